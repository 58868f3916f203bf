"""How DataProto compares and merges field values (the rules of ``union`` and ``concat``).

Owns value equality (tensors element-wise, object arrays element by element, NaN equal to NaN) and
``concat``'s ``meta_info`` merge, which follows verl: each part's ``"metrics"`` are gathered into one dict of
lists, every other key must agree between the parts that hold it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch


def _tensor_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a is b:
        return True
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    b = b.to(a.device)
    if a.is_floating_point() or a.is_complex():
        return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
    return torch.equal(a, b)


def values_equal(a: Any, b: Any) -> bool:
    """Value equality for tensors, arrays (object arrays element-wise), containers and scalars; NaN == NaN."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _tensor_equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)) or a.shape != b.shape:
            return False
        if a.dtype.hasobject or b.dtype.hasobject:
            return all(values_equal(x, y) for x, y in zip(a.reshape(-1), b.reshape(-1), strict=True))
        return bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc" and b.dtype.kind in "fc"))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(values_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and type(a) is type(b):
        return len(a) == len(b) and all(values_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    try:
        return bool(a == b)
    except Exception:  # == that returns something without a truth value
        return False


def merge_meta(metas: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``concat``'s meta_info: ``"metrics"`` gathered into a dict of lists, other keys equal in every part."""
    meta: dict[str, Any] = {}
    source: dict[str, int] = {}
    metrics: dict[str, list[Any]] | None = None
    for i, part in enumerate(metas):
        for k, v in part.items():
            if k == "metrics":
                for entry in v if isinstance(v, list) else [] if v is None else [v]:
                    if not isinstance(entry, Mapping):
                        raise ValueError(
                            f"concat: meta_info 'metrics' of part {i} holds a {type(entry).__name__}; it must be a "
                            "dict of metric values or a list of such dicts"
                        )
                    metrics = {} if metrics is None else metrics
                    for name, value in entry.items():
                        metrics.setdefault(name, []).append(value)
                continue
            if k in meta and not values_equal(meta[k], v):
                raise ValueError(f"concat: meta_info {k!r} differs between part {source[k]} and part {i}; pop it")
            meta.setdefault(k, v)
            source.setdefault(k, i)
    if metrics is not None:
        meta["metrics"] = metrics
    return meta
