"""Hostile input, fuzzed: every file reader, given a damaged or made-up file, returns a result
consistent with that file or raises StarpuLLMError naming it; never another exception, never a
hang, never an allocation that the file's size does not justify.

READERS has one entry per reader: a strategy for valid files (made by the project's own writer),
the call that reads a path, a check that a result agrees with the bytes it was read from, and the
header fields worth damaging. Hypothesis damages the valid files (a field set to 0, -1, 1, off by
one, huge; the file truncated at any byte, given trailing bytes, overwritten in places) and also
tries random bytes and the empty file. A new reader is one more entry.

    make test   about 80 cases a reader, the same ones every run (derandomized)
    make fuzz   HYPOTHESIS_PROFILE=thorough: 4000 a reader (FUZZ_EXAMPLES=n to change), new
                ones every run, failures kept in .hypothesis/ and replayed first next time
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import tracemalloc
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, find, given, settings, strategies as st

from starpu_llm.model.config import GPTConfig
from starpu_llm.errors import StarpuLLMError
from starpu_llm.io import checkpoint, data, formats, hf
from starpu_llm.io.tokenizer import Tokenizer
from starpu_llm.model.state import TrainState

# Writing the valid files (fsync'ed by the writers) makes data generation slowish on a busy disk.
_COMMON = dict(deadline=5000, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("fuzz-suite", max_examples=80, derandomize=True, database=None, **_COMMON)
settings.register_profile("thorough", max_examples=int(os.environ.get("FUZZ_EXAMPLES", 4000)),
                          **_COMMON)
FUZZ = settings.get_profile("thorough" if os.environ.get("HYPOTHESIS_PROFILE") == "thorough"
                            else "fuzz-suite")

HANG_SECONDS = 10            # a reader still running after this on a few-KB file hangs
ALLOC_SLACK = 1 << 20        # bytes any call may allocate whatever the file (messages, numpy)
SHARD_VOCAB = 1000

_DIR = tempfile.TemporaryDirectory(prefix="starpu-llm-fuzz-")


# --------------------------------------------------------------------------- the readers

@dataclass(frozen=True)
class Reader:
    name: str
    valid: st.SearchStrategy              # bytes of a valid file (of the project's writer)
    read: Callable[[str], object]         # the reader, on a path
    check: Callable[[object, bytes], None]  # asserts that a result agrees with the file's bytes
    fields: dict                          # header field -> byte offset of its 32-bit int
    huge: tuple = ()                      # header values ({field: value}) claiming far more
                                          # data than a 2 KB file holds
    alloc_per_byte: int = 2               # bytes the reader may allocate per byte of file

    def __repr__(self):                   # in Hypothesis's failure reports
        return f"<{self.name} reader>"


def _written(write, *args) -> bytes:
    """The bytes the project's writer `write(path, *args)` puts in a file."""
    path = os.path.join(_DIR.name, "valid.bin")
    write(path, *args)
    with open(path, "rb") as f:
        return f.read()


@functools.lru_cache(maxsize=None)
def _checkpoint_bytes(config: GPTConfig) -> bytes:
    # distinct values: a shifted or reordered read shows in the check
    return _written(formats.write_checkpoint, config, np.arange(config.num_parameters, dtype=np.float32))


@st.composite
def _checkpoints(draw):
    nh, v = draw(st.integers(1, 3)), draw(st.integers(1, 12))
    config = GPTConfig(max_seq_len=draw(st.integers(1, 6)), vocab_size=v,
                       padded_vocab_size=v + draw(st.integers(0, 4)), num_layers=draw(st.integers(1, 2)),
                       num_heads=nh, channels=nh * draw(st.integers(1, 3)))
    return _checkpoint_bytes(config)


def _check_checkpoint(result, raw: bytes):
    config, flat = result
    n = config.num_parameters
    assert min(config.maxT, config.V, config.L, config.NH) >= 1
    assert config.C % config.NH == 0 and config.Vp >= config.V
    assert struct.unpack_from("<6i", raw, 8) == (config.maxT, config.V, config.L, config.NH, config.C,
                                                 config.Vp)
    assert len(raw) == formats.HEADER_BYTES + 4 * n
    assert flat.dtype == np.float32 and flat.shape == (n,)
    assert flat.tobytes() == raw[formats.HEADER_BYTES:]


def _shards(vocab: int):
    return st.lists(st.integers(0, vocab - 1), max_size=40).map(
        lambda tokens: _written(formats.write_shard, np.array(tokens, dtype=np.uint16)))


