"""The tests' short way to the resolved partition a Runtime starts (runtime.resolve_here)."""
from dataclasses import replace

from starpu_llm.plan.partition import PartitionRequest
from starpu_llm.runtime import resolve_here


def here(workers=None, cores_per_worker=None, comm=None, **request):
    """The partition of N workers x K cores (and the other PartitionRequest fields given)
    resolved on this process (on comm's ranks)."""
    return resolve_here(PartitionRequest(workers=workers, cores_per_worker=cores_per_worker,
                                         **request),
                        comm.Get_size() if comm is not None else 1)


def subs(runtime, sub_batches=None, **fields):
    """The runtime's partition with `sub_batches` (None: the default for the batch, decided
    by the engine's partition.with_batch) and the other fields given."""
    return replace(runtime.partition, sub_batches=sub_batches or 0, **fields)
