"""Issue 34's evaluation on a borrowed node, everything of it that runs without that node
(tools/device-eval16.sh, docs/figures.md "Figures on a node lent for minutes"): llm.c's
patched matmuls against numpy, the llm.c series' runner on a stand-in trainer, the quick
calibration, figures.py's node options (predictions first, steps sized, a deadline) on the
tiny model, and experiments/eval16_report.py on what they wrote. No timing is checked."""
from __future__ import annotations

import csv
import json
import os
import re
import stat
import subprocess
import sys
import time

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
EXPERIMENTS = os.path.join(os.path.dirname(HERE), "experiments")
sys.path.insert(0, EXPERIMENTS)

import llmc  # noqa: E402
from series import config_key  # noqa: E402

from starpu_llm.plan.partition import shapes  # noqa: E402
from starpu_llm.perf import machine  # noqa: E402
from starpu_llm.perf.calibrate import calibrate  # noqa: E402
from starpu_llm.runtime import usable_cores  # noqa: E402

OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-openmp"


# ---------------------------------------------------------------- llm.c's patch

# a stand-in for train_gpt2.c with the pieces the patch edits (not llm.c's code)
FAKE_TRAINER = """#include <stdlib.h>
#include "llmc/utils.h"
void matmul_forward(float* out, const float* inp, const float* weight, const float* bias,
                    int B, int T, int C, int OC) {
    out[0] = 0;
}
void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                     const float* inp, const float* weight, int B, int T, int C, int OC) {
    dinp[0] = 0;
}
int main() {
    gpt2_build_from_checkpoint(&model, "gpt2_124M.bin");
    int B = 4;
    int T = 64;
    for (int step = 0; step <= 40; step++) {
        if (step % 10 == 0) {
        }
        if (step > 0 && step % 20 == 0) {
        }
    }
}
"""

HARNESS = r"""
#include <stdio.h>
#include <stdlib.h>
%s
%s
%s
static float *load(const char *path, size_t n) {
    float *p = malloc(n * sizeof(float));
    FILE *f = fopen(path, "rb");
    if (!p || !f || fread(p, sizeof(float), n, f) != n) exit(2);
    fclose(f);
    return p;
}
static void save(const char *path, const float *p, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(p, sizeof(float), n, f) != n) exit(3);
    fclose(f);
}
int main(int argc, char **argv) {
    int B = 2, T = 3, C = 5, OC = 7;
    float *inp = load("inp", B*T*C), *w = load("w", OC*C), *bias = load("bias", OC);
    float *dout = load("dout", B*T*OC), *dinp = load("dinp", B*T*C);
    float *dw = load("dw", OC*C), *db = load("db", OC);
    float *out = malloc(B*T*OC * sizeof(float));
    matmul_forward(out, inp, w, bias, B, T, C, OC);
    matmul_backward(dinp, dw, db, dout, inp, w, B, T, C, OC);
    save("out", out, B*T*OC); save("dinp", dinp, B*T*C); save("dw", dw, OC*C); save("db", db, OC);
    return 0;
}
"""


def test_patched_matmuls_compute_llmcs_products(tmp_path):
    """The cblas_sgemm bodies the patch puts in llm.c: out = inp w^T + bias, and the backward
    accumulating into dinp, dweight and dbias as llm.c's loops do."""
    B, T, C, OC = 2, 3, 5, 7
    rng = np.random.default_rng(0)
    arrays = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in
              (("inp", (B * T, C)), ("w", (OC, C)), ("bias", (OC,)), ("dout", (B * T, OC)),
               ("dinp", (B * T, C)), ("dw", (OC, C)), ("db", (OC,)))}
    for name, a in arrays.items():
        a.tofile(tmp_path / name)
    src = tmp_path / "harness.c"
    src.write_text(HARNESS % (llmc.CBLAS, llmc.MATMUL_FORWARD, llmc.MATMUL_BACKWARD))
    lib = os.path.join(OPENBLAS, "libopenblas.so.0")
    subprocess.run(["gcc", "-O2", "-fopenmp", "-o", str(tmp_path / "h"), str(src), lib,
                    f"-Wl,-rpath,{OPENBLAS}", "-lm"], check=True, cwd=tmp_path)
    subprocess.run([str(tmp_path / "h")], check=True, cwd=tmp_path)
    got = {n: np.fromfile(tmp_path / n, np.float32) for n in ("out", "dinp", "dw", "db")}
    a = {k: v.astype(np.float64) for k, v in arrays.items()}
    want = {"out": a["inp"] @ a["w"].T + a["bias"], "dinp": a["dinp"] + a["dout"] @ a["w"],
            "dw": a["dw"] + a["dout"].T @ a["inp"], "db": a["db"] + a["dout"].sum(0)}
    for n, w in want.items():
        np.testing.assert_allclose(got[n], w.ravel(), rtol=1e-5, atol=1e-5, err_msg=n)


def test_patch_edits_each_piece_once_or_refuses():
    out = llmc.patch(FAKE_TRAINER)
    assert out.count("cblas_sgemm(") == 4          # the prototype, 1 forward, 2 backward
    for old, new in llmc.MAIN_EDITS:
        assert old not in out or old in new, old
        assert new in out
    assert "out[0] = 0" not in out and "dinp[0] = 0" not in out
    with pytest.raises(llmc.PatchError, match="int T = 64"):
        llmc.patch(FAKE_TRAINER.replace("int T = 64;", "int T = 1024;"))
    with pytest.raises(llmc.PatchError, match="matmul_backward"):
        llmc.patch(FAKE_TRAINER.replace("void matmul_backward", "void matmul_backward2"))


