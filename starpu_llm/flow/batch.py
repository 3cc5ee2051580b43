"""Batched decoding: many sequences through the model together, each in a slot of the
key/value cache, each at its own position.

A SlotDecoder holds the cache as S slots (tensors.KVCache, (S, NH, Tc, hs) per layer) and one
set of buffers for up to `rows` rows of a step (tensors.DecodeTensors, shared by the layers)
and for the logits of up to S of them (tensors.HeadTensors). All are created once, as StarPU
handles on the StarPU engine (numpy arrays on the reference engine), and reused by every step
of every sequence that comes and goes: a new sequence takes a free slot and writes over what
the slot's last sequence left.

A step (decode_step) takes N rows, each one new position of one sequence, described by the
rows' idx (N, 3): token, slot, position. Every layer treats the rows as one matrix of N rows
(the training block's own code, taskflow.block_forward: layernorms, matmuls, GeLU and
residuals are row by row, so a row does not see the others); the attention appends each
row's key and value to its slot (kv_append) and lets its query attend to its slot's positions
0..position (attention_decode). So one step carries, side by side, the next token of every
running sequence and whole prompts of new ones (prefill), and submits the same tasks however
many sequences it carries: one per layer operation, each over all the rows. The rows whose
logits are wanted (a sequence's last row; each row of a prompt being scored) come first, and
the final layernorm and the lm head run on those M rows only.

With several StarPU workers of one core each, the slots are split into groups, one per
worker: each group has its own cache and buffers, so the steps of two groups are independent
task chains that StarPU runs side by side (data parallelism, as training's sub-batches).
"""
from __future__ import annotations

import collections
from typing import NamedTuple, Sequence

import numpy as np

from .._kernels import lib as kernels
from ..errors import StarpuLLMError
from . import taskflow
from .tensors import DecodeTensors, HeadTensors, KVCache

DEFAULT_ROWS = 256      # rows per step (and group): the new tokens a step takes, prompts included


class Feed(NamedTuple):
    """What one sequence brings to a step: tokens at positions pos, pos + 1, ... of the
    sequence in `slot`; logits: whether the logits after its last token are wanted (True), or
    the number of its last tokens after each of which they are (an int: a prompt scored)."""
    slot: int
    pos: int
    tokens: Sequence[int]
    logits: bool = True


class Submitted(NamedTuple):
    """A step submitted (SlotDecoder.submit): its feeds and (slot, group, row) of each wanted
    logits row."""
    feeds: tuple
    heads: list


def decode_step(ops, cfg, p, kv, d, h, N: int, M: int):
    """N rows (their token, slot and position in d.idx) through the model, their keys and
    values into the cache kv (Tc positions a slot); the logits of the first M rows into
    h.logits (M = 0: no lm head)."""
    C, NH, Tc = cfg.C, cfg.NH, kv.k[0].shape[2]
    ops.encoder_decode(d.res3, d.idx, p.wte, p.wpe, N, C)
    for l in range(cfg.L):
        def attention(b, l=l):
            ops.kv_append(kv.k[l], kv.v[l], b.qkv, d.idx, N, C, NH, Tc)
            ops.attention_decode(b.atty, b.qkv, kv.k[l], kv.v[l], d.idx, N, C, NH, Tc)
        # d.res3, the residual stream, is each block's input and output
        taskflow.block_forward(ops, cfg, p, l, d.res3, d, N, attention)
    if M:
        ops.layernorm_forward(h.lnf, h.lnf_mean, h.lnf_rstd, d.res3, p.lnfw, p.lnfb, M, C)
        ops.matmul_forward(h.logits, h.lnf, p.wte, None, M, C, cfg.Vp)   # lm head, tied to wte


class _Group:
    """Slots first .. first + n - 1, with their cache and a step's buffers (the logits of up to
    n + extra rows)."""

    def __init__(self, cfg, first: int, n: int, rows: int, Tc: int, tensor, extra: int = 0):
        self.first, self.n = first, n
        self.kv = KVCache.create(cfg, n, Tc, tensor)
        self.d = DecodeTensors.create(cfg, rows, 1, tensor)
        self.h = HeadTensors.create(cfg, n + extra, 1, tensor)
        self.heads = n + extra


