"""Training data: tokenization into llm.c shards, the cached default dataset (the bundled
Shakespeare of corpus.py), and the batch loader."""
from __future__ import annotations

import codecs
import glob
import json
import os
import re
from typing import Iterable, Iterator

import numpy as np

from . import corpus, formats
from .atomic import atomic_write_text
from ..errors import StarpuLLMError, opt
from .tokenizer import EOT_TEXT, N_VOCAB, encode, gpt2

TOKENIZER_FILENAME = "gpt2_tokenizer.bin"
DEFAULT_DATASET = "shakespeare"
_TRAIN, _VAL = "_train.bin", "_val.bin"      # prepare's shards: <name>_train.bin, <name>_val.bin
# prepare's training shards with shard_tokens: <name>_train_000000.bin, ...; six digits, so
# that sorted (the loader's order) is the order written, up to _MAX_SHARDS of them
_SHARD, _SHARDS = "_train_{:06d}.bin", "_train_*.bin"
_TRAIN_NAMES = r"_train(?:_\d{6})?\.bin"    # either form: what one prepare replaces of another's
_MAX_SHARDS = 10 ** 6
_CACHE_FORMAT = 1                     # bump when the corpus conversion or tokenization changes


# --------------------------------------------------------------------------- tokenization into shards

def _text_path(source) -> str | None:
    """The path of the text file `source` names, checked; None when source is the text itself
    (a str containing a newline)."""
    if isinstance(source, str) and "\n" in source:
        return None
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"prepare() needs a text or a file path, got {type(source).__name__}")
    path = os.fspath(source)
    if not os.path.exists(path):
        raise StarpuLLMError(f"input text file {path} does not exist; check the path")
    if not os.path.isfile(path):
        raise StarpuLLMError(f"input text path {path} is not a regular file; give a UTF-8 text file")
    return path


def _file_text(path: str, block: int) -> Iterator[str]:
    """The text of the file at path in pieces, `block` bytes read at a time, as Python's text
    mode reads it: UTF-8, a byte-order mark dropped, Windows' and old Macs' line ends read as
    "\n" (as llm.c's prepro scripts read them: a blank line is then "\n\n" whatever wrote the
    file)."""
    utf8 = codecs.getincrementaldecoder("utf-8")()
    offset, cr, first = 0, "", True        # cr: a "\r" held until the next byte shows its line end
    try:
        with open(path, "rb") as f:
            while True:
                raw = f.read(block)
                nul = raw.find(b"\0")
                if nul >= 0:
                    raise StarpuLLMError(f"input text file {path} has a NUL byte at offset {offset + nul}, "
                                         f"so it is not text (binary, or UTF-16: convert that with "
                                         f"`iconv -f UTF-16 -t UTF-8`)")
                held = len(utf8.getstate()[0])          # bytes of a character begun in the last block
                try:
                    text = cr + utf8.decode(raw, final=not raw)
                except UnicodeDecodeError as e:
                    raise StarpuLLMError(f"input text file {path} is not valid UTF-8 (bad byte at offset "
                                         f"{offset - held + e.start}); convert it to UTF-8 first, e.g. "
                                         f"`iconv -f LATIN1 -t UTF-8`") from None
                offset += len(raw)
                if first and text:
                    text, first = text.removeprefix("\ufeff"), False
                cr = "\r" if raw and text.endswith("\r") else ""
                yield text[:len(text) - len(cr)].replace("\r\n", "\n").replace("\r", "\n")
                if not raw:
                    return
    except OSError as e:
        raise StarpuLLMError(f"cannot read input text file {path}: {e.strerror}") from None


# where GPT-2's pre-tokenizer always splits (a word's end, then a space or a line end; its
# pieces never hold both) and a "\n\n" never straddles: the ids of a text cut there are the
# ids of its two sides, one after the other
_CUT = re.compile(r"\w(?=[ \n])")


def _last_cut(text: str, start: int) -> int:
    """The index after text's last cut place at or after `start`, or 0 when it has none."""
    window = 4096
    while True:
        lo = max(start, len(text) - window)
        cut = 0
        for m in _CUT.finditer(text, lo):
            cut = m.end()
        if cut or lo == start:
            return cut
        window *= 16


