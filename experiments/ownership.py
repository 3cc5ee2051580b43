"""Who owns the parameters under mpirun, measured (issue 21, item 5): tokens/ms, bytes each rank
sends and receives per step (StarPU-MPI's own counters) and each rank's peak RSS, for every
ownership mode on R ranks of one core each, beside one process on 1 core and on R cores.

Every configuration runs once per round, rounds interleaved (a slow phase of a shared machine
hits all alike); the summary takes each configuration's median round. A second part runs the
sharded mode at R = 2, 3, 4 (oversubscribed: bytes only, the times mean nothing there) to
compare the largest rank's traffic with the 2 (R-1)/R x model-bytes optimum. Writes
runs.csv (every run), summary.csv, summary.md and machine.json into --out.

A mode's suffix -wteN runs it with wte in N row blocks instead of the placement's (its
Topology reads placement.WTE_BLOCKS_ENV): sharded-wte1 is sharded with wte whole, as before
it was split; --bytes-modes measures the bytes of several.

    .venv/bin/python experiments/ownership.py                      # ~25 min on 2 cores
    .venv/bin/python experiments/ownership.py --batches 8 --repeat 1 --steps 3   # a trial
    .venv/bin/python experiments/ownership.py --modes sharded,sharded-wte1 --transports default \
        --single '' --bytes-modes sharded,sharded-wte1 --out .../wte-blocks   # wte blocked or not
"""
from __future__ import annotations

import argparse
import json
import os
import re
import time

from provenance import cpu_kind, machine_info
from starpu_llm.model.config import MODELS
from starpu_llm.plan.sites import default_micro_batches
from starpu_llm.plan.topology import WTE_BLOCKS_ENV
from starpu_llm.perf.runs import run_in_subprocess, write_csv

HERE = os.path.dirname(os.path.abspath(__file__))


def configurations(modes, R, transports, polls=("backoff",)):
    """(label, spec fields) of each configuration run at every batch. polls: how StarPU-MPI's
    progression thread waits (runtime.mpi.mpi_polling; "spin" labelled, the default not)."""
    out = [("1 process 1x1", dict(workers=1, cores_per_worker=1, cpus=1)),
           (f"1 process 1x{R}", dict(workers=1, cores_per_worker=R, kcore="team", cpus=R))
           ]
    for poll in polls:
        for transport in transports:
            args = ["--mca", "btl", "self,tcp"] if transport == "tcp" else []
            if poll != "backoff":
                args += ["-x", f"STARPU_LLM_MPI_POLL={poll}"]
            suffix = (" tcp" if transport == "tcp" else "") + ("" if poll == "backoff" else f" {poll}")
            for mode in modes:
                fields = dict(workers=1, cores_per_worker=1, cpus=R, ranks=R, mpirun_args=args)
                fields.update(mode_fields(mode))
                out.append((f"{R} ranks {mode}{suffix}", fields))
    return out


def baseline_configurations(modes, R, python):
    """(label, spec fields) of each mode run by another installation's interpreter (python:
    e.g. a build of main's code), labelled "... (baseline)"."""
    return [(f"{R} ranks {mode} (baseline)", dict(workers=1, cores_per_worker=1, cpus=R, ranks=R,
                                                  python=python, **mode_fields(mode)))
            for mode in modes]


def mode_fields(mode: str) -> dict:
    """The run-spec fields of an ownership mode: rank0, sharded, or pipeline<S>[-<schedule>]
    (pipeline2-gpipe: 2 stages, --pipeline-schedule gpipe; default eager), each with an optional
    -wteN (wte in N row blocks: "env", the run's environment) and -mbN (N sub-batches per
    copy, a pipeline's micro-batches; default sites.default_micro_batches)."""
    opts = dict(re.findall(r"-(wte|mb)(\d+)", mode))
    mode = re.sub(r"-(wte|mb)\d+", "", mode)
    extra = {"env": dict(os.environ, **{WTE_BLOCKS_ENV: opts["wte"]})} if "wte" in opts else {}
    if "mb" in opts:
        extra["sub_batches"] = int(opts["mb"])
    if mode.startswith("pipeline"):
        stages, _, schedule = mode[len("pipeline"):].partition("-")
        return dict(ownership="sharded", pipeline_stages=int(stages or 2),
                    pipeline_schedule=schedule or None, **extra)
    return dict(ownership=mode, **extra)


def run(spec: dict) -> dict:
    """One configuration in its own process(es), with its own environment and interpreter
    if it has them."""
    spec = dict(spec)
    env, python = spec.pop("env", None), spec.pop("python", None)
    return run_in_subprocess(spec, env=env, python=python)


