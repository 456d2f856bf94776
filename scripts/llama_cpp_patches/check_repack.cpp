// check_repack: a mul_mat of a random quantized matrix held in the CPU_REPACK buffer (as
// llama.cpp places weights when it repacks; with GGML_CPU_TILED_REPACK=1 the patched ggml
// interleaves Q4_K there) against N random f32 columns (column j seeded by j only); writes
// the outputs for a bit comparison and times the call. NOREPACK=1: the plain CPU buffer.
#include "ggml.h"
#include "ggml-cpu.h"
#include "ggml-backend.h"
#include "ggml-alloc.h"
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <chrono>
#include <random>
#include <vector>
#include <string>

int main(int argc, char ** argv) {
    if (argc < 7) { fprintf(stderr, "usage: check_repack TYPE K M N REPS OUT\n"); return 2; }
    std::string tname = argv[1];
    int K = atoi(argv[2]), M = atoi(argv[3]), N = atoi(argv[4]), reps = atoi(argv[5]);
    ggml_type t = tname == "q4_K" ? GGML_TYPE_Q4_K : tname == "q6_K" ? GGML_TYPE_Q6_K : GGML_TYPE_Q4_0;
    bool repack = !getenv("NOREPACK");
    ggml_backend_t be = ggml_backend_cpu_init();
    ggml_backend_cpu_set_n_threads(be, getenv("NTH") ? atoi(getenv("NTH")) : 2);
    ggml_backend_dev_t dev = ggml_backend_get_device(be);
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
    auto fn = (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
    ggml_backend_buffer_type_t wbuft = ggml_backend_cpu_buffer_type();
    if (repack && fn) {
        for (auto * p = fn(dev); p && *p; ++p) {
            if (strstr(ggml_backend_buft_name(*p), "REPACK")) wbuft = *p;
        }
    }
    fprintf(stderr, "weights in %s\n", ggml_backend_buft_name(wbuft));
    ggml_init_params ip = { ggml_tensor_overhead() * 8 + ggml_graph_overhead(), nullptr, true };
    ggml_context * cw = ggml_init(ip);
    ggml_tensor * a = ggml_new_tensor_2d(cw, t, K, M);
    ggml_backend_buffer_t wb = ggml_backend_alloc_ctx_tensors_from_buft(cw, wbuft);
    ggml_context * cx = ggml_init(ip);
    ggml_tensor * b = ggml_new_tensor_2d(cx, GGML_TYPE_F32, K, N);
    ggml_tensor * c = ggml_mul_mat(cx, a, b);
    ggml_backend_buffer_t xb = ggml_backend_alloc_ctx_tensors_from_buft(cx, ggml_backend_cpu_buffer_type());
    std::mt19937 rng(1234);
    std::normal_distribution<float> nd(0.f, 1.f);
    std::vector<float> w((size_t) K * M);
    for (auto & x : w) x = nd(rng) * 0.05f;
    std::vector<char> q(ggml_row_size(t, K) * M);
    ggml_quantize_chunk(t, w.data(), q.data(), 0, M, K, nullptr);
    ggml_backend_tensor_set(a, q.data(), 0, q.size());
    std::vector<float> cols((size_t) K * N);
    for (int j = 0; j < N; j++) {
        std::mt19937 r2(777 + j);
        for (int k = 0; k < K; k++) cols[(size_t) j * K + k] = nd(r2);
        if (getenv("TIES")) {  // each block's max |x| twice, negative first: the q8_K sign rule decides
            for (int k0 = 0; k0 < K; k0 += 256) { cols[(size_t) j * K + k0 + 3] = -9.f; cols[(size_t) j * K + k0 + 200] = 9.f; }
        }
    }
    ggml_backend_tensor_set(b, cols.data(), 0, cols.size() * 4);
    ggml_cgraph * gf = ggml_new_graph(cx);
    ggml_build_forward_expand(gf, c);
    ggml_backend_graph_compute(be, gf);
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; i++) ggml_backend_graph_compute(be, gf);
    auto t1 = std::chrono::steady_clock::now();
    double ms = std::chrono::duration<double, std::milli>(t1 - t0).count() / (reps > 0 ? reps : 1);
    std::vector<float> out((size_t) M * N);
    ggml_backend_tensor_get(c, out.data(), 0, out.size() * 4);
    FILE * f = fopen(argv[6], "wb"); fwrite(out.data(), 4, out.size(), f); fclose(f);
    printf("%s K=%d M=%d N=%d %.3f ms\n", tname.c_str(), K, M, N, ms);
    ggml_backend_buffer_free(wb); ggml_backend_buffer_free(xb);
    return 0;
}
