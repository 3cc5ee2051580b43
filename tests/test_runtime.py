"""The StarPU runtime: partitions, threads and CPU affinity seen inside a task, start/stop."""
import os

import pytest

from starpu_llm import StarpuLLMError
from starpu_llm.errors import flag
from starpu_llm.runtime import starpu as runtime
from starpu_llm.runtime import (MAX_GROUP, Runtime, check_partition, default_partition,
                                max_starpu_cpus, partitions_that_fit, usable_cores)

CORES = usable_cores()


def bits(mask):
    return [c for c in range(64) if mask >> c & 1]


# every partition of this machine that the StarPU build can run, and one core alone
@pytest.mark.parametrize("workers,cores,kcore",
                         list(dict.fromkeys(partitions_that_fit(CORES) + [(1, 1, "team")])))
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
        assert rt.workers * rt.cores_per_worker == CORES


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


def test_partition_larger_than_machine_says_what_fits(monkeypatch):
    # a test double of the core count: a 1-core process, whatever this machine has
    monkeypatch.setattr(runtime, "usable_cores", lambda: 1)
    with pytest.raises(StarpuLLMError, match=r"can use 1; partitions that fit: 1x1 "):
        check_partition(1, 2)
    check_partition(1, 2, oversubscribe=True)   # allowed explicitly


@pytest.mark.parametrize("fake_cores", [1, 2, 3, max_starpu_cpus() + 2, 2 * max_starpu_cpus(), 36])
def test_partitions_that_fit_are_accepted(monkeypatch, fake_cores):
    """On any core count, including more cores than the build's STARPU_MAXCPUS (a test double
    of the core count): the default partition and every partition offered as fitting are
    accepted by the partition check, and a machine-sized N x 1 beyond the cap is refused
    with the cap named."""
    monkeypatch.setattr(runtime, "usable_cores", lambda: fake_cores)
    fits = partitions_that_fit()
    assert fits and all(n * k == fake_cores for n, k, _ in fits)
    for n, k, mode in fits:
        check_partition(n, k, kcore=mode)
    if fake_cores <= MAX_GROUP:
        assert default_partition() == (1, fake_cores)
        check_partition(*default_partition())
    if fake_cores > max_starpu_cpus():
        assert (fake_cores, 1, "team") not in fits
        with pytest.raises(StarpuLLMError, match="STARPU_MAXCPUS"):
            check_partition(fake_cores, 1)


def test_zero_workers_rejected():
    with pytest.raises(StarpuLLMError, match="at least 1"):
        check_partition(0, 1)


def test_unknown_kcore_mode():
    # the library names the setting as TrainConfig does; the CLI renders it as the flag
    with pytest.raises(StarpuLLMError, match="^kcore 'threads': choose one of") as e:
        Runtime(1, 1, kcore="threads")
    assert e.value.render(flag).startswith("--kcore 'threads'")
