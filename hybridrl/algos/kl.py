"""KL(policy || reference) per token: the estimators (k1, abs, k2, k3, their aliases and straight-through
variants), KL as a reward penalty (:func:`apply_kl_penalty`) and as a loss (:func:`kl_loss`), and the fixed /
adaptive coefficient controllers.

All estimators work on the log-probs of the sampled tokens only, ``logp = log pi(y_t)`` and
``ref = log pi_ref(y_t)``, with ``y_t ~ pi`` (Schulman 2020, "Approximating KL Divergence",
http://joschu.net/blog/kl-approx.html). Names match ``hybridrl.config.schema_roles.KL_TYPES`` (verl's:
``kl_loss_type`` / ``kl_penalty`` in verl's config docs); "full" (the exact KL over the vocabulary) needs the
whole distributions and is refused with an explanation.

A name with a trailing "+" (``k1+``, ``k3+``, ``low_var_kl+``, ``abs+``, ...) is straight-through, as verl
defines it: the VALUE of the base estimator with the GRADIENT of k2,

    k_+ = k2 - sg(k2) + sg(k_base)          (sg = stop-gradient)

because k1 and k3 are unbiased for the KL's value but their expected gradients are not the KL's gradient,
while k2's is (Schulman 2020; verl PR #2953).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from hybridrl.algos.losses import LossOutput, reduce_loss
from hybridrl.algos.masked import masked_mean
from hybridrl.config.schema import KL_CTRL_TYPES, KLControlConfig

KLFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
KL_ESTIMATORS: dict[str, KLFn] = {}
"""KL estimator name (aliases included) -> ``fn(log_prob, ref_log_prob) -> (b, r)``."""


def _register(*names: str) -> Callable[[KLFn], KLFn]:
    """Register ``fn`` under ``names`` and its straight-through variant under each name + "+"."""

    def decorator(fn: KLFn) -> KLFn:
        plus = _straight_through(fn)
        for name in names:
            KL_ESTIMATORS[name] = fn
            KL_ESTIMATORS[f"{name}+"] = plus
        return fn

    return decorator


def _straight_through(base: KLFn) -> KLFn:
    def estimator(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
        k2 = 0.5 * (log_prob - ref_log_prob) ** 2
        return k2 - k2.detach() + base(log_prob, ref_log_prob).detach()

    estimator.__name__ = f"{base.__name__}_straight_through"
    estimator.__doc__ = f"Value of {base.__name__}, gradient of k2 (``k2 - sg(k2) + sg({base.__name__})``)."
    return estimator


@_register("kl", "k1")
def kl_k1(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """``k1 = logp - ref``: unbiased, high variance, negative on some tokens."""
    return log_prob - ref_log_prob


@_register("abs")
def kl_abs(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """``|logp - ref|``: a biased, non-negative variant of k1."""
    return (log_prob - ref_log_prob).abs()


@_register("mse", "k2")
def kl_k2(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """``k2 = 0.5 * (logp - ref)^2``: biased, low variance, non-negative."""
    return 0.5 * (log_prob - ref_log_prob) ** 2


@_register("low_var_kl", "k3")
def kl_k3(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """``k3 = exp(ref - logp) - (ref - logp) - 1``: unbiased, low variance, non-negative (``e^x >= 1 + x``).

    ``ref - logp`` is clamped to [-20, 20] and k3 to at most 10, as in verl, so that one token whose
    probabilities differ wildly cannot dominate the batch. verl clamps k3 to [-10, 10]; the lower bound here
    is 0 instead. k3 is never negative in exact arithmetic, so verl's -10 never acts, and the two agree except
    where float rounding puts ``exp(x) - x - 1`` below 0 (``|x| < 2.5e-4`` in fp32, ``< 1.1e-8`` in fp64):
    there this returns 0, the nearest value the estimate can take, so that k3 stays non-negative as documented;
    the difference from verl is at most one ulp of 1 (6e-8 in fp32), on tokens whose true k3 is below 3e-8.
    """
    log_ratio = (ref_log_prob - log_prob).clamp(-20.0, 20.0)
    return (torch.exp(log_ratio) - log_ratio - 1.0).clamp(min=0.0, max=10.0)


def get_kl_estimator(name: str) -> KLFn:
    """The estimator registered as ``name``; unknown names raise a one-line ValueError listing the valid ones."""
    if name == "full":
        raise ValueError(
            "KL type 'full' (exact KL over the vocabulary) needs both full distributions, which the actor does "
            f"not keep; use one of {sorted(KL_ESTIMATORS)} (low_var_kl is unbiased and low-variance)"
        )
    if name not in KL_ESTIMATORS:
        raise ValueError(f"KL type ({name!r}) must be one of {sorted(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[name]


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kl_type: str = "kl") -> torch.Tensor:
    """Per-token KL estimate ``(b, r)`` of estimator ``kl_type`` (not masked)."""
    return get_kl_estimator(kl_type)(log_prob, ref_log_prob)


class KLController(Protocol):
    """A KL coefficient: read ``value``, then ``update`` it with the KL measured on a batch. A checkpoint part
    (``state_dict`` / ``load_state_dict``): a resumed run restores only what it moved, the coefficient; settings
    come from the resumed run's config."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None: ...

    def state_dict(self) -> dict[str, float]: ...

    def load_state_dict(self, state: dict[str, float]) -> None: ...


