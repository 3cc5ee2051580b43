"""serve/engine.Engine._admit on its own (no thread, no model): the slots it counts free stay
those no sequence holds, whatever a client's cancel does while a request leaves the queue."""
from starpu_llm.model.config import GPTConfig
from starpu_llm.io import tokenizer
from starpu_llm.serve.engine import Engine, Request, Sampling, _Tally


class _OneGroup:
    def group_of(self, slot):
        return 0


class _CancelledAsItLeaves(Request):
    """Its client cancels between the engine's first and second look at `cancelled` (the
    event loop thread runs Request.cancel while the engine thread admits it)."""

    def __init__(self, *a, **k):
        self.looks = 0
        super().__init__(*a, **k)

    @property
    def cancelled(self):
        self.looks += 1
        return self.looks > 1

    @cancelled.setter
    def cancelled(self, value):
        pass


def test_a_request_cancelled_as_it_is_admitted_keeps_the_free_slots_counted():
    config = GPTConfig(max_seq_len=64, num_layers=1, num_heads=1, channels=8)
    events = []
    engine = Engine(None, config, tokenizer.gpt2(), tokenizer.EOT_ID, max_batch=2)
    engine.decoder = _OneGroup()
    req = _CancelledAsItLeaves([1, 2], Sampling(), events.append)
    req.tally = _Tally(1, 0.0)
    engine._queue.append(req)
    engine._admit()
    # a slot counted taken is a slot a sequence holds (else the server's room shrinks for good)
    assert engine._free == engine.max_batch - len(engine._running)


def test_the_draw_takes_the_loaded_models_cores_with_starpu_paused(monkeypatch):
    """The engine draws a step's tokens on the cores the model was loaded on (Loaded.cores:
    the partition's N x K for StarPU, the reference engine's threads), not on every core of
    the machine, and with StarPU paused (Loaded.paused: its idle workers would spin on those
    cores)."""
    import contextlib
    import threading
    import numpy as np
    from starpu_llm.flow import generate as gen
    from starpu_llm.model.state import random_init
    from starpu_llm.serve import scoring
    from starpu_llm.serve.engine import Loaded
    config = GPTConfig(max_seq_len=32, num_layers=1, num_heads=2, channels=16, vocab_size=64,
                       padded_vocab_size=64)
    seen, pausing = [], []
    real = scoring.sample_batch

    def sample_batch(*a, **k):
        seen.append((a[5] if len(a) > 5 else k.get("threads"), bool(pausing)))
        return real(*a, **k)

    @contextlib.contextmanager
    def paused():
        pausing.append(1)
        try:
            yield
        finally:
            pausing.pop()
    monkeypatch.setattr(scoring, "sample_batch", sample_batch)

    def load():
        backend = gen.DirectBackend(config, random_init(config), threads=1)
        return Loaded(backend, 1, paused, backend.close, "test", cores=3)
    engine = Engine(load, config, tokenizer.gpt2(), None, max_batch=2)
    engine.start(timeout=60)
    done = threading.Event()
    engine.submit([Request([1, 2, 3], Sampling(max_tokens=3, top_p=0.9),
                           lambda ev: ev.finish and done.set(), np.random.default_rng(0))])
    assert done.wait(60)
    engine.drain(5)
    assert seen and set(seen) == {(3, True)}
