"""Training from Python: TrainConfig + train(), the same as `starpu-llm train`: the run's
settings and the training loop. Around it: what the run starts from and what a resumed run
keeps (resume.py), its engine and partition (engines.py), Ctrl-C (ctrl_c.py), the metrics
file (metrics.py), the checkpoints (checkpointing.py), samples (sampler.py).

    from starpu_llm import TrainConfig, train
    result = train(TrainConfig(model="d12", batch=4, seq_len=64, steps=10))
    print(result.tokens_per_ms, result.losses)
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field, fields

import numpy as np

from .checkpointing import checkpoint_step, save_model
from .config import MODELS, GPTConfig, check_batch_shape
from .ctrl_c import StopOnCtrlC
from .engines import autotuned, make_engine, partition_of, start_runtime
from .errors import StarpuLLMError, opt
from .flow.placement import PIPELINE_SCHEDULES
from .io import checkpoint, data
from .io.atomic import check_writable
from .metrics import Metrics, step_extras
from .record import RunRecord, Settings
from .resume import load_model, on_recorded_partition, warn_changes
from .runs import peak_rss_mb
from .runtime import mpi as distributed
from .runtime.offload import MemoryLimit
from .sampler import TrainingSampler
from .schedule import SCHEDULES, check_schedule, learning_rate
from .state import TrainState
from .validation import Validation


PARALLELISM = "parallelism (StarPU engine)"     # the help group of the partition flags
MEMORY = "memory budget (StarPU engine)"


def setting(default, help: str | None = None, *, short: str | None = None,
            check: str | None = None, choices=None, metavar: str | None = None,
            group: str | None = None, ranks_agree: bool = False):
    """A TrainConfig field. With `help` it is also the `starpu-llm train` flag --<name with
    dashes> (cli.py builds the flags from these fields): `short` option, `check` ("positive":
    a whole number >= 1, "nonneg": a number >= 0), `choices`, `metavar`, help `group`.
    `ranks_agree`: every MPI rank must have the same value (see run_settings)."""
    meta = dict(help=help, short=short, check=check, choices=choices, metavar=metavar,
                group=group)
    meta = {k: v for k, v in meta.items() if v is not None}
    if ranks_agree:
        meta["ranks_agree"] = True
    return field(default=default, metadata=meta)


@dataclass
class TrainConfig:
    model: str | None = setting(None, "model size (default d12 = GPT-2 124M; with --init-from or "
                                "--resume, the checkpoint's: a contradicting one is refused)",
                                choices=sorted(MODELS))
    init_from: str | None = setting(None, "llm.c fp32 checkpoint to start from", metavar="CKPT",
                                    ranks_agree=True)   # its header gives the model
    train_data: str | None = setting(None, "llm.c token shard (default: bundled Shakespeare)",
                                     metavar="SHARD")
    batch: int = setting(4, "B, global batch (default 4)", short="-b", check="positive",
                         ranks_agree=True)
    seq_len: int = setting(64, "T (default 64)", short="-t", check="positive", ranks_agree=True)
    steps: int = setting(10, "training steps (default 10)", short="-n", check="positive",
                         ranks_agree=True)
    lr: float = setting(1e-4, "AdamW learning rate (default 1e-4)", check="nonneg",
                        ranks_agree=True)
    weight_decay: float = setting(0.0, "AdamW decoupled weight decay (default 0)", check="nonneg",
                                  ranks_agree=True)
    engine: str = setting("starpu", "starpu: the task graph; reference: the same kernels in a "
                          "plain loop", choices=["starpu", "reference"])
    seed: int = setting(1337, "seed of the random init", ranks_agree=True)
    save: str | None = setting(None, "write the trained model (llm.c format) and its PATH.state "
                               "(to --resume from), also when Ctrl-C stops the run", metavar="PATH")
    save_every: int | None = setting(None, "write a checkpoint every N steps into "
                                     "--checkpoint-dir", check="positive", metavar="N",
                                     ranks_agree=True)
    checkpoint_dir: str = setting("checkpoints", "where --save-every writes step_<N>.bin and its "
                                  ".state (default: checkpoints)", metavar="DIR")
    keep_checkpoints: int = setting(2, "checkpoints of --save-every kept, the newest (default 2)",
                                    check="positive", metavar="K")
    resume: str | None = setting(None, "continue the run saved in CKPT (a model with its .state, or "
                                 "a --checkpoint-dir: its newest) on its recorded partition unless "
                                 "one is given; --steps counts the whole run",
                                 metavar="CKPT", ranks_agree=True)
    metrics_jsonl: str | None = setting(None, "one JSON object per step (with the partition it "
                                        "ran on)", metavar="PATH")
    # validation, learning-rate schedule, gradient clipping
    val_data: str | None = setting(None, "validation shard (default: the bundled corpus's "
                                   "validation shard)", metavar="SHARD")
    val_every: int = setting(0, "mean validation loss every N steps and after the last "
                             "(default 0: none)", metavar="N", ranks_agree=True)
    val_batches: int = setting(10, "M fixed validation batches (default 10)", check="positive",
                               metavar="M", ranks_agree=True)
    lr_schedule: str = setting("constant", "learning rate: constant, or cosine decay to "
                               "--min-lr over the run (after the warmup)",
                               choices=list(SCHEDULES), ranks_agree=True)
    warmup_steps: int = setting(0, "linear learning-rate warmup over the first N steps "
                                "(default 0)", metavar="N", ranks_agree=True)
    min_lr: float = setting(0.0, "the cosine schedule's final learning rate (default 0)",
                            check="nonneg", ranks_agree=True)
    grad_clip: float = setting(0.0, "clip the global L2 norm of the gradients to C before "
                               "AdamW (default 0: off)", check="nonneg", metavar="C",
                               ranks_agree=True)
    sample_every: int = setting(0, "every N steps, print a sample from the model being trained "
                                "(default: never)", check="positive", metavar="N")
    # the n x k partition of the cores (StarPU engine)
    workers: int | str | None = setting(
        None, "N: parallel workers, or auto: the partition and sub-batches the performance model "
        "ranks best, confirmed by a short trial of the two best and cached per machine and shape "
        "(needs `starpu-llm calibrate`) (default: 1 worker on all usable cores, calibrated or "
        "not; with --resume, the recorded partition)", check="positive_or_auto", group=PARALLELISM)
    cores_per_worker: int | None = setting(None, "K: cores of each worker (default: all cores / N)",
                                           check="positive", group=PARALLELISM)
    sub_batches: int | None = setting(
        None, "split the batch into this many sub-batches (default: one per worker)",
        check="positive", group=PARALLELISM, ranks_agree=True)
    kcore: str | None = setting(
        None, "how a task gets K > 1 cores without StarPU parallel workers: team (one worker per "
        "K-core group with a bound OpenMP team; default) or forkjoin (FORKJOIN tasks on combined "
        "workers, scheduler peager)", choices=["team", "forkjoin"], group=PARALLELISM)
    sched: str | None = setting(None, "StarPU scheduler (default: peager for forkjoin, else lws)",
                                group=PARALLELISM)
    oversubscribe: bool = setting(False, "allow N x K above the usable cores (correctness tests only)",
                                  group=PARALLELISM)
    ownership: str | None = setting(
        None, "under mpirun, which ranks own the parameters, gradients and AdamW moments: "
        "sharded (each tensor slice on one rank, bytes balanced; the default) or rank0 (all on "
        "rank 0, the paper's scheme)", choices=["sharded", "rank0"], group=PARALLELISM,
        ranks_agree=True)
    pipeline_stages: int | None = setting(
        None, "under mpirun, S pipeline stages: the layers split into S contiguous stages (the "
        "first also runs the embedding and the head), balanced by their flops; the sub-batches "
        "flow through them as micro-batches; R = S x D ranks run D data-parallel copies "
        "(default 1: data parallelism only)", check="positive", metavar="S", group=PARALLELISM,
        ranks_agree=True)
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
                        "GPU and StarPU moves the data (default 0: CPUs only)", metavar="G",
                        group=PARALLELISM, ranks_agree=True)
    gpu_matmul: str = setting("tf32", "the GPUs' matmul precision: tf32 (tensor cores; the "
                              "default) or fp32", choices=["tf32", "fp32"], group=PARALLELISM,
                              ranks_agree=True)
    # training under a memory budget (runtime/offload.py, flow/placement.py)
    memory_limit: str | None = setting(
        None, "keep the run's main memory under SIZE (e.g. 12G, 800M; powers of 1024): StarPU "
        "allocates every tensor and evicts those that wait (AdamW moments, activations between "
        "their forward and backward tasks, gradients, parameters) to --offload-dir, fetching them "
        "back for the tasks that need them; peak RSS stays under SIZE plus the interpreter and "
        "libraries; the same results as without it (default: no limit)", metavar="SIZE",
        group=MEMORY)
    offload_dir: str | None = setting(
        None, "where --memory-limit evicts to: a new folder is made there and removed at exit "
        "(default: the system's temporary folder)", metavar="DIR", group=MEMORY)
    # Python-only settings (no flag)
    untimed_steps: int = 1             # first steps excluded from the tokens/ms metric
    trace: bool = False                # record each task's worker and start/end times
    record: bool = False               # record each submitted task (name, writes, reads)
    log: callable = print              # where step lines go (None: silent)


@dataclass
class TrainResult:
    losses: list = field(default_factory=list)
    step_ms: list = field(default_factory=list)
    tokens_per_ms: float = float("nan")   # over the timed (post-warmup) steps
    timed_steps: int = 0
    peak_rss_mb: float = 0.0
    engine: str = ""
    state: TrainState | None = None
    trace: list | None = None
    records: list | None = None
    val_losses: list = field(default_factory=list)   # (step, validation loss)
    # under mpirun: every rank's (bytes sent, bytes received) per timed step, from StarPU-MPI's
    # statistics (None when off: runtime.mpi.COMM_STATS_ENV), and every rank's peak RSS
    traffic: list | None = None
    rank_peak_rss_mb: list | None = None
    # under --memory-limit: (bytes read from, bytes written to) the disk per step (this rank)
    disk_traffic: list | None = None


def run_settings(cfg: TrainConfig, config: GPTConfig, loader) -> dict:
    """What every MPI rank must agree on (compared before training): the TrainConfig fields
    marked ranks_agree, the model's shape, and the training data (its content, not its path)."""
    toks = loader.tokens
    settings = {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.metadata.get("ranks_agree")}
    return {**settings, "model": str(config),
            "train_data": (loader.num_tokens, int(toks[:4096].astype(np.int64).sum()),
                           int(toks[-4096:].astype(np.int64).sum())),
            "data_position": loader.position}