def fake_llmc(folder, model="tiny", fail=False):
    """A stand-in for llm.c's build folder: a trainer that prints llm.c's step lines."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "model.json"), "w") as f:
        json.dump({"model": model}, f)
    script = os.path.join(folder, "train_gpt2")
    with open(script, "w") as f:
        f.write("#!/bin/sh\n" + ("exit 3\n" if fail else "") +
                'i=0; while [ $i -lt "$LLMC_STEPS" ]; do\n'
                '  echo "step $i: train loss 10.5 (took $((100 * LLMC_B + 10 * i)).5 ms)"\n'
                "  i=$((i + 1)); done\n")
    os.chmod(script, os.stat(script).st_mode | stat.S_IEXEC)
    return folder


def test_llmc_runner_reads_the_step_lines(tmp_path):
    folder = fake_llmc(str(tmp_path / "llmc"))
    spec = dict(engine="llmc", model="tiny", batch=2, seq_len=64, steps=3, threads=1, cpus=1)
    r = llmc.run(spec, folder)
    assert r["step_ms"] == [210.5, 220.5, 230.5]       # the warm-up (200.5) left out
    assert r["tokens_per_ms"] == pytest.approx(2 * 64 * 3 / (210.5 + 220.5 + 230.5))
    assert r["losses"] == [10.5] * 4 and r["peak_rss_mb"] >= 0
    assert "error" in llmc.run(dict(spec, model="d12"), folder)     # another model's folder
    bad = fake_llmc(str(tmp_path / "bad"), fail=True)
    assert "exit 3" in llmc.run(spec, bad)["error"]


# ---------------------------------------------------------------- the node's pipeline, small

def rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def quick_calibration(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("cal") / "calibration.toml")
    calibrate(path, steps=1, log=lambda *_: None, model="tiny", disk_bytes=64 << 20, quick=True)
    return path


def test_quick_calibration_covers_every_partition(quick_calibration):
    back = machine.load(quick_calibration)
    cores = usable_cores()
    assert len(back.sgemm_gflops) == len(back.bandwidth_gbs) == cores
    assert "--quick" in back.source
    ks = {k for _, k in shapes(cores)}
    assert ks <= set(back.codelets["matmul_forward"]["a"])


def figures(out, *extra):
    cmd = [sys.executable, os.path.join(EXPERIMENTS, "figures.py"), "--model", "tiny",
           "--only", "fig3,fig4,fig2a,fig2b", "--cores", "1,2", "--weak-per-core", "1",
           "--strong-batch", "2", "--fig3-batches", "2,4", "--fig3-kcore", "team",
           "--ranks", "1,2", "--mpi-split", "--mpi-batch-per-rank", "2", "--repeat", "1",
           "--no-plots", "--no-sgemm-peak", "--allow-dirty", "--out", str(out), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=EXPERIMENTS)


@pytest.mark.skipif(usable_cores() < 2, reason="Figure 4's mpirun -np 2 wants 2 cores")
def test_node_pipeline_small(tmp_path, quick_calibration):
    """What tools/device-eval16.sh --device runs, at 2 cores on the tiny model: every point
    predicted before the first run, steps sized, the llm.c series (a stand-in trainer), then
    the report: the figures' CSVs and PNGs, the model's errors, the autotuner's choices."""
    out = tmp_path / "fig"
    llmc_dir = fake_llmc(str(tmp_path / "llmc"))
    p = figures(out, "--series", "tensor,data,llmc", "--llmc", llmc_dir, "--calibration",
                quick_calibration, "--point-seconds", "0.5", "--steps", "3", "--order", "cheap",
                "--deadline", "900", "--run-grace", "600")  # a loaded CI machine: no run killed
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    runs, preds = rows(out / "runs.csv"), rows(out / "predictions.csv")
    points = json.load(open(out / "points.json"))["points"]
    assert {r["config"] for r in preds} == {config_key(dict(p["spec"], steps=None))
                                            for p in points if p["spec"]["engine"] == "starpu"}
    assert not [r for r in preds if r.get("error")]
    assert max(r["written"] for r in preds) <= min(r["when"] for r in runs)
    assert all(1 <= int(p["spec"]["steps"]) <= 3 for p in points)
    assert not [r for r in runs if r["error"]], [r["error"] for r in runs if r["error"]]
    assert {r["engine"] for r in runs} == {"starpu", "llmc"}
    assert {int(r["ranks"] or 1) for r in runs} == {1, 2}
    assert rows(out / "autotune_rank.csv")

    folder = tmp_path / "back"          # what the device tool brings back
    folder.mkdir()
    for f in ("runs.csv", "predictions.csv", "autotune_rank.csv", "points.json"):
        (folder / f).write_bytes((out / f).read_bytes())
    (folder / "calibration.toml").write_bytes(open(quick_calibration, "rb").read())
    results = tmp_path / "results"
    r = subprocess.run([sys.executable, os.path.join(EXPERIMENTS, "eval16_report.py"),
                        str(folder), "--results", str(results), "--png-dir", "", "--docs",
                        "", "--no-whatif"],
                       capture_output=True, text=True, cwd=EXPERIMENTS)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for f in ("fig2a_weak", "fig2b_strong", "fig3_partitions", "fig4_mpi", "validation"):
        assert (results / f"{f}.png").stat().st_size > 0 and (results / f"{f}.csv").exists()
    val = rows(results / "validation.csv")
    measured = {r["config"] for r in runs if r["engine"] == "starpu"}
    assert len(val) == len(measured)
    assert {r["B"] for r in rows(results / "autotune.csv")} == {"2", "4"}
    summary = (results / "summary.md").read_text()
    assert "median" in summary and "largest" in summary and "autotuner" in summary


def test_deadline_passed_runs_nothing(tmp_path):
    """A deadline already passed: no run starts, each is written down as not run. On one
    core, one rank: --mpi-split refuses 2 ranks sharing 1 core (nothing to do with the
    deadline)."""
    out = tmp_path / "fig"
    p = figures(out, "--series", "tensor,data", "--deadline", "0",
                "--ranks", "1,2" if usable_cores() >= 2 else "1")
    assert p.returncode == 0, p.stderr[-3000:]
    runs = rows(out / "runs.csv")
    assert runs and all(r["error"].startswith("not run:") and not r["tokens_per_ms"]
                        for r in runs)


PIN_CHILD = """
import json, os
from starpu_llm.runtime import mpi

class Node:                 # one rank on this node, as mpirun -np R on R nodes
    def Get_rank(self): return 0
    def Get_size(self): return 1
    def Free(self): pass

class Comm:
    def Split_type(self, kind): return Node()
    def allgather(self, x): return [x]
    def Get_rank(self): return 0

mine = mpi.pin_rank(Comm())
from starpu_llm.runtime.cpus import cpu_indexes    # the thread's CPU in StarPU's numbers
mine = cpu_indexes(mine)
print(json.dumps(dict(mine=mine, thread=int(os.environ["STARPU_MPI_THREAD_CPUID"]),
                      spare=mpi.mpi_polling(mine[:-1]), full=mpi.mpi_polling(mine))))
"""


