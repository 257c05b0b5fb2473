// GELU (tanh approximation) forward and in-place backward.
#include "common.cuh"
#define GELU_SCALE 0.7978845608f

template <typename T>
__device__ void gelu_forward(T* out, const T* inp, long N) {
    constexpr int P = PACK(T);
    const long i0 = pack_start<P>();
    if (i0 >= N) return;
    const bool whole = i0 + P <= N && aligned16(out) && aligned16(inp);
    float x[P], y[P];
    load_pack(x, inp, i0, N, whole);
    UNROLL for (int u = 0; u < P; u++) y[u] = 0.5f * x[u] * (1.f + tanhf(GELU_SCALE * (x[u] + 0.044715f * x[u] * x[u] * x[u])));
    store_pack(out, i0, N, y, whole);
}

template <typename T>
__device__ void gelu_backward_inplace(T* dinout, const T* inp, long N) {
    constexpr int P = PACK(T);
    const long i0 = pack_start<P>();
    if (i0 >= N) return;
    const bool whole = i0 + P <= N && aligned16(dinout) && aligned16(inp);
    float x[P], d[P];
    load_pack(x, inp, i0, N, whole);
    load_pack(d, dinout, i0, N, whole);
    UNROLL for (int u = 0; u < P; u++) {
        float th = tanhf(GELU_SCALE * (x[u] + 0.044715f * x[u] * x[u] * x[u]));
        float local = 0.5f * (1.f + th) + x[u] * 0.5f * (1.f - th * th) * GELU_SCALE * (1.f + 3.f * 0.044715f * x[u] * x[u]);
        d[u] *= local;
    }
    store_pack(dinout, i0, N, d, whole);
}

extern "C" __global__ void gelu_forward_f32(float* o, const float* x, long N) { gelu_forward(o, x, N); }
extern "C" __global__ void gelu_forward_bf16(bf16_t* o, const bf16_t* x, long N) { gelu_forward(o, x, N); }
extern "C" __global__ void gelu_forward_f16(f16_t* o, const f16_t* x, long N) { gelu_forward(o, x, N); }
extern "C" __global__ void gelu_backward_f32(float* d, const float* x, long N) { gelu_backward_inplace(d, x, N); }
extern "C" __global__ void gelu_backward_bf16(bf16_t* d, const bf16_t* x, long N) { gelu_backward_inplace(d, x, N); }
extern "C" __global__ void gelu_backward_f16(f16_t* d, const f16_t* x, long N) { gelu_backward_inplace(d, x, N); }
