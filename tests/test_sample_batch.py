"""flow/generate.sample_batch: the whole batch's tokens drawn at once (the serving engine's
sampling) are the tokens the one-row definition draws, row by row, from the same generators."""
import importlib.util
import os

import numpy as np

from starpu_llm.flow import generate as gen

_spec = importlib.util.spec_from_file_location(
    "sampling_bench", os.path.join(os.path.dirname(__file__), "..", "experiments",
                                   "sampling_bench.py"))
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)
one_row = bench.row_by_row       # the former definition: one row at a time, a full sort


def test_sample_batch_draws_what_each_row_draws():
    rng = np.random.default_rng(11)
    M, V = 12, 8000
    for trial in range(25):
        # flat rows (a nucleus of thousands of tokens, past the bins' first guess) and peaked
        logits = (rng.standard_normal((M, V)) * rng.choice([0.5, 2.0, 8.0])).astype(np.float32)
        logits[0, :5] = logits[0].max()              # ties at the top: broken by id
        T = rng.choice([0.0, 0.6, 1.0, 1.7], M)
        K = rng.choice([0, 0, 1, 3, 50, 4000], M)
        P = rng.choice([1.0, 0.95, 0.9, 0.5, 0.1], M)
        seeds = rng.integers(0, 2 ** 32, M)
        got = gen.sample_batch(logits, T, K, [np.random.default_rng(s) for s in seeds], P)
        want = [one_row(logits[i], T[i], K[i], np.random.default_rng(seeds[i]), P[i])
                for i in range(M)]
        assert got.tolist() == want, trial
        # a row alone draws as in the batch
        assert gen.sample(logits[3], T[3], K[3], np.random.default_rng(seeds[3]), P[3]) == want[3]


def test_sample_batch_marks_rows_that_are_not_finite():
    logits = np.zeros((3, 10), np.float32)
    logits[:, 4] = 5
    logits[1, 2] = np.nan
    rngs = [np.random.default_rng(0) for _ in range(3)]
    assert gen.sample_batch(logits, [1.0, 1.0, 0.0], [0, 0, 0], rngs, [0.9, 1.0, 1.0]).tolist() \
        == [4, -1, 4]


def test_choose_batch_leaves_a_row_that_is_not_finite_to_its_request():
    """The serving engine's draw: a row of NaN logits (a diverged model) is that request's
    fault alone: its entry is None (scoring.choose on the row raises); the others are drawn."""
    import pytest
    from starpu_llm.serve import scoring
    from starpu_llm.serve.engine import Sampling
    logits = np.zeros((3, 10), np.float32)
    logits[:, 7] = 4
    logits[1] = np.nan
    rows = [(Sampling(temperature=1.0), [], np.random.default_rng(k)) for k in range(3)]
    chosen = scoring.choose_batch(logits, rows)
    assert chosen[1] is None and chosen[0][0] in range(10) and chosen[2][0] in range(10)
    with pytest.raises(ValueError, match="not all finite"):
        scoring.choose(logits[1], *rows[1])
