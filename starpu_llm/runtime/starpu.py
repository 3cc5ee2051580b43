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
import sys
import tempfile
import weakref
from typing import NamedTuple

from ..plan import partition
from .._clib import ffi, lib
from ..errors import StarpuLLMError, opt
from ..model.config import ATTENTIONS
from ..plan.partition import Build, PartitionRequest, check_memory_limit
from ..plan.record import Partition
from . import cpus, offload, starpupy_face
from ..kernels.codelets import cuda_devices
from ..kernels.cpu import check as check_cpu
from .mpi import BACKOFF_MAX_US, mpi_polling, phase
from .submit import StarPUOps


# The mechanism that gives a task its K cores (plan/partition.py says which), as the C layer takes
# it (sl_api.h)
MECHANISMS = {"single": lib.SL_KCORE_SINGLE, "team": lib.SL_KCORE_TEAM,
              "forkjoin": lib.SL_KCORE_FORKJOIN, "parallel-workers": lib.SL_KCORE_PARALLEL}


# StarPU writes dirty buffers back to their home node (main memory) in the background whenever
# fewer than 5 % of a memory node's buffers are clean (STARPU_MINIMUM_CLEAN_BUFFERS; up to 10 %,
# STARPU_TARGET_CLEAN_BUFFERS), whether or not the node is short of memory
# (datawizard/memalloc.c, starpu_memchunk_tidy). On a GPU that holds the step, every
# activation, gradient and moment is dirty after each step, so this drained GBs a step across
# the bus into host memory, and a task writing a buffer waited for its write-back (an H200 at
# d12, 8 x 1024: 0.6 s waits, 760 ms a step; docs/gpus.md). With GPUs and no memory limit
# nothing is written back early; under --memory-limit StarPU's defaults stay (its disk node
# wants clean buffers to evict).
KEEP_DIRTY = {"STARPU_MINIMUM_CLEAN_BUFFERS": "0", "STARPU_TARGET_CLEAN_BUFFERS": "0"}


def start_environment(p: Partition, memory, cuda_devices: list | None = None) -> dict:
    """The StarPU variables a start of partition p (under memory, an offload.MemoryLimit or
    None) sets, each only where the user's environment does not: KEEP_DIRTY with GPUs and no
    memory limit; STARPU_WORKERS_CUDAID, the GPUs of this rank, where cuda_devices names them
    (under MPI: rank_cuda_devices)."""
    env = dict(KEEP_DIRTY) if p.gpus > 0 and memory is None else {}
    if p.gpus > 0 and cuda_devices:
        env["STARPU_WORKERS_CUDAID"] = " ".join(str(d) for d in cuda_devices)
    return env


def rank_cuda_devices(local_rank: int, gpus: int, visible: int) -> list:
    """The CUDA devices of the rank local_rank among the ranks of its node, each with `gpus`
    GPUs: the node's visible devices dealt out in order, rank 0 the first `gpus`, rank 1 the
    next (a launcher that gives each rank its own GPUs, CUDA_VISIBLE_DEVICES, leaves each
    rank's first); ranks share them round-robin where there are fewer than they ask."""
    if visible < 1:
        return []
    return [(local_rank * gpus + d) % visible for d in range(gpus)]


def _environment(variables: dict):
    """variables set for the duration (StarPU reads them in starpu_init), those the user set
    left as they are; then the environment as it was, so that a later start in this process
    (another partition) decides afresh."""
    return starpupy_face.environment({k: v for k, v in variables.items() if k not in os.environ})


def perf_model_dir() -> tuple[str, str]:
    """(where StarPU writes its performance models (codelets/, bus/), the variable that says
    so): STARPU_PERF_MODEL_DIR, or .starpu/sampling in the first of XDG_CACHE_HOME,
    STARPU_HOME, HOME, TMPDIR, TEMP, TMP that is set, else in /tmp (StarPU 1.3's and 1.4's
    _starpu_get_home_path)."""
    for name in ("STARPU_PERF_MODEL_DIR", "XDG_CACHE_HOME", "STARPU_HOME", "HOME", "TMPDIR",
                 "TEMP", "TMP"):
        if os.environ.get(name):
            base = os.environ[name]
            return (base if name == "STARPU_PERF_MODEL_DIR"
                    else os.path.join(base, ".starpu", "sampling")), name
    return os.path.join("/tmp", ".starpu", "sampling"), ""


