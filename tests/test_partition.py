"""The partition decided in one place (starpu_llm/plan/partition.py): resolve() is a pure function
of the request, the cores, the ranks and the StarPU build, so these tests give it any machine
(no test double of the process): defaults, the mechanism that gives a task its cores, every
rule's error, and a recorded partition asked for again giving the same partition."""
from dataclasses import replace

import pytest

from starpu_llm import StarpuLLMError
from starpu_llm.errors import flag
from starpu_llm.plan.partition import (Build, PartitionRequest, partitions_that_fit, request_of, resolve, scheduler)

DEBIAN = Build(max_cpus=4, parallel_workers=False)          # StarPU 1.3.10 as Debian has it
CLUSTER = Build(max_cpus=64, parallel_workers=True)         # a StarPU 1.4 module
GPU = Build(max_cpus=64, parallel_workers=True, cuda=True)


def test_the_default_is_one_worker_on_every_core():
    for build, cores in ((DEBIAN, 2), (DEBIAN, 4), (CLUSTER, 36)):
        p = resolve(PartitionRequest(), cores=cores, build=build, batch=8)
        assert (p.workers, p.cores_per_worker, p.sub_batches, p.ranks) == (1, cores, 1, 1)
    assert resolve(PartitionRequest(), cores=2, build=DEBIAN).kcore == "team"
    assert resolve(PartitionRequest(), cores=36, build=CLUSTER).kcore == "parallel-workers"
    assert resolve(PartitionRequest(workers=2), cores=2, build=DEBIAN).kcore == "single"


def test_the_mechanism():
    """Parallel workers where the build has them and they can run the partition: not
    oversubscribed, not under a memory limit, not beyond STARPU_MAXCPUS; team workers with
    GPUs; else what is asked."""
    def mechanism(build, cores, **ask):
        return resolve(PartitionRequest(**ask), cores=cores, build=build).kcore
    assert mechanism(CLUSTER, 8, workers=2) == "parallel-workers"
    assert mechanism(CLUSTER, 4, workers=2, cores_per_worker=4, oversubscribe=True) == "team"
    assert mechanism(CLUSTER, 8, workers=2, kcore="forkjoin", oversubscribe=True,
                     cores_per_worker=8) == "forkjoin"
    assert resolve(PartitionRequest(workers=2), cores=8, build=CLUSTER,
                   memory_limit=True).kcore == "team"
    assert mechanism(GPU, 8, workers=1, cores_per_worker=4, gpus=1) == "team"
    assert mechanism(DEBIAN, 2, kcore="forkjoin") == "forkjoin"


def test_gpus_take_a_core_each_and_need_a_cuda_build():
    p = resolve(PartitionRequest(gpus=1), cores=8, build=GPU, batch=8)
    assert (p.workers, p.cores_per_worker, p.gpus, p.gpu_matmul, p.sub_batches) == (1, 7, 1, "tf32", 1)
    with pytest.raises(StarpuLLMError, match="CPU build"):
        resolve(PartitionRequest(gpus=1), cores=8, build=CLUSTER)
    # under MPI each rank its GPUs beside its workers (runtime.starpu.rank_cuda_devices)
    mpi = resolve(PartitionRequest(gpus=1), cores=8, build=GPU, ranks=2, batch=8)
    assert (mpi.ranks, mpi.gpus, mpi.workers, mpi.cores_per_worker, mpi.ownership) == (
        2, 1, 1, 7, "sharded")
    assert "+ 1 GPU(s) (TF32 matmuls)" in mpi.describe() and "2 MPI processes" in mpi.describe()
    with pytest.raises(StarpuLLMError, match="memory_limit: not supported yet"):
        resolve(PartitionRequest(gpus=1), cores=8, build=GPU, memory_limit=True)
    with pytest.raises(StarpuLLMError, match="can use 8"):
        resolve(PartitionRequest(workers=1, cores_per_worker=8, gpus=1), cores=8, build=GPU)


