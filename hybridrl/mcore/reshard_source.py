"""What the hybrid engine reads from a Megatron model: its parameters by global name and the training groups.

``hybridrl.hybrid_engine`` never imports Megatron; it gets this rank's shards (names with GLOBAL layer
numbers, as :func:`hybridrl.mcore.bridge.global_parameters` gives them) and the tensor / pipeline process
groups of the initialised parallel state through :func:`training_source`, which checks that state against the
run's layout. Under expert parallelism (``layout.ep > 1``) the transport group is Megatron's
expert-tensor-model-pipeline group (TP x EP x PP: the ranks that together hold every expert once), and the
expert-parallel rank is checked against the layout's (``planner.expert_rank``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from hybridrl.distributed.layout import LayoutError, ParallelLayout
from hybridrl.mcore.bridge import global_parameters


@dataclass
class TrainingSource:
    """This rank's Megatron shards and its place in the training layout."""

    parameters: dict[str, torch.Tensor] = field(repr=False)
    """Megatron name (global layer numbers) -> the parameter (no copy)."""
    layout: ParallelLayout
    """The run's layout (training and generation groups) the parallel state was built from."""
    tp_rank: int
    pp_rank: int
    tp_group: Any
    pp_group: Any
    pp_ranks: list[int]
    """Global rank of each pipeline stage in this rank's pipeline group (index = stage)."""
    fused_norms: bool
    """TransformerEngine's spec: norm weights live in ``linear_qkv`` / ``linear_fc1``."""
    mp_group: Any = None
    """The ranks that together hold one copy of the model: the model-parallel (TP x PP) group, with experts
    split over EP ranks the TP x EP x PP group."""
    mp_ranks: list[int] = field(default_factory=list)
    """Global rank of each member of ``mp_group``, in group-rank order."""
    ep_rank: int = 0
    """This rank's expert-parallel rank (0 without expert parallelism)."""

    @property
    def params(self) -> dict[str, torch.Tensor]:
        """Name -> the parameter's data NOW: offloading a model (``RoleModel.offload`` / ``onload``) rebinds
        ``p.data`` to new tensors, so a switch must read it afresh rather than keep the tensors it first saw."""
        return {name: p.data for name, p in self.parameters.items()}


def training_source(chunks: list[torch.nn.Module], layout: ParallelLayout) -> TrainingSource:
    """This rank's parameters and groups on the current Megatron parallel state, which must be ``layout``'s."""
    params = dict(global_parameters(chunks))
    pp_group = mpu.get_pipeline_model_parallel_group()
    experts = layout.ep > 1
    mp_group = mpu.get_expert_tensor_model_pipeline_parallel_group() if experts else mpu.get_model_parallel_group()
    live = {
        "world_size": dist.get_world_size(),
        "tp": mpu.get_tensor_model_parallel_world_size(),
        "pp": mpu.get_pipeline_model_parallel_world_size(),
        "vpp": mpu.get_virtual_pipeline_model_parallel_world_size() or 1,
        "cp": mpu.get_context_parallel_world_size(),
        "ep": mpu.get_expert_model_parallel_world_size(),
    }
    for axis, size in live.items():
        if getattr(layout, axis) != size:
            raise LayoutError(
                f"layout.{axis} ({getattr(layout, axis)}) != the initialised parallel state's ({size}); pass the "
                "layout init_model_parallel was given (the one the model was built on)",
                axis=axis,
            )
    from hybridrl.hybrid_engine.planner import expert_rank  # pure layout math (no process groups)

    ep_rank = mpu.get_expert_model_parallel_rank() if experts else 0
    if ep_rank != expert_rank(layout, dist.get_rank()):
        raise LayoutError(
            f"expert-parallel rank ({ep_rank}) of rank {dist.get_rank()} != the layout's "
            f"({expert_rank(layout, dist.get_rank())}); build the parallel state with init_model_parallel(layout)",
            axis="ep",
        )
    return TrainingSource(
        parameters=params,
        layout=layout,
        tp_rank=mpu.get_tensor_model_parallel_rank(),
        pp_rank=mpu.get_pipeline_model_parallel_rank(),
        tp_group=mpu.get_tensor_model_parallel_group(),
        pp_group=pp_group,
        pp_ranks=[dist.get_global_rank(pp_group, s) for s in range(layout.pp)],
        fused_norms=any(n.endswith("linear_qkv.layer_norm_weight") for n in params),
        mp_group=mp_group,
        mp_ranks=dist.get_process_group_ranks(mp_group),
        ep_rank=ep_rank,
    )
