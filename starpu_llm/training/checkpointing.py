"""The files a run writes, and when: every N steps a checkpoint into --checkpoint-dir (the
newest --keep-checkpoints kept, io/checkpoint.save_step), and --save at the end, with a
fallback file when that fails; --metrics-jsonl as it goes (training/metrics.py). Each save carries the
run's record (partition, settings, run identity).

Before the first step, check_outputs refuses what would lose data: an output that could not
be written, one that is the training or validation data or another output, an existing file
that is not what the output would replace (a --save onto something other than a checkpoint, a
--metrics-jsonl onto something other than a metrics file); check_checkpoint_dir refuses a
--checkpoint-dir that holds another run's checkpoints (this run would delete them, and a
--resume of the folder would take them)."""
from __future__ import annotations

import json
import os

import numpy as np

from ..errors import StarpuLLMError, opt
from ..io import atomic, checkpoint, formats
from ..plan.record import RunRecord
from ..model.config import ParamLayout
from ..model.state import TrainState, chunks


def check_outputs(cfg) -> None:
    """Fail now, not after the training, when an output of cfg could not be written or would
    overwrite data (see the module)."""
    inputs = {opt(k): getattr(cfg, k) for k in ("train_data", "val_data", "init_from", "resume")}
    outputs = {}
    if cfg.save:
        # a model saved over the one it started from is what was asked
        outputs[opt("save")] = Output(cfg.save, _is_checkpoint_file,
                                      companions=[checkpoint.companion(cfg.save)],
                                      may_replace=(opt("init_from"), opt("resume")))
    if cfg.metrics_jsonl:
        outputs[opt("metrics_jsonl")] = Output(cfg.metrics_jsonl, _is_metrics_file)
    check_new_outputs(outputs, inputs)
    if cfg.save_hf:     # a folder written whole (io/hf.py); like --save, over its --init-from
        # the checkpoints too: the folder's replacement would remove them
        written = {opt("checkpoint_dir"): cfg.checkpoint_dir if cfg.save_every else None}
        check_model_output(cfg.save_hf, opt("save_hf"),
                           {**{k: v for k, v in inputs.items() if k != opt("init_from")},
                            **{k: out.path for k, out in outputs.items()}, **written}, hf=True)
    if cfg.save_every:
        if os.path.exists(cfg.checkpoint_dir) and not os.path.isdir(cfg.checkpoint_dir):
            raise StarpuLLMError(f"{opt('checkpoint_dir')} {cfg.checkpoint_dir} is a file; give a "
                                 f"folder (made if missing)")
        checkpoint.check_writable(checkpoint.step_path(cfg.checkpoint_dir, 0))


class Output:
    """A file a command writes: its path, what an existing file there must be to be replaced
    (is_kind, whose docstring names it), the files written beside it (companions), and the
    inputs it may replace (may_replace: their labels)."""

    def __init__(self, path: str, is_kind, companions=(), may_replace=(), fix: str = ""):
        self.path, self.is_kind = os.fspath(path), is_kind
        self.companions, self.may_replace = list(companions), tuple(may_replace)
        self.fix = fix          # what to do instead (default: give the output another path)

    @property
    def files(self) -> list:
        return [self.path] + self.companions


def check_new_outputs(outputs: dict, inputs: dict) -> None:
    """Every command's check before its work, of outputs {label: Output} against inputs
    {label: path or None} (a label: a flag, opt(field) or the name of an argument): an output
    onto an input or another output (through any path, hard link or symlink), onto an
    existing file of another kind, or where it could not be written, is refused, naming
    both."""
    given = {label: p for label, p in inputs.items() if p}
    given.update((label, out.path) for label, out in outputs.items())
    for label, out in outputs.items():
        for other, path in given.items():
            if other == label or other in out.may_replace:
                continue
            for f in out.files:
                if _same_file(f, path):
                    raise StarpuLLMError(
                        f"{label} {out.path} would overwrite {other} {path}"
                        + ("" if f == out.path else f" (with {f})") + "; "
                        + (out.fix or f"give {label} another path"))
    for label, out in outputs.items():
        for f in out.files:
            _check_replaceable(f, label, out.is_kind)
            atomic.check_writable(f)


