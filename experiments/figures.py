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
(starpu_llm.runs.run_in_subprocess), pinned to the cores the point uses.
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

from starpu_llm.runs import run_in_subprocess, write_csv
from starpu_llm.config import MODELS
from starpu_llm.perf.machine import default_path, load
from starpu_llm.perf.predict import Mode, predict
from starpu_llm.runtime import partitions_that_fit, usable_cores

import taskgraph
from provenance import cpu_kind, machine_info, reusable
from series import CONFIG_FIELDS, FIG4_MODES, SERIES, config_key

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FIGURES = ("fig1", "fig2a", "fig2b", "fig3", "fig4", "trace")
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


def spec_of(engine, batch, S, cpus, workers=None, cores_per_worker=None, kcore=None, threads=None,
            ranks=None, mpirun_args=None) -> dict:
    spec = dict(engine=engine, model=S["model"], batch=batch, seq_len=S["T"], steps=S["steps"],
                cpus=cpus)
    if engine == "starpu":
        spec.update(workers=workers, cores_per_worker=cores_per_worker)
        if cores_per_worker > 1:
            spec["kcore"] = kcore or "team"
    else:
        spec["threads"] = threads
    if ranks and ranks > 1:
        spec.update(ranks=ranks, mpirun_args=mpirun_args or [])
        if mpirun_args:        # a cluster: each node's cores are its own
            spec.pop("cpus")
    return spec


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
                                   spec=spec_of("starpu", B, S, k, 1, k, "team")))
            if "data" in series and B % k == 0 and fits(k, 1, "team", k):
                points.append(dict(figure=fig, series="data", x=k,
                                   spec=spec_of("starpu", B, S, k, k, 1)))
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
                    label = f"{n}x{k}" + (" forkjoin" if mode == "forkjoin" else "")
                    points.append(dict(figure="fig3", series=f"B={B}", x=label,
                                       spec=spec_of("starpu", B, S, S["cores"], n, k, mode)))
    if "fig4" in only:
        # one process, then each ownership mode at every R > 1 (a pipeline: a stage per rank)
        for R in S["ranks"]:
            mw, mk, cpus = mpi_partition(S, R)
            for mode, fields in (FIG4_MODES.items() if R > 1 else [("one process", {})]):
                spec = spec_of("starpu", R * S["mpi_batch_per_rank"], S, cpus, mw, mk,
                               "team", ranks=R, mpirun_args=S["mpirun_args"])
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
        modes = ([("one process", Mode())] if R == 1 else
                 [("rank0", Mode("rank0")), ("sharded", Mode("sharded")),
                  (f"pipeline 2 stages x {R // 2}", Mode("sharded", 2))])
        for label, mode in modes:
            p = predict(S["model"], 72 * R, S["T"], 4, 8, ranks=R, calibration=calibration,
                        machine=target, parallel_workers=True, mode=mode)
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
    key, spec, cal_path = job
    from starpu_llm.perf.predict import Mode, load_calibration, predict
    try:
        R = int(spec.get("ranks") or 1)
        stages = int(spec.get("pipeline_stages") or 1)
        n, k = int(spec["workers"]), int(spec["cores_per_worker"])
        # no sub-batches given: predict takes the engine's default, as the run does
        p = predict(spec["model"], spec["batch"], spec["seq_len"], n, k, ranks=R,
                    sub_batches=spec.get("sub_batches"), calibration=load_calibration(cal_path), ranks_per_node=R,
                    mode=Mode(spec.get("ownership") or "sharded", stages))
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
    return B, [dict(B=B, rank=i + 1, workers=p.workers, cores_per_worker=p.cores_per_worker,
                    sub_batches=p.sub_batches, predicted_tokens_per_ms=round(p.tokens_per_ms, 5))
               for i, p in enumerate(ranked)]


