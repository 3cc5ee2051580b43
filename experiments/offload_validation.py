"""The performance model's disk node against the runs of experiments/offload_bench.py (issue
22, item 3): for each run of its runs.csv, predict (perf/predict.py, --memory-limit: StarPU's
eviction replayed over the recorded step, its bytes at the disk's bandwidth) the tokens/ms
and the bytes read and written per step, and compare. The disk's bandwidth is the one the
benchmark measured beside its runs (machine.json; --disk calibration: the calibration's
own), the compute the machine's calibration (starpu-llm calibrate; --calibration FILE).
Writes validation.csv and validation.md beside runs.csv (validation-calibration-disk.* with
--disk calibration).

    .venv/bin/python experiments/offload_validation.py [--results DIR] [--calibration FILE]
"""
from __future__ import annotations

import argparse
import csv
import json
import os
from dataclasses import replace

from provenance import cpu_kind
from starpu_llm.plan.partition import PartitionRequest
from starpu_llm.perf.predict import load_calibration, predict, target_partition
from starpu_llm.perf.runs import write_csv
from starpu_llm.runtime.offload import parse_size
from starpu_llm.runtime.starpu import usable_cores

HERE = os.path.dirname(os.path.abspath(__file__))


def error(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured if measured else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default=os.path.join(HERE, "results", "offload", cpu_kind()))
    ap.add_argument("--calibration", default=None)
    ap.add_argument("--disk", choices=("beside", "calibration"), default="beside",
                    help="the disk's bandwidth: as measured beside each run (default) or the "
                         "calibration's own (writes validation-calibration-disk.csv/.md)")
    args = ap.parse_args()
    calibration = load_calibration(args.calibration)
    with open(os.path.join(args.results, "runs.csv")) as f:
        runs = [r for r in csv.DictReader(f) if r.get("tokens_per_ms")]
    with open(os.path.join(args.results, "machine.json")) as f:
        info = json.load(f)
    rows = []
    for r in runs:
        # the disk as measured beside this run (its row), else beside the benchmark; or the
        # calibration's own
        disk = {k: float(r.get(k) or info[k]) if args.disk == "beside" else getattr(calibration, k)
                for k in ("disk_write_gbs", "disk_read_gbs")}
        limit = parse_size(f"{r['memory_limit_mb']}M") if r["memory_limit_mb"] else None
        p = predict(r["model"], int(r["batch"]), int(r["seq_len"]), target_partition(
            PartitionRequest(workers=1, cores_per_worker=usable_cores()), batch=int(r["batch"])),
                    calibration=replace(calibration, **disk), memory_limit=limit)
        notes = p.schedule.notes
        row = dict(config=r["config"], memory_limit_mb=r["memory_limit_mb"], **disk,
                   measured_tokens_per_ms=float(r["tokens_per_ms"]),
                   predicted_tokens_per_ms=round(p.tokens_per_ms, 5),
                   tokens_per_ms_error=round(error(p.tokens_per_ms, float(r["tokens_per_ms"])), 4),
                   measured_read_mb=float(r["disk_read_mb_per_step"]),
                   predicted_read_mb=round(notes.get("disk_read", 0) / 1e6, 1),
                   measured_written_mb=float(r["disk_written_mb_per_step"]),
                   predicted_written_mb=round(notes.get("disk_written", 0) / 1e6, 1))
        row["read_error"] = round(error(row["predicted_read_mb"], row["measured_read_mb"]), 4)
        row["written_error"] = round(error(row["predicted_written_mb"],
                                           row["measured_written_mb"]), 4)
        rows.append(row)
        print(json.dumps(row), flush=True)
    name = "validation" if args.disk == "beside" else "validation-calibration-disk"
    write_csv(os.path.join(args.results, name + ".csv"), rows)
    disk_from = ("each run's disk bandwidth as measured beside it" if args.disk == "beside"
                 else "the calibration's disk bandwidth")
    lines = [f"calibration: {calibration.source}; {disk_from} (write / read GB/s)", "",
             "| run | disk GB/s | tok/ms measured | predicted | error | read MB measured / "
             "predicted | written MB measured / predicted |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['config']} | {row['disk_write_gbs']} / {row['disk_read_gbs']} | "
                     f"{row['measured_tokens_per_ms']} | "
                     f"{row['predicted_tokens_per_ms']} | {row['tokens_per_ms_error']:+.1%} | "
                     f"{row['measured_read_mb']} / {row['predicted_read_mb']} | "
                     f"{row['measured_written_mb']} / {row['predicted_written_mb']} |")
    with open(os.path.join(args.results, name + ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
