"""Policy/value losses: hand-computed cases, clipping properties, the policy-loss registry and its config names."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridrl.algos.aggregation import agg_loss
from hybridrl.algos.losses import (
    POLICY_LOSSES,
    entropy_bonus,
    get_policy_loss,
    ppo_clip_loss,
    value_loss,
)
from hybridrl.config.schema_roles import POLICY_LOSS_NAMES

SETTINGS = settings(max_examples=30, deadline=None)


@given(st.integers(1, 5), st.integers(1, 6), st.integers(0, 2**31 - 1))
@SETTINGS
def test_agg_modes_agree_when_lengths_are_equal(b, r, seed):
    loss = torch.randn(b, r, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    mask = torch.ones(b, r)
    token_mean = agg_loss(loss, mask, "token-mean")
    torch.testing.assert_close(agg_loss(loss, mask, "seq-mean-token-mean"), token_mean)
    torch.testing.assert_close(agg_loss(loss, mask, "seq-mean-token-sum"), token_mean * r)
    torch.testing.assert_close(agg_loss(loss, mask, "token-sum"), token_mean * r * b)
    torch.testing.assert_close(agg_loss(loss, mask, "seq-mean-token-sum-norm"), token_mean)  # C = r here


# --- PPO clip ------------------------------------------------------------------------------------------


def test_policy_loss_registry():
    assert get_policy_loss("ppo_clip") is ppo_clip_loss
    assert get_policy_loss("vanilla") is ppo_clip_loss  # verl's name (policy_loss.loss_mode: vanilla)
    assert set(POLICY_LOSSES) == set(POLICY_LOSS_NAMES)  # the config's choices are the registry's entries
    with pytest.raises(ValueError, match="policy loss") as err:
        get_policy_loss("ppo")
    assert "\n" not in str(err.value) and all(name in str(err.value) for name in POLICY_LOSSES)


def test_ppo_ratio_one_gives_minus_advantage():
    g = torch.Generator().manual_seed(0)
    logp, adv = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)
    mask = torch.ones(3, 4)
    loss, metrics = ppo_clip_loss(logp, logp.clone(), adv, mask, per_token=True)
    torch.testing.assert_close(loss, -adv)
    assert float(metrics["clipfrac"]) == 0.0 and float(metrics["approx_kl"]) == 0.0


def test_ppo_clip_hand_computed():
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, -2.0, 7.0]])
    ratio = torch.tensor([[1.5, 0.5, 1.5, 0.5, 5.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0, 0.0]])
    old = torch.zeros_like(ratio)
    kwargs = dict(clip_ratio_low=0.2, clip_ratio_high=0.3, clip_ratio_c=3.0)
    loss, metrics = ppo_clip_loss(ratio.log(), old, adv, mask, per_token=True, **kwargs)
    # clipped at 1.3 | unclipped (pessimistic) | unclipped | clipped at 0.8 | dual-capped at 3 * 2 | padding
    torch.testing.assert_close(loss, torch.tensor([[-1.3, -0.5, 1.5, 0.8, 6.0, 0.0]]))
    assert float(metrics["clipfrac"]) == pytest.approx(2 / 5)
    assert float(metrics["clipfrac_lower"]) == pytest.approx(1 / 5)
    assert float(metrics["approx_kl"]) == pytest.approx(float(-ratio.log()[:, :5].mean()))
    scalar, _ = ppo_clip_loss(ratio.log(), old, adv, mask, loss_agg_mode="token-mean", **kwargs)
    assert float(scalar) == pytest.approx(float(loss.sum() / 5))


def test_ppo_gradient_vanishes_when_clipped():
    logp = torch.log(torch.tensor([[1.1, 1.5]])).requires_grad_()
    adv = torch.tensor([[2.0, 2.0]])
    loss, _ = ppo_clip_loss(logp, torch.zeros(1, 2), adv, torch.ones(1, 2), per_token=True)
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-2.0 * 1.1, 0.0]]))  # d(-A * e^logp) / dlogp = -A * ratio


@given(
    st.floats(-5, 5),
    st.floats(-8, 8),
    st.floats(0.01, 0.5),
    st.floats(0.01, 0.5),
    st.floats(1.01, 10),
)
@SETTINGS
def test_ppo_dual_clip_caps_negative_advantages(adv, log_ratio, low, high, c):
    a, lr = torch.tensor([[adv]], dtype=torch.float64), torch.tensor([[log_ratio]], dtype=torch.float64)
    clips = dict(clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=c)
    loss, _ = ppo_clip_loss(lr, torch.zeros_like(lr), a, torch.ones(1, 1), per_token=True, **clips)
    ratio = float(torch.exp(lr))
    standard = max(-adv * ratio, -adv * min(max(ratio, 1 - low), 1 + high))
    expected = min(standard, c * abs(adv)) if adv < 0 else standard
    assert float(loss) == pytest.approx(expected, rel=1e-9, abs=1e-12)
    if adv < 0:
        assert float(loss) <= c * abs(adv) + 1e-12


def test_ppo_rejects_bad_dual_clip():
    x = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        ppo_clip_loss(x, x, x, torch.ones(1, 1), clip_ratio_c=1.0)


# --- value loss and entropy ------------------------------------------------------------------------------


def test_value_loss_takes_the_larger_term():
    values = torch.tensor([[1.0, 1.0, 0.2, 5.0]])
    old = torch.zeros(1, 4)
    returns = torch.tensor([[0.0, 2.0, 1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss, metrics = value_loss(values, old, returns, mask, cliprange_value=0.5, per_token=True)
    # (1)^2 > (0.5)^2 | (0.5-2)^2 > (1-2)^2 | inside the clip range: both terms equal | padding
    torch.testing.assert_close(loss, torch.tensor([[0.5, 1.125, 0.32, 0.0]]))
    assert float(metrics["vf_clipfrac"]) == pytest.approx(1 / 3)
    mean, _ = value_loss(values, old, returns, mask, cliprange_value=0.5, loss_agg_mode="seq-mean-token-sum")
    assert float(mean) == pytest.approx(0.5 + 1.125 + 0.32)


def test_entropy_bonus_aggregates_entropy():
    entropy = torch.tensor([[1.0, 3.0], [2.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    bonus, metrics = entropy_bonus(entropy, mask, loss_agg_mode="seq-mean-token-mean")
    assert float(bonus) == pytest.approx((2.0 + 2.0) / 2)
    assert float(metrics["entropy"]) == pytest.approx(2.0)
    per_token, _ = entropy_bonus(entropy, mask, per_token=True)
    torch.testing.assert_close(per_token, torch.tensor([[1.0, 3.0], [2.0, 0.0]]))
