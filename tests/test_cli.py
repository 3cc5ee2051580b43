"""The command line: a real run, its outputs, and one clear error for each kind of bad input."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from starpu_llm.io import checkpoint, formats
from starpu_llm.config import MODELS, ParamLayout
from starpu_llm.runtime import usable_cores
from starpu_llm.state import random_init

MICRO = MODELS["micro"]   # V=250: tiny random shards stand in for real data


def run(*args, timeout=300):
    p = subprocess.run([sys.executable, "-m", "starpu_llm", *args], capture_output=True,
                       text=True, timeout=timeout)
    return p.returncode, p.stdout, p.stderr


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    path = str(d / "micro_train.bin")
    # a repeated random phrase: learnable, so a falling loss means training works
    formats.write_shard(path, np.tile(rng.integers(0, MICRO.V, 37), 600).astype(np.uint16))
    return path


def assert_clean_error(rc, err, *needles):
    assert rc == 2, err
    assert "Traceback" not in err, err
    assert err.count("error:") == 1, err
    for n in needles:
        assert n in err, err


def test_train_save_and_metrics(shard, tmp_path):
    save = str(tmp_path / "out" / "model.bin")
    metrics = str(tmp_path / "m.jsonl")
    rc, out, err = run("train", "--model", "micro", "--train-data", shard, "--batch", "2",
                       "--seq-len", "16", "--steps", "3", "--lr", "1e-2", "--save", save,
                       "--metrics-jsonl", metrics)
    assert rc == 0, err
    assert "step    3/3: train loss" in out
    assert "tokens/ms over 2 timed step(s)" in out and "peak RSS" in out
    rows = [json.loads(l) for l in open(metrics)]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(set(r) == {"step", "loss", "ms", "tokens_per_ms", "partition"} for r in rows)
    # no partition flag: the documented default, one worker on all usable cores
    assert rows[0]["partition"] == dict(engine="starpu", workers=1, cores_per_worker=usable_cores(),
                                        sub_batches=1, kcore=rows[0]["partition"]["kcore"], ranks=1,
                                        ownership="rank0", stages=1, gpus=0, gpu_matmul="")
    assert rows[0]["partition"]["kcore"] in (("single",) if usable_cores() == 1 else
                                             ("team", "parallel-workers"))
    assert f"partition: 1 worker(s) x {usable_cores()} core(s)" in out
    assert rows[-1]["loss"] < rows[0]["loss"]
    config, params = formats.read_checkpoint(save)
    assert config == MICRO
    assert not np.array_equal(params, random_init(MICRO))   # trained, not the init
    # the model and its state, to resume from; no temporary left
    assert sorted(os.listdir(tmp_path / "out")) == ["model.bin", "model.bin.state"]


def test_init_from_checkpoint_gives_config_and_resumes_weights(shard, tmp_path):
    ckpt = str(tmp_path / "init.bin")
    formats.write_checkpoint(ckpt, MICRO, random_init(MICRO, seed=7))
    rc, out, err = run("train", "--init-from", ckpt, "--train-data", shard, "--batch", "2",
                       "--seq-len", "16", "--steps", "2", "--engine", "reference")
    assert rc == 0, err
    assert f"L={MICRO.L} NH={MICRO.NH} C={MICRO.C} V={MICRO.V}" in out


def test_wrong_magic(shard, tmp_path):
    bad = tmp_path / "bad.bin"
    bad.write_bytes(np.zeros(300, np.int32).tobytes())
    rc, _, err = run("train", "--init-from", str(bad), "--train-data", shard)
    assert_clean_error(rc, err, "bad.bin", "magic")


def test_truncated_checkpoint(shard, tmp_path):
    ckpt = tmp_path / "trunc.bin"
    formats.write_checkpoint(str(ckpt), MICRO, random_init(MICRO))
    data = ckpt.read_bytes()
    ckpt.write_bytes(data[: len(data) - 1000])
    rc, _, err = run("train", "--init-from", str(ckpt), "--train-data", shard)
    assert_clean_error(rc, err, "trunc.bin", "truncated")


def test_truncated_shard(tmp_path):
    good = tmp_path / "s.bin"
    formats.write_shard(str(good), np.arange(5000, dtype=np.uint16) % 200)
    good.write_bytes(good.read_bytes()[:-10])
    rc, _, err = run("train", "--model", "micro", "--train-data", str(good), "--seq-len", "16")
    assert_clean_error(rc, err, "s.bin")


def test_token_out_of_range(tmp_path):
    path = str(tmp_path / "big_ids.bin")
    formats.write_shard(path, np.full(5000, MICRO.V, np.uint16))   # id == V
    rc, _, err = run("train", "--model", "micro", "--train-data", path, "--seq-len", "16")
    assert_clean_error(rc, err, "big_ids.bin", str(MICRO.V))


def test_seq_len_above_max(shard):
    rc, _, err = run("train", "--model", "micro", "--train-data", shard, "--seq-len",
                     str(MICRO.maxT + 1))
    assert_clean_error(rc, err, "--seq-len")


def test_shard_shorter_than_one_batch(tmp_path):
    path = str(tmp_path / "short.bin")
    formats.write_shard(path, np.arange(30, dtype=np.uint16))
    rc, _, err = run("train", "--model", "micro", "--train-data", path, "--batch", "2",
                     "--seq-len", "16")
    assert_clean_error(rc, err, "short.bin", "33")


@pytest.mark.parametrize("args,flag", [
    (["--engine", "gpu"], "--engine"),
    (["--batch", "0"], "--batch"),
    (["--batch", "two"], "--batch"),
    (["--model", "gpt5"], "--model"),
    (["--lr", "-1"], "--lr"),
])
def test_bad_flag_values(args, flag):
    rc, _, err = run("train", *args)
    assert_clean_error(rc, err, flag)


def test_impossible_partition(shard):
    # one more one-core worker than this process has cores (or than StarPU can run)
    rc, _, err = run("train", "--model", "micro", "--train-data", shard, "--seq-len", "16",
                     "--workers", str(usable_cores() + 1), "--cores-per-worker", "1")
    assert_clean_error(rc, err, "--workers")


def test_missing_file():
    rc, _, err = run("train", "--init-from", "/nonexistent/model.bin")
    assert_clean_error(rc, err, "/nonexistent/model.bin")


def interrupted(*args, cwd=None):
    """`starpu-llm train *args` sent SIGINT once it printed step 3: (status, stdout, stderr)."""
    p = subprocess.Popen([sys.executable, "-u", "-m", "starpu_llm", "train", *args], cwd=cwd,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    try:
        for line in p.stdout:
            lines.append(line)
            if "step    3/" in line:
                break
        p.send_signal(signal.SIGINT)
        rc = p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    return rc, "".join(lines) + p.stdout.read(), p.stderr.read()


def test_ctrl_c_exits_cleanly(shard):
    """SIGINT mid-run: StarPU is shut down, exit status 130, no crash, no traceback."""
    rc, _, err = interrupted("--model", "micro", "--train-data", shard, "--batch", "2",
                             "--seq-len", "16", "--steps", "100000")
    assert rc == 130, err
    assert "interrupted" in err and "Traceback" not in err


def test_resume_from_a_checkpoint_directory(shard, tmp_path):
    ck, metrics = str(tmp_path / "ck"), str(tmp_path / "m.jsonl")
    args = ("train", "--model", "micro", "--train-data", shard, "--batch", "2", "--seq-len", "16",
            "--metrics-jsonl", metrics)
    rc, _, err = run(*args, "--steps", "3", "--save-every", "2", "--checkpoint-dir", ck)
    assert rc == 0, err
    assert sorted(os.listdir(ck)) == ["step_00000002.bin", "step_00000002.bin.state"]
    rc, out, err = run(*args, "--steps", "5", "--resume", ck)
    assert rc == 0, err
    assert "step    3/5" in out and "step    2/5" not in out
    # the resumed run's metrics: the first run's up to the checkpoint, then its own
    assert [json.loads(l)["step"] for l in open(metrics)] == [1, 2, 3, 4, 5]
    rc, _, err = run(*args, "--steps", "2", "--resume", ck)
    assert_clean_error(rc, err, "at step 2 already", "--steps above 2")
    # a micro run resumed as another model: refused, not silently trained as the saved one
    rc, _, err = run("train", "--model", "tiny", "--train-data", shard, "--steps", "5",
                     "--resume", ck)
    assert_clean_error(rc, err, "--model tiny contradicts", "the micro model")
    # no --model: the checkpoint's; a changed batch is named in one warning line
    rc, out, err = run("train", "--train-data", shard, "--batch", "4", "--seq-len", "16",
                       "--steps", "5", "--resume", ck)
    assert rc == 0, err
    assert [l for l in out.splitlines() if l.startswith("warning")] == [
        "warning: --batch 4 (saved with 2): the run is no longer the uninterrupted one"], out


def test_unwritable_save_is_reported_before_training(shard, tmp_path):
    (tmp_path / "a_file").write_text("")
    rc, out, err = run("train", "--model", "micro", "--train-data", shard, "--seq-len", "16",
                       "--save", str(tmp_path / "a_file" / "model.bin"))
    assert_clean_error(rc, err, "a_file")
    assert "step" not in out


def test_ctrl_c_saves_a_checkpoint_to_resume_from(shard, tmp_path):
    """SIGINT mid-run with --save: the run stops after the step under way, writes the model
    and its state (no temporary, no core left), exits with 130; the run resumes from them."""
    save = str(tmp_path / "model.bin")
    args = ["--train-data", shard, "--batch", "2", "--seq-len", "16"]
    rc, out, err = interrupted(*args, "--model", "micro", "--steps", "100000", "--save", save,
                               cwd=tmp_path)
    assert rc == 130, err
    assert "interrupted" in err and "Traceback" not in err
    last = max(int(l.split()[1].split("/")[0]) for l in out.splitlines() if l.startswith("step"))
    assert checkpoint.read(save).step == last
    assert f"continue with --resume {save} --steps 100000" in out
    assert sorted(os.listdir(tmp_path)) == ["model.bin", "model.bin.state"]
    rc, out, err = run("train", *args, "--resume", save, "--steps", str(last + 1))
    assert rc == 0, err
    assert f"step {last + 1:4d}/{last + 1}" in out
