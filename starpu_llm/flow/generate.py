"""Text generation: GPT-2 forward-only with a key/value cache, as a task flow.

A Decoder runs B sequences through the model a few positions at a time, all at the same
position: a batch.SlotDecoder of B slots, one per sequence (the keys and values of every
position processed so far, per layer, and one set of forward buffers shared by the layers;
created once, as StarPU handles on the StarPU engine, numpy arrays on the reference engine,
and reused by every step). A step takes the new positions of every sequence through every
block with the training block's own code (batch.decode_step); its attention appends the new
keys and values to the cache and lets each new query attend to the cached positions before
it. A new token thus costs one position of every layer, not the whole prefix. The prompt goes
in as steps of up to `chunk` positions, the last of which ends with the final layernorm and
the lm head on its last position, which give the logits of the next token; so does each
sampled token, a step of one position. Sequences at different positions, coming and going,
are batch.SlotDecoder's (serving).

Recompute is the same model without a cache: the training forward (taskflow.forward) over the
whole sequence for every new token, the tests' oracle and the benchmark's baseline
(experiments/generation_speed.py). Sampling is done here, from the logits of the last
position: the greedy rows in numpy, the drawn ones in C (sample_batch).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._kernels import ffi, lib as kernels
from ..kernels.codelets import DirectOps
from ..model.config import ParamLayout
from ..errors import StarpuLLMError, opt
from ..plan.settings import check_fields, setting
from ..runtime.cpus import core_cpus
from ..runtime.submit import StarPUOps
from . import taskflow
from .batch import Feed, SlotDecoder
from .engine import read_tensor, write_tensor
from .handles import Handles
from .tensors import ActivationTensors, ParameterTensors, Tensor

DEFAULT_CHUNK = 64     # prompt positions per prefill step


@dataclass(frozen=True)
class Generating:
    """A generation's settings, each stated here once with its default and its rule: cli.py
    makes `starpu-llm generate`'s flags of them, run_generate's and generate()'s keywords
    default to them, check_request holds a Python caller's values to the same rules, and the
    server's temperature and top_p keep them too (serve/api.py). The sampling's defaults leave
    the model's distribution as it is (temperature 1, no top-k or top-p cut)."""
    max_new_tokens: int = setting(64, "tokens to generate (default %(default)s); prompt + new "
                                  "tokens <= the model's maxT", check="positive")
    # the sampling (sample)
    temperature: float = setting(1.0, "softmax temperature (default %(default)g; 0: greedy)",
                                 check="nonneg")
    top_k: int = setting(0, "sample among the K most likely tokens (default %(default)s: all; "
                         "1: greedy)", check="nonneg_int", metavar="K")
    top_p: float = setting(1.0, "nucleus sampling: among the most likely tokens whose "
                           "probabilities add up to P (default %(default)g: all), after --top-k",
                           check="probability", metavar="P")
    seed: int = setting(1337, "seed of the sampling (default %(default)s)", check="nonneg_int")


# ---- where the tensors live and how the tasks run (one backend per engine)

class DirectBackend:
    """The reference engine's side of generation: numpy tensors, the kernels called at once in
    this thread (reference.DirectOps). Parameters: `params` (a flat ParamLayout buffer) or
    an engine's ParameterTensors `p`."""

    def __init__(self, config, params=None, p=None, threads: int | None = None):
        if threads:
            kernels.kernels_set_threads(threads)
        self.threads = kernels.kernels_threads()    # this thread's (the kernels' team)
        self.config, self.ops = config, DirectOps()
        self.p = p if p is not None else ParameterTensors.of_arrays(
            "param", ParamLayout(config), params)

    def tensor(self, name, shape, dtype=np.float32) -> Tensor:
        return Tensor(name, shape, dtype, array=np.zeros(shape, dtype))

    def read(self, t, rows: int | None = None, cols: int | None = None) -> np.ndarray:
        """A copy of t (its first rows and cols only, when given)."""
        return (t.array if rows is None and cols is None else t.array[:rows, :cols]).copy()

    def write(self, t, values):
        """values into the first values.size elements of t."""
        values = np.asarray(values, t.dtype).reshape(-1)
        t.array.reshape(-1)[:values.size] = values

    def sync(self):
        """Every kernel called has run (they run at once here)."""

    def scratch(self) -> "DirectBackend":
        """A backend for temporary tensors over the same parameters (close() releases them)."""
        return DirectBackend(self.config, p=self.p)

    def close(self):
        pass


