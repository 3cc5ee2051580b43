"""The server's connections (serve/middleware.py's protocol, docs/serving.md "Timeouts"): uvicorn
with the protocol serve runs, in a thread of this process on a free port of 127.0.0.1, in
front of a small application (no model), driven by raw sockets. The timeouts are injected
small; a wait in a test is a fraction of the timeout it stays under, with seconds to spare
for a machine whose cores are all busy, a timeout a test does not exercise is left long, and
nothing measures how long a closing took."""
import argparse
import contextlib
import json
import re
import socket
import threading
import time

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from starpu_llm import cli
from starpu_llm.cli_serve import FD_HEADROOM, check_connection_room, listen_socket
from starpu_llm.errors import StarpuLLMError
from starpu_llm.serve import middleware
from starpu_llm.serve.metrics import Metrics

GET = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
HEAD = b"%s %s HTTP/1.1\r\nHost: %s\r\n%s\r\n"      # method, path, host, other headers
BIG = 64 << 20          # an answer beyond any socket's buffers


@contextlib.contextmanager
def serving(edges: middleware.Edges, metrics=None, big_ended=None):
    """The port of a server with edges (and metrics, a serve/metrics.Metrics), stopped at the
    end. GET /big streams BIG bytes, then sets big_ended (a threading.Event), as it ends or is
    stopped."""
    async def health(request):
        return JSONResponse({"status": "ok"})

    async def echo(request):
        return JSONResponse({"got": len(await request.body())})

    async def big(request):
        async def pieces():
            try:
                for _ in range(BIG >> 16):
                    yield b"x" * (1 << 16)
            finally:
                big_ended.set()
        return StreamingResponse(pieces())
    app = middleware.wrap(Starlette(routes=[Route("/health", health),
                                            Route("/echo", echo, methods=["POST"]),
                                            Route("/big", big)]), edges,
                          middleware.host_names("127.0.0.1", "127.0.0.1", edges.allow_hosts),
                          metrics)
    sock = listen_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning",
                                           http=middleware.http_protocol(edges, metrics),
                                           timeout_keep_alive=edges.idle_timeout))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.01)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()


def connect(port, data=b""):
    s = socket.create_connection(("127.0.0.1", port), timeout=120)
    s.sendall(data)
    return s


def answer(s) -> bytes:
    """One whole answer (its head and Content-Length bytes of body) from s."""
    got = b""
    while b"\r\n\r\n" not in got:
        piece = s.recv(4096)
        assert piece, f"closed before a whole answer: {got!r}"
        got += piece
    head, _, body = got.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")))
    while len(body) < length:
        body += s.recv(4096)
    return head + b"\r\n\r\n" + body


def rest_until_closed(s) -> bytes:
    """What s receives until the server closes it (a socket timeout fails the test)."""
    got = b""
    while piece := s.recv(4096):
        got += piece
    s.close()
    return got


def test_the_idle_timeout_and_max_connections_flags():
    """--idle-timeout defaults to 75 s, above the 60 s for which load balancers and proxies
    keep an idle upstream connection (5 s: the server closed first, racing the balancer's next
    request: a 502); --max-connections to 512; bad values are one usage error naming the
    flag."""
    p = cli.build_parser()
    serve = ["serve", "--init-from", "m.bin"]
    args = p.parse_args(serve)
    assert args.idle_timeout == 75.0 > 60 and args.max_connections == 512
    edges = cli._serve_edges(args)
    assert edges["idle_timeout"] == 75.0 and edges["max_connections"] == 512
    assert middleware.Edges(**edges) == middleware.Edges(api_key=edges["api_key"])
    assert p.parse_args(serve + ["--idle-timeout", "2.5"]).idle_timeout == 2.5
    assert p.parse_args(serve + ["--max-connections", "3"]).max_connections == 3
    for flag, bad in (("--idle-timeout", "0"), ("--idle-timeout", "inf"),
                      ("--max-connections", "0"), ("--max-connections", "2.5")):
        with pytest.raises(cli.UsageError, match=flag):
            p.parse_args(serve + [flag, bad])


