"""starpu-llm bench: tokens/ms of the StarPU engine (per partition), the reference engine and
PyTorch eager, side by side in one run (the paper's metric: tokens over the timed steps divided
by their time, after one warm-up step).

Each configuration runs in a fresh subprocess: StarPU starts once per process, and the peak
RSS of each configuration is then its own.
"""
from __future__ import annotations

import importlib.util
import json
import sys
import time
from dataclasses import replace

from ._clib import ffi
from .model.config import MODELS, AdamW, check_batch_shape
from .errors import StarpuLLMError
from .flow.engine import StarPUEngine
from .io import data, formats
from .perf.runs import cpu_description, mpi_rank, peak_rss_mb, run_in_subprocess, write_csv
from .plan.partition import KCORE_REQUESTS, PartitionRequest, settings_of
from .plan.record import Partition
from .runtime.starpu import Runtime, partitions_that_fit, resolve_here, usable_cores
from .model.state import TrainState, random_init
from .training.trainer import TrainConfig, train


def bench_partitions(workers=None, cores_per_worker=None, kcore=None,
                     cores: int | None = None) -> list[Partition]:
    """The partitions of bench's partition flags (lists, or auto; cli.add_setting_args), each
    resolved once, here (partition.resolve, as train resolves it: K defaults to the cores over
    N), duplicates dropped: --workers auto: every N x K = cores this build runs, with both
    k-core requests for K > 1 (or those of --kcore) as this build gives them (parallel workers
    take both); else each N x K given. No flag: the default partition. A row's subprocess
    trains on partition.settings_of(p), which asks for p again."""
    cores = cores or usable_cores()
    kcores = KCORE_REQUESTS if kcore in (None, "auto") else kcore
    if workers == "auto":
        out = []
        for n, k in dict.fromkeys((n, k) for n, k, _ in partitions_that_fit(cores)):
            for m in kcores if k > 1 else ("team",):
                try:
                    out.append(resolve_here(PartitionRequest(workers=n, cores_per_worker=k,
                                                             kcore=m), cores=cores))
                except StarpuLLMError:      # that mechanism at that size: not on this build
                    pass
        return list(dict.fromkeys(out))
    asked = [PartitionRequest(workers=n, cores_per_worker=k, kcore=mode)
             for n in workers or [None]
             for k in (None if cores_per_worker == "auto" else cores_per_worker) or [None]
             for mode in (kcores if kcore else [None])]
    return list(dict.fromkeys(resolve_here(r, cores=cores) for r in asked))


def label_of(p: Partition, sub_batches: int | None) -> str:
    """A bench row's name of a StarPU partition: N x K, its mechanism where K > 1, the
    sub-batches where given."""
    return (f"{p.workers}x{p.cores_per_worker}" + (f" {p.kcore}" if p.cores_per_worker > 1 else "")
            + (f" {sub_batches} subs" if sub_batches else ""))


TORCH_ENGINES = ("torch", "torch-readable")


