"""Where the StarPU engine's tensors live and where its tasks run: the one place that decides.

Every task submission takes a `Where` (rank, worker) as an argument (runtime.submit.StarPUOps.at);
the sites come from this class alone (sub_batch_site, update_site), and so do the owners of
the handles it registers. Nothing else, in Python or in C, holds placement state.

Every tensor is a StarPU vector handle. The per-layer parameters, gradients and moments are
one (L, ...) array each, partitioned into a child handle per layer (StarPU data
partitioning), so each layer's slice has its own dependencies and its own update task.

Under StarPU-MPI (a Runtime started on a communicator of R processes) every process registers
every handle with an owner and a small dense tag and submits the whole graph: rank r owns the
activations of its sub-batches, rank 0 the parameters, gradients and moments. A task runs
on the owner of the data it writes; gradient contributions of all ranks are reduced to rank
0, which runs the updates. Tags are given in registration order, so every rank registers the
same tensors in the same order.
"""
from __future__ import annotations

import numpy as np

from .._clib import ffi, lib
from ..config import GPTConfig, ParamLayout
from ..errors import StarpuLLMError
from ..runtime.submit import ANY, OWNER, Where
from .tensors import ParameterTensors, Tensor, sub_batch_tensors


def gradient_mode(workers: int, pinned: bool, subs_per_rank: int, nranks: int) -> int:
    """How the sub-batches' gradient contributions add up (the redux argument of the backward
    tasks) for `workers` workers per process, sub-batches pinned to them or not.

    A StarPU reduction (STARPU_REDUX, 1) gives each worker its own copy, summed in a fixed
    tree at the end; nothing orders two sub-batches' additions into one copy, so where they
    share a worker the sums can round differently from run to run (seen on StarPU 1.4's
    parallel worker). With a single worker per process (and one process) the contributions are
    chained instead (RW, 0): in submission order, sub-batch 0's first, bitwise reproducible,
    with no copy, no zeroing and no final sum (AdamW leaves every gradient zeroed); one worker
    runs one task at a time anyway, so nothing is lost. With several workers the reduction
    stays: a chain would serialize the sub-batches' backward passes (each one's first
    contribution, to the tied wte gradient, would wait for the previous one's last, to the
    same gradient), and under StarPU-MPI the ranks' contributions must be reductions. There,
    bitwise reproducibility holds when each worker runs one sub-batch (pinned, N
    sub-batches on N workers)."""
    if subs_per_rank * nranks <= 1:
        return 0
    return int(nranks > 1 or workers > 1)


