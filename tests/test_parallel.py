"""Tensor, data and mixed parallelism: every n x k partition trains exactly like one worker."""
from collections import Counter

import numpy as np
import pytest

from starpu_llm import Runtime, StarpuLLMError
from starpu_llm.model.config import AdamW, GPTConfig, ParamLayout
from starpu_llm.flow.engine import StarPUEngine
from starpu_llm.plan.partition import PartitionRequest
from starpu_llm.runtime import resolve_here
from starpu_llm.model.state import TrainState, random_init
from starpu_llm.flow.taskflow import update_order
from partitions import here, subs

from bounds import AdamDrift, grad_rel_bound, ratio, slice_scales

CFG = GPTConfig(max_seq_len=32, vocab_size=250, padded_vocab_size=256, num_layers=2,
                num_heads=4, channels=64)
B, T, STEPS = 4, 32, 10
LR, WEIGHT_DECAY = 1e-3, 0.01
TOKENS = np.random.default_rng(3).integers(0, CFG.V, 8000).astype(np.uint16)
LAYOUT = ParamLayout(CFG)

# Bounds (tests/bounds.py, section "whole model"). A partition changes the order of fp32
# sums: the gradients of the sub-batches are added (STARPU_REDUX, or chained where sub-batches
# share a worker) instead of summed over the
# whole batch in one kernel, and tasks run with 1 or 2 threads, whose OpenMP and OpenBLAS
# splits can reorder any reduction of the forward and backward passes. No reduction is assumed
# to keep its order, so the bound is that of two fp32 runs of the model:
#   gradients   per slice (per layer, per q/k/v part of qkvw, per row of wte: slice_scales):
#               max |diff| <= GRAD_REL max |grad|,
#               GRAD_REL = 2 gamma(N_grads) = 5.1e-4 (N_grads = 4261 for this model and batch)
#   losses      per step: the loss bound at the step's parameters (2.2e-4 relative on the
#               logits' scale, plus the cross-entropy's and the mean's rounding)
#   parameters  per entry: the AdamW drift bound (Adam's step bound lr (|a| + R(t)) where a
#               gradient is within its rounding bound, the first-order change of the step
#               elsewhere; plus the updates' rounding)
# all built from the single-worker run, which plays the reference.
GRAD_REL = grad_rel_bound(CFG, B, T)


def run(workers, cores, sub_batches=None, oversubscribe=False, kcore=None, drift=None):
    """Gradients after one forward/backward, then the losses of 10 AdamW steps, the final
    parameters, the number of sub-batches and the bounds of the step losses. With `drift` (a
    bounds.AdamDrift) every step is submitted as its forward/backward then its update (the
    same tasks as step()), and the step's gradients, moments and parameters feed the drift
    bound and the step losses' bounds; without, the bounds are None."""
    state = TrainState(config=CFG, params=random_init(CFG, seed=5))
    with Runtime(here(workers, cores, oversubscribe=oversubscribe, kcore=kcore)) as rt:
        eng = StarPUEngine(CFG, state, B, T, TOKENS, rt, subs(rt, sub_batches))
        try:
            eng.forward_backward(0)
            eng.sync()
            grads = state.grads.copy()
            state.grads[:] = 0
            if drift is None:
                losses = [eng.step(i * B * T, AdamW(LR, WEIGHT_DECAY)) for i in range(STEPS)]
                loss_bounds = None
            else:
                losses, loss_bounds = [], []
                for i in range(STEPS):
                    loss = eng.forward_backward(i * B * T)
                    eng.sync()
                    loss_bounds.append(drift.gradients(state.grads, loss,
                                                       float(np.abs(eng.logits()).max())))
                    eng.submit_update(AdamW(LR, WEIGHT_DECAY))
                    eng.sync()
                    drift.update(state.m, state.v, state.params)
                    losses.append(loss)
                loss_bounds = np.array(loss_bounds)
            eng.sync()
            params = state.params.copy()
        finally:
            eng.close()
    return grads, losses, params, eng.sub_batches, loss_bounds


def skip_unless_it_fits(workers, cores, oversubscribe=False, kcore=None):
    """A partition this machine (its cores, its StarPU build's STARPU_MAXCPUS) cannot run is
    skipped, with the partition check's own reason."""
    try:
        resolve_here(PartitionRequest(workers=workers, cores_per_worker=cores,
                                      oversubscribe=oversubscribe, kcore=kcore))
    except StarpuLLMError as e:
        pytest.skip(f"{workers}x{cores} does not fit here: {e}")


