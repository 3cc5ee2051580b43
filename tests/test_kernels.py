"""Every C kernel (csrc/kernels) and GPU kernel (csrc/cuda) against PyTorch autograd
computed in float64.

Each test runs twice (the `kern` fixture, tests/kernel_impls.py): on the CPU kernels, and on
the GPU kernels through each codelet's CUDA body, which a CUDA build runs on its GPU (skipped,
naming why, without one) and the CPU build in its CPU emulation of CUDA and cuBLAS
(csrc/cuda/emulate.h: the kernels' indexing, barriers, warp shuffles and cuBLAS arguments).
The GPU kernels compute the same formulas as the CPU ones in another order (blocks of a
reduction, cuBLAS's GEMMs with the matmuls in fp32; CUDA's expf is documented to 2 ulp as
vexpf), so the same bounds hold for them: one bound per output, whichever computed it.

The kernels compute in float32. Each numerical comparison uses a bound derived from fp32
arithmetic (tests/bounds.py: u = 2^-24, gamma(n) = n u / (1 - n u)), stated next to it:
  - a sum or dot product of n terms (any order, any blocking, with or without FMA, as the
    CPU, OpenBLAS's kernel family and OpenMP's reduction choose) is within
    gamma(n) * sum|terms| of the exact value, element-wise; sum|terms| is computed in float64
    from the inputs (|A| @ |B| for a matmul). A count of "n + k" adds the k further roundings
    (a division, a product, the add into an accumulator) the kernel makes on the way;
  - composite kernels (layernorm, softmax in attention and crossentropy, gelu, adamw) carry
    the bound through their own steps, in the order and precision of csrc/kernels/*.c: the
    error of each intermediate (a mean, a score, an exp) times how it propagates, and where
    terms cancel (g - mean(g) - xn mean(g xn), datt - sum(att * datt), p - 1) the bound
    uses their |terms|;
  - exp is csrc/kernels/vexpf.h, documented to 2 ulp (bounds.VEXPF_REL = 4u).
None is scaled from errors seen on one machine. The propagation is first order in u: a
dropped product of two error terms is at most the largest relative error bound in this file
(~1e-2, layernorm's xn for |mean| = 1e5 std at C = 768) times the bound, a 1% change. The
float64 reference is exact to ~1e-16 relative, negligible, except where torch's float64
formula itself cancels (gelu's 1 + tanh): that error is added to the bound.
Structural properties (padding, causality, accumulate vs write, in place) are checked exactly.
"""

import math
import os
import subprocess
import sys
import zlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bounds import (EXP_FLOOR, U, U64, VEXPF_REL, assert_within, dot_bound, exp_rel,
                    gamma, gamma64, gamma_n, softmax_bound, tf32_dot_bound, tf32_gamma)
from kernel_impls import CPUKernels, GPUKernels, gpu_available
from starpu_llm._kernels import ffi, lib


# ---------------------------------------------------------------- numpy <-> C pointers


def fp(a):
    """float * to the data of a C-contiguous float32 array (kept alive by the caller)."""
    assert a.dtype == np.float32 and a.flags.c_contiguous
    return ffi.cast("float *", ffi.from_buffer(a))


def ip(a):
    assert a.dtype == np.int32 and a.flags.c_contiguous
    return ffi.cast("int32_t *", ffi.from_buffer(a))


def u16p(a):
    assert a.dtype == np.uint16 and a.flags.c_contiguous
    return ffi.cast("uint16_t *", ffi.from_buffer(a))


