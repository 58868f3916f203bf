"""RLHF computation on Megatron model chunks: padded batches through the pipeline schedules, per-token heads.

What a role worker calls to turn a (local data-parallel) batch into per-token quantities and gradients:

- :func:`forward_backward`: micro-batches through Megatron's ``get_forward_backward_func()`` with a
  caller-supplied per-token loss; the loss is scaled so that gradients equal those of ONE aggregated loss
  over the GLOBAL batch, however it is split over micro-batches and data-parallel ranks (see
  :mod:`hybridrl.mcore.loss_scaling`);
- :func:`compute_log_probs`, :func:`compute_values`, :func:`forward_outputs`: forward-only, results
  ``(batch, response)`` on every rank (taken from the last pipeline stage, broadcast over the PP group,
  optionally gathered over DP).

Batch layout (what rollout produces): ``input_ids``, ``attention_mask``, ``position_ids`` ``(b, s)`` with the
prompt LEFT-padded to ``p = s - r`` and the response RIGHT-padded, and ``responses`` ``(b, r)``. The
log-prob of response token ``t`` comes from the logits at sequence position ``p + t - 1``.

Padding never reaches a valid token: each row is rolled left by its number of left-pad tokens before the
model, so Megatron's RoPE (which uses positions ``0..s-1`` and ignores ``position_ids``) sees exactly
``position_ids = cumsum(mask) - 1`` (the batch's ``position_ids`` are therefore not read), and the attention
mask is causal + key padding (see :func:`attention_mask`). The heads gather the output at the rolled
response positions.

After the roll every row is ``[tokens][padding]``, so the columns past the longest row are padding for all
rows and :func:`trim_padding` drops them before the model (each micro-batch to its own longest row, or the
whole batch to one width under pipeline parallelism, whose p2p buffers have one shape). Without pipeline
parallelism the rows are first grouped by length (:func:`group_by_length`; results come back in the caller's
order), so that short rows share micro-batches with short rows. Rollout batches are
padded to ``max_prompt_length + response_length``; real prompts and responses are usually much shorter, and
the saving grows with the square of the width in attention. Outputs at valid tokens are unchanged.

Prompt sharing (``share_prefix``): the responses of one prompt (GRPO/RLOO groups, rows with equal prompt
columns) run as one packed row per micro-batch, the prompt computed once (:mod:`hybridrl.mcore.prefix_share`);
heads, losses and their aggregation see the same per-response tensors ``(mb, r)`` as without it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.utils import get_model_config

from hybridrl.algos.aggregation import aggregate, check_mode
from hybridrl.mcore import moe, prefix_share, response_logits, routing
from hybridrl.mcore.gpt import run_schedule
from hybridrl.mcore.heads import LogProbHead, TokenHead, ValuesHead, gather_response
from hybridrl.mcore.loss_scaling import global_denominator, grad_reduce_mean_factor

__all__ = ["LogProbHead", "StepOutput", "TokenHead", "ValuesHead", "compute_log_probs", "compute_values",
           "forward_backward", "forward_outputs", "gather_response", "prepare_batch"]  # fmt: skip
Batch = Mapping[str, torch.Tensor]
REQUIRED_KEYS = ("input_ids", "attention_mask", "responses")


def attention_mask(valid: torch.Tensor) -> torch.Tensor:
    """Megatron's boolean attention mask (True = masked) for padded rows: ``(b, 1, s, s)``.

    ``masked[i, q, k] = (k > q) or not valid[i, k]``, except that the diagonal is never masked: a padding
    query row would otherwise be fully masked (NaN softmax in fused kernels). Such rows only produce
    outputs at padding positions, which nothing reads; valid queries never see padding keys.

    Args:
        valid: ``(b, s)`` attention mask, nonzero on real tokens.
    """
    s = valid.shape[1]
    ones = torch.ones(s, s, dtype=torch.bool, device=valid.device)
    causal = torch.triu(ones, diagonal=1)
    masked = causal.unsqueeze(0) | ~valid.bool().unsqueeze(1)
    masked &= ~torch.eye(s, dtype=torch.bool, device=valid.device)
    return masked.unsqueeze(1)


def prepare_batch(batch: Batch) -> dict[str, torch.Tensor]:
    """Model inputs for a padded batch: rows rolled so that each starts with its first real token.

    Args:
        batch: ``input_ids``, ``attention_mask`` ``(b, s)`` and ``responses`` ``(b, r)`` (see module docs).

    Returns:
        ``batch`` plus ``model_input_ids``, ``model_position_ids`` ``(b, s)``, ``model_attention_mask``
        ``(b, 1, s, s)`` bool, and ``response_positions`` ``(b, r)``: the index into the model output's
        sequence dim whose prediction is response token ``t`` (``p + t - 1 - left_pad``).
    """
    missing = [k for k in REQUIRED_KEYS if k not in batch]
    if missing:
        raise KeyError(
            f"batch lacks {missing}; a compute batch needs {list(REQUIRED_KEYS)} (see hybridrl.mcore.compute)"
        )
    ids, mask = batch["input_ids"], batch["attention_mask"].long()
    b, s = ids.shape
    r = batch["responses"].shape[1]
    if mask.shape != ids.shape or batch["responses"].shape[0] != b or r >= s:
        raise ValueError(
            f"batch shapes input_ids {tuple(ids.shape)}, attention_mask {tuple(mask.shape)}, responses "
            f"{tuple(batch['responses'].shape)} disagree; need (b, s), (b, s), (b, r) with r < s"
        )
    prompt_len = s - r
    if not bool(mask[:, prompt_len - 1].all()):
        row = int((mask[:, prompt_len - 1] == 0).nonzero()[0])
        raise ValueError(f"batch row {row} has no prompt token at position {prompt_len - 1}; left-pad prompts")
    tail_valid = mask[:, prompt_len:].bool()
    if bool((batch["responses"] != ids[:, prompt_len:])[tail_valid].any()):
        row = int(((batch["responses"] != ids[:, prompt_len:]) & tail_valid).any(1).nonzero()[0])
        raise ValueError(
            f"batch['responses'] row {row} differs from input_ids[:, -r:]; responses must end the sequence"
        )
    left_pad = mask.argmax(dim=1)  # index of the first real token
    index = (torch.arange(s, device=ids.device).unsqueeze(0) + left_pad.unsqueeze(1)) % s
    rolled_mask = mask.gather(1, index)
    if bool((rolled_mask[:, 1:] > rolled_mask[:, :-1]).any()):
        row = int((rolled_mask[:, 1:] > rolled_mask[:, :-1]).any(1).nonzero()[0])
        raise ValueError(f"attention_mask row {row} is not [left pad][tokens][right pad]; fix the padding")
    out = dict(batch)
    out["model_input_ids"] = ids.gather(1, index)
    out["model_position_ids"] = (rolled_mask.cumsum(1) - 1).clamp(min=0)
    out["model_attention_mask"] = attention_mask(rolled_mask)
    out["response_positions"] = (prompt_len - 1 - left_pad).unsqueeze(1) + torch.arange(r, device=ids.device)
    out["model_lengths"] = rolled_mask.sum(1)
    return out


def trim_padding(batch: dict[str, torch.Tensor], multiple: int = 8) -> dict[str, torch.Tensor]:
    """``batch`` (from :func:`prepare_batch`) with the model inputs cut to its longest row, rounded up to
    ``multiple`` (at most the full width).

    The dropped columns are padding in every row and come after every valid token, which attends only to
    earlier positions: outputs at valid tokens do not change. Response positions past the cut (response
    padding, whose outputs are meaningless anyway) are clamped to the last kept column.
    """
    s = batch["model_input_ids"].shape[1]
    longest = int(batch["model_lengths"].max()) if batch["model_lengths"].numel() else s
    width = min(s, -(-max(longest, 1) // multiple) * multiple)
    if width == s:
        return batch
    out = dict(batch)
    out["model_input_ids"] = batch["model_input_ids"][:, :width]
    out["model_position_ids"] = batch["model_position_ids"][:, :width]
    out["model_attention_mask"] = batch["model_attention_mask"][:, :, :width, :width].contiguous()  # kernels
    out["response_positions"] = batch["response_positions"].clamp(max=width - 1)
    return out


def micro_batches_trimmed(chunks, batch: dict[str, torch.Tensor], micro_batch_size: int, trim: bool = True):
    """:func:`split_micro_batches` of ``batch`` with :func:`trim_padding` applied: to each micro-batch without
    pipeline parallelism, to the whole batch with it (every micro-batch one shape). The width is a multiple of
    8 (and of TP under sequence parallelism, which splits the sequence over TP)."""
    if not trim:
        return split_micro_batches(batch, micro_batch_size)
    if moe.expert_parallel(chunks):  # EP peers exchange tokens in every layer: one width for all of them
        moe.check_equal_width(batch["model_input_ids"].shape[1])
        return split_micro_batches(batch, micro_batch_size)
    multiple = _width_multiple(chunks)
    if _one_width(chunks):
        return split_micro_batches(trim_padding(batch, multiple), micro_batch_size)
    return [trim_padding(mb, multiple) for mb in split_micro_batches(batch, micro_batch_size)]


def _width_multiple(chunks) -> int:
    """Model input widths are multiples of 8, and of TP under sequence parallelism (which splits the sequence)."""
    if get_model_config(chunks[0]).sequence_parallel:
        return math.lcm(8, mpu.get_tensor_model_parallel_world_size())
    return 8


def _one_width(chunks) -> bool:
    """Pipeline parallelism: p2p buffers have one shape, so every micro-batch has the same width."""
    return mpu.get_pipeline_model_parallel_world_size() > 1 or len(chunks) > 1 or moe.expert_parallel(chunks)


def group_by_length(chunks, batch: dict[str, torch.Tensor], trim: bool = True):
    """``(batch, order)``: the rows reordered shortest first, so that rows of similar length share micro-batches
    and each micro-batch's trimmed width is close to its rows' lengths, and the order applied (``batch[order]``);
    ``(batch, None)`` where it would not help: trimming off, one width for all micro-batches, rows in order.

    Reordering rows changes no loss or gradient: the aggregation is over the whole batch (denominators from
    the whole batch, per-sequence terms per row); only per-micro-batch metric means and float summation order
    differ.
    """
    if not trim or _one_width(chunks):
        return batch, None
    order = torch.argsort(batch["model_lengths"], stable=True)
    if bool((order[1:] > order[:-1]).all()):
        return batch, None
    b = batch["input_ids"].shape[0]
    rows = {k: v[order] if isinstance(v, torch.Tensor) and v.dim() and len(v) == b else v for k, v in batch.items()}
    return rows, order


def split_micro_batches(batch: dict[str, torch.Tensor], micro_batch_size: int) -> list[dict[str, torch.Tensor]]:
    """Split every tensor of ``batch`` whose first dim is the batch size into micro-batches of that size.

    Equal sizes are required: pipeline p2p buffers have one shape for all micro-batches.
    """
    b = batch["input_ids"].shape[0]
    if micro_batch_size < 1 or b % micro_batch_size:
        raise ValueError(f"micro_batch_size ({micro_batch_size}) must divide the local batch size ({b})")
    n = b // micro_batch_size
    parts: list[dict[str, torch.Tensor]] = [{} for _ in range(n)]
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == b:
            for i, piece in enumerate(value.split(micro_batch_size)):
                parts[i][key] = piece
        else:
            for part in parts:
                part[key] = value
    return parts


def _pad_rows(batch: dict[str, torch.Tensor], pad: int) -> dict[str, torch.Tensor]:
    """``batch`` with ``pad`` copies of its last row appended to every tensor whose first dim is the batch."""
    b = batch["input_ids"].shape[0]
    if not pad:
        return batch
    return {
        k: torch.cat([v, v[-1:].expand(pad, *v.shape[1:])]) if isinstance(v, torch.Tensor) and v.dim() and len(v) == b
        else v
        for k, v in batch.items()
    }  # fmt: skip


LossFn = Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, Any]]]


@dataclass
class StepOutput:
    """What :func:`forward_backward` returns on every rank."""

    loss: float
    """The aggregated loss of the global batch (same value on every rank)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Each scalar metric of ``loss_fn``: mean over micro-batches and data-parallel ranks."""
    micro_batch_metrics: list[dict[str, Any]] = field(default_factory=list)
    """The raw metrics of each local micro-batch (last pipeline stage only; empty elsewhere)."""


def _run_schedule(chunks, micro_batches, loss_func, forward_only: bool, selector=None) -> list[Any]:
    seq, mb = micro_batches[0]["model_input_ids"].shape[1], micro_batches[0]["model_input_ids"].shape[0]

    def step(data_iterator, model):
        batch = next(data_iterator)
        if selector is not None:  # the output layer runs on this micro-batch's response positions only
            selector.set(batch)
        with routing.route(model, batch):  # MoE: the rollout's routes, replayed and/or compared (no-op without)
            output = model(batch["model_input_ids"], batch["model_position_ids"], batch["model_attention_mask"])
        return output, lambda output_tensor: loss_func(output_tensor, batch)

    return run_schedule(chunks, micro_batches, step, forward_only, seq=seq, micro_batch_size=mb)


def _bind(head: TokenHead, chunks) -> TokenHead:
    bind = getattr(head, "bind", None)
    return bind(chunks) if callable(bind) else head


def _check_supported(chunks) -> None:
    config = get_model_config(chunks[0])
    if mpu.get_context_parallel_world_size() > 1:
        raise NotImplementedError("context parallel (cp > 1) is not supported by hybridrl.mcore.compute; set cp=1")
    if config.calculate_per_token_loss:
        raise ValueError("model config calculate_per_token_loss=True is not supported; leave it False (the default)")


def _shared_plan(chunks, prepared, micro_batch_size: int, rows: int, share_prefix: bool | None, trim: bool):
    if share_prefix is None and not trim:  # untrimmed passes (a debugging knob) stay row by row
        return None
    if share_prefix is None and routing.ROUTES_KEY in prepared:  # per-token routes follow rows, not packed rows
        return None
    return prefix_share.choose(chunks, prepared, micro_batch_size, rows, share_prefix, _one_width(chunks),
                               _width_multiple(chunks))  # fmt: skip


def _installed(chunks, shared):
    return prefix_share.installed(chunks) if shared is not None else contextlib.nullcontext()


def _head_input(output: torch.Tensor, micro_batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model output as heads read it: packed outputs become ``(mb, r, ...)`` at the response positions."""
    if micro_batch.get(response_logits.KEY):
        return response_logits.as_responses(output, micro_batch)
    return prefix_share.unpack(output, micro_batch) if "packed_index" in micro_batch else output


