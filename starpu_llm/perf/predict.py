"""starpu-llm predict: the step time of a configuration, from the recorded task graph
(graph.py), the cost model (model.py) and the list scheduler (simulate.py); across ranks
on a resolved partition (target_partition: its workers, how the ranks share the model:
plan/topology.py's ownership, and pipeline stages)."""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace

from ..model.config import DEFAULT_MODEL, MODELS
from ..errors import StarpuLLMError, opt
from ..plan.sites import Sites
from ..plan.topology import OWNERSHIPS, Topology
from ..plan.partition import Build, PartitionRequest, attention_of, resolve, with_batch
from ..plan.record import Partition
from . import graph as graphs
from . import memory
from ..flow.memory import check_limit, step_needs
from .machine import Machine, default_path, load
from .model import CostModel
from .simulate import Schedule, simulate
from .stages import layer_costs

_GRAPHS: dict = {}


def task_graph(model: str, B: int, T: int, sites: Sites,
               attention: str | None = None) -> graphs.TaskGraph:
    """The recorded graph of (model, B, T) on the partition of `sites` with the attention's
    form `attention` (graph.record; None: a CPU run's), recorded once per process."""
    key = (model, B, T, sites.key(), attention)
    if key not in _GRAPHS:
        _GRAPHS[key] = _record_apart(model, B, T, sites, attention)
    return _GRAPHS[key]


def _record_apart(model: str, B: int, T: int, sites: Sites, attention: str | None = None):
    """graphs.record in a fresh Python process of its own, only the graph coming back
    (pickled): each dry-run step starts a StarPU runtime and registers every tensor of the
    batch, and in one process their memory added up from one recording to the next (14 GB
    resident by the eighth of Figure 4's predictions for the paper's nodes, where the machine
    killed it). A new interpreter, not multiprocessing: a fork would inherit OpenMP and BLAS
    threads, and a spawn re-runs the caller's script when it has no __main__ guard."""
    with tempfile.TemporaryDirectory(prefix="starpu-llm-graph-") as tmp:
        path = os.path.join(tmp, "graph.pickle")
        with open(path, "wb") as f:
            pickle.dump((model, B, T, sites, 0.0, attention), f)
        code = ("import pickle, sys; from starpu_llm.perf.graph import record; "
                "path = sys.argv[1]; args = pickle.load(open(path, 'rb')); "
                "pickle.dump(record(*args), open(path, 'wb'))")
        p = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True)
        if p.returncode != 0:
            last = (p.stderr.strip().splitlines() or ["?"])[-1]
            if "MemoryError" in last:     # the batch's tensors are allocated (not touched)
                raise StarpuLLMError(f"recording the task graph of {opt('batch')} {B} x "
                                     f"{opt('seq_len')} {T} allocates its tensors, more than "
                                     f"this machine can ({last.split(': ', 1)[-1]}): predict a "
                                     f"smaller {opt('batch')}")
            raise RuntimeError("recording the task graph failed: " + last)
        with open(path, "rb") as f:
            return pickle.load(f)


def layouts(ranks: int, ownership=None, stages=None, model: str = DEFAULT_MODEL) -> list:
    """The distinct (ownership, pipeline stages) of `ranks` ranks for the ownerships and stage
    counts asked for (predict's --ownership and --pipeline-stages: a list, or auto: every one;
    None: sharded, 1 stage), each to resolve into a Partition (target_partition): each
    ownership with each number of stages that divides the ranks (a pipeline of one rank per
    stage is one layout whatever the ownership; a pipeline's copies are sharded, as
    topology.Topology has them; one rank is one layout)."""
    owns = list(OWNERSHIPS) if ownership == "auto" else ownership or ["sharded"]
    for o in owns:
        if o not in OWNERSHIPS:
            raise StarpuLLMError(f"{opt('ownership')} {o!r}: choose among {', '.join(OWNERSHIPS)}, "
                                 "a comma-separated list of them, or auto")
    L = MODELS[model].L
    counts = list(range(1, L + 2)) if stages == "auto" else stages or [1]
    if min(counts) < 1:
        raise StarpuLLMError(f"{opt('pipeline_stages')} {counts}: give whole numbers >= 1 "
                             "separated by commas, or auto")
    if ranks == 1:
        return [("sharded", 1)]
    found = [("sharded" if s > 1 else o, s) for s in counts if ranks % s == 0
             and s <= L + 1 for o in owns]
    return list(dict.fromkeys(found))


