"""Scoring: the log-probabilities a request asks for (logprobs, top_logprobs, echo's prompt
scores) and the changes it makes to the logits before a token is drawn (presence_penalty,
frequency_penalty, logit_bias), as OpenAI's API defines them. No HTTP here.

The reported log-probabilities are those of the model itself: log_softmax of the logits the
model computed, before the request's penalties, bias, temperature, top_k and top_p (vLLM's
default, "raw" log-probabilities); the token drawn is the one sampled from the changed logits.

  logits'[j] = logits[j] + logit_bias[j] - frequency_penalty * c[j] - presence_penalty * [c[j] > 0]

with c[j] the times token j was drawn so far in this completion (the prompt does not count).
"""
from __future__ import annotations

import json
import re
from typing import NamedTuple

import numpy as np

from ..flow.generate import sample_batch
from ..io.tokenizer import StreamDecoder
from .errors import BadRequest

MAX_COMPLETION_LOGPROBS = 5      # OpenAI's limit on the completions API's logprobs
MAX_TOP_LOGPROBS = 20            # and on the chat API's top_logprobs
MAX_PENALTY = 2.0                # presence_penalty, frequency_penalty in [-2, 2]
MAX_BIAS = 100.0                 # a logit_bias value in [-100, 100]


class Logprob(NamedTuple):
    """One token's score: its id, its log-probability (None: the prompt's first token, which
    nothing predicts) and the `top` most likely tokens at its place, [(id, logprob)]."""
    token: int
    logprob: float | None
    top: tuple = ()


def log_softmax(logits) -> np.ndarray:
    """log softmax of one row of logits, in float64."""
    x = np.asarray(logits, np.float64)
    z = x - x.max()
    return z - np.log(np.exp(z).sum())


def score(logits, token: int, top: int) -> Logprob:
    """token's log-probability under logits, and the top most likely tokens (by decreasing
    log-probability, ties by id)."""
    if not np.isfinite(np.sum(logits, dtype=np.float64)):    # NaN or inf: not JSON, no score
        raise ValueError("the logits are not all finite: the token cannot be scored")
    lp = log_softmax(logits)
    best = ()
    if top:
        ids = np.argpartition(-lp, top - 1)[:top]
        ids = ids[np.lexsort((ids, -lp[ids]))]
        best = tuple((int(i), float(lp[i])) for i in ids)
    return Logprob(int(token), float(lp[token]), best)


def adjusted(logits, sampling, drawn) -> np.ndarray:
    """The logits the next token is drawn from: logits with the request's bias and penalties
    (the module docstring's formula); drawn: the tokens drawn so far. logits itself when the
    request changes nothing."""
    if not (sampling.logit_bias or sampling.presence_penalty or sampling.frequency_penalty):
        return logits
    x = np.array(logits, np.float64)
    for token, bias in sampling.logit_bias:
        x[token] += bias
    if drawn and (sampling.presence_penalty or sampling.frequency_penalty):
        ids, counts = np.unique(np.asarray(drawn, np.int64), return_counts=True)
        x[ids] -= sampling.frequency_penalty * counts + sampling.presence_penalty
    return x


def choose(logits, sampling, drawn, rng) -> tuple[int, Logprob | None]:
    """The next token of a sequence (drawn: its tokens so far) and, when the request asks for
    log-probabilities (sampling.logprobs not None), its score: choose_batch's row."""
    chosen = choose_batch(np.asarray(logits)[None], [(sampling, drawn, rng)])[0]
    if chosen is None:
        raise ValueError("the logits are not all finite: no token can be drawn")
    return chosen


def choose_batch(logits, rows, threads: int | None = None) -> list:
    """choose() of every row of logits (M, V) at once: rows[i] = (Sampling, tokens drawn so
    far, generator) of row i; the tokens drawn together (flow/generate.sample_batch, on
    `threads` threads).
    [(token, Logprob or None)], None for a row whose logits are not all finite (its
    request's fault alone: choose() on that row raises)."""
    x = np.asarray(logits)
    changed = [i for i, (sp, _, _) in enumerate(rows)
               if sp.logit_bias or sp.presence_penalty or sp.frequency_penalty]
    if changed:                 # float64 copies only for requests that change their logits
        x = np.array(x, np.float64)
        for i in changed:
            x[i] = adjusted(x[i], rows[i][0], rows[i][1])
    tokens = sample_batch(x, [sp.temperature for sp, _, _ in rows],
                          [sp.top_k for sp, _, _ in rows], [rng for _, _, rng in rows],
                          [sp.top_p for sp, _, _ in rows], threads)
    return [None if t < 0 else
            (int(t), score(logits[i], t, sp.logprobs) if sp.logprobs is not None else None)
            for i, (t, (sp, _, _)) in enumerate(zip(tokens, rows))]


