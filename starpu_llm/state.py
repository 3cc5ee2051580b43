"""A run's whole state: parameters, AdamW moments, step and data position (save/restore)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .config import PARAMETERS, GPTConfig, ParamLayout


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
    std = {"normal": 0.02, "residual": 0.02 / np.sqrt(2 * config.L)}
    for p in PARAMETERS:          # the random ones drawn in llm.c's order
        a = views[p.name]
        if p.init in std:
            a[...] = rng.standard_normal(a.shape, dtype=np.float32) * np.float32(std[p.init])
        elif p.init == "ones":
            a[...] = 1.0
    views["wte"][config.V:] = 0.0
    return flat
