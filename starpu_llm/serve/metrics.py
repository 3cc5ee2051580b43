"""The server's Prometheus metrics (GET /metrics), updated by the engine thread.

  starpu_llm_queue_length                  requests waiting for a slot
  starpu_llm_batch_size                    sequences in the last decode step
  starpu_llm_step_sequences                histogram of the same, over the steps
  starpu_llm_step_seconds                  histogram of a decode step's time
  starpu_llm_step_rows                     histogram of a step's rows (new tokens and prompt rows)
  starpu_llm_time_since_step_seconds       seconds since the last decode step completed while
      requests are pending (since the first of them came, after idling); 0 when idle: it
      climbs toward --stall-timeout when a step hangs
  starpu_llm_generated_tokens_total        tokens generated (rate(): tokens/s over any window)
  starpu_llm_tokens_per_second             tokens generated per second over the last 10 s
  starpu_llm_time_to_first_token_seconds   histogram: from a request's arrival to its first token
  starpu_llm_request_seconds               histogram: from a request's arrival to its end
  starpu_llm_requests_total{outcome}       HTTP requests to POST /v1/..., each counted once
      when it ends: stop, length (its choices' finish reasons: length if any), cancelled (the
      client left), error (HTTP 500/503 after it was accepted), rejected (HTTP 503 at once:
      queue full or stopping), invalid (HTTP 4xx: refused by the checks)

and prometheus-client's process_* metrics (memory, CPU, file descriptors, start time).
"""
from __future__ import annotations

import collections
import threading
import time

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector,
                               generate_latest)
from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE  # noqa: F401 (app.py)

WINDOW_S = 10.0       # the window of starpu_llm_tokens_per_second
_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120)


class Metrics:
    """The metrics of one server, in a registry of their own."""

    def __init__(self, max_batch: int):
        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)
        self._queue = Gauge("starpu_llm_queue_length", "Requests waiting for a slot", registry=r)
        self._batch = Gauge("starpu_llm_batch_size", "Sequences in the last decode step",
                            registry=r)
        sizes = sorted({1, 2, 4, 8, 16, 32, 64, 128, max_batch})
        self._step_seqs = Histogram("starpu_llm_step_sequences", "Sequences in a decode step",
                                    buckets=sizes, registry=r)
        self._step_s = Histogram("starpu_llm_step_seconds", "Time of a decode step",
                                 buckets=_SECONDS, registry=r)
        self._step_rows = Histogram("starpu_llm_step_rows", "Rows of a decode step (new tokens "
                                    "and prompt rows)", buckets=(1, 4, 16, 64, 256, 1024),
                                    registry=r)
        self._since_step = Gauge("starpu_llm_time_since_step_seconds",
                                 "Seconds since the last decode step completed while requests "
                                 "are pending; 0 when idle", registry=r)
        self._tokens = Counter("starpu_llm_generated_tokens", "Tokens generated", registry=r)
        self._tps = Gauge("starpu_llm_tokens_per_second",
                          f"Tokens generated per second over the last {WINDOW_S:g} s",
                          registry=r)
        self._tps.set_function(self.tokens_per_second)
        self._ttft = Histogram("starpu_llm_time_to_first_token_seconds",
                               "From a request's arrival to its first token",
                               buckets=_SECONDS, registry=r)
        self._latency = Histogram("starpu_llm_request_seconds",
                                  "From a request's arrival to its end", buckets=_SECONDS,
                                  registry=r)
        self._requests = Counter("starpu_llm_requests", "Requests ended, by outcome",
                                 ["outcome"], registry=r)
        self._recent = collections.deque()      # (time, tokens) of the steps in the window
        self._lock = threading.Lock()

    def queue_length(self, n: int):
        self._queue.set(n)

    def step(self, sequences: int, rows: int, new_tokens: int, seconds: float):
        self._batch.set(sequences)
        self._step_seqs.observe(sequences)
        self._step_rows.observe(rows)
        self._step_s.observe(seconds)
        self._tokens.inc(new_tokens)
        now = time.monotonic()
        with self._lock:
            self._recent.append((now, new_tokens))
            self._forget(now)

    def watch_progress(self, since_step):
        """since_step(): the engine's seconds without a completed step (Engine.since_step),
        read at each scrape."""
        self._since_step.set_function(since_step)

    def idle(self):
        """Nothing running, nothing waiting."""
        self._batch.set(0)
        self._queue.set(0)

    def tokens_per_second(self) -> float:
        now = time.monotonic()
        with self._lock:
            self._forget(now)
            return sum(n for _, n in self._recent) / WINDOW_S

    def _forget(self, now: float):
        """The steps older than the window leave (under _lock): the memory stays that of one
        window, whether /metrics is scraped or not."""
        while self._recent and self._recent[0][0] < now - WINDOW_S:
            self._recent.popleft()

    def first_token(self, seconds: float):
        self._ttft.observe(seconds)

    def finished(self, outcome: str, seconds: float):
        self._requests.labels(outcome).inc()
        self._latency.observe(seconds)

    def rejected(self):
        """An HTTP request refused at once (queue full or stopping), whatever its n."""
        self._requests.labels("rejected").inc()

    def outcome(self, name: str):
        """A request that ended before the engine had it (serve/middleware.py): "invalid"
        (HTTP 4xx) or "cancelled" (the client left mid-body)."""
        self._requests.labels(name).inc()

    def exposition(self) -> bytes:
        """The text format Prometheus scrapes."""
        return generate_latest(self.registry)
