// A host emulator for this project's CUDA kernels, so CI (no GPU) runs their logic: each thread
// of a block is a fiber (ucontext) on one OS thread, and the blocks of a grid run one after
// another. A fiber runs until it reaches a collective, which is a barrier: a warp's (a shuffle,
// the mma helper, __syncwarp) for the live fibers of its warp, __syncthreads for the block's;
// all of them reach it before any goes on (a block whose threads wait at different kinds of
// barrier, which the hardware would hang or garble on, is reported and stops). So a
// kernel that is correct here is correct in its indexing, masking, fragment layouts and warp
// exchanges; what the emulator cannot show is speed, or a race the real hardware would expose
// between two collectives. Include it, then the kernel family's source with HEADROOM_EMULATE
// defined (common.cuh then calls the emulated conversions and mma).
#pragma once
#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#define HEADROOM_EMULATE 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};

namespace emulate {
inline dim3 threadIdx, blockIdx, blockDim, gridDim;

// What a fiber waits for: nothing (runnable), its warp (a shuffle, mma), or its block.
enum class Wait { None, Warp, Block };

struct Fiber {
    ucontext_t ctx;
    char* stack = nullptr;  // one per thread of a block, kept across the grid's blocks
    dim3 tid;
    bool done = false;
    Wait wait = Wait::None;
};

inline ucontext_t scheduler;
inline std::vector<Fiber> fibers;
inline int current = 0;
inline const std::function<void()>* body = nullptr;

// Each thread's slot for the values a collective exchanges.
struct Slot {
    float f;
    unsigned a[4], b[2];
    float d[4];
};
inline std::vector<Slot> slots;

// Wait until every live thread of this warp (Wait::Warp) or block (Wait::Block) is waiting too.
inline void barrier(Wait scope) {
    fibers[current].wait = scope;
    swapcontext(&fibers[current].ctx, &scheduler);
}

inline void trampoline() {
    (*body)();
    fibers[current].done = true;
}

inline int linear(dim3 t) { return (int)(t.x + blockDim.x * (t.y + blockDim.y * t.z)); }

// Run `kernel` (a callable taking no arguments, reading threadIdx / blockIdx) over the grid.
inline void launch(dim3 grid, dim3 block, const std::function<void()>& kernel) {
    gridDim = grid;
    blockDim = block;
    body = &kernel;
    const int n = (int)(block.x * block.y * block.z);
    slots.assign(n, Slot{});
    constexpr size_t STACK = 128 << 10;
    std::vector<std::unique_ptr<char[]>> stacks;
    for (int i = 0; i < n; i++) stacks.emplace_back(new char[STACK]);  // not zeroed: a stack
    for (unsigned bz = 0; bz < grid.z; bz++)
        for (unsigned by = 0; by < grid.y; by++)
            for (unsigned bx = 0; bx < grid.x; bx++) {
                blockIdx = dim3{bx, by, bz};
                fibers.assign(n, Fiber{});
                for (int i = 0; i < n; i++) {
                    Fiber& f = fibers[i];
                    f.tid = dim3{(unsigned)(i % block.x), (unsigned)(i / block.x % block.y), (unsigned)(i / (block.x * block.y))};
                    f.stack = stacks[i].get();
                    getcontext(&f.ctx);
                    f.ctx.uc_stack.ss_sp = f.stack;
                    f.ctx.uc_stack.ss_size = STACK;
                    f.ctx.uc_link = &scheduler;
                    makecontext(&f.ctx, trampoline, 0);
                }
                for (;;) {
                    // Run every runnable thread to its next barrier (or its end).
                    for (int i = 0; i < n; i++) {
                        if (fibers[i].done || fibers[i].wait != Wait::None) continue;
                        current = i;
                        threadIdx = fibers[i].tid;
                        swapcontext(&scheduler, &fibers[i].ctx);
                    }
                    // Release each warp whose live threads all wait at a warp barrier; failing
                    // that, the block when all its live threads wait at __syncthreads.
                    bool any_live = false, released = false, all_block = true;
                    for (int w = 0; w * 32 < n; w++) {
                        bool live = false, all_warp = true;
                        for (int i = w * 32; i < std::min(n, w * 32 + 32); i++) {
                            if (fibers[i].done) continue;
                            live = true;
                            all_warp = all_warp && fibers[i].wait == Wait::Warp;
                            all_block = all_block && fibers[i].wait == Wait::Block;
                        }
                        any_live = any_live || live;
                        if (live && all_warp) {
                            for (int i = w * 32; i < std::min(n, w * 32 + 32); i++) fibers[i].wait = Wait::None;
                            released = true;
                        }
                    }
                    if (!any_live) break;
                    if (released) continue;
                    if (!all_block) {
                        std::fprintf(stderr, "emulated kernel: threads of block (%u,%u,%u) wait at different barriers\n",
                                     bx, by, bz);
                        std::exit(3);
                    }
                    for (Fiber& f : fibers) f.wait = Wait::None;
                }
            }
}

inline int lane() { return linear(threadIdx) % 32; }
inline Slot& mine() { return slots[linear(threadIdx)]; }
inline Slot& of_lane(int l) { return slots[linear(threadIdx) / 32 * 32 + l]; }

// fp16 through the compiler's _Float16 (conversions round to nearest even, like cvt.rn).
inline float f16_to_f32(unsigned short h) {
    _Float16 v;
    std::memcpy(&v, &h, 2);
    return (float)v;
}
inline unsigned short f32_to_f16(float f) {
    _Float16 v = (_Float16)f;
    unsigned short h;
    std::memcpy(&h, &v, 2);
    return h;
}
}  // namespace emulate

