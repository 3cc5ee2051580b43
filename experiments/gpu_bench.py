"""GPT-2 124M training on one GPU, side by side in one run (issue 41, item 6): starpu-llm's
StarPU engine with a CUDA worker, llm.c's train_gpt2_fp32.cu and PyTorch eager (SDPA, fused
AdamW), all with TF32 matmuls, at B x T = 16 x 1024, 8 x 1024 and 128 x 64 (the systems
interleaved shape by shape), from the same random init on the bundled Shakespeare tokens.

    python experiments/gpu_bench.py [--out DIR] [--llmc DIR | --llmc-binary FILE]
                                    [--shapes 16x1024,8x1024,128x64] [--steps 10] [--warmup 3]
                                    [--timeout 150] [--trace]

Each system runs each shape in a process of its own (one CUDA context and allocator at a
time), `warmup` untimed steps then `steps` timed ones:
  - starpu-llm: starpu_llm.train(TrainConfig(gpus=1, gpu_matmul="tf32", ...)), what
    `starpu-llm train --gpus 1` runs: every layer's task on the CUDA worker (the batch loads
    on a CPU worker), StarPU moving the data, step n + 1 submitted before step n's loss is
    read; a step's ms is the trainer's own. With --trace, a second run of warmup + 1 steps
    records its tasks to DIR/trace_BxT.csv (when each task's kernels were queued on which
    worker: the CUDA tasks are asynchronous); the timed run is never traced;
  - PyTorch eager: starpu_llm.baselines.torch_sdpa on "cuda", TF32 allowed; a step's ms is
    its adamw_step's (the loss read back);
  - llm.c (--llmc: a folder with train_gpt2_fp32.cu and llmc/, a fetched copy kept outside
    this repository, built here with nvcc -O3 --use_fast_math for this GPU; or --llmc-binary:
    one built already, in a folder of its own): run on the same parameters (written in llm.c's
    checkpoint format) and shard; its own per-step ms.
tok/ms = B T / the median timed step, for each system. After them, starpu-llm's VARIANTS:
the batched-GEMM attention at every shape, StarPU's eager scheduler and a deeper CUDA
pipeline at 8 x 1024.

Same start, checked: every system's first loss (the parameters at init, the shard's first
B x T tokens; llm.c's is its step-0 validation loss with the training shard given as the
validation one, as its training batches are shuffled) against PyTorch's, within the TF32 bound
of two TF32 runs (tests/bounds.py: twice loss_bound(tf32=True), PyTorch's max |logits| at init
the scale).

Writes to DIR (--out; default experiments/results/gpu/<gpu>/): gpu_bench.csv (every timed
step of every run), gpu_bench.md (the table: median ms, tok/ms, the ratios, the first losses
against the bound; the machine, the commands) after every run, and the traces; prints the
table. A system that fails or runs out of time gets its error in the table; the others still
run.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SYSTEMS = ("starpu-llm", "llm.c", "pytorch", "starpu-llm-gemm", "starpu-llm-eager",
           "starpu-llm-pipeline4")
# starpu-llm's variants, run after the comparison with the peers: (TrainConfig settings,
# environment) each changes from `train --gpus 1`'s defaults. starpu-llm-gemm: --attention gemm
# (the batched-GEMM attention, which keeps the (T, T) weights) in place of the GPUs' fused one,
# at every shape: which is faster on this GPU. At one shape (VARIANT_SHAPE, else the first),
# what the per-task cost depends on: starpu-llm-eager, StarPU's eager scheduler (a central
# queue, no cost model) in place of dmdas; starpu-llm-pipeline4, STARPU_CUDA_PIPELINE=4 (the
# CUDA worker's tasks in flight on its stream, StarPU's default 2, its most 4): whether short
# kernels between long ones leave the GPU idle for want of queued work
VARIANTS = {"starpu-llm-gemm": (dict(attention="gemm"), {}),
            "starpu-llm-eager": (dict(sched="eager"), {}),
            "starpu-llm-pipeline4": ({}, {"STARPU_CUDA_PIPELINE": "4"})}
ONE_SHAPE = ("starpu-llm-eager", "starpu-llm-pipeline4")
VARIANT_SHAPE = (8, 1024)


def shapes_of(text: str) -> list[tuple[int, int]]:
    """[(B, T)] of "BxT,BxT,..." (ValueError otherwise)."""
    out = []
    for s in text.split(","):
        B, T = (int(v) for v in s.split("x"))
        if B < 1 or T < 1:
            raise ValueError(s)
        out.append((B, T))
    return out


# ---------------------------------------------------------------- one system, one shape

def starpu_config(B: int, T: int, steps: int, warmup: int, trace: bool = False, **settings):
    """The run of `starpu-llm train --gpus 1 --gpu-matmul tf32 -b B -t T [--attention A ...]`
    on the bundled tokens, from random weights, as a TrainConfig (settings: a variant's flags;
    no setting of its own)."""
    from starpu_llm import TrainConfig
    return TrainConfig(model="d12", batch=B, seq_len=T, steps=warmup + steps, lr=1e-4,
                       gpus=1, gpu_matmul="tf32", untimed_steps=warmup, trace=trace, log=None,
                       **settings)


def run_starpu(B: int, T: int, steps: int, warmup: int, out: str, trace: bool = False,
               variant: str | None = None) -> dict:
    """starpu-llm (or one of its VARIANTS) at B x T: its timed steps, and with trace a traced
    run after them."""
    import numpy as np
    from starpu_llm import train

    settings, env = VARIANTS[variant] if variant else ({}, {})
    os.environ.update(env)          # StarPU's own settings, read when the runtime starts
    r = train(starpu_config(B, T, steps, warmup, **settings))
    result = dict(step_ms=r.step_ms[warmup:], first_loss=float(r.losses[0]),
                  losses=[float(x) for x in r.losses], describe=r.engine,
                  peak_gpu_mb=r.peak_gpu_mb, peak_rss_mb=r.peak_rss_mb,
                  finite=bool(np.all(np.isfinite(r.losses))))
    if trace:           # a separate run: no tracing in the timed steps
        t = train(starpu_config(B, T, 1, warmup, trace=True))
        with open(os.path.join(out, f"trace_{B}x{T}.csv"), "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["job", "codelet", "worker", "start_ns", "end_ns", "gpu_start_ns",
                        "gpu_end_ns", "flops", "nbytes"])
            w.writerows((e.job, e.codelet, e.worker, e.start_ns, e.end_ns, e.gpu_start_ns,
                         e.gpu_end_ns, e.flops, e.nbytes) for e in t.trace)
        result["traced_tasks"] = len(t.trace)
        busy = gpu_busy(t.trace)
        if busy:
            result["gpu_busy"], result["traced_step_ms"] = busy
            result["gpu_ms"] = gpu_ms_by_codelet(t.trace)
            peaks = gpu_peaks(gpu_name())
            if peaks:
                result["roofline"] = roofline(t.trace, peaks, tf32=True)
    return result


def last_step(trace) -> list:
    """The events of a trace's last step (from its batch load on: it ran alone)."""
    t0 = max((e.start_ns for e in trace if e.codelet == "load_batch"), default=None)
    return [] if t0 is None else [e for e in trace if e.start_ns >= t0]


