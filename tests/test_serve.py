"""`starpu-llm serve` (starpu_llm/serve/, docs/serving.md) as a client sees it: a real server
process on a free port of 127.0.0.1, driven by the official openai package, by curl and by raw
HTTP.

The model is tiny (GPT-2's vocabulary, maxT 64) with peaked logits (test_batch.peaked_params):
the greedy continuation of each prompt is computed here, one prompt at a time, by
flow/generate.generate on the reference engine, and every answer must be exactly that text,
whatever else shared the server's batch. The tests of time (disconnects, a full queue,
shutdown) use a model with maxT 1024, so that a request of 1000 tokens is still running
while the test acts; none of them measures a time."""
import concurrent.futures
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
import openai
import pytest

import test_serve_edges as edges_test
from bounds import logits_bound
from starpu_llm.model.config import MODELS, GPTConfig
from starpu_llm.flow import generate as gen
from starpu_llm.io import formats, tokenizer
from starpu_llm.runtime.starpu import have_cuda
from test_batch import peaked_params

TINY = MODELS["tiny"]
# GPT-2's vocabulary, maxT 1024: long requests at a small cost per token
LONG = GPTConfig(max_seq_len=1024, num_layers=1, num_heads=2, channels=32)
START_S = 180          # generous: a loaded 2-core machine
PROMPTS = ["Hello, world", "ROMEO:", "The quick brown fox", "To be, or not to be",
           "Once upon a time", "<|endoftext|>", "A", "naïve café 😀", "1 2 3 4 5",
           "What is StarPU?"]
LONGEST_NEW = 20


class Server:
    """A `starpu-llm serve` process: its URL, and its output files."""

    def __init__(self, ckpt, tmp, *flags, name="server", code=None, env=None):
        """code: Python run in place of `-m starpu_llm` (FAULTY: a fault hook, then the CLI)."""
        self.out, self.err = tmp / f"{name}.out", tmp / f"{name}.err"
        start = ["-m", "starpu_llm"] if code is None else ["-c", code]
        self.headers = {}           # sent by get, post and metric (a key)
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, *start, "serve", "--init-from", str(ckpt),
                 "--port", "0", "--log-level", "warning", *map(str, flags)],
                stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            m = re.search(r"on (http://[\d.]+:\d+)", self.out.read_text())
            if m:
                self.url = m.group(1)
                self.port = int(self.url.rsplit(":", 1)[1])
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        self.stop()
        raise AssertionError(f"the server did not start: {self.output()}")

    def output(self) -> str:
        return self.out.read_text() + self.err.read_text()

    def client(self, key="none", **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, **kw)

    def get(self, path):
        return httpx.get(self.url + path, headers=self.headers, timeout=60)

    def post(self, body, **kw):
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        kw.setdefault("headers", self.headers)
        return httpx.post(self.url + "/v1/completions", content=content, timeout=120, **kw)

    def metric(self, name) -> float:
        """A metric's value (the sum of its series)."""
        text = self.get("/metrics").text
        return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$",
                                                text, re.M))

    def stop(self, sig=signal.SIGTERM, timeout=120) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"the server did not stop within {timeout} s: {self.output()}")


