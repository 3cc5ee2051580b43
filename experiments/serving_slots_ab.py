"""Does a server's number of slots cost anything per step? The decode steps of one sequence
(GPT-2 124M, random weights) in a SlotDecoder of 1 slot and in one of 16 slots, interleaved
step by step (ABBA) in one process, so that the machine's load falls on both alike (docs/serving.md:
why serve --max-batch 1 and 16 differ at one client). Writes one row per step.

    .venv/bin/python experiments/serving_slots_ab.py experiments/results/serving/<cpu>/slots-ab.csv
"""
import csv
import os
import sys
import time

import numpy as np

from starpu_llm.config import MODELS
from starpu_llm.flow import generate as gen
from starpu_llm.flow.batch import Feed, SlotDecoder
from starpu_llm.runtime.starpu import Runtime
from starpu_llm.state import random_init

STEPS = 30


def main(out):
    cfg = MODELS["d12"]
    rt = Runtime()
    backend = gen.StarPUBackend(rt, cfg, random_init(cfg, 1))
    rows = []
    try:
        decoders = {1: SlotDecoder(backend, 1), 16: SlotDecoder(backend, 16)}
        prompt = np.random.default_rng(0).integers(0, cfg.V, 32).tolist()
        for d in decoders.values():
            d.step([Feed(0, 0, prompt)])             # the prompt, untimed
        for i in range(STEPS):
            order = list(decoders.items())
            for slots, d in order if i % 2 == 0 else order[::-1]:     # ABBA: no side first
                t0 = time.perf_counter()
                d.step([Feed(0, 32 + i, [1])])
                rows.append({"slots": slots, "step": i, "ms": (time.perf_counter() - t0) * 1e3,
                             "load": os.getloadavg()[0]})
    finally:
        backend.close()
        rt.shutdown()
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    ms = {s: [r["ms"] for r in rows if r["slots"] == s] for s in decoders}
    for slots, v in ms.items():
        print(f"{slots:2d} slots: median step {np.median(v):.1f} ms over {len(v)} steps")
    print(f"median of the step-by-step ratios 16 / 1: {np.median(np.divide(ms[16], ms[1])):.3f}")


if __name__ == "__main__":
    main(sys.argv[1])
