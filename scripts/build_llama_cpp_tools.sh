#!/usr/bin/env bash
# Build (once) llama.cpp's command-line tools, the benchmark's peers, from the llama.cpp
# source that the llama-cpp-python sdist vendors: the same code as the Python package.
#
# Why a build of its own beside scripts/build_llama_cpp_wheel.sh:
#  * The tools need `llama-common` (argument parsing, sampling, speculative helpers),
#    which the wheel's build switches off; so this is a separate CMake build.
#  * The same CPU flags as the wheel (this CPU's AVX-512 / VNNI extensions one by one,
#    GGML_NATIVE=OFF, never AMX: upstream issue 20824), so a tool and the Python
#    package run the same kernels. MINIONS_LLAMA_CPU=portable builds for AVX2 only.
#  * Static executables (BUILD_SHARED_LIBS=OFF): the bin folder is self-contained and
#    the build tree is deleted afterwards.
#  * No server, web UI or llama-cli (that one links the server and provisions a web UI
#    from the network); llama-completion is the plain command-line generator.
#
# Tools built: llama-speculative-simple (llama.cpp's speculative decoding with a draft
# model), llama-speculative, llama-completion, llama-simple, llama-bench, and rpc-server
# (GGML_RPC=ON; ggml names the target ggml-rpc-server, linked here as rpc-server too).
#
# Usage: scripts/build_llama_cpp_tools.sh [--print-dir] [VERSION]
#        --print-dir: print the bin folder it would use, build nothing.
# Env:   MINIONS_TOOLS_CACHE  cache folder (default ~/.cache/minions-local/tools)
#        PYTHON               interpreter whose pip downloads the sdist (default python)
#        LLAMA_CPP_SOURCE     build from this local llama-cpp-python sdist (.tar.gz or unpacked folder) instead
#                             of downloading it from the index (offline)
#        MINIONS_LLAMA_CPU    "portable": no CPU extensions beyond AVX2 (default: this CPU's)
#        JOBS                 parallel compile jobs (default 2)
set -euo pipefail

PRINT_DIR=0
if [ "${1:-}" = "--print-dir" ]; then
    PRINT_DIR=1
    shift
fi
VERSION="${1:-${LLAMA_CPP_PYTHON_VERSION:-0.3.36}}"
PYTHON="${PYTHON:-python}"
CACHE_ROOT="${MINIONS_TOOLS_CACHE:-$HOME/.cache/minions-local/tools}"
JOBS="${JOBS:-2}"

# ggml's x86 extensions this CPU has (AMX left out on purpose).
source "$(dirname "${BASH_SOURCE[0]}")/llama_cpp_cpu.sh"
source "$(dirname "${BASH_SOURCE[0]}")/llama_cpp_sdist.sh"

TOOLS_DIR="$CACHE_ROOT/llama.cpp-$VERSION-$CPU_TAG"
BIN_DIR="$TOOLS_DIR/bin"
if (( PRINT_DIR )); then
    echo "$BIN_DIR"
    exit 0
fi

TARGETS=(llama-speculative-simple llama-speculative llama-completion llama-simple llama-bench ggml-rpc-server)
complete() {
    local t
    for t in "${TARGETS[@]}" rpc-server; do
        [ -x "$BIN_DIR/$t" ] || return 1
    done
}

if complete; then
    echo "reusing cached tools in $BIN_DIR" >&2
    echo "$BIN_DIR"
    exit 0
fi

mkdir -p "$TOOLS_DIR"
WORK="$(mktemp -d "$TOOLS_DIR/.build-XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

unpack_llama_cpp_sdist "$VERSION" "$WORK/sdist"
SRC="$WORK/sdist/vendor/llama.cpp"

echo "building llama.cpp tools ($VERSION, $CPU_TAG) into $BIN_DIR with -j$JOBS (takes several minutes)" >&2
start=$(date +%s)
# shellcheck disable=SC2086  # CPU_FLAGS is a list of flags
cmake -S "$SRC" -B "$WORK/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=OFF $CPU_FLAGS -DGGML_RPC=ON \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_EXAMPLES=ON \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF >&2
cmake --build "$WORK/build" -j "$JOBS" --target "${TARGETS[@]}" >&2

mkdir -p "$BIN_DIR"
for t in "${TARGETS[@]}"; do
    cp "$WORK/build/bin/$t" "$BIN_DIR/.$t.partial"
    mv "$BIN_DIR/.$t.partial" "$BIN_DIR/$t"
done
ln -sf ggml-rpc-server "$BIN_DIR/rpc-server"
cat > "$TOOLS_DIR/BUILD_INFO" <<EOF
llama-cpp-python sdist $VERSION, vendor/llama.cpp
cmake: -DGGML_NATIVE=OFF $CPU_FLAGS -DGGML_RPC=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_COMMON=ON
targets: ${TARGETS[*]}
built $(date -u +%Y-%m-%dT%H:%M:%SZ) in $(( $(date +%s) - start )) s
EOF
echo "built in $(( $(date +%s) - start )) s" >&2
"$BIN_DIR/llama-speculative-simple" --help >/dev/null 2>&1 \
    || { echo "error: $BIN_DIR/llama-speculative-simple --help failed" >&2; exit 1; }
echo "$BIN_DIR"
