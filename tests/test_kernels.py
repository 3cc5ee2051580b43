"""Every C kernel (csrc/kernels) against PyTorch autograd computed in float64.

The kernels compute in float32, so each comparison uses the tightest tolerance fp32 allows
for that computation (stated per test as RTOL/ATOL; the observed errors are 3-30x smaller),
and structural properties (padding, causality, accumulate vs write) are checked exactly.
"""

import math
import zlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from starpu_llm._clib import ffi, lib


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


def close(actual, expected, rtol, atol):
    if isinstance(expected, torch.Tensor):
        expected = expected.detach().numpy()
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol)


@pytest.fixture
def rng(request):
    # a fixed seed per test: reproducible failures
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


# ---------------------------------------------------------------- encoder


def test_encoder_forward_backward_repeated_tokens(rng):
    B, T, C, Vp, maxT = 2, 7, 24, 40, 10
    RTOL, ATOL = 1e-6, 1e-6  # sums of a few floats
    inp = rng.integers(0, 4, size=(B, T)).astype(np.int32)  # ids repeat within and across rows
    inp[0, 0] = inp[0, 1] = inp[1, 1] = 3
    wte, wpe = randn(rng, Vp, C), randn(rng, maxT, C)
    out = np.full((B, T, C), np.nan, np.float32)
    lib.encoder_forward(fp(out), ip(inp), fp(wte), fp(wpe), B, T, C)

    wte_t, wpe_t = t64(wte, True), t64(wpe, True)
    ref = wte_t[torch.from_numpy(inp).long()] + wpe_t[:T]
    close(out, ref, RTOL, ATOL)

    dout = randn(rng, B, T, C)
    ref.backward(t64(dout))
    dwte0, dwpe0 = randn(rng, Vp, C), randn(rng, maxT, C)  # backward accumulates into these
    dwte, dwpe = dwte0.copy(), dwpe0.copy()
    lib.encoder_backward(fp(dwte), fp(dwpe), fp(dout), ip(inp), B, T, C)
    close(dwte, dwte0 + wte_t.grad.numpy(), RTOL, ATOL)
    close(dwpe, dwpe0 + wpe_t.grad.numpy(), RTOL, ATOL)
    unused = np.setdiff1d(np.arange(Vp), inp)
    assert np.array_equal(dwte[unused], dwte0[unused])
    assert np.array_equal(dwpe[T:], dwpe0[T:])


def test_encoder_backward_gpt2_width_many_repeats(rng):
    # wide enough that every thread owns several channel blocks, all tokens the same id
    B, T, C, Vp = 4, 64, 768, 50
    inp = np.full((B, T), 7, np.int32)
    inp[1] = rng.integers(0, Vp, size=T)
    dout = randn(rng, B, T, C)
    dwte, dwpe = np.zeros((Vp, C), np.float32), np.zeros((T, C), np.float32)
    lib.encoder_backward(fp(dwte), fp(dwpe), fp(dout), ip(inp), B, T, C)
    ref_wte = np.zeros((Vp, C))
    np.add.at(ref_wte, inp.reshape(-1), dout.reshape(-1, C).astype(np.float64))
    close(dwte, ref_wte, 1e-5, 1e-5)  # up to 193 float additions per entry
    close(dwpe, dout.astype(np.float64).sum(0), 1e-6, 1e-6)


# ---------------------------------------------------------------- layernorm


