"""Validation, learning-rate schedules, gradient clipping and gradient accumulation, on both
engines, against the PyTorch oracle (starpu_llm/baselines/torch_gpt2.py).

Bounds (tests/bounds.py, sections "whole model" and "gradient clipping"; none scaled from an
observed error):
  validation loss   the mean over M batches of the forward loss bound of each batch at the
                    engine's parameters (loss_bound: each batch's loss is within its bound,
                    so their mean is within the bounds' mean; the mean itself is in float64)
  gradient norm     per step, gradnorm_bound: the norm of the per-entry gradient bounds plus
                    both runs' rounding of the norm
  clipped training  AdamDrift per step with that step's learning rate and the clipped
                    gradients' relative bound (clipped_grad_rel), GPT-2's betas (0.9, 0.95)
                    on both sides; losses within the step's
                    loss bound, parameters within the drift bound after 10 steps
  accumulation      the gradients and loss of 2 micro-batches of B against torch's of the
                    2B sequences in one batch: those of two fp32 runs of the 2B batch
                    (grad_rel_bound, loss_bound at 2B): each gradient entry is the same sum
                    over the 2BT positions, its terms added in two parts, the second into the
                    first (one more rounding on a chain of 2BT + 1, far below the bound's)
StarPU against the reference engine with clipping or accumulation stays exact (same kernels,
same order, same thread count).
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

from starpu_llm import TrainConfig, train
from starpu_llm._clib import lib
from starpu_llm.baselines.torch_gpt2 import TorchGPT2, batch
from starpu_llm.model.config import MODELS, AdamW, GPTConfig, ParamLayout
from starpu_llm.flow.engine import StarPUEngine
from starpu_llm.flow.reference import ReferenceEngine
from starpu_llm.flow.taskflow import update_order
from starpu_llm.io import formats
from starpu_llm.runtime import usable_cores
from starpu_llm.training.schedule import learning_rate
from starpu_llm.model.state import TrainState, random_init
from partitions import subs

from bounds import (AdamDrift, assert_within, clipped_grad_rel, grad_rel_bound, gradnorm_bound,
                    loss_bound, ratio, slice_scales)
from tracing import named_buffers

torch.set_num_threads(usable_cores())

ENGINES = ("reference", "starpu")
SMALL = GPTConfig(max_seq_len=32, vocab_size=97, padded_vocab_size=128,
                  num_layers=2, num_heads=4, channels=32)
LAYOUT = ParamLayout(SMALL)
B, T, STEPS = 4, 16, 10
LR, MIN_LR, WARMUP, WEIGHT_DECAY = 1e-3, 1e-4, 3, 0.01
CLIP = 1.2        # between the gradient norms of these 10 steps: some steps clip, some not
BETAS = (0.9, 0.95)     # GPT-2's recipe (--beta2 0.95), not the default: they reach the kernels
GRAD_REL = grad_rel_bound(SMALL, B, T)
# the clipped runs' update, the same value for torch and the engines (each step at lr_at)
CLIPPED = AdamW(LR, WEIGHT_DECAY, betas=BETAS, grad_clip=CLIP)

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
            eng.step(pos, AdamW(LR, WEIGHT_DECAY))
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
            eng.step(POSITIONS[0], AdamW(LR, WEIGHT_DECAY))          # moments no longer 0
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
            eng.submit_update(AdamW(LR, WEIGHT_DECAY))
            loss = eng.step(POSITIONS[2], AdamW(LR, WEIGHT_DECAY))
            coherent(eng)
            runs.append((loss, state.params.copy(), state.m.copy(), state.v.copy()))
    assert runs[0][0] == runs[1][0]
    assert all(np.array_equal(a, b) for a, b in zip(runs[0][1:], runs[1][1:]))


def test_validation_flow_is_forward_only(runtime):
    """The tasks of a validation pass, as StarPU ran them: loads and forward layers only,
    parameters read (R), no gradient, moment or gradient-norm handle touched."""
    state = TrainState(config=SMALL, params=PARAMS.copy())
    with engine_of("starpu", runtime, state, sub_batches=2) as eng:
        eng.step(POSITIONS[0], AdamW(LR, WEIGHT_DECAY))
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
    tiny model has GPT-2's vocabulary), at step 0, every step and after the last."""
    from starpu_llm.io.data import default_dataset
    from starpu_llm.training.trainer import TrainConfig, train
    lines = []
    with runtime.paused():
        r = train(TrainConfig(model="tiny", engine="reference", batch=2, seq_len=16, steps=2,
                              val_every=1, val_batches=2, log=lines.append))
    assert [s for s, _ in r.val_losses] == [0, 1, 2]
    assert all(np.isfinite(v) and v > 0 for _, v in r.val_losses), r.val_losses
    assert any(line.startswith("validation: " + default_dataset()[1]) for line in lines), lines


