#!/usr/bin/env bash
# Build (once) and install llama-cpp-python for the GGUF minion backend.
#
# Why a script and not `pip install llama-cpp-python`:
#  * PyPI has no binary wheel, so pip compiles llama.cpp (~5 min on 2 cores).
#  * The default build uses -march=native, which on AMX CPUs enables a code path that
#    segfaults on q8_0/q4_0 models as soon as more than one token is evaluated at once
#    (upstream llama.cpp issue 20824). GGML_NATIVE=OFF avoids it, but then ggml is built
#    for AVX2 only; so the AVX-512 and VNNI extensions this CPU has (/proc/cpuinfo) are
#    switched on one by one, never AMX. On a 2-core AVX-512 EPYC that made the q3_k_m
#    SmolLM2 minion's passes 1.2-1.6x faster (1 token 9.0 -> 5.8 ms, 16 tokens 37.7 ->
#    30.7 ms, 64 tokens 131 -> 84 ms). MINIONS_LLAMA_CPU=portable builds for AVX2 only,
#    e.g. for a wheel that must run on other machines.
#  * pip's own wheel cache ignores CMAKE_ARGS and would silently reuse a native wheel,
#    so we build with --no-cache-dir into our own cache folder, keyed by version and
#    build flags, and reinstall from there (~4 s) on later runs.
#  * llama.cpp's CMakeLists forces its `llama-common` helper library on; the Python
#    package never uses it and it is half the build time. A CMake project-include file
#    switches it off (written below, nothing is downloaded).
#  * The sdist is patched before it is built: scripts/llama_cpp_patches/*.patch, our own
#    changes to the llama.cpp it vendors (why, in each patch's header and the folder's
#    README). Their hash is part of the cache key.
#  * ggml's RPC backend is built in (-DGGML_RPC=ON, libggml-rpc.so beside the others): a
#    target's layers split over other machines' servers and `minions-rpc-server` is this
#    same library (backends/llama_rpc.py). Its RDMA transport stays off: it would link
#    libibverbs where the build machine has it, and the client relays every connection
#    through a socket of its own (TCP) to put timeouts on it.
#
# Usage: scripts/build_llama_cpp_wheel.sh [VERSION]
# Env:   MINIONS_WHEEL_CACHE  cache folder (default ~/.cache/minions-local/wheels)
#        PYTHON               interpreter to install into (default python)
#        EXTRA_CMAKE_ARGS     more llama.cpp flags, e.g. "-DGGML_CUDA=ON" for GPU minions
#                             (a wheel of its own in the cache: the flags are in its key)
#        LLAMA_CPP_SOURCE     build from this local sdist (.tar.gz or unpacked folder) instead of the index (offline)
#        MINIONS_LLAMA_CPU    "portable": no CPU extensions beyond AVX2 (default: this CPU's)
set -euo pipefail

VERSION="${1:-${LLAMA_CPP_PYTHON_VERSION:-0.3.36}}"
PYTHON="${PYTHON:-python}"
CACHE_ROOT="${MINIONS_WHEEL_CACHE:-$HOME/.cache/minions-local/wheels}"

# ggml's x86 extensions this CPU has (AMX left out on purpose).
source "$(dirname "${BASH_SOURCE[0]}")/llama_cpp_cpu.sh"
source "$(dirname "${BASH_SOURCE[0]}")/llama_cpp_sdist.sh"

# The flags are part of the cache key: a wheel built with other flags is a different wheel.
RPC_FLAGS="-DGGML_RPC=ON -DGGML_RPC_RDMA=OFF"
PATCH_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/llama_cpp_patches"
PATCHES=("$PATCH_DIR"/*.patch)
PATCH_TAG="$(cat "${PATCHES[@]}" | sha256sum | cut -c1-8)"
FLAGS_TAG="$CPU_TAG-nocommon-rpc-p$PATCH_TAG"
if [ -n "${EXTRA_CMAKE_ARGS:-}" ]; then
    FLAGS_TAG="$FLAGS_TAG-$(printf '%s' "$EXTRA_CMAKE_ARGS" | sha256sum | cut -c1-8)"
fi
PY_TAG="$("$PYTHON" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"
CACHE_DIR="$CACHE_ROOT/llama-cpp-python-$VERSION-$FLAGS_TAG-$PY_TAG"
mkdir -p "$CACHE_DIR"

shopt -s nullglob
wheels=("$CACHE_DIR"/llama_cpp_python-"$VERSION"-*.whl)
if (( ${#wheels[@]} == 0 )); then
    include_file="$CACHE_DIR/no_llama_common.cmake"
    cat > "$include_file" <<'EOF'
# Loaded by CMake right after project(llama.cpp): skip the helper library the
# Python bindings never link against.
set(LLAMA_BUILD_COMMON OFF)
EOF
    echo "building llama-cpp-python $VERSION into $CACHE_DIR (takes a few minutes)" >&2
    start=$(date +%s)
    # The sdist (from the index, or LLAMA_CPP_SOURCE), unpacked and patched in a scratch folder.
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    unpack_llama_cpp_sdist "$VERSION" "$work/src"
    for p in "${PATCHES[@]}"; do
        patch -p1 --forward --quiet -d "$work/src" < "$p"
    done
    CMAKE_ARGS="-DGGML_NATIVE=OFF $CPU_FLAGS $RPC_FLAGS -DCMAKE_PROJECT_llama.cpp_INCLUDE=$include_file ${EXTRA_CMAKE_ARGS:-}" \
        "$PYTHON" -m pip wheel --no-cache-dir --no-deps "$work/src" -w "$CACHE_DIR"
    echo "built in $(( $(date +%s) - start )) s" >&2
    wheels=("$CACHE_DIR"/llama_cpp_python-"$VERSION"-*.whl)
    if (( ${#wheels[@]} == 0 )); then
        echo "error: pip wheel finished but no wheel is in $CACHE_DIR" >&2
        exit 1
    fi
else
    echo "reusing cached wheel ${wheels[0]}" >&2
fi

# Dependencies (numpy, diskcache, jinja2, typing-extensions) come from the index as usual.
# pip keeps an installed llama-cpp-python of the same version whatever its build flags,
# so a stamp next to the package says which build it is, and another one is replaced.
stamp() {
    "$PYTHON" - <<'PY' 2>/dev/null
import importlib.util, os
spec = importlib.util.find_spec("llama_cpp")
print(os.path.join(os.path.dirname(spec.origin), ".minions-build") if spec and spec.origin else "")
PY
}
installed="$(stamp || true)"
if [ -n "$installed" ] && [ "$(cat "$installed" 2>/dev/null)" != "$FLAGS_TAG" ]; then
    # Another build of the same version: pip would keep it ("already installed"), so it goes first.
    "$PYTHON" -m pip uninstall --yes --quiet llama-cpp-python
fi
"$PYTHON" -m pip install "${wheels[0]}"
echo "$FLAGS_TAG" > "$(stamp)"
"$PYTHON" -c 'import llama_cpp; print("llama_cpp", llama_cpp.__version__)'
