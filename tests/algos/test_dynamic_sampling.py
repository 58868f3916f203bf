"""DAPO's group filter and soft overlong punishment (Yu et al. 2025, secs. 3.2 and 3.4) against their definitions,
written out here."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridrl.algos.dynamic_sampling import informative_rows, overlong_penalty


def test_informative_rows_keep_groups_whose_scores_differ():
    scores = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.5, 0.5])
    index = np.array(["a"] * 3 + ["b"] * 2 + ["c"] * 3 + ["d"] * 2, dtype=object)
    expected = [False] * 3 + [True] * 2 + [False] * 3 + [False] * 2  # all 1 | mixed | all 0 | all 0.5
    assert informative_rows(scores, index).tolist() == expected


def test_equal_means_bitwise_equal():
    """Three copies of 0.1 have a float mean that is not 0.1 (and a nonzero computed std): still dropped."""
    scores = torch.tensor([0.1, 0.1, 0.1, 0.1, 0.1, 0.1 + 1e-7], dtype=torch.float64)
    index = np.array(["a"] * 3 + ["b"] * 3, dtype=object)
    assert informative_rows(scores, index).tolist() == [False] * 3 + [True] * 3


@pytest.mark.parametrize(("max_len", "cache"), [(8, 2), (20, 5), (16, 16), (7, 1)])
def test_overlong_penalty_is_eq_of_the_paper(max_len, cache):
    """R = 0 for |y| <= L_max - L_cache, ((L_max - L_cache) - |y|) / L_cache up to L_max, -1 beyond."""
    lengths = torch.arange(0, max_len + 3)
    factor = 0.7
    got = overlong_penalty(lengths, max_len, cache, factor)
    for y, value in zip(lengths.tolist(), got.tolist(), strict=True):
        if y <= max_len - cache:
            expected = 0.0
        elif y <= max_len:
            expected = ((max_len - cache) - y) / cache
        else:
            expected = -1.0
        assert value == pytest.approx(factor * expected, abs=1e-7), y


def test_overlong_buffer_must_fit_the_budget():
    with pytest.raises(ValueError, match=r"reward\.overlong_buffer\.len \(9\) must be in \[1, "):
        overlong_penalty(torch.tensor([3]), 8, 9)
