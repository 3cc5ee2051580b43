"""llm.c's little-endian binary file formats: fp32 checkpoints, uint16 token shards, tokenizer files.

Every reader validates the header and the file size and raises StarpuLLMError with a message that
names the file, what was expected, what was found and what to do. Every writer goes through
atomic.atomic_write, so a crash never leaves a half-written file under the final name.

Limits the readers enforce (tests/test_fuzz.py checks them on hostile files):

- Any file: a regular file (not a directory, FIFO or device) of at least the 1024-byte header
  (256 little-endian 32-bit ints); int 0 is the format's magic and int 1 its version: checkpoint
  20240326 version 3, token shard 20240520 version 1, tokenizer 20240328 version 2.
- The sizes in a header are checked against the file's size before anything else is read or
  allocated: a reader's memory grows with the file's size, never with a size its header claims
  (a checkpoint takes its size, a tokenizer's table some tens of times it, a shard is
  memory-mapped), and a file shorter or longer than its header says is refused.
- Checkpoint: maxT, V, Vp, L, NH and C (ints 2..7) each 1..2**31-1; C a multiple of NH;
  Vp >= V; the file exactly 1024 + 4*P bytes, P the parameter count these sizes imply (computed
  exactly: a header cannot overflow it). Ints 8..255 are ignored, as llm.c does.
- Token shard: token count (int 2) 0..2**31-1 and the file exactly 1024 + 2*count bytes; when
  the caller gives a vocabulary size (training and the bench do), every token id is below it.
- Tokenizer: the ints are unsigned; vocabulary size n (int 2) at least 1 and at most
  (file size - 1024) / 2, as each token takes 2 bytes or more; end-of-text id (int 3) below n;
  then exactly n tokens, each a length byte 1..255 followed by that many bytes, and nothing after.
"""
from __future__ import annotations

import os
import stat
import sys
import zlib

import numpy as np

from .atomic import AtomicFile, atomic_write
from ..model.config import GPTConfig, ParamLayout
from ..errors import StarpuLLMError
from ..model.state import Slices, chunks
from .tokenizer import Tokenizer

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4

CHECKPOINT_MAGIC = 20240326
CHECKPOINT_VERSION = 3
SHARD_MAGIC = 20240520
SHARD_VERSION = 1
TOKENIZER_MAGIC = 20240328
TOKENIZER_VERSION = 2

_I32 = np.dtype("<i4")
_U32 = np.dtype("<u4")
_F32 = np.dtype("<f4")
_U16 = np.dtype("<u2")


# --------------------------------------------------------------------------- helpers

def open_regular(path: str, what: str):
    """(the file opened for binary reading, its size in bytes); a clear error when path is
    missing, unreadable, or not a regular file (a directory, a FIFO, a device)."""
    try:
        # stat before open(): opening a FIFO would block until something writes to it
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise StarpuLLMError(f"{what} path {path} is not a regular file; give the path of a {what} file")
        f = open(path, "rb")
    except FileNotFoundError:
        raise StarpuLLMError(f"{what} file {path} does not exist; check the path") from None
    except OSError as e:
        raise StarpuLLMError(f"cannot read {what} file {path}: {e.strerror}; check its permissions") from None
    return f, os.fstat(f.fileno()).st_size


def _read_exact(f, path: str, nbytes: int, what: str) -> bytearray:
    """The next nbytes of f; only called once the file's size was checked to hold them."""
    buf = bytearray(nbytes)          # writable, so numpy views of it are too
    try:
        got = f.readinto(buf)
    except OSError as e:
        raise StarpuLLMError(f"cannot read {what} file {path}: {e.strerror}") from None
    if got != nbytes:                # the size was checked: the file shrank while being read
        raise StarpuLLMError(f"{path} changed while being read ({got} of {nbytes} bytes read); wait until "
                             f"whatever writes it has finished, then try again")
    return buf


def _read_header(f, path: str, size: int, dtype, what: str, hint: str) -> np.ndarray:
    if size < HEADER_BYTES:
        raise StarpuLLMError(f"{path} is too small to be a {what} file: {size} bytes, but the header "
                             f"alone is {HEADER_BYTES} bytes; {hint}")
    return np.frombuffer(_read_exact(f, path, HEADER_BYTES, what), dtype=dtype)


def _check_magic(path, header, magic, version, what, hint):
    if int(header[0]) != magic:
        raise StarpuLLMError(f"{path} is not a {what} file: header magic is {int(header[0])}, "
                             f"expected {magic}; {hint}")
    if int(header[1]) != version:
        raise StarpuLLMError(f"{path} is a {what} file of version {int(header[1])}, but only version "
                             f"{version} is supported; {hint}")