@pytest.mark.skipif(usable_cores() < 2, reason="a spare core needs 2 cores")
def test_a_partition_smaller_than_the_rank_leaves_its_last_core_to_the_mpi_thread():
    """Figure 4's reserved core: StarPU-MPI's thread on the rank's last core, where a
    partition of one core fewer than the rank has leaves it alone (the thread then spins);
    with every core working it shares a worker's and backs off."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STARPU_", "OMPI_", "PMI"))}
    p = subprocess.run([sys.executable, "-c", PIN_CHILD], capture_output=True, text=True,
                       env=env)
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["thread"] == r["mine"][-1] and len(r["mine"]) == usable_cores()
    assert r["spare"] == "spin" and r["full"] == "backoff"


# ---------------------------------------------------------------- issue 42: the plan, held out

import figures as plan  # noqa: E402  (figures() above runs the script)
import eval16_report  # noqa: E402


def point(figure, series, x, engine="starpu", B=16, n=None, k=None, threads=None, ranks=None,
          est=None, cores=16, **extra):
    spec = dict(engine=engine, model="d12", batch=B, seq_len=64, steps=3, cpus=cores)
    if engine == "starpu":
        spec.update(workers=n, cores_per_worker=k)
        if k > 1:
            spec["kcore"] = "team"
    else:
        spec["threads"] = threads
    if ranks:
        spec.update(ranks=ranks, mpirun_args=[], **extra)
    p = dict(figure=figure, series=series, x=x, spec=spec)
    if est is not None:
        p["estimate_s"] = est
    return p


def test_plan_by_priority_cut_at_the_deadline_lowest_priority_dropped_first():
    pts = [point("fig2a", "tensor", 1, n=1, k=1, B=1, est=10),
           point("fig2b", "data", 16, n=16, k=1, est=20),
           point("fig3", "B=16", "16x1", n=16, k=1, est=20),      # fig2b's configuration too
           point("fig3", "B=16", "1x16", n=1, k=16, est=30),
           point("fig4", "rank0", 2, n=1, k=7, ranks=2, ownership="rank0", est=5)]
    order = plan.by_priority(pts, ["fig3", "fig2b", "fig2a", "fig4"])
    assert [p["figure"] for p in order] == ["fig3", "fig3", "fig2b", "fig2a", "fig4"]
    # 20 + 30 = 50 s for Figure 3; fig2b's point is Figure 3's 16x1 (no time); fig2a's 10 s
    # would end at 60 s, past 90 - 40
    kept, dropped = plan.cut_to_budget(order, 90, margin_s=40)
    assert [(p["figure"], p["ends_s"]) for p in kept] == [("fig3", 20), ("fig3", 50),
                                                          ("fig2b", 20)]
    assert [p["figure"] for p in dropped] == ["fig2a", "fig4"]
    kept, dropped = plan.cut_to_budget(order, 94, margin_s=30)     # fig2a ends at 60 s
    assert max(p["ends_s"] for p in kept) <= 94 - 30 and [p["figure"] for p in dropped] == ["fig4"]
    # fig2a's 10 s do not fit in 55 - 50, fig4's 5 s do: the time left is used, nothing of
    # a higher priority displaced
    kept, dropped = plan.cut_to_budget(order, 85, margin_s=30)
    assert [p["figure"] for p in kept][-1] == "fig4" and [p["figure"] for p in dropped] == ["fig2a"]


def test_figure3_keeps_its_first_batch_and_the_largest_other_that_fits():
    pts = [point("fig3", f"B={B}", f"{n}x{16 // n}", n=n, k=16 // n, B=B, est=B / 4)
           for B in (16, 160, 96, 64) for n in (1, 16)]
    pts.append(point("fig2b", "data", 16, n=16, k=1, est=100))
    # the first row costs 8 s; 160's 80 s fits 100 - 10 - 8, so it is the second batch
    out, other = plan.choose_fig3_batches(pts, 100, margin_s=10)
    assert sorted({p["spec"]["batch"] for p in out if p["figure"] == "fig3"}) == [16, 160]
    assert {p["spec"]["batch"] for p in other} == {96, 64} and out[-1]["figure"] == "fig2b"
    out, _ = plan.choose_fig3_batches(pts, 70, margin_s=10)      # 160's 80 s does not
    assert sorted({p["spec"]["batch"] for p in out if p["figure"] == "fig3"}) == [16, 96]


def test_dry_run_prints_the_plan_and_its_cut(tmp_path):
    """figures.py --dry-run for a 4-core node on the tiny model: every point predicted, the
    plan in priority order ending before the deadline less the margin, the rest named."""
    cmd = [sys.executable, os.path.join(EXPERIMENTS, "figures.py"), "--dry-run",
           "--node-cores", "4", "--machine",
           os.path.join(EXPERIMENTS, "machines", "device-node-16.toml"), "--calibration",
           os.path.join(os.path.dirname(HERE), "starpu_llm", "perf", "reference-calibration.toml"),
           "--model", "tiny", "--only", "fig3,fig2b,fig4", "--cores", "1,4",
           "--strong-batch", "4", "--fig3-batches", "4,8", "--fig3-kcore", "team", "--series",
           "tensor,data", "--ranks", "1,2", "--mpi-split", "--point-seconds", "1",
           "--min-steps", "3", "--warmup", "2", "--order", "priority", "--deadline", "41",
           "--margin", "30", "--allow-dirty", "--out", str(tmp_path)]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=EXPERIMENTS, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    lines = [line.split() for line in p.stdout.splitlines()]
    order = ["fig3", "fig2b", "fig4"].index
    kept = [w[2] for w in lines if w[1:2] == ["plan"]]
    cut = re.findall(r"NOT IN THE PLAN \(deadline\): (\S+)", p.stdout)
    assert kept == sorted(kept, key=order) and kept[0] == "fig3"
    assert cut and cut == sorted(cut, key=order, reverse=True)     # lowest priority named first
    ends = re.search(r"the plan: ~(\d+) s of runs, ending (-?\d+) s before", p.stdout)
    # a dry run plans from its start: this machine's prediction time is not the node's
    assert int(ends[1]) <= 41 - 30 and int(ends[2]) >= 30, ends[0]
    # and every run killed at its cap still ends before the deadline
    worst = re.search(r"worst case, every run killed at its cap .*: (\d+) of (\d+) runs, the "
                      r"last ending \+(\d+) s, (-?\d+) s before the deadline", p.stdout)
    assert worst and int(worst[3]) <= 41 and int(worst[4]) >= 0, p.stdout[-2000:]
    saved = json.load(open(tmp_path / "points.json"))
    assert all(q["spec"]["steps"] >= 3 and q["spec"]["warmup"] == 2
               for q in saved["points"] + saved["dropped"])
    assert len(saved["points"]) + len(saved["dropped"]) >= 10
    # each StarPU point asks for one resolved partition, as the node's build (StarPU 1.4,
    # parallel workers) resolves it: its settings are that partition's (settings_of), e.g. no
    # 'team' asked where parallel workers run the 1 x 4
    from starpu_llm.plan.partition import Build, PartitionRequest, resolve, settings_of
    fields = ("workers", "cores_per_worker", "kcore", "sub_batches")
    starpu = [q["spec"] for q in saved["points"] + saved["dropped"]
              if q["spec"]["engine"] == "starpu"]
    assert any(s["cores_per_worker"] > 1 for s in starpu)
    for s in starpu:
        p = resolve(PartitionRequest(**{f: s.get(f) for f in fields}),
                    cores=s["workers"] * s["cores_per_worker"],
                    build=Build(max_cpus=64, parallel_workers=True))
        assert {f: s.get(f) for f in fields} == settings_of(p), s


def test_resume_leaves_out_what_an_earlier_run_measured(tmp_path):
    done = point("fig3", "B=16", "16x1", n=16, k=1)
    failed = point("fig3", "B=16", "1x16", n=1, k=16)
    machine = dict(cpu="c", host="h", commit="abc", cores=16)
    cache = plan.RunCache(str(tmp_path / "runs.csv"), machine)
    cache.add(dict(done["spec"], steps=7), 1, dict(tokens_per_ms=1.0, step_ms=[1.0]), 1.0)
    cache.add(failed["spec"], 1, dict(error="not run: cut"), 0.0)
    keys = plan.measured_keys([str(tmp_path / "runs.csv")])
    assert keys == {plan.pred_key(done["spec"])}          # another step count: still done
    with pytest.raises(SystemExit, match="--resume .*nope.csv"):
        plan.measured_keys([str(tmp_path / "nope.csv")])


def test_points_equal_to_a_calibration_run_are_in_sample():
    runs = plan.calibration_runs("1x16,4x4,16x1:1,6")
    assert (16, 1, 96) in runs and (4, 4, 24) in runs and (1, 16, 1) in runs
    pts = [point("fig3", "B=16", "16x1", n=16, k=1, B=16),
           point("fig3", "B=96", "16x1", n=16, k=1, B=96),
           point("fig3", "B=16", "4x4", n=4, k=4, B=16),
           point("fig3", "B=16", "1x16", n=1, k=16, B=16),
           point("fig2b", "llmc", 16, engine="llmc", threads=16, B=16),
           point("fig4", "sharded", 2, n=1, k=7, B=2, ranks=2, ownership="sharded")]
    plan.mark_in_sample(pts, runs)
    assert [bool(p.get("in_sample")) for p in pts] == [True, True, False, False, False, False]
    with pytest.raises(SystemExit, match="calibration-runs"):
        plan.calibration_runs("1x16")


def test_median_of_the_timed_steps_after_the_warm_ups():
    spec = dict(engine="starpu", batch=2, seq_len=64, steps=3, warmup=2)
    r = plan.median_of_timed(dict(spec, steps=4, step_ms=[90.0, 10.0, 30.0, 20.0]), spec)
    assert r["step_ms"] == [10.0, 30.0, 20.0] and r["warmup_ms"] == [90.0]
    assert r["tokens_per_ms"] == pytest.approx(2 * 64 / 20.0) and r["steps"] == 3


def test_blas_preflight_verdict():
    from blas_preflight import verdict
    checks = verdict(10.0, {(4, 4): 25.0, (1, 16): 70.0}, 0.5)
    assert [c["ok"] for c in checks] == [True, False]       # 2.5 >= 2; 7 < 8


def synthetic_device_folder(folder):
    """A device run's files, made up: Figures 2b, 3 and 4 and llm.c at B=32 on 16 cores."""
    os.makedirs(folder)
    pts = [point("fig2b", "llmc", 16, engine="llmc", threads=16, B=16),
           point("fig2b", "tensor", 16, n=1, k=16, B=16),
           point("fig2b", "data", 16, n=16, k=1, B=16),
           point("fig3", "B=16", "1x16", n=1, k=16, B=16),
           point("fig3", "B=16", "4x4", n=4, k=4, B=16),
           point("fig3", "B=16", "16x1", n=16, k=1, B=16),
           point("fig2-llmc", "llmc", 32, engine="llmc", threads=16, B=32),
           point("fig4", "one process", 1, n=1, k=15, B=8),
           point("fig4", "sharded", 2, n=1, k=7, B=16, ranks=2, ownership="sharded")]
    plan.mark_in_sample(pts, plan.calibration_runs("1x16,4x4,16x1:1,6"))
    measured = [1.0, 1.2, 0.9, 1.2, 1.5, 0.9, 1.1, 1.0, 1.8]
    predicted = {"1x16": 1.32, "4x4": 1.2, "16x1": 3.0, "1x15": 1.0, "1x7": 1.8}
    machine = dict(cpu_model="Intel(R) Xeon(R) Test CPU", cpu="Xeon test (16 cores)",
                   isa="avx2 fma", cores=16, host="node", starpu_version="1.4.12",
                   blas="openblas-openmp (SkylakeX)", torch_version="-", commit="abc",
                   device_kind="nvidia-h100")
    cache = plan.RunCache(os.path.join(folder, "runs.csv"), machine)
    preds = []
    for p, m in zip(pts, measured):
        cache.add(p["spec"], 1, dict(tokens_per_ms=m, step_ms=[10.0, 10.0, 10.0]), 5.0)
        s = p["spec"]
        if s["engine"] == "starpu":
            preds.append(dict(config=plan.pred_key(s), predicted_tokens_per_ms=predicted[
                f"{s['workers']}x{s['cores_per_worker']}"], predicted_ms_per_step=10,
                predicted_sub_batches=s["workers"]))
    plan.write_rows(os.path.join(folder, "predictions.csv"), preds)
    S = dict(model="d12", T=64, cores=16, scale="full", steps=3, weak_per_core=1,
             strong_batch=16, mpi_batch_per_rank=8, mpi_reserve=1,
             calibration_runs="1x16,4x4,16x1:1,6")
    with open(os.path.join(folder, "points.json"), "w") as f:
        json.dump(dict(settings=S, points=pts), f)
    with open(os.path.join(folder, "00-status.txt"), "w") as f:
        f.write("eval16 on node: Xeon, 16 CPUs, device machine nvidia-h100; commit abc\n")


