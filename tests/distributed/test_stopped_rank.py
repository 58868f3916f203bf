"""A rank that stops answering ends the job within ``trainer.collective_timeout_s``, not in Megatron's or torch's
own 10-30 minutes: a real 2-rank ``hybridrl train`` under torchrun, rank 1 frozen with SIGSTOP mid-training.

Also the unit rung: every process group a run makes (the default one, Megatron's, the rollout replica groups)
carries the configured timeout.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.multirank import free_port, run_ranks

TIMEOUT_S = 12


def _group_timeouts(rank: int, world: int) -> dict[str, list[float]]:
    import torch
    from torch.distributed import distributed_c10d as c10d

    from hybridrl.distributed import ParallelLayout, init_model_parallel
    from hybridrl.distributed.env import apply_collective_timeout

    def seconds(groups) -> list[float]:
        return sorted({g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in groups})

    # the default group of run_ranks has timeout_s (init_distributed); Megatron's and the replica groups follow it
    init_model_parallel(ParallelLayout.from_world(world, tp=2, rollout_tp=2), seed=0)  # + the replica groups
    made = seconds(c10d._world.pg_map)
    library = torch.distributed.new_group([0, 1])  # a group made without a timeout (as a library might)
    before = seconds([library])
    apply_collective_timeout()
    return {"made": made, "library_before": before, "after": seconds(c10d._world.pg_map)}


@pytest.mark.multirank
def test_every_group_gets_the_collective_timeout():
    out = run_ranks(_group_timeouts, 2, timeout=90.0)  # the default group's timeout, as init_distributed sets it
    for rank in out:
        assert rank["made"] == [90.0], rank  # Megatron's own default would be 600 s (1800 s for a few groups)
        assert rank["library_before"] == [1800.0]  # torch's default for a group made without a timeout
        assert rank["after"] == [90.0]


def _ranks(launcher: subprocess.Popen, world: int, deadline: float) -> dict[int, int]:
    """rank -> pid of torchrun's worker processes (from their RANK variable)."""
    import psutil

    while time.monotonic() < deadline and launcher.poll() is None:
        found = {}
        for child in psutil.Process(launcher.pid).children(recursive=True):
            try:
                rank = child.environ().get("RANK")
            except psutil.Error:
                continue
            if rank is not None and "train" in child.cmdline():
                found[int(rank)] = child.pid
        if len(found) == world:
            return found
        time.sleep(0.5)
    raise AssertionError(f"torchrun's workers did not start (torchrun exit status {launcher.poll()})")


@pytest.mark.multirank
def test_sigstopped_rank_ends_the_job_within_the_timeout(tmp_path):
    """Rank 1 of a real 2-rank ``hybridrl train`` (TP 2) freezes (SIGSTOP) before the actor update of step 2, so
    rank 0 waits in a Megatron tensor-parallel all-reduce: it exits within the timeout + a few seconds (the
    funnel waits up to 3 s for other ranks to check in), printing one line that names rank 1; nothing hangs (the
    test then kills the frozen rank itself, and torchrun returns)."""
    import psutil

    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    env.update(OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               HYBRIDRL_DEMO_WARMUP_STEPS="2", HYBRIDRL_TEST_STOP_AT_STEP="2")  # fmt: skip
    overrides = ["trainer.total_steps=4", f"trainer.collective_timeout_s={TIMEOUT_S}", "trainer.test_freq=-1",
                 "trainer.loggers=[console]", f"trainer.default_local_dir={tmp_path}", "data.train_batch_size=8",
                 "rollout.n=2", "actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size_per_gpu=8"]  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "tests.distributed.stop_rank", "train", "tiny_cpu_grpo.yaml", *overrides]  # fmt: skip
    out = tmp_path / "console.txt"
    with out.open("w") as sink:
        launcher = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, text=True, env=env)
        ranks: dict[int, int] = {}
        try:
            ranks = _ranks(launcher, 2, time.monotonic() + 300)
            deadline = time.monotonic() + 600
            while psutil.Process(ranks[1]).status() != psutil.STATUS_STOPPED:
                assert time.monotonic() < deadline and launcher.poll() is None, out.read_text()[-3000:]
                time.sleep(0.2)
            stopped = time.monotonic()
            try:
                psutil.Process(ranks[0]).wait(timeout=TIMEOUT_S + 60)
            except psutil.TimeoutExpired:
                raise AssertionError(f"rank 0 still runs {TIMEOUT_S + 60} s after rank 1 stopped") from None
            took = time.monotonic() - stopped
        finally:
            for pid in ranks.values():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            launcher.wait(timeout=60)
    lines = out.read_text().splitlines()
    message = [line for line in lines if "stopped answering" in line]
    print(f"rank 0 exited {took:.1f} s after rank 1 was stopped; {len(lines)} lines; {message}")
    assert len(message) == 1 and message[0].startswith(
        f"distributed error: rank 1 stopped answering: a collective got no reply within "
        f"trainer.collective_timeout_s={TIMEOUT_S}s ("
    ), "\n".join(lines[-30:])
    assert not any(line.strip().startswith("File ") and "hybridrl/" in line for line in lines), "a rank's traceback"
    assert TIMEOUT_S - 1 < took < TIMEOUT_S + 10, f"rank 0 exited {took:.1f} s after rank 1 stopped"
