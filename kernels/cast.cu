// Precision casts between the f32 master / accumulators and bf16 storage.
#include "common.cuh"

extern "C" __global__ void cast_f32_to_bf16(bf16_t* out, const float* in, long N) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N) store_f32(out, i, in[i]);
}
extern "C" __global__ void cast_bf16_to_f32(float* out, const bf16_t* in, long N) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N) out[i] = load_f32(in, i);
}
// dst += src (f32 accumulators into storage), used for parameter-gradient accumulation.
extern "C" __global__ void accumulate_f32(float* dst, const float* src, long N) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N) dst[i] += src[i];
}
extern "C" __global__ void accumulate_bf16(bf16_t* dst, const float* src, long N) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N) store_f32(dst, i, load_f32(dst, i) + src[i]);
}
