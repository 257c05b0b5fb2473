// Causal softmax over attention scores (the Q·Kᵀ and att·V products go through cuBLAS).
// One warp per (b, h, t) row of length T; entries above the diagonal are written as zero.
#include "common.cuh"

template <typename T>
__device__ void softmax_causal_forward(T* att, const float* preatt, float scale, int rows, int T_) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= rows) return;
    int t = row % T_;
    const long base = (long)row * T_;
    float mx = NEG_INF;
    for (int i = lane; i <= t; i += 32) mx = fmaxf(mx, preatt[base + i] * scale);
    mx = warp_max(mx);
    float s = 0.f;
    for (int i = lane; i <= t; i += 32) s += expf(preatt[base + i] * scale - mx);
    float inv = 1.f / warp_sum(s);
    for (int i = lane; i < T_; i += 32)
        store_f32(att, base + i, i <= t ? expf(preatt[base + i] * scale - mx) * inv : 0.f);
}

// dpreatt[i] = att[i] * (datt[i] - Σ att·datt) * scale
template <typename T>
__device__ void softmax_causal_backward(float* dpreatt, const float* datt, const T* att, float scale, int rows, int T_) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= rows) return;
    int t = row % T_;
    const long base = (long)row * T_;
    float s = 0.f;
    for (int i = lane; i <= t; i += 32) s += load_f32(att, base + i) * datt[base + i];
    s = warp_sum(s);
    for (int i = lane; i < T_; i += 32)
        dpreatt[base + i] = i <= t ? load_f32(att, base + i) * (datt[base + i] - s) * scale : 0.f;
}

extern "C" __global__ void softmax_causal_forward_f32(float* a, const float* p, float s, int rows, int T) { softmax_causal_forward(a, p, s, rows, T); }
extern "C" __global__ void softmax_causal_forward_bf16(bf16_t* a, const float* p, float s, int rows, int T) { softmax_causal_forward(a, p, s, rows, T); }
extern "C" __global__ void softmax_causal_backward_f32(float* dp, const float* da, const float* a, float s, int rows, int T) { softmax_causal_backward(dp, da, a, s, rows, T); }
extern "C" __global__ void softmax_causal_backward_bf16(float* dp, const float* da, const bf16_t* a, float s, int rows, int T) { softmax_causal_backward(dp, da, a, s, rows, T); }
