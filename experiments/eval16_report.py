"""What a device run of tools/device-eval16.sh brought back, made into committed results
(issue 34): the raw files, the figures' CSVs and PNG panels (the paper's points overlaid), the
model's errors on every measured StarPU point and the autotuner's choice against the best
measured partition of each Figure 3 batch.

    .venv/bin/python experiments/eval16_report.py FOLDER [FOLDER ...] [--results DIR]

FOLDER: what the device tool brought back (runs.csv, predictions.csv, autotune_rank.csv,
points.json, calibration.toml, env.txt, log.txt, eval16.tar.gz); several folders of the same
CPU kind (a second session finishing the points a first one left) are put together, the later
run of a point winning. Writes into --results (default experiments/results/eval16/<cpu kind>-<cores>c-<device kind>/,
the device kind from the GPU's name: the H100 and H200 machines' CPUs report the same name):
  runs.csv, predictions.csv, autotune_rank.csv, calibration.toml, points.json, env.txt,
  log.txt        the device's files as they came (several folders: runs and predictions joined)
  fig2a_weak.csv, fig2b_strong.csv, fig3_partitions.csv, fig4_mpi.csv and their PNGs
  validation.csv every measured StarPU point: measured and predicted tokens/ms, the error
  validation.png predicted against measured (perfmodel_validation.plot)
  autotune.csv   per Figure 3 batch: the model's choice, the best measured partition, the gap
  summary.md     the tables, the errors' median and largest, what was not run and why
and copies the PNGs to docs/figures/eval16_*.png (--png-dir; '' for none).
"""
from __future__ import annotations

import argparse
import csv
import contextlib
import io
import json
import os
import shutil
import statistics
import sys
import tarfile

from starpu_llm.perf.runs import write_csv

from provenance import kind_of
from series import config_key

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RAW = ("runs.csv", "predictions.csv", "autotune_rank.csv", "calibration.toml", "points.json",
       "env.txt", "log.txt", "00-status.txt")
FIG_CSV = {"fig2a": "fig2a_weak", "fig2b": "fig2b_strong", "fig3": "fig3_partitions",
           "fig4": "fig4_mpi"}
RESULTS = os.path.join(HERE, "results", "eval16")     # one folder per machine under it
GOAL = (0.10, 0.20)       # the goal: median and largest absolute error


class ReportError(Exception):
    pass


def load_folder(folder: str) -> dict:
    """{name: text} of a device run's files; those only in eval16.tar.gz taken from it."""
    files = {}
    tar = os.path.join(folder, "eval16.tar.gz")
    if os.path.exists(tar):
        try:
            with tarfile.open(tar) as t:
                for m in t.getmembers():
                    name = os.path.basename(m.name)
                    if m.isfile() and name in RAW and m.name.count("/") <= 2:
                        files.setdefault(name, t.extractfile(m).read().decode())
        except (tarfile.TarError, OSError, EOFError) as e:
            print(f"{tar}: unreadable ({e}); the plain files only", file=sys.stderr)
    for name in RAW:           # the plain copies are the latest (synced to the end)
        path = os.path.join(folder, name)
        if os.path.exists(path):
            with open(path) as f:
                files[name] = f.read()
    for need in ("runs.csv", "points.json"):
        if need not in files:
            raise ReportError(f"{folder}: no {need} (not a folder tools/device-eval16.sh "
                              "--device wrote?)")
    return files


def rows_of(text: str) -> list[dict]:
    return list(csv.DictReader(io.StringIO(text)))


def prediction_key(config: str) -> str:
    """A run's configuration (runs.csv's config) as predictions.csv keys it: without steps."""
    d = json.loads(config)
    return config_key(dict(d, steps=None))


class Runs:
    """The runs of one or several device runs, as plots.figure reads a RunCache."""

    def __init__(self, rows: list[dict]):
        self.rows = rows
        self.ok = {}
        for r in rows:          # in order: a later run of the same configuration wins
            if not r.get("error") and r.get("tokens_per_ms"):
                self.ok[(r["config"], int(r["repeat"]))] = r

    def get(self, key, repeat):
        return self.ok.get((key, repeat))


