// AdamW on fp32 master weights from gradients in the storage type (unscaling and clipping
// folded into grad_mult); writes the updated compute copy of the weights.
#include "common.cuh"

// PACK(G) elements per thread (G the storage type; params may be the master itself in f32).
template <typename G, typename Q>
__device__ void adamw(float* master, Q* params, const G* grads, float* m, float* v, long N, float lr, float beta1,
                      float beta2, float eps, float wd, float bc1, float bc2, float grad_mult) {
    constexpr int P = PACK(G);
    const long i0 = pack_start<P>();
    if (i0 >= N) return;
    const bool whole = i0 + P <= N && aligned16(master) && aligned16(params) && aligned16(grads) && aligned16(m) &&
                       aligned16(v);
    float g[P], mi[P], vi[P], w[P];
    load_pack(g, grads, i0, N, whole);
    load_pack(mi, m, i0, N, whole);
    load_pack(vi, v, i0, N, whole);
    load_pack(w, master, i0, N, whole);
    UNROLL for (int u = 0; u < P; u++) {
        g[u] *= grad_mult;
        mi[u] = beta1 * mi[u] + (1.f - beta1) * g[u];
        vi[u] = beta2 * vi[u] + (1.f - beta2) * g[u] * g[u];
        w[u] -= lr * ((mi[u] / bc1) / (sqrtf(vi[u] / bc2) + eps) + wd * w[u]);
    }
    store_pack(m, i0, N, mi, whole);
    store_pack(v, i0, N, vi, whole);
    store_pack(master, i0, N, w, whole);
    store_pack(params, i0, N, w, whole);
}

extern "C" __global__ void adamw_f32(float* w, float* p, const float* g, float* m, float* v, long N, float lr, float b1, float b2, float eps, float wd, float bc1, float bc2, float gm) { adamw(w, p, g, m, v, N, lr, b1, b2, eps, wd, bc1, bc2, gm); }
extern "C" __global__ void adamw_bf16(float* w, bf16_t* p, const bf16_t* g, float* m, float* v, long N, float lr, float b1, float b2, float eps, float wd, float bc1, float bc2, float gm) { adamw(w, p, g, m, v, N, lr, b1, b2, eps, wd, bc1, bc2, gm); }
extern "C" __global__ void adamw_f16(float* w, f16_t* p, const f16_t* g, float* m, float* v, long N, float lr, float b1, float b2, float eps, float wd, float bc1, float bc2, float gm) { adamw(w, p, g, m, v, N, lr, b1, b2, eps, wd, bc1, bc2, gm); }
