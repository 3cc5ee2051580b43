"""The training step both engines run: the batch split into sub-batches, the task flow
(taskflow.py) over each (over each micro-batch of a gradient accumulation in turn), the
update, the loss.

An engine is where a run's tensors live and how each task of the flow is executed: the StarPU
engine (engine.py) registers every tensor as a StarPU data handle and submits the flow as
tasks; the reference engine (reference.py) keeps numpy arrays and calls the same kernels in a
plain loop (the paper's baseline). Both run this step, so they execute the same layers in the
same order.
"""
from __future__ import annotations

import collections
import functools
import inspect
from typing import NamedTuple

import numpy as np

from . import taskflow
from .._kernels import ffi
from ..model.config import AdamW, GPTConfig, ParamLayout, check_batch_shape
from ..errors import StarpuLLMError, opt
from ..model.state import TrainState
from .tensors import Tensor


class Submitted(NamedTuple):
    """A step submitted (Engine.submit_step): the update it makes (1-based), the tensors its
    loss (each sub-batch's losses, summed over its micro_batches) and its gradient norm (the
    norm tree's root; None without clipping) are read from."""
    step: int
    losses: list
    norm: Tensor | None
    micro_batches: int = 1


def micro_positions(positions) -> list:
    """Each micro-batch of a step: its token position in the engine's data (an int), or its
    own B*T+1 tokens (a 1-D uint16 array: DataLoader.next_tokens, a view into its shard);
    one (no accumulation) or a sequence of them (gradient accumulation: the data loader's
    next ones)."""
    if isinstance(positions, (int, np.integer)):
        return [int(positions)]
    if isinstance(positions, np.ndarray) and positions.dtype == np.uint16:
        return [positions]              # a batch's tokens: ids are uint16, positions are not
    out = [p if isinstance(p, np.ndarray) else int(p) for p in positions]
    if not out:
        raise StarpuLLMError("a step needs the position of at least one micro-batch")
    return out


def token_pointer(tokens, what: str = "the data"):
    """The address the load tasks read tokens at, as uint16 ids one after the other: tokens
    must be a 1-D C-contiguous numpy uint16 array (a shard's memmap, DataLoader.tokens); any
    other array's bytes would be read as other ids (an int64 array: 3 zeros a token), or
    past its end."""
    if (not isinstance(tokens, np.ndarray) or tokens.dtype != np.uint16 or tokens.ndim != 1
            or not tokens.flags.c_contiguous):
        got = (f"a {tokens.ndim}-D {tokens.dtype} array"
               + ("" if tokens.flags.c_contiguous else ", not contiguous")
               if isinstance(tokens, np.ndarray) else type(tokens).__name__)
        raise StarpuLLMError(f"{what}: the load tasks read a 1-D contiguous numpy uint16 array of "
                             f"token ids, got {got}: give DataLoader(tokens, B, T, "
                             f"config.V).tokens (io/data.py), which checks and converts it")
    return ffi.cast("const uint16_t *", ffi.from_buffer(tokens))


def check_positions(positions, tokens: np.ndarray, B: int, T: int, V: int,
                    what: str = "the data"):
    """Each batch of B x T tokens at one of positions lies inside tokens: it reads B x T + 1
    tokens from its position (the inputs, and the targets one token on); the load tasks read
    the shard as it is, so a position past its end would read other memory, and an id >= V
    (an array not checked by DataLoader) a row past wte's and a probability past the
    logits'."""
    need = B * T + 1
    if getattr(tokens, "filename", None):         # a shard memory-mapped (formats.read_shard)
        what = f"{what} ({tokens.filename})"
    for pos in positions:
        if not 0 <= pos <= len(tokens) - need:
            where = (f"give a position from 0 to {len(tokens) - need}" if len(tokens) >= need
                     else f"it needs {need}: give more data, or a smaller {opt('batch')} or "
                          f"{opt('seq_len')}")
            raise StarpuLLMError(f"position {pos}: a batch of {B} x {T} reads {need} tokens from "
                                 f"its position, and {what} holds {len(tokens)}: {where}")
        top = int(tokens[pos:pos + need].max())
        if top >= V:
            raise StarpuLLMError(f"position {pos}: {what} holds token id {top} there, but the "
                                 f"vocabulary has {V} ids (0..{V - 1}): give tokens made with "
                                 f"this model's tokenizer")


