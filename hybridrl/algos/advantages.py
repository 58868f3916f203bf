"""Advantage estimators: the registry ``ADV_ESTIMATORS`` and its entries (gae, grpo, rloo, reinforce++, remax;
gpg and pass@k live in :mod:`hybridrl.algos.group_estimators`).

Every estimator is a pure function on masked ``(batch, response_len)`` tensors that returns
``(advantages, returns)``, both ``(b, r)`` and zero on padding. Each one asks, by its parameter names, for
just the inputs it needs (``values`` for a critic, ``index`` for groups of responses to one prompt,
``reward_baselines`` for ReMax); :func:`compute_advantages` fills them in from what the trainer has, so a
new estimator is one registered function and no branch in the loop. The names match
``hybridrl.config.schema.ADV_ESTIMATORS``.

"Outcome" estimators (grpo, rloo, reinforce_plus_plus_baseline) score a response by the sum of its token
rewards, ``s_i = sum_t r_it m_it``, and broadcast one advantage over its tokens.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from hybridrl.algos.masked import masked_sum, masked_whiten

AdvantageFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
ADV_ESTIMATORS: dict[str, AdvantageFn] = {}
"""Estimator name -> function; fill with :func:`register_adv_estimator`."""

ADV_INPUTS = {
    "token_level_rewards": "the rollout's token rewards (scores, minus the KL penalty with use_kl_in_reward)",
    "response_mask": "the rollout's response mask",
    "values": "critic values: an estimator asking for them gets a critic (config.schema.CRITIC_ESTIMATORS)",
    "index": "group id (uid) per response: asking for it needs rollout.n >= 2 (config.schema.GROUP_ESTIMATORS)",
    "reward_baselines": "score of a greedy response to each response's prompt: the trainer loop generates it",
    "gamma": "algorithm.gamma",
    "lam": "algorithm.lam",
    "norm_adv_by_std_in_grpo": "algorithm.norm_adv_by_std_in_grpo",
    "pass_k": "algorithm.pass_k",
    "pass_threshold": "algorithm.pass_threshold",
    "epsilon": "a small constant (the estimator's default)",
    "whiten": "whiten the advantages (the estimator's default)",
}
"""Everything an estimator may ask for by parameter name -> where the trainer gets it (see
:func:`compute_advantages`). Declaring a parameter is all an estimator does to get the input."""


def register_adv_estimator(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator: register ``fn`` as advantage estimator ``name`` (its parameters must be in ``ADV_INPUTS``)."""

    def decorator(fn: AdvantageFn) -> AdvantageFn:
        if name in ADV_ESTIMATORS:
            raise ValueError(f"adv_estimator {name!r} is already registered (by {ADV_ESTIMATORS[name].__name__})")
        unknown = [p for p in inspect.signature(fn).parameters if p not in ADV_INPUTS]
        if unknown:
            raise ValueError(f"adv_estimator {name!r} asks for {unknown}; known inputs are {list(ADV_INPUTS)}")
        ADV_ESTIMATORS[name] = fn
        return fn

    return decorator


def get_adv_estimator(name: str) -> AdvantageFn:
    """The estimator registered as ``name``; unknown names raise a one-line ValueError listing the valid ones."""
    if name not in ADV_ESTIMATORS:
        raise ValueError(f"algorithm.adv_estimator ({name!r}) must be one of {sorted(ADV_ESTIMATORS)}")
    return ADV_ESTIMATORS[name]


def required_inputs(name: str) -> tuple[str, ...]:
    """The inputs estimator ``name`` cannot run without (parameters without a default)."""
    params = inspect.signature(get_adv_estimator(name)).parameters.values()
    return tuple(p.name for p in params if p.default is inspect.Parameter.empty)


