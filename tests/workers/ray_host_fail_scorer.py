"""A custom reward scorer (``reward.custom.path``) that loads on the Ray driver but not on the host actors: importing
it inside a Ray worker process raises, as a scorer whose API key only the driver's environment holds would. The
driver loads it before it joins Ray, so only the hosts' rebuild (``reward.overlap_generation``) fails."""

from __future__ import annotations

import sys
from typing import Any

from hybridrl.rewards.registry import default_compute_score

_ray = sys.modules.get("ray")
if _ray is not None and _ray.is_initialized():
    raise RuntimeError("JUDGE_API_KEY is not set on this node")


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> Any:
    return default_compute_score(data_source, solution_str, ground_truth, extra_info)
