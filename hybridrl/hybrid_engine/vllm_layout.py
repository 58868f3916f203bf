"""vLLM's per-rank weight layout: which Hugging Face rows each rollout TP rank's tensors hold, by model family.

Pure metadata in the vocabulary of the weight bridge (:class:`~hybridrl.mcore.bridge_layout.TensorMap` of
:class:`~hybridrl.mcore.bridge_layout.Piece` rows, one tuple per rollout TP rank), so the planner can
intersect it with the Megatron layout. vLLM (``QKVParallelLinear``, ``MergedColumnParallelLinear``,
``VocabParallelEmbedding``), with rollout TP size ``tp`` and rank ``j``:

- ``qkv_proj`` ``[q_j | k_j | v_j]``: q is the contiguous block of ``heads / tp`` heads; k/v hold
  ``n_kv / tp`` heads, or, when ``tp >= n_kv``, the one head ``j // (tp / n_kv)`` (replicated KV heads);
  Qwen2's qkv bias alike;
- ``gate_up_proj`` ``[gate_j | up_j]``; ``o_proj`` / ``down_proj`` split on dim 1; norms replicated;
- ``embed_tokens`` / ``lm_head``: the vocab padded to a multiple of 64, then split over ``tp``; rows past
  the HF vocab are padding (left zero). At ``tp == 1`` the default is the UNPADDED HF shape
  ``[vocab, h]``: what ``model.load_weights`` takes on the weight-push path (vLLM pads it itself).

Names are vLLM's (``model.layers.{i}.self_attn.qkv_proj.weight``, ...); a tied model has no ``lm_head``.

Mixture-of-experts layers (Qwen3-MoE ``mlp``, Mixtral ``block_sparse_moe``; vLLM's ``FusedMoE``): the router
``{moe}.gate.weight`` ``[E, h]`` is replicated; the experts are two stacked tensors per layer,
``{moe}.experts.routed_experts.w13_weight`` ``[E_j, 2 f_j, h]`` (expert by expert ``[gate_j; up_j]``) and
``w2_weight`` ``[E_j, h, f_j]`` (down, split on its last dim). By default vLLM shards every expert over TP
(``E_j = E``, ``f_j = f / tp``, rank j's rows as in ``gate_up_proj`` / ``down_proj``); with
``enable_expert_parallel`` each rank holds whole experts ``[j E / tp, (j + 1) E / tp)`` (``f_j = f``). Each
expert's slice of a stacked tensor is its own map, named ``{tensor}@{local expert}`` (:func:`part_name`): the
planner plans it like any 2-D tensor, and the parts of one tensor lie back to back, so they are the stacked
tensor's memory.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from hybridrl.errors import InputError
from hybridrl.mcore.bridge_layout import Piece, TensorMap, split_pieces, vocab_pieces

if TYPE_CHECKING:
    from hybridrl.mcore.gpt import GPTShape

VLLM_VOCAB_PADDING = 64  # vllm.model_executor.layers.vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE

# HF model_type -> vLLM weight naming scheme. Every family here uses vLLM's Llama names (fused qkv_proj and
# gate_up_proj); a family with another scheme (e.g. fused "c_attn") needs its own entry and maps.
# Qwen3-MoE and Mixtral: the same names with FusedMoE experts (the MoE maps below).
FAMILIES: dict[str, str] = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama",
                            "qwen3_moe": "llama", "mixtral": "llama"}  # fmt: skip
PART = "@"
"""Separator of a stacked expert tensor's name and the local expert index of one of its parts."""


def part_name(name: str, expert: int) -> str:
    """The map of local expert ``expert``'s slice of the stacked vLLM tensor ``name``."""
    return f"{name}{PART}{expert}"


def split_part(name: str) -> tuple[str, int] | None:
    """(stacked tensor name, local expert) of a part name; None for a whole tensor."""
    base, sep, expert = name.rpartition(PART)
    return (base, int(expert)) if sep else None


class PlanError(InputError, ValueError):
    """A reshard that cannot be planned; the message names the key, the value and the fix."""


