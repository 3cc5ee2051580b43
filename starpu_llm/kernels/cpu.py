"""Whether this CPU runs the kernels as built: a build with -march=native (meson's `native`
option, the default) uses the build machine's instruction sets (AVX-512 on one, AVX2 on
another), and a CPU without one of them ends the process with an illegal instruction (SIGILL)
inside the first kernel that uses it, without a word: a cluster's login node and its compute
nodes often differ."""
from __future__ import annotations

from ..errors import StarpuLLMError


def cpu_flags(path: str = "/proc/cpuinfo") -> set[str] | None:
    """The flags of this machine's first CPU (None where unreadable: not Linux on x86)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


_passed = False       # this process's CPU passed check() once: nothing to read again


def missing(built: str | None = None, flags: set[str] | None = None) -> list[str]:
    """The instruction sets the build used (built: starpu_llm._build.ISA) that this CPU
    (flags: cpu_flags()) lacks; none where either is unknown (a tree never built: the import
    of the kernels says so; not Linux)."""
    if built is None:
        try:
            from .._build import ISA as built
        except ImportError:
            return []
    flags = cpu_flags() if flags is None else flags
    return [f for f in built.split() if flags is not None and f not in flags]


def check(built: str | None = None, flags: set[str] | None = None) -> None:
    """One StarpuLLMError when this CPU lacks an instruction set the build used (missing)."""
    global _passed
    mine = built is None and flags is None
    if mine and _passed:
        return
    lacking = missing(built, flags)
    if lacking:
        raise StarpuLLMError(
            f"starpu_llm was built with -march=native on a CPU with {', '.join(lacking)}, which "
            f"this CPU lacks (its first kernel would end the process with an illegal "
            f"instruction): build on this kind of node, or for any x86-64 CPU with "
            f"`pip install --no-build-isolation -Csetup-args=-Dnative=false -e .` in a fresh "
            f"build folder (docs/clusters.md)")
    _passed = _passed or mine
