"""This process's control groups: where a controller's files are for it (a container's, a
systemd unit's, a Slurm job's limits), read from /proc/self/cgroup, for offload's memory left
and mpi's allowed CPUs. The roots are module variables so that tests give a fake tree."""
from __future__ import annotations

import os

CGROUP, PROC_CGROUP = "/sys/fs/cgroup", "/proc/self/cgroup"


def controller_groups(controller: str) -> list[tuple[str, list[str]]]:
    """This process's groups of `controller` ("memory", "cpuset"), a (version, folders) per
    hierarchy: "v2" for the unified one (every controller in one tree at CGROUP; its line
    first), "v1" for the controller's own (CGROUP/controller); folders from the process's
    group up to the hierarchy's root, the group first (a container sees its own group at the
    root of a v1 hierarchy, not at the path named). [] where /proc/self/cgroup is unreadable."""
    try:
        with open(PROC_CGROUP) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    groups = []
    for line in lines:
        fields = line.split(":", 2)     # hierarchy-id:controllers:path; v2's controllers empty
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if not controllers:
            version, root = "v2", CGROUP
        elif controller in controllers.split(","):
            version, root = "v1", os.path.join(CGROUP, controller)
        else:
            continue
        parts = [p for p in path.strip().split("/") if p]
        groups.append((version, [os.path.join(root, *parts[:depth])
                                 for depth in range(len(parts), -1, -1)]))
    return sorted(groups, key=lambda g: g[0] != "v2")
