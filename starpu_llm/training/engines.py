"""The engine a run trains on, and the partition it runs (plan/partition.py resolves it): without a
partition setting the fixed default (the StarPU engine: one worker on all usable cores, one
sub-batch; the reference engine: one OpenMP thread per usable core), whatever calibration
exists; the autotuner's choice only with --workers auto (perf/autotune.py); on --resume, the
recorded partition unless one is given (training/resume.py)."""
from __future__ import annotations

from dataclasses import replace

from ..model.config import MODELS
from ..errors import StarpuLLMError, opt
from ..flow.engine import StarPUEngine
from ..flow.memory import footprint
from ..flow.reference import ReferenceEngine
from ..perf import autotune
from ..perf.model import CostModel
from ..perf.predict import load_calibration
from ..perf.stages import layer_costs
from ..plan.partition import on_runtime
from ..plan.record import Partition
from ..runtime.offload import available_memory, format_size
from ..runtime.starpu import Runtime, resolve_here

def autotuned(cfg, config, comm, runtime, log, calibration=None):
    """cfg with the partition the autotuner (perf/autotune.py) chooses for its batch, on this
    machine's calibration (None: the error that says why there is none)."""
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
    choice = autotune.choose(model, cfg.batch, cfg.seq_len, calibration or load_calibration(),
                             log=log)
    r = choice.request
    log(f"autotune: {r.workers}x{r.cores_per_worker}, {r.sub_batches} sub-batch(es): {choice.why}")
    return replace(cfg, workers=r.workers, cores_per_worker=r.cores_per_worker,
                   sub_batches=r.sub_batches)


def run_partition(cfg, comm=None, runtime=None, memory=None) -> Partition:
    """The partition cfg runs on, decided once: cfg's request resolved on this process
    (partition.resolve); on a runtime given, the runtime's partition with cfg's sub-batches
    (partition.on_runtime: any other difference refused)."""
    if runtime is not None and cfg.engine == "starpu":
        return on_runtime(runtime.partition, cfg.partition_request(), cfg.batch)
    return resolve_here(cfg.partition_request(), comm.Get_size() if comm is not None else 1,
                        cfg.batch, memory is not None, cfg.engine)


def start_runtime(cfg, partition: Partition, comm=None, memory=None) -> Runtime:
    """A StarPU Runtime for the partition (on comm, under StarPU-MPI) and the memory budget
    given (runtime.offload.MemoryLimit)."""
    return Runtime(partition, comm=comm, memory=memory)


def check_memory(cfg, config, partition: Partition, ranks: int = 1) -> None:
    """Refuse, before allocating it, a run whose tensors (flow/memory.footprint: one process's
    share of the batch, its parameters, gradients and moments, the partition's attention's)
    do not fit the memory this machine has available now; --memory-limit is the way to train
    it."""
    B = max(1, cfg.batch // ranks)
    need = footprint(config, B, cfg.seq_len, 1, state_copies=4 if ranks == 1 else 2,
                     attention=partition.attention)
    have = available_memory()
    if need > have:
        raise StarpuLLMError(
            f"{opt('batch')} {cfg.batch} x {opt('seq_len')} {cfg.seq_len} needs about "
            f"{format_size(need)} of memory{' per process' if ranks > 1 else ''} (the model's "
            f"parameters, gradients and AdamW moments and the batch's activations), but this "
            f"machine has {format_size(have)} available: give a smaller {opt('batch')} or "
            f"{opt('seq_len')}, or train under {opt('memory_limit')} (StarPU then keeps what does "
            f"not fit on disk)")


def make_engine(cfg, partition: Partition, state, tokens, runtime=None, calibration=None):
    """The engine of the partition (its engine) over state; the StarPU engine runs on
    `runtime`, a pipeline's stages balanced on this machine's calibration (None: flops)."""
    try:
        return _make_engine(cfg, partition, state, tokens, runtime, calibration)
    except MemoryError as e:
        raise StarpuLLMError(f"out of memory while allocating the run's tensors ({e}): give a "
                             f"smaller {opt('batch')} or {opt('seq_len')}, or train under "
                             f"{opt('memory_limit')}") from None


def _make_engine(cfg, p: Partition, state, tokens, runtime, calibration):
    if p.engine == "reference":
        return ReferenceEngine(state.config, state, cfg.batch, cfg.seq_len, tokens,
                               threads=p.cores_per_worker, sub_batches=p.sub_batches,
                               attention=p.attention)
    return StarPUEngine(state.config, state, cfg.batch, cfg.seq_len, tokens, runtime, p,
                        record=cfg.record,
                        stage_costs=(stage_costs(p, cfg, state.config, calibration)
                                     if p.stages > 1 else None))


def stage_costs(p: Partition, cfg, config, calibration):
    """The layers' predicted seconds for a pipeline's stage boundaries (perf/stages.py) from
    this machine's calibration; None without one (the boundaries then balance flops). The
    boundaries change no result, only the speed."""
    if calibration is None:
        return None
    per_copy = p.per_copy(cfg.batch)
    if not p.sub_batches or per_copy % p.sub_batches:
        return None          # the engine says what is wrong
    return layer_costs(config, per_copy // p.sub_batches, cfg.seq_len, CostModel(calibration),
                       p.cores_per_worker)


def calibration():
    """This machine's calibration (perf/predict.load_calibration), read once by a run's set-up;
    None without one (or an unreadable one): the run then goes without what it gives."""
    try:
        return load_calibration()
    except StarpuLLMError:
        return None


def calibrated_peak(partition: Partition, machine) -> float | None:
    """The sgemm FLOP/s of the cores a run uses (per rank, times the ranks) on this machine's
    calibration (`machine`): what a step's model FLOPs per second are compared with (its
    "mfu"); None without a calibration."""
    if machine is None:
        return None
    cores = min(machine.cores, partition.cores)
    return machine.sgemm(cores) * partition.ranks