def test_the_first_validations_disk_traffic_is_no_steps():
    """Under a memory limit a step's disk traffic is the change of the runtime's counters
    over it; the validation before the first step is in none (Counters.skip): step 1's
    starts after it."""
    from starpu_llm.training.watchers import Counters

    class Runtime:          # the counters read: 5 MB read, 1 MB written by the validation
        traffic = iter([(0, 0), (5e6, 1e6), (7e6, 4e6)])

        def disk_traffic(self):
            return next(self.traffic)

        def gpu_memory_mb(self):
            return None
    counters = Counters(None, Runtime(), memory=object())
    counters.skip()
    extra = {}
    counters.after_step(extra)
    assert extra == {"disk_read_mb": 2.0, "disk_written_mb": 3.0}


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
    """torch: clip_grad_norm_ then AdamW at the scheduled learning rate (TorchGPT2.adamw_update
    of CLIPPED), 10 steps; the bounds of comparing a run with it."""
    model = TorchGPT2(SMALL, PARAMS)
    drift = AdamDrift(LAYOUT, B, T, LR, WEIGHT_DECAY, GRAD_REL, *BETAS)
    out = {"losses": [], "loss_bounds": [], "norms": [], "norm_bounds": []}
    for s, pos in enumerate(POSITIONS):
        logits, loss = model.forward_backward(*batch(TRAIN, pos, B, T))
        grads = {n: t.grad.numpy().copy() for n, t in model.params.items()}
        norm_bound = gradnorm_bound(LAYOUT, grads, GRAD_REL, len(update_order(SMALL)))
        norm = model.adamw_update(CLIPPED.with_lr(lr_at(s)))    # clips, then updates
        drift.grad_rel = clipped_grad_rel(norm, norm_bound, CLIP, GRAD_REL)
        clipped = {n: t.grad.numpy() for n, t in model.params.items()}   # AdamW leaves them
        out["loss_bounds"].append(drift.gradients(clipped, loss, float(np.abs(logits).max())))
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
            losses.append(eng.step(pos, CLIPPED.with_lr(lr)))
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


# --------------------------------------------------------------------------- weight decay

# nanoGPT's decayed parameters (p.dim() >= 2 of nn.Linear/nn.Embedding weights), by name
MATRICES = {"wte", "wpe", "qkvw", "attprojw", "fcw", "fcprojw"}


@pytest.mark.parametrize("which", [None, "matrices", "all"])
def test_weight_decay_shrinks_the_chosen_tensors(runtime, tmp_path, which):
    """One step with AdamW's decoupled weight decay wd against the same step without: a
    decayed tensor moves by -lr wd p (within the roundings of both updates: on the first
    step |m_hat / (sqrt(v_hat) + eps)| <= 1; the biases start at 0, the layernorms' gains at
    1), any other stays bitwise (0 * p adds nothing).
    By default (and "matrices") the 2-D tensors only, as nanoGPT and llm.c's train_gpt2.cu:
    not the biases nor the layernorms' gains and shifts; "all": every tensor, as llm.c's
    train_gpt2.c."""
    rng = np.random.default_rng(5)
    path = str(tmp_path / "training.bin")
    formats.write_shard(path, rng.integers(0, MICRO.V, 2000).astype(np.uint16))
    lr, wd = 1e-2, 0.5
    common = dict(model="micro", train_data=path, batch=2, seq_len=16, steps=1, lr=lr,
                  engine="reference", log=None)
    if which is not None:
        common["weight_decay_params"] = which
    with runtime.paused():
        plain = train(TrainConfig(**common)).state.params
        decayed = train(TrainConfig(**common, weight_decay=wd)).state.params
    layout = ParamLayout(MICRO)
    p0, a, b = (layout.views(x) for x in (random_init(MICRO, 1337), plain, decayed))
    eps = np.finfo(np.float32).eps
    for n in layout.names:
        if n in (layout.names if which == "all" else MATRICES):
            p = p0[n].astype(np.float64)
            bound = 4 * eps * (np.abs(a[n]) + np.abs(b[n]) + lr * (1 + wd * np.abs(p)))
            assert_within(b[n].astype(np.float64) - a[n], -lr * wd * p, bound,
                          f"{which}: the decay of {n}")
            assert np.any(b[n] != a[n]) or not np.any(p), f"{which}: {n} not decayed"
        else:
            assert np.array_equal(b[n], a[n]), f"{which}: {n} decayed"


