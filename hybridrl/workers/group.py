"""Resource pools and worker groups: the role API of docs/architecture.md on top of SPMD processes.

    pool = ResourcePool(process_on_nodes=[8, 8], use_gpu=True, max_colocate_count=1)
    actor = WorkerGroup(pool, ClassWithInitArgs(ActorRolloutWorker, config=cfg))
    out = actor.compute_log_prob(batch)      # dispatched as the method declares; full result on every rank

Every process builds the same pool and groups; a :class:`WorkerGroup` holds this process's worker instance
and exposes its registered methods wrapped with their dispatch (see :mod:`hybridrl.workers.dispatch`).
The pool is validated against the launched world, so a config that asks for 16 processes fails at once
under a 2-process launch instead of hanging in the first collective.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hybridrl.errors import InputError
from hybridrl.workers.dispatch import dispatch_mode_of, dispatched, mesh_of


class ResourceError(InputError, ValueError):
    """A resource pool that does not match the launch; the message names the numbers and the fix."""


@dataclass
class ResourcePool:
    """Processes per node that the roles share.

    Args:
        process_on_nodes: processes (GPUs) on each node, e.g. ``[8, 8]``.
        use_gpu: whether the processes drive GPUs (NCCL) or run on CPU (gloo).
        max_colocate_count: processes per device; the SPMD backend colocates every role in ONE process (1).
    """

    process_on_nodes: list[int]
    use_gpu: bool = False
    max_colocate_count: int = 1
    validated: bool = False

    @property
    def world_size(self) -> int:
        return sum(self.process_on_nodes)

    def validate(self, world_size: int | None = None, local_world_size: int | None = None) -> None:
        """Check the pool against the launch (defaults: torch.distributed world, LOCAL_WORLD_SIZE)."""
        if not self.process_on_nodes or any(n < 1 for n in self.process_on_nodes):
            raise ResourceError(f"process_on_nodes ({self.process_on_nodes}) must list positive counts per node")
        if self.max_colocate_count != 1:
            raise ResourceError(
                f"resources.max_colocate_count ({self.max_colocate_count}): the SPMD backend runs every role in one "
                f"process per device; set 1 (Ray mode colocates every role of a device in one actor too)"
            )
        if world_size is None and dist.is_initialized():
            world_size = dist.get_world_size()
        if world_size is not None and world_size != self.world_size:
            raise ResourceError(
                f"process_on_nodes {self.process_on_nodes} sums to {self.world_size} but the launch has "
                f"world_size {world_size}; set resources.process_on_nodes or launch {self.world_size} processes"
            )
        if local_world_size is None and "LOCAL_WORLD_SIZE" in os.environ:
            local_world_size = int(os.environ["LOCAL_WORLD_SIZE"])
        uniform = len(set(self.process_on_nodes)) == 1
        if local_world_size is not None and uniform and local_world_size != self.process_on_nodes[0]:
            raise ResourceError(
                f"process_on_nodes {self.process_on_nodes} puts {self.process_on_nodes[0]} processes on a node "
                f"but this node launched {local_world_size}; match torchrun --nproc-per-node"
            )
        if self.use_gpu and not torch.cuda.is_available():
            raise ResourceError("use_gpu (True) but CUDA is not available here; set use_gpu=False for CPU runs")


class ClassWithInitArgs:
    """A worker class and the arguments to build it with, built lazily in each process.

    ``ClassWithInitArgs(cls, *args, **kwargs)`` or, as verl writes it, ``ClassWithInitArgs(cls=..., init_args={...})``
    (``init_args``: constructor keyword arguments). Arguments that do not fit the constructor are refused here, in
    one line, not at the first build.
    """

    complete_args = True  # the Ray form completes missing arguments from its pool's run instead

    def __init__(self, cls: type, *args: Any, init_args: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if init_args is not None and not isinstance(init_args, dict):
            raise TypeError(f"init_args ({init_args!r}) must be a dict of {getattr(cls, '__name__', cls)}'s keyword "
                            "arguments")  # fmt: skip
        both = sorted(set(init_args or {}) & set(kwargs))
        if both:
            raise TypeError(f"{both[0]!r} is given both in init_args and as a keyword argument; give it once")
        self.cls, self.args, self.kwargs = cls, args, {**(init_args or {}), **kwargs}
        if self.complete_args:
            import inspect

            try:
                inspect.signature(cls).bind(*self.args, **self.kwargs)
            except TypeError as err:
                raise TypeError(f"ClassWithInitArgs({getattr(cls, '__name__', cls)}): {err}; pass the constructor's "
                                "arguments (positional, keyword or init_args={...})") from None  # fmt: skip

    def build(self) -> Any:
        return self.cls(*self.args, **self.kwargs)


class WorkerGroup:
    """This process's instance of a role worker, with its registered methods dispatched.

    The worker tells the group its data-parallel layout through ``dp_size``, ``dp_rank`` and ``dp_group``
    attributes (and ``rollout_dp_*`` for generation); absent, the whole world is one DP group.
    """

    def __init__(self, resource_pool: ResourcePool, cls_with_init: ClassWithInitArgs) -> None:
        if not resource_pool.validated:  # once, before any role is built (vLLM rewrites LOCAL_WORLD_SIZE)
            resource_pool.validate()
            resource_pool.validated = True
        self.resource_pool = resource_pool
        self.worker = cls_with_init.build()

    @property
    def world_size(self) -> int:
        return self.resource_pool.world_size

    def _dp(self, mesh: str = "train") -> tuple[int, int, Any]:
        w = self.worker
        prefix = "rollout_dp" if mesh == "rollout" else "dp"
        if hasattr(w, f"{prefix}_size"):
            return getattr(w, f"{prefix}_size"), getattr(w, f"{prefix}_rank"), getattr(w, f"{prefix}_group")
        if dist.is_initialized():
            return dist.get_world_size(), dist.get_rank(), None
        return 1, 0, None

    def __getattr__(self, name: str) -> Callable:
        if name in ("worker", "resource_pool"):  # not built yet: avoid recursion
            raise AttributeError(name)
        method = getattr(self.worker, name)
        if not callable(method) or dispatch_mode_of(method) is None:
            raise AttributeError(
                f"{type(self.worker).__name__}.{name} is not a registered worker method; decorate it with "
                f"@register(Dispatch...)"
            )
        return dispatched(method, *self._dp(mesh_of(method)))
