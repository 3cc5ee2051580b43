"""OpenAI's completions API, as far as it applies here: a request body checked field by field
into engine requests, and the response objects. No HTTP here (serve/app.py).

POST /v1/completions takes OpenAI's fields: model, prompt (a string, a list of strings, a
list of token ids or a list of such lists), max_tokens (default 16), temperature (default 1;
0: greedy), top_p, n, stop (a string or up to 4), seed, stream, stream_options
({"include_usage": true}), echo, user, and the scoring fields (serve/scoring.py): logprobs
(0..5), presence_penalty, frequency_penalty, logit_bias; echo with max_tokens 0 scores the
prompt; and two of vLLM's: top_k (0 or -1: all tokens) and ignore_eos. Fields OpenAI has and
this server does not implement (suffix, best_of) are accepted only at their neutral value
(null, 1). Anything else, and every value out of range, is an error with one message naming
the field (BadRequest: HTTP 400; an unknown model: 404). The chat API (serve/chat.py) is
checked through the same function.
"""
from __future__ import annotations

import functools
import json
import math
import re
import time
import uuid

import numpy as np

from ..errors import StarpuLLMError
from ..flow.generate import Generating
from ..plan.settings import check_setting
from . import scoring
from .errors import BadRequest
from .engine import Sampling

DEFAULT_MAX_TOKENS = 16     # OpenAI's default for completions
MAX_STOP = 4                # OpenAI's limit on stop strings
# Arrays and objects nested deeper are refused before parsing (Python's parser recurses: 1100
# brackets were a RecursionError); the API's deepest body (a chat message's content parts)
# nests far less.
MAX_DEPTH = 16
# Integers of more digits are refused as they are parsed: the widest value a field takes is a
# seed (20 digits), and converting a long digit string costs time quadratic in its length
# (Python refuses beyond 4300 digits, with a message about its own internals).
MAX_DIGITS = 100
_DIGITS = re.compile(rb"[0-9]{%d}" % (MAX_DIGITS + 1))


# name -> the neutral value: OpenAI fields accepted only at it (not implemented here)
_NEUTRAL = {"suffix": None, "best_of": 1}
_FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stop",
           "seed", "stream", "stream_options", "echo", "user", "ignore_eos", "logprobs",
           "logit_bias", "presence_penalty", "frequency_penalty"} | set(_NEUTRAL)


class Choice:
    """One sequence a request asks for: its prompt (ids and text) and index; first: the first
    choice of its prompt (the usage counts a prompt once, whatever n)."""

    def __init__(self, index: int, ids: list, text: str, first: bool = True):
        self.index, self.ids, self.text, self.first = index, ids, text, first


