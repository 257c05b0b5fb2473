// Softmax + cross-entropy over rows of V, in f32 whatever the storage, one block per row.
// Forward: losses[row] and the probabilities in place over the logits, in two passes over the
// row (each thread keeps a running maximum and its sum of exponentials, rescaled when the
// maximum grows; the block combines them); backward: the probabilities turned into logit
// gradients (p - onehot) · dloss in place.
#include "common.cuh"

template <typename T>
__device__ void crossentropy_forward(T* logits, float* losses, const unsigned int* targets, int N, int V) {
    int row = blockIdx.x;
    if (row >= N) return;
    __shared__ float red[32];
    const long base = (long)row * V;
    float m = NEG_INF, s = 0.f;  // this thread's maximum and Σ exp(x − m)
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        const float x = load_f32(logits, base + i);
        if (x > m) {
            s = s * expf(m - x) + 1.f;
            m = x;
        } else {
            s += expf(x - m);
        }
    }
    const float mx = block_max(m, red);
    // (a thread with no element, V < blockDim.x, adds 0 · exp(−inf) = 0)
    const float sum = block_sum(s * expf(m - mx), red);
    unsigned int tgt = targets[row];
    float target_logit = load_f32(logits, base + tgt);
    __syncthreads();
    if (threadIdx.x == 0) losses[row] = -(target_logit - mx - logf(sum));
    float inv = 1.f / sum;
    for (int i = threadIdx.x; i < V; i += blockDim.x) store_f32(logits, base + i, expf(load_f32(logits, base + i) - mx) * inv);
}

// One block per row (no per-element division to find it). The target's gradient is rounded
// twice, as the CPU reference rounds it: p · dloss, then that minus dloss.
template <typename T>
__device__ void crossentropy_backward(T* probs, const unsigned int* targets, float dloss, int N, int V) {
    const int row = blockIdx.x;
    if (row >= N) return;
    const long base = (long)row * V;
    const int target = (int)targets[row];
    for (int col = threadIdx.x; col < V; col += blockDim.x) {
        store_f32(probs, base + col, load_f32(probs, base + col) * dloss);
        if (col == target) store_f32(probs, base + col, load_f32(probs, base + col) - dloss);
    }
}

extern "C" __global__ void crossentropy_forward_f32(float* l, float* loss, const unsigned int* t, int N, int V) { crossentropy_forward(l, loss, t, N, V); }
extern "C" __global__ void crossentropy_forward_bf16(bf16_t* l, float* loss, const unsigned int* t, int N, int V) { crossentropy_forward(l, loss, t, N, V); }
extern "C" __global__ void crossentropy_forward_f16(f16_t* l, float* loss, const unsigned int* t, int N, int V) { crossentropy_forward(l, loss, t, N, V); }
extern "C" __global__ void crossentropy_backward_f32(float* p, const unsigned int* t, float d, int N, int V) { crossentropy_backward(p, t, d, N, V); }
extern "C" __global__ void crossentropy_backward_bf16(bf16_t* p, const unsigned int* t, float d, int N, int V) { crossentropy_backward(p, t, d, N, V); }
extern "C" __global__ void crossentropy_backward_f16(f16_t* p, const unsigned int* t, float d, int N, int V) { crossentropy_backward(p, t, d, N, V); }
