"""A machine as the performance model sees it, in a readable TOML file.

[machine]   what it is: name, cores (usable by one process), source (where the figures come from)
[rates]     sgemm_gflops: GFLOP/s of one sgemm on k cores, for k = 1, 2, ... (a list; entry
            k-1 is k cores; missing k are extrapolated from the last one, linearly per core);
            bandwidth_gbs: GB/s that k cores together stream (same layout);
            first_touch_gbs: GB/s at which k cores write memory the process was just given
            (the kernel maps and zeroes each page; same layout; optional, [] if unmeasured)
[starpu]    task_us: StarPU's cost per task (submission to start, µs); step_ms: a step's fixed
            cost outside the tasks (the Python driver's submission and wait)
[link]      latency_us, bandwidth_gbs: one MPI message between two processes (two nodes);
            a calibration fits bandwidth_gbs to a StarPU-MPI training run (what StarPU-MPI gets
            of the link during a step) and keeps the raw MPI ping-pong's as pingpong_gbs
[reduction] zero_gbs, add_gbs: the rate of a reduction's init (zeroing a copy) and sum
[disk]      write_gbs, read_gbs: the sequential bandwidth of the disk --memory-limit evicts to
            (the system's temporary folder's; calibrate.measure_disk); 0: not measured
[codelets.NAME]  the fitted cost of each task type (calibrate.py): per core count k,
            a[k], b[k], c_us[k] in  t = a flops / sgemm(k) + b bytes / bandwidth + c_us

A calibration (starpu-llm calibrate) writes one of these for this machine; a description of
another machine (starpu-llm predict --machine FILE, e.g. experiments/machines/) may give
[machine], [rates], [starpu] and [link] only: its codelets' costs then come from this machine's
calibration, rescaled to its rates (the a and b factors are ratios to the machine's own rates,
so they carry over; see model.py).
"""
from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field

from ..errors import StarpuLLMError


@dataclass
class Machine:
    name: str
    cores: int
    sgemm_gflops: list          # entry k-1: k cores
    bandwidth_gbs: list         # entry k-1: k cores streaming together
    first_touch_gbs: list = field(default_factory=list)   # entry k-1: k cores; [] unmeasured
    task_us: float = 5.0
    step_ms: float = 0.0
    link_latency_us: float = 2.0
    link_bandwidth_gbs: float = 10.0
    link_pingpong_gbs: float = 0.0     # the raw MPI ping-pong's (information only)
    zero_gbs: float = 0.0       # 0: the bandwidth of one core
    add_gbs: float = 0.0
    disk_write_gbs: float = 0.0     # the disk --memory-limit evicts to (0: not measured)
    disk_read_gbs: float = 0.0
    source: str = ""
    # name -> {"a": {cores_per_worker: ..}, "b": .., "c_us": ..}: each ratio by worker size
    codelets: dict = field(default_factory=dict)

    @staticmethod
    def _per_core(table: list, cores: int) -> float:
        """table's value on `cores` cores (beyond the table: extrapolated from its last step)."""
        if cores <= len(table):
            return float(table[cores - 1])
        if len(table) == 1:
            return float(table[0]) * cores
        step = float(table[-1]) - float(table[-2])
        return float(table[-1]) + step * (cores - len(table))

    def sgemm(self, cores: int) -> float:
        """FLOP/s of an sgemm on `cores` cores."""
        return self._per_core(self.sgemm_gflops, cores) * 1e9

    def bandwidth(self, cores_per_worker: int, workers: int = 1) -> float:
        """Bytes/s of one worker of cores_per_worker cores while `workers` such workers
        stream at once."""
        alone = self._per_core(self.bandwidth_gbs, cores_per_worker)
        shared = self._per_core(self.bandwidth_gbs, min(cores_per_worker * workers,
                                                        max(self.cores, cores_per_worker))) / workers
        return min(alone, shared) * 1e9

    def first_touch(self, cores_per_worker: int) -> float:
        """Bytes/s at which a task of cores_per_worker cores writes new memory (0: not
        measured)."""
        return (self._per_core(self.first_touch_gbs, cores_per_worker) * 1e9
                if self.first_touch_gbs else 0.0)

    def zero_rate(self) -> float:
        return (self.zero_gbs or self._per_core(self.bandwidth_gbs, 1)) * 1e9

    def add_rate(self) -> float:
        return (self.add_gbs or self._per_core(self.bandwidth_gbs, 1)) * 1e9


