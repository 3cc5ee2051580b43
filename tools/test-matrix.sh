#!/usr/bin/env bash
# The numerical tests under other CPUs' rounding, emulated on this one. A cell is
#   KERNELS:BLAS:ATEN:CORES
#   KERNELS  native (-march=native, the default build in .venv) | portable (meson -Dnative=false,
#            built once into .venv-portable, which reuses .venv's packages)
#   BLAS     default (OpenBLAS picks for this CPU) | Haswell | SkylakeX   (OPENBLAS_CORETYPE)
#            | mkl (meson -Dblas=mkl against PyPI's MKL, built once into .venv-mkl, which reuses
#            .venv's packages; native kernels only: the clusters' MKL build, docs/clusters.md)
#   ATEN     default | avx2 | avx512                  (ATEN_CPU_CAPABILITY: PyTorch's dispatch)
#   CORES    all | 1                                   (taskset -c <first core>: 1 thread)
# Cells that need AVX-512 (SkylakeX, avx512) are skipped, with the reason, on a CPU without it.
#
#   tools/test-matrix.sh               9 cells covering every pair of settings (pairwise)
#   tools/test-matrix.sh --full        all 36 combinations
#   tools/test-matrix.sh --cell portable:Haswell:avx2:all [--cell ...]
#   tools/test-matrix.sh --cell native:mkl:default:all  (the MKL build; not in the 9 or the 36)
#   --tests tests/a.py,tests/b.py   other test files than the numerical ones below
# Extra arguments after -- go to pytest. Needs `make install` (the Makefile's test set-up) first.
set -euo pipefail
cd "$(dirname "$0")/.."

TESTS=(tests/test_kernels.py tests/test_model.py tests/test_parallel.py tests/test_mpi.py tests/test_batch.py
       tests/test_sample_batch.py)
PAIRWISE=(
  native:default:default:all   portable:default:avx2:1      native:default:avx512:1
  portable:Haswell:default:1   native:Haswell:avx2:all      portable:Haswell:avx512:all
  portable:SkylakeX:default:all native:SkylakeX:avx2:1      native:SkylakeX:avx512:all
)

cells=() pytest_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --full) for k in native portable; do for b in default Haswell SkylakeX; do
              for a in default avx2 avx512; do for c in all 1; do cells+=("$k:$b:$a:$c")
              done; done; done; done ;;
    --cell) cells+=("$2"); shift ;;
    --tests) IFS=, read -r -a TESTS <<<"$2"; shift ;;
    --) shift; pytest_args=("$@"); break ;;
    *) echo "test-matrix: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
  shift
