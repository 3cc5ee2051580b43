"""The command line: a real run, its outputs, and one clear error for each kind of bad input."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from starpu_llm.io import checkpoint, formats
from starpu_llm.model.config import MODELS
from starpu_llm.runtime import usable_cores
from starpu_llm.model.state import random_init
import starpu_llm
from starpu_llm import signals

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
                                        ownership="rank0", stages=1, gpus=0, gpu_matmul="",
                                        sched="lws", pipeline_schedule="", attention="gemm")
    assert rows[0]["partition"]["kcore"] in (("single",) if usable_cores() == 1 else
                                             ("team", "parallel-workers"))
    assert f"partition: 1 worker(s) x {usable_cores()} core(s)" in out
    assert rows[-1]["loss"] < rows[0]["loss"]
    config, params = formats.read_checkpoint(save)
    assert config == MICRO
    assert not np.array_equal(params, random_init(MICRO))   # trained, not the init
    # the model and its state, to resume from; no temporary left
    assert sorted(os.listdir(tmp_path / "out")) == ["model.bin", "model.bin.state"]


@pytest.mark.parametrize("accum,first", [(1, 1 / 3), (2, 2 / 3)])
def test_each_steps_rate_counts_the_work_its_time_holds(shard, tmp_path, accum, first):
    """Steps read ahead (the StarPU engine in one process): each row's tokens/ms x ms is the
    work its time holds, in steps: the drained warm-up 1, the first timed step (read at its
    loss, after a drain) its forward, 1/3 (it showed 3x the run's rate, and an mfu above 100
    %; with 2 micro-batches the first one's backward too: 2/3), the next ones 1, the last
    (drained after one read ahead) 2 - that; the run's tokens/ms is its tokens over the wall
    time."""
    metrics = str(tmp_path / "m.jsonl")
    rc, out, err = run("train", "--model", "micro", "--train-data", shard, "--batch", "2",
                       "--seq-len", "16", "--steps", "5", "--grad-accum", str(accum),
                       "--metrics-jsonl", metrics)
    assert rc == 0, err
    rows = [json.loads(line) for line in open(metrics)]
    work = [r["tokens_per_ms"] * r["ms"] / (accum * 2 * 16) for r in rows]
    assert work == pytest.approx([1, first, 1, 1, 2 - first], rel=1e-9), work
    run_rate = 4 * accum * 2 * 16 / sum(r["ms"] for r in rows[1:])
    assert f"tokens/ms over 4 timed step(s): {run_rate:.4f}" in out


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


def test_a_shard_error_names_its_flag(shard, tmp_path):
    """A validation shard shorter than one batch (or any error reading a shard given) names
    the flag that gave it: the message alone did not say whether the file was --train-data or
    --val-data."""
    path = str(tmp_path / "short.bin")
    formats.write_shard(path, np.arange(30, dtype=np.uint16))
    common = ("train", "--model", "micro", "--batch", "2", "--seq-len", "16", "--val-every", "1")
    rc, _, err = run(*common, "--train-data", shard, "--val-data", path)
    assert_clean_error(rc, err, f"--val-data: {path} is too short: needs at least B*T+1 = 33")
    rc, _, err = run(*common, "--train-data", path, "--val-data", shard)
    assert_clean_error(rc, err, f"--train-data: {path} is too short")


def test_train_on_shards_named_by_a_glob_pattern(tmp_path):
    """--train-data and --val-data take a quoted glob pattern: its shards, sorted, said at
    the start; --val-batches over several validation shards; a shard refused names itself
    and its flag; a pattern that matches nothing is one clean error."""
    rng = np.random.default_rng(2)
    for name, n in [("t_001", 80), ("t_000", 100), ("v_000", 40), ("v_001", 40)]:
        formats.write_shard(tmp_path / f"{name}.bin", rng.integers(0, MICRO.V, n).astype(np.uint16))
    common = ("train", "--model", "micro", "--batch", "2", "--seq-len", "16")
    train_glob, val_glob = str(tmp_path / "t_*.bin"), str(tmp_path / "v_*.bin")
    rc, out, err = run(*common, "--steps", "4", "--train-data", train_glob, "--val-data",
                       val_glob, "--val-every", "2", "--val-batches", "5")
    assert rc == 0, err
    assert f"data: {train_glob} (180 tokens, 2 shards), B=2 T=16" in out
    assert f"validation: {val_glob} (80 tokens, 2 shards), 2 batch(es)" in out
    assert "step    4/4: train loss" in out
    formats.write_shard(tmp_path / "v_002.bin", np.full(40, MICRO.V, np.uint16))
    rc, _, err = run(*common, "--train-data", train_glob, "--val-data", val_glob,
                     "--val-every", "2", "--val-batches", "5")
    assert_clean_error(rc, err, f"--val-data: {tmp_path / 'v_002.bin'} contains token id "
                                f"{MICRO.V}")
    rc, _, err = run(*common, "--train-data", str(tmp_path / "x_*.bin"))
    assert_clean_error(rc, err, f"--train-data: no file matches the pattern {tmp_path / 'x_*.bin'}")


def test_prepare_shard_tokens_then_train_on_the_glob_is_training_on_the_single_shard(tmp_path):
    """`prepare --shard-tokens N` then `train --train-data GLOB`: with N a multiple of B x T
    (each shard N/(B x T) whole batches, the last shard one), the losses of training on the
    single shard `prepare` writes of the same text, loss for loss, through a wrap; with N not
    one, a shard's tail is never read (the straddling rule): its batches start at k x N, and
    the losses are those of shards made of exactly those batches. The message names the
    pattern to train on; --val-every without --val-data names the validation shard beside."""
    from starpu_llm.io import data
    from starpu_llm.training.trainer import TrainConfig, train
    text = tmp_path / "play.txt"
    text.write_text("To be, or not to be, that is the question:\nWhether tis nobler in the "
                    "mind to suffer\n\n" * 5)
    B, T = 2, 8
    common = ("prepare", str(text), "--val-tokens", "16")
    rc, out, err = run(*common, "--out-dir", str(tmp_path / "one"))
    assert rc == 0, err
    whole = formats.read_shard(tmp_path / "one" / "play_train.bin").tolist()
    steps = (len(whole) - 1) // (B * T) + 2                     # an epoch and 2 more
    losses = lambda pattern: train(TrainConfig(model="tiny", engine="reference", train_data=pattern,  # noqa: E731
                                               batch=B, seq_len=T, steps=steps, log=None)).losses
    single = losses(str(tmp_path / "one" / "play_train.bin"))
    for n in (2 * B * T, 3 * B * T // 2):
        rc, out, err = run(*common, "--out-dir", str(tmp_path / f"n{n}"), "--shard-tokens", str(n))
        assert rc == 0, err
        pattern = str(tmp_path / f"n{n}" / "play_train_*.bin")
        paths = data.shard_paths(pattern)
        assert (f"wrote {len(paths)} training shard(s) of {n + 1} tokens (the last "
                f"{len(whole) - n * (len(paths) - 1)}), {paths[0]} .. "
                f"{os.path.basename(paths[-1])}, and {tmp_path / f'n{n}' / 'play_val.bin'}; train "
                f"on them with --train-data '{pattern}' --val-data "
                f"{tmp_path / f'n{n}' / 'play_val.bin'}") in out
        sharded = losses(pattern)
        if n % (B * T) == 0:
            assert len(paths) > 2 and sharded == single
            continue
        # 25 tokens a shard: one batch of 17 from each, starting at k x 24 of the single's
        loader = data.DataLoader(pattern, B, T)
        firsts = [int(loader.next_tokens()[0]) for _ in paths]
        assert firsts == [whole[k * n] for k in range(len(paths))]
        for k in range(len(paths)):
            formats.write_shard(tmp_path / f"rule_{k}.bin", whole[k * n:k * n + B * T + 1])
        assert sharded == losses(str(tmp_path / "rule_*.bin"))
        assert sharded[0] == single[0] and sharded[1] != single[1]
    rc, _, err = run("train", "--model", "tiny", "--train-data", pattern, "--val-every", "2")
    assert_clean_error(rc, err, "--val-data, the validation shard of the same text",
                       f"({tmp_path / f'n{n}' / 'play_val.bin'})")


def test_prepare_shard_tokens_errors(tmp_path):
    """--shard-tokens out of range, a file the shards' pattern would match that prepare did
    not write, an earlier shard that is not one: one clean error each, nothing written."""
    text = tmp_path / "notes.txt"
    text.write_text("To be, or not to be, that is the question.\n\n" * 20)
    out_dir = tmp_path / "out"
    common = ("prepare", str(text), "--out-dir", str(out_dir), "--val-tokens", "8")
    rc, _, err = run(*common, "--shard-tokens", "0")
    assert_clean_error(rc, err, "--shard-tokens must be at least 1, got 0")
    rc, _, err = run(*common, "--shard-tokens", str(2 ** 31 - 1))
    assert_clean_error(rc, err, f"--shard-tokens {2 ** 31 - 1} is not a shard size: give 1 .. "
                                f"{2 ** 31 - 2} tokens")
    out_dir.mkdir()
    (out_dir / "notes_train_old.bin").write_text("my notes\n")
    rc, _, err = run(*common, "--shard-tokens", "50")
    assert_clean_error(rc, err, f"{out_dir / 'notes_train_old.bin'} matches the training shards' "
                                f"pattern {out_dir / 'notes_train_*.bin'} but is not one that "
                                f"prepare writes", "give another --out-dir")
    (out_dir / "notes_train_old.bin").unlink()
    (out_dir / "notes_train_000003.bin").write_text("my notes\n")
    for shards in ((), ("--shard-tokens", "50")):         # it would be removed, or replaced
        rc, _, err = run(*common, *shards)
        assert_clean_error(rc, err, f"{out_dir / 'notes_train_000003.bin'}: a file is there",
                           "it is not a token shard")
    assert os.listdir(out_dir) == ["notes_train_000003.bin"]


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


@pytest.mark.parametrize("command", ["train", "predict"])
@pytest.mark.parametrize("words", [["--nosuch"], ["--cores-per-worke", "1"], ["--batc", "8"]])
def test_an_unknown_flag_is_the_commands_error(command, words):
    """A typo'd flag after a command: refused (no abbreviations: --cores-per-worke is not
    --cores-per-worker), with that command's usage."""
    rc, _, err = run(command, *words)
    assert_clean_error(rc, err, f"usage: starpu-llm {command} ",
                       f"starpu-llm {command}: error: unrecognized arguments: {' '.join(words)}")