def machine_of(rows: list[dict]) -> dict:
    r = next((r for r in rows if not r.get("error")), rows[0] if rows else None)
    if r is None:
        raise ReportError("no run in runs.csv")
    m = {k: r.get(k, "") for k in ("cpu_model", "cpu", "isa", "cores", "host", "starpu_version",
                                   "blas", "torch_version", "commit")}
    m["cores"] = int(m["cores"] or 0)
    m["starpu_fxt"] = r.get("starpu_fxt") == "True"
    return m


def peaks_of(calibration_text: str | None) -> dict:
    """{k: sgemm GFLOP/s on k cores} from the calibration (what calibrate measured)."""
    if not calibration_text:
        return {}
    from starpu_llm.perf.machine import loads
    m = loads(calibration_text)
    return {k + 1: g for k, g in enumerate(m.sgemm_gflops)}


def validation(points, runs: Runs, preds: list[dict]) -> list[dict]:
    """Every measured StarPU configuration (once, with the figures it belongs to): measured
    tokens/ms (median of its runs), predicted, error."""
    by_key = {r["config"]: r for r in preds if not r.get("error")}
    out, seen = [], {}
    for p in points:
        spec = p["spec"]
        if spec["engine"] != "starpu":
            continue
        key = config_key(spec)
        if key in seen:
            if p["figure"] not in seen[key]["figures"].split(","):
                seen[key]["figures"] += f",{p['figure']}"
            continue
        rs = [r for (k, _), r in runs.ok.items() if k == key]
        pred = by_key.get(config_key(dict(spec, steps=None)))
        if not rs or pred is None:
            continue
        m = statistics.median(float(r["tokens_per_ms"]) for r in rs)
        pr = float(pred["predicted_tokens_per_ms"])
        R = int(spec.get("ranks") or 1)
        row = dict(figures=p["figure"], series=p["series"], x=p["x"], B=spec["batch"],
                   in_sample=bool(p.get("in_sample")),
                   workers=spec["workers"], cores_per_worker=spec["cores_per_worker"],
                   sub_batches=int(pred.get("predicted_sub_batches") or spec["workers"]),
                   ranks=R, mode=(("pipeline" if spec.get("pipeline_stages") else
                                   spec.get("ownership") or "") if R > 1 else ""),
                   steps=spec["steps"], runs=len(rs), measured=round(m, 5), predicted=pr,
                   error=round(pr / m - 1, 4),
                   predicted_ms_per_step=pred["predicted_ms_per_step"],
                   measured_ms_per_step=round(statistics.median(float(r["ms_per_step"])
                                                                for r in rs), 1))
        seen[key] = row
        out.append(row)
    return out


def autotuner(points, runs: Runs, ranks: list[dict], rows: list[dict]) -> list[dict]:
    """Per Figure 3 batch: the model's first choice (autotune.rank on the device, before any
    run), its measured speed where Figure 3 measured that partition (one sub-batch per worker),
    the model's best among the measured partitions, and the best measured one."""
    out = []
    fig3 = [r for r in rows if "fig3" in r["figures"]]
    for B in sorted({r["B"] for r in fig3}):
        measured = {(r["workers"], r["cores_per_worker"], r["sub_batches"]): r
                    for r in fig3 if r["B"] == B}
        best = max(measured.values(), key=lambda r: r["measured"])
        top = next((r for r in ranks if int(r["B"]) == B and r.get("rank") == "1"), None)
        first = (int(top["workers"]), int(top["cores_per_worker"]), int(top["sub_batches"])) \
            if top else None
        mine = measured.get(first) if first else None
        by_model = max(measured.values(), key=lambda r: r["predicted"])
        label = lambda r: f"{r['workers']}x{r['cores_per_worker']}"   # noqa: E731
        out.append(dict(
            B=B, choice=(f"{first[0]}x{first[1]}, {first[2]} sub-batch(es)" if first else ""),
            choice_measured=mine["measured"] if mine else "",
            choice_note="" if mine or not first else "not measured (Figure 3 runs one "
                                                     "sub-batch per worker)",
            model_best_measured_partition=label(by_model), its_measured=by_model["measured"],
            best_measured=label(best), best_tokens_per_ms=best["measured"],
            gap=round(1 - by_model["measured"] / best["measured"], 4),
            choice_gap=round(1 - mine["measured"] / best["measured"], 4) if mine else ""))
    return out


