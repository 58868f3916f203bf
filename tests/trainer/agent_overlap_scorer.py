"""A custom scorer (``reward.custom.path``) for tests/trainer/test_agent_reward_overlap.py: a score that varies with
every trajectory's text (a barely trained policy rarely earns the environment's), with a planted error and a
planted timeout (drawn from the text), recording at each call how many requests the rank's vLLM engine still had
unfinished (the test puts the engine in :data:`ENGINE`)."""

from __future__ import annotations

import threading
import time
import zlib
from typing import Any

ENGINE: Any = None
"""The rank's ``vllm`` ``LLMEngine`` (set by the test)."""
UNFINISHED: list[int] = []
"""Per call: the engine's unfinished requests when the call started (> 0: scored while others generate)."""
SLOW_S = 2.5
"""How long a planted timeout sleeps (the tests run with reward.timeout_s=1)."""
_lock = threading.Lock()


def planted(solution_str: str) -> str:
    """What the scorer does with a trajectory: "error" (raises), "timeout" (sleeps past the timeout) or "score"."""
    return {1: "error", 2: "timeout"}.get(zlib.crc32(solution_str.encode()) % 5, "score")


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    if ENGINE is not None:
        with _lock:
            UNFINISHED.append(ENGINE.get_num_unfinished_requests())
    kind = planted(solution_str)
    if kind == "error":
        raise ValueError("planted scorer error")
    if kind == "timeout":
        time.sleep(SLOW_S)
    return (len(solution_str) % 7 + sum(c.isdigit() for c in solution_str)) / 20
