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

from bounds import logits_bound
from starpu_llm.config import MODELS, GPTConfig
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

    def __init__(self, ckpt, tmp, *flags, name="server"):
        self.out, self.err = tmp / f"{name}.out", tmp / f"{name}.err"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "starpu_llm", "serve", "--init-from", str(ckpt),
                 "--port", "0", "--log-level", "warning", *map(str, flags)],
                stdout=out, stderr=err, stdin=subprocess.DEVNULL)
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

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", **kw)

    def get(self, path):
        return httpx.get(self.url + path, timeout=60)

    def post(self, body, **kw):
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
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


def test_sampling_seed_and_stop(server, expected):
    client = server.client(max_retries=0)

    def sampled(seed):
        return client.completions.create(model="tiny", prompt="Hello", max_tokens=20,
                                         temperature=1.0, top_p=0.9, seed=seed,
                                         extra_body={"top_k": 40}).choices[0].text
    assert sampled(5) == sampled(5)
    assert sampled(5) != sampled(6)
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
    (b'[1, 2]', 400, "must be a JSON object"),
    (b'{"model": "tiny", "prompt": "Hi", "max_token": 5}', 400, "unknown field 'max_token'"),
    ({"model": "tiny", "prompt": "word " * 80}, 400, "maxT = 64"),
    ({"model": "tiny", "prompt": "Hi", "max_tokens": 64}, 400, "lower max_tokens to at most 63"),
    ({"model": "tiny", "prompt": "Hi", "max_tokens": 0}, 400, "max_tokens must be >= 1"),
    ({"model": "tiny", "prompt": "Hi", "temperature": -0.5}, 400, "temperature must be >= 0"),
    ({"model": "tiny", "prompt": "Hi", "temperature": "hot"}, 400, "temperature must be a number"),
    ({"model": "tiny", "prompt": "Hi", "top_p": 0}, 400, "top_p must be in (0, 1]"),
    ({"model": "tiny", "prompt": "Hi", "n": 9}, 400, "more than this server runs at once"),
    ({"model": "tiny", "prompt": "Hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "at most 4"),
    ({"model": "tiny", "prompt": [1, 2, 50257]}, 400, "token id 50257"),
    ({"model": "tiny", "prompt": []}, 400, "prompt must be"),
    ({"model": "tiny"}, 400, "prompt is required"),
    ({"model": "tiny", "prompt": "Hi", "best_of": 2}, 400, "best_of is not supported"),
    ({"model": "tiny", "prompt": "Hi", "stream_options": {"include_usage": True}}, 400,
     "only allowed with stream"),
    (b'{"model": "tiny", "prompt": "\\ud800"}', 400, "lone surrogate"),
    (b'{"model": "tiny", "prompt": "caf\xe9"}', 400, "not valid UTF-8"),
    (b'{"model": "tiny", "prompt": "Hi", "temperature": NaN}', 400, "not valid JSON"),
    ({"model": "gpt-4", "prompt": "Hi"}, 404, "this server serves 'tiny'"),
    (b'{"model": "tiny", "prompt": "' + b"a" * (17 << 20) + b'"}', 413, "larger than 16 MiB"),
]


@pytest.mark.parametrize("body,status,message", BAD, ids=[m for _, _, m in BAD])
def test_bad_input_is_one_clear_error(server, expected, body, status, message):
    r = server.post(body)
    assert r.status_code == status
    err = r.json()["error"]
    assert message in err["message"], err["message"]
    assert "Traceback" not in err["message"] and "\n" not in err["message"]
    # and the server goes on serving
    ok = server.post({"model": "tiny", "prompt": "ROMEO:", "max_tokens": 3, "temperature": 0,
                      "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == text_of(expected["ROMEO:"][:3])


def test_bad_input_through_the_openai_client(server):
    client = server.client(max_retries=0)
    with pytest.raises(openai.BadRequestError, match="temperature must be >= 0"):
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
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
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