def document_ids(pieces: Iterable[str]) -> Iterator[np.ndarray]:
    """GPT-2 ids (uint16 arrays, one after the other) of the text made of `pieces`, with
    llm.c's tinyshakespeare convention: EOT at the start and after every blank line ("\n\n").
    They are the ids of the whole text encoded at once, computed up to each piece's last cut
    place (_CUT), what follows carried into the next piece: the memory is a piece's."""
    carry = EOT_TEXT
    for piece in pieces:
        text = carry + piece
        cut = _last_cut(text, max(len(carry) - 1, 0))      # carry has none: it was cut after its last
        if cut:
            yield _ids(text[:cut])
        carry = text[cut:]
    yield _ids(carry)


def _ids(text: str) -> np.ndarray:
    return np.asarray(encode(text.replace("\n\n", "\n\n" + EOT_TEXT)), dtype=np.uint16)


# the text's first tokens that make the validation shard, unless told (`prepare --val-tokens`;
# the bundled Shakespeare's cache): llm.c's tinyshakespeare split
VAL_TOKENS = 32768


def prepare(source, out_dir, val_tokens: int = VAL_TOKENS, name: str | None = None,
            block: int = 8 << 20, shard_tokens: int | None = None) -> tuple[str, str]:
    """Tokenize a text into llm.c shards; return (train, val_path), train the training shard's
    path or (shard_tokens given) the glob pattern of the training shards.

    `source` is a text file path (str or PathLike) or the text itself (a str containing a newline).
    The first `val_tokens` tokens become `<name>_val.bin`, the rest `<name>_train.bin`, or with
    `shard_tokens` N the shards `<name>_train_000000.bin`, `_000001.bin`, ...: shard k holds the
    rest's tokens k*N .. (k+1)*N, N + 1 tokens (the last: what is left), each but the first
    beginning with the one before's last token, the target of that one's last input: with N a
    multiple of B*T a shard holds N/(B*T) whole batches and the shards' batches are the
    single shard's (io/data.DataLoader). The GPT-2 tokenizer is written to `gpt2_tokenizer.bin`
    in out_dir. `name` defaults to the file's stem (or "data" for a text). The text is read
    and tokenized `block` bytes (characters) at a time, the memory a block's whatever the
    text's size; the shards are written under temporary names and replace what is there only
    once all are complete, and then the training shards of an earlier prepare of the same
    name that this one did not write (the other form, or shards past this one's last) go.
    """
    path = _text_path(source)
    what = f"input text file {path}" if path else "the input text"
    if int(val_tokens) < 1:
        raise StarpuLLMError(f"the validation split needs at least 1 token, got {opt('val_tokens')} "
                             f"{val_tokens}")
    val_tokens = int(val_tokens)
    check_shard_tokens(shard_tokens)
    train_path, val_path, tokenizer_path = prepared_paths(path, out_dir, name, shard_tokens is not None)
    earlier = prepared_train_files(path, out_dir, name)
    if shard_tokens is not None:
        _check_pattern_is_ours(train_path, earlier)
    pieces = (_file_text(path, block) if path else
              (source[i:i + block] for i in range(0, len(source), block)))
    val: list[np.ndarray] = []
    text = {"seen": False}                 # a character that is not whitespace

    def watched(pieces):
        for piece in pieces:
            text["seen"] = text["seen"] or bool(piece) and not piece.isspace()
            yield piece

    def train_ids():
        n = 0
        for ids in document_ids(watched(pieces)):
            take = min(max(val_tokens - n, 0), ids.size)
            if take:
                val.append(ids[:take])
            n += ids.size
            yield ids[take:]
        if not text["seen"]:
            raise StarpuLLMError(f"{what} is empty (or only whitespace); give a file with training text")
        if n <= val_tokens:
            raise StarpuLLMError(f"{what} is too short for a validation split: it has {n} tokens, but "
                                 f"the first {val_tokens} ({opt('val_tokens')}) go to validation and "
                                 f"training needs the rest; use a longer text or a smaller "
                                 f"{opt('val_tokens')}")

    train = ([formats.shard_file(train_path, train_ids())] if shard_tokens is None else
             _shard_files(lambda k: _shard_path(path, out_dir, name, k), train_ids(),
                          int(shard_tokens), what))
    try:
        formats.write_tokenizer(tokenizer_path, gpt2())
        formats.write_shard(val_path, np.concatenate(val))
    except BaseException:
        for f in train:
            f.discard()
        raise
    written = {f.commit() for f in train}
    for f in earlier:
        if f not in written:
            try:
                os.unlink(f)
            except FileNotFoundError:
                pass
            except OSError as e:
                raise StarpuLLMError(f"cannot remove {f}, a training shard of an earlier prepare "
                                     f"into this folder: {e.strerror}; remove it by hand (the "
                                     f"new shards are written)") from None
    return train_path, val_path


