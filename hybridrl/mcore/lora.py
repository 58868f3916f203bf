"""LoRA adapters on Megatron-Core's tensor-parallel linears: the actor's low-rank fine-tuning (Hu et al. 2021).

A LoRA layer keeps the frozen weight ``W`` and learns ``delta W = (alpha / r) * B @ A`` with ``A (r, in)`` and
``B (out, r)``: ``y = x W^T + (alpha / r) * dropout(x) A^T B^T``. ``B`` starts at zero (the adapted model starts
as the base model) and ``A`` as PEFT's (Kaiming-uniform, bound ``1 / sqrt(in)``), drawn from a seed per layer and
module over the FULL shape and then sliced, so every layout starts from the same adapter.

Under tensor parallelism the factor on the split side follows the weight and the other one is replicated:

- column-parallel ``linear_qkv`` / ``linear_fc1`` (``W`` split by output rows, input ``x`` replicated):
  ``A (r, in)`` replicated, ``B_t (out / tp, r)`` holds this rank's rows, in the weight's own row layout (qkv's
  per-group interleave, fc1's ``[gate_t; up_t]``). ``h = x A^T`` goes through Megatron's
  ``copy_to_tensor_model_parallel_region`` (identity forward, all-reduce backward), so every rank's ``dA`` is the
  full sum over the output rows and the replicas stay equal;
- row-parallel ``linear_proj`` / ``linear_fc2`` (``W`` split by input columns, ``x_t`` this rank's slice):
  ``A_t (r, in / tp)`` holds this rank's columns, ``B (out, r)`` replicated; ``h = sum_t x_t A_t^T`` is reduced
  over TP (``reduce_from_tensor_model_parallel_region``) as the base output is, then ``h B^T`` is added.

The factors carry Megatron's tensor-parallel attributes to match (split ones counted on every rank by the grad
norm, replicated ones once), and a ``sharded_state_dict`` that saves them at their global offsets. Pipeline
parallelism needs nothing: each stage adapts its own layers. Targets are named as users know them (PEFT / HF:
``q_proj`` ... ``down_proj``) or as Megatron does (``linear_qkv`` ...): a fused layer adapted for only some of its
HF projections (``q_proj`` without ``k_proj``) masks the other rows of ``B`` to zero, so the adapter is exactly
the PEFT one. Only the factors train (:func:`apply_lora` freezes everything else); :func:`disabled` gives the
base model (the reference policy), :func:`merged` the merged weights ``W + scale * B @ A`` in place of ``W``
(the rollout's push, the HF export).
"""

from __future__ import annotations

import contextlib
import math
import types
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    set_tensor_model_parallel_attributes,
)

MODULES = {"linear_qkv": ("q", "k", "v"), "linear_proj": ("o",), "linear_fc1": ("gate", "up"), "linear_fc2": ("down",)}
"""Megatron's adaptable linears of a decoder layer and the HF projections each holds."""
HF_TARGETS = {"q_proj": ("linear_qkv", "q"), "k_proj": ("linear_qkv", "k"), "v_proj": ("linear_qkv", "v"),
              "o_proj": ("linear_proj", "o"), "gate_proj": ("linear_fc1", "gate"), "up_proj": ("linear_fc1", "up"),
              "down_proj": ("linear_fc2", "down")}  # fmt: skip
"""HF / PEFT target names -> (Megatron module, part)."""
ALL = "all-linear"
KNOWN_TARGETS = (*HF_TARGETS, *MODULES, ALL)
COLUMN = ("linear_qkv", "linear_fc1")
ATTR = "hybridrl_lora"
"""Attribute of an adapted linear: its :class:`LoRASpec`."""


class LoRAError(ValueError):
    """A LoRA setting this model cannot take (one line: the key, the value, the fix)."""


