"""The actor's and critic's per-token losses composed from the registries, against the papers' formulas written
out here; the policy loss picked by actor.policy_loss (registry names, verl's "vanilla", a user's file)."""

from __future__ import annotations

import math

import pytest
import torch

from hybridrl.algos.objectives import ActorLoss, CriticLoss
from hybridrl.config.schema_roles import ActorConfig, CriticConfig, PolicyLossConfig

G = torch.Generator().manual_seed(7)
B, R = 3, 5
MASK = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 1, 1, 0]])
OLD = -1.0 - torch.rand(B, R, generator=G, dtype=torch.float64)
LOGP = OLD + 0.4 * torch.randn(B, R, generator=G, dtype=torch.float64)
REF = OLD + 0.3 * torch.randn(B, R, generator=G, dtype=torch.float64)
ADV = torch.randn(B, R, generator=G, dtype=torch.float64) * 2
ENT = torch.rand(B, R, generator=G, dtype=torch.float64) * 3


def _ppo_by_hand(logp: float, old: float, adv: float, low=0.2, high=0.28, c=3.0) -> float:
    """Schulman et al. 2017 eq. 7 with clip-higher (DAPO) and dual clip (Ye et al. 2020) for A < 0."""
    ratio = math.exp(logp - old)
    loss = max(-adv * ratio, -adv * min(max(ratio, 1 - low), 1 + high))
    return min(loss, -adv * c) if adv < 0 else loss


def _batch() -> dict[str, torch.Tensor]:
    return {"response_mask": MASK, "old_log_probs": OLD, "advantages": ADV, "ref_log_probs": REF}


def test_actor_loss_is_pg_minus_entropy_plus_kl_per_token():
    cfg = ActorConfig(clip_ratio_high=0.28, entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1,
                      kl_loss_type="low_var_kl")  # fmt: skip
    objective = ActorLoss(cfg)
    assert objective.inputs == ("old_log_probs", "advantages", "ref_log_probs")
    logp = LOGP.clone().requires_grad_()
    loss, metrics = objective({"log_probs": logp, "entropy": ENT}, _batch())
    expected = torch.zeros(B, R, dtype=torch.float64)
    for i in range(B):
        for t in range(R):
            if MASK[i, t]:
                x = float(REF[i, t] - LOGP[i, t])
                k3 = math.exp(x) - x - 1  # Schulman 2020's k3 (GRPO's KL term, Shao et al. 2024 eq. 4)
                pg = _ppo_by_hand(float(LOGP[i, t]), float(OLD[i, t]), float(ADV[i, t]), high=0.28)
                expected[i, t] = pg - 0.01 * float(ENT[i, t]) + 0.1 * k3
    torch.testing.assert_close(loss.detach(), expected)
    assert {"clipfrac", "clipfrac_lower", "approx_kl", "entropy", "kl_loss"} <= set(metrics)
    assert "ref_log_probs" not in ActorLoss(ActorConfig()).inputs  # no KL loss: no reference needed


def test_straight_through_kl_loss_takes_k2s_gradient():
    cfg = ActorConfig(use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type="k3+")
    logp = LOGP.clone().requires_grad_()
    loss_plus, _ = ActorLoss(cfg)({"log_probs": logp, "entropy": ENT}, _batch())
    loss_plus.sum().backward()
    grad_plus = logp.grad.clone()
    logp.grad = None
    no_kl, _ = ActorLoss(ActorConfig())({"log_probs": logp, "entropy": ENT}, _batch())
    no_kl.sum().backward()
    # d/dlogp of 0.5 * 0.5 * (logp - ref)^2 on valid tokens, on top of the policy loss's gradient
    torch.testing.assert_close(grad_plus - logp.grad, 0.5 * (LOGP - REF) * MASK)


def test_vanilla_is_verls_name_for_ppo_clip():
    outputs = {"log_probs": LOGP, "entropy": ENT}
    a, _ = ActorLoss(ActorConfig(policy_loss=PolicyLossConfig(loss_mode="vanilla")))(outputs, _batch())
    b, _ = ActorLoss(ActorConfig())(outputs, _batch())
    torch.testing.assert_close(a, b, rtol=0, atol=0)


CUSTOM = '''
import torch

def reinforce(log_prob, old_log_prob, advantages, response_mask, *, per_token, **options):
    """-A * log pi, with the options the actor passes recorded in the metrics."""
    loss = torch.where(response_mask.bool(), -advantages * log_prob, torch.zeros_like(log_prob))
    return (loss if per_token else loss.sum()), {"seen": torch.tensor(float(len(options)))}

def wrong_shape(log_prob, old_log_prob, advantages, response_mask, **options):
    return log_prob.sum(), {}
'''


