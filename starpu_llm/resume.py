"""What a run starts from: a random init of --model (default d12), the weights of
--init-from, or the run saved at --resume with its record (record.RunRecord). And what a
resumed run keeps: the model (a contradicting --model is refused), the recorded partition
unless one is given (another is accepted with a warning: roundings will differ), the settings
(a changed one is named in a warning: the run is no longer the uninterrupted one)."""
from __future__ import annotations

from dataclasses import replace

from .config import MODELS, GPTConfig
from .engines import partition_given
from .errors import StarpuLLMError, flag, opt
from .io import checkpoint, formats
from .record import Partition, RunRecord, Settings
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


def load_model(cfg, lazy: bool = False) -> tuple[TrainState, RunRecord | None]:
    """The state the run starts from, and the record of the run it continues (None for a
    new run, or a checkpoint saved before records existed). lazy: its parameters and moments
    are not read into memory (state.Slices: the checkpoint's files, checked, or the random
    init, drawn slice by slice), for an engine to take slice by slice (--memory-limit)."""
    if cfg.resume:
        if cfg.init_from:
            raise StarpuLLMError(f"{opt('resume')} continues a saved run and {opt('init_from')} "
                                 f"starts a new one from given weights; give only one of them")
        state, record = checkpoint.read_with_record(cfg.resume, lazy)
        check_model(cfg.model, state.config, cfg.resume)
        return state, record
    if cfg.init_from:
        config, params = formats.read_checkpoint(cfg.init_from, lazy)
        check_model(cfg.model, config, cfg.init_from)
        return TrainState(config=config, params=params), None
    model = cfg.model or DEFAULT_MODEL
    if model not in MODELS:
        raise StarpuLLMError(f"{opt('model')} {model!r} is not a known model; choose one of "
                             f"{', '.join(MODELS)} or give an llm.c checkpoint with {opt('init_from')}")
    config = MODELS[model]
    params = RandomInit(config, cfg.seed) if lazy else random_init(config, cfg.seed)
    return TrainState(config=config, params=params), None


def on_recorded_partition(cfg, record: RunRecord | None):
    """cfg set to the recorded partition, when it gives none and runs the recorded engine."""
    if record is None or partition_given(cfg) or record.partition.engine != cfg.engine:
        return cfg
    p = record.partition
    if p.engine == "reference":
        return replace(cfg, threads=p.cores_per_worker, sub_batches=p.sub_batches)
    # team and forkjoin are asked for; single (K = 1) and parallel-workers follow from N x K
    kcore = p.kcore if p.kcore in ("team", "forkjoin") else None
    return replace(cfg, workers=p.workers, cores_per_worker=p.cores_per_worker,
                   sub_batches=p.sub_batches, kcore=kcore,
                   ownership=p.ownership if p.ranks > 1 else None,
                   pipeline_stages=p.stages if p.ranks > 1 else None)


def warn_changes(record: RunRecord | None, partition: Partition, settings: Settings, log) -> None:
    """One warning line for another partition, one for changed settings, against the record."""
    if record is None:
        log("warning: the checkpoint records no partition or settings (saved by an older "
            "starpu-llm): whether this run continues the saved one unchanged is not checked")
        return
    if record.partition != partition:
        log(f"warning: the run continues on {partition.describe()}, it was saved on "
            f"{record.partition.describe()}: roundings will differ from the uninterrupted run")
    changed = record.settings.changed(settings)
    if changed:
        log("warning: " + ", ".join(f"{flag(name)} {now} (saved with {was})"
                                    for name, was, now in changed)
            + ": the run is no longer the uninterrupted one")
