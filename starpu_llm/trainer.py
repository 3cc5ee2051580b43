"""Training from Python: TrainConfig + train(), the same as `starpu-llm train`.

    from starpu_llm import TrainConfig, train
    result = train(TrainConfig(model="d12", batch=4, seq_len=64, steps=10))
    print(result.tokens_per_ms, result.losses)
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field, fields, replace

import numpy as np

from .io import checkpoint, data, formats
from .io.atomic import AtomicFile, check_writable
from .config import MODELS, GPTConfig, check_batch_shape
from .errors import StarpuLLMError, opt
from .runs import peak_rss_mb
from .schedule import SCHEDULES, check_schedule, learning_rate
from .state import TrainState, random_init
from .validation import Validation


PARALLELISM = "parallelism (StarPU engine)"     # the help group of the partition flags


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
    model: str = setting("d12", "model size when not initialised from a checkpoint (d12 = GPT-2 124M)",
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
                                 "a --checkpoint-dir: its newest); --steps counts the whole run",
                                 metavar="CKPT", ranks_agree=True)
    metrics_jsonl: str | None = setting(None, "one JSON object per step", metavar="PATH")
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
        "(needs `starpu-llm calibrate`) (default: auto where this machine is calibrated and no "
        "other partition setting is given, else 1)", check="positive_or_auto", group=PARALLELISM)
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
    threads: int | None = setting(None, "reference engine: OpenMP/BLAS threads (default: all cores)",
                                  check="positive", group=PARALLELISM)
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


def load_model(cfg: TrainConfig) -> TrainState:
    if cfg.resume:
        if cfg.init_from:
            raise StarpuLLMError(f"{opt('resume')} continues a saved run and {opt('init_from')} "
                                 f"starts a new one from given weights; give only one of them")
        return checkpoint.read(cfg.resume)
    if cfg.init_from:
        config, params = formats.read_checkpoint(cfg.init_from)
    else:
        if cfg.model not in MODELS:
            raise StarpuLLMError(f"{opt('model')} {cfg.model!r} is not a known model; choose one of "
                                 f"{', '.join(MODELS)} or give an llm.c checkpoint with {opt('init_from')}")
        config = MODELS[cfg.model]
        params = random_init(config, cfg.seed)
    return TrainState(config=config, params=params)


def run_settings(cfg: TrainConfig, config: GPTConfig, loader) -> dict:
    """What every MPI rank must agree on (compared before training): the TrainConfig fields
    marked ranks_agree, the model's shape, and the training data (its content, not its path)."""
    toks = loader.tokens
    settings = {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.metadata.get("ranks_agree")}
    return {**settings, "model": str(config),
            "train_data": (loader.num_tokens, int(toks[:4096].astype(np.int64).sum()),
                           int(toks[-4096:].astype(np.int64).sum())),
            "data_position": loader.position}


def partition_by_default(cfg: TrainConfig, config, comm, runtime) -> bool:
    """Whether the autotuner chooses the partition although --workers auto was not given: a
    single process starting its own StarPU engine, a model of MODELS (not a checkpoint of
    another shape), no partition setting given, and a calibration of this machine on disk
    (without one, the default stays 1 x all cores)."""
    from .perf.machine import default_path
    given = (cfg.workers, cfg.cores_per_worker, cfg.sub_batches, cfg.kcore, cfg.sched)
    return (cfg.engine == "starpu" and comm is None and runtime is None
            and config in MODELS.values() and all(x is None for x in given)
            and os.path.exists(default_path()))


def autotuned(cfg: TrainConfig, config, comm, runtime, log) -> TrainConfig:
    """cfg with the partition the autotuner (perf/autotune.py) chooses for its batch."""
    from .perf import autotune
    from .perf.predict import load_calibration
    if comm is not None or runtime is not None or cfg.engine != "starpu":
        raise StarpuLLMError(f"{opt('workers')} auto chooses the partition of a single process "
                             f"starting its own StarPU engine: give {opt('workers')} N there")
    if cfg.cores_per_worker or cfg.sub_batches:
        raise StarpuLLMError(f"{opt('workers')} auto chooses {opt('cores_per_worker')} and "
                             f"{opt('sub_batches')} too: leave them out")
    model = next((name for name, c in MODELS.items() if c == config), None)
    if model is None:
        raise StarpuLLMError(f"{opt('workers')} auto: the model is none of {', '.join(MODELS)}; "
                             f"give {opt('workers')} N")
    choice = autotune.choose(model, cfg.batch, cfg.seq_len, load_calibration(), log=log)
    log(f"autotune: {choice.workers}x{choice.cores}, {choice.sub_batches} sub-batch(es): "
        f"{choice.why}")
    return replace(cfg, workers=choice.workers, cores_per_worker=choice.cores,
                   sub_batches=choice.sub_batches)