class Completion:
    """A checked completion request: its choices (prompts x n), their Sampling, the seed of
    each choice's generator, and the response's settings."""
    default_max_tokens = DEFAULT_MAX_TOKENS    # None: the rest of the context (chat's)

    def __init__(self, model, choices, sampling, seed, stream, include_usage, echo):
        self.model, self.choices, self.sampling = model, choices, sampling
        self.seed, self.stream, self.include_usage, self.echo = seed, stream, include_usage, echo
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._offsets: dict = {}     # streamed: choice index -> its scoring.TextOffsets

    def rng(self, k: int):
        """Choice k's generator: with a seed, choice 0 draws as `starpu-llm generate --seed`
        (numpy's default_rng(seed)), choice k > 0 from the seed's k-th child sequence."""
        if self.seed is None:
            return np.random.default_rng()
        if k == 0:
            return np.random.default_rng(self.seed)
        return np.random.default_rng(np.random.SeedSequence(self.seed, spawn_key=(k,)))

    def chunk(self, index: int, text: str, finish=None, logprobs=()) -> dict:
        """A server-sent event's object: a piece of choice index's text (and the scores of
        its tokens, scoring.Logprob, when the request asks for them; null in an event without
        tokens; their text_offset runs on from the choice's last event, as in the whole
        answer)."""
        lp = None
        if self.sampling.logprobs is not None and logprobs:
            if index not in self._offsets:
                self._offsets[index] = self._text_offsets(self.choices[index])
            lp = scoring.completion_logprobs(logprobs, self.tokenizer, self._offsets[index])
        out = {"id": self.id, "object": "text_completion", "created": self.created,
               "model": self.model,
               "choices": [{"index": index, "text": text, "logprobs": lp,
                            "finish_reason": finish}]}
        if self.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": [],
                "usage": usage(prompt_tokens, completion_tokens)}

    def response(self, texts, finishes, prompt_tokens: int, completion_tokens: int,
                 logprobs=None) -> dict:
        """logprobs: each choice's scoring.Logprob list (with echo, the prompt's from its
        second token first)."""
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model,
                "choices": [{"index": c.index, "text": (c.text if self.echo else "") + t,
                             "logprobs": self._logprobs(c, logprobs[k] if logprobs else []),
                             "finish_reason": f}
                            for k, (c, t, f) in enumerate(zip(self.choices, texts, finishes))],
                "usage": usage(prompt_tokens, completion_tokens)}

    def _text_offsets(self, choice: Choice) -> scoring.TextOffsets:
        """A new scoring.TextOffsets of choice's scored tokens, at the first one's place in
        the text the client gets: 0 with echo (the prompt's own tokens are scored first; a
        stream never has both, parse_completion refuses it), else the prompt's end."""
        return scoring.TextOffsets(self.tokenizer, 0 if self.echo else len(choice.text))

    def _logprobs(self, choice, entries):
        if self.sampling.logprobs is None:
            return None
        if self.echo:       # the prompt's first token has no score (nothing before it), as
            entries = [scoring.Logprob(choice.ids[0], None), *entries]    # in OpenAI's API
        return scoring.completion_logprobs(entries, self.tokenizer, self._text_offsets(choice))


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def models(model: str, created: int) -> dict:
    return {"object": "list", "data": [model_card(model, created)]}


def model_card(model: str, created: int) -> dict:
    return {"id": model, "object": "model", "created": created, "owned_by": "starpu-llm"}


# ---- checking a request

def _reject_constant(name):
    raise ValueError(f"{name} is not a JSON number")


class _Long:
    """An integer of more than MAX_DIGITS digits, as parse_json's hooks leave it: in place of
    the integer, and of each object holding it; `where` is the path to it from there
    (".seed", ".prompt[3]")."""

    def __init__(self, where: str = ""):
        self.where = where


def _long_in(v) -> str | None:
    """The path to a _Long in v, a parsed value (its arrays searched; its objects, parsed
    before, are one themselves if they held it), or None."""
    if isinstance(v, _Long):
        return v.where
    if isinstance(v, list):
        for i, x in enumerate(v):
            where = _long_in(x)
            if where is not None:
                return f"[{i}]{where}"
    return None


def max_values(max_batch: int, cache_len: int, V: int) -> int:
    """The most JSON values a request body may hold (parse_json's max_values): max_batch
    prompts of cache_len token ids, a logit_bias over the whole vocabulary, and room for the
    other fields."""
    return max_batch * cache_len + V + 1024


_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')     # a JSON string (unrolled: no backtracking)
_BRACKETS = np.zeros(256, np.int32)
_BRACKETS[[0x5B, 0x7B]], _BRACKETS[[0x5D, 0x7D]] = 1, -1       # [ { open, ] } close
_CHUNK = 1 << 18


def _nesting(bare: bytes) -> int:
    """The deepest nesting of arrays and objects in a JSON text without strings (a running
    sum of its brackets, 256 KiB at a time: neither recursion nor Python objects)."""
    depth = deepest = 0
    for start in range(0, len(bare), _CHUNK):
        a = np.frombuffer(bare, np.uint8, min(_CHUNK, len(bare) - start), start)
        run = np.cumsum(_BRACKETS[a]) + depth
        deepest, depth = max(deepest, int(run.max())), int(run[-1])
    return deepest


