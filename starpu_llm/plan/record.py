"""What a run records about itself, printed at its start, in each metrics record and in the
checkpoint companion: the partition it ran on and the settings that shape its numbers. A
resumed run compares them with its own (training/resume.py)."""
from __future__ import annotations

import hashlib
import json
import zlib
from dataclasses import MISSING, asdict, dataclass, fields, replace

import numpy as np

from ..errors import opt
from ..model.config import ADAM_BETAS


@dataclass(frozen=True)
class Partition:
    """How a run splits its work; with the settings, what fixes its roundings."""
    engine: str             # "starpu" or "reference"
    workers: int            # N (the reference engine: 1)
    cores_per_worker: int   # K (the reference engine: its OpenMP threads)
    sub_batches: int        # per MPI process
    kcore: str              # what gives a task its K cores, as in effect: single, team,
                            # forkjoin or parallel-workers (partition.resolve); the
                            # reference engine: openmp
    ranks: int = 1          # MPI processes
    ownership: str = "rank0"  # who owns parameters, gradients, moments (plan/topology.py):
                              # sharded or rank0 (a single process: rank0)
    stages: int = 1         # pipeline stages (ranks = stages x data-parallel copies)
    gpus: int = 0           # GPUs (StarPU CUDA workers) beside the N CPU workers
    gpu_matmul: str = ""    # their matmul precision, "tf32" or "fp32" ("" without GPUs)
    sched: str = ""         # the StarPU scheduler (partition.scheduler; "": the reference
                            # engine, or a record saved before it was kept)
    pipeline_schedule: str = ""   # a pipeline's schedule (plan/topology.PIPELINE_SCHEDULES;
                                  # "": no pipeline, or a record saved before it was kept)
    attention: str = ""     # the attention's form, "flash" or "gemm" (model/config.ATTENTIONS,
                            # partition.attention_of; "": a record saved before it was kept,
                            # whose resume takes the default; a run refuses it)

    @property
    def cores(self) -> int:
        """N x K: the CPU cores the partition's workers take (the reference engine: its
        threads)."""
        return self.workers * self.cores_per_worker

    @property
    def copies(self) -> int:
        """D: the data-parallel copies of the model among the ranks (R = S stages x D); each
        copy trains on its share of the batch (per_copy)."""
        return max(1, self.ranks // self.stages)

    def per_copy(self, batch: int) -> int:
        """The sequences of one data-parallel copy in a step of `batch` (over all ranks)."""
        return batch // self.copies

    @property
    def starpu_workers(self) -> int:
        """StarPU CPU workers: N team workers (their OpenMP teams take the other cores), else a
        worker on every core."""
        return self.workers if self.kcore == "team" else self.cores

    @property
    def pins_sub_batches(self) -> bool:
        """The pinning rule, stated here only: sub-batch i runs on worker i mod N where
        partition worker i is StarPU worker i (N > 1 team or one-core workers); not on parallel
        or combined workers (built over a worker per core), nor with GPUs (their CUDA workers
        come first in StarPU's numbering, and a pinned task would never reach them)."""
        return self.workers > 1 and self.gpus == 0 and self.starpu_workers == self.workers

    def same_shape(self, other: "Partition") -> bool:
        """Whether other runs the same roundings: every field but the scheduler and a
        pipeline's schedule (the same bits under any schedule; absent from older records), the
        attention's form where both record it."""
        def blank(p, q):
            return replace(p, sched="", pipeline_schedule="", attention=p.attention or q.attention)
        return blank(self, other) == blank(other, self)

    def describe(self) -> str:
        if self.stages > 1:
            ranks = (f" per copy, {self.copies} copies of {self.stages} pipeline "
                     f"stages on {self.ranks} MPI processes, {self.ownership} ownership")
        else:
            ranks = (f" on each of {self.ranks} MPI processes, {self.ownership} ownership"
                     if self.ranks > 1 else "")
        attention = f", {self.attention} attention" if self.attention else ""
        if self.engine == "reference":
            return (f"reference engine, {self.cores_per_worker} thread(s), "
                    f"{self.sub_batches} sub-batch(es){attention}")
        gpus = (f" + {self.gpus} GPU(s) ({self.gpu_matmul.upper()} matmuls)" if self.gpus
                else "")
        sched = f", scheduler {self.sched}" if self.sched else ""
        schedule = f", {self.pipeline_schedule} schedule" if self.pipeline_schedule else ""
        return (f"{self.workers} worker(s) x {self.cores_per_worker} core(s) ({self.kcore}){gpus}, "
                f"{self.sub_batches} sub-batch(es){ranks}{attention}{schedule}{sched}")


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
    grad_accum: int = 1     # micro-batches a step (a record saved before it was kept: 1)
    weight_decay_params: str = "all"    # the tensors decayed (a record saved before it was
                                        # kept: all, the only choice then)
    beta1: float = ADAM_BETAS[0]        # AdamW's (a record saved before they were kept:
    beta2: float = ADAM_BETAS[1]        # llm.c's, the only ones then)

    @classmethod
    def of(cls, cfg) -> "Settings":
        """The settings of a TrainConfig."""
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls)})

    def changed(self, now: "Settings") -> list[tuple[str, object, object]]:
        """(name, recorded value, value now) of each setting that differs in a way that changes
        the run: `steps` only under the cosine schedule (elsewhere it only says where to stop),
        `weight_decay_params` only with a weight decay."""
        out = []
        for f in fields(self):
            was, new = getattr(self, f.name), getattr(now, f.name)
            if f.name == "steps" and "cosine" not in (self.lr_schedule, now.lr_schedule):
                continue
            if f.name == "weight_decay_params" and not (self.weight_decay or now.weight_decay):
                continue
            if was != new:
                out.append((f.name, was, new))
        return out


