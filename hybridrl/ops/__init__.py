"""Python entry points of the csrc/ kernels, each with its pure-PyTorch reference.

``block_copy(src, dst, plan)`` (one flat destination) and ``block_scatter(src, dsts, plan)`` (many destination
tensors) run the native reshard kernel when it is available (C++ / OpenMP on CPU, CUDA on
GPU; the installed ``hybridrl._reshard`` or a JIT build of csrc/, see :mod:`hybridrl.ops._native`) and
:func:`~hybridrl.ops.reshard_ref.block_copy_reference` otherwise.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence

import torch

from hybridrl.ops._native import native_module
from hybridrl.ops.reshard_ref import block_copy_reference, block_scatter_reference, check_plan, check_scatter_plan


def native_available() -> bool:
    """Whether :func:`block_copy` runs native code on CPU (builds it on first call; see ``HYBRIDRL_NATIVE``)."""
    return native_module() is not None


def _native_for(src: torch.Tensor):
    ext = native_module()
    if ext is None or not (src.device.type == "cpu" or (src.device.type == "cuda" and ext.with_cuda)):
        if ext is not None and src.device.type == "cuda":
            _warn_no_cuda_kernel()
        return None
    return ext


@functools.cache
def _warn_no_cuda_kernel() -> None:
    warnings.warn(
        "the native reshard kernel has no CUDA build here: CUDA switches run one PyTorch copy per block (a 70B "
        "switch has millions); build csrc/ with nvcc on a GPU machine (pip install -e . --no-build-isolation)",
        RuntimeWarning,
        stacklevel=4,
    )


def block_copy(src: torch.Tensor, dst: torch.Tensor, plan: torch.Tensor) -> torch.Tensor:
    """Copy ``plan``'s blocks from ``src`` into ``dst`` in place; returns ``dst``.

    Args:
        src: ``(src_numel,)`` contiguous buffer.
        dst: ``(dst_numel,)`` contiguous buffer of ``src``'s dtype and device.
        plan: ``(n, 3)`` int64 rows ``(src_offset, dst_offset, length)`` in elements; destinations must not
            overlap. Keep it on the CPU: the kernels read it on the host (a CUDA plan costs a synchronization).

    Raises:
        ValueError: the buffers or the plan break the contract (:func:`~hybridrl.ops.reshard_ref.check_plan`).
    """
    check_plan(src, dst, plan)
    ext = _native_for(src)
    if ext is None:
        return block_copy_reference(src, dst, plan)
    ext.block_copy(src, dst, plan)
    return dst


def block_scatter(src: torch.Tensor, dsts: Sequence[torch.Tensor], plan: torch.Tensor) -> None:
    """Copy ``plan``'s blocks from ``src`` into several destination tensors in place, in one kernel pass.

    Args:
        src: ``(src_numel,)`` contiguous buffer.
        dsts: contiguous tensors of ``src``'s dtype and device, any shape (offsets index ``dst.view(-1)``), e.g.
            a vLLM model's parameters: the hybrid engine writes straight into them, with no staging buffer.
        plan: ``(n, 4)`` int64 rows ``(src_offset, dst_index, dst_offset, length)`` in elements; destination
            ranges must not overlap (also across tensors that share memory). Keep it on the CPU.

    Raises:
        ValueError: the tensors or the plan break the contract (:func:`~hybridrl.ops.reshard_ref.check_scatter_plan`).
    """
    dsts = list(dsts)
    check_scatter_plan(src, dsts, plan)
    ext = _native_for(src)
    if ext is None:
        block_scatter_reference(src, dsts, plan)
    else:
        ext.block_scatter(src, dsts, plan)


__all__ = [
    "block_copy",
    "block_copy_reference",
    "block_scatter",
    "block_scatter_reference",
    "check_plan",
    "check_scatter_plan",
    "native_available",
]
