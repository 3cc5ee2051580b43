"""Replay a recorded task graph on N k-core workers per process and R processes.

A list scheduler in the spirit of StarPU's eager/lws: tasks are taken in submission order;
each starts when its data dependencies allow (StarPU's sequential consistency: a read after
the last write, a write after the last write and the reads since) on the worker that can
start it first, filling idle gaps; a sub-batch's tasks stay on its worker when the placement
pins them (flow/placement.py), updates and reductions go to any worker of rank 0.

Gradients follow the placement's rule (placement.gradient_mode): a StarPU reduction gives
each worker a copy, zeroed by the first task that adds into it, and the copies are added into
the gradient before it is read; a chain needs nothing more than the dependencies. Across R
processes (StarPU-MPI), each rank's copies are summed locally, then sent to rank 0 (StarPU
1.3: each rank to rank 0 in turn; 1.4: a binary tree) and added there; a rank other than 0
receives each parameter from rank 0 before its first task that reads it.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from .._clib import ffi, lib
from .graph import REDUX, W, TaskGraph
from .model import CostModel


def _sequential_codelets() -> frozenset:
    names = (ffi.string(lib.sl_codelet_name(i)).decode() for i in range(lib.sl_codelet_count()))
    return frozenset(n for i, n in enumerate(names) if lib.sl_codelet_sequential(i) == 1)


SEQUENTIAL = _sequential_codelets()


class Resource:
    """A worker (or a link): busy intervals, and the earliest start of a job in its gaps."""

    def __init__(self):
        self.gaps = []          # sorted (start, end) idle intervals before `tail`
        self.tail = 0.0         # idle from here on
        self.busy = 0.0

    def earliest(self, ready: float, dur: float) -> float:
        for s, e in self.gaps:
            start = max(s, ready)
            if start + dur <= e:
                return start
        return max(self.tail, ready)

    def take(self, start: float, dur: float) -> float:
        end = start + dur
        self.busy += dur
        if start >= self.tail:
            if start > self.tail:
                self.gaps.append((self.tail, start))
            self.tail = end
            return end
        i = bisect.bisect_right(self.gaps, (start, math.inf)) - 1
        s, e = self.gaps[i]
        assert s <= start and end <= e + 1e-12
        new = [(s, start)] if start > s else []
        if e > end:
            new.append((end, e))
        self.gaps[i:i + 1] = new
        return end


@dataclass
class Schedule:
    step_s: float               # predicted step time (makespan plus the step's fixed cost)
    critical_path_s: float      # the longest chain of dependent tasks, with no worker limit
    idle: list                  # each worker's idle share of the makespan
    busy_s: list
    tasks: int
    tokens: int
    notes: dict = field(default_factory=dict)

    @property
    def tokens_per_ms(self) -> float:
        return self.tokens / (self.step_s * 1e3)


def simulate(graph: TaskGraph, cost: CostModel, workers: int, cores: int, ranks: int = 1,
             pinned: bool = True, redux: int = 0, tree: bool = True,
             ranks_per_node: int = 1) -> Schedule:
    """The schedule of one step of graph (recorded with ranks x sub-batches-per-rank
    sub-batches) on `workers` workers of `cores` cores in each of `ranks` processes."""
    S = graph.sub_batches // ranks
    if S * ranks != graph.sub_batches:
        raise ValueError("the graph's sub-batches do not split over the ranks")
    # workers streaming at once on a node, sharing its memory bandwidth: a sub-batch's tasks
    # run beside the other sub-batches' only (S < N leaves workers idle), the updates on all
    busy_subs = min(workers, S) * ranks_per_node
    node_workers = workers * ranks_per_node
    wk = [[Resource() for _ in range(workers)] for _ in range(ranks)]
    link = [Resource() for _ in range(ranks)]   # each rank's network link
    nh = len(graph.handles)
    write_end = [0.0] * nh      # end of the last write (or of the reduction) of each handle
    read_end = [0.0] * nh       # latest end of the reads since
    cp_write = [0.0] * nh       # the same on the critical path (no resource limits)
    cp_read = [0.0] * nh
    pending = {}                # gradient h -> {(rank, worker): end of its last contribution}
    cp_pending = {}             # gradient h -> latest contribution end on the critical path
    copies = set()              # (h, rank, worker) zeroed this step
    arrived = {}                # (rank, h) -> arrival of a parameter from rank 0
    cp_end_all = 0.0
    end_all = 0.0
    redux_notes = {"reduction_s": 0.0, "transfer_s": 0.0}

    def place(rank, ready, dur, only=None):
        """Start a job of dur on the worker of rank (or `only`) that starts it first."""
        pool = [only] if only is not None else range(workers)
        best = min(pool, key=lambda w: wk[rank][w].earliest(ready, dur))
        start = wk[rank][best].earliest(ready, dur)
        return best, start, wk[rank][best].take(start, dur)

    # Without a core of its own for StarPU-MPI's progression thread (every core of the node
    # runs a worker), a transfer also takes the receiving rank's core while it copies.
    shares_cores = ranks > 1 and workers * cores * ranks_per_node >= cost.machine.cores

    def receive(src, dst, ready, nbytes):
        """A message of nbytes from rank src to rank dst, ready at `ready`: its arrival."""
        d = cost.transfer(nbytes)
        port = link[0 if src == 0 else dst]   # rank 0's broadcasts share its link; a
        start = port.earliest(ready, d)        # reduction's messages queue on the receiver's
        arrive = port.take(start, d)
        redux_notes["transfer_s"] += d
        if shares_cores:
            arrive = max(arrive, place(dst, start, d)[2])
        return arrive

    def reduce(h):
        """Sum the copies of gradient h into it (on rank 0): local sums, then across ranks."""
        nonlocal end_all
        parts = {}
        nbytes = graph.bytes_of(h)
        add = cost.add(nbytes)
        for (rank, _w), end in sorted(pending.pop(h).items()):
            ready = max(parts.get(rank, 0.0), end)
            _, _, parts[rank] = place(rank, ready, add)   # this copy into the rank's sum
            redux_notes["reduction_s"] += add
        order = sorted(parts.items())
        if len(order) > 1 and not tree:
            (r0, t0), rest = order[0], order[1:]
            for r, t in rest:        # StarPU 1.3: every rank sends to the owner in turn
                arrive = receive(r, r0, t, nbytes)
                _, _, t0 = place(r0, max(t0, arrive), add)
            order = [(r0, t0)]
        while len(order) > 1:        # StarPU 1.4: a binary tree towards the owner
            nxt = []
            for i in range(0, len(order), 2):
                if i + 1 == len(order):
                    nxt.append(order[i])
                    continue
                (rd, td), (rs, ts) = order[i], order[i + 1]
                arrive = receive(rs, rd, ts, nbytes)
                _, _, t = place(rd, max(td, arrive), add)
                nxt.append((rd, t))
            order = nxt
        write_end[h] = max(write_end[h], order[0][1])
        end_all = max(end_all, write_end[h])
        cp_write[h] = cp_read[h] = max(cp_write[h], cp_pending.pop(h, 0.0) + add)

    for task in graph.tasks:
        rank = 0 if task.sub is None else task.sub // S
        only = (task.sub % S) % workers if (task.sub is not None and pinned) else None
        k = 1 if task.codelet in SEQUENTIAL else cores
        dur = cost.task(task.codelet, task.flops, task.nbytes, k,
                        node_workers if task.sub is None else busy_subs)
        ready = cp_ready = 0.0
        for h, mode in task.accesses:
            as_redux = redux and h in task.grads
            if not as_redux and h in pending:
                reduce(h)
            if rank != 0 and graph.handles[h][0].startswith("param.") and (rank, h) not in arrived:
                arrived[(rank, h)] = receive(0, rank, write_end[h], graph.bytes_of(h))
            ready = max(ready, write_end[h], arrived.get((rank, h), 0.0))
            cp_ready = max(cp_ready, cp_write[h])
            if mode & (W | REDUX):
                ready = max(ready, read_end[h])
                cp_ready = max(cp_ready, cp_read[h])
        extra = 0.0
        if redux and task.grads:
            # a worker's first contribution to a gradient zeroes its copy (inline init)
            w_guess = only if only is not None else 0
            for h in task.grads:
                if (h, rank, w_guess) not in copies:
                    copies.add((h, rank, w_guess))
                    extra += cost.zero(graph.bytes_of(h))
        w, start, end = place(rank, ready, dur + extra, only)
        end_all = max(end_all, end)
        cp_end = cp_ready + dur + extra
        cp_end_all = max(cp_end_all, cp_end)
        for h, mode in task.accesses:
            if redux and h in task.grads:
                pending.setdefault(h, {})[(rank, w)] = end
                cp_pending[h] = max(cp_pending.get(h, 0.0), cp_end)
            elif mode & W:
                write_end[h], read_end[h] = end, end
                cp_write[h], cp_read[h] = cp_end, cp_end
            else:
                read_end[h] = max(read_end[h], end)
                cp_read[h] = max(cp_read[h], cp_end)
    for h in list(pending):
        reduce(h)
    makespan = end_all
    busy = [r.busy for ranks_w in wk for r in ranks_w]
    return Schedule(step_s=makespan + cost.machine.step_ms * 1e-3, critical_path_s=cp_end_all,
                    idle=[max(0.0, 1 - b / makespan) if makespan else 0.0 for b in busy],
                    busy_s=busy, tasks=len(graph.tasks), tokens=graph.B * graph.T,
                    notes=redux_notes)
