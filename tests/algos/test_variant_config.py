"""The RL variants' config: selected by name through load_config (the trainer's path), their derived fields, and
each bad value refused with one line naming the key, the value and the fix."""

from __future__ import annotations

import pytest

from hybridrl.config import load_config
from hybridrl.config.schema import ConfigError

GRPO = "tiny_cpu_grpo.yaml"


def test_variants_load_by_name_with_derived_fields():
    overrides = [
        "actor.policy_loss.loss_mode=gspo", "actor.loss_agg_mode=seq-mean-token-mean", "algorithm.pass_k=8",
        "algorithm.adv_estimator=pass_at_k", "reward.overlong_buffer.enable=true",
        "algorithm.filter_groups.enable=true", "algorithm.rollout_correction.rollout_rs=geometric",
        "algorithm.rollout_correction.rollout_is_threshold=1.5",
    ]  # fmt: skip
    cfg = load_config(GRPO, overrides)
    assert cfg.actor.policy_loss.loss_mode == "gspo" and cfg.algorithm.adv_estimator == "pass_at_k"
    assert cfg.reward.overlong_buffer.len == 2  # a quarter of data.max_response_length (8)
    rc = cfg.algorithm.rollout_correction
    assert rc.rollout_rs_threshold == 1.5 and rc.rollout_rs_threshold_lower == pytest.approx(1 / 1.5)
    for mode in ("cispo", "gpg", "clip_cov", "kl_cov"):
        assert load_config(GRPO, [f"actor.policy_loss.loss_mode={mode}"]).actor.policy_loss.loss_mode == mode
    assert load_config(GRPO, ["algorithm.adv_estimator=gpg"]).critic.enable is False


CASES = [
    (["actor.policy_loss.loss_mode=gspo"], "actor.loss_agg_mode ('token-mean') with actor.policy_loss.loss_mode "
     "'gspo': GSPO's objective averages each sequence's tokens first (Zheng et al. 2025); set "
     "actor.loss_agg_mode=seq-mean-token-mean"),
    (["actor.policy_loss.clip_cov_ratio=0"], "actor.policy_loss.clip_cov_ratio (0.0) must be in (0, 1]: the share "
     "of valid tokens selected, e.g. 0.0002"),
    (["actor.policy_loss.kl_cov_ratio=1.5"], "actor.policy_loss.kl_cov_ratio (1.5) must be in (0, 1]: the share of "
     "valid tokens selected, e.g. 0.0002"),
    (["actor.policy_loss.clip_cov_lb=5"], "actor.policy_loss.clip_cov_lb (5.0) must be below "
     "actor.policy_loss.clip_cov_ub (5.0); e.g. 1.0 and 5.0"),
    (["actor.policy_loss.ppo_kl_coef=-1"], "actor.policy_loss.ppo_kl_coef (-1.0) must be >= 0"),
    (["algorithm.adv_estimator=pass_at_k", "algorithm.pass_k=9"], "algorithm.pass_k (9) must be in [1, rollout.n "
     "(8)]: pass@k draws k of a prompt's responses; lower algorithm.pass_k or raise rollout.n"),
    (["algorithm.adv_estimator=pass_at_k", "rollout.n=1", "actor.ppo_micro_batch_size_per_gpu=4"],
     "rollout.n (1) must be >= 2 for algorithm.adv_estimator 'pass_at_k' (its baseline is the other responses to the "
     "same prompt); set e.g. rollout.n=8"),
    (["algorithm.filter_groups.enable=true", "algorithm.adv_estimator=remax", "rollout.n=1",
      "actor.ppo_micro_batch_size_per_gpu=4"],
     "algorithm.filter_groups.enable (true) needs rollout.n >= 2 (got 1): it drops groups whose responses all "
     "scored the same; set rollout.n=8 or algorithm.filter_groups.enable=false"),
    (["algorithm.filter_groups.max_num_gen_batches=0"], "algorithm.filter_groups.max_num_gen_batches (0) must be >= 1 "
     "(generation rounds per step, the first included)"),
    (["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=9"], "reward.overlong_buffer.len (9) must "
     "be in [1, data.max_response_length (8)]; set reward.overlong_buffer.len=null (a quarter of it)"),
    (["reward.overlong_buffer.penalty_factor=-0.5"], "reward.overlong_buffer.penalty_factor (-0.5) must be >= 0"),
    (["algorithm.rollout_correction.rollout_is=tokens"], "algorithm.rollout_correction.rollout_is ('tokens') must be "
     "one of 'token', 'sequence' or null"),
    (["algorithm.rollout_correction.rollout_rs=seq"], "algorithm.rollout_correction.rollout_rs ('seq') must be one "
     "of 'token', 'sequence', 'geometric' or null"),
    (["algorithm.rollout_correction.rollout_is_threshold=0"], "algorithm.rollout_correction.rollout_is_threshold "
     "(0.0) must be positive"),
    (["algorithm.rollout_correction.rollout_rs_threshold_lower=3"], "algorithm.rollout_correction."
     "rollout_rs_threshold_lower (3.0) must be below algorithm.rollout_correction.rollout_rs_threshold (2.0); set it "
     "to null (1 / the upper bound)"),
    (["algorithm.rollout_correction.rollout_is=token", "rollout.top_p=0.9"], "algorithm.rollout_correction."
     "rollout_is ('token') compares vLLM's log-probs with the actor's, which differ by design with rollout.top_p "
     "(0.9) / rollout.top_k (-1) (vLLM renormalises over the kept tokens); set rollout.top_p=1.0 and "
     "rollout.top_k=-1, or algorithm.rollout_correction.rollout_is=null"),
]  # fmt: skip


@pytest.mark.parametrize(("overrides", "message"), CASES, ids=lambda c: c[0] if isinstance(c, list) else "")
def test_bad_values_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(GRPO, overrides)
    assert str(err.value) == message
    assert err.value.key is not None and err.value.key.split(".")[0] in message
