"""The performance model (starpu_llm/perf): the recorded task graph is the one the driver
runs; the simulator's step time on synthetic machines (perf/machine.py Machine, rates chosen
here) equals the hand-computed sum where it must and moves the right way where rates change;
the autotuner's ranking picks the partition that must win on machines where the answer is
known; a calibration writes a complete machine description.

No test here reads a clock or compares a prediction with a measurement: the model's accuracy
and the autotuner's choice against measured runs are `make perfmodel`'s
(experiments/perfmodel_validation.py, docs/perfmodel.md), which needs a quiet machine.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

from starpu_llm.perf import autotune, graph, machine, memory
from starpu_llm.perf.calibrate import calibrate, fit_codelets, nnls3, read_starpu_history, total_error
from starpu_llm.model.config import MODELS, PARAMETER_SPECS, ParamLayout
from starpu_llm.plan.topology import Topology, placement_shares
from starpu_llm.plan.partition import PartitionRequest, request_of, settings_of, shapes
from starpu_llm.perf.predict import predict, sites_of, target_partition, task_graph
from starpu_llm.perf.simulate import SEQUENTIAL
from starpu_llm.runtime import usable_cores
from starpu_llm.errors import StarpuLLMError
from partitions import here


def on(n=1, k=1, ranks=1, sub_batches=None, ownership=None, stages=None):
    """The predicted partition of N x K workers (no parallel workers) on `ranks` ranks
    (predict.target_partition)."""
    return target_partition(PartitionRequest(workers=n, cores_per_worker=k, sub_batches=sub_batches,
                                             ownership=ownership, pipeline_stages=stages),
                            ranks, parallel_workers=False)


def test_recorded_graph_is_the_traced_step():
    """The dry-run graph has the tasks of a real step, in submission order, with the same
    codelets and access modes as a traced real step of the same shape."""
    from starpu_llm import Runtime
    from tracing import traced_step
    from starpu_llm.model.config import MODELS
    g = graph.record("micro", 4, 16, sites_of("micro", 4, 16, on(sub_batches=2)))
    tokens = np.random.default_rng(0).integers(0, MODELS["micro"].V, 4000).astype(np.uint16)
    with Runtime(here(1, 1)) as rt:
        events, _ = traced_step(rt, MODELS["micro"], tokens, B=4, T=16, sub_batches=2)
    real = sorted((e for e in events if e.buffers is not None), key=lambda e: e.job)
    assert [t.codelet for t in g.tasks] == [e.codelet for e in real]
    assert [tuple(m for _, m in t.accesses) for t in g.tasks] == \
        [tuple(m for _, m in e.buffers) for e in real]
    assert [t.flops for t in g.tasks] == [e.flops for e in real]
    # the trace's byte count of a task (StarPU's sizes of its buffers) is the graph's
    assert [t.nbytes for t in g.tasks] == [e.nbytes for e in real]
    assert all(e.nbytes > 0 for e in real)
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
    assert back.first_touch_gbs == [] and back.first_touch(2) == 0.0     # not measured
    m.first_touch_gbs = [1.5, 2.5]
    machine.save(m, str(path))
    assert machine.load(str(path)).first_touch(2) == 2.5e9
    path.write_text("[machine]\nname = 'y'\n")
    with pytest.raises(StarpuLLMError, match="m.toml: not a machine description"):
        machine.load(str(path))


needs2 = pytest.mark.skipif(usable_cores() < 2, reason="the partitions need 2 cores")


# ---------------------------------------------------------------- synthetic machines
# A synthetic machine gives every codelet a = b = 1 (a task runs at the machine's sgemm and
# stream rates) and c = team_us on k > 1 cores (0 on one core); its rates are chosen so that
# the answer is known without running anything.

MODEL, T = "micro", 16


def synthetic(cores, sgemm, bandwidth, task_us=0.0, team_us=0.0, reduction_gbs=1e6,
              step_ms=0.0, free_sequential=True) -> machine.Machine:
    """sgemm, bandwidth: GFLOP/s and GB/s per core count (machine.py's lists).
    free_sequential: the one-core codelets (the reductions' add, zero, norm_sum) cost nothing,
    so that no partition is favoured by where they run."""
    names = {t.codelet for t in task_graph(MODEL, 8, T, sites_of(MODEL, 8, T)).tasks} | SEQUENTIAL
    ks = sorted({1, *range(2, cores + 1)})
    codelets = {}
    for name in names:
        free = free_sequential and name in SEQUENTIAL
        codelets[name] = {"a": {k: 0.0 if free else 1.0 for k in ks},
                          "b": {k: 0.0 if free else 1.0 for k in ks},
                          "c_us": {k: 0.0 if (free or k == 1) else team_us for k in ks}}
    return machine.Machine(f"synthetic-{cores}", cores, list(sgemm), list(bandwidth),
                           task_us=task_us, step_ms=step_ms, zero_gbs=reduction_gbs,
                           add_gbs=reduction_gbs, codelets=codelets)


def linear(cores, **kw):
    """sgemm and bandwidth that scale perfectly with the cores."""
    return synthetic(cores, [1.0 * k for k in range(1, cores + 1)],
                     [1.0 * k for k in range(1, cores + 1)], **kw)


def step_by_hand(m, B, k):
    """One worker of k cores, one sub-batch: the tasks run one after another, so the step is
    the sum of their costs (sequential codelets on one core), plus the step's fixed cost."""
    total = 0.0
    for t in task_graph(MODEL, B, T, sites_of(MODEL, B, T)).tasks:
        kk = 1 if t.codelet in SEQUENTIAL else k
        a, b = (0.0, 0.0) if (t.codelet in SEQUENTIAL) else (1.0, 1.0)
        c = m.codelets[t.codelet]["c_us"][kk] * 1e-6
        total += a * t.flops / m.sgemm(kk) + b * t.nbytes / m.bandwidth(kk) + c + m.task_us * 1e-6
    return total + m.step_ms * 1e-3


@pytest.mark.parametrize("k", [1, 2, 4])
def test_one_worker_step_is_the_sum_of_its_tasks(k):
    m = synthetic(4, [3.0, 5.0, 6.0, 7.5], [2.0, 3.0, 3.5, 4.0], task_us=7.0, team_us=40.0,
                  step_ms=2.5)
    p = predict(MODEL, 8, T, on(1, k, sub_batches=1), calibration=m)
    assert p.schedule.step_s == pytest.approx(step_by_hand(m, 8, k), rel=1e-9)
    assert p.tokens_per_ms == pytest.approx(8 * T / (step_by_hand(m, 8, k) * 1e3), rel=1e-9)
    assert p.schedule.idle == [pytest.approx(0.0, abs=1e-9)]      # one worker never waits
    assert p.schedule.critical_path_s <= p.schedule.step_s


def test_predictions_move_the_right_way():
    """Faster rates never slow a step, a larger per-task cost never speeds it, more cores on a
    perfectly scaling machine make it faster; every schedule is consistent with itself."""
    base = linear(4, task_us=2.0, reduction_gbs=2.0)
    slow_sgemm = synthetic(4, [x / 2 for x in base.sgemm_gflops], base.bandwidth_gbs,
                           task_us=2.0, reduction_gbs=2.0)
    costly = linear(4, task_us=20.0, reduction_gbs=2.0)
    for n, k in [(1, 1), (1, 4), (2, 2), (4, 1)]:
        runs = {name: predict(MODEL, 8, T, on(n, k, sub_batches=n), calibration=mm).schedule
                for name, mm in (("base", base), ("slow", slow_sgemm), ("costly", costly))}
        assert runs["slow"].step_s > runs["base"].step_s, (n, k)
        assert runs["costly"].step_s > runs["base"].step_s, (n, k)
        for s in runs.values():
            assert s.critical_path_s <= s.step_s + 1e-12
            assert len(s.idle) == n and all(0 <= x <= 1 for x in s.idle)
            assert s.tasks == len(task_graph(MODEL, 8, T, sites_of(
                MODEL, 8, T, on(n, k, sub_batches=n))).tasks)
    one = [predict(MODEL, 8, T, on(1, k, sub_batches=1),
                   calibration=base).schedule.step_s for k in (1, 2, 4)]
    assert one[0] > one[1] > one[2], one


# ---------------------------------------------------------------- the autotuner's ranking

def best_per_partition(ranked):
    """[(N, K)] in the order of each partition's best candidate."""
    return list(dict.fromkeys((p.partition.workers, p.partition.cores_per_worker) for p in ranked))


def speeds_against_one_core(m, ranked):
    """{(N, K): best tokens/ms over one 1 x 1 worker's on the same machine}."""
    one = predict(MODEL, 8, T, on(1, 1, sub_batches=1), calibration=m).tokens_per_ms
    best = {}
    for p in ranked:
        best.setdefault((p.partition.workers, p.partition.cores_per_worker), p.tokens_per_ms / one)
    return best


def shape_of(p):
    """(N, K, sub-batches) of a resolved partition."""
    return p.workers, p.cores_per_worker, p.sub_batches


def test_candidates_of_a_machine():
    """The candidates are resolved partitions (predict.target_partition, with the batch's
    sub-batches), each asking for itself again (partition.request_of: what choose caches)."""
    assert [shape_of(p) for p in autotune.candidates(2, 8, False)] == \
        [(2, 1, 2), (2, 1, 4), (1, 2, 1), (1, 2, 2)]
    assert [shape_of(p) for p in autotune.candidates(4, 2, False)] == \
        [(4, 1, 2), (2, 2, 2), (1, 4, 1), (1, 4, 2)]
    eight = autotune.candidates(8, 8, False)
    assert [shape_of(p)[:2] for p in eight] == \
        [(8, 1), (4, 2), (4, 2), (2, 4), (2, 4), (1, 8), (1, 8)]
    assert [p.kcore for p in eight] == ["single"] + ["team"] * 6
    assert {p.kcore for p in autotune.candidates(8, 8, True)} == {"single", "parallel-workers"}
    for p in eight:
        assert target_partition(request_of(p), batch=8, parallel_workers=False) == p


def test_choose_trials_the_partitions_and_caches_their_requests(tmp_path, monkeypatch):
    """choose runs each of the two best predictions' partitions (partition.settings_of), keeps
    the faster, and caches its request: read back, the cached choice is the same partition."""
    tried = []

    def trial(spec):
        tried.append(spec)
        return dict(spec, tokens_per_ms=float(spec["workers"]))   # more workers: faster

    monkeypatch.setattr(autotune, "run_in_subprocess", trial)
    cache = str(tmp_path / "autotune.json")
    m = synthetic(2, [1.0, 1.0], [1e6] * 2)
    top = [p.partition for p in autotune.rank(MODEL, 8, T, m)[:2]]
    first = autotune.choose(MODEL, 8, T, m, rounds=1, cache=cache, log=lambda *a: None)
    assert [{k: s[k] for k in settings_of(top[0])} for s in tried] == \
        [settings_of(p) for p in top]
    assert first.partition == max(top, key=lambda p: p.workers)
    tried.clear()
    again = autotune.choose(MODEL, 8, T, m, cache=cache, log=lambda *a: None)
    assert tried == [] and again.why.endswith("(cached)")
    assert again.partition == first.partition and again.request == request_of(first.partition)
    # a cache written before it held whole requests (N, K and sub-batches alone) still reads
    import json
    with open(cache) as f:
        keys = list(json.load(f))
    with open(cache, "w") as f:
        json.dump({k: dict(workers=2, cores_per_worker=1, sub_batches=4, why="old") for k in keys}, f)
    old = autotune.choose(MODEL, 8, T, m, cache=cache, log=lambda *a: None)
    assert tried == [] and shape_of(old.partition) == (2, 1, 4)


def test_autotuner_picks_one_worker_where_cores_scale_and_reductions_cost():
    """sgemm and bandwidth scale perfectly with the cores: a task on K cores takes 1/K of its
    one-core time, so N workers of K cores can at best match one worker of N K cores, and
    they also zero and add N copies of every gradient (slow here), which one worker (its
    sub-batches chained) does not; one sub-batch reads the weights once. So 1 x all cores,
    one sub-batch, must come first, on 2, 4 and 8 cores."""
    for cores in (2, 4, 8):
        ranked = autotune.rank(MODEL, 8, T, linear(cores, reduction_gbs=0.05),
                               parallel_workers=False)
        assert len(ranked) == len(autotune.candidates(cores, 8)) >= 4
        top = ranked[0]
        assert (top.partition.workers, top.partition.cores_per_worker, top.sub_batches) == (1, cores, 1), \
            [p.describe() for p in ranked]


def test_autotuner_picks_one_core_workers_where_teams_do_not_scale():
    """sgemm does not scale with the cores of a task (a 4-core task runs at one core's rate)
    and memory is not a limit: N workers run N tasks at once, so the more workers the faster:
    4 x 1 first, then 2 x 2, then 1 x 4."""
    m = synthetic(4, [1.0] * 4, [1e6] * 4)
    ranked = autotune.rank(MODEL, 8, T, m, parallel_workers=False)
    assert best_per_partition(ranked) == [(4, 1), (2, 2), (1, 4)], [p.describe() for p in ranked]
    # and by how much: the sub-batches split the work evenly and nothing else costs (memory
    # and reductions: ~1e-6 of a step), so N workers are N times one core
    assert speeds_against_one_core(m, ranked) == pytest.approx({(4, 1): 4, (2, 2): 2, (1, 4): 1},
                                                               rel=1e-4)


def test_autotuner_avoids_a_costly_team():
    """sgemm scales perfectly, but a task on more than one core pays 1 ms to start its team
    (the k-core per-task cost): on 8 cores the one-core workers must win."""
    m = linear(8, team_us=1000.0)
    ranked = autotune.rank(MODEL, 8, T, m, parallel_workers=False)
    assert (ranked[0].partition.workers, ranked[0].partition.cores_per_worker) == (8, 1), [p.describe() for p in ranked]
    assert best_per_partition(ranked)[-1] == (1, 8)


def test_autotuner_picks_the_middle_partition_where_it_must():
    """A 2-core task runs 2.5 times as fast as a 1-core one, a 4-core task no faster than a
    2-core one, memory and reductions cost nothing: per 4 cores, 2 x 2 does 5 units of work,
    4 x 1 does 4 and 1 x 4 does 2.5. Not a choice between two: three partitions, six
    candidates (the batch of 8 split in 2 or 4 sub-batches for 2 x 2, 4 or 8 for 4 x 1, 1 or
    2 for 1 x 4)."""
    m = synthetic(4, [1.0, 2.5, 2.5, 2.5], [1e6] * 4)
    ranked = autotune.rank(MODEL, 8, T, m, parallel_workers=False)
    assert len(ranked) == 6
    assert best_per_partition(ranked) == [(2, 2), (4, 1), (1, 4)], [p.describe() for p in ranked]
    assert speeds_against_one_core(m, ranked) == pytest.approx(
        {(2, 2): 5, (4, 1): 4, (1, 4): 2.5}, rel=1e-4)


def test_ranking_is_a_pure_function_of_the_description():
    m = synthetic(4, [1.0, 2.5, 2.5, 2.5], [1e6] * 4)
    one = [(p.partition.workers, p.partition.cores_per_worker, p.sub_batches, p.tokens_per_ms)
           for p in autotune.rank(MODEL, 8, T, m, parallel_workers=False)]
    again = [(p.partition.workers, p.partition.cores_per_worker, p.sub_batches, p.tokens_per_ms)
             for p in autotune.rank(MODEL, 8, T, machine.loads(machine.dumps(m)),
                                    parallel_workers=False)]
    assert one == again


# ---------------------------------------------------------------- calibration and the CLI

@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """(STARPU_LLM_HOME, Machine): this machine calibrated on the tiny model."""
    home = tmp_path_factory.mktemp("home")
    path = os.path.join(str(home), os.path.basename(machine.default_path()))
    return str(home), calibrate(path, steps=2, log=lambda *_: None, model="tiny",
                                disk_bytes=64 << 20)


class _Traced(Exception):
    """Raised by a stand-in traced_runs: the steps calibrate gave it."""


@pytest.mark.parametrize("given, quick, steps", [(None, False, 2), (None, True, 1),
                                                 (3, True, 3), (1, False, 1)])
def test_calibrate_decides_its_steps(monkeypatch, tmp_path, given, quick, steps):
    """calibrate()'s steps: STEPS, or QUICK_STEPS with quick, unless given: decided there
    once; the CLI passes --steps or None (a Python caller with quick=True gets the CLI's 1).
    The measurements are stand-ins: the traced runs are reached with the steps decided."""
    from starpu_llm import cli
    from starpu_llm.perf import calibrate as cal
    monkeypatch.setattr(cal, "measure_rates", lambda cores, seconds: {
        k: [1.0] * cores for k in ("sgemm", "stream", "touch", "zero", "add")})
    monkeypatch.setattr(cal, "measure_link", lambda: None)
    monkeypatch.setattr(cal, "measure_disk", lambda folder, nbytes: dict(write_gbs=1.0,
                                                                          read_gbs=1.0))

    def traced(cores, n, *args, **kwargs):
        raise _Traced(n)
    monkeypatch.setattr(cal, "traced_runs", traced)
    with pytest.raises(_Traced) as got:
        cal.calibrate(str(tmp_path / "m.toml"), given, log=lambda *_: None, quick=quick)
    assert got.value.args == (steps,)
    argv = ["calibrate"] + (["--steps", str(given)] if given else []) + (["--quick"] * quick)
    args = cli.build_parser().parse_args(argv)
    assert (args.steps, args.quick) == (given, quick)
    args.out = str(tmp_path / "cli.toml")
    with pytest.raises(_Traced) as got:
        cli.cmd_calibrate(args)
    assert got.value.args == (steps,)


def test_calibration_describes_every_partition(calibrated):
    """What a calibration writes (its values are measurements: only their presence and sign
    are checked here): rates for each core count, and the codelets' costs at the core count of
    each partition of this machine, loadable again, and the disk's bandwidth."""
    home, cal = calibrated
    back = machine.load(os.path.join(home, os.path.basename(machine.default_path())))
    cores = usable_cores()
    assert back.cores == cores and len(back.sgemm_gflops) == len(back.bandwidth_gbs) == cores
    assert min(back.sgemm_gflops + back.bandwidth_gbs) > 0 and back.task_us >= 0
    assert back.disk_write_gbs > 0 and back.disk_read_gbs > 0
    ks = {k for _, k in shapes(cores)}
    assert ks <= set(back.codelets["matmul_forward"]["a"]), back.codelets["matmul_forward"]
    for name, c in back.codelets.items():
        assert all(v >= 0 for key in ("a", "b", "c_us") for v in c[key].values()), name


@needs2
def test_workers_auto_chooses_confirms_and_caches(tmp_path):
    """The autotuner's plumbing (which partition it keeps rests on timed trials, not checked
    here; its ranking is, above): two trials printed, the choice used and cached, a partition
    flag beside --workers auto refused."""
    home = tmp_path / "home"
    machine.save(linear(usable_cores()), str(home / os.path.basename(machine.default_path())))
    env = dict(os.environ, STARPU_LLM_HOME=str(home))
    cmd = [sys.executable, "-m", "starpu_llm", "train", "--model", "tiny", "--batch", "8",
           "--seq-len", "64", "--steps", "2", "--workers", "auto"]
    first = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    trials = [l for l in first.stdout.splitlines() if "measured" in l and "predicted" in l]
    assert len(trials) >= 2, first.stdout          # two trials, then the choice
    chosen = [l for l in first.stdout.splitlines() if l.startswith("autotune: ") and "best of" in l]
    assert chosen and "(cached)" not in chosen[0], first.stdout
    part = chosen[0].split()[1].rstrip(",")
    tried = [l.split()[1].rstrip(",") for l in trials]
    assert part in tried, (part, tried)
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
    all_cores = f"1 worker(s) x {usable_cores()} core(s)"
    assert all_cores in tuned.stdout, tuned.stdout
    bare = subprocess.run(default, capture_output=True, text=True, cwd=tmp_path,
                          env=dict(env, STARPU_LLM_HOME=str(tmp_path / "uncalibrated")))
    assert bare.returncode == 0, bare.stderr
    assert "autotune" not in bare.stdout and all_cores in bare.stdout, bare.stdout


def test_predict_cli_tables(tmp_path):
    """`predict --workers auto` gives one line per N x K of the machine's cores, a list of
    --ranks one line per rank count (weak scaling), and --machine predicts for a described
    node (the paper's, 36 cores) with this machine's codelet ratios (here a synthetic
    calibration)."""
    cal = linear(usable_cores())
    home = tmp_path / "home"
    machine.save(cal, str(home / os.path.basename(machine.default_path())))
    env = dict(os.environ, STARPU_LLM_HOME=str(home))
    base = [sys.executable, "-m", "starpu_llm", "predict", "--model", "tiny"]
    r = subprocess.run(base + ["--workers", "auto", "--batch", "4", "--ranks", "1,2"],
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
    bad = subprocess.run(base + ["--workers", "auto", "--cores-per-worker", "1"],
                         capture_output=True, text=True, env=env, cwd=tmp_path)
    assert bad.returncode == 2 and "--workers auto" in bad.stderr, bad.stderr


@needs2
def test_validation_writes_its_raw_data(tmp_path):
    """experiments/perfmodel_validation.py on the tiny model, one repeat, one timed step, with a
    synthetic calibration: its raw files (what `make perfmodel` commits) hold every run, every
    configuration's prediction and error, the autotuner's choice and the machine. Only the
    files' content is checked, none of the numbers' values."""
    cal = tmp_path / "calibration.toml"
    machine.save(linear(usable_cores()), str(cal))
    out = tmp_path / "results"
    script = os.path.join(os.path.dirname(__file__), "..", "experiments", "perfmodel_validation.py")
    r = subprocess.run([sys.executable, script, "--model", "tiny", "--batches", "4",
                        "--mpi-batches", "", "--steps", "1", "--repeat", "1", "--autotune",
                        "--calibration", str(cal), "--results", str(out), "--png", ""],
                       capture_output=True, text=True, cwd=tmp_path,
                       env=dict(os.environ, STARPU_LLM_HOME=str(tmp_path / "home")))
    assert r.returncode == 0, r.stdout + r.stderr
    import csv
    import json
    parts = [(1, 1, 1)] + [shape_of(p) for p in autotune.candidates(usable_cores(), 4)]
    with open(out / "runs.csv", newline="") as f:
        runs = list(csv.DictReader(f))
    assert [(int(x["workers"]), int(x["cores_per_worker"]), int(x["sub_batches"])) for x in runs] == parts
    assert all(float(x["tokens_per_ms"]) > 0 and len(x["step_ms"].split()) == 1 for x in runs)
    with open(out / "validation.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(int(x["workers"]), int(x["cores_per_worker"]), int(x["sub_batches"])) for x in rows] == parts
    for x in rows:
        assert float(x["error"]) == pytest.approx(float(x["predicted"]) / float(x["measured"]) - 1)
    with open(out / "autotune.csv", newline="") as f:
        (choice,) = list(csv.DictReader(f))
    assert choice["B"] == "4" and choice["choice"] in choice["ranking"] and choice["trials"]
    about = json.loads((out / "machine.json").read_text())
    for key in ("cpu_model", "isa", "cores", "starpu_version", "blas", "commit", "dirty",
                "calibration", "command"):
        assert key in about, key
    assert about["dirty"] == about["commit"].endswith("-dirty")
    assert (out / "calibration.toml").read_text() == cal.read_text()


def test_fit_is_unbiased_for_noisy_tasks():
    """Tasks of two shapes whose durations spread log-normally (s = 0.3, as tasks do on a
    shared machine): the fitted cost of each shape is the mean of its samples (a step is a sum
    of tasks), not the ~16 % faster estimate that a relative fit on the samples themselves
    gives; the fit's total error on them is then 0."""
    m = machine.Machine("x", 2, [1.0, 2.0], [1.0, 2.0])
    noise = np.exp(0.3 * np.random.default_rng(0).standard_normal(400))
    samples = [("matmul_forward", 1, 1, flops, 0, flops * 1e-9 * x, 1.0)   # 1 s per GFLOP
               for flops in (1e9, 4e9) for x in noise]
    fit = fit_codelets(samples, m)["matmul_forward"]
    for flops in (1e9, 4e9):
        got = fit["a"][1] * flops / m.sgemm(1) + fit["c_us"][1] * 1e-6
        assert got == pytest.approx(flops * 1e-9 * noise.mean(), rel=1e-9)
    # what a relative fit on the samples themselves would say: well below their mean
    X = np.array([[s[3] / m.sgemm(1), 0.0, 1.0] for s in samples])
    y = np.array([s[5] for s in samples])
    a_raw = nnls3(X, y, 1 / y ** 2)[0]
    assert a_raw < 0.9 * fit["a"][1], (a_raw, fit["a"][1])
    assert fit["total_err"][1] == pytest.approx(0.0, abs=1e-9)
    m.codelets = {"matmul_forward": fit}
    assert total_error(samples, m) == pytest.approx({1: 0.0}, abs=1e-9)


# ---------------------------------------------------------------- ranks: the ownership modes

def model_bytes(model=MODEL) -> int:
    return ParamLayout(MODELS[model]).total * 4


@pytest.mark.parametrize("R", [2, 3, 4])
@pytest.mark.parametrize("workers", [1, 2])
def test_bytes_per_rank_are_the_closed_form(R, workers):
    """Sharded: each rank sends its contributions to the slices the others own ((1 - share)
    x the model's bytes) and its own slices' new parameters to the R - 1 others ((R - 1) x
    share), and receives the reverse (its own workers' copies are added up locally first).
    rank0: rank 0 sends and receives R - 1 models, every other rank one."""
    m, M = linear(2), model_bytes()
    shares = placement_shares(MODELS[MODEL], R)
    assert len(set(shares)) > 1            # the closed form is checked on unequal shares
    sharded = predict(MODEL, 4 * R, T, on(workers, 1, R, ownership="sharded"),
                      calibration=m).schedule
    expected = [round((1 - f) * M + (R - 1) * f * M) for f in shares]
    assert sharded.sent == expected and sharded.received == expected
    rank0 = predict(MODEL, 4 * R, T, on(workers, 1, R, ownership="rank0"),
                    calibration=m).schedule
    assert rank0.sent == rank0.received == [(R - 1) * M] + [M] * (R - 1)


def test_pipeline_moves_only_activations():
    """Two stages, one rank each: no parameter or gradient crosses; per sequence, the residual
    stream at the boundary goes forward and its gradient back, the last stage's output to
    the head on stage 0 and the head's gradient back: 2 x T x C floats each way."""
    C, B = MODELS[MODEL].C, 8
    s = predict(MODEL, B, T, on(1, 1, 2, sub_batches=4, stages=2),
                calibration=linear(2)).schedule
    assert s.sent == s.received == [2 * B * T * C * 4] * 2


def test_pipeline_embedding_adds_its_wte_gradient_apart():
    """In a pipeline the engine gives the embedding its own wte gradient, added into the
    head's after the backward (handles.embedding_wte_grads, taskflow.reduce_gradients), and
    the model replays it as recorded: GPT-2 124M in 2 stages, 4 micro-batches, micro-batch 1's
    head backward (its lm head adding into the wte gradient) starts before micro-batch 0's
    embedding backward. With one chain through both (one process, no pipeline) it cannot:
    it writes after it."""
    from starpu_llm.perf.model import CostModel
    from starpu_llm.perf.simulate import simulate
    m = CostModel(linear(2))
    pipe_g = task_graph("d12", 8, 64, sites_of("d12", 8, 64, on(1, 1, 2, sub_batches=4,
                                                              stages=2)))
    one_g = task_graph("d12", 8, 64, sites_of("d12", 8, 64, on(sub_batches=4)))

    def start(g, sched, codelet, sub):
        return next(sched.notes["starts"][i] for i, t in enumerate(g.tasks)
                    if t.codelet == codelet and t.sub == sub
                    and any(g.handles[h][0].startswith(("grad.wte", "grad@0.embedding.wte"))
                            for h, _ in t.accesses))
    pipe, one = simulate(pipe_g, m, 1), simulate(one_g, m, 1)
    assert start(pipe_g, pipe, "matmul_backward", 1) < start(pipe_g, pipe, "encoder_backward", 0)
    assert start(one_g, one, "matmul_backward", 1) > start(one_g, one, "encoder_backward", 0)
    # the embedding's own gradient stays on stage 0: only activations cross
    assert pipe.sent == pipe.received == [2 * 8 * 64 * MODELS["d12"].C * 4] * 2


def test_owner_maps():
    """The model takes its owners and wte's row blocks from the placement's Topology: a
    pipeline's slices are owned within their stage (with one copy, by the stage's rank; with
    two, wte's two blocks by stage 0's two ranks); predict records the graph with the
    topology's blocks, and the owners of its wte blocks are the topology's."""
    config = MODELS["d12"]
    stages = (0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1)

    def stage(key):
        return stages[key[1]] if PARAMETER_SPECS[key[0]].part == "block" else 0
    one = Topology(config, 2, 2, layer_stage=stages).owners
    assert all(r == stage(key) for key, r in one.items())
    two = Topology(config, 4, 2, layer_stage=stages)     # ranks 0, 2: stage 0; 1, 3: stage 1
    assert all(r % 2 == stage(key) for key, r in two.owners.items())
    assert set(two.owners.values()) == {0, 1, 2, 3}
    assert two.wte_blocks == 2 and {two.owners[("wte", b)] for b in range(2)} == {0, 2}
    m = linear(2)
    for R, (ownership, stages) in ((3, ("sharded", 1)), (4, ("sharded", 2)), (2, ("rank0", 1))):
        p = predict(MODEL, 12 if R == 3 else 8, T, on(1, 1, R, ownership=ownership,
                                                      stages=stages), calibration=m)
        nb = Topology(MODELS[MODEL], R, stages, ownership).wte_blocks
        assert nb == (1 if ownership == "rank0" else R // stages) == p.wte_blocks
        g = task_graph(MODEL, p.B, T, sites_of(MODEL, p.B, T, p.partition))
        assert g.wte_blocks == nb
        # the embedding and the lm head take every block; wte's updates are one per block
        heads = [t for t in g.tasks if t.sub == 0 and t.codelet in ("encoder_forward",
                                                                   "matmul_backward")]
        assert all(sum(g.handles[h][0].startswith("param.wte[") for h, _ in t.accesses)
                   in (0, nb) for t in heads)
        updates = [t for t in g.tasks if t.codelet == "adamw"]
        assert sum(g.handles[t.accesses[0][0]][0].startswith("param.wte[")
                   for t in updates) == nb


def test_sharded_beats_rank0_on_a_slow_link():
    """Where the link is what a step waits for, rank 0 alone sending and receiving R - 1
    models (rank0) is slower than every rank sending and receiving about two (sharded)."""
    m = linear(2)
    m.link_bandwidth_gbs = 1e-3
    speed = {o: predict(MODEL, 16, T, on(1, 1, 4, ownership=o), calibration=m).tokens_per_ms
             for o in ("rank0", "sharded")}
    assert speed["sharded"] > speed["rank0"], speed
    # and a link this slow is what the step is made of: rank 0's R - 1 = 3 models out at the
    # step's start (the parameters), then 3 in (the gradients, once the backward has run)
    step_s = 4 * 16 * T / (speed["rank0"] * 1e3)
    assert step_s > 2 * 3 * model_bytes() / 1e6


def test_mode_predictions_are_deterministic():
    """The same graph recorded twice, the same machine read back from its file: the same
    schedule, to the bit, in every mode."""
    from starpu_llm.perf.model import CostModel
    from starpu_llm.perf.simulate import simulate
    m = linear(2, reduction_gbs=2.0)
    m.link_bandwidth_gbs = 0.01
    layouts = (("rank0", 1), ("sharded", 1), ("sharded", 2))
    runs = []
    for cal in (m, machine.loads(machine.dumps(m))):
        runs.append([(s.step_s, s.critical_path_s, s.busy_s, s.sent, s.received)
                     for s in (simulate(graph.record(MODEL, 16, T, sites_of(
                         MODEL, 16, T, on(2, 1, 4, 2 if stages == 1 else 4, ownership, stages))),
                         CostModel(cal), 1) for ownership, stages in layouts)])
    assert runs[0] == runs[1]


def test_task_layer():
    """Every transformer block's tasks, and only they, belong to their layer: one
    sub-batch's step has as many tasks in each layer, the rest (embedding, head, loss,
    updates of wte, wpe, lnf) in none."""
    g = task_graph(MODEL, 4, T, sites_of(MODEL, 4, T))
    layers = [graph.task_layer(g, t) for t in g.tasks if t.sub is not None]
    counts = [layers.count(l) for l in range(MODELS[MODEL].L)]
    assert counts == [10 + 8] * MODELS[MODEL].L         # a block's forward and backward tasks
    head = [t.codelet for t in g.tasks if t.sub is not None and graph.task_layer(g, t) is None]
    assert sorted(set(head)) == ["crossentropy_backward", "crossentropy_forward",
                                 "encoder_backward", "encoder_forward", "layernorm_backward",
                                 "layernorm_forward", "load_batch", "matmul_backward",
                                 "matmul_forward"]


def test_predict_ranks_the_modes(tmp_path):
    """`predict --ownership auto --pipeline-stages 1,2`: one line per mode of each rank count,
    best first, with each one's share of one node's speed per node; a bad mode named."""
    home = tmp_path / "home"
    machine.save(linear(usable_cores()), str(home / os.path.basename(machine.default_path())))
    env = dict(os.environ, STARPU_LLM_HOME=str(home))
    base = [sys.executable, "-m", "starpu_llm", "predict", "--model", "tiny", "--batch", "4"]
    r = subprocess.run(base + ["--ranks", "1,2", "--ownership", "auto", "--pipeline-stages", "1,2",
                               "--sub-batches", "2"],
                       capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    lines = [l for l in r.stdout.splitlines() if "predicted" in l]
    assert len(lines) == 4, r.stdout            # one process; rank0, sharded, pipeline at R=2
    assert "ranks" not in lines[0]
    two = lines[1:]
    assert sorted(l.split("x 2 ranks, ")[1].split(",")[0] for l in two) == \
        ["pipeline 2 stages", "rank0", "sharded"], r.stdout
    speeds = [float(l.split("predicted ")[1].split()[0]) for l in two]
    assert speeds == sorted(speeds, reverse=True) and all("of one node's" in l for l in two)
    bad = subprocess.run(base + ["--ranks", "2", "--ownership", "rank1"],
                         capture_output=True, text=True, env=env, cwd=tmp_path)
    assert bad.returncode == 2 and "--ownership 'rank1'" in bad.stderr, bad.stderr


def test_ownership_validation_script(tmp_path):
    """experiments/ownership_validation.py on a CSV of made-up runs (repeats, both modes, one
    process): one line per configuration, the repeats' median against the prediction of this
    calibration, the error predicted / measured - 1. Only the arithmetic is checked."""
    import csv
    cal = tmp_path / "calibration.toml"
    machine.save(linear(usable_cores()), str(cal))
    runs = tmp_path / "runs.csv"
    runs.write_text("mode,ranks,batch,tokens_per_ms,model,seq_len,note,transport,schedule\n"
                    "rank0,2,4,1.0,tiny,16,a,default,\nrank0,2,4,3.0,tiny,16,b,default,\n"
                    "rank0,2,4,2.0,tiny,16,c,,\nrank0,2,4,9.0,tiny,16,d,tcp,\n"
                    "sharded,2,4,2.5,tiny,16,,,\n,1,4,1.5,tiny,16,,,\n"
                    "pipeline,2,4,7.0,tiny,16,,,1f1b\n")
    out = tmp_path / "out.csv"
    script = os.path.join(os.path.dirname(__file__), "..", "experiments", "ownership_validation.py")
    r = subprocess.run([sys.executable, script, str(runs), "--calibration", str(cal), "--csv", str(out)],
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(x["mode"], x["ranks"], x["runs"], float(x["measured"])) for x in rows] == \
        [("rank0", "2", "3", 2.0), ("sharded", "2", "1", 2.5), ("sharded", "1", "1", 1.5)]
    for x in rows:
        assert float(x["error"]) == pytest.approx(float(x["predicted"]) / float(x["measured"]) - 1)
        p = predict("tiny", 4, 16, on(1, 1, int(x["ranks"]), ownership=x["mode"]),
                    calibration=machine.load(str(cal)), ranks_per_node=int(x["ranks"]))
        assert float(x["predicted"]) == pytest.approx(p.tokens_per_ms, rel=1e-9)
    assert "| rank0 | 3 |" in r.stdout.replace("1x1 ", "")
    assert "1 runs over another transport than the default left out" in r.stdout
    # the model replays eager's schedule: a pipeline run of another one is left out
    assert "1 pipeline runs under another schedule than eager left out" in r.stdout
    runs.write_text("mode,ranks,batch,tokens_per_ms\nrank2,2,4,1.0\n")
    bad = subprocess.run([sys.executable, script, str(runs), "--calibration", str(cal)],
                         capture_output=True, text=True, cwd=tmp_path)
    assert bad.returncode == 2 and "row 2: mode 'rank2'" in bad.stderr, bad.stderr


def test_autotuner_keeps_each_candidates_best_round(tmp_path, monkeypatch):
    """choose() measures the model's two best candidates in interleaved rounds and keeps each
    one's best round: a slow first round of the model's favourite (a busy moment) does not
    hand the choice to the other; a candidate slower in every round loses. No clock: the
    trials' speeds are scripted."""
    m = synthetic(4, [1.0, 2.5, 2.5, 2.5], [1e6] * 4)
    top, second = [(p.partition.workers, p.partition.cores_per_worker, p.sub_batches)
                   for p in autotune.rank(MODEL, 8, T, m)[:2]]
    for script, expect in (({top: [0.10, 0.30], second: [0.20, 0.21]}, top),
                           ({top: [0.10, 0.12], second: [0.20, 0.19]}, second)):
        runs, seen = {k: list(v) for k, v in script.items()}, []

        def trial(spec, runs=runs, seen=seen):
            key = (spec["workers"], spec["cores_per_worker"], spec["sub_batches"])
            seen.append(key)
            return dict(tokens_per_ms=runs[key].pop(0))
        monkeypatch.setattr(autotune, "run_in_subprocess", trial)
        choice = autotune.choose(MODEL, 8, T, m, cache=str(tmp_path / f"{expect}.json"),
                                 log=lambda *a: None)
        assert seen == [top, second, top, second]           # interleaved, two rounds
        r = choice.request
        assert (r.workers, r.cores_per_worker, r.sub_batches) == expect
        assert f"{max(script[expect]):.4f} tok/ms measured (best round)" in choice.why


# ---------------------------------------------------------------- the disk node (--memory-limit)

def test_main_memory_evicts_the_least_recently_used_and_writes_only_dirty_buffers():
    """perf/memory.py's rules, by hand: three buffers of 10 bytes under a cap of 20."""
    from starpu_llm.perf.memory import MainMemory
    W, R = graph.W, graph.R
    mm = MainMemory([10, 10, 10], 20)
    assert mm.task(((0, W),)) == (0, 0) and mm.task(((1, W),)) == (0, 0)
    assert mm.task(((2, W),)) == (0, 10)          # 0, least recently used and dirty, written
    assert mm.task(((0, R),)) == (10, 10)         # 0 read back; 1 written to make room
    assert mm.task(((1, R),)) == (10, 10)         # 1 read back; 2 written
    assert mm.task(((0, R),)) == (0, 0)           # in memory
    assert mm.task(((2, R),)) == (10, 0)          # 1 evicted: clean (as read), not written
    assert mm.task(((0, R), (2, W))) == (0, 0)    # 2 changed: dirty again
    assert mm.task(((1, W), (0, R))) == (0, 10)   # a buffer only written is not read; 2 goes,
    assert set(mm.lru) == {0, 1} and mm.used == 20    # not 0, which the task holds


def test_main_memory_reuses_a_buffer_of_the_same_size_first():
    """StarPU takes the least recently used buffer of the size it needs before the least
    recently used of all (memalloc.c: try_to_reuse_potentially_in_use_mc)."""
    from starpu_llm.perf.memory import MainMemory
    mm = MainMemory([20, 10, 10], 30)
    mm.task(((0, graph.W),))
    mm.task(((1, graph.W),))
    assert mm.task(((2, graph.W),)) == (0, 10)
    assert list(mm.lru) == [0, 2]                 # 1 went, not 0 (the least recently used)


def test_the_engine_drops_activations_without_writing_them():
    """An activation's values are dropped after its last task of the step (the engine's
    invalidation): never written to the disk, and its memory goes back at once."""
    from starpu_llm.perf.memory import replay
    W, R = graph.W, graph.R
    g = graph.TaskGraph("micro", 1, 1, 1, [
        graph.GraphTask("a", 0.0, 0, 0, ((1, W), (0, R)), frozenset()),
        graph.GraphTask("b", 0.0, 0, 0, ((2, W), (1, R)), frozenset()),
    ], [("param.p", 10), ("s0.x", 10), ("s0.y", 10)])
    steps = replay(g, [0, 1], 20).steps
    # step 1: the parameter, dirty since its initial fill, makes room for y; then it is read
    # back each step and evicted clean: only parameter bytes move, never an activation's
    assert steps == [(0, 10), (10, 0), (10, 0)]


def test_main_memory_counts_new_memory_but_not_a_reused_buffer():
    """Every allocation above glibc's mmap threshold is new memory (pages the kernel maps
    and zeroes) but the reuse of a same-size buffer; a dropped buffer's next allocation is new
    again; a buffer below the threshold comes from the heap, already mapped."""
    from starpu_llm.perf.memory import MMAP_MAX, MainMemory
    big = MMAP_MAX + 4096
    mm = MainMemory([2 * big, big, big, MMAP_MAX], 3 * big + MMAP_MAX)
    mm.task(((0, graph.W),))
    mm.task(((1, graph.W),))
    assert mm.allocated == 3 * big
    mm.task(((3, graph.W),))                      # from the heap
    assert mm.allocated == 3 * big
    mm.task(((2, graph.W),))                      # takes 1's memory: nothing new
    assert mm.allocated == 3 * big
    mm.drop(0)
    mm.task(((0, graph.W),))
    assert mm.allocated == 5 * big


def test_predictions_under_a_memory_limit_wait_for_new_memory():
    """With the machine's first-touch rate, a cap with room for everything still costs the
    step its activations' new memory (the engine drops them each step, StarPU frees them, the
    next step maps them again): with one worker, exactly their bytes at that rate."""
    m = synthetic(2, [3.0, 5.0], [2.0, 3.0], task_us=5.0)
    m.disk_read_gbs, m.disk_write_gbs = 0.5, 0.25
    model, B, T64 = "tiny", 4, 64      # its logits and probabilities above MMAP_MAX
    free = predict(model, B, T64, on(1, 2), calibration=m).schedule
    m.first_touch_gbs = [1.0, 1.5]
    g = task_graph(model, B, T64, sites_of(model, B, T64))
    dropped = sum(n for name, n in g.handles
                  if memory.dropped_after_use(name) and n > memory.MMAP_MAX)
    roomy = predict(model, B, T64, on(1, 2), calibration=m,
                    memory_limit=1 << 40).schedule
    assert (roomy.notes["disk_read"], roomy.notes["disk_written"]) == (0, 0)
    assert dropped > 0
    assert roomy.step_s == pytest.approx(free.step_s + dropped / 1.5e9, rel=1e-9)


def test_predictions_under_a_memory_limit():
    """Under a cap above the step's peak nothing moves and the prediction is the uncapped
    one; below it bytes move, more for a smaller cap, and with one worker the step takes the
    uncapped time plus exactly their time at the disk's bandwidth; a cap below what the
    largest task holds (the run refuses it) and a machine without a disk bandwidth are
    refused."""
    from starpu_llm.flow.memory import minimum_limit, step_needs
    from starpu_llm.perf.memory import MainMemory
    m = synthetic(2, [3.0, 5.0], [2.0, 3.0], task_us=5.0)
    m.disk_read_gbs, m.disk_write_gbs = 0.5, 0.25
    model, B = "tiny", 2          # StarPU's limit is whole MiB: a model of tens of them
    g = task_graph(model, B, T, sites_of(model, B, T))
    whole = MainMemory([n for _, n in g.handles], 1 << 40)
    peak = 0
    for t in g.tasks:
        whole.task(t.accesses)
        peak = max(peak, whole.used)
    free = predict(model, B, T, on(1, 2), calibration=m).schedule
    roomy = predict(model, B, T, on(1, 2), calibration=m,
                    memory_limit=peak + (1 << 20)).schedule
    assert (roomy.notes["disk_read"], roomy.notes["disk_written"]) == (0, 0)
    assert roomy.step_s == pytest.approx(free.step_s, rel=1e-12)
    least, _ = minimum_limit(MODELS[model], step_needs(MODELS[model], B, T), 1, 1)
    assert least < peak
    moved = []
    for cap in (least + 2 * (peak - least) // 3, least + (peak - least) // 3):
        s = predict(model, B, T, on(1, 2), calibration=m,
                    memory_limit=cap).schedule
        read, written = s.notes["disk_read"], s.notes["disk_written"]
        assert read > 0 and written > 0
        assert s.step_s == pytest.approx(free.step_s + read / 0.5e9 + written / 0.25e9,
                                         rel=1e-9)
        moved.append(read + written)
    assert moved[1] > moved[0]
    with pytest.raises(StarpuLLMError, match="cannot hold what the tasks need at once"):
        predict(model, B, T, on(1, 2), calibration=m, memory_limit=least - (1 << 20))
    m.disk_read_gbs = 0.0
    with pytest.raises(StarpuLLMError, match="no disk bandwidth"):
        predict(model, B, T, on(1, 2), calibration=m, memory_limit=least + (peak - least) // 2)


def test_a_prediction_runs_the_partitions_attention(monkeypatch):
    """predict records the graph of the attention its partition was resolved with (resolve's
    decision, plan/partition.attention_of), not a CPU run's default: a partition asking for
    flash on CPUs is predicted with the flash graph, the default one with gemm's."""
    from starpu_llm.perf import predict as predicting
    m = synthetic(2, [1.0, 2.0], [1.0, 2.0])
    seen = []

    def stop(model, B, T, sites, attention=None):
        seen.append(attention)
        raise RuntimeError("stop here")
    monkeypatch.setattr(predicting, "task_graph", stop)
    for asked in ("flash", None):
        p = target_partition(PartitionRequest(workers=1, cores_per_worker=1, attention=asked),
                             1, 4, 2)
        with pytest.raises(RuntimeError, match="stop here"):
            predict(MODEL, 4, T, p, calibration=m)
    assert seen == ["flash", "gemm"]
    assert request_of(target_partition(PartitionRequest(), 1, 4, 2)).gpu_matmul == \
        PartitionRequest().gpu_matmul
