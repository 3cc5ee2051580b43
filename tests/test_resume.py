"""Checkpoints and exact resume: the checkpoint pair (io/checkpoint.py), saves that survive a
SIGKILL, a run stopped and resumed giving the same bits as one that was not, outputs checked
before the work and a failed final save rescued."""
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import replace

import numpy as np
import pytest

from starpu_llm import StarpuLLMError
from starpu_llm.model.config import MODELS, GPTConfig
from starpu_llm.io import checkpoint, formats
from starpu_llm.perf.machine import Machine, default_path, save as save_machine
from starpu_llm.plan.record import Partition, RunRecord, Settings, data_fingerprint, run_identity
from starpu_llm.plan.partition import PartitionRequest
from starpu_llm.runtime import resolve_here, usable_cores
from starpu_llm.model.state import TrainState, random_init
from starpu_llm.training.trainer import TrainConfig, train

MICRO = MODELS["micro"]


def state_at(step, config=MICRO, seed=0):
    """A state with distinct parameters, moments, step and data position."""
    rng = np.random.default_rng(seed + step)
    n = config.num_parameters
    return TrainState(config=config, params=random_init(config, seed + step),
                      m=rng.standard_normal(n, dtype=np.float32),
                      v=rng.random(n, dtype=np.float32), step=step, data={"position": 32 * step})


