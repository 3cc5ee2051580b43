"""What figures.py (the runs) and plots.py (their plots) share: a run's configuration fields
and cache key, figure 2's series, and the model FLOPs per token."""
from __future__ import annotations

import json

from starpu_llm.model.config import MODELS

# the configuration fields of a run (its cache key, with the machine and the commit)
CONFIG_FIELDS = ("engine", "model", "batch", "seq_len", "steps", "workers", "cores_per_worker", "kcore",
                 "sub_batches", "threads", "cpus", "ranks", "mpirun_args", "ownership",
                 "pipeline_stages")
FIG4_MODES = {   # figure 4's series under mpirun: label -> run-spec fields (docs/scaling.md)
    "rank0": dict(ownership="rank0"),
    "sharded": dict(ownership="sharded"),
    "pipeline": dict(ownership="sharded", pipeline_stages="R"),   # one stage per rank
}
SERIES = {   # figure 2's series: label, colour, marker
    "reference": ("reference engine (paper: Karpathy's llm.c)", "#444444", "s"),
    "tensor": ("StarPU 1 x k (one k-core worker: tensor parallelism)", "#1f77b4", "o"),
    "data": ("StarPU k x 1 (k one-core workers, k sub-batches: data parallelism)", "#2ca02c", "^"),
    "torch": ("PyTorch eager, SDPA + fused AdamW, k threads", "#d62728", "D"),
    "torch-readable": ("PyTorch eager, readable model (tests' oracle)", "#ff9896", "d"),
    "llmc": ("llm.c train_gpt2.c + OpenBLAS sgemm, k OpenMP threads (the paper's baseline)",
             "#000000", "P"),
}


def config_key(spec: dict) -> str:
    return json.dumps({k: spec.get(k) for k in CONFIG_FIELDS}, sort_keys=True)


def flops_per_token(model: str, T: int) -> float:
    """Model FLOPs per trained token (GPTConfig.flops_per_token)."""
    return MODELS[model].flops_per_token(T)
