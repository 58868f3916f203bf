"""The agent demo as a user runs it: ``CONFIG=tiny_cpu_agent.yaml bash launch/quickstart.sh`` (the config checked
by ``hybridrl validate-config`` first, then ``hybridrl train`` on 2 CPU ranks with the calculator environment, the
demo model made on the spot and warmed up on tool-use traces).

- every run: the first step of the config as shipped (smaller batches, a short warm-up) logs the agent metrics and
  the actor's log-probs equal vLLM's on policy tokens;
- slow (~3 min on 2 cores): with the shipped warm-up, 5 GRPO steps turn a policy that calls the calculator on a
  minority of its trajectories into one that calls it on nearly all, and the greedy validation reward rises from
  near 0 to most prompts right.
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


def _quickstart(run_dir: Path, *overrides: str, warmup: str | None = None) -> dict[int, dict]:
    """The quickstart on the agent config; the metrics of each step (step 0: validation before training)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "HYBRIDRL_DEMO_WARMUP_STEPS")}
    env.update(CONFIG="tiny_cpu_agent.yaml", RUN_DIR=str(run_dir), HYBRIDRL_VENV=str(Path(sys.executable).parents[1]),
               HYBRIDRL_BOOTSTRAP="0")  # fmt: skip
    if warmup is not None:
        env["HYBRIDRL_DEMO_WARMUP_STEPS"] = warmup
    cmd = ["bash", str(ROOT / "launch" / "quickstart.sh"), "trainer.loggers=[jsonl]", *overrides]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=1200)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    rows = [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    history: dict[int, dict] = {}
    for r in rows:  # validation at step s is its own row: merge it into the step's
        history.setdefault(r["step"], {}).update(r)
    return history


def _check_steps(history: dict[int, dict], steps: int) -> None:
    for step in range(1, steps + 1):
        h = history[step]
        for key in ("reward/mean", "agent/tool_calls_mean", "agent/tool_failure_rate", "agent/turns_mean"):
            assert isinstance(h[key], float) and math.isfinite(h[key]), (step, key, h.get(key))
        assert h["rollout/logprob_mismatch"] <= 1e-4, (step, h["rollout/logprob_mismatch"])


def test_demo_config_first_step_runs(tmp_path):
    small = ("trainer.total_steps=1", "trainer.test_freq=-1", "data.train_batch_size=4", "rollout.n=4",
             "actor.ppo_mini_batch_size=4")  # fmt: skip
    history = _quickstart(tmp_path / "run", *small, warmup="20")
    _check_steps(history, 1)
    assert history[1]["agent/end/done"] + history[1]["agent/end/budget"] + history[1]["agent/end/max_turns"] > 0


@pytest.mark.slow
def test_demo_learns_to_use_the_calculator(tmp_path):
    """Measured at seed 1: tool calls per trajectory 0.26 -> 0.99, greedy validation reward 0.125 -> 0.89 (step 5)."""
    history = _quickstart(tmp_path / "run", "trainer.total_steps=5", "trainer.test_freq=5")
    _check_steps(history, 5)
    first, last = history[1], history[5]
    print({s: {k: round(h[k], 3) for k in ("val/reward/mean", "reward/mean", "agent/tool_calls_mean") if k in h}
           for s, h in history.items()})  # fmt: skip
    assert first["agent/tool_calls_mean"] < 0.6 < 0.9 < last["agent/tool_calls_mean"]
    assert last["reward/mean"] > first["reward/mean"] + 0.3
    assert history[0]["val/reward/mean"] < 0.4 and last["val/reward/mean"] > 0.7
    assert last["agent/tool_failure_rate"] < 0.2