def test_each_rule_says_what_to_do():
    with pytest.raises(StarpuLLMError, match="STARPU_MAXCPUS"):
        resolve(PartitionRequest(workers=5, cores_per_worker=1, oversubscribe=True), cores=2,
                build=DEBIAN)
    with pytest.raises(StarpuLLMError, match="STARPU_MAXCPUS.*or kcore team"):
        resolve(PartitionRequest(workers=4, cores_per_worker=2, kcore="forkjoin",
                                 oversubscribe=True), cores=8, build=DEBIAN)
    # team workers: StarPU runs only N workers, the teams take the other cores
    assert resolve(PartitionRequest(workers=4, cores_per_worker=2), cores=8,
                   build=DEBIAN).starpu_workers == 4
    with pytest.raises(StarpuLLMError, match=r"can use 1; partitions that fit: 1x1 "):
        resolve(PartitionRequest(workers=1, cores_per_worker=2), cores=1, build=DEBIAN)
    assert resolve(PartitionRequest(workers=1, cores_per_worker=2, oversubscribe=True),
                   cores=1, build=DEBIAN).cores_per_worker == 2
    # the fields' own rules (plan/settings.check_fields), resolve's first check and its only
    with pytest.raises(StarpuLLMError, match="^workers must be at least 1, or auto, got 0$"):
        resolve(PartitionRequest(workers=0), cores=2, build=DEBIAN)
    with pytest.raises(StarpuLLMError, match="^cores_per_worker must be at least 1, got 0$"):
        resolve(PartitionRequest(cores_per_worker=0), cores=2, build=DEBIAN)
    with pytest.raises(StarpuLLMError, match="above 64"):
        resolve(PartitionRequest(cores_per_worker=65, oversubscribe=True), cores=2, build=CLUSTER)
    with pytest.raises(StarpuLLMError, match="^kcore 'threads': choose one of") as e:
        resolve(PartitionRequest(kcore="threads"), cores=2, build=DEBIAN)
    assert e.value.render(flag).startswith("--kcore 'threads'")
    with pytest.raises(StarpuLLMError, match="FORKJOIN"):
        resolve(PartitionRequest(kcore="forkjoin"), cores=2, build=DEBIAN, memory_limit=True)


@pytest.mark.parametrize("cores", [1, 2, 3, 6, 8, 36])
@pytest.mark.parametrize("build", [DEBIAN, CLUSTER], ids=["1.3", "1.4"])
def test_every_partition_offered_as_fitting_resolves(cores, build):
    fits = partitions_that_fit(cores, build)
    assert fits and all(n * k == cores for n, k, _ in fits)
    for n, k, mode in fits:
        p = resolve(PartitionRequest(workers=n, cores_per_worker=k, kcore=mode), cores=cores,
                    build=build)
        assert (p.workers, p.cores_per_worker) == (n, k)
    if cores > build.max_cpus:
        assert (cores, 1, "team") not in fits


@pytest.mark.parametrize("build", [DEBIAN, CLUSTER], ids=["1.3", "1.4"])
def test_every_partition_is_offered_once(build):
    """Two requests that resolve to one partition (team and forkjoin where parallel workers
    take both, StarPU 1.4) are offered once: a figure or a sweep does not measure one
    partition twice under two labels."""
    fits = partitions_that_fit(4, build)
    resolved = [resolve(PartitionRequest(workers=n, cores_per_worker=k, kcore=mode), cores=4,
                        build=build) for n, k, mode in fits]
    assert len(set(resolved)) == len(resolved), fits
    assert any(k > 1 and mode == "forkjoin" for _, k, mode in fits) == (build is DEBIAN)


def test_sub_batches_and_ranks():
    """One sub-batch per worker (per GPU with GPUs), a pipeline's 2 S N micro-batches when
    they divide its copy's batch; ownership sharded across ranks, rank0 alone."""
    p = resolve(PartitionRequest(workers=2), cores=2, build=DEBIAN, batch=8)
    assert (p.sub_batches, p.ownership) == (2, "rank0")
    p = resolve(PartitionRequest(workers=1, cores_per_worker=1), cores=1, build=DEBIAN, ranks=4,
                batch=16)
    assert (p.ranks, p.ownership, p.sub_batches) == (4, "sharded", 1)
    p = resolve(PartitionRequest(pipeline_stages=2), cores=1, build=DEBIAN, ranks=2, batch=16)
    assert (p.stages, p.sub_batches) == (2, 4)
    p = resolve(PartitionRequest(gpus=2, workers=1), cores=8, build=GPU, batch=8)
    assert p.sub_batches == 2
    assert resolve(PartitionRequest(threads=3, sub_batches=2), cores=4, build=DEBIAN,
                   engine="reference").describe() == \
        "reference engine, 3 thread(s), 2 sub-batch(es), gemm attention"


