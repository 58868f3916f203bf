"""Ray worker groups: a role's registered methods as remote calls on the pool's host actors (single controller).

    resource_pool = RayResourcePool(process_on_nodes=[8, 8], use_gpu=True, max_colocate_count=1)
    actor_rollout_cls = RayClassWithInitArgs(cls=ActorRolloutWorker, init_args={"backend": "vllm"})
    actor_rollout_wg = MegatronRayWorkerGroup(resource_pool=resource_pool, ray_cls_with_init=actor_rollout_cls)
    out = actor_rollout_wg.compute_log_prob(batch)        # on the driver: the full result, as SPMD gives every rank

Every group of a pool builds its worker inside the SAME host actors (one per device), so the roles of a
device share one process and one torch.distributed world, as under SPMD. A call follows the method's
declared :class:`~hybridrl.workers.dispatch.Dispatch` mode, done by the driver instead of collectives:

- ``DP_COMPUTE``: the driver pads and chunks the DataProto over the role's DP ranks
  (:func:`~hybridrl.workers.dispatch.split_for_dp`'s split), sends chunk ``d`` to every host of DP rank ``d``
  (its TP/PP peers compute with it), takes the output of the first host of each DP rank, concatenates in
  DP-rank order and drops the padding; ``meta_info`` is rank 0's (what SPMD's rank 0 logs);
- ``ONE_TO_ALL`` / ``LOCAL``: every host runs the call with the same arguments; the driver returns rank 0's.

``group.method.remote(data)`` returns a :class:`DataFuture` instead: passed to a DP_COMPUTE method of a
group with the same DP split, its chunks go from host to host through Ray's object store without being
gathered on the driver.

A host that dies is named (role, rank, node) as soon as Ray sees it; the other hosts are not waited for.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable
from typing import Any

from hybridrl.errors import InputError
from hybridrl.protocol import DataProto
from hybridrl.workers.dispatch import Dispatch, dispatch_mode_of, mesh_of
from hybridrl.workers.group import ClassWithInitArgs
from hybridrl.workers.ray_pool import RayResourcePool, import_ray

_names = itertools.count()


class WorkerClassError(InputError, TypeError):
    """A class given as a worker that is not one, or init args that do not build it; one line."""


class WorkerDiedError(RuntimeError):
    """A host actor died (or its collective failed for a dead peer); the message names role, rank and node."""


def registered_methods(cls: type) -> list[str]:
    """The names of ``cls``'s methods decorated with :func:`~hybridrl.workers.dispatch.register`."""
    return [n for n in dir(cls) if not n.startswith("__") and dispatch_mode_of(getattr(cls, n, None)) is not None]


class RayClassWithInitArgs(ClassWithInitArgs):
    """A worker class and its constructor arguments, built later inside each host actor.

    ``init_args`` are constructor keyword arguments; those the constructor does not take are keys of the
    role's config section (``{"backend": "vllm"}`` is ``actor_rollout.backend``), and constructor arguments
    left out are taken from the run the pool serves (see :class:`RayResourcePool`'s ``config``).
    """

    complete_args = False  # checked by resolve(), against the pool's run

    def __init__(self, cls: type, *args: Any, init_args: dict[str, Any] | None = None, **kwargs: Any) -> None:
        cls = getattr(cls, "__ray_actor_class__", cls)  # a ray.remote(Worker) given as verl users write it
        if not isinstance(cls, type) or not registered_methods(cls):
            raise WorkerClassError(
                f"RayClassWithInitArgs(cls={getattr(cls, '__name__', cls)!r}) is not a worker class: it has no method "
                "decorated with @register(Dispatch...); pass a role worker such as ActorRolloutWorker"
            )
        super().__init__(cls, *args, init_args=init_args, **kwargs)

    @classmethod
    def wrap(cls, spec: ClassWithInitArgs) -> RayClassWithInitArgs:
        """The Ray form of an SPMD :class:`ClassWithInitArgs` (the trainer's ``role_workers``)."""
        return cls(spec.cls, *spec.args, **spec.kwargs)

    def resolve(self, pool: RayResourcePool) -> tuple[tuple, dict[str, Any]]:
        """The complete constructor arguments: as given when they bind, else completed from the pool's run."""
        try:
            inspect.signature(self.cls).bind(*self.args, **self.kwargs)
            return self.args, self.kwargs
        except TypeError as err:
            missing = str(err)
        params = inspect.signature(self.cls).parameters
        own = {k: v for k, v in self.kwargs.items() if k in params}
        config_keys = {k: v for k, v in self.kwargs.items() if k not in params}
        spec = run_of(pool).role_args(self.cls, config_keys, missing)
        bound = inspect.signature(self.cls).bind_partial(*spec.args, **spec.kwargs).arguments
        return (), {**bound, **own}


