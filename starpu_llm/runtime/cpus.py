"""CPU numbers as StarPU takes them: hwloc's logical index (STARPU_WORKERS_CPUID, the
workers' binding, StarPU-MPI's thread), not the OS's (sched_getaffinity, taskset), which
differ where a core's hyperthreads are numbered apart; and how a STARPU_WORKERS_CPUID list
places team workers; and which CPUs are cores: StarPU runs one worker a core, not one a
hardware thread, and so do the partition and each task's team (two threads of a kernel on one
core share its FMA units)."""
from __future__ import annotations

import errno
import os

from ..errors import StarpuLLMError

VARIABLE = "STARPU_WORKERS_CPUID"
SYSFS = "/sys/devices/system/cpu"

# The list pin_rank set for this process's rank (its cores, in StarPU's numbers): the
# variable holding exactly that is ours, read as the partition's cores; any other is the
# user's (team_cores).
pinned: str | None = None


def cpu_indexes(ids, to_logical: bool = True) -> list[int]:
    """CPUs ids converted from the OS's numbers to hwloc's logical ones, or back
    (sl_cpu_indexes); the same numbers where this build has no hwloc (StarPU then numbers as
    the OS does)."""
    from .._clib import ffi, lib
    ids = [int(i) for i in ids]
    if not ids:
        return ids
    out = ffi.new("int[]", len(ids))
    ret = lib.sl_cpu_indexes(ffi.new("int[]", ids), out, len(ids), int(to_logical))
    if ret == -errno.EINVAL:
        raise StarpuLLMError(f"CPU(s) {ids}: not all are CPUs this process may use (hwloc)")
    if ret not in (0, -errno.ENOSYS):
        raise RuntimeError(f"sl_cpu_indexes failed ({ret})")
    return list(out)


def cpu_list(text: str, last: int | None = None) -> list[int]:
    """The CPUs of a list such as "0-3,8 10" (a cgroup's cpuset, STARPU_WORKERS_CPUID), in
    order: numbers and ranges separated by spaces or commas, "a-" up to `last` where given;
    ValueError for anything else."""
    cores = []
    for word in text.replace(",", " ").split():
        first, dash, end = word.partition("-")
        if dash and not end and last is None:
            raise ValueError(word)
        cores += range(int(first), (int(end) if end else last if dash else int(first)) + 1)
    return cores


def core_groups(cpus, sysfs: str | None = None) -> list[list[int]]:
    """`cpus` (the OS's numbers) grouped by core, each core's hardware threads among them in
    order, the cores in the order of their first (Linux's thread_siblings_list; a CPU whose
    siblings cannot be read is a core of its own)."""
    groups: dict[frozenset, list[int]] = {}
    for c in sorted(cpus):
        try:
            with open(f"{sysfs or SYSFS}/cpu{c}/topology/thread_siblings_list") as f:
                core = frozenset(cpu_list(f.read()))
        except (OSError, ValueError):
            core = frozenset([c])
        groups.setdefault(core, []).append(c)
    return list(groups.values())


def core_cpus(cpus=None, sysfs: str | None = None) -> list[int]:
    """The CPUs (the OS's numbers) this process runs workers and teams on: the first hardware
    thread of each core it may use (its affinity mask by default), as StarPU places workers;
    the first n of each with StarPU's STARPU_NTHREADS_PER_CORE=n (hyperthreads used on
    purpose)."""
    cpus = os.sched_getaffinity(0) if cpus is None else cpus
    try:
        n = max(1, int(os.environ.get("STARPU_NTHREADS_PER_CORE", "1")))
    except ValueError:
        raise StarpuLLMError(f"STARPU_NTHREADS_PER_CORE="
                             f"{os.environ['STARPU_NTHREADS_PER_CORE']!r}: give a whole "
                             f"number of hardware threads a core, or unset it") from None
    return [c for group in core_groups(cpus, sysfs) for c in group[:n]]


def listed_cores(text: str) -> list[int]:
    """The CPUs of a STARPU_WORKERS_CPUID value, in order, as StarPU reads it (cpu_list; a-
    up to the last CPU)."""
    try:
        cores = cpu_list(text, last=(os.cpu_count() or 1) - 1)
    except ValueError:
        raise StarpuLLMError(f"{VARIABLE}={text!r}: give CPU numbers or ranges (such as "
                             f"0-7) separated by spaces or commas, or unset it") from None
    if not cores:
        raise StarpuLLMError(f"{VARIABLE} is empty: give CPU numbers, or unset it")
    return cores


def check_listed(text: str) -> None:
    """A STARPU_WORKERS_CPUID value that StarPU can read: CPUs of this machine (StarPU 1.3
    crashed on others)."""
    cores = listed_cores(text)
    if max(cores) >= (os.cpu_count() or 1):
        raise StarpuLLMError(f"{VARIABLE}={text!r} names CPU {max(cores)}, and this machine "
                             f"has CPUs 0 to {(os.cpu_count() or 1) - 1}: give CPUs of this "
                             f"machine (hwloc's logical numbers, lstopo's L#), or unset it")


def team_cores(text: str, workers: int, k: int, gpus: int) -> list[int]:
    """The cores of a partition of team workers (workers x k, then one for each GPU's
    thread) from a STARPU_WORKERS_CPUID value. pin_rank's own list is the rank's cores in
    order. A user's is read as StarPU reads it, the GPUs' threads first, then either one CPU
    a worker (its team: that CPU and the next k - 1) or every team's CPUs in order (worker
    w's: entries w k to w k + k - 1); anything else is refused (cycled, teams would share
    cores)."""
    listed = listed_cores(text)
    if text == pinned:
        return listed
    gpu, cpu = listed[:gpus], listed[gpus:]
    if len(cpu) == workers and k > 1:
        cpu = [c + t for c in cpu for t in range(k)]
    elif len(cpu) < workers * k:
        raise StarpuLLMError(
            f"{VARIABLE}={text!r} lists {len(cpu)} CPU(s) for {workers} team worker(s) of {k} "
            f"cores{f' (after {gpus} for the GPUs)' if gpus else ''}: give one CPU a worker "
            f"({workers}: its team is that CPU and the next {k - 1}) or every team's CPUs in "
            f"order ({workers * k}), or unset it")
    return cpu[:workers * k] + gpu
