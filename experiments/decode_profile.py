"""Where a serving decode step's time goes: GPT-2 124M (d12, random init) on the StarPU engine,
one flow/batch.SlotDecoder step of N rows (one new token of each of N sequences at position
--pos), N = 1 and 16 by default.

For each N it prints the step's wall time (median of --steps steps, the N values taking turns
step by step so that a change of the machine's load falls on all alike), and from the task
trace of one more round of steps: the tasks a step submits, the sum of their run times per
codelet, the rest of the step (wall - tasks: StarPU's per-task cost, the Python that submits the
tasks, the wait), the Python submission alone (decode_step returns before the tasks end), the
matmuls' weight bytes per step over their time against the machine's memory bandwidth (a
numpy copy of 256 MiB, read + write), and the sampling of N rows (greedy argmax; temperature 1,
top_p 0.9), per token. Not a test; it prints the load average before and after.

    .venv/bin/python experiments/decode_profile.py [--rows 1 16] [--steps 20] [--pos 64]
"""
import argparse
import collections
import os
import statistics
import time

import numpy as np

from starpu_llm.model.config import MODELS
from starpu_llm.flow import generate as gen
from starpu_llm.flow.batch import Feed, SlotDecoder, decode_step
from starpu_llm.serve.engine import SCORED_ROWS
from starpu_llm.model.state import random_init


BLAS_PATH = "/usr/lib/x86_64-linux-gnu/openblas-openmp/libopenblas.so.0"


def bandwidth_gbs(mib=256, repeat=5) -> float:
    """The machine's memory bandwidth: bytes read + written by a numpy copy, best of repeat."""
    a = np.ones(mib << 18, np.float32)
    b = np.empty_like(a)
    best = min(_timed(lambda: np.copyto(b, a)) for _ in range(repeat))
    return 2 * a.nbytes / best / 1e9


def _timed(f) -> float:
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def weight_bytes(cfg, M: int) -> int:
    """The weights a decode step's matmuls read: every layer's qkv, attproj, fc, fcproj, and
    the lm head (wte) when M > 0 rows want logits."""
    C = cfg.C
    per_layer = (3 * C * C + C * C + 4 * C * C + 4 * C * C) * 4
    return cfg.L * per_layer + (cfg.Vp * C * 4 if M else 0)


