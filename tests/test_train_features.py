"""Validation, learning-rate schedules and gradient clipping, on both engines, against the
PyTorch oracle (starpu_llm/baselines/torch_gpt2.py).

Bounds (tests/bounds.py, sections "whole model" and "gradient clipping"; none scaled from an
observed error):
  validation loss   the mean over M batches of the forward loss bound of each batch at the
                    engine's parameters (loss_bound: each batch's loss is within its bound,
                    so their mean is within the bounds' mean; the mean itself is in float64)
  gradient norm     per step, gradnorm_bound: the norm of the per-entry gradient bounds plus
                    both runs' rounding of the norm
  clipped training  AdamDrift per step with that step's learning rate and the clipped
                    gradients' relative bound (clipped_grad_rel); losses within the step's
                    loss bound, parameters within the drift bound after 10 steps
StarPU against the reference engine with clipping stays exact (same kernels, same order,
same thread count).
"""
from __future__ import annotations

import contextlib
import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from starpu_llm._clib import lib
from starpu_llm.baselines.torch_gpt2 import TorchGPT2, batch
from starpu_llm.model.config import MODELS, GPTConfig, ParamLayout
from starpu_llm.flow.engine import StarPUEngine
from starpu_llm.flow.reference import ReferenceEngine
from starpu_llm.flow.taskflow import update_order
from starpu_llm.io import formats
from starpu_llm.runtime import usable_cores
from starpu_llm.training.schedule import learning_rate
from starpu_llm.model.state import TrainState, random_init
from partitions import subs

from bounds import AdamDrift, clipped_grad_rel, grad_rel_bound, gradnorm_bound, loss_bound, ratio
from tracing import named_buffers

torch.set_num_threads(usable_cores())

ENGINES = ("reference", "starpu")
SMALL = GPTConfig(max_seq_len=32, vocab_size=97, padded_vocab_size=128,
                  num_layers=2, num_heads=4, channels=32)
LAYOUT = ParamLayout(SMALL)
B, T, STEPS = 4, 16, 10
LR, MIN_LR, WARMUP, WEIGHT_DECAY = 1e-3, 1e-4, 3, 0.01
CLIP = 1.2        # between the gradient norms of these 10 steps: some steps clip, some not
GRAD_REL = grad_rel_bound(SMALL, B, T)

_rng = np.random.default_rng(11)
# every parameter perturbed (no 0 or 1 left), as test_model's small case
PARAMS = random_init(SMALL, seed=7) + _rng.standard_normal(LAYOUT.total, dtype=np.float32) * np.float32(0.02)
TRAIN = _rng.integers(0, SMALL.V, 4096).astype(np.uint16)
VAL = _rng.integers(0, SMALL.V, 1024).astype(np.uint16)
VAL_POSITIONS = [0, B * T, 2 * B * T]
POSITIONS = [i * B * T for i in range(STEPS)]      # consecutive batches, as the loader's


@contextlib.contextmanager
def engine_of(kind, runtime, state, sub_batches=None):
    """An engine on the small model over state; StarPU's workers paused for the reference
    (idle workers would spin on the cores its OpenMP team uses)."""
    with runtime.paused() if kind == "reference" else contextlib.nullcontext():
        if kind == "reference":
            # the StarPU tasks' team size: the same reduction order, bitwise equal results
            eng = ReferenceEngine(SMALL, state, B, T, TRAIN, threads=runtime.partition.cores_per_worker)
        else:
            eng = StarPUEngine(SMALL, state, B, T, TRAIN, runtime, subs(runtime, sub_batches))
        try:
            yield eng
        finally:
            eng.close()


def coherent(eng):
    """Make the state's numpy buffers hold the engine's values."""
    if isinstance(eng, StarPUEngine):
        eng.sync()


# --------------------------------------------------------------------------- validation

@pytest.mark.parametrize("kind,sub_batches", [("reference", None), ("starpu", None), ("starpu", 2)])
def test_validation_loss_matches_torch(runtime, kind, sub_batches):
    """After two training steps, the validation loss (forward-only flows over 3 fixed
    batches of another shard) equals torch's mean forward loss on the same batches at the
    engine's parameters, within the mean of the batches' fp32 loss bounds."""
    state = TrainState(config=SMALL, params=PARAMS.copy())
    with engine_of(kind, runtime, state, sub_batches) as eng:
        for pos in POSITIONS[:2]:
            eng.step(pos, LR, WEIGHT_DECAY)
        got = eng.validation_loss(VAL, VAL_POSITIONS)
        coherent(eng)
        params = state.params.copy()
    model = TorchGPT2(SMALL, params)
    losses, bounds = [], []
    with runtime.paused(), torch.no_grad():
        for pos in VAL_POSITIONS:
            logits, loss = model.forward(*batch(VAL, pos, B, T))
            losses.append(float(loss))
            bounds.append(loss_bound(SMALL, B, T, float(loss), float(logits.abs().max())))
    want, bound = float(np.mean(losses)), float(np.mean(bounds))
    assert abs(got - want) <= bound, f"{kind}: validation loss {got} vs torch {want}, bound {bound}"


