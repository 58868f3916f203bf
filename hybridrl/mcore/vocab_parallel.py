"""Per-token log-probabilities and entropy from vocab-parallel logits, without gathering the vocabulary.

Megatron's output layer leaves each tensor-parallel rank with a contiguous slice of the vocabulary:
rank ``r`` of ``tp`` holds logits ``x[..., r*V/tp : (r+1)*V/tp]``. The full softmax statistics need only
three numbers per token, so they are reduced over the TP group instead of gathering ``V`` logits:

    m      = max_j x_j                         (all-reduce MAX)
    Z      = sum_j exp(x_j - m)                (all-reduce SUM, fused with the two below)
    S      = sum_j exp(x_j - m) * (x_j - m)
    x_t    = x_target - m                      (only the rank owning ``target`` contributes)
    log p(target) = x_t - log Z
    entropy H     = log Z - S / Z             (= -sum_j p_j log p_j)

with ``x`` = logits / temperature in fp32. Backward (local to each rank; Megatron's output layer all-reduces
the input gradient):

    d log p(t) / d x_j = 1[j = t] - p_j
    d H / d x_j        = -p_j * ((x_j - m) - S / Z)

Two collectives per call (forward), none in backward. Computation is in fp32 for 16-bit logits (fp64
stays fp64); gradients are returned in the logits dtype. Pure ``torch.distributed``: no Megatron import, any group.

The logits are the largest tensor of a small model's update (rows x V/tp); the backward needs them once more and
then never again. With ``grad_into_logits=True`` it writes the gradient into the logits' own memory, chunk by chunk
after reading each, so the update holds one such tensor instead of two. The logits then hold the gradient after
the backward: the caller must not read them again, and autograd raises ("modified by an inplace operation") if
another function saved them for its own backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

ProcessGroup = dist.ProcessGroup


def _group_size(group: ProcessGroup | None) -> int:
    if group is None and not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def _group_rank(group: ProcessGroup | None) -> int:
    if group is None and not dist.is_initialized():
        return 0
    return dist.get_rank(group)


CHUNK_ELEMENTS = 2**21
"""Logit elements per chunk of rows (8 MiB in fp32): each chunk's passes run in cache, not in memory."""


def _chunks(n_rows: int, n_valid: int) -> list[slice]:
    step = max(1, CHUNK_ELEMENTS // max(n_valid, 1))
    return [slice(i, min(i + step, n_rows)) for i in range(0, n_rows, step)]


class _VocabParallelLogProbEntropy(torch.autograd.Function):
    """``(logits (..., V/tp), target (...)) -> (log p(target) (...), entropy (...))``, at least fp32.

    Rows are processed in chunks of :data:`CHUNK_ELEMENTS` logits, each through all of its elementwise passes
    (shift, exp, the sums; in backward the softmax and the gradient) while it is in cache; nothing of the
    logits' size is allocated but the gradient itself. Backward recomputes ``x - m`` from the saved logits rather
    than keeping a shifted fp32 copy, and skips the entropy term when the loss does not use the entropy.
    """

    @staticmethod
    def forward(ctx, logits, target, group, vocab_start, n_valid, temperature, grad_into_logits, with_entropy):
        world = _group_size(group)
        local_vocab = logits.shape[-1]
        compute = torch.promote_types(logits.dtype, torch.float32)
        flat = logits.reshape(-1, local_vocab)[:, :n_valid]
        rows = flat.shape[0]
        # one rank: each chunk's max is taken with its other passes, while the chunk is in cache; a TP group
        # needs every row's global max (an all-reduce) before the first shift
        m = torch.full((rows,), float("-inf"), dtype=compute, device=logits.device)  # all-padding columns: -inf
        if world > 1:
            if n_valid > 0:
                _row_max(flat, temperature, compute, out=m)
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)  # every rank, its columns all padding or not
        local_t = target.reshape(-1) - vocab_start
        owned = (local_t >= 0) & (local_t < n_valid)
        idx = local_t.clamp(0, max(n_valid - 1, 0))
        stats = torch.zeros(3, rows, dtype=compute, device=logits.device)
        if n_valid > 0:
            for c in _chunks(rows, n_valid):
                if world == 1:
                    _row_max(flat[c], temperature, compute, out=m[c])
                x = _shifted(flat[c], m[c], temperature, compute)
                stats[2, c] = x.gather(-1, idx[c].unsqueeze(-1)).squeeze(-1) * owned[c]
                e = x.exp()
                stats[0, c] = e.sum(-1)
                if with_entropy:  # S: the entropy's one extra product and sum over the chunk
                    stats[1, c] = e.mul_(x).sum(-1)
        if world > 1:
            dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
        sum_e, sum_ex, x_target = stats.unbind(0)
        log_z = sum_e.log()
        mean_x = sum_ex / sum_e
        ctx.save_for_backward(logits, m, log_z, mean_x, idx, owned)
        ctx.n_valid, ctx.temperature, ctx.compute = n_valid, temperature, compute
        ctx.grad_into_logits = grad_into_logits
        ctx.set_materialize_grads(False)
        shape = logits.shape[:-1]
        return (x_target - log_z).reshape(shape), (log_z - mean_x).reshape(shape) if with_entropy else None

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, m, log_z, mean_x, idx, owned = ctx.saved_tensors
        n_valid, temperature, compute = ctx.n_valid, ctx.temperature, ctx.compute
        local_vocab = logits.shape[-1]
        flat = logits.reshape(-1, local_vocab)
        rows = flat.shape[0]
        nones = (None,) * 7
        # the logits' memory, when the caller gave it up and no graph of this backward could still need it
        reuse = ctx.grad_into_logits and logits.is_contiguous() and not torch.is_grad_enabled()
        if grad_logp is None and grad_entropy is None:
            grad = flat.zero_() if reuse else torch.zeros_like(flat)
            return grad.reshape(logits.shape), *nones
        if reuse:
            grad = flat
            grad[:, n_valid:].zero_()  # padded columns get no gradient
        else:
            make = torch.zeros if n_valid < local_vocab else torch.empty
            grad = make(rows, local_vocab, dtype=logits.dtype, device=logits.device)
        g_lp = grad_logp.reshape(-1).to(compute) if grad_logp is not None else None
        g_ent = grad_entropy.reshape(-1).to(compute) if grad_entropy is not None else None
        in_place = compute == logits.dtype  # x is computed in the gradient's own memory: no copy at the end
        # (with ``reuse`` that memory is the chunk's logits, read by the same elementwise op that overwrites them)
        for c in _chunks(rows, n_valid) if n_valid > 0 else []:
            x = _shifted(flat[c, :n_valid], m[c], temperature, compute, out=grad[c, :n_valid] if in_place else None)
            # d log p(t) / dx_j = 1[j = t] - p_j;  dH / dx_j = -p_j ((x_j - m) - S / Z);  then / temperature
            if g_ent is not None:
                p = (x - log_z[c].unsqueeze(-1)).exp_()
                out = x.sub_(mean_x[c].unsqueeze(-1)).mul_(g_ent[c].unsqueeze(-1))
                if g_lp is not None:
                    out.add_(g_lp[c].unsqueeze(-1))
                out.mul_(p).neg_()
            else:
                out = x.sub_(log_z[c].unsqueeze(-1)).exp_().mul_(-g_lp[c].unsqueeze(-1))  # p_j, then its term
            if g_lp is not None:
                out.scatter_add_(-1, idx[c].unsqueeze(-1), (g_lp[c] * owned[c]).unsqueeze(-1))
            if temperature != 1.0:
                out.div_(temperature)
            if not in_place:
                grad[c, :n_valid] = out  # after the chunk's logits were read: the next chunk's are untouched
        return grad.reshape(logits.shape), *nones


