"""The partition of a run, decided in one place.

A PartitionRequest is what is asked for: each field is a flag of `train`, `bench` and
`predict` (plan/settings.py; one spelling: `--workers N`, `--cores-per-worker K`, ...; `bench` and
`predict` take comma-separated lists of the fields marked sweep) and a field of TrainConfig.
resolve(), a pure function, turns it, with the cores and MPI ranks of the process and what the
StarPU build supports (a Build), into the record.Partition that runs: the defaults filled in,
the mechanism that gives a task its K cores chosen, every rule checked. That Partition is
printed, recorded in the metrics and the checkpoints, resumed (request_of), run again in
bench's and the autotuner's subprocesses (settings_of), predicted (perf/predict.py) and
started: Runtime and the C layer receive N, K and the mechanism and decide nothing.

How a task gets K > 1 cores (the mechanism): "parallel-workers" where the StarPU build has them
(StarPU 1.4's parallel workers, 1.3's clusters) and they can run the partition; else what is
asked, "team" (one StarPU worker per K-core group running an OpenMP team bound to the group:
the parallel-worker design, the default) or "forkjoin" (FORKJOIN tasks on combined workers of
K cores, scheduler peager). "single" for K = 1; the reference engine's "openmp".
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

from ..errors import StarpuLLMError, opt
from ..model.config import ATTENTIONS
from .sites import default_sub_batches
from .topology import OWNERSHIPS, PIPELINE_SCHEDULES
from .record import Partition
from .settings import check_fields, setting

PARALLELISM = "parallelism (StarPU engine)"     # the help group of the partition flags
# The engines a run, `generate` and `serve` choose among (--engine), the first the default:
# the task graph on StarPU, or the same kernels in a plain loop
ENGINES = ("starpu", "reference")
KCORE_REQUESTS = ("team", "forkjoin")
DEFAULT_KCORE = "team"
# With GPUs: the precision of the CUDA tasks' matmuls (the first the default: TF32 on tensor
# cores, as llm.c's fp32 trainer does and PyTorch with allow_tf32; or fp32), and the scheduler,
# a history-model one by default (dmdas: dmda with its queues sorted by priority), which weighs
# a task's time on a CPU against a GPU and the transfers; never lws, whose idle CPU workers
# steal GPU tasks (measured: 1.8 ms per GPU-only task, against 15-30 us under dmda/dmdas).
GPU_MATMUL = ("tf32", "fp32")
GPU_SCHED = "dmdas"
NOT_WITH_GPUS = ("lws", "ws")


@dataclass(frozen=True)
class Build:
    """What the StarPU build running the partition supports (runtime.starpu.this_build reads
    this process's; perf/predict.py describes another machine's)."""
    max_cpus: int                   # STARPU_MAXCPUS: CPU workers at most
    parallel_workers: bool          # parallel workers (1.4) / clusters (1.3), and not turned off
    cuda: bool = False              # a CUDA build (GPUs)
    max_group: int = 64             # cores of one team worker (SL_MAX_GROUP)
    schedulers: tuple = ()          # its scheduling policies by name (empty: not checked)
    cuda_error: str = ""            # why CUDA could not count its GPUs (runtime.cuda_devices)
    cuda_seen: int | None = None    # the GPUs CUDA sees (None: not asked, as without --gpus)


# The fields that give the partition's shape (PartitionRequest.given)
SHAPE = ("workers", "cores_per_worker", "sub_batches", "kcore", "ownership", "pipeline_stages",
         "threads", "gpus")


@dataclass
class PartitionRequest:
    """A partition as asked for; None: the default (resolve says which)."""
    workers: int | str | None = setting(
        None, "N: parallel workers, or auto: the partition and sub-batches the performance model "
        "ranks best, confirmed by a short trial of the two best and cached per machine and shape "
        "(needs `starpu-llm calibrate`) (default: 1 worker on all usable cores, calibrated or "
        "not; with --resume, the recorded partition)", check="positive_or_auto", group=PARALLELISM,
        sweep=True)
    cores_per_worker: int | None = setting(None, "K: cores of each worker (default: all cores / N)",
                                           check="positive", group=PARALLELISM, sweep=True)
    sub_batches: int | None = setting(
        None, "split each process's batch into this many sub-batches (default: one per worker; "
        "a pipeline's micro-batches: 2 S N)", check="positive", group=PARALLELISM,
        ranks_agree=True, sweep=True)
    kcore: str | None = setting(
        None, "how a task gets K > 1 cores without StarPU parallel workers: team (one worker per "
        "K-core group with a bound OpenMP team; default) or forkjoin (FORKJOIN tasks on combined "
        "workers, scheduler peager)", choices=list(KCORE_REQUESTS), group=PARALLELISM, sweep=True)
    sched: str | None = setting(None, "StarPU scheduler (default: dmdas with GPUs, peager for "
                                "forkjoin, else lws)", group=PARALLELISM)
    oversubscribe: bool = setting(False, "allow N x K above the usable cores (correctness tests only)",
                                  group=PARALLELISM)
    ownership: str | None = setting(
        None, "under mpirun, which ranks own the parameters, gradients and AdamW moments: "
        "sharded (each tensor slice on one rank, bytes balanced; the default) or rank0 (all on "
        "rank 0, the paper's scheme)", choices=list(OWNERSHIPS), group=PARALLELISM,
        ranks_agree=True, sweep=True)
    pipeline_stages: int | None = setting(
        None, "under mpirun, S pipeline stages: the layers split into S contiguous stages (the "
        "first also runs the embedding and the head), balanced by their predicted time; the "
        "sub-batches flow through them as micro-batches; R = S x D ranks run D data-parallel "
        "copies (default: 1 stage, data parallelism only)", check="positive", metavar="S",
        group=PARALLELISM, ranks_agree=True, sweep=True)
    pipeline_schedule: str | None = setting(
        None, "how the micro-batches go through the pipeline's stages: eager (each stage holds "
        "at most 2 S micro-batches' activations, forward tasks first; the default), 1f1b (at "
        "most S, backward tasks first: the least memory), bounded (S, tasks in the order they "
        "become ready) or gpipe (forwards first, every stage holding all the micro-batches); "
        "the same results bitwise",
        choices=list(PIPELINE_SCHEDULES), group=PARALLELISM, ranks_agree=True)
    threads: int | None = setting(None, "reference engine: OpenMP/BLAS threads (default: all cores)",
                                  check="positive", group=PARALLELISM)
    gpus: int = setting(0, "G GPUs beside the CPU workers, a StarPU CUDA worker each (a CUDA "
                        "build; README, GPUs): the scheduler (dmdas) puts each task on a CPU or a "
                        "GPU and StarPU moves the data (default %(default)s: CPUs only)", check="nonneg_int",
                        metavar="G", group=PARALLELISM, ranks_agree=True)
    gpu_matmul: str = setting(GPU_MATMUL[0], "the GPUs' matmul precision: tf32 (tensor cores; the "
                              "default) or fp32", choices=list(GPU_MATMUL), group=PARALLELISM,
                              ranks_agree=True)
    attention: str | None = setting(
        None, "the attention's form: flash (fused, tiles with an online softmax: no (T, T) "
        "tensor, the scores recomputed in the backward; the default with GPUs) or gemm (the "
        "softmax weights (B, NH, T, T) kept for the backward, batched GEMMs; the default on "
        "CPUs); the same math, other roundings", choices=list(ATTENTIONS), group=PARALLELISM,
        ranks_agree=True)

    def given(self) -> bool:
        """Whether the partition's shape is asked for (else the default, or on --resume the
        recorded one): its workers, cores, sub-batches, mechanism, ranks' split, GPUs or
        threads; not the scheduler or a pipeline's schedule."""
        return any(getattr(self, name) != PartitionRequest.__dataclass_fields__[name].default
                   for name in SHAPE)

    def partition_request(self) -> "PartitionRequest":
        """The request alone (of a TrainConfig, which has these fields among its own)."""
        return PartitionRequest(**{f.name: getattr(self, f.name)
                                   for f in fields(PartitionRequest)})