class FixedKLController:
    """A constant coefficient."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """No-op: a fixed coefficient is the config's, whatever a checkpoint holds."""


class AdaptiveKLController:
    """Steers the measured KL towards ``target_kl`` (Ziegler et al. 2019, "Fine-Tuning Language Models from
    Human Preferences", sec. 2.2):

        e = clip(KL / target_kl - 1, -0.2, 0.2),      beta <- beta * (1 + e * n_steps / horizon)
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Scale the coefficient after a batch of ``n_steps`` samples whose mean KL was ``current_kl``."""
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """The coefficient an adaptive controller steered to; target and horizon stay this run's config. A state
        without a horizon was saved by a fixed controller: its coefficient was never steered, so the config's
        ``kl_coef`` stays."""
        if "horizon" in state:
            self.value = float(state["value"])


def make_kl_controller(cfg: KLControlConfig) -> KLController:
    """The controller that ``algorithm.kl_ctrl`` describes."""
    if cfg.kl_coef < 0:
        raise ValueError(f"algorithm.kl_ctrl.kl_coef ({cfg.kl_coef}) must be >= 0")
    if cfg.type == "fixed":
        return FixedKLController(cfg.kl_coef)
    if cfg.type == "adaptive":
        if cfg.target_kl <= 0 or cfg.horizon <= 0:
            raise ValueError(
                f"algorithm.kl_ctrl.target_kl ({cfg.target_kl}) and horizon ({cfg.horizon}) must be > 0 "
                "for the adaptive controller"
            )
        return AdaptiveKLController(cfg.kl_coef, cfg.target_kl, cfg.horizon)
    raise ValueError(f"algorithm.kl_ctrl.type ({cfg.type!r}) must be one of {KL_CTRL_TYPES}")


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_ctrl: KLController,
    kl_type: str = "kl",
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL as a reward penalty (Ziegler et al. 2019, eq. 2; Stiennon et al. 2020):

        r_t = score_t - beta * KL_t      (on valid tokens; 0 on padding)

    ``beta`` is ``kl_ctrl.value``. Afterwards the controller is updated with the batch's KL (mean over
    responses of each response's token-mean KL) and ``n_steps`` = the number of responses; this update is
    the function's one side effect, so call it once per rollout batch.

    Args:
        token_level_scores: ``(b, r)`` task scores (usually only on each response's last token).
        log_prob: ``(b, r)`` log-probs of the rollout policy (the actor's old log-probs).
        ref_log_prob: ``(b, r)`` reference log-probs.
        response_mask: ``(b, r)``.
        kl_ctrl: the coefficient controller.
        kl_type: KL estimator name (``algorithm.kl_penalty``).

    Returns:
        ``(token_level_rewards, metrics)``; metrics: ``kl`` (the measured KL) and ``kl_coef`` (the beta used).
    """
    mask = response_mask.to(token_level_scores.dtype)
    kl = kl_penalty(log_prob, ref_log_prob, kl_type) * mask
    beta = kl_ctrl.value
    rewards = (token_level_scores - beta * kl) * mask
    current_kl = float(masked_mean(kl, response_mask, dim=-1).mean()) if kl.shape[0] else 0.0
    kl_ctrl.update(current_kl, n_steps=kl.shape[0])
    return rewards, {"kl": current_kl, "kl_coef": beta}


def kl_loss(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    kl_type: str = "low_var_kl",
    loss_agg_mode: str = "token-mean",
    per_token: bool = False,
    loss_scale_factor: float | None = None,
) -> LossOutput:
    """KL as a loss term (GRPO, Shao et al. 2024, "DeepSeekMath", eq. 4, which uses k3): the actor adds
    ``kl_loss_coef * KL`` to the policy loss; gradients flow through ``log_prob``.

    Args:
        log_prob: ``(b, r)`` log-probs under the policy being trained.
        ref_log_prob: ``(b, r)`` reference log-probs.
        response_mask: ``(b, r)``.
        kl_type: KL estimator name (``actor.kl_loss_type``).
        loss_agg_mode: one of ``AGG_MODES`` (ignored with ``per_token``).
        per_token: return the ``(b, r)`` matrix instead of its aggregate.
        loss_scale_factor: ``C`` of "seq-mean-token-sum-norm" (ignored with ``per_token``).

    Returns:
        ``(loss, metrics)``; metrics: ``kl_loss`` (token mean of the estimator's value).
    """
    kl = kl_penalty(log_prob, ref_log_prob, kl_type)
    metrics = {"kl_loss": masked_mean(kl, response_mask).detach()}
    return reduce_loss(kl, response_mask, loss_agg_mode, per_token, loss_scale_factor), metrics
