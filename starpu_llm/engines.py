"""The engine a run trains on, and the partition it runs: without a partition setting the
fixed default (the StarPU engine: one worker on all usable cores, one sub-batch; the
reference engine: one OpenMP thread per usable core), whatever calibration exists; the
autotuner's choice only with --workers auto (perf/autotune.py); on --resume, the recorded
partition unless one is given (resume.py)."""
from __future__ import annotations

import os
from dataclasses import replace

from .config import MODELS
from .errors import StarpuLLMError, opt
from .flow.engine import StarPUEngine
from .flow.sites import default_micro_batches
from .flow.memory import footprint
from .flow.reference import ReferenceEngine
from .perf import autotune
from .perf.model import CostModel
from .perf.machine import default_path, load
from .perf.predict import load_calibration
from .perf.stages import layer_costs
from .record import Partition
from .runtime.offload import available_memory, format_size
from .runtime.starpu import Runtime

PARTITION_SETTINGS = ("workers", "cores_per_worker", "sub_batches", "kcore", "threads",
                      "ownership", "pipeline_stages")


def partition_given(cfg) -> bool:
    """Whether cfg sets any part of the partition (or leaves it to the default)."""
    return any(getattr(cfg, name) is not None for name in PARTITION_SETTINGS)


def autotuned(cfg, config, comm, runtime, log):
    """cfg with the partition the autotuner (perf/autotune.py) chooses for its batch."""
    if comm is not None or runtime is not None or cfg.engine != "starpu":
        raise StarpuLLMError(f"{opt('workers')} auto chooses the partition of a single process "
                             f"starting its own StarPU engine: give {opt('workers')} N there")
    if cfg.memory_limit is not None:
        raise StarpuLLMError(f"{opt('workers')} auto tries partitions without a limit; under "
                             f"{opt('memory_limit')}: give {opt('workers')} N")
    if cfg.cores_per_worker or cfg.sub_batches:
        raise StarpuLLMError(f"{opt('workers')} auto chooses {opt('cores_per_worker')} and "
                             f"{opt('sub_batches')} too: leave them out")
    model = next((name for name, c in MODELS.items() if c == config), None)
    if model is None:
        raise StarpuLLMError(f"{opt('workers')} auto: the model is none of {', '.join(MODELS)}; "
                             f"give {opt('workers')} N")
    choice = autotune.choose(model, cfg.batch, cfg.seq_len, load_calibration(), log=log)
    log(f"autotune: {choice.workers}x{choice.cores_per_worker}, {choice.sub_batches} sub-batch(es): "
        f"{choice.why}")
    return replace(cfg, workers=choice.workers, cores_per_worker=choice.cores_per_worker,
                   sub_batches=choice.sub_batches)


def start_runtime(cfg, comm=None, memory=None) -> Runtime:
    """A StarPU Runtime for cfg's partition (on comm, under StarPU-MPI), with the memory
    budget given (runtime.offload.MemoryLimit)."""
    return Runtime(cfg.workers, cfg.cores_per_worker, cfg.sched, cfg.oversubscribe,
                   comm=comm, kcore=cfg.kcore, memory=memory, gpus=cfg.gpus,
                   gpu_matmul=cfg.gpu_matmul)


def check_memory(cfg, config, ranks: int = 1) -> None:
    """Refuse, before allocating it, a run whose tensors (flow/memory.footprint: one process's
    share of the batch, its parameters, gradients and moments) do not fit the memory this
    machine has available now; --memory-limit is the way to train it."""
    B = max(1, cfg.batch // ranks)
    need = footprint(config, B, cfg.seq_len, 1, state_copies=4 if ranks == 1 else 2)
    have = available_memory()
    if need > have:
        raise StarpuLLMError(
            f"{opt('batch')} {cfg.batch} x {opt('seq_len')} {cfg.seq_len} needs about "
            f"{format_size(need)} of memory{' per process' if ranks > 1 else ''} (the model's "
            f"parameters, gradients and AdamW moments and the batch's activations), but this "
            f"machine has {format_size(have)} available: give a smaller {opt('batch')} or "
            f"{opt('seq_len')}, or train under {opt('memory_limit')} (StarPU then keeps what does "
            f"not fit on disk)")


def make_engine(cfg, state, tokens, runtime=None):
    """The engine of cfg.engine over state; the StarPU engine runs on `runtime`."""
    try:
        return _make_engine(cfg, state, tokens, runtime)
    except MemoryError as e:
        raise StarpuLLMError(f"out of memory while allocating the run's tensors ({e}): give a "
                             f"smaller {opt('batch')} or {opt('seq_len')}, or train under "
                             f"{opt('memory_limit')}") from None


def _make_engine(cfg, state, tokens, runtime=None):
    if cfg.engine == "reference" and cfg.gpus:
        raise StarpuLLMError(f"{opt('gpus')} {cfg.gpus} runs the StarPU engine's tasks on GPUs; the "
                             f"reference engine runs on CPUs: give {opt('engine')} starpu, or no "
                             f"{opt('gpus')}")
    if cfg.engine == "reference":
        return ReferenceEngine(state.config, state, cfg.batch, cfg.seq_len, tokens,
                               threads=cfg.threads, sub_batches=cfg.sub_batches or 1)
    if cfg.engine != "starpu":
        raise StarpuLLMError(f"{opt('engine')} {cfg.engine!r}: choose starpu or reference")
    S = cfg.pipeline_stages or 1
    return StarPUEngine(state.config, state, cfg.batch, cfg.seq_len, tokens, runtime,
                        sub_batches=cfg.sub_batches, record=cfg.record, ownership=cfg.ownership,
                        pipeline_stages=S, pipeline_schedule=cfg.pipeline_schedule,
                        stage_costs=stage_costs(cfg, state.config, runtime) if S > 1 else None)


def stage_costs(cfg, config, runtime):
    """The layers' predicted seconds for a pipeline's stage boundaries (perf/stages.py) from
    this machine's calibration; None without one (the boundaries then balance flops). The
    boundaries change no result, only the speed."""
    try:
        calibration = load_calibration()
    except StarpuLLMError:
        return None
    S = cfg.pipeline_stages
    per_copy = cfg.batch // max(1, runtime.size // S)
    micro = cfg.sub_batches or default_micro_batches(per_copy, S, runtime.workers)
    if per_copy % micro:
        return None          # the engine says what is wrong
    return layer_costs(config, per_copy // micro, cfg.seq_len, CostModel(calibration),
                       runtime.cores_per_worker)


def calibrated_peak(partition: Partition) -> float | None:
    """The sgemm FLOP/s of the cores a run uses (per rank, times the ranks) on this machine's
    calibration: what a step's model FLOPs per second are compared with (its "mfu"); None
    without a calibration."""
    path = default_path()
    if not os.path.exists(path):
        return None
    try:
        machine = load(path)
    except StarpuLLMError:
        return None
    cores = min(machine.cores, partition.workers * partition.cores_per_worker)
    return machine.sgemm(cores) * partition.ranks


def partition_of(engine) -> Partition:
    """The partition an engine runs, as in effect (after defaults and the StarPU build's
    choices)."""
    if engine.name == "reference":
        return Partition("reference", 1, engine.threads, engine.sub_batches, "openmp", 1)
    rt = engine.runtime
    return Partition("starpu", rt.workers, rt.cores_per_worker, engine.subs_per_rank, rt.kcore,
                     rt.size, engine.sites.topology.ownership, engine.sites.topology.stages,
                     rt.gpus, rt.gpu_matmul if rt.gpus else "")