def request_of(p: Partition) -> PartitionRequest:
    """The request that gives the partition p again (a resume's): team and forkjoin are asked
    for; single (K = 1) and parallel-workers follow from N x K; the scheduler and a pipeline's
    schedule where recorded (None, the default, in a record saved before they were)."""
    if p.engine == "reference":
        return PartitionRequest(threads=p.cores_per_worker, sub_batches=p.sub_batches,
                                attention=p.attention or None)
    return PartitionRequest(
        workers=p.workers, cores_per_worker=p.cores_per_worker, sub_batches=p.sub_batches or None,
        kcore=p.kcore if p.kcore in KCORE_REQUESTS else None,
        ownership=p.ownership if p.ranks > 1 else None,
        pipeline_stages=p.stages if p.ranks > 1 else None,
        gpus=p.gpus, gpu_matmul=p.gpu_matmul or GPU_MATMUL[0], sched=p.sched or None,
        pipeline_schedule=p.pipeline_schedule or None, attention=p.attention or None)


def attention_of(asked: str | None, gpus: int) -> str:
    """The attention's form (model/config.ATTENTIONS) of a run asking for `asked` (None: the
    default) on `gpus` GPUs, decided here only: the fused one with GPUs, whose memory the
    (T, T) weights would fill (GPT-2 124M at 16 x 1024: 9.7 GB of them); the batched-GEMM one
    on CPUs, whose bits every CPU result so far has (the fused one is as fast there, in less
    memory: --attention flash)."""
    attention = asked or ("flash" if gpus else "gemm")
    if attention not in ATTENTIONS:
        raise StarpuLLMError(f"{opt('attention')} {attention!r}: choose one of "
                             f"{', '.join(ATTENTIONS)}")
    return attention


