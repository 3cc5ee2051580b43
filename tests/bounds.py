"""fp32 rounding-error bounds for the numerical tests.

Every tolerance in the suite comes from here or states its own derivation next to it; none is
scaled from errors seen on one machine. The CPU (AVX2 or AVX-512, FMA or not), OpenBLAS's
kernel family, OpenMP's reduction order and PyTorch's dispatch all change the order and the
fusing of fp32 operations, but none of them escapes these bounds, which hold for any order.

Standard model (Higham, Accuracy and Stability of Numerical Algorithms, ch. 2-3): each fp32
operation returns op(a, b) (1 + d), |d| <= u = 2^-24. A sum or dot product of n terms
computed in any order (with or without FMA) satisfies

    |computed - exact| <= gamma(n) * sum |terms|,    gamma(n) = n u / (1 - n u).

For a matmul the "sum |terms|" of entry (i, j) is (|A| @ |B|)[i, j]. Inputs that are fp32
values are exact; the float64 reference has an error ~2^-53 relative, negligible here.
"""
from __future__ import annotations

import numpy as np

from starpu_llm._kernels import lib as _klib

FLASH_TILE = _klib.SL_FLASH_TILE   # the fused attention's tiles of keys (kernels.h)

U = 2.0 ** -24            # unit roundoff of fp32 (round to nearest)


def gamma(n: float) -> float:
    """Higham's gamma_n = n u / (1 - n u): the relative bound of n chained fp32 roundings."""
    nu = n * U
    assert nu < 0.5, f"gamma({n}) is meaningless in fp32"
    return nu / (1.0 - nu)


def dot_bound(n: int, abs_terms, c: float = 1.0):
    """Elementwise bound of a computed sum/dot of n terms: c * gamma(n) * sum|terms|
    (abs_terms: the sum of |terms| per entry, e.g. |A| @ |B| in float64)."""
    return c * gamma(n) * np.asarray(abs_terms, dtype=np.float64)