def test_serve_defaults_are_stated_once(monkeypatch):
    """serve's defaults live in serve/settings.py alone: `serve` without flags gives Serving's
    and Edges' fields, each flag's help says that value, and run_serve's and the engine's
    defaults are the same (a number changed there changes them all; a second copy in cli.py
    would diverge). The engine's stall_timeout stays 0 (off: a library's engine watches for
    stalls only when asked)."""
    import inspect
    from dataclasses import asdict
    from starpu_llm.cli_serve import run_serve
    from starpu_llm.serve.engine import Engine
    from starpu_llm.serve.settings import Edges, Serving
    monkeypatch.delenv("STARPU_LLM_API_KEY", raising=False)
    p = cli.build_parser()
    args = p.parse_args(["serve", "--init-from", "m.bin"])
    serving = asdict(Serving())
    assert {name: getattr(args, name) for name in serving} == serving
    assert middleware.Edges(**cli._serve_edges(args)) == Edges()
    (sv,) = [a.choices["serve"] for a in p._actions if isinstance(a, argparse._SubParsersAction)]
    helps = {a.dest: sv._get_formatter()._expand_help(a) for a in sv._actions if a.help}
    for name, value in [*serving.items(), *asdict(Edges()).items()]:
        if isinstance(value, (int, float)):
            assert f"default {value:g}" in helps[name], (name, helps[name])
    for fn, names in ((run_serve, set(serving)), (Engine, {"max_batch", "max_queue"})):
        for name, param in inspect.signature(fn).parameters.items():
            if name in names:
                assert param.default == serving[name], (fn.__name__, name)


@pytest.mark.parametrize("name, value, message", [
    ("max_batch", 0, "max_batch must be at least 1, got 0"),
    ("max_queue", -1, "max_queue must be >= 0, got -1"),
    ("port", 70000, "port must be in 0..65535, got 70000"),
    ("port", 65536, "port must be in 0..65535, got 65536"),
    ("port", -1, "port must be in 0..65535, got -1"),
    ("stall_timeout", float("nan"), "stall_timeout must be a finite number >= 0, got nan"),
    ("log_level", "loud", "log_level 'loud': choose one of critical, error, warning, info, "
                          "debug"),
])
def test_serve_settings_keep_their_flags_rules_from_python(tmp_path, name, value, message):
    """run_serve from Python holds Serving's settings to their flags' rules (serve/settings,
    the one statement), before the model is read: the message names the field; the flag's
    names the flag; the engine keeps the same rule for its slots and queue."""
    from starpu_llm.cli_serve import run_serve
    from starpu_llm.serve.engine import Engine
    with pytest.raises(StarpuLLMError, match=f"^{re.escape(message)}$"):
        run_serve(str(tmp_path / "no-such-model.bin"), **{name: value})
    flag = "--" + name.replace("_", "-")
    with pytest.raises(cli.UsageError, match=re.escape(flag)):
        cli.build_parser().parse_args(["serve", "--init-from", "m.bin", flag, str(value)])
    if name in ("max_batch", "max_queue"):
        with pytest.raises(StarpuLLMError, match=f"^{re.escape(message)}$"):
            Engine(lambda: None, None, None, None, **{name: value})