def check_model_output(path: str, what: str, inputs: dict, hf: bool) -> None:
    """Refuse now a model output (what: its flag or argument) that could not be written or
    would lose data: an llm.c checkpoint file (hf False) onto one of the inputs ({name: path})
    or onto a file that is not a checkpoint; a Hugging Face folder (io/hf.py, replaced as a
    whole) that is an input or holds one, or that holds other files (hf.check_hf_output)."""
    from ..io import hf as hf_format
    for name, given in inputs.items():
        if given is None:
            continue
        inside = hf and os.path.realpath(given).startswith(os.path.realpath(path) + os.sep)
        if _same_file(path, given) or inside:
            raise StarpuLLMError(f"{what} {path} would overwrite {name} {given}; give "
                                 f"{what} another path")
    if hf:
        hf_format.check_hf_output(path, what)
    else:
        check_new_outputs({what: Output(path, _is_checkpoint_file)}, {})


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:          # one of them does not exist (yet): the same path?
        return os.path.realpath(a) == os.path.realpath(b)


def _check_replaceable(path: str, label: str, is_kind) -> None:
    """An existing file at path that is not of the kind the output writes is not replaced."""
    if not os.path.lexists(path) or os.path.isdir(path):
        return               # a folder: check_writable says so
    if not is_kind(path):
        raise StarpuLLMError(f"{label} {path}: a file is there that this output would "
                             f"replace, and it is not {is_kind.__doc__}; remove it, or give "
                             f"another path")


def _magic_in(path: str, *magics) -> bool:
    """Whether the file at path starts with one of these llm.c magic numbers."""
    try:
        f, size = formats.open_regular(path, "output")
        with f:
            magic = int.from_bytes(f.read(4), "little")
    except StarpuLLMError:
        return False
    return magic in magics


def _is_checkpoint_file(path: str) -> bool:
    """a checkpoint (an llm.c model or its .state companion)"""
    return _magic_in(path, formats.CHECKPOINT_MAGIC, checkpoint.MAGIC)


def is_shard_file(path: str) -> bool:
    """a token shard"""
    return _magic_in(path, formats.SHARD_MAGIC)


def is_tokenizer_file(path: str) -> bool:
    """a tokenizer file"""
    return _magic_in(path, formats.TOKENIZER_MAGIC)


def first_line_is(path: str, accepts, limit: int = 1 << 16) -> bool:
    """Whether the file at path is one of ours of some kind, told by its first line: a
    readable regular file, empty (one of ours cut short before its first line) or whose first
    line (its first `limit` bytes at most, the line end taken off) accepts(line) takes."""
    try:
        f, size = formats.open_regular(path, "output")
        with f:
            first = f.readline(limit)
    except StarpuLLMError:
        return False
    return size == 0 or bool(accepts(first.rstrip(b"\r\n")))


def _is_metrics_row(line: bytes) -> bool:
    try:
        row = json.loads(line)
    except ValueError:
        return False
    return isinstance(row, dict) and "step" in row


def _is_metrics_file(path: str) -> bool:
    """a metrics file (one JSON object with a "step" per line)"""
    return first_line_is(path, _is_metrics_row)


def check_checkpoint_dir(directory: str, run: str | None, legacy: bool = False) -> None:
    """Refuse a --checkpoint-dir holding checkpoints of another run than this one (identity
    `run`, record.run_identity): this run would delete its older ones and a --resume of the
    folder would take its newer ones. legacy: this run resumes a checkpoint saved before runs
    had an identity (run None); checkpoints without one are then taken as its own."""
    others = []
    for s, path in sorted(checkpoint.saved_steps(directory).items()):
        record = checkpoint.read_record(path)
        owner = record.run if record is not None else None
        if owner is None and legacy:
            continue
        if owner is None or owner != run:
            others.append(s)
    if others:
        steps = ", ".join(map(str, others[:5])) + (", ..." if len(others) > 5 else "")
        raise StarpuLLMError(
            f"{opt('checkpoint_dir')} {directory} holds checkpoints of another run (of step(s) "
            f"{steps}), which this run would delete or be confused with: give another "
            f"{opt('checkpoint_dir')}, continue that run with {opt('resume')} {directory}, or "
            f"remove them")


