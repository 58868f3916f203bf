"""The policy-loss variants (gspo, cispo, gpg, clip_cov, kl_cov) against their papers' formulas, written out here
on random fp32 inputs (references in fp64 from the same numbers), values and gradients; and through ActorLoss with
the options the config gives them."""

from __future__ import annotations

import math

import pytest
import torch

from hybridrl.algos.objectives import ActorLoss
from hybridrl.algos.policy_variants import cispo_loss, clip_cov_loss, gpg_loss, gspo_loss, kl_cov_loss
from hybridrl.config.schema_roles import ActorConfig, PolicyLossConfig

TOL = dict(rtol=1e-5, atol=1e-6)


def _inputs(seed: int, b: int = 5, r: int = 7, noise: float = 0.3, per_sequence: bool = True):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, r + 1, (b,), generator=g)
    mask = (torch.arange(r)[None] < lengths[:, None]).float()
    old = -0.5 - torch.rand(b, r, generator=g)
    logp = old + noise * torch.randn(b, r, generator=g)
    adv = torch.randn(b, 1, generator=g).expand(b, r).clone() if per_sequence else torch.randn(b, r, generator=g)
    return logp, old, adv, mask


def _grad(fn, logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = logp.clone().requires_grad_()
    value = fn(x)
    (grad,) = torch.autograd.grad(value, x)
    return value.detach().double(), grad.double()


@pytest.mark.parametrize("seed", range(4))
def test_gspo_equals_the_sequence_level_objective(seed):
    """Zheng et al. 2025: J = 1/G sum_i min(s_i A_i, clip(s_i, 1-eps_l, 1+eps_h) A_i), s_i the geometric mean of
    the token ratios; GSPO-token with seq-mean-token-mean gives the same value and the same gradient."""
    logp, old, adv, mask = _inputs(seed, b=12, noise=0.15)
    low, high = 0.05, 0.08  # narrow: some sequences clipped

    def paper(x: torch.Tensor) -> torch.Tensor:
        x, o, a, m = x.double(), old.double(), adv[:, 0].double(), mask.double()
        s = torch.exp(((x - o) * m).sum(-1) / m.sum(-1))
        return -torch.minimum(s * a, s.clamp(1 - low, 1 + high) * a).mean()

    def ours(x: torch.Tensor) -> torch.Tensor:
        return gspo_loss(x, old, adv, mask, clip_ratio_low=low, clip_ratio_high=high)[0]

    expected, expected_grad = _grad(paper, logp)
    value, grad = _grad(ours, logp)
    torch.testing.assert_close(value.double(), expected, **TOL)
    torch.testing.assert_close(grad.double(), expected_grad, **TOL)
    s = torch.exp(((logp - old) * mask).sum(-1) / mask.sum(-1))
    assert ((s < 1 - low) | (s > 1 + high)).any() and ((s > 1 - low) & (s < 1 + high)).any(), "both regimes tested"
    token = gspo_loss(logp, old, adv, mask, clip_ratio_low=low, clip_ratio_high=high, loss_agg_mode="token-mean")[0]
    assert not torch.allclose(token.double(), value)  # the aggregation matters: the paper's is per sequence


def test_gspo_metrics_count_clipped_sequences():
    mask = torch.ones(2, 3)
    old = torch.zeros(2, 3)
    logp = torch.tensor([[0.3, 0.3, 0.3], [0.0, 0.01, -0.01]])
    _, m = gspo_loss(logp, old, torch.ones(2, 3), mask, clip_ratio_low=0.1, clip_ratio_high=0.1)
    assert float(m["clipfrac"]) == pytest.approx(0.5)  # the first sequence's ratio e^0.3 > 1.1
    assert float(m["seq_ratio_mean"]) == pytest.approx((math.exp(0.3) + 1.0) / 2, rel=1e-6)


@pytest.mark.parametrize("seed", range(3))
def test_cispo_gradient_is_the_clipped_weight_times_reinforce(seed):
    """MiniMax-M1, CISPO: J = sg(clip(r, 1-eps_l, 1+eps_h)) * A * log pi; grad l = -clip(r) * A * grad log pi, also
    on clipped tokens (PPO gives them none)."""
    logp, old, adv, mask = _inputs(seed, per_sequence=False, noise=0.5)
    low, high = 0.1, 0.2
    ratio = torch.exp(logp.double() - old.double())
    weight = ratio.clamp(1 - low, 1 + high)
    count = mask.sum()
    value, grad = _grad(lambda x: cispo_loss(x, old, adv, mask, clip_ratio_low=low, clip_ratio_high=high)[0], logp)
    torch.testing.assert_close(value.double(), (-weight * adv * logp * mask).sum() / count, **TOL)
    torch.testing.assert_close(grad.double(), -weight * adv * mask / count, **TOL)
    # without the stop-gradient the weight's own derivative (r * A * log pi inside the clip range) would add in
    inside = ((ratio > 1 - low) & (ratio < 1 + high)).double()
    assert not torch.allclose(grad.double(), (-weight * adv - inside * ratio * adv * logp) * mask / count, **TOL)
    clipped = (weight != ratio) & mask.bool()
    assert clipped.any() and (grad[clipped] != 0).all()


def test_gpg_is_the_plain_policy_gradient():
    logp, old, adv, mask = _inputs(5, per_sequence=False)
    value, grad = _grad(lambda x: gpg_loss(x, old, adv, mask)[0], logp)
    torch.testing.assert_close(value, ((-adv * logp * mask).sum() / mask.sum()).double(), **TOL)
    torch.testing.assert_close(grad, (-adv * mask / mask.sum()).double(), **TOL)


def _cov_by_hand(logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor) -> dict[tuple[int, int], float]:
    """Cui et al. 2025: Cov_t = (logp_t - mean logp)(A_t - mean A), means over the valid tokens."""
    cells = [(i, t) for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i, t]]
    mean_logp = sum(float(logp[c]) for c in cells) / len(cells)
    mean_adv = sum(float(adv[c]) for c in cells) / len(cells)
    return {c: (float(logp[c]) - mean_logp) * (float(adv[c]) - mean_adv) for c in cells}


