"""Model configuration and the layout of GPT-2's 16 parameter tensors (llm.c's order)."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, NamedTuple

import numpy as np

from ..errors import StarpuLLMError, opt


class ParamSpec(NamedTuple):
    """One of GPT-2's parameter tensors: the one declaration the layout (ParamLayout), the named
    groups (flow/tensors.ParameterTensors), the update order (flow/taskflow.update_order) and
    the initialisation (state.random_init) are derived from."""
    name: str
    shape: Callable      # GPTConfig -> the shape (one layer's, for a block's tensor)
    part: str            # "embedding", "block" (one per layer, stacked over L) or "head"
    init: str            # "normal" N(0, 0.02), "residual" N(0, 0.02/sqrt(2L)), "ones", "zeros"


# GPT-2's parameters in llm.c's checkpoint order.
PARAMETERS = (
    ParamSpec("wte", lambda c: (c.Vp, c.C), "embedding", "normal"),   # rows >= V stay 0
    ParamSpec("wpe", lambda c: (c.maxT, c.C), "embedding", "normal"),
    ParamSpec("ln1w", lambda c: (c.C,), "block", "ones"),
    ParamSpec("ln1b", lambda c: (c.C,), "block", "zeros"),
    ParamSpec("qkvw", lambda c: (3 * c.C, c.C), "block", "normal"),
    ParamSpec("qkvb", lambda c: (3 * c.C,), "block", "zeros"),
    ParamSpec("attprojw", lambda c: (c.C, c.C), "block", "residual"),
    ParamSpec("attprojb", lambda c: (c.C,), "block", "zeros"),
    ParamSpec("ln2w", lambda c: (c.C,), "block", "ones"),
    ParamSpec("ln2b", lambda c: (c.C,), "block", "zeros"),
    ParamSpec("fcw", lambda c: (4 * c.C, c.C), "block", "normal"),
    ParamSpec("fcb", lambda c: (4 * c.C,), "block", "zeros"),
    ParamSpec("fcprojw", lambda c: (c.C, 4 * c.C), "block", "residual"),
    ParamSpec("fcprojb", lambda c: (c.C,), "block", "zeros"),
    ParamSpec("lnfw", lambda c: (c.C,), "head", "ones"),
    ParamSpec("lnfb", lambda c: (c.C,), "head", "zeros"),
)
PARAMETER_SPECS = {p.name: p for p in PARAMETERS}

# The tensor that may be split in row blocks, each block a slice of its own (owner, gradient,
# moments, update): the tied embedding and lm head, 31 % of GPT-2 124M. How many blocks is the
# placement's decision (plan/topology.Topology.wte_blocks): one in a single process.
ROW_BLOCKED = "wte"


def row_blocks(rows: int, nb: int) -> list:
    """[(first, end)] of nb contiguous blocks of `rows` rows, in order, sizes differing by at
    most one (block b starts at row b rows // nb)."""
    if not 1 <= nb <= rows:
        raise ValueError(f"{nb} row blocks of {rows} rows")
    return [(b * rows // nb, (b + 1) * rows // nb) for b in range(nb)]


def is_sliced(name: str) -> bool:
    """Whether the named groups (flow/tensors.ParameterTensors) hold a tensor as a list of
    slices: a block tensor's layers, or ROW_BLOCKED's row blocks (one or more)."""
    return PARAMETER_SPECS[name].part == "block" or name == ROW_BLOCKED


@dataclass(frozen=True)
class GPTConfig:
    """GPT-2's shape, llm.c's: maxT, V, Vp, L, NH, C (MODELS names the sizes)."""
    max_seq_len: int = 1024      # maxT
    vocab_size: int = 50257      # V, the real vocabulary
    padded_vocab_size: int = 50304  # Vp, rows of wte (multiple of 128 for aligned GEMMs)
    num_layers: int = 12         # L
    num_heads: int = 12          # NH
    channels: int = 768          # C

    def __post_init__(self):
        if self.channels % self.num_heads:
            raise ValueError(f"channels ({self.channels}) must be a multiple of num_heads ({self.num_heads})")
        if self.padded_vocab_size < self.vocab_size:
            raise ValueError("padded_vocab_size must be >= vocab_size")

    # short names used throughout the code, as in the kernels' shape comments
    @property
    def L(self): return self.num_layers
    @property
    def C(self): return self.channels
    @property
    def NH(self): return self.num_heads
    @property
    def V(self): return self.vocab_size
    @property
    def Vp(self): return self.padded_vocab_size
    @property
    def maxT(self): return self.max_seq_len

    @property
    def num_parameters(self) -> int:
        # math.prod (Python ints), not np.prod: a checkpoint header's int32 sizes can multiply past
        # int64, and np.prod would wrap silently to a small or negative count
        return sum(math.prod(s) for _, s in self.param_shapes())

    def flops_per_token(self, T: int) -> float:
        """Model FLOPs per trained token at sequence length T, counted from the shapes of the
        step's matmuls: forward per token L (24 C^2 + 2 C (T + 1)) + 2 C Vp, that is the four
        GEMMs of a block (qkv 3 C^2, attproj C^2, fc 4 C^2, fcproj 4 C^2 multiply-adds),
        causal attention (q.k and att.v over (T + 1) / 2 positions on average: 2 C (T + 1)
        flops) and the lm head over the padded vocabulary; backward twice the forward (the
        gradients of the input and of the weight); 3x in all. Layernorm, GeLU, softmax,
        cross-entropy and AdamW are left out (memory-bound, < 2 % of the flops). GPT-2 124M
        at T=64: 745 MFLOP/token (6 N = 747 M)."""
        forward = self.L * (24 * self.C ** 2 + 2 * self.C * (T + 1)) + 2 * self.C * self.Vp
        return 3.0 * forward

    def param_shapes(self):
        """The 16 parameter tensors in llm.c's checkpoint order, with their shapes (a block's
        tensors stacked over the L layers)."""
        return [(p.name, ((self.L,) if p.part == "block" else ()) + p.shape(self))
                for p in PARAMETERS]


def check_batch_shape(config: GPTConfig, B: int, T: int) -> None:
    """A clear error for a batch shape this model cannot train on."""
    if B < 1:
        raise StarpuLLMError(f"{opt('batch')} must be at least 1, got {B}")
    if T < 1 or T > config.maxT:
        raise StarpuLLMError(f"{opt('seq_len')} {T} is outside 1..{config.maxT}, the model's maximum "
                             f"sequence length; use {opt('seq_len')} <= {config.maxT}")


# The tensors AdamW's weight decay shrinks (--weight-decay-params): "matrices", the 2-D ones (wte,
# wpe, each layer's four weight matrices; not the biases nor the layernorms' gains and shifts),
# as nanoGPT, llm.c's train_gpt2.cu and GPT-3; "all", as llm.c's train_gpt2.c.
DECAYED = {"matrices": frozenset(p.name for p in PARAMETERS if len(p.shape(GPTConfig())) == 2),
           "all": frozenset(p.name for p in PARAMETERS)}
DEFAULT_DECAYED = "matrices"
# AdamW's decay rates of the moments (--beta1, --beta2): llm.c train_gpt2.c's; GPT-2's recipe
# (nanoGPT, llm.c's train_gpt2.cu) takes beta2 = 0.95
ADAM_BETAS = (0.9, 0.999)
# AdamW's epsilon, added to the second moment's root (llm.c's and torch's)
ADAM_EPS = 1e-8


@dataclass(frozen=True)
class AdamW:
    """An update's AdamW settings, decided once (the trainer: from the run's settings, each
    step's learning rate from the schedule, with_lr) and passed whole to the update tasks
    (flow/taskflow.update) or the PyTorch baselines: the learning rate, the decoupled weight
    decay of the tensors DECAYED[decayed] names, the moments' decay rates (beta1, beta2), the
    global L2 norm the gradients are clipped to first (0: none) and epsilon."""
    lr: float
    weight_decay: float = 0.0
    decayed: str = DEFAULT_DECAYED
    betas: tuple = ADAM_BETAS
    grad_clip: float = 0.0
    eps: float = ADAM_EPS

    def __post_init__(self):
        if self.decayed not in DECAYED:
            raise StarpuLLMError(f"AdamW decayed {self.decayed!r}: choose one of "
                                 f"{', '.join(sorted(DECAYED))}")

    def with_lr(self, lr: float) -> AdamW:
        """These settings at learning rate lr (a step of a schedule)."""
        return replace(self, lr=lr)

    def decays(self, name: str) -> bool:
        """Whether the weight decay shrinks the parameter tensor `name` (DECAYED[decayed])."""
        return name in DECAYED[self.decayed]

    def decay_of(self, name: str) -> float:
        """The weight decay of the parameter tensor `name`: 0 where it does not decay."""
        return self.weight_decay if self.decays(name) else 0.0


# Named configurations: llm.c's GPT-2 sizes "dL" (L layers, maxT=1024, V=50257 padded to
# Vp=50304), each also under its GPT-2 release's name; the tiny ones keep tests fast.
GPT2_124M = GPTConfig()
GPT2_350M = GPTConfig(num_layers=24, num_heads=16, channels=1024)
GPT2_774M = GPTConfig(num_layers=36, num_heads=20, channels=1280)
GPT2_1558M = GPTConfig(num_layers=48, num_heads=25, channels=1600)
MODELS = {
    "gpt2": GPT2_124M,
    "d12": GPT2_124M,
    "gpt2-medium": GPT2_350M,
    "d24": GPT2_350M,
    "gpt2-large": GPT2_774M,
    "d36": GPT2_774M,
    "gpt2-xl": GPT2_1558M,
    "d48": GPT2_1558M,
    "d6": GPTConfig(num_layers=6, num_heads=6, channels=384),
    "tiny": GPTConfig(max_seq_len=64, vocab_size=50257, padded_vocab_size=50304,
                      num_layers=2, num_heads=4, channels=64),
    "micro": GPTConfig(max_seq_len=32, vocab_size=250, padded_vocab_size=256,
                       num_layers=2, num_heads=2, channels=32),
}
# The model a command trains, benchmarks, calibrates or predicts when not told (train: unless
# --init-from or --resume gives one): GPT-2 124M, the paper's.
DEFAULT_MODEL = "d12"


class ParamLayout:
    """Offsets of the 16 tensors inside one contiguous float32 buffer (llm.c's layout)."""

    def __init__(self, config: GPTConfig):
        self.config = config
        self.names = []
        self.shapes = {}
        self.offsets = {}
        off = 0
        for name, shape in config.param_shapes():
            self.names.append(name)
            self.shapes[name] = shape
            self.offsets[name] = off
            off += math.prod(shape)
        self.total = off

    def views(self, flat: np.ndarray) -> dict:
        """Per-tensor numpy views (no copies) into a flat buffer of this layout."""
        assert flat.size == self.total and flat.dtype == np.float32
        return {n: flat[self.offsets[n]:self.offsets[n] + math.prod(s)].reshape(s)
                for n, s in self.shapes.items()}

    def is_layered(self, name: str) -> bool:
        return PARAMETER_SPECS[name].part == "block"

    def slices(self, name: str, view: np.ndarray, wte_blocks: int = 1):
        """A tensor's view (views()) as the named groups hold it: ROW_BLOCKED's as the list of
        its wte_blocks row blocks (views, row_blocks), any other as is (a block tensor's
        (L, ...) array: its layers)."""
        if name == ROW_BLOCKED:
            return [view[a:e] for a, e in row_blocks(len(view), wte_blocks)]
        return view

    def slice_list(self, wte_blocks: int = 1) -> list:
        """((name, layer, wte's row block or None), offset, shape) of every slice (a block
        tensor's layer, one of wte's wte_blocks row blocks, or a whole wpe, lnfw or lnfb), in
        llm.c's order: the units that have their own StarPU handle, update task and owner
        (plan/topology.py: the keys of its owners); consecutive, they cover the buffer."""
        out = []
        for name in self.names:
            shape, off = self.shapes[name], self.offsets[name]
            if self.is_layered(name):
                size = math.prod(shape[1:])
                out += [((name, l), off + l * size, shape[1:]) for l in range(shape[0])]
            elif name == ROW_BLOCKED:
                rows, cols = shape
                out += [((name, b), off + a * cols, (e - a, cols))
                        for b, (a, e) in enumerate(row_blocks(rows, wte_blocks))]
            else:
                out.append(((name, None), off, shape))
        return out


# The attention's two forms (csrc/kernels/kernels.h): "gemm" keeps the weights att (B,NH,T,T)
# for the backward (the CPU engine's, and the batched-GEMM CUDA reference); "flash", fused,
# keeps each query row's logsumexp (B,NH,T), and no (T, T) tensor exists.
ATTENTIONS = ("gemm", "flash")
