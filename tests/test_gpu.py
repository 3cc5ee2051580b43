"""GPT-2 on a GPU through StarPU: the StarPU engine with a CUDA worker (Runtime(gpus=1)) beside
its CPU workers, every layer's task on the GPU (the CPU workers load the batches), StarPU moving
the data. Every test skips without a CUDA build or without a GPU, naming which.

  - 10 AdamW steps of `tiny` and `d12` against the PyTorch oracle with test_model.py's
    comparisons: matmuls in fp32 within its fp32 bounds, in TF32 within bounds.py's TF32
    bounds (each GEMM along a chain adds 2^14 + 4 to its length, the fused attention's TF32
    products too: d12's logits within 9.1 % of max |logits|; test_model_cuda.py checks the
    figures);
    and that the GPU ran tasks;
  - the CPU and GPU engines' losses side by side (printed), both within the oracle's bounds;
  - checkpoints written on one engine resumed on the other (trainer.train, --save then
    --resume), the 4 steps within the oracle's bounds;
  - `--grad-clip` through train() with --gpus 1 against test_train_features' clipped oracle.
  - `--grad-accum 2`: the first step's loss and gradients against torch's batch of the 2B
    sequences (test_train_features' bounds, with the fused attention).
  - HellaSwag: each ending's mean loss on the GPU within the TF32 bound of the CPU's, the same
    picks where that bound decides them; `eval --gpus 1` and `train --gpus 1 --hellaswag` score
    as the CPU;
  - `--train-data` a glob of shards: the single shard's losses bit for bit, at lr 0 and
    trained (no atomics: a GPU run's bits are the same on every run), trained within the
    oracle's TF32 bounds;
  - a GPU run saved and resumed on the GPU: the uninterrupted run's losses and parameters to
    the bit;
  - `--version`: the driver's CUDA and each GPU's sm_XX as nvidia-smi states them; `--gpus`
    past the GPUs CUDA sees: one error naming the count.
`pytest -s` prints the errors against their bounds and where the tasks ran."""
import os
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest

from starpu_llm import TrainConfig, train
from starpu_llm._clib import lib
from starpu_llm.model.config import ParamLayout
from starpu_llm.runtime import Runtime
from starpu_llm.kernels.codelets import cuda_devices
from starpu_llm.runtime.starpu import have_cuda, placed, placement
from partitions import here
from test_model import (STEPS, WEIGHT_DECAY, compare, make_case, param_errors, report, run_engine,
                        run_torch)


def _why_no_gpu():
    if not have_cuda():
        return "not a CUDA build (README, GPUs: make cuda), so no GPU runs"
    n, why = cuda_devices()
    if n < 1:
        return f"no GPU: {why or 'CUDA reports no device'}"
    return None


pytestmark = pytest.mark.skipif(_why_no_gpu() is not None, reason=str(_why_no_gpu()))

_torch_runs = {}


def oracle(case):
    """torch's run of case (test_model.run_torch) with the bounds of case's precision and
    attention (a GPU run's is the fused one, Runtime's default with GPUs), one torch run per
    (model, steps, attention) for both precisions (d12's takes a while)."""
    key = (case.name, case.steps, case.attention)
    if key not in _torch_runs:
        out = {}
        run_torch(case, out, tf32s=(False, True))
        _torch_runs[key] = out
    out = dict(_torch_runs[key])
    out["bounds"] = out["bounds_tf32"][case.tf32]
    return out


def gpu_runtime(matmul: str) -> Runtime:
    return Runtime(here(gpus=1, gpu_matmul=matmul))


def where_ran(events, cuda_workers: int | None = None) -> Counter:
    """Tasks of a trace per (codelet, "gpu" or "cpu"): StarPU numbers its CUDA workers first
    (cuda_workers: how many; None: StarPU's count, while it runs)."""
    if cuda_workers is None:
        cuda_workers = lib.sl_cuda_worker_count()
    cuda_workers = set(range(cuda_workers))
    return Counter((e.codelet, "gpu" if e.worker in cuda_workers else "cpu") for e in events)