def _ppo_token(logp: float, old: float, a: float, low: float, high: float) -> float:
    ratio = math.exp(logp - old)
    return max(-a * ratio, -a * min(max(ratio, 1 - low), 1 + high))


@pytest.mark.parametrize("seed", range(3))
def test_kl_cov_adds_the_kl_term_on_the_top_covariance_tokens(seed):
    logp, old, adv, mask = _inputs(seed, per_sequence=False, b=6, r=8)
    ratio_k, beta = 0.15, 0.7
    cov = _cov_by_hand(logp, adv, mask)
    k = max(int(ratio_k * len(cov)), 1)
    top = set(sorted(cov, key=cov.get, reverse=True)[:k])
    expected = torch.zeros_like(logp, dtype=torch.float64)
    expected_grad = torch.zeros_like(expected)
    for c in cov:
        r = math.exp(float(logp[c]) - float(old[c]))
        expected[c] = -float(adv[c]) * r + (beta * abs(float(logp[c] - old[c])) if c in top else 0.0)
        expected_grad[c] = -float(adv[c]) * r + (beta * math.copysign(1.0, float(logp[c] - old[c])) if c in top else 0)
    _, grad = _grad(
        lambda x: kl_cov_loss(x, old, adv, mask, kl_cov_ratio=ratio_k, ppo_kl_coef=beta, per_token=True)[0].sum(), logp
    )
    per_token, metrics = kl_cov_loss(logp, old, adv, mask, kl_cov_ratio=ratio_k, ppo_kl_coef=beta, per_token=True)
    torch.testing.assert_close(per_token.double(), expected, **TOL)
    torch.testing.assert_close(grad.double(), expected_grad, **TOL)
    assert float(metrics["kl_cov_frac"]) == pytest.approx(k / len(cov))


