"""The server's edges, around the application of serve/app.py (installed by wrap()):

  request id  every answer carries an X-Request-Id header (the client's own when it sent a
              plain one, else a new one), and the log line of the request names it (one line
              per request at --log-level info, in place of uvicorn's access line; a GET
              /health answered 200 at debug);
  Host        a request whose Host header names another host than the server's (a name of
              host_names(): --host's, localhost when it listens on loopback, --allow-host's;
              an IP address is always taken) is refused with 400 before it runs: a web page of a
              domain its owner rebinds to this address (DNS rebinding) is then same-origin,
              and would read the answers the Origin check lets through;
  API key     with Edges.api_key, every request but GET /health needs the header
              "Authorization: Bearer KEY": without it, HTTP 401 in OpenAI's error shape;
  CORS        closed (no Access-Control-* header: browsers refuse cross-origin calls) unless
              Edges.allow_origins names origins; a request a browser sends from a page of
              another origin (its Origin header) is refused with 403 before it runs: CORS
              only hides the answer, and a page's plain-text POST needs no preflight, so any
              site a user visits could otherwise run completions on a server on their machine
              or network;
  timeouts    a connection that sends no whole request head within header_timeout seconds
              (from its opening, or from the first byte of its next request) is closed
              (http_protocol()); a body that stops arriving for body_timeout seconds gets
              HTTP 408 and the connection is closed; between two requests (from the end of
              an answer to the first byte of the next request), uvicorn's keep-alive timeout
              (idle_timeout) closes an idle connection; a client that reads nothing of its
              answer for body_timeout seconds (the socket's buffers full) has its connection
              cut, so that it does not hold the connection and the answer's bytes for ever;
  connections at most max_connections open at once (http_protocol()): one more closes the
              kept-alive connection idle the longest, or, with none idle, has its request
              answered 503 with Retry-After and closed;
  body size   a body over max_body MiB is answered 413 and the connection closed, as it
              arrives (its Content-Length, or its bytes so far), never held whole;
  encoding    a body with a Content-Encoding other than identity is read (under the limits
              above) and answered 415;
  client gone a client that leaves while sending its body is one log line, no traceback;
  counting    a POST /v1/... answered 4xx by the checks counts once as "invalid", one whose
              client left mid-body as "cancelled" (serve/metrics.py; the engine counts the
              requests it accepted).
"""
from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import re
import time
import uuid

from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..errors import StarpuLLMError
from .errors import error_body
from .settings import Edges

log = logging.getLogger("uvicorn.error")
HEALTH = ("GET", "/health")            # open without the key: a supervisor's probe
_CLIENT_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")    # a client's X-Request-Id that we keep


def wrap(app, edges: Edges, hosts: frozenset | None, metrics=None):
    """The ASGI application serving app (a Starlette application, not yet started) behind the
    edges: request id outermost (so that every answer has one), then the Host check (hosts:
    host_names()'s names; None: any), CORS, the key; the body's guard goes inside Starlette's
    own error handling, next to the routes."""
    app.add_middleware(_BodyGuard, edges=edges, metrics=metrics)
    outer = app
    if edges.api_key is not None:
        outer = _Key(outer, edges.api_key)
    if "*" not in edges.allow_origins:
        outer = _Origin(outer, edges.allow_origins)
    if edges.allow_origins:
        outer = CORSMiddleware(outer, allow_origins=list(edges.allow_origins),
                               allow_methods=["GET", "POST"],
                               allow_headers=["Authorization", "Content-Type", "X-Request-Id"],
                               expose_headers=["X-Request-Id"])
    if hosts is not None:
        outer = _Host(outer, hosts)
    return _RequestId(outer, metrics)


def host_names(host: str, bound: str, allow_hosts) -> frozenset | None:
    """The host names (lower case) a request's Host header may give, the server listening on
    --host host, bound to the address bound, with --allow-host's names allow_hosts; None: any.
    Any, when it listens on every interface (0.0.0.0, ::) and --allow-host names none: the
    operator opened it to whatever names its clients use (a LAN name, a load balancer's, a
    container service's), none of which the server can know, and without a key anyone who
    reaches the port has the model anyway (a warning at start); --allow-host closes it."""
    if "*" in allow_hosts:
        return None
    address = ipaddress.ip_address(bound.partition("%")[0])
    if address.is_unspecified and not allow_hosts:
        return None
    names = {h.lower().rstrip(".") for h in (host, *allow_hosts)}
    if address.is_loopback or address.is_unspecified:
        names.add("localhost")
    return frozenset(names)


