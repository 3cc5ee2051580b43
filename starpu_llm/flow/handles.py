"""The StarPU engine's data handles: registered here, each with its owner rank (under
StarPU-MPI) and with memory on the process that uses it, unregistered at the end; where the
tensors live, where the tasks run is sites.py's, who owns what topology.py's.

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
parameter receive it. docs/scaling.md, StarPU-MPI internals, says more. Tags are given in
registration order, so every rank registers the same tensors in the same order.

wte, the tied embedding and lm head (31 % of GPT-2 124M), is split in row blocks
(Topology.wte_blocks: one per data-parallel copy of stage 0 when sharded, else one), each block
a slice with its own handles, owner, reduction and update: contiguous views of the state's
(Vp, C) arrays, so the checkpoints and the state do not change.
"""
from __future__ import annotations

import contextlib
import ctypes
import mmap
import weakref

import numpy as np

from .._clib import ffi, lib
from ..model.config import GPTConfig, ParamLayout, row_blocks
from ..errors import StarpuLLMError, opt
from ..model.state import Slices, read_slice_into
from . import taskflow
from ..plan.sites import Sites
from .tensors import PER_MICRO_BATCH, ParameterTensors, Tensor, shape_only, sub_batch_tensors
from ..plan.topology import Topology

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

    def __init__(self, config: GPTConfig, group: ParameterTensors, placement: "Handles"):
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


