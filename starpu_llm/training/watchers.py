"""What watches a training run's steps (trainer._run calls each after every step, then closes
them): its metrics row, its line, the divergence check, samples, checkpoints, the task trace;
and what a run counts beside its time."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .checkpointing import checkpoint_step
from ..errors import StarpuLLMError, opt
from ..runtime import mpi as distributed
from .sampler import TrainingSampler


@dataclass
class StepDone:
    """What a step left, for what watches it."""
    step: int               # the updates made so far
    loss: float
    ms: float
    tokens_per_ms: float
    extra: dict             # step_extras: lr, grad_norm, val_loss, hellaswag_acc_norm,
                            # disk traffic, mfu
    stopping: bool          # a signal stops the run after this step (every rank's answer)


class Watcher:
    """Called after each step (after_step), closed at the end of the run (close)."""

    def after_step(self, done: StepDone) -> None:
        pass

    def validated_first(self, measured: dict) -> None:
        """The measures of the weights the run starts from (step 0, before any update:
        Evaluation.due_first), {key: value} (val_loss, hellaswag_acc_norm)."""

    def reads_state(self, step: int) -> bool:
        """Whether after update `step` it reads the model or the data position (the trainer
        then submits nothing past that step before it has run)."""
        return False

    def close(self) -> None:
        pass


class StepLine(Watcher):
    """A line per step, like llm.c's, and the share of the calibrated peak like nanoGPT's
    MFU."""

    def __init__(self, log, steps):
        self.log, self.steps = log, steps

    def after_step(self, d):
        extra = "".join(", " + _extra(k, v) for k, v in d.extra.items())
        self.log(f"step {d.step:4d}/{self.steps}: train loss {d.loss:.6f} ({d.ms:.1f} ms, "
                 f"{d.tokens_per_ms:.3f} tok/ms){extra}")

    def validated_first(self, measured):
        self.log(f"step {0:4d}/{self.steps}: "
                 + ", ".join(_extra(k, v) for k, v in measured.items()))


def _extra(key: str, value: float) -> str:
    """One of a step's extras as its line says it ("val loss 4.2", "mfu 31.0%", "disk written
    2.9 MB"; the metrics row keeps the value whole)."""
    if key == "mfu":
        return f"mfu {value:.1%}"
    if key.endswith("_mb"):
        return f"{key[:-3].replace('_', ' ')} {value:.1f} MB"
    return f"{key.replace('_', ' ')} {value:.6g}"


class Divergence(Watcher):
    def after_step(self, d):
        if not np.isfinite(d.loss):
            raise StarpuLLMError(f"the loss diverged at step {d.step} ({d.loss}); lower {opt('lr')}")


class Samples(Watcher):
    """--sample-every: a sample from the model being trained."""

    def __init__(self, run):
        self.sampler, self.every, self.log = TrainingSampler(run.engine, run.cfg.seed), \
            run.cfg.sample_every, run.log

    def reads_state(self, step):
        return step % self.every == 0

    def after_step(self, d):
        if self.reads_state(d.step):
            self.log(f"sample at step {d.step}: {self.sampler.sample()!r}")

    def close(self):
        self.sampler.close()


class Checkpoints(Watcher):
    """--save-every: a checkpoint every N steps and when a signal stops the run, with the
    metrics rows up to it synced to disk; failed(text): one could not be written."""

    def __init__(self, run, metrics, failed):
        self.run, self.metrics, self.failed = run, metrics, failed

    def reads_state(self, step):
        return step % self.run.cfg.save_every == 0

    def after_step(self, d):
        run = self.run
        if self.reads_state(d.step) or d.stopping:
            checkpoint_step(run.cfg, run.engine, run.state, run.loader, run.rank, run.record,
                            run.log, self.failed)
            if self.metrics:
                self.metrics.sync()


class Trace(Watcher):
    """cfg.trace: every task StarPU runs, recorded (result.trace)."""

    def __init__(self, runtime, result):
        self.runtime, self.result = runtime, result
        runtime.start_trace(200_000)

    def close(self):
        self.result.trace = self.runtime.trace()
        self.runtime.stop_trace()


class Counters:
    """What a run counts beside its time: under MPI the bytes each rank sends (StarPU-MPI's
    statistics), under --memory-limit the disk traffic of each step (also in its extras)."""

    def __init__(self, comm, runtime, memory):
        self.comm, self.runtime = comm, runtime
        self.sent = []      # under MPI, the bytes sent so far at each step's start
        self.disk = [runtime.disk_traffic()] if memory is not None else None
        self.gpu_mb = None  # with GPUs, the most memory in use on them after a step

    def before_step(self):
        if self.comm is not None:
            self.sent.append(self.runtime.bytes_sent())

    def skip(self):
        """What ran since the last count (the validation before the first step) is no step's:
        the next step's disk traffic starts from now."""
        if self.disk is not None:
            self.disk[-1] = self.runtime.disk_traffic()

    def after_step(self, extra: dict):
        gpu = self.runtime.gpu_memory_mb() if self.runtime is not None else None
        if gpu is not None:     # StarPU keeps what it allocated: the peak is still there
            self.gpu_mb = max(self.gpu_mb or 0.0, gpu)
        if self.disk is not None:
            self.disk.append(self.runtime.disk_traffic())
            (r0, w0), (r1, w1) = self.disk[-2:]
            extra.update(disk_read_mb=(r1 - r0) / 1e6, disk_written_mb=(w1 - w0) / 1e6)

    def results(self, result, timed: int) -> None:
        result.peak_gpu_mb = self.gpu_mb
        if self.comm is not None and self.sent:
            result.traffic = distributed.traffic(self.comm, self.sent[len(result.step_ms) - timed],
                                                 self.runtime.bytes_sent(), timed)
        if self.disk is not None:
            result.disk_traffic = [(b[0] - a[0], b[1] - a[1])
                                   for a, b in zip(self.disk, self.disk[1:])]
