"""The machine's sgemm peak with the project's own BLAS, for the figures' utilisation axis.

Calls the project's matmul kernel (csrc/kernels/matmul.c: one cblas_sgemm, no bias) through
its cffi binding, with the BLAS and OpenMP threads set as a task of k cores sets them
(kernels_set_threads). Shapes: GPT-2 124M's four layer GEMMs (out = inp @ W^T with inp (N, C)) at
N = B*T = 256 and 1024 tokens, and a square 2048^3; each timed as the best of several calls
after a warm-up. The peak is the best GFLOP/s over the shapes (2 N C OC flops per call).

Run it on the cores it should measure (the figures pipeline pins it with sched_setaffinity):

    taskset -c 0 .venv/bin/python experiments/sgemm_peak.py --threads 1
    .venv/bin/python experiments/sgemm_peak.py --threads 2 --json
"""
import argparse
import json
import time

import numpy as np

from starpu_llm._kernels import ffi, lib

C = 768
SHAPES = [(256, C, 3 * C), (256, C, 4 * C), (256, 4 * C, C), (1024, C, 3 * C),
          (1024, C, 4 * C), (1024, 4 * C, C), (2048, 2048, 2048)]


def matmul_call(N, K, OC, seed=0):
    """A call of the matmul kernel, out (N, OC) = inp (N, K) @ w (OC, K)^T on random operands
    it keeps alive; called once here (warm-up)."""
    rng = np.random.default_rng(seed)
    arrays = (rng.standard_normal((N, K), dtype=np.float32),
              rng.standard_normal((OC, K), dtype=np.float32), np.empty((N, OC), np.float32))
    pi, pw, po = (ffi.cast("float *", ffi.from_buffer(a)) for a in arrays)

    def call():
        lib.matmul_forward(po, pi, pw, ffi.NULL, N, K, OC)
    call.arrays = arrays
    call()
    return call


def gflops(N, K, OC, seconds_per_shape=1.0):
    matmul = matmul_call(N, K, OC)
    best, t_end = float("inf"), time.perf_counter() + seconds_per_shape
    calls = 0
    while calls < 3 or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        matmul()
        best = min(best, time.perf_counter() - t0)
        calls += 1
    return 2.0 * N * K * OC / best / 1e9


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    args = ap.parse_args()
    lib.kernels_set_threads(args.threads)
    per_shape = {f"{n}x{k}x{oc}": round(gflops(n, k, oc), 2) for n, k, oc in SHAPES}
    peak = max(per_shape.values())
    blas = ffi.string(lib.blas_name()).decode()
    if args.json:
        print(json.dumps({"threads": args.threads, "peak_gflops": peak, "blas": blas,
                          "shapes": per_shape}))
    else:
        for s, g in per_shape.items():
            print(f"{s:>16}: {g:8.1f} GFLOP/s")
        print(f"sgemm peak on {args.threads} thread(s), {blas}: {peak:.1f} GFLOP/s")


if __name__ == "__main__":
    main()
