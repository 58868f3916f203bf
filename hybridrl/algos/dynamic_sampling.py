"""DAPO's two rollout-side pieces as pure functions: which groups dynamic sampling keeps, and the soft overlong
punishment added to the scores (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
secs. 3.2 and 3.4).

The loop that uses them (generate more prompts until the batch is full, shape the training scores) is the
trainer's (:meth:`hybridrl.trainer.rl_trainer.RLTrainer.train_step`), switched on by
``algorithm.filter_groups.enable`` and ``reward.overlong_buffer.enable``.
"""

from __future__ import annotations

from typing import Any

import torch

from hybridrl.algos.advantages import _group_ids


def informative_rows(scores: torch.Tensor, index: Any) -> torch.Tensor:
    """Dynamic sampling's filter (Yu et al. 2025, sec. 3.2: keep groups with ``0 < #correct < G``,
    generalised to any score): ``(b,)`` True for the responses of groups whose scores are not all equal.

    A group whose responses all scored the same has zero group-relative advantage under every group baseline
    (GRPO, RLOO, ...): it adds no gradient, only noise to the denominators. Equal means bitwise equal (max ==
    min), so a group of identical scores is never kept by rounding. A group of one has no siblings to compare
    with and is dropped too.

    Args:
        scores: ``(b,)`` one score per response.
        index: ``(b,)`` group id (uid) per response.
    """
    ids = _group_ids(index, scores.shape[0], scores.device)
    groups = int(ids.max()) + 1 if ids.numel() else 0
    high = scores.new_full((groups,), float("-inf")).scatter_reduce(0, ids, scores, "amax")
    low = scores.new_full((groups,), float("inf")).scatter_reduce(0, ids, scores, "amin")
    return (high > low)[ids]


def overlong_penalty(
    lengths: torch.Tensor, max_length: int, buffer_length: int, penalty_factor: float = 1.0
) -> torch.Tensor:
    """Soft overlong punishment (Yu et al. 2025, sec. 3.4, eq. 13), ``(b,)``:

        R_len(y) = 0                                   |y| <= L_max - L_cache
                 = ((L_max - L_cache) - |y|) / L_cache  L_max - L_cache < |y| <= L_max
                 = -1                                  L_max < |y|

    times ``penalty_factor``, with ``L_max = max_length`` and ``L_cache = buffer_length``.

    Args:
        lengths: ``(b,)`` response lengths in tokens.
        max_length: ``L_max`` (data.max_response_length).
        buffer_length: ``L_cache``, in [1, max_length].
        penalty_factor: scale, >= 0.
    """
    if not 1 <= buffer_length <= max_length:
        raise ValueError(f"reward.overlong_buffer.len ({buffer_length}) must be in [1, data.max_response_length "
                         f"({max_length})]")  # fmt: skip
    expected = max_length - buffer_length
    penalty = ((expected - lengths.to(torch.float32)) / buffer_length).clamp(-1.0, 0.0)
    return penalty * penalty_factor