def compute_advantages(name: str, **inputs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Run estimator ``name`` on the inputs it asks for; the rest of ``inputs`` (or ``None`` ones) are ignored.

    Args:
        name: a registered estimator name.
        **inputs: any of ``ADV_INPUTS``: ``token_level_rewards`` and ``response_mask`` ``(b, r)``, ``values``
            ``(b, r)`` or None, ``index`` ``(b,)`` group ids (numpy array or tensor), ``reward_baselines``
            ``(b,)``, and the scalars ``gamma``, ``lam``, ``norm_adv_by_std_in_grpo``, ``epsilon``, ``whiten``.

    Returns:
        ``(advantages, returns)``, both ``(b, r)`` and zero on padding.
    """
    fn = get_adv_estimator(name)
    unknown = sorted(set(inputs) - set(ADV_INPUTS))
    if unknown:
        raise TypeError(f"compute_advantages got unknown inputs {unknown}; known inputs are {list(ADV_INPUTS)}")
    missing = [p for p in required_inputs(name) if inputs.get(p) is None]
    if missing:
        raise ValueError(f"adv_estimator {name!r} needs {missing}, which the trainer did not provide")
    params = inspect.signature(fn).parameters
    return fn(**{k: v for k, v in inputs.items() if k in params and v is not None})


def _outcome_scores(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``(b,)`` sum of each response's token rewards."""
    return masked_sum(token_level_rewards, response_mask, dim=-1)


def _group_ids(index: Any, batch: int, device: torch.device) -> torch.Tensor:
    """``(b,)`` int64 group ids 0..G-1 from any ``(b,)`` uid array (numpy of str/int/object, list, tensor)."""
    if isinstance(index, torch.Tensor):
        ids = torch.unique(index.reshape(-1), return_inverse=True)[1]
    else:
        ids = torch.from_numpy(np.unique(np.asarray(index).reshape(-1), return_inverse=True)[1].reshape(-1))
    if ids.numel() != batch:
        raise ValueError(f"index has {ids.numel()} entries; expected one per response ({batch})")
    return ids.to(device=device, dtype=torch.long)


def _group_stats(scores: torch.Tensor, index: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-response ``(count, mean, std)`` of its group's scores, each ``(b,)``; std is Bessel-corrected.

    A group of one gets mean 0 and std 1 (so its "advantage" is its raw score), as in verl.
    """
    ids = _group_ids(index, scores.shape[0], scores.device)
    groups = int(ids.max()) + 1 if ids.numel() else 0
    zeros = scores.new_zeros(groups)
    count = zeros.index_add(0, ids, torch.ones_like(scores))
    mean = zeros.index_add(0, ids, scores) / count
    sq_dev = zeros.index_add(0, ids, (scores - mean[ids]) ** 2)
    std = torch.sqrt(sq_dev / (count - 1).clamp(min=1.0))
    single = count <= 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return count[ids], mean[ids], std[ids]


def _reward_to_go(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = r_t + gamma * G_{t+1}`` over valid tokens; masked positions neither add nor discount. ``(b, r)``."""
    mask = response_mask.to(token_level_rewards.dtype)
    returns = torch.zeros_like(token_level_rewards)
    running = token_level_rewards.new_zeros(token_level_rewards.shape[0])
    for t in reversed(range(token_level_rewards.shape[1])):
        running = mask[:, t] * (token_level_rewards[:, t] + gamma * running) + (1 - mask[:, t]) * running
        returns[:, t] = running
    return returns * mask


@register_adv_estimator("gae")
def gae(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016, "High-Dimensional Continuous Control Using
    Generalized Advantage Estimation", eq. 16) for PPO with a critic.

        delta_t = r_t + gamma * V_{t+1} - V_t,      A_t = delta_t + gamma * lam * A_{t+1},      R_t = A_t + V_t

    with ``V`` and ``A`` past the last valid token equal to 0. Masked positions are skipped (the recursion
    carries over them), so rewards and values on padding never reach a valid token. With ``whiten`` the
    advantages are then whitened over the batch's valid tokens; the returns (critic targets) are not.

    Args:
        token_level_rewards: ``(b, r)`` rewards (score on the last token, minus any KL penalty).
        values: ``(b, r)`` critic values of the rollout.
        response_mask: ``(b, r)``.
        gamma: discount.
        lam: GAE lambda (1 = Monte-Carlo returns minus values, 0 = one-step TD error).
        whiten: normalise the advantages to zero mean, unit variance over the batch.

    Returns:
        ``(advantages, returns)``, both ``(b, r)``, zero on padding.
    """
    mask = response_mask.to(values.dtype)
    advantages = torch.zeros_like(values)
    next_value = values.new_zeros(values.shape[0])
    last_gae = values.new_zeros(values.shape[0])
    for t in reversed(range(values.shape[1])):
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        gae_t = delta + gamma * lam * last_gae
        next_value = mask[:, t] * values[:, t] + (1 - mask[:, t]) * next_value
        last_gae = mask[:, t] * gae_t + (1 - mask[:, t]) * last_gae
        advantages[:, t] = gae_t
    advantages = advantages * mask
    returns = (advantages + values) * mask
    if whiten:
        advantages = masked_whiten(advantages, response_mask)
    return advantages, returns


@register_adv_estimator("grpo")
def grpo(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group Relative Policy Optimization, outcome supervision (Shao et al. 2024, "DeepSeekMath", sec. 4.1.2):

        A_i = (s_i - mean_{j in g(i)} s_j) / (std_{j in g(i)} s_j + epsilon)     on every token of response i

    where ``g(i)`` are the responses sharing ``index[i]`` (the same prompt). ``norm_adv_by_std_in_grpo=False``
    drops the division (Dr. GRPO, Liu et al. 2025, "Understanding R1-Zero-Like Training", sec. 3.1), which
    removes the bias towards questions of very low or high difficulty.

    Args:
        token_level_rewards: ``(b, r)``; a response's score is the sum over its tokens.
        response_mask: ``(b, r)``.
        index: ``(b,)`` group id (uid) per response: numpy array (any dtype) or tensor.
        norm_adv_by_std_in_grpo: divide by the group std.
        epsilon: added to the std.

    Returns:
        ``(advantages, returns)``: the same ``(b, r)`` tensor twice, zero on padding.
    """
    scores = _outcome_scores(token_level_rewards, response_mask)
    _, mean, std = _group_stats(scores, index)
    adv = scores - mean
    if norm_adv_by_std_in_grpo:
        adv = adv / (std + epsilon)
    adv = adv[:, None] * response_mask.to(adv.dtype)
    return adv, adv


@register_adv_estimator("rloo")
def rloo(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE Leave-One-Out (Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style
    Optimization for Learning from Human Feedback in LLMs", eq. 6; after Kool et al. 2019):

        A_i = s_i - 1/(n-1) * sum_{j in g(i), j != i} s_j  =  n/(n-1) * (s_i - mean_{g(i)} s)

    on every token of response ``i``, with ``n = |g(i)|``. A group of one keeps its raw score.

    Args:
        token_level_rewards: ``(b, r)``; a response's score is the sum over its tokens.
        response_mask: ``(b, r)``.
        index: ``(b,)`` group id (uid) per response.

    Returns:
        ``(advantages, returns)``: the same ``(b, r)`` tensor twice, zero on padding.
    """
    scores = _outcome_scores(token_level_rewards, response_mask)
    count, mean, _ = _group_stats(scores, index)
    factor = torch.where(count > 1, count / (count - 1).clamp(min=1.0), torch.ones_like(count))
    adv = (factor * (scores - mean))[:, None] * response_mask.to(scores.dtype)
    return adv, adv


@register_adv_estimator("reinforce_plus_plus")
def reinforce_plus_plus(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language
    Models", sec. 3): token-level discounted returns, whitened over the whole batch (no critic, no groups):

        G_t = sum_{s >= t} gamma^(s-t) r_s,      A_t = (G_t - mean(G)) / std(G)     (over valid tokens)

    The token rewards should already carry the per-token KL penalty (``algorithm.use_kl_in_reward``).

    Args:
        token_level_rewards: ``(b, r)``.
        response_mask: ``(b, r)``.
        gamma: discount.

    Returns:
        ``(advantages, returns)``: whitened advantages and the raw returns ``G``, ``(b, r)``, zero on padding.
    """
    returns = _reward_to_go(token_level_rewards, response_mask, gamma)
    return masked_whiten(returns, response_mask), returns


@register_adv_estimator("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group baseline (Hu 2025, sec. 3): subtract the group mean score, then whiten over
    the batch:

        A'_i = s_i - mean_{j in g(i)} s_j  on every token of i,      A = (A' - mean(A')) / std(A')  (valid tokens)

    Args:
        token_level_rewards: ``(b, r)``; a response's score is the sum over its tokens.
        response_mask: ``(b, r)``.
        index: ``(b,)`` group id (uid) per response.

    Returns:
        ``(advantages, returns)``: the same ``(b, r)`` tensor twice, zero on padding.
    """
    scores = _outcome_scores(token_level_rewards, response_mask)
    _, mean, _ = _group_stats(scores, index)
    centred = (scores - mean)[:, None] * response_mask.to(scores.dtype)
    adv = masked_whiten(centred, response_mask)
    return adv, adv


@register_adv_estimator("remax")
def remax(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, reward_baselines: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023, "ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method for
    Aligning Large Language Models", Algorithm 1): REINFORCE with the reward of the greedy response as baseline:

        G_t = sum_{s >= t} r_s,      A_t = G_t - b_i,      b_i = reward of the greedy decoding of prompt i

    Args:
        token_level_rewards: ``(b, r)`` rewards of the sampled responses.
        response_mask: ``(b, r)``.
        reward_baselines: ``(b,)`` score of the greedy response to each row's prompt.

    Returns:
        ``(advantages, returns)``: advantages and the reward-to-go ``G``, ``(b, r)``, zero on padding.
    """
    returns = _reward_to_go(token_level_rewards, response_mask, 1.0)
    baselines = torch.as_tensor(reward_baselines, dtype=returns.dtype, device=returns.device).reshape(-1, 1)
    return (returns - baselines) * response_mask.to(returns.dtype), returns
