"""Failure handling under a real torchrun launch on 2 CPU ranks.

- NaN/Inf: every actor loss is poisoned, through the public extension point (a custom policy-loss file selected
  by actor.policy_loss, returning NaN): each update is skipped with a warning and the weights stay as they
  were; after trainer.max_bad_steps in a row the run saves a checkpoint and stops with a one-line error. A resume
  from a checkpoint two bad steps in stops after one more: the count is part of the trainer's state.
- A rank dies (SIGKILL in the middle of a step, from the custom scorer ``crash_scorer.py`` on rank 1): the
  launch ends (no hang) with a non-zero exit that names the dead rank; the subprocess timeout bounds the wait.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.multirank


def _launch(out: Path, env_extra: dict[str, str], *overrides: str) -> subprocess.CompletedProcess:
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "hybridrl", "train", "tiny_cpu.yaml"]
    cmd += ["trainer.n_gpus_per_node=2", "trainer.test_freq=-1", "trainer.loggers=[jsonl]"]
    cmd += [f"trainer.default_local_dir={out}", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env_extra}
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)


NAN_LOSS = """
import torch


def compute_policy_loss(log_prob, old_log_prob, advantages, response_mask, **options):
    loss = torch.full_like(log_prob, float("nan")) * log_prob  # NaN, and still on the graph
    return torch.where(response_mask.bool(), loss, torch.zeros_like(loss)), {}
"""


def test_nan_steps_are_skipped_then_stop_with_checkpoint(tmp_path):
    out = tmp_path / "run"
    loss_file = tmp_path / "nan_loss.py"
    loss_file.write_text(NAN_LOSS)
    result = _launch(out, {}, "trainer.total_steps=5", "trainer.max_bad_steps=3", "trainer.save_freq=2",
                     "actor.policy_loss.loss_mode=custom", f"actor.policy_loss.path={loss_file}")  # fmt: skip
    log = result.stdout + result.stderr
    assert result.returncode != 0, log[-3000:]
    assert "trainer.max_bad_steps (3) consecutive steps had NaN/Inf losses or grad norms; stopped at step 3" in log
    assert "step 1 skipped its update (NaN/Inf loss or grad norm); 1/3 in a row" in log
    assert (out / "global_step_3" / "meta.json").exists()  # the checkpoint written on the way out
    # the regular save of step 2 holds step 2's count: a resume from it stops after 1 more bad step, not 2
    saved = {n: json.loads((out / f"global_step_{n}" / "trainer_state.json").read_text())["bad_steps"] for n in (2, 3)}
    assert saved == {2: 2, 3: 3}
    steps = [json.loads(x) for x in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert all(s["actor/skipped"] == 1.0 for s in steps)
    assert steps[0]["actor/param_norm"] == steps[2]["actor/param_norm"]  # no poisoned update was applied

    again = _launch(out, {}, "trainer.total_steps=5", "trainer.max_bad_steps=3", "trainer.save_freq=2",
                    "actor.policy_loss.loss_mode=custom", f"actor.policy_loss.path={loss_file}",
                    "trainer.resume_mode=path", f"trainer.resume_from_path={out / 'global_step_2'}")  # fmt: skip
    log = again.stdout + again.stderr
    assert again.returncode != 0, log[-3000:]
    assert "step 3 skipped its update (NaN/Inf loss or grad norm); 3/3 in a row" in log  # the count went on
    assert "consecutive steps had NaN/Inf losses or grad norms; stopped at step 3" in log


def test_dead_rank_ends_the_launch(tmp_path):
    scorer = Path(__file__).with_name("crash_scorer.py")
    result = _launch(tmp_path / "run", {"CRASH_SCORER_AT_CALL": "1"}, "trainer.total_steps=3",
                     f"reward.custom.path={scorer}")  # fmt: skip
    log = result.stdout + result.stderr
    assert result.returncode != 0
    assert "Signal 9 (SIGKILL) received by PID" in log or "exitcode  : -9" in log, log[-3000:]
