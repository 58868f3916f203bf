"""Rewards: rule-based scorers (GSM8K, boxed math, the demo task), the data_source registry, user scorers
loaded from a file, and the :class:`RewardManager` that scores batches with timeouts and error counts.

    from hybridrl.rewards import RewardManager, get_scorer, make_demo_task
    result = RewardManager(timeout_s=5.0)(batch, responses_text)   # scores (b,), token_level_scores (b, r)
"""

from hybridrl.rewards.demo import make_demo_task
from hybridrl.rewards.manager import RewardManager, RewardResult, last_token_rewards, run_with_timeouts, score_batch
from hybridrl.rewards.registry import (
    ScoreFn,
    default_compute_score,
    fixed_scorer,
    get_scorer,
    known_sources,
    load_custom_scorer,
    register_scorer,
)

__all__ = [
    "RewardManager",
    "RewardResult",
    "ScoreFn",
    "default_compute_score",
    "fixed_scorer",
    "get_scorer",
    "known_sources",
    "last_token_rewards",
    "load_custom_scorer",
    "make_demo_task",
    "register_scorer",
    "run_with_timeouts",
    "score_batch",
]
