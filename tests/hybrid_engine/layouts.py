"""Test-side layouts, written from docs/cpu_stack.md and independent of the planner: HF -> Megatron shards -> vLLM.

Two independent spellings of each layout: tensor slicing (:func:`megatron_shards`, :func:`vllm_tensors`,
for element-by-element simulation of small models) and index arithmetic over flat offsets
(:func:`megatron_ids`, :func:`vllm_ids`, for symbolic checks of plans far too big to materialise).
Padding rows are ``MEGATRON_PAD`` in Megatron shards and ``VLLM_PAD`` (the destination's initial value) in
vLLM tensors, so a block that copies padding into real rows shows up.
"""

from __future__ import annotations

import re

import torch

MEGATRON_PAD, VLLM_PAD = -3, -1


def pad64(n: int) -> int:
    return -(-n // 64) * 64


def hf_names(shape) -> dict[str, tuple[int, ...]]:
    """HF Llama/Qwen tensor names and shapes (the LM-head model)."""
    h, hd, f, v = shape.hidden_size, shape.kv_channels, shape.ffn_hidden_size, shape.vocab_size
    q, kv = shape.num_attention_heads * hd, shape.num_query_groups * hd
    out = {"model.embed_tokens.weight": (v, h)}
    for i in range(shape.num_layers):
        a = f"model.layers.{i}.self_attn."
        out[f"model.layers.{i}.input_layernorm.weight"] = (h,)
        for x, rows in (("q", q), ("k", kv), ("v", kv)):
            out[f"{a}{x}_proj.weight"] = (rows, h)
            if shape.qkv_bias:
                out[f"{a}{x}_proj.bias"] = (rows,)
        if shape.qk_norm:
            out[a + "q_norm.weight"] = out[a + "k_norm.weight"] = (hd,)
        out[a + "o_proj.weight"] = (h, q)
        out[f"model.layers.{i}.post_attention_layernorm.weight"] = (h,)
        for x in ("gate", "up"):
            out[f"model.layers.{i}.mlp.{x}_proj.weight"] = (f, h)
        out[f"model.layers.{i}.mlp.down_proj.weight"] = (h, f)
    out["model.norm.weight"] = (h,)
    if not shape.tie_embeddings:
        out["lm_head.weight"] = (v, h)
    return out


def hf_tensors(shape) -> dict[str, torch.Tensor]:
    """Every HF tensor filled with globally unique ids (an int64 arange over the whole model)."""
    out, start = {}, 0
    for name, shp in hf_names(shape).items():
        n = torch.Size(shp).numel()
        out[name] = torch.arange(start, start + n, dtype=torch.int64).view(shp)
        start += n
    return out


def _pad_rows(t: torch.Tensor, rows: int, value: int) -> torch.Tensor:
    return torch.cat([t, torch.full((rows - t.shape[0], *t.shape[1:]), value, dtype=t.dtype)])


def megatron_shards(hf: dict, shape, tp: int, fused_norms: bool = False) -> dict[str, list[torch.Tensor]]:
    """Megatron name -> per-TP-rank shard (replicated tensors: one entry), per docs/cpu_stack.md."""
    ng, hd = shape.num_query_groups, shape.kv_channels
    qpg = shape.num_attention_heads // ng
    out = {
        "embedding.word_embeddings.weight": _pad_rows(
            hf["model.embed_tokens.weight"], shape.padded_vocab, MEGATRON_PAD
        ).chunk(tp)
    }
    for i in range(shape.num_layers):
        a, m = f"model.layers.{i}.self_attn.", f"decoder.layers.{i}."
        out[m + ("self_attention.linear_qkv.layer_norm_weight" if fused_norms else "input_layernorm.weight")] = [
            hf[f"model.layers.{i}.input_layernorm.weight"]
        ]
        for suffix in ("weight", "bias") if shape.qkv_bias else ("weight",):
            q, k, v = (hf[f"{a}{x}_proj.{suffix}"] for x in "qkv")
            tail = q.shape[1:]
            grouped = torch.cat([q.reshape(ng, qpg * hd, *tail), k.reshape(ng, hd, *tail), v.reshape(ng, hd, *tail)], 1)
            out[f"{m}self_attention.linear_qkv.{suffix}"] = [g.reshape(-1, *tail) for g in grouped.chunk(tp)]
        if shape.qk_norm:
            out[m + "self_attention.q_layernorm.weight"] = [hf[a + "q_norm.weight"]]
            out[m + "self_attention.k_layernorm.weight"] = [hf[a + "k_norm.weight"]]
        out[m + "self_attention.linear_proj.weight"] = [c.contiguous() for c in hf[a + "o_proj.weight"].chunk(tp, 1)]
        out[m + ("mlp.linear_fc1.layer_norm_weight" if fused_norms else "pre_mlp_layernorm.weight")] = [
            hf[f"model.layers.{i}.post_attention_layernorm.weight"]
        ]
        gate, up = (hf[f"model.layers.{i}.mlp.{x}_proj.weight"].chunk(tp) for x in ("gate", "up"))
        out[m + "mlp.linear_fc1.weight"] = [torch.cat([g, u]) for g, u in zip(gate, up, strict=True)]
        down = hf[f"model.layers.{i}.mlp.down_proj.weight"]
        out[m + "mlp.linear_fc2.weight"] = [c.contiguous() for c in down.chunk(tp, 1)]
    out["decoder.final_layernorm.weight"] = [hf["model.norm.weight"]]
    if not shape.tie_embeddings:
        out["output_layer.weight"] = _pad_rows(hf["lm_head.weight"], shape.padded_vocab, MEGATRON_PAD).chunk(tp)
    return {k: list(v) for k, v in out.items()}


def vllm_tensors(hf: dict, shape, tp: int, j: int, pad_vocab: bool, pad_value=VLLM_PAD) -> dict[str, torch.Tensor]:
    """vLLM rollout rank ``j``'s tensors (fused qkv / gate_up; padded vocab split when ``pad_vocab``)."""
    hd, kv = shape.kv_channels, shape.num_query_groups
    qh = shape.num_attention_heads // tp
    kv_first, kv_n = (j // (tp // kv), 1) if tp >= kv else (j * (kv // tp), kv // tp)

    def vocab(t):
        return _pad_rows(t, pad64(shape.vocab_size), pad_value).chunk(tp)[j] if pad_vocab else t

    out = {"model.embed_tokens.weight": vocab(hf["model.embed_tokens.weight"])}
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        out[p + "input_layernorm.weight"] = hf[p + "input_layernorm.weight"]
        for suffix in ("weight", "bias") if shape.qkv_bias else ("weight",):
            q, k, v = (hf[f"{a}{x}_proj.{suffix}"] for x in "qkv")
            kvs = slice(kv_first * hd, (kv_first + kv_n) * hd)
            out[f"{a}qkv_proj.{suffix}"] = torch.cat([q[j * qh * hd : (j + 1) * qh * hd], k[kvs], v[kvs]])
        if shape.qk_norm:
            out[a + "q_norm.weight"], out[a + "k_norm.weight"] = hf[a + "q_norm.weight"], hf[a + "k_norm.weight"]
        out[a + "o_proj.weight"] = hf[a + "o_proj.weight"].chunk(tp, 1)[j]
        out[p + "post_attention_layernorm.weight"] = hf[p + "post_attention_layernorm.weight"]
        out[p + "mlp.gate_up_proj.weight"] = torch.cat(
            [hf[f"{p}mlp.{x}_proj.weight"].chunk(tp)[j] for x in ("gate", "up")]
        )
        out[p + "mlp.down_proj.weight"] = hf[p + "mlp.down_proj.weight"].chunk(tp, 1)[j]
    out["model.norm.weight"] = hf["model.norm.weight"]
    if not shape.tie_embeddings:
        out["lm_head.weight"] = vocab(hf["lm_head.weight"])
    return out


# ---- index arithmetic: flat offset in a shard -> (HF id, contiguity run) ---------------------------------
def hf_ids(shape) -> tuple[dict[str, int], dict[str, int]]:
    """Start id of each HF tensor in the global numbering of :func:`hf_tensors`, and each tensor's numel."""
    starts, sizes, start = {}, {}, 0
    for name, shp in hf_names(shape).items():
        starts[name], sizes[name] = start, torch.Size(shp).numel()
        start += sizes[name]
    return starts, sizes


def _rows(e: torch.Tensor, row: int) -> tuple[torch.Tensor, torch.Tensor]:
    return e // row, e % row


def megatron_ids(name: str, r: torch.Tensor, e: torch.Tensor, shape, tp: int, starts: dict) -> tuple:
    """HF ids (-1 = padding) and contiguity runs of elements ``e`` of Megatron shard ``name`` on TP ranks ``r``."""
    h, hd, f = shape.hidden_size, shape.kv_channels, shape.ffn_hidden_size
    layer = re.match(r"decoder\.layers\.(\d+)\.", name)
    p = f"model.layers.{layer.group(1)}." if layer else ""
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        hf = "model.embed_tokens.weight" if name.startswith("embedding") else "lm_head.weight"
        row, col = _rows(e, h)
        row = r * (shape.padded_vocab // tp) + row
        real = row < shape.vocab_size
        return torch.where(real, starts[hf] + row * h + col, -1), real.long()
    if "linear_qkv.weight" in name or "linear_qkv.bias" in name:
        suffix = "weight" if name.endswith("weight") else "bias"
        cols = h if suffix == "weight" else 1
        ng = shape.num_query_groups
        qpg = shape.num_attention_heads // ng
        row, col = _rows(e, cols)
        g = r * (ng // tp) + row // ((qpg + 2) * hd)
        w = row % ((qpg + 2) * hd)
        which = torch.where(w < qpg * hd, 0, torch.where(w < (qpg + 1) * hd, 1, 2))
        hf_row = torch.where(which == 0, g * qpg * hd + w, g * hd + w - qpg * hd - (which == 2).long() * hd)
        base = torch.tensor([starts[f"{p}self_attn.{x}_proj.{suffix}"] for x in "qkv"])[which]
        return base + hf_row * cols + col, g * 3 + which
    if "linear_fc1.weight" in name:
        row, col = _rows(e, h)
        up = (row >= f // tp).long()
        base = torch.tensor([starts[p + "mlp.gate_proj.weight"], starts[p + "mlp.up_proj.weight"]])[up]
        return base + (r * (f // tp) + row - up * (f // tp)) * h + col, up
    if "linear_proj.weight" in name or "linear_fc2.weight" in name:
        hf, full = (p + "self_attn.o_proj.weight", shape.num_attention_heads * hd)
        if "fc2" in name:
            hf, full = p + "mlp.down_proj.weight", f
        row, col = _rows(e, full // tp)
        return starts[hf] + row * full + r * (full // tp) + col, row
    hf = {
        "input_layernorm.weight": "input_layernorm.weight",
        "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
        "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
        "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
        "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
        "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    }
    if name == "decoder.final_layernorm.weight":
        return starts["model.norm.weight"] + e, torch.zeros_like(e)
    return starts[p + hf[name.split(".", 3)[3]]] + e, torch.zeros_like(e)


def vllm_ids(name: str, j: int, e: torch.Tensor, shape, tp: int, pad_vocab: bool, starts: dict) -> tuple:
    """HF ids (-1 = padding) and contiguity runs of elements ``e`` of rollout rank ``j``'s vLLM tensor ``name``."""
    h, hd, f = shape.hidden_size, shape.kv_channels, shape.ffn_hidden_size
    layer = re.match(r"model\.layers\.(\d+)\.", name)
    p = f"model.layers.{layer.group(1)}." if layer else ""
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        row, col = _rows(e, h)
        row = row + (j * pad64(shape.vocab_size) // tp if pad_vocab else 0)
        real = row < shape.vocab_size
        return torch.where(real, starts[name] + row * h + col, -1), real.long()
    if ".qkv_proj." in name:
        suffix = name.rsplit(".", 1)[1]
        cols = h if suffix == "weight" else 1
        kv, qh = shape.num_query_groups, shape.num_attention_heads // tp
        kv_first, kv_n = (j // (tp // kv), 1) if tp >= kv else (j * (kv // tp), kv // tp)
        row, col = _rows(e, cols)
        which = torch.where(row < qh * hd, 0, torch.where(row < (qh + kv_n) * hd, 1, 2))
        q_row, kv_row = j * qh * hd + row, kv_first * hd + row - qh * hd - (which == 2).long() * kv_n * hd
        base = torch.tensor([starts[f"{p}self_attn.{x}_proj.{suffix}"] for x in "qkv"])[which]
        return base + torch.where(which == 0, q_row, kv_row) * cols + col, which
    if "gate_up_proj" in name:
        row, col = _rows(e, h)
        up = (row >= f // tp).long()
        base = torch.tensor([starts[p + "mlp.gate_proj.weight"], starts[p + "mlp.up_proj.weight"]])[up]
        return base + (j * (f // tp) + row - up * (f // tp)) * h + col, up
    if "o_proj" in name or "down_proj" in name:
        full = shape.num_attention_heads * hd if "o_proj" in name else f
        row, col = _rows(e, full // tp)
        return starts[name] + row * full + j * (full // tp) + col, row
    return starts[name] + e, torch.zeros_like(e)
