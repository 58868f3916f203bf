"""The need-based transport plans (hybrid_engine/need_plan.py), without process groups.

Small models: every HF element gets a unique id; the test shards the ids the Megatron way itself
(``layouts.megatron_shards``), packs each rank's buckets, runs every rank's send plan, delivers the splits as an
all-to-all over the model-parallel group would, runs each receiver's one copy per bucket and compares its
tensors with vLLM's layout built straight from the HF ids (``layouts.vllm_tensors``). Each destination element
is written once, and the elements a rank receives are counted against an independent count of what it needs:
the ids of its rollout tensors that are not in its own Megatron shards. Llama-70B at 128 ranks: the plans of
a few ranks are computed by arithmetic alone (received == needed, far below what the gather path brings in).
"""

from __future__ import annotations

import time

import pytest
import torch

from hybridrl.distributed.layout import ParallelLayout
from hybridrl.hybrid_engine import need_plan
from hybridrl.hybrid_engine.planner import ReshardPlan
from hybridrl.mcore.gpt import GPTShape, padded_vocab_size
from hybridrl.ops import block_copy_reference
from tests.hybrid_engine import layouts
from tests.hybrid_engine.test_planner import LLAMA_70B, _shape


def _pack(plan: ReshardPlan, shards: dict, k: int, stage: int, tp: int, numel: int) -> torch.Tensor:
    """Rank (stage, tp)'s combined buffer head for bucket ``k``: its local bucket (zeros off its stage)."""
    b = plan.buckets[k]
    local = torch.zeros(numel, dtype=torch.int64)
    if b.stage == stage:
        for name, off, (start, stop) in zip(b.names, b.offsets, b.ranges, strict=True):
            shard = shards[name][0 if len(shards[name]) == 1 else tp].reshape(-1)
            local[off : off + stop - start] = shard[start:stop]
    return local


def simulate(plan: ReshardPlan, shards: dict) -> dict[int, tuple[dict, torch.Tensor, int, int]]:
    """Every rank's (tensors, write counts, received elements, needed elements) after a simulated switch."""
    lay = plan.layout
    marked = need_plan.collectives(plan)
    plans = {r: need_plan.for_rank(plan, r, marked=marked) for r in range(lay.world_size)}
    out = {}
    for r, npl in plans.items():
        c = lay.coords(r)
        rp = plan.for_rank(c.pp, c.tp, lay.rollout_coords(r).tp)
        dest = torch.full((rp.dest_numel,), layouts.VLLM_PAD, dtype=torch.int64)
        writes = torch.zeros(rp.dest_numel + 1, dtype=torch.int64)
        received = 0
        for k in range(len(plan.buckets)):
            parts = [_pack(plan, shards, k, c.pp, c.tp, npl.local_numel)]
            for i, peer in enumerate(npl.members):  # what peer i sends me, cut from its send buffer
                if npl.recv_splits[k][i]:
                    assert marked[k], f"bucket {k} moves data but is not marked for a collective"
                    pp_ = plans[peer]
                    pc = lay.coords(peer)
                    send = torch.zeros(max(pp_.send_numel, 1), dtype=torch.int64)
                    src = _pack(plan, shards, k, pc.pp, pc.tp, pp_.local_numel)
                    block_copy_reference(src, send, pp_.send[k])
                    at = sum(pp_.send_splits[k][: npl.me])
                    assert pp_.send_splits[k][npl.me] == npl.recv_splits[k][i]
                    parts.append(send[at : at + npl.recv_splits[k][i]])
                    received += npl.recv_splits[k][i]
            combined = torch.cat(parts)
            block_copy_reference(combined, dest, npl.copies[k])
            for _, d, n in npl.copies[k].tolist():
                writes[d] += 1
                writes[d + n] -= 1
        tensors = {}
        for d in plan.dests[lay.rollout_coords(r).tp]:
            if d.name in rp.shared:
                src, off = rp.shared[d.name]
                flat = shards[src][0 if len(shards[src]) == 1 else c.tp].reshape(-1)
            else:
                flat, off = dest, rp.offsets[d.name]
            tensors[d.name] = flat[off : off + d.numel].view(d.shape)
        out[r] = (tensors, writes.cumsum(0)[:-1], received, npl.needed_numel)
    return out


def _independent_need(shards: dict, want: dict, stage: int, tp: int, plan: ReshardPlan) -> int:
    """Ids of a rank's rollout tensors (padding excluded) that are not in its own stage's Megatron shards."""
    held = [t[0 if len(t) == 1 else tp].reshape(-1) for name, t in shards.items() if plan.sources[name].stage == stage]
    ids = torch.cat([w.reshape(-1) for w in want.values()])
    ids = ids[ids >= 0]
    return int((~torch.isin(ids, torch.cat(held))).sum())


