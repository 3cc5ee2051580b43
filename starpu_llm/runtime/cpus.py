"""CPU numbers as StarPU takes them: hwloc's logical index (STARPU_WORKERS_CPUID, the
workers' binding, StarPU-MPI's thread), not the OS's (sched_getaffinity, taskset), which
differ where a core's hyperthreads are numbered apart; and how a STARPU_WORKERS_CPUID list
places team workers; and which CPUs are cores: StarPU runs one worker a core, not one a
hardware thread, and so do the partition and each task's team (two threads of a kernel on one
core share its FMA units)."""
from __future__ import annotations

import errno
import functools
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
    return _by_core(cpus, sysfs)[0]


def _by_core(cpus, sysfs: str | None = None) -> tuple[list[list[int]], int | None]:
    """(core_groups' groups, the most hardware threads a core has among those whose siblings
    could be read: None where none could), sysfs read once a CPU."""
    groups: dict[frozenset, list[int]] = {}
    most = None
    for c in sorted(cpus):
        core = _siblings(c, sysfs or SYSFS)
        if core is not None:
            most = max(most or 0, len(core))
        groups.setdefault(core or frozenset([c]), []).append(c)
    return list(groups.values()), most


@functools.lru_cache(maxsize=None)
def _siblings(cpu: int, sysfs: str) -> frozenset | None:
    """The hardware threads of cpu's core (the OS's numbers, Linux's thread_siblings_list);
    None where they cannot be read. Read once a process (the sampler asks at every decode
    step: a file a CPU on a 128-core node)."""
    try:
        with open(f"{sysfs}/cpu{cpu}/topology/thread_siblings_list") as f:
            return frozenset(cpu_list(f.read())) or None
    except (OSError, ValueError):
        return None


def core_cpus(cpus=None, sysfs: str | None = None) -> list[int]:
    """The CPUs (the OS's numbers) this process runs workers and teams on: the first hardware
    thread of each core it may use (its affinity mask by default), as StarPU places workers;
    the first n of each with StarPU's STARPU_NTHREADS_PER_CORE=n (hyperthreads used on
    purpose)."""
    cpus = os.sched_getaffinity(0) if cpus is None else cpus
    text = os.environ.get("STARPU_NTHREADS_PER_CORE", "1")
    try:
        n = int(text)
    except ValueError:
        n = None
    # StarPU 1.3 aborts below 1 (an assertion) and, placing workers itself (one core a
    # worker, no STARPU_WORKERS_CPUID), above the threads its cores have
    groups, most = _by_core(cpus, sysfs)
    if n is None or n < 1 or (most is not None and n > most):
        allowed = ("1 or more" if most is None else "1 (a core has one here)" if most == 1
                   else f"1 to {most} (the threads a core has here)")
        raise StarpuLLMError(f"STARPU_NTHREADS_PER_CORE={text!r}: give a whole number of "
                             f"hardware threads a core, {allowed}, or unset it")
    return [c for group in groups for c in group[:n]]


def listed_cores(text: str) -> list[int]:
    """The CPUs of a STARPU_WORKERS_CPUID value, in order, as StarPU reads it (cpu_list; a-
    up to StarPU's last CPU, starpu_cpu_count)."""
    open_range = any(w.endswith("-") for w in text.replace(",", " ").split())
    try:
        cores = cpu_list(text, last=starpu_cpu_count() - 1 if open_range else None)
    except ValueError:
        raise StarpuLLMError(f"{VARIABLE}={text!r}: give CPU numbers or ranges (such as "
                             f"0-7) separated by spaces or commas, or unset it") from None
    if not cores:
        raise StarpuLLMError(f"{VARIABLE} is empty: give CPU numbers, or unset it")
    return cores


def check_listed(text: str) -> None:
    """A STARPU_WORKERS_CPUID value that StarPU can read: CPUs of the topology StarPU loads
    (StarPU 1.3 crashed on others): hwloc's PUs, those of this process's cpuset (a
    container's, a Slurm job's), fewer than the host's os.cpu_count() there; os.cpu_count()
    in a build without hwloc."""
    cores = listed_cores(text)
    have = starpu_cpu_count()
    if max(cores) >= have:
        raise StarpuLLMError(f"{VARIABLE}={text!r} names CPU {max(cores)}, and StarPU has "
                             f"CPUs 0 to {have - 1} here: give CPUs of this machine (of this "
                             f"job's or container's share; hwloc's logical numbers, lstopo's "
                             f"L#), or unset it")


def starpu_cpu_count() -> int:
    """How many CPUs StarPU numbers here (sl_cpu_count: hwloc's PUs of the topology it loads,
    numbered 0 to n - 1: this process's cpuset's, fewer than os.cpu_count() in a container or
    a Slurm job; os.cpu_count() without hwloc)."""
    from .._clib import lib
    n = lib.sl_cpu_count()
    if n == -errno.ENOSYS:        # no hwloc: StarPU numbers CPUs as the OS does
        return os.cpu_count() or 1
    if n <= 0:
        raise StarpuLLMError(f"{VARIABLE} cannot be checked: hwloc, whose CPU numbers StarPU "
                             f"takes, could not load this machine's topology "
                             f"({errno.errorcode.get(-n, n)}): see what lstopo says, or unset "
                             f"{VARIABLE}")
    return n


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
