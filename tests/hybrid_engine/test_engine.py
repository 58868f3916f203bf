"""The hybrid engine on live gloo ranks: Megatron actors resharded into vLLM tensors, bit-exact against HF.

One 4-rank launch loads tiny HF checkpoints (Llama untied; Qwen2 tied + qkv bias) into Megatron actors at
TP1, TP2, PP2 and TP2 x PP2 (layouts re-initialised within the launch), switches each to rollout TP 1 and 2,
and compares every produced tensor with ``torch.equal`` against vLLM's fused layout built in the test
straight from the HF safetensors (``layouts.vllm_tensors``). Collectives are counted by wrapping
``torch.distributed`` (one broadcast per bucket at PP > 1, one all_gather per bucket at TP > 1).
"""

from __future__ import annotations

import os

import pytest

from tests.hybrid_engine import layouts
from tests.mcore import hf_tiny
from tests.multirank import run_ranks

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]  # (tp, pp) on 4 ranks
ROLLOUT_TP = (1, 2)
# transport memory (2 gathered buffers x tp local buckets) >= 2 x the largest fp32 shard x tp (embedding 256 x 64
# at TP 1, 128 x 64 at TP 2): several buckets per stage
BUCKET_BYTES = 140_000


def _counting(counts: dict) -> None:
    import torch.distributed as dist

    for name in ("broadcast", "all_gather_single", "all_gather_into_tensor"):
        original = getattr(dist, name, None)
        if original is None:
            continue

        def wrapped(*args, _original=original, _name=name, **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            return _original(*args, **kwargs)

        setattr(dist, name, wrapped)


def _body(rank: int, world_size: int, paths: dict) -> dict:
    import torch
    from safetensors.torch import load_file

    from hybridrl.distributed import ParallelLayout, init_model_parallel
    from hybridrl.hybrid_engine import HybridEngine
    from hybridrl.mcore import roles

    counts: dict = {}
    _counting(counts)
    report = {}
    for arch, path in paths.items():
        hf = {}
        for f in sorted(os.listdir(path)):
            if f.endswith(".safetensors"):
                hf.update(load_file(os.path.join(path, f)))
        for tp, pp in LAYOUTS:
            layout = ParallelLayout.from_world(world_size, tp=tp, pp=pp)
            init_model_parallel(layout)
            actor = roles.build_actor(path)
            storages = {p.untyped_storage().data_ptr() for p in actor.parameters()}
            for tp_i in ROLLOUT_TP:
                engine = HybridEngine.from_role(actor, layout.with_rollout_tp(tp_i), bucket_bytes=BUCKET_BYTES)
                counts.clear()
                out = engine.to_rollout()
                calls = sum(counts.values())
                again = engine.to_rollout()  # the buffer is reused: a second switch gives the same tensors
                want = layouts.vllm_tensors(hf, actor.shape, tp_i, engine.rollout_rank, tp_i > 1, pad_value=0.0)
                report[(arch, tp, pp, tp_i)] = {
                    "names": list(out) == list(want),
                    "unequal": [n for n in want if not torch.equal(out[n], want[n])],
                    "unstable": [n for n in want if not torch.equal(again[n], want[n])],
                    "shared_not_views": [
                        n for n in engine.rank_plan.shared if out[n].untyped_storage().data_ptr() not in storages
                    ],
                    "copied_are_views": [
                        n for n in engine.rank_plan.offsets if out[n].untyped_storage().data_ptr() in storages
                    ],
                    "stats": engine.stats.as_dict(),
                    "calls": calls,
                    "buckets": len(engine.plan.buckets),
                    "nbytes": sum(t.numel() * t.element_size() for t in out.values()),
                    "shared": sorted(engine.rank_plan.shared),
                }
                # straight into other tensors (vLLM's parameters on GPU): all of them, then every other one;
                # NaN-filled so unwritten elements (vocab padding must be zeroed) show
                fresh = {n: torch.full_like(t, float("nan")) for n, t in want.items()}
                into_all = engine.to_rollout(into=fresh)
                all_stats = engine.stats.as_dict()
                half = {n: fresh[n].fill_(float("nan")) for n in list(want)[::2]}
                into_half = engine.to_rollout(into=half)
                half_stats = engine.stats.as_dict()
                back = engine.to_rollout()  # and back to the flat buffer
                qkv = "model.layers.0.self_attn.qkv_proj.weight"
                try:  # the same names as before with one target of the right size but the wrong shape
                    engine.to_rollout(into={**fresh, qkv: fresh[qkv].view(-1)})
                    reshaped_target = "accepted"
                except Exception as e:
                    reshaped_target = type(e).__name__
                report[(arch, tp, pp, tp_i)]["into"] = {
                    "unequal_all": [n for n in want if not torch.equal(into_all[n], want[n])],
                    "unequal_half": [n for n in want if not torch.equal(into_half[n], want[n])],
                    "unequal_back": [n for n in want if not torch.equal(back[n], want[n])],
                    "not_targets": [n for n in half if into_half[n].data_ptr() != fresh[n].data_ptr()],
                    "reshaped_target": reshaped_target,
                    "all": all_stats,
                    "half": half_stats,
                    "half_bytes": sum(t.numel() * t.element_size() for t in half.values()),
                    "rest_copied_bytes": sum(
                        want[n].numel() * 4 for n in want if n not in half and n not in engine.rank_plan.shared
                    ),
                }
            # offloading a model (RoleModel.offload / onload on GPU) rebinds each parameter's data: the next
            # switch must read the new tensors (the old ones are poisoned here), shared views included
            old = [p.data for p in actor.parameters()]
            for p in actor.parameters():
                p.data = p.data.clone()
            for t in old:
                t.fill_(float("nan"))
            rebound = engine.to_rollout()
            report[(arch, tp, pp, "rebound")] = [n for n in want if not torch.equal(rebound[n], want[n])]
    report["wrong_layout"] = _wrong_layouts(actor, layout)  # the last one: tp 2 x pp 2
    return report


def _wrong_layouts(actor, layout) -> list[str]:
    """The errors of a layout that is not the one the groups were built from (one line each, naming both)."""
    from hybridrl.distributed import LayoutError, ParallelLayout
    from hybridrl.hybrid_engine import HybridEngine
    from hybridrl.mcore.parallel_state import rollout_replica_info

    out = []
    for call in (
        lambda: HybridEngine.from_role(actor, ParallelLayout.from_world(layout.world_size, tp=1, pp=2)),
        lambda: rollout_replica_info(layout.with_rollout_tp(2)),  # the replica groups were built for rollout tp 1
    ):
        try:
            call()
            out.append("accepted")
        except LayoutError as e:
            out.append(str(e))
    return out


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid_engine")
    paths = {
        arch: hf_tiny.make_checkpoint(arch, str(root / arch), seed=20 + i) for i, arch in enumerate(("llama", "qwen2"))
    }
    return run_ranks(_body, 4, paths, timeout=300)


CASES = [(arch, tp, pp, tp_i) for arch in ("llama", "qwen2") for tp, pp in LAYOUTS for tp_i in ROLLOUT_TP]


@pytest.mark.multirank
def test_a_layout_other_than_the_groups_is_refused(reports):
    for report in reports:
        engine, replicas = report["wrong_layout"]
        assert engine.startswith("layout.tp (1) != the initialised parallel state's (2); pass the layout"), engine
        assert replicas.startswith("the rollout replica groups were built for rollout tp=1 x 4 replicas, not "
                                   "rollout tp=2 x 2 replicas"), replicas  # fmt: skip


@pytest.mark.multirank
@pytest.mark.parametrize("arch,tp,pp,tp_i", CASES)
def test_rollout_tensors_are_bit_exact(reports, arch, tp, pp, tp_i):
    for rank, report in enumerate(reports):
        r = report[(arch, tp, pp, tp_i)]
        assert r["names"], f"rank {rank}: vLLM names or order differ"
        assert not r["unequal"], f"rank {rank}: {len(r['unequal'])} tensors differ, e.g. {r['unequal'][:3]}"
        assert not r["unstable"], f"rank {rank}: second switch differs: {r['unstable'][:3]}"
        assert not r["shared_not_views"] and not r["copied_are_views"]


@pytest.mark.multirank
@pytest.mark.parametrize("arch,tp,pp,tp_i", CASES)
def test_switch_straight_into_given_tensors(reports, arch, tp, pp, tp_i):
    """to_rollout(into=...) (the GPU path into vLLM's own parameters) writes the same bits, with no staging buffer
    when every tensor has a target; names without one still go through a (smaller) buffer."""
    for rank, report in enumerate(reports):
        r = report[(arch, tp, pp, tp_i)]["into"]
        assert not r["unequal_all"], f"rank {rank}: into= differs from HF's cut: {r['unequal_all'][:3]}"
        assert not r["unequal_half"], f"rank {rank}: partial into= differs: {r['unequal_half'][:3]}"
        assert not r["unequal_back"], f"rank {rank}: flat buffer after into= differs: {r['unequal_back'][:3]}"
        assert not r["not_targets"], "into= must return the given tensors themselves"
        assert r["reshaped_target"] == "PlanError", "targets are checked on every call, not only the first"
        full, half = r["all"], r["half"]
        assert full["dest_bytes"] == 0 and full["bytes_shared"] == 0
        assert full["bytes_direct"] == report[(arch, tp, pp, tp_i)]["nbytes"]
        assert half["dest_bytes"] == r["rest_copied_bytes"] and half["bytes_direct"] == r["half_bytes"]
        assert full["peak_extra_bytes"] <= BUCKET_BYTES


@pytest.mark.multirank
@pytest.mark.parametrize("arch,tp,pp,tp_i", CASES)
def test_one_collective_per_bucket_and_sane_stats(reports, arch, tp, pp, tp_i):
    for report in reports:
        r = report[(arch, tp, pp, tp_i)]
        s = r["stats"]
        per_bucket = (tp > 1) + (pp > 1)
        assert r["calls"] == s["collectives"] == r["buckets"] * per_bucket
        assert s["buckets"] == r["buckets"] and (r["buckets"] > 1 or per_bucket == 0 or tp == tp_i)
        # every byte of the rollout tensors is copied or shared, except the 6 vocab padding rows of rank 1 at tp 2
        assert r["nbytes"] - s["bytes_copied"] - s["bytes_shared"] in (0, 6 * 64 * 4, 2 * 6 * 64 * 4)
        assert s["bytes_copied"] <= s["dest_bytes"]
        # the transport's memory (both gathered buffers of the overlapped switch) stays within bucket_bytes
        assert s["seconds"] > 0 and s["peak_extra_bytes"] <= BUCKET_BYTES
        assert (s["peak_extra_bytes"] > 0) == (s["buckets"] > 0)
        if pp == 1 and tp == 1:
            assert s["bytes_moved"] == 0
        if pp == 1 and tp == tp_i:  # every rank holds its own shards: row-parallel, fc1 and norms are views
            assert "model.layers.0.mlp.down_proj.weight" in r["shared"]
            assert "model.layers.0.post_attention_layernorm.weight" in r["shared"]
            assert s["bytes_shared"] > 0


@pytest.mark.multirank
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("tp,pp", LAYOUTS)
def test_switch_reads_parameters_rebound_by_offload(reports, arch, tp, pp):
    for rank, report in enumerate(reports):
        assert not report[(arch, tp, pp, "rebound")], (
            f"rank {rank}: stale tensors {report[(arch, tp, pp, 'rebound')][:3]}"
        )
