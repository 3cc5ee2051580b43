"""Multi-process training under mpirun (StarPU-MPI), on this one machine.

Every rank runs the whole task graph; rank r computes B/R sequences; the parameters,
gradients and moments are owned as --ownership says (sharded over the ranks, or all on rank
0), each slice's gradient reduced to its owner, which updates it. Results must equal a single
process on the same global batch within fp32 bounds, and be bitwise equal from run to run.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from starpu_llm import StarpuLLMError
from starpu_llm.io import checkpoint, formats
from starpu_llm._clib import lib
from starpu_llm.model.config import MODELS, AdamW
from starpu_llm.io.data import DataLoader
from starpu_llm.flow.reference import ReferenceEngine
from starpu_llm.model.state import TrainState, random_init

from bounds import loss_bound, ratio

MICRO = MODELS["micro"]
BATCH, SEQ_LEN, STEPS, LR, WEIGHT_DECAY, SEED = 12, 16, 5, 1e-2, 0.01, 1337   # train_args'
MPIRUN = shutil.which("mpirun")
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           OMPI_MCA_rmaps_base_oversubscribe="1")


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("mpi") / "training.bin")
    rng = np.random.default_rng(1)
    formats.write_shard(path, np.tile(rng.integers(0, MICRO.V, 41), 800).astype(np.uint16))
    return path


def train_args(shard, metrics, batch=BATCH, steps=STEPS):
    return ["-m", "starpu_llm", "train", "--model", "micro", "--train-data", shard,
            "--batch", str(batch), "--seq-len", str(SEQ_LEN), "--steps", str(steps),
            "--lr", str(LR), "--weight-decay", str(WEIGHT_DECAY), "--seed", str(SEED),
            "--metrics-jsonl", metrics]


def losses(path):
    return [json.loads(l)["loss"] for l in open(path)]


def mpirun(n, args, timeout=240):
    return subprocess.run([MPIRUN, "--oversubscribe", "-np", str(n), sys.executable, *args],
                          capture_output=True, text=True, timeout=timeout, env=ENV)


@pytest.fixture(scope="module")
def single(shard, tmp_path_factory):
    m = str(tmp_path_factory.mktemp("single") / "m.jsonl")
    p = subprocess.run([sys.executable, *train_args(shard, m), "--workers", "1",
                        "--cores-per-worker", "1"], capture_output=True, text=True, env=ENV)
    assert p.returncode == 0, p.stderr
    return losses(m)


@pytest.fixture(scope="module")
def loss_bounds(shard, single):
    """Per-step bounds of |loss of R ranks - loss of the single process| (tests/bounds.py,
    section "whole model"). The ranks split the batch and add their gradients, and their
    kernels see other batch shapes: any fp32 sum of the forward and backward passes may run in
    another order, so the bound is that of two fp32 runs of the model: at each step the loss
    bound at the step's parameters (2 gamma(N_logits) = 1.2e-4 relative on the logits' scale,
    N_logits = 1007, plus the cross-entropy's and the mean's rounding). It covers the rounding
    of each step at the step's parameters, not the effect on the loss of the parameters having
    drifted apart (bounds.py, 2., says why that is not added). It needs the run's logits, so
    the single process's run is replayed here on the reference engine (1 thread), and its
    losses must match the single process's within the same bounds (the bounds are those of
    the right run)."""
    state = TrainState(config=MICRO, params=random_init(MICRO, SEED))
    loader = DataLoader(shard, BATCH, SEQ_LEN, vocab_size=MICRO.V)
    threads = lib.kernels_threads()
    eng = ReferenceEngine(MICRO, state, BATCH, SEQ_LEN, loader.tokens, threads=1)
    replay, bounds = [], []
    try:
        for _ in range(STEPS):
            loss = eng.step(loader.next_position(), AdamW(LR, WEIGHT_DECAY))
            replay.append(loss)
            bounds.append(loss_bound(MICRO, BATCH, SEQ_LEN, loss,
                                     float(np.abs(eng.logits()).max())))
    finally:
        eng.close()
        lib.kernels_set_threads(threads)
    bounds = np.array(bounds)
    assert np.all(np.abs(np.array(replay) - single) <= bounds), (replay, single, bounds)
    return bounds


MODES = {   # name: (ranks, flags, what the partition line says)
    "sharded-2": (2, [], "2 MPI processes, sharded ownership"),
    "sharded-3": (3, [], "3 MPI processes, sharded ownership"),
    "sharded-4": (4, [], "4 MPI processes, sharded ownership"),
    "rank0-2": (2, ["--ownership", "rank0"], "2 MPI processes, rank0 ownership"),
    "rank0-3": (3, ["--ownership", "rank0"], "3 MPI processes, rank0 ownership"),
    # two workers a rank: the sub-batches add their gradients in a StarPU reduction, whose
    # methods (add, zero) the cross-rank reduction's tasks use too
    "sharded-2-workers": (2, ["--workers", "2", "--cores-per-worker", "1", "--oversubscribe"],
                          "2 sub-batch(es) on each of 2 MPI processes, sharded ownership"),
    # micro-batches flowing through the stages
    "pipeline-2": (2, ["--pipeline-stages", "2", "--sub-batches", "3"],
                   "1 copies of 2 pipeline stages on 2 MPI processes"),
    "pipeline-3": (3, ["--pipeline-stages", "3", "--sub-batches", "4"],
                   "1 copies of 3 pipeline stages on 3 MPI processes"),
    # both: 2 data-parallel copies of a 2-stage pipeline
    "both-4": (4, ["--pipeline-stages", "2", "--sub-batches", "2"],
               "2 copies of 2 pipeline stages on 4 MPI processes"),
    # gradient accumulation: 2 micro-batches of 6, the 12 sequences of the single process's
    # batch; each rank's contributions (a pipeline's embedding wte) added up once a step
    "sharded-2-accum": (2, ["--batch", "6", "--grad-accum", "2"],
                        "2 MPI processes, sharded ownership"),
    "pipeline-2-accum": (2, ["--pipeline-stages", "2", "--sub-batches", "3", "--batch", "6",
                             "--grad-accum", "2"],
                         "1 copies of 2 pipeline stages on 2 MPI processes"),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_ranks_equal_single_process(shard, single, loss_bounds, tmp_path, mode):
    """Every mode on R ranks (3 and 4: oversubscribed) against one process within the loss
    bounds, and the same run twice bitwise equal (losses and saved model)."""
    ranks, flags, described = MODES[mode]
    saved = []
    for run in range(2):
        m = str(tmp_path / f"m{run}.jsonl")
        save = str(tmp_path / f"model{run}.bin")
        p = mpirun(ranks, train_args(shard, m) + ["--save", save] + flags)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
        got = losses(m)
        assert len(got) == STEPS
        # every step: the loss bound at the step's parameters (fixture loss_bounds)
        err = np.abs(np.array(got) - np.array(single))
        print(f"\n[{mode}] losses error / bound: "
              f"{np.max(ratio(err, loss_bounds)):.2e}")
        assert np.all(err <= loss_bounds), (err, loss_bounds)
        assert described in p.stdout
        assert p.stdout.count("step    5/5") == 1           # only rank 0 prints
        assert os.path.exists(save) and formats.read_checkpoint(save)[0] == MICRO
        saved.append((got, open(save, "rb").read(), open(checkpoint.companion(save), "rb").read()))
    assert saved[0] == saved[1]



def _why_no_gpu_ranks():
    from starpu_llm.kernels.codelets import cuda_devices
    from starpu_llm.runtime.starpu import have_cuda
    if not have_cuda():
        return "not a CUDA build (README, GPUs: make cuda), so no GPU runs"
    n, why = cuda_devices()
    if n < 1:
        return f"no GPU: {why or 'CUDA reports no device'}"
    if not lib.sl_mpi_available():
        return "this CUDA build has no StarPU-MPI (an MPI and libstarpumpi at its build)"
    return None


def test_ranks_with_a_gpu_each_equal_single_process(shard, single, loss_bounds, tmp_path):
    """`mpirun -np 2 starpu-llm train --gpus 1`: each rank's layer tasks on a CUDA worker of
    its own (fp32 matmuls, the batched-GEMM attention, as the single CPU process's), the
    gradients reduced to their owners across the ranks (sharded) and each slice updated on its
    owner's GPU; the losses within the single process's bounds. One worker of one core a rank
    beside its GPU's thread (--oversubscribe: mpirun may bind a rank to one core); on a
    one-GPU machine both ranks share it (runtime.starpu.rank_cuda_devices), which the
    partition line names."""
    why = _why_no_gpu_ranks()
    if why:
        pytest.skip(why)
    m = str(tmp_path / "m.jsonl")
    p = mpirun(2, train_args(shard, m) + ["--gpus", "1", "--gpu-matmul", "fp32", "--attention",
                                          "gemm", "--workers", "1", "--cores-per-worker", "1",
                                          "--oversubscribe"])
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    got = losses(m)
    err = np.abs(np.array(got) - np.array(single))
    print(f"\n[2 ranks, a GPU each] losses error / bound: {np.max(ratio(err, loss_bounds)):.2e}")
    assert len(got) == STEPS and np.all(err <= loss_bounds), (err, loss_bounds)
    assert "2 MPI processes" in p.stdout and "+ 1 GPU(s) (FP32 matmuls" in p.stdout, p.stdout
    assert "rank 0's: CUDA device(s) 0" in p.stdout, p.stdout


def test_shard_owners_balance_the_bytes():
    """Every slice has one owner; wte comes in R row blocks (one per rank), so no rank owns
    more than its share 1/R plus the largest slice (the greedy's bound: a rank's last slice
    went to it when it owned the least, at most the mean), where before wte (31 % of GPT-2
    124M) alone was the bound from 4 ranks on; rank0 and one process keep wte whole."""
    from starpu_llm.plan.topology import Topology, placement_shares, shard_owners, slice_sizes
    from starpu_llm.model.config import ParamLayout
    for name in ("micro", "d12"):
        cfg = MODELS[name]
        total = ParamLayout(cfg).total
        for R in (1, 2, 3, 4, 16):
            owners = shard_owners(cfg, R)
            assert len(owners) == 3 + R + 12 * cfg.L and set(owners.values()) <= set(range(R))
            assert Topology(cfg, R).wte_blocks == R
            largest = max(size for _, size in slice_sizes(cfg, R)) / total
            shares = placement_shares(cfg, R)
            assert abs(sum(shares) - 1) < 1e-12
            assert max(shares) <= 1 / R + largest + 1e-12, (name, R, shares)
            if name == "d12":       # the blocks, the largest slices, go one to each rank
                assert sorted(owners[("wte", b)] for b in range(R)) == list(range(R))
        assert placement_shares(cfg, 2, "rank0") == [1.0, 0.0]
        assert Topology(cfg, 2, ownership="rank0").wte_blocks == Topology(cfg, 1).wte_blocks == 1


def test_pipeline_stages_balance_the_flops():
    """Stage 0 runs the embedding, its layers and the head; the boundaries minimise the
    busiest stage's flops (checked against every split), so GPT-2 124M's head (5.4 blocks'
    worth) leaves stage 0 fewer blocks; every stage's slices are owned by its ranks."""
    from starpu_llm.plan.topology import Topology, stage_layers
    cfg, T = MODELS["d12"], 64
    block, head = 72 * cfg.C ** 2 + 12 * T * cfg.C, 6 * cfg.Vp * cfg.C
    for S in (2, 3, 4):
        stages = stage_layers(cfg, S, T)
        assert list(stages) == sorted(stages) and set(stages) <= set(range(S))
        counts = [stages.count(s) for s in range(S)]
        work = max([head + counts[0] * block] + [c * block for c in counts[1:]])
        for first in range(cfg.L - S + 2):      # no other split of stage 0 does better
            rest = cfg.L - first
            others = [rest // (S - 1) + (k < rest % (S - 1)) for k in range(S - 1)]
            assert work <= max([head + first * block] + [c * block for c in others])
        assert counts[0] < cfg.L // S
    topo = Topology(cfg, 4, 2, "sharded", T)
    for key, r in topo.owners.items():
        assert r in topo.readers(key)
        assert (key[1] is None) == (topo.slice_stage(key) == 0) or key[1] is not None
    assert topo.wte_blocks == 2 and topo.stage_ranks(0) == [0, 2]
    assert sorted(topo.owners[("wte", b)] for b in range(2)) == [0, 2]


def test_impossible_topologies_say_what_to_do(shard, tmp_path):
    for ranks, flags, says in ((2, ["--pipeline-stages", "3"], "--pipeline-stages 3"),
                               (2, ["--pipeline-stages", "2", "--ownership", "rank0"],
                                "--ownership rank0"),
                               (2, ["--pipeline-stages", "4"], "--pipeline-stages 4")):
        p = mpirun(ranks, train_args(shard, str(tmp_path / "m.jsonl")) + flags)
        assert p.returncode != 0
        assert says in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]


def test_batch_must_split_over_ranks(shard, tmp_path):
    p = mpirun(2, train_args(shard, str(tmp_path / "m.jsonl"), batch=3))
    assert p.returncode != 0
    assert "--batch 3" in p.stderr and "Traceback" not in p.stderr


def mpmd(*commands, timeout=240):
    """One rank per command (each a list of arguments to the Python interpreter)."""
    line = [MPIRUN, "--oversubscribe"]
    for i, args in enumerate(commands):
        line += ([":"] if i else []) + ["-np", "1", sys.executable, *args]
    return subprocess.run(line, capture_output=True, text=True, timeout=timeout, env=ENV)


def test_mismatched_settings_detected_before_training(shard, tmp_path):
    m = str(tmp_path / "m.jsonl")
    p = mpmd(train_args(shard, m, batch=4), train_args(shard, m, batch=8))
    assert p.returncode != 0
    assert "different settings" in p.stderr and "batch" in p.stderr, p.stderr[-3000:]


DIES_AFTER_MPI_INIT = ("-c", "import os, signal; from starpu_llm.runtime import mpi; mpi.world(); "
                       "os.kill(os.getpid(), signal.SIGKILL)")


@pytest.mark.parametrize("case", ["missing shard", "missing checkpoint", "another batch",
                                  "a bad flag", "dies"])
def test_an_error_on_one_rank_ends_every_rank_with_its_message_once(shard, tmp_path, case):
    """Rank 1 alone fails before the first step (a file missing on its node, other settings,
    a flag only it has wrong, or it dies): the whole job ends (no rank left waiting: the
    timeout would fire), non-zero, rank 0 printing rank 1's message once, no traceback,
    nothing trained."""
    good = train_args(shard, str(tmp_path / "m.jsonl"))
    bad, says = {"missing shard": (train_args(str(tmp_path / "nope.bin"), str(tmp_path / "m.jsonl")),
                                   "rank 1: --train-data: token shard file"),
                 "missing checkpoint": (good + ["--resume", str(tmp_path / "nope.bin")],
                                        "rank 1: checkpoint file"),
                 "another batch": (train_args(shard, str(tmp_path / "m.jsonl"), batch=8),
                                   "batch: rank 0 has 12, rank 1 has 8"),
                 "a bad flag": (good + ["--lr", "fast"], "rank 1: usage"),
                 "dies": (DIES_AFTER_MPI_INIT, None)}[case]
    p = mpmd(good, bad, timeout=180)
    assert p.returncode != 0
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    assert "step " not in p.stdout
    if says:
        assert p.stderr.count(says) == 1 and p.stderr.count("error:") == 1, p.stderr[-3000:]


def test_the_same_error_on_every_rank_is_printed_once(shard, tmp_path):
    p = mpirun(2, train_args(shard, str(tmp_path / "m.jsonl")) + ["--resume", str(tmp_path / "no")])
    assert p.returncode == 2
    assert p.stderr.count("error:") == 1 and "rank" not in p.stderr.split("error:")[1].split("\n")[0]
    assert "step    1" not in p.stdout                    # nothing trained


class OneRankOf:
    """This rank of a job whose other ranks ended their phase with `others` (None: they
    succeeded, else (kind, message)), for runtime.mpi.phase without mpirun."""
    def __init__(self, rank, others):
        self.rank, self.others = rank, list(others)

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return len(self.others) + 1

    def allgather(self, mine):
        return self.others[:self.rank] + [mine] + self.others[self.rank:]


def test_a_phase_ends_every_rank_with_the_lowest_failing_ranks_one_message(capsys):
    """`with phase(comm, what)`: the block runs on every rank, then they meet; any rank's error
    ends every rank: rank 0 raises the lowest failing rank's message (its kind kept), the
    others PeerFailed (ending quietly), both agreed; another exception is a bug: its traceback
    printed on its rank, and "unexpected ..., please report it" naming the phase; comm None:
    a plain block."""
    from starpu_llm.cli import UsageError
    from starpu_llm.runtime.mpi import PeerFailed, phase

    def ends(comm, body=None):
        ran = []
        with pytest.raises(StarpuLLMError) as e:
            with phase(comm, "reading the inputs"):
                ran.append(True)
                if body:
                    body()
        assert ran and e.value.agreed
        return e.value

    def fails(error):
        def body():
            raise error
        return body
    e = ends(OneRankOf(0, [(StarpuLLMError, "token shard file nope.bin is missing")]))
    assert type(e) is StarpuLLMError
    assert e.args[0] == "rank 1: token shard file nope.bin is missing"
    e = ends(OneRankOf(1, [None]), fails(UsageError("usage: --lr fast")))
    assert type(e) is PeerFailed and e.args[0] == "rank 1: usage: --lr fast"
    e = ends(OneRankOf(0, [(UsageError, "usage: --lr fast")]))
    assert type(e) is UsageError                           # the kind the CLI prints as it is
    e = ends(OneRankOf(0, [(StarpuLLMError, "x")]), fails(StarpuLLMError("x")))
    assert e.args[0] == "x"                                # the same error everywhere
    e = ends(OneRankOf(0, [(StarpuLLMError, "y"), None]), fails(StarpuLLMError("x")))
    assert e.args[0] == "rank 0 (and 1 more of the ranks that failed): x"
    e = ends(OneRankOf(0, [None]), fails(ZeroDivisionError("division by zero")))
    assert e.args[0].startswith("unexpected ZeroDivisionError while reading the inputs: "
                                "division by zero") and "please report it" in e.args[0]
    assert "Traceback" in capsys.readouterr().err
    with phase(OneRankOf(1, [None, None]), "reading the inputs"):
        pass                                               # every rank succeeded
    with pytest.raises(ZeroDivisionError):
        with phase(None, "reading the inputs"):
            1 / 0


def signal_a_rank(tmp_path, args, rank, sig):
    """Run `args` on 2 ranks and send `sig` to rank `rank` once step 3 is printed: (exit
    status, seconds from the signal to the job's end, stdout)."""
    pids = tmp_path / "pids"
    pids.mkdir()
    wrapper = tmp_path / "rank.sh"
    wrapper.write_text(f'#!/bin/sh\necho $$ > {pids}/$OMPI_COMM_WORLD_RANK\nexec "$@"\n')
    wrapper.chmod(0o755)
    p = subprocess.Popen([MPIRUN, "--oversubscribe", "-np", "2", str(wrapper), sys.executable,
                          "-u", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=ENV)
    lines = []
    try:
        for line in p.stdout:
            lines.append(line)
            if "step    3/" in line:
                break
        os.kill(int((pids / str(rank)).read_text()), sig)
        t0 = time.monotonic()
        # read both pipes to the end while waiting: a rank blocked on a full pipe never stops
        rest, _ = p.communicate(timeout=60)
        return p.returncode, time.monotonic() - t0, "".join(lines) + rest
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_dead_rank_ends_the_job(shard, tmp_path):
    """kill -9 of one rank mid-run: the job exits non-zero within 60 s, no hang."""
    args = train_args(shard, str(tmp_path / "m.jsonl"), batch=4, steps=100000)
    rc, seconds, _ = signal_a_rank(tmp_path, args, 1, signal.SIGKILL)
    assert rc != 0 and seconds < 60


def test_ctrl_c_of_one_rank_stops_every_rank_after_the_same_step(shard, tmp_path):
    """SIGINT to rank 1 alone (mpirun itself would kill the ranks): every rank stops after
    the same step, rank 0 saves the model and its state there, the job exits with 130."""
    save = str(tmp_path / "model.bin")
    args = train_args(shard, str(tmp_path / "m.jsonl"), batch=4, steps=100000) + ["--save", save]
    rc, _, out = signal_a_rank(tmp_path, args, 1, signal.SIGINT)
    assert rc == 130
    last = max(int(l.split()[1].split("/")[0]) for l in out.splitlines() if l.startswith("step"))
    assert checkpoint.read(save).step == last
    assert f"stopped by Ctrl-C after step {last}" in out


def stopped_after_step_3(shard, tmp_path, stop):
    """2 ranks training (saving at the end) until rank 0 prints step 3, then stop(mpirun's
    Popen): mpirun's stderr, after checking that the job failed without a traceback and
    that rank 0 saved the model with a metrics row for every step up to the saved one."""
    save, metrics = tmp_path / "model.bin", tmp_path / "m.jsonl"
    args = train_args(shard, str(metrics), batch=4, steps=100000) + ["--save", str(save)]
    p = subprocess.Popen([MPIRUN, "--oversubscribe", "-np", "2", sys.executable, "-u", *args],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        for line in p.stdout:
            if line.startswith("step    3/"):
                break
        stop(p)
        err = p.communicate(timeout=120)[1]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode != 0 and "Traceback" not in err, err
    last = checkpoint.read(save).step
    assert last >= 3 and [json.loads(l)["step"] for l in open(metrics)] == list(range(1, last + 1))
    return err


def test_a_closed_stdout_of_mpirun_stops_every_rank_and_saves(shard, tmp_path):
    """`mpirun ... | head`: mpirun sees the closed pipe and ends the job with SIGTERM to every
    rank, which stop after the same step; rank 0 saves the model there with a metrics row
    for every step, and alone says so; no traceback."""
    err = stopped_after_step_3(shard, tmp_path, lambda p: p.stdout.close())
    # said once, by rank 0 (every rank got the signal: on 16 nodes, 16 copies before)
    assert err.count("starpu-llm: stopped by SIGTERM") == 1, err
    # announced once: rank 0's own copy ("stopping after the step under way"), or, where rank
    # 1's copy reached the ranks' exchange before rank 0's watcher took its own (a loaded
    # machine), "SIGTERM on rank 1: stopping" (the copy that lands after is not said again)
    assert (err.count("SIGTERM: stopping after the step under way")
            + err.count("SIGTERM on rank 1: stopping")) == 1, err


def rank_pids(mpirun_pid: int) -> dict:
    """The ranks' PIDs of a local mpirun by rank (Open MPI's rank in each child's environment)."""
    pids = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != mpirun_pid:
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        except (OSError, ValueError, IndexError):
            continue
        if b"OMPI_COMM_WORLD_RANK" in env:
            pids[int(env[b"OMPI_COMM_WORLD_RANK"])] = int(entry)
    return pids


def test_a_signal_to_one_rank_alone_stops_every_rank_and_is_said_once(shard, tmp_path):
    """`kill` of one rank that is not rank 0 (a user's, a node's OOM killer's SIGTERM): every
    rank stops after the same step and rank 0 saves, as with a signal to every rank; rank 0
    says which rank got it and the final line once (nothing was said before: rank 1 does not
    announce, rank 0 did not get the signal)."""
    err = stopped_after_step_3(
        shard, tmp_path, lambda p: os.kill(rank_pids(p.pid)[1], signal.SIGTERM))
    assert err.count("starpu-llm: SIGTERM on rank 1: stopping, then saving") == 1, err
    assert err.count("starpu-llm: stopped by SIGTERM") == 1, err


@pytest.mark.parametrize("flags", [[], ["--pipeline-stages", "2", "--sub-batches", "3"]],
                         ids=["sharded", "pipeline"])
def test_resumed_run_equals_uninterrupted(shard, tmp_path, flags):
    """2 ranks: 4 steps in one run, and a run saving a checkpoint at step 2 (going on to
    step 3) resumed up to step 4: the same losses and final parameters, to the bit; and a run
    that saves a checkpoint at steps 2 and 4 ends with the same model as the one that
    does not (the owners' sending rank 0 their slices changes nothing)."""
    whole, part, ck = (str(tmp_path / n) for n in ("whole.jsonl", "part.jsonl", "ck"))
    runs = [(whole, 4, ["--save", str(tmp_path / "whole.bin")]),
            (part, 3, ["--save-every", "2", "--checkpoint-dir", ck]),
            (part, 4, ["--resume", ck, "--save", str(tmp_path / "resumed.bin")]),
            (str(tmp_path / "saving.jsonl"), 4, ["--save-every", "2", "--checkpoint-dir",
                                                 str(tmp_path / "ck2"), "--save",
                                                 str(tmp_path / "saving.bin")])]
    for metrics, steps, extra in runs:
        p = mpirun(2, train_args(shard, metrics, steps=steps) + extra + flags)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    assert losses(part) == losses(whole)
    assert (tmp_path / "resumed.bin").read_bytes() == (tmp_path / "whole.bin").read_bytes()
    assert (tmp_path / "saving.bin").read_bytes() == (tmp_path / "whole.bin").read_bytes()
    assert losses(str(tmp_path / "saving.jsonl")) == losses(whole)


def test_ranks_read_a_glob_of_shards_as_the_shard_they_were_cut_from(shard, tmp_path):
    """2 ranks over two shards cut from the shard at a batch's start (the first ends with
    that batch's first token, as a batch never straddles two shards): the batches, so the
    losses, of the shard itself, bit for bit; each rank reads the views of its own memory
    maps."""
    tokens = formats.read_shard(shard)
    need = BATCH * SEQ_LEN
    formats.write_shard(str(tmp_path / "cut_0.bin"), tokens[:2 * need + 1])     # batches 0, 1
    formats.write_shard(str(tmp_path / "cut_1.bin"), tokens[2 * need:5 * need + 1])
    got = {}
    for name, data in (("one", shard), ("cut", str(tmp_path / "cut_*.bin"))):
        m = str(tmp_path / f"{name}.jsonl")
        p = mpirun(2, train_args(data, m))
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
        got[name] = losses(m)
    assert len(got["cut"]) == STEPS and got["cut"] == got["one"]


def test_resume_under_another_mode_and_rank_count(shard, single, loss_bounds, tmp_path):
    """A checkpoint of 2 sharded ranks at step 2, resumed on 3 ranks with rank-0 ownership,
    in one process and in a 2-stage pipeline: steps 3-5 within the loss bounds of the
    uninterrupted single process."""
    save = str(tmp_path / "two.bin")
    p = mpirun(2, train_args(shard, str(tmp_path / "a.jsonl"), steps=2) + ["--save", save])
    assert p.returncode == 0, p.stderr[-4000:]
    for ranks, extra in ((3, ["--ownership", "rank0"]), (1, ["--workers", "1"]),
                         (2, ["--pipeline-stages", "2", "--sub-batches", "2"])):
        m = str(tmp_path / f"r{ranks}.jsonl")
        args = train_args(shard, m) + ["--resume", save] + extra
        p = (mpirun(ranks, args) if ranks > 1 else
             subprocess.run([sys.executable, *args], capture_output=True, text=True, env=ENV))
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
        assert "warning: the run continues on" in p.stderr
        err = np.abs(np.array(losses(m)) - np.array(single[2:]))
        assert len(err) == STEPS - 2 and np.all(err <= loss_bounds[2:]), (ranks, err)


POLL_CHILD = """
import json, sys
if sys.argv[1] == "mpi4py-first":
    from mpi4py import MPI
from starpu_llm.runtime import mpi as distributed
from starpu_llm.runtime.starpu import Runtime
from starpu_llm.training.trainer import TrainConfig, train
from starpu_llm.plan.partition import PartitionRequest
from starpu_llm.runtime import resolve_here
comm = distributed.world()
distributed.pin_rank(comm)
with Runtime(resolve_here(PartitionRequest(workers=1, cores_per_worker=1), comm.Get_size()),
             comm=comm) as rt:
    r = train(TrainConfig(model="micro", train_data=sys.argv[2], batch=4, seq_len=16, steps=3,
                          log=None), runtime=rt)
    # a file per rank: mpirun may interleave the ranks' stdout within a line
    with open(f"{sys.argv[3]}.{comm.Get_rank()}", "w") as f:
        json.dump(dict(rank=comm.Get_rank(), mode=rt.mpi_poll, stats=rt.mpi_poll_stats(),
                       losses=r.losses), f)
"""


def poll_run(shard, how, tmp_path, **env):
    out = str(tmp_path / f"poll-{how}-{len(env)}")
    p = subprocess.run([MPIRUN, "--oversubscribe", "-np", "2", sys.executable, "-c", POLL_CHILD,
                        how, shard, out], capture_output=True, text=True, timeout=240,
                       env=dict(ENV, **env))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return [json.load(open(f"{out}.{rank}")) for rank in range(2)]


def test_mpi_thread_backs_off_where_it_shares_a_worker_core(shard, tmp_path):
    """Two ranks of one core each: StarPU-MPI's progression thread shares the worker's core, so
    it sleeps between polls that find nothing (csrc/starpu/mpi_poll.c): its MPI_Test calls go
    through ours, and it slept. Spinning (STARPU_LLM_MPI_POLL=spin) calls the real one only.
    With mpi4py's MPI imported first, StarPU-MPI calls MPI's own MPI_Test: said, and it spins.
    The losses are the same to the bit whichever way the thread waits."""
    backoff = poll_run(shard, "default", tmp_path)
    assert [r["mode"] for r in backoff] == ["backoff"] * 2
    for r in backoff:
        assert r["stats"]["polls"] > 0 and r["stats"]["sleeps"] > 0 and r["stats"]["slept_s"] > 0
    spin = poll_run(shard, "default", tmp_path, STARPU_LLM_MPI_POLL="spin")
    assert [r["mode"] for r in spin] == ["spin"] * 2
    assert all(r["stats"] == dict(polls=0, sleeps=0, slept_s=0.0) for r in spin)
    first = poll_run(shard, "mpi4py-first", tmp_path)
    assert all(r["mode"].startswith("spin (no backoff: mpi4py's MPI module was imported "
                                    "before starpu_llm") for r in first)
    assert all(r["stats"]["polls"] == 0 for r in first)
    assert backoff[0]["losses"] == spin[0]["losses"] == first[0]["losses"]
    assert len(backoff[0]["losses"]) == 3


def test_tag_bound_is_starpu_mpis_not_mpi_tag_ub(tmp_path):
    """Handles.check_tags refuses a run whose handles need more data tags than the bound: that
    bound is StarPU-MPI's (STARPU_MPI_TAG_UB, a 64-bit tag carried in its envelope; its
    messages use its own few MPI tags), not MPI's MPI_TAG_UB, which may be as small as 32767
    and would refuse runs StarPU-MPI takes."""
    script = tmp_path / "tag_ub.py"
    script.write_text("import starpu_llm\n"
                      "from mpi4py import MPI\n"
                      "from starpu_llm.runtime.starpu import Runtime\n"
                      "from starpu_llm._clib import lib\n"
                      "with Runtime(comm=MPI.COMM_WORLD):\n"
                      "    print('tag_ub', lib.sl_mpi_tag_ub(), flush=True)\n")
    p = mpirun(2, [str(script)], timeout=120)
    assert p.returncode == 0, p.stderr
    bounds = [int(line.split()[1]) for line in p.stdout.splitlines() if line.startswith("tag_ub")]
    assert bounds == [2**63 - 1] * 2


def test_mpi_polling_follows_the_threads_core():
    """Backoff where the progression thread is bound to a worker's core or unbound; spin where
    it has a core no worker runs on; the environment's choice wins, a wrong one is refused."""
    from starpu_llm.errors import StarpuLLMError
    from starpu_llm.runtime.mpi import mpi_polling
    assert mpi_polling([0], {"STARPU_MPI_THREAD_CPUID": "0"}) == "backoff"
    assert mpi_polling([0, 1], {}) == "backoff"
    assert mpi_polling([1, 2, 3], {"STARPU_MPI_THREAD_CPUID": "0"}) == "spin"
    assert mpi_polling([1], {"STARPU_MPI_THREAD_CPUID": "0", "STARPU_MPI_NOBIND": "1"}) == "backoff"
    assert mpi_polling([0], {"STARPU_MPI_THREAD_CPUID": "0", "STARPU_LLM_MPI_POLL": "spin"}) == "spin"
    with pytest.raises(StarpuLLMError, match="STARPU_LLM_MPI_POLL='sleep'"):
        mpi_polling([0], {"STARPU_LLM_MPI_POLL": "sleep"})


@pytest.mark.parametrize("mode", ["pipeline-2", "pipeline-3"])
def test_pipeline_schedules_give_the_same_bits(shard, tmp_path, mode):
    """eager (each stage holds at most 2 S of the M micro-batches: all 3, all 4; forwards
    first), 1f1b (at most S: 2 of 3, 3 of 4; backward first), bounded (the same, no
    priorities) and gpipe (every micro-batch its own activations, forwards first): the same
    tasks on other buffers, so the same losses and saved model, bitwise."""
    ranks, flags, _ = MODES[mode]
    runs = []
    for schedule in ("eager", "1f1b", "bounded", "gpipe"):
        m, save = str(tmp_path / f"{schedule}.jsonl"), str(tmp_path / f"{schedule}.bin")
        p = mpirun(ranks, train_args(shard, m) + ["--save", save, "--pipeline-schedule",
                                                  schedule] + flags)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
        micro = int(flags[flags.index("--sub-batches") + 1])
        held = ranks if schedule in ("1f1b", "bounded") else micro
        assert (f"schedule {schedule}: each stage holds at most {held} micro-batch(es) of "
                f"{micro}, " + ("backward first" if schedule == "1f1b" else "tasks in the order"
                                if schedule == "bounded" else "forwards first")) in p.stdout
        runs.append((losses(m), open(save, "rb").read()))
    assert len(runs[0][0]) == STEPS and all(r == runs[0] for r in runs[1:])


@pytest.mark.parametrize("ownership", ["rank0", "sharded"])
def test_owner_receives_contributions_into_memory_of_its_own(shard, ownership):
    """2 ranks: every other rank's contribution to a gradient slice a rank owns is received
    into memory of that rank's own, there before the first step and the same after each step
    (placement.contributions: left to StarPU, it was freed and mapped again every step). At
    R = 2 each slice has one contribution received: rank0's rank 0 receives them all."""
    p = subprocess.run([MPIRUN, "--oversubscribe", "-np", "2", sys.executable,
                        os.path.join(os.path.dirname(__file__), "received_contributions.py"),
                        ownership, shard], capture_output=True, text=True, timeout=240, env=ENV)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    slices = sum(d["owned"] for d in out)
    assert [d["received"] for d in out] == ([slices, 0] if ownership == "rank0"
                                            else [d["owned"] for d in out])
    for d in out:
        before, *after = d["where"]
        assert all(before), f"rank {d['rank']}: a received contribution has no memory"
        assert after == [before, before]


@pytest.mark.parametrize("schedule,micro", [("1f1b", 3), ("gpipe", 3), ("eager", 5)])
def test_pipeline_stage_holds_its_sets(shard, schedule, micro):
    """2 stages, M micro-batches: every activation and backward scratch tensor of a stage is
    one of its sets, micro-batch j on set j mod sets (so micro-batch j + sets' forward waits
    for micro-batch j's backward there): 2 sets under 1f1b (S), all 3 under gpipe, 4 of 5
    under eager (2 S); the losses, inputs and targets each micro-batch's own. Micro-batch j's
    tasks at priority p x M + M - 1 - j, p by phase: under 1f1b backward (the head's too) 2,
    the head's forward 1, other forwards 0; under gpipe and eager forwards 2, the head's
    forward and backward 1, other backward 0; the updates at 0."""
    p = subprocess.run([MPIRUN, "--oversubscribe", "-np", "2", sys.executable,
                        os.path.join(os.path.dirname(__file__), "pipeline_sets.py"), schedule,
                        str(micro), shard], capture_output=True, text=True, timeout=240, env=ENV)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    out = {d["rank"]: d for d in json.loads(p.stdout.strip().splitlines()[-1])}
    assert set(out) == {0, 1}
    sets = {"1f1b": 2, "gpipe": micro, "eager": 4}[schedule]
    order = (dict(forward=0, head=1, head_backward=2, backward=2) if schedule == "1f1b"
             else dict(forward=2, head=1, head_backward=1, backward=0))
    at = {ph: sorted(p * micro + micro - 1 - j for j in range(micro)) for ph, p in order.items()}
    for rank, d in out.items():
        assert d["sets"] == sets
        for key, firsts in d["shared"].items():
            own = key.split(":")[1] in ("inputs", "targets", "losses")
            assert firsts == (list(range(micro)) if own
                              else [j % sets for j in range(micro)]), key
        stages = {int(k.split(":")[0]) for k in d["shared"]}
        assert stages == {0, 1}
        prio = d["priorities"]
        assert prio["attention_forward"] == at["forward"]
        assert prio["attention_backward"] == at["backward"]
        assert prio["adamw"] == [0]
    # stage 1 runs blocks only; stage 0 its first blocks and the head, forward and backward
    assert all(p == at["backward"] for c, p in out[1]["priorities"].items()
               if c.endswith("_backward"))
    head = out[0]["priorities"]
    assert head["crossentropy_forward"] == at["head"]
    assert head["crossentropy_backward"] == at["head_backward"]
    assert head["matmul_forward"] == sorted(at["forward"] + at["head"])
    assert head["matmul_backward"] == sorted(set(at["backward"] + at["head_backward"]))


def test_mpi_thread_polls_briefly_between_sleeps_once_quiet():
    """The progression thread's backoff decision (csrc/starpu/mpi_poll.c), driven by polls
    100 ns apart: polls without news for 20 us, then sleeps 5 us, doubled after each sleep up
    to the cap; between two sleeps only 5 us of polls (a whole 20 us after every sleep kept
    the thread busy 9-10 % of a worker's core); news starts it over."""
    from starpu_llm._clib import ffi, lib
    st = ffi.new("struct sl_poll_state *")
    lib.sl_mpi_poll_reset(st)

    def polls_then_sleep():
        for n in range(1, 10_000):
            s = lib.sl_mpi_poll_next(st, 0, 100, 200_000)
            if s:
                return n, s
        raise AssertionError("never slept")

    first = [polls_then_sleep() for _ in range(9)]
    assert first == [(201, 5000), (51, 10000), (51, 20000), (51, 40000), (51, 80000),
                     (51, 160000), (51, 200000), (51, 200000), (51, 200000)]
    assert lib.sl_mpi_poll_next(st, 1, 100, 200_000) == 0      # news
    assert polls_then_sleep() == (201, 5000)


def test_a_one_process_checkpoint_resumes_under_mpirun(shard, tmp_path):
    """A checkpoint of one process on all its cores, resumed by 2 ranks with fewer cores each:
    the ranks run their default partition with one warning (not an error naming flags the
    user never passed)."""
    save = str(tmp_path / "one.bin")
    p = subprocess.run([sys.executable, *train_args(shard, str(tmp_path / "a.jsonl"), steps=2),
                        "--save", save], capture_output=True, text=True, env=ENV)
    assert p.returncode == 0, p.stderr
    p = mpirun(2, train_args(shard, str(tmp_path / "b.jsonl"), steps=3) + ["--resume", save])
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stderr.count("warning: the checkpoint was saved by 1 process(es) and this run has "
                          "2") == 1
    assert "--workers" not in p.stderr and losses(str(tmp_path / "b.jsonl"))


def test_a_launcher_binding_ranks_to_fewer_cores_than_allowed_is_warned(shard, tmp_path,
                                                                        monkeypatch):
    """mpirun binding its ranks to fewer cores than their cgroup allows (its default for 2
    ranks or fewer: a core each) makes each rank's default partition that core: one warning
    naming --bind-to none, under -np 1 too; none with --bind-to none, nor where the ranks
    cover the cores; srun --mpi=pmix ranks (PMIx, no Open MPI variable) are an MPI job."""
    from starpu_llm.runtime import mpi
    if (mpi.allowed_cpus() or set()) != set(os.sched_getaffinity(0)) or \
            len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores or more, all of them this process's (a binding to narrow)")
    env = {k: v for k, v in ENV.items() if k != "OMPI_MCA_rmaps_base_oversubscribe"}
    args = train_args(shard, str(tmp_path / "m.jsonl"), batch=2, steps=1)
    for binding, warned in (("core", True), ("none", False)):
        p = subprocess.run([MPIRUN, "--bind-to", binding, "-np", "1", sys.executable, *args],
                           capture_output=True, text=True, timeout=240, env=env)
        assert p.returncode == 0, p.stderr[-3000:]
        assert ("give mpirun --bind-to none" in p.stderr) == warned, (binding, p.stderr)
    lines = []
    monkeypatch.setattr(mpi, "allowed_cpus", lambda: {0, 1, 2, 3})
    monkeypatch.setattr(sys, "stderr", type("W", (), {"write": lambda _, t: lines.append(t),
                                                      "flush": lambda _: None})())
    mpi.say_if_bound([[0], [1]])
    assert "bound this node's 2 rank(s) to 2 of the 4 cores" in "".join(lines)
    lines.clear()
    mpi.say_if_bound([[0, 1], [2, 3]])
    assert lines == []
    warned = []                     # a run's warn (TrainConfig.warn) gets it instead
    mpi.say_if_bound([[0]], warned.append)
    assert lines == [] and warned[0].startswith("the launcher bound this node's 1 rank(s) to 1 "
                                                "of the 4 cores")
    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PMIX_RANK", "0")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "4")
    assert mpi.launched_by_mpirun()
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "1")
    assert not mpi.launched_by_mpirun()
