// out += inp (residual connections), and bias broadcast over rows for matmul outputs.
#include "common.cuh"

template <typename T>
__device__ void residual_forward(T* out, const T* inp, long N) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N) store_f32(out, i, load_f32(out, i) + load_f32(inp, i));
}

template <typename T>
__device__ void bias_add(T* out, const T* bias, long rows, int OC) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < rows * OC) store_f32(out, i, load_f32(out, i) + load_f32(bias, i % OC));
}

extern "C" __global__ void residual_forward_f32(float* o, const float* x, long N) { residual_forward(o, x, N); }
extern "C" __global__ void residual_forward_bf16(bf16_t* o, const bf16_t* x, long N) { residual_forward(o, x, N); }
extern "C" __global__ void bias_add_f32(float* o, const float* b, long rows, int OC) { bias_add(o, b, rows, OC); }
extern "C" __global__ void bias_add_bf16(bf16_t* o, const bf16_t* b, long rows, int OC) { bias_add(o, b, rows, OC); }
