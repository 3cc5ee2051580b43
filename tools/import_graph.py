"""Print the import circles among the modules of starpu_llm/ and experiments/, and every arrow
that goes up the layer order (LAYERS); exit 1 if any.

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

# The layers of starpu_llm, lowest first (the one place that states them; docs/design.md
# "Layers" says what each does). A module may import its own layer and those below, never one
# above. "room/" is a subpackage, with all its modules; a plain name is a module of the package
# root ("__init__": the package itself, also what an import of the compiled _clib/_kernels
# resolves to). experiments/ stands above them all. A module in no layer is an error: a new
# room or root file is placed here first.
LAYERS = [
    ("base", ["__init__", "errors", "signals"]),   # process-wide: the error type, the signals
    ("model", ["model/"]),         # GPT-2's configuration, parameter layout, a run's state
    ("baselines", ["baselines/"]),  # the PyTorch GPT-2 (tests' oracle, bench's series)
    ("plan", ["plan/"]),           # settings, the partition, ownership, task sites, the record
    ("io", ["io/"]),               # file formats, tokenizer, data, checkpoints
    ("kernels", ["kernels/"]),     # the codelet table read from C
    ("runtime", ["runtime/"]),     # StarPU (cffi or starpupy), MPI, offload
    ("flow", ["flow/"]),           # the task flow of a step, decode, the reference engine
    ("perf", ["perf/"]),           # the performance model, calibration, autotuner, runs
    ("training", ["training/"]),      # the trainer and what watches it
    ("serve", ["serve/"]),         # the HTTP server's engine and API
    ("entry", ["__main__", "cli", "cli_generate", "cli_serve", "bench"]),   # the commands
]


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


def layer_of(name: str) -> int | None:
    """The index in LAYERS of module `name` (experiments' modules: above them all)."""
    if name != "starpu_llm" and not name.startswith("starpu_llm."):
        return len(LAYERS)
    rel = name[len("starpu_llm."):] if name != "starpu_llm" else "__init__"
    for i, (_, members) in enumerate(LAYERS):
        for m in members:
            if (m.endswith("/") and (rel == m[:-1] or rel.startswith(m[:-1] + "."))) or rel == m:
                return i
    return None


def upward(graph: dict[str, set]) -> list[str]:
    """Every arrow from a lower layer to a higher one, and every module in no layer."""
    out = [f"{a} is in no layer: place it in tools/import_graph.py's LAYERS"
           for a in sorted(graph) if layer_of(a) is None]
    for a in sorted(graph):
        for b in sorted(graph[a]):
            la, lb = layer_of(a), layer_of(b)
            if la is not None and lb is not None and lb > la:
                out.append(f"arrow up: {a} ({LAYERS[la][0]}) -> {b} ({LAYERS[lb][0]})")
    return out


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
    up = upward(graph)
    for line in up:
        print(line)
    if not up:
        print(f"every arrow goes down the {len(LAYERS)} layers "
              f"({' < '.join(name for name, _ in LAYERS)})")
    return 1 if found or up else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
