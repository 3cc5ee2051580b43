"""Weak scaling over MPI processes (the paper's Figure 4): now part of the figures pipeline,
`experiments/figures.py --only fig4`, which this script calls with its old options.

A constant batch per process, R = 1, 2, ... processes (mpirun -np R, each rank pinned to its
share of the cores), tokens/ms over 10 timed steps (repeated, interleaved), and the
per-iteration cost of the gradient reduction and parameter broadcast, estimated as the step
time above the R=1 run (each process has the same cores and the same work). Writes
experiments/out/fig4_mpi.{csv,png}.

On a 2-core machine, R=2 puts both processes on the machine that R=1 runs on with one core:
the numbers say what the StarPU-MPI path costs, not how a cluster scales.

    .venv/bin/python experiments/mpi_weak_scaling.py --ranks 1,2 --batch-per-rank 4
"""
import argparse
import os
import sys

import figures

ap = argparse.ArgumentParser()
ap.add_argument("--ranks", default="1,2")
ap.add_argument("--batch-per-rank", type=int, default=4)
ap.add_argument("--seq-len", type=int, default=64)
ap.add_argument("--steps", type=int, default=10, help="timed steps (one more is the warm-up)")
ap.add_argument("--model", default="d12")
ap.add_argument("--cores-per-rank", type=int, default=1)
ap.add_argument("--repeat", type=int, default=3)
ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"),
                help="output directory")
args = ap.parse_args()
sys.exit(figures.main(["--only", "fig4", "--ranks", args.ranks,
                       "--mpi-batch-per-rank", str(args.batch_per_rank),
                       "--mpi-partition", f"1x{args.cores_per_rank}", "--seq-len", str(args.seq_len),
                       "--steps", str(args.steps), "--model", args.model,
                       "--repeat", str(args.repeat), "--out", args.out, "--png-dir", ""]))