@pytest.mark.parametrize("kind", ENGINES)
def test_validation_leaves_gradients_and_moments(runtime, kind):
    """A validation pass between a backward pass and its update leaves the pending
    gradients, the moments and the parameters bitwise as they were, and the training that
    follows bitwise the same as without it."""
    runs = []
    for validate in (False, True):
        state = TrainState(config=SMALL, params=PARAMS.copy())
        with engine_of(kind, runtime, state) as eng:
            eng.step(POSITIONS[0], LR, WEIGHT_DECAY)          # moments no longer 0
            eng.forward_backward(POSITIONS[1])                # gradients pending
            coherent(eng)
            before = [x.copy() for x in (state.grads, state.m, state.v, state.params)]
            assert np.any(before[0] != 0) and np.any(before[1] != 0)
            if validate:
                eng.validation_loss(VAL, VAL_POSITIONS)
                coherent(eng)
                for name, x, y in zip(("grads", "m", "v", "params"), before,
                                      (state.grads, state.m, state.v, state.params)):
                    assert np.array_equal(x, y), f"{kind}: validation changed the {name}"
            eng.submit_update(LR, WEIGHT_DECAY)
            loss = eng.step(POSITIONS[2], LR, WEIGHT_DECAY)
            coherent(eng)
            runs.append((loss, state.params.copy(), state.m.copy(), state.v.copy()))
    assert runs[0][0] == runs[1][0]
    assert all(np.array_equal(a, b) for a, b in zip(runs[0][1:], runs[1][1:]))


def test_validation_flow_is_forward_only(runtime):
    """The tasks of a validation pass, as StarPU ran them: loads and forward layers only,
    parameters read (R), no gradient, moment or gradient-norm handle touched."""
    state = TrainState(config=SMALL, params=PARAMS.copy())
    with engine_of("starpu", runtime, state, sub_batches=2) as eng:
        eng.step(POSITIONS[0], LR, WEIGHT_DECAY)
        runtime.start_trace(100_000)
        try:
            eng.validation_loss(VAL, VAL_POSITIONS)
            events, names = runtime.trace(), eng.tensor_names()
        finally:
            runtime.stop_trace()
    kinds = {e[0] for e in events}
    assert kinds == {"load_batch", "encoder_forward", "layernorm_forward", "matmul_forward",
                     "attention_forward", "residual_forward", "gelu_forward",
                     "crossentropy_forward"}, kinds
    assert sum(e[0] == "crossentropy_forward" for e in events) == 2 * len(VAL_POSITIONS)
    for e in events:
        for n, mode in named_buffers(e, names) if e[5] is not None else ():
            assert not n.startswith(("grad.", "m.", "v.", "gradnorm")), (e[0], n)
            if n.startswith("param."):
                assert mode == lib.SL_ACCESS_R, (e[0], n, mode)


def test_validation_defaults_to_the_bundled_validation_shard(runtime):
    """Without val_data, train() validates on the bundled corpus's validation shard (the
    tiny model has GPT-2's vocabulary), every step and after the last."""
    from starpu_llm.io.data import default_dataset
    from starpu_llm.training.trainer import TrainConfig, train
    lines = []
    with runtime.paused():
        r = train(TrainConfig(model="tiny", engine="reference", batch=2, seq_len=16, steps=2,
                              val_every=1, val_batches=2, log=lines.append))
    assert [s for s, _ in r.val_losses] == [1, 2]
    assert all(np.isfinite(v) and v > 0 for _, v in r.val_losses), r.val_losses
    assert any(line.startswith("validation: " + default_dataset()[1]) for line in lines), lines


# --------------------------------------------------------------------------- schedule

def lr_at(s: int) -> float:
    """nanoGPT's schedule for the oracle, written out: linear warmup over WARMUP steps, then
    a cosine from LR down to MIN_LR over the rest of the STEPS."""
    if s < WARMUP:
        return LR * (s + 1) / (WARMUP + 1)
    return MIN_LR + 0.5 * (1 + math.cos(math.pi * (s - WARMUP) / (STEPS - WARMUP))) * (LR - MIN_LR)


