"""Training from Python: TrainConfig + train(), the same as `starpu-llm train`: the run's
settings and the training loop. Around it: what the run starts from and what a resumed run
keeps (training/resume.py), its engine and partition (training/engines.py), signals (signals.py), what watches
each step (training/watchers.py: the metrics file, training/metrics.py; the line; samples, training/sampler.py;
checkpoints and the other files a run writes, training/checkpointing.py). Under mpirun every rank
runs the same set-up (_set_up) in phases that end together (runtime/mpi.phase): an error on
one rank ends every rank at once, reported by rank 0.

    from starpu_llm import TrainConfig, train
    result = train(TrainConfig(model="d12", batch=4, seq_len=64, steps=10))
    print(result.tokens_per_ms, result.losses)
"""
from __future__ import annotations

import contextlib
import os
import sys
import textwrap
import time
from dataclasses import dataclass, field, fields
from typing import NamedTuple


from . import resume
from .. import signals
from .checkpointing import check_outputs, check_checkpoint_dir, save_final
from ..model.config import (ADAM_BETAS, DECAYED, DEFAULT_DECAYED, DEFAULT_MODEL, MODELS, AdamW,
                            GPTConfig, check_batch_shape)
from .engines import (autotuned, calibrated_peak, calibration, check_memory, make_engine,
                      run_partition, start_runtime)
from ..errors import StarpuLLMError, flag, opt, render
from ..io import data
from .metrics import Metrics, step_extras
from ..plan.partition import ENGINES, PartitionRequest
from ..plan.record import RunRecord, Settings, data_fingerprint, run_identity
from ..perf.runs import peak_rss_mb
from ..runtime import mpi as distributed
from ..runtime.offload import MemoryLimit
from .schedule import SCHEDULES, check_schedule, learning_rate
from ..plan.settings import CHECKS, check_fields, help_of, setting
from ..model.state import TrainState
from .hellaswag import HellaSwag
from .validation import Validation
from .watchers import Checkpoints, Counters, Divergence, Samples, StepDone, StepLine, Trace


MEMORY = "memory budget (StarPU engine)"     # the help group of the memory flags


