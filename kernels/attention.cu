// Causal self-attention around cuBLAS: head split/merge permutes, and the causal softmax over
// the scores (the Q·Kᵀ and att·V products are strided-batched GEMMs on the host side, a chunk
// of sequences at a time). Layouts: qkv (B,T,3,NH,HS); q, k, v, y (B,NH,T,HS); a chunk's
// scores and att (chunk·NH,T,T); lse (B,NH,T), the only per-(head, query) state kept for
// backward, which recomputes att from it. `flash_attention_forward_*` (16-bit, HS 32 or 64) is
// the forward pass fused into one kernel on tensor cores instead, with the same out and lse.
#include "common.cuh"

// qkv (B,T,3C) -> q, k, v (B,NH,T,HS)
template <typename T>
__device__ void permute_qkv(T* q, T* k, T* v, const T* qkv, int B, int T_, int NH, int HS) {
    long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long)B * NH * T_ * HS) return;
    int hs = idx % HS, t = (idx / HS) % T_, h = (idx / ((long)HS * T_)) % NH, b = idx / ((long)HS * T_ * NH);
    long src = ((long)(b * T_ + t) * 3 * NH + h) * HS + hs;
    long C = (long)NH * HS;
    q[idx] = qkv[src];
    k[idx] = qkv[src + C];
    v[idx] = qkv[src + 2 * C];
}

// f32 dq, dk, dv (B,NH,T,HS) -> dqkv (B,T,3C) [overwritten, rounded once to the storage type]
template <typename T>
__device__ void permute_qkv_backward(T* dqkv, const float* dq, const float* dk, const float* dv, int B, int T_, int NH, int HS) {
    long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long)B * NH * T_ * HS) return;
    int hs = idx % HS, t = (idx / HS) % T_, h = (idx / ((long)HS * T_)) % NH, b = idx / ((long)HS * T_ * NH);
    long dst = ((long)(b * T_ + t) * 3 * NH + h) * HS + hs;
    long C = (long)NH * HS;
    store_f32(dqkv, dst, dq[idx]);
    store_f32(dqkv, dst + C, dk[idx]);
    store_f32(dqkv, dst + 2 * C, dv[idx]);
}

// (B,NH,T,HS) -> (B,T,C) when merge != 0, the inverse when merge == 0.
template <typename T>
__device__ void heads_permute(T* out, const T* in, int B, int T_, int NH, int HS, int merge) {
    long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long)B * NH * T_ * HS) return;
    int hs = idx % HS, t = (idx / HS) % T_, h = (idx / ((long)HS * T_)) % NH, b = idx / ((long)HS * T_ * NH);
    long btc = ((long)(b * T_ + t) * NH + h) * HS + hs;
    if (merge) out[btc] = in[idx]; else out[idx] = in[btc];
}

// One warp per row of a chunk's (T,T) matrices; row = (head, query t), keys 0..=t causal.
// att[row] = exp(scale · scores[row] − lse[row]) rounded to T, zero above the diagonal, with
// lse[row] = log Σ exp(scale · scores[row]) (the maximum subtracted first), kept for backward.
template <typename T>
__device__ __forceinline__ void causal_probs_row(T* att, const float* preatt, float scale, float l, long base, int t, int T_, int lane) {
    for (int i = lane; i < T_; i += 32)
        store_f32(att, base + i, i <= t ? expf(preatt[base + i] * scale - l) : 0.f);
}

template <typename T>
__device__ void softmax_causal_forward(T* att, float* lse, const float* preatt, float scale, int rows, int T_) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= rows) return;
    int t = row % T_;
    const long base = (long)row * T_;
    float mx = NEG_INF;
    for (int i = lane; i <= t; i += 32) mx = fmaxf(mx, preatt[base + i] * scale);
    mx = warp_max(mx);
    float s = 0.f;
    for (int i = lane; i <= t; i += 32) s += expf(preatt[base + i] * scale - mx);
    float l = mx + logf(warp_sum(s));
    if (lane == 0) lse[row] = l;
    causal_probs_row(att, preatt, scale, l, base, t, T_, lane);
}

