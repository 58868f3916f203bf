"""The HF <-> Megatron weight bridge: bit-exact round trips, layout coverage, and one-line errors on bad input.

One 4-rank gloo launch loads tiny HF checkpoints (Llama sharded + untied, Qwen2 tied + qkv bias, Qwen3
QK-norm) at TP2 x PP2 and at TP2 x DP2, exports them back with small shard files, and also checks that a
bad checkpoint fails before any rank builds a model. The parent compares every exported tensor with
``torch.equal`` and reloads the export in HF transformers. Validation and layout tests need no ranks.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.mcore import hf_tiny
from tests.multirank import run_ranks

# (arch, tp, pp, vpp) on 4 ranks; tp=2 pp=1 has dp=2 (the export takes DP rank 0's copy)
ROUND_TRIP = [("llama", 2, 2, 1), ("qwen2", 2, 2, 1), ("qwen3", 2, 2, 1), ("llama", 2, 1, 1), ("qwen2", 1, 2, 2)]


def _all_tensors(path: str) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


# ---- multi-rank: export round trip ---------------------------------------------------------------------
def _round_trip_body(rank: int, world_size: int, paths: dict, out_root: str, bad_path: str) -> dict:
    from hybridrl.distributed import ParallelLayout, init_model_parallel
    from hybridrl.mcore import bridge, gpt, roles

    report = {}
    for arch, tp, pp, vpp in ROUND_TRIP:
        init_model_parallel(ParallelLayout.from_world(world_size, tp=tp, pp=pp, vpp=vpp))
        actor = roles.build_actor(paths[arch])
        actor.export(os.path.join(out_root, f"{arch}_tp{tp}_pp{pp}_vpp{vpp}"), max_shard_bytes=40_000)
    # A bad checkpoint fails in validation: no rank gets as far as building the model.
    built = []
    original = gpt.build_model_chunks
    gpt.build_model_chunks = lambda *a, **k: built.append(1) or original(*a, **k)
    try:
        roles.build_actor(bad_path)
    except bridge.CheckpointError as err:
        report["bad_error"] = str(err)
    finally:
        gpt.build_model_chunks = original
    report["bad_built"] = len(built)
    return report


@pytest.fixture(scope="module")
def round_trip(tmp_path_factory):
    root = tmp_path_factory.mktemp("bridge")
    paths = {}
    for i, arch in enumerate(("llama", "qwen2", "qwen3")):
        paths[arch] = hf_tiny.make_checkpoint(
            arch, str(root / arch), seed=10 + i, max_shard_size="60KB" if arch == "llama" else None
        )
    bad = str(root / "bad")
    shutil.copytree(paths["qwen2"], bad)
    tensors = load_file(os.path.join(bad, "model.safetensors"))
    del tensors["model.layers.3.mlp.up_proj.weight"]
    save_file(tensors, os.path.join(bad, "model.safetensors"), metadata={"format": "pt"})
    out_root = str(root / "out")
    reports = run_ranks(_round_trip_body, 4, paths, out_root, bad, timeout=600)
    return paths, out_root, reports


@pytest.mark.multirank
@pytest.mark.parametrize("arch,tp,pp,vpp", ROUND_TRIP)
def test_export_round_trip_is_bit_exact(round_trip, arch, tp, pp, vpp):
    paths, out_root, _ = round_trip
    out = os.path.join(out_root, f"{arch}_tp{tp}_pp{pp}_vpp{vpp}")
    src, got = _all_tensors(paths[arch]), _all_tensors(out)
    assert sorted(got) == sorted(src)
    unequal = [k for k in src if not torch.equal(src[k], got[k])]
    assert not unequal, f"{len(unequal)} tensors differ, e.g. {unequal[:3]}"
    files = [f for f in os.listdir(out) if f.endswith(".safetensors")]
    assert len(files) > 1 and os.path.isfile(os.path.join(out, "model.safetensors.index.json"))
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        assert sorted(json.load(f)["weight_map"]) == sorted(src)
    assert os.path.isfile(os.path.join(out, "tokenizer_config.json"))
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == [type(hf_tiny.tiny_config(arch)).__name__.replace("Config", "ForCausalLM")]


@pytest.mark.multirank
def test_export_loads_in_transformers(round_trip):
    paths, out_root, _ = round_trip
    ids = hf_tiny.input_ids()
    for arch in ("qwen2", "llama"):
        ref = hf_tiny.hf_outputs(paths[arch], ids)
        assert torch.equal(hf_tiny.hf_outputs(os.path.join(out_root, f"{arch}_tp2_pp2_vpp1"), ids), ref)


@pytest.mark.multirank
def test_bad_checkpoint_fails_before_the_model_is_built(round_trip):
    _, _, reports = round_trip
    for r in reports:
        assert r["bad_built"] == 0
        assert "model.layers.3.mlp.up_proj.weight is missing" in r["bad_error"]


# ---- no ranks: validation errors -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return hf_tiny.make_checkpoint("qwen2", str(tmp_path_factory.mktemp("good")), seed=5)


def _variant(good: str, tmp_path, edit=None, config_edit=None) -> str:
    path = str(tmp_path / "variant")
    shutil.copytree(good, path)
    if edit:
        tensors = load_file(os.path.join(path, "model.safetensors"))
        edit(tensors)
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    if config_edit:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        config_edit(config)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f)
    return path


def _check(path: str, tp: int = 1, head: str = "lm"):
    from hybridrl.mcore import bridge, hf_config

    shape = hf_config.shape_from_hf(hf_config.load_hf_config(path), tp=tp)
    return bridge.validate(bridge.HFCheckpoint(path), shape, tp, head=head)


def test_good_checkpoint_validates(good):
    assert "model.layers.0.self_attn.q_proj.bias" in _check(good, tp=2)


@pytest.mark.parametrize(
    "edit,match",
    [
        (
            lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"),
            "tensor model.layers.1.self_attn.k_proj.bias is missing",
        ),
        (
            lambda t: t.update({"model.layers.4.mlp.up_proj.weight": torch.zeros(96, 64)}),
            "unexpected tensor model.layers.4",
        ),
        (
            lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(97, 64)}),
            r"tensor model.layers.0.mlp.up_proj.weight has shape \[97, 64\] but config.json implies \[96, 64\]",
        ),
    ],
    ids=["missing", "extra", "shape"],
)
def test_checkpoint_mismatch_errors(good, tmp_path, edit, match):
    from hybridrl.mcore.bridge import CheckpointError

    with pytest.raises(CheckpointError, match=match):
        _check(_variant(good, tmp_path, edit))


def test_kv_heads_not_divisible_by_tp(good):
    from hybridrl.mcore import bridge, hf_config

    hf = hf_config.load_hf_config(good)
    with pytest.raises(hf_config.HFConfigError, match=r"num_key_value_heads \(2\) is not divisible by tp \(4\)"):
        hf_config.shape_from_hf(hf, tp=4)
    shape = hf_config.shape_from_hf(hf, tp=1)
    with pytest.raises(hf_config.HFConfigError, match="num_key_value_heads"):
        bridge.validate(bridge.HFCheckpoint(good), shape, tp=4)


def test_unreadable_checkpoints(good, tmp_path):
    from hybridrl.mcore.bridge import CheckpointError, HFCheckpoint

    with pytest.raises(CheckpointError, match="does not exist"):
        HFCheckpoint(str(tmp_path / "nowhere"))
    binary = _variant(good, tmp_path)
    os.rename(os.path.join(binary, "model.safetensors"), os.path.join(binary, "pytorch_model.bin"))
    with pytest.raises(CheckpointError, match=r"no safetensors weights .*pytorch_model.bin.*safe_serialization=True"):
        HFCheckpoint(binary)
    with open(os.path.join(binary, "model.safetensors"), "wb") as f:
        f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    with pytest.raises(CheckpointError, match=r"model.safetensors .*corrupt"):
        HFCheckpoint(binary)
    os.remove(os.path.join(binary, "model.safetensors"))
    with open(os.path.join(binary, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}, f)
    with pytest.raises(CheckpointError, match=r"model-00001-of-00002.safetensors is listed .* but missing"):
        HFCheckpoint(binary).shapes()


@pytest.mark.parametrize(
    "config_edit,match",
    [
        (
            lambda c: c.update(architectures=["GPT2LMHeadModel"]),
            r"unsupported architecture \['GPT2LMHeadModel'\].*LlamaForCausalLM",
        ),
        (lambda c: c.update(hidden_act="gelu"), r"hidden_act \('gelu'\) is not supported"),
        (
            lambda c: c.update(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
            r"rope_type \('yarn'\) is not supported",
        ),
        (
            lambda c: c.update(
                rope_parameters={
                    "rope_type": "llama3",
                    "rope_theta": 1e4,
                    "factor": 8.0,
                    "low_freq_factor": 2.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192,
                }
            ),
            r"rope_parameters.low_freq_factor \(2.0\) must be 1.0",
        ),
        (
            lambda c: c.update(
                use_sliding_window=True,
                max_window_layers=2,
                layer_types=["full_attention"] * 2 + ["sliding_attention"] * 2,
                sliding_window=8,
            ),
            r"use_sliding_window \(True\)",
        ),
    ],
    ids=["architecture", "activation", "rope_type", "llama3_factors", "qwen_sliding"],
)
def test_unsupported_configs(good, tmp_path, config_edit, match):
    from hybridrl.mcore.hf_config import HFConfigError, load_hf_config, shape_from_hf

    with pytest.raises(HFConfigError, match=match):
        shape_from_hf(load_hf_config(_variant(good, tmp_path, config_edit=config_edit)))


def test_missing_config(tmp_path):
    from hybridrl.mcore.hf_config import HFConfigError, load_hf_config

    with pytest.raises(HFConfigError, match=r"no config\.json"):
        load_hf_config(str(tmp_path))


# ---- no ranks: layout math -------------------------------------------------------------------------------
def test_fused_norm_names():
    """TransformerEngine's spec keeps the pre-attention / pre-MLP norms inside linear_qkv / linear_fc1."""
    from hybridrl.mcore.bridge_layout import layer_maps
    from hybridrl.mcore.gpt import GPTShape

    shape = GPTShape(2, 64, 4, 2, 96, 250)
    local = {m.megatron: m.hf_names for m in layer_maps(shape, 1, 1)}
    fused = {m.megatron: m.hf_names for m in layer_maps(shape, 1, 1, fused_norms=True)}
    assert local["decoder.layers.1.input_layernorm.weight"] == ("model.layers.1.input_layernorm.weight",)
    assert local["decoder.layers.1.pre_mlp_layernorm.weight"] == ("model.layers.1.post_attention_layernorm.weight",)
    assert (
        fused["decoder.layers.1.self_attention.linear_qkv.layer_norm_weight"]
        == local["decoder.layers.1.input_layernorm.weight"]
    )
    assert (
        fused["decoder.layers.1.mlp.linear_fc1.layer_norm_weight"] == local["decoder.layers.1.pre_mlp_layernorm.weight"]
    )