def run_identity(settings: Settings, config, start: str, data: list) -> str:
    """The identity of a new run, which its resumed parts keep (checkpoints tell runs apart):
    a digest of what decides its numbers (settings, model, what it starts from, e.g. "seed
    1337", and its data_fingerprint), so that the same run started again is the same run
    (its checkpoints are the same) and its files stay bitwise the same."""
    kept = asdict(settings)
    # a setting kept after the first records (a field with a default: the value every run had
    # before), at that value, leaves the identity as it was: the same runs, the same identity
    for f in fields(Settings):
        if f.default is not MISSING and kept[f.name] == f.default:
            del kept[f.name]
    if not kept["weight_decay"]:        # no decay: the tensors it would shrink change nothing
        kept.pop("weight_decay_params", None)
    blob = json.dumps([kept, str(config), start, data], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def data_fingerprint(shards) -> list | dict:
    """What tells token data apart cheaply, from its shards (uint16 arrays, in order): one
    shard, [its length, the sums of its first and of its last 4096 tokens]; several,
    {"tokens": their total length, "shards": their count, "crc": a CRC-32 of each one's
    fingerprint in order} (a record has room for three numbers, not a hundred shards')."""
    each = [[int(t.size), int(t[:4096].astype(np.int64).sum()),
             int(t[-4096:].astype(np.int64).sum())] for t in shards]
    if len(each) == 1:
        return each[0]
    return {"tokens": sum(f[0] for f in each), "shards": len(each),
            "crc": zlib.crc32(json.dumps(each).encode())}


def _data_size(fingerprint) -> tuple[int, int]:
    """(tokens, shards) of a data_fingerprint."""
    if isinstance(fingerprint, dict):
        return fingerprint["tokens"], fingerprint["shards"]
    return fingerprint[0], 1


@dataclass(frozen=True)
class RunRecord:
    partition: Partition
    settings: Settings
    run: str | None = None      # run_identity(): None in checkpoints saved before it was kept
    data: list | dict | None = None    # data_fingerprint() of the training data

    def to_json(self) -> str:
        d = {"partition": asdict(self.partition), "settings": asdict(self.settings)}
        d.update({k: v for k, v in (("run", self.run), ("data", self.data)) if v is not None})
        return json.dumps(d, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "RunRecord":
        """The record of to_json; ValueError (KeyError, TypeError) when text is not one."""
        d = json.loads(text)
        return cls(Partition(**d["partition"]), Settings(**d["settings"]), d.get("run"),
                   d.get("data"))

    def changes_since(self, saved: "RunRecord | None") -> list[str]:
        """One warning each for another partition, changed settings, other training data,
        against `saved`, the record of the checkpoint resumed (None: one saved before records
        were kept)."""
        if saved is None:
            return ["the checkpoint records no partition or settings (saved by an older "
                    "starpu-llm): whether this run continues the saved one unchanged is not "
                    "checked"]
        out = []
        if not saved.partition.same_shape(self.partition):
            out.append(f"the run continues on {self.partition.describe()}, it was saved on "
                       f"{saved.partition.describe()}: roundings will differ from the "
                       f"uninterrupted run")
        changed = saved.settings.changed(self.settings)
        if changed:
            out.append(", ".join(f"{opt(name)} {new} (saved with {was})"
                                 for name, was, new in changed)
                       + ": the run is no longer the uninterrupted one")
        if saved.data is not None and saved.data != self.data:
            (was, was_shards), (now, shards) = _data_size(saved.data), _data_size(self.data)
            several = max(was_shards, shards) > 1
            if (was, was_shards) == (now, shards):
                detail = "as many" + (f" in as many shards ({shards})" if several else "") + ", but others"
            elif several:
                detail = f"{was:,} tokens in {was_shards} shard(s) then, {now:,} in {shards} now"
            else:
                detail = f"{was:,} tokens then, {now:,} now"
            out.append(f"{opt('train_data')}: these are not the tokens the run was saved with "
                       f"({detail}): the run is no longer the uninterrupted one")
        return out
