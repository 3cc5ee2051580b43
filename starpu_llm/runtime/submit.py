"""The StarPU executor of the task flow: one task per call, at the place it is given.

StarPUOps has one method per codelet of the table (kernels/codelets.py gives the calling convention);
each submits a task through the one insert path, lib.sl_submit, with the `Where` of the
executor: where a task runs is an argument of every submission, decided by plan/sites.Sites
and nowhere else.
"""
from __future__ import annotations

import threading

from .._clib import ffi, lib
from ..kernels.codelets import Codelet, SubmitError, add_methods, read_table, split_call
from ..plan.sites import ANY, ANYWHERE, OWNER, Where


# where a task runs is data of its own (plan/sites.py); its constants are the C layer's
assert (OWNER, ANY) == (lib.SL_NODE_OWNER, lib.SL_ANY_WORKER)
TABLE = read_table(ffi, lib)


def _handle(t):
    """A Tensor's handle, or a raw sl_handle (e.g. a starpupy handle's)."""
    return getattr(t, "h", t)


class _Buffers(threading.local):
    """What a submission hands to sl_submit, allocated once per thread and filled anew for each
    task: sl_submit reads the handles during the call only and copies the arguments
    (csrc/starpu/submit.c). Per thread, as cffi releases the GIL during the call (and a thread
    makes one submission at a time: no signal handler or finalizer submits a task)."""

    def __init__(self):
        self.handles = ffi.new("sl_handle[]", lib.SL_MAX_BUFFERS)
        self.args = {name: ffi.new(cd.args_type + " *") for name, cd in TABLE.items()
                     if cd.has_args}


_BUFFERS = _Buffers()


def _submit(self, cd: Codelet, args, kwargs):
    redux = kwargs.pop("redux", 0)
    buffers, scalars = split_call(cd, args, kwargs)
    n, mine = len(buffers), _BUFFERS
    if n > len(mine.handles):       # repeated buffers past the declared maximum
        mine.handles = ffi.new("sl_handle[]", n)
    mine.handles[0:n] = [_handle(t) for t in buffers]
    if cd.has_args:
        a, size = mine.args[cd.name], cd.args_size
        a[0] = scalars              # every field: split_call refuses a call missing one
    else:
        a, size = ffi.NULL, 0
    where = ANYWHERE if self.sites is not None else self.where
    ret = lib.sl_submit(cd.id, mine.handles, n, redux, a, size, *where)
    if ret != 0:
        raise SubmitError(f"submitting {cd.name} failed ({ret})")
    if self.records is not None:
        self.records.append(cd.name)
    if self.sites is not None:
        self.sites[lib.sl_submitted() - 1] = (cd.name, self.where)


class StarPUOps:
    """Submits each codelet as a StarPU task at `where`. With record=True, keeps the name of
    every submission, in order, in .records (shared by the executors made by at()).

    sites (a dict): the performance model's recording of another machine's step (perf/graph.py):
    each task is submitted anywhere in this process, and its submission number is mapped to
    (its codelet, the Where it was given: the site it would run at there)."""

    def __init__(self, record: bool = False, where: Where = ANYWHERE, records=None, sites=None):
        self.records = records if records is not None else ([] if record else None)
        self.where = where
        self.sites = sites

    def at(self, where: Where) -> "StarPUOps":
        """The same executor submitting its tasks at `where`."""
        return StarPUOps(where=where, records=self.records, sites=self.sites)


add_methods(StarPUOps, TABLE, _submit)