// Backward's recompute: att[row] as forward made it, from the same scores and the saved lse.
template <typename T>
__device__ void softmax_causal_probs(T* att, const float* preatt, const float* lse, float scale, int rows, int T_) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= rows) return;
    causal_probs_row(att, preatt, scale, lse[row], (long)row * T_, row % T_, T_, lane);
}

// dpreatt[i] = att[i] * (datt[i] - Σ att·datt) * scale, rounded to T. dpreatt may be att itself:
// each lane reads its elements of the row before it writes them.
template <typename T>
__device__ void softmax_causal_backward(T* dpreatt, const float* datt, const T* att, float scale, int rows, int T_) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= rows) return;
    int t = row % T_;
    const long base = (long)row * T_;
    float s = 0.f;
    for (int i = lane; i <= t; i += 32) s += load_f32(att, base + i) * datt[base + i];
    s = warp_sum(s);
    for (int i = lane; i < T_; i += 32) {
        float d = i <= t ? load_f32(att, base + i) * (datt[base + i] - s) * scale : 0.f;
        store_f32(dpreatt, base + i, d);
    }
}

extern "C" __global__ void permute_qkv_f32(float* q, float* k, float* v, const float* x, int B, int T, int NH, int HS) { permute_qkv(q, k, v, x, B, T, NH, HS); }
extern "C" __global__ void permute_qkv_bf16(bf16_t* q, bf16_t* k, bf16_t* v, const bf16_t* x, int B, int T, int NH, int HS) { permute_qkv(q, k, v, x, B, T, NH, HS); }
extern "C" __global__ void permute_qkv_f16(f16_t* q, f16_t* k, f16_t* v, const f16_t* x, int B, int T, int NH, int HS) { permute_qkv(q, k, v, x, B, T, NH, HS); }
extern "C" __global__ void permute_qkv_backward_f32(float* d, const float* dq, const float* dk, const float* dv, int B, int T, int NH, int HS) { permute_qkv_backward(d, dq, dk, dv, B, T, NH, HS); }
extern "C" __global__ void permute_qkv_backward_bf16(bf16_t* d, const float* dq, const float* dk, const float* dv, int B, int T, int NH, int HS) { permute_qkv_backward(d, dq, dk, dv, B, T, NH, HS); }
extern "C" __global__ void permute_qkv_backward_f16(f16_t* d, const float* dq, const float* dk, const float* dv, int B, int T, int NH, int HS) { permute_qkv_backward(d, dq, dk, dv, B, T, NH, HS); }
extern "C" __global__ void heads_permute_f32(float* o, const float* x, int B, int T, int NH, int HS, int merge) { heads_permute(o, x, B, T, NH, HS, merge); }
extern "C" __global__ void heads_permute_bf16(bf16_t* o, const bf16_t* x, int B, int T, int NH, int HS, int merge) { heads_permute(o, x, B, T, NH, HS, merge); }
extern "C" __global__ void heads_permute_f16(f16_t* o, const f16_t* x, int B, int T, int NH, int HS, int merge) { heads_permute(o, x, B, T, NH, HS, merge); }
extern "C" __global__ void softmax_causal_forward_f32(float* a, float* l, const float* p, float s, int rows, int T) { softmax_causal_forward(a, l, p, s, rows, T); }
extern "C" __global__ void softmax_causal_forward_bf16(bf16_t* a, float* l, const float* p, float s, int rows, int T) { softmax_causal_forward(a, l, p, s, rows, T); }
extern "C" __global__ void softmax_causal_forward_f16(f16_t* a, float* l, const float* p, float s, int rows, int T) { softmax_causal_forward(a, l, p, s, rows, T); }
extern "C" __global__ void softmax_causal_probs_f32(float* a, const float* p, const float* l, float s, int rows, int T) { softmax_causal_probs(a, p, l, s, rows, T); }
extern "C" __global__ void softmax_causal_probs_bf16(bf16_t* a, const float* p, const float* l, float s, int rows, int T) { softmax_causal_probs(a, p, l, s, rows, T); }
extern "C" __global__ void softmax_causal_probs_f16(f16_t* a, const float* p, const float* l, float s, int rows, int T) { softmax_causal_probs(a, p, l, s, rows, T); }
extern "C" __global__ void softmax_causal_backward_f32(float* dp, const float* da, const float* a, float s, int rows, int T) { softmax_causal_backward(dp, da, a, s, rows, T); }
extern "C" __global__ void softmax_causal_backward_bf16(bf16_t* dp, const float* da, const bf16_t* a, float s, int rows, int T) { softmax_causal_backward(dp, da, a, s, rows, T); }
extern "C" __global__ void softmax_causal_backward_f16(f16_t* dp, const float* da, const f16_t* a, float s, int rows, int T) { softmax_causal_backward(dp, da, a, s, rows, T); }