def assert_within(actual, expected, bound, what: str = ""):
    """|actual - expected| <= bound elementwise (bound broadcast); reports the worst entry
    and how close to its bound it came."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    bound = np.broadcast_to(np.asarray(bound, dtype=np.float64), expected.shape)
    err = np.abs(actual - expected)
    bad = ~(err <= bound)          # NaN counts as a failure
    if bad.any():
        idx = np.unravel_index(np.argmax(np.where(bad, err - bound, -np.inf)), err.shape)
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {err.size} entries outside the fp32 bound; worst at "
            f"{tuple(int(i) for i in idx)}: |{actual[idx]!r} - {expected[idx]!r}| = "
            f"{err[idx]:.3e} > bound {bound[idx]:.3e}")


# ---- kernels
# Used by tests/test_kernels.py: array versions of gamma, the accuracy of the kernels' exp
# (csrc/kernels/vexpf.h) and the bound of a max-shifted softmax.

U64 = 2.0 ** -53          # unit roundoff of float64: the one sum the kernels keep in double

# An ulp of a normal fp32 value y is at most 2^-23 |y| = 2u |y|.
ULP_REL = 2.0 * U

# vexpf (csrc/kernels/vexpf.h) documents "relative error ~2 ulp" (Cody-Waite reduction, degree-7
# Taylor polynomial with truncation < 2^-27, plain IEEE float operations). Taken as 2 ulp = 4u
# relative. (An exhaustive run over every float in [-87, 88], with and without FMA contraction,
# stays below 1.3 ulp = 1.8u, so the documented figure is an upper bound.)
VEXPF_ULP = 2.0
VEXPF_REL = VEXPF_ULP * ULP_REL

# vexpf returns +0 below -87 instead of exp(x) < e^-87; an argument carrying a rounding error
# (< 1 in every test) moves that to < e^-86. An absolute error of at most EXP_FLOOR on such an
# exp, which after a max-shifted normalisation (sum >= 1) stays an absolute error <= EXP_FLOOR
# on a probability. It also covers fp32 subnormal results (absolute rounding 2^-150).
EXP_FLOOR = float(np.exp(-86.0))


def gamma_n(n):
    """gamma() element-wise for an array of counts of roundings."""
    nu = np.asarray(n, dtype=np.float64) * U
    assert np.all(nu < 0.5), "gamma_n: n u >= 1/2"
    return nu / (1.0 - nu)


def gamma64(n):
    """gamma_n in float64 arithmetic (unit roundoff 2^-53)."""
    nu = np.asarray(n, dtype=np.float64) * U64
    assert np.all(nu < 0.5)
    return nu / (1.0 - nu)


def exp_rel(eta):
    """Relative error bound of vexpf(x) against exp(X) when |x - X| <= eta:
    e^{+-eta} (1 +- 4u) lies within e^{+-(eta + 4u)}, so expm1(eta + VEXPF_REL)."""
    return np.expm1(np.asarray(eta, dtype=np.float64) + VEXPF_REL)


def softmax_bound(P, phi, g, axis=-1):
    """Element-wise bound of a computed max-shifted softmax against the exact one P.

    The kernel's e_j = exp(z_j) (1 + f_j), |f_j| <= phi_j (phi from exp_rel: the error of z_j
    itself, which the shift by the row max would otherwise hide, is in phi; an error of the
    max shifts every z_j alike and cancels in the normalisation), and the normalisation (sum,
    reciprocal, product) adds a relative error <= g (a gamma of its roundings). Then
    p_j / P_j = (1 + f_j) / (1 + sum_k P_k f_k) (1 + g'), so
        |p_j - P_j| <= P_j ((1 + phi_j)(1 + g) / (1 - S) - 1),   S = sum_k P_k phi_k,
    plus EXP_FLOOR for an exp that vexpf flushed to zero."""
    P = np.asarray(P, dtype=np.float64)
    phi = np.asarray(phi, dtype=np.float64)
    S = (P * phi).sum(axis=axis, keepdims=True)
    assert np.all(S < 0.5)
    return P * ((1.0 + phi) * (1.0 + g) / (1.0 - S) - 1.0) + EXP_FLOOR


# ---- whole model
# Bounds for comparing two fp32 runs of the whole GPT-2 (an engine against the fp32 torch
# oracle, or two partitions of one engine). Used by test_model.py, test_parallel.py and
# test_mpi.py. Nothing here is scaled from an observed error.
#
# 1. Forward/backward at given parameters. Both runs approximate the same exact result, so
#    |a - b| <= bound(a) + bound(b): every bound below is twice a one-run bound. A one-run
#    bound follows the longest chain of dependent fp32 operations that produce the quantity.
#    Operation k of the chain returns its exact value up to a relative error gamma(n_k) of the
#    magnitude it handles (n_k = its reduction length for a sum/dot product, the number of
#    chained roundings for an elementwise function; an exp/tanh of <= 2 ulp counts 4). Adding
#    the per-operation bounds along the chain (first order) and gamma(a) + gamma(b) <=
#    gamma(a + b) give a relative error <= gamma(N) with N = sum n_k, the "chain length",
#    counted from the model's shapes in gpt2_chain_lengths() below.
#    What this takes for granted, stated rather than hidden: each operation passes on the
#    relative error of its inputs with a factor <= 1 when errors are measured against each
#    tensor's own scale (layernorm renormalises every block's input, softmax and GeLU have
#    slopes <= ~1.1, the residual adds keep the scale), i.e. the model is well conditioned at
#    these parameters (random init or a small perturbation of it). The matmuls' cancellation
#    (|A| @ |B| against |A @ B|, <= sqrt(n) for random signs) is the factor this neglects;
#    worst-case gamma(N) over-estimates a chain of N roundings of random sign by ~sqrt(N)
#    (30 to 560 here), which is larger. The scale of a compared tensor is its own max |x|
#    (per layer for the stacked (L, ...) tensors, per q, k, v part of qkvw, per row of wte:
#    slice_scales), taken from the reference run.
#    The reduction over the positions of the batch (weight gradients, the loss's mean) and
#    the reduction over the vocabulary are in the chains, so any order of them (sub-batches,
#    MPI ranks, thread counts, OpenBLAS kernels, FMA or not, torch's dispatch) stays inside.
#
# 2. AdamW steps. Adam divides by sqrt(v): where a gradient is ~0 (the key biases, whose
#    gradient is analytically zero, or any entry whose gradient is within its rounding error)
#    the two runs' rounding noise becomes steps of size ~lr of unrelated sign. The only bound
#    there is Adam's step size: |m_hat_t| / sqrt(v_hat_t) <= R(t) (adam_ratio_bound), so two
#    runs' steps differ by at most (|a| + R(t)) lr, a the reference's step (weight decay only
#    contracts the difference: p_t = (1 - lr wd) p_{t-1} - lr a_t in both).
#    Where the gradient is well above its rounding error the step is well determined: for
#    gradients differing by |delta_s| <= eta_s at steps s <= t,
#        |m_hat' - m_hat| <= A_t = sum_s c_s eta_s,          (m_hat = sum_s c_s g_s)
#        |sqrt(v_hat') - sqrt(v_hat)| <= W_t = ||eta||_w,   (sqrt(v_hat) = ||g||_w, Minkowski)
#    so the update a = m_hat / (sqrt(v_hat) + eps) moves by at most
#        (A_t + |a| W_t) / (sqrt(v_hat) - W_t + eps),
#    evaluated per entry from the reference run's moments (AdamDrift). The per-entry bound on
#    |p_a - p_b| is lr times the sum over steps of the smaller of the two, plus the update's
#    own fp32 rounding. What this covers: the rounding of every step. What it neglects (first
#    order): the gradients at step s are taken at parameters that already differ by the bound
#    of step s-1; the difference this makes to the gradients is not in eta_s. (The drift is
#    largest exactly where the loss is flat in that parameter, which keeps that effect small,
#    but it is not bounded here.)
#    The loss at step t is compared with the forward bound of the loss at the step's
#    parameters (1.): it covers the rounding of that step's forward pass, not the change of
#    the loss caused by the parameters having drifted apart (that is what the parameters'
#    check bounds). To first order that change is sum_i g_i (p_a - p_b)_i, a sum of terms of
#    unrelated signs; its worst case sum_i |g_i| drift_i (AdamDrift.loss_drift) is 2.4e-3
#    for the small test model (loss 4.6) but exceeds the loss itself for GPT-2 124M, where
#    the worst-case gradient bound (3.8e-2 relative) leaves most entries to Adam's step
#    bound, so it is reported, not added.


# ---- TF32 matmuls
# With TF32 (tensor cores; cuBLAS's CUBLAS_COMPUTE_32F_FAST_TF32) a GEMM converts each element
# of its two inputs to TF32, 10 explicit significand bits, rounded to nearest (PTX's
# cvt.rna.tf32.f32, as the CPU emulation does: unit roundoff TF32_U = 2^-11), before
# multiplying; products and sums stay fp32. One GEMM of reduction length n, per entry, on
# a' = a (1 + al), b' = b (1 + be), |al|, |be| <= TF32_U, then the fp32 sum of n products:
#     |computed - exact| <= tf32_gamma(n) (|A| @ |B|),
#     tf32_gamma(n) = (1 + TF32_U)^2 (1 + gamma(n)) - 1                   (tf32_dot_bound)
# i.e. 2 TF32_U + TF32_U^2 on top of the fp32 gamma(n). Along a chain (gpt2_chain_lengths'
# units, u each) one TF32 GEMM adds TF32_MATMUL = (2 TF32_U + TF32_U^2) / u, rounded up:
# 2^14 + 4. Along the logits' chain there are 6 GEMMs a block (qkv, scores, att @ v,
# attproj, fc, fcproj) and the lm head; along a gradient's, those, the head's backward
# (dlogits @ wte), 6 a block going down (fcproj, fc, attproj, datt, dq or dk, qkv) and the
# weight gradient's own GEMM. The fused attention's products are TF32 MMAs in its own
# tensor-core kernels (attention.cu), the same 6 a block, where the head size is a multiple of
# 8 up to SL_FLASH_MAX_HS (GPT-2's 64); with other head sizes they are fp32 FMAs in its scalar
# kernels: 4 a block each way (qkv, attproj, fc, fcproj). First order, as the rest of this
# section. Two runs of which one is in TF32 (the GPU against the fp32 oracle) are within the
# sum of their one-run bounds, gamma(N_tf32) + gamma(N_fp32): d12 at B = 1, T = 64
# (tests/test_gpu.py) gives logits within D12_TF32_LOGITS = 9.1 % of max |logits| with either
# attention (it was 35 %: truncation's 2^-10 taken for the conversion, and the TF32 chain
# counted for both runs).
TF32_U = 2.0 ** -11
TF32_MATMUL = int(np.ceil((2.0 * TF32_U + TF32_U ** 2) / U))
D12_TF32_LOGITS = 0.091


def flash_on_tensor_cores(hs: int) -> bool:
    """Whether the fused attention's TF32 kernels take head size hs (attention.cu,
    flash_tc_width): a multiple of 8 up to SL_FLASH_MAX_HS; else its fp32 kernels run."""
    return hs % 8 == 0 and hs <= _klib.SL_FLASH_MAX_HS


def tf32_gamma(n):
    """The relative bound of one TF32 GEMM entry against |A| @ |B| (see above)."""
    return (1.0 + TF32_U) ** 2 * (1.0 + gamma_n(n)) - 1.0


def tf32_dot_bound(n: int, abs_terms):
    """Elementwise bound of a TF32 GEMM's entries of reduction length n: tf32_gamma(n) *
    (|A| @ |B|) (abs_terms, float64)."""
    return tf32_gamma(n) * np.asarray(abs_terms, dtype=np.float64)


def gpt2_chain_lengths(config, B: int, T: int, tf32: bool = False,
                       attention: str = "gemm") -> dict:
    """Chain lengths N (see above) of the logits and of the gradients of GPT-2 (`config`:
    L, C, NH, V, Vp) on a (B, T) batch. Per operation (engine and torch alike):

      forward, one block (from its input x to its output):
        ln1: mean (C terms; then corrected by the mean of x - mean, whose C + 1
             roundings handle the spread and the last addition the mean: 2 more),
             centring (1), variance (C terms), /C + eps, sqrt, 1/ (3), normalise * w + b
             (4)                                                         2C + 12
        qkv: dot over C + bias                                          C + 1
        scores q.k over hs, * 1/sqrt(hs)                                 hs + 1
        softmax: - max (1), exp (4), sum of <= T terms, 1/, *           T + 7
        att @ v: dot over <= T                                          T
        attproj: C + 1; residual add: 1; ln2: 2C + 12; fc: C + 1
        GeLU (tanh form: cube and polynomial 5, exp 4, 1 + e and 1/ 2, select * r 1,
              x * s 1; rounded up)                                      16
        fcproj: dot over 4C + bias 4C + 1; residual add: 1
        one block: 11C + 2T + hs + 54
      logits: embedding add (1) + L blocks + lnf (2C + 12) + head dot over C (C)
      backward, from the logits:
        dlogits = softmax - onehot, * 1/(BT): - max, exp, sum over V, 1/, *, -, *   V + 9
        d lnf output = dlogits @ wte: dot over Vp                       Vp
        lnf backward: the two sums over C, then ~10 roundings            C + 10
        one block, top to bottom: residual add 1, fcproj (dot over C) C, GeLU backward 24,
          fc (dot over 4C) 4C, ln2 C + 10, residual add 1, attproj C, attention (dot over
          hs, sum over <= T, 2 roundings, dot over <= T, 3) hs + 2T + 5, qkv (dot over 3C)
          3C, ln1 C + 10, residual add 1:                                11C + 2T + hs + 52
        the deepest gradient (wte's embedding rows, wpe): a sum over <= BT positions and
          the add to the head's part                                    BT + 1
      (every weight gradient is a sum over the BT positions of a chain no longer than this)
    attention "flash", the fused attention (csrc/kernels/flash.c, nt = ceil(T / tile)
    tiles of keys), instead of the scores to att @ v above (hs + 2T + 8) and the attention
    backward (hs + 2T + 5):
      forward: scores hs + 1; exp(s - m) 5; the nt - 1 rescalings' exps 4 each; o's sum over
        <= T and its nt rescalings; l's sum over <= T and its nt rescalings, both into o / l
        (1)                                                             hs + 2T + 6 nt + 3
      backward: a = exp(s - lse) recomputed: log and + of lse 3, - and exp 5; dy . out (the
        row sum, dot over hs, beside da's); a (da - sum) 2 roundings; scale 3; dot over
        <= T                                                            hs + T + 13
    """
    C, L, V, Vp = config.C, config.L, config.V, config.Vp
    hs = C // config.NH
    if attention == "flash":
        nt = -(-T // FLASH_TILE)
        att_fwd, att_bwd = hs + 2 * T + 6 * nt + 3, hs + T + 13
    else:
        att_fwd, att_bwd = hs + 2 * T + 8, hs + 2 * T + 5
    logits = 1 + L * (11 * C + 46 + att_fwd) + (2 * C + 12) + C
    grads = (logits + (V + 9) + Vp + (C + 10) + L * (11 * C + 47 + att_bwd)
             + B * T + 1)
    if tf32:      # the TF32 matmuls along each chain (see above)
        scalar = attention == "flash" and not flash_on_tensor_cores(hs)
        g = 4 if scalar else 6      # a block's, each way
        logits += (g * L + 1) * TF32_MATMUL
        grads += (2 * g * L + 3) * TF32_MATMUL
    return {"logits": logits, "grads": grads}


def _two_runs(config, B: int, T: int, what: str, tf32: bool, attention: str = "gemm") -> float:
    """gamma(N_a) + gamma(N_b) of `what` ("logits" or "grads") for two runs, the first in fp32
    with the batched-GEMM attention (the oracle's), the second's matmuls in TF32 when tf32
    (the TF32 matmuls section) and its attention form `attention`."""
    return (gamma(gpt2_chain_lengths(config, B, T)[what])
            + gamma(gpt2_chain_lengths(config, B, T, tf32, attention)[what]))


def logits_bound(config, B: int, T: int, scale: float, tf32: bool = False,
                 attention: str = "gemm") -> float:
    """max |logits_a - logits_b| for two runs at the same parameters: 2 gamma(N_logits) scale,
    scale = max |logits| of the reference. tf32, attention: the second run's matmuls in TF32
    and its attention form (_two_runs: gamma(N_second) + gamma(N_fp32))."""
    return _two_runs(config, B, T, "logits", tf32, attention) * scale


def loss_bound(config, B: int, T: int, loss: float, logits_scale: float,
               tf32: bool = False, attention: str = "gemm") -> float:
    """|loss_a - loss_b| at the same parameters. One run: every logit is within
    delta = gamma(N_logits) logits_scale of exact; a cross-entropy log(sum_j e^{x_j - max}) -
    (x_t - max) moves by at most 2 delta under such errors (both terms are 1-Lipschitz in the
    max norm); its own rounding: the sum of V exps (4 each) has relative error gamma(V + 6),
    i.e. an absolute error gamma(V + 6) after the log, and log, + and - add gamma(3) of
    log V + |x_t - max| <= log V + 2 logits_scale; the mean over BT cross-entropies (>= 0)
    adds gamma(BT + 1) loss. Twice that for two runs."""
    two_d = _two_runs(config, B, T, "logits", tf32, attention) * logits_scale   # both runs' logits
    one = (gamma(config.V + 6) + gamma(3) * (np.log(config.V) + 2.0 * logits_scale)
           + gamma(B * T + 1) * loss)
    return 2.0 * two_d + 2.0 * one


def grad_rel_bound(config, B: int, T: int, tf32: bool = False, attention: str = "gemm") -> float:
    """|grad_a - grad_b| <= grad_rel_bound * max |grad| of the tensor's slice (slice_scales):
    2 gamma(N_grads) (tf32, attention: the second run's, _two_runs)."""
    return _two_runs(config, B, T, "grads", tf32, attention)


def slice_scales(layout, flat) -> dict:
    """{tensor name: max |x|} of a flat ParamLayout buffer (or of a dict of its tensors): the
    scale against which a tensor's rounding errors are measured. Per layer for the stacked
    (L, ...) tensors; for qkvw, per part q, k and v (three weights stored as one, each with
    its own chain: the k part's gradient comes from the attention scores and can be orders of
    magnitude below the others'); for wte, per row (row v's gradient is sum over positions of
    dlogits[., v] lnf[.] plus the embedding rows: a softmax's error is relative to each
    probability, so every row carries its own scale; the padded rows' is exactly 0 in both
    runs, as the logits beyond V never reach the loss). Not per part for qkvb: its k part's
    gradient is analytically zero (a constant added to every key's score cancels in the
    softmax), its computed value is a cancelled sum of terms as large as the q and v parts',
    and those are its scale. The result broadcasts against the tensor: a scalar, or shape
    (L, 1, ...), or (L, 3C, 1) for qkvw, or (Vp, 1) for wte."""
    out = {}
    views = flat if isinstance(flat, dict) else layout.views(flat)
    C = layout.config.C
    for n, x in views.items():
        a = np.abs(x)                      # a max is exact: float64 only afterwards
        if n == "wte":
            out[n] = a.max(axis=1, keepdims=True).astype(np.float64)
        elif n == "qkvw":
            parts = a.reshape(a.shape[0], 3, -1).max(axis=2).astype(np.float64)     # (L, 3)
            out[n] = np.repeat(parts, C, axis=1).reshape(a.shape[0], 3 * C, 1)
        elif layout.is_layered(n):
            out[n] = a.reshape(a.shape[0], -1).max(axis=1).astype(np.float64).reshape(
                (a.shape[0],) + (1,) * (a.ndim - 1))
        else:
            out[n] = np.float64(a.max())
    return out


def ratio(err, bound):
    """err / bound elementwise (<= 1 passes), with 0 / 0 = 0: a bound of 0 (an exactly zero
    gradient, such as wte's padded rows) admits only an error of 0."""
    err = np.asarray(err, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(err == 0, 0.0, err / np.asarray(bound, dtype=np.float64))


def adam_ratio_bound(t: int, beta1: float = 0.9, beta2: float = 0.999) -> float:
    """max over all gradient sequences of |m_hat_t| / sqrt(v_hat_t) (bias-corrected moments):
    with m_hat = sum_s c_s g_s and v_hat = sum_s w_s g_s^2, Cauchy-Schwarz gives
    R(t) = sqrt(sum_s c_s^2 / w_s), attained. R(1) = 1; for betas (0.9, 0.999) it grows to
    1.043 at t = 10 (above 1 since beta1^2 / beta2 > beta1^2: the moments weigh the past
    differently)."""
    s = np.arange(1, t + 1)
    c = (1 - beta1) * beta1 ** (t - s) / (1 - beta1 ** t)
    w = (1 - beta2) * beta2 ** (t - s) / (1 - beta2 ** t)
    return float(np.sqrt(np.sum(c * c / w)))


class AdamDrift:
    """Bounds for two AdamW trainings of one model from the same parameters, built from the
    reference run (see 2. above). Per step t, in order:
        loss_bound_t = drift.gradients(grads_t, loss_t, max |logits_t|)  # before the update
        drift.update(m_t, v_t, params_t)                                 # after it
    with the reference's flat float32 buffers in ParamLayout order, or dicts of its tensors
    (gradients at step t; moments and parameters after its update). `drift.bound` is then
    the per-entry bound on |params_a - params_b|. `grad_rel` is the relative bound of the two
    runs' gradients at one step (grad_rel_bound), applied to slice_scales of the reference's
    gradients; it also covers the fp32 rounding of the moments (about 3t roundings, far
    below it)."""

    def __init__(self, layout, B: int, T: int, lr: float, weight_decay: float,
                 grad_rel: float, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
                 tf32: bool = False, attention: str = "gemm"):
        self.layout, self.B, self.T = layout, B, T
        self.lr, self.wd, self.b1, self.b2, self.eps = lr, weight_decay, beta1, beta2, eps
        self.grad_rel = grad_rel
        self.tf32 = tf32          # one run's matmuls in TF32: its loss bounds (above)
        self.attention = attention  # and its attention's form
        self.bound = np.zeros(layout.total, np.float64)
        self.t = 0
        self.loss_drift = []
        self._e1, self._e2 = {}, {}

    def gradients(self, grads, loss: float, logits_scale: float) -> float:
        """Records this step's gradient bounds; returns the bound of this step's loss (the
        forward bound at the step's parameters, see 2. above) and appends the worst-case
        first-order effect of the drift so far, sum_i |g_i| drift_i, to self.loss_drift."""
        scales = slice_scales(self.layout, grads)
        first_order = 0.0
        for n, g in self._views(grads).items():
            eta = self._rows(n, self.grad_rel * scales[n])
            self._e1[n] = self.b1 * self._e1.get(n, 0.0) + (1 - self.b1) * eta
            self._e2[n] = self.b2 * self._e2.get(n, 0.0) + (1 - self.b2) * eta * eta
            g2 = self._rows(n, g)
            for rows, drift in self._chunks(n):
                first_order += float(np.dot(np.abs(g2[rows].astype(np.float64)).ravel(),
                                            drift.ravel()))
        self.loss_drift.append(first_order)
        return loss_bound(self.layout.config, self.B, self.T, loss, logits_scale, self.tf32,
                          self.attention)

    def update(self, m, v, params):
        self.t += 1
        t, lr = self.t, self.lr
        R = adam_ratio_bound(t, self.b1, self.b2)
        bc1, bc2 = 1 - self.b1 ** t, 1 - self.b2 ** t
        mv, vv, pv = (self._views(x) for x in (m, v, params))
        for n in self.layout.names:
            A = np.broadcast_to(self._e1[n] / bc1, (self._rows(n, mv[n]).shape[0], 1))
            W = np.broadcast_to(np.sqrt(self._e2[n] / bc2), A.shape)
            for rows, drift in self._chunks(n):
                a_, w_ = A[rows], W[rows]
                N = np.sqrt(self._rows(n, vv[n])[rows].astype(np.float64) / bc2)
                a = np.abs(self._rows(n, mv[n])[rows].astype(np.float64)) / bc1 / (N + self.eps)
                step = np.minimum(a + R, (a_ + a * w_) / (np.maximum(N - w_, 0.0) + self.eps))
                p = np.abs(self._rows(n, pv[n])[rows].astype(np.float64)) + drift
                # the update's own rounding in each run, on |p| of either run: p (1 - lr wd)
                # or p - lr wd p (3 roundings), lr m_hat / (sqrt(v_hat) + eps) (8)
                rounding = 2.0 * (gamma(3) * p + gamma(8) * lr * (R + self.wd * p))
                drift += lr * step + rounding

    # Tensors are walked as 2-D (rows, columns) arrays whose rows carry one scale each
    # (slice_scales: a layer, a q/k/v part of a layer's qkvw, a wte row; one row for the
    # unstacked tensors), in chunks of rows that stay in cache.
    _CHUNK = 1 << 16

    def _rows(self, n, x):
        """x (tensor n, or its per-slice scales) as 2-D: (rows, columns)."""
        x = np.asarray(x)
        if x.ndim == 0:
            return x.reshape(1, 1)
        shape = self.layout.shapes[n]
        if n == "wte":
            return x.reshape(shape[0], -1)
        if n == "qkvw":
            return x.reshape(shape[0] * shape[1], -1)
        if self.layout.is_layered(n):
            return x.reshape(shape[0], -1)
        return x.reshape(1, -1)

    def _chunks(self, n):
        """(row slice, view of the float64 bound for those rows) over tensor n."""
        b = self._rows(n, self._view(n))
        step = max(1, self._CHUNK // b.shape[1])
        for r in range(0, b.shape[0], step):
            rows = slice(r, r + step)
            yield rows, b[rows]

    def _views(self, x):
        return x if isinstance(x, dict) else self.layout.views(x)

    def _view(self, n):
        """Tensor n of the float64 per-entry bound (a view)."""
        o, shape = self.layout.offsets[n], self.layout.shapes[n]
        return self.bound[o:o + int(np.prod(shape))].reshape(shape)


# ---- gradient clipping
# Clipping (torch.nn.utils.clip_grad_norm_) multiplies every gradient by
# s = min(1, C / (n + 1e-6)), n the global L2 norm of all gradients. Two runs whose gradients
# differ by |g_a - g_b| <= eta = grad_rel * slice scale (per entry, as above):
#   - the exact norms of their gradients differ by at most ||eta||_2 (the triangle inequality),
#     and each run computes its norm from per-tensor sums of squares (k terms, the squares
#     rounded: gamma(k + 1)), their square roots (u), the sum of the P per-tensor squares
#     (gamma(P + 1)) and its square root (u): a relative error <= gamma(k + P + 6) (fp32,
#     torch; the engines sum in float64, far below it). So
#         |n_a - n_b| <= ||eta||_2 + 2 gamma(k_max + P + 6) n        (gradnorm_bound)
#   - min(1, C / (x + 1e-6)) moves by at most |x - y| / (min(x, y) + 1e-6) relative, and its
#     own computation rounds (+, /, the clamp, a conversion: gamma(4)); where both runs'
#     norms stay below C - 1e-6 neither clips, s = 1 exactly:
#         ds = |s_a - s_b| / s_b <= |n_a - n_b| / (n_b - |n_a - n_b|) + gamma(4)
#   - the clipped gradients then differ by
#         |s_a g_a - s_b g_b| <= s_b eta + ds s_b |g_a| + 2 u s |g|
#     which, relative to the slice scale of the reference's clipped gradient s_b g_b, is
#         grad_rel + ds (1 + grad_rel) + 2u                           (clipped_grad_rel)
#     the gradient bound AdamDrift takes for that step.
# First order, as the rest of the section.


def gradnorm_bound(layout, grads, grad_rel: float, partials: int) -> float:
    """|n_a - n_b| for two runs' global gradient norms (see above): grads the reference's
    (unclipped) gradients, a flat ParamLayout buffer or a dict of its tensors; partials the
    number of per-tensor sums of squares (the larger of the two runs')."""
    views = grads if isinstance(grads, dict) else layout.views(grads)
    scales = slice_scales(layout, views)
    eta2 = sum(float(np.sum(np.broadcast_to(grad_rel * scales[n], np.shape(g)) ** 2))
               for n, g in views.items())
    norm = float(np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in views.values())))
    k_max = max(int(np.size(g)) for g in views.values())
    return float(np.sqrt(eta2)) + 2.0 * gamma(k_max + partials + 6) * norm


def clipped_grad_rel(norm: float, norm_bound: float, max_norm: float, grad_rel: float) -> float:
    """The relative gradient bound of two runs after clipping to max_norm (see above): norm
    the reference's global norm, norm_bound gradnorm_bound."""
    if (norm + norm_bound + 1e-6) * (1.0 + gamma(4)) <= max_norm:
        return grad_rel                      # neither run clips: s = 1 exactly
    assert norm_bound < norm, "the norm's bound is as large as the norm: nothing to compare"
    ds = norm_bound / (norm - norm_bound) + gamma(4)
    return grad_rel + ds * (1.0 + grad_rel) + 2.0 * U