def target_partition(request: PartitionRequest, ranks: int = 1, batch: int | None = None,
                     cores: int | None = None, parallel_workers: bool | None = None) -> Partition:
    """The partition `request` resolves into on the predicted machine (partition.resolve, the
    one decision; N x K may exceed this process's cores): `cores` its cores (default N x K),
    `parallel_workers` whether it runs K-core workers as StarPU 1.4 parallel workers
    (default: as this build does), its sub-batches those of a `batch` of sequences."""
    from ..runtime.starpu import this_build
    cores = cores or (request.workers or 1) * (request.cores_per_worker or 1)
    here = this_build()
    build = Build(max_cpus=max(here.max_cpus, cores), max_group=here.max_group,
                  parallel_workers=here.parallel_workers if parallel_workers is None
                  else parallel_workers)
    return resolve(replace(request, oversubscribe=True), cores=cores, build=build, ranks=ranks,
                   batch=batch)



def layout_label(p: Partition) -> str:
    """How p's ranks share the model, in words."""
    if p.ranks == 1:
        return "one process"
    if p.stages == 1:
        return p.ownership
    if p.stages == p.ranks:
        return f"pipeline {p.stages} stages"
    return f"pipeline {p.stages} stages x {p.copies} {p.ownership}"


def sites_of(model: str, B: int, T: int, partition: Partition | None = None,
             cost: CostModel | None = None) -> Sites:
    """The engine's placement of (model, B, T) on that partition (default: one worker of one
    core; plan/topology.py, plan/sites.py), as the engine makes it: its sub-batches (the
    default for B where it has none: partition.with_batch), a pipeline's stages balanced on
    the layers' predicted costs (on `cost`'s machine; by flops without one), as the engine
    balances them with the calibration (engines.stage_costs)."""
    p = with_batch(partition or target_partition(PartitionRequest()), B)
    copies = p.copies
    config = MODELS[model]
    S = p.sub_batches
    if B % (S * copies):
        over = f"{p.ranks} rank(s)" if p.stages == 1 else f"{copies} pipeline cop(ies)"
        raise StarpuLLMError(f"{opt('batch')} {B} does not split into {S} sub-batch(es) x {over}; "
                             f"choose a {opt('batch')} divisible by {S * copies}")
    costs = (layer_costs(config, p.per_copy(B) // S, T, cost, p.cores_per_worker)
             if p.stages > 1 and cost is not None else None)
    topology = Topology.of(config, p.ranks, p.stages, p.ownership, T, costs)
    return Sites(topology, S, p.workers, p.pins_sub_batches)


@dataclass
class Prediction:
    model: str
    B: int
    T: int
    partition: Partition    # as predicted: its sub-batches per rank (a pipeline: per copy)
    schedule: Schedule
    reduction: bool
    wte_blocks: int = 1     # wte's row blocks (placement.Topology's)

    @property
    def tokens_per_ms(self) -> float:
        return self.schedule.tokens_per_ms

    @property
    def sub_batches(self) -> int:
        return self.partition.sub_batches

    @property
    def ranks(self) -> int:
        return self.partition.ranks

    def describe(self) -> str:
        s, p = self.schedule, self.partition
        part = f"{p.workers}x{p.cores_per_worker}" + (
            f" x {p.ranks} ranks, {layout_label(p)}" if p.ranks > 1 else "") + (
            f", wte in {self.wte_blocks} row blocks" if self.wte_blocks > 1 else "")
        idle = ", ".join(f"{x:.0%}" for x in s.idle[:16]) + (" ..." if len(s.idle) > 16 else "")
        how = "reduction" if self.reduction else ("chained" if self.sub_batches * self.ranks > 1
                                                  else "one sub-batch")
        per = "per rank" if p.stages == 1 else "per copy"
        disk = (f"; disk {s.notes['disk_read'] / 1e6:.0f} MB read, "
                f"{s.notes['disk_written'] / 1e6:.0f} MB written per step"
                if "disk_read" in s.notes else "")
        return (f"{self.model} B={self.B} T={self.T} {part}, {self.sub_batches} sub-batch(es) "
                f"{per} ({how}): predicted {self.tokens_per_ms:.4f} tok/ms, "
                f"{s.step_s * 1e3:.1f} ms/step; critical path {s.critical_path_s * 1e3:.1f} ms; "
                f"idle per worker {idle}" + (f"; per rank up to {max(s.sent) / 1e6:.0f} MB sent, "
                                             f"{max(s.received) / 1e6:.0f} MB received"
                                             if self.ranks > 1 else "") + disk)


# The calibration predict falls back on for another machine's what-if (--machine) where this
# one has none: a 2-core AMD EPYC Zen 3 VM's (experiments/results/perfmodel/amd-epyc-avx2/),
# whose codelets' relative costs the described machine's rates then scale.
BUNDLED_CALIBRATION = os.path.join(os.path.dirname(__file__), "reference-calibration.toml")


def calibration_for(path: str | None, machine: Machine | None) -> tuple[Machine, str | None]:
    """The calibration a prediction uses: `path`'s, else this machine's; for a what-if of
    another machine (`machine` given) without either, the bundled one, with a note saying so
    (else None)."""
    if path or machine is None or os.path.exists(default_path()):
        return load_calibration(path), None
    bundled = load(BUNDLED_CALIBRATION)
    return bundled, (f"note: this machine has no calibration ({default_path()}): the codelets' "
                     f"relative costs come from the one bundled with starpu-llm ({bundled.source}); "
                     f"`starpu-llm calibrate` measures this machine's")


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


def predict(model: str, B: int, T: int, partition: Partition,
            calibration: Machine | None = None, machine: Machine | None = None,
            ranks_per_node: int = 1, memory_limit: int | None = None) -> Prediction:
    """Predict one configuration: `partition` (target_partition: its workers, cores, ranks,
    how they share the model, its sub-batches per rank or in a pipeline per data-parallel
    copy, its micro-batches; none: the default for B). calibration: this machine's (default:
    its file); machine: another machine's description (what-if), its codelet ratios taken
    from the calibration; memory_limit: bytes (one process): the disk traffic StarPU's
    eviction makes (memory.replay, in the order the tasks run without it), each task also
    waiting for its bytes at the disk's bandwidth and for its new memory at the machine's
    first-touch rate, and the step scheduled again; the schedule's notes then have
    disk_read and disk_written, bytes per step."""
    calibration = calibration or load_calibration()
    target = machine or calibration
    p = partition
    workers, cores_per_worker, ranks = p.workers, p.cores_per_worker, p.ranks
    if workers * cores_per_worker > target.cores:
        raise StarpuLLMError(f"{workers} x {cores_per_worker} cores do not fit in {target.name}'s "
                             f"{target.cores} cores")
    if p.stages < 1 or ranks % p.stages:
        raise StarpuLLMError(f"{p.stages} pipeline stages do not divide {ranks} rank(s); choose "
                             f"a number of stages dividing the ranks")
    if T > MODELS[model].max_seq_len:
        raise StarpuLLMError(f"{opt('seq_len')} {T} is above the model's {MODELS[model].max_seq_len}")
    cost = CostModel(target, calibration)
    sites = sites_of(model, B, T, p, cost)
    S, topology = sites.subs_per_copy, sites.topology
    attention = attention_of(p.attention or None, p.gpus)   # the partition's (resolve's)
    g = task_graph(model, B, T, sites, attention)

    def schedule(extra=None):
        return simulate(g, cost, cores_per_worker, ranks_per_node=ranks_per_node, extra=extra)
    sched = schedule()
    if memory_limit is not None:
        if ranks > 1:
            raise StarpuLLMError(f"predicting {opt('memory_limit')} under mpirun is not modelled: "
                                 f"predict one process")
        needs = step_needs(MODELS[model], B // S, T, S, attention)
        check_limit(memory_limit, MODELS[model], needs, S, workers)   # as the run refuses it
        if not (target.disk_read_gbs > 0 and target.disk_write_gbs > 0):
            raise StarpuLLMError(f"{target.name} has no disk bandwidth in its description: run "
                                 f"`starpu-llm calibrate` again")
        starts = sched.notes["starts"]
        order = sorted(range(len(g.tasks)), key=lambda i: (starts[i], i))
        traffic = memory.replay(g, order, memory_limit >> 20 << 20)   # whole MiB, as StarPU
        touch = target.first_touch(cores_per_worker)
        extra = [r / (target.disk_read_gbs * 1e9) + w / (target.disk_write_gbs * 1e9)
                 + (a / touch if touch else 0.0)
                 for r, w, a in zip(traffic.read, traffic.written, traffic.allocated)]
        sched = schedule(extra)
        sched.notes["disk_read"], sched.notes["disk_written"] = traffic.step
    return Prediction(model, B, T, replace(p, sub_batches=S), sched, bool(sites.redux),
                      topology.wte_blocks)
