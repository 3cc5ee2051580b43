"""The HTTP side: an ASGI application (Starlette) speaking OpenAI's completions API to the
engine (serve/engine.py), served by uvicorn (cli_serve.py).

  POST /v1/completions   a completion, whole or streamed as server-sent events (stream: true)
  POST /v1/chat/completions  the same for a conversation (serve/chat.py)
  GET  /v1/models        the one model served (and GET /v1/models/{id})
  GET  /health           200 {"status": "ok", ...} while serving, 503 once stopping or failed,
                         or while stalled (serve/engine.Engine.stalled: why, and since when)
  GET  /metrics          Prometheus metrics (serve/metrics.py)

The handlers run on the event loop and never wait for the engine thread: a request is
checked (serve/api.py), handed to Engine.submit (which queues it or refuses it at once: HTTP
503 with Retry-After), and its text comes back through an asyncio queue that the engine
thread fills with loop.call_soon_threadsafe. A client that goes away (its connection closed)
cancels its requests: the engine frees their slots before its next step.
"""
from __future__ import annotations

import asyncio
import datetime
import json
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from . import api, chat
from .engine import Event, QueueFull, Request, ShuttingDown
from .errors import BadRequest, error_body
from .metrics import CONTENT_TYPE


# A stream with no event for this many seconds (waiting in the queue, a long prompt, a slow
# step) sends an SSE comment line, which clients skip: a proxy's read timeout (nginx's
# proxy_read_timeout, a load balancer's idle timeout: 60 s by default) otherwise cuts it.
KEEPALIVE_S = 15.0


async def _body(request: HTTPRequest) -> bytearray:
    """The request's body (its size bounded by --max-body: serve/middleware.py's body guard
    refuses a larger one as it arrives)."""
    body = bytearray()            # grown in place: the body is held once, not twice
    async for chunk in request.stream():
        body += chunk
    return body


def _error(status: int, message: str, kind: str = "invalid_request_error", param=None,
           code=None, headers=None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param, code), status, headers=headers)


def create_app(engine, model: str, chat_template=None) -> Starlette:
    """The application serving `engine` (started) under the model name `model`, with the
    engine's metrics; chat_template: chat.Template of the chat API (None: the default)."""
    created = int(time.time())
    config, metrics = engine.config, engine.metrics
    most = api.max_values(engine.max_batch, engine.cache_len, config.V)

    def checked(raw: bytes, parse) -> api.Completion:
        return parse(api.parse_json(raw, most), model, engine.tokenizer, config.V,
                     engine.cache_len, engine.max_batch)

    async def completions(request: HTTPRequest, parse=api.parse_completion):
        try:
            # parsed and tokenized in a thread: a large body never holds the event loop
            c = await asyncio.to_thread(checked, await _body(request), parse)
        except BadRequest as e:
            kind = "not_found_error" if e.status == 404 else "invalid_request_error"
            return _error(e.status, e.message, kind, e.param, e.code)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def listener(k):
            return lambda ev: loop.call_soon_threadsafe(events.put_nowait, (k, ev))

        reqs = [Request(ch.ids, c.sampling, listener(k), c.rng(k))
                for k, ch in enumerate(c.choices)]
        try:
            engine.submit(reqs)
        except QueueFull as e:
            return _error(503, str(e), "server_busy", headers={"Retry-After": str(e.retry_after)})
        except ShuttingDown as e:
            return _error(503, str(e), "server_unavailable", headers={"Retry-After": "5"})
        if c.stream:
            # X-Accel-Buffering: nginx passes each event on at once (it buffers by default)
            return StreamingResponse(_stream(c, reqs, events), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache",
                                              "X-Accel-Buffering": "no"})
        return await _whole(request, c, reqs, events)

    async def chat_completions(request: HTTPRequest):
        return await completions(request, lambda *a: chat.parse_chat(*a, chat_template))

    async def list_models(request):
        return JSONResponse(api.models(model, created))

    async def one_model(request):
        if request.path_params["name"] != model:
            return _error(404, f"the model {request.path_params['name']!r} does not exist: "
                               f"this server serves {model!r}", "not_found_error", "model",
                          "model_not_found")
        return JSONResponse(api.model_card(model, created))

    async def health(request):
        state, stall = engine.state(), engine.stalled()
        body = {"status": state, "model": model, "running": engine.running(),
                "waiting": engine.waiting(), "max_batch": engine.max_batch,
                "engine": engine.describe}
        if state == "ok" and stall is not None:
            since = datetime.datetime.fromtimestamp(time.time() - stall.seconds,
                                                    datetime.timezone.utc)
            body.update(status="stalled", why=stall.why,
                        since=since.isoformat(timespec="seconds"),
                        stalled_s=round(stall.seconds, 1))
        return JSONResponse(body, 200 if body["status"] == "ok" else 503)

    async def prometheus(request):
        if metrics is None:
            return _error(404, "no metrics on this server", "not_found_error")
        return Response(metrics.exposition(), media_type=CONTENT_TYPE)

    async def http_error(request, exc: HTTPException):
        return _error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                      "not_found_error" if exc.status_code == 404 else "invalid_request_error")

    routes = [Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/models", list_models, methods=["GET"]),
              Route("/v1/models/{name:path}", one_model, methods=["GET"]),
              Route("/health", health, methods=["GET"]),
              Route("/metrics", prometheus, methods=["GET"])]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error})


