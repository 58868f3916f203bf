"""The command line: validate-config prints the resolved config and the run's layout; errors are one line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hybridrl.cli import main


def test_validate_config_layouts(capsys):
    assert main(["validate-config", "ppo_llama3_70b_multinode.yaml", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "# world size 32 = 4 node(s) x 8 process(es)" in out
    assert "train   tp=8 pp=4 dp=1 vpp=2 (world 32), shared by actor, ref, critic" in out
    assert "pp peers: [0,8,16,24] [1,9,17,25]" in out
    assert "rollout vllm tp=8 replicas=4" in out
    assert "engines: [0,1,2,3,4,5,6,7] [8,9,10,11,12,13,14,15]" in out
    assert "replica groups: [0,8,16,24] [1,9,17,25]" in out
    # sbatch --nodes=8 (slurm_ppo.sh passes trainer.nnodes=8): no per-node list pinned to 4 nodes in the way
    assert main(["validate-config", "ppo_llama3_70b_multinode.yaml", "trainer.nnodes=8", "--quiet"]) == 0
    assert "train   tp=8 pp=4 dp=2 vpp=2 (world 64)" in capsys.readouterr().out


def test_validate_config_resolves_and_overrides(capsys):
    assert main(["validate-config", "tiny_cpu.yaml", "actor.megatron.tp_size=1"]) == 0
    out = capsys.readouterr().out
    assert "tp_size: 1" in out and "dp_size: 2" in out  # resolved YAML shows the derived dp
    assert "train   tp=1 pp=1 dp=2 (world 2)" in out


def test_validate_config_warns_of_missing_data_files(capsys, tmp_path):
    present = tmp_path / "train.jsonl"
    present.write_text('{"prompt": "1+1"}\n')
    missing = tmp_path / "nope.parquet"
    args = ["validate-config", "tiny_cpu.yaml", "--quiet", "data.demo_task=false", f"model.path={tmp_path}"]
    files = [f"data.train_files=[{present}]", f"data.val_files=[{present},{missing}]"]
    assert main([*args, *files]) == 0  # a warning: the run's machine may see other files
    out = capsys.readouterr().out
    assert f"# note: on this machine, data file '{missing}' does not exist; check data.train_files" in out
    assert out.count("# note: on this machine") == 1
    assert main([*args, f"data.train_files=[{tmp_path}]"]) == 0  # a folder: named as one, as the run would
    assert f"# note: on this machine, data file '{tmp_path}' is a folder; list its" in capsys.readouterr().out
    assert main(["validate-config", "tiny_cpu.yaml", "--quiet"]) == 0  # the demo task makes its own data
    assert "# note: on this machine" not in capsys.readouterr().out


def test_validate_config_error_is_one_line(capsys):
    assert main(["validate-config", "tiny_cpu.yaml", "actor.megatron.tp_szie=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "did you mean 'actor.megatron.tp_size'" in err


def test_validate_config_get_prints_one_resolved_value(capsys):
    """--get KEY (what launch/torchrun.sh reads NPROC with): the value after overrides and derivation only."""
    assert (
        main(["validate-config", "tiny_cpu.yaml", "trainer.n_gpus_per_node=4", "--get", "trainer.n_gpus_per_node"]) == 0
    )
    assert capsys.readouterr().out == "4\n"
    assert main(["validate-config", "tiny_cpu.yaml", "--get", "actor.megatron.dp_size"]) == 0  # derived: 2 / tp 2
    assert main(["validate-config", "tiny_cpu.yaml", "--get", "trainer.loggers"]) == 0
    assert capsys.readouterr().out == "1\n[console, jsonl]\n"
    assert main(["validate-config", "tiny_cpu.yaml", "--get", "trainer.n_gpus"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "did you mean 'trainer.n_gpus_per_node'" in err


def test_train_config_error_is_one_line():
    """A rank of ``hybridrl train`` whose config fails its checks prints one line and exits 2, no traceback:
    tiny_cpu.yaml wants 2 ranks, this launch is 1 (RANK / WORLD_SIZE as torchrun sets them)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    cmd = [sys.executable, "-m", "hybridrl", "train", "tiny_cpu.yaml"]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stdout == ""
    err = result.stderr.strip()
    assert err.count("\n") == 0, err
    assert err.startswith(
        "config error: world_size (1) of the launch != trainer.nnodes (1) * trainer.n_gpus_per_node (2)"
    )
    env.update(RANK="3", WORLD_SIZE="2")  # a launch environment that cannot be: one line too
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 2 and result.stderr.strip() == (
        "launch error: rank (3) must lie in [0, world_size=2); check RANK/SLURM_PROCID"
    ), result.stderr[-2000:]