def check_shard_tokens(shard_tokens: int | None) -> None:
    """prepare()'s shard_tokens (None: one training shard), refused unless a shard size."""
    limit = np.iinfo(np.int32).max - 1                  # a shard's N + 1 within the format's 2**31-1
    if shard_tokens is not None and not 1 <= int(shard_tokens) <= limit:
        raise StarpuLLMError(f"{opt('shard_tokens')} {shard_tokens} is not a shard size: give 1 .. "
                             f"{limit} tokens (a shard holds one more, at most the format's 2**31-1)")


class _Ids:
    """The ids of a stream of uint16 arrays, taken a number at a time."""

    def __init__(self, arrays: Iterable[np.ndarray]):
        self._arrays, self._held = iter(arrays), np.zeros(0, np.uint16)

    def more(self) -> bool:
        """Whether ids are left (reading on to the next array that has some)."""
        while not self._held.size:
            nxt = next(self._arrays, None)
            if nxt is None:
                return False
            self._held = nxt
        return True

    def take(self, n: int) -> Iterator[np.ndarray]:
        """The next n ids (fewer at the end), in pieces."""
        while n and self.more():
            piece, self._held = self._held[:n], self._held[n:]
            n -= piece.size
            yield piece


def _shard_files(path_of, arrays, n: int, what: str) -> list:
    """The ids of `arrays` as shards of n + 1 ids at path_of(0), path_of(1), ... under
    temporary names (formats.AtomicFile, uncommitted), one written as the ids come: each but
    the first begins with the one before's last id. What the ids raise drops them all."""
    ids, out, last = _Ids(arrays), [], []
    try:
        while ids.more():
            if len(out) == _MAX_SHARDS:
                raise StarpuLLMError(f"{what} makes more than {_MAX_SHARDS:,} training shards of "
                                     f"{opt('shard_tokens')} {n}; give a larger {opt('shard_tokens')}")
            head, tail = last, []

            def shard():
                yield from head
                for piece in ids.take(n + 1 - len(head)):
                    tail[:] = [piece[-1:]]
                    yield piece
            out.append(formats.shard_file(path_of(len(out)), shard()))
            last = tail
    except BaseException:
        for f in out:
            f.discard()
        raise
    return out


def _dataset(path: str | None, out_dir, name: str | None) -> tuple[str, str]:
    """(out_dir, name): the folder and the dataset's name (checked) of prepare's files."""
    if name is None:
        name = os.path.splitext(os.path.basename(path))[0] if path else "data"
    if not name or os.sep in name or (os.altsep and os.altsep in name):
        raise StarpuLLMError(f"dataset name {name!r} is not a plain file name; give a name without slashes")
    return os.fspath(out_dir), name


def prepared_paths(path: str | None, out_dir, name: str | None = None,
                   sharded: bool = False) -> tuple[str, str, str]:
    """The files prepare() writes for the text file at path (None: a text given as such):
    (training shard, or with sharded the glob pattern of the training shards; validation
    shard; tokenizer)."""
    out_dir, name = _dataset(path, out_dir, name)
    train = (os.path.join(glob.escape(out_dir), glob.escape(name) + _SHARDS) if sharded else
             os.path.join(out_dir, name + _TRAIN))
    return train, os.path.join(out_dir, name + _VAL), os.path.join(out_dir, TOKENIZER_FILENAME)


def _shard_path(path: str | None, out_dir, name: str | None, k: int) -> str:
    """The k-th (from 0) training shard prepare() writes with shard_tokens."""
    out_dir, name = _dataset(path, out_dir, name)
    return os.path.join(out_dir, name + _SHARD.format(k))


