"""starpu-llm calibrate: measure this machine's cost model (machine.py's file), in minutes.

1. Rates, from the kernels alone (no StarPU): an sgemm (the matmul kernel at GPT-2's width)
   and a streaming kernel (the residual add) on k = 1 .. cores threads, and the same threads
   writing memory just given by malloc (first touch: what --memory-limit's buffers cost each
   step, memory.py); zeroing and adding a
   gradient-sized buffer on one core (a reduction's init and sum); under mpirun, when there is
   one, a ping-pong between two processes (the link); the sequential bandwidth of the disk
   under the temporary folder, where --memory-limit evicts by default (measure_disk).
2. Codelet costs: short traced training runs of GPT-2 124M on each partition N x K of the
   machine, at sub-batches of 1, 3 and 6 sequences of 64 tokens, and with one sequence of the
   model's full length per sub-batch (1024; LONG_SEQ_STEPS timed steps). Every task of
   the timed steps is a sample (codelet, cores, flops, data size, seconds), and so is every
   entry of StarPU's own history-based perf models written by those runs (STARPU_CALIBRATE=1,
   their mean per data size; only for one-core workers, the only case where StarPU's record
   of a task's core count is the real one: a team worker is one StarPU worker). Per codelet
   and core count, a non-negative least-squares fit (relative error, on each shape's mean:
   fit_codelets) of
       seconds = a * flops / sgemm(k) + b * size / bandwidth(k, N) + c
   StarPU's cost per task: the time a one-worker step spends outside its tasks, per task; the
   step's fixed cost: a step's wall time outside its first-to-last task.

Quick (`starpu-llm calibrate --quick`, for a borrowed node with minutes to spare): the rates
timed over QUICK_RATE_SECONDS instead of half a second each, a 256 MB disk file, the traced
runs at QUICK_SUB_BATCH sequences per sub-batch only and one traced step by default, and no
full-length run (predictions at T far from 64 then rest on the T = 64 fit). At T = 64 a
codelet's flops and bytes both grow with the sequences per sub-batch, so two sizes already fix
the fitted line (its slope and its fixed cost); the third of the full calibration checks it.
"""
from __future__ import annotations

import ctypes
import glob
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from ..model.config import DEFAULT_MODEL, MODELS
from ..errors import StarpuLLMError
from .runs import cpu_description, run_in_subprocess
from ..plan.partition import shapes
from .machine import Machine, save

FIT_SEQ_LEN = 64            # tokens per sequence of the calibration runs (fit_seq_len)
FIT_SUB_BATCH = (1, 3, 6)   # sequences per sub-batch of those runs
# Why a run at the model's full length too: at T = 64 alone, an attention task's flops and bytes
# both grow with the batch only, in a fixed ratio, so the fit cannot tell them apart, yet its
# scores grow as T^2 and its inputs as T, and its rate per flop falls at long sequences (the
# kernel alone, one core: ~9 GFLOP/s at T = 256-512, 5-7 at 1024). Fitted at T = 64 alone (its
# flops declared or not), a 124M step at T = 1024, B = 8 on 1 x 2 was predicted at 0.165 tok/ms
# against 0.111-0.114 measured, the attention 4.4 x too fast; with this run, 0.115.
# One sequence of full length per sub-batch, one timed step (~80 s on 2 cores).
LONG_SEQ_STEPS = 1
STEPS = 2                   # traced steps per calibration run, after one warm-up
QUICK_STEPS = 1             # --quick's
QUICK_SUB_BATCH = (1, 6)    # --quick: the two ends of FIT_SUB_BATCH
QUICK_RATE_SECONDS = 0.15   # --quick: each rate's timing window (the full one: 0.5 s)
QUICK_DISK_BYTES = 256 << 20


def fit_seq_len(model: str) -> int:
    """FIT_SEQ_LEN, or the model's whole length when shorter (micro's 32)."""
    return min(FIT_SEQ_LEN, MODELS[model].maxT)


# ---------------------------------------------------------------- rates

