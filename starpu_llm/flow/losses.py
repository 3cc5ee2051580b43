"""Each token's loss under the model, for batches given as arrays (HellaSwag's rows): the
training forward (taskflow.forward, the same tasks as a step's) on one set of activations,
made once on a generation backend (generate.DirectBackend or StarPUBackend, the engines' sides)
and reused by every batch. Forward only: the parameters are read, nothing else is touched."""
from __future__ import annotations

import numpy as np

from ..model.config import check_batch_shape
from . import taskflow
from .tensors import ActivationTensors


class TokenLosses:
    """losses(inputs, targets): the (B, T) cross-entropies -log p(targets[b, t] | inputs[b,
    :t + 1]) of a (B, T) batch, on backend's parameters (its temporary tensors: close()
    releases them)."""

    def __init__(self, backend, B: int, T: int):
        check_batch_shape(backend.config, B, T)
        self.B, self.T, self.config = B, T, backend.config
        self.backend = backend.scratch()
        self.a = ActivationTensors.create(self.config, B, T, self.backend.tensor)

    def __call__(self, inputs, targets) -> np.ndarray:
        inputs, targets = (np.asarray(x, np.int32) for x in (inputs, targets))
        if inputs.shape != (self.B, self.T) or targets.shape != (self.B, self.T):
            raise ValueError(f"a batch of {self.B} x {self.T} tokens, got inputs "
                             f"{inputs.shape} and targets {targets.shape}")
        if min(inputs.min(), targets.min()) < 0 or max(inputs.max(), targets.max()) >= self.config.V:
            raise ValueError(f"token ids must be in [0, {self.config.V}): the kernels index "
                             f"wte and the probabilities with them")
        b, a = self.backend, self.a
        b.write(a.inputs, inputs)
        b.write(a.targets, targets)
        taskflow.forward(b.ops, self.config, b.p, a, self.B, self.T)
        return b.read(a.losses)

    def close(self):
        self.backend.close()