def prepared_train_files(path: str | None, out_dir, name: str | None = None) -> list[str]:
    """The training shards, in either form, that a prepare() of this dataset into out_dir
    wrote and are there: one prepare() replaces them, or removes those it does not write."""
    out_dir, name = _dataset(path, out_dir, name)
    ours = re.compile(re.escape(name) + _TRAIN_NAMES)
    try:
        names = os.listdir(out_dir or ".")
    except OSError:
        return []               # no folder (yet): none; one that cannot be read fails on writing
    found = (os.path.join(out_dir, f) for f in names if ours.fullmatch(f))
    return sorted(f for f in found if not os.path.isdir(f))


def _check_pattern_is_ours(pattern: str, ours: list[str]) -> None:
    """A file the training shards' pattern matches that prepare() did not write is refused:
    training on the pattern would read it with them."""
    names = {os.path.basename(f) for f in ours}
    for f in sorted(glob.glob(pattern)):
        if os.path.basename(f) not in names and not os.path.isdir(f):
            raise StarpuLLMError(f"{f} matches the training shards' pattern {pattern} but is not "
                                 f"one that prepare writes, so training on the pattern would read "
                                 f"it too; move it away, or give another {opt('out_dir')}")


def val_shard_beside(train_path: str) -> str:
    """The validation shard prepare() wrote with the training shard (or the pattern of the
    training shards) at train_path (its name with <name> in place of the dataset's when
    train_path is not one of prepare's)."""
    head, base = os.path.split(train_path)
    named = re.fullmatch(r"(.+)(?:" + _TRAIN_NAMES + r"|" + re.escape(_SHARDS) + r")", base)
    return os.path.join(head, (named.group(1) if named else "<name>") + _VAL)


def default_cache_dir() -> str:
    """$STARPU_LLM_CACHE, or ~/.cache/starpu_llm."""
    env = os.environ.get("STARPU_LLM_CACHE")
    if env:
        return env
    return os.path.join(os.path.expanduser("~"), ".cache", "starpu_llm")


def _cached_ok(cache_dir: str, train: str, val: str, meta_path: str) -> bool:
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
        # any JSON value parses: a list or a number is a damaged cache too
        if not isinstance(meta, dict) or meta.get("format") != _CACHE_FORMAT:
            return False
        ok = (formats.read_shard(train, N_VOCAB).size == meta["train_tokens"]
              and formats.read_shard(val, N_VOCAB).size == meta["val_tokens"])
        formats.read_tokenizer(os.path.join(cache_dir, TOKENIZER_FILENAME))
        return ok
    except (OSError, ValueError, KeyError, TypeError, RecursionError, StarpuLLMError):
        return False          # (RecursionError: json's answer to very deeply nested brackets)


def default_dataset(cache_dir=None) -> tuple[str, str]:
    """The bundled Shakespeare corpus as (train_path, val_path) shards, tokenized on first use.

    Cached in cache_dir (default: $STARPU_LLM_CACHE or ~/.cache/starpu_llm) and re-used when the
    cached files are valid.
    """
    cache_dir = os.fspath(cache_dir) if cache_dir is not None else default_cache_dir()
    train = os.path.join(cache_dir, f"{DEFAULT_DATASET}_train.bin")
    val = os.path.join(cache_dir, f"{DEFAULT_DATASET}_val.bin")
    meta_path = os.path.join(cache_dir, f"{DEFAULT_DATASET}.json")
    if _cached_ok(cache_dir, train, val, meta_path):
        return train, val
    train, val = prepare(corpus.shakespeare_text(), cache_dir, name=DEFAULT_DATASET)
    meta = {"format": _CACHE_FORMAT, "source": corpus.SOURCE,
            "train_tokens": int(formats.read_shard(train).size),
            "val_tokens": int(formats.read_shard(val).size)}
    # written last: its presence marks a complete cache
    atomic_write_text(meta_path, json.dumps(meta, indent=1) + "\n")
    return train, val


