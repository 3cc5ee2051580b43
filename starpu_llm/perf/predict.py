"""starpu-llm predict: the step time of a configuration, from the recorded task graph
(graph.py), the cost model (model.py) and the list scheduler (simulate.py)."""
from __future__ import annotations

from dataclasses import dataclass

from .._clib import ffi, lib
from ..errors import StarpuLLMError, opt
from ..flow.placement import gradient_mode
from . import graph as graphs
from .machine import Machine, default_path, load
from .model import CostModel
from .simulate import Schedule, simulate

_GRAPHS: dict = {}


def task_graph(model: str, B: int, T: int, sub_batches: int) -> graphs.TaskGraph:
    """The recorded graph of (model, B, T, sub-batches), recorded once per process."""
    key = (model, B, T, sub_batches)
    if key not in _GRAPHS:
        _GRAPHS[key] = graphs.record(model, B, T, sub_batches)
    return _GRAPHS[key]


def starpu_has_tree_reduction() -> bool:
    """StarPU-MPI 1.4 reduces with a tree (starpu_mpi_redux_data_prio_tree); 1.3 flat."""
    v = ffi.new("int[3]")
    lib.sl_starpu_version(v, v + 1, v + 2)
    return (v[0], v[1]) >= (1, 4)


def pins_sub_batches(workers: int, cores_per_worker: int, parallel_workers: bool | None = None) -> bool:
    """Whether the placement pins sub-batch i to worker i mod N here: where StarPU's workers
    are the partition's (one-core workers, or team workers; not parallel workers)."""
    from ..runtime.starpu import DEFAULT_KCORE, starpu_worker_count
    if workers == 1:
        return False
    if parallel_workers is None:
        return starpu_worker_count(workers, cores_per_worker, DEFAULT_KCORE) == workers
    return cores_per_worker == 1 or not parallel_workers


@dataclass
class Prediction:
    model: str
    B: int
    T: int
    workers: int
    cores_per_worker: int
    sub_batches: int        # per rank
    ranks: int
    schedule: Schedule
    reduction: bool

    @property
    def tokens_per_ms(self) -> float:
        return self.schedule.tokens_per_ms

    def describe(self) -> str:
        s = self.schedule
        part = f"{self.workers}x{self.cores_per_worker}" + (f" x {self.ranks} ranks" if self.ranks > 1 else "")
        idle = ", ".join(f"{x:.0%}" for x in s.idle[:16]) + (" ..." if len(s.idle) > 16 else "")
        how = "reduction" if self.reduction else ("chained" if self.sub_batches * self.ranks > 1
                                                  else "one sub-batch")
        return (f"{self.model} B={self.B} T={self.T} {part}, {self.sub_batches} sub-batch(es) "
                f"per rank ({how}): predicted {self.tokens_per_ms:.4f} tok/ms, "
                f"{s.step_s * 1e3:.1f} ms/step; critical path {s.critical_path_s * 1e3:.1f} ms; "
                f"idle per worker {idle}")


def load_calibration(path: str | None = None) -> Machine:
    path = path or default_path()
    try:
        return load(path)
    except StarpuLLMError:
        import os
        if not os.path.exists(path):
            raise StarpuLLMError(f"no calibration of this machine at {path}: run "
                                 "`starpu-llm calibrate` first (a few minutes)")
        raise


def predict(model: str, B: int, T: int, workers: int, cores_per_worker: int, ranks: int = 1,
            sub_batches: int | None = None, calibration: Machine | None = None,
            machine: Machine | None = None, tree: bool | None = None,
            parallel_workers: bool | None = None, ranks_per_node: int = 1) -> Prediction:
    """Predict one configuration. calibration: this machine's (default: its file);
    machine: another machine's description (what-if), its codelet ratios taken from the
    calibration; parallel_workers: whether the target runs k-core workers as StarPU 1.4
    parallel workers (default: as this build does)."""
    from ..config import MODELS
    calibration = calibration or load_calibration()
    target = machine or calibration
    if workers < 1 or cores_per_worker < 1 or ranks < 1:
        raise StarpuLLMError(f"{opt('workers')}, {opt('cores_per_worker')} and ranks must be >= 1")
    if workers * cores_per_worker > target.cores:
        raise StarpuLLMError(f"{workers} x {cores_per_worker} cores do not fit in {target.name}'s "
                             f"{target.cores} cores")
    S = sub_batches or workers
    if B % (S * ranks):
        raise StarpuLLMError(f"{opt('batch')} {B} does not split into {S} sub-batch(es) x {ranks} "
                             f"rank(s); choose a {opt('batch')} divisible by {S * ranks}")
    if T > MODELS[model].max_seq_len:
        raise StarpuLLMError(f"{opt('seq_len')} {T} is above the model's {MODELS[model].max_seq_len}")
    g = task_graph(model, B, T, S * ranks)
    pinned = pins_sub_batches(workers, cores_per_worker, parallel_workers)
    redux = gradient_mode(workers, pinned, S)
    if tree is None:
        tree = starpu_has_tree_reduction()
    sched = simulate(g, CostModel(target, calibration), workers, cores_per_worker, ranks, pinned=pinned,
                     redux=redux, tree=tree, ranks_per_node=ranks_per_node)
    return Prediction(model, B, T, workers, cores_per_worker, S, ranks, sched, bool(redux))
