"""Test helpers: move full (1-rank) weights into this rank's Megatron shards and gather gradients back.

They read the tensor-parallel attributes of each parameter (``tensor_model_parallel``, ``partition_dim``,
``partition_stride``, which ``gpt.build_model_chunks`` sets as Megatron's init would: test_grad_norm_hf checks
them against Megatron's own) and the global layer numbers, so they are independent of the bridge's layout math.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu


def global_named_parameters(chunks):
    """(global name, param) over all chunks; layer indices become 0-based global layer numbers."""
    for chunk in chunks:
        numbers = [layer.layer_number - 1 for layer in chunk.decoder.layers]
        for name, param in chunk.named_parameters():
            m = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
            if m:
                name = f"decoder.layers.{numbers[int(m.group(1))]}.{m.group(2)}"
            yield name, param


def _pieces(full: torch.Tensor, param: torch.Tensor, tp: int) -> list[list[torch.Tensor]]:
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    per_stride = full.shape[dim] // (tp * stride)
    chunks = torch.split(full, per_stride, dim=dim)
    return [[chunks[j * tp + r] for j in range(stride)] for r in range(tp)]


def load_full(chunks, full: dict[str, torch.Tensor]) -> None:
    """Copy this rank's shard of every full tensor in ``full`` into the model."""
    tp, rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, param in global_named_parameters(chunks):
            value = full[name]
            if getattr(param, "tensor_model_parallel", False) and tp > 1:
                value = torch.cat(_pieces(value, param, tp)[rank], dim=param.partition_dim)
            param.copy_(value)


def gather_full(chunks, attr: str = "grad") -> dict[str, torch.Tensor]:
    """Full tensors of ``param.<attr>`` (e.g. grads) over TP and PP, on every rank."""
    tp = mpu.get_tensor_model_parallel_world_size()
    local = {}
    for name, param in global_named_parameters(chunks):
        value = param if attr == "data" else getattr(param, attr)
        value = value.detach().clone()
        if getattr(param, "tensor_model_parallel", False) and tp > 1:
            parts = [torch.empty_like(value) for _ in range(tp)]
            dist.all_gather(parts, value, group=mpu.get_tensor_model_parallel_group())
            dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
            split = [torch.chunk(p, stride, dim=dim) for p in parts]
            value = torch.cat([split[r][j] for j in range(stride) for r in range(tp)], dim=dim)
        local[name] = value
    everything = [None] * dist.get_world_size()
    dist.all_gather_object(everything, local)
    merged: dict[str, torch.Tensor] = {}
    for d in everything:
        merged.update(d)
    return merged


def local_shards(chunks, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's expected piece of every full tensor in ``full`` (keys as in :func:`global_named_parameters`).

    The inverse view of :func:`load_full`: compare it with the rank's own params/grads to check a result
    without gathering (and so every data-parallel copy is checked, not just one).
    """
    tp, rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
    out = {}
    for name, param in global_named_parameters(chunks):
        value = full[name]
        if getattr(param, "tensor_model_parallel", False) and tp > 1:
            value = torch.cat(_pieces(value, param, tp)[rank], dim=param.partition_dim)
        out[name] = value
    return out


def init_layout(**layout_kw) -> None:
    """Megatron groups for ``layout_kw`` (tp, pp, vpp, ...) over the whole launched world."""
    from hybridrl.distributed import ParallelLayout, init_model_parallel

    init_model_parallel(ParallelLayout.from_world(dist.get_world_size(), **layout_kw), seed=1234)


def build_chunks(shape, full: dict[str, torch.Tensor] | None = None):
    """This rank's model chunks for ``shape`` on the current layout, optionally loaded with ``full`` weights.

    Loaded models skip Megatron's random init, as every role does (roles._build): that init is where Megatron
    sets the tensor-parallel attributes, so a test that kept it would not see a model that lacks them.
    """
    from hybridrl.mcore import gpt

    chunks = gpt.build_model_chunks(shape, gpt.make_config(shape, perform_initialization=full is None))
    if full is not None:
        load_full(chunks, full)
    return chunks
