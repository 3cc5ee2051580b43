"""Generation (starpu_llm/flow/generate.py): the key/value cache against full recomputation on
both engines, sampling and its seed, the streamed text, the CLI and the training hook.

The logits of the cached decoder and of the full forward are two fp32 computations of the
same exact logits: they agree within bounds.logits_bound (twice the fp32 error bound of one
run; its derivation is in tests/bounds.py), at the length of the sequence so far."""
import contextlib
import re
import subprocess
import sys

import numpy as np
import pytest

from bounds import assert_within, logits_bound
from starpu_llm.model.config import MODELS
from starpu_llm.errors import StarpuLLMError
from starpu_llm.flow import generate as gen
from starpu_llm.runtime.submit import StarPUOps
from starpu_llm.io import formats, tokenizer
from starpu_llm.model.state import random_init
from starpu_llm.training.trainer import TrainConfig, train

MICRO, TINY = MODELS["micro"], MODELS["tiny"]


def params_of(config, seed=3):
    """random_init, every tensor moved by N(0, 0.02) so that biases, layernorm parameters and
    every position embedding matter."""
    p = random_init(config, seed)
    return p + np.random.default_rng(seed).standard_normal(p.size).astype(np.float32) * 0.02


@pytest.fixture
def starpu_idle(runtime):
    """StarPU paused: its idle workers would spin on the cores that the reference engine or a
    subprocess uses."""
    with runtime.paused():
        yield


@pytest.fixture(params=["reference", "starpu"])
def make_backend(request, runtime):
    """make(config, params): a backend of the engine, closed at the end of the test."""
    made = []
    starpu = request.param == "starpu"

    def make(config, params):
        b = (gen.StarPUBackend(runtime, config, params) if starpu
             else gen.DirectBackend(config, params))
        made.append(b)
        return b

    with contextlib.nullcontext() if starpu else runtime.paused():
        yield make
    for b in reversed(made):
        b.close()


@pytest.mark.parametrize("name,prompt_len,new,chunk", [("micro", 9, 23, 4), ("tiny", 5, 16, 64)])
def test_greedy_with_cache_equals_full_recomputation(make_backend, name, prompt_len, new, chunk):
    """Token for token, and the logits of every step within the fp32 bound. micro goes to its
    last position (9 + 23 = maxT) with a prompt prefilled in chunks of 4 positions."""
    config = MODELS[name]
    backend = make_backend(config, params_of(config))
    prompt = np.random.default_rng(0).integers(0, config.V, prompt_len)
    cached, full = gen.Decoder(backend, chunk=chunk), gen.Recompute(backend)
    lc, lf = cached.feed([prompt])[0], full.feed([prompt])[0]
    tokens = []
    for i in range(new):
        T = prompt_len + i          # the sequence so far
        assert_within(lc, lf, logits_bound(config, 1, T, np.abs(lf).max()),
                      f"{name}: logits after {T} tokens")
        token = int(np.argmax(lc))
        assert token == int(np.argmax(lf)), (name, i)
        tokens.append(token)
        if i + 1 < new:
            lc, lf = cached.feed([[token]])[0], full.feed([[token]])[0]
    # generate() greedy, through the cache and by full recomputation, gives the same tokens
    assert gen.generate(cached, prompt, new, top_k=1) == tokens
    assert gen.generate(full, prompt, new, temperature=0.0) == tokens


def test_batch_of_two_sequences(make_backend):
    backend = make_backend(MICRO, params_of(MICRO))
    prompts = np.random.default_rng(1).integers(0, MICRO.V, (2, 6))
    cached, full = gen.Decoder(backend, B=2, chunk=4), gen.Recompute(backend, B=2)
    lc, lf = cached.feed(prompts), full.feed(prompts)
    for step in range(3):
        T = 6 + step
        assert_within(lc, lf, logits_bound(MICRO, 2, T, np.abs(lf).max()), f"after {T} tokens")
        nxt = np.argmax(lf, axis=1)[:, None]
        lc, lf = cached.feed(nxt), full.feed(nxt)


def test_same_seed_same_tokens(make_backend):
    decoder = gen.Decoder(make_backend(MICRO, params_of(MICRO)))

    def run(seed):
        return gen.generate(decoder, [1, 2, 3], 20, temperature=1.0, top_k=40,
                            rng=np.random.default_rng(seed))

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_too_long_says_maxT(make_backend):
    decoder = gen.Decoder(make_backend(MICRO, params_of(MICRO)))
    with pytest.raises(StarpuLLMError, match=r"maxT = 32"):
        gen.generate(decoder, list(range(30)), 3)
    gen.generate(decoder, list(range(30)), 2, top_k=1)      # 32 tokens: fits
    assert decoder.pos == 31                 # the last token drawn is not fed
    decoder.feed([[1]])
    with pytest.raises(StarpuLLMError, match=r"maxT = 32"):
        decoder.feed([[1]])                  # a 33rd position


