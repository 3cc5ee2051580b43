"""The StarPU engine: every tensor a StarPU data handle, every layer a task.

The step (step.py) submits the task flow; handles.py registers the data handles, sites.py
decides where each task runs (also across MPI processes: who owns what is topology.py's). The
reference engine, the same step without StarPU, is in reference.py.
"""
from __future__ import annotations

import numpy as np

from .._clib import ffi, lib
from ..errors import StarpuLLMError, opt
from ..io import formats
from ..runtime.offload import format_size
from . import taskflow
from .checkpoint_task import CheckpointTask
from .memory import check_limit, step_needs
from .handles import READ, READ_WRITE, HandleSlices, Handles, acquired
from ..plan.partition import with_batch
from ..plan.record import Partition
from ..plan.sites import Sites
from .step import Engine
from ..plan.topology import Topology, schedule_order
from ..runtime.submit import StarPUOps
from .tensors import SECOND_SET


def read_tensor(t, rows: int | None = None, cols: int | None = None):
    """A copy of tensor t as the tasks submitted so far leave it (its first `rows` rows and
    `cols` columns only, when given)."""
    with acquired(t, READ) as x:
        x = x.reshape(t.shape)
        return (x if rows is None and cols is None else x[:rows, :cols]).copy()


def write_tensor(t, values):
    """Write values into the first values.size elements of tensor t, after the tasks submitted
    so far that use it."""
    values = np.asarray(values, t.dtype).reshape(-1)
    with acquired(t, READ_WRITE) as x:
        x[:values.size] = values