def _flushed(log):
    def out(*args, **kwargs):
        log(*args, **kwargs)
        sys.stdout.flush()
    return out


def check_outputs(cfg: TrainConfig, comm, rank: int) -> None:
    """Fail before the first step, on every rank, when rank 0 (which writes them all) could
    not write an output, instead of losing the trained model after the run."""
    problem = None
    if rank == 0:
        try:
            if cfg.save:
                checkpoint.check_writable(cfg.save)
            if cfg.save_every:
                checkpoint.check_writable(checkpoint.step_path(cfg.checkpoint_dir, 0))
            if cfg.metrics_jsonl:
                check_writable(cfg.metrics_jsonl)
        except StarpuLLMError as e:
            problem = e.args[0]
    if comm is not None:
        problem = comm.bcast(problem, root=0)
    if problem:
        raise StarpuLLMError(problem)


def train(cfg: TrainConfig, state: TrainState | None = None, runtime=None) -> TrainResult:
    """Train up to step cfg.steps (a resumed state continues from its step); returns losses,
    timings and the final state.

    A running `runtime` is used (and left running); otherwise the StarPU engine starts one
    for cfg's partition and shuts it down at the end. Ctrl-C stops after the current step,
    saves as at the end (--save, and a checkpoint with --save-every), then raises
    KeyboardInterrupt (StopOnCtrlC)."""
    with StopOnCtrlC() as ctrl_c:
        return _train(cfg, state, runtime, ctrl_c)


