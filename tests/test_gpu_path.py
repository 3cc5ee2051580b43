"""The GPU engine as `train --gpus N` runs it, checked without a GPU (issue 41, item 1):

  - placement: with GPUs every task of a codelet with a CUDA body (every layer of a training
    step, the clipping's norm, AdamW) may run on the CUDA workers only, the CPU workers keep
    the batch loads (runtime.starpu.placement, the C layer's one decision, which sl_start
    applies: here checked applied on a CPU start);
  - the training loop submits step n + 1 before it reads step n's loss, and waits for every
    task only where something reads the state (the last step, a validation); its losses,
    gradient norms (the clip applied by the AdamW tasks from the norm tree's root, no host
    read before the update), validation losses and final parameters are those of
    Engine.step, which waits at every step, bit for bit;
  - the run's last line: the peak GPU memory beside the peak RSS with GPUs, nothing GPU
    without.
test_gpu.py checks the same on a GPU (every layer task of a step ran on a CUDA worker)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from starpu_llm import TrainConfig, train
from starpu_llm.model.config import GPTConfig
from starpu_llm.flow import step as step_module
from starpu_llm.flow.engine import StarPUEngine
from starpu_llm.io import formats
from starpu_llm.io.data import DataLoader
from starpu_llm.runtime import starpu as rt_module
from starpu_llm.runtime.starpu import ON_CPU, ON_CUDA, placed, placement
from starpu_llm.training.schedule import learning_rate
from starpu_llm.model.state import TrainState, random_init

SMALL = GPTConfig(max_seq_len=32, vocab_size=97, padded_vocab_size=128,
                  num_layers=2, num_heads=4, channels=32)
B, T, STEPS, CLIP = 4, 16, 5, 1.4   # between the norms of these steps: some clip, some not
# on purpose on the CPU workers: the batch loads read the token shard in host memory
CPU_ON_PURPOSE = {"load_batch"}


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("shards")
    rng = np.random.default_rng(3)
    train_path, val_path = str(d / "training.bin"), str(d / "val.bin")
    formats.write_shard(train_path, rng.integers(0, SMALL.V, 4096).astype(np.uint16))
    formats.write_shard(val_path, rng.integers(0, SMALL.V, 1024).astype(np.uint16))
    return train_path, val_path


def config(shards, **kw):
    train_path, val_path = shards
    settings = dict(train_data=train_path, batch=B, seq_len=T, steps=STEPS,
                    lr=1e-3, weight_decay=0.01, lr_schedule="cosine", warmup_steps=1,
                    min_lr=1e-4, grad_clip=CLIP, log=None)
    if kw.get("val_every"):         # the validation shard, read only then
        settings["val_data"] = val_path
    return TrainConfig(**{**settings, **kw})


def fresh_state():
    return TrainState(config=SMALL, params=random_init(SMALL, seed=5))


def test_with_gpus_every_layer_codelet_runs_on_cuda_only(runtime, shards):
    """Every codelet a training step submits (2 sub-batches: their gradients' reduction
    methods too; clipping: the norm's tasks), as placed on a start with 1 or 2 GPUs: on the
    CUDA workers only, but the batch loads, on the CPU workers only. Without GPUs all on the
    CPU workers, as this CPU start applied them."""
    r = train(config(shards, steps=1, sub_batches=2, record=True), fresh_state(), runtime)
    submitted = set(r.records) | {"add", "zero"}     # the reduction methods StarPU calls
    assert {"matmul_forward", "attention_backward", "grad_sumsq", "adamw"} <= submitted
    for gpus in (1, 2):
        where = placement(gpus)
        wrong = {c: where[c] for c in submitted - CPU_ON_PURPOSE if where[c] != ON_CUDA}
        assert not wrong, f"with {gpus} GPU(s) these layer codelets may run on a CPU: {wrong}"
        assert all(where[c] == ON_CPU for c in CPU_ON_PURPOSE)
    assert placement(0) == {c: ON_CPU for c in placement(0)}
    assert placed() == placement(0)          # what this CPU start gave StarPU


def reference_run(runtime, cfg):
    """What the loop must give: Engine.step (waits at every step) on the loader's batches,
    with the run's learning rates, the gradient norm read after each step, the validation
    loss of the initial weights (step 0), after step 3 and the last."""
    state = fresh_state()
    loader = DataLoader(cfg.train_data, B, T, vocab_size=SMALL.V)
    val = DataLoader(cfg.val_data, B, T, vocab_size=SMALL.V)
    positions = [val.next_position() for _ in range(cfg.val_batches)]    # as training/validation.py's
    losses, norms, vals = [], [], []
    with StarPUEngine(SMALL, state, B, T, loader.tokens, runtime) as eng:
        vals.append((0, eng.validation_loss(val.tokens, positions)))     # the initial weights'
        for s in range(STEPS):
            lr = learning_rate(s, STEPS, cfg.lr, cfg.lr_schedule, cfg.warmup_steps, cfg.min_lr)
            losses.append(eng.step(loader.next_position(), cfg.adamw.with_lr(lr)))
            norms.append(eng.grad_norm())
            if (s + 1) % cfg.val_every == 0 or s + 1 == STEPS:
                vals.append((s + 1, eng.validation_loss(val.tokens, positions)))
        eng.sync()
    return losses, norms, vals, state.params.copy()


def test_the_loop_submits_the_next_step_before_reading_a_loss(runtime, shards, monkeypatch,
                                                              tmp_path):
    """5 steps, validation every 3: the initial weights' validation (its 2 batches, each
    waited for) comes before step 1 is submitted; step n + 1 is submitted before step n's
    loss is read; the loop waits for every task only after step 1 (the untimed one: the timed steps' times then
    add up to the wall time after it), after step 3 (a validation reads the parameters) and
    after the last; losses, gradient norms, validation losses and parameters equal
    Engine.step's."""
    metrics = str(tmp_path / "m.jsonl")
    cfg = config(shards, val_every=3, val_batches=2, metrics_jsonl=metrics)
    log = []
    submit, loss, wait = (step_module.Engine.submit_step, StarPUEngine.loss,
                          rt_module.Runtime.wait)

    def logged_submit(self, *a, **k):
        s = submit(self, *a, **k)
        log.append(f"submit {s.step}")
        self._submitted = getattr(self, "_submitted", []) + [s]
        return s

    def logged_loss(self, losses=None, micro_batches=1):
        if losses is not None:       # a step's loss (else a validation batch's)
            step = next(s.step for s in reversed(self._submitted) if s.losses == losses)
            log.append(f"read {step}")
        return loss(self, losses, micro_batches)

    def logged_wait(self):
        log.append("wait")
        return wait(self)

    monkeypatch.setattr(step_module.Engine, "submit_step", logged_submit)
    monkeypatch.setattr(StarPUEngine, "loss", logged_loss)
    monkeypatch.setattr(rt_module.Runtime, "wait", logged_wait)
    r = train(cfg, fresh_state(), runtime)
    monkeypatch.undo()
    # a validation waits for each of its batches (the "wait"s after a step's read); the run's
    # end may wait again
    end = log.index("read 5") + 1
    assert log[:end] == ["wait", "wait", "submit 1", "wait", "read 1", "submit 2", "submit 3", "read 2", "wait",
                         "read 3", "wait", "wait", "submit 4", "submit 5", "read 4", "wait",
                         "read 5"], " ".join(log)
    assert set(log[end:]) == {"wait"}, " ".join(log)

    losses, norms, vals, params = reference_run(runtime, cfg)
    rows = [json.loads(line) for line in open(metrics)]
    assert [x.hex() for x in r.losses] == [x.hex() for x in losses]
    assert [row["grad_norm"] for row in rows[1:]] == norms     # rows[0]: the step-0 validation
    assert any(n > CLIP for n in norms) and any(n < CLIP for n in norms)   # clipped sometimes
    assert r.val_losses == vals
    assert np.array_equal(r.state.params, params)


