"""Writing files so that a crash never leaves a half-written file under the final name.

The data goes to a temporary file in the target's directory; on commit it is flushed and
fsync'ed, os.replace()d onto the target, and the directory is fsync'ed so that the rename
itself survives a crash. Failures raise StarpuLLMError naming the file and what to do.

    atomic_write(path, lambda f: f.write(data))          # all at once
    atomic_write_text(path, text)
    check_writable(path)                                  # fail early, before the work
    out = AtomicFile(path, text=True)                     # progressively, renamed at the end
    out.file.write(line); ...; out.commit()               # (or out.discard())

The temporary file is named .<name>.<host>.<pid>.<random>.tmp: the next AtomicFile of the same
path removes those that a process of this host killed midway left behind (its pid is gone).
"""
from __future__ import annotations

import errno
import os
import socket
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
            # EEXIST, ENOTDIR: a file where the folder, or one above it, would be
            why = ("a file is in the way (a folder is needed there)"
                   if e.errno in (errno.EEXIST, errno.ENOTDIR) else e.strerror)
            raise StarpuLLMError(f"cannot create directory {self._dir} for {self.path}: "
                                 f"{why}; choose a writable output location") from e
        base = os.path.basename(self.path)
        remove_stale_temporaries(self._dir, keep=lambda name: name != base)
        try:
            fd, self._tmp = tempfile.mkstemp(dir=self._dir, suffix=".tmp",
                                             prefix=_temporary_prefix(self.path) + f"{os.getpid()}.")
        except OSError as e:
            raise StarpuLLMError(f"cannot write {self.path}: {e.strerror}; choose a writable "
                                 f"output location") from e
        # newline="": what is written is what lands in the file (csv writes its own \r\n)
        self.file = (os.fdopen(fd, "w", encoding="utf-8", newline="") if text
                     else os.fdopen(fd, "wb"))

    def finish(self) -> None:
        """Make the written data complete on disk under the temporary name (flushed, fsync'ed,
        closed); commit() then only renames. Used to write two files before either replaces
        what is there (io/checkpoint.py)."""
        if not self.file.closed:
            self._or_discard(self._complete)

    def fill(self, write: Callable) -> None:
        """write(file), then finish(); should either fail, what was written is dropped (an
        OSError reported as a StarpuLLMError naming the file)."""
        self._or_discard(write, self.file)
        self.finish()

    def _complete(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.chmod(self._tmp, 0o644 & ~_umask())    # mkstemp made it 0600

    def commit(self) -> str:
        """Make the written data the file at `path`; returns `path`."""
        self.finish()
        self._or_discard(os.replace, self._tmp, self.path)
        _fsync_dir(self._dir)
        return self.path

    def _or_discard(self, step, *args) -> None:
        """step(*args); should it fail, what was written is dropped (an OSError reported as
        a StarpuLLMError naming the file)."""
        try:
            step(*args)
        except OSError as e:
            self.discard()
            raise _write_error(self.path, e) from e
        except BaseException:
            self.discard()
            raise

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


def _temporary_prefix(path: str) -> str:
    return f".{os.path.basename(path)}.{socket.gethostname()}."


def remove_stale_temporaries(directory, keep=lambda name: False) -> None:
    """Remove the temporary files in `directory` that writers of this host killed midway left
    behind (their process is gone), but those whose target's name keep(name) accepts; the
    temporary files of live processes and of other hosts stay."""
    host = "." + socket.gethostname()
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        parts = name.rsplit(".", 3)
        if len(parts) != 4 or parts[3] != "tmp" or not name.startswith("."):
            continue
        rest, pid = parts[0], parts[1]
        if not (rest.endswith(host) and pid.isdigit()) or keep(rest[1:-len(host)]):
            continue
        if not _alive(int(pid)):
            try:
                os.unlink(os.path.join(directory, name))
            except OSError:
                pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:            # another user's process: alive
        return True
    return True


def _write_error(path: str, e: Exception) -> StarpuLLMError:
    """e: an OSError, or another library's error writing path (safetensors')"""
    return StarpuLLMError(f"writing {path} failed: {getattr(e, 'strerror', None) or e}; check "
                          f"free disk space and permissions")


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