@pytest.mark.parametrize("name, value, message", [
    ("temperature", float("inf"), "temperature must be a finite number >= 0, got inf"),
    ("temperature", -0.5, "temperature must be a finite number >= 0, got -0.5"),
    ("top_k", -1, "top_k must be >= 0, got -1"),
    ("top_p", 0.0, "top_p must be in (0, 1], got 0.0"),
    ("max_new_tokens", 0, "max_new_tokens must be at least 1, got 0"),
    ("top_k", 2.5, "top_k expects a whole number, got 2.5"),
])
def test_a_generation_keeps_its_flags_rules(name, value, message):
    """From Python (check_request: generate(), run_generate) a sampling setting keeps the rule
    of its flag, both stated once by its flow/generate.Generating field: the message names the
    field, the flag's the flag (an infinite temperature was taken before, and drew the argmax
    of a NaN softmax)."""
    from starpu_llm import cli
    request = {**dict(max_new_tokens=4, temperature=1.0, top_k=0, top_p=1.0), name: value}
    with pytest.raises(StarpuLLMError, match=f"^{re.escape(message)}$"):
        gen.check_request(MICRO, 1, **request)
    flag = "--" + name.replace("_", "-")
    rule = message[len(name):].split(", got")[0]
    with pytest.raises(cli.UsageError, match=re.escape(flag + rule)):
        cli.build_parser().parse_args(["generate", "--init-from", "m.bin", flag, str(value)])


def test_decode_tasks_and_cache_modes(runtime):
    """A feed of 3 tokens in chunks of 2 is a prefill step of 2 positions and a step of 1 with
    the lm head; StarPU ran kv_append with the caches RW (the earlier positions are kept) and
    attention_decode with them R."""
    from starpu_llm._clib import lib
    from starpu_llm.runtime.starpu import read_trace
    backend = gen.StarPUBackend(runtime, MICRO, params_of(MICRO))
    try:
        backend.ops = StarPUOps(record=True)
        decoder = gen.Decoder(backend, chunk=2)
        runtime.start_trace(10_000)
        try:
            decoder.feed([[1, 2, 3]])
            events = read_trace()
        finally:
            runtime.stop_trace()
        block = ["layernorm_forward", "matmul_forward", "kv_append", "attention_decode",
                 "matmul_forward", "residual_forward", "layernorm_forward", "matmul_forward",
                 "gelu_forward", "matmul_forward", "residual_forward"]
        step = ["encoder_decode"] + block * MICRO.L
        assert backend.ops.records == step + step + ["layernorm_forward", "matmul_forward"]
        r, rw = lib.SL_ACCESS_R, lib.SL_ACCESS_R | lib.SL_ACCESS_W
        modes = {name: [tuple(m for _, m in e[5]) for e in events if e[0] == name]
                 for name in ("kv_append", "attention_decode")}
        assert modes["kv_append"] == [(rw, rw, r, r)] * (2 * MICRO.L)
        assert modes["attention_decode"] == [(lib.SL_ACCESS_W, r, r, r, r)] * (2 * MICRO.L)
    finally:
        backend.close()


def test_sample_greedy_top_k_temperature():
    rng = np.random.default_rng(0)
    logits = np.array([0.0, 3.0, 1.0, 2.9, -1.0])
    assert gen.sample(logits, 1.0, 1, rng) == 1
    assert gen.sample(logits, 0.0, 0, rng) == 1
    assert {gen.sample(logits, 1.0, 2, rng) for _ in range(300)} == {1, 3}
    assert {gen.sample(logits, 100.0, 0, rng) for _ in range(500)} == set(range(5))
    # the frequencies follow softmax(logits / T): within 5 standard deviations of n draws
    n, temp = 20000, 0.7
    p = np.exp(logits / temp) / np.exp(logits / temp).sum()
    counts = np.bincount([gen.sample(logits, temp, 0, rng) for _ in range(n)], minlength=5)
    assert np.all(np.abs(counts - n * p) <= 5 * np.sqrt(n * p * (1 - p)) + 1), (counts, n * p)


def _is_utf8(b):
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_stream_decoder_waits_for_whole_characters():
    tok = tokenizer.gpt2()
    text = "naïve café 😀 日本語"
    ids = tok.encode(text)
    assert not all(_is_utf8(tok.decode_bytes(i)) for i in ids)   # some token splits a character
    pieces = []
    stream = tokenizer.StreamDecoder(tok, pieces.append)
    for i in ids:
        stream(i)
    stream.close()
    assert "".join(pieces) == text
    # a character cut short at the end: what is left becomes U+FFFD at close()
    first = next(i for i in ids if not _is_utf8(tok.decode_bytes(i)))
    pieces = []
    stream = tokenizer.StreamDecoder(tok, pieces.append)
    stream(first)
    assert "\ufffd" not in "".join(pieces)     # the incomplete character waits
    stream.close()
    assert "".join(pieces) == tok.decode([first]) and "\ufffd" in pieces[-1]


