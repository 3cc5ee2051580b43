"""The figures' plots (matplotlib) and CSVs, from the runs cache (figures.py) and the paper's
quoted points (paper_points.csv)."""
from __future__ import annotations

import csv
import json
import os
import statistics

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

import taskgraph  # noqa: E402
from series import SERIES, config_key, flops_per_token  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
PAPER_NODE = "paper: 2x Xeon Gold 6240, 36 cores, StarPU 1.4.10, MKL"


def paper_points(figure: str) -> list[dict]:
    with open(os.path.join(HERE, "paper_points.csv"), newline="") as f:
        return [r for r in csv.DictReader(f) if r["figure"] == figure]


def shrink_png(path: str, limit: int) -> None:
    """Re-encode a PNG with a palette (and, if still needed, smaller) until under limit bytes."""
    if os.path.getsize(path) <= limit:
        return
    from PIL import Image
    img = Image.open(path).convert("RGB")
    scale = 1.0
    while True:
        im = img if scale == 1.0 else img.resize((int(img.width * scale), int(img.height * scale)),
                                                 Image.LANCZOS)
        im.quantize(colors=64, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)
        if os.path.getsize(path) <= limit or scale < 0.3:
            return
        scale *= 0.85


def _subtitle(S, machine, extra=""):
    return (f"{machine['cpu_model']}, {machine['cores']} cores; StarPU {machine['starpu_version']}, "
            f"BLAS {machine['blas']}, torch {machine['torch_version']}; commit {machine['commit']}"
            + (f"\n{extra}" if extra else ""))


def _wrap(text, width):
    """Each line of a title wrapped at width characters."""
    import textwrap
    return "\n".join(w for line in text.split("\n") for w in textwrap.wrap(line, width) or [""])


def _logy(ax):
    """A log y axis labelled with plain numbers."""
    from matplotlib.ticker import FuncFormatter, LogLocator
    ax.set_yscale("log")
    fmt = FuncFormatter(lambda y, _: f"{y:g}")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(fmt)
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda y, _: ""))


def _model(S):
    return "GPT-2 124M" if S["model"] in ("d12", "gpt2") else f"model {S['model']} (pipeline test)"


def _stats(values):
    return statistics.median(values), min(values), max(values)


def _runs(points, cache, repeat):
    """{(series, x): [rows of the runs cache]} for these points."""
    out = {}
    for p in points:
        rows = [cache.get(config_key(p["spec"]), r) for r in range(1, repeat + 1)]
        out[(p["series"], p["x"])] = (p, [r for r in rows if r is not None])
    return out


def _write_fig_csv(path, fig, runs, S, machine, peaks, extra=None):
    rows = []
    for (series, x), (p, rs) in runs.items():
        spec = p["spec"]
        fpt = flops_per_token(spec["model"], spec["seq_len"])
        ranks = int(spec.get("ranks") or 1)
        per_rank_cores = (spec.get("workers", 1) * spec.get("cores_per_worker", 1)) if ranks > 1 else \
            int(spec.get("cpus") or machine["cores"])
        peak = peaks.get(per_rank_cores)
        for r in rs:
            tpm = float(r["tokens_per_ms"])
            row = dict(figure=fig, series=series, x=x, repeat=r["repeat"],
                       tokens_per_ms=round(tpm, 5), ms_per_step=round(float(r["ms_per_step"]), 1),
                       step_ms=r["step_ms"], peak_rss_mb=r["peak_rss_mb"],
                       flops_per_token=int(fpt), sgemm_peak_gflops=peak,
                       utilisation=(round(fpt * tpm / ranks * 1e3 / (peak * 1e9), 4) if peak else ""),
                       scale=S["scale"])
            row.update({k: r[k] for k in ("engine", "model", "batch", "seq_len", "steps", "workers",
                                          "cores_per_worker", "kcore", "sub_batches", "threads", "cpus",
                                          "ranks", "describe", "when")})
            if extra:
                row.update(extra(p, r))
            row.update({k: machine[k] for k in ("cpu_model", "starpu_version", "blas",
                                                "torch_version", "commit", "host")})
            row["machine_cores"] = machine["cores"]
            rows.append(row)
    from starpu_llm.perf.runs import write_csv
    if rows:
        write_csv(path, rows)
    return rows


