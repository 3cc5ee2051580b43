"""Where the StarPU engine's tensors live and where its tasks run: the one place that decides.

Every task submission takes a `Where` (rank, worker) as an argument (runtime.submit.StarPUOps.at);
the sites come from this class alone (sub_batch_site, update_site), and so do the owners of
the handles it registers. Nothing else, in Python or in C, holds placement state.

Every tensor is a StarPU vector handle. The per-layer parameters, gradients and moments are
one (L, ...) array each, partitioned into a child handle per layer (StarPU data
partitioning), so each layer's slice has its own dependencies and its own update task.

Under StarPU-MPI (a Runtime started on a communicator of R processes) every process registers
every handle with an owner and a small dense tag and submits the whole graph; a task runs on
the owner of the data it writes, and StarPU-MPI moves what another rank reads. Rank r owns the
activations of its sub-batches. The parameters, gradients and moments are owned by
`--ownership`:
  - sharded (the default): each slice by one rank, the bytes balanced (shard_owners). Every
    rank's gradient contributions to a slice are reduced to its owner (StarPU-MPI reduction,
    a tree on StarPU 1.4), which updates it; the ranks that read the new parameter receive it
    from its owner. Each rank sends and receives about 2 (R-1)/R x the model's bytes per step.
  - rank0 (the paper's scheme, for comparison): rank 0 owns them all, receives R-1 copies of
    every gradient, updates, and sends R-1 copies of every parameter.
Tags are given in registration order, so every rank registers the same tensors in the same
order.
"""
from __future__ import annotations

import math

import numpy as np

from .._clib import ffi, lib
from ..config import GPTConfig, ParamLayout
from ..errors import StarpuLLMError, opt
from ..runtime.submit import ANY, OWNER, Where
from . import taskflow
from .tensors import ParameterTensors, Tensor, sub_batch_tensors


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


