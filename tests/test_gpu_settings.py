"""The GPU settings on any build, no GPU needed: --gpus and --gpu-matmul, where the partition
records them, what a CPU build or an unsupported combination answers, and which codelets have
a CUDA body (tests/test_gpu.py runs them on a GPU; test_kernels.py and test_model_cuda.py
check the CUDA bodies here)."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from starpu_llm import StarpuLLMError, TrainConfig
from starpu_llm._kernels import lib as klib
from starpu_llm.cli import build_parser
from starpu_llm.kernels.codelets import CUDA_BODIES, TABLE, cuda_devices
from starpu_llm.plan.record import Partition, RunRecord, Settings
from starpu_llm.runtime import Runtime
from starpu_llm.plan.partition import Build, PartitionRequest, resolve
from starpu_llm.runtime import starpu as rt
from starpu_llm.runtime.starpu import have_cuda, this_build, usable_cores
from partitions import here


def test_every_layer_has_a_cuda_body():
    # a codelet added without one would run its tasks on CPUs only, unnoticed: this names it
    cpu_only = {name for name, cd in TABLE.items() if cd.id not in CUDA_BODIES}
    assert cpu_only == {"load_batch", "gather", "probe"}, cpu_only
    assert all(klib.sl_codelet_has_cuda(cd.id) in (0, 1) for cd in TABLE.values())


def test_flags_and_defaults():
    assert TrainConfig().gpus == 0 and TrainConfig().gpu_matmul == "tf32"
    args = build_parser().parse_args(["train", "--gpus", "2", "--gpu-matmul", "fp32"])
    assert args.gpus == 2 and args.gpu_matmul == "fp32"
    with pytest.raises(StarpuLLMError, match="--gpu-matmul: invalid choice: 'bf16'"):
        build_parser().parse_args(["train", "--gpu-matmul", "bf16"])


def test_partition_records_the_gpus():
    cpu = Partition("starpu", 1, 2, 1, "team", attention="gemm")
    gpu = Partition("starpu", 1, 15, 1, "team", gpus=1, gpu_matmul="tf32", attention="flash")
    assert cpu.describe() == "1 worker(s) x 2 core(s) (team), 1 sub-batch(es), gemm attention"
    assert gpu.describe() == ("1 worker(s) x 15 core(s) (team) + 1 GPU(s) (TF32 matmuls), 1 "
                              "sub-batch(es), flash attention")
    settings = Settings.of(TrainConfig())
    for p in (cpu, gpu):
        assert RunRecord.from_json(RunRecord(p, settings).to_json()).partition == p
    # a record written before GPUs existed reads as a CPU run's
    old = json.loads(RunRecord(cpu, settings).to_json())
    del old["partition"]["gpus"], old["partition"]["gpu_matmul"]
    assert RunRecord.from_json(json.dumps(old)).partition == cpu


def test_gpus_refused_where_they_cannot_run():
    for bad, what in ((dict(gpus=-1), "--gpus"), (dict(gpus=1, gpu_matmul="bf16"), "--gpu-matmul")):
        with pytest.raises(StarpuLLMError, match=what.strip("-").replace("-", "_")):
            Runtime(here(**bad))
    if not have_cuda():
        with pytest.raises(StarpuLLMError, match="CPU build"):
            Runtime(here(gpus=1))
    else:   # a CUDA build refuses what GPUs cannot run yet, before starting anything
        for kw, what in ((dict(sched="lws"), "lws"), (dict(kcore="forkjoin"), "forkjoin")):
            with pytest.raises(StarpuLLMError, match=what):
                Runtime(here(gpus=1, **kw))
    with pytest.raises(StarpuLLMError, match="reference engine"):
        resolve(PartitionRequest(gpus=1), cores=2, build=this_build(), engine="reference")


def test_a_driver_cuda_cannot_use_is_one_clear_error_not_no_gpu(monkeypatch):
    """cudaGetDeviceCount failing (a driver older than the build's CUDA: error 35) is not "no
    GPU": --gpus 1 is one error naming CUDA's message and what to check, never a run on the
    CPUs or a skipped GPU test; --gpus 0 does not ask CUDA. The CPU emulation's
    cudaGetDeviceCount answers that error under SL_EMULATE_DEVICE_COUNT_ERROR."""
    insufficient = "CUDA driver version is insufficient for CUDA runtime version"
    request = PartitionRequest(gpus=1)
    broken = Build(max_cpus=64, parallel_workers=True, cuda=True,
                   cuda_error=f"cudaGetDeviceCount failed: {insufficient} (cudaError 35)")
    with pytest.raises(StarpuLLMError) as e:
        resolve(request, cores=8, build=broken)
    gpus = "gpus"       # as Python's API names it (the CLI's message says --gpus)
    assert str(e.value) == (f"{gpus} 1: cudaGetDeviceCount failed: {insufficient} (cudaError "
                            "35): check the NVIDIA driver (nvidia-smi; it must be as new as the "
                            "CUDA this starpu-llm was built with: starpu-llm --version names "
                            "both) and CUDA_VISIBLE_DEVICES, or "
                            f"run with {gpus} 0")
    resolve(PartitionRequest(gpus=0), cores=8, build=broken)
    if not klib.sl_gpu_emulated():
        return          # a CUDA build: its own driver answers; the rest is the emulation's
    assert klib.sl_gpu_devices() == 0 and cuda_devices() == (0, "")     # no device: no error
    monkeypatch.setenv("SL_EMULATE_DEVICE_COUNT_ERROR", "35")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert klib.sl_gpu_devices() == -35
    why = f"cudaGetDeviceCount failed: {insufficient} (cudaError 35; CUDA_VISIBLE_DEVICES '0')"
    assert cuda_devices() == (0, why)
    monkeypatch.setattr(rt, "have_cuda", lambda: True)     # as a CUDA build on that driver
    assert this_build(1).cuda_error == why and this_build(0).cuda_error == ""
    with pytest.raises(StarpuLLMError, match=rf"^{gpus} 1: {re.escape(why)}: check the NVIDIA"):
        rt.resolve_here(request)
    monkeypatch.setenv("SL_EMULATE_DEVICE_COUNT_ERROR", "803")
    assert "unsupported display driver" in cuda_devices()[1]


def test_more_gpus_than_cuda_sees_is_one_clear_error(monkeypatch):
    """--gpus N above the GPUs CUDA sees (a 1-GPU node, CUDA_VISIBLE_DEVICES, SLURM's
    allocation) is refused before StarPU starts, naming the count, instead of StarPU's fewer
    CUDA workers (or, under mpirun, two workers of a rank on one device)."""
    one = Build(max_cpus=64, parallel_workers=True, cuda=True, cuda_seen=1)
    resolve(PartitionRequest(gpus=1), cores=8, build=one)
    with pytest.raises(StarpuLLMError, match=r"^gpus 2: CUDA sees 1 GPU\(s\) here .*"
                                              r"ask for at most 1$"):
        resolve(PartitionRequest(gpus=2), cores=8, build=one)
    # not counted (another machine's build, perf/predict.py): not checked
    resolve(PartitionRequest(gpus=2), cores=8, build=Build(max_cpus=64, parallel_workers=True,
                                                           cuda=True))
    if not klib.sl_gpu_emulated():
        return
    monkeypatch.setattr(rt, "have_cuda", lambda: True)     # a CUDA build on a GPU-less node
    assert this_build(1).cuda_seen == 0 and this_build(0).cuda_seen is None
    with pytest.raises(StarpuLLMError, match=r"^gpus 1: CUDA sees 0 GPU\(s\) here"):
        rt.resolve_here(PartitionRequest(gpus=1))


def test_a_settings_mistake_is_said_before_what_cuda_sees():
    """resolve asks what CUDA sees last (partition._check_devices): a job script's mistake in
    the settings is its own error on a node where CUDA answers an error (a login node without
    a driver) or sees no GPU, not the devices'; with the settings right, the devices' error."""
    for devices in (dict(cuda_error="cudaGetDeviceCount failed: no driver"), dict(cuda_seen=0)):
        build = Build(max_cpus=64, parallel_workers=True, cuda=True, **devices)
        with pytest.raises(StarpuLLMError, match=r"^workers 16 x cores_per_worker 1 = 16 cores "
                                                 r"and 1 for the GPUs' worker threads, but this "
                                                 r"process can use 8"):
            resolve(PartitionRequest(gpus=1, workers=16, cores_per_worker=1), cores=8, build=build)
        with pytest.raises(StarpuLLMError, match=r"^workers 4 x cores_per_worker 1 needs 4 "
                                                 r"StarPU CPU workers, but this StarPU build "
                                                 r"supports at most 2"):
            resolve(PartitionRequest(gpus=1, workers=4, cores_per_worker=1), cores=8,
                    build=Build(max_cpus=2, parallel_workers=True, cuda=True, **devices))
        with pytest.raises(StarpuLLMError, match=r"^gpus 1: (cudaGetDeviceCount|CUDA sees 0)"):
            resolve(PartitionRequest(gpus=1, workers=4, cores_per_worker=1), cores=8, build=build)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_meson_takes_the_cuda_toolkit_of_the_nvcc_on_path(tmp_path):
    """A cluster's `module load cuda/12.x` puts its toolkit's nvcc on PATH, the toolkit
    anywhere but /usr/local/cuda: meson takes nvcc, cudart and cuBLAS from that toolkit (it
    looked in -Dcudatoolkit's /usr/local/cuda, which mixed two CUDAs or missed cudart), says
    which, and refuses a -Dgpu_arch the kernels cannot be built for, naming the option. A
    stand-in toolkit (nvcc a script, cudart and cuBLAS empty libraries): configure only."""
    kit = tmp_path / "cuda-12.4"
    (kit / "lib64").mkdir(parents=True)
    (tmp_path / "e.c").write_text("int sl_stand_in;\n")
    for lib in ("cudart", "cublas"):       # ELF libraries: meson's find_library reads them
        subprocess.run([shutil.which("cc") or "gcc", "-shared", "-fPIC", "-o",
                        str(kit / "lib64" / f"lib{lib}.so"), str(tmp_path / "e.c")], check=True)
    for name, text in (("bin/nvcc", "#!/bin/sh\nexit 0\n"), ("include/cublas_v2.h", "")):
        (kit / name).parent.mkdir(exist_ok=True)
        (kit / name).write_text(text)
    (kit / "bin" / "nvcc").chmod(0o755)
    env = dict(os.environ, PATH=f"{kit / 'bin'}:{os.environ['PATH']}")
    meson = os.path.join(os.path.dirname(sys.executable), "meson")

    def setup(name, *options):
        return subprocess.run([meson, "setup", str(tmp_path / name), ROOT, *options],
                              capture_output=True, text=True, env=env, timeout=300)
    p = setup("b", "-Dgpu_arch= 80, 90")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr
    assert f"CUDA toolkit: {kit} (the nvcc on PATH)" in p.stdout, p.stdout
    said = re.search(r"CUDA build: (on|off)[^\n]*", p.stdout).group(0)
    if said.startswith("CUDA build: on"):       # a StarPU with CUDA found here
        assert f"nvcc {kit / 'bin' / 'nvcc'}, sm 80,90, cuBLAS {kit / 'lib64'}" in said, said
    else:       # StarPU without CUDA: the toolkit's parts were all found
        assert not re.search(r"nvcc|cudart|cuBLAS", said), said
    p = setup("bad", "-Dgpu_arch=70,80")
    assert p.returncode != 0 and "-Dgpu_arch=70,80: give compute capabilities x10, 80 or more" \
        in p.stdout, p.stdout[-3000:]
    # a wrapper script on PATH (exec KIT/bin/nvcc "$@", as this machine's /usr/local/bin/nvcc):
    # two folders up is no toolkit; the toolkit is where nvcc's dry run says it is
    (kit / "bin" / "nvcc").write_text(
        f'#!/bin/sh\ncase " $* " in *" --dryrun "*) echo "#$ _HERE_={kit / "bin"}" >&2;; esac\n')
    (kit / "include" / "cuda_runtime.h").write_text("")
    wrapper = tmp_path / "site" / "bin" / "nvcc"
    wrapper.parent.mkdir(parents=True)
    wrapper.write_text(f'#!/bin/sh\nexec {kit / "bin" / "nvcc"} "$@"\n')
    wrapper.chmod(0o755)
    env["PATH"] = f"{wrapper.parent}:{os.environ['PATH']}"
    p = setup("wrapped", "-Dgpu_arch=90")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr
    assert f"CUDA toolkit: {kit} (the nvcc on PATH, {wrapper}, runs its nvcc)" in p.stdout, p.stdout


def test_gpus_take_a_core_each():
    """A CUDA build's partition (partition.resolve on a build with CUDA): team workers, and a
    core for each GPU's worker thread."""
    build = Build(max_cpus=64, parallel_workers=True, cuda=True)
    n = usable_cores()
    assert resolve(PartitionRequest(cores_per_worker=4, gpus=1), cores=8, build=build).kcore == "team"
    assert resolve(PartitionRequest(workers=2, cores_per_worker=1, gpus=1), cores=8,
                   build=build).kcore == "single"
    resolve(PartitionRequest(workers=1, cores_per_worker=n), cores=n, build=build)
    with pytest.raises(StarpuLLMError, match="for the GPUs' worker threads"):
        resolve(PartitionRequest(workers=1, cores_per_worker=n, gpus=1), cores=n, build=build)
    resolve(PartitionRequest(workers=1, cores_per_worker=n, gpus=1, oversubscribe=True),
            cores=n, build=build)


def test_gpu_buffers_stay_dirty_only_with_gpus_and_no_memory_limit(monkeypatch, tmp_path):
    # StarPU's clean-buffer write-back (4x a d12 step's time on an H200: docs/gpus.md) is off
    # exactly where the GPUs hold the step; under --memory-limit the disk node keeps it
    from starpu_llm.runtime import offload, starpu
    gpu = Partition("starpu", 1, 15, 1, "team", gpus=1, gpu_matmul="tf32", attention="flash",
                    sched="dmdas")
    cpu = Partition("starpu", 1, 2, 1, "team", attention="gemm", sched="lws")
    limit = offload.MemoryLimit.of("1G", str(tmp_path))
    assert starpu.start_environment(gpu, None) == {"STARPU_MINIMUM_CLEAN_BUFFERS": "0",
                                                   "STARPU_TARGET_CLEAN_BUFFERS": "0"}
    assert starpu.start_environment(gpu, limit) == {}
    assert starpu.start_environment(cpu, None) == {}
    # set for the start only, the user's own value kept, the environment restored after
    monkeypatch.delenv("STARPU_MINIMUM_CLEAN_BUFFERS", raising=False)
    monkeypatch.setenv("STARPU_TARGET_CLEAN_BUFFERS", "7")
    with starpu._environment(starpu.KEEP_DIRTY):
        assert os.environ["STARPU_MINIMUM_CLEAN_BUFFERS"] == "0"
        assert os.environ["STARPU_TARGET_CLEAN_BUFFERS"] == "7"
    assert "STARPU_MINIMUM_CLEAN_BUFFERS" not in os.environ
    assert os.environ["STARPU_TARGET_CLEAN_BUFFERS"] == "7"


def test_activations_with_gpus_have_no_host_buffer(runtime):
    """With GPUs an activation's handle is StarPU's memory, not a numpy buffer of ours (the
    GPU tasks write it; a host buffer only took RSS when StarPU copied the values back at
    unregistration); the host still writes and reads it (acquire: StarPU's main memory).
    Without GPUs, a buffer of ours (first touch by the task that writes it)."""
    import numpy as np
    from starpu_llm.flow.engine import read_tensor
    from starpu_llm.flow.handles import WRITE, Handles, acquired
    from starpu_llm.model.config import MODELS
    from starpu_llm.plan.sites import Sites
    from starpu_llm.plan.topology import Topology

    config = MODELS["tiny"]
    for gpus, host_buffers in ((1, 0), (0, 1)):
        h = Handles(runtime, config, Sites(Topology(config, 1, 1, "rank0"), gpus=gpus))
        t = h.tensor("x", (3, 5))
        assert len(h._buffers) == host_buffers
        values = np.arange(15, dtype=np.float32).reshape(3, 5)
        with acquired(t, WRITE) as x:       # written whole first, as a task would
            x[:] = values.reshape(-1)
        assert np.array_equal(read_tensor(t), values)
        h.unregister_all()


def test_each_rank_takes_its_own_gpus_under_mpi():
    """Under mpirun a rank starts its CUDA workers on its own devices of the node: the node's
    visible devices dealt out by the rank's place among the node's ranks (4 ranks, 4 GPUs:
    one each; 2 GPUs a rank: in pairs; more ranks than GPUs: shared round-robin; a launcher
    that shows each rank its own GPU only: device 0), set as STARPU_WORKERS_CUDAID beside the
    dirty-buffer settings; nothing set without GPUs or without a list (one process: StarPU's
    own order)."""
    from starpu_llm.runtime.starpu import KEEP_DIRTY, rank_cuda_devices, start_environment
    assert [rank_cuda_devices(r, 1, 4) for r in range(4)] == [[0], [1], [2], [3]]
    assert [rank_cuda_devices(r, 2, 4) for r in range(2)] == [[0, 1], [2, 3]]
    assert [rank_cuda_devices(r, 1, 2) for r in range(4)] == [[0], [1], [0], [1]]
    assert [rank_cuda_devices(r, 1, 1) for r in range(3)] == [[0], [0], [0]]
    assert rank_cuda_devices(0, 1, 0) == []
    gpu = Partition("starpu", 1, 7, 1, "team", gpus=2, gpu_matmul="tf32", attention="flash")
    cpu = Partition("starpu", 1, 7, 1, "team", attention="gemm")
    assert start_environment(gpu, None, [2, 3]) == {**KEEP_DIRTY, "STARPU_WORKERS_CUDAID": "2 3"}
    assert start_environment(gpu, None) == KEEP_DIRTY
    assert start_environment(cpu, None, [0]) == {}
