"""The task graph of a traced run: the data dependencies StarPU derives from the access modes
(Figure 1), the iterations, and an iteration's critical path (the Gantt charts).

Input: the events of Runtime.trace() as returned by starpu_llm.bench.traced_run (codelet,
worker, cores, start_ns, end_ns, [[handle, mode], ...] or None for a reduction step StarPU ran
inline), and its {handle: tensor name} map. Per handle, the accesses in execution order are
those of submission order wherever they conflict (StarPU orders conflicting accesses in
submission order; only reads between two writes may swap, which changes no dependency), so the
rules of sequential consistency give StarPU's edges:
  read        after the last write (RAW) and after the pending reduction contributions;
  write/RW    after the last write (WAW; RAW for RW), after every read since it (WAR), after the pending
              reduction contributions;
  REDUX       after the last write and the reads since it; contributions are unordered.
"""
from __future__ import annotations

import re
import subprocess
from collections import defaultdict

from starpu_llm.flow.tensors import set_free_name

ACCESS_R, ACCESS_W, ACCESS_REDUX = 1, 2, 4     # csrc/sl_api.h SL_ACCESS_*

PHASES = ("load", "forward", "loss", "backward", "reduction", "update")
PHASE_COLOURS = {"load": "#bdbdbd", "forward": "#6baed6", "loss": "#fd8d3c",
                 "backward": "#74c476", "reduction": "#9e9ac8", "update": "#e6550d"}
KINDS = ("inputs", "targets", "activations", "activation gradients", "gradients", "parameters",
         "optimizer state", "reduction copy", "loss")
KIND_COLOURS = {"inputs": "#636363", "targets": "#d62728", "activations": "#1f77b4",
                "activation gradients": "#2ca02c", "gradients": "#31a354",
                "parameters": "#e6550d", "optimizer state": "#8c6d31",
                "reduction copy": "#756bb1", "loss": "#fd8d3c"}
KIND_SHORT = {"inputs": "in", "targets": "tgt", "activations": "act",
              "activation gradients": "dact", "gradients": "grad", "parameters": "param",
              "optimizer state": "m,v", "reduction copy": "redux", "loss": "loss"}


def phase(codelet: str) -> str:
    if codelet == "load_batch":
        return "load"
    if codelet == "crossentropy_forward":
        return "loss"
    if codelet.endswith("_forward"):
        return "forward"
    if codelet.endswith("_backward"):
        return "backward"
    if codelet == "adamw":
        return "update"
    return "reduction"          # zero, add: StarPU's STARPU_REDUX init and reduction


def handle_kind(name: str | None) -> str:
    """What a handle carries, by its tensor name (engine.tensor_names())."""
    if name is None:
        return "reduction copy"     # a per-worker STARPU_REDUX copy, StarPU's own
    if name.startswith("param."):
        return "parameters"
    if name.startswith("grad."):
        return "gradients"
    if name.startswith(("m.", "v.")):
        return "optimizer state"
    local = name.split(".", 1)[1] if re.match(r"s\d+\.", name) else name
    local = set_free_name(local)     # either set of the losses (steps submitted ahead)
    if local == "inputs":
        return "inputs"
    if local == "targets":
        return "targets"
    if local == "losses":
        return "loss"
    if local.startswith("d") or local == "att_scratch":
        return "activation gradients"
    return "activations"


class Event:
    __slots__ = ("i", "codelet", "worker", "cores", "start", "end", "buffers", "phase")

    def __init__(self, i, raw):
        self.i = i
        self.codelet, self.worker, self.cores, self.start, self.end, bufs = raw[:6]
        self.buffers = None if bufs is None else [(int(h), int(m)) for h, m in bufs]
        self.phase = phase(self.codelet)

    @property
    def ms(self) -> float:
        return (self.end - self.start) / 1e6


