#!/usr/bin/env bash
# Builds StarPU 1.4 from a source tarball (the repository tree: autogen.sh comes first) into a
# prefix, for building starpu-llm against it the way a cluster's `module load starpu/1.4.x` does:
#
#   tools/build-starpu.sh ../shared/vendor/starpu-1.4.12.tar.gz .deps/starpu-1.4
#   PKG_CONFIG_PATH=$PWD/.deps/starpu-1.4/lib/pkgconfig pip install --no-build-isolation -e .
#
# With MPI (StarPU-MPI), parallel workers and starpupy; without CUDA, OpenCL, HIP, Fortran,
# documentation, examples or tests. Nothing is downloaded: the Debian packages it needs are
# installed with apt-get when missing (SL_NO_APT=1: don't, just fail if something is missing).
#
# Environment:
#   PYTHON          the Python starpupy is built for (default python3). It needs setuptools and,
#                   for starpupy's numpy support, numpy: a project venv's python is a good choice.
#   STARPU_MAXCPUS  CPU workers the build supports (default 256). StarPU's own default is the
#                   build machine's core count rounded up to a power of two (2 on a 2-core VM),
#                   too small for the nodes it runs on.
#   JOBS            make -j (default: nproc)
#
# Idempotent: a prefix whose stamp records the same tarball and options is left as it is.
set -euo pipefail

usage() { echo "usage: $0 TARBALL PREFIX" >&2; exit 2; }
[ $# -eq 2 ] || usage
tarball=$(realpath "$1")
mkdir -p "$2"
prefix=$(realpath "$2")
[ -f "$tarball" ] || { echo "$0: no tarball at $1" >&2; exit 1; }

PYTHON=${PYTHON:-python3}
python=$(command -v "$PYTHON") || { echo "$0: no Python at $PYTHON" >&2; exit 1; }
# absolute (the build runs in another directory), without resolving a venv's symlink
case "$python" in /*) ;; *) python="$(cd "$(dirname "$python")" && pwd)/$(basename "$python")" ;; esac
maxcpus=${STARPU_MAXCPUS:-256}
jobs=${JOBS:-$(nproc)}

options=(--prefix="$prefix" --enable-mpi --enable-starpupy --enable-parallel-worker
         --enable-maxcpus="$maxcpus" --disable-cuda --disable-opencl --disable-hip
         --disable-fortran --disable-build-doc --disable-build-examples --disable-build-tests
         --disable-static
         --disable-starpufft --disable-socl --disable-fxt)

sha=$(sha256sum "$tarball" | cut -d' ' -f1)
stamp="$prefix/.build-starpu.stamp"
want="tarball $sha
python $("$python" -c 'import sys; print(sys.version.split()[0])')
options ${options[*]}"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "StarPU already built in $prefix (stamp matches); nothing to do"
  exit 0
fi

# ---- Debian build dependencies ----
pkgs=(autoconf automake libtool-bin make gcc pkg-config libhwloc-dev libopenmpi-dev openmpi-bin)
# Debian's python3 needs its -dev package for Python.h; another Python (venv, pyenv) has its own.
case "$(realpath "$python")" in /usr/bin/*) pkgs+=(python3-dev python3-setuptools) ;; esac
"$(dirname "$0")/install-system-deps.sh" "${pkgs[@]}"
"$python" -c 'import setuptools' 2>/dev/null ||
  { echo "$0: $python has no setuptools (starpupy's install needs it)" >&2; exit 1; }

# ---- build ----
work=$(mktemp -d "${TMPDIR:-/tmp}/build-starpu.XXXXXX")
# kept on failure, for its logs
trap 'if [ $? -eq 0 ]; then rm -rf "$work"; else echo "$0: logs in $work" >&2; fi' EXIT
tar -xzf "$tarball" -C "$work"
src=$(find "$work" -mindepth 1 -maxdepth 1 -type d | head -n1)
cd "$src"
[ -x configure ] || ./autogen.sh >"$work/autogen.log" 2>&1 ||
  { tail -n 30 "$work/autogen.log" >&2; exit 1; }

# configure looks for libpython$VERSION: point it at this Python's library directory (a
# venv's or pyenv's Python is not in the default linker path).
pylibdir=$("$python" -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR") or "")')
mkdir -p build && cd build
if ! PYTHON="$python" LDFLAGS="${LDFLAGS:-}${pylibdir:+ -L$pylibdir}" \
     ../configure "${options[@]}" >"$work/configure.log" 2>&1; then
  tail -n 40 "$work/configure.log" >&2
  exit 1
fi
# configure silently drops what it cannot build: demand what we asked for.
for feature in "StarPU MPI" "Python Interface" "Parallel Worker support"; do
  grep -Eq "^\s*$feature enabled:\s+yes" "$work/configure.log" ||
    { echo "$0: configure disabled $feature (see $work/configure.log)" >&2; exit 1; }
done
grep -q "^#define STARPU_MAXCPUS $maxcpus\$" include/starpu_config.h ||
  { echo "$0: STARPU_MAXCPUS is not $maxcpus" >&2; exit 1; }

make -j"$jobs" >"$work/make.log" 2>&1 || { tail -n 40 "$work/make.log" >&2; exit 1; }
make install >"$work/install.log" 2>&1 || { tail -n 40 "$work/install.log" >&2; exit 1; }

printf '%s\n' "$want" >"$stamp"
echo "StarPU $(sed -n 's/^Version: *//p' "$prefix"/lib/pkgconfig/starpu-1.*.pc | head -n1) installed in $prefix"
echo "build against it with: PKG_CONFIG_PATH=$prefix/lib/pkgconfig"
