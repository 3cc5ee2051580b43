"""The learning rate of each step: constant, or nanoGPT's schedule (linear warmup, then a
cosine decay to a floor).

    cosine, step s = 0, 1, ... of a run of S steps (s counts the updates made before it):
      s < W:          lr (s + 1) / (W + 1)
      W <= s <= S:    min_lr + (lr - min_lr) (1 + cos(pi (s - W) / (S - W))) / 2
      s > S:          min_lr
    constant: lr, after the same linear warmup when W > 0.
"""
from __future__ import annotations

import math

from ..errors import StarpuLLMError, opt

SCHEDULES = ("constant", "cosine")


def learning_rate(step: int, total: int, lr: float, schedule: str = "constant",
                  warmup: int = 0, min_lr: float = 0.0) -> float:
    """The learning rate of the update at 0-based step `step` of `total` steps."""
    if step < warmup:
        return lr * (step + 1) / (warmup + 1)
    if schedule == "constant":
        return lr
    if step > total or total <= warmup:
        return min_lr
    decay = (step - warmup) / (total - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * decay)) * (lr - min_lr)


def check_schedule(schedule: str, lr: float, warmup: int, min_lr: float,
                   steps: int | None = None) -> None:
    """A clear error for settings the schedule cannot follow (steps: the run's, when known)."""
    if schedule not in SCHEDULES:
        raise StarpuLLMError(f"{opt('lr_schedule')} {schedule!r}: choose one of {', '.join(SCHEDULES)}")
    if warmup < 0:
        raise StarpuLLMError(f"{opt('warmup_steps')} must be >= 0, got {warmup}")
    if steps is not None and warmup > steps:
        raise StarpuLLMError(f"{opt('warmup_steps')} {warmup} is above {opt('steps')} {steps}: the "
                             f"run would end inside its warmup, below the learning rate asked "
                             f"for; give {opt('warmup_steps')} at most {steps}")
    if schedule == "cosine" and not 0 <= min_lr <= lr:
        raise StarpuLLMError(f"{opt('min_lr')} {min_lr} must be between 0 and {opt('lr')} {lr}: "
                             "the cosine schedule decays from the one to the other")
