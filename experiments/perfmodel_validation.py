"""The performance model against measurements on this machine (issue 14's validation), and the
autotuner's choice against the best measured partition.

For every B in --batches: every partition of this machine's cores (1 x 1 and each N x K = all
cores, with one and with two sub-batches per worker where they split B: the autotuner's
candidates), and under `mpirun -np 2` one one-core process per core for --mpi-batches. Each
configuration is measured as `starpu-llm bench` measures it (a fresh process, one warm-up and
--steps timed steps, the runs of every configuration interleaved --repeat times, the median
kept) and predicted by `starpu-llm predict` from this machine's calibration. With --autotune,
the autotuner (a fresh cache) chooses a partition for each B, and its choice's measured speed
is compared with the best measured one.

Writes the raw data beside the plot, in experiments/results/perfmodel/<cpu kind>/ (committed;
the CPU kind is its model name and widest vector ISA, provenance.cpu_kind):
  runs.csv          every run: configuration, repeat, tokens/ms, each timed step's ms
  validation.csv    per configuration: the runs' tokens/ms, their median, the prediction, the error
  autotune.csv      (--autotune) per B: the model's ranking, the trials, the choice, its measured
                    speed against the best measured partition, the gap
  machine.json      the CPU (model, ISA flags avx2/avx512, cores), StarPU, BLAS, the git commit
                    and whether the tree had uncommitted changes, the calibration used, the command
  calibration.toml  a copy of that calibration
  validation.png    predicted against measured (also copied to docs/figures/perfmodel_validation.png)
and prints the tables in Markdown.

    .venv/bin/python experiments/perfmodel_validation.py [--repeat 2] [--autotune]
    make perfmodel        (calibrates first if this machine has no calibration, then this
                           script with --repeat 2 --autotune: about 20 minutes on 2 cores)
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile

from starpu_llm.perf.runs import cpu_description, run_in_subprocess, write_csv
from starpu_llm.io.atomic import atomic_write_text
from starpu_llm.perf import autotune
from starpu_llm.perf.machine import default_path
from starpu_llm.plan.partition import PartitionRequest, settings_of
from starpu_llm.perf.predict import load_calibration, predict, target_partition
from starpu_llm.runtime.starpu import usable_cores

from provenance import cpu_kind, machine_info, reusable

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "perfmodel")


def configurations(cores: int, batches: list, mpi_batches: list) -> list:
    """(B, its partition: N x K, sub-batches per rank, ranks), each partition resolved once
    (predict.target_partition; the autotuner's candidates are), then measured and predicted."""
    out = []
    for B in batches:
        out.append((B, target_partition(PartitionRequest(workers=1, cores_per_worker=1,
                                                         sub_batches=1), batch=B)))
        out += [(B, p) for p in autotune.candidates(cores, B)]
    out += [(B, target_partition(PartitionRequest(workers=1, cores_per_worker=cores // 2,
                                                  sub_batches=1), 2, B))
            for B in mpi_batches if cores >= 2 and B % 2 == 0]
    return out


def shape(p) -> tuple:
    """(N, K, sub-batches per rank, ranks) of a partition: the columns of the CSVs."""
    return p.workers, p.cores_per_worker, p.sub_batches, p.ranks


def label(n: int, k: int, s: int, ranks: int) -> str:
    return f"{n}x{k}" + (f", {s} sub-batches" if s > 1 else "") + (f", mpirun -np {ranks}"
                                                                   if ranks > 1 else "")


def plot(rows: list, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5.2, 4.6))
    hi = 1.1 * max(max(r["measured"], r["predicted"]) for r in rows)
    ax.plot([0, hi], [0, hi], "k-", lw=0.8, label="predicted = measured")
    for f, style in ((0.1, ":"), (0.2, "--")):
        ax.plot([0, hi], [0, hi * (1 + f)], "k" + style, lw=0.6, label=f"±{f:.0%}")
        ax.plot([0, hi], [0, hi * (1 - f)], "k" + style, lw=0.6)
    marks = {1: "o", 4: "s", 8: "^", 16: "D"}
    for r in rows:
        color = ("C3" if r["ranks"] > 1 else "C2" if r["workers"] * r["cores_per_worker"] == 1 else
                 "C0" if r["workers"] == 1 else "C1")
        ax.plot(r["measured"], r["predicted"], marks.get(r["B"], "x"), color=color, ms=5,
                mfc="none" if r["sub_batches"] > r["workers"] else color)
    from matplotlib.lines import Line2D
    h, l = ax.get_legend_handles_labels()
    h += [Line2D([], [], color=c, marker="o", ls="") for c in ("C2", "C0", "C1", "C3")]
    l += ["1 worker x 1 core", "1 worker x all cores", "one-core workers",
          "mpirun -np 2, 1 core each", "(hollow: 2 sub-batches per worker)"]
    h.append(Line2D([], [], color="gray", marker="o", ls="", mfc="none"))
    h += [Line2D([], [], color="gray", marker=m, ls="") for m in marks.values()]
    l += [f"B={b}" for b in marks]
    ax.legend(h, l, fontsize=7, loc="upper left")
    ax.set_xlim(0, hi)
    ax.set_ylim(0, hi)
    ax.set_xlabel("measured tokens/ms")
    ax.set_ylabel("predicted tokens/ms")
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="d12")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batches", default="1,4,8,16")
    ap.add_argument("--mpi-batches", default="4,8", help="total batch of the mpirun -np 2 runs")
    ap.add_argument("--steps", type=int, default=10, help="timed steps (one more is the warm-up)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--calibration", help="this machine's calibration (default: its file)")
    ap.add_argument("--autotune", action="store_true", help="also check the autotuner's choices")
    ap.add_argument("--replot", metavar="CSV", help="only redraw the plot of an earlier run's CSV")
    ap.add_argument("--results", help="the raw files' folder (default: "
                    "experiments/results/perfmodel/<cpu kind>)")
    ap.add_argument("--png", default=os.path.join(HERE, "..", "docs", "figures",
                                                  "perfmodel_validation.png"),
                    help="where the plot is also copied ('' for nowhere)")
    args = ap.parse_args(argv)
    if args.replot:
        import csv
        with open(args.replot, newline="") as f:
            rows = [{k: (v if k == "runs" else float(v)) for k, v in r.items()}
                    for r in csv.DictReader(f)]
        plot(rows, args.png, f"{args.model} T={args.seq_len}, {cpu_description()}")
        print(f"wrote {args.png}")
        return 0
    cal_path = args.calibration or default_path()
    cal = load_calibration(cal_path)
    cores = usable_cores()
    batches = [int(b) for b in args.batches.split(",") if b]
    mpi_batches = [int(b) for b in args.mpi_batches.split(",") if b]
    configs = configurations(cores, batches, mpi_batches)
    machine = machine_info()
    results = args.results or os.path.join(RESULTS, cpu_kind())
    print(f"machine: {cpu_description()}; calibration: {cal.source}; commit {machine['commit']}")
    if not reusable(machine["commit"]):
        print("note: the tree has uncommitted changes: machine.json says so (commit before a "
              "run whose results are committed)")
    print(f"{len(configs)} configurations x {args.repeat} run(s), {args.steps} timed steps each")
    runs = measure(configs, args)
    rows = validation_rows(configs, runs, cal, args.model, args.seq_len)
    print_table(rows)
    choices = autotuner_rows(batches, rows, cal, args.model, args.seq_len) if args.autotune else None
    write_results(results, runs, rows, choices, machine, cal_path, cal, args, argv)
    try:
        png = os.path.join(results, "validation.png")
        plot(rows, png, f"{args.model} T={args.seq_len}, {cpu_description()}, {machine['commit']}")
        print(f"wrote {png}")
        if args.png:
            os.makedirs(os.path.dirname(os.path.abspath(args.png)), exist_ok=True)
            shutil.copy(png, args.png)
            print(f"copied to {args.png}")
    except ImportError:
        print("no matplotlib here: the plot is skipped (`make perfmodel` installs it; or redraw "
              f"later: --replot {os.path.join(results, 'validation.csv')})")
    return 0


