"""What the model predicts for the paper's node (experiments/machines/), beside the numbers
the paper quotes: its Figure 3 (every N x K = 36 partition at a total batch of 360) and its
Figure 4 (1 to 16 nodes, 32 cores each as 4 parallel workers of 8, one MPI process per node),
for each way of sharing the model over the nodes (--modes: the ownership, rank0 or sharded,
and pipelines of S stages as "pipeline S", with --micro-batches per data-parallel copy), with
each node count's per-node efficiency against one node (one process, as it runs: wte whole).
Each mode is predicted as main submits it (starpu-llm predict): the graph recorded with the
placement's wte row blocks (sharded: one per data-parallel copy of stage 0) and its owners.

The codelets' ratios to the machine's rates come from this machine's calibration
(`starpu-llm calibrate`); the node's rates from its description. The paper gives Figure 4's
batch only as "4 sequences executed in parallel" per node: the batch per node is a flag.

    .venv/bin/python experiments/whatif_paper_node.py [--per-node-batch 72] [--csv out.csv]
        [--modes rank0,sharded,"pipeline 2"] [--micro-batches 16]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys

from starpu_llm.perf.runs import write_csv
from starpu_llm.plan.partition import shapes
from starpu_llm.perf.machine import load
from starpu_llm.plan.partition import PartitionRequest
from starpu_llm.perf.predict import layout_label, load_calibration, predict, target_partition

HERE = os.path.dirname(os.path.abspath(__file__))
PAPER_FIG3 = {(12, 3): 2.70, (3, 12): 2.53}          # tok/ms at B=360 (section 3)
PAPER_FIG4 = {1: 2.32, 16: 1.88}                      # tok/ms per node count (section 4)


def fixed_mmap_threshold():
    """Keep every large array in its own mapping (glibc's M_MMAP_THRESHOLD fixed at 128 KiB).
    Otherwise glibc raises the threshold once large arrays are freed, and after a few recorded
    graphs the next ones' tensors come from the heap: recording a B=360 graph then took 11 s
    and 2.4 GB of memory instead of 0.1 s and nothing (seen on the 2-vCPU VM)."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)     # -3: M_MMAP_THRESHOLD
    except OSError:
        pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--machine", default=os.path.join(HERE, "machines",
                                                      "paper-node-xeon-gold-6240.toml"))
    ap.add_argument("--calibration", help="this machine's calibration (default: its file)")
    ap.add_argument("--batch", type=int, default=360)
    ap.add_argument("--per-node-batch", type=int, default=72)
    ap.add_argument("--nodes", default="1,2,4,8,16")
    ap.add_argument("--modes", default="rank0,sharded,pipeline 2",
                    help='comma-separated: rank0, sharded, "pipeline S" (S stages, sharded '
                         "over the copies of each stage)")
    ap.add_argument("--micro-batches", type=int, default=16,
                    help="a pipeline's micro-batches per data-parallel copy (default 16)")
    ap.add_argument("--csv")
    args = ap.parse_args(argv)
    fixed_mmap_threshold()
    node = load(args.machine)
    cal = load_calibration(args.calibration)
    rows = []
    print(f"machine: {node.name}; codelet ratios from {cal.name} ({cal.source})")
    print(f"\nFigure 3: B={args.batch}, T=64, N x K = {node.cores}")
    for n, k in shapes(node.cores):
        if args.batch % n:
            continue
        p = predict("d12", args.batch, 64, target_partition(
            PartitionRequest(workers=n, cores_per_worker=k), batch=args.batch,
            parallel_workers=True), calibration=cal, machine=node)
        paper = PAPER_FIG3.get((n, k))
        err = f"  paper {paper:.2f}, error {p.tokens_per_ms / paper - 1:+.0%}" if paper else ""
        print(f"  {n:>2}x{k:<2} predicted {p.tokens_per_ms:.3f} tok/ms{err}", flush=True)
        rows.append(dict(figure=3, partition=f"{n}x{k}", nodes=1, batch=args.batch, mode="",
                         wte_blocks=1, predicted=p.tokens_per_ms, efficiency="",
                         paper=paper or ""))
    print(f"\nFigure 4: 4 parallel workers x 8 cores per node, B={args.per_node_batch} per node")
    one = predict("d12", args.per_node_batch, 64, target_partition(
        PartitionRequest(workers=4, cores_per_worker=8), batch=args.per_node_batch,
        parallel_workers=True), calibration=cal, machine=node).tokens_per_ms
    print(f"  {'one process':>28},  1 node:   predicted {one:.3f} tok/ms  paper "
          f"{PAPER_FIG4[1]:.2f}, error {one / PAPER_FIG4[1] - 1:+.0%}")
    rows.append(dict(figure=4, partition="4x8", nodes=1, batch=args.per_node_batch, mode="",
                     wte_blocks=1, predicted=one, efficiency=1.0, paper=PAPER_FIG4[1]))
    for text in args.modes.split(","):
        stages = int(text.split()[1]) if text.startswith("pipeline") else 1
        ownership = "sharded" if stages > 1 else text
        for R in (int(x) for x in args.nodes.split(",")):
            if R == 1 or R % stages:
                continue
            subs = args.micro_batches if stages > 1 else None
            p = predict("d12", args.per_node_batch * R, 64, target_partition(
                PartitionRequest(workers=4, cores_per_worker=8, sub_batches=subs,
                                 ownership=ownership, pipeline_stages=stages), R,
                args.per_node_batch * R, parallel_workers=True), calibration=cal, machine=node)
            per_node = p.tokens_per_ms / R
            paper = PAPER_FIG4.get(R) if (ownership, stages) == ("rank0", 1) else None
            err = f"  paper {paper:.2f}, error {per_node / paper - 1:+.0%}" if paper else ""
            print(f"  {layout_label(p.partition):>28}, {R:>2} nodes: predicted {per_node:.3f} tok/ms per "
                  f"node, {per_node / one:.0%} of one node's; per node up to "
                  f"{max(p.schedule.sent) / 1e6:.0f} MB sent; wte in {p.wte_blocks} "
                  f"block(s){err}", flush=True)
            rows.append(dict(figure=4, partition="4x8", nodes=R, batch=args.per_node_batch * R,
                             mode=layout_label(p.partition), wte_blocks=p.wte_blocks, predicted=per_node,
                             efficiency=per_node / one, paper=paper or ""))
    if args.csv:
        write_csv(args.csv, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