def test_schedule():
    got = [learning_rate(s, STEPS, LR, "cosine", WARMUP, MIN_LR) for s in range(STEPS)]
    assert got == pytest.approx([lr_at(s) for s in range(STEPS)], rel=1e-12, abs=0)
    assert got[WARMUP] == LR and max(got) == LR
    assert all(a > b for a, b in zip(got[WARMUP:], got[WARMUP + 1:]))     # decays
    assert learning_rate(STEPS + 1, STEPS, LR, "cosine", WARMUP, MIN_LR) == MIN_LR
    assert [learning_rate(s, STEPS, LR, "constant", 2) for s in range(4)] == [
        LR / 3, 2 * LR / 3, LR, LR]


# --------------------------------------------------------------------------- clipping

def run_torch_clipped():
    """torch: clip_grad_norm_ then AdamW at the scheduled learning rate, 10 steps; the
    bounds of comparing a run with it."""
    model = TorchGPT2(SMALL, PARAMS)
    tensors = [model.params[n] for n in LAYOUT.names]
    drift = AdamDrift(LAYOUT, B, T, LR, WEIGHT_DECAY, GRAD_REL)
    out = {"losses": [], "loss_bounds": [], "norms": [], "norm_bounds": []}
    for s, pos in enumerate(POSITIONS):
        logits, loss = model.forward_backward(*batch(TRAIN, pos, B, T))
        grads = {n: t.grad.numpy().copy() for n, t in model.params.items()}
        norm_bound = gradnorm_bound(LAYOUT, grads, GRAD_REL, len(update_order(SMALL)))
        norm = float(torch.nn.utils.clip_grad_norm_(tensors, CLIP))
        drift.grad_rel = clipped_grad_rel(norm, norm_bound, CLIP, GRAD_REL)
        clipped = {n: t.grad.numpy() for n, t in model.params.items()}
        out["loss_bounds"].append(drift.gradients(clipped, loss, float(np.abs(logits).max())))
        model.adamw_update(lr_at(s), WEIGHT_DECAY)
        drift.lr = lr_at(s)
        st = model.optimizer.state
        drift.update({n: st[t]["exp_avg"].numpy() for n, t in model.params.items()},
                     {n: st[t]["exp_avg_sq"].numpy() for n, t in model.params.items()},
                     {n: t.detach().numpy() for n, t in model.params.items()})
        out["losses"].append(loss)
        out["norms"].append(norm)
        out["norm_bounds"].append(norm_bound)
    out["params"], out["param_bound"] = model.params_flat(), drift.bound
    return {k: np.asarray(v) for k, v in out.items()}


def run_engine_clipped(kind, runtime, sub_batches=None):
    state = TrainState(config=SMALL, params=PARAMS.copy())
    losses, norms = [], []
    with engine_of(kind, runtime, state, sub_batches) as eng:
        for s, pos in enumerate(POSITIONS):
            lr = learning_rate(s, STEPS, LR, "cosine", WARMUP, MIN_LR)
            losses.append(eng.step(pos, lr, WEIGHT_DECAY, CLIP))
            norms.append(eng.grad_norm())
        coherent(eng)
        return {"losses": np.array(losses), "norms": np.array(norms),
                "params": state.params.copy()}


@pytest.fixture(scope="module")
def clipped(runtime):
    with runtime.paused():
        ref = run_torch_clipped()
    runs = {kind: run_engine_clipped(kind, runtime) for kind in ENGINES}
    runs["starpu, 2 sub-batches"] = run_engine_clipped("starpu", runtime, sub_batches=2)
    return ref, runs


def test_clipping_is_exercised(clipped):
    """The oracle's gradient norm is above the clip in some steps and below it in others:
    the comparison below covers both sides of min(1, C / (norm + 1e-6))."""
    ref, _ = clipped
    assert np.any(ref["norms"] > CLIP) and np.any(ref["norms"] < CLIP), ref["norms"]


@pytest.mark.parametrize("run", ["reference", "starpu", "starpu, 2 sub-batches"])
def test_clipped_scheduled_training_matches_torch(clipped, run):
    ref, runs = clipped
    got = runs[run]
    err = np.abs(got["norms"] - ref["norms"])
    assert np.all(err <= ref["norm_bounds"]), (
        f"{run}: |grad norm - torch| {err} > bounds {ref['norm_bounds']}")
    err = np.abs(got["losses"] - ref["losses"])
    assert np.all(err <= ref["loss_bounds"]), (
        f"{run}: |step loss - torch| {err} > bounds {ref['loss_bounds']}")
    r = ratio(np.abs(got["params"].astype(np.float64) - ref["params"]), ref["param_bound"])
    assert r.max() <= 1.0, f"{run}: parameters after {STEPS} steps: max |diff| / bound {r.max():.3e}"


