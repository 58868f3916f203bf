"""KL estimators (vs. torch.distributions' exact KL), the reward penalty, the KL loss and the controllers."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridrl.algos.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    get_kl_estimator,
    kl_loss,
    kl_penalty,
    make_kl_controller,
)
from hybridrl.config.schema import KLControlConfig
from hybridrl.config.schema_roles import KL_TYPES

SETTINGS = settings(max_examples=40, deadline=None)
LOGPS = st.floats(-30.0, 0.0)


VERL_NAMES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")  # verl's config docs: kl_loss_type / kl_penalty


def test_names_match_config_and_verl():
    assert set(KL_ESTIMATORS) == set(KL_TYPES) == {*VERL_NAMES, *(f"{n}+" for n in VERL_NAMES)}
    for a, b in (("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3"), ("kl+", "k1+"), ("low_var_kl+", "k3+")):
        assert KL_ESTIMATORS[a] is KL_ESTIMATORS[b]


def test_unknown_and_full_are_one_line_errors():
    with pytest.raises(ValueError, match="KL type") as err:
        get_kl_estimator("k4")
    assert "\n" not in str(err.value) and all(name in str(err.value) for name in KL_ESTIMATORS)
    with pytest.raises(ValueError, match=r"'full'.*low_var_kl"):
        get_kl_estimator("full")


def test_hand_values():
    logp, ref = torch.tensor([0.0]), torch.tensor([math.log(0.5)])
    assert float(kl_penalty(logp, ref, "k1")) == pytest.approx(math.log(2))
    assert float(kl_penalty(ref, logp, "abs")) == pytest.approx(math.log(2))
    assert float(kl_penalty(logp, ref, "k2")) == pytest.approx(0.5 * math.log(2) ** 2)
    assert float(kl_penalty(logp, ref, "k3")) == pytest.approx(0.5 + math.log(2) - 1)


@given(LOGPS, LOGPS)
@SETTINGS
def test_estimators_nonnegative_and_zero_when_equal(logp, ref):
    a, b = torch.tensor([logp], dtype=torch.float64), torch.tensor([ref], dtype=torch.float64)
    for name in ("abs", "k2", "k3"):
        assert float(kl_penalty(a, b, name)) >= 0.0
    for name in KL_ESTIMATORS:
        assert float(kl_penalty(a, a, name)) == 0.0


def _verl_forward(logp: torch.Tensor, ref: torch.Tensor, name: str) -> torch.Tensor:
    """The estimators as verl's docs and Schulman (2020) define them (k3: x = ref - logp clamped to [-20, 20],
    the result clamped to [-10, 10])."""
    base = name.rstrip("+")
    if base in ("kl", "k1"):
        return logp - ref
    if base == "abs":
        return (logp - ref).abs()
    if base in ("mse", "k2"):
        return 0.5 * (logp - ref) ** 2
    x = (ref - logp).clamp(-20, 20)
    return (x.exp() - x - 1).clamp(-10, 10)


@pytest.mark.parametrize("name", VERL_NAMES)
def test_straight_through_has_the_base_value_and_k2s_gradient(name):
    """verl: a trailing '+' keeps the estimator's value and takes k2's gradient, d/dlogp 0.5 (logp - ref)^2."""
    g = torch.Generator().manual_seed(3)
    logp = (torch.randn(64, generator=g, dtype=torch.float64) * 3).requires_grad_()
    ref = torch.randn(64, generator=g, dtype=torch.float64) * 3
    plus = kl_penalty(logp, ref, f"{name}+")
    torch.testing.assert_close(plus, _verl_forward(logp, ref, name).detach(), rtol=0, atol=1e-12)
    plus.sum().backward()
    torch.testing.assert_close(logp.grad, (logp - ref).detach())
    logp.grad = None
    kl_penalty(logp, ref, name).sum().backward()  # the plain estimator keeps its own gradient
    if name not in ("mse", "k2"):
        assert not torch.allclose(logp.grad, (logp - ref).detach())


def test_estimators_match_verls_formulas_k3_clamped_at_zero_not_minus_ten():
    """Equal to verl's definitions; k3 differs only where rounding makes exp(x) - x - 1 negative (|x| tiny):
    verl keeps the few-ulp negative value, here it is 0."""
    g = torch.Generator().manual_seed(4)
    for dtype, band in ((torch.float64, 1e-15), (torch.float32, 1e-7)):
        logp = torch.cat([torch.randn(4000, generator=g) * 10, torch.randn(4000, generator=g) * 1e-4]).to(dtype)
        ref = torch.cat([torch.randn(4000, generator=g) * 10, torch.zeros(4000)]).to(dtype)
        for name in VERL_NAMES:
            ours, verl = kl_penalty(logp, ref, name), _verl_forward(logp, ref, name)
            assert (ours - verl).abs().max() <= band, (name, dtype)
            if name in ("k3", "low_var_kl"):
                assert (ours == verl)[verl >= 0].all() and (ours[verl < 0] == 0).all()


def test_k1_and_k3_are_unbiased_estimates_of_the_exact_kl():
    """Sampled tokens y ~ p: E[k1] = E[k3] = KL(p || q), computed exactly by torch.distributions."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, generator=g, dtype=torch.float64)
    p = torch.distributions.Categorical(logits=logits)
    q = torch.distributions.Categorical(logits=logits + 0.3 * torch.randn(8, generator=g, dtype=torch.float64))
    exact = float(torch.distributions.kl_divergence(p, q))
    y = torch.multinomial(p.probs, 200_000, replacement=True, generator=g)
    logp, ref = p.log_prob(y), q.log_prob(y)
    for name in ("k1", "k3"):
        assert float(kl_penalty(logp, ref, name).mean()) == pytest.approx(exact, rel=0.03)
    assert kl_penalty(logp, ref, "k3").var() < kl_penalty(logp, ref, "k1").var()  # the point of k3 (p close to q)