@pytest.mark.parametrize(
    ("error", "printed"),
    [
        ("hybridrl.data.files:DataError", "data error: t.parquet: row 3: column 'prompt' is an empty string"),
        (
            "hybridrl.trainer.checkpoint:ResumeError",
            "checkpoint error: t.parquet: row 3: column 'prompt' is an empty string",
        ),
        ("hybridrl.mcore.hf_config:HFConfigError", "model error: t.parquet: row 3: column 'prompt' is an empty string"),
        ("hybridrl.rewards.manager:ScorerError", "reward error: t.parquet: row 3: column 'prompt' is an empty string"),
        ("hybridrl.distributed.env:LaunchError", "launch error: t.parquet: row 3: column 'prompt' is an empty string"),
        ("hybridrl.errors:InputError", "input error: t.parquet: row 3: column 'prompt' is an empty string"),
        ("builtins:RuntimeError", None),  # not bad input: a bug keeps its traceback
        ("builtins:ValueError", None),
    ],
)
def test_train_prints_bad_input_errors_in_one_line(monkeypatch, capsys, error, printed):
    import importlib

    import hybridrl.trainer.main

    module, name = error.split(":")
    cls = getattr(importlib.import_module(module), name)

    def fail(config, overrides):
        raise cls("t.parquet: row 3: column 'prompt' is an empty string")

    monkeypatch.setattr(hybridrl.trainer.main, "train", fail)
    if printed is None:
        with pytest.raises(cls):
            main(["train", "tiny_cpu.yaml"])
        return
    assert main(["train", "tiny_cpu.yaml"]) == 2
    assert capsys.readouterr().err == printed + "\n"


def test_python_dash_m_entry():
    result = subprocess.run([sys.executable, "-m", "hybridrl", "--version"], capture_output=True, text=True)
    import hybridrl

    assert result.returncode == 0 and result.stdout.strip() == hybridrl.__version__
    result = subprocess.run([sys.executable, "-m", "hybridrl", "frobnicate"], capture_output=True, text=True)
    assert result.returncode == 2 and "unknown command 'frobnicate'" in result.stderr


def test_memory_estimate_is_printed(capsys):
    """validate-config ends with the estimate (its numbers: tests/config/test_memory.py)."""
    assert main(["validate-config", "ppo_llama3_70b_multinode.yaml", "--quiet", "--device-gib", "80"]) == 0
    out = capsys.readouterr().out
    assert "memory per rank in GiB, GPU with 80 GiB; model 70.55B params" in out and "critic weights" in out


def test_total_steps_from_epochs():
    from hybridrl.config import load_config
    from hybridrl.trainer.main import resolve_total_steps

    cfg = load_config("ppo_llama2_7b.yaml")  # total_epochs 15, total_steps null
    assert cfg.trainer.total_steps is None
    assert resolve_total_steps(cfg, 10 * cfg.data.train_batch_size + 3) == 15 * 10
    cfg = load_config("tiny_cpu.yaml")  # an explicit total_steps wins
    assert resolve_total_steps(cfg, 10_000) == cfg.trainer.total_steps


