"""Models bigger than this machine's memory, trained under --memory-limit (issue 22, item 4):
GPT-2 XL (d48, 1558M: 24.9 GB of parameters, gradients and AdamW moments) under a 16 GiB cap
on a 24 GiB machine, and GPT-2 774M (d36) under half its uncapped footprint. Each model: a
run of --steps steps from a fresh init that saves a checkpoint at its end, then a run resumed
from that checkpoint for one more step: the losses must be finite and fall (checks: each
later training loss below the first, below the one before, and the validation loss on the
same fixed batch after every step falling; the training losses are each on a new batch),
the resume must continue the run (step, data position), and the peak RSS, here
sampled from /proc every 50 ms (VmRSS, and VmHWM, the kernel's peak), stays under the cap
plus offload.RSS_OVERHEAD. Both runs are the documented command line:

    starpu-llm train --model d48 --batch 1 --seq-len 64 --steps 3 --memory-limit 16G \\
        --save-every 3 --checkpoint-dir CK --metrics-jsonl M     # then --resume CK --steps 4

Writes, per model, the two runs' metrics (one JSON object per step: loss, time, bytes read
from and written to the disk), their logs and a summary (summary.json, summary.md) into
--out. A run starts only when the machine has its cap plus 1 GiB available.

    .venv/bin/python experiments/offload_xl.py                     # ~1-2 h here (disk-bound)
    .venv/bin/python experiments/offload_xl.py --models d36
    .venv/bin/python experiments/offload_xl.py --models d48 --caps d48=12G   # a lower cap
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

from offload_bench import GIB, start, wait_for_memory
from starpu_llm.model.config import MODELS
from starpu_llm.flow.memory import step_needs
from starpu_llm.perf.runs import run_sampling_rss
from starpu_llm.runtime.offload import RSS_OVERHEAD, parse_size

CAPS = {"d48": "16G", "d36": None}       # None: half the uncapped footprint


def sampled_run(cmd, log_path):
    """Run cmd (output to log_path), sampling its RSS every 50 ms: (exit status, peak RSS
    bytes, seconds)."""
    t0 = time.monotonic()
    with open(log_path, "w") as out:
        status, peak = run_sampling_rss(cmd, out, subprocess.STDOUT, every=0.05)
    return status, peak, time.monotonic() - t0


def run_model(model, args, out, log):
    config = MODELS[model]
    needs = step_needs(config, args.batch, args.seq_len)
    cap = parse_size(args.caps.get(model) or CAPS.get(model) or f"{needs.footprint // 2 >> 20}M")
    limit = f"{cap >> 20}M"
    log(f"{model}: {config.num_parameters:,} parameters, {needs.footprint / GIB:.1f} GiB of "
        f"tensors at B={args.batch} T={args.seq_len}; --memory-limit {limit}")
    ck = os.path.join(args.offload_dir, f"starpu-llm-{model}-checkpoints")
    base = [sys.executable, "-m", "starpu_llm", "train", "--model", model, "--batch",
            str(args.batch), "--seq-len", str(args.seq_len), "--lr", str(args.lr),
            "--memory-limit", limit, "--offload-dir", args.offload_dir,
            "--checkpoint-dir", ck, "--keep-checkpoints", "1"]
    if args.val_batches:     # the loss on the same fixed batches after every step
        base += ["--val-every", "1", "--val-batches", str(args.val_batches)]
    runs = {}
    for name, extra, steps in (("fresh", ["--save-every", str(args.steps)], args.steps),
                               ("resumed", ["--resume", ck], args.steps + 1)):
        if not wait_for_memory(cap + GIB, args.wait_minutes, log):
            raise SystemExit(f"{model} {name}: {(cap + GIB) / GIB:.1f} GiB never available")
        metrics = os.path.join(out, f"{model}_{name}.jsonl")
        status, peak, seconds = sampled_run(base + extra + ["--steps", str(steps),
                                                            "--metrics-jsonl", metrics],
                                            os.path.join(out, f"{model}_{name}.log"))
        rows = [json.loads(line) for line in open(metrics)] if os.path.exists(metrics) else []
        # the steps' rows; a fresh run's row of step 0 (its initial validation) has no step's
        runs[name] = dict(status=status, peak_rss_mb=round(peak / 2**20), seconds=round(seconds),
                          steps=[r for r in rows if "loss" in r],
                          val0=next((r["val_loss"] for r in rows if "loss" not in r), None))
        log(f"  {name}: status {status}, peak RSS {peak / GIB:.2f} GiB, {seconds:.0f} s, "
            + ", ".join(f"step {r['step']} loss {r['loss']:.4f} "
                        + (f"val {r['val_loss']:.4f} " if "val_loss" in r else "")
                        + f"{r['ms'] / 1e3:.0f} s "
                        f"read {r['disk_read_mb'] / 1e3:.1f} GB written "
                        f"{r['disk_written_mb'] / 1e3:.1f} GB" for r in rows))
        if status != 0:
            break
    fresh = [r["loss"] for r in runs["fresh"]["steps"]]
    every = [r["loss"] for name in ("fresh", "resumed") for r in runs.get(name, {}).get("steps", [])
             if r["step"] > (0 if name == "fresh" else args.steps)]
    val0 = runs["fresh"]["val0"]
    val = ([] if val0 is None else [val0]) + [
        r["val_loss"] for name in ("fresh", "resumed")
        for r in runs.get(name, {}).get("steps", []) if "val_loss" in r]
    checks = dict(
        finite=all(math.isfinite(x) for x in every + val),
        below_first=len(every) > 1 and all(x < every[0] for x in every[1:]),
        monotone=len(every) > 1 and all(b < a for a, b in zip(every, every[1:])),
        val_monotone=(len(val) > 1 and all(b < a for a, b in zip(val, val[1:]))) if val else None,
        resumed_at=(runs.get("resumed", {}).get("steps") or [{}])[0].get("step"),
        rss_under_cap=all(r["peak_rss_mb"] * 2**20 <= cap + RSS_OVERHEAD for r in runs.values()),
        steps_run=len(fresh))
    return dict(model=model, parameters=config.num_parameters, batch=args.batch,
                seq_len=args.seq_len, lr=args.lr, val_batches=args.val_batches,
                footprint_mb=round(needs.footprint / 2**20),
                memory_limit=limit, memory_limit_mb=cap >> 20,
                rss_overhead_mb=RSS_OVERHEAD >> 20, runs=runs, checks=checks)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="d48,d36")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--val-batches", type=int, default=1,
                    help="the loss on these fixed validation batches after every step (each "
                         "step's training loss is on a new batch); 0: none")
    ap.add_argument("--caps", default="", help="model=SIZE,... instead of the defaults (d48: "
                    "16G, d36: half its footprint), e.g. d48=12G on a machine shared with "
                    "other work")
    args, out, log, info = start(ap, wait_minutes=120.0)
    args.caps = dict(c.split("=") for c in args.caps.split(",") if c)
    results = [run_model(m, args, out, log) for m in args.models.split(",")]
    with open(os.path.join(out, "xl_summary.json"), "w") as f:
        json.dump(dict(machine=info, results=results), f, indent=1)
    lines = [f"commit {info['commit']}; {info['mem_total_gib']} GiB of memory; disk "
             f"{info['disk_write_gbs']:.3f} GB/s write, {info['disk_read_gbs']:.3f} GB/s read", "",
             "| model | cap | run | step | loss | val loss | s/step | disk read / written (GB) | "
             "peak RSS (MiB) |", "|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        for name, run in res["runs"].items():
            for r in run["steps"]:
                lines.append(f"| {res['model']} | {res['memory_limit']} | {name} | {r['step']} | "
                             f"{r['loss']:.4f} | {r.get('val_loss', float('nan')):.4f} | "
                             f"{r['ms'] / 1e3:.0f} | "
                             f"{r['disk_read_mb'] / 1e3:.1f} / {r['disk_written_mb'] / 1e3:.1f} | "
                             f"{run['peak_rss_mb']} |")
        lines.append(f"| {res['model']} | checks | {json.dumps(res['checks'])} | | | | | | |")
    with open(os.path.join(out, "xl_summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
