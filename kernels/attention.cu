// Causal self-attention around cuBLAS: head split/merge permutes, and the causal softmax over
// the scores (the Q·Kᵀ and att·V products are strided-batched GEMMs on the host side, a chunk
// of sequences at a time). Layouts: qkv (B,T,3,NH,HS); q, k, v, y (B,NH,T,HS); a chunk's
// scores and att (chunk·NH,T,T); lse (B,NH,T), the only per-(head, query) state kept for
// backward, which recomputes att from it. `flash_attention_*` (16-bit, HS 32 or 64) is the
// same forward and backward fused into kernels on tensor cores instead, with the same out, lse
// and dqkv, and no (T,T) buffer.
#include "common.cuh"

// The (B,T,·) offset of element idx of a (B,NH,T,HS) tensor, in rows of `heads` heads: the
// (B,T,C) tensors' (heads NH) or qkv's (3·NH, q's part).
__device__ __forceinline__ long token_offset(long idx, int T_, int NH, int HS, int heads) {
    const int hs = idx % HS, t = (idx / HS) % T_, h = (idx / ((long)HS * T_)) % NH;
    const long b = idx / ((long)HS * T_ * NH);
    return ((b * T_ + t) * heads + h) * HS + hs;
}

// The permutes move PACK(T) elements per thread: whole 16-byte packs where HS is a multiple of
// a pack (a pack then never crosses a head) and the arrays are aligned, else one by one.
template <typename T>
__device__ __forceinline__ bool heads_in_packs(int HS, const void* a, const void* b, const void* c, const void* d) {
    return HS % PACK(T) == 0 && aligned16(a) && aligned16(b) && aligned16(c) && aligned16(d);
}

// qkv (B,T,3C) -> q, k, v (B,NH,T,HS)
template <typename T>
__device__ void permute_qkv(T* q, T* k, T* v, const T* qkv, int B, int T_, int NH, int HS) {
    constexpr int P = PACK(T);
    const long i0 = pack_start<P>(), N = (long)B * NH * T_ * HS, C = (long)NH * HS;
    if (i0 >= N) return;
    if (heads_in_packs<T>(HS, q, k, v, qkv)) {
        const long src = token_offset(i0, T_, NH, HS, 3 * NH);
        copy_pack<P>(q + i0, qkv + src);
        copy_pack<P>(k + i0, qkv + src + C);
        copy_pack<P>(v + i0, qkv + src + 2 * C);
        return;
    }
    for (long idx = i0; idx < i0 + P && idx < N; idx++) {
        const long src = token_offset(idx, T_, NH, HS, 3 * NH);
        q[idx] = qkv[src];
        k[idx] = qkv[src + C];
        v[idx] = qkv[src + 2 * C];
    }
}

// f32 dq, dk, dv (B,NH,T,HS) -> dqkv (B,T,3C) [overwritten, rounded once to the storage type]
template <typename T>
__device__ void permute_qkv_backward(T* dqkv, const float* dq, const float* dk, const float* dv, int B, int T_, int NH, int HS) {
    constexpr int P = PACK(T);
    const long i0 = pack_start<P>(), N = (long)B * NH * T_ * HS, C = (long)NH * HS;
    if (i0 >= N) return;
    if (heads_in_packs<T>(HS, dqkv, dq, dk, dv)) {
        const long dst = token_offset(i0, T_, NH, HS, 3 * NH);
        float x[P];
        load_pack(x, dq, i0, N, true);
        store_pack(dqkv + dst, 0, P, x, true);
        load_pack(x, dk, i0, N, true);
        store_pack(dqkv + dst + C, 0, P, x, true);
        load_pack(x, dv, i0, N, true);
        store_pack(dqkv + dst + 2 * C, 0, P, x, true);
        return;
    }
    for (long idx = i0; idx < i0 + P && idx < N; idx++) {
        const long dst = token_offset(idx, T_, NH, HS, 3 * NH);
        store_f32(dqkv, dst, dq[idx]);
        store_f32(dqkv, dst + C, dk[idx]);
        store_f32(dqkv, dst + 2 * C, dv[idx]);
    }
}