def test_model_paths_resolve_folders_and_explain_hub_failures(tmp_path, monkeypatch):
    """A local folder is used as is; a path that is neither a folder nor a hub name, and a hub name that cannot
    be downloaded (offline here), fail in one line naming the key and the fix."""
    from hybridrl.trainer.main import resolve_checkpoint
    from hybridrl.trainer.preflight import ModelPathError

    assert resolve_checkpoint(str(tmp_path), "model.path") == str(tmp_path)
    sp = tmp_path / "tokenizer.model"
    sp.write_bytes(b"")
    assert resolve_checkpoint(str(sp), "model.tokenizer_path", files=True) == str(sp)  # a sentencepiece file
    with pytest.raises(FileNotFoundError, match="is a file, not a folder"):
        resolve_checkpoint(str(sp), "model.path")
    with pytest.raises(FileNotFoundError, match=r"^model.path \('\./nope'\) is not a folder; set it to a local"):
        resolve_checkpoint("./nope", "model.path")
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read at call time: no network tried
    with pytest.raises(ModelPathError) as failed:
        resolve_checkpoint("hybridrl-tests/no-such-model", "critic.model_path")
    message = str(failed.value)
    assert "\n" not in message and message.startswith(
        "critic.model_path ('hybridrl-tests/no-such-model') is not a local folder and downloading it from"
    )
    assert message.endswith(
        "(huggingface-cli download hybridrl-tests/no-such-model --local-dir DIR) and set critic.model_path=DIR"
    )


def _hub_body(rank: int, world: int, local_ranks: list[int], cache: str, fail_on: int) -> dict:
    import os

    import huggingface_hub

    os.environ["LOCAL_RANK"] = str(local_ranks[rank])
    online = []

    def fake_download(repo_id, allow_patterns, local_files_only):  # records who went online
        if not local_files_only:
            online.append(rank)
            if rank == fail_on:
                raise OSError("disk full\nmore")
        return os.path.join(cache, repo_id)

    huggingface_hub.snapshot_download = fake_download
    from hybridrl.trainer.main import resolve_checkpoint

    try:
        return {"path": resolve_checkpoint("org/model", "model.path"), "online": online}
    except FileNotFoundError as e:  # ModelPathError
        return {"error": str(e), "online": online}


def _split_view_body(rank: int, world: int, folder: str) -> str:
    import os

    real = os.path.isdir
    os.path.isdir = lambda p: real(p) and rank == 0  # a node-local folder: present on rank 0's node only
    from hybridrl.trainer.main import resolve_checkpoint

    try:
        return resolve_checkpoint(folder, "model.path")
    except FileNotFoundError as e:
        return str(e)


@pytest.mark.multirank
def test_folder_on_some_nodes_only_fails_on_every_rank(tmp_path):
    """Ranks that disagree about a folder fail together in one line (some would otherwise wait in the download's
    collective while the others went on)."""
    from tests.multirank import run_ranks

    out = run_ranks(_split_view_body, 2, str(tmp_path))
    assert out == [f"model.path ({str(tmp_path)!r}) is a folder on some nodes only (missing on ranks [1]); put it on "
                   "a filesystem every node sees"] * 2  # fmt: skip


@pytest.mark.multirank
def test_hub_checkpoints_download_once_per_node(tmp_path):
    """Local rank 0 of each node downloads, the others read the cache; a failure on any node fails every rank."""
    from tests.multirank import run_ranks

    one_node = run_ranks(_hub_body, 2, [0, 1], str(tmp_path), -1)
    assert [r["online"] for r in one_node] == [[0], []]
    assert [r["path"] for r in one_node] == [str(tmp_path / "org/model")] * 2
    two_nodes = run_ranks(_hub_body, 2, [0, 0], str(tmp_path), 1)
    assert [r["online"] for r in two_nodes] == [[0], [1]]
    for r in two_nodes:
        assert r["error"].startswith("model.path ('org/model') is not a local folder and downloading it from the "
                                     "Hugging Face Hub failed (OSError: disk full); download it first")  # fmt: skip


