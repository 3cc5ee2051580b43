"""The reference engine: the kernels in a plain loop with OpenMP, no StarPU (the paper's
baseline).

Every tensor is a numpy array; DirectOps calls the C kernels at once in the calling thread,
in the order taskflow.py makes its calls, so the reference runs exactly the layers the
StarPU engine submits. It loads starpu_llm._kernels, the binding of the kernels alone: no
StarPU library is loaded or called on this path.
"""
from __future__ import annotations

import numpy as np

from .._kernels import ffi, lib
from . import taskflow
from .step import Engine
from .tensors import ParameterTensors, Tensor, sub_batch_tensors


def _p(t):
    return ffi.NULL if t is None else t.ptr


class DirectOps:
    """Calls the kernels directly, in order, in this thread (OpenMP inside each kernel);
    the same methods as ops.StarPUOps."""

    def load_batch(self, inputs, targets, tokens_ptr, pos, n):
        lib.load_batch(inputs.ptr, targets.ptr, tokens_ptr, pos, n)

    def encoder_forward(self, out, inp, wte, wpe, B, T, C, pos=0):
        lib.encoder_forward(out.ptr, inp.ptr, wte.ptr, wpe.ptr + pos * C, B, T, C)

    def encoder_backward(self, dwte, dwpe, dout, inp, B, T, C, redux):
        lib.encoder_backward(dwte.ptr, dwpe.ptr, dout.ptr, inp.ptr, B, T, C)

    def layernorm_forward(self, out, mean, rstd, inp, w, b, N, C):
        lib.layernorm_forward(out.ptr, mean.ptr, rstd.ptr, inp.ptr, w.ptr, b.ptr, N, C)

    def layernorm_backward(self, dinp, dw, db, dout, inp, w, mean, rstd, N, C, accumulate, redux):
        lib.layernorm_backward(dinp.ptr, dw.ptr, db.ptr, dout.ptr, inp.ptr, w.ptr, mean.ptr,
                               rstd.ptr, N, C, accumulate)

    def matmul_forward(self, out, inp, w, b, N, C, OC):
        lib.matmul_forward(out.ptr, inp.ptr, w.ptr, _p(b), N, C, OC)

    def matmul_backward(self, dinp, dw, db, dout, inp, w, N, C, OC, redux):
        lib.matmul_backward(dinp.ptr, dw.ptr, _p(db), dout.ptr, inp.ptr, w.ptr, N, C, OC)

    def attention_forward(self, out, preatt, att, qkv, B, T, C, NH):
        lib.attention_forward(out.ptr, preatt.ptr, att.ptr, qkv.ptr, B, T, C, NH)

    def attention_backward(self, dqkv, scratch, dout, qkv, att, B, T, C, NH):
        datt = ffi.cast("float *", scratch.ptr) + B * NH * T * T
        lib.attention_backward(dqkv.ptr, scratch.ptr, datt, dout.ptr, qkv.ptr, att.ptr,
                               B, T, C, NH)

    def kv_append(self, kcache, vcache, qkv, B, Tn, C, NH, maxT, pos):
        lib.kv_append(kcache.ptr, vcache.ptr, qkv.ptr, B, Tn, C, NH, maxT, pos)

    def attention_decode(self, out, qkv, kcache, vcache, B, Tn, C, NH, maxT, pos):
        lib.attention_decode(out.ptr, qkv.ptr, kcache.ptr, vcache.ptr, B, Tn, C, NH, maxT, pos)

    def gelu_forward(self, out, inp, N):
        lib.gelu_forward(out.ptr, inp.ptr, N)

    def gelu_backward(self, dinp, inp, dout, N):
        lib.gelu_backward(dinp.ptr, inp.ptr, dout.ptr, N)

    def residual_forward(self, out, a, b, N):
        lib.residual_forward(out.ptr, a.ptr, b.ptr, N)

    def crossentropy_forward(self, probs, losses, logits, targets, N, V, Vp):
        lib.crossentropy_softmax_forward(probs.ptr, losses.ptr, logits.ptr, targets.ptr, N, V, Vp)

    def crossentropy_backward(self, dlogits, probs, targets, N, V, Vp, dloss):
        lib.crossentropy_softmax_backward(dlogits.ptr, probs.ptr, targets.ptr, N, V, Vp, dloss)

    def adamw(self, p, g, m, v, lr, beta1, beta2, eps, wd, t, sumsq=None, max_norm=0.0):
        scale = lib.clip_scale(sumsq.array[0], max_norm) if max_norm > 0 else 1.0
        lib.adamw_update(p.ptr, g.ptr, m.ptr, v.ptr, p.size, lr, beta1, beta2, eps, wd, t, 1, scale)

    def grad_sumsq(self, sumsq, grad):
        lib.sum_of_squares(sumsq.ptr, grad.ptr, grad.size)

    def norm_sum(self, out, inputs):
        lib.sum_f64(out.ptr, [t.array[0] for t in inputs], len(inputs))


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
