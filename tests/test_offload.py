"""Training under a memory budget (--memory-limit): StarPU allocates every tensor, caps its
main memory and evicts to a disk node (runtime/offload.py, csrc/starpu/ooc.c,
flow/handles.py). A capped run gives bitwise the losses, parameters and moments of the
uncapped run on the same partition, on every partition, resumed, and under mpirun -np 2; its
peak RSS stays under the cap plus offload.RSS_OVERHEAD while the uncapped run's does not; and
the cases it cannot run end with one clear error before the first step (a cap too small for a
task, an offload folder that is not one, unwritable or too small) or, for a disk that fills
mid-run, with one clear error, status 2, the last checkpoint intact and no file left behind.

The model is small in flops and large in activations (12 layers of C = 64 over B x T = 16 x
128 tokens, a 512-token vocabulary): 194 MiB of tensors of which no task holds more than 16
MiB, so that a cap of 64 MiB makes StarPU evict most of a step while the run stays fast.
"""
import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

from starpu_llm import StarpuLLMError
from starpu_llm.model.config import GPTConfig, ParamLayout
from starpu_llm.flow.memory import step_needs
from starpu_llm.io import checkpoint, formats
from starpu_llm.perf.runs import run_sampling_rss
from starpu_llm.plan.partition import PartitionRequest
from starpu_llm.runtime import Runtime, resolve_here
from starpu_llm.runtime.offload import RSS_OVERHEAD, MemoryLimit, OffloadFolder, parse_size
from starpu_llm.model.state import RandomInit, random_init
from starpu_llm.training.trainer import TrainConfig, train

MODEL = GPTConfig(max_seq_len=128, vocab_size=512, padded_vocab_size=512, num_layers=12,
                  num_heads=4, channels=64)
B, T, STEPS, LR = 16, 128, 3, 1e-3
CAP = "64M"
MPIRUN = shutil.which("mpirun")
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           OMPI_MCA_rmaps_base_oversubscribe="1")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The model's initial checkpoint and a token shard of its vocabulary."""
    d = tmp_path_factory.mktemp("offload")
    init, shard = str(d / "init.bin"), str(d / "training.bin")
    formats.write_checkpoint(init, MODEL, random_init(MODEL, 5))
    formats.write_shard(shard, np.random.default_rng(1).integers(0, MODEL.V, 100_000)
                        .astype(np.uint16))
    return init, shard


def settings(files, out, **kw):
    init, shard = files
    return dict(init_from=init, train_data=shard, batch=B, seq_len=T, steps=STEPS, lr=LR,
                weight_decay=0.01, save=str(out / "model.bin"), log=None, **kw)


def cli(files, out, *extra):
    init, shard = files
    return ["-m", "starpu_llm", "train", "--init-from", init, "--train-data", shard,
            "--batch", str(B), "--seq-len", str(T), "--steps", str(STEPS), "--lr", str(LR),
            "--weight-decay", "0.01", "--metrics-jsonl", str(out / "m.jsonl"), *extra]


def metrics(out):
    return [json.loads(line) for line in open(out / "m.jsonl")]


def same_files(a, b):
    """Whether two checkpoint pairs hold the same model (byte for byte), moments, step and
    data position (their run records may differ: a run's steps)."""
    x, y = checkpoint.read(a), checkpoint.read(b)
    return (open(a, "rb").read() == open(b, "rb").read() and (x.step, x.data) == (y.step, y.data)
            and all(np.array_equal(getattr(x, k).view(np.uint32), getattr(y, k).view(np.uint32))
                    for k in ("params", "m", "v")))


def hexes(losses):
    return [float(x).hex() for x in losses]


def fits(**partition):
    try:
        resolve_here(PartitionRequest(workers=partition.get("workers", 1),
                                      cores_per_worker=partition.get("cores_per_worker", 1)))
    except StarpuLLMError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def uncapped(files, tmp_path_factory):
    out = tmp_path_factory.mktemp("uncapped")
    return train(TrainConfig(**settings(files, out, save_every=1, checkpoint_dir=str(out / "ck"),
                                        keep_checkpoints=STEPS))), out