def _host_name(value: bytes) -> str:
    """The host of a Host header's value (example.com:8000, [::1]:8000), lower case, without
    its port or trailing dot."""
    v = value.decode("latin-1").strip().lower()
    if v.startswith("["):
        v = v[1:].partition("]")[0]
    elif v.count(":") == 1:
        v = v.partition(":")[0]
    return v.rstrip(".")


def _ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


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


class _Origin:
    """A request with an Origin header (a browser's, from a web page) of an origin that
    --allow-origin does not name: HTTP 403, before it runs. Clients that are not browsers
    (curl, OpenAI's) send no Origin."""

    def __init__(self, app, origins):
        self.app, self.allowed = app, {o.encode() for o in origins}

    async def __call__(self, scope, receive, send):
        origin = _header(scope, b"origin") if scope["type"] == "http" else None
        if origin is None or origin in self.allowed:
            return await self.app(scope, receive, send)
        shown = origin.decode("latin-1")
        scope.setdefault("state", {})["why"] = f"a web page of {shown} sent it"
        await _json(send, 403, error_body(
            f"requests from web pages of the origin {shown} are not allowed; to let that "
            f"site's pages call this server, start it with --allow-origin {shown}",
            code="origin_not_allowed"))


class _Host:
    """A request whose Host header gives a name that is not one of names (host_names()'s),
    nor an IP address, nor under .localhost when localhost is among them: HTTP 400, before it runs.
    A DNS rebinding needs a name (its owner's DNS answers this server's address), so an
    address is never one; a request without Host (HTTP/1.0) runs."""

    def __init__(self, app, names: frozenset):
        self.app, self.names = app, names

    async def __call__(self, scope, receive, send):
        given = _header(scope, b"host") if scope["type"] == "http" else None
        if given is None:
            return await self.app(scope, receive, send)
        name = _host_name(given)
        if (name in self.names or _ip(name)
                or ("localhost" in self.names and name.endswith(".localhost"))):
            return await self.app(scope, receive, send)
        scope.setdefault("state", {})["why"] = f"its Host header names {name}"
        await _json(send, 400, error_body(
            f"this server does not answer requests for the host {name} (the Host header): a "
            f"web page of a domain pointed at this server's address would read its answers; "
            f"to serve that name, start the server with --allow-host {name}",
            code="host_not_allowed"))


class _BodyStalled(Exception):
    pass


class _BodyTooLarge(Exception):
    pass


class _BodyGuard:
    """Inside Starlette's error handling: a body over edges.max_body MiB is refused as it
    arrives, before it is held (HTTP 413, the connection closed: its Content-Length, or the
    bytes come so far of a chunked one); a body that stops arriving for edges.body_timeout
    seconds ends with HTTP 408 (the connection closed); a client that leaves mid-body is one
    log line instead of a ClientDisconnect traceback."""

    def __init__(self, app, edges: Edges, metrics=None):
        self.app, self.timeout, self.metrics = app, edges.body_timeout, metrics
        self.max_body = edges.max_body

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = scope.setdefault("state", {})       # "why": said on the request's log line
        limit = self.max_body << 20
        declared = (_header(scope, b"content-length") or b"").strip()
        if declared.isdigit() and int(declared) > limit:
            return await self._too_large(send, state, int(declared))
        encoding = (_header(scope, b"content-encoding") or b"identity").strip().lower()
        app = self.app if encoding == b"identity" else _unencoded_only(encoding, state)
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
            if got > limit:
                raise _BodyTooLarge
            whole = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await app(scope, guarded_receive, tracked_send)
        except _BodyTooLarge:
            if not started:
                await self._too_large(send, state, got)
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

    async def _too_large(self, send, state, size: int):
        state["why"] = f"its body of {size} bytes or more is over --max-body; answered 413"
        await _json(send, 413, error_body(
            f"the request body is larger than {self.max_body} MiB (--max-body): send fewer or "
            f"shorter prompts (a prompt must fit the model's context)", code="body_too_large"),
            [(b"connection", b"close")])


async def _drain(receive, timeout=None) -> None:
    """The rest of the request body read and dropped (None: receive's own deadline): a close
    over unread bytes resets the connection, and the client never reads the answer."""
    more = True
    while more:
        try:
            message = await asyncio.wait_for(receive(), timeout)
        except asyncio.TimeoutError:
            break
        more = message["type"] == "http.request" and message.get("more_body", False)


def _unencoded_only(encoding: bytes, state):
    """The application of a body with a Content-Encoding other than identity: its body read
    (under the guard's size and time limits) and dropped, then HTTP 415. Refused, not decoded:
    no client of this API compresses its requests, and a decoder would be a decompression
    bomb's way past --max-body."""
    shown = encoding.decode("latin-1")

    async def refuse(scope, receive, send):
        state["why"] = f"its body is encoded (Content-Encoding: {shown}); answered 415"
        await _drain(receive)
        await _json(send, 415, error_body(
            f"the request body is encoded (Content-Encoding: {shown}); this server reads only "
            f"bodies sent as they are: send it without Content-Encoding",
            code="unsupported_content_encoding"))
    return refuse