def resolve_targets(targets: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """Megatron module -> the HF parts of it adapted, from target names (HF, Megatron or ``all-linear``).

    Raises:
        LoRAError: a name that matches no layer of a Llama-family decoder.
    """
    out: dict[str, set[str]] = {}
    for name in targets:
        if name == ALL:
            for module, parts in MODULES.items():
                out.setdefault(module, set()).update(parts)
        elif name in MODULES:
            out.setdefault(name, set()).update(MODULES[name])
        elif name in HF_TARGETS:
            module, part = HF_TARGETS[name]
            out.setdefault(module, set()).add(part)
        else:
            raise LoRAError(f"actor.lora.target_modules: {name!r} matches no layer; choose from {list(KNOWN_TARGETS)}")
    if not out:
        raise LoRAError(f"actor.lora.target_modules is empty; name at least one of {list(KNOWN_TARGETS)}")
    return {m: tuple(p for p in MODULES[m] if p in parts) for m, parts in out.items()}


@dataclass
class LoRASpec:
    """What an adapted linear needs besides its factors."""

    module: str
    """Megatron module name (``linear_qkv`` ...)."""
    parts: tuple[str, ...]
    """The HF projections adapted (all of the module's, or some of a fused one)."""
    scale: float
    """``alpha / rank``."""
    dropout: float
    column: bool
    layer: int = 0
    """0-based global layer number."""
    enabled: bool = field(default=True)


def _row_mask(module: str, parts: tuple[str, ...], rows: int, shape, tp: int) -> torch.Tensor | None:
    """``(rows, 1)`` 0/1 mask of this rank's rows of ``B`` that belong to adapted parts; None = all rows."""
    if set(parts) == set(MODULES[module]):
        return None
    if module == "linear_fc1":  # local rows [gate_t; up_t]
        half = rows // 2
        keep = torch.zeros(rows, 1)
        keep[:half] = float("gate" in parts)
        keep[half:] = float("up" in parts)
        return keep
    hd, groups = shape.kv_channels, shape.num_query_groups // tp  # local rows: per group [q heads, k, v]
    qpg = shape.num_attention_heads // shape.num_query_groups
    group = torch.cat([torch.full((qpg * hd, 1), float("q" in parts)), torch.full((hd, 1), float("k" in parts)),
                       torch.full((hd, 1), float("v" in parts))])  # fmt: skip
    return group.repeat(groups, 1)


def _init_a(spec: LoRASpec, rank: int, fan_in: int, seed: int) -> torch.Tensor:
    """PEFT's initial A over the full input ``(rank, fan_in)``: Kaiming-uniform(a=sqrt(5)) = U(+-1/sqrt(fan_in))."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + spec.layer * 8 + list(MODULES).index(spec.module))
    bound = 1.0 / math.sqrt(fan_in)
    return (torch.rand(rank, fan_in, generator=g, dtype=torch.float64) * 2 - 1).mul_(bound)


def _delta(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``scale * dropout(x) A^T B^T`` on this rank (see the module docstring for the TP collectives)."""
    spec: LoRASpec = getattr(module, ATTR)
    b = module.lora_b if module.lora_mask is None else module.lora_b * module.lora_mask
    if spec.column:
        if spec.dropout > 0 and module.training:
            x = F.dropout(x, spec.dropout)  # the default generator: equal on every TP rank, as x is
        h = tensor_parallel.copy_to_tensor_model_parallel_region(F.linear(x, module.lora_a))
    else:
        if spec.dropout > 0 and module.training:
            with tensor_parallel.get_cuda_rng_tracker().fork():  # x is this rank's slice: its own mask
                x = F.dropout(x, spec.dropout)
        h = tensor_parallel.reduce_from_tensor_model_parallel_region(F.linear(x, module.lora_a))
    return F.linear(h, b) * spec.scale


def _hook(module: torch.nn.Module, args: tuple, output: tuple) -> tuple:
    if not getattr(module, ATTR).enabled:
        return output
    out, bias = output
    return out + _delta(module, args[0]).to(out.dtype), bias


def _sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
    """Megatron's own, with the split factor at its global TP offset (fc1's ``B`` as SwiGLU halves, as its weight)."""
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    spec: LoRASpec = getattr(self, ATTR)
    axes = {"weight": 0, "bias": 0, "lora_b": 0} if spec.column else {"weight": 1, "lora_a": 1}
    out = make_sharded_tensors_for_checkpoint(
        self.state_dict(prefix="", keep_vars=True), prefix, axes, sharded_offsets,
        tp_group=self.tp_group, dp_cp_group=(metadata or {}).get("dp_cp_group"),
    )  # fmt: skip
    if spec.module == "linear_fc1" and self.config.gated_linear_unit:
        out[f"{prefix}lora_b"] = apply_swiglu_sharded_factory(out[f"{prefix}lora_b"], sharded_offsets)
    return out


def adapted_modules(chunks: Iterable[torch.nn.Module]) -> Iterator[tuple[str, torch.nn.Module]]:
    """(name, linear) of every adapted linear of the chunks (wrapped chunks too)."""
    for chunk in chunks:
        for name, module in chunk.named_modules():
            if hasattr(module, ATTR):
                yield name, module


def is_adapted(chunks: Iterable[torch.nn.Module]) -> bool:
    return next(adapted_modules(chunks), None) is not None


def apply_lora(
    chunks: list[torch.nn.Module], shape, rank: int, alpha: float, targets: Iterable[str],
    dropout: float = 0.0, seed: int = 0,
) -> list[str]:  # fmt: skip
    """Add LoRA factors to the targeted linears of every decoder layer and freeze every other parameter.

    Args:
        chunks: this rank's model chunks (``gpt.build_model_chunks``, loaded).
        shape: their :class:`~hybridrl.mcore.gpt.GPTShape`.
        rank / alpha / dropout: LoRA's ``r``, ``alpha`` (scale ``alpha / r``) and dropout on the adapter's input.
        targets: HF / Megatron module names (see :func:`resolve_targets`).
        seed: the initial A's seed (B starts at zero).

    Returns:
        The adapted modules' names.

    Raises:
        LoRAError: rank < 1, no layer matched, or a targeted layer is not Megatron's local parallel linear.
    """
    if rank < 1:
        raise LoRAError(f"actor.lora.rank ({rank}) must be >= 1; e.g. actor.lora.rank=8")
    wanted = resolve_targets(targets)
    tp, tp_rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
    for chunk in chunks:
        for p in chunk.parameters():
            p.requires_grad_(False)
    done = []
    for chunk in chunks:
        for layer in chunk.decoder.layers:
            for name, module in layer.named_modules():
                leaf = name.rsplit(".", 1)[-1]
                if leaf not in wanted:
                    continue
                if type(module) not in (ColumnParallelLinear, RowParallelLinear):
                    raise LoRAError(
                        f"actor.lora.target_modules: {leaf} is a {type(module).__name__}; LoRA adapts Megatron's local "
                        "ColumnParallelLinear / RowParallelLinear only (not TransformerEngine's fused layers): run "
                        "without transformer_engine or drop actor.lora"
                    )
                spec = LoRASpec(leaf, wanted[leaf], alpha / rank, dropout, leaf in COLUMN, layer.layer_number - 1)
                _attach(module, spec, rank, shape, tp, tp_rank, seed)
                done.append(f"decoder.layers.{spec.layer}.{name}")
    if not done:
        raise LoRAError(f"actor.lora.target_modules ({sorted(wanted)}) matched no layer of this model")
    return done


def _attach(module, spec: LoRASpec, rank: int, shape, tp: int, tp_rank: int, seed: int) -> None:
    w = module.weight
    out_local, in_local = w.shape
    fan_in = in_local if spec.column else in_local * tp
    a = _init_a(spec, rank, fan_in, seed)
    if not spec.column:
        a = a[:, tp_rank * in_local : (tp_rank + 1) * in_local]
    module.lora_a = torch.nn.Parameter(a.to(device=w.device, dtype=w.dtype).contiguous())
    module.lora_b = torch.nn.Parameter(torch.zeros(out_local, rank, device=w.device, dtype=w.dtype))
    mask = _row_mask(spec.module, spec.parts, out_local, shape, tp) if spec.column else None
    module.register_buffer("lora_mask", None if mask is None else mask.to(w.device, w.dtype), persistent=False)
    stride = getattr(w, "partition_stride", 1)
    if spec.column:  # A replicated, B split by output rows like W
        set_tensor_model_parallel_attributes(module.lora_a, False, -1, 1)
        set_tensor_model_parallel_attributes(module.lora_b, True, 0, stride)
    else:  # A split by input columns like W, B replicated
        set_tensor_model_parallel_attributes(module.lora_a, True, 1, 1)
        set_tensor_model_parallel_attributes(module.lora_b, False, -1, 1)
    setattr(module, ATTR, spec)
    module.register_forward_hook(_hook)
    module.sharded_state_dict = types.MethodType(_sharded_state_dict, module)


def delta_weight(module: torch.nn.Module) -> torch.Tensor:
    """This rank's ``scale * B @ A`` in the weight's local layout ``(out_local, in_local)``."""
    spec: LoRASpec = getattr(module, ATTR)
    b = module.lora_b if module.lora_mask is None else module.lora_b * module.lora_mask
    return (b.float() @ module.lora_a.float()).mul_(spec.scale).to(module.weight.dtype)


@contextlib.contextmanager
def disabled(chunks: Iterable[torch.nn.Module]) -> Iterator[None]:
    """The base model for the block: every adapter off (the reference policy is the actor without them)."""
    specs = [getattr(m, ATTR) for _, m in adapted_modules(chunks)]
    before = [s.enabled for s in specs]
    for s in specs:
        s.enabled = False
    try:
        yield
    finally:
        for s, was in zip(specs, before, strict=True):
            s.enabled = was


@contextlib.contextmanager
def merged(chunks: Iterable[torch.nn.Module]) -> Iterator[None]:
    """Each adapted weight's data is ``W + scale * B @ A`` for the block (adapters off meanwhile, so a forward
    is the adapted model's), then ``W`` again, bit for bit: the base weight is never written. A no-op without
    adapters. Whoever reads the weights inside (the hybrid engine's push, the HF export) sees merged weights."""
    saved = []
    with torch.no_grad():
        for _, module in adapted_modules(chunks):
            base = module.weight.data
            module.weight.data = base + delta_weight(module)
            saved.append((module, base))
    try:
        with disabled(m for m, _ in saved):
            yield
    finally:
        for module, base in saved:
            module.weight.data = base


def adapter_parameters(chunks: Iterable[torch.nn.Module]) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """(name, factor) of every LoRA parameter of the chunks, names as in ``named_parameters``."""
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if name.endswith((".lora_a", ".lora_b")):
                yield name, p


def global_adapted_modules(chunks: Iterable[torch.nn.Module]) -> Iterator[tuple[str, torch.nn.Module]]:
    """(name with the GLOBAL layer number, e.g. ``decoder.layers.3.mlp.linear_fc1``, linear) of every adapter."""
    for _, module in adapted_modules(chunks):
        spec: LoRASpec = getattr(module, ATTR)
        block = "self_attention" if spec.module in ("linear_qkv", "linear_proj") else "mlp"
        yield f"decoder.layers.{spec.layer}.{block}.{spec.module}", module


SETTINGS_ATTR = "hybridrl_lora_settings"
"""Attribute of each chunk of an adapted model: the settings it was adapted with (:func:`settings_of`)."""


def apply_config(model, cfg) -> list[str]:
    """Adapt a :class:`~hybridrl.mcore.roles.RoleModel` as an ``actor.lora`` section says (``rank``, ``alpha``,
    ``dropout``, ``target_modules``, ``init_seed``); what the actor worker and a checkpoint rebuild call."""
    settings = {"rank": int(cfg.rank), "alpha": float(cfg.alpha), "dropout": float(cfg.dropout),
                "target_modules": list(cfg.target_modules), "init_seed": int(cfg.init_seed)}  # fmt: skip
    names = apply_lora(model.chunks, model.shape, settings["rank"], settings["alpha"], settings["target_modules"],
                       settings["dropout"], settings["init_seed"])  # fmt: skip
    for chunk in model.chunks:
        setattr(chunk, SETTINGS_ATTR, settings)
    return names


def settings_of(chunks: Iterable[torch.nn.Module]) -> dict | None:
    """The settings :func:`apply_config` adapted the chunks with (wrapped chunks too); None without adapters."""
    for chunk in chunks:
        while not hasattr(chunk, SETTINGS_ATTR) and hasattr(chunk, "module"):
            chunk = chunk.module
        if hasattr(chunk, SETTINGS_ATTR):
            return getattr(chunk, SETTINGS_ATTR)
    return None
