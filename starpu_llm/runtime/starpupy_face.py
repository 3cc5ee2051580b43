"""starpupy, StarPU's own Python interface, as the Python face of the runtime (opt-in).

Where StarPU was built with starpupy (the `starpu` Python package, StarPU >= 1.4) and the user
asks for it (Runtime(face="starpupy"), or STARPU_LLM_FACE=starpupy in the environment):

- StarPU is started and stopped by starpupy (starpu.init() / starpu.shutdown()); the project's
  set-up after init (parallel workers, team groups, the codelets' cores) is then done by
  sl_attach (csrc/starpu/runtime.c) on the StarPU starpupy started. starpu.init() takes no
  configuration: the partition's (CPU workers, scheduler, worker cores, combined-worker size)
  is handed to it through StarPU's environment variables, set for the call only.
- Python-level tasks run in the same task graph as the C codelets (a starpupy handle's raw
  starpu_data_handle_t is handle_pointer's); the checkpoint write of flow/checkpoint_task.py
  is one.

What starpupy cannot do (StarPU 1.4.12): its handles are not vector handles. starpupy
registers a numpy array with its own data interface (STARPUPY_BUFFER_INTERFACE, whose second
field is a PyObject pointer, NULL for numpy, where a vector has its data pointer), so a C codelet
reading STARPU_VECTOR_GET_PTR gets NULL and crashes; and a starpupy task given a vector handle
aborts ("unexpected object": starpupy_codelet_func converts only its own interfaces). So the
model's tensors stay vector handles registered by flow/handles.py, and the raw
starpu_data_handle_t of a starpupy handle (handle_pointer, from its "Handle" capsule) goes to C
helpers that only order on it or copy into its memory, never to a codelet reading it.

Without starpupy, or without the request, the cffi runtime is used, as before.
"""
from __future__ import annotations

import concurrent.futures
import concurrent.futures.thread
import contextlib
import ctypes
import importlib.util
import os

from .._clib import ffi, lib
from ..errors import StarpuLLMError

FACES = ("cffi", "starpupy")
ENV = "STARPU_LLM_FACE"


def available() -> bool:
    """Whether starpupy (StarPU's `starpu` Python package with its C module) is importable."""
    try:
        return importlib.util.find_spec("starpu") is not None and \
            importlib.util.find_spec("starpu.starpupy") is not None
    except (ImportError, ValueError):
        return False


def resolve(face: str | None) -> str:
    """The face to use: the one asked for (an error when it cannot be had), else
    $STARPU_LLM_FACE when starpupy is there for it, else "cffi" (a value of the variable that
    names no face: an error naming it)."""
    if face is not None:
        if face not in FACES:
            raise StarpuLLMError(f"face {face!r}: choose one of {', '.join(FACES)}")
        if face == "starpupy" and not available():
            raise StarpuLLMError("face 'starpupy' needs StarPU's Python interface (the `starpu` "
                                 "package of a StarPU >= 1.4 built with starpupy) on sys.path")
        return face
    env = os.environ.get(ENV, "cffi")
    if env not in FACES:
        raise StarpuLLMError(f"{ENV}={env!r}: choose one of {', '.join(FACES)}, or unset it")
    return "starpupy" if env == "starpupy" and available() else "cffi"


def import_starpupy():
    """The `starpu` package (starpupy), imported once, with the references its C module's
    initialisation releases without owning them put back (see _repair_references)."""
    import starpu
    import starpu.starpupy  # noqa: F401
    _repair_references()
    return starpu


_repaired = False


def _repair_references() -> None:
    """StarPU 1.4.12's starpupy (starpupy/src/starpu_task_wrapper.c, module init and free)
    Py_DECREFs borrowed references: the dicts of concurrent.futures and
    concurrent.futures.thread and the ThreadPoolExecutor class when it is imported, the
    Future class and the starpu package's dict when it is freed. Each is then one reference
    short, and Python's finalisation frees a module dict twice: a segfault at exit, after
    every test passed, in about one run in five (seen in _PyModule_ClearDict of
    concurrent.futures). Giving each object the one reference starpupy took, once per
    process, makes the counts right again."""
    global _repaired
    if _repaired:
        return
    import starpu
    for obj in (vars(concurrent.futures), vars(concurrent.futures.thread),
                concurrent.futures.thread.ThreadPoolExecutor, concurrent.futures.Future,
                vars(starpu)):
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
    _repaired = True


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def handle_pointer(handle):
    """The starpu_data_handle_t of a starpupy Handle (its "Handle" capsule) as an sl_handle."""
    ptr = _capsule_pointer(handle.get_capsule(), b"Handle")
    if not ptr or ptr == ctypes.c_void_p(-1).value:
        raise StarpuLLMError("this starpupy handle has been unregistered")
    return ffi.cast("sl_handle", ptr)


@contextlib.contextmanager
def environment(values: dict):
    """os.environ updated with values for the block only (None: variable unset)."""
    def apply(env):
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    saved = {k: os.environ.get(k) for k in values}
    try:
        apply(values)
        yield
    finally:
        apply(saved)


def start(partition, started, core_ids: list) -> None:
    """starpu.init() with the configuration sl_start would make for `partition` (a resolved
    record.Partition), then sl_attach; started: the partition as the C layer takes it
    (runtime.starpu.c_partition)."""
    starpu = import_starpupy()

    workers, cores_per_worker = partition.workers, partition.cores_per_worker
    env = {"STARPU_SCHED": partition.sched, "STARPU_NCPU": str(partition.cores),
           "STARPU_NCUDA": "0",
           "STARPU_NCPUS": None, "STARPU_WORKERS_CPUID": None, "STARPU_MIN_WORKERSIZE": None,
           "STARPU_MAX_WORKERSIZE": None}
    if partition.kcore == "team":      # one worker on the first core of each group
        env["STARPU_NCPU"] = str(workers)
        env["STARPU_WORKERS_CPUID"] = " ".join(str(core_ids[w * cores_per_worker])
                                               for w in range(workers))
    elif partition.kcore == "forkjoin":
        env["STARPU_MIN_WORKERSIZE"] = env["STARPU_MAX_WORKERSIZE"] = str(cores_per_worker)
    lib.sl_reserve_interface_ids(16)    # starpupy's 3 interfaces (see csrc/starpu/runtime.c)
    with environment(env):
        starpu.init()
    ret = lib.sl_attach(started, ffi.new("int[]", core_ids))
    if ret != 0:
        starpu.shutdown()
        raise StarpuLLMError(f"setting up the StarPU started by starpupy failed ({ret})")


def stop() -> int:
    """Our part of the shutdown (tasks, parallel workers), then starpupy's starpu.shutdown();
    sl_shutdown's result (Runtime checks it)."""
    starpu = import_starpupy()

    ret = lib.sl_shutdown()
    starpu.shutdown()
    return ret
