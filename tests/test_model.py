"""Whole-model correctness: both engines against a PyTorch GPT-2 (starpu_llm/baselines/torch_gpt2.py).

Two models: a small one (random tokens, perturbed parameters so that every bias, layernorm
parameter and padded wte row is non-trivial) and GPT-2 124M (random_init, Shakespeare tokens).
For each, and for each engine: one forward/backward (logits, loss, the 16 gradients), then
10 AdamW steps on consecutive batches (losses, final parameters); and StarPU vs reference.
Plus the small model on StarPU with 2 sub-batches (gradient reduction).

Every run happens once, in the module-scoped `results` fixture (per model): torch, then one
engine at a time, each engine doing the forward/backward check as its first step. It keeps only
the errors, so the 124M arrays are freed as it goes (`pytest -s` prints, per quantity, the
largest error / bound ratio and the times).

Bounds (tests/bounds.py, section "whole model", has the derivations). The torch oracle is an
fp32 model too, so every bound is that of two fp32 runs of the same exact computation, each
within a worst-case fp32 forward-error bound of it (first order, the model taken as well
conditioned at these parameters: bounds.py states what that assumes); none is scaled from an
observed error, and they hold for any summation order, FMA contraction, OpenBLAS kernel or
torch dispatch.
  logits       max |diff| <= 2 gamma(N_logits) max |logits|     (N_logits: the chain of
               roundings that feeds a logit, 991 small, 106595 d12: 1.2e-4 and 1.3e-2 relative)
  loss         2 (2 gamma(N_logits) max|logits| + gamma(V + 6) + gamma(3)(log V + 2 max|logits|)
               + gamma(BT + 1) loss)
  gradients    per slice (per layer, per q/k/v part of qkvw, per row of wte: bounds.slice_scales):
               max |diff| <= 2 gamma(N_grads) max |grad|  (N_grads 2220 small, 312312 d12:
               2.6e-4 and 3.8e-2 relative; 0 for wte's padded rows, whose gradient is 0)
  step losses  the loss bound at that step's parameters (it covers the step's rounding; the
               parameters' drift is checked below, its effect on the loss is not bounded:
               bounds.py says why; pytest -s prints its worst-case first-order size)
  parameters   per entry |diff| <= drift_i: lr times the sum over the steps of the smaller of
               Adam's step bound (|a| + R(t), a the reference's step, |m_hat|/sqrt(v_hat) <=
               R(t) <= 1.043) and the first-order change of the step under the gradients'
               bound (from the reference's moments), plus the updates' rounding. Where a
               gradient is ~0 (e.g. the key biases, whose gradient is analytically zero) Adam
               turns fp32 noise into steps of ~lr: only the first holds there; elsewhere the
               second keeps the check strict. It neglects the change of the later gradients
               caused by the drift itself (bounds.py). For GPT-2 124M the gradients' bound
               (3.8e-2 relative) leaves most entries to Adam's step bound: the check is tight
               there only on the entries with the largest gradients (pytest -s prints, per
               tensor, the fraction that training moved by more than its bound).
StarPU vs reference stays an exact comparison (same kernels, same order, same thread count).
llm.c's own test_gpt2.c allows 1e-2 on logits and loss and 2e-2 on gradients.
"""
from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import dataclass, field

import numpy as np
import pytest

import torch

from starpu_llm.baselines.torch_gpt2 import TorchGPT2, batch
from starpu_llm.model.config import MODELS, AdamW, GPTConfig, ParamLayout
from starpu_llm.io.data import DataLoader, default_dataset
from starpu_llm.flow.engine import StarPUEngine
from starpu_llm.io.formats import read_shard
from starpu_llm.flow.reference import ReferenceEngine
from starpu_llm.runtime import usable_cores
from starpu_llm.model.state import TrainState, random_init
from partitions import subs

from bounds import AdamDrift, grad_rel_bound, logits_bound, loss_bound, ratio, slice_scales

torch.set_num_threads(usable_cores())

ENGINES = ("reference", "starpu")
STEPS = 10
WEIGHT_DECAY = 0.01

SMALL = GPTConfig(max_seq_len=32, vocab_size=97, padded_vocab_size=128,
                  num_layers=2, num_heads=4, channels=32)


