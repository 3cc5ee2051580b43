"""Stopping a run on a signal without losing it: SIGINT (Ctrl-C), SIGTERM (what Slurm's scancel
and time limit, `timeout`, `kill`, container and systemd stops send), SIGUSR1 (what mpirun
forwards to every rank, and what Slurm's --signal sends ahead of a time limit) and SIGHUP (a
terminal closed, an SSH session that drops).

A closed stdout or stderr (`starpu-llm train ... | head`, a terminal closed, `tee` killed) is a
stop like them (guarded_output): the run stops after the step under way and saves; what goes to
that stream from then on is dropped; the exit status is 141, 128 + SIGPIPE, what a shell
reports for a process that a closed pipe ends. Output that cannot be written never ends a run
by itself.

While a run trains, the first of them asks it to stop after the step under way, as after its
last step: the run saves (--save, a checkpoint with --save-every), flushes its metrics, shuts
StarPU down, removes its offload folder, then raises Interrupted (exit status 128 + the
signal's number from the CLI: 130, 143, 138). A second signal ends the process at once, also in
the middle of a step: a watcher thread sees it even while the main thread waits inside StarPU
(Python runs its own handlers only between two bytecodes of the main thread), removes the
offload folders and exits without saving. Before the training loop (start-up) the first signal
interrupts at once: there is nothing to save yet. The starpu-llm command handles them from
Python's site on (tools/00-starpu-llm-start.pth, installed beside the package: the console script's
imports and an editable install's rebuild come after it), then from the first line of its
package (at_start_up, called by starpu_llm/__init__.py); before site only the interpreter's own
initialisation runs (a few ms).

Under mpirun, every rank stops after the same step (stop() agrees across the ranks), so a
signal that reaches one rank stops the job. mpirun itself kills its ranks one second after it
gets SIGINT or SIGTERM (Open MPI's odls_base_sigkill_timeout): send SIGUSR1 to mpirun, which
forwards it, or SIGTERM to the ranks themselves (srun does), for a stop that saves.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)
# a closed stdout or stderr stops a run as a signal would, with this one's status (141)
OUTPUT_CLOSED = signal.SIGPIPE

# Folders removed when a second signal ends the process at once (atexit does not run then):
# the offload folders of a memory limit (runtime/offload.py).
_remove_at_once: set = set()


def remove_if_killed(path: str) -> None:
    _remove_at_once.add(path)


def forget(path: str) -> None:
    _remove_at_once.discard(path)


def name(signum: int) -> str:
    """How a signal is named to the user: Ctrl-C for SIGINT; OUTPUT_CLOSED, a closed output."""
    if signum == OUTPUT_CLOSED:
        return "a closed output"
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


def ended(signum: int) -> str:
    """The one line that says why the command ended."""
    return "interrupted" if signum == signal.SIGINT else f"stopped by {name(signum)}"


def at_start_up() -> None:
    """In the starpu-llm command (its console script, or python -m starpu_llm), from the
    package's first line: a stop signal ends the process at once, with one line and 128 + its
    number (nothing is written yet); main() then installs StopOnSignal. Elsewhere (a program
    that imports starpu_llm) nothing changes."""
    argv0 = sys.argv[0] if sys.argv else ""
    # while -m locates the package, sys.argv[0] is "-m"; the module is in sys.orig_argv
    command = (os.path.basename(argv0) == "starpu-llm"
               or (argv0 == "-m" and "starpu_llm" in getattr(sys, "orig_argv", ())))
    if command and threading.current_thread() is threading.main_thread():
        for s in STOP_SIGNALS:
            signal.signal(s, _at_once)
        for fd in (0, 1, 2):   # closed (`>&-`): /dev/null there, or the next file opened
            try:               # would take its number and receive what StarPU prints
                os.fstat(fd)
            except OSError:
                null = os.open(os.devnull, os.O_RDWR)
                if null != fd:
                    os.dup2(null, fd)
                    os.close(null)


def _at_once(signum, frame):
    try:
        sys.stdout.flush()
    except Exception:            # a reentrant flush (the signal landed in one): lost
        pass
    say(ended(signum))
    os._exit(128 + signum)


class Interrupted(KeyboardInterrupt):
    """The run stopped on a signal (after saving, when it had started training); `signum`
    says which, `result` holds what train() would have returned for the steps done (its
    losses and state: from Python nothing trained is lost without --save), None when it
    stopped before training. A KeyboardInterrupt, as Ctrl-C has always raised."""

    def __init__(self, signum: int, result=None):
        super().__init__(signum)
        self.signum = signum
        self.result = result

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


class StopOnSignal:
    """The handlers of STOP_SIGNALS, installed between __enter__ and __exit__ (from the main
    thread; elsewhere nothing changes: Python runs handlers in the main thread only).
    `signum`: the first signal received (None: none). Inside deferred(), a signal only sets it;
    outside, it also raises Interrupted at once."""

    def __init__(self):
        self.signum = None
        self._count = 0
        self._deferred = 0
        self._saves = True      # whether a stop inside deferred() writes something
        self._announce = True   # whether this process announces a stop (deferred)
        self._first_seen = threading.Event()   # the watcher has taken the first signal
        self._here = False      # a signal reached this process (not only another rank)
        self._told = False      # the stop is announced already (another rank's signal)
        self._installed = False

    # --- installing and removing
    def __enter__(self):
        if threading.current_thread() is not threading.main_thread():
            return self
        self._read, write = os.pipe()
        os.set_blocking(write, False)
        self._write = write
        threading.Thread(target=self._watch, name="starpu-llm signals", daemon=True).start()
        self._install()
        return self

    def __exit__(self, *exc):
        if not self._installed:
            return
        self._uninstall()
        os.close(self._write)           # the watcher reads the end of the pipe and returns

    def _install(self):
        self._previous_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._previous_hook, sys.unraisablehook = sys.unraisablehook, self._unraisable
        self._installed = True
        # last: from here a signal may raise Interrupted, out of this very call too
        self._previous = {}
        for s in STOP_SIGNALS:
            self._previous[s] = signal.signal(s, self._handler)

    def _uninstall(self):
        for s, h in self._previous.items():
            # None: a handler not set from Python; Python's default then
            signal.signal(s, h if h is not None else (signal.default_int_handler
                                                      if s == signal.SIGINT else signal.SIG_DFL))
        signal.set_wakeup_fd(self._previous_fd)
        sys.unraisablehook = self._previous_hook
        self._installed = False

    @contextlib.contextmanager
    def suspended(self):
        """The handlers and wakeup fd as they were before, inside the block: for a command
        that handles the signals itself (serve: uvicorn's handlers drain the requests)."""
        if not self._installed:
            yield self
            return
        self._uninstall()
        try:
            yield self
        finally:
            self._install()

    # --- what a signal does
    def _handler(self, signum, frame):
        # the watcher counts; here, only whether to interrupt the main thread now
        self._here = True
        if self.signum is None:
            self.signum = signum
        if not self._deferred:
            raise Interrupted(signum)

    def _unraisable(self, info):
        """An Interrupted raised where Python can only print it and go on (a callback, a
        __del__): the process ends at once, as _at_once does, rather than a traceback."""
        if isinstance(info.exc_value, Interrupted):
            try:
                sys.stdout.flush()
            except Exception:        # a reentrant flush: what is buffered is lost
                pass
            say(ended(info.exc_value.signum))
            os._exit(info.exc_value.exit_status)
        self._previous_hook(info)

    def output_closed(self, which: str) -> None:
        """stdout or stderr (`which`) cannot be written any more: a stop as by a signal (in
        the main thread, before the training loop, at once)."""
        if self.signum is not None or not self._installed:
            return           # (suspended: the command that handles signals itself goes on)
        self.signum = OUTPUT_CLOSED
        if self._deferred:
            say(f"{which} closed: stopping after the step under way{self._then()}")
        elif threading.current_thread() is threading.main_thread():
            raise Interrupted(OUTPUT_CLOSED)

    def _watch(self):
        """Sees each signal as it arrives (Python writes its number to the wakeup pipe from
        the C-level handler): the first is announced, the second ends the process now."""
        try:
            while True:
                data = os.read(self._read, 64)
                if not data:
                    return
                for signum in data:
                    if signum in STOP_SIGNALS:
                        self._received(signum)
        finally:
            os.close(self._read)

    def _received(self, signum: int) -> None:
        self._count += 1
        if self.signum is None:
            self.signum = signum
        if self._count == 1:
            try:
                if self._deferred and self._announce and not self._told:
                    say(f"{name(signum)}: stopping after the step under way{self._then()} (send "
                        f"it again to stop at once{', without saving' if self._saves else ''})")
            finally:
                self._first_seen.set()
            return
        say(f"{name(signum)} again: stopped at once{', without saving' if self._saves else ''}")
        if _remove_at_once:
            _remove_once_gone(sorted(_remove_at_once))
        os._exit(128 + signum)

    # --- for the training loop
    @contextlib.contextmanager
    def deferred(self, saves: bool = True, announce: bool = True):
        """Signals only ask to stop (stop() tells) while inside; saves: whether the stop
        writes the run's outputs (what the announcement says); announce: whether this
        process says so (under mpirun rank 0 alone: mpirun forwards a signal to every
        rank)."""
        self._deferred += 1
        outer, self._saves = (self._saves, self._announce), saves
        self._announce = announce
        try:
            yield self
        finally:
            self._deferred -= 1
            self._saves, self._announce = outer

    def _then(self) -> str:
        return (", then saving" if self._saves
                else " (nothing is saved: no --save or --save-every was given)")

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def announced(self, timeout: float = 1.0) -> None:
        """Wait (at most timeout seconds) until the watcher has said what a signal this
        process received does: a run that stops within a few ms (a small model's step) would
        otherwise print its last lines before the announcement of the stop."""
        if self._here and self._installed:
            self._first_seen.wait(timeout)

    def stop(self, comm) -> int | None:
        """The signal to stop on after this step (None: go on); under MPI every rank gets the
        same answer, after the same step: a signal that lands during the exchange stays
        requested and stops every rank after the next step."""
        if comm is None:
            agreed = self.signum
        else:
            signums = comm.allgather(self.signum)
            agreed = next((s for s in signums if s is not None), None)
            if self.signum is None and agreed is not None:
                # only other ranks got it (`kill` of one rank, a node's OOM killer): the
                # ranks that announce say which, once
                self.signum, self._told = agreed, True
                if self._announce:
                    ranks = [r for r, s in enumerate(signums) if s is not None]
                    say(f"{name(agreed)} on rank{'s' if len(ranks) > 1 else ''} "
                        f"{', '.join(map(str, ranks))}: stopping{self._then()}")
        if agreed is not None:
            self.announced()        # said before the lines that end the run
        return agreed


_current: StopOnSignal | None = None


@contextlib.contextmanager
def stop_on_signal():
    """The StopOnSignal in force (the CLI's), else a new one installed for the block."""
    global _current
    if _current is not None:
        yield _current
        return
    with StopOnSignal() as s:
        _current = s
        try:
            yield s
        finally:
            _current = None


@contextlib.contextmanager
def suspended():
    """The CLI's StopOnSignal (if any) out of the way inside the block (StopOnSignal.suspended)."""
    if _current is None:
        yield None
        return
    with _current.suspended() as s:
        yield s


def _remove_once_gone(paths: list) -> None:
    """Remove paths once this process has ended: StarPU's threads may still write there until
    it does (removing them first makes StarPU abort). A child process waits for the end of a
    pipe that only this process holds open, then removes them (it holds this process's output
    open until it is done)."""
    try:
        read, write = os.pipe()
        if os.fork() == 0:     # the child: only system calls, then exec (other threads here)
            os.close(write)
            os.dup2(read, 0)
            os.execvp("sh", ["sh", "-c", 'cat >/dev/null; rm -rf -- "$@"', "sh", *paths])
        os.close(read)         # `write` stays open until this process ends
    except OSError:
        pass


class _Guarded:
    """sys.stdout or sys.stderr (`which`), whose write errors (a closed pipe, a terminal gone)
    stop the run instead of raising: the stream's file descriptor then points to /dev/null, so
    that what follows (Python's last flush, StarPU's messages) goes nowhere without an error."""

    def __init__(self, stream, which: str):
        self._stream, self._which = stream, which
        self.lost = False

    def write(self, text):
        try:
            return self._stream.write(text)
        except OSError:
            self._lose()
            return len(text)

    def flush(self):
        try:
            self._stream.flush()
        except OSError:
            self._lose()

    def __getattr__(self, attr):
        return getattr(self._stream, attr)

    def _lose(self):
        first = not self.lost
        self.lost = True
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self._stream.fileno())
            os.close(null)
            self._stream.flush()        # what was buffered goes to /dev/null
        except (OSError, ValueError):
            pass
        if first and _current is not None:
            _current.output_closed(self._which)


