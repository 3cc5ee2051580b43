"""The StarPU runtime: partitions, threads and CPU affinity seen inside a task, start/stop."""
import hashlib
import os
from pathlib import Path

import pytest

from starpu_llm import StarpuLLMError
from starpu_llm._clib import ffi, lib
from starpu_llm.errors import flag
from starpu_llm.runtime import Runtime, cpus, partitions_that_fit, starpu, usable_cores
from partitions import here

CORES = usable_cores()
PATCHES = Path(__file__).resolve().parents[1] / "tools" / "patches"


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


@pytest.mark.skipif(CORES < 2, reason="a core other than the first")
def test_a_one_core_worker_runs_on_the_cores_the_process_may_use():
    """Under taskset (two servers on one machine, each given its own cores) the worker of a
    one-core partition was bound by StarPU to the machine's first core, outside the process's
    CPUs: two such servers both ran on core 0. It runs on the core the process may use."""
    allowed = os.sched_getaffinity(0)
    last = max(cpus.core_cpus())
    os.sched_setaffinity(0, {last})
    try:
        with Runtime(here(1, 1)) as rt:
            assert rt.partition.kcore == "single"
            for _ in range(4):
                nthreads, masks = rt.probe()
                assert [bits(m) for m in masks] == [[last]]
    finally:
        os.sched_setaffinity(0, allowed)

@pytest.mark.skipif(CORES < 2, reason="a team of 2 cores needs 2 usable cores")
def test_a_hand_set_workers_cpuid_places_each_team_on_its_cores(monkeypatch):
    """STARPU_WORKERS_CPUID set by hand (and by pin_rank under mpirun, to the rank's cores)
    with team workers: the list is the teams' cores in order, the worker on its team's first
    (StarPU read the variable before the explicit binding: the worker went to the list's
    w-th core, into its own or another team, and two threads shared a core)."""
    monkeypatch.setenv("SL_NO_PARALLEL_WORKERS", "1")    # team workers on StarPU 1.4 too
    # the list in StarPU's numbers (hwloc's logical), the threads' masks in the OS's
    first, second = cpus.cpu_indexes(sorted(os.sched_getaffinity(0))[:2])
    os_first, os_second = cpus.cpu_indexes([first, second], to_logical=False)
    monkeypatch.setenv("STARPU_WORKERS_CPUID", f"{second} {first}")
    with Runtime(here(1, 2, kcore="team")) as rt:
        for _ in range(4):
            nthreads, masks = rt.probe()
            assert nthreads == 2
            assert [bits(m) for m in masks] == [[os_second], [os_first]], [hex(m) for m in masks]
    assert os.environ["STARPU_WORKERS_CPUID"] == f"{second} {first}"      # put back
    # two workers of 2 cores (sharing these 2): each worker on its group's first core, the
    # list's entries 0 and 2, not 0 and 1
    monkeypatch.setenv("STARPU_WORKERS_CPUID", f"{first} {second} {first} {second}")
    with Runtime(here(2, 2, kcore="team", oversubscribe=True)) as rt:
        assert rt.worker_cores() == [first, first]
    # StarPU's own reading: one CPU a worker, its team the next ones
    monkeypatch.setenv("STARPU_WORKERS_CPUID", f"{first}")
    with Runtime(here(1, 2, kcore="team")) as rt:
        assert rt.worker_cores() == [first]
    # StarPU's syntax: spaces or commas, ranges, open ranges
    assert cpus.listed_cores("0-2 5") == cpus.listed_cores("0,1,2,5") == [0, 1, 2, 5]
    assert cpus.listed_cores(f"{CORES - 1}-") == [CORES - 1]
    monkeypatch.setenv("STARPU_WORKERS_CPUID", "a b")
    with pytest.raises(StarpuLLMError, match="STARPU_WORKERS_CPUID='a b': give CPU numbers"):
        Runtime(here(1, 2, kcore="team"))
    # neither one a worker nor every team's: teams would share cores (it cycled)
    monkeypatch.setenv("STARPU_WORKERS_CPUID", f"{first} {second} {first}")
    with pytest.raises(StarpuLLMError, match="lists 3 CPU.s. for 2 team worker.s. of 2 cores"):
        Runtime(here(2, 2, kcore="team", oversubscribe=True))


