"""`starpu-llm serve`'s settings and their defaults, each stated here once: cli.py builds the
flags (their defaults, the numbers in their help, their rules) from these, cli_serve.py and
serve/middleware.py read the values. Nothing heavy is imported here, so that the parser
reads the defaults without the serve extra (Starlette, uvicorn) installed."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import StarpuLLMError, opt
from ..plan.settings import check_fields, setting


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


def check_api_key(key, name: str) -> None:
    """--api-key's rule (name: how the error names it: the flag, $STARPU_LLM_API_KEY, the
    field): a key clients can send in a header. The message does not repeat the key."""
    if not isinstance(key, str) or not key or key.strip() != key or not key.isprintable() \
            or not key.isascii():
        raise StarpuLLMError(f"{name} must be printable ASCII, not empty and without spaces "
                             f"around it")


@dataclass(frozen=True)
class Edges:
    """The flags of serve/middleware.py (docs/serving.md): the key, the origins CORS allows,
    the host names beyond the server's own that a request's Host header may give, and, each a
    setting (its default, help and rule: the flag's and, made from Python,
    __post_init__'s), the timeouts in seconds, the connections open at once and the largest
    request body, in MiB. idle_timeout is above the 60 s for which load balancers and proxies
    keep an idle connection to a backend (AWS ALB, nginx's upstream keepalive_timeout): a
    backend that closes first races the balancer's next request on that connection, which
    then fails (a 502). max_body: --max-batch prompts that fit GPT-2's context are far
    smaller (a prompt of maxT = 1024 tokens is at most 128 Ki characters, 12 bytes each as
    JSON's escaped surrogate pairs: 1.5 MiB). api_key, allow_origins and allow_hosts are
    not settings: their flags (cli.py) also read $STARPU_LLM_API_KEY and repeat."""
    api_key: str | None = None
    allow_origins: tuple = ()
    allow_hosts: tuple = ()
    header_timeout: float = setting(30.0, "seconds a connection has to send a whole request "
                                    "head (default %(default)g)", check="positive_number")
    body_timeout: float = setting(30.0, "seconds a request body may pause before HTTP 408, and "
                                  "a client may leave the answer unread before its connection "
                                  "is cut (default %(default)g)", check="positive_number")
    idle_timeout: float = setting(75.0, "seconds a kept-alive connection may idle between two "
                                  "requests (default %(default)g: above a load balancer's or "
                                  "proxy's 60)", check="positive_number")
    max_connections: int = setting(512, "connections open at once (default %(default)s); one "
                                   "more closes the one idle the longest, or with none idle is "
                                   "answered 503", check="positive")
    max_body: int = setting(16, "the largest request body, in MiB; a larger one is refused "
                            "with HTTP 413 as it arrives (default %(default)s)",
                            check="positive", metavar="MIB")

    def __post_init__(self):
        """Made from Python (run_serve's edges, a test's server), each field holds what its
        flag would take: else one StarpuLLMError naming the field."""
        check_fields(self)
        if self.api_key is not None:
            check_api_key(self.api_key, opt("api_key"))
        if not isinstance(self.allow_origins, (tuple, list)) or not all(
                isinstance(o, str) and o for o in self.allow_origins):
            raise StarpuLLMError(f"{opt('allow_origins')} expects a tuple of origins "
                                 f"(https://host[:port], or *), got {self.allow_origins!r}")
        if not isinstance(self.allow_hosts, (tuple, list)) or not all(
                isinstance(h, str) and h for h in self.allow_hosts):
            raise StarpuLLMError(f"{opt('allow_hosts')} expects a tuple of host names (or *), "
                                 f"got {self.allow_hosts!r}")
