"""The ``guess_number`` environment: find a hidden integer from "Higher." / "Lower." replies (no tools).

Each turn the policy names a number (the last integer in its turn is the guess). The environment replies with a
``user`` message, "Higher." or "Lower.", or "Say one whole number between <low> and <high>." when the turn holds no
integer, and ends the trajectory on the right guess with reward ``1 - 0.1 * <earlier turns>`` (at least 0.1), so
that fewer guesses earn more; running out of turns earns 0. The row's ``extra_info`` holds ``target`` and,
optionally, ``low`` / ``high`` (default 1 / 100).
"""

from __future__ import annotations

import random
import re
from typing import Any

from hybridrl.rollout.agent.interface import Environment, Step, Turn
from hybridrl.rollout.agent.registry import register_environment

_INTEGER = re.compile(r"-?\d+")
DATA_SOURCE = "hybridrl/agent_guess_number"


def last_integer(text: str) -> int | None:
    """The last integer written in ``text``, or None."""
    found = _INTEGER.findall(text)
    return int(found[-1]) if found else None


@register_environment("guess_number")
class GuessNumberEnvironment(Environment):
    """Higher / lower feedback until the hidden number is found; see the module docstring."""

    def reset(self, extra_info: dict[str, Any]) -> None:
        super().reset(extra_info)
        self.target = int(extra_info["target"])
        self.low, self.high = int(extra_info.get("low", 1)), int(extra_info.get("high", 100))

    def step(self, turn: Turn) -> Step:
        guess = last_integer(turn.text)
        if guess == self.target:
            return Step(reward=max(0.1, 1.0 - 0.1 * turn.index), done=True)
        if turn.last:  # out of turns: not done, reward 0
            return Step(reward=0.0)
        if guess is None:
            return Step(observation=f"Say one whole number between {self.low} and {self.high}.", reward=0.0)
        return Step(observation="Higher." if guess < self.target else "Lower.", reward=0.0)


def make_guess_task(n: int, seed: int = 0, low: int = 1, high: int = 100, split: str = "train") -> list[dict]:
    """``n`` rows in the dataset schema: the prompt states the range, ``extra_info`` holds the target."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        target = rng.randint(low, high)
        prompt = f"I picked a whole number between {low} and {high}. Guess it; I will say higher or lower."
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": prompt}],
            "reward_model": {"style": "rule", "ground_truth": str(target)},
            "extra_info": {"target": target, "low": low, "high": high, "split": split, "index": i},
        })  # fmt: skip
    return rows
