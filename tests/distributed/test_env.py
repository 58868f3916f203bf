"""Launch environment detection (torchrun, srun) and the 1-rank and multi-rank gloo rungs."""

from __future__ import annotations

import socket

import pytest

from hybridrl.distributed import LaunchError, detect_env, expand_nodelist
from tests.multirank import run_ranks


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node1", ["node1"]),
        ("gpu[01-03]", ["gpu01", "gpu02", "gpu03"]),
        ("gpu[01-02,07],login1", ["gpu01", "gpu02", "gpu07", "login1"]),
        ("rack[1-2]-n[8-9]", ["rack1-n8", "rack1-n9", "rack2-n8", "rack2-n9"]),
        ("a[9-11]", ["a9", "a10", "a11"]),
    ],
)
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


def test_torchrun_env():
    env = detect_env(
        {
            "RANK": "5",
            "WORLD_SIZE": "16",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "4",
            "MASTER_ADDR": "n0",
            "MASTER_PORT": "1234",
        }
    )
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (5, 16, 1, 4)
    assert (env.master_addr, env.master_port, env.launcher) == ("n0", 1234, "torchrun")


def test_local_rank_without_local_rank_variable():
    """A launcher that sets only RANK / WORLD_SIZE / LOCAL_WORLD_SIZE: rank 9 of 4-rank nodes is local rank 1 (was 9:
    set_device(9) on an 8-GPU node)."""
    env = detect_env({"RANK": "9", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "4"})
    assert (env.local_rank, env.local_world_size) == (1, 4)
    assert detect_env({"RANK": "1", "WORLD_SIZE": "2"}).local_rank == 1  # one node


def test_slurm_env_uses_first_node_of_job():
    env = detect_env(
        {
            "SLURM_PROCID": "9",
            "SLURM_NTASKS": "16",
            "SLURM_LOCALID": "1",
            "SLURM_JOB_NODELIST": "gpu[03-06]",
            "SLURM_NTASKS_PER_NODE": "4(x4)",
            "SLURM_NNODES": "4",
        }
    )
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (9, 16, 1, 4)
    assert env.master_addr == "gpu03" and env.launcher == "slurm" and env.master_port == 29500


def test_torchrun_wins_over_slurm():
    env = detect_env({"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "7", "SLURM_NTASKS": "8"})
    assert env.launcher == "torchrun" and env.world_size == 2


def test_single_process_default():
    env = detect_env({})
    assert (env.rank, env.world_size, env.launcher) == (0, 1, "single")
    # a port the OS hands out as free (its ephemeral range), not torchrun's 29500 that a second single run or a
    # torchrun job on the machine would already hold; MASTER_PORT still wins
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        assert detect_env({}).master_port not in (29500, held.getsockname()[1])
    assert detect_env({"MASTER_PORT": "31000"}).master_port == 31000


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
        ({"RANK": "4", "WORLD_SIZE": "2"}, "rank (4) must lie in [0, world_size=2)"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": ""}, "SLURM_JOB_NODELIST is empty"),
    ],
)
def test_bad_env(environ, message):
    with pytest.raises(LaunchError) as err:
        detect_env(environ)
    assert message in str(err.value)


def _groups_body(rank, world_size):
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from hybridrl.distributed import ParallelLayout, init_model_parallel
    from hybridrl.mcore import cpu_compat

    layout = ParallelLayout.from_world(world_size, tp=2, pp=2)
    init_model_parallel(layout)
    groups = {
        "tp": dist.get_process_group_ranks(mpu.get_tensor_model_parallel_group()),
        "pp": dist.get_process_group_ranks(mpu.get_pipeline_model_parallel_group()),
        "dp": dist.get_process_group_ranks(mpu.get_data_parallel_group()),
    }
    expected = {axis: layout.group_of(axis, rank) for axis in groups}
    backend, shims = dist.get_backend(), cpu_compat.is_applied()
    # the end of every launched command: all groups down (Megatron's too), and a second call is a no-op
    from torch.distributed import distributed_c10d as c10d

    from hybridrl.distributed import end_distributed

    hooks_saw = []  # the exit hooks (vLLM's engine shutdown) run while the groups are still up
    end_distributed(exit_hooks=lambda: hooks_saw.append(len(c10d._world.pg_map)))
    end_distributed()
    ended = (dist.is_initialized(), len(c10d._world.pg_map), len(hooks_saw), hooks_saw[0] > 1)
    return {"groups": groups, "expected": expected, "backend": backend, "shims": shims, "ended": ended}


@pytest.mark.multirank
def test_megatron_groups_on_four_gloo_ranks():
    results = run_ranks(_groups_body, 4, timeout=300)
    for rank, r in enumerate(results):
        assert r["backend"] == "gloo" and r["shims"], rank
        assert {k: sorted(v) for k, v in r["groups"].items()} == r["expected"], rank
        assert r["ended"] == (False, 0, 1, True), rank


def _single_body(rank, world_size):
    import torch
    import torch.distributed as dist

    t = torch.tensor([3.0])
    dist.all_reduce(t)
    return (dist.get_world_size(), t.item())


@pytest.mark.multirank
def test_single_rank_gloo():
    assert run_ranks(_single_body, 1) == [(1, 3.0)]


def test_srun_launch_exports_torchrun_variables():
    """A plain srun launch (no torchrun) gets RANK / LOCAL_RANK / WORLD_SIZE / MASTER_* exported: vLLM's
    external_launcher executor reads them from the environment."""
    import os
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    env.update(SLURM_PROCID="0", SLURM_NTASKS="1", SLURM_LOCALID="0", SLURM_JOB_NODELIST="localhost",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    code = (
        "import os; from hybridrl.distributed import init_distributed; init_distributed('gloo'); "
        "print(*(os.environ[k] for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT')))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "0", "1", "127.0.0.1", str(port)]


def test_more_local_ranks_than_gpus_is_one_line(monkeypatch):
    """NCCL with a local rank beyond the node's GPUs (a config's n_gpus_per_node on a smaller node): a LaunchError
    naming the counts, not CUDA's 'invalid device ordinal'. This machine has no GPU, so local rank 0 is one too many."""
    import torch

    from hybridrl.distributed import init_distributed
    from hybridrl.distributed.env import LaunchError

    if torch.cuda.is_available():
        pytest.skip("needs a machine with fewer GPUs than local rank 0 + 1, i.e. none")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(LaunchError, match=r"^local rank 0 but this node has 0 GPU\(s\); launch at most 0"):
        init_distributed("nccl")