def settings_of(p: Partition) -> dict:
    """The settings of a run (bench.run_one's spec, TrainConfig's fields) that ask for the
    partition p again, one process's (request_of): its workers, cores per worker, mechanism
    asked and sub-batches (None: the default for the run's batch); the scheduler as the run's
    environment and build give it."""
    r = request_of(p)
    return dict(workers=r.workers, cores_per_worker=r.cores_per_worker, kcore=r.kcore,
                sub_batches=r.sub_batches)


def resolve(req: PartitionRequest, *, cores: int, build: Build, ranks: int = 1,
            engine: str = "starpu", batch: int | None = None,
            memory_limit: bool = False, sched_env: str | None = None) -> Partition:
    """The partition req asks for, on a process of `cores` usable cores among `ranks` MPI
    ranks, with a StarPU `build`: the defaults filled in (one worker on all cores; K = cores /
    N; with GPUs a core for each GPU's worker thread; sub-batches, when `batch` is given:
    with_batch; the scheduler: scheduler(), `sched_env` being $STARPU_SCHED; a pipeline's
    schedule: eager), the mechanism chosen, every rule checked (a clear StarpuLLMError naming
    the setting). Pure: the same arguments, the same partition."""
    check_fields(req)       # each value of the kind and range its flag takes (from Python)
    if engine == "reference":
        if req.gpus:
            raise StarpuLLMError(f"{opt('gpus')} {req.gpus} runs the StarPU engine's tasks on "
                                 f"GPUs; the reference engine runs on CPUs: give "
                                 f"{opt('engine')} starpu, or no {opt('gpus')}")
        given = [name for name in ("workers", "cores_per_worker", "kcore")
                 if getattr(req, name) is not None]
        if given:
            raise StarpuLLMError(f"{opt(given[0])} is the StarPU engine's; the reference engine "
                                 f"runs one loop on the threads {opt('threads')} gives (default: all "
                                 f"cores)")
        threads = req.threads or cores
        if threads > cores and not req.oversubscribe:
            raise StarpuLLMError(f"{opt('threads')} {threads} is above the {cores} cores this "
                                 f"process can use: give at most {cores} (or set "
                                 f"{opt('oversubscribe')} to share cores, for tests only)")
        return Partition("reference", 1, threads, req.sub_batches or 1, "openmp", 1,
                         attention=attention_of(req.attention, 0))
    if engine not in ENGINES:
        raise StarpuLLMError(f"{opt('engine')} {engine!r}: choose one of {', '.join(ENGINES)}")
    if req.threads:
        raise StarpuLLMError(f"{opt('threads')} sets the reference engine's threads; the StarPU "
                             f"engine's cores are {opt('workers')} x {opt('cores_per_worker')}")
    kcore = req.kcore or DEFAULT_KCORE        # one of KCORE_REQUESTS: check_fields
    _check_gpus(req, kcore, build, memory_limit)
    gpus = req.gpus
    free = min(cores, build.max_cpus) if kcore == "forkjoin" else cores
    free = max(1, free - gpus)      # a core for each GPU's worker thread
    workers, cores_per_worker = req.workers, req.cores_per_worker
    if workers == "auto":
        raise StarpuLLMError(f"{opt('workers')} auto is the autotuner's to settle (engines.autotuned) "
                             f"before the partition is resolved")
    if workers is None and cores_per_worker is None:
        workers, cores_per_worker = 1, free
    elif cores_per_worker is None:
        cores_per_worker = max(1, free // workers)
    elif workers is None:
        workers = max(1, free // cores_per_worker)
    total = workers * cores_per_worker
    oversubscribed = total + gpus > cores
    mechanism = _mechanism(kcore, workers, cores_per_worker, oversubscribed, memory_limit,
                           gpus, build)
    # the cores this process has first: the partitions it names then fit the build too
    if oversubscribed and not req.oversubscribe:
        fits = ", ".join(dict.fromkeys(f"{n}x{k}" for n, k, m in
                                       partitions_that_fit(max(1, cores - gpus), build)
                                       if m == kcore or k == 1))
        gpu_cores = f" and {gpus} for the GPUs' worker threads" if gpus else ""
        raise StarpuLLMError(
            f"{opt('workers')} {workers} x {opt('cores_per_worker')} {cores_per_worker} = {total} "
            f"cores{gpu_cores}, but this process can use {cores}; partitions that fit: {fits} "
            f"(or set {opt('oversubscribe')} to share cores, for correctness tests only)")
    needed = starpu_workers(workers, cores_per_worker, mechanism)
    if needed > build.max_cpus:
        raise StarpuLLMError(
            f"{opt('workers')} {workers} x {opt('cores_per_worker')} {cores_per_worker} needs "
            f"{needed} StarPU CPU workers, but this StarPU build supports at most "
            f"{build.max_cpus} (STARPU_MAXCPUS); choose N x K <= {build.max_cpus}"
            + (f", or {opt('kcore')} team with N <= {build.max_cpus}" if kcore != "team" else ""))
    if cores_per_worker > build.max_group:
        raise StarpuLLMError(f"{opt('cores_per_worker')} {cores_per_worker} is above "
                             f"{build.max_group}")
    if memory_limit:
        check_memory_limit(mechanism, gpus)
    stages = req.pipeline_stages or 1
    schedule = ""
    if stages > 1:
        schedule = req.pipeline_schedule or PIPELINE_SCHEDULES[0]
        if schedule not in PIPELINE_SCHEDULES:
            raise StarpuLLMError(f"{opt('pipeline_schedule')} {schedule!r}: choose one of "
                                 f"{', '.join(PIPELINE_SCHEDULES)}")
    p = Partition("starpu", workers, cores_per_worker, req.sub_batches or 0, mechanism, ranks,
                  (req.ownership or "sharded") if ranks > 1 else "rank0", stages, gpus,
                  req.gpu_matmul if gpus else "", pipeline_schedule=schedule,
                  attention=attention_of(req.attention, gpus))
    p = replace(p, sched=scheduler(p, req.sched, build.schedulers, sched_env))
    _check_devices(gpus, build)
    return with_batch(p, batch) if batch is not None else p


def with_batch(p: Partition, batch: int) -> Partition:
    """p with its sub-batches for a `batch` of sequences (over all ranks) where it has none
    (0): the one place their default is decided (plan/sites.default_sub_batches: a pipeline's
    micro-batches, else one per worker, one per GPU with GPUs) on each data-parallel copy's
    share of the batch."""
    if p.sub_batches or p.engine != "starpu":
        return p
    per_copy = max(1, p.per_copy(batch))
    return replace(p, sub_batches=default_sub_batches(per_copy, p.stages, p.workers, p.gpus))


def on_runtime(started: Partition, req: PartitionRequest, batch: int) -> Partition:
    """The partition a run on a runtime already started trains on: the runtime's own
    (resolved when it started: its workers, mechanism, GPUs, scheduler, ranks' split), with the
    run's sub-batches (req's, else with_batch's default for `batch`). Any other field that req
    sets to something else is refused: a runtime keeps the workers it started (a kcore asked
    for only where it is in effect: single and parallel-workers follow from N x K)."""
    runs = request_of(started)
    for f in fields(PartitionRequest):
        asked = getattr(req, f.name)
        if (f.name in ("sub_batches", "oversubscribe", "threads") or asked == f.default
                or asked == getattr(runs, f.name)
                or (f.name == "kcore" and started.kcore not in KCORE_REQUESTS)):
            continue
        raise StarpuLLMError(f"{opt(f.name)} {asked}: the runtime given runs "
                             f"{started.describe()}; leave {opt(f.name)} out, or start the "
                             f"runtime on the partition asked for (Runtime(resolve_here(...)))")
    return with_batch(replace(started, sub_batches=req.sub_batches or 0), batch)


def _mechanism(kcore, workers, cores_per_worker, oversubscribed, memory_limit, gpus,
               build: Build) -> str:
    """What gives a task its K cores. Parallel workers need a StarPU worker on each of the
    N x K cores, so not beyond STARPU_MAXCPUS, nor with more cores than the process has (a
    parallel worker whose StarPU workers share a core runs no task); nor under a memory limit:
    with a disk node StarPU 1.4.12 prefetches a task's data when it is pushed, and again when a
    parallel worker moves it into its own context, which it asserts against ("Prefetching was
    already requested for this task"); team workers run the same way. With GPUs, team workers
    too: the scheduler must see the CPU and CUDA workers in one context."""
    if cores_per_worker == 1:
        return "single"
    if gpus:
        return "team"
    if (build.parallel_workers and not oversubscribed and not memory_limit
            and workers * cores_per_worker <= build.max_cpus):
        return "parallel-workers"
    return kcore


def starpu_workers(workers: int, cores_per_worker: int, mechanism: str) -> int:
    """StarPU CPU workers of an N x K partition of a mechanism (Partition.starpu_workers)."""
    return Partition("starpu", workers, cores_per_worker, 0, mechanism).starpu_workers


def partitions_that_fit(cores: int, build: Build) -> list[tuple[int, int, str]]:
    """Every N x K = cores partition (N, K, kcore asked) that resolve accepts, each once: both
    k-core mechanisms for K > 1 where the build gives them apart ('team' alone where parallel
    workers take both requests), 'team' alone for K = 1; none that the build's
    STARPU_MAXCPUS or its largest team rules out."""
    out = []
    for workers in range(1, cores + 1):
        cores_per_worker = cores // workers
        if cores % workers or cores_per_worker > build.max_group:
            continue
        mechanisms = set()
        for kcore in (KCORE_REQUESTS if cores_per_worker > 1 else ("team",)):
            mechanism = _mechanism(kcore, workers, cores_per_worker, False, False, 0, build)
            if (mechanism not in mechanisms
                    and starpu_workers(workers, cores_per_worker, mechanism) <= build.max_cpus):
                mechanisms.add(mechanism)
                out.append((workers, cores_per_worker, kcore))
    return out


def shapes(cores: int) -> list[tuple[int, int]]:
    """Every (N workers, K cores) with N x K = cores, N from 1 up: partitions_that_fit on a
    machine of that many cores whose build limits none (the performance model's candidates)."""
    build = Build(max_cpus=cores, parallel_workers=False, max_group=cores)
    return list(dict.fromkeys((n, k) for n, k, _ in partitions_that_fit(cores, build)))


def scheduler(partition: Partition, sched: str | None, policies, env: str | None = None) -> str:
    """The StarPU scheduler of a partition: the one asked for (sched, else `env`, the
    environment's STARPU_SCHED), else dmdas with GPUs, peager under forkjoin, lws otherwise;
    checked against the build's `policies` (none given: another machine's, not checked)."""
    given = f"{opt('sched')} {sched}" if sched else f"STARPU_SCHED={env} (in the environment)"
    sched = sched or env or (GPU_SCHED if partition.gpus else
                             "peager" if partition.kcore == "forkjoin" else "lws")
    if policies and sched not in policies:
        raise StarpuLLMError(f"{given}: this StarPU has no such scheduler; choose one of "
                             f"{', '.join(policies)}")
    if partition.gpus and sched in NOT_WITH_GPUS:
        raise StarpuLLMError(f"{opt('gpus')} {partition.gpus} does not run with scheduler {sched}, "
                             f"whose idle CPU workers take GPU tasks (1.8 ms each measured); use "
                             f"dmdas or dmda")
    return sched


def _check_gpus(req: PartitionRequest, kcore: str, build: Build, memory_limit: bool) -> None:
    """A clear error for GPUs this build or these settings cannot run."""
    gpus = req.gpus
    if not isinstance(gpus, int) or gpus < 0:
        raise StarpuLLMError(f"{opt('gpus')} {gpus!r}: give a whole number of GPUs, 0 or more")
    if req.gpu_matmul not in GPU_MATMUL:
        raise StarpuLLMError(f"{opt('gpu_matmul')} {req.gpu_matmul!r}: choose one of "
                             f"{', '.join(GPU_MATMUL)}")
    if not gpus:
        return
    if not build.cuda:
        raise StarpuLLMError(
            f"{opt('gpus')} {gpus}: this starpu-llm is a CPU build; `make cuda` builds StarPU "
            "with CUDA and starpu-llm against it in .venv-cuda (README, GPUs)")
    if kcore == "forkjoin":
        raise StarpuLLMError(f"{opt('gpus')} {gpus} does not run with {opt('kcore')} forkjoin "
                             f"(combined CPU workers); use team")
    if memory_limit:
        check_memory_limit(kcore, gpus)


def _check_devices(gpus: int, build: Build) -> None:
    """The GPUs this machine has for `gpus` asked, or a clear error: after every check of the
    settings, so that a job script's mistake is said on a login node without a driver too."""
    if not gpus:
        return
    if build.cuda_error:
        raise StarpuLLMError(
            f"{opt('gpus')} {gpus}: {build.cuda_error}: check the NVIDIA driver (nvidia-smi; it "
            "must be as new as the CUDA this starpu-llm was built with: starpu-llm --version "
            "names both) and CUDA_VISIBLE_DEVICES, "
            f"or run with {opt('gpus')} 0")
    if build.cuda_seen is not None and gpus > build.cuda_seen:
        # StarPU would start fewer CUDA workers than asked (or, under MPI, two on one device)
        raise StarpuLLMError(
            f"{opt('gpus')} {gpus}: CUDA sees {build.cuda_seen} GPU(s) here (those nvidia-smi "
            "lists, less what CUDA_VISIBLE_DEVICES or the batch system's GPU allocation hides; "
            f"under mpirun or srun, each rank's own): ask for at most {build.cuda_seen}")


def check_memory_limit(mechanism: str, gpus: int) -> None:
    """A partition of this mechanism and GPUs under a memory limit, or a clear error: the one
    rule, for resolve and for a Runtime given a resolved partition and a limit (the partition
    does not record the limit it was resolved for)."""
    if gpus:
        raise StarpuLLMError(f"{opt('gpus')} {gpus} does not run with {opt('memory_limit')}: "
                             f"not supported yet (the GPUs' memory budget comes with it)")
    if mechanism == "forkjoin":
        raise StarpuLLMError(
            f"{opt('memory_limit')} needs tasks on buffers StarPU allocates itself, which "
            f"StarPU 1.3's FORKJOIN tasks (peager) cannot run: use {opt('kcore')} team (the "
            f"default) or one core per worker")
    if mechanism == "parallel-workers":     # resolve avoids them under a limit (_mechanism)
        raise StarpuLLMError(
            f"{opt('memory_limit')} does not run on StarPU's parallel workers (with a disk node "
            f"StarPU 1.4.12 asserts when a parallel worker prefetches a task's data again): "
            f"resolve the partition with the limit (memory_limit=True: team workers)")