def test_random_init_read_from_any_slice_on():
    """Under a limit each rank draws only its slices (state.RandomInit): read from a later
    slice on (a rank owning wte's second row block of three, then the rest), the values are
    random_init's, which draws the whole model."""
    whole = random_init(MODEL, 5)
    init = RandomInit(MODEL, 5)
    for _, offset, shape in ParamLayout(MODEL).slice_list(3)[1:]:
        out = np.empty(int(np.prod(shape)), np.float32)
        init.read_range(offset, out)
        assert np.array_equal(out, whole[offset:offset + out.size])
    with pytest.raises(ValueError, match="llm.c's order"):
        init.read_range(0, out)


def test_the_model_needs_far_more_than_the_cap():
    needs = step_needs(MODEL, B, T)
    assert needs.footprint > 3 * parse_size(CAP) > 3 * needs.largest_task


@pytest.mark.parametrize("partition", [{}, {"workers": 2, "cores_per_worker": 1},
                                       {"workers": 1, "cores_per_worker": 2, "sub_batches": 2},
                                       {"grad_accum": 2}],
                         ids=["default", "2x1", "1x2-chain", "accum-2"])
def test_capped_run_equals_uncapped(files, tmp_path, partition):
    """Losses, final parameters and moments bitwise those of the uncapped run, while StarPU
    read and wrote the disk at every step (with 2 micro-batches a step: each one's
    activations dropped after its backward, the losses kept across them)."""
    fits(**partition)
    free_out, capped_out = tmp_path / "free", tmp_path / "capped"
    free = train(TrainConfig(**settings(files, free_out, **partition)))
    capped = train(TrainConfig(**settings(files, capped_out, memory_limit=CAP, **partition)))
    assert hexes(capped.losses) == hexes(free.losses)
    assert same_files(free_out / "model.bin", capped_out / "model.bin")
    assert free.disk_traffic is None and len(capped.disk_traffic) == STEPS
    assert all(read > 0 and written > 0 for read, written in capped.disk_traffic)


def test_capped_resume_equals_uncapped(files, uncapped, tmp_path):
    """A capped run stopped after step 1 and resumed, capped, from its checkpoint (read slice
    by slice) ends where the uncapped run does; its checkpoints (written slice by slice from
    StarPU's handles) are the uncapped run's, byte for byte."""
    free, free_out = uncapped
    first = settings(files, tmp_path, memory_limit=CAP, save_every=1,
                     checkpoint_dir=str(tmp_path / "ck"))
    a = train(TrainConfig(**dict(first, steps=1)))
    assert same_files(free_out / "ck" / "step_00000001.bin", tmp_path / "ck" / "step_00000001.bin")
    rest = dict(first, init_from=None, resume=str(tmp_path / "ck"))
    b = train(TrainConfig(**rest))
    assert hexes(a.losses + b.losses) == hexes(free.losses)
    assert same_files(free_out / "model.bin", tmp_path / "model.bin")


def measured(args, out, env=ENV):
    """(exit status, stderr, peak RSS in bytes) of a python child process, its RSS sampled
    every 5 ms from /proc (runs.run_sampling_rss)."""
    out.mkdir(exist_ok=True)
    with open(out / "stderr", "w+") as err:
        status, peak = run_sampling_rss([sys.executable, *args], subprocess.DEVNULL, err, env)
        err.seek(0)
        return status, err.read(), peak


def test_peak_rss_stays_under_the_cap(files, tmp_path):
    """The capped process's peak RSS is under the cap plus RSS_OVERHEAD; the uncapped one's
    is not: the cap is what bounds it. Same losses."""
    free_out, capped_out = tmp_path / "free", tmp_path / "capped"
    status, err, free = measured(cli(files, free_out), free_out)
    assert status == 0, err
    status, err, capped = measured(cli(files, capped_out, "--memory-limit", CAP), capped_out)
    assert status == 0, err
    limit = parse_size(CAP) + RSS_OVERHEAD
    assert capped <= limit < free, (capped, limit, free)
    assert ([r["loss"] for r in metrics(capped_out)] == [r["loss"] for r in metrics(free_out)])
    assert all(r["disk_read_mb"] > 0 and r["disk_written_mb"] > 0 for r in metrics(capped_out))


