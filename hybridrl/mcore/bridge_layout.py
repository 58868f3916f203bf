"""Which rows of which Hugging Face tensors make up each Megatron tensor shard: the bridge's layout math.

Pure metadata (no I/O, no process groups): the same :class:`TensorMap` list drives the import (each rank
reads the pieces of its own shards), the export (the writer puts every gathered shard's pieces back) and
the checkpoint validation (the HF names and shapes a config implies). Layouts, verified numerically
against HF transformers (tests/mcore/test_hf_parity.py), with h hidden, ng query groups (HF ``num_key_value_heads``),
qpg = heads / ng, hd head dim, f MLP width:

- ``linear_qkv`` ``[ng * (qpg + 2) * hd, h]``: rows grouped per query group ``[qpg q heads, k_g, v_g]``;
  TP rank r holds groups ``[r * ng / tp, (r + 1) * ng / tp)`` (:func:`qkv_pieces`; Qwen2's biases alike);
- ``linear_fc1`` (SwiGLU): TP rank r holds ``[gate_r; up_r]`` (:func:`gate_up_pieces`);
- ``linear_proj`` (o_proj) and ``linear_fc2`` (down_proj): split on dim 1; norms replicated;
- embedding / output layer: split on the padded vocab; rows past the HF vocab are zero padding.

Megatron names use 0-based GLOBAL layer numbers (``decoder.layers.{layer}.``), whatever the pipeline stage.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridrl.mcore.gpt import GPTShape

HEADS = ("lm", "score")  # LM head; scalar score head (critic / reward model)


@dataclass(frozen=True)
class Piece:
    """Rows ``[start, stop)`` (along the map's ``dim``) of HF tensor ``hf``; ``hf=None`` is zero padding."""

    hf: str | None
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class TensorMap:
    """One Megatron tensor as concatenations of HF pieces along ``dim``, one tuple per TP rank.

    A single tuple means the tensor is replicated over TP. ``export=False`` marks a copy the export skips
    (the output layer of a tied model, which duplicates the embedding).
    """

    megatron: str
    dim: int
    shards: tuple[tuple[Piece, ...], ...]
    export: bool = True
    expert: bool = False
    """An expert weight: its shards are per EXPERT tensor-parallel rank (``bridge_moe``)."""

    @property
    def replicated(self) -> bool:
        return len(self.shards) == 1

    def pieces(self, tp_rank: int) -> tuple[Piece, ...]:
        """The pieces TP rank ``tp_rank`` holds, in order."""
        return self.shards[0 if self.replicated else tp_rank]

    @property
    def hf_names(self) -> tuple[str, ...]:
        """HF tensors this map reads, in first-use order."""
        names: dict[str, None] = {}
        for shard in self.shards:
            names.update((p.hf, None) for p in shard if p.hf is not None)
        return tuple(names)


def _span(n: int, tp: int, rank: int) -> tuple[int, int]:
    size = n // tp
    return rank * size, (rank + 1) * size


def split_pieces(name: str, n: int, tp: int, rank: int) -> tuple[Piece, ...]:
    """A contiguous 1/tp of ``n`` rows (column- or row-parallel linear)."""
    return (Piece(name, *_span(n, tp, rank)),)


def qkv_pieces(prefix: str, shape: GPTShape, tp: int, rank: int, suffix: str = "weight") -> tuple[Piece, ...]:
    """Rows of ``{prefix}{q,k,v}_proj.{suffix}`` in TP rank ``rank``'s ``linear_qkv`` shard.

    Per query group g of this rank: its qpg query heads, then k_g, then v_g.
    """
    hd, ng = shape.kv_channels, shape.num_query_groups
    qpg = shape.num_attention_heads // ng
    q, k, v = (f"{prefix}{x}_proj.{suffix}" for x in "qkv")
    pieces = []
    for g in range(*_span(ng, tp, rank)):
        pieces += [
            Piece(q, g * qpg * hd, (g + 1) * qpg * hd),
            Piece(k, g * hd, (g + 1) * hd),
            Piece(v, g * hd, (g + 1) * hd),
        ]
    return tuple(pieces)


def gate_up_pieces(prefix: str, shape: GPTShape, tp: int, rank: int) -> tuple[Piece, ...]:
    """Rows of ``{prefix}{gate,up}_proj.weight`` in TP rank ``rank``'s ``linear_fc1`` shard: ``[gate_r; up_r]``."""
    span = _span(shape.ffn_hidden_size, tp, rank)
    return (Piece(f"{prefix}gate_proj.weight", *span), Piece(f"{prefix}up_proj.weight", *span))


def vocab_pieces(name: str, shape: GPTShape, tp: int, rank: int) -> tuple[Piece, ...]:
    """TP rank ``rank``'s rows of the padded vocab: HF rows below ``vocab_size``, zero padding above."""
    start, stop = _span(shape.padded_vocab, tp, rank)
    real = (max(start, 0), min(stop, shape.vocab_size))
    pieces = [Piece(name, *real)] if real[1] > real[0] else []
    pad = stop - max(start, shape.vocab_size)
    if pad > 0:
        pieces.append(Piece(None, 0, pad))
    return tuple(pieces)


def _per_rank(tp: int, fn, *args) -> tuple[tuple[Piece, ...], ...]:
    return tuple(fn(*args, tp, r) for r in range(tp))


def layer_maps(shape: GPTShape, tp: int, layer: int, fused_norms: bool = False) -> list[TensorMap]:
    """The maps of decoder layer ``layer`` (0-based, global).

    ``fused_norms``: TransformerEngine's spec, whose pre-attention / pre-MLP norm weights live in
    ``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight`` instead of the local spec's
    ``input_layernorm.weight`` / ``pre_mlp_layernorm.weight``.
    """
    hf, mg = f"model.layers.{layer}.", f"decoder.layers.{layer}."
    attn = f"{hf}self_attn."
    h, hd = shape.hidden_size, shape.kv_channels
    in_norm = "self_attention.linear_qkv.layer_norm_weight" if fused_norms else "input_layernorm.weight"
    mlp_norm = "mlp.linear_fc1.layer_norm_weight" if fused_norms else "pre_mlp_layernorm.weight"
    maps = [
        TensorMap(mg + in_norm, 0, ((Piece(f"{hf}input_layernorm.weight", 0, h),),)),
        TensorMap(
            mg + "self_attention.linear_qkv.weight",
            0,
            tuple(qkv_pieces(attn, shape, tp, r) for r in range(tp)),
        ),
    ]
    if shape.qkv_bias:
        maps.append(
            TensorMap(
                mg + "self_attention.linear_qkv.bias",
                0,
                tuple(qkv_pieces(attn, shape, tp, r, "bias") for r in range(tp)),
            )
        )
    if shape.qk_norm:
        for x in "qk":
            maps.append(
                TensorMap(f"{mg}self_attention.{x}_layernorm.weight", 0, ((Piece(f"{attn}{x}_norm.weight", 0, hd),),))
            )
    maps.append(
        TensorMap(
            mg + "self_attention.linear_proj.weight",
            1,
            _per_rank(tp, split_pieces, f"{attn}o_proj.weight", shape.num_attention_heads * hd),
        )
    )
    if shape.moe is not None:  # the MoE block keeps its own pre-MLP norm in both specs
        from hybridrl.mcore import bridge_moe

        norm = Piece(f"{hf}post_attention_layernorm.weight", 0, h)
        maps.append(TensorMap(mg + "pre_mlp_layernorm.weight", 0, ((norm,),)))
        return maps + bridge_moe.moe_maps(shape, tp, layer, grouped=fused_norms)
    maps += [
        TensorMap(mg + mlp_norm, 0, ((Piece(f"{hf}post_attention_layernorm.weight", 0, h),),)),
        TensorMap(mg + "mlp.linear_fc1.weight", 0, tuple(gate_up_pieces(f"{hf}mlp.", shape, tp, r) for r in range(tp))),
        TensorMap(
            mg + "mlp.linear_fc2.weight",
            1,
            _per_rank(tp, split_pieces, f"{hf}mlp.down_proj.weight", shape.ffn_hidden_size),
        ),
    ]
    return maps


def tensor_maps(shape: GPTShape, tp: int, head: str = "lm", fused_norms: bool = False) -> list[TensorMap]:
    """Every map of the model, in HF order: embedding, layers, final norm, head.

    Args:
        head: ``"lm"`` (output layer from ``lm_head.weight``, or from the embedding when tied) or ``"score"``
            (a replicated ``[1, h]`` value/reward head from ``score.weight``).
    """
    if head not in HEADS:
        raise ValueError(f"head ({head!r}) must be one of {HEADS}")
    maps = [
        TensorMap(
            "embedding.word_embeddings.weight", 0, _per_rank(tp, vocab_pieces, "model.embed_tokens.weight", shape)
        )
    ]
    for layer in range(shape.num_layers):
        maps += layer_maps(shape, tp, layer, fused_norms)
    maps.append(TensorMap("decoder.final_layernorm.weight", 0, ((Piece("model.norm.weight", 0, shape.hidden_size),),)))
    if head == "lm":
        source = "model.embed_tokens.weight" if shape.tie_embeddings else "lm_head.weight"
        maps.append(
            TensorMap(
                "output_layer.weight", 0, _per_rank(tp, vocab_pieces, source, shape), export=not shape.tie_embeddings
            )
        )
    elif head == "score":
        maps.append(TensorMap("output_layer.weight", 0, ((Piece("score.weight", 0, 1),),)))
    return maps


def hf_shapes(shape: GPTShape, head: str = "lm") -> dict[str, tuple[int, ...]]:
    """Every HF tensor name a checkpoint of ``shape`` holds, with its full shape, in HF order."""
    h, hd, f, v = shape.hidden_size, shape.kv_channels, shape.ffn_hidden_size, shape.vocab_size
    q, kv = shape.num_attention_heads * hd, shape.num_query_groups * hd
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for layer in range(shape.num_layers):
        p = f"model.layers.{layer}."
        out[p + "input_layernorm.weight"] = (h,)
        for x, rows in (("q", q), ("k", kv), ("v", kv)):
            out[f"{p}self_attn.{x}_proj.weight"] = (rows, h)
            if shape.qkv_bias:
                out[f"{p}self_attn.{x}_proj.bias"] = (rows,)
        if shape.qk_norm:
            out[p + "self_attn.q_norm.weight"] = (hd,)
            out[p + "self_attn.k_norm.weight"] = (hd,)
        out[p + "self_attn.o_proj.weight"] = (h, q)
        out[p + "post_attention_layernorm.weight"] = (h,)
        if shape.moe is not None:
            from hybridrl.mcore import bridge_moe

            out.update(bridge_moe.hf_moe_shapes(shape, layer))
            continue
        out[p + "mlp.gate_proj.weight"] = (f, h)
        out[p + "mlp.up_proj.weight"] = (f, h)
        out[p + "mlp.down_proj.weight"] = (h, f)
    out["model.norm.weight"] = (h,)
    if head == "lm" and not shape.tie_embeddings:
        out["lm_head.weight"] = (v, h)
    elif head == "score":
        out["score.weight"] = (1, h)
    return out