// Fused ("flash") causal attention forward for 16-bit storage on tensor cores: no (T,T) buffer.
// A block of 4 warps takes 64 query rows of one (batch, head), each warp 16 of them, reading q,
// k and v in place from qkv (B,T,3,NH,HS). Per step of 64 keys (up to the block's last query)
// a warp computes its scores S (16×64) = q·kᵀ with mma, scales and masks them (key > query or
// key ≥ T), keeps each row's running maximum m and sum l of exp(s − m) in f32 (rescaling its
// output when m grows), and adds P·v with P = exp(s − m) rounded to the storage type. At the end
// out = O / l, rounded once, and lse = m + log l, as `softmax_causal_forward` defines it (the
// backward pass recomputes the probabilities from it). HS is 32 or 64; qkv 4-byte aligned (the
// launch checks), so each pair of q or k elements at an even index is one 32-bit load.
template <typename T, int HS>
__device__ void flash_attention_forward(T* out, float* lse, const T* qkv, int B, int T_, int NH, float scale) {
    constexpr int KEYS = 64;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q4 = lane % 4;
    const int b = blockIdx.y / NH, h = blockIdx.y % NH;
    const int row0 = blockIdx.x * 64 + warp * 16;  // this warp's first query
    const long C = (long)NH * HS, rs = 3 * C;       // qkv's row stride
    const T* q = qkv + (long)b * T_ * rs + h * HS;
    const T* k = q + C;
    const T* v = q + 2 * C;
    const int rows[2] = {row0 + g, row0 + g + 8};  // the two query rows this lane holds
    // q's fragments (rows past T are zero)
    unsigned qa[HS / 16][4];
    UNROLL
    for (int ks = 0; ks < HS / 16; ks++) {
        UNROLL
        for (int r = 0; r < 2; r++) {
            UNROLL
            for (int half = 0; half < 2; half++) {
                long col = ks * 16 + 2 * q4 + 8 * half;
                long at = (long)rows[r] * rs + col;
                qa[ks][r + 2 * half] = rows[r] < T_ ? load_pair_aligned(q, at) : 0u;
            }
        }
    }
    float o[HS / 8][4];
    UNROLL
    for (int n = 0; n < HS / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};  // l: this lane's share of the row sums
    const int keys_end = min(T_, (int)blockIdx.x * 64 + 64);
    for (int k0 = 0; k0 < keys_end; k0 += KEYS) {
        // S = q · kᵀ: column n of tile j is key k0 + 8j + n
        float s[KEYS / 8][4];
        UNROLL
        for (int j = 0; j < KEYS / 8; j++) {
            s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
            const int key = k0 + 8 * j + g;
            UNROLL
            for (int ks = 0; ks < HS / 16; ks++) {
                long at = (long)key * rs + ks * 16 + 2 * q4;
                unsigned kb[2];
                kb[0] = key < T_ ? load_pair_aligned(k, at) : 0u;
                kb[1] = key < T_ ? load_pair_aligned(k, at + 8) : 0u;
                mma_16x8x16(s[j], qa[ks], kb, T());
            }
        }
        // scale, mask, and the rows' new maxima (over the 4 lanes of a row)
        float mx[2] = {NEG_INF, NEG_INF};
        UNROLL
        for (int j = 0; j < KEYS / 8; j++) {
            UNROLL
            for (int e = 0; e < 4; e++) {
                const int key = k0 + 8 * j + 2 * q4 + (e & 1), r = e / 2;
                s[j][e] = key <= rows[r] && key < T_ ? s[j][e] * scale : NEG_INF;
                mx[r] = fmaxf(mx[r], s[j][e]);
            }
        }
        float base[2];
        UNROLL
        for (int r = 0; r < 2; r++) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
            const float m_new = fmaxf(m[r], mx[r]);
            // a row with no key yet (past T) keeps 0 as its base, so no inf − inf
            base[r] = m_new == NEG_INF ? 0.f : m_new;
            const float rescale = expf(m[r] - base[r]);
            l[r] *= rescale;
            UNROLL
            for (int n = 0; n < HS / 8; n++) {
                o[n][2 * r] *= rescale;
                o[n][2 * r + 1] *= rescale;
            }
            m[r] = m_new;
        }
        UNROLL
        for (int j = 0; j < KEYS / 8; j++) {
            UNROLL
            for (int e = 0; e < 4; e++) {
                s[j][e] = expf(s[j][e] - base[e / 2]);
                l[e / 2] += s[j][e];
            }
        }
        // O += P · v, 16 keys at a time: P's score tiles 2kk and 2kk+1 are the A fragment
        UNROLL
        for (int kk = 0; kk < KEYS / 16; kk++) {
            unsigned pa[4];
            pa[0] = pack_pair<T>(s[2 * kk][0], s[2 * kk][1]);
            pa[1] = pack_pair<T>(s[2 * kk][2], s[2 * kk][3]);
            pa[2] = pack_pair<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            pa[3] = pack_pair<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
            const int key = k0 + 16 * kk + 2 * q4;  // rows key, key+1, key+8, key+9 of v
            UNROLL
            for (int n = 0; n < HS / 8; n++) {
                const long col = 8 * n + g;
                unsigned vb[2];
                UNROLL
                for (int half = 0; half < 2; half++) {
                    const int lo = key + 8 * half, hi = lo + 1;  // keys past T are zero
                    vb[half] = (lo < T_ ? (unsigned)bits_of(v[(long)lo * rs + col]) : 0u) |
                               ((hi < T_ ? (unsigned)bits_of(v[(long)hi * rs + col]) : 0u) << 16);
                }
                mma_16x8x16(o[n], pa, vb, T());
            }
        }
    }
    UNROLL
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        if (rows[r] >= T_) continue;
        const float inv = 1.f / l[r];
        T* y = out + ((long)b * T_ + rows[r]) * C + h * HS;
        UNROLL
        for (int n = 0; n < HS / 8; n++) {
            store_f32(y, 8 * n + 2 * q4, o[n][2 * r] * inv);
            store_f32(y, 8 * n + 2 * q4 + 1, o[n][2 * r + 1] * inv);
        }
        if (q4 == 0) lse[((long)b * NH + h) * T_ + rows[r]] = m[r] + logf(l[r]);
    }
}

