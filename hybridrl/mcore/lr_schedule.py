"""Learning-rate schedules: linear warmup, then constant, linear or cosine decay to ``min_lr``.

``step`` counts the optimizer updates already applied (0 for the first update); skipped updates (NaN
gradients) do not advance it. With ``W = warmup_steps`` and ``T = total_steps``:

    step < W:   lr * (step + 1) / W                      (the first update already moves; the W-th uses lr)
    constant:   lr
    linear:     min_lr + (lr - min_lr) * (1 - q)         q = clamp((step - W) / (T - W), 0, 1)
    cosine:     min_lr + (lr - min_lr) * (1 + cos(pi q)) / 2

Pure Python, no torch: the same function drives the CPU (``torch.optim``), GPU (Megatron) and FSDP optimizers,
which also share :class:`StepResult`, what a step reports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DECAY_STYLES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class LRSchedule:
    """A warmup + decay schedule; call it with the number of updates already applied."""

    lr: float
    """Peak learning rate (reached at the end of warmup)."""
    min_lr: float = 0.0
    """Floor of linear/cosine decay (reached at ``total_steps``)."""
    warmup_steps: int = 0
    """Updates of linear warmup from ``lr / warmup_steps`` to ``lr``."""
    total_steps: int | None = None
    """Updates in the whole run; required by linear/cosine decay."""
    decay_style: str = "constant"
    """One of ``constant``, ``linear``, ``cosine``."""

    def __post_init__(self) -> None:
        if self.decay_style not in DECAY_STYLES:
            raise ValueError(f"lr decay_style ({self.decay_style!r}) must be one of {DECAY_STYLES}")
        if self.lr < 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"need 0 <= min_lr ({self.min_lr}) <= lr ({self.lr}); lower min_lr")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be >= 0")
        if self.decay_style != "constant" and (self.total_steps is None or self.total_steps <= self.warmup_steps):
            raise ValueError(
                f"total_steps ({self.total_steps}) must exceed warmup_steps ({self.warmup_steps}) for "
                f"{self.decay_style} decay; set total_steps or use decay_style='constant'"
            )

    def __call__(self, step: int) -> float:
        if step < 0:
            raise ValueError(f"step ({step}) must be >= 0")
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.decay_style == "constant":
            return self.lr
        assert self.total_steps is not None
        q = min(max((step - self.warmup_steps) / (self.total_steps - self.warmup_steps), 0.0), 1.0)
        if self.decay_style == "linear":
            factor = 1.0 - q
        else:
            factor = 0.5 * (1.0 + math.cos(math.pi * q))
        return self.min_lr + (self.lr - self.min_lr) * factor


@dataclass
class StepResult:
    """Outcome of one optimizer step (identical on every rank); the Megatron and FSDP optimizers both return it."""

    grad_norm: float
    """Global gradient norm before clipping (NaN/Inf when the step was skipped)."""
    lr: float
    """Learning rate used (or that would have been used)."""
    skipped: bool
    """True when the gradients were not finite and the update was not applied."""
    num_steps: int
    """Updates applied so far, this one included."""