def test_version():
    """--version: the package's version, the StarPU the compiled part loads (without starting
    it) and what the build has."""
    rc, out, err = run("--version")
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0] == f"starpu-llm {starpu_llm.__version__}"
    assert re.fullmatch(r"StarPU 1\.[34]\.\d+ \(/.*libstarpu-1\.[34]\.so.*\), STARPU_MAXCPUS \d+",
                        lines[1]), out
    assert re.fullmatch(r"StarPU-MPI: (yes|no), CUDA: (no|yes \(built with CUDA .+\)), "
                        r"parallel workers: .+", lines[2]), out
    assert lines[3].startswith("BLAS: "), out
    from starpu_llm._build import ISA
    assert lines[4] == (f"kernels: -march=native ({ISA})" if ISA
                        else "kernels: portable (-Dnative=false)"), out
    assert err == ""


def test_the_version_is_stated_once():
    # meson.build's project() version is the package's metadata (pyproject's is dynamic) and
    # starpu_llm.__version__ (the build's _build.py): no second copy to fall behind
    import importlib.metadata
    import tomllib
    root = Path(starpu_llm.__file__).resolve().parents[1]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    assert "version" not in project and "version" in project["dynamic"]
    meson = re.search(r"project\([^)]*?\bversion:\s*'([^']+)'", (root / "meson.build").read_text()).group(1)
    assert starpu_llm.__version__ == meson == importlib.metadata.version("starpu-llm")


def test_version_says_what_cuda_the_build_has_and_which_gpus_it_runs_on():
    """A CUDA build's --version, the check before queuing a GPU job: the CUDA it was built
    with and its architectures (meson's gpu_arch, recorded in _build.py: none in a CPU build),
    the driver's CUDA, and each GPU seen, by compute capability, with whether the kernels run
    on it (the code of its major version no newer, or the last's PTX)."""
    from starpu_llm._build import GPU_ARCH
    from starpu_llm.cli import cuda_text, gpu_arch_runs
    from starpu_llm.runtime.starpu import have_cuda
    assert bool(GPU_ARCH) == have_cuda()
    assert [cc for cc in (70, 75, 80, 86, 89, 90, 100, 120) if gpu_arch_runs(cc, [80, 90])] == \
        [80, 86, 89, 90, 100, 120]
    assert not gpu_arch_runs(80, [90]) and gpu_arch_runs(86, [80]) and not gpu_arch_runs(90, [])
    head = "built with CUDA 12.4 for sm_80 sm_90 + PTX compute_90; driver: "
    assert cuda_text("80 90", 12040, 12080, (2, ""), [80, 90]) == \
        head + "CUDA 12.8; 2 GPU(s) seen: 0: sm_80, 1: sm_90"
    assert cuda_text("90", 13000, 0, (0, "cudaGetDeviceCount failed: x"), []) == (
        "built with CUDA 13.0 for sm_90 + PTX compute_90; driver: none found; "
        "cudaGetDeviceCount failed: x")
    assert cuda_text("90", 13000, 13000, (3, ""), [80, 75, -999]) == (
        "built with CUDA 13.0 for sm_90 + PTX compute_90; driver: CUDA 13.0; 3 GPU(s) seen: "
        "0: sm_80, which this build's kernels do not run on (rebuild with -Dgpu_arch=80,90), "
        "1: sm_75, older than the kernels' sm_80, 2: cudaError 999")


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
    """SIGINT mid-run: StarPU is shut down, exit status 130, no crash, no traceback; without
    --save or --save-every the announcement does not promise a save."""
    rc, _, err = interrupted("--model", "micro", "--train-data", shard, "--batch", "2",
                             "--seq-len", "16", "--steps", "100000")
    assert rc == 130, err
    assert "interrupted" in err and "Traceback" not in err
    assert "stopping after the step under way (nothing is saved: no --save" in err, err
    assert "then saving" not in err


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
    # warnings go to stderr, one line each; the checkpoint resumed is named
    assert [l for l in err.splitlines() if l.startswith("warning")] == [
        "warning: --batch 4 (saved with 2): the run is no longer the uninterrupted one"], err
    assert "warning" not in out
    assert f"resuming: {checkpoint.step_path(ck, 2)} (step 2)" in out


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
    assert "Ctrl-C: stopping after the step under way, then saving" in err, err
    last = max(int(l.split()[1].split("/")[0]) for l in out.splitlines() if l.startswith("step"))
    assert checkpoint.read(save).step == last
    assert f"continue with --resume {save} --steps 100000" in out
    assert sorted(os.listdir(tmp_path)) == ["model.bin", "model.bin.state"]
    rc, out, err = run("train", *args, "--resume", save, "--steps", str(last + 1))
    assert rc == 0, err
    assert f"step {last + 1:4d}/{last + 1}" in out