class StarPUBackend:
    """The StarPU engine's side of generation: every tensor a StarPU handle on our memory,
    registered once (its own Handles), every layer a task (runtime.submit.StarPUOps). Parameters:
    `params` (registered here) or the training engine's ParameterTensors `p`."""

    def __init__(self, runtime, config, params=None, p=None):
        if not runtime.running:
            raise RuntimeError("the StarPU runtime is not running")
        if runtime.size > 1:
            raise StarpuLLMError("generation runs in one process: it is not available under mpirun")
        self.runtime, self.config, self.ops = runtime, config, StarPUOps()
        self.handles = Handles(runtime, config, owner=self)
        self.p = p if p is not None else self.handles.parameter_tensors(
            "param", ParamLayout(config), params)
        self.write = write_tensor

    def tensor(self, name, shape, dtype=np.float32) -> Tensor:
        return self.handles.tensor(name, shape, dtype)

    def read(self, t, rows: int | None = None, cols: int | None = None) -> np.ndarray:
        """A copy of t (its first rows and cols only, when given) after the tasks submitted."""
        self.runtime.wait()     # the whole step, which also frees its tasks' arguments
        return read_tensor(t, rows, cols)

    def sync(self):
        """Every task submitted has run."""
        self.runtime.wait()

    def scratch(self) -> "StarPUBackend":
        """A backend for temporary tensors over the same parameters (close() unregisters them)."""
        return StarPUBackend(self.runtime, self.config, p=self.p)

    def close(self):
        self.handles.unregister_all()


# ---- the decode flow

def _batch(tokens, B: int, V: int) -> np.ndarray:
    """tokens as a (B, n) int32 array, n >= 1, of ids in [0, V)."""
    tokens = np.asarray(tokens, np.int64).reshape(B, -1)
    if tokens.shape[1] == 0:
        raise ValueError("no tokens to feed")
    if tokens.min() < 0 or tokens.max() >= V:
        raise StarpuLLMError(f"token ids must be in [0, {V}), the model's vocabulary; got "
                             f"{tokens.min()}..{tokens.max()}")
    return tokens.astype(np.int32)


def _check_positions(config, n: int):
    if n > config.maxT:
        raise StarpuLLMError(f"{n} positions exceed the model's maximum sequence length "
                             f"(maxT = {config.maxT})")


class Decoder:
    """B sequences through the model with a key/value cache (see the module docstring): a
    feed of n tokens costs n positions, whatever came before. Tensors are made by `backend`
    once, here."""

    def __init__(self, backend, B: int = 1, chunk: int = DEFAULT_CHUNK):
        cfg = self.config = backend.config
        self.backend, self.B = backend, B
        self.chunk = max(1, min(chunk, cfg.maxT))
        self.slots = SlotDecoder(backend, B, rows=B * self.chunk)
        self.pos = 0    # positions in the cache

    def reset(self):
        """Start new sequences (the new positions overwrite the cache's old ones)."""
        self.pos = 0

    def feed(self, tokens) -> np.ndarray:
        """Appends tokens (B, n) to the sequences; returns the (B, V) logits of the next token."""
        tokens = _batch(tokens, self.B, self.config.V)
        n = tokens.shape[1]
        _check_positions(self.config, self.pos + n)
        for s in range(0, n, self.chunk):       # the last step ends with the lm head
            e = min(s + self.chunk, n)
            logits = self.slots.step([Feed(b, self.pos, tokens[b, s:e], e == n)
                                      for b in range(self.B)])
            self.pos += e - s
        return logits


class Recompute:
    """The same model without a cache: each feed runs the training forward (taskflow.forward)
    over the whole sequence so far, on tensors made for its length and released after it."""

    def __init__(self, backend, B: int = 1):
        self.backend, self.config, self.B = backend, backend.config, B
        self.reset()

    def reset(self):
        self.sequence = np.zeros((self.B, 0), np.int32)

    def feed(self, tokens) -> np.ndarray:
        """Appends tokens (B, n) to the sequences; returns the (B, V) logits of the next token."""
        seq = np.concatenate([self.sequence, _batch(tokens, self.B, self.config.V)], axis=1)
        B, T = seq.shape
        _check_positions(self.config, T)
        scratch = self.backend.scratch()
        try:
            a = ActivationTensors.create(self.config, B, T, scratch.tensor)
            scratch.write(a.inputs, seq)
            scratch.write(a.targets, np.zeros_like(seq))    # the loss is computed, not used
            taskflow.forward(scratch.ops, self.config, scratch.p, a, B, T)
            logits = scratch.read(a.logits)[:, -1, :self.config.V]
        finally:
            scratch.close()
        self.sequence = seq
        return logits


# ---- sampling

