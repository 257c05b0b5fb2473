// Fused softmax + cross-entropy over rows of V, in f32 whatever the storage: losses[row] and
// the logit gradient (p - onehot) * dloss written in place over the logits. One block per row.
#include "common.cuh"

template <typename T>
__device__ void crossentropy_fused(T* logits, float* losses, const unsigned int* targets, float dloss, int N, int V) {
    int row = blockIdx.x;
    if (row >= N) return;
    __shared__ float red[32];
    const long base = (long)row * V;
    float mx = NEG_INF;
    for (int i = threadIdx.x; i < V; i += blockDim.x) mx = fmaxf(mx, load_f32(logits, base + i));
    mx = block_max(mx, red);
    float s = 0.f;
    for (int i = threadIdx.x; i < V; i += blockDim.x) s += expf(load_f32(logits, base + i) - mx);
    float sum = block_sum(s, red);
    unsigned int tgt = targets[row];
    if (threadIdx.x == 0) losses[row] = -(load_f32(logits, base + tgt) - mx - logf(sum));
    __syncthreads();
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        float p = expf(load_f32(logits, base + i) - mx) / sum;
        store_f32(logits, base + i, (p - (i == (int)tgt ? 1.f : 0.f)) * dloss);
    }
}

extern "C" __global__ void crossentropy_fused_f32(float* l, float* loss, const unsigned int* t, float d, int N, int V) { crossentropy_fused(l, loss, t, d, N, V); }
extern "C" __global__ void crossentropy_fused_bf16(bf16_t* l, float* loss, const unsigned int* t, float d, int N, int V) { crossentropy_fused(l, loss, t, d, N, V); }
