"""Pearson's chi-square goodness-of-fit test, for checking that a sampler draws the distribution it is given."""

from __future__ import annotations

import math

import torch


def chi_square(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson's statistic of observed ``counts`` against ``probs`` and its degrees of freedom.

    Categories whose expected count is below ``min_expected`` are pooled into one (the usual validity rule of the
    chi-square approximation); a draw from a category of probability 0 returns ``inf``.
    """
    counts, probs = counts.double(), probs.double()
    if counts[probs == 0].sum() > 0:
        return math.inf, 0
    expected = probs * counts.sum()
    keep = expected >= min_expected
    obs = torch.cat([counts[keep], counts[~keep & (probs > 0)].sum()[None]])
    exp = torch.cat([expected[keep], expected[~keep & (probs > 0)].sum()[None]])
    if exp[-1] < min_expected:  # the pooled rest is itself too small: fold it into the last kept category
        obs, exp = torch.cat([obs[:-2], obs[-2:].sum()[None]]), torch.cat([exp[:-2], exp[-2:].sum()[None]])
    return float(((obs - exp) ** 2 / exp).sum()), len(exp) - 1


def chi_square_bound(df: int, z: float = 4.0) -> float:
    """The value a chi-square variable with ``df`` degrees of freedom exceeds with the probability a standard normal
    exceeds ``z`` (z 4: 3e-5), by the Wilson-Hilferty approximation (Wilson & Hilferty, PNAS 1931)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3
