"""The serving engine's draw of a step's tokens: flow/generate.sample_batch (the whole batch at
once, in C: csrc/kernels/sample.c) against the definition, one row at a time with a full sort
for top_p (row_by_row, kept here as the baseline and as tests/test_sample_batch.py's oracle),
and, with --against COMMIT, against that commit's sample_batch (read with `git show`: the
numpy one of 151a3b1, say; where it calls the C kernel, that commit's sample.c built here),
all interleaved.

    .venv/bin/python experiments/sampling_bench.py --rows 16 --repeat 9 --against 151a3b1 \
        --csv experiments/results/sampling/<cpu>/sample_batch.csv

prints, per setting (greedy; temperature 1; temperature 1 with top_p 0.9) and logit scale, the
best of --repeat times of each, for --rows rows of GPT-2's 50257 logits drawn N(0, scale^2);
--csv adds the rows to a CSV (rows, scale, setting, system, best_ms, repeat).
"""
import argparse
import ast
import csv
import os
import subprocess
import time

import numpy as np

from starpu_llm.flow.generate import sample_batch


def row_by_row(logits, temperature, top_k, rng, top_p):
    """The definition, one row at a time: greedy (top_k 1 or temperature 0), or
    softmax(logits / T) over the top_k largest (ties by id), kept to the nucleus (a full sort by
    decreasing probability, ties by id), drawn with Generator.choice."""
    x = np.asarray(logits, np.float64)
    if top_k == 1 or temperature == 0:
        return int(np.argmax(x))
    ids = np.arange(x.size)
    if 0 < top_k < x.size:
        ids = np.sort(np.argsort(-x, kind="stable")[:top_k])
    w = np.exp((x[ids] - x[ids].max()) / temperature)
    p = w / w.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        keep = np.sort(order[:int(np.searchsorted(np.cumsum(p[order]), top_p)) + 1])
        ids, p = ids[keep], p[keep] / p[keep].sum()
    return int(ids[rng.choice(ids.size, p=p)])


ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def git_show(commit, path):
    return subprocess.run(["git", "-C", ROOT, "show", f"{commit}:{path}"], capture_output=True,
                          text=True, check=True).stdout


class _OldKernels:
    """That commit's csrc/kernels/sample.c (with its kernels.h and vexp.h), built as this build
    is (gcc -O3 -march=native -fopenmp) into a library of its own; its sample_rows called with
    the cffi pointers its sample_batch passes."""

    def __init__(self, commit):
        import ctypes
        import tempfile
        from starpu_llm._kernels import ffi
        d = tempfile.mkdtemp(prefix="sampling-")
        for f in ("sample.c", "kernels.h", "vexp.h"):
            with open(os.path.join(d, f), "w") as out:
                out.write(git_show(commit, f"csrc/kernels/{f}"))
        so = os.path.join(d, "libsample.so")
        subprocess.run(["gcc", "-O3", "-march=native", "-fopenmp", "-DNDEBUG", "-shared",
                        "-fPIC", "-o", so, os.path.join(d, "sample.c"), "-lm"], check=True)
        self._f = ctypes.CDLL(so).sample_rows
        P, I = ctypes.c_void_p, ctypes.c_int
        self._f.argtypes = [P, P, P, ctypes.c_size_t, P, I, I, P, P, P, P, I]
        self._f.restype = None
        self._ffi = ffi

    def sample_rows(self, *args):
        cdata = self._ffi.CData
        self._f(*[int(self._ffi.cast("uintptr_t", a)) if isinstance(a, cdata) else a
                  for a in args])


def sample_batch_of(commit):
    """That commit's flow/generate.sample_batch (with the module-level names it uses that are
    defined in the same file), from `git show`; where it calls the C kernel (sample_rows),
    that commit's kernel (_OldKernels)."""
    from starpu_llm._kernels import ffi
    src = git_show(commit, "starpu_llm/flow/generate.py")
    tree = ast.parse(src)
    keep = [n for n in tree.body
            if isinstance(n, ast.FunctionDef) and n.name in ("sample_batch", "_nucleus", "_ptr")
            or isinstance(n, ast.Assign) and any(getattr(t, "id", "").isupper() for t in n.targets)]
    ns = {"np": np, "os": os, "ffi": ffi}
    exec(compile(ast.Module(keep, []), f"{commit}:generate.py", "exec"), ns)
    if "kernels.sample_rows" in src:
        ns["kernels"] = _OldKernels(commit)
    return ns["sample_batch"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--against", metavar="COMMIT", help="also that commit's sample_batch")
    ap.add_argument("--csv", help="append the rows to this CSV (written whole, then renamed)")
    args = ap.parse_args()
    rng = np.random.default_rng(1)
    M = args.rows
    systems = {"row by row": lambda L, T, P: [row_by_row(L[i], T, 0, rng, P) for i in range(M)]}
    if args.against:
        old = sample_batch_of(args.against)
        systems[args.against] = lambda L, T, P: old(L, [T] * M, [0] * M, [rng] * M, [P] * M)
    systems["batch"] = lambda L, T, P: sample_batch(L, [T] * M, [0] * M, [rng] * M, [P] * M)
    print(f"{M} rows of {args.vocab} logits, best of {args.repeat}")
    out = []
    for scale in (0.05, 2.0, 4.0):      # 0.05: flat, as an untrained model's
        L = (rng.standard_normal((M, args.vocab)) * scale).astype(np.float32)
        for name, T, P in (("greedy", 0.0, 1.0), ("temperature 1", 1.0, 1.0),
                           ("temperature 1, top_p 0.9", 1.0, 0.9)):
            best = dict.fromkeys(systems, float("inf"))
            for _ in range(args.repeat):      # interleaved
                for system, run in systems.items():
                    t0 = time.perf_counter()
                    run(L, T, P)
                    best[system] = min(best[system], time.perf_counter() - t0)
            print(f"N(0, {scale:g}^2) {name:26s} " + "   ".join(
                f"{system} {t * 1e3:7.2f} ms" for system, t in best.items()))
            out += [[M, scale, name, system, f"{t * 1e3:.3f}", args.repeat]
                    for system, t in best.items()]
    if args.csv:
        rows = []
        if os.path.exists(args.csv):
            with open(args.csv, newline="") as f:
                rows = list(csv.reader(f))[1:]
        os.makedirs(os.path.dirname(os.path.abspath(args.csv)), exist_ok=True)
        with open(args.csv + ".tmp", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["rows", "scale", "setting", "system", "best_ms", "repeat"])
            w.writerows(rows + out)
        os.replace(args.csv + ".tmp", args.csv)


if __name__ == "__main__":
    main()
