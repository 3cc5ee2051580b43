"""What a run starts from (start(): one Start, read once): a random init of --model (default
d12), the weights of --init-from, or the run saved at --resume with its record
(record.RunRecord). And what a resumed run keeps: the model (a contradicting --model is
refused), the recorded partition unless one is given or it cannot run here (another is
accepted with a warning: roundings will differ), the recorded settings that the command line
does not give (its batch, sequence length, learning rate and schedule...: `--resume CKPT
--steps N` goes on as the run was), and the training data (a change is named in a warning,
RunRecord.changes_since: the run is no longer the uninterrupted one).
The checkpoint resumed is named, and so is any newer one that could not be read
(io/checkpoint.load)."""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from ..model.config import DEFAULT_MODEL, MODELS, GPTConfig
from ..errors import StarpuLLMError, opt
from ..io import checkpoint, hf
from ..io.formats import params_crc
from ..plan.record import Partition, RunRecord, Settings
from ..plan.partition import request_of
from ..runtime.starpu import resolve_here
from ..model.state import RandomInit, TrainState, random_init
from .schedule import check_schedule


def model_name(config: GPTConfig) -> str:
    name = next((n for n, c in MODELS.items() if c == config), None)
    return (f"the {name} model" if name else
            f"a model with L={config.L} NH={config.NH} C={config.C} V={config.V}")


def check_model(model: str | None, config: GPTConfig, path) -> None:
    """Refuse a --model given beside a checkpoint (path) that holds another model."""
    if model is None:
        return
    if model not in MODELS:
        raise StarpuLLMError(f"{opt('model')} {model!r} is not a known model; choose one of "
                             f"{', '.join(MODELS)}")
    if MODELS[model] != config:
        raise StarpuLLMError(f"{opt('model')} {model} contradicts {path}, which holds "
                             f"{model_name(config)}: leave {opt('model')} out to go on with the "
                             f"checkpoint's model, or start a new run without it")


@dataclass
class Start:
    """What a run starts from (start()), handed to the set-up in one piece."""
    cfg: object                 # the run's settings; a resume's on its recorded partition
    state: TrainState
    saved: checkpoint.Saved | None = None   # the checkpoint a --resume continues; None: new
    partition: Partition | None = None  # a resume's recorded partition, resolved here (None:
                                        # the run resolves its own, engines.run_partition)
    origin: str | None = None   # a new run's start, for its identity (record.run_identity):
                                # "seed N" or "weights CRC"
    run: str | None = None      # a resumed run's identity (None: saved before it was kept)
    restored: list = field(default_factory=list)    # (setting, value) a resume took from
                                # its record, where it differs from the run's default
    warnings: list = field(default_factory=list)    # to print once the run is set up: a
                                # recorded partition not followed, newer checkpoints skipped


def start(cfg, state: TrainState | None, ranks: int, memory_limit: bool = False,
          on_runtime: bool = False) -> Start:
    """What the run of cfg on `ranks` processes starts from: the state given, else the model
    (load_model; under --memory-limit read slice by slice); a resume's checkpoint, with cfg on
    its recorded partition (on_recorded_partition) unless the run trains on a StarPU runtime
    already started (on_runtime: the runtime's); refused when it is at --steps already."""
    saved = None
    given = state is not None
    if state is None:
        state, saved = load_model(cfg, lazy=memory_limit)
    if state.step >= cfg.steps:
        raise StarpuLLMError(f"the run is at step {state.step} already and {opt('steps')} counts "
                             f"the steps of the whole run: give {opt('steps')} above {state.step}")
    if saved is None:
        return Start(cfg, state, origin=(f"weights {params_crc(state.params)}"
                                         if given or cfg.init_from else f"seed {cfg.seed}"))
    cfg, restored = with_recorded_settings(cfg, saved.record)
    partition, warnings = None, []
    if not on_runtime:
        cfg, partition, warnings = on_recorded_partition(cfg, saved.record, ranks, memory_limit)
    return Start(cfg, state, saved, partition, run=saved.record.run if saved.record else None,
                 restored=restored, warnings=warnings + [
        f"{path} cannot be resumed ({why}); resuming from {saved.path} instead"
        for path, why in saved.skipped])


