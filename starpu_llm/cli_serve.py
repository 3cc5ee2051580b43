"""`starpu-llm serve`: the model of an llm.c checkpoint behind an OpenAI-compatible HTTP API
(the engine: serve/engine.py; the API: serve/app.py and serve/api.py; docs/serving.md).

The checkpoint is read here, then the engine thread starts StarPU, registers the parameters
and builds the key/value cache once; uvicorn then serves HTTP on the main thread. SIGINT or
SIGTERM: uvicorn stops accepting connections, the engine refuses new requests (503) and lets
the accepted ones finish for --shutdown-timeout seconds, then cancels what is left; StarPU is
shut down and the command returns. A second SIGINT or SIGTERM cancels the requests at once,
each answered as at the deadline; a third SIGINT stops without waiting for their answers.
An engine that fails (an error in a decode step: every request in flight answered 503) stops
the server too, with status 1, for a supervisor to start it again (docs/serving.md).
"""
from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import sys

from . import signals
from .cli_generate import read_text_model
from .errors import StarpuLLMError
from .io import tokenizer
from .plan.partition import ENGINES
from .plan.settings import check_fields
from .serve.settings import Edges, Serving

SERVE_INSTALL = "pip install 'starpu-llm[serve]' (make install does it)"
BACKLOG = 2048        # connections waiting to be accepted (uvicorn's default)
# file descriptors the server holds besides its connections (the listening socket, the event
# loop's, StarPU's and CUDA's, the metrics' /proc reads): a tiny model served on 2 cores held 11
FD_HEADROOM = 64


def _web():
    """uvicorn and the application, or a clear error when the serve extra is missing."""
    try:
        import jinja2  # noqa: F401 (the chat templates)
        import uvicorn
        from .serve.app import create_app
        from .serve.metrics import Metrics
    except ImportError as e:
        raise StarpuLLMError(f"starpu-llm serve needs the packages of its HTTP server "
                             f"({e.name} is missing): {SERVE_INSTALL}") from None
    return uvicorn, create_app, Metrics


def load_model(config, params, engine: str = "starpu", partition=None):
    """The engine's load callable: run in the engine thread, it starts StarPU on the partition
    (a record.Partition, partition.resolve's) or the reference engine, registers params and
    returns an engine.Loaded."""
    def load():
        from .flow.generate import DirectBackend, StarPUBackend
        from .runtime.starpu import Runtime
        from .serve.engine import Loaded
        if engine == "reference":
            backend = DirectBackend(config, params)
            return Loaded(backend, 1, contextlib.nullcontext, backend.close,
                          "reference engine (the kernels in a plain loop, no StarPU)",
                          backend.threads)
        runtime = Runtime(partition)
        try:
            backend = StarPUBackend(runtime, config, params)
        except BaseException:
            runtime.shutdown()
            raise

        def close():
            try:
                backend.close()
            finally:                # StarPU stopped whatever the backend says
                runtime.shutdown()
        part = runtime.partition
        return Loaded(backend, part.workers, runtime.paused, close, runtime.describe(),
                      part.cores)
    return load


def listen_socket(host: str, port: int):
    """The server's socket, bound to host:port and listening before StarPU starts, so that a
    port in use or a host that is not this machine's is one error at once, not uvicorn's
    traceback after the loading. Listening, not only bound: with SO_REUSEADDR (a restart
    beside the old connections' TIME_WAIT) Linux binds a second socket to a port nobody
    listens on yet, so a second server started while the first loads was refused only once
    loaded. Connections made while the model loads wait in the backlog until it serves."""
    import errno
    import socket
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise StarpuLLMError(f"--host {host}: not an address ({getattr(e, 'strerror', e)}); "
                             "127.0.0.1 serves this machine only, 0.0.0.0 every interface")
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(BACKLOG)
    except OSError as e:
        sock.close()
        why = {errno.EADDRINUSE: f"--port {port}: {host}:{port} is already in use (another "
                                 "server?); choose another port, or --port 0 for a free one",
               errno.EACCES: f"--port {port}: this user may not listen on it (ports below "
                             "1024 need privileges); choose a port from 1024 up",
               errno.EADDRNOTAVAIL: f"--host {host}: not an address of this machine; "
                                    "127.0.0.1 serves this machine only, 0.0.0.0 every "
                                    "interface"}
        raise StarpuLLMError(why.get(e.errno, f"--host {host} --port {port}: cannot listen "
                                              f"there ({e.strerror})"))
    return sock


def warn_if_open(sock, api_key) -> None:
    """A warning when sock listens beyond this machine's loopback without a key: anyone who
    reaches the port uses the model."""
    host = sock.getsockname()[0]
    if api_key is None and not ipaddress.ip_address(host).is_loopback:
        print(f"warning: --host {host} without --api-key (or STARPU_LLM_API_KEY): anyone who "
              f"reaches this port uses the model (fine behind a proxy that checks access)",
              file=sys.stderr, flush=True)


def check_cache_memory(config, max_batch: int) -> None:
    """Refuse, before allocating them, --max-batch slots whose key/value caches (a key and a
    value per layer, position (maxT of a slot) and channel, float32) do not fit the memory
    this machine has available now."""
    from .flow.memory import group_bytes
    from .flow.tensors import KVCache
    from .runtime.offload import available_memory, format_size
    need = group_bytes(KVCache, config, max_batch, config.maxT)
    have = available_memory()
    if need > have:
        raise StarpuLLMError(
            f"--max-batch {max_batch} needs {format_size(need)} of key/value cache ({max_batch} "
            f"sequences of up to {config.maxT} positions), but this machine (or its container's "
            f"memory limit) has {format_size(have)} available: give a smaller --max-batch (at most "
            f"{max(1, have // (need // max_batch))} here)")