# --------------------------------------------------------------------------- signals

def running(*args, cwd=None):
    """`starpu-llm train *args` started, its output merged into one stream."""
    return subprocess.Popen([sys.executable, "-u", "-m", "starpu_llm", "train", *args], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def handles_stop_signals(pid: int) -> bool:
    """Whether the process catches SIGUSR1 (Python's defaults do not): starpu-llm's handlers
    are installed, so main() runs."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGUSR1 - 1)))
    return False


def signalled(p, sig, delay: float, poll: float = 0.001):
    """(status, output) of process p sent sig `delay` seconds after its stop handlers are in."""
    try:
        while not handles_stop_signals(p.pid):
            time.sleep(poll)
        time.sleep(delay)
        p.send_signal(sig)
        out, _ = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    return p.returncode, out


@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_during_start_up_ends_cleanly(shard, sig, status):
    """A signal from the moment starpu-llm's handlers are in place (before numpy and StarPU are
    loaded): the command ends at once with 128 + the signal's number, one line, no
    traceback."""
    p = running("--model", "micro", "--train-data", shard, "--batch", "2", "--seq-len", "16",
                "--steps", "100000")
    try:
        while not handles_stop_signals(p.pid):
            time.sleep(0.001)
        p.send_signal(sig)
        out, _ = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == status, out
    assert "Traceback" not in out and "step " not in out
    assert out.strip().splitlines()[-1] in ("starpu-llm: interrupted",
                                            "starpu-llm: stopped by SIGTERM"), out


def test_the_command_handles_signals_from_its_package_first_line():
    """The starpu-llm command's handlers are in once its package is imported, before cli's
    imports (only Python's start-up comes before: the interpreter, site, and in an editable
    install meson-python's build check)."""
    code = ("import signal, sys; sys.argv = ['/bin/starpu-llm']; import starpu_llm; "
            "print(all(signal.getsignal(s) not in (signal.SIG_DFL, signal.default_int_handler) "
            "for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)), 'starpu_llm.cli' in "
            "sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60).stdout
    assert out.split() == ["True", "False"], out


@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_at_any_moment_of_start_up_ends_cleanly(shard, sig, status):
    """A signal from 10 ms after the handlers are in (the package's first line) through cli's
    imports, numpy's (which turns an exception raised inside it into an ImportError), the
    files and StarPU's start: 128 + the signal, one line, no traceback."""
    for delay in [0.01 * i for i in range(1, 21)] + [0.32, 0.64]:
        returncode, out = signalled(running("--model", "micro", "--train-data", shard, "--batch",
                                            "2", "--seq-len", "16", "--steps", "100000"),
                                    sig, delay)
        assert returncode == status, (delay, out)
        assert "Traceback" not in out, (delay, out)
        assert out.strip().splitlines()[-1] in ("starpu-llm: interrupted",
                                                "starpu-llm: stopped by SIGTERM"), (delay, out)


def test_importing_the_package_elsewhere_leaves_the_signals_alone():
    """Only the starpu-llm command installs handlers at import: a program importing
    starpu_llm keeps Python's."""
    code = ("import signal, starpu_llm; print(signal.getsignal(signal.SIGINT) is "
            "signal.default_int_handler, signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60).stdout
    assert out.split() == ["True", "True"], out


START_PTH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools",
                         "00-starpu-llm-start.pth")


def test_the_start_pth_is_installed_where_the_tests_run():
    """The .pth that covers Python's own start-up is in this environment's site-packages (the
    Makefile copies it into its editable venvs; a wheel installs it), as tools/ has it."""
    import site
    want = open(START_PTH).read()
    found = [os.path.join(d, "00-starpu-llm-start.pth") for d in site.getsitepackages()]
    assert any(os.path.exists(f) and open(f).read() == want for f in found), found


@pytest.mark.parametrize("sig", signals.STOP_SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_a_signal_before_the_package_is_imported_ends_cleanly(tmp_path, sig):
    """A signal while the console script is still importing, before the package's first line
    (the script's `import re`, an editable install's rebuild; here a stand-in script named
    starpu-llm that sleeps there): the handlers are already in from Python's site on
    (tools/00-starpu-llm-start.pth), for each of the package's stop signals, with the package's
    one line and 128 + the signal's number, no traceback."""
    script = tmp_path / "starpu-llm"
    script.write_text("import time\ntime.sleep(20)\nfrom starpu_llm.cli import main\nmain()\n")
    p = subprocess.Popen([sys.executable, str(script), "--version"], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 10
        while not handles_stop_signals(p.pid) and time.monotonic() < deadline:
            time.sleep(0.001)
        assert handles_stop_signals(p.pid), "no handlers while the script imports"
        p.send_signal(sig)
        out, _ = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 128 + sig, out
    assert out == f"starpu-llm: {signals.ended(sig)}\n", out


@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_from_pythons_start_up_on_ends_cleanly(shard, sig, status):
    """The starpu-llm console script from the moment Python's site has run (a few ms after
    the process starts; before that only the interpreter's own initialisation) through its
    imports to the package's first line and on: one line, 128 + the signal, no traceback,
    for each delay after the handlers are seen in place."""
    command = os.path.join(os.path.dirname(sys.executable), "starpu-llm")
    assert os.path.exists(command), command
    for delay in (0, 0.001, 0.002, 0.003, 0.005, 0.008, 0.012, 0.02, 0.03, 0.05, 0.08):
        p = subprocess.Popen([command, "train", "--model", "micro", "--train-data", shard,
                              "--batch", "2", "--seq-len", "16", "--steps", "100000"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        returncode, out = signalled(p, sig, delay, poll=0.0002)
        assert returncode == status, (delay, out)
        assert "Traceback" not in out and "Fatal" not in out, (delay, out)
        assert out.strip().splitlines()[-1] in ("starpu-llm: interrupted",
                                                "starpu-llm: stopped by SIGTERM"), (delay, out)


@pytest.mark.parametrize("sig, status, name", [(signal.SIGTERM, 143, "SIGTERM"),
                                               (signal.SIGUSR1, 138, "SIGUSR1"),
                                               (signal.SIGHUP, 129, "SIGHUP")])
def test_sigterm_and_sigusr1_stop_after_the_step_and_save(shard, tmp_path, sig, status, name):
    """SIGTERM (Slurm, timeout, container stops) and SIGUSR1 (mpirun forwards it) stop the run
    as Ctrl-C does: after the step under way, saving the model and a checkpoint, the metrics
    up to that step written; exit 128 + the signal's number."""
    save, ck, metrics = tmp_path / "model.bin", tmp_path / "ck", tmp_path / "m.jsonl"
    p = running("--model", "micro", "--train-data", shard, "--batch", "2", "--seq-len", "16",
                "--steps", "100000", "--save", str(save), "--save-every", "1000",
                "--checkpoint-dir", str(ck), "--metrics-jsonl", str(metrics))
    lines = []
    try:
        for line in p.stdout:
            lines.append(line)
            if line.startswith("step    3/"):
                p.send_signal(sig)
                break
        out = "".join(lines) + p.communicate(timeout=60)[0]
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == status, out
    last = max(int(l.split()[1].split("/")[0]) for l in out.splitlines() if l.startswith("step"))
    assert f"{name}: stopping after the step under way" in out
    assert f"stopped by {name} after step {last}" in out and "Traceback" not in out
    assert checkpoint.read(save).step == last == checkpoint.read(ck).step
    assert [json.loads(l)["step"] for l in open(metrics)] == list(range(1, last + 1))


def test_a_closed_stdout_stops_the_run_and_saves(shard, tmp_path):
    """`starpu-llm train ... | head`: once stdout is closed, the run stops after the step under
    way as on a signal: the model and a checkpoint saved, the metrics of every step, exit 141
    (128 + SIGPIPE), one line on stderr saying why; no traceback."""
    save, ck, metrics = tmp_path / "model.bin", tmp_path / "ck", tmp_path / "m.jsonl"
    p = subprocess.Popen([sys.executable, "-u", "-m", "starpu_llm", "train", "--model", "micro",
                          "--train-data", shard, "--batch", "2", "--seq-len", "16", "--steps",
                          "100000", "--save", str(save), "--save-every", "1000",
                          "--checkpoint-dir", str(ck), "--metrics-jsonl", str(metrics)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in p.stdout:
            if line.startswith("step    3/"):
                break
        p.stdout.close()           # as `head` does once it has its lines
        err = p.communicate(timeout=120)[1]
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 141, err
    assert "Traceback" not in err and "Error" not in err, err
    assert "stdout closed: stopping after the step under way" in err
    assert err.strip().splitlines()[-1] == "starpu-llm: stopped by a closed output", err
    last = checkpoint.read(save).step
    assert last >= 3 and checkpoint.read(ck).step == last
    assert [json.loads(l)["step"] for l in open(metrics)] == list(range(1, last + 1))


@pytest.mark.parametrize("fd", [1, 2])
def test_an_output_closed_from_the_start_loses_nothing(shard, tmp_path, fd):
    """`starpu-llm train ... >&-` (or 2>&-): the run trains and saves; what it prints goes
    nowhere (never into a file that took the closed descriptor's number)."""
    save, metrics = tmp_path / "model.bin", tmp_path / "m.jsonl"
    p = subprocess.run([sys.executable, "-m", "starpu_llm", "train", "--model", "micro",
                        "--train-data", shard, "--batch", "2", "--seq-len", "16", "--steps", "3",
                        "--save", str(save), "--metrics-jsonl", str(metrics)],
                       preexec_fn=lambda: os.close(fd), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert checkpoint.read(save).step == 3
    assert [json.loads(l)["step"] for l in open(metrics)] == [1, 2, 3]


def test_a_signal_with_stdout_closed_from_the_start_is_one_line(shard, tmp_path):
    """`starpu-llm train ... >&-`, then SIGTERM: the run stops after its step and saves, with
    the usual status and one line on stderr (no traceback of the missing sys.stdout)."""
    save, metrics = tmp_path / "model.bin", tmp_path / "m.jsonl"
    p = subprocess.Popen([sys.executable, "-m", "starpu_llm", "train", "--model", "micro",
                          "--train-data", shard, "--batch", "2", "--seq-len", "16", "--steps",
                          "100000", "--save", str(save), "--metrics-jsonl", str(metrics)],
                         preexec_fn=lambda: os.close(1), stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (metrics.exists() and metrics.stat().st_size) and time.monotonic() < deadline:
            time.sleep(0.05)
        p.send_signal(signal.SIGTERM)
        err = p.communicate(timeout=120)[1]
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 143, err
    assert "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == "starpu-llm: stopped by SIGTERM", err
    assert checkpoint.read(save).step >= 1


def test_metrics_survive_a_kill_and_a_resumed_run_appends(shard, tmp_path):
    """kill -9 mid-run: the metrics file has a row for every step printed (under its own name,
    no hidden temporary left); the run resumed from its last checkpoint keeps the rows up to
    it and appends its own."""
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    args = ["--model", "micro", "--train-data", shard, "--batch", "2", "--seq-len", "16",
            "--save-every", "4", "--checkpoint-dir", str(ck), "--metrics-jsonl", str(metrics)]
    p = running(*args, "--steps", "100000", cwd=tmp_path)
    printed = 0
    try:
        for line in p.stdout:
            if line.startswith("step"):
                printed = int(line.split()[1].split("/")[0])
                if printed == 10:
                    p.kill()
                    break
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    steps = [json.loads(l)["step"] for l in open(metrics)]
    assert steps[:10] == list(range(1, 11))
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []
    rc, out, err = run("train", *args, "--steps", "12", "--resume", str(ck))
    assert rc == 0, err
    resumed = checkpoint.read(checkpoint.step_path(ck, 12))
    assert resumed.step == 12
    assert [json.loads(l)["step"] for l in open(metrics)] == list(range(1, 13))


# --------------------------------------------------------------------------- data kept

def test_outputs_never_overwrite_data(shard, tmp_path):
    """--save or --metrics-jsonl onto the training or validation data, onto each other or
    onto a file that is not what they write: refused before the first step, the file
    untouched."""
    other = tmp_path / "notes.txt"
    other.write_text("my notes\n")
    before = open(shard, "rb").read()
    base = ["train", "--model", "micro", "--train-data", shard, "--batch", "2", "--seq-len", "16",
            "--steps", "2"]
    save, val = str(tmp_path / "model.bin"), str(tmp_path / "val.bin")
    open(val, "wb").write(before)
    for extra, says in ((["--save", shard], "would overwrite --train-data"),
                        (["--metrics-jsonl", shard], "would overwrite --train-data"),
                        (["--save", save, "--metrics-jsonl", save], "would overwrite --metrics-jsonl"),
                        (["--save", save, "--metrics-jsonl", save + ".state"], "would overwrite"),
                        (["--val-data", val, "--val-every", "1", "--save", val],
                         "would overwrite --val-data"),
                        (["--save", str(other)], "it is not a checkpoint"),
                        (["--metrics-jsonl", str(other)], "it is not a metrics file")):
        rc, out, err = run(*base, *extra)
        assert_clean_error(rc, err, says)
        assert "step" not in out
    assert open(shard, "rb").read() == open(val, "rb").read() == before
    assert other.read_text() == "my notes\n"
    # a checkpoint saved over the one the run resumes, and metrics over a metrics file: fine
    rc, _, err = run(*base, "--save", save, "--metrics-jsonl", str(tmp_path / "m.jsonl"))
    assert rc == 0, err
    rc, _, err = run(*base[:-1], "3", "--resume", save, "--save", save, "--metrics-jsonl",
                     str(tmp_path / "m.jsonl"))
    assert rc == 0, err
    assert checkpoint.read(save).step == 3


@pytest.mark.parametrize("kind", ["metrics", "bench"])
def test_whose_file_is_told_by_its_first_line(tmp_path, kind):
    """What may be replaced as a metrics file or a bench table (one helper,
    checkpointing.first_line_is, for both): an empty file or one whose first line is theirs
    (CRLF too), not another file, a folder, a FIFO or nothing."""
    from starpu_llm.bench import is_bench_table
    from starpu_llm.training.checkpointing import _is_metrics_file
    is_kind, ours = {"metrics": (_is_metrics_file, b'{"step": 1, "loss": 2.5}'),
                     "bench": (is_bench_table, b"B,engine,tok/ms")}[kind]
    cases = {"empty": (b"", True), "ours": (ours + b"\nmore\n", True),
             "ours, CRLF": (ours + b"\r\n", True), "notes": (b"my notes\n", False),
             "blank first line": (b"\n" + ours + b"\n", False)}
    for name, (content, expect) in cases.items():
        path = tmp_path / f"{kind}-{name}"
        path.write_bytes(content)
        assert is_kind(str(path)) is expect, name
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in (tmp_path, fifo, tmp_path / "missing"):
        assert is_kind(str(path)) is False, path


def test_every_command_refuses_an_output_onto_data(shard, tmp_path):
    """calibrate --out, bench --csv and prepare's shards go through train's check: never onto
    a shard, an input or a file of another kind (through a symlink too), refused before any
    work; the files untouched."""
    before = open(shard, "rb").read()
    text = tmp_path / "notes.txt"
    text.write_text("To be, or not to be, that is the question.\n\n" * 40)
    link = tmp_path / "link.toml"
    link.symlink_to(shard)
    for args, says in ((["calibrate", "--out", shard], "it is not a machine description"),
                       (["calibrate", "--out", str(link)], "it is not a machine description"),
                       (["bench", "--csv", shard, "--model", "micro"],
                        "it is not a table of starpu-llm bench")):
        rc, out, err = run(*args, timeout=120)
        assert_clean_error(rc, err, shard if "link" not in args[-1] else str(link), says)
        assert "calibrating" not in out and "machine:" not in out
    # prepare: a shard's name taken by the text itself (a symlink), or by a file of notes
    out_dir = tmp_path / "prepared"
    out_dir.mkdir()
    (out_dir / "notes_val.bin").symlink_to(text)
    rc, out, err = run("prepare", str(text), "--out-dir", str(out_dir), "--val-tokens", "8")
    assert_clean_error(rc, err, "would overwrite the text", "give another --out-dir")
    (out_dir / "notes_val.bin").unlink()
    (out_dir / "notes_train.bin").write_text("my notes\n")
    rc, out, err = run("prepare", str(text), "--out-dir", str(out_dir), "--val-tokens", "8")
    assert_clean_error(rc, err, "notes_train.bin", "it is not a token shard")
    assert (out_dir / "notes_train.bin").read_text() == "my notes\n"
    assert open(shard, "rb").read() == before and text.read_text().startswith("To be")
    # what each writes, written again over itself: fine
    (out_dir / "notes_train.bin").unlink()
    for _ in range(2):
        rc, out, err = run("prepare", str(text), "--out-dir", str(out_dir), "--val-tokens", "8")
        assert rc == 0, err


def test_resume_goes_on_with_the_recorded_settings_not_given(shard, tmp_path):
    """`train --resume CKPT --steps N` alone goes on as the run was (its batch, sequence
    length, learning rate and schedule, not train's defaults): the uninterrupted run's losses,
    bit for bit, no warning; a setting given on the command line wins, with the warning."""
    common = ["--model", "micro", "--train-data", shard]
    settings = ["--batch", "2", "--seq-len", "16", "--lr", "1e-2", "--lr-schedule", "cosine",
                "--warmup-steps", "1", "--min-lr", "1e-3"]
    whole, part, ck = (str(tmp_path / n) for n in ("whole.jsonl", "part.jsonl", "ck"))
    rc, _, err = run("train", *common, *settings, "--steps", "4", "--metrics-jsonl", whole)
    assert rc == 0, err
    rc, _, err = run("train", *common, *settings, "--steps", "4", "--save-every", "2",
                     "--checkpoint-dir", ck, "--metrics-jsonl", part)
    assert rc == 0, err
    os.remove(os.path.join(ck, "step_00000004.bin"))      # as if stopped after step 2
    os.remove(os.path.join(ck, "step_00000004.bin.state"))
    rc, out, err = run("train", "--model", "micro", "--train-data", shard, "--resume", ck,
                       "--steps", "4", "--metrics-jsonl", part)
    assert rc == 0, err
    assert "warning" not in err, err
    assert ("with its recorded settings batch=2, seq_len=16, lr=0.01, lr_schedule=cosine, "
            "warmup_steps=1, min_lr=0.001") in out, out
    rows = lambda path: [json.loads(line)["loss"] for line in open(path)]   # noqa: E731
    assert rows(part) == rows(whole)
    rc, out, err = run("train", "--model", "micro", "--train-data", shard, "--resume", ck,
                       "--steps", "4", "--lr", "2e-2")
    assert rc == 0, err
    assert "--lr 0.02 (saved with 0.01)" in err, err


def test_a_checkpoint_dir_of_another_run_is_refused(shard, tmp_path):
    """A new run writing into a --checkpoint-dir that holds another run's checkpoints would
    delete them (and a --resume of the folder would take them): refused, saying what to do.
    The same run started again (same settings and seed), or resumed, writes there."""
    ck = str(tmp_path / "ck")
    base = ["train", "--model", "micro", "--train-data", shard, "--batch", "2", "--seq-len", "16",
            "--save-every", "2", "--checkpoint-dir", ck]
    rc, _, err = run(*base, "--steps", "4")
    assert rc == 0, err
    rc, out, err = run(*base, "--steps", "4", "--seed", "7")
    assert_clean_error(rc, err, f"--checkpoint-dir {ck} holds checkpoints of another run",
                       f"--resume {ck}")
    assert "step" not in out
    rc, _, err = run(*base, "--steps", "4")
    assert rc == 0, err
    rc, _, err = run(*base, "--steps", "6", "--resume", ck)
    assert rc == 0, err
    assert checkpoint.read(ck).step == 6


# --------------------------------------------------------------------------- clear errors

@pytest.mark.parametrize("args, says", [
    (["train", "--seed", "-5"], "--seed"),
    (["generate", "--init-from", "x.bin", "--seed", "-1"], "--seed"),
    (["bench", "--batches", "a,b"], "--batches"),
    (["train", "--lr", "inf"], "--lr must be a finite number >= 0, got inf"),
    (["train", "--lr", "nan"], "--lr must be a finite number >= 0, got nan"),
    (["train", "--steps", "2", "--warmup-steps", "5"], "--warmup-steps 5 is above --steps 2"),
    (["train", "--memory-limit", "1T"], "above this machine's memory"),
    (["train", "--sched", "nosuch"], "--sched nosuch"),
    (["predict", "--machine", "nope.toml"], "nope.toml"),
    # an empty path (an unset $CKPT in a script) is not "no flag": a new run, nothing saved
    (["train", "--resume", ""], "--resume is empty"),
    (["train", "--save", ""], "--save is empty"),
    (["train", "--init-from", " "], "--init-from is empty"),
    (["convert", "x.bin", ""], "DST is empty"),
    (["generate", "--init-from", ""], "--init-from is empty"),
    # its graph recorded with the batch's tensors allocated: more than any machine has
    (["predict", "--model", "tiny", "--memory-limit", "1K", "--calibration",
      os.path.join(os.path.dirname(starpu_llm.__file__), "perf", "reference-calibration.toml")],
     "--memory-limit 1 KiB cannot hold what the tasks need at once"),
    (["predict", "--model", "tiny", "--batch", "10000000000", "--calibration",
      os.path.join(os.path.dirname(starpu_llm.__file__), "perf", "reference-calibration.toml")],
     "predict a smaller --batch"),
])
def test_bad_settings_get_one_clear_error(shard, args, says):
    extra = (["--model", "micro", "--train-data", shard, "--seq-len", "16"]
             if args[0] == "train" else [])
    rc, out, err = run(*args, *extra)
    assert_clean_error(rc, err, says)
    assert "step" not in out


def test_a_starpu_home_that_cannot_be_written_is_one_clear_error(shard, tmp_path):
    """StarPU aborts the process (a C backtrace, status 134) where it cannot make its
    performance models' folder (a read-only home; here a path through a file): one error
    naming the folder and what to set, status 2."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env = {k: v for k, v in os.environ.items()
           if k not in ("XDG_CACHE_HOME", "STARPU_PERF_MODEL_DIR")}
    env["STARPU_HOME"] = str(blocker / "home")
    p = subprocess.run([sys.executable, "-m", "starpu_llm", "train", "--model", "micro",
                        "--train-data", shard, "--seq-len", "16", "--steps", "1"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert_clean_error(p.returncode, p.stderr, str(blocker / "home" / ".starpu" / "sampling"),
                       "(from $STARPU_HOME)", "set STARPU_HOME")
    # XDG_CACHE_HOME, which StarPU reads before STARPU_HOME: the variable that wins is named
    env["XDG_CACHE_HOME"] = str(blocker / "cache")
    p = subprocess.run([sys.executable, "-m", "starpu_llm", "train", "--model", "micro",
                        "--train-data", shard, "--seq-len", "16", "--steps", "1"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert_clean_error(p.returncode, p.stderr, "(from $XDG_CACHE_HOME)",
                       "set STARPU_PERF_MODEL_DIR to a writable folder")


def test_a_batch_too_large_for_memory_says_how_much(tmp_path):
    path = str(tmp_path / "big.bin")
    formats.write_shard(path, np.zeros(4096 * 1024 + 1, np.uint16))
    rc, out, err = run("train", "--model", "d12", "--train-data", path, "--batch", "4096",
                       "--seq-len", "1024", "--steps", "1")
    assert_clean_error(rc, err, "--batch 4096 x --seq-len 1024 needs about", "available",
                       "--memory-limit")


def test_calibrate_checks_its_output_before_measuring(tmp_path):
    folder = tmp_path / "folder"
    folder.mkdir()
    rc, out, err = run("calibrate", "--out", str(folder), timeout=60)
    assert_clean_error(rc, err, str(folder), "is a directory")
    assert "calibrating" not in out


def test_calibrate_and_bench_run_on_a_model_of_another_vocabulary(tmp_path):
    """micro's 250 ids hold none of the bundled Shakespeare's: calibrate and bench time it on
    those ids modulo 250 (data.timing_dataset) rather than ending in a traceback."""
    out = tmp_path / "machine.toml"
    rc, stdout, err = run("calibrate", "--model", "micro", "--quick", "--out", str(out))
    assert rc == 0 and "Traceback" not in err, err
    from starpu_llm.perf.machine import load
    assert load(str(out)).cores >= 1
    rc, stdout, err = run("bench", "--model", "micro", "--batches", "2", "--seq-len", "16",
                          "--steps", "1", "--no-torch")
    assert rc == 0 and "failed" not in stdout, stdout + err


def test_bench_exits_non_zero_when_a_row_failed(tmp_path, monkeypatch, capsys):
    """A configuration that failed is its row, then one error and status 2 (after the CSV of
    the others); a --seq-len above the model's is one error before any run."""
    from starpu_llm import bench, cli
    ran = bench.run_in_subprocess

    def run_one(spec):
        return ({"error": "the engine failed"} if spec["engine"] == "reference"
                else ran(spec))
    monkeypatch.setattr(bench, "run_in_subprocess", run_one)
    csv = tmp_path / "b.csv"
    assert cli.main(["bench", "--model", "micro", "--batches", "1", "--seq-len", "16",
                     "--steps", "1", "--no-torch", "--csv", str(csv)]) == 2
    out, err = capsys.readouterr()
    assert "1 reference              failed: the engine failed" in out, out
    assert "configuration(s) failed (B=1 reference)" in err and "Traceback" not in err
    rows = [line.split(",")[1] for line in csv.read_text().splitlines()[1:]]
    assert len(rows) == 1 and rows[0].startswith("starpu "), rows
    rc, out, err = run("bench", "--model", "micro", "--batches", "1", "--seq-len", "64",
                       "--steps", "1", "--no-torch")
    assert_clean_error(rc, err, "--seq-len 64 is outside 1..32")
    assert "tok/ms" not in out


def test_bench_without_torch_says_how_before_running(monkeypatch, capsys):
    """bench's PyTorch row where torch is not installed (the package's own install): one
    error before any run, naming --no-torch (it was a failed row after minutes of runs)."""
    import importlib.util
    from starpu_llm import cli
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch" else find(name, *a))
    assert cli.main(["bench", "--model", "micro", "--batches", "1", "--seq-len", "16",
                     "--steps", "1"]) == 2
    out, err = capsys.readouterr()
    assert "torch is not installed here: pip install torch, or give --no-torch" in err, err
    assert "tok/ms" not in out


def test_predict_of_a_binary_machine_file_is_one_error(tmp_path):
    path = tmp_path / "machine.bin"
    path.write_bytes(bytes(range(256)) * 4)
    rc, out, err = run("predict", "--machine", str(path))
    assert_clean_error(rc, err, str(path), "not a machine description")


def test_a_fifo_or_folder_companion_is_an_error_not_a_hang(shard, tmp_path):
    save = str(tmp_path / "m.bin")
    rc, _, err = run("train", "--model", "micro", "--train-data", shard, "--batch", "2",
                     "--seq-len", "16", "--steps", "2", "--save", save)
    assert rc == 0, err
    os.unlink(checkpoint.companion(save))
    for make in (os.mkfifo, os.mkdir):
        make(checkpoint.companion(save))
        rc, _, err = run("train", "--train-data", shard, "--batch", "2", "--seq-len", "16",
                         "--steps", "4", "--resume", save, timeout=60)
        assert_clean_error(rc, err, "m.bin.state", "not a regular file")
        (os.rmdir if make is os.mkdir else os.unlink)(checkpoint.companion(save))


def test_predict_a_described_machine_without_a_calibration(tmp_path):
    """The README's what-if for the paper's node, on a machine never calibrated: the bundled
    calibration's codelet costs, said in a note; an impossible pipeline is an error."""
    paper = os.path.join(os.path.dirname(__file__), "..", "experiments", "machines",
                         "paper-node-xeon-gold-6240.toml")
    rc, out, err = run("predict", "--machine", paper, "--batch", "36", "--workers", "2")
    assert rc == 0, err
    assert "paper node" in out and "tok/ms" in out
    assert "no calibration" in err and "bundled" in err
    rc, out, err = run("predict", "--machine", paper, "--ranks", "2", "--pipeline-stages", "3")
    assert_clean_error(rc, err, "--pipeline-stages 3", "--ranks 2")


def test_a_compiled_part_that_does_not_load_is_one_error():
    """The command where the cffi binding does not load (a wheel on a machine without a library
    it was linked against, such as an MKL wheel without its environment's mkl): one line saying
    what did not load and what to do, status 2, no traceback (it was ImportError's, status 1)."""
    code = ("import sys; sys.modules['starpu_llm._clib'] = None\n"
            "from starpu_llm.cli import main\n"
            "sys.exit(main(['train', '--steps', '1']))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("starpu-llm: error: starpu-llm needs the compiled part"), lines[0]
    assert "starpu_llm._clib" in lines[0] and "a wheel needs those libraries" in lines[0], lines[0]


def test_the_engines_are_stated_once(tmp_path):
    """train's, generate's, serve's and eval's --engine choose among plan/partition.ENGINES,
    its first the default; from Python an unknown engine is the partition's one error
    (resolve), said before the model is read (no second check in cli_generate)."""
    import argparse

    from starpu_llm import cli
    from starpu_llm.cli_generate import run_eval, run_generate
    from starpu_llm.cli_serve import run_serve
    from starpu_llm.plan.partition import ENGINES
    p = cli.build_parser()
    (sub,) = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
    for command in ("train", "generate", "serve", "eval"):
        (engine,) = [a for a in sub.choices[command]._actions if a.dest == "engine"]
        assert (list(engine.choices), engine.default) == (list(ENGINES), ENGINES[0]), command
    missing = str(tmp_path / "no-such-model.bin")
    for call in (lambda: run_generate(missing, engine="gpu"),
                 lambda: run_serve(missing, engine="gpu"),
                 lambda: run_eval(missing, "no-such.jsonl", engine="gpu")):
        with pytest.raises(starpu_llm.StarpuLLMError,
                           match=f"^engine 'gpu': choose one of {', '.join(ENGINES)}$"):
            call()


def test_the_default_model_is_stated_once():
    """Every subcommand's --model, calibrate(), the traced runs and predict's layouts default
    to model/config.DEFAULT_MODEL; train's --model is None (a checkpoint may give the model)
    and a new run without one starts from DEFAULT_MODEL (training/resume.load_model), which
    its help names. A "d12" written again anywhere would diverge."""
    import argparse
    import inspect

    from starpu_llm import cli
    from starpu_llm.model.config import DEFAULT_MODEL
    from starpu_llm.perf.calibrate import calibrate, traced_runs
    from starpu_llm.perf.predict import layouts
    from starpu_llm.training.resume import load_model
    from starpu_llm.training.trainer import TrainConfig
    p = cli.build_parser()
    (sub,) = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
    defaults = {command: a.default for command, c in sub.choices.items()
                for a in c._actions if a.dest == "model"}
    assert defaults.pop("train") is None
    assert defaults == {c: DEFAULT_MODEL for c in ("bench", "calibrate", "predict")}
    for fn in (calibrate, traced_runs, layouts):
        assert inspect.signature(fn).parameters["model"].default == DEFAULT_MODEL, fn.__name__
    (model,) = [a for a in sub.choices["train"]._actions if a.dest == "model"]
    assert f"default: {DEFAULT_MODEL} = GPT-2 124M" in model.help
    state, saved = load_model(TrainConfig(), lazy=True)
    assert saved is None and state.config == MODELS[DEFAULT_MODEL]


def test_bench_predict_and_prepare_read_their_defaults_where_they_are_decided():
    """bench's --seq-len and predict's --batch, --seq-len and --memory-limit are train's
    settings (a configuration benchmarked or predicted is one `train` runs): TrainConfig's
    default, rule and short option (an empty --memory-limit was ignored by predict); bench's
    --steps alone differs in meaning (timed steps after a warm-up). prepare's --val-tokens
    defaults to io/data.VAL_TOKENS, prepare()'s own default."""
    import argparse
    import inspect
    from dataclasses import fields

    from starpu_llm import cli
    from starpu_llm.io import data
    from starpu_llm.training.trainer import TrainConfig
    p = cli.build_parser()
    (sub,) = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
    train = {f.name: f.default for f in fields(TrainConfig) if "help" in f.metadata}
    shared = {}
    for command in ("bench", "predict"):
        for a in sub.choices[command]._actions:
            if a.dest in train and a.dest not in {f.name for f in cli.partition_settings(
                    *train)} | {"model", "steps"}:
                shared[command, a.dest] = (a.default, a.option_strings)
                bad, why = ("", "is empty") if a.dest == "memory_limit" else ("0", "must be at "
                                                                               "least 1, got 0")
                with pytest.raises(cli.UsageError, match=f"{a.option_strings[0]} {why}"):
                    p.parse_args([command, a.option_strings[0], bad])
    assert shared == {("bench", "seq_len"): (train["seq_len"], ["--seq-len", "-t"]),
                      ("predict", "batch"): (train["batch"], ["--batch", "-b"]),
                      ("predict", "seq_len"): (train["seq_len"], ["--seq-len", "-t"]),
                      ("predict", "memory_limit"): (train["memory_limit"], ["--memory-limit"])}
    (val,) = [a for a in sub.choices["prepare"]._actions if a.dest == "val_tokens"]
    assert val.default == data.VAL_TOKENS == \
        inspect.signature(data.prepare).parameters["val_tokens"].default


def test_the_calibration_files_help_names_is_the_one_used(monkeypatch, tmp_path):
    """calibrate's --out and predict's --calibration say perf/machine.default_path(), the
    file they use without the flag, where $STARPU_LLM_HOME puts it (the help said
    ~/.cache/starpu-llm whatever the environment); a % in it is shown as is."""
    import argparse

    from starpu_llm import cli
    from starpu_llm.perf.machine import default_path
    monkeypatch.setenv("STARPU_LLM_HOME", str(tmp_path / "100%"))
    p = cli.build_parser()
    (sub,) = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
    for command, dest in (("calibrate", "out"), ("predict", "calibration")):
        c = sub.choices[command]
        (a,) = [a for a in c._actions if a.dest == dest]
        shown = " ".join(c._get_formatter()._expand_help(a).split())
        assert f"(default: {default_path()}," in shown and "100%" in default_path(), shown


def test_generate_defaults_are_stated_once():
    """generate's defaults live in flow/generate.Generating alone: `generate` without flags
    gives its fields, each number flag's help says that value, and run_generate's and
    generate()'s keywords default to the same (a second copy in cli.py would diverge)."""
    import argparse
    import inspect
    from dataclasses import asdict

    from starpu_llm import cli
    from starpu_llm.cli_generate import run_generate
    from starpu_llm.flow.generate import Generating, generate
    p = cli.build_parser()
    args = p.parse_args(["generate", "--init-from", "m.bin"])
    gen = asdict(Generating())
    assert {name: getattr(args, name) for name in gen} == gen
    (sub,) = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
    g = sub.choices["generate"]
    helps = {a.dest: g._get_formatter()._expand_help(a) for a in g._actions if a.help}
    for name, value in gen.items():
        if isinstance(value, (int, float)):
            assert f"default {value:g}" in helps[name], (name, helps[name])
    params = inspect.signature(run_generate).parameters
    assert {name: params[name].default for name in gen} == gen
    params = inspect.signature(generate).parameters
    assert {name: params[name].default for name in ("temperature", "top_k", "top_p")} == \
        {name: gen[name] for name in ("temperature", "top_k", "top_p")}


def _wrong_defaults(parser) -> list:
    """(command, flag, what its help says, its default) for each help of parser's commands
    (as --help shows it) that says "(default X" or "; default X" where X is not the flag's
    default: a number unequal, a word not the same, a list not the same comma-separated, or
    any X for a flag whose default is decided later (None: say it after a colon, "(default:
    ...)", a description). Also how many such statements it read."""
    import argparse
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    wrong, read = [], 0
    for command, p in sub.choices.items():
        fmt = p._get_formatter()
        for a in p._actions:
            if not a.help or a.help == argparse.SUPPRESS:
                continue
            for m in re.finditer(r"(?:\(|; )default ([^\s;)]+)", fmt._expand_help(a)):
                said, d = m.group(1).rstrip(",:"), a.default
                read += 1
                if isinstance(d, (list, tuple)):
                    ok = said == ",".join(map(str, d))
                elif d is None or isinstance(d, bool):
                    ok = False
                elif isinstance(d, (int, float)):
                    try:
                        ok = float(said) == d
                    except ValueError:
                        ok = False
                else:
                    ok = said == str(d)
                if not ok:
                    wrong.append((command, a.option_strings[0], m.group(0), d))
    return wrong, read


def test_a_command_s_summary_does_not_narrow_what_its_init_from_takes():
    """`starpu-llm --help` summarises each command in one line; for a command whose --init-from
    takes a Hugging Face folder or a Hub name too, the line must not say "llm.c checkpoint" (it
    did for generate, serve and eval after --init-from grew)."""
    from starpu_llm import cli
    p = cli.build_parser()
    sub = next(a for a in p._actions if a.dest == "cmd")
    summaries = {c.dest: c.help for c in sub._choices_actions}
    takes_hf = [name for name, c in sub.choices.items()
                if any(a.help == cli.INIT_FROM_HELP for a in c._actions)]
    assert sorted(takes_hf) == ["eval", "generate", "serve"]
    assert [n for n in takes_hf if "llm.c checkpoint" in summaries[n]] == []


def test_every_default_a_help_states_is_the_flags():
    """A help's "(default X)" is its flag's default, for every subcommand: written
    %(default)s (a setting's field, cli.py's own flags) or built from the value at the
    parser's construction, so that a default changed in one place changes the help too. The
    check itself sees a help that states another number, a word for a None default, a list."""
    from dataclasses import fields

    from starpu_llm import cli
    from starpu_llm.flow.generate import Generating
    from starpu_llm.serve.settings import Edges, Serving
    from starpu_llm.training.trainer import TrainConfig
    wrong, read = _wrong_defaults(cli.build_parser())
    assert not wrong and read >= 40, (wrong, read)
    for cls in (TrainConfig, Generating, Serving, Edges):      # a setting's value: its own field's
        for f in fields(cls):
            for m in re.finditer(r"(?:\(|; )default ([^\s;)]+)", f.metadata.get("help", "")):
                assert m.group(1).startswith("%(default"), (f.name, m.group(0))
    p = cli._Parser(prog="t")
    sub = p.add_subparsers(dest="cmd")
    c = sub.add_parser("c")
    c.add_argument("--steps", default=4, help="steps (default 5)")
    c.add_argument("--good", default=4, help="steps (default %(default)s)")
    c.add_argument("--lr", default=1e-4, help="rate (default %(default)g; 0: none)")
    c.add_argument("--model", default=None, help="a model (default d12)")
    c.add_argument("--later", default=None, help="decided later (default: one per worker)")
    c.add_argument("--ranks", default=[1], help="ranks (default 1,2)")
    c.add_argument("--kind", default="a", help="a kind; default b")
    assert _wrong_defaults(p) == ([("c", "--steps", "(default 5", 4),
                                   ("c", "--model", "(default d12", None),
                                   ("c", "--ranks", "(default 1,2", [1]),
                                   ("c", "--kind", "; default b", "a")], 6)