def check_family(family: str) -> str:
    """The naming scheme of ``family`` (HF ``model_type``), or a one-line :class:`PlanError`."""
    if family not in FAMILIES:
        raise PlanError(
            f"model family ({family!r}) has no vLLM layout entry; supported: {', '.join(sorted(FAMILIES))} "
            f"(add one to hybridrl.hybrid_engine.vllm_layout.FAMILIES)"
        )
    return FAMILIES[family]


def vllm_padded_vocab(vocab_size: int) -> int:
    """vLLM's padded vocab: a multiple of 64 (independent of TP, unlike Megatron's)."""
    return -(-vocab_size // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING


def check_rollout_tp(shape: GPTShape, tp: int, pad_vocab: bool) -> None:
    """Raise a one-line :class:`PlanError` unless vLLM can shard ``shape`` over ``tp`` ranks (that ``tp`` tiles
    the world is the layout's rule, :class:`~hybridrl.distributed.layout.ParallelLayout`)."""
    heads, kv = shape.num_attention_heads, shape.num_query_groups
    if heads % tp:
        raise PlanError(f"rollout.tp_size ({tp}) must divide num_attention_heads ({heads}); choose a divisor of it")
    if (tp >= kv and tp % kv) or (tp < kv and kv % tp):
        raise PlanError(
            f"rollout.tp_size ({tp}) and num_key_value_heads ({kv}): one must divide the other "
            f"(vLLM replicates KV heads only when tp_size is a multiple of them)"
        )
    if shape.moe is not None:
        _check_rollout_experts(shape, tp)
    elif shape.ffn_hidden_size % tp:
        raise PlanError(f"rollout.tp_size ({tp}) must divide ffn_hidden_size ({shape.ffn_hidden_size})")
    if vllm_padded_vocab(shape.vocab_size) % tp:
        raise PlanError(
            f"rollout.tp_size ({tp}) must divide vLLM's padded vocab ({vllm_padded_vocab(shape.vocab_size)})"
        )
    if tp > 1 and not pad_vocab:
        raise PlanError(f"pad_vocab (False) needs rollout.tp_size 1 (got {tp}); vLLM shards the padded vocab")


def _check_rollout_experts(shape: GPTShape, tp: int) -> None:
    experts, width = shape.moe.num_experts, shape.moe.ffn_hidden_size
    if tp > experts:  # vLLM's Qwen3-MoE / Mixtral refuse it
        raise PlanError(f"rollout.tp_size ({tp}) must not exceed the number of experts ({experts})")
    if width % tp or experts % tp:
        raise PlanError(
            f"rollout.tp_size ({tp}) must divide the expert width ({width}) and the number of experts ({experts})"
        )


def _expert_maps(p: str, shape: GPTShape, tp: int, expert_parallel: bool) -> list[TensorMap]:
    """Router and stacked-expert part maps of the MoE block of layer prefix ``p`` (see the module docstring)."""
    moe = shape.moe
    block = f"{p}{moe.hf_prefix}."
    gate, up, down = moe.hf_expert_names
    f, n = moe.ffn_hidden_size, moe.num_experts
    maps = [_replicated(f"{block}gate.weight", n)]
    w13, w2 = f"{block}experts.routed_experts.w13_weight", f"{block}experts.routed_experts.w2_weight"
    local = n // tp if expert_parallel else n
    stacked: tuple[list[TensorMap], list[TensorMap]] = ([], [])  # each stacked tensor's parts back to back
    for e in range(local):
        # expert parallel: rank r holds experts r * local + e whole; else every expert, rows/columns r of tp
        owners = [(r * local + e, 0, f) if expert_parallel else (e, r * f // tp, (r + 1) * f // tp) for r in range(tp)]
        ex = [f"{block}experts.{g}." for g, _, _ in owners]
        fused = tuple(
            (Piece(f"{x}{gate}.weight", a, b), Piece(f"{x}{up}.weight", a, b))
            for x, (_, a, b) in zip(ex, owners, strict=True)
        )
        cols = tuple((Piece(f"{x}{down}.weight", a, b),) for x, (_, a, b) in zip(ex, owners, strict=True))
        stacked[0].append(TensorMap(part_name(w13, e), 0, fused, expert=True))
        stacked[1].append(TensorMap(part_name(w2, e), 1, cols, expert=True))
    return maps + stacked[0] + stacked[1]


def _qkv_pieces(prefix: str, shape: GPTShape, tp: int, rank: int, suffix: str) -> tuple[Piece, ...]:
    hd, kv = shape.kv_channels, shape.num_query_groups
    q_heads = shape.num_attention_heads // tp
    if tp >= kv:
        kv_heads, kv_first = 1, rank // (tp // kv)
    else:
        kv_heads, kv_first = kv // tp, rank * (kv // tp)
    q, k, v = (f"{prefix}{x}_proj.{suffix}" for x in "qkv")
    kv_rows = (kv_first * hd, (kv_first + kv_heads) * hd)
    return (Piece(q, rank * q_heads * hd, (rank + 1) * q_heads * hd), Piece(k, *kv_rows), Piece(v, *kv_rows))


def _vocab(name: str, shape: GPTShape, tp: int, pad_vocab: bool) -> TensorMap:
    if not pad_vocab:
        return TensorMap(name, 0, ((Piece(name, 0, shape.vocab_size),),))
    padded = dataclasses.replace(shape, padded_vocab_size=vllm_padded_vocab(shape.vocab_size))
    return TensorMap(name, 0, tuple(vocab_pieces(name, padded, tp, r) for r in range(tp)))


def _replicated(name: str, rows: int) -> TensorMap:
    return TensorMap(name, 0, ((Piece(name, 0, rows),),))


def rollout_maps(
    shape: GPTShape, tp: int, family: str = "llama", pad_vocab: bool | None = None, expert_parallel: bool = False
) -> list[TensorMap]:
    """Every vLLM tensor of ``shape`` at rollout TP size ``tp``, as HF pieces per rollout rank, in model order.

    Each map's ``megatron`` field holds the vLLM name (the class is shared with the bridge). ``pad_vocab``:
    None = pad at ``tp > 1`` only (see the module docstring). ``expert_parallel``: vLLM's
    ``enable_expert_parallel`` (whole experts per rank) instead of TP-sharded experts.
    """
    check_family(family)
    pad_vocab = tp > 1 if pad_vocab is None else pad_vocab
    h, hd = shape.hidden_size, shape.kv_channels
    ranks = range(tp)
    maps = [_vocab("model.embed_tokens.weight", shape, tp, pad_vocab)]
    for layer in range(shape.num_layers):
        p = f"model.layers.{layer}."
        attn = p + "self_attn."
        maps.append(_replicated(p + "input_layernorm.weight", h))
        for suffix in ("weight", "bias") if shape.qkv_bias else ("weight",):
            maps.append(
                TensorMap(f"{attn}qkv_proj.{suffix}", 0, tuple(_qkv_pieces(attn, shape, tp, r, suffix) for r in ranks))
            )
        if shape.qk_norm:
            maps += [_replicated(f"{attn}q_norm.weight", hd), _replicated(f"{attn}k_norm.weight", hd)]
        q_cols = shape.num_attention_heads * hd
        maps.append(
            TensorMap(
                attn + "o_proj.weight", 1, tuple(split_pieces(attn + "o_proj.weight", q_cols, tp, r) for r in ranks)
            )
        )
        maps.append(_replicated(p + "post_attention_layernorm.weight", h))
        if shape.moe is not None:
            maps += _expert_maps(p, shape, tp, expert_parallel)
            continue
        f = shape.ffn_hidden_size
        gate_up = tuple(
            tuple(Piece(f"{p}mlp.{x}_proj.weight", r * f // tp, (r + 1) * f // tp) for x in ("gate", "up"))
            for r in ranks
        )
        maps.append(TensorMap(p + "mlp.gate_up_proj.weight", 0, gate_up))
        down = p + "mlp.down_proj.weight"
        maps.append(TensorMap(down, 1, tuple(split_pieces(down, f, tp, r) for r in ranks)))
    maps.append(_replicated("model.norm.weight", h))
    if not shape.tie_embeddings:
        maps.append(_vocab("lm_head.weight", shape, tp, pad_vocab))
    return maps
