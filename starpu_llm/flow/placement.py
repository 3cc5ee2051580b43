"""Where the StarPU engine's tensors live and where its tasks run: the one place that decides.

Every task submission takes a `Where` (rank, worker, priority) as an argument
(runtime.submit.StarPUOps.at); the sites come from this class alone (sub_batch_site,
update_site), and so do the owners of the handles it registers and which micro-batches of a
pipeline share activation buffers (sub_batch, `sets`). Nothing else, in Python or in C,
holds placement state.

Every tensor is a StarPU vector handle; the per-layer parameters, gradients and moments have
one handle per layer (a view of the state's (L, ...) array), so each layer's slice has its own
dependencies, owner and update task.

Under StarPU-MPI (a Runtime started on a communicator of R processes) every process registers
every handle with an owner and a small dense tag and submits the whole graph; a task runs on
the owner of the data it writes, and StarPU-MPI moves what another rank reads. A Topology says
who owns what: R = S pipeline stages x D data-parallel copies; a micro-batch's (sub-batch's)
activations of a layer on the rank of the layer's stage in its copy; each parameter slice, its
gradient and moments owned by one of its stage's ranks (`--ownership sharded`, bytes
balanced) or all by rank 0 (`rank0`, the paper's scheme, no pipeline). Each copy adds its
gradients into its own contribution handles, added into the owners' gradients in a fixed
order (taskflow.reduce_gradients), then the owner updates and the ranks that read the new
parameter receive it. docs/design.md, StarPU-MPI internals, says more. Tags are given in
registration order, so every rank registers the same tensors in the same order.

wte, the tied embedding and lm head (31 % of GPT-2 124M), is split in row blocks
(Topology.wte_blocks: one per data-parallel copy of stage 0 when sharded, else one), each block
a slice with its own handles, owner, reduction and update: contiguous views of the state's
(Vp, C) arrays, so the checkpoints and the state do not change.
"""
from __future__ import annotations

import contextlib
import ctypes
import math
import mmap
import os

import numpy as np

from .._clib import ffi, lib
from ..config import PARAMETER_SPECS, GPTConfig, ParamLayout, row_blocks
from ..errors import StarpuLLMError, opt
from ..runtime.submit import ANY, OWNER, Where
from ..state import Slices, read_slice_into
from . import taskflow
from .tensors import PER_MICRO_BATCH, ParameterTensors, Tensor, shape_only, sub_batch_tensors

READ, WRITE, READ_WRITE = 1, 2, 3      # sl_acquire's modes


@contextlib.contextmanager
def acquired(t: Tensor, mode: int):
    """Tensor t's memory as a flat numpy array, held (StarPU acquire, in main memory) after
    the tasks submitted so far that write t (READ: to read it) or use it (WRITE: to write it
    anew, READ_WRITE: to change it)."""
    ptr = lib.sl_acquire(t.h, mode)
    if ptr == ffi.NULL:
        raise RuntimeError(f"acquiring {t.name} failed")
    try:
        yield np.frombuffer(ffi.buffer(ptr, t.size * t.dtype.itemsize), dtype=t.dtype)
    finally:
        lib.sl_release(t.h)


class HandleSlices(Slices):
    """A ParamLayout buffer held by an engine's StarPU handles (under a memory limit, the
    state's buffers once the engine has them: StarPU may have evicted any slice to disk),
    read slice by slice through acquire/release, after the tasks submitted so far."""

    def __init__(self, config: GPTConfig, group: ParameterTensors, placement: "Placement"):
        super().__init__(config)
        # the group's slices by their offset in the buffer (wte in the placement's row blocks)
        self.tensors = dict(zip((offset for _, offset, _ in
                                 self.layout.slice_list(placement.topology.wte_blocks)),
                                group.tensors()))
        self.placement = placement

    def _tensor(self, offset):
        if not self.placement.registered:
            raise StarpuLLMError(
                f"the run's parameters and moments lived in StarPU under {opt('memory_limit')} "
                f"and went with its engine: read them before closing it, or save them "
                f"({opt('save')}, {opt('save_every')})")
        return self.tensors[offset]

    def read_range(self, offset, out):
        with acquired(self._tensor(offset), READ) as x:
            out[...] = x

    def chunks(self):
        for offset in self.tensors:
            with acquired(self._tensor(offset), READ) as x:
                yield x