def _annotate_paper(ax, pts, colour_of, xkey=float):
    right = max((xkey(q["x"]) for q in pts), default=0)
    for q in pts:
        x, y = xkey(q["x"]), float(q["tokens_per_ms"])
        c = colour_of(q)
        ax.plot([x], [y], marker="*", ms=13, mfc="none", mec=c, mew=1.5, ls="none", zorder=5)
        at_right = x >= right
        ax.annotate(f"{q['label']}: {y:g}", (x, y), textcoords="offset points",
                    xytext=(-6 if at_right else 6, 6), ha="right" if at_right else "left",
                    fontsize=7, color=c)


FIG4_COLOURS = {"one process": "k", "rank0": "#1f77b4", "sharded": "#2ca02c",
                "pipeline": "#ff7f0e"}
FIG4_LABELS = {"rank0": "rank 0 owns all (the paper's)", "sharded": "sharded data parallelism",
               "pipeline": "pipeline, a stage per rank"}


def figure(fig, points, cache, S, machine, peaks, out, repeat, log, predicted=None,
           overlay=None):
    """overlay (Figures 2a, 2b): extra hollow diamonds, dicts of x, tokens_per_ms, series and
    label (eval16_report.py: where the paper's ratio to llm.c puts each StarPU series)."""
    pts = [p for p in points if p["figure"] == fig]
    if not pts:
        return None
    runs = _runs(pts, cache, repeat)
    csv_path = os.path.join(out, f"{fig}_{ {'fig2a': 'weak', 'fig2b': 'strong', 'fig3': 'partitions', 'fig4': 'mpi'}[fig] }.csv")
    png = csv_path[:-4] + ".png"
    headline = {}
    stat = {k: _stats([float(r["tokens_per_ms"]) for r in rs]) for k, (p, rs) in runs.items() if rs}
    missing = [k for k, (p, rs) in runs.items() if len(rs) < repeat]
    if missing:
        log(f"  {fig}: {len(missing)} point(s) with fewer than {repeat} good runs: {missing}")
    fpt = flops_per_token(S["model"], S["T"])
    formula = (f"utilisation = model FLOPs/token ({fpt / 1e6:.0f} M: 3 x [L(24C² + 2C(T+1)) + 2C·Vp]) "
               f"x tokens/s / sgemm peak of the cores used (experiments/sgemm_peak.py)")
    stats_note = (f"median of {repeat} interleaved runs, bars min-max; {S['steps']} timed steps "
                  f"after {S.get('warmup', 1)} warm-up"
                  + (" (a run's median step)" if S.get("warmup", 1) > 1 else "")
                  + f", T={S['T']}")

    if fig in ("fig2a", "fig2b"):
        extra = None
        _write_fig_csv(csv_path, fig, runs, S, machine, peaks)
        weak = fig == "fig2a"
        paper = paper_points(fig)
        f, (ax, au) = plt.subplots(2, 1, figsize=(9, 8.2), sharex=True,
                                   gridspec_kw=dict(height_ratios=[3, 1.4]))
        series = list(dict.fromkeys(p["series"] for p in pts))
        xs_all = sorted({p["x"] for p in pts})
        for s in series:
            label, colour, marker = SERIES[s]
            xs = [x for x in xs_all if (s, x) in stat]
            if not xs:
                continue
            med = [stat[(s, x)][0] for x in xs]
            lo = [stat[(s, x)][0] - stat[(s, x)][1] for x in xs]
            hi = [stat[(s, x)][2] - stat[(s, x)][0] for x in xs]
            ax.errorbar(xs, med, yerr=[lo, hi], label=label, color=colour, marker=marker,
                        capsize=4, lw=1.6, ms=6)
            ut = [fpt * m * 1e3 / (peaks[x] * 1e9) * 100 for x, m in zip(xs, med) if peaks.get(x)]
            if len(ut) == len(xs):
                au.plot(xs, ut, color=colour, marker=marker, lw=1.2)
            headline[s] = {x: round(stat[(s, x)][0], 4) for x in xs}
        for q in overlay or []:
            c = SERIES.get(q["series"], (None, "k"))[1]
            ax.plot([q["x"]], [q["tokens_per_ms"]], marker="D", ms=8, mfc="none", mec=c, mew=1.4,
                    ls="none", zorder=5)
            ax.annotate(q["label"], (q["x"], q["tokens_per_ms"]), textcoords="offset points",
                        xytext=(-6, -12), ha="right", fontsize=6.5, color=c)
        if overlay:
            ax.plot([], [], marker="D", ms=7, mfc="none", mec="k", ls="none",
                    label="the paper's ratio to llm.c, applied to this llm.c")
        if weak and ("reference", 1) in stat:
            ideal = [stat[("reference", 1)][0] * x for x in xs_all]
            ax.plot(xs_all, ideal, ls=":", color="#999999", lw=1, label="linear from the reference on 1 core")
        if paper:
            colour_of = {"reference": SERIES["reference"][1], "tensor": SERIES["tensor"][1],
                         "data": SERIES["data"][1]}
            _annotate_paper(ax, paper, lambda q: colour_of.get(q["series"], "k"))
            ax.plot([], [], marker="*", ms=11, mfc="none", mec="k", ls="none",
                    label=f"quoted in the paper ({PAPER_NODE}; B={paper[0]['batch']})")
            ax.set_xscale("log", base=2)
            _logy(ax)
            ticks = sorted(set(xs_all) | {int(float(q["x"])) for q in paper})
            ax.set_xticks(ticks)
            ax.set_xticklabels([str(t) for t in ticks])
        else:
            ax.set_xticks(xs_all)
            ax.set_ylim(bottom=0)
        batch = ("batch = " + f"{S['weak_per_core']} x cores" if weak else f"batch = {S['strong_batch']}")
        scale_note = ""
        if S["scale"] == "quick":
            scale_note = ("QUICK SCALE: batch scaled down, "
                          + (f"{S['weak_per_core']} sequence(s)/core (paper: 6)" if weak
                             else f"total batch {S['strong_batch']} (paper: 72)"))
        ax.set_title(_wrap(("Figure 2a: weak scaling (" if weak else "Figure 2b: strong scaling (")
                           + f"{batch}), {_model(S)}\n" + _subtitle(S, machine, "; ".join(
                               x for x in (scale_note, stats_note) if x)), 120), fontsize=8.5)
        ax.set_ylabel("tokens / ms")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7.5, loc="upper left")
        au.set_ylabel("% of sgemm peak\n(of the k cores)")
        au.set_xlabel("cores (k)")
        au.grid(alpha=0.3)
        au.set_ylim(bottom=0)
        au.set_title(_wrap(formula, 130), fontsize=7)
    elif fig == "fig3":
        _write_fig_csv(csv_path, fig, runs, S, machine, peaks)
        paper = paper_points("fig3")
        f, (ax, ap) = plt.subplots(1, 2, figsize=(11, 5.2), gridspec_kw=dict(width_ratios=[3, 1.3]))
        labels = list(dict.fromkeys(p["x"] for p in pts))
        series = list(dict.fromkeys(p["series"] for p in pts))
        cmap = plt.get_cmap("viridis")
        for i, s in enumerate(series):
            xs = [j for j, x in enumerate(labels) if (s, x) in stat]
            if not xs:
                continue
            med = [stat[(s, labels[j])][0] for j in xs]
            lo = [m - stat[(s, labels[j])][1] for m, j in zip(med, xs)]
            hi = [stat[(s, labels[j])][2] - m for m, j in zip(med, xs)]
            off = (i - (len(series) - 1) / 2) * 0.08
            ax.errorbar([j + off for j in xs], med, yerr=[lo, hi], marker="o", capsize=4, ls="-",
                        color=cmap(i / max(1, len(series) - 1) * 0.85), label=f"total {s}")
            headline[s] = {labels[j]: round(m, 4) for j, m in zip(xs, med)}
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels([l.replace(" ", "\n") for l in labels])
        ax.set_xlabel("partition: n workers x k cores (n sub-batches in parallel, k-core tasks)")
        ax.set_ylabel("tokens / ms")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        peak = peaks.get(S["cores"])
        if peak:
            sec = ax.secondary_yaxis("right", functions=(lambda y: fpt * y * 1e3 / (peak * 1e9) * 100,
                                                         lambda u: u * peak * 1e9 / (fpt * 1e3) / 100))
            sec.set_ylabel(f"% of the {S['cores']}-core sgemm peak ({peak:.0f} GFLOP/s)")
        scale_note = (f"QUICK SCALE: total batches {', '.join(str(b) for b in S['fig3_batches'])} "
                      "(paper: up to 360 on 36 cores)" if S["scale"] == "quick" else "")
        ax.set_title(_wrap(f"Figure 3: every partition of the {S['cores']}-core node, {_model(S)}\n"
                           + _subtitle(S, machine, "; ".join(x for x in (scale_note, stats_note) if x)),
                           115), fontsize=8)
        for j, q in enumerate(paper):
            ap.bar(j, float(q["tokens_per_ms"]), color="#bbbbbb", edgecolor="k")
            ap.text(j, float(q["tokens_per_ms"]) + 0.03, f"{float(q['tokens_per_ms']):g}",
                    ha="center", fontsize=8)
        ap.set_xticks(range(len(paper)))
        ap.set_xticklabels([f"{q['x']}\nB={q['batch']}" for q in paper], fontsize=8)
        ap.set_title("quoted in the paper\n(36-core node: 2x Xeon Gold 6240)", fontsize=8)
        ap.set_ylabel("tokens / ms")
        ap.grid(alpha=0.3, axis="y")
    elif fig == "fig4":
        one = ("one process", 1)
        base_ms = (statistics.median(float(r["ms_per_step"]) for r in runs[one][1])
                   if one in runs and runs[one][1] else None)

        def extra(p, r):
            R = int(p["x"])
            return dict(tokens_per_ms_per_rank=round(float(r["tokens_per_ms"]) / R, 5),
                        overhead_ms_vs_1_rank=(round(float(r["ms_per_step"]) - base_ms, 1)
                                               if base_ms else ""),
                        ownership=p["spec"].get("ownership", ""),
                        pipeline_stages=p["spec"].get("pipeline_stages", ""))
        _write_fig_csv(csv_path, fig, runs, S, machine, peaks, extra)
        paper = paper_points("fig4")
        f, (ax, ao, ap) = plt.subplots(3, 1, figsize=(8.5, 10.5),
                                       gridspec_kw=dict(height_ratios=[3, 1.5, 3]))
        modes = [m for m in FIG4_COLOURS if m != "one process" and any(p["series"] == m for p in pts)]
        xs_all = sorted({int(p["x"]) for p in pts})
        for m in modes:
            xs = [x for x in xs_all if (m, x) in stat or (x == 1 and one in stat)]
            key = [one if x == 1 else (m, x) for x in xs]
            med = [stat[k][0] / x for k, x in zip(key, xs)]
            lo = [md - stat[k][1] / x for md, k, x in zip(med, key, xs)]
            hi = [stat[k][2] / x - md for md, k, x in zip(med, key, xs)]
            ax.errorbar(xs, med, yerr=[lo, hi], marker="o", capsize=4, color=FIG4_COLOURS[m],
                        label=f"{FIG4_LABELS[m]} ({S['mpi_workers']}x{S['mpi_cores']} per rank)")
            headline[m] = {x: round(stat[k][0] / x, 4) for k, x in zip(key, xs)}
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs_all)
        ax.set_xticklabels([str(t) for t in xs_all])
        ax.set_ylabel("tokens / ms per process")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7.5, loc="best")
        one_node = not S["mpirun_args"]
        note = ("ALL RANKS ON THIS ONE MACHINE (each pinned to its own cores): measures the "
                "StarPU-MPI path, not a cluster" if one_node else "")
        scale_note = (f"QUICK SCALE: {S['mpi_batch_per_rank']} sequences per rank" if S["scale"] == "quick" else "")
        ax.set_title(_wrap(f"Figure 4: weak scaling over MPI processes (mpirun -np R), {_model(S)}, "
                           "by who owns the parameters\n"
                           + _subtitle(S, machine, "; ".join(x for x in (note, scale_note, stats_note) if x)),
                           115), fontsize=8)
        if base_ms:
            width = 0.8 / max(1, len(modes))
            overhead = {}
            for i, m in enumerate(modes):
                xs = [x for x in xs_all if x > 1 and (m, x) in runs and runs[(m, x)][1]]
                ov = [statistics.median(float(r["ms_per_step"]) for r in runs[(m, x)][1]) - base_ms
                      for x in xs]
                pos = [xs_all.index(x) + (i - (len(modes) - 1) / 2) * width for x in xs]
                ao.bar(pos, ov, width=width, color=FIG4_COLOURS[m], edgecolor="k",
                       label=FIG4_LABELS[m])
                for x, o, q in zip(xs, ov, pos):
                    ao.text(q, o, f"{o:+.0f}", ha="center", va="bottom", fontsize=7)
                overhead[m] = {x: round(o) for x, o in zip(xs, ov)}
            headline["overhead_ms"] = overhead
            ao.set_xticks(range(len(xs_all)))
            ao.set_xticklabels([f"R={x}" for x in xs_all])
            ao.axhline(0, color="k", lw=0.6)
            ao.margins(y=0.25)
        ao.set_ylabel("ms per iteration\nabove 1 process")
        ao.set_title("what sharing the model across ranks costs per iteration (step time minus the "
                     "1-process step time, same work per process)", fontsize=7.5)
        ao.grid(alpha=0.3, axis="y")
        headline["total"] = {f"{s} {x}": round(stat[(s, x)][0], 4) for (s, x) in stat}
        if predicted:
            for m in dict.fromkeys(r["series"] for r in predicted if r["series"] != "one process"):
                rows = [r for r in predicted if r["series"] in (m, "one process")]
                xs = [int(r["x"]) for r in rows]
                ys = [float(r["tokens_per_ms_per_node"]) for r in rows]
                colour = FIG4_COLOURS.get(m.split(" ")[0], "#9467bd")
                ap.plot(xs, ys, marker="o", color=colour, label=f"{m} (predicted)")
                last = rows[-1]
                ap.annotate(f"{float(last['efficiency']):.0%}", (xs[-1], ys[-1]),
                            textcoords="offset points", xytext=(6, 0), fontsize=7, color=colour,
                            va="center")
            _annotate_paper(ap, paper, lambda q: "k")
            ap.plot([], [], marker="*", ms=11, mfc="none", mec="k", ls="none",
                    label="measured in the paper (rank0, StarPU 1.4's tree reduction)")
            ap.set_xscale("log", base=2)
            ticks = sorted({int(r["x"]) for r in predicted})
            ap.set_xticks(ticks)
            ap.set_xticklabels([str(t) for t in ticks])
            ap.set_xlim(0.8, 24)
            ap.set_xlabel("MPI processes R (one per node)")
            ap.set_ylabel("tokens / ms per node")
            ap.grid(alpha=0.3, which="both")
            ap.legend(fontsize=7, loc="best")
            ap.set_title(_wrap(f"Predicted for the paper's node ({predicted[0]['machine']}; 4 workers "
                               f"x 8 cores, 72 sequences per node) by the task-graph model "
                               f"(starpu-llm predict), per-node efficiency at 16 nodes labelled", 115),
                         fontsize=7.5)
            headline["predicted_efficiency_16"] = {r["mode"]: r["efficiency"] for r in predicted
                                                   if int(r["x"]) == 16}
        else:
            ap.set_axis_off()
            ap.text(0.5, 0.5, "no prediction: this machine has no calibration", ha="center",
                    transform=ap.transAxes)
    f.tight_layout()
    f.savefig(png, dpi=90)
    plt.close(f)
    log(f"  {fig}: {csv_path}, {png}: {json.dumps(headline)}")
    table = []
    for (series, x), (p, rs) in runs.items():
        if not rs:
            continue
        spec = p["spec"]
        R = int(spec.get("ranks") or 1)
        c = spec["workers"] * spec["cores_per_worker"] if R > 1 else int(spec.get("cpus") or S["cores"])
        med, lo, hi = stat[(series, x)]
        peak = peaks.get(c)
        table.append(dict(series=series, label=SERIES.get(series, (series,))[0], x=x,
                          batch=spec["batch"], median=med, min=lo, max=hi, runs=len(rs),
                          ms_per_step=statistics.median(float(r["ms_per_step"]) for r in rs),
                          util_pct=(100 * fpt * med / R * 1e3 / (peak * 1e9)) if peak else None))
    return {"headline": headline, "table": table, "png": png, "csv": csv_path,
            "missing": missing}