def with_recorded_settings(cfg, record: RunRecord | None):
    """(cfg with the record's settings where cfg.flags_given leaves them out, [(setting,
    recorded value) that differ from cfg's]): every one but --steps, which says where the
    resumed run ends. A cfg that names no flags given (a Python caller's TrainConfig, every
    value its own) or a record without settings: cfg as it is."""
    if record is None or cfg.flags_given is None:
        return cfg, []
    recorded = {f.name: getattr(record.settings, f.name) for f in fields(Settings)
                if f.name != "steps" and f.name not in cfg.flags_given}
    restored = [(k, v) for k, v in recorded.items() if getattr(cfg, k) != v]
    cfg = replace(cfg, **recorded)
    check_schedule(cfg.lr_schedule, cfg.lr, cfg.warmup_steps, cfg.min_lr, cfg.steps)
    return cfg, restored


def load_model(cfg, lazy: bool = False) -> tuple[TrainState, checkpoint.Saved | None]:
    """The state the run starts from, and the checkpoint it resumes (checkpoint.Saved: its
    record is None for a checkpoint saved before records existed), None for a new run. lazy:
    its parameters and moments are not read into memory (state.Slices: the checkpoint's files,
    checked, or the random init, drawn slice by slice), for an engine to take slice by slice
    (--memory-limit)."""
    if cfg.resume:
        if cfg.init_from:
            raise StarpuLLMError(f"{opt('resume')} continues a saved run and {opt('init_from')} "
                                 f"starts a new one from given weights; give only one of them")
        saved = checkpoint.load(cfg.resume, lazy)
        check_model(cfg.model, saved.state.config, cfg.resume)
        return saved.state, saved
    if cfg.init_from:
        config, params = hf.read_model(cfg.init_from, lazy)
        check_model(cfg.model, config, cfg.init_from)
        return TrainState(config=config, params=params), None
    model = cfg.model or DEFAULT_MODEL
    if model not in MODELS:
        raise StarpuLLMError(f"{opt('model')} {model!r} is not a known model; choose one of "
                             f"{', '.join(MODELS)} or give an llm.c checkpoint with {opt('init_from')}")
    config = MODELS[model]
    params = RandomInit(config, cfg.seed) if lazy else random_init(config, cfg.seed)
    return TrainState(config=config, params=params), None


def on_recorded_partition(cfg, record: RunRecord | None, ranks: int, memory_limit: bool):
    """(cfg set to it, the recorded partition resolved once (for cfg's batch, under a memory
    limit or not), []) when cfg gives no partition, runs the recorded engine on as many
    processes, and the recorded partition (Partition.request) resolves on this process; else
    (cfg as it is, None: the run resolves its default partition, [a warning where the record
    could not be followed])."""
    if record is None or cfg.given() or record.partition.engine != cfg.engine:
        return cfg, None, []
    p = record.partition
    if p.ranks != ranks:
        return cfg, None, [f"the checkpoint was saved by {p.ranks} process(es) and this run has "
                           f"{ranks}: it runs on the default partition, not on the recorded one "
                           f"({p.describe()})"]
    # the scheduler, a pipeline's schedule and the attention's form (not the partition's shape:
    # PartitionRequest.given) resumed where this run names none
    recorded = request_of(p)
    resumed = replace(cfg, **{f.name: getattr(recorded, f.name) for f in fields(recorded)
                              if f.name != "oversubscribe"
                              and not (f.name in ("sched", "pipeline_schedule", "attention")
                                       and getattr(cfg, f.name) is not None)})
    try:
        return resumed, resolve_here(resumed.partition_request(), ranks, cfg.batch,
                                     memory_limit, p.engine), []
    except StarpuLLMError as e:
        return cfg, None, [f"the recorded partition ({p.describe()}) cannot run here "
                           f"({e.args[0]}): the run goes on on the default partition"]
