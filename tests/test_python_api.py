"""The package driven from Python as a researcher does (a script, a notebook: one process,
runs one after the other): a wrong value is one StarpuLLMError naming the field before StarPU
starts; a run that fails or is interrupted leaves StarPU stopped (the next run starts); an
interrupted run hands back what it trained; an engine refuses a position outside its data and
any use once closed or once its runtime ended, instead of reading other memory or aborting
the process. No module-wide runtime: each test starts and stops its own."""
import os
import signal

import numpy as np
import pytest

from starpu_llm import TrainConfig, train
from starpu_llm.errors import StarpuLLMError
from starpu_llm.flow.engine import StarPUEngine
from starpu_llm.flow.reference import ReferenceEngine
from starpu_llm.model.config import MODELS, AdamW
from starpu_llm.model.state import TrainState, random_init
from starpu_llm.runtime import Runtime
from starpu_llm.signals import Interrupted
from partitions import here

TINY = dict(model="tiny", batch=2, seq_len=16, steps=2, log=None)


def starpu_stopped() -> bool:
    return Runtime._active is None


@pytest.mark.parametrize("field, value, said", [
    ("batch", "2", "batch expects a whole number, got '2'"),
    ("batch", 2.0, "batch expects a whole number, got 2.0"),
    ("batch", True, "batch expects a whole number, got True"),
    ("steps", "3", "steps expects a whole number"),
    ("lr", "1e-3", "lr expects a number"),
    ("lr", float("nan"), "lr must be a finite number >= 0, got nan"),
    ("workers", "two", "workers expects a whole number or auto"),
    ("grad_accum", 0, "grad_accum must be at least 1, got 0"),
    ("val_batches", 0, "val_batches must be at least 1, got 0"),
    ("save_every", 0, "save_every must be at least 1, got 0"),
    ("keep_checkpoints", -1, "keep_checkpoints must be at least 1, got -1"),
    ("sample_every", -1, "sample_every must be >= 0, got -1"),
    ("val_every", -1, "val_every must be >= 0, got -1"),
    ("beta2", 1.0, "beta2 must be in [0, 1), got 1.0"),
    ("warmup_steps", -2, "warmup_steps must be >= 0, got -2"),
    ("engine", "fast", "engine 'fast': choose one of starpu, reference"),
    ("oversubscribe", 1, "oversubscribe is a switch: True or False, got 1"),
    ("train_data", 5, "train_data expects text"),
    ("save", " ", "save expects text"),
    ("untimed_steps", -1, "untimed_steps -1"),
])
def test_a_wrong_value_from_python_names_its_field_before_starpu_starts(field, value, said):
    """Each value its flag would refuse (a string for a number, a float or a bool for a whole
    number, out of range, not among the choices, a number for a path): one StarpuLLMError
    naming the field, nothing started (a TypeError deep inside, an error at the first step,
    or a run on True as a batch of 1, before)."""
    with pytest.raises(StarpuLLMError) as e:
        train(TrainConfig(**{**TINY, field: value}))
    assert said in str(e.value), str(e.value)
    assert starpu_stopped()


def test_numpy_whole_numbers_are_whole_numbers():
    r = train(TrainConfig(**{**TINY, "batch": np.int64(2), "seed": np.int64(3),
                             "engine": "reference"}))
    assert len(r.losses) == 2


def test_a_failure_while_the_run_is_described_leaves_starpu_stopped():
    """A log callable that raises on the partition's line (StarPU is running then, the engine
    made): its error comes out, StarPU is stopped, and the next run starts."""
    def log(line, *_, **__):
        if str(line).startswith("partition:"):
            raise RuntimeError("the notebook's logger broke")
    with pytest.raises(RuntimeError, match="logger broke"):
        train(TrainConfig(**{**TINY, "log": log}))
    assert starpu_stopped()
    assert len(train(TrainConfig(**TINY)).losses) == 2


