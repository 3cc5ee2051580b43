"""Training from Python: TrainConfig + train(), the same as `starpu-llm train`.

    from starpu_llm import TrainConfig, train
    result = train(TrainConfig(model="d12", batch=4, seq_len=64, steps=10))
    print(result.tokens_per_ms, result.losses)
"""
from __future__ import annotations

import json
import resource
import time
from dataclasses import dataclass, field, fields

import numpy as np

from .io import data, formats
from .io.atomic import AtomicFile
from .config import MODELS, GPTConfig, check_batch_shape
from .errors import StarpuLLMError, opt
from .state import TrainState, random_init


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
    save: str | None = setting(None, "write the trained model (llm.c format)", metavar="PATH")
    metrics_jsonl: str | None = setting(None, "one JSON object per step", metavar="PATH")
    sample_every: int = setting(0, "every N steps, print a sample from the model being trained "
                                "(default: never)", check="positive", metavar="N")
    # the n x k partition of the cores (StarPU engine)
    workers: int | None = setting(None, "N: parallel workers (default: 1)", check="positive",
                                  group=PARALLELISM)
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
    warmup_steps: int = 1              # steps excluded from the tokens/ms metric
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


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def load_model(cfg: TrainConfig) -> TrainState:
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


def train(cfg: TrainConfig, state: TrainState | None = None, runtime=None) -> TrainResult:
    """Train for cfg.steps steps; returns losses, timings and the final state.

    A running `runtime` is used (and left running); otherwise the StarPU engine starts one
    for cfg's partition and shuts it down at the end."""
    if cfg.steps < 1:
        raise StarpuLLMError(f"{opt('steps')} must be at least 1, got {cfg.steps}")
    from .runtime import mpi as distributed
    comm = distributed.world() if runtime is None else runtime.comm
    rank = comm.Get_rank() if comm is not None else 0
    log = (cfg.log if rank == 0 else None) or (lambda *a, **k: None)
    if comm is not None:
        if cfg.engine != "starpu":
            raise StarpuLLMError(f"under mpirun only {opt('engine')} starpu runs (the reference engine "
                                 "is a single process)")
        if runtime is None:
            distributed.pin_rank(comm)
        if rank == 0 and not cfg.train_data:
            data.default_dataset()          # tokenize once, then every rank reads the cache
        comm.Barrier()
    state = state or load_model(cfg)
    config = state.config
    check_batch_shape(config, cfg.batch, cfg.seq_len)
    path = cfg.train_data or data.default_dataset()[0]
    loader = data.DataLoader(path, cfg.batch, cfg.seq_len, vocab_size=config.V)
    if comm is not None:
        distributed.check_same_settings(comm, run_settings(cfg, config, loader))
    if state.data:
        loader.load_state(state.data)

    own_runtime = None
    if runtime is None and cfg.engine == "starpu":
        runtime = own_runtime = start_runtime(cfg, comm)
    engine = make_engine(cfg, state, loader.tokens, runtime)
    result = TrainResult(engine=engine.describe())
    tracing = cfg.trace and runtime is not None   # the reference engine runs no tasks
    if tracing:
        runtime.start_trace(200_000)
    # written as the run goes, under its final name at the end (also of a failed run)
    metrics = AtomicFile(cfg.metrics_jsonl, text=True) if cfg.metrics_jsonl and rank == 0 else None
    log(f"model: L={config.L} NH={config.NH} C={config.C} V={config.V} Vp={config.Vp} "
        f"maxT={config.maxT}, {config.num_parameters:,} parameters")
    log(f"data: {path} ({loader.num_tokens:,} tokens), B={cfg.batch} T={cfg.seq_len}")
    log(f"engine: {result.engine}")
    sampler = None
    try:
        if cfg.sample_every:
            from .flow.generate import TrainingSampler
            sampler = TrainingSampler(engine, cfg.seed)
        tokens_per_step = cfg.batch * cfg.seq_len
        for i in range(cfg.steps):
            pos = loader.next_position()
            t0 = time.perf_counter()
            loss = engine.step(pos, cfg.lr, cfg.weight_decay)
            ms = (time.perf_counter() - t0) * 1e3
            result.losses.append(loss)
            result.step_ms.append(ms)
            tpm = tokens_per_step / ms
            log(f"step {state.step:4d}/{cfg.steps}: train loss {loss:.6f} ({ms:.1f} ms, {tpm:.3f} tok/ms)")
            if metrics:
                metrics.file.write(json.dumps({"step": state.step, "loss": loss, "ms": ms,
                                               "tokens_per_ms": tpm}) + "\n")
                metrics.file.flush()
            if not np.isfinite(loss):
                raise StarpuLLMError(f"the loss diverged at step {state.step} ({loss}); "
                                     f"lower {opt('lr')}")
            if sampler and state.step % cfg.sample_every == 0:
                log(f"sample at step {state.step}: {sampler.sample()!r}")
        state.data = loader.state()
        timed = result.step_ms[cfg.warmup_steps:] or result.step_ms
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
        formats.write_checkpoint(cfg.save, config, state.params)
        log(f"saved {cfg.save}")
    return result
