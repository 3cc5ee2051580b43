"""Training under a memory budget (--memory-limit, --offload-dir): the runtime's part.

StarPU caps the main memory it allocates at the limit and evicts what it allocated to a disk
memory node in a folder of our own (csrc/starpu/ooc.c): a new folder under --offload-dir
(default: the system's temporary folder), removed when StarPU stops, also after Ctrl-C or an
error (the Runtime stops StarPU then; and at exit). Which tensors StarPU allocates, and so may
evict, flow/handles.py decides (all of them under a limit).
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
from dataclasses import dataclass

from .. import signals
from .._clib import ffi, lib
from ..errors import StarpuLLMError, opt
from . import cgroups

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}

# What a run's peak RSS may exceed its memory limit by: what is not StarPU's data, the
# interpreter, numpy, the compiled modules, StarPU's and MPI's own state, OpenBLAS's buffers,
# the tokenizer, the token shard's pages read so far; measured 60-100 MiB here for every model
# (tests/test_offload.py checks it, docs/offload.md gives the measurements).
RSS_OVERHEAD = 150 << 20


def parse_size(text) -> int:
    """Bytes of a size such as 12G, 1.5G, 800M, 65536 (K, M, G, T: powers of 1024; an
    optional trailing B or iB)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([KMGT]?)(?:I?B)?\s*", str(text).upper())
    if not m:
        raise StarpuLLMError(f"{opt('memory_limit')} {text!r}: give a size such as 12G, 1.5G or "
                             f"800M (powers of 1024)")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def physical_memory() -> int:
    """Bytes of main memory of this machine."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def available_memory() -> int:
    """Bytes of main memory available to a new allocation now: MemAvailable (or the physical
    memory where the kernel does not say), and no more than this process's memory cgroups
    leave (a container's limit: /proc/meminfo is the host's there)."""
    have = physical_memory()
    try:
        with open("/proc/meminfo") as f:
            have = next(int(line.split()[1]) * 1024 for line in f
                        if line.startswith("MemAvailable:"))
    except (OSError, ValueError, IndexError, StopIteration):
        pass
    return min(have, cgroup_memory_left())


# the files of a memory cgroup, v2 and v1: (limit, usage, reclaimable in memory.stat)
_MEMORY_FILES = {"v2": ("memory.max", "memory.current", "inactive_file"),
                 "v1": ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")}


def cgroup_memory_left() -> float:
    """Bytes the memory cgroups of this process allow it yet (a container's --memory, a
    systemd unit's MemoryMax, a Slurm job's): the least over its groups and those above them
    (cgroups.controller_groups) of the limit less the usage, the inactive page cache counted
    free as the kubelet counts it; inf without one."""
    left = float("inf")
    for version, folders in cgroups.controller_groups("memory"):
        limit_file, usage_file, reclaimable = _MEMORY_FILES[version]
        for group in folders:
            try:
                limit = open(os.path.join(group, limit_file)).read().strip()
                if limit == "max" or int(limit) >= 1 << 60:       # v1's "no limit"
                    continue
                used = int(open(os.path.join(group, usage_file)).read())
                stat = dict(l.split() for l in open(os.path.join(group, "memory.stat"))
                            if l.strip())
                left = min(left, max(0, int(limit) - used + int(stat.get(reclaimable, 0))))
            except (OSError, ValueError):
                continue
    return left


def format_size(n: float) -> str:
    """A byte count as GiB (one decimal), MiB, or KiB below one MiB."""
    if n >= 1 << 30:
        return f"{n / (1 << 30):.1f} GiB"
    return f"{n / (1 << 20):.0f} MiB" if n >= 1 << 20 else f"{n / (1 << 10):.0f} KiB"


@dataclass(frozen=True)
class MemoryLimit:
    """A memory budget: StarPU allocates at most `limit` bytes of main memory and evicts to a
    folder made under `offload_dir` (None: the system's temporary folder)."""
    limit: int
    offload_dir: str | None = None

    @classmethod
    def of(cls, memory_limit, offload_dir=None) -> "MemoryLimit | None":
        """The budget of the settings (None without a memory limit)."""
        if memory_limit is None:
            if offload_dir is not None:
                raise StarpuLLMError(f"{opt('offload_dir')} is where {opt('memory_limit')} evicts "
                                     f"to: give {opt('memory_limit')} too")
            return None
        limit = parse_size(memory_limit)
        if limit < 1 << 20:
            raise StarpuLLMError(f"{opt('memory_limit')} {memory_limit}: give at least 1M")
        if limit > physical_memory():
            raise StarpuLLMError(f"{opt('memory_limit')} {memory_limit} is above this machine's "
                                 f"memory ({format_size(physical_memory())}): a limit only helps "
                                 f"below it; give less, or leave it out")
        return cls(limit, offload_dir)


class OffloadFolder:
    """A new folder for the evicted data under parent (None: the system's temporary folder),
    made now and removed by remove() (also at exit, should nobody call it)."""

    def __init__(self, parent: str | None):
        parent = parent or tempfile.gettempdir()
        what = f"{opt('offload_dir')} {parent}" if parent else "the temporary folder"
        if not os.path.isdir(parent):
            raise StarpuLLMError(f"{what} is not a folder; give an existing, writable folder")
        try:
            self.path = tempfile.mkdtemp(prefix="starpu-llm-offload-", dir=parent)
        except OSError as e:
            raise StarpuLLMError(f"cannot write in {what}: {e.strerror}; give a writable "
                                 f"folder") from None
        signals.remove_if_killed(self.path)

    def free_bytes(self) -> int:
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize

    def remove(self):
        shutil.rmtree(self.path, ignore_errors=True)
        signals.forget(self.path)


def start(memory: MemoryLimit | None) -> OffloadFolder | None:
    """Before StarPU starts: the limit and the disk node's folder for it (None: no limit)."""
    folder = OffloadFolder(memory.offload_dir) if memory else None
    ret = lib.sl_set_memory_limit(memory.limit if memory else 0,
                                  folder.path.encode() if folder else ffi.NULL)
    if ret != 0:
        if folder:
            folder.remove()
        raise StarpuLLMError(f"{opt('memory_limit')}: StarPU is running already ({ret})")
    return folder


def traffic() -> tuple[int, int]:
    """(bytes read from, bytes written to) the disk node since StarPU started."""
    read, written = ffi.new("uint64_t *"), ffi.new("uint64_t *")
    lib.sl_ooc_traffic(read, written)
    return int(read[0]), int(written[0])


def memory_used() -> int:
    """Bytes of main memory StarPU has allocated now (counted against the limit)."""
    return int(lib.sl_memory_used())
