"""LoRA adapters of a Megatron model <-> PEFT adapter folders (``adapter_config.json`` + ``adapter_model.safetensors``).

PEFT adapts each HF projection on its own; Megatron fuses q/k/v into ``linear_qkv`` (rows per query group
``[q heads, k_g, v_g]``) and gate/up into ``linear_fc1`` (TP rank t: ``[gate_t; up_t]``). A fused layer has ONE
``A`` and one ``B`` in the weight's row layout, so ``delta W_qkv = B A`` splits exactly into PEFT's
``q_proj: (lora_A = A, lora_B = B_q)``, ``k_proj: (A, B_k)``, ``v_proj: (A, B_v)`` (gate/up alike): the rows of
``B`` are cut and put back with the bridge's own row maps (:mod:`hybridrl.mcore.bridge_layout`), the ones that
place the weights. The other way, a PEFT adapter loads when the projections of each fused layer share their
``lora_A`` (what :func:`save_peft_adapter` writes); separate ``A`` per projection has no rank-r fused form.

PEFT's names: ``base_model.model.<HF module>.lora_A.weight`` ``(r, in)`` and ``.lora_B.weight`` ``(out, r)``;
``scale = lora_alpha / r``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from safetensors.torch import load_file, save_file

from hybridrl.mcore import bridge, bridge_layout, lora
from hybridrl.mcore.gpt import GPTShape

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."


def _weight_map(shape: GPTShape, tp: int, name: str) -> bridge_layout.TensorMap:
    """The bridge's map of the weight whose adapter factor is ``name`` (``decoder.layers.3.mlp.linear_fc1.lora_b``)."""
    layer = int(name.split(".")[2])
    weight = name.rsplit(".", 1)[0] + ".weight"
    return next(m for m in bridge_layout.layer_maps(shape, tp, layer) if m.megatron == weight)


def _peft_key(hf_weight: str, factor: str) -> str:
    return f"{PREFIX}{hf_weight.removesuffix('.weight')}.lora_{factor}.weight"


def _part_of(hf_weight: str) -> str:
    """``model.layers.0.self_attn.q_proj.weight`` -> ``q`` (the parts of :data:`hybridrl.mcore.lora.MODULES`)."""
    return hf_weight.rsplit(".", 2)[-2].removesuffix("_proj")


def _gather(chunks: list[torch.nn.Module], tensor_of: Callable) -> tuple[dict[str, list[torch.Tensor]], dict]:
    """On global rank 0: each factor's TP shards (DP rank 0's copies, in TP order) and its adapter's parts and
    side; elsewhere ``{}``. Collective over the world (one object all-gather, then one send per shard)."""
    local = {}
    for name, module in lora.global_adapted_modules(chunks):
        spec = getattr(module, lora.ATTR)
        for factor in ("a", "b"):
            local[f"{name}.lora_{factor}"] = (tensor_of(getattr(module, f"lora_{factor}")).detach(),
                                              {"parts": spec.parts, "column": spec.column})  # fmt: skip
    meta_of = {n: (tuple(t.shape), str(t.dtype).removeprefix("torch."), s) for n, (t, s) in local.items()}
    mine = {"tp": mpu.get_tensor_model_parallel_rank(), "dp": mpu.get_data_parallel_rank(with_context_parallel=True),
            "meta": meta_of}  # fmt: skip
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    holders: dict[str, list[tuple[int, int]]] = {}
    meta: dict[str, tuple] = {}
    for rank, info in enumerate(everyone):
        if info["dp"] == 0:
            for name, m in info["meta"].items():
                holders.setdefault(name, []).append((info["tp"], rank))
                meta[name] = m
    me, out = dist.get_rank(), {}
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    for name in sorted(holders):
        shards = []
        for _, src in sorted(holders[name]):
            if src == me == 0:
                shards.append(local[name][0].clone())
            elif src == me:
                dist.send(local[name][0].contiguous(), dst=0)
            elif me == 0:
                shp, dt, _ = meta[name]
                buf = torch.empty(shp, dtype=getattr(torch, dt), device=device)
                dist.recv(buf, src=src)
                shards.append(buf)
        if me == 0:
            out[name] = shards
    return out, {n: m[2] for n, m in meta.items()}


def adapter_tensors(
    chunks: list[torch.nn.Module], shape: GPTShape, tensor_of: Callable = lambda p: p
) -> dict[str, torch.Tensor]:
    """The adapters as full PEFT-named tensors on global rank 0 (``{}`` elsewhere). Collective.

    Args:
        chunks / shape: the adapted model (:func:`hybridrl.mcore.lora.apply_lora`) and its shape.
        tensor_of: what to read of each factor (``lambda p: p.grad`` for the gradients in PEFT's layout).
    """
    tp = mpu.get_tensor_model_parallel_world_size()
    shards, specs = _gather(chunks, tensor_of)
    hf_shapes = bridge_layout.hf_shapes(shape)
    out: dict[str, torch.Tensor] = {}
    for name, parts in shards.items():
        spec, factor = specs[name], name[-1]  # "a" / "b"
        wmap = _weight_map(shape, tp, name)
        adapted = {hf for hf in wmap.hf_names if _part_of(hf) in spec["parts"]}
        split = (factor == "b") == spec["column"]  # column: B follows W's rows; row: A follows W's columns
        if split:
            rank = parts[0].shape[1 - wmap.dim]
            full = {n: tuple(s if d == wmap.dim else rank for d, s in enumerate(hf_shapes[n])) for n in wmap.hf_names}
            pieces = bridge._assemble(bridge_layout.TensorMap(name, wmap.dim, wmap.shards), parts, full)
        else:
            pieces = dict.fromkeys(wmap.hf_names, parts[0])
        for hf, tensor in pieces.items():
            if hf in adapted:
                out[_peft_key(hf, factor.upper())] = tensor.clone()  # a shared A: one tensor per PEFT name
    return out