def matmul_ab(cfg, rows, repeat=7) -> dict:
    """{N: (this build's ms, OpenBLAS sgemm's ms)} for the matmuls of one decode step of N rows
    (each layer's 4, the lm head), taking turns call by call; each the best of repeat, so
    that a change of the machine's load falls on both alike."""
    import ctypes
    from starpu_llm._kernels import ffi, lib
    blas = ctypes.CDLL(BLAS_PATH)       # the one our kernels link (already loaded)
    f = ctypes.c_float
    P = ctypes.c_void_p
    C = cfg.C
    shapes = [(C, 3 * C, cfg.L), (C, C, cfg.L), (C, 4 * C, cfg.L), (4 * C, C, cfg.L),
              (C, cfg.Vp, 1)]
    rng = np.random.default_rng(0)
    out = {}
    for n in rows:
        ours = theirs = 0.0
        for c, oc, times in shapes:
            w = rng.standard_normal((oc, c)).astype(np.float32)
            x = rng.standard_normal((n, c)).astype(np.float32)
            y = np.empty((n, oc), np.float32)
            yp, xp, wp = (ffi.cast("float *", a.ctypes.data) for a in (y, x, w))
            a, b = [], []
            for _ in range(repeat):
                a.append(_timed(lambda: lib.matmul_forward(yp, xp, wp, ffi.NULL, n, c, oc)))
                b.append(_timed(lambda: blas.cblas_sgemm(
                    101, 111, 112, n, oc, c, f(1.0), P(x.ctypes.data), c, P(w.ctypes.data), c,
                    f(0.0), P(y.ctypes.data), oc)))     # row major, inp @ weight^T
            ours += min(a) * times
            theirs += min(b) * times
        out[n] = (ours * 1e3, theirs * 1e3)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--steps", type=int, default=20, help="timed steps per N (default 20)")
    ap.add_argument("--pos", type=int, default=64, help="the rows' position (default 64)")
    args = ap.parse_args()
    from starpu_llm.runtime.starpu import Runtime
    cfg = MODELS["d12"]
    load_before = os.getloadavg()
    bw = bandwidth_gbs()
    runtime = Runtime()
    backend = gen.StarPUBackend(runtime, cfg, random_init(cfg, 1337))
    rng = np.random.default_rng(0)
    try:
        # as the server makes it: room for the logits of scored prompts' rows beside the slots'
        dec = {n: SlotDecoder(backend, n, rows=max(n, args.pos), extra_heads=SCORED_ROWS,
                              cache_len=args.pos + args.steps + 8)
               for n in args.rows}

        def step(n, i):
            return dec[n].step([Feed(s, args.pos + i % 8, [int(rng.integers(cfg.V))])
                                for s in range(n)])

        for n in args.rows:                     # warm-up (and the positions before --pos)
            for s in range(n):
                dec[n].step([Feed(s, 0, rng.integers(0, cfg.V, args.pos))])
            step(n, 0)
        wall = {n: [] for n in args.rows}
        submit = {n: [] for n in args.rows}
        for i in range(args.steps):
            for n in args.rows:
                wall[n].append(_timed(lambda: step(n, i)))
                # the Python submission alone: decode_step returns when its tasks are submitted
                g = dec[n].groups[0]
                submit[n].append(_timed(lambda: decode_step(
                    backend.ops, cfg, backend.p, g.kv, g.d, g.h, n, n)))
                runtime.wait()
        traces = {}
        for n in args.rows:
            runtime.start_trace()
            t0 = time.perf_counter_ns()     # CLOCK_MONOTONIC, as the trace's times
            step(n, 1)
            t1 = time.perf_counter_ns()
            traces[n] = (runtime.trace(), (t1 - t0) / 1e9, t0, t1)
            runtime.stop_trace()
        logits = {n: step(n, 2) for n in args.rows}
        sampled = {}
        for n in args.rows:
            rngs = [np.random.default_rng(s) for s in range(n)]
            greedy = statistics.median(_timed(lambda: gen.sample_batch(
                logits[n], [0.0] * n, [0] * n, rngs, [1.0] * n)) for _ in range(5))
            top_p = statistics.median(_timed(lambda: gen.sample_batch(
                logits[n], [1.0] * n, [0] * n, rngs, [0.9] * n)) for _ in range(5))
            sampled[n] = (greedy, top_p)
        where = runtime.describe()
        ab = matmul_ab(cfg, args.rows) if os.path.exists(BLAS_PATH) else {}
    finally:
        backend.close()
        runtime.shutdown()
    load_after = os.getloadavg()
    print(f"GPT-2 124M (d12, random init), {where}; rows at position {args.pos}")
    print(f"load average (1, 5, 15 min) before: {' '.join(f'{x:.2f}' for x in load_before)}, "
          f"after: {' '.join(f'{x:.2f}' for x in load_after)} ({os.cpu_count()} logical cores)")
    print(f"memory bandwidth (numpy copy of 256 MiB, read + write): {bw:.1f} GB/s")
    for n in args.rows:
        events, t, t0, t1 = traces[n]
        ms = statistics.median(wall[n]) * 1e3
        by = collections.defaultdict(lambda: [0, 0.0])
        for e in events:
            by[e.codelet][0] += 1
            by[e.codelet][1] += (e.end_ns - e.start_ns) / 1e6
        busy = sum(v[1] for v in by.values())
        span = (max(e.end_ns for e in events) - min(e.start_ns for e in events)) / 1e6
        mm = by.get("matmul_forward", [0, 0.0])[1]
        print(f"\nN = {n} rows: step {ms:.2f} ms (median of {args.steps}; best "
              f"{min(wall[n]) * 1e3:.2f}), "
              f"{ms / n:.2f} ms per token; traced step {t * 1e3:.2f} ms")
        print(f"  {len(events)} tasks; their run times sum to {busy:.2f} ms "
              f"(first start to last end {span:.2f} ms); the rest of the step "
              f"{t * 1e3 - busy:.2f} ms = {(t * 1e3 - busy) / len(events) * 1e3:.0f} us a task")
        first, last = min(e.start_ns for e in events), max(e.end_ns for e in events)
        print(f"  gaps between the tasks {span - busy:.2f} ms; before the first task "
              f"{(first - t0) / 1e6:.2f} ms, after the last {(t1 - last) / 1e6:.2f} ms (the "
              f"step's Python: rows, submission, reading the logits)")
        print(f"  Python submission of the step's tasks: "
              f"{statistics.median(submit[n]) * 1e3:.2f} ms")
        for name, (count, tms) in sorted(by.items(), key=lambda kv: -kv[1][1]):
            print(f"    {name:<22} {count:>4} tasks {tms:8.2f} ms  {tms / count * 1e3:7.1f} us each")
        wb = weight_bytes(cfg, n)
        print(f"  matmuls: {wb / 1e6:.0f} MB of weights in {mm:.2f} ms = "
              f"{wb / mm / 1e6:.1f} GB/s ({wb / mm / 1e6 / bw * 100:.0f} % of the copy's "
              f"bandwidth; at it, {wb / bw / 1e6:.2f} ms)")
        if n in ab:
            ours, theirs = ab[n]
            wb = weight_bytes(cfg, 1)
            print(f"  the step's matmuls alone (best of 7, taking turns): this build "
                  f"{ours:.2f} ms ({wb / ours / 1e6:.1f} GB/s), OpenBLAS sgemm {theirs:.2f} ms "
                  f"({wb / theirs / 1e6:.1f} GB/s): {theirs / ours:.2f} x")
        g, p = sampled[n]
        print(f"  sampling {n} rows: greedy {g * 1e3:.2f} ms, temperature 1 top_p 0.9 "
              f"{p * 1e3:.2f} ms ({p * 1e3 / n:.2f} ms a token)")


if __name__ == "__main__":
    main()