done
[ ${#cells[@]} -gt 0 ] || cells=("${PAIRWISE[@]}")

[ -x .venv/bin/python ] || { echo "test-matrix: no .venv: run 'make install' first" >&2; exit 2; }
if grep -qw avx512f /proc/cpuinfo; then avx512=1; else avx512=0; fi
first_core=$(.venv/bin/python -c 'import os; print(min(os.sched_getaffinity(0)))')

portable_venv() {   # the kernels built without -march=native, beside the main build
  [ -f .venv-portable/.installed ] && return
  echo "== building the portable kernels into .venv-portable (meson -Dnative=false)"
  .venv/bin/python -m venv .venv-portable
  site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
  own=$(.venv-portable/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
  echo "$site" > "$own/main-venv-packages.pth"   # torch, numpy, cffi, meson-python, pytest
  PATH="$PWD/.venv/bin:$PATH" .venv-portable/bin/python -m pip install -q --no-deps \
    --no-build-isolation -Cbuild-dir=build/portable -Csetup-args=-Dnative=false -e .
  cp tools/00-starpu-llm-start.pth "$own/"   # what the Makefile's venvs carry (signals.py)
  touch .venv-portable/.installed
}

# MKL's libraries, headers and pkg-config files alone, at the version checked: the full mkl wheel
# also brings Intel's OpenMP, TBB and a libhwloc that the GNU-OpenMP link does not use (meson.build)
MKL_PIN=(mkl==2026.2.0 mkl-include==2026.2.0 mkl-devel==2026.2.0)
mkl_venv() {   # the kernels linked to MKL (meson -Dblas=mkl), beside the main build
  [ -f .venv-mkl/.installed ] && return
  echo "== building against MKL into .venv-mkl (${MKL_PIN[*]} from PyPI, meson -Dblas=mkl)"
  .venv/bin/python -m venv .venv-mkl
  site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
  own=$(.venv-mkl/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
  echo "$site" > "$own/main-venv-packages.pth"
  .venv-mkl/bin/python -m pip install -q --no-deps "${MKL_PIN[@]}"
  PKG_CONFIG_PATH="$PWD/.venv-mkl/lib/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}" \
    PATH="$PWD/.venv/bin:$PATH" .venv-mkl/bin/python -m pip install -q --no-deps \
    --no-build-isolation -Cbuild-dir=build/mkl -Csetup-args=-Dblas=mkl -e .
  cp tools/00-starpu-llm-start.pth "$own/"
  touch .venv-mkl/.installed
}

declare -a results
status=0
for cell in "${cells[@]}"; do
  IFS=: read -r kernels blas aten cores <<<"$cell"
  skip=""
  if [ $avx512 = 0 ] && { [ "$blas" = SkylakeX ] || [ "$aten" = avx512 ]; }; then
    skip="this CPU has no AVX-512"
  fi
  case "$kernels:$blas" in
    native:mkl) mkl_venv; py=.venv-mkl/bin/python ;;
    portable:mkl) echo "test-matrix: the mkl build has native kernels only, not $cell" >&2; exit 2 ;;
    native:*) py=.venv/bin/python ;;
    portable:*) portable_venv; py=.venv-portable/bin/python ;;
    *) echo "test-matrix: kernels must be native or portable, not $kernels" >&2; exit 2 ;; esac
  # a "default" cell is the libraries' own choice for this CPU, even where the environment
  # already forces one (some machines export OPENBLAS_CORETYPE)
  env=(-u OPENBLAS_CORETYPE -u ATEN_CPU_CAPABILITY PATH="$PWD/.venv/bin:$PATH")
  case "$blas" in default|mkl) ;; *) env+=(OPENBLAS_CORETYPE="$blas") ;; esac
  [ "$aten" = default ] || env+=(ATEN_CPU_CAPABILITY="$aten")
  pin=()
  [ "$cores" = 1 ] && pin=(taskset -c "$first_core")
  if [ -n "$skip" ]; then
    echo "== $cell: skipped ($skip)"; results+=("$cell  skipped ($skip)"); continue
  fi
  # what the cell really runs with, as the libraries report it
  seen=$(env "${env[@]}" "${pin[@]}" "$py" -c '
import os, torch
from starpu_llm._clib import ffi, lib
print(f"BLAS {ffi.string(lib.blas_name()).decode()}, torch {torch.backends.cpu.get_cpu_capability()}, "
      f"{len(os.sched_getaffinity(0))} core(s)")')
  echo "== $cell: $seen"
  t0=$SECONDS
  if env "${env[@]}" "${pin[@]}" "$py" -m pytest -q -p no:cacheprovider "${TESTS[@]}" \
       ${pytest_args[@]+"${pytest_args[@]}"} > "/tmp/test-matrix-${cell//:/-}.log" 2>&1; then
    verdict="passed"
  else
    verdict="FAILED (log: /tmp/test-matrix-${cell//:/-}.log)"; status=1
  fi
  summary=$(tail -n 1 "/tmp/test-matrix-${cell//:/-}.log")
  echo "   $verdict: $summary ($((SECONDS - t0)) s)"
  results+=("$cell  $verdict: $summary; $seen")
done
echo
echo "test matrix (KERNELS:BLAS:ATEN:CORES):"
printf '  %s\n' "${results[@]}"
exit $status
