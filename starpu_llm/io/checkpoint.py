"""Checkpoints a run resumes from exactly: the model in llm.c's format (formats.py) and a
companion file with the rest of the run's state, the AdamW moments, the step and the data
position.

A checkpoint is two files, the model at PATH and its companion at PATH.state:

    header  128 little-endian int64 (1024 bytes): magic, version, the model's config (maxT,
            V, L, NH, C, Vp), step, data position (the shard's index x 2**32 + the token
            offset in it: a shard holds < 2**31 tokens, and one shard's is its offset), CRC-32 of the model's parameters, CRC-32
            of the first ten fields, of the run record and of the body (so a damaged step,
            position or record is caught too); then (version 2) the length n of the run
            record and, from byte 104, its n bytes: the partition and the settings of the
            run (record.RunRecord, as compact JSON); the rest 0
    body    m then v: float32, ParamLayout order

Version 1 companions (no run record; their CRC covers the first ten fields and the body) are
read as before, with no record.

Write order, so that at every instant one complete pair (the old or the new) is under the
names a resume reads: both new files are written in full under temporary names (atomic.py);
the old pair, when there is one, gets a second name by hard links, PATH.prev and
PATH.prev.state; the new model and then its companion are renamed onto PATH and PATH.state;
the .prev names go. A save killed anywhere leaves PATH and PATH.state complete (old or new), or
PATH.prev and its companion complete: read() and load() take the .prev pair when PATH's is not
complete, and say so. A pair put together from two saves (files copied or renamed by hand) is
refused on reading: the companion records its model's config and the checksum of its
parameters.

Saves every N steps go to a directory, each under its own name (step_00000005.bin and its
.state); older ones are removed only after a newer pair is complete. Reading a directory takes
its newest complete checkpoint, or, when that one cannot be read (damaged), the newest that
can, and says so.
"""
from __future__ import annotations

import os
import re
import zlib
from typing import NamedTuple

import numpy as np

from . import atomic, formats
from ..model.config import ParamLayout
from ..errors import StarpuLLMError, opt
from ..plan.record import RunRecord
from ..model.state import TrainState

MAGIC = 20261123
VERSION = 2                        # 2: with the run record; 1 is still read
HEADER_INTS = 128                  # int64: a 1024-byte header, as llm.c's files have
RECORD_AT = 13                     # the run record's first int64 of the header
_I64 = np.dtype("<i8")
_F32 = np.dtype("<f4")
_STEP_NAME = re.compile(r"step_(\d+)\.bin")


def companion(path) -> str:
    """The companion file of the model at path."""
    return os.fspath(path) + ".state"


def _crc(*arrays) -> int:
    """CRC-32 of the arrays' bytes, in order."""
    crc = 0
    for a in arrays:
        crc = zlib.crc32(memoryview(np.ascontiguousarray(a)).cast("B"), crc)
    return crc


def _config_fields(config) -> list[int]:
    return [config.maxT, config.V, config.L, config.NH, config.C, config.Vp]


def _record_field(record: RunRecord | None) -> np.ndarray:
    """Header ints 12.. : the record's length, then its bytes, zero-padded."""
    raw = record.to_json().encode() if record is not None else b""
    room = (HEADER_INTS - RECORD_AT) * 8
    if len(raw) > room:
        raise ValueError(f"the run record takes {len(raw)} bytes, the header has room for {room}")
    out = np.zeros(HEADER_INTS - RECORD_AT + 1, _I64)
    out[0] = len(raw)
    out[1:].view(np.uint8)[:len(raw)] = np.frombuffer(raw, np.uint8)
    return out


_SHARD_AT = 1 << 32            # the data position's field: shard x _SHARD_AT + offset


def _packed(data: dict) -> int:
    """The data position field of a loader's state (io/data.DataLoader.state)."""
    return data.get("shard", 0) * _SHARD_AT + data.get("position", 0)


def _unpacked(field: int) -> dict:
    """The loader's state of a data position field (no "shard" when 0, as DataLoader.state)."""
    shard, position = divmod(field, _SHARD_AT)
    return {**({"shard": shard} if shard else {}), "position": position}


def previous(path) -> str:
    """Where the pair a save replaces stays until the new pair is complete (see the module)."""
    return os.fspath(path) + ".prev"