def test_architecture_overrides_make_a_linked_model_folder(tmp_path):
    """model.architecture fields next to model.path override its config.json: a new folder with the edited
    config and links to the same weights; nothing to override gives the checkpoint folder itself."""
    import json

    from safetensors.torch import load_file

    from hybridrl.config.schema import ArchitectureConfig
    from hybridrl.mcore import hf_config
    from hybridrl.trainer.main import apply_architecture_overrides
    from tests.mcore import hf_tiny

    path = hf_tiny.make_checkpoint("llama", str(tmp_path / "ckpt"), seed=0)
    original = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    theta = original["rope_parameters"]["rope_theta"]  # transformers 5 layout
    same = ArchitectureConfig(rope_theta=theta, model_type="llama", max_position_embeddings=16384)
    assert apply_architecture_overrides(same, path, str(tmp_path / "out")) == path
    wanted = ArchitectureConfig(rope_theta=12345.0, max_position_embeddings=4096)
    out = apply_architecture_overrides(wanted, path, str(tmp_path / "out"))
    edited = json.loads((tmp_path / "out" / "config.json").read_text())
    rope = {**original["rope_parameters"], "rope_theta": 12345.0}
    assert out == str(tmp_path / "out") and edited == {
        **original,
        "max_position_embeddings": 4096,
        "rope_parameters": rope,
    }
    hf = hf_config.load_hf_config(out)  # what every role and the vLLM engine read
    assert hf.max_position_embeddings == 4096 and hf_config._rope(hf)[0] == 12345.0
    weights = sorted(p.name for p in (tmp_path / "ckpt").glob("*.safetensors"))
    assert weights and all((tmp_path / "out" / w).is_symlink() for w in weights)
    for w in weights:
        a, b = load_file(tmp_path / "ckpt" / w), load_file(tmp_path / "out" / w)
        assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def test_train_help_is_usage_and_success():
    done = subprocess.run([sys.executable, "-m", "hybridrl", "train", "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.startswith("usage: hybridrl train CONFIG [key=value ...]")
    bare = subprocess.run([sys.executable, "-m", "hybridrl", "train"], capture_output=True, text=True)
    assert bare.returncode == 2 and bare.stderr.startswith("usage: hybridrl train")


def test_export_of_a_run_folder_names_its_newest_checkpoint(tmp_path):
    """Exporting the run folder instead of one of its global_step_N folders: one line pointing at the newest."""
    for step in (2, 10):
        (tmp_path / f"global_step_{step}").mkdir()
        (tmp_path / f"global_step_{step}" / "meta.json").write_text("{}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    cmd = [sys.executable, "-m", "hybridrl", "export", str(tmp_path), str(tmp_path / "out")]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip() == (  # Megatron's import warnings are known harmless: filtered
        f"model error: {tmp_path}/actor/model not found; pass a global_step_N folder holding the actor; it holds "
        f"checkpoints: the newest is {tmp_path}/global_step_10"
    )


def _funnel_body(rank: int, world: int) -> list[str]:
    import contextlib
    import io

    import torch.distributed as dist

    from hybridrl.data.files import DataError
    from hybridrl.errors import report_input_error

    printed = []
    for same in (True, False):  # every rank met the same bad input / rank 1 met its own
        message = "t.parquet: row 3: column 'prompt' is an empty string" if same or rank == 0 else "u.parquet: no rows"
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            assert report_input_error(DataError(message)) == 2
        printed.append(err.getvalue())
        dist.barrier()
        store = dist.distributed_c10d._get_default_store()
        store.delete_key(f"hybridrl/input_error/{rank}")
        dist.barrier()
    return printed


@pytest.mark.multirank
def test_input_error_is_printed_once_per_job():
    """Rank 0 prints; a rank whose error is rank 0's stays silent, one with its own error says so with its rank."""
    from tests.multirank import run_ranks

    rank0, rank1 = run_ranks(_funnel_body, 2)
    line = "data error: t.parquet: row 3: column 'prompt' is an empty string\n"
    assert rank0 == [line, line]
    assert rank1 == ["", "[rank 1] data error: u.parquet: no rows\n"]