def _fmt(v) -> str:
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def dumps(m: Machine) -> str:
    out = ["# starpu-llm machine description (starpu_llm/perf/machine.py says what each key is)",
           "[machine]", f"name = {_fmt(m.name)}", f"cores = {m.cores}", f"source = {_fmt(m.source)}",
           "", "[rates]", f"sgemm_gflops = {_fmt([float(x) for x in m.sgemm_gflops])}",
           f"bandwidth_gbs = {_fmt([float(x) for x in m.bandwidth_gbs])}",
           *([f"first_touch_gbs = {_fmt([float(x) for x in m.first_touch_gbs])}"]
             if m.first_touch_gbs else []),
           "", "[starpu]", f"task_us = {_fmt(float(m.task_us))}", f"step_ms = {_fmt(float(m.step_ms))}",
           "", "[link]", f"latency_us = {_fmt(float(m.link_latency_us))}",
           f"bandwidth_gbs = {_fmt(float(m.link_bandwidth_gbs))}",
           *([f"pingpong_gbs = {_fmt(float(m.link_pingpong_gbs))}"] if m.link_pingpong_gbs else []),
           "", "[reduction]", f"zero_gbs = {_fmt(float(m.zero_gbs))}", f"add_gbs = {_fmt(float(m.add_gbs))}",
           "", "[disk]", f"write_gbs = {_fmt(float(m.disk_write_gbs))}",
           f"read_gbs = {_fmt(float(m.disk_read_gbs))}"]
    for name in sorted(m.codelets):
        c = m.codelets[name]
        out += ["", f"[codelets.{name}]"]
        for key in ("a", "b", "c_us", "samples", "rel_err", "total_err"):
            if key in c:
                out.append(f"{key} = {{ " + ", ".join(f'"{k}" = {_fmt(float(v))}'
                                                      for k, v in sorted(c[key].items())) + " }")
    return "\n".join(out) + "\n"


def loads(text: str, path: str = "<machine>") -> Machine:
    try:
        d = tomllib.loads(text)
        mach, rates = d["machine"], d["rates"]
        starpu, link, red = d.get("starpu", {}), d.get("link", {}), d.get("reduction", {})
        disk = d.get("disk", {})
        codelets = {name: {key: {int(k): float(v) for k, v in table.items()}
                           for key, table in c.items()}
                    for name, c in d.get("codelets", {}).items()}
        m = Machine(name=str(mach["name"]), cores=int(mach["cores"]),
                    sgemm_gflops=[float(x) for x in rates["sgemm_gflops"]],
                    bandwidth_gbs=[float(x) for x in rates["bandwidth_gbs"]],
                    first_touch_gbs=[float(x) for x in rates.get("first_touch_gbs", [])],
                    task_us=float(starpu.get("task_us", 5.0)), step_ms=float(starpu.get("step_ms", 0.0)),
                    link_latency_us=float(link.get("latency_us", 2.0)),
                    link_bandwidth_gbs=float(link.get("bandwidth_gbs", 10.0)),
                    link_pingpong_gbs=float(link.get("pingpong_gbs", 0.0)),
                    zero_gbs=float(red.get("zero_gbs", 0.0)), add_gbs=float(red.get("add_gbs", 0.0)),
                    disk_write_gbs=float(disk.get("write_gbs", 0.0)),
                    disk_read_gbs=float(disk.get("read_gbs", 0.0)),
                    source=str(mach.get("source", "")), codelets=codelets)
    except (tomllib.TOMLDecodeError, KeyError, TypeError, ValueError) as e:
        raise StarpuLLMError(f"{path}: not a machine description ({type(e).__name__}: {e}); "
                             "see starpu_llm/perf/machine.py for its keys, or run starpu-llm calibrate")
    if m.cores < 1 or not m.sgemm_gflops or not m.bandwidth_gbs or \
            min(m.sgemm_gflops + m.bandwidth_gbs) <= 0:
        raise StarpuLLMError(f"{path}: cores, sgemm_gflops and bandwidth_gbs must be positive")
    return m


def load(path: str) -> Machine:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise StarpuLLMError(f"{path}: cannot read the machine description ({e.strerror})")
    except UnicodeDecodeError as e:
        raise StarpuLLMError(f"{path}: not a machine description (not UTF-8 text: byte "
                             f"{e.start}); give a TOML file as docs/perfmodel.md describes (\"What-if: "
                             f"the paper's node\"; examples in the source's experiments/machines/), "
                             f"or run starpu-llm calibrate")
    return loads(text, path)


def is_machine_file(path: str) -> bool:
    """a machine description"""
    try:
        load(path)
    except StarpuLLMError:
        return False
    return True


def save(m: Machine, path: str) -> None:
    from ..io.atomic import atomic_write
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write(path, lambda f: f.write(dumps(m)), text=True)


def default_path() -> str:
    """Where this machine's calibration lives: $STARPU_LLM_HOME, else ~/.cache/starpu-llm,
    one file per host name."""
    base = os.environ.get("STARPU_LLM_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "starpu-llm")
    return os.path.join(base, f"machine-{os.uname().nodename}.toml")
