// Softmax + cross-entropy over the first V of each row of VP logits (the vocabulary; the
// padding columns past it get 0), in f32 whatever the storage, one block per row (in 16-byte
// packs where the row allows), in two passes over the row: each thread keeps a running maximum and its sum of exponentials,
// rescaled when the maximum grows, and the block combines them; the second pass writes over
// the logits either the probabilities (`crossentropy_forward`: evaluation, decoding) or, in
// training, the logits' gradient (p − onehot) · dloss (`crossentropy_forward_backward`: the
// probabilities are never stored and backward makes no pass of its own over the logits).
#include "common.cuh"

// grad: write (p − onehot(target)) · dloss, else p.
template <typename T>
__device__ void softmax_crossentropy(T* logits, float* losses, const unsigned int* targets, int N, int V, int VP,
                                     bool grad, float dloss) {
    constexpr int P = PACK(T);
    int row = blockIdx.x;
    if (row >= N) return;
    __shared__ float red[32];
    const long base = (long)row * VP;
    // Rows of 16-byte packs (VP a multiple of a pack, as the padded vocabulary is, and the
    // logits aligned): thread x takes packs x, x + blockDim.x, ...; else elements.
    const bool packs = VP % P == 0 && aligned16(logits);
    float m = NEG_INF, s = 0.f;  // this thread's maximum and Σ exp(x − m)
    if (packs) {
        for (int i0 = threadIdx.x * P; i0 < V; i0 += blockDim.x * P) {
            float x[P];
            load_pack(x, logits + base, i0, VP, true);
            float pm = m;  // the pack's maximum over its columns in the vocabulary
            UNROLL for (int u = 0; u < P; u++) if (i0 + u < V) pm = fmaxf(pm, x[u]);
            s *= expf(m - pm);  // (m = −inf at first: s is 0, and exp(−inf) 0)
            UNROLL for (int u = 0; u < P; u++) if (i0 + u < V) s += expf(x[u] - pm);
            m = pm;
        }
    } else {
        for (int i = threadIdx.x; i < V; i += blockDim.x) {
            const float x = load_f32(logits, base + i);
            if (x > m) {
                s = s * expf(m - x) + 1.f;
                m = x;
            } else {
                s += expf(x - m);
            }
        }
    }
    const float mx = block_max(m, red);
    // (a thread with no element, V < blockDim.x, adds 0 · exp(−inf) = 0)
    const float sum = block_sum(s * expf(m - mx), red);
    const int target = (int)targets[row];
    const float target_logit = load_f32(logits, base + target);
    __syncthreads();  // every thread has read the target's logit before it is overwritten
    if (threadIdx.x == 0) losses[row] = -(target_logit - mx - logf(sum));
    const float inv = 1.f / sum;
    if (packs) {
        // The whole row in packs: the vocabulary's columns, then 0 in the padding.
        for (int i0 = threadIdx.x * P; i0 < VP; i0 += blockDim.x * P) {
            float x[P];
            load_pack(x, logits + base, i0, VP, true);
            UNROLL for (int u = 0; u < P; u++) {
                const int i = i0 + u;
                const float p = expf(x[u] - mx) * inv;
                x[u] = i >= V ? 0.f : grad ? (p - (i == target ? 1.f : 0.f)) * dloss : p;
            }
            store_pack(logits + base, i0, VP, x, true);
        }
        return;
    }
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        const float p = expf(load_f32(logits, base + i) - mx) * inv;
        store_f32(logits, base + i, grad ? (p - (i == target ? 1.f : 0.f)) * dloss : p);
    }
    for (int i = V + threadIdx.x; i < VP; i += blockDim.x) store_f32(logits, base + i, 0.f);
}

extern "C" __global__ void crossentropy_forward_f32(float* l, float* loss, const unsigned int* t, int N, int V, int VP) { softmax_crossentropy(l, loss, t, N, V, VP, false, 0.f); }
extern "C" __global__ void crossentropy_forward_bf16(bf16_t* l, float* loss, const unsigned int* t, int N, int V, int VP) { softmax_crossentropy(l, loss, t, N, V, VP, false, 0.f); }
extern "C" __global__ void crossentropy_forward_f16(f16_t* l, float* loss, const unsigned int* t, int N, int V, int VP) { softmax_crossentropy(l, loss, t, N, V, VP, false, 0.f); }
extern "C" __global__ void crossentropy_forward_backward_f32(float* l, float* loss, const unsigned int* t, float d, int N, int V, int VP) { softmax_crossentropy(l, loss, t, N, V, VP, true, d); }
extern "C" __global__ void crossentropy_forward_backward_bf16(bf16_t* l, float* loss, const unsigned int* t, float d, int N, int V, int VP) { softmax_crossentropy(l, loss, t, N, V, VP, true, d); }
extern "C" __global__ void crossentropy_forward_backward_f16(f16_t* l, float* loss, const unsigned int* t, float d, int N, int V, int VP) { softmax_crossentropy(l, loss, t, N, V, VP, true, d); }
