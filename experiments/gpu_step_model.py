"""What a d12 training step should take on one GPU, and how busy the GPU should be, before
it is measured (issue 41's targets: the GPU busy at least 90 % of a step).

    python experiments/gpu_step_model.py [--gpu "NVIDIA H200"] [--shapes 8x1024,16x1024,128x64]
                                         [--host-us 10,20,30] [--efficiency 0.5,0.35]
                                         [--depth 2] [--out CSV]

The step's tasks are the real ones (perf/graph.record: a dry-run step of the engine, the fused
attention's graph, as `train --gpus 1` submits it), in submission order. Each GPU task's kernel
time is its roofline bound on that GPU (gpu_bench.roofline's: flops at the TF32 tensor-core
rate for matmuls and attention, else fp32, or its bytes at the memory's rate) divided by an
efficiency, plus a launch's few microseconds. StarPU's CUDA worker then runs them one after
another on its stream: it starts a task `host_us` after starting the one before (the
scheduler's pop, the data checks, the codelet's launches: measured at 15-30 us a task under
dmda/dmdas on the H100/H200 machines), and no sooner than when the task `depth` places before
it has ended (STARPU_CUDA_PIPELINE, StarPU's default 2). The GPU idles when short kernels
follow each other faster than the worker can queue them.

Prints and writes (--out, default experiments/results/gpu/model/step_model.csv) one row per
shape, per-task cost and efficiency: the predicted step ms, tok/ms and GPU-busy share.
"""
from __future__ import annotations

import argparse
import csv
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import gpu_bench  # noqa: E402

LAUNCH_S = 3e-6      # a kernel's launch to start on an idle GPU


def step_graph(B: int, T: int):
    """The recorded task graph of a d12 step at B x T with the fused attention, as `train --gpus
    1` submits it (perf/predict.task_graph: recorded once, in a process of its own)."""
    from starpu_llm.perf.predict import sites_of, target_partition, task_graph
    from starpu_llm.plan.partition import PartitionRequest
    p = target_partition(PartitionRequest(workers=1, cores_per_worker=1), 1,
                         parallel_workers=False)
    return task_graph("d12", B, T, sites_of("d12", B, T, p), attention="flash")


def kernel_times(graph, peaks: tuple, efficiency: float) -> list[tuple[str, float]]:
    """(codelet, seconds) of each GPU task of the step's graph, in submission order: its bound
    (gpu_bench.task_bound_s, TF32) over efficiency, plus a launch."""
    return [(t.codelet, gpu_bench.task_bound_s(t.codelet, t.flops, t.nbytes, peaks, True)
             / efficiency + LAUNCH_S)
            for t in graph.tasks
            if t.codelet != "load_batch"]   # a CPU worker's, before the step's first kernel


def simulate(kernels: list[float], host_s: float, depth: int) -> tuple[float, float]:
    """(step seconds, busy share) of kernels run in order on one stream by a worker that
    starts a task host_s after the one before, once the task depth places back has ended."""
    host = gpu_free = busy = 0.0
    ends = []
    for i, k in enumerate(kernels):
        start = max(host, ends[i - depth] if i >= depth else 0.0) + host_s
        gpu_free = max(start, gpu_free) + k
        busy += k
        ends.append(gpu_free)
        host = start
    return gpu_free, busy / gpu_free if gpu_free else 1.0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", default="NVIDIA H200", help="a GPU name gpu_bench.GPU_PEAKS knows")
    ap.add_argument("--shapes", default="8x1024,16x1024,128x64")
    ap.add_argument("--host-us", default="10,20,30", help="StarPU's cost a GPU task, us")
    ap.add_argument("--efficiency", default="0.5,0.35,0.25",
                    help="each kernel's fraction of its roofline bound")
    ap.add_argument("--depth", type=int, default=2, help="STARPU_CUDA_PIPELINE")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "gpu", "model",
                                                  "step_model.csv"))
    args = ap.parse_args()
    peaks = gpu_bench.gpu_peaks(args.gpu)
    if peaks is None:
        ap.error(f"--gpu {args.gpu!r}: no rates known (gpu_bench.GPU_PEAKS)")
    rows = []
    for B, T in gpu_bench.shapes_of(args.shapes):
        graph = step_graph(B, T)
        for eff in (float(x) for x in args.efficiency.split(",")):
            ks = kernel_times(graph, peaks, eff)
            for h in (float(x) for x in args.host_us.split(",")):
                step, busy = simulate([k for _, k in ks], h * 1e-6, args.depth)
                rows.append(dict(gpu=args.gpu, B=B, T=T, tasks=len(ks), efficiency=eff,
                                 host_us=h, depth=args.depth, step_ms=round(step * 1e3, 2),
                                 tok_per_ms=round(B * T / (step * 1e3), 1),
                                 gpu_busy=round(busy, 4)))
                print(f"{B:4d} x {T:4d}  kernels at {eff:.2f} of their bound, {h:4.0f} us a "
                      f"task: {step * 1e3:6.1f} ms a step, {B * T / (step * 1e3):6.1f} tok/ms, "
                      f"GPU busy {100 * busy:5.1f} %")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".tmp", "w", newline="") as f:
        w = csv.DictWriter(f, list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    os.replace(args.out + ".tmp", args.out)
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
