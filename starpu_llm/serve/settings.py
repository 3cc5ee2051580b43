"""`starpu-llm serve`'s settings and their defaults, each stated here once: cli.py builds the
flags (their defaults and the numbers in their help) from these, cli_serve.py and
serve/middleware.py read the values. Nothing heavy is imported here, so that the parser reads
the defaults without the serve extra (Starlette, uvicorn) installed."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Serving:
    """The engine and process flags: where to listen, the slots and the queue, the seconds
    a stop waits for the running requests, and those without a decode step completed (work
    pending) after which GET /health answers 503: about twice GPT-2 XL's longest step on a
    loaded 2-core machine (docs/serving.md, "Faults and supervision", has the sum; 0: off);
    uvicorn's log level (info: a line a request)."""
    host: str = "127.0.0.1"
    port: int = 8000
    max_batch: int = 8
    max_queue: int = 64
    shutdown_timeout: float = 30.0
    stall_timeout: float = 300.0
    log_level: str = "info"


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
