"""Prompt-shared forward passes: the n responses of a prompt computed on ONE copy of its prompt.

GRPO / RLOO sample ``n`` responses per prompt, and the rollout lays them out adjacent. Row by row, the model
runs the same prompt ``n`` times; here each group of rows with the same prompt becomes one PACKED row

    [prompt][pad] [response_1][pad] [response_2][pad] ... [response_K][pad]
     Pw columns    Rw columns        Rw columns             Rw columns       (L = Pw + K * Rw)

in which every response attends to the prompt and to itself only, and response token ``t`` sits at RoPE position
``len(prompt) + t``, as in its own row. Every response token therefore sees exactly the keys, values and
positions it sees unpacked, so log-probs, values and gradients are those of the unpacked rows up to float
summation order (the prompt's gradient is the sum over its responses, which is what the unpacked rows' sum
of duplicated prompts gives).

The attention is computed on the structure, not through a dense ``L x L`` mask: prompt queries against prompt
keys (``Pw x Pw``), each response's queries against ``[prompt, own response]`` (``Rw x (Pw + Rw)``), which is
``Pw^2 + K Rw (Pw + Rw)`` scores instead of ``L^2``; :class:`SharedPrefixAttention` replaces Megatron's core
attention in every layer while a packed pass runs (:func:`installed`). Its mask is ``(G, K, Rw, Pw + Rw)``
bool (True = masked): query ``t`` of slot ``k`` against the prompt columns then its slot's columns; the
shape alone gives the layout, so activation recompute (which re-runs layers on saved inputs) needs nothing else.
Megatron's GPTModel evaluates RoPE at positions ``0..L-1`` whatever ``position_ids`` says; while installed, a
hook on its rotary module returns the same table gathered at each packed row's ``position_ids`` instead.

:func:`plan` turns a prepared batch (``hybridrl.mcore.compute.prepare_batch``) into packed micro-batches:
rows grouped by prompt (identical prompt tokens, whatever their ``uid``), the groups of a micro-batch packed one
per row; each micro-batch keeps its rows' per-response tensors (``responses``, masks, advantages, ...) for the
heads and the loss, and :func:`unpack` gives the heads the model output at the response positions as
``(rows, r, ...)``. Under pipeline parallelism every micro-batch gets one shape (p2p buffers): the widths and
the packed-row count are the batch's maxima, short micro-batches repeat their last packed row.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.attention import SelfAttention
from megatron.core.utils import get_model_config


def unsupported(chunks: list[torch.nn.Module]) -> str | None:
    """Why the packed pass cannot reproduce this model's unpacked one (None: it can)."""
    config = get_model_config(chunks[0])
    models = [m for c in chunks for m in c.modules() if isinstance(m, GPTModel)]
    checks = (
        (not models, "the chunks hold no Megatron GPTModel"),
        (any(m.position_embedding_type != "rope" for m in models), "position embeddings other than RoPE"),
        (config.window_size is not None, "sliding-window attention"),
        (config.multi_latent_attention, "multi-latent attention"),
        (config.softmax_type != "vanilla", f"softmax_type {config.softmax_type!r}"),
        (config.apply_rope_fusion, "apply_rope_fusion=True (the fused kernel takes one position table per batch)"),
        (config.apply_query_key_layer_scaling, "apply_query_key_layer_scaling"),
        (config.attention_dropout > 0, f"attention_dropout {config.attention_dropout}"),
        (config.context_parallel_size > 1, "context parallelism"),
        (config.expert_model_parallel_size > 1, "expert parallelism (EP peers must run equal token counts)"),
    )
    return next((why for bad, why in checks if bad), None)