def save_peft_adapter(
    chunks: list[torch.nn.Module], shape: GPTShape, out_dir: str | os.PathLike, rank: int, alpha: float,
    dropout: float = 0.0, base_model: str | None = None, dtype: torch.dtype | None = None,
) -> None:  # fmt: skip
    """Write the adapters as a PEFT LoRA folder that ``peft.PeftModel.from_pretrained(hf_model, out_dir)`` loads.
    Collective; global rank 0 writes."""
    tensors = adapter_tensors(chunks, shape)
    if dist.get_rank() == 0:
        out_dir = os.fspath(out_dir)
        os.makedirs(out_dir, exist_ok=True)
        modules = sorted({k.removeprefix(PREFIX).split(".")[-3] for k in tensors})
        save_file({k: v.to(dtype or v.dtype).cpu() for k, v in tensors.items()}, os.path.join(out_dir, WEIGHTS),
                  metadata={"format": "pt"})  # fmt: skip
        config = {
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "r": rank,
            "lora_alpha": alpha, "lora_dropout": dropout, "target_modules": modules, "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "init_lora_weights": True,
            "modules_to_save": None, "inference_mode": True,
        }  # fmt: skip
        with open(os.path.join(out_dir, CONFIG), "w") as f:
            json.dump(config, f, indent=2)
    dist.barrier()


def load_peft_adapter(chunks: list[torch.nn.Module], shape: GPTShape, path: str | os.PathLike) -> None:
    """Fill this rank's adapter factors from a PEFT LoRA folder (each rank reads its own rows; no collectives).

    Raises:
        lora.LoRAError: the folder's ``r`` differs, a targeted projection is missing from it, or two projections
            of one fused layer have different ``lora_A`` (no rank-r fused form).
    """
    path = os.fspath(path)
    with open(os.path.join(path, CONFIG)) as f:
        config = json.load(f)
    tensors = load_file(os.path.join(path, WEIGHTS))
    tp, tp_rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for base, module in lora.global_adapted_modules(chunks):
            spec = getattr(module, lora.ATTR)
            if module.lora_a.shape[0] != config["r"]:
                raise lora.LoRAError(
                    f"{path}: r ({config['r']}) differs from actor.lora.rank ({module.lora_a.shape[0]}); "
                    f"set actor.lora.rank={config['r']}"
                )
            wmap = _weight_map(shape, tp, f"{base}.lora_b")
            keys = {hf: (_peft_key(hf, "A"), _peft_key(hf, "B")) for hf in wmap.hf_names if _part_of(hf) in spec.parts}
            for ka, kb in keys.values():
                if ka not in tensors or kb not in tensors:
                    raise lora.LoRAError(f"{path} lacks {ka} / {kb}; the adapter targets another set of modules")
            a_full = [tensors[ka] for ka, _ in keys.values()]
            b_full = {hf: tensors[kb] for hf, (_, kb) in keys.items()}
            if any(not torch.equal(a_full[0], a) for a in a_full[1:]):
                raise lora.LoRAError(f"{path}: the projections of {base} have different lora_A; a fused Megatron "
                                     "linear shares one A (adapters saved by hybridrl have it)")  # fmt: skip
            split = wmap.pieces(tp_rank)
            if spec.column:
                rows = [b_full[p.hf][p.start : p.stop] if p.hf in b_full else torch.zeros(p.size, config["r"])
                        for p in split]  # fmt: skip
                module.lora_a.copy_(a_full[0])
                module.lora_b.copy_(torch.cat(rows))
            else:
                module.lora_a.copy_(torch.cat([a_full[0][:, p.start : p.stop] for p in split], dim=1))
                module.lora_b.copy_(next(iter(b_full.values())))


ADAPTER_DIR = "lora_adapter"
"""Sub-folder of ``hybridrl export``'s output holding the PEFT adapter of an adapted actor."""


def export_role(model: Any, out_dir: str | os.PathLike) -> str | None:
    """Write an adapted :class:`~hybridrl.mcore.roles.RoleModel`'s adapters as a PEFT folder (its LoRA settings,
    ``base_model_name_or_path`` = the HF folder it started from); returns the folder, None (nothing written) for a
    model without adapters. Collective."""
    settings = lora.settings_of(model.chunks)
    if settings is None:
        return None
    save_peft_adapter(model.chunks, model.shape, out_dir, settings["rank"], settings["alpha"], settings["dropout"],
                      base_model=model.source)  # fmt: skip
    return os.fspath(out_dir)
