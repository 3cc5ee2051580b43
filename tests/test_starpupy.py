"""starpupy as the runtime's Python face (starpu_llm/runtime/starpupy_face.py): StarPU started and
stopped by starpupy trains exactly as when started through cffi, and the checkpoint write, a
Python task submitted with starpupy into the task graph of the C codelets, writes the
parameters of the step it follows while the next step runs.

Needs a StarPU built with starpupy (the `starpu` package: `make test-1.4`); skipped elsewhere.
"""
import numpy as np
import pytest

starpu = pytest.importorskip(
    "starpu", reason="this StarPU build has no starpupy (StarPU's Python interface, StarPU "
                     ">= 1.4 built with it): the starpupy face cannot run; `make test-1.4` runs it")

from starpu_llm import Runtime, StarpuLLMError                      # noqa: E402
from starpu_llm.io import formats                                   # noqa: E402
from starpu_llm.runtime import starpupy_face                      # noqa: E402
from starpu_llm.model.config import MODELS, AdamW, GPTConfig               # noqa: E402
from starpu_llm.flow.engine import StarPUEngine                           # noqa: E402
from starpu_llm.runtime import usable_cores                          # noqa: E402
from starpu_llm.model.state import TrainState, random_init                 # noqa: E402
from partitions import here, subs

starpupy_face.import_starpupy()   # its reference repair, whatever runs first

SMALL = GPTConfig(max_seq_len=32, vocab_size=250, padded_vocab_size=256, num_layers=2,
                  num_heads=4, channels=64)
B, T, STEPS = 4, 32, 4
# Partitions whose task order the data dependencies fix (one sub-batch, no reduction): a
# run gives the same losses bit for bit whoever started StarPU. 1x2 is a parallel worker on
# StarPU 1.4 (a team worker where the build has none).
PARTITIONS = [(1, 1)] + ([(1, 2), (2, 1)] if usable_cores() >= 2 else [])


@pytest.fixture(autouse=True)
def no_face_env(monkeypatch):
    monkeypatch.delenv(starpupy_face.ENV, raising=False)


def tokens():
    return np.random.default_rng(7).integers(0, SMALL.V, B * T * STEPS + 1).astype(np.uint16)


def train(face, workers, cores, checkpoint_dir=None):
    """Losses of STEPS steps and the parameters after each; with checkpoint_dir, a
    checkpoint is submitted after each step (it runs during the next one)."""
    state = TrainState(config=SMALL, params=random_init(SMALL, seed=11))
    losses, params = [], []
    with Runtime(here(workers, cores), face=face) as rt:
        assert rt.face == face
        eng = StarPUEngine(SMALL, state, B, T, tokens(), rt, subs(rt, 1))
        try:
            for s in range(STEPS):
                losses.append(eng.step(s * B * T, AdamW(1e-3, 0.01)))
                if checkpoint_dir is not None:
                    eng.submit_checkpoint(checkpoint_dir / f"step{s + 1}.bin")
                eng.sync()
                params.append(state.params.copy())
        finally:
            eng.close()
    return np.array(losses), params


@pytest.mark.parametrize("workers,cores", PARTITIONS)
def test_same_losses_and_checkpoints_as_cffi(tmp_path, workers, cores):
    ref_losses, ref_params = train("cffi", workers, cores)
    losses, params = train("starpupy", workers, cores, checkpoint_dir=tmp_path)
    assert np.all(np.isfinite(ref_losses))
    np.testing.assert_array_equal(losses, ref_losses)
    for s in range(STEPS):
        np.testing.assert_array_equal(params[s], ref_params[s])
        config, written = formats.read_checkpoint(tmp_path / f"step{s + 1}.bin")
        assert config == SMALL
        # the parameters after step s + 1, not those of a later step the write overlapped
        np.testing.assert_array_equal(written, ref_params[s], err_msg=f"checkpoint {s + 1}")