@contextlib.contextmanager
def _at_responses(chunks, head, micro_batches):
    """:func:`hybridrl.mcore.response_logits.installed` for a pass, its micro-batches marked when it is active."""
    with response_logits.installed(chunks, response_logits.usable(chunks, head)) as selector:
        if selector is not None:
            for micro_batch in micro_batches:
                micro_batch[response_logits.KEY] = True
        yield selector


def forward_backward(
    chunks: list[torch.nn.Module],
    batch: Batch,
    loss_fn: LossFn,
    micro_batch_size: int,
    forward_only: bool = False,
    *,
    head: TokenHead | None = None,
    loss_agg_mode: str = "token-mean",
    loss_scale_factor: float | None = None,
    response_mask_key: str = "response_mask",
    trim: bool = True,
    share_prefix: bool | None = False,
) -> StepOutput:
    """Forward (and backward) this rank's data-parallel batch through the pipeline schedule.

    The loss of the GLOBAL batch ``B`` (all micro-batches of all DP ranks) is
    ``L = agg_{i in B}(loss_fn(head(model(x_i))), mask_i)`` with ``agg`` = ``loss_agg_mode`` (formulas in
    :mod:`hybridrl.algos.aggregation`); gradients accumulated in the parameters are ``dL/dtheta`` summed
    over micro-batches, and become the gradient of ``L`` once summed over DP ranks (the optimizer does that;
    under Megatron's DDP, which averages, the loss is pre-multiplied by the DP size).

    Call it once per optimizer step: the denominators are counted on this call's batch.

    Args:
        chunks: this rank's model chunks (plain or wrapped in Megatron DDP).
        batch: the local DP batch (module docs) plus whatever ``loss_fn`` reads, every tensor ``(b, ...)``;
            ``response_mask`` ``(b, r)`` defaults to ``attention_mask[:, -r:]``. Same on all PP/TP ranks.
        loss_fn: ``(outputs, micro_batch) -> (per_token_loss (mb, r), metrics)``; ``outputs`` are the head's
            tensors ``(mb, r)`` (``log_probs``/``entropy`` by default), metrics are scalars.
        micro_batch_size: samples per micro-batch; must divide ``b``.
        forward_only: no backward (e.g. a validation loss).
        head: :class:`LogProbHead` (default), :class:`ValuesHead` or any :class:`TokenHead`.
        loss_agg_mode: one of ``hybridrl.algos.aggregation.AGG_MODES``.
        loss_scale_factor: the constant "seq-mean-token-sum-norm" divides by (e.g. the maximum response length).
        response_mask_key: the batch key of the response mask.
        trim: drop the batch's trailing padding columns before the model (:func:`trim_padding`).
        share_prefix: compute each prompt once for the rows that share it (module docs): ``True`` wherever some
            micro-batch holds two rows of one prompt, ``None`` (auto) where that also runs fewer tokens (and the
            model allows it, see :func:`hybridrl.mcore.prefix_share.unsupported`), ``False`` never.

    Returns:
        :class:`StepOutput` with the global loss and metrics on every rank.
    """
    check_mode(loss_agg_mode, loss_scale_factor)  # on every rank, before any collective
    _check_supported(chunks)
    head = _bind(head or LogProbHead(), chunks)
    prepared = prepare_batch(batch)
    r = prepared["responses"].shape[1]
    if response_mask_key not in prepared:
        prepared[response_mask_key] = prepared["attention_mask"][:, -r:]
    b = prepared["input_ids"].shape[0]
    if micro_batch_size < 1 or b % micro_batch_size:
        raise ValueError(f"micro_batch_size ({micro_batch_size}) must divide the local batch size ({b})")
    shared = _shared_plan(chunks, prepared, micro_batch_size, b, share_prefix, trim)
    if shared is None:
        prepared, _ = group_by_length(chunks, prepared, trim)
        micro_batches = micro_batches_trimmed(chunks, prepared, micro_batch_size, trim)
    else:
        micro_batches = shared.micro_batches
    last_stage = mpu.is_pipeline_last_stage(ignore_virtual=True)
    dp_group = mpu.get_data_parallel_group()
    mask = prepared[response_mask_key]
    denominator = global_denominator(mask, loss_agg_mode, dp_group, loss_scale_factor) if last_stage else None
    scale = len(micro_batches) * grad_reduce_mean_factor(chunks)
    contributions: list[torch.Tensor] = []
    routing.clear()

    def loss_func(output, micro_batch):
        outputs = head(_head_input(output, micro_batch), micro_batch)
        per_token, metrics = loss_fn(outputs, micro_batch)
        loss = aggregate(per_token, micro_batch[response_mask_key], loss_agg_mode, denominator)
        contributions.append(loss.detach())
        return loss * scale, metrics

    with (
        torch.no_grad() if forward_only else torch.enable_grad(),
        _installed(chunks, shared),
        _at_responses(chunks, head, micro_batches) as selector,
    ):
        mb_metrics = _run_schedule(chunks, micro_batches, loss_func, forward_only, selector)
    loss, metrics = _reduce_step_metrics(contributions, mb_metrics if last_stage else [], dp_group)
    metrics.update(moe.aux_loss_metrics(get_model_config(chunks[0]), len(micro_batches)))  # MoE only
    metrics.update(routing.mismatch_metrics(get_model_config(chunks[0])))  # MoE with rollout routes only
    return StepOutput(loss=loss, metrics=metrics, micro_batch_metrics=mb_metrics if last_stage else [])


