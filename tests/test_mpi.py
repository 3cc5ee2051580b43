"""Multi-process training under mpirun (StarPU-MPI), on this one machine.

Every rank runs the whole task graph; rank r computes B/R sequences, rank 0 reduces the
gradients and updates. Results must equal a single process on the same global batch.
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

from starpu_llm import formats
from starpu_llm.config import MODELS

MICRO = MODELS["micro"]
MPIRUN = shutil.which("mpirun")
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           OMPI_MCA_rmaps_base_oversubscribe="1")


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("mpi") / "train.bin")
    rng = np.random.default_rng(1)
    formats.write_shard(path, np.tile(rng.integers(0, MICRO.V, 41), 800).astype(np.uint16))
    return path


def train_args(shard, metrics, batch=6, steps=5):
    return ["-m", "starpu_llm", "train", "--model", "micro", "--train-data", shard,
            "--batch", str(batch), "--seq-len", "16", "--steps", str(steps), "--lr", "1e-2",
            "--weight-decay", "0.01", "--metrics-jsonl", metrics]


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


@pytest.mark.parametrize("ranks", [2, 3])
def test_ranks_equal_single_process(shard, single, tmp_path, ranks):
    m = str(tmp_path / "m.jsonl")
    save = str(tmp_path / "model.bin")
    p = mpirun(ranks, train_args(shard, m) + ["--save", save])
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    got = losses(m)
    assert len(got) == 5
    np.testing.assert_allclose(got, single, rtol=1e-5, atol=0)
    assert f"{ranks} MPI processes" in p.stdout
    assert p.stdout.count("step    5/5") == 1           # only rank 0 prints
    assert os.path.exists(save) and formats.read_checkpoint(save)[0] == MICRO


def test_batch_must_split_over_ranks(shard, tmp_path):
    p = mpirun(2, train_args(shard, str(tmp_path / "m.jsonl"), batch=3))
    assert p.returncode != 0
    assert "--batch 3" in p.stderr and "Traceback" not in p.stderr


def test_mismatched_settings_detected_before_training(shard, tmp_path):
    m = str(tmp_path / "m.jsonl")
    a = train_args(shard, m, batch=4)
    b = train_args(shard, m, batch=8)
    p = subprocess.run([MPIRUN, "--oversubscribe", "-np", "1", sys.executable, *a, ":",
                        "-np", "1", sys.executable, *b], capture_output=True, text=True,
                       timeout=240, env=ENV)
    assert p.returncode != 0
    assert "different settings" in p.stderr and "batch" in p.stderr, p.stderr[-3000:]
    assert "step    1" not in p.stdout                    # nothing trained


def test_dead_rank_ends_the_job(shard, tmp_path):
    """kill -9 of one rank mid-run: the job exits non-zero within 60 s, no hang."""
    pids = tmp_path / "pids"
    pids.mkdir()
    wrapper = tmp_path / "rank.sh"
    wrapper.write_text(f'#!/bin/sh\necho $$ > {pids}/$OMPI_COMM_WORLD_RANK\nexec "$@"\n')
    wrapper.chmod(0o755)
    args = train_args(shard, str(tmp_path / "m.jsonl"), batch=4, steps=100000)
    p = subprocess.Popen([MPIRUN, "--oversubscribe", "-np", "2", str(wrapper), sys.executable,
                          "-u", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=ENV)
    try:
        for line in p.stdout:
            if "step    3/" in line:
                break
        os.kill(int((pids / "1").read_text()), signal.SIGKILL)
        t0 = time.monotonic()
        rc = p.wait(timeout=60)
        assert rc != 0
        assert time.monotonic() - t0 < 60
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
