"""A run's whole state: parameters, AdamW moments, step and data position (save/restore)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .config import GPTConfig, ParamLayout


@dataclass
class TrainState:
    config: GPTConfig
    params: np.ndarray                  # flat float32, llm.c's layout
    m: np.ndarray = None                # AdamW first moment
    v: np.ndarray = None                # AdamW second moment
    grads: np.ndarray = None            # zero between steps (the update zeroes them)
    step: int = 0
    data: dict = field(default_factory=dict)   # the loader's state, e.g. {"position": ...}

    def __post_init__(self):
        n = ParamLayout(self.config).total
        assert self.params.dtype == np.float32 and self.params.size == n
        for name in ("m", "v", "grads"):
            if getattr(self, name) is None:
                setattr(self, name, np.zeros(n, np.float32))


def random_init(config: GPTConfig, seed: int = 1337) -> np.ndarray:
    """GPT-2 initialisation: N(0, 0.02) weights, residual projections scaled by 1/sqrt(2L),
    zero biases, unit layernorm gains; the padded rows of wte stay 0."""
    layout = ParamLayout(config)
    flat = np.zeros(layout.total, np.float32)
    views = layout.views(flat)
    rng = np.random.default_rng(seed)
    std = 0.02
    for name in ("wte", "wpe", "qkvw", "attprojw", "fcw", "fcprojw"):
        s = std / np.sqrt(2 * config.L) if name in ("attprojw", "fcprojw") else std
        a = views[name]
        a[...] = rng.standard_normal(a.shape, dtype=np.float32) * np.float32(s)
    views["wte"][config.V:] = 0.0
    for name in ("ln1w", "ln2w", "lnfw"):
        views[name][...] = 1.0
    return flat
