"""Whole-model correctness: both engines against a PyTorch GPT-2 (starpu_llm/torch_gpt2.py).

Two models: a small one (random tokens, perturbed parameters so that every bias, layernorm
parameter and padded wte row is non-trivial) and GPT-2 124M (random_init, Shakespeare tokens).
For each, and for each engine: one forward/backward (logits, loss, the 16 gradients), then
10 AdamW steps on consecutive batches (losses, final parameters); and StarPU vs reference.
Plus the small model on StarPU with 2 sub-batches (gradient reduction).

Every run happens once, in the module-scoped `results` fixture (per model): torch, then one
engine at a time, each engine doing the forward/backward check as its first step. It keeps only
the errors, so the 124M arrays are freed as it goes (`pytest -s` prints the errors and times).
Tolerances are a few times the errors observed on this machine (2 cores); each states the
observed error.
llm.c's own test_gpt2.c allows 1e-2 on logits and loss and 2e-2 on gradients: ours are far
tighter, as fp32 allows.
"""
from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import dataclass, field

import numpy as np
import pytest

import torch

from starpu_llm.torch_gpt2 import TorchGPT2, batch
from starpu_llm.config import MODELS, GPTConfig, ParamLayout
from starpu_llm.data import DataLoader, default_dataset
from starpu_llm.engine import ReferenceEngine, StarPUEngine
from starpu_llm.formats import read_shard
from starpu_llm.runtime import Runtime
from starpu_llm.state import TrainState, random_init

torch.set_num_threads(2)

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
    tol: dict

    def positions(self):
        loader = DataLoader(self.tokens, self.B, self.T)
        return [loader.next_position() for _ in range(STEPS)]


# Tolerances, with the largest error observed (over both engines, which agree bitwise).
# Gradients: per tensor, max |engine - torch| <= grad_rel * max |torch gradient|.
# Parameters after the steps: max |engine - torch| <= params and, per tensor,
# ||engine - torch|| / ||torch - initial|| <= params_rel (the error relative to the update).
# The parameter errors are fp32 noise amplified by Adam where a gradient is ~0 (e.g. the key
# biases, whose gradient is analytically zero): torch fp32 itself differs from torch fp64 as
# much (124M, fcprojw: 8.6e-5 max abs, the engines 8.7e-5 from fp64).
TOLERANCES = {
    "small": dict(
        logits=1e-6,        # observed 2.1e-7 (|logits| <= 0.75)
        loss=1e-6,          # observed 1.8e-7 (loss 4.57)
        grad_rel=5e-6,      # observed 4.4e-7 (max abs 4.5e-8)
        step_loss=2e-6,     # observed 5.2e-7
        params=5e-5,        # observed 1.0e-5 (qkvb; others <= 1.1e-6), updates ~1e-2
        params_rel=3e-3,    # observed 7.0e-4 (qkvb; others <= 8e-5)
    ),
    "d12": dict(
        logits=1e-5,        # observed 2.8e-6 (|logits| <= 2.9)
        loss=2e-6,          # observed 4.6e-7 (loss 11.08)
        grad_rel=5e-6,      # observed 1.4e-6 (max abs 4e-7)
        step_loss=1e-5,     # observed 2.1e-6 (losses 11.08 -> 8.9)
        params=5e-4,        # observed 1.3e-4 (fcprojw; qkvw 4.6e-5), updates ~1e-3
        params_rel=1e-2,    # observed 2.4e-3 (qkvb; ln*w 1.2e-3, others <= 1.2e-4)
    ),
}


def make_case(name: str) -> Case:
    if name == "small":
        cfg = SMALL
        rng = np.random.default_rng(42)
        # perturb everything, padded wte rows included, so no parameter is 0 or 1
        params = random_init(cfg, seed=7)
        params += rng.standard_normal(params.size, dtype=np.float32) * np.float32(0.02)
        tokens = rng.integers(0, cfg.V, size=4096).astype(np.uint16)
        return Case(name, cfg, params, tokens, B=4, T=16, lr=1e-3, tol=TOLERANCES[name])
    cfg = MODELS["d12"]
    tokens = read_shard(default_dataset()[0])
    return Case(name, cfg, random_init(cfg), tokens, B=1, T=64, lr=1e-4, tol=TOLERANCES[name])


def tensor_errors(layout: ParamLayout, got: np.ndarray, want: np.ndarray) -> dict:
    """{tensor name: (max |got - want|, max |want|)}."""
    g, w = layout.views(got), layout.views(want)
    return {n: (float(np.abs(g[n] - w[n]).max()), float(np.abs(w[n]).max())) for n in layout.names}


