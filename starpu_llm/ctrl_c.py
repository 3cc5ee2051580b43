"""Ctrl-C while training: stop after the current step, as after the last one."""
from __future__ import annotations

import signal
import threading


class StopOnCtrlC:
    """While training, Ctrl-C (SIGINT) asks to stop after the current step, so the run ends
    as after its last step (StarPU shut down, --save written) rather than wherever the signal
    lands; a second Ctrl-C interrupts at once. Python runs signal handlers in the main thread
    only, so elsewhere nothing changes."""

    def __init__(self):
        self.requested = False
        self._installed = False

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handler)
            self._installed = True
        return self

    def __exit__(self, *exc):
        if self._installed:    # None: a handler not set from Python; Python's default then
            signal.signal(signal.SIGINT, self._previous or signal.default_int_handler)

    def _handler(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def stop(self, comm) -> bool:
        """Whether to stop after this step; under MPI every rank stops after the same one."""
        if comm is None:
            return self.requested
        # the ranks' answers agree; a Ctrl-C that lands during the allgather stays requested
        # (not overwritten by its result) and stops every rank after the next step
        agreed = any(comm.allgather(self.requested))
        self.requested = self.requested or agreed
        return agreed