def test_clipped_starpu_matches_reference(clipped):
    """Same kernels, same order (the norm's tree included), same thread count: bitwise."""
    _, runs = clipped
    a, b = runs["starpu"], runs["reference"]
    assert np.array_equal(a["norms"], b["norms"]) and np.array_equal(a["losses"], b["losses"])
    assert np.array_equal(a["params"], b["params"])


# --------------------------------------------------------------------------- the command line

MICRO = MODELS["micro"]


def run_cli(*args):
    p = subprocess.run([sys.executable, "-m", "starpu_llm", *args], capture_output=True,
                       text=True, timeout=300)
    return p.returncode, p.stdout, p.stderr


@pytest.mark.parametrize("engine", ENGINES)
def test_train_flags_and_metrics(tmp_path, engine):
    """`starpu-llm train` with validation, a cosine schedule with warmup and clipping: the
    metrics file has val_loss after steps 2 and 3 (every 2 steps and the last), the
    scheduled lr and the gradient norm at every step."""
    rng = np.random.default_rng(0)
    train_path, val_path = str(tmp_path / "training.bin"), str(tmp_path / "val.bin")
    formats.write_shard(train_path, np.tile(rng.integers(0, MICRO.V, 37), 300).astype(np.uint16))
    formats.write_shard(val_path, rng.integers(0, MICRO.V, 2000).astype(np.uint16))
    metrics = str(tmp_path / "m.jsonl")
    rc, out, err = run_cli("train", "--model", "micro", "--engine", engine, "--train-data",
                           train_path, "--batch", "2", "--seq-len", "16", "--steps", "3",
                           "--lr", "1e-2", "--val-data", val_path, "--val-every", "2",
                           "--val-batches", "2", "--lr-schedule", "cosine", "--warmup-steps",
                           "1", "--min-lr", "1e-3", "--grad-clip", "0.5",
                           "--metrics-jsonl", metrics)
    assert rc == 0, err
    rows = [json.loads(line) for line in open(metrics)]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert ["val_loss" in r for r in rows] == [False, True, True]
    assert all(np.isfinite(r["val_loss"]) and r["val_loss"] > 0 for r in rows[1:])
    assert [r["lr"] for r in rows] == pytest.approx(
        [learning_rate(s, 3, 1e-2, "cosine", 1, 1e-3) for s in range(3)], rel=1e-12)
    assert all(r["grad_norm"] > 0 for r in rows)
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert ["val loss" in line for line in lines] == [False, True, True], out
    assert all("grad norm" in line and ", lr " in line for line in lines), out
    assert "validation: " in out


@pytest.mark.parametrize("args,flag", [
    (["--lr-schedule", "linear"], "--lr-schedule"),
    (["--lr-schedule", "cosine", "--lr", "1e-3", "--min-lr", "1e-2"], "--min-lr"),
    (["--warmup-steps", "-1"], "--warmup-steps"),
    (["--grad-clip", "-1"], "--grad-clip"),
    (["--val-batches", "0"], "--val-batches"),
])
def test_bad_schedule_and_clip_flags(args, flag):
    rc, _, err = run_cli("train", "--model", "micro", "--steps", "1", *args)
    assert rc == 2 and "Traceback" not in err and flag in err, err


def test_each_step_reports_its_share_of_the_calibrated_peak(tmp_path, monkeypatch):
    """Where this machine is calibrated, each step's line and metrics row carry "mfu": the
    model FLOPs per second over the calibrated sgemm rate of the cores used; without a
    calibration, neither does."""
    from starpu_llm.perf import machine as machines
    from starpu_llm.training.trainer import TrainConfig, train
    shard = str(tmp_path / "s.bin")
    formats.write_shard(shard, np.arange(4000, dtype=np.uint16) % MODELS["micro"].V)

    def run(name):
        lines, metrics = [], str(tmp_path / f"{name}.jsonl")
        train(TrainConfig(model="micro", train_data=shard, batch=2, seq_len=16, steps=2,
                          engine="reference", threads=1, metrics_jsonl=metrics,
                          log=lines.append))
        return lines, [json.loads(line) for line in open(metrics)]
    lines, rows = run("plain")
    assert not any("mfu" in line for line in lines) and all("mfu" not in r for r in rows)
    home = tmp_path / "home"
    monkeypatch.setenv("STARPU_LLM_HOME", str(home))
    cal = machines.load(machines.__file__.replace("machine.py", "reference-calibration.toml"))
    machines.save(cal, machines.default_path())
    lines, rows = run("calibrated")
    fpt = MODELS["micro"].flops_per_token(16)
    for r in rows:
        assert r["mfu"] == pytest.approx(fpt * r["tokens_per_ms"] * 1e3 / cal.sgemm(1), rel=1e-12)
    assert all(f"mfu {r['mfu']:.1%}" in line for r, line in
               zip(rows, [l for l in lines if l.startswith("step")]))
