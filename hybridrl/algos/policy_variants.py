"""Policy losses beyond PPO's clipped surrogate, registered in ``POLICY_LOSSES`` under verl's names: ``gspo``,
``cispo``, ``gpg``, ``clip_cov``, ``kl_cov``.

Each has :func:`~hybridrl.algos.losses.ppo_clip_loss`'s contract: ``(loss, metrics)`` on masked ``(b, r)`` tensors,
the per-token matrix (zero on padding) with ``per_token=True``, else its ``agg_loss`` over this batch. A loss asks
for the options it uses by parameter name (:class:`~hybridrl.algos.objectives.ActorLoss` passes only those).
``sg[x]`` below is the stop-gradient (``x.detach()``); ``rho_t = exp(logp_t - logp_old_t)``.

Clip-Cov and KL-Cov select tokens by ``Cov_t = (logp_t - mean(logp)) * (A_t - mean(A))``, centred over the valid
tokens of the batch the loss sees (one micro-batch of the training backend, as in verl).
"""

from __future__ import annotations

import torch

from hybridrl.algos.losses import LossOutput, reduce_loss, register_policy_loss
from hybridrl.algos.masked import masked_mean, masked_sum

MAX_SEQ_LOG_RATIO = 10.0
"""GSPO's sequence log-ratio is clamped above at this (as verl does) so that ``exp`` cannot overflow."""


def _log_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor) -> torch.Tensor:
    return (log_prob - old_log_prob).clamp(-20.0, 20.0)


@register_policy_loss("gspo")
def gspo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    loss_agg_mode: str = "seq-mean-token-mean",
    per_token: bool = False,
    loss_scale_factor: float | None = None,
) -> LossOutput:
    """Group Sequence Policy Optimization in its GSPO-token form (Zheng et al. 2025, "Group Sequence Policy
    Optimization", sec. 4): one importance ratio per sequence, the length-normalised geometric mean of
    its token ratios, clipped per sequence:

        s_i   = exp(1/|y_i| * sum_t m_it (logp_it - logp_old_it))
        s_it  = sg[s_i] * pi(y_it) / sg[pi(y_it)]           (value s_i, gradient s_i * grad logp_it)
        l_it  = max(-A_it * s_it, -A_it * clip(s_it, 1 - clip_ratio_low, 1 + clip_ratio_high))

    With "seq-mean-token-mean" aggregation and one advantage per sequence, ``L`` and its gradient equal the
    paper's ``-1/G sum_i min(s_i A_i, clip(s_i) A_i)``. ``log s_i`` is clamped above at ``MAX_SEQ_LOG_RATIO``.

    Args:
        log_prob, old_log_prob, advantages, response_mask: ``(b, r)``.
        clip_ratio_low, clip_ratio_high: the sequence-ratio clip range (the paper uses 3e-4 and 4e-4).
        loss_agg_mode: one of ``AGG_MODES``; the paper's objective is "seq-mean-token-mean".
        per_token: return the ``(b, r)`` loss matrix instead of its aggregate.
        loss_scale_factor: ``C`` of "seq-mean-token-sum-norm".

    Returns:
        ``(loss, metrics)``; metrics: ``clipfrac`` (tokens of clipped sequences), ``approx_kl``,
        ``seq_ratio_mean`` (mean ``s_i`` over sequences).
    """
    log_ratio = _log_ratio(log_prob, old_log_prob)
    lengths = response_mask.bool().sum(-1).clamp(min=1)
    seq_log_ratio = masked_sum(log_ratio, response_mask, dim=-1) / lengths
    token_log_ratio = (log_prob - log_prob.detach() + seq_log_ratio.detach()[:, None]).clamp(max=MAX_SEQ_LOG_RATIO)
    ratio = torch.exp(token_log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_mat = torch.maximum(unclipped, clipped)
    has_tokens = response_mask.bool().any(-1)
    metrics = {
        "clipfrac": masked_mean((clipped > unclipped).to(ratio.dtype), response_mask).detach(),
        "approx_kl": masked_mean(-log_ratio, response_mask).detach(),
        "seq_ratio_mean": torch.exp(seq_log_ratio.detach())[has_tokens].mean()
        if bool(has_tokens.any())
        else seq_log_ratio.new_ones(()),
    }
    return reduce_loss(loss_mat, response_mask, loss_agg_mode, per_token, loss_scale_factor), metrics


@register_policy_loss("cispo")
def cispo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    loss_agg_mode: str = "token-mean",
    per_token: bool = False,
    loss_scale_factor: float | None = None,
) -> LossOutput:
    """CISPO (MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention",
    sec. 3.1): the clipped importance weight, under a stop-gradient, times the REINFORCE term, so that
    no token loses its gradient to clipping:

        l_it = -sg[clip(rho_it, 1 - clip_ratio_low, 1 + clip_ratio_high)] * A_it * logp_it

    Its gradient is ``-clip(rho) * A * grad logp``; its value is not a surrogate of the return.

    Args:
        log_prob, old_log_prob, advantages, response_mask: ``(b, r)``.
        clip_ratio_low, clip_ratio_high: the IS-weight bounds ``epsilon_low^IS``, ``epsilon_high^IS``.
        loss_agg_mode: one of ``AGG_MODES`` (the paper: "token-mean").
        per_token: return the ``(b, r)`` loss matrix instead of its aggregate.
        loss_scale_factor: ``C`` of "seq-mean-token-sum-norm".

    Returns:
        ``(loss, metrics)``; metrics: ``clipfrac`` (tokens whose weight was clipped), ``approx_kl``.
    """
    log_ratio = _log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(log_ratio.detach())
    weight = ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_mat = -weight * advantages * log_prob
    metrics = {
        "clipfrac": masked_mean((weight != ratio).to(ratio.dtype), response_mask).detach(),
        "approx_kl": masked_mean(-log_ratio, response_mask).detach(),
    }
    return reduce_loss(loss_mat, response_mask, loss_agg_mode, per_token, loss_scale_factor), metrics