// (B,NH,T,HS) -> (B,T,C) when merge != 0, the inverse when merge == 0.
template <typename T>
__device__ void heads_permute(T* out, const T* in, int B, int T_, int NH, int HS, int merge) {
    constexpr int P = PACK(T);
    const long i0 = pack_start<P>(), N = (long)B * NH * T_ * HS;
    if (i0 >= N) return;
    if (heads_in_packs<T>(HS, out, in, out, in)) {
        const long btc = token_offset(i0, T_, NH, HS, NH);
        if (merge) copy_pack<P>(out + btc, in + i0); else copy_pack<P>(out + i0, in + btc);
        return;
    }
    for (long idx = i0; idx < i0 + P && idx < N; idx++) {
        const long btc = token_offset(idx, T_, NH, HS, NH);
        if (merge) out[btc] = in[idx]; else out[idx] = in[btc];
    }
}

// One warp per row of a chunk's (T,T) matrices; row = (head, query t), keys 0..=t causal.
// att[row] = exp(scale · scores[row] − lse[row]) rounded to T, zero above the diagonal, with
// lse[row] = log Σ exp(scale · scores[row]) (the maximum subtracted first), kept for backward.
// A row is walked in 16-byte packs of T (lane takes packs lane, lane + 32, ...) where T_ is a
// multiple of a pack and the matrices are aligned (then so is every row), else element by
// element: the same value per element either way.
template <typename T>
__device__ __forceinline__ bool scores_in_packs(int T_, const void* a, const void* b) {
    return T_ % PACK(T) == 0 && aligned16(a) && aligned16(b);
}

