"""Pure-PyTorch reference of the reshard kernel: block copies between two flat buffers.

This is the contract the csrc/ kernels implement and the tests compare them against. A *plan* is an
``int64`` tensor of shape ``(n, 3)``; row ``i = (src_offset, dst_offset, length)`` copies
``src[src_offset : src_offset + length]`` to ``dst[dst_offset : dst_offset + length]`` (offsets and lengths
in elements of the buffers' common dtype). Destination ranges must not overlap; the copy order is
therefore irrelevant, which is what lets a kernel do all blocks in one parallel pass.

A *scatter plan* (``block_scatter``) has rows ``(src_offset, dst_index, dst_offset, length)`` and writes into
``dsts[dst_index].view(-1)``: several destination tensors (a vLLM model's parameters) in the same single pass.
"""

from __future__ import annotations

from collections.abc import Sequence

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


def check_scatter_plan(src: torch.Tensor, dsts: Sequence[torch.Tensor], plan: torch.Tensor) -> None:
    """Raise ValueError (one line) unless the scatter ``plan`` fits ``src`` and the destination tensors."""
    if src.dim() != 1 or not src.is_contiguous():
        raise ValueError(f"block_scatter needs a 1-D contiguous src, got {tuple(src.shape)}")
    for i, d in enumerate(dsts):
        if not d.is_contiguous() or d.dtype != src.dtype or d.device != src.device:
            raise ValueError(
                f"block_scatter destination {i} ({d.dtype}, {d.device}, contiguous={d.is_contiguous()}) must be "
                f"contiguous and share src's dtype {src.dtype} and device {src.device}"
            )
    if plan.dtype != torch.int64 or plan.dim() != 2 or plan.shape[1] != 4:
        raise ValueError(f"block_scatter plan must be int64 (n, 4), got {plan.dtype} {tuple(plan.shape)}")
    if plan.numel() == 0:
        return
    index = plan[:, 1]
    if int(plan.min()) < 0 or int(index.max()) >= len(dsts):
        raise ValueError(f"block_scatter plan has a negative entry or a destination index >= {len(dsts)}")
    sizes = torch.tensor([d.numel() for d in dsts], dtype=torch.int64)
    src_end = int((plan[:, 0] + plan[:, 3]).max())
    over = (plan[:, 2] + plan[:, 3]) > sizes[index]
    if src_end > src.numel() or bool(over.any()):
        row = int(over.nonzero()[0]) if bool(over.any()) else int((plan[:, 0] + plan[:, 3]).argmax())
        raise ValueError(
            f"block_scatter plan row {row} {plan[row].tolist()} leaves src ({src.numel()}) or its destination "
            f"({int(sizes[plan[row, 1]])} elements)"
        )


@torch.no_grad()  # targets may be parameters (vLLM's): writing them is not part of any graph
def block_scatter_reference(src: torch.Tensor, dsts: Sequence[torch.Tensor], plan: torch.Tensor) -> None:
    """Copy every block of the scatter ``plan`` from ``src`` into ``dsts`` (in place)."""
    check_scatter_plan(src, dsts, plan)
    flat = [d.view(-1) for d in dsts]
    for s, i, d, n in plan.tolist():
        flat[i][d : d + n].copy_(src[s : s + n])


@torch.no_grad()
def block_copy_reference(src: torch.Tensor, dst: torch.Tensor, plan: torch.Tensor) -> torch.Tensor:
    """Copy every block of ``plan`` from ``src`` into ``dst`` (in place); returns ``dst``."""
    check_plan(src, dst, plan)
    for s, d, n in plan.tolist():
        dst[d : d + n].copy_(src[s : s + n])
    return dst
