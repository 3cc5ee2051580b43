"""Generate the cffi (API mode) C source of a binding module from public C headers.

Run by meson at build time: build_cffi.py MODULE OUT.c HEADER...
    starpu_llm._kernels  from kernels.h: the pure kernels (no StarPU), for the reference engine
    starpu_llm._clib     from kernels.h and sl_api.h: the kernels and the StarPU layer
The declarations are the headers themselves minus preprocessor lines (integer constants,
`#define NAME 123`, are kept: Python reads them as lib.NAME), so the Python binding cannot
drift from the C API.
"""
import os
import re
import sys

import cffi


def cdef_of(path):
    text = open(path).read()
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    const = re.compile(r"\s*#define\s+\w+\s+-?\d+\s*$")
    return "\n".join(l for l in text.splitlines()
                     if not l.lstrip().startswith("#") or const.match(l))


def main(module, out_c, *headers):
    ffi = cffi.FFI()
    for h in headers:
        ffi.cdef(cdef_of(h))
    ffi.set_source(module, "".join(f'#include "{os.path.basename(h)}"\n' for h in headers))
    tmp = out_c + ".tmp"
    ffi.emit_c_code(tmp)
    os.replace(tmp, out_c)


if __name__ == "__main__":
    main(*sys.argv[1:])