@pytest.mark.parametrize("name, value, message", [
    ("header_timeout", 0, "header_timeout must be a finite number > 0, got 0"),
    ("body_timeout", -1.5, "body_timeout must be a finite number > 0, got -1.5"),
    ("idle_timeout", float("inf"), "idle_timeout must be a finite number > 0, got inf"),
    ("idle_timeout", "75", "idle_timeout expects a number, got '75'"),
    ("max_connections", 0, "max_connections must be at least 1, got 0"),
    ("max_body", 2.5, "max_body expects a whole number, got 2.5"),
])
def test_edges_keep_their_flags_rules_from_python(monkeypatch, tmp_path, name, value, message):
    """serve/settings.Edges' settings keep one rule each: the flag refuses a bad value with a
    usage error naming it, and Edges made from Python (run_serve's edges, before the model is
    read; middleware's) with one StarpuLLMError naming the field (the old flag-only rule let
    Edges(header_timeout=0) through to a server that closed every connection at once)."""
    from starpu_llm.cli_serve import run_serve
    from starpu_llm.serve.settings import Edges
    with pytest.raises(StarpuLLMError, match=f"^{re.escape(message)}$"):
        Edges(**{name: value})
    with pytest.raises(StarpuLLMError, match=f"^{re.escape(message)}$"):
        run_serve(str(tmp_path / "no-such-model.bin"), edges={name: value})
    flag = "--" + name.replace("_", "-")
    monkeypatch.setattr(cli._Parser, "format_usage", lambda self: "")
    if not isinstance(value, str):          # "75" is a number to the flag
        with pytest.raises(cli.UsageError, match=f"error: argument {re.escape(flag)}: "
                                                 f"{re.escape(flag)} (must be|expects) "):
            cli.build_parser().parse_args(["serve", "--init-from", "m.bin", flag, str(value)])
    assert getattr(Edges(**{name: 7}), name) == 7       # in range: taken as given


@pytest.mark.parametrize("edges, message", [
    (dict(api_key=" key"), "api_key must be printable ASCII, not empty and without spaces "
                           "around it"),
    (dict(api_key=""), "api_key must be printable ASCII"),
    (dict(allow_origins="https://ui.example"), "allow_origins expects a tuple of origins"),
    (dict(allow_origins=("https://ui.example", None)), "allow_origins expects a tuple of origins"),
    (dict(allow_origins=("https://ui.example", "")), "allow_origins expects a tuple of origins"),
])
def test_the_key_and_the_origins_are_checked_from_python(edges, message):
    """Edges' key keeps --api-key's rule (serve/settings.check_api_key, also the flag's and
    $STARPU_LLM_API_KEY's) and its origins must be a tuple of names (a string would be
    taken letter by letter); the message names the field, never the key."""
    from starpu_llm.serve.settings import Edges
    with pytest.raises(StarpuLLMError, match=f"^{re.escape(message)}") as e:
        Edges(**edges)
    assert " key" not in str(e.value).replace("api_key", "")
    assert Edges(api_key="k-1", allow_origins=["*"]).allow_origins == ["*"]
    with pytest.raises(cli.UsageError, match="--api-key must be printable ASCII"):
        cli.build_parser().parse_args(["serve", "--init-from", "m.bin", "--api-key", " key"])


def test_an_idle_connection_lasts_the_idle_timeout_and_a_stall_mid_request_does_not():
    """Between two requests a connection idles up to --idle-timeout (10 s here), however short
    the head timeout (1 s): idle 2.5 s, its next request is answered; then it is closed.
    Mid-request the keep-alive timer is off and the head and body timeouts close a stall:
    half the next head on a kept-alive connection, half a body (408 first)."""
    edges = middleware.Edges(header_timeout=1, body_timeout=1, idle_timeout=10)
    with serving(edges) as port:
        kept = connect(port, GET)
        assert answer(kept).startswith(b"HTTP/1.1 200 ")
        time.sleep(2.5)
        kept.sendall(GET)
        assert answer(kept).startswith(b"HTTP/1.1 200 ")
        assert rest_until_closed(kept) == b""           # idle past 10 s

        half_head = connect(port, GET)
        assert answer(half_head).startswith(b"HTTP/1.1 200 ")
        half_head.sendall(b"GET /health HTTP/1.1\r\nHo")
        half_body = connect(port, b"POST /echo HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 10"
                                  b"\r\n\r\nabc")
        assert rest_until_closed(half_head) == b""
        got = rest_until_closed(half_body)
        assert got.startswith(b"HTTP/1.1 408 ") and b"nothing for 1 s after 3 bytes" in got


