"""Preference losses of the DPO recipe (``dpo.loss_type``), on sequence log-probabilities; pure functions.

Notation for pair ``i``: prompt ``x``, chosen ``y_w``, rejected ``y_l``; ``log pi(y|x) = sum_t log pi(y_t | x,
y_<t)`` over the response tokens, ``|y|`` its token count, and the log-ratio margin

    h_i = [log pi(y_w|x) - log pi_ref(y_w|x)] - [log pi(y_l|x) - log pi_ref(y_l|x)].

- ``sigmoid`` (DPO, Rafailov et al. 2023, "Direct Preference Optimization", eq. 7), with conservative label
  smoothing ``eps`` (cDPO, Mitchell 2023: the label is flipped with probability eps):
  ``l_i = -(1 - eps) log sigma(beta h_i) - eps log sigma(-beta h_i)``.
- ``robust`` (Chowdhury et al. 2024, "Provably Robust DPO", eq. 6): the unbiased loss under label flips,
  ``l_i = [-(1 - eps) log sigma(beta h_i) + eps log sigma(-beta h_i)] / (1 - 2 eps)``.
- ``ipo`` (Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human Preferences",
  eq. 17, with ``tau = beta``): ``l_i = (h_i - 1 / (2 beta))^2``, on sequence log-probs as in the paper.
- ``simpo`` (Meng et al. 2024, "SimPO: Simple Preference Optimization with a Reference-Free Reward", eq. 6),
  reference-free, length-normalised: ``l_i = -log sigma(beta/|y_w| log pi(y_w|x) - beta/|y_l| log pi(y_l|x) -
  gamma)`` (with label smoothing as in cDPO).

The implicit rewards reported are ``r = beta (log pi - log pi_ref)`` (SimPO: ``beta / |y| log pi``); accuracy is
the share of pairs with ``r_w > r_l`` and the margin the mean of ``r_w - r_l``.

The batch loss is the mean over pairs. It is no sum over tokens, but its gradient is one:
``dL/dtheta = sum_i sum_{y in {w, l}} (dL / d log pi(y_i|x)) * d log pi(y_i|x) / dtheta``, so
:func:`sequence_weights` gives each sequence its weight ``g = dL / d log pi(y|x)`` and the training backend
minimises the per-token surrogate ``g * log pi(y_t | ...)`` summed over tokens, whose gradient is the loss's exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridrl.config.schema_recipes import DPO_LOSSES, REFERENCE_FREE_LOSSES


def preference_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor | None,
    ref_rejected_logps: torch.Tensor | None,
    chosen_lengths: torch.Tensor,
    rejected_lengths: torch.Tensor,
    loss_type: str = "sigmoid",
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair losses and implicit rewards (module docs for the formulas).

    Args:
        chosen_logps / rejected_logps: ``(k,)`` policy ``log pi(y|x)``, summed over response tokens.
        ref_chosen_logps / ref_rejected_logps: ``(k,)`` the reference's (None for "simpo").
        chosen_lengths / rejected_lengths: ``(k,)`` response token counts (used by "simpo").
        loss_type: one of :data:`~hybridrl.config.schema_recipes.DPO_LOSSES`.
        beta, label_smoothing, simpo_gamma: the ``dpo`` section's.

    Returns:
        ``(losses, chosen_rewards, rejected_rewards)``, each ``(k,)``.
    """
    if loss_type not in DPO_LOSSES:
        raise ValueError(f"dpo.loss_type ({loss_type!r}) must be one of {DPO_LOSSES}")
    eps = label_smoothing
    if loss_type in REFERENCE_FREE_LOSSES:
        chosen = beta * chosen_logps / chosen_lengths.clamp(min=1)
        rejected = beta * rejected_logps / rejected_lengths.clamp(min=1)
        z = chosen - rejected - simpo_gamma
        losses = -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
        return losses, chosen.detach(), rejected.detach()
    if ref_chosen_logps is None or ref_rejected_logps is None:
        raise ValueError(f"dpo.loss_type {loss_type!r} needs the reference's log-probs")
    chosen_ratio, rejected_ratio = chosen_logps - ref_chosen_logps, rejected_logps - ref_rejected_logps
    h = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        losses = -(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)
    elif loss_type == "robust":
        losses = (-(1 - eps) * F.logsigmoid(beta * h) + eps * F.logsigmoid(-beta * h)) / (1 - 2 * eps)
    else:  # ipo
        losses = (h - 1 / (2 * beta)) ** 2
    return losses, (beta * chosen_ratio).detach(), (beta * rejected_ratio).detach()


def sequence_weights(
    logps: torch.Tensor, ref_logps: torch.Tensor | None, lengths: torch.Tensor, **options: float | str
) -> tuple[torch.Tensor, dict[str, float]]:
    """Each sequence's weight ``g = dL / d log pi(y|x)`` of the batch loss ``L = mean_i l_i``, and the metrics.

    Args:
        logps: ``(2k,)`` policy log-probs of the batch: the ``k`` chosen sequences, then the ``k`` rejected ones.
        ref_logps: ``(2k,)`` the reference's, same order (None for a reference-free loss).
        lengths: ``(2k,)`` response token counts.
        **options: :func:`preference_loss`'s ``loss_type``, ``beta``, ``label_smoothing``, ``simpo_gamma``.

    Returns:
        ``g`` ``(2k,)`` (detached) and ``dpo/loss``, ``dpo/rewards_chosen``, ``dpo/rewards_rejected``,
        ``dpo/accuracy``, ``dpo/margin``, ``dpo/logps_chosen``, ``dpo/logps_rejected``.
    """
    k = logps.shape[0] // 2
    policy = logps.detach().double().requires_grad_(True)
    ref = (None, None) if ref_logps is None else ref_logps.double().split(k)
    lens = lengths.double().split(k)
    with torch.enable_grad():
        losses, chosen, rejected = preference_loss(*policy.split(k), *ref, *lens, **options)
        loss = losses.mean()
        (grad,) = torch.autograd.grad(loss, policy)
    metrics = {
        "dpo/loss": float(loss.detach()),
        "dpo/rewards_chosen": float(chosen.mean()),
        "dpo/rewards_rejected": float(rejected.mean()),
        "dpo/accuracy": float((chosen > rejected).double().mean()),
        "dpo/margin": float((chosen - rejected).mean()),
        "dpo/logps_chosen": float(logps[:k].mean()),
        "dpo/logps_rejected": float(logps[k:].mean()),
    }
    return grad.to(logps.dtype), metrics