# ---- planning: rows -> packed micro-batches ------------------------------------------------------------
def group_ids(batch: dict[str, torch.Tensor]) -> list[int]:
    """Per row, the index of its prompt among the batch's distinct prompts (numbered by first appearance).

    Two rows share a prompt when their prompt columns (``input_ids[:, :s - r]``, padding included) are equal:
    the same tokens, hence the same left padding.
    """
    p = batch["input_ids"].shape[1] - batch["responses"].shape[1]
    prompts = torch.where(batch["attention_mask"][:, :p].bool(), batch["input_ids"][:, :p], -1)
    _, inverse = torch.unique(prompts, dim=0, return_inverse=True)
    first: dict[int, int] = {}
    return [first.setdefault(g, len(first)) for g in inverse.tolist()]


@dataclass
class Plan:
    """Packed micro-batches of a batch (see :func:`plan`)."""

    micro_batches: list[dict[str, torch.Tensor]]
    """Per micro-batch: its rows' per-row tensors ``(rows, ...)`` plus the packed model inputs (module docs)."""
    order: torch.Tensor
    """The batch's rows in micro-batch order (padding rows excluded): ``cat(micro-batch rows)[:b] = batch[order]``."""
    tokens: int
    """Token columns the model runs over: sum of packed rows x width."""
    unshared_tokens: int
    """The same for the unpacked micro-batches (each cut to its longest row), for the auto decision."""
    shared_responses: int
    """Responses that share a packed row with another response."""


def choose(
    chunks, prepared, micro_batch_size: int, rows: int, share: bool | None, one_width: bool, multiple: int = 8
) -> Plan | None:
    """The :func:`plan` of a pass with prompt sharing ``share``, or None where the pass runs unshared rows.

    ``True``: packed wherever some micro-batch holds two rows of one prompt (an error where the model cannot
    be packed exactly, see :func:`unsupported`); ``None`` (auto): packed where that also runs fewer token
    columns than the unshared rows and the model allows it; ``False``: never.
    """
    if share is False:
        return None
    why = unsupported(chunks)
    if why is not None:
        if share:
            raise ValueError(
                f"actor.share_prompt_prefix (true) cannot reproduce this model's unshared pass: {why}; set it to "
                "null (auto) or false"
            )
        return None
    packed = plan(prepared, micro_batch_size, rows, one_width, multiple)
    if packed.shared_responses == 0 or (share is None and packed.tokens >= packed.unshared_tokens):
        return None
    return packed


