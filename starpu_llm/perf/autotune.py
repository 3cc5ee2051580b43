"""Choose the partition (N workers x K cores, sub-batches) of a batch from the model, confirm
the two best predictions with one short measured trial each, and remember the choice per
machine and shape.

rank() is the model's part alone (no run, no clock: the same machine description gives the
same ranking; tests/test_perfmodel.py checks it on synthetic machines); choose() adds the
timed trials and the cache."""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields

from ..io.atomic import atomic_write
from ..plan.partition import PartitionRequest, request_of, settings_of, shapes
from ..plan.record import Partition
from .runs import run_in_subprocess
from .machine import Machine, default_path
from .predict import predict, target_partition


@dataclass
class Choice:
    """The autotuner's partition, resolved (predict.target_partition), and why."""
    partition: Partition
    why: str

    @property
    def request(self) -> PartitionRequest:
        """What a run asks for to train on it (partition.request_of)."""
        return request_of(self.partition)


def candidates(cores: int, B: int, parallel_workers: bool | None = None) -> list[Partition]:
    """Every N x K = cores with one or two sub-batches per worker that split B (where neither
    splits B, B below N: the most sub-batches below N that do), each resolved once for a
    machine of those cores (predict.target_partition: `parallel_workers` as there) with its
    sub-batches."""
    out = []
    for n, k in sorted(shapes(cores), key=lambda p: p[1]):
        split = [s for s in (n, 2 * n) if B % s == 0]
        out += [target_partition(PartitionRequest(workers=n, cores_per_worker=k, sub_batches=s),
                                 batch=B, parallel_workers=parallel_workers)
                for s in split or [max(s for s in range(1, n) if B % s == 0)]]
    return out


def rank(model: str, B: int, T: int, calibration: Machine, machine: Machine | None = None,
         parallel_workers: bool | None = None) -> list:
    """The candidates of (model, B, T) on `machine` (default: the calibrated one), as
    Predictions, fastest predicted first (ties: fewer workers first, the candidates' order)."""
    target = machine or calibration
    ranked = [predict(model, B, T, p, calibration=calibration, machine=machine)
              for p in candidates(target.cores, B, parallel_workers)]
    ranked.sort(key=lambda p: -p.tokens_per_ms)      # stable: ties keep the candidates' order
    if not ranked:
        raise ValueError(f"no partition of {target.cores} cores splits a batch of {B}")
    return ranked


def cache_path(calibration_path: str | None = None) -> str:
    return os.path.join(os.path.dirname(calibration_path or default_path()), "autotune.json")


def choose(model: str, B: int, T: int, calibration: Machine, trial_steps: int = 3,
           rounds: int = 2, cache: str | None = None, log=print) -> Choice:
    """The partition for (model, B, T) on this machine: ranked by the model (rank), the two best
    measured (trial_steps steps each, the first a warm-up, in a subprocess training on the
    partition's settings, partition.settings_of; `rounds` rounds, the two interleaved, each
    kept at its best round: one slow round, a busy moment of the machine, then decides
    nothing), the faster kept and cached (its request, partition.request_of: resolved again
    as the candidates are, it gives the same partition)."""
    cache = cache or cache_path()
    key = f"{calibration.name}:{calibration.source}:{model}:B{B}:T{T}"   # a new calibration: new choices
    try:
        with open(cache, encoding="utf-8") as f:
            known = json.load(f)
    except (OSError, ValueError):
        known = {}
    if key in known:
        c = known[key]
        asked = PartitionRequest(**{f.name: c[f.name] for f in fields(PartitionRequest)
                                    if f.name in c})
        return Choice(target_partition(asked, batch=B), c["why"] + " (cached)")
    ranked = rank(model, B, T, calibration)
    best = {}
    for _ in range(rounds):
        for pred in ranked[:2]:
            p = pred.partition
            r = run_in_subprocess(dict(engine="starpu", model=model, batch=B, seq_len=T,
                                       steps=trial_steps, **settings_of(p)))
            measured = r.get("tokens_per_ms", 0.0)
            log(f"autotune: {p.workers}x{p.cores_per_worker}, {p.sub_batches} sub-batch(es): "
                f"predicted {pred.tokens_per_ms:.4f}, measured {measured:.4f} tok/ms")
            if measured > best.get(p, (0.0,))[0]:
                best[p] = (measured, pred)
    measured, pred = max(best.values(), key=lambda t: t[0])
    why = (f"best of the model's ranking of {len(ranked)} partitions, confirmed by "
           f"{rounds} interleaved {trial_steps}-step trials of the top {len(best)}: "
           f"{measured:.4f} tok/ms measured (best round), {pred.tokens_per_ms:.4f} predicted")
    known[key] = dict(asdict(request_of(pred.partition)), why=why)
    os.makedirs(os.path.dirname(os.path.abspath(cache)), exist_ok=True)
    atomic_write(cache, lambda f: json.dump(known, f, indent=1), text=True)
    return Choice(pred.partition, why)