@pytest.mark.parametrize("req,engine,says", [
    (PartitionRequest(threads=100000), "reference", "threads 100000 is above the 4 cores"),
    (PartitionRequest(workers=2), "reference", "workers is the StarPU engine's"),
    (PartitionRequest(cores_per_worker=2), "reference", "cores_per_worker is the StarPU"),
    (PartitionRequest(threads=2), "starpu", "threads sets the reference engine's threads"),
])
def test_each_engines_settings_stay_its_own(req, engine, says):
    """A setting of the other engine, or more threads than cores (libgomp failed creating
    40000, 100000 crashed), is one clear error, not ignored; --oversubscribe lets a test share
    cores."""
    with pytest.raises(StarpuLLMError, match=says):
        resolve(req, cores=4, build=DEBIAN, engine=engine)
    assert resolve(PartitionRequest(threads=8, oversubscribe=True), cores=4, build=DEBIAN,
                   engine="reference").cores_per_worker == 8


@pytest.mark.parametrize("build, cores, ask, ranks", [
    (DEBIAN, 2, {}, 1), (DEBIAN, 2, dict(workers=2), 1), (DEBIAN, 2, dict(kcore="forkjoin"), 1),
    (CLUSTER, 16, dict(workers=4), 1), (CLUSTER, 4, dict(ownership="rank0"), 2),
    (CLUSTER, 4, dict(pipeline_stages=2, sub_batches=3), 2), (GPU, 8, dict(gpus=1), 1),
    (CLUSTER, 4, dict(pipeline_stages=2, pipeline_schedule="1f1b", sched="dmda"), 2)])
def test_a_recorded_partition_asked_for_again_is_the_same(build, cores, ask, ranks):
    p = resolve(PartitionRequest(**ask), cores=cores, build=build, ranks=ranks, batch=24)
    again = request_of(p)
    assert again.given()
    assert resolve(again, cores=cores, build=build, ranks=ranks, batch=24) == p


def test_what_counts_as_given_and_the_scheduler():
    assert not PartitionRequest(sched="eager", pipeline_schedule="1f1b").given()
    assert PartitionRequest(sub_batches=2).given() and PartitionRequest(gpus=1).given()
    policies = ["lws", "peager", "dmdas", "eager"]
    p = resolve(PartitionRequest(), cores=2, build=DEBIAN)
    assert scheduler(p, None, policies) == "lws"
    assert scheduler(p, None, policies, env="eager") == "eager"
    assert scheduler(resolve(PartitionRequest(kcore="forkjoin"), cores=2, build=DEBIAN), None,
                     policies) == "peager"
    assert scheduler(resolve(PartitionRequest(gpus=1), cores=4, build=GPU), None,
                     policies) == "dmdas"
    with pytest.raises(StarpuLLMError, match="sched nosuch: this StarPU has no such scheduler"):
        scheduler(p, "nosuch", policies)
    with pytest.raises(StarpuLLMError, match="STARPU_SCHED=nosuch"):
        scheduler(p, None, policies, env="nosuch")
    with pytest.raises(StarpuLLMError, match="lws"):
        scheduler(resolve(PartitionRequest(gpus=1), cores=4, build=GPU), "lws", policies)


def test_the_scheduler_and_a_pipelines_schedule_are_the_partitions():
    """resolve decides them (the one asked for, else $STARPU_SCHED, else the default; a
    pipeline's schedule, eager by default), the partition prints them, and a record saved
    before they were kept reads with neither, the same shape as one with them."""
    import json
    from dataclasses import asdict, replace
    from starpu_llm.plan.record import RunRecord, Settings
    from starpu_llm.training.trainer import TrainConfig
    policies = ("lws", "peager", "dmdas", "eager")
    build = replace(DEBIAN, schedulers=policies)
    p = resolve(PartitionRequest(), cores=2, build=build)
    assert (p.sched, p.pipeline_schedule) == ("lws", "")
    assert resolve(PartitionRequest(), cores=2, build=build, sched_env="eager").sched == "eager"
    pipe = resolve(PartitionRequest(pipeline_stages=2), cores=2, build=build, ranks=2, batch=8)
    assert (pipe.sched, pipe.pipeline_schedule) == ("lws", "eager")
    assert pipe.describe().endswith(", eager schedule, scheduler lws")
    with pytest.raises(StarpuLLMError, match="sched nosuch"):
        resolve(PartitionRequest(sched="nosuch"), cores=2, build=build)
    with pytest.raises(StarpuLLMError, match="pipeline_schedule 'fast'"):
        resolve(PartitionRequest(pipeline_stages=2, pipeline_schedule="fast"), cores=2,
                build=build, ranks=2)
    old = json.loads(RunRecord(p, Settings.of(TrainConfig())).to_json())
    del old["partition"]["sched"], old["partition"]["pipeline_schedule"]
    was = RunRecord.from_json(json.dumps(old)).partition
    assert (was.sched, was.pipeline_schedule) == ("", "") and was.same_shape(p)
    assert request_of(was).sched is None and request_of(p).sched == "lws"
    assert asdict(was) != asdict(p)