def _check_size(path, size, expected, what, detail, hint):
    if size < expected:
        raise StarpuLLMError(f"{path} is truncated: the header describes {detail} = {expected} bytes, "
                             f"but the file has only {size} bytes; {hint}")
    if size > expected:
        raise StarpuLLMError(f"{path} has {size - expected} bytes of trailing data: the header describes "
                             f"{detail} = {expected} bytes, but the file has {size} bytes; {hint}")


# --------------------------------------------------------------------------- checkpoints

_CKPT_HINT = ("is it an llm.c fp32 checkpoint (like gpt2_124M.bin, written by train_gpt2.py "
              "or by this package)? Re-create or re-download it")


def read_checkpoint(path, lazy: bool = False) -> tuple[GPTConfig, np.ndarray | Slices]:
    """Read an llm.c fp32 checkpoint; return (config, flat float32 parameters in ParamLayout
    order). lazy: the parameters stay in the file (FileSlices, read slice by slice) once the
    header and the size are checked."""
    path = os.fspath(path)
    f, size = open_regular(path, "checkpoint")
    with f:
        header = _read_header(f, path, size, _I32, "checkpoint", _CKPT_HINT)
        _check_magic(path, header, CHECKPOINT_MAGIC, CHECKPOINT_VERSION, "llm.c fp32 checkpoint", _CKPT_HINT)
        maxT, V, L, NH, C, Vp = (int(header[i]) for i in (2, 3, 4, 5, 6, 7))
        dims = dict(maxT=maxT, V=V, L=L, NH=NH, C=C, Vp=Vp)
        if min(dims.values()) <= 0:
            raise StarpuLLMError(f"{path} has an invalid model shape in its header ({_fmt(dims)}); "
                                 f"{_CKPT_HINT}")
        try:
            config = GPTConfig(max_seq_len=maxT, vocab_size=V, padded_vocab_size=Vp,
                               num_layers=L, num_heads=NH, channels=C)
        except ValueError as e:
            raise StarpuLLMError(f"{path} has an invalid model shape in its header ({_fmt(dims)}): {e}; "
                                 f"{_CKPT_HINT}") from None
        n = config.num_parameters
        _check_size(path, size, HEADER_BYTES + 4 * n, "checkpoint",
                    f"a {HEADER_BYTES}-byte header + {n} float32 parameters ({_fmt(dims)})", _CKPT_HINT)
        if lazy:
            return config, FileSlices(config, path, HEADER_BYTES)
        flat = np.frombuffer(_read_exact(f, path, 4 * n, "checkpoint"), dtype=_F32)
    # native order (a copy only on a big-endian host)
    return config, flat.astype(np.float32, copy=False)


def write_checkpoint(path, config: GPTConfig, flat) -> str:
    """Write `flat` (config.num_parameters float32 values, ParamLayout order: a numpy array or
    a state.Slices) as an llm.c checkpoint."""
    return write_checkpoint_crc(path, config, flat, with_crc=False)[0]


def write_checkpoint_crc(path, config: GPTConfig, flat, with_crc: bool = True):
    """write_checkpoint, and the CRC-32 of the parameters' bytes as written (None without
    with_crc)."""
    path = os.fspath(path)
    crc = None

    def write(f):
        nonlocal crc
        crc = write_checkpoint_into(f, config, flat, 0 if with_crc else None, path)

    return atomic_write(path, write), crc


def write_checkpoint_into(f, config: GPTConfig, flat, crc: int | None = 0, path: str = ""):
    """The llm.c checkpoint of `flat` (a numpy array or a state.Slices) into the open binary
    file f, the checkpoint to be at `path` (for the messages); with crc, returns the CRC-32 of
    the parameters' bytes continuing crc."""
    if not isinstance(flat, Slices):
        flat = np.asarray(flat)
        if flat.size != config.num_parameters:
            raise StarpuLLMError(f"cannot write checkpoint {path}: got {flat.size} parameters, "
                                 f"but the model configuration needs {config.num_parameters}")
        flat = np.ascontiguousarray(flat.reshape(-1), dtype=_F32)
    header = np.zeros(HEADER_INTS, dtype=_I32)
    header[:8] = [CHECKPOINT_MAGIC, CHECKPOINT_VERSION, config.maxT, config.V, config.L,
                  config.NH, config.C, config.Vp]
    f.write(header.tobytes())
    return write_values(f, flat, ParamLayout(config), crc)


def write_values(f, values, layout: ParamLayout, crc: int | None = None):
    """Write a ParamLayout buffer (a numpy array or a state.Slices) as little-endian float32,
    in llm.c's order; with crc, returns the CRC-32 of its bytes continuing crc."""
    for chunk in chunks(values, layout):
        crc = _write_array(f, np.ascontiguousarray(chunk, dtype=_F32), crc)
    return crc