def start_runtime(cfg: TrainConfig, comm=None):
    """A StarPU Runtime for cfg's partition (on comm, under StarPU-MPI)."""
    from .runtime.starpu import Runtime
    return Runtime(cfg.workers, cfg.cores_per_worker, cfg.sched, cfg.oversubscribe,
                   comm=comm, kcore=cfg.kcore)


def make_engine(cfg: TrainConfig, state: TrainState, tokens, runtime=None):
    """The engine of cfg.engine over state; the StarPU engine runs on `runtime`."""
    if cfg.engine == "reference":
        from .flow.reference import ReferenceEngine
        return ReferenceEngine(state.config, state, cfg.batch, cfg.seq_len, tokens,
                               threads=cfg.threads, sub_batches=cfg.sub_batches or 1)
    if cfg.engine != "starpu":
        raise StarpuLLMError(f"{opt('engine')} {cfg.engine!r}: choose starpu or reference")
    from .flow.engine import StarPUEngine
    return StarPUEngine(state.config, state, cfg.batch, cfg.seq_len, tokens, runtime,
                        sub_batches=cfg.sub_batches, record=cfg.record)


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


def open_metrics(path, step: int) -> AtomicFile:
    """The metrics file, written under a temporary name as the run goes. A run resumed at
    `step` keeps the rows up to that step from the file it replaces, so the file covers the
    whole run (the rows of steps the resumed run redoes are dropped)."""
    out = AtomicFile(path, text=True)
    if step and os.path.exists(path):
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
                    out.file.write(line)
    return out


def checkpoint_step(cfg: TrainConfig, engine, state: TrainState, loader, rank: int, log) -> None:
    """--save-every's checkpoint of the step just done (every rank syncs; rank 0 writes). A
    failed save does not end the run: the next one, or --save at the end, may succeed."""
    engine.sync()
    state.data = loader.state()
    if rank != 0:
        return
    try:
        log(f"checkpoint {checkpoint.save_step(cfg.checkpoint_dir, state, cfg.keep_checkpoints)}")
    except StarpuLLMError as e:
        log(f"warning: the checkpoint of step {state.step} was not written: {e}; training goes on")


def save_model(cfg: TrainConfig, state: TrainState, log) -> None:
    """--save at the end of the run. Should it fail after all (the path was checked before the
    first step), the model goes to a fallback file in the working directory, so that the
    training is not lost, and the error says where."""
    try:
        checkpoint.write(cfg.save, state)
    except StarpuLLMError as e:
        fallback = os.path.abspath(f"starpu-llm-unsaved-{os.getpid()}-step{state.step}.bin")
        try:
            checkpoint.write(fallback, state)
        except StarpuLLMError as again:
            raise StarpuLLMError(f"{e.args[0]}; writing the fallback {fallback} failed too "
                                 f"({again.args[0]}): the trained model is lost") from e
        raise StarpuLLMError(f"{e.args[0]}; the trained model was written to {fallback} "
                             f"instead (and its state to {checkpoint.companion(fallback)})") from e
    log(f"saved {cfg.save} and {checkpoint.companion(cfg.save)}")