class Placement:
    """The handles of one engine (registered here with their owners, unregistered in reverse
    order by unregister_all) and where each task of its step runs."""

    def __init__(self, runtime, layers: int, subs_per_rank: int):
        self.runtime = runtime
        self.rank, self.nranks = runtime.rank, runtime.size
        self.mpi = self.nranks > 1
        self.layers, self.subs_per_rank = layers, subs_per_rank
        # Data parallelism: sub-batch i stays on worker i mod N, so every worker always adds
        # into its own reduction copies (StarPU allocates them all in the first step) and two
        # sub-batches never queue behind each other. Only where StarPU's worker ids are the N
        # workers of the partition.
        self.pin_sub_batches = runtime.workers > 1 and runtime.workers_are_starpu_workers
        self.redux = gradient_mode(runtime.workers, self.pin_sub_batches, subs_per_rank,
                                   self.nranks)
        self._registered = []     # (handle, partitioned) to unregister in reverse order
        self._buffers = []
        self._next_tag = 0

    # --- the handles ---
    def parameter_tensors(self, kind: str, layout: ParamLayout, flat: np.ndarray) -> ParameterTensors:
        """The parameters, gradients or moments (kind "param", "grad", "m", "v") over flat, a
        buffer of layout. Rank 0 owns them; other ranks hold parameter memory (received copies
        land there) and nothing else. Gradients accept STARPU_REDUX contributions when self.redux."""
        L = self.layers
        owner_here = self.rank == 0
        memory = owner_here or kind == "param"

        def make(name, arr, layered):
            if owner_here:
                h = self._register(arr, partitioned=layered)
                if layered:
                    kids = ffi.new("sl_handle[]", L)
                    if lib.sl_partition(h, L, kids) != 0:
                        raise RuntimeError(f"partitioning {name} failed")
                    tensors = [Tensor(f"{kind}.{name}[{l}]", arr.shape[1:], h=kids[l])
                               for l in range(L)]
                else:
                    tensors = [Tensor(f"{kind}.{name}", arr.shape, h=h)]
            else:
                # a non-owner: one handle per slice (the same tags as the owner's children),
                # so there is no partition to gather back at the end
                slices = [arr[l] for l in range(L)] if layered else [arr]
                tensors = [Tensor(f"{kind}.{name}" + (f"[{l}]" if layered else ""), sl.shape,
                                  h=self._register(sl if memory else None, sl.size))
                           for l, sl in enumerate(slices)]
            for t in tensors:
                self._mpi_register(t.h, owner=0)
                if kind == "grad" and self.redux:
                    lib.sl_set_grad_reduction(t.h)
            return tensors if layered else tensors[0]

        return ParameterTensors.over(layout, flat, make)

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

    def scalars(self, name: str, n: int) -> list:
        """n float64 scalars "name[k]", each its own handle (over one element of a buffer of
        rank 0, which owns them): the gradient norm's partial sums and their tree."""
        arr = np.zeros(n, np.float64) if self.rank == 0 else None
        return [Tensor(f"{name}[{k}]", (1,), np.float64,
                       h=self._register(None if arr is None else arr[k:k + 1], 1, 8, owner=0))
                for k in range(n)]

    def check_tags(self):
        """A clear error when the handles registered need more MPI tags than MPI allows."""
        if self.mpi and self._next_tag > lib.sl_mpi_tag_ub():
            raise StarpuLLMError(f"{self._next_tag} data handles need more MPI tags than this MPI "
                                 f"allows ({lib.sl_mpi_tag_ub()}); use fewer sub-batches per process")

    def _register(self, arr, n=None, itemsize=4, owner=None, partitioned=False):
        """A vector handle on arr (kept alive), or of n elements allocated by StarPU when arr
        is None (a tensor this process never computes on); MPI-registered when owner is
        given; unregistered by unregister_all(), in reverse order."""
        if arr is not None:
            self._buffers.append(arr)
            h = lib.sl_register_vector(ffi.from_buffer(arr), arr.size, arr.itemsize)
        else:
            h = lib.sl_register_vector(ffi.NULL, n, itemsize)
        self._registered.append((h, partitioned))
        if owner is not None:
            self._mpi_register(h, owner)
        return h

    def _mpi_register(self, h, owner):
        if self.mpi:
            if lib.sl_mpi_register(h, self._next_tag, owner) != 0:
                raise RuntimeError("starpu_mpi_data_register failed")
            self._next_tag += 1

    def unregister_all(self):
        """After the pending tasks, gather the partitions back and unregister every handle, in
        reverse order (nothing to do once StarPU has shut down)."""
        if not self._registered or not self.runtime.running:
            self._registered = []
            return
        self.runtime.wait()
        for h, partitioned in reversed(self._registered):
            if partitioned:
                lib.sl_unpartition(h)
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
        """The update tasks (AdamW, the gradient norm): on the owner of what they write (rank
        0, which owns parameters, gradients and moments), on any worker."""
        return Where(OWNER, ANY)

    def reduce_gradients(self, grads: ParameterTensors):
        """After the backward passes: under MPI every rank's gradient contributions are
        reduced to the gradients' owner."""
        if self.mpi:
            for t in grads.tensors():
                if lib.sl_mpi_redux(t.h) != 0:
                    raise RuntimeError(f"starpu_mpi_redux_data failed for {t.name}")
