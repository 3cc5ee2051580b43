#!/usr/bin/env python3
"""Which CPUs tools/device-eval16.sh runs the node's evaluation on (issue 42), and what to say
about them first: one hardware thread of each of the node's first --node-cores cores, the
cores as starpu-llm counts them (runtime.cpus.core_cpus: a worker a core). The device
machine's 16 CPUs were 16 cores of one thread each on the H200 machine seen; a machine of
2 threads a core numbered side by side (0-1 one core) cut to CPUs 0-15 would be 8 cores, and
one of 8 cores x 2 threads has 8 for a plan made for 16.

    python experiments/node_cores.py --node-cores 16

Prints the CPUs to give `taskset -c` (comma-separated, the OS's numbers) on the first line and
the line for 00-status.txt on the second."""
from __future__ import annotations

import argparse
import os

from starpu_llm.runtime.cpus import core_cpus


def node_cpus(node_cores: int, cpus=None, sysfs: str | None = None) -> tuple[list[int], str]:
    """(the first hardware thread of each of the first node_cores cores among cpus (this
    process's by default), the status line: cores against CPUs, and what to do when there are
    fewer cores than the plan's)."""
    shown = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    cores = core_cpus(shown, sysfs)
    use = cores[:node_cores]
    line = (f"cores: {len(cores)} (one a core, of {len(shown)} CPUs); the runs on CPUs "
            f"{','.join(map(str, use))}")
    if len(cores) < node_cores:
        line += (f" -- FEWER THAN THE PLAN'S {node_cores}: its {node_cores}-core points and "
                 f"the calibration on {node_cores}-core partitions cannot run; for this "
                 f"machine give EVAL_NODE_CORES={len(cores)} and EVAL_CAL_PARTITIONS, "
                 f"EVAL_CORE_COUNTS of {len(cores)} cores"
                 + (", or STARPU_NTHREADS_PER_CORE=2 to count hardware threads as cores"
                    if len(shown) > len(cores) else ""))
    return use, line


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--node-cores", type=int, required=True,
                    help="the cores the plan is for (EVAL_NODE_CORES)")
    args = ap.parse_args()
    if args.node_cores < 1:
        ap.error("--node-cores: at least 1")
    use, line = node_cpus(args.node_cores)
    print(",".join(map(str, use)))
    print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