def predict_points(points, cal_path, S, out, log, jobs) -> dict:
    """Every StarPU point predicted from the calibration at cal_path, `jobs` at a time, and
    the autotuner's ranking of each Figure 3 batch: OUT/predictions.csv (a row per point, with
    the time it was written: before the first run) and OUT/autotune_rank.csv. {config key:
    prediction}."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    t0 = time.time()
    todo = {pred_key(p["spec"]): p["spec"] for p in points if p["spec"]["engine"] == "starpu"}
    batches = sorted({p["spec"]["batch"] for p in points if p["figure"] == "fig3"})
    with ProcessPoolExecutor(max_workers=max(1, jobs),
                             mp_context=multiprocessing.get_context("spawn")) as pool:
        ranked = pool.map(_rank_one, [(B, S["model"], S["T"], cal_path) for B in batches])
        preds = dict(pool.map(_predict_one, [(k, s, cal_path) for k, s in todo.items()]))
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
                         **pred, calibration=cal_path, written=when))
    write_rows(os.path.join(out, "predictions.csv"), rows)
    if ranks:
        write_rows(os.path.join(out, "autotune_rank.csv"), ranks)
    bad = [r for r in rows if r.get("error")]
    log(f"  {len(preds)} configurations predicted, {len(batches)} autotuner ranking(s), "
        f"{time.time() - t0:.0f} s, {jobs} at a time" + (f"; {len(bad)} FAILED, e.g. "
                                                        f"{bad[0]['error']}" if bad else ""))
    return preds


def step_seconds(p, preds) -> float | None:
    """A point's predicted step time: its own prediction, or for the engines the model does
    not describe (llm.c, reference, PyTorch) that of one worker on the same cores and batch."""
    spec = p["spec"]
    pred = preds.get(pred_key(spec))
    if pred is None and spec["engine"] != "starpu":
        k = int(spec.get("threads") or spec.get("cpus") or 1)
        proxy = dict(spec, engine="starpu", workers=1, cores_per_worker=k, threads=None)
        if k > 1:
            proxy["kcore"] = "team"
        pred = preds.get(pred_key(proxy))
    if not pred or "predicted_ms_per_step" not in pred:
        return None
    return pred["predicted_ms_per_step"] / 1e3


def size_steps(points, preds, S, seconds, overhead, log) -> None:
    """Each point's timed steps: about `seconds` of them by its predicted step, 1 to --steps;
    and its estimated run time (estimate_s, what the deadline goes by)."""
    for p in points:
        step = step_seconds(p, preds)
        if step is None:
            continue
        spec = p["spec"]
        spec["steps"] = max(1, min(S["steps"], int(seconds / step + 0.5)))
        extra = 2.0 if int(spec.get("ranks") or 1) > 1 else 0.0      # mpirun's start
        p["estimate_s"] = round(overhead + extra + (spec["steps"] + WARMUP_STEPS) * step, 1)
    sized = [p for p in points if "estimate_s" in p]
    total = sum({config_key(p["spec"]): p["estimate_s"] for p in sized}.values())
    log(f"  timed steps sized to ~{seconds:g} s a point: {len(sized)} of {len(points)} points, "
        f"{min(p['spec']['steps'] for p in sized) if sized else '-'}-"
        f"{max(p['spec']['steps'] for p in sized) if sized else '-'} steps; all the distinct "
        f"runs estimated at {total / 60:.1f} min")


def run_spec(spec, llmc_dir=None, timeout=None) -> dict:
    """One run: llm.c (experiments/llmc.py) or starpu_llm's bench in a subprocess."""
    if spec["engine"] == "llmc":
        if not llmc_dir:
            return dict(spec, error="the llmc series needs --llmc DIR (experiments/llmc.py)")
        import llmc
        return llmc.run(dict(spec), llmc_dir, timeout)
    return run_in_subprocess(dict(spec), timeout=timeout)


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
                   ms_per_step=(sum(result["step_ms"]) / len(result["step_ms"])) if ok else "",
                   step_ms=" ".join(f"{x:.1f}" for x in result.get("step_ms", [])),
                   peak_rss_mb=round(result.get("peak_rss_mb", 0), 1) if ok else "",
                   describe=result.get("describe", ""), error=result.get("error", ""),
                   wall_s=round(seconds, 1),
                   when=datetime.datetime.now().isoformat(timespec="seconds"))
        row.update(self.machine)
        self.rows = [r for r in self.rows if not self._match(r, row["config"], repeat)]
        self.rows.append(row)
        self.fresh.add((row["config"], repeat))
        fields = list(dict.fromkeys(k for r in self.rows for k in r))
        write_csv(self.path, [{k: r.get(k, "") for k in fields} for r in self.rows])
        return row


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
               order="plan", llmc_dir=None):
    """Round-robin over the distinct configurations, `repeat` times; cached runs skipped.
    order "cheap": within a round, by estimated run time (estimate_s). deadline (epoch
    seconds): a run whose estimate ends after it is not started (written down as not run),
    and each run is killed at the deadline or at 3 x its estimate + 60 s."""
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
    t_start = time.time()
    durations = []
    for i, (r, key, p) in enumerate(todo, 1):
        figs = ",".join(sorted({q["figure"] for q in points if config_key(q["spec"]) == key}))
        timeout = None
        if deadline is not None:
            left, est = deadline - time.time(), p.get("estimate_s")
            if left <= 0 or (est is not None and est > left):
                why = (f"not run: estimated {est or 0:.0f} s, {max(0, left):.0f} s left before "
                       "the deadline")
                cache.add(p["spec"], r, dict(error=why), 0.0)
                log(f"[{i:3d}/{len(todo)}] {figs:<11} {describe_point(p):<34} NOT RUN: estimated "
                    f"{est or 0:.0f} s, {max(0, left):.0f} s left before the deadline")
                continue
            timeout = left if est is None else min(left, 3 * est + 60)
        t0 = time.time()
        result = run_spec(p["spec"], llmc_dir, timeout)
        dt = time.time() - t0
        durations.append(dt)
        row = cache.add(p["spec"], r, result, dt)
        left = (len(todo) - i) * statistics.mean(durations)
        status = (f"{float(row['tokens_per_ms']):.4f} tok/ms" if not row["error"]
                  else f"FAILED: {row['error']}")
        log(f"[{i:3d}/{len(todo)}] {figs:<11} {describe_point(p):<34} repeat {r}/{repeat}: "
            f"{status} ({dt:.0f} s; {(time.time() - t_start) / 60:.1f} min so far, "
            f"~{left / 60:.1f} min left)")


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
        spec = dict(engine="starpu", model=model, batch=B, seq_len=T, steps=1, workers=1,
                    cores_per_worker=1, cpus=1)
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
        label = f"{n}x{k}" + (f"_{mode}" if k > 1 else "")
        spec = dict(engine="starpu", model=S["model"], batch=B, seq_len=S["T"], steps=1,
                    workers=n, cores_per_worker=k, cpus=S["cores"])
        if k > 1:
            spec["kcore"] = mode
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
        cpus = sorted(os.sched_getaffinity(0))[:k]
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
    node.add_argument("--order", choices=["plan", "cheap"], default="plan",
                      help="cheap: the runs by estimated time, shortest first (default plan)")
    node.add_argument("--jobs", type=int, help="predictions at a time (default: usable cores)")
    node.add_argument("--no-plots", action="store_true", help="measure only: no plots, no "
                      "results.md (experiments/eval16_report.py draws them elsewhere)")
    node.add_argument("--no-sgemm-peak", action="store_true",
                      help="no sgemm peak runs (utilisation left out)")
    args = ap.parse_args(argv)
    if args.repeat < 3 and not args.dry_run:
        print(f"note: --repeat {args.repeat} (< 3): fine for a test, not for the figures")
    only = set(args.only.split(","))
    unknown = only - set(FIGURES)
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
    S = settings(args, cores)
    machine = machine_info()
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
    if args.calibration and points:
        log(f"Predictions of every StarPU point ({args.calibration})")
        preds = predict_points(points, args.calibration, S, args.out, log,
                               args.jobs or usable_cores())
        if args.point_seconds:
            size_steps(points, preds, S, args.point_seconds, args.run_overhead, log)
    with open(os.path.join(args.out, "points.json"), "w") as f:
        json.dump(dict(settings=S, points=points), f, indent=1, default=str)
    if args.dry_run:
        for p in points:
            print(p["figure"], p["series"], p["x"], describe_point(p),
                  f"{p['spec']['steps']} steps" + (f", ~{p['estimate_s']:.0f} s"
                                                   if "estimate_s" in p else ""))
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
        deadline = (args.deadline_at if args.deadline_at is not None else
                    t0 + args.deadline if args.deadline is not None else None)
        run_points(points, cache, args.repeat, only if args.force else set(), log, args.replot,
                   deadline, args.order, args.llmc)
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