def test_checkpoint_submitted_before_the_next_step_without_waiting(tmp_path):
    """Submitted right after the update, with no wait: the data dependencies alone put the
    snapshot after that update and before the next one."""
    _, ref_params = train("cffi", 1, 1)
    state = TrainState(config=SMALL, params=random_init(SMALL, seed=11))
    with Runtime(here(1, 1), face="starpupy") as rt:
        eng = StarPUEngine(SMALL, state, B, T, tokens(), rt, subs(rt, 1))
        try:
            for s in range(STEPS):
                eng.submit_forward_backward(s * B * T)
                eng.submit_update(AdamW(1e-3, 0.01))
                eng.submit_checkpoint(tmp_path / f"step{s + 1}.bin")
            eng.wait()
            assert eng.checkpoints.written == [str(tmp_path / f"step{s + 1}.bin")
                                               for s in range(STEPS)]
        finally:
            eng.close()
    for s in range(STEPS):
        np.testing.assert_array_equal(formats.read_checkpoint(tmp_path / f"step{s + 1}.bin")[1],
                                      ref_params[s])


def test_checkpoint_error_is_raised(tmp_path):
    state = TrainState(config=SMALL, params=random_init(SMALL, seed=11))
    with Runtime(here(1, 1), face="starpupy") as rt:
        eng = StarPUEngine(SMALL, state, B, T, tokens(), rt, subs(rt, 1))
        try:
            eng.step(0, AdamW(1e-3, 0.01))
            (tmp_path / "file").write_text("not a directory")
            eng.submit_checkpoint(tmp_path / "file" / "ck.bin")
            with pytest.raises(StarpuLLMError, match="writing a checkpoint failed"):
                eng.wait()
        finally:
            eng.close()


def test_face_choice(monkeypatch):
    assert starpupy_face.available()
    assert starpupy_face.resolve(None) == "cffi"
    monkeypatch.setenv(starpupy_face.ENV, "starpupy")
    assert starpupy_face.resolve(None) == "starpupy"
    with Runtime(here(1, 1)) as rt:                      # the environment asks for it
        assert rt.face == "starpupy" and "starpupy" in rt.describe()
    with Runtime(here(1, 1), face="cffi") as rt:         # an explicit choice wins
        assert rt.face == "cffi"
    with pytest.raises(StarpuLLMError, match="choose one of"):
        starpupy_face.resolve("ctypes")


def test_starpupy_handle_pointer_is_a_starpu_handle():
    """The raw handle of a starpupy Handle (its capsule) is the StarPU handle C code orders
    on: a C task writing it (the snapshot copy) runs before the starpupy task reading it."""
    with Runtime(here(1, 1), face="starpupy") as rt:
        from starpu_llm.flow.handles import Handles
        place = Handles(rt, MODELS["micro"])
        src = [np.arange(5, dtype=np.float32), np.arange(5, 8, dtype=np.float32)]
        handles = [place._register(a) for a in src]
        dst = np.zeros(8, np.float32)
        h = starpu.Handle(dst)
        seen = []
        from starpu_llm._clib import ffi
        from starpu_llm.runtime.submit import StarPUOps
        StarPUOps().gather(starpupy_face.handle_pointer(h), handles,
                           ffi.cast("char *", ffi.from_buffer(dst)))
        starpu.task_submit(ret_fut=False)(lambda a: seen.append(a.copy()), h)
        rt.wait()
        h.unregister()
        place.unregister_all()
    np.testing.assert_array_equal(seen[0], np.arange(8, dtype=np.float32))


def test_many_starts_in_one_process():
    """starpu.init() registers starpupy's data interfaces anew each time; StarPU 1.4.12's
    table of them overflowed from the 7th start of a process (sl_reserve_interface_ids)."""
    for _ in range(12):
        with Runtime(here(1, 1), face="starpupy") as rt:
            h = starpu.Handle(np.zeros(4, np.float32))
            seen = []
            starpu.task_submit(ret_fut=False)(lambda a: seen.append(a.sum()), h)
            rt.wait()
            h.unregister()
            assert seen == [0.0]