# --- reward penalty and loss ---------------------------------------------------------------------------


def test_apply_kl_penalty_subtracts_beta_kl_on_valid_tokens():
    scores = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 2.0]])
    logp = torch.tensor([[-1.0, -1.0, -5.0], [-2.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.5, -0.5, 0.0], [-1.0, -1.0, -2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    ctrl = FixedKLController(0.1)
    rewards, metrics = apply_kl_penalty(scores, logp, ref, mask, ctrl, kl_type="k1")
    kl = torch.tensor([[0.5, -0.5, 0.0], [-1.0, 0.0, 1.0]])
    torch.testing.assert_close(rewards, (scores - 0.1 * kl) * mask)
    assert metrics["kl"] == pytest.approx((0.0 / 2 + 0.0 / 3) / 2)
    assert metrics["kl_coef"] == 0.1 and ctrl.value == 0.1


def test_apply_kl_penalty_updates_adaptive_controller():
    logp, ref, mask = torch.zeros(4, 3), torch.full((4, 3), -1.0), torch.ones(4, 3)  # k1 = 1 per token
    ctrl = AdaptiveKLController(0.2, target_kl=0.5, horizon=100)
    _, metrics = apply_kl_penalty(torch.zeros(4, 3), logp, ref, mask, ctrl)
    assert metrics["kl"] == pytest.approx(1.0) and metrics["kl_coef"] == 0.2
    assert ctrl.value == pytest.approx(0.2 * (1 + 0.2 * 4 / 100))  # error 1/0.5 - 1 = 1, clipped to 0.2


def test_kl_loss_matches_estimator_and_has_gradient():
    g = torch.Generator().manual_seed(1)
    logp = torch.randn(2, 5, generator=g).requires_grad_()
    ref = torch.randn(2, 5, generator=g)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.0], [1.0] * 5])
    loss, metrics = kl_loss(logp, ref, mask, kl_type="low_var_kl", loss_agg_mode="token-mean")
    expected = kl_penalty(logp, ref, "k3")[mask.bool()].mean()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(metrics["kl_loss"], expected.detach())
    loss.backward()
    assert (logp.grad[mask == 0] == 0).all() and logp.grad[mask == 1].abs().sum() > 0
    per_token, _ = kl_loss(logp, ref, mask, per_token=True)
    assert per_token.shape == (2, 5) and (per_token[mask == 0] == 0).all()


# --- controllers ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("measured", "direction"), [(0.3, 1), (0.1, 0), (0.05, -1), (10.0, 1)])
def test_adaptive_controller_moves_towards_target(measured, direction):
    ctrl = AdaptiveKLController(0.1, target_kl=0.1, horizon=1000)
    ctrl.update(measured, n_steps=100)
    assert (ctrl.value > 0.1) - (ctrl.value < 0.1) == direction
    assert abs(ctrl.value / 0.1 - 1) <= 0.2 * 100 / 1000 + 1e-12  # proportional error clipped to +-0.2


def test_make_kl_controller():
    fixed = make_kl_controller(KLControlConfig(type="fixed", kl_coef=0.05))
    fixed.update(100.0, n_steps=1000)
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.05
    adaptive = make_kl_controller(KLControlConfig(type="adaptive", kl_coef=0.05, target_kl=0.2, horizon=50))
    assert isinstance(adaptive, AdaptiveKLController) and (adaptive.target, adaptive.horizon) == (0.2, 50)
    with pytest.raises(ValueError, match=r"algorithm\.kl_ctrl\.type \('pid'\)"):
        make_kl_controller(KLControlConfig(type="pid"))
    with pytest.raises(ValueError, match="horizon"):
        make_kl_controller(KLControlConfig(type="adaptive", horizon=0))
