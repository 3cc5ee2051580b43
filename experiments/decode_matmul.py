"""A serving decode step's matmuls alone: GPT-2 124M's 49 (12 layers x qkv, attention
projection, fc, fc projection, each layer its own weights, + the tied lm head 768 x 50304) at
N = 1, 4, 8 and 16 rows, through the project's matmul kernel (csrc/kernels/matmul.c: with
N <= SL_MATMUL_FEW_ROWS its few-rows kernel, not sgemm) and its cffi binding, with the OpenMP
threads a task of --threads cores sets (kernels_set_threads).

Each round times one step of every N in turn (the N taking turns, so that a change of the
machine's load falls on all alike); a row per (round, N) with the step's ms and GFLOP/s
(2 N C OC flops per matmul) and the weight bytes it streams per second. The weights are numpy
arrays (about 500 MB: read from memory each step, as a served model's are). Not a test.

    .venv/bin/python experiments/decode_matmul.py [--threads 2] [--rounds 5] [--csv FILE]
"""
import argparse
import csv
import sys
import time

import numpy as np

from starpu_llm._kernels import ffi, lib

C, L, VP = 768, 12, 50304
LAYER = [(C, 3 * C), (C, C), (C, 4 * C), (4 * C, C)]     # (in, out) of qkv, attproj, fc, fcproj


def step_matmuls(rows_max: int, seed=0):
    """(in, out, weight pointer) of a step's 49 matmuls, and the arrays they point into."""
    rng = np.random.default_rng(seed)
    keep, calls = [], []
    for _ in range(L):
        for k, oc in LAYER:
            w = rng.standard_normal((oc, k), dtype=np.float32)
            keep.append(w)
            calls.append((k, oc, ffi.cast("float *", ffi.from_buffer(w))))
    wte = rng.standard_normal((VP, C), dtype=np.float32)
    keep.append(wte)
    calls.append((C, VP, ffi.cast("float *", ffi.from_buffer(wte))))
    inp = rng.standard_normal((rows_max, 4 * C), dtype=np.float32)
    out = np.empty((rows_max, VP), np.float32)
    keep += [inp, out]
    return calls, keep, (ffi.cast("float *", ffi.from_buffer(inp)),
                         ffi.cast("float *", ffi.from_buffer(out)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--label", default="", help="a column to tell runs apart")
    ap.add_argument("--csv", help="append the rows here (else standard output)")
    args = ap.parse_args()
    lib.kernels_set_threads(args.threads)
    calls, keep, (pi, po) = step_matmuls(max(args.rows))
    weight_bytes = sum(k * oc * 4 for k, oc, _ in calls)

    def step(n):
        t0 = time.perf_counter()
        for k, oc, pw in calls:
            lib.matmul_forward(po, pi, pw, ffi.NULL, n, k, oc)
        return time.perf_counter() - t0

    for n in args.rows:          # warm-up: first touch of every weight page and output
        step(n)
    out = open(args.csv, "a", newline="") if args.csv else sys.stdout
    w = csv.writer(out)
    if not args.csv or out.tell() == 0:
        w.writerow(["label", "round", "N", "ms", "gflops", "weight_gbs"])
    for r in range(args.rounds):
        for n in args.rows:
            s = step(n)
            flops = sum(2 * n * k * oc for k, oc, _ in calls)
            w.writerow([args.label, r, n, f"{s * 1e3:.2f}", f"{flops / s / 1e9:.1f}",
                        f"{weight_bytes / s / 1e9:.1f}"])
            out.flush()


if __name__ == "__main__":
    main()
