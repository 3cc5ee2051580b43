"""The codelet table, read from C, and the two executors of the task flow derived from it.

Each codelet is declared once, in C (csrc/codelets/<layer>.c): its buffers and their access
modes, its argument struct (csrc/codelets/sl_codelets.h), its flop count and its body. Python
reads that table and gives each executor one method per codelet, called as

    ops.matmul_forward(out, inp, weight, bias, N, C, OC)

the buffers in declared order (None for an optional buffer left out; for a repeated one
(SL_REPEAT), a list of its k repeats, e.g. a matrix's row blocks, or one tensor: k = 1),
then the fields of the codelet's argument struct in order (or by name) but its repeat count,
which is filled from the lists (SL_CODELET_REPEAT names it), and `redux=1` where parameter
gradients take StarPU reduction contributions. The mode of an SL_ACC buffer (W, or RW when
adding) follows the field its declaration names (SL_CODELET_ACC), read by the C side from
the arguments.

  - DirectOps (here) runs the codelet's body at once in the calling thread (the reference
    engine; only the _kernels binding is loaded, no StarPU);
  - runtime.submit.StarPUOps submits one StarPU task per call (lib.sl_submit, never running Python
    inside a task), at the `Where` it was made for: plan/sites.py gives it with every task.

flow/taskflow.py is written against these methods only, so both engines run exactly the same
sequence of layers.
"""
from __future__ import annotations

import os
from typing import NamedTuple

from .._kernels import ffi, lib
from .cpu import check as check_cpu


def cuda_devices() -> tuple[int, str]:
    """The GPUs CUDA sees here, and "" or why it could not count them (cudaGetDeviceCount's
    error: a driver older than this build's CUDA, a broken install), which is no "no GPU"."""
    n = lib.sl_gpu_devices()
    if n >= 0:
        return n, ""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return 0, (f"cudaGetDeviceCount failed: {ffi.string(lib.sl_gpu_error_string(-n)).decode()} "
               f"(cudaError {-n}; CUDA_VISIBLE_DEVICES "
               f"{'unset' if visible is None else repr(visible)})")


class SubmitError(RuntimeError):
    pass


class TableError(RuntimeError):
    """The C codelet table cannot be read as the calling convention needs (a mistake in
    csrc/codelets/, caught at import rather than as a missing or wrong method later)."""


class Codelet(NamedTuple):
    """One declaration of the codelet table."""
    id: int
    name: str
    args_type: str          # "struct sl_..._args"
    args_size: int          # its size in bytes
    fields: tuple           # the argument struct's field names a call gives, in order
    nbuffers: int           # declared buffers
    repeat: tuple           # the declared buffers that come k >= 1 times (SL_REPEAT)
    count: str              # the argument field holding k, filled from the call ("" without)

    @property
    def has_args(self) -> bool:
        """Whether a task carries an argument struct."""
        return bool(self.fields or self.count)


def read_table(ffi_, lib_) -> dict:
    """{name: Codelet} of a binding module's codelet table; TableError for a name declared
    twice (a copied codelet file not renamed: one would hide the other) or an argument struct
    cffi does not see."""
    out = {}
    for i in range(lib_.sl_codelet_count()):
        name = ffi_.string(lib_.sl_codelet_name(i)).decode()
        if name in out:
            raise TableError(f"codelet {name} is declared twice in csrc/codelets/ (two "
                             f"SL_CODELET({name}, ...)): rename one, its name is its method "
                             f"in Python and its perf model in StarPU")
        args_type = ffi_.string(lib_.sl_codelet_args_type(i)).decode()
        count = ffi_.string(lib_.sl_codelet_repeat_field(i)).decode()
        try:
            fields = () if args_type == "struct sl_no_args" else tuple(
                f for f, _ in ffi_.typeof(args_type).fields if f != count)
        except ffi_.error:
            raise TableError(f"codelet {name}'s arguments, {args_type}, are not declared in "
                             f"csrc/codelets/sl_codelets.h, the header Python's binding is "
                             f"generated from: move the struct there") from None
        modes = ffi_.new("int32_t[]", lib_.SL_MAX_BUFFERS)
        n = lib_.sl_codelet_modes(i, 0, 0, modes, lib_.SL_MAX_BUFFERS)
        out[name] = Codelet(i, name, args_type, ffi_.sizeof(args_type), fields, n,
                            tuple(j for j in range(n) if modes[j] & lib_.SL_ACCESS_REPEAT),
                            count)
    return out


