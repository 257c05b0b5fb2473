// Token + position embedding. out: (B,T,C) = wte[inp] + wpe[t]; backward sorts the positions
// by token and sums each token's rows in order, and sums the positions' over the batch in order
// (no atomics: deterministic, and bit for bit the CPU reference).
#include "common.cuh"

template <typename T>
__device__ void encoder_forward(T* out, const unsigned int* inp, const T* wte, const T* wpe, int BT, int T_, int C) {
    long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long)BT * C) return;
    int bt = idx / C, c = idx % C, t = bt % T_;
    store_f32(out, idx, load_f32(wte, (long)inp[bt] * C + c) + load_f32(wpe, (long)t * C + c));
}

// The token order of the embedding's backward, with no atomics: keys (token << 32 | bt), padded
// with ORDER_PAD to a power of two N, sorted ascending by a bitonic network — afterwards each
// token's positions lie together, in (b, t) order. A block sorts a chunk of up to ORDER_CHUNK
// keys in shared memory; the stages whose stride spans chunks run one launch
// each over global memory (`encoder_order_merge`), each followed by the in-chunk strides
// (`encoder_order_merge_chunk`). `cuda::backend::encoder_order_plan` lists the launches.
#define ORDER_CHUNK 2048
#define ORDER_PAD 0xffffffffffffffffull
typedef unsigned long long order_key;

// Keys i < l = i + j in order for a bitonic sequence of length k: ascending where (i & k) == 0.
__device__ __forceinline__ void order_exchange(order_key* keys, long i, long l, long gi, long k) {
    order_key a = keys[i], b = keys[l];
    if ((a > b) == ((gi & k) == 0)) {
        keys[i] = b;
        keys[l] = a;
    }
}

// The strides j = k/2 .. 1 of stage k within this block's chunk (in shared memory `s`, whose
// first key is key `base` of the whole sequence).
__device__ void order_chunk_stage(order_key* s, long base, int chunk, long k, int j_from) {
    for (int j = j_from; j > 0; j >>= 1) {
        for (int p = threadIdx.x; p < chunk / 2; p += blockDim.x) {
            int i = 2 * j * (p / j) + p % j;
            order_exchange(s, i, i + j, base + i, k);
        }
        __syncthreads();
    }
}

// Fills the keys of positions bt < BT (the rest pad) and sorts each chunk of `chunk` keys (at
// most ORDER_CHUNK): stages k = 2 .. chunk, alternating direction chunk by chunk as the network
// continues.
extern "C" __global__ void encoder_order_chunks(order_key* keys, const unsigned int* inp, int BT, int chunk) {
    __shared__ order_key s[ORDER_CHUNK];
    const long base = (long)blockIdx.x * chunk;
    for (int i = threadIdx.x; i < chunk; i += blockDim.x) {
        long g = base + i;
        s[i] = g < BT ? ((order_key)inp[g] << 32) | (order_key)g : ORDER_PAD;
    }
    __syncthreads();
    for (int k = 2; k <= chunk; k <<= 1) order_chunk_stage(s, base, chunk, k, k >> 1);
    for (int i = threadIdx.x; i < chunk; i += blockDim.x) keys[base + i] = s[i];
}

// Stage k, stride j (at least a chunk): one thread per pair, over global memory.
extern "C" __global__ void encoder_order_merge(order_key* keys, int N, int j, int k) {
    long p = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= N / 2) return;
    long i = 2 * (long)j * (p / j) + p % j;
    order_exchange(keys, i, i + j, i, k);
}

// Stage k's strides below a chunk, each block on its own chunk in shared memory.
extern "C" __global__ void encoder_order_merge_chunk(order_key* keys, int chunk, int k) {
    __shared__ order_key s[ORDER_CHUNK];
    const long base = (long)blockIdx.x * chunk;
    for (int i = threadIdx.x; i < chunk; i += blockDim.x) s[i] = keys[base + i];
    __syncthreads();
    order_chunk_stage(s, base, chunk, k, chunk / 2);
    for (int i = threadIdx.x; i < chunk; i += blockDim.x) keys[base + i] = s[i];
}