def test_cpu_numbers_go_to_starpu_in_hwlocs_logical_order(monkeypatch):
    """StarPU binds by hwloc's logical CPU index; the OS's numbers (sched_getaffinity) are
    converted both ways without loss, and every CPU worker is bound where the partition says,
    in StarPU's numbers: on a machine whose hyperthreads are numbered apart (OS 0-15 the
    first thread of each core, 16-31 the second) the OS's 0-15 passed as they are would be
    both threads of 8 cores."""
    mine = sorted(os.sched_getaffinity(0))
    logical = cpus.cpu_indexes(mine)
    assert sorted(logical) == sorted(set(logical)) and len(logical) == len(mine)
    assert cpus.cpu_indexes(logical, to_logical=False) == mine
    monkeypatch.setenv("SL_NO_PARALLEL_WORKERS", "1")    # team workers on StarPU 1.4 too
    if CORES >= 2:      # team workers of 2 (the binding this code gives StarPU) on half
        workers = max(1, CORES // 4)    # of the cores: all of them would be one set either way
        with Runtime(here(workers, 2, kcore="team")) as rt:
            assert rt.worker_cores() == logical[0:2 * workers:2]
            _, masks = rt.probe()
            assert {bits(m)[0] for m in masks} <= set(mine)


def fake_cores(root, siblings):
    """A sysfs of CPUs whose cores are `siblings` (lists of OS numbers)."""
    for group in siblings:
        for c in group:
            (root / f"cpu{c}" / "topology").mkdir(parents=True)
            (root / f"cpu{c}" / "topology" / "thread_siblings_list").write_text(
                ",".join(map(str, group)) + "\n")
    return str(root)


def test_cores_are_counted_once_whatever_their_hardware_threads(tmp_path, monkeypatch):
    """One worker, one team thread, one rank's share a core, not a hardware thread (StarPU
    counts and binds by core): on a machine of 4 cores x 2 threads numbered apart (OS 0-3 the
    first thread of each core, 4-7 the second), the partition's cores were 8 (a team of 8
    threads on 4 cores), and two ranks of the node got OS 0-3 and 4-7, the same 4 cores."""
    from starpu_llm.runtime import mpi
    apart = fake_cores(tmp_path / "apart", [[0, 4], [1, 5], [2, 6], [3, 7]])
    together = fake_cores(tmp_path / "together", [[0, 1], [2, 3], [4, 5], [6, 7]])
    monkeypatch.delenv("STARPU_NTHREADS_PER_CORE", raising=False)
    assert cpus.core_groups(range(8), apart) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert cpus.core_cpus(range(8), apart) == [0, 1, 2, 3]
    assert cpus.core_cpus(range(8), together) == [0, 2, 4, 6]
    assert cpus.core_cpus([5, 2, 6], apart) == [2, 5]          # a mask of some threads
    assert cpus.core_cpus([0, 1], tmp_path / "none") == [0, 1]  # siblings unknown: own cores
    monkeypatch.setenv("STARPU_NTHREADS_PER_CORE", "2")         # hyperthreads on purpose
    assert cpus.core_cpus(range(8), apart) == [0, 4, 1, 5, 2, 6, 3, 7]
    monkeypatch.setenv("STARPU_NTHREADS_PER_CORE", "two")
    with pytest.raises(StarpuLLMError, match="STARPU_NTHREADS_PER_CORE='two'"):
        cpus.core_cpus(range(8), apart)
    monkeypatch.delenv("STARPU_NTHREADS_PER_CORE")
    # this process as if on that machine: its cores, and two ranks' shares of the node
    monkeypatch.setattr(cpus, "SYSFS", apart)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert usable_cores() == 4
    set_to = []
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, mask: set_to.append(list(mask)))
    monkeypatch.setattr(cpus, "cpu_indexes", lambda ids, to_logical=True: list(ids))
    monkeypatch.setattr(cpus, "pinned", None)
    for var in (cpus.VARIABLE, "STARPU_MPI_THREAD_CPUID", "STARPU_RESERVE_NCPU"):
        monkeypatch.setenv(var, "")     # what pin_rank sets is taken back after the test
        monkeypatch.delenv(var)

    # rank 1 of 2 on one node, both allowed every CPU (no MPI started in this process:
    # StarPU 1.3 then crashes in its next start)
    monkeypatch.setattr(mpi, "local_rank_and_size", lambda comm: (1, 2))

    class Comm:
        def Get_rank(self): return 1
        def allgather(self, x): return [x, x]

    assert mpi.pin_rank(Comm()) == [2, 3]
    assert set_to == [[2, 6, 3, 7]]                     # whole cores: both their threads
    assert os.environ[cpus.VARIABLE] == "2 3" and os.environ["STARPU_MPI_THREAD_CPUID"] == "3"