def test_cpu_and_gpu_losses_side_by_side(runtime):
    """tiny, 10 steps, fp32 matmuls: the CPU engine (this file's CPU runtime) and the GPU
    engine from the same parameters, their losses printed side by side; each within the
    oracle's step-loss bounds, so within their sum of each other."""
    case = make_case("tiny")
    out, out_gpu = oracle(case), oracle(replace(case, attention="flash"))
    _, (cpu_losses, _) = run_engine("starpu", case, runtime)
    runtime.shutdown()
    with gpu_runtime("fp32") as rt:
        _, (gpu_losses, _) = run_engine("starpu", case, rt)
    bound, gpu_bound = out["bounds"].step_losses, out_gpu["bounds"].step_losses
    print("\n[tiny] step   torch        cpu          gpu (fp32)   bound")
    for i in range(STEPS):
        print(f"[tiny] {i + 1:4d}   {out['losses'][i]:.7f}  {cpu_losses[i]:.7f}  "
              f"{gpu_losses[i]:.7f}  {bound[i]:.1e}")
    for what, losses, b in (("cpu", cpu_losses, bound), ("gpu", gpu_losses, gpu_bound)):
        err = np.abs(losses - out["losses"])
        assert np.all(err <= b), f"{what}: |loss - torch| {err} > {b}"


@pytest.mark.parametrize("first,then", [(1, 0), (0, 1)], ids=["gpu-then-cpu", "cpu-then-gpu"])
def test_checkpoint_resumes_on_the_other_engine(tmp_path, first, then):
    """2 steps on one engine saved (--save), resumed (--resume) for 2 more on the other: the 4
    losses and the final parameters within the oracle's bounds for 4 uninterrupted steps."""
    case = replace(make_case("tiny"), steps=4)
    # one engine's attention is the GEMM one, the other's (on the GPU) the fused one: each
    # bound the larger of the two forms'
    out = oracle(case)
    fused = oracle(replace(case, attention="flash"))["bounds"]
    out["bounds"] = replace(out["bounds"], **{
        f: np.maximum(getattr(out["bounds"], f), getattr(fused, f))
        for f in ("step_losses", "params")})
    path = str(tmp_path / "tiny.bin")
    common = dict(model="tiny", batch=case.B, seq_len=case.T, lr=case.lr, weight_decay=0.01,
                  gpu_matmul="fp32", log=None)
    a = train(TrainConfig(steps=2, save=path, gpus=first, **common))
    b = train(TrainConfig(steps=4, resume=path, gpus=then, **common))
    losses = np.array(a.losses + b.losses)
    assert b.state.step == 4
    err = np.abs(losses - out["losses"])
    assert np.all(err <= out["bounds"].step_losses), (losses, out["losses"])
    # the parameters: every tensor within the AdamW drift bound (test_model.param_errors)
    ratios = {n: r for n, (_, r) in param_errors(ParamLayout(case.config), b.state.params,
                                                  out["params"], out["bounds"].params).items()}
    assert max(ratios.values()) <= 1.0, ratios


def test_a_gpu_run_resumed_on_the_gpu_is_the_uninterrupted_run_to_the_bit(tmp_path):
    """2 steps on the GPU saved, resumed on the GPU for 2 more: the losses and the final
    parameters those of 4 uninterrupted GPU steps, bit for bit, as the CPU engine's resume is
    (test_resume.py). It holds where the GPU's kernels are deterministic (no atomics: the
    embedding's backward adds a token's rows in order) and cuBLAS picks the same algorithms in
    both runs of one process (one toolkit, one GPU, a handle per stream)."""
    path = str(tmp_path / "tiny.bin")
    common = dict(model="tiny", batch=4, seq_len=64, lr=1e-3, weight_decay=0.01, gpus=1,
                  gpu_matmul="tf32", log=None)
    whole = train(TrainConfig(steps=4, **common))
    a = train(TrainConfig(steps=2, save=path, **common))
    b = train(TrainConfig(steps=4, resume=path, **common))
    assert b.state.step == 4
    assert a.losses + b.losses == whole.losses, (a.losses + b.losses, whole.losses)
    assert np.array_equal(b.state.params, whole.state.params)


