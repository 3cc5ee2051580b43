"""Engines: where the tensors of a training run live and how the task flow is executed.

StarPUEngine registers every tensor as a StarPU data handle and submits the flow as tasks;
ReferenceEngine keeps numpy arrays and calls the same kernels in a plain loop (the paper's
baseline). Both run taskflow.py, so they execute the same layers in the same order.
"""
from __future__ import annotations

import numpy as np

from . import taskflow
from ._clib import ffi, lib
from .config import GPTConfig, ParamLayout, check_batch_shape
from .errors import StarpuLLMError
from .ops import DirectOps, StarPUOps, Tensor
from .state import TrainState


def tensor_list(ns):
    """Every tensor of a parameter-like namespace: per-layer lists flattened."""
    for t in vars(ns).values():
        yield from (t if isinstance(t, list) else [t])


class _Engine:
    """The per-step orchestration shared by both engines."""

    name = "?"

    def __init__(self, config: GPTConfig, state: TrainState, B: int, T: int, tokens: np.ndarray,
                 sub_batches: int = 1):
        check_batch_shape(config, B, T)
        if sub_batches < 1 or B % sub_batches:
            raise StarpuLLMError(f"--batch {B} cannot be split into {sub_batches} equal sub-batches; "
                                 f"choose --sub-batches dividing {B}")
        self.config, self.state, self.B, self.T = config, state, B, T
        self.sub_batches, self.Bs = sub_batches, B // sub_batches
        self.redux = 1 if sub_batches > 1 else 0
        self.layout = ParamLayout(config)
        self.tokens = tokens   # keep the shard alive: load tasks read it
        self.tokens_ptr = ffi.cast("const uint16_t *", ffi.from_buffer(tokens))

    # --- what subclasses provide ---
    def wait(self):
        raise NotImplementedError

    def read(self, t: Tensor) -> np.ndarray:
        raise NotImplementedError

    # --- the step ---
    def submit_forward_backward(self, pos: int):
        n = self.Bs * self.T
        dloss = 1.0 / (self.B * self.T)   # gradients of all sub-batches sum to the mean's
        for i, (a, s) in enumerate(self.subs):
            self._run_sub_batch_on(i)
            self.ops.load_batch(a.inputs, a.targets, self.tokens_ptr, pos + i * n, n)
            taskflow.forward(self.ops, self.config, self.p, a, self.Bs, self.T)
            taskflow.backward(self.ops, self.config, self.p, self.g, a, s, self.Bs, self.T,
                              dloss, self.redux)
        self._gradients_submitted()

    # where tasks run: overridden by the multi-process engine
    def _run_sub_batch_on(self, i):
        pass

    def _gradients_submitted(self):
        pass

    def _run_update_on_owner(self):
        pass

    def submit_update(self, lr: float, weight_decay: float):
        self._run_update_on_owner()
        self.state.step += 1
        taskflow.update(self.ops, self.config, self.p, self.g, self.m, self.v, lr, weight_decay,
                        self.state.step)

    def forward_backward(self, pos: int) -> float:
        """Loss of the batch at token position pos; leaves its gradients in the grads buffer."""
        self.submit_forward_backward(pos)
        self.wait()
        return self.loss()

    def step(self, pos: int, lr: float, weight_decay: float) -> float:
        self.submit_forward_backward(pos)
        self.submit_update(lr, weight_decay)
        self.wait()
        return self.loss()

    def loss(self) -> float:
        return float(np.mean([self.read(a.losses).mean(dtype=np.float64) for a, _ in self.subs]))

    def logits(self) -> np.ndarray:
        """(B, T, Vp) logits of the last forward pass."""
        return np.concatenate([self.read(a.logits) for a, _ in self.subs])

    def _param_namespaces(self, make):
        from types import SimpleNamespace
        return [SimpleNamespace(**make(kind, flat))
                for kind, flat in (("param", self.state.params), ("grad", self.state.grads),
                                   ("m", self.state.m), ("v", self.state.v))]

    def close(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class ReferenceEngine(_Engine):
    """The kernels in a plain loop with OpenMP, no StarPU (paper's baseline)."""

    name = "reference"

    def __init__(self, config, state, B, T, tokens, threads: int | None = None, sub_batches: int = 1):
        super().__init__(config, state, B, T, tokens, sub_batches)
        if threads:
            lib.sl_set_threads(threads)
        self.threads = lib.sl_get_threads()
        self.ops = DirectOps()

        def make(kind, flat):
            out = {}
            for name, arr in self.layout.views(flat).items():
                if self.layout.is_layered(name):
                    out[name] = [Tensor(f"{kind}.{name}[{l}]", arr[l].shape, array=arr[l])
                                 for l in range(config.L)]
                else:
                    out[name] = Tensor(f"{kind}.{name}", arr.shape, array=arr)
            return out

        self.p, self.g, self.m, self.v = self._param_namespaces(make)

        def new_tensor(name, shape, dtype):
            return Tensor(name, shape, dtype, array=np.zeros(shape, dtype))

        self.subs = [taskflow.make_activations(config, self.Bs, T, new_tensor)
                     for _ in range(sub_batches)]

    def wait(self):
        pass

    def read(self, t):
        return t.array.copy()

    def describe(self):
        return f"reference engine, {self.threads} OpenMP thread(s), BLAS {ffi.string(lib.sl_blas_name()).decode()}"


class StarPUEngine(_Engine):
    """Every tensor a StarPU data handle; every layer a task (needs a running Runtime).

    Under StarPU-MPI (a Runtime started on a communicator of R processes) every process
    registers every handle with an owner and a small dense tag and submits the whole graph:
    rank r owns the activations of its sub-batches (B/R sequences), rank 0 the parameters,
    gradients and moments; gradient contributions of all ranks are reduced to rank 0, which
    runs the updates."""

    name = "starpu"

    def __init__(self, config, state, B, T, tokens, runtime, sub_batches: int | None = None,
                 record: bool = False):
        if not runtime.running:
            raise RuntimeError("the StarPU runtime is not running")
        self.rank, self.nranks = runtime.rank, runtime.size
        if B % self.nranks:
            raise StarpuLLMError(f"--batch {B} cannot be split over {self.nranks} MPI processes; "
                                 f"use a --batch divisible by {self.nranks}")
        per_rank = B // self.nranks
        if sub_batches is None:   # data parallelism: one sub-batch per worker by default
            sub_batches = runtime.workers
            if per_rank % sub_batches:
                raise StarpuLLMError(
                    f"--batch {B} cannot be split over {sub_batches} workers (one sub-batch "
                    f"each) x {self.nranks} process(es); use a --batch divisible by "
                    f"{sub_batches * self.nranks}, or --sub-batches")
        elif per_rank % sub_batches:
            raise StarpuLLMError(f"--batch {B} ({per_rank} per process) cannot be split into "
                                 f"{sub_batches} equal sub-batches; choose --sub-batches dividing {per_rank}")
        self.subs_per_rank = sub_batches
        super().__init__(config, state, B, T, tokens, sub_batches * self.nranks)
        self.mpi = self.nranks > 1
        self.runtime = runtime
        # Data parallelism: sub-batch i stays on worker i mod N, so every worker always adds
        # into its own reduction copies (StarPU allocates them all in the first step) and two
        # sub-batches never queue behind each other. Only where StarPU's worker ids are the N
        # workers of the partition.
        self._pin_sub_batches = runtime.workers > 1 and runtime.workers_are_starpu_workers
        self.ops = StarPUOps(record=record)
        self._registered = []     # (handle, partitioned) to unregister in reverse order
        self._buffers = []
        self._next_tag = 0

        def make(kind, flat):
            # Rank 0 owns parameters, gradients and moments. Other ranks hold parameter
            # memory (received copies land there) and nothing else.
            owner_here = self.rank == 0
            memory = owner_here or kind == "param"
            out = {}
            for name, arr in self.layout.views(flat).items():
                layered = self.layout.is_layered(name)
                if owner_here:
                    h = self._register(arr, partitioned=layered)
                    if layered:
                        # StarPU data partitioning: one child handle per layer, so each
                        # layer's slice has its own dependencies and its own update task.
                        kids = ffi.new("sl_handle[]", config.L)
                        if lib.sl_partition(h, config.L, kids) != 0:
                            raise RuntimeError(f"partitioning {name} failed")
                        tensors = [Tensor(f"{kind}.{name}[{l}]", arr.shape[1:], h=kids[l])
                                   for l in range(config.L)]
                    else:
                        tensors = [Tensor(f"{kind}.{name}", arr.shape, h=h)]
                else:
                    # a non-owner: one handle per slice (the same tags as the owner's
                    # children), so there is no partition to gather back at the end
                    slices = [arr[l] for l in range(config.L)] if layered else [arr]
                    tensors = [Tensor(f"{kind}.{name}" + (f"[{l}]" if layered else ""), sl.shape,
                                      h=self._register(sl if memory else None, sl.size))
                               for l, sl in enumerate(slices)]
                out[name] = tensors if layered else tensors[0]
                for t in tensors:
                    self._mpi_register(t.h, owner=0)
                    if kind == "grad" and self.redux:
                        lib.sl_set_grad_reduction(t.h)
            return out

        self.p, self.g, self.m, self.v = self._param_namespaces(make)

        def activations_of(owner):
            def new_tensor(name, shape, dtype):
                # Our memory, not StarPU's (-1): StarPU 1.3.10's peager crashes when a
                # parallel task gets a buffer StarPU allocated itself. np.empty touches no
                # page, so the first task that writes a tensor places its pages (first touch).
                arr = np.empty(shape, dtype) if owner == self.rank else None
                h = self._register(arr, int(np.prod(shape)), np.dtype(dtype).itemsize, owner)
                return Tensor(name, shape, dtype, h=h)
            return new_tensor

        self.subs = [taskflow.make_activations(config, self.Bs, T,
                                               activations_of(i // self.subs_per_rank))
                     for i in range(self.sub_batches)]
        if self.mpi and self._next_tag > lib.sl_mpi_tag_ub():
            raise StarpuLLMError(f"{self._next_tag} data handles need more MPI tags than this MPI "
                                 f"allows ({lib.sl_mpi_tag_ub()}); use fewer sub-batches per process")

    def tensor_names(self) -> dict:
        """{handle address: tensor name} of every tensor of this engine (sub-batch i's
        activations prefixed "s{i}."), to read the handles of a task trace."""
        names = {}
        for t in (t for ns in (self.p, self.g, self.m, self.v) for t in tensor_list(ns)):
            names[int(ffi.cast("uintptr_t", t.h))] = t.name
        for i, (a, s) in enumerate(self.subs):
            for t in (t for ns in (a, s) for t in tensor_list(ns)):
                names[int(ffi.cast("uintptr_t", t.h))] = f"s{i}.{t.name}"
        return names

    def _register(self, arr, n=None, itemsize=4, owner=None, partitioned=False):
        """A vector handle on arr (kept alive), or of n elements allocated by StarPU when arr
        is None (a tensor this process never computes on); MPI-registered when owner is
        given; unregistered by close(), in reverse order."""
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

    # --- where tasks run under MPI ---
    def _owner(self, i):
        return i // self.subs_per_rank

    def _run_sub_batch_on(self, i):
        if self.mpi:
            lib.sl_mpi_set_exec_node(self._owner(i))
        if self._pin_sub_batches:
            lib.sl_set_exec_worker(i % self.subs_per_rank % self.runtime.workers)

    def _gradients_submitted(self):
        lib.sl_set_exec_worker(-1)   # reductions and updates go wherever a worker is free
        if self.mpi:   # every rank's contributions -> rank 0
            for t in tensor_list(self.g):
                if lib.sl_mpi_redux(t.h) != 0:
                    raise RuntimeError(f"starpu_mpi_redux_data failed for {t.name}")

    def _run_update_on_owner(self):
        if self.mpi:
            lib.sl_mpi_set_exec_node(0)

    def wait(self):
        self.runtime.wait()

    def read(self, t):
        ptr = lib.sl_acquire(t.h, 1)
        if ptr == ffi.NULL:
            raise RuntimeError(f"acquiring {t.name} failed")
        try:
            return np.frombuffer(ffi.buffer(ptr, t.size * t.dtype.itemsize),
                                 dtype=t.dtype).reshape(t.shape).copy()
        finally:
            lib.sl_release(t.h)

    def loss(self) -> float:
        if not self.mpi:
            return super().loss()
        mine = [self.read(a.losses).mean(dtype=np.float64)
                for i, (a, _) in enumerate(self.subs) if self._owner(i) == self.rank]
        return float(sum(self.runtime.comm.allreduce(mine)) / self.sub_batches)

    def sync(self):
        """Make the numpy buffers of parameters, gradients and moments coherent (runs any
        pending gradient reduction). Under MPI only rank 0 holds them."""
        self.wait()
        if self.mpi and self.rank != 0:
            return
        for ns in (self.p, self.g, self.m, self.v):
            for t in tensor_list(ns):
                if lib.sl_acquire(t.h, 1) == ffi.NULL:
                    raise RuntimeError(f"acquiring {t.name} failed")
                lib.sl_release(t.h)

    def close(self):
        if not self._registered or not self.runtime.running:
            self._registered = []
            return
        self.wait()
        for h, partitioned in reversed(self._registered):
            if partitioned:
                lib.sl_unpartition(h)
            lib.sl_unregister(h)
        self._registered = []
        self._buffers = []

    def describe(self):
        per = f" ({self.subs_per_rank} per process)" if self.mpi else ""
        return f"starpu engine, {self.runtime.describe()}, {self.sub_batches} sub-batch(es){per}"