def row_of(label, B, rnd, r, model_bytes):
    """One run's CSV row: its configuration in experiments/ownership_validation.py's columns
    (mode, ranks, stages, workers, cores_per_worker, sub_batches), then what was measured."""
    ranks = int(r.get("ranks") or 1)
    stages = int(r.get("pipeline_stages") or 1)
    mode = "" if ranks == 1 else "pipeline" if stages > 1 else r.get("ownership") or "sharded"
    schedule = ("" if stages == 1 else "baseline" if label.endswith("(baseline)")
                else r.get("pipeline_schedule") or "eager")
    micro = r.get("sub_batches") or (default_micro_batches(B // (ranks // stages), stages, 1)
                                     if stages > 1 else 1)
    row = dict(config=label, model=r["model"], seq_len=r["seq_len"], batch=B, round=rnd,
               mode=mode, schedule=schedule, ranks=ranks, stages=stages,
               wte_blocks=int(m.group(1)) if (m := re.search(r"wte in (\d+) row blocks",
                                                             r.get("describe", ""))) else 1,
               workers=r["workers"], cores_per_worker=r["cores_per_worker"], sub_batches=micro,
               transport=("tcp" if "self,tcp" in r.get("mpirun_args", []) else "default"
                          if ranks > 1 else ""),
               mpi_poll=(next((a.split("=")[1] for a in r.get("mpirun_args", [])
                               if a.startswith("STARPU_LLM_MPI_POLL=")), "backoff")
                         if ranks > 1 else ""),
               tokens_per_ms=round(r["tokens_per_ms"], 5),
               ms_per_step=round(sum(r["step_ms"]) / len(r["step_ms"]), 1),
               peak_rss_mb=round(r["peak_rss_mb"]))
    if r.get("rank_peak_rss_mb"):
        row["rank_peak_rss_mb"] = " ".join(str(round(x)) for x in r["rank_peak_rss_mb"])
    if r.get("traffic"):
        sent = [s for s, _ in r["traffic"]]
        recv = [v for _, v in r["traffic"]]
        row.update(sent_mb=" ".join(f"{s / 1e6:.1f}" for s in sent),
                   received_mb=" ".join(f"{v / 1e6:.1f}" for v in recv),
                   largest_traffic_model_bytes=round(max(max(sent), max(recv)) / model_bytes, 4))
    return row


def uniform(rows):
    """rows with the same columns (the union, in order of appearance; '' where missing)."""
    cols = list(dict.fromkeys(k for r in rows for k in r))
    return [{k: r.get(k, "") for k in cols} for r in rows]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="d12")
    ap.add_argument("--batches", default="8,16")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10, help="timed steps (one warm-up before)")
    ap.add_argument("--repeat", type=int, default=2, help="interleaved rounds")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--modes", default="rank0,sharded")
    ap.add_argument("--transports", default="default,tcp",
                    help="default (Open MPI's choice: shared memory) and/or tcp (--mca btl "
                         "self,tcp on the loopback, as between nodes)")
    ap.add_argument("--polls", default="backoff",
                    help="how StarPU-MPI's thread waits: backoff (the default where it shares "
                         "a worker's core) and/or spin (StarPU's own polling), e.g. spin,backoff")
    ap.add_argument("--bytes-ranks", default="2,3,4",
                    help="R of the oversubscribed sharded runs that measure bytes only ('' none)")
    ap.add_argument("--baseline-python", default=None,
                    help="also run --baseline-modes with this interpreter (another venv: e.g. "
                         "main's code), labelled (baseline), interleaved with the others")
    ap.add_argument("--baseline-modes", default="pipeline2")
    ap.add_argument("--single", default="1x1,1xR",
                    help="the one-process runs: 1x1 and/or 1xR ('' none)")
    ap.add_argument("--single-sub-batches", type=int, default=0,
                    help="also one process 1x1 with this many sub-batches (a pipeline's "
                         "micro-batches: what splitting the batch costs on one core)")
    ap.add_argument("--bytes-modes", default="sharded",
                    help="the modes of those runs (sharded, sharded-wteN)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "ownership", cpu_kind()))
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    config = MODELS[args.model]
    model_bytes = 4 * config.num_parameters
    batches = [int(b) for b in args.batches.split(",")]
    confs = configurations(args.modes.split(","), args.ranks, args.transports.split(","),
                           args.polls.split(","))
    singles = {"1x1": "1 process 1x1", "1xR": f"1 process 1x{args.ranks}"}
    keep = {singles[x] for x in args.single.split(",") if x}
    confs = [c for c in confs if c[1].get("ranks") or c[0] in keep]
    if args.single_sub_batches:
        confs.insert(0, (f"1 process 1x1 {args.single_sub_batches} sub-batches",
                         dict(workers=1, cores_per_worker=1, cpus=1,
                              sub_batches=args.single_sub_batches)))
    if args.baseline_python:
        confs += baseline_configurations(args.baseline_modes.split(","), args.ranks,
                                         args.baseline_python)
    base = dict(engine="starpu", model=args.model, seq_len=args.seq_len, steps=args.steps)
    rows, t0 = [], time.time()
    for rnd in range(args.repeat):
        for B in batches:
            for label, fields in confs:
                r = run(dict(base, batch=B, **fields))
                if "error" in r:
                    print(f"B={B} {label}: failed: {r['error']}", flush=True)
                    continue
                rows.append(dict(row_of(label, B, rnd, r, model_bytes),
                                 loadavg_1m=round(os.getloadavg()[0], 2)))   # others' load too
                print(json.dumps(rows[-1]), flush=True)
    for R in [int(x) for x in args.bytes_ranks.split(",") if x]:
        for mode in args.bytes_modes.split(","):
            # bytes only: oversubscribed, 2 timed steps, one sequence per rank
            r = run(dict(base, batch=R, steps=2, workers=1, cores_per_worker=1, ranks=R,
                         oversubscribe=True, **mode_fields(mode)))
            if "error" in r:
                print(f"bytes at R={R} {mode}: failed: {r['error']}", flush=True)
                continue
            row = row_of(f"{R} ranks {mode} (bytes only)", R, 0, r, model_bytes)
            row["optimum_model_bytes"] = round(2 * (R - 1) / R, 4)
            rows.append(row)
            print(json.dumps(row), flush=True)
    rows = uniform(rows)
    write_csv(os.path.join(args.out, "runs.csv"), rows)
    summary = uniform(summarize(rows))
    write_csv(os.path.join(args.out, "summary.csv"), summary)
    info = dict(machine_info(), minutes=round((time.time() - t0) / 60, 1), argv=argv or [],
                model_bytes=model_bytes)
    with open(os.path.join(args.out, "machine.json"), "w") as f:
        json.dump(info, f, indent=1)
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(markdown(summary, info))
    print(markdown(summary, info))


def summarize(rows):
    """Each (config, batch)'s median round, with its ratio to the same batch's rank0 run."""
    out = []
    keys = sorted({(r["batch"], r["config"]) for r in rows}, key=lambda k: (k[0], k[1]))
    for B, label in keys:
        runs = sorted((r for r in rows if r["batch"] == B and r["config"] == label),
                      key=lambda r: r["tokens_per_ms"])
        med = dict(runs[len(runs) // 2])
        med["rounds"] = " ".join(f"{r['tokens_per_ms']:.4f}" for r in runs)
        med.pop("round")
        out.append(med)
    for r in out:
        parts = r["config"].removesuffix(" (baseline)").split(" ", 3)  # "R ranks MODE [tcp] [spin]"
        suffix = parts[3] if " ranks " in r["config"] and len(parts) > 3 else ""
        ref = next((x for x in out if x["batch"] == r["batch"]
                    and x["config"].endswith("ranks rank0" + (f" {suffix}" if suffix else ""))), None)
        r["vs_rank0"] = round(r["tokens_per_ms"] / ref["tokens_per_ms"], 3) if ref and "ranks" in r["config"] else ""
    return out


def markdown(summary, info) -> str:
    lines = [f"# Ownership modes measured ({info['cpu_model']}, {info['cores']} cores, "
             f"StarPU {info['starpu_version']}, commit {info['commit']})", "",
             f"Model bytes: {info['model_bytes'] / 1e6:.1f} MB. Median of the rounds "
             "(all rounds in the last column).", "",
             "| B | configuration | wte blocks | tok/ms | vs rank0 | ms/step | peak RSS per rank (MB) | "
             "sent per rank (MB/step) | received per rank (MB/step) | largest / model bytes | rounds |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary:
        lines.append(f"| {r['batch']} | {r['config']} | {r['wte_blocks']} | {r['tokens_per_ms']:.4f} | {r['vs_rank0']} | "
                     f"{r['ms_per_step']} | {r.get('rank_peak_rss_mb') or r['peak_rss_mb']} | "
                     f"{r.get('sent_mb', '')} | {r.get('received_mb', '')} | "
                     f"{r.get('largest_traffic_model_bytes', '')}"
                     + (f" (optimum {r['optimum_model_bytes']})" if r.get("optimum_model_bytes", "") != "" else "")
                     + f" | {r['rounds']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
