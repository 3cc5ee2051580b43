"""--sample-every: short samples printed while training, from the model being trained."""
from __future__ import annotations

import numpy as np

from ..errors import StarpuLLMError, opt
from ..flow.generate import Decoder, DirectBackend, StarPUBackend, generate
from ..io import tokenizer

SAMPLE_TOKENS = 64     # length of a sample


class TrainingSampler:
    """--sample-every: short samples from the model being trained, on the training engine's
    own parameter tensors (on the StarPU engine its tasks read the parameter handles, so StarPU
    runs them after the updates that write them), from <|endoftext|> (token 0 for a
    vocabulary other than GPT-2's, whose samples are shown as token ids)."""

    def __init__(self, engine, seed: int):
        config = engine.config
        if getattr(engine, "mpi", False):
            raise StarpuLLMError(f"{opt('sample_every')} is not available under mpirun "
                                 "(generation runs in one process)")
        backend = (StarPUBackend(engine.runtime, config, p=engine.p) if engine.name == "starpu"
                   else DirectBackend(config, p=engine.p))
        self.decoder = Decoder(backend, chunk=1)
        self.rng = np.random.default_rng(seed)
        self.tokenizer = tokenizer.gpt2() if config.V == tokenizer.N_VOCAB else None
        self.start = tokenizer.EOT_ID if self.tokenizer else 0
        self.length = min(SAMPLE_TOKENS, config.maxT - 1)

    def sample(self) -> str:
        ids = generate(self.decoder, [self.start], self.length, rng=self.rng)
        return self.tokenizer.decode(ids) if self.tokenizer else " ".join(map(str, ids))

    def close(self):
        self.decoder.backend.close()
