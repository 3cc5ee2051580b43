"""The performance model (starpu_llm/perf): the recorded task graph is the one the driver
runs, and a calibration on the tiny model predicts a measured run within a loose bound.

Speed is not asserted here (benchmarks measure it: experiments/perfmodel_validation.py); the
bound only says the model is of the right order, whatever the machine's load: a prediction
within a factor 2 of the measured tokens/ms.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

from starpu_llm.runs import run_in_subprocess
from starpu_llm.perf import graph, machine
from starpu_llm.perf.calibrate import calibrate, nnls3, read_starpu_history
from starpu_llm.perf.predict import predict
from starpu_llm.runtime import usable_cores
from starpu_llm.errors import StarpuLLMError


def test_recorded_graph_is_the_traced_step():
    """The dry-run graph has the tasks of a real step, in submission order, with the same
    codelets and access modes as a traced real step of the same shape."""
    from starpu_llm import Runtime
    from tracing import traced_step
    from starpu_llm.config import MODELS
    g = graph.record("micro", 4, 16, 2)
    tokens = np.random.default_rng(0).integers(0, MODELS["micro"].V, 4000).astype(np.uint16)
    with Runtime(1, 1) as rt:
        events, _ = traced_step(rt, MODELS["micro"], tokens, B=4, T=16, sub_batches=2)
    real = sorted((e for e in events if e.buffers is not None), key=lambda e: e.job)
    assert [t.codelet for t in g.tasks] == [e.codelet for e in real]
    assert [tuple(m for _, m in t.accesses) for t in g.tasks] == \
        [tuple(m for _, m in e.buffers) for e in real]
    assert [t.flops for t in g.tasks] == [e.flops for e in real]
    # two sub-batches, then the updates (no sub-batch)
    assert {t.sub for t in g.tasks} == {0, 1, None}
    assert all(t.sub is None for t in g.tasks if t.codelet == "adamw")
    assert sum(bool(t.grads) for t in g.tasks) > 0


def test_nnls_and_history_parser(tmp_path):
    X = np.array([[1.0, 0, 1], [2, 0, 1], [3, 1, 1], [4, 2, 1]])
    y = X @ np.array([2.0, 0.5, 0.1])
    np.testing.assert_allclose(nnls3(X, y, np.ones(4)), [2.0, 0.5, 0.1], rtol=1e-9)
    # a negative coefficient is never returned
    assert np.all(nnls3(X, -y, np.ones(4)) >= 0)
    p = tmp_path / "sl_x.vm"
    p.write_text("# number of cores \n1\n# hash\t\tsize\t\tflops\t\tmean (us)\tdev (us)\tsum\t\tsum2\t\tn\n"
                 "639f87f6\t25772032\t4.1e+08\t1.0e+04\t0\t1.0e+04\t1e8\t1\n"
                 "5ab7f67e\t147712\t2.1e+06\t3.0e+01\t5\t2.1e+02\t7e3\t7\n# end\n")
    got = read_starpu_history(str(p))
    assert [(c, s, f, n) for c, s, f, _, n in got] == [(1, 25772032, 4.1e8, 1), (1, 147712, 2.1e6, 7)]
    np.testing.assert_allclose([t for _, _, _, t, _ in got], [1e-2, 3e-5], rtol=1e-12)


def test_machine_file_round_trip_and_errors(tmp_path):
    m = machine.Machine("x", 4, [10.0, 19.0], [5.0, 8.0], link_bandwidth_gbs=0.75,
                        link_pingpong_gbs=12.0, codelets={
                            "adamw": {"a": {1: 0.0}, "b": {1: 1.5}, "c_us": {1: 2.0}}})
    path = tmp_path / "m.toml"
    machine.save(m, str(path))
    back = machine.load(str(path))
    assert back.sgemm(2) == 19e9 and back.sgemm(4) == 37e9      # extrapolated per core
    assert back.codelets["adamw"]["b"][1] == 1.5
    assert (back.link_bandwidth_gbs, back.link_pingpong_gbs) == (0.75, 12.0)
    path.write_text("[machine]\nname = 'y'\n")
    with pytest.raises(StarpuLLMError, match="m.toml: not a machine description"):
        machine.load(str(path))


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """(STARPU_LLM_HOME, Machine): this machine calibrated on the tiny model."""
    home = tmp_path_factory.mktemp("home")
    path = os.path.join(str(home), os.path.basename(machine.default_path()))
    return str(home), calibrate(path, steps=2, log=lambda *_: None, model="tiny")


needs2 = pytest.mark.skipif(usable_cores() < 2, reason="the partitions need 2 cores")


@needs2
def test_prediction_within_a_loose_bound_of_a_measurement(calibrated):
    _, cal = calibrated
    for workers, cores, B in [(1, 2, 4), (2, 1, 8)]:
        p = predict("tiny", B, 64, workers, cores, calibration=cal)
        r = run_in_subprocess(dict(engine="starpu", model="tiny", batch=B, seq_len=64, steps=4,
                                   workers=workers, cores=cores))
        assert "error" not in r, r
        ratio = p.tokens_per_ms / r["tokens_per_ms"]
        print(f"\n{workers}x{cores} B={B}: predicted {p.tokens_per_ms:.3f}, measured "
              f"{r['tokens_per_ms']:.3f} tok/ms", end="")
        assert 0.5 <= ratio <= 2.0, (workers, cores, B, p.tokens_per_ms, r["tokens_per_ms"])
        assert p.schedule.critical_path_s <= p.schedule.step_s
        assert len(p.schedule.idle) == workers and all(0 <= x <= 1 for x in p.schedule.idle)


@needs2
def test_workers_auto_chooses_confirms_and_caches(calibrated, tmp_path):
    home, _ = calibrated
    env = dict(os.environ, STARPU_LLM_HOME=home)
    cmd = [sys.executable, "-m", "starpu_llm", "train", "--model", "tiny", "--batch", "8",
           "--seq-len", "64", "--steps", "2", "--workers", "auto"]
    first = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    trials = [l for l in first.stdout.splitlines() if "measured" in l and "predicted" in l]
    assert len(trials) >= 2, first.stdout          # two trials, then the choice
    chosen = [l for l in first.stdout.splitlines() if l.startswith("autotune: ") and "best of" in l]
    assert chosen and "(cached)" not in chosen[0], first.stdout
    part = chosen[0].split()[1].rstrip(",")
    assert part in ("1x2", "2x1"), chosen
    assert f"{part[0]} worker(s) x {part[2]} core(s)" in first.stdout, first.stdout
    again = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "(cached)" in again.stdout and part in again.stdout, again.stdout
    bad = subprocess.run(cmd + ["--cores-per-worker", "1"], capture_output=True, text=True,
                         env=env, cwd=tmp_path)
    assert bad.returncode == 2 and "--workers auto" in bad.stderr, bad.stderr
    # no partition given: 1 x all cores, calibrated or not (the autotuner only when asked)
    default = cmd[:-2]
    assert "--workers" not in default
    tuned = subprocess.run(default, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert tuned.returncode == 0 and "autotune" not in tuned.stdout, tuned
    assert "1 worker(s) x 2 core(s)" in tuned.stdout, tuned.stdout
    bare = subprocess.run(default, capture_output=True, text=True, cwd=tmp_path,
                          env=dict(env, STARPU_LLM_HOME=str(tmp_path / "uncalibrated")))
    assert bare.returncode == 0, bare.stderr
    assert "autotune" not in bare.stdout and "1 worker(s) x 2 core(s)" in bare.stdout, bare.stdout


def test_predict_cli_tables(calibrated, tmp_path):
    """`predict --workers all` gives one line per N x K of the machine's cores, a list of
    --ranks one line per rank count (weak scaling), and --machine predicts for a described
    node (the paper's, 36 cores) with this machine's codelet ratios."""
    home, cal = calibrated
    env = dict(os.environ, STARPU_LLM_HOME=home)
    base = [sys.executable, "-m", "starpu_llm", "predict", "--model", "tiny"]
    r = subprocess.run(base + ["--workers", "all", "--batch", "4", "--ranks", "1,2"],
                       capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    lines = [l for l in r.stdout.splitlines() if "predicted" in l]
    parts = [(n, cal.cores // n) for n in range(1, cal.cores + 1) if cal.cores % n == 0]
    assert len(lines) == 2 * len(parts), r.stdout
    for (n, k), (one, two) in zip(parts, zip(lines[::2], lines[1::2])):
        assert f"B=4 T=64 {n}x{k}," in one and f"B=8 T=64 {n}x{k} x 2 ranks" in two, r.stdout
        assert "per node" in two and "per node" not in one
    node = os.path.join(os.path.dirname(__file__), "..", "experiments", "machines",
                        "paper-node-xeon-gold-6240.toml")
    r = subprocess.run(base + ["--machine", node, "--batch", "36", "--workers", "12",
                               "--cores-per-worker", "3"],
                       capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0 and "36 cores" in r.stdout and "12x3" in r.stdout, r
    bad = subprocess.run(base + ["--workers", "all", "--cores-per-worker", "1"],
                         capture_output=True, text=True, env=env, cwd=tmp_path)
    assert bad.returncode == 2 and "--workers all" in bad.stderr, bad.stderr