@register_policy_loss("gpg")
def gpg_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    per_token: bool = False,
    loss_scale_factor: float | None = None,
) -> LossOutput:
    """Group Policy Gradient (Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for
    Model Reasoning", arXiv 2504.02546): the policy gradient itself, with no ratio, no clipping and no KL:

        l_it = -A_it * logp_it

    (pair it with ``algorithm.adv_estimator=gpg``, the paper's group advantage with its batch correction).

    Args:
        log_prob, old_log_prob, advantages, response_mask: ``(b, r)`` (``old_log_prob`` only feeds the metric).
        loss_agg_mode: one of ``AGG_MODES`` (the paper: "token-mean").
        per_token: return the ``(b, r)`` loss matrix instead of its aggregate.
        loss_scale_factor: ``C`` of "seq-mean-token-sum-norm".

    Returns:
        ``(loss, metrics)``; metrics: ``approx_kl``.
    """
    loss_mat = -advantages * log_prob
    metrics = {"approx_kl": masked_mean(-_log_ratio(log_prob, old_log_prob), response_mask).detach()}
    return reduce_loss(loss_mat, response_mask, loss_agg_mode, per_token, loss_scale_factor), metrics


def token_covariance(log_prob: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``Cov_t = (logp_t - mean(logp)) * (A_t - mean(A))`` ``(b, r)``, means over the valid tokens, detached
    (Cui et al. 2025, the centred cross product whose mean drives the entropy change)."""
    logp = log_prob.detach()
    return (logp - masked_mean(logp, response_mask)) * (advantages - masked_mean(advantages, response_mask))


def _selection_generator(cov: torch.Tensor, mask: torch.Tensor) -> torch.Generator:
    """A generator seeded from the inputs: every tensor-parallel rank (same inputs) draws the same tokens, and a
    resumed run draws what an uninterrupted one did."""
    digest = hash((int(mask.bool().sum()), float(torch.where(mask.bool(), cov, 0.0).sum())))
    return torch.Generator().manual_seed(digest % (2**63))


@register_policy_loss("clip_cov")
def clip_cov_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_cov_ratio: float = 0.0002,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    loss_agg_mode: str = "token-mean",
    per_token: bool = False,
    loss_scale_factor: float | None = None,
    generator: torch.Generator | None = None,
) -> LossOutput:
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language
    Models", arXiv 2505.22617): PPO's clipped surrogate, with the gradient of a few high-covariance tokens
    removed so that they cannot collapse the entropy:

        I_clip = k tokens drawn uniformly from {t valid, not clipped by PPO : clip_cov_lb < Cov_t < clip_cov_ub},
                 k = max(floor(clip_cov_ratio * N), 1),  N = number of valid tokens
        l_it   = 0                                                   t in I_clip
               = max(-A_it * rho_it, -A_it * clip(rho_it, 1 - low, 1 + high))   otherwise

    (as in the authors' code, which verl's ``clip_cov`` follows: no dual clip).

    Args:
        log_prob, old_log_prob, advantages, response_mask: ``(b, r)``.
        clip_ratio_low, clip_ratio_high: PPO's clip range.
        clip_cov_ratio, clip_cov_lb, clip_cov_ub: the share of tokens to detach and the covariance band.
        loss_agg_mode: one of ``AGG_MODES``.
        per_token: return the ``(b, r)`` loss matrix instead of its aggregate.
        loss_scale_factor: ``C`` of "seq-mean-token-sum-norm".
        generator: draws ``I_clip``; None = one seeded from the inputs (the same on every tensor-parallel rank).

    Returns:
        ``(loss, metrics)``; metrics: ``clipfrac`` (PPO-clipped tokens), ``clip_cov_frac`` (share of valid tokens
        in ``I_clip``), ``approx_kl``.
    """
    valid = response_mask.bool()
    log_ratio = _log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    ppo_clipped = (clipped > unclipped) & valid
    cov = token_covariance(log_prob, advantages, response_mask)
    candidates = (valid & ~ppo_clipped & (cov > clip_cov_lb) & (cov < clip_cov_ub)).reshape(-1).nonzero().squeeze(-1)
    k = min(max(int(clip_cov_ratio * int(valid.sum())), 1), candidates.numel())
    generator = generator or _selection_generator(cov, response_mask)
    chosen = candidates[torch.randperm(candidates.numel(), generator=generator)[:k].to(candidates.device)]
    keep = torch.ones(valid.numel(), dtype=ratio.dtype, device=ratio.device)
    keep[chosen] = 0.0
    loss_mat = torch.maximum(unclipped, clipped) * keep.reshape(valid.shape)
    metrics = {
        "clipfrac": masked_mean(ppo_clipped.to(ratio.dtype), response_mask).detach(),
        "clip_cov_frac": torch.tensor(k / max(int(valid.sum()), 1), dtype=ratio.dtype),
        "approx_kl": masked_mean(-log_ratio, response_mask).detach(),
    }
    return reduce_loss(loss_mat, response_mask, loss_agg_mode, per_token, loss_scale_factor), metrics


@register_policy_loss("kl_cov")
def kl_cov_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    kl_cov_ratio: float = 0.0002,
    ppo_kl_coef: float = 0.1,
    loss_agg_mode: str = "token-mean",
    per_token: bool = False,
    loss_scale_factor: float | None = None,
) -> LossOutput:
    """KL-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models",
    arXiv 2505.22617): the unclipped importance-weighted policy gradient, plus a KL penalty on the tokens of
    largest covariance:

        I_KL = the k valid tokens of largest Cov_t,   k = max(floor(kl_cov_ratio * N), 1)
        l_it = -A_it * rho_it + ppo_kl_coef * |logp_it - logp_old_it|     t in I_KL
             = -A_it * rho_it                                            otherwise

    Args:
        log_prob, old_log_prob, advantages, response_mask: ``(b, r)``.
        kl_cov_ratio: the share of valid tokens that get the KL term.
        ppo_kl_coef: its weight ``beta``.
        loss_agg_mode: one of ``AGG_MODES``.
        per_token: return the ``(b, r)`` loss matrix instead of its aggregate.
        loss_scale_factor: ``C`` of "seq-mean-token-sum-norm".

    Returns:
        ``(loss, metrics)``; metrics: ``kl_cov_frac`` (share of valid tokens in ``I_KL``), ``approx_kl``.
    """
    valid = response_mask.bool()
    log_ratio = _log_ratio(log_prob, old_log_prob)
    loss_mat = -advantages * torch.exp(log_ratio)
    count = int(valid.sum())
    k = min(max(int(kl_cov_ratio * count), 1), count)
    cov = token_covariance(log_prob, advantages, response_mask).masked_fill(~valid, float("-inf"))
    chosen = torch.zeros(valid.numel(), dtype=torch.bool, device=valid.device)
    chosen[torch.topk(cov.reshape(-1), k).indices] = True
    loss_mat = loss_mat + ppo_kl_coef * log_ratio.abs() * chosen.reshape(valid.shape).to(loss_mat.dtype)
    metrics = {
        "kl_cov_frac": torch.tensor(k / max(count, 1), dtype=log_prob.dtype),
        "approx_kl": masked_mean(-log_ratio, response_mask).detach(),
    }
    return reduce_loss(loss_mat, response_mask, loss_agg_mode, per_token, loss_scale_factor), metrics
