# ggml's x86 extensions this CPU has (AMX is left out on purpose), for llama.cpp's CMake:
# sets CPU_FLAGS (the -DGGML_* switches) and CPU_TAG (a cache key). Sourced by
# build_llama_cpp_wheel.sh and build_llama_cpp_tools.sh, whose builds must agree (the
# benchmarks' peers run the kernels our minions run). MINIONS_LLAMA_CPU=portable:
# nothing beyond AVX2.
CPU_FLAGS=""
CPU_TAG="portable"
if [ "${MINIONS_LLAMA_CPU:-native}" != portable ] && [ -r /proc/cpuinfo ]; then
    have=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
    CPU_TAG="x86"
    if [[ $have == *" avx512f "* && $have == *" avx512bw "* && $have == *" avx512dq "* \
          && $have == *" avx512vl "* && $have == *" avx512cd "* ]]; then
        CPU_FLAGS="-DGGML_AVX512=ON"
        CPU_TAG="$CPU_TAG-avx512"
        for pair in avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
            if [[ $have == *" ${pair%%:*} "* ]]; then
                CPU_FLAGS="$CPU_FLAGS -DGGML_${pair##*:}=ON"
                CPU_TAG="$CPU_TAG-${pair%%:*}"
            fi
        done
    fi
    if [[ $have == *" avx_vnni "* ]]; then
        CPU_FLAGS="$CPU_FLAGS -DGGML_AVX_VNNI=ON"
        CPU_TAG="$CPU_TAG-avx_vnni"
    fi
    if [ "$CPU_TAG" = x86 ]; then CPU_TAG="portable"; fi  # nothing beyond the AVX2 baseline
fi
