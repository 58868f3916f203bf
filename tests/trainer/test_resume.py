"""Exact resume after a crash, on 2 CPU ranks through 'hybridrl train' (PPO: actor, critic, reference, vLLM).

Three launches of tiny_cpu.yaml with a checkpoint after every step: an uninterrupted 3-step reference; a run
whose rank 1 SIGKILLs itself in the middle of step 3 (``HYBRIDRL_TEST_KILL_AT_STEP``, after the critic
update); and its relaunch with ``resume_mode=auto``, which must continue from ``global_step_2`` and log
step-3 losses and grad norms equal to the reference's (1e-6). Also: a ``.tmp`` folder left by a crash
during a save is ignored (and removed once a newer checkpoint completes), and ``max_ckpt_to_keep=1`` keeps only
the newest checkpoint.
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


def _train(out: Path, *overrides: str, env: dict | None = None) -> subprocess.CompletedProcess:
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "hybridrl", "train", "tiny_cpu.yaml"]
    cmd += ["trainer.n_gpus_per_node=2", "trainer.loggers=[jsonl]", "trainer.test_freq=-1", "trainer.save_freq=1"]
    cmd += ["trainer.total_steps=3", "trainer.resume_mode=auto", f"trainer.default_local_dir={out}", *overrides]
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


def _metrics(out: Path) -> dict[int, dict]:
    lines = (out / "logs" / "metrics.jsonl").read_text().splitlines()
    return {h["step"]: h for h in map(json.loads, lines)}


def _steps(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.name.startswith("global_step"))


def test_resume_after_kill_is_exact(tmp_path):
    ref, run = tmp_path / "ref", tmp_path / "run"
    done = _train(ref)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert _steps(ref) == ["global_step_1", "global_step_2", "global_step_3"]

    killed = _train(run, "trainer.max_ckpt_to_keep=1", env={"HYBRIDRL_TEST_KILL_AT_STEP": "3"})
    assert killed.returncode != 0
    assert _steps(run) == ["global_step_2"]  # keep-last-1 removed step 1; step 3 never completed
    assert sorted(_metrics(run)) == [1, 2]
    (run / "global_step_7.tmp" / "actor").mkdir(parents=True)  # a save that crashed half-way: ignored

    resumed = _train(run, "trainer.max_ckpt_to_keep=1")
    assert resumed.returncode == 0, (resumed.stdout)[-4000:]
    assert f"resumed from {run / 'global_step_2'} (step 2)" in resumed.stdout
    assert _steps(run) == ["global_step_3"]  # the crashed half-save went once a newer checkpoint completed
    expected, got = _metrics(ref), _metrics(run)
    for step in (1, 2, 3):
        for key in KEYS:
            assert abs(got[step][key] - expected[step][key]) <= 1e-6, (step, key, got[step][key], expected[step][key])