class DataFuture:
    """The result of ``group.method.remote(...)``, still on the hosts; :meth:`get` collects it on the driver."""

    def __init__(self, group: RayWorkerGroup, pending: dict[str, Any]) -> None:
        self.group, self.pending = group, pending

    def get(self) -> Any:
        if "value" not in self.pending:
            self.pending["value"] = self.group._collect(self.pending)
        return self.pending["value"]

    def chunks_for(self, group: RayWorkerGroup, mesh: str) -> list[Any] | None:
        """Per DP rank, the ObjectRef of this result's chunk, when ``group``'s ``mesh`` split is this one's
        (same DP ranks on the same hosts, no padding); else None (the driver gathers and splits again)."""
        p = self.pending
        if p["mode"] is not Dispatch.DP_COMPUTE or p["pad"] or group.pool is not self.group.pool:
            return None
        if [i[mesh] for i in group.dp_info] != [i[p["mesh"]] for i in self.group.dp_info]:
            return None
        return [p["futures"][rank] for rank in p["collectors"]]


class _RemoteMethod:
    def __init__(self, group: RayWorkerGroup, name: str) -> None:
        self.group, self.name = group, name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.group._collect(self.group._submit(self.name, args, kwargs))

    def remote(self, *args: Any, **kwargs: Any) -> DataFuture:
        return DataFuture(self.group, self.group._submit(self.name, args, kwargs))


