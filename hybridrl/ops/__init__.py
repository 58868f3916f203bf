"""Python entry points of the csrc/ kernels, each with its pure-PyTorch reference.

``block_copy(src, dst, plan)`` runs the native reshard kernel when it is available (C++ / OpenMP on CPU, CUDA on
GPU; the installed ``hybridrl._reshard`` or a JIT build of csrc/, see :mod:`hybridrl.ops._native`) and
:func:`~hybridrl.ops.reshard_ref.block_copy_reference` otherwise.
"""

from __future__ import annotations

import torch

from hybridrl.ops._native import native_module
from hybridrl.ops.reshard_ref import block_copy_reference, check_plan


def native_available() -> bool:
    """Whether :func:`block_copy` runs native code on CPU (builds it on first call; see ``HYBRIDRL_NATIVE``)."""
    return native_module() is not None


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
    ext = native_module()
    if ext is None or not (src.device.type == "cpu" or (src.device.type == "cuda" and ext.with_cuda)):
        return block_copy_reference(src, dst, plan)
    ext.block_copy(src, dst, plan)
    return dst


__all__ = ["block_copy", "block_copy_reference", "check_plan", "native_available"]
