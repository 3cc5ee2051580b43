"""The StarPU runtime: partitions, threads and CPU affinity seen inside a task, start/stop."""
import os

import pytest

from starpu_llm import StarpuLLMError
from starpu_llm.runtime import Runtime, check_partition, max_starpu_cpus, usable_cores

CORES = usable_cores()


def bits(mask):
    return [c for c in range(64) if mask >> c & 1]


@pytest.mark.parametrize("workers,cores,kcore", [
    (1, CORES, "team"), (1, CORES, "forkjoin"), (CORES, 1, "team"), (1, 1, "team")])
def test_task_threads_and_affinity(workers, cores, kcore):
    """A task of a k-core worker runs a k-thread team, one thread per core, all distinct."""
    with Runtime(workers, cores, kcore=kcore) as rt:
        for _ in range(4):   # several tasks: whichever worker is master, the layout holds
            nthreads, masks = rt.probe()
            assert nthreads == cores
            assert all(len(bits(m)) == 1 for m in masks), [hex(m) for m in masks]
            owned = {bits(m)[0] for m in masks}
            assert len(owned) == cores            # tasks' threads never share a core
            assert owned <= set(os.sched_getaffinity(0))


def test_default_partition_uses_every_core():
    with Runtime() as rt:
        assert rt.workers * rt.cores_per_worker == min(CORES, max_starpu_cpus())


def test_restart_after_shutdown():
    for _ in range(2):
        rt = Runtime(1, 1)
        assert rt.running
        rt.shutdown()
        assert not rt.running


def test_only_one_runtime_per_process():
    with Runtime(1, 1):
        with pytest.raises(StarpuLLMError, match="already running"):
            Runtime(1, 1)


def test_partition_larger_than_starpu_build():
    cap = max_starpu_cpus()
    with pytest.raises(StarpuLLMError, match="STARPU_MAXCPUS"):
        check_partition(cap + 1, 1, oversubscribe=True)
    with pytest.raises(StarpuLLMError, match="STARPU_MAXCPUS"):
        check_partition(cap, 2, oversubscribe=True, kcore="forkjoin")
    # team workers: StarPU runs only N workers, the teams take the other cores
    check_partition(cap, 2, oversubscribe=True, kcore="team")


def test_partition_larger_than_machine_says_what_fits():
    if CORES + 1 > max_starpu_cpus():
        pytest.fail("needs a machine with fewer cores than STARPU_MAXCPUS")  # 2 cores here
    with pytest.raises(StarpuLLMError, match=r"partitions that fit: 1x"):
        check_partition(CORES + 1, 1)
    check_partition(CORES + 1, 1, oversubscribe=True)   # allowed explicitly


def test_zero_workers_rejected():
    with pytest.raises(StarpuLLMError, match="at least 1"):
        check_partition(0, 1)


def test_unknown_kcore_mode():
    with pytest.raises(StarpuLLMError, match="--kcore"):
        Runtime(1, 1, kcore="threads")