def _layernorm_case(rng, N, C, RTOL, ATOL):
    # a non-zero mean and a spread of scales per row: the two-pass variance must cope
    inp = (randn(rng, N, C) * rng.uniform(0.1, 5, (N, 1)) + rng.uniform(-3, 3, (N, 1))).astype(
        np.float32
    )
    w, b = randn(rng, C), randn(rng, C)
    out = np.full((N, C), np.nan, np.float32)
    mean = np.full(N, np.nan, np.float32)
    rstd = np.full(N, np.nan, np.float32)
    lib.layernorm_forward(fp(out), fp(mean), fp(rstd), fp(inp), fp(w), fp(b), N, C)

    x_t, w_t, b_t = t64(inp, True), t64(w, True), t64(b, True)
    ref = F.layer_norm(x_t, (C,), w_t, b_t, eps=1e-5)
    x64 = inp.astype(np.float64)
    close(out, ref, RTOL, ATOL)
    close(mean, x64.mean(1), RTOL, ATOL)
    close(rstd, 1 / np.sqrt(x64.var(1) + 1e-5), RTOL, ATOL)

    dout = randn(rng, N, C)
    ref.backward(t64(dout))
    for accumulate in (0, 1):
        dinp0 = randn(rng, N, C)
        dw0, db0 = randn(rng, C), randn(rng, C)
        dinp, dw, db = dinp0.copy(), dw0.copy(), db0.copy()
        lib.layernorm_backward(
            fp(dinp), fp(dw), fp(db), fp(dout), fp(inp), fp(w), fp(mean), fp(rstd), N, C, accumulate
        )
        expect = x_t.grad.numpy() + (dinp0 if accumulate else 0)
        close(dinp, expect, RTOL, ATOL)
        close(dw, dw0 + w_t.grad.numpy(), RTOL, ATOL)
        close(db, db0 + b_t.grad.numpy(), RTOL, ATOL)


def test_layernorm_small(rng):
    _layernorm_case(rng, N=2 * 7, C=40, RTOL=2e-6, ATOL=2e-6)


def test_layernorm_gpt2_width(rng):
    # C=768 float reductions, and dweight sums 64 rows of products
    _layernorm_case(rng, N=64, C=768, RTOL=5e-6, ATOL=1e-5)


# ---------------------------------------------------------------- matmul


def _matmul_case(rng, N, C, OC, use_bias, RTOL, ATOL):
    inp, weight = randn(rng, N, C), randn(rng, OC, C, scale=1 / math.sqrt(C))
    bias = randn(rng, OC) if use_bias else None
    out = np.full((N, OC), np.nan, np.float32)
    lib.matmul_forward(fp(out), fp(inp), fp(weight), fp(bias) if use_bias else ffi.NULL, N, C, OC)
    x_t, w_t = t64(inp, True), t64(weight, True)
    b_t = t64(bias, True) if use_bias else None
    ref = F.linear(x_t, w_t, b_t)
    close(out, ref, RTOL, ATOL)

    dout = randn(rng, N, OC)
    ref.backward(t64(dout))
    dinp = np.full((N, C), np.nan, np.float32)  # written, not accumulated
    dw0 = randn(rng, OC, C)
    dw = dw0.copy()
    db0 = randn(rng, OC)
    db = db0.copy()
    lib.matmul_backward(
        fp(dinp), fp(dw), fp(db) if use_bias else ffi.NULL, fp(dout), fp(inp), fp(weight), N, C, OC
    )
    close(dinp, x_t.grad, RTOL, ATOL)
    close(dw, dw0 + w_t.grad.numpy(), RTOL, ATOL)
    if use_bias:
        close(db, db0 + b_t.grad.numpy(), RTOL, ATOL)
    else:
        assert np.array_equal(db, db0)


@pytest.mark.parametrize("use_bias", [True, False])
def test_matmul_small(rng, use_bias):
    _matmul_case(rng, N=2 * 5, C=24, OC=72, use_bias=use_bias, RTOL=3e-6, ATOL=3e-6)


@pytest.mark.parametrize("C,OC", [(768, 2304), (3072, 768)])
def test_matmul_gpt2_width(rng, C, OC):
    # sgemm sums of 768..3072 products of O(1) terms in fp32
    _matmul_case(rng, N=64, C=C, OC=OC, use_bias=True, RTOL=2e-5, ATOL=2e-5)


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


