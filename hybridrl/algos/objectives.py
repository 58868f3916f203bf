"""What the actor and the critic minimise, composed from the registries (one small callable each).

    actor:   l_it = w_it * pg_it - entropy_coeff * H_it + kl_loss_coef * KL_it
    critic:  l_it = value_loss_it

``pg`` is the policy loss ``actor.policy_loss.loss_mode`` of :data:`~hybridrl.algos.losses.POLICY_LOSSES`, or a
user's function from the file ``actor.policy_loss.path`` (loss_mode "custom"), called with the options it names
(the clip ratios, the aggregation mode, the Clip-Cov / KL-Cov knobs of ``actor.policy_loss``; a function taking
``**options`` gets the first five); ``w`` the rollout correction's truncated importance weights
(``algorithm.rollout_correction.rollout_is``, :mod:`~hybridrl.algos.rollout_correction`; 1 without); ``H`` the
entropy bonus
(:func:`~hybridrl.algos.losses.entropy_bonus`); ``KL`` the estimator ``actor.kl_loss_type`` as a loss
(:func:`~hybridrl.algos.kl.kl_loss`); the value loss is :func:`~hybridrl.algos.losses.value_loss`. Each callable
maps ``(outputs, batch)`` (the model head's ``(b, r)`` tensors and the micro-batch) to the per-token loss
``(b, r)``, zero on padding, and scalar metrics; the training backend aggregates it over the whole mini-batch
with the role's ``loss_agg_mode`` (:mod:`hybridrl.algos.aggregation`).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from hybridrl.algos.kl import kl_loss
from hybridrl.algos.losses import POLICY_LOSSES, LossOutput, PolicyLossFn, entropy_bonus, value_loss
from hybridrl.algos.masked import masked_mean
from hybridrl.config.schema import RolloutCorrectionConfig
from hybridrl.config.schema_roles import CUSTOM_POLICY_LOSS, ActorConfig, CriticConfig, PolicyLossConfig
from hybridrl.user_code import load_user_function

Tensors = Mapping[str, torch.Tensor]


def load_policy_loss(cfg: PolicyLossConfig) -> PolicyLossFn:
    """The policy loss ``cfg`` names: a registry entry, or the function ``cfg.name`` of the file ``cfg.path``."""
    if cfg.loss_mode != CUSTOM_POLICY_LOSS:
        if cfg.path is not None:
            raise ValueError(f"actor.policy_loss.path ({cfg.path!r}) is set but actor.policy_loss.loss_mode is "
                             f"{cfg.loss_mode!r}; set actor.policy_loss.loss_mode=custom to use the file")  # fmt: skip
        if cfg.loss_mode not in POLICY_LOSSES:
            raise ValueError(f"actor.policy_loss.loss_mode ({cfg.loss_mode!r}) must be one of {sorted(POLICY_LOSSES)} "
                             f"or {CUSTOM_POLICY_LOSS!r} (with actor.policy_loss.path)")  # fmt: skip
        return POLICY_LOSSES[cfg.loss_mode]
    file = Path(cfg.path or "")
    if cfg.path is None or not file.is_file():
        raise ValueError(f"actor.policy_loss.path ({cfg.path!r}) must be a .py file for loss_mode 'custom'")
    return load_user_function(file, cfg.name, path_key="actor.policy_loss.path", name_key="actor.policy_loss.name")


def policy_options(fn: PolicyLossFn, cfg: ActorConfig) -> dict[str, Any]:
    """The keyword options of ``fn`` from the actor's section: those it names as parameters; a function that takes
    ``**options`` also gets the five every loss shares (clip ratios, aggregation mode, its constant)."""
    p = cfg.policy_loss
    shared = dict(clip_ratio_low=cfg.clip_ratio_low, clip_ratio_high=cfg.clip_ratio_high, clip_ratio_c=cfg.clip_ratio_c,
                  loss_agg_mode=cfg.loss_agg_mode, loss_scale_factor=cfg.loss_scale_factor)  # fmt: skip
    specific = dict(clip_cov_ratio=p.clip_cov_ratio, clip_cov_lb=p.clip_cov_lb, clip_cov_ub=p.clip_cov_ub,
                    kl_cov_ratio=p.kl_cov_ratio, ppo_kl_coef=p.ppo_kl_coef)  # fmt: skip
    params = inspect.signature(fn).parameters
    named = {k: v for k, v in {**shared, **specific}.items() if k in params}
    if any(q.kind is inspect.Parameter.VAR_KEYWORD for q in params.values()):
        named = {**shared, **named}
    return {**named, "per_token": True}


class ActorLoss:
    """``l = w * pg - entropy_coeff * H (+ kl_loss_coef * KL)`` per token, from the actor's config section.

    Args:
        cfg: the ``actor`` section (policy loss, clip ratios, entropy and KL coefficients).
        rollout_correction: ``algorithm.rollout_correction``; with its ``rollout_is`` set, the policy term is
            weighted by the batch's ``rollout_is_weights`` (the loop computes them). None = no weights.
    """

    def __init__(self, cfg: ActorConfig, rollout_correction: RolloutCorrectionConfig | None = None) -> None:
        self.policy = load_policy_loss(cfg.policy_loss)
        self.custom = cfg.policy_loss.loss_mode == CUSTOM_POLICY_LOSS
        self.options = policy_options(self.policy, cfg)
        self.entropy_coeff = cfg.entropy_coeff
        self.kl = (cfg.kl_loss_type, cfg.kl_loss_coef) if cfg.use_kl_loss else None
        self.weighted = rollout_correction is not None and rollout_correction.rollout_is is not None
        self.on_policy = cfg.recompute_old_log_prob is False
        """No old-log-prob pass ran: the old policy is this forward's (``old_log_probs = log_probs.detach()``)."""
        old = ("rollout_log_probs",) if self.on_policy else ("old_log_probs",)
        self.inputs = (*old, "advantages", *(("ref_log_probs",) if self.kl else ()),
                       *(("rollout_is_weights",) if self.weighted else ()))  # fmt: skip
        """The batch keys it reads besides ``response_mask``."""

    def __call__(self, outputs: Tensors, batch: Tensors) -> LossOutput:
        """Per-token loss ``(b, r)`` and metrics from the head's ``log_probs`` / ``entropy`` ``(b, r)``."""
        mask, log_prob = batch["response_mask"], outputs["log_probs"]
        old_log_prob = log_prob.detach() if self.on_policy else batch["old_log_probs"]
        out = self.policy(log_prob=log_prob, old_log_prob=old_log_prob, advantages=batch["advantages"],
                          response_mask=mask, **self.options)  # fmt: skip
        if self.custom:
            _check_custom(out, mask)
        pg, metrics = out
        if self.weighted:
            pg = pg * batch["rollout_is_weights"].to(pg.dtype)
        # without an entropy bonus the entropy is a metric only: detached, the head's backward skips its term
        entropy = outputs["entropy"] if self.entropy_coeff else outputs["entropy"].detach()
        ent, ent_metrics = entropy_bonus(entropy, mask, per_token=True)
        loss = pg - self.entropy_coeff * ent if self.entropy_coeff else pg
        metrics = {**metrics, **ent_metrics}
        if self.on_policy:  # what the loop reads from the old-log-prob pass when there is one
            gap = (log_prob.detach() - batch["rollout_log_probs"].to(log_prob.dtype)).abs()
            metrics["rollout_logprob_mismatch"] = masked_mean(gap, mask)
        if self.kl:
            kl_type, coef = self.kl
            kl, kl_metrics = kl_loss(log_prob, batch["ref_log_probs"], mask, kl_type=kl_type, per_token=True)
            loss = loss + coef * kl
            metrics.update(kl_metrics)
        return loss, metrics


class CriticLoss:
    """The clipped value loss per token, from the critic's config section.

    Args:
        cfg: the ``critic`` section (``cliprange_value``).
    """

    inputs = ("values", "returns")
    """The batch keys it reads besides ``response_mask``."""

    def __init__(self, cfg: CriticConfig) -> None:
        self.cliprange_value = cfg.cliprange_value

    def __call__(self, outputs: Tensors, batch: Tensors) -> LossOutput:
        """Per-token loss ``(b, r)`` and metrics from the head's ``values`` ``(b, r)``."""
        return value_loss(outputs["values"], batch["values"], batch["returns"], batch["response_mask"],
                          cliprange_value=self.cliprange_value, per_token=True)  # fmt: skip


def _check_custom(out: Any, mask: torch.Tensor) -> None:
    ok = isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], torch.Tensor) and isinstance(out[1], dict)
    if not ok or out[0].shape != mask.shape:
        got = f"a loss of shape {tuple(out[0].shape)}" if ok else f"{type(out).__name__}"
        raise ValueError(f"actor.policy_loss.path: the custom policy loss returned {got}; it must return (loss, "
                         f"metrics), the loss of shape {tuple(mask.shape)} with per_token=True")  # fmt: skip