def assert_same_state(a, b):
    assert a.config == b.config and a.step == b.step and a.data == b.data
    for name in ("params", "m", "v"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name


# --------------------------------------------------------------------------- the pair

def test_round_trip(tmp_path):
    path = str(tmp_path / "model.bin")
    saved = state_at(5)
    checkpoint.write(path, saved)
    assert_same_state(checkpoint.read(path), saved)
    # the model file alone is an llm.c checkpoint
    config, params = formats.read_checkpoint(path)
    assert config == MICRO and np.array_equal(params, saved.params)
    assert sorted(os.listdir(tmp_path)) == ["model.bin", "model.bin.state"]


RECORD = RunRecord(Partition("starpu", 2, 1, 4, "single", 1),
                   Settings(batch=4, seq_len=16, steps=6, lr=1e-2, weight_decay=0.01,
                            lr_schedule="cosine", warmup_steps=1, min_lr=1e-3, grad_clip=0.5))


def test_the_run_record_round_trip(tmp_path):
    path = str(tmp_path / "model.bin")
    checkpoint.write(path, state_at(3), RECORD)
    state, record = checkpoint.read_with_record(path)
    assert record == RECORD and state.step == 3
    checkpoint.write(path, state_at(3))
    assert checkpoint.read_with_record(path)[1] is None


def test_a_record_of_before_the_decay_choice_decayed_every_tensor():
    """A record saved before weight_decay_params was kept is of a run that decayed every
    tensor: it reads as "all" (a resumed run keeps it); without weight decay the choice
    changes nothing: no warning, the same run identity (that of before the choice)."""
    d = json.loads(RECORD.to_json())
    del d["settings"]["weight_decay_params"]
    old = RunRecord.from_json(json.dumps(d))
    assert old.settings.weight_decay_params == "all"
    now = replace(old.settings, weight_decay_params="matrices")
    assert old.settings.changed(now) == [("weight_decay_params", "all", "matrices")]
    undecayed = replace(old.settings, weight_decay=0.0)
    assert undecayed.changed(replace(now, weight_decay=0.0)) == []
    ident = [run_identity(s, MICRO, "seed 1", [1]) for s in (old.settings, now, undecayed,
                                                           replace(now, weight_decay=0.0))]
    assert ident[0] != ident[1] and ident[2] == ident[3]


def test_the_data_fingerprint_tells_the_shards_and_their_order_apart():
    """One shard: [its length, the sums of its first and last 4096 ids]; several: {tokens,
    shards, crc}, the crc over each one's fingerprint in order: the same shards in another
    order are other data (the batches come in another order), the same shards the same."""
    a, b = np.arange(5000, dtype=np.uint16), np.arange(7, 20, dtype=np.uint16)
    assert data_fingerprint([a]) == [5000, 4095 * 4096 // 2, sum(range(904, 5000))]
    ab = data_fingerprint([a, b])
    assert ab == data_fingerprint([a.copy(), b.copy()])
    assert (ab["tokens"], ab["shards"]) == (5013, 2)
    assert data_fingerprint([b, a]) != ab


def test_a_version_1_companion_is_still_read(tmp_path):
    """A companion of before the run record (version 1: its checksum over the first ten
    header fields and the moments) reads as before, with no record."""
    path = str(tmp_path / "model.bin")
    saved = state_at(4)
    checkpoint.write(path, saved, RECORD)
    comp = checkpoint.companion(path)
    raw = bytearray(open(comp, "rb").read())
    header = np.frombuffer(raw, "<i8", count=checkpoint.HEADER_INTS).copy()
    header[1] = 1
    header[11:] = 0
    header[11] = checkpoint._crc(header[:10], saved.m, saved.v)
    raw[:header.nbytes] = header.tobytes()
    open(comp, "wb").write(bytes(raw))
    state, record = checkpoint.read_with_record(path)
    assert record is None
    assert_same_state(state, saved)
    # a damaged record is caught by the checksum
    checkpoint.write(path, saved, RECORD)
    raw = bytearray(open(comp, "rb").read())
    raw[checkpoint.RECORD_AT * 8 + 5] ^= 1
    open(comp, "wb").write(bytes(raw))
    with pytest.raises(StarpuLLMError, match="run record"):
        checkpoint.read(path)


def test_companion_of_another_model_is_refused(tmp_path):
    a, b = str(tmp_path / "a.bin"), str(tmp_path / "b.bin")
    checkpoint.write(a, state_at(5))
    checkpoint.write(b, state_at(5, GPTConfig(max_seq_len=32, vocab_size=250,
                                              padded_vocab_size=256, num_layers=1,
                                              num_heads=2, channels=32)))
    os.replace(checkpoint.companion(b), checkpoint.companion(a))
    with pytest.raises(StarpuLLMError, match=r"a\.bin\.state does not belong to .*a\.bin.*L=1"):
        checkpoint.read(a)


def test_companion_of_another_step_is_refused(tmp_path):
    a, b = str(tmp_path / "a.bin"), str(tmp_path / "b.bin")
    checkpoint.write(a, state_at(5))
    checkpoint.write(b, state_at(6))
    os.replace(checkpoint.companion(b), checkpoint.companion(a))
    with pytest.raises(StarpuLLMError, match="at step 6.*different saves"):
        checkpoint.read(a)


def test_missing_truncated_or_corrupt_companion(tmp_path):
    path = str(tmp_path / "model.bin")
    comp = checkpoint.companion(path)
    formats.write_checkpoint(path, MICRO, random_init(MICRO))
    with pytest.raises(StarpuLLMError, match="no companion file.*init_from"):
        checkpoint.read(path)
    checkpoint.write(path, state_at(5))
    good = open(comp, "rb").read()
    open(comp, "wb").write(good[:-4])
    with pytest.raises(StarpuLLMError, match="bytes, but a companion of this model has"):
        checkpoint.read(path)
    open(comp, "wb").write(good[:-1] + bytes([good[-1] ^ 1]))
    with pytest.raises(StarpuLLMError, match="corrupt"):
        checkpoint.read(path)
    open(comp, "wb").write(b"\0" * 2000)
    with pytest.raises(StarpuLLMError, match="not a starpu-llm checkpoint companion"):
        checkpoint.read(path)


def test_a_save_failing_midway_leaves_the_old_pair(tmp_path, monkeypatch):
    """Re-saving over a pair when the disk fills while the companion is written: an error
    naming the file, the old pair whole and nothing else left behind."""
    path = str(tmp_path / "model.bin")
    checkpoint.write(path, state_at(5))
    write_values = formats.write_values

    def full(f, values, layout, crc=None):
        if values is not None and values is SAVING.m:
            raise OSError(28, "No space left on device")
        return write_values(f, values, layout, crc)
    SAVING = state_at(6)
    monkeypatch.setattr(formats, "write_values", full)
    with pytest.raises(StarpuLLMError, match=r"model\.bin\.state failed: No space left"):
        checkpoint.write(path, SAVING)
    monkeypatch.undo()
    assert_same_state(checkpoint.read(path), state_at(5))
    assert sorted(os.listdir(tmp_path)) == ["model.bin", "model.bin.state"]


KILLED_AT = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    from starpu_llm.model.config import MODELS
    from starpu_llm.io import checkpoint
    from starpu_llm.model.state import TrainState, random_init

    path, step, point = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    checkpoint._after = lambda at: at == point and os.kill(os.getpid(), signal.SIGKILL)
    n = MODELS["micro"].num_parameters
    checkpoint.write(path, TrainState(config=MODELS["micro"], params=random_init(MODELS["micro"], step),
                                      m=np.full(n, step, np.float32), v=np.full(n, step, np.float32),
                                      step=step, data={"position": step}))
""")
SAVE_POINTS = ("written", "kept", "model", "state", "done")


def save_killed_at(path, step, point):
    p = subprocess.run([sys.executable, "-c", KILLED_AT, str(path), str(step), point],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == (0 if point == "never" else -signal.SIGKILL), p.stderr


@pytest.mark.parametrize("first", SAVE_POINTS)
def test_a_save_killed_at_any_point_leaves_one_complete_pair(tmp_path, first):
    """`--save` over an existing checkpoint killed (SIGKILL) at each point of the save, then
    again by the next save at each point: the path always resumes, as the old or the new
    checkpoint, and says which pair it took; a save that completes leaves the pair alone."""
    path = tmp_path / "model.bin"
    save_killed_at(path, 5, "never")         # the old checkpoint, saved whole
    save_killed_at(path, 6, first)
    saved = checkpoint.load(path)
    assert saved.state.step == (5 if first in ("written", "kept", "model") else 6)
    assert saved.path == str(path) + (".prev" if first == "model" else "")
    assert bool(saved.skipped) == (first == "model")
    for second in SAVE_POINTS:
        save_killed_at(path, 7, second)
        assert checkpoint.load(path).state.step in (5, 6, 7)
    assert checkpoint.load(path).state.step == 7
    save_killed_at(path, 8, "never")
    saved = checkpoint.load(path)
    assert (saved.state.step, saved.path, saved.skipped) == (8, str(path), [])
    assert sorted(os.listdir(tmp_path)) == ["model.bin", "model.bin.state"]


def test_a_damaged_newest_checkpoint_falls_back_to_the_newest_that_reads(tmp_path):
    """A directory whose newest companion is damaged (or not a regular file): the newest
    checkpoint that reads, with the one skipped and why; none that reads: every one named."""
    d = tmp_path / "ck"
    for step in (4, 5, 6):
        checkpoint.save_step(d, state_at(step), keep=3)
    comp = checkpoint.companion(checkpoint.step_path(d, 6))
    good = open(comp, "rb").read()
    open(comp, "wb").write(good[:-1] + bytes([good[-1] ^ 1]))
    saved = checkpoint.load(d)
    assert_same_state(saved.state, state_at(5))
    assert [(m, "corrupt" in why) for m, why in saved.skipped] == [
        (checkpoint.step_path(d, 6), True)]
    os.unlink(comp)
    os.mkfifo(comp)                    # opening it for reading would block forever
    assert checkpoint.load(d).state.step == 5
    with pytest.raises(StarpuLLMError, match="not a regular file"):
        checkpoint.load(checkpoint.step_path(d, 6))
    os.unlink(comp)
    os.mkdir(comp)
    with pytest.raises(StarpuLLMError, match="not a regular file"):
        checkpoint.load(checkpoint.step_path(d, 6))
    for step in (4, 5):
        os.unlink(checkpoint.step_path(d, step))
        formats.write_checkpoint(checkpoint.step_path(d, step), MICRO, random_init(MICRO))
    with pytest.raises(StarpuLLMError, match="step_00000006.bin.state is not a regular file.*"
                                             "step_00000005.bin.state does not belong.*cannot be "
                                             "read either.*step_00000004"):
        checkpoint.load(d)


def test_directory_keeps_the_newest_complete(tmp_path):
    d = tmp_path / "ck"
    for step in range(1, 6):
        checkpoint.save_step(d, state_at(step), keep=2)
    assert sorted(os.listdir(d)) == ["step_00000004.bin", "step_00000004.bin.state",
                                     "step_00000005.bin", "step_00000005.bin.state"]
    # a newer model whose companion was never written is not a checkpoint yet
    formats.write_checkpoint(checkpoint.step_path(d, 6), MICRO, random_init(MICRO))
    assert_same_state(checkpoint.read(d), state_at(5))
    with pytest.raises(StarpuLLMError, match="no complete checkpoint"):
        checkpoint.read(tmp_path)


# --------------------------------------------------------------------------- killed mid-save

SAVER = textwrap.dedent("""
    import sys
    import numpy as np
    from starpu_llm import StarpuLLMError
    from starpu_llm.model.config import GPTConfig
    from starpu_llm.io import checkpoint
    from starpu_llm.model.state import TrainState

    config = GPTConfig(max_seq_len=64, vocab_size=50257, padded_vocab_size=50304, num_layers=2,
                       num_heads=4, channels=128)
    n = config.num_parameters
    try:
        step = checkpoint.read(sys.argv[1]).step
    except StarpuLLMError:
        step = 0
    while True:
        step += 1
        state = TrainState(config=config, params=np.full(n, step, np.float32),
                           m=np.full(n, -step, np.float32), v=np.full(n, 2 * step, np.float32),
                           step=step, data={"position": 7 * step})
        checkpoint.save_step(sys.argv[1], state, keep=2)
        print(step, flush=True)
""")


def test_sigkill_mid_save_leaves_the_previous_checkpoint(tmp_path):
    """A process saving a 7M-parameter model (84 MB a checkpoint) in a loop is killed after a
    random delay, at least four times; each time the directory's newest complete checkpoint,
    and every other complete one, loads and is the save of one step. Most kills land inside a
    save, leaving a temporary file or a model without its companion (the next save removes
    them); the rounds go on (up to 16) until one has (four could all land between saves on
    a machine whose saves are short)."""
    d = str(tmp_path / "ck")
    rng = random.Random(13)
    midway = 0
    for round_ in range(16):
        if round_ >= 4 and midway:
            break
        p = subprocess.Popen([sys.executable, "-c", SAVER, d], stdout=subprocess.PIPE, text=True)
        try:
            done = int(p.stdout.readline())        # one complete save in this round
            time.sleep(rng.uniform(0.0, 1.5))
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=30)
        finally:
            if p.poll() is None:
                p.kill()
        done = max([done] + [int(line) for line in p.stdout.read().split()])
        models = checkpoint.saved_steps(d)
        complete = [s for s, m in models.items() if os.path.exists(checkpoint.companion(m))]
        midway += len(complete) < len(models) or any(n.endswith(".tmp") for n in os.listdir(d))
        assert checkpoint.read(d).step == max(complete) >= done
        for step in complete:
            s = checkpoint.read(models[step])
            assert s.step == step and s.data == {"position": 7 * step}
            assert (s.params == step).all() and (s.m == -step).all() and (s.v == 2 * step).all()
    assert midway, "no kill landed inside a save: make the saved model larger"


# --------------------------------------------------------------------------- exact resume

@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("data") / "micro_train.bin")
    rng = np.random.default_rng(0)
    # a short shard: the 6 steps of 4 x 16 tokens wrap around it once
    formats.write_shard(path, rng.integers(0, MICRO.V, 200).astype(np.uint16))
    return path


def config(shard, **kw):
    return TrainConfig(**{**dict(model="micro", train_data=shard, batch=4, seq_len=16,
                                 lr=1e-2, weight_decay=0.01, log=None), **kw})


def rows(path):
    return [json.loads(line) for line in open(path)]


@pytest.mark.parametrize("engine,workers,cores,accum", [
    ("reference", None, None, 1), ("starpu", 1, 1, 1), ("starpu", 1, 2, 1), ("starpu", 2, 1, 1),
    ("starpu", 2, 1, 2)])
def test_stopped_and_resumed_equals_uninterrupted(shard, tmp_path, engine, workers, cores,
                                                  accum):
    """6 steps in one run, and 3 steps saved every 3 then resumed with steps=6: the same
    losses and the same final parameters and moments, to the bit (also with 2 micro-batches
    a step: the data position saved after both)."""
    if engine == "starpu":
        try:
            resolve_here(PartitionRequest(workers=workers, cores_per_worker=cores))
        except StarpuLLMError as e:
            pytest.skip(f"{workers}x{cores} does not fit here: {e}")
    kw = dict(engine=engine, workers=workers, cores_per_worker=cores, grad_accum=accum)
    whole = train(config(shard, steps=6, metrics_jsonl=str(tmp_path / "whole.jsonl"), **kw))
    metrics, ck = str(tmp_path / "m.jsonl"), str(tmp_path / "ck")
    first = train(config(shard, steps=3, save_every=3, checkpoint_dir=ck, metrics_jsonl=metrics,
                         **kw))
    assert checkpoint.read(ck).step == 3
    rest = train(config(shard, steps=6, resume=ck, metrics_jsonl=metrics, **kw))
    assert first.losses + rest.losses == whole.losses
    assert_same_state(rest.state, whole.state)
    # the metrics file of the resumed run is the whole run's, steps numbered globally
    assert [(r["step"], r["loss"]) for r in rows(metrics)] == \
           [(r["step"], r["loss"]) for r in rows(str(tmp_path / "whole.jsonl"))]


@pytest.mark.parametrize("engine", ["reference", "starpu"])
def test_a_final_save_resumes_at_the_next_batch(shard, tmp_path, engine):
    """--save at the end of a run records the data position after its last step (the
    shard's batches: 0, 64, then 128; one batch behind would train 64 again): 2 steps saved
    with --save and resumed from that file to 6 equal 6 steps in one run, to the bit."""
    kw = dict(engine=engine, workers=1, cores_per_worker=1) if engine == "starpu" else {}
    whole = train(config(shard, steps=6, **kw))
    path = str(tmp_path / "model.bin")
    first = train(config(shard, steps=2, save=path, **kw))
    assert checkpoint.read(path).data == {"position": 128}
    rest = train(config(shard, steps=6, resume=path, **kw))
    assert first.losses + rest.losses == whole.losses
    assert_same_state(rest.state, whole.state)


@pytest.mark.parametrize("engine", ["reference", "starpu"])
def test_validation_at_step_0_comes_first_and_a_resumed_run_does_not_repeat_it(
        shard, tmp_path, monkeypatch, engine):
    """With validation (every 2 steps), a run from step 0 first validates the weights it
    starts from (llm.c's and nanoGPT's step 0): its line comes before step 1 is submitted,
    (0, loss) is the first of val_losses, the metrics file's first row is step 0 with its
    val_loss only, and the loss is the engine's validation loss of the initial weights on the
    validation batches, bit for bit. Stopped at step 4 and resumed to 6, the resumed run
    validates no step 0 (no line, not in its val_losses) and the metrics file is the
    uninterrupted run's: the same steps, losses and validation losses."""
    from starpu_llm.flow import step as step_module
    from starpu_llm.flow.engine import StarPUEngine
    from starpu_llm.flow.reference import ReferenceEngine
    from starpu_llm.runtime import Runtime
    from starpu_llm.training.validation import Validation
    val = str(tmp_path / "val.bin")
    formats.write_shard(val, np.random.default_rng(5).integers(0, MICRO.V, 500).astype(np.uint16))
    one_core = dict(workers=1, cores_per_worker=1) if engine == "starpu" else {}
    kw = dict(engine=engine, val_data=val, val_every=2, val_batches=2, **one_core)
    lines, submit = [], step_module.Engine.submit_step

    def logged_submit(self, *a, **k):
        lines.append("submit")
        return submit(self, *a, **k)
    monkeypatch.setattr(step_module.Engine, "submit_step", logged_submit)
    whole = train(config(shard, steps=6, metrics_jsonl=str(tmp_path / "whole.jsonl"),
                         log=lines.append, **kw))
    first_line = next(i for i, line in enumerate(lines) if line.startswith("step    0/6: "))
    assert first_line < lines.index("submit"), lines
    v0 = whole.val_losses[0][1]
    assert lines[first_line] == f"step    0/6: val loss {v0:.6g}"
    assert [s for s, _ in whole.val_losses] == [0, 2, 4, 6]
    head = rows(str(tmp_path / "whole.jsonl"))[0]
    assert (head["step"], head["val_loss"], sorted(head)) == (0, v0, ["partition", "step",
                                                                      "val_loss"])
    # the initial weights' loss on the validation batches, by the same engine
    state = TrainState(config=MICRO, params=random_init(MICRO, TrainConfig.seed))
    batches = Validation(val, 4, 16, MICRO.V, 2, 2)
    if engine == "reference":
        with ReferenceEngine(MICRO, state, 4, 16, batches.loader.tokens,
                             threads=usable_cores()) as eng:
            assert batches.loss(eng) == v0
    else:
        with Runtime(resolve_here(PartitionRequest(**one_core))) as rt, \
                StarPUEngine(MICRO, state, 4, 16, batches.loader.tokens, rt) as eng:
            assert batches.loss(eng) == v0

    metrics, ck = str(tmp_path / "m.jsonl"), str(tmp_path / "ck")
    train(config(shard, steps=4, save_every=4, checkpoint_dir=ck, metrics_jsonl=metrics, **kw))
    lines.clear()
    rest = train(config(shard, steps=6, resume=ck, metrics_jsonl=metrics, log=lines.append,
                        **kw))
    assert not any(line.startswith("step    0/") for line in lines), lines
    assert [s for s, _ in rest.val_losses] == [6] and rest.val_losses == whole.val_losses[-1:]
    same = lambda path: [(r["step"], r.get("loss"), r.get("val_loss")) for r in rows(path)]  # noqa: E731
    assert same(metrics) == same(str(tmp_path / "whole.jsonl"))


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Three shards of 150, 100 and 140 tokens (2, 1 and 2 batches of 4 x 16 + 1): 6 steps
    cross every boundary and wrap once; the glob pattern that names them."""
    folder = tmp_path_factory.mktemp("shards")
    rng = np.random.default_rng(1)
    for k, n in enumerate((150, 100, 140)):
        formats.write_shard(str(folder / f"micro_train_{k:06d}.bin"),
                            rng.integers(0, MICRO.V, n).astype(np.uint16))
    return str(folder / "micro_train_*.bin")


@pytest.mark.parametrize("engine,accum", [("reference", 1), ("starpu", 1), ("starpu", 2)])
def test_resumed_across_a_shard_boundary_equals_uninterrupted(shards, tmp_path, engine, accum):
    """Over three shards (a glob pattern), a run saved after step 3 (its data position: the
    third shard, offset 0; with 2 micro-batches a step, the second shard's...) and resumed to
    step 6 gives the uninterrupted run's losses and final state, bit for bit; the checkpoint
    records (shard, offset)."""
    one_core = dict(workers=1, cores_per_worker=1) if engine == "starpu" else {}
    kw = dict(engine=engine, grad_accum=accum, **one_core)
    whole = train(config(shards, steps=6, **kw))
    ck = str(tmp_path / "ck")
    first = train(config(shards, steps=3, save_every=3, checkpoint_dir=ck, **kw))
    # 3 batches: shard 0's two and shard 1's; 6 (accum 2): an epoch, then shard 0's first
    assert checkpoint.read(ck).data == ({"shard": 2, "position": 0} if accum == 1 else
                                        {"position": 64})
    rest = train(config(shards, steps=6, resume=ck, **kw))
    assert first.losses + rest.losses == whole.losses
    assert_same_state(rest.state, whole.state)


def test_resuming_on_other_shards(shards, tmp_path):
    """Resumed with other shards: the saved position in a shard they do not have is refused,
    naming the shard count; on other shards, the run goes on with the warning of any data
    change (the run is no longer the uninterrupted one), saying the tokens and the shards
    then and now (as many in as many shards: that some are others)."""
    ck = str(tmp_path / "ck")
    train(config(shards, steps=3, save_every=3, checkpoint_dir=ck))   # at shard 2
    folder = os.path.dirname(shards)
    fewer = str(tmp_path / "fewer_*.bin")
    for k in range(2):
        os.link(os.path.join(folder, f"micro_train_{k:06d}.bin"),
                str(tmp_path / f"fewer_{k}.bin"))
    with pytest.raises(StarpuLLMError, match=r"train_data: the state is at shard 2 \(counted "
                                             r"from 0\), but .*fewer_\*\.bin has 2; .*give the "
                                             r"shards it was saved with"):
        train(config(fewer, steps=6, resume=ck))
    formats.write_shard(str(tmp_path / "fewer_2.bin"),
                        np.random.default_rng(9).integers(0, MICRO.V, 140).astype(np.uint16))
    warnings = []
    train(config(fewer, steps=4, resume=ck, warn=warnings.append))
    assert warnings == ["train_data: these are not the tokens the run was saved with (as many "
                        "in as many shards (3), but others): the run is no longer the "
                        "uninterrupted one"]
    # a shard more: how many tokens and shards then and now
    formats.write_shard(str(tmp_path / "fewer_3.bin"),
                        np.random.default_rng(9).integers(0, MICRO.V, 100).astype(np.uint16))
    warnings.clear()
    train(config(fewer, steps=4, resume=ck, warn=warnings.append))
    assert warnings == ["train_data: these are not the tokens the run was saved with (390 "
                        "tokens in 3 shard(s) then, 490 in 4 now): the run is no longer the "
                        "uninterrupted one"]


def test_resume_needs_steps_beyond_the_checkpoint(shard, tmp_path):
    path = str(tmp_path / "model.bin")
    checkpoint.write(path, state_at(3))
    with pytest.raises(StarpuLLMError, match="at step 3 already.*steps above 3"):
        train(config(shard, steps=3, resume=path, engine="reference"))
    with pytest.raises(StarpuLLMError, match="only one of them"):
        train(config(shard, steps=5, resume=path, init_from=path, engine="reference"))


# --------------------------------------------------------------------------- outputs

@pytest.mark.parametrize("setting", ["save", "metrics_jsonl", "checkpoint_dir"])
def test_unwritable_output_fails_before_the_first_step(shard, tmp_path, setting):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    lines = []
    outputs = dict(save_every=1, checkpoint_dir=str(tmp_path / "ck"))
    outputs[setting] = str(blocker / "out")
    with pytest.raises(StarpuLLMError, match="a_file"):
        train(config(shard, steps=2, engine="reference", log=lines.append, **outputs))
    assert lines == []                            # nothing loaded, nothing trained
    with pytest.raises(StarpuLLMError, match="is a directory"):
        train(config(shard, steps=2, engine="reference", save=str(tmp_path)))


def test_failed_final_save_goes_to_a_fallback_file(shard, tmp_path, monkeypatch):
    """The --save directory is replaced by a file during the run (permissions would not
    stop root): the model goes to a file in the working directory, named in the error."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"

    def log(line):
        if line.startswith("step") and out.is_dir():
            out.rename(tmp_path / "moved")
            out.write_text("")

    with pytest.raises(StarpuLLMError, match="written to (.*starpu-llm-unsaved-.*-step2.bin)") as e:
        train(config(shard, steps=2, engine="reference", save=str(out / "model.bin"), log=log))
    fallback = e.value.args[0].split("written to ")[1].split(" ")[0]
    assert os.path.dirname(fallback) == os.path.realpath(tmp_path)
    assert checkpoint.read(fallback).step == 2


def test_a_diverged_update_writes_nothing_over_the_good_checkpoints(shard, tmp_path,
                                                                   monkeypatch):
    """An update that makes the parameters inf (lr 1e36 with weight decay 1e6: p - lr wd p
    overflows) after a step whose loss is finite (computed before the update: the loss check
    lets it pass): one error naming the step; no checkpoint of it, so the good one the
    --save-every rotation would have deleted (keep 1) stays, and no --save (nor a fallback
    file) is written over the good model. Without a save at that step, the next step's NaN
    loss is the error, naming that step."""
    monkeypatch.chdir(tmp_path)             # where a fallback file would go
    ck, out = tmp_path / "ck", tmp_path / "model.bin"
    kw = dict(engine="reference", save=str(out))
    train(config(shard, steps=2, save_every=1, keep_checkpoints=1, checkpoint_dir=str(ck), **kw))
    good = checkpoint.latest(str(ck))
    diverging = dict(lr=1e36, weight_decay=1e6, resume=good, **kw)
    with pytest.raises(StarpuLLMError, match=r"parameters after step 3 are not finite .*not "
                                             r"writing the checkpoint of step 3"):
        train(config(shard, steps=4, save_every=1, keep_checkpoints=1, checkpoint_dir=str(ck),
                     **diverging))
    assert sorted(os.listdir(ck)) == ["step_00000002.bin", "step_00000002.bin.state"]
    assert np.isfinite(checkpoint.read(good).params).all()
    with pytest.raises(StarpuLLMError, match=r"parameters after step 3 are not finite .*not "
                                             r"writing save"):
        train(config(shard, steps=3, **diverging))
    assert checkpoint.read(str(out)).step == 2 and not list(tmp_path.glob("starpu-llm-unsaved*"))
    with pytest.raises(StarpuLLMError, match=r"the loss diverged at step 4 \(nan\)"):
        train(config(shard, steps=4, **{**diverging, "save": None}))


def test_check_finite_reads_every_parameter(monkeypatch):
    """check_finite reads the parameters a block at a time, of an array or of Slices (slice
    by slice: --memory-limit's): one inf or NaN anywhere (a block's last float, the next
    block's first, the last parameter) is refused."""
    from starpu_llm.model.state import Slices
    from starpu_llm.training import checkpointing

    class Over(Slices):                 # the array's values, read a slice at a time
        def __init__(self, values):
            super().__init__(MICRO)
            self.values = values

        def read_range(self, offset, out):
            out[...] = self.values[offset:offset + out.size]

    monkeypatch.setattr(checkpointing, "_FINITE_BLOCK", 1000)
    checkpointing.check_finite(state_at(3), "x")
    for at, bad in ((999, np.nan), (1000, np.inf), (MICRO.num_parameters - 1, -np.inf)):
        params = state_at(3).params
        params[at] = bad
        for state in (TrainState(config=MICRO, params=params, step=3),
                      TrainState(config=MICRO, params=Over(params), step=3)):
            with pytest.raises(StarpuLLMError, match=r"parameters after step 3 are not finite "
                                                     r".*not writing x, "):
                checkpointing.check_finite(state, "x")


class _FillsAt:
    """A file whose writes fail as on a full disk from the n-th on."""

    def __init__(self, f, n):
        self.f, self.n, self.writes = f, n, 0

    def write(self, text):
        self.writes += 1
        if self.writes >= self.n:
            raise OSError(28, "No space left on device")
        return self.f.write(text)

    def __getattr__(self, name):
        return getattr(self.f, name)


def test_a_full_disk_under_the_metrics_keeps_the_run_and_its_model(shard, tmp_path, monkeypatch):
    """The metrics file's disk fills at step 2: a warning, the run goes on to its end and its
    --save, the rows before step 2 kept, none after, and the run lists the metrics among the
    outputs it could not write (the command line's status 1)."""
    from starpu_llm.training import metrics as metrics_module
    real_open = open
    monkeypatch.setattr(metrics_module, "open",
                        lambda *a, **k: _FillsAt(real_open(*a, **k), 2), raising=False)
    warnings, path = [], str(tmp_path / "m.jsonl")
    r = train(config(shard, steps=3, engine="reference", save=str(tmp_path / "model.bin"),
                     metrics_jsonl=path, warn=warnings.append))
    assert checkpoint.read(str(tmp_path / "model.bin")).step == 3
    assert [json.loads(line)["step"] for line in real_open(path)] == [1]
    assert len(r.unwritten) == 1 and path in r.unwritten[0] and "step 2" in r.unwritten[0]
    assert len(warnings) == 1 and "No space left on device" in warnings[0], warnings


def test_checkpoints_not_written_end_the_command_with_status_1(shard, tmp_path):
    """Every --save-every checkpoint fails (as on a full disk): the training goes on, --save is
    written, and `starpu-llm train` ends with status 1 and one error naming each checkpoint
    not written."""
    script = textwrap.dedent(f"""
        import sys
        from starpu_llm import StarpuLLMError, cli
        from starpu_llm.io import checkpoint
        def full(*a, **k):
            raise StarpuLLMError("writing step_N.bin failed: No space left on device")
        checkpoint.save_step = full
        sys.exit(cli.main(["train", "--model", "micro", "--train-data", {shard!r},
                           "--batch", "4", "--seq-len", "16", "--steps", "2",
                           "--engine", "reference", "--save-every", "1",
                           "--checkpoint-dir", {str(tmp_path / "ck")!r},
                           "--save", {str(tmp_path / "model.bin")!r}]))
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 1, p.stderr
    assert checkpoint.read(str(tmp_path / "model.bin")).step == 2
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("starpu-llm: error: the run ended, but 2 of its outputs"), p.stderr
    assert "checkpoint of step 1" in last and "checkpoint of step 2" in last
    assert "Traceback" not in p.stderr


# --------------------------------------------------------------------------- the same command, the same run

def calibrate_synthetically() -> None:
    """A calibration of this machine where $STARPU_LLM_HOME says (a synthetic one: the
    trainer must not read it at all without --workers auto)."""
    save_machine(Machine(name="synthetic", cores=usable_cores(), sgemm_gflops=[50.0, 90.0],
                         bandwidth_gbs=[10.0, 15.0], source="tests/test_resume.py",
                         codelets={"matmul_forward": {"a": {1: 1.0}, "b": {1: 0.0},
                                                      "c_us": {1: 5.0}}}), default_path())


def test_the_default_partition_ignores_a_calibration(shard, tmp_path, monkeypatch):
    """Without a partition setting, `train` runs 1 worker on all usable cores, one
    sub-batch, calibrated or not, and trains the same losses (the tiny model, to the bit)."""
    tiny = str(tmp_path / "tiny.bin")
    formats.write_shard(tiny, np.random.default_rng(1).integers(0, 50257, 2000).astype(np.uint16))

    def run():
        lines = []
        r = train(TrainConfig(model="tiny", train_data=tiny, batch=2, seq_len=32, steps=3,
                              metrics_jsonl=str(tmp_path / "m.jsonl"), log=lines.append))
        assert not any("autotune" in line for line in lines), lines
        return r.losses, rows(str(tmp_path / "m.jsonl"))[0]["partition"], lines

    monkeypatch.setenv("STARPU_LLM_HOME", str(tmp_path / "uncalibrated"))
    plain, plain_partition, _ = run()
    monkeypatch.setenv("STARPU_LLM_HOME", str(tmp_path / "calibrated"))
    calibrate_synthetically()
    assert os.path.exists(default_path())
    calibrated, calibrated_partition, lines = run()
    assert calibrated_partition == plain_partition
    assert (plain_partition["workers"], plain_partition["cores_per_worker"],
            plain_partition["sub_batches"]) == (1, usable_cores(), 1)
    assert f"partition: 1 worker(s) x {usable_cores()} core(s)" in "\n".join(lines)
    assert calibrated == plain


def test_resume_continues_on_the_recorded_partition(shard, tmp_path):
    """A run saved on 2x1 resumed with no partition setting continues on 2x1 (and equals the
    uninterrupted 2x1 run); a partition given is used, with one warning line."""
    kw = dict(engine="starpu", oversubscribe=True)
    whole = train(config(shard, steps=4, workers=2, cores_per_worker=1, **kw))
    ck = str(tmp_path / "ck")
    train(config(shard, steps=2, workers=2, cores_per_worker=1, save_every=2, checkpoint_dir=ck,
                 **kw))
    p = checkpoint.read_with_record(ck)[1].partition
    assert (p.engine, p.workers, p.cores_per_worker, p.sub_batches) == ("starpu", 2, 1, 2)
    warnings, metrics = [], str(tmp_path / "m.jsonl")
    rest = train(config(shard, steps=4, resume=ck, metrics_jsonl=metrics, warn=warnings.append,
                        **kw))
    assert rest.losses == whole.losses[2:]
    assert {(r["partition"]["workers"], r["partition"]["cores_per_worker"]) for r in rows(metrics)} \
        == {(2, 1)}
    assert warnings == []
    train(config(shard, steps=4, resume=ck, workers=1, cores_per_worker=1, warn=warnings.append,
                 **kw))
    assert len(warnings) == 1 and "1 worker(s) x 1 core(s)" in warnings[0] \
        and "2 worker(s) x 1 core(s)" in warnings[0] and "roundings will differ" in warnings[0]


def test_resume_keeps_the_recorded_scheduler_and_reads_older_records(shard, tmp_path,
                                                                     monkeypatch):
    """The scheduler is the partition's: recorded, and resumed where the resumed run names
    none; a checkpoint saved before it was recorded resumes on the default one, with no
    warning (the partition's shape is the same)."""
    kw = dict(engine="starpu", workers=1, cores_per_worker=1)
    ck, old = str(tmp_path / "ck"), str(tmp_path / "old")
    train(config(shard, steps=2, save_every=2, checkpoint_dir=ck, sched="eager", **kw))
    assert checkpoint.read_with_record(ck)[1].partition.sched == "eager"
    to_json = RunRecord.to_json

    def before_the_scheduler_was_kept(record):
        d = json.loads(to_json(record))
        del d["partition"]["sched"], d["partition"]["pipeline_schedule"]
        return json.dumps(d, separators=(",", ":"))
    monkeypatch.setattr(RunRecord, "to_json", before_the_scheduler_was_kept)
    train(config(shard, steps=2, save_every=2, checkpoint_dir=old, sched="eager", **kw))
    monkeypatch.undo()
    assert checkpoint.read_with_record(old)[1].partition.sched == ""
    for path, sched in ((ck, "eager"), (old, "lws")):
        warnings, metrics = [], str(tmp_path / f"{sched}.jsonl")
        train(config(shard, steps=3, resume=path, engine="starpu", metrics_jsonl=metrics,
                     warn=warnings.append))
        assert warnings == [] and {r["partition"]["sched"] for r in rows(metrics)} == {sched}


def test_resume_keeps_the_recorded_attention_unless_one_is_asked(shard, tmp_path):
    """The attention's form is the partition's: recorded, resumed where the resumed run asks
    for none; another one asked for is run, with the warning that the roundings differ."""
    kw = dict(engine="starpu", workers=1, cores_per_worker=1)
    ck = str(tmp_path / "ck")
    train(config(shard, steps=2, save_every=2, checkpoint_dir=ck, attention="flash", **kw))
    assert checkpoint.read_with_record(ck)[1].partition.attention == "flash"
    for asked, runs in ((None, "flash"), ("gemm", "gemm")):
        warnings, metrics = [], str(tmp_path / f"{runs}.jsonl")
        train(config(shard, steps=3, resume=ck, engine="starpu", attention=asked,
                     metrics_jsonl=metrics, warn=warnings.append))
        assert {r["partition"]["attention"] for r in rows(metrics)} == {runs}
        assert (warnings == []) == (asked is None), warnings
        assert all("roundings will differ" in w for w in warnings)


def test_resume_refuses_another_model_and_warns_on_changed_settings(shard, tmp_path):
    ck = str(tmp_path / "ck")
    train(config(shard, steps=2, engine="reference", save_every=2, checkpoint_dir=ck))
    with pytest.raises(StarpuLLMError, match="model tiny contradicts .*the micro model"):
        train(config(shard, steps=3, engine="reference", resume=ck, model="tiny"))
    with pytest.raises(StarpuLLMError, match="model tiny contradicts .*the micro model"):
        train(config(shard, steps=3, engine="reference", init_from=checkpoint.latest(ck),
                     model="tiny"))
    warnings = []
    train(config(shard, steps=3, engine="reference", resume=ck, warn=warnings.append))
    assert warnings == []
    train(config(shard, steps=3, engine="reference", resume=ck, batch=2, lr=1e-3,
                 warn=warnings.append))
    # from Python the settings are named as TrainConfig's fields (the CLI's flags:
    # test_cli.py's resume tests)
    assert warnings == ["batch 2 (saved with 4), lr 0.001 (saved with 0.01): the "
                        "run is no longer the uninterrupted one"]
    other = str(tmp_path / "other.bin")
    formats.write_shard(other, np.arange(300, dtype=np.uint16) % MICRO.V)
    warnings = []
    train(config(other, steps=3, engine="reference", resume=ck, warn=warnings.append))
    assert warnings == ["train_data: these are not the tokens the run was saved with (200 "
                        "tokens then, 300 now): the run is no longer the uninterrupted one"]


# --------------------------------------------------------------------------- the set-up reads top to bottom

def test_the_set_up_enters_resume_and_the_calibration_once(shard, tmp_path, monkeypatch):
    """A resumed run's set-up (trainer._set_up, up to its training loop) takes what it
    continues from in one call into training/resume.py (the model, the checkpoint, its recorded
    partition and settings, what to say), and this machine's calibration in one call into
    perf/predict.py (the autotuner's, a pipeline's stages and the mfu's): no return trips."""
    import starpu_llm
    from starpu_llm.training import trainer
    root = os.path.dirname(starpu_llm.__file__)
    # each watched file and the code whose calls into it are its own (the autotuner's
    # predictions); the count of entries into it from the rest
    own = {os.path.join(root, "training/resume.py"): os.path.join(root, "training/resume.py"),
           os.path.join(root, "perf", "predict.py"): os.path.join(root, "perf", "")}
    watched = dict.fromkeys(own, 0)
    monkeypatch.setenv("STARPU_LLM_HOME", str(tmp_path / "home"))
    calibrate_synthetically()
    ck = str(tmp_path / "ck")
    train(config(shard, steps=2, save_every=2, checkpoint_dir=ck, engine="starpu"))
    setting_up = [False]

    def tracer(frame, event, arg):
        code = frame.f_code
        if code.co_filename == trainer.__file__ and code.co_name in ("_set_up", "_run"):
            setting_up[0] = code.co_name == "_set_up"
        caller = frame.f_back.f_code.co_filename if frame.f_back else ""
        if (setting_up[0] and code.co_filename in watched
                and not caller.startswith(own[code.co_filename])):
            watched[code.co_filename] += 1
        return None

    sys.settrace(tracer)
    try:
        train(config(shard, steps=4, resume=ck, engine="starpu", workers="auto"))
    finally:
        sys.settrace(None)
    assert list(watched.values()) == [1, 1], watched


def test_a_resumed_run_resolves_its_partition_once(shard, tmp_path, monkeypatch):
    """--resume on the recorded partition: resolved once (resume.on_recorded_partition, for
    the run's batch), not checked by one resolve and then resolved again by the run."""
    from starpu_llm.plan import partition
    ck = str(tmp_path / "ck")
    train(config(shard, steps=2, save_every=2, checkpoint_dir=ck, engine="reference",
                 threads=1))
    calls = []
    real = partition.resolve
    monkeypatch.setattr(partition, "resolve", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    r = train(config(shard, steps=3, resume=ck, engine="reference"))
    assert len(calls) == 1 and calls[0].threads == 1
    assert r.engine.startswith("reference engine, 1 OpenMP thread(s)"), r.engine
