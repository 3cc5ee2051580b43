"""Tensor, data and mixed parallelism: every n x k partition trains exactly like one worker."""
from collections import Counter

import numpy as np
import pytest

from starpu_llm import Runtime, StarpuLLMError
from starpu_llm._clib import lib
from starpu_llm.config import GPTConfig
from starpu_llm.engine import StarPUEngine
from starpu_llm.state import TrainState, random_init
from starpu_llm.taskflow import update_order
from starpu_llm.trainer import read_trace

CFG = GPTConfig(max_seq_len=32, vocab_size=250, padded_vocab_size=256, num_layers=2,
                num_heads=4, channels=64)
B, T, STEPS = 4, 32, 10
TOKENS = np.random.default_rng(3).integers(0, CFG.V, 8000).astype(np.uint16)


def run(workers, cores, sub_batches=None, oversubscribe=False, kcore=None):
    """Gradients after one forward/backward, then the losses of 10 AdamW steps."""
    state = TrainState(config=CFG, params=random_init(CFG, seed=5))
    with Runtime(workers, cores, oversubscribe=oversubscribe, kcore=kcore) as rt:
        eng = StarPUEngine(CFG, state, B, T, TOKENS, rt, sub_batches=sub_batches)
        try:
            eng.forward_backward(0)
            eng.sync()
            grads = state.grads.copy()
            state.grads[:] = 0
            losses = [eng.step(i * B * T, 1e-3, 0.01) for i in range(STEPS)]
            eng.sync()
            params = state.params.copy()
        finally:
            eng.close()
    return grads, losses, params, eng.sub_batches


@pytest.fixture(scope="module")
def single():
    return run(1, 1)


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
    g1, l1, p1, _ = single
    g, l, p, nsub = run(workers, cores, sub_batches, oversubscribe, kcore)
    assert nsub == (sub_batches or workers)
    # losses: same within 1e-5 relative for all 10 steps
    np.testing.assert_allclose(l, l1, rtol=1e-5, atol=0)
    # gradients: the sum over sub-batches only reorders fp32 additions (observed <= ~1e-9
    # absolute on gradients of magnitude <= ~1e-1)
    np.testing.assert_allclose(g, g1, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(p, p1, rtol=1e-4, atol=1e-5)


def test_indivisible_batch_is_a_clear_error():
    state = TrainState(config=CFG, params=random_init(CFG))
    with Runtime(1, 1) as rt:
        with pytest.raises(StarpuLLMError, match="--sub-batches"):
            StarPUEngine(CFG, state, 4, T, TOKENS, rt, sub_batches=3)


@pytest.mark.parametrize("sub_batches", [2, 4])
def test_sub_batches_stay_on_their_worker(sub_batches):
    """Data parallelism pins sub-batch i to worker i mod N (its forward and backward tasks),
    while reductions and updates run wherever a worker is free."""
    state = TrainState(config=CFG, params=random_init(CFG, seed=5))
    lib.sl_trace_enable(100_000)
    try:
        with Runtime(2, 1) as rt:
            eng = StarPUEngine(CFG, state, B, T, TOKENS, rt, sub_batches=sub_batches)
            try:
                for i in range(2):
                    eng.step(i * B * T, 1e-3, 0.01)
            finally:
                eng.close()
        events = read_trace(lib)
    finally:
        lib.sl_trace_enable(0)
    per_sub = 2 * (sub_batches // 2)   # 2 steps, sub_batches / 2 sub-batches per worker
    workers = Counter(e[1] for e in events if e[0] == "load_batch")
    assert workers == {0: per_sub, 1: per_sub}
    for name in ("matmul_forward", "attention_backward", "crossentropy_forward"):
        counts = Counter(e[1] for e in events if e[0] == name)
        assert set(counts) == {0, 1} and counts[0] == counts[1], (name, counts)
    # one task per parameter tensor per step, not pinned: they run on either worker
    assert sum(1 for e in events if e[0] == "adamw") == 2 * len(update_order(CFG))
