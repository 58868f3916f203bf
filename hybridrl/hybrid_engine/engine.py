"""The 3D-HybridEngine switch: Megatron training shards -> this rank's vLLM weights, bucket by bucket.

Owns the execution of a :class:`~hybridrl.hybrid_engine.planner.ReshardPlan` on the live process groups:
each rank receives only the blocks it needs and does not hold, with one all-to-all per bucket over the
model-parallel group and none where every rank regroups locally (``transport="need"``,
:mod:`~hybridrl.hybrid_engine.need_plan`); ``transport="gather"`` moves every TP shard to every rank instead (one
PP broadcast and one TP all_gather per bucket, :mod:`~hybridrl.hybrid_engine.buckets`). Then ONE kernel call per
bucket writes every needed block straight to its destination: a preallocated flat
buffer (views per vLLM tensor, ``hybridrl.ops.block_copy``), or, given ``into=`` (vLLM's own parameters),
those tensors themselves (``hybridrl.ops.block_scatter``: no staging buffer at all). Tensors whose layouts
agree are views of the training parameters (no copy, no buffer). Collective: every rank of the world calls
:meth:`HybridEngine.to_rollout`. vLLM's stacked expert tensors (``w13_weight`` / ``w2_weight``, MoE families) are
planned per expert part; the engine hands them in and out whole (``into=`` and the result hold the stacked
tensors; the parts are back to back in either).

    engine = HybridEngine.from_role(actor, layout, bucket_bytes=64 << 20)   # layout: the run's ParallelLayout
    weights = engine.to_rollout()          # {vLLM name: tensor} of this rank's rollout TP rank
    llm_model.load_weights(weights.items())
    engine.to_rollout(into=params)         # or: write into {vLLM name: vLLM's parameter} in place
    engine.stats.as_dict()                 # bytes moved / copied / shared, bucket memory, seconds
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from hybridrl.distributed.layout import ParallelLayout
from hybridrl.hybrid_engine import need_plan
from hybridrl.hybrid_engine.buckets import BucketMover, NeedMover
from hybridrl.hybrid_engine.planner import TRANSPORTS, ReshardPlan
from hybridrl.hybrid_engine.probe import SwitchProbe
from hybridrl.hybrid_engine.vllm_layout import PlanError, split_part
from hybridrl.mcore.reshard_source import TrainingSource, training_source
from hybridrl.ops import block_copy, block_scatter


@dataclass
class SwitchStats:
    """What one training -> rollout switch did on this rank."""

    buckets: int = 0
    collectives: int = 0
    """Collectives issued: all-to-alls (need transport, at most 1 per bucket) or broadcasts + all_gathers
    (gather transport, at most 2 per bucket)."""
    bytes_moved: int = 0
    """Bytes the collectives brought into this rank's bucket buffers (= ``bytes_received``)."""
    bytes_sent: int = 0
    """Bytes this rank sent to other ranks."""
    bytes_received: int = 0
    """Bytes this rank received from other ranks."""
    bytes_needed: int = 0
    """Bytes of this rank's copied rollout tensors that come from shards it does not hold (the least any
    transport must receive; the need transport receives exactly this)."""
    bytes_copied: int = 0
    """Bytes written into the destination buffer by block_copy."""
    bytes_shared: int = 0
    """Bytes of vLLM tensors handed out as views of training parameters (not copied)."""
    bytes_direct: int = 0
    """Bytes written straight into the ``into=`` tensors (vLLM's parameters), shared layouts included."""
    peak_extra_bytes: int = 0
    """Bucket buffers (the transport's memory on top of the training and rollout weights)."""
    dest_bytes: int = 0
    """The flat destination buffer (this rank's non-shared rollout weights that have no ``into=`` tensor)."""
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class HybridEngine:
    """Reshards this rank's Megatron chunks into its rollout TP rank's vLLM tensors.

    Args:
        chunks: this rank's model chunks (on the initialised Megatron parallel state).
        shape: the model (as built for training: ``padded_vocab_size`` for the training TP).
        layout: the run's layout: the training groups the chunks live on (checked against the parallel state)
            and the generation groups to reshard into (``layout.rollout_tp``; ``layout.with_rollout_tp(1)`` for
            whole HF-layout tensors on every rank).
        bucket_bytes: memory of the transport: all gathered bucket buffers together (both when ``overlap``);
            the switch's peak extra memory beyond the destination. Must hold the largest shard that moves
            x training TP x buffers.
        family: HF ``model_type`` (``llama``, ``mistral``, ``qwen2``, ``qwen3``).
        dtype: rollout dtype; None = the parameters'. Another dtype casts while packing and disables sharing.
        pad_vocab: vLLM-padded vocab rows; None = only at ``layout.rollout_tp > 1`` (TP 1 gives HF's ``[vocab, h]``).
        overlap: double-buffer buckets (the collective of bucket k+1 while copying bucket k).
        transport: ``"need"`` (each rank receives only what it needs and does not hold) or ``"gather"`` (every
            TP shard to every rank; the older path, kept as a baseline).
        expert_parallel: the engine runs vLLM's ``enable_expert_parallel`` (whole experts per rollout rank).
    """

    def __init__(
        self,
        chunks: list[torch.nn.Module],
        shape: Any,
        layout: ParallelLayout,
        bucket_bytes: int = 256 * 2**20,
        family: str = "llama",
        dtype: torch.dtype | None = None,
        pad_vocab: bool | None = None,
        overlap: bool = True,
        transport: str = "need",
        expert_parallel: bool = False,
    ) -> None:
        src = training_source(chunks, layout)
        if transport not in TRANSPORTS:
            raise PlanError(f"hybrid_engine transport ({transport!r}) must be one of {list(TRANSPORTS)}")
        if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise PlanError(f"hybrid_engine.bucket_bytes ({bucket_bytes!r}) must be a positive integer")
        dtypes = {p.dtype for p in src.params.values()}
        self.dtype = dtype or next(iter(dtypes))
        self.src, self.overlap = src, overlap
        self.rank = dist.get_rank()
        self.plan = ReshardPlan(
            shape,
            layout,
            family=family,
            bucket_bytes=bucket_bytes,
            element_size=torch.empty(0, dtype=self.dtype).element_size(),
            fused_norms=src.fused_norms,
            pad_vocab=pad_vocab,
            share=dtypes == {self.dtype},
            slots=2 if overlap else 1,
            transport=transport,
            expert_parallel=expert_parallel,
        )
        self._check_params()
        self.rank_plan = self.plan.for_rank(src.pp_rank, src.tp_rank, layout.rollout_coords(self.rank).tp)
        self.need = need_plan.for_rank(self.plan, self.rank, src.mp_ranks) if transport == "need" else None
        self.needed_numel = (
            self.need.needed_numel
            if self.need is not None
            else need_plan.needed_numel(self.plan, src.pp_rank, src.tp_rank, src.ep_rank, self.rollout_rank)
        )
        if self.need is not None:  # the same destinations, read from [local bucket | received blocks]
            self.rank_plan = dataclasses.replace(self.rank_plan, copies=self.need.copies)
        self.device = next(iter(src.params.values())).device
        self.copies = self.rank_plan.copies  # host tensors: the kernels read plans on the host
        self.buffer: torch.Tensor | None = None
        self._scatter: _ScatterPlan | None = None
        self._dests = {d.name: d for d in self.plan.dests[self.rollout_rank]}
        self._parts: dict[str, list[str]] = {}  # stacked expert tensor -> its part names, in expert order
        for name in self._dests:
            if split_part(name):
                self._parts.setdefault(split_part(name)[0], []).append(name)
        self.stats = SwitchStats()
        self._probe: SwitchProbe | None = None  # built on the first check()

    @classmethod
    def from_role(cls, role: Any, layout: ParallelLayout, **kwargs: Any) -> HybridEngine:
        """An engine for a :class:`hybridrl.mcore.roles.RoleModel` (its chunks, shape and HF model family)."""
        return cls(role.chunks, role.shape, layout, family=role.hf_config.model_type, **kwargs)

    @property
    def rollout_rank(self) -> int:
        """This rank's rollout TP rank."""
        return self.rank_plan.rollout_rank

    def _check_params(self) -> None:
        for s in self.plan.sources.values():
            if s.stage != self.src.pp_rank or s.ep_rank not in (None, self.src.ep_rank):
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

    def to_rollout(self, into: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Run the switch (collective over the world); returns {vLLM name: tensor} in model order.

        Without ``into``, non-shared tensors are views of one flat buffer that is reused (overwritten) by the
        next switch; shared ones are views of the training parameters.

        Args:
            into: {vLLM name: tensor of this rank's shape, the rollout dtype, contiguous} to write straight
                into, e.g. vLLM's own parameters where they cannot alias other memory (CUDA graphs, sleep
                mode): the kernel scatters each bucket into them, shared layouts are copied in, vocab padding
                rows are zeroed, and only names without a tensor here go through the flat buffer. The
                returned dict then holds these tensors themselves.
        """
        start = time.perf_counter()
        rp, stats = self.rank_plan, SwitchStats(buckets=len(self.plan.buckets))
        params = self.src.params  # read now: offloading the model rebinds its parameters' data
        scatter, stacked = None, into
        if into:
            into = self._expand(into)
        if into:
            scatter = self._scatter_plan(into)
            targets = [into[name] for name in scatter.targets]
        elif self._scatter is not None:  # back to the flat buffer for everything
            self._scatter, self.buffer = None, None
        if self.buffer is None:
            numel = scatter.buffer_numel if scatter is not None else rp.dest_numel
            self.buffer = torch.zeros(numel, dtype=self.dtype, device=self.device)  # vocab padding stays 0

        mover = self._mover(params, stats)
        n = len(self.plan.buckets)
        pending = mover.start(0) if n else None
        for k in range(n):
            following = mover.start(k + 1) if self.overlap and k + 1 < n else None
            gathered = pending.wait()
            if scatter is not None:
                if len(scatter.copies[k]):
                    block_scatter(gathered, [self.buffer, *targets], scatter.copies[k])
            elif len(self.copies[k]):
                block_copy(gathered, self.buffer, self.copies[k])
            pending = following if self.overlap else (mover.start(k + 1) if k + 1 < n else None)
        stats.peak_extra_bytes = mover.buffer_bytes
        del mover
        out = self._views(scatter, params)
        es = self.buffer.element_size()
        stats.bytes_copied = rp.copied_numel * es
        stats.bytes_needed = self.needed_numel * es
        stats.bytes_moved = stats.bytes_received
        if scatter is not None:
            with torch.no_grad():
                for name, (a, b) in scatter.gaps:  # vocab padding rows: vLLM's memory may hold anything
                    into[name].view(-1)[a:b].zero_()
                for name in scatter.targets:
                    if name in rp.shared and out[name].data_ptr() != into[name].data_ptr():
                        into[name].copy_(out[name])
                        stats.bytes_copied += into[name].numel() * es
                    out[name] = into[name]
            stats.bytes_direct = sum(into[name].numel() * es for name in scatter.targets)
        stats.bytes_shared = sum(out[name].numel() * es for name in rp.shared if scatter is None or name not in into)
        stats.dest_bytes = self.buffer.numel() * es
        stats.seconds = time.perf_counter() - start
        self.stats = stats
        return self._stack(out, stacked or {})

    def _expand(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Stacked expert tensors -> their per-expert parts (views); other names unchanged."""
        out = {}
        for name, t in tensors.items():
            parts = self._parts.get(name)
            if parts is None:
                out[name] = t
            elif t.dim() == 3 and t.shape[0] == len(parts):
                out.update((p, t[e]) for e, p in enumerate(parts))
            else:
                raise PlanError(
                    f"to_rollout(into=...): {name} is {list(t.shape)}; rollout rank {self.rollout_rank} stacks "
                    f"{len(parts)} experts of {list(self._dests[parts[0]].shape)}"
                )
        return out

    def _stack(self, out: dict[str, torch.Tensor], into: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per-expert parts -> the stacked tensor (``into``'s own, or the flat buffer's back-to-back parts)."""
        if not self._parts:
            return out
        stacked: dict[str, torch.Tensor] = {}
        for name, t in out.items():
            part = split_part(name)
            if part is None:
                stacked[name] = t
            elif part[1] == 0:
                base, parts = part[0], self._parts[part[0]]
                if base in into:
                    stacked[base] = into[base]
                    continue
                assert all(out[p].data_ptr() == t.data_ptr() + e * t.numel() * t.element_size()
                           for e, p in enumerate(parts)), f"{base}: expert parts are not back to back"  # fmt: skip
                flat = self.buffer.view(-1)
                offset = (t.data_ptr() - flat.data_ptr()) // t.element_size()
                stacked[base] = flat[offset : offset + len(parts) * t.numel()].view(len(parts), *t.shape)
        return stacked

    def _mover(self, params: Mapping[str, torch.Tensor], stats: SwitchStats) -> NeedMover | BucketMover:
        def count(sent: int, received: int) -> None:
            stats.collectives += 1
            stats.bytes_sent += sent
            stats.bytes_received += received

        slots, src = 2 if self.overlap else 1, self.src
        if self.need is not None:
            return NeedMover(self.plan.buckets, self.need, params, src.pp_rank, src.mp_group, self.dtype, self.device,
                             slots=slots, on_collective=count)  # fmt: skip
        groups = (src.tp_rank, src.tp_group, src.pp_group, src.pp_ranks)
        return BucketMover(self.plan.buckets, params, src.pp_rank, src.layout.tp, *groups, self.dtype, self.device,
                           slots=slots, on_collective=count)  # fmt: skip

    def _views(self, scatter: _ScatterPlan | None, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        offsets = scatter.buffer_offsets if scatter is not None else self.rank_plan.offsets
        for d in self.plan.dests[self.rollout_rank]:
            if d.name in self.rank_plan.shared:
                src, offset = self.rank_plan.shared[d.name]
                flat = params[src].reshape(-1)
            elif d.name in offsets:
                flat, offset = self.buffer, offsets[d.name]
            else:  # written into its into= tensor, filled in by to_rollout
                continue
            out[d.name] = flat[offset : offset + d.numel].view(d.shape)
        return out

    def _scatter_plan(self, into: Mapping[str, torch.Tensor]) -> _ScatterPlan:
        # the targets are checked on every call (cheap; a wrong one found mid-switch would leave the other
        # ranks waiting in a collective), the plan is rebuilt only when the set of names changes
        dests = self._dests
        for name, t in into.items():
            d = dests.get(name)
            if d is None:
                raise PlanError(f"to_rollout(into=...): {name!r} is not a tensor of rollout rank {self.rollout_rank}")
            want = (d.shape, self.dtype, self.device, True)
            if (tuple(t.shape), t.dtype, t.device, t.is_contiguous()) != want:
                raise PlanError(
                    f"to_rollout(into=...): {name} is {list(t.shape)} {t.dtype} {t.device} (contiguous="
                    f"{t.is_contiguous()}); the switch writes {list(d.shape)} {self.dtype} {self.device} contiguous"
                )
        key = tuple(sorted(into))
        if self._scatter is None or self._scatter.key != key:
            self._scatter = _ScatterPlan.build(self.rank_plan, self.plan.dests[self.rollout_rank], key, set(into))
            self.buffer = None
        return self._scatter

    def check(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, float]:
        """Probe this rank's rollout ``tensors`` (what :meth:`to_rollout` gave, or vLLM's parameters holding it)
        against the actor's shards (collective over the world; :class:`~hybridrl.hybrid_engine.probe.SwitchProbe`).

        Returns:
            ``{"probe_s", "probe_samples"}``; raises :class:`~hybridrl.hybrid_engine.probe.ProbeError` (one line,
            naming the tensor) on every rank when an element differs.
        """
        if self._probe is None:
            self._probe = SwitchProbe(self.plan, self.rank, self.plan.pad_vocab, self.src.fused_norms, self.dtype)
        return self._probe.run(self._expand(tensors), self.src.params)

    def release(self) -> None:
        """Free the destination buffer (back to training); the next :meth:`to_rollout` reallocates it."""
        self.buffer = None


@dataclass
class _ScatterPlan:
    """A rank plan re-aimed at ``into=`` tensors: per bucket ``(n, 4)`` rows (src, dst index, dst offset,
    length), destination 0 being a smaller flat buffer for the tensors without a target."""

    key: tuple[str, ...]
    targets: list[str]
    """Names with an ``into=`` tensor, in model order (destination ``1 + i``)."""
    buffer_offsets: dict[str, int]
    buffer_numel: int
    copies: list[torch.Tensor]
    gaps: list[tuple[str, tuple[int, int]]]
    """Element ranges of targets that no block writes (vocab padding rows), zeroed at each switch."""

    @classmethod
    def build(cls, rp: Any, dests: list[Any], key: tuple[str, ...], wanted: set[str]) -> _ScatterPlan:
        targets = [d.name for d in dests if d.name in wanted]
        buffer_offsets, used = {}, 0
        for d in dests:
            if d.name in rp.offsets and d.name not in wanted:
                buffer_offsets[d.name] = used
                used += d.numel
        # every non-shared tensor's range in the planner's flat layout -> (destination index, base offset)
        named = sorted((off, name) for name, off in rp.offsets.items())
        starts = torch.tensor([off for off, _ in named], dtype=torch.int64)
        numels = {d.name: d.numel for d in dests}
        index = {name: i + 1 for i, name in enumerate(targets)}
        dest_of = torch.tensor([index.get(name, 0) for _, name in named], dtype=torch.int64)
        base = torch.tensor([off - (buffer_offsets[n] if n not in index else 0) for off, n in named], dtype=torch.int64)
        copies = []
        written = torch.zeros(len(targets) + 1, dtype=torch.int64)
        for blocks in rp.copies:
            blocks = _split_at(blocks, starts)
            which = torch.searchsorted(starts, blocks[:, 1].contiguous(), right=True) - 1
            rows = torch.stack([blocks[:, 0], dest_of[which], blocks[:, 1] - base[which], blocks[:, 2]], dim=1)
            copies.append(rows)
            written.index_add_(0, rows[:, 1], rows[:, 3])
        gaps = []  # blocks are disjoint, so a target is whole iff its blocks add up to it
        for i, name in enumerate(targets, start=1):
            if name in rp.offsets and int(written[i]) < numels[name]:
                ranges = [(o, o + n) for c in copies for _, _, o, n in c[c[:, 1] == i].tolist()]
                gaps += [(name, gap) for gap in _gaps(ranges, numels[name])]
        return cls(key, targets, buffer_offsets, used, copies, gaps)


def _split_at(blocks: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """Cut the ``(n, 3)`` blocks where they cross a tensor start in the flat layout (coalescing may join
    the end of one tensor to the start of the next)."""
    if not len(blocks):
        return blocks
    begin = blocks[:, 1].contiguous()
    first = torch.searchsorted(starts, begin, right=True)
    last = torch.searchsorted(starts, begin + blocks[:, 2] - 1, right=True)
    cross = first != last
    if not bool(cross.any()):
        return blocks
    rows, cuts = [], starts.tolist()  # only the few crossing blocks in Python (a 70B plan has millions of rows)
    for (s, d, n), a, b in zip(blocks[cross].tolist(), first[cross].tolist(), last[cross].tolist(), strict=True):
        for cut in [*cuts[a:b], d + n]:
            rows.append((s, d, cut - d))
            s, n, d = s + cut - d, n - (cut - d), cut
    return torch.cat([blocks[~cross], torch.tensor(rows, dtype=torch.int64).reshape(-1, 3)])


def _gaps(ranges: list[tuple[int, int]], numel: int) -> list[tuple[int, int]]:
    out, at = [], 0
    for a, b in sorted(ranges):
        if a > at:
            out.append((at, a))
        at = max(at, b)
    return out + ([(at, numel)] if at < numel else [])


__all__ = ["HybridEngine", "SwitchStats", "TrainingSource"]