def parse_json(body: bytes, max_values: int | None = None) -> dict:
    """The request body as a JSON object (BadRequest for anything else). Before it is parsed:
    nesting deeper than MAX_DEPTH is refused, and with max_values (api.max_values) a body of
    more values, so that a prompt of millions of token ids is refused in milliseconds instead
    of becoming millions of Python integers. An integer of more than MAX_DIGITS digits is
    refused naming its field."""
    bare = _STRING.sub(b'""', body)       # the brackets and commas of strings left out
    values = bare.count(b",") + 1         # about: every member of a container but its first
    if max_values is not None and values > max_values:
        raise BadRequest(f"the request body holds {values} JSON values, more than a request "
                         f"to this server can use ({max_values}: --max-batch prompts of maxT "
                         f"token ids and the other fields); send fewer or shorter prompts",
                         "prompt")
    if bare.count(b"[") + bare.count(b"{") > MAX_DEPTH:     # else it cannot nest deeper
        deepest = _nesting(bare)
        if deepest > MAX_DEPTH:
            raise BadRequest(f"the request body nests arrays and objects {deepest} deep; this "
                             f"API takes at most {MAX_DEPTH} levels")
    longs = _DIGITS.search(bare) is not None      # of a number: the strings are left out
    del bare
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(f"the request body is not valid UTF-8 (byte 0x{body[e.start]:02x} at "
                         f"offset {e.start}); send the JSON encoded in UTF-8") from None
    try:
        obj = (json.loads(text, parse_constant=_reject_constant) if not longs else
               _parse_with_longs(text))
    except (json.JSONDecodeError, ValueError, RecursionError) as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise BadRequest(f"the request body must be a JSON object, got {_json_kind(obj)}")
    return obj


def _parse_with_longs(text: str):
    """text parsed (json.loads) when it holds a run of more than MAX_DIGITS digits: BadRequest
    naming the field of the first integer that long (a float that long is parsed)."""
    digits = []             # of each integer over MAX_DIGITS, in the order parsed

    def integer(s: str):
        n = len(s) - s.startswith("-")
        if n <= MAX_DIGITS:
            return int(s)
        digits.append(n)
        return _Long()

    def members(pairs):
        for k, v in pairs:
            where = _long_in(v)
            if where is not None:
                return _Long(f".{k}{where}")
        return dict(pairs)
    obj = json.loads(text, parse_constant=_reject_constant, parse_int=integer,
                     object_pairs_hook=members)
    where = _long_in(obj)
    if where is None:
        return obj
    field = where[1:] if where.startswith(".") else None      # else not in an object
    raise BadRequest(f"{field + ' is' if field else 'the request body holds'} an integer of "
                     f"{digits[0]} digits; this API takes integers of at most {MAX_DIGITS} "
                     f"digits (a seed has at most 20)",
                     field and re.match(r"[^.\[]*", field).group())


def _json_kind(v) -> str:
    """What a parsed JSON value is, in JSON's words (null, an array, ...)."""
    if v is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string",
            list: "an array", dict: "an object"}.get(type(v), type(v).__name__)


def _int(obj, name, default, low=None, high=None):
    v = obj.get(name, default)
    if v is None:
        v = default
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"{name} must be an integer, got {json.dumps(v)}", name)
    if (low is not None and v < low) or (high is not None and v > high):
        rule = (f">= {low}" if high is None else f"<= {high}" if low is None
                else f"in {low}..{high}")
        raise BadRequest(f"{name} must be {rule}, got {v}", name)
    return v


def _number(obj, name, default):
    v = obj.get(name, default)
    if v is None:
        v = default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise BadRequest(f"{name} must be a number, got {json.dumps(v)}", name)
    return float(v)


