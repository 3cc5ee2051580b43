"""The server's connections (serve/middleware.py's protocol, docs/serving.md "Timeouts"): uvicorn
with the protocol serve runs, in a thread of this process on a free port of 127.0.0.1, in
front of a small application (no model), driven by raw sockets. The timeouts are injected
small; a wait in a test is a fraction of the timeout it stays under, with seconds to spare
for a machine whose cores are all busy, a timeout a test does not exercise is left long, and
nothing measures how long a closing took."""
import contextlib
import json
import re
import socket
import threading
import time

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from starpu_llm import cli
from starpu_llm.cli_serve import FD_HEADROOM, check_connection_room, listen_socket
from starpu_llm.errors import StarpuLLMError
from starpu_llm.serve import middleware
from starpu_llm.serve.metrics import Metrics

GET = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"


@contextlib.contextmanager
def serving(edges: middleware.Edges, metrics=None):
    """The port of a server with edges (and metrics, a serve/metrics.Metrics), stopped at the
    end."""
    async def health(request):
        return JSONResponse({"status": "ok"})

    async def echo(request):
        return JSONResponse({"got": len(await request.body())})
    app = middleware.wrap(Starlette(routes=[Route("/health", health),
                                            Route("/echo", echo, methods=["POST"])]), edges,
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
        half_body = connect(port, b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 10"
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
        over = connect(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
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
