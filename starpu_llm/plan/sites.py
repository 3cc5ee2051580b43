"""Where each task of a training step runs: the one place that decides.

Every task submission takes a `Where` (rank, worker, priority) as an argument
(runtime.submit.StarPUOps.at); the engine takes every Where from a Sites, and the
performance model reads the sites the engine chose from the task graph it records
(perf/graph.py). No StarPU here: a Sites is arithmetic on the topology (topology.py) and the
partition.
"""
from __future__ import annotations

from typing import NamedTuple

from ..errors import StarpuLLMError, opt
from .topology import PHASE_PRIORITY, PIPELINE_SCHEDULES, Topology, gradient_mode, schedule_sets

# csrc/starpu/sl_api.h's SL_NODE_OWNER and SL_ANY_WORKER (runtime/submit.py checks them)
OWNER = -1      # the rank: StarPU-MPI's choice, the owner of the data the task writes
ANY = -1        # the worker: the scheduler's choice


class Where(NamedTuple):
    """Where and when a task runs: the StarPU-MPI rank (OWNER: the owner of the data it
    writes), the StarPU worker (ANY: the scheduler's choice) and its StarPU priority (higher
    first among the tasks ready on a worker; 0 the default)."""
    node: int = OWNER
    worker: int = ANY
    priority: int = 0


ANYWHERE = Where()


def default_micro_batches(per_copy: int, stages: int, workers: int) -> int:
    """A pipeline's sub-batches (micro-batches) per copy when not given: the fewest that
    divide the copy's batch and give each stage's workers two each in flight (2 S N), so
    that a stage has the next micro-batch while the others hold theirs; at most one sequence
    each."""
    return next((m for m in range(2 * stages * workers, per_copy + 1) if per_copy % m == 0),
                per_copy)


def default_sub_batches(per_copy: int, stages: int, workers: int, gpus: int = 0) -> int:
    """The sub-batches per data-parallel copy when not given: a pipeline's micro-batches
    (default_micro_batches), else one per worker (data parallelism); with GPUs one per GPU
    (they run nearly every task)."""
    return default_micro_batches(per_copy, stages, workers) if stages > 1 else gpus or workers


class Sites:
    """The sites of one engine's tasks, for a topology of ranks, `subs_per_copy` sub-batches
    (micro-batches) per data-parallel copy, `workers` workers a process, sub-batches pinned to
    them or not (`pinned`: where StarPU's worker ids are the partition's workers), and a
    pipeline's schedule.

    Data parallelism: sub-batch i stays on worker i mod N when pinned, so every worker always
    adds into its own reduction copies and two sub-batches never queue behind each other.
    A pipeline's schedule (docs/scaling.md, StarPU-MPI internals): each stage holds `sets`
    activation sets per copy (schedule_sets), micro-batch j of a copy using set j mod sets;
    the tasks' priorities (PHASE_PRIORITY): under eager and gpipe forward before the head
    before the backward, under 1f1b the reverse, bounded all 0."""

    def __init__(self, topology: Topology, subs_per_copy: int = 1, workers: int = 1,
                 pinned: bool = False, schedule: str = "eager", gpus: int = 0):
        if schedule not in PIPELINE_SCHEDULES:
            raise StarpuLLMError(f"{opt('pipeline_schedule')} {schedule!r}: choose one of "
                                 f"{', '.join(PIPELINE_SCHEDULES)}")
        self.topology = topology
        self.subs_per_copy, self.workers, self.gpus = subs_per_copy, workers, gpus
        self.pinned = pinned and workers > 1
        self.schedule = schedule if topology.stages > 1 else None
        self.sets = (schedule_sets(schedule, topology.stages, subs_per_copy) if self.schedule
                     else subs_per_copy)
        # how the sub-batches of a process add their gradients (topology.gradient_mode)
        self.redux = gradient_mode(workers + gpus, self.pinned, subs_per_copy)

    def key(self) -> tuple:
        """What the sites depend on (the performance model caches a recording by it)."""
        t = self.topology
        return (t.ranks, t.stages, t.ownership, t.layer_stage, t.wte_blocks,
                self.subs_per_copy, self.workers, self.pinned, self.schedule, self.redux)

    def copy(self, i: int) -> int:
        """The data-parallel copy sub-batch i runs on."""
        return i // self.subs_per_copy

    def owner(self, i: int) -> int:
        """The rank of sub-batch i's inputs and loss: its copy's stage 0."""
        return self.topology.rank(0, self.copy(i))

    def sub_batch_site(self, i: int, phase: str = "forward") -> Where:
        """Sub-batch i's tasks of a phase ("forward": its load and blocks, "head": the final
        layernorm, lm head and loss, "head_backward": their backward, "backward": the rest of
        it): on its rank (in a pipeline: the rank of the stage a task belongs to, the owner of
        what it writes), on its worker when pinned, and in a pipeline at priority
        PHASE_PRIORITY[schedule][phase] x M + M - 1 - j for micro-batch j of M in its copy
        (phase first, then the earlier micro-batch; 0 to 3 M - 1)."""
        M, j = self.subs_per_copy, i % self.subs_per_copy
        worker = j % self.workers if self.pinned else ANY
        order = PHASE_PRIORITY.get(self.schedule)
        return Where(self.owner(i) if self.topology.stages == 1 else OWNER, worker,
                     order[phase] * M + M - 1 - j if order else 0)

    def update_site(self) -> Where:
        """The update tasks (AdamW, the gradient norm): on the owner of what they write (each
        slice's owner; the norm's sums on rank 0), on any worker."""
        return Where(OWNER, ANY)

    def reduction_site(self) -> Where:
        """The gradient reduction's tasks (taskflow.reduce_gradients): on the owner of what
        they write (a contribution added into its slice's owner's gradient, a contribution
        zeroed on its rank), on any worker."""
        return Where(OWNER, ANY)
