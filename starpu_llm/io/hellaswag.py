"""HellaSwag's validation file (hellaswag_val.jsonl: one JSON object a line with "ctx", the
4 "endings" and the correct one's index "label"), tokenized, and the rows the model scores.

Each example makes 4 rows, context + ending, with the GPT-2 tokens of ctx and of " " + ending
(the ending follows the context after a space). A row longer than T (the model's maxT) loses
the context's first tokens; an ending of T tokens or more keeps its first T - 1 (one context
token stays to predict its first). HellaSwag's longest row is far below GPT-2's 1024.
"""
from __future__ import annotations

import json
from typing import NamedTuple

from ..errors import StarpuLLMError

ENDINGS = 4
FORMAT = ("HellaSwag's jsonl, one example a line: {\"ctx\": text, \"endings\": 4 texts, "
          "\"label\": 0..3} (as hellaswag_val.jsonl)")


class Example(NamedTuple):
    context: tuple          # token ids of ctx
    endings: tuple          # ENDINGS tuples of token ids, each of " " + ending
    label: int              # the correct ending's index


class Row(NamedTuple):
    """One ending after its context, as the model reads it: tokens (at most T), the position
    whose next-token loss scores the ending's first token (start), and the ending's tokens
    scored (n: positions start .. start + n - 1)."""
    tokens: tuple
    start: int
    n: int


def _bad(path: str, line: int, what: str) -> StarpuLLMError:
    return StarpuLLMError(f"{path}:{line}: {what}; give {FORMAT}")


def _fields(path: str, line: int, text: str) -> tuple[str, list, int]:
    """ctx, endings and label of one line, each checked."""
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise _bad(path, line, f"not JSON ({e})") from None
    if not isinstance(obj, dict):
        raise _bad(path, line, f"a JSON {type(obj).__name__}, not an object")
    for name in ("ctx", "endings", "label"):
        if name not in obj:
            raise _bad(path, line, f"no field \"{name}\"")
    ctx, endings, label = obj["ctx"], obj["endings"], obj["label"]
    if not isinstance(ctx, str) or not ctx:
        raise _bad(path, line, f"\"ctx\" must be a text, not empty, got {json.dumps(ctx)[:80]}")
    if (not isinstance(endings, list) or len(endings) != ENDINGS
            or not all(isinstance(e, str) for e in endings)):
        got = (f"{len(endings)} item(s)" if isinstance(endings, list)
               else json.dumps(endings)[:80])
        raise _bad(path, line, f"\"endings\" must be a list of {ENDINGS} texts, got {got}")
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < ENDINGS:
        raise _bad(path, line, f"\"label\" must be an integer in 0..{ENDINGS - 1}, got "
                               f"{json.dumps(label)}")
    return ctx, endings, label


def read(path: str, tokenizer, limit: int | None = None) -> list[Example]:
    """The first `limit` examples of the file at path (None: all), tokenized with tokenizer
    (GPT-2's). Blank lines are skipped; any other bad line is an error naming the file and
    the line, as is a file without examples."""
    examples = []
    try:
        with open(path, encoding="utf-8") as f:
            for number, text in enumerate(f, 1):
                if limit is not None and len(examples) == limit:
                    break
                if not text.strip():
                    continue
                ctx, endings, label = _fields(path, number, text)
                examples.append(Example(tuple(tokenizer.encode(ctx)),
                                        tuple(tuple(tokenizer.encode(" " + e)) for e in endings),
                                        label))
    except OSError as e:
        raise StarpuLLMError(f"cannot read {path}: {e.strerror or e}; give {FORMAT}") from None
    except UnicodeDecodeError as e:
        raise StarpuLLMError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); give "
                             f"{FORMAT}") from None
    if not examples:
        raise StarpuLLMError(f"{path} holds no example; give {FORMAT}")
    return examples


def row(context, ending, T: int) -> Row:
    """The row of ending after context in at most T tokens (the module says what is cut)."""
    ending = tuple(ending[:T - 1])
    context = tuple(context[-(T - len(ending)):])
    return Row(context + ending, len(context) - 1, len(ending))


def length(examples) -> int:
    """The longest row of the examples, uncut."""
    return max(len(x.context) + len(e) for x in examples for e in x.endings)