def _train(cfg: TrainConfig, state: TrainState | None, runtime, ctrl_c: StopOnCtrlC) -> TrainResult:
    if cfg.steps < 1:
        raise StarpuLLMError(f"{opt('steps')} must be at least 1, got {cfg.steps}")
    check_schedule(cfg.lr_schedule, cfg.lr, cfg.warmup_steps, cfg.min_lr)
    comm = distributed.world() if runtime is None else runtime.comm
    rank = comm.Get_rank() if comm is not None else 0
    log = (cfg.log if rank == 0 else None) or (lambda *a, **k: None)
    memory = MemoryLimit.of(cfg.memory_limit, cfg.offload_dir)
    if memory is not None:
        if cfg.engine != "starpu":
            raise StarpuLLMError(f"{opt('memory_limit')} needs {opt('engine')} starpu (the reference "
                                 f"engine keeps every tensor in numpy arrays)")
        # a disk that fills ends the process from inside StarPU: the lines so far are out
        log = _flushed(log)
    check_outputs(cfg, comm, rank)
    if comm is not None:
        if cfg.engine != "starpu":
            raise StarpuLLMError(f"under mpirun only {opt('engine')} starpu runs (the reference engine "
                                 "is a single process)")
        if runtime is None:
            distributed.pin_rank(comm)
        if rank == 0 and not (cfg.train_data and (cfg.val_data or not cfg.val_every)):
            data.default_dataset()          # tokenize once, then every rank reads the cache
        comm.Barrier()
    saved = None            # the record of the run a --resume continues
    if state is None:       # under a limit, kept in its files (or drawn) until StarPU has it
        state, saved = load_model(cfg, lazy=memory is not None)
    if state.step >= cfg.steps:
        raise StarpuLLMError(f"the run is at step {state.step} already and {opt('steps')} counts the "
                             f"steps of the whole run: give {opt('steps')} above {state.step}")
    config = state.config
    check_batch_shape(config, cfg.batch, cfg.seq_len)
    path = cfg.train_data or data.default_dataset()[0]
    loader = data.DataLoader(path, cfg.batch, cfg.seq_len, vocab_size=config.V)
    if state.data:
        loader.load_state(state.data)
    if comm is not None:
        distributed.check_same_settings(comm, run_settings(cfg, config, loader))
    validation = None
    if cfg.val_every:
        validation = Validation(cfg.val_data or data.default_dataset()[1], cfg.batch,
                                cfg.seq_len, config.V, cfg.val_every, cfg.val_batches)

    # the partition: the default, or --workers auto's, or a --resume's recorded one
    if cfg.resume:
        cfg = on_recorded_partition(cfg, saved)
    if cfg.workers == "auto":
        cfg = autotuned(cfg, config, comm, runtime, log)
    own_runtime = None
    if runtime is None and cfg.engine == "starpu":
        runtime = own_runtime = start_runtime(cfg, comm, memory)
    elif memory is not None and runtime.memory != memory:
        raise StarpuLLMError(f"{opt('memory_limit')}: the runtime given was started with "
                             f"{runtime.memory}; start it with the run's (Runtime(memory=...))")
    try:
        engine = make_engine(cfg, state, loader.tokens, runtime)
    except BaseException:       # e.g. a memory limit too small: StarPU stops (and its folder goes)
        if own_runtime:
            own_runtime.shutdown()
        raise
    result = TrainResult(engine=engine.describe())
    record = RunRecord(partition_of(engine), Settings.of(cfg))
    tracing = cfg.trace and runtime is not None   # the reference engine runs no tasks
    if tracing:
        runtime.start_trace(200_000)
    # written as the run goes, under its final name at the end (also of a failed run)
    metrics = (Metrics(cfg.metrics_jsonl, state.step, record.partition)
               if cfg.metrics_jsonl and rank == 0 else None)
    log(f"model: L={config.L} NH={config.NH} C={config.C} V={config.V} Vp={config.Vp} "
        f"maxT={config.maxT}, {config.num_parameters:,} parameters")
    log(f"data: {path} ({loader.num_tokens:,} tokens), B={cfg.batch} T={cfg.seq_len}")
    log(f"engine: {result.engine}")
    log(f"partition: {record.partition.describe()}")
    if cfg.resume:
        warn_changes(saved, record.partition, record.settings, log)
    if validation:
        log(validation.describe())
    sampler = None
    try:
        if cfg.sample_every:
            sampler = TrainingSampler(engine, cfg.seed)
        tokens_per_step = cfg.batch * cfg.seq_len
        # --steps counts the whole run (a resumed one too): also the schedule's horizon
        sent = []     # under MPI, the bytes sent so far at each step's start (if counted)
        disk = [runtime.disk_traffic()] if memory is not None else None
        for i in range(cfg.steps - state.step):
            if comm is not None:
                sent.append(runtime.bytes_sent())
            pos = loader.next_position()
            lr = learning_rate(state.step, cfg.steps, cfg.lr, cfg.lr_schedule, cfg.warmup_steps,
                               cfg.min_lr)
            t0 = time.perf_counter()
            loss = engine.step(pos, lr, cfg.weight_decay, cfg.grad_clip)
            ms = (time.perf_counter() - t0) * 1e3
            result.losses.append(loss)
            result.step_ms.append(ms)
            tpm = tokens_per_step / ms
            extra = step_extras(cfg, engine, validation, lr, rank, last=state.step == cfg.steps)
            if disk is not None:
                disk.append(runtime.disk_traffic())
                extra.update(disk_read_mb=(disk[-1][0] - disk[-2][0]) / 1e6,
                             disk_written_mb=(disk[-1][1] - disk[-2][1]) / 1e6)
            if "val_loss" in extra:
                result.val_losses.append((state.step, extra["val_loss"]))
            log(f"step {state.step:4d}/{cfg.steps}: train loss {loss:.6f} ({ms:.1f} ms, {tpm:.3f} tok/ms)"
                + "".join(f", {k.replace('_', ' ')} {v:.6g}" for k, v in extra.items()))
            if metrics:
                metrics.write(state.step, loss, ms, tpm, extra)
            if not np.isfinite(loss):
                raise StarpuLLMError(f"the loss diverged at step {state.step} ({loss}); "
                                     f"lower {opt('lr')}")
            if sampler and state.step % cfg.sample_every == 0:
                log(f"sample at step {state.step}: {sampler.sample()!r}")
            stop = ctrl_c.stop(comm)
            if cfg.save_every and (state.step % cfg.save_every == 0 or stop):
                checkpoint_step(cfg, engine, state, loader, rank, record, log)
            if stop:
                break
        state.data = loader.state()
        timed = result.step_ms[cfg.untimed_steps:] or result.step_ms
        result.timed_steps = len(timed)
        if comm is not None and sent:
            result.traffic = distributed.traffic(comm, sent[len(result.step_ms) - len(timed)],
                                                 runtime.bytes_sent(), len(timed))
        result.tokens_per_ms = tokens_per_step * len(timed) / sum(timed)
        if cfg.trace:
            result.trace = runtime.trace() if tracing else []
        result.records = engine.submitted()
        if disk is not None:
            result.disk_traffic = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(disk, disk[1:])]
        if cfg.save:
            engine.sync()       # under MPI the owners send rank 0 their slices to save
            if memory is not None and rank == 0:    # the state is in StarPU: saved from there
                save_model(cfg.save, state, record, log)
    finally:
        if sampler:
            sampler.close()
        engine.close()
        if tracing:
            runtime.stop_trace()
        if own_runtime:
            own_runtime.shutdown()
        if metrics:
            metrics.commit()
    result.peak_rss_mb = peak_rss_mb()
    if comm is not None:
        result.rank_peak_rss_mb = comm.allgather(result.peak_rss_mb)
    result.state = state
    log(f"tokens/ms over {result.timed_steps} timed step(s): {result.tokens_per_ms:.4f}"
        f"   peak RSS: {result.peak_rss_mb:.0f} MB")
    if cfg.save and rank == 0 and memory is None:    # rank 0 owns the parameters
        save_model(cfg.save, state, record, log)
    if ctrl_c.requested:
        saved = cfg.save or (cfg.checkpoint_dir if cfg.save_every else None)
        log(f"stopped by Ctrl-C after step {state.step}"
            + (f"; continue with --resume {saved} --steps {cfg.steps}" if saved else ""))
        raise KeyboardInterrupt
    return result
