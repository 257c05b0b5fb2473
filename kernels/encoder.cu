// Token + position embedding. out: (B,T,C) = wte[inp] + wpe[t]; backward scatters with atomics.
#include "common.cuh"

template <typename T>
__device__ void encoder_forward(T* out, const unsigned int* inp, const T* wte, const T* wpe, int BT, int T_, int C) {
    long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long)BT * C) return;
    int bt = idx / C, c = idx % C, t = bt % T_;
    store_f32(out, idx, load_f32(wte, (long)inp[bt] * C + c) + load_f32(wpe, (long)t * C + c));
}

// dwte (V,C) += scatter of dout by token; dwpe (maxT,C) += dout summed over the batch.
template <typename T>
__device__ void encoder_backward(T* dwte, T* dwpe, const T* dout, const unsigned int* inp, int BT, int T_, int C) {
    long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long)BT * C) return;
    int bt = idx / C, c = idx % C, t = bt % T_;
    float d = load_f32(dout, idx);
    atomic_add(dwte, (long)inp[bt] * C + c, d);
    atomic_add(dwpe, (long)t * C + c, d);
}

extern "C" __global__ void encoder_forward_f32(float* o, const unsigned int* i, const float* w, const float* p, int BT, int T, int C) { encoder_forward(o, i, w, p, BT, T, C); }
extern "C" __global__ void encoder_forward_bf16(bf16_t* o, const unsigned int* i, const bf16_t* w, const bf16_t* p, int BT, int T, int C) { encoder_forward(o, i, w, p, BT, T, C); }
extern "C" __global__ void encoder_forward_f16(f16_t* o, const unsigned int* i, const f16_t* w, const f16_t* p, int BT, int T, int C) { encoder_forward(o, i, w, p, BT, T, C); }
extern "C" __global__ void encoder_backward_f32(float* dw, float* dp, const float* d, const unsigned int* i, int BT, int T, int C) { encoder_backward(dw, dp, d, i, BT, T, C); }
extern "C" __global__ void encoder_backward_bf16(bf16_t* dw, bf16_t* dp, const bf16_t* d, const unsigned int* i, int BT, int T, int C) { encoder_backward(dw, dp, d, i, BT, T, C); }
extern "C" __global__ void encoder_backward_f16(f16_t* dw, f16_t* dp, const f16_t* d, const unsigned int* i, int BT, int T, int C) { encoder_backward(dw, dp, d, i, BT, T, C); }
