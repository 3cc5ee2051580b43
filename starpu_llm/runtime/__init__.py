"""The runtime layer: StarPU started, partitioned and stopped (`starpu.py`, through the cffi
binding), the same through StarPU's own Python binding where it is installed
(`starpupy_face.py`), and the multi-process set-up for StarPU-MPI under mpirun (`mpi.py`)."""
from .starpu import (Runtime, have_cuda, max_starpu_cpus, partitions_that_fit, read_trace,
                     resolve_here, this_build, usable_cores)

__all__ = ["Runtime", "have_cuda", "max_starpu_cpus", "partitions_that_fit", "read_trace",
           "resolve_here", "this_build", "usable_cores"]