def test_report_table_against_the_paper_on_synthetic_csvs(tmp_path):
    folder, results = str(tmp_path / "back"), str(tmp_path / "results")
    synthetic_device_folder(folder)
    docs = tmp_path / "figures.md"
    docs.write_text(f"# x\n{eval16_report.DOCS_BEGIN}\nold\n{eval16_report.DOCS_END}\nafter\n")
    assert eval16_report.main([folder, "--results", results, "--png-dir", "", "--docs",
                               str(docs), "--no-whatif"]) == 0
    table = {(r["ratio"], r["B"]): r for r in rows(os.path.join(results, "paper_table.csv"))}
    t = table[("StarPU 1x16 / llm.c", "16")]
    assert float(t["measured"]) == pytest.approx(1.2) and float(t["paper"]) == pytest.approx(1.9 / 1.7, abs=1e-3)
    assert float(table[("StarPU 16x1 / llm.c", "16")]["measured"]) == pytest.approx(0.9)
    assert not table[("StarPU 1x16 / llm.c", "32")]["measured"]     # no StarPU at B=32
    assert float(table[("best (4x4) / 1x16", "16")]["measured"]) == pytest.approx(1.25)
    t = table[("16x1 / 1x16", "16")]
    assert float(t["measured"]) == pytest.approx(0.75) and float(t["paper"]) == pytest.approx(1.5 / 1.9, abs=1e-3)
    t = table[("per-rank tok/ms, R=2 sharded / R=1", "16")]
    assert float(t["measured"]) == pytest.approx(0.9) and float(t["paper"]) == pytest.approx(1.88 / 2.32, abs=1e-3)
    val = {(r["workers"], r["cores_per_worker"], r["B"]): r
           for r in rows(os.path.join(results, "validation.csv"))}
    assert val[("16", "1", "16")]["in_sample"] == "True"
    assert val[("4", "4", "16")]["in_sample"] == "False"
    text = docs.read_text()
    # the 16x1 fit (+233 %) is in-sample: the largest held-out error is 4x4's 20 %
    assert "largest 20.0%" in text and "1 in-sample" in text and "old" not in text
    assert text.startswith("# x\n") and text.endswith("after\n") and "| 3 | 16x1 / 1x16 |" in text
    assert "median" in (tmp_path / "results" / "summary.md").read_text()