def _write_array(f, arr: np.ndarray, crc: int | None = None, chunk_bytes: int = 64 << 20):
    """Write arr's bytes; with crc, returns the CRC-32 of them continuing crc."""
    mv = memoryview(arr).cast("B")
    for i in range(0, len(mv), chunk_bytes):
        f.write(mv[i:i + chunk_bytes])
        if crc is not None:
            crc = zlib.crc32(mv[i:i + chunk_bytes], crc)
    return crc


def params_crc(params) -> int:
    """CRC-32 of a ParamLayout buffer's values as a checkpoint holds them (a numpy array, a
    FileSlices read from its file, or any state.Slices read slice by slice)."""
    if isinstance(params, FileSlices):
        return file_crc(params.path, params.offset, 4 * params.layout.total)
    crc = 0
    for chunk in chunks(params, None if isinstance(params, np.ndarray) else params.layout):
        crc = zlib.crc32(memoryview(np.ascontiguousarray(chunk, dtype=_F32)).cast("B"), crc)
    return crc


def file_crc(path: str, offset: int, nbytes: int, crc: int = 0, chunk_bytes: int = 64 << 20) -> int:
    """CRC-32 of nbytes of a file from offset (read in chunks), continuing crc."""
    buf = bytearray(min(nbytes, chunk_bytes) or 1)
    with open(path, "rb") as f:
        f.seek(offset)
        left = nbytes
        while left:
            view = memoryview(buf)[:min(left, len(buf))]
            got = f.readinto(view)
            if got != len(view):
                raise StarpuLLMError(f"{path} changed while being read; wait until whatever "
                                     f"writes it has finished, then try again")
            crc = zlib.crc32(view, crc)
            left -= got
    return crc


class FileSlices(Slices):
    """A ParamLayout buffer of little-endian float32 stored in a file from `offset` (a
    checkpoint's parameters, a companion's moments), read slice by slice."""

    def __init__(self, config: GPTConfig, path: str, offset: int):
        super().__init__(config)
        self.path, self.offset = path, offset

    def read_range(self, offset, out):
        view = memoryview(out).cast("B")
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset + 4 * offset)
                got = f.readinto(view)
        except OSError as e:
            raise StarpuLLMError(f"cannot read {self.path}: {e.strerror}") from None
        if got != len(view):
            raise StarpuLLMError(f"{self.path} changed while being read ({got} of {len(view)} "
                                 f"bytes of a slice); wait until whatever writes it has "
                                 f"finished, then try again")
        if sys.byteorder == "big":
            out.byteswap(inplace=True)


def _fmt(d: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in d.items())


# --------------------------------------------------------------------------- token shards

_SHARD_HINT = ("is it an llm.c token shard (.bin written by `prepare` or llm.c's dev/data scripts)? "
               "Re-create it with the data preparation step")


def read_shard(path, vocab_size: int | None = None) -> np.ndarray:
    """Memory-map an llm.c uint16 token shard (read-only) after validating header and size.

    If vocab_size is given, every token must be < vocab_size.
    """
    path = os.fspath(path)
    f, size = open_regular(path, "token shard")
    with f:
        header = _read_header(f, path, size, _I32, "token shard", _SHARD_HINT)
        _check_magic(path, header, SHARD_MAGIC, SHARD_VERSION, "token shard", _SHARD_HINT)
        ntok = int(header[2])
        if ntok < 0:
            raise StarpuLLMError(f"{path} has a negative token count ({ntok}) in its header; {_SHARD_HINT}")
        _check_size(path, size, HEADER_BYTES + 2 * ntok, "token shard",
                    f"a {HEADER_BYTES}-byte header + {ntok} uint16 tokens", _SHARD_HINT)
        if ntok == 0:                    # mmap cannot map 0 bytes
            return np.zeros(0, dtype=np.uint16)
        tokens = np.memmap(f, dtype=_U16, mode="r", offset=HEADER_BYTES, shape=(ntok,))
    if vocab_size is not None:
        mx = int(tokens.max())
        if mx >= vocab_size:
            at = int(np.argmax(tokens >= vocab_size))
            raise StarpuLLMError(f"{path} contains token id {mx} (the first out of range at token {at}), but "
                                 f"the vocabulary has only {vocab_size} tokens (ids 0..{vocab_size - 1}); the "
                                 f"shard was made with a different tokenizer: re-create it with this model's "
                                 f"tokenizer")
    return tokens


def write_shard(path, tokens) -> str:
    """Write token ids (each 0..65535) as an llm.c uint16 token shard."""
    return shard_file(path, [tokens]).commit()