def _sampling(obj, name, default):
    """A number of the sampling (temperature, top_p) under the rule of generate's flag of that
    name (flow/generate.Generating: one statement of it)."""
    v = _number(obj, name, default)
    try:
        check_setting(Generating, name, v)
    except StarpuLLMError as e:
        raise BadRequest(str(e), name) from None
    return v


def _bool(obj, name, default=False):
    v = obj.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise BadRequest(f"{name} must be true or false, got {json.dumps(v)}", name)
    return v


def _utf8(s: str, name: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest(f"{name} holds a lone surrogate (\\ud800-\\udfff), which is not "
                         "text; send valid Unicode", name) from None
    return s


@functools.lru_cache(maxsize=None)
def _longest_token(tokenizer) -> int:
    """The most bytes (so characters) one token of tokenizer stands for."""
    return max(len(b) for b in tokenizer.token_bytes)


def _too_long(n: int, cache_len: int) -> BadRequest:
    return BadRequest(f"the prompt has {n} tokens: a prompt and its completion must fit the "
                      f"model's maximum sequence length (maxT = {cache_len}); shorten the "
                      f"prompt", "prompt")


def _prompts(v, tokenizer, V: int, cache_len: int | None = None) -> list:
    """[(ids, text)] of the prompt field. With cache_len, a prompt that cannot fit is refused
    before it is encoded or decoded: token ids by their count, a text by its characters (a
    token stands for at most _longest_token of them)."""
    def ids_of(x, where):
        if isinstance(x, str):
            text = _utf8(x, where)
            if cache_len is not None and len(text) > cache_len * _longest_token(tokenizer):
                raise BadRequest(f"{where} has {len(text)} characters, more than the model's "
                                 f"maximum sequence length (maxT = {cache_len} tokens) can "
                                 f"hold; shorten the prompt", "prompt")
            return (tokenizer.encode(text) if text else [tokenizer.eot]), text
        if isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool)
                                             for t in x):
            if cache_len is not None and len(x) > cache_len:
                raise _too_long(len(x), cache_len)
            bad = [t for t in x if not 0 <= t < V]
            if bad:
                raise BadRequest(f"{where} holds token id {bad[0]}: ids must be in [0, {V})",
                                 "prompt")
            return list(x), tokenizer.decode(x)
        raise BadRequest(f"{where} must be a string or a non-empty list of token ids",
                         "prompt")

    if v is None:
        raise BadRequest("prompt is required: a string, a list of strings, a list of token "
                         "ids or a list of such lists", "prompt")
    if isinstance(v, str) or (isinstance(v, list) and v and isinstance(v[0], int)):
        return [ids_of(v, "prompt")]
    if isinstance(v, list) and v:
        return [ids_of(x, f"prompt[{i}]") for i, x in enumerate(v)]
    raise BadRequest("prompt must be a string, a list of strings, a list of token ids or a "
                     "list of such lists (not empty)", "prompt")