def _attention_case(rng, B, T, C, NH, RTOL, ATOL, qscale=1.0, GRAD_ATOL=None):
    qkv = randn(rng, B, T, 3 * C)
    qkv[..., :C] *= qscale
    out = np.full((B, T, C), np.nan, np.float32)
    preatt = np.full((B, NH, T, T), np.nan, np.float32)
    att = np.full((B, NH, T, T), np.nan, np.float32)
    lib.attention_forward(fp(out), fp(preatt), fp(att), fp(qkv), B, T, C, NH)

    qkv_t = t64(qkv, True)
    ref_out, ref_pre, ref_att, mask = _attention_ref(qkv_t, B, T, C, NH)
    ref_pre.retain_grad()
    ref_att.retain_grad()
    m = mask.numpy()
    close(out, ref_out, RTOL, ATOL)
    close(att, ref_att, RTOL, ATOL)
    close(preatt[..., ~m], ref_pre.detach().numpy()[..., ~m], RTOL, ATOL)
    assert np.all(preatt[..., m] == 0) and np.all(att[..., m] == 0)
    close(att.sum(-1), np.ones((B, NH, T)), 1e-6, 1e-6)

    dout = randn(rng, B, T, C)
    ref_out.backward(t64(dout))
    dqkv = np.full((B, T, 3 * C), np.nan, np.float32)  # written, not accumulated
    dpreatt = np.full((B, NH, T, T), np.nan, np.float32)
    datt = np.full((B, NH, T, T), np.nan, np.float32)
    lib.attention_backward(fp(dqkv), fp(dpreatt), fp(datt), fp(dout), fp(qkv), fp(att), B, T, C, NH)
    GRAD_ATOL = ATOL if GRAD_ATOL is None else GRAD_ATOL
    close(dqkv, qkv_t.grad, RTOL, GRAD_ATOL)
    close(dpreatt, ref_pre.grad, RTOL, GRAD_ATOL)  # torch's is 0 above the diagonal too
    close(datt[..., ~m], ref_att.grad.numpy()[..., ~m], RTOL, GRAD_ATOL)
    assert np.all(datt[..., m] == 0) and np.all(dpreatt[..., m] == 0)
    return qkv, out


@pytest.mark.parametrize("B,T,C,NH", [(2, 5, 16, 2), (2, 8, 48, 4), (1, 7, 36, 3)])
def test_attention_small(rng, B, T, C, NH):
    _attention_case(rng, B, T, C, NH, RTOL=2e-6, ATOL=2e-6)


def test_attention_gpt2_width(rng):
    _attention_case(rng, B=1, T=64, C=768, NH=12, RTOL=3e-5, ATOL=3e-6)


def test_attention_large_scores(rng):
    # scores of +-100s: exp would overflow without the max subtraction. The scores themselves
    # carry fp32 rounding of ~1e-5 absolute, which exp turns into ~1e-5 relative on att; in
    # the backward, datt - sum(att * datt) cancels for a peaked softmax, so the gradients
    # (|dqkv| up to ~100 here) get an absolute tolerance of 3e-5, ~3e-7 of their scale.
    _attention_case(rng, B=2, T=8, C=32, NH=2, RTOL=1e-4, ATOL=1e-6, qscale=60.0, GRAD_ATOL=3e-5)


def test_attention_is_causal(rng):
    B, T, C, NH = 2, 8, 32, 4
    qkv, out = _attention_case(rng, B, T, C, NH, RTOL=2e-6, ATOL=2e-6)
    t0 = 5
    qkv2 = qkv.copy()
    qkv2[:, t0:] = randn(rng, B, T - t0, 3 * C, scale=10)  # change q, k, v of tokens >= t0
    out2 = np.empty_like(out)
    pre, att = (np.empty((B, NH, T, T), np.float32) for _ in range(2))
    lib.attention_forward(fp(out2), fp(pre), fp(att), fp(qkv2), B, T, C, NH)
    assert np.array_equal(out2[:, :t0], out[:, :t0])
    assert not np.allclose(out2[:, t0:], out[:, t0:])


# ---------------------------------------------------------------- gelu