class RayWorkerGroup:
    """A role on the pool's host actors: each registered method of its worker is a remote call (module doc).

    Args:
        resource_pool: the :class:`RayResourcePool`; its hosts are placed on first use.
        ray_cls_with_init: the worker class and its arguments.
        name: the role's name on the hosts (error messages name it); default: the class name.
    """

    megatron = False

    def __init__(self, resource_pool: RayResourcePool, ray_cls_with_init: ClassWithInitArgs,
                 name: str | None = None) -> None:  # fmt: skip
        if not isinstance(ray_cls_with_init, RayClassWithInitArgs):
            ray_cls_with_init = RayClassWithInitArgs.wrap(ray_cls_with_init)
        self.pool, self.cls = resource_pool, ray_cls_with_init.cls
        self.name = name or f"{self.cls.__name__}_{next(_names)}"
        args, kwargs = ray_cls_with_init.resolve(resource_pool)
        timeout = run_of(resource_pool).timeout_s if (self.megatron or resource_pool.run) else 600.0
        resource_pool.start(timeout)
        ray = import_ray()
        if self.megatron and not resource_pool.megatron:
            run = run_of(resource_pool)
            self._get([h.init_model_parallel.remote(run.layout, run.seed) for h in resource_pool.hosts], "setup")
            resource_pool.megatron = True
        cls_ref = ray.put(self.cls)  # pickled once for every host
        self.dp_info = self._get([h.build.remote(self.name, cls_ref, args, kwargs) for h in resource_pool.hosts],
                                 "__init__")  # fmt: skip

    @property
    def world_size(self) -> int:
        return self.pool.world_size

    def __getattr__(self, name: str) -> Callable:
        if name in ("pool", "cls", "name", "dp_info"):  # not set yet: avoid recursion
            raise AttributeError(name)
        if dispatch_mode_of(getattr(self.cls, name, None)) is None:
            raise AttributeError(
                f"{self.cls.__name__}.{name} is not a registered worker method; decorate it with @register(Dispatch...)"
            )
        return _RemoteMethod(self, name)

    # ---- dispatch on the driver ---------------------------------------------------------------------------
    def _submit(self, method: str, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
        fn = getattr(self.cls, method)
        mode, mesh, hosts = dispatch_mode_of(fn), mesh_of(fn), self.pool.hosts
        pending = {"mode": mode, "mesh": mesh, "method": method, "pad": 0}
        if mode is not Dispatch.DP_COMPUTE:
            pending["futures"] = [h.call.remote(self.name, method, r == 0, *args, **kwargs)
                                  for r, h in enumerate(hosts)]  # fmt: skip
            return pending
        ray = import_ray()
        ranks = [info[mesh][1] for info in self.dp_info]
        size = self.dp_info[0][mesh][0]
        collectors = [ranks.index(d) for d in range(size)]  # the first host of each DP rank returns its output
        data = args[0] if args else None
        chunks = data.chunks_for(self, mesh) if isinstance(data, DataFuture) else None
        if chunks is None:
            data = data.get() if isinstance(data, DataFuture) else data
            if not isinstance(data, DataProto):
                raise TypeError(f"{method} is DP_COMPUTE: its first argument must be a DataProto")
            padded, pending["pad"] = data.pad_to_divisor(size)
            parts = padded.chunk(size)
            pending["rows"] = [len(p) for p in parts]
            chunks = [ray.put(p) for p in parts]
        pending["collectors"] = collectors
        pending["futures"] = [h.call.remote(self.name, method, r in collectors, chunks[ranks[r]], *args[1:], **kwargs)
                              for r, h in enumerate(hosts)]  # fmt: skip
        return pending

    def _collect(self, pending: dict[str, Any]) -> Any:
        results = self._get(pending["futures"], pending["method"])
        if pending["mode"] is not Dispatch.DP_COMPUTE:
            return results[0]
        outs = [results[r] for r in pending["collectors"]]
        if not all(isinstance(o, DataProto) for o in outs):
            return outs[0]
        rows = pending.get("rows")
        k = len(outs[0]) // rows[0] if rows and rows[0] else 1
        if rows and any(len(o) != k * n for o, n in zip(outs, rows, strict=True)):
            raise RuntimeError(f"{pending['method']} returned {[len(o) for o in outs]} rows for {rows} inputs: "
                               "DP_COMPUTE methods must return a whole number of rows per input row")  # fmt: skip
        meta = outs[0].meta_info
        for o in outs:
            o.meta_info = {}
        out = outs[0] if all(len(o) == 0 for o in outs) else DataProto.concat(outs)
        out = out.unpad(pending["pad"] * k) if pending["pad"] else out
        out.meta_info = meta
        return out

    def _get(self, futures: list[Any], method: str) -> list[Any]:
        """Wait for every host's result; the first that fails ends the wait, with its role, rank and node named."""
        ray = import_ray()
        from ray.exceptions import RayActorError, RayTaskError

        from hybridrl.errors import _PEER_PATTERNS, is_peer_failure

        rank_of = {f: r for r, f in enumerate(futures)}
        results: dict[int, Any] = {}
        pending = list(futures)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            try:
                results[rank_of[ready[0]]] = ray.get(ready[0])
            except RayActorError:
                self._raise_dead(ready, rank_of, method, wait_s=0)
            except RayTaskError as err:
                cause = getattr(err, "cause", None)
                if isinstance(cause, InputError):  # the host's own error: its one line, not Ray's traceback text
                    raise cause from None
                text = str(getattr(err, "cause", err))
                if is_peer_failure(getattr(err, "cause", err)) or _PEER_PATTERNS.search(text):
                    self._raise_dead(pending, rank_of, method)  # the peer that died, when Ray knows it
                    where = self.pool.describe(rank_of[ready[0]])
                    first = text.strip().splitlines()[0] if text.strip() else ""
                    raise WorkerDiedError(f"the {self.name} worker on {where} lost a peer during {method}: "
                                          f"{first[:300]}; the run stopped") from None  # fmt: skip
                raise
        return [results[r] for r in range(len(futures))]

    def _raise_dead(self, pending: list[Any], rank_of: dict[Any, int], method: str, wait_s: float = 5.0) -> None:
        """Raise :class:`WorkerDiedError` for a host among ``pending`` that died (waiting ``wait_s`` for Ray to
        notice); return if none did."""
        ray = import_ray()
        from ray.exceptions import RayActorError

        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=wait_s) if pending else ([], [])
        for ref in ready:
            try:
                ray.get(ref)
            except RayActorError as err:
                raise WorkerDiedError(
                    f"the {self.name} worker's host {self.pool.describe(rank_of[ref])} died during {method} "
                    f"({type(err).__name__}); its node's Ray logs (/tmp/ray/session_latest/logs) say why; the run "
                    "stopped"
                ) from None
            except Exception:  # another peer's own failure: the dead one is what to name
                continue


class MegatronRayWorkerGroup(RayWorkerGroup):
    """A :class:`RayWorkerGroup` whose hosts hold Megatron's parallel state: the run's layout (the same TP x PP x DP
    groups and rollout replica groups as SPMD), initialised once per pool before the first such role is built."""

    megatron = True


def run_of(pool: RayResourcePool) -> Any:
    """The run the pool's groups serve (:class:`hybridrl.trainer.ray_launch.RayRun`), made from ``pool.config``
    on first use when the driver did not set it."""
    if pool.run is None:
        from hybridrl.trainer.ray_launch import RayRun

        pool.run = RayRun.for_pool(pool)
    return pool.run


def ray_role_group(pool: RayResourcePool, spec: ClassWithInitArgs) -> MegatronRayWorkerGroup:
    """One of the trainer's roles (:func:`~hybridrl.trainer.rl_trainer.role_workers`) on the pool's hosts, named by
    its role for error messages."""
    names = {"ActorRolloutWorker": "actor", "CriticWorker": "critic", "ReferenceWorker": "ref",
             "RewardModelWorker": "rm"}  # fmt: skip
    return MegatronRayWorkerGroup(pool, RayClassWithInitArgs.wrap(spec), name=names.get(spec.cls.__name__))
