"""Generate the cffi (API mode) C source of starpu_llm._clib from the public C headers.

Run by meson at build time: build_cffi.py kernels.h sl_api.h out.c
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


def main(kernels_h, api_h, out_c):
    ffi = cffi.FFI()
    ffi.cdef(cdef_of(kernels_h))
    ffi.cdef(cdef_of(api_h))
    ffi.set_source("starpu_llm._clib", '#include "kernels.h"\n#include "sl_api.h"\n')
    tmp = out_c + ".tmp"
    ffi.emit_c_code(tmp)
    os.replace(tmp, out_c)


if __name__ == "__main__":
    main(*sys.argv[1:4])