# ---- request fields

def _bad(message, param):
    return BadRequest(message, param)


def _penalty(obj, name) -> float:
    v = obj.get(name)
    if v is None:
        return 0.0
    if (isinstance(v, bool) or not isinstance(v, (int, float))
            or not -MAX_PENALTY <= v <= MAX_PENALTY):
        raise _bad(f"{name} must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got "
                   f"{json.dumps(v)}", name)
    return float(v)


def parse_fields(obj: dict, V: int, logprobs, limit: int) -> dict:
    """The Sampling fields of scoring from a request body (BadRequest names the field):
    logprobs, the top count asked for (None: no log-probabilities; already read from the
    body's own field by the caller, which knows its API), checked against limit."""
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                 or not 0 <= logprobs <= limit):
        raise _bad(f"logprobs must be an integer in 0..{limit} (the most likely tokens "
                   f"listed at each place), got {json.dumps(logprobs)}", "logprobs")
    bias = obj.get("logit_bias")
    pairs = []
    if bias is not None:
        if not isinstance(bias, dict):
            raise _bad(f"logit_bias must be an object mapping token ids to a bias in "
                       f"[-{MAX_BIAS:g}, {MAX_BIAS:g}], got {json.dumps(bias)}", "logit_bias")
        for key, value in bias.items():
            # ASCII digits only (str.isdigit takes "²", which int() refuses), at most 9
            if not (re.fullmatch(r"[0-9]{1,9}", key) and int(key) < V):
                raise _bad(f"logit_bias key {key!r} is not a token id in [0, {V})",
                           "logit_bias")
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not -MAX_BIAS <= value <= MAX_BIAS):
                raise _bad(f"logit_bias[{key!r}] must be a number in [-{MAX_BIAS:g}, "
                           f"{MAX_BIAS:g}], got {json.dumps(value)}", "logit_bias")
            pairs.append((int(key), float(value)))
    return {"logprobs": logprobs, "logit_bias": tuple(pairs),
            "presence_penalty": _penalty(obj, "presence_penalty"),
            "frequency_penalty": _penalty(obj, "frequency_penalty")}


# ---- the response objects

def _token_text(tokenizer, token: int) -> str:
    """A token as text; a token that is not whole UTF-8 characters as its bytes, written
    bytes:\\xNN... (OpenAI's form)."""
    raw = tokenizer.decode_bytes([token])
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class TextOffsets:
    """text_offset of a choice's tokens, one after the other: where each token's text starts in
    the text the client gets, in characters. That text holds back the bytes of a character
    split over tokens (GPT-2's byte-level BPE splits emoji and CJK) until the token that
    completes it (engine._Text, through the same StreamDecoder): a token ending inside a
    character moves the offset by the characters it completes, never by a U+FFFD."""

    def __init__(self, tokenizer, start: int):
        self.next = start
        self._stream = StreamDecoder(tokenizer, self._advance)

    def _advance(self, text: str):
        self.next += len(text)

    def __call__(self, token: int) -> int:
        """token's offset; the offset moves on past the characters it completes."""
        at = self.next
        self._stream(token)
        return at


def completion_logprobs(entries, tokenizer, offsets: TextOffsets) -> dict:
    """The completions API's logprobs object of a choice's scored tokens; offsets: the
    choice's TextOffsets, at the text offset of the first (0 with echo, else the prompt's
    length; streamed, where the event's first token is)."""
    return {"tokens": [_token_text(tokenizer, e.token) for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [None if e.logprob is None else
                             {_token_text(tokenizer, t): lp for t, lp in e.top}
                             for e in entries],
            "text_offset": [offsets(e.token) for e in entries]}


def chat_logprobs(entries, tokenizer) -> dict:
    """The chat API's logprobs object of a choice's tokens."""
    def one(token, lp):
        return {"token": _token_text(tokenizer, token), "logprob": lp,
                "bytes": list(tokenizer.decode_bytes([token]))}
    return {"content": [dict(one(e.token, e.logprob),
                             top_logprobs=[one(t, lp) for t, lp in e.top])
                        for e in entries]}
