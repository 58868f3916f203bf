"""Pure-PyTorch reference of the reshard kernel: block copies between two flat buffers.

This is the contract the csrc/ kernels implement and the tests compare them against. A *plan* is an
``int64`` tensor of shape ``(n, 3)``; row ``i = (src_offset, dst_offset, length)`` copies
``src[src_offset : src_offset + length]`` to ``dst[dst_offset : dst_offset + length]`` (offsets and lengths
in elements of the buffers' common dtype). Destination ranges must not overlap; the copy order is
therefore irrelevant, which is what lets a kernel do all blocks in one parallel pass.
"""

from __future__ import annotations

import torch


def check_plan(src: torch.Tensor, dst: torch.Tensor, plan: torch.Tensor) -> None:
    """Raise ValueError (one line, naming the numbers) unless ``plan`` fits ``src`` and ``dst``."""
    if src.dim() != 1 or dst.dim() != 1 or not src.is_contiguous() or not dst.is_contiguous():
        raise ValueError(f"block_copy needs 1-D contiguous buffers, got src {tuple(src.shape)} dst {tuple(dst.shape)}")
    if src.dtype != dst.dtype:
        raise ValueError(f"block_copy needs one dtype, got src {src.dtype} and dst {dst.dtype}")
    if plan.dtype != torch.int64 or plan.dim() != 2 or plan.shape[1] != 3:
        raise ValueError(f"block_copy plan must be int64 (n, 3), got {plan.dtype} {tuple(plan.shape)}")
    if plan.numel() == 0:
        return
    src_end = int((plan[:, 0] + plan[:, 2]).max())
    dst_end = int((plan[:, 1] + plan[:, 2]).max())
    if int(plan.min()) < 0 or src_end > src.numel() or dst_end > dst.numel():
        raise ValueError(
            f"block_copy plan reaches src {src_end} / dst {dst_end} elements, buffers hold {src.numel()} / "
            f"{dst.numel()} (or has a negative entry)"
        )


def block_copy_reference(src: torch.Tensor, dst: torch.Tensor, plan: torch.Tensor) -> torch.Tensor:
    """Copy every block of ``plan`` from ``src`` into ``dst`` (in place); returns ``dst``."""
    check_plan(src, dst, plan)
    for s, d, n in plan.tolist():
        dst[d : d + n].copy_(src[s : s + n])
    return dst