extern "C" __global__ void __launch_bounds__(128) flash_attention_forward_hs64_bf16(bf16_t* o, float* l, const bf16_t* x, int B, int T, int NH, float s) { flash_attention_forward<bf16_t, 64>(o, l, x, B, T, NH, s); }
extern "C" __global__ void __launch_bounds__(128) flash_attention_forward_hs64_f16(f16_t* o, float* l, const f16_t* x, int B, int T, int NH, float s) { flash_attention_forward<f16_t, 64>(o, l, x, B, T, NH, s); }
extern "C" __global__ void __launch_bounds__(128) flash_attention_forward_hs32_bf16(bf16_t* o, float* l, const bf16_t* x, int B, int T, int NH, float s) { flash_attention_forward<bf16_t, 32>(o, l, x, B, T, NH, s); }
extern "C" __global__ void __launch_bounds__(128) flash_attention_forward_hs32_f16(f16_t* o, float* l, const f16_t* x, int B, int T, int NH, float s) { flash_attention_forward<f16_t, 32>(o, l, x, B, T, NH, s); }

// Incremental decoding. cache (2,B,context,C): keys then values. kv_append writes the keys and
// values of the Tn new tokens of qkv (B,Tn,3C) at positions start..start+Tn.
template <typename T>
__device__ void kv_append(T* cache, const T* qkv, int B, int Tn, int start, int context, int C) {
    long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long)B * Tn * C) return;
    int c = idx % C, i = (idx / C) % Tn, b = idx / ((long)C * Tn);
    long src = (long)(b * Tn + i) * 3 * C + c;
    long dst = (long)(b * context + start + i) * C + c;
    cache[dst] = qkv[src + C];
    cache[(long)B * context * C + dst] = qkv[src + 2 * C];
}