def _reduce_step_metrics(contributions, mb_metrics, dp_group) -> tuple[float, dict[str, float]]:
    """Global loss (sum over DP) and metric means (over micro-batches, then DP), on every rank."""
    result: list[Any] = [None]
    if mpu.is_pipeline_last_stage(ignore_virtual=True):
        keys = sorted(
            k for k in (mb_metrics[0] if mb_metrics else {}) if torch.as_tensor(mb_metrics[0][k]).numel() == 1
        )
        # stacked on the device and read back once: a float() per micro-batch and metric is a GPU sync each
        device = contributions[0].device if contributions else None
        f64 = dict(dtype=torch.float64, device=device)
        loss = torch.stack([c.to(**f64).reshape(()) for c in contributions]).sum() if contributions else None
        means = [torch.stack([torch.as_tensor(m[k]).to(**f64).reshape(()) for m in mb_metrics]).mean() for k in keys]
        vec = torch.stack([loss if loss is not None else torch.zeros((), **f64), *means])
        dp = dist.get_world_size(dp_group)
        if dp > 1:
            dist.all_reduce(vec, group=dp_group)
        vec[1:] /= dp
        values = vec.tolist()
        result = [(values[0], dict(zip(keys, values[1:], strict=True)))]
    if mpu.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast_object_list(
            result, src=mpu.get_pipeline_model_parallel_last_rank(), group=mpu.get_pipeline_model_parallel_group()
        )
    return result[0]