def _round(width: int, multiple: int) -> int:
    return -(-max(width, 1) // multiple) * multiple


def _runs(groups: list[int], rows: range) -> list[list[int]]:
    """Consecutive rows of one group (micro-batch-local indices) -> one packed row each."""
    runs: list[list[int]] = []
    for i in rows:
        if runs and groups[rows.start + runs[-1][0]] == groups[i]:
            runs[-1].append(i - rows.start)
        else:
            runs.append([i - rows.start])
    return runs


def plan(
    prepared: dict[str, torch.Tensor], micro_batch_size: int, rows: int, one_width: bool, multiple: int = 8
) -> Plan:
    """Packed micro-batches of ``micro_batch_size`` rows over a prepared batch padded to ``rows`` rows.

    Rows are ordered by group (groups by prompt length, then first appearance), padded with copies of the last
    one up to ``rows`` (forward-only passes whose micro-batch size does not divide the batch), and cut into
    micro-batches; each micro-batch packs each of its groups into one row. A group cut by a micro-batch boundary
    is packed once per side. ``one_width``: every micro-batch has the batch's widths and packed-row count.
    """
    b = prepared["input_ids"].shape[0]
    r = prepared["responses"].shape[1]
    resp_len = prepared["attention_mask"][:, -r:].sum(1)
    prompt_len = prepared["model_lengths"] - resp_len
    groups = group_ids(prepared)
    plen, rlen = prompt_len.tolist(), resp_len.tolist()
    order = sorted(range(b), key=lambda i: (plen[i], groups[i]))  # stable: rows of a group keep their order
    order += [order[-1]] * (rows - b)
    groups, plen, rlen = [groups[i] for i in order], [plen[i] for i in order], [rlen[i] for i in order]
    spans = [range(s, min(s + micro_batch_size, rows)) for s in range(0, rows, micro_batch_size)]
    runs = [_runs(groups, span) for span in spans]
    widths = [
        (max(plen[span.start + run[0]] for run in rr), max(max(rlen[i] for i in span), 1), max(map(len, rr)), len(rr))
        for span, rr in zip(spans, runs, strict=True)
    ]
    if one_width:
        widths = [tuple(max(w[j] for w in widths) for j in range(4))] * len(spans)
    index = torch.tensor(order, device=prepared["input_ids"].device)
    micro_batches, tokens = [], 0
    for span, rr, (pw, rw, k, g) in zip(spans, runs, widths, strict=True):
        pw = _round(pw + k * rw, multiple) - k * rw  # L a multiple of `multiple`: the extra columns go to the prompt
        idx = index[span.start : span.stop]
        micro = {key: v[idx] if isinstance(v, torch.Tensor) and v.dim() and len(v) == b else v
                 for key, v in prepared.items()}  # fmt: skip
        micro.update(_pack(micro, rr, prompt_len[idx], resp_len[idx], pw, rw, k, g))
        micro_batches.append(micro)
        tokens += g * (pw + k * rw)
    lengths = sorted(p + q for p, q in zip(plen, rlen, strict=True))
    if one_width:
        unshared = rows * _round(lengths[-1], multiple)
    else:
        unshared = sum(len(c) * _round(c[-1], multiple) for c in (lengths[s : s + micro_batch_size] for s in
                                                                   range(0, rows, micro_batch_size)))  # fmt: skip
    shared = sum(len(run) for rr in runs for run in rr if len(run) > 1)
    return Plan(micro_batches, index[:b], tokens, unshared, shared)


def _pack(micro, runs, prompt_len, resp_len, pw: int, rw: int, k: int, g: int) -> dict[str, torch.Tensor]:
    """The packed model inputs of one micro-batch (module docs) and the unpacking index.

    Args:
        micro: the micro-batch's prepared rows (``model_input_ids`` rolled: ``[prompt][response][pad]``).
        runs: per packed row, the micro-batch rows of its group, in slot order.
        prompt_len, resp_len: ``(rows,)`` valid prompt / response tokens per row.
        pw, rw, k, g: prompt width, response slot width, slots and packed rows.
    """
    rolled = micro["model_input_ids"]
    device, s = rolled.device, rolled.shape[1]
    where = [(0, 0)] * prompt_len.shape[0]  # per row: (packed row, slot)
    for j, run in enumerate(runs):
        for slot_k, i in enumerate(run):
            where[i] = (j, slot_k)
    runs = runs + [runs[-1]] * (g - len(runs))  # one shape under PP: repeat the last packed row
    members = torch.tensor([run + [-1] * (k - len(run)) for run in runs], device=device)  # (g, k), -1: empty
    slot, first = members.clamp(min=0), members[:, 0]
    plen = prompt_len[first]  # (g,)
    rlen = torch.where(members >= 0, resp_len[slot], 0)  # (g, k)
    c, t = torch.arange(pw, device=device), torch.arange(rw, device=device)
    p_valid = c < plen[:, None]  # (g, pw)
    s_valid = t < rlen[..., None]  # (g, k, rw)
    p_ids = rolled[first[:, None], c.clamp(max=s - 1)] * p_valid
    r_col = plen[:, None, None] + t  # response token t of a row is at rolled column len(prompt) + t
    s_ids = rolled[slot[..., None], r_col.clamp(max=s - 1)] * s_valid
    # every query sees its prompt's valid keys (at least one), so no row is fully masked
    later = t[None, :] > t[:, None]  # [query, key]: the key comes after the query
    mask = torch.cat([(~p_valid)[:, None, None, :].expand(g, k, rw, pw), later | ~s_valid[:, :, None, :]], dim=-1)
    # unpacking: response token 0 is predicted at the prompt's last token, token t > 0 at slot column t - 1
    where_t = torch.tensor(where, device=device)
    r = micro["responses"].shape[1]
    tt = torch.arange(r, device=device)
    start = pw + where_t[:, 1:] * rw  # (rows, 1)
    pos = torch.where(tt == 0, prompt_len[:, None] - 1, start + tt.clamp(max=rw) - 1)
    return {
        "model_input_ids": torch.cat([p_ids, s_ids.reshape(g, k * rw)], 1),
        "model_position_ids": torch.cat([c * p_valid, r_col.expand(g, k, rw).reshape(g, k * rw)], 1),
        "model_attention_mask": mask,
        "packed_index": where_t[:, :1] * (pw + k * rw) + pos,
        "response_positions": tt.expand(len(where), r),
    }


def unpack(output: torch.Tensor, micro_batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The packed model output ``(G, L, *rest)`` at each row's response positions: ``(rows, r, *rest)``."""
    index = micro_batch["packed_index"]
    flat = output.reshape(-1, *output.shape[2:])
    return flat[index.reshape(-1)].reshape(*index.shape, *output.shape[2:])


# ---- the packed pass: core attention and RoPE positions --------------------------------------------------
class SharedPrefixAttention(torch.nn.Module):
    """Core attention over packed rows (module docs): Megatron's ``DotProductAttention`` math (scaled scores,
    masked softmax, probabilities times values) on the prompt block and on each response's ``[prompt, own]``
    keys, through ``torch.nn.functional.scaled_dot_product_attention``. Query head ``h`` uses key/value group
    ``h // (heads / groups)``, as Megatron's GQA does: the heads of a group are folded into its query rows (the
    mask repeated per head), so the kernel sees plain multi-head attention and no key or value is copied per head.

    The fused kernel does not keep the ``(.., Rw, Pw + Rw)`` probabilities for the backward, only the output's
    log-sum-exp (torch's CPU flash kernel, which takes a boolean mask; the separate matmul / masked_fill / softmax
    ops kept them); it keeps instead its inputs, among them each slot's ``[prompt, own]`` keys and values, copied
    per slot. Per slot that is ``2 d (Pw + Rw)`` floats per key/value group against ``(heads / groups) Rw (Pw + Rw)``
    before: less memory when ``2 d < (heads / groups) Rw``, long responses (23.7M bench model, d 64, two heads per
    group, 64 responses of 128 tokens in groups of 4: 70-210 MiB less at the update's peak), about the same at
    the 0.85M model's 32 tokens. Time: the same within this machine's drift in the trainer; without the trainer's
    allocator settings (which keep freed pages) the separate ops also fault their fresh tensors in, and the kernel
    takes 0.4x their forward and 0.5x their backward time. Masked keys get no weight either way (Megatron fills
    them with -10000, whose ``exp`` is 0 in fp32, the kernel with ``-inf``); every query sees at least its
    prompt's valid keys. The kernel accumulates the softmax in fp32 whatever the input dtype: with
    ``attention_softmax_in_fp32=False`` (a bf16 softmax in Megatron's unpacked pass) the packed pass is the more
    precise of the two."""

    def __init__(self, softmax_scale: float) -> None:
        super().__init__()
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None) -> torch.Tensor:  # fmt: skip
        """``query`` ``[L, G, heads, d]``, ``key``/``value`` ``[L, G, groups, d]``, mask ``(G, K, Rw, Pw + Rw)``:
        context ``[L, G, heads * d]``."""
        if attention_bias is not None or packed_seq_params is not None:
            raise NotImplementedError("SharedPrefixAttention takes neither attention_bias nor packed_seq_params")
        L, g, heads, d = query.shape
        ng = key.shape[2]
        qpg = heads // ng
        k, rw, w = attention_mask.shape[1:]
        pw = w - rw
        if pw + k * rw != L:
            raise RuntimeError(f"packed mask {tuple(attention_mask.shape)} does not fit a sequence of {L}")
        attend = functools.partial(torch.nn.functional.scaled_dot_product_attention, scale=self.softmax_scale)
        q = query.permute(1, 2, 0, 3).unflatten(1, (ng, qpg))  # (G, groups, heads per group, L, d)
        kk, vv = key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3)  # (G, groups, L, d)

        def per_head(mask: torch.Tensor) -> torch.Tensor:  # (B, rows, keys) -> (B, 1, heads per group * rows, keys)
            return mask[:, None].expand(-1, qpg, -1, -1).reshape(mask.shape[0], 1, qpg * mask.shape[1], -1)

        # prompt block: causal over the prompt, its padding keys masked (a padding query still sees the valid
        # prompt keys before it); the kernel's mask is True where a query attends
        causal = torch.ones(pw, pw, dtype=torch.bool, device=q.device).tril()
        p_keep = causal & ~attention_mask[:, 0, 0, None, :pw]  # (G, Pw, Pw): prompt columns are the same per query
        p_out = attend(q[..., :pw, :].reshape(g, ng, qpg * pw, d), kk[:, :, :pw], vv[:, :, :pw],
                       attn_mask=per_head(p_keep))  # fmt: skip
        p_out = p_out.view(g, heads, pw, d)

        # responses: one batch entry per (packed row, slot), its keys the prompt's then its own slot's
        def with_prompt(x: torch.Tensor) -> torch.Tensor:  # (G, groups, L, d) -> (G * K, groups, Pw + Rw, d)
            own = x[:, :, pw:].unflatten(2, (k, rw)).transpose(1, 2)  # (G, K, groups, Rw, d)
            return torch.cat([x[:, None, :, :pw].expand(g, k, ng, pw, d), own], dim=3).reshape(g * k, ng, pw + rw, d)

        qr = q[..., pw:, :].unflatten(3, (k, rw)).permute(0, 3, 1, 2, 4, 5).reshape(g * k, ng, qpg * rw, d)
        keep = per_head(~attention_mask.reshape(g * k, rw, w))
        r_out = attend(qr, with_prompt(kk), with_prompt(vv), attn_mask=keep)  # (G * K, groups, qpg * Rw, d)
        r_out = r_out.view(g, k, heads, rw, d).transpose(1, 2).reshape(g, heads, k * rw, d)
        out = torch.cat([p_out, r_out], dim=2)  # (G, heads, L, d)
        return out.permute(2, 0, 1, 3).reshape(L, g, heads * d)


