// out += inp (residual connections), and the matmul bias: broadcast over rows before the GEMM
// accumulates into it (one rounding, as the CPU reference), and its gradient as column sums.
#include "common.cuh"

template <typename T>
__device__ void residual_forward(T* out, const T* inp, long N) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N) store_f32(out, i, load_f32(out, i) + load_f32(inp, i));
}

// out (rows,OC) = bias (OC) in every row
template <typename T>
__device__ void bias_broadcast(T* out, const T* bias, long rows, int OC) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < rows * OC) out[i] = bias[i % OC];
}

// dbias (OC) += Σ_rows dout (rows,OC), stage one: partial (bands, OC) f32, each band's column
// sums. Block (32, 16): 32 columns, 16 row strides through the band, reduced in shared memory.
template <typename T>
__device__ void bias_backward_partial(float* partial, const T* dout, int rows, int OC, int band) {
    __shared__ float s[16][33];
    int col = blockIdx.x * 32 + threadIdx.x;
    int end = band_end(rows, band);
    float a = 0.f;
    if (col < OC)
        for (int row = blockIdx.y * band + threadIdx.y; row < end; row += blockDim.y) a += load_f32(dout, (long)row * OC + col);
    s[threadIdx.y][threadIdx.x] = a;
    __syncthreads();
    if (threadIdx.y == 0 && col < OC) {
        float sum = 0.f;
        for (int y = 0; y < blockDim.y; y++) sum += s[y][threadIdx.x];
        partial[(long)blockIdx.y * OC + col] = sum;
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