def _row_max(logits: torch.Tensor, temperature: float, compute: torch.dtype, out: torch.Tensor) -> None:
    """``max_j logits[:, j] / temperature`` in ``compute``, written into ``out`` ``(rows,)``: ``max(l) / T`` is
    ``max(l / T)`` exactly (``T > 0``), so the division runs on the maxima, not the logits."""
    maxima = logits.max(dim=-1).values
    if temperature != 1.0:
        torch.div(maxima.to(compute), temperature, out=out)
    else:
        out.copy_(maxima)


def _shifted(
    logits: torch.Tensor, m: torch.Tensor, temperature: float, compute: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``logits / temperature - m`` in ``compute``: a new tensor, or written into ``out`` (``compute``, the shape
    of ``logits``) when given; the caller may work on it in place."""
    x = logits.to(compute)
    if temperature != 1.0:  # in fp32: dividing 16-bit logits first would round them again
        return torch.div(x, temperature, out=out).sub_(m.unsqueeze(-1))
    return torch.sub(x, m.unsqueeze(-1), out=out)


def log_probs_and_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    group: ProcessGroup | None = None,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    grad_into_logits: bool = False,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of ``target`` and the entropy of the softmax, from this rank's vocabulary slice.

    Args:
        logits: ``(..., V / tp)`` this rank's slice of the logits (any float dtype).
        target: ``(...)`` token ids in ``[0, V)``.
        group: the tensor-parallel group that holds the other slices (``None``: the default group, or a
            single process when ``torch.distributed`` is not initialised).
        temperature: logits are divided by it first (the sampling temperature of the rollout).
        vocab_size: the true vocabulary size when the model's vocabulary is padded to ``V > vocab_size``;
            ids ``>= vocab_size`` are left out of the softmax. ``None``: no padding.
        grad_into_logits: the backward writes the gradient into ``logits``' memory (contiguous logits, one
            backward); ``logits`` are not to be read after it (module docs). False: a new tensor.
        with_entropy: False skips the entropy's pass over the logits and returns None in its place.

    Returns:
        ``(log_probs, entropy)``, each ``(...)`` fp32 (fp64 for fp64 logits), differentiable w.r.t. ``logits``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature ({temperature}) must be > 0; use 1.0 for the model's own distribution")
    if target.shape != logits.shape[:-1]:
        raise ValueError(f"target shape {tuple(target.shape)} != logits shape without vocab {tuple(logits.shape[:-1])}")
    local_vocab = logits.shape[-1]
    vocab_start = _group_rank(group) * local_vocab
    n_valid = local_vocab
    if vocab_size is not None:
        n_valid = min(max(vocab_size - vocab_start, 0), local_vocab)
    return _VocabParallelLogProbEntropy.apply(
        logits, target, group, vocab_start, n_valid, float(temperature), grad_into_logits, with_entropy
    )


def log_probs(
    logits: torch.Tensor,
    target: torch.Tensor,
    group: ProcessGroup | None = None,
    temperature: float = 1.0,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """``log softmax(logits / temperature)[target]`` over the full vocabulary: ``(...)`` fp32.

    See :func:`log_probs_and_entropy` for the arguments (``logits (..., V/tp)``, ``target (...)``).
    """
    return log_probs_and_entropy(logits, target, group, temperature, vocab_size, with_entropy=False)[0]


def entropy(
    logits: torch.Tensor,
    group: ProcessGroup | None = None,
    temperature: float = 1.0,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Entropy ``-sum_j p_j log p_j`` of ``softmax(logits / temperature)`` over the full vocabulary: ``(...)``."""
    target = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    return log_probs_and_entropy(logits, target, group, temperature, vocab_size)[1]