def test_one_connection_beyond_max_connections():
    """At --max-connections (2 here) one more connection closes the kept-alive connection idle
    the longest and is served (idle connections, kept 75 s for a load balancer, never keep a
    request out); with none idle its request, body and all, is answered 503 in OpenAI's
    shape with Retry-After and, as every answer, an X-Request-Id (the refusal had none, and
    was not counted), counted "rejected", and closed; the server goes on serving. The half heads that keep
    connections busy get a head timeout no loaded machine reaches."""
    edges = middleware.Edges(header_timeout=600, idle_timeout=600, max_connections=2)
    metrics = Metrics(1)
    with serving(edges, metrics) as port:
        idle = connect(port, GET)
        assert answer(idle).startswith(b"HTTP/1.1 200 ")
        busy = connect(port, b"GET /health HTTP/1.1\r\n")          # half a head: not idle
        third = connect(port, GET)
        assert answer(third).startswith(b"HTTP/1.1 200 ")
        assert rest_until_closed(idle) == b""                    # made room for the third
        third.sendall(b"GET /health HTTP/1.1\r\n")                 # busy too now
        body = b'{"prompt": "Hi"}'
        over = connect(port, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                             b"application/json\r\nContent-Length: %d\r\n\r\n%s"
                       % (len(body), body))
        got = rest_until_closed(over)
        head, _, text = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503 ") and b"\r\nretry-after: 1\r\n" in head.lower()
        assert re.search(rb"\r\nx-request-id: [0-9a-f]{32}(\r\n|$)", head.lower())
        assert re.search(r'^starpu_llm_requests_total\{outcome="rejected"\} 1\.0$',
                         metrics.exposition().decode(), re.M)
        err = json.loads(text)["error"]
        assert "has 2 connections open, its most (--max-connections)" in err["message"]
        assert err["type"] == "server_busy"
        busy.close()
        third.close()
        after = connect(port, GET)
        assert answer(after).startswith(b"HTTP/1.1 200 ")
        after.close()


def test_max_connections_beyond_the_file_descriptor_limit_is_refused(monkeypatch):
    """Past the process's file descriptors asyncio stops accepting (a traceback a second) and
    nothing else opens: --max-connections must leave cli_serve.FD_HEADROOM of them."""
    import resource
    monkeypatch.setattr(resource, "getrlimit", lambda which: (256, 4096))
    check_connection_room(256 - FD_HEADROOM)
    with pytest.raises(StarpuLLMError, match=rf"--max-connections 512 needs {512 + FD_HEADROOM} "
                                             rf"file descriptors, but this process may open 256 "
                                             rf".*at most {256 - FD_HEADROOM}"):
        check_connection_room(512)


def test_a_body_over_max_body_is_413_as_it_arrives():
    """--max-body (1 MiB here): a larger body is refused with 413 in OpenAI's shape naming the
    flag, from its Content-Length before a byte of it is read, or, chunked, once its bytes pass
    the limit; a body under it is served."""
    with serving(middleware.Edges(max_body=1)) as port:
        over = (1 << 20) + 1
        declared = connect(port, b"POST /echo HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: %d\r\n"
                                 b"\r\n" % over)
        chunk = b"%x\r\n%s\r\n" % (1 << 16, b"a" * (1 << 16))
        chunked = connect(port, b"POST /echo HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: "
                                b"chunked\r\n\r\n" + chunk * 17)
        for s in (declared, chunked):
            head, _, text = answer(s).partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 413 "), head
            err = json.loads(text)["error"]
            assert "larger than 1 MiB (--max-body)" in err["message"], err
            s.close()
        body = b"a" * (1 << 20)
        ok = connect(port, b"POST /echo HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: %d\r\n\r\n%s"
                           % (len(body), body))
        assert json.loads(answer(ok).partition(b"\r\n\r\n")[2]) == {"got": 1 << 20}
        ok.close()
    p = cli.build_parser()
    args = p.parse_args(["serve", "--init-from", "m.bin", "--max-body", "2"])
    assert cli._serve_edges(args)["max_body"] == 2
    with pytest.raises(cli.UsageError, match="--max-body"):
        p.parse_args(["serve", "--init-from", "m.bin", "--max-body", "0"])