def test_an_interrupted_run_hands_back_what_it_trained():
    """Ctrl-C (SIGINT to the process) during train() from Python, without save: the run stops
    after the step under way and raises Interrupted, whose result holds the steps done (their
    losses, the state at that step); StarPU is stopped."""
    def log(line, *_, **__):
        if str(line).split()[:2] == ["step", "1/20:"]:
            os.kill(os.getpid(), signal.SIGINT)
    with pytest.raises(Interrupted) as e:
        train(TrainConfig(**{**TINY, "steps": 20, "log": log}))
    r = e.value.result
    assert r is not None and r.state is not None
    assert 1 <= len(r.losses) == r.state.step < 20, (len(r.losses), r.state.step)
    assert all(np.isfinite(r.losses))
    assert starpu_stopped()


def test_ctrl_c_as_starpu_starts_leaves_it_stopped(monkeypatch):
    """Ctrl-C landing while StarPU starts (Python raises it as sl_start returns, before the
    Runtime held StarPU; a notebook's interrupt during train()'s start): Interrupted, StarPU
    stopped, and the next run starts (each one after failed "starpu_init failed (-114)":
    StarPU initialized, no Runtime to stop it)."""
    from starpu_llm.runtime import starpu
    real = starpu.lib

    class SignalledStart:              # the binding, with Ctrl-C arriving during sl_start
        def __getattr__(self, name):
            return getattr(real, name)

        def sl_start(self, *args):
            ret = real.sl_start(*args)
            os.kill(os.getpid(), signal.SIGINT)     # its handler runs here, at once
            return ret
    monkeypatch.setattr(starpu, "lib", SignalledStart())
    with pytest.raises(Interrupted) as e:
        train(TrainConfig(**TINY))
    assert e.value.result is None
    assert starpu_stopped()
    monkeypatch.undo()
    assert len(train(TrainConfig(**TINY)).losses) == 2


def _engines(rt, tokens):
    config = MODELS["tiny"]
    for make in (lambda s: ReferenceEngine(config, s, 2, 16, tokens, threads=1),
                 lambda s: StarPUEngine(config, s, 2, 16, tokens, rt)):
        yield make(TrainState(config=config, params=random_init(config)))


def test_a_position_outside_the_data_is_refused():
    """A batch of 2 x 16 reads 33 tokens from its position: a position past len - 33 (which
    read memory past the shard: a loss of garbage, or a segfault at 10^9) or below 0 is one
    StarpuLLMError saying which positions fit, on both engines, for training and
    validation; the last one that fits runs."""
    tokens = np.random.default_rng(0).integers(0, MODELS["tiny"].V, 100).astype(np.uint16)
    with Runtime(here()) as rt:
        for eng in _engines(rt, tokens):
            with eng:
                for pos in (len(tokens) - 10, 10**9, -5, [0, 90]):
                    with pytest.raises(StarpuLLMError, match="give a position from 0 to 67"):
                        eng.step(pos, AdamW(1e-3))
                with pytest.raises(StarpuLLMError, match="the validation data holds 100"):
                    eng.validation_loss(tokens, [68])
                assert np.isfinite(eng.step(67, AdamW(1e-3)))
                assert np.isfinite(eng.validation_loss(tokens, [0, 67]))


