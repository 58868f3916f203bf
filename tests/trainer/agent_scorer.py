"""A custom scorer (``reward.custom.path``) for the agent end-to-end tests: digits written / 20.

Multi-turn trajectories of a model that has not learned the task earn the environment's reward rarely; this
score varies with every trajectory, so GRPO's advantages (and the update the resume test compares) are not zero.
"""

from __future__ import annotations

from typing import Any


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    return sum(c.isdigit() for c in solution_str) / 20