def checkpoint_step(cfg, engine, state: TrainState, loader, rank: int, record: RunRecord,
                    log, failed) -> None:
    """--save-every's checkpoint of the step just done (every rank syncs; rank 0 writes). A
    failed save does not end the run (the next one, or --save at the end, may succeed):
    failed(text) says what was not written."""
    engine.sync()
    state.data = loader.state()
    if rank != 0:
        return
    check_finite(state, f"the checkpoint of step {state.step}")
    try:
        log(f"checkpoint {checkpoint.save_step(cfg.checkpoint_dir, state, cfg.keep_checkpoints, record)}")
    except StarpuLLMError as e:
        failed(f"the checkpoint of step {state.step} was not written: {e}")


def save_final(cfg, state: TrainState, record: RunRecord, log) -> None:
    """The outputs written at the end of the run: --save, then --save-hf."""
    check_finite(state, " and ".join(opt(k) for k in ("save", "save_hf") if getattr(cfg, k)))
    if cfg.save:
        save_model(cfg.save, state, record, log)
    if cfg.save_hf:
        from ..io.hf import write_hf
        try:
            written = write_hf(cfg.save_hf, state.config, state.params, opt("save_hf"))
        except StarpuLLMError as e:
            if cfg.save:        # the model is there already
                raise StarpuLLMError(f"{e.args[0]}; the trained model is in {cfg.save}") from e
            _fallback(state, record, e)
        log(f"saved {written} (Hugging Face)")


_FINITE_BLOCK = 1 << 22       # floats checked at once (a small temporary)


def check_finite(state: TrainState, output: str) -> None:
    """Refuse to write parameters that an update made inf or NaN: the step's loss, computed
    before its update, was finite, so the divergence check let it pass, and the checkpoint
    would replace the good ones (--save-every keeps only the newest) with a model that cannot
    be resumed. output: what was not written."""
    for c in chunks(state.params, ParamLayout(state.config)):
        for i in range(0, c.size, _FINITE_BLOCK):
            if not np.isfinite(c[i:i + _FINITE_BLOCK]).all():
                raise StarpuLLMError(
                    f"the parameters after step {state.step} are not finite (inf or NaN: the "
                    f"update diverged): not writing {output}, the files already written are "
                    f"kept; lower {opt('lr')}")


def save_model(path, state: TrainState, record: RunRecord, log) -> None:
    """--save at the end of the run. Should it fail after all (the path was checked before the
    first step), the model goes to a fallback file in the working directory, so that the
    training is not lost, and the error says where."""
    try:
        checkpoint.write(path, state, record)
    except StarpuLLMError as e:
        _fallback(state, record, e)
    log(f"saved {path} and {checkpoint.companion(path)}")


def _fallback(state: TrainState, record: RunRecord, e: StarpuLLMError):
    """The final save failed with e: the model written to a fallback file in the working
    directory instead, e raised saying where."""
    fallback = os.path.abspath(f"starpu-llm-unsaved-{os.getpid()}-step{state.step}.bin")
    try:
        checkpoint.write(fallback, state, record)
    except StarpuLLMError as again:
        raise StarpuLLMError(f"{e.args[0]}; writing the fallback {fallback} failed too "
                             f"({again.args[0]}): the trained model is lost") from e
    raise StarpuLLMError(f"{e.args[0]}; the trained model was written to {fallback} "
                         f"instead (and its state to {checkpoint.companion(fallback)})") from e


def convert(src, dst) -> str:
    """`starpu-llm convert`: the model at src (an llm.c checkpoint, a Hugging Face GPT-2
    folder, or a Hub name in the local cache) written at dst: an llm.c checkpoint when dst
    ends in .bin, else a Hugging Face folder. Refuses a dst that is src or that would lose
    data, before reading anything."""
    from ..io import formats, hf
    src, dst = os.fspath(src), os.fspath(dst)
    to_llmc = dst.endswith(".bin")
    check_model_output(dst, "DST", {"SRC": src}, hf=not to_llmc)
    config, flat = hf.read_model(src)
    if to_llmc:
        return formats.write_checkpoint(dst, config, flat)
    return hf.write_hf(dst, config, flat, "DST")