def fig4_plot(points, runs: Runs, preds, S, machine, out) -> list[dict]:
    """Figure 4 on one node shared by R ranks (--mpi-split): the node's tokens/ms per R and
    ownership, measured (filled) and predicted (hollow); the paper's per-node numbers noted."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from plots import FIG4_COLOURS, FIG4_LABELS, _wrap
    by_key = {r["config"]: r for r in preds if not r.get("error")}
    rows = []
    for p in (p for p in points if p["figure"] == "fig4"):
        key = config_key(p["spec"])
        rs = [r for (k, _), r in runs.ok.items() if k == key]
        pred = by_key.get(config_key(dict(p["spec"], steps=None)))
        rows.append(dict(series=p["series"], R=int(p["x"]), B=p["spec"]["batch"],
                         partition=f"{p['spec']['workers']}x{p['spec']['cores_per_worker']}",
                         measured=statistics.median(float(r["tokens_per_ms"]) for r in rs)
                         if rs else None,
                         predicted=float(pred["predicted_tokens_per_ms"]) if pred else None))
    if not rows:
        return rows
    f, ax = plt.subplots(figsize=(8, 5))
    one = next((r for r in rows if r["R"] == 1), None)
    for m in ("rank0", "sharded", "pipeline"):
        mr = sorted([r for r in rows if r["series"] == m] + ([one] if one else []),
                    key=lambda r: r["R"])
        xs = [r["R"] for r in mr if r["measured"] is not None]
        ax.plot(xs, [r["measured"] for r in mr if r["measured"] is not None], "o-",
                color=FIG4_COLOURS[m], label=f"{FIG4_LABELS[m]}, measured")
        xp = [r["R"] for r in mr if r["predicted"] is not None]
        ax.plot(xp, [r["predicted"] for r in mr if r["predicted"] is not None], "o--",
                mfc="none", color=FIG4_COLOURS[m], label="predicted")
    for r in rows:
        if r["measured"] is not None:
            ax.annotate(r["partition"], (r["R"], r["measured"]), textcoords="offset points",
                        xytext=(4, -10), fontsize=6)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({r["R"] for r in rows}))
    ax.set_xticklabels([str(x) for x in sorted({r["R"] for r in rows})])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("MPI processes R on the one node, each on cores/R cores "
                  f"({S.get('mpi_reserve', 0)} of them left to StarPU-MPI's thread)")
    ax.set_ylabel("tokens / ms of the node (all ranks)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    ax.set_title(_wrap(
        f"Figure 4 on one {machine['cores']}-core node: mpirun -np R, {S['mpi_batch_per_rank']} "
        f"sequences per rank; {machine['cpu_model']}; StarPU {machine['starpu_version']}, BLAS "
        f"{machine['blas']}; commit {machine['commit']}\nthe paper (one 32-core rank per node, "
        "rank 0 owning all): 2.32 tok/ms per node on 1 node, 1.88 on 16; hollow: the model's "
        "prediction, made before the run", 110), fontsize=8)
    f.tight_layout()
    f.savefig(os.path.join(out, "fig4_mpi.png"), dpi=90)
    plt.close(f)
    write_csv(os.path.join(out, "fig4_mpi.csv"), [dict(r, machine_cores=machine["cores"],
                                                       commit=machine["commit"]) for r in rows])
    return rows


def held_out_errors(rows) -> dict:
    """The model's absolute errors on the held-out points only (a point equal to a
    calibration run is a fit, not a prediction): n, median, largest, and how many in-sample
    points were left out."""
    errs = [abs(r["error"]) for r in rows if not r.get("in_sample")]
    return dict(n=len(errs), in_sample=sum(1 for r in rows if r.get("in_sample")),
                median=statistics.median(errs) if errs else None,
                largest=max(errs) if errs else None)


# ---------------------------------------------------------------- against the paper

TABLE_HEAD = ("| figure | ratio | B | sequences per core | measured | the paper's | the paper's "
              "point |")
TABLE_RULE = "|---|---|---|---|---|---|---|"


def paper_quoted() -> dict:
    """{(figure, series, x): tokens/ms} of experiments/paper_points.csv, and the batch of
    each figure's quoted points."""
    with open(os.path.join(HERE, "paper_points.csv"), newline="") as f:
        return {(r["figure"], r["series"], r["x"]): dict(r, tokens_per_ms=float(r["tokens_per_ms"]))
                for r in csv.DictReader(f)}


