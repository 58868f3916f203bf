"""Policy and value losses on masked ``(batch, response_len)`` tensors, and the policy-loss registry.

Every loss returns ``(loss, metrics)``. With ``per_token=True`` ``loss`` is the ``(b, r)`` per-token matrix
(zero on padding): the training backend aggregates it over the whole mini-batch with global denominators
(:mod:`hybridrl.mcore.loss_scaling`). With ``per_token=False`` it is ``agg_loss(matrix, mask, loss_agg_mode)``
over this batch alone (:mod:`hybridrl.algos.aggregation`). Metrics are token means over this batch.

All terms are returned unweighted; :mod:`hybridrl.algos.objectives` composes what the actor and critic minimise.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybridrl.algos.aggregation import agg_loss, get_mode
from hybridrl.algos.masked import masked_mean

LossOutput = tuple[torch.Tensor, dict[str, torch.Tensor]]
PolicyLossFn = Callable[..., LossOutput]
POLICY_LOSSES: dict[str, PolicyLossFn] = {}
"""Policy loss name -> ``fn(log_prob, old_log_prob, advantages, response_mask, **options)``, called with keywords.
The built-in names match ``hybridrl.config.schema_roles.POLICY_LOSS_NAMES``."""


def reduce_loss(
    loss_mat: torch.Tensor, mask: torch.Tensor, mode: str, per_token: bool, loss_scale_factor: float | None = None
) -> torch.Tensor:
    """The ``(b, r)`` loss matrix with padding zeroed (``per_token``), or its :func:`agg_loss` over this batch."""
    get_mode(mode)
    loss_mat = torch.where(mask.bool(), loss_mat, torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device))
    return loss_mat if per_token else agg_loss(loss_mat, mask, mode, loss_scale_factor)


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: register ``fn`` as policy loss ``name`` (stack it to register one loss under several names)."""

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered (by {POLICY_LOSSES[name].__name__})")
        POLICY_LOSSES[name] = fn
        return fn

    return decorator