def test_the_betas_reach_the_update(runtime, tmp_path):
    """TrainConfig's beta1 and beta2 (--beta1, --beta2) are the moments' decay rates of every
    AdamW task: the first step depends on them only through roundings (its bias-corrected
    moments are g and g^2 in exact arithmetic: a few float32 roundings of the update, at most
    lr each), the second does, for each, far beyond them. (The oracle test of clipped
    training runs with GPT-2's betas against torch's AdamW.)"""
    rng = np.random.default_rng(6)
    path = str(tmp_path / "training.bin")
    formats.write_shard(path, rng.integers(0, MICRO.V, 2000).astype(np.uint16))
    common = dict(model="micro", train_data=path, batch=2, seq_len=16, lr=1e-2,
                  engine="reference", log=None)
    with runtime.paused():
        runs = {betas: [train(TrainConfig(**common, steps=s, beta1=betas[0], beta2=betas[1]))
                        .state.params for s in (1, 2)]
                for betas in ((0.9, 0.999), (0.9, 0.95), (0.5, 0.999))}
    rounding = 8 * np.finfo(np.float32).eps * (np.abs(runs[(0.9, 0.999)][0]) + 1e-2)
    for betas, (first, second) in runs.items():
        assert np.all(np.abs(first - runs[(0.9, 0.999)][0]) <= rounding), betas
        if betas != (0.9, 0.999):
            far = np.abs(second - runs[(0.9, 0.999)][1]) > 100 * rounding
            assert far.mean() > 0.5, (betas, far.mean())


# --------------------------------------------------------------------------- accumulation

ACCUM = 2       # micro-batches of B x T a step: one update on 2B sequences
ACCUM_RUNS = {"reference": ("reference", None), "starpu": ("starpu", None),
              "starpu, 2 sub-batches": ("starpu", 2)}


def micro(step):
    """The positions of step's micro-batches, consecutive as the loader gives them: 2B
    consecutive sequences, the rows of one batch of 2B at the first."""
    return [(step * ACCUM + j) * B * T for j in range(ACCUM)]


@pytest.fixture(scope="module")
def accumulated(runtime):
    """Each run's loss and gradients of its first step's micro-batches (forward_backward),
    then its losses and parameters after that step's update and 2 more accumulated steps."""
    out = {}
    for name, (kind, sub_batches) in ACCUM_RUNS.items():
        state = TrainState(config=SMALL, params=PARAMS.copy())
        with engine_of(kind, runtime, state, sub_batches) as eng:
            first = eng.forward_backward(micro(0))
            coherent(eng)
            grads = state.grads.copy()
            eng.submit_update(AdamW(LR, WEIGHT_DECAY))
            losses = [first] + [eng.step(micro(s), AdamW(LR, WEIGHT_DECAY)) for s in (1, 2)]
            coherent(eng)
            out[name] = {"loss": first, "grads": grads, "losses": losses,
                         "params": state.params.copy()}
    return out


@pytest.mark.parametrize("run", list(ACCUM_RUNS))
def test_accumulated_micro_batches_are_the_whole_batch(accumulated, runtime, run):
    """2 micro-batches of B: the loss and the gradients of torch's batch of their 2B
    sequences, within the fp32 bounds of two runs of that batch (not of one micro-batch: the
    gradient of the first B sequences alone, 1/2 of the mean's terms, is far outside)."""
    got = accumulated[run]
    model = TorchGPT2(SMALL, PARAMS)
    with runtime.paused():
        logits, loss = model.forward_backward(*batch(TRAIN, micro(0)[0], ACCUM * B, T))
    scale = float(np.abs(logits).max())
    assert abs(got["loss"] - loss) <= loss_bound(SMALL, ACCUM * B, T, loss, scale), (
        f"{run}: loss {got['loss']} vs torch's {loss} on the {ACCUM * B} sequences")
    want = LAYOUT.views(model.grads_flat())
    have = LAYOUT.views(got["grads"])
    scales = slice_scales(LAYOUT, want)
    rel = grad_rel_bound(SMALL, ACCUM * B, T)
    for n in LAYOUT.names:
        assert_within(have[n], want[n], rel * scales[n], f"{run}: accumulated gradient of {n}")


def test_accumulation_starpu_matches_reference(accumulated):
    """Same kernels, same order, same thread count, the micro-batches in turn: bitwise."""
    a, b = accumulated["starpu"], accumulated["reference"]
    assert a["losses"] == b["losses"]
    assert np.array_equal(a["grads"], b["grads"]) and np.array_equal(a["params"], b["params"])


