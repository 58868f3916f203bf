"""Need-based transport plans: the blocks each rank sends to and receives from its model-parallel peers.

Pure arithmetic over a :class:`~hybridrl.hybrid_engine.planner.ReshardPlan` (no process groups): what the
need-based switch runs instead of gathering every TP shard to every rank. Each rank receives exactly the
elements its rollout tensors take from a shard it does not hold, once, from the one peer of its model-parallel
group (the TP x PP ranks that together hold one copy of the model) that holds them:

- a block of a rank's own shard (same stage and TP rank; replicated tensors from any TP rank of its stage) is
  read from its own packed bucket: at equal TP and PP 1 nothing travels and no collective is issued;
- every other block comes from the peer at (the shard's stage, the shard's TP rank), for replicated tensors
  the peer at that stage with the receiver's own TP rank (which spreads the norms over the TP ranks).

Per bucket and rank, three int64 plans of rows ``(src_offset, dst_offset, length)`` in elements:

- ``send[k]``: local bucket -> the send buffer ``[to member 0 | to member 1 | ...]`` (what each peer needs, in
  that peer's order); ``send_splits[k]`` are the per-member element counts (0 for itself);
- ``recv_splits[k]``: the per-member element counts of the receive region (the all-to-all's output splits);
- ``copies[k]``: the combined buffer ``[local bucket (local_numel) | receive region]`` -> the planner's flat
  destination layout (:attr:`RankPlan.offsets <hybridrl.hybrid_engine.planner.RankPlan.offsets>`): the ONE
  kernel call per bucket, every destination element written once.

Mixture-of-experts models: the group is the TP x PP x EP ranks (:func:`~hybridrl.hybrid_engine.planner.
transport_groups`), a role is (stage, TP rank, EP rank); an expert's rows come from the EP rank holding that
expert, dense rows from the receiver's own EP rank.

``collective[k]`` is the same on every rank of the world (computed over all roles): the bucket needs an
all-to-all. Both sides derive the order of the blocks a peer sends from the same function
(:func:`incoming`), so sender and receiver agree without exchanging metadata.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridrl.distributed.layout import ParallelLayout
from hybridrl.hybrid_engine.planner import (
    ReshardPlan,
    Segment,
    clip_blocks,
    coalesce,
    segment_blocks,
    transport_groups,
)

Role = tuple[int, int, int]  # (pipeline stage, training TP rank, EP rank): a rank's place in its transport group


@dataclass
class NeedPlan:
    """What one rank does in a need-based switch (see the module docstring)."""

    members: tuple[int, ...]
    """Global ranks of this rank's model-parallel group, in group-rank order (the all-to-all's split order)."""
    me: int
    """This rank's index in ``members``."""
    local_numel: int
    """Elements of the local-bucket region at the head of the combined buffer (the largest bucket)."""
    recv_numel: int
    """The largest receive region over buckets."""
    send_numel: int
    """The largest send buffer over buckets."""
    needed_numel: int
    """Elements this rank's copied rollout tensors take from shards it does not hold."""
    send: list[torch.Tensor] = field(repr=False)
    send_splits: list[list[int]] = field(repr=False)
    recv_splits: list[list[int]] = field(repr=False)
    copies: list[torch.Tensor] = field(repr=False)
    collective: list[bool] = field(repr=False)


def holder(plan: ReshardPlan, seg: Segment, stage: int, tp: int, ep: int = 0) -> Role | None:
    """The (stage, TP rank, EP rank) that sends ``seg``'s rows to a rank at (``stage``, ``tp``, ``ep``); None = it
    holds them."""
    h = plan.holder_of(seg, tp, ep)
    return None if h == (stage, tp, ep) else h


def incoming(plan: ReshardPlan, stage: int, tp: int, ep: int, j: int, only: Role | None = None) -> dict:
    """The blocks a rank at (``stage``, ``tp``, ``ep``, rollout rank ``j``) copies, keyed by (bucket, holder).

    Values are lists of ``(n, 3)`` blocks: source offsets in the holder's packed bucket, destination offsets in
    the planner's flat layout, in the order the receive region holds them. ``only``: just that holder's.
    """
    out: dict[tuple[int, Role | None], list[torch.Tensor]] = {}
    used = 0
    for d in plan.dests[j]:
        if plan.is_shared(d, stage, tp):
            continue
        for seg in d.segments:
            h = holder(plan, seg, stage, tp, ep)
            if only is not None and h != only:
                continue
            src = plan.sources[seg.src]
            blocks = segment_blocks(seg, src.shape, d.shape, 0, used)
            for k, offset, start, stop in plan.chunks[seg.src]:
                clipped = clip_blocks(blocks, start, stop, offset, src.numel)
                if len(clipped):
                    out.setdefault((k, h), []).append(clipped)
        used += d.numel
    return out


