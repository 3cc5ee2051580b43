"""The pipeline's stage boundaries: the layers' costs (perf/stages.py) and the split
(plan/topology.stage_layers). No timing: costs on synthetic machines."""
import pytest

from starpu_llm.model.config import MODELS
from starpu_llm.plan.topology import stage_layers
from starpu_llm.perf import machine
from starpu_llm.perf.model import CostModel
from starpu_llm.perf.predict import sites_of, task_graph
from starpu_llm.perf.stages import layer_costs

MODEL, B, T = "micro", 2, 16
NOT_IN_A_LAYER = ("load_batch", "adamw", "grad_sumsq", "norm_sum")   # the step's other tasks


def synthetic(a, b, c_us=0.0, task_us=1.0):
    """A one-core machine on which codelet x costs a[x] * flops + b[x] * bytes + c."""
    names = {t.codelet for t in task_graph(MODEL, B, T, sites_of(MODEL, B, T)).tasks}
    codelets = {n: {"a": {1: a.get(n, 1.0)}, "b": {1: b.get(n, 1.0)}, "c_us": {1: c_us}}
                for n in names}
    return machine.Machine("synthetic", 1, [1.0], [1.0], task_us=task_us, codelets=codelets)


def test_layer_costs_account_for_every_task_of_the_recorded_step():
    """head + the blocks' costs = the cost of the recorded step's forward and backward tasks
    (the real graph: its flops and bytes), and every block costs the same."""
    m = synthetic({"matmul_forward": 2.0}, {"attention_backward": 3.0}, c_us=5.0)
    cost = CostModel(m)
    head, blocks = layer_costs(MODELS[MODEL], B, T, cost)
    want = sum(cost.task(t.codelet, t.flops, t.nbytes, 1, 1)
               for t in task_graph(MODEL, B, T, sites_of(MODEL, B, T)).tasks if t.codelet not in NOT_IN_A_LAYER)
    assert head + sum(blocks) == pytest.approx(want, rel=1e-9)
    assert head > 0 and len(blocks) == MODELS[MODEL].L
    assert all(x == pytest.approx(blocks[0], rel=1e-12) for x in blocks)


def test_split_follows_the_costs():
    """A free head: the blocks evenly; a head worth 4 blocks on 12: stage 0 gets 4 of them
    at 2 stages (8 / 8), none at 4 (4 / 4 / 4 / 4); uneven blocks move the boundary."""
    cfg = MODELS["d12"]
    assert stage_layers(cfg, 2, 64, (0.0, [1.0] * 12)) == (0,) * 6 + (1,) * 6
    assert stage_layers(cfg, 2, 64, (4.0, [1.0] * 12)) == (0,) * 4 + (1,) * 8
    assert stage_layers(cfg, 4, 64, (4.0, [1.0] * 12)) == (1,) * 4 + (2,) * 4 + (3,) * 4
    heavy_last = [1.0] * 11 + [5.0]
    split = stage_layers(cfg, 2, 64, (0.0, heavy_last))
    assert split.count(1) < 6 and sum(c for c, s in zip(heavy_last, split) if s == 0) == 8.0
