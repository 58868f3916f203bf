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


class _VocabParallelLogProbEntropy(torch.autograd.Function):
    """``(logits (..., V/tp), target (...)) -> (log p(target) (...), entropy (...))``, at least fp32."""

    @staticmethod
    def forward(ctx, logits, target, group, vocab_start, n_valid, temperature):
        world = _group_size(group)
        local_vocab = logits.shape[-1]
        x = logits[..., :n_valid].to(torch.promote_types(logits.dtype, torch.float32))
        if temperature != 1.0:  # in fp32: dividing 16-bit logits first would round them again
            x = x / temperature
        if n_valid > 0:
            m = x.max(dim=-1).values
        else:  # every column of this rank is vocabulary padding
            m = torch.full(logits.shape[:-1], float("-inf"), dtype=x.dtype, device=logits.device)
        if world > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        x = x - m.unsqueeze(-1)
        e = x.exp()
        local_t = target - vocab_start
        owned = (local_t >= 0) & (local_t < n_valid)
        idx = local_t.clamp(0, max(n_valid - 1, 0))
        if n_valid > 0:
            picked = x.gather(-1, idx.unsqueeze(-1)).squeeze(-1) * owned
        else:
            picked = torch.zeros_like(m)
        stats = torch.stack([e.sum(-1), (e * x).sum(-1), picked])
        if world > 1:
            dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
        sum_e, sum_ex, x_target = stats.unbind(0)
        log_z = sum_e.log()
        mean_x = sum_ex / sum_e
        ctx.save_for_backward(x, log_z, mean_x, idx, owned)
        ctx.logits_dtype, ctx.local_vocab, ctx.temperature = logits.dtype, local_vocab, temperature
        return x_target - log_z, log_z - mean_x

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        x, log_z, mean_x, idx, owned = ctx.saved_tensors
        p = (x - log_z.unsqueeze(-1)).exp()
        grad = -p * (grad_logp.unsqueeze(-1) + grad_entropy.unsqueeze(-1) * (x - mean_x.unsqueeze(-1)))
        if x.shape[-1] > 0:
            grad.scatter_add_(-1, idx.unsqueeze(-1), (grad_logp * owned).unsqueeze(-1))
        if ctx.temperature != 1.0:
            grad = grad / ctx.temperature
        if x.shape[-1] < ctx.local_vocab:  # padded vocabulary columns get no gradient
            grad = torch.nn.functional.pad(grad, (0, ctx.local_vocab - x.shape[-1]))
        return grad.to(ctx.logits_dtype), None, None, None, None, None


def log_probs_and_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    group: ProcessGroup | None = None,
    temperature: float = 1.0,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of ``target`` and the entropy of the softmax, from this rank's vocabulary slice.

    Args:
        logits: ``(..., V / tp)`` this rank's slice of the logits (any float dtype).
        target: ``(...)`` token ids in ``[0, V)``.
        group: the tensor-parallel group that holds the other slices (``None``: the default group, or a
            single process when ``torch.distributed`` is not initialised).
        temperature: logits are divided by it first (the sampling temperature of the rollout).
        vocab_size: the true vocabulary size when the model's vocabulary is padded to ``V > vocab_size``;
            ids ``>= vocab_size`` are left out of the softmax. ``None``: no padding.

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
    return _VocabParallelLogProbEntropy.apply(logits, target, group, vocab_start, n_valid, float(temperature))


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
    return log_probs_and_entropy(logits, target, group, temperature, vocab_size)[0]


def entropy(
    logits: torch.Tensor,
    group: ProcessGroup | None = None,
    temperature: float = 1.0,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Entropy ``-sum_j p_j log p_j`` of ``softmax(logits / temperature)`` over the full vocabulary: ``(...)``."""
    target = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    return log_probs_and_entropy(logits, target, group, temperature, vocab_size)[1]
