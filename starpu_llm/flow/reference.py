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
from ..kernels.codelets import DirectOps
from .step import Engine
from .tensors import ParameterTensors, Tensor, sub_batch_tensors


class ReferenceEngine(Engine):
    """The kernels in a plain loop with OpenMP, no StarPU (paper's baseline). gpu: the
    codelets' CUDA bodies instead, each on copies of its buffers (codelets.DirectOps: on GPU
    0 of a CUDA build, in the CPU emulation of CUDA otherwise), matmuls in TF32 when tf32: the
    GPU kernels' own check against the same oracle, without StarPU. attention: the attention's
    form (tensors.ATTENTIONS; the fused one's CPU or CUDA body likewise)."""

    name = "reference"

    def __init__(self, config, state, B, T, tokens, threads: int | None = None, sub_batches: int = 1,
                 gpu: bool = False, tf32: bool = False, attention: str = "gemm"):
        super().__init__(config, state, B, T, tokens, sub_batches)
        if threads:
            lib.kernels_set_threads(threads)
        self.threads = lib.kernels_threads()
        self.gpu = gpu
        self.ops = DirectOps(gpu, tf32)
        self.p, self.g, self.m, self.v = (
            ParameterTensors.of_arrays(kind, self.layout, flat)
            for kind, flat in (("param", state.params), ("grad", state.grads),
                               ("m", state.m), ("v", state.v)))

        def new_tensor(name, shape, dtype):
            return Tensor(name, shape, dtype, array=np.zeros(shape, dtype))

        self.subs = [sub_batch_tensors(config, self.Bs, T, new_tensor, attention=attention)
                     for _ in range(sub_batches)]
        norm = np.zeros(taskflow.norm_nodes(config), np.float64)
        self.norm = [Tensor(f"gradnorm[{k}]", (1,), np.float64, array=norm[k:k + 1])
                     for k in range(norm.size)]

    def wait(self):
        pass

    def read(self, t):
        return t.array.copy()

    def describe(self):
        gpu = (f", CUDA bodies {'emulated' if lib.sl_gpu_emulated() else 'on GPU 0'}"
               if self.gpu else "")
        return (f"reference engine, {self.threads} OpenMP thread(s), "
                f"BLAS {ffi.string(lib.blas_name()).decode()}{gpu}")
