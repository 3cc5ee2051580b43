"""The tensors of a training run by name, as llm.c's ParameterTensors and ActivationTensors.

A Tensor is a name, a shape, a dtype and where the data is: a StarPU data handle (StarPU
engine) or a numpy array (reference engine). A group is a dataclass of Tensors, per-layer
ones as lists of L (one per layer). The field lists below are the one declaration of the
tensors' names, and for the activations and the backward scratch of their shapes too (the
parameters' shapes are llm.c's layout, config.ParamLayout).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, make_dataclass
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np

from .._kernels import ffi
from ..model.config import ATTENTIONS, PARAMETERS, GPTConfig, ParamLayout, is_sliced


class Tensor:
    """A named tensor: a StarPU data handle (h), or a numpy array and its pointer (direct)."""

    __slots__ = ("name", "shape", "dtype", "array", "ptr", "h")

    def __init__(self, name, shape, dtype=np.float32, array=None, h=None):
        self.name, self.shape, self.dtype = name, tuple(shape), np.dtype(dtype)
        self.array, self.h = array, h
        self.ptr = None
        if array is not None:
            ctype = {np.int32: "int32_t *", np.float64: "double *"}.get(self.dtype.type, "float *")
            self.ptr = ffi.cast(ctype, ffi.from_buffer(array))

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def __repr__(self):
        return f"Tensor({self.name}, {self.shape})"


class TensorGroup:
    """What every group offers: its tensors in field order."""

    def tensors(self):
        """Every tensor of the group, per-layer lists flattened, in field order."""
        for f in fields(self):
            t = getattr(self, f.name)
            yield from (t if isinstance(t, list) else [t])


class _ParameterGroup(TensorGroup):
    """What ParameterTensors offers beyond its fields."""

    @classmethod
    def over(cls, layout: ParamLayout, flat: np.ndarray, make, wte_blocks: int = 1):
        """The group over flat, a buffer of layout (parameters, gradients, m or v): each field
        is make(name, view, sliced), which returns a Tensor, or for a sliced tensor
        (config.is_sliced) the list of its slices' Tensors: view then holds the slices (a
        block tensor's (L, ...) view of flat, or wte's list of wte_blocks row-block views).
        Called in llm.c's order."""
        return cls(**{name: make(name, layout.slices(name, view, wte_blocks), is_sliced(name))
                      for name, view in layout.views(flat).items()})

    @classmethod
    def of_arrays(cls, kind: str, layout: ParamLayout, flat: np.ndarray):
        """The group of numpy views into flat, named "{kind}.{name}" ("{kind}.{name}[l]"; wte
        in one row block)."""
        def make(name, arr, sliced):
            if sliced:
                return [Tensor(f"{kind}.{name}[{l}]", arr[l].shape, array=arr[l])
                        for l in range(len(arr))]
            return Tensor(f"{kind}.{name}", arr.shape, array=arr)
        return cls.over(layout, flat, make)

    @classmethod
    def of_shapes(cls, kind: str, layout: ParamLayout):
        """The group's names and shapes alone (Tensors with no data), named as of_arrays."""
        def make(name, arr, sliced):
            if sliced:
                return [Tensor(f"{kind}.{name}[{l}]", arr[l].shape) for l in range(len(arr))]
            return Tensor(f"{kind}.{name}", arr.shape)
        return cls.over(layout, shape_only(layout), make)


def shape_only(layout: ParamLayout) -> np.ndarray:
    """A flat float32 array of layout's size holding no memory (one element, stride 0): its
    views give the tensors' shapes (ParameterTensors.over) and must never be written."""
    return np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), (layout.total,), (0,),
                                           writeable=False)


# GPT-2's 16 parameter tensors in llm.c's order (config.PARAMETERS): one group each for the
# parameters, gradients and AdamW moments. A block's tensor is the list of its L layers' slices,
# wte the list of its row blocks (topology.Topology.wte_blocks; one in a single process).
ParameterTensors = make_dataclass(
    "ParameterTensors", [(p.name, list if is_sliced(p.name) else Tensor) for p in PARAMETERS],
    bases=(_ParameterGroup,))


class Dims(NamedTuple):
    """The sizes an activation's shape is made of: a (sub-)batch of B sequences of T tokens,
    and the attention's form (ATTENTIONS), which sets what the attention keeps."""
    B: int
    T: int
    C: int
    NH: int
    Vp: int
    attention: str = "gemm"


