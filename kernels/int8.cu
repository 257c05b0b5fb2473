// int8 transfer packing for activation offload: one scale (absmax / 127) per row of C; and the
// 4-bit weights of quantized inference, two per byte (low nibble first), a scale per group.
#include "common.cuh"

template <typename T>
__device__ void pack_int8(signed char* q, float* scales, const T* x, int rows, int C) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= rows) return;
    const long base = (long)row * C;
    float amax = 0.f;
    for (int i = lane; i < C; i += 32) amax = fmaxf(amax, fabsf(load_f32(x, base + i)));
    amax = warp_max(amax);
    float scale = amax > 0.f ? amax / 127.f : 1.f;
    for (int i = lane; i < C; i += 32)
        q[base + i] = (signed char)fmaxf(-127.f, fminf(127.f, roundf(load_f32(x, base + i) / scale)));
    if (lane == 0) scales[row] = scale;
}

template <typename T>
__device__ void unpack_int8(T* x, const signed char* q, const float* scales, int rows, int C) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)rows * C) return;
    store_f32(x, i, (float)q[i] * scales[i / C]);
}

extern "C" __global__ void pack_int8_f32(signed char* q, float* s, const float* x, int rows, int C) { pack_int8(q, s, x, rows, C); }
extern "C" __global__ void pack_int8_bf16(signed char* q, float* s, const bf16_t* x, int rows, int C) { pack_int8(q, s, x, rows, C); }
extern "C" __global__ void pack_int8_f16(signed char* q, float* s, const f16_t* x, int rows, int C) { pack_int8(q, s, x, rows, C); }
extern "C" __global__ void unpack_int8_f32(float* x, const signed char* q, const float* s, int rows, int C) { unpack_int8(x, q, s, rows, C); }
extern "C" __global__ void unpack_int8_bf16(bf16_t* x, const signed char* q, const float* s, int rows, int C) { unpack_int8(x, q, s, rows, C); }
extern "C" __global__ void unpack_int8_f16(f16_t* x, const signed char* q, const float* s, int rows, int C) { unpack_int8(x, q, s, rows, C); }

template <typename T>
__device__ void unpack_int4(T* x, const unsigned char* packed, const float* scales, long N, int group) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= N) return;
    int byte = packed[i / 2];
    int v = (i % 2 == 0) ? (byte & 0xf) : (byte >> 4);
    v = v >= 8 ? v - 16 : v;
    store_f32(x, i, (float)v * scales[i / group]);
}

extern "C" __global__ void unpack_int4_f32(float* x, const unsigned char* p, const float* s, long N, int group) { unpack_int4(x, p, s, N, group); }
extern "C" __global__ void unpack_int4_bf16(bf16_t* x, const unsigned char* p, const float* s, long N, int group) { unpack_int4(x, p, s, N, group); }
extern "C" __global__ void unpack_int4_f16(f16_t* x, const unsigned char* p, const float* s, long N, int group) { unpack_int4(x, p, s, N, group); }
