"""One training iteration of a 2-stage pipeline, both ranks, as a Gantt chart (issue 21, item
5): `mpirun -np 2` ranks of one core each train --steps steps (3) with the task trace on, each
writes its trace, and the last step is drawn, a row per rank, tasks coloured by phase, each
run of one micro-batch's forward or backward labelled with its number (the order the stages
took them in: forwards first under --schedule eager (the default) and gpipe, forwards and
backwards alternating under 1f1b). Writes pipeline_gantt.png and pipeline_gantt.csv (every
task of the step: rank, codelet, phase, micro-batch, start and end in ms) into --out. Prints
where each rank's step went, and the step's tail: from the last backward task of any rank to
the step's end (the last gradient sums, updates and messages, which the ranks wait for), and
for every step but the first each rank's forward and backward busy time (which rank was the
slower, step by step).

--stages 1 --ranks R --ownership sharded|rank0 draws data parallelism instead (files named
<ownership>_gantt.*).

    .venv/bin/python experiments/pipeline_gantt.py [--batch 8] [--stages 2] [--model d12] [--schedule eager]
    .venv/bin/python experiments/pipeline_gantt.py --stages 1 --ranks 2 --ownership sharded --steps 7
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))
PHASES = {"forward": "#4c72b0", "backward": "#dd8452", "reduction": "#8172b3",
          "update": "#55a868"}


def phase(codelet: str) -> str:
    if codelet in ("add", "zero"):
        return "reduction"
    if codelet in ("adamw", "grad_sumsq", "norm_sum"):
        return "update"
    if codelet.endswith("_backward") or codelet == "copy":
        return "backward"
    return "forward"


def child(args):
    """Under mpirun: train with the trace on, write this rank's last step."""
    from starpu_llm.perf.runs import mpi_rank
    from starpu_llm.training.trainer import TrainConfig, train
    r = train(TrainConfig(model=args.model, batch=args.batch, seq_len=args.seq_len,
                          steps=args.steps, workers=1, cores_per_worker=1,
                          pipeline_stages=args.stages,
                          pipeline_schedule=args.schedule if args.stages > 1 else None,
                          ownership=args.ownership, trace=True, log=None))
    events = [(e.codelet, e.start_ns, e.end_ns, e.job) for e in r.trace]
    with open(os.path.join(args.tmp, f"rank{mpi_rank()}.json"), "w") as f:
        json.dump(dict(step_ms=r.step_ms, events=events, describe=r.engine), f)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="d12")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--stages", type=int, default=2)
    from starpu_llm.plan.topology import PIPELINE_SCHEDULES
    ap.add_argument("--schedule", default="eager", choices=PIPELINE_SCHEDULES)
    ap.add_argument("--ranks", type=int, default=None, help="MPI processes (default: --stages)")
    ap.add_argument("--ownership", default="sharded", choices=["sharded", "rank0"])
    ap.add_argument("--steps", type=int, default=3, help="traced steps (the last is drawn)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "ownership"))
    ap.add_argument("--subdir", default="", help="write into --out/<cpu kind>/SUBDIR")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tmp", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.ranks = args.ranks or args.stages
    if args.steps < 2:
        ap.error("--steps must be at least 2 (the first warms up)")
    if args.child:
        return child(args)
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        sys.exit("mpirun not found (install openmpi-bin)")
    from provenance import cpu_kind, git_commit
    out = os.path.join(args.out, cpu_kind(), args.subdir)
    os.makedirs(out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        cmd = [mpirun, "--oversubscribe", "--bind-to", "none", "-np", str(args.ranks),
               sys.executable, os.path.abspath(__file__), "--child", "--tmp", tmp,
               "--model", args.model, "--batch", str(args.batch), "--seq-len", str(args.seq_len),
               "--stages", str(args.stages), "--schedule", args.schedule,
               "--ownership", args.ownership, "--steps", str(args.steps)]
        p = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if p.returncode != 0:
            sys.exit(f"the traced run failed: {p.stderr.strip().splitlines()[-1:]}")
        ranks = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(args.ranks)]
    # step k's micro-batches' loads are the k-th of --steps equal groups of rank 0's (stage 0
    # loads); the first of them is the step's first task (each step waits for the one
    # before). Micro-batch m's tasks are submitted after its load, before m + 1's; every
    # rank submits every task, so the submission numbers are the same on every rank.
    all_loads = sorted((j, s) for c, s, _, j in ranks[0]["events"] if c == "load_batch")
    per = len(all_loads) // args.steps
    step_starts = [all_loads[k * per][1] for k in range(args.steps)]
    loads = all_loads[len(all_loads) - per:]
    starts = [j for j, _ in loads]
    t0 = loads[0][1]
    t1 = t0 + ranks[0]["step_ms"][-1] * 1e6
    rows = []
    for r, d in enumerate(ranks):
        for c, s, e, j in d["events"]:
            if s >= t0 and s < t1:
                ph = phase(c)
                mb = (sum(x <= j for x in starts) - 1) if ph in ("forward", "backward") else ""
                rows.append(dict(rank=r, codelet=c, phase=ph, micro_batch=mb,
                                 start_ms=round((s - t0) / 1e6, 3), end_ms=round((e - t0) / 1e6, 3)))
    from starpu_llm.perf.runs import write_csv
    name = "pipeline" if args.stages > 1 else args.ownership
    write_csv(os.path.join(out, f"{name}_gantt.csv"), rows)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    f, ax = plt.subplots(figsize=(12, 1.6 + 0.6 * args.ranks))
    for r in range(args.ranks):
        for ph, colour in PHASES.items():
            bars = [(x["start_ms"], x["end_ms"] - x["start_ms"]) for x in rows
                    if x["rank"] == r and x["phase"] == ph]
            if bars:
                ax.broken_barh(bars, (r - 0.4, 0.8), facecolors=colour, edgecolor="none")
    for r in range(args.ranks):     # label each run of one micro-batch's forward or backward
        mine = sorted((x for x in rows if x["rank"] == r), key=lambda x: x["start_ms"])
        for k, x in enumerate(mine):
            if x["micro_batch"] != "" and (k == 0 or (mine[k - 1]["micro_batch"], mine[k - 1]["phase"])
                                           != (x["micro_batch"], x["phase"])):
                ax.text(x["start_ms"], r + (0.25 if x["phase"] == "forward" else -0.25),
                        str(x["micro_batch"]), fontsize=6, va="center")
    span = (t1 - t0) / 1e6
    busy = [sum(x["end_ms"] - x["start_ms"] for x in rows if x["rank"] == r) for r in range(args.ranks)]
    ax.set_yticks(range(args.ranks))
    ax.set_yticklabels([f"rank {r}{f' (stage {r})' if args.stages > 1 else ''}, busy {b / span:.0%}"
                        for r, b in enumerate(busy)])
    ax.set_xlim(0, span)
    ax.set_xlabel("ms since the step's first task")
    what = (f"a {args.stages}-stage pipeline" if args.stages > 1
            else f"data parallelism, {args.ownership} ownership")
    ax.set_title(textwrap.fill(f"One step of {what}, {args.model}, "
                               f"B={args.batch}, T={args.seq_len}, {args.ranks} ranks x 1 core "
                               f"({ranks[0]['describe']}); commit {git_commit()}", 150),
                 fontsize=8)
    ax.legend(handles=[Patch(color=c, label=p) for p, c in PHASES.items()], fontsize=7,
              loc="center left", bbox_to_anchor=(1.005, 0.5))
    f.tight_layout()
    png = os.path.join(out, f"{name}_gantt.png")
    f.savefig(png, dpi=90)
    print(f"wrote {png}: step {span:.0f} ms, busy " + ", ".join(f"{b:.0f} ms" for b in busy))
    for r in range(args.ranks):    # where each rank's step went
        mine = [x for x in rows if x["rank"] == r]
        by = {ph: sum(x["end_ms"] - x["start_ms"] for x in mine if x["phase"] == ph) for ph in PHASES}
        first = min(x["start_ms"] for x in mine)
        print(f"rank {r}: " + ", ".join(f"{ph} {ms:.0f}" for ph, ms in by.items())
              + f" ms; idle {span - busy[r]:.0f} ms, of which {first:.0f} before its first task")
    last_backward = max(x["end_ms"] for x in rows if x["phase"] == "backward")
    print(f"tail: {span - last_backward:.0f} ms from the last backward task to the step's end")
    ends = step_starts[1:] + [t1]
    for k in range(1, args.steps):     # the slower rank, step by step
        fb = [sum(e - s for c, s, e, _ in d["events"]
                  if step_starts[k] <= s < ends[k] and phase(c) in ("forward", "backward")) / 1e6
              for d in ranks]
        print(f"step {k} ({ranks[0]['step_ms'][k]:.0f} ms): forward and backward busy "
              + ", ".join(f"rank {r} {b:.0f}" for r, b in enumerate(fb))
              + f" ms; slowest rank {max(range(len(fb)), key=fb.__getitem__)}")


if __name__ == "__main__":
    main()
