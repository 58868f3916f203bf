"""gpg and pass@k advantages against their papers' definitions, written out here: GPG's corrected group baseline
(Chu et al. 2025) by hand, and pass@k's closed form (Chen et al. 2025) against the expectation over all k-subsets of
each group, which the closed form is derived from."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from hybridrl.algos.advantages import compute_advantages
from hybridrl.algos.group_estimators import pass_at_k_group_advantages


def _outcome(
    scores: list[float], width: int = 4, seed: int = 0, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random-length right-padded ``(rewards, mask)`` with each score on its response's last token."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (len(scores),), generator=g)
    mask = (torch.arange(width)[None] < lengths[:, None]).float()
    rewards = torch.zeros(len(scores), width, dtype=dtype)
    rewards[torch.arange(len(scores)), lengths - 1] = torch.tensor(scores, dtype=dtype)
    return rewards, mask


def test_gpg_centres_groups_and_corrects_for_zero_signal_groups():
    # groups: p0 mixed, p1 all equal (its 3 responses carry no signal), p2 mixed, p3 a single response
    scores = [1.0, 0.0, 0.5, 0.1, 0.1, 0.1, 0.2, 0.9, 0.4]  # 0.1 * 3: a float std of ~1e-17, not 0
    index = np.array(["p0", "p0", "p0", "p1", "p1", "p1", "p2", "p2", "p3"], dtype=object)
    rewards, mask = _outcome(scores, seed=1, dtype=torch.float64)
    adv, returns = compute_advantages("gpg", token_level_rewards=rewards, response_mask=mask, index=index)
    alpha = 9 / (9 - 3)  # B / (B - M)
    groups = {"p0": [1.0, 0.0, 0.5], "p1": [0.1] * 3, "p2": [0.2, 0.9], "p3": [0.4]}
    means = {k: (sum(v) / len(v) if len(v) > 1 else 0.0) for k, v in groups.items()}  # a single keeps its score
    expected = torch.tensor([alpha * (s - means[i]) for s, i in zip(scores, index, strict=True)], dtype=torch.float64)
    torch.testing.assert_close(adv, expected[:, None] * mask, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(returns, adv)
    same, _ = compute_advantages("gpg", token_level_rewards=rewards[3:6], response_mask=mask[3:6], index=index[3:6])
    assert same.abs().max() < 1e-12  # only zero-signal responses: alpha = 1, nothing to scale


def _subset_expectation(passed: list[bool], k: int) -> list[float]:
    """Each response's pass@k advantage as the paper defines it before the closed form: the group's k-subsets get
    reward max(pass), normalised by the mean and std over all subsets; a response's advantage is the mean over the
    subsets that contain it."""
    n = len(passed)
    subsets = list(itertools.combinations(range(n), k))
    rewards = [float(any(passed[j] for j in s)) for s in subsets]
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    out = []
    for i in range(n):
        mine = [(r - mean) / (std + 1e-6) for s, r in zip(subsets, rewards, strict=True) if i in s]
        out.append(sum(mine) / len(mine))
    return out


@pytest.mark.parametrize(("n", "k"), [(4, 1), (4, 2), (5, 3), (6, 4), (8, 4), (6, 6)])
def test_pass_at_k_closed_form_equals_the_subset_expectation(n, k):
    for correct in range(n + 1):
        passed = [True] * correct + [False] * (n - correct)
        expected = _subset_expectation(passed, k)
        pos, neg = pass_at_k_group_advantages(n, correct, k)
        got = [pos if p else neg for p in passed]
        assert got == pytest.approx(expected, rel=1e-6, abs=1e-6), (n, k, correct)


def test_pass_at_1_is_grpo_with_population_std():
    """k = 1: the subset reward is the response's own, so pass@1 is the group z-score (population std)."""
    pos, neg = pass_at_k_group_advantages(8, 3, 1, epsilon=0.0)
    p = 3 / 8
    assert (pos, neg) == pytest.approx(((1 - p) / math.sqrt(p * (1 - p)), -p / math.sqrt(p * (1 - p))))


@pytest.mark.parametrize("seed", range(3))
def test_pass_at_k_estimator_on_a_batch(seed):
    g = torch.Generator().manual_seed(seed)
    scores = (torch.rand(12, generator=g) < 0.5).float() * torch.where(torch.rand(12, generator=g) < 0.3, 0.9, 1.0)
    index = np.repeat(np.array(["a", "b", "c"], dtype=object), 4)
    rewards, mask = _outcome(scores.tolist(), seed=seed)
    adv, _ = compute_advantages("pass_at_k", token_level_rewards=rewards, response_mask=mask, index=index,
                                pass_k=2, pass_threshold=0.95)  # fmt: skip
    for group in range(3):
        passed = [bool(s >= 0.95) for s in scores[group * 4 : group * 4 + 4]]
        expected = torch.tensor(_subset_expectation(passed, 2))[:, None] * mask[group * 4 : group * 4 + 4]
        torch.testing.assert_close(adv[group * 4 : group * 4 + 4], expected, rtol=1e-5, atol=1e-5)


def test_pass_at_k_refuses_groups_smaller_than_k():
    rewards, mask = _outcome([1.0, 0.0])
    with pytest.raises(ValueError, match=r"algorithm\.pass_k \(4\) must be in \[1, group size \(2\)\]"):
        compute_advantages("pass_at_k", token_level_rewards=rewards, response_mask=mask, index=["p", "p"], pass_k=4)
