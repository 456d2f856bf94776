// check_tiled: ggml mul_mat of a random quantized matrix against N random f32 columns;
// writes the result bytes (for bit comparison between ggml builds) and times it.
#include "ggml.h"
#include "ggml-cpu.h"
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <chrono>
#include <random>
#include <vector>
#include <string>

int main(int argc, char ** argv) {
    if (argc < 7) { fprintf(stderr, "usage: mm TYPE K M N REPS OUT\n"); return 2; }
    std::string tname = argv[1];
    int K = atoi(argv[2]), M = atoi(argv[3]), N = atoi(argv[4]), reps = atoi(argv[5]);
    ggml_type t = tname == "q4_K" ? GGML_TYPE_Q4_K : tname == "q6_K" ? GGML_TYPE_Q6_K : tname == "q5_K" ? GGML_TYPE_Q5_K : tname == "q3_K" ? GGML_TYPE_Q3_K : tname == "q2_K" ? GGML_TYPE_Q2_K : GGML_TYPE_IQ4_XS;
    size_t need = ggml_row_size(t, K) * M + (size_t) K * N * 4 * 2 + (size_t) M * N * 4 + 64 * 1024 * 1024;
    ggml_init_params ip = { need, nullptr, false };
    ggml_context * ctx = ggml_init(ip);
    ggml_tensor * a = ggml_new_tensor_2d(ctx, t, K, M);
    ggml_tensor * b = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, K, N);
    std::mt19937 rng(1234);
    std::normal_distribution<float> nd(0.f, 1.f);
    std::vector<float> w((size_t) K * M);
    for (auto & x : w) x = nd(rng) * 0.05f;
    ggml_quantize_chunk(t, w.data(), a->data, 0, M, K, nullptr);
    // columns: column j is seeded by j only, so column j is the same for any N
    for (int j = 0; j < N; j++) {
        std::mt19937 r2(777 + j);
        float * col = (float *) ((char *) b->data + j * b->nb[1]);
        for (int k = 0; k < K; k++) col[k] = nd(r2);
    }
    ggml_tensor * c = ggml_mul_mat(ctx, a, b);
    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, c);
    int nth = getenv("NTH") ? atoi(getenv("NTH")) : 2;
    ggml_graph_compute_with_ctx(ctx, gf, nth);
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; i++) ggml_graph_compute_with_ctx(ctx, gf, nth);
    auto t1 = std::chrono::steady_clock::now();
    double ms = std::chrono::duration<double, std::milli>(t1 - t0).count() / (reps > 0 ? reps : 1);
    FILE * f = fopen(argv[6], "wb"); fwrite(c->data, 4, (size_t) M * N, f); fclose(f);
    printf("%s K=%d M=%d N=%d %.3f ms\n", tname.c_str(), K, M, N, ms);
    return 0;
}