def load_events(raw_events) -> list[Event]:
    """Events sorted by start time, numbered in that order."""
    raw = sorted(raw_events, key=lambda e: (e[3], e[4]))
    return [Event(i, e) for i, e in enumerate(raw)]


def iterations(events: list[Event], loads_per_iteration: int) -> list[list[Event]]:
    """The events of each training step: a step waits for all its tasks before the next one is
    submitted, so step j is everything from its first load task on."""
    loads = [e.start for e in events if e.codelet == "load_batch"]
    starts = loads[::loads_per_iteration]
    out = [[] for _ in starts]
    j = 0
    for e in events:
        while j + 1 < len(starts) and e.start >= starts[j + 1]:
            j += 1
        out[j].append(e)
    return out


def dependencies(events: list[Event]):
    """[(src event index, dst event index, handle, "RAW"|"WAR"|"WAW")] among the events (in
    start order), by the rules in the module docstring."""
    state = {}
    edges = []
    for e in events:
        if not e.buffers:
            continue
        for h, mode in e.buffers:
            st = state.setdefault(h, {"w": None, "r": [], "x": []})
            if mode & ACCESS_REDUX:
                if st["w"] is not None:
                    edges.append((st["w"], e.i, h, "WAW"))
                edges += [(r, e.i, h, "WAR") for r in st["r"]]
                st["x"].append(e.i)
            elif mode & ACCESS_W:
                if st["w"] is not None:     # RW reads what the last writer wrote
                    edges.append((st["w"], e.i, h, "RAW" if mode & ACCESS_R else "WAW"))
                edges += [(r, e.i, h, "WAR") for r in st["r"]]
                edges += [(x, e.i, h, "RAW") for x in st["x"]]
                st.update(w=e.i, r=[], x=[])
            elif mode & ACCESS_R:
                if st["w"] is not None:
                    edges.append((st["w"], e.i, h, "RAW"))
                edges += [(x, e.i, h, "RAW") for x in st["x"]]
                st["r"].append(e.i)
    return [(s, d, h, t) for s, d, h, t in edges if s != d]


def critical_path(events: list[Event]):
    """The longest chain of dependent tasks of one iteration, weighted by the tasks' measured
    durations: (list of events on it, its length in ms). It bounds the iteration's time from
    below whatever the number of workers."""
    idx = {e.i: e for e in events}
    preds = defaultdict(set)
    for s, d, _, _ in dependencies(events):
        preds[d].add(s)
    best, via = {}, {}
    for e in events:                      # start order is a topological order
        p = max((best[q], q) for q in preds[e.i]) if preds[e.i] else (0.0, None)
        best[e.i] = p[0] + e.ms
        via[e.i] = p[1]
    if not best:
        return [], 0.0
    end = max(best, key=best.get)
    path = []
    k = end
    while k is not None:
        path.append(idx[k])
        k = via[k]
    return path[::-1], best[end]


# --------------------------------------------------------------------------- Figure 1

def _short(codelet: str) -> str:
    return codelet.replace("_forward", " fwd").replace("_backward", " bwd").replace(
        "crossentropy", "xent").replace("layernorm", "ln").replace("load_batch", "load")


def _label(e: Event, names) -> str:
    """The codelet and the tensor it produces (the gradient for a backward task, the
    parameter for an update)."""
    if not e.buffers:
        return _short(e.codelet)
    named = [(names.get(h), m) for h, m in e.buffers]
    pick = None
    if e.codelet == "adamw":
        pick = named[0][0]
    else:
        grads = [n for n, m in named if n and n.startswith("grad.") and m & (ACCESS_W | ACCESS_REDUX)]
        outs = [n for n, m in named if n and m & ACCESS_W]
        pick = (grads or outs or [named[0][0]])[0]
    pick = re.sub(r"^(s\d+\.|param\.|grad\.)", "", pick or "")
    return f"{_short(e.codelet)}\\n{pick}"


