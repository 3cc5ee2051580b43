"""HellaSwag's accuracy (io/hellaswag.py reads the examples): for each example the model reads
its 4 rows (context + ending), and the ending it finds likeliest is the one of lowest loss on
the ending's tokens: their mean cross-entropy for acc_norm (llm.c's and the usual GPT-2
figure, about 0.2955 for GPT-2 124M on the 10042 validation examples by llm.c's report), their
sum for acc. The rows go through the model B at a time, padded to T (the padding is scored by
no ending), on flow/losses.TokenLosses.

In training (--hellaswag FILE --hellaswag-every N), acc_norm is measured as the validation
loss is (validation.Evaluation): before the first update, every N steps and after the last,
recorded as "hellaswag_acc_norm" in the step's line and metrics row."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..errors import StarpuLLMError
from ..flow.generate import DirectBackend, StarPUBackend
from ..flow.losses import TokenLosses
from ..io import hellaswag, tokenizer
from .validation import Evaluation

DEFAULT_ROWS = 16      # rows a forward (4 examples) where no batch is given


class Score(NamedTuple):
    """How many examples were scored, and how many the model got right by the lowest total
    loss of the ending (acc) and by the lowest mean loss a token (acc_norm)."""
    examples: int
    correct: int
    correct_norm: int

    @property
    def acc(self) -> float:
        return self.correct / self.examples

    @property
    def acc_norm(self) -> float:
        return self.correct_norm / self.examples

    def describe(self) -> str:
        return (f"acc {self.acc:.4f} ({self.correct}/{self.examples}), acc_norm "
                f"{self.acc_norm:.4f} ({self.correct_norm}/{self.examples})")


def seq_len(config, examples) -> int:
    """T of the batches: the longest row, at most the model's maxT (io/hellaswag.py cuts the
    longer ones)."""
    return min(config.maxT, hellaswag.length(examples))


def ending_losses(examples, losses, B: int, T: int,
                  progress=None) -> tuple[np.ndarray, np.ndarray]:
    """(sums, counts), each (N, 4): the loss of each ending's tokens summed (float64) and
    their count, with losses(inputs, targets) -> (B, T) per-token losses (TokenLosses);
    progress(rows done, rows) after each batch when given."""
    rows = [(i, j, hellaswag.row(x.context, e, T))
            for i, x in enumerate(examples) for j, e in enumerate(x.endings)]
    sums = np.zeros((len(examples), hellaswag.ENDINGS))
    counts = np.zeros((len(examples), hellaswag.ENDINGS), np.int64)
    for first in range(0, len(rows), B):
        batch = rows[first:first + B]
        inputs = np.full((B, T), tokenizer.EOT_ID, np.int32)     # padding: scored by none
        targets = inputs.copy()
        for r, (_, _, row) in enumerate(batch):
            inputs[r, :len(row.tokens)] = row.tokens
            targets[r, :len(row.tokens) - 1] = row.tokens[1:]
        got = losses(inputs, targets)
        for r, (i, j, row) in enumerate(batch):
            sums[i, j] = got[r, row.start:row.start + row.n].sum(dtype=np.float64)
            counts[i, j] = row.n
        if progress:
            progress(first + len(batch), len(rows))
    return sums, counts


def score(examples, sums, counts) -> Score:
    """The Score of ending_losses' (sums, counts) (a tie goes to the first ending)."""
    labels = np.array([x.label for x in examples])
    return Score(len(examples), int((sums.argmin(1) == labels).sum()),
                 int(((sums / counts).argmin(1) == labels).sum()))


def evaluate(examples, backend, B: int = DEFAULT_ROWS, progress=None) -> Score:
    """The Score of the examples under the model of backend (generate.DirectBackend or
    StarPUBackend), B rows a forward (progress: ending_losses')."""
    T = seq_len(backend.config, examples)
    losses = TokenLosses(backend, B, T)
    try:
        return score(examples, *ending_losses(examples, losses, B, T, progress))
    finally:
        losses.close()


def read_examples(path: str, config, limit: int | None = None) -> list:
    """The examples of the file at path (its first `limit`), for a model of config: GPT-2's
    vocabulary, the text's tokens."""
    if config.V != tokenizer.N_VOCAB:
        raise StarpuLLMError(f"HellaSwag's text is read with the GPT-2 tokenizer: the model has "
                             f"a vocabulary of {config.V} tokens, not GPT-2's {tokenizer.N_VOCAB}")
    return hellaswag.read(path, tokenizer.gpt2(), limit)


class HellaSwag(Evaluation):
    """--hellaswag FILE: acc_norm of the model being trained on the file's first `limit`
    examples (None: all), every `every` steps, B rows a forward, on the training engine's own
    parameter tensors (its tasks read the parameter handles, after the updates that write
    them)."""

    key = "hellaswag_acc_norm"

    def __init__(self, path: str, config, every: int, limit: int | None, B: int):
        super().__init__(every)
        self.path, self.B = path, B
        self.examples = read_examples(path, config, limit)

    def measure(self, engine) -> float:
        backend = (StarPUBackend(engine.runtime, engine.config, p=engine.p)
                   if engine.name == "starpu" else DirectBackend(engine.config, p=engine.p))
        try:
            return evaluate(self.examples, backend, self.B).acc_norm
        finally:
            backend.close()

    def describe(self) -> str:
        return (f"hellaswag: {self.path}, {len(self.examples)} example(s), acc_norm at step 0, "
                f"every {self.every} step(s) and after the last")
