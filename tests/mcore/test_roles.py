"""Actor, reference, critic and reward model built from HF checkpoints on the same TP2 x PP2 process groups.

One 4-rank gloo launch builds every role and reports its state (trainable or frozen, offloaded or not),
the critic's per-token values (compared here with HF ``*ForSequenceClassification``'s ``score`` over its
own hidden states), its gradients, its export, and the errors a role raises on the wrong checkpoint.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.mcore import hf_tiny
from tests.multirank import run_ranks

pytestmark = pytest.mark.multirank

TOL = 1e-4


def _named(model) -> dict[str, torch.Tensor]:
    from hybridrl.mcore.bridge import global_parameters

    return {n: p.detach().clone() for n, p in global_parameters(model.chunks)}


def _body(rank: int, world_size: int, paths: dict, ids: torch.Tensor) -> dict:
    from hybridrl.distributed import ParallelLayout, init_model_parallel
    from hybridrl.mcore import bridge, gpt, roles

    init_model_parallel(ParallelLayout.from_world(world_size, tp=2, pp=2))
    r: dict = {}
    actor = roles.build_actor(paths["lm"])
    r["actor"] = (actor.trainable, all(p.requires_grad for p in actor.parameters()), actor.chunks[0].training)
    from megatron.core.transformer.mlp import MLP

    from hybridrl.mcore.swiglu import swiglu

    mlps = [m for c in actor.chunks for m in c.modules() if isinstance(m, MLP)]
    r["actor_mlp_swiglu"] = [m.activation_func is swiglu for m in mlps]

    ref = roles.build_reference(paths["lm"], offload=True)
    r["ref_offloaded_at_build"] = ref.offloaded
    try:
        ref.require_onloaded()
    except RuntimeError as err:
        r["ref_offloaded_error"] = str(err)
    ref.onload()
    ref.onload()  # idempotent
    r["ref_onloaded"] = not ref.offloaded
    r["ref_frozen"] = (ref.trainable, any(p.requires_grad for p in ref.parameters()), ref.chunks[0].training)
    a, b = _named(actor), _named(ref)
    ref.offload()
    ref.onload()
    r["ref_equals_actor"] = sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    r["ref_kept_values"] = all(torch.equal(b[k], v) for k, v in _named(ref).items())

    zero = roles.build_critic(paths["lm"])  # causal LM: lm_head ignored, zero head
    r["zero_values"] = hf_tiny.megatron_outputs(zero.chunks, None, ids)
    small = roles.build_critic(paths["lm"], value_head_std=0.02)
    r["small_values"] = hf_tiny.megatron_outputs(small.chunks, None, ids)
    from_file = roles.build_critic(paths["lm"], value_head_path=paths["head_file"])
    r["file_head"] = [c.output_layer.weight.detach().clone() for c in from_file.chunks if c.post_process]

    critic = roles.build_critic(paths["cls"])
    r["critic_values"] = hf_tiny.megatron_outputs(critic.chunks, None, ids)
    batch = {"input_ids": ids, "position_ids": torch.arange(ids.shape[1]).expand_as(ids).contiguous()}
    gpt.forward_backward(critic.chunks, [batch], lambda out, _: (out.float().square().mean(), {}))
    grads = {n: p.grad for n, p in bridge.global_parameters(critic.chunks)}
    r["critic_grads"] = {n: g is not None and g.abs().sum().item() > 0 for n, g in grads.items()}
    critic.export(os.path.join(paths["out"], "critic"), max_shard_bytes=40_000)

    rm = roles.build_reward_model(paths["cls"])
    r["rm_values"] = hf_tiny.megatron_outputs(rm.chunks, None, ids)
    r["rm_frozen"] = (rm.trainable, any(p.requires_grad for p in rm.parameters()))
    try:
        roles.build_reward_model(paths["lm"])
    except bridge.CheckpointError as err:
        r["rm_error"] = str(err)
    return hf_tiny.portable(r)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = tmp_path_factory.mktemp("roles")
    paths = {
        "lm": hf_tiny.make_checkpoint("qwen2", str(root / "lm"), seed=21),
        "cls": hf_tiny.make_checkpoint("llama", str(root / "cls"), seed=22, score=True),
        "head_file": str(root / "head.safetensors"),
        "out": str(root / "out"),
    }
    head = torch.randn(1, 64, generator=torch.Generator().manual_seed(23))
    save_file({"score.weight": head}, paths["head_file"])
    ids = hf_tiny.input_ids()
    ref = hf_tiny.hf_outputs(paths["cls"], ids, score=True)
    return hf_tiny.tensors(run_ranks(_body, 4, paths, ids, timeout=600)), ref, head, paths


def test_actor_is_trainable(report):
    for r in report[0]:
        assert r["actor"] == (True, True, True)


def test_actor_mlps_use_the_swiglu_that_keeps_only_its_input(report):
    """The trainer's builder gives every dense MLP hybridrl.mcore.swiglu (numerics: tests/mcore/test_swiglu.py)."""
    for r in report[0]:
        assert r["actor_mlp_swiglu"] and all(r["actor_mlp_swiglu"]), r["actor_mlp_swiglu"]


