"""flow/generate.sample_batch: the whole batch's tokens drawn at once (the serving engine's
sampling, in C) are the tokens the one-row definition draws, row by row, from the same
generators. Both compute in float64; C's exp and its order of summation differ from numpy's
by a few units in the last place, so a token could differ only where a uniform draw falls
within ~1e-15 of a boundary of the cumulative probabilities (about 1e-12 a draw here): the
seeds are fixed, the comparison exact."""
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


def test_the_draw_does_not_depend_on_the_threads_or_the_logits_type():
    """sample_rows gives a row to a thread: 1, 2 or more threads than rows draw the same
    tokens; float64 logits (a request's logit_bias makes them so) draw as their float32
    values do."""
    rng = np.random.default_rng(5)
    M, V = 9, 3000
    logits = (rng.standard_normal((M, V)) * 3).astype(np.float32)
    T, K, P = [1.0] * M, [0, 20] * 4 + [0], [0.9, 1.0, 0.5] * 3
    seeds = rng.integers(0, 2 ** 32, M)
    draws = [gen.sample_batch(x, T, K, [np.random.default_rng(s) for s in seeds], P, threads=t)
             for x, t in ((logits, 1), (logits, 2), (logits, 16),
                          (logits.astype(np.float64), 2))]
    assert all(d.tolist() == draws[0].tolist() for d in draws)
    assert len(set(draws[0].tolist())) > 1          # not a constant


def test_top_k_ties_are_broken_by_id():
    """Five equal largest logits and top_k 3: the three kept are the lowest ids, whatever
    the draw (the definition, row_by_row, says so too)."""
    logits = np.full((1, 50), -1.0, np.float32)
    logits[0, [7, 3, 40, 12, 25]] = 2.0
    seen = {int(gen.sample(logits[0], 1.0, 3, np.random.default_rng(s))) for s in range(200)}
    assert seen == {3, 7, 12}
    assert {one_row(logits[0], 1.0, 3, np.random.default_rng(s), 1.0) for s in range(50)} \
        <= {3, 7, 12}


def test_flat_and_constant_rows_draw_as_the_definition():
    """Rows whose tokens nearly all share the first pass's boundary bin (an untrained model,
    a high temperature: sample.c bins them again, finer) and rows of equal logits (kept in id
    order: top_p 0.5 of V equal tokens is the first V/2 ids)."""
    rng = np.random.default_rng(3)
    V = 6000
    for scale, T in ((1e-3, 1.0), (0.05, 1.7), (0.0, 1.0)):
        logits = (rng.standard_normal((8, V)) * scale).astype(np.float32)
        P = [0.5, 0.9, 0.99, 0.1] * 2
        seeds = rng.integers(0, 2 ** 32, 8)
        got = gen.sample_batch(logits, [T] * 8, [0] * 8, [np.random.default_rng(s) for s in seeds],
                               P)
        want = [one_row(logits[i], T, 0, np.random.default_rng(seeds[i]), P[i]) for i in range(8)]
        assert got.tolist() == want, scale
    equal = np.zeros((1, V), np.float32)
    drawn = {int(gen.sample(equal[0], 1.0, 0, np.random.default_rng(s), 0.5)) for s in range(300)}
    assert max(drawn) < V // 2 and min(drawn) < V // 8


def test_the_draws_exp_is_within_two_ulp_of_libm(tmp_path):
    """csrc/kernels/vexp.h (the draw's vectorised float64 exp) against the C library's exp on
    [-708, 0] (2 million points, the ends included), 0 below -708 and at -inf, 1 at 0: a
    small C program built with the compiler that builds the package."""
    import shutil
    import subprocess
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    assert cc, "no C compiler: the package itself needs one"
    src = tmp_path / "vexp_check.c"
    src.write_text(r'''
#include <math.h>
#include <stdio.h>
#include "vexp.h"
int main(void) {
	double worst = 0;
	long n = 2000000;
	for (long i = 0; i <= n; i++) {
		double x = -708.0 * (double)i / (double)n, e = exp(x);
		double rel = fabs(vexp_neg(x) - e) / e;
		worst = rel > worst ? rel : worst;
	}
	printf("%.17g %.17g %.17g %.17g\n", worst / 2.220446049250313e-16, vexp_neg(-708.5),
	       vexp_neg(-INFINITY), vexp_neg(0.0));
	return 0;
}
''')
    exe = tmp_path / "vexp_check"
    kernels = os.path.join(os.path.dirname(__file__), "..", "csrc", "kernels")
    subprocess.run([cc, "-O2", "-I", kernels, str(src), "-o", str(exe), "-lm"], check=True)
    ulp, below, at_inf, at_zero = map(float, subprocess.run(
        [str(exe)], capture_output=True, text=True, check=True).stdout.split())
    assert ulp <= 2.0 and below == 0.0 and at_inf == 0.0 and at_zero == 1.0, \
        (ulp, below, at_inf, at_zero)
