"""Time per generated token with and without the key/value cache, at positions 20 and 200:
GPT-2 124M (d12, random init) on the StarPU engine (or --engine reference).

With the cache (starpu_llm/flow/generate.py, Decoder) the token at position t is one decode
step: every layer on one new row, its attention over the t cached positions. Without it
(generate.Recompute) it is the training forward (taskflow.forward) over the t + 1 tokens of the
sequence. Each time is the median of --repeat tokens (positions t .. t+repeat-1 with the cache;
position t again and again without), the positions taking turns token by token, after an
untimed warm-up. Not a test: it prints the times, the load average before and after (the
machine may be shared), and the ratio of the cached times at the last and the first position
(the issue asks for at most 2).

    .venv/bin/python experiments/generation_speed.py [--engine reference] [--repeat 5]
"""
import argparse
import os
import statistics
import time

import numpy as np

from starpu_llm.model.config import MODELS
from starpu_llm.flow import generate as gen
from starpu_llm.model.state import random_init

POSITIONS = (20, 200)


def ms_per_token(models, sequence, repeat, cached):
    """{t: median ms of feeding the token at position t to models[t] (the t tokens before it
    already in the model)}. The positions take turns, token by token, so that a change of the
    machine's load falls on all of them alike."""
    if cached:
        for t, model in models.items():
            model.reset()
            model.feed([sequence[:t]])
    times = {t: [] for t in models}
    for i in range(repeat):
        for t, model in models.items():
            if not cached:
                model.sequence = sequence[None, :t]      # the prefix, without running it
            token = sequence[t + i if cached else t]
            t0 = time.perf_counter()
            model.feed([[token]])
            times[t].append((time.perf_counter() - t0) * 1e3)
    return {t: statistics.median(v) for t, v in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="starpu", choices=["starpu", "reference"])
    ap.add_argument("--repeat", type=int, default=5, help="timed tokens per figure (default 5)")
    args = ap.parse_args()
    config = MODELS["d12"]
    params = random_init(config, 1337)
    sequence = np.random.default_rng(0).integers(0, config.V, max(POSITIONS) + args.repeat,
                                                 dtype=np.int32)
    runtime = None
    if args.engine == "starpu":
        from starpu_llm.runtime.starpu import Runtime
        runtime = Runtime()
        backend = gen.StarPUBackend(runtime, config, params)
        where = runtime.describe()
    else:
        backend = gen.DirectBackend(config, params)
        where = "reference engine (the kernels in a plain loop)"
    load_before = os.getloadavg()
    try:
        decoders = {t: gen.Decoder(backend) for t in POSITIONS}     # a cache each
        full = {t: gen.Recompute(backend) for t in POSITIONS}
        ms_per_token(decoders, sequence, 1, cached=True)                # warm-up
        ms_per_token(full, sequence, 1, cached=False)
        with_cache = ms_per_token(decoders, sequence, args.repeat, cached=True)
        without = ms_per_token(full, sequence, args.repeat, cached=False)
        rows = [(t, with_cache[t], without[t]) for t in POSITIONS]
    finally:
        backend.close()
        if runtime is not None:
            runtime.shutdown()
    load_after = os.getloadavg()
    print(f"GPT-2 124M (d12, random init), {where}")
    print(f"load average (1, 5, 15 min) before: {load_before[0]:.2f} {load_before[1]:.2f} "
          f"{load_before[2]:.2f}, after: {load_after[0]:.2f} {load_after[1]:.2f} "
          f"{load_after[2]:.2f} ({os.cpu_count()} logical cores)")
    print(f"{'position':>8}  {'with cache ms/token':>20}  {'without cache ms/token':>23}")
    for t, with_cache, without in rows:
        print(f"{t:>8}  {with_cache:>20.1f}  {without:>23.1f}")
    ratio = rows[-1][1] / rows[0][1]
    print(f"with the cache, time per token at position {POSITIONS[-1]} / at {POSITIONS[0]}: "
          f"{ratio:.2f} (asked: <= 2)")


if __name__ == "__main__":
    main()
