"""The serving engine: one thread that owns StarPU and the model and runs continuous batching.

The model is loaded once, in the engine thread: StarPU started, the parameters registered as
handles, the key/value cache of max_batch slots and the step buffers created
(flow/batch.SlotDecoder). Every request after that is only rows of decode steps.

Requests come from any thread (the HTTP server's event loop) through submit(), which never
waits for the engine: it puts them in a bounded queue or refuses them at once (QueueFull,
with a retry time; ShuttingDown while the server stops). The engine thread loops:

  1. requests cancelled since the last step (a client gone) leave, freeing their slots;
  2. waiting requests take the free slots, in arrival order (continuous batching: a request
     joins the running batch between two steps, never waiting for the batch to finish);
  3. one decode step carries every running sequence's last token, and the prompt rows of
     new sequences (up to `rows` rows a step and group, several prompts side by side, a long
     prompt over several steps);
  4. while the step's tasks run, the tokens drawn after the last step become text (whole
     UTF-8 characters, stop strings held back until they can no longer match) handed to
     their requests' callbacks, which must not block (the HTTP side puts it on its event
     loop); a sequence that meets a stop string leaves and frees its slot (its row in the
     step under way is computed and not used);
  5. the sequences whose step gave logits draw their next tokens together, each with its
     own sampling settings and generator (serve/scoring.choose_batch: the request's bias and
     penalties, then flow/generate.sample_batch for the whole batch at once; a sequence
     still in a prompt it scores gets the log-probability of its next prompt token
     instead); a sequence that reaches its max tokens or <|endoftext|> sends its last text
     and leaves at once; the others' tokens are the next step's rows, their text waits for
     step 4 of the next round.

Faults stay with their request: an exception while one sequence's next token is drawn (NaN
logits with temperature > 0 make the draw raise) ends that request with an error (HTTP 500)
and the batch goes on; an exception anywhere else in the loop (a decode step) ends every
request with an error (HTTP 503) and the thread: the engine is failed, and the server exits
with a non-zero status for its supervisor to restart it (cli_serve.py).

A step that never ends (a StarPU task stuck, a deadlock) fails nothing: stalled() says when the
engine has had work pending and completed no step for longer than stall_timeout, for the
health check to answer 503 (a load balancer then routes elsewhere) and submit() to refuse new
requests at once instead of queueing them behind it.

With nothing to do, the thread sleeps on a condition, StarPU paused (its idle workers would
otherwise spin). drain() stops accepting and lets the accepted requests finish until a
deadline, then cancels what is left; the thread then releases the model and shuts StarPU
down.
"""
from __future__ import annotations

import collections
import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np

from ..flow.batch import DEFAULT_ROWS, Feed, SlotDecoder
from ..io.tokenizer import StreamDecoder
from ..plan.settings import check_fields
from . import scoring
from .settings import Serving

# a step's logits for this many rows of scored prompts (echo with logprobs) a group, beside
# one a slot: a scored prompt goes in this many tokens a step (GPT-2: 13 MB of logits)
SCORED_ROWS = 64