def shard_owners(config: GPTConfig, nranks: int) -> dict:
    """{(name, layer or None): rank} for every parameter slice (a block tensor's layer, or
    wte, wpe, lnfw, lnfb), the owned bytes balanced over the ranks: the slices, largest first,
    each to the rank owning the fewest bytes so far (ties: the lowest rank). No slice is larger
    than wte, 31 % of GPT-2 124M: up to 3 ranks each owns at most a third plus less than the
    smallest slice; from 4 ranks on the rank owning wte owns 31 % (placement_shares says how
    much each rank owns)."""
    layout = ParamLayout(config)
    slices = []
    for name in layout.names:
        size = math.prod(layout.shapes[name])
        if layout.is_layered(name):
            slices += [((name, l), size // config.L) for l in range(config.L)]
        else:
            slices.append(((name, None), size))
    owned = [0] * nranks
    owners = {}
    for key, size in sorted(slices, key=lambda s: -s[1]):    # stable: llm.c's order in a tie
        r = min(range(nranks), key=lambda r: (owned[r], r))
        owners[key] = r
        owned[r] += size
    return owners


def placement_shares(config: GPTConfig, nranks: int, ownership: str = "sharded") -> list:
    """The fraction of the parameter bytes each rank owns."""
    owners = owner_map(config, nranks, ownership)
    layout = ParamLayout(config)
    owned = [0] * nranks
    for (name, l), r in owners.items():
        owned[r] += math.prod(layout.shapes[name]) // (config.L if l is not None else 1)
    return [o / layout.total for o in owned]


def owner_map(config: GPTConfig, nranks: int, ownership: str) -> dict:
    """{(name, layer or None): rank} under an ownership scheme (OWNERSHIPS)."""
    if ownership == "sharded":
        return shard_owners(config, nranks)
    if ownership == "rank0":
        return {key: 0 for key in shard_owners(config, 1)}
    raise StarpuLLMError(f"{opt('ownership')} {ownership!r}: choose one of {', '.join(OWNERSHIPS)}")


class Placement:
    """The handles of one engine (registered here with their owners, unregistered in reverse
    order by unregister_all) and where each task of its step runs."""

    def __init__(self, runtime, config: GPTConfig, subs_per_rank: int, ownership: str | None = None):
        self.runtime = runtime
        self.rank, self.nranks = runtime.rank, runtime.size
        self.mpi = self.nranks > 1
        self.layers, self.subs_per_rank = config.L, subs_per_rank
        # who owns each parameter slice, with its gradient and moments: one process owns all
        self.ownership = (ownership or "sharded") if self.mpi else "rank0"
        self.owners = owner_map(config, self.nranks, self.ownership)
        # Data parallelism: sub-batch i stays on worker i mod N, so every worker always adds
        # into its own reduction copies (StarPU allocates them all in the first step) and two
        # sub-batches never queue behind each other. Only where StarPU's worker ids are the N
        # workers of the partition.
        self.pin_sub_batches = runtime.workers > 1 and runtime.workers_are_starpu_workers
        self.redux = gradient_mode(runtime.workers, self.pin_sub_batches, subs_per_rank)
        self._registered = []     # handles to unregister, in reverse order
        self._buffers = []
        self._next_tag = 0
        self.elsewhere = set()    # names of the slices this process holds no memory for

    # --- the handles ---
    def parameter_tensors(self, kind: str, layout: ParamLayout, flat: np.ndarray) -> ParameterTensors:
        """The parameters, gradients or moments (kind "param", "grad", "m", "v") over flat, a
        buffer of layout: one handle per slice (a block tensor's layer, or a whole embedding or
        head tensor), owned by self.owners' rank. Every rank holds the parameters (its tasks
        read them all; received copies land there). Gradients are on their owner's memory;
        moments on their owner's and on rank 0's, where the checkpoint's copies land (a page
        is touched only when written: rank 0 holds others' moments only once it has written a
        checkpoint); elsewhere they are never touched. Gradients accept STARPU_REDUX
        contributions when self.redux."""
        def make(name, arr, layered):
            tensors = []
            for key, view in self._slices(name, arr, layered):
                owner = self.owners[key]
                memory = (owner == self.rank or kind == "param"
                          or (self.rank == 0 and kind in ("m", "v")))
                tensors.append(self._slice_tensor(kind, key, view, memory, owner))
            return tensors if layered else tensors[0]

        return ParameterTensors.over(layout, flat, make)

    def contributions(self, layout: ParamLayout, flat: np.ndarray,
                      grads: ParameterTensors) -> list:
        """For each rank q, the tensors its backward tasks add into: for the slices q owns the
        gradients themselves, for the others q's contribution, a handle owned by q (on q's
        memory: the slice of flat, a gradient buffer, that no gradient of q uses), which
        taskflow.reduce_gradients adds into the owner's gradient. One process: [grads].

        Not starpu_mpi_redux_data: it adds the contributions in the order they arrive
        (STARPU_COMMUTE), so from 3 ranks on the sums round differently from run to run."""
        if not self.mpi:
            return [grads]
        groups = []
        for q in range(self.nranks):
            def make(name, arr, layered, q=q):
                mine = getattr(grads, name) if layered else [getattr(grads, name)]
                tensors = [g if self.owners[key] == q else
                           self._slice_tensor(f"grad@{q}", key, view, q == self.rank, q)
                           for g, (key, view) in zip(mine, self._slices(name, arr, layered))]
                return tensors if layered else tensors[0]
            groups.append(ParameterTensors.over(layout, flat, make))
        return groups

    def _slices(self, name, arr, layered):
        """((name, layer or None), view) of each slice of one parameter tensor's buffer."""
        if layered:
            return [((name, l), arr[l]) for l in range(len(arr))]
        return [((name, None), arr)]

    def _slice_tensor(self, kind, key, view, memory: bool, owner: int) -> Tensor:
        """A slice's handle: on view when memory, else allocated by StarPU if ever needed;
        MPI-registered with its owner; a gradient ("grad...") accepts STARPU_REDUX
        contributions when self.redux."""
        name, l = key
        if not memory:
            self.elsewhere.add(f"{kind}.{name}" + ("" if l is None else f"[{l}]"))
        t = Tensor(f"{kind}.{name}" + ("" if l is None else f"[{l}]"), view.shape,
                   h=self._register(view if memory else None, view.size,
                                    owner=owner if self.mpi else None))
        if kind.startswith("grad") and self.redux:
            lib.sl_set_grad_reduction(t.h)
        return t

    def norm_scalars(self, cfg: GPTConfig) -> list:
        """The gradient norm's float64 scalars (taskflow.norm_nodes): partial k (the sum of
        squares of update_order's k-th gradient) owned by that gradient's owner, so it is
        computed where the gradient is; the sums of the tree owned by rank 0."""
        order = taskflow.update_order(cfg)
        n = taskflow.norm_nodes(cfg)
        owners = [self.owners[key] for key in order] + [0] * (n - len(order))
        arr = np.zeros(n, np.float64)
        return [Tensor(f"gradnorm[{k}]", (1,), np.float64,
                       h=self._register(arr[k:k + 1] if owner == self.rank or not self.mpi else None,
                                        1, 8, owner=owner if self.mpi else None))
                for k, owner in enumerate(owners)]

    def sub_batch(self, config: GPTConfig, B: int, T: int, i: int):
        """(ActivationTensors, BackwardScratch) of sub-batch i, owned by its rank."""
        owner = self.owner(i)
        return sub_batch_tensors(config, B, T,
                                 lambda name, shape, dtype: self.tensor(name, shape, dtype, owner))

    def tensor(self, name, shape, dtype=np.float32, owner=None) -> Tensor:
        """A new tensor registered as a handle; under MPI owned by rank `owner` (None: this
        process's own, not MPI-registered)."""
        # Our memory, not StarPU's (-1): StarPU 1.3.10's peager crashes when a parallel
        # task gets a buffer StarPU allocated itself. np.empty touches no page, so the
        # first task that writes a tensor places its pages (first touch).
        arr = np.empty(shape, dtype) if owner in (None, self.rank) else None
        h = self._register(arr, int(np.prod(shape)), np.dtype(dtype).itemsize, owner)
        return Tensor(name, shape, dtype, h=h)

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
    def owner(self, i: int) -> int:
        """The rank of sub-batch i."""
        return i // self.subs_per_rank

    def sub_batch_site(self, i: int) -> Where:
        """Sub-batch i's tasks: on its rank, and on its worker when pinned."""
        worker = i % self.subs_per_rank % self.runtime.workers if self.pin_sub_batches else ANY
        return Where(self.owner(i), worker)

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
