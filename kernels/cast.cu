// Precision casts between the f32 master / accumulators and 16-bit storage (bf16, fp16).
#include "common.cuh"

// out = in converted, P elements per thread (PACK of the 16-bit side).
template <int P, typename D, typename S>
__device__ void cast(D* out, const S* in, long N) {
    const long i0 = pack_start<P>();
    if (i0 >= N) return;
    const bool whole = i0 + P <= N && aligned16(out) && aligned16(in);
    float x[P];
    load_pack(x, in, i0, N, whole);
    store_pack(out, i0, N, x, whole);
}

extern "C" __global__ void cast_f32_to_bf16(bf16_t* out, const float* in, long N) { cast<PACK(bf16_t)>(out, in, N); }
extern "C" __global__ void cast_bf16_to_f32(float* out, const bf16_t* in, long N) { cast<PACK(bf16_t)>(out, in, N); }
extern "C" __global__ void cast_f32_to_f16(f16_t* out, const float* in, long N) { cast<PACK(f16_t)>(out, in, N); }
extern "C" __global__ void cast_f16_to_f32(float* out, const f16_t* in, long N) { cast<PACK(f16_t)>(out, in, N); }