def gpu_ms_by_codelet(trace) -> dict:
    """{codelet: ms its kernels ran on the GPU in the trace's last step}, largest first."""
    ms = {}
    for e in last_step(trace):
        if e.gpu_end_ns > 0:
            ms[e.codelet] = ms.get(e.codelet, 0.0) + (e.gpu_end_ns - e.gpu_start_ns) / 1e6
    return dict(sorted(ms.items(), key=lambda kv: -kv[1]))


def gpu_busy(trace) -> tuple[float, float] | None:
    """(the fraction of the last step during which a GPU ran kernels, that step in ms) of a
    trace whose last step ran alone (train() drains the step before it): from its batch load's
    start to its last kernel's end, the union of the tasks' GPU intervals (gpu_start_ns ..
    gpu_end_ns). None without GPU times."""
    step = last_step(trace)
    spans = sorted((e.gpu_start_ns, e.gpu_end_ns) for e in step if e.gpu_end_ns > 0)
    if not spans:
        return None
    busy, (lo, hi) = 0, spans[0]
    for a, b in spans[1:]:
        if a > hi:
            busy, lo = busy + hi - lo, a
        hi = max(hi, b)
    busy += hi - lo
    t0 = min(e.start_ns for e in step)
    return busy / (hi - t0), (hi - t0) / 1e6