def test_the_pinning_rule_with_gpus():
    """Sub-batch i runs on worker i mod N where partition worker i is StarPU worker i: team
    or one-core workers, N > 1; not parallel workers, nor with GPUs (their CUDA workers come
    first in StarPU's numbering)."""
    def pins(build, cores, **ask):
        return resolve(PartitionRequest(**ask), cores=cores, build=build).pins_sub_batches
    assert pins(DEBIAN, 2, workers=2) and pins(DEBIAN, 4, workers=2, cores_per_worker=2)
    assert not pins(DEBIAN, 2, workers=1)
    assert not pins(CLUSTER, 8, workers=2, cores_per_worker=4)        # parallel workers
    assert not pins(GPU, 4, workers=2, cores_per_worker=1, gpus=1)
    assert not pins(GPU, 8, workers=2, cores_per_worker=2, gpus=1)


def test_a_run_on_a_started_runtime_takes_its_partition_without_resolving_again(monkeypatch):
    """engines.run_partition on a runtime given: the runtime's partition (its mechanism,
    scheduler, GPUs as started) with the run's sub-batches, no second resolve; a request for
    another shape or scheduler is one clear error, not silently replaced."""
    from types import SimpleNamespace

    from starpu_llm.training import engines
    from starpu_llm.plan import partition
    from starpu_llm.training.trainer import TrainConfig
    started = resolve(PartitionRequest(workers=2, kcore="forkjoin", sched="eager"), cores=4,
                      build=CLUSTER)
    runtime = SimpleNamespace(partition=started)
    calls = []
    real = partition.resolve
    monkeypatch.setattr(partition, "resolve", lambda *a, **k: calls.append(1) or real(*a, **k))
    p = engines.run_partition(TrainConfig(batch=8, sub_batches=4), runtime=runtime)
    assert calls == []
    assert p == partition.with_batch(replace(started, sub_batches=4), 8)
    assert engines.run_partition(TrainConfig(batch=8, workers=2), runtime=runtime).sub_batches == 2
    assert engines.run_partition(TrainConfig(batch=8, kcore="team"), runtime=runtime) == \
        partition.with_batch(started, 8)        # parallel workers whatever kcore: as resolve
    for ask in (dict(workers=3), dict(sched="lws"), dict(cores_per_worker=1), dict(gpus=1)):
        with pytest.raises(StarpuLLMError, match=f"^{next(iter(ask))} "):
            engines.run_partition(TrainConfig(batch=8, **ask), runtime=runtime)
    assert calls == []


def test_bench_resolves_each_configuration_once():
    """bench's partitions are resolved Partitions (one resolve each, duplicates dropped: 2 x 1
    is one partition whichever kcore is asked), and the settings its subprocess trains on
    (partition.settings_of) ask for the same partition again."""
    from starpu_llm.bench import bench_partitions
    from starpu_llm.plan.partition import settings_of
    from starpu_llm.plan.record import Partition
    from starpu_llm.runtime import resolve_here
    ps = bench_partitions([1, 2], None, ["team", "forkjoin"], cores=2)
    assert all(isinstance(p, Partition) for p in ps) and len(set(ps)) == len(ps)
    assert [(p.workers, p.cores_per_worker) for p in ps].count((2, 1)) == 1
    for p in ps:
        assert resolve_here(PartitionRequest(**settings_of(p)), cores=2) == p


