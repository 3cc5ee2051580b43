"""Print the import circles among the modules of starpu_llm/ and experiments/; exit 1 if any.

Every import counts, at module top or inside a function (an import inside a function is an
arrow too, only a hidden one). Read from the source with ast, nothing imported:

    python tools/import_graph.py [ROOT]            (ROOT: the repository, default: this one's)
    python tools/import_graph.py --edges [ROOT]    (also print every arrow, one a line)
"""
from __future__ import annotations

import ast
import os
import sys

TREES = {"starpu_llm": "starpu_llm", "experiments": ""}   # folder: its modules' package prefix


def modules(root: str) -> dict[str, str]:
    """{module name: file} of the trees. experiments/ scripts import each other by their bare
    names (the folder is on sys.path when they run), so they are named so."""
    out = {}
    for folder, package in TREES.items():
        for dirpath, _, files in os.walk(os.path.join(root, folder)):
            for f in files:
                if not f.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, f), os.path.join(root, folder))
                parts = rel[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                name = ".".join(([package] if package else []) + parts)
                out[name] = os.path.join(dirpath, f)
    return out


def imported(name: str, path: str, known: dict) -> set[str]:
    """The modules of `known` that the module `name` (file path) imports."""
    is_package = os.path.basename(path) == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    out = set()

    def add(target):
        # a name imported from a module may be a submodule (from . import x) or an attribute
        # (from .x import f): the longest known module it names
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            out.add(target)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                add(a.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")
                up = up[:len(up) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            for a in node.names:
                add(f"{base}.{a.name}" if base else a.name)
    return out


def cycles(graph: dict[str, set]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted:
    every circle of the graph lies inside one of them."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def graph_of(root: str) -> dict[str, set]:
    known = modules(root)
    return {name: imported(name, path, known) for name, path in known.items()}


def main(argv: list[str]) -> int:
    edges = "--edges" in argv
    args = [a for a in argv if a != "--edges"]
    root = args[0] if args else os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    graph = graph_of(root)
    if edges:
        for a in sorted(graph):
            for b in sorted(graph[a]):
                print(f"{a} -> {b}")
    found = cycles(graph)
    for comp in found:
        arrows = [f"{a} -> {b}" for a in comp for b in sorted(graph[a]) if b in comp]
        print(f"import circle among {', '.join(comp)}: {'; '.join(arrows)}")
    if not found:
        print(f"no import circle among the {len(graph)} modules of {', '.join(TREES)}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