def _best(f, reps=5, seconds=0.5):
    """The best time of f over at least reps calls and `seconds`, after one warm-up call. A
    window of a few calls is not enough on a VM: measured here (Zen 3, 2 vCPUs), 5 calls of a
    2-thread sgemm gave one core's rate in one measurement of two, the second thread held off
    for the whole window (the calibration then recorded sgemm(2) = 91 against 175 GFLOP/s)."""
    f()
    best, calls, end = float("inf"), 0, time.perf_counter() + seconds
    while calls < reps or time.perf_counter() < end:
        t0 = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t0)
        calls += 1
    return best


def measure_rates(cores: int, seconds: float = 0.5) -> dict:
    """sgemm GFLOP/s, stream GB/s and first-touch GB/s per core count, zero and add GB/s on
    one core; each timed as the best call over at least `seconds`."""
    from .._kernels import ffi, lib

    def ptr(a):
        return ffi.cast("float *", ffi.from_buffer(a))

    N, C, OC = 512, 768, 3072          # a GPT-2 MLP matmul of 8 sequences of 64
    inp = np.random.default_rng(0).standard_normal((N, C)).astype(np.float32)
    w = np.random.default_rng(1).standard_normal((OC, C)).astype(np.float32)
    out = np.empty((N, OC), np.float32)
    n = 1 << 24                         # 64 MB per array: well beyond the caches
    x, y, z = (np.ones(n, np.float32) for _ in range(3))

    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]

    fresh = 1 << 26                     # floats: 256 MB

    def touch_new():
        # from malloc, as StarPU allocates its buffers: above glibc's largest mmap threshold
        # (32 MiB), so new pages at each call, unmapped by free. Not numpy: it asks the
        # kernel for huge pages (madvise), which made this 5 x faster than StarPU gets.
        a = libc.malloc(4 * fresh)
        if not a:
            raise MemoryError("256 MB for the first-touch rate")
        lib.fill_zero(ffi.cast("float *", a), fresh)
        libc.free(a)
    sgemm, stream, touch = [], [], []
    for k in range(1, cores + 1):
        lib.kernels_set_threads(k)
        t = _best(lambda: lib.matmul_forward(ptr(out), ptr(inp), ptr(w), ffi.NULL, N, C, OC),
                  seconds=seconds)
        sgemm.append(2.0 * N * C * OC / t / 1e9)
        t = _best(lambda: lib.residual_forward(ptr(z), ptr(x), ptr(y), n), seconds=seconds)
        stream.append(3 * 4 * n / t / 1e9)
        touch.append(4 * fresh / _best(touch_new, reps=3, seconds=seconds) / 1e9)
    lib.kernels_set_threads(1)
    zero = 4 * n / _best(lambda: lib.fill_zero(ptr(z), n), seconds=seconds) / 1e9
    add = 3 * 4 * n / _best(lambda: lib.add_inplace(ptr(z), ptr(x), n), seconds=seconds) / 1e9
    lib.kernels_set_threads(cores)
    return dict(sgemm=sgemm, stream=stream, touch=touch, zero=zero, add=add)


