"""How R ranks and the N workers of each share a training step: the pipeline stages and
data-parallel copies of the ranks (Topology), who owns each parameter slice, wte's row blocks,
a pipeline's schedule (how many micro-batches a stage holds, the priorities of its phases) and
how a process's sub-batches add their gradients. Pure arithmetic on the model and the
partition, no StarPU: the engine's placement (handles.py, sites.py) and the performance model
(perf/) both use it, so each rule is written once."""
from __future__ import annotations

import math
import os

from ..model.config import PARAMETER_SPECS, GPTConfig, ParamLayout
from ..errors import StarpuLLMError, opt


def gradient_mode(workers: int, pinned: bool, subs_per_rank: int) -> int:
    """How one process's sub-batches add their gradient contributions (the redux argument of
    the backward tasks) for `workers` workers, sub-batches pinned to them or not. (Under MPI
    each rank adds into its own tensors, and the ranks' sums are added in a fixed order:
    Handles.contributions, taskflow.reduce_gradients.)

    A StarPU reduction (STARPU_REDUX, 1) gives each worker its own copy, summed in a fixed
    tree at the end; nothing orders two sub-batches' additions into one copy, so where they
    share a worker the sums can round differently from run to run (seen on StarPU 1.4's
    parallel worker). With a single worker the contributions are chained instead (RW, 0): in
    submission order, sub-batch 0's first, bitwise reproducible, with no copy, no zeroing and
    no final sum (AdamW leaves every gradient zeroed); one worker runs one task at a time
    anyway, so nothing is lost. With several workers the reduction stays: a chain would
    serialize the sub-batches' backward passes (each one's first contribution, to the tied wte
    gradient, would wait for the previous one's last, to the same gradient). There, bitwise
    reproducibility holds when each worker runs one sub-batch (pinned, N sub-batches on N
    workers)."""
    return int(subs_per_rank > 1 and workers > 1)


OWNERSHIPS = ("sharded", "rank0")

# How a pipeline's micro-batches go through its stages (Sites: sets, sub_batch_site):
# eager (the default) runs forwards first and lets a stage hold 2 S micro-batches; 1f1b
# bounds what a stage holds to S micro-batches and prefers backward work; bounded, the same
# bound, tasks in the order they become ready; gpipe, every micro-batch its own activations,
# all forwards before the backwards.
PIPELINE_SCHEDULES = ("eager", "1f1b", "bounded", "gpipe")
# The task priorities of a schedule's phases (sites.Where.priority,
# Sites.sub_batch_site); a schedule without an entry leaves every priority 0.
# 1f1b: among the tasks ready on a worker, a backward first, then a head (its backward
# follows at once, on the same rank), then forwards, which under 1f1b run at most `sets`
# micro-batches ahead anyway. eager and gpipe: the forwards first, then the heads, then the
# backwards: stage 0, which also runs the head, runs its blocks of every micro-batch it may
# hold before a head, so the next stage never waits for a forward while stage 0 is busy with
# a head (docs/scaling.md, StarPU-MPI internals, Schedule). In all, within a phase the earlier micro-batch first
# (without it a worker alternates between two micro-batches' ready tasks layer by layer, and
# both reach the next stage late).
# The head's backward (phase head_backward) goes with the backward under 1f1b and with the
# head under eager and gpipe: either way it follows its forward at once, so the stage before
# gets its gradient without waiting for the other micro-batches' heads.
FORWARD_FIRST = {"forward": 2, "head": 1, "head_backward": 1, "backward": 0}
PHASE_PRIORITY = {"1f1b": {"forward": 0, "head": 1, "head_backward": 2, "backward": 2},
                  "eager": FORWARD_FIRST, "gpipe": FORWARD_FIRST}


def schedule_order(schedule: str) -> str:
    """In words, the order PHASE_PRIORITY gives a schedule's ready tasks."""
    order = PHASE_PRIORITY.get(schedule)
    if order is None:
        return "tasks in the order they become ready"
    first = "backward" if order["backward"] > order["forward"] else "forwards"
    return f"{first} first (priorities)"


def schedule_sets(schedule: str, stages: int, micro_batches: int) -> int:
    """How many micro-batches' activations a stage of a pipeline holds at most: S under 1f1b
    and bounded, 2 S under eager (a micro-batch's route visits stage 0 twice, its blocks and
    then the head, so stage 0 needs more in flight than 1F1B's S to keep the next stage
    busy), all M under gpipe; never more than M."""
    per = {"1f1b": stages, "bounded": stages, "eager": 2 * stages}.get(schedule, micro_batches)
    return min(per, micro_batches)


