"""The task graph of one training step, exactly as the driver submits it, and where each task
runs, as the engine places it.

A real StarPU engine runs one step in dry-run mode (sl_set_dry_run: every task goes through
StarPU, with its data handles, access modes and dependencies, and is traced, but its kernel is
skipped), so the graph holds the tasks, shapes and accesses of the real code path, in
submission order, in a fraction of a step's time (GPT-2 124M: ~5 ms of tasks plus the
engine's set-up). The engine is made for the partition predicted (a plan/sites.Sites: R ranks,
pipeline stages, owners, N workers, pinning, schedule) in this one process, which plays every
rank (StarPUEngine's `sites`): it registers every rank's handles with their owners and submits
the whole step, the cross-rank gradient reduction included, each task with the site the
engine gives it there. The simulator (simulate.py) replays it as it is; it decides nothing
the engine decides.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._clib import ffi, lib
from ..model.config import PARAMETER_SPECS, ROW_BLOCKED
from ..plan.sites import ANY, OWNER, Sites

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
    rank: int | None = None     # the rank the engine gave it (None: the owner of what it writes)
    worker: int | None = None   # the worker it gave it (None: the scheduler's choice)
    priority: int = 0


@dataclass
class TaskGraph:
    model: str
    B: int
    T: int
    sub_batches: int        # of all ranks
    tasks: list             # GraphTask, in submission order
    handles: list           # (name, nbytes) by handle index
    owners: list | None = None  # the rank owning each handle (None: the rank writing it)
    ranks: int = 1
    workers: int = 1        # per rank
    subs_per_copy: int | None = None   # sub-batches (micro-batches) per data-parallel copy

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


def graph_from_events(events, table, model, B, T, sub_batches, sites=None, owners=None,
                      where=None) -> TaskGraph:
    """The TaskGraph of traced events (TraceEvent with buffers), table: {handle address:
    (name, nbytes)}. Events are put back in submission order (their job numbers). With a
    recorded partition: sites (its Sites), owners ({handle address: rank}) and where
    ({submission number: (codelet, the Where of that task)}): the graph keeps those submissions' events
    alone (not the tasks StarPU makes for its reductions), each with its site."""
    index, handles = {}, []
    for addr, (name, nbytes) in table.items():
        index[addr] = len(handles)
        handles.append((name, nbytes))
    sizes = [n for _, n in handles]
    tasks = []
    for e in sorted((e for e in events if e.buffers is not None), key=lambda e: e.job):
        site = None
        if where is not None:   # one of the engine's submissions (not StarPU's own tasks)
            codelet, site = where.get(e.job, (None, None))
            if codelet != e.codelet:
                continue
        acc = tuple((index[h], mode) for h, mode in e.buffers)
        subs = {handles[h][0].split(".", 1)[0] for h, _ in acc}
        subs = {int(s[1:]) for s in subs if s[:1] == "s" and s[1:].isdigit()}
        sub = subs.pop() if len(subs) == 1 else None
        grads = frozenset(h for h, mode in acc if mode & (W | REDUX) and e.codelet != "adamw"
                          and handles[h][0].startswith(("grad.", "grad@")))
        rank = worker = None
        if site is not None:
            rank = None if site.node == OWNER else site.node
            worker = None if site.worker == ANY else site.worker
        tasks.append(GraphTask(e.codelet, e.flops, task_bytes(acc, sizes), sub, acc, grads,
                               rank, worker, e.priority))
    graph = TaskGraph(model, B, T, sub_batches, tasks, handles)
    if sites is not None:
        graph.owners = [owners.get(addr) for addr in table]
        graph.ranks, graph.workers = sites.topology.ranks, sites.workers
        graph.subs_per_copy = sites.subs_per_copy
    return graph


def record(model: str, B: int, T: int, sites: Sites, grad_clip: float = 0.0,
           attention: str | None = None) -> TaskGraph:
    """Record the task graph of one training step of `model` (a MODELS name) at batch B (all
    ranks'), sequence length T, on the partition of `sites` (its ranks, owners, workers,
    sub-batches per copy): a dry-run step of an engine made for those sites in this process
    (on a fresh one-worker runtime: no runtime may be running in this process), with the
    attention's form `attention` (None: a CPU run's default)."""
    from ..model.config import MODELS, AdamW, ParamLayout
    from ..flow.engine import StarPUEngine
    from ..plan.partition import PartitionRequest
    from ..runtime.starpu import Runtime, resolve_here
    from ..model.state import TrainState

    config = MODELS[model]
    layout = ParamLayout(config)
    # the dry run reads nothing: zero pages, never touched
    state = TrainState(config=config, params=np.zeros(layout.total, np.float32))
    tokens = np.zeros(B * T + 1, np.uint16)
    subs = sites.subs_per_copy * sites.topology.copies
    capacity = 64 + 600 * config.L * subs
    request = PartitionRequest(workers=1, cores_per_worker=1, attention=attention)
    with Runtime(resolve_here(request)) as rt:
        eng = StarPUEngine(config, state, B, T, tokens, rt, sites=sites)
        try:
            table = {int(ffi.cast("uintptr_t", t.h)): (name, t.size * t.dtype.itemsize)
                     for name, t in eng.named_tensors()}
            lib.sl_set_dry_run(1)
            rt.start_trace(capacity)
            try:
                with np.errstate(all="ignore"):     # the step's values are of skipped kernels
                    eng.submit_forward_backward(0)
                    eng.submit_update(AdamW(0.0, grad_clip=grad_clip))
                    eng.wait()
                events = rt.trace()
            finally:
                rt.stop_trace()
                lib.sl_set_dry_run(0)
        finally:
            eng.close()
    if len(events) >= capacity:
        raise RuntimeError("the dry-run trace overflowed its buffer")
    return graph_from_events(events, table, model, B, T, subs, sites, eng.handles.owner_of,
                             eng.ops.sites)