def test_the_end_line_has_the_peak_gpu_memory_with_gpus_only(runtime, shards, monkeypatch):
    """A CPU run's last line: the peak RSS, nothing GPU; a runtime with GPUs (its
    gpu_memory_mb, which reads cudaMemGetInfo, replaced here): the most it reported after a
    step beside it."""
    lines = []
    r = train(config(shards, steps=2, log=lines.append), fresh_state(), runtime)
    assert r.peak_gpu_mb is None and runtime.gpu_memory_mb() is None
    assert runtime.cuda_devices() == []     # the devices it would read: no CUDA worker's
    assert "peak RSS" in lines[-1] and "GPU" not in lines[-1], lines[-1]
    seen = iter([1000.0, 1234.4, 900.0])
    monkeypatch.setattr(rt_module.Runtime, "gpu_memory_mb", lambda self: next(seen))
    lines.clear()
    r = train(config(shards, steps=3, log=lines.append), fresh_state(), runtime)
    assert r.peak_gpu_mb == 1234.4
    assert lines[-1].endswith("peak GPU memory: 1234 MB") and "peak RSS" in lines[-1], lines[-1]


def test_a_signal_while_a_step_is_ahead_stops_after_it_with_its_checkpoint(runtime, shards,
                                                                          monkeypatch, tmp_path):
    """SIGUSR1 while step 2 is submitted (step 1 not read yet): step 1 is read and watched
    without stopping, step 2 (the step under way) drained, then the run saves and stops: the
    checkpoint of step 2 holds the parameters Engine.step leaves after 2 steps, bit for
    bit, and no step 3 was submitted."""
    import os
    import signal

    from starpu_llm import signals

    submitted = []
    submit = step_module.Engine.submit_step

    def signalled_submit(self, *a, **k):
        s = submit(self, *a, **k)
        submitted.append(s.step)
        if s.step == 2:
            os.kill(os.getpid(), signal.SIGUSR1)
        return s

    monkeypatch.setattr(step_module.Engine, "submit_step", signalled_submit)
    cfg = config(shards, save_every=100, checkpoint_dir=str(tmp_path / "ck"))
    with pytest.raises(signals.Interrupted):
        train(cfg, fresh_state(), runtime)
    monkeypatch.undo()
    assert submitted == [1, 2]
    _, params = formats.read_checkpoint(str(tmp_path / "ck" / "step_00000002.bin"))
    state = fresh_state()
    loader = DataLoader(cfg.train_data, B, T, vocab_size=SMALL.V)
    with StarPUEngine(SMALL, state, B, T, loader.tokens, runtime) as eng:
        for s in range(2):
            lr = learning_rate(s, STEPS, cfg.lr, cfg.lr_schedule, cfg.warmup_steps, cfg.min_lr)
            eng.step(loader.next_position(), cfg.adamw.with_lr(lr))
        eng.sync()
    assert np.array_equal(params, state.params)