# tiny first, d12 last (its oracle takes the longest): what a time limit cuts is d12
@pytest.fixture(scope="module", params=[("tiny", "fp32"), ("tiny", "tf32"), ("d12", "fp32"),
                                        ("d12", "tf32")], ids=lambda p: "-".join(p))
def gpu_run(request):
    """(case, errors against torch, bounds, tasks per (codelet, worker kind)) of one model
    trained on the GPU engine at one matmul precision."""
    name, matmul = request.param
    case = replace(make_case(name), tf32=matmul == "tf32", attention="flash")
    out = oracle(case)
    with gpu_runtime(matmul) as rt:
        rt.start_trace(400_000)
        fb, trained = run_engine("starpu", case, rt)
        where = where_ran(rt.trace())
        rt.stop_trace()
        assert placed() == placement(1)     # what sl_start gave StarPU: the one decision
    errors = compare(ParamLayout(case.config), fb, trained,
                     (out["logits"], out["loss"], out["grads"]), (out["losses"], out["params"]),
                     out["bounds"].params)
    report(f"{name}] [gpu {matmul}", errors, case, out["bounds"])
    print(f"[{name}] [gpu {matmul}] tasks on the GPU / on CPUs: " + ", ".join(
        f"{c} {where[(c, 'gpu')]}/{where[(c, 'cpu')]}" for c in sorted({c for c, _ in where})))
    return case, errors, out["bounds"], where


def test_gpu_matches_torch(gpu_run):
    case, errors, bounds, _ = gpu_run
    ratios = errors.ratios(case, bounds)
    # logits, loss and gradients of the first batch, the 10 losses, the final parameters:
    # each within its bound (test_model.py; TF32: bounds.py)
    assert all(r <= 1.0 for r in ratios.values()), \
        f"{case.name} ({'tf32' if case.tf32 else 'fp32'}): error / bound {ratios}"


def on_cpu_but_loads(where: Counter) -> dict:
    """The tasks of `where` (per (codelet, worker kind)) that ran on a CPU worker, but the
    batch loads (they read the token shard in host memory: CPU only, on purpose)."""
    return {c: n for (c, kind), n in where.items() if kind == "cpu" and c != "load_batch"}


def test_the_gpu_ran_the_layers(gpu_run):
    """Every layer task of every step (forward, backward, AdamW) ran on the CUDA worker:
    none on a CPU worker, the batch loads only there."""
    _, _, _, where = gpu_run
    assert not on_cpu_but_loads(where), f"layer tasks ran on a CPU worker: {dict(where)}"
    assert where[("matmul_forward", "gpu")] > 0 and where[("adamw", "gpu")] > 0
    assert where[("load_batch", "gpu")] == 0


def test_grad_clip_through_train_on_the_gpu(tmp_path):
    """`train --gpus 1 --grad-clip` (TrainConfig, the CLI's path; fp32 matmuls): the
    clipped, scheduled run of test_train_features against its PyTorch oracle within the same
    bounds (gradient norms, losses, parameters after 10 steps): the clip scale computed on
    the GPU from the norm tree's root by each AdamW task, no host read before the update;
    every layer task of every step on the CUDA worker (the task trace)."""
    import json
    import test_train_features as tf
    from starpu_llm.io import formats
    from starpu_llm.model.state import TrainState

    ref = tf.run_torch_clipped()
    shard = formats.write_shard(str(tmp_path / "train.bin"), tf.TRAIN)
    metrics = str(tmp_path / "m.jsonl")
    state = TrainState(config=tf.SMALL, params=tf.PARAMS.copy())
    r = train(TrainConfig(train_data=shard, batch=tf.B, seq_len=tf.T, steps=tf.STEPS, lr=tf.LR,
                          lr_schedule="cosine", warmup_steps=tf.WARMUP, min_lr=tf.MIN_LR,
                          weight_decay=tf.WEIGHT_DECAY, grad_clip=tf.CLIP, gpus=1,
                          gpu_matmul="fp32", trace=True, metrics_jsonl=metrics, log=None), state)
    assert np.any(ref["norms"] > tf.CLIP) and np.any(ref["norms"] < tf.CLIP)
    norms = np.array([json.loads(line)["grad_norm"] for line in open(metrics)])
    err = np.abs(norms - ref["norms"])
    assert np.all(err <= ref["norm_bounds"]), f"|grad norm - torch| {err} > {ref['norm_bounds']}"
    err = np.abs(np.array(r.losses) - ref["losses"])
    assert np.all(err <= ref["loss_bounds"]), f"|loss - torch| {err} > {ref['loss_bounds']}"
    ratio = tf.ratio(np.abs(r.state.params.astype(np.float64) - ref["params"]),
                     ref["param_bound"])
    assert ratio.max() <= 1.0, f"parameters: max |diff| / bound {ratio.max():.3e}"
    where = where_ran(r.trace, cuda_workers=1)     # train() has shut StarPU down: gpus=1
    assert where[("grad_sumsq", "gpu")] > 0 and where[("norm_sum", "gpu")] > 0
    assert not on_cpu_but_loads(where), f"layer tasks ran on a CPU worker: {dict(where)}"


