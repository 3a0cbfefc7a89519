#!/usr/bin/env bash
# Build llama.cpp's shared library and its speculative-decoding tool from the sources vendored in the
# llama-cpp-python sdist (PyPI), for `dflash2 bench --peers llamacpp,llamacpp-spec`. Installs the Python
# package without compiling it a second time; the library is found through ~/.cache/dflash2/llama.cpp/bin.
# About 15-40 min on 2 busy cores. Usage: scripts/build_llama_cpp.sh [PYTHON]
set -euo pipefail
PY=${1:-.venv/bin/python}
VERSION=0.3.36
WORK=${DFLASH2_HOME:-$HOME/.cache/dflash2}/llama.cpp
SRC=$WORK/llama_cpp_python-$VERSION
mkdir -p "$WORK"
if [ ! -d "$SRC" ]; then
  "$PY" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$WORK/sdist"
  tar xzf "$WORK/sdist/llama_cpp_python-$VERSION.tar.gz" -C "$WORK"
fi
CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" "$PY" -m pip install --no-deps "$SRC"
"$PY" -m pip install "diskcache>=5.6"
PATH="$(dirname "$PY"):$PATH" cmake -S "$SRC/vendor/llama.cpp" -B "$WORK/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF \
  -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TOOLS=ON -DGGML_NATIVE=ON
PATH="$(dirname "$PY"):$PATH" nice -n 10 cmake --build "$WORK/build" -j2 --target llama llama-speculative-simple
ln -sfn "$WORK/build/bin" "$WORK/bin"
echo "llama.cpp library and llama-speculative-simple in $WORK/bin"