@pytest.mark.parametrize("n", [37, 100003])  # a SIMD tail; above the parallel threshold
def test_gelu(rng, n):
    RTOL, ATOL = 3e-6, 3e-7  # float32 evaluation of a tanh/exp formula
    x = randn(rng, n, scale=3)
    x[:8] = [0.0, -0.0, 1e-6, -1e-6, 12.0, -12.0, 60.0, -60.0]  # the tails saturate
    out = np.full(n, np.nan, np.float32)
    lib.gelu_forward(fp(out), fp(x), n)
    x_t = t64(x, True)
    ref = F.gelu(x_t, approximate="tanh")
    close(out, ref, RTOL, ATOL)
    dout = randn(rng, n)
    ref.backward(t64(dout))
    dinp = np.full(n, np.nan, np.float32)
    lib.gelu_backward(fp(dinp), fp(x), fp(dout), n)
    close(dinp, x_t.grad, RTOL, ATOL)


# ---------------------------------------------------------------- residual


@pytest.mark.parametrize("n", [37, 100003])
def test_residual(rng, n):
    a, b = randn(rng, n), randn(rng, n)
    out = np.full(n, np.nan, np.float32)
    lib.residual_forward(fp(out), fp(a), fp(b), n)
    assert np.array_equal(out, a + b)  # one float32 addition: exact
    dout = randn(rng, n)
    d1_0, d2_0 = randn(rng, n), randn(rng, n)
    d1, d2 = d1_0.copy(), d2_0.copy()
    lib.residual_backward(fp(d1), fp(d2), fp(dout), n)
    assert np.array_equal(d1, d1_0 + dout) and np.array_equal(d2, d2_0 + dout)  # accumulated


# ---------------------------------------------------------------- crossentropy


@pytest.mark.parametrize("N,V,Vp,scale", [(2 * 6, 37, 40, 3.0), (2 * 6, 37, 40, 40.0), (3, 5000, 5008, 5.0)])
def test_crossentropy(rng, N, V, Vp, scale):
    RTOL, ATOL = 1e-6, 1e-8  # probabilities and losses from exp/log in float32
    logits = randn(rng, N, Vp, scale=scale)
    logits[:, V:] = 1e4  # padding must be ignored (it would dominate the softmax)
    targets = rng.integers(0, V, size=N).astype(np.int32)
    targets[0], targets[1] = 0, V - 1
    probs = np.full((N, Vp), np.nan, np.float32)
    losses = np.full(N, np.nan, np.float32)
    lib.crossentropy_softmax_forward(fp(probs), fp(losses), fp(logits), ip(targets), N, V, Vp)

    lg_t = t64(logits[:, :V], True)
    tg_t = torch.from_numpy(targets).long()
    close(probs[:, :V], torch.softmax(lg_t, -1), RTOL, ATOL)
    assert np.all(probs[:, V:] == 0)
    ref_losses = F.cross_entropy(lg_t, tg_t, reduction="none")
    close(losses, ref_losses, RTOL, 1e-6)

    ref_losses.mean().backward()
    dloss = 1.0 / N
    dlogits = np.full((N, Vp), np.nan, np.float32)
    lib.crossentropy_softmax_backward(fp(dlogits), fp(probs), ip(targets), N, V, Vp, dloss)
    close(dlogits[:, :V], lg_t.grad, RTOL, ATOL * dloss)
    assert np.all(dlogits[:, V:] == 0)

    # in place: dlogits aliases probs
    inplace = probs.copy()
    lib.crossentropy_softmax_backward(fp(inplace), fp(inplace), ip(targets), N, V, Vp, dloss)
    assert np.array_equal(inplace, dlogits)


def test_crossentropy_gpt2_vocab_row(rng):
    # one full-size row: 50257 terms in the normaliser, padded to 50304
    N, V, Vp = 2, 50257, 50304
    logits = randn(rng, N, Vp, scale=4)
    logits[:, V:] = -1e4
    targets = np.array([123, V - 1], np.int32)
    probs, losses = np.empty((N, Vp), np.float32), np.empty(N, np.float32)
    lib.crossentropy_softmax_forward(fp(probs), fp(losses), fp(logits), ip(targets), N, V, Vp)
    lg_t = t64(logits[:, :V])
    close(probs[:, :V], torch.softmax(lg_t, -1), 2e-6, 1e-11)
    close(losses, F.cross_entropy(lg_t, torch.from_numpy(targets).long(), reduction="none"), 2e-7, 0)
    assert np.all(probs[:, V:] == 0)