def randn(rng, *shape, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(np.float32)


def t64(a, grad=False):
    """float64 torch copy of a numpy array (the reference computation)."""
    return torch.tensor(np.asarray(a, dtype=np.float64), dtype=torch.float64, requires_grad=grad)


def f64(a):
    """float64 numpy copy of an array or a torch tensor."""
    if isinstance(a, torch.Tensor):
        a = a.detach().numpy()
    return np.asarray(a, dtype=np.float64)


def close(actual, expected, bound, what):
    """|actual - expected| <= bound element-wise (bounds.assert_within, torch accepted)."""
    assert_within(actual, f64(expected), bound, what)


@pytest.fixture(params=["cpu", "gpu"])
def kern(request):
    """The kernels under test: the CPU ones, then the GPU ones (kernel_impls.py)."""
    if request.param == "gpu":
        why = gpu_available()
        if why:
            pytest.skip(why)
        return GPUKernels()
    return CPUKernels()


@pytest.fixture
def rng(request):
    # a fixed seed per test: reproducible failures
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


# ---------------------------------------------------------------- encoder


def _encoder_backward_bounds(dwte0, dwpe0, dout, inp):
    """dwte[v] = dwte0[v] + the dout rows of the k_v tokens with id v: k_v additions, so
    gamma(k_v) (|dwte0| + sum|dout|) (k_v = 0: untouched, bound 0). dwpe[t] = dwpe0[t] + B
    rows: gamma(B) (|dwpe0| + sum_b |dout|), rows t >= T untouched (bound 0)."""
    B, T, C = dout.shape
    ad = np.abs(f64(dout))
    k = np.bincount(inp.reshape(-1), minlength=dwte0.shape[0])
    s_wte = np.abs(f64(dwte0))
    np.add.at(s_wte, inp.reshape(-1), ad.reshape(-1, C))
    b_wte = gamma_n(k)[:, None] * s_wte
    b_wpe = np.zeros(dwpe0.shape)
    b_wpe[:T] = gamma(B) * (np.abs(f64(dwpe0[:T])) + ad.sum(0))
    return b_wte, b_wpe


def test_encoder_forward_backward_repeated_tokens(kern, rng):
    B, T, C, Vp, maxT = 2, 7, 24, 40, 10
    inp = rng.integers(0, 4, size=(B, T)).astype(np.int32)  # ids repeat within and across rows
    inp[0, 0] = inp[0, 1] = inp[1, 1] = 3
    wte, wpe = randn(rng, Vp, C), randn(rng, maxT, C)
    out = np.full((B, T, C), np.nan, np.float32)
    kern.encoder_forward(out, inp, wte, wpe, B, T, C)

    wte_t, wpe_t = t64(wte, True), t64(wpe, True)
    ref = wte_t[torch.from_numpy(inp).long()] + wpe_t[:T]
    # one fp32 addition of two exact inputs: u |wte + wpe|
    close(out, ref, dot_bound(1, np.abs(f64(ref))), "encoder out")

    dout = randn(rng, B, T, C)
    ref.backward(t64(dout))
    dwte0, dwpe0 = randn(rng, Vp, C), randn(rng, maxT, C)  # backward accumulates into these
    dwte, dwpe = dwte0.copy(), dwpe0.copy()
    kern.encoder_backward(dwte, dwpe, dout, inp, B, T, C)
    b_wte, b_wpe = _encoder_backward_bounds(dwte0, dwpe0, dout, inp)
    close(dwte, f64(dwte0) + f64(wte_t.grad), b_wte, "encoder dwte")
    close(dwpe, f64(dwpe0) + f64(wpe_t.grad), b_wpe, "encoder dwpe")
    unused = np.setdiff1d(np.arange(Vp), inp)
    assert np.array_equal(dwte[unused], dwte0[unused])
    assert np.array_equal(dwpe[T:], dwpe0[T:])


def test_encoder_backward_gpt2_width_many_repeats(kern, rng):
    # wide enough that every thread owns several channel blocks, all tokens the same id
    B, T, C, Vp = 4, 64, 768, 50
    inp = np.full((B, T), 7, np.int32)
    inp[1] = rng.integers(0, Vp, size=T)
    dout = randn(rng, B, T, C)
    dwte, dwpe = np.zeros((Vp, C), np.float32), np.zeros((T, C), np.float32)
    kern.encoder_backward(dwte, dwpe, dout, inp, B, T, C)
    ref_wte = np.zeros((Vp, C))
    np.add.at(ref_wte, inp.reshape(-1), f64(dout).reshape(-1, C))
    # gamma(k_v) (sum|dout|): up to k = 193 additions for id 7, gamma(B) for dwpe
    b_wte, b_wpe = _encoder_backward_bounds(np.zeros((Vp, C)), np.zeros((T, C)), dout, inp)
    close(dwte, ref_wte, b_wte, "encoder dwte")
    close(dwpe, f64(dout).sum(0), b_wpe, "encoder dwpe")


@pytest.mark.parametrize("B,T,C,Vp,ids", [(3, 100, 24, 16, 5), (2, 64, 768, 50, 1), (1, 1, 8, 4, 4),
                                           (1, (4 << 20) // 8 + 300, 2, 7, 7)])
def test_gpu_encoder_backward_is_the_cpu_kernels_to_the_bit(rng, B, T, C, Vp, ids):
    """The GPU's dwte and dwpe add each repeated token's (each position's) rows in the CPU
    kernel's order, b t = 0, 1, ... into the old value (encoder.cu: the positions sorted by
    (token, b t)), so they are the CPU's bits, on every run. The positions take the last `ids`
    token ids (1: one token throughout). C = 24 spreads a block of 256 threads over rows,
    which the emulation runs in lane, reversed and scrambled orders: the atomic additions this
    replaced added a token's rows out of order there, and bits differed; B T = 300 pads the
    sort to 512. The last case has 300 positions past the 524 288 that one sort takes (the
    4 MiB scratch, SL_GPU_SCRATCH_BYTES, in 8-byte keys): two sorts, in b t order."""
    why = gpu_available()
    if why:
        pytest.skip(why)
    inp = rng.integers(0, ids, size=(B, T)).astype(np.int32) + (Vp - ids)  # the last row too
    dout = randn(rng, B, T, C)
    dwte0, dwpe0 = randn(rng, Vp, C), randn(rng, T + 3, C)
    runs = []
    for k in (CPUKernels(), GPUKernels(), GPUKernels()):
        dwte, dwpe = dwte0.copy(), dwpe0.copy()
        k.encoder_backward(dwte, dwpe, dout, inp, B, T, C)
        runs.append((dwte, dwpe))
    for (cw, cp), (gw, gp) in ((runs[0], runs[1]), (runs[1], runs[2])):
        assert np.array_equal(gw, cw, equal_nan=False), np.argwhere(gw != cw)[:5]
        assert np.array_equal(gp, cp)
    assert not np.array_equal(runs[0][0], dwte0)  # it added something


def test_gpu_encoder_backward_fills_the_gpu(rng):
    """The embedding's backward at GPT-2's B T = 8192 positions (C = 64 here): one block sorts
    the positions, then dwte's additions run in at least 4 blocks per SM of an H100 (a thread
    per (sorted position, channel)), then dwpe's."""
    _emulated_only()
    B, T, C, Vp = 8, 1024, 64, 50
    inp = rng.integers(0, Vp, size=(B, T)).astype(np.int32)
    dwte, dwpe = np.zeros((Vp, C), np.float32), np.zeros((T, C), np.float32)
    _grids()
    GPUKernels().encoder_backward(dwte, dwpe, randn(rng, B, T, C), inp, B, T, C)
    grids = _grids()
    assert len(grids) == 3 and grids[0] == 1 and grids[1] >= 4 * H100_SMS, grids


# ---------------------------------------------------------------- layernorm


EPS32 = float(np.float32(1e-5))  # LN_EPS is 1e-5f; torch's eps is the double 1e-5


def _layernorm_bounds(inp, w, b, dout, dinp0, dw0, db0, accumulate):
    """Bounds of the layernorm kernel's outputs, carried through csrc/kernels/layernorm.c.
    Exact (float64) quantities: mu, Xh = (x - mu) R, R = 1 / sqrt(var + 1e-5), G = w dout."""
    x, w, b = f64(inp), f64(w), f64(b)
    N, C = x.shape
    mu = x.mean(1, keepdims=True)
    Vs = ((x - mu) ** 2).sum(1, keepdims=True)  # C var
    W = Vs / C + 1e-5
    R = 1 / np.sqrt(W)
    Xh = (x - mu) * R
    bd = {}
    # m0 = (sum x) / C: C - 1 additions and the division
    e_m0 = gamma(C) * np.abs(x).mean(1, keepdims=True)
    # m = m0 + (sum fl(x - m0)) / C: the exact sum of x - m0 is C (mu - m0), so only the
    # roundings of the C terms and their sum, on sum |x - m0| <= C (A + e_m0) with
    # A = mean |x - mu|: gamma(C); the division's u on |mu - m0| plus that, and
    # (1 + gamma(C)) (1 + u) - 1 <= gamma(C + 1); the final addition's u |m|, |m| <= |mu| + e_m
    A = np.abs(x - mu).mean(1, keepdims=True)
    e_m = (gamma(C + 1) * (A + e_m0) + U * e_m0 + U * np.abs(mu)) / (1 - U)
    bd["mean"] = e_m[:, 0]
    # v = sum fl(x - m)^2: the subtraction (counted twice, being squared), the square and
    # C - 1 additions: C + 2; and sum (x - m)^2 = Vs + C e_m^2 exactly since sum (x - mu) = 0:
    # the error of m enters the variance only squared (why the two passes need no more care)
    e_v = gamma(C + 2) * (Vs + C * e_m**2) + C * e_m**2
    # w = v / C + 1e-5f: the division and the addition round (2), 1e-5f != 1e-5;
    # r = 1 / sqrtf(w): half of w's relative error, and sqrtf and the division round (2)
    rel_w = (e_v / C + abs(EPS32 - 1e-5)) / W + gamma(2)
    rel_r = rel_w / 2 + gamma(2)
    bd["rstd"] = (rel_r * R)[:, 0]
    # xn = fl(fl(x - m) * r): the error of m times r, and x - m and the product round (2)
    eX = R * e_m + np.abs(Xh) * (rel_r + gamma(2))
    # out = xn * w + b: xn's error times |w|, the product and the sum round
    bd["out"] = np.abs(w) * (eX + U * np.abs(Xh)) + U * (np.abs(Xh * w) + np.abs(b))

    dy = f64(dout)
    G = w * dy
    MG = G.mean(1, keepdims=True)
    MGX = (G * Xh).mean(1, keepdims=True)
    Tm = G - MG - Xh * MGX  # dx = R Tm: its three terms cancel, the bound takes each |term|
    # mg = (sum w dy) / C: the product, C - 1 additions, the division
    e_mg = gamma(C + 1) * np.abs(G).mean(1, keepdims=True)
    # mgx = (sum (w dy) xn) / C: two products, C - 1 additions, the division; and xn's error
    e_mgx = (gamma(C + 2) * np.abs(G * Xh).sum(1, keepdims=True)
             + (np.abs(G) * eX).sum(1, keepdims=True)) / C
    # t = w dy - mg - xn * mgx: the errors of mg, mgx and xn, and w dy, the product and the
    # two subtractions round (<= 3 roundings on any |term|)
    e_t = (gamma(3) * (np.abs(G) + np.abs(MG) + np.abs(Xh * MGX))
           + e_mg + eX * np.abs(MGX) + np.abs(Xh) * e_mgx)
    # dx = r * t: r's relative error and the product on |R t|, plus t's error times R
    e_dx = R * e_t + R * np.abs(Tm) * (rel_r + U)
    if accumulate:  # dx += ...: one more rounding of the sum
        e_dx = e_dx + U * (np.abs(f64(dinp0)) + np.abs(R * Tm))
    bd["dinp"] = e_dx
    # dweight = dw0 + sum over N rows of dy * xn: the product and N additions, xn's error
    bd["dw"] = (gamma(N + 1) * (np.abs(f64(dw0)) + np.abs(dy * Xh).sum(0))
                + (np.abs(dy) * eX).sum(0))
    # dbias = db0 + N rows of dy: N additions
    bd["db"] = gamma(N) * (np.abs(f64(db0)) + np.abs(dy).sum(0))
    return bd


def _layernorm_case(kern, rng, N, C, inp=None):
    # a non-zero mean and a spread of scales per row: the two-pass variance must cope
    if inp is None:
        inp = (randn(rng, N, C) * rng.uniform(0.1, 5, (N, 1))
               + rng.uniform(-3, 3, (N, 1))).astype(np.float32)
    w, b = randn(rng, C), randn(rng, C)
    out = np.full((N, C), np.nan, np.float32)
    mean = np.full(N, np.nan, np.float32)
    rstd = np.full(N, np.nan, np.float32)
    kern.layernorm_forward(out, mean, rstd, inp, w, b, N, C)

    x_t, w_t, b_t = t64(inp, True), t64(w, True), t64(b, True)
    ref = F.layer_norm(x_t, (C,), w_t, b_t, eps=1e-5)
    x64 = f64(inp)
    dout = randn(rng, N, C)
    bd = _layernorm_bounds(inp, w, b, dout, 0, 0, 0, 0)
    close(out, ref, bd["out"], "layernorm out")
    close(mean, x64.mean(1), bd["mean"], "layernorm mean")
    close(rstd, 1 / np.sqrt(x64.var(1) + 1e-5), bd["rstd"], "layernorm rstd")

    ref.backward(t64(dout))
    for accumulate in (0, 1):
        dinp0 = randn(rng, N, C)
        dw0, db0 = randn(rng, C), randn(rng, C)
        dinp, dw, db = dinp0.copy(), dw0.copy(), db0.copy()
        kern.layernorm_backward(
            dinp, dw, db, dout, inp, w, mean, rstd, N, C, accumulate
        )
        # the backward reads the kernel's own mean and rstd: their errors are in the bound
        bd = _layernorm_bounds(inp, w, b, dout, dinp0, dw0, db0, accumulate)
        expect = f64(x_t.grad) + (f64(dinp0) if accumulate else 0)
        close(dinp, expect, bd["dinp"], f"layernorm dinp (accumulate={accumulate})")
        close(dw, f64(dw0) + f64(w_t.grad), bd["dw"], "layernorm dweight")
        close(db, f64(db0) + f64(b_t.grad), bd["db"], "layernorm dbias")


def test_layernorm_small(kern, rng):
    _layernorm_case(kern, rng, N=2 * 7, C=40)


def test_layernorm_gpt2_width(kern, rng):
    # C=768 float reductions, and dweight sums 64 rows of products
    _layernorm_case(kern, rng, N=64, C=768)


def test_layernorm_large_mean_small_spread(kern, rng):
    """Rows whose |mean| is 1e3..1e5 times their spread, and constant rows: the mean's
    rounding in the first sum (~C u |mean|, 5 ulp of 1e4 here) is corrected before x - mean,
    so each output stays within the bound of the corrected mean (it was 0.8 off on a constant
    row of 10000.1, rstd 46% off, beyond any bound carried from the rounded mean's error
    alone). A constant row normalises to its bias exactly: mean = x, rstd = 1/sqrt(eps)."""
    N, C = 6, 768
    inp = np.empty((N, C), np.float32)
    inp[0], inp[1], inp[2] = 10000.1, -123.456, 3.0
    inp[3] = 1e4 + 0.1 * rng.standard_normal(C)
    inp[4] = 300 + 0.01 * rng.standard_normal(C)
    inp[5] = -2e3 + 1.0 * rng.standard_normal(C)
    _layernorm_case(kern, rng, N, C, inp=inp)
    w, b = randn(rng, C), randn(rng, C)
    out, mean, rstd = np.empty((N, C), np.float32), np.empty(N, np.float32), np.empty(N, np.float32)
    kern.layernorm_forward(out, mean, rstd, inp, w, b, N, C)
    assert np.array_equal(mean[:3], inp[:3, 0])
    assert np.all(rstd[:3] == np.float32(1) / np.sqrt(np.float32(EPS32)))
    assert np.array_equal(out[:3], np.broadcast_to(b, (3, C)))


def test_column_sums_ragged_chunks(kern, rng):
    # the GPU's two-pass column sums (gpu.h) on ragged edges: N = 1001 rows in 8 chunks of
    # 126 (the last 119), C = 40 and OC = 72 columns (a partial column tile)
    _layernorm_case(kern, rng, N=1001, C=40)
    _matmul_case(kern, rng, N=1001, C=24, OC=72, use_bias=True)


# ---------------------------------------------------------------- matmul


def _matmul_case(kern, rng, N, C, OC, use_bias, dot=dot_bound):
    """matmul forward and backward against float64; dot(n, |terms|) the bound of a GEMM entry
    of reduction length n (fp32: dot_bound; TF32: bounds.tf32_dot_bound)."""
    inp, weight = randn(rng, N, C), randn(rng, OC, C, scale=1 / math.sqrt(C))
    bias = randn(rng, OC) if use_bias else None
    out = np.full((N, OC), np.nan, np.float32)
    kern.matmul_forward(out, inp, weight, bias if use_bias else None, N, C, OC)
    x_t, w_t = t64(inp, True), t64(weight, True)
    b_t = t64(bias, True) if use_bias else None
    ref = F.linear(x_t, w_t, b_t)
    ax, aw = np.abs(f64(inp)), np.abs(f64(weight))
    # sgemm: C products summed (gamma(C), any blocking or kernel), then + bias (1 rounding)
    if use_bias:
        close(out, ref, dot(C + 1, ax @ aw.T + np.abs(f64(bias))), "matmul out")
    else:
        close(out, ref, dot(C, ax @ aw.T), "matmul out")

    dout = randn(rng, N, OC)
    ref.backward(t64(dout))
    dinp = np.full((N, C), np.nan, np.float32)  # written, not accumulated
    dw0 = randn(rng, OC, C)
    dw = dw0.copy()
    db0 = randn(rng, OC)
    db = db0.copy()
    kern.matmul_backward(
        dinp, dw, db if use_bias else None, dout, inp, weight, N, C, OC
    )
    ady = np.abs(f64(dout))
    # dinp = dout @ weight: OC products
    close(dinp, x_t.grad, dot(OC, ady @ aw), "matmul dinp")
    # dweight = dw0 + dout^T @ inp (beta = 1): N products and the old value, N + 1 terms
    close(dw, f64(dw0) + f64(w_t.grad), dot(N + 1, np.abs(f64(dw0)) + ady.T @ ax),
          "matmul dweight")
    if use_bias:
        # dbias = db0 + the N rows of dout: N additions
        close(db, f64(db0) + f64(b_t.grad), dot_bound(N, np.abs(f64(db0)) + ady.sum(0)),
              "matmul dbias")
    else:
        assert np.array_equal(db, db0)
    return dict(dinp=dinp, dw=dw, db=db, dout=dout, inp=inp, weight=weight, dw0=dw0, db0=db0)


@pytest.mark.parametrize("use_bias", [True, False])
def test_matmul_small(kern, rng, use_bias):
    _matmul_case(kern, rng, N=2 * 5, C=24, OC=72, use_bias=use_bias)


@pytest.mark.parametrize("C,OC", [(768, 2304), (3072, 768)])
def test_matmul_gpt2_width(kern, rng, C, OC):
    # sgemm sums of 768..3072 products in fp32
    _matmul_case(kern, rng, N=64, C=C, OC=OC, use_bias=True)


# decoding's few rows (N <= SL_MATMUL_FEW_ROWS, kernels.h): the CPU's own kernel instead of sgemm,
# its tiles of 4 input rows x 4 weight rows with their tails (N % 4, OC % 4, C % 16)
@pytest.mark.parametrize("N,C,OC", [(1, 40, 14), (3, 40, 14), (5, 40, 14), (16, 3072, 771),
                                    (lib.SL_MATMUL_FEW_ROWS, 768, 2304)])
def test_matmul_few_rows(kern, rng, N, C, OC):
    _matmul_case(kern, rng, N=N, C=C, OC=OC, use_bias=True)


def test_matmul_few_rows_alone_or_together(rng):
    # a row's output is the same bits alone or with other rows (a sequence decoded alone or in
    # a batch of the server's: the same answer)
    kern = CPUKernels()
    N, C, OC = lib.SL_MATMUL_FEW_ROWS, 776, 70
    inp, weight, bias = randn(rng, N, C), randn(rng, OC, C), randn(rng, OC)
    out = np.full((N, OC), np.nan, np.float32)
    kern.matmul_forward(out, inp, weight, bias, N, C, OC)
    for n in (1, 3, 4, 7):
        part = np.full((n, OC), np.nan, np.float32)
        kern.matmul_forward(part, inp[-n:].copy(), weight, bias, n, C, OC)
        assert np.array_equal(part, out[-n:]), f"the last {n} rows alone differ"



# A fresh process: k-thread GEMMs after kernels_set_threads(k), the CPU time each of the
# process's threads spent in them (/proc/self/task/*/stat: utime + stime, in clock ticks) and
# the threads the process gained. Prints: threads gained, threads that did a share, BLAS name.
_GEMM_THREADS = r"""
import os, sys
import numpy as np
from starpu_llm._kernels import ffi, lib

def ticks():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        out[tid] = int(fields[11]) + int(fields[12])
    return out

k = int(sys.argv[1])
N, C, OC = 512, 768, 3072                     # one training matmul: ~2.4 GFLOP a call
rng = np.random.default_rng(0)
inp = rng.standard_normal((N, C), dtype=np.float32)
weight = rng.standard_normal((OC, C), dtype=np.float32)
out = np.empty((N, OC), np.float32)
p = lambda a: ffi.cast("float *", a.ctypes.data)
before = ticks()
lib.kernels_set_threads(k)
for _ in range(60):
    lib.matmul_forward(p(out), p(inp), p(weight), ffi.NULL, N, C, OC)
after = ticks()
spent = {t: after[t] - before.get(t, 0) for t in after}
busy = [t for t in spent if spent[t] >= sum(spent.values()) / (4 * k)]
print(len(after) - len(before), len(busy), ffi.string(lib.blas_name()).decode())
"""


def test_a_k_thread_gemm_runs_on_k_threads_and_no_other_pool():
    """The threads promise at the BLAS (docs/clusters.md): after kernels_set_threads(k), as a
    k-core task's codelet calls it, a GEMM runs on k threads, each doing a share, and they are
    the caller's OpenMP team: the process gains k - 1 threads, not a pool of the BLAS's own
    (OpenBLAS's pthread build, MKL under Intel's OpenMP: a second runtime, its threads beside
    libgomp's). Whichever BLAS this build links (tools/test-matrix.sh's mkl cell checks MKL)."""
    k = min(2, len(os.sched_getaffinity(0)))
    r = subprocess.run([sys.executable, "-c", _GEMM_THREADS, str(k)], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    gained, busy, name = r.stdout.strip().split(" ", 2)
    assert (int(gained), int(busy)) == (k - 1, k), \
        f"{name}: {k}-thread GEMMs: the process gained {gained} thread(s), {busy} did a share"


FEW_ROWS_CHECK = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
void matmul_forward(float *out, const float *inp, const float *weight, const float *bias, int N,
		    int C, int OC);
void cblas_sgemm() { abort(); }		/* N <= 16: never called */
int main(void) {
	static const int shapes[][3] = { {16, 776, 70}, {5, 40, 14}, {1, 3072, 771}, {13, 768, 37},
					 {3, 19, 5}, {16, 3072, 9} };
	unsigned long long h = 1469598103934665603ULL, x = 7;
	for (int s = 0; s < 6; s++) {
		int N = shapes[s][0], C = shapes[s][1], OC = shapes[s][2];
		float *in = malloc(4 * (size_t)N * C), *w = malloc(4 * (size_t)OC * C);
		float *o = malloc(4 * (size_t)N * OC), *o1 = malloc(4 * (size_t)OC);
		for (size_t i = 0; i < (size_t)N * C + (size_t)OC * C; i++) {
			x = x * 6364136223846793005ULL + 1442695040888963407ULL;
			float *v = i < (size_t)N * C ? &in[i] : &w[i - (size_t)N * C];
			*v = (float)(x >> 40) / 16777216.0f - 0.5f;
		}
		matmul_forward(o, in, w, NULL, N, C, OC);
		for (size_t i = 0; i < 4 * (size_t)N * OC; i++)
			h = (h ^ ((unsigned char *)o)[i]) * 1099511628211ULL;
		for (int r = 0; r < N; r++) {	/* each row alone: the same bits */
			matmul_forward(o1, in + (size_t)r * C, w, NULL, 1, C, OC);
			if (memcmp(o1, o + (size_t)r * OC, 4 * (size_t)OC) != 0)
				printf("alone-differs shape %d row %d\n", s, r);
		}
	}
	printf("%016llx\n", h);
	return 0;
}
"""


def test_matmul_few_rows_same_bits_at_every_vector_width(tmp_path):
    """The few-rows kernel computes each entry by one sequence of operations whatever its vector
    width and tile (csrc/kernels/matmul.c): built with the system compiler for AVX2 with 8-float
    halves in 2 x 2 tiles and with 16-float vectors in 4 x 4 tiles (SL_FEW_ROWS_WIDTH), and for
    AVX-512 where this CPU has it, the outputs of shapes with every tail are the same bits, and
    each row alone gives its row of the batch. Fails if a width sums the lanes in another order."""
    import shutil
    cpu = open("/proc/cpuinfo").read()
    if " avx2 " not in cpu or " fma " not in cpu:
        pytest.skip("this CPU has no AVX2/FMA to run the builds")
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    assert cc, "no C compiler: the package itself needs one"
    (tmp_path / "cblas.h").write_text("void cblas_sgemm();\nenum { CblasRowMajor, CblasNoTrans, "
                                      "CblasTrans };\n")     # matmul.c's sgemm calls compile
    src = tmp_path / "few_rows_check.c"
    src.write_text(FEW_ROWS_CHECK)
    kernels = os.path.join(os.path.dirname(__file__), "..", "csrc", "kernels")
    builds = {"avx2, 8-float halves, 2 x 2": ["-mavx2", "-mfma", "-DSL_FEW_ROWS_WIDTH=8"],
              "avx2, 16-float vectors, 4 x 4": ["-mavx2", "-mfma", "-DSL_FEW_ROWS_WIDTH=16"]}
    if " avx512f " in cpu:
        builds["avx512, 4 x 4"] = ["-mavx512f", "-mavx2", "-mfma"]
    out = {}
    for name, flags in builds.items():
        exe = tmp_path / f"check{len(out)}"
        subprocess.run([cc, "-O2", "-fopenmp", *flags, "-I", str(tmp_path), "-I", kernels,
                        str(src), os.path.join(kernels, "matmul.c"), "-o", str(exe)], check=True)
        out[name] = subprocess.run([str(exe)], capture_output=True, text=True,
                                   env={**os.environ, "OMP_NUM_THREADS": "2"},
                                   check=True).stdout
    for name, text in out.items():
        assert "alone-differs" not in text, (name, text)
    assert len(set(out.values())) == 1, out

ATTEND_CHECK = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "attend.h"
/* attend() on fixed pseudo-random data, every output's bits printed */
static float rnd(unsigned *s) { *s = *s * 1103515245u + 12345u; return (float)(*s >> 8) / (1 << 24) - 0.5f; }
int main(void)
{
	static const int hss[] = { 16, 32, 64, 128, 48, 24 }, ns[] = { 1, 3, 4, 5, 17, 100, 1024 };
	unsigned seed = 7;
	for (int a = 0; a < 6; a++)
		for (int b = 0; b < 7; b++) {
			int hs = hss[a], n = ns[b];
			size_t stride = 3 * (size_t)hs + 5;
			float *k = malloc(n * stride * 4), *v = malloc(n * stride * 4), *q = malloc(hs * 4);
			float *o = malloc(hs * 4), *p = malloc(n * 4);
			for (size_t i = 0; i < n * stride; i++) { k[i] = 4 * rnd(&seed); v[i] = rnd(&seed); }
			for (int i = 0; i < hs; i++) q[i] = rnd(&seed);
			attend(o, p, p, q, k, v, stride, n, hs, 0.125f);
			unsigned u;
			for (int i = 0; i < hs; i++) { memcpy(&u, o + i, 4); printf("%08x", u); }
			for (int j = 0; j < n; j++) { memcpy(&u, p + j, 4); printf("%08x", u); }
			printf("\n");
			free(k); free(v); free(q); free(o); free(p);
		}
	return 0;
}
"""


def _vector_and_generic(tmp_path, check_source, *sources):
    """{build: (stdout of the vector paths, of the generic loops)}: check_source (with
    csrc/kernels' sources) built at -O3 as the package builds, then with SL_ATTEND_GENERIC, for
    this CPU (-march=native; 512-bit vectors preferred, as GCC does on AMD's AVX-512 and not by
    default on Intel's: the paths' width with AVX-512) and, where it has AVX2 and FMA, for
    Haswell (the paths' 8-float vectors)."""
    import shutil
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    assert cc, "no C compiler: the package itself needs one"
    src = tmp_path / "check.c"
    src.write_text(check_source)
    kernels = os.path.join(os.path.dirname(__file__), "..", "csrc", "kernels")
    cpu = open("/proc/cpuinfo").read()
    builds = {"native": ["-march=native", "-mprefer-vector-width=512"]}
    if " avx2 " in cpu and " fma " in cpu:
        builds["haswell"] = ["-march=haswell"]
    out = {}
    for name, march in builds.items():
        for flags in ([], ["-DSL_ATTEND_GENERIC"]):
            exe = tmp_path / f"check-{name}{len(flags)}"
            subprocess.run([cc, "-O3", *march, "-fopenmp", *flags, "-I", kernels, str(src),
                            *(os.path.join(kernels, f) for f in sources), "-lm", "-o", str(exe)],
                           check=True)
            out.setdefault(name, []).append(subprocess.run(
                [str(exe)], capture_output=True, text=True, check=True,
                env={**os.environ, "OMP_NUM_THREADS": "2"}).stdout)
    return out


def test_attend_vector_path_gives_the_generic_loops_bits(tmp_path):
    """csrc/kernels/attend.h's vector path (four keys' lane sums side by side, the output in
    registers; 16-float vectors with AVX-512, 8-float with AVX2) against its generic loop: the
    same bits for every head size it takes (16 to 128), two it leaves to the loop (48, 24), and
    key counts with every tail of four, training's and decoding's
    one query. Fails if the path sums a key's lanes or a value's terms in another order."""
    for build, (vectors, loop) in _vector_and_generic(tmp_path, ATTEND_CHECK).items():
        assert vectors.count("\n") == 42 and vectors == loop, build


ATTENTION_CHECK = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "kernels.h"
/* attention_forward and attention_backward on fixed pseudo-random data: a hash of every
 * output's bits for each shape */
static float rnd(unsigned *s) { *s = *s * 1103515245u + 12345u; return (float)(*s >> 8) / (1 << 24) - 0.5f; }
static unsigned long fold(unsigned long h, const float *x, size_t n)
{
	unsigned u;
	for (size_t i = 0; i < n; i++) { memcpy(&u, x + i, 4); h = (h ^ u) * 1099511628211ul; }
	return h;
}
int main(void)
{
	static const int shapes[][4] = { { 2, 37, 64, 4 }, { 1, 70, 768, 12 }, { 2, 21, 64, 1 },
					 { 1, 33, 256, 2 }, { 2, 19, 48, 1 }, { 1, 9, 64, 2 } };
	for (int c = 0; c < 6; c++) {
		int B = shapes[c][0], T = shapes[c][1], C = shapes[c][2], NH = shapes[c][3];
		size_t nq = (size_t)B * T * 3 * C, no = (size_t)B * T * C, na = (size_t)B * NH * T * T;
		float *qkv = malloc(nq * 4), *dqkv = malloc(nq * 4), *out = malloc(no * 4);
		float *dout = malloc(no * 4), *att = malloc(na * 4), *datt = malloc(na * 4);
		float *dp = malloc(na * 4);
		unsigned seed = 11 + c;
		for (size_t i = 0; i < nq; i++) qkv[i] = 2 * rnd(&seed);
		for (size_t i = 0; i < no; i++) dout[i] = rnd(&seed);
		attention_forward(out, att, qkv, B, T, C, NH);
		attention_backward(dqkv, dp, datt, dout, qkv, att, B, T, C, NH);
		printf("%016lx %016lx", fold(1469598103934665603ul, out, no),
		       fold(1469598103934665603ul, dqkv, nq));
		/* the fused attention (att: the logsumexp, datt: dsum) */
		attention_flash_forward(out, att, qkv, B, T, C, NH);
		attention_flash_backward(dqkv, datt, dout, qkv, out, att, B, T, C, NH);
		printf(" %016lx %016lx %016lx\n", fold(1469598103934665603ul, out, no),
		       fold(1469598103934665603ul, att, (size_t)B * NH * T),
		       fold(1469598103934665603ul, dqkv, nq));
		free(qkv); free(dqkv); free(out); free(dout); free(att); free(datt); free(dp);
	}
	return 0;
}
"""


def test_attention_vector_paths_give_the_generic_loops_bits(tmp_path):
    """The forward's and the backward's vector paths (attend.h's attend_vectors;
    attention.c's backward_query_*: four keys' lane sums side by side, dq in registers), and
    the fused attention's (flash_query_forward, flash_query_dq, flash_key_dkv), against their
    generic loops, with AVX-512 and with AVX2, on head sizes the paths take (16, 32, 64, 128)
    and one they leave to the loops (48), sequences ending inside a tile of keys: the same bits
    of out, the logsumexp and dqkv."""
    for build, (vectors, loop) in _vector_and_generic(tmp_path, ATTENTION_CHECK,
                                                      "attention.c", "flash.c").items():
        assert vectors.count("\n") == 6 and vectors == loop, (build, vectors, loop)


# ---------------------------------------------------------------- TF32, production shapes


@pytest.fixture(params=["cpu", "gpu", "gpu-tf32"])
def kern_prec(request):
    """(kernels, GEMM bound): the CPU kernels and the GPU ones in fp32 (dot_bound), the GPU
    ones in TF32 (tf32_dot_bound: the emulation rounds the GEMMs' inputs to TF32)."""
    if request.param == "cpu":
        return CPUKernels(), dot_bound
    why = gpu_available()
    if why:
        pytest.skip(why)
    if request.param == "gpu":
        return GPUKernels(), dot_bound
    return GPUKernels(tf32=True), tf32_dot_bound


@pytest.mark.parametrize("C,OC", [(768, 2304), (3072, 768)])
def test_matmul_production_shape(kern_prec, rng, C, OC):
    """GPT-2 124M's matmuls at B = 1, T = 1024 (N = 1024 rows), forward and backward, in fp32
    and TF32, each within its GEMM bound."""
    kern, dot = kern_prec
    _matmul_case(kern, rng, N=1024, C=C, OC=OC, use_bias=True, dot=dot)


def _round_significand(a, bits, mode):
    """float32 a with `bits` explicit significand bits: "nearest" (ties away, as
    cvt.rna.tf32.f32) or "truncate"."""
    u = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
    drop = 23 - bits
    if mode == "nearest":
        u = u + (1 << (drop - 1))
    return (u & ~np.uint64((1 << drop) - 1)).astype(np.uint32).view(np.float32)


def _adversarial(rng, shape, bits, frac):
    """Positive values in [1, 1.25) 2^e whose `bits`-bit rounding to nearest moves each down by
    frac of a `bits`-bit ulp (a representable value plus frac ulp): every product's rounding
    error of one sign, so a GEMM's error adds up instead of cancelling (the worst case the
    bound covers, nearly)."""
    e = rng.integers(-3, 3, size=shape).astype(np.float64)
    m = _round_significand(rng.uniform(1.0, 1.25, size=shape), bits, "truncate").astype(np.float64)
    return ((m + frac * 2.0 ** -bits) * 2.0 ** e).astype(np.float32)


def test_tf32_gemm_bound_can_fail_on_the_gpu_kernels(rng):
    """The TF32 GEMM bound (bounds.tf32_dot_bound: inputs rounded to nearest TF32, unit
    roundoff 2^-11) on inputs that make every product's rounding error one-signed:
      - the GPU matmul in TF32 (the emulation rounds as cvt.rna.tf32) is within it, and
        outside the fp32 bound (the TF32 rounding did happen); also on inputs that only
        rounding to nearest keeps within it (on a GPU: cuBLAS's conversion is not truncation);
      - it fails for a GEMM that truncates to TF32 instead (errors up to 2^-10 an input:
        about 1.7x the bound here), and for a bf16-like rounding (7 bits, to nearest)."""
    why = gpu_available()
    if why:
        pytest.skip(why)
    N, C, OC = 64, 768, 96
    inp = _adversarial(rng, (N, C), 10, 0.45)
    weight = _adversarial(rng, (OC, C), 10, 0.45)
    ref = f64(inp) @ f64(weight).T
    terms = np.abs(f64(inp)) @ np.abs(f64(weight)).T
    out = np.full((N, OC), np.nan, np.float32)
    GPUKernels(tf32=True).matmul_forward(out, inp, weight, None, N, C, OC)
    close(out, ref, tf32_dot_bound(C, terms), "TF32 matmul")
    with pytest.raises(AssertionError):
        close(out, ref, dot_bound(C, terms), "TF32 matmul against the fp32 bound")
    # a deliberately wrong TF32: truncation, on inputs 0.95 of an ulp above a TF32 value
    a, w = _adversarial(rng, (N, C), 10, 0.95), _adversarial(rng, (OC, C), 10, 0.95)
    # the GPU matmul on them within the bound: the inputs above (0.45 ulp) round down either
    # way, these tell rounding to nearest from truncation, so that on a GPU this checks the
    # bound's premise about cuBLAS's (undocumented) TF32 conversion
    out = np.full((N, OC), np.nan, np.float32)
    GPUKernels(tf32=True).matmul_forward(out, a, w, None, N, C, OC)
    close(out, f64(a) @ f64(w).T, tf32_dot_bound(C, np.abs(f64(a)) @ np.abs(f64(w)).T),
          "TF32 matmul, inputs 0.95 of a TF32 ulp above one")
    trunc = (f64(_round_significand(a, 10, "truncate"))
             @ f64(_round_significand(w, 10, "truncate")).T)
    with pytest.raises(AssertionError):
        close(trunc, f64(a) @ f64(w).T, tf32_dot_bound(C, np.abs(f64(a)) @ np.abs(f64(w)).T),
              "TF32 by truncation")
    # bf16-like: 7 bits to nearest, on inputs 0.45 of its ulp above a 7-bit value
    a, w = _adversarial(rng, (N, C), 7, 0.45), _adversarial(rng, (OC, C), 7, 0.45)
    bf = f64(_round_significand(a, 7, "nearest")) @ f64(_round_significand(w, 7, "nearest")).T
    with pytest.raises(AssertionError):
        close(bf, f64(a) @ f64(w).T, tf32_dot_bound(C, np.abs(f64(a)) @ np.abs(f64(w)).T),
              "bf16-like rounding")


# ---------------------------------------------------------------- reductions at B T = 8192 rows

H100_SMS = 132


def _grids():
    """The block counts of the emulation's launches since the last call."""
    blocks = ffi.new("unsigned[64]")
    n = lib.sl_gpu_emulated_launches(blocks, 64)
    return list(blocks)[:min(n, 64)]


def _emulated_only():
    why = gpu_available()
    if why:
        pytest.skip(why)
    if not lib.sl_gpu_emulated():
        pytest.skip("the launch grids are read from the CPU emulation (a CUDA build runs them)")


def test_column_sums_8192_rows_fill_the_gpu(rng):
    """Layernorm's dweight/dbias and matmul's dbias over N = 8192 rows (B T = 8 x 1024) of
    C = 768 columns: within the fp32 bound of float64 (gamma(N + 1): any order), the same bits
    on a second run, and the pass over the N x C input in at least 4 blocks per SM of an
    H100 (the column tiles alone were 24 blocks)."""
    _emulated_only()
    kern = GPUKernels()
    N, C = 8192, 768
    _grids()
    # layernorm: forward, backward written and accumulated, each within its bounds
    _layernorm_case(kern, rng, N=N, C=C)
    big = [b for b in _grids() if b >= 4 * H100_SMS]
    # the forward's rows, then each backward's rows and its column sums' first pass
    assert len(big) >= 5, f"launches of >= {4 * H100_SMS} blocks: {big}"
    inp, w = randn(rng, N, C), randn(rng, C)
    mean, rstd = np.zeros(N, np.float32), np.zeros(N, np.float32)
    kern.layernorm_forward(np.zeros((N, C), np.float32), mean, rstd, inp, w, w, N, C)
    dout = randn(rng, N, C)
    runs = []
    for _ in range(2):
        dinp = np.zeros((N, C), np.float32)
        dw, db = np.zeros(C, np.float32), np.zeros(C, np.float32)
        kern.layernorm_backward(dinp, dw, db, dout, inp, w, mean, rstd, N, C, 0)
        runs.append((dinp, dw, db))
    for a, b in zip(*runs):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), "layernorm backward bits"
    # matmul's dbias (C = 32 inputs: the GEMMs small), within gamma(N) inside _matmul_case
    _grids()
    r = _matmul_case(kern, rng, N=N, C=32, OC=C, use_bias=True)
    assert max(_grids()) >= 4 * H100_SMS, "matmul dbias: one block a column tile"
    db = r["db0"].copy()
    kern.matmul_backward(np.zeros((N, 32), np.float32), r["dw0"].copy(), db, r["dout"], r["inp"],
                         r["weight"], N, 32, C)
    assert np.array_equal(db.view(np.uint32), r["db"].view(np.uint32)), "matmul dbias bits"


# ---------------------------------------------------------------- wte in row blocks


@pytest.mark.parametrize("nb", [2, 3, 7])
def test_row_blocks_agree_with_one_block(kern, rng, nb):
    """The codelets that use the tied wte given it in nb row blocks (the embedding, the lm
    head's matmul forward and backward: codelets.DirectOps, i.e. the codelet bodies on their
    buffers) against the same codelets given it whole. Vp = 203 rows in blocks of unequal
    sizes (config.row_blocks), tokens on the blocks' edges and repeated.
      - embedding, forward and backward: the same additions in the same order whatever the
        blocks, so equal to the bit (bound 0);
      - logits: each entry is the same C-term dot product in both (a block's sgemm writes its
        columns): each within gamma(C) sum|terms| of the exact value, so 2 gamma(C) apart;
      - dlnf = sum over the blocks of dlogits[:, block] @ wte_block, the blocks' sgemms added
        in order: a sum of the same Vp products in another order. Along any product's path
        at most Vp roundings (its product, rows_b - 1 additions in its block, nb - 1 of the
        blocks' partial sums; rows_b + nb - 1 <= Vp), so gamma(Vp) for each, 2 gamma(Vp)
        apart;
      - dwte: each row block's rows are the same N-term sums plus the old value, gamma(N + 1)
        each."""
    from starpu_llm.kernels.codelets import DirectOps
    from starpu_llm.model.config import row_blocks
    from starpu_llm.flow.tensors import Tensor
    B, T, C, Vp, maxT = 3, 8, 40, 203, 16
    N = B * T
    edges = [e for a, e in row_blocks(Vp, nb)][:-1]
    inp = rng.integers(0, Vp, size=(B, T)).astype(np.int32)
    inp.reshape(-1)[:2 * len(edges)] = [v for e in edges for v in (e - 1, e)]
    inp[2, :3] = inp[0, 0]                                  # repeated ids
    wte, wpe = randn(rng, Vp, C, scale=1 / math.sqrt(C)), randn(rng, maxT, C)
    lnf, dlogits = randn(rng, N, C), randn(rng, N, Vp)
    dwte0, dwpe0 = randn(rng, Vp, C), randn(rng, maxT, C)

    def t(name, a):
        return Tensor(name, a.shape, a.dtype, array=a)

    def run(blocks):
        """(encoded, dwte, dwpe, logits, dlnf, dwte after the head) with wte in `blocks`."""
        w, dw = wte.copy(), dwte0.copy()
        wb = [t(f"wte[{b}]", w[a:e]) for b, (a, e) in enumerate(blocks)]
        dwb = [t(f"dwte[{b}]", dw[a:e]) for b, (a, e) in enumerate(blocks)]
        out = {k: np.full(shape, np.nan, np.float32) for k, shape in
               (("encoded", (B, T, C)), ("logits", (N, Vp)), ("dlnf", (N, C)))}
        dwpe = dwpe0.copy()
        ops = DirectOps(gpu=kern.name == "gpu")
        ops.encoder_forward(t("encoded", out["encoded"]), t("inp", inp), wb, t("wpe", wpe),
                            B, T, C)
        # generation's embedding of the same tokens, given as rows (token, slot, position)
        # in reverse order: the same additions, row by row
        idx = np.stack([inp.reshape(-1), np.zeros(N, np.int64), np.tile(np.arange(T), B)],
                       axis=1)[::-1].astype(np.int32).copy()
        rows = np.full((N, C), np.nan, np.float32)
        ops.encoder_decode(t("rows", rows), t("idx", idx), wb, t("wpe", wpe), N, C)
        assert np.array_equal(rows[::-1].reshape(B, T, C), out["encoded"]), "encoder_decode"
        ops.matmul_forward(t("logits", out["logits"]), t("lnf", lnf), wb, None, N, C, Vp)
        ops.encoder_backward(dwb, t("dwpe", dwpe), t("dout", out["encoded"]), t("inp", inp),
                             B, T, C)
        encoder_dwte = dw.copy()
        ops.matmul_backward(t("dlnf", out["dlnf"]), dwb, t("dlogits", dlogits), t("lnf", lnf),
                            wb, None, N, C, Vp)
        return out["encoded"], encoder_dwte, dwpe, out["logits"], out["dlnf"], dw

    one, blocked = run([(0, Vp)]), run(row_blocks(Vp, nb))
    for what, a, b in zip(("encoded", "encoder dwte", "dwpe"), one[:3], blocked[:3]):
        assert np.array_equal(a, b), what
    aw, al, ad = np.abs(f64(wte)), np.abs(f64(lnf)), np.abs(f64(dlogits))
    close(blocked[3], one[3], 2 * dot_bound(C, al @ aw.T), "logits")
    close(blocked[4], one[4], 2 * dot_bound(Vp, ad @ aw), "dlnf")
    close(blocked[5], one[5], 2 * dot_bound(N + 1, np.abs(f64(one[1])) + ad.T @ al), "dwte")


# ---------------------------------------------------------------- attention


def _attention_ref(qkv_t, B, T, C, NH):
    hs = C // NH
    q, k, v = qkv_t.split(C, dim=2)
    q, k, v = (z.view(B, T, NH, hs).transpose(1, 2) for z in (q, k, v))  # (B,NH,T,hs)
    preatt = (q @ k.transpose(-2, -1)) / math.sqrt(hs)
    mask = torch.ones(T, T, dtype=torch.bool).triu(1)
    preatt_m = preatt.masked_fill(mask, float("-inf"))
    att = torch.softmax(preatt_m, dim=-1)
    out = (att @ v).transpose(1, 2).reshape(B, T, C)
    return out, preatt, att, mask


def _attention_bounds(qkv, dout, B, T, C, NH, tile=None, tf32=False):
    """Bounds of the attention kernels' outputs, carried through csrc/kernels/attention.c in
    float64 per (b, h): Q, K, V, dY (B,NH,T,hs), exact scores P, att A, datt DA, dpreatt DP.
    tile: the fused attention's (attention_flash_*, tiles of `tile` keys) instead of the
    batched-GEMM one's. tf32: the fused attention's products on tensor cores (its TF32
    kernels, attention.cu): each product's two operands rounded to TF32 (tf32_gamma for
    gamma on its terms), the softmax as in fp32."""
    assert not tf32 or tile is not None
    hs = C // NH
    # a product's relative bound on its terms: fp32's, or TF32's (operands rounded first)
    prod = tf32_gamma if tf32 else gamma
    Q, K, Vv = f64(qkv).reshape(B, T, 3, NH, hs).transpose(2, 0, 3, 1, 4)
    dY = f64(dout).reshape(B, T, NH, hs).transpose(0, 2, 1, 3)
    aQ, aK, aV, adY = (np.abs(z) for z in (Q, K, Vv, dY))
    tT = lambda z: z.swapaxes(-1, -2)  # noqa: E731
    causal = np.tril(np.ones((T, T), bool))
    n = np.arange(1, T + 1, dtype=np.float64)[:, None]  # query t sees n = t + 1 keys
    scale = 1 / math.sqrt(hs)
    P = np.where(causal, Q @ tT(K) * scale, -np.inf)
    Pmax = P.max(-1, keepdims=True)
    Z = np.where(causal, P - Pmax, 0.0)
    A = np.where(causal, np.exp(Z), 0.0)
    A /= A.sum(-1, keepdims=True)
    bd = {}
    # pre = fl(fl(q . k) * scale), scale = 1.0f / sqrtf(hs): hs products-and-sums, the scale
    # (2 roundings) and the product: gamma(hs + 3) on sum|q k| / sqrt(hs)
    e_pre = np.where(causal, prod(hs + 3) * (aQ @ tT(aK)) * scale, 0.0)
    if tile is None:
        bd["preatt"] = e_pre
        # exp's argument fl(pre - max): the score's own error (an error of the max shifts the
        # whole row and cancels in the normalisation) and the subtraction's rounding; vexpf's
        # 2 ulp
        phi = exp_rel(e_pre + U * np.abs(Z))
        # normalisation: t additions of t + 1 exps, 1 / sum, * inv: gamma(n + 1)
        e_att = np.where(causal, softmax_bound(A, phi, gamma_n(n + 1)), 0.0)
        bd["att"] = e_att
        bd["rowsum"] = gamma_n(n + 1)[:, 0]  # sum_j e_j inv / sum = 1 up to those roundings
        # out = sum_t2 a[t2] v[t2]: a's error times |v|, and n products accumulated onto 0
        e_out = e_att @ aV + gamma_n(n) * (A @ aV)
    else:
        # Online softmax over nt = ceil(n / tile) tiles. Key j of tile k gets exp(s_j - m_k)
        # (m_k the running max then), times the rescalings exp(m_k' - m_k'+1) of the later
        # tiles, each computed once and applied to both l and o. Their arguments' roundings add
        # up to U (m_k - s_j) + U (M - m_k) = U |Z_j| (M the row max, s_j <= m_k <= M), their
        # exps' 2 ulp to at most nt - 1 more of vexpf's; the rescalings' products round o's
        # partial sums (nt roundings, on the weights of o) and l's (in the normalisation with
        # l's n additions: gamma(n + nt)); o / l is one more rounding on out.
        nt = np.ceil(n / tile)
        phi = exp_rel(e_pre + U * np.abs(Z) + (nt - 1) * VEXPF_REL)
        g_l = gamma_n(n + nt)
        phi_o = (1 + phi) * (1 + gamma_n(nt)) - 1
        e_w = np.where(causal, softmax_bound(A, phi_o, g_l), 0.0)
        e_out = e_w @ aV + gamma_n(n + 1) * (A @ aV)
        if tf32:   # the weights and v rounded to TF32 for p v: on |w| |v|, |w| <= A + e_w
            e_out += (prod(0) + gamma_n(n + 1) * prod(0)) * ((A + e_w) @ aV)
        # lse = fl(m + fl(log l)): m is a computed score (an error <= the row's largest score
        # error, which moves the logsumexp by at most as much), l's relative error
        # eps <= sum_j A_j phi_j + g_l, log's 1 ulp of log l, the add's rounding
        eps = np.where(causal, A * phi, 0.0).sum(-1, keepdims=True) + g_l
        assert np.all(eps < 0.5)
        logl = np.log(np.where(causal, np.exp(Z), 0.0).sum(-1, keepdims=True))
        LSE = Pmax + logl
        e_lse = e_pre.max(-1, keepdims=True) + eps / (1 - eps) + 2 * U * logl + U * np.abs(LSE)
        bd["lse"] = e_lse[..., 0]
        # the backward's weights a = exp(fl(s - lse)): the score's and lse's errors, the
        # subtraction's rounding, vexpf's 2 ulp (and its flush to 0 below e^-87)
        phi_b = exp_rel(e_pre + e_lse + U * np.abs(np.where(causal, P - LSE, 0.0)))
        e_att = np.where(causal, A * phi_b + EXP_FLOOR, 0.0)
    bd["out"] = e_out.transpose(0, 2, 1, 3).reshape(B, T, C)

    # backward, with the kernel's att (error e_att) as its input
    DA = np.where(causal, dY @ tT(Vv), 0.0)
    # datt = dy . v: hs products
    e_datt = np.where(causal, prod(hs) * (adY @ tT(aV)), 0.0)
    bd["datt"] = e_datt
    # dv[t2] = sum_{t >= t2} a[t, t2] dy[t]: a's error, and <= T products onto 0
    e_dv = (1 + prod(T) - gamma(T)) * (tT(e_att) @ adY) + prod(T) * (tT(A) @ adY)
    # s = sum a da, dp = a (da - s): da - s cancels for a peaked softmax, so the roundings are
    # bounded on |da| + |s| and s's on sum a |da|, never on the result
    S = (A * DA).sum(-1, keepdims=True)
    if tile is None:
        # s: n products of a (error e_att) and da (error e_datt)
        e_s = ((e_att * np.abs(DA) + A * e_datt).sum(-1, keepdims=True)
               + gamma_n(n) * (A * np.abs(DA)).sum(-1, keepdims=True))
    else:
        # the fused backward's s = dy . out (hs products; out's error e_out), = sum a da exactly
        Out = A @ Vv
        e_s = ((adY * e_out).sum(-1, keepdims=True)
               + gamma(hs) * (adY * np.abs(Out)).sum(-1, keepdims=True))
    DP = A * (DA - S)
    e_dp = np.where(causal, e_att * np.abs(DA - S) + A * (e_datt + e_s)
                    + gamma(2) * A * (np.abs(DA) + np.abs(S)), 0.0)
    bd["dpreatt"] = e_dp
    # g = scale * dp (scale 2 roundings, product 1), dq[t] += g k[t2] over n keys,
    # dk[t2] += g q[t] over <= T queries
    # (TF32: g and k, g and q rounded for the product, also on g's own error)
    cross = prod(0) if tf32 else 0.0
    prod_n = (1 + prod(0)) * (1 + gamma_n(n + 3)) - 1      # prod(n + 3), row by row
    e_dq = scale * ((1 + cross) * (e_dp @ aK) + prod_n * (np.abs(DP) @ aK))
    e_dk = scale * ((1 + cross) * (tT(e_dp) @ aQ) + prod(T + 3) * (tT(np.abs(DP)) @ aQ))
    bd["dqkv"] = np.stack([e_dq, e_dk, e_dv]).transpose(1, 3, 0, 2, 4).reshape(B, T, 3 * C)
    if tile is not None:
        bd["LSE"] = LSE[..., 0]  # the exact logsumexp, for the test
    return bd


def _attention_case(kern, rng, B, T, C, NH, qscale=1.0):
    qkv = randn(rng, B, T, 3 * C)
    qkv[..., :C] *= qscale
    out = np.full((B, T, C), np.nan, np.float32)
    att = np.full((B, NH, T, T), np.nan, np.float32)
    kern.attention_forward(out, att, qkv, B, T, C, NH)

    qkv_t = t64(qkv, True)
    ref_out, ref_pre, ref_att, mask = _attention_ref(qkv_t, B, T, C, NH)
    ref_pre.retain_grad()
    ref_att.retain_grad()
    m = mask.numpy()
    dout = randn(rng, B, T, C)
    bd = _attention_bounds(qkv, dout, B, T, C, NH)  # each bound derived in there
    close(out, ref_out, bd["out"], "attention out")
    close(att, ref_att, bd["att"], "attention att")
    # (the CUDA body of the backward reads the whole (T, T) att: the triangle is 0)
    assert np.all(att[..., m] == 0)
    close(f64(att).sum(-1), np.ones((B, NH, T)), bd["rowsum"], "attention att row sums")

    ref_out.backward(t64(dout))
    dqkv = np.full((B, T, 3 * C), np.nan, np.float32)  # written, not accumulated
    dpreatt = np.full((B, NH, T, T), np.nan, np.float32)
    datt = np.full((B, NH, T, T), np.nan, np.float32)
    kern.attention_backward(dqkv, dpreatt, datt, dout, qkv, att, B, T, C, NH)
    close(dqkv, qkv_t.grad, bd["dqkv"], "attention dqkv")
    # the scratch below the diagonal (above it: whatever the kernel leaves, read by no one)
    close(dpreatt[..., ~m], f64(ref_pre.grad)[..., ~m], bd["dpreatt"][..., ~m],
          "attention dpreatt")
    close(datt[..., ~m], f64(ref_att.grad)[..., ~m], bd["datt"][..., ~m], "attention datt")
    return qkv, out


@pytest.mark.parametrize("B,T,C,NH", [(2, 5, 16, 2), (2, 8, 48, 4), (1, 7, 36, 3)])
def test_attention_small(kern, rng, B, T, C, NH):
    _attention_case(kern, rng, B, T, C, NH)


def test_attention_gpt2_width(kern, rng):
    _attention_case(kern, rng, B=1, T=64, C=768, NH=12)


def test_attention_large_scores(kern, rng):
    # scores of +-100s: exp would overflow without the max subtraction. Each score carries an
    # fp32 error up to gamma(hs + 3) sum|q k| / sqrt(hs) (~1e-4 here), which exp turns into a
    # relative error of att of that size; in the backward datt - sum(att * datt) cancels for a
    # peaked softmax, which the bound handles through the |terms| of that sum
    _attention_case(kern, rng, B=2, T=8, C=32, NH=2, qscale=60.0)


def test_attention_is_causal(kern, rng):
    B, T, C, NH = 2, 8, 32, 4
    qkv, out = _attention_case(kern, rng, B, T, C, NH)
    t0 = 5
    qkv2 = qkv.copy()
    qkv2[:, t0:] = randn(rng, B, T - t0, 3 * C, scale=10)  # change q, k, v of tokens >= t0
    out2 = np.empty_like(out)
    att = np.empty((B, NH, T, T), np.float32)
    kern.attention_forward(out2, att, qkv2, B, T, C, NH)
    assert np.array_equal(out2[:, :t0], out[:, :t0])
    assert not np.allclose(out2[:, t0:], out[:, t0:])


def test_gemm_attention_one_cublas_call_per_product(rng):
    """The batched-GEMM attention's CUDA bodies make one cuBLAS call per product over all
    B x NH (sequence, head) pairs: 2 in the forward (scores, att @ v), 4 in the backward
    (datt, dv, dq, dk), whatever NH (a loop over heads made NH times as many)."""
    _emulated_only()
    kern = GPUKernels()
    B, T, C, NH = 2, 6, 24, 3
    qkv, dout = randn(rng, B, T, 3 * C), randn(rng, B, T, C)
    out = np.zeros((B, T, C), np.float32)
    att = np.zeros((B, NH, T, T), np.float32)
    lib.sl_gpu_emulated_blas_calls()
    kern.attention_forward(out, att, qkv, B, T, C, NH)
    assert lib.sl_gpu_emulated_blas_calls() == 2, "forward: scores and att @ v, one call each"
    scratch = [np.zeros((B, NH, T, T), np.float32) for _ in range(2)]
    kern.attention_backward(np.zeros((B, T, 3 * C), np.float32), *scratch, dout, qkv, att,
                            B, T, C, NH)
    assert lib.sl_gpu_emulated_blas_calls() == 4, "backward: datt, dv, dq, dk, one call each"


def test_gemm_attention_misaligned_pairs_one_gemm_each(rng):
    """T = 5: the scores' (b, h) matrices are T T = 25 floats apart, not 16-byte aligned,
    which a batched cuBLAS call cannot take (it reads the pointers on the GPU: the emulation
    refuses them, as emulate.cpp says). Those products go one GEMM a pair, the aligned ones
    (T = 6) one batched call each; the results equal the CPU kernel's within the bound."""
    _emulated_only()
    kern, cpu = GPUKernels(), CPUKernels()
    B, T, C, NH = 2, 5, 24, 3
    pairs = B * NH
    qkv = randn(rng, B, T, 3 * C)
    out, ref = (np.zeros((B, T, C), np.float32) for _ in range(2))
    att, ref_att = (np.zeros((B, NH, T, T), np.float32) for _ in range(2))
    lib.sl_gpu_emulated_blas_calls()
    kern.attention_forward(out, att, qkv, B, T, C, NH)
    # scores (k q^T into att) and att @ v: each touches the misaligned att
    assert lib.sl_gpu_emulated_blas_calls() == 2 * pairs
    cpu.attention_forward(ref, ref_att, qkv, B, T, C, NH)
    assert np.allclose(out, ref, rtol=1e-5, atol=1e-6), np.abs(out - ref).max()


_DIRECT_THREADS = """
import sys, threading
import numpy as np
sys.path.insert(0, sys.argv[1])
from kernel_impls import GPUKernels
B, T, C, NH = 2, 8, 32, 4
rng = np.random.default_rng(0)
cases = [rng.standard_normal((B, T, 3 * C), dtype=np.float32) for _ in range(2)]

def run(qkv):
    out, att = np.zeros((B, T, C), np.float32), np.zeros((B, NH, T, T), np.float32)
    GPUKernels().attention_forward(out, att, qkv, B, T, C, NH)
    return out

alone = [run(q) for q in cases]
bad = []

def worker(i):
    for _ in range(300):
        if not np.array_equal(run(cases[i]), alone[i]):
            bad.append(i)

threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print("wrong results in threads", sorted(set(bad)) if bad else "none")
"""


def test_direct_cuda_runs_from_two_threads():
    """Two Python threads running CUDA bodies directly at once (sl_codelet_run_cuda: the
    server's engine thread and a test, say) share one stream and scratch: the batched
    attention's pointer arrays, written into the scratch and read by its GEMMs, must be each
    thread's own. Each thread's 300 results equal the same run alone, bit for bit (a child
    process: a race may also crash it)."""
    why = gpu_available()
    if why:
        pytest.skip(why)
    r = subprocess.run([sys.executable, "-c", _DIRECT_THREADS, os.path.dirname(__file__)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().endswith("none"), r.stdout


# ---- the fused attention (attention_flash_*: tiles, online softmax, no (T, T) tensor)

FLASH_TILE = lib.SL_FLASH_TILE


@pytest.fixture(params=["cpu", "gpu", "gpu-tf32"])
def flash_kern(request):
    """The fused attention's kernels: the CPU ones, the GPU ones in fp32 (its scalar
    kernels) and in TF32 (its tensor-core kernels where the head size is a multiple of 8)."""
    if request.param == "cpu":
        return CPUKernels()
    why = gpu_available()
    if why:
        pytest.skip(why)
    return GPUKernels(tf32=request.param == "gpu-tf32")


def _flash_case(kern, rng, B, T, C, NH, qscale=1.0):
    """attention_flash_forward / _backward against the float64 reference: out, the row
    logsumexp and dqkv, each within _attention_bounds(tile=) (the online softmax's own; in
    TF32, tf32=: the GPU kernels in TF32 take every head size, the bound holds for fp32)."""
    qkv = randn(rng, B, T, 3 * C)
    qkv[..., :C] *= qscale
    out = np.full((B, T, C), np.nan, np.float32)
    lse = np.full((B, NH, T), np.nan, np.float32)
    kern.attention_flash_forward(out, lse, qkv, B, T, C, NH)

    qkv_t = t64(qkv, True)
    ref_out = _attention_ref(qkv_t, B, T, C, NH)[0]
    dout = randn(rng, B, T, C)
    bd = _attention_bounds(qkv, dout, B, T, C, NH, tile=FLASH_TILE,
                           tf32=bool(getattr(kern, "tf32", False)))
    close(out, ref_out, bd["out"], "flash attention out")
    close(lse, bd["LSE"], bd["lse"], "flash attention lse")

    ref_out.backward(t64(dout))
    dqkv = np.full((B, T, 3 * C), np.nan, np.float32)  # written, not accumulated
    dsum = np.full((B, NH, T), np.nan, np.float32)
    kern.attention_flash_backward(dqkv, dsum, dout, qkv, out, lse, B, T, C, NH)
    close(dqkv, qkv_t.grad, bd["dqkv"], "flash attention dqkv")
    return qkv, dout, out, dqkv


# T across several tiles and several 64-row blocks of the CUDA kernels (T = 70, 130), a head
# size below 32 and not a power of 2 (12)
# (and head sizes 32 and 48: the tensor-core kernels' other widths)
@pytest.mark.parametrize("B,T,C,NH", [(2, 5, 16, 2), (1, 70, 48, 4), (2, 130, 36, 3),
                                      (1, 70, 96, 3), (1, 130, 96, 2)])
def test_flash_attention_small(flash_kern, rng, B, T, C, NH):
    _flash_case(flash_kern, rng, B, T, C, NH)


def test_flash_attention_large_scores(flash_kern, rng):
    # scores of +-100s over several tiles: the running max rises from tile to tile, so the
    # rescalings exp(m_old - m_new) underflow to 0 or carry large arguments
    _flash_case(flash_kern, rng, B=1, T=96, C=32, NH=2, qscale=60.0)


def test_flash_attention_production_shape(flash_kern, rng):
    # GPT-2 124M's layer at T = 1024: C = 768, NH = 12, B = 1
    _flash_case(flash_kern, rng, B=1, T=1024, C=768, NH=12)


def test_flash_attention_is_causal(flash_kern, rng):
    """Out row t and dq of row t never depend on later tokens; dk, dv of a row never on
    earlier queries' gradients (dout rows before it)."""
    B, T, C, NH = 1, 100, 32, 2
    qkv, dout, out, dqkv = _flash_case(flash_kern, rng, B, T, C, NH)
    t0 = 37
    qkv2 = qkv.copy()
    qkv2[:, t0:] = randn(rng, B, T - t0, 3 * C, scale=10)  # q, k, v of tokens >= t0
    dout2 = dout.copy()
    dout2[:, t0:] = randn(rng, B, T - t0, C, scale=10)
    out2 = np.empty_like(out)
    lse2 = np.empty((B, NH, T), np.float32)
    flash_kern.attention_flash_forward(out2, lse2, qkv2, B, T, C, NH)
    assert np.array_equal(out2[:, :t0], out[:, :t0])
    assert not np.allclose(out2[:, t0:], out[:, t0:])
    dqkv2, dsum = np.empty_like(dqkv), np.empty((B, NH, T), np.float32)
    flash_kern.attention_flash_backward(dqkv2, dsum, dout2, qkv2, out2, lse2, B, T, C, NH)
    assert np.array_equal(dqkv2[:, :t0, :C], dqkv[:, :t0, :C])  # dq of the earlier rows
    assert not np.allclose(dqkv2[:, :t0, C:], dqkv[:, :t0, C:])  # their dk, dv see later dout


def _flash_run(kern, qkv, dout, B, T, C, NH):
    out, lse = np.empty((B, T, C), np.float32), np.empty((B, NH, T), np.float32)
    kern.attention_flash_forward(out, lse, qkv, B, T, C, NH)
    dqkv, dsum = np.empty((B, T, 3 * C), np.float32), np.empty((B, NH, T), np.float32)
    kern.attention_flash_backward(dqkv, dsum, dout, qkv, out, lse, B, T, C, NH)
    return out, dqkv


def test_flash_gpu_tf32_bound_is_needed_and_odd_heads_run_fp32(rng):
    """In TF32 the fused attention's products run on tensor cores with their operands rounded
    to TF32: out and dqkv then leave the fp32 bound (the TF32 one, which the tests above
    hold them to, is needed) and differ from the fp32 kernels'. A head size that is not a
    multiple of 8 runs the fp32 kernels in TF32 too, bit for bit."""
    why = gpu_available()
    if why:
        pytest.skip(why)
    fp32, tf32 = GPUKernels(), GPUKernels(tf32=True)
    B, T, C, NH = 1, 70, 128, 2
    qkv, dout = randn(rng, B, T, 3 * C), randn(rng, B, T, C)
    out, dqkv = _flash_run(tf32, qkv, dout, B, T, C, NH)
    qkv_t = t64(qkv, True)
    ref_out = _attention_ref(qkv_t, B, T, C, NH)[0]
    ref_out.backward(t64(dout))
    bd = _attention_bounds(qkv, dout, B, T, C, NH, tile=FLASH_TILE)   # fp32's
    assert np.any(np.abs(f64(out) - f64(ref_out)) > bd["out"]), "out within fp32's bound"
    assert np.any(np.abs(f64(dqkv) - f64(qkv_t.grad)) > bd["dqkv"]), "dqkv within fp32's"
    assert not np.array_equal(out, _flash_run(fp32, qkv, dout, B, T, C, NH)[0])
    B, T, C, NH = 1, 40, 36, 3      # hs = 12
    qkv, dout = randn(rng, B, T, 3 * C), randn(rng, B, T, C)
    for a, b in zip(_flash_run(tf32, qkv, dout, B, T, C, NH), _flash_run(fp32, qkv, dout, B, T, C, NH)):
        assert np.array_equal(a, b)



WMMA_PROBE = r"""
#include <cstdio>
#include <cstdlib>
#include "emulate.h"
namespace wmma = nvcuda::wmma;
void cblas_sgemm(int, int, int, int, int, int, float, const float *, int, const float *, int,
		 float, float *, int) { abort(); }
/* one warp loads a TF32 operand from tile + off with stride ldm and stores an accumulator there */
static void kernel(int off, unsigned ldm)
{
	__shared__ __align__(32) float tile[16 * 24 + 16];
	for (int e = threadIdx.x; e < 16 * 24 + 16; e += blockDim.x)
		tile[e] = (float)e;
	__syncwarp();
	wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::row_major> a;
	wmma::load_matrix_sync(a, tile + off, ldm);
	wmma::fragment<wmma::accumulator, 16, 16, 8, float> c;
	wmma::fill_fragment(c, 0.0f);
	wmma::store_matrix_sync(tile + off, c, ldm, wmma::mem_row_major);
}
int main(int argc, char **argv)
{
	const int off = atoi(argv[1]);
	const unsigned ldm = (unsigned)atoi(argv[2]);
	sl_emu::launch(dim3(1), dim3(32), 0, 0, [=]() { kernel(off, ldm); });
	printf("ran\n");
	return 0;
}
"""


def _emulation_probe(tmp_path, source):
    """source (C++ against csrc/cuda/emulate.h) built with the CPU emulation, its cuBLAS on a
    stub cblas_sgemm; returns run(*args), the program run with those arguments."""
    import shutil
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    assert cxx, "no C++ compiler: the package's CPU build needs one"
    (tmp_path / "cblas.h").write_text(      # emulate.cpp's cuBLAS goes to cblas_sgemm
        "enum { CblasColMajor, CblasNoTrans, CblasTrans };\nvoid cblas_sgemm(int, int, int, int, "
        "int, int, float, const float *, int, const float *, int, float, float *, int);\n")
    (tmp_path / "probe.cpp").write_text(source)
    cuda = os.path.join(os.path.dirname(__file__), "..", "csrc", "cuda")
    exe = tmp_path / "probe"
    subprocess.run([cxx, "-O1", "-std=c++17", "-Wno-unknown-pragmas", "-I", str(tmp_path),
                    "-I", cuda, str(tmp_path / "probe.cpp"), os.path.join(cuda, "emulate.cpp"),
                    "-o", str(exe)], check=True)

    def run(*args):
        return subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True,
                              timeout=60)
    return run


def test_the_emulation_ends_a_wmma_access_a_gpu_would_fault_on(tmp_path):
    """A GPU requires a WMMA load or store's pointer 256-bit aligned and its stride a multiple
    of 16 bytes (else a misaligned-address fault, or wrong elements), which nothing on the CPU
    would show: the emulation ends the program naming the call, so the tensor-core attention's
    tests above (which pass) show its tiles and strides are ones a GPU takes. A probe built
    against the emulation: aligned offsets and strides of 4k floats run; 4 floats off, or a
    stride of 18, end with the message."""
    probe = _emulation_probe(tmp_path, WMMA_PROBE)
    for off, ldm in ((0, 16), (8, 24), (16, 20)):
        r = probe(off, ldm)
        assert r.returncode == 0 and r.stdout == "ran\n", (off, ldm, r.stderr)
    r = probe(4, 16)
    assert r.returncode != 0 and "load_matrix_sync" in r.stderr and "256-bit aligned" in r.stderr
    r = probe(0, 18)
    assert r.returncode != 0 and "ldm 18" in r.stderr and "multiple of 4 floats" in r.stderr


SCHEDULE_PROBE = r"""
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include "emulate.h"
namespace wmma = nvcuda::wmma;
void cblas_sgemm(int, int, int, int, int, int, float, const float *, int, const float *, int,
		 float, float *, int) { abort(); }
/* thread `from` of each block writes, thread `to` reads (after a barrier when sync); out[b]
 * is what block b's `to` read, its `from` having written b + 1 */
static void handover(float *out, int from, int to, bool sync)
{
	__shared__ float slot;
	__syncthreads(); /* the block meets a barrier: fibers */
	if ((int)threadIdx.x == from)
		slot = (float)(blockIdx.x + 1);
	if (sync)
		__syncthreads();
	if ((int)threadIdx.x == to)
		out[blockIdx.x] = slot;
}
static void divergent()
{
	if (threadIdx.x < 16)
		__syncthreads();
	else
		__syncthreads();
}
/* every lane loads tile + off (lane 0 only, when lone; odd lanes 32 floats on, when skew) */
static void wmma_lanes(bool lone, bool skew)
{
	__shared__ __align__(32) float tile[64 * 8];
	for (int e = threadIdx.x; e < 64 * 8; e += blockDim.x)
		tile[e] = 1.0f;
	__syncwarp();
	wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::row_major> a;
	if (!lone || threadIdx.x % 32 == 0)
		wmma::load_matrix_sync(a, tile + (skew && threadIdx.x % 2 ? 32 : 0), 8);
}
/* lane 0's accumulator from a row-major tile of 0, 1, .., 255: out[0] whether x[i] is element
 * i for every i, out[1] whether a store gives the tile back */
static void acc_layout(int *out)
{
	__shared__ __align__(32) float tile[256], back[256];
	for (int e = threadIdx.x; e < 256; e += blockDim.x)
		tile[e] = (float)e;
	__syncwarp();
	wmma::fragment<wmma::accumulator, 16, 16, 8, float> c;
	wmma::load_matrix_sync(c, tile, 16, wmma::mem_row_major);
	wmma::store_matrix_sync(back, c, 16, wmma::mem_row_major);
	__syncwarp();
	if (threadIdx.x == 0) {
		out[0] = out[1] = 1;
		for (int i = 0; i < 256; i++) {
			out[0] &= c.x[i] == tile[i];
			out[1] &= back[i] == tile[i];
		}
	}
}
int main(int argc, char **argv)
{
	const char *mode = argv[1];
	if (!strcmp(mode, "handover")) { /* from, to, sync: the blocks whose read was wrong */
		int from = atoi(argv[2]), to = atoi(argv[3]);
		bool sync = atoi(argv[4]) != 0;
		float out[8];
		sl_emu::launch(dim3(8), dim3(64), 0, 0, [=, &out]() { handover(out, from, to, sync); });
		int wrong = 0;
		for (int b = 0; b < 8; b++)
			wrong += out[b] != (float)(b + 1);
		printf("%d\n", wrong);
		return 0;
	} else if (!strcmp(mode, "divergent")) {
		sl_emu::launch(dim3(1), dim3(32), 0, 0, []() { divergent(); });
	} else if (!strcmp(mode, "wmma")) {
		bool lone = atoi(argv[2]) != 0, skew = atoi(argv[3]) != 0;
		sl_emu::launch(dim3(1), dim3(64), 0, 0, [=]() { wmma_lanes(lone, skew); });
	} else if (!strcmp(mode, "layout")) {
		int out[2];
		sl_emu::launch(dim3(1), dim3(32), 0, 0, [&out]() { acc_layout(out); });
		printf("%d %d\n", out[0], out[1]);
		return 0;
	} else if (!strcmp(mode, "smem")) { /* the launch's error at that much dynamic shared memory */
		size_t bytes = (size_t)atol(argv[2]);
		sl_emu::launch(dim3(1), dim3(32), bytes, 0, []() {});
		printf("%d\n", (int)cudaGetLastError());
		return 0;
	}
	printf("ran\n");
	return 0;
}
"""


def test_the_emulation_shows_what_a_gpu_leaves_undefined(tmp_path):
    """What a GPU may run without a word but the emulation refuses or shows, each in a probe
    built against it: a value handed from one thread to another without the barrier between
    (read wrong in some of 8 blocks whichever thread writes and which reads, lane 0 and 31
    both ways: the blocks run their threads in lane order, reversed and scrambled; right in
    all with the barrier); __syncthreads at two call sites in divergent code; a WMMA load made
    by lane 0 alone, or with a pointer that differs between lanes; a launch asking for more
    than 48 KiB of dynamic shared memory (a GPU needs cudaFuncSetAttribute's opt-in); reading
    an accumulator's elements as the tile's row-major order (the GPU's layout is its own: a
    load then a store give the tile back, element i of the fragment is not element i)."""
    probe = _emulation_probe(tmp_path, SCHEDULE_PROBE)
    for from_, to in ((0, 31), (31, 0), (5, 40), (40, 5)):
        r = probe("handover", from_, to, 0)
        assert r.returncode == 0 and int(r.stdout) > 0, (from_, to, r.stdout, r.stderr)
        r = probe("handover", from_, to, 1)
        assert r.returncode == 0 and r.stdout == "0\n", (from_, to, r.stdout, r.stderr)
    r = probe("divergent")
    assert r.returncode != 0 and "divergent barriers" in r.stderr, r.stderr
    r = probe("wmma", 0, 0)
    assert r.returncode == 0 and r.stdout == "ran\n", r.stderr
    for lone, skew in ((1, 0), (0, 1)):
        r = probe("wmma", lone, skew)
        assert r.returncode != 0 and "not made by every lane" in r.stderr, (lone, skew, r.stderr)
    assert probe("layout").stdout == "0 1\n"
    assert probe("smem", 48 * 1024).stdout == "0\n"
    assert probe("smem", 48 * 1024 + 4).stdout == "1\n"      # cudaErrorInvalidValue


_FLASH_MANY_PAIRS = """
import sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from kernel_impls import GPUKernels
B, T, C, NH = 4096, 1, 32, 16
rng = np.random.default_rng(0)
qkv = rng.standard_normal((B, T, 3 * C), dtype=np.float32)
dout = rng.standard_normal((B, T, C), dtype=np.float32)
out, lse = np.full((B, T, C), np.nan, np.float32), np.full((B, NH, T), np.nan, np.float32)
kern = GPUKernels()
kern.attention_flash_forward(out, lse, qkv, B, T, C, NH)
dqkv, dsum = np.full((B, T, 3 * C), np.nan, np.float32), np.empty((B, NH, T), np.float32)
kern.attention_flash_backward(dqkv, dsum, dout, qkv, out, lse, B, T, C, NH)
assert np.array_equal(out, qkv[:, :, 2 * C:]), "out: one key, its value"
assert np.allclose(dqkv[:, :, 2 * C:], dout, rtol=1e-5, atol=0), "dv: dout (weight 1)"
assert np.allclose(dqkv[:, :, :2 * C], 0, atol=1e-5), "dq, dk: 0 (a softmax over one key)"
print("ok")
"""


def test_flash_attention_more_pairs_than_a_grid_column():
    """B NH = 65536 (batch, head) pairs, one past what a grid's y (and z) dimension takes: the
    fused kernels launch (a launch error ends the process, hence a child) and, at T = 1, give
    out = v, dv = dout, dq = dk = 0."""
    why = gpu_available()
    if why:
        pytest.skip(why)
    r = subprocess.run([sys.executable, "-c", _FLASH_MANY_PAIRS, os.path.dirname(__file__)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]



_SANITIZED_KERNELS = """
import sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from kernel_impls import GPUKernels
rng = np.random.default_rng(0)


def r(*shape):
    return rng.standard_normal(shape, dtype=np.float32)


def empty(*shape):
    return np.full(shape, np.nan, np.float32)


for tf32 in (False, True):
    k = GPUKernels(tf32=tf32)
    # the fused attention: head sizes 64, 48, 16 (tensor cores in TF32) and 12 (the scalar
    # kernels), T not a multiple of a block's rows nor of a tile
    for B, T, C, NH in ((1, 100, 128, 2), (2, 70, 96, 2), (1, 40, 32, 2), (1, 33, 36, 3)):
        qkv, dout = r(B, T, 3 * C), r(B, T, C)
        out, lse = empty(B, T, C), empty(B, NH, T)
        k.attention_flash_forward(out, lse, qkv, B, T, C, NH)
        dqkv, dsum = empty(B, T, 3 * C), empty(B, NH, T)
        k.attention_flash_backward(dqkv, dsum, dout, qkv, out, lse, B, T, C, NH)
        assert np.isfinite(out).all() and np.isfinite(dqkv).all(), (B, T, C, NH, tf32)
    # the block and column reductions (layernorm, the bias gradient, the softmax, the norm);
    # the matmul small (its GEMMs are cuBLAS's: racecheck's time goes into their tiles)
    N, C, OC, V, Vp = 300, 768, 80, 500, 512
    x, dy, w, b = r(N, C), r(N, C), r(C), r(C)
    y, mean, rstd = empty(N, C), empty(N), empty(N)
    k.layernorm_forward(y, mean, rstd, x, w, b, N, C)
    dx, dw, db = np.zeros((N, C), np.float32), np.zeros(C, np.float32), np.zeros(C, np.float32)
    k.layernorm_backward(dx, dw, db, dy, x, w, mean, rstd, N, C, 0)
    dinp, dW, dbias = empty(N, C), np.zeros((OC, C), np.float32), np.zeros(OC, np.float32)
    k.matmul_backward(dinp, dW, dbias, r(N, OC), x, r(OC, C), N, C, OC)
    targets = rng.integers(0, V, N).astype(np.int32)
    probs, losses = empty(N, Vp), empty(N)
    k.crossentropy_softmax_forward(probs, losses, r(N, Vp), targets, N, V, Vp, 0)
    sumsq = np.zeros(1)
    k.sum_of_squares(sumsq, x.reshape(-1), x.size)
    assert all(np.isfinite(a).all() for a in (y, dx, dw, db, dinp, dW, dbias, losses, sumsq))
print("ok")
"""


@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_gpu_kernels_pass_compute_sanitizer(tool):
    """On a GPU, NVIDIA's compute-sanitizer finds no out-of-bounds or misaligned access
    (memcheck) and no shared-memory hazard (racecheck: a read or write between two threads
    without the barrier that orders them) in the fused attention, fp32 and TF32 (the
    tensor-core kernels' tiles and per-warp scratch), nor in the block and column
    reductions, at shapes with ragged edges. Neither the CPU emulation nor a correct result
    shows these: a race can give the right numbers on one run."""
    import shutil
    if lib.sl_gpu_emulated():
        pytest.skip("no GPU: compute-sanitizer checks the kernels on one (a CUDA build)")
    why = gpu_available()
    if why:
        pytest.skip(why)
    cuda_bin = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin")
    sanitizer = shutil.which("compute-sanitizer") or shutil.which("compute-sanitizer",
                                                                     path=cuda_bin)
    if not sanitizer:
        pytest.skip(f"no compute-sanitizer on PATH nor in {cuda_bin} (CUDA's toolkit has it)")
    r = subprocess.run([sanitizer, "--tool", tool, "--error-exitcode", "9", sys.executable,
                        "-c", _SANITIZED_KERNELS, os.path.dirname(__file__)],
                       capture_output=True, text=True, timeout=600)
    text = r.stdout + r.stderr
    assert r.returncode == 0 and "ok" in r.stdout, text[-4000:]
    assert "ERROR SUMMARY: 0 errors" in text, text[-4000:]


# ---------------------------------------------------------------- gelu


GELU_S, GELU_A = math.sqrt(2 / math.pi), 0.044715


def _gelu_bounds(x, dout):
    """Bounds of gelu_forward / gelu_backward, through csrc/kernels/gelu.c:
    u = S (x + A x x x), e = vexpf(-2|u|), r = 1 / (1 + e), (sp, sn) = (r, e r) for u >= 0 and
    (e r, r) for u < 0, out = x sp, dinp = (sp + 2 x sp sn du) dout, du = S (1 + 3 A x x)."""
    x, dy = f64(x), np.abs(f64(dout))
    ax = np.abs(x)
    Uu = GELU_S * (x + GELU_A * x**3)
    # u: GELU_S and GELU_A are rounded to float (2), three products, the sum and the product
    # by S (5): gamma(7), on |u| itself as x and A x^3 have the same sign (no cancellation)
    e_U = gamma(7) * np.abs(Uu)
    E = np.exp(-2 * np.abs(Uu))
    # e: the argument's error 2 e_U and vexpf's 2 ulp; EXP_FLOOR where vexpf flushes to 0
    dE = E * exp_rel(2 * e_U) + EXP_FLOOR
    R = 1 / (1 + E)
    dR = R**2 * dE + gamma(2) * R  # d(1/(1+e)) = -de/(1+e)^2; 1 + e and 1/ round
    dER = E * dR + R * dE + U * E * R  # e * r: both errors and the product
    pos = Uu >= 0
    SP, SN = np.where(pos, R, E * R), np.where(pos, E * R, R)
    dSP, dSN = np.where(pos, dR, dER), np.where(pos, dER, dR)
    # torch's float64 formula 0.5 x (1 + tanh(u)) cancels for u << 0: its 1 + tanh carries an
    # absolute error of a few 2^-53 (tanh's ulp, the sum); allowed as 8 * 2^-53 |x|
    out = ax * (dSP + U * SP) + 8 * U64 * ax
    # du = S (1 + 3A x x): S, 3A rounded (3A folded in float: 2), two products, the sum, *S
    DU = GELU_S * (1 + 3 * GELU_A * x**2)
    T2 = 2 * ax * SP * SN * DU  # |2 x sp sn du|; 2 x is exact, three products round
    dT2 = 2 * ax * DU * (dSP * SN + SP * dSN + SP * SN * gamma(7)) + gamma(3) * T2
    # sp + t2 can cancel (x < 0): the sum and the product by dout round on |sp| + |t2|
    # torch's float64 1 + tanh and 1 - tanh^2 (times 0.5 x du) each carry a few 2^-53
    dinp = dy * (dSP + dT2 + gamma(2) * (SP + T2)) + 8 * U64 * dy * (1 + ax * DU)
    return out, dinp


@pytest.mark.parametrize("n", [37, 100003])  # a SIMD tail; above the parallel threshold
def test_gelu(kern, rng, n):
    x = randn(rng, n, scale=3)
    x[:8] = [0.0, -0.0, 1e-6, -1e-6, 12.0, -12.0, 60.0, -60.0]  # the tails saturate
    out = np.full(n, np.nan, np.float32)
    kern.gelu_forward(out, x, n)
    x_t = t64(x, True)
    ref = F.gelu(x_t, approximate="tanh")
    dout = randn(rng, n)
    b_out, b_dinp = _gelu_bounds(x, dout)  # each bound derived in there
    close(out, ref, b_out, "gelu out")
    ref.backward(t64(dout))
    dinp = np.full(n, np.nan, np.float32)
    kern.gelu_backward(dinp, x, dout, n)
    close(dinp, x_t.grad, b_dinp, "gelu dinp")


# ---------------------------------------------------------------- residual


@pytest.mark.parametrize("n", [37, 100003])
def test_residual(kern, rng, n):
    a, b = randn(rng, n), randn(rng, n)
    out = np.full(n, np.nan, np.float32)
    kern.residual_forward(out, a, b, n)
    assert np.array_equal(out, a + b)  # one float32 addition: exact


def test_gpu_kernels_map_a_kernels_arguments_onto_its_codelet_exactly():
    """GPUKernels' call for a codelet without a method of its own (gelu's, residual's): an
    argument count that is not the codelet's buffers and fields is an error naming them, not
    a field left 0 or an argument dropped (a kernel whose signature is not its codelet's)."""
    x = np.zeros(4, np.float32)
    for args in ((x, x), (x, x, 4, 1)):
        with pytest.raises(TypeError, match=r"gelu_forward: its codelet takes 2 buffers then N"):
            GPUKernels().gelu_forward(*args)


# ---------------------------------------------------------------- crossentropy


def _crossentropy_bounds(logits, targets, V):
    """Bounds of crossentropy_softmax_forward, through csrc/kernels/crossentropy.c: exact
    (float64) Z = x - max over the V real columns, probabilities P, losses L."""
    x = f64(logits[:, :V])
    N = x.shape[0]
    Z = x - x.max(1, keepdims=True)
    E = np.exp(Z)
    P = E / E.sum(1, keepdims=True)
    # fl(x - max) rounds once (u |Z|; the max is exact), then vexpf's 2 ulp; a -inf logit's
    # exp is exactly 0 (vexpf's, CUDA's expf)
    with np.errstate(invalid="ignore"):
        phi = np.where(np.isfinite(Z), exp_rel(U * np.abs(Z)), 0.0)
    # the normaliser is summed in double (V - 1 additions) and inverted in double (gamma64),
    # the inverse rounded to float and the product p = e * inv (gamma(2))
    e_p = softmax_bound(P, phi, gamma(2) + gamma64(V + 1))
    # loss = (float)(log(sum) - (x_t - max)), in double: log of the sum is off by -log(1 - rel)
    # of the sum's relative error rel (the exps' errors, the double sum, flushed exps), the
    # log, the difference and the subtraction round in double (gamma64(3)), then to float (u)
    rel_S = ((P * phi).sum(1) + gamma64(V) + V * EXP_FLOOR)
    logS = np.log(E.sum(1))
    Zt = Z[np.arange(N), targets]
    L = logS - Zt
    e_L = -np.log1p(-rel_S) + gamma64(3) * (np.abs(logS) + np.abs(Zt)) + U * np.abs(L)
    return P, e_p, e_L


@pytest.mark.parametrize("N,V,Vp,scale", [(2 * 6, 37, 40, 3.0), (2 * 6, 37, 40, 40.0), (3, 5000, 5008, 5.0)])
def test_crossentropy(kern, rng, N, V, Vp, scale):
    logits = randn(rng, N, Vp, scale=scale)
    logits[:, V:] = 1e4  # padding must be ignored (it would dominate the softmax)
    targets = rng.integers(0, V, size=N).astype(np.int32)
    targets[0], targets[1] = 0, V - 1
    probs = np.full((N, Vp), np.nan, np.float32)
    losses = np.full(N, np.nan, np.float32)
    kern.crossentropy_softmax_forward(probs, losses, logits, targets, N, V, Vp, 0)

    lg_t = t64(logits[:, :V], True)
    tg_t = torch.from_numpy(targets).long()
    P, e_p, e_L = _crossentropy_bounds(logits, targets, V)  # each bound derived in there
    close(probs[:, :V], torch.softmax(lg_t, -1), e_p, "crossentropy probs")
    assert np.all(probs[:, V:] == 0)
    ref_losses = F.cross_entropy(lg_t, tg_t, reduction="none")
    close(losses, ref_losses, e_L, "crossentropy losses")

    # accumulate (a gradient accumulation's later micro-batches): the same losses, added in
    # float to what the buffer held, the probabilities written as before
    held = randn(rng, N, scale=3.0)
    summed, probs2 = held.copy(), np.full((N, Vp), np.nan, np.float32)
    kern.crossentropy_softmax_forward(probs2, summed, logits, targets, N, V, Vp, 1)
    assert np.array_equal(summed, held + losses) and np.array_equal(probs2, probs)

    ref_losses.mean().backward()
    dloss = 1.0 / N
    dlogits = np.full((N, Vp), np.nan, np.float32)
    kern.crossentropy_softmax_backward(dlogits, probs, targets, N, V, Vp, dloss)
    # d = p * dloss, d[target] = (p - 1) * dloss, with the kernel's p (error e_p): dloss
    # rounded to float, the product, and the subtraction at the target (3), on |p - onehot|
    onehot = np.zeros_like(P)
    onehot[np.arange(N), targets] = 1
    b_d = dloss * (e_p + gamma(3) * np.abs(P - onehot))
    close(dlogits[:, :V], lg_t.grad, b_d, "crossentropy dlogits")
    assert np.all(dlogits[:, V:] == 0)

    # in place: dlogits aliases probs
    inplace = probs.copy()
    kern.crossentropy_softmax_backward(inplace, inplace, targets, N, V, Vp, dloss)
    assert np.array_equal(inplace, dlogits)


def test_crossentropy_minus_inf_logits(kern, rng):
    """-inf logits (a mask) take no probability and leave the loss of the others finite: the
    GPU body's per-thread running sum added exp(-inf - -inf) = NaN while a thread had seen
    only -inf columns (the first 600 here, over its 512 threads)."""
    N, V, Vp = 4, 1000, 1024
    logits = randn(rng, N, Vp, scale=3.0)
    logits[:, :600] = -np.inf
    logits[:, 601::3] = -np.inf
    targets = np.array([600, 602, 603, V - 1], np.int32)
    probs = np.full((N, Vp), np.nan, np.float32)
    losses = np.full(N, np.nan, np.float32)
    kern.crossentropy_softmax_forward(probs, losses, logits, targets, N, V, Vp, 0)
    lg_t = t64(logits[:, :V], True)
    P, e_p, e_L = _crossentropy_bounds(logits, targets, V)  # as in test_crossentropy
    assert np.all(probs[:, :V][np.isinf(logits[:, :V])] == 0)
    close(probs[:, :V], torch.softmax(lg_t, -1), e_p, "crossentropy probs")
    ref_losses = F.cross_entropy(lg_t, torch.from_numpy(targets).long(), reduction="none")
    close(losses, ref_losses, e_L, "crossentropy losses")


def test_crossentropy_gpt2_vocab_row(kern, rng):
    # one full-size row: 50257 terms in the normaliser, padded to 50304
    N, V, Vp = 2, 50257, 50304
    logits = randn(rng, N, Vp, scale=4)
    logits[:, V:] = -1e4
    targets = np.array([123, V - 1], np.int32)
    probs, losses = np.empty((N, Vp), np.float32), np.empty(N, np.float32)
    kern.crossentropy_softmax_forward(probs, losses, logits, targets, N, V, Vp, 0)
    lg_t = t64(logits[:, :V])
    P, e_p, e_L = _crossentropy_bounds(logits, targets, V)  # as in test_crossentropy
    close(probs[:, :V], torch.softmax(lg_t, -1), e_p, "crossentropy probs")
    close(losses, F.cross_entropy(lg_t, torch.from_numpy(targets).long(), reduction="none"), e_L,
          "crossentropy losses")
    assert np.all(probs[:, V:] == 0)


# ---------------------------------------------------------------- adamw


# the GPU's AdamW (the adamw codelet) always zeroes the gradient
@pytest.mark.parametrize("kern,zero_grad,grad_scale", [
    ("cpu", 0, 1.0), ("cpu", 1, 1.0), ("cpu", 1, 0.25), ("gpu", 1, 1.0), ("gpu", 1, 0.25)],
    indirect=["kern"])
def test_adamw_three_steps(kern, rng, zero_grad, grad_scale):
    # grad_scale (gradient clipping's factor) multiplies the gradient; a power of two, so the
    # scaled gradient is exact and the bounds below hold unchanged
    lr, b1, b2, eps, wd = 1e-3, 0.9, 0.999, 1e-8, 0.01
    # The kernel takes its hyperparameters as C floats, so it computes AdamW with them rounded
    # to fp32 (1 - 0.999f is 1.3e-5 away from 1 - 0.999, relatively): the float64 reference
    # runs with those same values, and the comparison measures the fp32 arithmetic only.
    lr, b1, b2, eps, wd = (float(np.float32(z)) for z in (lr, b1, b2, eps, wd))
    shapes = [(40, 16), (16,), (7, 3, 5), (100003,)]  # one above the parallel threshold
    sizes = [math.prod(s) for s in shapes]
    n = sum(sizes)
    params = randn(rng, n)
    m, v = np.zeros(n, np.float32), np.zeros(n, np.float32)
    grads_c = np.empty(n, np.float32)

    tparams = [t64(p.reshape(s), True) for p, s in zip(np.split(params, np.cumsum(sizes)[:-1]), shapes)]
    opt = torch.optim.AdamW(tparams, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)

    def ref_state():
        flat = lambda ts: np.concatenate([f64(t).reshape(-1) for t in ts])  # noqa: E731
        st = [opt.state[p] for p in tparams]
        if not st[0]:
            return flat(tparams), np.zeros(n), np.zeros(n)
        return flat(tparams), flat(s["exp_avg"] for s in st), flat(s["exp_avg_sq"] for s in st)

    # error bounds of the kernel's p, m (absolute) and v (relative), carried step to step
    e_p, e_m, rel_v = np.zeros(n), np.zeros(n), 0.0
    for step in range(1, 4):
        g = randn(rng, n, scale=0.1)
        g[:50] = 0.0  # no gradient: moments decay, weight decay still applies
        g[50:60] *= 1e-6  # sqrt(vhat) comparable to eps
        grads_c[:] = g
        kern.adamw_update(params, grads_c, m, v, n, lr, b1, b2, eps, wd, step, zero_grad,
                         grad_scale)
        if zero_grad:
            assert np.all(grads_c == 0)
        else:
            assert np.array_equal(grads_c, g)   # the unscaled gradient, left as it was
        P0, M0, _ = ref_state()
        g = g * np.float32(grad_scale)    # exact (a power of two)
        for p_t, g_part in zip(tparams, np.split(g, np.cumsum(sizes)[:-1])):
            p_t.grad = t64(g_part.reshape(p_t.shape))
        opt.step()
        opt.zero_grad()
        P1, M1, V1 = ref_state()

        ag = np.abs(f64(g))
        # m = b1 m + (1 - b1) g: 1 - b1 is exact (Sterbenz), two products and the sum round
        e_m = b1 * e_m + gamma(2) * (b1 * np.abs(M0) + (1 - b1) * ag)
        # v = b2 v + ((1 - b2) g) g: all terms >= 0, so a relative bound; 3 roundings a step
        rel_v = rel_v + gamma(3)
        bc1, bc2 = 1 - b1**step, 1 - b2**step
        den = np.sqrt(V1 / bc2)
        # sqrt(v / bc2): half of v's error, bc2 rounded to float, the division, sqrt (3)
        rel_den = (rel_v + gamma(2)) / 2 + U
        ratio = (M1 / bc1) / (den + eps)
        # ratio = (m / bc1) / (den + eps): m's error and bc1's rounding and the division on
        # mhat, den's error damped by den / (den + eps), the sum and the division
        e_ratio = ((e_m + gamma(2) * np.abs(M1)) / (bc1 * (den + eps))
                   + np.abs(ratio) * (rel_den * den / (den + eps) + gamma(2)))
        # p = p - lr (ratio + wd p): p's error scaled by 1 - lr wd, lr times ratio's error,
        # wd * p, the sum, the product by lr (3) and the subtraction (1) round
        e_p = (e_p * (1 - lr * wd) + lr * e_ratio
               + lr * gamma(3) * (np.abs(ratio) + wd * np.abs(P0)) + U * np.abs(P1))

    close(params, P1, e_p, "adamw params")
    close(m, M1, e_m, "adamw m")
    close(v, V1, rel_v * V1, "adamw v")


# ---------------------------------------------------------------- gradient norm (clipping)


@pytest.mark.parametrize("n", [1, 37, 4096, 100003, 1 << 21])  # 2^21: the GPU's block cap
def test_sum_of_squares(kern, rng, n):
    x = randn(rng, n, scale=3.0)
    out = np.zeros(1)
    kern.sum_of_squares(out, x, n)
    # float64: the squares of floats are exact, the n - 1 additions of non-negative terms
    # round: gamma64(n) * sum
    exact = np.sum(f64(x) ** 2)
    close(out[0], exact, gamma64(n) * exact, "sum_of_squares")
    # fixed blocks: the same bits whatever the team size (the GPU's grid depends on n alone:
    # the same bits on every run)
    got = []
    for k in (1, 2, 3):
        saved = lib.kernels_threads()
        lib.kernels_set_threads(k)
        try:
            kern.sum_of_squares(out, x, n)
        finally:
            lib.kernels_set_threads(saved)
        got.append(out[0])
    assert got[0] == got[1] == got[2], got


def test_sum_of_squares_fills_the_gpu(rng):
    """The gradient norm's first pass over a large tensor (wte: 38.6M) in at least 4 blocks per
    SM of an H100 (it was capped at 256), its partial sums in the worker's scratch: no
    allocation in the task (the emulation has no cudaMallocAsync)."""
    _emulated_only()
    x = randn(rng, 1 << 21)
    out = np.zeros(1)
    _grids()
    GPUKernels().sum_of_squares(out, x, x.size)
    grids = _grids()
    assert max(grids) >= 4 * H100_SMS and len(grids) == 2, grids
    exact = np.sum(f64(x) ** 2)
    close(out[0], exact, gamma64(x.size) * exact, "sum_of_squares")


def test_sum_f64(kern):
    x = np.array([1e16, 1.0, -1e16, 3.0])
    out = np.zeros(1)
    kern.sum_f64(out, x, 4)
    assert out[0] == ((1e16 + 1.0) - 1e16) + 3.0        # left to right, as documented


def test_clip_scale():
    # min(1, C / (||g|| + 1e-6)), ||g|| = sqrt(sumsq); the result rounded to fp32 once
    for sumsq, c in [(4.0, 1.0), (0.25, 1.0), (1e-20, 0.5), (1e6, 3.0)]:
        want = min(1.0, c / (math.sqrt(sumsq) + 1e-6))
        got = lib.clip_scale(sumsq, c)
        assert abs(got - want) <= (U + gamma64(4)) * want, (sumsq, c, got, want)   # fp32 of a float64
    assert lib.clip_scale(0.0, 1.0) == 1.0


# ---------------------------------------------------------------- util


@pytest.mark.parametrize("n", [37, 100003])
def test_fill_zero_add_inplace(kern, rng, n):
    x = randn(rng, n)
    kern.fill_zero(x, n)
    assert np.all(x == 0)
    a, b = randn(rng, n), randn(rng, n)
    expect = a + b
    kern.add_inplace(a, b, n)
    assert np.array_equal(a, expect)


def test_load_batch():
    tokens = np.array([5, 50256, 65535, 0, 1, 2, 3, 40000, 9, 10], np.uint16)  # > int16 range
    pos, n = 1, 6
    inputs = np.full(n, -1, np.int32)
    targets = np.full(n, -1, np.int32)
    lib.load_batch(ip(inputs), ip(targets), u16p(tokens), pos, n)
    assert inputs.tolist() == tokens[pos : pos + n].astype(np.int64).tolist()
    assert targets.tolist() == tokens[pos + 1 : pos + n + 1].astype(np.int64).tolist()


# ---------------------------------------------------------------- key/value cache (generation)


def _kv_cache(qkv, NH, maxT, fill):
    """Caches kcache, vcache (B,NH,maxT,hs) holding the keys and values of qkv's T positions;
    positions >= T hold `fill`."""
    B, T, C3 = qkv.shape
    C = C3 // 3
    hs = C // NH
    caches = []
    for part in (1, 2):
        cache = np.full((B, NH, maxT, hs), fill, np.float32)
        cache[:, :, :T] = qkv[..., part * C:(part + 1) * C].reshape(B, T, NH, hs).transpose(0, 2, 1, 3)
        caches.append(cache)
    return caches


def _decode_rows(B, Tn, pos, S, rng):
    """idx (B*Tn, 3) of a step bringing positions pos..pos+Tn-1 of sequences 0..B-1, which sit
    in B distinct slots among S (chosen at random), the rows in a random order; the rows'
    (b, i); the slots."""
    slots = rng.permutation(S)[:B]
    bi = [(r // Tn, r % Tn) for r in rng.permutation(B * Tn)]
    idx = np.array([(0, slots[b], pos + i) for b, i in bi], np.int32).reshape(-1, 3)
    return idx, bi, slots


@pytest.mark.parametrize("B,Tn,pos", [(1, 1, 0), (2, 1, 7), (2, 3, 5)])
def test_kv_append(kern, rng, B, Tn, pos):
    C, NH, maxT, S = 24, 3, 12, 4
    qkv = randn(rng, B, pos + Tn, 3 * C)
    k0, v0 = _kv_cache(qkv[:, :pos], NH, maxT, fill=7.0)  # 7: a marker for the empty positions
    idx, bi, slots = _decode_rows(B, Tn, pos, S, rng)
    k = np.full((S, NH, maxT, C // NH), 5.0, np.float32)  # 5: the slots of no sequence
    v = k.copy()
    k[slots], v[slots] = k0, v0
    new = np.ascontiguousarray([qkv[b, pos + i] for b, i in bi])
    kern.kv_append(k, v, new, idx, B * Tn, C, NH, maxT)
    k_ref, v_ref = _kv_cache(qkv, NH, maxT, fill=7.0)
    # a copy, so exact; the positions before pos and after pos + Tn, and the other slots, kept
    assert np.array_equal(k[slots], k_ref) and np.array_equal(v[slots], v_ref)
    others = np.setdiff1d(np.arange(S), slots)
    assert np.all(k[others] == 5.0) and np.all(v[others] == 5.0)


def _attention_decode_case(kern, rng, B, Tn, pos, C, NH, qscale=1.0):
    """attention_decode of Tn new positions after pos cached ones, against rows pos.. of causal
    attention over all T = pos + Tn positions (torch, float64). The bound is
    _attention_bounds' for those rows: the kernel computes each row with the same operations
    in the same order as attention_forward (csrc/kernels/attend.h), over the same keys. The
    sequences sit in slots among others that hold NaN, their rows in a random order; one more
    row, the first position of another sequence in a slot of its own, shares the step."""
    T, maxT, S = pos + Tn, pos + Tn + 3, B + 3
    qkv = randn(rng, B, T, 3 * C)
    qkv[..., :C] *= qscale
    # positions >= T are NaN: a read of one (not causal) would make the output NaN, a failure
    k0, v0 = _kv_cache(qkv, NH, maxT, fill=np.nan)
    idx, bi, slots = _decode_rows(B, Tn, pos, S - 1, rng)
    k = np.full((S, NH, maxT, C // NH), np.nan, np.float32)
    v = k.copy()
    k[slots], v[slots] = k0, v0
    lone = randn(rng, 3 * C)              # the other sequence: its position 0, in slot S-1
    k[S - 1, :, 0], v[S - 1, :, 0] = lone[C:2 * C].reshape(NH, -1), lone[2 * C:].reshape(NH, -1)
    idx = np.concatenate([idx, [[0, S - 1, 0]]]).astype(np.int32)
    new = np.ascontiguousarray([qkv[b, pos + i] for b, i in bi] + [lone])
    out = np.full((len(idx), C), np.nan, np.float32)
    kern.attention_decode(out, new, k, v, idx, len(idx), C, NH, maxT)
    ref_out = _attention_ref(t64(qkv), B, T, C, NH)[0]
    bd = _attention_bounds(qkv, np.zeros((B, T, C), np.float32), B, T, C, NH)
    got = np.full((B, Tn, C), np.nan, np.float32)
    for r, (b, i) in enumerate(bi):
        got[b, i] = out[r]
    close(got, f64(ref_out)[:, pos:], bd["out"][:, pos:], "attention_decode out")
    # a query alone attends to its own value with weight 1 (exp(0) / exp(0)): exact
    assert np.array_equal(out[-1], lone[2 * C:]), "the lone row"


@pytest.mark.parametrize("B,Tn,pos,C,NH", [(1, 1, 0, 16, 2), (2, 1, 9, 48, 4), (2, 3, 5, 36, 3)])
def test_attention_decode_small(kern, rng, B, Tn, pos, C, NH):
    _attention_decode_case(kern, rng, B, Tn, pos, C, NH)


def test_attention_decode_gpt2_width(kern, rng):
    # one row on the task's thread (too little work for a team: kvcache.c)
    _attention_decode_case(kern, rng, B=1, Tn=1, pos=63, C=768, NH=12)


def test_attention_decode_team(kern, rng):
    # rows x heads x positions enough for the OpenMP team (kvcache.c)
    _attention_decode_case(kern, rng, B=2, Tn=3, pos=120, C=128, NH=4)


def test_attention_decode_large_scores(kern, rng):
    # scores of +-100s, as test_attention_large_scores
    _attention_decode_case(kern, rng, B=2, Tn=2, pos=6, C=32, NH=2, qscale=60.0)
