"""The reference engine: the kernels in a plain loop with OpenMP, no StarPU (the paper's
baseline).

Every tensor is a numpy array; DirectOps (ops.py) runs each codelet's body at once in the
calling thread, in the order taskflow.py makes its calls, so the reference runs exactly the
layers, and the codelet bodies, the StarPU engine submits. It loads starpu_llm._kernels, the binding of the kernels alone: no
StarPU library is loaded or called on this path.
"""
from __future__ import annotations

import numpy as np

from .._kernels import ffi, lib
from . import taskflow
from ..codelets import DirectOps
from .step import Engine
from .tensors import ParameterTensors, Tensor, sub_batch_tensors


class ReferenceEngine(Engine):
    """The kernels in a plain loop with OpenMP, no StarPU (paper's baseline)."""

    name = "reference"

    def __init__(self, config, state, B, T, tokens, threads: int | None = None, sub_batches: int = 1):
        super().__init__(config, state, B, T, tokens, sub_batches)
        if threads:
            lib.kernels_set_threads(threads)
        self.threads = lib.kernels_threads()
        self.ops = DirectOps()
        self.p, self.g, self.m, self.v = (
            ParameterTensors.of_arrays(kind, self.layout, flat)
            for kind, flat in (("param", state.params), ("grad", state.grads),
                               ("m", state.m), ("v", state.v)))

        def new_tensor(name, shape, dtype):
            return Tensor(name, shape, dtype, array=np.zeros(shape, dtype))

        self.subs = [sub_batch_tensors(config, self.Bs, T, new_tensor) for _ in range(sub_batches)]
        norm = np.zeros(taskflow.norm_nodes(config), np.float64)
        self.norm = [Tensor(f"gradnorm[{k}]", (1,), np.float64, array=norm[k:k + 1])
                     for k in range(norm.size)]

    def wait(self):
        pass

    def read(self, t):
        return t.array.copy()

    def describe(self):
        return f"reference engine, {self.threads} OpenMP thread(s), BLAS {ffi.string(lib.blas_name()).decode()}"
