"""Expert parameters on the CPU optimizer path (``TorchOptimizer``): gradient sync groups and the grad norm.

Megatron marks expert weights ``allreduce=False``. With expert parallelism ``ep`` the data-parallel ranks of
a model replica hold different experts, so (as Megatron's DDP and ``get_grad_norm_fp32`` do):

- an expert's gradient is SUMMED over the expert-data-parallel group (the ranks holding the same expert
  shard; size ``dp * tp / (ep * etp)``), every other gradient over the data-parallel group;
- the global norm adds ``sum ||g_e||^2`` of the expert shards over the expert model-parallel group
  (EP x expert-TP x PP: one full copy of the experts, each shard once) to the dense part, which is summed
  over the model-parallel group (TP x PP);
- the load-balancing loss is a per-rank term that Megatron's DDP averages over DP: the CPU path sums
  gradients, so its coefficient is divided by the DP size (:func:`scale_aux_loss_for_summed_grads`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

_BASE_COEFF = "hybridrl_moe_aux_loss_coeff"


def is_expert(param: torch.nn.Parameter) -> bool:
    """An expert weight (Megatron's ``allreduce=False``)."""
    return not getattr(param, "allreduce", True)


def plan_grouped_buckets(
    params: list[torch.nn.Parameter], expert: list[bool], bucket_numel: int, plan: Callable
) -> list[list[int]]:
    """``plan``'s buckets over the dense params and, separately, the expert params (never mixed: they are
    reduced over different groups). Indices refer to ``params``."""
    buckets = []
    for want in (False, True):
        idx = [i for i, e in enumerate(expert) if e == want]
        buckets += [[idx[j] for j in b] for b in plan([params[i] for i in idx], bucket_numel)]
    return buckets


def grad_group(expert: bool) -> dist.ProcessGroup:
    """The group a gradient is summed over: expert-data-parallel for experts, data-parallel otherwise."""
    if expert:
        return mpu.get_expert_data_parallel_group()
    return mpu.get_data_parallel_group(with_context_parallel=True)


def expert_norm_stats(norms: torch.Tensor, expert: torch.Tensor, params: list[torch.nn.Parameter]) -> torch.Tensor:
    """``[sum of squared expert-shard norms, non-finite count]`` over one full copy of the experts.

    A shard split over expert-TP counts on each of its ranks, an expert-TP-replicated one on rank 0 only.
    """
    etp_rank = mpu.get_expert_tensor_parallel_rank()
    counted = torch.tensor(
        [bool(e) and (bool(getattr(p, "tensor_model_parallel", False)) or etp_rank == 0)
         for p, e in zip(params, expert.tolist(), strict=True)],
        dtype=torch.bool, device=norms.device,
    )  # fmt: skip
    stats = torch.stack([norms[counted].pow(2).sum(), (~torch.isfinite(norms[expert])).sum().double()])
    group = mpu.get_expert_tensor_model_pipeline_parallel_group()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(stats, group=group)
    return stats


def scale_aux_loss_for_summed_grads(chunks: list[torch.nn.Module]) -> None:
    """Divide the models' load-balancing coefficient by the DP size (idempotent; no-op for dense models)."""
    dp = mpu.get_data_parallel_world_size(with_context_parallel=True)
    for chunk in chunks:
        config = getattr(chunk, "config", None)
        if getattr(config, "num_moe_experts", None) is None:
            continue
        base = getattr(config, _BASE_COEFF, config.moe_aux_loss_coeff)
        setattr(config, _BASE_COEFF, base)
        config.moe_aux_loss_coeff = base / dp
