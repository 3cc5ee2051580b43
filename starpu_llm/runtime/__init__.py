"""The runtime layer: StarPU started, partitioned and stopped (`starpu.py`, through the cffi
binding), the same through StarPU's own Python binding where it is installed
(`starpupy_face.py`), and the multi-process set-up for StarPU-MPI under mpirun (`mpi.py`)."""
from .starpu import (DEFAULT_KCORE, KCORE_MODES, MAX_GROUP, Runtime, check_partition,
                     default_partition, effective_kcore, max_starpu_cpus, partitions_that_fit,
                     read_trace, starpu_worker_count, usable_cores)

__all__ = ["DEFAULT_KCORE", "KCORE_MODES", "MAX_GROUP", "Runtime", "check_partition",
           "default_partition", "effective_kcore", "max_starpu_cpus", "partitions_that_fit",
           "read_trace", "starpu_worker_count", "usable_cores"]