def shard_file(path, blocks) -> AtomicFile:
    """The token ids of the arrays in `blocks`, one after the other, as an llm.c uint16 token
    shard under a temporary name next to path, one block in memory at a time: an AtomicFile
    whose commit() puts it at path (discard() drops it). What a block raises drops it."""
    path = os.fspath(path)
    limit = np.iinfo(np.int32).max

    def write(f):
        f.write(bytes(HEADER_BYTES))           # the count is known at the end
        n = 0
        for block in blocks:
            data = _shard_tokens(path, block)
            n += data.size
            if n > limit:
                raise StarpuLLMError(f"cannot write token shard {path}: more than 2**31-1 tokens, the "
                                     f"format's limit; split the data into several shards")
            _write_array(f, data)
        header = np.zeros(HEADER_INTS, dtype=_I32)
        header[:3] = [SHARD_MAGIC, SHARD_VERSION, n]
        f.seek(0)
        f.write(header.tobytes())

    out = AtomicFile(path)
    out.fill(write)
    return out


def _shard_tokens(path: str, tokens) -> np.ndarray:
    """tokens as the shard's little-endian uint16, or an error naming the shard."""
    arr = np.asarray(tokens)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise StarpuLLMError(f"cannot write token shard {path}: tokens must be integers, got {arr.dtype}")
    arr = arr.reshape(-1)
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi > 0xFFFF:
            raise StarpuLLMError(f"cannot write token shard {path}: token ids must fit uint16 (0..65535), "
                                 f"found {lo if lo < 0 else hi}; use a vocabulary of at most 65536 tokens")
    return np.ascontiguousarray(arr, dtype=_U16)


# --------------------------------------------------------------------------- tokenizer files

_TOK_HINT = ("is it an llm.c tokenizer file (gpt2_tokenizer.bin)? Re-create it with the data "
             "preparation step")


def read_tokenizer(path) -> Tokenizer:
    """Read an llm.c tokenizer file (version 2) into a Tokenizer."""
    path = os.fspath(path)
    f, size = open_regular(path, "tokenizer")
    with f:
        header = _read_header(f, path, size, _U32, "tokenizer", _TOK_HINT)
        _check_magic(path, header, TOKENIZER_MAGIC, TOKENIZER_VERSION, "tokenizer", _TOK_HINT)
        n, eot = int(header[2]), int(header[3])
        if n == 0 or eot >= n:
            raise StarpuLLMError(f"{path} has an invalid header: vocab size {n}, end-of-text id {eot} "
                                 f"(must be < vocab size); {_TOK_HINT}")
        # each token is a length byte and 1..255 bytes: a count the file cannot hold fails here,
        # before the table is built
        if 2 * n > size - HEADER_BYTES:
            raise StarpuLLMError(f"{path} is truncated: the header says {n} tokens, at least {2 * n} bytes, "
                                 f"but the file has {size - HEADER_BYTES} bytes after its header; {_TOK_HINT}")
        body = memoryview(_read_exact(f, path, size - HEADER_BYTES, "tokenizer"))
    table = []
    pos, end = 0, len(body)
    for i in range(n):
        if pos >= end:
            raise StarpuLLMError(f"{path} is truncated: the header says {n} tokens, but the file ends after "
                                 f"{i} of them; {_TOK_HINT}")
        length = body[pos]
        if length == 0:
            raise StarpuLLMError(f"{path} is corrupt: token {i} has length 0; {_TOK_HINT}")
        if pos + 1 + length > end:
            raise StarpuLLMError(f"{path} is truncated: the header says {n} tokens, but the file ends inside "
                                 f"token {i}; {_TOK_HINT}")
        table.append(bytes(body[pos + 1:pos + 1 + length]))
        pos += 1 + length
    if pos != end:
        raise StarpuLLMError(f"{path} has {end - pos} bytes of trailing data after its {n} tokens; "
                             f"{_TOK_HINT}")
    return Tokenizer(table, eot, path)


def write_tokenizer(path, tok) -> str:
    """Write a Tokenizer's (or a tiktoken Encoding's) id -> bytes table as an llm.c tokenizer
    file (version 2)."""
    path = os.fspath(path)
    if not isinstance(tok, Tokenizer):
        tok = Tokenizer.from_encoding(tok)
    n, eot = tok.vocab_size, tok.eot
    parts = []
    for i, b in enumerate(tok.token_bytes):
        if not 0 < len(b) < 256:
            raise StarpuLLMError(f"cannot write tokenizer {path}: token {i} is {len(b)} bytes long, the "
                                 f"format allows 1..255")
        parts.append(bytes([len(b)]))
        parts.append(b)
    header = np.zeros(HEADER_INTS, dtype=_U32)
    header[:4] = [TOKENIZER_MAGIC, TOKENIZER_VERSION, n, eot]
    body = b"".join(parts)

    def write(f):
        f.write(header.tobytes())
        f.write(body)

    return atomic_write(path, write)