// The value `store_f32` would leave in a T, read back (the CPU reference rounds the
// probabilities to the storage type before they weight the values).
template <typename T>
__device__ __forceinline__ float rounded(float v) {
    T tmp;
    store_f32(&tmp, 0, v);
    return load_f32(&tmp, 0);
}

// One warp per (b, h, new token i): scores against positions 0..=start+i into its row of
// scores (B·NH·Tn, context) f32, softmax, then out (B,Tn,C) = probabilities · values.
template <typename T>
__device__ void attention_cached(T* out, float* scores, const T* cache, const T* qkv, int B, int Tn, int start, int context, int NH, int HS) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= B * NH * Tn) return;
    int i = row % Tn, h = (row / Tn) % NH, b = row / (Tn * NH);
    int C = NH * HS, last = start + i;
    float scale = rsqrtf((float)HS);
    const T* q = qkv + (long)(b * Tn + i) * 3 * C + h * HS;
    const T* keys = cache + (long)b * context * C + h * HS;
    const T* values = cache + (long)B * context * C + (long)b * context * C + h * HS;
    float* s = scores + (long)row * context;
    float mx = NEG_INF;
    for (int t = lane; t <= last; t += 32) {
        float d = 0.f;
        for (int k = 0; k < HS; k++) d += load_f32(q, k) * load_f32(keys, (long)t * C + k);
        s[t] = d * scale;
        mx = fmaxf(mx, d * scale);
    }
    mx = warp_max(mx);
    float sum = 0.f;
    for (int t = lane; t <= last; t += 32) sum += expf(s[t] - mx);
    float l = mx + logf(warp_sum(sum));
    for (int t = lane; t <= last; t += 32) s[t] = rounded<T>(expf(s[t] - l));
    __syncwarp();
    for (int k = lane; k < HS; k += 32) {
        float acc = 0.f;
        for (int t = 0; t <= last; t++) acc += s[t] * load_f32(values, (long)t * C + k);
        store_f32(out, (long)(b * Tn + i) * C + h * HS + k, acc);
    }
}

extern "C" __global__ void kv_append_f32(float* cache, const float* qkv, int B, int Tn, int start, int context, int C) { kv_append(cache, qkv, B, Tn, start, context, C); }
extern "C" __global__ void kv_append_bf16(bf16_t* cache, const bf16_t* qkv, int B, int Tn, int start, int context, int C) { kv_append(cache, qkv, B, Tn, start, context, C); }
extern "C" __global__ void kv_append_f16(f16_t* cache, const f16_t* qkv, int B, int Tn, int start, int context, int C) { kv_append(cache, qkv, B, Tn, start, context, C); }
extern "C" __global__ void attention_cached_f32(float* o, float* s, const float* cache, const float* qkv, int B, int Tn, int start, int context, int NH, int HS) { attention_cached(o, s, cache, qkv, B, Tn, start, context, NH, HS); }
extern "C" __global__ void attention_cached_bf16(bf16_t* o, float* s, const bf16_t* cache, const bf16_t* qkv, int B, int Tn, int start, int context, int NH, int HS) { attention_cached(o, s, cache, qkv, B, Tn, start, context, NH, HS); }
extern "C" __global__ void attention_cached_f16(f16_t* o, float* s, const f16_t* cache, const f16_t* qkv, int B, int Tn, int start, int context, int NH, int HS) { attention_cached(o, s, cache, qkv, B, Tn, start, context, NH, HS); }