def _layer_of(e: Event, names) -> str:
    """The layer a task belongs to: that of the per-layer tensors it touches ("[l]"), else
    'embedding' (encoder) or 'head' (final layernorm, lm head, loss)."""
    layers = set()
    for h, _ in (e.buffers or []):
        n = names.get(h) or ""
        if n.startswith(("m.", "v.")) or ".wte[" in n:     # wte's row blocks are no layer
            continue
        m = re.search(r"\[(\d+)\]", n)
        if m and not n.split(".")[-1].startswith(("res3", "encoded")):
            layers.add(int(m.group(1)))
    if layers:
        return f"layer {max(layers)}" if e.phase == "backward" else f"layer {min(layers)}"
    if e.codelet.startswith("encoder") or e.codelet == "load_batch":
        return "embedding"
    if e.codelet == "adamw":
        n = names.get(e.buffers[0][0], "")
        return "embedding" if re.sub(r"\[\d+\]$", "", n).endswith(("wte", "wpe")) else "head"
    return "head"


def _reachability(succ):
    """reach[v]: bitmask of the nodes reachable from v (any graph)."""
    reach = []
    for v in range(len(succ)):
        seen, stack = 0, list(succ[v])
        while stack:
            w = stack.pop()
            if not (seen >> w) & 1:
                seen |= 1 << w
                stack.extend(succ[w])
        reach.append(seen)
    return reach


def build_graph(events: list[Event], names: dict, loads_per_iteration: int, collapse: bool):
    """The graph of the second-to-last traced iteration and its edges into the last one.

    Returns (nodes, edges, stats): nodes {id: (label, phase, next_iteration)}, edges
    {(src, dst): {"kinds": set, "types": set, "next": bool}}. With collapse, one node per
    (phase, layer). Edges into the next iteration are kept only where no other path of the
    two-iteration graph already implies them (stats counts both)."""
    its = iterations(events, loads_per_iteration)
    cur, nxt = its[-2], its[-1]
    both = cur + nxt
    in_cur = {e.i for e in cur}
    deps = dependencies(both)

    def key(e: Event):
        if not collapse:
            return e.i
        return (e.phase, "loss" if e.phase == "loss" else _layer_of(e, names))

    order = {}
    for e in both:
        k = (key(e), e.i not in in_cur)
        order.setdefault(k, len(order))
    ev = {e.i: e for e in both}
    nodes = {}
    for e in both:
        k = (key(e), e.i not in in_cur)
        if k not in nodes:
            if collapse:
                ph, layer = k[0]
                label = f"{layer}\\n{ph}" if ph != "loss" else "loss"
            else:
                label = _label(e, names)
            nodes[k] = [label, e.phase, e.i not in in_cur, 0]
        nodes[k][3] += 1
    edges = {}
    for s, d, h, t in deps:
        ks, kd = (key(ev[s]), s not in in_cur), (key(ev[d]), d not in in_cur)
        if ks == kd:
            continue
        a = edges.setdefault((ks, kd), {"kinds": set(), "types": set(), "next": kd[1]})
        a["kinds"].add(handle_kind(names.get(h)))
        a["types"].add(t)
    # Drawn: every read-after-write edge of this iteration (the data flow); an edge into the
    # next iteration, or a WAR/WAW edge (a reused handle), only where no other path of the
    # two-iteration graph implies it. Edges inside the next iteration only serve that test.
    ids = {k: order[k] for k in nodes}
    succ = [[] for _ in ids]
    for (a, b) in edges:
        succ[ids[a]].append(ids[b])
    reach = _reachability(succ)

    def implied(a, b):
        ia, ib = ids[a], ids[b]
        return any(w != ib and (reach[w] >> ib) & 1 for w in succ[ia])

    stats = {"raw": 0, "reuse": 0, "reuse_implied": 0, "next": 0, "next_implied": 0}
    drawn = {}
    for (a, b), attr in edges.items():
        if a[1]:
            continue                                  # inside the next iteration
        if attr["next"]:
            stats["next"] += 1
        elif "RAW" in attr["types"]:
            stats["raw"] += 1
            drawn[(a, b)] = attr
            continue
        else:
            stats["reuse"] += 1
        if implied(a, b):
            stats["next_implied" if attr["next"] else "reuse_implied"] += 1
        else:
            drawn[(a, b)] = attr
    used = {b for (a, b) in drawn}
    nodes = {k: v for k, v in nodes.items() if not k[1] or k in used}
    return nodes, drawn, stats, ids