# ---------------------------------------------------------------- adamw


@pytest.mark.parametrize("zero_grad", [0, 1])
def test_adamw_three_steps(rng, zero_grad):
    RTOL, ATOL = 1e-6, 1e-8  # float32 parameters (|p| ~ 1) vs a float64 torch run
    lr, b1, b2, eps, wd = 1e-3, 0.9, 0.999, 1e-8, 0.01
    shapes = [(40, 16), (16,), (7, 3, 5), (100003,)]  # one above the parallel threshold
    sizes = [math.prod(s) for s in shapes]
    n = sum(sizes)
    params = randn(rng, n)
    m, v = np.zeros(n, np.float32), np.zeros(n, np.float32)
    grads_c = np.empty(n, np.float32)

    tparams = [t64(p.reshape(s), True) for p, s in zip(np.split(params, np.cumsum(sizes)[:-1]), shapes)]
    opt = torch.optim.AdamW(tparams, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    for step in range(1, 4):
        g = randn(rng, n, scale=0.1)
        g[:50] = 0.0  # no gradient: moments decay, weight decay still applies
        g[50:60] *= 1e-6  # sqrt(vhat) comparable to eps
        grads_c[:] = g
        lib.adamw_update(fp(params), fp(grads_c), fp(m), fp(v), n, lr, b1, b2, eps, wd, step, zero_grad)
        if zero_grad:
            assert np.all(grads_c == 0)
        else:
            assert np.array_equal(grads_c, g)
        for p_t, g_part in zip(tparams, np.split(g, np.cumsum(sizes)[:-1])):
            p_t.grad = t64(g_part.reshape(p_t.shape))
        opt.step()
        opt.zero_grad()

    ref_p = np.concatenate([p.detach().numpy().reshape(-1) for p in tparams])
    ref_m = np.concatenate([opt.state[p]["exp_avg"].numpy().reshape(-1) for p in tparams])
    ref_v = np.concatenate([opt.state[p]["exp_avg_sq"].numpy().reshape(-1) for p in tparams])
    close(params, ref_p, RTOL, ATOL)
    # m and v are sums of terms of either sign / size: an absolute floor of a few ulp of the
    # moments' scale (|m| ~ 0.03, v ~ 3e-5) where they cancel to near zero
    close(m, ref_m, RTOL, 1e-8)
    # beta2 reaches C as float32: 1 - 0.999f is 1.3e-5 (relative) away from 1 - 0.999, so v
    # itself differs from torch's by that much; the step does not, because the bias
    # correction 1 - beta2^t carries the same factor (checked above at 1e-6)
    close(v, ref_v, 2e-5, 1e-11)
    close(v, ref_v * (1 - np.float64(np.float32(b2))) / (1 - b2), RTOL, 1e-11)


# ---------------------------------------------------------------- util


@pytest.mark.parametrize("n", [37, 100003])
def test_fill_zero_add_inplace(rng, n):
    x = randn(rng, n)
    lib.fill_zero(fp(x), n)
    assert np.all(x == 0)
    a, b = randn(rng, n), randn(rng, n)
    expect = a + b
    lib.add_inplace(fp(a), fp(b), n)
    assert np.array_equal(a, expect)


def test_load_batch():
    tokens = np.array([5, 50256, 65535, 0, 1, 2, 3, 40000, 9, 10], np.uint16)  # > int16 range
    pos, n = 1, 6
    inputs = np.full(n, -1, np.int32)
    targets = np.full(n, -1, np.int32)
    lib.load_batch(ip(inputs), ip(targets), u16p(tokens), pos, n)
    assert inputs.tolist() == tokens[pos : pos + n].astype(np.int64).tolist()
    assert targets.tolist() == tokens[pos + 1 : pos + n + 1].astype(np.int64).tolist()