def test_a_binding_to_a_thread_of_every_core_is_not_warned(tmp_path, monkeypatch):
    """mpirun --bind-to hwthread, one rank a core (4 ranks on 4 cores x 2 threads): the ranks
    have every core (the partition takes a core's first thread anyway), so nothing to warn
    of; it said "bound ... to 4 of the 4 cores they may use: give --bind-to none to use them
    all". A binding to fewer cores than allowed is still warned, in cores."""
    from starpu_llm.runtime import mpi
    monkeypatch.setattr(cpus, "SYSFS", fake_cores(tmp_path, [[0, 4], [1, 5], [2, 6], [3, 7]]))
    monkeypatch.setattr(mpi, "allowed_cpus", lambda: set(range(8)))
    warned = []
    mpi.say_if_bound([[0], [1], [2], [3]], warned.append)
    assert warned == []
    mpi.say_if_bound([[0, 4], [1, 5]], warned.append)           # a core each, of 4
    assert len(warned) == 1 and warned[0].startswith(
        "the launcher bound this node's 2 rank(s) to 2 of the 4 cores"), warned


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_a_controllers_cgroup_folders_and_the_cpus_they_allow(tmp_path, monkeypatch, version):
    """controller_groups reads /proc/self/cgroup once for offload's memory and mpi's cpuset:
    the unified hierarchy's groups first (v2: the line with no controllers, under the root),
    then the controller's own (v1: under root/controller, also where several controllers share
    a line), each from the process's group up to the root; other controllers' lines left out.
    allowed_cpus reads the first group's effective CPUs, v2's where it has them."""
    from starpu_llm.runtime import cgroups, mpi
    root = tmp_path / "sys"
    proc = tmp_path / "cgroup"
    proc.write_text("12:cpuset:/slurm/job_7\n4:cpu,cpuacct:/slurm/job_7\n"
                    "1:name=systemd:/user.slice/job.scope\n0::/user.slice/job.scope\n")
    monkeypatch.setattr(cgroups, "CGROUP", str(root))
    monkeypatch.setattr(cgroups, "PROC_CGROUP", str(proc))
    v2 = ("v2", [str(root / "user.slice" / "job.scope"), str(root / "user.slice"), str(root)])
    v1 = ("v1", [str(root / "cpuset" / "slurm" / "job_7"), str(root / "cpuset" / "slurm"),
                 str(root / "cpuset")])
    assert cgroups.controller_groups("cpuset") == [v2, v1]
    assert cgroups.controller_groups("cpuacct") == [
        v2, ("v1", [str(root / "cpuacct" / "slurm" / "job_7"), str(root / "cpuacct" / "slurm"),
                    str(root / "cpuacct")])]
    assert cgroups.controller_groups("memory") == [v2]
    assert mpi.allowed_cpus() is None                    # no cpuset file in either yet
    (root / "cpuset" / "slurm" / "job_7").mkdir(parents=True)
    (root / "cpuset" / "slurm" / "job_7" / "cpuset.effective_cpus").write_text("0-1,4\n")
    if version == "v2":
        (root / "user.slice" / "job.scope").mkdir(parents=True)
        (root / "user.slice" / "job.scope" / "cpuset.cpus.effective").write_text("2-3,5\n")
    assert mpi.allowed_cpus() == ({2, 3, 5} if version == "v2" else {0, 1, 4})
    monkeypatch.setattr(cgroups, "PROC_CGROUP", str(tmp_path / "none"))
    assert cgroups.controller_groups("cpuset") == [] and mpi.allowed_cpus() is None


@pytest.mark.parametrize("value", ["0", "-1", "3"])
def test_a_threads_per_core_starpu_cannot_take_is_one_error(tmp_path, monkeypatch, value):
    """STARPU_NTHREADS_PER_CORE below 1, or above the hardware threads of this machine's cores
    (2 on the fake sysfs), is refused before StarPU starts, as a word is: StarPU 1.3 aborts on
    it (starpu_get_env_number's assertion for a negative value; "Incorrect number of
    hyperthreads" in _starpu_initialize_workers_bindid for 0 or too many, with one core per
    worker). It was taken as 1 (or as many as a core has)."""
    apart = fake_cores(tmp_path, [[0, 4], [1, 5], [2, 6], [3, 7]])
    monkeypatch.setenv("STARPU_NTHREADS_PER_CORE", value)
    with pytest.raises(StarpuLLMError, match=f"STARPU_NTHREADS_PER_CORE='{value}'"):
        cpus.core_cpus(range(8), apart)
    monkeypatch.setenv("STARPU_NTHREADS_PER_CORE", "2")
    assert cpus.core_cpus(range(8), apart) == [0, 4, 1, 5, 2, 6, 3, 7]
    # where no core's siblings can be read, the threads a core has are not known: not refused
    monkeypatch.setenv("STARPU_NTHREADS_PER_CORE", "3")
    assert cpus.core_cpus([0, 1], tmp_path / "none") == [0, 1]


