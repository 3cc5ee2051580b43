"""How much a step balanced over this machine's cores loses to their independent speed changes.

One process per core, each pinned to its core, runs the project's matmul kernel (one
cblas_sgemm, GPT-2 124M's fc shape at 256 tokens, as a rank of `mpirun -np 2` at B=8 does) for
--seconds and records its GFLOP/s over consecutive windows of --window seconds (about one
training step). All cores run at once, as the ranks of a data-parallel run do.

A synchronous step whose work is split evenly over the cores (sharded data parallelism: every
rank computes, then both wait for each other's gradients) runs at the slowest core's pace in
each window; one whose other cores have slack (rank-0 ownership: rank 1 idles a quarter of
the step) runs at its busiest core's own pace. The report gives, per core, the mean and the
coefficient of variation of its windows, the correlation between cores, and the balance
factor mean(min over cores) / mean(mean over cores): the share of the cores' mean speed a
balanced synchronous step gets. 1 on a quiet dedicated node; below 1 where the cores' speeds
move independently (a VM whose vCPUs share their host's cores with other guests).

    .venv/bin/python experiments/core_noise.py --seconds 120 --window 3.5 --out DIR

writes DIR/core_noise.csv (core, window, gflops) and DIR/core_noise.json (the report).
"""
import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

N, K, OC = 256, 768, 4 * 768


def child(core: int, seconds: float, window: float, start: float) -> list:
    """GFLOP/s of core's matmul loop in each window, from the wall-clock time start on."""
    from sgemm_peak import lib, matmul_call
    os.sched_setaffinity(0, {core})
    lib.kernels_set_threads(1)
    matmul = matmul_call(N, K, OC, seed=core)
    time.sleep(max(0.0, start - time.time()))                # every core starts together
    rates = []
    for _ in range(int(seconds / window + 1e-9)):     # (0.6 // 0.2 is 2.0)
        t0, calls = time.perf_counter(), 0
        while time.perf_counter() - t0 < window:
            matmul()
            calls += 1
        rates.append(2.0 * N * K * OC * calls / (time.perf_counter() - t0) / 1e9)
    return rates


def report(rates: np.ndarray) -> dict:
    """rates (cores, windows) GFLOP/s -> the summary the module docstring describes."""
    mean = rates.mean(axis=1)
    corr = np.corrcoef(rates) if len(rates) > 1 else np.ones((1, 1))
    off = corr[~np.eye(len(rates), dtype=bool)]
    return dict(cores=len(rates), windows=rates.shape[1],
                mean_gflops=[round(float(m), 2) for m in mean],
                cv=[round(float(c), 4) for c in rates.std(axis=1) / mean],
                correlation=round(float(off.mean()), 3) if off.size else None,
                balance_factor=round(float(rates.min(axis=0).mean() / rates.mean(axis=0).mean()),
                                     4))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--window", type=float, default=3.5, help="seconds (about one step)")
    ap.add_argument("--cores", default=None, help="e.g. 0,1 (default: every usable core)")
    ap.add_argument("--out", default=None, help="folder for core_noise.csv and .json")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        core, seconds, window, start = args.child
        print(json.dumps(child(int(core), float(seconds), float(window), float(start))))
        return 0
    if args.window <= 0 or args.seconds < 2 * args.window:
        ap.error("--seconds must hold at least two --window")
    from starpu_llm.runtime.cpus import core_cpus   # here: the children import nothing
    cores = ([int(c) for c in args.cores.split(",")] if args.cores
             else core_cpus())       # one busy loop a core (its first hardware thread)
    start = time.time() + 2.0            # after every child has imported and warmed up
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, __file__, "--child", str(c), str(args.seconds),
                               str(args.window), str(start)], stdout=subprocess.PIPE, env=env,
                              text=True) for c in cores]
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        sys.exit("core_noise: a core's run failed (see above)")
    rates = np.array([json.loads(o.strip().splitlines()[-1]) for o in outs])
    rep = dict(report(rates), window_s=args.window, seconds=args.seconds, core_ids=cores)
    print(json.dumps(rep))
    if args.out:
        from provenance import machine_info
        from starpu_llm.io.atomic import atomic_write_text
        os.makedirs(args.out, exist_ok=True)
        lines = ["core,window,gflops"] + [f"{c},{w},{rates[i, w]:.2f}" for i, c in enumerate(cores)
                                          for w in range(rates.shape[1])]
        atomic_write_text(os.path.join(args.out, "core_noise.csv"), "\n".join(lines) + "\n")
        atomic_write_text(os.path.join(args.out, "core_noise.json"),
                          json.dumps(dict(rep, machine=machine_info()), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
