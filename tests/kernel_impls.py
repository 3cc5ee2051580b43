"""The kernels as tests/test_kernels.py calls them, on numpy arrays: the CPU kernels
(csrc/kernels, called directly) or the GPU kernels (csrc/cuda, through each codelet's CUDA
body: sl_codelet_run_cuda, on this machine's GPU in a CUDA build, in the CPU emulation of
CUDA otherwise). Both take the CPU kernels' arguments (kernels.h), so one test checks both
against the same float64 reference and the same fp32 bound: the GPU kernels compute the same
formulas in another order, which the bounds allow (test_kernels.py's docstring)."""
from __future__ import annotations

import numpy as np

from starpu_llm._kernels import ffi, lib
from starpu_llm.kernels.codelets import TABLE, cuda_devices

_PTR = {np.dtype(np.float32): "float *", np.dtype(np.int32): "int32_t *",
        np.dtype(np.uint16): "uint16_t *", np.dtype(np.float64): "double *"}


def ptr(a):
    """A typed pointer to a C-contiguous array (None: NULL); other arguments as they are."""
    if a is None:
        return ffi.NULL
    if isinstance(a, np.ndarray):
        assert a.flags.c_contiguous, "the kernels take C-contiguous arrays"
        return ffi.cast(_PTR[a.dtype], ffi.from_buffer(a))
    return a


class CPUKernels:
    """lib's kernel functions with numpy arrays for pointers."""
    name = "cpu"

    def __getattr__(self, name):
        f = getattr(lib, name)

        def call(*args):
            return f(*(ptr(a) for a in args))
        return call


def gpu_available() -> str | None:
    """None when the GPU kernels can run here, else why not."""
    if lib.sl_gpu_emulated():
        return None
    n, why = cuda_devices()
    if n < 1:
        return (f"no GPU: {why or 'CUDA reports no device'} (the CUDA build runs its kernels on "
                "a GPU only)")
    return None