def test_bench_auto_gives_each_partition_of_the_kcore_asked():
    """--workers auto with --kcore forkjoin: 1 x 2 as this build resolves a forkjoin request
    (FORKJOIN on StarPU 1.3, parallel workers on 1.4, where partitions_that_fit offers it once,
    as team) and 2 x 1; each partition once."""
    from starpu_llm.bench import bench_partitions
    from starpu_llm.runtime import resolve_here
    ps = bench_partitions("auto", None, ["forkjoin"], cores=2)
    assert len(set(ps)) == len(ps)
    assert resolve_here(PartitionRequest(workers=1, cores_per_worker=2, kcore="forkjoin"),
                        cores=2) in ps
    assert [(p.workers, p.cores_per_worker) for p in ps] == [(1, 2), (2, 1)]


def test_the_attention_is_decided_with_the_partition():
    """--attention resolved once with the partition: gemm on CPUs, flash with GPUs unless
    asked; resumed (request_of), kept on a runtime given (on_runtime refuses another), and a
    record saved before it was kept runs the same roundings as either."""
    from starpu_llm.plan.partition import on_runtime
    cpu = resolve(PartitionRequest(), cores=2, build=DEBIAN, batch=4)
    gpu = resolve(PartitionRequest(gpus=1), cores=8, build=GPU, batch=4)
    assert (cpu.attention, gpu.attention) == ("gemm", "flash")
    asked = resolve(PartitionRequest(attention="flash"), cores=2, build=DEBIAN, batch=4)
    assert asked.attention == "flash" and "flash attention" in asked.describe()
    assert resolve(PartitionRequest(gpus=1, attention="gemm"), cores=8, build=GPU).attention == "gemm"
    assert resolve(PartitionRequest(threads=2, attention="flash"), cores=2, build=DEBIAN,
                   engine="reference").attention == "flash"
    with pytest.raises(StarpuLLMError, match="attention 'dense': choose one of gemm, flash"):
        resolve(PartitionRequest(attention="dense"), cores=2, build=DEBIAN)
    for p in (cpu, gpu, asked):
        assert resolve(request_of(p), cores=8 if p.gpus else 2,
                       build=GPU if p.gpus else DEBIAN, batch=4) == p
    assert on_runtime(asked, PartitionRequest(), 4).attention == "flash"
    with pytest.raises(StarpuLLMError, match="attention gemm: the runtime given runs"):
        on_runtime(asked, PartitionRequest(attention="gemm"), 4)
    old = replace(cpu, attention="")
    assert old.same_shape(cpu) and cpu.same_shape(old) and not asked.same_shape(cpu)


def test_more_workers_than_cores_names_the_partitions_that_fit_first():
    """5 workers on 2 cores of a 4-CPU build: the cores' error, whose partitions fit both (the
    build's 'choose N x K <= 4' came first and 3 or 4 were refused next)."""
    with pytest.raises(StarpuLLMError, match="this process can use 2; partitions that fit: "
                                             "1x2, 2x1"):
        resolve(PartitionRequest(workers=5), cores=2, build=DEBIAN)


def test_the_copies_of_a_partition_are_stated_once(monkeypatch):
    """R = S x D: the data-parallel copies and each one's share of the batch are the
    Partition's (copies, per_copy), read by with_batch, the engine and the prediction alike.
    The engine hands with_batch the whole batch, as the trainer's resolve does: a pipeline of
    2 stages on 4 ranks (2 copies) with N = 2 and B = 24 takes 12 micro-batches a copy
    either way (the copy's share taken twice, 6, gave 6)."""
    from types import SimpleNamespace

    from starpu_llm.flow import engine
    from starpu_llm.plan import partition
    req = PartitionRequest(workers=2, cores_per_worker=1, pipeline_stages=2)
    p = resolve(req, cores=2, build=DEBIAN, ranks=4)
    assert (p.copies, p.per_copy(24), p.sub_batches) == (2, 12, 0)
    resolved = resolve(req, cores=2, build=DEBIAN, ranks=4, batch=24)
    assert partition.with_batch(p, 24) == resolved and resolved.sub_batches == 12
    given = []

    def stop(q, batch):
        given.append(partition.with_batch(q, batch))
        raise RuntimeError("stop here")
    monkeypatch.setattr(engine, "with_batch", stop)
    runtime = SimpleNamespace(running=True, size=4, partition=p)
    with pytest.raises(RuntimeError, match="stop here"):
        engine.StarPUEngine(None, None, 24, 64, None, runtime)
    assert given == [resolved]