def _takes_adamw(method):
    """An Engine method that takes an update's settings as one AdamW value (model/config.py):
    a call without one, in the loose arguments these methods took before (step(pos, lr=1e-4,
    weight_decay=0.0), step(pos, 1e-4, 0.0), a bare learning rate), is one clear error before
    any task, not a TypeError about arguments or a failure inside the update."""
    signature = inspect.signature(method)
    at = list(signature.parameters).index("adamw")     # its place among the arguments (self 0)

    @functools.wraps(method)
    def checked(*args, **kw):
        # the call as documented (step calls submit_step calls submit_update: every step):
        # no binding of the arguments
        if isinstance(args[at] if len(args) > at else kw.get("adamw"), AdamW):
            return method(*args, **kw)
        try:
            adamw = signature.bind(*args, **kw).arguments.get("adamw")
        except TypeError:
            if any(isinstance(a, AdamW) for a in (*args, *kw.values())):
                raise               # another mistake: Python's own message says it
            adamw = None
        if not isinstance(adamw, AdamW):
            given = ", ".join([*map(repr, args[1:]), *(f"{k}={v!r}" for k, v in kw.items())])
            raise StarpuLLMError(f"{method.__name__}({given}): an update takes its settings as "
                                 f"one AdamW value: give AdamW(lr=...) (starpu_llm.AdamW: lr, "
                                 f"weight_decay, decayed, betas, grad_clip, eps)")
        return method(*args, **kw)
    return checked