# Called with the name of each point of a save (tests kill the process there): "written"
# (both new files complete under temporary names), "kept" (the old pair linked to .prev),
# "model" (the new model renamed in), "state" (its companion renamed in), "done".
_after = None


def _reached(point: str) -> None:
    if _after is not None:
        _after(point)


def write(path, state: TrainState, record: RunRecord | None = None) -> str:
    """Write state as a checkpoint pair: the model at path and its companion, with the run's
    record, replacing a pair there in the order the module's docstring gives. Returns path.
    The state's buffers may be numpy arrays or state.Slices (written slice by slice)."""
    path = os.fspath(path)
    comp = companion(path)
    for p in (path, comp):
        if os.path.isdir(p):
            raise StarpuLLMError(f"{p} is a directory; give the path of a checkpoint file to write")
    model = atomic.AtomicFile(path)
    try:
        moments = atomic.AtomicFile(comp)
    except BaseException:
        model.discard()
        raise
    writing = path
    try:
        model_crc = formats.write_checkpoint_into(model.file, state.config, state.params,
                                                  path=path)
        model.finish()
        writing = comp
        _write_companion(moments.file, state, record, model_crc)
        moments.finish()
    except BaseException as e:
        model.discard()
        moments.discard()
        if isinstance(e, OSError):
            raise atomic._write_error(writing, e) from e
        raise
    _reached("written")
    kept = _keep_previous(path)
    _reached("kept")
    try:
        model.commit()
        _reached("model")
        moments.commit()
    except BaseException:
        model.discard()
        moments.discard()
        raise
    _reached("state")
    if kept:
        for p in (companion(previous(path)), previous(path)):
            _unlink(p)
    _reached("done")
    return path


def _write_companion(f, state: TrainState, record: RunRecord | None, model_crc: int) -> None:
    header = np.zeros(HEADER_INTS, _I64)
    fields = [MAGIC, VERSION, *_config_fields(state.config), state.step,
              _packed(state.data), model_crc]
    header[:len(fields)] = fields
    header[RECORD_AT - 1:] = _record_field(record)
    layout = ParamLayout(state.config)
    f.write(header.tobytes())      # its body checksum follows the moments, written next
    crc = _crc(header[:len(fields) - 1], header[RECORD_AT - 1:])
    for a in (state.m, state.v):
        crc = formats.write_values(f, a, layout, crc)
    header[len(fields)] = crc
    f.seek(0)
    f.write(header.tobytes())


def _keep_previous(path: str) -> bool:
    """A second name (PATH.prev, PATH.prev.state) for the pair at path, if there is one; True
    when the .prev pair is there. Hard links, else copies (a file system without links).
    Both .prev files there already: a save killed midway left them, the pair it was replacing,
    complete (both are linked from a complete pair, and removed companion first), while the
    pair at path may be mixed: they stay."""
    pair = ((path, previous(path)), (companion(path), companion(previous(path))))
    if all(os.path.isfile(q) for _, q in pair):
        return True
    if not all(os.path.isfile(p) for p, _ in pair):
        return False
    for p, q in pair:
        _unlink(q)
        try:
            os.link(p, q)
        except OSError:
            try:
                atomic.atomic_write(q, lambda f, p=p: _copy_into(p, f))
            except StarpuLLMError as e:
                raise StarpuLLMError(f"cannot keep the checkpoint at {path} while it is replaced "
                                     f"({e.args[0]})") from e
    atomic._fsync_dir(os.path.dirname(os.path.abspath(path)))
    return True


def _copy_into(src: str, f) -> None:
    with open(src, "rb") as g:
        while chunk := g.read(64 << 20):
            f.write(chunk)


def _unlink(p: str) -> None:
    try:
        os.unlink(p)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise StarpuLLMError(f"cannot remove {p}: {e.strerror}; check the folder's "
                             f"permissions") from e


class Saved(NamedTuple):
    """A checkpoint read: its state and run record (None: a version 1 companion), the model
    file it was read from, and (model path, why) of each checkpoint tried before it that could
    not be read (the pair a save was replacing when it was killed, a damaged newest one)."""
    state: TrainState
    record: RunRecord | None
    path: str
    skipped: list