def sample(logits, temperature: float, top_k: int, rng, top_p: float = 1.0) -> int:
    """A token id from one row of logits: the argmax when top_k is 1 or temperature 0
    (greedy); else drawn with rng (a numpy Generator) from softmax(logits / temperature) over
    the top_k largest logits (top_k 0: all; ties by id), and of those, with top_p < 1, over
    the most likely ones whose probabilities add up to top_p (nucleus sampling: the fewest
    tokens, taken in decreasing probability, ties by id, whose sum reaches top_p).
    sample_batch's row."""
    token = sample_batch(np.asarray(logits)[None], [temperature], [top_k], [rng], [top_p])[0]
    if token < 0:
        raise ValueError("the logits are not all finite: no token can be drawn")
    return int(token)


def sample_batch(logits, temperature, top_k, rngs, top_p,
                 threads: int | None = None) -> np.ndarray:
    """sample() of every row of logits (M, V) (float32 or float64) at once, row i with
    temperature[i], top_k[i], top_p[i] and its generator rngs[i] (one uniform draw per row
    that is not greedy, in row order, as Generator.choice makes): the (M,) token ids, -1 for
    a row whose logits are not all finite. The greedy rows here, the drawn ones in C
    (kernels.h sample_rows: a row a thread, on `threads` threads, default this process's
    cores); each row's token depends on that row alone."""
    x = np.asarray(logits)
    if x.dtype != np.float64:
        x = np.asarray(x, np.float32)
    x = np.ascontiguousarray(x)
    M, V = x.shape
    temperature = np.asarray(temperature, np.float64)
    top_k, top_p = np.asarray(top_k, np.int64), np.asarray(top_p, np.float64)
    finite = np.isfinite(x).all(axis=1)     # (16 rows of GPT-2's: 0.06 ms; a float64 sum 0.25)
    drawn = finite & (top_k != 1) & (temperature != 0)
    tokens = np.full(M, -1, np.int64)
    greedy = np.flatnonzero(finite & ~drawn)
    tokens[greedy] = np.argmax(x, axis=1)[greedy]     # every row's: no copy of the rows
    r = np.flatnonzero(drawn)
    if r.size == 0:
        return tokens
    u = np.array([rngs[i].random() for i in r])
    out = np.empty(r.size, np.int64)
    t, k, P = (np.ascontiguousarray(a[r]) for a in (temperature, top_k, top_p))
    f32 = x.dtype == np.float32
    kernels.sample_rows(_ptr(out, "int64_t"), _ptr(x, "float") if f32 else ffi.NULL,
                        ffi.NULL if f32 else _ptr(x, "double"), V, _ptr(r, "int64_t"),
                        r.size, V, _ptr(t, "double"), _ptr(k, "int64_t"), _ptr(P, "double"),
                        _ptr(u, "double"), threads or len(core_cpus()))
    if (out == -2).any():
        raise MemoryError(f"sampling: no memory for the scratch of {V} logits a thread")
    tokens[r] = out
    return tokens


def _ptr(a, ctype):
    return ffi.cast(f"{ctype} *", ffi.from_buffer(a))


def check_request(config, prompt_len: int, max_new_tokens: int, temperature: float, top_k: int,
                  top_p: float = Generating.top_p):
    """A clear error for a generation this model cannot do: the settings' rules are
    Generating's (check_fields), the sequence must fit the model."""
    if prompt_len < 1:
        raise StarpuLLMError("generation needs a prompt of at least one token")
    check_fields(Generating(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                            top_p=top_p))
    total = prompt_len + max_new_tokens
    if total > config.maxT:
        raise StarpuLLMError(
            f"the prompt ({prompt_len} tokens) + {opt('max_new_tokens')} {max_new_tokens} = "
            f"{total} tokens exceed the model's maximum sequence length (maxT = {config.maxT}); "
            f"shorten the prompt or lower {opt('max_new_tokens')}")


def generate(model, prompt, max_new_tokens: int, temperature: float = Generating.temperature,
             top_k: int = Generating.top_k, rng=None, on_token=None, top_p: float = Generating.top_p) -> list[int]:
    """Continues one sequence, prompt (token ids), by max_new_tokens tokens sampled from
    `model` (a Decoder, or Recompute) with rng (default: a fresh numpy Generator); each token
    goes to on_token as soon as it is drawn. Returns the new tokens."""
    prompt = [int(t) for t in prompt]
    check_request(model.config, len(prompt), max_new_tokens, temperature, top_k, top_p)
    rng = rng if rng is not None else np.random.default_rng()
    model.reset()
    logits = model.feed([prompt])[0]
    out = []
    while True:
        token = sample(logits, temperature, top_k, rng, top_p)
        out.append(token)
        if on_token is not None:
            on_token(token)
        if len(out) == max_new_tokens:
            return out
        logits = model.feed([[token]])[0]
