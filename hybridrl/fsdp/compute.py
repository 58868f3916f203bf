"""Rollout batches through an FSDP :class:`~hybridrl.fsdp.model.TokenModel`: forward-only heads and the loss's backward.

Batch layout (what rollout produces, as for the Megatron path, :mod:`hybridrl.mcore.compute`): ``input_ids``,
``attention_mask`` ``(b, s)`` with the prompt LEFT-padded to ``p = s - r`` and the response RIGHT-padded, and
``responses`` ``(b, r)``. The output of response token ``t`` comes from sequence position ``p + t - 1``.

Each row is rolled left by its number of left-pad tokens, so that it is ``[tokens][padding]``: with a causal
mask no real token attends to padding, the positions are ``0..n-1`` (the batch's ``position_ids`` are the same
numbers, ``cumsum(mask) - 1``) and the model needs no padding mask. Columns past a micro-batch's longest row are
then padding for all its rows and are cut (to a multiple of 8) before the model.

The loss of one optimizer step is one aggregate over the GLOBAL batch (every micro-batch of every rank),
``L = agg_{i in B}(loss_fn(outputs_i), mask_i)`` with ``agg`` = ``loss_agg_mode``
(:mod:`hybridrl.algos.aggregation`: denominators counted over the whole batch, so the parts add up to ``L``).
FSDP averages gradients over the mesh in its reduce-scatter; each micro-batch's backward is therefore of its
contribution times the mesh size, and the sharded gradients end up equal to ``dL/dtheta``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hybridrl.algos import aggregation

Batch = dict[str, torch.Tensor]
LossFn = Callable[[dict[str, torch.Tensor], Batch], tuple[torch.Tensor, dict[str, Any]]]
WIDTH_MULTIPLE = 8


def prepare_batch(batch: Batch) -> Batch:
    """``batch`` plus ``model_input_ids`` ``(b, s)`` (rows rolled to start with their first real token),
    ``model_lengths`` ``(b,)`` and ``response_positions`` ``(b, r)`` (``p + t - 1 - left_pad``).

    Raises:
        ValueError: shapes disagree, or a row is not ``[left pad][tokens][right pad]``.
    """
    ids, mask = batch["input_ids"], batch["attention_mask"].long()
    b, s = ids.shape
    r = batch["responses"].shape[1]
    if mask.shape != ids.shape or batch["responses"].shape[0] != b or r >= s:
        shapes = f"{tuple(ids.shape)}, {tuple(mask.shape)}, {tuple(batch['responses'].shape)}"
        raise ValueError(
            f"batch shapes (input_ids, attention_mask, responses) {shapes} disagree; need (b, s), (b, s), (b, r), r < s"
        )
    left_pad = mask.argmax(dim=1)
    index = (torch.arange(s, device=ids.device).unsqueeze(0) + left_pad.unsqueeze(1)) % s
    rolled = mask.gather(1, index)
    if bool((rolled[:, 1:] > rolled[:, :-1]).any()):
        row = int((rolled[:, 1:] > rolled[:, :-1]).any(1).nonzero()[0])
        raise ValueError(f"attention_mask row {row} is not [left pad][tokens][right pad]; fix the padding")
    out = dict(batch)
    out["model_input_ids"] = ids.gather(1, index)
    out["model_lengths"] = rolled.sum(1)
    out["response_positions"] = (s - r - 1 - left_pad).unsqueeze(1) + torch.arange(r, device=ids.device)
    return out


def micro_batches(prepared: Batch, size: int) -> list[Batch]:
    """``prepared`` in micro-batches of ``size`` rows (the last one may be shorter), each cut to its longest row
    (rounded up to :data:`WIDTH_MULTIPLE`, at most the full width); cut response positions are clamped."""
    b, s = prepared["model_input_ids"].shape
    parts = []
    for start in range(0, b, size):
        part = {k: v[start : start + size] if isinstance(v, torch.Tensor) and v.dim() and len(v) == b else v
                for k, v in prepared.items()}  # fmt: skip
        longest = max(int(part["model_lengths"].max()), 1)
        width = min(s, -(-longest // WIDTH_MULTIPLE) * WIDTH_MULTIPLE)
        part["model_input_ids"] = part["model_input_ids"][:, :width]
        part["response_positions"] = part["response_positions"].clamp(max=width - 1)
        parts.append(part)
    return parts


def _outputs(model: torch.nn.Module, mb: Batch, temperature: float) -> torch.Tensor:
    return model(mb["model_input_ids"], mb["response_positions"], mb.get("responses"), temperature)


@torch.no_grad()
def forward(model: torch.nn.Module, batch: Batch, micro_batch_size: int, temperature: float = 1.0) -> torch.Tensor:
    """The model's per-response-token outputs for this rank's batch: ``(b, r)`` fp32 (values, or log-probs of
    ``responses`` at ``temperature``); meaningless at response padding. Collective over the FSDP mesh: a rank
    with fewer micro-batches than another repeats its last one (FSDP's gathers pair up layer by layer)."""
    prepared = prepare_batch(batch)
    b = prepared["input_ids"].shape[0]
    if b == 0:
        raise ValueError("an empty batch reached the FSDP forward; the dispatch pads every rank to >= 1 row")
    parts = micro_batches(prepared, max(1, micro_batch_size))
    outs = [_outputs(model, mb, temperature) for mb in parts]
    for _ in range(_agreed_count(len(parts), prepared["input_ids"].device) - len(parts)):
        _outputs(model, parts[-1], temperature)
    return torch.cat(outs)


def _agreed_count(count: int, device: torch.device) -> int:
    """The most micro-batches any rank runs."""
    t = torch.tensor([count], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t)


@dataclass
class StepOutput:
    """What :func:`forward_backward` returns on every rank."""

    loss: float
    """The aggregated loss of the global batch (the same on every rank)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Each scalar metric of ``loss_fn``: mean over micro-batches, then over ranks."""


def forward_backward(
    model: torch.nn.Module,
    batch: Batch,
    loss_fn: LossFn,
    micro_batch_size: int,
    *,
    output_key: str = "values",
    loss_agg_mode: str = "token-mean",
    loss_scale_factor: float | None = None,
    group: Any = None,
) -> StepOutput:
    """Forward and backward this rank's part of one optimizer step's batch (module docs for the loss).

    Args:
        model: the FSDP-sharded :class:`~hybridrl.fsdp.model.TokenModel`.
        batch: the local batch (module docs) plus what ``loss_fn`` reads, ``response_mask`` ``(b, r)`` included.
        loss_fn: ``(outputs, micro_batch) -> (per_token_loss (mb, r), metrics)``; ``outputs[output_key]`` is
            the model's ``(mb, r)`` output.
        micro_batch_size: rows per micro-batch; must divide ``b`` (the same count on every rank).
        loss_agg_mode / loss_scale_factor: :mod:`hybridrl.algos.aggregation`.
        group: the data-parallel group (None: the world, the FSDP mesh).

    Returns:
        :class:`StepOutput` with the global loss and metrics on every rank; the gradients are in the shards.
    """
    aggregation.check_mode(loss_agg_mode, loss_scale_factor)
    prepared = prepare_batch(batch)
    b = prepared["input_ids"].shape[0]
    if micro_batch_size < 1 or b % micro_batch_size:
        raise ValueError(f"micro_batch_size ({micro_batch_size}) must divide the local batch size ({b})")
    mask = prepared["response_mask"]
    count = aggregation.local_count(mask, loss_agg_mode).reshape(1)
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if aggregation.get_mode(loss_agg_mode).counts and world > 1:
        dist.all_reduce(count, group=group)
    denominator = aggregation.denominator(count[0], loss_agg_mode, loss_scale_factor)
    parts = micro_batches(prepared, micro_batch_size)
    contributions, metrics = [], []
    for mb in parts:
        per_token, m = loss_fn({output_key: _outputs(model, mb, 1.0)}, mb)
        loss = aggregation.aggregate(per_token, mb["response_mask"], loss_agg_mode, denominator)
        (loss * world).backward()  # FSDP's reduce-scatter averages over the mesh: the sum is dL/dtheta
        contributions.append(loss.detach().double())
        metrics.append({k: float(v) for k, v in m.items() if torch.as_tensor(v).numel() == 1})
    keys = sorted(metrics[0]) if metrics else []
    vec = torch.tensor([float(sum(contributions)), *(sum(m[k] for m in metrics) / len(metrics) for k in keys)],
                       dtype=torch.float64, device=mask.device)  # fmt: skip
    if world > 1:
        dist.all_reduce(vec, group=group)
    vec[1:] /= world
    values = vec.tolist()
    return StepOutput(loss=values[0], metrics=dict(zip(keys, values[1:], strict=True)))
