"""Replay a recorded task graph on N k-core workers per process and R processes.

A list scheduler in the spirit of StarPU's eager/lws: tasks are taken in submission order;
each starts when its data dependencies allow (StarPU's sequential consistency: a read after
the last write, a write after the last write and the reads since) on the worker that can
start it first, filling idle gaps; a sub-batch's tasks stay on its worker when the placement
pins them (flow/placement.py), the other tasks go to any worker of their rank.

Gradients follow the placement's rule (placement.gradient_mode): a StarPU reduction gives
each worker a copy, zeroed by the first task that adds into it, and the copies are added into
the gradient before it is read; a chain needs nothing more than the dependencies.

Across R processes (StarPU-MPI) the step is spread as flow/placement.py spreads it: every
parameter slice has an owner (`owners`), which updates it; rank r runs its sub-batches' tasks,
or in a pipeline (`layer_stage`) stage s of data-parallel copy d (rank d * stages + s) runs
its layers' tasks of copy d's sub-batches (the embedding and the head are stage 0's; the
embedding adds its wte gradient into a tensor of its own, added into the head's after the
backward, as the engine does). Data lives where it was last written; a task reading it
elsewhere waits for a message. Each rank has a full-duplex link: a message takes the
sender's outgoing and the receiver's incoming side at once. Each rank adds its sub-batches'
gradient contributions into its own copy of a slice (the slices it owns: the gradient
itself); after the backward, slice by slice in update order, the owner receives each other
contributor's copy in rank order and adds it (one core), and the contributor zeroes its copy
(one core): taskflow.reduce_gradients. At the step's start the owners send the parameters
(their previous update) to the ranks that read them: slice by slice in the order the step
first reads them, each slice to the ranks in rank order (MPI progresses the posted sends
together; a slice at a time approximates that fair share).
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from .._clib import ffi, lib
from ..config import MODELS
from ..flow.taskflow import update_order
from .graph import R, REDUX, W, TaskGraph, task_layer
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


def slice_of(name: str):
    """(tensor name, layer, wte's row block or None) of a parameter, gradient or moment
    handle's name ("grad.qkvw[3]" -> ("qkvw", 3), "m.wte[1]" -> ("wte", 1)), None for any
    other handle."""
    kind, _, rest = name.partition(".")
    if kind not in ("param", "grad", "m", "v"):
        return None
    base, _, l = rest.partition("[")
    return base, int(l[:-1]) if l else None


def homes(graph: TaskGraph, owners: dict) -> list:
    """The rank holding each handle of graph at the step's start (None: none yet): a
    parameter slice's, its gradient's and moments' owner; a gradient norm partial's (k-th
    of update order) its gradient's owner, the norm's sums rank 0."""
    order = update_order(MODELS[graph.model], graph.wte_blocks)
    out = []
    for name, _ in graph.handles:
        key = slice_of(name)
        if key is not None:
            out.append(owners.get(key, 0))
        elif name.startswith("gradnorm["):
            k = int(name[len("gradnorm["):-1])
            out.append(owners.get(order[k], 0) if k < len(order) else 0)
        else:
            out.append(None)
    return out


def simulate(graph: TaskGraph, cost: CostModel, workers: int, cores: int, ranks: int = 1,
             pinned: bool = True, redux: int = 0, ranks_per_node: int = 1,
             owners: dict | None = None, layer_stage: tuple = (), extra: list | None = None) -> Schedule:
    """The schedule of one step of graph (recorded with all ranks' sub-batches) on `workers`
    workers of `cores` cores in each of `ranks` processes. owners: {(tensor name, layer, wte's
    row block or None): rank} of every parameter slice (placement.Topology's, for the graph's
    wte blocks; default: all on rank 0); layer_stage: the pipeline stage of each layer
    (default: no pipeline); extra: seconds added to each task (by index: its worker waits for
    the disk, memory.py). The schedule's notes["starts"] are the tasks' start times."""
    stages = max(layer_stage, default=0) + 1
    copies = ranks // stages
    S = graph.sub_batches // copies if copies * stages == ranks else 0
    if S * copies != graph.sub_batches:
        raise ValueError("the graph's sub-batches do not split over the ranks")
    home = homes(graph, owners or {})
    # the rank of each task: its sub-batch's copy and its layer's stage; an update's, the
    # rank holding what it writes first
    rank_of = []
    for task in graph.tasks:
        if task.sub is not None:
            layer = task_layer(graph, task) if stages > 1 else None
            rank_of.append(task.sub // S * stages + (0 if layer is None else layer_stage[layer]))
        else:
            written = [h for h, mode in task.accesses if mode & W]
            rank_of.append(home[written[0]] or 0 if written else 0)
    last_sub = max((i for i, t in enumerate(graph.tasks) if t.sub is not None), default=-1)

    # workers streaming at once on a node, sharing its memory bandwidth: a sub-batch's tasks
    # run beside the other sub-batches' only (S < N leaves workers idle), the updates on all
    busy_subs = min(workers, S) * ranks_per_node
    node_workers = workers * ranks_per_node
    wk = [[Resource() for _ in range(workers)] for _ in range(ranks)]
    out_port = [Resource() for _ in range(ranks)]     # each rank's link, sending
    in_port = [Resource() for _ in range(ranks)]      # and receiving
    sent, received = [0] * ranks, [0] * ranks
    # per handle (the graph's, then each rank's copy of a gradient slice it does not own):
    size = [n for _, n in graph.handles]
    where = list(home)          # the rank holding its latest version
    write_end = [0.0] * len(size)   # end of the last write (or of the reduction)
    read_end = [0.0] * len(size)    # latest end of the reads since (messages included)
    cp_write = [0.0] * len(size)    # the same on the critical path (no resource limits)
    cp_read = [0.0] * len(size)
    held = {}                   # handle -> {rank: arrival of its latest version there}
    contribution = {}           # (gradient, rank) -> that rank's copy of it
    pending = {}                # handle -> {worker: end of its last contribution}
    cp_pending = {}             # handle -> latest contribution end on the critical path
    zeroed = set()              # (handle, worker) reduction copies zeroed this step
    end_all = cp_end_all = 0.0
    notes = {"reduction_s": 0.0, "transfer_s": 0.0,
             "backward_end_s": [0.0] * ranks}     # each rank's last sub-batch task's end
    starts = notes["starts"] = []

    def place(rank, ready, dur, only=None):
        """Start a job of dur on the worker of rank (or `only`) that starts it first."""
        pool = [only] if only is not None else range(workers)
        best = min(pool, key=lambda w: wk[rank][w].earliest(ready, dur))
        start = wk[rank][best].earliest(ready, dur)
        return best, start, wk[rank][best].take(start, dur)

    # Without a core of its own for StarPU-MPI's progression thread (every core of the node
    # runs a worker), a message also takes the receiving rank's core while it copies.
    shares_cores = ranks > 1 and workers * cores * ranks_per_node >= cost.machine.cores

    def send(src, dst, ready, nbytes):
        """A message of nbytes from rank src to rank dst, ready at `ready`, on the links:
        (start, arrival)."""
        d = cost.transfer(nbytes)
        start = earliest_together(out_port[src], in_port[dst], ready, d)
        out_port[src].take(start, d)
        in_port[dst].take(start, d)
        notes["transfer_s"] += d
        sent[src] += nbytes
        received[dst] += nbytes
        return start, start + d

    def arrival(message, dst):
        """When a message's data is usable on dst: it also takes a core of dst to copy."""
        start, arrive = message
        if shares_cores:
            arrive = max(arrive, place(dst, start, arrive - start)[2])
        return arrive

    # the parameters: the owners send them at the step's start (see the module's docstring);
    # a message is on the links from here, the copy on the receiver's core when it is read
    reads = {}                  # (parameter, reading rank) in the order of the first reads
    for i, task in enumerate(graph.tasks):
        for h, mode in task.accesses:
            if mode & R and graph.handles[h][0].startswith("param.") and home[h] != rank_of[i]:
                reads.setdefault((h, rank_of[i]), None)
    first = {}
    for h, _ in reads:
        first.setdefault(h, len(first))
    messages = {(h, r): send(home[h], r, 0.0, size[h])
                for h, r in sorted(reads, key=lambda hr: (first[hr[0]], hr[1]))}

    def new_handle(nbytes, rank):
        for lst, v in ((size, nbytes), (where, rank), (write_end, 0.0), (read_end, 0.0),
                       (cp_write, 0.0), (cp_read, 0.0)):
            lst.append(v)
        return len(size) - 1

    # A pipeline's embedding adds its wte gradient into a tensor of its own per copy
    # (placement.embedding_wte_grads), added into the wte gradient after the backward
    # (taskflow.reduce_gradients): one chain through the head's additions and the
    # embedding's would hold each micro-batch's backward until the one before had finished.
    embedding_wte = {}          # (wte gradient block, rank) -> the rank's embedding's own

    def embedding_own(h, rank):
        if (h, rank) not in embedding_wte:
            embedding_wte[(h, rank)] = new_handle(size[h], rank)
        return embedding_wte[(h, rank)]

    def added_into(h, rank):
        """The handle rank's contributions to gradient h go into: h on its owner, else the
        rank's own copy."""
        if home[h] == rank:
            return h
        if (h, rank) not in contribution:
            contribution[(h, rank)] = new_handle(size[h], rank)
        return contribution[(h, rank)]

    def reduce_locally(v):
        """Add the workers' reduction copies of v into it, on the rank holding it."""
        nonlocal end_all
        rank, t = where[v], 0.0
        add = cost.add(size[v])
        for _w, end in sorted(pending.pop(v).items()):
            _, _, t = place(rank, max(t, end), add)
            notes["reduction_s"] += add
        write_end[v] = max(write_end[v], t)
        end_all = max(end_all, write_end[v])
        cp_write[v] = cp_read[v] = max(cp_write[v], cp_pending.pop(v, 0.0) + add)

    def run(rank, dur, accesses, only=None, into=frozenset()):
        """One task on rank (on worker `only`, else the first free) of dur seconds:
        accesses ((handle, mode), ...), adding a reduction contribution into the handles
        `into`. Returns its end."""
        nonlocal end_all, cp_end_all
        ready = cp_ready = 0.0
        for v, mode in accesses:
            if v not in into and v in pending:
                reduce_locally(v)
            if mode & R and v not in into and where[v] not in (None, rank):
                there = held.setdefault(v, {})
                if rank not in there:
                    message = messages.pop((v, rank), None) or \
                        send(where[v], rank, write_end[v], size[v])
                    there[rank] = arrival(message, rank)
                    read_end[v] = max(read_end[v], message[1])
                ready = max(ready, there[rank])
                cp_ready = max(cp_ready, cp_write[v] + cost.transfer(size[v]))
            ready = max(ready, write_end[v])
            cp_ready = max(cp_ready, cp_write[v])
            if mode & (W | REDUX):
                ready = max(ready, read_end[v])
                cp_ready = max(cp_ready, cp_read[v])
        w, start, end = place(rank, ready, dur, only)
        end_all = max(end_all, end)
        cp_end = cp_ready + dur
        cp_end_all = max(cp_end_all, cp_end)
        for v, mode in accesses:
            if v in into:
                pending.setdefault(v, {})[w] = end
                cp_pending[v] = max(cp_pending.get(v, 0.0), cp_end)
            elif mode & W:
                write_end[v], read_end[v] = end, end
                cp_write[v], cp_read[v] = cp_end, cp_end
                where[v] = rank
                held.pop(v, None)
            else:
                read_end[v] = max(read_end[v], end)
                cp_read[v] = max(cp_read[v], cp_end)
        return end

    def reduce_gradients():
        """taskflow.reduce_gradients: each other contributor's copy of a slice added into
        it on its owner, in rank order, then zeroed on the contributor; slice by slice in
        update order (wte's row blocks in their order)."""
        grads = {slice_of(name): h for h, (name, _) in enumerate(graph.handles)
                 if name.startswith("grad.")}
        for (h, q), e in sorted(embedding_wte.items()):
            run(q, cost.add(size[h]), ((added_into(h, q), R | W), (e, R)))
            run(q, cost.zero(size[h], task=True), ((e, W),))
            notes["reduction_s"] += cost.add(size[h])
        for key in update_order(MODELS[graph.model], graph.wte_blocks):
            h = grads[key]
            for q in sorted(q for g, q in contribution if g == h):
                v = contribution[(h, q)]
                run(home[h], cost.add(size[h]), ((h, R | W), (v, R)))
                run(q, cost.zero(size[h], task=True), ((v, W),))
                notes["reduction_s"] += cost.add(size[h])

    for i, task in enumerate(graph.tasks):
        rank = rank_of[i]
        only = (task.sub % S) % workers if (task.sub is not None and pinned) else None
        k = 1 if task.codelet in SEQUENTIAL else cores
        dur = cost.task(task.codelet, task.flops, task.nbytes, k,
                        node_workers if task.sub is None else busy_subs)
        if extra is not None:
            dur += extra[i]
        apart = stages > 1 and task.codelet == "encoder_backward"
        accesses = tuple((h if h not in task.grads else embedding_own(h, rank)
                          if apart and slice_of(graph.handles[h][0])[0] == "wte"
                          else added_into(h, rank), mode) for h, mode in task.accesses)
        into = frozenset(v for (v, _), (h, _) in zip(accesses, task.accesses)
                         if redux and h in task.grads and v not in embedding_wte.values())
        # a worker's first contribution to a gradient zeroes its copy (inline init)
        w_guess = only if only is not None else 0
        for v in sorted(into):
            if (v, w_guess) not in zeroed:
                zeroed.add((v, w_guess))
                dur += cost.zero(size[v])
        end = run(rank, dur, accesses, only, into)
        starts.append(end - dur)
        if task.sub is not None:
            notes["backward_end_s"][rank] = max(notes["backward_end_s"][rank], end)
        if i == last_sub and ranks > 1:
            reduce_gradients()
    for v in list(pending):
        reduce_locally(v)
    makespan = end_all
    notes["link_out_s"] = [p.busy for p in out_port]
    notes["link_in_s"] = [p.busy for p in in_port]
    busy = [r.busy for ranks_w in wk for r in ranks_w]
    return Schedule(step_s=makespan + cost.machine.step_ms * 1e-3, critical_path_s=cp_end_all,
                    idle=[max(0.0, 1 - b / makespan) if makespan else 0.0 for b in busy],
                    busy_s=busy, tasks=len(graph.tasks), tokens=graph.B * graph.T,
                    sent=sent, received=received, notes=notes)
