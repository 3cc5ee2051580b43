"""--metrics-jsonl: one JSON object per step, written as the run goes.

Each record has the step, its loss, its time (ms, tokens_per_ms), the partition the step ran
on ("partition": record.Partition's fields) and, when they apply, the scheduled learning rate
("lr"), the gradients' norm before clipping ("grad_norm") and the validation loss
("val_loss")."""
from __future__ import annotations

import json
import os
from dataclasses import asdict

from .io.atomic import AtomicFile
from .record import Partition


class Metrics:
    """The metrics file, written under a temporary name as the run goes and under its own at
    commit() (also for a failed run). A run resumed at `step` keeps the records up to that
    step from the file it replaces, so the file covers the whole run (the records of steps
    the resumed run redoes are dropped)."""

    def __init__(self, path, step: int, partition: Partition):
        self.out = AtomicFile(path, text=True)
        self.partition = asdict(partition)
        if step and os.path.exists(path):
            with open(path, encoding="utf-8", errors="replace") as f:
                for line in f:
                    try:
                        row = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
                        self.out.file.write(line)

    def write(self, step: int, loss: float, ms: float, tokens_per_ms: float, extra: dict) -> None:
        self.out.file.write(json.dumps({"step": step, "loss": loss, "ms": ms,
                                        "tokens_per_ms": tokens_per_ms, **extra,
                                        "partition": self.partition}) + "\n")
        self.out.file.flush()

    def commit(self) -> None:
        self.out.commit()


def step_extras(cfg, engine, validation, lr: float, rank: int, last: bool) -> dict:
    """What the metrics record of a step beyond its loss and time, when it applies: the
    scheduled learning rate, the gradients' norm before clipping (rank 0 holds it), the
    validation loss (after the step's update, every val_every steps and after the last)."""
    extra = {}
    if cfg.lr_schedule != "constant" or cfg.warmup_steps:
        extra["lr"] = lr
    if cfg.grad_clip > 0 and rank == 0:
        extra["grad_norm"] = engine.grad_norm()
    if validation and validation.due(engine.state.step, last):
        extra["val_loss"] = validation.loss(engine)
    return extra
