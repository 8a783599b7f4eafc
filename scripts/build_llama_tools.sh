#!/usr/bin/env bash
# Build llama.cpp's llama-quantize, llama-imatrix and llama-gguf-split (CPU only, portable flags) from the
# llama.cpp vendored in the llama-cpp-python 0.3.36 source distribution: the revision our GGUF output is
# compared with. The tests find them through LLAMA_CPP_BIN, PATH or .ci-cache/llama-build/bin
# (tests/helpers/llama_tools.py) and skip the comparisons without them.
#
#   scripts/build_llama_tools.sh [LLAMA_CPP_SRC] [BUILD_DIR]
#
# LLAMA_CPP_SRC defaults to .ci-cache/llama_cpp_python-0.3.36/vendor/llama.cpp (downloaded with pip when
# missing); BUILD_DIR to .ci-cache/llama-build. About 5 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
src="${1:-.ci-cache/llama_cpp_python-0.3.36/vendor/llama.cpp}"
build="${2:-.ci-cache/llama-build}"
if [ ! -f "$src/CMakeLists.txt" ]; then
    mkdir -p .ci-cache
    pip download llama-cpp-python==0.3.36 --no-deps --no-binary :all: -d .ci-cache -q
    tar -xzf .ci-cache/llama_cpp_python-0.3.36.tar.gz -C .ci-cache
    src=.ci-cache/llama_cpp_python-0.3.36/vendor/llama.cpp
fi
cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF > /dev/null
cmake --build "$build" -j "$(nproc)" --target llama-quantize llama-imatrix llama-gguf-split > /dev/null
ls "$build"/bin/llama-quantize "$build"/bin/llama-imatrix "$build"/bin/llama-gguf-split
