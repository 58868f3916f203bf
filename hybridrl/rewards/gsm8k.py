"""GSM8K scorer: the final answer after ``####`` (strict) or the last number in the text (flexible).

GSM8K solutions end with ``#### <answer>``; answers are integers, sometimes written with thousands commas
(``1,234``), a dollar sign or a trailing period. Both the response's and the ground truth's answers are
normalised (commas, ``$`` and a trailing ``.`` removed) and compared as numbers (``72`` == ``72.00``).
"""

from __future__ import annotations

import re
from typing import Any

_STRICT = re.compile(r"#### *\$?(-?[0-9][0-9,]*(?:\.[0-9]+)?)")
_NUMBER = re.compile(r"-?[0-9][0-9,]*(?:\.[0-9]+)?")
METHODS = ("strict", "flexible")


def normalize_number(text: str) -> str:
    """``"$1,234.50."`` -> ``"1234.50"``: drops commas, ``$``, spaces and a trailing period."""
    return text.replace(",", "").replace("$", "").replace(" ", "").rstrip(".")


def extract_answer(solution_str: str, method: str = "strict") -> str | None:
    """The answer a response gives, normalised, or None when it gives none.

    Args:
        solution_str: the response text.
        method: "strict" takes the last ``#### <number>``; "flexible" takes the last number anywhere.
    """
    if method not in METHODS:
        raise ValueError(f"gsm8k method {method!r} is unknown; use one of {list(METHODS)}")
    found = (_STRICT if method == "strict" else _NUMBER).findall(solution_str)
    return normalize_number(found[-1]) if found else None


def _same_number(a: str, b: str) -> bool:
    try:
        return float(a) == float(b)
    except ValueError:
        return a == b


def compute_score(
    solution_str: str, ground_truth: Any, method: str = "strict", format_score: float = 0.0, score: float = 1.0
) -> float:
    """``score`` when the response's answer equals ``ground_truth``, ``format_score`` when it gives a wrong
    answer, 0.0 when it gives none. A ground truth that is a full solution (``... #### 72``) is reduced to
    its answer first."""
    truth = str(ground_truth)
    if "####" in truth:
        truth = truth.split("####")[-1]
    answer = extract_answer(solution_str, method)
    if answer is None:
        return 0.0
    return score if _same_number(answer, normalize_number(truth.strip())) else format_score