def single(shape, dtype=np.float32):
    """A field holding one tensor; shape(dims) gives its shape."""
    return field(metadata={"shape": shape, "dtype": dtype, "layered": False})


def per_layer(shape):
    """A field holding one float32 tensor per layer, each of shape(dims)."""
    return field(metadata={"shape": shape, "dtype": np.float32, "layered": True})


class SubBatchGroup(TensorGroup):
    """A group whose fields declare their shapes (single / per_layer): one sub-batch's.
    attention: the attention's form its tensors are laid out for (ATTENTIONS), which the task
    flow reads to submit that attention's codelets (decided once, where the tensors are made)."""
    attention = "gemm"

    @classmethod
    def create(cls, cfg: GPTConfig, B: int, T: int, new_tensor, layer_tensor=None,
               attention: str = "gemm"):
        """The group of a (sub-)batch of B x T tokens: every tensor is
        new_tensor(name, shape, dtype), per-layer ones named "name[l]" (made by
        layer_tensor(name, shape, dtype, l) when given: a pipeline places layers apart); in
        field order; attention: the attention's form (ATTENTIONS)."""
        if attention not in ATTENTIONS:
            raise ValueError(f"attention {attention!r}: one of {', '.join(ATTENTIONS)}")
        dims = Dims(B, T, cfg.C, cfg.NH, cfg.Vp, attention)
        layer_tensor = layer_tensor or (lambda name, shape, dtype, l: new_tensor(name, shape, dtype))
        out = {}
        for f in fields(cls):
            shape, dtype = f.metadata["shape"](dims), f.metadata["dtype"]
            if f.metadata["layered"]:
                out[f.name] = [layer_tensor(f"{f.name}[{l}]", shape, dtype, l)
                               for l in range(cfg.L)]
            else:
                out[f.name] = new_tensor(f.name, shape, dtype)
        group = cls(**out)
        group.attention = attention
        return group

    def layer(self, l: int) -> SimpleNamespace:
        """Layer l's tensor of each per-layer field, by the field's name."""
        return SimpleNamespace(**{f.name: getattr(self, f.name)[l] for f in fields(self)
                                  if f.metadata["layered"]})


@dataclass
class ActivationTensors(SubBatchGroup):
    """One sub-batch's inputs, targets and forward activations (llm.c's ActivationTensors)."""
    inputs: Tensor = single(lambda d: (d.B, d.T), np.int32)
    targets: Tensor = single(lambda d: (d.B, d.T), np.int32)
    encoded: Tensor = single(lambda d: (d.B, d.T, d.C))
    lnf: Tensor = single(lambda d: (d.B, d.T, d.C))
    lnf_mean: Tensor = single(lambda d: (d.B, d.T))
    lnf_rstd: Tensor = single(lambda d: (d.B, d.T))
    logits: Tensor = single(lambda d: (d.B, d.T, d.Vp))
    probs: Tensor = single(lambda d: (d.B, d.T, d.Vp))
    losses: Tensor = single(lambda d: (d.B, d.T))
    ln1: list = per_layer(lambda d: (d.B, d.T, d.C))
    ln1_mean: list = per_layer(lambda d: (d.B, d.T))
    ln1_rstd: list = per_layer(lambda d: (d.B, d.T))
    qkv: list = per_layer(lambda d: (d.B, d.T, 3 * d.C))
    atty: list = per_layer(lambda d: (d.B, d.T, d.C))
    # what the attention keeps for its backward: the weights, or each row's logsumexp (fused)
    att: list = per_layer(lambda d: (d.B, d.NH, d.T) if d.attention == "flash"
                          else (d.B, d.NH, d.T, d.T))
    attproj: list = per_layer(lambda d: (d.B, d.T, d.C))
    res2: list = per_layer(lambda d: (d.B, d.T, d.C))
    ln2: list = per_layer(lambda d: (d.B, d.T, d.C))
    ln2_mean: list = per_layer(lambda d: (d.B, d.T))
    ln2_rstd: list = per_layer(lambda d: (d.B, d.T))
    fch: list = per_layer(lambda d: (d.B, d.T, 4 * d.C))
    fch_gelu: list = per_layer(lambda d: (d.B, d.T, 4 * d.C))
    fcproj: list = per_layer(lambda d: (d.B, d.T, d.C))
    res3: list = per_layer(lambda d: (d.B, d.T, d.C))


