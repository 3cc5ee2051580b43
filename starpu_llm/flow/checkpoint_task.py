"""The checkpoint write as a starpupy task in the training task graph (the StarPU engine
started by starpupy: runtime/starpupy_face.py).

The write is a starpupy task reading a starpupy handle (a numpy array), which a C task fills
from the parameter handles after the last update of the step. Later steps' forward and
backward passes and even their update overlap the file write: only the copy stands between
the update of step s and that of step s+1.
"""
from __future__ import annotations

import os
import threading

import numpy as np

from .._clib import ffi
from ..model.config import ParamLayout
from ..errors import StarpuLLMError
from ..io import formats
from ..runtime.starpupy_face import handle_pointer, import_starpupy
from ..runtime.submit import StarPUOps


class CheckpointTask:
    """The checkpoint write as a starpupy task in the training task graph.

    submit(path) submits, after the tasks submitted so far: a C task copying every parameter
    handle (read) into a snapshot, a numpy array registered as a starpupy handle (written);
    then a Python task (starpupy, on a StarPU worker) reading that handle and writing the
    snapshot as an llm.c checkpoint (formats.write_checkpoint). Both are ordered by StarPU's
    data dependencies alone: the copy after the last update of the parameters, the write after
    the copy, the next copy after the write; the next step's tasks need only the copy done."""

    def __init__(self, config, params):
        starpu = import_starpupy()
        self.config = config
        self.sources = [t.h for t in params.tensors()]    # ParamLayout order
        self.snapshot = np.empty(ParamLayout(config).total, np.float32)
        self.handle = starpu.Handle(self.snapshot)
        self.written = []       # paths written, in order
        self.errors = []
        self._lock = threading.Lock()
        self._submit = starpu.task_submit(ret_fut=False, name="checkpoint_write")

    def submit(self, path) -> None:
        path = os.fspath(path)
        StarPUOps().gather(handle_pointer(self.handle), self.sources,
                           ffi.cast("char *", ffi.from_buffer(self.snapshot)))
        # a starpu.Handle argument is read (STARPU_R) by default; the task gets its numpy array
        self._submit(self._write, path, self.handle)

    def _write(self, path, snapshot):
        try:
            formats.write_checkpoint(path, self.config, snapshot)
            with self._lock:
                self.written.append(path)
        except BaseException as e:        # raised in the submitting thread by check()
            with self._lock:
                self.errors.append(e)

    def check(self) -> None:
        """Raise the first error of a checkpoint write (once the tasks have run)."""
        with self._lock:
            if self.errors:
                e, self.errors = self.errors[0], []
                raise StarpuLLMError(f"writing a checkpoint failed: {e}") from e

    def close(self) -> None:
        """Unregister the snapshot handle (after its tasks; call with StarPU running)."""
        if self.handle is not None:
            self.handle.unregister()
            self.handle = None