@pytest.mark.parametrize("seed", range(3))
def test_clip_cov_detaches_k_band_tokens_and_keeps_ppo_elsewhere(seed):
    logp, old, adv, mask = _inputs(seed, per_sequence=False, b=8, r=8, noise=0.4)
    adv = adv * 3  # covariances reach the band (1, 5)
    low, high, lb, ub, share = 0.2, 0.28, 0.2, 5.0, 0.05
    cov = _cov_by_hand(logp, adv, mask)
    ppo = {c: _ppo_token(float(logp[c]), float(old[c]), float(adv[c]), low, high) for c in cov}
    unclipped = {c: -float(adv[c]) * math.exp(float(logp[c] - old[c])) for c in cov}
    band = {c for c in cov if lb < cov[c] < ub and ppo[c] <= unclipped[c]}  # in the band and not clipped by PPO
    k = min(max(int(share * len(cov)), 1), len(band))
    assert len(band) > k > 0, "the draw is a strict subset"
    opts = dict(clip_ratio_low=low, clip_ratio_high=high, clip_cov_ratio=share, clip_cov_lb=lb, clip_cov_ub=ub)
    x = logp.clone().requires_grad_()
    loss, metrics = clip_cov_loss(x, old, adv, mask, per_token=True, **opts)
    loss.sum().backward()
    loss = loss.detach()
    zeroed = {c for c in cov if loss[c] == 0 and ppo[c] != 0}
    assert len(zeroed) == k and zeroed <= band
    for c in cov:
        expected = 0.0 if c in zeroed else ppo[c]
        assert float(loss[c]) == pytest.approx(expected, rel=1e-5, abs=1e-6)
        if c in zeroed:
            assert x.grad[c] == 0
    assert float(metrics["clip_cov_frac"]) == pytest.approx(k / len(cov))
    again, _ = clip_cov_loss(logp, old, adv, mask, per_token=True, **opts)
    torch.testing.assert_close(again, loss, rtol=0, atol=0)  # same inputs, same draw (every TP rank)
    everything, _ = clip_cov_loss(logp, old, adv, mask, per_token=True, **{**opts, "clip_cov_ratio": 1.0})
    assert {c for c in cov if everything[c] == 0 and ppo[c] != 0} == band  # k >= |band|: the whole band


@pytest.mark.parametrize("mode", ["gspo", "cispo", "gpg", "clip_cov", "kl_cov"])
def test_every_variant_runs_through_the_actor_loss_with_its_config(mode):
    """ActorLoss passes each loss only the options it names (gspo has no dual clip, gpg no clip at all)."""
    logp, old, adv, mask = _inputs(1, per_sequence=False)
    agg = "seq-mean-token-mean" if mode == "gspo" else "token-mean"
    policy = PolicyLossConfig(loss_mode=mode, kl_cov_ratio=0.3, ppo_kl_coef=0.5, clip_cov_ratio=0.3)
    cfg = ActorConfig(policy_loss=policy, loss_agg_mode=agg, clip_ratio_high=0.28, loss_scale_factor=7.0)
    objective = ActorLoss(cfg)
    loss, metrics = objective({"log_probs": logp, "entropy": torch.zeros_like(logp)},
                              {"response_mask": mask, "old_log_probs": old, "advantages": adv})  # fmt: skip
    assert loss.shape == mask.shape and (loss[mask == 0] == 0).all() and torch.isfinite(loss).all()
    assert "approx_kl" in metrics
    options = dict(objective.options)
    assert options.pop("per_token") is True
    fn = {"gspo": gspo_loss, "cispo": cispo_loss, "gpg": gpg_loss, "clip_cov": clip_cov_loss, "kl_cov": kl_cov_loss}
    direct, _ = fn[mode](logp, old, adv, mask, per_token=True, **options)
    torch.testing.assert_close(loss, direct, rtol=0, atol=0)
    if mode == "kl_cov":
        assert options["kl_cov_ratio"] == 0.3 and options["ppo_kl_coef"] == 0.5 and "clip_ratio_low" not in options
    if mode == "gpg":
        assert set(options) == {"loss_agg_mode", "loss_scale_factor"}
