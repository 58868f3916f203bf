"""Exact resume after a crash, on 2 CPU ranks through 'hybridrl train' (PPO: actor, critic, reference, vLLM).

Three launches of tiny_cpu.yaml with a checkpoint after every step, all scoring through the custom scorer
``tests/trainer/crash_scorer.py`` (the registry's scores): an uninterrupted 3-step reference; a run whose
rank 1 SIGKILLs itself in the middle of step 3 (the scorer's first call of the step); and its relaunch with
``resume_mode=auto`` after the newest checkpoint (``global_step_2``) had a shard cut in half on disk. The
relaunch must name the cut file in one line, fall back to ``global_step_1``, and log steps 2 and 3 with
losses and grad norms equal to the reference's (1e-6). Also: a ``.tmp`` folder left by a crash during a save
is ignored (and removed once a newer checkpoint completes), ``max_ckpt_to_keep=1`` keeps only the newest
checkpoint, and the metrics rows the relaunch logs again are kept in ``metrics.1.jsonl``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.multirank
KEYS = ("actor/loss", "critic/loss", "actor/grad_norm", "critic/grad_norm", "reward/mean")
SCORER = Path(__file__).with_name("crash_scorer.py")


def _train(out: Path, *overrides: str, env: dict | None = None) -> subprocess.CompletedProcess:
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "hybridrl", "train", "tiny_cpu.yaml"]
    cmd += ["trainer.n_gpus_per_node=2", "trainer.loggers=[jsonl]", "trainer.test_freq=-1", "trainer.save_freq=1"]
    cmd += ["trainer.total_steps=3", "trainer.resume_mode=auto", f"trainer.default_local_dir={out}"]
    cmd += [f"reward.custom.path={SCORER}", *overrides]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    # output to a file, not a pipe, and the launch in its own session: after a SIGKILL nothing it started
    # (a spawned helper) can keep the test waiting, and killpg ends whatever it left behind.
    with open(out.with_suffix(".log"), "w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=full_env, start_new_session=True
        )
        try:
            proc.wait(timeout=300)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(cmd, proc.returncode, out.with_suffix(".log").read_text(), "")


def _metrics(out: Path, name: str = "metrics.jsonl") -> dict[int, dict]:
    lines = (out / "logs" / name).read_text().splitlines()
    rows = [json.loads(x) for x in lines]
    assert len({r["step"] for r in rows}) == len(rows), f"{name}: a step logged twice"
    return {r["step"]: r for r in rows}


def _steps(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.name.startswith("global_step"))


def test_resume_after_kill_is_exact_and_skips_a_corrupt_newest(tmp_path):
    from hybridrl.config import load_config

    cfg = load_config("tiny_cpu.yaml")
    # each of tiny_cpu's 2 rollout replicas scores the responses it generated (reward.overlap_generation)
    first_call_of_step_3 = 2 * cfg.data.train_batch_size * cfg.rollout.n // 2 + 1
    ref, run = tmp_path / "ref", tmp_path / "run"
    done = _train(ref)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert _steps(ref) == ["global_step_1", "global_step_2", "global_step_3"]

    killed = _train(run, "trainer.max_ckpt_to_keep=2", env={"CRASH_SCORER_AT_CALL": str(first_call_of_step_3)})
    assert killed.returncode != 0
    assert _steps(run) == ["global_step_1", "global_step_2"]  # step 3 never completed
    assert sorted(_metrics(run)) == [1, 2]
    shard = run / "global_step_2" / "actor" / "model" / "__1_0.distcp"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:  # a shard cut short on disk
        f.truncate(size // 2)
    (run / "global_step_7.tmp" / "actor").mkdir(parents=True)  # a save that crashed half-way: ignored

    resumed = _train(run, "trainer.max_ckpt_to_keep=1")
    assert resumed.returncode == 0, (resumed.stdout)[-4000:]
    assert (f"checkpoint {run / 'global_step_2'} is corrupt: {shard} is {size // 2} bytes, {size} at save (cut short "
            f"or overwritten); falling back to {run / 'global_step_1'}") in resumed.stdout  # fmt: skip
    assert f"resumed from {run / 'global_step_1'} (step 1)" in resumed.stdout
    assert _steps(run) == ["global_step_3"]  # the crashed half-save went once a newer checkpoint completed
    expected, got = _metrics(ref), _metrics(run)
    assert sorted(got) == [1, 2, 3]
    for step in (1, 2, 3):
        for key in KEYS:
            assert abs(got[step][key] - expected[step][key]) <= 1e-6, (step, key, got[step][key], expected[step][key])
    assert sorted(_metrics(run, "metrics.1.jsonl")) == [1, 2]  # the killed run's rows, as they were