def test_tokens_the_load_tasks_cannot_read_are_refused():
    """An engine's tokens (and validation_loss's) other than a 1-D contiguous uint16 array
    (an int64 array from tok.encode, float, strided, a list) is one StarpuLLMError naming
    DataLoader, which converts it (their bytes were read as other ids: a silent wrong loss,
    or a segfault); an id >= V in a batch, one naming the position (a row past wte's read)."""
    config = MODELS["tiny"]
    ids = np.random.default_rng(0).integers(0, config.V, 100)
    tokens = ids.astype(np.uint16)
    with Runtime(here()) as rt:
        for make in (lambda s, t: ReferenceEngine(config, s, 2, 16, t, threads=1),
                     lambda s, t: StarPUEngine(config, s, 2, 16, t, rt)):
            for wrong in (ids, ids.astype(np.float32), np.repeat(tokens, 2)[::2], list(tokens)):
                with pytest.raises(StarpuLLMError, match="the training data: the load tasks read "
                                   "a 1-D contiguous numpy uint16 array .* give DataLoader"):
                    make(TrainState(config=config, params=random_init(config)), wrong)
            high = tokens.copy()
            high[40] = config.V
            with make(TrainState(config=config, params=random_init(config)), high) as eng:
                with pytest.raises(StarpuLLMError, match=f"position 30: the training data holds "
                                   f"token id {config.V} there"):
                    eng.step(30, AdamW(1e-3))
                with pytest.raises(StarpuLLMError, match="the validation data: the load tasks"):
                    eng.validation_loss(ids, [0])
                with pytest.raises(StarpuLLMError, match="the validation data holds token id"):
                    eng.validation_loss(high, [0, 30])
                assert eng.state.step == 0
                assert np.isfinite(eng.step(0, AdamW(1e-3)))
    from starpu_llm.io.data import DataLoader
    strided = DataLoader(np.repeat(tokens, 2)[::2], 2, 16, config.V).tokens
    assert strided.flags.c_contiguous and (strided == tokens).all()


def test_an_update_takes_its_settings_as_one_adamw_value():
    """Engine.step, submit_step and submit_update take the update's settings as one AdamW
    value: a call in the loose arguments they took before (positional or keywords: a
    TypeError about arguments before), or a bare learning rate, is one StarpuLLMError naming
    the call and saying what to give, before any task (no update counted, and the next step's loss is the
    first step's); an AdamW naming tensors to decay that DECAYED does not have is refused
    where it is made."""
    tokens = np.random.default_rng(0).integers(0, MODELS["tiny"].V, 100).astype(np.uint16)
    with pytest.raises(StarpuLLMError, match="AdamW decayed 'biases': choose one of all, "
                                             "matrices"):
        AdamW(1e-3, 0.1, decayed="biases")
    with Runtime(here()) as rt:
        for eng in _engines(rt, tokens):
            with eng:
                first = eng.forward_backward(0)
                # the README's call before (keywords), the loose positional ones, a bare lr
                for use, said in (
                        (lambda: eng.step(0, lr=1e-3, weight_decay=0.0),
                         r"step\(0, lr=0.001, weight_decay=0.0\)"),
                        (lambda: eng.step(0, 1e-3, 0.0), r"step\(0, 0.001, 0.0\)"),
                        (lambda: eng.step(0, 1e-3), r"step\(0, 0.001\)"),
                        (lambda: eng.submit_step(0, 1e-3, 0.0, 1.0, keep_previous=False),
                         r"submit_step\(0, 0.001, 0.0, 1.0, keep_previous=False\)"),
                        (lambda: eng.submit_step(0, 1e-3), r"submit_step\(0, 0.001\)"),
                        (lambda: eng.submit_update(1e-3, 0.0), r"submit_update\(0.001, 0.0\)")):
                    with pytest.raises(StarpuLLMError, match=said + r": an update takes its "
                                       r"settings as one AdamW value: give AdamW\(lr=...\)"):
                        use()
                with pytest.raises(TypeError, match="positional"):   # not about the settings
                    eng.step(0, AdamW(1e-3), 0.0)
                assert eng.state.step == 0
                assert eng.step(0, AdamW(1e-3)) == first and eng.state.step == 1


def test_a_step_given_its_adamw_binds_no_arguments(monkeypatch):
    """step, submit_step and submit_update given an AdamW (step calls the other two) check
    it without binding the call's arguments to the signature (three bindings a step before:
    the check's own cost on every step); the loose calls still bind to name the mistake."""
    import inspect
    bound = []
    real = inspect.Signature.bind
    monkeypatch.setattr(inspect.Signature, "bind", lambda *a, **k: bound.append(1) or real(*a, **k))
    tokens = np.random.default_rng(0).integers(0, MODELS["tiny"].V, 100).astype(np.uint16)
    config = MODELS["tiny"]
    with ReferenceEngine(config, TrainState(config=config, params=random_init(config)), 2, 16,
                         tokens, threads=1) as eng:
        eng.step(0, AdamW(1e-3))
        eng.step(0, adamw=AdamW(1e-3))
        eng.submit_update(adamw=AdamW(1e-3))
        assert bound == []
        with pytest.raises(StarpuLLMError, match=r"step\(0, 0.001\): an update takes"):
            eng.step(0, 1e-3)
        assert bound