def gantt(r, workers, png, S, machine) -> dict:
    """One iteration (the last traced one) as a Gantt chart: a row per worker, tasks coloured
    by phase, idle time white, the dependency critical path outlined and drawn on its own row."""
    events = taskgraph.load_events(r["events"])
    subs = r.get("sub_batches") or workers
    it = taskgraph.iterations(events, subs)[-1]
    t0 = min(e.start for e in it)
    t1 = max(e.end for e in it)
    makespan = (t1 - t0) / 1e6
    path, crit = taskgraph.critical_path(it)
    on_path = {e.i for e in path}
    rows = sorted({e.worker for e in it})
    # idle: the share of the partition's core time (n x k cores over the iteration) that no
    # task held; a task of k cores holds k of them
    ncores = workers * int(r["cores_per_worker"])
    idle = 100.0 * (1 - sum(e.ms * e.cores for e in it) / (ncores * makespan))
    f, ax = plt.subplots(figsize=(12, 2.0 + 0.45 * (len(rows) + 1)))
    for y, w in enumerate(rows):
        for ph in taskgraph.PHASES:
            bars = [((e.start - t0) / 1e6, e.ms) for e in it if e.worker == w and e.phase == ph]
            if bars:
                ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=taskgraph.PHASE_COLOURS[ph],
                               edgecolor="none")
        crit_bars = [((e.start - t0) / 1e6, e.ms) for e in it if e.worker == w and e.i in on_path]
        if crit_bars:
            ax.broken_barh(crit_bars, (y - 0.4, 0.8), facecolors="none", edgecolor="k", lw=0.6)
    yc = len(rows)
    ax.broken_barh([((e.start - t0) / 1e6, e.ms) for e in path], (yc - 0.25, 0.5),
                   facecolors=[taskgraph.PHASE_COLOURS[e.phase] for e in path], edgecolor="k", lw=0.4)
    cores = {e.worker: e.cores for e in it}
    ax.set_yticks(range(len(rows) + 1))
    ax.set_yticklabels([f"worker {w} ({cores[w]} core{'s' if cores[w] > 1 else ''})" for w in rows]
                       + ["critical path"])
    ax.set_ylim(-0.6, yc + 0.6)
    ax.set_xlim(0, makespan)
    ax.set_xlabel("ms since the iteration's first task")
    label = f"{workers}x{r['cores_per_worker']}"   # the mechanism as resolved: in 'describe'
    ax.set_title(_wrap(f"One training iteration, partition {label} ({r.get('describe', '')}), "
                 f"{_model(S)}, B={r['batch']}, T={r['seq_len']}: {len(it)} tasks, "
                 f"{makespan:.0f} ms; idle {idle:.0f} % of the {ncores} cores' time; dependency critical path "
                 f"{crit:.0f} ms ({len(path)} tasks, outlined)\n" + _subtitle(S, machine)
                 + "; from the project's task trace (Runtime.start_trace)", 170), fontsize=7.5)
    ax.legend(handles=[Patch(color=taskgraph.PHASE_COLOURS[p], label=p) for p in taskgraph.PHASES]
              + [Patch(facecolor="white", edgecolor="k", label="on the critical path")],
              fontsize=7, ncol=1, loc="center left", bbox_to_anchor=(1.005, 0.5))
    f.tight_layout()
    f.savefig(png, dpi=90)
    plt.close(f)
    by_phase = {}
    for e in it:
        by_phase[e.phase] = by_phase.get(e.phase, 0.0) + e.ms
    return dict(tasks=len(it), makespan_ms=round(makespan, 1), critical_ms=round(crit, 1),
                critical_tasks=len(path), idle_pct=round(idle, 1),
                **{f"{p}_ms": round(v, 1) for p, v in by_phase.items()})