def test_a_web_page_of_another_origin_is_refused():
    """A browser's request from a page of an origin --allow-origin does not name is 403 before
    it runs (a plain-text POST needs no CORS preflight: any site a user visited ran
    completions on their local server, CORS only hiding the answer); a named origin, "*",
    and clients without an Origin (curl, OpenAI's) are served."""
    post = (b"POST /echo HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: text/plain\r\n%s"
            b"Content-Length: 2\r\n\r\n{}")
    with serving(middleware.Edges(allow_origins=("https://ui.example",))) as port:
        s = connect(port, post % b"Origin: https://evil.example\r\n")
        head, _, text = answer(s).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 403 "), head
        err = json.loads(text)["error"]
        assert "--allow-origin https://evil.example" in err["message"]
        assert err["code"] == "origin_not_allowed"
        for origin in (b"Origin: https://ui.example\r\n", b""):
            s = connect(port, post % origin)
            assert answer(s).startswith(b"HTTP/1.1 200 ")
            s.close()
    with serving(middleware.Edges(allow_origins=("*",))) as port:
        s = connect(port, post % b"Origin: https://evil.example\r\n")
        assert answer(s).startswith(b"HTTP/1.1 200 ")
        s.close()


def test_a_host_header_of_another_name_is_refused():
    """DNS rebinding: a page of a domain whose DNS then answers 127.0.0.1 is same-origin with
    the server, so its GETs (/v1/models, /health, /metrics: no key) were read, whatever the
    Origin check. A Host that is not the server's name, localhost (on loopback) or an
    --allow-host name is 400 host_not_allowed naming the flag, before it runs; any IP address
    is served (a rebinding needs a name)."""
    with serving(middleware.Edges()) as port:
        for host in (b"evil.example:%d" % port, b"EVIL.example.", b"localhost.evil.example"):
            s = connect(port, HEAD % (b"GET", b"/health", host, b""))
            head, _, text = answer(s).partition(b"\r\n\r\n")
            s.close()
            assert head.startswith(b"HTTP/1.1 400 "), (host, head)
            err = json.loads(text)["error"]
            name = host.decode().lower().split(":")[0].rstrip(".")
            assert err["code"] == "host_not_allowed", err
            assert f"--allow-host {name}" in err["message"], err
        for host in (b"127.0.0.1:%d" % port, b"localhost:%d" % port, b"LocalHost",
                     b"app.localhost", b"[::1]:%d" % port, b"10.1.2.3"):
            s = connect(port, HEAD % (b"GET", b"/health", host, b""))
            assert answer(s).startswith(b"HTTP/1.1 200 "), host
            s.close()
    with serving(middleware.Edges(allow_hosts=("llm.lan",))) as port:
        for host, status in ((b"llm.lan:80", b"200"), (b"evil.example", b"400")):
            s = connect(port, HEAD % (b"GET", b"/health", host, b""))
            assert answer(s).startswith(b"HTTP/1.1 %s " % status), host
            s.close()
    # which names: the server's own and --allow-host's; any on every interface without one
    assert middleware.host_names("127.0.0.1", "127.0.0.1", ()) == {"127.0.0.1", "localhost"}
    assert middleware.host_names("llm.lan", "192.168.1.5", ("x.lan",)) == {"llm.lan", "x.lan"}
    for bound in ("0.0.0.0", "::"):
        assert middleware.host_names(bound, bound, ()) is None
        assert middleware.host_names(bound, bound, ("x.lan",)) == {bound, "x.lan",
                                                                   "localhost"}
    assert middleware.host_names("127.0.0.1", "127.0.0.1", ("*",)) is None
    p = cli.build_parser()
    serve = ["serve", "--init-from", "m.bin"]
    args = p.parse_args(serve + ["--allow-host", "LLM.lan.", "--allow-host", "*"])
    assert cli._serve_edges(args)["allow_hosts"] == ("llm.lan", "*")
    for bad in ("http://llm.lan", "llm.lan:8000", "", "a b"):
        with pytest.raises(cli.UsageError, match="--allow-host"):
            p.parse_args(serve + ["--allow-host", bad])