def accumulated_step_on(rt, micro_batches: int = 2):
    """The loss and gradients of test_train_features' first accumulated step (its 2
    micro-batches of B submitted in turn) on runtime rt, and the tasks per (codelet, where)."""
    import test_train_features as tf
    from starpu_llm.flow.engine import StarPUEngine
    from starpu_llm.model.state import TrainState
    state = TrainState(config=tf.SMALL, params=tf.PARAMS.copy())
    eng = StarPUEngine(tf.SMALL, state, tf.B, tf.T, tf.TRAIN, rt)
    try:
        rt.start_trace(100_000)
        loss = eng.forward_backward(tf.micro(0)[:micro_batches])
        eng.sync()
        where = where_ran(rt.trace())
        rt.stop_trace()
    finally:
        eng.close()
    return loss, state.grads.copy(), where


def test_gradient_accumulation_on_the_gpu_is_the_whole_batch():
    """`--grad-accum 2` on the GPU engine (fp32 matmuls, the fused attention): 2 micro-batches
    of B give the loss and the gradients of torch's batch of their 2B sequences, within the
    fp32 bounds of two runs of that batch with the fused attention (test_train_features'
    CPU test, here the cross-entropy's accumulation into its losses and the backward's into the
    gradients run in the CUDA bodies); every layer task on the CUDA worker."""
    import test_train_features as tf
    from bounds import assert_within, grad_rel_bound, loss_bound, slice_scales
    from starpu_llm.baselines.torch_gpt2 import TorchGPT2, batch
    with gpu_runtime("fp32") as rt:
        loss, grads, where = accumulated_step_on(rt)
    n = tf.ACCUM * tf.B
    model = TorchGPT2(tf.SMALL, tf.PARAMS)
    logits, want = model.forward_backward(*batch(tf.TRAIN, tf.micro(0)[0], n, tf.T))
    scale = float(np.abs(logits).max())
    assert abs(loss - want) <= loss_bound(tf.SMALL, n, tf.T, want, scale, attention="flash"), \
        f"gpu: loss {loss} vs torch's {want} on the {n} sequences"
    layout = ParamLayout(tf.SMALL)
    have, expect = layout.views(grads), layout.views(model.grads_flat())
    scales = slice_scales(layout, expect)
    rel = grad_rel_bound(tf.SMALL, n, tf.T, attention="flash")
    for name in layout.names:
        assert_within(have[name], expect[name], rel * scales[name],
                      f"gpu: accumulated gradient of {name}")
    assert not on_cpu_but_loads(where), f"layer tasks ran on a CPU worker: {dict(where)}"
    assert where[("crossentropy_forward", "gpu")] == tf.ACCUM, dict(where)


