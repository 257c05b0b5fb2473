// AdamW on fp32 master weights from gradients in the storage type (unscaling and clipping
// folded into grad_mult); writes the updated compute copy of the weights.
#include "common.cuh"

template <typename G, typename P>
__device__ void adamw(float* master, P* params, const G* grads, float* m, float* v, long N, float lr, float beta1,
                      float beta2, float eps, float wd, float bc1, float bc2, float grad_mult) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= N) return;
    float g = load_f32(grads, i) * grad_mult;
    float mi = beta1 * m[i] + (1.f - beta1) * g;
    float vi = beta2 * v[i] + (1.f - beta2) * g * g;
    m[i] = mi; v[i] = vi;
    float w = master[i];
    w -= lr * ((mi / bc1) / (sqrtf(vi / bc2) + eps) + wd * w);
    master[i] = w;
    store_f32(params, i, w);
}

extern "C" __global__ void adamw_f32(float* w, float* p, const float* g, float* m, float* v, long N, float lr, float b1, float b2, float eps, float wd, float bc1, float bc2, float gm) { adamw(w, p, g, m, v, N, lr, b1, b2, eps, wd, bc1, bc2, gm); }
extern "C" __global__ void adamw_bf16(float* w, bf16_t* p, const bf16_t* g, float* m, float* v, long N, float lr, float b1, float b2, float eps, float wd, float bc1, float bc2, float gm) { adamw(w, p, g, m, v, N, lr, b1, b2, eps, wd, bc1, bc2, gm); }
extern "C" __global__ void adamw_f16(float* w, f16_t* p, const f16_t* g, float* m, float* v, long N, float lr, float b1, float b2, float eps, float wd, float bc1, float bc2, float gm) { adamw(w, p, g, m, v, N, lr, b1, b2, eps, wd, bc1, bc2, gm); }
