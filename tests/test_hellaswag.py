"""HellaSwag (io/hellaswag.py, training/hellaswag.py, flow/losses.py, `starpu-llm eval`,
`train --hellaswag`): each ending's mean loss against the PyTorch oracle on the same weights,
the argmin on examples whose answer is the model's own greedy choice, the file's errors, and
the measure in a training run's line and metrics.

The engines' mean loss over an ending's n tokens and torch's are two fp32 computations of the
same exact value: within bounds.loss_bound of the batch's B=1 x T (a mean over n <= T
cross-entropies, each within the bound of one)."""
import contextlib
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from bounds import loss_bound
from starpu_llm.baselines.torch_gpt2 import TorchGPT2
from starpu_llm.errors import StarpuLLMError, flag
from starpu_llm.flow import generate as gen
from starpu_llm.flow.losses import TokenLosses
from starpu_llm.io import hellaswag as hs_io, tokenizer
from starpu_llm.model.config import MODELS
from starpu_llm.model.state import random_init
from starpu_llm.training import hellaswag
from starpu_llm.training.trainer import TrainConfig, train
import test_generate

TINY = MODELS["tiny"]
LONG = " ".join(["The long story goes on and on, word after word."] * 12)     # > maxT tokens
EXAMPLES = [
    {"ctx": "A man is sitting on a roof. He", "endings": [
        "is using wrap to wrap a pair of skis.", "is ripping level tiles off.",
        "is holding a rubik's cube.", "starts pulling up roofing on a roof."], "label": 3},
    {"ctx": "The cat", "endings": ["sat.", "ran away from the dog quickly.", "slept", ""],
     "label": 0},
    {"ctx": LONG, "endings": ["ends.", "goes on and on.", "is long", "x"], "label": 1},
]


PARAMS = test_generate.params_of(TINY)
tiny_ckpt = test_generate.tiny_ckpt        # the fixture: the tiny model of PARAMS


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def eval_cli(*args):
    """`starpu-llm eval *args`: (status, stdout, stderr)."""
    p = subprocess.run([sys.executable, "-m", "starpu_llm", "eval", *map(str, args)],
                       capture_output=True, text=True, timeout=300)
    return p.returncode, p.stdout, p.stderr


@pytest.fixture(params=["reference", "starpu"])
def backend(request, runtime):
    starpu = request.param == "starpu"
    b = gen.StarPUBackend(runtime, TINY, PARAMS) if starpu else gen.DirectBackend(TINY, PARAMS)
    with contextlib.nullcontext() if starpu else runtime.paused():
        yield b
    b.close()


def test_ending_losses_match_torch(backend, tmp_path):
    """Each ending's mean loss (5 rows a forward: examples split over batches, the last one
    padded) is torch's on that row alone, context + " " + ending with the context cut from
    the left to maxT (the long example); the counts are the endings' token counts."""
    path = write_jsonl(tmp_path / "hs.jsonl", EXAMPLES)
    examples = hellaswag.read_examples(path, TINY)
    T = hellaswag.seq_len(TINY, examples)
    assert T == TINY.maxT                     # the long context is cut
    B = 5
    losses = TokenLosses(backend, B, T)
    try:
        sums, counts = hellaswag.ending_losses(examples, losses, B, T)
    finally:
        losses.close()
    tok = tokenizer.gpt2()
    model = TorchGPT2(TINY, PARAMS)
    for i, x in enumerate(EXAMPLES):
        context = tok.encode(x["ctx"])
        for j, text in enumerate(x["endings"]):
            ending = tok.encode(" " + text)
            row = (context + ending)[-TINY.maxT:]
            n = len(ending)
            assert counts[i, j] == n
            with torch.no_grad():
                logits, _ = model.forward(np.array([row[:-1]]))
                ce = torch.nn.functional.cross_entropy(
                    logits[0, :, :TINY.V], torch.tensor(row[1:]), reduction="none")
            want = float(ce[-n:].double().mean())
            bound = loss_bound(TINY, 1, T, want, float(logits.abs().max()))
            got = sums[i, j] / counts[i, j]
            assert abs(got - want) <= bound, (i, j, got, want, bound)