def test_the_trace_times_the_kernels_on_the_gpu():
    """A traced `train --gpus 1` (tiny, 3 steps): every task on the CUDA worker has its
    kernels' GPU interval (two events on its stream, trace.c), which starts after the task
    began queueing them and, the worker having one stream, after the previous task's
    kernels ended; the CPU tasks (the batch loads) have none. gpu_bench.py's GPU-busy
    fraction is read from these."""
    r = train(TrainConfig(model="tiny", batch=4, seq_len=64, steps=3, gpus=1, trace=True,
                          log=None))
    gpu = sorted((e for e in r.trace if e.worker == 0), key=lambda e: e.gpu_start_ns)
    cpu = [e for e in r.trace if e.worker != 0]
    assert gpu and cpu and all(e.codelet == "load_batch" for e in cpu)
    assert all(e.gpu_start_ns == e.gpu_end_ns == 0 for e in cpu)
    slack = 100_000         # 0.1 ms: the host clock read against the GPU's, once
    for e in gpu:
        assert 0 < e.gpu_start_ns <= e.gpu_end_ns, e
        assert e.gpu_start_ns >= e.start_ns - slack, e
    for a, b in zip(gpu, gpu[1:]):
        assert b.gpu_start_ns >= a.gpu_end_ns - slack, (a, b)


def test_gpu_batched_decoding_equals_one_sequence_at_a_time():
    """What `serve --gpus 1` runs: test_batch.py's sequences that come and go in 3 slots
    (prompts prefilled beside other sequences' tokens, slots reused), decoded on the GPU
    engine (fp32 matmuls), against one sequence at a time on the reference engine (CPU): the
    logits within the fp32 bound of the generation tests, the same greedy tokens; and the
    decode kernels ran on the GPU."""
    from bounds import assert_within, logits_bound
    from starpu_llm.flow import generate as gen
    from starpu_llm.flow.batch import SlotDecoder
    from test_batch import MICRO, REQUESTS, alone, continuous, peaked_params, prompts

    requests = list(zip(prompts(), (new for _, new in REQUESTS)))
    ref_backend = gen.DirectBackend(MICRO, peaked_params(MICRO))
    try:
        ref = [alone(ref_backend, prompt, new) for prompt, new in requests]
    finally:
        ref_backend.close()
    with gpu_runtime("fp32") as rt:
        backend = gen.StarPUBackend(rt, MICRO, peaked_params(MICRO))
        try:
            rt.start_trace(400_000)
            batched, largest = continuous(SlotDecoder(backend, 3, rows=24), requests)
            where = where_ran(rt.trace())
            rt.stop_trace()
        finally:
            backend.close()
    assert largest == 3
    for (prompt, new), (tokens, steps), (ref_tokens, ref_steps) in zip(requests, batched, ref):
        for k, (a, b) in enumerate(zip(steps, ref_steps)):
            T = len(prompt) + k
            assert_within(a, b, logits_bound(MICRO, 1, T, np.abs(b).max()),
                          f"gpu: prompt of {len(prompt)}, logits after {T} tokens")
        assert tokens == ref_tokens
    print("\n[decode] tasks on the GPU / on CPUs: " + ", ".join(
        f"{c} {where[(c, 'gpu')]}/{where[(c, 'cpu')]}" for c in sorted({c for c, _ in where})))
    assert sum(n for (c, kind), n in where.items() if kind == "gpu") > 0, dict(where)



def test_gpu_generate_continues_as_the_cpu(tmp_path):
    """`starpu-llm generate --gpus 1 --gpu-matmul fp32`: the decode steps on the GPU give the
    reference engine's greedy text on CPUs (a model whose top two logits stand apart, so the
    fp32 differences of the GPU's kernels cannot flip a choice)."""
    from starpu_llm.cli_generate import run_generate
    from starpu_llm.io import formats
    from starpu_llm.model.config import MODELS
    from starpu_llm.plan.partition import PartitionRequest
    from test_batch import peaked_params
    ckpt = tmp_path / "tiny.bin"
    formats.write_checkpoint(ckpt, MODELS["tiny"], peaked_params(MODELS["tiny"]))
    args = dict(prompt="The quick brown fox", max_new_tokens=16, top_k=1, write=lambda _: None)
    gpu = run_generate(ckpt, request=PartitionRequest(gpus=1, gpu_matmul="fp32"), **args)
    cpu = run_generate(ckpt, engine="reference", **args)
    assert gpu == cpu and len(gpu) > 0