async def _whole(request: HTTPRequest, c: api.Completion, reqs, events: asyncio.Queue):
    """The whole completion as one JSON response; the requests cancelled if the client goes."""
    texts, finishes = [""] * len(reqs), [None] * len(reqs)
    logprobs = [[] for _ in reqs]
    usage = [0, 0]
    left = len(reqs)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        while left:
            get = asyncio.ensure_future(events.get())
            done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
            if get not in done:
                get.cancel()
                return Response(status_code=499)      # nobody reads it
            k, ev = get.result()
            texts[k] += ev.text
            logprobs[k] += ev.logprobs
            if ev.error:
                return _error(ev.status, ev.error, "server_error")
            if ev.finish:
                finishes[k], left = ev.finish, left - 1
                usage[0] += ev.prompt_tokens if c.choices[k].first else 0
                usage[1] += ev.completion_tokens
        return JSONResponse(c.response(texts, finishes, *usage, logprobs=logprobs))
    finally:
        gone.cancel()
        for r in reqs:
            r.cancel()          # nothing for a finished request; frees the others' slots


async def _disconnected(request: HTTPRequest):
    """Returns when the client has closed the connection."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _stream(c: api.Completion, reqs, events: asyncio.Queue):
    """The completion as server-sent events, one per piece of text, as OpenAI sends them:
    then, with include_usage, the usage; then "data: [DONE]"; a comment line after
    KEEPALIVE_S seconds without one. Starlette stops this generator
    when the client goes away; the requests are then cancelled."""
    usage = [0, 0]
    left = len(reqs)
    try:
        if c.echo:
            for ch in c.choices:
                yield _sse(c.chunk(ch.index, ch.text))
        while left:
            try:
                k, ev = await asyncio.wait_for(events.get(), KEEPALIVE_S)
            except asyncio.TimeoutError:
                yield ": keep-alive\n\n"
                continue
            ev: Event
            if ev.error:
                yield _sse(error_body(ev.error, "server_error"))
                break
            if ev.text or ev.finish or ev.logprobs:
                yield _sse(c.chunk(c.choices[k].index, ev.text, ev.finish, ev.logprobs))
            if ev.finish:
                left -= 1
                usage[0] += ev.prompt_tokens if c.choices[k].first else 0
                usage[1] += ev.completion_tokens
        if c.include_usage and not left:
            yield _sse(c.usage_chunk(*usage))
        yield "data: [DONE]\n\n"
    finally:
        for r in reqs:
            r.cancel()
