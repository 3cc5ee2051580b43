"""The engine and the HTTP application in this process (no server process, no port): the
reference engine on the tiny model (GPT-2's vocabulary), the application through Starlette's
TestClient. The tokens are forced where a test needs given ones (a fake
serve/scoring.choose_batch), and a decode step is held where a test needs one stuck (a
SlotDecoder whose collect waits); time is an injected clock, never slept."""
import json
import re
import threading

import pytest
from starlette.testclient import TestClient

from starpu_llm.cli_serve import load_model
from starpu_llm.flow import batch
from starpu_llm.io import tokenizer
from starpu_llm.model.config import MODELS, GPTConfig
from starpu_llm.model.state import random_init
from starpu_llm.serve import api, scoring
from starpu_llm.serve import engine as eng
from starpu_llm.serve.app import create_app
from starpu_llm.serve.metrics import Metrics

TINY = MODELS["tiny"]
TOK = tokenizer.gpt2()
# GPT-2 tokens that end inside a UTF-8 character: b" \xf0\x9f\x98" + b"\x80" is " 😀";
# "中文" is b"\xe4\xb8\xad" (中), b"\xe6\x96" + b"\x87" (文)
SPACE_EMOJI_HEAD, EMOJI_TAIL, HI = 30325, 222, 23105
ZHONG, WEN_HEAD, WEN_TAIL = 40792, 23877, 229
EMOJI_HEAD = 47249          # b"\xf0\x9f\x98": 😀 without its last byte
SPLIT = [SPACE_EMOJI_HEAD, EMOJI_TAIL, HI, ZHONG, WEN_HEAD, WEN_TAIL]


def test_the_tokens_split_characters():
    """The premise: each pair splits one character, which decodes whole only with its tail."""
    raw = [TOK.decode_bytes(t) for t in SPLIT]
    assert TOK.decode(SPLIT) == " 😀 hi中文"
    for head in (raw[0], raw[4], TOK.decode_bytes(EMOJI_HEAD)):
        with pytest.raises(UnicodeDecodeError):
            head.decode("utf-8")


def test_text_offsets_count_the_characters_sent():
    """A token that ends inside a character moved text_offset on by one U+FFFD per stray byte
    (" 😀 hi": " hi" at 4 of a 3-character text); the offsets now count the characters the
    client gets, the character to the token that completes it, streamed (the offsets running
    on from event to event) or whole alike."""
    c = api.parse_completion({"model": "m", "prompt": "Hi", "logprobs": 0, "stream": True,
                              "max_tokens": len(SPLIT)}, "m", TOK, TINY.V, 64, 1)
    entries = [scoring.Logprob(t, -1.0) for t in SPLIT]
    streamed = []
    for e in entries:            # an event a token, as the engine sends them
        streamed += c.chunk(0, "", logprobs=(e,))["choices"][0]["logprobs"]["text_offset"]
    whole = c.response([""], ["length"], 1, len(SPLIT), logprobs=[entries])
    text = "Hi" + TOK.decode(SPLIT)
    assert streamed == whole["choices"][0]["logprobs"]["text_offset"] == [2, 3, 4, 7, 8, 8]
    # each token's slice of the text is the characters it completes, never a U+FFFD
    ends = streamed[1:] + [len(text)]
    assert [text[a:b] for a, b in zip(streamed, ends)] == [" ", "😀", " hi", "中", "", "文"]


def test_text_offsets_with_echo_start_at_the_prompt():
    """echo: the prompt's tokens first, from 0; a prompt given as token ids that splits a
    character counts it once."""
    c = api.parse_completion({"model": "m", "prompt": [HI, SPACE_EMOJI_HEAD, EMOJI_TAIL],
                              "logprobs": 0, "echo": True, "max_tokens": 0}, "m", TOK, TINY.V,
                             64, 1)
    r = c.response([""], ["length"], 3, 0, logprobs=[[scoring.Logprob(t, -1.0)
                                                       for t in (SPACE_EMOJI_HEAD, EMOJI_TAIL)]])
    assert r["choices"][0]["text"] == " hi 😀"
    assert r["choices"][0]["logprobs"]["text_offset"] == [0, 3, 4]


@pytest.fixture(scope="module")
def tiny_params():
    return random_init(TINY, 1)


def forced(script):
    """A scoring.choose_batch drawing script[k] as a sequence's k-th token, scored as the real
    one scores it."""
    def choose_batch(logits, rows, threads=None):
        return [(script[len(drawn)], scoring.score(logits[i], script[len(drawn)], sp.logprobs)
                 if sp.logprobs is not None else None)
                for i, (sp, drawn, _) in enumerate(rows)]
    return choose_batch


def events_of(response) -> list:
    return [json.loads(line[len("data: "):]) for line in response.iter_lines()
            if line.startswith("data: {")]


