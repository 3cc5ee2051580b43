"""What a run measures of its model as it trains (Evaluation): the validation loss, the mean
loss over fixed batches of a validation shard computed by forward-only task flows
(Engine.validation_loss); HellaSwag's accuracy (hellaswag.py)."""
from __future__ import annotations

from ..errors import StarpuLLMError, opt
from ..io import data


class Evaluation:
    """A measure of the model (measure(engine), recorded under `key` in the step's line and
    metrics row) taken before the first update (step 0), every `every` steps and after the
    last step."""

    key = "?"

    def __init__(self, every: int):
        self.every = every

    def measure(self, engine) -> float:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def due_first(self, step: int) -> bool:
        """Whether a run that starts at update `step` first measures the weights it starts
        from: at step 0 (llm.c's and nanoGPT's step 0), not when it resumes one saved later
        (that run measured them then: an exact resume repeats nothing, its records the whole
        run's)."""
        return step == 0

    def due(self, step: int, last: bool) -> bool:
        """Whether to measure after update `step` (1-based); last: the run's last step."""
        return self.every > 0 and (step % self.every == 0 or last)


class Validation(Evaluation):
    """The first `batches` (B, T) batches of the shards at path (a shard or a glob pattern:
    io/data.DataLoader, in its order; all they have when they have fewer), the same at every
    evaluation."""

    key = "val_loss"

    def __init__(self, path: str, B: int, T: int, vocab_size: int, every: int, batches: int):
        if every < 0:
            raise StarpuLLMError(f"{opt('val_every')} must be >= 0 (0: no validation), got {every}")
        super().__init__(every)
        self.path = path
        self.loader = data.DataLoader(path, B, T, vocab_size=vocab_size)
        self.batches = min(batches, self.loader.num_batches)    # an epoch's at most
        self.tokens = [self.loader.next_tokens() for _ in range(self.batches)]   # views

    def measure(self, engine) -> float:
        return self.loss(engine)

    def loss(self, engine) -> float:
        return engine.validation_loss(None, self.tokens)

    def describe(self) -> str:
        return (f"validation: {self.loader.describe()}, {self.batches} batch(es) at step 0, every "
                f"{self.every} step(s) and after the last")
