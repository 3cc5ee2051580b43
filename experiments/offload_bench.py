"""Training under a memory budget, measured (issue 22, item 3): GPT-2 124M at T=1024, B=8
without a cap and under caps of 75, 50 and 25 % of its uncapped peak RSS: tokens/ms, peak RSS,
bytes read from and written to the offload disk per step, beside the disk's own sequential
bandwidth (perf/calibrate.measure_disk, in the offload folder).

Each configuration runs in a fresh process (bench.run_one: the trainer itself), one warm-up
step then --steps timed ones. The uncapped run holds the whole footprint in memory (GPT-2
124M at B=8, T=1024: 21.6 GiB of tensors); it runs only when the machine has that much
available (MemAvailable, checked first), else its peak RSS is taken as the footprint plus
offload.RSS_OVERHEAD ("estimated" in the CSV) and the caps are fractions of that. A capped
run starts only when the machine has its cap plus 1 GiB available (it waits up to
--wait-minutes for it). Writes runs.csv, summary.md and machine.json into --out.

    .venv/bin/python experiments/offload_bench.py                  # ~30-60 min here
    .venv/bin/python experiments/offload_bench.py --batch 1 --seq-len 256 --steps 1   # a trial
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from provenance import cpu_kind, machine_info
from starpu_llm.model.config import MODELS
from starpu_llm.flow.memory import step_needs
from starpu_llm.perf.calibrate import measure_disk
from starpu_llm.perf.runs import run_in_subprocess, write_csv
from starpu_llm.runtime.offload import RSS_OVERHEAD

HERE = os.path.dirname(os.path.abspath(__file__))
GIB = 1 << 30


def available_bytes() -> int:
    """MemAvailable of /proc/meminfo."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def wait_for_memory(need: int, minutes: float, log) -> bool:
    """Whether `need` bytes became available within `minutes` (checked every 30 s)."""
    end = time.monotonic() + 60 * minutes
    while available_bytes() < need:
        if time.monotonic() > end:
            return False
        log(f"  waiting: {available_bytes() / GIB:.1f} GiB available, {need / GIB:.1f} needed")
        time.sleep(30)
    return True


def machine_and_disk(folder: str, log) -> dict:
    """provenance.machine_info, the machine's memory, and the sequential bandwidth of the disk
    under folder (perf/calibrate.measure_disk)."""
    info = machine_info()
    disk = measure_disk(folder)
    info.update(offload_dir=folder, disk_write_gbs=round(disk["write_gbs"], 4),
                disk_read_gbs=round(disk["read_gbs"], 4),
                mem_total_gib=round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
                                    / GIB, 1),
                available_gib_at_start=round(available_bytes() / GIB, 1))
    log(f"disk under {folder}: write {disk['write_gbs']:.3f} GB/s, read "
        f"{disk['read_gbs']:.3f} GB/s (sequential, synced / cold)")
    return info


