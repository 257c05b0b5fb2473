// Shared helpers for every kernel family: bf16 and fp16 stored as raw 16-bit words (no CUDA
// headers needed under NVRTC), converted to and from f32 with round-to-nearest-even — bf16 by
// bit arithmetic, fp16 by the hardware's cvt instructions. fp16 is a struct so the two 16-bit
// types overload apart.
#pragma once
#define NEG_INF __int_as_float(0xff800000)
// Unroll a loop of constant trip count (its arrays then stay in registers).
#ifndef HEADROOM_EMULATE
#define UNROLL _Pragma("unroll")
#else
#define UNROLL
#endif
typedef unsigned short bf16_t;
struct f16_t { unsigned short bits; };

__device__ __forceinline__ float load_f32(const float* p, long i) { return p[i]; }
__device__ __forceinline__ float load_f32(const bf16_t* p, long i) {
    return __uint_as_float(((unsigned int)p[i]) << 16);
}
__device__ __forceinline__ void store_f32(float* p, long i, float v) { p[i] = v; }
__device__ __forceinline__ void store_f32(bf16_t* p, long i, float v) {
    unsigned int u = __float_as_uint(v);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x7fffffu)) { p[i] = (bf16_t)((u >> 16) | 0x40); return; }
    u += 0x7fffu + ((u >> 16) & 1u);
    p[i] = (bf16_t)(u >> 16);
}

#ifndef HEADROOM_EMULATE
__device__ __forceinline__ float load_f32(const f16_t* p, long i) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(p[i].bits));
    return f;
}
__device__ __forceinline__ void store_f32(f16_t* p, long i, float v) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    p[i].bits = h;
}
#else
// The host emulator (tests/cuda_emulator) converts in software, rounding to nearest even.
__device__ __forceinline__ float load_f32(const f16_t* p, long i) { return emulate_f16_to_f32(p[i].bits); }
__device__ __forceinline__ void store_f32(f16_t* p, long i, float v) { p[i].bits = emulate_f32_to_f16(v); }
#endif

// The raw 16 bits of either half type, read and written alike.
__device__ __forceinline__ unsigned short bits_of(bf16_t v) { return v; }
__device__ __forceinline__ unsigned short bits_of(f16_t v) { return v.bits; }
__device__ __forceinline__ void set_bits(bf16_t* v, unsigned short b) { *v = b; }
__device__ __forceinline__ void set_bits(f16_t* v, unsigned short b) { v->bits = b; }

// Element-wise kernels move PACK(T) elements per thread (16 bytes of their storage type T):
// as 128-bit loads and stores when the pack is whole and every array it touches is 16-byte
// aligned (pool buffers are; a view at an odd offset may not be), element by element otherwise
// (that, and the tail past N). The host launches `cuda::backend::packed(N, sizeof(T))`.
#define PACK(T) ((int)(16 / sizeof(T)))
struct alignas(16) Bytes16 { unsigned int w[4]; };

__device__ __forceinline__ bool aligned16(const void* p) { return ((size_t)p & 15) == 0; }

// This thread's first element: a multiple of P.
template <int P>
__device__ __forceinline__ long pack_start() { return ((long)blockIdx.x * blockDim.x + threadIdx.x) * P; }

// 16 bytes from src to dst (both 16-byte aligned): one 128-bit load and store.
__device__ __forceinline__ void copy16(void* dst, const void* src) {
#ifndef HEADROOM_EMULATE
    *(Bytes16*)dst = *(const Bytes16*)src;
#else
    std::memcpy(dst, src, 16);
#endif
}

// P consecutive elements of T from src to dst (both 16-byte aligned), in 16-byte chunks.
template <int P, typename T>
__device__ __forceinline__ void copy_pack(T* dst, const T* src) {
    static_assert((P * sizeof(T)) % 16 == 0, "a pack is whole 16-byte chunks");
    UNROLL for (int k = 0; k < P * (int)sizeof(T) / 16; k++) copy16((Bytes16*)dst + k, (const Bytes16*)src + k);
}

// P elements of T in registers, aligned as a pack in memory is.
template <int P, typename T>
struct alignas(16) PackOf {
    T v[P];
};

// x[u] = p[i0 + u], u < P, widened to f32 (0 past N).
template <int P, typename T>
__device__ __forceinline__ void load_pack(float (&x)[P], const T* p, long i0, long N, bool whole) {
    if (whole) {
        PackOf<P, T> pk;
        copy_pack<P>(pk.v, p + i0);
        UNROLL for (int u = 0; u < P; u++) x[u] = load_f32(pk.v, u);
    } else {
        for (int u = 0; u < P; u++) x[u] = i0 + u < N ? load_f32(p, i0 + u) : 0.f;
    }
}

