"""The same bench configurations under several builds of the project, side by side in one run.

A side is a Python interpreter whose environment has its own starpu_llm: another virtual
environment built against another StarPU (`.venv` on Debian's 1.3, `.venv-1.4` on the vendored
1.4), or a worktree of another commit (before and after a change), optionally with environment
variables (`SL_NO_PARALLEL_WORKERS=1` turns StarPU 1.4's parallel workers off, so a k-core task
runs on a 'team' worker as on 1.3). Every configuration runs on every side, each run in a fresh
process, all of them interleaved round-robin `--repeat` times (a slow phase of a shared machine
then hits every side alike); the table gives the median tokens/ms with the min-max of the runs,
and the CSV every run.

    .venv/bin/python experiments/compare_builds.py \\
        --side "1.3=.venv/bin/python" --side "1.4=.venv-1.4/bin/python" \\
        --side "1.4 team=.venv-1.4/bin/python SL_NO_PARALLEL_WORKERS=1" \\
        --batches 4,8 --workers auto --mpi-ranks 1,2,3 --repeat 3 --csv experiments/out/builds.csv

MPI rows (`--mpi-ranks`): R processes under mpirun, each a 1 x K partition with
`--mpi-batch-per-rank` sequences (weak scaling); the gradient reduction's cost per iteration is
estimated as the step time above the R = 1 run of the same side. On a machine with fewer cores
than R x K the ranks share cores, and that sharing is in the estimate too.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from dataclasses import replace

from starpu_llm.bench import bench_partitions, label_of
from starpu_llm.plan.partition import settings_of
from starpu_llm.cli import add_setting_args, partition_settings
from starpu_llm.perf.runs import cpu_description, run_in_subprocess, write_csv
from starpu_llm.runtime.cpus import core_cpus


def parse_side(text: str) -> tuple[str, str, dict]:
    """'LABEL=PYTHON [VAR=VALUE ...]' -> (label, python, extra environment)."""
    label, sep, rest = text.partition("=")
    words = rest.split()
    if not sep or not label or not words:
        raise SystemExit(f"--side {text!r}: write LABEL=PYTHON [VAR=VALUE ...]")
    python = os.path.abspath(words[0])
    if not os.access(python, os.X_OK):
        raise SystemExit(f"--side {text!r}: {python} is not an executable Python; build that "
                         "environment first (make install, make test-1.4)")
    env = {}
    for w in words[1:]:
        var, eq, value = w.partition("=")
        if not eq:
            raise SystemExit(f"--side {text!r}: {w!r} is not VAR=VALUE")
        env[var] = value
    return label, python, env


def plan(args, cores: int) -> list[tuple[str, dict]]:
    """(row label, spec) of every configuration."""
    rows = []
    for B in (int(b) for b in args.batches.split(",") if b):
        rows.append((f"B={B} reference", dict(engine="reference", batch=B)))
        for p in bench_partitions(args.workers, args.cores_per_worker, args.kcore, cores):
            for sub in [int(x) for x in args.sub_batches.split(",") if x] or [None]:
                if B % p.workers or (sub and B % sub):
                    continue
                rows.append((f"B={B} {label_of(p, sub)}",
                             dict(engine="starpu", batch=B,
                                  **settings_of(replace(p, sub_batches=sub or 0)))))
    for R in (int(r) for r in args.mpi_ranks.split(",") if r):
        k = args.mpi_cores_per_rank
        spec = dict(engine="starpu", batch=R * args.mpi_batch_per_rank, workers=1, cores_per_worker=k,
                    kcore="team")
        if R > 1:
            spec["ranks"] = R
        rows.append((f"mpirun -np {R} (1x{k}, B={args.mpi_batch_per_rank}/rank)", spec))
    for _, spec in rows:
        spec.update(model=args.model, seq_len=args.seq_len, steps=args.steps)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--side", action="append", required=True,
                    help="LABEL=PYTHON [VAR=VALUE ...]; give it once per side")
    ap.add_argument("--model", default="d12")
    ap.add_argument("--batches", default="4,8")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10, help="timed steps (after one warm-up)")
    add_setting_args(ap, partition_settings("workers", "cores_per_worker", "kcore"), sweep=True)
    ap.set_defaults(workers="auto")     # as starpu-llm bench --workers auto
    ap.add_argument("--sub-batches", default="", help="e.g. 2,4: each partition row with these "
                    "--sub-batches (empty: the default, one per worker)")
    ap.add_argument("--mpi-ranks", default="", help="e.g. 1,2,3 (empty: no MPI rows)")
    ap.add_argument("--mpi-batch-per-rank", type=int, default=4)
    ap.add_argument("--mpi-cores-per-rank", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--csv", help="every run, one row each")
    args = ap.parse_args(argv)
    sides = [parse_side(s) for s in args.side]
    rows = plan(args, len(core_cpus()))
    print(f"machine: {cpu_description()}", flush=True)
    runs = []
    for rep in range(args.repeat):
        for label, spec in rows:
            for side, python, extra in sides:
                r = run_in_subprocess(dict(spec), env=dict(os.environ, **extra), python=python)
                r.update(side=side, row=label, repeat=rep)
                runs.append(r)
                what = r.get("error") or f"{r['tokens_per_ms']:.4f} tok/ms  ({r.get('describe')})"
                print(f"[{rep + 1}/{args.repeat}] {side:<10} {label:<36} {what}", flush=True)
    if args.csv:
        fields = ["side", "row", "repeat", "tokens_per_ms", "peak_rss_mb", "describe", "error"]
        write_csv(args.csv, [{f: r.get(f, "") for f in fields} | {"step_ms": " ".join(
            f"{x:.1f}" for x in r.get("step_ms", []))} for r in runs])
    # the table: median tok/ms (min-max) per row and side, and the MPI cost above R = 1
    print(f"\nmedian tokens/ms of {args.repeat} interleaved runs (min-max)")
    print(f"{'':<36}" + "".join(f"{s:>30}" for s, _, _ in sides))
    base_ms = {}
    for label, spec in rows:
        cells = []
        for side, _, _ in sides:
            ok = [r for r in runs if r["side"] == side and r["row"] == label and "error" not in r]
            if not ok:
                cells.append(f"{'failed':>30}")
                continue
            tpm = sorted(r["tokens_per_ms"] for r in ok)
            ms = statistics.median(statistics.mean(r["step_ms"]) for r in ok)
            cell = f"{statistics.median(tpm):.4f} ({tpm[0]:.3f}-{tpm[-1]:.3f})"
            if "mpirun" in label:
                R = spec.get("ranks", 1)
                if R == 1:
                    base_ms[side] = ms
                elif side in base_ms:
                    cell = f"+{ms - base_ms[side]:.0f} ms " + cell
            cells.append(f"{cell:>30}")
        print(f"{label:<36}" + "".join(cells))
    return 1 if any("error" in r for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