def needed_numel(plan: ReshardPlan, stage: int, tp: int, ep: int, j: int) -> int:
    """Elements a rank's copied rollout tensors take from shards it does not hold (what it must receive)."""
    total = 0
    for d in plan.dests[j]:
        if plan.is_shared(d, stage, tp):
            continue
        for seg in d.segments:
            if holder(plan, seg, stage, tp, ep) is not None:
                src = plan.sources[seg.src]
                total += seg.size * (_row(src.shape) if seg.dim == 0 else src.shape[0])
    return total


def collectives(plan: ReshardPlan) -> list[bool]:
    """Per bucket: some rank of the world receives from it (the same answer on every rank). Conservative: a
    shard any rank needs remotely marks every bucket that holds a chunk of it."""
    marked = [False] * len(plan.buckets)
    for stage, tp, ep, j in plan._roles():
        for d in plan.dests[j]:
            if plan.is_shared(d, stage, tp):
                continue
            for seg in d.segments:
                if holder(plan, seg, stage, tp, ep) is not None:
                    for k, *_ in plan.chunks[seg.src]:
                        marked[k] = True
    return marked


def model_parallel_members(layout: ParallelLayout, rank: int) -> list[int]:
    """Global ranks of ``rank``'s transport group (TP x PP, x EP for experts), sorted (Megatron's group-rank
    order)."""
    return next(g for g in transport_groups(layout) if rank in g)


def for_rank(plan: ReshardPlan, rank: int, members: list[int] | None = None, marked: list[bool] | None = None):
    """The :class:`NeedPlan` of global ``rank`` (``members``: its model-parallel group in group-rank order)."""
    lay = plan.layout
    members = list(members if members is not None else model_parallel_members(lay, rank))
    roles = [plan.role(m)[:3] for m in members]
    index = {role: i for i, role in enumerate(roles)}
    assert len(index) == len(members), f"transport group {members} repeats a (stage, tp, ep) role"
    me = members.index(rank)
    stage, tp, ep = roles[me]
    n_buckets = len(plan.buckets)
    local = max((b.numel for b in plan.buckets), default=0)
    recv_splits = [[0] * len(members) for _ in range(n_buckets)]
    copies: list[list[torch.Tensor]] = [[] for _ in range(n_buckets)]
    recv_at = [local] * n_buckets
    mine = incoming(plan, stage, tp, ep, lay.rollout_coords(rank).tp)
    for (k, h), blocks in sorted(mine.items(), key=lambda kv: (kv[0][0], -1 if kv[0][1] is None else index[kv[0][1]])):
        b = torch.cat(blocks)
        if h is None:
            copies[k].append(b)
            continue
        n = b[:, 2]
        pos = recv_at[k] + torch.cumsum(n, 0) - n
        copies[k].append(torch.stack([pos, b[:, 1], n], dim=1))
        recv_splits[k][index[h]] = int(n.sum())
        recv_at[k] += int(n.sum())
    send_splits = [[0] * len(members) for _ in range(n_buckets)]
    send: list[list[torch.Tensor]] = [[] for _ in range(n_buckets)]
    send_at = [0] * n_buckets
    for i, peer in enumerate(members):
        if i == me:
            continue
        theirs = incoming(plan, *roles[i], lay.rollout_coords(peer).tp, only=(stage, tp, ep))
        for (k, _), blocks in sorted(theirs.items(), key=lambda kv: kv[0][0]):
            b = torch.cat(blocks)
            n = b[:, 2]
            pos = send_at[k] + torch.cumsum(n, 0) - n
            send[k].append(torch.stack([b[:, 0], pos, n], dim=1))
            send_splits[k][i] = int(n.sum())
            send_at[k] += int(n.sum())
    empty = torch.empty(0, 3, dtype=torch.int64)
    return NeedPlan(
        members=tuple(members),
        me=me,
        local_numel=local,
        recv_numel=max((r - local for r in recv_at), default=0),
        send_numel=max(send_at, default=0),
        needed_numel=needed_numel(plan, stage, tp, ep, lay.rollout_coords(rank).tp),
        send=[coalesce(torch.cat(s)) if s else empty for s in send],
        send_splits=send_splits,
        recv_splits=recv_splits,
        copies=[coalesce(torch.cat(c)) if c else empty for c in copies],
        collective=marked if marked is not None else collectives(plan),
    )


def _row(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape[1:]:
        n *= s
    return n