def get_policy_loss(name: str) -> PolicyLossFn:
    """The policy loss registered as ``name``; unknown names raise a one-line ValueError listing the valid ones."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"policy loss ({name!r}) must be one of {sorted(POLICY_LOSSES)}")
    return POLICY_LOSSES[name]


@register_policy_loss("vanilla")  # verl's name of the same loss (``policy_loss.loss_mode: vanilla``)
@register_policy_loss("ppo_clip")
def ppo_clip_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    per_token: bool = False,
    loss_scale_factor: float | None = None,
) -> LossOutput:
    """PPO's clipped surrogate (Schulman et al. 2017, "Proximal Policy Optimization Algorithms", eq. 7) with
    asymmetric clip ratios (DAPO's clip-higher, Yu et al. 2025, sec. 3.1) and dual clip (Ye et al. 2020,
    "Mastering Complex Control in MOBA Games with Deep Reinforcement Learning", sec. 3.3):

        rho = exp(logp - logp_old)
        l   = max(-A * rho, -A * clip(rho, 1 - clip_ratio_low, 1 + clip_ratio_high))
        l   = min(l, -A * clip_ratio_c)   where A < 0     (dual clip: the loss of a negative advantage is
                                                           capped at clip_ratio_c * |A| however large rho is)

    ``logp - logp_old`` is clamped to [-20, 20] before ``exp`` so that a stale token cannot overflow.

    Args:
        log_prob: ``(b, r)`` log-probs of the sampled tokens under the policy being trained.
        old_log_prob: ``(b, r)`` the same under the policy that generated them.
        advantages: ``(b, r)``.
        response_mask: ``(b, r)``.
        clip_ratio_low: lower clip ``epsilon_low``.
        clip_ratio_high: upper clip ``epsilon_high``.
        clip_ratio_c: dual-clip constant, > 1.
        loss_agg_mode: one of ``AGG_MODES`` (ignored with ``per_token``).
        per_token: return the ``(b, r)`` loss matrix instead of its aggregate.
        loss_scale_factor: ``C`` of "seq-mean-token-sum-norm" (see :func:`agg_loss`; ignored with ``per_token``).

    Returns:
        ``(loss, metrics)``; metrics: ``clipfrac`` (tokens where the clipped term was taken), ``clipfrac_lower``
        (tokens where the dual clip was taken), ``approx_kl`` (mean of ``logp_old - logp``).
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"actor.clip_ratio_c ({clip_ratio_c}) must be > 1 (dual-clip bound, Ye et al. 2020)")
    log_ratio = (log_prob - old_log_prob).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clip_max = torch.maximum(unclipped, clipped)
    dual_bound = -advantages * clip_ratio_c
    negative = advantages < 0
    loss_mat = torch.where(negative, torch.minimum(clip_max, dual_bound), clip_max)
    metrics = {
        "clipfrac": masked_mean((clipped > unclipped).to(ratio.dtype), response_mask).detach(),
        "clipfrac_lower": masked_mean(((clip_max > dual_bound) & negative).to(ratio.dtype), response_mask).detach(),
        "approx_kl": masked_mean(-log_ratio, response_mask).detach(),
    }
    return reduce_loss(loss_mat, response_mask, loss_agg_mode, per_token, loss_scale_factor), metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cliprange_value: float = 0.5,
    loss_agg_mode: str = "token-mean",
    per_token: bool = False,
    loss_scale_factor: float | None = None,
) -> LossOutput:
    """Clipped value loss of the critic (PPO2 in OpenAI Baselines; analysed in Engstrom et al. 2020,
    "Implementation Matters in Deep Policy Gradients", sec. 3):

        V_clip = V_old + clip(V - V_old, -cliprange_value, cliprange_value)
        l      = 0.5 * max((V - R)^2, (V_clip - R)^2)

    Args:
        values: ``(b, r)`` current critic values.
        old_values: ``(b, r)`` critic values at rollout time.
        returns: ``(b, r)`` targets (e.g. GAE returns).
        response_mask: ``(b, r)``.
        cliprange_value: how far the value may move from ``old_values`` before the loss stops pulling it.
        loss_agg_mode: one of ``AGG_MODES`` (ignored with ``per_token``).
        per_token: return the ``(b, r)`` loss matrix instead of its aggregate.
        loss_scale_factor: ``C`` of "seq-mean-token-sum-norm" (see :func:`agg_loss`; ignored with ``per_token``).

    Returns:
        ``(loss, metrics)``; metrics: ``vf_clipfrac`` (tokens where the clipped term was taken).
    """
    clipped_values = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    loss_unclipped = (values - returns) ** 2
    loss_clipped = (clipped_values - returns) ** 2
    loss_mat = 0.5 * torch.maximum(loss_unclipped, loss_clipped)
    metrics = {"vf_clipfrac": masked_mean((loss_clipped > loss_unclipped).to(values.dtype), response_mask).detach()}
    return reduce_loss(loss_mat, response_mask, loss_agg_mode, per_token, loss_scale_factor), metrics


def entropy_bonus(
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    per_token: bool = False,
    loss_scale_factor: float | None = None,
) -> LossOutput:
    """The entropy of the policy, to be maximised (Williams & Peng 1991; Mnih et al. 2016, "Asynchronous
    Methods for Deep Reinforcement Learning", sec. 4): the actor loss subtracts ``entropy_coeff * H``.

    Args:
        entropy: ``(b, r)`` entropy of the next-token distribution at each response position.
        response_mask: ``(b, r)``.
        loss_agg_mode: one of ``AGG_MODES`` (ignored with ``per_token``).
        per_token: return the ``(b, r)`` matrix instead of its aggregate.
        loss_scale_factor: ``C`` of "seq-mean-token-sum-norm" (see :func:`agg_loss`; ignored with ``per_token``).

    Returns:
        ``(H, metrics)``; metrics: ``entropy`` (token mean).
    """
    metrics = {"entropy": masked_mean(entropy, response_mask).detach()}
    return reduce_loss(entropy, response_mask, loss_agg_mode, per_token, loss_scale_factor), metrics
