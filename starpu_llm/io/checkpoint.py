"""Checkpoints a run resumes from exactly: the model in llm.c's format (formats.py) and a
companion file with the rest of the run's state, the AdamW moments, the step and the data
position.

A checkpoint is two files, the model at PATH and its companion at PATH.state:

    header  128 little-endian int64 (1024 bytes): magic, version, the model's config (maxT,
            V, L, NH, C, Vp), step, data position, CRC-32 of the model's parameters, CRC-32
            of the first ten fields, of the run record and of the body (so a damaged step,
            position or record is caught too); then (version 2) the length n of the run
            record and, from byte 104, its n bytes: the partition and the settings of the
            run (record.RunRecord, as compact JSON); the rest 0
    body    m then v: float32, ParamLayout order

Version 1 companions (no run record; their CRC covers the first ten fields and the body) are
read as before, with no record.

Write order: any old companion at PATH.state is removed first, then the model is written,
then its companion, each atomically (atomic.py). So the companion's presence marks a complete
pair, and a save interrupted at any point leaves a model without a companion, never a new
model beside an old companion. A pair put together from two saves anyway (files copied or
renamed by hand) is refused on reading: the companion records its model's config and the
checksum of its parameters.

Saves every N steps go to a directory, each under its own name (step_00000005.bin and its
.state); older ones are removed only after a newer pair is complete, so a process killed
mid-save leaves the previous checkpoint loadable.
"""
from __future__ import annotations

import os
import re
import zlib

import numpy as np

from . import atomic, formats
from ..config import ParamLayout
from ..errors import StarpuLLMError, opt
from ..record import RunRecord
from ..state import TrainState

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


def write(path, state: TrainState, record: RunRecord | None = None) -> str:
    """Write state as a checkpoint pair: the model at path, then its companion (see the
    module's docstring for the order), with the run's record. Returns path. The state's
    buffers may be numpy arrays or state.Slices (written slice by slice)."""
    path = os.fspath(path)
    try:
        os.unlink(companion(path))
    except FileNotFoundError:
        pass
    except OSError as e:
        raise StarpuLLMError(f"cannot replace {companion(path)}: {e.strerror}; choose a writable "
                             f"output location") from e
    _, model_crc = formats.write_checkpoint_crc(path, state.config, state.params)
    header = np.zeros(HEADER_INTS, _I64)
    fields = [MAGIC, VERSION, *_config_fields(state.config), state.step,
              state.data.get("position", 0), model_crc]
    header[:len(fields)] = fields
    header[RECORD_AT - 1:] = _record_field(record)
    layout = ParamLayout(state.config)

    def body(f):
        f.write(header.tobytes())      # its body checksum follows the moments, written next
        crc = _crc(header[:len(fields) - 1], header[RECORD_AT - 1:])
        for a in (state.m, state.v):
            crc = formats.write_values(f, a, layout, crc)
        header[len(fields)] = crc
        f.seek(0)
        f.write(header.tobytes())

    atomic.atomic_write(companion(path), body)
    return path


def read(path) -> TrainState:
    """The TrainState saved at path: a model file with its companion, or a directory of
    saves (its newest complete checkpoint). Refuses a companion that does not belong to its
    model (StarpuLLMError)."""
    return read_with_record(path)[0]


def read_with_record(path, lazy: bool = False) -> tuple[TrainState, RunRecord | None]:
    """read(path) and the run record of its companion (None: a version 1 companion). lazy:
    once every check has passed (the checksums computed reading the files in chunks), the
    parameters and moments stay in the files (formats.FileSlices, read slice by slice)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = latest(path)
    config, params = formats.read_checkpoint(path, lazy)
    comp = companion(path)
    hint = "resume from a checkpoint whose two files were saved together"
    if not os.path.exists(comp):
        raise StarpuLLMError(
            f"{path} has no companion file {comp} (AdamW moments, step, data position): it was "
            f"saved as a model only, or its save was interrupted; resume from another checkpoint, "
            f"or start from its weights alone with {opt('init_from')} {path}")
    size = os.path.getsize(comp)
    header = np.fromfile(comp, dtype=_I64, count=HEADER_INTS)
    if size < HEADER_INTS * 8 or int(header[0]) != MAGIC:
        raise StarpuLLMError(f"{comp} is not a starpu-llm checkpoint companion (no header with "
                             f"magic {MAGIC}); {hint}")
    version = int(header[1])
    if version not in (1, VERSION):
        raise StarpuLLMError(f"{comp} is a companion of version {version}, but this starpu-llm "
                             f"reads versions 1 to {VERSION}; resume it with the starpu-llm that "
                             f"saved it, or {hint}")
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
        raise StarpuLLMError(f"{comp} does not belong to {path}: it was saved (at step {step}) "
                             f"with other parameters than {path} holds, so the two files come "
                             f"from different saves; {hint}")
    covered = (header[:10],) if version == 1 else (header[:10], header[RECORD_AT - 1:])
    if lazy:
        crc = formats.file_crc(comp, HEADER_INTS * 8, 8 * n, _crc(*covered))
    else:
        moments = np.fromfile(comp, dtype=_F32, count=2 * n, offset=HEADER_INTS * 8)
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
                      data={"position": position}), record


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
    # and the temporary files of saves killed midway (atomic.py names them .<name>.*.tmp)
    doomed += [os.path.join(directory, n) for n in os.listdir(directory)
               if n.startswith(".step_") and n.endswith(".tmp")]
    for p in doomed:
        try:
            os.unlink(p)
        except OSError:           # an old file left behind does no harm
            pass
    return path


def check_writable(path) -> None:
    """Fail now, not after the training, when the checkpoint at path could not be written."""
    for p in (path, companion(path)):
        atomic.check_writable(p)