def _greedy_file(tmp_path, name, shift=0):
    """Examples whose correct ending is the model's greedy choice among 4 one-token endings:
    the label is the ending whose token has the largest next-token logit after the context,
    read from the decoder (flow/generate, the key/value cache: another path than the scored
    forward); `shift` moves every label by that much (a wrong answer)."""
    tok = tokenizer.gpt2()
    words = ["cat", "dog", "house", "tree", "red", "blue", "water", "stone", "king", "song",
             "river", "light"]
    ids = [tok.encode(" " + w) for w in words]
    assert all(len(t) == 1 for t in ids)
    decoder = gen.Decoder(gen.DirectBackend(TINY, PARAMS))
    rows = []
    for k, ctx in enumerate(["Once upon a time there was a", "She looked at the",
                             "In the morning we saw the"]):
        decoder.reset()
        logits = decoder.feed([tok.encode(ctx)])[0]
        pool = [words[(4 * k + m) % len(words)] for m in range(4)]
        best = int(np.argmax([logits[tok.encode(" " + w)[0]] for w in pool]))
        rows.append({"ctx": ctx, "endings": pool, "label": (best + shift) % 4})
    decoder.backend.close()
    return write_jsonl(tmp_path / name, rows)


def greedy_and_wrong_file(tmp_path):
    """_greedy_file's 3 examples right, then the same 3 with each label moved by one: acc and
    acc_norm 3/6 (one-token endings: the lowest sum is the lowest mean)."""
    rows = [line for shift in (0, 1)
            for line in open(_greedy_file(tmp_path, f"greedy{shift}.jsonl", shift)).read().splitlines()]
    return write_jsonl(tmp_path / "greedy_and_wrong.jsonl", rows)


def scored_examples(tmp_path) -> list:
    """EXAMPLES (the long context cut, an empty ending), then _greedy_file's: the 6 examples
    two engines' picks are compared on."""
    return (hellaswag.read_examples(write_jsonl(tmp_path / "hs.jsonl", EXAMPLES), TINY)
            + hellaswag.read_examples(_greedy_file(tmp_path, "greedy.jsonl"), TINY))


def scored(backend, examples, B: int = 5):
    """ending_losses' (sums, counts) of examples on backend (TINY's), B rows a forward, and the
    largest |logit| of those forwards (bounds.loss_bound's scale)."""
    T = hellaswag.seq_len(TINY, examples)
    losses, scale = TokenLosses(backend, B, T), [0.0]

    def forward(inputs, targets):
        got = losses(inputs, targets)
        scale[0] = max(scale[0], float(np.abs(losses.backend.read(losses.a.logits)).max()))
        return got
    try:
        return (*hellaswag.ending_losses(examples, forward, B, T), scale[0])
    finally:
        losses.close()


# of scored_examples' 6, how many picks (by mean, by sum) two runs within the bound must share,
# fp32 (False) and TF32 (True): assert_same_endings' count, found on the CPU
# (test_engines_pick_the_same_endings_where_the_bound_decides); test_gpu.py's check of the
# GPU's picks compares these
DECIDED = {False: (6, 5), True: (4, 4)}


def assert_same_endings(examples, ref, other, tf32: bool) -> tuple:
    """scored()'s ref and other, two engines' on examples: each ending's mean loss within
    loss_bound of two runs (the second's matmuls in TF32 when tf32; B=1 x T as
    test_ending_losses_match_torch's), and each example's pick by the lowest mean (acc_norm)
    and by the lowest sum (acc) the same wherever ref's leads the next by more than twice the
    bound (within it, a tie the bound leaves open). Returns how many examples were so decided
    (by mean, by sum)."""
    (sums, counts, scale), (other_sums, other_counts, _) = ref, other
    T = hellaswag.seq_len(TINY, examples)
    means = sums / counts
    bound = np.array([[loss_bound(TINY, 1, T, m, scale, tf32) for m in row] for row in means])
    assert np.array_equal(other_counts, counts)
    err = np.abs(other_sums / counts - means)
    assert np.all(err <= bound), f"|mean loss - reference's| {err} > {bound}"
    decided = []
    for want, have, b in ((means, other_sums / counts, bound), (sums, other_sums, bound * counts)):
        lead = np.diff(np.sort(want, 1)[:, :2], axis=1)[:, 0]
        sure = lead > 2 * b.max(1)
        assert np.array_equal(have.argmin(1)[sure], want.argmin(1)[sure]), \
            (have.argmin(1), want.argmin(1), lead, b.max(1))
        decided.append(int(sure.sum()))
    return tuple(decided)


