"""The task graph of one training step, exactly as the driver submits it.

A real StarPU engine runs one step in dry-run mode (sl_set_dry_run: every task goes through
StarPU, with its data handles, access modes and dependencies, and is traced, but its kernel is
skipped), so the graph holds the tasks, shapes and accesses of the real code path, in
submission order, in a fraction of a step's time (GPT-2 124M: ~5 ms of tasks plus the
engine's set-up). It is recorded on one one-core worker; the sub-batches' placement and the
gradients' reduction of a given partition are applied by the simulator (simulate.py) with the
placement's own rule (flow/placement.py, gradient_mode).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._clib import ffi, lib
from ..config import PARAMETER_SPECS, ROW_BLOCKED

# access bits of the trace (csrc/sl_api.h)
R, W, REDUX = lib.SL_ACCESS_R, lib.SL_ACCESS_W, lib.SL_ACCESS_REDUX


@dataclass(frozen=True)
class GraphTask:
    codelet: str
    flops: float            # as submitted (the C submit helper's count)
    nbytes: int             # the sum of its buffers' sizes
    sub: int | None         # the sub-batch whose activations it uses (None: updates, norm)
    accesses: tuple         # ((handle index, access bits), ...) in buffer order
    grads: frozenset        # handle indexes it adds a gradient contribution into


@dataclass
class TaskGraph:
    model: str
    B: int
    T: int
    sub_batches: int
    tasks: list             # GraphTask, in submission order
    handles: list           # (name, nbytes) by handle index

    def bytes_of(self, h: int) -> int:
        return self.handles[h][1]

    def is_gradient(self, h: int) -> bool:
        return self.handles[h][0].startswith("grad.")

    @property
    def wte_blocks(self) -> int:
        """wte's row blocks in this graph ("param.wte[b]")."""
        return sum(1 for name, _ in self.handles if name.startswith(f"param.{ROW_BLOCKED}["))


def handle_layer(name: str) -> int | None:
    """The layer of a per-layer tensor's handle: a block parameter's, gradient's or moment's
    ("grad.qkvw[3]": 3) or a sub-batch's per-layer activation ("s0.qkv[3]"); else None."""
    kind, _, rest = name.partition(".")
    base, bracket, index = rest.partition("[")
    if not bracket:
        return None
    if kind in ("param", "grad", "m", "v") and PARAMETER_SPECS[base].part != "block":
        return None
    return int(index[:-1])


def task_layer(graph: TaskGraph, task: GraphTask) -> int | None:
    """The transformer block a task belongs to: None for the embedding, the head and the loss
    (a task touching wte, wpe, lnfw or lnfb, or no per-layer tensor); else the layer of what
    it writes (layer l's first layernorm reads layer l-1's output), else of what it reads."""
    names = [(graph.handles[h][0], mode) for h, mode in task.accesses]
    for n, _ in names:
        kind, _, rest = n.partition(".")
        if kind in ("param", "grad") and PARAMETER_SPECS[rest.partition("[")[0]].part != "block":
            return None
    for writes in (True, False):
        layers = [handle_layer(n) for n, mode in names if bool(mode & (W | REDUX)) == writes]
        layers = [l for l in layers if l is not None]
        if layers:
            return layers[0]
    return None


def task_bytes(accesses, sizes) -> int:
    """A task's data size: the sum of its buffers' sizes (StarPU's own size of a task, that
    of its perf-model records)."""
    return sum(sizes[h] for h, _ in accesses)


def graph_from_events(events, table, model, B, T, sub_batches) -> TaskGraph:
    """The TaskGraph of traced events (TraceEvent with buffers), table: {handle address:
    (name, nbytes)}. Events are put back in submission order (their job numbers)."""
    index, handles = {}, []
    for addr, (name, nbytes) in table.items():
        index[addr] = len(handles)
        handles.append((name, nbytes))
    sizes = [n for _, n in handles]
    tasks = []
    for e in sorted((e for e in events if e.buffers is not None), key=lambda e: e.job):
        acc = tuple((index[h], mode) for h, mode in e.buffers)
        subs = {handles[h][0].split(".", 1)[0] for h, _ in acc}
        subs = {int(s[1:]) for s in subs if s[:1] == "s" and s[1:].isdigit()}
        sub = subs.pop() if len(subs) == 1 else None
        grads = frozenset(h for h, mode in acc if mode & (W | REDUX) and e.codelet != "adamw"
                          and handles[h][0].startswith("grad."))
        tasks.append(GraphTask(e.codelet, e.flops, task_bytes(acc, sizes), sub, acc, grads))
    return TaskGraph(model, B, T, sub_batches, tasks, handles)


def record(model: str, B: int, T: int, sub_batches: int = 1, grad_clip: float = 0.0,
           wte_blocks: int = 1) -> TaskGraph:
    """Record the task graph of one training step of `model` (a MODELS name) at batch B (split
    into sub_batches), sequence length T, wte in wte_blocks row blocks (what the placement
    gives the ranks: flow/placement.Topology.wte_blocks): a dry-run step on a fresh one-worker
    runtime (no runtime may be running in this process)."""
    from ..config import MODELS, ParamLayout
    from ..flow.engine import StarPUEngine
    from ..runtime.starpu import Runtime
    from ..state import TrainState

    config = MODELS[model]
    layout = ParamLayout(config)
    # the dry run reads nothing: zero pages, never touched
    state = TrainState(config=config, params=np.zeros(layout.total, np.float32))
    tokens = np.zeros(B * T + 1, np.uint16)
    with Runtime(1, 1) as rt:
        eng = StarPUEngine(config, state, B, T, tokens, rt, sub_batches=sub_batches,
                           wte_blocks=wte_blocks)
        try:
            table = {int(ffi.cast("uintptr_t", t.h)): (name, t.size * t.dtype.itemsize)
                     for name, t in eng.named_tensors()}
            lib.sl_set_dry_run(1)
            rt.start_trace(64 + 400 * config.L * sub_batches)
            try:
                with np.errstate(all="ignore"):     # the step's loss is of skipped kernels
                    eng.step(0, 0.0, 0.0, grad_clip)
                events = rt.trace()
            finally:
                rt.stop_trace()
                lib.sl_set_dry_run(0)
        finally:
            eng.close()
    graph = graph_from_events(events, table, model, B, T, sub_batches)
    if len(events) >= 64 + 400 * config.L * sub_batches:
        raise RuntimeError("the dry-run trace overflowed its buffer")
    return graph
