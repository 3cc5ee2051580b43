"""The calls between the C files of csrc/: which file calls a function another file defines,
and any circle among them. Usage: python tools/c_calls.py [CSRC]; prints the file graph and
each circle found; exit status 1 when there is one.

A function counts where it is defined (a non-static definition: its name, its parameters, then
a body); a file calls it where the name is followed by "(" outside comments and strings. A
call through a function pointer (a callback such as sl_codelet_cpu) is no arrow: the caller
does not name the callee.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from import_graph import cycles  # noqa: E402  (the same circle finder as for the imports)

DEFINITION = re.compile(r"^(?!static\b)[A-Za-z_][\w \t\*]*?\b([A-Za-z_]\w*)\s*\(([^;{}]*)\)\s*\{",
                        re.M)
CALL = re.compile(r"\b([A-Za-z_]\w*)\s*\(")


def _code(text: str) -> str:
    """text without comments, string and character literals, or preprocessor lines."""
    text = re.sub(r"/\*.*?\*/|//[^\n]*", " ", text, flags=re.S)
    text = re.sub(r'"(\\.|[^"\\])*"|\'(\\.|[^\'\\])*\'', '""', text)
    return re.sub(r"^[ \t]*#.*(\\\n.*)*", "", text, flags=re.M)


def call_graph(root: Path) -> dict:
    """{file: {file it calls}} over the .c files below root (paths relative to root)."""
    code = {str(p.relative_to(root)): _code(p.read_text()) for p in sorted(root.rglob("*.c"))}
    owner = {}
    for f, text in code.items():
        for m in DEFINITION.finditer(text):
            owner.setdefault(m.group(1), f)
    graph = {}
    for f, text in code.items():
        graph[f] = {owner[n] for n in CALL.findall(text) if n in owner and owner[n] != f}
    return graph


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    root = Path(argv[0] if argv else Path(__file__).resolve().parent.parent / "csrc")
    graph = call_graph(root)
    for f in sorted(graph):
        if graph[f]:
            print(f"{f} -> {', '.join(sorted(graph[f]))}")
    found = cycles(graph)
    for c in found:
        print("circle: " + " <-> ".join(c))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