def test_custom_policy_loss_from_a_file(tmp_path):
    path = tmp_path / "my_loss.py"
    path.write_text(CUSTOM)
    cfg = ActorConfig(policy_loss=PolicyLossConfig(loss_mode="custom", path=str(path), name="reinforce"))
    loss, metrics = ActorLoss(cfg)({"log_probs": LOGP, "entropy": ENT}, _batch())
    torch.testing.assert_close(loss, -ADV * LOGP * MASK)  # entropy_coeff 0, no KL
    assert float(metrics["seen"]) == 5  # clip ratios (3), loss_agg_mode, loss_scale_factor, by keyword
    bad = ActorLoss(ActorConfig(policy_loss=PolicyLossConfig(loss_mode="custom", path=str(path), name="wrong_shape")))
    with pytest.raises(ValueError, match=r"actor\.policy_loss\.path: .* returned a loss of shape \(\)"):
        bad({"log_probs": LOGP, "entropy": ENT}, _batch())


@pytest.mark.parametrize(
    ("policy_loss", "message"),
    [
        (PolicyLossConfig(loss_mode="gspo2"), r"actor\.policy_loss\.loss_mode \('gspo2'\) must be one of"),
        (PolicyLossConfig(loss_mode="custom"), r"actor\.policy_loss\.path \(None\) must be a \.py file"),
        (PolicyLossConfig(loss_mode="ppo_clip", path="x.py"), "set actor.policy_loss.loss_mode=custom"),
        (
            PolicyLossConfig(loss_mode="custom", path="FILE", name="nope"),
            r"actor\.policy_loss\.name 'nope' is not a function",
        ),
        (PolicyLossConfig(loss_mode="custom", path="BROKEN"), r"failed to import \(ZeroDivisionError"),
    ],
)
def test_policy_loss_errors_are_one_line(tmp_path, policy_loss, message):
    (tmp_path / "ok.py").write_text(CUSTOM)
    (tmp_path / "broken.py").write_text("1 / 0\n")
    paths = {"FILE": str(tmp_path / "ok.py"), "BROKEN": str(tmp_path / "broken.py")}
    policy_loss.path = paths.get(policy_loss.path, policy_loss.path)
    with pytest.raises(ValueError, match=message) as err:
        ActorLoss(ActorConfig(policy_loss=policy_loss))
    assert "\n" not in str(err.value)


def test_critic_loss_is_the_clipped_value_loss():
    values = torch.tensor([[1.0, 1.0, 0.2, 5.0]])
    batch = {"values": torch.zeros(1, 4), "returns": torch.tensor([[0.0, 2.0, 1.0, 0.0]]),
             "response_mask": torch.tensor([[1, 1, 1, 0]])}  # fmt: skip
    loss, metrics = CriticLoss(CriticConfig(cliprange_value=0.5))({"values": values}, batch)
    # 0.5 * max((V - R)^2, (V_clip - R)^2), V_clip = V_old + clip(V - V_old, -0.5, 0.5) (PPO2 / Engstrom et al.)
    torch.testing.assert_close(loss, torch.tensor([[0.5 * 1.0, 0.5 * 1.5**2, 0.5 * 0.8**2, 0.0]]))
    assert "vf_clipfrac" in metrics and CriticLoss.inputs == ("values", "returns")


@pytest.mark.parametrize("coeff", [0.0, 0.01])
def test_entropy_takes_a_gradient_only_with_an_entropy_bonus(coeff):
    """Without the bonus (``entropy_coeff: 0``, the default) the entropy is a metric: no gradient reaches it, so the
    log-prob head's backward skips its term; the loss and the log-probs' gradient are those of
    ``pg - 0 * H``, bitwise. With a bonus, ``-coeff`` per unmasked token reaches the entropy."""
    cfg = ActorConfig(entropy_coeff=coeff, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl")
    logp, ent = LOGP.clone().requires_grad_(), ENT.clone().requires_grad_()
    loss, metrics = ActorLoss(cfg)({"log_probs": logp, "entropy": ent}, _batch())
    loss.sum().backward()
    assert metrics["entropy"].item() == pytest.approx(float(ENT[MASK.bool()].mean()))
    if coeff == 0.0:
        assert ent.grad is None
        logp_before, ent_before = LOGP.clone().requires_grad_(), ENT.clone().requires_grad_()
        pg, _ = ActorLoss(cfg)({"log_probs": logp_before, "entropy": ENT}, _batch())
        before = pg - 0.0 * ent_before  # the former composition: the entropy times 0, kept in the graph
        before.sum().backward()
        assert torch.equal(loss.detach(), before.detach())
        assert torch.equal(logp.grad, logp_before.grad)
        assert torch.equal(ent_before.grad, torch.zeros_like(ENT))
    else:
        assert torch.equal(ent.grad, -coeff * MASK.to(ent.dtype))