template <typename T>
__device__ __forceinline__ void causal_probs_row(T* att, const float* preatt, float scale, float l, long base, int t, int T_, int lane) {
    constexpr int P = PACK(T);
    if (scores_in_packs<T>(T_, att, preatt)) {
        for (int i0 = lane * P; i0 < T_; i0 += 32 * P) {
            float x[P];
            if (i0 <= t) load_pack(x, preatt + base, i0, T_, true);
            else UNROLL for (int u = 0; u < P; u++) x[u] = 0.f;
            UNROLL for (int u = 0; u < P; u++) x[u] = i0 + u <= t ? expf(x[u] * scale - l) : 0.f;
            store_pack(att + base, i0, T_, x, true);
        }
        return;
    }
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
    constexpr int P = PACK(T);
    int t = row % T_;
    const long base = (long)row * T_;
    float s = 0.f;
    if (scores_in_packs<T>(T_, att, datt) && aligned16(dpreatt)) {
        for (int i0 = lane * P; i0 <= t; i0 += 32 * P) {
            float a[P], d[P];
            load_pack(a, att + base, i0, T_, true);
            load_pack(d, datt + base, i0, T_, true);
            UNROLL for (int u = 0; u < P; u++) if (i0 + u <= t) s += a[u] * d[u];
        }
        s = warp_sum(s);
        for (int i0 = lane * P; i0 < T_; i0 += 32 * P) {
            float a[P], d[P];
            if (i0 <= t) {
                load_pack(a, att + base, i0, T_, true);
                load_pack(d, datt + base, i0, T_, true);
            } else UNROLL for (int u = 0; u < P; u++) a[u] = d[u] = 0.f;
            UNROLL for (int u = 0; u < P; u++) a[u] = i0 + u <= t ? a[u] * (d[u] - s) * scale : 0.f;
            store_pack(dpreatt + base, i0, T_, a, true);
        }
        return;
    }
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

// The value `store_f32` would leave in a T, read back (the CPU reference rounds the
// probabilities to the storage type before they weight the values).
template <typename T>
__device__ __forceinline__ float rounded(float v) {
    T tmp;
    store_f32(&tmp, 0, v);
    return load_f32(&tmp, 0);
}

// Fused ("flash") causal attention for 16-bit storage on tensor cores: no (T,T) buffer, q, k, v
// and dout read in place. A block of 4 warps takes 64 rows (queries, or keys in dkv below) of
// one (batch, head), each warp 16 of them, held as mma A fragments for the whole kernel; the
// other side streams through in tiles of N rows straight from global memory. The helpers below
// are the two products every pass is made of. Rows are T-bounded: a row at or past T reads as
// zero (row T − 1 is loaded and the value dropped: a select, not a branch around the load —
// with branches ptxas spilled). All 16-bit pointers are 4-byte aligned with even row strides
// (the launch checks), so a pair of elements at an even column is one 32-bit load.

// a: the A fragments of rows row0..row0+16 (columns 0..HS) of x (row stride rs).
template <typename T, int HS>
__device__ __forceinline__ void flash_rows(unsigned (&a)[HS / 16][4], const T* x, long rs, int row0, int T_) {
    const int lane = threadIdx.x % 32, g = lane / 4, q4 = lane % 4;
    UNROLL
    for (int ks = 0; ks < HS / 16; ks++) {
        UNROLL
        for (int r = 0; r < 2; r++) {
            UNROLL
            for (int half = 0; half < 2; half++) {
                const int row = row0 + g + 8 * r;
                const long col = ks * 16 + 2 * q4 + 8 * half;
                const unsigned pair = load_pair_aligned(x, (long)min(row, T_ - 1) * rs + col);
                a[ks][r + 2 * half] = row < T_ ? pair : 0u;
            }
        }
    }
}

// s (16×N, f32) = a · yᵀ over HS, y's rows y0..y0+N (row stride rs): column n of tile j is
// row y0 + 8j + n of y. Forward's scores q·kᵀ, backward's dout·vᵀ, and transposed k·qᵀ, v·doutᵀ.
template <typename T, int HS, int N>
__device__ __forceinline__ void flash_products(float (&s)[N / 8][4], const unsigned (&a)[HS / 16][4], const T* y, long rs, int y0, int T_) {
    const int lane = threadIdx.x % 32, g = lane / 4, q4 = lane % 4;
    UNROLL
    for (int j = 0; j < N / 8; j++) {
        s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
        const int row = y0 + 8 * j + g;
        UNROLL
        for (int ks = 0; ks < HS / 16; ks++) {
            const long at = (long)min(row, T_ - 1) * rs + ks * 16 + 2 * q4;
            const unsigned lo = load_pair_aligned(y, at), hi = load_pair_aligned(y, at + 8);
            unsigned b[2];
            b[0] = row < T_ ? lo : 0u;
            b[1] = row < T_ ? hi : 0u;
            mma_16x8x16(s[j], a[ks], b, T());
        }
    }
}

// o (16×HS, f32) += p · x, p (16×N) in the C layout `flash_products` leaves (rounded to T
// here: each 16 columns of it are an A fragment), x's rows x0..x0+N (row stride rs).
// Forward's P·v, backward's ds·k, Pᵀ·dout and dsᵀ·q.
template <typename T, int HS, int N>
__device__ __forceinline__ void flash_accumulate(float (&o)[HS / 8][4], const float (&p)[N / 8][4], const T* x, long rs, int x0, int T_) {
    const int lane = threadIdx.x % 32, g = lane / 4, q4 = lane % 4;
    UNROLL
    for (int kk = 0; kk < N / 16; kk++) {
        unsigned pa[4];
        pa[0] = pack_pair<T>(p[2 * kk][0], p[2 * kk][1]);
        pa[1] = pack_pair<T>(p[2 * kk][2], p[2 * kk][3]);
        pa[2] = pack_pair<T>(p[2 * kk + 1][0], p[2 * kk + 1][1]);
        pa[3] = pack_pair<T>(p[2 * kk + 1][2], p[2 * kk + 1][3]);
        const int row = x0 + 16 * kk + 2 * q4;  // rows row, row+1, row+8, row+9 of x
        UNROLL
        for (int n = 0; n < HS / 8; n++) {
            const long col = 8 * n + g;
            unsigned b[2];
            UNROLL
            for (int half = 0; half < 2; half++) {
                const int lo = row + 8 * half, hi = lo + 1;  // rows past T are zero
                const unsigned x_lo = bits_of(x[(long)min(lo, T_ - 1) * rs + col]);
                const unsigned x_hi = bits_of(x[(long)min(hi, T_ - 1) * rs + col]);
                b[half] = (lo < T_ ? x_lo : 0u) | ((hi < T_ ? x_hi : 0u) << 16);
            }
            mma_16x8x16(o[n], pa, b, T());
        }
    }
}

// A (16×HS) f32 accumulator in C fragments, zeroed.
template <int HS>
__device__ __forceinline__ void flash_clear(float (&o)[HS / 8][4]) {
    UNROLL
    for (int n = 0; n < HS / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
}

// Rows row0 + g and row0 + g + 8 (the lane's two rows in a C fragment) of a (16×HS) f32
// accumulator, times `factor[r]`, rounded into dst (row stride rs); rows past T are skipped.
template <typename T, int HS>
__device__ __forceinline__ void flash_store(T* dst, long rs, const float (&o)[HS / 8][4], const float (&factor)[2], int row0, int T_) {
    const int lane = threadIdx.x % 32, g = lane / 4, q4 = lane % 4;
    UNROLL
    for (int r = 0; r < 2; r++) {
        const int row = row0 + g + 8 * r;
        if (row >= T_) continue;
        T* y = dst + (long)row * rs;
        UNROLL
        for (int n = 0; n < HS / 8; n++) {
            store_f32(y, 8 * n + 2 * q4, o[n][2 * r] * factor[r]);
            store_f32(y, 8 * n + 2 * q4 + 1, o[n][2 * r + 1] * factor[r]);
        }
    }
}

// Sum over the 4 lanes that hold one row of a C fragment (lanes 4g..4g+3).
__device__ __forceinline__ float row_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// Where a fused kernel's block works: (batch, head) blockIdx.y, rows 64·blockIdx.x.. of it.
template <int HS>
struct FlashHead {
    long C, rs;  // the model width; qkv's row stride (3C)
    long qkv;    // the head's first q element in qkv (its k and v follow at +C and +2C)
    long btc;    // its first element in a (B,T,C) tensor: out, dout
    long bh;     // its first row in a (B,NH,T) tensor: lse, delta
    int row0;    // this warp's first row (a query, or a key in the dk/dv kernel)
    __device__ FlashHead(int T_, int NH) : C((long)NH * HS), rs(3 * C) {
        const int b = blockIdx.y / NH, h = blockIdx.y % NH;
        qkv = (long)b * T_ * rs + h * HS;
        btc = (long)b * T_ * C + h * HS;
        bh = ((long)b * NH + h) * T_;
        row0 = blockIdx.x * 64 + threadIdx.x / 32 * 16;
    }
};

// Forward. Block blockIdx.x takes queries 64·x.. of (batch, head) blockIdx.y. Per step of 64
// keys (up to the block's last query) a warp computes its scores S (16×64) = q·kᵀ, scales and
// masks them (key > query or key ≥ T), keeps each row's running maximum m and sum l of
// exp(s − m) in f32 (rescaling its output when m grows), and adds P·v with P = exp(s − m)
// rounded to the storage type. At the end out = O / l, rounded once, and lse = m + log l, as
// `softmax_causal_forward` defines it (backward recomputes the probabilities from it).
template <typename T, int HS>
__device__ void flash_attention_forward(T* out, float* lse, const T* qkv, int B, int T_, int NH, float scale) {
    constexpr int KEYS = 64;
    const int lane = threadIdx.x % 32, g = lane / 4, q4 = lane % 4;
    const FlashHead<HS> at(T_, NH);
    const long C = at.C, rs = at.rs;
    const int row0 = at.row0;  // this warp's first query
    const T *q = qkv + at.qkv, *k = q + C, *v = q + 2 * C;
    const int rows[2] = {row0 + g, row0 + g + 8};  // the two query rows this lane holds
    unsigned qa[HS / 16][4];
    flash_rows<T, HS>(qa, q, rs, row0, T_);
    float o[HS / 8][4];
    flash_clear<HS>(o);
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};  // l: this lane's share of the row sums
    const int keys_end = min(T_, (int)blockIdx.x * 64 + 64);
    for (int k0 = 0; k0 < keys_end; k0 += KEYS) {
        float s[KEYS / 8][4];
        flash_products<T, HS, KEYS>(s, qa, k, rs, k0, T_);
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
        flash_accumulate<T, HS, KEYS>(o, s, v, rs, k0, T_);
    }
    float inv[2];
    UNROLL
    for (int r = 0; r < 2; r++) {
        l[r] = row_sum(l[r]);
        inv[r] = 1.f / l[r];
        if (rows[r] < T_ && q4 == 0) lse[at.bh + rows[r]] = m[r] + logf(l[r]);
    }
    flash_store<T, HS>(out + at.btc, C, o, inv, row0, T_);
}

// Backward, in two kernels with no atomics (each gradient row is one warp's), recomputing the
// probabilities p = exp(s·scale − lse) rounded to the storage type as forward made them, as
// `attention_backward`'s CPU reference defines the rest: datt = dout·vᵀ, the row dot
// D = Σ p·datt, ds = p · (datt − D) · scale rounded to the storage type, dq = ds·k,
// dk = dsᵀ·q, dv = pᵀ·dout, each accumulated in f32 and rounded once into dqkv (B,T,3C).
//
// flash_attention_backward_dq: queries 64·x.. of (batch, head) y, as forward; a first pass over
// the keys makes each row's D (written to delta (B,NH,T) for the second kernel), a second its dq.
// The dq kernel's tile of N keys from k0: s = p (rounded to T, zero where masked) and
// dp = datt = dout·vᵀ, for the lane's query rows `rows`.
template <typename T, int HS, int N>
__device__ __forceinline__ void flash_dq_tile(float (&s)[N / 8][4], float (&dp)[N / 8][4], const unsigned (&qa)[HS / 16][4], const unsigned (&da)[HS / 16][4], const T* k, const T* v, long rs, int k0, const int (&rows)[2], const float (&row_lse)[2], float scale, int T_) {
    const int q4 = threadIdx.x % 4;
    flash_products<T, HS, N>(s, qa, k, rs, k0, T_);
    flash_products<T, HS, N>(dp, da, v, rs, k0, T_);
    UNROLL
    for (int j = 0; j < N / 8; j++) {
        UNROLL
        for (int e = 0; e < 4; e++) {
            const int key = k0 + 8 * j + 2 * q4 + (e & 1), r = e / 2;
            s[j][e] = key <= rows[r] && rows[r] < T_ ? rounded<T>(expf(s[j][e] * scale - row_lse[r])) : 0.f;
        }
    }
}

template <typename T, int HS>
__device__ void flash_attention_backward_dq(T* dqkv, float* delta, const T* dout, const T* qkv, const float* lse, int B, int T_, int NH, float scale) {
    constexpr int KEYS = 64;
    const int g = threadIdx.x % 32 / 4, q4 = threadIdx.x % 4;
    const FlashHead<HS> at(T_, NH);
    const long C = at.C, rs = at.rs, bh = at.bh;
    const int row0 = at.row0;  // this warp's first query
    const T *q = qkv + at.qkv, *k = q + C, *v = q + 2 * C, *dy = dout + at.btc;
    const int rows[2] = {row0 + g, row0 + g + 8};
    unsigned qa[HS / 16][4], da[HS / 16][4];
    flash_rows<T, HS>(qa, q, rs, row0, T_);
    flash_rows<T, HS>(da, dy, C, row0, T_);
    const float row_lse[2] = {rows[0] < T_ ? lse[bh + rows[0]] : 0.f, rows[1] < T_ ? lse[bh + rows[1]] : 0.f};
    const int keys_end = min(T_, (int)blockIdx.x * 64 + 64);
    float d[2] = {0.f, 0.f};
    for (int k0 = 0; k0 < keys_end; k0 += KEYS) {
        float s[KEYS / 8][4], dp[KEYS / 8][4];
        flash_dq_tile<T, HS, KEYS>(s, dp, qa, da, k, v, rs, k0, rows, row_lse, scale, T_);
        UNROLL
        for (int j = 0; j < KEYS / 8; j++) {
            UNROLL
            for (int e = 0; e < 4; e++) d[e / 2] += s[j][e] * dp[j][e];
        }
    }
    UNROLL
    for (int r = 0; r < 2; r++) {
        d[r] = row_sum(d[r]);
        if (rows[r] < T_ && q4 == 0) delta[bh + rows[r]] = d[r];
    }
    float dq[HS / 8][4];
    flash_clear<HS>(dq);
    for (int k0 = 0; k0 < keys_end; k0 += KEYS) {
        float s[KEYS / 8][4], dp[KEYS / 8][4];
        flash_dq_tile<T, HS, KEYS>(s, dp, qa, da, k, v, rs, k0, rows, row_lse, scale, T_);
        UNROLL
        for (int j = 0; j < KEYS / 8; j++) {
            UNROLL
            for (int e = 0; e < 4; e++) s[j][e] *= (dp[j][e] - d[e / 2]) * scale;  // ds
        }
        flash_accumulate<T, HS, KEYS>(dq, s, k, rs, k0, T_);
    }
    const float one[2] = {1.f, 1.f};
    flash_store<T, HS>(dqkv + at.qkv, rs, dq, one, row0, T_);
}

// flash_attention_backward_dkv: keys 64·x.. of (batch, head) y, each warp 16 of them, over the
// queries that see them (from the block's first key to T) in steps of 16: the transposed
// scores sᵀ = k·qᵀ and datt ᵀ = v·doutᵀ, pᵀ and dsᵀ from lse and delta, then dv += pᵀ·dout and
// dk += dsᵀ·q. Runs after the dq kernel (delta).
template <typename T, int HS>
__device__ void flash_attention_backward_dkv(T* dqkv, const T* dout, const T* qkv, const float* lse, const float* delta, int B, int T_, int NH, float scale) {
    constexpr int QUERIES = 16;  // 32 needs 255 registers for fp16 HS 64 (ptxas), 16 needs 168
    const int g = threadIdx.x % 32 / 4, q4 = threadIdx.x % 4;
    const FlashHead<HS> at(T_, NH);
    const long C = at.C, rs = at.rs, bh = at.bh;
    const int row0 = at.row0;  // this warp's first key
    const T *q = qkv + at.qkv, *k = q + C, *v = q + 2 * C, *dy = dout + at.btc;
    const int keys[2] = {row0 + g, row0 + g + 8};
    unsigned ka[HS / 16][4], va[HS / 16][4];
    flash_rows<T, HS>(ka, k, rs, row0, T_);
    flash_rows<T, HS>(va, v, rs, row0, T_);
    float dk[HS / 8][4], dv[HS / 8][4];
    flash_clear<HS>(dk);
    flash_clear<HS>(dv);
    for (int q0 = blockIdx.x * 64; q0 < T_; q0 += QUERIES) {
        float s[QUERIES / 8][4], dp[QUERIES / 8][4];
        flash_products<T, HS, QUERIES>(s, ka, q, rs, q0, T_);
        flash_products<T, HS, QUERIES>(dp, va, dy, C, q0, T_);
        UNROLL
        for (int j = 0; j < QUERIES / 8; j++) {
            UNROLL
            for (int c = 0; c < 2; c++) {
                const int query = q0 + 8 * j + 2 * q4 + c;
                const bool live = query < T_;
                const float l = live ? lse[bh + query] : 0.f, d = live ? delta[bh + query] : 0.f;
                UNROLL
                for (int r = 0; r < 2; r++) {
                    const int e = 2 * r + c;
                    const float p = keys[r] <= query && live ? rounded<T>(expf(s[j][e] * scale - l)) : 0.f;
                    s[j][e] = p;
                    dp[j][e] = p * (dp[j][e] - d) * scale;
                }
            }
        }
        flash_accumulate<T, HS, QUERIES>(dv, s, dy, C, q0, T_);
        flash_accumulate<T, HS, QUERIES>(dk, dp, q, rs, q0, T_);
    }
    const float one[2] = {1.f, 1.f};
    T* base = dqkv + at.qkv;
    flash_store<T, HS>(base + C, rs, dk, one, row0, T_);
    flash_store<T, HS>(base + 2 * C, rs, dv, one, row0, T_);
}

extern "C" __global__ void __launch_bounds__(128) flash_attention_forward_hs64_bf16(bf16_t* o, float* l, const bf16_t* x, int B, int T, int NH, float s) { flash_attention_forward<bf16_t, 64>(o, l, x, B, T, NH, s); }
extern "C" __global__ void __launch_bounds__(128) flash_attention_forward_hs64_f16(f16_t* o, float* l, const f16_t* x, int B, int T, int NH, float s) { flash_attention_forward<f16_t, 64>(o, l, x, B, T, NH, s); }
extern "C" __global__ void __launch_bounds__(128) flash_attention_forward_hs32_bf16(bf16_t* o, float* l, const bf16_t* x, int B, int T, int NH, float s) { flash_attention_forward<bf16_t, 32>(o, l, x, B, T, NH, s); }
extern "C" __global__ void __launch_bounds__(128) flash_attention_forward_hs32_f16(f16_t* o, float* l, const f16_t* x, int B, int T, int NH, float s) { flash_attention_forward<f16_t, 32>(o, l, x, B, T, NH, s); }
extern "C" __global__ void __launch_bounds__(128) flash_attention_backward_dq_hs64_bf16(bf16_t* dx, float* delta, const bf16_t* dy, const bf16_t* x, const float* l, int B, int T, int NH, float s) { flash_attention_backward_dq<bf16_t, 64>(dx, delta, dy, x, l, B, T, NH, s); }
extern "C" __global__ void __launch_bounds__(128) flash_attention_backward_dq_hs64_f16(f16_t* dx, float* delta, const f16_t* dy, const f16_t* x, const float* l, int B, int T, int NH, float s) { flash_attention_backward_dq<f16_t, 64>(dx, delta, dy, x, l, B, T, NH, s); }
extern "C" __global__ void __launch_bounds__(128) flash_attention_backward_dq_hs32_bf16(bf16_t* dx, float* delta, const bf16_t* dy, const bf16_t* x, const float* l, int B, int T, int NH, float s) { flash_attention_backward_dq<bf16_t, 32>(dx, delta, dy, x, l, B, T, NH, s); }
extern "C" __global__ void __launch_bounds__(128) flash_attention_backward_dq_hs32_f16(f16_t* dx, float* delta, const f16_t* dy, const f16_t* x, const float* l, int B, int T, int NH, float s) { flash_attention_backward_dq<f16_t, 32>(dx, delta, dy, x, l, B, T, NH, s); }
extern "C" __global__ void __launch_bounds__(128) flash_attention_backward_dkv_hs64_bf16(bf16_t* dx, const bf16_t* dy, const bf16_t* x, const float* l, const float* delta, int B, int T, int NH, float s) { flash_attention_backward_dkv<bf16_t, 64>(dx, dy, x, l, delta, B, T, NH, s); }
extern "C" __global__ void __launch_bounds__(128) flash_attention_backward_dkv_hs64_f16(f16_t* dx, const f16_t* dy, const f16_t* x, const float* l, const float* delta, int B, int T, int NH, float s) { flash_attention_backward_dkv<f16_t, 64>(dx, dy, x, l, delta, B, T, NH, s); }
extern "C" __global__ void __launch_bounds__(128) flash_attention_backward_dkv_hs32_bf16(bf16_t* dx, const bf16_t* dy, const bf16_t* x, const float* l, const float* delta, int B, int T, int NH, float s) { flash_attention_backward_dkv<bf16_t, 32>(dx, dy, x, l, delta, B, T, NH, s); }
extern "C" __global__ void __launch_bounds__(128) flash_attention_backward_dkv_hs32_f16(f16_t* dx, const f16_t* dy, const f16_t* x, const float* l, const float* delta, int B, int T, int NH, float s) { flash_attention_backward_dkv<f16_t, 32>(dx, dy, x, l, delta, B, T, NH, s); }

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
