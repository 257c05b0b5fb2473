// LayerNorm over rows of C: one warp per row. Statistics (mean, rstd) are always f32.
#include "common.cuh"

template <typename T>
__device__ void layernorm_forward(T* out, float* mean, float* rstd, const T* inp, const T* w, const T* b, int N, int C) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= N) return;
    const long base = (long)row * C;
    float s = 0.f;
    for (int i = lane; i < C; i += 32) s += load_f32(inp, base + i);
    float m = warp_sum(s) / C;
    float v = 0.f;
    for (int i = lane; i < C; i += 32) { float d = load_f32(inp, base + i) - m; v += d * d; }
    float r = rsqrtf(warp_sum(v) / C + 1e-5f);
    for (int i = lane; i < C; i += 32)
        store_f32(out, base + i, (load_f32(inp, base + i) - m) * r * load_f32(w, i) + load_f32(b, i));
    if (lane == 0) { mean[row] = m; rstd[row] = r; }
}

// dinp += ...; dweight, dbias: f32 accumulators.
template <typename T>
__device__ void layernorm_backward(T* dinp, float* dw, float* db, const T* dout, const T* inp, const T* w,
                                   const float* mean, const float* rstd, int N, int C) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= N) return;
    const long base = (long)row * C;
    float m = mean[row], r = rstd[row];
    float a = 0.f, bsum = 0.f;
    for (int i = lane; i < C; i += 32) {
        float n = (load_f32(inp, base + i) - m) * r;
        float dn = load_f32(w, i) * load_f32(dout, base + i);
        a += dn; bsum += dn * n;
    }
    a = warp_sum(a) / C; bsum = warp_sum(bsum) / C;
    for (int i = lane; i < C; i += 32) {
        float d = load_f32(dout, base + i);
        float n = (load_f32(inp, base + i) - m) * r;
        float dn = load_f32(w, i) * d;
        store_f32(dinp, base + i, load_f32(dinp, base + i) + (dn - a - n * bsum) * r);
        atomicAdd(&db[i], d);
        atomicAdd(&dw[i], n * d);
    }
}

extern "C" __global__ void layernorm_forward_f32(float* o, float* m, float* r, const float* x, const float* w, const float* b, int N, int C) { layernorm_forward(o, m, r, x, w, b, N, C); }
extern "C" __global__ void layernorm_forward_bf16(bf16_t* o, float* m, float* r, const bf16_t* x, const bf16_t* w, const bf16_t* b, int N, int C) { layernorm_forward(o, m, r, x, w, b, N, C); }
extern "C" __global__ void layernorm_backward_f32(float* dx, float* dw, float* db, const float* d, const float* x, const float* w, const float* m, const float* r, int N, int C) { layernorm_backward(dx, dw, db, d, x, w, m, r, N, C); }
extern "C" __global__ void layernorm_backward_bf16(bf16_t* dx, float* dw, float* db, const bf16_t* d, const bf16_t* x, const bf16_t* w, const float* m, const float* r, int N, int C) { layernorm_backward(dx, dw, db, d, x, w, m, r, N, C); }
