"""The bridge's MoE part: HF per-expert weights and router <-> Megatron's experts and router, any EP x ETP split.

Pure layout math plus the expert numbering, used by ``bridge_layout`` (maps), ``bridge`` (load / export) and
every reader of :func:`hybridrl.mcore.bridge.global_parameters`. For MoE layer l (HF prefix ``mlp`` for
Qwen3-MoE, ``block_sparse_moe`` for Mixtral; gate/up/down named ``gate_proj/up_proj/down_proj`` or
``w1/w3/w2``):

- ``decoder.layers.{l}.mlp.router.weight`` ``[E, h]`` = ``{prefix}.gate.weight`` (replicated);
- expert e's ``linear_fc1.weight`` = ``[gate_r; up_r]`` of expert e on expert-tensor-parallel rank r (as the
  dense SwiGLU MLP), ``linear_fc2.weight`` = its down projection split on dim 1.

Megatron names an expert by its LOCAL index on its expert-parallel rank (``SequentialMLP``:
``mlp.experts.local_experts.{j}.``; TransformerEngine's ``TEGroupedMLP``: ``mlp.experts.linear_fc1.weight{j}``);
:func:`global_expert_name` renames it to the global expert ``e = ep_rank * E / ep + j``, so a map names one
expert whatever the EP size, like layer numbers are global whatever the PP stage. Megatron's expert tensor
parallel size is the TP size (hybridrl does not set another).
"""

from __future__ import annotations

import re

from hybridrl.mcore.gpt import GPTShape

_SEQUENTIAL = re.compile(r"(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)")
_GROUPED = re.compile(r"(.*\.mlp\.experts\.linear_fc[12]\.weight)(\d+)$")


def is_expert_name(name: str) -> bool:
    """A Megatron expert weight (either layout)."""
    return bool(_SEQUENTIAL.match(name) or _GROUPED.match(name))


def global_expert_name(name: str, ep_rank: int, local_experts: int) -> str:
    """``name`` with its local expert index replaced by the global one (other names unchanged)."""
    m = _SEQUENTIAL.match(name)
    if m:
        return f"{m.group(1)}{ep_rank * local_experts + int(m.group(2))}{m.group(3)}"
    m = _GROUPED.match(name)
    if m:
        return f"{m.group(1)}{ep_rank * local_experts + int(m.group(2))}"
    return name


def _expert_names(layer: int, expert: int, grouped: bool) -> tuple[str, str]:
    mg = f"decoder.layers.{layer}.mlp.experts."
    if grouped:
        return f"{mg}linear_fc1.weight{expert}", f"{mg}linear_fc2.weight{expert}"
    return f"{mg}local_experts.{expert}.linear_fc1.weight", f"{mg}local_experts.{expert}.linear_fc2.weight"


def moe_maps(shape: GPTShape, etp: int, layer: int, grouped: bool = False) -> list:
    """The router and expert maps of MoE layer ``layer`` (0-based, global) at expert tensor parallel ``etp``.

    ``grouped``: TransformerEngine's grouped-GEMM expert names instead of ``SequentialMLP``'s.
    """
    from hybridrl.mcore.bridge_layout import Piece, TensorMap, split_pieces

    moe = shape.moe
    hf = f"model.layers.{layer}.{moe.hf_prefix}."
    gate, up, down = moe.hf_expert_names
    f = moe.ffn_hidden_size
    maps = [
        TensorMap(f"decoder.layers.{layer}.mlp.router.weight", 0, ((Piece(f"{hf}gate.weight", 0, moe.num_experts),),))
    ]
    step = f // etp
    for e in range(moe.num_experts):
        fc1, fc2 = _expert_names(layer, e, grouped)
        ex = f"{hf}experts.{e}."
        fc1_shards = tuple(
            (Piece(f"{ex}{gate}.weight", r * step, (r + 1) * step), Piece(f"{ex}{up}.weight", r * step, (r + 1) * step))
            for r in range(etp)
        )
        fc2_shards = tuple(split_pieces(f"{ex}{down}.weight", f, etp, r) for r in range(etp))
        maps.append(TensorMap(fc1, 0, fc1_shards, expert=True))
        maps.append(TensorMap(fc2, 1, fc2_shards, expert=True))
    return maps


def hf_moe_shapes(shape: GPTShape, layer: int) -> dict[str, tuple[int, ...]]:
    """The HF tensors of MoE layer ``layer`` with their full shapes, in HF order."""
    moe, h = shape.moe, shape.hidden_size
    hf = f"model.layers.{layer}.{moe.hf_prefix}."
    gate, up, down = moe.hf_expert_names
    out: dict[str, tuple[int, ...]] = {f"{hf}gate.weight": (moe.num_experts, h)}
    for e in range(moe.num_experts):
        out[f"{hf}experts.{e}.{gate}.weight"] = (moe.ffn_hidden_size, h)
        out[f"{hf}experts.{e}.{up}.weight"] = (moe.ffn_hidden_size, h)
        out[f"{hf}experts.{e}.{down}.weight"] = (h, moe.ffn_hidden_size)
    return out


def expert_index(name: str) -> int | None:
    """The expert index in an expert weight's name (global in global names); None for other names."""
    m = _SEQUENTIAL.match(name) or _GROUPED.match(name)
    return int(m.group(2)) if m else None