@pytest.mark.skipif(MPIRUN is None, reason="no mpirun")
@pytest.mark.parametrize("mode", [[], ["--pipeline-stages", "2"]], ids=["sharded", "pipeline"])
def test_capped_mpi_run_equals_uncapped(files, tmp_path, mode):
    """mpirun -np 2, sharded ownership or 2 pipeline stages: each rank capped (its own limit
    and disk node), the same losses bitwise."""
    runs = {}
    for name, extra in (("free", mode), ("capped", mode + ["--memory-limit", CAP])):
        out = tmp_path / name
        out.mkdir()
        p = subprocess.run([MPIRUN, "--oversubscribe", "-np", "2", sys.executable,
                            *cli(files, out, *extra)], capture_output=True, text=True, env=ENV,
                           timeout=600)
        assert p.returncode == 0, p.stderr
        runs[name] = metrics(out)
    assert [r["loss"] for r in runs["capped"]] == [r["loss"] for r in runs["free"]]
    assert all(r["disk_read_mb"] > 0 and r["disk_written_mb"] > 0 for r in runs["capped"])


# --------------------------------------------------------------------------- what it cannot run

def run_cli(args, env=ENV, timeout=600):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def test_a_cap_below_the_largest_task_fails_before_the_first_step(files, tmp_path):
    off = tmp_path / "off"
    off.mkdir()
    p = run_cli(cli(files, tmp_path, "--memory-limit", "8M", "--offload-dir", str(off)))
    assert p.returncode == 2
    assert "--memory-limit 8 MiB cannot hold what the tasks need at once" in p.stderr
    assert "give at least" in p.stderr and p.stderr.count("error") == 1
    assert "step" not in p.stdout and os.listdir(off) == []


@pytest.mark.parametrize("where, why", [("missing", "is not a folder"),
                                        ("/sys", "cannot write in"),
                                        ("/dev/null", "is not a folder")])
def test_an_offload_folder_that_is_none_fails_before_the_first_step(files, tmp_path, where,
                                                                     why):
    folder = str(tmp_path / where) if where == "missing" else where
    p = run_cli(cli(files, tmp_path, "--memory-limit", CAP, "--offload-dir", folder))
    assert p.returncode == 2 and f"--offload-dir {folder}" in p.stderr and why in p.stderr
    assert "step" not in p.stdout


def test_an_offload_folder_without_room_fails_before_the_first_step(files, tmp_path,
                                                                    monkeypatch):
    monkeypatch.setattr(OffloadFolder, "free_bytes", lambda self: 100 << 20)
    lines = []
    with pytest.raises(StarpuLLMError, match="has 100 MiB free, but StarPU may have to evict up "
                                             "to 194 MiB there"):
        train(TrainConfig(**dict(settings(files, tmp_path, memory_limit=CAP), log=lines.append)))
    assert not any(line.startswith("step") for line in lines)


@pytest.mark.parametrize("setting, why", [
    (dict(engine="reference"), "needs engine starpu"),
    (dict(kcore="forkjoin", workers=1, cores_per_worker=2), "use kcore team"),
    (dict(memory_limit="12X"), "give a size such as 12G"),
    (dict(memory_limit=None, offload_dir="/tmp"), "give memory_limit too"),
    (dict(workers="auto"), "memory_limit: give workers N")])
def test_settings_it_cannot_run_are_refused(files, tmp_path, setting, why):
    if setting.get("cores_per_worker"):
        fits(**setting)
    with pytest.raises(StarpuLLMError, match=why):
        train(TrainConfig(**{**settings(files, tmp_path, memory_limit=CAP), **setting}))


def test_a_runtime_given_a_partition_resolved_without_the_limit_refuses_forkjoin(tmp_path):
    """A Runtime started with a memory limit on a partition resolved without it applies
    resolve's rule (check_memory_limit) before StarPU starts: no FORKJOIN tasks under it."""
    fits(workers=1, cores_per_worker=2)
    p = resolve_here(PartitionRequest(workers=1, cores_per_worker=2, kcore="forkjoin"))
    if p.kcore != "forkjoin":
        pytest.skip(f"this build runs 1x2 as {p.kcore}")
    with pytest.raises(StarpuLLMError, match="use kcore team"):
        Runtime(p, memory=MemoryLimit.of(CAP, str(tmp_path)))
    assert Runtime._active is None and not list(tmp_path.iterdir())