// p[i0 + u] = x[u] rounded to T, u < P (nothing past N).
template <int P, typename T>
__device__ __forceinline__ void store_pack(T* p, long i0, long N, const float (&x)[P], bool whole) {
    if (whole) {
        PackOf<P, T> pk;
        UNROLL for (int u = 0; u < P; u++) store_f32(pk.v, u, x[u]);
        copy_pack<P>(p + i0, pk.v);
    } else {
        for (int u = 0; u < P; u++) if (i0 + u < N) store_f32(p, i0 + u, x[u]);
    }
}

// Column sums in two stages, so every SM works on a tall (rows, C) tensor: stage one's blocks
// (32 columns × a band of rows each, grid (⌈C/32⌉, bands)) write f32 partial sums, one row of
// `partial` (bands, C) per band; stage two adds each column's partials, in band order, to the
// stored value, rounding once.
template <typename T>
__device__ void column_partials_add(T* dst, const float* partial, int bands, int C) {
    int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= C) return;
    float sum = 0.f;
    for (int r = 0; r < bands; r++) sum += partial[(long)r * C + col];
    store_f32(dst, col, load_f32(dst, col) + sum);
}

// The rows of band blockIdx.y of `band` rows each, within `rows`.
__device__ __forceinline__ int band_end(int rows, int band) { return min(rows, (blockIdx.y + 1) * band); }

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Block-wide reductions (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ __forceinline__ float block_sum(float v, float* red) {
    v = warp_sum(v);
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
    __syncthreads();
    float r = threadIdx.x < blockDim.x / 32 ? red[threadIdx.x] : 0.f;
    if (threadIdx.x < 32) r = warp_sum(r);
    if (threadIdx.x == 0) red[0] = r;
    __syncthreads();
    r = red[0];
    __syncthreads();
    return r;
}
__device__ __forceinline__ float block_max(float v, float* red) {
    v = warp_max(v);
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
    __syncthreads();
    float r = threadIdx.x < blockDim.x / 32 ? red[threadIdx.x] : NEG_INF;
    if (threadIdx.x < 32) r = warp_max(r);
    if (threadIdx.x == 0) red[0] = r;
    __syncthreads();
    r = red[0];
    __syncthreads();
    return r;
}

// Tensor cores: d (16×8, f32) += a (16×16, row-major) · b (16×8, column-major), one warp, 16-bit
// inputs of the storage type. Fragments per lane (g = lane / 4, q = lane % 4), each 32-bit
// register two elements, the lower-indexed in the low half: a[0] row g, columns 2q, 2q+1;
// a[1] row g+8, the same columns; a[2] row g, columns 2q+8, 2q+9; a[3] row g+8, those. b[0]
// rows 2q, 2q+1 of column g; b[1] rows 2q+8, 2q+9. d[0], d[1] row g, columns 2q, 2q+1; d[2],
// d[3] row g+8. (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type".)
#ifndef HEADROOM_EMULATE
__device__ __forceinline__ void mma_16x8x16(float* d, const unsigned* a, const unsigned* b, bf16_t) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void mma_16x8x16(float* d, const unsigned* a, const unsigned* b, f16_t) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#else
template <typename H>
__device__ __forceinline__ void mma_16x8x16(float* d, const unsigned* a, const unsigned* b, H) { emulate_mma_16x8x16<H>(d, a, b); }
#endif

// Two values of a 16-bit storage type in one register for mma: lo in the low half.
template <typename H>
__device__ __forceinline__ unsigned pack_pair(float lo, float hi) {
    H l, h;
    store_f32(&l, 0, lo);
    store_f32(&h, 0, hi);
    return (unsigned)bits_of(l) | ((unsigned)bits_of(h) << 16);
}
// Elements i and i+1 of p (16-bit, i even, p 4-byte aligned) in one 32-bit load, lo = p[i].
template <typename H>
__device__ __forceinline__ unsigned load_pair_aligned(const H* p, long i) {
#ifndef HEADROOM_EMULATE
    return *(const unsigned*)(p + i);
#else
    if (i % 2 != 0 || (size_t)(p + i) % 4 != 0) emulate_fail("load_pair_aligned: element not 4-byte aligned");
    unsigned v;
    memcpy(&v, p + i, 4);
    return v;
#endif
}

