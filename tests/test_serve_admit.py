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