def test_reference_is_frozen_and_offloadable(report):
    for r in report[0]:
        assert r["ref_offloaded_at_build"] and "offloaded; call onload()" in r["ref_offloaded_error"]
        assert r["ref_onloaded"] and r["ref_kept_values"]
        assert r["ref_frozen"] == (False, False, False)
        assert r["ref_equals_actor"]


def test_critic_values_match_hf_score(report):
    reports, ref, _, _ = report
    for r in reports:
        assert r["critic_values"].shape == ref.shape == (hf_tiny.BATCH, hf_tiny.SEQ, 1)
        diff = (r["critic_values"] - ref).abs().max().item()
        assert diff <= TOL, f"max |critic - hf score| = {diff:.2e}"


def test_critic_value_head_init(report):
    reports, _, head, _ = report
    for r in reports:
        assert torch.count_nonzero(r["zero_values"]) == 0
        assert r["small_values"].abs().max() > 0
        for w in r["file_head"]:
            assert torch.equal(w, head)


def test_critic_trains_head_and_backbone(report):
    for r in report[0]:
        grads = r["critic_grads"]
        assert grads and all(grads.values()), [n for n, ok in grads.items() if not ok]
    names = set().union(*(r["critic_grads"] for r in report[0]))
    assert "output_layer.weight" in names and "embedding.word_embeddings.weight" in names


def test_critic_export_round_trip(report):
    _, _, _, paths = report
    src = load_file(os.path.join(paths["cls"], "model.safetensors"))
    out = os.path.join(paths["out"], "critic")
    got = {}
    for f in os.listdir(out):
        if f.endswith(".safetensors"):
            got.update(load_file(os.path.join(out, f)))
    assert sorted(got) == sorted(src) and all(torch.equal(src[k], got[k]) for k in src)
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == ["LlamaForSequenceClassification"] and len(config["id2label"]) == 1


def test_reward_model(report):
    reports, ref, _, _ = report
    for r in reports:
        assert r["rm_frozen"] == (False, False)
        assert (r["rm_values"] - ref).abs().max().item() <= TOL
        assert "tensor score.weight is missing" in r["rm_error"]


def _sp_head_body(rank: int, world_size: int) -> dict:
    from hybridrl.distributed import ParallelLayout, init_model_parallel
    from hybridrl.mcore.roles import ValueHead

    init_model_parallel(ParallelLayout.from_world(world_size, tp=world_size))
    gen = torch.Generator().manual_seed(3)
    full = torch.randn(8, 3, 16, generator=gen)  # (s, b, h)
    head = ValueHead(16, torch.float32, init_std=0.5)
    head.weight.data = torch.randn(1, 16, generator=gen)  # the same on every rank (same seed)
    head.sequence_parallel = True
    mine = full.chunk(world_size)[rank].clone().requires_grad_(True)  # this rank's s/tp positions
    values, _ = head(mine)
    values.square().sum().backward()
    ref_w = head.weight.detach().clone().requires_grad_(True)
    ref_h = full.clone().requires_grad_(True)
    ref = torch.matmul(ref_h, ref_w.t())
    ref.square().sum().backward()
    return {
        "values": (values - ref).abs().max().item(),
        "weight_grad": (head.weight.grad - ref_w.grad).abs().max().item(),
        "hidden_grad": (mine.grad - ref_h.grad.chunk(world_size)[rank]).abs().max().item(),
        "shape": list(values.shape),
    }


@pytest.mark.multirank
def test_value_head_gathers_the_sequence_parallel_region():
    """Under sequence parallelism each TP rank holds s/tp positions; the head gathers them: full values, the
    full head gradient on every rank (no TP all-reduce needed) and each rank's slice of the hidden gradient."""
    for r in run_ranks(_sp_head_body, 2, timeout=300):
        assert r["shape"] == [8, 3, 1], r
        assert r["values"] <= 1e-6 and r["weight_grad"] <= 1e-5 and r["hidden_grad"] <= 1e-6, r


def _final_norm_body(rank: int, world_size: int) -> str:
    from megatron.core.transformer import transformer_block

    from hybridrl.distributed import ParallelLayout, init_model_parallel
    from hybridrl.mcore import gpt

    class RefusesRMSNorm(torch.nn.Module):  # stands in for apex's FusedLayerNorm, Megatron's default with apex
        def __init__(self, config, hidden_size, eps=1e-5, **kwargs):
            super().__init__()
            assert config.normalization == "LayerNorm", f"({config.normalization}) is not supported"

    transformer_block.LayerNormImpl = RefusesRMSNorm
    init_model_parallel(ParallelLayout.from_world(world_size, tp=1, pp=world_size))
    shape = gpt.GPTShape(
        num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96, vocab_size=128
    )
    (chunk,) = gpt.build_model_chunks(shape, gpt.make_config(shape))
    norm = chunk.decoder.final_layernorm
    return f"{'none' if norm is None else type(norm).__name__} {len(chunk.decoder.layers)}"


@pytest.mark.multirank
def test_local_spec_final_norm_is_torch_rmsnorm_even_with_apex():
    """Without TransformerEngine the decoder's final norm is torch's RMSNorm whatever Megatron's block default
    (apex's FusedLayerNorm when apex is installed, which refuses RMSNorm), and each stage builds its layers."""
    assert run_ranks(_final_norm_body, 2, timeout=300) == ["none 2", "RMSNorm 2"]
