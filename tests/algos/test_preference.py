"""The DPO recipe's losses against the papers' formulas, written out here per pair with Python floats.

Independent of :mod:`hybridrl.algos.preference`: each formula is the paper's equation in scalar form (DPO eq. 7,
cDPO's smoothed labels, robust DPO eq. 6, IPO eq. 17, SimPO eq. 6), and the per-sequence weights are the
closed-form derivatives of those scalars (the surrogate's gradient must equal the loss's).
"""

from __future__ import annotations

import math

import pytest
import torch

from hybridrl.algos.preference import preference_loss, sequence_weights


def _logsig(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def _sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def paper_loss(kind, pc, pr, rc, rr, lc, lr, beta, eps, gamma) -> float:
    """One pair's loss, as each paper writes it."""
    h = (pc - rc) - (pr - rr)
    if kind == "sigmoid":  # Rafailov et al. 2023 eq. 7; cDPO: expectation over a label flipped w.p. eps
        return -(1 - eps) * _logsig(beta * h) - eps * _logsig(-beta * h)
    if kind == "robust":  # Chowdhury et al. 2024 eq. 6
        return ((1 - eps) * -_logsig(beta * h) - eps * -_logsig(-beta * h)) / (1 - 2 * eps)
    if kind == "ipo":  # Azar et al. 2023 eq. 17, tau = beta
        return (h - 1 / (2 * beta)) ** 2
    z = beta / lc * pc - beta / lr * pr - gamma  # Meng et al. 2024 eq. 6
    return -(1 - eps) * _logsig(z) - eps * _logsig(-z)


def paper_grad(kind, pc, pr, rc, rr, lc, lr, beta, eps, gamma) -> tuple[float, float]:
    """d loss / d log pi(y_w|x) and d loss / d log pi(y_l|x) of one pair, by hand."""
    h = (pc - rc) - (pr - rr)
    if kind == "sigmoid":
        d = -(1 - eps) * beta * _sig(-beta * h) + eps * beta * _sig(beta * h)
    elif kind == "robust":
        d = (-(1 - eps) * beta * _sig(-beta * h) - eps * beta * _sig(beta * h)) / (1 - 2 * eps)
    elif kind == "ipo":
        d = 2 * (h - 1 / (2 * beta))
    else:
        z = beta / lc * pc - beta / lr * pr - gamma
        dz = -(1 - eps) * _sig(-z) + eps * _sig(z)
        return dz * beta / lc, -dz * beta / lr
    return d, -d


CASES = [("sigmoid", 0.0), ("sigmoid", 0.2), ("robust", 0.1), ("ipo", 0.0), ("simpo", 0.0), ("simpo", 0.1)]


@pytest.mark.parametrize(("kind", "eps"), CASES)
def test_losses_and_weights_equal_the_papers(kind, eps):
    g = torch.Generator().manual_seed(0)
    k, beta, gamma = 6, 0.3, 0.7
    pc, pr, rc, rr = (-20 * torch.rand(k, generator=g, dtype=torch.float64) for _ in range(4))
    lc, lr = torch.randint(1, 9, (k,), generator=g), torch.randint(1, 9, (k,), generator=g)
    opts = dict(loss_type=kind, beta=beta, label_smoothing=eps, simpo_gamma=gamma)
    losses, chosen, rejected = preference_loss(pc, pr, rc, rr, lc, lr, **opts)
    rows = list(zip(pc.tolist(), pr.tolist(), rc.tolist(), rr.tolist(), lc.tolist(), lr.tolist(), strict=True))
    want = [paper_loss(kind, *r, beta, eps, gamma) for r in rows]
    torch.testing.assert_close(losses, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    ref = None if kind == "simpo" else torch.cat([rc, rr])
    weights, metrics = sequence_weights(torch.cat([pc, pr]), ref, torch.cat([lc, lr]), **opts)
    grads = [paper_grad(kind, *r, beta, eps, gamma) for r in rows]
    want_w = torch.tensor([a for a, _ in grads] + [b for _, b in grads], dtype=torch.float64) / k  # mean over pairs
    torch.testing.assert_close(weights, want_w, rtol=1e-10, atol=1e-12)
    assert metrics["dpo/loss"] == pytest.approx(sum(want) / k, rel=1e-12)
    if kind == "simpo":  # reference-free reward: beta * average log-prob
        torch.testing.assert_close(chosen, beta * pc / lc)
    else:
        torch.testing.assert_close(chosen, beta * (pc - rc))
        torch.testing.assert_close(rejected, beta * (pr - rr))
    assert metrics["dpo/accuracy"] == pytest.approx(float((chosen > rejected).double().mean()))
    assert metrics["dpo/margin"] == pytest.approx(float((chosen - rejected).mean()))


def test_policy_equal_to_reference_is_chance():
    """At the start of DPO (policy = reference) every reward is 0: loss log 2, no pair counted as won."""
    logps = torch.tensor([-3.0, -5.0, -4.0, -2.0])
    weights, m = sequence_weights(logps, logps.clone(), torch.tensor([3, 3, 3, 3]), loss_type="sigmoid", beta=0.1)
    assert m["dpo/loss"] == pytest.approx(math.log(2))
    assert m["dpo/accuracy"] == 0.0 and m["dpo/margin"] == 0.0
    torch.testing.assert_close(weights, torch.tensor([-0.025, -0.025, 0.025, 0.025]))  # -beta * sigma(0) / k


def test_unknown_loss_and_missing_reference_are_one_line_errors():
    x = torch.zeros(2)
    with pytest.raises(ValueError, match=r"dpo.loss_type \('kto'\) must be one of"):
        preference_loss(x, x, x, x, x, x, loss_type="kto")
    with pytest.raises(ValueError, match="needs the reference"):
        preference_loss(x, x, None, None, x, x, loss_type="sigmoid")
