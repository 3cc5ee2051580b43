"""What the two PyTorch models share: llm.c's parameter layout as numpy views, the engines'
batches, and the timed training loop of the bench."""
from __future__ import annotations

import time

import numpy as np

from ..model.config import AdamW, GPTConfig, ParamLayout

LN_EPS = 1e-5


def param_views(config: GPTConfig, flat_params: np.ndarray) -> tuple[ParamLayout, dict]:
    """llm.c's flat parameter buffer as {name: numpy view} (per-layer tensors stacked (L, ...))."""
    layout = ParamLayout(config)
    flat = np.asarray(flat_params, dtype=np.float32)
    assert flat.size == layout.total, f"{flat.size} parameters, the layout has {layout.total}"
    return layout, layout.views(flat)


def batch(tokens: np.ndarray, pos: int, B: int, T: int):
    """The (inputs, targets) the engines read at token position pos (llm.c's loader)."""
    buf = np.asarray(tokens[pos:pos + B * T + 1], dtype=np.int64)
    return buf[:-1].reshape(B, T), buf[1:].reshape(B, T)


def step_times(model, tokens: np.ndarray, B: int, T: int, steps: int, lr: float) -> list[float]:
    """Milliseconds of each of `steps` training steps (forward, backward, AdamW without weight
    decay) of model (a model with adamw_step) on consecutive batches."""
    ms = []
    for i in range(steps):
        x, y = batch(tokens, i * B * T, B, T)
        t0 = time.perf_counter()
        model.adamw_step(x, y, AdamW(lr))
        ms.append((time.perf_counter() - t0) * 1e3)
    return ms