def test_a_workers_cpuid_naming_cpus_this_machine_lacks_is_one_error(monkeypatch):
    """A STARPU_WORKERS_CPUID from a bigger node (a job script copied): one error naming the
    variable, whatever the partition (StarPU 1.3 crashed with a segmentation fault)."""
    monkeypatch.setenv("STARPU_WORKERS_CPUID", f"0 {os.cpu_count()}")
    for shape, kcore in ((1, 1), None), *([((1, 2), "team")] if CORES >= 2 else []):
        with pytest.raises(StarpuLLMError, match=f"STARPU_WORKERS_CPUID='0 {os.cpu_count()}' "
                                                 f"names CPU {os.cpu_count()}"):
            Runtime(here(*shape, kcore=kcore))


def test_a_workers_cpuid_beyond_starpus_cpus_is_refused_on_a_bigger_host(monkeypatch):
    """StarPU numbers the CPUs of the topology it loads, hwloc's allowed ones: in a container
    or a Slurm job's cgroup those of its cpuset, fewer than os.cpu_count() (the host's). A
    list naming CPUs the job lacks is refused there too (it passed the host's count, and
    StarPU 1.3 segfaulted with team workers)."""
    out = ffi.new("int[]", 1)
    if lib.sl_cpu_indexes(ffi.new("int[]", [0]), out, 1, 0) != 0:
        pytest.skip("this build numbers CPUs without hwloc")
    pus = os.cpu_count()      # hwloc's PUs here (no cpuset narrows this machine's)
    monkeypatch.setattr(os, "cpu_count", lambda: 4 * pus)      # a host 4 times as big
    with pytest.raises(StarpuLLMError, match=f"STARPU_WORKERS_CPUID='0 {pus}' names CPU {pus}"
                                             f".* 0 to {pus - 1}"):
        cpus.check_listed(f"0 {pus}")
    cpus.check_listed(f"0-{pus - 1}")
    # "a-" runs to StarPU's last CPU, as StarPU reads it (nhwpus - 1), not the host's
    assert cpus.starpu_cpu_count() == pus
    assert cpus.listed_cores("0-") == list(range(pus))
    cpus.check_listed("0-")


def test_starpus_cpu_count_is_hwlocs_and_an_unloadable_topology_is_one_error(monkeypatch):
    """sl_cpu_count counts the PUs of the topology StarPU loads in one call (it was found by
    bisection over sl_cpu_indexes, a topology load a probe): the last logical index it gives
    is a CPU sl_cpu_indexes converts, the next one is not. A topology hwloc cannot load is one
    error naming the variable, not a RuntimeError or a count of 0."""
    import errno
    from starpu_llm import _clib
    n = cpus.starpu_cpu_count()
    if lib.sl_cpu_count() == -errno.ENOSYS:
        assert n == os.cpu_count()                  # StarPU numbers the OS's CPUs then
    else:
        assert lib.sl_cpu_count() == n >= 1
        out = ffi.new("int[]", 1)
        assert lib.sl_cpu_indexes(ffi.new("int[]", [n - 1]), out, 1, 0) == 0
        assert lib.sl_cpu_indexes(ffi.new("int[]", [n]), out, 1, 0) == -errno.EINVAL

    class NoTopology:
        def __getattr__(self, name):
            return getattr(lib, name)

        def sl_cpu_count(self):
            return -errno.ENODEV
    monkeypatch.setattr(_clib, "lib", NoTopology())
    for call in cpus.starpu_cpu_count, lambda: cpus.check_listed("0"):
        with pytest.raises(StarpuLLMError, match="STARPU_WORKERS_CPUID cannot be checked: "
                                                 "hwloc.*could not load .*ENODEV.*lstopo"):
            call()


def test_default_partition_uses_every_core():
    with Runtime() as rt:
        assert rt.partition.cores == CORES == rt.partition.workers * rt.partition.cores_per_worker


def test_restart_after_shutdown():
    for _ in range(2):
        rt = Runtime(here(1, 1))
        assert rt.running
        rt.shutdown()
        assert not rt.running


def test_shutdown_says_0_when_its_wait_and_stop_succeed():
    # sl_shutdown returns the error of its wait or of StarPU-MPI's shutdown, 0 without one
    rt = Runtime(here(1, 1))
    try:
        assert lib.sl_shutdown() == 0
        assert lib.sl_shutdown() == 0       # stopped already: nothing to do
    finally:
        rt.shutdown()
    assert not rt.running


