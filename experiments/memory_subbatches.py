"""Peak RSS against the number of sub-batches (issue: data parallelism memory), GPT-2 124M.

Each sub-batch has its own activations; gradients of several sub-batches are summed by
STARPU_REDUX, for which StarPU keeps one scratch copy of each gradient handle per worker that
contributes. Writes experiments/out/memory_subbatches.csv.

    .venv/bin/python experiments/memory_subbatches.py [--batch 8] [--steps 3]
"""
import argparse
import os

from starpu_llm.perf.runs import run_in_subprocess, write_csv

ap = argparse.ArgumentParser()
ap.add_argument("--batch", type=int, default=8)
ap.add_argument("--steps", type=int, default=3)
ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out", "memory_subbatches.csv"))
args = ap.parse_args()

rows = []
print(f"{'partition':>10} {'sub-batches':>11} {'peak RSS MB':>12} {'tok/ms':>8}")
for n, k in [(1, 2), (2, 1)]:
    for sb in (1, 2, 4, 8):
        if args.batch % sb or sb < n:
            continue
        r = run_in_subprocess(dict(engine="starpu", model="d12", batch=args.batch, seq_len=64,
                                   steps=args.steps, workers=n, cores_per_worker=k, sub_batches=sb))
        if "error" in r:
            print(f"{n}x{k} {sb}: {r['error']}")
            continue
        rows.append(dict(partition=f"{n}x{k}", sub_batches=sb, peak_rss_mb=round(r["peak_rss_mb"]),
                         tokens_per_ms=round(r["tokens_per_ms"], 4)))
        print(f"{n}x{k:<8} {sb:>11} {r['peak_rss_mb']:>12.0f} {r['tokens_per_ms']:>8.4f}", flush=True)
write_csv(args.out, rows)
print("wrote", args.out)