@dataclass
class TrainConfig(PartitionRequest):
    """A run's settings: each field with help is a `starpu-llm train` flag (cli.py makes them);
    the partition's fields come from PartitionRequest (plan/partition.py)."""
    model: str | None = setting(None, f"model size (default: {DEFAULT_MODEL} = GPT-2 "
                                "124M; with --init-from or --resume, the checkpoint's: a "
                                "contradicting one is refused)",
                                choices=sorted(MODELS))
    init_from: str | None = setting(None, "the weights to start from: an llm.c fp32 checkpoint, "
                                    "a Hugging Face GPT-2 folder, or a Hub model's name (gpt2, "
                                    "gpt2-medium) in the local Hugging Face cache",
                                    metavar="MODEL",
                                    ranks_agree=True)   # its header gives the model
    train_data: str | None = setting(None, "llm.c token shard, or a quoted glob pattern of "
                                     "several (\"data/fineweb_train_*.bin\"), read in sorted "
                                     "order (default: bundled Shakespeare)", metavar="SHARDS")
    batch: int = setting(4, "B, global batch (default %(default)s)", short="-b", check="positive",
                         ranks_agree=True)
    seq_len: int = setting(64, "T (default %(default)s)", short="-t", check="positive", ranks_agree=True)
    grad_accum: int = setting(1, "gradient accumulation: N micro-batches of B x T a step, one "
                              "AdamW update on their mean loss (N x B x T tokens a step, in "
                              "the memory of B x T; default %(default)s)", check="positive", metavar="N",
                              ranks_agree=True)
    steps: int = setting(10, "training steps (default %(default)s)", short="-n", check="positive",
                         ranks_agree=True)
    lr: float = setting(1e-4, "AdamW learning rate (default %(default)g)", check="nonneg",
                        ranks_agree=True)
    weight_decay: float = setting(0.0, "AdamW decoupled weight decay (default %(default)g)", check="nonneg",
                                  ranks_agree=True)
    weight_decay_params: str = setting(DEFAULT_DECAYED, "the tensors the weight decay shrinks: "
                                       "matrices, the 2-D ones (wte, wpe, the layers' weight "
                                       "matrices; as nanoGPT, llm.c's train_gpt2.cu), or all "
                                       "(biases and layernorms too, as llm.c's train_gpt2.c; "
                                       "default %(default)s)", choices=sorted(DECAYED),
                                       ranks_agree=True)
    beta1: float = setting(ADAM_BETAS[0], "AdamW's decay rate of the gradients' mean (default "
                           "%(default)g)", check="unit", ranks_agree=True)
    beta2: float = setting(ADAM_BETAS[1], "AdamW's decay rate of the squared gradients' mean "
                           "(default %(default)g, llm.c train_gpt2.c's; GPT-2's recipe in "
                           "nanoGPT and llm.c's train_gpt2.cu: 0.95)", check="unit",
                           ranks_agree=True)
    engine: str = setting(ENGINES[0], "starpu: the task graph; reference: the same kernels in a "
                          "plain loop", choices=list(ENGINES))
    seed: int = setting(1337, "seed of the random init (default %(default)s)", check="nonneg_int",
                        ranks_agree=True)
    save: str | None = setting(None, "write the trained model (llm.c format) and its PATH.state "
                               "(to --resume from), also when Ctrl-C stops the run", metavar="PATH")
    save_hf: str | None = setting(None, "also write the trained model as a Hugging Face GPT-2 "
                                  "folder (config, model.safetensors, GPT-2's tokenizer files) "
                                  "that transformers loads", metavar="DIR")
    save_every: int | None = setting(None, "write a checkpoint every N steps into "
                                     "--checkpoint-dir", check="positive", metavar="N",
                                     ranks_agree=True)
    checkpoint_dir: str = setting("checkpoints", "where --save-every writes step_<N>.bin and its "
                                  ".state (default %(default)s)", metavar="DIR")
    keep_checkpoints: int = setting(2, "checkpoints of --save-every kept, the newest (default %(default)s)",
                                    check="positive", metavar="K")
    resume: str | None = setting(None, "continue the run saved in CKPT (a model with its .state, or "
                                 "a --checkpoint-dir: its newest) on its recorded partition unless "
                                 "one is given; --steps counts the whole run",
                                 metavar="CKPT", ranks_agree=True)
    metrics_jsonl: str | None = setting(None, "one JSON object per step (with the partition it "
                                        "ran on)", metavar="PATH")
    # validation, learning-rate schedule, gradient clipping
    val_data: str | None = setting(None, "validation shard, or a quoted glob pattern of "
                                   "several (default: the bundled corpus's validation shard; "
                                   "needed with --train-data)", metavar="SHARDS")
    val_every: int = setting(0, "mean validation loss before the first update (step 0), "
                             "every N steps and after the last (default %(default)s: none)",
                             check="nonneg_int", metavar="N",
                             ranks_agree=True)
    val_batches: int = setting(10, "M fixed validation batches (default %(default)s)", check="positive",
                               metavar="M", ranks_agree=True)
    hellaswag: str | None = setting(None, "HellaSwag's validation jsonl (hellaswag_val.jsonl, "
                                    "docs/training.md): its acc_norm, as the validation loss is "
                                    "measured, every --hellaswag-every N steps", metavar="FILE")
    hellaswag_every: int = setting(0, "HellaSwag's acc_norm before the first update (step 0), "
                                   "every N steps and after the last (default %(default)s: none)",
                                   check="nonneg_int", metavar="N")
    hellaswag_limit: int | None = setting(None, "only the first N examples of --hellaswag "
                                          "(default: all)", check="positive", metavar="N")
    lr_schedule: str = setting("constant", "learning rate: constant, or cosine decay to "
                               "--min-lr over the run (after the warmup)",
                               choices=list(SCHEDULES), ranks_agree=True)
    warmup_steps: int = setting(0, "linear learning-rate warmup over the first N steps "
                                "(default %(default)s)", check="nonneg_int", metavar="N", ranks_agree=True)
    min_lr: float = setting(0.0, "the cosine schedule's final learning rate (default %(default)g)",
                            check="nonneg", ranks_agree=True)
    grad_clip: float = setting(0.0, "clip the global L2 norm of the gradients to C before "
                               "AdamW (default %(default)g: off)", check="nonneg", metavar="C",
                               ranks_agree=True)
    sample_every: int = setting(0, "every N steps, print a sample from the model being trained "
                                "(default %(default)s: never)", check="nonneg_int", metavar="N")
    # training under a memory budget (runtime/offload.py, flow/handles.py)
    memory_limit: str | int | float | None = setting(
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
    flags_given: frozenset | None = None   # the settings given explicitly (the command
                                           # line's flags): a resumed run takes the others'
                                           # recorded values (resume.py); None: every field
    log: callable = print              # where step lines go (None: silent)
    warn: callable = None              # where warnings go (None: stderr, "warning: ...")

    @property
    def adamw(self) -> AdamW:
        """The run's AdamW settings, at lr (a step's learning rate: with_lr, the schedule's)."""
        return AdamW(self.lr, self.weight_decay, self.weight_decay_params,
                     (self.beta1, self.beta2), self.grad_clip)

    @property
    def tokens_per_step(self) -> int:
        """The tokens of one update: its micro-batches' B x T each."""
        return self.grad_accum * self.batch * self.seq_len


def _field_help(cls) -> str:
    """Each setting of cls with its default and help, for help(TrainConfig): what a Python
    caller reads where the command line has --help."""
    lines = []
    for f in fields(cls):
        if "help" in f.metadata:
            text = f"{f.name} = {f.default!r}: {help_of(f)}"
            lines += textwrap.wrap(text, 92, initial_indent="    ", subsequent_indent="        ")
    return "\n\nSettings (each the `starpu-llm train` flag --<name with dashes>):\n" + \
        "\n".join(lines)


TrainConfig.__doc__ += _field_help(TrainConfig)


@dataclass
class TrainResult:
    """What train() returns (and signals.Interrupted.result holds when a signal stopped it):
    the losses of this run's steps (each the mean cross-entropy of its tokens, in nats; a
    resumed run: its own), each step's time (ms), the run's tokens/ms over its timed steps,
    the peak memory (MiB), the final state (parameters, moments, step, data position), and
    what the run could not write."""
    losses: list = field(default_factory=list)
    step_ms: list = field(default_factory=list)
    tokens_per_ms: float = float("nan")   # over the timed (post-warmup) steps
    timed_steps: int = 0
    peak_rss_mb: float = 0.0
    peak_gpu_mb: float | None = None      # with GPUs: the most memory in use on them
    engine: str = ""
    state: TrainState | None = None
    trace: list | None = None
    records: list | None = None
    val_losses: list = field(default_factory=list)   # (step, validation loss)
    hellaswag: list = field(default_factory=list)    # (step, HellaSwag's acc_norm)
    # under mpirun: every rank's (bytes sent, bytes received) per timed step, from StarPU-MPI's
    # statistics (None when off: runtime.mpi.COMM_STATS_ENV), and every rank's peak RSS
    traffic: list | None = None
    rank_peak_rss_mb: list | None = None
    # under --memory-limit: (bytes read from, bytes written to) the disk per step (this rank)
    disk_traffic: list | None = None
    # what the run could not write as it went (a checkpoint of --save-every, the metrics
    # file's rows), one sentence each: the training went on, each was warned of then, and the
    # command line ends with status 1 after the final save
    unwritten: list = field(default_factory=list)


def run_settings(cfg: TrainConfig, config: GPTConfig, loader, fingerprint) -> dict:
    """What every MPI rank must agree on (compared before training): the TrainConfig fields
    marked ranks_agree, the model's shape, and the training data (its content, not its path:
    fingerprint, plan/record.data_fingerprint of the loader's shards, taken once)."""
    settings = {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.metadata.get("ranks_agree")}
    return {**settings, "model": str(config), "train_data": fingerprint,
            "data_position": loader.state()}


def _flushed(log):
    def out(*args, **kwargs):
        log(*args, **kwargs)
        sys.stdout.flush()
    return out


def _to_stderr(text: str) -> None:
    print(f"warning: {text}", file=sys.stderr, flush=True)


def _words(cfg: TrainConfig):
    """How the run's lines name a setting: its flag when the run came from a command line
    (cfg.flags_given), else its TrainConfig field."""
    return flag if cfg.flags_given is not None else (lambda field: field)


def _warnings(cfg: TrainConfig):
    """cfg's warn (default: stderr), its settings named in the run's words (_words)."""
    warn, words = cfg.warn or _to_stderr, _words(cfg)
    return lambda text: warn(render(text, words))


def train(cfg: TrainConfig, state: TrainState | None = None, runtime=None) -> TrainResult:
    """Train up to step cfg.steps (a resumed state continues from its step); returns losses,
    timings and the final state.

    A running `runtime` is used (and left running); otherwise the StarPU engine starts one
    for cfg's partition and shuts it down at the end. SIGINT (Ctrl-C), SIGTERM or SIGUSR1
    stop it after the current step, saving as at the end (--save, and a checkpoint with
    --save-every), then raise signals.Interrupted (a KeyboardInterrupt); a second signal ends
    the process at once (signals.py)."""
    with signals.stop_on_signal() as stop:
        run = _set_up(cfg, state, runtime)
        try:
            with stop.deferred(saves=bool(run.cfg.save or run.cfg.save_hf or run.cfg.save_every),
                               announce=run.rank == 0):
                return _run(run, stop)
        except BaseException:
            # a signal or an error before _run's own try (entering deferred): StarPU still
            # stopped, or the process could start no other Runtime (both idempotent)
            _stop_starpu(run.engine, run.own_runtime)
            raise


def _stop_starpu(engine, own_runtime) -> None:
    """The engine closed (None: none made yet) and the runtime the run started shut down,
    whatever the close raised."""
    try:
        if engine is not None:
            engine.close()
    finally:
        if own_runtime:
            own_runtime.shutdown()


@dataclass
class Run:
    """A run set up: everything the training loop needs, made once."""
    cfg: TrainConfig
    comm: object
    rank: int
    log: callable
    warn: callable
    memory: MemoryLimit | None
    state: TrainState
    loader: data.DataLoader
    evaluations: list        # validation.Evaluation: the validation loss, HellaSwag
    runtime: object
    own_runtime: object
    engine: object
    record: RunRecord
    counters: Counters
    peak: float | None       # FLOP/s of the cores used, calibrated (None: no calibration)


def _set_up(cfg: TrainConfig, state: TrainState | None, runtime) -> Run:
    """The run set up, top to bottom: the settings checked; what it starts from (the model: a
    checkpoint with its recorded partition and settings, or an initialisation); the data and
    the validation; the partition that runs (resolved once) and the run's record; StarPU
    started; the engine; what is said of them. Under mpirun in phases that every rank ends
    together (distributed.phase)."""
    comm = distributed.world() if runtime is None else runtime.comm
    rank, ranks = (comm.Get_rank(), comm.Get_size()) if comm is not None else (0, 1)
    log = (cfg.log if rank == 0 else None) or (lambda *a, **k: None)
    warn = _warnings(cfg) if rank == 0 else (lambda *a, **k: None)
    with distributed.phase(comm, "checking the settings"):
        memory = _check_settings(cfg, comm, rank, runtime)
    if memory is not None:
        log = _flushed(log)   # a disk that fills ends the process from inside StarPU
    if comm is not None and runtime is None:
        distributed.pin_rank(comm, warn)
    elif runtime is None and "OMPI_COMM_WORLD_SIZE" in os.environ:    # mpirun -np 1
        distributed.say_if_bound([os.sched_getaffinity(0)], warn)
    with distributed.phase(comm, "reading the inputs"):
        start = resume.start(cfg, state, ranks, memory is not None,
                             on_runtime=runtime is not None and cfg.engine == "starpu")
        cfg, state, config = start.cfg, start.state, start.state.config
        loader, evaluations = _read_data(cfg, config, state.data)
        machine = calibration()         # this machine's (None: uncalibrated), read once
        if cfg.workers == "auto":
            cfg = autotuned(cfg, config, comm, runtime, log, machine)
        partition = start.partition or run_partition(cfg, comm, runtime, memory)   # resolved once
        if memory is None:
            check_memory(cfg, config, partition, ranks)
        peak = calibrated_peak(partition, machine)      # what a step's "mfu" is of
        fingerprint = data_fingerprint(loader.shard_tokens())
        run_id = (start.run if start.saved is not None      # the run's identity (plan/record.py)
                  else run_identity(Settings.of(cfg), config, start.origin, fingerprint))
        record = RunRecord(partition, Settings.of(cfg), run=run_id, data=fingerprint)
        if cfg.save_every and rank == 0:
            check_checkpoint_dir(cfg.checkpoint_dir, run_id,
                                 legacy=start.saved is not None and run_id is None)
    if comm is not None:
        distributed.same_everywhere(comm, run_settings(cfg, config, loader, fingerprint))
    own_runtime = (start_runtime(cfg, partition, comm, memory)
                   if runtime is None and cfg.engine == "starpu" else None)
    runtime, engine = own_runtime or runtime, None
    try:
        with distributed.phase(comm, "making the engine"):
            # no data of its own: each step gives its batches' tokens (loader.next_tokens)
            engine = make_engine(cfg, partition, state, None, runtime, machine)
        log(f"model: L={config.L} NH={config.NH} C={config.C} V={config.V} Vp={config.Vp} "
            f"maxT={config.maxT}, {config.num_parameters:,} parameters")
        accum = (f", {cfg.grad_accum} micro-batches a step (gradient accumulation: "
                 f"{cfg.tokens_per_step:,} tokens)" if cfg.grad_accum > 1 else "")
        log(f"data: {loader.describe()}, B={cfg.batch} T={cfg.seq_len}{accum}")
        log(f"engine: {engine.describe()}")
        log(f"partition: {partition.describe()}")
        for text in start.warnings:
            warn(text)
        if start.saved is not None:
            taken = ", ".join(f"{k}={v}" for k, v in start.restored)
            log(f"resuming: {start.saved.path} (step {state.step})"
                + (f" with its recorded settings {taken}" if taken else ""))
            for text in record.changes_since(start.saved.record):
                warn(text)
        for e in evaluations:
            log(e.describe())
    except BaseException:
        # a memory limit too small, a log or warn callable that raises, Ctrl-C while the run
        # is described: StarPU stops (and its folder goes), or the process could start no
        # other Runtime
        _stop_starpu(engine, own_runtime)
        raise
    return Run(cfg, comm, rank, log, warn, memory, state, loader, evaluations, runtime,
               own_runtime, engine, record, Counters(comm, runtime, memory), peak)


def _check_settings(cfg: TrainConfig, comm, rank: int, runtime) -> MemoryLimit | None:
    """The settings alone, and the files rank 0 will write: a clear error now rather than
    after the training. The memory budget of the settings."""
    check_fields(cfg)       # each value of the kind and range its flag takes
    whole = CHECKS["nonneg_int"]
    if not (whole.is_kind(cfg.untimed_steps) and whole.ok(cfg.untimed_steps)):
        raise StarpuLLMError(f"untimed_steps {cfg.untimed_steps!r}: give a whole number >= 0")
    check_schedule(cfg.lr_schedule, cfg.lr, cfg.warmup_steps, cfg.min_lr, cfg.steps)
    if cfg.val_data and not cfg.val_every:
        raise StarpuLLMError(f"{opt('val_data')} is read only to validate every "
                             f"{opt('val_every')} N steps: give {opt('val_every')} too")
    if cfg.val_every and cfg.train_data and not cfg.val_data:
        # the default validation shard is the bundled Shakespeare's: a loss on other text
        raise StarpuLLMError(f"{opt('val_every')} with {opt('train_data')} {cfg.train_data} needs "
                             f"{opt('val_data')}, the validation shard of the same text (without it, "
                             f"the bundled Shakespeare's would be used); give the one `prepare` wrote "
                             f"beside the training shard ({data.val_shard_beside(cfg.train_data)})")
    if bool(cfg.hellaswag) != bool(cfg.hellaswag_every):
        raise StarpuLLMError(f"{opt('hellaswag')} FILE and {opt('hellaswag_every')} N go together "
                             f"(the examples, and how often they are scored): give both")
    if cfg.hellaswag_limit and not cfg.hellaswag:
        raise StarpuLLMError(f"{opt('hellaswag_limit')} limits {opt('hellaswag')}'s examples: "
                             f"give {opt('hellaswag')} FILE too")
    if comm is not None and cfg.hellaswag:
        raise StarpuLLMError(f"{opt('hellaswag')} is not available under mpirun (its forward "
                             f"runs in one process, as generation's)")
    memory = MemoryLimit.of(cfg.memory_limit, cfg.offload_dir)
    if memory is not None and cfg.engine != "starpu":
        raise StarpuLLMError(f"{opt('memory_limit')} needs {opt('engine')} starpu (the reference "
                             f"engine keeps every tensor in numpy arrays)")
    if memory is not None and runtime is not None and runtime.memory != memory:
        raise StarpuLLMError(f"{opt('memory_limit')}: the runtime given was started with "
                             f"{runtime.memory}; start it with the run's (Runtime(memory=...))")
    if comm is not None and cfg.engine != "starpu":
        raise StarpuLLMError(f"under mpirun only {opt('engine')} starpu runs (the reference engine "
                             "is a single process)")
    if rank == 0:
        check_outputs(cfg)
        if comm is not None and not (cfg.train_data and (cfg.val_data or not cfg.val_every)):
            data.default_dataset()          # tokenized once, then every rank reads the cache
    return memory


def _read_data(cfg: TrainConfig, config: GPTConfig, position: dict | None):
    """The training data (at the position a resumed state records) and what the run measures
    of the model (the validation with --val-every, HellaSwag with --hellaswag), for config's
    batch shape."""
    check_batch_shape(config, cfg.batch, cfg.seq_len)
    with _about("train_data", cfg.train_data):
        loader = data.DataLoader(cfg.train_data or data.default_dataset()[0], cfg.batch,
                                 cfg.seq_len, vocab_size=config.V)
        if position:
            loader.load_state(position)
    evaluations = []
    if cfg.val_every:
        with _about("val_data", cfg.val_data):
            evaluations.append(Validation(cfg.val_data or data.default_dataset()[1], cfg.batch,
                                          cfg.seq_len, config.V, cfg.val_every,
                                          cfg.val_batches))
    if cfg.hellaswag:
        with _about("hellaswag", cfg.hellaswag):
            evaluations.append(HellaSwag(cfg.hellaswag, config, cfg.hellaswag_every,
                                         cfg.hellaswag_limit, cfg.batch))
    return loader, evaluations


@contextlib.contextmanager
def _about(field: str, given):
    """An error about the file a setting gave names the setting first (one file may be
    given to two: --train-data and --val-data)."""
    try:
        yield
    except StarpuLLMError as e:
        if not given:
            raise
        raise StarpuLLMError(f"{opt(field)}: {e.args[0]}") from None


def _run(run: Run, stop: signals.StopOnSignal) -> TrainResult:
    """The training loop: each step, then what watches it; then the run's end (saves, StarPU
    stopped). Raises signals.Interrupted after saving when a signal stopped it."""
    result = TrainResult()
    watchers = []
    try:
        result.engine = run.engine.describe()
        _watchers(run, result, watchers)
        _validate_first(run, result, watchers)
        _steps(run, stop, result, watchers)
        _finish(run, result)
    finally:
        try:
            for watch in reversed(watchers):
                watch.close()
        finally:        # StarPU stopped whatever a watcher's end raised
            _stop_starpu(run.engine, run.own_runtime)
    return _end(run, stop, result)


def _steps(run: Run, stop, result: TrainResult, watchers: list) -> None:
    """The steps, each then what watches it. On an engine that can (engine.ahead: the
    StarPU engine in one process) step n + 1 is submitted before step n's loss is read, so
    the workers (a GPU) never wait for Python between steps: a step's line comes once the
    next step is submitted, its loss the same value, bit for bit. Nothing is submitted past a
    step after which something reads the model or the data position (the last step, a
    validation, a sample, a checkpoint, a signal), nor past the untimed steps (so that the
    timed steps' times add up to the wall time from the end of the last untimed one, its
    backward and update not counted in the next one's): that step is drained (every task
    waited for) before its watchers run. A step read while the next runs has its time from
    the previous read to its loss, so the steps' times add up to the run's (_done says what
    work each time holds)."""
    cfg, state, engine = run.cfg, run.state, run.engine
    pending, since = None, None       # a step submitted, not yet read; when its time began
    after_read = False                # whether it began at the previous step's read
    untimed_end = state.step + cfg.untimed_steps    # the last untimed step of this run
    adamw = cfg.adamw                 # the update's settings; each step its scheduled lr
    for _ in range(cfg.steps - state.step):     # --steps counts the whole run
        if pending is None:
            since, after_read = time.perf_counter(), False
        lr = learning_rate(state.step, cfg.steps, cfg.lr, cfg.lr_schedule, cfg.warmup_steps,
                           cfg.min_lr)
        run.counters.before_step()
        with _about("train_data", cfg.train_data):   # a shard opened (checked) as it comes
            positions = [run.loader.next_tokens() for _ in range(cfg.grad_accum)]
        current = (engine.submit_step(positions, adamw.with_lr(lr),
                                      keep_previous=pending is not None), lr)
        if pending is not None:         # the previous step, read while this one runs
            since = _done(run, stop, result, watchers, pending, since, False, after_read).at
            after_read = True
        pending = current
        step = current[0].step
        if not (engine.ahead and step < cfg.steps and step != untimed_end and not stop.requested
                and not any(e.due(step, False) for e in run.evaluations)
                and not any(w.reads_state(step) for w in watchers)):
            engine.wait()
            done = _done(run, stop, result, watchers, pending, since, True, after_read)
            pending = None
            if done.stopping:
                break


def _validate_first(run: Run, result: TrainResult, watchers: list) -> None:
    """The measures (validation loss, HellaSwag) of the weights the run starts from, before
    its first update, when due (Evaluation.due_first: at step 0, not on a resume); their time
    and disk traffic are no step's."""
    measured = {e.key: e.measure(run.engine) for e in run.evaluations
                if e.due_first(run.state.step)}
    if not measured:
        return
    run.counters.skip()
    _record_measures(result, 0, measured)
    for watch in watchers:
        watch.validated_first(measured)


def _record_measures(result: TrainResult, step: int, extra: dict) -> None:
    """The measures of update `step` among its extras, into the result's lists."""
    for key, out in ((Validation.key, result.val_losses), (HellaSwag.key, result.hellaswag)):
        if key in extra:
            out.append((step, extra[key]))


class _Done(NamedTuple):
    stopping: bool
    at: float           # when it was read: the next step's time begins


# The share of a step's model FLOPs in its forward pass (config.flops_per_token: the backward
# twice the forward)
FORWARD_SHARE = 1.0 / 3.0


def _done(run: Run, stop, result: TrainResult, watchers, submitted, since: float,
          drained: bool, after_read: bool) -> _Done:
    """A step submitted, read (its loss, after the tasks that write it; drained: after
    every task) and watched: its time runs from `since` (its submission, or, after_read, the
    previous step's read) to now. That time holds the work of one step only where both ends
    are alike: read as soon as its loss is there (not drained), the step's backward and
    update are not in it; begun at the previous step's read, that step's are. Its tokens/ms
    and mfu count the work it holds (FORWARD_SHARE of a step, one, or two less that), so
    that a short first line after a drain (its forward) is not 3x the run's rate; its time
    is the wall time, as is the run's tokens/ms. With N micro-batches a step's loss is there
    once its last one's forward has run, after the others' backwards (its load waits for
    the previous one's embedding backward): 1 - (1 - FORWARD_SHARE) / N of its work. Only a
    drained step can stop the run (a signal, every rank's answer): a step read while the
    next runs leaves that to the next."""
    cfg, state, engine = run.cfg, run.state, run.engine
    s, lr = submitted
    loss = engine.loss(s.losses, s.micro_batches)
    now = time.perf_counter()
    ms = (now - since) * 1e3
    result.losses.append(loss)
    result.step_ms.append(ms)
    at_loss = 1.0 - (1.0 - FORWARD_SHARE) / cfg.grad_accum   # done when its loss is there
    work = (1.0 - at_loss if after_read else 0.0) + (1.0 if drained else at_loss)
    tokens_per_ms = work * cfg.tokens_per_step / ms
    extra = step_extras(cfg, engine, run.evaluations, lr, run.rank, last=s.step == cfg.steps,
                        step=s.step, norm=s.norm)
    run.counters.after_step(extra)
    if run.peak:
        extra["mfu"] = state.config.flops_per_token(cfg.seq_len) * tokens_per_ms * 1e3 / run.peak
    _record_measures(result, s.step, extra)
    done = StepDone(s.step, loss, ms, tokens_per_ms, extra,
                    bool(stop.stop(run.comm)) if drained else False)
    for watch in watchers:
        watch.after_step(done)
    return _Done(done.stopping, now)


def _watchers(run: Run, result: TrainResult, out: list) -> None:
    """What watches each step, in order (into out, as each is made): the task trace, its
    metrics row (before its line: a step printed is a step in the file), its line, the
    divergence check, a sample, a checkpoint."""
    cfg = run.cfg

    def failed(text):       # an output not written: warned, listed at the end
        run.warn(text)
        result.unwritten.append(text)
    if cfg.trace and run.runtime is not None:     # the reference engine runs no tasks
        out.append(Trace(run.runtime, result))
    metrics = None
    if cfg.metrics_jsonl and run.rank == 0:
        out.append(metrics := Metrics(cfg.metrics_jsonl, run.state.step, run.record.partition,
                                      run.warn, failed))
    out += [StepLine(run.log, cfg.steps), Divergence()]
    if cfg.sample_every:
        out.append(Samples(run))
    if cfg.save_every:
        out.append(Checkpoints(run, metrics, failed))


def _finish(run: Run, result: TrainResult) -> None:
    """After the last step, StarPU still running: the timings and counters, and under a
    memory limit the model saved from StarPU."""
    cfg = run.cfg
    run.state.data = run.loader.state()
    timed = result.step_ms[cfg.untimed_steps:] or result.step_ms
    result.timed_steps = len(timed)
    run.counters.results(result, len(timed))
    result.tokens_per_ms = cfg.tokens_per_step * len(timed) / sum(timed)
    if cfg.trace and run.runtime is None:
        result.trace = []
    result.records = run.engine.submitted()
    if cfg.save or cfg.save_hf:
        run.engine.sync()       # under MPI the owners send rank 0 their slices to save
        if run.memory is not None and run.rank == 0:    # the state is in StarPU: saved from there
            save_final(cfg, run.state, run.record, run.log)


def _continue(cfg: TrainConfig, saved: str) -> str:
    """How to continue a run stopped after saving to `saved`, in the run's words."""
    if cfg.flags_given is not None:
        return f"--resume {saved} --steps {cfg.steps}"
    return f"TrainConfig(resume={saved!r}, steps={cfg.steps}, ...)"


def _end(run: Run, stop, result: TrainResult) -> TrainResult:
    """StarPU stopped: the peak memory, the last lines, --save (from the state), and the
    signal that stopped the run, raised."""
    cfg, state, log = run.cfg, run.state, run.log
    result.peak_rss_mb = peak_rss_mb()
    if run.comm is not None:
        result.rank_peak_rss_mb = run.comm.allgather(result.peak_rss_mb)
    result.state = state
    gpu = (f"   peak GPU memory: {result.peak_gpu_mb:.0f} MB"
           if result.peak_gpu_mb is not None else "")
    log(f"tokens/ms over {result.timed_steps} timed step(s): {result.tokens_per_ms:.4f}"
        f"   peak RSS: {result.peak_rss_mb:.0f} MB{gpu}")
    if run.rank == 0 and run.memory is None:    # rank 0 owns the parameters
        save_final(cfg, state, run.record, log)
    if stop.requested:
        saved = cfg.save or (cfg.checkpoint_dir if cfg.save_every else None)
        log(f"stopped by {signals.name(stop.signum)} after step {state.step}"
            + (f"; continue with {_continue(cfg, saved)}" if saved else ""))
        stopped = signals.Interrupted(stop.signum, result)
        stopped.agreed = True      # every rank stops after the same step (stop.stop)
        raise stopped
    return result
