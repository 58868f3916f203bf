"""Loss aggregation modes against verl's documented definitions, written out by hand; their split invariance;
one home for their names and formulas.

verl 0.9 (``agg_loss`` in ``verl/trainer/ppo/core_algos.py``, ``loss_agg_mode`` / ``loss_scale_factor`` in
``verl/trainer/config/actor/actor.yaml``): token-mean = masked sum / valid tokens; token-sum = masked sum;
seq-mean-token-sum = mean over non-empty sequences of their token sums; seq-mean-token-mean = mean over
non-empty sequences of their token means; seq-mean-token-sum-norm = seq-mean-token-sum / loss_scale_factor
(default: the response length).
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridrl.algos import aggregation
from hybridrl.algos.aggregation import AGG_MODES, agg_loss, aggregate, denominator, local_count
from hybridrl.config.schema_roles import LOSS_AGG_MODES

ROOT = Path(__file__).resolve().parents[2]
LOSS = torch.tensor([[1.0, 2.0, 3.0, 7.0], [4.0, 9.0, 9.0, 9.0], [5.0, 5.0, 5.0, 5.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])  # row sums 6 and 4; the last row is empty


@pytest.mark.parametrize(
    ("mode", "scale", "expected"),
    [
        ("token-mean", None, (6 + 4) / 4),
        ("token-sum", None, 6 + 4),
        ("seq-mean-token-sum", None, (6 + 4) / 2),
        ("seq-mean-token-mean", None, (6 / 3 + 4 / 1) / 2),
        ("seq-mean-token-sum-norm", None, (6 + 4) / 2 / 4),  # verl's default constant: the response width (4)
        ("seq-mean-token-sum-norm", 10.0, (6 + 4) / 2 / 10),
    ],
)
def test_modes_equal_verls_definitions(mode, scale, expected):
    assert float(agg_loss(LOSS, MASK, mode, scale)) == pytest.approx(expected)
    assert float(agg_loss(LOSS, torch.zeros_like(MASK), mode, scale)) == 0.0  # no valid token: 0, not NaN


def test_padding_values_never_reach_the_loss():
    poisoned = torch.where(MASK.bool(), LOSS, torch.tensor(float("nan")))
    for mode in AGG_MODES:
        assert torch.isfinite(agg_loss(poisoned, MASK, mode, 4.0)), mode


def _by_hand(loss: torch.Tensor, mask: torch.Tensor, mode: str, scale: float) -> torch.Tensor:
    m = mask.double()
    sums, lengths = (loss * m).sum(1), m.sum(1)
    seqs = (lengths > 0).sum().clamp(min=1)
    return {
        "token-mean": sums.sum() / lengths.sum().clamp(min=1),
        "token-sum": sums.sum(),
        "seq-mean-token-sum": sums.sum() / seqs,
        "seq-mean-token-mean": (sums / lengths.clamp(min=1)).sum() / seqs,
        "seq-mean-token-sum-norm": sums.sum() / seqs / scale,
    }[mode]


@given(st.integers(1, 7), st.integers(1, 6), st.integers(1, 4), st.integers(0, 2**31 - 1))
@settings(max_examples=40, deadline=None)
def test_every_split_adds_up_to_the_whole(b, r, parts, seed):
    """Parts of the batch, each over the WHOLE batch's denominator, add up to L (what DP and micro-batches do)."""
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(b, r, generator=g, dtype=torch.float64)
    mask = (torch.rand(b, r, generator=g) < 0.6).long()
    cuts = sorted(torch.randint(0, b + 1, (parts - 1,), generator=g).tolist())
    pieces = list(itertools.pairwise([0, *cuts, b]))
    for mode in AGG_MODES:
        count = sum(local_count(mask[lo:hi], mode) for lo, hi in pieces)
        denom = denominator(torch.as_tensor(count, dtype=torch.float64), mode, 8.0)
        total = sum(aggregate(loss[lo:hi], mask[lo:hi], mode, denom) for lo, hi in pieces)
        torch.testing.assert_close(torch.as_tensor(total, dtype=torch.float64), _by_hand(loss, mask, mode, 8.0))


def test_errors_name_the_key():
    with pytest.raises(ValueError, match="loss_agg_mode") as err:
        agg_loss(LOSS, MASK, "mean")
    assert all(mode in str(err.value) for mode in AGG_MODES)
    with pytest.raises(ValueError, match="does not match"):
        agg_loss(LOSS, MASK[:, :2], "token-mean")
    with pytest.raises(ValueError, match="loss_scale_factor"):  # the split path has no batch width to fall back on
        denominator(torch.tensor(2.0, dtype=torch.float64), "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="loss_scale_factor"):
        aggregation.check_mode("seq-mean-token-sum-norm", 0.0)


def test_one_home_for_names_and_formulas():
    """The config's names are the modes' (same object); mcore and losses define none of their own."""
    assert AGG_MODES is LOSS_AGG_MODES and tuple(aggregation.MODES) == LOSS_AGG_MODES
    for path in ("hybridrl/mcore/loss_scaling.py", "hybridrl/mcore/compute.py", "hybridrl/algos/losses.py"):
        tree = ast.parse((ROOT / path).read_text())
        strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        assert not strings & set(AGG_MODES) - {"token-mean"}, (path, strings & set(AGG_MODES))
