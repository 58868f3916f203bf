"""The process of one device in Ray mode: a Ray actor that hosts every role of that device.

A :class:`WorkerHost` is what one SPMD rank is under torchrun: it joins the pool's torch.distributed world
(:meth:`init_distributed`), holds Megatron's parallel state (:meth:`init_model_parallel`), builds the role
workers on it in the trainer's order (:meth:`build`), and runs their registered methods on what the driver
sends (:meth:`call`): a DP_COMPUTE method gets its data-parallel chunk, already split by the driver exactly
as :func:`~hybridrl.workers.dispatch.split_for_dp` splits it under SPMD, and returns its output to the driver
only where asked (one rank per DP rank), instead of all-gathering it over the world.

Nothing here imports Ray at module level: the pool makes the class remote (``ray.remote(WorkerHost)``).
"""

from __future__ import annotations

import os
import socket
from typing import Any

import torch

from hybridrl.protocol import DataProto
from hybridrl.workers.dispatch import compute_device


def _dp_info(worker: Any, mesh: str) -> tuple[int, int]:
    """(size, rank) of ``worker``'s data-parallel split on ``mesh``, as :class:`WorkerGroup` reads it."""
    import torch.distributed as dist

    prefix = "rollout_dp" if mesh == "rollout" else "dp"
    if hasattr(worker, f"{prefix}_size"):
        return int(getattr(worker, f"{prefix}_size")), int(getattr(worker, f"{prefix}_rank"))
    return dist.get_world_size(), dist.get_rank()


class WorkerHost:
    """One device's process: its rank of the world and the role workers built on it (see the module doc)."""

    def __init__(self) -> None:
        from hybridrl import console

        console.install()  # before Megatron / vLLM load here: their known-harmless warnings, as under torchrun
        from hybridrl.trainer import startup

        startup.keep_freed_memory()  # CPU runs: the heap reused pass after pass, as a torchrun rank's
        threads = os.environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:  # Ray imported torch before this actor's variables applied
            torch.set_num_threads(int(threads))
        self.workers: dict[str, Any] = {}
        self.megatron = False

    def where(self) -> dict[str, Any]:
        """Where this host runs: Ray node id, IP, host name, pid, assigned GPU ids."""
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
                "hostname": socket.gethostname(), "pid": os.getpid(), "gpu_ids": ray.get_gpu_ids()}  # fmt: skip

    def free_port(self) -> int:
        """A TCP port free on this node (rank 0's is the world's rendezvous)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def init_distributed(self, launch_env: dict[str, str], timeout_s: float) -> None:
        """Join the world as torchrun's variables ``launch_env`` say (vLLM's external launcher reads them too)."""
        from hybridrl.distributed import init_distributed

        os.environ.update(launch_env)
        init_distributed(timeout_s=timeout_s)

    def init_model_parallel(self, layout: Any, seed: int) -> None:
        """Megatron's groups and the rollout replica groups of ``layout`` (once), seeded as an SPMD rank is."""
        if not self.megatron:
            from hybridrl.distributed import init_model_parallel

            init_model_parallel(layout, seed=seed)
            self.megatron = True

    def build(self, role: str, cls: type, args: tuple, kwargs: dict[str, Any]) -> dict[str, tuple[int, int]]:
        """Build ``role``'s worker here; returns its (DP size, DP rank) per mesh ("train", "rollout")."""
        from hybridrl.distributed import apply_collective_timeout

        if role in self.workers:
            raise ValueError(f"role {role!r} is already built on this host; give each worker group its own name")
        worker = cls(*args, **kwargs)
        self.workers[role] = worker
        apply_collective_timeout()  # the groups the worker (vLLM) made get the run's timeout too
        return {mesh: _dp_info(worker, mesh) for mesh in ("train", "rollout")}

    def call(self, role: str, method: str, collect: bool, *args: Any, **kwargs: Any) -> Any:
        """Run ``role.method``; a DataProto first argument (a DP chunk) is moved to this rank's compute device and
        a DataProto result comes back on the CPU. Returns None where ``collect`` is false (a TP/PP peer's copy)."""
        if args and isinstance(args[0], DataProto):
            args = (args[0].to(compute_device()), *args[1:])
        out = getattr(self.workers[role], method)(*args, **kwargs)
        if isinstance(out, DataProto):
            out = out.to("cpu")
        return out if collect else None

    def pid(self) -> int:
        return os.getpid()