def _check_shard(vocab: int | None):
    def check(tokens, raw: bytes):
        assert tokens.dtype == np.uint16 and tokens.tobytes() == raw[formats.HEADER_BYTES:]
        assert struct.unpack_from("<i", raw, 8)[0] == tokens.size
        if vocab is not None:
            assert tokens.size == 0 or int(tokens.max()) < vocab
    return check


@st.composite
def _tokenizers(draw):
    table = draw(st.lists(st.binary(min_size=1, max_size=255), min_size=1, max_size=12))
    return _written(formats.write_tokenizer, Tokenizer(table, draw(st.integers(0, len(table) - 1))))


def _check_tokenizer(tok, raw: bytes):
    n, eot = struct.unpack_from("<2I", raw, 8)
    assert tok.vocab_size == n and tok.eot == eot < n
    assert all(1 <= len(t) <= 255 for t in tok.token_bytes)
    assert raw[formats.HEADER_BYTES:] == b"".join(bytes([len(t)]) + t for t in tok.token_bytes)


# The dataset cache's meta file (JSON), read by data._cached_ok: never raises, says False for
# anything but a meta file that matches the cached shards. Its "valid" files are any JSON, the
# meta file data.default_dataset writes among them.
_TRAIN, _VAL = 50, 10


@functools.lru_cache(maxsize=None)
def _cache() -> tuple[str, str, str]:
    cache = os.path.join(_DIR.name, "cache")
    train, val = (os.path.join(cache, f"fuzz_{s}.bin") for s in ("train", "val"))
    formats.write_shard(train, np.arange(_TRAIN))
    formats.write_shard(val, np.arange(_VAL))
    formats.write_tokenizer(os.path.join(cache, data.TOKENIZER_FILENAME), Tokenizer([b"a", b"b"], 1))
    return cache, train, val


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
                     lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids,
                                                                               max_size=4),
                     max_leaves=8)
_metas = st.one_of(
    st.fixed_dictionaries({"format": st.just(data._CACHE_FORMAT), "train_tokens": st.just(_TRAIN),
                           "val_tokens": st.just(_VAL)}),
    st.fixed_dictionaries({"format": st.integers(0, 2) | _json, "train_tokens": st.integers(0, 99) | _json,
                           "val_tokens": st.integers(0, 99) | _json}),
    _json).map(lambda meta: json.dumps(meta).encode())


def _check_meta(ok, raw: bytes):
    assert isinstance(ok, bool)
    if ok:
        meta = json.loads(raw)
        assert meta["format"] == data._CACHE_FORMAT
        assert (meta["train_tokens"], meta["val_tokens"]) == (_TRAIN, _VAL)


# The companion of a checkpoint (io/checkpoint.py: AdamW moments, step, data position): the
# damaged file is put beside the model it was written for (fixed: one small config), as
# PATH.state, and the pair read.
_COMP_CONFIG = GPTConfig(max_seq_len=4, vocab_size=6, padded_vocab_size=8, num_layers=1,
                         num_heads=2, channels=4)


@functools.lru_cache(maxsize=None)
def _companion_model() -> str:
    path = os.path.join(_DIR.name, "pair", "model.bin")
    n = _COMP_CONFIG.num_parameters
    checkpoint.write(path, TrainState(config=_COMP_CONFIG, params=np.arange(n, dtype=np.float32)))
    return path


@st.composite
def _companions(draw):
    n = _COMP_CONFIG.num_parameters
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    state = TrainState(config=_COMP_CONFIG, params=np.arange(n, dtype=np.float32),
                       m=rng.standard_normal(n, dtype=np.float32),
                       v=rng.random(n, dtype=np.float32), step=draw(st.integers(0, 10**6)),
                       data={"position": draw(st.integers(0, 10**9))})
    _companion_model()                      # writes pair/model.bin
    other = os.path.join(_DIR.name, "pair", "valid.bin")
    checkpoint.write(other, state)          # the same parameters: its .state fits model.bin
    with open(checkpoint.companion(other), "rb") as f:
        return f.read()


def _read_companion(path: str):
    """The pair <pair>/NAME (a copy of the model) + <pair>/NAME.state (the file at path), NAME
    the file's own name, so that every message about the pair names it."""
    pair = os.path.join(_DIR.name, "pair", os.path.basename(path))
    shutil.copyfile(_companion_model(), pair)
    shutil.copyfile(path, checkpoint.companion(pair))
    return checkpoint.read(pair)