def read(path) -> TrainState:
    """The TrainState saved at path: a model file with its companion, or a directory of
    saves (its newest complete checkpoint). Refuses a companion that does not belong to its
    model (StarpuLLMError)."""
    return load(path).state


def read_with_record(path, lazy: bool = False) -> tuple[TrainState, RunRecord | None]:
    """read(path) and the run record of its companion (None: a version 1 companion)."""
    saved = load(path, lazy)
    return saved.state, saved.record


def load(path, lazy: bool = False) -> Saved:
    """The checkpoint at path (a model file, or a directory of saves): the first of its
    candidates that reads, in this order: the pair at path, then its .prev pair (a save over it
    was killed); in a directory the complete checkpoints newest first (each then its .prev).
    lazy: once every check has passed (the checksums computed reading the files in chunks),
    the parameters and moments stay in the files (formats.FileSlices, read slice by slice).
    StarpuLLMError, naming each candidate tried, when none reads."""
    path = os.fspath(path)
    if os.path.isdir(path):
        candidates = [c for s in sorted(saved_steps(path), reverse=True)
                      for c in _with_previous(step_path(path, s)) if os.path.exists(companion(c))]
        if not candidates:
            raise StarpuLLMError(f"{path} holds no complete checkpoint (a step_<N>.bin with its "
                                 f".state); give a checkpoint file or another directory")
    else:
        candidates = _with_previous(path)
    skipped = []
    for model in candidates:
        try:
            state, record = _read_pair(model, lazy)
        except StarpuLLMError as e:
            skipped.append((model, e.args[0]))
            continue
        return Saved(state, record, model, skipped)
    first = skipped[0][1]
    if len(skipped) > 1:
        first += "; " + "; ".join(f"{m} cannot be read either ({why})" for m, why in skipped[1:])
    raise StarpuLLMError(first)


def _with_previous(path: str) -> list:
    """path, and its .prev pair when both of its files are there."""
    prev = previous(path)
    return [path] + ([prev] if os.path.isfile(prev) and os.path.isfile(companion(prev)) else [])


def _read_pair(path: str, lazy: bool) -> tuple[TrainState, RunRecord | None]:
    config, params = formats.read_checkpoint(path, lazy)
    comp = companion(path)
    hint = "resume from a checkpoint whose two files were saved together"
    if not os.path.lexists(comp):
        raise StarpuLLMError(
            f"{path} has no companion file {comp} (AdamW moments, step, data position): it was "
            f"saved as a model only, or its save was interrupted; resume from another checkpoint, "
            f"or start from its weights alone with {opt('init_from')} {path}")
    f, size = formats.open_regular(comp, "checkpoint companion")
    with f:
        header = np.fromfile(f, dtype=_I64, count=HEADER_INTS)
        if size < HEADER_INTS * 8 or int(header[0]) != MAGIC:
            raise StarpuLLMError(f"{comp} is not a starpu-llm checkpoint companion (no header "
                                 f"with magic {MAGIC}); {hint}")
        version = int(header[1])
        if version not in (1, VERSION):
            raise StarpuLLMError(f"{comp} is a companion of version {version}, but this "
                                 f"starpu-llm reads versions 1 to {VERSION}; resume it with the "
                                 f"starpu-llm that saved it, or {hint}")
        saved_for = [int(x) for x in header[2:8]]
        if saved_for != _config_fields(config):
            names = ("maxT", "V", "L", "NH", "C", "Vp")
            raise StarpuLLMError(
                f"{comp} does not belong to {path}: it was saved for a model with "
                f"{formats._fmt(dict(zip(names, saved_for)))}, {path} holds one with "
                f"{formats._fmt(dict(zip(names, _config_fields(config))))}; {hint}")
        n = config.num_parameters
        expected = HEADER_INTS * 8 + 2 * 4 * n
        if size != expected:
            raise StarpuLLMError(f"{comp} has {size} bytes, but a companion of this model has "
                                 f"{expected} (the header and two moments of {n} float32); {hint}")
        step, position, model_crc, body_crc = (int(x) for x in header[8:12])
        crc = (formats.file_crc(path, formats.HEADER_BYTES, 4 * n) if lazy
               else _crc(params.astype(_F32, copy=False)))
        if crc != model_crc:
            raise StarpuLLMError(f"{comp} does not belong to {path}: it was saved (at step "
                                 f"{step}) with other parameters than {path} holds, so the two "
                                 f"files come from different saves; {hint}")
        covered = (header[:10],) if version == 1 else (header[:10], header[RECORD_AT - 1:])
        if lazy:
            crc = formats.file_crc(comp, HEADER_INTS * 8, 8 * n, _crc(*covered))
        else:
            moments = np.fromfile(f, dtype=_F32, count=2 * n)
            crc = _crc(*covered, moments)
    if crc != body_crc:
        raise StarpuLLMError(f"{comp} is corrupt: its step, data position, run record or "
                             f"moments do not match their checksum; resume from another checkpoint")
    record = _read_record(header, comp) if version >= 2 else None
    if lazy:
        m, v = (formats.FileSlices(config, comp, HEADER_INTS * 8 + 4 * n * k) for k in (0, 1))
    else:
        m, v = np.split(moments.astype(np.float32, copy=False), 2)
    return TrainState(config=config, params=params, m=m, v=v, step=step,
                      data=_unpacked(position)), record


