"""A custom reward scorer (``reward.custom.path``) that kills its process in the middle of a training step.

It scores like the built-in registry (``default_compute_score``), so a run with it and without a crash is
the reference. With ``CRASH_SCORER_AT_CALL=K`` the process whose ``RANK`` is ``CRASH_SCORER_RANK`` (default
1) SIGKILLs itself on its K-th call: a real crash in the middle of a step (while its responses are generated
and scored), with nothing of the step saved or logged. Each rank scores the responses its rollout replica generated
(``reward.overlap_generation``, on by default), so with R replicas step s (no validation) starts at call
``(s - 1) * data.train_batch_size * rollout.n / R + 1``.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from hybridrl.rewards.registry import default_compute_score

_calls = 0
_lock = threading.Lock()  # the reward manager calls scorers from several threads at once


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> Any:
    global _calls
    at = os.environ.get("CRASH_SCORER_AT_CALL")
    if at is not None and os.environ.get("RANK") == os.environ.get("CRASH_SCORER_RANK", "1"):
        with _lock:
            _calls += 1
            if _calls == int(at):
                os.kill(os.getpid(), signal.SIGKILL)
    return default_compute_score(data_source, solution_str, ground_truth, extra_info)
