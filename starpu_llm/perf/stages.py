"""What each layer of one micro-batch costs, for the pipeline's stage boundaries
(plan/topology.stage_layers): the training step's task flow (flow/taskflow.py) walked with
an executor that runs nothing and adds up each task's predicted time (model.CostModel, from
the codelet's declared flop count and its buffers' bytes) under the layer it belongs to.

A task belongs to the head (stage 0, with the embedding) when it touches wte, wpe, lnfw or
lnfb or no per-layer tensor at all (the loss), else to the last layer whose tensors it touches
(block l also reads its input, block l-1's output). The matmuls of a small micro-batch run well below the sgemm rate while the lm head's
stays near it: balancing by flops alone put 3 of GPT-2 124M's 12 blocks beside the head where
a trace of 2 ranks (micro-batches of 2 sequences) showed the head worth 2.3 blocks, not 5.4.
"""
from __future__ import annotations

import re

from .._clib import ffi, lib
from ..kernels.codelets import TABLE, add_methods, split_call
from ..model.config import GPTConfig, ParamLayout
from ..flow import taskflow
from ..flow.tensors import ActivationTensors, BackwardScratch, ParameterTensors, Tensor
from .model import CostModel

HEAD_TENSORS = ("wte", "wpe", "lnfw", "lnfb")
_LAYER = re.compile(r"\[(\d+)\]$")


class _CostOps:
    """taskflow's executor that runs nothing: each task's predicted seconds go to its layer
    (costs[l]) or to the head (costs[None])."""

    def __init__(self, cost: CostModel, cores_per_worker: int):
        self.cost, self.cores_per_worker = cost, cores_per_worker
        self.costs = {}

    def at(self, where):
        return self


def _account(self, cd, args, kwargs):
    kwargs.pop("redux", None)
    buffers, scalars = split_call(cd, args, kwargs)
    counts = ffi.new("size_t[]", [t.size for t in buffers] or 1)
    a = ffi.new(cd.args_type + " *", scalars) if cd.has_args else ffi.NULL
    flops = lib.sl_codelet_flops(cd.id, counts, len(buffers), a)
    nbytes = sum(t.size * t.dtype.itemsize for t in buffers)
    names = [t.name for t in buffers]
    layers = {int(m.group(1)) for m in map(_LAYER.search, names) if m}
    head = any(n.split(".")[-1].split("[")[0] in HEAD_TENSORS for n in names)
    key = None if head or not layers else max(layers)   # a block reads its input, res3[l-1]
    self.costs[key] = (self.costs.get(key, 0.0)
                       + self.cost.task(cd.name, flops, nbytes, self.cores_per_worker, 1))


add_methods(_CostOps, TABLE, _account)


def layer_costs(config: GPTConfig, B: int, T: int, cost: CostModel, cores_per_worker: int = 1):
    """(head seconds, [block l's seconds]) of one micro-batch of B x T tokens, forward and
    backward, each task on a worker of cores_per_worker cores."""
    layout = ParamLayout(config)
    p, g = (ParameterTensors.of_shapes(kind, layout) for kind in ("param", "grad"))
    tensor = lambda name, shape, dtype: Tensor(name, shape, dtype)    # noqa: E731
    a = ActivationTensors.create(config, B, T, tensor)
    s = BackwardScratch.create(config, B, T, tensor)
    ops = _CostOps(cost, cores_per_worker)
    taskflow.forward(ops, config, p, a, B, T)
    taskflow.backward(ops, config, p, g, a, [s], B, T, 1.0, 0)
    return ops.costs.get(None, 0.0), [ops.costs.get(l, 0.0) for l in range(config.L)]