def read_record(path) -> RunRecord | None:
    """The run record in the companion of the model at path, read from its header alone (no
    checksum: for telling runs apart, not for resuming); None when there is none or it cannot
    be read."""
    try:
        f, size = formats.open_regular(companion(path), "checkpoint companion")
        with f:
            header = np.fromfile(f, dtype=_I64, count=HEADER_INTS)
        if size < HEADER_INTS * 8 or int(header[0]) != MAGIC or int(header[1]) < 2:
            return None
        return _read_record(header, companion(path))
    except StarpuLLMError:
        return None


def _read_record(header: np.ndarray, comp: str) -> RunRecord | None:
    n = int(header[RECORD_AT - 1])
    if n == 0:
        return None
    raw = header[RECORD_AT:].view(np.uint8)
    try:
        if not 0 < n <= raw.size:
            raise ValueError(f"a length of {n} bytes")
        return RunRecord.from_json(raw[:n].tobytes().decode())
    except (ValueError, KeyError, TypeError) as e:
        raise StarpuLLMError(f"{comp}: its run record cannot be read ({e}); resume from "
                             f"another checkpoint") from e


# --------------------------------------------------------------------------- a directory of saves

def step_path(directory, step: int) -> str:
    """Where the checkpoint of `step` goes in a directory of saves."""
    return os.path.join(os.fspath(directory), f"step_{step:08d}.bin")


def saved_steps(directory) -> dict[int, str]:
    """{step: model path} of the checkpoints in directory, complete or not."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return {}
    found = (_STEP_NAME.fullmatch(n) for n in names)
    return {int(m.group(1)): os.path.join(directory, m.group(0)) for m in found if m}


def latest(directory) -> str:
    """The model path of the newest complete checkpoint (one with its companion) in directory."""
    complete = {s: p for s, p in saved_steps(directory).items() if os.path.exists(companion(p))}
    if not complete:
        raise StarpuLLMError(f"{directory} holds no complete checkpoint (a step_<N>.bin with its "
                             f".state); give a checkpoint file or another directory")
    return complete[max(complete)]


def save_step(directory, state: TrainState, keep: int, record: RunRecord | None = None) -> str:
    """Write state's checkpoint into directory, then remove older ones, keeping `keep` in all.
    Checkpoints of later steps (an earlier run's, in the same directory) are left alone, to be
    replaced when this run gets there: until then `latest` finds them, not this run's."""
    path = write(step_path(directory, state.step), state, record)
    saved = saved_steps(directory)
    older = sorted(s for s in saved if s < state.step)
    doomed = [p for s in older[:max(0, len(older) - (keep - 1))]
              for p in (companion(saved[s]), saved[s])]    # companion first, as in write()
    for p in doomed:
        try:
            os.unlink(p)
        except OSError:           # an old file left behind does no harm
            pass
    # and the temporary files that saves killed midway left (of steps never saved again)
    atomic.remove_stale_temporaries(directory, keep=lambda name: not name.startswith("step_"))
    return path


def check_writable(path) -> None:
    """Fail now, not after the training, when the checkpoint at path could not be written."""
    for p in (path, companion(path)):
        atomic.check_writable(p)
