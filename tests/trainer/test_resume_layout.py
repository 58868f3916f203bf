"""Resume under a different training layout through the real trainer (2 CPU ranks).

Run 1 trains 2 steps at TP 2 and checkpoints; run 2 resumes it at TP 1 x DP 2. The weights load exactly
under the new layout: run 2's greedy validation of the resumed weights equals run 1's validation at step 2
(same prompts, greedy, so any weight difference that changes a token changes the reward); the optimizer
moments restart with the documented warning; the resumed run trains on (finite losses).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.multirank


def _launch(out: Path, *overrides: str) -> str:
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "hybridrl", "train", "tiny_cpu.yaml"]
    cmd += ["trainer.n_gpus_per_node=2", "trainer.loggers=[jsonl]", "trainer.test_freq=2", "trainer.save_freq=1"]
    cmd += [f"trainer.default_local_dir={out}", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-4000:]
    return log


def test_resume_at_tp1_dp2_from_a_tp2_checkpoint(tmp_path):
    out = tmp_path / "run"
    _launch(out, "trainer.total_steps=2")
    first = [json.loads(x) for x in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    log = _launch(out, "trainer.total_steps=3", "actor.megatron.tp_size=1", "trainer.resume_mode=auto")
    assert "resumed from" in log and "(step 2)" in log
    assert "optimizer state in" in log and "Adam moments restart from zero" in log  # the documented warning
    every = [json.loads(x) for x in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    resumed = every[len(first) :]
    assert resumed[0]["step"] == 2 and set(resumed[0]) >= {"val/reward/mean"}  # validation of the loaded weights
    val_at_2 = next(h["val/reward/mean"] for h in first if h["step"] == 2)
    assert resumed[0]["val/reward/mean"] == val_at_2
    assert resumed[-1]["step"] == 3 and math.isfinite(resumed[-1]["actor/loss"])