def test_gpu_memory_is_read_on_the_cuda_workers_devices():
    """The peak GPU memory is read on the devices StarPU's CUDA workers run on (their device
    ids from StarPU), not on GPUs 0..n-1: with STARPU_WORKERS_CUDAID naming the last GPU, the
    one CUDA worker's device is that one, and the memory read there holds the CUDA context."""
    import json
    import os
    import subprocess
    import sys
    last = cuda_devices()[0] - 1
    code = ("import json\nfrom starpu_llm.runtime import Runtime\nfrom partitions import here\n"
            "with Runtime(here(gpus=1)) as rt:\n"
            "    print(json.dumps([rt.cuda_devices(), rt.gpu_memory_mb()]))\n")
    env = dict(os.environ, STARPU_WORKERS_CUDAID=str(last))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       cwd=os.path.dirname(__file__), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    devices, mb = json.loads(r.stdout.strip().splitlines()[-1])
    assert devices == [last], devices
    assert mb > 0, mb


def _history_hashes(folder) -> set:
    """The footprints (hashes) of the entries of sl_matmul_forward's history-based perf model
    in a perf-model folder (STARPU_PERF_MODEL_DIR)."""
    import glob
    hashes = set()
    for path in glob.glob(os.path.join(folder, "codelets", "*", "sl_matmul_forward.*")):
        lines = open(path, encoding="utf-8", errors="replace").read().splitlines()
        for i, line in enumerate(lines):
            if line.startswith("# hash"):
                for entry in lines[i + 1:]:
                    if not entry.strip() or entry.startswith("#"):
                        break
                    hashes.add(entry.split()[0])
    return hashes


