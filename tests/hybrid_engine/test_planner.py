"""The reshard planner, without process groups: simulated on small models, checked symbolically at 70B scale.

Small models: every HF element gets a unique id, the test shards the ids the Megatron way itself
(``layouts.megatron_shards``), packs the plan's buckets, runs ``block_copy_reference`` once per bucket and
compares every rollout tensor with vLLM's layout built straight from the HF ids (``layouts.vllm_tensors``),
and counts that every destination element is written exactly once. Llama-70B layouts (128 ranks,
tp_rollout < and > tp_train, replicated KV heads): each block's first and last elements are mapped to HF ids
by index arithmetic on both sides (``layouts.megatron_ids`` / ``vllm_ids``) and must agree, stay inside one
contiguous run, and the blocks must tile the destination without overlap.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridrl.distributed.layout import ParallelLayout
from hybridrl.hybrid_engine.engine import _gaps, _ScatterPlan, _split_at
from hybridrl.hybrid_engine.planner import ReshardPlan
from hybridrl.hybrid_engine.vllm_layout import PlanError
from hybridrl.mcore.gpt import GPTShape, padded_vocab_size
from hybridrl.ops import block_copy_reference, block_scatter_reference
from tests.hybrid_engine import layouts


def _shape(tp: int, **kw) -> GPTShape:
    base = dict(
        num_layers=4, hidden_size=32, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=48, vocab_size=250,
        head_dim=8,
    )  # fmt: skip
    base.update(kw)
    return GPTShape(**base, padded_vocab_size=padded_vocab_size(base["vocab_size"], tp))


def _roles(plan: ReshardPlan) -> list[tuple[int, int, int]]:
    lay = plan.layout
    return sorted({(lay.coords(r).pp, lay.coords(r).tp, r % plan.rollout_tp) for r in range(lay.world_size)})


def _gathered(plan: ReshardPlan, shards: dict, k: int) -> torch.Tensor:
    """Bucket ``k`` as the all_gather over the training TP ranks delivers it."""
    b, tp = plan.buckets[k], plan.layout.tp
    gathered = torch.zeros(tp * b.numel, dtype=torch.int64)
    for r in range(tp):
        for name, off, (start, stop) in zip(b.names, b.offsets, b.ranges, strict=True):
            shard = shards[name][0 if len(shards[name]) == 1 else r].reshape(-1)
            gathered[r * b.numel + off : r * b.numel + off + stop - start] = shard[start:stop]
    return gathered


def _simulate(plan: ReshardPlan, shards: dict, role: tuple[int, int, int]) -> tuple[dict, torch.Tensor]:
    """Run the plan for one rank on id-filled shards; returns its tensors and per-element write counts."""
    rp = plan.for_rank(*role)
    dest = torch.full((rp.dest_numel,), layouts.VLLM_PAD, dtype=torch.int64)
    writes = torch.zeros(rp.dest_numel + 1, dtype=torch.int64)
    for k in range(len(plan.buckets)):
        block_copy_reference(_gathered(plan, shards, k), dest, rp.copies[k])
        for _, d, n in rp.copies[k].tolist():
            writes[d] += 1
            writes[d + n] -= 1
    out = {}
    for d in plan.dests[role[2]]:
        if d.name in rp.shared:
            src, off = rp.shared[d.name]
            flat = shards[src][0 if len(shards[src]) == 1 else role[1]].reshape(-1)
        else:
            flat, off = dest, rp.offsets[d.name]
        out[d.name] = flat[off : off + d.numel].view(d.shape)
    return out, writes.cumsum(0)[:-1]


@pytest.mark.parametrize("bucket_bytes", [140_000, 3_000])
def test_scatter_plans_equal_the_flat_buffer(bucket_bytes):
    """The engine's re-aimed plans (into= tensors, e.g. vLLM's parameters) put every element where the flat plan
    does: all targets, every other one, or none; blocks that coalescing joined across tensors are cut apart."""
    shape = _shape(2, qkv_bias=True, tie_embeddings=True)
    hf = layouts.hf_tensors(shape)
    shards = layouts.megatron_shards(hf, shape, 2, False)
    layout = ParallelLayout.from_world(4, tp=2, pp=2)
    joined_total = 0
    for tp_i in (1, 2, 4):
        plan = ReshardPlan(shape, layout.with_rollout_tp(tp_i), bucket_bytes=bucket_bytes, element_size=8)
        for role in _roles(plan):
            flat, _ = _simulate(plan, shards, role)
            rp, dests = plan.for_rank(*role), plan.dests[role[2]]
            joined = sum(int(len(_split_at(c, _starts(rp))) - len(c)) for c in rp.copies)
            for wanted in (set(rp.offsets), set(list(rp.offsets)[::2]), set()):
                sp = _ScatterPlan.build(rp, dests, tuple(sorted(wanted)), wanted)
                targets = [torch.full(flat[n].shape, -7, dtype=torch.int64) for n in sp.targets]
                buffer = torch.full((sp.buffer_numel,), -7, dtype=torch.int64)
                for k in range(len(plan.buckets)):
                    block_scatter_reference(_gathered(plan, shards, k), [buffer, *targets], sp.copies[k])
                for name, (a, b) in sp.gaps:
                    assert bool((flat[name].reshape(-1)[a:b] == layouts.VLLM_PAD).all()), "a gap that is not padding"
                    targets[sp.targets.index(name)].view(-1)[a:b] = layouts.VLLM_PAD
                for name, t in zip(sp.targets, targets, strict=True):
                    assert torch.equal(t, flat[name]), f"tp_i={tp_i} {role} {name} (into)"
                for name, off in sp.buffer_offsets.items():
                    got = buffer[off : off + flat[name].numel()].view(flat[name].shape)
                    assert torch.equal(torch.where(got == -7, layouts.VLLM_PAD, got), flat[name]), name
                assert sp.buffer_numel == sum(flat[n].numel() for n in rp.offsets if n not in wanted)
            joined_total += joined
    assert joined_total > 0, "no block crossed a tensor boundary: the cutting was not exercised"
    assert _split_at(torch.tensor([[0, 5, 10]]), torch.tensor([0, 8, 12])).tolist() == [
        [0, 5, 3],
        [3, 8, 4],
        [7, 12, 3],
    ]
    assert _gaps([(4, 6), (0, 2), (6, 7)], 10) == [(2, 4), (7, 10)]


def _starts(rp) -> torch.Tensor:
    return torch.tensor(sorted(rp.offsets.values()), dtype=torch.int64)


SMALL = [
    # (shape kwargs, tp_t, pp, vpp, world, rollout tps)
    (dict(), 2, 2, 1, 8, (1, 2, 4, 8)),  # tp 8 > kv 4: replicated KV heads
    (dict(qkv_bias=True, tie_embeddings=True), 2, 1, 1, 4, (1, 2, 4)),
    (dict(num_query_groups=2, qk_norm=True, vocab_size=300), 2, 2, 2, 8, (1, 2, 4, 8)),
    (dict(num_query_groups=8), 8, 1, 1, 8, (1, 2, 8)),  # one group per rank at tp 8: qkv shared
    (dict(), 1, 2, 1, 4, (1, 2, 4)),
    (dict(num_query_groups=8, vocab_size=256), 4, 1, 1, 8, (8,)),
]


@pytest.mark.parametrize("kw,tp,pp,vpp,world,rollout", SMALL)
@pytest.mark.parametrize("fused_norms,bucket_bytes", [(False, 140_000), (True, 140_000), (False, 3_000)])
def test_small_layouts_simulated(kw, tp, pp, vpp, world, rollout, fused_norms, bucket_bytes):
    """Every rank's tensors equal vLLM's, each element written once; 3 kB buckets cut shards over buckets."""
    shape = _shape(tp, **kw)
    hf = layouts.hf_tensors(shape)
    shards = layouts.megatron_shards(hf, shape, tp, fused_norms)
    layout = ParallelLayout.from_world(world, tp=tp, pp=pp, vpp=vpp)
    for tp_i in rollout:
        plan = ReshardPlan(
            shape, layout.with_rollout_tp(tp_i), bucket_bytes=bucket_bytes, element_size=8, fused_norms=fused_norms
        )
        if bucket_bytes < 10_000 and plan.needed:
            assert len(plan.buckets) > len(plan.needed)  # shards really were cut
        assert set(plan.sources) <= set(shards)
        for role in _roles(plan):
            got, writes = _simulate(plan, shards, role)
            expected = layouts.vllm_tensors(hf, shape, tp_i, role[2], pad_vocab=tp_i > 1)
            assert list(got) == list(expected)
            shared = plan.for_rank(*role).shared
            for name, want in expected.items():
                if name in shared:  # a shared vocab shard shows Megatron's padding rows (vLLM never reads them)
                    megatron_pad = (want == layouts.VLLM_PAD) & (got[name] == layouts.MEGATRON_PAD)
                    want = torch.where(megatron_pad, got[name], want)
                assert torch.equal(got[name], want), f"tp_i={tp_i} role={role}: {name}"
            padding = sum(int((t == layouts.VLLM_PAD).sum()) for n, t in expected.items() if n not in shared)
            assert int((writes == 1).sum()) + padding == writes.numel() and bool((writes <= 1).all())
        _check_symbolic(plan, _roles(plan), pad_vocab=tp_i > 1)


def test_sharing_and_buckets():
    shape = _shape(2)
    same = ReshardPlan(shape, ParallelLayout.from_world(2, tp=2, rollout_tp=2), bucket_bytes=140_000, element_size=8)
    rp = same.for_rank(0, 1, 1)
    # equal TP, one rank per stage: row-parallel, gate_up, norms and the embedding shard are views
    assert (
        "model.layers.0.self_attn.o_proj.weight" in rp.shared and "model.layers.3.mlp.gate_up_proj.weight" in rp.shared
    )
    assert "model.layers.0.self_attn.qkv_proj.weight" not in rp.shared  # 2 groups per rank: regrouped
    assert all(len(b.names) and b.numel * 8 <= 70_000 for b in same.buckets)
    # buckets are per stage and hold every shard some rank must receive, once
    pp = ReshardPlan(shape, ParallelLayout.from_world(4, tp=2, pp=2), bucket_bytes=140_000, element_size=8)
    names = [n for b in pp.buckets for n in b.names]
    assert sorted(names) == sorted(pp.needed) and len(names) == len(set(names))
    assert [b.stage for b in pp.buckets] == sorted(b.stage for b in pp.buckets)
    assert all(pp.sources[n].stage == b.stage for b in pp.buckets for n in b.names)


# ---- 70B-scale layouts, symbolically ---------------------------------------------------------------------
LLAMA_70B = dict(
    num_layers=80, hidden_size=8192, num_attention_heads=64, num_query_groups=8, ffn_hidden_size=28672,
    vocab_size=128256,
)  # fmt: skip


def _groups(idx: torch.Tensor):
    order = torch.argsort(idx, stable=True)
    values, counts = torch.unique_consecutive(idx[order], return_counts=True)
    yield from zip(values.tolist(), order.split(counts.tolist()), strict=True)


def _check_symbolic(plan: ReshardPlan, roles, pad_vocab: bool) -> None:
    shape, tp, tp_i = plan.shape, plan.layout.tp, plan.rollout_tp
    starts, _ = layouts.hf_ids(shape)
    for stage, tp_rank, j in roles:
        rp = plan.for_rank(stage, tp_rank, j, merge=False)
        src_ids, dst_ids = [], []
        blocks = []
        for k, b in enumerate(plan.buckets):
            c = rp.copies[k]
            if not len(c):
                continue
            blocks.append(c)
            offs = torch.tensor(b.offsets)
            ends = torch.stack([c[:, 0], c[:, 0] + c[:, 2] - 1])  # first and last element of each block
            r, o = ends // b.numel, ends % b.numel
            assert torch.equal(r[0], r[1]), "a block crosses TP ranks of the gathered bucket"
            which = torch.searchsorted(offs, o, right=True) - 1
            assert torch.equal(which[0], which[1]), "a block crosses two source shards"
            ids, runs = torch.empty_like(o), torch.empty_like(o)
            for i, pos in _groups(which[0]):
                e = o[:, pos] - offs[i] + b.ranges[i][0]
                assert int(e.max()) < b.ranges[i][1] <= plan.sources[b.names[i]].numel
                ids[:, pos], runs[:, pos] = layouts.megatron_ids(b.names[i], r[:, pos], e, shape, tp, starts)
            assert torch.equal(runs[0], runs[1]), f"bucket {k}: a block leaves a contiguous run of its source"
            src_ids.append(ids)
        _check_shared(plan, rp, shape, tp, starts, pad_vocab)
        if not blocks:
            assert rp.dest_numel == 0, f"role {(stage, tp_rank, j)}: nothing copied into a non-empty buffer"
            continue
        c = torch.cat(blocks)
        ends = torch.stack([c[:, 1], c[:, 1] + c[:, 2] - 1])
        names = list(rp.offsets)
        offs = torch.tensor([rp.offsets[n] for n in names])
        which = torch.searchsorted(offs, ends, right=True) - 1
        assert torch.equal(which[0], which[1]), "a block crosses two destination tensors"
        ids, runs = torch.empty_like(ends), torch.empty_like(ends)
        for i, pos in _groups(which[0]):
            e = ends[:, pos] - offs[i]
            ids[:, pos], runs[:, pos] = layouts.vllm_ids(names[i], j, e, shape, tp_i, pad_vocab, starts)
        assert torch.equal(runs[0], runs[1]), "a block leaves a contiguous run of its destination"
        dst_ids.append(ids)
        src, dst = torch.cat(src_ids, 1), torch.cat(dst_ids, 1)
        assert bool((src >= 0).all()), "a block copies padding rows"
        assert torch.equal(src, dst), f"role {(stage, tp_rank, j)}: blocks copy the wrong elements"
        assert torch.equal(src[1] - src[0], c[:, 2] - 1)
        # every non-padding destination element exactly once
        order = torch.argsort(c[:, 1])
        d, n = c[order, 1], c[order, 2]
        assert bool((d[1:] >= d[:-1] + n[:-1]).all()), "destination blocks overlap"
        assert int(n.sum()) == sum(
            _real(plan.dests[j][i], j, shape, tp_i, pad_vocab)
            for i, dd in enumerate(plan.dests[j])
            if dd.name in rp.offsets
        )


def _real(dest, j, shape, tp_i, pad_vocab) -> int:
    if dest.name not in ("model.embed_tokens.weight", "lm_head.weight"):
        return dest.numel
    rows = dest.shape[0]
    first = j * rows if pad_vocab else 0
    return max(0, min(rows, shape.vocab_size - first)) * shape.hidden_size


def _check_shared(plan, rp, shape, tp, starts, pad_vocab) -> None:
    for d in plan.dests[rp.rollout_rank]:
        if d.name not in rp.shared:
            continue
        src, off = rp.shared[d.name]
        e = torch.unique(torch.cat([torch.linspace(0, d.numel - 1, 997).long(), torch.tensor([0, d.numel - 1])]))
        r = torch.full_like(e, 0 if plan.sources[src].replicated else rp.tp_rank)
        want, _ = layouts.vllm_ids(d.name, rp.rollout_rank, e, shape, plan.rollout_tp, pad_vocab, starts)
        got, _ = layouts.megatron_ids(src, r, off + e, shape, tp, starts)
        assert torch.equal(got, want), f"shared {d.name} is not a view of {src}"


@pytest.mark.parametrize(
    "tp,pp,vpp,tp_i,ranks",
    [(8, 4, 1, 4, (5, 127)), (8, 4, 1, 16, (13,)), (4, 4, 2, 8, (70,)), (8, 1, 1, 8, (7,))],
    ids=["tp8pp4-to-tp4", "tp8pp4-to-tp16-replicated-kv", "tp4pp4vpp2-to-tp8", "tp8-to-tp8-shared"],
)
def test_llama70b_plans(tp, pp, vpp, tp_i, ranks):
    shape = GPTShape(**LLAMA_70B, padded_vocab_size=padded_vocab_size(LLAMA_70B["vocab_size"], tp))
    layout = ParallelLayout.from_world(128 if pp > 1 else 8, tp=tp, pp=pp, vpp=vpp)
    plan = ReshardPlan(shape, layout.with_rollout_tp(tp_i), bucket_bytes=2**30, element_size=2)
    assert len(plan.sources) == 1 + 80 * 6 + 2  # embedding, 6 per layer, final norm, output layer
    roles = []
    for rank in ranks:
        c = layout.coords(rank)
        roles.append((c.pp, c.tp, rank % tp_i))
    _check_symbolic(plan, roles, pad_vocab=True)
    # the switch re-aimed at vLLM's parameters (into=): no buffer, every element kept, each row inside its tensor
    rp, dests = plan.for_rank(*roles[0]), plan.dests[roles[0][2]]
    sp = _ScatterPlan.build(rp, dests, ("all",), set(rp.offsets))
    rows = torch.cat([c for c in sp.copies if len(c)]) if rp.copied_numel else torch.empty(0, 4, dtype=torch.int64)
    sizes = torch.tensor([0] + [next(d.numel for d in dests if d.name == n) for n in sp.targets])
    assert sp.buffer_numel == 0 and int(rows[:, 3].sum()) == rp.copied_numel
    assert bool((rows[:, 1] > 0).all()) and bool((rows[:, 2] + rows[:, 3] <= sizes[rows[:, 1]]).all())
    if tp == tp_i and pp == 1:  # 8 groups at tp 8: every tensor but the vocab-split ones is a view
        assert len(plan.needed) == 2
    if tp_i == 16:  # two rollout ranks per KV head
        ks = [plan.dests[j][2].segments for j in (4, 5)]
        assert [(s.src_pos, s.size) for s in ks[0] if s.size == 128] == [
            (s.src_pos, s.size) for s in ks[1] if s.size == 128
        ]


# ---- one-line errors -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw,tp_i,world,match",
    [
        (dict(), 3, 6, r"rollout.tp_size \(3\) must divide num_attention_heads \(8\)"),
        (dict(num_attention_heads=12, num_query_groups=4, ffn_hidden_size=48), 6, 12, r"num_key_value_heads \(4\)"),
    ],
)
def test_bad_rollout_tp(kw, tp_i, world, match):
    with pytest.raises(PlanError, match=match):
        ReshardPlan(_shape(2, **kw), ParallelLayout.from_world(world, tp=2, rollout_tp=tp_i))


def test_other_errors():
    layout = ParallelLayout.from_world(4, tp=2, rollout_tp=2)
    with pytest.raises(PlanError, match=r"model family \('gpt2'\) has no vLLM layout entry; supported: llama"):
        ReshardPlan(_shape(2), layout, family="gpt2")
    with pytest.raises(PlanError, match=r"bucket_bytes \(31\) cannot hold one element x tp 2 x 2 buffer\(s\)"):
        ReshardPlan(_shape(2), layout, bucket_bytes=31, element_size=8, slots=2)
    with pytest.raises(PlanError, match=r"padded_vocab_size \(250\) is not divisible by actor.megatron.tp_size \(4\)"):
        ReshardPlan(dataclasses.replace(_shape(4), padded_vocab_size=250), ParallelLayout.from_world(4, tp=4))
    with pytest.raises(PlanError, match=r"pad_vocab \(False\) needs rollout.tp_size 1"):
        ReshardPlan(_shape(2), layout, pad_vocab=False)
