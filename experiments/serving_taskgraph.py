"""What serving submits (issue 35, item 7; docs/serving.md): the task graph of two consecutive
decode steps of the engine, traced as StarPU ran them, in the style of the paper's Figure 1.

Step 1 carries 3 running sequences (one row each); between the steps a 4th request arrives
and takes a free slot, so step 2 carries the 3 sequences' next tokens and the new prompt's 5
rows, side by side. Both steps submit the same tasks: one per layer operation, each over all
the step's rows (flow/batch.py). The parameters were registered once, when the model was
loaded; no task writes them, so they add no edge: every step only reads them. What a new
request adds is rows in the next step (and the positions of its slot in the cache), not a
task nor a handle. The edges between the steps are the reuse of the step's buffers and of the
cache (write after read: a step's kv_append waits for the last step's attention that read the
cache).

The graph is drawn for the micro model (L = 2) so that it stays readable; the counts printed
are also given for GPT-2 124M (d12), from the same flow without running it.

    .venv/bin/python experiments/serving_taskgraph.py      # docs/figures/serving_taskgraph.png
"""
from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np

from starpu_llm._clib import ffi
from starpu_llm.model.config import MODELS, ParamLayout
from starpu_llm.flow import batch, generate as gen
from starpu_llm.flow.tensors import DecodeTensors, HeadTensors, KVCache, ParameterTensors, Tensor
from starpu_llm.runtime.starpu import Runtime
from starpu_llm.model.state import random_init
from taskgraph import ACCESS_R, ACCESS_W, _reachability, dependencies, load_events, render

HERE = os.path.dirname(os.path.abspath(__file__))
FIGURE = os.path.join(os.path.dirname(HERE), "docs", "figures", "serving_taskgraph.png")
KIND_COLOURS = {"parameters": "#e6550d", "key/value cache": "#756bb1",
                "step buffers": "#1f77b4", "rows (token, slot, position)": "#636363",
                "logits": "#fd8d3c"}
TASK_COLOURS = {"embedding": "#bdbdbd", "block": "#6baed6", "cache": "#9e9ac8",
                "head": "#fd8d3c"}


def tasks_of_a_step(config, rows: int, heads: int) -> list:
    """The codelets one decode step submits (flow/batch.decode_step), recorded without running
    anything: the tensors are names and shapes only."""
    names = []

    class Record:
        def __getattr__(self, name):
            return lambda *a, **k: names.append(name)

    def shape_only(name, shape, dtype=np.float32):
        return Tensor(name, shape, dtype)
    p = ParameterTensors.of_shapes("param", ParamLayout(config))
    kv = KVCache.create(config, 4, config.maxT, shape_only)
    d = DecodeTensors.create(config, rows, 1, shape_only)
    h = HeadTensors.create(config, heads, 1, shape_only)
    batch.decode_step(Record(), config, p, kv, d, h, rows, heads)
    return names, len(list(p.tensors()))


def kind(name: str) -> str:
    if name.startswith("param."):
        return "parameters"
    if name.startswith(("k[", "v[")):
        return "key/value cache"
    if name == "idx":
        return "rows (token, slot, position)"
    if name in ("logits", "lnf", "lnf_mean", "lnf_rstd"):
        return "logits"
    return "step buffers"


def task_kind(codelet: str) -> str:
    if codelet == "encoder_decode":
        return "embedding"
    if codelet in ("kv_append", "attention_decode"):
        return "cache"
    return "block"


def traced_steps():
    """The trace of the two steps on the micro model, and {handle: tensor name}."""
    config = MODELS["micro"]
    rt = Runtime()
    backend = gen.StarPUBackend(rt, config, random_init(config, 1))
    try:
        dec = batch.SlotDecoder(backend, slots=4, rows=16)
        rng = np.random.default_rng(0)
        prompts = [rng.integers(0, config.V, n).tolist() for n in (4, 6, 3, 5)]
        dec.step([batch.Feed(s, 0, prompts[s]) for s in range(3)])    # the 3 prompts
        rt.wait()
        rt.start_trace(10_000)
        dec.step([batch.Feed(s, len(prompts[s]), [7]) for s in range(3)])
        rt.wait()
        n_first = len(rt.trace())
        dec.step([batch.Feed(s, len(prompts[s]) + 1, [9]) for s in range(3)]
                 + [batch.Feed(3, 0, prompts[3])])
        rt.wait()
        events = rt.trace()
        rt.stop_trace()
        g = dec.groups[0]
        names = {}
        for t in list(backend.p.tensors()) + list(g.kv.tensors()) + list(g.d.tensors()) + \
                list(g.h.tensors()):
            names[int(ffi.cast("uintptr_t", t.h))] = t.name
    finally:
        backend.close()
        rt.shutdown()
    return events, n_first, names, config


def transitive_edges(edges, n: int) -> set:
    """The edges (a, b) among tasks 0..n-1 with another path from a to b (StarPU needs them
    no more than the graph shows them)."""
    succ = [[] for _ in range(n)]
    for a, b in edges:
        succ[a].append(b)
    reach = _reachability(succ)
    return {(a, b) for a, b in edges if any(w != b and (reach[w] >> b) & 1 for w in succ[a])}