class StarPUEngine(Engine):
    """Every tensor a StarPU data handle; every layer a task (needs a running Runtime).

    Under StarPU-MPI (a Runtime started on a communicator of R processes) every process
    submits the whole graph; rank r runs its sub-batches (B/R sequences), the owner of each
    parameter slice its update (`ownership`: topology.py).

    sites (a sites.Sites, instead of the partition of the runtime and the settings): the
    performance model's recording of another partition's step (perf/graph.py): this process
    plays every rank of the sites' topology, registers every rank's handles (with their
    owners, Handles.owner_of) and submits every task anywhere here, the site it would run at
    there recorded (ops.sites); its tasks are meant to run dry (sl_set_dry_run)."""

    name = "starpu"

    def __init__(self, config, state, B, T, tokens, runtime, partition: Partition | None = None,
                 record: bool = False, stage_costs=None, sites: Sites | None = None):
        if not runtime.running:
            raise StarpuLLMError("the StarPU runtime is not running: make the engine inside "
                                 "`with Runtime(partition) as rt:`")
        self._closed = False
        nranks = runtime.size
        # the resolved partition (default: the runtime's), its sub-batches for this batch (the
        # whole batch: with_batch takes each copy's share itself)
        given = partition or runtime.partition
        p = with_batch(given, B)
        if sites is not None:
            topology, sub_batches = sites.topology, sites.subs_per_copy
        else:
            topology = Topology.of(config, nranks, p.stages, p.ownership, T, stage_costs)
            sub_batches = p.sub_batches
        pipeline_stages = topology.stages
        copies = topology.copies      # data-parallel copies: every rank's without a pipeline
        where = (f"{copies} data-parallel copies of the pipeline" if pipeline_stages > 1
                 else f"{nranks} MPI processes")
        if B % copies:
            raise StarpuLLMError(f"{opt('batch')} {B} cannot be split over {where}; "
                                 f"use a {opt('batch')} divisible by {copies}")
        per_copy = B // copies
        if per_copy % sub_batches:
            if not given.sub_batches and sites is None:
                raise StarpuLLMError(
                    f"{opt('batch')} {B} cannot be split over {sub_batches} workers (one sub-batch "
                    f"each) x {where}; use a {opt('batch')} divisible by "
                    f"{sub_batches * copies}, or {opt('sub_batches')}")
            raise StarpuLLMError(f"{opt('batch')} {B} ({per_copy} per copy) cannot be split into "
                                 f"{sub_batches} equal sub-batches; choose {opt('sub_batches')} "
                                 f"dividing {per_copy}")
        self.partition = p
        self.subs_per_rank = sub_batches     # per data-parallel copy (a rank's, or a pipeline's)
        super().__init__(config, state, B, T, tokens, sub_batches * copies)
        self.runtime = runtime
        self.ops = StarPUOps(record=record, sites={} if sites is not None else None)
        self.memory = runtime.memory
        if self.memory is not None:
            self.check_memory()      # before StarPU allocates anything of ours
        self.sites = sites or Sites(topology, self.subs_per_rank, p.workers,
                                    p.pins_sub_batches, p.pipeline_schedule or "eager", p.gpus)
        self.handles = place = Handles(runtime, config, self.sites, self.memory,
                                       everywhere=sites is not None, owner=self)
        place.keep(tokens)
        self.layer_stage = place.layer_stage if place.stages > 1 else None
        self.redux = place.redux
        # mpi: the step spans ranks (the recording of another partition's too)
        self.rank, self.mpi = place.rank, topology.ranks > 1
        self.p, self.g, self.m, self.v = (
            place.parameter_tensors(kind, self.layout, flat)
            for kind, flat in (("param", state.params), ("grad", state.grads),
                               ("m", state.m), ("v", state.v)))
        # under MPI each rank adds its sub-batches' gradients into its own contributions
        self.contributions = place.contributions(self.layout, state.grads, self.g)
        # a pipeline's embedding adds its wte gradient apart from the head (taskflow.backward)
        self.embedding_wte = place.embedding_wte_grads(config) if place.stages > 1 else None
        self.subs = [place.sub_batch(config, self.Bs, T, i) for i in range(self.sub_batches)]
        self.norm = place.norm_scalars(config)
        place.check_tags()
        self.checkpoints = None     # the starpupy face's checkpoint task, made on first use
        # one process, no memory limit (its step's disk traffic is counted step by step), not
        # a recording: the trainer may submit step n+1 before reading step n's loss
        self.ahead = not self.mpi and not place.offload and sites is None
        self._spare = None          # the other set of losses and norm root (_alternate_buffers)
        if place.offload:           # the state's buffers are the handles now (sync())
            state.params, state.grads, state.m, state.v = (
                HandleSlices(config, group, place) for group in (self.p, self.g, self.m, self.v))

    def _alternate_buffers(self):
        """The next step writes its losses and gradient norm into the other set: each
        sub-batch's losses and the norm tree's root, a second set registered on first use.
        Both are written whole by one task each (crossentropy_forward, the root's norm_sum;
        a gradient accumulation's first micro-batch writes the losses, the others add into
        them), so the values are those of one set, bit for bit."""
        if not self.ahead:
            raise StarpuLLMError("the StarPU engine submits a step ahead in one process without "
                                 f"{opt('memory_limit')} only")
        if self._spare is None:     # named apart from the first set's, for the trace
            self._spare = ([self.handles.tensor(a.losses.name + SECOND_SET, a.losses.shape,
                                                a.losses.dtype) for a, _ in self.subs],
                           self.handles.tensor(self.norm[-1].name + SECOND_SET, (1,),
                                               np.float64))
        losses, root = self._spare
        self._spare = ([a.losses for a, _ in self.subs], self.norm[-1])
        for (a, _), t in zip(self.subs, losses):
            a.losses = t
        self.norm[-1] = root

    def check_memory(self):
        """Under a memory limit, before the first step: one clear error when the limit cannot
        hold what the workers' tasks hold at once (each worker's largest task; with a
        reduction, each worker's copy of every gradient, which StarPU never evicts), or when
        the offload folder has no room for every tensor StarPU may evict."""
        needs = step_needs(self.config, self.Bs, self.T, self.subs_per_rank,
                           self.runtime.attention)
        check_limit(self.memory.limit, self.config, needs, self.subs_per_rank,
                    self.partition.workers, advice=f", or a smaller {opt('batch')} (or more "
                                                   f"{opt('sub_batches')})")
        free = self.runtime.offload.free_bytes()
        if free < needs.footprint:
            raise StarpuLLMError(
                f"the offload folder {self.runtime.offload.path} has {format_size(free)} free, "
                f"but StarPU may have to evict up to {format_size(needs.footprint)} there (every "
                f"tensor of the run): give {opt('offload_dir')} on a disk with that much room")

    def submitted(self) -> list | None:
        return None if self.ops.records is None else list(self.ops.records)

    def named_tensors(self):
        """(name, Tensor) of every tensor of this engine, sub-batch i's prefixed "s{i}."."""
        for t in (t for group in (self.p, self.g, self.m, self.v) for t in group.tensors()):
            yield t.name, t
        for t in self.norm:
            yield t.name, t
        if self._spare is not None:         # the other set (_alternate_buffers)
            for i, t in enumerate(self._spare[0]):
                yield f"s{i}.{t.name}", t
            yield self._spare[1].name, self._spare[1]
        for t in (t for copy in self.contributions for t in copy.tensors()):
            if t.name.startswith("grad@"):
                yield t.name, t
        for t in (t for blocks in self.embedding_wte or [] for t in blocks):
            yield t.name, t
        seen = set()     # a pipeline's micro-batches may share sets: the first one's name
        for i, (a, stages) in enumerate(self.subs):
            named = [(f"s{i}.{t.name}", t) for t in a.tensors()]
            for k, s in enumerate(stages):     # stage k > 0's scratch: "s{i}.stage{k}."
                named += [(f"s{i}.{f'stage{k}.' if k else ''}{t.name}", t) for t in s.tensors()]
            for name, t in named:
                if id(t) not in seen:
                    seen.add(id(t))
                    yield name, t

    def tensor_names(self) -> dict:
        """{handle address: tensor name} of every tensor of this engine (sub-batch i's
        activations prefixed "s{i}."), to read the handles of a task trace."""
        return {int(ffi.cast("uintptr_t", t.h)): name for name, t in self.named_tensors()}

    # --- where tasks run: the sites decide, each submission takes one ---
    def sub_batch_ops(self, i, phase="forward"):
        return self.ops.at(self.sites.sub_batch_site(i, phase))

    def update_ops(self):
        return self.ops.at(self.sites.update_site())

    def sub_batch_grads(self, i):
        return self.contributions[self.sites.copy(i)]

    def sub_batch_embedding_wte(self, i):
        return None if self.embedding_wte is None else self.embedding_wte[self.sites.copy(i)]

    def _activations_used(self):
        """Under a memory limit: each activation and scratch tensor of this process (but the
        losses, which loss() reads) dropped once the tasks using it have run, so that StarPU
        frees it then instead of writing it to disk (its next use, the next step's, writes
        it)."""
        if self.handles.offload:
            for a, stages in self.subs:
                for t in (t for group in (a, *stages) for t in group.tensors()):
                    if t is not a.losses and self.handles.holds(t):
                        lib.sl_invalidate(t.h)

    def _gradients_submitted(self):
        if self.mpi:
            taskflow.reduce_gradients(self.ops.at(self.sites.reduction_site()), self.config,
                                      self.g, self.contributions, self.embedding_wte)

    def _check_open(self):
        if self._closed:
            raise StarpuLLMError("this StarPU engine is closed (close() released its data): "
                                 "make a new one")
        if not self.runtime.running:
            raise StarpuLLMError("the StarPU runtime of this engine has been shut down, and its "
                                 "data with it: make a new engine in a running Runtime")

    def wait(self):
        self._check_open()
        self.runtime.wait()
        if self.checkpoints is not None:
            self.checkpoints.check()

    def read(self, t):
        self._check_open()
        return read_tensor(t)

    def loss(self, losses: list | None = None, micro_batches: int = 1) -> float:
        if not self.mpi:
            return super().loss(losses, micro_batches)
        losses = losses or [a.losses for a, _ in self.subs]
        mine = [self.read(t).mean(dtype=np.float64)
                for i, t in enumerate(losses) if self.sites.owner(i) == self.rank]
        return float(sum(self.runtime.comm.allreduce(mine)) / self.sub_batches / micro_batches)

    def sync(self):
        """Make the state's arrays of parameters, gradients and moments hold their current
        values (runs any pending gradient reduction). Under MPI on rank 0 only, which writes
        the checkpoints: every rank takes part, the owners send rank 0 their slices of the
        parameters and moments (the gradients: rank 0's own slices)."""
        groups = (self.p, self.g, self.m, self.v)
        self.wait()
        # not the gradients (each update leaves them zero; a received copy on a non-owner
        # would be added into by its next gradient reduction)
        self.handles.gather_to_root(t for group in (self.p, self.m, self.v)
                                      for t in group.tensors())
        if (self.mpi and self.rank != 0) or self.handles.offload:
            return          # (under a limit the state's buffers are the handles themselves)
        for group in groups:
            for t in group.tensors():
                if t.name in self.handles.elsewhere:   # another rank's gradient
                    continue
                if lib.sl_acquire(t.h, 1) == ffi.NULL:
                    raise RuntimeError(f"acquiring {t.name} failed")
                lib.sl_release(t.h)

    def submit_checkpoint(self, path):
        """Write the parameters, as the tasks submitted so far leave them, as an llm.c
        checkpoint at path. Started by starpupy, the runtime does it as a Python task in the
        task graph (checkpoint_task.CheckpointTask), overlapping the next steps: wait() or
        close() waits for it and raises its error. Else it waits and writes it here."""
        if self.mpi:
            raise StarpuLLMError("submit_checkpoint: under MPI, write the checkpoint on rank 0 "
                                 "after sync()")
        if getattr(self.runtime, "face", "cffi") != "starpupy":
            self.sync()
            formats.write_checkpoint(path, self.config, self.state.params)
            return
        if self.checkpoints is None:
            self.checkpoints = CheckpointTask(self.config, self.p)
        self.checkpoints.submit(path)

    def close(self):
        self._closed = True
        checkpoints, self.checkpoints = self.checkpoints, None
        try:
            if checkpoints is not None and self.runtime.running:
                self.runtime.wait()
                checkpoints.close()
                checkpoints.check()
        finally:
            self.handles.unregister_all()

    def logits(self) -> np.ndarray:
        if self.handles.offload:
            raise StarpuLLMError(f"under {opt('memory_limit')} the logits are dropped once the "
                                 f"backward has read them")
        if self.sites.sets < self.subs_per_rank:
            raise StarpuLLMError(f"a {self.sites.schedule} pipeline keeps no micro-batch's "
                                 f"logits past its backward; use {opt('pipeline_schedule')} gpipe")
        return super().logits()

    def describe(self):
        sites = self.sites
        unit = "copy" if sites.topology.stages > 1 else "process"
        per = f" ({self.subs_per_rank} per {unit})" if self.mpi else ""
        pipe = ""
        if sites.schedule:
            pipe = (f", schedule {sites.schedule}: each stage holds at most {sites.sets} "
                    f"micro-batch(es) of {self.subs_per_rank}, "
                    + schedule_order(sites.schedule))
        nb = sites.topology.wte_blocks
        blocks = f", wte in {nb} row blocks" if nb > 1 else ""
        return (f"starpu engine, {self.runtime.describe()}, {self.sub_batches} sub-batch(es)"
                f"{per}{pipe}{blocks}")
