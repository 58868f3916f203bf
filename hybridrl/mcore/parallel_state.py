"""Process groups from the run's :class:`~hybridrl.distributed.ParallelLayout`: Megatron's and the rollout replicas'.

``hybridrl.distributed.init_model_parallel`` calls :func:`initialize` here: it applies the CPU shims when
CUDA is absent, builds Megatron's TP/PP/DP/CP/EP groups with the layout's sizes and the rollout replica
groups with its generation groups (:func:`rollout_replica_info` checks a layout against them), and seeds the RNG
tracker the way ``model_parallel_cuda_manual_seed`` does on GPU.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from hybridrl.distributed.env import apply_collective_timeout
from hybridrl.distributed.layout import LayoutError, ParallelLayout
from hybridrl.mcore import cpu_compat

_MEGATRON_AXIS = {"tp": "tp", "pp": "pp", "dp": "dp", "cp": "cp", "mp": "tp-pp"}
_BUILT: dict[str, object] = {}
"""What :func:`initialize` built: ``layout`` and ``replica_groups`` (one per rollout TP rank; empty at rollout TP 1)."""


def megatron_rank_groups(layout: ParallelLayout, axis: str) -> list[list[int]]:
    """The groups Megatron's own ``RankGenerator`` builds for ``axis``, without any process group.

    Used to check :meth:`ParallelLayout.groups` against Megatron for layouts far bigger than this machine.
    """
    gen = mpu.RankGenerator(tp=layout.tp, ep=1, dp=layout.dp, pp=layout.pp, cp=layout.cp, order="tp-cp-ep-dp-pp")
    return sorted(sorted(g) for g in gen.get_ranks(_MEGATRON_AXIS[axis]))


def initialize(layout: ParallelLayout, seed: int = 1234, timeout_s: float = 600.0) -> None:
    """Build Megatron's process groups and the rollout replica groups for ``layout``; seed the model-parallel RNG.

    Requires ``torch.distributed`` to be initialised with ``layout.world_size`` ranks; collective (every rank
    creates every group, in the same order). Every group's collectives wait ``timeout_s`` (Megatron's own default,
    30 minutes, would outlast ``trainer.collective_timeout_s``); the few Megatron creates without passing its
    timeout get it set afterwards.
    """
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised; call hybridrl.distributed.init_distributed() first")
    if dist.get_world_size() != layout.world_size:
        raise LayoutError(
            f"layout world_size ({layout.world_size}) != launched world size ({dist.get_world_size()}); "
            f"launch {layout.world_size} processes or change the layout"
        )
    on_cpu = cpu_compat.apply()
    if mpu.model_parallel_is_initialized():
        cpu_compat.unroute_tp_all_reduce()
        mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        distributed_timeout_minutes=timeout_s / 60,  # timedelta(minutes=...) inside: a float is fine
        create_gloo_process_groups=on_cpu,
    )
    timeout = datetime.timedelta(seconds=timeout_s)
    replicas = (
        [dist.new_group(g, timeout=timeout) for g in layout.groups("rollout_dp")] if layout.rollout_tp > 1 else []
    )
    _BUILT.update(layout=layout, replica_groups=replicas)
    apply_collective_timeout(timeout_s)  # also the few groups Megatron makes without its timeout
    if on_cpu:  # TP all-reduces through shared memory, not gloo's loopback TCP (docs/cpu_stack.md)
        cpu_compat.route_tp_all_reduce(mpu.get_tensor_model_parallel_group())
    reseed(seed)


def reseed(seed: int) -> None:
    """Seed the default and model-parallel RNG states (different per TP rank, equal across DP)."""
    tp_rank = mpu.get_tensor_model_parallel_rank()
    if cpu_compat.is_applied():
        cpu_compat.seed_model_parallel(seed, tp_rank, ep_rank=mpu.get_expert_model_parallel_rank())
    else:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed)


def destroy() -> None:
    """Tear down Megatron's groups (the default process group stays)."""
    cpu_compat.unroute_tp_all_reduce()
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    _BUILT.clear()


def p2p_settings() -> dict[str, bool]:
    """Pipeline p2p settings for the active backend.

    gloo + batched p2p (``batch_p2p_comm=True``, Megatron's default) gives SILENTLY WRONG activations for
    later micro-batches under virtual pipelining (docs/cpu_stack.md), so gloo always gets ``batch_p2p_comm=False``.
    """
    if dist.is_initialized() and dist.get_backend() == "gloo":
        return {"batch_p2p_comm": False, "batch_p2p_sync": False}
    return {"batch_p2p_comm": True, "batch_p2p_sync": True}


def data_parallel_info() -> tuple[int, int, object]:
    """(size, rank, process group) of this rank's Megatron data-parallel group."""
    return (
        mpu.get_data_parallel_world_size(),
        mpu.get_data_parallel_rank(),
        mpu.get_data_parallel_group(),
    )


def rollout_replica_info(layout: ParallelLayout) -> tuple[int, int, object]:
    """(size, rank, group) of this rank's replica group: one rank of every vLLM engine, those with its rollout TP
    rank (the group is None, i.e. the whole world, at rollout TP 1)."""
    built = _BUILT.get("layout")
    if built is None or (built.world_size, built.rollout_tp) != (layout.world_size, layout.rollout_tp):
        have = "none" if built is None else built.describe_rollout()
        raise LayoutError(
            f"the rollout replica groups were built for {have}, not {layout.describe_rollout()}; pass the layout "
            "that init_model_parallel was given"
        )
    coords = layout.rollout_coords(dist.get_rank())
    group = _BUILT["replica_groups"][coords.tp] if layout.rollout_tp > 1 else None
    return layout.rollout_replicas, coords.replica, group
