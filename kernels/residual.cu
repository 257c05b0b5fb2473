// out += inp (residual connections), and the matmul bias: broadcast over rows before the GEMM
// accumulates into it (one rounding, as the CPU reference), and its gradient as column sums.
#include "common.cuh"

template <typename T>
__device__ void residual_forward(T* out, const T* inp, long N) {
    constexpr int P = PACK(T);
    const long i0 = pack_start<P>();
    if (i0 >= N) return;
    const bool whole = i0 + P <= N && aligned16(out) && aligned16(inp);
    float o[P], x[P];
    load_pack(o, out, i0, N, whole);
    load_pack(x, inp, i0, N, whole);
    UNROLL for (int u = 0; u < P; u++) o[u] += x[u];
    store_pack(out, i0, N, o, whole);
}

// out (rows,OC) = bias (OC) in every row: a pack lies within one row when OC is a multiple of it.
template <typename T>
__device__ void bias_broadcast(T* out, const T* bias, long rows, int OC) {
    constexpr int P = PACK(T);
    const long i0 = pack_start<P>(), N = rows * OC;
    if (i0 >= N) return;
    if (i0 + P <= N && OC % P == 0 && aligned16(out) && aligned16(bias)) {
        copy_pack<P>(out + i0, bias + i0 % OC);
    } else {
        for (long i = i0; i < i0 + P && i < N; i++) out[i] = bias[i % OC];
    }
}

// dbias (OC) += Σ_rows dout (rows,OC), stage one: partial (bands, OC) f32, each band's column
// sums. Block (32, 16): 32 packs of PACK(T) columns (16-byte loads where the rows allow), 16
// row strides through the band, reduced in shared memory — per column, rows in the same order
// either way.
template <typename T>
__device__ void bias_backward_partial(float* partial, const T* dout, int rows, int OC, int band) {
    constexpr int P = PACK(T);
    __shared__ float s[16][32 * P + 1];
    const int col0 = (blockIdx.x * 32 + threadIdx.x) * P;
    const bool whole = OC % P == 0 && aligned16(dout);
    const int end = band_end(rows, band);
    float a[P];
    UNROLL for (int u = 0; u < P; u++) a[u] = 0.f;
    if (col0 < OC)
        for (int row = blockIdx.y * band + threadIdx.y; row < end; row += blockDim.y) {
            float d[P];
            load_pack(d, dout + (long)row * OC, col0, OC, whole);
            UNROLL for (int u = 0; u < P; u++) a[u] += d[u];
        }
    UNROLL for (int u = 0; u < P; u++) s[threadIdx.y][threadIdx.x * P + u] = a[u];
    __syncthreads();
    if (threadIdx.y == 0)
        for (int u = 0; u < P && col0 + u < OC; u++) {
            float sum = 0.f;
            for (int y = 0; y < blockDim.y; y++) sum += s[y][threadIdx.x * P + u];
            partial[(long)blockIdx.y * OC + col0 + u] = sum;
        }
}

extern "C" __global__ void residual_forward_f32(float* o, const float* x, long N) { residual_forward(o, x, N); }
extern "C" __global__ void residual_forward_bf16(bf16_t* o, const bf16_t* x, long N) { residual_forward(o, x, N); }
extern "C" __global__ void residual_forward_f16(f16_t* o, const f16_t* x, long N) { residual_forward(o, x, N); }
extern "C" __global__ void bias_broadcast_f32(float* o, const float* b, long rows, int OC) { bias_broadcast(o, b, rows, OC); }
extern "C" __global__ void bias_broadcast_bf16(bf16_t* o, const bf16_t* b, long rows, int OC) { bias_broadcast(o, b, rows, OC); }
extern "C" __global__ void bias_broadcast_f16(f16_t* o, const f16_t* b, long rows, int OC) { bias_broadcast(o, b, rows, OC); }
extern "C" __global__ void bias_backward_partial_f32(float* p, const float* d, int rows, int OC, int band) { bias_backward_partial(p, d, rows, OC, band); }
extern "C" __global__ void bias_backward_partial_bf16(float* p, const bf16_t* d, int rows, int OC, int band) { bias_backward_partial(p, d, rows, OC, band); }
extern "C" __global__ void bias_backward_partial_f16(float* p, const f16_t* d, int rows, int OC, int band) { bias_backward_partial(p, d, rows, OC, band); }
extern "C" __global__ void column_partials_add_f32(float* dst, const float* p, int bands, int C) { column_partials_add(dst, p, bands, C); }
extern "C" __global__ void column_partials_add_bf16(bf16_t* dst, const float* p, int bands, int C) { column_partials_add(dst, p, bands, C); }
extern "C" __global__ void column_partials_add_f16(f16_t* dst, const float* p, int bands, int C) { column_partials_add(dst, p, bands, C); }