def median_tpm(runs: Runs, engine, batch, workers=None, cores_per_worker=None, threads=None):
    """Median tokens/ms of the single-process runs of that configuration, any figure."""
    got = []
    for r in runs.ok.values():
        if (r["engine"] != engine or int(r["batch"]) != int(batch)
                or int(r.get("ranks") or 1) != 1):
            continue
        if workers is not None and (int(r.get("workers") or 0), int(r.get("cores_per_worker")
                                                                    or 0)) != (workers,
                                                                               cores_per_worker):
            continue
        if threads is not None and int(r.get("threads") or 0) != threads:
            continue
        got.append(float(r["tokens_per_ms"]))
    return statistics.median(got) if got else None


def ratio(a, b):
    return round(a / b, 4) if a is not None and b else None


def paper_table(points, runs: Runs, cores: int, fig4_rows) -> list[dict]:
    """The paper's claims as scale-free ratios, measured on this node beside the paper's:
    Figure 2: StarPU 1 x N and N x 1 against llm.c on all N cores at each batch measured
    (llm.c also at --llmc-batches); Figure 3: the best partition against 1 x N, and N x 1
    against 1 x N, at each batch; Figure 4: each R's per-rank tokens/ms against one process."""
    q = paper_quoted()
    pc = lambda k: q[k]["tokens_per_ms"] if k in q else None       # noqa: E731
    P = 36
    llmc_p, tensor_p, data_p = (pc(("fig2b", s, str(P))) for s in ("reference", "tensor", "data"))
    out = []
    batches = sorted({int(r["batch"]) for r in runs.ok.values() if r["engine"] == "llmc"
                      and int(r.get("threads") or 0) == cores})
    for B in batches:
        ll = median_tpm(runs, "llmc", B, threads=cores)
        for name, n, k, paper in ((f"StarPU 1x{cores} / llm.c", 1, cores,
                                   ratio(tensor_p, llmc_p)),
                                  (f"StarPU {cores}x1 / llm.c", cores, 1, ratio(data_p, llmc_p))):
            out.append(dict(figure="2", ratio=name, B=B, per_core=round(B / cores, 2),
                            measured=ratio(median_tpm(runs, "starpu", B, n, k), ll),
                            paper=paper, paper_point=f"{P} cores, B=72 (2 per core)",
                            llmc=ll))
    fig3 = sorted({p["spec"]["batch"] for p in points if p["figure"] == "fig3"})
    for B in fig3:
        parts = {(int(p["spec"]["workers"]), int(p["spec"]["cores_per_worker"])):
                 median_tpm(runs, "starpu", B, int(p["spec"]["workers"]),
                            int(p["spec"]["cores_per_worker"]))
                 for p in points if p["figure"] == "fig3" and p["spec"]["batch"] == B}
        parts = {nk: v for nk, v in parts.items() if v is not None}
        one = parts.get((1, cores))
        best = max(parts, key=parts.get) if parts else None
        out.append(dict(figure="3", ratio=f"best ({best[0]}x{best[1]}) / 1x{cores}" if best
                        else f"best / 1x{cores}", B=B, per_core=round(B / cores, 2),
                        measured=ratio(parts.get(best), one) if best else None,
                        paper=None, paper_point="B=360 (10 per core): best 12x3 2.70, 3x12 "
                        "2.53; 1x36 not quoted"))
        out.append(dict(figure="3", ratio=f"{cores}x1 / 1x{cores}", B=B,
                        per_core=round(B / cores, 2), measured=ratio(parts.get((cores, 1)), one),
                        paper=ratio(pc(("fig3", "B=72", f"{P}x1")), pc(("fig3", "B=72",
                                                                         f"1x{P}"))),
                        paper_point=f"{P} cores, B=72 (2 per core)"))
    one = next((r["measured"] for r in fig4_rows if r["R"] == 1 and r["measured"]), None)
    p1, p16 = pc(("fig4", "StarPU-MPI", "1")), pc(("fig4", "StarPU-MPI", "16"))
    for r in sorted(fig4_rows, key=lambda r: (r["R"], r["series"])):
        if r["R"] == 1 or r["measured"] is None:
            continue
        out.append(dict(figure="4", ratio=f"per-rank tok/ms, R={r['R']} {r['series']} / R=1",
                        B=r["B"], per_core="", measured=ratio(r["measured"] / r["R"], one),
                        paper=ratio(p16, p1), paper_point="per node, 16 nodes / 1 node "
                        "(rank 0 owns all; one 32-core rank per node)"))
    return out


