// Precision casts between the f32 master / accumulators and 16-bit storage (bf16, fp16).
#include "common.cuh"

template <typename T>
__device__ void cast_from_f32(T* out, const float* in, long N) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N) store_f32(out, i, in[i]);
}

template <typename T>
__device__ void cast_to_f32(float* out, const T* in, long N) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N) out[i] = load_f32(in, i);
}

extern "C" __global__ void cast_f32_to_bf16(bf16_t* out, const float* in, long N) { cast_from_f32(out, in, N); }
extern "C" __global__ void cast_bf16_to_f32(float* out, const bf16_t* in, long N) { cast_to_f32(out, in, N); }
extern "C" __global__ void cast_f32_to_f16(f16_t* out, const float* in, long N) { cast_from_f32(out, in, N); }
extern "C" __global__ void cast_f16_to_f32(float* out, const f16_t* in, long N) { cast_to_f32(out, in, N); }