# What one GPU can do at most, by a name nvidia-smi gives (the first that the name contains):
# (bytes/s of its memory, dense TF32 tensor-core FLOP/s, fp32 FLOP/s), NVIDIA's datasheets.
# KINDS.md's H200 copy moved 4.3 TB/s (reads and writes counted) against the sheet's 4.8.
GPU_PEAKS = (("H200", (4.8e12, 494.7e12, 66.9e12)),
             ("H100 PCIe", (2.0e12, 378.0e12, 51.2e12)),
             ("H100", (3.35e12, 494.7e12, 66.9e12)),
             ("A100-SXM4-80GB", (2.04e12, 156.0e12, 19.5e12)),
             ("A100", (1.555e12, 156.0e12, 19.5e12)))
# the codelets whose products run on tensor cores when the matmuls are TF32 (cuBLAS, the
# fused attention's WMMA); the others' flops are fp32 FMAs
TENSOR_CORE_CODELETS = ("matmul_forward", "matmul_backward", "attention_forward",
                        "attention_backward", "attention_flash_forward",
                        "attention_flash_backward")


def gpu_name() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout.splitlines()[0]
    except (OSError, IndexError, subprocess.TimeoutExpired):
        return ""


def gpu_peaks(name: str) -> tuple | None:
    """GPU_PEAKS' rates of the GPU called name; None for one not listed."""
    return next((rates for key, rates in GPU_PEAKS if key in name), None)


def task_bound_s(codelet: str, flops: float, nbytes: float, peaks: tuple, tf32: bool) -> float:
    """The least seconds a task's work takes on a GPU of rates `peaks` (GPU_PEAKS'): its flops
    at the tensor-core (TF32, TENSOR_CORE_CODELETS) or fp32 rate, or its bytes (its buffers'
    sizes, each moved once) at the memory's, whichever is longer."""
    bw, tc, fp32 = peaks
    rate = tc if tf32 and codelet in TENSOR_CORE_CODELETS else fp32
    return max(flops / rate, nbytes / bw)


def roofline(trace, peaks: tuple, tf32: bool) -> dict:
    """{codelet: [tasks, GPU ms, bound ms]} of the trace's last step, largest GPU time first,
    and "step": the same over all its GPU tasks, a task's bound task_bound_s's; GPU ms / bound
    ms says how far a codelet's kernels are from what the GPU allows."""
    out, step = {}, [0, 0.0, 0.0]
    for e in last_step(trace):
        if e.gpu_end_ns <= 0:
            continue
        bound = task_bound_s(e.codelet, e.flops, e.nbytes, peaks, tf32) * 1e3
        ms = (e.gpu_end_ns - e.gpu_start_ns) / 1e6
        for row in (out.setdefault(e.codelet, [0, 0.0, 0.0]), step):
            row[0] += 1
            row[1] += ms
            row[2] += bound
    out = dict(sorted(out.items(), key=lambda kv: -kv[1][1]))
    if step[0]:
        out["step"] = step
    return out


