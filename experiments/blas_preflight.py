#!/usr/bin/env python3
"""Does a k-core task's GEMM run on k threads? (tools/device-eval16.sh's preflight, issue 42.)

A k-core StarPU task gets its cores only if the BLAS follows the task's OpenMP team (OpenBLAS's
OpenMP build, linked explicitly: meson's -Dopenblas_dir); a pthread OpenBLAS shares one
process-wide pool between the workers and the n x k partitions then oversubscribe. Checked, not
assumed: a short traced run (one warm-up and one timed step of the model) on 1 x 1, then on
each N x K asked, and each matmul_forward task's rate (its flops over its time) compared: a
task of K cores must run at least --ratio x K times as fast as one of a single core (OpenMP
teams of K threads reach ~0.8 K on these sizes; a shared pthread pool well under K / 2).

    python experiments/blas_preflight.py --partitions 4x4,1x16 [--model d12] [--json OUT]

Prints one line per partition and a verdict; exit status 0 when every partition passes, 1 when
one does not (its GEMM does not use its cores), 2 when a run failed (no verdict).
"""
from __future__ import annotations

import argparse
import json
import sys

from starpu_llm.perf.runs import run_in_subprocess

CODELET = "matmul_forward"
PER_SUB = 4          # sequences per worker: a (4 x 64) x 768 x 3072 sgemm, wide enough for 16


def gemm_rate(events, steps_ns) -> float | None:
    """GFLOP/s of the matmul_forward tasks of the timed steps (each task's flops over its own
    time, summed), None when there is none."""
    t_first = steps_ns[1][0] if len(steps_ns) > 1 else 0
    flops = secs = 0.0
    for codelet, _w, _k, start, end, _b, f, _j in events:
        if codelet == CODELET and start >= t_first and end > start and f:
            flops += f
            secs += (end - start) * 1e-9
    return flops / secs / 1e9 if secs else None


def verdict(one: float, rates: dict, ratio: float) -> list[dict]:
    """Each partition's check: (N, K) -> GFLOP/s of its tasks against ratio x K x one core's."""
    out = []
    for (n, k), r in rates.items():
        speedup = r / one
        out.append(dict(partition=f"{n}x{k}", gflops=round(r, 2), one_core_gflops=round(one, 2),
                        speedup=round(speedup, 2), needed=round(ratio * k, 2),
                        ok=bool(speedup >= ratio * k)))
    return out


def measure(model: str, n: int, k: int, T: int = 64) -> float:
    spec = dict(engine="starpu", model=model, batch=n * PER_SUB, seq_len=T, steps=1,
                workers=n, cores_per_worker=k, cpus=n * k, trace=True)
    if k > 1:
        spec["kcore"] = "team"
    r = run_in_subprocess(spec, timeout=300)
    if "error" in r:
        raise RuntimeError(f"{n}x{k}: {r['error']}")
    rate = gemm_rate(r["events"], r["steps_ns"])
    if rate is None:
        raise RuntimeError(f"{n}x{k}: no {CODELET} task traced")
    return rate


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--partitions", default="4x4,1x16", help="N x K partitions to check")
    ap.add_argument("--model", default="d12")
    ap.add_argument("--ratio", type=float, default=0.5,
                    help="a K-core task must be this x K times one core's rate (default 0.5)")
    ap.add_argument("--json", help="write the checks there too")
    args = ap.parse_args(argv)
    try:
        parts = [tuple(int(x) for x in p.lower().split("x")) for p in args.partitions.split(",")]
        if any(len(p) != 2 or min(p) < 1 for p in parts):
            raise ValueError
    except ValueError:
        print(f"blas_preflight.py: --partitions {args.partitions!r}: want NxK[,NxK...], e.g. "
              "4x4,1x16", file=sys.stderr)
        return 2
    try:
        one = measure(args.model, 1, 1)
        rates = {(n, k): measure(args.model, n, k) for n, k in parts}
    except RuntimeError as e:
        print(f"blas preflight: FAILED (no verdict): {e}")
        return 2
    checks = verdict(one, rates, args.ratio)
    for c in checks:
        print(f"blas preflight: {c['partition']}: a task's GEMM {c['gflops']:.1f} GFLOP/s, "
              f"{c['speedup']:.1f} x one core's ({c['one_core_gflops']:.1f}); needed "
              f">= {c['needed']:.1f}: {'ok' if c['ok'] else 'NOT ITS CORES'}")
    ok = all(c["ok"] for c in checks)
    print("blas preflight: " + ("ok: k-core tasks' GEMMs use their k cores" if ok else
                                "FAILED: a k-core task's GEMM does not use its k cores"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(ok=ok, checks=checks), f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