TIED = dict(qkv_bias=True, tie_embeddings=True)
QK = dict(num_query_groups=2, qk_norm=True, vocab_size=300)
CASES = [  # (tp, pp, vpp, world, rollout tp, shape): the issue's four layouts, then DP, VPP, KV replicas, families
    (2, 1, 1, 2, 1, {}),
    (1, 1, 1, 2, 2, {}),
    (1, 2, 1, 2, 1, {}),
    (2, 2, 1, 4, 2, {}),
    (2, 2, 1, 8, 1, {}),
    (2, 2, 2, 4, 4, QK),
    (2, 1, 1, 8, 8, {}),
    (4, 1, 1, 4, 2, TIED),
]


@pytest.mark.parametrize(
    "tp,pp,vpp,world,tp_i,kw", CASES, ids=[f"tp{a}pp{b}vpp{v}w{c}-to-tp{d}" for a, b, v, c, d, _ in CASES]
)
@pytest.mark.parametrize("bucket_bytes", [140_000, 3_000])
def test_need_transport_simulated(tp, pp, vpp, world, tp_i, kw, bucket_bytes):
    shape = _shape(tp, **kw)
    layout = ParallelLayout.from_world(world, tp=tp, pp=pp, vpp=vpp, rollout_tp=tp_i)
    plan = ReshardPlan(shape, layout, bucket_bytes=bucket_bytes, element_size=8, transport="need", slots=2)
    hf = layouts.hf_tensors(shape)
    shards = layouts.megatron_shards(hf, shape, tp)
    for r, (got, writes, received, needed) in simulate(plan, shards).items():
        j, c = layout.rollout_coords(r).tp, layout.coords(r)
        want = layouts.vllm_tensors(hf, shape, tp_i, j, tp_i > 1)
        shared = plan.for_rank(c.pp, c.tp, j).shared
        for name in shared:  # a shared vocab shard shows Megatron's padding rows (vLLM never reads them)
            pad = (want[name] == layouts.VLLM_PAD) & (got[name] == layouts.MEGATRON_PAD)
            want[name] = torch.where(pad, got[name], want[name])
        bad = [n for n in want if not torch.equal(got[n], want[n])]
        assert not bad, f"rank {r}: {len(bad)} tensors differ, e.g. {bad[:3]}"
        padding = sum(int((t == layouts.VLLM_PAD).sum()) for n, t in want.items() if n not in shared)
        assert int((writes == 1).sum()) + padding == writes.numel() and bool((writes <= 1).all()), f"rank {r}"
        assert needed == _independent_need(shards, want, c.pp, c.tp, plan), f"rank {r}"
        assert received <= 1.05 * needed, f"rank {r}: received {received} elements for {needed} needed"
    if not plan.receives():
        assert not any(need_plan.collectives(plan)), "a local regroup issues no collective"


def test_equal_tp_and_tp1_to_tp2_issue_no_collective():
    for tp, tp_i, world in ((2, 2, 2), (1, 2, 2), (4, 4, 8)):
        plan = ReshardPlan(
            _shape(tp), ParallelLayout.from_world(world, tp=tp, rollout_tp=tp_i), element_size=4, transport="need"
        )
        assert not plan.receives() and not any(need_plan.collectives(plan)), (tp, tp_i)


@pytest.mark.parametrize("tp,pp,tp_i,rank", [(8, 4, 4, 37), (8, 16, 8, 127), (8, 1, 8, 5)])
def test_llama70b_need_plans_by_arithmetic(tp, pp, tp_i, rank):
    """A 128-rank (or 8-rank) Llama-3-70B layout, no process groups: received == needed, and the gather path's
    bytes for the same rank are computed alongside (tp x the local buckets + a broadcast per foreign bucket)."""
    shape = GPTShape(**LLAMA_70B, padded_vocab_size=padded_vocab_size(LLAMA_70B["vocab_size"], tp))
    layout = ParallelLayout.from_world(128 if pp > 1 else 8, tp=tp, pp=pp, rollout_tp=tp_i)
    start = time.perf_counter()
    plan = ReshardPlan(shape, layout, bucket_bytes=2**30, element_size=2, transport="need", slots=2)
    npl = need_plan.for_rank(plan, rank)
    assert time.perf_counter() - start < 120  # arithmetic only (generous: a shared 2-core machine)
    received = sum(sum(s) for s in npl.recv_splits)
    assert received == npl.needed_numel
    assert len(npl.members) == tp * pp and npl.members[npl.me] == rank
    if pp == 1 and tp == tp_i:  # only the vocab rows between Megatron's (pad 1024) and vLLM's (pad 64) boundaries
        vocab = 2 * (shape.vocab_size // tp) * shape.hidden_size  # embedding + lm_head shards
        assert 0 < received < 0.05 * vocab, received
    else:
        c = layout.coords(rank)
        rp = plan.for_rank(c.pp, c.tp, layout.rollout_coords(rank).tp)
        assert 0 < received <= rp.copied_numel