def run_pytorch(B: int, T: int, steps: int, warmup: int, out: str) -> dict:
    import torch
    from starpu_llm.baselines.common import batch
    from starpu_llm.baselines.torch_sdpa import SdpaGPT2
    from starpu_llm.model.config import MODELS, AdamW
    from starpu_llm.io.data import default_dataset
    from starpu_llm.io.formats import read_shard
    from starpu_llm.model.state import random_init

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    config = MODELS["d12"]
    tokens = read_shard(default_dataset()[0])
    model = SdpaGPT2(config, random_init(config), device="cuda")
    x, y = batch(tokens, 0, B, T)
    with torch.no_grad():         # the scale of the first-loss bound: max |logits| at init
        logits, _ = model.forward(x, y)
        scale = float(logits.abs().max())
        del logits
    ms, losses = [], []
    for i in range(warmup + steps):
        x, y = batch(tokens, i * B * T, B, T)
        t0 = time.perf_counter()
        losses.append(model.adamw_step(x, y, AdamW(1e-4)))      # reads the loss: synchronises
        ms.append((time.perf_counter() - t0) * 1e3)
    return dict(step_ms=ms[warmup:], first_loss=losses[0], logits_scale=scale, losses=losses,
                describe=f"PyTorch {torch.__version__} eager, SDPA, AdamW {model.optimizer_kind}, "
                         f"TF32 on {torch.cuda.get_device_name(0)}")


def build_llmc(src: str, work: str) -> str:
    """train_gpt2_fp32.cu of the llm.c copy at src, built in work for this GPU; the binary."""
    shutil.copytree(src, os.path.join(work, "llmc-src"), dirs_exist_ok=True)
    d = os.path.join(work, "llmc-src")
    try:
        arch = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                              capture_output=True, text=True).stdout.split()[0].replace(".", "")
    except (OSError, IndexError):
        arch = os.environ.get("SL_GPU_ARCH", "90")
    cmd = ["nvcc", "-O3", "--use_fast_math", f"-arch=sm_{arch}", "-o", "train_gpt2fp32cu",
           "train_gpt2_fp32.cu", "-lcublas", "-lcublasLt"]
    subprocess.run(cmd, cwd=d, check=True, capture_output=True, text=True)
    return os.path.join(d, "train_gpt2fp32cu")


def run_llmc(B: int, T: int, steps: int, warmup: int, out: str, binary: str) -> dict:
    from starpu_llm.model.config import MODELS
    from starpu_llm.io.data import default_dataset
    from starpu_llm.io.formats import write_checkpoint
    from starpu_llm.model.state import random_init

    d = os.path.dirname(binary)
    ckpt = os.path.join(d, "gpt2_124M.bin")      # the name llm.c reads
    if not os.path.exists(ckpt):
        write_checkpoint(ckpt, MODELS["d12"], random_init(MODELS["d12"]))
    train, val = default_dataset()
    # one epoch of the shard; its training batches are shuffled, so the step-0 validation
    # loss on one batch of the training shard (given as -j) is the first loss to compare: the
    # init parameters on the shard's first B x T tokens. A 2-token sample at the end only.
    cmd = [binary, "-i", train, "-j", train, "-b", str(B), "-t", str(T), "-v", "100000",
           "-m", "1", "-s", "100000", "-g", "2"]
    p = subprocess.run(cmd, cwd=d, capture_output=True, text=True)
    with open(os.path.join(out, f"llmc_{B}x{T}.log"), "w") as f:
        f.write(p.stdout + p.stderr)
    if p.returncode != 0:
        # llm.c prints its CUDA errors to stdout
        raise RuntimeError(f"llm.c exited with {p.returncode}: {(p.stdout + p.stderr)[-400:]}")
    ms = [float(m) for m in re.findall(r"^step\s+\d+/\d+: train loss \S+ \((\S+) ms", p.stdout,
                                       re.M)]
    ms = ms[warmup:warmup + steps]
    if not ms:
        raise RuntimeError("llm.c printed no step after the warm-up ones")
    first = re.search(r"^val loss (\S+)", p.stdout, re.M)
    return dict(step_ms=ms, first_loss=float(first.group(1)) if first else None,
                describe="llm.c train_gpt2_fp32.cu, TF32 matmuls (cuBLAS), " + " ".join(cmd[1:]))


