"""Task order from a trace of real steps: an update never starts before its gradient is final."""
import numpy as np
import pytest

from starpu_llm import Runtime
from starpu_llm._clib import lib
from starpu_llm.model.config import MODELS
from starpu_llm.flow.taskflow import norm_nodes, norm_tree, update_order
from starpu_llm.runtime import usable_cores
from partitions import here
from tracing import named_buffers, traced_step

MICRO = MODELS["micro"]
TOKENS = np.random.default_rng(0).integers(0, MICRO.V, 4000).astype(np.uint16)


@pytest.mark.parametrize("workers,cores,sub_batches", [(1, 1, None), (1, 1, 2), (2, 1, None),
                                                       (1, 2, 2)])
def test_update_starts_after_its_gradient_is_final(workers, cores, sub_batches):
    """Every AdamW task starts after every task that wrote or contributed to its gradient has
    ended: the backward task that finalised it and, with sub-batches, every contribution and
    StarPU's reduction of them. Handles and modes are those StarPU gave the running tasks."""
    if workers * cores > usable_cores():
        pytest.skip(f"a {workers}x{cores} partition needs {workers * cores} cores; "
                    f"this process may use {usable_cores()}")
    with Runtime(here(workers, cores)) as rt:
        events, names = traced_step(rt, MICRO, TOKENS, sub_batches=sub_batches)
    writes = lib.SL_ACCESS_W | lib.SL_ACCESS_REDUX
    last_write = {}   # gradient handle -> end of the last task writing it, other than AdamW
    for e in events:
        if e[0] != "adamw" and e[5]:
            for h, mode in e[5]:
                if mode & writes and names.get(h, "").startswith("grad."):
                    last_write[h] = max(last_write.get(h, 0), e[4])
    updates = [e for e in events if e[0] == "adamw"]
    assert len(updates) == 12 * MICRO.L + 4
    for e in updates:
        grad = e[5][1][0]
        assert names[grad].startswith("grad.")
        assert grad in last_write, f"no task wrote {names[grad]}"
        assert e[3] >= last_write[grad], (
            f"adamw of {names[grad]} started {(last_write[grad] - e[3]) / 1e3:.0f} us "
            "before its gradient was final")


PARTITIONS = [(1, 1, None), (1, 1, 2), (2, 1, None)]


def sub_batch_of(event, names):
    """The sub-batch whose activations a traced task uses (None: no sub-batch's)."""
    subs = {n.split(".", 1)[0] for n, _ in named_buffers(event, names) if n.startswith("s")
            and n.split(".", 1)[0][1:].isdigit()}
    assert len(subs) <= 1, (event[0], subs)
    return int(subs.pop()[1:]) if subs else None


@pytest.mark.parametrize("workers,cores,sub_batches,reduction", [
    (2, 1, None, True),    # one sub-batch per one-core worker: a StarPU reduction
    (1, 1, 2, False),      # two sub-batches on one worker: chained
    (1, 2, 2, False),      # on one 2-core worker (a parallel worker on StarPU 1.4)
    (2, 1, 4, True),       # two per worker: a reduction still (a chain would serialize them)
])
def test_sub_batches_on_one_worker_add_in_submission_order(workers, cores, sub_batches,
                                                               reduction):
    """Where all sub-batches share the one worker, whose reduction copy they would add into in
    an order nothing fixes (so the sums, and the losses, would round differently from run to
    run), their contributions to each gradient are chained instead: the gradient is RW, and
    the tasks adding into it run one after another, sub-batch 0's first. With several workers,
    the contributions are a StarPU reduction (REDUX)."""
    events, names = traced(workers, cores, sub_batches, 0.0)
    contributions = {}   # gradient name -> [(start, end, sub-batch)] of the tasks adding into it
    for e in events:
        if e[0] in ("adamw", "zero", "add") or not e[5]:   # (zero, add: StarPU's reduction)
            continue
        for n, mode in named_buffers(e, names):
            if n.startswith("grad."):
                assert bool(mode & lib.SL_ACCESS_REDUX) == reduction, (e[0], n, mode)
                if not reduction:
                    assert mode == lib.SL_ACCESS_R | lib.SL_ACCESS_W, (e[0], n, mode)
                contributions.setdefault(n, []).append((e[3], e[4], sub_batch_of(e, names)))
    assert len(contributions) == 12 * MICRO.L + 4
    # StarPU's reduction methods run exactly when there is a reduction
    assert {"zero", "add"} <= {e[0] for e in events} if reduction else \
        not {"zero", "add"} & {e[0] for e in events}
    if reduction:
        return
    for n, tasks in contributions.items():
        tasks.sort()
        order = [i for _, _, i in tasks]
        assert order == sorted(order) and set(order) == set(range(sub_batches)), (n, order)
        for (_, end, _), (start, _, _) in zip(tasks, tasks[1:]):
            assert start >= end, f"two contributions to {n} overlapped"


