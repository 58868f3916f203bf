"""Group advantage estimators beyond GRPO's, registered in ``ADV_ESTIMATORS``: ``gpg`` and ``pass_at_k``.

Like the estimators of :mod:`hybridrl.algos.advantages`, each scores a response by the sum of its token rewards,
``s_i = sum_t r_it m_it``, compares it with the other responses to the same prompt (the group ``g(i)``, from
``index``) and broadcasts one advantage over the response's tokens.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from hybridrl.algos.advantages import _group_ids, _group_stats, _outcome_scores, register_adv_estimator
from hybridrl.algos.dynamic_sampling import informative_rows


@register_adv_estimator("gpg")
def gpg(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group Policy Gradient's advantage (Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning
    Baseline for Model Reasoning", arXiv 2504.02546): the group-centred score, no std normalisation
    (``F_norm = 1``), scaled up for the responses that carry no signal:

        A_i = alpha * (s_i - mean_{j in g(i)} s_j),      alpha = B / (B - M)

    where ``B`` is the number of responses and ``M`` the number in groups (of two or more) whose scores are all
    equal, whose advantage is 0: without ``alpha`` they would shrink the mean gradient by ``(B - M) / B``.
    ``alpha = 1`` when every response is such. Pair with ``actor.policy_loss.loss_mode=gpg``.

    Args:
        token_level_rewards: ``(b, r)``; a response's score is the sum over its tokens.
        response_mask: ``(b, r)``.
        index: ``(b,)`` group id (uid) per response.

    Returns:
        ``(advantages, returns)``: the same ``(b, r)`` tensor twice, zero on padding.
    """
    scores = _outcome_scores(token_level_rewards, response_mask)
    count, mean, _ = _group_stats(scores, index)
    invalid = int(((count > 1) & ~informative_rows(scores, index)).sum())  # bitwise-equal scores, not std == 0
    batch = scores.shape[0]
    alpha = batch / (batch - invalid) if invalid < batch else 1.0
    adv = (alpha * (scores - mean))[:, None] * response_mask.to(scores.dtype)
    return adv, adv


def pass_at_k_group_advantages(n: int, correct: int, k: int, epsilon: float = 1e-6) -> tuple[float, float]:
    """``(A_pos, A_neg)``: the pass@k advantage of a passing and of a failing response in a group of ``n`` with
    ``correct`` passing (Chen et al. 2025, "Pass@k Training for Adaptively Balancing Exploration and Exploitation
    of Large Reasoning Models", arXiv 2508.10751, its analytical derivation):

        R     = 1 - C(n - c, k) / C(n, k)                 (the group's expected pass@k reward)
        sigma = sqrt(R (1 - R))
        A_pos = (1 - R) / (sigma + epsilon)
        A_neg = (1 - R - C(n - c - 1, k - 1) / C(n - 1, k - 1)) / (sigma + epsilon)

    These are the expectations, over the ``C(n, k)`` k-subsets containing the response, of the subset's
    normalised reward ``(max_{j in subset} pass_j - R) / sigma``.
    """
    if not 1 <= k <= n:
        raise ValueError(f"algorithm.pass_k ({k}) must be in [1, group size ({n})]; lower algorithm.pass_k")
    mean = 1.0 - math.comb(n - correct, k) / math.comb(n, k)
    sigma = math.sqrt(mean * (1.0 - mean))
    positive = (1.0 - mean) / (sigma + epsilon)
    all_fail_given_fail = math.comb(n - correct - 1, k - 1) / math.comb(n - 1, k - 1) if correct < n else 0.0
    negative = (1.0 - mean - all_fail_given_fail) / (sigma + epsilon)
    return positive, negative


@register_adv_estimator("pass_at_k")
def pass_at_k(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    pass_k: int = 4,
    pass_threshold: float = 1.0,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k Training's advantage (Chen et al. 2025, "Pass@k Training for Adaptively Balancing Exploration and
    Exploitation of Large Reasoning Models", arXiv 2508.10751): the group-relative advantage of the pass@k reward, in
    closed form (:func:`pass_at_k_group_advantages`), so that a failing response is not penalised as hard when
    its group already has passing ones. Response ``i`` passes when ``s_i >= pass_threshold``.

    Args:
        token_level_rewards: ``(b, r)``; a response's score is the sum over its tokens.
        response_mask: ``(b, r)``.
        index: ``(b,)`` group id (uid) per response; every group needs at least ``pass_k`` responses.
        pass_k: ``k`` (``algorithm.pass_k``).
        pass_threshold: the score at which a response passes (``algorithm.pass_threshold``).
        epsilon: added to the group's std.

    Returns:
        ``(advantages, returns)``: the same ``(b, r)`` tensor twice, zero on padding.
    """
    scores = _outcome_scores(token_level_rewards, response_mask)
    ids = _group_ids(index, scores.shape[0], scores.device)
    passed = scores >= pass_threshold
    adv = torch.zeros_like(scores)
    for group in torch.unique(ids).tolist():
        rows = ids == group
        positive, negative = pass_at_k_group_advantages(int(rows.sum()), int(passed[rows].sum()), pass_k, epsilon)
        adv[rows] = torch.where(passed[rows], positive, negative).to(scores.dtype)
    adv = adv[:, None] * response_mask.to(scores.dtype)
    return adv, adv
