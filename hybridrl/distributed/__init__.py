"""Process launch (torchrun / Slurm), parallel layout math, and Megatron parallel-state setup.

This package itself never imports Megatron: :func:`init_model_parallel` hands the layout to
``hybridrl.mcore.parallel_state``, the only place that does (together with the CPU shims it applies).
"""

from __future__ import annotations

from hybridrl.distributed.env import (
    LaunchError,
    ProcessEnv,
    default_backend,
    detect_env,
    expand_nodelist,
    init_distributed,
)
from hybridrl.distributed.layout import LayoutError, ParallelLayout, RankCoords


def init_model_parallel(layout: ParallelLayout, seed: int = 1234) -> None:
    """Initialise Megatron's process groups (and, without CUDA, the CPU shims) from ``layout``."""
    from hybridrl.mcore.parallel_state import initialize

    initialize(layout, seed=seed)


__all__ = [
    "LaunchError",
    "LayoutError",
    "ParallelLayout",
    "ProcessEnv",
    "RankCoords",
    "default_backend",
    "detect_env",
    "expand_nodelist",
    "init_distributed",
    "init_model_parallel",
]
