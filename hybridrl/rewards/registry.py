"""Which scorer scores a sample: the ``data_source`` -> scorer registry and user scorers loaded from files.

Built-in scorers take ``(solution_str, ground_truth) -> float``. Everything the reward manager calls has
verl's signature, :data:`ScoreFn` = ``fn(data_source, solution_str, ground_truth, extra_info) -> float``:
:func:`default_compute_score` dispatches on ``data_source`` through the registry, and a user function
loaded with :func:`load_custom_scorer` (``reward.custom.path`` / ``reward.custom.name``) has that
signature itself. A scorer may also return a dict with a ``"score"`` key, or a bool.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from hybridrl.rewards import demo, gsm8k, math_boxed
from hybridrl.user_code import load_user_function

Scorer = Callable[[str, Any], Any]
ScoreFn = Callable[[str, str, Any, Any], Any]

_SCORERS: dict[str, Scorer] = {}


def register_scorer(fn: Scorer, *names: str) -> Scorer:
    """Register ``fn(solution_str, ground_truth)`` under scorer names and ``data_source`` values.

    Raises:
        ValueError: a name is already registered to another function.
    """
    for name in names:
        if _SCORERS.get(name, fn) is not fn:
            raise ValueError(f"scorer name {name!r} is already registered; pick another data_source name")
        _SCORERS[name] = fn
    return fn


register_scorer(gsm8k.compute_score, "gsm8k", "openai/gsm8k")
register_scorer(
    math_boxed.compute_score,
    "math",
    "lighteval/MATH",
    "DigitalLearningGmbH/MATH-lighteval",
    "HuggingFaceH4/MATH-500",
)
register_scorer(demo.compute_score, "demo_copy", demo.DATA_SOURCE)
_COMPARE_GROUND_TRUTH = frozenset({gsm8k.compute_score, math_boxed.compute_score, demo.compute_score})


def compares_ground_truth(name: str) -> bool:
    """The scorer registered as ``name`` is a built-in one, which compares the response with the row's
    ``reward_model.ground_truth`` (functions of ``register_scorer`` may not need one)."""
    return _SCORERS.get(name) in _COMPARE_GROUND_TRUTH


def known_sources() -> list[str]:
    """Every registered scorer name / data_source."""
    return sorted(_SCORERS)


def get_scorer(data_source: str | None) -> Scorer:
    """The scorer registered for ``data_source`` (or a scorer name such as "gsm8k", "math").

    Raises:
        ValueError: nothing is registered under that name (the message lists what is), or ``data_source`` is
            None (rows of a file without a data_source column: the message says how to score them).
    """
    if data_source is None:  # RLHFDataset's rows from a file without a data_source column
        raise ValueError(
            "rows without a data_source (their data file has no 'data_source' column) have no reward scorer: "
            f"reward.scorer='auto' picks one by data_source; add a 'data_source' column naming one of "
            f"{known_sources()}, or set reward.scorer to one of them, reward.custom.path to your function, or "
            "reward.scorer=null to score with a reward model alone"
        )
    try:
        return _SCORERS[data_source]
    except (KeyError, TypeError):
        raise ValueError(
            f"no reward scorer for data_source {data_source!r}; known: {known_sources()}; set reward.scorer, "
            "reward.custom.path, or register_scorer()"
        ) from None


def default_compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> Any:
    """Score with the scorer registered for ``data_source`` (``extra_info`` is not used by built-ins)."""
    return get_scorer(data_source)(solution_str, ground_truth)


def fixed_scorer(name: str) -> ScoreFn:
    """A :data:`ScoreFn` that scores every sample with the scorer ``name``, whatever its data_source."""
    scorer = get_scorer(name)

    def score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> Any:
        return scorer(solution_str, ground_truth)

    score.__name__ = f"scorer_{name}"
    return score


def load_custom_scorer(path: str | os.PathLike, name: str = "compute_score") -> ScoreFn:
    """Load ``name`` from the Python file ``path``; it is called as ``fn(data_source, solution_str,
    ground_truth, extra_info)``.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: the file fails to import, or defines no callable ``name`` (lists what it defines).
    """
    return load_user_function(path, name, path_key="reward.custom.path", name_key="reward.custom.name")
