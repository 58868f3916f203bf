"""Loss aggregation over the GLOBAL batch, and the scaling that makes gradients independent of the split.

A step's loss is one aggregate ``L`` over the global batch ``B`` (every micro-batch of every data-parallel
rank) of a per-token loss, with one of the modes of :mod:`hybridrl.algos.aggregation` (formulas there). Every
mode is a SUM over samples divided by a denominator counted over ``B`` (tokens, non-empty samples, or
nothing), times a constant, so it splits exactly: each micro-batch contributes
``aggregation.aggregate(l, m, mode, denominator)`` and the contributions add up to ``L`` whatever the
micro-batch size or DP size. The counts are taken on the local batch and all-reduced over DP before the
schedule runs (:func:`global_denominator`).

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

from hybridrl.algos import aggregation


def global_denominator(
    mask: torch.Tensor, mode: str, group: dist.ProcessGroup | None, loss_scale_factor: float | None = None
) -> torch.Tensor:
    """The denominator of ``mode`` over the global batch: the local count (tokens or non-empty samples of the
    ``(b, r)`` ``mask``) summed over ``group``, at least 1, times ``loss_scale_factor`` where the mode divides by
    it (:func:`hybridrl.algos.aggregation.denominator`).

    ``group`` is required: the data-parallel group (``None`` would be torch's default group, every rank, which
    counts each sample once per TP/PP rank).

    One all-reduce (none when the group has one rank or the mode counts nothing). Returns a fp64 scalar.
    """
    count = aggregation.local_count(mask, mode).reshape(1)
    if aggregation.get_mode(mode).counts and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(count, group=group)
    return aggregation.denominator(count[0], mode, loss_scale_factor)


def grad_reduce_mean_factor(chunks: list[torch.nn.Module]) -> int:
    """How much the data-parallel gradient reduction divides by: ``dp`` under Megatron DDP, else 1."""
    if isinstance(chunks[0], DistributedDataParallel):
        return mpu.get_data_parallel_world_size(with_context_parallel=True)
    return 1