def child(args) -> None:
    B, T = shapes_of(args.shape)[0]
    if args.system == "starpu-llm":
        r = run_starpu(B, T, args.steps, args.warmup, args.out, args.trace)
    elif args.system in VARIANTS:
        r = run_starpu(B, T, args.steps, args.warmup, args.out, variant=args.system)
    elif args.system == "pytorch":
        r = run_pytorch(B, T, args.steps, args.warmup, args.out)
    else:
        r = run_llmc(B, T, args.steps, args.warmup, args.out, args.llmc_binary)
    print("RESULT " + json.dumps(r))


# ---------------------------------------------------------------- the run

def run_group(cmd: list, timeout: float) -> subprocess.CompletedProcess:
    """cmd in a process group of its own, its output captured; the whole group killed when it
    ends, at the timeout (TimeoutExpired) and when this process gets TERM (the device script's
    cap: exit 143), so what a run started (llm.c's binary, a PyTorch worker) never holds the
    GPU into the next run or stage."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         process_group=0)

    def end(signum=None, frame=None):
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if signum is not None:
            sys.exit(128 + signum)

    before = signal.signal(signal.SIGTERM, end)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        end()
        p.communicate()
        raise
    finally:
        signal.signal(signal.SIGTERM, before)
        end()
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def run_order(shapes, systems) -> list[tuple[int, int, str]]:
    """(B, T, system) in the order they run: the systems interleaved shape by shape, then
    starpu-llm's VARIANTS (a run cut short keeps the comparison with the peers), each at every
    shape but ONE_SHAPE's at one (VARIANT_SHAPE where asked, else the first)."""
    one = VARIANT_SHAPE if VARIANT_SHAPE in shapes else shapes[0]
    return ([(B, T, s) for B, T in shapes for s in systems if s not in VARIANTS] +
            [(B, T, s) for B, T in shapes for s in systems
             if s in VARIANTS and (s not in ONE_SHAPE or (B, T) == one)])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="results folder (default experiments/results/gpu/<gpu>/, the GPU "
                    "as nvidia-smi names it)")
    ap.add_argument("--llmc", help="llm.c copy (train_gpt2_fp32.cu, llmc/); without: no llm.c")
    ap.add_argument("--llmc-binary", help="train_gpt2fp32cu built already (instead of --llmc)")
    ap.add_argument("--shapes", default="16x1024,8x1024,128x64")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--timeout", type=int, default=150, help="seconds for one system at one shape")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"of {', '.join(SYSTEMS)}")
    ap.add_argument("--trace", action="store_true",
                    help="starpu-llm: also a traced run, its tasks to DIR/trace_BxT.csv")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--system", help=argparse.SUPPRESS)
    ap.add_argument("--shape", help=argparse.SUPPRESS)
    args = ap.parse_args()
    for what, value in (("--steps", args.steps), ("--timeout", args.timeout)):
        if value < 1:
            ap.error(f"{what} must be at least 1, not {value}")
    if args.warmup < 0:
        ap.error(f"--warmup must be 0 or more, not {args.warmup}")
    try:
        shapes = shapes_of(args.shapes)
    except ValueError:
        ap.error("--shapes: BxT pairs separated by commas (e.g. 16x1024,128x64), not "
                 f"{args.shapes!r}")
    unknown = set(args.systems.split(",")) - set(SYSTEMS)
    if unknown:
        ap.error(f"--systems: unknown {', '.join(sorted(unknown))} "
                 f"(of {', '.join(SYSTEMS)})")
    args.out = args.out or os.path.join(HERE, "results", "gpu", gpu_slug())
    os.makedirs(args.out, exist_ok=True)
    if args.child:
        return child(args)

    systems = args.systems.split(",")
    binary, notes = None, []
    if "llm.c" in systems:
        if args.llmc_binary:
            binary = os.path.abspath(args.llmc_binary)
            if not os.access(binary, os.X_OK):
                notes.append(f"llm.c: --llmc-binary {binary} is not an executable: not run")
                systems.remove("llm.c")
        elif not args.llmc:
            systems.remove("llm.c")
            notes.append("llm.c: no --llmc copy given, not run")
        else:
            t = time.perf_counter()
            try:
                binary = build_llmc(args.llmc, args.out)
                notes.append(f"llm.c built in {time.perf_counter() - t:.0f} s")
            except (subprocess.CalledProcessError, OSError) as e:
                notes.append(f"llm.c did not build: {getattr(e, 'stderr', None) or e}"[-400:])
                systems.remove("llm.c")
    rows, table = [], {}
    for B, T, system in run_order(shapes, systems):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--system", system,
               "--shape", f"{B}x{T}", "--out", args.out, "--steps", str(args.steps),
               "--warmup", str(args.warmup)] + (["--llmc-binary", binary] if binary else [])
        cmd += ["--trace"] if args.trace and system == "starpu-llm" else []
        t = time.perf_counter()
        try:
            p = run_group(cmd, args.timeout)
            line = next((l for l in p.stdout.splitlines() if l.startswith("RESULT ")), None)
            if line is None:
                raise RuntimeError(f"exit {p.returncode}: {(p.stderr or p.stdout)[-600:]}")
            r = json.loads(line[len("RESULT "):])
            r["median_ms"] = statistics.median(r["step_ms"])
            r["tok_per_ms"] = B * T / r["median_ms"]
        except (subprocess.TimeoutExpired, RuntimeError, KeyError, ValueError) as e:
            r = dict(error=str(e).replace("\n", " ")[-600:])
        r["wall_s"] = time.perf_counter() - t
        table[(system, B, T)] = r
        for i, ms in enumerate(r.get("step_ms", [])):
            rows.append(dict(system=system, precision="tf32", B=B, T=T, step=i + 1, ms=ms))
        print(f"{system:15s} {B:4d} x {T:4d}: " + (
            f"{r['median_ms']:.1f} ms/step, {r['tok_per_ms']:.1f} tok/ms"
            if "tok_per_ms" in r else f"failed: {r['error'][:300]}")
            + f"  ({r['wall_s']:.0f} s)", flush=True)
        # after every run: a run stopped from outside keeps what was measured
        write_report(args, systems, table, rows, notes)
    print(open(os.path.join(args.out, "gpu_bench.md")).read())


