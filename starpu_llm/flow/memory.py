"""What a training step needs in main memory, from the task flow and the tensors' shapes:
the bytes one task holds at once (its buffers: StarPU fetches all of them into main memory
before it runs, and can evict none while it runs) and the step's whole footprint (every
tensor). Under --memory-limit the first bounds the cap from below, the second is what StarPU
may have to put on disk; the benchmark's caps are fractions of a run's footprint.
"""
from __future__ import annotations

from typing import NamedTuple

from ..errors import StarpuLLMError, opt
from ..kernels.codelets import TABLE, add_methods, split_call
from ..model.config import AdamW, GPTConfig, ParamLayout
from . import taskflow
from .tensors import ActivationTensors, BackwardScratch, ParameterTensors, Tensor


class StepNeeds(NamedTuple):
    largest_task: int        # bytes of the buffers of the step's largest task
    largest_name: str        # its codelet (and the tensor it writes first)
    footprint: int           # bytes of every tensor of a process (one copy of each)


def nbytes(t: Tensor) -> int:
    return t.size * t.dtype.itemsize


class _TaskBytes:
    """taskflow's executor that runs nothing: the largest sum of one task's buffers."""

    def __init__(self):
        self.largest = (0, "")

    def at(self, where):
        return self


def _account(self, cd, args, kwargs):
    kwargs.pop("redux", None)
    buffers, _ = split_call(cd, args, kwargs)
    distinct = {id(t): t for t in buffers}.values()
    n = sum(nbytes(t) for t in distinct)
    if n > self.largest[0]:
        self.largest = (n, f"{cd.name} ({buffers[0].name})")


add_methods(_TaskBytes, TABLE, _account)


def step_needs(config: GPTConfig, B: int, T: int, sub_batches: int = 1,
               attention: str = "gemm") -> StepNeeds:
    """The needs of a step of `sub_batches` sub-batches of B sequences of T tokens each, with
    gradient clipping (its tasks too), in one process holding every tensor; attention: the
    attention's form (tensors.ATTENTIONS)."""
    layout = ParamLayout(config)
    p, g, m, v = (ParameterTensors.of_shapes(kind, layout) for kind in ("param", "grad", "m", "v"))
    tensor = lambda name, shape, dtype: Tensor(name, shape, dtype)    # noqa: E731
    a = ActivationTensors.create(config, B, T, tensor, attention=attention)
    s = BackwardScratch.create(config, B, T, tensor, attention=attention)
    norm = [Tensor(f"gradnorm[{k}]", (1,), "float64") for k in range(taskflow.norm_nodes(config))]
    ops = _TaskBytes()
    taskflow.forward(ops, config, p, a, B, T)
    taskflow.backward(ops, config, p, g, a, [s], B, T, 1.0, 0)
    taskflow.update(ops, config, p, g, m, v, AdamW(1e-4, grad_clip=1.0), 1, norm)
    return StepNeeds(ops.largest[0], ops.largest[1],
                     footprint(config, B, T, sub_batches, attention=attention))


def minimum_limit(config: GPTConfig, needs: StepNeeds, sub_batches: int,
                  workers: int) -> tuple[int, str]:
    """(bytes, why): the least --memory-limit a process of `workers` workers (each runs a task
    at a time: team or parallel workers) can train `sub_batches` sub-batches under, their
    step_needs `needs`: what each worker's largest task holds at once and, where the
    sub-batches add their gradients through a reduction, each worker's copy of every gradient
    (StarPU never evicts those)."""
    from ..plan.topology import gradient_mode
    minimum = workers * needs.largest_task
    why = f"{needs.largest_name} holds {_size(needs.largest_task)} of buffers, x {workers} worker(s)"
    if gradient_mode(workers, True, sub_batches):
        copies = workers * 4 * ParamLayout(config).total
        minimum += copies
        why += f", and the workers' reduction copies of the gradients, {_size(copies)}"
    return minimum, why


def check_limit(limit: int, config: GPTConfig, needs: StepNeeds, sub_batches: int,
                workers: int, advice: str = "") -> None:
    """One clear error when --memory-limit `limit` is below minimum_limit (the run refuses it
    before its first step; predict refuses it as the run would); `advice` ends the message."""
    minimum, why = minimum_limit(config, needs, sub_batches, workers)
    if limit < minimum:
        raise StarpuLLMError(f"{opt('memory_limit')} {_size(limit)} cannot hold what the tasks "
                             f"need at once ({why}): give at least {-(-minimum // (1 << 20))}M"
                             f"{advice}")


def _size(n: int) -> str:
    from ..runtime.offload import format_size    # here: this module loads no StarPU binding
    return format_size(n)


def group_bytes(group, config: GPTConfig, B: int, T: int, attention: str = "gemm") -> int:
    """Bytes of the tensors of one tensors.SubBatchGroup (its class) created for B x T."""
    new = lambda name, shape, dtype: Tensor(name, shape, dtype)    # noqa: E731
    return sum(nbytes(t) for t in group.create(config, B, T, new, attention=attention).tensors())


def footprint(config: GPTConfig, B: int, T: int, sub_batches: int = 1, state_copies: int = 4,
              attention: str = "gemm") -> int:
    """Bytes of every tensor of a process running `sub_batches` sub-batches of B sequences of
    T tokens: state_copies of the parameters (parameters, gradients, two AdamW moments), and
    each sub-batch's activations and backward scratch (attention: the attention's form,
    tensors.ATTENTIONS)."""
    per_sub = sum(group_bytes(group, config, B, T, attention)
                  for group in (ActivationTensors, BackwardScratch))
    return 4 * state_copies * ParamLayout(config).total + sub_batches * per_sub
