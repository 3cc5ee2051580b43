"""Stopping a run on a signal without losing it: SIGINT (Ctrl-C), SIGTERM (what Slurm's scancel
and time limit, `timeout`, `kill`, container and systemd stops send) and SIGUSR1 (what mpirun
forwards to every rank, and what Slurm's --signal sends ahead of a time limit).

While a run trains, the first of them asks it to stop after the step under way, as after its
last step: the run saves (--save, a checkpoint with --save-every), flushes its metrics, shuts
StarPU down, removes its offload folder, then raises Interrupted (exit status 128 + the
signal's number from the CLI: 130, 143, 138). A second signal ends the process at once, also in
the middle of a step: a watcher thread sees it even while the main thread waits inside StarPU
(Python runs its own handlers only between two bytecodes of the main thread), removes the
offload folders and exits without saving. Before the training loop (start-up) the first signal
interrupts at once: there is nothing to save yet.

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

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)

# Folders removed when a second signal ends the process at once (atexit does not run then):
# the offload folders of a memory limit (runtime/offload.py).
_remove_at_once: set = set()


def remove_if_killed(path: str) -> None:
    _remove_at_once.add(path)


def forget(path: str) -> None:
    _remove_at_once.discard(path)


def name(signum: int) -> str:
    """How a signal is named to the user: Ctrl-C for SIGINT."""
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


class Interrupted(KeyboardInterrupt):
    """The run stopped on a signal (after saving, when it had started training); `signum`
    says which. A KeyboardInterrupt, as Ctrl-C has always raised."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

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
        if self.signum is None:
            self.signum = signum
        if not self._deferred:
            raise Interrupted(signum)

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
            if self._deferred:
                _say(f"{name(signum)}: stopping after the step under way, then saving "
                     f"(send it again to stop at once, without saving)")
            return
        _say(f"{name(signum)} again: stopped at once, without saving")
        if _remove_at_once:
            _remove_once_gone(sorted(_remove_at_once))
        os._exit(128 + signum)

    # --- for the training loop
    @contextlib.contextmanager
    def deferred(self):
        """Signals only ask to stop (stop() tells) while inside."""
        self._deferred += 1
        try:
            yield self
        finally:
            self._deferred -= 1

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def stop(self, comm) -> int | None:
        """The signal to stop on after this step (None: go on); under MPI every rank gets the
        same answer, after the same step: a signal that lands during the exchange stays
        requested and stops every rank after the next step."""
        if comm is None:
            return self.signum
        agreed = next((s for s in comm.allgather(self.signum) if s is not None), None)
        if self.signum is None:
            self.signum = agreed
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


def _say(text: str) -> None:
    try:
        os.write(sys.stderr.fileno(), f"starpu-llm: {text}\n".encode())
    except (OSError, ValueError):
        pass