def test_padded_vocab_size():
    from hybridrl.mcore.gpt import padded_vocab_size

    assert [padded_vocab_size(250, tp) for tp in (1, 2, 4)] == [256, 256, 256]
    assert padded_vocab_size(300, 2) == 384 and padded_vocab_size(256, 1) == 256
    assert padded_vocab_size(151_936, 8, divisor=128) == 151_552 + 1024


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize(
    "heads,groups,qkv_bias,tied", [(8, 4, True, False), (8, 8, False, True), (16, 4, False, False)]
)
def test_every_hf_row_has_exactly_one_home(tp, heads, groups, qkv_bias, tied):
    """Over all TP ranks, each row of each HF tensor lands in exactly one shard (what export relies on)."""
    from hybridrl.mcore.bridge_layout import hf_shapes, tensor_maps
    from hybridrl.mcore.gpt import GPTShape, padded_vocab_size

    shape = GPTShape(
        2, 64, heads, groups, 96, 250, head_dim=16, qkv_bias=qkv_bias, tie_embeddings=tied,
        padded_vocab_size=padded_vocab_size(250, tp),
    )  # fmt: skip
    expected = hf_shapes(shape)
    seen: dict[str, torch.Tensor] = {}
    for m in tensor_maps(shape, tp):
        if not m.export:
            continue
        sizes = set()
        for rank in range(len(m.shards)):
            sizes.add(sum(p.size for p in m.pieces(rank)))
            for p in m.pieces(rank):
                if p.hf is not None:
                    rows = seen.setdefault(p.hf, torch.zeros(expected[p.hf][m.dim], dtype=torch.int))
                    rows[p.start : p.stop] += 1
        assert len(sizes) == 1, f"{m.megatron}: unequal shard sizes {sizes}"
    assert sorted(seen) == sorted(expected)
    for name, rows in seen.items():
        assert torch.equal(rows, torch.ones_like(rows)), name