def timing_dataset(vocab_size: int, cache_dir=None) -> str:
    """The training shard that bench and calibrate time a model on: the bundled Shakespeare's
    when the model's vocabulary holds GPT-2's ids, else (micro) those ids taken modulo the
    vocabulary, cached next to it. A step's time depends on how many ids it reads, not on
    which, and the text's ids fit no smaller vocabulary."""
    train = default_dataset(cache_dir)[0]
    if vocab_size >= N_VOCAB:
        return train
    path = os.path.join(os.path.dirname(train), f"{DEFAULT_DATASET}_mod{vocab_size}_train.bin")
    tokens = formats.read_shard(train, N_VOCAB)
    try:
        if formats.read_shard(path, vocab_size).size == tokens.size:
            return path
    except StarpuLLMError:
        pass                  # missing or damaged: written again
    formats.write_shard(path, tokens % vocab_size)
    return path


# --------------------------------------------------------------------------- batch loader

def shard_paths(spec) -> list[str]:
    """The token shards `spec` names: a path (one shard), or a glob pattern (`*`, `?`, `[...]`;
    quoted on a command line, as llm.c's `fineweb_train_*.bin`) whose matches are the shards
    in sorted order (llm.c's order)."""
    spec = os.fspath(spec)
    if not any(c in spec for c in "*?["):
        return [spec]
    found = sorted(p for p in glob.glob(spec) if not os.path.isdir(p))
    if not found:
        raise StarpuLLMError(f"no file matches the pattern {spec}; check its folder and pattern "
                             f"(quote it on a command line, so that the shell passes it as it is)")
    return found