def table_line(t) -> str:
    f = lambda v: "-" if v is None or v == "" else f"{v:.2f}"    # noqa: E731
    return (f"| {t['figure']} | {t['ratio']} | {t['B']} | {t['per_core']} | {f(t['measured'])} | "
            f"{f(t['paper'])} | {t['paper_point']} |")


def fig2_overlay(table, fig, points) -> list[dict]:
    """Where the paper's StarPU / llm.c ratios put each StarPU series on this node's llm.c
    (Figure 2's batch at all cores), for plots.figure's overlay."""
    out = []
    for p in points:
        if p["figure"] != fig or p["series"] != "llmc":
            continue
        for t in table:
            if t["figure"] == "2" and t["B"] == p["spec"]["batch"] and t["paper"] and \
                    t.get("llmc") and int(p["x"]) == int(p["spec"].get("threads") or 0):
                series = "tensor" if t["ratio"].startswith("StarPU 1x") else "data"
                out.append(dict(x=p["x"], series=series, tokens_per_ms=t["llmc"] * t["paper"],
                                label=f"paper's ratio {t['paper']:.2f}"))
    return out


def summary(machine, S, rows, choices, runs: Runs, fig4, out_dir, table=()) -> str:
    errs = [abs(r["error"]) for r in rows if not r.get("in_sample")]
    n_in = sum(1 for r in rows if r.get("in_sample"))
    shown = (os.path.relpath(out_dir, ROOT) if os.path.abspath(out_dir).startswith(ROOT + os.sep)
             else out_dir)
    L = [f"# The paper's evaluation on {machine['cores']} cores: {machine['cpu_model']}", "",
         f"- {machine['cpu']}; StarPU {machine['starpu_version']}, BLAS {machine['blas']}, "
         f"commit {machine['commit']}, host {machine['host']}",
         f"- GPT-2 model {S['model']}, T={S['T']}; one run a point, {S.get('warmup', 1)} "
         f"warm-up step(s) then the timed steps of the `steps` column (sized to the device "
         f"minutes from the prediction)" + ("; tokens/ms of the median timed step"
                                            if S.get("warmup", 1) > 1 else ""),
         f"- files in `{shown}/`", ""]
    if errs:
        med, worst = statistics.median(errs), max(errs)
        cal = S.get("calibration_runs") or "every partition"
        L += [f"**The model** (calibrate --quick on the node on {cal}; every point predicted "
              f"before it ran): absolute error over {len(errs)} held-out StarPU configurations "
              f"median {med:.1%}, largest {worst:.1%} (the issue's goal: <= {GOAL[0]:.0%} and "
              f"<= {GOAL[1]:.0%}); {n_in} point(s) equal to a calibration run (in-sample) left "
              "out of these figures.", ""]
    if rows:
        L += ["| figures | B | partition | ranks | mode | steps | measured tok/ms | predicted | "
              "error | |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in sorted(rows, key=lambda r: (r["figures"], r["B"], r["workers"])):
            L.append(f"| {r['figures']} | {r['B']} | {r['workers']}x{r['cores_per_worker']} | "
                     f"{r['ranks']} | {r['mode']} | {r['steps']} | {r['measured']:.4f} | "
                     f"{r['predicted']:.4f} | {r['error']:+.1%} | "
                     f"{'in-sample' if r.get('in_sample') else 'held out'} |")
        L.append("")
    if table:
        L += ["**Against the paper** (scale-free ratios; the paper's node: 36 cores, its numbers "
              "from experiments/paper_points.csv):", "", TABLE_HEAD, TABLE_RULE]
        L += [table_line(t) for t in table]
        L.append("")
    if choices:
        L += ["**The autotuner** (its ranking made on the node before any run) against the best "
              "measured partition of Figure 3:", "",
              "| B | its choice | measured | the model's best of the measured partitions | "
              "measured | best measured | tok/ms | gap |", "|---|---|---|---|---|---|---|---|"]
        for c in choices:
            cm = f"{c['choice_measured']:.4f}" if c["choice_measured"] != "" else c["choice_note"]
            L.append(f"| {c['B']} | {c['choice']} | {cm} | {c['model_best_measured_partition']} | "
                     f"{c['its_measured']:.4f} | {c['best_measured']} | "
                     f"{c['best_tokens_per_ms']:.4f} | {c['gap']:.1%} |")
        L.append("")
    if fig4:
        L += ["**Figure 4** (the node's tokens/ms, all ranks):", "",
              "| R | mode | partition per rank | B | measured | predicted |",
              "|---|---|---|---|---|---|"]
        for r in sorted(fig4, key=lambda r: (r["R"], r["series"])):
            f = lambda v: "-" if v is None else f"{v:.4f}"   # noqa: E731
            L.append(f"| {r['R']} | {r['series']} | {r['partition']} | {r['B']} | "
                     f"{f(r['measured'])} | {f(r['predicted'])} |")
        L.append("")
    missing = [r for r in runs.rows if r.get("error")]
    missing = [r for r in missing if (r["config"], int(r["repeat"])) not in runs.ok]
    if missing:
        L += [f"**Not measured** ({len(missing)}):", ""]
        L += [f"- {r['engine']} {r.get('workers') or ''}x{r.get('cores_per_worker') or ''} "
              f"threads={r.get('threads') or ''} B={r['batch']} ranks={r.get('ranks') or 1}"
              + (f" {r.get('ownership') or ''}" if r.get("ranks") else "")
              + (f" {r['pipeline_stages']} stages" if r.get("pipeline_stages") else "")
              + f": {r['error']}" for r in missing]
        L.append("")
    return "\n".join(L)


def device_kind(rows, loaded) -> str:
    """The device machine the node came with (its CPUs report the same name on the H100 and
    the H200 machines): the runs' device_kind, else 00-status.txt's or env.txt's line."""
    kinds = {r.get("device_kind") for r in rows if r.get("device_kind")}
    if kinds:
        return sorted(kinds)[-1]
    for files in reversed(loaded):
        for name in ("00-status.txt", "env.txt"):
            for line in files.get(name, "").splitlines():
                if "device machine " in line:
                    return line.split("device machine ", 1)[1].split()[0].strip(";,")
    return "unknown-device"


def whatif(calibration, out) -> None:
    """experiments/whatif_paper_node.py with the calibration measured on the node: its
    output and CSV beside the results."""
    import whatif_paper_node
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        whatif_paper_node.main(["--calibration", calibration, "--csv",
                                os.path.join(out, "whatif_paper_node.csv")])
    with open(os.path.join(out, "whatif_paper_node.txt"), "w") as f:
        f.write(buf.getvalue())
    print(buf.getvalue())


DOCS_BEGIN = "<!-- eval16:begin (experiments/eval16_report.py writes this block) -->"
DOCS_END = "<!-- eval16:end -->"


def fill_docs(path, machine, out, table, errors) -> None:
    """The block between DOCS_BEGIN and DOCS_END in the doc: the node, the figures, the
    ratio table against the paper and the model's errors on the held-out points."""
    with open(path) as f:
        text = f.read()
    if DOCS_BEGIN not in text or DOCS_END not in text:
        raise ReportError(f"{path}: no eval16 block ({DOCS_BEGIN} ... {DOCS_END}); add one "
                          "where the 16-core figures go")
    shown = os.path.relpath(out, ROOT) if os.path.abspath(out).startswith(ROOT + os.sep) else out
    L = [DOCS_BEGIN, "",
         f"Measured on {machine['cpu_model']} ({machine['cores']} cores, the "
         f"{machine['device_kind']} device machine), StarPU {machine['starpu_version']}, BLAS "
         f"{machine['blas']}, commit {machine['commit']}; files in `{shown}/`.", ""]
    if errors["n"]:
        L += [f"The model on the {errors['n']} held-out points: median absolute error "
              f"{errors['median']:.1%}, largest {errors['largest']:.1%} ({errors['in_sample']} "
              "in-sample point(s), equal to a calibration run, left out).", ""]
    else:
        L += ["The model: no held-out point measured.", ""]
    L += ["![Figure 2a](figures/eval16_fig2a_weak.png) ![Figure 2b](figures/eval16_fig2b_strong.png)",
          "![Figure 3](figures/eval16_fig3_partitions.png) ![Figure 4](figures/eval16_fig4_mpi.png)",
          ""]
    if table:
        L += [TABLE_HEAD, TABLE_RULE] + [table_line(t) for t in table] + [""]
    L.append(DOCS_END)
    head, rest = text.split(DOCS_BEGIN, 1)
    tail = rest.split(DOCS_END, 1)[1]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(head + "\n".join(L) + tail)
    os.replace(tmp, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", help="what the device tool brought back")
    ap.add_argument("--results", help="default experiments/results/eval16/<cpu kind>")
    ap.add_argument("--png-dir", default=os.path.join(ROOT, "docs", "figures"),
                    help="where the PNGs are also copied, as eval16_*.png ('' for none)")
    ap.add_argument("--docs", default=os.path.join(ROOT, "docs", "figures.md"),
                    help="the doc whose eval16 block gets the table and the errors ('' for none)")
    ap.add_argument("--no-whatif", action="store_true", help="do not rerun "
                    "experiments/whatif_paper_node.py with the node's calibration")
    args = ap.parse_args(argv)
    try:
        loaded = [load_folder(f) for f in args.folders]
    except (ReportError, OSError) as e:
        print(f"eval16_report.py: {e}", file=sys.stderr)
        return 2
    if args.docs and not os.path.exists(args.docs):
        print(f"eval16_report.py: --docs {args.docs}: no such file ('' for none)",
              file=sys.stderr)
        return 2
    runs_rows, pred_rows, rank_rows, points = [], [], [], {}
    for files in loaded:
        runs_rows += rows_of(files["runs.csv"])
        pred_rows += rows_of(files.get("predictions.csv", ""))
        rank_rows += rows_of(files.get("autotune_rank.csv", ""))
        plan = json.loads(files["points.json"])
        S = plan["settings"]
        for p in plan["points"]:
            points[(config_key(p["spec"]), p["figure"], p["series"], str(p["x"]))] = p
    points = list(points.values())
    from figures import calibration_runs, mark_in_sample
    # a calibration of every partition (before issue 42) made every point it ran in-sample
    mark_in_sample(points, calibration_runs(S.get("calibration_runs") or (
        ",".join(f"{n}x{S['cores'] // n}" for n in range(1, S["cores"] + 1)
                 if S["cores"] % n == 0) + ":1,6")))
    try:
        machine = machine_of(runs_rows)
    except ReportError as e:
        print(f"eval16_report.py: {e}", file=sys.stderr)
        return 2
    kinds = {kind_of(r.get("cpu_model", ""), r.get("isa", "").split()) for r in runs_rows
             if r.get("cpu_model")}
    if len(kinds) > 1:
        print(f"eval16_report.py: runs of several CPU kinds ({', '.join(sorted(kinds))}): "
              "report each kind's folders apart", file=sys.stderr)
        return 2
    machine["device_kind"] = device_kind(runs_rows, loaded)
    # the folder names the machine: CPU kind, cores, the device machine it came with
    out = args.results or os.path.join(RESULTS, f"{kinds.pop()}-"
                                       f"{machine['cores']}c-{machine['device_kind']}")
    os.makedirs(out, exist_ok=True)
    last = loaded[-1]
    for name in RAW:
        if name in ("runs.csv", "predictions.csv", "autotune_rank.csv"):
            continue
        if name in last:
            with open(os.path.join(out, name), "w") as f:
                f.write(last[name])
    for name, rows in (("runs.csv", runs_rows), ("predictions.csv", pred_rows),
                       ("autotune_rank.csv", rank_rows)):
        if rows:
            fields = list(dict.fromkeys(k for r in rows for k in r))
            write_csv(os.path.join(out, name), [{k: r.get(k, "") for k in fields} for r in rows])
    runs = Runs(runs_rows)
    steps = sorted({int(p["spec"]["steps"]) for p in points})
    S = dict(S, steps=f"{steps[0]}-{steps[-1]}" if len(steps) > 1 else steps[0])
    peaks = peaks_of(last.get("calibration.toml"))
    import plots
    log = print
    fig4 = fig4_plot(points, runs, pred_rows, S, machine, out)
    table = paper_table(points, runs, machine["cores"], fig4)
    for fig in ("fig2a", "fig2b", "fig3"):
        if any(p["figure"] == fig for p in points):
            plots.figure(fig, points, runs, S, machine, peaks, out, 1, log,
                         overlay=fig2_overlay(table, fig, points) if fig != "fig3" else None)
    if table:
        write_csv(os.path.join(out, "paper_table.csv"), table)
    rows = validation(points, runs, pred_rows)
    choices = autotuner(points, runs, rank_rows, rows)
    if rows:
        write_csv(os.path.join(out, "validation.csv"), rows)
        from perfmodel_validation import plot
        plot(rows, os.path.join(out, "validation.png"),
             f"{S['model']} T={S['T']}, {machine['cpu']}, {machine['commit']}; predicted "
             "before measured")
    if choices:
        write_csv(os.path.join(out, "autotune.csv"), choices)
    md = summary(machine, S, rows, choices, runs, fig4, out, table)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(md + "\n")
    print(md)
    if not args.no_whatif and last.get("calibration.toml"):
        whatif(os.path.join(out, "calibration.toml"), out)
    if args.docs:
        try:
            fill_docs(args.docs, machine, out, table, held_out_errors(rows))
        except ReportError as e:
            print(f"eval16_report.py: {e}", file=sys.stderr)
            return 2
    if args.png_dir:
        os.makedirs(args.png_dir, exist_ok=True)
        for f in sorted(os.listdir(out)):
            if f.endswith(".png"):
                plots.shrink_png(os.path.join(out, f), 300_000)
                shutil.copy(os.path.join(out, f), os.path.join(args.png_dir, "eval16_" + f))
    print(f"wrote {out}" + (f" and {args.png_dir}/eval16_*.png" if args.png_dir else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
