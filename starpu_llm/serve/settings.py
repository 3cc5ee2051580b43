"""`starpu-llm serve`'s settings and their defaults, each stated here once: cli.py builds the
flags (their defaults, the numbers in their help and, for Serving's, their rules) from these,
cli_serve.py and serve/middleware.py read the values. Nothing heavy is imported here, so that the parser reads
the defaults without the serve extra (Starlette, uvicorn) installed."""
from __future__ import annotations

from dataclasses import dataclass

from ..plan.settings import setting


@dataclass(frozen=True)
class Serving:
    """The engine and process flags, each a setting (plan/settings.setting: its default, help
    and rule, which the flag and run_serve's check_fields both keep): where to listen, the
    slots and the queue, the seconds a stop waits for the running requests, and those without
    a decode step completed (work pending) after which GET /health answers 503: about twice
    GPT-2 XL's longest step on a loaded 2-core machine (docs/serving.md, "Faults and
    supervision", has the sum; 0: off); uvicorn's log level (info: a line a request)."""
    host: str = setting("127.0.0.1", "address to listen on (default %(default)s: this machine "
                        "only)")
    port: int = setting(8000, "TCP port (default %(default)s; 0: a free one, printed)",
                        check="port")
    max_batch: int = setting(8, "sequences generated at once, each in a slot of the key/value "
                             "cache (default %(default)s)", check="positive")
    max_queue: int = setting(64, "requests waiting for a slot beyond those; more are refused "
                             "with HTTP 503 and Retry-After (default %(default)s)",
                             check="nonneg_int")
    shutdown_timeout: float = setting(30.0, "seconds the running requests get to finish after "
                                      "SIGINT or SIGTERM, before they are cancelled (default "
                                      "%(default)g)", check="nonneg")
    stall_timeout: float = setting(300.0, "seconds without a decode step completed, with "
                                   "requests pending, after which GET /health answers 503 and "
                                   "new requests are refused (a stuck task); 0: never (default "
                                   "%(default)g, beyond GPT-2 XL's longest step on a loaded "
                                   "machine)", check="nonneg")
    log_level: str = setting("info", "uvicorn's log level (info: one line per request)",
                             choices=["critical", "error", "warning", "info", "debug"])


@dataclass(frozen=True)
class Edges:
    """The flags of serve/middleware.py (docs/serving.md): the key, the origins CORS allows,
    the timeouts in seconds, the connections open at once and the largest request body, in
    MiB. idle_timeout is above the 60 s for which load balancers and proxies keep an idle
    connection to a backend (AWS ALB, nginx's upstream keepalive_timeout): a backend that
    closes first races the balancer's next request on that connection, which then fails (a
    502). max_body: --max-batch prompts that fit GPT-2's context are far smaller (a prompt of
    maxT = 1024 tokens is at most 128 Ki characters, 12 bytes each as JSON's escaped
    surrogate pairs: 1.5 MiB)."""
    api_key: str | None = None
    allow_origins: tuple = ()
    header_timeout: float = 30.0
    body_timeout: float = 30.0
    idle_timeout: float = 75.0
    max_connections: int = 512
    max_body: int = 16