def check_perf_model_dir() -> None:
    """One clear error where StarPU could not write its performance models: it aborts the
    process in starpu_init then (a read-only home, a path through a file)."""
    where, by = perf_model_dir()
    try:
        for sub in ("codelets", "bus"):
            os.makedirs(os.path.join(where, sub), mode=0o700, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".starpu-llm-probe-", dir=os.path.join(where, "bus"))
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        # StarPU reads STARPU_PERF_MODEL_DIR first, XDG_CACHE_HOME before STARPU_HOME
        fix = ("STARPU_PERF_MODEL_DIR" if by in ("STARPU_PERF_MODEL_DIR", "XDG_CACHE_HOME")
               else "STARPU_HOME (or STARPU_PERF_MODEL_DIR)")
        raise StarpuLLMError(
            f"StarPU keeps its performance models in {where}"
            f"{f' (from ${by})' if by else ''}, which cannot be written there "
            f"({e.strerror or e}): set {fix} to a writable folder") from None


def have_cuda() -> bool:
    """Whether this build runs GPUs (a CUDA build: README "GPUs")."""
    return bool(lib.sl_have_cuda())


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, e.g. under mpirun or taskset): one
    a core, whatever its hardware threads (cpus.core_cpus)."""
    return len(cpus.core_cpus())


def max_starpu_cpus() -> int:
    """CPU workers the StarPU build supports (STARPU_MAXCPUS; 4 in Debian's 1.3)."""
    return lib.sl_max_cpus()


def this_build(gpus: int = 0) -> Build:
    """What this process's StarPU build supports (its parallel workers: parallel_workers_here).
    gpus > 0 (a CUDA build): CUDA asked for its devices, their count or its error kept
    (Build.cuda_seen, Build.cuda_error); else CUDA is left untouched (a process that forks
    later must not have started it)."""
    asked = have_cuda() and isinstance(gpus, int) and gpus > 0
    seen, why = cuda_devices() if asked else (None, "")
    return Build(max_cpus=max_starpu_cpus(), parallel_workers=parallel_workers_here()[0],
                 cuda=have_cuda(), max_group=lib.SL_MAX_GROUP,
                 schedulers=tuple(sched_policies()),
                 cuda_error=why, cuda_seen=None if why else seen)


def parallel_workers_here() -> tuple[bool, str]:
    """Whether this process runs K-core tasks on StarPU's parallel workers (1.4's; 1.3's
    clusters), and why not, to tell the user, where its build has them: off with a libstarpu
    that lacks the fix of lws/ws's deadlock after parallel workers (docs/clusters.md, "Known
    hang"; the mark the fix leaves: sl_starpu_ws_fixed), the same version either way. Off
    without a word with SL_NO_PARALLEL_WORKERS in the environment (the user's own choice)."""
    if not lib.sl_have_parallel_workers() or os.environ.get("SL_NO_PARALLEL_WORKERS"):
        return False, ""
    if not lib.sl_starpu_ws_fixed():
        path = ffi.string(lib.sl_starpu_library()).decode()
        library = os.path.realpath(path) if path else "the libstarpu loaded"
        return False, (f"{library} lacks the fix of lws/ws's deadlock after parallel workers "
                       f"(docs/clusters.md, \"Known hang\"): build StarPU with "
                       f"tools/build-starpu.sh, or apply "
                       f"tools/patches/starpu-1.4.12-ws-no-self-steal.patch to it")
    return True, ""


def sched_policies() -> list[str]:
    """The scheduling policies of this StarPU build, by name."""
    names = []
    while (p := lib.sl_sched_policy_name(len(names))) != ffi.NULL:
        names.append(ffi.string(p).decode())
    return names


def partitions_that_fit(cores: int | None = None) -> list[tuple[int, int, str]]:
    """Every N x K of this process's cores this build runs (partition.partitions_that_fit)."""
    return partition.partitions_that_fit(cores or usable_cores(), this_build())


def resolve_here(request: PartitionRequest, ranks: int = 1, batch: int | None = None,
                 memory_limit: bool = False, engine: str = "starpu",
                 cores: int | None = None) -> Partition:
    """partition.resolve on this process's cores (or `cores` of them) and StarPU build (and
    $STARPU_SCHED)."""
    return partition.resolve(request, cores=cores or usable_cores(), build=this_build(request.gpus),
                             ranks=ranks,
                             engine=engine, batch=batch, memory_limit=memory_limit,
                             sched_env=os.environ.get("STARPU_SCHED"))


def c_partition(p: Partition, sched):
    """The partition p as sl_start takes it (struct sl_partition, sl_api.h): every field the
    C layer reads, in one struct; sched: p.sched as a char[] the caller keeps alive."""
    return ffi.new("struct sl_partition *", dict(
        workers=p.workers, cores_per_worker=p.cores_per_worker, kcore=MECHANISMS[p.kcore],
        ncuda=p.gpus, tf32=int(p.gpu_matmul == "tf32"), sched=sched))


_said_off = False


def _say_parallel_workers_off(p: Partition, comm) -> None:
    """A K-core CPU partition run without the parallel workers its build has, for a reason the
    user did not choose (parallel_workers_here): said once a process, on stderr, by rank 0
    under mpirun (every rank has the same build)."""
    global _said_off
    why = parallel_workers_here()[1]      # a reason only where they are off
    if comm is not None and comm.Get_rank() != 0:
        return
    if _said_off or not why or p.gpus or p.cores_per_worker < 2:
        return
    _said_off = True
    print(f"warning: StarPU's parallel workers are off: {why}; the {p.cores_per_worker}-core "
          f"tasks run on {p.kcore} workers instead", file=sys.stderr, flush=True)


ON_CPU, ON_CUDA = lib.SL_ON_CPU, lib.SL_ON_CUDA


def placement(gpus: int) -> dict[str, int]:
    """{codelet name: where its tasks may run (ON_CPU / ON_CUDA bits)} on a start with `gpus`
    GPUs: the C layer's one decision (sl_codelet_where), which sl_start applies; readable
    without a GPU, on any build."""
    return {ffi.string(lib.sl_codelet_name(i)).decode(): lib.sl_codelet_where(i, gpus)
            for i in range(lib.sl_codelet_count())}


def placed() -> dict[str, int]:
    """{codelet name: where its tasks may run} as StarPU was last started (the CPU and CUDA
    functions its codelets were given)."""
    return {ffi.string(lib.sl_codelet_name(i)).decode(): lib.sl_codelet_placed(i)
            for i in range(lib.sl_codelet_count())}


class Runtime:
    """Owns starpu_init / starpu_shutdown for this process (there is one StarPU per process).

    It starts the partition it is given (`partition`, a record.Partition from
    partition.resolve: N workers x K cores per worker, their mechanism, the GPUs and their
    matmuls, the scheduler; plan/partition.py says what each means; None: the default partition
    of this process) and decides nothing about it: with K = 1 tasks are sequential and the N
    workers run independent sub-batches; with K > 1 each task runs on its worker's K cores.
    comm: an mpi4py communicator to start StarPU-MPI on.
    face: who starts and stops StarPU: "cffi" (sl_start, the default) or "starpupy" (StarPU's
    own Python interface, where the StarPU build has it; see starpupy_face.py). None: "cffi",
    or $STARPU_LLM_FACE=starpupy where starpupy is importable.
    memory: an offload.MemoryLimit: StarPU allocates at most that much main memory and evicts
    to a disk node in a folder of its own (removed at shutdown); None: no limit.
    With GPUs (CUDA workers, GPUs 0..gpus-1, under MPI the rank's own: rank_cuda_devices;
    beside the CPU workers, a CUDA build) each takes a core for its thread. The tasks of every codelet with a CUDA body may run on either: the
    scheduler (dmdas by default) places them on the GPUs and StarPU moves the data: every task
    of a codelet with a CUDA body runs on the GPUs only (placement()), the CPU workers run
    the rest (the batch loads), so dmda never tries a layer task on a CPU to calibrate its
    model (at GPT-2 124M, B=16, T=1024, seconds a task).
    The attention the layer tasks run is the partition's (partition.resolve decides it: the
    fused one, "flash", with GPUs, the batched-GEMM one, "gemm", without, or
    PartitionRequest(attention=)); the task flow's tensors read it there.
    """

    _active: "Runtime | None" = None

    def __init__(self, partition: Partition | None = None, *, comm=None,
                 face: str | None = None, memory: offload.MemoryLimit | None = None):
        if partition is not None and not partition.attention:
            raise StarpuLLMError("the partition says no attention form: make it with "
                                 "plan.partition.resolve (PartitionRequest(attention=) one of "
                                 f"{', '.join(ATTENTIONS)}, or the default)")
        check_cpu()         # the kernels run from here: built for an instruction set here?
        if Runtime._active is not None:
            raise StarpuLLMError("StarPU is already running in this process: shut the other "
                                 "Runtime down first (rt.shutdown(), or the end of its `with` "
                                 "block), or run on it (train(cfg, runtime=rt))")
        with phase(comm, "planning StarPU's start"):   # every rank, before any starts StarPU-MPI
            core_ids = self._plan(partition, comm, face, memory)
            check_perf_model_dir()
        p = self.partition
        self._held = weakref.WeakSet()     # the data registered on it (holding)
        self._left = []                    # ... whose owner was dropped unclosed (left)
        _say_parallel_workers_off(p, comm)
        self.offload = offload.start(memory)     # the limit, before StarPU starts
        self.offload_path = self.offload.path if self.offload else None
        sched = ffi.new("char[]", p.sched.encode())      # alive through the start
        started = c_partition(p, sched)
        if self.face == "starpupy":
            starpupy_face.start(p, started, core_ids[:p.cores])   # undone there if it fails
        try:
            # ours from before sl_start returns: whatever ends __init__ from here (an error,
            # Ctrl-C landing as the start returns) stops StarPU, or no Runtime could start again
            Runtime._active = self
            atexit.register(self._stop_at_exit)
            if self.face != "starpupy":
                self._start_cffi(p, started, core_ids, comm, memory)
            self.mpi_poll = None
            if comm is not None:
                self.mpi_poll = mpi_polling(core_ids)
                ret = lib.sl_mpi_poll_backoff(BACKOFF_MAX_US if self.mpi_poll == "backoff" else 0)
                if ret == -errno.ENOTSUP:
                    self.mpi_poll = ("spin (no backoff: mpi4py's MPI module was imported before "
                                     "starpu_llm; import starpu_llm first)")
                elif ret != 0:
                    raise RuntimeError(f"sl_mpi_poll_backoff failed ({ret})")
            got = self.starpu_workers = lib.sl_cpu_worker_count()
            if got != p.starpu_workers:
                raise StarpuLLMError(f"StarPU started {got} CPU worker(s) instead of "
                                     f"{p.starpu_workers} (STARPU_NCPU or "
                                     "STARPU_WORKERS_CPUID in the environment?)")
        except BaseException:
            self._stop(warn=True)       # the error on its way is the one to see
            raise

    def _start_cffi(self, p: Partition, started, core_ids: list, comm, memory) -> None:
        """sl_start: StarPU (StarPU-MPI on comm) started on the partition (`started`, its C
        form) and core_ids, or one error saying why not."""
        comm_addr = ffi.NULL
        if comm is not None:
            from mpi4py import MPI
            comm_addr = ffi.cast("void *", MPI._addressof(comm))
        with _environment(start_environment(p, memory, self._rank_gpus)):
            ret = lib.sl_start(started, ffi.new("int[]", core_ids), comm_addr)
        if ret == -errno.ENODEV and p.gpus:
            raise StarpuLLMError(f"{opt('gpus')} {p.gpus}: StarPU started fewer CUDA "
                                 f"workers (no GPU, or fewer GPUs, visible to CUDA here)")
        if ret != 0:
            raise StarpuLLMError(f"starpu_init failed ({ret}) for {p.describe()} with "
                                 f"scheduler {p.sched!r}"
                                 + (f", or its disk node in {self.offload_path}"
                                    if self.offload_path else ""))

    def _plan(self, partition, comm, face, memory) -> list:
        """The partition (None: the default one here), settle what the start needs (no side
        effect on StarPU): the cores of the workers, then one for each GPU's worker thread."""
        ranks = comm.Get_size() if comm is not None else 1
        p = self.partition = partition or resolve_here(PartitionRequest(), ranks,
                                                       memory_limit=memory is not None)
        if p.engine != "starpu" or not p.sched:
            raise StarpuLLMError(f"the StarPU runtime starts a StarPU partition (resolved), not "
                                 f"{p.describe()}")
        if memory is not None:      # a partition resolved without the limit: resolve's rule
            check_memory_limit(p.kcore, p.gpus)
        os.environ.setdefault("STARPU_SILENT", "1")
        os.environ.setdefault("STARPU_NOPENCL", "0")
        n = p.cores
        core_ids = cpus.cpu_indexes(cpus.core_cpus())    # StarPU's numbers, one a core
        listed = os.environ.get(cpus.VARIABLE)
        if listed is not None:
            cpus.check_listed(listed)       # before StarPU reads it
        if listed is not None and p.kcore == "team":
            # StarPU would bind its N workers to the list's first N entries, whatever the
            # teams' cores; read as the teams' cores instead (sl_start binds each worker to
            # its team's first)
            core_ids = cpus.team_cores(listed, p.workers, p.cores_per_worker, p.gpus)
        # the partition's cores, then one for each GPU's thread (oversubscribed: reused)
        core_ids = (core_ids * ((n + p.gpus) // len(core_ids) + 1))[:n + p.gpus]
        self.comm = comm
        if comm is not None and not lib.sl_mpi_available():
            raise StarpuLLMError("this build has no StarPU-MPI support (rebuild with "
                                 "libstarpumpi and an MPI installed)")
        # under MPI each rank its own GPUs, by its rank among those of its node
        # (every rank splits the communicator, collectively; the user's own list, where set,
        # is StarPU's to read)
        self._rank_gpus = None
        if comm is not None and p.gpus > 0:
            from mpi4py import MPI
            local = comm.Split_type(MPI.COMM_TYPE_SHARED)
            try:
                if "STARPU_WORKERS_CUDAID" not in os.environ:
                    self._rank_gpus = rank_cuda_devices(local.Get_rank(), p.gpus,
                                                        cuda_devices()[0])
            finally:
                local.Free()
        explicit = face is not None
        self.face = face = starpupy_face.resolve(face)
        for why, when in (("cannot start StarPU-MPI (starpu.init() takes no communicator); use "
                           "the cffi face under MPI", comm is not None),
                          (f"does not run under {opt('memory_limit')} (its checkpoint task copies "
                           f"every parameter into one numpy array); use the cffi face",
                           memory is not None),
                          ("does not start GPUs; use the cffi face", p.gpus > 0)):
            if face == "starpupy" and when:
                if explicit:
                    raise StarpuLLMError(f"face 'starpupy' {why}")
                self.face = face = "cffi"
        self.memory = memory
        return core_ids

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
    def attention(self) -> str:
        """The attention the layer tasks run: the partition's."""
        return self.partition.attention

    @property
    def running(self) -> bool:
        return Runtime._active is self

    def wait(self) -> None:
        ret = lib.sl_wait_all()
        if ret != 0:
            raise RuntimeError(f"starpu_task_wait_for_all failed ({ret})")

    def worker_cores(self) -> list[int]:
        """The core each CPU worker's thread is bound to (sl_cpu_worker_cores), in StarPU's
        order; a team worker's team takes its group's other cores."""
        n = lib.sl_cpu_worker_cores(ffi.NULL, 0)
        cores = ffi.new("int[]", max(n, 1))
        return list(cores[0:lib.sl_cpu_worker_cores(cores, n)])

    def cuda_devices(self) -> list[int]:
        """The CUDA devices this runtime's CUDA workers run on (sl_cuda_worker_devices: StarPU's
        device id of each, each once); [] without CUDA workers."""
        n = lib.sl_cuda_worker_devices(ffi.NULL, 0)
        devs = ffi.new("int[]", max(n, 1))
        return list(devs[0:lib.sl_cuda_worker_devices(devs, n)])

    def gpu_memory_mb(self) -> float | None:
        """The memory in use on this runtime's GPUs now, in MB (sl_gpu_memory_used: what
        cudaMemGetInfo reports, StarPU's buffers and caches and the CUDA contexts included);
        None without GPUs (a CPU build runs none)."""
        if not self.partition.gpus:
            return None
        used = ffi.new("size_t *")
        ret = lib.sl_gpu_memory_used(used)
        if ret != 0:
            raise RuntimeError(f"sl_gpu_memory_used failed ({ret})")
        return used[0] / 1e6

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
        """Stop StarPU (StarPU-MPI, the offload folder) whatever happens. Its last wait for the
        tasks or StarPU-MPI's stop failing is a RuntimeError, or a warning where an exception
        is on its way already (an error path, a `with` block left by one): that exception is
        the one to see, never masked."""
        self._stop(warn=sys.exc_info()[1] is not None)

    def _stop_at_exit(self) -> None:
        """shutdown at exit (atexit): a failure a warning, nothing left to raise it to."""
        self._stop(warn=True)

    def holding(self, data) -> None:
        """data (an engine's handles, flow/handles.py: its unregister_all()) is registered on
        this runtime. In one process the shutdown unregisters it if its owner did not (an
        engine never closed: StarPU warns of handles left registered), and the data of owners
        dropped unclosed (left) are unregistered here, their memory given back."""
        if self.comm is None:
            self._unregister(self._left)
            self._left = []
            self._held.add(data)

    def left(self, data) -> None:
        """data's owner was dropped without closing it (a finalizer: anywhere, in any thread,
        so only noted here): data and the memory under it, which tasks may still be using,
        stay alive until they are unregistered (the next holding(), or the shutdown)."""
        self._left.append(data)

    def _unregister(self, held) -> None:
        for data in list(held):
            with contextlib.suppress(RuntimeError):   # a failed wait: the shutdown's says it
                data.unregister_all()

    def _stop(self, warn: bool) -> None:
        if Runtime._active is not self:
            return
        try:
            if self.comm is None:
                self._unregister([*self._held, *self._left])
                self._left = []
            ret = starpupy_face.stop() if self.face == "starpupy" else lib.sl_shutdown()
        finally:
            self._stop_offload()
            Runtime._active = None
            atexit.unregister(self._stop_at_exit)
        if ret != 0:
            message = (f"stopping StarPU: its wait for the last tasks or StarPU-MPI's shutdown "
                       f"failed ({ret}); StarPU is stopped, but what those tasks computed may "
                       f"be missing")
            if not warn:
                raise RuntimeError(message)
            print(f"warning: {message}", file=sys.stderr, flush=True)

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

    def __exit__(self, exc_type, exc, tb):
        self._stop(warn=exc_type is not None)

    def describe(self) -> str:
        major, minor, release = ffi.new("int *"), ffi.new("int *"), ffi.new("int *")
        lib.sl_starpu_version(major, minor, release)
        mpi = (f", {self.size} MPI processes (MPI thread: {self.mpi_poll})"
               if self.comm is not None else "")
        face = ", started by starpupy" if self.face == "starpupy" else ""
        limit = (f", memory limit {offload.format_size(self.memory.limit)} (evicting to "
                 f"{self.offload_path})" if self.memory else "")
        p = self.partition
        devices = (f"; rank {self.rank}'s: CUDA device(s) "
                   f"{', '.join(str(d) for d in self.cuda_devices())}"
                   if self.comm is not None and p.gpus else "")
        gpus = (f" + {p.gpus} GPU(s) ({p.gpu_matmul.upper()} matmuls"
                f", every layer on them{devices})" if p.gpus else "")
        return (f"StarPU {major[0]}.{minor[0]}.{release[0]}{face}{mpi}, {p.workers} worker(s) x "
                f"{p.cores_per_worker} core(s) ({p.kcore}){gpus}, scheduler {p.sched}, "
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
    # a GPU task's kernels on its GPU, in start_ns's clock (start_ns to end_ns is the
    # queueing of its kernels); 0 for a CPU task or in a build without CUDA
    gpu_start_ns: int = 0
    gpu_end_ns: int = 0
    nbytes: int = 0         # the sum of its buffers' sizes (0 where buffers is None)


def read_trace() -> list:
    """The recorded tasks (TraceEvent), in the order they started; those on GPUs with their
    kernels' times (sl_trace_gpu_times waits for the kernels of the tasks that have ended)."""
    lib.sl_trace_gpu_times()
    n = lib.sl_trace_count()
    ev = lib.sl_trace_events()
    names = [ffi.string(lib.sl_codelet_name(i)).decode() for i in range(lib.sl_codelet_count())]
    out = []
    for e in (ev[i] for i in range(n)):
        bufs = None if e.nbuffers < 0 else tuple(
            (int(ffi.cast("uintptr_t", e.handles[b])), int(e.modes[b])) for b in range(e.nbuffers))
        out.append(TraceEvent(names[e.codelet], e.worker, e.ncores, e.start_ns, e.end_ns, bufs,
                              float(e.flops), int(e.job), int(e.priority), int(e.gpu_start_ns),
                              int(e.gpu_end_ns), int(e.nbytes)))
    return out
