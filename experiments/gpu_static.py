"""Static GPU checks that need no GPU (issue 41): every kernel of csrc/cuda/*.cu compiled by
nvcc for one architecture with ptxas' report (-Xptxas -v), parsed into a table: registers a
thread, stack frame, spill stores and loads, static shared memory and barriers a kernel.

    python experiments/gpu_static.py [--arch 90] [--nvcc PATH] [--cublas-include DIR]
                                     [--out experiments/results/gpu/static/ptxas_sm90.csv]

The flags are meson.build's for the CUDA build (-O3 -std=c++17 -lineinfo -DNDEBUG), one
architecture, objects into a temporary folder. A kernel whose spill bytes are not 0 is
printed as such; the CSV (rows sorted by file and kernel) is written to a temporary name and
renamed. Reading the table: docs/gpus.md, "Static checks".
"""
from __future__ import annotations

import argparse
import csv
import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = ["-c", "-O3", "-std=c++17", "-lineinfo", "-DNDEBUG", "-Xptxas", "-v"]
COLUMNS = ["file", "kernel", "arch", "registers", "stack_bytes", "spill_store_bytes",
           "spill_load_bytes", "shared_bytes", "barriers"]

ENTRY = re.compile(r"ptxas info\s*: Compiling entry function '(\S+)' for '(sm_\d+a?)'")
FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
USED = re.compile(r"ptxas info\s*: Used (\d+) registers")
BARRIERS = re.compile(r"used (\d+) barriers")
SHARED = re.compile(r"(\d+) bytes smem")


def parse_ptxas(text: str, file: str) -> list[dict]:
    """One row per entry function of ptxas' -v report (the kernels; device functions, which
    are inlined, have no entry)."""
    rows, row = [], None
    for line in text.splitlines():
        m = ENTRY.search(line)
        if m:
            row = dict(file=file, kernel=m.group(1), arch=m.group(2), registers=0, stack_bytes=0,
                       spill_store_bytes=0, spill_load_bytes=0, shared_bytes=0, barriers=0)
            rows.append(row)
            continue
        if row is None:
            continue
        m = FRAME.search(line)
        if m:
            row["stack_bytes"], row["spill_store_bytes"], row["spill_load_bytes"] = map(int, m.groups())
        m = USED.search(line)
        if m:
            row["registers"] = int(m.group(1))
            b, s = BARRIERS.search(line), SHARED.search(line)
            row["barriers"] = int(b.group(1)) if b else 0
            row["shared_bytes"] = int(s.group(1)) if s else 0
    return rows


def demangle(names: list[str], nvcc: str) -> dict:
    """{mangled: demangled} through cu++filt beside nvcc, else binutils' c++filt (the same
    Itanium mangling), the names unchanged without either."""
    filt = os.path.join(os.path.dirname(nvcc), "cu++filt")
    if not os.access(filt, os.X_OK):
        filt = shutil.which("c++filt")
    if not names or not filt:
        return {n: n for n in names}
    out = subprocess.run([filt], input="\n".join(names), capture_output=True, text=True,
                         check=True).stdout.splitlines()
    return dict(zip(names, out)) if len(out) == len(names) else {n: n for n in names}


def default_cublas_include() -> str:
    here = os.path.join(sysconfig.get_path("purelib"), "nvidia", "cu13", "include")
    return next((d for d in (here, os.path.join(ROOT, ".venv-cuda")) if
                 os.path.exists(os.path.join(d, "cublas_v2.h"))), "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="90")
    ap.add_argument("--nvcc", default=os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"),
                                                   "bin", "nvcc"))
    ap.add_argument("--cublas-include", default=None,
                    help="folder of cublas_v2.h (default: this Python's nvidia/cu13/include)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if not os.access(a.nvcc, os.X_OK):
        print(f"gpu_static: no nvcc at {a.nvcc}; give --nvcc or CUDA_HOME", file=sys.stderr)
        return 2
    inc = a.cublas_include or default_cublas_include()
    if not inc or not os.path.exists(os.path.join(inc, "cublas_v2.h")):
        print("gpu_static: no cublas_v2.h found; give --cublas-include (the folder holding it, "
              "e.g. a venv's site-packages/nvidia/cu13/include)", file=sys.stderr)
        return 2
    out = a.out or os.path.join(ROOT, "experiments", "results", "gpu", "static",
                                f"ptxas_sm{a.arch}.csv")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for src in sorted(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu"))):
            cmd = [a.nvcc, *FLAGS, f"-I{inc}", "-gencode", f"arch=compute_{a.arch},code=sm_{a.arch}",
                   src, "-o", os.path.join(tmp, os.path.basename(src) + ".o")]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                print(f"gpu_static: nvcc failed on {src}:\n{r.stderr}", file=sys.stderr)
                return 1
            rows += parse_ptxas(r.stdout + r.stderr, os.path.relpath(src, ROOT))
    names = demangle([r["kernel"] for r in rows], a.nvcc)
    for r in rows:
        r["kernel"] = names[r["kernel"]]
    rows.sort(key=lambda r: (r["file"], r["kernel"]))
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp_out = out + ".tmp"
    with open(tmp_out, "w", newline="") as f:
        w = csv.DictWriter(f, COLUMNS)
        w.writeheader()
        w.writerows(rows)
    os.replace(tmp_out, out)
    for r in rows:
        spill = r["spill_store_bytes"] + r["spill_load_bytes"]
        print(f"{r['registers']:4d} regs {r['stack_bytes']:5d} B stack "
              f"{'SPILLS %d/%d B ' % (r['spill_store_bytes'], r['spill_load_bytes']) if spill else ''}"
              f"{r['file']}: {r['kernel'][:90]}")
    print(f"{len(rows)} kernels -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