using emulate::blockDim;
using emulate::blockIdx;
using emulate::gridDim;
using emulate::threadIdx;

inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
// CUDA's integer min and max: mixed signedness compares as unsigned, as in CUDA's headers.
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline unsigned min(int a, unsigned b) { return min((unsigned)a, b); }
inline unsigned min(unsigned a, int b) { return min(a, (unsigned)b); }
inline long min(long a, long b) { return a < b ? a : b; }
inline long max(long a, long b) { return a > b ? a : b; }

inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }

inline void __syncthreads() { emulate::barrier(emulate::Wait::Block); }
inline void __syncwarp(unsigned = 0xffffffffu) { emulate::barrier(emulate::Wait::Warp); }

inline float __shfl_xor_sync(unsigned, float v, int offset) {
    emulate::mine().f = v;
    emulate::barrier(emulate::Wait::Warp);
    float r = emulate::of_lane(emulate::lane() ^ offset).f;
    emulate::barrier(emulate::Wait::Warp);
    return r;
}

[[noreturn]] inline void emulate_fail(const char* what) {
    std::fprintf(stderr, "emulated kernel: %s (block %u,%u thread %u)\n", what, blockIdx.x, blockIdx.y, threadIdx.x);
    std::exit(3);
}

inline float emulate_f16_to_f32(unsigned short h) { return emulate::f16_to_f32(h); }
inline unsigned short emulate_f32_to_f16(float v) { return emulate::f32_to_f16(v); }

struct f16_t;
template <typename H> float emulate_half_value(unsigned short bits);
template <> inline float emulate_half_value<unsigned short>(unsigned short bits) { return __uint_as_float((unsigned)bits << 16); }
template <> inline float emulate_half_value<f16_t>(unsigned short bits) { return emulate::f16_to_f32(bits); }

// mma.m16n8k16 with f32 accumulation, per the PTX fragment layout common.cuh documents: every
// lane deposits its fragments, then computes its own four outputs from the whole warp's.
template <typename H>
inline void emulate_mma_16x8x16(float* d, const unsigned* a, const unsigned* b) {
    using namespace emulate;
    Slot& s = mine();
    std::memcpy(s.a, a, sizeof s.a);
    std::memcpy(s.b, b, sizeof s.b);
    barrier(Wait::Warp);
    auto A = [](int row, int col) {  // element (row, col) of the 16×16 A
        int g = row % 8, hi_row = row / 8, q = (col % 8) / 2, hi_col = col / 8;
        unsigned reg = of_lane(4 * g + q).a[hi_row + 2 * hi_col];
        return emulate_half_value<H>((unsigned short)(col % 2 ? reg >> 16 : reg & 0xffffu));
    };
    auto B = [](int row, int col) {  // element (row, col) of the 16×8 B
        int q = (row % 8) / 2, hi = row / 8;
        unsigned reg = of_lane(4 * col + q).b[hi];
        return emulate_half_value<H>((unsigned short)(row % 2 ? reg >> 16 : reg & 0xffffu));
    };
    const int g = lane() / 4, q = lane() % 4;
    float out[4];
    for (int e = 0; e < 4; e++) {
        const int row = g + 8 * (e / 2), col = 2 * q + e % 2;
        double acc = d[e];
        for (int k = 0; k < 16; k++) acc += (double)A(row, k) * (double)B(k, col);
        out[e] = (float)acc;
    }
    barrier(Wait::Warp);
    std::memcpy(d, out, sizeof out);
}
