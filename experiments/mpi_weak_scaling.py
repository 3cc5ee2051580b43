"""Weak scaling over MPI processes (the paper's Figure 4, on whatever machine this runs on):
a constant batch per process, R = 1, 2, ... processes, tokens/ms over 10 timed steps, and the
per-iteration overhead of the gradient reduction and parameter broadcast, estimated as the step
time above the R=1 run (each process has the same cores and the same work).

On a 2-core machine, R=2 puts both processes on the machine that R=1 runs on with one core:
the numbers say what the StarPU-MPI path costs, not how a cluster scales.

    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \\
    .venv/bin/python experiments/mpi_weak_scaling.py --ranks 1,2 --batch-per-rank 4
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

from starpu_llm.bench import write_csv
from starpu_llm.config import MODELS

ap = argparse.ArgumentParser()
ap.add_argument("--ranks", default="1,2")
ap.add_argument("--batch-per-rank", type=int, default=4)
ap.add_argument("--seq-len", type=int, default=64)
ap.add_argument("--steps", type=int, default=10, help="timed steps (one more is the warm-up)")
ap.add_argument("--model", default="d12")
ap.add_argument("--cores-per-rank", type=int, default=1)
ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out", "mpi_weak_scaling.csv"))
args = ap.parse_args()

env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
cfg = MODELS[args.model]
param_bytes = cfg.num_parameters * 4
rows = []
base_ms = None
print(f"{'R':>2} {'B':>4} {'tok/ms':>8} {'ms/step':>9} {'overhead ms':>12} {'grad bytes to rank 0':>22} {'param bytes from rank 0':>24}")
for R in (int(r) for r in args.ranks.split(",")):
    B = R * args.batch_per_rank
    with tempfile.TemporaryDirectory() as d:
        m = os.path.join(d, "m.jsonl")
        train = ["-m", "starpu_llm", "train", "--model", args.model, "--batch", str(B),
                 "--seq-len", str(args.seq_len), "--steps", str(args.steps + 1),
                 "--workers", "1", "--cores-per-worker", str(args.cores_per_rank),
                 "--metrics-jsonl", m]
        cmd = [sys.executable, *train]
        if R > 1:
            cmd = ["mpirun", "--oversubscribe", "-np", str(R), *cmd]
        p = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if p.returncode != 0:
            print(f"R={R} failed:\n{p.stderr[-2000:]}")
            continue
        steps = [json.loads(l) for l in open(m)][1:]
    ms = sum(s["ms"] for s in steps) / len(steps)
    tpm = B * args.seq_len * len(steps) / sum(s["ms"] for s in steps)
    base_ms = ms if base_ms is None else base_ms
    # flat reduction (StarPU 1.3): every other rank sends its gradient contribution to rank 0;
    # broadcast: rank 0 sends the updated parameters to every other rank.
    moved_in, moved_out = (R - 1) * param_bytes, (R - 1) * param_bytes
    rows.append(dict(ranks=R, batch=B, tokens_per_ms=round(tpm, 4), ms_per_step=round(ms, 1),
                     overhead_ms=round(ms - base_ms, 1), grad_bytes_to_rank0=moved_in,
                     param_bytes_from_rank0=moved_out))
    print(f"{R:>2} {B:>4} {tpm:>8.4f} {ms:>9.1f} {ms - base_ms:>12.1f} {moved_in:>22,} {moved_out:>24,}", flush=True)
write_csv(args.out, rows)
print("wrote", args.out)
