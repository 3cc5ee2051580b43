"""The serving engine's draw of a step's tokens: flow/generate.sample_batch (the whole batch at
once) against the former definition, one row at a time with a full sort for top_p
(row_by_row, kept here as the baseline and as tests/test_sample_batch.py's oracle).

    .venv/bin/python experiments/sampling_bench.py --rows 16 --repeat 7

prints, per setting (greedy; temperature 1; temperature 1 with top_p 0.9) and logit scale, the
best of --repeat times of both, for --rows rows of GPT-2's 50257 logits drawn N(0, scale^2).
"""
import argparse
import time

import numpy as np

from starpu_llm.flow.generate import sample_batch


def row_by_row(logits, temperature, top_k, rng, top_p):
    """The definition, one row at a time: greedy (top_k 1 or temperature 0), or
    softmax(logits / T) over the top_k largest, kept to the nucleus (a full sort by decreasing
    probability, ties by id), drawn with Generator.choice."""
    x = np.asarray(logits, np.float64)
    if top_k == 1 or temperature == 0:
        return int(np.argmax(x))
    ids = np.arange(x.size)
    if 0 < top_k < x.size:
        ids = np.sort(np.argpartition(x, x.size - top_k)[x.size - top_k:])
    w = np.exp((x[ids] - x[ids].max()) / temperature)
    p = w / w.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        keep = np.sort(order[:int(np.searchsorted(np.cumsum(p[order]), top_p)) + 1])
        ids, p = ids[keep], p[keep] / p[keep].sum()
    return int(ids[rng.choice(ids.size, p=p)])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--vocab", type=int, default=50257)
    args = ap.parse_args()
    rng = np.random.default_rng(1)
    M = args.rows
    print(f"{M} rows of {args.vocab} logits, best of {args.repeat}")
    for scale in (2.0, 4.0):
        L = (rng.standard_normal((M, args.vocab)) * scale).astype(np.float32)
        for name, T, P in (("greedy", 0.0, 1.0), ("temperature 1", 1.0, 1.0),
                           ("temperature 1, top_p 0.9", 1.0, 0.9)):
            old, new = [], []
            for _ in range(args.repeat):      # interleaved
                t0 = time.perf_counter()
                for i in range(M):
                    row_by_row(L[i], T, 0, rng, P)
                t1 = time.perf_counter()
                sample_batch(L, [T] * M, [0] * M, [rng] * M, [P] * M)
                t2 = time.perf_counter()
                old.append(t1 - t0)
                new.append(t2 - t1)
            print(f"N(0, {scale:g}^2) {name:26s} row by row {min(old) * 1e3:7.1f} ms   "
                  f"batch {min(new) * 1e3:7.1f} ms")


if __name__ == "__main__":
    main()
