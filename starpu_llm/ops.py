"""The two executors of the task flow: one method per layer type, same signature in both.

StarPUOps submits one StarPU task per call (through the C submit helpers, never running Python
inside a task) and can record the name of each task it submitted (the handles and access modes
of a task are StarPU's own, read back by the runtime's task trace); DirectOps calls the same C kernels at once in
the calling thread (the reference trainer, no StarPU). taskflow.py is written against this
interface only, so both engines run exactly the same sequence of layers.
"""
from __future__ import annotations

import math

import numpy as np

from ._clib import ffi, lib


class Tensor:
    """A named tensor: a StarPU data handle (h), or a numpy array and its pointer (direct)."""

    __slots__ = ("name", "shape", "dtype", "array", "ptr", "h")

    def __init__(self, name, shape, dtype=np.float32, array=None, h=None):
        self.name, self.shape, self.dtype = name, tuple(shape), np.dtype(dtype)
        self.array, self.h = array, h
        self.ptr = None
        if array is not None:
            ctype = "int32_t *" if self.dtype == np.int32 else "float *"
            self.ptr = ffi.cast(ctype, ffi.from_buffer(array))

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def __repr__(self):
        return f"Tensor({self.name}, {self.shape})"


NULL = ffi.NULL


def _h(t):
    return NULL if t is None else t.h


def _p(t):
    return NULL if t is None else t.ptr


class SubmitError(RuntimeError):
    pass


class StarPUOps:
    """Submits each layer as a StarPU task. With record=True, keeps the task name of every
    submission, in order, in .records."""

    def __init__(self, record: bool = False):
        self.records = [] if record else None

    def _done(self, ret, name):
        if ret != 0:
            raise SubmitError(f"submitting {name} failed ({ret})")
        if self.records is not None:
            self.records.append(name)

    def load_batch(self, inputs, targets, tokens_ptr, pos, n):
        self._done(lib.sl_submit_load_batch(inputs.h, targets.h, tokens_ptr, pos, n),
                   "load_batch")

    def encoder_forward(self, out, inp, wte, wpe, B, T, C):
        self._done(lib.sl_submit_encoder_forward(out.h, inp.h, wte.h, wpe.h, B, T, C),
                   "encoder_forward")

    def encoder_backward(self, dwte, dwpe, dout, inp, B, T, C, redux):
        self._done(lib.sl_submit_encoder_backward(dwte.h, dwpe.h, dout.h, inp.h, B, T, C, redux),
                   "encoder_backward")

    def layernorm_forward(self, out, mean, rstd, inp, w, b, N, C):
        self._done(lib.sl_submit_layernorm_forward(out.h, mean.h, rstd.h, inp.h, w.h, b.h, N, C),
                   "layernorm_forward")

    def layernorm_backward(self, dinp, dw, db, dout, inp, w, mean, rstd, N, C, accumulate, redux):
        self._done(lib.sl_submit_layernorm_backward(dinp.h, dw.h, db.h, dout.h, inp.h, w.h,
                                                    mean.h, rstd.h, N, C, accumulate, redux),
                   "layernorm_backward")

    def matmul_forward(self, out, inp, w, b, N, C, OC):
        self._done(lib.sl_submit_matmul_forward(out.h, inp.h, w.h, _h(b), N, C, OC),
                   "matmul_forward")

    def matmul_backward(self, dinp, dw, db, dout, inp, w, N, C, OC, redux):
        self._done(lib.sl_submit_matmul_backward(dinp.h, dw.h, _h(db), dout.h, inp.h, w.h,
                                                 N, C, OC, redux),
                   "matmul_backward")

    def attention_forward(self, out, preatt, att, qkv, B, T, C, NH):
        self._done(lib.sl_submit_attention_forward(out.h, preatt.h, att.h, qkv.h, B, T, C, NH),
                   "attention_forward")

    def attention_backward(self, dqkv, scratch, dout, qkv, att, B, T, C, NH):
        self._done(lib.sl_submit_attention_backward(dqkv.h, scratch.h, dout.h, qkv.h, att.h,
                                                    B, T, C, NH),
                   "attention_backward")

    def gelu_forward(self, out, inp, N):
        self._done(lib.sl_submit_gelu_forward(out.h, inp.h, N), "gelu_forward")

    def gelu_backward(self, dinp, inp, dout, N):
        self._done(lib.sl_submit_gelu_backward(dinp.h, inp.h, dout.h, N),
                   "gelu_backward")

    def residual_forward(self, out, a, b, N):
        self._done(lib.sl_submit_residual_forward(out.h, a.h, b.h, N),
                   "residual_forward")

    def crossentropy_forward(self, probs, losses, logits, targets, N, V, Vp):
        self._done(lib.sl_submit_crossentropy_forward(probs.h, losses.h, logits.h, targets.h,
                                                      N, V, Vp),
                   "crossentropy_forward")

    def crossentropy_backward(self, dlogits, probs, targets, N, V, Vp, dloss):
        self._done(lib.sl_submit_crossentropy_backward(dlogits.h, probs.h, targets.h,
                                                       N, V, Vp, dloss),
                   "crossentropy_backward")

    def adamw(self, p, g, m, v, lr, beta1, beta2, eps, wd, t):
        self._done(lib.sl_submit_adamw(p.h, g.h, m.h, v.h, lr, beta1, beta2, eps, wd, t),
                   "adamw")


class DirectOps:
    """Calls the kernels directly, in order, in this thread (OpenMP inside each kernel)."""

    records = None

    def load_batch(self, inputs, targets, tokens_ptr, pos, n):
        lib.load_batch(inputs.ptr, targets.ptr, tokens_ptr, pos, n)

    def encoder_forward(self, out, inp, wte, wpe, B, T, C):
        lib.encoder_forward(out.ptr, inp.ptr, wte.ptr, wpe.ptr, B, T, C)

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

    def adamw(self, p, g, m, v, lr, beta1, beta2, eps, wd, t):
        lib.adamw_update(p.ptr, g.ptr, m.ptr, v.ptr, p.size, lr, beta1, beta2, eps, wd, t, 1)