// dwte (V,C) += each token's rows of dout, from the sorted keys: the thread of (i, c) where key
// i starts its token's run sums the run's rows at column c in f32, in (b, t) order, and adds
// the sum once — the CPU reference's terms, order and rounding, bit for bit.
template <typename T>
__device__ void encoder_backward_wte(T* dwte, const T* dout, const order_key* keys, int BT, int C) {
    long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long)BT * C) return;
    int i = idx / C, c = idx % C;
    unsigned int tok = (unsigned int)(keys[i] >> 32);
    if (i > 0 && (unsigned int)(keys[i - 1] >> 32) == tok) return; // not the run's first
    // The run's end: the first key of a later token (binary search; the run may be long).
    const order_key next = ((order_key)tok + 1) << 32;
    int lo = i + 1, hi = BT;
    while (lo < hi) {
        int mid = lo + (hi - lo) / 2;
        if (keys[mid] < next) lo = mid + 1; else hi = mid;
    }
    const int end = lo;
    // In order, eight rows' loads issued before their adds (a frequent token's run is one
    // thread's serial chain; the loads need not be).
    float acc = 0.f;
    int r = i;
    for (; r + 8 <= end; r += 8) {
        float d[8];
        UNROLL for (int u = 0; u < 8; u++) d[u] = load_f32(dout, (long)(unsigned int)keys[r + u] * C + c);
        UNROLL for (int u = 0; u < 8; u++) acc += d[u];
    }
    for (; r < end; r++) acc += load_f32(dout, (long)(unsigned int)keys[r] * C + c);
    long w = (long)tok * C + c;
    store_f32(dwte, w, load_f32(dwte, w) + acc);
}

// dwpe (maxT,C) += dout summed over the batch, for positions t < T: one thread per (t, c), the
// sequences in order, rounded to the storage type at each add — the CPU reference's order and
// roundings, bit for bit, with no atomics.
template <typename T>
__device__ void encoder_backward_wpe(T* dwpe, const T* dout, int B, int T_, int C) {
    long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    const long TC = (long)T_ * C;
    if (idx >= TC) return;
    T acc = dwpe[idx];
    for (int b = 0; b < B; b++) store_f32(&acc, 0, load_f32(&acc, 0) + load_f32(dout, b * TC + idx));
    dwpe[idx] = acc;
}

extern "C" __global__ void encoder_forward_f32(float* o, const unsigned int* i, const float* w, const float* p, int BT, int T, int C) { encoder_forward(o, i, w, p, BT, T, C); }
extern "C" __global__ void encoder_forward_bf16(bf16_t* o, const unsigned int* i, const bf16_t* w, const bf16_t* p, int BT, int T, int C) { encoder_forward(o, i, w, p, BT, T, C); }
extern "C" __global__ void encoder_forward_f16(f16_t* o, const unsigned int* i, const f16_t* w, const f16_t* p, int BT, int T, int C) { encoder_forward(o, i, w, p, BT, T, C); }
extern "C" __global__ void encoder_backward_wte_f32(float* dw, const float* d, const order_key* k, int BT, int C) { encoder_backward_wte(dw, d, k, BT, C); }
extern "C" __global__ void encoder_backward_wte_bf16(bf16_t* dw, const bf16_t* d, const order_key* k, int BT, int C) { encoder_backward_wte(dw, d, k, BT, C); }
extern "C" __global__ void encoder_backward_wte_f16(f16_t* dw, const f16_t* d, const order_key* k, int BT, int C) { encoder_backward_wte(dw, d, k, BT, C); }
extern "C" __global__ void encoder_backward_wpe_f32(float* dp, const float* d, int B, int T, int C) { encoder_backward_wpe(dp, d, B, T, C); }
extern "C" __global__ void encoder_backward_wpe_bf16(bf16_t* dp, const bf16_t* d, int B, int T, int C) { encoder_backward_wpe(dp, d, B, T, C); }
extern "C" __global__ void encoder_backward_wpe_f16(f16_t* dp, const f16_t* d, int B, int T, int C) { encoder_backward_wpe(dp, d, B, T, C); }