def cli(*args):
    p = subprocess.run([sys.executable, "-m", "starpu_llm", "generate", *map(str, args)],
                       capture_output=True, text=True, timeout=300)
    return p.returncode, p.stdout, p.stderr


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("gen") / "tiny.bin"
    formats.write_checkpoint(path, TINY, params_of(TINY))
    return path


def test_cli_generate_is_reproducible(starpu_idle, tiny_ckpt):
    args = ["--init-from", tiny_ckpt, "--prompt", "Hello, world", "--max-new-tokens", 12,
            "--top-k", 40, "--temperature", 0.9]
    rc, out, err = cli(*args, "--seed", 7)
    assert rc == 0, err
    assert out.startswith("Hello, world") and len(out) > len("Hello, world\n")
    assert cli(*args, "--seed", 7)[1] == out
    assert cli(*args, "--seed", 8)[1] != out


def test_cli_greedy_both_engines(starpu_idle, tiny_ckpt):
    args = ["--init-from", tiny_ckpt, "--max-new-tokens", 10, "--top-k", 1]
    rc, out, err = cli(*args)
    assert rc == 0, err
    assert cli(*args, "--engine", "reference")[1] == out
    # --top-p: a nucleus of almost no probability is the most likely token alone, drawn
    assert cli("--init-from", tiny_ckpt, "--max-new-tokens", 10, "--top-p", 1e-9)[1] == out


def test_cli_errors(starpu_idle, tiny_ckpt, tmp_path):
    rc, _, err = cli("--init-from", tiny_ckpt, "--prompt", "Hi", "--max-new-tokens", 64)
    assert rc == 2 and "Traceback" not in err
    assert "maxT = 64" in err and "--max-new-tokens" in err, err
    micro = tmp_path / "micro.bin"
    formats.write_checkpoint(micro, MICRO, params_of(MICRO))
    rc, _, err = cli("--init-from", micro)
    assert rc == 2 and "vocabulary of 250 tokens" in err, err
    rc, _, err = cli("--init-from", tiny_ckpt, "--top-k", -1)
    assert rc == 2 and "--top-k must be >= 0" in err, err
    rc, _, err = cli("--init-from", tiny_ckpt, "--top-p", 0)
    assert rc == 2 and "--top-p must be in (0, 1]" in err, err
    rc, _, err = cli("--init-from", tiny_ckpt, "--workers", 0)
    assert rc == 2 and "--workers must be at least 1" in err, err
    from starpu_llm.runtime.starpu import have_cuda
    if not have_cuda():       # a CPU build names the flag and how to get a CUDA build
        rc, _, err = cli("--init-from", tiny_ckpt, "--gpus", 1)
        assert rc == 2 and "--gpus 1" in err and "CPU build" in err, err


_GENERATE_ON = """
import sys
from starpu_llm import cli, cli_generate
real = cli_generate.Runtime


def runtime(partition=None):
    print("partition", partition.workers, partition.cores_per_worker, partition.gpus,
          file=sys.stderr)
    return real(partition)


cli_generate.Runtime = runtime
sys.exit(cli.main(["generate", *sys.argv[1:]]))
"""


def test_generate_runs_on_the_partition_its_flags_ask(starpu_idle, tiny_ckpt):
    """generate's partition flags (serve's) reach the runtime it starts: 2 workers of 1 core
    asked, 2 started, and the same greedy text as the default partition's one worker."""
    def run(*flags):
        p = subprocess.run([sys.executable, "-c", _GENERATE_ON, "--init-from", str(tiny_ckpt),
                            "--prompt", "Hello", "--max-new-tokens", "6", "--top-k", "1",
                            *flags], capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        return p.stdout, [l for l in p.stderr.splitlines() if l.startswith("partition ")]
    two, started_two = run("--workers", "2", "--cores-per-worker", "1")
    one, started_one = run()
    assert started_two == ["partition 2 1 0"] and started_one[0].startswith("partition 1 ")
    assert two == one and two.startswith("Hello") and len(two) > len("Hello\n")


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    path = tmp_path_factory.mktemp("gen_data") / "micro.bin"
    formats.write_shard(path, np.random.default_rng(0).integers(0, MICRO.V, 4000).astype(np.uint16))
    return str(path)


@pytest.mark.parametrize("engine", ["starpu", "reference"])
def test_sample_every_leaves_training_unchanged(runtime, shard, engine):
    def run(**kw):
        cfg = TrainConfig(model="micro", train_data=shard, batch=2, seq_len=16, steps=4, lr=1e-2,
                          engine=engine, **kw)
        return train(cfg, runtime=runtime if engine == "starpu" else None)

    lines = []
    with contextlib.nullcontext() if engine == "starpu" else runtime.paused():
        plain = run(log=None)
        sampled = run(sample_every=2, log=lines.append)
    assert sampled.losses == plain.losses
    assert np.array_equal(sampled.state.params, plain.state.params)
    samples = [l for l in lines if l.startswith("sample at step")]
    assert [s.split(":")[0] for s in samples] == ["sample at step 2", "sample at step 4"]
    assert samples[0].split(":", 1)[1] != samples[1].split(":", 1)[1]
