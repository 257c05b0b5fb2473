// Softmax + cross-entropy over rows of V, in f32 whatever the storage. Forward: losses[row] and
// the probabilities in place over the logits (one block per row); backward: the probabilities
// turned into logit gradients (p - onehot) · dloss in place.
#include "common.cuh"

template <typename T>
__device__ void crossentropy_forward(T* logits, float* losses, const unsigned int* targets, int N, int V) {
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
    float target_logit = load_f32(logits, base + tgt);
    __syncthreads();
    if (threadIdx.x == 0) losses[row] = -(target_logit - mx - logf(sum));
    float inv = 1.f / sum;
    for (int i = threadIdx.x; i < V; i += blockDim.x) store_f32(logits, base + i, expf(load_f32(logits, base + i) - mx) * inv);
}

template <typename T>
__device__ void crossentropy_backward(T* probs, const unsigned int* targets, float dloss, int N, int V) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)N * V) return;
    int row = i / V, col = i % V;
    store_f32(probs, i, load_f32(probs, i) * dloss);
    if (col == (int)targets[row]) store_f32(probs, i, load_f32(probs, i) - dloss);
}

extern "C" __global__ void crossentropy_forward_f32(float* l, float* loss, const unsigned int* t, int N, int V) { crossentropy_forward(l, loss, t, N, V); }
extern "C" __global__ void crossentropy_forward_bf16(bf16_t* l, float* loss, const unsigned int* t, int N, int V) { crossentropy_forward(l, loss, t, N, V); }
extern "C" __global__ void crossentropy_forward_f16(f16_t* l, float* loss, const unsigned int* t, int N, int V) { crossentropy_forward(l, loss, t, N, V); }
extern "C" __global__ void crossentropy_backward_f32(float* p, const unsigned int* t, float d, int N, int V) { crossentropy_backward(p, t, d, N, V); }
extern "C" __global__ void crossentropy_backward_bf16(bf16_t* p, const unsigned int* t, float d, int N, int V) { crossentropy_backward(p, t, d, N, V); }
extern "C" __global__ void crossentropy_backward_f16(f16_t* p, const unsigned int* t, float d, int N, int V) { crossentropy_backward(p, t, d, N, V); }
