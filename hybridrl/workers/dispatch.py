"""Dispatch modes: how a role method's batch is split over ranks and how its results come back.

hybridrl runs SPMD: every process holds every role and the whole batch the loop works on. A role method
declares, with :func:`register`, how a :class:`~hybridrl.protocol.DataProto` argument is cut for it and how
its output is assembled, so that after the call every rank again holds the full result:

- ``DP_COMPUTE``: the batch is chunked over the role's data-parallel ranks (TP and PP peers of a DP rank get
  the same chunk); each rank's output (already identical over its TP/PP peers: the compute helpers broadcast
  from the last pipeline stage) is concatenated over the DP group with ONE fused all-gather;
- ``ONE_TO_ALL``: every rank runs the method with the same arguments (e.g. the actor's weight switch, a
  collective of the whole world); the output of rank 0 is returned unchanged on every rank (its metrics);
- ``LOCAL``: no splitting or gathering (the method handles communication itself).

Batch sizes that do not divide the DP size are padded by repeating leading rows and the padding is
removed from the result (``DataProto.pad_to_divisor`` / ``unpad``).

Devices: the trainer's loop holds its batches on the CPU (rewards, advantages and metrics are small and
mix with CPU data: scorer results, dataset tensors). A ``DP_COMPUTE`` chunk is moved to the rank's compute
device (its current CUDA device, else the CPU) before the method runs, and the gathered result is moved
back to the CPU: over NCCL the gather delivers CUDA tensors whatever the sender's device was.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from hybridrl.protocol import DataProto, all_gather

_ATTR = "__hybridrl_dispatch__"


class Dispatch(enum.Enum):
    """How a registered method's DataProto is split and its result collected."""

    DP_COMPUTE = "dp_compute"
    ONE_TO_ALL = "one_to_all"
    LOCAL = "local"


MESHES = ("train", "rollout")


def register(dispatch_mode: Dispatch = Dispatch.DP_COMPUTE, mesh: str = "train") -> Callable:
    """Declare a worker method's dispatch mode (read by :class:`~hybridrl.workers.group.WorkerGroup`).

    ``mesh`` names the data-parallel split: "train" (the Megatron DP ranks: worker attributes ``dp_size``,
    ``dp_rank``, ``dp_group``) or "rollout" (the vLLM replicas: ``rollout_dp_size``, ``rollout_dp_rank``,
    ``rollout_dp_group``).
    """
    if not isinstance(dispatch_mode, Dispatch):
        valid = ", ".join(m.name for m in Dispatch)
        raise ValueError(f"dispatch_mode ({dispatch_mode!r}) is not a Dispatch; valid: {valid}")
    if mesh not in MESHES:
        raise ValueError(f"mesh ({mesh!r}) must be one of {MESHES}")

    def mark(method: Callable) -> Callable:
        setattr(method, _ATTR, (dispatch_mode, mesh))
        return method

    return mark


def dispatch_mode_of(method: Callable) -> Dispatch | None:
    """The mode a method was registered with, or None."""
    marked = getattr(getattr(method, "__func__", method), _ATTR, None)
    return marked[0] if marked else None


def mesh_of(method: Callable) -> str:
    """The data-parallel mesh a registered method splits over ("train" or "rollout")."""
    marked = getattr(getattr(method, "__func__", method), _ATTR, None)
    return marked[1] if marked else "train"


def split_for_dp(data: DataProto, dp_size: int, dp_rank: int) -> tuple[DataProto, int]:
    """This DP rank's contiguous chunk of ``data`` (padded to a multiple of ``dp_size``) and the pad size."""
    padded, pad = data.pad_to_divisor(dp_size)
    return padded.chunk(dp_size)[dp_rank], pad


def gather_from_dp(output: DataProto, dp_group: Any, pad: int) -> DataProto:
    """Concatenate every DP rank's output in rank order (one fused collective) and drop the padding.

    ``meta_info`` is rank-local (timings, per-rank metrics): it does not travel; the result carries this
    rank's own.
    """
    meta, output.meta_info = output.meta_info, {}
    gathered = all_gather(output, group=dp_group) if dist.is_initialized() else output
    gathered.meta_info = meta
    return gathered.unpad(pad) if pad else gathered


def compute_device() -> torch.device:
    """Where this rank's role methods compute: its current CUDA device, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def dispatched(method: Callable, dp_size: int, dp_rank: int, dp_group: Any) -> Callable:
    """Wrap a bound registered method with its split/collect logic."""
    mode = dispatch_mode_of(method)

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        if mode is Dispatch.DP_COMPUTE:
            if not args or not isinstance(args[0], DataProto):
                raise TypeError(f"{method.__name__} is DP_COMPUTE: its first argument must be a DataProto")
            chunk, pad = split_for_dp(args[0], dp_size, dp_rank)
            out = method(chunk.to(compute_device()), *args[1:], **kwargs)
            if not isinstance(out, DataProto):
                return out
            # a method may return k rows per input row (generate_sequences: n samples per prompt, adjacent):
            # the padding rows then came back k times each
            k = len(out) // len(chunk) if len(chunk) else 1
            if len(chunk) and len(out) != k * len(chunk):
                raise RuntimeError(
                    f"{method.__name__} returned {len(out)} rows for {len(chunk)} inputs: DP_COMPUTE methods must "
                    "return a whole number of rows per input row"
                )
            return gather_from_dp(out, dp_group, pad * k).to("cpu")
        if mode is Dispatch.ONE_TO_ALL and dist.is_initialized() and dist.get_world_size() > 1:
            out = method(*args, **kwargs)
            if isinstance(out, DataProto):
                out.to("cpu")  # pickled for the broadcast: CUDA tensors would land on the sender's device index
            box = [out if dist.get_rank() == 0 else None]
            dist.broadcast_object_list(box, src=0)
            return box[0]
        return method(*args, **kwargs)

    return call
