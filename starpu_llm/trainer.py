"""Training from Python: TrainConfig + train(), the same as `starpu-llm train`.

    from starpu_llm import TrainConfig, train
    result = train(TrainConfig(model="d12", batch=4, seq_len=64, steps=10))
    print(result.tokens_per_ms, result.losses)
"""
from __future__ import annotations

import json
import os
import resource
import time
from dataclasses import dataclass, field

import numpy as np

from . import data, formats
from .config import MODELS, GPTConfig, check_batch_shape
from .errors import StarpuLLMError
from .state import TrainState, random_init


@dataclass
class TrainConfig:
    model: str = "d12"                 # a name in config.MODELS (d12 = GPT-2 124M)
    init_from: str | None = None       # an llm.c checkpoint; its header gives the model
    train_data: str | None = None      # a token shard; default: bundled Shakespeare
    batch: int = 4                     # B, the global batch (sequences per step)
    seq_len: int = 64                  # T
    steps: int = 10
    lr: float = 1e-4
    weight_decay: float = 0.0
    engine: str = "starpu"             # "starpu" or "reference"
    workers: int | None = None         # n x k partition of the cores (StarPU engine)
    cores_per_worker: int | None = None
    sub_batches: int | None = None     # data parallelism; default one per worker
    threads: int | None = None         # reference engine's OpenMP/BLAS threads (default: all)
    sched: str | None = None           # StarPU scheduler override
    kcore: str | None = None           # k-core tasks: "team" (default) or "forkjoin"
    oversubscribe: bool = False
    seed: int = 1337
    save: str | None = None            # write the trained model (llm.c format) here
    metrics_jsonl: str | None = None   # one JSON object per step
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
            raise StarpuLLMError(f"--model {cfg.model!r} is not a known model; choose one of "
                                 f"{', '.join(MODELS)} or give an llm.c checkpoint with --init-from")
        config = MODELS[cfg.model]
        params = random_init(config, cfg.seed)
    return TrainState(config=config, params=params)


def run_settings(cfg: TrainConfig, config: GPTConfig, loader) -> dict:
    """What every MPI rank must agree on (compared before training)."""
    toks = loader.tokens
    return {"model": str(config), "batch": cfg.batch, "seq_len": cfg.seq_len,
            "steps": cfg.steps, "lr": cfg.lr, "weight_decay": cfg.weight_decay,
            "seed": cfg.seed, "init_from": cfg.init_from, "sub_batches": cfg.sub_batches,
            "train_data": (loader.num_tokens, int(toks[:4096].astype(np.int64).sum()),
                           int(toks[-4096:].astype(np.int64).sum())),
            "data_position": loader.position}


def make_engine(cfg: TrainConfig, state: TrainState, tokens, runtime=None, comm=None):
    """The engine of cfg.engine over state; starts a StarPU Runtime (on comm, under
    StarPU-MPI) if none is given."""
    from .engine import ReferenceEngine, StarPUEngine
    if cfg.engine == "reference":
        return ReferenceEngine(state.config, state, cfg.batch, cfg.seq_len, tokens,
                               threads=cfg.threads, sub_batches=cfg.sub_batches or 1)
    if cfg.engine != "starpu":
        raise StarpuLLMError(f"--engine {cfg.engine!r}: choose starpu or reference")
    from .runtime import Runtime
    if runtime is None:
        runtime = Runtime(cfg.workers, cfg.cores_per_worker, cfg.sched, cfg.oversubscribe,
                          comm=comm, kcore=cfg.kcore)
    return StarPUEngine(state.config, state, cfg.batch, cfg.seq_len, tokens, runtime,
                        sub_batches=cfg.sub_batches, record=cfg.record)


def train(cfg: TrainConfig, state: TrainState | None = None, runtime=None) -> TrainResult:
    """Train for cfg.steps steps; returns losses, timings and the final state.

    A running `runtime` is used (and left running); otherwise the StarPU engine starts one
    for cfg's partition and shuts it down at the end."""
    if cfg.steps < 1:
        raise StarpuLLMError(f"--steps must be at least 1, got {cfg.steps}")
    from . import distributed
    comm = distributed.world() if runtime is None else runtime.comm
    rank = comm.Get_rank() if comm is not None else 0
    log = (cfg.log if rank == 0 else None) or (lambda *a, **k: None)
    if comm is not None:
        if cfg.engine != "starpu":
            raise StarpuLLMError("under mpirun only --engine starpu runs (the reference engine "
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

    from ._clib import lib
    engine = make_engine(cfg, state, loader.tokens, runtime, comm)
    own_runtime = runtime is None and getattr(engine, "runtime", None)
    result = TrainResult(engine=engine.describe())
    if cfg.trace:
        lib.sl_trace_enable(200_000)
    metrics = open(cfg.metrics_jsonl + ".tmp", "w") if cfg.metrics_jsonl and rank == 0 else None
    log(f"model: L={config.L} NH={config.NH} C={config.C} V={config.V} Vp={config.Vp} "
        f"maxT={config.maxT}, {config.num_parameters:,} parameters")
    log(f"data: {path} ({loader.num_tokens:,} tokens), B={cfg.batch} T={cfg.seq_len}")
    log(f"engine: {result.engine}")
    try:
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
                metrics.write(json.dumps({"step": state.step, "loss": loss, "ms": ms,
                                          "tokens_per_ms": tpm}) + "\n")
                metrics.flush()
            if not np.isfinite(loss):
                raise StarpuLLMError(f"the loss diverged at step {state.step} ({loss}); "
                                     "lower --lr")
        state.data = loader.state()
        timed = result.step_ms[cfg.warmup_steps:] or result.step_ms
        result.timed_steps = len(timed)
        result.tokens_per_ms = tokens_per_step * len(timed) / sum(timed)
        if cfg.trace:
            result.trace = read_trace(lib)
        result.records = engine.ops.records
    finally:
        engine.close()
        if cfg.trace:
            lib.sl_trace_enable(0)
        if own_runtime:
            own_runtime.shutdown()
        if metrics:
            metrics.close()
            os.replace(cfg.metrics_jsonl + ".tmp", cfg.metrics_jsonl)
    result.peak_rss_mb = peak_rss_mb()
    result.state = state
    log(f"tokens/ms over {result.timed_steps} timed step(s): {result.tokens_per_ms:.4f}"
        f"   peak RSS: {result.peak_rss_mb:.0f} MB")
    if cfg.save and rank == 0:    # rank 0 owns the parameters
        formats.write_checkpoint(cfg.save, config, state.params)
        log(f"saved {cfg.save}")
    return result


def read_trace(lib):
    """The recorded tasks: (codelet, worker, cores, start ns, end ns, buffers), where buffers
    is ((handle address, SL_ACCESS_* mode), ...) as StarPU gave them to the task, or None for
    a reduction method StarPU ran inline inside another task."""
    from ._clib import ffi
    n = lib.sl_trace_count()
    ev = lib.sl_trace_events()
    names = [ffi.string(lib.sl_codelet_name(i)).decode() for i in range(lib.sl_codelet_count())]
    out = []
    for e in (ev[i] for i in range(n)):
        nb = min(e.nbuffers, lib.SL_TRACE_MAXBUF)
        bufs = None if e.nbuffers < 0 else tuple(
            (int(ffi.cast("uintptr_t", e.handles[b])), int(e.modes[b])) for b in range(nb))
        out.append((names[e.codelet], e.worker, e.ncores, e.start_ns, e.end_ns, bufs))
    return out
