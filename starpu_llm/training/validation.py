"""Validation during training: the mean loss over fixed batches of a validation shard,
computed by forward-only task flows (Engine.validation_loss)."""
from __future__ import annotations

from ..errors import StarpuLLMError, opt
from ..io import data


class Validation:
    """The first `batches` (B, T) batches of the shard at path (all it has when it has fewer),
    the same at every evaluation; every `every` steps and after the last step."""

    def __init__(self, path: str, B: int, T: int, vocab_size: int, every: int, batches: int):
        if every < 0:
            raise StarpuLLMError(f"{opt('val_every')} must be >= 0 (0: no validation), got {every}")
        self.path, self.every = path, every
        self.loader = data.DataLoader(path, B, T, vocab_size=vocab_size)
        self.batches = min(batches, self.loader.num_batches)
        self.positions = [self.loader.next_position() for _ in range(self.batches)]

    def due(self, step: int, last: bool) -> bool:
        """Whether to validate after update `step` (1-based); last: the run's last step."""
        return self.every > 0 and (step % self.every == 0 or last)

    def loss(self, engine) -> float:
        return engine.validation_loss(self.loader.tokens, self.positions)

    def describe(self) -> str:
        return (f"validation: {self.path}, {self.batches} batch(es) every {self.every} step(s) "
                f"and after the last")