class SlotDecoder:
    """`slots` sequences with a key/value cache of cache_len positions each (default: the
    model's maxT), stepped together (see the module docstring); at most `rows` new tokens
    per step in each of `groups` groups of slots, and the logits of at most head_rows(g) of
    them (a group's slots, plus extra_heads for the rows of scored prompts). Tensors are made
    by `backend` once, here."""

    def __init__(self, backend, slots: int, rows: int = DEFAULT_ROWS,
                 cache_len: int | None = None, groups: int = 1, extra_heads: int = 0):
        cfg = self.config = backend.config
        self.backend = backend
        self.Tc = cache_len or cfg.maxT
        if not 1 <= self.Tc <= cfg.maxT:
            raise StarpuLLMError(f"a cache of {self.Tc} positions: choose 1..{cfg.maxT} "
                                 f"(the model's maximum sequence length)")
        if slots < 1 or rows < 1:
            raise StarpuLLMError(f"{slots} slots of {rows} rows: both must be at least 1")
        self.slots, self.rows = slots, rows
        groups = max(1, min(groups, slots))
        per = -(-slots // groups)
        self.groups = [_Group(cfg, first, min(per, slots - first), rows, self.Tc, backend.tensor,
                              max(0, min(extra_heads, rows - 1)))
                       for first in range(0, slots, per)]
        self._per = per
        kernels.keep_freed_memory()     # a step's logits reused, not faulted in every step

    def place_caches(self):
        """Writes every slot's cache once (zeros, a task each) and waits: their memory is
        committed now, placed by the workers, so that a server short of memory fails as it
        loads, not under traffic, and the first steps do not pay for the pages (16 slots of
        1024 positions of GPT-2 124M: 1.2 GB; on the 2-core VM, whose first touch of fresh
        memory is slow, a first 256-row step of 1.3 s against 0.3 s). The server calls it
        before it takes requests, as llama.cpp's clears its cache."""
        for g in self.groups:
            for t in g.kv.k + g.kv.v:
                self.backend.ops.zero(t)
        self.backend.sync()

    def group_of(self, slot: int) -> int:
        """The group that holds slot."""
        return slot // self._per

    def head_rows(self, g: int) -> int:
        """The most rows of group g whose logits one step gives."""
        return self.groups[g].heads

    def step(self, feeds: Sequence[Feed]) -> np.ndarray:
        """One step of the feeds (each slot at most once; see Feed): their tokens through the
        model, into the cache. Returns the (M, V) logits after each wanted token (a feed's
        last, or its last `logits` ones), in the feeds' order and each feed's token order."""
        return self.collect(self.submit(feeds))

    def submit(self, feeds: Sequence[Feed]) -> Submitted:
        """step()'s first half: the step's tasks submitted (on the StarPU engine they run while
        the caller goes on); collect() of what it returns waits for them and gives the logits."""
        cfg = self.config
        per_group = [[] for _ in self.groups]
        seen = set()
        for f in feeds:
            n = len(f.tokens)
            if not 0 <= f.slot < self.slots or f.slot in seen:
                raise ValueError(f"slot {f.slot}: outside 0..{self.slots - 1}, or twice in a step")
            if n < 1 or f.pos < 0 or f.pos + n > self.Tc:
                raise StarpuLLMError(f"positions {f.pos}..{f.pos + n - 1} of slot {f.slot}: a "
                                     f"slot holds positions 0..{self.Tc - 1}")
            seen.add(f.slot)
            per_group[self.group_of(f.slot)].append(f)
        heads = []       # (group, row) of each wanted logits row, in the feeds' order
        for g, (group, fs) in enumerate(zip(self.groups, per_group)):
            if not fs:
                continue
            tokens = np.concatenate([np.asarray(f.tokens, np.int64) for f in fs])
            if tokens.min() < 0 or tokens.max() >= cfg.V:
                raise StarpuLLMError(f"token ids must be in [0, {cfg.V}), the model's "
                                     f"vocabulary; got {tokens.min()}..{tokens.max()}")
            # the rows of the wanted logits first, then every other row
            first = [(f, i) for f in fs
                     for i in range(len(f.tokens) - min(int(f.logits), len(f.tokens)),
                                    len(f.tokens))]
            rest = [(f, i) for f in fs
                    for i in range(len(f.tokens) - min(int(f.logits), len(f.tokens)))]
            if len(first) + len(rest) > self.rows:
                raise ValueError(f"{len(first) + len(rest)} rows in one step of a group "
                                 f"of {self.rows}")
            if len(first) > group.heads:
                raise ValueError(f"the logits of {len(first)} rows in one step of a group "
                                 f"that gives {group.heads}")
            idx = np.array([(f.tokens[i], f.slot - group.first, f.pos + i)
                            for f, i in first + rest], np.int32)
            self.backend.write(group.d.idx, idx)
            decode_step(self.backend.ops, cfg, self.backend.p, group.kv, group.d, group.h,
                        len(idx), len(first))
            heads += [(f.slot, g, r) for r, (f, _) in enumerate(first)]
        return Submitted(tuple(feeds), heads)

    def collect(self, step: Submitted) -> np.ndarray:
        """step()'s second half: the logits of a submitted step, once its tasks have run."""
        cfg, feeds, heads = self.config, step.feeds, step.heads
        if not heads:
            return np.zeros((0, cfg.V), np.float32)
        # only the rows written this step, without the padding columns (the lm head's Vp)
        used = collections.Counter(g for _, g, _ in heads)
        logits = {g: self.backend.read(self.groups[g].h.logits, n, cfg.V)
                  for g, n in used.items()}
        if len(logits) == 1:        # one group: its rows are already in the feeds' order
            return next(iter(logits.values()))
        order = {f.slot: k for k, f in enumerate(f for f in feeds if f.logits)}
        heads.sort(key=lambda x: order[x[0]])
        return np.stack([logits[g][r] for _, g, r in heads])
