"""Megatron models loaded from Hugging Face checkpoints give HF transformers' logits on every layout.

Four tiny architectures, each exercising one part of the mapping (Llama: llama3 RoPE scaling, sharded
checkpoint; Qwen2: qkv bias, tied embeddings; Mistral: sliding window shorter than the sequence; Qwen3:
QK-norm, head_dim != hidden / heads), all with a vocab (250) that needs padding. The HF forward runs here
(the independent reference); one 4-rank gloo launch loads every checkpoint through the bridge at TP1, TP2
(dp=2), PP2 (dp=2), TP2 x PP2 (and PP2 x VPP2 for Llama) and returns the TP-gathered logits. Two sabotaged
layouts (k/v swapped inside each query group; gate/up swapped in linear_fc1), injected by replacing the
bridge's layout functions, must land far from HF: the parity check can fail.
"""

from __future__ import annotations

import pytest
import torch

from tests.mcore import hf_tiny
from tests.multirank import run_ranks

pytestmark = pytest.mark.multirank

TOL = 1e-4  # fp32
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]  # (tp, pp) on 4 ranks


def _swap_kv(prefix, shape, tp, rank, suffix="weight"):
    from hybridrl.mcore.bridge_layout import Piece

    pieces = list(_ORIGINAL["qkv"](prefix, shape, tp, rank, suffix))
    for i in range(0, len(pieces), 3):  # [q_g, k_g, v_g] -> [q_g, v_g, k_g]
        _, k, v = pieces[i : i + 3]
        pieces[i + 1 : i + 3] = [Piece(v.hf, v.start, v.stop), Piece(k.hf, k.start, k.stop)]
    return tuple(pieces)


def _swap_gate_up(prefix, shape, tp, rank):
    return tuple(reversed(_ORIGINAL["gate_up"](prefix, shape, tp, rank)))


_ORIGINAL: dict = {}


def _body(rank: int, world_size: int, paths: dict[str, str], ids: torch.Tensor) -> dict:
    from hybridrl.distributed import ParallelLayout, init_model_parallel
    from hybridrl.mcore import bridge_layout, roles

    out = {}
    for tp, pp in LAYOUTS:
        init_model_parallel(ParallelLayout.from_world(world_size, tp=tp, pp=pp))
        for arch, path in paths.items():
            actor = roles.build_actor(path)
            out[(arch, tp, pp)] = hf_tiny.megatron_outputs(actor.chunks, hf_tiny.VOCAB, ids)
            out[("padded_vocab", arch, tp, pp)] = actor.shape.padded_vocab
    init_model_parallel(ParallelLayout.from_world(world_size, tp=1, pp=2, vpp=2))  # 4 chunks of 1 layer
    out["llama_vpp"] = hf_tiny.megatron_outputs(roles.build_actor(paths["llama"]).chunks, hf_tiny.VOCAB, ids, 2)
    init_model_parallel(ParallelLayout.from_world(world_size, tp=2, pp=2))
    # Sabotage, on the last layout (TP2 x PP2): the parity check must notice.
    _ORIGINAL.update(qkv=bridge_layout.qkv_pieces, gate_up=bridge_layout.gate_up_pieces)
    for name, attr, fake in (("kv_swap", "qkv_pieces", _swap_kv), ("gate_up_swap", "gate_up_pieces", _swap_gate_up)):
        setattr(bridge_layout, attr, fake)
        try:
            out[name] = hf_tiny.megatron_outputs(roles.build_actor(paths["llama"]).chunks, hf_tiny.VOCAB, ids)
        finally:
            setattr(bridge_layout, attr, _ORIGINAL["qkv" if attr == "qkv_pieces" else "gate_up"])
    return hf_tiny.portable(out) if rank == 0 else {}


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    ids = hf_tiny.input_ids()
    paths, refs = {}, {}
    for arch in hf_tiny.ARCHS:
        path = str(tmp_path_factory.mktemp(arch))
        hf_tiny.make_checkpoint(arch, path, seed=len(paths), max_shard_size="60KB" if arch == "llama" else None)
        paths[arch], refs[arch] = path, hf_tiny.hf_outputs(path, ids)
    return refs, hf_tiny.tensors(run_ranks(_body, 4, paths, ids, timeout=600)[0])


@pytest.mark.parametrize("tp,pp", LAYOUTS)
@pytest.mark.parametrize("arch", list(hf_tiny.ARCHS))
def test_logits_match_hf(parity, arch, tp, pp):
    refs, out = parity
    got = out[(arch, tp, pp)]
    assert got.shape == refs[arch].shape == (hf_tiny.BATCH, hf_tiny.SEQ, hf_tiny.VOCAB)
    diff = (got - refs[arch]).abs().max().item()
    assert diff <= TOL, f"{arch} tp={tp} pp={pp}: max |megatron - hf| = {diff:.2e}"


def test_virtual_pipeline_matches_hf(parity):
    refs, out = parity
    assert (out["llama_vpp"] - refs["llama"]).abs().max().item() <= TOL


def test_vocab_is_padded(parity):
    _, out = parity
    assert {out[("padded_vocab", a, tp, pp)] for a in hf_tiny.ARCHS for tp, pp in LAYOUTS} == {256}


@pytest.mark.parametrize("case", ["kv_swap", "gate_up_swap"])
def test_sabotaged_layout_is_caught(parity, case):
    refs, out = parity
    diff = (out[case] - refs["llama"]).abs().max().item()
    assert diff > 1e-2, f"{case}: a wrong layout gave logits within {diff:.2e} of HF; the parity test cannot fail"