def parse_completion(obj: dict, model: str, tokenizer, V: int, cache_len: int,
                     max_batch: int, max_logprobs: int = scoring.MAX_COMPLETION_LOGPROBS,
                     kind=None) -> Completion:
    """A completion request's body (parse_json's object) checked: BadRequest names the first
    field in error. cache_len: the positions a sequence may reach (prompt + max_tokens);
    max_batch: the most choices (prompts x n) one request may ask for; max_logprobs: the
    most logprobs asked for; kind: the Completion class made (chat: serve/chat.py; its
    default_max_tokens is the default of max_tokens)."""
    kind = kind or Completion
    unknown = sorted(set(obj) - _FIELDS)
    if unknown:
        raise BadRequest(f"unknown field {unknown[0]!r}; this server takes "
                         f"{', '.join(sorted(_FIELDS))}", unknown[0])
    for name, neutral in _NEUTRAL.items():     # (true == 1 in Python: best_of true is not 1)
        if name in obj and obj[name] is not None and (obj[name] != neutral
                                                      or isinstance(obj[name], bool)):
            raise BadRequest(f"{name} is not supported by this server (leave it out, or "
                             f"{json.dumps(neutral)})", name)
    if obj.get("model") is None:
        raise BadRequest(f"model is required (this server serves {model!r})", "model")
    if not isinstance(obj["model"], str):
        raise BadRequest(f"model must be a string, got {json.dumps(obj['model'])} (this server "
                         f"serves {model!r})", "model")
    if obj["model"] != model:
        raise BadRequest(f"the model {obj['model']!r} does not exist: this server serves "
                         f"{model!r} (GET /v1/models)", "model", 404, "model_not_found")
    prompts = _prompts(obj.get("prompt"), tokenizer, V, cache_len)
    n = _int(obj, "n", 1, low=1)
    if len(prompts) * n > max_batch:
        raise BadRequest(f"{len(prompts)} prompt(s) x n {n} = {len(prompts) * n} sequences, "
                         f"more than this server runs at once ({max_batch}, its --max-batch)",
                         "n")
    longest = max(len(ids) for ids, _ in prompts)
    if longest >= cache_len:
        raise _too_long(longest, cache_len)
    echo = _bool(obj, "echo")
    # max_tokens 0 with echo: the prompt alone (scored with logprobs), as OpenAI's API takes it
    fits = cache_len - longest
    max_tokens = _int(obj, "max_tokens", fits if kind.default_max_tokens is None
                      else min(kind.default_max_tokens, fits), low=0 if echo else 1)
    if longest + max_tokens > cache_len:
        raise BadRequest(f"the prompt ({longest} tokens) + max_tokens {max_tokens} = "
                         f"{longest + max_tokens} tokens exceed the model's maximum sequence "
                         f"length (maxT = {cache_len}); lower max_tokens to at most "
                         f"{cache_len - longest}", "max_tokens")
    temperature = _sampling(obj, "temperature", 1.0)
    top_p = _sampling(obj, "top_p", 1.0)
    top_k = min(_int(obj, "top_k", 0, low=-1), V)     # V or more: every token
    stop = obj.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if (not isinstance(stop, list) or len(stop) > MAX_STOP
            or not all(isinstance(s, str) and s for s in stop)):
        raise BadRequest(f"stop must be a non-empty string or a list of at most {MAX_STOP} "
                         f"of them, got {json.dumps(obj.get('stop'))}", "stop")
    seed = obj.get("seed")
    if seed is not None:        # -1: no seed, as llama.cpp's and vLLM's servers take it
        seed = _int(obj, "seed", None, low=-1, high=2 ** 64 - 1)
        seed = None if seed == -1 else seed
    stream = _bool(obj, "stream")
    options = obj.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise BadRequest("stream_options is only allowed with stream: true",
                             "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise BadRequest('stream_options must be {"include_usage": true|false}',
                             "stream_options")
        include_usage = _bool(options, "include_usage")
    user = obj.get("user")
    if user is not None and not isinstance(user, str):
        raise BadRequest(f"user must be a string, got {json.dumps(user)}", "user")
    scored = scoring.parse_fields(obj, V, obj.get("logprobs"), max_logprobs)
    if echo and stream and scored["logprobs"] is not None:
        raise BadRequest("echo with logprobs is answered whole: set stream to false",
                         "stream")
    sampling = Sampling(max_tokens=max_tokens, temperature=temperature,
                        top_k=0 if top_k == -1 else top_k, top_p=top_p,
                        stop=tuple(_utf8(s, "stop") for s in stop),
                        ignore_eos=_bool(obj, "ignore_eos"),
                        prompt_logprobs=echo and scored["logprobs"] is not None, **scored)
    choices = [Choice(i * n + j, ids, text, j == 0) for i, (ids, text) in enumerate(prompts)
               for j in range(n)]
    c = kind(model, choices, sampling, seed, stream, include_usage, echo)
    c.tokenizer = tokenizer
    return c