def measure(configs: list, args) -> dict:
    """{configuration: [run result, one per repeat]}, the configurations interleaved."""
    runs = {c: [] for c in configs}
    for _ in range(args.repeat):          # interleaved: a slow phase hits every configuration
        for c in configs:
            B, p = c
            r = run_in_subprocess(dict(engine="starpu", model=args.model, batch=B,
                                       seq_len=args.seq_len, steps=args.steps,
                                       **settings_of(p), ranks=p.ranks))
            if "error" in r:
                raise SystemExit(f"{label(*shape(p))} B={B} failed: {r['error']}")
            runs[c].append(r)
            print(f"  B={B:<3} {label(*shape(p)):<32} {r['tokens_per_ms']:.4f} tok/ms", flush=True)
    return runs


def validation_rows(configs: list, runs: dict, cal, model: str, T: int) -> list:
    """Per configuration: the median of its runs' tokens/ms against the model's prediction."""
    rows = []
    for c in configs:
        B, part = c
        n, k, s, R = shape(part)
        p = predict(model, B, T, part, calibration=cal, ranks_per_node=R)
        speeds = [r["tokens_per_ms"] for r in runs[c]]
        m = statistics.median(speeds)
        rows.append(dict(B=B, workers=n, cores_per_worker=k, sub_batches=s, ranks=R, measured=m,
                         predicted=p.tokens_per_ms, error=p.tokens_per_ms / m - 1,
                         runs=" ".join(f"{x:.4f}" for x in speeds)))
    return rows