def _check_companion(state, raw: bytes):
    n = _COMP_CONFIG.num_parameters
    header = np.frombuffer(raw[:checkpoint.HEADER_INTS * 8], dtype="<i8")
    assert len(raw) == checkpoint.HEADER_INTS * 8 + 8 * n
    assert (state.step, state.data["position"]) == (int(header[8]), int(header[9]))
    assert np.concatenate([state.m, state.v]).tobytes() == raw[checkpoint.HEADER_INTS * 8:]


# A Hugging Face folder (io/hf.py): the damaged file is its model.safetensors, beside the
# config.json of the model it was written for (fixed: one small config), in a folder named
# after the file, so that every message about it names it.
_HF_CONFIG = GPTConfig(max_seq_len=4, vocab_size=6, padded_vocab_size=128, num_layers=1,
                       num_heads=2, channels=4)


@st.composite
def _hf_weights(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    flat = rng.standard_normal(_HF_CONFIG.num_parameters, dtype=np.float32)
    flat[_HF_CONFIG.V * _HF_CONFIG.C:_HF_CONFIG.Vp * _HF_CONFIG.C] = 0   # wte's padded rows
    folder = hf.write_hf(os.path.join(_DIR.name, "hf-valid"), _HF_CONFIG, flat)
    with open(os.path.join(folder, hf.SAFETENSORS), "rb") as f:
        return f.read()


def _read_hf(path: str):
    folder = os.path.join(_DIR.name, "hf", os.path.basename(path))
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, hf.CONFIG), "w") as f:
        json.dump(hf.hf_config(_HF_CONFIG), f)
    shutil.copyfile(path, os.path.join(folder, hf.SAFETENSORS))
    return hf.read_hf(folder)


def _check_hf(result, raw: bytes):
    from safetensors.numpy import load
    config, flat = result
    assert config == _HF_CONFIG and flat.dtype == np.float32
    stored = load(raw)
    for name, a in hf.hf_tensors(config, flat).items():
        assert a.tobytes() == stored[name].astype(np.float32).tobytes(), name


_CKPT_FIELDS = dict(magic=0, version=4, maxT=8, V=12, L=16, NH=20, C=24, Vp=28, reserved=32)
READERS = [
    Reader("checkpoint", _checkpoints(), formats.read_checkpoint, _check_checkpoint, _CKPT_FIELDS,
           huge=(dict(V=2**20, Vp=2**20, C=2**20, NH=1),          # wte alone 2**40 parameters
                 dict(L=2**31 - 1), dict(maxT=2**31 - 1))),
    Reader("shard", _shards(65536), formats.read_shard, _check_shard(None),
           dict(magic=0, version=4, ntok=8, reserved=12), huge=(dict(ntok=2**31 - 1),)),
    Reader("shard-vocab", _shards(SHARD_VOCAB), lambda p: formats.read_shard(p, vocab_size=SHARD_VOCAB),
           _check_shard(SHARD_VOCAB), dict(magic=0, version=4, ntok=8), huge=(dict(ntok=2**31 - 1),)),
    # a table of bytes objects: about 40 bytes of Python object per 2 bytes of file
    Reader("tokenizer", _tokenizers(), formats.read_tokenizer, _check_tokenizer,
           dict(magic=0, version=4, n=8, eot=12, reserved=16), huge=(dict(n=2**32 - 1, eot=0),),
           alloc_per_byte=32),
    # int64 fields: the damage writes the low 32 bits of each
    Reader("companion", _companions(), _read_companion, _check_companion,
           dict(magic=0, version=8, maxT=16, V=24, L=32, NH=40, C=48, Vp=56, step=64,
                position=72, model_crc=80, body_crc=88, reserved=96)),
    # safetensors: an 8-byte header length, then a JSON header (dtype, shape and offsets of
    # each tensor); the tensors' arrays, then llm.c's buffer (its padded vocabulary)
    Reader("hf-safetensors", _hf_weights(), _read_hf, _check_hf, dict(header_len=0),
           alloc_per_byte=8),
    Reader("dataset-meta", _metas, lambda p: data._cached_ok(*_cache(), p), _check_meta, {},
           alloc_per_byte=64),          # JSON: a Python object per few bytes
]
_BY_NAME = {r.name: r for r in READERS}


# --------------------------------------------------------------------------- damage

_FIELD_VALUES = [0, -1, 1, 2, 2**16, 2**20, 2**28, 2**31 - 1, -2**31, 2**32 - 1]