class Engine:
    """The per-step orchestration shared by both engines, made with config (GPTConfig), state
    (TrainState: its flat float32 arrays trained in place), B x T the batch, tokens (the
    training data: a 1-D uint16 array of token ids < V, DataLoader.tokens; a step's position
    is a token offset into it; None: each step gives its batches' tokens, views into shards,
    DataLoader.next_tokens) and sub_batches (B's split). A subclass sets ops (the
    executor of taskflow's calls), p, g, m, v (ParameterTensors of the parameters, gradients
    and moments), subs (each sub-batch's (ActivationTensors, [BackwardScratch of each pipeline
    stage])) and norm (the taskflow.norm_nodes float64 scalars of the gradient norm, for
    clipping)."""

    name = "?"
    # whether the trainer may submit the next step before reading this one's loss (the
    # StarPU engine in one process: its tasks run while Python submits; see submit_step)
    ahead = False

    def __init__(self, config: GPTConfig, state: TrainState, B: int, T: int, tokens: np.ndarray,
                 sub_batches: int = 1):
        check_batch_shape(config, B, T)
        if sub_batches < 1 or B % sub_batches:
            raise StarpuLLMError(f"{opt('batch')} {B} cannot be split into {sub_batches} equal sub-batches; "
                                 f"choose {opt('sub_batches')} dividing {B}")
        self.config, self.state, self.B, self.T = config, state, B, T
        self.sub_batches, self.Bs = sub_batches, B // sub_batches
        # how sub-batches add their gradients (StarPU engine: a reduction or a chain, its
        # sites decide); the reference engine adds them in order
        self.redux = 0
        # the pipeline stage of each layer (the StarPU engine's topology; here one stage)
        self.layer_stage = None
        self.layout = ParamLayout(config)
        # None: every step gives its batches' tokens (DataLoader.next_tokens: shards)
        self.tokens_ptr = token_pointer(tokens, "the training data") if tokens is not None else None
        self.tokens = tokens   # keep the shard alive: load tasks read it
        # the batches' tokens of the last two steps submitted, alive while their load tasks
        # may not have run (a step's loss read, its loads ran: the trainer submits a step
        # once the one before the previous was read; a caller submitting further ahead keeps
        # its batches' tokens itself)
        self._held = collections.deque(maxlen=2)

    # --- what subclasses provide ---
    def wait(self):
        raise NotImplementedError

    def read(self, t: Tensor) -> np.ndarray:
        raise NotImplementedError

    def sync(self):
        """Make the state's arrays hold what the tasks submitted so far computed (the StarPU
        engine's override; here the tensors are those arrays)."""
        self.wait()

    def submitted(self) -> list | None:
        """The names of the tasks submitted so far, in order, when recording; else None."""
        return None

    # where tasks run: the StarPU engine's sites decide; the reference runs them here
    def sub_batch_ops(self, i: int, phase: str = "forward"):
        """The executor of sub-batch i's tasks of a phase: "forward" (its load and blocks),
        "head" (final layernorm, lm head, loss), "head_backward" (theirs) or "backward"."""
        return self.ops

    def update_ops(self):
        """The executor of the update tasks."""
        return self.ops

    def sub_batch_embedding_wte(self, i: int):
        """Where sub-batch i's embedding adds its wte gradient (None: into the head's, the
        gradients'; a pipeline: its own, taskflow.backward says why)."""
        return None

    def sub_batch_grads(self, i: int):
        """The ParameterTensors sub-batch i's backward tasks add into: the gradients (the
        StarPU engine under MPI: its rank's contributions, added up after the backward)."""
        return self.g

    def _gradients_submitted(self):
        pass

    def _activations_used(self):
        """After the tasks that use the activations and the backward scratch: the StarPU
        engine under a memory limit drops their values (the next step writes them anew)."""

    def _check_open(self):
        """Raise where this engine can no longer submit or read (the StarPU engine's, once
        closed or its runtime shut down)."""

    def micro_batches(self, positions, tokens=None, what: str = "the training data") -> list:
        """Each micro-batch of positions (micro_positions) as (the pointer its load tasks read
        tokens at, its position there), checked: a position in `tokens` (None: the engine's),
        or a batch's own tokens, read from 0."""
        tokens = self.tokens if tokens is None else tokens
        out = []
        for p in micro_positions(positions):
            if isinstance(p, np.ndarray):
                if p.size != self.B * self.T + 1:
                    raise StarpuLLMError(f"a batch's tokens of {what}: {p.size} ids, but a batch "
                                         f"of {self.B} x {self.T} reads B*T+1 = "
                                         f"{self.B * self.T + 1}: give DataLoader.next_tokens()")
                check_positions([0], p, self.B, self.T, self.config.V, f"a batch of {what}")
                out.append((token_pointer(p, what), 0))
            elif tokens is None:
                raise StarpuLLMError(f"position {p}: the engine was made without token data "
                                     f"(tokens None), so each micro-batch is given as its "
                                     f"tokens: DataLoader.next_tokens() (io/data.py)")
            else:
                check_positions([p], tokens, self.B, self.T, self.config.V, what)
                out.append((self.tokens_ptr if tokens is self.tokens
                            else token_pointer(tokens, what), p))
        return out

    # --- the step ---
    def submit_forward_backward(self, positions):
        """The forward and backward of the batch at each of positions (micro_positions: one,
        or a gradient accumulation's micro-batches, in turn on the same activations): every
        gradient adds into the parameters' gradients, each token's loss into the sub-batch's
        losses (the first micro-batch writes them)."""
        self._check_open()
        self._submit_batches(micro_positions(positions), self.micro_batches(positions))

    def _submit_batches(self, positions: list, batches: list):
        """submit_forward_backward's tasks for positions (micro_positions) checked into
        batches (micro_batches): a step checks its batches once, before any task."""
        self._held.append([p for p in positions if isinstance(p, np.ndarray)])
        n = self.Bs * self.T
        # the gradients of all sub-batches and micro-batches sum to the mean loss's
        dloss = 1.0 / (self.B * self.T * len(batches))
        for j, (ptr, pos) in enumerate(batches):
            for i, (a, s) in enumerate(self.subs):
                ops = self.sub_batch_ops(i)
                ops.load_batch(a.inputs, a.targets, ptr, pos + i * n, n)
                taskflow.forward(ops, self.config, self.p, a, self.Bs, self.T,
                                 self.sub_batch_ops(i, "head"), add_loss=j > 0)
                taskflow.backward(self.sub_batch_ops(i, "backward"), self.config, self.p,
                                  self.sub_batch_grads(i), a, s, self.Bs, self.T, dloss,
                                  self.redux, self.layer_stage, self.sub_batch_embedding_wte(i),
                                  self.sub_batch_ops(i, "head_backward"))
            self._activations_used()
        self._gradients_submitted()

    @_takes_adamw
    def submit_update(self, adamw: AdamW):
        """The AdamW tasks of the settings adamw holds (adamw.grad_clip > 0: the gradients'
        global norm clipped to it first)."""
        self._check_open()
        self.state.step += 1
        taskflow.update(self.update_ops(), self.config, self.p, self.g, self.m, self.v, adamw,
                        self.state.step, self.norm)

    def _alternate_buffers(self):
        """Have the next step write its losses and gradient norm into the other of two sets
        (the StarPU engine's; submit_step)."""
        raise StarpuLLMError(f"the {self.name} engine does not submit a step ahead")

    @_takes_adamw
    def submit_step(self, positions, adamw: AdamW, keep_previous: bool = False) -> Submitted:
        """Submit the step on the batch at token position positions (forward, backward,
        update with adamw's settings; several positions: a gradient accumulation over those
        micro-batches, one update of their mean loss's gradient; adamw.grad_clip > 0 clips
        the gradients' global norm on the workers: the AdamW tasks read the norm tree's root)
        without waiting for it. keep_previous: the previous step's
        loss or gradient norm is still to be read (step_loss, grad_norm) while this one
        runs, so this one writes them into the other of two sets of buffers (engines with
        `ahead`)."""
        self._check_open()          # before the other buffers' first registration
        positions = micro_positions(positions)
        batches = self.micro_batches(positions)       # checked before any task
        if keep_previous:
            self._alternate_buffers()
        self._submit_batches(positions, batches)
        self.submit_update(adamw)
        return Submitted(self.state.step, [a.losses for a, _ in self.subs],
                         self.norm[-1] if adamw.grad_clip > 0 else None, len(positions))

    def forward_backward(self, positions) -> float:
        """Mean loss of the batch at token position positions (several: the micro-batches of a
        gradient accumulation); leaves its gradients in the gradients' tensors (in
        state.grads once sync() has run: the StarPU engine's workers may hold them)."""
        positions = micro_positions(positions)
        self.submit_forward_backward(positions)
        self.wait()
        return self.loss(micro_batches=len(positions))

    @_takes_adamw
    def step(self, positions, adamw: AdamW) -> float:
        """The step on the batch at positions with adamw's update (submit_step), waited for;
        its loss."""
        s = self.submit_step(positions, adamw)
        self.wait()
        return self.loss(s.losses, s.micro_batches)

    def grad_norm(self, norm: Tensor | None = None) -> float:
        """The global L2 norm of the gradients (before clipping) of the last clipped step, or
        of the step whose root `norm` is (Submitted.norm): read after the tasks that write it,
        not after every task."""
        return float(np.sqrt(self.read(norm or self.norm[-1])[0]))

    def validation_loss(self, tokens: np.ndarray | None, positions) -> float:
        """Mean loss over the batches of tokens (a uint16 shard) starting at positions (tokens
        None: each of positions is a batch's own tokens, DataLoader.next_tokens):
        forward-only task flows on the training's activation buffers. They read the
        parameters and touch no gradient or moment (no backward, no update)."""
        self._check_open()
        if tokens is None and any(not isinstance(p, np.ndarray) for p in positions):
            raise StarpuLLMError("validation_loss(None, positions): without tokens each "
                                 "position is a batch's tokens (DataLoader.next_tokens())")
        batches = self.micro_batches(positions, tokens, "the validation data")
        n = self.Bs * self.T
        losses = []
        for ptr, pos in batches:
            for i, (a, _) in enumerate(self.subs):
                ops = self.sub_batch_ops(i)
                ops.load_batch(a.inputs, a.targets, ptr, pos + i * n, n)
                taskflow.forward(ops, self.config, self.p, a, self.Bs, self.T,
                                 self.sub_batch_ops(i, "head"))
            self.wait()           # the next batch reuses the activations
            losses.append(self.loss())
            self._activations_used()
        return float(np.mean(losses))

    def loss(self, losses: list | None = None, micro_batches: int = 1) -> float:
        """The mean loss of the last forward, or of the step whose sub-batches' losses tensors
        are `losses` (Submitted.losses, holding the sums over its micro_batches): read after
        the tasks that write them."""
        losses = losses or [a.losses for a, _ in self.subs]
        return float(np.mean([self.read(t).mean(dtype=np.float64) for t in losses])
                     / micro_batches)

    def logits(self) -> np.ndarray:
        """(B, T, Vp) logits of the last forward pass."""
        return np.concatenate([self.read(a.logits) for a, _ in self.subs])

    def close(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
