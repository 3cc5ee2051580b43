"""What a run starts from: a random init of --model (default d12), the weights of
--init-from, or the run saved at --resume with its record (record.RunRecord). And what a
resumed run keeps: the model (a contradicting --model is refused), the recorded partition
unless one is given or it cannot run here (another is accepted with a warning: roundings will
differ), the settings and the training data (a change is named in a warning: the run is no
longer the uninterrupted one). The checkpoint resumed is named, and so is any newer one that
could not be read (io/checkpoint.load)."""
from __future__ import annotations

from dataclasses import fields, replace

from .config import MODELS, GPTConfig
from .errors import StarpuLLMError, flag, opt
from .io import checkpoint, hf
from .record import RunRecord
from .partition import request_of
from .runtime.starpu import resolve_here
from .state import RandomInit, TrainState, random_init

DEFAULT_MODEL = "d12"       # GPT-2 124M, when neither --init-from nor --resume gives one


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


def on_recorded_partition(cfg, record: RunRecord | None, ranks: int, warn,
                          memory_limit: bool = False):
    """(cfg, the partition the run resumes on) when cfg gives no partition, runs the recorded
    engine on as many processes, and the recorded partition (Partition.request) resolves on
    this process (for cfg's batch, under a memory limit or not): cfg set to it, and it
    resolved, once; else (cfg as it is, None: the run resolves its default partition), with a
    warning where the record could not be followed."""
    if record is None or cfg.given() or record.partition.engine != cfg.engine:
        return cfg, None
    p = record.partition
    if p.ranks != ranks:
        warn(f"the checkpoint was saved by {p.ranks} process(es) and this run has {ranks}: it "
             f"runs on the default partition, not on the recorded one ({p.describe()})")
        return cfg, None
    # the scheduler and a pipeline's schedule (not the partition's shape: PartitionRequest.given)
    # resumed where this run names none
    recorded = request_of(p)
    resumed = replace(cfg, **{f.name: getattr(recorded, f.name) for f in fields(recorded)
                              if f.name != "oversubscribe"
                              and not (f.name in ("sched", "pipeline_schedule")
                                       and getattr(cfg, f.name) is not None)})
    try:
        return resumed, resolve_here(resumed.partition_request(), ranks, cfg.batch,
                                     memory_limit, p.engine)
    except StarpuLLMError as e:
        warn(f"the recorded partition ({p.describe()}) cannot run here ({e.render(flag)}): the "
             f"run goes on on the default partition")
        return cfg, None


def say_resumed(saved: checkpoint.Saved, log, warn) -> None:
    """The line naming the checkpoint resumed, and a warning for each newer one skipped."""
    for path, why in saved.skipped:
        warn(f"{path} cannot be resumed ({why}); resuming from {saved.path} instead")
    log(f"resuming: {saved.path} (step {saved.state.step})")


def warn_changes(saved: RunRecord | None, now: RunRecord, warn) -> None:
    """One warning each for another partition, changed settings, other training data,
    against the record of the checkpoint resumed."""
    if saved is None:
        warn("the checkpoint records no partition or settings (saved by an older starpu-llm): "
             "whether this run continues the saved one unchanged is not checked")
        return
    if not saved.partition.same_shape(now.partition):
        warn(f"the run continues on {now.partition.describe()}, it was saved on "
             f"{saved.partition.describe()}: roundings will differ from the uninterrupted run")
    changed = saved.settings.changed(now.settings)
    if changed:
        warn(", ".join(f"{flag(name)} {new} (saved with {was})" for name, was, new in changed)
             + ": the run is no longer the uninterrupted one")
    if saved.data is not None and saved.data != now.data:
        detail = (f"{saved.data[0]:,} tokens then, {now.data[0]:,} now"
                  if saved.data[0] != now.data[0] else "as many, but others")
        warn(f"{flag('train_data')}: these are not the tokens the run was saved with "
             f"({detail}): the run is no longer the uninterrupted one")