def update_errors(layout: ParamLayout, got: np.ndarray, want: np.ndarray, init: np.ndarray) -> dict:
    """{tensor name: (max |got - want|, ||got - want|| / ||want - init||)}: the second is the
    error relative to how far training moved the tensor."""
    g, w, i = layout.views(got), layout.views(want), layout.views(init)
    out = {}
    for n in layout.names:
        d = (g[n] - w[n]).astype(np.float64)
        out[n] = (float(np.abs(d).max()),
                  float(np.linalg.norm(d) / np.linalg.norm((w[n] - i[n]).astype(np.float64))))
    return out


# --------------------------------------------------------------------------- the runs

@pytest.fixture(scope="module")
def runtime():
    rt = Runtime()
    yield rt
    rt.shutdown()


def make_engine(kind, case, state, runtime, sub_batches=None):
    if kind == "reference":
        # the same OpenMP team size as the StarPU engine's tasks, so that both run the
        # kernels' reductions in the same order
        return ReferenceEngine(case.config, state, case.B, case.T, case.tokens,
                               threads=runtime.cores_per_worker)
    return StarPUEngine(case.config, state, case.B, case.T, case.tokens, runtime=runtime,
                        sub_batches=sub_batches)


def run_torch(case: Case, out: dict):
    model = TorchGPT2(case.config, case.params)
    losses = []
    for i, pos in enumerate(case.positions()):
        logits, loss = model.forward_backward(*batch(case.tokens, pos, case.B, case.T))
        if i == 0:   # the forward/backward check: the first batch, before any update
            out["logits"], out["loss"], out["grads"] = logits, loss, model.grads_flat()
        model.adamw_update(case.lr, WEIGHT_DECAY)
        losses.append(loss)
    out["losses"], out["params"] = np.array(losses), model.params_flat()


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
        engine.submit_update(case.lr, WEIGHT_DECAY)
        engine.wait()
        losses = [loss] + [engine.step(pos, case.lr, WEIGHT_DECAY) for pos in positions[1:]]
        if kind == "starpu":
            engine.sync()
        assert state.step == STEPS
        train = np.array(losses), state.params.copy()
    finally:
        engine.close()
    return fb, train


@dataclass
class Errors:
    logits: float = 0.0
    loss: float = 0.0
    grads: dict = field(default_factory=dict)
    step_losses: np.ndarray = None
    params: dict = field(default_factory=dict)


def compare(layout, case, fb, train, ref_fb, ref_train) -> Errors:
    """The errors of (fb, train) = ((logits, loss, grads), (step losses, final params))
    against the same of a reference run."""
    e = Errors()
    e.logits = float(np.abs(fb[0] - ref_fb[0]).max())
    e.loss = abs(fb[1] - ref_fb[1])
    e.grads = tensor_errors(layout, fb[2], ref_fb[2])
    e.step_losses = np.abs(train[0] - ref_train[0])
    e.params = update_errors(layout, train[1], ref_train[1], case.params)
    return e


