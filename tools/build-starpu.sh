#!/usr/bin/env bash
# Builds StarPU 1.4 from a source tarball (the release, or a tree of its repository: then
# autogen.sh comes first) into a prefix, for building starpu-llm against it the way a cluster's
# `module load starpu/1.4.x` does:
#
#   tools/build-starpu.sh ../shared/vendor/starpu-1.4.12.tar.gz .deps/starpu-1.4
#   tools/build-starpu.sh download .deps/starpu-1.4     # the release, sha256-checked (--fetch)
#   PKG_CONFIG_PATH=$PWD/.deps/starpu-1.4/lib/pkgconfig pip install --no-build-isolation -e .
#
# With MPI (StarPU-MPI), parallel workers and starpupy; without CUDA, OpenCL, HIP, Fortran,
# documentation, examples or tests. Only `download` downloads: the Debian packages it needs are
# installed with apt-get when missing (SL_NO_APT=1: don't, just fail if something is missing);
# without dpkg, their commands (autoconf, automake, libtool, make, gcc, patch, pkg-config, mpicc)
# and hwloc.pc are looked for instead, from modules or elsewhere, and nothing is installed.
#
#   tools/build-starpu.sh --cuda TARBALL PREFIX
#
# The same with CUDA (StarPU's CUDA workers, cuBLAS) and without starpupy: starpufft stays off
# (it does not build against cuFFT 13) and STARPU_MAXCPUS defaults to 64. It needs
# nvcc and cudart ($CUDA_HOME, else /usr/local/cuda or /usr/local/cuda-13.0) and cuBLAS
# ($CUBLAS_HOME: a folder with include/cublas_v2.h and lib/ or lib64/libcublas.so*, default
# $CUDA_HOME; PyPI's nvidia-cublas==13.1.0.3 unpacked with pip install --target DIR is one:
# CUBLAS_HOME=DIR/nvidia/cu13). Without the cuSPARSE and cuSOLVER headers that starpu.h
# includes (a machine with cuBLAS from PyPI), tools/cuda-stubs stands in for them: compiling
# works, nothing of theirs is used. No GPU is needed to build.
#
# Every build applies the fixes in tools/patches/ first (starpu-1.4.12-*.patch, in name order;
# each says why): CUDA 13's removed cudaDeviceProp.computeMode, and a deadlock of lws after
# parallel workers. The tree records each fix applied (its name and sha256 in
# .starpu-llm-fixes), so a tree fixed once is not patched again.
#
#   tools/build-starpu.sh --autogen TARBALL OUT.tar.gz
#
# Writes the tarball's tree after autogen.sh (configure made) with the fixes applied: what a
# machine without libtool or patch, such as the GPU machine, builds from (it needs no patch
# program there). An OUT whose tree records the same fixes is left as it is.
#
#   tools/build-starpu.sh --apply-fixes SRCDIR
#
# Applies the fixes to a StarPU 1.4.12 source tree in place (what the other forms do).
#
#   tools/build-starpu.sh --fetch OUT.tar.gz
#
# On a connected machine: downloads the StarPU 1.4.12 release tarball from the StarPU project's
# release page and checks its sha256 before anything else reads it (a mismatch removes it and
# fails). TARBALL may also be the word `download` in the other forms: the release is fetched
# into .deps/ beside this script's repository first (once; a file already there is checked
# again). Nothing else downloads: a TARBALL path is taken as it is (the vendored one is the
# repository's tree at the release tag, not the release tarball, so its sha256 differs).
#
# Environment:
#   PYTHON          the Python starpupy is built for (default python3). It needs setuptools and,
#                   for starpupy's numpy support, numpy: a project venv's python is a good choice.
#   STARPU_MAXCPUS  CPU workers the build supports (default 256; 64 with --cuda). StarPU's own
#                   default is the build machine's core count rounded up to a power of two (2 on
#                   a 2-core VM), too small for the nodes it runs on.
#   JOBS            make -j (default: nproc)
#   SL_SKIP_DEPS    1: do not check the build's packages (tools/install-system-deps.sh: Debian's
#                   packages, or without dpkg the commands and pkg-config modules they provide)
#
# Idempotent: a prefix whose stamp records the same tarball and options is left as it is.
set -euo pipefail

