"""The quickstart's demo task, "copy the digits", and its scorer.

A prompt asks to copy a short random digit string: the user turn is ``"Copy: 482"`` and the right
response is exactly ``"482"``. It is verifiable by string equality, needs no knowledge (a tiny
random-init model can learn it), and depends on the prompt (the policy cannot win with one fixed
answer). The scorer gives dense partial credit so the reward rises from the very first steps:

    score = 1.0                                    if response.strip() == answer
    score = 0.5 * matches / max(len(response), len(answer))   otherwise,

where ``matches`` counts positions where the stripped response and the answer hold the same character.
Partial credit stays below 0.5, so an exact copy always beats any near miss, and dividing by the longer
length rewards stopping at the right place (emitting EOS).
"""

from __future__ import annotations

import random
from typing import Any

DATA_SOURCE = "hybridrl/demo_copy"
"""``data_source`` of the demo rows (selects :func:`compute_score` in the scorer registry)."""


def make_demo_task(n: int, seed: int = 0, num_digits: int = 3, split: str = "train") -> list[dict[str, Any]]:
    """``n`` demo rows in the dataset schema (``prompt``, ``data_source``, ``reward_model``, ``extra_info``).

    Args:
        n: number of rows.
        seed: RNG seed (the same seed gives the same rows).
        num_digits: digits to copy per prompt.
        split: stored in ``extra_info`` (use different seeds for train and validation).

    Returns:
        Rows ready for :func:`hybridrl.data.write_rows`.
    """
    if n < 1 or num_digits < 1:
        raise ValueError(f"make_demo_task needs n >= 1 and num_digits >= 1, got n={n}, num_digits={num_digits}")
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        digits = "".join(rng.choice("0123456789") for _ in range(num_digits))
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": f"Copy: {digits}"}],
                "reward_model": {"style": "rule", "ground_truth": digits},
                "extra_info": {"split": split, "index": i},
            }
        )
    return rows


def demo_texts(rows: list[dict[str, Any]]) -> list[str]:
    """Sentences to train the demo tokenizer on (every prompt, every answer, all ten digits)."""
    texts = [m["content"] for r in rows for m in r["prompt"]]
    return [*texts, *(r["reward_model"]["ground_truth"] for r in rows), "0123456789"]


def compute_score(solution_str: str, ground_truth: Any) -> float:
    """1.0 for an exact copy, else partial credit in [0, 0.5) (see the module docstring)."""
    response, answer = solution_str.strip(), str(ground_truth)
    if response == answer:
        return 1.0
    longest = max(len(response), len(answer))
    if longest == 0:
        return 0.0
    matches = sum(a == b for a, b in zip(response, answer, strict=False))
    return 0.5 * matches / longest