@pytest.mark.parametrize("script,final", [(SPLIT, " 😀 hi中文"),
                                          ([HI, EMOJI_HEAD], " hi\ufffd")])
def test_a_stream_holds_a_split_character_until_it_completes(monkeypatch, tiny_params, script,
                                                              final):
    """Streamed through the application, the generation of tokens that split characters: no
    event's text holds a U+FFFD for a character that the next token completes (its bytes wait
    for it); the text_offsets index the text the events make up, and equal the whole
    answer's; a character still incomplete at the end is flushed (U+FFFD, as the whole
    answer and `generate` decode it)."""
    monkeypatch.setattr(scoring, "choose_batch", forced(script))
    engine = eng.Engine(load_model(TINY, tiny_params, engine="reference"), TINY, TOK, TOK.eot,
                        max_batch=2)
    engine.start(180)
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": len(script), "logprobs": 1,
            "ignore_eos": True}
    try:
        with TestClient(create_app(engine, "tiny")) as client:
            with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                assert r.status_code == 200
                events = events_of(r)
            whole = client.post("/v1/completions", json=body).json()["choices"][0]
    finally:
        assert engine.close(30)
    pieces = [e["choices"][0]["text"] for e in events]
    offsets = [o for e in events if e["choices"][0]["logprobs"]
               for o in e["choices"][0]["logprobs"]["text_offset"]]
    text = "".join(pieces)
    assert text == whole["text"] == final == TOK.decode(script)
    for e in events:         # a U+FFFD only in the final flush, with the last token's score
        if "\ufffd" in e["choices"][0]["text"]:
            assert e["choices"][0]["logprobs"]["text_offset"][-1] == offsets[-1]
    assert offsets == whole["logprobs"]["text_offset"]
    # token k starts after the whole characters of the tokens before it (valid UTF-8 here:
    # "ignore" drops only an incomplete character at their end)
    assert offsets == [len("Hi") + len(TOK.decode_bytes(script[:k]).decode("utf-8", "ignore"))
                       for k in range(len(script))]
    full = "Hi" + text
    ends = offsets[1:] + [len(full)]
    assert "".join(full[a:b] for a, b in zip(offsets, ends)) == text
    assert all(full[a:b] != "\ufffd" or k == len(script) - 1
               for k, (a, b) in enumerate(zip(offsets, ends)))


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_a_stuck_step_makes_health_503_until_a_step_completes(monkeypatch, tiny_params):
    """/health answered 200 while the engine thread hung in a step (a stuck task): a load
    balancer kept sending requests to a dead server. With work pending and no step completed
    for more than --stall-timeout seconds (the clock moved on; the step held in collect),
    /health is 503 saying why and since when, and a new request is refused at once (503);
    once the step completes, 200 again. An idle engine stays healthy however long it idles.
    /metrics' starpu_llm_time_since_step_seconds counts the same seconds, 0 while idle."""
    entered, release = threading.Event(), threading.Event()

    class Stuck(batch.SlotDecoder):
        def collect(self, step):
            entered.set()
            assert release.wait(120), "the test never released the step"
            return super().collect(step)
    monkeypatch.setattr(eng, "SlotDecoder", Stuck)
    clock = Clock()
    engine = eng.Engine(load_model(TINY, tiny_params, engine="reference"), TINY, TOK, TOK.eot,
                        max_batch=2, stall_timeout=30, clock=clock, metrics=Metrics(2))
    engine.start(180)
    done = threading.Event()
    try:
        with TestClient(create_app(engine, "tiny")) as client:
            def since_step():
                text = client.get("/metrics").text
                return float(re.search(r"^starpu_llm_time_since_step_seconds (\S+)$", text,
                                       re.M).group(1))
            clock.now += 1000                       # idle for 1000 s: healthy
            assert client.get("/health").status_code == 200
            assert since_step() == 0.0
            engine.submit([eng.Request([HI, HI], eng.Sampling(max_tokens=2, top_k=1),
                                       lambda ev: ev.finish and done.set())])
            assert entered.wait(120)
            clock.now += 30                         # at the threshold: not yet
            assert client.get("/health").status_code == 200
            assert since_step() == 30.0             # from the request's arrival, not idling
            clock.now += 15
            assert since_step() == 45.0
            r = client.get("/health")
            assert r.status_code == 503
            h = r.json()
            assert h["status"] == "stalled" and h["stalled_s"] == 45.0 and h["running"] == 1
            assert "no decode step has completed for 45 s" in h["why"]
            assert "--stall-timeout 30" in h["why"] and h["since"].endswith("+00:00")
            refused = client.post("/v1/completions", json={"model": "tiny", "prompt": "Hi"})
            assert refused.status_code == 503 and refused.headers["Retry-After"]
            assert "the server is stalled" in refused.json()["error"]["message"]
            release.set()
            assert done.wait(120)
            assert client.get("/health").json()["status"] == "ok"
            assert since_step() == 0.0              # a step completed
    finally:
        release.set()
        assert engine.close(30)


