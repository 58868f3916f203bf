"""Config check of every number at once: a NaN or an infinity in any float field (YAML's ``.nan`` / ``.inf``,
or an override such as ``actor.optim.lr=.nan``) is refused before anything runs.

The range checks of :mod:`hybridrl.config.checks` compare with ``<=`` / ``<``, which NaN passes silently; and no
field of the run config means anything at infinity (a timeout of ``.inf`` overflows torch's ``timedelta``).
Run by :func:`hybridrl.config.checks.check_counts`, before its range checks.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from hybridrl.config.schema import ConfigError, RunConfig


def _floats(value: Any, key: str):
    """(key, value) of every float inside ``value`` (dataclass fields, list items, dict values)."""
    if isinstance(value, float):
        yield key, value
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from _floats(getattr(value, f.name), f"{key}.{f.name}" if key else f.name)
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            yield from _floats(item, f"{key}[{i}]")
    elif isinstance(value, dict):
        for k, item in value.items():
            yield from _floats(item, f"{key}.{k}")


def check_finite(cfg: RunConfig, world: int) -> None:
    """Every float of the config is finite."""
    for key, value in _floats(cfg, ""):
        if not math.isfinite(value):
            raise ConfigError(f"{key} ({value}) must be a finite number; set it to a real value", key=key)