def forward_outputs(
    chunks: list[torch.nn.Module],
    batch: Batch,
    micro_batch_size: int,
    head: TokenHead,
    gather_dp: bool = False,
    trim: bool = True,
    share_prefix: bool | None = False,
) -> dict[str, torch.Tensor]:
    """Forward-only ``head`` outputs for the local batch, on every rank.

    Args:
        chunks, batch: as in :func:`forward_backward`.
        micro_batch_size: samples per micro-batch; need not divide ``b`` (the last one is padded).
        head: which per-token tensors to compute (its ``keys`` name them).
        gather_dp: concatenate the results of all DP ranks (in DP-rank order) instead of the local ones.
        trim: drop the batch's trailing padding columns before the model (:func:`trim_padding`).
        share_prefix: compute each prompt once for the rows that share it (see :func:`forward_backward`).

    Returns:
        ``{key: (b, r) fp32}`` (``(b * dp, r)`` with ``gather_dp``), identical on every TP/PP rank.
        Values at response padding are computed but meaningless.
    """
    _check_supported(chunks)
    head = _bind(head, chunks)
    prepared = prepare_batch(batch)
    b, r = prepared["responses"].shape
    # Forward-only, so a batch that micro_batch_size does not divide (a validation tail, ReMax's greedy
    # baselines, any reference / reward-model micro-batch size) is padded with copies of its last row,
    # whose outputs are dropped below; pipeline buffers need equal micro-batches, and Megatron's interleaved
    # (virtual pipeline) schedule a multiple of pp of them.
    micro_batch_size = max(1, min(micro_batch_size, b))
    count = -(-b // micro_batch_size)
    if len(chunks) > 1:
        pp = mpu.get_pipeline_model_parallel_world_size()
        count = -(-count // pp) * pp
    shared = _shared_plan(chunks, prepared, micro_batch_size, count * micro_batch_size, share_prefix, trim)
    if shared is None:
        prepared, order = group_by_length(chunks, prepared, trim)
        micro_batches = micro_batches_trimmed(chunks, _pad_rows(prepared, count * micro_batch_size - b),
                                              micro_batch_size, trim)  # fmt: skip
    else:
        micro_batches, order = shared.micro_batches, shared.order

    def loss_func(output, micro_batch):
        outputs = head(_head_input(output, micro_batch), micro_batch)
        return output.new_zeros(()), {k: outputs[k].detach().float() for k in head.keys}

    with torch.no_grad(), _installed(chunks, shared), _at_responses(chunks, head, micro_batches) as selector:
        collected = _run_schedule(chunks, micro_batches, loss_func, True, selector)
    if mpu.is_pipeline_last_stage(ignore_virtual=True):
        stacked = torch.stack([torch.cat([c[k] for c in collected])[:b] for k in head.keys])
        if order is not None:  # back to the caller's row order
            stacked = stacked[:, torch.argsort(order.to(stacked.device))]
    else:
        stacked = torch.empty(len(head.keys), b, r, dtype=torch.float32, device=prepared["input_ids"].device)
    if mpu.get_pipeline_model_parallel_world_size() > 1:
        src = mpu.get_pipeline_model_parallel_last_rank()
        dist.broadcast(stacked, src=src, group=mpu.get_pipeline_model_parallel_group())
    if gather_dp and mpu.get_data_parallel_world_size() > 1:
        stacked = _gather_dp(stacked)
    return dict(zip(head.keys, stacked.unbind(0), strict=True))


def _gather_dp(stacked: torch.Tensor) -> torch.Tensor:
    """Concatenate ``(k, b_i, r)`` over DP ranks along dim 1 (local batch sizes may differ)."""
    group = mpu.get_data_parallel_group()
    world = dist.get_world_size(group)
    size = torch.tensor([stacked.shape[1]], device=stacked.device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = int(max(s.item() for s in sizes))
    padded = torch.nn.functional.pad(stacked, (0, 0, 0, longest - stacked.shape[1]))
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[:, : int(n.item())] for p, n in zip(parts, sizes, strict=True)], dim=1)


def compute_log_probs(
    chunks: list[torch.nn.Module],
    batch: Batch,
    micro_batch_size: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    gather_dp: bool = False,
    vocab_size: int | None = None,
    share_prefix: bool | None = False,
) -> dict[str, torch.Tensor]:
    """Per-token log-probs of ``batch['responses']`` (and entropy): ``{'log_probs': (b, r), ...}`` on every rank.

    The softmax runs over the model's true vocabulary (``vocab_size=None``: taken from the model, see
    :class:`LogProbHead`), at ``temperature`` (pass the rollout's for PPO's old log-probs); ``share_prefix`` as in
    :func:`forward_backward`.
    """
    head = LogProbHead(temperature=temperature, with_entropy=with_entropy, vocab_size=vocab_size)
    return forward_outputs(chunks, batch, micro_batch_size, head, gather_dp, share_prefix=share_prefix)


def compute_values(
    chunks: list[torch.nn.Module],
    batch: Batch,
    micro_batch_size: int,
    gather_dp: bool = False,
    share_prefix: bool | None = False,
) -> torch.Tensor:
    """Critic values at the response tokens: ``(b, r)`` fp32 on every rank (critic output ``(mb, s, 1)``)."""
    out = forward_outputs(chunks, batch, micro_batch_size, ValuesHead(), gather_dp, share_prefix=share_prefix)
    return out["values"]
