"""Where a cap with room to spare loses time (issue 22, item 3's 75 % row): the same training
uncapped, under --memory-limit at a fraction of its peak RSS, then uncapped again (a drift of
the machine shows as the two uncapped runs apart), each in a fresh process; per run the step
times, the peak RSS, the disk traffic and the page faults and system time of the process
(getrusage of the children, so one run at a time).

Under the flag StarPU frees every activation when the engine drops it after the backward
(the next step's use writes it again), and glibc gives buffers above 32 MiB back to the
kernel, so each step maps those pages again: the minor page faults count them (4 KiB each).
perf/memory.py predicts these bytes (`allocated`), the calibration's first-touch rate their
time.

    .venv/bin/python experiments/offload_faults.py --batch 2     # ~8 min here
"""
from __future__ import annotations

import argparse
import resource

from starpu_llm.perf.runs import run_in_subprocess
from starpu_llm.runtime import usable_cores


def measured(spec: dict) -> tuple:
    """(the run's result, its minor page faults, its system seconds)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = run_in_subprocess(spec)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if "error" in r:
        raise SystemExit(f"{spec}: {r['error']}")
    return r, after.ru_minflt - before.ru_minflt, after.ru_stime - before.ru_stime


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="d12")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up")
    ap.add_argument("--fraction", type=float, default=0.75, help="the cap, of the uncapped peak RSS")
    args = ap.parse_args()
    base = dict(engine="starpu", model=args.model, batch=args.batch, seq_len=args.seq_len,
                steps=args.steps, workers=1, cores_per_worker=usable_cores())
    rows = []
    first, faults, sys_s = measured(dict(base))
    rows.append(("uncapped", "", first, faults, sys_s))
    cap = int(first["peak_rss_mb"] * args.fraction)
    rows.append((f"cap {args.fraction:.0%}", f"{cap}M", *measured(dict(base, memory_limit=f"{cap}M"))))
    rows.append(("uncapped again", "", *measured(dict(base))))
    print(f"{args.model} B={args.batch} T={args.seq_len}, 1 warm-up + {args.steps} steps per run\n")
    print("| run | cap | s per step | peak RSS (MiB) | disk read / written per step (MB) | "
          "minor page faults | system s |\n|---|---|---|---|---|---|---|")
    for name, limit, r, faults, sys_s in rows:
        disk = r.get("disk_traffic") or [[0, 0]]
        print(f"| {name} | {limit} | {' '.join(f'{x / 1e3:.1f}' for x in r['step_ms'])} | "
              f"{r['peak_rss_mb']:.0f} | {disk[-1][0] / 1e6:.0f} / {disk[-1][1] / 1e6:.0f} | "
              f"{faults} | {sys_s:.1f} |")


if __name__ == "__main__":
    main()