@dataclass
class BackwardScratch(SubBatchGroup):
    """One sub-batch's backward buffers, reused by every layer."""
    dlogits: Tensor = single(lambda d: (d.B, d.T, d.Vp))
    dres: Tensor = single(lambda d: (d.B, d.T, d.C))     # gradient of the residual stream
    dln: Tensor = single(lambda d: (d.B, d.T, d.C))
    datty: Tensor = single(lambda d: (d.B, d.T, d.C))
    dfch_gelu: Tensor = single(lambda d: (d.B, d.T, 4 * d.C))
    dfch: Tensor = single(lambda d: (d.B, d.T, 4 * d.C))
    dqkv: Tensor = single(lambda d: (d.B, d.T, 3 * d.C))
    # the attention backward's: dpreatt and datt, or the fused one's row sums dout . out
    att_scratch: Tensor = single(lambda d: (d.B, d.NH, d.T) if d.attention == "flash"
                                 else (2, d.B, d.NH, d.T, d.T))


# The activations that outlive a step: the losses (the step's loss reads them after it) and
# the inputs and targets (written by the load task, which may run ahead). Each micro-batch of
# a pipeline keeps its own; the rest a stage may share between micro-batches
# (handles.Handles.sub_batch).
PER_MICRO_BATCH = ("inputs", "targets", "losses")

# The suffix of the second set of losses and gradient-norm root that steps submitted ahead
# alternate with the first (engine.StarPUEngine._alternate_buffers): "s0.losses#1" in a trace
# is the other buffer of "s0.losses", the same tensor.
SECOND_SET = "#1"


def set_free_name(name: str) -> str:
    """A tensor's name without the second set's suffix: the same tensor in either set."""
    return name[:-len(SECOND_SET)] if name.endswith(SECOND_SET) else name


def sub_batch_tensors(cfg: GPTConfig, B: int, T: int, new_tensor, layer_tensor=None,
                      stage_tensors=None, attention: str = "gemm"):
    """(activations, [backward scratch of each pipeline stage]) of one (sub-)batch, in this
    order (the MPI tags follow it): each tensor made by new_tensor(name, shape, dtype), a
    per-layer activation by layer_tensor(name, shape, dtype, l) when given, and stage s's
    scratch by stage_tensors[s](name, shape, dtype) when given (else one stage's, by
    new_tensor); attention: the attention's form (ATTENTIONS)."""
    return (ActivationTensors.create(cfg, B, T, new_tensor, layer_tensor, attention),
            [BackwardScratch.create(cfg, B, T, make, attention=attention)
             for make in (stage_tensors or [new_tensor])])


# ---- generation (flow/batch.py)

@dataclass
class KVCache(SubBatchGroup):
    """The keys and values of the positions processed so far, per layer, in slots (one
    sequence each): created with B = the slots and T = Tc, the positions a slot holds
    (at most maxT), (B, NH, Tc, hs) each (the layout is explained in csrc/kernels/kvcache.c)."""
    k: list = per_layer(lambda d: (d.B, d.NH, d.T, d.C // d.NH))
    v: list = per_layer(lambda d: (d.B, d.NH, d.T, d.C // d.NH))


def _decode_fields():
    """DecodeTensors' fields: the rows' (token, slot, position); one of each of a transformer
    block's activations (ActivationTensors' per-layer fields, without att, whose place the
    cache takes)."""
    block = [(f.name, Tensor, single(f.metadata["shape"])) for f in fields(ActivationTensors)
             if f.metadata["layered"] and f.name != "att"]
    return [("idx", Tensor, single(lambda d: (d.B * d.T, 3), np.int32))] + block


# The buffers of a decode step of up to B x T rows (created with T = 1: B rows), each row one
# new position of one sequence, reused by every layer (a block's buffers have the names of
# ActivationTensors.layer(l); res3 is the residual stream, each block's input and output).
DecodeTensors = make_dataclass("DecodeTensors", _decode_fields(), bases=(SubBatchGroup,))


@dataclass
class HeadTensors(SubBatchGroup):
    """The final layernorm and the logits of up to B rows of a decode step (created with T = 1):
    a sequence's last row, whose logits give its next token."""
    lnf: Tensor = single(lambda d: (d.B, d.C))
    lnf_mean: Tensor = single(lambda d: (d.B,))
    lnf_rstd: Tensor = single(lambda d: (d.B,))
    logits: Tensor = single(lambda d: (d.B, d.Vp))