def test_report_names_the_device_machine_in_its_folder(tmp_path, monkeypatch):
    folder = str(tmp_path / "back")
    synthetic_device_folder(folder)
    monkeypatch.setattr(eval16_report, "RESULTS", str(tmp_path / "results" / "eval16"))
    assert eval16_report.main([folder, "--png-dir", "", "--docs", "", "--no-whatif"]) == 0
    made = os.listdir(tmp_path / "results" / "eval16")
    assert len(made) == 1 and made[0].endswith("-16c-nvidia-h100"), made
    bad = tmp_path / "nodocs.md"
    bad.write_text("no block\n")
    assert eval16_report.main([folder, "--results", str(tmp_path / "r"), "--png-dir", "",
                               "--docs", str(bad), "--no-whatif"]) == 2


@pytest.mark.skipif(usable_cores() < 2, reason="a partition subset wants 2 partitions of 2 cores")
def test_calibration_on_a_named_subset_of_partitions(tmp_path):
    """calibrate(only=...): the traced runs on those partitions alone, so the others are
    predicted (held out by configuration); link_run=False: no mpirun run is fitted."""
    path = str(tmp_path / "cal.toml")
    lines = []
    calibrate(path, steps=1, log=lines.append, model="tiny", disk_bytes=64 << 20, quick=True,
              only=[(2, 1)], link_run=False)
    back = machine.load(path)
    assert set(back.codelets["matmul_forward"]["a"]) == {1}        # no 1 x 2 run: no k = 2
    traced = [x for x in lines if "tasks traced" in x]
    assert traced and all(x.strip().startswith("2x1 ") for x in traced), traced
    assert not [x for x in lines if "mpirun -np 2" in x]
    assert "on partitions 2x1" in back.source and "link from the ping-pong" in back.source
    with pytest.raises(ValueError, match="3x1"):
        calibrate(path, model="tiny", quick=True, only=[(3, 1)])


def test_a_run_is_killed_at_three_estimates_plus_the_grace(monkeypatch):
    """run_points' per-run timeout: 3 x the estimate + --run-grace (60 s by default, the
    device's), never past the deadline less the killed run's time to end; the pipeline test gives its tiny runs 600 s so a
    loaded machine cannot kill one."""
    import figures
    seen = []
    monkeypatch.setattr(figures, "run_spec", lambda spec, llmc_dir, timeout: (
        seen.append(timeout), {"error": "stand-in"})[1])

    class Cache:
        def get(self, key, repeat):
            return None

        def add(self, spec, repeat, result, seconds):
            return {"error": result.get("error", ""), "tokens_per_ms": ""}

    p = point("fig3", "B=16", "16x1", n=16, k=1, est=5.0)
    from starpu_llm.perf.runs import END_GRACE      # a killed run's TERM-to-KILL, kept free
    for grace, deadline_in, want in ((60.0, 1000, 75), (600.0, 1000, 615),
                                     (600.0, 100, 100 - END_GRACE)):
        seen.clear()
        figures.run_points([p], Cache(), 1, set(), lambda s: None,
                           deadline=time.time() + deadline_in, grace=grace)
        assert seen and abs(seen[0] - want) < 2, (grace, deadline_in, seen)


