"""A custom reward scorer (``reward.custom.path``) that kills one of Ray mode's host actors mid-step.

With ``reward.overlap_generation=false`` Ray mode scores on the driver; on its ``RAY_KILL_AT_CALL``-th call this
scorer SIGKILLs the host actor of rank ``RAY_KILL_RANK`` (default 1) of the driver's pool, and writes the time it
did so to ``RAY_KILL_STAMP``: a real death of a device's process between two role calls. It scores like the
built-in registry otherwise.
"""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
from typing import Any

from hybridrl.rewards.registry import default_compute_score

_calls = 0
_lock = threading.Lock()  # the reward manager calls scorers from several threads at once


def _kill_host(rank: int) -> None:
    from hybridrl.workers.ray_pool import RayResourcePool

    pool = next(o for o in gc.get_objects() if isinstance(o, RayResourcePool) and o.hosts)
    os.kill(pool.where[rank]["pid"], signal.SIGKILL)
    with open(os.environ["RAY_KILL_STAMP"], "w") as f:
        f.write(str(time.time()))


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> Any:
    global _calls
    with _lock:
        _calls += 1
        if _calls == int(os.environ.get("RAY_KILL_AT_CALL", "0")):
            _kill_host(int(os.environ.get("RAY_KILL_RANK", "1")))
    return default_compute_score(data_source, solution_str, ground_truth, extra_info)
