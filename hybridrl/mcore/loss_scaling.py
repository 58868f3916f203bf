"""Loss aggregation over the GLOBAL batch, and the scaling that makes gradients independent of the split.

A step's loss is one aggregate over the global batch ``B`` (every micro-batch of every data-parallel
rank) of a per-token loss ``l_it`` (sample ``i``, response token ``t``, mask ``m_it``, ``n_i = sum_t m_it``):

    token-mean:           L = sum_i sum_t l_it m_it / N_tok,      N_tok = sum_{i in B} n_i
    seq-mean-token-sum:   L = sum_i sum_t l_it m_it / N_seq,      N_seq = #{i in B : n_i > 0}
    seq-mean-token-mean:  L = sum_i (sum_t l_it m_it / n_i) / N_seq

Every mode is a SUM over samples divided by a global denominator, so it splits exactly: each micro-batch
contributes ``aggregate(l, m) = its part of the sum / global denominator`` and the contributions add up to
``L`` whatever the micro-batch size or DP size. The denominators are counted on the local batch and
all-reduced over DP before the schedule runs (:func:`global_denominator`).

Megatron's schedule divides a ``(loss, metrics)`` loss by ``num_microbatches`` before backward
(``forward_step_calc_loss`` in megatron-core 0.16; a 3-tuple ``(loss, num_tokens, metrics)`` would instead
divide by the micro-batch's own token count, which is the wrong denominator here), and Megatron's DDP
averages gradients over DP (``gradient_scaling_factor = 1 / dp``). So the loss handed to the schedule is

    aggregate(l, m) * num_microbatches * (dp if the model is wrapped in Megatron DDP else 1)

and summing the gradients over DP ranks (hybridrl's CPU optimizer sums) yields ``dL/dtheta`` exactly.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.distributed import DistributedDataParallel

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


def _check_mode(mode: str) -> None:
    if mode not in AGG_MODES:
        raise ValueError(f"loss_agg_mode ({mode!r}) must be one of {AGG_MODES}")


def local_denominator(mask: torch.Tensor, mode: str) -> torch.Tensor:
    """This rank's share of the denominator: valid tokens (token-mean) or non-empty samples. fp64 scalar.

    Args:
        mask: ``(b, r)`` response mask (nonzero = valid token).
    """
    _check_mode(mode)
    valid = mask.bool()
    if mode == "token-mean":
        return valid.sum().to(torch.float64)
    return valid.any(dim=1).sum().to(torch.float64)


def global_denominator(mask: torch.Tensor, mode: str, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The denominator of ``mode`` over the global batch: :func:`local_denominator` summed over ``group``.

    One all-reduce (none when the group has one rank). Returns a fp64 scalar, at least 1 so that a batch
    without any valid token gives a zero loss rather than NaN.
    """
    value = local_denominator(mask, mode).reshape(1)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(value, group=group)
    return value[0].clamp(min=1.0)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str, denominator: torch.Tensor) -> torch.Tensor:
    """This micro-batch's contribution to the global loss of ``mode`` (formulas in the module docs).

    Args:
        per_token: ``(mb, r)`` per-token loss.
        mask: ``(mb, r)`` response mask.
        mode: one of ``AGG_MODES``.
        denominator: the global denominator from :func:`global_denominator`.

    Returns:
        A scalar (dtype of ``per_token``): the contributions of all micro-batches on all DP ranks sum to ``L``.
    """
    _check_mode(mode)
    if per_token.shape != mask.shape:
        raise ValueError(
            f"loss_fn returned per-token loss of shape {tuple(per_token.shape)}; expected {tuple(mask.shape)}"
        )
    m = mask.to(per_token.dtype)
    token_sums = (per_token * m).sum(dim=1)
    if mode == "seq-mean-token-mean":
        token_sums = token_sums / m.sum(dim=1).clamp(min=1.0)
    return token_sums.sum() / denominator.to(per_token.dtype)


def grad_reduce_mean_factor(chunks: list[torch.nn.Module]) -> int:
    """How much the data-parallel gradient reduction divides by: ``dp`` under Megatron DDP, else 1."""
    if isinstance(chunks[0], DistributedDataParallel):
        return mpu.get_data_parallel_world_size(with_context_parallel=True)
    return 1
