"""Config rules of the RL variants (docs/algorithms.md): their derived fields and their checks, run from
:mod:`hybridrl.config.checks` (``fill_derived``, ``check_policy_loss``, ``check_algorithm_roles``).

- policy losses: the Clip-Cov / KL-Cov knobs of ``actor.policy_loss``, GSPO's aggregation;
- estimators: pass@k's ``k``;
- loop features: dynamic sampling (``algorithm.filter_groups``), the soft overlong punishment
  (``reward.overlong_buffer``) and rollout correction (``algorithm.rollout_correction``);
- the old-log-prob pass (``actor.recompute_old_log_prob``): skipped where the update's forward is the old policy.

Each failure is a one-line :class:`ConfigError` naming the key, its value and the fix.
"""

from __future__ import annotations

from typing import Any

from hybridrl.config.schema import ROLLOUT_IS_LEVELS, ROLLOUT_RS_LEVELS, ConfigError, RunConfig

GSPO_AGG_MODE = "seq-mean-token-mean"
"""GSPO averages each sequence's tokens first (its ratio and objective are per sequence)."""


def _fail(message: str, key: str) -> None:
    raise ConfigError(message, key=key)


def _show(value: Any) -> str:
    return "null" if value is None else repr(value)


def fill_variants(cfg: RunConfig) -> None:
    """The variants' ``None = ...`` fields (in place)."""
    buffer, rc = cfg.reward.overlong_buffer, cfg.algorithm.rollout_correction
    if buffer.len is None:
        buffer.len = max(cfg.data.max_response_length // 4, 1)
    if rc.rollout_rs_threshold is None:
        rc.rollout_rs_threshold = rc.rollout_is_threshold
    if rc.rollout_rs_threshold_lower is None and rc.rollout_rs_threshold > 0:
        rc.rollout_rs_threshold_lower = 1.0 / rc.rollout_rs_threshold
    if cfg.actor.recompute_old_log_prob is None:
        cfg.actor.recompute_old_log_prob = old_log_prob_needed(cfg) is not None


def old_log_prob_needed(cfg: RunConfig) -> str | None:
    """Why the step needs the old policy's log-probs in a pass of their own (a phrase naming the key), or None
    when the actor's single update per rollout can take them from its own forward (ratio 1)."""
    a, rc = cfg.actor, cfg.algorithm.rollout_correction
    steps = cfg.data.train_batch_size // a.ppo_mini_batch_size * a.ppo_epochs
    if steps != 1:
        return (f"the actor makes {steps} optimizer steps per rollout (data.train_batch_size "
                f"{cfg.data.train_batch_size} / actor.ppo_mini_batch_size {a.ppo_mini_batch_size} x actor.ppo_epochs "
                f"{a.ppo_epochs}), so the policy moves before the last one")  # fmt: skip
    if cfg.algorithm.use_kl_in_reward:
        return "algorithm.use_kl_in_reward (true) reads them before the update"
    for name in ("rollout_is", "rollout_rs"):
        if getattr(rc, name) is not None:
            return f"algorithm.rollout_correction.{name} ({getattr(rc, name)!r}) reads them before the update"
    return None


def check_loss_variants(cfg: RunConfig) -> None:
    """Clip-Cov / KL-Cov ranges; GSPO's sequence-level aggregation."""
    p, key = cfg.actor.policy_loss, "actor.policy_loss"
    for name in ("clip_cov_ratio", "kl_cov_ratio"):
        value = getattr(p, name)
        if not 0 < value <= 1:
            _fail(f"{key}.{name} ({value}) must be in (0, 1]: the share of valid tokens selected, e.g. 0.0002",
                  f"{key}.{name}")  # fmt: skip
    if p.clip_cov_lb >= p.clip_cov_ub:
        _fail(f"{key}.clip_cov_lb ({p.clip_cov_lb}) must be below {key}.clip_cov_ub ({p.clip_cov_ub}); e.g. 1.0 and "
              "5.0", f"{key}.clip_cov_lb")  # fmt: skip
    if p.ppo_kl_coef < 0:
        _fail(f"{key}.ppo_kl_coef ({p.ppo_kl_coef}) must be >= 0", f"{key}.ppo_kl_coef")
    if p.loss_mode == "gspo" and cfg.actor.loss_agg_mode != GSPO_AGG_MODE:
        _fail(f"actor.loss_agg_mode ({cfg.actor.loss_agg_mode!r}) with {key}.loss_mode 'gspo': GSPO's objective "
              f"averages each sequence's tokens first (Zheng et al. 2025); set actor.loss_agg_mode={GSPO_AGG_MODE}",
              "actor.loss_agg_mode")  # fmt: skip


def check_loop_features(cfg: RunConfig) -> None:
    """pass@k's k; dynamic sampling, overlong shaping and rollout correction against the rollout and the data."""
    a, n = cfg.algorithm, cfg.rollout.n
    if a.adv_estimator == "pass_at_k" and not 1 <= a.pass_k <= n:
        _fail(f"algorithm.pass_k ({a.pass_k}) must be in [1, rollout.n ({n})]: pass@k draws k of a prompt's "
              "responses; lower algorithm.pass_k or raise rollout.n", "algorithm.pass_k")  # fmt: skip
    f = a.filter_groups
    if f.enable and n < 2:
        _fail(f"algorithm.filter_groups.enable (true) needs rollout.n >= 2 (got {n}): it drops groups whose "
              "responses all scored the same; set rollout.n=8 or algorithm.filter_groups.enable=false",
              "algorithm.filter_groups.enable")  # fmt: skip
    if f.max_num_gen_batches < 1:
        _fail(f"algorithm.filter_groups.max_num_gen_batches ({f.max_num_gen_batches}) must be >= 1 (generation "
              "rounds per step, the first included)", "algorithm.filter_groups.max_num_gen_batches")  # fmt: skip
    b, max_len = cfg.reward.overlong_buffer, cfg.data.max_response_length
    if b.enable and not 1 <= b.len <= max_len:
        _fail(f"reward.overlong_buffer.len ({b.len}) must be in [1, data.max_response_length ({max_len})]; set "
              "reward.overlong_buffer.len=null (a quarter of it)", "reward.overlong_buffer.len")  # fmt: skip
    if b.penalty_factor < 0:
        _fail(f"reward.overlong_buffer.penalty_factor ({b.penalty_factor}) must be >= 0",
              "reward.overlong_buffer.penalty_factor")  # fmt: skip
    _check_rollout_correction(cfg)
    needed = old_log_prob_needed(cfg)
    if cfg.actor.recompute_old_log_prob is False and needed is not None:
        _fail(f"actor.recompute_old_log_prob (false) cannot skip the old-log-prob pass: {needed}; set it to null "
              "(auto)", "actor.recompute_old_log_prob")  # fmt: skip


def _check_rollout_correction(cfg: RunConfig) -> None:
    rc, key = cfg.algorithm.rollout_correction, "algorithm.rollout_correction"
    for name, allowed in (("rollout_is", ROLLOUT_IS_LEVELS), ("rollout_rs", ROLLOUT_RS_LEVELS)):
        value = getattr(rc, name)
        if value is not None and value not in allowed:
            _fail(f"{key}.{name} ({_show(value)}) must be one of {', '.join(map(repr, allowed))} or null",
                  f"{key}.{name}")  # fmt: skip
    for name in ("rollout_is_threshold", "rollout_rs_threshold", "rollout_rs_threshold_lower"):
        value = getattr(rc, name)
        if value is not None and value <= 0:
            _fail(f"{key}.{name} ({value}) must be positive", f"{key}.{name}")
    if rc.rollout_rs_threshold_lower >= rc.rollout_rs_threshold:
        _fail(f"{key}.rollout_rs_threshold_lower ({rc.rollout_rs_threshold_lower}) must be below "
              f"{key}.rollout_rs_threshold ({rc.rollout_rs_threshold}); set it to null (1 / the upper bound)",
              f"{key}.rollout_rs_threshold_lower")  # fmt: skip
    r = cfg.rollout
    active = rc.rollout_is if rc.rollout_is is not None else rc.rollout_rs
    if active is not None and (r.top_k != -1 or r.top_p != 1.0):
        name = "rollout_is" if rc.rollout_is is not None else "rollout_rs"
        _fail(f"{key}.{name} ({active!r}) compares vLLM's log-probs with the actor's, which differ by design with "
              f"rollout.top_p ({r.top_p}) / rollout.top_k ({r.top_k}) (vLLM renormalises over the kept tokens); set "
              f"rollout.top_p=1.0 and rollout.top_k=-1, or {key}.{name}=null", f"{key}.{name}")  # fmt: skip
