#!/usr/bin/env bash
# Build llama.cpp's shared library and its speculative-decoding tool from the sources vendored in the
# llama-cpp-python sdist (PyPI), for `dflash2 bench --peers llamacpp,llamacpp-spec`. Installs the Python
# package without compiling it a second time; the library is found through ~/.cache/dflash2/llama.cpp/bin.
# About 15-40 min on 2 busy cores. Usage: [WITH_SERVER=1] scripts/build_llama_cpp.sh [PYTHON]
# WITH_SERVER=1 also builds llama-server (dflash2 bench serve http's `llamacpp`; ~15 min more).
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
# Patches to the vendored sources, each applied once (a patch that already reverses cleanly is in place).
# llama.cpp-qwen2-layer-inputs.patch: llama.cpp's DFlash draft reads the target's layer inputs, which this llama.cpp
# commit (0c1e570) registers in its qwen3, llama and newer graphs but not in qwen2's, so a Qwen2.5 target stopped at
# GGML_ASSERT(t_layer_inp[il] != nullptr). The versions of upstream's src/models/qwen2.cpp seen (ggml-org/llama.cpp
# 93bf6ab, 0215468) do not register them either. The patch only adds graph outputs.
for PATCH in "$(dirname "$0")"/patches/llama.cpp-*.patch; do
  if ! patch -p1 -R --dry-run -s -f -d "$SRC/vendor/llama.cpp" < "$PATCH" >/dev/null 2>&1; then
    patch -p1 -N -s -d "$SRC/vendor/llama.cpp" < "$PATCH"
  fi
done
# -march=native, except on CPUs with AMX: this llama.cpp's AMX path (GGML_NATIVE turns it on there) crashes in the
# first llama_decode of the Q4_K_M target (seen on a Sapphire Rapids-class Xeon), so there the AVX-512 kernels are
# selected explicitly instead.
ISA_FLAGS=(-DGGML_NATIVE=ON)
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
  ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON
             -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF
             -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
fi
SERVER=OFF
TARGETS=(llama llama-speculative-simple)
if [ -n "${WITH_SERVER:-}" ]; then SERVER=ON; TARGETS+=(llama-server); fi
CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" "$PY" -m pip install --no-deps "$SRC"
"$PY" -m pip install "diskcache>=5.6" sentencepiece  # sentencepiece: convert_hf_to_gguf.py imports it for every model
PATH="$(dirname "$PY"):$PATH" cmake -S "$SRC/vendor/llama.cpp" -B "$WORK/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=$SERVER \
  -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TOOLS=ON "${ISA_FLAGS[@]}"
PATH="$(dirname "$PY"):$PATH" nice -n 10 cmake --build "$WORK/build" -j2 --target "${TARGETS[@]}"
ln -sfn "$WORK/build/bin" "$WORK/bin"
echo "llama.cpp library and ${TARGETS[*]:1} in $WORK/bin"