def test_the_trainer_steps_over_the_micro_batches(runtime, tmp_path):
    """`train --grad-accum 2 --batch 2`: each step on the loader's next 2 positions (after 3
    steps, where `--batch 4` is), its loss their mean (step 1, from the same parameters: the
    loss of the same 4 sequences as `--batch 4`'s), its tokens 2 x 2 x T, and a run that says
    so; the StarPU engine's steps (submitted ahead) the reference's; 0 refused."""
    rng = np.random.default_rng(3)
    path = str(tmp_path / "training.bin")
    formats.write_shard(path, rng.integers(0, MICRO.V, 3000).astype(np.uint16))
    common = dict(model="micro", train_data=path, seq_len=16, steps=3, lr=1e-2,
                  engine="reference")
    lines = []
    with runtime.paused():
        acc = train(TrainConfig(**common, batch=2, grad_accum=2, log=lines.append))
        whole = train(TrainConfig(**common, batch=4, log=None))
    assert acc.state.data == whole.state.data == {"position": 3 * 4 * 16}
    assert any("B=2 T=16, 2 micro-batches a step (gradient accumulation: 64 tokens)" in line
               for line in lines), lines
    timed = acc.step_ms[1:]
    assert acc.tokens_per_ms == pytest.approx(2 * 2 * 16 * len(timed) / sum(timed), rel=1e-12)
    assert acc.losses[0] == pytest.approx(whole.losses[0], abs=1e-5)
    metrics = str(tmp_path / "m.jsonl")
    rc, out, err = run_cli("train", "--model", "micro", "--train-data", path, "--seq-len", "16",
                           "--steps", "3", "--lr", "1e-2", "--batch", "2", "--grad-accum", "2",
                           "--metrics-jsonl", metrics)
    assert rc == 0, err
    got = [json.loads(line)["loss"] for line in open(metrics)]
    assert got == pytest.approx(acc.losses, abs=1e-5), (got, acc.losses)
    rc, _, err = run_cli("train", "--model", "micro", "--steps", "1", "--grad-accum", "0")
    assert rc == 2 and "Traceback" not in err and "--grad-accum" in err, err


# --------------------------------------------------------------------------- the command line

MICRO = MODELS["micro"]


def run_cli(*args):
    p = subprocess.run([sys.executable, "-m", "starpu_llm", *args], capture_output=True,
                       text=True, timeout=300)
    return p.returncode, p.stdout, p.stderr


@pytest.mark.parametrize("engine", ENGINES)
def test_train_flags_and_metrics(tmp_path, engine):
    """`starpu-llm train` with validation, a cosine schedule with warmup and clipping: the
    metrics file has a row of step 0 with the initial weights' val_loss only, val_loss after
    steps 2 and 3 (every 2 steps and the last), the scheduled lr and the gradient norm at
    every step; the lines likewise."""
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
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert sorted(rows[0]) == ["partition", "step", "val_loss"]
    assert ["val_loss" in r for r in rows] == [True, False, True, True]
    assert all(np.isfinite(r["val_loss"]) and r["val_loss"] > 0 for r in rows if "val_loss" in r)
    steps = rows[1:]
    assert [r["lr"] for r in steps] == pytest.approx(
        [learning_rate(s, 3, 1e-2, "cosine", 1, 1e-3) for s in range(3)], rel=1e-12)
    assert all(r["grad_norm"] > 0 for r in steps)
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert lines[0] == f"step    0/3: val loss {rows[0]['val_loss']:.6g}", out
    assert ["val loss" in line for line in lines[1:]] == [False, True, True], out
    assert all("grad norm" in line and ", lr " in line for line in lines[1:]), out
    assert "validation: " in out


@pytest.mark.parametrize("args,flag", [
    (["--lr-schedule", "linear"], "--lr-schedule"),
    (["--lr-schedule", "cosine", "--lr", "1e-3", "--min-lr", "1e-2"], "--min-lr"),
    (["--warmup-steps", "-1"], "--warmup-steps"),
    (["--grad-clip", "-1"], "--grad-clip"),
    (["--weight-decay-params", "biases"], "--weight-decay-params"),
    (["--val-batches", "0"], "--val-batches"),
    (["--val-data", "val.bin"], "--val-data is read only to validate every --val-every N steps"),
    # its own data validated on the bundled Shakespeare's validation shard, silently
    (["--train-data", "d/mine_train.bin", "--val-every", "5"],
     "--val-every with --train-data d/mine_train.bin needs --val-data, the validation shard of the "
     "same text (without it, the bundled Shakespeare's would be used); give the one `prepare` wrote "
     "beside the training shard (d/mine_val.bin)"),
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


def test_a_step_line_says_its_extras_in_their_units():
    # the line rounds what the metrics row keeps whole: megabytes as MB with one decimal
    # (it printed "disk written mb 2.94912"), mfu as a percentage, a loss to 6 digits
    from starpu_llm.training.watchers import _extra
    assert _extra("disk_written_mb", 2.94912) == "disk written 2.9 MB"
    assert _extra("disk_read_mb", 0.0) == "disk read 0.0 MB"
    assert _extra("mfu", 0.3104) == "mfu 31.0%"
    assert _extra("val_loss", 4.2345678) == "val loss 4.23457"
