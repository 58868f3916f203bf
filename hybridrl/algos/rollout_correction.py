"""Rollout correction: importance weights and rejection masks for the mismatch between the rollout engine's
sampling distribution and the trainer's (``algorithm.rollout_correction``).

The rollout engine (vLLM) samples with kernels, precisions and batching the trainer does not share, so the
log-probs it reports for the sampled tokens, ``log pi_rollout``, differ from the trainer's ``log pi_old`` of the
same weights; PPO's ratio assumes the data came from ``pi_old``. From the per-token log ratio

    log rho_t = log pi_old(y_t) - log pi_rollout(y_t)          (clamped to [-20, 20], 0 on padding)

- truncated importance sampling, TIS (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
  Off-Policy RL Training"; ``rollout_is``) weighs each token's policy loss by

      "token":     w_t = min(rho_t, C)
      "sequence":  w_t = min(prod_s rho_s, C)     (the same weight on every token of the sequence)

- masked importance sampling / rejection, MIS (``rollout_rs``; verl's "rollout correction" names) removes from
  the actor's loss, and from its denominators, the tokens whose ratio leaves ``[lower, upper]``:

      "token":     rho_t                   per token
      "sequence":  prod_t rho_t            the whole sequence
      "geometric": exp(mean_t log rho_t)   the whole sequence, length-normalised

``w`` is a constant of the update (both log-probs are fixed data), so it scales the gradient and nothing flows
through it. The loop applies this just before the actor's update (:class:`hybridrl.trainer.rl_trainer.RLTrainer`);
the actor's loss multiplies its policy term by ``rollout_is_weights`` (:class:`hybridrl.algos.objectives.ActorLoss`).
"""

from __future__ import annotations

import torch

from hybridrl.algos.masked import masked_mean, masked_sum

SAFETY_LOG_BOUND = 20.0
"""Log-ratios (token and sequence) are clamped to +-this before ``exp``: a stale token cannot overflow."""


def _sequence_log_ratio(log_rho: torch.Tensor, mask: torch.Tensor, mean: bool) -> torch.Tensor:
    """``(b, 1)`` sum (or mean) of the token log-ratios over each sequence, clamped."""
    total = masked_sum(log_rho, mask, dim=-1)
    if mean:
        total = total / mask.bool().sum(-1).clamp(min=1)
    return total.clamp(-SAFETY_LOG_BOUND, SAFETY_LOG_BOUND)[:, None]


def rollout_correction(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    rollout_is: str | None = None,
    rollout_is_threshold: float = 2.0,
    rollout_rs: str | None = None,
    rollout_rs_threshold: float | None = None,
    rollout_rs_threshold_lower: float | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """TIS weights and the MIS-masked response mask (formulas in the module docs).

    Args:
        old_log_probs: ``(b, r)`` the trainer's log-probs of the sampled tokens (``pi_old``).
        rollout_log_probs: ``(b, r)`` the rollout engine's log-probs of the same tokens (``pi_rollout``).
        response_mask: ``(b, r)``.
        rollout_is: "token", "sequence" or None (no weights).
        rollout_is_threshold: the truncation ``C``.
        rollout_rs: "token", "sequence", "geometric" or None (no masking).
        rollout_rs_threshold: the upper bound; None = ``rollout_is_threshold``.
        rollout_rs_threshold_lower: the lower bound; None = 1 / the upper bound.

    Returns:
        ``(weights, mask, metrics)``: ``(b, r)`` weights (0 on padding; None without ``rollout_is``), the
        ``(b, r)`` response mask with the rejected tokens set to 0, and ``rollout_corr/...`` metrics:
        ``is_weight_mean`` and ``is_truncated_frac`` (share of valid tokens whose weight hit ``C``),
        ``masked_token_frac`` (share of valid tokens masked) and ``masked_seq_frac`` (share of sequences that
        lost a token), ``log_ratio_mean``.
    """
    valid = response_mask.bool()
    log_rho = torch.where(valid, old_log_probs - rollout_log_probs, 0.0).clamp(-SAFETY_LOG_BOUND, SAFETY_LOG_BOUND)
    log_rho = log_rho.to(torch.float32)
    metrics = {"rollout_corr/log_ratio_mean": float(masked_mean(log_rho, valid))}
    weights = None
    if rollout_is is not None:
        if rollout_is not in ("token", "sequence"):
            raise ValueError(
                f"algorithm.rollout_correction.rollout_is ({rollout_is!r}) must be token, sequence or null"
            )
        raw = torch.exp(log_rho if rollout_is == "token" else _sequence_log_ratio(log_rho, valid, mean=False))
        raw = raw.expand_as(log_rho)
        weights = torch.where(valid, raw.clamp(max=rollout_is_threshold), 0.0)
        metrics["rollout_corr/is_weight_mean"] = float(masked_mean(weights, valid))
        metrics["rollout_corr/is_truncated_frac"] = float(masked_mean((raw > rollout_is_threshold).float(), valid))
    mask = response_mask
    if rollout_rs is not None:
        if rollout_rs not in ("token", "sequence", "geometric"):
            raise ValueError(f"algorithm.rollout_correction.rollout_rs ({rollout_rs!r}) must be token, sequence, "
                             "geometric or null")  # fmt: skip
        upper = rollout_is_threshold if rollout_rs_threshold is None else rollout_rs_threshold
        lower = 1.0 / upper if rollout_rs_threshold_lower is None else rollout_rs_threshold_lower
        if rollout_rs == "token":
            log_ratio = log_rho
        else:
            log_ratio = _sequence_log_ratio(log_rho, valid, mean=rollout_rs == "geometric").expand_as(log_rho)
        ratio = torch.exp(log_ratio)
        keep = (ratio >= lower) & (ratio <= upper)
        mask = response_mask * keep.to(response_mask.dtype)
        rejected = valid & ~keep
        metrics["rollout_corr/masked_token_frac"] = float(masked_mean(rejected.float(), valid))
        has_tokens = valid.any(-1)
        lost = rejected.any(-1)[has_tokens]
        metrics["rollout_corr/masked_seq_frac"] = float(lost.float().mean()) if lost.numel() else 0.0
    return weights, mask, metrics
