"""A custom scorer (``reward.custom.path``) for tests/trainer/test_reward_overlap.py: the demo task's score, with a
planted error and a planted timeout, recording at each call how many requests the rank's vLLM engine still had
unfinished (the test puts the engine in :data:`ENGINE`)."""

from __future__ import annotations

import threading
import time
from typing import Any

from hybridrl.rewards.demo import compute_score as demo_score

ENGINE: Any = None
"""The rank's ``vllm`` ``LLMEngine`` (set by the test)."""
UNFINISHED: list[int] = []
"""Per call: the engine's unfinished requests when the call started (> 0: scored while generating)."""
SLOW_S = 2.5
"""How long a planted timeout sleeps (the tests run with reward.timeout_s=1)."""
_lock = threading.Lock()


def planted(ground_truth: Any) -> str:
    """What the scorer does with a prompt: "error" (raises), "timeout" (sleeps past the timeout) or "score"."""
    return {1: "error", 2: "timeout"}.get(int(ground_truth) % 3, "score")


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    if ENGINE is not None:
        with _lock:
            UNFINISHED.append(ENGINE.get_num_unfinished_requests())
    kind = planted(ground_truth)
    if kind == "error":
        raise ValueError("planted scorer error")
    if kind == "timeout":
        time.sleep(SLOW_S)
    return demo_score(solution_str, ground_truth)
