// GELU (tanh approximation) forward and in-place backward.
#include "common.cuh"
#define GELU_SCALE 0.7978845608f

template <typename T>
__device__ void gelu_forward(T* out, const T* inp, long N) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= N) return;
    float x = load_f32(inp, i);
    store_f32(out, i, 0.5f * x * (1.f + tanhf(GELU_SCALE * (x + 0.044715f * x * x * x))));
}

template <typename T>
__device__ void gelu_backward_inplace(T* dinout, const T* inp, long N) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= N) return;
    float x = load_f32(inp, i);
    float th = tanhf(GELU_SCALE * (x + 0.044715f * x * x * x));
    float local = 0.5f * (1.f + th) + x * 0.5f * (1.f - th * th) * GELU_SCALE * (1.f + 3.f * 0.044715f * x * x);
    store_f32(dinout, i, load_f32(dinout, i) * local);
}

extern "C" __global__ void gelu_forward_f32(float* o, const float* x, long N) { gelu_forward(o, x, N); }
extern "C" __global__ void gelu_forward_bf16(bf16_t* o, const bf16_t* x, long N) { gelu_forward(o, x, N); }
extern "C" __global__ void gelu_forward_f16(f16_t* o, const f16_t* x, long N) { gelu_forward(o, x, N); }
extern "C" __global__ void gelu_backward_f32(float* d, const float* x, long N) { gelu_backward_inplace(d, x, N); }
extern "C" __global__ void gelu_backward_bf16(bf16_t* d, const bf16_t* x, long N) { gelu_backward_inplace(d, x, N); }
extern "C" __global__ void gelu_backward_f16(f16_t* d, const f16_t* x, long N) { gelu_backward_inplace(d, x, N); }
