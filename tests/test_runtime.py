"""The StarPU runtime: partitions, threads and CPU affinity seen inside a task, start/stop."""
import os

import pytest

from starpu_llm import StarpuLLMError
from starpu_llm.errors import flag
from starpu_llm.runtime import Runtime, partitions_that_fit, usable_cores
from partitions import here

CORES = usable_cores()


def bits(mask):
    return [c for c in range(64) if mask >> c & 1]


# every partition of this machine that the StarPU build can run, and one core alone
@pytest.mark.parametrize("workers,cores,kcore",
                         list(dict.fromkeys(partitions_that_fit(CORES) + [(1, 1, "team")])))
def test_task_threads_and_affinity(workers, cores, kcore):
    """A task of a k-core worker runs a k-thread team, one thread per core, all distinct."""
    with Runtime(here(workers, cores, kcore=kcore)) as rt:
        for _ in range(4):   # several tasks: whichever worker is master, the layout holds
            nthreads, masks = rt.probe()
            assert nthreads == cores
            assert all(len(bits(m)) == 1 for m in masks), [hex(m) for m in masks]
            owned = {bits(m)[0] for m in masks}
            assert len(owned) == cores            # tasks' threads never share a core
            assert owned <= set(os.sched_getaffinity(0))


def test_default_partition_uses_every_core():
    with Runtime() as rt:
        assert rt.partition.cores == CORES == rt.partition.workers * rt.partition.cores_per_worker


def test_restart_after_shutdown():
    for _ in range(2):
        rt = Runtime(here(1, 1))
        assert rt.running
        rt.shutdown()
        assert not rt.running


def test_only_one_runtime_per_process():
    with Runtime(here(1, 1)):
        with pytest.raises(StarpuLLMError, match="already running"):
            Runtime(here(1, 1))


def test_unknown_kcore_mode():
    # the library names the setting as TrainConfig does; the CLI renders it as the flag
    with pytest.raises(StarpuLLMError, match="^kcore 'threads': choose one of") as e:
        Runtime(here(1, 1, kcore="threads"))
    assert e.value.render(flag).startswith("--kcore 'threads'")
