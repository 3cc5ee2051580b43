#!/usr/bin/env python3
"""Regenerate the paper's evaluation figures on this machine: `make figures` (or this script).

    .venv/bin/python experiments/figures.py              # --quick: < 20 min on 2 cores
    .venv/bin/python experiments/figures.py --full       # the paper's settings, for a real node
    .venv/bin/python experiments/figures.py --only fig2a,fig3 --force

Figures (PNG and CSV in --out, PNGs also copied to --png-dir):
  fig1   the task graph of one iteration as the driver submits it (DOT + PNG, Graphviz): the
         small test config, and GPT-2 124M with one node per layer and phase
  fig2a  weak scaling (batch grows with the cores), fig2b strong scaling (fixed batch):
         the reference engine, StarPU 1 x k, StarPU k x 1, PyTorch eager (SDPA)
  fig3   tokens/ms of every n x k partition of the node, for several total batches
  fig4   weak scaling over MPI processes, with the per-iteration cost of the reduction
  trace  a Gantt chart of one training iteration per partition, critical path marked
Every point: tokens/ms over 10 timed steps after one warm-up (the paper's metric), repeated
--repeat times (>= 3), configurations interleaved round-robin; median with min-max bars.

Resumable: every run is appended to OUT/runs.csv with its configuration, the machine and the
git commit; a run already there for the same configuration, machine, commit and repeat is not
run again (--force reruns the selected figures). Only a clean commit's runs are reused: the
script refuses a tree with uncommitted changes, unless --allow-dirty (a smoke test, a trial):
then nothing is reused, every caption says "<commit>-dirty", and docs/figures is not touched. Each run is one subprocess
(starpu_llm.perf.runs.run_in_subprocess), pinned to the cores the point uses.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

from starpu_llm.perf.runs import END_GRACE, run_in_subprocess, write_csv
from starpu_llm.model.config import MODELS
from starpu_llm.perf.machine import default_path, load
from starpu_llm.errors import StarpuLLMError
from starpu_llm.plan.partition import PartitionRequest, resolve, settings_of
from starpu_llm.perf.predict import predict, target_partition
from starpu_llm.plan.partition import Build, partitions_that_fit as build_partitions
from starpu_llm.runtime import partitions_that_fit as partitions_here, resolve_here, usable_cores
from starpu_llm.runtime.cpus import core_cpus

import taskgraph
from provenance import cpu_kind, machine_info, reusable
from series import CONFIG_FIELDS, FIG4_MODES, SERIES, config_key

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FIGURES = ("fig1", "fig2a", "fig2b", "fig3", "fig4", "trace")
# not made by default: llm.c and StarPU 1 x N, N x 1 at more batches on every core
# (--llmc-batches), for the ratio table of experiments/eval16_report.py
EXTRA_FIGURES = ("fig2-llmc",)
NODE_BUILD = None     # --node-cores (a dry run for another node): its StarPU build, as assumed
REPLOT = False        # --replot: draw from the caches only
PAPER_NODE_FILE = os.path.join(HERE, "machines", "paper-node-xeon-gold-6240.toml")


# --------------------------------------------------------------------------- the machine

def write_rows(path, rows):
    """CSV of dict rows with the union of their fields (runs.write_csv: atomic)."""
    fields = list(dict.fromkeys(k for r in rows for k in r))
    write_csv(path, [{k: r.get(k, "") for k in fields} for r in rows])


# --------------------------------------------------------------------------- the plan

def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def settings(args, cores: int) -> dict:
    """The sizes of the two scales. The quick one divides the paper's batches so that the
    whole run fits 20 minutes on 2 cores; the full one is the paper's."""
    core_counts = ([int(c) for c in args.cores.split(",")] if args.cores else divisors(cores))
    if args.full:
        s = dict(scale="full", weak_per_core=6, strong_batch=72,
                 fig3_batches=[cores * m for m in (1, 2, 4, 10)], trace_batch=2 * cores,
                 mpi_batch_per_rank=None, graph_batch=1)
    else:
        s = dict(scale="quick", weak_per_core=1, strong_batch=2,
                 fig3_batches=[cores * m for m in (1, 2)], trace_batch=2 * cores,
                 mpi_batch_per_rank=2, graph_batch=1)
    s.update(core_counts=core_counts, cores=cores, T=args.seq_len, steps=args.steps,
             model=args.model)
    for k in ("weak_per_core", "strong_batch", "trace_batch"):
        if getattr(args, k, None):
            s[k] = getattr(args, k)
    if args.fig3_batches:
        s["fig3_batches"] = [int(b) for b in args.fig3_batches.split(",")]
    # MPI: R ranks, each an N x K partition; on one machine each rank gets cores / max(R), or
    # with --mpi-split cores / R (the node shared by the R ranks), less --mpi-reserve cores left
    # to StarPU-MPI's progression thread (runtime.mpi.pin_rank gives it the rank's last core)
    ranks = [int(r) for r in args.ranks.split(",")]
    if args.mpi_partition:
        mw, mk = (int(x) for x in args.mpi_partition.lower().split("x"))
    elif args.mpi_split:
        mw, mk = 1, cores // max(ranks) - args.mpi_reserve
    else:
        mw, mk = 1, max(1, cores // max(ranks)) if not args.mpirun_args else cores
    s.update(ranks=ranks, mpi_workers=mw, mpi_cores=mk, mpi_split=args.mpi_split,
             mpi_reserve=args.mpi_reserve, mpi_partition_given=bool(args.mpi_partition),
             mpi_batch_per_rank=args.mpi_batch_per_rank or s["mpi_batch_per_rank"] or 6 * mw * mk,
             mpirun_args=args.mpirun_args.split() if args.mpirun_args else [])
    if args.mpi_split and min(cores // R - args.mpi_reserve for R in ranks) < 1:
        raise SystemExit(f"figures.py: --mpi-split --mpi-reserve {args.mpi_reserve}: {cores} cores "
                         f"over {max(ranks)} ranks leave no core to a rank's workers")
    s["series"] = args.series.split(",") if args.series else None
    s["fig3_kcore"] = args.fig3_kcore
    s["llmc_batches"] = [int(b) for b in args.llmc_batches.split(",")] if args.llmc_batches else []
    s["warmup"] = args.warmup
    return s


def mpi_partition(S, R) -> tuple[int, int, int]:
    """(workers, cores per worker, the cores the run may use) of each of R ranks in Figure 4."""
    if not S["mpi_split"]:
        mw, mk = S["mpi_workers"], S["mpi_cores"]
        return mw, mk, R * mw * mk
    per = S["cores"] // R
    mw, mk = ((S["mpi_workers"], S["mpi_cores"]) if S["mpi_partition_given"] else
              (1, per - S["mpi_reserve"]))
    if mw * mk > per:
        raise SystemExit(f"figures.py: --mpi-partition {mw}x{mk} does not fit a rank's {per} cores "
                         f"at R={R}")
    return mw, mk, S["cores"]


def run_settings(p) -> dict:
    """The settings that ask a StarPU run for the partition p again (partition.settings_of),
    the defaults left out: a configuration's key names only what is asked."""
    return {k: v for k, v in settings_of(p).items() if v is not None}


def spec_of(engine, batch, S, cpus, partition=None, threads=None, ranks=None,
            mpirun_args=None) -> dict:
    """A point's run: a StarPU one trains on `partition` (resolved once: partition_of), asked
    for again by its settings (run_settings)."""
    spec = dict(engine=engine, model=S["model"], batch=batch, seq_len=S["T"], steps=S["steps"],
                cpus=cpus)
    if S.get("warmup", 1) > 1:      # --warmup: not part of the configuration's key
        spec["warmup"] = S["warmup"]
    if engine == "starpu":
        spec.update(run_settings(partition))
    else:
        spec["threads"] = threads
    if ranks and ranks > 1:
        spec.update(ranks=ranks, mpirun_args=mpirun_args or [])
        if mpirun_args:        # a cluster: each node's cores are its own
            spec.pop("cpus")
    return spec


def partitions_that_fit(cpus):
    """Every N x K of cpus cores the StarPU build runs: this process's, or with --node-cores
    the node's as assumed (NODE_BUILD: StarPU 1.4 with parallel workers)."""
    return build_partitions(cpus, NODE_BUILD) if NODE_BUILD else partitions_here(cpus)


def partition_of(n, k, kcore, cpus):
    """The partition a StarPU point trains on: N x K (kcore asked) resolved once on its cpus
    cores, on the build the plan assumes (NODE_BUILD with --node-cores, else this process's
    build and $STARPU_SCHED); one that build refuses: a clear exit naming it."""
    req = PartitionRequest(workers=n, cores_per_worker=k, kcore=kcore)
    try:
        return (resolve(req, cores=cpus, build=NODE_BUILD) if NODE_BUILD
                else resolve_here(req, cores=cpus))
    except StarpuLLMError as e:
        raise SystemExit(f"figures.py: the partition {n}x{k} on {cpus} cores: {e}")


def fits(n, k, mode, cpus) -> bool:
    return any((n, k) == (a, b) and (mode == m or k == 1) for a, b, m in partitions_that_fit(cpus))


def plan(S, args, only) -> list[dict]:
    """Every measured point: {figure, series, x, spec}."""
    points = []
    torch_series = ["torch"] + (["torch-readable"] if args.torch_readable else [])
    series = S.get("series") or ["reference", "tensor", "data"] + torch_series
    for fig, batch_of in (("fig2a", lambda k: S["weak_per_core"] * k),
                          ("fig2b", lambda k: S["strong_batch"])):
        if fig not in only:
            continue
        for k in S["core_counts"]:
            B = batch_of(k)
            if "reference" in series:
                points.append(dict(figure=fig, series="reference", x=k,
                                   spec=spec_of("reference", B, S, k, threads=k)))
            if "tensor" in series and fits(1, k, "team", k):
                points.append(dict(figure=fig, series="tensor", x=k,
                                   spec=spec_of("starpu", B, S, k, partition_of(1, k, "team", k))))
            if "data" in series and B % k == 0 and fits(k, 1, "team", k):
                points.append(dict(figure=fig, series="data", x=k,
                                   spec=spec_of("starpu", B, S, k, partition_of(k, 1, "team", k))))
            for t in [t for t in series if t in ("torch", "torch-readable", "llmc")]:
                points.append(dict(figure=fig, series=t, x=k, spec=spec_of(t, B, S, k, threads=k)))
    if "fig3" in only:
        kcores = {"all": ("team", "forkjoin")}.get(S.get("fig3_kcore") or "all",
                                                    (S.get("fig3_kcore"),))
        for B in S["fig3_batches"]:
            for n, k, mode in partitions_that_fit(S["cores"]):
                if k > 1 and mode not in kcores:
                    continue
                if B % n == 0:
                    p = partition_of(n, k, mode, S["cores"])
                    label = f"{n}x{k}" + (" forkjoin" if p.kcore == "forkjoin" else "")
                    points.append(dict(figure="fig3", series=f"B={B}", x=label,
                                       spec=spec_of("starpu", B, S, S["cores"], p)))
    if "fig2-llmc" in only:
        # llm.c and StarPU 1 x N and N x 1 on all N cores at more batches: Figure 2's ratios
        # at the paper's sequences per core too
        N = S["cores"]
        for B in S.get("llmc_batches") or []:
            points.append(dict(figure="fig2-llmc", series="llmc", x=B,
                               spec=spec_of("llmc", B, S, N, threads=N)))
            points.append(dict(figure="fig2-llmc", series="tensor", x=B,
                               spec=spec_of("starpu", B, S, N, partition_of(1, N, "team", N))))
            if B % N == 0:
                points.append(dict(figure="fig2-llmc", series="data", x=B,
                                   spec=spec_of("starpu", B, S, N, partition_of(N, 1, "team", N))))
    if "fig4" in only:
        # one process, then each ownership mode at every R > 1 (a pipeline: a stage per rank)
        for R in S["ranks"]:
            mw, mk, cpus = mpi_partition(S, R)
            # each rank's partition, on the cores its workers use
            p = partition_of(mw, mk, "team", mw * mk)
            for mode, fields in (FIG4_MODES.items() if R > 1 else [("one process", {})]):
                spec = spec_of("starpu", R * S["mpi_batch_per_rank"], S, cpus, p,
                               ranks=R, mpirun_args=S["mpirun_args"])
                spec.update({k: R if v == "R" else v for k, v in fields.items()})
                points.append(dict(figure="fig4", series=mode, x=R, spec=spec))
    return points


def predicted_fig4(S, machine_file, calibration_file, log) -> list[dict]:
    """Figure 4's prediction for the paper's node (perf/predict.py, the task graph replayed on
    machine_file's description with this machine's calibrated codelet ratios): per-node
    tokens/ms of each mode at 1 to 16 nodes, 4 workers x 8 cores and 72 sequences per node;
    [] without a calibration."""
    if not calibration_file:
        log("  fig4: no calibration of this machine (starpu-llm calibrate, or "
            "experiments/results/perfmodel/<cpu kind>/calibration.toml): no predicted panel")
        return []
    calibration, target = load(calibration_file), load(machine_file)
    rows = []
    for R in (1, 2, 4, 8, 16):
        layouts = ([("one process", ("sharded", 1))] if R == 1 else
                   [("rank0", ("rank0", 1)), ("sharded", ("sharded", 1)),
                    (f"pipeline 2 stages x {R // 2}", ("sharded", 2))])
        for label, (ownership, stages) in layouts:
            p = predict(S["model"], 72 * R, S["T"], target_partition(
                PartitionRequest(workers=4, cores_per_worker=8, ownership=ownership,
                                 pipeline_stages=stages), R, 72 * R, parallel_workers=True),
                calibration=calibration, machine=target)
            rows.append(dict(figure="fig4-predicted", series=label.split(" x ")[0], x=R,
                             mode=label, tokens_per_ms=round(p.tokens_per_ms, 5),
                             tokens_per_ms_per_node=round(p.tokens_per_ms / R, 5),
                             ms_per_step=round(p.schedule.step_s * 1e3, 1),
                             max_sent_mb=round(max(p.schedule.sent) / 1e6, 1) if R > 1 else 0,
                             machine=target.name, calibration=calibration_file))
    one = rows[0]["tokens_per_ms_per_node"]
    for r in rows:
        r["efficiency"] = round(r["tokens_per_ms_per_node"] / one, 4)
    log("  fig4 predicted for the paper's node, per-node efficiency at 16 nodes: " + ", ".join(
        f"{r['mode']} {r['efficiency']:.0%}" for r in rows if r["x"] == 16))
    return rows


def calibration_file() -> str | None:
    """This machine's calibration (starpu-llm calibrate), else the committed one of its CPU
    kind (make perfmodel's), else None."""
    for path in (default_path(), os.path.join(HERE, "results", "perfmodel", cpu_kind(),
                                              "calibration.toml")):
        if os.path.exists(path):
            return path
    return None


# ----------------------------------------------------------------- a node lent for minutes
# --calibration: every StarPU point predicted (starpu-llm predict's model, that calibration)
# before any is measured; --point-seconds: each point's timed steps sized from its predicted
# step; --deadline: no run started that its estimate says ends after it. docs/figures.md,
# "Figures on a node lent for minutes".

WARMUP_STEPS = 1.5      # a run's first step (allocations, first touch) in steps, for estimates


def pred_key(spec) -> str:
    """A configuration's key without its number of steps (a prediction is per step)."""
    return config_key(dict(spec, steps=None))


def _predict_one(job):
    """One point's prediction, in a worker process: job = (config key, spec, calibration
    path); (key, {predicted_tokens_per_ms, predicted_ms_per_step, ...} or {error})."""
    key, spec, cal_path, machine_path = job
    from starpu_llm.plan.partition import PartitionRequest
    from starpu_llm.perf.predict import load_calibration, predict, target_partition
    try:
        R = int(spec.get("ranks") or 1)
        stages = int(spec.get("pipeline_stages") or 1)
        n, k = int(spec["workers"]), int(spec["cores_per_worker"])
        # no sub-batches given: predict takes the engine's default, as the run does
        partition = target_partition(PartitionRequest(
            workers=n, cores_per_worker=k, sub_batches=spec.get("sub_batches"),
            ownership=spec.get("ownership") or "sharded", pipeline_stages=stages), R,
            spec["batch"], parallel_workers=True if machine_path else None)
        p = predict(spec["model"], spec["batch"], spec["seq_len"], partition,
                    calibration=load_calibration(cal_path), ranks_per_node=R,
                    machine=load(machine_path) if machine_path else None)
        return key, dict(predicted_tokens_per_ms=round(p.tokens_per_ms, 5),
                         predicted_ms_per_step=round(p.schedule.step_s * 1e3, 1),
                         predicted_critical_path_ms=round(p.schedule.critical_path_s * 1e3, 1),
                         predicted_sub_batches=p.sub_batches)
    except Exception as e:       # one point's failure is written down, the others go on
        return key, dict(error=f"{type(e).__name__}: {e}")


def _rank_one(job):
    """The autotuner's ranking (perf/autotune.rank: the model alone) of one batch."""
    B, model, T, cal_path = job
    from starpu_llm.perf import autotune
    from starpu_llm.perf.predict import load_calibration
    try:
        ranked = autotune.rank(model, B, T, load_calibration(cal_path))
    except Exception as e:
        return B, [dict(B=B, error=f"{type(e).__name__}: {e}")]
    return B, [dict(B=B, rank=i + 1, workers=p.partition.workers,
                    cores_per_worker=p.partition.cores_per_worker,
                    sub_batches=p.sub_batches, predicted_tokens_per_ms=round(p.tokens_per_ms, 5))
               for i, p in enumerate(ranked)]


def predict_points(points, cal_path, S, out, log, jobs, machine_path=None) -> dict:
    """Every StarPU point predicted from the calibration at cal_path, `jobs` at a time, and
    the autotuner's ranking of each Figure 3 batch: OUT/predictions.csv (a row per point, with
    the time it was written: before the first run) and OUT/autotune_rank.csv. {config key:
    prediction}."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    t0 = time.time()
    todo = {pred_key(p["spec"]): p["spec"] for p in points if p["spec"]["engine"] == "starpu"}
    for p in points:        # the engines the model does not describe: step_seconds' stand-in
        if p["spec"]["engine"] != "starpu":
            proxy = proxy_spec(p["spec"])
            todo.setdefault(pred_key(proxy), proxy)
    batches = sorted({p["spec"]["batch"] for p in points if p["figure"] == "fig3"})
    with ProcessPoolExecutor(max_workers=max(1, jobs),
                             mp_context=multiprocessing.get_context("spawn")) as pool:
        ranked = pool.map(_rank_one, [(B, S["model"], S["T"], cal_path) for B in batches])
        preds = dict(pool.map(_predict_one, [(k, s, cal_path, machine_path)
                                             for k, s in todo.items()]))
        ranks = [r for _, rows in ranked for r in rows]
    when = datetime.datetime.now().isoformat(timespec="seconds")
    rows = []
    for p in points:
        pred = preds.get(pred_key(p["spec"]))
        if pred is None:
            continue
        rows.append(dict(figure=p["figure"], series=p["series"], x=p["x"],
                         config=pred_key(p["spec"]), **{k: p["spec"].get(k, "") for k in
                                                          CONFIG_FIELDS if k != "steps"},
                         **pred, calibration=cal_path, machine=machine_path or "",
                         in_sample=bool(p.get("in_sample")), written=when))
    write_rows(os.path.join(out, "predictions.csv"), rows)
    if ranks:
        write_rows(os.path.join(out, "autotune_rank.csv"), ranks)
    bad = [r for r in rows if r.get("error")]
    log(f"  {len(preds)} configurations predicted, {len(batches)} autotuner ranking(s), "
        f"{time.time() - t0:.0f} s, {jobs} at a time" + (f"; {len(bad)} FAILED, e.g. "
                                                        f"{bad[0]['error']}" if bad else ""))
    return preds


def proxy_spec(spec) -> dict:
    """The StarPU point standing in for another engine's in the estimates: one worker on the
    same cores and batch."""
    k = int(spec.get("threads") or spec.get("cpus") or 1)
    proxy = dict(spec, engine="starpu", workers=1, cores_per_worker=k, threads=None)
    if k > 1:
        proxy["kcore"] = "team"
    return proxy


def step_seconds(p, preds) -> float | None:
    """A point's predicted step time: its own prediction, or for the engines the model does
    not describe (llm.c, reference, PyTorch) that of one worker on the same cores and batch."""
    spec = p["spec"]
    pred = preds.get(pred_key(spec))
    if pred is None and spec["engine"] != "starpu":
        pred = preds.get(pred_key(proxy_spec(spec)))
    if not pred or "predicted_ms_per_step" not in pred:
        return None
    return pred["predicted_ms_per_step"] / 1e3


def size_steps(points, preds, S, seconds, overhead, log, min_steps=1) -> None:
    """Each point's timed steps: about `seconds` of them by its predicted step, min_steps to
    --steps; and its estimated run time (estimate_s, what the deadline goes by): the warm-up
    steps (the first costing WARMUP_STEPS steps), the timed ones and the run's overhead."""
    for p in points:
        step = step_seconds(p, preds)
        if step is None:
            continue
        spec = p["spec"]
        spec["steps"] = max(min_steps, min(S["steps"], int(seconds / step + 0.5)))
        extra = 2.0 if int(spec.get("ranks") or 1) > 1 else 0.0      # mpirun's start
        warm = WARMUP_STEPS + int(spec.get("warmup") or 1) - 1
        p["estimate_s"] = round(overhead + extra + (spec["steps"] + warm) * step, 1)
    sized = [p for p in points if "estimate_s" in p]
    total = sum({config_key(p["spec"]): p["estimate_s"] for p in sized}.values())
    log(f"  timed steps sized to ~{seconds:g} s a point: {len(sized)} of {len(points)} points, "
        f"{min(p['spec']['steps'] for p in sized) if sized else '-'}-"
        f"{max(p['spec']['steps'] for p in sized) if sized else '-'} steps; all the distinct "
        f"runs estimated at {total / 60:.1f} min")


def by_priority(points, order) -> list:
    """The points by their figure's place in `order` (--only's order: the first figure first),
    each figure's points in the plan's order (Figure 3: its batches as --fig3-batches lists
    them)."""
    rank = {f: i for i, f in enumerate(order)}
    return sorted(points, key=lambda p: rank.get(p["figure"], len(rank)))


def choose_fig3_batches(points, budget_s, margin_s=30.0) -> tuple[list, list]:
    """Figure 3 at two batches: the first of --fig3-batches, and the largest of the others
    whose row (every partition) fits the budget left after the first row; (points, the
    other batches' points). With two batches or fewer, both kept as they are."""
    def row(B):
        return [p for p in points if p["figure"] == "fig3" and p["spec"]["batch"] == B]
    batches = list(dict.fromkeys(p["spec"]["batch"] for p in points if p["figure"] == "fig3"))
    if len(batches) <= 2:
        return points, []

    def cost(ps):
        return sum({config_key(p["spec"]): p.get("estimate_s", 0.0) for p in ps}.values())
    left = budget_s - margin_s - cost(row(batches[0]))
    fitting = [B for B in batches[1:] if cost(row(B)) <= left]
    second = max(fitting) if fitting else min(batches[1:])
    out = [p for p in points if p["figure"] != "fig3" or p["spec"]["batch"] in
           (batches[0], second)]
    why = (f"not run: Figure 3 at B={batches[0]} and B={second}, the largest of "
           f"{', '.join(str(B) for B in batches[1:])} that fits")
    return out, [dict(p, why=why) for p in points if p["figure"] == "fig3" and
                 p["spec"]["batch"] not in (batches[0], second)]


def cut_to_budget(points, budget_s, margin_s=30.0) -> tuple[list, list]:
    """(kept, dropped): the points in priority order, each distinct configuration counted
    once, kept while their estimated seconds (estimate_s; a point without one counts 0) end
    margin_s before budget_s; a point that would end later is dropped and the next ones are
    still tried (a shorter one of lower priority uses the time left; none displaces one of
    higher priority, which was kept before it). Each kept point gets ends_s, its predicted end
    from the start."""
    kept, dropped, seen, t = [], [], {}, 0.0
    for p in points:
        key = config_key(p["spec"])
        if key in seen:
            kept.append(dict(p, ends_s=seen[key]))
        elif t + p.get("estimate_s", 0.0) <= budget_s - margin_s:
            t += p.get("estimate_s", 0.0)
            seen[key] = round(t, 1)
            kept.append(dict(p, ends_s=seen[key]))
        else:
            dropped.append(p)
    return kept, dropped


def measured_keys(paths) -> set:
    """The configurations (pred_key: steps aside) with a run that measured them in the given
    runs.csv files (earlier device runs, committed or brought back), for a later run to
    measure only the points still missing."""
    done = set()
    for path in paths:
        try:
            with open(path, newline="") as f:
                rows = list(csv.DictReader(f))
        except OSError as e:
            raise SystemExit(f"figures.py: --resume {path}: {e.strerror}; give the runs.csv of "
                             "an earlier run")
        if rows and "config" not in rows[0]:
            raise SystemExit(f"figures.py: --resume {path}: no config column (not a runs.csv "
                             "of figures.py)")
        for r in rows:
            if r.get("tokens_per_ms") and not r.get("error"):
                done.add(pred_key(json.loads(r["config"])))
    return done


def calibration_runs(text) -> list[tuple[int, int, int]]:
    """--calibration-runs "1x16,4x4,16x1:1,6": the (workers, cores per worker, batch) of
    each traced run of `calibrate --partitions ... --sub-batch ...` (batch = workers x
    sequences per sub-batch, one sub-batch per worker)."""
    try:
        parts, per = text.split(":")
        out = []
        for nk in parts.split(","):
            n, k = (int(x) for x in nk.lower().split("x"))
            out += [(n, k, n * int(b)) for b in per.split(",")]
        return out
    except ValueError:
        raise SystemExit(f"figures.py: --calibration-runs {text!r}: want NxK[,NxK...]:B1[,B2] "
                         "(partitions, then sequences per sub-batch), e.g. 1x16,4x4,16x1:1,6")


def multicore(spec) -> bool:
    """Whether a point's tasks (StarPU: cores per worker) or threads (the other engines) use
    more than one core."""
    if spec["engine"] == "starpu":
        return int(spec["cores_per_worker"]) > 1
    return int(spec.get("threads") or 1) > 1


def mark_in_sample(points, runs) -> None:
    """in_sample=True on each StarPU point of one process that a calibration run also ran
    (same workers, cores per worker and batch, one sub-batch per worker, T = 64): its
    prediction is a fit, not a prediction, and the error figures leave it out."""
    runs = set(runs)
    for p in points:
        s = p["spec"]
        if (s["engine"] == "starpu" and int(s.get("ranks") or 1) == 1 and s["seq_len"] == 64
                and s.get("sub_batches") in (None, s["workers"])
                and (s["workers"], s["cores_per_worker"], s["batch"]) in runs):
            p["in_sample"] = True


def run_spec(spec, llmc_dir=None, timeout=None) -> dict:
    """One run: llm.c (experiments/llmc.py) or starpu_llm's bench in a subprocess. With
    spec["warmup"] = W > 1: W warm-up steps (the runners drop their first; the others are
    dropped here), then spec["steps"] timed ones, tokens/ms of their median step."""
    warm = int(spec.get("warmup") or 1)
    run = dict(spec, steps=int(spec["steps"]) + warm - 1)
    if spec["engine"] == "llmc":
        if not llmc_dir:
            return dict(spec, error="the llmc series needs --llmc DIR (experiments/llmc.py)")
        import llmc
        r = llmc.run(run, llmc_dir, timeout)
    else:
        r = run_in_subprocess(run, timeout=timeout)
    return median_of_timed(r, spec) if warm > 1 else r


def median_of_timed(r, spec) -> dict:
    """A run's result with its extra warm-up steps dropped and tokens/ms of the median timed
    step (a drift between the first and the last steps moves it less than the mean)."""
    if "error" in r:
        return dict(r, steps=spec["steps"])
    warm = int(spec.get("warmup") or 1)
    timed = r["step_ms"][warm - 1:]
    return dict(r, steps=spec["steps"], step_ms=timed, warmup_ms=r["step_ms"][:warm - 1],
                tokens_per_ms=spec["batch"] * spec["seq_len"] / statistics.median(timed),
                statistic=f"median of {len(timed)} timed steps after {warm} warm-up")


# --------------------------------------------------------------------------- the runs

class RunCache:
    """OUT/runs.csv: one row per run (raw repeat), rewritten atomically after each run."""

    def __init__(self, path, machine):
        self.path, self.machine = path, machine
        self.fresh = set()      # (config, repeat) run by this process
        self.rows = []
        if os.path.exists(path):
            with open(path, newline="") as f:
                self.rows = list(csv.DictReader(f))

    def _match(self, row, key, repeat):
        m = self.machine
        return (row["config"] == key and row["commit"] == m["commit"] and
                row["cpu"] == m["cpu"] and row["host"] == m["host"] and int(row["repeat"]) == repeat)

    def get(self, key, repeat):
        if not reusable(self.machine["commit"]) and (key, repeat) not in self.fresh:
            return None         # a dirty tree's runs serve only the invocation that made them
        for row in self.rows:
            if self._match(row, key, repeat) and not row.get("error"):
                return row
        return None

    def drop(self, key):
        self.rows = [r for r in self.rows if not (r["config"] == key and
                                                   r["commit"] == self.machine["commit"])]

    def add(self, spec, repeat, result, seconds):
        row = {"config": config_key(spec), "repeat": repeat}
        row.update({k: json.dumps(spec.get(k)) if isinstance(spec.get(k), list) else spec.get(k, "")
                    for k in CONFIG_FIELDS})
        ok = "error" not in result
        row.update(tokens_per_ms=result.get("tokens_per_ms", "") if ok else "",
                   ms_per_step=((statistics.median(result["step_ms"]) if "statistic" in result
                                 else sum(result["step_ms"]) / len(result["step_ms"]))
                                if ok else ""),
                   step_ms=" ".join(f"{x:.1f}" for x in result.get("step_ms", [])),
                   peak_rss_mb=round(result.get("peak_rss_mb", 0), 1) if ok else "",
                   describe=result.get("describe", ""), error=result.get("error", ""),
                   statistic=result.get("statistic", "mean"),
                   wall_s=round(seconds, 1),
                   when=datetime.datetime.now().isoformat(timespec="seconds"))
        row.update(self.machine)
        self.rows = [r for r in self.rows if not self._match(r, row["config"], repeat)]
        self.rows.append(row)
        self.fresh.add((row["config"], repeat))
        fields = list(dict.fromkeys(k for r in self.rows for k in r))
        write_csv(self.path, [{k: r.get(k, "") for k in fields} for r in self.rows])
        return row


def print_plan(points, dropped, deadline, margin, log, now) -> None:
    """The plan as it will run: each point's predicted seconds and end; what does not fit,
    lowest priority first; where it ends against the deadline."""
    for p in points:
        tag = " [in-sample]" if p.get("in_sample") else ""
        est = f"~{p['estimate_s']:.0f} s" if "estimate_s" in p else "no estimate"
        ends = f", ends +{p['ends_s']:.0f} s" if "ends_s" in p else ""
        log(f"  plan {p['figure']:<9} {str(p['series']):<9} {str(p['x']):<6} "
            f"{describe_point(p):<36} {p['spec']['steps']} steps, {est}{ends}{tag}")
    total = max((p.get("ends_s", 0.0) for p in points), default=0.0)
    if deadline is not None:
        left = deadline - now
        log(f"  the plan: ~{total:.0f} s of runs, ending {left - total:.0f} s before the "
            f"deadline (margin {margin:.0f} s)")
    for p in reversed(dropped):
        log(f"  NOT IN THE PLAN ({(p.get('why') or 'deadline').removeprefix('not run: ')}): {p['figure']} {p['series']} {p['x']} "
            f"{describe_point(p)}" + (f", ~{p['estimate_s']:.0f} s" if "estimate_s" in p
                                      else ""))


def describe_point(p) -> str:
    s = p["spec"]
    what = {"reference": f"reference {s.get('threads')} thr",
            "llmc": f"llm.c {s.get('threads')} thr",
            "torch": f"torch SDPA {s.get('threads')} thr",
            "torch-readable": f"torch readable {s.get('threads')} thr"}.get(s["engine"])
    if what is None:
        what = f"starpu {s['workers']}x{s['cores_per_worker']}" + (f" {s['kcore']}" if s.get("kcore") else "")
        if s.get("ranks"):
            what = f"mpirun -np {s['ranks']} " + what
            if s.get("pipeline_stages"):
                what += f" {s['pipeline_stages']} stages"
            elif s.get("ownership"):
                what += f" {s['ownership']}"
    return f"{what}, B={s['batch']}"


def latest_commit(path, machine) -> str:
    """The commit of the most recent run in the runs cache made on this machine at a clean
    commit."""
    if os.path.exists(path):
        with open(path, newline="") as f:
            rows = [r for r in csv.DictReader(f) if r["host"] == machine["host"]
                    and r["cpu"] == machine["cpu"] and reusable(r["commit"])]
        if rows:
            return max(rows, key=lambda r: r["when"])["commit"]
    return machine["commit"]


def run_points(points, cache, repeat, force_figs, log, replot=False, deadline=None,
               order="plan", llmc_dir=None, grace=60.0, run_env=None, after_run=None,
               after_run_s=0.0, clock=time.time, run=None):
    """Round-robin over the distinct configurations, `repeat` times; cached runs skipped.
    order "cheap": within a round, by estimated run time (estimate_s). deadline (epoch
    seconds): every run and what follows it end before it, whatever happens: a run whose
    estimate does not fit is not started (written down as not run), and each run is killed at
    3 x its estimate + grace seconds or where the time left ends, less its tail (END_GRACE
    from TERM to KILL, then after_run_s, the after-run command's longest).
    clock and run (run_spec's signature): worst_case's stand-ins.
    run_env (VAR=VALUE): in the environment of each run's processes; after_run: a shell
    command run after each run, without run_env (tools/device-eval16.sh: it ends what the run
    left, marked run_env, so that no run shares its cores with one before it); when it fails,
    the runs after it are not run (written down)."""
    var, _, value = (run_env or "").partition("=")
    run = run or run_spec
    tail = END_GRACE + after_run_s
    configs = {}
    for p in points:
        configs.setdefault(config_key(p["spec"]), p)
    for key, p in configs.items():
        if force_figs & {q["figure"] for q in points if config_key(q["spec"]) == key}:
            cache.drop(key)
    todo = [(r, key, p) for r in range(1, repeat + 1) for key, p in configs.items()
            if cache.get(key, r) is None]
    if replot:
        log(f"--replot: {len(todo)} run(s) missing from the cache are not run")
        return
    if order == "cheap":
        todo.sort(key=lambda t: (t[0], t[2].get("estimate_s", float("inf"))))
    total = len(configs) * repeat
    log(f"{len(configs)} configurations x {repeat} repeats = {total} runs; "
        f"{total - len(todo)} in the cache (same configuration, machine and commit), "
        f"{len(todo)} to run")
    t_start = clock()
    durations = []
    stopped = None      # why the runs stopped: what a run left outlives after_run
    for i, (r, key, p) in enumerate(todo, 1):
        figs = ",".join(sorted({q["figure"] for q in points if config_key(q["spec"]) == key}))
        if stopped:
            cache.add(p["spec"], r, dict(error=stopped), 0.0)
            log(f"[{i:3d}/{len(todo)}] {figs:<11} {describe_point(p):<34} "
                f"NOT RUN: {stopped.removeprefix('not run: ')}")
            continue
        timeout = None
        if deadline is not None:
            left, est = deadline - clock() - tail, p.get("estimate_s")
            if left <= 0 or (est is not None and est > left):
                why = (f"not run: estimated {est or 0:.0f} s, {max(0, left):.0f} s left before "
                       "the deadline")
                cache.add(p["spec"], r, dict(error=why), 0.0)
                log(f"[{i:3d}/{len(todo)}] {figs:<11} {describe_point(p):<34} "
                    f"NOT RUN: {why.removeprefix('not run: ')}")
                continue
            timeout = left if est is None else min(left, 3 * est + grace)
        t0 = clock()
        before = os.environ.get(var)
        if var:
            os.environ[var] = value         # the run's processes inherit it
        try:
            result = run(p["spec"], llmc_dir, timeout)
        finally:
            if var and before is None:
                del os.environ[var]
            elif var:
                os.environ[var] = before
        dt = clock() - t0
        if after_run:
            done = subprocess.run(after_run, shell=True)
            if done.returncode != 0:
                stopped = (f"not run: `{after_run}` failed (exit {done.returncode}) after "
                           f"{describe_point(p)}: its processes may still run")
        durations.append(dt)
        row = cache.add(p["spec"], r, result, dt)
        left = (len(todo) - i) * statistics.mean(durations)
        status = (f"{float(row['tokens_per_ms']):.4f} tok/ms" if not row["error"]
                  else f"FAILED: {row['error']}")
        log(f"[{i:3d}/{len(todo)}] {figs:<11} {describe_point(p):<34} repeat {r}/{repeat}: "
            f"{status} ({dt:.0f} s; {(clock() - t_start) / 60:.1f} min so far, "
            f"~{left / 60:.1f} min left)")


def worst_case(points, deadline, now, grace=60.0, after_run_s=0.0) -> tuple[int, float]:
    """run_points on a clock of its own where every run is killed at its timeout and takes
    END_GRACE more to end, then after_run_s (the after-run command's longest): the points that
    would still run, and when the last of them ends (seconds after now); the deadline is never
    passed (--dry-run prints it)."""
    t = [now]
    ran = []

    def killed(spec, llmc_dir, timeout):
        t[0] += timeout + END_GRACE + after_run_s
        ran.append(t[0])
        return dict(spec, error="timed out (worst case)")

    class Nothing:          # no cache: every point runs, nothing written
        def get(self, key, repeat):
            return None

        def add(self, spec, repeat, result, seconds):
            return {"error": result.get("error", ""), "tokens_per_ms": ""}

    run_points(points, Nothing(), 1, set(), lambda s: None, deadline=deadline, grace=grace,
               after_run_s=after_run_s, clock=lambda: t[0], run=killed)
    return len(ran), (ran[-1] if ran else now) - now


# --------------------------------------------------------------------------- traced runs

def traced(spec, path, machine, force, log):
    """A traced run (bench.traced_run), cached as JSON for the same configuration and commit."""
    key = config_key(spec) + machine["commit"] + machine["host"]
    if not force and reusable(machine["commit"]) and os.path.exists(path):
        with open(path) as f:
            r = json.load(f)
        if r.get("cache_key") == key:
            log(f"  {os.path.basename(path)}: cached")
            return r
    if REPLOT:
        log(f"  {os.path.basename(path)}: not in the cache (--replot: not run)")
        return None
    t0 = time.time()
    r = run_in_subprocess(dict(spec, trace=True))
    if "error" in r:
        log(f"  {os.path.basename(path)}: FAILED: {r['error']}")
        return None
    r["cache_key"] = key
    with open(path, "w") as f:
        json.dump(r, f)
    log(f"  {os.path.basename(path)}: {len(r['events'])} tasks traced ({time.time() - t0:.0f} s)")
    return r


def figure1(S, out, machine, force, log):
    made = []
    for name, model, B, T, collapse in (("fig1_taskgraph_small", "tiny", 2, 16, False),
                                        ("fig1_taskgraph_gpt2", "d12", S["graph_batch"], S["T"], True)):
        spec = dict(engine="starpu", model=model, batch=B, seq_len=T, steps=1, cpus=1,
                    **run_settings(partition_of(1, 1, "team", 1)))
        r = traced(spec, os.path.join(out, f"{name}.trace.json"), machine, force, log)
        if r is None:
            continue
        names = {int(h): n for h, n in r["names"].items()}
        events = taskgraph.load_events(r["events"])
        nodes, edges, stats, ids = taskgraph.build_graph(events, names, 1, collapse)
        per_it = len(r["records"]) // (r["steps"] + 1)
        # every submitted task is in the trace (StarPU's own reduction tasks come on top)
        from collections import Counter
        traced_tasks = Counter(e.codelet for e in events if e.phase != "reduction")
        if traced_tasks != Counter(r["records"]):
            log(f"  {name}: WARNING: the trace's tasks differ from the submitted ones: "
                f"{(traced_tasks - Counter(r['records'])) + (Counter(r['records']) - traced_tasks)}")
        cfg = MODELS[model]
        what = ("GPT-2 124M, one node per layer and phase (x n: tasks merged)" if collapse else
                f"small test config '{model}' (L={cfg.L}, C={cfg.C}), one node per task")
        title = (f"Figure 1: one training iteration as submitted, {what}; B={B}, T={T}, "
                 f"1 worker; {per_it} tasks/iteration (StarPU's trace, access modes)\\n"
                 f"edges drawn: {stats['raw']} read-after-write; reused-handle (WAR/WAW) edges "
                 f"{stats['reuse'] - stats['reuse_implied']} of {stats['reuse']} (the others implied"
                 f" by other paths); into the next iteration {stats['next'] - stats['next_implied']}"
                 f" of {stats['next']} (the others implied)")
        dot = os.path.join(out, f"{name}.dot")
        png = os.path.join(out, f"{name}.png")
        taskgraph.write_dot(dot, title, nodes, edges, ids, labels=True)
        err = taskgraph.render(dot, png, dpi=48 if not collapse else 64)
        if err:
            log(f"  {name}: Graphviz failed: {err}")
            continue
        log(f"  {name}: {len(nodes)} nodes, {len(edges)} edges -> {png}")
        made.append((name, stats, per_it))
    return made


def traces(S, out, machine, force, log):
    """One traced iteration (the second; the first is the warm-up) per partition of the node."""
    import plots
    results = []
    for n, k, mode in partitions_that_fit(S["cores"]):
        B = S["trace_batch"]
        if B % n:
            continue
        p = partition_of(n, k, mode, S["cores"])
        label = f"{n}x{k}" + (f"_{p.kcore}" if k > 1 else "")
        spec = spec_of("starpu", B, dict(S, steps=1, warmup=1), S["cores"], p)
        r = traced(spec, os.path.join(out, f"trace_{label}.json"), machine, force, log)
        if r is None:
            continue
        png = os.path.join(out, f"trace_{label}.png")
        info = plots.gantt(r, n, png, S, machine)
        log(f"  trace {label}: iteration {info['makespan_ms']:.0f} ms, critical path "
            f"{info['critical_ms']:.0f} ms, idle {info['idle_pct']:.0f} % -> {png}")
        results.append(dict(partition=label, **info))
    if results:
        write_rows(os.path.join(out, "trace_summary.csv"), results)
    return results


def sgemm_peaks(core_counts, out, machine, force, log, replot=False) -> dict:
    """{k: GFLOP/s}: experiments/sgemm_peak.py on the first k cores, cached per commit."""
    path = os.path.join(out, "sgemm_peak.csv")
    rows = []
    if os.path.exists(path):
        with open(path, newline="") as f:
            rows = [r for r in csv.DictReader(f)
                    if r["commit"] == machine["commit"] and r["host"] == machine["host"]
                    and reusable(r["commit"])]
    have = {} if force else {int(r["threads"]): float(r["peak_gflops"]) for r in rows}
    for k in sorted(set(core_counts)):
        if k in have or replot:
            continue
        cpus = core_cpus()[:k]
        p = subprocess.run([sys.executable, os.path.join(HERE, "sgemm_peak.py"), "--threads",
                            str(k), "--json"], capture_output=True, text=True,
                           preexec_fn=lambda: os.sched_setaffinity(0, cpus))
        if p.returncode != 0:
            log(f"  sgemm peak on {k} core(s) failed: {p.stderr.strip()[-300:]}")
            continue
        r = json.loads(p.stdout.strip().splitlines()[-1])
        have[k] = r["peak_gflops"]
        log(f"  sgemm peak on {k} core(s): {r['peak_gflops']:.1f} GFLOP/s ({r['blas']})")
    write_csv(path, [dict(threads=k, peak_gflops=g, commit=machine["commit"], host=machine["host"],
                          blas=machine["blas"], cpu=machine["cpu"]) for k, g in sorted(have.items())])
    return have


# --------------------------------------------------------------------------- results.md

def results_markdown(S, machine, made, peaks, minutes, load_before, load_after, repeat) -> str:
    """The numbers of this run as Markdown (docs/figures/results.md): the machine, then each
    figure's medians (min-max) in tokens/ms and the utilisation."""
    L = [f"# Figures made on {machine['host']}, {datetime.date.today()}", "",
         f"- CPU: {machine['cpu']}",
         f"- StarPU {machine['starpu_version']} (FxT: {'yes' if machine['starpu_fxt'] else 'no'}), "
         f"BLAS {machine['blas']}, PyTorch {machine['torch_version']}, commit {machine['commit']}",
         "- sgemm peak (experiments/sgemm_peak.py): " + ", ".join(
             f"{g:.0f} GFLOP/s on {k} core{'s' if k > 1 else ''}" for k, g in sorted(peaks.items())),
         f"- scale: {S['scale']}; {repeat} interleaved runs per point, median (min-max) tokens/ms; "
         f"{S['steps']} timed steps after 1 warm-up, T={S['T']}",
         f"- `make figures` took {minutes:.1f} min; load average {load_before:.2f} before, "
         f"{load_after:.2f} after", ""]

    def cell(t):
        u = f", {t['util_pct']:.0f} %" if t.get("util_pct") is not None else ""
        return f"{t['median']:.4f} ({t['min']:.4f}-{t['max']:.4f}{u})"

    for fig, title in (("fig2a", "Figure 2a, weak scaling"), ("fig2b", "Figure 2b, strong scaling")):
        if not made.get(fig):
            continue
        table = made[fig]["table"]
        xs = sorted({t["x"] for t in table})
        L += [f"## {title}", "", "tokens/ms (min-max, % of the k cores' sgemm peak); batch in brackets", "",
              "| series | " + " | ".join(f"{x} core{'s' if x > 1 else ''}" for x in xs) + " |",
              "|---|" + "---|" * len(xs)]
        for series in dict.fromkeys(t["series"] for t in table):
            row = {t["x"]: t for t in table if t["series"] == series}
            L.append(f"| {SERIES[series][0]} | " + " | ".join(
                f"{cell(row[x])} [B={row[x]['batch']}]" if x in row else "-" for x in xs) + " |")
        L.append("")
    if made.get("fig3"):
        table = made["fig3"]["table"]
        parts = list(dict.fromkeys(t["x"] for t in table))
        L += ["## Figure 3, partitions", "",
              f"tokens/ms (min-max, % of the {S['cores']}-core sgemm peak)", "",
              "| total batch | " + " | ".join(parts) + " |", "|---|" + "---|" * len(parts)]
        for series in dict.fromkeys(t["series"] for t in table):
            row = {t["x"]: t for t in table if t["series"] == series}
            L.append(f"| {series} | " + " | ".join(cell(row[x]) if x in row else "-" for x in parts) + " |")
        L.append("")
    if made.get("fig4"):
        table = sorted(made["fig4"]["table"], key=lambda t: (t["x"], t["series"]))
        base = next((t["ms_per_step"] for t in table if t["x"] == 1), None)
        L += ["## Figure 4, MPI weak scaling", "",
              "| processes | who owns the parameters | global batch | tokens/ms (all) | "
              "tokens/ms per process | ms/step | above 1 process |",
              "|---|---|---|---|---|---|---|"]
        for t in table:
            R = int(t["x"])
            above = "" if base is None else f"{t['ms_per_step'] - base:+.0f} ms"
            L.append(f"| {R} | {t['series']} | {t['batch']} | {cell(t)} | {t['median'] / R:.4f} | "
                     f"{t['ms_per_step']:.0f} | {above} |")
        eff = made["fig4"]["headline"].get("predicted_efficiency_16")
        if eff:
            L += ["", "Predicted for the paper's node at 16 nodes, per-node efficiency: "
                  + ", ".join(f"{m} {e:.0%}" for m, e in eff.items())
                  + " (fig4_predicted.csv)."]
        L.append("")
    if made.get("trace"):
        L += ["## Traced iterations", "",
              "| partition | tasks | iteration ms | critical path ms | idle % of core time | forward / backward / update / reduction ms (task time) |",
              "|---|---|---|---|---|---|"]
        for t in made["trace"]:
            L.append(f"| {t['partition']} | {t['tasks']} | {t['makespan_ms']:.0f} | {t['critical_ms']:.0f} | "
                     f"{t['idle_pct']:.0f} | " + " / ".join(f"{t.get(p + '_ms', 0):.0f}" for p in
                                                           ("forward", "backward", "update", "reduction")) + " |")
        L.append("")
    if made.get("fig1"):
        L += ["## Task graphs", ""]
        for name, stats, per_it in made["fig1"]:
            L.append(f"- {name}: {per_it} tasks per iteration; {stats['raw']} read-after-write edges; "
                     f"{stats['reuse']} reused-handle edges, {stats['reuse_implied']} implied by others; "
                     f"{stats['next']} edges into the next iteration, {stats['next_implied']} implied")
        L.append("")
    return "\n".join(L)


# --------------------------------------------------------------------------- main

def main(argv=None):
    ap = argparse.ArgumentParser(description="Regenerate the paper's figures (see the module doc).")
    scale = ap.add_mutually_exclusive_group()
    scale.add_argument("--quick", action="store_true", help="scaled-down batches (default)")
    scale.add_argument("--full", action="store_true", help="the paper's batch sizes, for a real node")
    ap.add_argument("--only", default=",".join(FIGURES), help=f"figures to make ({','.join(FIGURES)})")
    ap.add_argument("--force", action="store_true", help="rerun the selected figures' points")
    ap.add_argument("--repeat", type=int, default=3, help="runs per point, interleaved (>= 3)")
    ap.add_argument("--cores", help="figure 2's core counts (default: the divisors of the usable cores)")
    ap.add_argument("--weak-per-core", type=int, help="figure 2a's sequences per core")
    ap.add_argument("--strong-batch", type=int, help="figure 2b's total batch")
    ap.add_argument("--fig3-batches", help="figure 3's total batches, comma-separated")
    ap.add_argument("--trace-batch", type=int, help="the Gantt charts' batch")
    ap.add_argument("--ranks", default="1,2", help="figure 4's MPI process counts (default 1,2)")
    ap.add_argument("--mpi-partition", help="figure 4: each rank's N x K (default 1 x cores/max R)")
    ap.add_argument("--mpi-batch-per-rank", type=int, help="figure 4: sequences per rank")
    ap.add_argument("--mpirun-args", help="extra mpirun options, e.g. on a cluster "
                    "'--hostfile H --map-by ppr:1:node' (each rank then uses its node's cores)")
    ap.add_argument("--torch-readable", action="store_true",
                    help="figure 2: also the readable PyTorch model (torch_gpt2.py)")
    ap.add_argument("--out", default=os.path.join(HERE, "out"), help="CSV, DOT, traces, PNG")
    ap.add_argument("--png-dir", default=os.path.join(ROOT, "docs", "figures"),
                    help="where the PNGs are copied (committed; '' for none)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan only")
    ap.add_argument("--allow-dirty", action="store_true",
                    help="run from a tree with uncommitted changes (a smoke test): nothing is "
                    "reused or reusable, captions say -dirty, --png-dir is ignored")
    ap.add_argument("--replot", action="store_true",
                    help="redraw from the runs already in OUT (the latest commit measured on this "
                    "machine), running nothing")
    ap.add_argument("--model", default="d12", help="model (default d12 = GPT-2 124M; "
                    "smaller ones only to test this pipeline)")
    ap.add_argument("--seq-len", type=int, default=64, help="T (default 64, the paper's)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per run (default 10, the paper's)")
    node = ap.add_argument_group("a node lent for minutes (docs/figures.md; "
                                 "tools/device-eval16.sh)")
    node.add_argument("--series", help="figure 2's series, comma-separated, from "
                      f"{','.join(SERIES)} (default reference,tensor,data,torch)")
    node.add_argument("--llmc", metavar="DIR", help="llm.c's build folder (experiments/llmc.py), "
                      "for the llmc series")
    node.add_argument("--fig3-kcore", choices=["all", "team", "forkjoin"], default="all",
                      help="figure 3's k-core mechanisms (default all that fit; team: StarPU "
                      "1.4's parallel workers where the build has them)")
    node.add_argument("--mpi-split", action="store_true",
                      help="figure 4: the R ranks share the node, cores/R each (default: "
                      "cores/max R each)")
    node.add_argument("--mpi-reserve", type=int, default=0, metavar="N",
                      help="figure 4 with --mpi-split: cores of each rank left to StarPU-MPI's "
                      "progression thread (the rank's last; the paper leaves one)")
    node.add_argument("--calibration", metavar="TOML", help="predict every StarPU point from "
                      "this calibration before measuring any (OUT/predictions.csv, "
                      "OUT/autotune_rank.csv)")
    node.add_argument("--point-seconds", type=float, help="with --calibration: each point's "
                      "timed steps sized to about this many seconds (1 to --steps)")
    node.add_argument("--run-overhead", type=float, default=3.0,
                      help="seconds a run costs besides its steps, for the estimates (default 3)")
    node.add_argument("--deadline", type=float, metavar="SECONDS",
                      help="start no run that would end more than SECONDS after this script's "
                      "start (by its estimate; --deadline-at: an epoch time instead)")
    node.add_argument("--deadline-at", type=float, metavar="EPOCH",
                      help="the deadline as an epoch time (a calling script's start + its budget)")
    node.add_argument("--run-grace", type=float, default=60.0, metavar="SECONDS",
                      help="with a deadline, a run is killed at 3 x its estimate + SECONDS "
                      "(default 60; more on a machine other processes load)")
    node.add_argument("--run-env", metavar="VAR=VALUE", help="set in the environment of "
                      "each run's processes (not of --after-each-run): a mark that finds what "
                      "a run left, e.g. mpirun's ranks")
    node.add_argument("--after-each-run", metavar="CMD", help="a shell command run after each "
                      "run, before the next (tools/device-eval16.sh: ends what the run left, by "
                      "--run-env's mark, so no run shares its cores with one before it); when "
                      "it fails, the runs after it are not run")
    node.add_argument("--after-each-run-seconds", type=float, default=0.0, metavar="SECONDS",
                      help="the longest --after-each-run takes: each run ends that long (and "
                      "the TERM-to-KILL grace) before the deadline (default 0)")
    node.add_argument("--order", choices=["plan", "cheap", "priority"], default="plan",
                      help="cheap: the runs by estimated time, shortest first; priority: by "
                      "--only's order, the first figure first, and with --deadline a plan cut "
                      "to it before any run: a point that does not fit is dropped, the later "
                      "ones still tried (default plan)")
    node.add_argument("--margin", type=float, default=30.0, metavar="SECONDS",
                      help="--order priority: the plan ends this long before the deadline "
                      "(default 30)")
    node.add_argument("--warmup", type=int, default=1, metavar="W",
                      help="warm-up steps per run (default 1); W > 1: tokens/ms of the median "
                      "timed step")
    node.add_argument("--min-steps", type=int, default=1,
                      help="with --point-seconds: at least this many timed steps (default 1)")
    node.add_argument("--llmc-batches", help="fig2-llmc: llm.c, StarPU 1 x N and N x 1 on "
                      "all N cores at these batches (comma-separated), for the ratio table")
    node.add_argument("--resume", action="append", default=[], metavar="RUNS_CSV",
                      help="leave out every configuration an earlier run measured (its "
                      "runs.csv; repeatable): a later device run measures the rest")
    node.add_argument("--calibration-runs", metavar="NxK,..:B,..", help="the calibration's "
                      "traced runs (partitions:sequences per sub-batch), so that the points "
                      "they equal are marked in_sample (points.json, predictions.csv)")
    node.add_argument("--machine", metavar="TOML", help="predict for this machine "
                      "description (a what-if) with --calibration's codelet ratios")
    node.add_argument("--one-core-only", metavar="WHY", help="run no point whose tasks or "
                      "threads use more than one core (written down as not run: WHY), e.g. "
                      "when the BLAS does not give a k-core task its k cores")
    node.add_argument("--node-cores", type=int, help="with --dry-run: plan for a node of "
                      "this many cores with StarPU 1.4's parallel workers (not this machine)")
    node.add_argument("--jobs", type=int, help="predictions at a time (default: usable cores)")
    node.add_argument("--no-plots", action="store_true", help="measure only: no plots, no "
                      "results.md (experiments/eval16_report.py draws them elsewhere)")
    node.add_argument("--no-sgemm-peak", action="store_true",
                      help="no sgemm peak runs (utilisation left out)")
    args = ap.parse_args(argv)
    if args.repeat < 3 and not args.dry_run:
        print(f"note: --repeat {args.repeat} (< 3): fine for a test, not for the figures")
    var, eq, _ = (args.run_env or "VAR=").partition("=")
    if not (var and eq):
        ap.error(f"--run-env {args.run_env!r}: give VAR=VALUE, e.g. SL_DEVICE_RUN=123-runs")
    only = set(args.only.split(","))
    unknown = only - set(FIGURES)
    unknown -= set(EXTRA_FIGURES)
    if unknown:
        ap.error(f"--only: unknown {', '.join(sorted(unknown))}; choose from {', '.join(FIGURES)}")

    os.makedirs(args.out, exist_ok=True)
    log_file = open(os.path.join(args.out, "figures.log"), "a")

    def log(msg):
        line = f"{datetime.datetime.now():%H:%M:%S} {msg}"
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    t0 = time.time()
    cores = usable_cores()
    if args.node_cores:
        if not args.dry_run:
            ap.error("--node-cores plans for another node: with --dry-run only")
        global NODE_BUILD
        NODE_BUILD = Build(max_cpus=64, parallel_workers=True)
        cores = args.node_cores
    if args.warmup < 1 or args.min_steps < 1:
        ap.error("--warmup and --min-steps: at least 1")
    S = settings(args, cores)
    machine = machine_info()
    if os.environ.get("SL_DEVICE_KIND"):     # tools/device-eval16.sh: the device machine's kind
        machine["device_kind"] = os.environ["SL_DEVICE_KIND"]
    if not reusable(machine["commit"]) and not (args.replot or args.dry_run):
        if not args.allow_dirty:
            print(f"figures.py: the tree is at {machine['commit']} (uncommitted changes, or not a "
                  "git checkout): figures must name the commit that made them. Commit first "
                  "(git status), or pass --allow-dirty for a trial run (nothing cached, captions "
                  "say -dirty, docs/figures untouched).", file=sys.stderr)
            return 2
        args.png_dir = ""
    if args.replot:
        global REPLOT
        REPLOT = True
        machine["commit"] = latest_commit(os.path.join(args.out, "runs.csv"), machine)
    log(f"figures ({S['scale']} scale): {machine['cpu']}; StarPU {machine['starpu_version']}"
        f"{' (FxT)' if machine['starpu_fxt'] else ''}, BLAS {machine['blas']}, "
        f"torch {machine['torch_version']}, commit {machine['commit']}")
    try:
        load = os.getloadavg()[0]
        log(f"load average before: {load:.2f}" + ("  (busy machine: timings will be noisy)"
                                                  if load > 1 else ""))
    except OSError:
        load = None
    points = plan(S, args, only)
    if args.order == "priority":
        points = by_priority(points, args.only.split(","))
    if args.calibration_runs:
        S["calibration_runs"] = args.calibration_runs
        mark_in_sample(points, calibration_runs(args.calibration_runs))
    if args.resume:
        done = measured_keys(args.resume)
        before = len(points)
        points = [p for p in points if pred_key(p["spec"]) not in done]
        log(f"--resume: {before - len(points)} of {before} points measured already "
            f"({', '.join(args.resume)}); {len(points)} left")
    if args.calibration and points:
        log(f"Predictions of every StarPU point ({args.calibration}"
            + (f", for {args.machine}" if args.machine else "") + ")")
        preds = predict_points(points, args.calibration, S, args.out, log,
                               args.jobs or usable_cores(), args.machine)
        if args.point_seconds:
            size_steps(points, preds, S, args.point_seconds, args.run_overhead, log,
                       args.min_steps)
    deadline = (args.deadline_at if args.deadline_at is not None else
                t0 + args.deadline if args.deadline is not None else None)
    dropped = []
    if args.one_core_only:
        for p in points:
            if multicore(p["spec"]):
                p["why"] = f"not run: {args.one_core_only}"
        dropped = [p for p in points if "why" in p]
        points = [p for p in points if "why" not in p]
    # a dry run plans for another machine: this one's prediction time is not the node's
    now = t0 if args.dry_run else time.time()
    if args.order == "priority" and deadline is not None:
        points, unchosen = choose_fig3_batches(points, deadline - now, args.margin)
        points, cut = cut_to_budget(points, deadline - now, args.margin)
        dropped += cut + unchosen
    with open(os.path.join(args.out, "points.json"), "w") as f:
        json.dump(dict(settings=S, points=points, dropped=dropped), f, indent=1, default=str)
    if args.order == "priority" or args.dry_run:
        print_plan(points, dropped, deadline, args.margin, log, now)
    if args.dry_run:
        if deadline is not None:
            n, end = worst_case(points, deadline, now, args.run_grace, args.after_each_run_seconds)
            log(f"  worst case, every run killed at its cap (+{END_GRACE:.0f} s to end, "
                f"+{args.after_each_run_seconds:.0f} s after it): {n} of {len(points)} runs, "
                f"the last ending +{end:.0f} s, {deadline - now - end:.0f} s before the deadline")
        return 0

    made = {}
    if "fig1" in only:
        log("Figure 1: task graphs")
        made["fig1"] = figure1(S, args.out, machine, args.force, log)
    peak_cores = sorted(set(S["core_counts"]) | {S["cores"], S["mpi_cores"] * S["mpi_workers"]})
    peaks = {}
    if only & {"fig2a", "fig2b", "fig3", "fig4", "trace"} and not args.no_sgemm_peak:
        log("sgemm peak (experiments/sgemm_peak.py, the project's BLAS)")
        peaks = sgemm_peaks([c for c in peak_cores if c <= cores], args.out, machine,
                            args.force and not args.replot, log, args.replot)
    if "trace" in only:
        log(f"Execution traces, one iteration per partition (B={S['trace_batch']})")
        made["trace"] = traces(S, args.out, machine, args.force, log)
        if machine["starpu_fxt"]:
            log("  this StarPU has FxT: for StarPU's own Paje trace of the same run, "
                "STARPU_FXT_PREFIX=/tmp/fxt/ STARPU_FXT_TRACE=1 .venv/bin/starpu-llm train "
                "--steps 2 ...; then starpu_fxt_tool -i /tmp/fxt/prof_file_* (writes paje.trace, "
                "for ViTE); see docs/figures.md")
        else:
            log("  (this StarPU has no FxT, so no Paje trace: the charts come from the project's "
                "own task trace; docs/figures.md says how to get one with an FxT build)")
    if points:
        log("Measurements")
        cache = RunCache(os.path.join(args.out, "runs.csv"), machine)
        for p in dropped:       # written down, so that the report names them
            cache.add(p["spec"], 1, dict(error=p.get("why") or "not run: cut from the plan "
                                         "(the deadline; lower priority)"), 0.0)
        run_points(points, cache, args.repeat, only if args.force else set(), log, args.replot,
                   deadline, args.order, args.llmc, args.run_grace, args.run_env,
                   args.after_each_run, args.after_each_run_seconds)
        if args.no_plots:
            done = sum(1 for r in cache.rows if not r.get("error"))
            log(f"--no-plots: {done} run(s) in {os.path.join(args.out, 'runs.csv')}, "
                f"{len(cache.rows) - done} not run or failed; done in "
                f"{(time.time() - t0) / 60:.1f} min")
            return 0
        import plots
        predicted = []
        if "fig4" in only:
            predicted = predicted_fig4(S, PAPER_NODE_FILE, calibration_file(), log)
            if predicted:
                write_csv(os.path.join(args.out, "fig4_predicted.csv"), predicted)
        for fig in ("fig2a", "fig2b", "fig3", "fig4"):
            if fig in only:
                made[fig] = plots.figure(fig, points, cache, S, machine, peaks, args.out,
                                         args.repeat, log, predicted=predicted)
    if args.png_dir:
        os.makedirs(args.png_dir, exist_ok=True)
        import plots
        for f in sorted(os.listdir(args.out)):
            if f.endswith(".png") and f.split("_")[0] in ("fig1", "fig2a", "fig2b", "fig3", "fig4", "trace"):
                plots.shrink_png(os.path.join(args.out, f), 300_000)
                shutil.copy(os.path.join(args.out, f), os.path.join(args.png_dir, f))
            if f.endswith(".csv") and f.startswith(("fig", "sgemm", "trace_summary")):
                shutil.copy(os.path.join(args.out, f), os.path.join(args.png_dir, f))
        log(f"PNGs and CSVs copied to {args.png_dir}")
    minutes, load_after = (time.time() - t0) / 60, os.getloadavg()[0]
    if args.replot:     # the measuring run's summary and results.md stay
        log("done (--replot: results.md and summary.json left as the measuring run wrote them)")
        return 0
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump({"settings": S, "machine": machine, "made": made, "peaks": peaks,
                   "minutes": minutes, "load_before": load, "load_after": load_after},
                  f, indent=1, default=str)
    md = results_markdown(S, machine, made, peaks, minutes, load or 0.0, load_after, args.repeat)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(md + "\n")
    if args.png_dir:
        shutil.copy(os.path.join(args.out, "results.md"), os.path.join(args.png_dir, "results.md"))
    log(f"done in {(time.time() - t0) / 60:.1f} min; load average now {os.getloadavg()[0]:.2f}")
    problems = incomplete(made, only)
    if problems:
        log("INCOMPLETE (exit status 1): " + "; ".join(problems))
        return 1
    return 0


def incomplete(made, only) -> list:
    """What a run left out: points without their runs, task graphs or traces not made."""
    out = [f"{fig}: no run for {made[fig]['missing']}" for fig in ("fig2a", "fig2b", "fig3", "fig4")
           if made.get(fig) and made[fig]["missing"]]
    if "fig1" in only and len(made.get("fig1", [])) < 2:
        out.append("fig1: a task graph is missing")
    if "trace" in only and not made.get("trace"):
        out.append("trace: no traced iteration")
    return out


if __name__ == "__main__":
    sys.exit(main())