def wait_for(what, ok, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = ok()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve")
    tiny, long = d / "tiny.bin", d / "long.bin"
    formats.write_checkpoint(tiny, TINY, peaked_params(TINY))
    formats.write_checkpoint(long, LONG, peaked_params(LONG))
    return {"tiny": tiny, "long": long, "dir": d}


@pytest.fixture(scope="module")
def expected():
    """{prompt: greedy token ids} (LONGEST_NEW of them) of generate() on the reference engine,
    one prompt at a time; the top logit of every step leads the second by more than twice the
    fp32 bound of two computations of the logits (test_batch's argument): the server, whatever
    shares its batch, picks the same tokens."""
    tok = tokenizer.gpt2()
    backend = gen.DirectBackend(TINY, peaked_params(TINY))
    out = {}
    for p in PROMPTS:
        decoder = gen.Decoder(backend)
        ids = tok.encode(p)
        logits = decoder.feed([ids])[0]
        tokens = []
        for _ in range(LONGEST_NEW):
            top2 = np.sort(logits)[-2:]
            bound = logits_bound(TINY, 1, len(ids) + len(tokens), np.abs(logits).max())
            assert top2[1] - top2[0] > 2 * bound, f"{p!r}: the logits are not peaked enough"
            tokens.append(int(np.argmax(logits)))
            logits = decoder.feed([[tokens[-1]]])[0]
        assert tokens == gen.generate(decoder, ids, LONGEST_NEW, top_k=1)
        out[p] = tokens
    return out


def text_of(tokens):
    return tokenizer.gpt2().decode(tokens)


@pytest.fixture(scope="module")
def server(ckpts):
    s = Server(ckpts["tiny"], ckpts["dir"], "--max-batch", 8, name="main")
    yield s
    assert s.stop() == 0, s.output()
    assert "stopped: StarPU shut down" in s.output()


GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def test_openai_completion_is_single_prompt_generate(server, expected):
    client = server.client(max_retries=0)
    assert [m.id for m in client.models.list()] == ["tiny"]
    for p in PROMPTS[:4]:
        r = client.completions.create(model="tiny", prompt=p, max_tokens=12, **GREEDY)
        assert r.choices[0].text == text_of(expected[p][:12])
        assert r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == 12
        assert r.usage.prompt_tokens == len(tokenizer.gpt2().encode(p))
    # several prompts in one request: a choice each, in order
    r = client.completions.create(model="tiny", prompt=PROMPTS[4:7], max_tokens=5, **GREEDY)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [text_of(expected[p][:5]) for p in PROMPTS[4:7]]


def test_openai_streaming(server, expected):
    client = server.client(max_retries=0)
    p = PROMPTS[7]
    chunks = list(client.completions.create(model="tiny", prompt=p, max_tokens=LONGEST_NEW,
                                            stream=True, stream_options={"include_usage": True},
                                            **GREEDY))
    pieces = [c.choices[0].text for c in chunks if c.choices]
    assert len(pieces) > 1
    assert "".join(pieces) == text_of(expected[p])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == LONGEST_NEW



def test_a_stream_is_not_buffered_by_a_proxy(server):
    """nginx buffers a proxied answer by default (proxy_buffering on): a stream's tokens
    reached the client in bursts of its buffers. A stream says X-Accel-Buffering: no (nginx
    then passes each event on at once) and Cache-Control: no-cache."""
    with httpx.stream("POST", server.url + "/v1/completions", timeout=120,
                      json={"model": "tiny", "prompt": "Hi", "max_tokens": 2, "stream": True}) as r:
        assert r.headers["X-Accel-Buffering"] == "no"
        assert r.headers["Cache-Control"] == "no-cache"
        assert r.read().endswith(b"data: [DONE]\n\n")

def test_sampling_seed_and_stop(server, expected):
    client = server.client(max_retries=0)

    def sampled(seed):
        return client.completions.create(model="tiny", prompt="Hello", max_tokens=20,
                                         temperature=1.0, top_p=0.9, seed=seed,
                                         extra_body={"top_k": 40}).choices[0].text
    assert sampled(5) == sampled(5)
    assert sampled(5) != sampled(6)
    # -1: no seed, as llama.cpp's and vLLM's servers take it (their clients send it; a 400)
    assert sampled(-1) != sampled(-1)
    # a stop string: the text ends before it, finish_reason "stop"
    p = PROMPTS[0]
    full = text_of(expected[p])
    stop = full[len(full) // 2:len(full) // 2 + 3]
    r = client.completions.create(model="tiny", prompt=p, max_tokens=LONGEST_NEW, stop=[stop],
                                  **GREEDY)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[:full.index(stop)]
    # streamed, the stop string is held back too
    chunks = client.completions.create(model="tiny", prompt=p, max_tokens=LONGEST_NEW,
                                       stop=stop, stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in chunks) == full[:full.index(stop)]


def test_curl(server, expected):
    def curl(*args):
        p = subprocess.run(["curl", "-sS", "--max-time", "120", *args], capture_output=True,
                           text=True, timeout=180)
        assert p.returncode == 0, p.stderr
        return p.stdout
    assert json.loads(curl(server.url + "/v1/models"))["data"][0]["id"] == "tiny"
    assert json.loads(curl(server.url + "/health"))["status"] == "ok"
    p = PROMPTS[1]
    body = {"model": "tiny", "prompt": p, "max_tokens": 7, "temperature": 0, "ignore_eos": True}
    out = json.loads(curl(server.url + "/v1/completions", "-H", "Content-Type: application/json",
                          "-d", json.dumps(body)))
    assert out["choices"][0]["text"] == text_of(expected[p][:7])
    events = curl("-N", server.url + "/v1/completions", "-d", json.dumps({**body, "stream": True}))
    data = [line[len("data: "):] for line in events.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    assert "".join(json.loads(d)["choices"][0]["text"] for d in data[:-1]) == out["choices"][0]["text"]
    assert "starpu_llm_time_to_first_token_seconds_count" in curl(server.url + "/metrics")


def test_200_requests_at_concurrency_32(server, expected):
    """Every request answered with its own prompt's text: nothing lost, nothing mixed."""
    client = server.client(max_retries=0, timeout=300)
    before = server.metric("starpu_llm_requests_total")
    work = [(PROMPTS[i % len(PROMPTS)], 1 + (7 * i) % LONGEST_NEW, i % 3 == 0)
            for i in range(200)]

    def one(job):
        p, n, stream = job
        if stream:
            chunks = client.completions.create(model="tiny", prompt=p, max_tokens=n,
                                               stream=True, **GREEDY)
            return "".join(c.choices[0].text for c in chunks), n
        r = client.completions.create(model="tiny", prompt=p, max_tokens=n, **GREEDY)
        return r.choices[0].text, r.usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(one, work))
    assert len(answers) == 200
    for (p, n, _), (text, count) in zip(work, answers):
        assert (text, count) == (text_of(expected[p][:n]), n), (p, n)
    assert server.metric("starpu_llm_requests_total") - before == 200
    # batching happened: some steps carried more than one sequence
    text = server.get("/metrics").text
    one_seq = float(re.search(r'^starpu_llm_step_sequences_bucket{le="1.0"} (\S+)$', text,
                              re.M).group(1))
    assert server.metric("starpu_llm_step_sequences_count") > one_seq


BAD = [
    (b'{"model": "tiny", "prompt": "Hi"', 400, "not valid JSON"),
    (b'[1, 2]', 400, "must be a JSON object, got an array"),
    (b'null', 400, "must be a JSON object, got null"),
    ({"model": None, "prompt": "Hi"}, 400, "model is required"),
    (b'{"model": "tiny", "prompt": "Hi", "max_token": 5}', 400, "unknown field 'max_token'"),
    ({"model": "tiny", "prompt": "word " * 80}, 400, "maxT = 64"),
    ({"model": "tiny", "prompt": "Hi", "max_tokens": 64}, 400, "lower max_tokens to at most 63"),
    ({"model": "tiny", "prompt": "Hi", "max_tokens": 0}, 400, "max_tokens must be >= 1"),
    ({"model": "tiny", "prompt": "Hi", "temperature": -0.5}, 400,
     "temperature must be a finite number >= 0, got -0.5"),
    ({"model": "tiny", "prompt": "Hi", "temperature": "hot"}, 400, "temperature must be a number"),
    ({"model": "tiny", "prompt": "Hi", "top_p": 0}, 400, "top_p must be in (0, 1]"),
    ({"model": "tiny", "prompt": "Hi", "seed": -2}, 400,
     "seed must be in -1..18446744073709551615"),
    ({"model": "tiny", "prompt": "Hi", "seed": -1.0}, 400, "seed must be an integer"),
    ({"model": "tiny", "prompt": "Hi", "n": 9}, 400, "more than this server runs at once"),
    ({"model": "tiny", "prompt": "Hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "at most 4"),
    ({"model": "tiny", "prompt": [1, 2, 50257]}, 400, "token id 50257"),
    ({"model": "tiny", "prompt": []}, 400, "prompt must be"),
    ({"model": "tiny"}, 400, "prompt is required"),
    ({"model": "tiny", "prompt": "Hi", "best_of": 2}, 400, "best_of is not supported"),
    ({"model": "tiny", "prompt": "Hi", "best_of": True}, 400, "best_of is not supported"),
    ({"model": "tiny", "prompt": "Hi", "logit_bias": {"\u00b2": 1}}, 400,
     "logit_bias key '\u00b2' is not a token id"),
    ({"model": "tiny", "prompt": "Hi", "logit_bias": {"7" * 5000: 1}}, 400,
     "is not a token id in [0, 50257)"),
    ({"model": "tiny", "prompt": "Hi", "stream_options": {"include_usage": True}}, 400,
     "only allowed with stream"),
    (b'{"model": "tiny", "prompt": "\\ud800"}', 400, "lone surrogate"),
    (b'{"model": "tiny", "prompt": "caf\xe9"}', 400, "not valid UTF-8"),
    (b'{"model": "tiny", "prompt": "Hi", "temperature": NaN}', 400, "not valid JSON"),
    (b'{"model": "tiny", "prompt": "Hi", "seed": ' + b"7" * 5000 + b'}', 400,
     "seed is an integer of 5000 digits; this API takes integers of at most 100 digits"),
    (b'{"model": "tiny", "prompt": [1, -' + b"7" * 4301 + b']}', 400,
     "prompt[1] is an integer of 4301 digits"),
    ({"model": "gpt-4", "prompt": "Hi"}, 404, "this server serves 'tiny'"),
    ({"model": 5, "prompt": "Hi"}, 400, "model must be a string, got 5"),
    (b'{"model": "tiny", "prompt": "' + b"a" * (17 << 20) + b'"}', 413, "larger than 16 MiB"),
]


@pytest.mark.parametrize("body,status,message", BAD, ids=[m for _, _, m in BAD])
def test_bad_input_is_one_clear_error(server, expected, body, status, message):
    r = server.post(body)
    assert r.status_code == status
    err = r.json()["error"]
    assert message in err["message"], err["message"]
    assert "Traceback" not in err["message"] and "\n" not in err["message"]
    assert "sys." not in err["message"]             # no word of Python's internals
    # and the server goes on serving
    ok = server.post({"model": "tiny", "prompt": "ROMEO:", "max_tokens": 3, "temperature": 0,
                      "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == text_of(expected["ROMEO:"][:3])


@pytest.mark.parametrize("body, field, message", [
    (b'{"seed": %s}', "seed", "seed is an integer of 4301 digits"),
    (b'{"prompt": [[1], [2, %s]]}', "prompt", "prompt[1][1] is an integer of 4301 digits"),
    (b'{"messages": [{"content": [{"text": %s}]}]}', "messages",
     "messages[0].content[0].text is an integer of 4301 digits"),
    (b'[1, %s]', None, "the request body holds an integer of 4301 digits"),
])
def test_an_integer_of_thousands_of_digits_names_its_field(body, field, message):
    """An integer past Python's 4300 digits was a 400 quoting Python's own error
    ("use sys.set_int_max_str_digits() to increase the limit") and naming no field: it is one
    400 naming the field (its path) or the body, before any check of the fields; the
    strings and floats of as many digits, and integers of 100, parse as before."""
    from starpu_llm.serve import api
    from starpu_llm.serve.errors import BadRequest
    with pytest.raises(BadRequest) as e:
        api.parse_json(body % (b"-" + b"9" * 4301))
    assert e.value.message.startswith(message) and "sys." not in e.value.message
    assert e.value.param == field and e.value.status == 400
    digits = "7" * 4301
    assert api.parse_json(b'{"a": "%s", "b": 0.%s, "c": %s}' % ((digits.encode(),) * 2 + (
        b"1" * 100,))) == {"a": digits, "b": float("0." + digits), "c": int("1" * 100)}


def test_a_host_header_of_another_name_is_refused(server):
    """The server run by the command checks the Host header against its --host 127.0.0.1
    (tests/test_serve_edges.py has the rule): a rebinding domain's name is 400 naming
    --allow-host, the address and localhost are served."""
    r = httpx.get(server.url + "/v1/models", headers={"Host": "rebound.example"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "host_not_allowed"
    assert "--allow-host rebound.example" in r.json()["error"]["message"]
    for host in (f"localhost:{server.port}", f"127.0.0.1:{server.port}"):
        assert httpx.get(server.url + "/v1/models", headers={"Host": host},
                         timeout=60).status_code == 200


def test_a_top_k_beyond_the_vocabulary_keeps_every_token(server):
    """top_k of 10^20 (past a C long) is every token, as top_k 0: the same seeded draw, and
    the server goes on (it ended on an OverflowError)."""
    texts = []
    for top_k in (10 ** 20, 0):
        r = server.post({"model": "tiny", "prompt": "ROMEO:", "max_tokens": 4, "seed": 5,
                         "temperature": 1.0, "top_k": top_k, "ignore_eos": True})
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["text"])
    assert texts[0] == texts[1]


def test_bad_input_through_the_openai_client(server):
    client = server.client(max_retries=0)
    with pytest.raises(openai.BadRequestError, match="temperature must be a finite number >= 0"):
        client.completions.create(model="tiny", prompt="Hi", temperature=-1)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nope", prompt="Hi")
    r = httpx.get(server.url + "/v2/nothing", timeout=60)
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(server.url + "/v1/completions", timeout=60)
    assert r.status_code == 405 and "error" in r.json()


# ---- time: a full queue, disconnects, shutdown (the long model)

LONG_BODY = {"model": "long", "prompt": "Hello", "max_tokens": 1000, "temperature": 0,
             "ignore_eos": True}


def raw_request(port, body: dict):
    """A POST /v1/completions sent on a socket of our own (so that the test closes it)."""
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=120)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
              b"Content-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return s


@pytest.fixture(scope="module")
def one_slot(ckpts):
    """A server of the long model with one slot and room for one waiting request."""
    s = Server(ckpts["long"], ckpts["dir"], "--max-batch", 1, "--max-queue", 1, name="one_slot")
    yield s
    assert s.stop() == 0, s.output()


def read_until(sock, marker: bytes) -> bytes:
    """What the socket brings until marker has come (it comes: the test waits for it)."""
    got = b""
    while marker not in got:
        piece = sock.recv(4096)
        assert piece, f"the connection closed before {marker!r}: {got!r}"
        got += piece
    return got


def running(server):
    return server.get("/health").json()["running"]


def test_client_disconnect_frees_its_slot(one_slot):
    for stream in (True, False):
        cancelled = one_slot.metric("starpu_llm_requests_total")
        s = raw_request(one_slot.port, {**LONG_BODY, "stream": stream})
        if stream:
            read_until(s, b"data: ")          # it is streaming
        wait_for("the request to run", lambda: running(one_slot) == 1)
        s.close()
        wait_for("the slot to be freed", lambda: running(one_slot) == 0)
        # it ended cancelled (it had up to 1000 tokens to go), not finished
        text = one_slot.get("/metrics").text
        assert re.search(r'^starpu_llm_requests_total{outcome="cancelled"} (\S+)$', text, re.M)
        assert one_slot.metric("starpu_llm_requests_total") == cancelled + 1
        assert float(re.search(r'^starpu_llm_requests_total{outcome="cancelled"} (\S+)$', text,
                               re.M).group(1)) == (1 if stream else 2)
    # the slot serves the next request
    r = one_slot.post({**LONG_BODY, "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_full_queue_is_503_with_retry_after(one_slot):
    first = raw_request(one_slot.port, {**LONG_BODY, "stream": True})
    try:
        read_until(first, b"data: ")          # the slot is taken, for 1000 tokens
        second = raw_request(one_slot.port, {**LONG_BODY, "stream": True})   # waits: the queue
        try:
            wait_for("the second request to wait", lambda: one_slot.get("/health").json()["waiting"] == 1)
            r = one_slot.post(LONG_BODY)
            assert r.status_code == 503
            assert int(r.headers["Retry-After"]) >= 1
            assert "the server is busy" in r.json()["error"]["message"]
            with pytest.raises(openai.APIStatusError) as e:
                one_slot.client(max_retries=0).completions.create(model="long", prompt="Hi")
            assert e.value.status_code == 503
        finally:
            second.close()
    finally:
        first.close()
    wait_for("the slot to be freed", lambda: running(one_slot) == 0)
    assert one_slot.metric("starpu_llm_requests_total") >= 2


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_finishes_running_requests_then_stops(ckpts, sig):
    s = Server(ckpts["long"], ckpts["dir"], "--shutdown-timeout", 120, name=f"stop{sig}")
    try:
        with httpx.stream("POST", s.url + "/v1/completions", timeout=300,
                          json={**LONG_BODY, "max_tokens": 300, "stream": True}) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            s.proc.send_signal(sig)
            # no new connection is accepted
            wait_for("the port to close", lambda: not _accepts(s.port))
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        chunks = [json.loads(d[len("data: "):]) for d in [first] + rest[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert len([c for c in chunks if c["choices"][0]["text"]]) == 300
        assert s.proc.wait(120) == 0, s.output()
        assert "stopped: StarPU shut down" in s.output()
    finally:
        s.stop()


def test_shutdown_bound_cancels_what_is_left(ckpts):
    s = Server(ckpts["long"], ckpts["dir"], "--shutdown-timeout", 0, name="bound")
    try:
        with httpx.stream("POST", s.url + "/v1/completions", timeout=300,
                          json={**LONG_BODY, "stream": True}) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            s.proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        err = json.loads(rest[-2][len("data: "):])
        assert "shutting down" in err["error"]["message"]
        assert s.proc.wait(120) == 0, s.output()
        assert "stopped: StarPU shut down" in s.output()
    finally:
        s.stop()


def test_a_second_sigint_answers_every_request(ckpts):
    """SIGINT, then SIGINT again: the running requests are cancelled at once and each is
    answered (a stream's error event and [DONE], a whole request's 503 in OpenAI's shape);
    uvicorn's forced exit cut them (a 500 in plain text, a stream without its end, a
    traceback in the log)."""
    s = Server(ckpts["long"], ckpts["dir"], "--shutdown-timeout", 120, name="twice",
               code=FAULTY)
    slow = {**LONG_BODY, "prompt": [SLOW_MARK, 5]}       # a step a second: running on
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool, \
                httpx.stream("POST", s.url + "/v1/completions", timeout=300,
                             json={**slow, "stream": True}) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            whole = pool.submit(s.post, slow)
            wait_for("both requests to run", lambda: running(s) == 2)
            s.proc.send_signal(signal.SIGINT)
            wait_for("the port to close", lambda: not _accepts(s.port))
            s.proc.send_signal(signal.SIGINT)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        assert "shutting down" in json.loads(rest[-2][len("data: "):])["error"]["message"]
        r = whole.result()
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
        assert s.proc.wait(120) == 0, s.output()
        assert "Traceback" not in s.output()
    finally:
        s.stop()


def _accepts(port) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=5):
        return True
    return False


def test_serve_errors(ckpts, tmp_path):
    def serve(*args):
        p = subprocess.run([sys.executable, "-m", "starpu_llm", "serve", *map(str, args)],
                           capture_output=True, text=True, timeout=300)
        return p.returncode, p.stderr
    rc, err = serve("--init-from", tmp_path / "none.bin")
    assert rc == 2 and "none.bin" in err and "Traceback" not in err, err
    micro = tmp_path / "micro.bin"
    formats.write_checkpoint(micro, MODELS["micro"], peaked_params(MODELS["micro"]))
    rc, err = serve("--init-from", micro)
    assert rc == 2 and "vocabulary of 250 tokens" in err, err
    rc, err = serve("--init-from", ckpts["tiny"], "--model-name", "")
    assert rc == 2 and "--model-name must be a name" in err and "got ''" in err, err
    rc, err = serve("--init-from", ckpts["tiny"], "--max-batch", 0)
    assert rc == 2 and "--max-batch must be at least 1" in err, err
    # caches beyond the machine's memory: said before they are allocated (a numpy
    # MemoryError's traceback at 1.49 TiB)
    rc, err = serve("--init-from", ckpts["tiny"], "--max-batch", 100_000_000)
    assert rc == 2 and "--max-batch 100000000 needs" in err and "Traceback" not in err, err
    rc, err = serve("--init-from", ckpts["tiny"], "--workers", 64)
    assert rc == 2 and "--workers 64" in err and "Traceback" not in err, err
    # a port in use, a host that is not this machine's: one error naming the flag, before
    # StarPU starts (uvicorn alone prints a log line and exits 3)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        rc, err = serve("--init-from", ckpts["tiny"], "--port", port)
    assert rc == 2 and f"--port {port}" in err and "already in use" in err, err
    rc, err = serve("--init-from", ckpts["tiny"], "--host", "192.0.2.1", "--port", 0)
    assert rc == 2 and "--host 192.0.2.1: not an address of this machine" in err, err
    if not have_cuda():       # a CPU build names the flag and how to get a CUDA build
        rc, err = serve("--init-from", ckpts["tiny"], "--gpus", 1)
        assert rc == 2 and "--gpus 1" in err and "CPU build" in err, err



def test_a_second_server_on_a_port_is_refused_before_it_loads():
    """listen_socket listens, not only binds: with SO_REUSEADDR Linux binds a second socket to
    a port nobody listens on yet, so a second server started while the first loaded its model
    passed the check, loaded, then ended on uvicorn's traceback (status 1)."""
    from starpu_llm.cli_serve import listen_socket
    from starpu_llm.errors import StarpuLLMError
    first = listen_socket("127.0.0.1", 0)
    port = first.getsockname()[1]
    with first, pytest.raises(StarpuLLMError, match=f"--port {port}: .* is already in use"):
        listen_socket("127.0.0.1", port).close()



def test_listening_beyond_this_machine_without_a_key_is_warned(capsys):
    """--host 0.0.0.0 (a container's, a proxy's upstream) without --api-key serves the model
    to anyone who reaches the port: said once at start (it was silent); not with a key, nor
    on the loopback."""
    from starpu_llm.cli_serve import listen_socket, warn_if_open
    for host, key, warned in (("0.0.0.0", None, True), ("0.0.0.0", "k", False),
                              ("127.0.0.1", None, False)):
        with listen_socket(host, 0) as sock:
            warn_if_open(sock, key)
        err = capsys.readouterr().err
        assert ("warning: --host 0.0.0.0 without --api-key" in err) == warned, (host, key, err)

@pytest.mark.parametrize("version", ["v2", "v1"])
def test_the_cache_check_counts_a_containers_memory_limit(tmp_path, monkeypatch, version):
    """In a container (docker --memory 1g, a systemd unit's MemoryMax, a Kubernetes limit)
    /proc/meminfo is the host's: --max-batch 16 of GPT-2 (1.1 GiB of cache) passed the check
    and the kernel killed the server as it wrote the caches (status 137, no word). The
    cgroup's limit less what it holds (its inactive page cache reclaimable) is what is left:
    here 1 GiB - 512 MiB + 256 MiB. v1: a container sees its own group at the hierarchy's
    root, not under the path /proc/self/cgroup names."""
    from starpu_llm.cli_serve import check_cache_memory
    from starpu_llm.errors import StarpuLLMError
    from starpu_llm.runtime import cgroups, offload
    if version == "v2":
        proc, group = "0::/system.slice/llm.service\n", tmp_path / "system.slice" / "llm.service"
        files = {"memory.max": 1 << 30, "memory.current": 512 << 20,
                 "memory.stat": "anon 1\ninactive_file 268435456\n"}
    else:
        proc, group = "4:memory:/docker/abc\n0::/\n", tmp_path / "memory"
        files = {"memory.limit_in_bytes": 1 << 30, "memory.usage_in_bytes": 512 << 20,
                 "memory.stat": "cache 1\ntotal_inactive_file 268435456\n"}
    group.mkdir(parents=True)
    for name, text in files.items():
        (group / name).write_text(f"{text}\n")
    (tmp_path / "cgroup").write_text(proc)
    monkeypatch.setattr(cgroups, "CGROUP", str(tmp_path))
    monkeypatch.setattr(cgroups, "PROC_CGROUP", str(tmp_path / "cgroup"))
    assert offload.available_memory() == 768 << 20
    with pytest.raises(StarpuLLMError, match=r"--max-batch 16 needs 1.1 GiB .* its container.s "
                                             r"memory limit\) has 768 MiB .*at most 10 here"):
        check_cache_memory(MODELS["d12"], 16)

# ---- the edges: parsing limits, stalled connections, faults, counting, the key (issues 40, 44)

KEY = "test-key-0123"
# prompts starting with these trip FAULTY's hook (SLOW_MARK: each step 1 s longer)
NAN_MARK, STEP_MARK, SLOW_MARK = 31337, 31338, 31339
FAULTY = f"""
import sys
import time
import numpy as np
from starpu_llm.serve.engine import Engine

engine_step = Engine._step

def faulty_step(self):
    if any(s.req.prompt[0] == {STEP_MARK} for s in self._running.values()):
        raise RuntimeError("injected fault in a decode step")
    if any(s.req.prompt[0] == {SLOW_MARK} for s in self._running.values()):
        time.sleep(1.0)
    nan = {{slot for slot, s in self._running.items() if s.req.prompt[0] == {NAN_MARK}}}
    decoder_collect = type(self.decoder).collect

    def collect(step):      # NaN logits for the marked sequences, as a diverged model gives
        logits = decoder_collect(self.decoder, step)
        for row, f in zip(logits, [f for f in step.feeds if f.logits]):
            if f.slot in nan:
                row[:] = np.nan
        return logits
    self.decoder.collect = collect
    try:
        return engine_step(self)
    finally:
        del self.decoder.collect

Engine._step = faulty_step
from starpu_llm.cli import main
sys.exit(main(sys.argv[1:]))
"""


def bearer(key=KEY):
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def edged(ckpts):
    """The tiny model behind a key, CORS open to one origin, 2 s timeouts, a request log, and
    the fault hook."""
    s = Server(ckpts["tiny"], ckpts["dir"], "--max-batch", 4, "--api-key", KEY,
               "--allow-origin", "https://ok.example", "--header-timeout", 2,
               "--body-timeout", 2, "--idle-timeout", 2, "--log-level", "info",
               name="edged", code=FAULTY)
    s.headers = bearer()
    yield s
    assert s.stop() == 0, s.output()


def peak_rss_kb(pid) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"^VmHWM:\s+(\d+) kB", f.read(), re.M).group(1))


def test_hostile_bodies_are_400_at_once(edged):
    """Nested brackets (Python's parser recursed: a plain-text 500) and a prompt of 7.5 million
    token ids under the 16 MiB limit (decoded whole before the length check: the server's
    memory grew by most of a gigabyte) are each one 400 naming the problem."""
    r = httpx.post(edged.url + "/v1/completions", content=b"[" * 1100, headers=bearer(),
                   timeout=120)
    assert r.status_code == 400
    assert "nests arrays and objects 1100 deep" in r.json()["error"]["message"]
    before = peak_rss_kb(edged.proc.pid)
    body = b'{"model": "tiny", "prompt": [' + b"1," * 7_500_000 + b'1]}'
    assert len(body) < 16 << 20
    r = httpx.post(edged.url + "/v1/completions", content=body, headers=bearer(), timeout=300)
    assert r.status_code == 400
    err = r.json()["error"]
    assert "holds 7500002 JSON values" in err["message"] and err["param"] == "prompt"
    # the body itself is in memory a few times (bytes, text): never a list of its ids
    assert peak_rss_kb(edged.proc.pid) - before < 150_000
    # a text far beyond what maxT tokens hold is refused before it is encoded
    r = httpx.post(edged.url + "/v1/completions", headers=bearer(), timeout=120,
                   json={"model": "tiny", "prompt": "ab" * 500_000})
    assert r.status_code == 400 and "1000000 characters" in r.json()["error"]["message"]
    # token ids over the context: refused by their count
    r = httpx.post(edged.url + "/v1/completions", headers=bearer(), timeout=120,
                   json={"model": "tiny", "prompt": [1] * 65})
    assert r.status_code == 400 and "the prompt has 65 tokens" in r.json()["error"]["message"]


def test_stalled_connections_are_closed(edged):
    """A connection that sends nothing, half a head or half a body is closed after the
    timeouts (2 s here; they were never closed); the half body gets 408 first. An idle
    kept-alive connection is closed too."""
    def connect(data: bytes):
        return edges_test.connect(edged.port, data)
    until_closed = edges_test.rest_until_closed
    nothing = connect(b"")
    half_head = connect(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    half_body = connect(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                        b"Authorization: Bearer "
                        + KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{\"model\"")
    idle = connect(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert until_closed(nothing) == b""
    assert until_closed(half_head) == b""
    answer = until_closed(half_body)
    assert answer.startswith(b"HTTP/1.1 408 ")
    assert b"the request body stopped arriving: nothing for 2 s after 8 bytes" in answer
    assert until_closed(idle).startswith(b"HTTP/1.1 200 ")
    wait_for("the log lines", lambda: "no whole request head within 2 s" in edged.output())
    assert edged.output().count("no whole request head within 2 s") >= 2


def test_a_client_leaving_mid_body_is_one_line(edged):
    rid = "left-mid-body-1"
    before = edged.metric('starpu_llm_requests_total{outcome="cancelled"}')
    s = socket.create_connection(("127.0.0.1", edged.port), timeout=120)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
              + KEY.encode() + b"\r\nX-Request-Id: " + rid.encode()
              + b"\r\nContent-Length: 100\r\n\r\n{\"model\": ")
    s.close()
    wait_for("the log line", lambda: rid in edged.output())
    time.sleep(1)          # anything else it would print about it
    lines = [line for line in edged.output().splitlines() if rid in line]
    assert len(lines) == 1 and "the client left after" in lines[0], lines
    assert "Traceback" not in edged.output() and "ClientDisconnect" not in edged.output()
    assert edged.metric('starpu_llm_requests_total{outcome="cancelled"}') == before + 1


def test_api_key_request_id_and_cors(edged, server):
    r = edged.client(KEY, max_retries=0).completions.create(model="tiny", prompt="Hi", max_tokens=2)
    assert len(r.choices) == 1
    for key in ("none", KEY + "x"):
        with pytest.raises(openai.AuthenticationError) as e:
            openai.OpenAI(base_url=edged.url + "/v1", api_key=key,
                          max_retries=0).completions.create(model="tiny", prompt="Hi")
        assert e.value.status_code == 401
        assert e.value.body["code"] == "invalid_api_key"
        assert "Authorization: Bearer KEY" in e.value.body["message"]
    for path in ("/v1/models", "/metrics"):
        r = httpx.get(edged.url + path, timeout=60)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(edged.url + "/v1/models", headers=bearer(), timeout=60).status_code == 200
    health = httpx.get(edged.url + "/health", timeout=60)     # open: a probe needs no key
    assert health.status_code == 200
    # X-Request-Id on every answer (200, 401, 400, 404), each its own; the client's kept; logged
    answers = [health, httpx.get(edged.url + "/metrics", timeout=60), edged.post({"model": "tiny"}),
               httpx.get(edged.url + "/nothing", headers=bearer(), timeout=60),
               httpx.get(server.url + "/v1/models", timeout=60)]
    assert [a.status_code for a in answers] == [200, 401, 400, 404, 200]
    ids = [a.headers["X-Request-Id"] for a in answers]
    assert len(set(ids)) == len(ids)
    wait_for("the request's log line", lambda: ids[2] in edged.output())
    mine = httpx.get(edged.url + "/health", headers={"X-Request-Id": "trace-42"}, timeout=60)
    assert mine.headers["X-Request-Id"] == "trace-42"
    # CORS: open to the origin named, closed to others, closed everywhere without the flag
    pre = {"Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type"}
    r = httpx.options(edged.url + "/v1/completions", timeout=60,
                      headers={"Origin": "https://ok.example", **pre})
    assert r.status_code == 200
    assert r.headers["Access-Control-Allow-Origin"] == "https://ok.example"
    for url, origin in ((edged.url, "https://evil.example"), (server.url, "https://ok.example")):
        r = httpx.options(url + "/v1/completions", headers={"Origin": origin, **pre}, timeout=60)
        assert "Access-Control-Allow-Origin" not in r.headers
        r = httpx.get(url + "/health", headers={"Origin": origin}, timeout=60)
        assert "Access-Control-Allow-Origin" not in r.headers


def test_a_sampling_fault_ends_its_request_alone(edged):
    """NaN logits (the hook's, for prompts starting with NAN_MARK) with temperature 1: that
    request is a 500 naming it; the requests beside it and after it are served."""
    client = edged.client(KEY, max_retries=0, timeout=300)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        good = [pool.submit(client.completions.create, model="tiny", prompt=p, max_tokens=20,
                            **GREEDY) for p in PROMPTS[:3]]
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model="tiny", prompt=[NAN_MARK, 11, 12], max_tokens=20,
                                      temperature=1.0)
        assert e.value.status_code == 500
        assert "drawing this request's next token failed: ValueError" in e.value.body["message"]
        assert all(len(f.result().choices[0].text) > 0 for f in good)
    assert edged.get("/health").json()["status"] == "ok"
    r = client.completions.create(model="tiny", prompt="ROMEO:", max_tokens=3, **GREEDY)
    assert r.usage.completion_tokens == 3


def test_a_scoring_fault_ends_its_request_alone(edged):
    """NaN logits while scoring a prompt (echo, max_tokens 0, logprobs): that request is a 500
    naming it, not a body of NaN (not JSON); the server goes on."""
    client = edged.client(KEY, max_retries=0, timeout=300)
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model="tiny", prompt=[NAN_MARK, 11, 12, 13], max_tokens=0,
                                  echo=True, logprobs=1)
    assert e.value.status_code == 500
    assert "scoring this request's prompt failed: ValueError" in e.value.body["message"]
    assert edged.get("/health").json()["status"] == "ok"
    r = client.completions.create(model="tiny", prompt=[11, 12, 13], max_tokens=0, echo=True,
                                  logprobs=1)
    assert all(np.isfinite(r.choices[0].logprobs.token_logprobs[1:]))


def test_usage_and_counting_per_request(server):
    """n > 1: the prompt counted once in the usage (OpenAI's and vLLM's way), the request once
    in starpu_llm_requests_total; a bad request once, as invalid."""
    client = server.client(max_retries=0)
    total = server.metric("starpu_llm_requests_total")
    invalid = server.metric('starpu_llm_requests_total{outcome="invalid"}')
    n_ids = len(tokenizer.gpt2().encode(PROMPTS[2]))
    r = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=4, n=3, **GREEDY)
    assert len(r.choices) == 3
    assert r.usage.prompt_tokens == n_ids and r.usage.completion_tokens == 12
    chunks = list(client.completions.create(model="tiny", prompt=[PROMPTS[2], PROMPTS[3]],
                                            max_tokens=4, n=2, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert chunks[-1].usage.prompt_tokens == n_ids + len(tokenizer.gpt2().encode(PROMPTS[3]))
    assert server.post({"model": "tiny", "prompt": "Hi", "top_p": 0}).status_code == 400
    assert server.metric("starpu_llm_requests_total") == total + 3
    assert server.metric('starpu_llm_requests_total{outcome="invalid"}') == invalid + 1


def test_a_cancelled_waiting_request_frees_its_room_at_once(one_slot):
    """The second request waits (one slot, room for one); its client leaves: its room is free
    at once (it held it until the slot freed), it is counted cancelled, and a third request
    takes the room while the first still runs."""
    def cancelled():
        return one_slot.metric('starpu_llm_requests_total{outcome="cancelled"}')

    def waiting():
        return one_slot.get("/health").json()["waiting"]
    first = raw_request(one_slot.port, {**LONG_BODY, "stream": True})
    try:
        read_until(first, b"data: ")
        before = cancelled()
        second = raw_request(one_slot.port, LONG_BODY)
        wait_for("the second request to wait", lambda: waiting() == 1)
        second.close()
        wait_for("its room to be free", lambda: waiting() == 0, timeout=60)
        assert cancelled() == before + 1
        assert running(one_slot) == 1           # the first runs on
        third = raw_request(one_slot.port, {**LONG_BODY, "stream": True})
        try:
            wait_for("the third request to wait", lambda: waiting() == 1)
        finally:
            third.close()
    finally:
        first.close()
    wait_for("the slot to be freed", lambda: running(one_slot) == 0)


def test_a_step_fault_answers_503_and_ends_the_process(ckpts):
    """An error in a decode step (the hook's, once a prompt starting with STEP_MARK runs):
    every request in flight is answered (a stream's error event, a 503), and the server exits
    with status 1 and one line, for a supervisor to restart it."""
    s = Server(ckpts["long"], ckpts["dir"], name="step_fault", code=FAULTY)
    try:
        with httpx.stream("POST", s.url + "/v1/completions", timeout=300,
                          json={**LONG_BODY, "stream": True}) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            bad = s.post({"model": "long", "prompt": [STEP_MARK, 5], "max_tokens": 3})
            rest = [line for line in lines if line.startswith("data: ")]
        assert bad.status_code == 503
        assert "injected fault in a decode step" in bad.json()["error"]["message"]
        assert "injected fault" in json.loads(rest[-2][len("data: "):])["error"]["message"]
        assert s.proc.wait(120) == 1, s.output()
        assert "the engine failed: RuntimeError: injected fault in a decode step" in s.output()
        assert "Traceback" not in s.output()
    finally:
        s.stop()


def test_recent_steps_stay_bounded_without_a_scraper(monkeypatch):
    from starpu_llm.serve import metrics as m
    clock = [0.0]
    monkeypatch.setattr(m.time, "monotonic", lambda: clock[0])
    metrics = m.Metrics(8)
    for _ in range(1000):
        clock[0] += 0.5
        metrics.step(4, 4, 4, 0.01)
    assert len(metrics._recent) <= m.WINDOW_S / 0.5 + 1
    assert metrics.tokens_per_second() == pytest.approx(4 / 0.5, rel=0.1)


def test_metrics_have_the_process_ones():
    """The server's own registry left out prometheus-client's process metrics, which every
    exporter has: a dashboard had no memory (the key/value cache's), CPU, file descriptors,
    nor start time (restarts)."""
    from starpu_llm.serve.metrics import Metrics
    text = Metrics(8).exposition().decode()
    rss = re.search(r"^process_resident_memory_bytes (\S+)$", text, re.M)
    assert rss and float(rss.group(1)) > 0
    for name in ("process_cpu_seconds_total", "process_open_fds", "process_start_time_seconds"):
        assert re.search(rf"^{name} ", text, re.M), name


def test_serve_access_flag_errors(ckpts):
    def serve(*args, env=None):
        p = subprocess.run([sys.executable, "-m", "starpu_llm", "serve", "--init-from",
                            str(ckpts["tiny"]), *map(str, args)], capture_output=True,
                           text=True, timeout=300, env=env)
        return p.returncode, p.stderr
    rc, err = serve("--api-key", "")
    assert rc == 2 and "--api-key must be printable ASCII" in err, err
    rc, err = serve(env={**os.environ, "STARPU_LLM_API_KEY": " padded"})
    assert rc == 2 and "STARPU_LLM_API_KEY must be printable ASCII" in err, err
    assert "Traceback" not in err
    rc, err = serve("--body-timeout", 0)
    assert rc == 2 and "--body-timeout" in err, err


def test_text_is_sent_while_the_next_step_runs(monkeypatch, expected):
    """The engine submits a step, then sends the text of the tokens drawn after the last one
    (while the tasks run), then collects the step's logits: every piece of text but the last
    arrives between a step's submission and its collection; the answers stay the
    single-prompt generations, and a stop string met that way ends the text before it."""
    from starpu_llm.cli_serve import load_model
    from starpu_llm.flow import batch
    from starpu_llm.serve import engine as eng
    log = []

    class Recording(batch.SlotDecoder):
        def submit(self, feeds):
            log.append("submit")
            return super().submit(feeds)

        def collect(self, step):
            log.append("collect")
            return super().collect(step)

    monkeypatch.setattr(eng, "SlotDecoder", Recording)
    tok = tokenizer.gpt2()
    engine = eng.Engine(load_model(TINY, peaked_params(TINY), engine="reference"), TINY, tok,
                        tok.eot, max_batch=2)
    engine.start(START_S)
    texts, done = {}, {}

    def listen(name):
        def on_event(ev):
            if ev.text:
                log.append(("text", name))
                texts[name] = texts.get(name, "") + ev.text
            if ev.finish or ev.error:
                done[name] = (ev.finish, ev.error, ev.completion_tokens)
        return on_event
    whole = text_of(expected[PROMPTS[1]][:8])
    stop = whole[len(whole) // 2:len(whole) // 2 + 2]   # met in the middle of the text
    try:
        engine.submit([eng.Request(tok.encode(PROMPTS[0]), eng.Sampling(8, top_k=1),
                                   listen("a")),
                       eng.Request(tok.encode(PROMPTS[1]), eng.Sampling(8, top_k=1,
                                                                       stop=(stop,)),
                                   listen("b"))])
        wait_for("both answers", lambda: len(done) == 2)
    finally:
        assert engine.close(30)
    assert texts["a"] == text_of(expected[PROMPTS[0]][:8]) and done["a"][:2] == ("length", None)
    assert texts["b"] == whole[:whole.index(stop)] and done["b"][:2] == ("stop", None)
    pieces = [k for k, e in enumerate(log) if isinstance(e, tuple) and e[1] == "a"]
    assert len(pieces) >= 4
    for k in pieces[:-1]:          # the last piece comes with the end, after the last step
        calls = [e for e in log[:k] if not isinstance(e, tuple)]
        assert calls[-1] == "submit", f"piece {pieces.index(k)} of a came after {calls[-1]}"
