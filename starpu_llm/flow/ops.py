"""The StarPU executor of the task flow: one method per layer type, each submitting one task.

StarPUOps submits one StarPU task per call (through the C submit helpers, never running Python
inside a task) and can record the name of each task it submitted (the handles and access modes
of a task are StarPU's own, read back by the runtime's task trace). reference.DirectOps has
the same methods and calls the C kernels at once in the calling thread (the reference
trainer, no StarPU). taskflow.py is written against this interface only, so both engines run
exactly the same sequence of layers.
"""
from __future__ import annotations

from .._clib import ffi, lib


NULL = ffi.NULL


def _h(t):
    return NULL if t is None else t.h


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

    def encoder_forward(self, out, inp, wte, wpe, B, T, C, pos=0):
        self._done(lib.sl_submit_encoder_forward(out.h, inp.h, wte.h, wpe.h, B, T, C, pos),
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

    def kv_append(self, kcache, vcache, qkv, B, Tn, C, NH, maxT, pos):
        self._done(lib.sl_submit_kv_append(kcache.h, vcache.h, qkv.h, B, Tn, C, NH, maxT, pos),
                   "kv_append")

    def attention_decode(self, out, qkv, kcache, vcache, B, Tn, C, NH, maxT, pos):
        self._done(lib.sl_submit_attention_decode(out.h, qkv.h, kcache.h, vcache.h,
                                                  B, Tn, C, NH, maxT, pos),
                   "attention_decode")

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

    def adamw(self, p, g, m, v, lr, beta1, beta2, eps, wd, t, sumsq=None, max_norm=0.0):
        self._done(lib.sl_submit_adamw(p.h, g.h, m.h, v.h, _h(sumsq), max_norm, lr, beta1, beta2,
                                       eps, wd, t),
                   "adamw")

    def grad_sumsq(self, sumsq, grad):
        self._done(lib.sl_submit_grad_sumsq(sumsq.h, grad.h), "grad_sumsq")

    def norm_sum(self, out, inputs):
        self._done(lib.sl_submit_norm_sum(out.h, [t.h for t in inputs], len(inputs)), "norm_sum")