def gpu_slug() -> str:
    """This machine's GPU as a folder name (nvidia-smi's name, lower case, dashes)."""
    return re.sub(r"[^a-z0-9]+", "-", gpu_name().lower()).strip("-") or "unknown-gpu"


def first_loss_bound(B: int, T: int, loss: float, logits_scale: float) -> float:
    """|loss_a - loss_b| of two TF32 runs at the same parameters on the same batch: each run
    within one TF32 run's bound, so twice bounds.loss_bound(tf32=True) (which holds one TF32
    run against an fp32 one)."""
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    from bounds import loss_bound
    from starpu_llm.model.config import MODELS
    return 2.0 * loss_bound(MODELS["d12"], B, T, loss, logits_scale, tf32=True)


def same_start(table, systems, B: int, T: int) -> list[str]:
    """Each system's first loss against PyTorch's, with the bound (first_loss_bound)."""
    ref = table.get(("pytorch", B, T), {})
    if ref.get("first_loss") is None or ref.get("logits_scale") is None:
        return []
    bound = first_loss_bound(B, T, ref["first_loss"], ref["logits_scale"])
    out = []
    for s in systems:
        got = table.get((s, B, T), {}).get("first_loss")
        if s == "pytorch" or got is None:
            continue
        d = abs(got - ref["first_loss"])
        out.append(f"{B}x{T} first loss: {s} {got:.6f}, pytorch {ref['first_loss']:.6f}, "
                   f"|diff| {d:.2e} {'<=' if d <= bound else 'EXCEEDS'} the TF32 bound "
                   f"{bound:.2e} (max |logits| {ref['logits_scale']:.3f})")
    return out