def test_fp32_and_tf32_matmuls_keep_apart_histories(tmp_path):
    """A GEMM in fp32 takes several times its TF32 time for the same sizes, and StarPU adds
    samples to a history entry only while it calibrates it: the perf model's footprint tells
    the two precisions apart (csrc/starpu/codelets.c, footprint), so a host's CUDA history
    calibrated by an fp32 run is not what dmdas reads for a TF32 one. Two runs, fp32 then
    TF32, into one perf-model folder: the TF32 run's matmuls add entries of their own."""
    import subprocess
    import sys
    from starpu_llm.io import formats
    from starpu_llm.model.config import MODELS
    rng = np.random.default_rng(1)
    shard = formats.write_shard(str(tmp_path / "train.bin"),
                                np.tile(rng.integers(0, MODELS["micro"].V, 41), 800)
                                .astype(np.uint16))
    folder = str(tmp_path / "models")
    env = dict(os.environ, STARPU_PERF_MODEL_DIR=folder, STARPU_CALIBRATE="1")
    seen = []
    for matmul in ("fp32", "tf32"):
        r = subprocess.run([sys.executable, "-m", "starpu_llm", "train", "--model", "micro",
                            "--train-data", shard, "--batch", "4", "--seq-len", "16",
                            "--steps", "2", "--gpus", "1", "--gpu-matmul", matmul],
                           env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        seen.append(_history_hashes(folder))
    assert seen[0], "the fp32 run wrote no sl_matmul_forward history"
    assert seen[1] > seen[0], f"the TF32 run's matmuls reused the fp32 entries: {seen}"


# The paths that came after the tests above (HellaSwag, several shards, --version, the GPU
# count): after them, so what a time limit cuts is these (about 30 s in all on an H200).

def test_gpu_hellaswag_endings_score_as_on_the_cpu(tmp_path):
    """HellaSwag on the GPU engine (flow/losses.TokenLosses on a StarPUBackend, TF32 matmuls,
    the GEMM attention TokenLosses lays out): test_hellaswag's 6 examples, each ending's mean
    loss within the TF32 loss bound of the reference engine's on the CPU, and the same pick by
    the lowest mean (acc_norm) and the lowest sum (acc) wherever that bound decides it
    (test_hellaswag.DECIDED, found on the CPU); the forwards' matmuls ran on the GPU."""
    import test_hellaswag as hs
    from starpu_llm.flow import generate as gen
    examples = hs.scored_examples(tmp_path)
    ref = hs.scored(gen.DirectBackend(hs.TINY, hs.PARAMS), examples)
    with gpu_runtime("tf32") as rt:
        backend = gen.StarPUBackend(rt, hs.TINY, hs.PARAMS)
        try:
            rt.start_trace(100_000)
            got = hs.scored(backend, examples)
            where = where_ran(rt.trace())
            rt.stop_trace()
        finally:
            backend.close()
    print("\n[hellaswag] mean loss of each ending, cpu / gpu (tf32):")
    for cpu, gpu in zip(ref[0] / ref[1], got[0] / got[1]):
        print("[hellaswag] " + "  ".join(f"{a:.6f}/{b:.6f}" for a, b in zip(cpu, gpu)))
    assert hs.assert_same_endings(examples, ref, got, tf32=True) == hs.DECIDED[True]
    assert where[("matmul_forward", "gpu")] > 0, dict(where)


def test_gpu_eval_and_train_measure_hellaswag_as_the_cpu(tmp_path):
    """`starpu-llm eval --hellaswag FILE --gpus 1 --gpu-matmul fp32` (a runtime of its own) and
    `train --gpus 1 --hellaswag FILE --hellaswag-every 1` (step 0's measure on the training
    engine's own parameter handles, on the GPU): test_hellaswag's greedy examples right, then
    moved by one, scored 3/6 as on the CPU (every pick decided at the fp32 bound there:
    test_engines_pick_the_same_endings_where_the_bound_decides; not all at TF32's)."""
    import test_hellaswag as hs
    from starpu_llm.io import formats
    ckpt = tmp_path / "tiny.bin"
    formats.write_checkpoint(ckpt, hs.TINY, hs.PARAMS)
    path = hs.greedy_and_wrong_file(tmp_path)
    rc, out, err = hs.eval_cli("--hellaswag", path, "--init-from", ckpt, "--batch", 5,
                               "--gpus", 1, "--gpu-matmul", "fp32")
    assert rc == 0, err
    assert out == f"hellaswag: {path}, 6 example(s): acc 0.5000 (3/6), acc_norm 0.5000 (3/6)\n", out
    r = train(TrainConfig(init_from=str(ckpt), hellaswag=path, hellaswag_every=1, steps=1,
                          batch=4, seq_len=64, gpus=1, gpu_matmul="fp32", log=None))
    assert r.hellaswag[0] == (0, 0.5), r.hellaswag


def test_training_on_shards_is_training_on_the_shard_they_were_cut_from(tmp_path):
    """`train --gpus 1 --train-data "dir/x_train_*.bin"`: 3 shards cut from the tiny case's
    tokens as `prepare --shard-tokens N` cuts them (N = 4 batches; each after the first
    begins with the one before's last token), each step's batch a memory-mapped view handed to
    its load task (flow/step.token_pointer), 4 + 4 + 2 batches in 10 steps. At lr 0 every
    loss is a forward of the initial weights on its batch: the 10 losses are the single
    shard's, bit for bit. Trained (the case's lr) too, end to end: no kernel adds by atomics
    (encoder.cu's embedding backward adds a repeated token's rows in a fixed order, the CPU
    kernel's) and cuBLAS gives the same bits on every run for one toolkit, GPU model and SM
    count with a handle per stream (its "Results reproducibility"; each CUDA worker has its
    own), so the same batches give the same 10 losses; all 10 within the oracle's TF32
    step-loss bounds (docs/gpus.md, "Deterministic training")."""
    from starpu_llm.io import formats
    case = replace(make_case("tiny"), tf32=True, attention="flash")   # train --gpus 1's defaults
    n = 4 * case.B * case.T
    for k in range(3):
        formats.write_shard(str(tmp_path / f"x_train_{k:06d}.bin"),
                            case.tokens[k * n:(k + 1) * n + 1])
    pattern = str(tmp_path / "x_train_*.bin")
    common = dict(model="tiny", batch=case.B, seq_len=case.T, steps=case.steps,
                  weight_decay=WEIGHT_DECAY, gpus=1, log=None)
    # train_data None: the single shard (data.default_dataset), the case's tokens
    shards, single = (train(TrainConfig(train_data=d, lr=0.0, **common)).losses
                      for d in (pattern, None))
    assert shards == single and len(set(single)) == case.steps, (shards, single)
    trained, again = (np.array(train(TrainConfig(train_data=d, lr=case.lr, **common)).losses)
                      for d in (pattern, None))
    assert np.array_equal(trained, again), (trained, again)
    out = oracle(case)
    assert trained[0] == single[0]
    err = np.abs(trained - out["losses"])
    assert np.all(err <= out["bounds"].step_losses), f"|loss - torch| {err} > {out['bounds'].step_losses}"


def test_version_names_the_drivers_cuda_and_each_gpus_sm():
    """`starpu-llm --version` on the GPU machine (cli.cuda_text): the driver's CUDA as
    nvidia-smi states it, of a major version no older than the build's CUDA, then every GPU
    (no CUDA_VISIBLE_DEVICES) by the compute capability nvidia-smi gives it (sm_90 on an H100
    or H200), each one the kernels run on (no rebuild named)."""
    import re
    import subprocess
    import sys

    def smi(*args):
        r = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout
    driver = re.search(r"CUDA Version:\s*(\d+\.\d+)", smi()).group(1)
    gpus = [line.rsplit(",", 1) for line in
            smi("--query-gpu=name,compute_cap", "--format=csv,noheader").strip().splitlines()]
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    r = subprocess.run([sys.executable, "-m", "starpu_llm", "--version"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    line = r.stdout.splitlines()[2]
    m = re.fullmatch(r"StarPU-MPI: (?:yes|no), CUDA: yes \(built with CUDA (\d+)\.(\d+) for "
                     r"sm_\d+(?: sm_\d+)* \+ PTX compute_\d+; driver: CUDA (\d+)\.(\d+); (\d+) "
                     r"GPU\(s\) seen: (.+)\), parallel workers: .+", line)
    assert m, line
    # a driver of the build's major version, minor versions either way (CUDA's minor version
    # compatibility)
    assert f"{m[3]}.{m[4]}" == driver and int(m[3]) >= int(m[1]), line
    assert int(m[5]) == len(gpus), (line, gpus)
    assert m[6] == ", ".join(f"{d}: sm_{cc.strip().replace('.', '')}"
                             for d, (_, cc) in enumerate(gpus)), (line, gpus)
    hopper = [d for d, (name, _) in enumerate(gpus) if "H100" in name or "H200" in name]
    assert all(f"{d}: sm_90" in m[6] for d in hopper), (line, gpus)


def test_gpus_past_those_cuda_sees_is_one_clear_error_naming_the_count():
    """`train --gpus N+1` where CUDA sees N (partition._check_devices, before StarPU starts):
    one clear error naming both, exit 2; with CUDA_VISIBLE_DEVICES empty CUDA sees none
    (sl_gpu_devices reads cudaErrorNoDevice as 0 GPUs, not as a driver's error), and --gpus 1
    is that error naming 0."""
    import subprocess
    import sys
    from test_cli import assert_clean_error
    n = cuda_devices()[0]
    for env, gpus, seen in ((os.environ, n + 1, n), (dict(os.environ, CUDA_VISIBLE_DEVICES=""), 1, 0)):
        r = subprocess.run([sys.executable, "-m", "starpu_llm", "train", "--model", "tiny",
                            "--steps", "1", "--gpus", str(gpus)], env=env, capture_output=True,
                           text=True, timeout=120)
        assert_clean_error(r.returncode, r.stderr, f"--gpus {gpus}: CUDA sees {seen} GPU(s) here",
                           f"ask for at most {seen}")
