// Token + position embedding. out: (B,T,C) = wte[inp] + wpe[t]; backward scatters the token
// rows' gradients with atomics and sums the positions' over the batch in order.
#include "common.cuh"

template <typename T>
__device__ void encoder_forward(T* out, const unsigned int* inp, const T* wte, const T* wpe, int BT, int T_, int C) {
    long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long)BT * C) return;
    int bt = idx / C, c = idx % C, t = bt % T_;
    store_f32(out, idx, load_f32(wte, (long)inp[bt] * C + c) + load_f32(wpe, (long)t * C + c));
}

// dwte (V,C) += scatter of dout by token (atomics: a token's rows come in any order).
template <typename T>
__device__ void encoder_backward_wte(T* dwte, const T* dout, const unsigned int* inp, int BT, int C) {
    long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long)BT * C) return;
    int bt = idx / C, c = idx % C;
    atomic_add(dwte, (long)inp[bt] * C + c, load_f32(dout, idx));
}

// dwpe (maxT,C) += dout summed over the batch, for positions t < T: one thread per (t, c), the
// sequences in order, rounded to the storage type at each add — the CPU reference's order and
// roundings, bit for bit, with no atomics.
template <typename T>
__device__ void encoder_backward_wpe(T* dwpe, const T* dout, int B, int T_, int C) {
    long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    const long TC = (long)T_ * C;
    if (idx >= TC) return;
    T acc = dwpe[idx];
    for (int b = 0; b < B; b++) store_f32(&acc, 0, load_f32(&acc, 0) + load_f32(dout, b * TC + idx));
    dwpe[idx] = acc;
}

extern "C" __global__ void encoder_forward_f32(float* o, const unsigned int* i, const float* w, const float* p, int BT, int T, int C) { encoder_forward(o, i, w, p, BT, T, C); }
extern "C" __global__ void encoder_forward_bf16(bf16_t* o, const unsigned int* i, const bf16_t* w, const bf16_t* p, int BT, int T, int C) { encoder_forward(o, i, w, p, BT, T, C); }
extern "C" __global__ void encoder_forward_f16(f16_t* o, const unsigned int* i, const f16_t* w, const f16_t* p, int BT, int T, int C) { encoder_forward(o, i, w, p, BT, T, C); }
extern "C" __global__ void encoder_backward_wte_f32(float* dw, const float* d, const unsigned int* i, int BT, int C) { encoder_backward_wte(dw, d, i, BT, C); }
extern "C" __global__ void encoder_backward_wte_bf16(bf16_t* dw, const bf16_t* d, const unsigned int* i, int BT, int C) { encoder_backward_wte(dw, d, i, BT, C); }
extern "C" __global__ void encoder_backward_wte_f16(f16_t* dw, const f16_t* d, const unsigned int* i, int BT, int C) { encoder_backward_wte(dw, d, i, BT, C); }
extern "C" __global__ void encoder_backward_wpe_f32(float* dp, const float* d, int B, int T, int C) { encoder_backward_wpe(dp, d, B, T, C); }
extern "C" __global__ void encoder_backward_wpe_bf16(bf16_t* dp, const bf16_t* d, int B, int T, int C) { encoder_backward_wpe(dp, d, B, T, C); }
extern "C" __global__ void encoder_backward_wpe_f16(f16_t* dp, const f16_t* d, int B, int T, int C) { encoder_backward_wpe(dp, d, B, T, C); }
