"""The bench's PyTorch series (starpu_llm/baselines/torch_sdpa.py: SDPA attention, per-layer
F.linear weights, tied head over the real vocabulary, fused AdamW) computes the same training
step as the readable oracle (starpu_llm/baselines/torch_gpt2.py), from the same llm.c-layout weights.

Bounds (tests/bounds.py, "whole model"): both are fp32 evaluations of the same exact function,
so each quantity is compared within the worst-case bound of two fp32 runs of it, whatever the
order of their sums (SDPA's fused kernel, fused AdamW):
  logits      max |diff| <= 2 gamma(N_logits) max |logits|                 (logits_bound)
  loss        loss_bound
  gradients   per slice, max |diff| <= 2 gamma(N_grads) max |grad of the slice|
              (grad_rel_bound x slice_scales)
  parameters  after one AdamW step, per entry, AdamDrift's bound (Adam's step bound where the
              gradient is ~0, the first-order change of the step under the gradients' bound
              elsewhere, plus the update's rounding).
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from starpu_llm.baselines.torch_sdpa import SdpaGPT2  # noqa: E402
from starpu_llm.model.config import AdamW, GPTConfig, ParamLayout  # noqa: E402
from starpu_llm.model.state import random_init  # noqa: E402
from starpu_llm.baselines.torch_gpt2 import TorchGPT2, batch  # noqa: E402

from bounds import (AdamDrift, assert_within, grad_rel_bound, logits_bound,  # noqa: E402
                    loss_bound, slice_scales)

SMALL = GPTConfig(max_seq_len=32, vocab_size=97, padded_vocab_size=128,
                  num_layers=2, num_heads=4, channels=32)
B, T, LR, WD = 4, 16, 1e-3, 0.01


@pytest.fixture(scope="module")
def runs():
    rng = np.random.default_rng(42)
    params = random_init(SMALL, seed=7)
    params += rng.standard_normal(params.size, dtype=np.float32) * np.float32(0.02)
    tokens = rng.integers(0, SMALL.V, size=4096).astype(np.uint16)
    x, y = batch(tokens, 0, B, T)
    torch.set_num_threads(2)
    oracle, fast = TorchGPT2(SMALL, params), SdpaGPT2(SMALL, params)
    out = {}
    for name, model in (("oracle", oracle), ("fast", fast)):
        logits, loss = model.forward_backward(x, y)
        out[name] = dict(logits=logits[..., :SMALL.V], loss=loss, grads=model.grads_flat())
        model.adamw_update(AdamW(LR, WD))
        out[name]["params"] = model.params_flat()
    st = oracle.optimizer.state
    out["oracle"]["m"] = {n: st[t]["exp_avg"].numpy() for n, t in oracle.params.items()}
    out["oracle"]["v"] = {n: st[t]["exp_avg_sq"].numpy() for n, t in oracle.params.items()}
    out["optimizer"] = fast.optimizer_kind
    return out


def test_same_logits_and_loss(runs):
    o, f = runs["oracle"], runs["fast"]
    scale = float(np.abs(o["logits"]).max())
    assert_within(f["logits"], o["logits"], logits_bound(SMALL, B, T, scale), "logits")
    assert_within(f["loss"], o["loss"], loss_bound(SMALL, B, T, o["loss"], scale), "loss")


def test_same_gradients(runs):
    layout = ParamLayout(SMALL)
    o, f = (layout.views(runs[k]["grads"]) for k in ("oracle", "fast"))
    scales = slice_scales(layout, o)
    rel = grad_rel_bound(SMALL, B, T)
    for n in layout.names:
        assert_within(f[n], o[n], rel * scales[n], f"gradient of {n}")


def test_same_adamw_step(runs):
    layout = ParamLayout(SMALL)
    o = runs["oracle"]
    drift = AdamDrift(layout, B, T, LR, WD, grad_rel_bound(SMALL, B, T))
    drift.gradients(o["grads"], o["loss"], float(np.abs(o["logits"]).max()))
    drift.update(o["m"], o["v"], o["params"])
    assert_within(runs["fast"]["params"], o["params"], drift.bound, "parameters after one AdamW step")
    assert runs["optimizer"] in ("fused", "foreach")


# Not GPT-2's settings, so that each one shows: betas and epsilon far from the defaults, the
# decay of every tensor (not the matrices only), a clipping norm between the two steps' norms
SETTINGS = AdamW(2e-3, 0.1, decayed="all", betas=(0.5, 0.9), grad_clip=2.0, eps=1e-3)


@pytest.mark.parametrize("kind", [TorchGPT2, SdpaGPT2])
def test_each_baseline_adamw_update_takes_every_setting(kind):
    """Two updates of a baseline with SETTINGS from gradients g, then 3 g (set by hand; g's
    norm is half the clipping norm: the second is clipped to 2 g) give AdamW's parameters, the
    formula in float64 (t = 1, 2; bias-corrected moments; decoupled decay; the gradients
    scaled by min(1, clip / (norm + 1e-6)) first): each of lr, weight decay, decayed, betas,
    eps and the clipping norm reaches torch (each ignored moves the parameters by ~lr)."""
    rng = np.random.default_rng(3)
    p0 = random_init(SMALL, seed=5) + rng.standard_normal(ParamLayout(SMALL).total,
                                                          dtype=np.float32) * np.float32(0.02)
    g = rng.standard_normal(p0.size).astype(np.float32) * np.float32(1e-3)
    g *= np.float32(SETTINGS.grad_clip / 2 / np.linalg.norm(g.astype(np.float64)))
    model = kind(SMALL, p0)
    tensors = list(model.parameters()) if kind is SdpaGPT2 else list(model.params.values())
    s, (b1, b2), eps = SETTINGS, SETTINGS.betas, SETTINGS.eps
    p, m, v = p0.astype(np.float64), 0.0, 0.0
    for t, k in ((1, 1.0), (2, 3.0)):
        at = 0
        for x in tensors:        # llm.c's layout: the tensors (a layer's each) in order
            x.grad = torch.from_numpy(k * g[at:at + x.numel()].reshape(x.shape))
            at += x.numel()
        model.adamw_update(s)
        gt = k * g.astype(np.float64)
        gt *= min(1.0, s.grad_clip / (np.linalg.norm(gt) + 1e-6))
        m, v = b1 * m + (1 - b1) * gt, b2 * v + (1 - b2) * gt * gt
        p = p * (1 - s.lr * s.weight_decay) - s.lr * (m / (1 - b1 ** t)) / (
            np.sqrt(v / (1 - b2 ** t)) + eps)
    # two fp32 updates: a few roundings of each parameter and of each step (<= lr)
    tol = 16 * 2.0 ** -24 * (np.abs(p) + 2 * s.lr)
    assert np.all(np.abs(model.params_flat() - p) <= tol), np.abs(model.params_flat() - p).max()