# Experiments only (experiments/ownership.py measures wte blocked against not): the number of
# wte's row blocks, instead of wte_block_count's.
WTE_BLOCKS_ENV = "STARPU_LLM_WTE_BLOCKS"


def wte_block_count(config: GPTConfig, ranks: int, stages: int, ownership: str) -> int:
    """wte's row blocks: sharded, one per data-parallel copy of stage 0 (D = R / S), so that
    each of those ranks can own one (the other slices balanced around them), and wte's sends,
    gradient sums and update are spread over D ranks rather than one; rank0 and one process:
    one block, wte whole (the step computes exactly what it did unblocked)."""
    return min(ranks // stages, config.Vp) if ownership == "sharded" else 1


def slice_sizes(config: GPTConfig, wte_blocks: int = 1) -> list:
    """((name, layer, wte's row block or None), elements) of every parameter slice, in llm.c's
    order."""
    return [(key, math.prod(shape))
            for key, _, shape in ParamLayout(config).slice_list(wte_blocks)]


def balance(slices: list, candidates) -> dict:
    """{key: rank}: the slices ((key, size)), largest first, each to the rank among
    candidates(key) owning the fewest elements so far (ties: the lowest rank)."""
    owned, owners = {}, {}
    for key, size in sorted(slices, key=lambda s: -s[1]):    # stable: llm.c's order in a tie
        r = min(candidates(key), key=lambda r: (owned.get(r, 0), r))
        owners[key] = r
        owned[r] = owned.get(r, 0) + size
    return owners


def flop_costs(config: GPTConfig, T: int):
    """(head, [block l]) work per token by the flop counts the codelets declare, forward and
    backward: a block 72 C^2 + 12 T C (its four matmuls, 24 C^2 forward and twice that
    backward, and the attention's 4 T C forward, twice backward), the head 6 Vp C; the
    embedding and the small layers add next to nothing. The default costs of stage_layers;
    perf/stages.layer_costs predicts seconds from a calibration instead."""
    return 6 * config.Vp * config.C, [72 * config.C ** 2 + 12 * T * config.C] * config.L


def stage_layers(config: GPTConfig, stages: int, T: int, costs=None) -> tuple:
    """The pipeline stage of each layer: contiguous ranges, stage 0 first. Stage 0 also runs
    the embedding and the head (lnf and the lm head, tied to wte: its gradient never leaves
    the rank). costs = (head, [block l]) (default: flop_costs): of the splits, the one whose
    busiest stage costs least (ties: fewer blocks on the earlier stages)."""
    L = config.L
    if not 1 <= stages <= L + 1:
        raise StarpuLLMError(f"{opt('pipeline_stages')} {stages}: choose 1 to {L + 1} (the "
                             f"model's {L} layers, and the head)")
    head, block = costs or flop_costs(config, T)
    prefix = [0.0]
    for c in block:
        prefix.append(prefix[-1] + c)
    # best[s][j]: (the busiest stage's cost, cuts) of blocks [0, j) on stages 0..s; stage 0
    # holds the head and may hold no block, every later stage at least one (linear partition)
    best = [{j: (head + prefix[j], (0, j)) for j in range(L - stages + 2)}]
    for k in range(1, stages):
        row = {}
        for j in range(k, L - stages + k + 2):
            row[j] = min((max(best[-1][i][0], prefix[j] - prefix[i]), best[-1][i][1] + (j,))
                         for i in best[-1] if i < j)
        best.append(row)
    cuts = best[-1][L][1]
    return tuple(s for s in range(stages) for _ in range(cuts[s], cuts[s + 1]))


class Topology:
    """How R ranks share the work: S pipeline stages x D data-parallel copies (rank d S + s
    runs stage s of copy d; S = 1: plain data parallelism, a copy per rank), wte's row blocks
    (wte_blocks, wte_block_count) and the owner of every parameter slice (a block tensor's
    layer, a row block of wte, or wpe, lnfw, lnfb): a pure function of the model, R, S, the
    ownership and T. A slice belongs to one stage (its layer's; the embedding and head tensors
    to stage 0) and is owned by one of that stage's D ranks, the stage's bytes balanced over
    them (sharded); rank0 puts every slice on rank 0 (no pipeline). The ranks that read a
    slice and add into its gradient are its stage's. costs: the layers' (stage_layers);
    layer_stage: the stage of each layer, when given (the performance model's, from a recorded
    graph); wte_blocks: instead of wte_block_count's (the performance model records a rank's
    graph in one process; WTE_BLOCKS_ENV, an experiment's, else)."""

    def __init__(self, config: GPTConfig, ranks: int, stages: int = 1,
                 ownership: str = "sharded", T: int | None = None, costs=None,
                 layer_stage: tuple | None = None, wte_blocks: int | None = None):
        if ownership not in OWNERSHIPS:
            raise StarpuLLMError(f"{opt('ownership')} {ownership!r}: choose one of "
                                 f"{', '.join(OWNERSHIPS)}")
        if stages < 1 or ranks % stages:
            raise StarpuLLMError(f"{opt('pipeline_stages')} {stages} does not divide the {ranks} "
                                 f"MPI process(es); run a multiple of {stages} processes")
        if stages > 1 and ownership == "rank0":
            raise StarpuLLMError(f"{opt('ownership')} rank0 puts every parameter on rank 0, "
                                 f"which a pipeline cannot: leave {opt('ownership')} out")
        self.ranks, self.stages, self.copies = ranks, stages, ranks // stages
        self.ownership = ownership
        self.layer_stage = (tuple(layer_stage) if layer_stage is not None
                            else stage_layers(config, stages, T or config.maxT, costs))
        if wte_blocks is None and os.environ.get(WTE_BLOCKS_ENV):
            wte_blocks = int(os.environ[WTE_BLOCKS_ENV])
        self.wte_blocks = wte_blocks or wte_block_count(config, ranks, stages, ownership)
        slices = slice_sizes(config, self.wte_blocks)
        if ownership == "rank0":
            self.owners = {key: 0 for key, _ in slices}
        else:
            self.owners = {}
            for s in range(stages):
                ranks = self.stage_ranks(s)
                self.owners.update(balance([x for x in slices if self.slice_stage(x[0]) == s],
                                           lambda key: ranks))

    @classmethod
    def of(cls, config: GPTConfig, ranks: int, stages: int = 1, ownership: str | None = None,
           T: int | None = None, costs=None) -> "Topology":
        """The topology of a run: `ownership` by default sharded, rank0 for one process."""
        return cls(config, ranks, stages, (ownership or "sharded") if ranks > 1 else "rank0",
                   T, costs)

    def rank(self, stage: int, copy: int) -> int:
        return copy * self.stages + stage

    def stage_ranks(self, stage: int) -> list:
        """The ranks running `stage`, one per copy, in copy order."""
        return [self.rank(stage, d) for d in range(self.copies)]

    def slice_stage(self, key) -> int:
        """The stage of a slice: its layer's, stage 0 for the embedding's and head's."""
        return self.layer_stage[key[1]] if PARAMETER_SPECS[key[0]].part == "block" else 0

    def readers(self, key) -> list:
        """The ranks whose tasks read a parameter slice and add into its gradient."""
        return self.stage_ranks(self.slice_stage(key))

    def shares(self, config: GPTConfig) -> list:
        """The fraction of the parameter bytes each rank owns."""
        sizes = dict(slice_sizes(config, self.wte_blocks))
        owned = [0] * self.ranks
        for key, r in self.owners.items():
            owned[r] += sizes[key]
        total = sum(sizes.values())
        return [o / total for o in owned]


def owner_map(config: GPTConfig, nranks: int, ownership: str, stages: int = 1,
              T: int | None = None) -> dict:
    """{(name, layer, wte's row block or None): rank} under an ownership scheme (OWNERSHIPS)
    and S stages."""
    return Topology(config, nranks, stages, ownership, T).owners


def placement_shares(config: GPTConfig, nranks: int, ownership: str = "sharded",
                     stages: int = 1, T: int | None = None) -> list:
    """The fraction of the parameter bytes each rank owns."""
    return Topology(config, nranks, stages, ownership, T).shares(config)


def shard_owners(config: GPTConfig, nranks: int) -> dict:
    """Sharded data parallelism's owners: every slice on one of the R ranks, the owned bytes
    balanced (largest first to the least loaded), wte in R row blocks: each rank owns at most
    1/R of the bytes plus the largest slice (the greedy's bound: a rank's last slice went to
    it when it owned the least, at most the mean)."""
    return owner_map(config, nranks, "sharded")
