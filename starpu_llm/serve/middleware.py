"""The server's edges, around the application of serve/app.py (installed by wrap()):

  request id  every answer carries an X-Request-Id header (the client's own when it sent a
              plain one, else a new one), and the log line of the request names it (one line
              per request at --log-level info, in place of uvicorn's access line; a GET
              /health answered 200 at debug);
  API key     with Edges.api_key, every request but GET /health needs the header
              "Authorization: Bearer KEY": without it, HTTP 401 in OpenAI's error shape;
  CORS        closed (no Access-Control-* header: browsers refuse cross-origin calls) unless
              Edges.allow_origins names origins;
  timeouts    a connection that sends no whole request head within header_timeout seconds
              (from its opening, or from the first byte of its next request) is closed
              (http_protocol()); a body that stops arriving for body_timeout seconds gets
              HTTP 408 and the connection is closed; between two requests (from the end of
              an answer to the first byte of the next request), uvicorn's keep-alive timeout
              (idle_timeout) closes an idle connection;
  connections at most max_connections open at once (http_protocol()): one more closes the
              kept-alive connection idle the longest, or, with none idle, has its request
              answered 503 with Retry-After and closed;
  client gone a client that leaves while sending its body is one log line, no traceback;
  counting    a POST /v1/... answered 4xx by the checks counts once as "invalid", one whose
              client left mid-body as "cancelled" (serve/metrics.py; the engine counts the
              requests it accepted).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
import uuid
from dataclasses import dataclass

from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import error_body

log = logging.getLogger("uvicorn.error")
HEALTH = ("GET", "/health")            # open without the key: a supervisor's probe
_CLIENT_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")    # a client's X-Request-Id that we keep


@dataclass(frozen=True)
class Edges:
    """The serve flags of this module (docs/serving.md): the key, the origins CORS allows,
    the timeouts in seconds and the connections open at once. idle_timeout is above the 60 s
    for which load balancers and proxies keep an idle connection to a backend (AWS ALB,
    nginx's upstream keepalive_timeout): a backend that closes first races the balancer's
    next request on that connection, which then fails (a 502)."""
    api_key: str | None = None
    allow_origins: tuple = ()
    header_timeout: float = 30.0
    body_timeout: float = 30.0
    idle_timeout: float = 75.0
    max_connections: int = 512


def wrap(app, edges: Edges, metrics=None):
    """The ASGI application serving app (a Starlette application, not yet started) behind the
    edges: request id outermost (so that every answer has one), then CORS, then the key;
    the body's guard goes inside Starlette's own error handling, next to the routes."""
    app.add_middleware(_BodyGuard, timeout=edges.body_timeout, metrics=metrics)
    outer = app
    if edges.api_key is not None:
        outer = _Key(outer, edges.api_key)
    if edges.allow_origins:
        outer = CORSMiddleware(outer, allow_origins=list(edges.allow_origins),
                               allow_methods=["GET", "POST"],
                               allow_headers=["Authorization", "Content-Type", "X-Request-Id"],
                               expose_headers=["X-Request-Id"])
    return _RequestId(outer, metrics)


async def _json(send, status: int, body: dict, headers=()):
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode()), *headers]})
    await send({"type": "http.response.body", "body": data})


def _header(scope, name: bytes) -> bytes | None:
    for k, v in scope["headers"]:
        if k == name:
            return v
    return None


def _counted(scope) -> bool:
    """A request to the model (the engine counts it once accepted)."""
    return scope["method"] == "POST" and scope["path"].startswith("/v1/")


class _RequestId:
    """X-Request-Id on every answer; one log line per request naming it; the 4xx of the model's
    endpoints counted."""

    def __init__(self, app, metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        theirs = (_header(scope, b"x-request-id") or b"").decode("latin-1")
        rid = theirs if _CLIENT_ID.fullmatch(theirs) else uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"] = rid
        status = None
        t0 = time.monotonic()

        async def send_with_id(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"x-request-id", rid.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            if self.metrics is not None and _counted(scope) and status is not None \
                    and 400 <= status < 499:        # 499: a client gone, the engine counts it
                self.metrics.outcome("invalid")
            client = scope.get("client")
            # a healthy probe (a load balancer's, every few seconds) at debug: not a line each
            probe = (scope["method"], scope["path"]) == HEALTH and status == 200
            log.log(logging.DEBUG if probe else logging.INFO,
                    '%s - "%s %s" %s %.0f ms, request %s%s',
                    f"{client[0]}:{client[1]}" if client else "-", scope["method"],
                    scope["path"], status if status is not None else "(no answer)",
                    1e3 * (time.monotonic() - t0), rid,
                    f": {state['why']}" if "why" in state else "")


class _Key:
    """Every request but GET /health needs "Authorization: Bearer <key>" (HTTP 401)."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, b"Bearer " + key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or (scope["method"], scope["path"]) == HEALTH:
            return await self.app(scope, receive, send)
        given = _header(scope, b"authorization")
        if given is not None and hmac.compare_digest(given, self.expected):
            return await self.app(scope, receive, send)
        why = ("no API key was sent" if given is None else
               "the API key sent is not this server's")
        await _json(send, 401, error_body(
            f"{why}: send the header 'Authorization: Bearer KEY' with the key the server was "
            f"started with (--api-key or STARPU_LLM_API_KEY)", code="invalid_api_key"),
            [(b"www-authenticate", b"Bearer")])


class _BodyStalled(Exception):
    pass


class _BodyGuard:
    """Inside Starlette's error handling: a body that stops arriving for `timeout` seconds
    ends with HTTP 408 (the connection closed); a client that leaves mid-body is one log
    line instead of a ClientDisconnect traceback."""

    def __init__(self, app, timeout: float, metrics=None):
        self.app, self.timeout, self.metrics = app, timeout, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        got, whole, started = 0, False, False

        async def guarded_receive():
            nonlocal got, whole
            if whole:
                return await receive()          # the body is in: waiting for a disconnect
            try:
                message = await asyncio.wait_for(receive(), self.timeout)
            except asyncio.TimeoutError:
                raise _BodyStalled from None
            got += len(message.get("body", b""))
            whole = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        state = scope.setdefault("state", {})       # "why": said on the request's log line
        try:
            await self.app(scope, guarded_receive, tracked_send)
        except _BodyStalled:
            state["why"] = (f"its body stopped arriving for {self.timeout:g} s after {got} "
                            f"bytes; answered 408 and closed")
            if not started:
                await _json(send, 408, error_body(
                    f"the request body stopped arriving: nothing for {self.timeout:g} s after "
                    f"{got} bytes; send the whole body without pauses", code="timeout"),
                    [(b"connection", b"close")])
        except ClientDisconnect:
            state["why"] = f"the client left after {got} bytes of its body"
            if self.metrics is not None and _counted(scope):
                self.metrics.outcome("cancelled")


def _refuse(edges: Edges, metrics=None):
    """The application of a connection beyond edges.max_connections, none idle to close: 503,
    the connection closed; behind the request id (its header, its log line) and counted
    "rejected" like a full queue's 503."""
    async def refuse(scope, receive, send):
        if metrics is not None and _counted(scope):
            metrics.rejected()
        more = True
        while more:     # the body read first: a close over unread bytes resets the connection
            try:        # and the client never reads the answer
                message = await asyncio.wait_for(receive(), edges.body_timeout)
            except asyncio.TimeoutError:
                break
            more = message["type"] == "http.request" and message.get("more_body", False)
        await _json(send, 503, error_body(
            f"the server has {edges.max_connections} connections open, its most "
            f"(--max-connections), none of them idle; retry in a second", "server_busy"),
            [(b"retry-after", b"1"), (b"connection", b"close")])
    return _RequestId(refuse, metrics)


class _Edge(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline on each request head (a connection that
    sends nothing, or half a head, for edges.header_timeout seconds is closed) and at most
    edges.max_connections connections open (a refusal counted in metrics, a serve/metrics.Metrics
    or None)."""
    edges = Edges()
    metrics = None

    def connection_made(self, transport):
        super().connection_made(transport)
        self._head_timer = self.loop.call_later(self.edges.header_timeout, self._head_stalled)
        if len(self.connections) > self.edges.max_connections:
            self._make_room()

    def _make_room(self):
        """This connection is one too many: close the one idle the longest (its keep-alive
        timer due first), else refuse this one's request. Idle connections (a balancer's pool,
        kept idle_timeout seconds) never keep a request out."""
        live = [c for c in self.connections if not c.transport.is_closing()]
        if len(live) <= self.edges.max_connections:
            return                  # the excess is already closing
        idle = [c for c in live if c.timeout_keep_alive_task is not None]
        if idle:
            oldest = min(idle, key=lambda c: c.timeout_keep_alive_task.when())
            log.info("closed an idle kept-alive connection for the connection of %s "
                     "(--max-connections %d)", self._who(), self.edges.max_connections)
            oldest.timeout_keep_alive_handler()
        else:
            log.warning("the connection of %s is answered 503: %d connections are open, none "
                        "idle (--max-connections)", self._who(), self.edges.max_connections)
            self.app = _refuse(self.edges, self.metrics)

    def data_received(self, data: bytes):
        cycle = self.cycle
        super().data_received(data)
        if self.cycle is not cycle:                 # a whole head came: its request runs
            self._stop_head_timer()
        elif (self._head_timer is None and not self.transport.is_closing()
              and (self.cycle is None or self.cycle.response_complete)):
            # the first bytes of the next request's head on a kept-alive connection
            self._head_timer = self.loop.call_later(self.edges.header_timeout,
                                                    self._head_stalled)

    def connection_lost(self, exc):
        self._stop_head_timer()
        super().connection_lost(exc)

    def _who(self) -> str:
        return f"{self.client[0]}:{self.client[1]}" if self.client else "a client"

    def _stop_head_timer(self):
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_stalled(self):
        self._head_timer = None
        if not self.transport.is_closing():
            log.info("closed the connection of %s: no whole request head within %g s",
                     self._who(), self.edges.header_timeout)
            self.transport.close()


def http_protocol(edges: Edges, metrics=None) -> type:
    """The protocol class for uvicorn.Config(http=...): h11 with the head's deadline and the
    cap on connections (its refusals counted in metrics, wrap()'s)."""
    return type("H11Edge", (_Edge,), {"edges": edges, "metrics": metrics})
