"""Replay a recorded task graph (graph.py: the step of R ranks of N workers, each task at the
site the engine gave it) on k-core workers.

A list scheduler in the spirit of StarPU's eager/lws: tasks are taken in submission order;
each starts when its data dependencies allow (StarPU's sequential consistency: a read after
the last write, a write after the last write and the reads since) on its rank: on the worker
the engine pinned it to, else on the rank's worker that can start it first, filling idle gaps.
A task the engine left to StarPU-MPI (rank OWNER) runs, as StarPU-MPI runs it, on the owner of
the first handle it writes.

What StarPU does beside the tasks is modelled here. A handle accessed in STARPU_REDUX mode
(the engine's choice: topology.gradient_mode) gives each worker a copy, zeroed inside the task
that first adds into it, and the copies are added into the handle before its next other
access. Data lives where it was last written (at the start: on its owner); a task reading it
on another rank waits for a message. Each rank has a full-duplex link: a message takes the
sender's outgoing and the receiver's incoming side at once. At the step's start the owners
send the parameters (their previous update) to the ranks that read them: slice by slice in
the order the step first reads them, each slice to the ranks in rank order (MPI progresses the
posted sends together; a slice at a time approximates that fair share). The engine's own
reduction across ranks (taskflow.reduce_gradients: add and zero tasks) is in the graph.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from .._clib import ffi, lib
from .graph import R, REDUX, W, TaskGraph
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


def earliest_together(a: Resource, b: Resource, ready: float, dur: float) -> float:
    """The earliest start >= ready at which both a and b are idle for dur."""
    while True:
        t = a.earliest(ready, dur)
        u = b.earliest(t, dur)
        if u == t:
            return t
        ready = u


@dataclass
class Schedule:
    step_s: float               # predicted step time (makespan plus the step's fixed cost)
    critical_path_s: float      # the longest chain of dependent tasks, with no worker limit
    idle: list                  # each worker's idle share of the makespan
    busy_s: list
    tasks: int
    tokens: int
    sent: list = field(default_factory=list)       # bytes each rank sends in the step
    received: list = field(default_factory=list)   # bytes each rank receives
    notes: dict = field(default_factory=dict)

    @property
    def tokens_per_ms(self) -> float:
        return self.tokens / (self.step_s * 1e3)


class _Replay:
    """One step of a graph being scheduled: the ranks' workers and links, and per handle where
    its latest version is and when it was last written and read."""

    def __init__(self, graph: TaskGraph, cost: CostModel, cores_per_worker: int,
                 ranks_per_node: int):
        self.graph, self.cost, self.cores_per_worker = graph, cost, cores_per_worker
        ranks, self.workers = graph.ranks, graph.workers
        S = graph.subs_per_copy or graph.sub_batches
        # workers streaming at once on a node, sharing its memory bandwidth: a sub-batch's
        # tasks run beside the other sub-batches' only (S < N leaves workers idle), the
        # updates on all
        self.busy_subs = min(self.workers, S) * ranks_per_node
        self.node_workers = self.workers * ranks_per_node
        # Without a core of its own for StarPU-MPI's progression thread (every core of the
        # node runs a worker), a message also takes the receiving rank's core while it copies.
        self.shares_cores = (ranks > 1 and self.workers * cores_per_worker * ranks_per_node
                             >= cost.machine.cores)
        self.wk = [[Resource() for _ in range(self.workers)] for _ in range(ranks)]
        self.out_port = [Resource() for _ in range(ranks)]     # each rank's link, sending
        self.in_port = [Resource() for _ in range(ranks)]      # and receiving
        self.sent, self.received = [0] * ranks, [0] * ranks
        self.size = [n for _, n in graph.handles]
        n = len(self.size)
        self.home = ([o if o is not None else 0 for o in graph.owners] if graph.owners
                     else [0] * n)
        self.where = list(self.home)     # the rank holding each handle's latest version
        self.write_end = [0.0] * n       # end of the last write (or of the reduction)
        self.read_end = [0.0] * n        # latest end of the reads since (messages included)
        self.cp_write = [0.0] * n        # the same on the critical path (no resource limits)
        self.cp_read = [0.0] * n
        self.held = {}          # handle -> {rank: arrival of its latest version there}
        self.pending = {}       # handle -> {worker: end of its last contribution}
        self.cp_pending = {}    # handle -> latest contribution end on the critical path
        self.zeroed = set()     # (handle, worker) reduction copies zeroed this step
        self.end_all = self.cp_end_all = 0.0
        self.notes = {"reduction_s": 0.0, "transfer_s": 0.0,
                      "backward_end_s": [0.0] * ranks, "starts": []}
        self.rank_of = [self.rank(t) for t in graph.tasks]
        self.messages = self.parameters_sent()

    def rank(self, task) -> int:
        """The engine's rank of a task, else the owner of the first handle it writes."""
        if task.rank is not None:
            return task.rank
        written = [h for h, mode in task.accesses if mode & (W | REDUX)]
        return self.home[written[0]] if written else 0

    def place(self, rank, ready, dur, only=None):
        """Start a job of dur on the worker of rank (or `only`) that starts it first:
        (worker, start, end)."""
        wk = self.wk[rank]
        best = min([only] if only is not None else range(self.workers),
                   key=lambda w: wk[w].earliest(ready, dur))
        start = wk[best].earliest(ready, dur)
        return best, start, wk[best].take(start, dur)

    def send(self, src, dst, ready, nbytes):
        """A message of nbytes from rank src to rank dst, ready at `ready`, on the links:
        (start, arrival)."""
        d = self.cost.transfer(nbytes)
        start = earliest_together(self.out_port[src], self.in_port[dst], ready, d)
        self.out_port[src].take(start, d)
        self.in_port[dst].take(start, d)
        self.notes["transfer_s"] += d
        self.sent[src] += nbytes
        self.received[dst] += nbytes
        return start, start + d

    def arrival(self, message, dst):
        """When a message's data is usable on dst: it also takes a core of dst to copy."""
        start, arrive = message
        if self.shares_cores:
            arrive = max(arrive, self.place(dst, start, arrive - start)[2])
        return arrive

    def parameters_sent(self) -> dict:
        """The parameters the owners send at the step's start (see the module's docstring),
        {(handle, reading rank): message}: on the links from here, the copy on the
        receiver's core when it is read."""
        reads = {}              # (parameter, reading rank) in the order of the first reads
        for i, task in enumerate(self.graph.tasks):
            for h, mode in task.accesses:
                if (mode & R and self.graph.handles[h][0].startswith("param.")
                        and self.home[h] != self.rank_of[i]):
                    reads.setdefault((h, self.rank_of[i]), None)
        first = {}
        for h, _ in reads:
            first.setdefault(h, len(first))
        return {(h, r): self.send(self.home[h], r, 0.0, self.size[h])
                for h, r in sorted(reads, key=lambda hr: (first[hr[0]], hr[1]))}

    def reduce_locally(self, v):
        """Add the workers' reduction copies of v into it, on the rank holding it."""
        rank, t = self.where[v], 0.0
        add = self.cost.add(self.size[v])
        for _w, end in sorted(self.pending.pop(v).items()):
            _, _, t = self.place(rank, max(t, end), add)
            self.notes["reduction_s"] += add
        self.write_end[v] = max(self.write_end[v], t)
        self.end_all = max(self.end_all, self.write_end[v])
        self.cp_write[v] = self.cp_read[v] = max(self.cp_write[v],
                                                 self.cp_pending.pop(v, 0.0) + add)

    def ready(self, rank, accesses, into):
        """(when a task on rank with these accesses may start, the same on the critical
        path): after its data, received on rank if they are elsewhere."""
        ready = cp_ready = 0.0
        for v, mode in accesses:
            if v not in into and v in self.pending:
                self.reduce_locally(v)
            if mode & R and v not in into and self.where[v] not in (None, rank):
                there = self.held.setdefault(v, {})
                if rank not in there:
                    message = (self.messages.pop((v, rank), None)
                               or self.send(self.where[v], rank, self.write_end[v], self.size[v]))
                    there[rank] = self.arrival(message, rank)
                    self.read_end[v] = max(self.read_end[v], message[1])
                ready = max(ready, there[rank])
                cp_ready = max(cp_ready, self.cp_write[v] + self.cost.transfer(self.size[v]))
            ready = max(ready, self.write_end[v])
            cp_ready = max(cp_ready, self.cp_write[v])
            if mode & (W | REDUX):
                ready = max(ready, self.read_end[v])
                cp_ready = max(cp_ready, self.cp_read[v])
        return ready, cp_ready

    def run(self, rank, dur, accesses, only=None, into=frozenset()):
        """One task on rank (on worker `only`, else the first free) of dur seconds:
        accesses ((handle, mode), ...), adding a reduction contribution into the handles
        `into`. Returns its end."""
        ready, cp_ready = self.ready(rank, accesses, into)
        w, start, end = self.place(rank, ready, dur, only)
        self.end_all = max(self.end_all, end)
        cp_end = cp_ready + dur
        self.cp_end_all = max(self.cp_end_all, cp_end)
        for v, mode in accesses:
            if v in into:
                self.pending.setdefault(v, {})[w] = end
                self.cp_pending[v] = max(self.cp_pending.get(v, 0.0), cp_end)
            elif mode & W:
                self.write_end[v] = self.read_end[v] = end
                self.cp_write[v] = self.cp_read[v] = cp_end
                self.where[v] = rank
                self.held.pop(v, None)
            else:
                self.read_end[v] = max(self.read_end[v], end)
                self.cp_read[v] = max(self.cp_read[v], cp_end)
        return end

    def duration(self, task) -> float:
        """A task's seconds: the cost model's, at the reduction rates for the engine's own
        reduction across ranks (add and zero tasks, after the backward)."""
        if task.sub is None and task.codelet in ("add", "zero"):
            written = self.size[task.accesses[0][0]]
            if task.codelet == "zero":
                return self.cost.zero(written, task=True)
            self.notes["reduction_s"] += self.cost.add(written)
            return self.cost.add(written)
        cores = 1 if task.codelet in SEQUENTIAL else self.cores_per_worker
        return self.cost.task(task.codelet, task.flops, task.nbytes, cores,
                              self.node_workers if task.sub is None else self.busy_subs)

    def step(self, extra) -> Schedule:
        """Every task in submission order, then the reductions still pending."""
        for i, task in enumerate(self.graph.tasks):
            rank, only = self.rank_of[i], task.worker
            dur = self.duration(task) + (extra[i] if extra is not None else 0.0)
            into = frozenset(h for h, mode in task.accesses if mode & REDUX)
            # a worker's first contribution to a gradient zeroes its copy (inline init)
            w_guess = only if only is not None else 0
            for v in sorted(into):
                if (v, w_guess) not in self.zeroed:
                    self.zeroed.add((v, w_guess))
                    dur += self.cost.zero(self.size[v])
            end = self.run(rank, dur, task.accesses, only, into)
            self.notes["starts"].append(end - dur)
            if task.sub is not None:
                ends = self.notes["backward_end_s"]
                ends[rank] = max(ends[rank], end)
        for v in list(self.pending):
            self.reduce_locally(v)
        makespan = self.end_all
        self.notes["link_out_s"] = [p.busy for p in self.out_port]
        self.notes["link_in_s"] = [p.busy for p in self.in_port]
        busy = [r.busy for ranks_w in self.wk for r in ranks_w]
        return Schedule(step_s=makespan + self.cost.machine.step_ms * 1e-3,
                        critical_path_s=self.cp_end_all,
                        idle=[max(0.0, 1 - b / makespan) if makespan else 0.0 for b in busy],
                        busy_s=busy, tasks=len(self.graph.tasks),
                        tokens=self.graph.B * self.graph.T, sent=self.sent,
                        received=self.received, notes=self.notes)


def simulate(graph: TaskGraph, cost: CostModel, cores_per_worker: int, ranks_per_node: int = 1,
             extra: list | None = None) -> Schedule:
    """The schedule of one step of graph on its ranks and workers, each worker of
    cores_per_worker cores; extra: seconds added to each task (by index: its worker waits for
    the disk, memory.py). The schedule's notes["starts"] are the tasks' start times."""
    return _Replay(graph, cost, cores_per_worker, ranks_per_node).step(extra)
