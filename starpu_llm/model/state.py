"""A run's whole state: parameters, AdamW moments, step and data position (save/restore).

The parameters, the two moments and the gradients are each a buffer of ParamLayout: a flat
numpy array, or, where a run must not hold them in its own memory (--memory-limit: StarPU
owns them and evicts them to disk), a `Slices`: values read one slice at a time (a block
tensor's layer, a row block of wte, a whole wpe, lnfw or lnfb; ParamLayout.slice_list), in
llm.c's order.
Before an engine takes them those are where the values come from (RandomInit, Zeros,
io.checkpoint's file regions); then the engine's own (flow/engine.py: its StarPU handles).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .config import PARAMETER_SPECS, GPTConfig, ParamLayout

_DISCARD_CHUNK = 1 << 22                       # floats drawn at once when skipping a slice


class Slices:
    """A ParamLayout buffer read one slice at a time, in llm.c's order (see the module)."""

    def __init__(self, config: GPTConfig):
        self.config = config
        self.layout = ParamLayout(config)

    def read_range(self, offset: int, out: np.ndarray) -> None:
        """Put the buffer's elements [offset, offset + out.size), a slice's (inside one tensor;
        ParamLayout.slice_list's), into out, a flat float32 array."""
        raise NotImplementedError

    def chunks(self):
        """Every slice's values, in llm.c's order, each a flat float32 array valid until the
        next one is asked for (one buffer of the largest slice, reused)."""
        slices = self.layout.slice_list()
        buf = np.empty(max(math.prod(shape) for _, _, shape in slices), np.float32)
        for _, offset, shape in slices:
            out = buf[:math.prod(shape)]
            self.read_range(offset, out)
            yield out


def chunks(values, layout: ParamLayout):
    """A ParamLayout buffer's values in llm.c's order: a numpy array whole (flat), a Slices
    slice by slice (Slices.chunks)."""
    if isinstance(values, np.ndarray):
        yield values.reshape(-1)
    else:
        yield from values.chunks()


def read_slice_into(values, offset: int, out: np.ndarray) -> None:
    """The slice at offset of a ParamLayout buffer (a numpy array or a Slices; its size out's,
    ParamLayout.slice_list) into out (flat)."""
    if isinstance(values, np.ndarray):
        out[...] = values.reshape(-1)[offset:offset + out.size]
    else:
        values.read_range(offset, out)


class Zeros(Slices):
    """A buffer of zeros (fresh moments, gradients)."""

    def read_range(self, offset, out):
        out[...] = 0.0


class RandomInit(Slices):
    """GPT-2's initialisation (random_init), drawn slice by slice: N(0, 0.02) weights,
    residual projections N(0, 0.02/sqrt(2L)), zero biases, unit layernorm gains, the padded
    rows of wte 0. One random stream in llm.c's order (a random tensor's elements drawn in
    turn), so slices are read in that order; what lies between two slices read (another
    rank's) is drawn and thrown away, as the stream must go past it."""

    def __init__(self, config: GPTConfig, seed: int = 1337):
        super().__init__(config)
        self.rng = np.random.default_rng(seed)
        self.next = 0                   # the first element not drawn yet

    def read_range(self, offset, out):
        if offset < self.next:
            raise ValueError(f"RandomInit reads its slices in llm.c's order: element {offset} "
                             f"was passed")
        layout = self.layout
        for name in layout.names:        # the tensors between, drawn and thrown away
            start = layout.offsets[name]
            a, e = max(start, self.next), min(start + math.prod(layout.shapes[name]), offset)
            if a < e:
                self._discard(name, e - a)
        name = next(n for n in layout.names
                    if layout.offsets[n] <= offset < layout.offsets[n] + math.prod(layout.shapes[n]))
        self._draw(name, out, offset - layout.offsets[name])
        self.next = offset + out.size

    def _std(self, name):
        """The standard deviation of a random tensor's elements; None for a constant one."""
        init = PARAMETER_SPECS[name].init
        if init == "residual":
            return np.float32(0.02 / np.sqrt(2 * self.config.L))
        return np.float32(0.02) if init == "normal" else None

    def _draw(self, name, out, at):
        """out: name's elements from its at-th on."""
        std = self._std(name)
        if std is not None:
            self.rng.standard_normal(out=out, dtype=np.float32)
            out *= std
        else:
            out[...] = 1.0 if PARAMETER_SPECS[name].init == "ones" else 0.0
        if name == "wte":               # the padded rows (from row V on) in this range
            C = self.config.C
            out[max(self.config.V * C - at, 0):] = 0.0

    def _discard(self, name, n):
        if self._std(name) is None:
            return
        scratch = np.empty(min(n, _DISCARD_CHUNK), np.float32)
        for start in range(0, n, scratch.size):
            self.rng.standard_normal(out=scratch[:min(scratch.size, n - start)], dtype=np.float32)


@dataclass
class TrainState:
    """A model being trained: its configuration, the flat float32 parameters (llm.c's
    layout, ParamLayout), the AdamW moments and gradients, the step done, and the data
    position (what a checkpoint's .state holds)."""
    config: GPTConfig
    params: np.ndarray | Slices         # flat float32, llm.c's layout
    m: np.ndarray | Slices = None       # AdamW first moment
    v: np.ndarray | Slices = None       # AdamW second moment
    grads: np.ndarray | Slices = None   # zero between steps (the update zeroes them)
    step: int = 0
    data: dict = field(default_factory=dict)   # the loader's state, e.g. {"position": ...}

    def __post_init__(self):
        if isinstance(self.params, Slices):
            for name in ("m", "v", "grads"):
                if getattr(self, name) is None:
                    setattr(self, name, Zeros(self.config))
            return
        n = ParamLayout(self.config).total
        assert self.params.dtype == np.float32 and self.params.size == n
        for name in ("m", "v", "grads"):
            if getattr(self, name) is None:
                setattr(self, name, np.zeros(n, np.float32))


def random_init(config: GPTConfig, seed: int = 1337) -> np.ndarray:
    """GPT-2 initialisation (RandomInit) into one flat array."""
    layout = ParamLayout(config)
    flat = np.zeros(layout.total, np.float32)
    init = RandomInit(config, seed)
    for _, offset, shape in layout.slice_list():
        init.read_range(offset, flat[offset:offset + math.prod(shape)])
    return flat
