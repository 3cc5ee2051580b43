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
from starpu_llm.model.config import GPTConfig, ParamLayout  # noqa: E402
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
        model.adamw_update(LR, WD)
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