@pytest.mark.parametrize("encoding", [b"gzip", b"deflate", b"br, identity"])
def test_an_encoded_body_is_415(encoding):
    """A body with a Content-Encoding other than identity was read as plain bytes and failed
    as UTF-8 or JSON; it is 415 naming the header (refused, not decoded: no client of this
    API compresses, and a decoder is a zip bomb's way past --max-body), after its body is
    read under --max-body (a larger one stays a 413); identity is served."""
    import gzip
    body = gzip.compress(b'{"model": "m"}')
    with serving(middleware.Edges(max_body=1)) as port:
        s = connect(port, HEAD % (b"POST", b"/echo", b"127.0.0.1",
                                  b"Content-Encoding: %s\r\nContent-Length: %d\r\n"
                                  % (encoding, len(body))) + body)
        head, _, text = answer(s).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 415 "), head
        err = json.loads(text)["error"]
        assert err["code"] == "unsupported_content_encoding"
        assert f"(Content-Encoding: {encoding.decode()})" in err["message"], err
        s.sendall(GET)                      # the body was read: the connection goes on
        assert answer(s).startswith(b"HTTP/1.1 200 ")
        s.close()
        chunk = b"%x\r\n%s\r\n" % (1 << 16, b"a" * (1 << 16))
        s = connect(port, HEAD % (b"POST", b"/echo", b"127.0.0.1",
                                  b"Content-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n")
                    + chunk * 17)
        assert answer(s).startswith(b"HTTP/1.1 413 ")
        s.close()
        s = connect(port, HEAD % (b"POST", b"/echo", b"127.0.0.1",
                                  b"Content-Encoding: Identity\r\nContent-Length: 2\r\n") + b"{}")
        assert json.loads(answer(s).partition(b"\r\n\r\n")[2]) == {"got": 2}
        s.close()


def test_a_client_that_reads_nothing_of_its_answer_is_cut():
    """A client that sends its request and never reads (its receive window full) held its
    connection, and the answer's bytes in the server, for ever (a streamed completion's
    events are made whatever the client reads: a few hundred such clients filled
    --max-connections); after --body-timeout (1 s here) without a byte read it is cut: the
    answer's generator ends and the client never gets the whole answer."""
    ended = threading.Event()
    with serving(middleware.Edges(body_timeout=1), big_ended=ended) as port:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.settimeout(120)
        s.connect(("127.0.0.1", port))
        s.sendall(b"GET /big HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert ended.wait(120), "the server still waits for the client to read"
        got = 0
        with contextlib.suppress(ConnectionResetError):
            while piece := s.recv(1 << 16):
                got += len(piece)
        s.close()
        assert got < BIG
        s = connect(port, GET)                  # and the server goes on
        assert answer(s).startswith(b"HTTP/1.1 200 ")
        s.close()


@pytest.mark.parametrize("change", ["method", "attribute", "constructor"])
def test_a_uvicorn_without_what_the_edges_use_is_one_error_at_start(monkeypatch, change):
    """The cap on connections and the deadlines are built on uvicorn's H11Protocol (no public
    option does it): a uvicorn whose protocol lacks one of middleware.UVICORN_NEEDS is one
    error naming it and the versions tested, when the protocol is made (at start, before the
    model loads), not a failure on each connection or a cap that silently does not hold."""
    from uvicorn.protocols.http import h11_impl
    if change == "method":
        monkeypatch.delattr(h11_impl.H11Protocol, "timeout_keep_alive_handler")
        name = "timeout_keep_alive_handler"
    elif change == "attribute":
        init = h11_impl.H11Protocol.__init__

        def without(self, *a, **kw):
            init(self, *a, **kw)
            del self.timeout_keep_alive_task
        monkeypatch.setattr(h11_impl.H11Protocol, "__init__", without)
        name = "timeout_keep_alive_task"
    else:
        monkeypatch.setattr(h11_impl.H11Protocol, "__init__", lambda self, config: None)
        name = "__init__"
    with pytest.raises(StarpuLLMError, match=rf"uvicorn \S+ lacks what serve's --max-connections"
                                             rf".*H11Protocol\.{name}.*uvicorn>=0\.30"):
        middleware.http_protocol(middleware.Edges())
