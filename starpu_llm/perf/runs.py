"""One configuration run in a fresh Python process, and the helpers that record such runs:
what the bench, the calibration, the autotuner and the experiments share.

run_in_subprocess starts `python -m starpu_llm.bench SPEC`: the child runs bench.run_one
(the trainer's own run), so this module sits below both the trainer and the bench and
imports neither; the child process is the only link.
"""
from __future__ import annotations

import csv
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time

from ..io.atomic import atomic_write
from ..runtime.cpus import core_cpus
from ..runtime.mpi import COMM_STATS_ENV

CHILD = "starpu_llm.bench"      # the module the child process runs (its __main__: run_one)


def peak_rss_mb() -> float:
    """This process's peak resident memory, MB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def run_sampling_rss(cmd, stdout, stderr, env=None, every: float = 0.005,
                     timeout: float | None = None, **popen) -> tuple[int, int]:
    """Run cmd to its end, sampling its resident memory from /proc every `every` seconds:
    (exit status, peak RSS in bytes), the largest of the VmRSS seen and of the VmHWM last
    read (the kernel's peak of the process since its exec; its ru_maxrss would also count the
    pages of the process it was forked from, those of a big parent). timeout: seconds after
    which it is killed (status -9); popen: more of subprocess.Popen's arguments (cwd, ...)."""
    p = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, env=env, **popen)
    peak = 0
    end = None if timeout is None else time.monotonic() + timeout
    while p.poll() is None:
        if end is not None and time.monotonic() > end:
            p.kill()
            p.wait()
            break
        try:
            with open(f"/proc/{p.pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f)
            peak = max(peak, *(int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM")))
        except (OSError, KeyError, ValueError):       # exiting
            pass
        time.sleep(every)
    return p.returncode, peak


def write_csv(path: str, rows: list[dict]) -> None:
    """rows as CSV at path, written atomically (nothing half-written)."""
    def write(f):
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["B"])
        w.writeheader()
        w.writerows(rows)

    atomic_write(path, write, text=True)


def cpu_description() -> str:
    model = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
        flags = ", ".join(x for x in ("avx512f", "avx2", "fma") if f" {x}" in text)
    except OSError:
        pass
    return f"{model} ({len(core_cpus())} cores usable; {flags})"


def mpi_rank() -> int:
    """This process's rank under mpirun (0 outside it), from the launcher's environment."""
    for var in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"):   # runtime/mpi.py's launchers
        if os.environ.get(var):
            return int(os.environ[var])
    return 0


def run_in_subprocess(spec: dict, env=None, python: str | None = None,
                      timeout: float | None = None) -> dict:
    """bench.run_one(spec) in a fresh Python process (StarPU starts once per process, and the
    peak RSS is then this configuration's own); on failure, spec with "error": the last
    stderr line.

    spec["cpus"] = c: the process (and its threads) may use only the first c of this
    process's cores. spec["ranks"] = R > 1: R processes under mpirun (extra launcher options
    in spec["mpirun_args"], a list), each given its share of those cores by the trainer's
    pinning (runtime.mpi.pin_rank); the result is rank 0's. python: the interpreter (default
    this one), e.g. another virtual environment's, whose starpu_llm (another build or commit)
    then runs; it starts outside any source tree, so it imports its own installed package.
    timeout: seconds, after which the child is ended with its process group (TERM, then KILL:
    _run_limited; mpirun ends its ranks) and the result's "error" says so (None: no limit)."""
    cmd = [python or sys.executable, "-m", CHILD, json.dumps(spec)]
    ranks = int(spec.get("ranks") or 1)
    if ranks > 1:
        mpirun = shutil.which("mpirun")
        if mpirun is None:
            return dict(spec, error="mpirun not found (install openmpi-bin)")
        cmd = [mpirun, "--oversubscribe", "--bind-to", "none", "-np", str(ranks),
               *spec.get("mpirun_args", []), *cmd]
        # StarPU-MPI's traffic counters on (the result's "traffic": bytes per step and rank)
        env = dict(env or os.environ, OMPI_ALLOW_RUN_AS_ROOT="1",
                   OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", **COMM_STATS_ENV)
    preexec = None
    if spec.get("cpus"):
        cpus = core_cpus()[:int(spec["cpus"])]
        preexec = lambda: os.sched_setaffinity(0, cpus)   # noqa: E731
    cwd = None if python is None else os.sep
    if timeout is not None:
        return _run_limited(cmd, spec, env, preexec, cwd, timeout)
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, preexec_fn=preexec, cwd=cwd)
    if p.returncode != 0:
        return dict(spec, error=(p.stderr.strip().splitlines() or ["failed"])[-1])
    return json.loads(p.stdout.strip().splitlines()[-1])


END_GRACE = 10.0     # seconds between a timed-out run's TERM and its KILL


def _run_limited(cmd, spec, env, preexec, cwd, timeout: float) -> dict:
    """run_in_subprocess's child with a time limit: in a session of its own, its process group
    sent TERM at the limit, then KILL END_GRACE s later. TERM first: mpirun puts each rank in
    a process group of its own, so only mpirun, on TERM, ends its ranks; killed outright it
    leaves them running (what still outlives it is the caller's: tools/device-lib.sh's
    sweep)."""
    import signal
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         preexec_fn=preexec, cwd=cwd, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        def signal_group(sig):
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        signal_group(signal.SIGTERM)
        try:
            p.communicate(timeout=END_GRACE)
        except subprocess.TimeoutExpired:
            signal_group(signal.SIGKILL)
            p.wait()        # not its pipes: a process outside the group may hold them
        return dict(spec, error=f"timed out after {timeout:.0f} s (killed)")
    if p.returncode != 0:
        return dict(spec, error=(err.strip().splitlines() or ["failed"])[-1])
    return json.loads(out.strip().splitlines()[-1])
