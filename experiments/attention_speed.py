"""The attention kernels alone, as the package builds them: attention_forward and _backward
(training's, the causal attention of B sequences of T positions), the fused ones
(attention_flash_forward and _backward, --attention flash) and attention_decode (serving's: N rows of N
slots at one position each, against key/value caches larger than the caches of the CPU), on
--threads threads (kernels_set_threads), GFLOP/s (the causal half: B NH T (T+1)/2 query-key
pairs, 4 hs flops each) and, for decoding, the caches' bytes read per second. The median of
--repeat calls. Not a test.

Run it with another tree's Python to time that tree's kernels (each venv's package is its own
editable build), --label naming it; --csv appends rows (written whole, then renamed):

    .venv/bin/python experiments/attention_speed.py --label new --csv a.csv
    /work/wt/old/.venv/bin/python experiments/attention_speed.py --label old --csv a.csv
"""
import argparse
import csv
import os
import time

import numpy as np

from starpu_llm._kernels import ffi, lib
from starpu_llm.runtime.cpus import core_cpus     # one thread a core

C, NH = 768, 12
HS = C // NH


def ptr(a, ctype="float"):
    return ffi.cast(f"{ctype} *", ffi.from_buffer(a))


def median_time(call, repeat):
    ts = []
    for r in range(repeat):
        t = time.perf_counter()
        call(r)
        ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=len(core_cpus()))
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--label", default="this tree")
    ap.add_argument("--csv")
    args = ap.parse_args()
    lib.kernels_set_threads(args.threads)
    rng = np.random.default_rng(0)
    rows = []
    for B, T in ((4, 1024), (16, 64)):
        qkv = rng.standard_normal((B, T, 3 * C), dtype=np.float32)
        out = np.empty((B, T, C), np.float32)
        att = np.zeros((B, NH, T, T), np.float32)       # touched once, before the timing
        t = median_time(lambda r: lib.attention_forward(ptr(out), ptr(att), ptr(qkv), B, T, C,
                                                        NH), args.repeat)
        gf = B * NH * T * (T + 1) / 2 * 4 * HS / t / 1e9
        rows.append(["forward", f"B={B} T={T}", f"{t * 1e3:.3f}", f"{gf:.1f}", ""])
    # training's backward, and the fused attention's forward and backward (--attention flash)
    B, T = 2, 1024
    qkv = rng.standard_normal((B, T, 3 * C), dtype=np.float32)
    dout = rng.standard_normal((B, T, C), dtype=np.float32)
    out, dqkv = np.empty((B, T, C), np.float32), np.empty((B, T, 3 * C), np.float32)
    att, datt, dp = (np.zeros((B, NH, T, T), np.float32) for _ in range(3))
    lse, dsum = np.empty((B, NH, T), np.float32), np.empty((B, NH, T), np.float32)
    pairs = B * NH * T * (T + 1) / 2
    lib.attention_forward(ptr(out), ptr(att), ptr(qkv), B, T, C, NH)
    calls = (
        ("backward", 8, lambda r: lib.attention_backward(
            ptr(dqkv), ptr(dp), ptr(datt), ptr(dout), ptr(qkv), ptr(att), B, T, C, NH)),
        ("flash-forward", 4, lambda r: lib.attention_flash_forward(
            ptr(out), ptr(lse), ptr(qkv), B, T, C, NH)),
        ("flash-backward", 10, lambda r: lib.attention_flash_backward(
            ptr(dqkv), ptr(dsum), ptr(dout), ptr(qkv), ptr(out), ptr(lse), B, T, C, NH)))
    # flops: 2 a product of each (query, key) pair's hs floats: the unfused backward's 4 (datt,
    # dv, dq, dk), the fused forward's 2, its backward's 5 (the scores and dy.v recomputed,
    # dq, dk, dv: one pass; a build without the vector paths does 7 in two passes)
    for kind, flops_per_pair_hs, call in calls:
        t = median_time(call, args.repeat)
        gf = pairs * flops_per_pair_hs * HS / t / 1e9
        rows.append([kind, f"B={B} T={T}", f"{t * 1e3:.3f}", f"{gf:.1f}", ""])
    S, Tc, N = 16, 1024, 16
    caches = [(rng.standard_normal((S, NH, Tc, HS), dtype=np.float32),
               rng.standard_normal((S, NH, Tc, HS), dtype=np.float32)) for _ in range(4)]
    qkv = rng.standard_normal((N, 3 * C), dtype=np.float32)
    out = np.empty((N, C), np.float32)
    for pos in (64, 512):
        idx = np.array([(0, s, pos) for s in range(N)], np.int32)

        def call(r):        # a layer's caches in turn: 4 x 100 MB, read from memory
            k, v = caches[r % 4]
            lib.attention_decode(ptr(out), ptr(qkv), ptr(k), ptr(v), ptr(idx, "int32_t"), N, C,
                                 NH, Tc)
        t = median_time(call, args.repeat * 3)
        gf = N * NH * (pos + 1) * 4 * HS / t / 1e9
        gbs = N * (pos + 1) * C * 2 * 4 / t / 1e9
        rows.append(["decode", f"N={N} pos={pos}", f"{t * 1e3:.3f}", f"{gf:.1f}", f"{gbs:.1f}"])
    print(f"{args.label}: {args.threads} threads, median of {args.repeat} (decoding: of "
          f"{3 * args.repeat})")
    for kind, shape, ms, gf, gbs in rows:
        print(f"  {kind:8s} {shape:16s} {ms:>9s} ms {gf:>7s} GFLOP/s" +
              (f" {gbs:>6s} GB/s of keys and values" if gbs else ""))
    if args.csv:
        old = []
        if os.path.exists(args.csv):
            with open(args.csv, newline="") as f:
                old = list(csv.reader(f))[1:]
        with open(args.csv + ".tmp", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["label", "threads", "kernel", "shape", "ms", "gflops", "cache_gbs"])
            w.writerows(old + [[args.label, args.threads] + r for r in rows])
        os.replace(args.csv + ".tmp", args.csv)


if __name__ == "__main__":
    main()