def write_dot(path: str, title: str, nodes, edges, ids, labels: bool) -> None:
    """Graphviz DOT: tasks coloured by phase, edges coloured and labelled by the data they
    carry; RAW edges solid, WAR/WAW (a handle reused) dotted; the next iteration's tasks as
    dashed boxes."""
    out = [f'digraph "{title}" {{',
           '  graph [rankdir=TB, fontname="Helvetica", fontsize=20, labelloc=t, '
           f'label="{title}", nodesep=0.15, ranksep=0.35, newrank=true];',
           '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10, '
           'margin="0.05,0.02", height=0.3];',
           '  edge [fontname="Helvetica", fontsize=8, arrowsize=0.5];']
    cur = [k for k in nodes if not k[1]]
    nxt = [k for k in nodes if k[1]]
    for group, name in ((cur, "this iteration"), (nxt, "next iteration")):
        if not group:
            continue
        out.append(f'  subgraph "cluster_{name}" {{ label="{name}"; style=dashed; color="#999999";')
        for k in sorted(group, key=lambda k: ids[k]):
            label, ph, is_next, count = nodes[k]
            extra = f"\\n(x{count})" if count > 1 else ""
            style = ', style="rounded,filled,dashed", fillcolor="#f0f0f0"' if is_next else ""
            out.append(f'    n{ids[k]} [label="{label}{extra}", fillcolor="{PHASE_COLOURS[ph]}"{style}];')
        out.append("  }")
    for (a, b), attr in sorted(edges.items(), key=lambda x: (ids[x[0][0]], ids[x[0][1]])):
        kinds = sorted(attr["kinds"], key=KINDS.index)
        colour = KIND_COLOURS[kinds[0]]
        dotted = "RAW" not in attr["types"]
        style = "dotted" if dotted else "solid"
        lab = f', label="{",".join(KIND_SHORT[k] for k in kinds)}", fontcolor="{colour}"' if labels else ""
        cons = ""
        out.append(f'  n{ids[a]} -> n{ids[b]} [color="{colour}", style={style}{lab}{cons}];')
    # legend
    out.append('  subgraph cluster_legend { label="legend"; style=solid; color="#cccccc"; fontsize=12;')
    out.append('    legend [shape=plain, fillcolor=white, label=<<table border="0" cellspacing="2">'
               + "".join(f'<tr><td bgcolor="{PHASE_COLOURS[p]}">  {p}  </td></tr>' for p in PHASES)
               + "".join(f'<tr><td><font color="{KIND_COLOURS[k]}">&#8212; {k} ({KIND_SHORT[k]})</font></td></tr>'
                         for k in KINDS if k not in ("reduction copy", "loss"))
               + '<tr><td>solid: read after write</td></tr>'
               + '<tr><td>dotted: handle reused (WAR/WAW)</td></tr>'
               + '<tr><td>dashed box: next iteration</td></tr></table>>];')
    out.append("  }")
    out.append("}")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def render(dot_path: str, png_path: str, dpi: int = 60) -> str | None:
    """dot -Tpng; returns an error message, or None."""
    try:
        p = subprocess.run(["dot", "-Tpng", f"-Gdpi={dpi}", dot_path, "-o", png_path],
                           capture_output=True, text=True, timeout=300)
    except FileNotFoundError:
        return "Graphviz's dot is not installed (apt-get install graphviz)"
    return None if p.returncode == 0 else p.stderr.strip()[-500:]
