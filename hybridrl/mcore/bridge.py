"""Hugging Face safetensors checkpoints <-> Megatron model chunks, on any TP x PP (x VPP) layout.

Owns loading each rank's shards (:func:`load`: a rank reads only the rows it holds and only the layers of
its pipeline stage; no collectives) and writing the model back as an HF folder from any layout
(:func:`export`: shards go to global rank 0 one tensor at a time, so no rank ever holds the whole model).
Reading and validating checkpoints lives in ``bridge_checkpoint`` (re-exported here), the row layouts in
``bridge_layout``.

    ckpt = HFCheckpoint(path)
    validate(ckpt, shape, tp)              # before building: names, shapes, tp divisibility
    load(chunks, shape, ckpt)              # every rank
    export(chunks, shape, hf_config, out)  # every rank (collective); rank 0 writes
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from safetensors.torch import save_file

from hybridrl.mcore import bridge_layout as layout
from hybridrl.mcore import bridge_moe
from hybridrl.mcore.bridge_checkpoint import INDEX, SINGLE, CheckpointError, HFCheckpoint, validate
from hybridrl.mcore.gpt import GPTShape
from hybridrl.mcore.hf_config import architecture_name

__all__ = ["CheckpointError", "HFCheckpoint", "export", "global_parameters", "load", "validate"]

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "generation_config.json",
)


def global_parameters(chunks: Iterable[torch.nn.Module]) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) over this rank's chunks, with 0-based GLOBAL layer numbers in the names."""
    for chunk in chunks:
        numbers = [layer.layer_number - 1 for layer in chunk.decoder.layers] if hasattr(chunk, "decoder") else []
        experts = getattr(getattr(chunk, "config", None), "num_moe_experts", None)
        for name, param in chunk.named_parameters():
            m = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
            if m:
                name = f"decoder.layers.{numbers[int(m.group(1))]}.{m.group(2)}"
            if experts:  # experts by their global index, as layers
                ep = mpu.get_expert_model_parallel_world_size()
                name = bridge_moe.global_expert_name(name, mpu.get_expert_model_parallel_rank(), experts // ep)
            yield name, param


def _maps(shape: GPTShape, names: Iterable[str], tp: int, head: str) -> list[layout.TensorMap]:
    fused = any(n.endswith("linear_qkv.layer_norm_weight") for n in names)
    return layout.tensor_maps(shape, tp, head=head, fused_norms=fused)


def load(
    chunks: list[torch.nn.Module],
    shape: GPTShape,
    ckpt: HFCheckpoint | str | os.PathLike,
    head: str = "lm",
    optional: Iterable[str] = (),
) -> list[str]:
    """Fill this rank's parameters from ``ckpt``, reading only its own rows (no collectives).

    Args:
        chunks: this rank's model chunks (``gpt.build_model_chunks`` or a role).
        shape: the model's architecture.
        ckpt: the checkpoint (or its folder).
        head: which head the model has (see :func:`validate`).
        optional: HF names that may be absent; their parameters keep their initial values.

    Returns:
        The Megatron names (global layer numbers) that were left at their initial values.
    """
    ckpt = ckpt if isinstance(ckpt, HFCheckpoint) else HFCheckpoint(ckpt)
    tp, tp_rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
    params = dict(global_parameters(chunks))
    expected = layout.hf_shapes(shape, head)
    skipped, covered = [], set()
    with torch.no_grad():
        for m in _maps(shape, params, tp, head):
            if m.megatron not in params:
                continue  # another pipeline stage's tensor, or a tied output layer that reuses the embedding
            covered.add(m.megatron)
            pieces = m.pieces(mpu.get_expert_tensor_parallel_rank() if m.expert else tp_rank)
            if any(p.hf not in ckpt.files for p in pieces if p.hf is not None):
                missing = [p.hf for p in pieces if p.hf is not None and p.hf not in ckpt.files]
                if set(missing) <= set(optional):
                    skipped.append(m.megatron)
                    continue
                raise CheckpointError(f"tensor {missing[0]} is missing from {ckpt.path}; run bridge.validate first")
            value = ckpt.read(pieces, m.dim, expected[m.hf_names[0]])
            param = params[m.megatron]
            if value.shape != param.shape:
                raise CheckpointError(
                    f"{m.megatron}: rows read from {m.hf_names} have shape {list(value.shape)} but the parameter is "
                    f"{list(param.shape)}; the model was built for another config or TP size"
                )
            param.copy_(value)
    unmapped = sorted(set(params) - covered)
    if unmapped:
        raise RuntimeError(
            f"no HF source for Megatron parameter {unmapped[0]}; the layer spec has a tensor the bridge lacks"
        )
    return skipped


def _owners(chunks: list[torch.nn.Module]) -> tuple[dict[str, torch.Tensor], dict[str, list[tuple[int, int]]], dict]:
    """Local params, and for each name the (tp rank, global rank) of its DP-rank-0 holders, plus shapes."""
    params = {n: p.detach() for n, p in global_parameters(chunks)}
    mine = {
        "tp": mpu.get_tensor_model_parallel_rank(),
        "dp": mpu.get_data_parallel_rank(with_context_parallel=True),
        # experts: one copy per expert-data-parallel group, split over expert-tensor-parallel ranks
        "etp": mpu.get_expert_tensor_parallel_rank(),
        "edp": mpu.get_expert_data_parallel_rank(),
        "params": {n: (tuple(p.shape), str(p.dtype).removeprefix("torch.")) for n, p in params.items()},
    }
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    sources: dict[str, list[tuple[int, int]]] = {}
    meta: dict[str, tuple] = {}
    for rank, info in enumerate(everyone):
        for name, spec in info["params"].items():
            expert = bridge_moe.is_expert_name(name)
            if info["edp" if expert else "dp"] != 0:
                continue
            sources.setdefault(name, []).append((info["etp" if expert else "tp"], rank))
            meta[name] = spec
    return params, {n: sorted(s) for n, s in sources.items()}, meta


class _ShardWriter:
    """Accumulates HF tensors into safetensors files of at most ``max_bytes`` (rank 0 only)."""

    def __init__(self, out_dir: str, max_bytes: int) -> None:
        self.out_dir, self.max_bytes = out_dir, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.files: list[list[str]] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and sum(t.numel() * t.element_size() for t in self.pending.values()) + size > self.max_bytes:
            self.flush()
        self.pending[name] = tensor.contiguous().cpu()

    def flush(self) -> None:
        if self.pending:
            save_file(self.pending, os.path.join(self.out_dir, f".part-{len(self.files)}"), metadata={"format": "pt"})
            self.files.append(list(self.pending))
            self.pending = {}

    def close(self) -> None:
        self.flush()
        n = len(self.files)
        weight_map = {}
        for i, names in enumerate(self.files):
            final = SINGLE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(os.path.join(self.out_dir, f".part-{i}"), os.path.join(self.out_dir, final))
            weight_map.update((name, final) for name in names)
        if n > 1:
            total = sum(os.path.getsize(os.path.join(self.out_dir, f)) for f in set(weight_map.values()))
            with open(os.path.join(self.out_dir, INDEX), "w") as f:
                json.dump(
                    {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2
                )


def _write_config(hf_config: Any, out_dir: str, head: str, dtype: torch.dtype, source: str | None) -> None:
    cfg = copy.deepcopy(hf_config)
    cfg.architectures = [architecture_name(hf_config, head)]
    cfg.dtype = dtype
    if head == "score":
        cfg.num_labels = 1
    cfg.save_pretrained(out_dir)
    for name in TOKENIZER_FILES if source else ():
        if os.path.isfile(os.path.join(source, name)):
            shutil.copy2(os.path.join(source, name), os.path.join(out_dir, name))


def export(
    chunks: list[torch.nn.Module],
    shape: GPTShape,
    hf_config: Any,
    out_dir: str | os.PathLike,
    head: str = "lm",
    source: str | os.PathLike | None = None,
    max_shard_bytes: int = 5 * 2**30,
    dtype: torch.dtype | None = None,
) -> None:
    """Write the model as an HF folder (config.json, safetensors shards + index, tokenizer files from ``source``).

    Collective: every rank calls it. Shards of each tensor travel to global rank 0 one tensor at a time;
    rank 0 rebuilds the HF tensors and writes files of at most ``max_shard_bytes``.

    Args:
        chunks: this rank's model chunks.
        shape: the model's architecture.
        hf_config: the transformers config to write (architectures / dtype updated).
        out_dir: the folder to write (created by rank 0).
        head: ``"lm"`` (``...ForCausalLM``) or ``"score"`` (``...ForSequenceClassification``, ``num_labels=1``).
        source: an HF folder whose tokenizer / generation files are copied along.
        dtype: dtype of the written tensors; default: the parameters' dtype.
    """
    out_dir = os.fspath(out_dir)
    me, tp = dist.get_rank(), mpu.get_tensor_model_parallel_world_size()
    params, sources, meta = _owners(chunks)
    expected = layout.hf_shapes(shape, head)
    writer = _ShardWriter(out_dir, max_shard_bytes) if me == 0 else None
    if writer:
        os.makedirs(out_dir, exist_ok=True)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    out_dtype = dtype
    for m in _maps(shape, meta, tp, head):
        if not m.export or m.megatron not in sources:
            continue
        holders = sources[m.megatron][:1] if m.replicated else sources[m.megatron]
        shards = []
        for _, src in holders:
            if src == me == 0:
                shards.append(params[m.megatron])
            elif src == me:
                dist.send(params[m.megatron].contiguous(), dst=0)
            elif me == 0:
                shp, dt = meta[m.megatron]
                buf = torch.empty(shp, dtype=getattr(torch, dt), device=device)
                dist.recv(buf, src=src)
                shards.append(buf)
        if writer:
            out_dtype = out_dtype or shards[0].dtype
            for name, tensor in _assemble(m, shards, expected).items():
                writer.add(name, tensor.to(out_dtype))
    if writer:
        writer.close()
        _write_config(hf_config, out_dir, head, out_dtype or torch.float32, os.fspath(source) if source else None)
    dist.barrier()


def _assemble(m: layout.TensorMap, shards: list[torch.Tensor], expected: dict) -> dict[str, torch.Tensor]:
    """The HF tensors of map ``m`` from its per-TP-rank shards (padding dropped)."""
    out = {name: torch.empty(expected[name], dtype=shards[0].dtype, device=shards[0].device) for name in m.hf_names}
    filled = dict.fromkeys(m.hf_names, 0)
    for rank, shard in enumerate(shards):
        offset = 0
        for p in m.pieces(rank):
            if p.hf is not None:
                out[p.hf].narrow(m.dim, p.start, p.size).copy_(shard.narrow(m.dim, offset, p.size))
                filled[p.hf] += p.size
            offset += p.size
        if offset != shard.shape[m.dim]:
            raise RuntimeError(f"{m.megatron}: TP shard {rank} has {shard.shape[m.dim]} rows, layout expects {offset}")
    for name, rows in filled.items():
        if rows != expected[name][m.dim]:
            raise RuntimeError(f"{m.megatron}: layout covers {rows} of {expected[name][m.dim]} rows of {name}")
    return out
