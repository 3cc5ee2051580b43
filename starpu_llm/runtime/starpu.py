"""The StarPU runtime as a Python object: start, partition the cores, stop cleanly.

StarPU must be shut down before the interpreter exits (otherwise Python crashes at exit), also
after Ctrl-C: the Runtime registers its shutdown with atexit. StarPU chains SIGINT, so Ctrl-C
still raises KeyboardInterrupt in Python.
"""
from __future__ import annotations

import atexit
import contextlib
import errno
import os
from typing import NamedTuple

from .._clib import ffi, lib
from ..errors import StarpuLLMError, opt
from . import offload, starpupy_face
from .mpi import BACKOFF_MAX_US, agree, mpi_polling
from .submit import StarPUOps


# How a task gets K > 1 cores (cores_per_worker) on a StarPU without parallel workers (see sl_api.h): "team" =
# one worker per k-core group running an OpenMP team bound to the group (StarPU 1.4's
# parallel-worker design; the cheaper dispatch), "forkjoin" = FORKJOIN tasks on combined workers
# under peager (the per-task costs are measured in docs/design.md).
KCORE_MODES = {"team": lib.SL_KCORE_TEAM, "forkjoin": lib.SL_KCORE_FORKJOIN}
DEFAULT_KCORE = "team"

# With GPUs: the precision of the CUDA tasks' matmuls (TF32 on tensor cores, as llm.c's fp32
# trainer does and PyTorch with allow_tf32, or fp32), and the scheduler, a history-model one
# by default (dmdas: dmda with its queues sorted by priority), which weighs a task's time on a
# CPU against a GPU and the transfers; never lws, whose idle CPU workers steal GPU tasks
# (measured: 1.8 ms per GPU-only task, against 15-30 us under dmda/dmdas).
GPU_MATMUL = ("tf32", "fp32")
GPU_SCHED = "dmdas"
NOT_WITH_GPUS = ("lws", "ws")


