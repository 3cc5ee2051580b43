"""Issue 34's evaluation on a borrowed node, everything of it that runs without that node
(tools/device-eval16.sh, docs/figures.md "Figures on a node lent for minutes"): llm.c's
patched matmuls against numpy, the llm.c series' runner on a stand-in trainer, the quick
calibration, figures.py's node options (predictions first, steps sized, a deadline) on the
tiny model, and experiments/eval16_report.py on what they wrote. No timing is checked."""
from __future__ import annotations

import csv
import json
import os
import stat
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
EXPERIMENTS = os.path.join(os.path.dirname(HERE), "experiments")
sys.path.insert(0, EXPERIMENTS)

import llmc  # noqa: E402
from series import config_key  # noqa: E402

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
    ks = {k for _, k in machine.partitions(cores)}
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
                "--deadline", "900")
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
                        str(folder), "--results", str(results), "--png-dir", ""],
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

mine = mpi.pin_rank(Comm())
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
