"""The multi-rank test harness: :func:`hybridrl.distributed.spawn.run_ranks` (N gloo ranks, results back)."""

from hybridrl.distributed.spawn import free_port, run_ranks

__all__ = ["free_port", "run_ranks"]