class StopOnCtrlC:
    """While training, Ctrl-C (SIGINT) asks to stop after the current step, so the run ends
    as after its last step (StarPU shut down, --save written) rather than wherever the signal
    lands; a second Ctrl-C interrupts at once. Python runs signal handlers in the main thread
    only, so elsewhere nothing changes."""

    def __init__(self):
        self.requested = False
        self._installed = False

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handler)
            self._installed = True
        return self

    def __exit__(self, *exc):
        if self._installed:    # None: a handler not set from Python; Python's default then
            signal.signal(signal.SIGINT, self._previous or signal.default_int_handler)

    def _handler(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def stop(self, comm) -> bool:
        """Whether to stop after this step; under MPI every rank stops after the same one."""
        if comm is None:
            return self.requested
        # the ranks' answers agree; a Ctrl-C that lands during the allgather stays requested
        # (not overwritten by its result) and stops every rank after the next step
        agreed = any(comm.allgather(self.requested))
        self.requested = self.requested or agreed
        return agreed


def step_extras(cfg: TrainConfig, engine, validation, lr: float, rank: int, last: bool) -> dict:
    """What the metrics record of a step beyond its loss and time, when it applies: the
    scheduled learning rate, the gradients' norm before clipping (rank 0 holds it), the
    validation loss (after the step's update, every val_every steps and after the last)."""
    extra = {}
    if cfg.lr_schedule != "constant" or cfg.warmup_steps:
        extra["lr"] = lr
    if cfg.grad_clip > 0 and rank == 0:
        extra["grad_norm"] = engine.grad_norm()
    if validation and validation.due(engine.state.step, last):
        extra["val_loss"] = validation.loss(engine)
    return extra


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
    from .runtime import mpi as distributed
    comm = distributed.world() if runtime is None else runtime.comm
    rank = comm.Get_rank() if comm is not None else 0
    log = (cfg.log if rank == 0 else None) or (lambda *a, **k: None)
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
    state = state or load_model(cfg)
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

    if cfg.workers == "auto" or partition_by_default(cfg, config, comm, runtime):
        cfg = autotuned(cfg, config, comm, runtime, log)
    own_runtime = None
    if runtime is None and cfg.engine == "starpu":
        runtime = own_runtime = start_runtime(cfg, comm)
    engine = make_engine(cfg, state, loader.tokens, runtime)
    result = TrainResult(engine=engine.describe())
    tracing = cfg.trace and runtime is not None   # the reference engine runs no tasks
    if tracing:
        runtime.start_trace(200_000)
    # written as the run goes, under its final name at the end (also of a failed run)
    metrics = open_metrics(cfg.metrics_jsonl, state.step) if cfg.metrics_jsonl and rank == 0 else None
    log(f"model: L={config.L} NH={config.NH} C={config.C} V={config.V} Vp={config.Vp} "
        f"maxT={config.maxT}, {config.num_parameters:,} parameters")
    log(f"data: {path} ({loader.num_tokens:,} tokens), B={cfg.batch} T={cfg.seq_len}")
    log(f"engine: {result.engine}")
    if validation:
        log(validation.describe())
    sampler = None
    try:
        if cfg.sample_every:
            from .flow.generate import TrainingSampler
            sampler = TrainingSampler(engine, cfg.seed)
        tokens_per_step = cfg.batch * cfg.seq_len
        # --steps counts the whole run (a resumed one too): also the schedule's horizon
        for i in range(cfg.steps - state.step):
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
            if "val_loss" in extra:
                result.val_losses.append((state.step, extra["val_loss"]))
            log(f"step {state.step:4d}/{cfg.steps}: train loss {loss:.6f} ({ms:.1f} ms, {tpm:.3f} tok/ms)"
                + "".join(f", {k.replace('_', ' ')} {v:.6g}" for k, v in extra.items()))
            if metrics:
                metrics.file.write(json.dumps({"step": state.step, "loss": loss, "ms": ms,
                                               "tokens_per_ms": tpm, **extra}) + "\n")
                metrics.file.flush()
            if not np.isfinite(loss):
                raise StarpuLLMError(f"the loss diverged at step {state.step} ({loss}); "
                                     f"lower {opt('lr')}")
            if sampler and state.step % cfg.sample_every == 0:
                log(f"sample at step {state.step}: {sampler.sample()!r}")
            stop = ctrl_c.stop(comm)
            if cfg.save_every and (state.step % cfg.save_every == 0 or stop):
                checkpoint_step(cfg, engine, state, loader, rank, log)
            if stop:
                break
        state.data = loader.state()
        timed = result.step_ms[cfg.untimed_steps:] or result.step_ms
        result.timed_steps = len(timed)
        result.tokens_per_ms = tokens_per_step * len(timed) / sum(timed)
        if cfg.trace:
            result.trace = runtime.trace() if tracing else []
        result.records = engine.submitted()
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
    result.state = state
    log(f"tokens/ms over {result.timed_steps} timed step(s): {result.tokens_per_ms:.4f}"
        f"   peak RSS: {result.peak_rss_mb:.0f} MB")
    if cfg.save and rank == 0:    # rank 0 owns the parameters
        save_model(cfg, state, log)
    if ctrl_c.requested:
        saved = cfg.save or (cfg.checkpoint_dir if cfg.save_every else None)
        log(f"stopped by Ctrl-C after step {state.step}"
            + (f"; continue with --resume {saved} --steps {cfg.steps}" if saved else ""))
        raise KeyboardInterrupt
    return result