def roofline_line(shape: str, roof: dict) -> str:
    """A traced step's kernels against their bounds (roofline's), in words."""
    tasks, ms, bound = roof["step"]
    return (f"{shape} starpu-llm kernels against their bounds (gpu_bench.roofline: the "
            f"datasheet's rates): the step's {tasks} GPU tasks {ms:.2f} ms, bound {bound:.2f} ms "
            f"({ms / bound:.1f}x); by codelet, GPU ms / bound ms: "
            + ", ".join(f"{c} {m:.2f} / {b:.2f} ({m / b:.1f}x)"
                        for c, (_, m, b) in roof.items() if c != "step"))


def write_report(args, systems, table, rows, notes):
    """DIR/gpu_bench.csv (every step) and DIR/gpu_bench.md (the table) of the runs so far, each
    written to a temporary name and renamed."""
    path = os.path.join(args.out, "gpu_bench.csv")
    with open(path + ".tmp", "w", newline="") as f:
        w = csv.DictWriter(f, ["system", "precision", "B", "T", "step", "ms"])
        w.writeheader()
        w.writerows(rows)
    os.replace(path + ".tmp", path)
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    except OSError:
        gpu = "? (no nvidia-smi)"
    others = [s for s in systems if s != "starpu-llm"]
    lines = [f"GPU: {gpu}; {os.cpu_count()} CPU cores; {args.warmup} warm-up + {args.steps} "
             "timed steps each; median ms per timed step, tok/ms = B T / median", "",
             "| B x T | " + " | ".join(f"{s} ms | {s} tok/ms" for s in systems) + " | "
             + " | ".join(f"starpu-llm / {s}" for s in others) + " |",
             "|---" * (1 + 2 * len(systems) + len(others)) + "|"]
    checks = []
    for B, T in shapes_of(args.shapes):
        if not any((s, B, T) in table for s in systems):
            continue
        cells = []
        for s in systems:
            r = table.get((s, B, T))
            if r is None:
                cells += ["-", "-"]
            elif "tok_per_ms" in r:
                cells += [f"{r['median_ms']:.1f}", f"{r['tok_per_ms']:.1f}"]
            else:
                cells += ["failed", "failed"]
        ours = table.get(("starpu-llm", B, T), {}).get("tok_per_ms")
        ratios = [f"{ours / table[(s, B, T)]['tok_per_ms']:.2f}"
                  if ours and table.get((s, B, T), {}).get("tok_per_ms") else "-" for s in others]
        lines.append(f"| {B} x {T} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
        checks += same_start(table, systems, B, T)
        r = table.get(("starpu-llm", B, T), {})
        if r.get("peak_gpu_mb") is not None:
            checks.append(f"{B}x{T} starpu-llm memory: peak GPU {r['peak_gpu_mb']:.0f} MB, "
                          f"peak RSS {r.get('peak_rss_mb', 0):.0f} MB")
        if "gpu_busy" in r:
            checks.append(f"{B}x{T} starpu-llm traced step: {r['traced_step_ms']:.1f} ms, the GPU "
                          f"running kernels {100 * r['gpu_busy']:.1f} % of it; GPU ms by codelet: "
                          + ", ".join(f"{c} {ms:.2f}" for c, ms in r["gpu_ms"].items()))
        if r.get("roofline"):
            checks.append(roofline_line(f"{B}x{T}", r["roofline"]))
    lines += [""] + checks + [""] + notes + [f"{s} {B}x{T}: {r.get('describe', r.get('error'))}"
                                             for (s, B, T), r in table.items()]
    path = os.path.join(args.out, "gpu_bench.md")
    with open(path + ".tmp", "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
