// LayerNorm over rows of C: one warp per row (in 16-byte packs where the rows allow). Statistics (mean, rstd) are always f32. Parameter
// gradients are column sums in f32 (in row bands, then the bands' partials by
// `column_partials_add`), added to the stored gradient once (as the CPU reference).
#include "common.cuh"

// Whether a row kernel over (N,C) can walk its rows in 16-byte packs: C a multiple of
// PACK(T) and every array aligned (then so is every row).
template <typename T>
__device__ __forceinline__ bool rows_in_packs(int C, const void* a, const void* b, const void* c, const void* d) {
    return C % PACK(T) == 0 && aligned16(a) && aligned16(b) && aligned16(c) && aligned16(d);
}

// One warp per row; a lane takes the row's 16-byte packs lane, lane + 32, ... (or, unaligned or
// C not a multiple of a pack, its elements lane, lane + 32, ...).
template <typename T>
__device__ void layernorm_forward(T* out, float* mean, float* rstd, const T* inp, const T* w, const T* b, int N, int C) {
    constexpr int P = PACK(T);
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= N) return;
    const long base = (long)row * C;
    float m, r;
    if (rows_in_packs<T>(C, out, inp, w, b)) {
        const T* x_row = inp + base;
        float s = 0.f;
        for (int i = lane * P; i < C; i += 32 * P) {
            float x[P];
            load_pack(x, x_row, i, C, true);
            UNROLL for (int u = 0; u < P; u++) s += x[u];
        }
        m = warp_sum(s) / C;
        float v = 0.f;
        for (int i = lane * P; i < C; i += 32 * P) {
            float x[P];
            load_pack(x, x_row, i, C, true);
            UNROLL for (int u = 0; u < P; u++) v += (x[u] - m) * (x[u] - m);
        }
        r = rsqrtf(warp_sum(v) / C + 1e-5f);
        for (int i = lane * P; i < C; i += 32 * P) {
            float x[P], wv[P], bv[P];
            load_pack(x, x_row, i, C, true);
            load_pack(wv, w, i, C, true);
            load_pack(bv, b, i, C, true);
            UNROLL for (int u = 0; u < P; u++) x[u] = (x[u] - m) * r * wv[u] + bv[u];
            store_pack(out + base, i, C, x, true);
        }
    } else {
        float s = 0.f;
        for (int i = lane; i < C; i += 32) s += load_f32(inp, base + i);
        m = warp_sum(s) / C;
        float v = 0.f;
        for (int i = lane; i < C; i += 32) { float d = load_f32(inp, base + i) - m; v += d * d; }
        r = rsqrtf(warp_sum(v) / C + 1e-5f);
        for (int i = lane; i < C; i += 32)
            store_f32(out, base + i, (load_f32(inp, base + i) - m) * r * load_f32(w, i) + load_f32(b, i));
    }
    if (lane == 0) { mean[row] = m; rstd[row] = r; }
}

// out (N,C) from the input and saved statistics (checkpointing's recompute). PACK(T) elements
// per thread, whole packs within a row when C is a multiple of it.
template <typename T>
__device__ void layernorm_recompute(T* out, const T* inp, const T* w, const T* b, const float* mean, const float* rstd, int N, int C) {
    constexpr int P = PACK(T);
    const long i0 = pack_start<P>(), NC = (long)N * C;
    if (i0 >= NC) return;
    if (i0 + P <= NC && C % P == 0 && aligned16(out) && aligned16(inp) && aligned16(w) && aligned16(b)) {
        const int row = i0 / C, c0 = i0 % C;
        float x[P], wv[P], bv[P];
        load_pack(x, inp, i0, NC, true);
        load_pack(wv, w, c0, C, true);
        load_pack(bv, b, c0, C, true);
        UNROLL for (int u = 0; u < P; u++) x[u] = (x[u] - mean[row]) * rstd[row] * wv[u] + bv[u];
        store_pack(out, i0, NC, x, true);
    } else {
        for (long i = i0; i < i0 + P && i < NC; i++) {
            int row = i / C, c = i % C;
            store_f32(out, i, (load_f32(inp, i) - mean[row]) * rstd[row] * load_f32(w, c) + load_f32(b, c));
        }
    }
}

// dinp (N,C) += input gradient. One warp per row.
template <typename T>
__device__ void layernorm_backward(T* dinp, const T* dout, const T* inp, const T* w, const float* mean,
                                   const float* rstd, int N, int C) {
    constexpr int P = PACK(T);
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= N) return;
    const long base = (long)row * C;
    float m = mean[row], r = rstd[row];
    float a = 0.f, bsum = 0.f;
    if (rows_in_packs<T>(C, dinp, dout, inp, w)) {
        // The same terms per element as below, a lane's packs lane, lane + 32, ...
        for (int i = lane * P; i < C; i += 32 * P) {
            float x[P], d[P], wv[P];
            load_pack(x, inp + base, i, C, true);
            load_pack(d, dout + base, i, C, true);
            load_pack(wv, w, i, C, true);
            UNROLL for (int u = 0; u < P; u++) {
                float n = (x[u] - m) * r, dn = wv[u] * d[u];
                a += dn; bsum += dn * n;
            }
        }
        a = warp_sum(a) / C; bsum = warp_sum(bsum) / C;
        for (int i = lane * P; i < C; i += 32 * P) {
            float x[P], d[P], wv[P], g[P];
            load_pack(x, inp + base, i, C, true);
            load_pack(d, dout + base, i, C, true);
            load_pack(wv, w, i, C, true);
            load_pack(g, dinp + base, i, C, true);
            UNROLL for (int u = 0; u < P; u++) {
                float n = (x[u] - m) * r, dn = wv[u] * d[u];
                g[u] += (dn - a - n * bsum) * r;
            }
            store_pack(dinp + base, i, C, g, true);
        }
        return;
    }
    for (int i = lane; i < C; i += 32) {
        float n = (load_f32(inp, base + i) - m) * r;
        float dn = load_f32(w, i) * load_f32(dout, base + i);
        a += dn; bsum += dn * n;
    }
    a = warp_sum(a) / C; bsum = warp_sum(bsum) / C;
    for (int i = lane; i < C; i += 32) {
        float n = (load_f32(inp, base + i) - m) * r;
        float dn = load_f32(w, i) * load_f32(dout, base + i);
        store_f32(dinp, base + i, load_f32(dinp, base + i) + (dn - a - n * bsum) * r);
    }
}