class DataLoader:
    """llm.c's loader over one shard or several (a glob pattern: shard_paths), read in order.

    Batch i of a shard is its B*T+1 tokens starting at i*B*T: inputs the first B*T, targets
    the same shifted by one, both int32 of shape (B, T). A batch never straddles two shards
    (llm.c's rule): when the current shard cannot supply B*T+1 more tokens the next shard's
    first batch follows (its last tokens, fewer than a batch's, are never read), and after
    the last shard the first's (an epoch). The position is (shard index, token offset in it).

    Shards are memory-mapped, one at a time: the memory is never the dataset's. Every shard's
    header and size are checked when the loader is made (each must hold B*T+1 tokens), and
    its token ids (< vocab_size, when given) when it is opened to be read; each error names
    the shard's file.
    """

    def __init__(self, path_or_tokens, B: int, T: int, vocab_size: int | None = None):
        B, T = int(B), int(T)
        if B < 1 or T < 1:
            raise StarpuLLMError(f"batch size and sequence length must be >= 1, got B={B}, T={T}")
        self.B, self.T, self.vocab_size = B, T, vocab_size
        need = B * T + 1
        if isinstance(path_or_tokens, (str, os.PathLike)):
            self.path = os.fspath(path_or_tokens)      # as given: a path or a pattern
            self.paths = shard_paths(self.path)
            self.sizes = [int(formats.read_shard(p).size) for p in self.paths]   # headers
            sources = self.paths
        else:
            self.path, self.paths = None, []
            arr = np.asarray(path_or_tokens).reshape(-1)
            if arr.size and (not np.issubdtype(arr.dtype, np.integer) or arr.min() < 0 or arr.max() > 0xFFFF):
                raise StarpuLLMError("in-memory tokens must be integers in 0..65535")
            if vocab_size is not None and arr.size and int(arr.max()) >= vocab_size:
                raise StarpuLLMError(f"in-memory tokens contain id {int(arr.max())}, but the vocabulary has "
                                     f"only {vocab_size} tokens")
            self.tokens = np.ascontiguousarray(arr, dtype=np.uint16)   # the load tasks' layout
            self.sizes = [int(self.tokens.size)]
            sources = ["the in-memory token array"]
        for src, have in zip(sources, self.sizes):
            if have < need:
                several = (f" (every shard of {self.path} must hold a batch: remove it from "
                           f"the shards)" if len(self.sizes) > 1 else "")
                raise StarpuLLMError(f"{src} is too short: needs at least B*T+1 = {need} tokens, has "
                                     f"{have}; use a smaller {opt('batch')}/{opt('seq_len')} or a "
                                     f"larger shard{several}")
        self.shard = None
        self._open(0)
        self._position = 0

    def _open(self, shard: int) -> None:
        """Make `shard` the current one: memory-mapped, its ids checked (a shard file)."""
        if shard != self.shard and self.paths:
            self.tokens = formats.read_shard(self.paths[shard], self.vocab_size)
            if self.tokens.size != self.sizes[shard]:
                raise StarpuLLMError(f"{self.paths[shard]} changed while training read the shards "
                                     f"(it held {self.sizes[shard]} tokens, now {self.tokens.size}); "
                                     f"leave the shards as they are while a run reads them")
        self.shard = shard

    @property
    def num_shards(self) -> int:
        return len(self.sizes)

    @property
    def num_tokens(self) -> int:
        """Tokens in all the shards."""
        return sum(self.sizes)

    @property
    def num_batches(self) -> int:
        """Batches per pass over the shards (an epoch)."""
        return sum((n - 1) // (self.B * self.T) for n in self.sizes)

    def describe(self) -> str:
        """The data in words: its path (or pattern, with its shard count) and its size."""
        where = self.path or "the in-memory token array"
        shards = f", {self.num_shards} shards" if self.num_shards > 1 else ""
        return f"{where} ({self.num_tokens:,} tokens{shards})"

    def shard_tokens(self) -> Iterator[np.ndarray]:
        """Each shard's tokens in order, memory-mapped one at a time (ids not checked)."""
        if not self.paths:
            yield self.tokens
        for p in self.paths:
            yield formats.read_shard(p)

    @property
    def position(self) -> int:
        """Start of the next batch in the current shard (self.shard)."""
        return self._position

    @position.setter
    def position(self, value):
        p = int(value)
        last = self.sizes[self.shard] - (self.B * self.T + 1)
        if not 0 <= p <= last:
            src = (self.paths[self.shard] if self.paths else "the in-memory token array")
            raise StarpuLLMError(f"data position {p} is outside {src} (valid: 0..{last} for B={self.B}, "
                                 f"T={self.T}); the state was saved for a different dataset or batch shape")
        self._position = p

    def reset(self):
        self._open(0)
        self._position = 0

    def state(self) -> dict:
        """{"shard": index, "position": offset}; "shard" left out when 0 (a state without it,
        of a single shard or saved before shards, is at shard 0)."""
        return {**({"shard": self.shard} if self.shard else {}), "position": self._position}

    def load_state(self, d: dict):
        try:
            shard, position = d.get("shard", 0), d["position"]
        except (KeyError, TypeError, AttributeError):
            raise StarpuLLMError(f"data loader state {d!r} has no 'position'; the checkpoint's state is "
                                 f"incomplete") from None
        if not 0 <= int(shard) < self.num_shards:
            raise StarpuLLMError(f"the state is at shard {int(shard)} (counted from 0), but "
                                 f"{self.path or 'the in-memory token array'} has "
                                 f"{self.num_shards}; the state was saved for other data: give "
                                 f"the shards it was saved with")
        self._open(int(shard))
        self.position = position

    def _advance(self) -> tuple[np.ndarray, int]:
        """(the current shard's tokens, the start of the next batch there), moving past it:
        to the next shard (after the last, the first) when this one holds no other batch."""
        n = self.B * self.T
        tokens, pos = self.tokens, self._position
        self._position += n
        if self._position + n + 1 > self.sizes[self.shard]:
            self._open((self.shard + 1) % self.num_shards)
            self._position = 0
        return tokens, pos

    def next_tokens(self) -> np.ndarray:
        """The next batch's B*T+1 tokens, a view into its shard (no copy: what the load tasks
        read, flow/step.py), and advance past it."""
        tokens, pos = self._advance()
        return tokens[pos:pos + self.B * self.T + 1]

    def next_position(self) -> int:
        """Start of the next batch in the shard (`tokens`), and advance past it (the load task
        reads the B*T+1 tokens from there itself). A single shard's: with several, a position
        says nothing of its shard (take next_tokens)."""
        if self.num_shards > 1:
            raise StarpuLLMError(f"next_position() is a position in one shard, and {self.path} "
                                 f"has {self.num_shards}: take next_tokens(), the batch's tokens")
        return self._advance()[1]

    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        B, T = self.B, self.T
        buf = np.array(self.next_tokens(), dtype=np.int32)
        return buf[:-1].reshape(B, T).copy(), buf[1:].reshape(B, T).copy()

    def __iter__(self):
        while True:
            yield self.next_batch()
