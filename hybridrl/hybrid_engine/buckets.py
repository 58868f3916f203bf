"""Bucket transports: pack one pipeline stage's shards into a flat bucket, then move what the ranks need of it.

:class:`NeedMover` (the default, ``transport="need"``): each rank receives only the blocks it needs and does not
hold, with one all-to-all per bucket over the model-parallel group, none at all where every rank regroups
locally (see :class:`NeedMover`). :class:`BucketMover` (``transport="gather"``) gives every rank all TP shards:

Per bucket (see :class:`~hybridrl.hybrid_engine.planner.Bucket`), two collectives at most:

1. ``broadcast`` over the pipeline group from the owning stage (skipped at PP 1): every stage's rank with
   the same TP (and DP) coordinates now holds the owner's local bucket;
2. ``all_gather`` over the training TP group (skipped at TP 1): every rank holds
   ``[tp rank 0's bucket | tp rank 1's | ...]``, the gathered buffer the plan's block offsets refer to.

Broadcasting before gathering moves one bucket over the pipeline links instead of TP of them. The gather is
in place: each rank packs its shards straight into its own slot of the gathered buffer, so the transport's
memory is ONE gathered buffer (``tp x`` the largest bucket) per slot and nothing else. With ``slots=2`` the
all_gather of bucket k+1 runs (async) while the caller copies out of bucket k; buffers are allocated once
at the largest bucket and reused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from hybridrl.hybrid_engine.planner import Bucket
from hybridrl.ops import block_copy


def _all_gather(output: torch.Tensor, local: torch.Tensor, group: Any, async_op: bool):
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.10+
    return gather(output, local, group=group, async_op=async_op)


class _Pending:
    def __init__(self, gathered: torch.Tensor, work: Any) -> None:
        self.gathered, self.work = gathered, work

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        return self.gathered


class BucketMover:
    """Moves buckets for one rank; :meth:`start` returns a handle whose ``wait()`` gives the gathered buffer.

    Args:
        buckets: the plan's buckets (same list, same order, on every rank).
        params: this rank's Megatron shards by name (only its own stage's are read).
        stage: this rank's pipeline stage.
        tp_size: training TP size (the gathered buffer holds ``tp_size`` buckets).
        tp_rank: this rank's training TP rank (its slot in the gathered buffer).
        tp_group / pp_group: the training process groups.
        pp_ranks: global rank of each stage in this rank's pipeline group.
        dtype / device: of the buckets (packing casts the shards to ``dtype``).
        slots: 2 = double buffering (async all_gather of the next bucket), 1 = one bucket at a time.
        on_collective: called once per collective with (bytes this rank sent, bytes it received); a broadcast's
            owner sends its bucket to each other stage, an all_gather sends it to each other TP rank.
    """

    def __init__(
        self,
        buckets: list[Bucket],
        params: dict[str, torch.Tensor],
        stage: int,
        tp_size: int,
        tp_rank: int,
        tp_group: Any,
        pp_group: Any,
        pp_ranks: list[int],
        dtype: torch.dtype,
        device: torch.device,
        slots: int = 2,
        on_collective: Callable[[int, int], None] | None = None,
    ) -> None:
        self.buckets, self.params, self.stage = buckets, params, stage
        self.tp_size, self.tp_group, self.pp_group, self.pp_ranks = tp_size, tp_group, pp_group, pp_ranks
        self.tp_rank = tp_rank
        self.on_collective = on_collective or (lambda sent, received: None)
        cap = max((b.numel for b in buckets), default=0)
        self.gathered = [torch.empty(cap * tp_size, dtype=dtype, device=device) for _ in range(slots)]

    @property
    def buffer_bytes(self) -> int:
        """Bytes of all bucket buffers (the transport's extra memory)."""
        return sum(b.numel() * b.element_size() for b in self.gathered)

    def start(self, k: int) -> _Pending:
        """Pack (owning stage), broadcast over PP, and launch the TP all_gather of bucket ``k``."""
        b = self.buckets[k]
        slot = k % len(self.gathered)
        gathered = self.gathered[slot][: b.numel * self.tp_size]
        local = gathered[self.tp_rank * b.numel : (self.tp_rank + 1) * b.numel]  # in place: this rank's slot
        if b.stage == self.stage:
            for name, offset, (start, stop) in zip(b.names, b.offsets, b.ranges, strict=True):
                local[offset : offset + stop - start].copy_(self.params[name].reshape(-1)[start:stop])
        if len(self.pp_ranks) > 1:
            dist.broadcast(local, src=self.pp_ranks[b.stage], group=self.pp_group)
            nbytes = local.numel() * local.element_size()
            owner = b.stage == self.stage
            self.on_collective((len(self.pp_ranks) - 1) * nbytes if owner else 0, 0 if owner else nbytes)
        if self.tp_size == 1:
            return _Pending(local, None)
        work = _all_gather(gathered, local, self.tp_group, async_op=len(self.gathered) > 1)
        nbytes = (self.tp_size - 1) * local.numel() * local.element_size()
        self.on_collective(nbytes, nbytes)
        return _Pending(gathered, work)


class NeedMover:
    """Moves buckets the need-based way (:mod:`~hybridrl.hybrid_engine.need_plan`): each rank receives only the
    blocks its rollout tensors take from shards it does not hold; :meth:`start` returns a handle whose ``wait()``
    gives the combined buffer ``[local bucket | receive region]`` that the plan's copies read.

    Per bucket: pack the local bucket (owning stage), one ``block_copy`` of what the peers need into the send
    buffer, one ``all_to_all_single`` over the model-parallel group (only for buckets some rank of the world
    receives from; async with ``slots=2``). NCCL on GPU, gloo on CPU: the same calls.

    Args:
        buckets: the plan's buckets (same list, same order, on every rank).
        need: this rank's :class:`~hybridrl.hybrid_engine.need_plan.NeedPlan`.
        params: this rank's Megatron shards by name (only its own stage's are read).
        stage: this rank's pipeline stage.
        group: the model-parallel (TP x PP) group, ranks in ``need.members`` order.
        dtype / device: of the buffers (packing casts the shards to ``dtype``).
        slots: 2 = double buffering, 1 = one bucket at a time.
        on_collective: called once per all-to-all with (bytes sent, bytes received) by this rank.
    """

    def __init__(
        self,
        buckets: list[Bucket],
        need: Any,
        params: dict[str, torch.Tensor],
        stage: int,
        group: Any,
        dtype: torch.dtype,
        device: torch.device,
        slots: int = 2,
        on_collective: Callable[[int, int], None] | None = None,
    ) -> None:
        self.buckets, self.need, self.params, self.stage, self.group = buckets, need, params, stage, group
        self.on_collective = on_collective or (lambda sent, received: None)
        moves = any(need.collective)
        slots = max(1, min(slots, len(buckets)))  # one bucket: nothing to overlap with
        self.combined = [
            torch.empty(need.local_numel + (need.recv_numel if moves else 0), dtype=dtype, device=device)
            for _ in range(slots)
        ]
        self.send = [torch.empty(need.send_numel if moves else 0, dtype=dtype, device=device) for _ in range(slots)]

    @property
    def buffer_bytes(self) -> int:
        """Bytes of all bucket, receive and send buffers (the transport's extra memory)."""
        return sum(b.numel() * b.element_size() for b in (*self.combined, *self.send))

    def start(self, k: int) -> _Pending:
        """Pack (owning stage), fill the send buffer, and launch the all-to-all of bucket ``k``."""
        b, need = self.buckets[k], self.need
        slot = k % len(self.combined)
        combined = self.combined[slot]
        local = combined[: need.local_numel]
        if b.stage == self.stage:
            for name, offset, (start, stop) in zip(b.names, b.offsets, b.ranges, strict=True):
                param = self.params.get(name)
                if param is not None:  # else another expert-parallel rank's expert: nobody reads this slot of ours
                    local[offset : offset + stop - start].copy_(param.reshape(-1)[start:stop])
        if not need.collective[k]:
            return _Pending(combined, None)
        out_splits, in_splits = need.send_splits[k], need.recv_splits[k]
        send = self.send[slot][: sum(out_splits)]
        if len(need.send[k]):
            block_copy(local, send, need.send[k])
        recv = combined[need.local_numel : need.local_numel + sum(in_splits)]
        work = dist.all_to_all_single(
            recv, send, in_splits, out_splits, group=self.group, async_op=len(self.combined) > 1
        )
        es = combined.element_size()
        self.on_collective(send.numel() * es, recv.numel() * es)
        return _Pending(combined, work)