def gradient_mode(workers: int, pinned: bool, subs_per_rank: int) -> int:
    """How one process's sub-batches add their gradient contributions (the redux argument of
    the backward tasks) for `workers` workers, sub-batches pinned to them or not. (Under MPI
    each rank adds into its own tensors, and the ranks' sums are added in a fixed order:
    Placement.contributions, taskflow.reduce_gradients.)

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

# How a pipeline's micro-batches go through its stages (Placement: sets, sub_batch_site):
# eager (the default) runs forwards first and lets a stage hold 2 S micro-batches; 1f1b
# bounds what a stage holds to S micro-batches and prefers backward work; bounded, the same
# bound, tasks in the order they become ready; gpipe, every micro-batch its own activations,
# all forwards before the backwards.
PIPELINE_SCHEDULES = ("eager", "1f1b", "bounded", "gpipe")
# The task priorities of a schedule's phases (runtime.submit.Where.priority,
# Placement.sub_batch_site); a schedule without an entry leaves every priority 0.
# 1f1b: among the tasks ready on a worker, a backward first, then a head (its backward
# follows at once, on the same rank), then forwards, which under 1f1b run at most `sets`
# micro-batches ahead anyway. eager and gpipe: the forwards first, then the heads, then the
# backwards: stage 0, which also runs the head, runs its blocks of every micro-batch it may
# hold before a head, so the next stage never waits for a forward while stage 0 is busy with
# a head (docs/design.md, Schedule). In all, within a phase the earlier micro-batch first
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


def discard_pages(view: np.ndarray) -> None:
    """Give the whole memory pages inside view back to the system (madvise MADV_DONTNEED):
    they read as zeros from then on, and count in no RSS until written again."""
    page = mmap.PAGESIZE
    start = -(-view.ctypes.data // page) * page
    end = (view.ctypes.data + view.nbytes) // page * page
    if end > start and _LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start),
                                     mmap.MADV_DONTNEED) != 0:
        raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) failed")


_LIBC = ctypes.CDLL(None, use_errno=True)


def _arrays(flat, layout: ParamLayout):
    """What ParameterTensors.over splits: flat itself (a numpy buffer of layout), or for a
    state.Slices, shapes only (under a memory limit the handles have no memory of ours)."""
    return flat if isinstance(flat, np.ndarray) else shape_only(layout)


def _zeros(out):
    out[...] = 0


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


class Placement:
    """The handles of one engine (registered here with their owners, unregistered in reverse
    order by unregister_all) and where each task of its step runs."""

    def __init__(self, runtime, config: GPTConfig, topology: Topology | None = None,
                 subs_per_copy: int = 1, schedule: str = "eager", memory=None):
        if schedule not in PIPELINE_SCHEDULES:
            raise StarpuLLMError(f"{opt('pipeline_schedule')} {schedule!r}: choose one of "
                                 f"{', '.join(PIPELINE_SCHEDULES)}")
        self.runtime = runtime
        # Under a memory limit (memory: runtime.offload.MemoryLimit) StarPU allocates every
        # tensor itself, so that it can evict any of them to its disk node (it never evicts a
        # buffer it did not allocate): a handle registered without memory, its initial values
        # (parameters, moments, zeroed gradients) written in through acquire/release.
        self.offload = memory is not None
        self.rank, self.nranks = runtime.rank, runtime.size
        self.mpi = self.nranks > 1
        self.layers, self.subs_per_copy = config.L, subs_per_copy
        # the ranks' pipeline stages and data-parallel copies, and who owns each parameter
        # slice with its gradient and moments (default: one process owns all)
        self.topology = topo = topology or Topology(config, self.nranks, 1, "rank0")
        self.ownership, self.owners = topo.ownership, topo.owners
        self.stages, self.copies, self.layer_stage = topo.stages, topo.copies, topo.layer_stage
        # A pipeline's schedule (docs/design.md, StarPU-MPI internals): each stage has `sets`
        # activation sets per copy (schedule_sets), micro-batch j of a copy using set
        # j mod sets; the tasks' priorities (PHASE_PRIORITY): under eager and gpipe forward
        # before the head before the backward, under 1f1b the reverse, bounded all 0.
        self.schedule = schedule if self.stages > 1 else None
        self.sets = (schedule_sets(schedule, self.stages, subs_per_copy) if self.schedule
                     else subs_per_copy)
        self._set_tensors = {}    # (copy, stage, set, name): the tensor micro-batches share
        # Data parallelism: sub-batch i stays on worker i mod N, so every worker always adds
        # into its own reduction copies (StarPU allocates them all in the first step) and two
        # sub-batches never queue behind each other. Only where StarPU's worker ids are the N
        # workers of the partition.
        self.pin_sub_batches = runtime.workers > 1 and runtime.workers_are_starpu_workers
        self.redux = gradient_mode(runtime.workers + getattr(runtime, "gpus", 0),
                                   self.pin_sub_batches, subs_per_copy)
        self._registered = []     # handles to unregister, in reverse order
        self._buffers = []
        self._held = set()        # this process's activation and scratch handles (tensor())
        self._next_tag = 0
        self.elsewhere = set()    # names of the slices this process holds no memory for

    # --- the handles ---
    def parameter_tensors(self, kind: str, layout: ParamLayout, flat) -> ParameterTensors:
        """The parameters, gradients or moments (kind "param", "grad", "m", "v") over flat, a
        buffer of layout: one handle per slice (a block tensor's layer, or a whole embedding or
        head tensor), owned by self.owners' rank. The ranks of a slice's stage hold its
        parameters (their tasks read them; received copies land there), its owner its
        gradient and moments; rank 0 has memory for every parameter and moment too, where the
        checkpoints' copies land (a page is touched only when written: rank 0 holds others'
        slices only once it has written a checkpoint). Elsewhere a slice's handle has no
        memory and is never used. The pages of flat a rank does not use are given back to the
        system (every rank initialised or loaded the whole model). Gradients accept
        STARPU_REDUX contributions when self.redux.

        Under a memory limit every handle is StarPU's (flat may then be a state.Slices, read
        slice by slice): the slices this rank uses get flat's values (the gradients zeros),
        the others none."""
        offsets = {key: off for key, off, _ in layout.slice_list(self.topology.wte_blocks)}

        def make(name, arr, sliced):
            tensors = []
            for key, view in self._slices(name, arr, sliced):
                owner = self.owners[key]
                used = owner == self.rank or (kind == "param"
                                              and self.rank in self.topology.readers(key))
                if not used and kind != "grad" and not self.offload:
                    discard_pages(view)    # the initial or loaded values another rank holds
                memory = used or (self.rank == 0 and kind != "grad")
                t = self._slice_tensor(kind, key, view, memory, owner)
                if used and self.offload:
                    self._fill(t, _zeros if kind == "grad" else
                               lambda out, key=key: read_slice_into(flat, offsets[key], out))
                tensors.append(t)
            return tensors if sliced else tensors[0]

        return ParameterTensors.over(layout, _arrays(flat, layout), make,
                                     self.topology.wte_blocks)

    def _fill(self, t: Tensor, fill):
        """Under a memory limit: t's initial values, fill(its flat memory), written in before
        any task uses it (StarPU allocates the memory, evicting to disk when at the limit)."""
        with acquired(t, WRITE) as x:
            fill(x)

    def contributions(self, layout: ParamLayout, flat: np.ndarray,
                      grads: ParameterTensors) -> list:
        """For each data-parallel copy d, the tensors its sub-batches' backward tasks add
        into: a slice's, on the rank q running the slice's stage in copy d, is the gradient
        itself where q owns it, else q's contribution, a handle owned by q (on q's memory: the
        slice of flat, a gradient buffer that no gradient of q uses), which
        taskflow.reduce_gradients adds into the owner's gradient. One copy: [grads].

        The owner receives q's contribution into a buffer of its own, allocated once (not
        under a memory limit, where StarPU's buffers can go to disk). Left to StarPU, the
        received copy is freed when q writes its contribution again in the next step (the
        StarPU-MPI cache drops it), glibc unmaps a buffer that large, and every step maps it
        again 4 KiB page by page, on the core the worker computes on: under rank-0 ownership
        on 2 ranks, 120 k page faults per step on rank 0 for the 498 MB it receives.

        Not starpu_mpi_redux_data: it adds the contributions in the order they arrive
        (STARPU_COMMUTE), so from 3 ranks on the sums round differently from run to run."""
        if self.copies == 1:
            return [grads]
        topo = self.topology
        groups = []
        for d in range(self.copies):
            def make(name, arr, sliced, d=d):
                mine = getattr(grads, name) if sliced else [getattr(grads, name)]
                tensors = []
                for g, (key, view) in zip(mine, self._slices(name, arr, sliced)):
                    q = topo.rank(topo.slice_stage(key), d)
                    if self.owners[key] == q:
                        tensors.append(g)
                        continue
                    received = self.owners[key] == self.rank and not self.offload
                    if received:
                        view = np.empty_like(view)     # where q's contribution lands
                    t = self._slice_tensor(f"grad@{q}", key, view, q == self.rank or received, q)
                    if q == self.rank and self.offload:
                        self._fill(t, _zeros)
                    tensors.append(t)
                return tensors if sliced else tensors[0]
            groups.append(ParameterTensors.over(layout, _arrays(flat, layout), make,
                                                topo.wte_blocks))
        return groups

    def embedding_wte_grads(self, config: GPTConfig) -> list:
        """For each copy, the (Vp, C) tensor its embedding adds its wte gradient into, apart
        from the lm head's (a pipeline's: taskflow.backward says why), in wte's row blocks,
        owned by the copy's stage 0; zeros to start with, zeroed again after each step's
        reduction."""
        out = []
        for d in range(self.copies):
            rank = self.topology.rank(0, d)
            mine = rank == self.rank
            arr = (np.zeros((config.Vp, config.C), np.float32) if mine and not self.offload
                   else None)
            blocks = []
            for b, (r0, r1) in enumerate(row_blocks(config.Vp, self.topology.wte_blocks)):
                t = Tensor(f"grad@{rank}.embedding.wte[{b}]", (r1 - r0, config.C),
                           h=self._register(None if arr is None else arr[r0:r1],
                                            (r1 - r0) * config.C, owner=rank))
                if mine and self.offload:
                    self._fill(t, _zeros)
                if self.redux:
                    lib.sl_set_grad_reduction(t.h)
                blocks.append(t)
            out.append(blocks)
        return out

    def _slices(self, name, arr, sliced):
        """((name, layer or row block, or None), view) of each slice of one parameter tensor's
        buffer (arr: its slices when sliced, tensors.ParameterTensors.over)."""
        if sliced:
            return [((name, l), arr[l]) for l in range(len(arr))]
        return [((name, None), arr)]

    def _slice_tensor(self, kind, key, view, memory: bool, owner: int) -> Tensor:
        """A slice's handle: on view when memory (under a memory limit: StarPU's), else
        allocated by StarPU if ever needed; MPI-registered with its owner; a gradient
        ("grad...") accepts STARPU_REDUX contributions when self.redux."""
        name, l = key
        if not memory:
            self.elsewhere.add(f"{kind}.{name}" + ("" if l is None else f"[{l}]"))
        t = Tensor(f"{kind}.{name}" + ("" if l is None else f"[{l}]"), view.shape,
                   h=self._register(view if memory and not self.offload else None, view.size,
                                    owner=owner if self.mpi else None))
        if kind.startswith("grad") and self.redux:
            lib.sl_set_grad_reduction(t.h)
        return t

    def norm_scalars(self, cfg: GPTConfig) -> list:
        """The gradient norm's float64 scalars (taskflow.norm_nodes): partial k (the sum of
        squares of update_order's k-th gradient) owned by that gradient's owner, so it is
        computed where the gradient is; the sums of the tree owned by rank 0."""
        order = taskflow.update_order(cfg, self.topology.wte_blocks)
        n = taskflow.norm_nodes(cfg, self.topology.wte_blocks)
        owners = [self.owners[key] for key in order] + [0] * (n - len(order))
        arr = np.zeros(n, np.float64)
        out = []
        for k, owner in enumerate(owners):
            mine = owner == self.rank or not self.mpi
            t = Tensor(f"gradnorm[{k}]", (1,), np.float64,
                       h=self._register(arr[k:k + 1] if mine and not self.offload else None,
                                        1, 8, owner=owner if self.mpi else None))
            if mine and self.offload:
                self._fill(t, _zeros)
            out.append(t)
        return out

    def sub_batch(self, config: GPTConfig, B: int, T: int, i: int):
        """(ActivationTensors, [BackwardScratch of each stage]) of sub-batch i: each layer's
        activations owned by the rank running the layer's stage in the sub-batch's copy, the
        embedding's and head's (and the inputs, targets, losses) by its stage 0's, a stage's
        scratch by the stage's. In a pipeline, what a stage holds of micro-batch j of a copy
        is its set j mod self.sets, shared with the copy's micro-batches j +- sets, 2 sets...:
        StarPU's sequential consistency then makes micro-batch j + sets' first task writing
        into a set wait until micro-batch j's last task reading it (its backward there) has
        run, so a stage holds at most self.sets micro-batches' activations. What outlives the
        step (tensors.PER_MICRO_BATCH: the losses, which loss() reads; the inputs and targets)
        stays each micro-batch's own."""
        topo, d = self.topology, self.copy(i)
        j = i % self.subs_per_copy

        def at(stage):
            rank = topo.rank(stage, d)

            def make(name, shape, dtype):
                if name in PER_MICRO_BATCH:
                    return self.tensor(name, shape, dtype, rank)
                key = (d, stage, j % self.sets, name)
                if key not in self._set_tensors:
                    self._set_tensors[key] = self.tensor(name, shape, dtype, rank)
                return self._set_tensors[key]
            return make
        return sub_batch_tensors(
            config, B, T, at(0),
            lambda name, shape, dtype, l: at(self.layer_stage[l])(name, shape, dtype),
            [at(s) for s in range(self.stages)])

    def tensor(self, name, shape, dtype=np.float32, owner=None) -> Tensor:
        """A new tensor registered as a handle; under MPI owned by rank `owner` (None: this
        process's own, not MPI-registered)."""
        # Our memory, not StarPU's (-1): StarPU 1.3.10's peager crashes when a parallel
        # task gets a buffer StarPU allocated itself. np.empty touches no page, so the
        # first task that writes a tensor places its pages (first touch). Under a memory
        # limit, StarPU's (the first task writes it: no initial values).
        mine = owner in (None, self.rank)
        arr = np.empty(shape, dtype) if mine and not self.offload else None
        h = self._register(arr, int(np.prod(shape)), np.dtype(dtype).itemsize, owner)
        if mine:
            self._held.add(h)
        return Tensor(name, shape, dtype, h=h)

    def holds(self, t: Tensor) -> bool:
        """Whether this process holds t (an activation or scratch tensor of its own)."""
        return t.h in self._held

    def check_tags(self):
        """A clear error when the handles registered need more MPI tags than MPI allows."""
        if self.mpi and self._next_tag > lib.sl_mpi_tag_ub():
            raise StarpuLLMError(f"{self._next_tag} data handles need more MPI tags than this MPI "
                                 f"allows ({lib.sl_mpi_tag_ub()}); use fewer sub-batches per process")

    def _register(self, arr, n=None, itemsize=4, owner=None):
        """A vector handle on arr (kept alive), or of n elements allocated by StarPU when arr
        is None (a tensor this process never computes on); MPI-registered when owner is
        given; unregistered by unregister_all(), in reverse order."""
        if arr is not None:
            self._buffers.append(arr)
            h = lib.sl_register_vector(ffi.from_buffer(arr), arr.size, arr.itemsize)
        else:
            h = lib.sl_register_vector(ffi.NULL, n, itemsize)
        self._registered.append(h)
        if owner is not None:
            self._mpi_register(h, owner)
        return h

    def _mpi_register(self, h, owner):
        if self.mpi:
            if lib.sl_mpi_register(h, self._next_tag, owner) != 0:
                raise RuntimeError("starpu_mpi_data_register failed")
            self._next_tag += 1

    @property
    def registered(self) -> bool:
        """Whether the handles are still registered (until unregister_all)."""
        return bool(self._registered)

    def unregister_all(self):
        """After the pending tasks, unregister every handle, in reverse order (nothing to do
        once StarPU has shut down)."""
        if not self._registered or not self.runtime.running:
            self._registered = []
            return
        self.runtime.wait()
        for h in reversed(self._registered):
            lib.sl_unregister(h)
        self._registered = []
        self._buffers = []

    # --- where tasks run: every submission takes one of these (runtime.submit.StarPUOps.at) ---
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
        worker = j % self.runtime.workers if self.pin_sub_batches else ANY
        order = PHASE_PRIORITY.get(self.schedule)
        return Where(self.owner(i) if self.stages == 1 else OWNER, worker,
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

    def gather_to_root(self, tensors):
        """Under MPI, bring the current value of each tensor to rank 0 (its owner sends it; a
        no-op for what rank 0 owns), for rank 0 to read: rank 0 writes the checkpoints.
        Every rank calls it with the same tensors."""
        if self.mpi:
            for t in tensors:
                if lib.sl_mpi_fetch(t.h, 0) != 0:
                    raise RuntimeError(f"starpu_mpi_get_data_on_node failed for {t.name}")