@dataclass
class Case:
    name: str
    config: GPTConfig
    params: np.ndarray
    tokens: np.ndarray
    B: int
    T: int
    lr: float
    tf32: bool = False      # the run compared with torch has its matmuls in TF32 (GPUs)
    attention: str = "gemm"  # and its attention's form (flow.tensors.ATTENTIONS)
    steps: int = STEPS

    def positions(self):
        loader = DataLoader(self.tokens, self.B, self.T)
        return [loader.next_position() for _ in range(self.steps)]

    @property
    def grad_rel(self) -> float:
        """Relative bound of two runs' gradients (bounds.grad_rel_bound)."""
        return grad_rel_bound(self.config, self.B, self.T, self.tf32, self.attention)


@dataclass
class Bounds:
    """The bounds of one comparison, from the reference run (torch) of a case."""
    logits: float            # max |logits diff|
    loss: float              # |loss diff|
    grad_scale: dict         # {tensor: max |grad| per slice (bounds.slice_scales)}
    step_losses: np.ndarray  # per step
    params: np.ndarray       # per entry, flat (float64)
    loss_drift: np.ndarray   # per step, sum_i |grad_i| drift_i: not in step_losses (printed)


def make_case(name: str) -> Case:
    if name == "small":
        cfg = SMALL
        rng = np.random.default_rng(42)
        # perturb everything, padded wte rows included, so no parameter is 0 or 1
        params = random_init(cfg, seed=7)
        params += rng.standard_normal(params.size, dtype=np.float32) * np.float32(0.02)
        tokens = rng.integers(0, cfg.V, size=4096).astype(np.uint16)
        return Case(name, cfg, params, tokens, B=4, T=16, lr=1e-3)
    # "d12", and "tiny" (the GPU tests, tests/test_gpu.py): random_init, Shakespeare tokens
    cfg = MODELS[name]
    tokens = read_shard(default_dataset()[0])
    if name == "tiny":
        return Case(name, cfg, random_init(cfg), tokens, B=4, T=64, lr=1e-3)
    return Case(name, cfg, random_init(cfg), tokens, B=1, T=64, lr=1e-4)


def slice_errors(layout: ParamLayout, got: np.ndarray, want: np.ndarray) -> dict:
    """{tensor name: max |got - want| per slice (bounds.slice_scales)}."""
    return slice_scales(layout, {n: g - w for (n, g), w in
                                 zip(layout.views(got).items(), layout.views(want).values())})


def param_errors(layout: ParamLayout, got: np.ndarray, want: np.ndarray, bound) -> dict:
    """{tensor name: (max |got - want|, max over entries of |got - want| / bound)}."""
    g, w = layout.views(got), layout.views(want)
    out = {}
    for n in layout.names:
        o = layout.offsets[n]
        d = np.abs(g[n] - w[n]).astype(np.float64).reshape(-1)
        out[n] = (float(d.max()), float(ratio(d, bound[o:o + d.size]).max()))
    return out


# --------------------------------------------------------------------------- the runs

def make_engine(kind, case, state, runtime, sub_batches=None):
    if kind == "cuda-bodies":
        # the codelets' CUDA bodies in the reference loop (tests/test_model_cuda.py)
        return ReferenceEngine(case.config, state, case.B, case.T, case.tokens, gpu=True,
                               tf32=case.tf32, attention=case.attention)
    if kind == "reference":
        # the same OpenMP team size as the StarPU engine's tasks, so that both run the
        # kernels' reductions in the same order
        return ReferenceEngine(case.config, state, case.B, case.T, case.tokens,
                               threads=runtime.partition.cores_per_worker, attention=case.attention)
    return StarPUEngine(case.config, state, case.B, case.T, case.tokens, runtime=runtime,
                        partition=subs(runtime, sub_batches))


