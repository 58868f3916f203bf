"""Reshard plans from Megatron's training layout to vLLM's rollout layout: pure math, no process groups.

Owns which Megatron shard (name with GLOBAL layer numbers, training TP rank, pipeline stage) feeds which
rows of which vLLM tensor on each rollout TP rank, how the shards of each stage are packed into flat
buckets, and the element blocks ``(src_offset, dst_offset, length)`` that ONE ``hybridrl.ops.block_copy``
call per bucket runs. Both layouts are spelled as Hugging Face row pieces (the Megatron side by
``hybridrl.mcore.bridge_layout``, the vLLM side by :mod:`~hybridrl.hybrid_engine.vllm_layout`); a plan is
their intersection, so it holds for tp_rollout < tp_train, = and >.

Buffers. Bucket k packs local shards of one stage ``[shard_a | shard_b | ...]`` (``numel`` elements, equal
on every TP rank); a shard larger than a bucket is cut into element ranges over consecutive buckets, so the
bucket size bounds the switch's memory whatever the model. After the PP broadcast and the TP all_gather
every rank holds the gathered buffer ``[tp rank 0's bucket | tp rank 1's | ...]``; a replicated tensor
(norms) is read from TP rank 0's copy. The destination is one flat buffer per rank holding its non-shared
vLLM tensors back to back.

Row-parallel tensors (``o_proj`` / ``down_proj``, split on dim 1) are planned per row: one block per
output row and source shard, ``columns`` elements long, so destinations stay plain row-major tensors (a
transposed plan would need a transpose copy afterwards). Blocks that continue each other are merged, so
equal splits (tp_rollout == tp_train) collapse back to one block per shard.

Shared tensors: a vLLM tensor that is one contiguous range of one Megatron shard (norms; ``o_proj`` /
``down_proj`` / ``gate_up_proj`` at equal TP; ``qkv_proj`` when each rank has one query group; the
embedding at TP 1, as a view of its first ``vocab`` rows) is handed out as a view of the training tensor on
every rank that holds that shard, and is moved only if some other rank needs it.

Rank mapping: the layout's (:meth:`~hybridrl.distributed.layout.ParallelLayout.coords` for training,
:meth:`~hybridrl.distributed.layout.ParallelLayout.rollout_coords` for generation).

Experts (MoE families). A Megatron expert shard lives on one expert-parallel rank (:func:`expert_rank`; the
EP ranks split the data-parallel ranks), so a rank's role is (stage, TP rank, EP rank) and the ranks that
together hold one copy of the model are the TP x PP x EP group (:func:`transport_groups`; Megatron's
expert-tensor-model-pipeline group). vLLM's stacked expert tensors are planned per expert part
(:func:`~hybridrl.hybrid_engine.vllm_layout.part_name`) and never shared with training tensors: a stacked
tensor is one storage. The gather transport moves TP shards only, so it needs ``ep == 1``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from hybridrl.distributed.layout import ParallelLayout
from hybridrl.hybrid_engine.vllm_layout import PlanError, check_family, check_rollout_tp, rollout_maps, split_part
from hybridrl.mcore import bridge_layout, bridge_moe

if TYPE_CHECKING:
    from hybridrl.mcore.gpt import GPTShape


# ---- where each Megatron tensor lives ------------------------------------------------------------------
def layer_stage(layer: int, num_layers: int, pp: int, vpp: int = 1) -> int:
    """Pipeline stage holding global layer ``layer`` (Megatron's even split, interleaved under VPP)."""
    per_chunk = num_layers // (pp * vpp)
    return (layer % (num_layers // vpp)) // per_chunk


def source_stage(name: str, num_layers: int, pp: int, vpp: int = 1) -> int:
    """Pipeline stage holding Megatron tensor ``name`` (embedding first, final norm and output layer last)."""
    m = re.match(r"decoder\.layers\.(\d+)\.", name)
    if m:
        return layer_stage(int(m.group(1)), num_layers, pp, vpp)
    return 0 if name.startswith("embedding.") else pp - 1


def expert_rank(layout: ParallelLayout, rank: int) -> int:
    """Expert-parallel rank of global ``rank``: Megatron splits the ``cp * dp`` ranks of each (tp, pp) into
    consecutive blocks of ``ep`` (order ``tp-cp-ep-dp-pp``)."""
    c = layout.coords(rank)
    return (c.cp + layout.cp * c.dp) % layout.ep


def transport_groups(layout: ParallelLayout) -> list[list[int]]:
    """The groups that each hold one whole copy of the model (experts included), sorted global ranks: the
    model-parallel (TP x PP) groups, joined over the ``ep`` expert-parallel ranks when ``ep > 1``."""
    if layout.ep == 1:
        return layout.groups("mp")
    groups: dict[int, list[int]] = {}
    for rank in range(layout.world_size):
        c = layout.coords(rank)
        groups.setdefault((c.cp + layout.cp * c.dp) // layout.ep, []).append(rank)
    return sorted(sorted(g) for g in groups.values())


@dataclass(frozen=True)
class Source:
    """One Megatron parameter as each TP rank holds it (every TP rank holds the same shape)."""

    name: str
    stage: int
    shape: tuple[int, ...]
    replicated: bool
    ep_rank: int | None = None
    """The expert-parallel rank holding this expert shard; None: every EP rank holds it (dense tensors)."""

    @property
    def numel(self) -> int:
        return _numel(self.shape)


@dataclass(frozen=True)
class Segment:
    """``size`` rows (dim 0) or columns (dim 1) of source shard (``src``, TP rank ``tp``) at ``src_pos`` go
    to ``dst_pos`` of a destination tensor."""

    src: str
    tp: int
    dim: int
    src_pos: int
    dst_pos: int
    size: int


@dataclass(frozen=True)
class Dest:
    """One vLLM tensor of one rollout rank and where its rows come from."""

    name: str
    shape: tuple[int, ...]
    segments: tuple[Segment, ...]
    shared: tuple[str, int, int] | None
    """(Megatron name, TP rank, element offset): the whole tensor is that contiguous range of that shard."""

    @property
    def numel(self) -> int:
        return _numel(self.shape)


@dataclass(frozen=True)
class Bucket:
    """Shards of one stage packed back to back: elements ``ranges[i]`` of shard ``names[i]`` at element
    ``offsets[i]``; ``numel`` per TP rank. A shard larger than a bucket is streamed over several buckets."""

    stage: int
    names: tuple[str, ...]
    offsets: tuple[int, ...]
    numel: int
    ranges: tuple[tuple[int, int], ...]


@dataclass
class RankPlan:
    """What one rank (pipeline stage, training TP rank, rollout TP rank) does in a switch (the same for every
    expert-parallel rank: which EP peer holds an expert matters to the transports only)."""

    stage: int
    tp_rank: int
    rollout_rank: int
    offsets: dict[str, int]
    """vLLM name -> element offset in the flat destination buffer (non-shared tensors, in model order)."""
    shared: dict[str, tuple[str, int]]
    """vLLM name -> (Megatron name, element offset) of a tensor handed out as a view of a local parameter."""
    dest_numel: int
    copies: list[torch.Tensor] = field(repr=False)
    """Per bucket: the ``(n, 3)`` int64 block plan from the gathered bucket into the destination buffer."""

    @property
    def copied_numel(self) -> int:
        return sum(int(c[:, 2].sum()) for c in self.copies if len(c))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _shape_along(full: tuple[int, ...], dim: int, size: int) -> tuple[int, ...]:
    return tuple(size if d == dim else s for d, s in enumerate(full))


# ---- element blocks ------------------------------------------------------------------------------------
def segment_blocks(seg: Segment, src_shape: tuple, dst_shape: tuple, src_base: int, dst_base: int) -> torch.Tensor:
    """The ``(n, 3)`` element blocks of ``seg`` between row-major shards at ``src_base`` / ``dst_base``."""
    if seg.dim == 0:
        row = _numel(tuple(src_shape[1:]))
        return torch.tensor([[src_base + seg.src_pos * row, dst_base + seg.dst_pos * row, seg.size * row]])
    rows = torch.arange(src_shape[0], dtype=torch.int64)
    return torch.stack(
        [
            src_base + rows * src_shape[1] + seg.src_pos,
            dst_base + rows * dst_shape[1] + seg.dst_pos,
            torch.full_like(rows, seg.size),
        ],
        dim=1,
    )


def clip_blocks(blocks: torch.Tensor, start: int, stop: int, base: int, numel: int | None = None) -> torch.Tensor:
    """The parts of ``blocks`` (source offsets relative to the shard) inside shard elements ``[start, stop)``,
    with source offsets moved to ``base`` + position in that range (a chunk of the shard in a bucket).
    ``numel``: the shard's size, for the fast path of a chunk that is the whole shard."""
    if start == 0 and stop == numel:
        return blocks + torch.tensor([base, 0, 0], dtype=blocks.dtype)
    src, dst, n = blocks.unbind(1)
    lo, hi = src.clamp(min=start), (src + n).clamp(max=stop)
    keep = lo < hi
    lo, hi = lo[keep], hi[keep]
    return torch.stack([base + lo - start, dst[keep] + lo - src[keep], hi - lo], dim=1)


def _bucket(stage: int, items: list[tuple[str, int, tuple[int, int]]], numel: int) -> Bucket:
    names, offsets, ranges = zip(*items, strict=True)
    return Bucket(stage, names, offsets, numel, ranges)


def coalesce(blocks: torch.Tensor) -> torch.Tensor:
    """Merge consecutive blocks that continue each other on both sides (order kept)."""
    if len(blocks) < 2:
        return blocks
    src, dst, n = blocks.unbind(1)
    starts = torch.ones(len(blocks), dtype=torch.bool)
    starts[1:] = (src[1:] != src[:-1] + n[:-1]) | (dst[1:] != dst[:-1] + n[:-1])
    group = torch.cumsum(starts.long(), 0) - 1
    lengths = torch.zeros(int(starts.sum()), dtype=torch.int64).index_add_(0, group, n)
    return torch.stack([src[starts], dst[starts], lengths], dim=1)


# ---- the plan ------------------------------------------------------------------------------------------
class ReshardPlan:
    """The reshard of ``shape`` from ``layout``'s training groups to its generation groups.

    Args:
        shape: the model (``padded_vocab_size`` as the training model was built, for ``layout.tp``).
        layout: the run's layout: training (tp, pp, vpp, dp) and generation (``rollout_tp``, vLLM's TP size).
        family: HF ``model_type`` (see ``vllm_layout.FAMILIES``).
        expert_parallel: vLLM's ``enable_expert_parallel`` (whole experts per rollout rank; MoE only).
        bucket_bytes: memory of the whole transport on a rank: ``slots`` gathered buffers, each ``layout.tp``
            local buckets; a local bucket thus holds ``bucket_bytes / (tp * slots)`` and must fit the
            largest shard that moves.
        slots: gathered buffers in flight (2 = double buffering).
        element_size: bytes per element of the buckets (the rollout dtype).
        fused_norms: TransformerEngine's layer spec (norm weights inside ``linear_qkv`` / ``linear_fc1``).
        pad_vocab: pad the vocab like vLLM's parameters; None = only at ``rollout_tp > 1``.
        share: hand out views of training tensors where the layouts agree (False: copy everything, e.g.
            when the rollout dtype differs from the training dtype).
        transport: what the buckets are sized for: ``"gather"`` (every TP shard to every rank: ``tp`` local
            buckets per slot) or ``"need"`` (:mod:`~hybridrl.hybrid_engine.need_plan`: per slot the local bucket,
            a receive region of one bucket per holder a rank receives from and a send buffer of one per peer it
            sends to, see :meth:`fan`; only the local bucket when no rank receives anything).
    """

    def __init__(
        self,
        shape: GPTShape,
        layout: ParallelLayout,
        family: str = "llama",
        bucket_bytes: int = 256 * 2**20,
        element_size: int = 2,
        fused_norms: bool = False,
        pad_vocab: bool | None = None,
        share: bool = True,
        slots: int = 1,
        transport: str = "gather",
        expert_parallel: bool = False,
    ) -> None:
        check_family(family)
        if transport not in TRANSPORTS:
            raise PlanError(f"transport ({transport!r}) must be one of {list(TRANSPORTS)}")
        if transport == "gather" and shape.moe is not None and layout.ep > 1:
            raise PlanError(
                f"rollout.sync_transport (gather) moves TP shards only and cannot bring experts from the other "
                f"expert-parallel ranks (actor.megatron.ep_size {layout.ep}); use rollout.sync_transport=need"
            )
        self.transport = transport
        rollout_tp = layout.rollout_tp
        pad_vocab = rollout_tp > 1 if pad_vocab is None else pad_vocab
        check_rollout_tp(shape, rollout_tp, pad_vocab)
        _check_training(shape, layout)
        self.shape, self.layout, self.rollout_tp, self.pad_vocab = shape, layout, rollout_tp, pad_vocab
        self.expert_parallel = expert_parallel
        self.bucket_bytes, self.element_size, self.share, self.slots = bucket_bytes, element_size, share, slots
        self.sources, homes = self._sources(fused_norms)
        maps = rollout_maps(shape, rollout_tp, family, pad_vocab, expert_parallel)
        self.dests = [self._dests([(m, m.pieces(j)) for m in maps], homes) for j in range(rollout_tp)]
        self.needed = self._needed()
        self.buckets = self._buckets()
        self.chunks: dict[str, list[tuple[int, int, int, int]]] = {}  # shard -> [(bucket, offset, start, stop)]
        for k, b in enumerate(self.buckets):
            for name, offset, (start, stop) in zip(b.names, b.offsets, b.ranges, strict=True):
                self.chunks.setdefault(name, []).append((k, offset, start, stop))

    # sources and destinations
    def _sources(self, fused_norms: bool) -> tuple[dict[str, Source], dict[str, list]]:
        shape, lay = self.shape, self.layout
        hf = bridge_layout.hf_shapes(shape)
        sources: dict[str, Source] = {}
        homes: dict[str, list] = {}  # HF name -> [(megatron name, tp rank, dim, position, hf start, hf stop)]
        for m in bridge_layout.tensor_maps(shape, lay.tp, fused_norms=fused_norms):
            if m.megatron == "output_layer.weight" and shape.tie_embeddings:
                continue  # vLLM ties lm_head to embed_tokens: the output layer copy is never read
            full = hf[m.hf_names[0]]
            rows = sum(p.size for p in m.pieces(0))
            stage = source_stage(m.megatron, shape.num_layers, lay.pp, lay.vpp)
            expert = bridge_moe.expert_index(m.megatron) if m.expert else None
            ep_rank = None if expert is None else expert // (shape.moe.num_experts // lay.ep)
            sources[m.megatron] = Source(m.megatron, stage, _shape_along(full, m.dim, rows), m.replicated, ep_rank)
            for tp_rank in range(len(m.shards)):
                pos = 0
                for p in m.pieces(tp_rank):
                    if p.hf is not None:
                        homes.setdefault(p.hf, []).append((m.megatron, tp_rank, m.dim, pos, p.start, p.stop))
                    pos += p.size
        return sources, homes

    def _dests(self, maps: list[tuple[bridge_layout.TensorMap, tuple]], homes: dict[str, list]) -> list[Dest]:
        hf = bridge_layout.hf_shapes(self.shape)
        out = []
        for m, pieces in maps:
            segments, pos = [], 0
            for p in pieces:
                if p.hf is not None:
                    for src, tp_rank, dim, spos, start, stop in homes[p.hf]:
                        lo, hi = max(start, p.start), min(stop, p.stop)
                        if lo < hi:
                            assert dim == m.dim, f"{m.megatron}: Megatron splits {p.hf} on dim {dim}, vLLM on {m.dim}"
                            segments.append(Segment(src, tp_rank, dim, spos + lo - start, pos + lo - p.start, hi - lo))
                pos += p.size
            shape = _shape_along(hf[m.hf_names[0]], m.dim, pos)
            shared = None if split_part(m.megatron) else self._shared(segments, shape)  # a stacked tensor: one storage
            out.append(Dest(m.megatron, shape, tuple(segments), shared))
        return out

    def _shared(self, segments: list[Segment], shape: tuple) -> tuple[str, int, int] | None:
        if not self.share or not segments or len({(s.src, s.tp) for s in segments}) != 1:
            return None
        src = self.sources[segments[0].src]
        if segments[0].dim == 1:  # columns: contiguous only when the one segment spans whole rows on both sides
            whole = len(segments) == 1 and segments[0].size == src.shape[1] == shape[1]
            return (src.name, segments[0].tp, 0) if whole else None
        blocks = coalesce(torch.cat([segment_blocks(s, src.shape, shape, 0, 0) for s in segments]))
        if len(blocks) != 1 or int(blocks[0, 1]) != 0:
            return None
        if int(blocks[0, 2]) == _numel(shape):
            return segments[0].src, segments[0].tp, int(blocks[0, 0])
        if int(blocks[0, 0]) == 0 and src.shape == shape:
            # a vocab shard whose tail is padding on both sides (same padded size): vLLM never reads padding
            # rows (lookups stay below the vocab, logits are cut to it), so Megatron's padding may stand in
            return segments[0].src, segments[0].tp, 0
        return None

    def is_shared(self, dest: Dest, stage: int, tp_rank: int) -> bool:
        """True when a rank at (``stage``, ``tp_rank``) holds the one shard ``dest`` is a view of."""
        if dest.shared is None:
            return False
        src = self.sources[dest.shared[0]]
        return src.stage == stage and (src.replicated or dest.shared[1] == tp_rank)

    def _roles(self) -> set[tuple[int, int, int, int]]:
        """Distinct (stage, training TP rank, expert-parallel rank, rollout TP rank) over the world."""
        lay = self.layout
        return {self.role(r) for r in range(lay.world_size)}

    def role(self, rank: int) -> tuple[int, int, int, int]:
        """(stage, training TP rank, expert-parallel rank, rollout TP rank) of global ``rank``."""
        c = self.layout.coords(rank)
        return c.pp, c.tp, expert_rank(self.layout, rank), self.layout.rollout_coords(rank).tp

    def _needed(self) -> set[str]:
        needed = set()
        for stage, tp_rank, _, j in self._roles():
            for d in self.dests[j]:
                if not self.is_shared(d, stage, tp_rank):
                    needed.update(s.src for s in d.segments)
        return needed

    def fan(self) -> tuple[int, int]:
        """(most holders one rank receives a stage's rows from, most peers one rank sends to) over the
        model-parallel groups: (0, 0) when every rank regroups locally (equal TP at PP 1, training TP 1 at PP 1).
        A rank receives from the holder at (the shard's stage, its TP rank), for replicated tensors at that stage
        with the receiver's own TP rank (see :mod:`~hybridrl.hybrid_engine.need_plan`)."""
        fan_in, fan_out = 0, 0
        seen: dict[tuple[int, int, int, int], set] = {}  # role -> holders it receives from
        for group in transport_groups(self.layout):
            senders: dict[tuple[int, int, int], int] = {}
            for rank in group:
                role = self.role(rank)
                if role not in seen:
                    seen[role] = self._holders(*role)
                holders = seen[role]
                for stage in {h[0] for h in holders}:
                    fan_in = max(fan_in, sum(h[0] == stage for h in holders))
                for h in holders:
                    senders[h] = senders.get(h, 0) + 1
            fan_out = max(fan_out, *senders.values(), 0)
        return fan_in, fan_out

    def _holders(self, stage: int, tp_rank: int, ep_rank: int, j: int) -> set[tuple[int, int, int]]:
        out = set()
        for d in self.dests[j]:
            if self.is_shared(d, stage, tp_rank):
                continue
            for seg in d.segments:
                holder = self.holder_of(seg, tp_rank, ep_rank)
                if holder != (stage, tp_rank, ep_rank):
                    out.add(holder)
        return out

    def holder_of(self, seg: Segment, tp_rank: int, ep_rank: int) -> tuple[int, int, int]:
        """The (stage, TP rank, EP rank) a rank at TP rank ``tp_rank`` / EP rank ``ep_rank`` reads ``seg`` from:
        replicated tensors from its own TP rank, dense tensors from its own EP rank."""
        src = self.sources[seg.src]
        return (src.stage, tp_rank if src.replicated else seg.tp, ep_rank if src.ep_rank is None else src.ep_rank)

    def receives(self) -> bool:
        """Some rank's rollout tensors take rows from a shard it does not hold (another stage or TP rank)."""
        return self.fan() != (0, 0)

    def _held(self) -> int:
        """Local buckets' worth of memory the transport holds at once."""
        if self.transport == "gather":
            return self.layout.tp * self.slots
        fan_in, fan_out = self.fan()  # per slot: the local bucket, a receive region, a send buffer
        return self.slots * (1 + fan_in + fan_out)

    def _buckets(self) -> list[Bucket]:
        held = self._held()  # local buckets the transport memory holds at once
        capacity = self.bucket_bytes // (self.element_size * held)
        if capacity < 1:
            raise PlanError(
                f"bucket_bytes ({self.bucket_bytes}) cannot hold one element x tp {self.layout.tp} x {self.slots} "
                f"buffer(s); use a few MiB or more (rollout.sync_bucket_mb)"
            )
        moving = [s for s in self.sources.values() if s.name in self.needed]
        buckets = []
        for stage in range(self.layout.pp):
            items: list[tuple[str, int, tuple[int, int]]] = []
            used = 0
            for s in (s for s in moving if s.stage == stage):
                if used + s.numel > capacity and items:  # a shard that fits a bucket is never cut
                    buckets.append(_bucket(stage, items, used))
                    items, used = [], 0
                start = 0
                while start < s.numel:  # a shard larger than a bucket streams through several
                    stop = min(s.numel, start + capacity - used)
                    items.append((s.name, used, (start, stop)))
                    used += stop - start
                    start = stop
                    if used == capacity:
                        buckets.append(_bucket(stage, items, used))
                        items, used = [], 0
            if items:
                buckets.append(_bucket(stage, items, used))
        return buckets

    # per rank
    def for_rank(self, stage: int, tp_rank: int, rollout_rank: int, merge: bool = True) -> RankPlan:
        """The plan of a rank at pipeline ``stage``, training TP rank ``tp_rank``, rollout TP rank ``rollout_rank``.

        ``merge=False`` keeps one block per segment (and per row of a dim-1 split), each inside one contiguous
        run of HF rows on both sides: what a checker wants; the kernel wants the merged plan.
        """
        offsets, shared, blocks = {}, {}, [[] for _ in self.buckets]
        used = 0
        for d in self.dests[rollout_rank]:
            if self.is_shared(d, stage, tp_rank):
                shared[d.name] = (d.shared[0], d.shared[2])
                continue
            offsets[d.name] = used
            for seg in d.segments:
                src_blocks = segment_blocks(seg, self.sources[seg.src].shape, d.shape, 0, used)
                for k, offset, start, stop in self.chunks[seg.src]:
                    base = seg.tp * self.buckets[k].numel + offset
                    blocks[k].append(clip_blocks(src_blocks, start, stop, base, self.sources[seg.src].numel))
            used += d.numel
        empty = torch.empty(0, 3, dtype=torch.int64)
        copies = [(coalesce if merge else _same)(torch.cat(bl)) if bl else empty for bl in blocks]
        return RankPlan(stage, tp_rank, rollout_rank, offsets, shared, used, copies)

    def for_global_rank(self, rank: int) -> RankPlan:
        """:meth:`for_rank` of global ``rank`` (its training and generation coordinates from the layout)."""
        stage, tp, _, j = self.role(rank)
        return self.for_rank(stage, tp, j)

    def describe(self) -> str:
        """One line: layouts, tensors, buckets."""
        moved = sum(b.numel for b in self.buckets) * self.element_size
        return (
            f"{self.layout.describe()} -> {self.layout.describe_rollout()}: {len(self.sources)} shards "
            f"({len(self.needed)} move), {len(self.buckets)} buckets, {moved / 2**20:.1f} MiB per TP rank"
        )


TRANSPORTS = ("need", "gather")


def _same(blocks: torch.Tensor) -> torch.Tensor:
    return blocks


def _check_training(shape: GPTShape, layout: ParallelLayout) -> None:
    tp, pp, vpp = layout.tp, layout.pp, layout.vpp
    if shape.num_query_groups % tp:
        raise PlanError(f"actor.megatron.tp_size ({tp}) must divide num_key_value_heads ({shape.num_query_groups})")
    width = shape.ffn_hidden_size if shape.moe is None else shape.moe.ffn_hidden_size
    if width % tp:
        raise PlanError(f"actor.megatron.tp_size ({tp}) must divide the MLP / expert width ({width})")
    if shape.moe is not None and shape.moe.num_experts % layout.ep:
        raise PlanError(
            f"actor.megatron.ep_size ({layout.ep}) must divide the number of experts ({shape.moe.num_experts})"
        )
    if shape.padded_vocab % tp:
        raise PlanError(
            f"padded_vocab_size ({shape.padded_vocab}) is not divisible by actor.megatron.tp_size ({tp}); "
            f"build the shape with hybridrl.mcore.gpt.padded_vocab_size(vocab, tp)"
        )
    if shape.num_layers % (pp * vpp):
        raise PlanError(
            f"num_layers ({shape.num_layers}) must be divisible by pp ({pp}) * vpp ({vpp}) for the even stage split"
        )