def _softmax_scale(config) -> float:
    return config.softmax_scale or 1.0 / math.sqrt(config.kv_channels)


@contextlib.contextmanager
def installed(chunks: list[torch.nn.Module]) -> Iterator[None]:
    """Packed passes for the block: every self-attention's core attention is :class:`SharedPrefixAttention` and
    RoPE is evaluated at the model's ``position_ids``; the model is as before afterwards (nothing is saved in a
    checkpoint: the swapped modules hold no state)."""
    config = get_model_config(chunks[0])
    swapped, handles = [], []
    attention = SharedPrefixAttention(_softmax_scale(config))
    try:
        for chunk in chunks:
            for module in chunk.modules():
                if isinstance(module, SelfAttention):
                    swapped.append((module, module.core_attention))
                    module.core_attention = attention
                if isinstance(module, GPTModel):
                    handles += _position_hooks(module)
        yield
    finally:
        for module, original in swapped:
            module.core_attention = original
        for handle in handles:
            handle.remove()


def _position_hooks(model: GPTModel) -> list:
    """Hooks that make ``model``'s RoPE table ``[L, 1, 1, d]`` (positions ``0..L-1``) the table at its
    ``position_ids`` ``(G, L)``: ``[L, G, 1, d]`` (every packed position is below ``L``)."""
    current: dict[str, torch.Tensor] = {}

    def keep_positions(module, args, kwargs):
        current["positions"] = args[1] if len(args) > 1 else kwargs["position_ids"]

    def at_positions(module, args, output):
        return output[:, 0, 0][current["positions"].t()].unsqueeze(2)

    return [
        model.register_forward_pre_hook(keep_positions, with_kwargs=True),
        model.rotary_pos_emb.register_forward_hook(at_positions),
    ]
