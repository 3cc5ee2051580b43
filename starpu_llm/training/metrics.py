"""--metrics-jsonl: one JSON object per step, written as the run goes (Metrics says how it
survives a killed run and continues a resumed one).

Each record has the step, its loss, its time (ms, tokens_per_ms), the partition the step ran
on ("partition": record.Partition's fields) and, when they apply, the scheduled learning rate
("lr"), the gradients' norm before clipping ("grad_norm"), the validation loss
("val_loss"), HellaSwag's acc_norm ("hellaswag_acc_norm"), the disk traffic under a memory limit ("disk_read_mb", "disk_written_mb") and,
where the machine is calibrated, the model FLOPs per second over the sgemm peak of the cores
used ("mfu", as nanoGPT's). With validation, a run from step 0 first writes a row of step 0
with its "val_loss" (the initial weights') and "partition" only: no update, so no loss or
time (as llm.c logs a validation loss at step 0); so with HellaSwag, its
"hellaswag_acc_norm" in that row."""
from __future__ import annotations

import json
import os
from dataclasses import asdict

from ..errors import StarpuLLMError
from ..io.atomic import atomic_write
from ..plan.record import Partition
from .watchers import Watcher


class Metrics(Watcher):
    """The metrics file, written row by row under its own name as the run goes: each row is
    handed to the operating system when written (a killed run leaves every row of the steps
    it finished), and fsync'ed at each checkpoint and at the end (the rows of a checkpoint's
    steps are on disk with it). A run resumed at `step` keeps the file's rows up to that step
    and appends its own (the rows of steps it redoes are dropped: it writes them again); a
    new run starts the file anew, saying so when it replaces rows. Should a row fail to be
    written (a full disk), the run goes on without the file: failed(text) says so once (the
    trainer warns and lists it among the outputs not written), and no row is written after."""

    def __init__(self, path, step: int, partition: Partition, warn, failed=None):
        self.path = os.fspath(path)
        self.partition = asdict(partition)
        self.failed = failed or warn
        self.broken = False
        kept, dropped = _rows_up_to(self.path, step) if step else ([], _count_rows(self.path))
        if dropped and not step:
            warn(f"{self.path}: its {dropped} row(s) of an earlier run are replaced by this "
                 f"run's")
        atomic_write(self.path, lambda f: f.writelines(kept), text=True)
        try:
            self.file = open(self.path, "a", encoding="utf-8")
        except OSError as e:
            raise StarpuLLMError(f"cannot write {self.path}: {e.strerror}; choose a writable "
                                 f"output location") from e

    def write(self, row: dict) -> None:
        """One row (its "step" first), with the partition."""
        if self.broken:
            return
        try:
            self.file.write(json.dumps({**row, "partition": self.partition}) + "\n")
            self.file.flush()
        except OSError as e:
            self.broken = True
            self.failed(f"{self.path}: its row of step {row['step']} and later ones were not "
                        f"written ({e.strerror or e}); the rows before it are there")

    def after_step(self, done) -> None:
        """The row of a step (trainer.StepDone)."""
        self.write({"step": done.step, "loss": done.loss, "ms": done.ms,
                    "tokens_per_ms": done.tokens_per_ms, **done.extra})

    def validated_first(self, measured) -> None:
        self.write({"step": 0, **measured})

    def sync(self) -> None:
        """The rows written so far on disk."""
        try:
            self.file.flush()
            os.fsync(self.file.fileno())
        except OSError:       # a metrics file that cannot be synced does not stop the run
            pass

    def close(self) -> None:
        self.sync()
        try:
            self.file.close()
        except OSError:       # what it could not flush was reported by write()
            pass


def _rows_up_to(path: str, step: int) -> tuple[list, int]:
    """The lines of the metrics file at path whose step is at most `step` (a missing file:
    none), and how many others it has."""
    kept, others = [], 0
    for line in _lines(path):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
            kept.append(line if line.endswith("\n") else line + "\n")
        else:
            others += 1
    return kept, others


def _count_rows(path: str) -> int:
    return sum(1 for line in _lines(path) if line.strip())


def _lines(path: str):
    if not os.path.isfile(path):      # not there yet (a FIFO or a folder: refused before)
        return []
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.readlines()


def step_extras(cfg, engine, evaluations, lr: float, rank: int, last: bool, step: int,
                norm=None) -> dict:
    """What the metrics record of update `step` beyond its loss and time, when it applies:
    the scheduled learning rate, the gradients' norm before clipping (rank 0 holds it; norm:
    the step's norm root, Submitted.norm), each evaluation's measure (validation.Evaluation:
    the validation loss, HellaSwag's acc_norm; after the step's update, when due: the
    trainer has drained the step then)."""
    extra = {}
    if cfg.lr_schedule != "constant" or cfg.warmup_steps:
        extra["lr"] = lr
    if cfg.grad_clip > 0 and rank == 0:
        extra["grad_norm"] = engine.grad_norm(norm)
    for e in evaluations:
        if e.due(step, last):
            extra[e.key] = e.measure(engine)
    return extra
