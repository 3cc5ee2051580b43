"""The disk node of the performance model: StarPU's main memory under a memory limit
(--memory-limit), replayed over a recorded task graph, task by task in the order they run:
which tensors StarPU evicts to the disk and which it reads back, so the bytes each task waits
for (predict.py adds their time at the disk's calibrated bandwidth).

The rules are StarPU 1.3's (src/datawizard/memalloc.c) as far as they decide the bytes moved:
  - every tensor is StarPU's (flow/handles.py under a limit), allocated when a task (or the
    initial fill) first uses it; StarPU counts each buffer's size against the limit;
  - a task's buffers are fetched into main memory before it runs: allocated, and read from
    the disk when their values are there and not in memory (a buffer it only writes is not
    read); each becomes the most recently used (the tail of StarPU's LRU list);
  - when an allocation does not fit, StarPU first reuses the memory of the least recently used
    buffer of the same size that no running task holds, else frees least recently used
    buffers (any size, not held) until twice the size needed is free; a buffer freed is
    written to the disk when it was changed since the disk last got it (dirty), else dropped;
  - after the backward the engine drops every activation and scratch buffer but the losses
    (StarPUEngine._activations_used: starpu_data_invalidate_submit), which StarPU does once
    its last task has run: it frees it, writes nothing;
  - StarPU frees a main-memory buffer at once (memalloc.c keeps no cache of them without
    pinned memory), and glibc gives one above its largest mmap threshold (MMAP_MAX) back to
    the system, so each allocation of such a buffer, but the reuse of a same-size one, is
    new memory: the task that first writes it also waits for the kernel to map and zero its
    pages (the bytes `allocated` before each task, which predict.py charges at the machine's
    first-touch rate). Smaller buffers come from glibc's heap, whose pages stay mapped.
Not modelled: prefetches (StarPU does not evict for one, so under a full cap they rarely find
room: they change when a read happens, not the bytes), and the asynchronous write-back of
dirty buffers when fewer than 5 % are clean (starpu_memchunk_tidy).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from ..flow.tensors import set_free_name
from .graph import R, REDUX, W, TaskGraph

RECLAIM = 2         # StarPU frees this many times the size it needs (memalloc.c)
MMAP_MAX = 32 << 20  # glibc's largest mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)


def dropped_after_use(name: str) -> bool:
    """Whether the engine drops a tensor at the end of each step: a sub-batch's activations and
    backward scratch ("s0.qkv[3]", "s1.stage1.dres"), not its losses."""
    head = name.split(".", 1)[0]
    return head[:1] == "s" and head[1:].isdigit() and not set_free_name(name).endswith(".losses")


@dataclass
class DiskTraffic:
    read: list          # bytes read from the disk before each task of the last step
    written: list       # bytes written to it to make room for each task
    allocated: list     # bytes of new memory allocated for each task
    steps: list         # (read, written) of each simulated step

    @property
    def step(self) -> tuple:
        """(bytes read, bytes written) of a step in the steady state: the last simulated."""
        return self.steps[-1]


class MainMemory:
    """StarPU's main-memory node under a limit of `cap` bytes, with a disk node behind it."""

    def __init__(self, sizes: list, cap: int):
        self.size, self.cap = sizes, cap
        self.used = 0
        self.lru = OrderedDict()        # resident handles, least recently used first
        self.dirty = set()              # resident handles the disk does not have as they are
        self.on_disk = set()            # handles whose values the disk holds
        self.valid = set()              # handles with values (written at least once)
        self.read = self.written = self.allocated = 0

    def _free(self, h: int) -> None:
        if h in self.dirty:
            self.written += self.size[h]
            self.on_disk.add(h)
            self.dirty.discard(h)
        del self.lru[h]
        self.used -= self.size[h]

    def _allocate(self, h: int, held: set) -> None:
        n = self.size[h]
        fresh = True
        if self.used + n > self.cap:
            same = next((v for v in self.lru if v not in held and self.size[v] == n), None)
            if same is not None:
                self._free(same)
                fresh = False           # its memory, already mapped, is reused
            else:
                freed = 0
                for v in [v for v in self.lru if v not in held]:
                    if freed >= RECLAIM * n:
                        break
                    freed += self.size[v]
                    self._free(v)
        self.used += n
        self.lru[h] = None
        if fresh and n > MMAP_MAX:
            self.allocated += n

    def task(self, accesses) -> tuple:
        """Run one task (its ((handle, access bits), ...)): (bytes read, bytes written) for it."""
        read0, written0 = self.read, self.written
        modes = {}
        for h, mode in accesses:
            modes[h] = modes.get(h, 0) | mode
        held = set(modes)
        for h, mode in modes.items():
            if h in self.lru:
                self.lru.move_to_end(h)
                continue
            self._allocate(h, held)
            if mode & (R | REDUX) and h in self.valid:
                self.read += self.size[h]       # fetched back from the disk
        for h, mode in modes.items():
            if mode & (W | REDUX):
                self.valid.add(h)
                self.dirty.add(h)
                self.on_disk.discard(h)
        return self.read - read0, self.written - written0

    def drop(self, h: int) -> None:
        """The engine's invalidation: values gone, memory freed, nothing written."""
        if h in self.lru:
            del self.lru[h]
            self.used -= self.size[h]
        for s in (self.dirty, self.on_disk, self.valid):
            s.discard(h)


def replay(graph: TaskGraph, order: list, cap: int, steps: int = 3) -> DiskTraffic:
    """The disk traffic of `steps` consecutive steps of graph, its tasks run in `order`
    (indexes into graph.tasks), under a cap of `cap` bytes, after the engine's initial fill
    (the parameters, gradients and moments written in one after the other)."""
    memory = MainMemory([n for _, n in graph.handles], cap)
    for h, (name, _) in enumerate(graph.handles):
        if name.split(".", 1)[0] in ("param", "grad", "m", "v"):
            memory.task(((h, W),))
    last_use = {}
    for i in order:
        for h, _ in graph.tasks[i].accesses:
            last_use[h] = i
    dropped = {}
    for h, i in last_use.items():
        if dropped_after_use(graph.handles[h][0]):
            dropped.setdefault(i, []).append(h)
    per_step, read, written, allocated = [], [], [], []
    for _ in range(steps):
        read, written = [0] * len(graph.tasks), [0] * len(graph.tasks)
        allocated = [0] * len(graph.tasks)
        r0, w0 = memory.read, memory.written
        for i in order:
            a0 = memory.allocated
            read[i], written[i] = memory.task(graph.tasks[i].accesses)
            allocated[i] = memory.allocated - a0
            for h in dropped.get(i, ()):
                memory.drop(h)
        per_step.append((memory.read - r0, memory.written - w0))
    return DiskTraffic(read, written, allocated, per_step)
