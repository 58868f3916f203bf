"""Process launch (torchrun / Slurm), the run's parallel layout (training and generation groups), and Megatron
parallel-state setup.

This package itself never imports Megatron: :func:`init_model_parallel` hands the layout to
``hybridrl.mcore.parallel_state``, the only place that does (together with the CPU shims it applies), which builds
the training groups and the rollout replica groups from it.
The launch helpers (which import torch) load on first use, so config validation stays torch-free.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hybridrl.distributed.layout import LayoutError, ParallelLayout, RankCoords, RolloutCoords

if TYPE_CHECKING:
    from hybridrl.distributed.env import (
        LaunchError,
        ProcessEnv,
        apply_collective_timeout,
        collective_timeout_s,
        default_backend,
        detect_env,
        end_distributed,
        expand_nodelist,
        init_distributed,
    )

_ENV_NAMES = {"LaunchError", "ProcessEnv", "apply_collective_timeout", "collective_timeout_s", "default_backend",
              "detect_env", "end_distributed", "expand_nodelist", "init_distributed"}  # fmt: skip


def __getattr__(name: str) -> Any:
    if name in _ENV_NAMES:
        return getattr(importlib.import_module("hybridrl.distributed.env"), name)
    raise AttributeError(f"module 'hybridrl.distributed' has no attribute {name!r}")


def init_model_parallel(layout: ParallelLayout, seed: int = 1234, timeout_s: float | None = None) -> None:
    """Initialise Megatron's process groups, the rollout replica groups (and, without CUDA, the CPU shims) from
    ``layout``; their collectives wait ``timeout_s`` (default: the default group's, ``trainer.collective_timeout_s``
    in a run)."""
    from hybridrl.distributed.env import collective_timeout_s
    from hybridrl.mcore.parallel_state import initialize

    initialize(layout, seed=seed, timeout_s=timeout_s or collective_timeout_s())


__all__ = [
    "LaunchError",
    "LayoutError",
    "ParallelLayout",
    "ProcessEnv",
    "RankCoords",
    "RolloutCoords",
    "apply_collective_timeout",
    "collective_timeout_s",
    "default_backend",
    "detect_env",
    "end_distributed",
    "expand_nodelist",
    "init_distributed",
    "init_model_parallel",
]