def check_connection_room(max_connections: int) -> None:
    """Refuse --max-connections beyond the file descriptors this process may open: past them
    asyncio stops accepting and logs a traceback a second, and opening anything fails."""
    import resource
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and max_connections + FD_HEADROOM > soft:
        raise StarpuLLMError(
            f"--max-connections {max_connections} needs {max_connections + FD_HEADROOM} file "
            f"descriptors, but this process may open {soft} ('ulimit -n'; LimitNOFILE= in a "
            f"systemd unit): raise that limit, or give --max-connections at most "
            f"{max(1, soft - FD_HEADROOM)}")


def run_serve(init_from, host: str = Serving.host, port: int = Serving.port,
              max_batch: int = Serving.max_batch, max_queue: int = Serving.max_queue,
              engine: str = ENGINES[0], request=None, model_name=None,
              shutdown_timeout: float = Serving.shutdown_timeout,
              log_level: str = Serving.log_level,
              edges=None, chat_template=None,
              stall_timeout: float = Serving.stall_timeout) -> int:
    """`starpu-llm serve` (see the module docstring): request, a partition.PartitionRequest
    (None: the default partition); edges: serve/middleware.Edges' fields (the key, CORS, the
    timeouts, the connection cap; None: the defaults); chat_template: the --chat-template
    file (None: the default template, serve/chat.py); stall_timeout: --stall-timeout
    (serve/engine.Engine; 0: off); the defaults are serve/settings.py's. Prints "serving
    MODEL on http://HOST:PORT" once it takes requests (port 0: a free port, the one
    printed)."""
    from .plan.partition import PartitionRequest
    from .runtime.starpu import resolve_here
    check_fields(Serving(host=host, port=port, max_batch=max_batch, max_queue=max_queue,
                         shutdown_timeout=shutdown_timeout, stall_timeout=stall_timeout,
                         log_level=log_level))        # the flags' rules, for a Python caller
    edges = Edges(**(edges or {}))                  # its own (Edges.__post_init__)
    request = request or PartitionRequest()
    partition = resolve_here(request, engine=engine)      # bad flags fail before the model loads
    uvicorn, create_app, Metrics = _web()
    from .serve import middleware
    from .serve.chat import load_template
    from .serve.engine import Engine
    template = load_template(chat_template) if chat_template is not None else None
    metrics = Metrics(max_batch)
    protocol = middleware.http_protocol(edges, metrics)     # a uvicorn it cannot use: said now
    config, params = read_text_model(init_from, "serve")
    check_cache_memory(config, max_batch)
    check_connection_room(edges.max_connections)
    sock = listen_socket(host, port)      # before the slow part: a port in use is said at once
    warn_if_open(sock, edges.api_key)
    with contextlib.closing(sock):
        model = model_name or os.path.splitext(os.path.basename(os.path.normpath(init_from)))[0]
        tok = tokenizer.gpt2()
        load = load_model(config, params, engine, partition)
        eng = Engine(load, config, tok, tok.eot, max_batch=max_batch, max_queue=max_queue,
                     metrics=metrics,
                     stall_timeout=stall_timeout)
        eng.start()              # StarPU up, the model registered; an error is raised here
        stopped = []

        class Server(uvicorn.Server):
            async def startup(self, sockets=None):
                await super().startup(sockets)
                if self.started:
                    h, p = self.servers[0].sockets[0].getsockname()[:2]
                    h = f"[{h}]" if ":" in h else h          # an IPv6 address in a URL
                    print(f"serving {model} on http://{h}:{p} ({eng.describe}; --max-batch "
                          f"{max_batch})", flush=True)

            async def on_tick(self, counter: int) -> bool:
                # a failed engine ends the server (the requests in flight were answered)
                return await super().on_tick(counter) or eng.state().startswith("failed")

            def handle_exit(self, sig, frame):
                if not stopped:
                    print(f"{signal.Signals(sig).name}: no new requests; the running ones have "
                          f"{shutdown_timeout:g} s to finish", flush=True)
                stopped.append(sig)
                eng.drain(0.0 if len(stopped) > 1 else shutdown_timeout)
                # the second cancels the requests, which are answered (a 503, a stream's error
                # event) before uvicorn stops: its forced exit (a second SIGINT) would cut
                # them; a third forces it
                if len(stopped) != 2:
                    super().handle_exit(sig, frame)

        hosts = middleware.host_names(host, sock.getsockname()[0], edges.allow_hosts)
        app = middleware.wrap(create_app(eng, model, template), edges, hosts, metrics)
        server = Server(uvicorn.Config(app, log_level=log_level, lifespan="off",
                                       timeout_graceful_shutdown=shutdown_timeout + 5,
                                       http=protocol,
                                       timeout_keep_alive=edges.idle_timeout,
                                       access_log=False))      # middleware logs each request
        # the CLI's stop-after-the-step handlers (signals.py) out of the way: uvicorn's drain
        # here; uvicorn gives the signals back to the handlers below once it stops, and raises
        # them again
        with signals.suspended():
            previous = {s: signal.signal(s, lambda *a: None)
                        for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                server.run(sockets=[sock])
            finally:
                for s, h in previous.items():
                    signal.signal(s, h)
                done = eng.close(timeout=0.0 if stopped else shutdown_timeout)
        failed = eng.state().startswith("failed")
        if failed:
            print(f"the engine {eng.state()}; the server stopped (status 1) for its "
                  f"supervisor to start it again", flush=True)
        if eng.close_error:
            print(f"stopped, but {eng.close_error}", flush=True)
        else:
            print("stopped: StarPU shut down" if done else
                  "stopped, but the engine thread did not end", flush=True)
        return 0 if done and server.started and not failed and not eng.close_error else 1