def test_stall_timeout_0_never_stalls():
    config = GPTConfig(max_seq_len=64, num_layers=1, num_heads=1, channels=8)
    clock = Clock()
    for timeout, stalled in ((0, False), (5, True)):
        engine = eng.Engine(None, config, TOK, TOK.eot, stall_timeout=timeout, clock=clock)
        engine._queue.append(eng.Request([1], eng.Sampling(), print))     # work pending
        clock.now += 10**6
        assert (engine.stalled() is not None) == stalled


def test_the_stall_timeout_flag():
    """--stall-timeout: seconds, 0 turning the check off; anything else is one usage error
    naming the flag; left out, serve/settings.Serving's (300 s)."""
    from starpu_llm.serve.settings import Serving
    from starpu_llm import cli
    p = cli.build_parser()
    serve = ["serve", "--init-from", "m.bin"]
    assert p.parse_args(serve + ["--stall-timeout", "0"]).stall_timeout == 0
    assert p.parse_args(serve + ["--stall-timeout", "12.5"]).stall_timeout == 12.5
    assert p.parse_args(serve).stall_timeout == Serving.stall_timeout == 300
    for bad in ("-1", "nan", "soon"):
        with pytest.raises(cli.UsageError, match="--stall-timeout"):
            p.parse_args(serve + ["--stall-timeout", bad])


def test_a_waiting_stream_sends_keepalive_comments(monkeypatch, tiny_params):
    """A stream that waits (its step held here; in production the queue, a long prompt) sent
    nothing: a proxy's read timeout (nginx's 60 s) cut it. It now sends an SSE comment line
    after KEEPALIVE_S seconds without an event (0.05 s here), which the openai client skips;
    the stream then ends as usual."""
    from starpu_llm.serve import app
    monkeypatch.setattr(app, "KEEPALIVE_S", 0.05)
    release = threading.Event()

    class Held(batch.SlotDecoder):
        def collect(self, step):
            assert release.wait(120), "the test never released the step"
            return super().collect(step)
    monkeypatch.setattr(eng, "SlotDecoder", Held)
    engine = eng.Engine(load_model(TINY, tiny_params, engine="reference"), TINY, TOK, TOK.eot,
                        max_batch=1)
    engine.start(180)
    try:
        with TestClient(create_app(engine, "tiny")) as client:
            with client.stream("POST", "/v1/completions", json={
                    "model": "tiny", "prompt": "Hi", "max_tokens": 2, "stream": True}) as r:
                lines = r.iter_lines()
                first = next(line for line in lines if line)
                release.set()
                rest = [line for line in lines if line]
    finally:
        release.set()
        assert engine.close(30)
    assert first == ": keep-alive"
    data = [line for line in rest if line.startswith("data: ")]
    assert data[-1] == "data: [DONE]"
    assert json.loads(data[-2][len("data: "):])["choices"][0]["finish_reason"] == "length"


def test_healthy_probes_are_not_logged_at_info(caplog):
    """A load balancer probes GET /health every few seconds from each of its nodes: each probe
    was a log line at --log-level info. A 200 probe is logged at debug; a probe answered 503
    and every other request stay at info."""
    import logging
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route
    from starpu_llm.serve import middleware
    status = {"code": 200}

    async def health(request):
        return JSONResponse({}, status["code"])
    app = middleware.wrap(Starlette(routes=[Route("/health", health), Route("/other", health)]),
                          middleware.Edges(), None)
    with TestClient(app) as client, caplog.at_level(logging.INFO, "uvicorn.error"):
        client.get("/health")
        status["code"] = 503
        client.get("/health")
        status["code"] = 200
        client.get("/other")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert '"GET /health" 503' in lines[0] and '"GET /other" 200' in lines[1]


def test_a_failed_unload_is_said_not_raised_in_the_engine_thread(tiny_params):
    """StarPU's shutdown failing when the server stops (Runtime.shutdown's RuntimeError: its
    last wait or StarPU-MPI's stop failed) was a traceback in the engine thread and the run
    said "StarPU shut down", status 0; it is now the engine's close_error (run_serve prints it
    and ends with status 1), the thread ending all the same."""
    load = load_model(TINY, tiny_params, engine="reference")

    def failing():
        loaded = load()

        def close():
            loaded.close()
            raise RuntimeError("stopping StarPU: its wait for the last tasks failed (-5)")
        return loaded._replace(close=close)
    engine = eng.Engine(failing, TINY, TOK, TOK.eot, max_batch=1)
    engine.start(180)
    assert engine.close_error is None
    assert engine.close(30)
    assert engine.close_error == ("unloading the model failed: RuntimeError: stopping StarPU: "
                                  "its wait for the last tasks failed (-5)")
