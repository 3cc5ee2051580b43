"""Multi-process data parallelism with StarPU-MPI (paper section 4).

One process per node, launched by mpirun. MPI is initialised by mpi4py; StarPU-MPI runs on
its communicator. Every process registers every handle and submits the whole task graph;
data ownership decides where each task runs: rank r owns its sub-batches' activations, rank 0
owns the parameters, gradients and AdamW moments. Gradients of all ranks are reduced to rank
0 by StarPU-MPI, rank 0 updates, and the next forward tasks on every rank receive the new
parameters through the graph's dependencies.
"""
from __future__ import annotations

import os
import sys
import traceback
from contextlib import contextmanager

from ..errors import StarpuLLMError
from .cgroups import controller_groups

# The environment that turns StarPU-MPI's communication statistics on (StarPU 1.3 reads the
# first, 1.4 the second, at the start): the bytes each rank sends (Runtime.bytes_sent).
COMM_STATS_ENV = {"STARPU_COMM_STATS": "1", "STARPU_MPI_STATS": "1"}


def traffic(comm, before: list, after: list, steps: int) -> list:
    """[(bytes sent, bytes received)] per step of every rank, from each rank's bytes_sent()
    before and after `steps` steps (every rank calls it; None when the statistics are off)."""
    if before is None or after is None or steps < 1:
        return None
    sent = [a - b for a, b in zip(after, before)]
    table = comm.allgather(sent)            # table[s][r]: bytes rank s sent to rank r
    R = len(table)
    return [(sum(table[r]) / steps, sum(table[s][r] for s in range(R)) / steps)
            for r in range(R)]


def launched_by_mpirun() -> bool:
    """True when this process is one of several started by an MPI launcher: Open MPI's
    mpirun, a PMI launcher (srun --mpi=pmi2, Hydra), or srun --mpi=pmix (PMIx names the rank;
    Slurm the step's tasks)."""
    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        if int(os.environ.get(var, "1") or 1) > 1:
            return True
    tasks = os.environ.get("SLURM_STEP_NUM_TASKS") or os.environ.get("SLURM_NTASKS") or "1"
    return "PMIX_RANK" in os.environ and tasks.isdigit() and int(tasks) > 1


def _to_stderr(text: str) -> None:
    print(f"warning: {text}", file=sys.stderr, flush=True)


def say_if_bound(same_node: list, warn=_to_stderr) -> None:
    """A warning (to warn: the run's, else stderr) when a launcher bound the ranks of a node
    (their CPUs, same_node) to fewer cores than their cgroup allows: mpirun's default
    binding, which a rank's default partition then takes as all it has. Under mpirun -np 1
    too (one process, no communicator: same_node its own CPUs). Cores counted once whatever
    their hardware threads (a rank bound to a core has its 2 threads)."""
    from .cpus import core_groups
    bound, allowed = set().union(*same_node), allowed_cpus()
    if not allowed or not bound <= allowed:
        return
    # in cores: a binding to one hardware thread of every core leaves the partition its cores
    cores, of = len(core_groups(bound)), len(core_groups(allowed))
    if cores < of:
        warn(f"the launcher bound this node's {len(same_node)} rank(s) to {cores} of the {of} "
             f"cores they may use "
             f"(Open MPI's mpirun binds each rank to a core for 2 ranks or fewer, to a socket "
             f"above): give mpirun --bind-to none to use them all (docs/clusters.md), unless "
             f"that binding is meant")


# the file of a cpuset cgroup with the CPUs its tasks may use, v2 and v1
_CPUSET_FILE = {"v2": "cpuset.cpus.effective", "v1": "cpuset.effective_cpus"}


def allowed_cpus() -> set[int] | None:
    """The CPUs this process's cgroup allows (cpuset: a Slurm job's, a container's), None
    where it cannot be read: what a launcher's own binding may narrow."""
    from .cpus import cpu_list
    for version, folders in controller_groups("cpuset"):
        try:
            cpus = set(cpu_list(open(os.path.join(folders[0], _CPUSET_FILE[version])).read()))
        except (OSError, ValueError):
            continue
        if cpus:
            return cpus
    return None


