"""The performance model against measured runs of the ownership modes (issue 21, item 6):
predicted against measured tokens/ms for every configuration of a CSV of runs, and the error.

The CSV (e.g. experiments/results/ownership/runs.csv) has one row per run, with columns
  mode              rank0, sharded, or pipeline (then `stages`, default: ranks); for one process
                    any value (or empty)
  ranks             MPI processes, all on this machine
  batch             the total batch B
  tokens_per_ms     the run's measured speed
and optionally workers, cores_per_worker (default 1 x 1 per rank), sub_batches (per rank, or per
copy in a pipeline; default one per worker), seq_len (64), model (d12), stages, transport;
other columns are ignored. Runs over another transport than Open MPI's default (transport
`tcp`, experiments/ownership.py's loopback runs) are left out and counted: the calibration's
link is fitted over the default one (calibrate.fit_link). Pipeline runs of another schedule
than the default, eager (a `schedule` column naming 1f1b, bounded, gpipe or a baseline), are
left out and counted too: the model's list scheduler starts every task as soon as it can,
which is what eager's forwards first comes to on this route. Runs of the same configuration
(repeats) are put together: their median is compared. The prediction uses this machine's
calibration (or --calibration).

    .venv/bin/python experiments/ownership_validation.py experiments/results/ownership/runs.csv \\
        [--calibration FILE] [--csv predictions.csv]
"""
from __future__ import annotations

import argparse
import csv
import statistics
import sys

from starpu_llm.errors import StarpuLLMError
from starpu_llm.plan.topology import OWNERSHIPS
from starpu_llm.plan.partition import PartitionRequest
from starpu_llm.perf.predict import layout_label, load_calibration, predict, target_partition
from starpu_llm.perf.runs import write_csv

KEY = ("model", "seq_len", "batch", "ranks", "workers", "cores_per_worker", "sub_batches",
       "mode", "stages")


def configuration(row: dict, where: str) -> tuple:
    """The configuration of one CSV row, as KEY's values, defaults filled in."""
    def number(name, default):
        text = (row.get(name) or "").strip()
        try:
            return int(text) if text else default
        except ValueError:
            raise StarpuLLMError(f"{where}: column {name} must be a whole number, got {text!r}")
    ranks, workers = number("ranks", 1), number("workers", 1)
    mode = (row.get("mode") or "").strip()
    stages = number("stages", ranks if mode == "pipeline" else 1)
    if ranks == 1:
        mode, stages = "sharded", 1
    elif mode == "pipeline":
        mode = "sharded"
    elif mode not in OWNERSHIPS:
        raise StarpuLLMError(f"{where}: mode {mode!r}: expected one of "
                             f"{', '.join(OWNERSHIPS + ('pipeline',))}")
    return ((row.get("model") or "d12").strip(), number("seq_len", 64), number("batch", 0), ranks,
            workers, number("cores_per_worker", 1), number("sub_batches", workers), mode, stages)


def other_transport(row: dict) -> bool:
    """Whether the run went over another transport than Open MPI's default."""
    return (row.get("transport") or "default").strip() not in ("default", "")


def other_schedule(row: dict) -> bool:
    """Whether the run is a pipeline's under another schedule than the default, eager."""
    return (row.get("schedule") or "eager").strip() not in ("eager", "")


def compare(rows: list, calibration=None) -> list:
    """One dict per configuration of rows (CSV rows as dicts), in order of first appearance:
    its KEY values, runs, measured (median tokens/ms), predicted, error (predicted / measured
    - 1), and the predicted bytes per rank (largest sent and received, MB)."""
    calibration = calibration or load_calibration()
    measured = {}
    for i, row in enumerate(rows):
        where = f"row {i + 2}"                  # the header is line 1
        if other_transport(row) or other_schedule(row):
            continue
        try:
            speed = float(row["tokens_per_ms"])
        except (KeyError, TypeError, ValueError):
            raise StarpuLLMError(f"{where}: no tokens_per_ms number")
        measured.setdefault(configuration(row, where), []).append(speed)
    out = []
    for key, speeds in measured.items():
        c = dict(zip(KEY, key))
        partition = target_partition(PartitionRequest(
            workers=c["workers"], cores_per_worker=c["cores_per_worker"],
            sub_batches=c["sub_batches"], ownership=c["mode"], pipeline_stages=c["stages"]),
            c["ranks"], c["batch"])
        p = predict(c["model"], c["batch"], c["seq_len"], partition, calibration=calibration,
                    ranks_per_node=c["ranks"])
        m = statistics.median(speeds)
        out.append(dict(c, label=layout_label(p.partition), runs=len(speeds), measured=m,
                        predicted=p.tokens_per_ms, error=p.tokens_per_ms / m - 1,
                        sent_mb=max(p.schedule.sent) / 1e6, received_mb=max(p.schedule.received) / 1e6))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", help="CSV of measured runs (see above for its columns)")
    ap.add_argument("--calibration", help="this machine's calibration (default: its file)")
    ap.add_argument("--csv", help="also write the comparison as CSV")
    args = ap.parse_args(argv)
    try:
        calibration = load_calibration(args.calibration)
    except StarpuLLMError as e:
        print(e, file=sys.stderr)
        return 2
    try:
        with open(args.runs, newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
        result = compare(rows, calibration)
    except OSError as e:
        print(f"{args.runs}: cannot read it ({e.strerror})", file=sys.stderr)
        return 2
    except StarpuLLMError as e:
        print(f"{args.runs}: {e}", file=sys.stderr)
        return 2
    print("| B | ranks | partition | mode | runs | measured tok/ms | predicted | error | "
          "predicted MB sent / received per rank (largest) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in result:
        print(f"| {r['batch']} | {r['ranks']} | {r['workers']}x{r['cores_per_worker']} | {r['label']} "
              f"| {r['runs']} | {r['measured']:.4f} | {r['predicted']:.4f} | {r['error']:+.1%} "
              f"| {r['sent_mb']:.0f} / {r['received_mb']:.0f} |")
    other = sum(map(other_transport, rows))
    if other:
        print(f"\n{other} runs over another transport than the default left out (the link "
              "is calibrated over the default)")
    other = sum(other_schedule(r) and not other_transport(r) for r in rows)
    if other:
        print(f"\n{other} pipeline runs under another schedule than eager left out (the model "
              "replays eager's)")
    errors = sorted(abs(r["error"]) for r in result)
    if errors:
        print(f"\nabsolute error: median {statistics.median(errors):.1%}, largest {errors[-1]:.1%}")
    if args.csv:
        write_csv(args.csv, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
