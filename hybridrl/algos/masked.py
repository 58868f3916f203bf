"""Masked reductions over ``(batch, seq)`` response tensors: mean, variance, whitening.

The shared vocabulary of :mod:`hybridrl.algos`: a response mask is nonzero on valid (generated) tokens and
zero on padding; every reduction here ignores the padding, so its values never leak into a result.
"""

from __future__ import annotations

import torch


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``sum(x * mask)`` over ``dim`` (all dims if None); NaN/inf at masked positions do not propagate."""
    x = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return x.sum() if dim is None else x.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over the valid entries of ``mask`` (along ``dim``, or all). 0 where nothing is valid."""
    count = masked_sum(torch.ones_like(x), mask, dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1.0)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``x`` over all valid entries (Bessel-corrected unless ``unbiased`` is False)."""
    mean = masked_mean(x, mask)
    count = mask.bool().sum()
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased and count > 1:
        var = var * count / (count - 1)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` with batch statistics over valid entries; padding is set to 0.

    Args:
        x: ``(batch, seq)`` values.
        mask: ``(batch, seq)`` response mask.
        shift_mean: subtract the mean (False keeps the mean, only rescales).
        eps: added to the variance.

    Returns:
        ``(batch, seq)``, zero at masked positions.
    """
    mean = masked_mean(x, mask)
    whitened = (x - mean) * torch.rsqrt(masked_var(x, mask) + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, torch.zeros((), dtype=x.dtype, device=x.device))