def test_the_node_runs_on_one_thread_of_each_of_its_cores(tmp_path, monkeypatch):
    """device-eval16.sh's CPUs (experiments/node_cores.py), on fake sysfs: the H200 machine
    seen (16 cores of one thread: CPUs 0-15), a 32-CPU one of 16 cores x 2 threads numbered
    apart (0-15, each core's first) or side by side (every other CPU: `taskset -c 0-15`
    there gave 8 cores), and 8 cores x 2 threads: 8 CPUs, said first with what to do.
    No sysfs topology (a VM without it): each CPU a core."""
    import node_cores
    from test_runtime import fake_cores
    monkeypatch.delenv("STARPU_NTHREADS_PER_CORE", raising=False)
    h200 = fake_cores(tmp_path / "h200", [[c] for c in range(16)])
    apart = fake_cores(tmp_path / "apart", [[c, c + 16] for c in range(16)])
    beside = fake_cores(tmp_path / "beside", [[2 * c, 2 * c + 1] for c in range(16)])
    small = fake_cores(tmp_path / "small", [[2 * c, 2 * c + 1] for c in range(8)])
    use, line = node_cores.node_cpus(16, range(16), h200)
    assert use == list(range(16)) and "FEWER" not in line and "16 (one a core, of 16" in line
    assert node_cores.node_cpus(16, range(32), apart)[0] == list(range(16))
    assert node_cores.node_cpus(16, range(32), beside)[0] == list(range(0, 32, 2))
    use, line = node_cores.node_cpus(16, range(16), small)
    assert use == list(range(0, 16, 2))
    assert "FEWER THAN THE PLAN'S 16" in line and "EVAL_NODE_CORES=8" in line, line
    assert "STARPU_NTHREADS_PER_CORE=2" in line        # its hardware threads, on purpose
    line = node_cores.node_cpus(16, range(8), h200)[1]          # 8 cores of one thread
    assert "EVAL_NODE_CORES=8" in line and "STARPU_NTHREADS_PER_CORE" not in line, line
    assert node_cores.node_cpus(16, range(16), str(tmp_path / "none"))[0] == list(range(16))
    # the script pins its calibration and runs to those CPUs and says the line first
    script = open(os.path.join(os.path.dirname(HERE), "tools", "device-eval16.sh")).read()
    assert 'experiments/node_cores.py" --node-cores "$cores"' in script
    assert 'pin=(taskset -c "$use")' in script and "0-$((cores - 1))" not in script


# ---------------------------------------------------------------- caps: nothing outlives its run

ROOT = os.path.dirname(HERE)
LIB = os.path.join(ROOT, "tools", "device-lib.sh")
MARK_VAR = re.search(r"^MARK_VAR=(\w+)", open(LIB).read(), re.M)[1]


def sh_script(path, text):
    path.write_text("#!/bin/sh\n" + text + "\n")
    path.chmod(0o755)
    return str(path)


def test_each_timed_run_is_swept_before_the_next_starts(tmp_path, monkeypatch):
    """run_points as tools/device-eval16.sh runs it (--run-env, --after-each-run: device-lib.sh's
    sweep), mpirun stood in for: the first run times out leaving a rank in a process group of
    its own that ignores TERM (OpenMPI's ranks each have their own group, so a mpirun that
    dies without ending them leaves them running); the second run's mpirun finds it gone."""
    from test_device_gpu import alive, records_live_pids
    bindir = tmp_path / "bin"
    bindir.mkdir()
    rank = ("import os, signal, time; os.setpgid(0, 0); "
            "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)")
    sh_script(bindir / "mpirun", (
        'if [ ! -e "$T/first" ]; then touch "$T/first"\n'
        f'  {sys.executable} -c "{rank}" </dev/null >"$T/rank.out" 2>&1 & echo $! >"$T/rank.pid"\n'
        '  sleep 300\nfi\n' + records_live_pids("alive-at-second-run") +
        '\necho \'{"step_ms": [1.0], "tokens_per_ms": 1.0}\''))
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.setenv("T", str(tmp_path))
    mark = f"test-{os.getpid()}-runs"
    before = os.environ.get(MARK_VAR)
    ran = []

    class Cache:
        def get(self, key, repeat):
            return None

        def add(self, spec, repeat, result, seconds):
            ran.append(result)
            return {"error": result.get("error", ""),
                    "tokens_per_ms": result.get("tokens_per_ms", "")}

    pts = [point("fig4", "sharded", 2, n=1, k=1, B=B, ranks=2, est=0.5) for B in (2, 4)]
    try:
        plan.run_points(pts, Cache(), 1, set(), lambda s: None, deadline=time.time() + 600,
                        grace=1.0, run_env=f"{MARK_VAR}={mark}",
                        after_run=f"bash {LIB} sweep {mark}")
        assert "timed out" in ran[0]["error"], ran
        assert (tmp_path / "alive-at-second-run").read_text() == "checked\n", ran
        assert ran[1]["tokens_per_ms"] == 1.0
        assert not alive(int((tmp_path / "rank.pid").read_text()))
        assert os.environ.get(MARK_VAR) == before     # this process's environment as it was
    finally:
        pid = tmp_path / "rank.pid"
        if pid.exists() and alive(int(pid.read_text())):
            os.kill(int(pid.read_text()), 9)


