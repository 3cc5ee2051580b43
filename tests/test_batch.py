"""Batched decoding (starpu_llm/flow/batch.py): sequences that come and go, each in a slot of
the key/value cache at its own position, prompts prefilled side by side with the others' next
tokens, against single-prompt generation (generate.Decoder, B = 1) on both engines.

The model has peaked logits (peaked_params): the largest logit of every step leads the second
by more than twice the fp32 bound of the existing generation tests (bounds.logits_bound), so
two computations within that bound pick the same greedy token. The test checks both: the
logits within the bound, and therefore the same tokens, whatever else shares the batch."""
import contextlib

import numpy as np
import pytest

from bounds import assert_within, logits_bound
from starpu_llm.model.config import MODELS, ParamLayout
from starpu_llm.errors import StarpuLLMError
from starpu_llm.flow import generate as gen
from starpu_llm.flow.batch import Feed, SlotDecoder
from starpu_llm.model.state import random_init

MICRO = MODELS["micro"]


def peaked_params(config, seed=3, mlp_scale=4.0, lnf_scale=20.0):
    """random_init moved by N(0, 0.02) (every tensor matters), the MLPs' weights scaled up
    (their output, a function of the tokens and positions so far, outweighs the embedding in
    the residual stream: the greedy continuation is not the last token again and again) and
    the final layernorm's weight too (the logits spread over several units: the top two are
    far apart; the tests check by how much, against the fp32 bound)."""
    p = random_init(config, seed)
    p += np.random.default_rng(seed).standard_normal(p.size).astype(np.float32) * 0.02
    views = ParamLayout(config).views(p)
    for name in ("fcw", "fcprojw"):
        views[name][:] *= mlp_scale
    views["lnfw"][:] *= lnf_scale
    return p


@contextlib.contextmanager
def engine_backend(engine, runtime):
    """The micro model with peaked logits on `engine`, closed at the end."""
    starpu = engine == "starpu"
    with contextlib.nullcontext() if starpu else runtime.paused():
        b = (gen.StarPUBackend(runtime, MICRO, peaked_params(MICRO)) if starpu
             else gen.DirectBackend(MICRO, peaked_params(MICRO)))
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(params=["reference", "starpu"])
def backend(request, runtime):
    with engine_backend(request.param, runtime) as b:
        yield b


# (prompt length, new tokens): more sequences than slots, so slots are reused
REQUESTS = [(5, 10), (9, 6), (3, 15), (12, 8), (7, 12), (1, 20), (20, 12)]


def prompts(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, MICRO.V, n).tolist() for n, _ in REQUESTS]


def alone(backend, prompt, new):
    """Greedy generation of one sequence by generate.Decoder: (tokens, logits of each step)."""
    decoder = gen.Decoder(backend, chunk=4)
    logits, out = decoder.feed([prompt])[0], []
    steps = []
    for _ in range(new):
        steps.append(logits)
        out.append(int(np.argmax(logits)))
        if len(out) < new:
            logits = decoder.feed([[out[-1]]])[0]
    return out, steps