_guards: dict = {}       # "stdout"/"stderr": its _Guarded, inside guarded_output


@contextlib.contextmanager
def guarded_output():
    """sys.stdout and sys.stderr guarded (_Guarded) inside the block; flushed at its end. A
    stream closed when Python started (sys.stdout None) is /dev/null inside it, so that what
    writes to it or flushes it (not only print()) goes nowhere without an error."""
    saved = sys.stdout, sys.stderr
    sinks = []
    for which in ("stdout", "stderr"):
        stream = getattr(sys, which)
        if stream is None:
            stream = open(os.devnull, "w")
            sinks.append(stream)
        _guards[which] = _Guarded(stream, which)
        setattr(sys, which, _guards[which])
    try:
        yield
    finally:
        for which in ("stdout", "stderr"):
            if which in _guards:
                _guards.pop(which).flush()
        sys.stdout, sys.stderr = saved
        for sink in sinks:
            sink.close()


def say(text: str) -> None:
    """`starpu-llm: text` on stderr, or on stdout when stderr was closed (one that works)."""
    lost = "stderr" in _guards and _guards["stderr"].lost
    try:
        if lost:
            sys.stdout.flush()
        os.write(1 if lost else 2, f"starpu-llm: {text}\n".encode())
    except (OSError, ValueError, AttributeError):
        pass
