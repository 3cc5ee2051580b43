"""The StarPU executor of the task flow: one task per call, at the place it is given.

StarPUOps has one method per codelet of the table (codelets.py gives the calling convention);
each submits a task through the one insert path, lib.sl_submit, with the `Where` of the
executor: where a task runs is an argument of every submission, decided by
flow/placement.Placement and nowhere else.
"""
from __future__ import annotations

from typing import NamedTuple

from .._clib import ffi, lib
from ..codelets import Codelet, SubmitError, add_methods, read_table, split_call


class Where(NamedTuple):
    """Where a task runs: the StarPU-MPI rank (OWNER: the owner of the data it writes) and the
    StarPU worker (ANY: the scheduler's choice). Decided by placement.Placement only."""
    node: int = lib.SL_NODE_OWNER
    worker: int = lib.SL_ANY_WORKER


OWNER, ANY = lib.SL_NODE_OWNER, lib.SL_ANY_WORKER
ANYWHERE = Where()
TABLE = read_table(ffi, lib)


def _handle(t):
    """A Tensor's handle, or a raw sl_handle (e.g. a starpupy handle's)."""
    return getattr(t, "h", t)


def _submit(self, cd: Codelet, args, kwargs):
    redux = kwargs.pop("redux", 0)
    buffers, scalars = split_call(cd, args, kwargs)
    handles = ffi.new("sl_handle[]", [_handle(t) for t in buffers] or 1)
    if cd.fields:
        a, size = ffi.new(cd.args_type + " *", scalars), ffi.sizeof(cd.args_type)
    else:
        a, size = ffi.NULL, 0
    ret = lib.sl_submit(cd.id, handles, len(buffers), redux, a, size, self.where.node,
                        self.where.worker)
    if ret != 0:
        raise SubmitError(f"submitting {cd.name} failed ({ret})")
    if self.records is not None:
        self.records.append(cd.name)


class StarPUOps:
    """Submits each codelet as a StarPU task at `where`. With record=True, keeps the name of
    every submission, in order, in .records (shared by the executors made by at())."""

    def __init__(self, record: bool = False, where: Where = ANYWHERE, records=None):
        self.records = records if records is not None else ([] if record else None)
        self.where = where

    def at(self, where: Where) -> "StarPUOps":
        """The same executor submitting its tasks at `where`."""
        return StarPUOps(where=where, records=self.records)


add_methods(StarPUOps, TABLE, _submit)