def test_an_engine_closed_or_whose_runtime_ended_refuses_to_run():
    """A StarPU engine used after close() or after its Runtime's end: one StarpuLLMError (the
    process aborted inside StarPU before: its data unregistered); close() twice is fine."""
    tokens = np.random.default_rng(0).integers(0, MODELS["tiny"].V, 100).astype(np.uint16)
    config = MODELS["tiny"]
    with Runtime(here()) as rt:
        eng = StarPUEngine(config, TrainState(config=config, params=random_init(config)), 2, 16,
                           tokens, rt)
        eng.step(0, AdamW(1e-3))
        eng.close()
        for use in (lambda: eng.step(0, AdamW(1e-3)), eng.logits, eng.sync,
                    lambda: eng.loss(), lambda: eng.forward_backward(0),
                    lambda: eng.submit_step(0, AdamW(1e-3), keep_previous=True)):
            with pytest.raises(StarpuLLMError, match="engine is closed"):
                use()
        eng.close()
        left = StarPUEngine(config, TrainState(config=config, params=random_init(config)), 2, 16,
                            tokens, rt)
        left.step(0, AdamW(1e-3))
    for use in (lambda: left.step(0, AdamW(1e-3)), left.logits):
        with pytest.raises(StarpuLLMError, match="runtime of this engine has been shut down"):
            use()
    left.close()
    with pytest.raises(StarpuLLMError, match="runtime is not running"):
        StarPUEngine(config, TrainState(config=config, params=random_init(config)), 2, 16,
                     tokens, rt)


DROPPED = """
import gc, numpy as np
from starpu_llm import MODELS, AdamW, Runtime, StarPUEngine, TrainState
from starpu_llm.model.state import random_init
from partitions import here
config = MODELS["tiny"]
tokens = np.random.default_rng(0).integers(0, config.V, 100).astype(np.uint16)
def engine(rt):
    return StarPUEngine(config, TrainState(config=config, params=random_init(config)), 2, 16,
                        tokens.copy(), rt)
rt = Runtime(here())
first = engine(rt).step(0, AdamW(1e-3))
for _ in range(6):      # a notebook's cell run again: each engine dropped, its steps running
    eng = engine(rt)
    eng.submit_step(0, AdamW(1e-3))
    eng.submit_step(0, AdamW(1e-3), keep_previous=True)
    gc.collect()
print(engine(rt).step(0, AdamW(1e-3)) == first)
kept = engine(rt)       # never closed, the runtime never shut down: the exit stops it
kept.step(0, AdamW(1e-3))
"""


def test_engines_dropped_unclosed_leave_their_tasks_memory_and_no_handle():
    """StarPU engines dropped without close() (a name bound again, steps still running), one
    left open at exit with its Runtime: their tasks finish on memory that is still there
    (freed under them before: a segfault), each dropped engine's handles are unregistered
    by the runtime (the next engine made, or its shutdown), and StarPU warns of no handle
    left registered (STARPU_SILENT=0 shows its warnings)."""
    import subprocess
    import sys
    env = {**os.environ, "STARPU_SILENT": "0",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__),
                                          os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", DROPPED], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert out.stdout.split() == ["True"], out.stdout
    assert "not unregistered" not in out.stderr, out.stderr


