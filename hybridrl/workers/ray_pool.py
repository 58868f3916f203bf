"""Ray resource pools: placement groups from ``process_on_nodes`` and the host actors that run the roles.

    resource_pool = RayResourcePool(process_on_nodes=[8, 8], use_gpu=True, max_colocate_count=1)

One placement group per node (``STRICT_PACK``: its bundles on one node), one bundle per process (1 CPU, and
1 GPU with ``use_gpu``), and on each bundle one :class:`~hybridrl.workers.ray_host.WorkerHost` actor: the
process of one device, which hosts every role of that device (colocated, as one SPMD rank does). The hosts
form one ``torch.distributed`` world (NCCL on GPUs, gloo on CPUs); global ranks follow the pool's node order
and bundle order, and local ranks count the hosts that landed on the same Ray node.

The pool is checked against the cluster before anything is placed: a request the cluster cannot hold is a
one-line :class:`~hybridrl.workers.group.ResourceError`, not a placement group pending forever.
"""

from __future__ import annotations

import os
from typing import Any

from hybridrl.errors import InputError
from hybridrl.workers.group import ResourceError

READY_TIMEOUT_S = 120.0
"""Seconds to wait for the placement groups and the hosts to come up before the pool gives up."""
FORWARDED_ENV = ("OMP_NUM_THREADS", "PYTHONPATH", "HYBRIDRL_", "VLLM_", "HF_", "TRANSFORMERS_", "NCCL_", "GLOO_")
"""Driver environment variables (names or prefixes) the hosts get: the same threads, paths and library knobs."""


class RayNotInstalledError(InputError, ImportError):
    """Ray mode was asked for but Ray is not importable; the message names the extra to install."""


class RayConnectError(InputError, ConnectionError):
    """The Ray cluster named by ``RAY_ADDRESS`` cannot be joined; one line naming the address and the fix."""


def import_ray() -> Any:
    """The ``ray`` module, or a one-line error naming ``pip install hybridrl[ray]``."""
    try:
        import ray
    except ImportError as err:
        raise RayNotInstalledError(
            f"trainer.launcher=ray needs Ray, which is not importable here ({err}); pip install 'hybridrl[ray]' "
            "or launch SPMD with torchrun (trainer.launcher=spmd)"
        ) from None
    return ray


def connect(num_cpus: int | None = None) -> bool:
    """Join the Ray cluster at ``RAY_ADDRESS`` (or the one this process already joined), else start a local one
    with ``num_cpus`` (default: this machine's). Returns whether this call started it (then it shuts it down)."""
    ray = import_ray()
    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        address = os.environ["RAY_ADDRESS"]
        try:
            ray.init(address=address, log_to_driver=True)
        except (ConnectionError, RuntimeError, ray.exceptions.RayError) as err:
            text = str(err).strip()
            first = text.splitlines()[-1] if text else type(err).__name__
            raise RayConnectError(
                f"could not join the Ray cluster at RAY_ADDRESS={address} ({type(err).__name__}: {first[:240]}); "
                "check the address, and RAY_AUTH_MODE / RAY_AUTH_TOKEN if the cluster authenticates, or unset "
                "RAY_ADDRESS for a local Ray"
            ) from None
        return False
    # "local": a new Ray of our own, even where `ray start` left another one (ray.init would join that)
    ray.init(address="local", num_cpus=num_cpus or os.cpu_count(), include_dashboard=False, log_to_driver=True)
    return True


def forwarded_env(environ: Any = None) -> dict[str, str]:
    """The driver's variables of :data:`FORWARDED_ENV` (the hosts of a running cluster do not inherit them)."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in env.items() if any(k == p or (p.endswith("_") and k.startswith(p)) for p in FORWARDED_ENV)}


def check_pool_request(process_on_nodes: Any, use_gpu: bool, max_colocate_count: int) -> list[int]:
    """The pool's own arguments (no cluster needed); returns ``process_on_nodes`` as a list of ints."""
    if max_colocate_count != 1:
        raise ResourceError(
            f"max_colocate_count ({max_colocate_count}): hybridrl colocates every role of a device in ONE process "
            "(one actor per device); set max_colocate_count=1"
        )
    nodes = list(process_on_nodes) if isinstance(process_on_nodes, (list, tuple)) else None
    if not nodes or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in nodes):
        raise ResourceError(f"process_on_nodes ({process_on_nodes!r}) must list positive process counts per node, "
                            "e.g. [8, 8]")  # fmt: skip
    if not isinstance(use_gpu, bool):
        raise ResourceError(f"use_gpu ({use_gpu!r}) must be True or False")
    return nodes


def check_against_cluster(process_on_nodes: list[int], use_gpu: bool, nodes: list[dict[str, Any]]) -> None:
    """``process_on_nodes`` fits the alive nodes of ``ray.nodes()``: each placement group needs one node with
    that many CPUs (and GPUs); the largest requests are matched with the largest nodes."""
    unit = "GPU" if use_gpu else "CPU"
    have = sorted((int(n.get("Resources", {}).get(unit, 0)) for n in nodes if n.get("Alive", True)), reverse=True)
    want = sorted(process_on_nodes, reverse=True)
    short = [(w, h) for w, h in zip(want, have + [0] * len(want), strict=False) if w > h]
    if short:
        need, got = short[0]
        fix = "set use_gpu=False on a CPU cluster, or RAY_ADDRESS to a GPU one" if use_gpu and not any(have) else (
            "lower process_on_nodes or add nodes to the Ray cluster")  # fmt: skip
        raise ResourceError(
            f"process_on_nodes {process_on_nodes} (use_gpu={use_gpu}) needs a node with {need} {unit}s per placement "
            f"group, but the Ray cluster's nodes have {have or [0]} {unit}s (node {len(want) - len(short)} of the "
            f"request gets {got}); {fix}"
        )