def _set_field(draw, reader: Reader, raw: bytearray) -> bytearray:
    if not reader.fields:
        return raw
    offset = reader.fields[draw(st.sampled_from(sorted(reader.fields)))]
    if len(raw) < offset + 4:
        return raw
    old = struct.unpack_from("<i", raw, offset)[0]
    new = draw(st.sampled_from(_FIELD_VALUES + [old - 1, old + 1]) | st.integers(-2**31, 2**32 - 1))
    struct.pack_into("<I", raw, offset, new & 0xFFFFFFFF)     # one pattern for int32 and uint32
    return raw


def _truncate(draw, reader, raw: bytearray) -> bytearray:
    return raw[:draw(st.integers(0, len(raw)))]


def _extend(draw, reader, raw: bytearray) -> bytearray:
    return raw + draw(st.binary(min_size=1, max_size=64))


def _overwrite(draw, reader, raw: bytearray) -> bytearray:
    at = draw(st.integers(0, len(raw)))
    patch = draw(st.binary(min_size=1, max_size=8))
    raw[at:at + len(patch)] = patch
    return raw


@st.composite
def _damaged(draw, reader: Reader) -> bytes:
    raw = bytearray(draw(reader.valid))
    for damage in draw(st.lists(st.sampled_from([_set_field, _truncate, _extend, _overwrite]),
                                min_size=1, max_size=3)):
        raw = damage(draw, reader, raw)
    return bytes(raw)


def _hostile(reader: Reader):
    return st.one_of(_damaged(reader), st.binary(max_size=2048), st.just(b""))


# --------------------------------------------------------------------------- the property

class Hang(BaseException):
    """A BaseException, so that no `except Exception` (or OSError) in a reader can swallow it."""


@contextlib.contextmanager
def _time_limit(seconds: float):
    def alarm(signum, frame):
        raise Hang(f"the reader was still running after {seconds} s")
    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _file(reader: Reader, raw: bytes) -> str:
    """The path of a file holding raw."""
    path = os.path.join(_DIR.name, f"hostile-{reader.name}.bin")
    # a new inode each time: a shard returned earlier may still map the previous file
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    with open(path, "wb") as f:
        f.write(raw)
    return path


def _read(reader: Reader, raw: bytes):
    """reader.read on a file holding raw, under a time and an allocation limit; its result, or
    None when it raised StarpuLLMError (which must name the file)."""
    path = _file(reader, raw)
    tracemalloc.start()
    try:
        with _time_limit(HANG_SECONDS):
            try:
                result = reader.read(path)
            except StarpuLLMError as e:
                assert os.path.basename(path) in str(e), f"the message does not name the file: {e}"
                result = None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    limit = ALLOC_SLACK + reader.alloc_per_byte * len(raw)
    assert peak <= limit, f"reading a {len(raw)}-byte file allocated {peak} bytes (limit {limit})"
    if result is not None:
        reader.check(result, raw)
    return result


@pytest.mark.parametrize("reader", READERS, ids=lambda r: r.name)
@FUZZ
@given(case=st.data())
def test_hostile_file(reader, case):
    _read(reader, case.draw(_hostile(reader), label="file"))


@pytest.mark.parametrize("reader", READERS, ids=lambda r: r.name)
@settings(FUZZ, max_examples=10)
@given(case=st.data())
def test_valid_files_read_back(reader, case):
    assert _read(reader, case.draw(reader.valid, label="file")) is not None


# --------------------------------------------------------------------------- huge claims

def _with(reader: Reader, raw: bytes, **values) -> bytes:
    """raw with header fields set to values."""
    raw = bytearray(raw)
    for name, value in values.items():
        struct.pack_into("<I", raw, reader.fields[name], value & 0xFFFFFFFF)
    return bytes(raw)


def _claim(reader: Reader, valid: bytes, values: dict) -> bytes:
    """A valid file's header with `values` patched in, and 1 KB of zeros."""
    return _with(reader, valid[:formats.HEADER_BYTES] + bytes(1024), **values)


_CLAIMING = [r for r in READERS if r.huge]


def _smallest_valid(reader: Reader) -> bytes:
    return _smallest_valid_of(reader.name)


@functools.lru_cache(maxsize=None)
def _smallest_valid_of(name: str) -> bytes:
    # Hypothesis tries the simplest example first: no shrinking needed
    return find(_BY_NAME[name].valid, lambda raw: True,
                settings=settings(database=None, phases=[Phase.generate], max_examples=1))