def run_one(spec: dict) -> dict:
    """Run one configuration in this process and return its result (used by the subprocess).

    spec: model, batch, seq_len, steps (timed, after one warm-up) and engine: "starpu"
    (workers, cores_per_worker, kcore, sub_batches, memory_limit, offload_dir: then the
    result's disk_traffic, (bytes read, bytes written) per timed step), "reference" (threads),
    "torch" (the standard eager
    GPT-2: baselines/torch_sdpa.py) or "torch-readable" (baselines/torch_gpt2.py, the tests' oracle),
    both with threads (default: every usable core). With trace=True (StarPU engine) the result
    also has the task trace of every step: see traced_run."""
    config = MODELS[spec["model"]]
    B, T, steps = spec["batch"], spec["seq_len"], spec["steps"]
    if spec["engine"] in TORCH_ENGINES:
        if spec["engine"] == "torch":
            from .baselines.torch_sdpa import torch_train_step_times
        else:
            from .baselines.torch_gpt2 import torch_train_step_times
        tokens = formats.read_shard(data.timing_dataset(config.V), config.V)
        threads = spec.get("threads") or usable_cores()
        ms = torch_train_step_times(config, random_init(config), tokens, B, T, steps + 1,
                                    threads=threads)
        import torch
        spec["describe"] = (f"PyTorch {torch.__version__} eager "
                            f"({'SDPA, fused AdamW' if spec['engine'] == 'torch' else 'readable'}), "
                            f"{torch.get_num_threads()} thread(s)")
    elif spec.get("trace"):
        ms = traced_run(spec)
    else:   # exactly what `starpu-llm train` runs: one warm-up step, then the timed ones
        r = train(TrainConfig(model=spec["model"], batch=B, seq_len=T, steps=steps + 1,
                              train_data=data.timing_dataset(config.V),
                              engine=spec["engine"], workers=spec.get("workers"),
                              cores_per_worker=spec.get("cores_per_worker"), kcore=spec.get("kcore"),
                              sub_batches=spec.get("sub_batches"), threads=spec.get("threads"),
                              ownership=spec.get("ownership"),
                              pipeline_stages=spec.get("pipeline_stages"),
                              pipeline_schedule=spec.get("pipeline_schedule"),
                              oversubscribe=spec.get("oversubscribe", False),
                              memory_limit=spec.get("memory_limit"),
                              offload_dir=spec.get("offload_dir"), log=None))
        ms = r.step_ms
        spec["describe"] = r.engine
        if r.disk_traffic is not None:      # under a memory limit: (read, written) per step
            spec["disk_traffic"] = r.disk_traffic[1:]
        if r.rank_peak_rss_mb is not None:    # under mpirun: every rank's
            spec.update(traffic=r.traffic, rank_peak_rss_mb=r.rank_peak_rss_mb)
    timed = ms[1:]
    spec.update(step_ms=timed, tokens_per_ms=B * T * len(timed) / sum(timed),
                peak_rss_mb=peak_rss_mb())
    return spec


def traced_run(spec: dict) -> list:
    """The StarPU engine for 1 + spec["steps"] steps under the task trace, as the trainer runs
    it (same Runtime, loader and engine.step), returning the step times. Adds to spec:
    "events" (Runtime.trace(): codelet, worker, cores, start_ns, end_ns, [[handle, mode], ...]
    or None, flops, job), "names" ({handle address as a string: tensor name}), "sizes" ({handle
    address as a string: bytes}), "steps_ns" ([start, end] of each step, on the trace's clock),
    "records" (the submitted task names, in order) and "describe"."""
    config = MODELS[spec["model"]]
    B, T = spec["batch"], spec["seq_len"]
    loader = data.DataLoader(data.timing_dataset(config.V), B, T, vocab_size=config.V)
    state = TrainState(config=config, params=random_init(config))
    ms, steps_ns = [], []
    partition = resolve_here(PartitionRequest(
        workers=spec.get("workers"), cores_per_worker=spec.get("cores_per_worker"),
        kcore=spec.get("kcore"), sub_batches=spec.get("sub_batches")), batch=B)
    with Runtime(partition) as rt:
        engine = StarPUEngine(config, state, B, T, loader.tokens, rt, record=True)
        rt.start_trace(400_000)
        try:
            for _ in range(spec["steps"] + 1):
                t0 = time.monotonic_ns()
                engine.step(loader.next_position(), AdamW(1e-4))
                t1 = time.monotonic_ns()
                ms.append((t1 - t0) / 1e6)
                steps_ns.append([t0, t1])
            names = engine.tensor_names()
            sizes = {str(int(ffi.cast("uintptr_t", t.h))): t.size * t.dtype.itemsize
                     for _, t in engine.named_tensors()}
            spec["describe"] = engine.describe()
        finally:
            engine.close()
        events = rt.trace()
        rt.stop_trace()
    spec["events"] = [[e.codelet, e.worker, e.cores, e.start_ns, e.end_ns,
                       None if e.buffers is None else [list(x) for x in e.buffers], e.flops, e.job]
                      for e in events]
    spec["names"] = {str(h): n for h, n in names.items()}
    spec["sizes"] = sizes
    spec["steps_ns"] = steps_ns
    spec["records"] = engine.submitted()
    return ms