@pytest.fixture(scope="module", params=["small", "d12"])
def results(request, runtime):
    """Runs torch, then each engine, on one model; returns (case, errors, moved): errors[engine]
    against torch, errors["starpu_vs_reference"], and how far torch's training moved each
    tensor. Only errors are kept: the runs' arrays are freed here."""
    case = make_case(request.param)
    layout = ParamLayout(case.config)
    timings, out = {}, {}
    t0 = time.perf_counter()
    with runtime.paused():   # StarPU's idle workers would spin on the cores torch uses
        run_torch(case, out)
    timings["torch"] = time.perf_counter() - t0
    torch_fb = out["logits"], out["loss"], out["grads"]
    torch_train = out["losses"], out["params"]
    del out
    errors, runs = {}, {}
    for kind in ENGINES:
        t0 = time.perf_counter()
        with runtime.paused() if kind == "reference" else contextlib.nullcontext():
            runs[kind] = run_engine(kind, case, runtime)
        timings[kind] = time.perf_counter() - t0
        errors[kind] = compare(layout, case, *runs[kind], torch_fb, torch_train)
    errors["starpu_vs_reference"] = compare(layout, case, *runs["starpu"], *runs["reference"])
    moved = tensor_errors(layout, torch_train[1], case.params)
    del runs, torch_fb, torch_train
    gc.collect()
    print(f"\n[{case.name}] seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in timings.items()))
    for kind, e in errors.items():
        print(f"[{case.name}] {kind}: logits {e.logits:.2e} loss {e.loss:.2e} "
              f"grad_rel {max(d / s if s else d for d, s in e.grads.values()):.2e} "
              f"step_loss {e.step_losses.max():.2e} "
              f"params {max(d for d, _ in e.params.values()):.2e} "
              f"params_rel {max(r for _, r in e.params.values()):.2e}")
    return case, errors, moved


# --------------------------------------------------------------------------- 1. forward/backward

@pytest.mark.parametrize("engine", ENGINES)
def test_logits_and_loss(results, engine):
    case, errors, _ = results
    e = errors[engine]
    assert e.logits <= case.tol["logits"], f"{case.name}/{engine}: max |logits - torch| = {e.logits:.3e}"
    assert e.loss <= case.tol["loss"], f"{case.name}/{engine}: |loss - torch| = {e.loss:.3e}"


@pytest.mark.parametrize("engine", ENGINES)
def test_gradients(results, engine):
    case, errors, _ = results
    tol = case.tol["grad_rel"]
    bad = {n: f"max|diff| {d:.3e} (max|grad| {s:.3e}, allowed {tol * s:.3e})"
           for n, (d, s) in errors[engine].grads.items() if not d <= tol * s}
    assert not bad, f"{case.name}/{engine}: gradients differing from torch: {bad}"
    # every tensor's gradient is non-trivial (so the relative check means something)
    assert all(s > 0 for _, s in errors[engine].grads.values())


# --------------------------------------------------------------------------- 2. AdamW steps

@pytest.mark.parametrize("engine", ENGINES)
def test_training_losses(results, engine):
    case, errors, _ = results
    err = errors[engine].step_losses
    assert err.max() <= case.tol["step_loss"], \
        f"{case.name}/{engine}: |step loss - torch| per step = {np.array2string(err, precision=2)}"


@pytest.mark.parametrize("engine", ENGINES)
def test_training_params(results, engine):
    case, errors, moved = results
    tol, tol_rel = case.tol["params"], case.tol["params_rel"]
    bad = {n: f"max|diff| {d:.3e}, ||diff|| / ||update|| {r:.3e}"
           for n, (d, r) in errors[engine].params.items() if not (d <= tol and r <= tol_rel)}
    assert not bad, f"{case.name}/{engine}: parameters after {STEPS} steps differ from torch: {bad}"
    # every tensor moved, by more than the tolerance
    small = {n: d for n, (d, _) in moved.items() if not d > tol}
    assert not small, f"{case.name}: tensors that training did not move: {small}"


# --------------------------------------------------------------------------- 3. StarPU vs reference

def test_starpu_matches_reference(results):
    """Same kernels in the same order with the same thread count: bitwise equal."""
    case, errors, _ = results
    e = errors["starpu_vs_reference"]
    assert e.logits == 0.0 and e.loss == 0.0, f"{case.name}: logits {e.logits}, loss {e.loss}"
    bad = {n: d for n, (d, _) in e.grads.items() if d != 0.0}
    assert not bad, f"{case.name}: gradients differ: {bad}"
    assert e.step_losses.max() == 0.0, f"{case.name}: step losses differ: {e.step_losses}"
    bad = {n: d for n, (d, _) in e.params.items() if d != 0.0}
    assert not bad, f"{case.name}: parameters after {STEPS} steps differ: {bad}"


# --------------------------------------------------------------------------- data parallelism

def test_starpu_sub_batches_small(runtime):
    """The small model with the batch split into 2 sub-batches whose gradients StarPU reduces
    (REDUX): matches torch within the same tolerances (the sums run in another order)."""
    case = make_case("small")
    layout = ParamLayout(case.config)
    out = {}
    with runtime.paused():
        run_torch(case, out)
    fb, train = run_engine("starpu", case, runtime, sub_batches=2)
    e = compare(layout, case, fb, train, (out["logits"], out["loss"], out["grads"]),
                (out["losses"], out["params"]))
    print(f"\n[small, 2 sub-batches] logits {e.logits:.2e} loss {e.loss:.2e} grad_rel "
          f"{max(d / s for d, s in e.grads.values()):.2e} step_loss {e.step_losses.max():.2e} "
          f"params {max(d for d, _ in e.params.values()):.2e} "
          f"params_rel {max(r for _, r in e.params.values()):.2e}")
    tol = case.tol
    assert e.logits <= tol["logits"] and e.loss <= tol["loss"], (e.logits, e.loss)
    bad = {n: (d, s) for n, (d, s) in e.grads.items() if not d <= tol["grad_rel"] * s}
    assert not bad, f"gradients differing from torch: {bad}"
    assert e.step_losses.max() <= tol["step_loss"], e.step_losses
    bad = {n: (d, r) for n, (d, r) in e.params.items()
           if not (d <= tol["params"] and r <= tol["params_rel"])}
    assert not bad, f"parameters after {STEPS} steps differ from torch: {bad}"