@pytest.mark.parametrize("reader", _CLAIMING, ids=lambda r: r.name)
def test_huge_claims_fail_fast(reader):
    """Terabytes claimed by a 2 KB file: refused, with no more than ALLOC_SLACK allocated."""
    valid = _smallest_valid(reader)
    for values in reader.huge:
        # refused within _read's allocation and hang limits (no speed bound: busy machines)
        assert _read(reader, _claim(reader, valid, values)) is None, values


_CHILD = """
import json, resource, sys
sys.path.insert(0, sys.argv[1])
import test_fuzz
from starpu_llm.errors import StarpuLLMError
readers = {r.name: r for r in test_fuzz.READERS}
cases = json.loads(sys.argv[2])
# set after the imports: what counts is what the readers allocate
vm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (vm + (256 << 20), resource.RLIM_INFINITY))
for name, path in cases:
    try:
        readers[name].read(path)
        print(name, path, "read")
    except StarpuLLMError:
        print(name, path, "refused")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_huge_claims_under_an_address_space_limit(tmp_path):
    """The same claims in a process that cannot map 256 MiB more than it has after its imports:
    an allocation tracemalloc does not see (C code, mmap) would fail there with MemoryError."""
    cases = []
    for reader in _CLAIMING:
        valid = _smallest_valid(reader)
        for i, values in enumerate(reader.huge):
            path = tmp_path / f"{reader.name}-{i}.bin"
            path.write_bytes(_claim(reader, valid, values))
            cases.append((reader.name, str(path)))
    out = subprocess.run([sys.executable, "-c", _CHILD, os.path.dirname(__file__), json.dumps(cases)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [f"{name} {path} refused" for name, path in cases], out.stdout


# --------------------------------------------------------------------------- named cases

def _at(offset: int, patch: bytes):
    return lambda reader, raw: raw[:offset] + patch + raw[offset + len(patch):]


# (reader, what to do to its smallest valid file, words the error must contain)
NAMED = [
    ("checkpoint", lambda r, raw: _with(r, raw, NH=3), "must be a multiple of num_heads (3)"),
    ("checkpoint", lambda r, raw: _with(r, raw, L=0), "invalid model shape"),
    ("checkpoint", lambda r, raw: _with(r, raw, maxT=0), "invalid model shape"),
    ("checkpoint", lambda r, raw: _with(r, raw, C=-1), "invalid model shape"),
    ("checkpoint", lambda r, raw: _with(r, raw, V=5), "padded_vocab_size must be >= vocab_size"),
    # sizes whose parameter count, multiplied out in int64, wraps to exactly 0: a bare header
    # used to read as a valid checkpoint of 2**30 channels and no parameters
    ("checkpoint", lambda r, raw: _with(r, raw[:formats.HEADER_BYTES], maxT=2**31 - 118, V=1,
                                        Vp=2**31 - 1, L=9, NH=1, C=2**30), "truncated"),
    ("shard", lambda r, raw: _with(r, raw, ntok=-1), "negative token count (-1)"),
    ("shard", lambda r, raw: _with(r, raw + b"\0", ntok=1), "truncated"),
    ("shard-vocab", lambda r, raw: _with(r, raw + b"\0\0\xff\xff", ntok=2),
     "token id 65535 (the first out of range at token 1)"),
    ("tokenizer", _at(formats.HEADER_BYTES, b"\0"), "token 0 has length 0"),
    ("tokenizer", _at(formats.HEADER_BYTES, b"\xff"), "ends inside token 0"),
    ("tokenizer", lambda r, raw: _with(r, raw, n=2), "says 2 tokens, at least 4 bytes"),
    ("tokenizer", lambda r, raw: _with(r, raw, eot=1), "end-of-text id 1"),
    ("tokenizer", lambda r, raw: _with(r, raw, n=0), "vocab size 0"),
]


@pytest.mark.parametrize("name, damage, words", NAMED, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(NAMED)])
def test_named_hostile_file(name, damage, words):
    reader = _BY_NAME[name]
    with pytest.raises(StarpuLLMError, match=re.escape(words)):
        with _time_limit(HANG_SECONDS):
            reader.read(_file(reader, damage(reader, _smallest_valid(reader))))


@pytest.mark.parametrize("text", ["[]", "1", "null", '"format"', "[" * 100_000 + "]" * 100_000,
                                  '{"format": 1, "train_tokens": [50], "val_tokens": {}}'])
def test_damaged_dataset_meta_means_no_cache(text):
    reader = _BY_NAME["dataset-meta"]
    assert reader.read(_file(reader, text.encode())) is False