def is_bench_table(path: str) -> bool:
    """a table of starpu-llm bench (CSV whose header starts with B)"""
    from .training.checkpointing import first_line_is
    return first_line_is(path, lambda line: line == b"B" or line.startswith(b"B,"))


def run_bench(args):
    """The table (printed, and --csv); a configuration that failed is a row saying why, and
    then an error at the end (after the CSV of those that ran)."""
    check_batch_shape(MODELS[args.model], 1, args.seq_len)     # before minutes of runs
    if not args.no_torch and importlib.util.find_spec("torch") is None:
        raise StarpuLLMError("bench runs PyTorch eager beside the engines, and torch is not "
                             "installed here: pip install torch, or give --no-torch")
    partitions = bench_partitions(args.workers, args.cores_per_worker, args.kcore)
    subs = [None] if args.sub_batches in (None, "auto") else args.sub_batches
    batches = args.batches
    print(f"machine: {cpu_description()}")
    print(f"model {args.model}, T={args.seq_len}, 1 warm-up + {args.steps} timed steps per row")
    rows, failed = [], []
    repeat = max(1, getattr(args, "repeat", 1))
    print(f"{'B':>3} {'engine':<22} {'tok/ms':>8} {'ms/step':>9} {'peak RSS MB':>12}"
          + ("  runs (tok/ms)" if repeat > 1 else ""))
    for B in batches:
        specs = [dict(engine="reference")]
        specs += [dict(engine="starpu", label=label_of(p, s),
                       **settings_of(replace(p, sub_batches=s or 0)))
                  for p in partitions for s in subs if B % (s or p.workers) == 0]
        if not args.no_torch:
            specs.append(dict(engine="torch"))
        for s in specs:
            s.update(model=args.model, batch=B, seq_len=args.seq_len, steps=args.steps)
        # round-robin over the configurations, `repeat` times: slow phases of a shared
        # machine then hit every configuration alike; the median run is reported
        runs = [[] for _ in specs]
        for _ in range(repeat):
            for i, s in enumerate(specs):
                runs[i].append(run_in_subprocess(dict(s)))
        for s, rs in zip(specs, runs):
            label = s["engine"] + (f" {s['label']}" if "label" in s else "")
            ok = [r for r in rs if "error" not in r]
            if not ok:
                print(f"{B:>3} {label:<22} failed: {rs[0]['error']}", flush=True)
                failed.append(f"B={B} {label}")
                continue
            ok.sort(key=lambda r: r["tokens_per_ms"])
            r = ok[len(ok) // 2]
            ms = sum(r["step_ms"]) / len(r["step_ms"])
            rss = max(x["peak_rss_mb"] for x in ok)
            extra = ("  " + " ".join(f"{x['tokens_per_ms']:.4f}" for x in ok)) if repeat > 1 else ""
            print(f"{B:>3} {label:<22} {r['tokens_per_ms']:>8.4f} {ms:>9.1f} {rss:>12.0f}{extra}",
                  flush=True)
            rows.append(dict(B=B, engine=label, tokens_per_ms=r["tokens_per_ms"],
                             ms_per_step=ms, peak_rss_mb=rss, runs=len(ok)))
    if args.csv:
        write_csv(args.csv, rows)
    if failed:
        raise StarpuLLMError(f"{len(failed)} configuration(s) failed ({', '.join(failed)}): "
                             f"see their rows above")
    return rows


if __name__ == "__main__":
    result = run_one(json.loads(sys.argv[1]))
    if mpi_rank() == 0:    # under mpirun: rank 0's timings
        print(json.dumps(result))