def measure_disk(folder: str, nbytes: int = 1 << 30, block: int = 64 << 20) -> dict:
    """The sequential bandwidth of the disk under folder (where --memory-limit evicts): a file
    of nbytes written in blocks and synced (what the disk takes), its pages then dropped from
    the page cache and the file read back (what the disk gives). {"write_gbs", "read_gbs"}."""
    buf = np.random.default_rng(0).integers(0, 255, block, dtype=np.uint8)
    fd, path = tempfile.mkstemp(prefix="starpu-llm-disk-", dir=folder)
    try:
        t0 = time.perf_counter()
        for _ in range(nbytes // block):
            os.write(fd, buf)
        os.fdatasync(fd)
        write = time.perf_counter() - t0
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.lseek(fd, 0, os.SEEK_SET)
        t0 = time.perf_counter()
        while os.readv(fd, [buf]):
            pass
        read = time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(path)
    n = nbytes // block * block
    return dict(write_gbs=n / write / 1e9, read_gbs=n / read / 1e9)


def pingpong() -> None:
    """Under mpirun -np 2: rank 0 prints {"latency_us", "bandwidth_gbs"} as JSON."""
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    other = 1 - rank

    def rounds(buf, reps):
        comm.Barrier()
        t0 = MPI.Wtime()
        for _ in range(reps):
            if rank == 0:
                comm.Send(buf, other)
                comm.Recv(buf, other)
            else:
                comm.Recv(buf, other)
                comm.Send(buf, other)
        return (MPI.Wtime() - t0) / (2 * reps)

    small = np.zeros(1, np.float64)
    big = np.zeros(1 << 23, np.float32)     # 32 MB: a layer's gradients are 7-28 MB
    rounds(small, 100)
    lat = rounds(small, 1000)
    t = rounds(big, 10)
    if rank == 0:
        print(json.dumps(dict(latency_us=lat * 1e6, bandwidth_gbs=big.nbytes / (t - lat) / 1e9)))


def measure_link() -> dict | None:
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        return None
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    p = subprocess.run([mpirun, "--oversubscribe", "--bind-to", "none", "-np", "2",
                        sys.executable, "-m", "starpu_llm.perf.calibrate", "--pingpong"],
                       capture_output=True, text=True, env=env, timeout=300)
    if p.returncode != 0:
        return None
    return json.loads(p.stdout.strip().splitlines()[-1])


MPI_FIT_SUB_BATCH = 6       # sequences per rank of the calibration's mpirun -np 2 run


def fit_link(m: Machine, model: str, steps: int, log) -> None:
    """The link's bandwidth as StarPU-MPI gets it during training: one `mpirun -np 2` run
    (a 1 x cores/2 partition per rank, MPI_FIT_SUB_BATCH sequences each, sharded ownership:
    each rank sends and receives about the model's bytes), then the bandwidth
    at which the simulated step takes the measured time (bisection: the step time falls as
    the bandwidth grows). Kept as it is when mpirun is missing or the run fails."""
    from ..plan.partition import PartitionRequest
    from .predict import predict, target_partition
    k = max(1, m.cores // 2)
    B = 2 * MPI_FIT_SUB_BATCH
    r = run_in_subprocess(dict(engine="starpu", model=model, batch=B, seq_len=fit_seq_len(model),
                               steps=max(steps, 4),     # one sample for one number: a few steps
                               workers=1, cores_per_worker=k, sub_batches=1, ranks=2,
                               ownership="sharded"))
    if "error" in r:
        log(f"  mpirun -np 2 run failed ({r['error']}): the link keeps the ping-pong's figures")
        return
    measured = statistics.median(r["step_ms"]) * 1e-3
    partition = target_partition(PartitionRequest(workers=1, cores_per_worker=k, sub_batches=1,
                                                  ownership="sharded"), ranks=2)

    def step_at(gbs):
        m.link_bandwidth_gbs = gbs
        return predict(model, B, fit_seq_len(model), partition, calibration=m,
                       ranks_per_node=2).schedule.step_s
    lo, hi = 0.01, 1000.0
    if step_at(hi) > measured:          # slower than measured even with an infinite link
        m.link_bandwidth_gbs = m.link_pingpong_gbs or 10.0
        log(f"  mpirun -np 2 B={B}: {measured * 1e3:.0f} ms/step, below the model's at any "
            f"bandwidth: the link keeps the ping-pong's figures")
        return
    for _ in range(40):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if step_at(mid) > measured else (lo, mid)
    m.link_bandwidth_gbs = hi
    log(f"  mpirun -np 2 B={B}: {measured * 1e3:.0f} ms/step: StarPU-MPI's link "
        f"{hi:.2f} GB/s (ping-pong {m.link_pingpong_gbs:.2f})")


# ---------------------------------------------------------------- StarPU's records

def read_starpu_history(path: str) -> list:
    """[(cores, size, flops, mean seconds, n)] of a StarPU history-based perf-model file."""
    out, cores, lines = [], None, open(path, encoding="utf-8", errors="replace").read().splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        if line.startswith("# number of cores") and i + 1 < len(lines):
            cores = int(lines[i + 1].split()[0])
        elif line.startswith("# hash") and "mean" in line:
            i += 1
            while i < len(lines) and lines[i].strip() and not lines[i].startswith("#"):
                f = lines[i].split()
                if len(f) >= 8 and cores is not None and int(f[7]) > 0:
                    out.append((cores, int(f[1]), float(f[2]), float(f[3]) * 1e-6, int(f[7])))
                i += 1
            continue
        i += 1
    return out


# ---------------------------------------------------------------- fitting

def nnls3(X: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Non-negative weighted least squares in 3 unknowns: the best of every subset of them
    (8 small problems), among the fits with no negative coefficient."""
    best, best_res = np.zeros(X.shape[1]), float("inf")
    sw = np.sqrt(w)
    for r in range(1, X.shape[1] + 1):
        for cols in itertools.combinations(range(X.shape[1]), r):
            A = X[:, cols] * sw[:, None]
            coef, *_ = np.linalg.lstsq(A, y * sw, rcond=None)
            if np.any(coef < 0):
                continue
            res = float(np.sum((A @ coef - y * sw) ** 2))
            if res < best_res:
                best_res, best = res, np.zeros(X.shape[1])
                best[list(cols)] = coef
    return best


def shape_means(samples: list) -> list:
    """The samples of one shape (codelet, cores, workers, flops, size) replaced by one: their
    weighted mean duration, weighted by their total weight."""
    groups = {}
    for name, k, W, flops, size, seconds, weight in samples:
        g = groups.setdefault((name, k, W, flops, size), [0.0, 0.0])
        g[0] += seconds * weight
        g[1] += weight
    return [(*key, total / weight, weight) for key, (total, weight) in groups.items() if weight > 0]


def fit_codelets(samples: list, machine: Machine) -> dict:
    """samples: (codelet, k, workers, flops, size, seconds, weight). Per codelet and k: a, b,
    c_us, the sample count, the weighted mean relative error of the fit and total_err, the
    signed error of the fit on the samples' total time (a step is a sum of tasks: this is what
    a prediction inherits).

    The fit is on each shape's mean duration (shape_means), weighted by its samples' weight
    over its mean squared: every shape's relative error counts (a codelet's small shapes, a
    layer's matmul at one sequence, as much as its large ones, the lm head at six), and the
    noise of the samples of one shape does not bias the fit. Fitted on the samples themselves
    with relative weights, a shape's estimate is E[1/y]/E[1/y^2] of its durations y: for a
    log-normal spread s, exp(-2 s^2) of their mean (s = 0.2: 8 % fast; 0.3: 16 % fast): the
    noisier the tasks (a k-core task waits for its slowest thread), the faster the model."""
    groups = {}
    for s in shape_means(samples):
        groups.setdefault((s[0], s[1]), []).append(s)
    out = {}
    for (name, k), rows in sorted(groups.items()):
        X = np.array([[f / machine.sgemm(k), b / machine.bandwidth(k, W), 1.0]
                      for _, _, W, f, b, _, _ in rows])
        y = np.array([r[5] for r in rows])
        w = np.array([r[6] for r in rows], dtype=float)
        a, b, c = nnls3(X, y, w / np.maximum(y, 1e-7) ** 2)
        pred = X @ np.array([a, b, c])
        total = float(np.sum(w * y))
        rel = float(np.sum(w * np.abs(pred - y)) / total) if total > 0 else 0.0
        d = out.setdefault(name, {"a": {}, "b": {}, "c_us": {}, "samples": {}, "rel_err": {},
                                  "total_err": {}})
        d["a"][k], d["b"][k], d["c_us"][k] = float(a), float(b), float(c * 1e6)
        d["samples"][k], d["rel_err"][k] = float(w.sum()), rel
        d["total_err"][k] = float(np.sum(w * pred) / total - 1) if total > 0 else 0.0
    return out


def total_error(samples: list, m: Machine) -> dict:
    """{k: the fitted codelets' total time on the samples of k-core tasks over their measured
    total, minus 1}: what a step made of these tasks inherits."""
    fitted, measured = {}, {}
    for name, k, W, flops, size, seconds, weight in samples:
        c = m.codelets[name]
        fitted[k] = fitted.get(k, 0.0) + weight * (c["a"][k] * flops / m.sgemm(k) + c["b"][k] * size
                                                   / m.bandwidth(k, W) + c["c_us"][k] * 1e-6)
        measured[k] = measured.get(k, 0.0) + weight * seconds
    return {k: fitted[k] / measured[k] - 1 for k in fitted if measured[k] > 0}


# ---------------------------------------------------------------- the runs

def traced_runs(cores: int, steps: int, log, model: str = DEFAULT_MODEL, sub_batch=FIT_SUB_BATCH,
                long_seq: bool = True, only=None) -> tuple[list, list, list]:
    """Traced runs of each partition (only: of those (N, K) alone) at each sub_batch size
    (FIT_SEQ_LEN), and (long_seq) with one sequence of the model's full length per sub-batch;
    (task samples, StarPU history samples, [(one-worker run, per-task overhead s, step fixed
    cost s)] of the FIT_SEQ_LEN runs)."""
    samples, history, overheads = [], [], []
    long_T = MODELS[model].maxT
    fit_T = fit_seq_len(model)
    parts = [nk for nk in shapes(cores) if only is None or nk in only]
    runs = [(N, K, per_sub, fit_T, steps)
            for (N, K), per_sub in itertools.product(parts, sub_batch)]
    if long_seq and long_T > fit_T:
        runs += [(N, K, 1, long_T, LONG_SEQ_STEPS) for N, K in parts]
    for N, K, per_sub, T, nsteps in runs:
        home = tempfile.mkdtemp(prefix="starpu-llm-calib-")
        # the models' folder named itself: StarPU takes XDG_CACHE_HOME before STARPU_HOME
        env = dict(os.environ, STARPU_HOME=home, STARPU_CALIBRATE="1",
                   STARPU_PERF_MODEL_DIR=os.path.join(home, ".starpu", "sampling"))
        spec = dict(engine="starpu", model=model, batch=N * per_sub, seq_len=T, steps=nsteps,
                    workers=N, cores_per_worker=K, trace=True)
        t0 = time.perf_counter()
        r = run_in_subprocess(spec, env=env)
        if "error" in r:
            shutil.rmtree(home, ignore_errors=True)
            raise StarpuLLMError(f"calibration run {N}x{K} B={N * per_sub} T={T} failed: "
                                 f"{r['error']}")
        log(f"  {N}x{K} B={N * per_sub} T={T}: {len(r['events'])} tasks traced, "
            f"{time.perf_counter() - t0:.0f} s")
        sizes = {int(h): n for h, n in r["sizes"].items()}
        steps_ns = r["steps_ns"][1:]            # the warm-up step is not a sample
        t_first = steps_ns[0][0]
        for c, w, k, s, e, bufs, flops, _ in r["events"]:
            if bufs is None or s < t_first:
                continue
            size = sum(sizes.get(int(h), 0) for h, _ in bufs)
            samples.append((c, k, N, flops, size, (e - s) * 1e-9, 1.0))
        for t0_ns, t1_ns in steps_ns if T == fit_T else ():
            ev = [(s, e) for _, _, _, s, e, b, _, _ in r["events"] if t0_ns <= s <= t1_ns]
            if not ev:
                continue
            first, last = min(s for s, _ in ev), max(e for _, e in ev)
            busy = sum(e - s for s, e in ev)
            fixed = ((t1_ns - t0_ns) - (last - first)) * 1e-9
            per_task = ((last - first) - busy) * 1e-9 / len(ev) if N == 1 else None
            overheads.append((N, per_task, fixed))
        if K == 1:
            for path in glob.glob(os.path.join(home, ".starpu", "sampling", "codelets", "*",
                                               "sl_*")):
                codelet = os.path.basename(path).split(".", 1)[0][3:]
                for cores_rec, size, flops, mean, n in read_starpu_history(path):
                    if cores_rec == 1:
                        history.append((codelet, 1, N, flops, size, mean, float(n)))
        shutil.rmtree(home, ignore_errors=True)
    return samples, history, overheads


def calibrate(path: str, steps: int | None = None, log=print, model: str = DEFAULT_MODEL,
              disk_bytes: int = 1 << 30, quick: bool = False, only=None,
              link_run: bool = True) -> Machine:
    """Calibrate this machine on `model` (GPT-2 124M; the tests use a small one) into path;
    the disk with a file of disk_bytes. quick: the cut-down calibration of the module's doc.
    steps: traced steps per calibration run, after one warm-up (None: STEPS, or QUICK_STEPS
    with quick, as `starpu-llm calibrate [--quick]`: decided here, the CLI passes --steps or
    None).
    only: the traced runs on these (N, K) partitions alone (a calibration held out by
    configuration: the other partitions' costs are then predicted, each worker size from the
    largest calibrated one below it); link_run=False: no mpirun -np 2 run for the link (its
    figures stay the ping-pong's), so that no MPI run a later evaluation scores is fitted."""
    from ..runtime.starpu import usable_cores
    cores = usable_cores()
    if only is not None:
        only = [tuple(nk) for nk in only]
        bad = [f"{n}x{k}" for n, k in only if (n, k) not in shapes(cores)]
        if bad or not only:
            raise ValueError(f"calibrate: partitions {', '.join(bad) or '(none)'} are not "
                             f"N x K = {cores} (this machine's usable cores)")
    t0 = time.perf_counter()
    if steps is None:
        steps = QUICK_STEPS if quick else STEPS
    if quick:
        disk_bytes = min(disk_bytes, QUICK_DISK_BYTES)
    log(f"calibrating {cpu_description()}" + (" (quick)" if quick else ""))
    rates = measure_rates(cores, QUICK_RATE_SECONDS if quick else 0.5)
    log("  sgemm GFLOP/s per core count: " + ", ".join(f"{x:.1f}" for x in rates["sgemm"]))
    log("  stream GB/s per core count:   " + ", ".join(f"{x:.1f}" for x in rates["stream"]))
    log("  first touch GB/s per core count: " + ", ".join(f"{x:.1f}" for x in rates["touch"]))
    link = measure_link()
    if link:
        log(f"  MPI link: {link['latency_us']:.1f} us, {link['bandwidth_gbs']:.2f} GB/s")
    disk = measure_disk(tempfile.gettempdir(), disk_bytes)
    log(f"  disk ({tempfile.gettempdir()}): write {disk['write_gbs']:.3f} GB/s, read "
        f"{disk['read_gbs']:.3f} GB/s")
    m = Machine(name=os.uname().nodename, cores=cores, sgemm_gflops=rates["sgemm"],
                bandwidth_gbs=rates["stream"], first_touch_gbs=rates["touch"],
                zero_gbs=rates["zero"], add_gbs=rates["add"],
                disk_write_gbs=disk["write_gbs"], disk_read_gbs=disk["read_gbs"],
                source=f"starpu-llm calibrate{' --quick' if quick else ''}"
                       + (" on partitions " + ",".join(f"{n}x{k}" for n, k in only)
                          if only is not None else "")
                       + ("" if link_run else ", link from the ping-pong")
                       + f" on {cpu_description()}, {time.strftime('%Y-%m-%d %H:%M')}")
    if link:
        m.link_latency_us, m.link_bandwidth_gbs = link["latency_us"], link["bandwidth_gbs"]
        m.link_pingpong_gbs = link["bandwidth_gbs"]
    samples, history, overheads = traced_runs(cores, steps, log, model,
                                              QUICK_SUB_BATCH if quick else FIT_SUB_BATCH,
                                              long_seq=not quick, only=only)
    m.codelets = fit_codelets(samples + history, m)
    log("  the fit against the traced tasks' total time, per core count: " + ", ".join(
        f"k={k} {err:+.1%}" for k, err in sorted(total_error(samples, m).items())))
    per_task = [p for _, p, _ in overheads if p is not None]
    m.task_us = max(0.0, statistics.median(per_task) * 1e6) if per_task else 5.0
    m.step_ms = max(0.0, statistics.median(f for _, _, f in overheads) * 1e3)
    if link and link_run:
        fit_link(m, model, steps, log)
    save(m, path)
    log(f"  {len(samples)} traced tasks and {len(history)} StarPU perf-model entries fitted; "
        f"StarPU per task {m.task_us:.1f} us, per step {m.step_ms:.1f} ms")
    log(f"wrote {path} ({time.perf_counter() - t0:.0f} s)")
    return m


if __name__ == "__main__":
    if sys.argv[1:] == ["--pingpong"]:
        pingpong()