def run_torch(case: Case, out: dict, tf32s=None):
    """Torch's run, and the bounds of comparing a run with it (out["bounds"]): the gradient,
    moment and parameter of every step feed AdamDrift (bounds.py). tf32s: the matmul
    precisions (False fp32, True TF32) of the runs to compare, each one's bounds in
    out["bounds_tf32"][flag] from the one torch run (default: the case's alone)."""
    model = TorchGPT2(case.config, case.params)
    layout = model.layout
    tf32s = (case.tf32,) if tf32s is None else tuple(tf32s)
    drifts = {f: AdamDrift(layout, case.B, case.T, case.lr, WEIGHT_DECAY,
                           grad_rel_bound(case.config, case.B, case.T, f, case.attention),
                           tf32=f, attention=case.attention)
              for f in tf32s}
    losses, loss_bounds, fb_bounds = [], {f: [] for f in tf32s}, {}
    for i, pos in enumerate(case.positions()):
        logits, loss = model.forward_backward(*batch(case.tokens, pos, case.B, case.T))
        grads = {n: t.grad.numpy() for n, t in model.params.items()}
        scale = float(np.abs(logits).max())
        for f, drift in drifts.items():
            loss_bounds[f].append(drift.gradients(grads, loss, scale))
        if i == 0:   # the forward/backward check: the first batch, before any update
            out["logits"], out["loss"], out["grads"] = logits, loss, model.grads_flat()
            fb_bounds = {f: (logits_bound(case.config, case.B, case.T, scale, f, case.attention),
                             loss_bound(case.config, case.B, case.T, loss, scale, f,
                                        case.attention),
                             slice_scales(layout, grads)) for f in tf32s}
        model.adamw_update(AdamW(case.lr, WEIGHT_DECAY))
        state = model.optimizer.state
        moments = ({n: state[t]["exp_avg"].numpy() for n, t in model.params.items()},
                   {n: state[t]["exp_avg_sq"].numpy() for n, t in model.params.items()},
                   {n: t.detach().numpy() for n, t in model.params.items()})
        for drift in drifts.values():
            drift.update(*moments)
        losses.append(loss)
    out["losses"], out["params"] = np.array(losses), model.params_flat()
    out["bounds_tf32"] = {f: Bounds(*fb_bounds[f], np.array(loss_bounds[f]), d.bound,
                                    np.array(d.loss_drift)) for f, d in drifts.items()}
    out["bounds"] = out["bounds_tf32"][tf32s[0]]


def run_engine(kind: str, case: Case, runtime, sub_batches=None):
    """(logits, loss, grads) of the forward/backward of the first batch, then (losses, final
    params) of STEPS steps: the first step's update is submitted after the gradients are read,
    so step 1 is exactly engine.step(positions[0])."""
    state = TrainState(config=case.config, params=case.params.copy())
    engine = make_engine(kind, case, state, runtime, sub_batches)
    try:
        positions = case.positions()
        loss = engine.forward_backward(positions[0])
        if kind == "starpu":
            engine.sync()
        fb = engine.logits(), loss, state.grads.copy()
        engine.submit_update(AdamW(case.lr, WEIGHT_DECAY))
        engine.wait()
        losses = [loss] + [engine.step(pos, AdamW(case.lr, WEIGHT_DECAY)) for pos in positions[1:]]
        if kind == "starpu":
            engine.sync()
        assert state.step == case.steps
        train = np.array(losses), state.params.copy()
    finally:
        engine.close()
    return fb, train


@dataclass
class Errors:
    logits: float = 0.0
    loss: float = 0.0
    grads: dict = field(default_factory=dict)      # {tensor: max |diff| per slice}
    step_losses: np.ndarray = None
    params: dict = field(default_factory=dict)     # {tensor: (max |diff|, max |diff| / bound)}

    def ratios(self, case: Case, bounds: Bounds) -> dict:
        """The largest error / bound of each quantity (<= 1 passes)."""
        return {
            "logits": self.logits / bounds.logits,
            "loss": self.loss / bounds.loss,
            "grads": max(float(np.max(ratio(d, case.grad_rel * bounds.grad_scale[n])))
                         for n, d in self.grads.items()),
            "step_loss": float(np.max(self.step_losses / bounds.step_losses)),
            "params": max(r for _, r in self.params.values()),
        }


