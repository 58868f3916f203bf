"""Math scorer for ``\\boxed{...}`` answers (MATH, MATH-500 and similar data).

Takes the content of the last ``\\boxed{}`` (or ``\\fbox{}``, or ``\\boxed 5``) of the response, with
nested braces, and compares it with the ground truth (itself unboxed if it is boxed) after a light
normalisation: spaces, ``\\left``/``\\right``, ``\\!``, ``$``, ``\\text{}``, degrees and percent signs,
``\\dfrac``/``\\tfrac``, ``\\frac{a}{b}`` / ``\\frac ab`` -> ``a/b``, a leading ``x=``, trailing ``.0``.
Values that both read as numbers (``0.5``, ``1/2``, ``2.0``) are compared numerically. This is a
string-level check, not a CAS: ``\\sqrt{4}`` and ``2`` differ.
"""

from __future__ import annotations

import re
from typing import Any

_FRAC_BRACED = re.compile(r"\\frac\{([^{}]*)\}\{([^{}]*)\}")
_FRAC_SHORT = re.compile(r"\\frac(\d)(\d)")
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")
_FRACTION = re.compile(r"^(-?\d+(?:\.\d+)?)/(-?\d+(?:\.\d+)?)$")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces kept), or of ``\\boxed x``."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start:].removeprefix("\\boxed").removeprefix("\\fbox")
    if rest.startswith(" "):  # \boxed 5
        return rest.strip().split("$")[0].split()[0] if rest.strip() else None
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, ch in enumerate(rest):
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if depth == 0:
            return rest[1:i]
    return None  # unbalanced braces


_THOUSANDS = re.compile(r"-?\d{1,3}(,\d{3})+(\.\d+)?")
_DECIMAL = re.compile(r"-?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def normalize(answer: str) -> str:
    """A canonical string for simple answers (see the module docstring for the rules)."""
    s = answer.strip().replace("\n", "")
    # "\\$" before "$": removing "$" first leaves a stray backslash ("\\$18.90" -> "\\18.90")
    for old, new in (("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\,", ""), ("\\;", ""), ("\\$", ""), ("$", "")):
        s = s.replace(old, new)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _TEXT.sub(r"\1", s)
    for unit in ("^{\\circ}", "^\\circ", "\\%", "%", "\\$"):
        s = s.replace(unit, "")
    s = s.replace(" ", "")
    s = _FRAC_SHORT.sub(r"\1/\2", s)
    while _FRAC_BRACED.search(s):
        s = _FRAC_BRACED.sub(lambda m: f"{_paren(m.group(1))}/{_paren(m.group(2))}", s)
    if "=" in s and len(s.split("=")[0]) <= 2:  # x=5 -> 5
        s = s.split("=", 1)[1]
    s = s.rstrip(".")
    s = re.sub(r"^(-?\d+)\.0+$", r"\1", s)  # 2.0 -> 2
    return re.sub(r"^(-?)\.(\d)", r"\g<1>0.\2", s)  # .5 -> 0.5


def _paren(term: str) -> str:
    return term if re.fullmatch(r"-?[\w.]+", term) else f"({term})"


def _as_number(s: str) -> float | None:
    if _THOUSANDS.fullmatch(s):  # 32,348 -> 32348; "1,2" (two roots) stays a list, not 12
        s = s.replace(",", "")
    if _DECIMAL.fullmatch(s):  # float() alone would also take "1_0", "inf", "nan"
        return float(s)
    m = _FRACTION.match(s)
    if m and float(m.group(2)) != 0:
        return float(m.group(1)) / float(m.group(2))
    return None


def is_equiv(a: str, b: str) -> bool:
    """Whether two answers match after :func:`normalize` (numerically when both are numbers)."""
    na, nb = normalize(a), normalize(b)
    if na == nb:
        return True
    xa, xb = _as_number(na), _as_number(nb)
    return xa is not None and xb is not None and abs(xa - xb) <= 1e-9 * max(1.0, abs(xb))


def compute_score(solution_str: str, ground_truth: Any) -> float:
    """1.0 when the last boxed answer of the response matches ``ground_truth``, else 0.0."""
    answer = last_boxed(solution_str)
    if answer is None:
        return 0.0
    truth = str(ground_truth)
    truth = last_boxed(truth) or truth  # a boxed ground truth is unboxed; a plain one stays as is
    return 1.0 if is_equiv(answer, truth) else 0.0