def world():
    """mpi4py's COMM_WORLD when several processes run, else None. Initialises MPI with
    MPI_THREAD_MULTIPLE (StarPU-MPI needs at least SERIALIZED)."""
    if not launched_by_mpirun():
        return None
    try:
        import mpi4py
        mpi4py.rc.thread_level = "multiple"
        from mpi4py import MPI
    except ImportError:
        raise StarpuLLMError("this run was started by mpirun but mpi4py is missing: "
                             "pip install --no-binary mpi4py mpi4py (built against this "
                             "MPI)") from None
    comm = MPI.COMM_WORLD
    if comm.Get_size() < 2:
        return None
    if MPI.Query_thread() < MPI.THREAD_SERIALIZED:
        raise StarpuLLMError("MPI provides less than MPI_THREAD_SERIALIZED, which StarPU-MPI "
                             "needs; use an MPI library built with thread support")
    return comm


def local_rank_and_size(comm) -> tuple[int, int]:
    """This process's index among the processes on its node, and their count."""
    from mpi4py import MPI
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_rank(), node.Get_size()
    finally:
        node.Free()


def pin_rank(comm, warn=_to_stderr) -> list[int]:
    """Give each rank on a shared node its own cores, for its StarPU workers and StarPU-MPI's
    communication thread, so ranks do not pile their threads on the same cores (StarPU would
    otherwise pin every rank's first worker to core 0). Returns this rank's cores.

    When mpirun already bound ranks to distinct cores, that binding is kept. With more ranks
    than cores (mpirun --oversubscribe on a small machine), ranks share cores round-robin.
    warn: where rank 0 says that a launcher's binding narrows the ranks (say_if_bound)."""
    lrank, lsize = local_rank_and_size(comm)
    mine = sorted(os.sched_getaffinity(0))
    masks = comm.allgather((os.uname().nodename, mine))
    same_node = [m for host, m in masks if host == os.uname().nodename]
    if comm.Get_rank() == 0:
        say_if_bound(same_node, warn)
    from . import cpus          # StarPU numbers CPUs by hwloc's logical index
    overlapping = any(set(m) & set(mine) for m in same_node[:lrank] + same_node[lrank + 1:])
    if overlapping and lsize > 1:
        # whole cores, each with its hardware threads: a rank's share of the OS's numbers
        # would be the other ranks' cores' second threads where the OS numbers them apart
        groups = cpus.core_groups(mine)
        per = len(groups) // lsize
        if per >= 1:
            groups = groups[lrank * per:(lrank + 1) * per]
        else:
            groups = [groups[lrank % len(groups)]]
        mine = [c for g in groups for c in g]
        os.sched_setaffinity(0, mine)
    # Workers on this rank's cores, from the first (the Runtime takes the first N x K); the
    # communication thread on the last of them unless the user chose (docs/clusters.md): a
    # partition of fewer cores than the rank has leaves that core to the thread alone, the
    # paper's reserved core, and the thread then spins (mpi_polling).
    mine = cpus.core_cpus(mine)
    logical = cpus.cpu_indexes(mine)
    if cpus.VARIABLE not in os.environ:
        cpus.pinned = os.environ[cpus.VARIABLE] = " ".join(map(str, logical))
    os.environ.setdefault("STARPU_MPI_THREAD_CPUID", str(logical[-1]))
    # starpu_mpi_init_conf would otherwise keep one core out of the workers for that thread
    os.environ.setdefault("STARPU_RESERVE_NCPU", "0")
    return mine


# How StarPU-MPI's progression thread waits for its requests (csrc/starpu/mpi_poll.c says why
# and how): "spin" (StarPU's own loop) where it has a core of its own, "backoff" (sleeps of at
# most BACKOFF_MAX_US between polls that find nothing) where it shares a worker's core.
# $STARPU_LLM_MPI_POLL=spin|backoff chooses instead.
MPI_POLLING = ("spin", "backoff")
BACKOFF_MAX_US = 200