def traced(workers, cores, sub_batches, grad_clip):
    if workers * cores > usable_cores():
        pytest.skip(f"a {workers}x{cores} partition needs {workers * cores} cores; "
                    f"this process may use {usable_cores()}")
    with Runtime(here(workers, cores)) as rt:
        return traced_step(rt, MICRO, TOKENS, sub_batches=sub_batches, grad_clip=grad_clip)


@pytest.mark.parametrize("workers,cores,sub_batches", PARTITIONS)
def test_unclipped_update_depends_on_its_own_gradient_only(workers, cores, sub_batches):
    """Without clipping, an AdamW task has the parameter, gradient and moments of its own
    tensor slice and nothing else (no gradient norm): StarPU starts it as soon as that
    gradient is final, whatever the other gradients do. No norm task runs."""
    events, names = traced(workers, cores, sub_batches, 0.0)
    assert not {"grad_sumsq", "norm_sum"} & {e[0] for e in events}
    updates = [named_buffers(e, names) for e in events if e[0] == "adamw"]
    assert len(updates) == len(update_order(MICRO))
    for bufs in updates:
        kinds = [n.split(".", 1) for n, _ in bufs]
        assert [k for k, _ in kinds] == ["param", "grad", "m", "v"], bufs
        assert len({t for _, t in kinds}) == 1, bufs


@pytest.mark.parametrize("workers,cores,sub_batches", PARTITIONS)
def test_clipped_update_waits_for_the_global_norm(workers, cores, sub_batches):
    """With clipping: each gradient's sum of squares starts after that gradient is final
    (every task writing or contributing to it has ended); the norm_sum tree runs after its
    inputs; every AdamW task reads the tree's root and starts after it was written, so after
    every gradient of the step is final."""
    events, names = traced(workers, cores, sub_batches, 1.0)
    writes = lib.SL_ACCESS_W | lib.SL_ACCESS_REDUX
    end_of_write = {}   # handle name -> end of the last task writing it (AdamW aside)
    for e in events:
        if e[0] != "adamw" and e[5]:
            for n, mode in named_buffers(e, names):
                if mode & writes:
                    end_of_write[n] = max(end_of_write.get(n, 0), e[4])
    P = len(update_order(MICRO))
    sums = [e for e in events if e[0] == "grad_sumsq"]
    assert len(sums) == P
    for e in sums:
        (out, _), (grad, mode) = named_buffers(e, names)
        assert out.startswith("gradnorm[") and grad.startswith("grad.") and mode == lib.SL_ACCESS_R
        assert e[3] >= end_of_write[grad], f"sum of squares of {grad} started before it was final"
    trees = [e for e in events if e[0] == "norm_sum"]
    assert len(trees) == len(norm_tree(P))
    for e in trees:
        (out, _), *inputs = named_buffers(e, names)
        assert all(e[3] >= end_of_write[n] for n, _ in inputs), (out, inputs)
    root = f"gradnorm[{norm_nodes(MICRO) - 1}]"
    last_gradient = max(t for n, t in end_of_write.items() if n.startswith("grad."))
    updates = [e for e in events if e[0] == "adamw"]
    assert len(updates) == P
    for e in updates:
        bufs = named_buffers(e, names)
        assert bufs[4] == (root, lib.SL_ACCESS_R), bufs
        assert e[3] >= end_of_write[root] >= last_gradient, bufs



def test_the_alternating_buffers_have_names_of_their_own():
    """The submit-ahead loop's two sets of losses and gradient-norm root (step n + 1 writes
    into the other set while step n's is still to be read: Engine.submit_step with
    keep_previous): in a trace of 2 such steps every handle has a name of its own, the first
    step's crossentropy_forward and norm tree root writing one set, the second's the other."""
    with Runtime(here(1, 1)) as rt:
        events, names = traced_step(rt, MICRO, TOKENS, grad_clip=1.0, steps=2)
    seen = {}
    for h, n in names.items():
        seen.setdefault(n, []).append(h)
    assert not {n: hs for n, hs in seen.items() if len(hs) > 1}, "handles named alike"

    def written(codelet, pick):
        return [n for e in events if e[0] == codelet
                for n, mode in named_buffers(e, names) if mode & lib.SL_ACCESS_W and pick(n)]

    losses = written("crossentropy_forward", lambda n: "losses" in n)
    assert len(losses) == 2 and len(set(losses)) == 2, losses
    root = names[max((h for h in names if names[h].startswith("gradnorm[")),
                     key=lambda h: int(names[h][9:].split("]")[0]))].split("#")[0]
    roots = written("norm_sum", lambda n: n.split("#")[0] == root)
    assert len(roots) == 2 and len(set(roots)) == 2, roots
