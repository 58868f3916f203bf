"""A custom reward scorer (``reward.custom.path``) that records each call: one line ``<pid>`` appended to the file
``HYBRIDRL_TEST_SCORER_CALLS`` names (a ``HYBRIDRL_`` variable: the Ray pool forwards it to the host actors). It
scores like the built-in registry."""

from __future__ import annotations

import os
import threading
from typing import Any

from hybridrl.rewards.registry import default_compute_score

_lock = threading.Lock()  # the reward manager calls scorers from several threads at once


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> Any:
    with _lock, open(os.environ["HYBRIDRL_TEST_SCORER_CALLS"], "a") as f:
        f.write(f"{os.getpid()}\n")
    return default_compute_score(data_source, solution_str, ground_truth, extra_info)