def compare(layout, fb, train, ref_fb, ref_train, param_bound) -> Errors:
    """The errors of (fb, train) = ((logits, loss, grads), (step losses, final params))
    against the same of a reference run."""
    e = Errors()
    e.logits = float(np.abs(fb[0] - ref_fb[0]).max())
    e.loss = abs(fb[1] - ref_fb[1])
    e.grads = slice_errors(layout, fb[2], ref_fb[2])
    e.step_losses = np.abs(train[0] - ref_train[0])
    e.params = param_errors(layout, train[1], ref_train[1], param_bound)
    return e


def report(label: str, e: Errors, case: Case, bounds: Bounds):
    print(f"[{label}] error / bound: " +
          " ".join(f"{k} {v:.2e}" for k, v in e.ratios(case, bounds).items()))


@pytest.fixture(scope="module", params=["small", "d12"])
def results(request, runtime):
    """Runs torch, then each engine, on one model; returns (case, errors, bounds, moved):
    errors[engine] against torch, errors["starpu_vs_reference"], the bounds (from torch's run)
    and, per tensor, the fraction of entries that torch's training moved by more than their
    bound. Only errors are kept: the runs' arrays are freed here."""
    case = make_case(request.param)
    layout = ParamLayout(case.config)
    timings, out = {}, {}
    t0 = time.perf_counter()
    with runtime.paused():   # StarPU's idle workers would spin on the cores torch uses
        run_torch(case, out)
    timings["torch"] = time.perf_counter() - t0
    torch_fb = out["logits"], out["loss"], out["grads"]
    torch_train = out["losses"], out["params"]
    bounds = out["bounds"]
    del out
    errors, runs = {}, {}
    for kind in ENGINES:
        t0 = time.perf_counter()
        with runtime.paused() if kind == "reference" else contextlib.nullcontext():
            runs[kind] = run_engine(kind, case, runtime)
        timings[kind] = time.perf_counter() - t0
        errors[kind] = compare(layout, *runs[kind], torch_fb, torch_train, bounds.params)
    errors["starpu_vs_reference"] = compare(layout, *runs["starpu"], *runs["reference"],
                                            bounds.params)
    moved = {}
    for n, (p1, p0) in zip(layout.names, zip(layout.views(torch_train[1]).values(),
                                              layout.views(case.params).values())):
        o = layout.offsets[n]
        d = np.abs(p1 - p0).astype(np.float64).reshape(-1)
        moved[n] = float(np.mean(d > bounds.params[o:o + d.size]))
    del runs, torch_fb, torch_train
    gc.collect()
    print(f"\n[{case.name}] seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in timings.items()))
    print(f"[{case.name}] bounds: logits {bounds.logits:.2e} loss {bounds.loss:.2e} "
          f"grad_rel {case.grad_rel:.2e} step_loss {bounds.step_losses.min():.2e}.."
          f"{bounds.step_losses.max():.2e} params {bounds.params.min():.2e}.."
          f"{bounds.params.max():.2e} (worst-case first-order effect of the parameters' drift "
          f"on the loss, not in the bound: {bounds.loss_drift.max():.1e})")
    print(f"[{case.name}] entries moved by training by more than their bound: " +
          " ".join(f"{n} {f:.1%}" for n, f in moved.items()))
    for kind in ENGINES:
        report(f"{case.name}] [{kind}", errors[kind], case, bounds)
    e = errors["starpu_vs_reference"]
    print(f"[{case.name}] starpu_vs_reference: logits {e.logits:.2e} loss {e.loss:.2e} "
          f"grads {max(float(np.max(d)) for d in e.grads.values()):.2e} "
          f"step_loss {e.step_losses.max():.2e} "
          f"params {max(d for d, _ in e.params.values()):.2e}")
    return case, errors, bounds, moved


# --------------------------------------------------------------------------- 1. forward/backward

@pytest.mark.parametrize("engine", ENGINES)
def test_logits_and_loss(results, engine):
    case, errors, bounds, _ = results
    e = errors[engine]
    # 2 gamma(N_logits) max|logits| and the loss bound (module docstring, bounds.py)
    assert e.logits <= bounds.logits, \
        f"{case.name}/{engine}: max |logits - torch| = {e.logits:.3e} > {bounds.logits:.3e}"
    assert e.loss <= bounds.loss, \
        f"{case.name}/{engine}: |loss - torch| = {e.loss:.3e} > {bounds.loss:.3e}"


@pytest.mark.parametrize("engine", ENGINES)
def test_gradients(results, engine):
    case, errors, bounds, _ = results
    # per slice (bounds.slice_scales): max |diff| <= 2 gamma(N_grads) max |torch gradient|
    tol = case.grad_rel
    bad = {n: f"max|diff| {np.max(d):.3e} (allowed {np.min(tol * bounds.grad_scale[n]):.3e}.."
              f"{np.max(tol * bounds.grad_scale[n]):.3e})"
           for n, d in errors[engine].grads.items()
           if not np.all(d <= tol * bounds.grad_scale[n])}
    assert not bad, f"{case.name}/{engine}: gradients differing from torch: {bad}"
    # every slice's gradient is non-trivial (so the relative check means something), but for
    # wte's padded rows, whose gradient is exactly 0 (and checked as such: bound 0)
    V = case.config.V
    assert all(np.all(s > 0) for n, s in bounds.grad_scale.items() if n != "wte")
    assert np.all(bounds.grad_scale["wte"][:V] > 0) and np.all(bounds.grad_scale["wte"][V:] == 0)


# --------------------------------------------------------------------------- 2. AdamW steps

@pytest.mark.parametrize("engine", ENGINES)
def test_training_losses(results, engine):
    case, errors, bounds, _ = results
    # per step: the loss bound at the step's parameters (module docstring)
    err = errors[engine].step_losses
    assert np.all(err <= bounds.step_losses), (
        f"{case.name}/{engine}: |step loss - torch| per step = "
        f"{np.array2string(err, precision=2)}, "
        f"bounds {np.array2string(bounds.step_losses, precision=2)}")


@pytest.mark.parametrize("engine", ENGINES)
def test_training_params(results, engine):
    case, errors, bounds, moved = results
    # per entry: |diff| <= the AdamW drift bound (bounds.AdamDrift)
    bad = {n: f"max|diff| {d:.3e}, max |diff| / bound {r:.3e}"
           for n, (d, r) in errors[engine].params.items() if not r <= 1.0}
    assert not bad, f"{case.name}/{engine}: parameters after {STEPS} steps differ from torch: {bad}"
    # every tensor moved: some of its entries by more than their bound (the comparison says
    # nothing of an entry whose bound lets it stay at its initial value)
    small = {n: f for n, f in moved.items() if not f > 0}
    assert not small, \
        f"{case.name}: fraction of entries that training moved beyond the bound: {small}"


# --------------------------------------------------------------------------- 3. StarPU vs reference

def test_starpu_matches_reference(results):
    """Same kernels in the same order with the same thread count: bitwise equal."""
    case, errors, _, _ = results
    e = errors["starpu_vs_reference"]
    assert e.logits == 0.0 and e.loss == 0.0, f"{case.name}: logits {e.logits}, loss {e.loss}"
    bad = {n: d for n, d in e.grads.items() if np.any(d != 0.0)}
    assert not bad, f"{case.name}: gradients differ: {bad}"
    assert e.step_losses.max() == 0.0, f"{case.name}: step losses differ: {e.step_losses}"
    bad = {n: d for n, (d, _) in e.params.items() if d != 0.0}
    assert not bad, f"{case.name}: parameters after {STEPS} steps differ: {bad}"


# --------------------------------------------------------------------------- data parallelism

def test_starpu_sub_batches_small(runtime):
    """The small model with the batch split into 2 sub-batches whose gradients add up (on
    the fixture's one worker, chained; on several, a StarPU reduction, also tested against
    one worker in test_parallel.py): matches torch within the same bounds (they hold for any
    summation order)."""
    case = make_case("small")
    layout = ParamLayout(case.config)
    out = {}
    with runtime.paused():
        run_torch(case, out)
    bounds = out["bounds"]
    fb, train = run_engine("starpu", case, runtime, sub_batches=2)
    e = compare(layout, fb, train, (out["logits"], out["loss"], out["grads"]),
                (out["losses"], out["params"]), bounds.params)
    print()
    report("small, 2 sub-batches", e, case, bounds)
    r = e.ratios(case, bounds)
    bad = {k: v for k, v in r.items() if not v <= 1.0}
    assert not bad, f"errors above their bound (error / bound): {bad}"