def test_engines_pick_the_same_endings_where_the_bound_decides(runtime, tmp_path):
    """The StarPU engine's mean loss of each ending within the fp32 bound of the reference
    engine's, and the same picks where the bound decides them (DECIDED, also at TF32's bound:
    what test_gpu.py's check of the GPU compares); greedy_and_wrong_file's picks all decided at
    fp32's (its `eval --gpus 1 --gpu-matmul fp32` expects the CPU's 3/6)."""
    examples = scored_examples(tmp_path)
    ref = scored(gen.DirectBackend(TINY, PARAMS), examples)
    backend = gen.StarPUBackend(runtime, TINY, PARAMS)
    try:
        assert assert_same_endings(examples, ref, scored(backend, examples), False) == DECIDED[False]
    finally:
        backend.close()
    assert assert_same_endings(examples, ref, ref, True) == DECIDED[True]
    greedy = hellaswag.read_examples(greedy_and_wrong_file(tmp_path), TINY)
    g = scored(gen.DirectBackend(TINY, PARAMS), greedy)
    assert assert_same_endings(greedy, g, g, False) == (6, 6)
    assert hellaswag.score(greedy, *g[:2]) == (6, 3, 3)


def test_eval_finds_the_models_greedy_ending(runtime, tiny_ckpt, tmp_path):
    """`starpu-llm eval` on both engines: every example right when the labels are the
    model's greedy choices, none when each label is moved by one; --limit scores the first
    N."""
    right, wrong = _greedy_file(tmp_path, "right.jsonl"), _greedy_file(tmp_path, "wrong.jsonl", 1)
    with runtime.paused():
        for engine in ("starpu", "reference"):
            rc, out, err = eval_cli("--hellaswag", right, "--init-from", tiny_ckpt, "--engine",
                                    engine, "--batch", 3)
            assert rc == 0, err
            assert out == (f"hellaswag: {right}, 3 example(s): acc 1.0000 (3/3), acc_norm "
                           f"1.0000 (3/3)\n"), out
        rc, out, err = eval_cli("--hellaswag", wrong, "--init-from", tiny_ckpt, "--limit", 2)
        assert rc == 0, err
        assert out.endswith("2 example(s): acc 0.0000 (0/2), acc_norm 0.0000 (0/2)\n"), out


def test_score_takes_the_lowest_total_and_mean_loss():
    """acc by the lowest sum, acc_norm by the lowest mean a token: a long ending of a low
    mean wins acc_norm and loses acc."""
    x = hs_io.Example((1,), ((2,),) * 4, 1)
    sums = np.array([[3.0, 4.0, 5.0, 6.0]])
    counts = np.array([[1, 4, 1, 1]])
    assert hellaswag.score([x], sums, counts) == (1, 0, 1)
    assert hellaswag.score([x._replace(label=0)], sums, counts) == (1, 1, 0)


def test_rows_are_cut_to_T():
    """A row longer than T loses the context's first tokens; an ending of T tokens or more
    keeps its first T - 1 after one context token."""
    assert hs_io.row((1, 2, 3), (4, 5), 4) == ((2, 3, 4, 5), 1, 2)
    assert hs_io.row((1, 2, 3), (4, 5), 8) == ((1, 2, 3, 4, 5), 2, 2)
    assert hs_io.row((1, 2, 3), (4, 5, 6, 7, 8), 4) == ((3, 4, 5, 6), 0, 3)


