// Global gradient norm: per-block partial sums of squares (a second pass sums the partials).
#include "common.cuh"

template <typename T>
__device__ void sum_squares(float* partial, const T* x, long N) {
    __shared__ float red[32];
    float s = 0.f;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < N; i += (long)gridDim.x * blockDim.x) {
        float v = load_f32(x, i);
        s += v * v;
    }
    s = block_sum(s, red);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

extern "C" __global__ void sum_squares_f32(float* p, const float* x, long N) { sum_squares(p, x, N); }
extern "C" __global__ void sum_squares_bf16(float* p, const bf16_t* x, long N) { sum_squares(p, x, N); }
extern "C" __global__ void sum_squares_f16(float* p, const f16_t* x, long N) { sum_squares(p, x, N); }