def test_a_failed_shutdown_is_an_error_or_a_warning_that_never_masks_another(monkeypatch,
                                                                            capsys):
    """sl_shutdown's error (its last wait for the tasks, StarPU-MPI's stop) was dropped. StarPU
    is stopped whatever it says (the next Runtime starts); the failure is a RuntimeError from a
    plain shutdown, and a warning where another exception is on its way (a `with` block left by
    it, a shutdown in an except block: that one comes out) and at exit."""
    import errno

    class FailingShutdown:      # the binding, its shutdown stopping StarPU and failing
        def __getattr__(self, name):
            return getattr(lib, name)

        def sl_shutdown(self):
            lib.sl_shutdown()
            return -errno.EIO
    monkeypatch.setattr(starpu, "lib", FailingShutdown())
    failed = r"stopping StarPU: its wait for the last tasks or StarPU-MPI's shutdown failed \(-5\)"

    rt = Runtime(here(1, 1))
    with pytest.raises(RuntimeError, match=failed):
        rt.shutdown()
    assert not rt.running
    rt.shutdown()                                   # stopped already: nothing to say
    assert capsys.readouterr().err == ""

    with pytest.raises(ValueError, match="the error to see"):
        with Runtime(here(1, 1)):
            raise ValueError("the error to see")
    rt = Runtime(here(1, 1))
    try:
        raise KeyError("an error path")
    except KeyError:
        rt.shutdown()
    rt = Runtime(here(1, 1))
    rt._stop_at_exit()
    warnings = capsys.readouterr().err.splitlines()
    assert len(warnings) == 3 and all(w.startswith("warning: stopping StarPU") for w in warnings)
    assert not rt.running and Runtime._active is None


def test_only_one_runtime_per_process():
    with Runtime(here(1, 1)):
        with pytest.raises(StarpuLLMError, match="already running"):
            Runtime(here(1, 1))


def test_unknown_kcore_mode():
    # the library names the setting as TrainConfig does; the CLI renders it as the flag
    with pytest.raises(StarpuLLMError, match="^kcore 'threads': choose one of") as e:
        Runtime(here(1, 1, kcore="threads"))
    assert e.value.render(flag).startswith("--kcore 'threads'")


def test_the_fix_mark_is_found_where_the_library_has_it():
    # tools/patches/starpu-1.4.12-ws-no-self-steal.patch leaves a mark in libstarpu that
    # sl_starpu_ws_fixed finds through a weak reference: present where the library loaded was
    # built by tools/build-starpu.sh with today's patch (its prefix's stamp records the patch's
    # sha256: make test-1.4, make cuda), absent elsewhere (Debian's 1.3.10, a site's module)
    library = ffi.string(lib.sl_starpu_library()).decode()
    assert os.path.basename(library).startswith("libstarpu-1."), library
    patch = PATCHES / "starpu-1.4.12-ws-no-self-steal.patch"
    fix = f"{patch.name} {hashlib.sha256(patch.read_bytes()).hexdigest()}"
    stamp = Path(library).resolve().parents[1] / ".build-starpu.stamp"
    built_here = stamp.is_file() and fix in stamp.read_text().splitlines()
    assert bool(lib.sl_starpu_ws_fixed()) == built_here, (library, built_here)


@pytest.mark.skipif(CORES < 2, reason="a 2-core worker needs 2 cores")
def test_parallel_workers_only_with_the_fix_and_their_absence_said_once(monkeypatch, capsys):
    # a library without the fix: K-core tasks on team workers, said once a process on stderr
    monkeypatch.setattr(starpu, "_said_off", False)
    monkeypatch.setattr(starpu, "parallel_workers_here", lambda: (False, "WHY"))
    assert not starpu.this_build().parallel_workers
    assert here(1, 2).kcore == "team"
    for _ in range(2):
        with Runtime(here(1, 2)):
            pass
    err = capsys.readouterr().err
    assert err.count("warning: StarPU's parallel workers are off: WHY; the 2-core tasks run "
                     "on team workers instead") == 1, err
    # with it (resolved only: Debian's StarPU has none to start), the same request takes them
    monkeypatch.setattr(starpu, "parallel_workers_here", lambda: (True, ""))
    assert starpu.this_build().parallel_workers and here(1, 2).kcore == "parallel-workers"
    # off by the user's own choice: nothing to say
    monkeypatch.setattr(starpu, "_said_off", False)
    monkeypatch.setattr(starpu, "parallel_workers_here", lambda: (False, ""))
    with Runtime(here(1, 2)):
        pass
    assert "parallel workers" not in capsys.readouterr().err