class GPUKernels:
    """The GPU kernels behind the CPU kernels' signatures (matmuls in fp32 unless tf32)."""
    name = "gpu"

    def __init__(self, tf32: bool = False):
        self.tf32 = int(tf32)

    def run(self, codelet: str, buffers: list, **scalars):
        """The CUDA body of codelet on the arrays (None: an optional buffer left out)."""
        cd = TABLE[codelet]
        n = len(buffers)
        keep = [ffi.from_buffer(a) if a is not None else ffi.NULL for a in buffers]
        ptrs = ffi.new("void *[]", [ffi.cast("void *", k) for k in keep] or 1)
        counts = ffi.new("size_t[]", [a.size if a is not None else 0 for a in buffers] or 1)
        sizes = ffi.new("size_t[]", [a.itemsize if a is not None else 0 for a in buffers] or 1)
        args = ffi.new(cd.args_type + " *", scalars) if cd.has_args else ffi.NULL
        ret = lib.sl_codelet_run_cuda(cd.id, ptrs, counts, sizes, n, args, self.tf32)
        if ret != 0:
            raise RuntimeError(f"sl_codelet_run_cuda({codelet}) failed ({ret})")

    def __getattr__(self, name):
        """A codelet named as its CPU kernel and taking the kernel's arguments in the same
        order (buffers, then its struct's fields: an element-wise layer's, gelu_forward,
        residual_forward): its CUDA body, with no method here. The others have one below."""
        cd = TABLE.get(name)
        if cd is None or name.startswith("_"):
            raise AttributeError(f"GPUKernels has no {name}: no codelet of that name; give the "
                                 f"kernel a method here that calls its codelet")

        def call(*args):
            # a kernel whose arguments are not the codelet's would leave a field 0 or drop one
            if len(args) != cd.nbuffers + len(cd.fields):
                raise TypeError(f"GPUKernels.{name}: its codelet takes {cd.nbuffers} buffers "
                                f"then {', '.join(cd.fields)}, not {len(args)} arguments: give "
                                f"the kernel a method here")
            self.run(name, list(args[:cd.nbuffers]), **dict(zip(cd.fields, args[cd.nbuffers:])))
        return call

    def encoder_forward(self, out, inp, wte, wpe, B, T, C):
        self.run("encoder_forward", [out, inp, wte, wpe], B=B, T=T, C=C, blocks=1)

    def encoder_backward(self, dwte, dwpe, dout, inp, B, T, C):
        self.run("encoder_backward", [dwte, dwpe, dout, inp], B=B, T=T, C=C, blocks=1)

    def layernorm_forward(self, out, mean, rstd, inp, w, b, N, C):
        self.run("layernorm_forward", [out, mean, rstd, inp, w, b], N=N, C=C)

    def layernorm_backward(self, dinp, dw, db, dout, inp, w, mean, rstd, N, C, accumulate):
        self.run("layernorm_backward", [dinp, dw, db, dout, inp, w, mean, rstd], N=N, C=C,
                 accumulate=accumulate)

    def matmul_forward(self, out, inp, weight, bias, N, C, OC):
        self.run("matmul_forward", [out, inp, weight] + ([bias] if bias is not None else []),
                 N=N, C=C, OC=OC, blocks=1)

    def matmul_backward(self, dinp, dweight, dbias, dout, inp, weight, N, C, OC):
        self.run("matmul_backward", [dinp, dweight, dout, inp, weight]
                 + ([dbias] if dbias is not None else []), N=N, C=C, OC=OC, blocks=1)

    def attention_forward(self, out, att, qkv, B, T, C, NH):
        self.run("attention_forward", [out, att, qkv], B=B, T=T, C=C, NH=NH)

    def attention_flash_forward(self, out, lse, qkv, B, T, C, NH):
        self.run("attention_flash_forward", [out, lse, qkv], B=B, T=T, C=C, NH=NH)

    def attention_flash_backward(self, dqkv, dsum, dout, qkv, out, lse, B, T, C, NH):
        self.run("attention_flash_backward", [dqkv, dsum, dout, qkv, out, lse], B=B, T=T, C=C,
                 NH=NH)

    def attention_backward(self, dqkv, dpreatt, datt, dout, qkv, att, B, T, C, NH):
        scratch = np.concatenate([dpreatt.reshape(-1), datt.reshape(-1)])  # (2,B,NH,T,T)
        self.run("attention_backward", [dqkv, scratch, dout, qkv, att], B=B, T=T, C=C, NH=NH)
        dpreatt.reshape(-1)[:] = scratch[:dpreatt.size]
        datt.reshape(-1)[:] = scratch[dpreatt.size:]

    def crossentropy_softmax_forward(self, probs, losses, logits, targets, N, V, Vp,
                                     accumulate):
        self.run("crossentropy_forward", [probs, losses, logits, targets], N=N, V=V, Vp=Vp,
                 accumulate=accumulate)

    def crossentropy_softmax_backward(self, dlogits, probs, targets, N, V, Vp, dloss):
        self.run("crossentropy_backward", [dlogits, probs, targets], N=N, V=V, Vp=Vp,
                 dloss=dloss)

    def adamw_update(self, params, grads, m, v, n, lr, b1, b2, eps, wd, t, zero_grad,
                     grad_scale):
        """The adamw codelet always zeroes the gradient; a grad_scale below 1 is given as
        the clipping of a squared norm 16 to max_norm 4 grad_scale (1 + 2^-22), which
        clip_scale's formula (kernels/clip.h, the same on both) rounds to grad_scale."""
        assert zero_grad, "the GPU AdamW zeroes the gradient"
        sumsq, max_norm = None, 0.0
        if grad_scale != 1.0:
            sumsq = np.array([16.0])
            max_norm = float(np.float32(4.0 * grad_scale * (1.0 + 2.0 ** -22)))
            assert lib.clip_scale(16.0, max_norm) == grad_scale
        self.run("adamw", [params, grads, m, v] + ([sumsq] if sumsq is not None else []),
                 lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd, t=t, max_norm=max_norm)

    def sum_of_squares(self, out, x, n):
        self.run("grad_sumsq", [out, x])

    def sum_f64(self, out, x, n):
        self.run("norm_sum", [out] + [x[i:i + 1] for i in range(n)], count=n)

    def fill_zero(self, x, n):
        self.run("zero", [x])

    def add_inplace(self, a, b, n):
        self.run("add", [a, b])

    def kv_append(self, k, v, new, idx, N, C, NH, Tc):
        self.run("kv_append", [k, v, new, idx], N=N, C=C, NH=NH, Tc=Tc)

    def attention_decode(self, out, new, k, v, idx, N, C, NH, Tc):
        self.run("attention_decode", [out, new, k, v, idx], N=N, C=C, NH=NH, Tc=Tc)