class QueueFull(Exception):
    """The queue cannot take the request: retry after retry_after seconds."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


class ShuttingDown(Exception):
    """The engine stops (or has stopped, or failed, or is stalled): it takes no new request."""


class Stall(NamedTuple):
    """An engine stalled (Engine.stalled): for how many seconds no step has completed, work
    pending, and a sentence saying so."""
    seconds: float
    why: str


@dataclass(frozen=True)
class Sampling:
    """How one sequence is continued: at most max_tokens new tokens, drawn as
    flow/generate.sample does (temperature 0 or top_k 1: greedy), ended early by a stop
    string (not included in the text) or by <|endoftext|> unless ignore_eos. Scoring
    (serve/scoring.py): logprobs, the most likely tokens listed beside each token's
    log-probability (None: no log-probabilities); prompt_logprobs: the prompt's tokens scored
    too (up to SCORED_ROWS of them a step); logit_bias ((token, bias), ...) and the penalties
    change the logits a token is drawn from. max_tokens 0: the prompt scored, nothing
    generated."""
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    stop: tuple = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: bool = False
    logit_bias: tuple = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0


class Event(NamedTuple):
    """What a request hears from the engine: text (possibly empty); at the end, finish
    ("stop", "length", or "cancelled") or error (a message), and the usage. logprobs: the
    scoring.Logprob of the tokens scored since the last event (the prompt's, from its second
    token, then the generated ones), when the request asks for them."""
    text: str = ""
    finish: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # with error, the HTTP status: 500 a fault of this request alone, 503 of the engine
    status: int = 503
    logprobs: tuple = ()


class _Tally:
    """The sequences that one HTTP request submitted together: the request is counted once
    in the metrics, when its last sequence ends, under the worst of their outcomes."""
    ORDER = ("stop", "length", "cancelled", "error")

    def __init__(self, left: int, submitted: float):
        self.left, self.submitted = left, submitted
        self.outcome, self.first_token = "stop", False


class Request:
    """One sequence to generate: prompt (token ids), its Sampling, its random generator (a
    numpy Generator; greedy draws use none) and on_event(Event), called from the engine
    thread for each piece of text and once at the end (it must not block)."""

    def __init__(self, prompt, sampling: Sampling, on_event: Callable[[Event], None], rng=None):
        self.prompt = [int(t) for t in prompt]
        self.sampling, self.on_event = sampling, on_event
        self.rng = rng if rng is not None else np.random.default_rng()
        self.cancelled = False
        self.submitted = self.first_token = self.finished = None     # time.monotonic()
        self.tokens: list[int] = []
        self.engine = self.tally = None         # set by Engine.submit

    def cancel(self):
        """The client is gone: a request still waiting leaves the queue at once (its room is
        free for the next request); a running one leaves before the next step (its slot)."""
        self.cancelled = True
        if self.engine is not None:
            self.engine._withdraw(self)


class Loaded(NamedTuple):
    """A model ready to serve, made in the engine thread by the engine's `load` callable: its
    backend (flow/generate), the slot groups (one per StarPU worker of one core), a context
    manager that pauses StarPU while the engine is idle, a function releasing everything (the
    backend's handles, StarPU), a line describing it, and the cores the model runs on (the
    draw of a step's tokens takes as many threads; 0: this process's)."""
    backend: object
    groups: int
    paused: Callable
    close: Callable
    describe: str
    cores: int = 0


class _Text:
    """A sequence's text as its tokens come: whole UTF-8 characters (a token may end inside
    one), the stop strings looked for; pieces are released once no stop string can still
    start in them."""

    def __init__(self, tokenizer, stop):
        self.stop = tuple(stop)
        self.longest = max((len(s) for s in self.stop), default=0)
        self.stream = StreamDecoder(tokenizer, self._append)
        self.text, self.sent = "", 0

    def _append(self, text: str):
        self.text += text

    def add(self, token: int | None, final: bool = False) -> tuple[str, bool]:
        """The new text to send after token (None: nothing more) and whether a stop string
        ended the sequence (the text then stops before it)."""
        if token is not None:
            self.stream(token)
        if final:
            self.stream.close()
        if not self.stop:
            return self._release(len(self.text)), False
        start = max(0, self.sent - self.longest + 1)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            return self._release(min(hits)), True
        if final:
            return self._release(len(self.text)), False
        hold = 0          # the longest end of the text that a stop string starts with
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text) - self.sent), hold, -1):
                if self.text.endswith(s[:k]):
                    hold = k
                    break
        return self._release(len(self.text) - hold), False

    def _release(self, end: int) -> str:
        piece, self.sent = self.text[self.sent:end], max(self.sent, end)
        return piece


class _Sequence:
    """A request in a slot: the tokens still to feed and the position of the first."""

    def __init__(self, req: Request, slot: int, text: _Text):
        self.req, self.slot, self.text = req, slot, text
        self.pending, self.pos = list(req.prompt), 0
        sp = req.sampling
        if sp.max_tokens == 0:      # scoring only: the last prompt token is never fed
            self.pending = self.pending[:-1] if sp.prompt_logprobs else []


class Engine:
    """Continuous batching of generation requests in a thread of its own (see the module
    docstring). load() -> Loaded runs in that thread. max_batch sequences at once (the
    slots), up to max_queue more waiting; rows: the new tokens of one step (per group);
    cache_len: the positions a slot holds (default the model's maxT). tokenizer: the text of
    the tokens (io/tokenizer.Tokenizer); eot: the end-of-text token. metrics: an object with
    the serve/metrics.Metrics methods, or None. stall_timeout: the seconds without a step
    completed, work pending, after which the engine is stalled (0: never); clock: the
    monotonic clock those seconds are read on."""

    def __init__(self, load: Callable[[], Loaded], config, tokenizer, eot: int | None,
                 max_batch: int = Serving.max_batch, max_queue: int = Serving.max_queue,
                 rows: int = DEFAULT_ROWS,
                 cache_len: int | None = None, metrics=None, stall_timeout: float = 0.0,
                 clock: Callable[[], float] = time.monotonic):
        check_fields(Serving(max_batch=max_batch, max_queue=max_queue))
        self.config, self.tokenizer, self.eot = config, tokenizer, eot
        self.max_batch, self.max_queue = max_batch, max_queue
        self.rows = max(rows, max_batch)      # every running sequence gets its row
        self.cache_len = cache_len or config.maxT
        self.metrics = metrics
        self._load = load
        self._cond = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self._free = max_batch          # slots not taken (under _cond)
        self._running: dict[int, _Sequence] = {}      # slot -> sequence (engine thread)
        # (sequence, token, its scores): drawn, their text not sent yet (engine thread)
        self._unsent: list = []
        self._draining = False
        self._deadline = None
        self._failed: str | None = None
        # why unloading the model (Loaded.close: StarPU's shutdown) failed, once the thread ends
        self.close_error: str | None = None
        self._request_s = 1.0           # a running mean of request durations (retry times)
        self.stall_timeout, self._clock = stall_timeout, clock
        # the end of the last step, or when work came to an idle engine (clock's time)
        self._progress = clock()
        if metrics:
            metrics.watch_progress(self.since_step)
        self.describe = ""
        self._cores = None              # the loaded model's (engine thread)
        self._paused = contextlib.nullcontext     # Loaded.paused, once loaded
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="starpu-llm-engine", daemon=True)

    # ---- any thread

    def start(self, timeout: float | None = None):
        """Start the thread and wait until the model is loaded; a loading error is raised here."""
        self._thread.start()
        self._ready.wait(timeout)
        if self._load_error is not None:
            self._thread.join()
            raise self._load_error

    def state(self) -> str:
        """"ok", "draining" or "failed: why" or "stopped"."""
        if self._failed:
            return f"failed: {self._failed}"
        if not self._thread.is_alive():
            return "stopped"
        return "draining" if self._draining else "ok"

    def submit(self, requests: list[Request]):
        """Queue the requests (all or none); raises QueueFull or ShuttingDown at once."""
        now = time.monotonic()
        with self._cond:
            if self._draining or self._failed or not self._thread.is_alive():
                if self.metrics:
                    self.metrics.rejected()
                raise ShuttingDown(f"the server is {self.state()}: it takes no new request")
            stall = self.stalled()
            if stall is not None:
                if self.metrics:
                    self.metrics.rejected()
                raise ShuttingDown(f"the server is stalled: {stall.why}; it takes no new "
                                   f"request until a step completes")
            if self.idle():            # idle until now: no step was due
                self._progress = self._clock()
            room = self.max_queue + self._free - len(self._queue)
            if len(requests) > room:
                wait = self.retry_after()
                if self.metrics:
                    self.metrics.rejected()
                raise QueueFull(f"the server is busy: {self.max_batch - self._free} sequences "
                                f"running and {len(self._queue)} waiting (at most "
                                f"{self.max_batch} + {self.max_queue}); retry in {wait} s",
                                wait)
            tally = _Tally(len(requests), now)
            for r in requests:
                r.submitted, r.engine, r.tally = now, self, tally
                self._queue.append(r)
            self._cond.notify()
        if self.metrics:
            self.metrics.queue_length(self.waiting())

    def waiting(self) -> int:
        """Requests that wait for a slot."""
        return max(0, len(self._queue) - self._free)

    def running(self) -> int:
        return self.max_batch - self._free

    def idle(self) -> bool:
        """No request running or waiting."""
        return not self._queue and self.running() == 0

    def since_step(self) -> float:
        """Seconds since the last decode step completed (or since work came to an idle
        engine) while work is pending; 0 when the engine is idle."""
        if self.idle():
            return 0.0
        return self._clock() - self._progress

    def stalled(self) -> Stall | None:
        """The stall when the engine has had work pending and completed no step for more than
        stall_timeout seconds; None when it has not (an idle engine never has)."""
        quiet = self.since_step()
        if not self.stall_timeout or quiet <= self.stall_timeout:
            return None
        return Stall(quiet, f"no decode step has completed for {quiet:.0f} s with "
                            f"{self.running()} sequences running and {self.waiting()} waiting "
                            f"(--stall-timeout {self.stall_timeout:g}): a StarPU task or the "
                            f"engine thread is stuck")

    def retry_after(self) -> int:
        """Whole seconds after which a slot has likely freed: the requests ahead, a batch at
        a time, each lasting the recent mean."""
        ahead = len(self._queue) + self.running()
        return int(min(60, max(1, np.ceil(self._request_s * (ahead / self.max_batch)))))

    def drain(self, timeout: float):
        """Take no new request; let the accepted ones finish for at most timeout seconds, then
        cancel the rest; the thread then stops (StarPU shut down)."""
        deadline = time.monotonic() + max(0.0, timeout)
        with self._cond:
            self._draining = True       # a second call can only bring the deadline closer
            self._deadline = deadline if self._deadline is None else min(self._deadline, deadline)
            self._cond.notify()

    def close(self, timeout: float = 10.0, join: float | None = None) -> bool:
        """drain(timeout), then wait for the thread (at most join seconds, default: the
        deadline plus a minute for a step under way); True when it stopped."""
        self.drain(timeout)
        self._thread.join(timeout + 60 if join is None else join)
        return not self._thread.is_alive()

    # ---- the engine thread

    def _main(self):
        loaded = None
        try:
            loaded = self._load()
            self.describe, self._cores, self._paused = (loaded.describe, loaded.cores or None,
                                                        loaded.paused)
            self.decoder = SlotDecoder(loaded.backend, self.max_batch, self.rows,
                                       self.cache_len, loaded.groups, extra_heads=SCORED_ROWS)
            self.decoder.place_caches()     # the first requests do not pay for the pages
        except BaseException as e:          # noqa: BLE001 (re-raised by start())
            self._load_error = e
            if loaded is not None:
                loaded.close()
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop()
        except BaseException as e:         # noqa: BLE001 (every request hears it)
            self._failed = f"{type(e).__name__}: {e}"
            self._end_all(error=f"the engine failed: {self._failed}")
        finally:
            try:
                loaded.close()
            except Exception as e:      # noqa: BLE001 (the answers are sent: said, not raised)
                self.close_error = f"unloading the model failed: {type(e).__name__}: {e}"

    def _loop(self):
        while True:
            with self._cond:
                idle = not self._queue and not self._running
                if idle and self._draining:
                    return
            if idle:
                if self.metrics:
                    self.metrics.idle()
                with self._paused():
                    with self._cond:
                        self._cond.wait_for(lambda: self._queue or self._draining)
                continue
            if self._draining and time.monotonic() >= self._deadline:
                self._end_all(error="the server is shutting down: the request was cancelled "
                                    "(its time to finish ran out)")
                continue
            self._leave_cancelled()
            self._admit()
            if self._running:
                self._step()

    def _end(self, seq: _Sequence, finish: str | None = None, error: str | None = None,
             status: int = 503):
        """seq leaves: its slot is freed, its request hears the end."""
        req = seq.req
        req.finished = time.monotonic()
        del self._running[seq.slot]
        with self._cond:
            self._free += 1
        self._request_s += 0.2 * (req.finished - req.submitted - self._request_s)
        self._emit(req, Event("", finish, error, len(req.prompt), len(req.tokens), status))
        self._count(req, finish or "error")

    def _end_all(self, error: str):
        for seq in list(self._running.values()):
            self._end(seq, error=error)
        with self._cond:
            queued, self._queue = list(self._queue), collections.deque()
        for req in queued:
            self._emit(req, Event("", None, error, len(req.prompt), 0))
            self._count(req, "error")

    def _withdraw(self, req: Request):
        """A cancelled request still in the queue leaves it now (any thread)."""
        with self._cond:
            try:
                self._queue.remove(req)
            except ValueError:
                return            # running (it leaves before the next step) or ended
        self._emit(req, Event("", "cancelled", None, len(req.prompt), 0))
        self._count(req, "cancelled")
        if self.metrics:
            self.metrics.queue_length(self.waiting())

    def _count(self, req: Request, outcome: str):
        """req has ended: its HTTP request is counted once its last sequence has."""
        t = req.tally
        with self._cond:
            t.left -= 1
            t.outcome = max(t.outcome, outcome, key=_Tally.ORDER.index)
            done = t.left == 0
        if done and self.metrics:
            self.metrics.finished(t.outcome, time.monotonic() - t.submitted)

    def _emit(self, req: Request, event: Event):
        try:
            req.on_event(event)
        except Exception:                  # noqa: BLE001 (a listener gone: drop the request)
            req.cancelled = True

    def _leave_cancelled(self):
        for seq in [s for s in self._running.values() if s.req.cancelled]:
            self._end(seq, finish="cancelled")

    def _admit(self):
        free = [s for s in range(self.max_batch) if s not in self._running]
        groups = self.decoder.group_of
        while free:
            with self._cond:
                if not self._queue:
                    break
                req = self._queue.popleft()
                cancelled = req.cancelled       # read once: a client may cancel right now
                if not cancelled:
                    self._free -= 1
            if cancelled:              # cancelled as it left the queue: it ends here
                self._emit(req, Event("", "cancelled", None, len(req.prompt), 0))
                self._count(req, "cancelled")
                continue
            # the slot of the least busy group (groups run side by side)
            load = collections.Counter(groups(s) for s in self._running)
            slot = min(free, key=lambda s: (load[groups(s)], s))
            free.remove(slot)
            self._running[slot] = _Sequence(req, slot, _Text(self.tokenizer, req.sampling.stop))
            if not self._running[slot].pending:         # nothing to compute (max_tokens 0)
                self._end(self._running[slot], "length")
        if self.metrics:
            self.metrics.queue_length(self.waiting())

    def _step(self):
        # every running sequence's next token first, then prompt rows while the group has room
        budget = collections.Counter()
        extra = collections.Counter()       # head rows taken beyond one a sequence
        feeds = []
        decoding = [s for s in self._running.values() if s.req.tokens]
        prefilling = sorted((s for s in self._running.values() if not s.req.tokens),
                            key=lambda s: s.req.submitted)
        for seq in decoding + prefilling:
            g = self.decoder.group_of(seq.slot)
            n = min(len(seq.pending), self.rows - budget[g])
            scored = seq.req.sampling.prompt_logprobs and not seq.req.tokens
            if scored:      # the logits after every prompt token: a head row each
                spare = self.decoder.head_rows(g) - self.decoder.groups[g].n - extra[g]
                n = min(n, 1 + spare)
                extra[g] += max(0, n - 1)
            if n < 1:
                continue
            budget[g] += n
            feeds.append(Feed(seq.slot, seq.pos, seq.pending[:n],
                              n if scored else n == len(seq.pending)))
        fed_seqs = [self._running[f.slot] for f in feeds]
        t0 = time.monotonic()
        submitted = self.decoder.submit(feeds)
        self._send_drawn()          # Python's share of the last tokens while the tasks run
        logits = self.decoder.collect(submitted)
        now = time.monotonic()
        new_tokens = 0
        rows = iter(logits)
        wanted = []         # (sequence, the tokens fed up to its logits row, the row)
        for f, seq in zip(feeds, fed_seqs):
            seq.pos += len(f.tokens)
            seq.pending = seq.pending[len(f.tokens):]
            w = int(f.logits)
            wanted += [(seq, seq.pos - w + j + 1, next(rows)) for j in range(w)]
        # a sequence that ended while the step ran (a stop string) has a row no one uses
        wanted = [w for w in wanted if self._running.get(w[0].slot) is w[0]]
        # the next token of every sequence past its prompt, drawn for the whole batch at once
        drawing = [k for k, (seq, fed, _) in enumerate(wanted) if fed >= len(seq.req.prompt)]
        reqs = [wanted[k][0].req for k in drawing]
        chosen = {}
        if drawing:
            # StarPU paused (no task is under way): its idle workers would spin on the cores
            # the draw's threads take (16 rows: 7.4 ms paused, 12.8 ms not, on 2 cores)
            with self._paused():
                chosen = dict(zip(drawing, scoring.choose_batch(
                    logits if len(drawing) == len(logits) else logits[drawing],
                    [(r.sampling, r.tokens, r.rng) for r in reqs], self._cores)))
        for k, (seq, fed, row) in enumerate(wanted):
            if k in chosen:
                new_tokens += 1
                self._alone(seq, "drawing this request's next token", self._next_token, seq,
                            row, now, chosen[k])
            else:
                self._alone(seq, "scoring this request's prompt", self._score_prompt, seq, fed,
                            row)
        self._progress = self._clock()
        if self.metrics:
            self.metrics.step(len(feeds), sum(len(f.tokens) for f in feeds), new_tokens,
                              now - t0)

    def _next_token(self, seq: _Sequence, logits, now: float, chosen=None):
        """seq's next token: chosen, (token, its scoring.Logprob or None), drawn from logits
        by scoring.choose when not given (or None: logits not finite, and choose raises)."""
        req, sp = seq.req, seq.req.sampling
        token, scored = chosen or scoring.choose(logits, sp, req.tokens, req.rng)
        scored = (scored,) if scored else ()
        req.tokens.append(token)
        if req.first_token is None:
            req.first_token = now
            if self.metrics and not req.tally.first_token:     # its HTTP request's first
                req.tally.first_token = True
                self.metrics.first_token(now - req.submitted)
        if token == self.eot and not sp.ignore_eos:
            text, _ = seq.text.add(None, final=True)
            self._emit(req, Event(text, logprobs=scored))
            return self._end(seq, "stop")
        last = (len(req.tokens) == sp.max_tokens
                or len(req.prompt) + len(req.tokens) >= self.cache_len)
        if last:
            text, stopped = seq.text.add(token, final=True)
            if text or scored:
                self._emit(req, Event(text, logprobs=scored))
            return self._end(seq, "stop" if stopped else "length")
        seq.pending = [token]       # the next step's row; its text is sent while that step runs
        self._unsent.append((seq, token, scored))

    def _send_drawn(self):
        """The text of the tokens drawn after the last step (_next_token) to their requests; a
        sequence whose text meets a stop string ends. A failure here is its request's alone."""
        unsent, self._unsent = self._unsent, []
        for seq, token, scored in unsent:
            if self._running.get(seq.slot) is not seq:      # ended since (cancelled, drained)
                continue
            self._alone(seq, "sending this request's text", self._send_text, seq, token, scored)

    def _send_text(self, seq: _Sequence, token: int, scored):
        text, stopped = seq.text.add(token)
        if text or scored:
            self._emit(seq.req, Event(text, logprobs=scored))
        if stopped:
            self._end(seq, "stop")

    def _alone(self, seq: _Sequence, what: str, work, *args):
        """work(*args) for seq: an error there is this request's fault, so it alone ends (a 500
        saying what failed) and the batch goes on."""
        try:
            work(*args)
        except Exception as e:      # noqa: BLE001
            if self._running.get(seq.slot) is seq:
                self._end(seq, error=f"{what} failed: {type(e).__name__}: {e}", status=500)

    def _score_prompt(self, seq: _Sequence, fed: int, logits):
        """Prompt token `fed` scored by the logits after the tokens before it; a request that
        only scores (max_tokens 0) ends with its last prompt token."""
        req = seq.req
        self._emit(req, Event(logprobs=(scoring.score(logits, req.prompt[fed],
                                                      req.sampling.logprobs or 0),)))
        if req.sampling.max_tokens == 0 and fed == len(req.prompt) - 1:
            self._end(seq, "length")