def test_without_the_compiled_part_the_import_says_how_to_build_it():
    """`from starpu_llm import TrainConfig` where the cffi binding does not load (not built,
    StarPU's library not found): one ImportError saying how to build it; the package and its
    file formats still import."""
    import subprocess
    import sys
    code = ("import sys; sys.modules['starpu_llm._clib'] = None\n"
            "import starpu_llm.io.formats\n"
            "try:\n    from starpu_llm import TrainConfig\n"
            "except ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "starpu_llm.TrainConfig needs the compiled part" in out.stdout, out.stdout
    assert "build it with `make`" in out.stdout, out.stdout


def test_a_face_variable_naming_no_face_is_an_error(monkeypatch):
    """STARPU_LLM_FACE set to a word that names no face: one error naming the variable (it
    was ignored); unset, or cffi, the cffi face."""
    from starpu_llm.runtime import starpupy_face
    monkeypatch.setenv("STARPU_LLM_FACE", "starpy")
    with pytest.raises(StarpuLLMError, match="STARPU_LLM_FACE='starpy': choose one of cffi, "):
        starpupy_face.resolve(None)
    monkeypatch.setenv("STARPU_LLM_FACE", "cffi")
    assert starpupy_face.resolve(None) == "cffi"
    monkeypatch.delenv("STARPU_LLM_FACE")
    assert starpupy_face.resolve(None) == "cffi"


def test_a_cpu_without_the_builds_instruction_sets_is_one_clear_error():
    """A build with -march=native records its instruction sets (starpu_llm._build.ISA, in
    /proc/cpuinfo's names); a CPU without one of them (a cluster's compute node unlike the
    login node that built it) is one error naming them and the build that runs anywhere,
    before a kernel dies of an illegal instruction. The build machine passes its own check:
    the recorded names are /proc/cpuinfo's."""
    from starpu_llm.kernels import cpu
    from starpu_llm._build import ISA
    cpu.check()                          # this machine built it
    flags = cpu.cpu_flags()
    if flags is not None:
        assert set(ISA.split()) <= flags, set(ISA.split()) - flags
    with pytest.raises(StarpuLLMError, match="with avx512f, avx512bw, which this CPU lacks") as e:
        cpu.check("avx2 fma avx512f avx512bw", {"avx2", "fma", "sse2"})
    assert "-Dnative=false" in str(e.value)
    cpu.check("", {"sse2"})              # built without -march=native: any CPU
    cpu.check("avx2", None)              # flags unknown (not Linux): no refusal


def test_a_stop_is_announced_before_the_run_ends(monkeypatch):
    """A signal inside the training loop: the loop learns of it (stop()) only once the
    watcher thread has announced it, so a run whose step takes milliseconds does not print
    its last lines, then the announcement (seen under load: the command's last line was the
    announcement)."""
    import time
    from starpu_llm import signals
    said = []

    def slow_say(text):             # a watcher thread descheduled under load
        time.sleep(0.3)
        said.append(text)
    monkeypatch.setattr(signals, "say", slow_say)
    with signals.StopOnSignal() as s, s.deferred(saves=False):
        os.kill(os.getpid(), signal.SIGUSR1)
        while s.signum is None:     # the handler has run; the watcher is still saying it
            time.sleep(0.001)
        assert s.stop(None) == signal.SIGUSR1
        assert said and "SIGUSR1: stopping after the step under way" in said[0], said


def test_the_cpu_check_comes_where_kernels_first_run(monkeypatch):
    """A build record naming an instruction set this CPU lacks: starting StarPU and making a
    reference engine (the two places kernels first run) are refused; the package, its pure
    Python names and --version's text are not (--version says what is missing)."""
    import starpu_llm._build as build
    from starpu_llm.cli import version_text
    from starpu_llm.kernels import cpu
    monkeypatch.setattr(build, "ISA", build.ISA + " nosuchisa")
    monkeypatch.setattr(cpu, "_passed", False)
    config = MODELS["tiny"]
    with pytest.raises(StarpuLLMError, match="which this CPU lacks"):
        Runtime(here())
    assert starpu_stopped()
    with pytest.raises(StarpuLLMError, match="nosuchisa"):
        ReferenceEngine(config, TrainState(config=config, params=random_init(config)), 2, 16,
                        np.zeros(100, np.uint16))
    assert "this CPU lacks nosuchisa: they cannot run here" in version_text()
