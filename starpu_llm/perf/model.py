"""The cost of one task on a worker of K cores (cores_per_worker), from its flop and byte
counts.

    t = a * flops / sgemm(K) + b * bytes / bandwidth(K, W) + c + task

sgemm(K) and bandwidth(K, W) are the machine's rates (machine.py: an sgemm on K cores, and
what one of W K-core workers streaming at once gets); a and b are the codelet's fitted
ratios to them (a = 1: the task runs at the sgemm rate; b = 1: at the stream rate), c its fixed
cost, task StarPU's cost per task. The ratios are what carry over to another machine: a
description of a cluster node gives its own rates and reuses this machine's ratios.

The reductions' methods: a per-worker copy is zeroed (bytes / zero rate) the first time a
worker adds into it in a step, and each copy is added into the gradient (3 bytes moved per
byte: read both, write one) before the gradient is read; across ranks a contribution is added
into its owner's gradient at the same rate and zeroed by a task of its own.
"""
from __future__ import annotations

from .machine import Machine


class CostModel:
    """Costs on `machine`; the codelets' ratios come from `calibration` (a calibrated
    Machine; default: machine itself)."""

    def __init__(self, machine: Machine, calibration: Machine | None = None):
        self.machine = machine
        self.calibration = calibration or machine
        if not self.calibration.codelets:
            raise ValueError("the calibration has no codelet costs: run starpu-llm calibrate")

    def coefficients(self, codelet: str, cores_per_worker: int):
        """(a, b, c seconds) of codelet on a worker of cores_per_worker cores: those fitted at
        that many, else at the largest calibrated worker size below it (the ratios of a wider
        sgemm are the machine's)."""
        c = self.calibration.codelets.get(codelet)
        if c is None:
            return 1.0, 1.0, 0.0
        sizes = sorted(c["a"])
        size = max([x for x in sizes if x <= cores_per_worker] or sizes[:1])
        return c["a"][size], c["b"][size], c["c_us"][size] * 1e-6

    def task(self, codelet: str, flops: float, nbytes: float, cores_per_worker: int,
             workers: int) -> float:
        """Seconds of one task of codelet on a worker of cores_per_worker cores among
        `workers` running at once."""
        m = self.machine
        a, b, c = self.coefficients(codelet, cores_per_worker)
        return (a * flops / m.sgemm(cores_per_worker)
                + b * nbytes / m.bandwidth(cores_per_worker, workers) + c + m.task_us * 1e-6)

    def zero(self, nbytes: float, task: bool = False) -> float:
        """Zeroing nbytes: inside the task that first adds into a copy, or as a task of its
        own (task=True: a contribution zeroed after it is sent)."""
        return nbytes / self.machine.zero_rate() + (self.machine.task_us * 1e-6 if task else 0.0)

    def add(self, nbytes: float) -> float:
        return 3 * nbytes / self.machine.add_rate() + self.machine.task_us * 1e-6

    def transfer(self, nbytes: float) -> float:
        m = self.machine
        return m.link_latency_us * 1e-6 + nbytes / (m.link_bandwidth_gbs * 1e9)
