"""Where a measured number comes from: the commit it was made at (and whether the tree had
uncommitted changes) and the machine it ran on. Written beside every committed raw file
(figures.py, perfmodel_validation.py).

A run made from a dirty tree measures code that no commit holds: its commit reads
"<hash>-dirty", and it is never reused from a cache (reusable)."""
from __future__ import annotations

import os
import subprocess
from importlib.metadata import PackageNotFoundError, version

from starpu_llm._clib import ffi, lib
from starpu_llm.perf.runs import cpu_description
from starpu_llm.runtime import usable_cores

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ISA_FLAGS = ("avx512f", "avx2", "fma")


def git_commit() -> str:
    """`git describe --always --dirty` of the source tree: "<hash>", "<hash>-dirty", or
    outside a git checkout $STARPU_LLM_COMMIT (what tools/device-eval16.sh --prepare recorded
    of the tree it copies to a machine without git), else "unknown"."""
    try:
        p = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=10"],
                           cwd=ROOT, capture_output=True, text=True, timeout=30)
        if p.returncode == 0 and p.stdout.strip():
            return p.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return os.environ.get("STARPU_LLM_COMMIT") or "unknown"


def reusable(commit: str) -> bool:
    """Whether runs made at `commit` name the code they measured (a clean commit)."""
    return commit != "unknown" and not commit.endswith("-dirty")


def starpu_has_fxt() -> bool:
    """Whether the StarPU this build uses was configured with FxT (STARPU_USE_FXT)."""
    for pc in ("starpu-1.4", "starpu-1.3"):
        p = subprocess.run(["pkg-config", "--variable=includedir", pc], capture_output=True, text=True)
        if p.returncode == 0:
            inc = p.stdout.strip()
            for sub in ("starpu/" + pc.split("-")[1], ""):
                f = os.path.join(inc, sub, "starpu_config.h")
                if os.path.exists(f):
                    return any(l.startswith("#define STARPU_USE_FXT") for l in open(f))
    return False


def cpuinfo() -> tuple[str, list]:
    """(model name, the ISA_FLAGS it has) from /proc/cpuinfo."""
    model, flags = "?", []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model == "?":
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    have = set(line.split(":", 1)[1].split())
                    flags = [x for x in ISA_FLAGS if x in have]
    except OSError:
        pass
    return model, flags


def cpu_generation(text: str) -> str:
    """x86 family and model from /proc/cpuinfo's text, with AMD's Zen generation where they name
    it ("family 26 model 2 (Zen 5)"): every AMD EPYC VM reports the model name "AMD EPYC", and a
    Zen 4's and a Zen 5's results must be told apart (both have AVX-512)."""
    def field(name):
        for line in text.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == name:
                return value.strip()
        return ""
    family, model = field("cpu family"), field("model")
    if not (family.isdigit() and model.isdigit()):
        return "?"
    f, m = int(family), int(model)
    zen = ""
    if field("vendor_id") == "AuthenticAMD":
        if f == 26:
            zen = "Zen 5"
        elif f == 25:   # Zen 3: Milan 0x01, Vermeer 0x21, Rembrandt 0x44, Cezanne 0x50;
            # Zen 4: Genoa 0x11, Raphael 0x61, Phoenix 0x74-0x78, Bergamo 0xa0
            zen = ("Zen 4" if 0x10 <= m <= 0x1f or 0x60 <= m <= 0x7f or 0xa0 <= m <= 0xaf
                   else "Zen 3")
        elif f == 23:
            zen = "Zen 2" if m >= 0x30 else "Zen"
    return f"family {f} model {m}" + (f" ({zen})" if zen else "")


def cpu_kind() -> str:
    """A folder name for this kind of CPU: its model name and widest vector ISA, e.g.
    amd-epyc-avx2 (the results of two CPU kinds must not overwrite each other)."""
    return kind_of(*cpuinfo())


def kind_of(model: str, flags) -> str:
    """cpu_kind of a CPU model name and its ISA_FLAGS (as machine_info records them)."""
    slug = "".join(c if c.isalnum() else "-" for c in model.lower()).strip("-")
    while "--" in slug:
        slug = slug.replace("--", "-")
    isa = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "noavx2"
    return f"{slug or 'cpu'}-{isa}"


def machine_info() -> dict:
    """The machine and the code a run measures."""
    v = [ffi.new("int *") for _ in range(3)]
    lib.sl_starpu_version(*v)
    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = "not installed"
    model, flags = cpuinfo()
    try:
        with open("/proc/cpuinfo") as f:
            generation = cpu_generation(f.read())
    except OSError:
        generation = "?"
    return {"cpu_model": model, "cpu_generation": generation, "cpu": cpu_description(),
            "isa": " ".join(flags),
            "cores": usable_cores(), "host": os.uname().nodename,
            "starpu_version": ".".join(str(x[0]) for x in v),
            "starpu_fxt": starpu_has_fxt(),
            "blas": ffi.string(lib.blas_name()).decode(),
            "torch_version": torch_version, "commit": git_commit()}