def _refuse(edges: Edges, metrics=None):
    """The application of a connection beyond edges.max_connections, none idle to close: 503,
    the connection closed; behind the request id (its header, its log line) and counted
    "rejected" like a full queue's 503."""
    async def refuse(scope, receive, send):
        if metrics is not None and _counted(scope):
            metrics.rejected()
        await _drain(receive, edges.body_timeout)
        await _json(send, 503, error_body(
            f"the server has {edges.max_connections} connections open, its most "
            f"(--max-connections), none of them idle; retry in a second", "server_busy"),
            [(b"retry-after", b"1"), (b"connection", b"close")])
    return _RequestId(refuse, metrics)


def _cancel(timer) -> None:
    """timer (an asyncio.TimerHandle or None) cancelled; None, for its attribute."""
    if timer is not None:
        timer.cancel()


class _Edge(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline on each request head (a connection that
    sends nothing, or half a head, for edges.header_timeout seconds is closed) and at most
    edges.max_connections connections open (a refusal counted in metrics, a serve/metrics.Metrics
    or None)."""
    edges = Edges()
    metrics = None
    _unread_timer = None

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

    def pause_writing(self):
        """The socket's buffers are full (the client reads nothing): cut the connection if
        that lasts edges.body_timeout seconds."""
        super().pause_writing()
        if self._unread_timer is None:
            self._unread_timer = self.loop.call_later(self.edges.body_timeout, self._unread)

    def resume_writing(self):
        super().resume_writing()
        self._stop_unread_timer()

    def connection_lost(self, exc):
        self._stop_head_timer()
        self._stop_unread_timer()
        super().connection_lost(exc)

    def _unread(self):
        self._unread_timer = None
        log.info("cut the connection of %s: it read nothing of its answer for %g s "
                 "(--body-timeout)", self._who(), self.edges.body_timeout)
        self.transport.abort()      # close() would wait for the unread bytes to go

    def _who(self) -> str:
        return f"{self.client[0]}:{self.client[1]}" if self.client else "a client"

    def _stop_head_timer(self):
        self._head_timer = _cancel(self._head_timer)

    def _stop_unread_timer(self):
        self._unread_timer = _cancel(self._unread_timer)

    def _head_stalled(self):
        self._head_timer = None
        if not self.transport.is_closing():
            log.info("closed the connection of %s: no whole request head within %g s",
                     self._who(), self.edges.header_timeout)
            self.transport.close()


# What _Edge uses of uvicorn's H11Protocol beyond asyncio's Protocol methods: no public option
# does what it does (uvicorn's limit_concurrency answers a plain-text 503 and never closes an
# idle kept-alive connection; it has no head or unread-answer deadline). Tested with uvicorn
# 0.54.0 (pyproject asks for 0.30 or later).
UVICORN_NEEDS = ("connections", "cycle", "app", "loop", "client", "transport", "flow",
                 "timeout_keep_alive_task", "timeout_keep_alive_handler")


def _check_uvicorn():
    """One error at start when this uvicorn's H11Protocol lacks what _Edge uses (else the cap
    and the deadlines would fail on each connection, or silently not hold)."""
    import uvicorn
    from uvicorn.server import ServerState

    async def nothing(scope, receive, send):
        pass
    loop = asyncio.new_event_loop()
    try:
        config = uvicorn.Config(nothing, lifespan="off", log_config=None)
        config.load()
        probe = H11Protocol(config, ServerState(), {}, loop)
        missing = [name for name in UVICORN_NEEDS if not hasattr(probe, name)]
    except TypeError as e:          # its constructor changed
        missing = [f"__init__ ({e})"]
    finally:
        loop.close()
    if missing:
        raise StarpuLLMError(
            f"uvicorn {uvicorn.__version__} lacks what serve's --max-connections and "
            f"--header-timeout are built on (uvicorn's H11Protocol.{missing[0]}): install a "
            f"uvicorn this server was tested with, pip install 'uvicorn>=0.30,<=0.54'")


def http_protocol(edges: Edges, metrics=None) -> type:
    """The protocol class for uvicorn.Config(http=...): h11 with the head's deadline, the
    unread answer's, and the cap on connections (its refusals counted in metrics, wrap()'s);
    StarpuLLMError when this uvicorn's protocol lacks what they are built on."""
    _check_uvicorn()
    return type("H11Edge", (_Edge,), {"edges": edges, "metrics": metrics})