def draw(events, n_first, names, config, dot_path, png_path):
    ev = load_events([tuple(e) for e in events])
    first = {e.i for e in ev if e.i < n_first}      # start order: step 1's tasks come first
    edges = {}
    for s, d, h, t in dependencies(ev):
        edges.setdefault((s, d), set()).add((kind(names.get(h, "?")), t))
    implied = transitive_edges(edges, 1 + max(e.i for e in ev))
    print(f"{len(edges)} dependencies between the tasks, {len(implied)} of them implied by "
          f"other paths")
    # drawn: the data flow (read after write), the cache's reuse, and every edge no other
    # path implies
    edges = {k: v for k, v in edges.items() if k not in implied
             or any(t == "RAW" or c == "key/value cache" for c, t in v)}
    layer = {}
    per = {}
    for e in ev:      # each task's layer: count the block tasks of its step
        step = 1 if e.i in first else 2
        key = (step, e.codelet)
        per[key] = per.get(key, 0) + 1
        n = per[key]
        reps = {"layernorm_forward": 2, "matmul_forward": 4, "residual_forward": 2}.get(e.codelet, 1)
        layer[e.i] = (n - 1) // reps if e.codelet not in ("encoder_decode",) else None
    out = ['digraph serving {',
           '  graph [rankdir=TB, fontname="Helvetica", fontsize=16, labelloc=t, nodesep=0.12, '
           'ranksep=0.22, label="Two decode steps of the server (micro model, L = 2): step 1 '
           'carries 3 sequences, step 2 the same 3 and a new request\'s prompt"];',
           '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=9, '
           'margin="0.04,0.01", height=0.25];', '  edge [arrowsize=0.4];']
    rows, heads = {1: 3, 2: 3 + 5}, {1: 3, 2: 4}
    for step, label in ((1, "step 1: 3 rows (3 sequences' next tokens)"),
                        (2, "step 2: 8 rows (3 next tokens + a new request's 5 prompt rows)")):
        out.append(f'  subgraph cluster_{step} {{ label="{label}"; style=dashed; color="#999999";')
        for e in ev:
            if (e.i in first) != (step == 1):
                continue
            head = e.codelet in ("layernorm_forward", "matmul_forward") and \
                layer[e.i] is not None and layer[e.i] >= config.L
            tk = "head" if head else task_kind(e.codelet)
            where = "" if layer[e.i] is None or head else f" [{layer[e.i]}]"
            name = e.codelet.replace("_forward", "").replace("_decode", "")
            n = heads[step] if head else rows[step]
            out.append(f'    t{e.i} [label="{name}{where}  N={n}", fillcolor="{TASK_COLOURS[tk]}"];')
        out.append("  }")
    for (s, d), kinds in sorted(edges.items()):
        ks = sorted({k for k, _ in kinds}, key=list(KIND_COLOURS).index)
        raw = any(t == "RAW" for _, t in kinds)
        out.append(f'  t{s} -> t{d} [color="{KIND_COLOURS[ks[0]]}", '
                   f'style={"solid" if raw else "dotted"}];')
    out.append('  legend [shape=plain, label=<<table border="0" cellspacing="1">'
               + "".join(f'<tr><td bgcolor="{c}">  {k} task  </td></tr>'
                         for k, c in TASK_COLOURS.items())
               + "".join(f'<tr><td><font color="{c}">&#8212; {k}</font></td></tr>'
                         for k, c in KIND_COLOURS.items() if k != "parameters")
               + '<tr><td>solid: read after write; dotted: a handle reused (WAR/WAW)</td></tr>'
               + '<tr><td>reuse edges implied by other paths left out</td></tr>'
               + '<tr><td>N: the rows a task computes</td></tr>'
               + '<tr><td>parameters: read by every task, written by none: no edge</td></tr>'
               + '</table>>];')
    out.append("}")
    with open(dot_path, "w") as f:
        f.write("\n".join(out) + "\n")
    return render(dot_path, png_path, dpi=70)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=FIGURE)
    args = ap.parse_args()
    for name in ("micro", "d12"):
        cfg = MODELS[name]
        step, params = tasks_of_a_step(cfg, rows=8, heads=4)
        print(f"{name}: {params} parameter handles registered once; a decode step submits "
              f"{len(step)} tasks ({', '.join(f'{c} x{step.count(c)}' for c in dict.fromkeys(step))}) "
              f"whatever its rows; a new request adds rows, no task and no handle")
    events, n_first, names, config = traced_steps()
    ev1 = events[:n_first]
    ev2 = events[n_first:]
    print(f"traced: step 1 ran {len(ev1)} tasks, step 2 {len(ev2)}; the parameters' "
          f"{sum(1 for n in names.values() if n.startswith('param.'))} handles were written by "
          f"none of them: "
          f"{not any(m & ACCESS_W for e in events for h, m in (e.buffers or []) if names.get(h, '').startswith('param.'))}")
    reads = sum(1 for e in events for h, m in (e.buffers or [])
                if names.get(h, "").startswith("param.") and m & ACCESS_R)
    print(f"parameter reads in the two steps: {reads}")
    with tempfile.TemporaryDirectory() as tmp:
        err = draw(events, n_first, names, config, os.path.join(tmp, "serving.dot"), args.out)
    print(err or f"wrote {args.out}")


if __name__ == "__main__":
    main()
