"""Writing files so that a crash never leaves a half-written file under the final name.

The data goes to a temporary file in the target's directory; on commit it is flushed and
fsync'ed, os.replace()d onto the target, and the directory is fsync'ed so that the rename
itself survives a crash. Failures raise StarpuLLMError naming the file and what to do.

    atomic_write(path, lambda f: f.write(data))          # all at once
    atomic_write_text(path, text)
    check_writable(path)                                  # fail early, before the work
    out = AtomicFile(path, text=True)                     # progressively, renamed at the end
    out.file.write(line); ...; out.commit()               # (or out.discard())
"""
from __future__ import annotations

import os
import tempfile
from typing import Callable

from ..errors import StarpuLLMError


class AtomicFile:
    """A temporary file next to `path` (attribute `file`, binary or UTF-8 text) that becomes
    `path` on commit() and disappears on discard(). As a context manager it yields `file`,
    commits when the block ends normally and discards when it raises."""

    def __init__(self, path, text: bool = False):
        self.path = os.fspath(path)
        self._dir = os.path.dirname(os.path.abspath(self.path))
        try:
            os.makedirs(self._dir, exist_ok=True)
        except OSError as e:
            raise StarpuLLMError(f"cannot create directory {self._dir} for {self.path}: "
                                 f"{e.strerror}; choose a writable output location") from e
        try:
            fd, self._tmp = tempfile.mkstemp(dir=self._dir, suffix=".tmp",
                                             prefix="." + os.path.basename(self.path) + ".")
        except OSError as e:
            raise StarpuLLMError(f"cannot write {self.path}: {e.strerror}; choose a writable "
                                 f"output location") from e
        # newline="": what is written is what lands in the file (csv writes its own \r\n)
        self.file = (os.fdopen(fd, "w", encoding="utf-8", newline="") if text
                     else os.fdopen(fd, "wb"))

    def commit(self) -> str:
        """Make the written data the file at `path`; returns `path`."""
        try:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            os.chmod(self._tmp, 0o644 & ~_umask())    # mkstemp made it 0600
            os.replace(self._tmp, self.path)
        except OSError as e:
            self.discard()
            raise _write_error(self.path, e) from e
        except BaseException:
            self.discard()
            raise
        _fsync_dir(self._dir)
        return self.path

    def discard(self) -> None:
        """Drop what was written; `path` is left as it was."""
        try:
            self.file.close()
        except OSError:
            pass
        try:
            os.unlink(self._tmp)
        except OSError:
            pass

    def __enter__(self):
        return self.file

    def __exit__(self, exc_type, exc, tb):
        if exc is None:
            self.commit()
            return False
        self.discard()
        if isinstance(exc, OSError):
            raise _write_error(self.path, exc) from exc
        return False


def atomic_write(path, write: Callable, text: bool = False) -> str:
    """Call write(file) on a temporary file next to `path`, then commit it onto `path`;
    returns `path` as a str. `file` is binary, or UTF-8 text if `text`."""
    out = AtomicFile(path, text)
    with out as f:
        write(f)
    return out.path


def atomic_write_text(path, text: str) -> str:
    """Write `text` (UTF-8) to `path` atomically."""
    return atomic_write(path, lambda f: f.write(text), text=True)


def check_writable(path) -> None:
    """Raise StarpuLLMError now if `path` could not be written later: a directory, or a place
    where AtomicFile cannot create its directory or temporary file (the steps of a real write)."""
    if os.path.isdir(path):
        raise StarpuLLMError(f"{os.fspath(path)} is a directory; give the path of a file to write")
    AtomicFile(path).discard()


def _write_error(path: str, e: OSError) -> StarpuLLMError:
    return StarpuLLMError(f"writing {path} failed: {e.strerror or e}; check free disk space "
                          f"and permissions")


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:       # some file systems cannot fsync a directory
        pass
    finally:
        os.close(fd)


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m