def test_when_the_sweep_fails_no_run_after_it_starts(monkeypatch, capsys):
    """--after-each-run failing (a process outlived KILL): the runs after it are written down
    as not run, naming the command, and none of them starts. A --run-env without = is one
    error naming the flag."""
    started = []
    monkeypatch.setattr(plan, "run_spec", lambda spec, llmc_dir, timeout: (
        started.append(spec["batch"]), {"error": "stand-in"})[1])
    rows = []

    class Cache:
        def get(self, key, repeat):
            return None

        def add(self, spec, repeat, result, seconds):
            rows.append(result.get("error", ""))
            return {"error": result.get("error", ""), "tokens_per_ms": ""}

    pts = [point("fig3", "B=16", "16x1", n=16, k=1, B=B, est=1.0) for B in (16, 32, 64)]
    said = []
    plan.run_points(pts, Cache(), 1, set(), said.append, deadline=time.time() + 600,
                    after_run="exit 3")
    assert started == [16]
    assert rows[1:] == ["not run: `exit 3` failed (exit 3) after starpu 16x1, B=16: its "
                        "processes may still run"] * 2
    # the log says it once: "NOT RUN: `exit 3` failed", not "NOT RUN: not run: ..."
    skipped = [line for line in said if "NOT RUN" in line]
    assert len(skipped) == 2 and all("NOT RUN: `exit 3` failed" in line for line in skipped)
    assert not [line for line in said if line.lower().count("not run") > 1], said
    with pytest.raises(SystemExit) as e:      # the mark given without its value
        plan.main(["--run-env", "SL_DEVICE_RUN", "--dry-run"])
    assert e.value.code == 2
    assert "--run-env 'SL_DEVICE_RUN': give VAR=VALUE" in capsys.readouterr().err