def start(ap, wait_minutes: float):
    """The experiments' common flags (--offload-dir, --wait-minutes, --out) added to ap and
    parsed: (args, the output folder, made, a log function, machine_and_disk's record)."""
    ap.add_argument("--offload-dir", default=tempfile.gettempdir())
    ap.add_argument("--wait-minutes", type=float, default=wait_minutes)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = args.out or os.path.join(HERE, "results", "offload", cpu_kind())
    os.makedirs(out, exist_ok=True)
    log = lambda *a: print(*a, flush=True)      # noqa: E731
    return args, out, log, machine_and_disk(args.offload_dir, log)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="d12")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up")
    ap.add_argument("--fractions", default="0.25,0.5,0.75",
                    help="caps as fractions of the uncapped peak RSS (the largest last: it "
                         "waits longest for memory; '' none)")
    ap.add_argument("--uncapped-margin", type=float, default=None,
                    help="GiB that must be available beyond the uncapped run's estimated peak "
                         "for it to run (default: 10 %% of the estimate)")
    args, out, log, info = start(ap, wait_minutes=60.0)
    if os.path.exists(os.path.join(out, "raw.jsonl")):
        os.unlink(os.path.join(out, "raw.jsonl"))      # this run's results only
    needs = step_needs(MODELS[args.model], args.batch, args.seq_len)
    base = dict(engine="starpu", model=args.model, batch=args.batch, seq_len=args.seq_len,
                steps=args.steps)
    rows = []

    def save(rows):
        """runs.csv (every row with every column) and the raw results so far."""
        cols = list(dict.fromkeys(k for r in rows for k in r))
        write_csv(os.path.join(out, "runs.csv"), [{k: r.get(k, "") for k in cols} for r in rows])

    def record(label, cap, r, estimated=False):
        with open(os.path.join(out, "raw.jsonl"), "a") as f:
            f.write(json.dumps(dict(r, config=label)) + "\n")
        steps = len(r["step_ms"])
        traffic = r.get("disk_traffic") or [(0, 0)] * steps
        row = dict(config=label, model=args.model, batch=args.batch, seq_len=args.seq_len,
                   memory_limit_mb=round(cap / 2**20) if cap else "",
                   tokens_per_ms=round(r["tokens_per_ms"], 5),
                   ms_per_step=round(sum(r["step_ms"]) / steps, 1),
                   peak_rss_mb=round(r["peak_rss_mb"]), peak_rss_estimated=estimated,
                   disk_read_mb_per_step=round(sum(t[0] for t in traffic) / steps / 1e6, 1),
                   disk_written_mb_per_step=round(sum(t[1] for t in traffic) / steps / 1e6, 1),
                   disk_write_gbs=info["disk_write_gbs"], disk_read_gbs=info["disk_read_gbs"],
                   footprint_mb=round(needs.footprint / 2**20), commit=info["commit"],
                   load_average=" ".join(f"{x:.1f}" for x in os.getloadavg()))
        rows.append(row)
        log(json.dumps(row))
        save(rows)

    estimate = needs.footprint + RSS_OVERHEAD
    margin = 0.1 * estimate if args.uncapped_margin is None else args.uncapped_margin * GIB
    if available_bytes() > estimate + margin:
        log(f"uncapped: {needs.footprint / GIB:.1f} GiB of tensors")
        r = run_in_subprocess(dict(base))
        if "error" in r:
            raise SystemExit(f"the uncapped run failed: {r['error']}")
        uncapped = r["peak_rss_mb"] * 2**20
        record("uncapped", 0, r)
    else:
        uncapped = estimate
        log(f"uncapped: not run ({available_bytes() / GIB:.1f} GiB available for "
            f"{estimate / GIB:.1f} GiB); peak RSS estimated as the footprint + RSS_OVERHEAD")
        rows.append(dict(config="uncapped", model=args.model, batch=args.batch,
                         seq_len=args.seq_len, peak_rss_mb=round(estimate / 2**20),
                         peak_rss_estimated=True, footprint_mb=round(needs.footprint / 2**20),
                         commit=info["commit"]))
        save(rows)
    for fraction in (float(x) for x in args.fractions.split(",") if x.strip()):
        cap = int(fraction * uncapped)
        label = f"cap {fraction:.0%}"
        if not wait_for_memory(cap + GIB, args.wait_minutes, log):
            log(f"{label}: skipped, {cap / GIB:.1f} GiB + 1 GiB never available")
            continue
        log(f"{label}: --memory-limit {cap >> 20}M")
        r = run_in_subprocess(dict(base, memory_limit=f"{cap >> 20}M",
                                   offload_dir=args.offload_dir))
        if "error" in r:
            log(f"{label}: failed: {r['error']}")
            continue
        record(label, cap, r)
    with open(os.path.join(out, "machine.json"), "w") as f:
        json.dump(info, f, indent=1)
    summary(rows, info, os.path.join(out, "summary.md"))


def summary(rows, info, path):
    lines = [f"GPT-2 {rows[0]['model']}, B={rows[0]['batch']}, T={rows[0]['seq_len']}; disk "
             f"{info['disk_write_gbs']:.3f} GB/s write, {info['disk_read_gbs']:.3f} GB/s read; "
             f"commit {info['commit']}", "",
             "| run | cap (MiB) | tok/ms | s/step | peak RSS (MiB) | disk read / written per "
             "step (MB) |", "|---|---|---|---|---|---|"]
    for r in rows:
        est = " (estimated)" if r.get("peak_rss_estimated") else ""
        lines.append(f"| {r['config']} | {r.get('memory_limit_mb', '')} | "
                     f"{r.get('tokens_per_ms', '')} | "
                     f"{r['ms_per_step'] / 1e3 if r.get('ms_per_step') else ''} | "
                     f"{r['peak_rss_mb']}{est} | {r.get('disk_read_mb_per_step', '')} / "
                     f"{r.get('disk_written_mb_per_step', '')} |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
