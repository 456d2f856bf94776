# Sourced by the llama.cpp build scripts: the llama-cpp-python sdist, unpacked.
#
# unpack_llama_cpp_sdist VERSION DEST: the sdist of llama-cpp-python VERSION unpacked into
# DEST (DEST/vendor/llama.cpp is the llama.cpp it vendors). It comes from LLAMA_CPP_SOURCE
# when set (an sdist .tar.gz, or an unpacked sdist folder: offline builds), else from the
# package index. Uses $PYTHON.
unpack_llama_cpp_sdist() {
    local version="$1" dest="$2" sdist="${LLAMA_CPP_SOURCE:-}"
    mkdir -p "$dest"
    if [ -z "$sdist" ]; then
        echo "downloading the llama-cpp-python $version sdist" >&2
        "${PYTHON:-python}" -m pip download --no-deps --no-binary :all: --no-cache-dir \
            "llama-cpp-python==$version" -d "$dest.dl" >&2
        sdist="$(ls "$dest.dl"/llama_cpp_python-*.tar.gz)"
    fi
    if [ -d "$sdist" ]; then
        cp -r "$sdist"/. "$dest"
    else
        tar xzf "$sdist" -C "$dest" --strip-components=1
    fi
    if [ ! -f "$dest/vendor/llama.cpp/CMakeLists.txt" ]; then
        echo "error: no vendor/llama.cpp in $sdist" >&2
        return 1
    fi
}