// dweight (C) += Σ_rows norm·dout, dbias (C) += Σ_rows dout, stage one: pw, pb (bands, C) f32,
// each band's column sums (`column_partials_add` adds them). Block (32, 16): 32 packs of
// PACK(T) columns (16-byte loads where the rows allow), 16 row strides through the band,
// reduced in shared memory.
template <typename T>
__device__ void layernorm_param_backward_partial(float* pw, float* pb, const T* dout, const T* inp, const float* mean,
                                                 const float* rstd, int N, int C, int band) {
    constexpr int P = PACK(T);
    __shared__ float sw[16][32 * P + 1];
    __shared__ float sb[16][32 * P + 1];
    const int col0 = (blockIdx.x * 32 + threadIdx.x) * P;
    const bool whole = C % P == 0 && aligned16(dout) && aligned16(inp);
    const int end = band_end(N, band);
    float aw[P], ab[P];
    UNROLL for (int u = 0; u < P; u++) aw[u] = ab[u] = 0.f;
    if (col0 < C)
        for (int row = blockIdx.y * band + threadIdx.y; row < end; row += blockDim.y) {
            float d[P], x[P];
            load_pack(d, dout + (long)row * C, col0, C, whole);
            load_pack(x, inp + (long)row * C, col0, C, whole);
            UNROLL for (int u = 0; u < P; u++) {
                ab[u] += d[u];
                aw[u] += (x[u] - mean[row]) * rstd[row] * d[u];
            }
        }
    UNROLL for (int u = 0; u < P; u++) {
        sw[threadIdx.y][threadIdx.x * P + u] = aw[u];
        sb[threadIdx.y][threadIdx.x * P + u] = ab[u];
    }
    __syncthreads();
    if (threadIdx.y == 0)
        for (int u = 0; u < P && col0 + u < C; u++) {
            float w = 0.f, b = 0.f;
            for (int y = 0; y < blockDim.y; y++) { w += sw[y][threadIdx.x * P + u]; b += sb[y][threadIdx.x * P + u]; }
            pw[(long)blockIdx.y * C + col0 + u] = w;
            pb[(long)blockIdx.y * C + col0 + u] = b;
        }
}

extern "C" __global__ void layernorm_forward_f32(float* o, float* m, float* r, const float* x, const float* w, const float* b, int N, int C) { layernorm_forward(o, m, r, x, w, b, N, C); }
extern "C" __global__ void layernorm_forward_bf16(bf16_t* o, float* m, float* r, const bf16_t* x, const bf16_t* w, const bf16_t* b, int N, int C) { layernorm_forward(o, m, r, x, w, b, N, C); }
extern "C" __global__ void layernorm_forward_f16(f16_t* o, float* m, float* r, const f16_t* x, const f16_t* w, const f16_t* b, int N, int C) { layernorm_forward(o, m, r, x, w, b, N, C); }
extern "C" __global__ void layernorm_recompute_f32(float* o, const float* x, const float* w, const float* b, const float* m, const float* r, int N, int C) { layernorm_recompute(o, x, w, b, m, r, N, C); }
extern "C" __global__ void layernorm_recompute_bf16(bf16_t* o, const bf16_t* x, const bf16_t* w, const bf16_t* b, const float* m, const float* r, int N, int C) { layernorm_recompute(o, x, w, b, m, r, N, C); }
extern "C" __global__ void layernorm_recompute_f16(f16_t* o, const f16_t* x, const f16_t* w, const f16_t* b, const float* m, const float* r, int N, int C) { layernorm_recompute(o, x, w, b, m, r, N, C); }
extern "C" __global__ void layernorm_backward_f32(float* dx, const float* d, const float* x, const float* w, const float* m, const float* r, int N, int C) { layernorm_backward(dx, d, x, w, m, r, N, C); }
extern "C" __global__ void layernorm_backward_bf16(bf16_t* dx, const bf16_t* d, const bf16_t* x, const bf16_t* w, const float* m, const float* r, int N, int C) { layernorm_backward(dx, d, x, w, m, r, N, C); }
extern "C" __global__ void layernorm_backward_f16(f16_t* dx, const f16_t* d, const f16_t* x, const f16_t* w, const float* m, const float* r, int N, int C) { layernorm_backward(dx, d, x, w, m, r, N, C); }
extern "C" __global__ void layernorm_param_backward_partial_f32(float* pw, float* pb, const float* d, const float* x, const float* m, const float* r, int N, int C, int band) { layernorm_param_backward_partial(pw, pb, d, x, m, r, N, C, band); }
extern "C" __global__ void layernorm_param_backward_partial_bf16(float* pw, float* pb, const bf16_t* d, const bf16_t* x, const float* m, const float* r, int N, int C, int band) { layernorm_param_backward_partial(pw, pb, d, x, m, r, N, C, band); }
extern "C" __global__ void layernorm_param_backward_partial_f16(float* pw, float* pb, const f16_t* d, const f16_t* x, const float* m, const float* r, int N, int C, int band) { layernorm_param_backward_partial(pw, pb, d, x, m, r, N, C, band); }