def print_table(rows: list) -> None:
    errors = [abs(r["error"]) for r in rows]
    print("\n| B | partition | measured tok/ms | predicted | error |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['B']} | {label(r['workers'], r['cores_per_worker'], r['sub_batches'], r['ranks'])} | "
              f"{r['measured']:.4f} | {r['predicted']:.4f} | {r['error']:+.1%} |")
    print(f"\nabsolute error over {len(rows)} configurations: median {statistics.median(errors):.1%},"
          f" largest {max(errors):.1%}")


def autotuner_rows(batches: list, rows: list, cal, model: str, T: int) -> list:
    """Per B: the autotuner's choice (a fresh cache, its own trials) against the best measured
    partition of the sweep."""
    print("\n| B | autotuner's choice | its measured tok/ms | best measured | gap |\n"
          "|---|---|---|---|---|")
    cache = os.path.join(tempfile.mkdtemp(prefix="starpu-llm-autotune-"), "autotune.json")
    out = []
    for B in batches:
        trials = []
        ch = autotune.choose(model, B, T, cal, cache=cache, log=trials.append).partition
        ranking = autotune.rank(model, B, T, cal)
        mine = next(r for r in rows if (r["B"], r["workers"], r["cores_per_worker"], r["sub_batches"],
                                        r["ranks"]) == (B, *shape(ch)))
        best = max((r for r in rows if r["B"] == B and r["ranks"] == 1), key=lambda r: r["measured"])
        gap = 1 - mine["measured"] / best["measured"]
        out.append(dict(B=B, choice=label(*shape(ch)),
                        choice_predicted=mine["predicted"], choice_measured=mine["measured"],
                        best=label(best["workers"], best["cores_per_worker"], best["sub_batches"], 1),
                        best_measured=best["measured"], gap=gap,
                        ranking=" > ".join(f"{label(*shape(p.partition))} "
                                           f"{p.tokens_per_ms:.4f}" for p in ranking),
                        trials=" | ".join(trials)))
        print(f"| {B} | {out[-1]['choice']} | {mine['measured']:.4f} | {out[-1]['best']}: "
              f"{best['measured']:.4f} | {gap:.1%} |", flush=True)
    print(f"\nautotuner: largest gap to the best measured partition "
          f"{max(r['gap'] for r in out):.1%}")
    return out


def write_results(folder: str, runs: dict, rows: list, choices: list | None, machine: dict,
                  cal_path: str, cal, args, argv) -> None:
    """The raw files of a validation run (the module doc lists them), each written atomically."""
    os.makedirs(folder, exist_ok=True)
    write_csv(os.path.join(folder, "runs.csv"), [
        dict(B=B, workers=p.workers, cores_per_worker=p.cores_per_worker,
             sub_batches=p.sub_batches, ranks=p.ranks, repeat=i + 1,
             tokens_per_ms=r["tokens_per_ms"], step_ms=" ".join(f"{x:.2f}" for x in r["step_ms"]))
        for (B, p), rs in runs.items() for i, r in enumerate(rs)])
    write_csv(os.path.join(folder, "validation.csv"), rows)
    if choices is not None:
        write_csv(os.path.join(folder, "autotune.csv"), choices)
    with open(cal_path, encoding="utf-8") as f:
        atomic_write_text(os.path.join(folder, "calibration.toml"), f.read())
    about = dict(machine, dirty=not reusable(machine["commit"]),
                 calibration=dict(path=cal_path, source=cal.source, task_us=cal.task_us,
                                  step_ms=cal.step_ms),
                 model=args.model, seq_len=args.seq_len, steps=args.steps, repeat=args.repeat,
                 command="experiments/perfmodel_validation.py " + " ".join(argv or sys.argv[1:]),
                 when=datetime.datetime.now().isoformat(timespec="seconds"))
    atomic_write_text(os.path.join(folder, "machine.json"), json.dumps(about, indent=1) + "\n")
    print(f"wrote runs.csv, validation.csv{', autotune.csv' if choices is not None else ''}, "
          f"machine.json and calibration.toml in {folder}")

if __name__ == "__main__":
    sys.exit(main())