usage() {
  echo "usage: $0 [--cuda | --autogen] TARBALL|download PREFIX|OUT.tar.gz" >&2
  echo "       $0 --fetch OUT.tar.gz" >&2
  echo "       $0 --apply-fixes SRCDIR" >&2
  exit 2
}
mode=cpu
case "${1:-}" in
  --cuda) mode=cuda; shift ;; --autogen) mode=autogen; shift ;; --fetch) mode=fetch; shift ;;
  --apply-fixes) mode=fixes; shift ;;
esac
case $mode in fetch|fixes) [ $# -eq 1 ] || usage ;; *) [ $# -eq 2 ] || usage ;; esac
tools=$(cd "$(dirname "$0")" && pwd)

# The fixes, one line each as a tree records them: the patch's name and sha256.
fixes=("$tools"/patches/starpu-1.4.12-*.patch)
fix_line() { echo "$(basename "$1") $(sha256sum "$1" | cut -d' ' -f1)"; }
fix_record() { local f; for f in "${fixes[@]}"; do fix_line "$f"; done; }

# The fixes applied to the source tree in the current directory, each once: one the tree
# records is skipped, so a fixed tree needs no patch program.
apply_fixes() {
  local f line
  for f in "${fixes[@]}"; do
    line=$(fix_line "$f")
    grep -qxF "$line" .starpu-llm-fixes 2>/dev/null && continue
    command -v patch >/dev/null || { echo "$0: $PWD lacks the fix $(basename "$f") and this" \
      "machine has no patch program: install patch, or build from a tree made by" \
      "$0 --autogen on a machine that has it" >&2; exit 1; }
    patch -p1 -s --forward <"$f" >/dev/null ||
      { echo "$0: $f does not apply to $PWD (another StarPU version?)" >&2; exit 1; }
    echo "$line" >>.starpu-llm-fixes
  done
}

if [ $mode = fixes ]; then
  [ -f "$1/src/sched_policies/work_stealing_policy.c" ] ||
    { echo "$0: --apply-fixes: $1 is not a StarPU source tree" >&2; exit 1; }
  cd "$1" && apply_fixes && echo "$PWD: $(wc -l <.starpu-llm-fixes) fixes applied" && exit 0
fi

# The release and its checksum (the StarPU project's release page; the same sha256 as Spack's
# starpu package). SL_STARPU_URL overrides the address (a site mirror), never the checksum.
release=starpu-1.4.12
release_sha256=a186e0f4fc279877ecb36d53a672c07d9fbd54839172c051de60e2acd5c94990
release_url=${SL_STARPU_URL:-https://files.inria.fr/starpu/$release/$release.tar.gz}

# fetch OUT: the release tarball at OUT, its sha256 checked; a partial or wrong file never
# stays under OUT's name.
fetch() {
  local out=$1 got
  mkdir -p "$(dirname "$out")"
  if [ ! -f "$out" ]; then
    echo "downloading $release_url"
    if command -v curl >/dev/null; then
      curl -fsSL --retry 2 -o "$out.part" "$release_url"
    elif command -v wget >/dev/null; then
      wget -q -O "$out.part" "$release_url"
    else
      echo "$0: neither curl nor wget to download $release_url: install one, or download it" \
           "on a connected machine and pass its path" >&2; exit 1
    fi || { rm -f "$out.part"; echo "$0: could not download $release_url (no network?):" \
           "download it on a connected machine and pass its path instead of 'download'" >&2; exit 1; }
    mv "$out.part" "$out.check"
  else
    mv "$out" "$out.check"
  fi
  got=$(sha256sum "$out.check" | cut -d' ' -f1)
  if [ "$got" != "$release_sha256" ]; then
    rm -f "$out.check"
    echo "$0: $release_url: sha256 $got, expected $release_sha256 (a damaged or another" \
         "file): removed, nothing unpacked" >&2
    exit 1
  fi
  mv "$out.check" "$out"
  echo "$out: $release, sha256 checked"
}

if [ $mode = fetch ]; then fetch "$(realpath -m "$1")"; exit 0; fi
if [ "$1" = download ]; then
  tarball=$(realpath -m "$tools/../.deps/$release.tar.gz")
  fetch "$tarball"
else
  tarball=$(realpath "$1")
  [ -f "$tarball" ] || { echo "$0: no tarball at $1 (on a connected machine, 'download' fetches" \
                              "$release and checks it)" >&2; exit 1; }
fi

# The tarball's source tree, unpacked into a new folder $work (kept on failure, for its logs).
unpack() {
  work=$(mktemp -d "${TMPDIR:-/tmp}/build-starpu.XXXXXX")
  trap 'if [ $? -eq 0 ]; then rm -rf "$work"; else echo "$0: logs in $work" >&2; fi' EXIT
  tar -xzf "$tarball" -C "$work"
  src=$(find "$work" -mindepth 1 -maxdepth 1 -type d | head -n1)
}
autogen() {
  [ -x "$src/configure" ] || (cd "$src" && ./autogen.sh) >"$work/autogen.log" 2>&1 ||
    { tail -n 30 "$work/autogen.log" >&2; exit 1; }
}

if [ $mode = autogen ]; then
  mkdir -p "$(dirname "$2")"
  out=$(realpath "$2")
  if [ -f "$out" ] && [ "$(tar -xzOf "$out" --wildcards '*/.starpu-llm-fixes' 2>/dev/null)" = "$(fix_record)" ]; then
    echo "$out: already made with these fixes; nothing to do"
    exit 0
  fi
  unpack
  autogen
  (cd "$src" && apply_fixes)
  tar -czf "$out.tmp" -C "$work" "$(basename "$src")" && mv "$out.tmp" "$out"
  echo "$out: $(basename "$src") with configure ($(du -h "$out" | cut -f1))"
  exit 0
fi
mkdir -p "$2"
prefix=$(realpath "$2")

PYTHON=${PYTHON:-python3}
python=$(command -v "$PYTHON") || { echo "$0: no Python at $PYTHON" >&2; exit 1; }
# absolute (the build runs in another directory), without resolving a venv's symlink
case "$python" in /*) ;; *) python="$(cd "$(dirname "$python")" && pwd)/$(basename "$python")" ;; esac
jobs=${JOBS:-$(nproc)}

if [ $mode = cpu ]; then
  maxcpus=${STARPU_MAXCPUS:-256}
  options=(--prefix="$prefix" --enable-mpi --enable-starpupy --enable-parallel-worker
           --enable-maxcpus="$maxcpus" --disable-cuda --disable-opencl --disable-hip
           --disable-fortran --disable-build-doc --disable-build-examples --disable-build-tests
           --disable-static
           --disable-starpufft --disable-socl --disable-fxt)
  features=("StarPU MPI" "Python Interface" "Parallel Worker support")
  cppflags=${CPPFLAGS:-}
  ldflags=${LDFLAGS:-}
else
  # ---- CUDA: nvcc and cudart, cuBLAS, the headers starpu.h includes ----
  cuda_home=${CUDA_HOME:-}
  if [ -z "$cuda_home" ]; then
    for d in /usr/local/cuda /usr/local/cuda-13.0; do
      [ -x "$d/bin/nvcc" ] && { cuda_home=$d; break; }
    done
  fi
  [ -n "$cuda_home" ] && [ -x "$cuda_home/bin/nvcc" ] || {
    echo "$0: --cuda: no CUDA toolkit (bin/nvcc) in \$CUDA_HOME (${CUDA_HOME:-unset}), /usr/local/cuda" \
         "or /usr/local/cuda-13.0: install it, or set CUDA_HOME" >&2; exit 1; }
  cuda_home=$(realpath "$cuda_home")
  cuda_lib=$cuda_home/lib64
  [ -d "$cuda_lib" ] || cuda_lib=$cuda_home/lib
  cublas_home=$(realpath "${CUBLAS_HOME:-$cuda_home}")
  cublas_lib=
  for d in "$cublas_home/lib64" "$cublas_home/lib" "$cuda_home/targets/x86_64-linux/lib"; do
    compgen -G "$d/libcublas.so*" >/dev/null && { cublas_lib=$d; break; }
  done
  cublas_inc=$cublas_home/include
  [ -f "$cublas_inc/cublas_v2.h" ] || cublas_inc=$cuda_home/include
  [ -n "$cublas_lib" ] && [ -f "$cublas_inc/cublas_v2.h" ] || {
    echo "$0: --cuda: no cuBLAS (include/cublas_v2.h and lib/libcublas.so*) in $cublas_home:" \
         "set CUBLAS_HOME, e.g. pip install --target DIR nvidia-cublas==13.1.0.3 and" \
         "CUBLAS_HOME=DIR/nvidia/cu13" >&2; exit 1; }
  maxcpus=${STARPU_MAXCPUS:-64}
  options=(--prefix="$prefix" --enable-mpi --disable-starpupy --enable-parallel-worker
           --enable-maxcpus="$maxcpus" --enable-cuda --with-cuda-dir="$cuda_home"
           --disable-opencl --disable-hip
           --disable-fortran --disable-build-doc --disable-build-examples --disable-build-tests
           --disable-static
           --disable-starpufft --disable-socl --disable-fxt)
  features=("StarPU MPI" "Parallel Worker support")
  # A GPU node without an MPI compiler that nothing will install (no dpkg, or SL_SKIP_DEPS as
  # on the device machine) still gets its CUDA StarPU (configure stops at --enable-mpi without
  # mpicc): one process, GPUs under mpirun left out, said once.
  if ! command -v "${MPICC:-mpicc}" >/dev/null &&
     { [ -n "${SL_SKIP_DEPS:-}" ] || ! command -v dpkg-query >/dev/null; }; then
    no_mpi=1
    echo "$0: --cuda: no ${MPICC:-mpicc} (no MPI compiler): StarPU built without StarPU-MPI" \
         "(one process; load an MPI module or set MPICC for mpirun runs)" >&2
    options=("${options[@]/--enable-mpi/--disable-mpi}")
    features=("Parallel Worker support")
  fi
  stubs=
  [ -f "$cuda_home/include/cusparse.h" ] || stubs=$tools/cuda-stubs
  cppflags="${CPPFLAGS:-} -I$cublas_inc${stubs:+ -I$stubs}"
  # configure's -lcublas needs a libcublas.so: PyPI's wheel has only libcublas.so.13. The
  # libraries then load from where they are (run path), without LD_LIBRARY_PATH.
  ldflags="${LDFLAGS:-} -L@LINKS@ -Wl,-rpath-link,$cublas_lib -Wl,-rpath,$cublas_lib -Wl,-rpath,$cuda_lib"
fi

sha=$(sha256sum "$tarball" | cut -d' ' -f1)
stamp="$prefix/.build-starpu.stamp"
want="tarball $sha
python $("$python" -c 'import sys; print(sys.version.split()[0])')
options ${options[*]}"
[ $mode = cpu ] || want="$want
cuda $cuda_home cublas $cublas_lib ${stubs:+stubs}"
want="$want
$(fix_record)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "StarPU already built in $prefix (stamp matches); nothing to do"
  exit 0
fi

# ---- Debian build dependencies ----
pkgs=(autoconf automake libtool-bin make gcc patch pkg-config libhwloc-dev)
[ -n "${no_mpi:-}" ] || pkgs+=(libopenmpi-dev openmpi-bin)
# Debian's python3 needs its -dev package for Python.h; another Python (venv, pyenv) has its own.
[ $mode = cpu ] && case "$(realpath "$python")" in /usr/bin/*) pkgs+=(python3-dev python3-setuptools) ;; esac
# Without dpkg (another distribution, a cluster's modules) install-system-deps.sh checks the
# commands and pkg-config modules these packages provide instead. SL_SKIP_DEPS=1: no check at
# all (e.g. the GPU machine building a tree made by --autogen: configure says what is missing)
if [ -z "${SL_SKIP_DEPS:-}" ]; then
  PYTHON=$python "$tools/install-system-deps.sh" "${pkgs[@]}" ||
    { echo "$0: SL_SKIP_DEPS=1 skips this check (configure then names what it lacks)" >&2; exit 1; }
fi
[ $mode = cuda ] || "$python" -c 'import setuptools' 2>/dev/null ||
  { echo "$0: $python has no setuptools (starpupy's install needs it)" >&2; exit 1; }

# ---- build ----
unpack
autogen
cd "$src"
apply_fixes
if [ $mode = cuda ]; then
  mkdir -p "$work/links"
  for l in "$cublas_lib"/libcublas*.so.*; do
    base=$(basename "$l"); ln -sf "$l" "$work/links/${base%%.so.*}.so"
  done
  ldflags=${ldflags//@LINKS@/$work/links}
fi

# configure looks for libpython$VERSION: point it at this Python's library directory (a
# venv's or pyenv's Python is not in the default linker path).
pylibdir=$("$python" -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR") or "")')
mkdir -p build && cd build
if ! PYTHON="$python" CPPFLAGS="$cppflags" LDFLAGS="$ldflags${pylibdir:+ -L$pylibdir}" \
     ../configure "${options[@]}" >"$work/configure.log" 2>&1; then
  tail -n 40 "$work/configure.log" >&2
  exit 1
fi
# configure silently drops what it cannot build: demand what we asked for.
for feature in "${features[@]}"; do
  grep -Eq "^\s*$feature enabled:\s+yes" "$work/configure.log" ||
    { echo "$0: configure disabled $feature (see $work/configure.log)" >&2; exit 1; }
done
grep -q "^#define STARPU_MAXCPUS $maxcpus\$" include/starpu_config.h ||
  { echo "$0: STARPU_MAXCPUS is not $maxcpus" >&2; exit 1; }
if [ $mode = cuda ]; then
  grep -q "^#define STARPU_USE_CUDA 1" include/starpu_config.h ||
    { echo "$0: configure left CUDA out (see $work/configure.log)" >&2; exit 1; }
fi

make -j"$jobs" >"$work/make.log" 2>&1 || { tail -n 40 "$work/make.log" >&2; exit 1; }
make install >"$work/install.log" 2>&1 || { tail -n 40 "$work/install.log" >&2; exit 1; }

# the configure-time link folder is gone after the build: not in the installed .pc files
[ $mode = cuda ] && sed -i "s| -L$work/links||" "$prefix"/lib/pkgconfig/*.pc
if [ $mode = cuda ] && [ -n "$stubs" ]; then
  # starpu.h includes the stubs' headers too: the installed .pc files name them
  mkdir -p "$prefix/include/cuda-stubs"
  cp "$stubs"/*.h "$stubs/README.md" "$prefix/include/cuda-stubs/"
  sed -i 's|^Cflags: \(.*\)$|Cflags: \1 -I${includedir}/cuda-stubs|' "$prefix"/lib/pkgconfig/*.pc
fi
printf '%s\n' "$want" >"$stamp"
echo "StarPU $(sed -n 's/^Version: *//p' "$prefix"/lib/pkgconfig/starpu-1.*.pc | head -n1) installed in $prefix"
echo "build against it with: PKG_CONFIG_PATH=$prefix/lib/pkgconfig"
