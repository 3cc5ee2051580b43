"""One traced GPU step as a Gantt chart, from gpu_bench.py's trace_BxT.csv: where each task ran
and when its kernels ran on the GPU.

    python experiments/gpu_gantt.py experiments/results/gpu/h200/trace_8x1024.csv [--png OUT]

Rows: the GPU (each task's kernels, gpu_start_ns .. gpu_end_ns: two CUDA events on its stream,
csrc/starpu/trace.c), the CUDA worker's thread (each task's queueing of its kernels) and the CPU
workers (their tasks: the batch loads), coloured by phase (experiments/taskgraph.py), over the
trace's last step (from its batch load on: the trainer drained the step before it). The title
gives the step's span and the share of it the GPU ran kernels (gpu_bench.gpu_busy). A trace
written before the GPU times existed (no gpu_* columns) draws the two worker rows only. The PNG
is written to a temporary name and renamed (default: beside the CSV, .png for .csv).
"""
from __future__ import annotations

import argparse
import csv
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import gpu_bench  # noqa: E402
import taskgraph  # noqa: E402
from starpu_llm.runtime.starpu import TraceEvent  # noqa: E402


def read_trace(path: str) -> list:
    """The rows of a trace CSV as TraceEvents (what gpu_bench's readings take)."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows or "codelet" not in rows[0]:
        raise SystemExit(f"{path}: not a gpu_bench trace (no codelet column)")
    return [TraceEvent(r["codelet"], int(r["worker"]), 1, int(r["start_ns"]), int(r["end_ns"]),
                       None, float(r.get("flops") or 0.0), int(r["job"]), 0,
                       int(r.get("gpu_start_ns") or 0), int(r.get("gpu_end_ns") or 0),
                       int(r.get("nbytes") or 0)) for r in rows]


def draw(trace: list, png: str, title: str) -> dict:
    """The last step of trace as a Gantt chart into png; what it shows, as numbers."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    step = gpu_bench.last_step(trace)
    if not step:
        raise SystemExit("the trace has no batch load: no step to draw")
    t0 = min(e.start_ns for e in step)
    gpu_workers = {e.worker for e in step if e.gpu_end_ns > 0} or {0}
    timed = [e for e in step if e.gpu_end_ns > 0]
    rows = [("GPU kernels", timed, True)] if timed else []
    rows += [(f"worker {w} ({'CUDA: queueing' if w in gpu_workers else 'CPU'})",
              [e for e in step if e.worker == w], False) for w in sorted({e.worker for e in step})]
    f, ax = plt.subplots(figsize=(12, 1.6 + 0.5 * len(rows)))
    end = t0
    for y, (_, events, on_gpu) in enumerate(rows):
        for ph in taskgraph.PHASES:
            bars = [(((e.gpu_start_ns if on_gpu else e.start_ns) - t0) / 1e6,
                     ((e.gpu_end_ns - e.gpu_start_ns) if on_gpu else (e.end_ns - e.start_ns)) / 1e6)
                    for e in events if taskgraph.phase(e.codelet) == ph]
            if bars:
                ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=taskgraph.PHASE_COLOURS[ph],
                               edgecolor="none")
        end = max([end] + [e.gpu_end_ns if on_gpu else e.end_ns for e in events])
    span = (end - t0) / 1e6
    busy = gpu_bench.gpu_busy(trace)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([name for name, _, _ in rows])
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.set_xlim(0, span)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step's batch load")
    gpu = f"; the GPU ran kernels {100 * busy[0]:.1f} % of it" if busy else "; no GPU times"
    ax.set_title(f"{title}: one step, {len(step)} tasks, {span:.1f} ms{gpu}", fontsize=8)
    ax.legend(handles=[Patch(color=taskgraph.PHASE_COLOURS[p], label=p) for p in taskgraph.PHASES],
              fontsize=7, loc="center left", bbox_to_anchor=(1.005, 0.5))
    f.tight_layout()
    tmp = png + ".tmp.png"
    f.savefig(tmp, dpi=90)
    plt.close(f)
    os.replace(tmp, png)
    return dict(tasks=len(step), span_ms=span, gpu_busy=busy[0] if busy else None)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", help="a trace_BxT.csv of experiments/gpu_bench.py --trace")
    ap.add_argument("--png", help="the chart (default: the CSV's name, .png)")
    args = ap.parse_args(argv)
    if not os.path.isfile(args.trace):
        ap.error(f"no trace file {args.trace}")
    png = args.png or os.path.splitext(args.trace)[0] + ".png"
    name = os.path.basename(os.path.dirname(os.path.abspath(args.trace)))
    shape = os.path.splitext(os.path.basename(args.trace))[0].replace("trace_", "")
    out = draw(read_trace(args.trace), png, f"starpu-llm on {name}, {shape}")
    print(f"{png}: {out}")


if __name__ == "__main__":
    main()