class RayResourcePool:
    """Processes per node for the roles, placed on a Ray cluster (one actor per device, every role inside).

    Args:
        process_on_nodes: processes (devices) per node, e.g. ``[8, 8]``; one ``STRICT_PACK`` placement group each.
        use_gpu: one GPU per process (NCCL) or CPU processes (gloo).
        max_colocate_count: processes per device; only 1 (all roles of a device share one process).
        config: the run the pool's groups serve when a worker's init args leave constructor arguments out
            (a :class:`~hybridrl.config.RunConfig` or a config name); None = the packaged ``tiny_cpu.yaml`` demo.
    """

    def __init__(self, process_on_nodes: list[int], use_gpu: bool = False, max_colocate_count: int = 1,
                 config: Any = None) -> None:  # fmt: skip
        self.process_on_nodes = check_pool_request(process_on_nodes, use_gpu, max_colocate_count)
        self.use_gpu, self.max_colocate_count, self.config = use_gpu, max_colocate_count, config
        self.run: Any = None  # the run context (model, layout, tokenizer) its groups build roles from
        self.hosts: list[Any] = []
        self.where: list[dict[str, Any]] = []  # per rank: node id, ip, hostname, pid, gpu ids
        self.placement_groups: list[Any] = []
        self.megatron = False  # whether the hosts hold Megatron's parallel state
        self.started_ray = connect(num_cpus=max(self.world_size, os.cpu_count() or 1))
        check_against_cluster(self.process_on_nodes, use_gpu, import_ray().nodes())

    @property
    def world_size(self) -> int:
        return sum(self.process_on_nodes)

    def describe(self, rank: int) -> str:
        """``rank 1 on node 10.0.0.2 (pid 1234)`` for error messages."""
        w = self.where[rank] if rank < len(self.where) else {}
        return f"rank {rank} on node {w.get('hostname', '?')} ({w.get('ip', '?')}, pid {w.get('pid', '?')})"

    def start(self, timeout_s: float = 600.0) -> None:
        """Place the hosts and join them in one torch.distributed world (idempotent). Collectives in it wait
        ``timeout_s`` (``trainer.collective_timeout_s``)."""
        if self.hosts:
            return
        ray = import_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from hybridrl.workers.ray_host import WorkerHost

        bundle = {"CPU": 1, **({"GPU": 1} if self.use_gpu else {})}
        self.placement_groups = [placement_group([bundle] * n, strategy="STRICT_PACK") for n in self.process_on_nodes]
        ready, _ = ray.wait([pg.ready() for pg in self.placement_groups], num_returns=len(self.placement_groups),
                            timeout=READY_TIMEOUT_S)  # fmt: skip
        if len(ready) < len(self.placement_groups):
            raise ResourceError(
                f"process_on_nodes {self.process_on_nodes}: {len(ready)} of {len(self.placement_groups)} placement "
                f"groups were placed within {READY_TIMEOUT_S:g} s (resources held by another job?); free them or "
                "lower process_on_nodes"
            )
        remote = ray.remote(WorkerHost)
        env = forwarded_env()
        for pg in self.placement_groups:
            for index in range(pg.bundle_count):
                strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)
                options = {"num_cpus": 1, "num_gpus": 1 if self.use_gpu else 0, "scheduling_strategy": strategy,
                           "runtime_env": {"env_vars": env}}  # fmt: skip
                self.hosts.append(remote.options(**options).remote())
        self.where = ray.get([h.where.remote() for h in self.hosts], timeout=READY_TIMEOUT_S)
        launch = self._launch_env(ray.get(self.hosts[0].free_port.remote()))
        ray.get([h.init_distributed.remote(launch[r], timeout_s) for r, h in enumerate(self.hosts)])

    def _launch_env(self, port: int) -> list[dict[str, str]]:
        """Each rank's torchrun-style variables: ranks in pool order, local ranks per Ray node, the rendezvous on
        rank 0's node; on GPUs each host sees its node's pool GPUs in local-rank order (so LOCAL_RANK selects its own
        and NCCL / vLLM see their peers)."""
        by_node: dict[str, list[int]] = {}
        for rank, w in enumerate(self.where):
            by_node.setdefault(w["node_id"], []).append(rank)
        out = []
        for rank, w in enumerate(self.where):
            peers = by_node[w["node_id"]]
            env = {"RANK": str(rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(peers.index(rank)),
                   "LOCAL_WORLD_SIZE": str(len(peers)), "MASTER_ADDR": self.where[0]["ip"],
                   "MASTER_PORT": str(port)}  # fmt: skip
            if self.use_gpu:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(str(self.where[p]["gpu_ids"][0]) for p in peers)
            out.append(env)
        return out

    def shutdown(self) -> None:
        """Kill the hosts, remove the placement groups, and stop Ray if this pool started it."""
        ray = import_ray()
        if not ray.is_initialized():
            return
        from ray.util.placement_group import remove_placement_group

        for h in self.hosts:
            ray.kill(h)
        for pg in self.placement_groups:
            remove_placement_group(pg)
        self.hosts, self.placement_groups, self.megatron = [], [], False
        if self.run is not None:
            self.run.close()
        if self.started_ray:
            ray.shutdown()