def have_cuda() -> bool:
    """Whether this build runs GPUs (a CUDA build: README "GPUs")."""
    return bool(lib.sl_have_cuda())


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, e.g. under mpirun or taskset)."""
    return len(os.sched_getaffinity(0))


def max_starpu_cpus() -> int:
    """CPU workers the StarPU build supports (STARPU_MAXCPUS; 4 in Debian's 1.3)."""
    return lib.sl_max_cpus()


def sched_policies() -> list[str]:
    """The scheduling policies of this StarPU build, by name."""
    names = []
    while (p := lib.sl_sched_policy_name(len(names))) != ffi.NULL:
        names.append(ffi.string(p).decode())
    return names


def default_partition(cores: int | None = None) -> tuple[int, int]:
    """One worker on every core StarPU can use (pure tensor parallelism)."""
    return 1, cores or usable_cores()


MAX_GROUP = lib.SL_MAX_GROUP   # cores of one team worker


def effective_kcore(kcore: str, cores_per_worker: int, workers: int = 1,
                    oversubscribed: bool = False, offload: bool = False, gpus: int = 0) -> str:
    """What actually gives a task its cores: 'single' (K = 1), 'parallel-workers' where the
    StarPU build has them and they can run the N x K partition, else the requested 'team' or
    'forkjoin'. Parallel workers need a StarPU worker on each of the N x K cores, so not
    beyond STARPU_MAXCPUS, nor with more cores than the process has (a parallel worker whose
    StarPU workers share a core runs no task); SL_NO_PARALLEL_WORKERS turns them off, and so
    does a memory limit (offload): with a disk node StarPU 1.4.12 prefetches a task's data
    when it is pushed, and again when a parallel worker moves it into its own context, which
    it asserts against ("Prefetching was already requested for this task"); team workers
    run the same way. With GPUs, team workers too: the scheduler must see the CPU and CUDA
    workers in one context. sl_start (csrc/starpu/runtime.c) decides the same way."""
    if cores_per_worker == 1:
        return "single"
    if gpus:
        return "team"
    if (lib.sl_have_parallel_workers() and not oversubscribed and not offload
            and workers * cores_per_worker <= max_starpu_cpus()
            and not os.environ.get("SL_NO_PARALLEL_WORKERS")):
        return "parallel-workers"
    return kcore


def starpu_worker_count(workers: int, cores_per_worker: int, kcore: str,
                        oversubscribed: bool = False, offload: bool = False) -> int:
    """StarPU CPU workers of an N x K partition: N team workers (their OpenMP teams take the
    other cores), else a worker on every core."""
    mode = effective_kcore(kcore, cores_per_worker, workers, oversubscribed, offload)
    return workers if mode == "team" else workers * cores_per_worker


def partitions_that_fit(cores: int | None = None) -> list[tuple[int, int, str]]:
    """Every N x K = cores partition (N, K, kcore) that check_partition accepts: both k-core
    mechanisms for K > 1, 'team' alone for K = 1; none that the StarPU build's
    STARPU_MAXCPUS or SL_MAX_GROUP rules out."""
    cores = cores or usable_cores()
    cap = max_starpu_cpus()
    out = []
    for workers in range(1, cores + 1):
        cores_per_worker = cores // workers
        if cores % workers or cores_per_worker > MAX_GROUP:
            continue
        for kcore in (("team", "forkjoin") if cores_per_worker > 1 else ("team",)):
            if starpu_worker_count(workers, cores_per_worker, kcore) <= cap:
                out.append((workers, cores_per_worker, kcore))
    return out


def check_partition(workers: int, cores_per_worker: int, oversubscribe: bool = False,
                    kcore: str = "team", gpus: int = 0) -> None:
    """Raise a clear error when N x K (and a core for each GPU's worker thread) does not fit
    the cores StarPU can use here."""
    if workers < 1 or cores_per_worker < 1:
        raise StarpuLLMError(f"{opt('workers')} ({workers}) and {opt('cores_per_worker')} ({cores_per_worker}) "
                             "must be at least 1")
    total = workers * cores_per_worker
    cap = max_starpu_cpus()
    needed = starpu_worker_count(workers, cores_per_worker, kcore, total > usable_cores())
    if needed > cap:
        raise StarpuLLMError(
            f"{opt('workers')} {workers} x {opt('cores_per_worker')} {cores_per_worker} needs {needed} "
            f"StarPU CPU workers, but this StarPU build supports at most {cap} (STARPU_MAXCPUS); "
            f"choose N x K <= {cap}" + (f", or {opt('kcore')} team with N <= {cap}" if kcore != "team" else ""))
    if cores_per_worker > MAX_GROUP:
        raise StarpuLLMError(f"{opt('cores_per_worker')} {cores_per_worker} is above {MAX_GROUP}")
    cores = usable_cores()
    if total + gpus > cores and not oversubscribe:
        fits = ", ".join(dict.fromkeys(f"{n}x{k}" for n, k, m in
                                       partitions_that_fit(max(1, cores - gpus))
                                       if m == kcore or k == 1))
        gpu_cores = f" and {gpus} for the GPUs' worker threads" if gpus else ""
        raise StarpuLLMError(
            f"{opt('workers')} {workers} x {opt('cores_per_worker')} {cores_per_worker} = {total} cores"
            f"{gpu_cores}, but this process can use {cores}; partitions that fit: {fits} "
            f"(or set {opt('oversubscribe')} to share cores, for correctness tests only)")


def check_gpus(gpus: int, gpu_matmul: str, kcore: str, sched: str | None, comm, memory) -> None:
    """Raise a clear error for GPUs this build or these settings cannot run."""
    if not isinstance(gpus, int) or gpus < 0:
        raise StarpuLLMError(f"{opt('gpus')} {gpus!r}: give a whole number of GPUs, 0 or more")
    if gpu_matmul not in GPU_MATMUL:
        raise StarpuLLMError(f"{opt('gpu_matmul')} {gpu_matmul!r}: choose one of "
                             f"{', '.join(GPU_MATMUL)}")
    if not gpus:
        return
    if not have_cuda():
        raise StarpuLLMError(
            f"{opt('gpus')} {gpus}: this starpu-llm is a CPU build; build StarPU with CUDA "
            "(tools/build-starpu.sh --cuda) and starpu-llm against it (README, GPUs)")
    for why, when in ((f"{opt('kcore')} forkjoin (combined CPU workers); use team", kcore == "forkjoin"),
                      (f"scheduler {sched}, whose idle CPU workers take GPU tasks (1.8 ms each "
                       f"measured); use dmdas or dmda", sched in NOT_WITH_GPUS),
                      ("StarPU-MPI: not supported yet (one process)", comm is not None),
                      (f"{opt('memory_limit')}: not supported yet (the GPUs' memory budget "
                       f"comes with it)", memory is not None)):
        if when:
            raise StarpuLLMError(f"{opt('gpus')} {gpus} does not run with {why}")


class Runtime:
    """Owns starpu_init / starpu_shutdown for this process (there is one StarPU per process).

    workers x cores_per_worker is the n x k partition: with k = 1 tasks are sequential and
    the n workers run independent sub-batches; with k > 1 each task runs on its worker's k
    cores, through parallel workers, team workers or FORKJOIN tasks (see effective_kcore).
    comm: an mpi4py communicator to start StarPU-MPI on.
    face: who starts and stops StarPU: "cffi" (sl_start, the default) or "starpupy" (StarPU's
    own Python interface, where the StarPU build has it; see starpupy_face.py). None: "cffi",
    or $STARPU_LLM_FACE=starpupy where starpupy is importable.
    memory: an offload.MemoryLimit: StarPU allocates at most that much main memory and evicts
    to a disk node in a folder of its own (removed at shutdown); None: no limit.
    gpus: CUDA workers, GPUs 0..gpus-1, beside the CPU workers (a CUDA build); each takes a
    core for its thread, so the default partition is then 1 worker x the other cores. The
    tasks of every codelet with a CUDA body may run on either: the scheduler (dmdas by
    default, by the codelets' history perf models) decides and StarPU moves the data.
    gpu_matmul: the GPUs' matmul precision, "tf32" (the default) or "fp32".
    cpu_layers: with GPUs, False keeps every task that has a CUDA body on the GPUs (the CPU
    workers then load the batches only): dmda need not try each task on a CPU first to
    calibrate its model (at GPT-2 124M, B=16, T=1024, seconds a task).
    """

    _active: "Runtime | None" = None

    def __init__(self, workers: int | None = None, cores_per_worker: int | None = None,
                 sched: str | None = None, oversubscribe: bool = False, comm=None,
                 kcore: str | None = None, face: str | None = None,
                 memory: offload.MemoryLimit | None = None, gpus: int = 0,
                 gpu_matmul: str = "tf32", cpu_layers: bool = True):
        if Runtime._active is not None:
            raise StarpuLLMError("StarPU is already running in this process; "
                                 "shut the other Runtime down first")
        # every rank checks its partition before any starts StarPU-MPI (mpi.agree)
        core_ids, kcore = agree(comm, self._plan, workers, cores_per_worker, sched,
                                oversubscribe, comm, kcore, face, memory, gpus, gpu_matmul,
                                cpu_layers)
        n = self.workers * self.cores_per_worker
        self.offload = offload.start(memory)     # the limit, before StarPU starts
        self.offload_path = self.offload.path if self.offload else None
        if self.face == "starpupy":
            starpupy_face.start(n, self.cores_per_worker, self.kcore, KCORE_MODES[kcore],
                                core_ids[:n], self.sched)
        else:
            comm_addr = ffi.NULL
            if comm is not None:
                from mpi4py import MPI
                comm_addr = ffi.cast("void *", MPI._addressof(comm))
            lib.sl_gpu_set_tf32(int(gpu_matmul == "tf32"))
            lib.sl_set_cuda_only(int(gpus > 0 and not cpu_layers))
            ret = lib.sl_start(n, self.cores_per_worker, KCORE_MODES[kcore],
                               ffi.new("int[]", core_ids), gpus, self.sched.encode(), comm_addr)
            if ret != 0:
                self._stop_offload()
                if ret == -errno.ENODEV and gpus:
                    raise StarpuLLMError(f"{opt('gpus')} {gpus}: StarPU started fewer CUDA "
                                         f"workers (no GPU, or fewer GPUs, visible to CUDA here)")
                raise StarpuLLMError(f"starpu_init failed ({ret}) for {self.workers} worker(s) x "
                                     f"{self.cores_per_worker} core(s) with scheduler "
                                     f"{self.sched!r}" + (f", or its disk node in {self.offload_path}"
                                                          if self.offload_path else ""))
        Runtime._active = self
        atexit.register(self.shutdown)
        self.mpi_poll = None
        if comm is not None:
            self.mpi_poll = mpi_polling(core_ids)
            ret = lib.sl_mpi_poll_backoff(BACKOFF_MAX_US if self.mpi_poll == "backoff" else 0)
            if ret == -errno.ENOTSUP:
                self.mpi_poll = ("spin (no backoff: mpi4py's MPI module was imported before "
                                 "starpu_llm; import starpu_llm first)")
            elif ret != 0:
                self.shutdown()
                raise RuntimeError(f"sl_mpi_poll_backoff failed ({ret})")
        got = self.starpu_workers = lib.sl_cpu_worker_count()
        expected = starpu_worker_count(self.workers, self.cores_per_worker, kcore,
                                       n + gpus > usable_cores(), memory is not None)
        if got != expected:
            self.shutdown()
            raise StarpuLLMError(f"StarPU started {got} CPU worker(s) instead of "
                                 f"{expected} (STARPU_NCPU or "
                                 "STARPU_WORKERS_CPUID in the environment?)")

    def _plan(self, workers, cores_per_worker, sched, oversubscribe, comm, kcore, face, memory,
              gpus, gpu_matmul, cpu_layers):
        """Check the partition and settle what the start needs (no side effect on StarPU):
        (the cores of the workers, the k-core mode asked for)."""
        kcore = kcore or DEFAULT_KCORE
        if kcore not in KCORE_MODES:
            raise StarpuLLMError(f"{opt('kcore')} {kcore!r}: choose one of {', '.join(KCORE_MODES)}")
        check_gpus(gpus, gpu_matmul, kcore, sched or os.environ.get("STARPU_SCHED"), comm,
                   memory)
        self.gpus, self.gpu_matmul = gpus, gpu_matmul
        self.cpu_layers = cpu_layers or not gpus
        ncores = usable_cores()
        if kcore == "forkjoin":
            ncores = min(ncores, max_starpu_cpus())
        ncores = max(1, ncores - gpus)      # a core for each GPU's worker thread
        if workers is None and cores_per_worker is None:
            workers, cores_per_worker = default_partition(ncores)
        elif cores_per_worker is None:
            cores_per_worker = max(1, ncores // workers)
        elif workers is None:
            workers = max(1, ncores // cores_per_worker)
        check_partition(workers, cores_per_worker, oversubscribe, kcore, gpus)
        self.workers, self.cores_per_worker = workers, cores_per_worker
        oversubscribed = workers * cores_per_worker + gpus > usable_cores()
        self.kcore = effective_kcore(kcore, cores_per_worker, workers, oversubscribed,
                                     memory is not None, gpus)
        if sched is None:
            sched = os.environ.get("STARPU_SCHED") or (
                GPU_SCHED if gpus else "peager" if self.kcore == "forkjoin" else "lws")
        policies = sched_policies()
        if sched not in policies:
            given = f"{opt('sched')} {sched}" if sched != os.environ.get("STARPU_SCHED") else \
                f"STARPU_SCHED={sched} (in the environment)"
            raise StarpuLLMError(f"{given}: this StarPU has no such scheduler; choose one of "
                                 f"{', '.join(policies)}")
        self.sched = sched
        os.environ.setdefault("STARPU_SILENT", "1")
        # The CUDA workers asked for, no other accelerator (the variable would override the
        # count sl_start gives StarPU)
        os.environ["STARPU_NCUDA"] = str(gpus)
        os.environ.setdefault("STARPU_NOPENCL", "0")
        n = workers * cores_per_worker
        core_ids = sorted(os.sched_getaffinity(0))
        # the partition's cores, then one for each GPU's thread (oversubscribed: reused)
        core_ids = (core_ids * ((n + gpus) // len(core_ids) + 1))[:n + gpus]
        self.comm = comm
        if comm is not None and not lib.sl_mpi_available():
            raise StarpuLLMError("this build has no StarPU-MPI support (rebuild with "
                                 "libstarpumpi and an MPI installed)")
        explicit = face is not None
        self.face = face = starpupy_face.resolve(face)
        for why, when in (("cannot start StarPU-MPI (starpu.init() takes no communicator); use "
                           "the cffi face under MPI", comm is not None),
                          (f"does not run under {opt('memory_limit')} (its checkpoint task copies "
                           f"every parameter into one numpy array); use the cffi face",
                           memory is not None),
                          ("does not start GPUs; use the cffi face", gpus > 0)):
            if face == "starpupy" and when:
                if explicit:
                    raise StarpuLLMError(f"face 'starpupy' {why}")
                self.face = face = "cffi"
        if memory is not None and self.kcore == "forkjoin":
            raise StarpuLLMError(
                f"{opt('memory_limit')} needs tasks on buffers StarPU allocates itself, which "
                f"StarPU 1.3's FORKJOIN tasks (peager) cannot run: use {opt('kcore')} team (the "
                f"default) or one core per worker")
        self.memory = memory
        return core_ids, kcore

    @property
    def workers_are_starpu_workers(self) -> bool:
        """Partition worker i is StarPU worker i (team or one-core workers), so a task can be
        pinned to it; not so for combined or parallel workers, built over a worker per core,
        nor with GPUs (their workers come first, and a pinned task would not reach them)."""
        return self.gpus == 0 and self.starpu_workers == self.workers

    @property
    def rank(self) -> int:
        return lib.sl_mpi_rank()

    @property
    def size(self) -> int:
        return lib.sl_mpi_size()

    def bytes_sent(self) -> list | None:
        """StarPU-MPI's count of the bytes this rank has sent to each rank since the start;
        None outside MPI or when its statistics are off (runtime.mpi.COMM_STATS_ENV turns
        them on)."""
        if self.comm is None:
            return None
        sent = ffi.new("size_t[]", self.size)
        return list(sent) if lib.sl_mpi_bytes_sent(sent) == 0 else None

    def mpi_poll_stats(self) -> dict:
        """What StarPU-MPI's progression thread did with backoff on (mpi_polling): its polls,
        its sleeps and the seconds slept since the start (zeros when it spins, or outside
        MPI)."""
        polls, sleeps, slept = ffi.new("long long *"), ffi.new("long long *"), ffi.new("long long *")
        lib.sl_mpi_poll_stats(polls, sleeps, slept)
        return dict(polls=polls[0], sleeps=sleeps[0], slept_s=slept[0] / 1e9)

    @property
    def running(self) -> bool:
        return Runtime._active is self

    def wait(self) -> None:
        ret = lib.sl_wait_all()
        if ret != 0:
            raise RuntimeError(f"starpu_task_wait_for_all failed ({ret})")

    @contextlib.contextmanager
    def paused(self):
        """Stop StarPU's idle workers from spinning during a Python-only phase."""
        self.wait()
        lib.sl_pause()
        try:
            yield
        finally:
            lib.sl_resume()

    def shutdown(self) -> None:
        if Runtime._active is self:
            if self.face == "starpupy":
                starpupy_face.stop()
            else:
                lib.sl_shutdown()
            self._stop_offload()
            Runtime._active = None
            atexit.unregister(self.shutdown)

    def _stop_offload(self) -> None:
        """No limit for the next start; the offload folder removed (StarPU is stopped)."""
        if self.offload is not None:
            lib.sl_set_memory_limit(0, ffi.NULL)
            self.offload.remove()
            self.offload = None

    def disk_traffic(self) -> tuple[int, int] | None:
        """(bytes read, bytes written) between StarPU and its disk node since the start; None
        without a memory limit."""
        return offload.traffic() if self.memory is not None else None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def describe(self) -> str:
        major, minor, release = ffi.new("int *"), ffi.new("int *"), ffi.new("int *")
        lib.sl_starpu_version(major, minor, release)
        mpi = (f", {self.size} MPI processes (MPI thread: {self.mpi_poll})"
               if self.comm is not None else "")
        face = ", started by starpupy" if self.face == "starpupy" else ""
        limit = (f", memory limit {offload.format_size(self.memory.limit)} (evicting to "
                 f"{self.offload_path})" if self.memory else "")
        gpus = (f" + {self.gpus} GPU(s) ({self.gpu_matmul.upper()} matmuls"
                f"{'' if self.cpu_layers else ', every layer on them'})" if self.gpus else "")
        return (f"StarPU {major[0]}.{minor[0]}.{release[0]}{face}{mpi}, {self.workers} worker(s) x "
                f"{self.cores_per_worker} core(s) ({self.kcore}){gpus}, scheduler {self.sched}, "
                f"BLAS {ffi.string(lib.blas_name()).decode()}{limit}")

    # --- the task trace (one per process; its events stay readable after shutdown) ---
    def start_trace(self, capacity: int = 200_000) -> None:
        """Record each task StarPU runs from now on (up to capacity tasks; see read_trace)."""
        if lib.sl_trace_enable(capacity) != 0:
            raise MemoryError(f"no memory for a trace of {capacity} tasks")

    def trace(self) -> list:
        """The tasks recorded since start_trace (read_trace's events)."""
        return read_trace()

    def stop_trace(self) -> None:
        """Stop recording and free the recorded events."""
        lib.sl_trace_enable(0)

    def probe(self, max_threads: int = 64):
        """Run one task and return (team size, [cpu mask of each team thread])."""
        out = ffi.new("uint64_t[]", 1 + max_threads)
        StarPUOps().probe(out, max_threads)
        self.wait()
        n = int(out[0])
        return n, [int(out[1 + t]) for t in range(min(n, max_threads))]


class TraceEvent(NamedTuple):
    """One task run, as the trace recorded it (csrc/starpu/trace.c)."""
    codelet: str
    worker: int
    cores: int
    start_ns: int
    end_ns: int
    buffers: tuple | None   # ((handle address, SL_ACCESS_* mode), ...) as StarPU gave them;
                            # None for a reduction method StarPU ran inline inside another task
    flops: float            # the flop count the task was submitted with
    job: int                # the task's submission number (process-wide)
    priority: int           # the priority it was submitted with (runtime.submit.Where)


def read_trace() -> list:
    """The recorded tasks (TraceEvent), in the order they started."""
    n = lib.sl_trace_count()
    ev = lib.sl_trace_events()
    names = [ffi.string(lib.sl_codelet_name(i)).decode() for i in range(lib.sl_codelet_count())]
    out = []
    for e in (ev[i] for i in range(n)):
        bufs = None if e.nbuffers < 0 else tuple(
            (int(ffi.cast("uintptr_t", e.handles[b])), int(e.modes[b])) for b in range(e.nbuffers))
        out.append(TraceEvent(names[e.codelet], e.worker, e.ncores, e.start_ns, e.end_ns, bufs,
                              float(e.flops), int(e.job), int(e.priority)))
    return out