class Handles:
    """The handles of one engine: registered here with their owners, unregistered in reverse
    order by unregister_all. `sites` (sites.Sites: default, one process's) gives the topology
    (who owns each slice), the sub-batches per copy, the pipeline's activation sets and how
    the gradients take their contributions (redux)."""

    def __init__(self, runtime, config: GPTConfig, sites: Sites | None = None, memory=None,
                 everywhere: bool = False, owner=None):
        self.runtime = runtime
        # the owner (an engine) dropped without close(): these handles and the buffers under
        # them, which its tasks may still be using, go to the runtime to unregister
        # (Runtime.left) instead of being freed under StarPU (a segfault)
        self._dropped = None
        if owner is not None:
            self._dropped = weakref.finalize(owner, runtime.left, self)
            self._dropped.atexit = False    # at exit the runtime's shutdown unregisters them
        self.sites = sites = sites or Sites(Topology(config, runtime.size, 1, "rank0"))
        # Under a memory limit (memory: runtime.offload.MemoryLimit) StarPU allocates every
        # tensor itself, so that it can evict any of them to its disk node (it never evicts a
        # buffer it did not allocate): a handle registered without memory, its initial values
        # (parameters, moments, zeroed gradients) written in through acquire/release.
        self.offload = memory is not None
        self.rank, self.nranks = runtime.rank, runtime.size
        self.mpi = self.nranks > 1
        # everywhere: this one process plays every rank of the sites' topology (the
        # performance model records the step of R ranks so, perf/graph.py): every handle has
        # memory here (never touched: no kernel runs), none is MPI-registered; the rank that
        # owns each is in owner_of, as for the handles of a run under MPI
        self.everywhere = everywhere
        self.owner_of = {}
        self.topology = topo = sites.topology
        self.owners = topo.owners
        self.stages, self.copies, self.layer_stage = topo.stages, topo.copies, topo.layer_stage
        self.subs_per_copy, self.sets, self.redux = sites.subs_per_copy, sites.sets, sites.redux
        self._set_tensors = {}    # (copy, stage, set, name): the tensor micro-batches share
        self._registered = []     # handles to unregister, in reverse order
        self._buffers = []
        self._held = set()        # this process's activation and scratch handles (tensor())
        self._next_tag = 0
        self.elsewhere = set()    # names of the slices this process holds no memory for
        runtime.holding(self)

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
                used = self._mine(owner) or (kind == "param" and any(
                    self._mine(r) for r in self.topology.readers(key)))
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
                    received = self._mine(self.owners[key]) and not self.offload
                    if received:
                        view = np.empty_like(view)     # where q's contribution lands
                    t = self._slice_tensor(f"grad@{q}", key, view, self._mine(q) or received, q)
                    if self._mine(q) and self.offload:
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
            mine = self._mine(rank)
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
                                    owner=owner))
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
            mine = self._mine(owner) or not self.mpi
            t = Tensor(f"gradnorm[{k}]", (1,), np.float64,
                       h=self._register(arr[k:k + 1] if mine and not self.offload else None,
                                        1, 8, owner=owner))
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
        hs = config.C // config.NH
        if self.runtime.attention == "flash" and self.runtime.partition.gpus and hs > lib.SL_FLASH_MAX_HS:
            raise StarpuLLMError(
                f"the fused attention on GPUs takes heads of up to {lib.SL_FLASH_MAX_HS} "
                f"channels, and this model's have {hs} ({config.C} channels / {config.NH} "
                f"heads): run it with {opt('attention')} gemm (the batched-GEMM attention)")
        topo, d = self.topology, self.sites.copy(i)
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
            [at(s) for s in range(self.stages)], self.runtime.attention)

    def tensor(self, name, shape, dtype=np.float32, owner=None) -> Tensor:
        """A new tensor registered as a handle; under MPI owned by rank `owner` (None: this
        process's own, not MPI-registered)."""
        # Our memory, not StarPU's (-1): StarPU 1.3.10's peager crashes when a parallel
        # task gets a buffer StarPU allocated itself. np.empty touches no page, so the
        # first task that writes a tensor places its pages (first touch). Under a memory
        # limit, StarPU's (the first task writes it: no initial values). With GPUs StarPU's
        # too: the tasks that write them run there, and a host buffer would only be written
        # when StarPU copied the values back (at unregistration: 12.7 GB of RSS at d12,
        # 8 x 1024); what the host reads (the losses) or writes (a batch's tokens) StarPU
        # puts in main memory of its own.
        mine = owner is None or self._mine(owner)
        ours = mine and not self.offload and not self.sites.gpus
        arr = np.empty(shape, dtype) if ours else None
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

    def _mine(self, rank: int) -> bool:
        """Whether this process holds what `rank` owns."""
        return self.everywhere or rank == self.rank

    def _register(self, arr, n=None, itemsize=4, owner=None):
        """A vector handle on arr (kept alive), or of n elements allocated by StarPU when arr
        is None (a tensor this process never computes on); owned by rank `owner` when given
        (MPI-registered under MPI); unregistered by unregister_all(), in reverse order."""
        if arr is not None:
            self._buffers.append(arr)
            h = lib.sl_register_vector(ffi.from_buffer(arr), arr.size, arr.itemsize)
        else:
            h = lib.sl_register_vector(ffi.NULL, n, itemsize)
        self._registered.append(h)
        if owner is not None:
            self.owner_of[int(ffi.cast("uintptr_t", h))] = owner
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
        if self._dropped is not None:
            self._dropped.detach()
        if not self._registered or not self.runtime.running:
            self._registered = []
            return
        self.runtime.wait()
        for h in reversed(self._registered):
            lib.sl_unregister(h)
        self._registered = []
        self._buffers = []

    def keep(self, buffer) -> None:
        """buffer (tasks read it through a pointer: the token shard) alive as long as the
        handles."""
        self._buffers.append(buffer)

    def gather_to_root(self, tensors):
        """Under MPI, bring the current value of each tensor to rank 0 (its owner sends it; a
        no-op for what rank 0 owns), for rank 0 to read: rank 0 writes the checkpoints.
        Every rank calls it with the same tensors."""
        if self.mpi:
            for t in tensors:
                if lib.sl_mpi_fetch(t.h, 0) != 0:
                    raise RuntimeError(f"starpu_mpi_get_data_on_node failed for {t.name}")
