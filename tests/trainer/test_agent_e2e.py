"""Multi-turn GRPO end to end on 2 CPU ranks through 'hybridrl train' (the entry point users run):
``configs/tiny_cpu_agent.yaml`` with the ``guess_number`` environment, whose every reply is an observation, so
every trajectory interleaves policy and observation tokens.

Checks: each step logs the agent metrics (turns > 1, observation tokens, end reasons); the actor's recomputed
log-probs equal vLLM's on policy tokens (``rollout/logprob_mismatch`` <= 1e-4, fp32, every step: step 2 runs on
updated weights) at training TP 2 (GRPO), at PP 2 (PPO with a critic) and with one vLLM engine over both ranks
(rollout TP 2, training TP 2 or DP 2); and a run stopped after step 2 and resumed reproduces step 3 of the
uninterrupted run (losses, grad norms, rewards, turns; 1e-6).
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
SCORER = Path(__file__).with_name("agent_scorer.py")
pytestmark = pytest.mark.multirank
SMALL = (
    "rollout.agent.env=guess_number", "rollout.agent.max_turns=3", "rollout.agent.max_tokens_per_turn=6",
    "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size_per_gpu=4",
    "data.max_prompt_length=48", "data.max_response_length=96", "trainer.test_freq=-1", "trainer.loggers=[jsonl]",
    "reward.scorer=auto", f"reward.custom.path={SCORER}",
)  # fmt: skip
KEYS = ("actor/loss", "actor/grad_norm", "reward/mean", "agent/turns_mean", "agent/observation_token_share")


def _train(out: Path, *overrides: str) -> dict[int, dict]:
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "hybridrl", "train", "tiny_cpu_agent.yaml"]
    cmd += [*SMALL, f"trainer.default_local_dir={out}", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYBRIDRL_DEMO_WARMUP_STEPS": "0"}
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    rows = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows}


def _check(history: dict[int, dict], steps: int) -> None:
    assert sorted(history) == list(range(1, steps + 1))
    for step, h in history.items():
        for key in (*KEYS, "agent/tool_calls_mean", "agent/end/max_turns", "agent/loop_s"):
            assert isinstance(h[key], float) and math.isfinite(h[key]), (step, key, h.get(key))
        assert h["agent/turns_mean"] > 1 and 0 < h["agent/observation_token_share"] < 1, h
        assert h["rollout/logprob_mismatch"] <= 1e-4, (step, h["rollout/logprob_mismatch"])
    assert history[1]["actor/param_norm"] != history[2]["actor/param_norm"]  # step 2 ran on updated weights


def test_tp2_run_and_resume_are_exact(tmp_path):
    ref = _train(tmp_path / "ref", "trainer.total_steps=3")
    _check(ref, 3)
    run = tmp_path / "run"
    _train(run, "trainer.total_steps=2", "trainer.save_freq=1")
    resumed = _train(run, "trainer.total_steps=3", "trainer.save_freq=1", "trainer.resume_mode=auto")
    assert sorted(resumed) == [1, 2, 3]  # steps 1-2 from the first launch's log, step 3 from the resumed one
    for key in KEYS:
        assert resumed[3][key] == pytest.approx(ref[3][key], abs=1e-6, rel=0), key


def test_ppo_at_pp2_log_probs_match_vllm(tmp_path):
    """PPO: the critic is valued on policy tokens (GAE carries over observation tokens, response_mask 0)."""
    history = _train(tmp_path / "pp", "trainer.total_steps=2", "actor.megatron.tp_size=1", "actor.megatron.pp_size=2",
                     "critic.enable=true", "algorithm.adv_estimator=gae")  # fmt: skip
    _check(history, 2)
    assert all(math.isfinite(h["critic/loss"]) and h["critic/grad_norm"] > 0 for h in history.values())


DP2 = ("actor.megatron.tp_size=1", "actor.ppo_micro_batch_size_per_gpu=2")  # 2 prompts x 2 samples per DP rank


@pytest.mark.parametrize("training", [("actor.megatron.tp_size=2",), DP2], ids=["tp2", "dp2"])
def test_rollout_tp2_log_probs_match_vllm(tmp_path, training):
    """One vLLM engine spanning both ranks (rollout TP 2): its first rank runs the environments and broadcasts each
    iteration's queue to the other, fed by a TP-2 or a DP-2 actor; every step's policy tokens match (<= 1e-4)."""
    history = _train(tmp_path / "r", "trainer.total_steps=2", "rollout.tp_size=2", *training)
    print({s: (h["rollout/logprob_mismatch"], h["agent/turns_mean"]) for s, h in history.items()})
    _check(history, 2)