def split_call(cd: Codelet, args: tuple, kwargs: dict):
    """(buffers, scalars) of a call: the buffers in declared order without trailing Nones,
    each repeated buffer's list in its place (all of the same length k, the repeat count);
    the struct's fields by position, then by name, and the repeat count."""
    nb = cd.nbuffers
    given = list(args[:nb])
    lengths = {len(given[j]) if isinstance(given[j], (list, tuple)) else 1
               for j in cd.repeat if j < len(given) and given[j] is not None}
    if len(lengths) > 1:
        raise TypeError(f"{cd.name}: repeated buffers of different counts {sorted(lengths)}")
    buffers = []
    for j, t in enumerate(given):
        buffers += list(t) if j in cd.repeat and isinstance(t, (list, tuple)) else [t]
    while buffers and buffers[-1] is None:
        buffers.pop()
    scalars = dict(zip(cd.fields, args[nb:]))
    extra = set(kwargs) - set(cd.fields)
    if extra or len(args) - nb > len(cd.fields):
        raise TypeError(f"{cd.name}: unexpected arguments {sorted(extra) or args[nb:]}")
    scalars.update(kwargs)
    missing = [f for f in cd.fields if f not in scalars]
    if missing:
        raise TypeError(f"{cd.name}: missing arguments {missing}")
    if cd.count:
        scalars[cd.count] = lengths.pop() if lengths else 0
    return buffers, scalars


def add_methods(cls, table: dict, call):
    """Gives cls one method per codelet of table, each `call(self, codelet, args, kwargs)`."""
    def method(cd):
        def run(self, *args, **kwargs):
            return call(self, cd, args, kwargs)
        run.__name__ = run.__qualname__ = cd.name
        run.__doc__ = f"The {cd.name} codelet ({cd.args_type}: {', '.join(cd.fields)})."
        return run
    for name, cd in table.items():
        setattr(cls, name, method(cd))
    return cls


TABLE = read_table(ffi, lib)


def _run(self, cd: Codelet, args, kwargs):
    kwargs.pop("redux", None)             # sub-batches add their gradients in order here
    buffers, scalars = split_call(cd, args, kwargs)
    n = len(buffers)
    ptrs = ffi.new("void *[]", [ffi.cast("void *", t.ptr) for t in buffers] or 1)
    counts = ffi.new("size_t[]", [t.size for t in buffers] or 1)
    sizes = ffi.new("size_t[]", [t.dtype.itemsize for t in buffers] or 1)
    a = ffi.new(cd.args_type + " *", scalars) if cd.has_args else ffi.NULL
    if self.gpu and cd.id in CUDA_BODIES:
        ret = lib.sl_codelet_run_cuda(cd.id, ptrs, counts, sizes, n, a, self.tf32)
    else:
        ret = lib.sl_codelet_run(cd.id, ptrs, counts, sizes, n, a)
    if ret != 0:
        raise SubmitError(f"running {cd.name}{' on the GPU' if self.gpu else ''} failed ({ret})")


# the codelets with a CUDA body (SL_CUDA); the others run on CPUs only
CUDA_BODIES = frozenset(cd.id for cd in TABLE.values() if lib.sl_codelet_has_cuda(cd.id) == 1)


class DirectOps:
    """Runs each codelet's body at once, in order, in this thread (OpenMP inside each kernel);
    the same methods as StarPUOps. gpu: each codelet's CUDA body instead where it has one
    (sl_codelet_run_cuda: on copies of the buffers, on GPU 0 of a CUDA build, in the CPU
    emulation of CUDA otherwise), matmuls in TF32 when tf32; the others' CPU bodies."""

    def __init__(self, gpu: bool = False, tf32: bool = False):
        check_cpu()         # the kernels run from here: built for an instruction set here?
        self.gpu, self.tf32 = gpu, int(tf32)

    def at(self, where) -> "DirectOps":
        return self


add_methods(DirectOps, TABLE, _run)