def continuous(decoder: SlotDecoder, requests, arrive_every=2):
    """Greedy generation of every (prompt, new) with continuous batching: request i arrives
    at step arrive_every * i, takes a free slot when there is one (prefilled in chunks of at
    most half the rows, next to the running sequences' tokens) and leaves when done.
    Returns per request (tokens, logits of each step) and the largest batch seen."""
    waiting = list(range(len(requests)))
    free = list(range(decoder.slots))
    running = {}         # slot -> [request, position, pending tokens, out, logits]
    results, largest, step = {}, 0, 0
    while waiting or running:
        while free and waiting and waiting[0] * arrive_every <= step:
            i = waiting.pop(0)
            running[free.pop(0)] = [i, 0, list(requests[i][0]), [], []]
        feeds = []
        for slot, (i, pos, pending, out, _) in running.items():
            n = min(len(pending), decoder.rows // 2) if not out else 1
            feeds.append(Feed(slot, pos, pending[:n], n == len(pending)))
        largest = max(largest, len(feeds))
        logits = iter(decoder.step(feeds))
        for f in feeds:
            r = running[f.slot]
            r[1] += len(f.tokens)
            r[2] = r[2][len(f.tokens):]
            if f.logits:
                row = next(logits)
                r[4].append(row)
                r[3].append(int(np.argmax(row)))
                r[2] = [r[3][-1]]
                if len(r[3]) == requests[r[0]][1]:
                    results[r[0]] = (r[3], r[4])
                    del running[f.slot]
                    free.append(f.slot)
        step += 1
    return [results[i] for i in range(len(requests))], largest


# groups (of slots, one per StarPU worker) on the StarPU engine only
@pytest.mark.parametrize("engine,slots,groups", [("reference", 3, 1), ("starpu", 3, 1),
                                                 ("starpu", 4, 2)])
def test_continuous_batching_equals_one_sequence_at_a_time(runtime, engine, slots, groups):
    requests = list(zip(prompts(), (new for _, new in REQUESTS)))
    with engine_backend(engine, runtime) as backend:
        decoder = SlotDecoder(backend, slots, rows=24, groups=groups)
        batched, largest = continuous(decoder, requests)
        ref = [alone(backend, prompt, new) for prompt, new in requests]
    assert largest == slots          # the batch filled up
    for (prompt, new), (tokens, steps), (ref_tokens, ref_steps) in zip(requests, batched, ref):
        for k, (a, b) in enumerate(zip(steps, ref_steps)):
            T = len(prompt) + k       # the sequence so far
            bound = logits_bound(MICRO, 1, T, np.abs(b).max())
            top2 = np.sort(b)[-2:]
            assert top2[1] - top2[0] > 2 * bound, "the model's logits are not peaked enough"
            assert_within(a, b, bound, f"prompt of {len(prompt)}, logits after {T} tokens")
        assert tokens == ref_tokens


def test_step_rows_and_slots(backend):
    """One step with several prompts (prefill) and their logits in the feeds' order; a feed
    without logits; the errors."""
    decoder = SlotDecoder(backend, 3, rows=8)
    ps = prompts(1)
    logits = decoder.step([Feed(2, 0, ps[0][:5]), Feed(0, 0, ps[2][:3], False)])
    assert logits.shape == (1, MICRO.V)
    ref = gen.Decoder(backend).feed([ps[0][:5]])[0]
    assert_within(logits[0], ref, logits_bound(MICRO, 1, 5, np.abs(ref).max()), "slot 2")
    with pytest.raises(ValueError, match="rows in one step"):
        decoder.step([Feed(0, 3, [1] * 6), Feed(1, 0, [1] * 3)])
    with pytest.raises(ValueError, match="twice in a step"):
        decoder.step([Feed(1, 0, [1]), Feed(1, 1, [2])])
    with pytest.raises(StarpuLLMError, match="positions 30..32 of slot 1"):
        decoder.step([Feed(1, 30, [1, 2, 3])])
    with pytest.raises(StarpuLLMError, match=r"token ids must be in \[0, 250\)"):
        decoder.step([Feed(1, 0, [250])])


def test_step_gives_the_logits_after_each_of_a_feeds_last_tokens(backend):
    """Feed.logits = k: the logits after each of the feed's last k tokens (a scored prompt),
    beside another feed's last row, within the bound of one token at a time; more wanted rows
    than the group's head rows (slots + extra_heads) is an error."""
    decoder = SlotDecoder(backend, 2, rows=16, extra_heads=4)
    assert decoder.head_rows(0) == 6
    ps = prompts(2)
    a, b = ps[3][:9], ps[1][:4]
    logits = decoder.step([Feed(0, 0, b, True), Feed(1, 0, a, 5)])
    assert logits.shape == (6, MICRO.V)
    one = gen.Decoder(backend)
    ref = [one.feed([[t]])[0] for t in a]           # after a[0], after a[:2], ...
    ref_b = gen.Decoder(backend).feed([b])[0]
    assert_within(logits[0], ref_b, logits_bound(MICRO, 1, 4, np.abs(ref_b).max()), "b")
    for j in range(5):
        r = ref[len(a) - 5 + j]
        assert_within(logits[1 + j], r, logits_bound(MICRO, 1, len(a) - 4 + j, np.abs(r).max()),
                      f"after {len(a) - 4 + j} tokens")
    with pytest.raises(ValueError, match="the logits of 7 rows"):
        decoder.step([Feed(0, 0, b, True), Feed(1, 0, a, 6)])


def test_sample_top_p():
    """top_p keeps the fewest most likely tokens whose probabilities reach it."""
    rng = np.random.default_rng(0)
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    assert {gen.sample(logits, 1.0, 0, rng, top_p=0.5) for _ in range(200)} == {0}
    assert {gen.sample(logits, 1.0, 0, rng, top_p=0.75) for _ in range(400)} == {0, 1}
    assert {gen.sample(logits, 1.0, 0, rng, top_p=0.9) for _ in range(600)} == {0, 1, 2}
    # within the kept tokens, the probabilities renormalised: 0.5 / 0.8 and 0.3 / 0.8
    n = 20000
    counts = np.bincount([gen.sample(logits, 1.0, 0, rng, top_p=0.79) for _ in range(n)],
                         minlength=4)
    p = np.array([0.625, 0.375, 0, 0])
    assert np.all(np.abs(counts - n * p) <= 5 * np.sqrt(n * p * (1 - p)) + 1), counts
    # top_p 1 draws exactly as before (the same generator, the same tokens)
    r1, r2 = np.random.default_rng(5), np.random.default_rng(5)
    assert ([gen.sample(logits, 0.7, 3, r1) for _ in range(50)]
            == [gen.sample(logits, 0.7, 3, r2, top_p=1.0) for _ in range(50)])


FAULTS_PER_STEP = r"""
import resource, sys
import numpy as np
from starpu_llm._kernels import lib
if sys.argv[1] == "keep":
    lib.keep_freed_memory()
logits = np.ones((20, 50257), np.float32)
rows = list(range(16))
def step():
    y = logits[rows]        # a 16-row step's logits (3.2 MB) and a copy of them, alive
    w = y[rows]             # together, read and freed, as a decode step's draw does
    return int(np.argmax(w[0]) + np.argmax(y[1]))
for _ in range(3):
    step()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / 20)
"""


def test_freed_logits_are_not_faulted_in_again_at_every_step():
    """kernels' keep_freed_memory (SlotDecoder calls it): the few MB a decode step allocates
    and frees are reused by the next step, not handed back to the kernel and faulted in again
    (glibc's default, in a fresh process: 1539 page faults a step, 3.4 ms of a 0.5 ms greedy
    draw of 16 rows on the 2-core VM). Fails if the call does nothing on glibc."""
    import subprocess
    import sys
    faults = {how: float(subprocess.run([sys.executable, "-c", FAULTS_PER_STEP, how],
                                        capture_output=True, text=True, check=True).stdout)
              for how in ("keep", "default")}
    assert faults["keep"] < 10, faults


def test_the_decoders_keep_freed_memory(monkeypatch, backend):
    """SlotDecoder makes the call above (the server's decoder and generate's)."""
    import starpu_llm.flow.batch as batch
    calls = []

    class Kernels:
        def keep_freed_memory(self):
            calls.append(1)
    monkeypatch.setattr(batch, "kernels", Kernels())
    SlotDecoder(backend, 2, rows=4)
    assert calls == [1]


def test_place_caches_writes_every_slots_cache_and_changes_no_logits(backend):
    """SlotDecoder.place_caches (the server calls it as it loads): every cache tensor of
    every group reads as zeros afterwards (written by its tasks, not left to the first
    steps), and a step gives the same logits as on a decoder without it."""
    placed, plain = SlotDecoder(backend, 3, rows=8, groups=2), SlotDecoder(backend, 3, rows=8,
                                                                          groups=2)
    for g in placed.groups:
        for t in g.kv.k + g.kv.v:
            backend.write(t, np.full(int(np.prod(t.shape)), np.nan, np.float32))
    placed.place_caches()
    for g in placed.groups:
        for t in g.kv.k + g.kv.v:
            assert not backend.read(t).any()
    ps = prompts(1)
    feeds = [Feed(0, 0, ps[0][:5]), Feed(2, 0, ps[1][:4])]
    np.testing.assert_array_equal(placed.step(feeds), plain.step(feeds))
