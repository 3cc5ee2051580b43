"""The relative links of the README and docs/ that lead nowhere. Usage: python tools/doc_links.py
[ROOT]; prints each broken link as FILE:LINE: TARGET (why); exit status 1 when there is one.

A link is [text](target) or ![alt](target) outside code (fenced blocks and `spans`); web
addresses are not followed. A target is a file or folder relative to the linking file, with an
optional #anchor, which must be a heading of the .md file it names (or of the linking file
when the target is #anchor alone), spelt as GitHub spells it: lower case, punctuation but
hyphens and underscores dropped, each space a hyphen, "-1", "-2" ... after a repeated one.
A reference to raw data (a link, or a `span` path from the root, under experiments/results/ or
docs/figures/) must name something that exists, and each CSV it names (or holds, for a folder)
a header row and a data row.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

# within a paragraph: a link's text, and a `span`, may go on over a line break (the README wraps
# them), never over a blank line
_IN = r"(?:[^\n{}]|\n(?![ \t]*\n))"
LINK = re.compile(r"!?\[(?:" + _IN.format(r"\[\]") + r"|\[[^\]]*\])*\]"
                  r"\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
SPAN = re.compile("`" + _IN.format("`") + "*`")
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


def _unfenced(text: str) -> str:
    """The text with its fenced blocks blanked, line for line."""
    lines, fenced = [], False
    for line in text.split("\n"):
        if FENCE.match(line):
            fenced = not fenced
            line = ""
        lines.append("" if fenced else line)
    return "\n".join(lines)


def _links(text: str):
    """(line number, target) of each link outside code: fenced blocks and `spans` blanked
    (their line breaks kept, so that a link's line is its first line's)."""
    prose = SPAN.sub(lambda m: "``" + "\n" * m.group().count("\n"), _unfenced(text))
    for m in LINK.finditer(prose):
        yield prose.count("\n", 0, m.start()) + 1, m.group(1)


def anchors(text: str) -> set:
    """The #anchors GitHub gives the headings of a Markdown text."""
    seen, found = {}, set()
    fenced = False
    for line in text.split("\n"):
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else HEADING.match(line)
        if not m:
            continue
        title = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1))   # a link: its text
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def broken_links(root: Path, files=None) -> list:
    """[(file relative to root, line, target, why)] over README.md and docs/*.md (or files)."""
    root = Path(root)
    files = files if files is not None else [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    headings = {}

    def heads(path: Path) -> set:
        if path not in headings:
            headings[path] = anchors(path.read_text())
        return headings[path]

    broken = []
    for f in files:
        for number, target in _links(f.read_text()):
            if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):     # http:, mailto:, ...
                continue
            path, _, anchor = target.partition("#")
            dest = (f.parent / path).resolve() if path else f
            where = (str(f.relative_to(root)), number, target)
            if not dest.exists():
                broken.append((*where, "no such file"))
            elif anchor and dest.suffix == ".md" and anchor not in heads(dest):
                broken.append((*where, f"no heading #{anchor} in {dest.name}"))
    return broken


# where raw data lives (the standard: the raw CSV beside every number quoted); a path in a
# `span` that starts so is taken from the repository root, as the docs write them
RAW = ("experiments/results/", "docs/figures/")


def _raw_refs(root: Path, f: Path):
    """(line, target, path) of each reference of f to raw data: a link resolving under a RAW
    folder, or a `span` naming a path from the root that starts with one (a `<placeholder>`
    span skipped: it names a kind of folder, not one)."""
    text = f.read_text()
    for number, target in _links(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):
            continue
        path = (f.parent / target.partition("#")[0]).resolve()
        if any((root / r).resolve() in (path, *path.parents) for r in RAW):
            yield number, target, path
    text = _unfenced(text)
    for m in SPAN.finditer(text):
        span = m.group()[1:-1].strip()
        if span.startswith(RAW) and "<" not in span and " " not in span:
            yield text.count("\n", 0, m.start()) + 1, span, root / span


def _csv_problem(path: Path):
    """Why a raw CSV holds no data (None when it has a header row and a data row)."""
    rows = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    if not rows:
        return "empty CSV"
    if "," not in rows[0]:
        return "CSV without a header row"
    if len(rows) < 2:
        return "CSV with a header and no data row"
    return None


def raw_data_problems(root: Path, files=None) -> list:
    """[(file, line, target, why)] for each reference to raw data (links and `spans`, RAW) over
    README.md and docs/*.md (or files) that names nothing, or a CSV without a header and a data
    row; a folder's CSVs (below it too) and a glob's matches are each checked."""
    root = Path(root)
    files = files if files is not None else [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    problems = []
    for f in files:
        for number, target, path in _raw_refs(root, f):
            where = (str(f.relative_to(root)), number, target)
            matches = sorted(root.glob(str(path.relative_to(root)))) if "*" in str(path) else \
                [path] if path.exists() else []
            if not matches:
                problems.append((*where, "no such file"))
                continue
            csvs = [c for m in matches for c in ([m] if m.is_file() else sorted(m.rglob("*")))
                    if c.suffix == ".csv"]
            problems += [(*where, f"{c.relative_to(root)}: {why}") for c in csvs
                         if (why := _csv_problem(c))]
    return problems


def main(argv) -> int:
    root = Path(argv[1] if len(argv) > 1 else Path(__file__).resolve().parent.parent)
    broken = broken_links(root) + raw_data_problems(root)
    for f, number, target, why in broken:
        print(f"{f}:{number}: {target} ({why})")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