@pytest.fixture(scope="module")
def single():
    """The single-worker run, and the per-entry bound of the parameters against it."""
    drift = AdamDrift(LAYOUT, B, T, LR, WEIGHT_DECAY, GRAD_REL)
    return run(1, 1, drift=drift) + (drift.bound,)


@pytest.mark.parametrize("workers,cores,sub_batches,oversubscribe,kcore", [
    (1, 2, None, False, "team"),      # pure tensor parallelism: one 2-core worker
    (1, 2, None, False, "forkjoin"),  # the same with FORKJOIN tasks on a combined worker
    (2, 1, None, False, None),        # pure data parallelism: 2 sub-batches, STARPU_REDUX
    (1, 2, 2, False, "team"),         # mixed: 2 sub-batches on one 2-core worker
    (1, 2, 2, False, "forkjoin"),
    (2, 1, 4, False, None),           # more sub-batches than workers
    (4, 1, None, True, None),         # 4 workers on 2 cores (correctness only)
])
def test_partition_equals_single_worker(single, workers, cores, sub_batches, oversubscribe, kcore):
    skip_unless_it_fits(workers, cores, oversubscribe, kcore)
    g1, l1, p1, _, loss_bounds, param_bound = single
    g, l, p, nsub, _ = run(workers, cores, sub_batches, oversubscribe, kcore)
    assert nsub == (sub_batches or workers)
    # losses, every step: the loss bound at the step's parameters
    err = np.abs(np.array(l) - np.array(l1))
    print(f"\n[{workers}x{cores} sub-batches {nsub} {kcore}] error / bound: "
          f"losses {np.max(ratio(err, loss_bounds)):.2e}", end=" ")
    assert np.all(err <= loss_bounds), (err, loss_bounds)
    # gradients, per slice (slice_scales): max |diff| <= 2 gamma(N_grads) max |grad|
    diff, scale = slice_scales(LAYOUT, g - g1), slice_scales(LAYOUT, g1)
    r = {n: float(np.max(ratio(diff[n], GRAD_REL * scale[n]))) for n in LAYOUT.names}
    print(f"gradients {max(r.values()):.2e}", end=" ")
    bad = {n: r[n] for n in LAYOUT.names if not np.all(diff[n] <= GRAD_REL * scale[n])}
    assert not bad, f"gradients differing (error / bound): {bad}"
    # parameters after 10 steps, per entry: the AdamW drift bound
    r = ratio(np.abs(p - p1), param_bound)
    print(f"params {r.max():.2e}")
    bad = {n: float(x.max()) for n, x in zip(LAYOUT.names, np.split(r, [
        LAYOUT.offsets[n] for n in LAYOUT.names[1:]])) if not x.max() <= 1.0}
    assert not bad, f"parameters after {STEPS} steps differing (error / bound): {bad}"


def test_indivisible_batch_is_a_clear_error():
    state = TrainState(config=CFG, params=random_init(CFG))
    with Runtime(here(1, 1)) as rt:
        with pytest.raises(StarpuLLMError, match="choose sub_batches dividing"):
            StarPUEngine(CFG, state, 4, T, TOKENS, rt, subs(rt, 3))


@pytest.mark.parametrize("sub_batches", [2, 4])
def test_sub_batches_stay_on_their_worker(sub_batches):
    """Data parallelism pins sub-batch i to worker i mod N (its forward and backward tasks),
    while reductions and updates run wherever a worker is free."""
    skip_unless_it_fits(2, 1)
    state = TrainState(config=CFG, params=random_init(CFG, seed=5))
    with Runtime(here(2, 1)) as rt:
        rt.start_trace(100_000)
        try:
            eng = StarPUEngine(CFG, state, B, T, TOKENS, rt, subs(rt, sub_batches))
            try:
                for i in range(2):
                    eng.step(i * B * T, AdamW(LR, WEIGHT_DECAY))
            finally:
                eng.close()
            events = rt.trace()
        finally:
            rt.stop_trace()
    per_sub = 2 * (sub_batches // 2)   # 2 steps, sub_batches / 2 sub-batches per worker
    workers = Counter(e[1] for e in events if e[0] == "load_batch")
    assert workers == {0: per_sub, 1: per_sub}
    for name in ("matmul_forward", "attention_backward", "crossentropy_forward"):
        counts = Counter(e[1] for e in events if e[0] == name)
        assert set(counts) == {0, 1} and counts[0] == counts[1], (name, counts)
    # one task per parameter tensor per step, not pinned: they run on either worker
    assert sum(1 for e in events if e[0] == "adamw") == 2 * len(update_order(CFG))
