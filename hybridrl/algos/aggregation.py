"""Loss aggregation modes: how a per-token loss matrix becomes one number. The one home of their formulas.

A mode (names: ``hybridrl.config.schema_roles.LOSS_AGG_MODES``, verl's) turns a per-token loss ``l_it``
(sample ``i``, response token ``t``, mask ``m_it``, ``n_i = sum_t m_it``) over a batch ``B`` into

    token-mean:               L = sum_i sum_t l_it m_it / N_tok,          N_tok = sum_{i in B} n_i
    token-sum:                L = sum_i sum_t l_it m_it
    seq-mean-token-sum:       L = sum_i sum_t l_it m_it / N_seq,          N_seq = #{i in B : n_i > 0}
    seq-mean-token-mean:      L = sum_i (sum_t l_it m_it / n_i) / N_seq
    seq-mean-token-sum-norm:  L = sum_i sum_t l_it m_it / (N_seq * C),    C = loss_scale_factor

as in verl 0.9 (``agg_loss`` in ``verl/trainer/ppo/core_algos.py``; ``loss_agg_mode`` / ``loss_scale_factor``
in ``verl/trainer/config/actor/actor.yaml``, whose ``C`` defaults to the response length: the padded width
there, ``data.max_response_length`` here, so that it stays one constant whatever the batch).
"token-mean" weighs every token equally (DAPO, Yu et al. 2025, sec. 3.3), "seq-mean-token-mean" every sequence
(GRPO, Shao et al. 2024, eq. 3); "seq-mean-token-sum-norm" is Dr. GRPO's constant normaliser (Liu et al. 2025,
"Understanding R1-Zero-Like Training", sec. 3.1: the generation budget in place of ``|o_i|``).

Every mode is a SUM over samples divided by a denominator that does not depend on how the batch is split
(a count over the whole batch, times a constant), so it splits exactly: each part contributes
``aggregate(l, m, mode, denominator)`` and the parts add up to ``L`` (:mod:`hybridrl.mcore.loss_scaling`
counts the denominator over the data-parallel ranks). Denominators are at least 1: a batch without valid
tokens gives 0, not NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridrl.algos.masked import masked_sum
from hybridrl.config.schema_roles import LOSS_AGG_MODES

AGG_MODES = LOSS_AGG_MODES


@dataclass(frozen=True)
class AggMode:
    """One row of the formula table in the module docs."""

    sequence_mean: bool
    """Divide each sample's token sum by its own length ``n_i`` first."""
    counts: str | None
    """What the denominator counts over the batch: "tokens", "sequences", or None (no count: 1)."""
    normalised: bool
    """Divide further by the constant ``loss_scale_factor``."""


MODES = {
    "token-mean": AggMode(sequence_mean=False, counts="tokens", normalised=False),
    "token-sum": AggMode(sequence_mean=False, counts=None, normalised=False),
    "seq-mean-token-sum": AggMode(sequence_mean=False, counts="sequences", normalised=False),
    "seq-mean-token-mean": AggMode(sequence_mean=True, counts="sequences", normalised=False),
    "seq-mean-token-sum-norm": AggMode(sequence_mean=False, counts="sequences", normalised=True),
}
assert tuple(MODES) == AGG_MODES, "every mode named in the config has one formula here"


def get_mode(mode: str) -> AggMode:
    """The mode called ``mode``; unknown names raise a one-line ValueError listing the valid ones."""
    if mode not in MODES:
        raise ValueError(f"loss_agg_mode ({mode!r}) must be one of {AGG_MODES}")
    return MODES[mode]


def check_mode(mode: str, loss_scale_factor: float | None = None) -> None:
    """Raise a one-line ValueError unless ``mode`` is known and has the constant it divides by."""
    if get_mode(mode).normalised and (loss_scale_factor is None or loss_scale_factor <= 0):
        raise ValueError(
            f"loss_agg_mode {mode!r} divides by loss_scale_factor, got {loss_scale_factor!r}; pass a positive "
            "constant (e.g. the maximum response length)"
        )


def local_count(mask: torch.Tensor, mode: str) -> torch.Tensor:
    """This part's share of the denominator's count (fp64 scalar; 0 for a mode that counts nothing).

    Args:
        mask: ``(b, r)`` response mask (nonzero = valid token).
        mode: one of ``AGG_MODES``.
    """
    counts = get_mode(mode).counts
    valid = mask.bool()
    if counts == "tokens":
        return valid.sum().to(torch.float64)
    if counts == "sequences":
        return valid.any(dim=-1).sum().to(torch.float64)
    return torch.zeros((), dtype=torch.float64, device=mask.device)


def denominator(count: torch.Tensor, mode: str, loss_scale_factor: float | None = None) -> torch.Tensor:
    """The denominator of ``mode`` from the count over the WHOLE batch (:func:`local_count` summed over its parts).

    Args:
        count: fp64 scalar, the whole batch's count.
        mode: one of ``AGG_MODES``.
        loss_scale_factor: the constant ``C`` of "seq-mean-token-sum-norm" (required there, ignored elsewhere).

    Returns:
        fp64 scalar: ``max(count, 1)`` (1 for "token-sum"), times ``C`` where the mode is normalised.
    """
    check_mode(mode, loss_scale_factor)
    spec = MODES[mode]
    value = count.to(torch.float64).clamp(min=1.0) if spec.counts else torch.ones((), dtype=torch.float64)
    if spec.normalised:
        value = value * float(loss_scale_factor)
    return value.to(count.device)


def aggregate(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str, denom: torch.Tensor) -> torch.Tensor:
    """This part's contribution to ``L``: its sum over samples divided by the whole batch's :func:`denominator`.

    Args:
        loss_mat: ``(b, r)`` per-token loss; values on padding are never read (NaN there does not propagate).
        mask: ``(b, r)`` response mask.
        mode: one of ``AGG_MODES``.
        denom: the whole batch's denominator.

    Returns:
        A scalar (dtype of ``loss_mat``); the contributions of all parts add up to ``L``.
    """
    spec = get_mode(mode)
    if loss_mat.shape != mask.shape:
        raise ValueError(f"loss matrix of shape {tuple(loss_mat.shape)} does not match the mask's {tuple(mask.shape)}")
    sums = masked_sum(loss_mat, mask, dim=-1)
    if spec.sequence_mean:
        sums = sums / mask.bool().sum(dim=-1).clamp(min=1)
    return sums.sum() / denom.to(loss_mat.dtype)


def agg_loss(
    loss_mat: torch.Tensor, mask: torch.Tensor, mode: str, loss_scale_factor: float | None = None
) -> torch.Tensor:
    """``L`` of ``mode`` over this batch alone (formulas in the module docs).

    Args:
        loss_mat: ``(b, r)`` per-token loss.
        mask: ``(b, r)`` response mask.
        mode: one of ``AGG_MODES``.
        loss_scale_factor: ``C`` of "seq-mean-token-sum-norm"; None there = ``r``, the batch's response width
            (verl's default; pass the maximum response length to keep it constant across batches).

    Returns:
        A scalar.
    """
    if get_mode(mode).normalised and loss_scale_factor is None:
        loss_scale_factor = loss_mat.shape[-1]
    return aggregate(loss_mat, mask, mode, denominator(local_count(mask, mode), mode, loss_scale_factor))
