"""Rollout correction (TIS weights, MIS masks) against the definitions written out here per token and per sequence
(Yao et al. 2025; verl's rollout-correction names), its metrics, and the actor's loss with the weights: value and
gradient are the weight times PPO's, the weight itself a constant."""

from __future__ import annotations

import math

import pytest
import torch

from hybridrl.algos.objectives import ActorLoss
from hybridrl.algos.rollout_correction import rollout_correction
from hybridrl.config.schema import RolloutCorrectionConfig
from hybridrl.config.schema_roles import ActorConfig


def _inputs(seed: int, b: int = 6, r: int = 5, noise: float = 0.4):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, r + 1, (b,), generator=g)
    mask = (torch.arange(r)[None] < lengths[:, None]).long()
    rollout = -0.5 - torch.rand(b, r, generator=g)
    old = rollout + noise * torch.randn(b, r, generator=g)
    return old, rollout, mask


def _seqs(mask: torch.Tensor) -> list[list[tuple[int, int]]]:
    return [[(i, t) for t in range(mask.shape[1]) if mask[i, t]] for i in range(mask.shape[0])]


@pytest.mark.parametrize("seed", range(3))
def test_token_and_sequence_tis_weights(seed):
    old, rollout, mask = _inputs(seed)
    c = 1.3
    w_tok, m_tok, metrics = rollout_correction(old, rollout, mask, rollout_is="token", rollout_is_threshold=c)
    w_seq, _, _ = rollout_correction(old, rollout, mask, rollout_is="sequence", rollout_is_threshold=c)
    truncated, count = 0, 0
    for seq in _seqs(mask):
        product = math.exp(sum(float(old[x] - rollout[x]) for x in seq))
        for x in seq:
            rho = math.exp(float(old[x] - rollout[x]))
            assert float(w_tok[x]) == pytest.approx(min(rho, c), rel=1e-6)  # TIS: min(pi_old / pi_rollout, C)
            assert float(w_seq[x]) == pytest.approx(min(product, c), rel=1e-5)
            truncated, count = truncated + (rho > c), count + 1
    assert (w_tok[mask == 0] == 0).all() and (w_seq[mask == 0] == 0).all()
    assert torch.equal(m_tok, mask)  # weights only: nothing masked
    assert metrics["rollout_corr/is_truncated_frac"] == pytest.approx(truncated / count)
    assert 0 < truncated < count


@pytest.mark.parametrize(("level", "upper", "lower"), [("token", 1.4, None), ("sequence", 2.0, 0.6),
                                                       ("geometric", 1.2, 0.9)])  # fmt: skip
def test_mis_masks_what_leaves_the_bounds(level, upper, lower):
    old, rollout, mask = _inputs(7, b=10)
    weights, out, metrics = rollout_correction(old, rollout, mask, rollout_rs=level, rollout_rs_threshold=upper,
                                               rollout_rs_threshold_lower=lower)  # fmt: skip
    assert weights is None
    low = 1 / upper if lower is None else lower
    masked = total = lost = 0
    for seq in _seqs(mask):
        logs = [float(old[x] - rollout[x]) for x in seq]
        ratios = {
            "token": [math.exp(v) for v in logs],
            "sequence": [math.exp(sum(logs))] * len(seq),
            "geometric": [math.exp(sum(logs) / len(logs))] * len(seq),
        }[level]
        for x, ratio in zip(seq, ratios, strict=True):
            keep = low <= ratio <= upper
            assert int(out[x]) == int(keep), (x, ratio)
            masked, total = masked + (not keep), total + 1
        lost += any(not (low <= q <= upper) for q in ratios)
    assert (out[mask == 0] == 0).all()
    assert metrics["rollout_corr/masked_token_frac"] == pytest.approx(masked / total)
    assert metrics["rollout_corr/masked_seq_frac"] == pytest.approx(lost / mask.shape[0])
    assert 0 < masked < total, "both kept and masked tokens"


def test_threshold_defaults_follow_verl():
    """rollout_rs_threshold None = rollout_is_threshold; the lower bound None = 1 / the upper."""
    old, rollout, mask = _inputs(3)
    _, a, _ = rollout_correction(old, rollout, mask, rollout_rs="token", rollout_is_threshold=1.5)
    _, b, _ = rollout_correction(old, rollout, mask, rollout_rs="token", rollout_rs_threshold=1.5,
                                 rollout_rs_threshold_lower=1 / 1.5)  # fmt: skip
    assert torch.equal(a, b)


def test_actor_loss_with_tis_is_the_weight_times_ppo_and_the_weight_has_no_gradient():
    old_policy, rollout, mask = _inputs(11)
    g = torch.Generator().manual_seed(4)
    logp = old_policy + 0.3 * torch.randn(old_policy.shape, generator=g)
    adv = torch.randn(old_policy.shape, generator=g)
    weights, _, _ = rollout_correction(old_policy, rollout, mask, rollout_is="token", rollout_is_threshold=1.5)
    batch = {"response_mask": mask, "old_log_probs": old_policy, "advantages": adv, "rollout_is_weights": weights}
    corrected = ActorLoss(ActorConfig(), RolloutCorrectionConfig(rollout_is="token"))
    plain = ActorLoss(ActorConfig())
    assert corrected.inputs[-1] == "rollout_is_weights" and "rollout_is_weights" not in plain.inputs
    grads = []
    for objective in (corrected, plain):
        x = logp.clone().requires_grad_()
        loss, _ = objective({"log_probs": x, "entropy": torch.zeros_like(x)}, batch)
        loss.sum().backward()
        grads.append((loss.detach(), x.grad))
    (loss_w, grad_w), (loss_p, grad_p) = grads
    torch.testing.assert_close(loss_w, weights * loss_p, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad_w, weights * grad_p, rtol=1e-6, atol=1e-7)  # w scales the gradient
    assert not torch.allclose(grad_w, grad_p)