def mpi_polling(worker_cores, env=os.environ) -> str:
    """How the progression thread of a rank whose workers run on worker_cores waits: "spin"
    when it is bound to a core no worker runs on (STARPU_MPI_THREAD_CPUID, set by pin_rank or
    by the user), else "backoff"; $STARPU_LLM_MPI_POLL overrides."""
    forced = env.get("STARPU_LLM_MPI_POLL")
    if forced:
        if forced not in MPI_POLLING:
            raise StarpuLLMError(f"STARPU_LLM_MPI_POLL={forced!r}: choose one of "
                                 f"{', '.join(MPI_POLLING)}")
        return forced
    cpu = env.get("STARPU_MPI_THREAD_CPUID", "")
    own_core = (cpu.lstrip("-").isdigit() and int(cpu) >= 0 and int(cpu) not in worker_cores
                and not int(env.get("STARPU_MPI_NOBIND", "0") or 0))
    return "spin" if own_core else "backoff"


class PeerFailed(StarpuLLMError):
    """Another rank failed before training; rank 0 reports its error (phase()), this rank
    ends quietly with the same exit status."""


@contextmanager
def phase(comm, what: str):
    """A step of the set-up that every rank ends together: `with phase(comm, "reading the
    inputs"): ...` runs the block on every rank, then the ranks meet. When the block failed on
    any rank, every rank raises the error of the lowest failing rank (fail_together); so an
    error on one rank (a file missing on one node) ends every rank at once with one message,
    instead of leaving the others waiting in their next collective call. An error of another
    kind than StarpuLLMError is a bug: the rank that has it prints its traceback and the others
    are told, naming `what` the phase does. comm None: a plain block."""
    if comm is None:
        yield
        return
    error = None
    try:
        yield
    except StarpuLLMError as e:
        error = (type(e), e.args[0])
    except Exception as e:
        traceback.print_exc()
        error = (StarpuLLMError, f"unexpected {type(e).__name__} while {what}: {e} (its "
                                 f"traceback is above; please report it)")
    failed = [(r, e) for r, e in enumerate(comm.allgather(error)) if e is not None]
    if failed:
        rank, (kind, message) = failed[0]
        if len(failed) == 1:
            where = f"rank {rank}: " if rank else ""
        elif len(failed) == comm.Get_size() and all(e[1] == message for _, e in failed):
            where = ""                                  # the same error everywhere
        else:
            where = f"rank {rank} (and {len(failed) - 1} more of the ranks that failed): "
        fail_together(comm, where + message, kind)


def same_everywhere(comm, settings: dict) -> None:
    """Fail together (fail_together) unless every rank has rank 0's settings (run_settings):
    ranks started with other arguments or files would train something else."""
    problem = differences(comm.allgather(settings))
    if problem:
        fail_together(comm, problem)


def fail_together(comm, message: str, kind=StarpuLLMError):
    """Raise the error that every rank knows of: a `kind` (a StarpuLLMError) on rank 0, which
    the CLI prints, PeerFailed on the others, which end quietly; both marked agreed, so that
    the CLI ends every rank normally rather than aborting the job."""
    e = kind(message) if comm.Get_rank() == 0 else PeerFailed(message)
    e.agreed = True
    raise e


def differences(all_settings: list) -> str | None:
    """The settings (run_settings, one dict per rank) that differ from rank 0's, in words;
    None when every rank has rank 0's."""
    ref = all_settings[0]
    for r, s in enumerate(all_settings):
        if s != ref:
            diffs = [f"{k}: rank 0 has {ref.get(k)!r}, rank {r} has {s.get(k)!r}"
                     for k in sorted(set(ref) | set(s), key=str) if ref.get(k) != s.get(k)]
            return ("the MPI ranks were started with different settings (" + "; ".join(diffs)
                    + "); start every rank with the same arguments and files")
    return None


def in_mpi_job():
    """COMM_WORLD when this process is one of several ranks of a running MPI job (MPI
    initialised by world(), not finalised), else None."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return None
    return mpi.COMM_WORLD if mpi.COMM_WORLD.Get_size() > 1 else None