def test_every_run_killed_at_its_cap_still_ends_before_the_deadline():
    """run_points' worst case (figures.worst_case: its own clock, every run killed at its
    timeout, END_GRACE more to end, then the after-run command's longest): the last run ends
    before the deadline, each point's timeout being the time left less that tail; what does
    not fit is not started. A point's estimate far below what it takes (a run hung) costs its
    cap, 3 x the estimate + the grace, not more."""
    from starpu_llm.perf.runs import END_GRACE
    pts = [point("fig3", "B=16", f"{n}x{16 // n}", n=n, k=16 // n, B=B, est=est)
           for B, est in ((16, 5.0), (32, 9.0)) for n in (1, 2, 4, 8, 16)]
    now = 1000.0
    for budget, grace, after in ((300.0, 60.0, 40.0), (120.0, 60.0, 40.0), (600.0, 5.0, 0.0),
                                 (2.0 * END_GRACE, 60.0, 10.0)):
        n, end = plan.worst_case(pts, now + budget, now, grace, after)
        assert end <= budget, (budget, grace, after, n, end)
        if budget >= 600:       # room for all: each its cap, 3 x estimate + grace, and tail
            assert n == len(pts)
            assert end == pytest.approx(sum(3 * p["estimate_s"] + grace + END_GRACE + after
                                            for p in pts))
        if budget <= 2 * END_GRACE:
            assert n == 0       # no time for even the tail of one run
    # and the tail is what a timeout leaves out: 10 s left after the tail -> a 10 s cap
    caps = []
    plan.run_points([pts[0]], type("C", (), {"get": lambda *a: None, "add": lambda *a: {
        "error": "x", "tokens_per_ms": ""}})(), 1, set(), lambda s: None,
        deadline=now + 10 + END_GRACE + 7, after_run_s=7, clock=lambda: now,
        run=lambda spec, d, timeout: (caps.append(timeout), dict(error="x"))[1])
    assert caps == [pytest.approx(10.0)]


def test_a_timed_out_run_gets_term_before_kill(tmp_path):
    """run_in_subprocess at its timeout: TERM to the run's process group first (mpirun ends
    its ranks on TERM, not on KILL), KILL only what is left END_GRACE s later."""
    from starpu_llm.perf.runs import run_in_subprocess
    child = sh_script(tmp_path / "child", f'trap \'echo term >"{tmp_path}/got"; exit 0\' TERM\n'
                                         'sleep 300 & wait')
    # 5 s: the shell has its trap set long before, even on a machine other jobs load
    r = run_in_subprocess(dict(engine="starpu"), python=child, timeout=5)
    assert "timed out" in r["error"] and (tmp_path / "got").read_text() == "term\n"


def eval16_stand_in(tmp_path, python3: str):
    """A copy of tools/device-eval16.sh (and device-lib.sh) with what --device carries and runs
    stood in for (sh scripts; T is tmp_path): PYTHON, dpkg, ldd, mpirun (writes which of T's
    *.pid files are live into T/alive-at-mpirun), nvidia-smi and tar failing with a message;
    StarPU given (EVAL_STARPU_PREFIX), no wheels. What a run needs: (script, env)."""
    import shutil
    from test_device_gpu import records_live_pids
    repo, e = tmp_path / "repo", tmp_path / "repo" / ".device-eval"
    for d in (repo / "tools", e / "cache", e / "deb", e / "llmc", tmp_path / "bin",
              tmp_path / "starpu" / "lib" / "pkgconfig"):
        d.mkdir(parents=True)
    for f in ("device-eval16.sh", "device-lib.sh"):
        shutil.copy(os.path.join(ROOT, "tools", f), repo / "tools" / f)
    (e / "commit.txt").write_text("abc1234\n")
    (e / "cache" / "tokens.bin").write_text("")
    (tmp_path / "starpu" / "lib" / "pkgconfig" / "starpu-1.4.pc").write_text("Version: 1.4.12\n")
    ob = tmp_path / "w" / "ob" / "usr" / "lib" / "x86_64-linux-gnu" / "openblas-openmp"
    b = tmp_path / "bin"
    sh_script(b / "python3", python3)
    sh_script(b / "dpkg", f'mkdir -p "{ob}"')
    sh_script(b / "ldd", f'echo "libopenblas.so.0 => {ob}/libopenblas.so.0 (0x1)"')
    sh_script(b / "nvidia-smi", 'echo "NVIDIA-SMI has failed: no driver here" >&2; exit 9')
    sh_script(b / "tar", 'echo "tar: stand-in: No space left on device" >&2; exit 2')
    sh_script(b / "mpirun", records_live_pids("alive-at-mpirun"))
    env = dict(os.environ, OUT=str(tmp_path / "out"), EVAL_WORK=str(tmp_path / "w"),
               EVAL_STARPU_PREFIX=str(tmp_path / "starpu"), EVAL_NO_WHEELS="1",
               PYTHON=str(b / "python3"), EVAL_SECONDS="300", EVAL_NODE_CORES="1", T=str(tmp_path),
               PATH=f"{b}:{os.environ['PATH']}")
    return str(repo / "tools" / "device-eval16.sh"), env


def test_device_caps_each_command_and_its_errors_come_back(tmp_path):
    """--device with stand-ins: the BLAS preflight (capped at EVAL_PREFLIGHT_SECONDS) never
    ends and leaves two sleeping grandchildren, one ignoring TERM, one in a session of its own
    (what `timeout` alone left running); at the cap both are ended and the next command, the
    mpirun smoke run, finds neither. nvidia-smi's and tar's error messages (discarded before)
    are in the log.txt that comes back, within the device tool's 8 files; node_cores.py's
    stderr is not read as its CPU list."""
    from test_device_gpu import alive
    script, env = eval16_stand_in(tmp_path, python3=(
        'case "$*" in\n'
        '  *blas_preflight.py*) (trap "" TERM; exec sleep 300) & echo $! >"$T/ignores-term.pid"\n'
        '    setsid sleep 300 & echo $! >"$T/own-session.pid"\n    exec sleep 300;;\n'
        '  -) cat >/dev/null; echo "parallel workers used True"; echo "blas openblas-openmp";;\n'
        '  *node_cores.py*) echo "DeprecationWarning: stand-in" >&2; echo 0\n'
        '    echo "cores: 1 (stand-in)";;\n'
        '  *figures.py*) echo "figures: done in 0.0 min";;\n'
        '  -c*) echo "no calibration here" >&2; exit 1;;\n'
        'esac'))
    env["EVAL_PREFLIGHT_SECONDS"] = "3"
    try:
        p = subprocess.run(["bash", script, "--device"], capture_output=True, text=True, env=env,
                           timeout=200)
        out = tmp_path / "out"
        log = (out / "log.txt").read_text()
        pids = {f.name: int(f.read_text()) for f in tmp_path.glob("*.pid")}
        assert sorted(pids) == ["ignores-term.pid", "own-session.pid"], log
        assert not [n for n, pid in pids.items() if alive(pid)], log
        assert (tmp_path / "alive-at-mpirun").read_text() == "checked\n", log
        assert "capped after 3 s" in log and "blas_preflight.py" in log, log
        assert "TERM to what outlived its command" in log and "KILL to what outlived" in log, log
        status = (out / "00-status.txt").read_text()
        assert "BLAS CHECK FAILED: the preflight (capped after 3 s" in status, status
        assert "NVIDIA-SMI has failed: no driver here" in log, log
        assert "tar: stand-in: No space left on device" in log, log
        assert "eval16.tar.gz not written" in log, log
        # node_cores.py's stderr kept apart from the CPU list it prints (a warning there was
        # taken for the CPUs), said in the log
        assert "node_cores.py said: DeprecationWarning: stand-in" in log, log
        assert "\ncores: 1 (stand-in)" in status and "0\ncores" not in status, status
        assert "figures: done in" in log and p.returncode == 0, p.stdout + p.stderr
        assert len(os.listdir(out)) <= 8
    finally:
        for f in tmp_path.glob("*.pid"):
            if alive(int(f.read_text())):
                os.kill(int(f.read_text()), 9)


def test_a_stage_past_its_time_is_cut_and_the_run_ends_by_its_deadline(tmp_path):
    """--device's worst case, stand-ins for the commands: figures.py never ends and ignores
    TERM (as every point hung at once, or a build not reused took the time): the watchdog ends
    the stages PACK_S s before EVAL_DEADLINE_AT, pack sweeps what they left (the hung process
    too), says so first in 00-status.txt, and the script has ended by the deadline with its
    files in $OUT. (The pack's 30 s reserve is many times what it takes here.)"""
    from test_device_gpu import alive
    script, env = eval16_stand_in(tmp_path, python3=(
        'case "$*" in\n'
        '  *figures.py*) echo $$ >"$T/figures.pid"; trap "" TERM; while :; do sleep 1; done;;\n'
        '  -) cat >/dev/null; echo "parallel workers used True"; echo "blas openblas-openmp";;\n'
        '  *node_cores.py*) echo 0; echo "cores: 1 (stand-in)";;\n'
        'esac'))
    pack_s = int(re.search(r"PACK_S=(\d+)", open(script).read())[1])
    start = time.time()
    env["EVAL_DEADLINE_AT"] = str(int(start) + pack_s + 25)
    try:
        p = subprocess.run(["bash", script, "--device"], capture_output=True, text=True, env=env,
                           timeout=300)
        ended = time.time()
        out = tmp_path / "out"
        log = (out / "log.txt").read_text()
        status = (out / "00-status.txt").read_text()
        assert ended <= int(env["EVAL_DEADLINE_AT"]), (ended - start, log)
        assert "CUT at +" in status and f"{pack_s} s before the end" in status, status
        pid = int((tmp_path / "figures.pid").read_text())
        assert not alive(pid), log        # swept: TERM ignored, then KILL
        assert "KILL to what outlived its command" in log and "packing" in log, log
        assert p.returncode != 0
    finally:
        f = tmp_path / "figures.pid"
        if f.exists() and alive(int(f.read_text())):
            os.kill(int(f.read_text()), 9)


def test_results_tell_a_zen_4_from_a_zen_5():
    # every AMD EPYC VM names itself "AMD EPYC" and both have AVX-512: the x86 family and model
    # (machine.json's cpu_generation) say which CPU measured what
    from provenance import cpu_generation

    def info(vendor, family, model):
        return f"vendor_id\t: {vendor}\ncpu family\t: {family}\nmodel\t\t: {model}\nmodel name\t: X\n"
    assert cpu_generation(info("AuthenticAMD", 26, 2)) == "family 26 model 2 (Zen 5)"
    assert cpu_generation(info("AuthenticAMD", 25, 0x11)) == "family 25 model 17 (Zen 4)"
    assert cpu_generation(info("AuthenticAMD", 25, 1)) == "family 25 model 1 (Zen 3)"
    assert cpu_generation(info("GenuineIntel", 6, 85)) == "family 6 model 85"
    assert cpu_generation("model name\t: AMD EPYC\n") == "?"
    with open("/proc/cpuinfo") as f:       # this machine's, as machine_info records it
        assert cpu_generation(f.read()).startswith("family ")