@pytest.mark.parametrize("rows,line,says", [
    ([EXAMPLES[0], {"ctx": "a", "endings": ["b"] * 4}], 2, 'no field "label"'),
    ([{"endings": ["b"] * 4, "label": 0}], 1, 'no field "ctx"'),
    (["", {"ctx": "a", "endings": ["b"] * 3, "label": 0}], 2,
     '"endings" must be a list of 4 texts, got 3 item(s)'),
    ([{"ctx": "a", "endings": ["b", "c", "d", 5], "label": 0}], 1, '"endings" must be'),
    ([{"ctx": "a", "endings": ["b"] * 4, "label": 4}], 1, '"label" must be an integer in 0..3'),
    ([{"ctx": "a", "endings": ["b"] * 4, "label": "1"}], 1, '"label" must be an integer'),
    ([{"ctx": "a", "endings": ["b"] * 4, "label": True}], 1,
     '"label" must be an integer in 0..3, got true'),
    ([{"ctx": "", "endings": ["b"] * 4, "label": 1}], 1, '"ctx" must be a text, not empty'),
    (["{not json"], 1, "not JSON"),
    (["[1, 2]"], 1, "a JSON list, not an object"),
])
def test_bad_lines_name_the_file_and_line(tmp_path, rows, line, says):
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(StarpuLLMError) as e:
        hellaswag.read_examples(path, TINY)
    assert f"{path}:{line}: {says}" in str(e.value), str(e.value)
    assert "hellaswag_val.jsonl" in str(e.value)


def test_bad_files(tmp_path, tiny_ckpt):
    """A file without examples, a missing one and a model without GPT-2's vocabulary are one
    clear error each; the CLI says it with status 2 and no traceback."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    with pytest.raises(StarpuLLMError, match=f"{empty} holds no example"):
        hellaswag.read_examples(str(empty), TINY)
    with pytest.raises(StarpuLLMError, match="cannot read .*nosuch.jsonl"):
        hellaswag.read_examples(str(tmp_path / "nosuch.jsonl"), TINY)
    with pytest.raises(StarpuLLMError, match="vocabulary of 250 tokens"):
        hellaswag.read_examples(str(empty), MODELS["micro"])
    bad = write_jsonl(tmp_path / "bad.jsonl", [EXAMPLES[0], {"ctx": "a", "endings": [],
                                                             "label": 0}])
    rc, out, err = eval_cli("--hellaswag", bad, "--init-from", tiny_ckpt)
    assert rc == 2 and "Traceback" not in err and out == "", err
    assert f"{bad}:2: \"endings\" must be a list of 4 texts, got 0 item(s)" in err, err


def test_train_measures_hellaswag_as_it_validates(runtime, tmp_path):
    """train --hellaswag FILE --hellaswag-every 2: acc_norm at step 0, every 2 steps and
    after the last, in the step lines and the metrics rows; step 0's is evaluate()'s on the
    initial weights. The file without N (or N without the file) is refused, and a bad file
    before the first step, naming the flag, the file and the line."""
    path = write_jsonl(tmp_path / "hs.jsonl", EXAMPLES)
    lines, metrics = [], tmp_path / "m.jsonl"
    kw = dict(model="tiny", engine="reference", batch=2, seq_len=16, hellaswag=path)
    with runtime.paused():
        r = train(TrainConfig(steps=3, hellaswag_every=2, metrics_jsonl=str(metrics),
                              log=lines.append, **kw))
        initial = hellaswag.evaluate(hellaswag.read_examples(path, TINY),
                                     gen.DirectBackend(TINY, random_init(TINY, TrainConfig.seed)),
                                     B=2).acc_norm
    assert [s for s, _ in r.hellaswag] == [0, 2, 3]
    assert r.hellaswag[0][1] == initial
    assert f"step    0/3: hellaswag acc norm {initial:.6g}" in lines, lines
    assert any(line.startswith("step    2/3: train loss") and "hellaswag acc norm" in line
               for line in lines), lines
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [(row["step"], row.get("hellaswag_acc_norm")) for row in rows] == \
        [(0, initial), (1, None), (2, r.hellaswag[1][1]), (3, r.hellaswag[2][1])]
    with pytest.raises(StarpuLLMError, match="go together"):
        train(TrainConfig(steps=1, **kw))
    bad = write_jsonl(tmp_path / "bad.jsonl", [EXAMPLES[0], {"ctx": "a", "endings": ["b"] * 4,
                                                             "label": -1}])
    lines.clear()
    with pytest.raises(StarpuLLMError) as e:
        train(TrainConfig(steps=1, hellaswag_every=1, log=lines.append, **dict(kw, hellaswag=bad)))
    assert e.value.render(flag).startswith(f"--hellaswag: {bad}:2: \"label\" must be"), e.value
    assert not any(line.startswith("step") for line in lines), lines
