"""The 3D-HybridEngine switch: Megatron training shards -> this rank's vLLM weights, bucket by bucket.

Owns the execution of a :class:`~hybridrl.hybrid_engine.planner.ReshardPlan` on the live process groups:
buckets move with one PP broadcast and one TP all_gather each (:mod:`~hybridrl.hybrid_engine.buckets`),
then ONE ``hybridrl.ops.block_copy`` per bucket writes every needed block straight into a preallocated flat
destination buffer (views per vLLM tensor). Tensors whose layouts agree are views of the training
parameters (no copy, no buffer). Collective: every rank of the world calls :meth:`HybridEngine.to_rollout`.

    engine = HybridEngine.from_role(actor, rollout_tp=1, bucket_bytes=64 << 20)
    weights = engine.to_rollout()          # {vLLM name: tensor} of this rank's rollout TP rank
    llm_model.load_weights(weights.items())
    engine.stats.as_dict()                 # bytes moved / copied / shared, bucket memory, seconds
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from hybridrl.distributed.layout import ParallelLayout
from hybridrl.hybrid_engine.buckets import BucketMover
from hybridrl.hybrid_engine.planner import ReshardPlan
from hybridrl.hybrid_engine.vllm_layout import PlanError
from hybridrl.mcore.reshard_source import TrainingSource, training_source
from hybridrl.ops import block_copy


@dataclass
class SwitchStats:
    """What one training -> rollout switch did on this rank."""

    buckets: int = 0
    collectives: int = 0
    """Broadcasts + all_gathers issued (at most 2 per bucket)."""
    bytes_moved: int = 0
    """Bytes the collectives brought into this rank's bucket buffers."""
    bytes_copied: int = 0
    """Bytes written into the destination buffer by block_copy."""
    bytes_shared: int = 0
    """Bytes of vLLM tensors handed out as views of training parameters (not copied)."""
    peak_extra_bytes: int = 0
    """Bucket buffers (the transport's memory on top of the training and rollout weights)."""
    dest_bytes: int = 0
    """The flat destination buffer (this rank's non-shared rollout weights)."""
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class HybridEngine:
    """Reshards this rank's Megatron chunks into its rollout TP rank's vLLM tensors.

    Args:
        chunks: this rank's model chunks (on the initialised Megatron parallel state).
        shape: the model (as built for training: ``padded_vocab_size`` for the training TP).
        train_layout: the training layout; None = read from the parallel state (a given one must match it).
        rollout_tp: vLLM's tensor-parallel size; rollout TP groups are consecutive global ranks.
        bucket_bytes: memory of the transport: all gathered bucket buffers together (both when ``overlap``);
            the switch's peak extra memory beyond the destination. Must hold the largest shard that moves
            x training TP x buffers.
        family: HF ``model_type`` (``llama``, ``mistral``, ``qwen2``, ``qwen3``).
        dtype: rollout dtype; None = the parameters'. Another dtype casts while packing and disables sharing.
        pad_vocab: vLLM-padded vocab rows; None = only at ``rollout_tp > 1`` (TP 1 gives HF's ``[vocab, h]``).
        overlap: double-buffer buckets (all_gather of bucket k+1 while copying bucket k).
    """

    def __init__(
        self,
        chunks: list[torch.nn.Module],
        shape: Any,
        train_layout: ParallelLayout | None = None,
        rollout_tp: int = 1,
        bucket_bytes: int = 256 * 2**20,
        family: str = "llama",
        dtype: torch.dtype | None = None,
        pad_vocab: bool | None = None,
        overlap: bool = True,
    ) -> None:
        src = training_source(chunks)
        _check_layout(train_layout, src.layout)
        if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise PlanError(f"hybrid_engine.bucket_bytes ({bucket_bytes!r}) must be a positive integer")
        dtypes = {p.dtype for p in src.params.values()}
        self.dtype = dtype or next(iter(dtypes))
        self.src, self.overlap = src, overlap
        self.rank = dist.get_rank()
        self.plan = ReshardPlan(
            shape,
            src.layout,
            rollout_tp,
            family=family,
            bucket_bytes=bucket_bytes,
            element_size=torch.empty(0, dtype=self.dtype).element_size(),
            fused_norms=src.fused_norms,
            pad_vocab=pad_vocab,
            share=dtypes == {self.dtype},
            slots=2 if overlap else 1,
        )
        self._check_params()
        self.rank_plan = self.plan.for_rank(src.pp_rank, src.tp_rank, self.rank % rollout_tp)
        self.device = next(iter(src.params.values())).device
        self.copies = [c.to(self.device) for c in self.rank_plan.copies]
        self.buffer: torch.Tensor | None = None
        self.stats = SwitchStats()

    @classmethod
    def from_role(cls, role: Any, rollout_tp: int = 1, **kwargs: Any) -> HybridEngine:
        """An engine for a :class:`hybridrl.mcore.roles.RoleModel` (its chunks, shape and HF model family)."""
        return cls(role.chunks, role.shape, rollout_tp=rollout_tp, family=role.hf_config.model_type, **kwargs)

    @property
    def rollout_rank(self) -> int:
        """This rank's rollout TP rank."""
        return self.rank_plan.rollout_rank

    def _check_params(self) -> None:
        for s in self.plan.sources.values():
            if s.stage != self.src.pp_rank:
                continue
            param = self.src.params.get(s.name)
            if param is None:
                raise PlanError(
                    f"the reshard plan expects {s.name} on pipeline stage {s.stage} but this rank's model lacks it; "
                    f"build the model for layout {self.src.layout.describe()}"
                )
            if tuple(param.shape) != s.shape:
                raise PlanError(
                    f"{s.name} has shape {list(param.shape)} but the plan expects {list(s.shape)}; pass the shape "
                    f"the model was built with (padded_vocab_size for tp={self.src.layout.tp})"
                )

    def to_rollout(self) -> dict[str, torch.Tensor]:
        """Run the switch (collective over the world); returns {vLLM name: tensor} in model order.

        Non-shared tensors are views of one flat buffer that is reused (overwritten) by the next switch;
        shared ones are views of the training parameters.
        """
        start = time.perf_counter()
        rp, stats = self.rank_plan, SwitchStats(buckets=len(self.plan.buckets))
        if self.buffer is None:
            self.buffer = torch.zeros(rp.dest_numel, dtype=self.dtype, device=self.device)  # vocab padding stays 0

        def count(nbytes: int) -> None:
            stats.collectives += 1
            stats.bytes_moved += nbytes

        mover = BucketMover(
            self.plan.buckets,
            self.src.params,
            self.src.pp_rank,
            self.src.layout.tp,
            self.src.tp_rank,
            self.src.tp_group,
            self.src.pp_group,
            self.src.pp_ranks,
            self.dtype,
            self.device,
            slots=2 if self.overlap else 1,
            on_collective=count,
        )
        n = len(self.plan.buckets)
        pending = mover.start(0) if n else None
        for k in range(n):
            following = mover.start(k + 1) if self.overlap and k + 1 < n else None
            gathered = pending.wait()
            if len(self.copies[k]):
                block_copy(gathered, self.buffer, self.copies[k])
            pending = following if self.overlap else (mover.start(k + 1) if k + 1 < n else None)
        stats.peak_extra_bytes = mover.buffer_bytes
        del mover
        out = self._views()
        es = self.buffer.element_size()
        stats.bytes_copied = rp.copied_numel * es
        stats.bytes_shared = sum(out[name].numel() * out[name].element_size() for name in rp.shared)
        stats.dest_bytes = self.buffer.numel() * es
        stats.seconds = time.perf_counter() - start
        self.stats = stats
        return out

    def _views(self) -> dict[str, torch.Tensor]:
        out = {}
        for d in self.plan.dests[self.rollout_rank]:
            if d.name in self.rank_plan.shared:
                src, offset = self.rank_plan.shared[d.name]
                flat = self.src.params[src].reshape(-1)
            else:
                flat, offset = self.buffer, self.rank_plan.offsets[d.name]
            out[d.name] = flat[offset : offset + d.numel].view(d.shape)
        return out

    def release(self) -> None:
        """Free the destination buffer (back to training); the next :meth:`to_rollout` reallocates it."""
        self.buffer = None


def _check_layout(given: ParallelLayout | None, actual: ParallelLayout) -> None:
    if given is None:
        return
    for axis in ("tp", "pp", "vpp", "world_size"):
        if getattr(given, axis) != getattr(actual, axis):
            raise PlanError(
                f"train_layout.{axis} ({getattr(given, axis)}) != the initialised parallel state's "
                f"({getattr(actual, axis)}); pass the layout the model was built on or None"
            )


__all__ = ["HybridEngine", "SwitchStats", "TrainingSource"]
