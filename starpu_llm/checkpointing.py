"""When a run saves: every --save-every steps into --checkpoint-dir (the newest
--keep-checkpoints kept, io/checkpoint.save_step), and --save at the end, with a fallback file
when that fails. Each save carries the run's record (partition and settings)."""
from __future__ import annotations

import os

from .errors import StarpuLLMError
from .io import checkpoint
from .record import RunRecord
from .state import TrainState


def checkpoint_step(cfg, engine, state: TrainState, loader, rank: int, record: RunRecord,
                    log) -> None:
    """--save-every's checkpoint of the step just done (every rank syncs; rank 0 writes). A
    failed save does not end the run: the next one, or --save at the end, may succeed."""
    engine.sync()
    state.data = loader.state()
    if rank != 0:
        return
    try:
        log(f"checkpoint {checkpoint.save_step(cfg.checkpoint_dir, state, cfg.keep_checkpoints, record)}")
    except StarpuLLMError as e:
        log(f"warning: the checkpoint of step {state.step} was not written: {e}; training goes on")


def save_model(path, state: TrainState, record: RunRecord, log) -> None:
    """--save at the end of the run. Should it fail after all (the path was checked before the
    first step), the model goes to a fallback file in the working directory, so that the
    training is not lost, and the error says where."""
    try:
        checkpoint.write(path, state, record)
    except StarpuLLMError as e:
        fallback = os.path.abspath(f"starpu-llm-unsaved-{os.getpid()}-step{state.step}.bin")
        try:
            checkpoint.write(fallback, state, record)
        except StarpuLLMError as again:
            raise StarpuLLMError(f"{e.args[0]}; writing the fallback {fallback} failed too "
                                 f"({again.args[0]}): the trained model is lost") from e
        raise StarpuLLMError(f"{e.args[0]}; the trained model was written to {fallback} "
                             f"instead (and its state to {checkpoint.companion(fallback)})") from e
    log(f"saved {path} and {checkpoint.companion(path)}")