def test_a_runtime_given_a_parallel_workers_partition_and_a_limit_is_one_clear_error(tmp_path):
    """A partition resolved without the limit where the build has parallel workers (StarPU
    1.4 with the ws fix) runs K-core tasks on them, which resolve avoids under a limit (1.4.12
    asserts when a parallel worker prefetches a task's data again): a Runtime given it with a
    limit says so before StarPU starts, as for FORKJOIN (it was sl_start's -EINVAL, "starpu_init
    failed (-22)"). The partition is made so here: this build may lack parallel workers."""
    from dataclasses import replace
    fits(workers=1, cores_per_worker=2)
    p = replace(resolve_here(PartitionRequest(workers=1, cores_per_worker=2)),
                kcore="parallel-workers")
    with pytest.raises(StarpuLLMError, match="memory.limit.*parallel workers"):
        Runtime(p, memory=MemoryLimit.of(CAP, str(tmp_path)))
    assert Runtime._active is None and not list(tmp_path.iterdir())


def test_a_disk_that_fills_mid_run_ends_it_cleanly(files, uncapped, tmp_path):
    """The disk fills during step 2 (SL_OOC_TEST_FULL_AFTER: full once that many bytes were
    written): one error, status 2, step 1's checkpoint intact (the uncapped run's), the
    offload folder gone."""
    probe = train(TrainConfig(**settings(files, tmp_path / "probe", memory_limit=CAP)))
    first, second = (w for _, w in probe.disk_traffic[:2])
    off, out = tmp_path / "off", tmp_path / "full"
    off.mkdir()
    out.mkdir()
    env = dict(ENV, SL_OOC_TEST_FULL_AFTER=str(first + second // 2))
    p = run_cli(cli(files, out, "--memory-limit", CAP, "--offload-dir", str(off),
                    "--save-every", "1", "--checkpoint-dir", str(out / "ck")), env=env)
    assert p.returncode == 2, p.stderr
    assert p.stderr.count("error") == 1 and "the disk is full" in p.stderr
    assert "No space left on device" in p.stderr and "--resume" in p.stderr
    assert [line.split("/")[0] for line in p.stdout.splitlines() if line.startswith("step")] == [
        "step    1"]
    free_out = uncapped[1]
    assert same_files(free_out / "ck" / "step_00000001.bin", checkpoint.latest(out / "ck"))
    assert os.listdir(off) == []


@pytest.mark.parametrize("sig, status, name", [(signal.SIGINT, 130, "Ctrl-C"),
                                               (signal.SIGTERM, 143, "SIGTERM")])
def test_a_signal_saves_and_removes_the_offload_folder(files, tmp_path, sig, status, name):
    off = tmp_path / "off"
    off.mkdir()
    p = subprocess.Popen([sys.executable, *cli(files, tmp_path, "--memory-limit", CAP,
                                               "--offload-dir", str(off), "--steps", "50",
                                               "--save", str(tmp_path / "model.bin"))],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    for line in p.stdout:
        if line.startswith("step"):
            assert len(os.listdir(off)) == 1        # the run's folder, while it runs
            p.send_signal(sig)
            break
    rest, err = p.communicate(timeout=300)
    assert p.returncode == status, err
    assert f"stopped by {name}" in rest and os.listdir(off) == []
    assert checkpoint.read(tmp_path / "model.bin").step >= 1


def test_a_second_signal_ends_the_run_at_once(files, tmp_path):
    """SIGTERM, then Ctrl-C while the step under way runs (the main thread inside StarPU):
    the process ends at once with 130, without saving, its offload folder removed."""
    off = tmp_path / "off"
    off.mkdir()
    p = subprocess.Popen([sys.executable, "-u", *cli(files, tmp_path, "--memory-limit", CAP,
                                                     "--offload-dir", str(off), "--steps", "50",
                                                     "--save", str(tmp_path / "model.bin"))],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
    out = []
    for line in p.stdout:
        out.append(line)
        if line.startswith("step"):
            p.send_signal(signal.SIGTERM)
        if "SIGTERM: stopping after the step under way" in line:
            p.send_signal(signal.SIGINT)
            break
    out = "".join(out) + p.communicate(timeout=300)[0]
    assert p.returncode == 130, out
    assert "Ctrl-C again: stopped at once, without saving" in out and "Traceback" not in out
    assert os.listdir(off) == [] and not os.path.exists(tmp_path / "model.bin")
