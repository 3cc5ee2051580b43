"""What a run records about itself, printed at its start, in each metrics record and in the
checkpoint companion: the partition it ran on and the settings that shape its numbers. A
resumed run compares them with its own (resume.py)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True)
class Partition:
    """How a run splits its work; with the settings, what fixes its roundings."""
    engine: str             # "starpu" or "reference"
    workers: int            # N (the reference engine: 1)
    cores_per_worker: int   # K (the reference engine: its OpenMP threads)
    sub_batches: int        # per MPI process
    kcore: str              # what gives a task its K cores, as in effect: single, team,
                            # forkjoin or parallel-workers (runtime.effective_kcore); the
                            # reference engine: openmp
    ranks: int = 1          # MPI processes
    ownership: str = "rank0"  # who owns parameters, gradients, moments (flow/placement.py):
                              # sharded or rank0 (a single process: rank0)
    stages: int = 1         # pipeline stages (ranks = stages x data-parallel copies)
    gpus: int = 0           # GPUs (StarPU CUDA workers) beside the N CPU workers
    gpu_matmul: str = ""    # their matmul precision, "tf32" or "fp32" ("" without GPUs)

    def describe(self) -> str:
        if self.stages > 1:
            ranks = (f" per copy, {self.ranks // self.stages} copies of {self.stages} pipeline "
                     f"stages on {self.ranks} MPI processes, {self.ownership} ownership")
        else:
            ranks = (f" on each of {self.ranks} MPI processes, {self.ownership} ownership"
                     if self.ranks > 1 else "")
        if self.engine == "reference":
            return f"reference engine, {self.cores_per_worker} thread(s), {self.sub_batches} sub-batch(es)"
        gpus = (f" + {self.gpus} GPU(s) ({self.gpu_matmul.upper()} matmuls)" if self.gpus
                else "")
        return (f"{self.workers} worker(s) x {self.cores_per_worker} core(s) ({self.kcore}){gpus}, "
                f"{self.sub_batches} sub-batch(es){ranks}")


@dataclass(frozen=True)
class Settings:
    """The training settings that shape a run's numbers beyond the model and the partition."""
    batch: int
    seq_len: int
    steps: int              # the cosine schedule's horizon
    lr: float
    weight_decay: float
    lr_schedule: str
    warmup_steps: int
    min_lr: float
    grad_clip: float

    @classmethod
    def of(cls, cfg) -> "Settings":
        """The settings of a TrainConfig."""
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls)})

    def changed(self, now: "Settings") -> list[tuple[str, object, object]]:
        """(name, recorded value, value now) of each setting that differs in a way that changes
        the run: `steps` only under the cosine schedule (elsewhere it only says where to stop)."""
        out = []
        for f in fields(self):
            was, new = getattr(self, f.name), getattr(now, f.name)
            if f.name == "steps" and "cosine" not in (self.lr_schedule, now.lr_schedule):
                continue
            if was != new:
                out.append((f.name, was, new))
        return out


@dataclass(frozen=True)
class RunRecord:
    partition: Partition
    settings: Settings

    def to_json(self) -> str:
        return json.dumps({"partition": asdict(self.partition), "settings": asdict(self.settings)},
                          separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "RunRecord":
        """The record of to_json; ValueError (KeyError, TypeError) when text is not one."""
        d = json.loads(text)
        return cls(Partition(**d["partition"]), Settings(**d["settings"]))
