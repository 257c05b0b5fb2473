//! The CPU reference layers: each a `*_forward` / `*_backward` pair side by side, on plain
//! slices (the pool owns the memory; these functions never allocate).
//!
//! Tensors are stored as `E: Elem` (f32, bf16 or f16); arithmetic is always f32, and LayerNorm
//! statistics, softmax and the loss stay f32. Matmuls go through the gemm crate in f32: for a
//! 16-bit `E` the operands are widened chunk by chunk into caller-provided f32 scratch.
//! Attention is the same: per (sequence, head) and tile of `ATTENTION_TILE` query rows, its
//! scores, probabilities-times-values and gradients are gemm-crate products over the tile's
//! (tile, T) block, on `ATTENTION_LANES` lanes of fixed scratch.
//!
//! Shapes follow llm.c: B batch, T time, C channels, NH heads, hs = C / NH, V vocabulary.
//! Backward functions *accumulate* into parameter gradients (so micro-batches add up) and
//! *overwrite* activation gradients unless documented otherwise.

use std::ops::Range;

use rayon::prelude::*;

use super::simd::widest;

/// A storage element type: converts to and from f32.
pub trait Elem: bytemuck::Pod + Send + Sync + Copy + Default + 'static {
    const BYTES: usize;
    const NAME: &'static str;
    fn to_f32(self) -> f32;
    fn from_f32(x: f32) -> Self;
    /// The slice itself when `Self` is f32 (zero-copy fast paths).
    fn as_f32(s: &[Self]) -> Option<&[f32]>;
    fn as_f32_mut(s: &mut [Self]) -> Option<&mut [f32]>;
    fn is_f32() -> bool {
        Self::BYTES == 4
    }
}

impl Elem for f32 {
    const BYTES: usize = 4;
    const NAME: &'static str = "fp32";
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
    fn as_f32(s: &[Self]) -> Option<&[f32]> {
        Some(s)
    }
    fn as_f32_mut(s: &mut [Self]) -> Option<&mut [f32]> {
        Some(s)
    }
}

impl Elem for half::bf16 {
    const BYTES: usize = 2;
    const NAME: &'static str = "bf16";
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16_to_f32(self.to_bits())
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        half::bf16::from_bits(bf16_bits(x))
    }
    fn as_f32(_: &[Self]) -> Option<&[f32]> {
        None
    }
    fn as_f32_mut(_: &mut [Self]) -> Option<&mut [f32]> {
        None
    }
}

impl Elem for half::f16 {
    const BYTES: usize = 2;
    const NAME: &'static str = "fp16";
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16_to_f32(self.to_bits())
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        half::f16::from_bits(f16_bits(x))
    }
    fn as_f32(_: &[Self]) -> Option<&[f32]> {
        None
    }
    fn as_f32_mut(_: &mut [Self]) -> Option<&mut [f32]> {
        None
    }
}

/// `half::bf16::from_f32(x).to_bits()` — round to nearest even, NaN kept quiet — written
/// without branches so loops that narrow vectorise (tested against `half` bit for bit).
#[inline(always)]
pub fn bf16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    let nan = (bits & 0x7FFF_FFFF) > 0x7F80_0000;
    let round_bit = 0x0000_8000u32;
    let round_up = (bits & round_bit) != 0 && (bits & (3 * round_bit - 1)) != 0;
    let rounded = (bits >> 16) + round_up as u32;
    let quiet = (bits >> 16) | 0x0040;
    (if nan { quiet } else { rounded }) as u16
}

/// `half::bf16::from_bits(b).to_f32()` — the high half of an f32, a NaN made quiet — written
/// without branches so loops that widen vectorise (tested against `half` bit for bit).
#[inline(always)]
pub fn bf16_to_f32(b: u16) -> f32 {
    let nan = (b & 0x7FFF) > 0x7F80;
    f32::from_bits(((b | if nan { 0x0040 } else { 0 }) as u32) << 16)
}

/// `half::f16::from_bits(h).to_f32()`, without branches (`half` asks the CPU for F16C at
/// every call, so its loops run scalar): the magnitude's bits moved into an f32 and scaled by
/// 2^112 (rebiasing the exponent; a subnormal comes out normalised by the multiply), ±∞ and
/// NaN (made quiet, payload kept) given the all-ones exponent. Tested against `half` on every
/// pattern.
#[inline(always)]
pub fn f16_to_f32(h: u16) -> f32 {
    let h = h as u32;
    let scaled = (f32::from_bits((h & 0x7FFF) << 13) * f32::from_bits((254 - 15) << 23)).to_bits();
    let quiet = if h & 0x03FF != 0 { 0x0040_0000 } else { 0 };
    let special = 0x7F80_0000 | ((h & 0x03FF) << 13) | quiet;
    let magnitude = if h & 0x7C00 == 0x7C00 { special } else { scaled };
    f32::from_bits(magnitude | ((h & 0x8000) << 16))
}

/// `half::f16::from_f32(x).to_bits()` — round to nearest even, overflow to ±∞, subnormals,
/// NaN made quiet with the payload's top bits — without branches (F. Giesen's
/// `float_to_half_fast3_rtne`, every case computed and one selected). Tested against `half`.
#[inline(always)]
pub fn f16_bits(x: f32) -> u16 {
    const F16_OVERFLOW: u32 = (127 + 16) << 23; // 65536: ±∞ from here (and ∞, NaN)
    const F16_MIN_NORMAL: u32 = 113 << 23; // 2^-14
    const DENORM_MAGIC: u32 = ((127 - 15) + (23 - 10) + 1) << 23; // 0.5
    let bits = x.to_bits();
    let sign = (bits >> 16) & 0x8000;
    let a = bits & 0x7FFF_FFFF;
    let special = if a > 0x7F80_0000 { 0x7E00 | ((a >> 13) & 0x03FF) } else { 0x7C00 };
    // Subnormal or zero: adding 0.5 lines the 10 mantissa bits up at the bottom, rounded by
    // the FPU to nearest even.
    let subnormal = (f32::from_bits(a) + f32::from_bits(DENORM_MAGIC)).to_bits().wrapping_sub(DENORM_MAGIC);
    // Normal: rebias the exponent by −112 and round to nearest even on the 13 dropped bits
    // (a carry out of the mantissa bumps the exponent, up to ∞).
    let odd = (a >> 13) & 1;
    let normal = a.wrapping_sub(112 << 23).wrapping_add(0x0FFF + odd) >> 13;
    let magnitude = if a >= F16_OVERFLOW {
        special
    } else if a < F16_MIN_NORMAL {
        subnormal
    } else {
        normal
    };
    (magnitude | sign) as u16
}

/// Elements per parallel task of the element-wise ops.
const ELEMENTWISE_CHUNK: usize = 4096;

/// f(a, b) over `a` and `b` (same length) element by element, `ELEMENTWISE_CHUNK` at a time on
/// every core, each chunk's loop compiled for the widest vector unit.
#[inline(always)]
fn for_each_pair<A: Send, B: Copy + Sync>(a: &mut [A], b: &[B], f: impl Fn(&mut A, B) + Sync + Send) {
    assert_eq!(a.len(), b.len(), "element-wise operands");
    a.par_chunks_mut(ELEMENTWISE_CHUNK).zip(b.par_chunks(ELEMENTWISE_CHUNK)).for_each(|(a, b)| {
        widest(
            #[inline(always)]
            || {
                // A `for` loop, not `for_each`: its `fold` may be compiled apart from `widest`'s
                // function, at the baseline instruction set (it was, for bf16 GELU backward).
                for (a, &b) in a.iter_mut().zip(b) {
                    f(a, b)
                }
            },
        )
    });
}

/// Widen `src` into `dst` (same length).
pub fn widen<E: Elem>(dst: &mut [f32], src: &[E]) {
    for_each_pair(
        dst,
        src,
        #[inline(always)]
        |d, s| *d = s.to_f32(),
    );
}

/// Narrow `src` into `dst` (same length).
pub fn narrow<E: Elem>(dst: &mut [E], src: &[f32]) {
    for_each_pair(
        dst,
        src,
        #[inline(always)]
        |d, s| *d = E::from_f32(s),
    );
}

/// A raw pointer that may cross threads: used only where tasks write provably disjoint ranges.
struct SendPtr<T>(*mut T);
impl<T> Clone for SendPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SendPtr<T> {}
unsafe impl<T> Send for SendPtr<T> {}
unsafe impl<T> Sync for SendPtr<T> {}

impl<T> SendPtr<T> {
    /// # Safety
    /// The caller guarantees `offset..offset+len` is in bounds and written by one task only.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice(&self, offset: usize, len: usize) -> &mut [T] {
        std::slice::from_raw_parts_mut(self.0.add(offset), len)
    }
}

fn threads() -> usize {
    rayon::current_num_threads()
}

// ----------------------------------------------------------------------------------------------
// encoder: token + position embedding

/// out: (B,T,C) = wte[inp[b,t]] + wpe[t]; inp: (B,T) token ids; wte: (V,C); wpe: (maxT,C).
pub fn encoder_forward<E: Elem>(out: &mut [E], inp: &[u32], wte: &[E], wpe: &[E], t: usize, c: usize) {
    out.par_chunks_mut(c).zip(inp.par_iter()).enumerate().for_each(|(bt, (row, &tok))| {
        let pos = bt % t;
        let we = &wte[tok as usize * c..][..c];
        let pe = &wpe[pos * c..][..c];
        for i in 0..c {
            row[i] = E::from_f32(we[i].to_f32() + pe[i].to_f32());
        }
    });
}

/// dwte (V,C) += each token's rows of dout (B,T,C), summed in f32 from zero in (b,t) order and
/// added once; dwpe (maxT,C) += dout summed over the batch in order, rounded per add. Both
/// orders are fixed (no atomics anywhere): the cuda kernels sum the same terms in the same order,
/// bit for bit.
pub fn encoder_backward<E: Elem>(dwte: &mut [E], dwpe: &mut [E], dout: &[E], inp: &[u32], t: usize, c: usize) {
    if c == 0 {
        return;
    }
    let (order, starts) = token_order(inp, dwte.len() / c.max(1));
    dwte.par_chunks_mut(c).zip(starts.par_windows(2)).for_each(|(row, run)| {
        if run[0] == run[1] {
            return; // a token this batch does not use
        }
        let mut acc = vec![0f32; c];
        for &bt in &order[run[0]..run[1]] {
            for (a, d) in acc.iter_mut().zip(&dout[bt as usize * c..][..c]) {
                *a += d.to_f32();
            }
        }
        for (w, a) in row.iter_mut().zip(&acc) {
            *w = E::from_f32(w.to_f32() + a);
        }
    });
    let b = inp.len() / t.max(1);
    dwpe[..t * c].par_chunks_mut(c).enumerate().for_each(|(pos, row)| {
        for s in 0..b {
            let d = &dout[(s * t + pos) * c..][..c];
            for (w, d) in row.iter_mut().zip(d) {
                *w = E::from_f32(w.to_f32() + d.to_f32());
            }
        }
    });
}

/// The positions (b,t) of `inp` grouped by token, each group in (b,t) order (a stable counting
/// sort): token v's positions are `order[starts[v]..starts[v + 1]]`; `rows` tokens.
pub fn token_order(inp: &[u32], rows: usize) -> (Vec<u32>, Vec<usize>) {
    let mut starts = vec![0usize; rows + 1];
    for &tok in inp {
        starts[tok as usize + 1] += 1;
    }
    for v in 0..rows {
        starts[v + 1] += starts[v];
    }
    let mut next = starts.clone();
    let mut order = vec![0u32; inp.len()];
    for (bt, &tok) in inp.iter().enumerate() {
        order[next[tok as usize]] = bt as u32;
        next[tok as usize] += 1;
    }
    (order, starts)
}

// ----------------------------------------------------------------------------------------------
// layernorm

const LN_EPS: f32 = 1e-5;
/// Rows per parallel task of the layernorm passes.
const LN_ROWS: usize = 16;
/// Columns per parallel task of `add_column_sums` (LayerNorm's and the matmuls' parameter
/// gradients): each task walks every row over its block of columns.
const COLUMN_BLOCK: usize = 64;

/// out: (N,C) normalised rows scaled by weight (C) plus bias (C); mean, rstd: (N) f32, kept for
/// backward.
pub fn layernorm_forward<E: Elem>(
    out: &mut [E],
    mean: &mut [f32],
    rstd: &mut [f32],
    inp: &[E],
    weight: &[E],
    bias: &[E],
    c: usize,
) {
    let rows = |s: usize| s * LN_ROWS;
    out.par_chunks_mut(rows(c))
        .zip(inp.par_chunks(rows(c)))
        .zip(mean.par_chunks_mut(LN_ROWS).zip(rstd.par_chunks_mut(LN_ROWS)))
        .for_each(|((o, x), (m, r))| {
            widest(
                #[inline(always)]
                || {
                    for ((o, x), (m, r)) in o.chunks_mut(c).zip(x.chunks(c)).zip(m.iter_mut().zip(r.iter_mut())) {
                        (*m, *r) = row_stats(x);
                        normalise_row(o, x, weight, bias, *m, *r);
                    }
                },
            )
        });
}

/// Mean and reciprocal standard deviation of one row, accumulated in f64 in `REDUCE_LANES`
/// partial sums (a fixed order: the same bits on every machine).
#[inline(always)]
fn row_stats<E: Elem>(x: &[E]) -> (f32, f32) {
    let n = x.len() as f64;
    let mean = lane_sum(
        x,
        #[inline(always)]
        |v| v as f64,
    ) / n;
    let var = lane_sum(
        x,
        #[inline(always)]
        |v| (v as f64 - mean) * (v as f64 - mean),
    ) / n;
    (mean as f32, (1.0 / (var + LN_EPS as f64).sqrt()) as f32)
}

/// Σ f(x) over a row in `REDUCE_LANES` f64 partial sums, added in lane order, then the tail.
#[inline(always)]
fn lane_sum<E: Elem>(x: &[E], f: impl Fn(f32) -> f64) -> f64 {
    let mut acc = [0f64; REDUCE_LANES];
    let chunks = x.chunks_exact(REDUCE_LANES);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (a, v) in acc.iter_mut().zip(chunk) {
            *a += f(v.to_f32());
        }
    }
    let mut sum = 0.0;
    for a in acc {
        sum += a;
    }
    for v in tail {
        sum += f(v.to_f32());
    }
    sum
}

/// o = (x − mean) · rstd · weight + bias over one row.
#[inline(always)]
fn normalise_row<E: Elem>(o: &mut [E], x: &[E], weight: &[E], bias: &[E], mu: f32, rs: f32) {
    for ((o, x), (w, b)) in o.iter_mut().zip(x).zip(weight.iter().zip(bias)) {
        *o = E::from_f32((x.to_f32() - mu) * rs * w.to_f32() + b.to_f32());
    }
}

/// Recompute a layernorm output from its input and saved statistics (used by checkpointing).
pub fn layernorm_recompute<E: Elem>(
    out: &mut [E],
    inp: &[E],
    weight: &[E],
    bias: &[E],
    mean: &[f32],
    rstd: &[f32],
    c: usize,
) {
    let rows = |s: usize| s * LN_ROWS;
    out.par_chunks_mut(rows(c))
        .zip(inp.par_chunks(rows(c)))
        .zip(mean.par_chunks(LN_ROWS).zip(rstd.par_chunks(LN_ROWS)))
        .for_each(|((o, x), (m, r))| {
            widest(
                #[inline(always)]
                || {
                    for ((o, x), (&m, &r)) in o.chunks_mut(c).zip(x.chunks(c)).zip(m.iter().zip(r)) {
                        normalise_row(o, x, weight, bias, m, r);
                    }
                },
            )
        });
}

/// dinp (N,C) += input gradient; dweight, dbias (C) += parameter gradients.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward<E: Elem>(
    dinp: &mut [E],
    dweight: &mut [E],
    dbias: &mut [E],
    dout: &[E],
    inp: &[E],
    weight: &[E],
    mean: &[f32],
    rstd: &[f32],
    c: usize,
) {
    let rows = |s: usize| s * LN_ROWS;
    dinp.par_chunks_mut(rows(c))
        .zip(dout.par_chunks(rows(c)).zip(inp.par_chunks(rows(c))))
        .zip(mean.par_chunks(LN_ROWS).zip(rstd.par_chunks(LN_ROWS)))
        .for_each(|((di, (d, x)), (m, r))| {
            widest(
                #[inline(always)]
                || {
                    for ((di, (d, x)), (&mu, &rs)) in
                        di.chunks_mut(c).zip(d.chunks(c).zip(x.chunks(c))).zip(m.iter().zip(r))
                    {
                        layernorm_backward_row(di, d, x, weight, mu, rs);
                    }
                },
            )
        });
    // Parameter gradients: dweight += Σ norm · dout, dbias += Σ dout over the rows.
    let n = mean.len();
    add_column_sums(
        [dweight, dbias],
        n,
        #[inline(always)]
        |r, cols, [aw, ab]| {
            let (mu, rs) = (mean[r], rstd[r]);
            let (d, x) = (&dout[r * c..][cols.clone()], &inp[r * c..][cols]);
            for ((aw, ab), (d, x)) in aw.iter_mut().zip(ab.iter_mut()).zip(d.iter().zip(x)) {
                let di = d.to_f32();
                *ab += di;
                *aw += (x.to_f32() - mu) * rs * di;
            }
        },
    );
}

/// dst[j] += Σ over `rows` rows of what `add_row(r, cols, acc)` adds into the f32 accumulators of
/// columns `cols` for row r, for every column j of each of the K destinations (equal widths):
/// each column summed in row order in f32 (deterministic, bitwise repeatable) — from the stored
/// value in f32 storage, the bits of adding into it row by row, else from zero and added once,
/// rounded once. The columns go in blocks of `COLUMN_BLOCK` to every core, each block walking
/// every row (not a strided walk per column). Bias and LayerNorm parameter gradients.
#[inline(always)]
fn add_column_sums<E: Elem, const K: usize>(
    dsts: [&mut [E]; K],
    rows: usize,
    add_row: impl Fn(usize, Range<usize>, &mut [[f32; COLUMN_BLOCK]; K]) + Sync + Send,
) {
    let c = dsts[0].len();
    assert!(dsts.iter().all(|d| d.len() == c), "column sums of one width");
    let dsts = dsts.map(|d| SendPtr(d.as_mut_ptr()));
    (0..c.div_ceil(COLUMN_BLOCK)).into_par_iter().for_each(|blk| {
        let cols = blk * COLUMN_BLOCK..(blk * COLUMN_BLOCK + COLUMN_BLOCK).min(c);
        // SAFETY: the blocks are disjoint and in bounds (every destination is c long); each is
        // written by this task alone.
        let mut dsts = dsts.each_ref().map(|d| unsafe { d.slice(cols.start, cols.len()) });
        widest(
            #[inline(always)]
            || {
                let w = cols.len();
                let mut acc = [[0f32; COLUMN_BLOCK]; K];
                if E::is_f32() {
                    for (a, d) in acc.iter_mut().zip(&dsts) {
                        widen_here(&mut a[..w], d);
                    }
                }
                for r in 0..rows {
                    add_row(r, cols.clone(), &mut acc);
                }
                for (a, d) in acc.iter_mut().zip(dsts.iter_mut()) {
                    if !E::is_f32() {
                        for (a, d) in a.iter_mut().zip(d.iter()) {
                            *a += d.to_f32();
                        }
                    }
                    narrow_here(d, &a[..w]);
                }
            },
        )
    });
}

/// One row of layernorm's input gradient: di += (dnorm − mean(dnorm) − norm · mean(dnorm ·
/// norm)) · rstd, with dnorm = weight · d; the two means in `REDUCE_LANES` f32 partial sums.
#[inline(always)]
fn layernorm_backward_row<E: Elem>(di: &mut [E], d: &[E], x: &[E], weight: &[E], mu: f32, rs: f32) {
    let c = d.len();
    let (mut dnorm_sum, mut dnorm_norm_sum) = ([0f32; REDUCE_LANES], [0f32; REDUCE_LANES]);
    let lanes = c - c % REDUCE_LANES;
    for ((d, x), w) in d[..lanes]
        .chunks_exact(REDUCE_LANES)
        .zip(x[..lanes].chunks_exact(REDUCE_LANES))
        .zip(weight[..lanes].chunks_exact(REDUCE_LANES))
    {
        for l in 0..REDUCE_LANES {
            let dnorm = w[l].to_f32() * d[l].to_f32();
            dnorm_sum[l] += dnorm;
            dnorm_norm_sum[l] += dnorm * ((x[l].to_f32() - mu) * rs);
        }
    }
    let (mut dnorm_mean, mut dnorm_norm_mean) = (0f32, 0f32);
    for l in 0..REDUCE_LANES {
        dnorm_mean += dnorm_sum[l];
        dnorm_norm_mean += dnorm_norm_sum[l];
    }
    for i in lanes..c {
        let dnorm = weight[i].to_f32() * d[i].to_f32();
        dnorm_mean += dnorm;
        dnorm_norm_mean += dnorm * ((x[i].to_f32() - mu) * rs);
    }
    dnorm_mean /= c as f32;
    dnorm_norm_mean /= c as f32;
    for ((di, d), (x, w)) in di.iter_mut().zip(d).zip(x.iter().zip(weight)) {
        let norm = (x.to_f32() - mu) * rs;
        let dnorm = w.to_f32() * d.to_f32();
        *di = E::from_f32(di.to_f32() + (dnorm - dnorm_mean - norm * dnorm_norm_mean) * rs);
    }
}

// ----------------------------------------------------------------------------------------------
// matmul (through the gemm crate, f32)

/// Rows a lane of a 16-bit matmul widens and multiplies at a time.
pub const MATMUL_ROW_CHUNK: usize = 128;
/// Lanes of a 16-bit matmul: row chunks in flight at once, each widened, multiplied and
/// narrowed by one task (its GEMM on one core when the lanes fill the cores, on all of them
/// otherwise), so a matmul is a few parallel regions, not several per chunk. Two: on this
/// project's 2-core machine as fast as sixteen (`bench --preset d4-128 --profile --precision
/// bf16`: matmuls forward 21.7 ms and backward 44.8 ms per step with two lanes, 22.5 and 40.8
/// with sixteen, 91 and 113 with one chunk at a time on every core) for an eighth of the
/// scratch rows: a tight `device_memory` on the cpu feels every widened row.
pub const MATMUL_LANES: usize = 2;
/// The f32 elements the lanes' row chunks may hold together: past it, fewer lanes (a chunk of
/// 128 rows of a very wide layer's input and output is a lane alone, its GEMM on every core).
pub const MATMUL_LANES_ELEMENTS: usize = 8 << 20;

/// The 16-bit matmul's partition of its N rows: rows per chunk and chunks in flight (lanes).
/// A function of the shapes alone, so the scratch is too, whatever the machine's cores.
#[derive(Debug, Clone, Copy)]
struct MatmulLanes {
    chunk: usize,
    lanes: usize,
}

impl MatmulLanes {
    fn of(n: usize, c: usize, oc: usize) -> Self {
        let chunk = n.clamp(1, MATMUL_ROW_CHUNK);
        let fit = MATMUL_LANES_ELEMENTS / (chunk * (c + oc)).max(1);
        MatmulLanes { chunk, lanes: fit.clamp(1, MATMUL_LANES).min(n.div_ceil(chunk).max(1)) }
    }

    /// Rows widened at once by all the lanes.
    fn rows(self) -> usize {
        self.chunk * self.lanes
    }

    /// Whether each lane's GEMM runs on every core: when the lanes are too few to fill them.
    fn parallel_gemm(self) -> bool {
        self.lanes < threads()
    }
}

/// Widen `src` into `dst` (same length) on the calling thread, vectorised.
#[inline(always)]
fn widen_here<E: Elem>(dst: &mut [f32], src: &[E]) {
    assert_eq!(dst.len(), src.len(), "element-wise operands");
    widest(
        #[inline(always)]
        || {
            for (d, s) in dst.iter_mut().zip(src) {
                *d = s.to_f32()
            }
        },
    )
}

/// Narrow `src` into `dst` (same length) on the calling thread, vectorised.
#[inline(always)]
fn narrow_here<E: Elem>(dst: &mut [E], src: &[f32]) {
    assert_eq!(dst.len(), src.len(), "element-wise operands");
    widest(
        #[inline(always)]
        || {
            for (d, &s) in dst.iter_mut().zip(src) {
                *d = E::from_f32(s)
            }
        },
    )
}

/// One operand of a GEMM: its first element and its row and column strides, in elements.
#[derive(Clone, Copy)]
struct Operand<P> {
    ptr: P,
    rs: usize,
    cs: usize,
}

impl Operand<*const f32> {
    /// A row-major matrix in `s` with row stride `rs`.
    fn rows(s: &[f32], rs: usize) -> Self {
        Operand { ptr: s.as_ptr(), rs, cs: 1 }
    }

    /// The transpose of this operand (strides swapped).
    fn t(self) -> Self {
        Operand { ptr: self.ptr, rs: self.cs, cs: self.rs }
    }
}

/// dst (m,n) = [dst +] lhs (m,k) · rhs (k,n) in f32 through the gemm crate (on the rayon pool,
/// or on the calling thread).
///
/// # Safety
/// Every element the shapes and strides reach is in bounds of its allocation, and no other
/// thread touches dst's elements meanwhile.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_raw(
    (m, n, k): (usize, usize, usize),
    dst: Operand<*mut f32>,
    accumulate: bool,
    lhs: Operand<*const f32>,
    rhs: Operand<*const f32>,
    parallel: bool,
) {
    let par = if parallel { gemm::Parallelism::Rayon(threads()) } else { gemm::Parallelism::None };
    gemm::gemm(
        m,
        n,
        k,
        dst.ptr,
        dst.cs as isize,
        dst.rs as isize,
        accumulate,
        lhs.ptr,
        lhs.cs as isize,
        lhs.rs as isize,
        rhs.ptr,
        rhs.cs as isize,
        rhs.rs as isize,
        1.0,
        1.0,
        false,
        false,
        false,
        par,
    );
}

/// dst (m,n) = [dst +] lhs (m,k) · rhs (k,n), all given by row/column strides, on every core
/// (`parallel`) or on the calling thread.
#[allow(clippy::too_many_arguments)]
fn gemm_f32(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [f32],
    dst_rs: usize,
    accumulate: bool,
    lhs: &[f32],
    lhs_rs: usize,
    lhs_cs: usize,
    rhs: &[f32],
    rhs_rs: usize,
    rhs_cs: usize,
    parallel: bool,
) {
    assert!(dst.len() >= (m - 1) * dst_rs + n, "gemm dst: ({m},{n}) rs {dst_rs} in {}", dst.len());
    assert!(lhs.len() > (m - 1) * lhs_rs + (k - 1) * lhs_cs, "gemm lhs: ({m},{k}) in {}", lhs.len());
    assert!(rhs.len() > (k - 1) * rhs_rs + (n - 1) * rhs_cs, "gemm rhs: ({k},{n}) in {}", rhs.len());
    let dst = Operand { ptr: dst.as_mut_ptr(), rs: dst_rs, cs: 1 };
    let lhs = Operand { ptr: lhs.as_ptr(), rs: lhs_rs, cs: lhs_cs };
    let rhs = Operand { ptr: rhs.as_ptr(), rs: rhs_rs, cs: rhs_cs };
    // SAFETY: the asserts above bound every access; dst is borrowed mutably.
    unsafe { gemm_raw((m, n, k), dst, accumulate, lhs, rhs, parallel) }
}

/// f32 scratch elements `matmul_forward::<E>` needs for an (N,C)·(OC,C)ᵀ product.
pub fn matmul_forward_scratch<E: Elem>(n: usize, c: usize, oc: usize) -> usize {
    if E::is_f32() {
        return 0;
    }
    MatmulPlan::forward(n, c, oc).forward_scratch(c)
}

/// f32 scratch elements `matmul_backward::<E>` needs.
pub fn matmul_backward_scratch<E: Elem>(n: usize, c: usize, oc: usize) -> usize {
    if E::is_f32() {
        return 0;
    }
    MatmulPlan::backward(n, c, oc).backward_scratch(n, c)
}

/// f32 elements of a 16-bit matmul's widened weight block: a weight of more (OC, C) elements
/// than this — the classifier's (V, C) — is widened and multiplied a block of OC rows at a
/// time, so the scratch holds a block (4 MiB), not the whole f32 weight (GPT-2's: 147 MiB,
/// twice over in backward). 1M elements: `bench --preset small --precision bf16` (d4-256, GPT-2
/// vocabulary, B 4, T 64) steps in 100 ms at a 290.6 MiB peak, against 113–123 ms and 316.0 MiB
/// with 4M-element blocks, 107–127 ms and 282.2 MiB with 256k, 128–139 ms and 401.6 MiB with
/// the whole weight (fp32: 99 ms, 312.6 MiB).
pub const MATMUL_WEIGHT_BLOCK_ELEMENTS: usize = 1 << 20;

/// The blocks of OC rows a 16-bit matmul widens its weight in: `count` blocks of `width`
/// rows, the last possibly shorter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct WeightBlocks {
    width: usize,
    count: usize,
}

impl WeightBlocks {
    fn whole(oc: usize) -> Self {
        WeightBlocks { width: oc, count: 1 }
    }

    /// As few blocks as keep each within `elements` (`MATMUL_WEIGHT_BLOCK_ELEMENTS`), of even
    /// widths.
    fn of(c: usize, oc: usize, elements: usize) -> Self {
        let most = (elements / c.max(1)).max(1);
        let width = oc.div_ceil(oc.div_ceil(most).max(1)).max(1);
        WeightBlocks { width, count: oc.div_ceil(width).max(1) }
    }

    /// Each block's OC rows.
    fn ranges(self, oc: usize) -> impl Iterator<Item = Range<usize>> {
        (0..self.count).map(move |j| j * self.width..((j + 1) * self.width).min(oc))
    }
}

/// How a 16-bit matmul runs: its weight blocks, and the lanes over rows of one block.
///
/// Forward blocks whenever the weight is over the block budget. Backward with one block widens
/// the weight and its gradient whole and narrows each lane's dinp rows straight from its
/// product; with several, a block of each at a time, dinp summed over the blocks in an f32
/// (N, C) accumulator first — so it blocks only when that declares less scratch (a long
/// vocabulary over few rows, the classifier's case).
#[derive(Debug, Clone, Copy)]
struct MatmulPlan {
    blocks: WeightBlocks,
    lanes: MatmulLanes,
}

impl MatmulPlan {
    fn forward(n: usize, c: usize, oc: usize) -> Self {
        Self::blocked(n, c, oc, MATMUL_WEIGHT_BLOCK_ELEMENTS)
    }

    fn backward(n: usize, c: usize, oc: usize) -> Self {
        Self::backward_within(n, c, oc, MATMUL_WEIGHT_BLOCK_ELEMENTS)
    }

    fn backward_within(n: usize, c: usize, oc: usize, block_elements: usize) -> Self {
        let whole = MatmulPlan { blocks: WeightBlocks::whole(oc), lanes: MatmulLanes::of(n, c, oc) };
        let blocked = Self::blocked(n, c, oc, block_elements);
        match blocked.blocks.count > 1 && blocked.backward_scratch(n, c) < whole.backward_scratch(n, c) {
            true => blocked,
            false => whole,
        }
    }

    /// Blocks of at most `block_elements`, whatever the scratch.
    fn blocked(n: usize, c: usize, oc: usize, block_elements: usize) -> Self {
        let blocks = WeightBlocks::of(c, oc, block_elements);
        MatmulPlan { blocks, lanes: MatmulLanes::of(n, c, blocks.width) }
    }

    /// Forward's: the widened weight block, the lanes' widened rows and their products.
    fn forward_scratch(self, c: usize) -> usize {
        let w = self.blocks.width;
        w * c + self.lanes.rows() * (c + w)
    }

    /// Backward's: the widened weight and weight-gradient blocks, the lanes' widened dout and
    /// inp rows, and (several blocks) the f32 dinp accumulator.
    fn backward_scratch(self, n: usize, c: usize) -> usize {
        let w = self.blocks.width;
        let accumulator = if self.blocks.count > 1 { n * c } else { 0 };
        2 * w * c + self.lanes.rows() * (c + w) + accumulator
    }
}

/// out: (N,OC) = inp (N,C) · weightᵀ (weight: (OC,C)) + bias (OC).
#[allow(clippy::too_many_arguments)]
pub fn matmul_forward<E: Elem>(
    out: &mut [E],
    inp: &[E],
    weight: &[E],
    bias: Option<&[E]>,
    n: usize,
    c: usize,
    oc: usize,
    scratch: &mut [f32],
) {
    if let (Some(out), Some(inp), Some(weight)) = (E::as_f32_mut(out), E::as_f32(inp), E::as_f32(weight)) {
        match bias.and_then(E::as_f32) {
            Some(b) => out.par_chunks_mut(oc).for_each(|row| row.copy_from_slice(b)),
            None => out.fill(0.0),
        }
        gemm_f32(n, oc, c, out, oc, true, inp, c, 1, weight, 1, c, true);
        return;
    }
    matmul_forward_16(MatmulPlan::forward(n, c, oc), out, inp, weight, bias, n, c, oc, scratch)
}

/// `matmul_forward` in 16-bit storage, as `plan` partitions it.
#[allow(clippy::too_many_arguments)]
fn matmul_forward_16<E: Elem>(
    plan: MatmulPlan,
    out: &mut [E],
    inp: &[E],
    weight: &[E],
    bias: Option<&[E]>,
    n: usize,
    c: usize,
    oc: usize,
    scratch: &mut [f32],
) {
    // Per block of weight rows (one, unless the weight is the classifier's): widen it, then
    // lane l takes row chunks l, l + lanes, …: widens its rows, multiplies them by the block
    // and narrows the product into the block's output columns, all on one task.
    let MatmulPlan { blocks, lanes } = plan;
    let width = blocks.width;
    let (w32, rest) = scratch.split_at_mut(width * c);
    let (x32, rest) = rest.split_at_mut(lanes.rows() * c);
    let y32 = &mut rest[..lanes.rows() * width];
    // The lanes write `out` through a raw pointer: its length is checked here, once.
    assert_eq!(out.len(), n * oc, "matmul_forward out (N,OC)");
    assert_eq!(inp.len(), n * c, "matmul_forward inp (N,C)");
    let out = SendPtr(out.as_mut_ptr());
    let (ch, parallel) = (lanes.chunk, lanes.parallel_gemm());
    for cols in blocks.ranges(oc) {
        let ob = cols.len();
        let w32 = &mut w32[..ob * c];
        widen(w32, &weight[cols.start * c..cols.end * c]);
        let (w32, cols) = (&*w32, &cols);
        x32.par_chunks_mut(ch * c).zip(y32.par_chunks_mut(ch * width)).enumerate().for_each(|(lane, (x32, y32))| {
            for start in (lane * ch..n).step_by(lanes.rows()) {
                let rows = ch.min(n - start);
                let (x, y) = (&mut x32[..rows * c], &mut y32[..rows * ob]);
                widen_here(x, &inp[start * c..(start + rows) * c]);
                match bias {
                    Some(b) => y.chunks_mut(ob).for_each(|row| widen_here(row, &b[cols.clone()])),
                    None => y.fill(0.0),
                }
                gemm_f32(rows, ob, c, y, ob, true, x, c, 1, w32, 1, c, parallel);
                for (r, y) in y.chunks(ob).enumerate() {
                    // SAFETY: each chunk's output rows are written by the one lane that owns
                    // the chunk; `cols` is within the row.
                    narrow_here(unsafe { out.slice((start + r) * oc + cols.start, ob) }, y);
                }
            }
        });
    }
}

/// dinp (N,C) = dout (N,OC) · weight (OC,C) [overwritten]; dweight (OC,C) += doutᵀ · inp;
/// dbias (OC) += Σ_rows dout.
#[allow(clippy::too_many_arguments)]
pub fn matmul_backward<E: Elem>(
    dinp: &mut [E],
    dweight: &mut [E],
    dbias: Option<&mut [E]>,
    dout: &[E],
    inp: &[E],
    weight: &[E],
    n: usize,
    c: usize,
    oc: usize,
    scratch: &mut [f32],
) {
    if let (Some(dinp), Some(dweight), Some(dout), Some(inp), Some(weight)) =
        (E::as_f32_mut(dinp), E::as_f32_mut(dweight), E::as_f32(dout), E::as_f32(inp), E::as_f32(weight))
    {
        gemm_f32(n, c, oc, dinp, c, false, dout, oc, 1, weight, c, 1, true);
        gemm_f32(oc, c, n, dweight, c, true, dout, 1, oc, inp, c, 1, true);
    } else {
        let plan = MatmulPlan::backward(n, c, oc);
        matmul_backward_16(plan, dinp, dweight, dout, inp, weight, n, c, oc, scratch);
    }
    if let Some(db) = dbias {
        add_column_sums(
            [db],
            n,
            #[inline(always)]
            |r, cols, [acc]| {
                for (a, x) in acc.iter_mut().zip(&dout[r * oc..][cols]) {
                    *a += x.to_f32();
                }
            },
        );
    }
}

/// `matmul_backward`'s dinp and dweight in 16-bit storage, as `plan` partitions them.
#[allow(clippy::too_many_arguments)]
fn matmul_backward_16<E: Elem>(
    plan: MatmulPlan,
    dinp: &mut [E],
    dweight: &mut [E],
    dout: &[E],
    inp: &[E],
    weight: &[E],
    n: usize,
    c: usize,
    oc: usize,
    scratch: &mut [f32],
) {
    // Per block of weight rows, its weight and weight gradient widened; per group of lanes
    // × chunk rows: each lane widens its chunk of dout's block columns and computes its
    // dinp rows (one block: through the x scratch, narrowed at once; several: added into
    // the f32 accumulator, narrowed after the last block), then widens its inp rows into
    // x; one GEMM over the group's rows then adds doutᵀ · inp into the block's f32 weight
    // gradient, narrowed once after the last group.
    let MatmulPlan { blocks, lanes } = plan;
    let width = blocks.width;
    let (w32, rest) = scratch.split_at_mut(width * c);
    let (dw32, rest) = rest.split_at_mut(width * c);
    let (d32, rest) = rest.split_at_mut(lanes.rows() * width);
    let (x32, rest) = rest.split_at_mut(lanes.rows() * c);
    let accumulator = if blocks.count > 1 { &mut rest[..n * c] } else { &mut rest[..0] };
    assert_eq!(dinp.len(), n * c, "matmul_backward dinp (N,C)");
    assert_eq!(dout.len(), n * oc, "matmul_backward dout (N,OC)");
    let accumulator = SendPtr(accumulator.as_mut_ptr());
    let (ch, parallel) = (lanes.chunk, lanes.parallel_gemm());
    for (j, cols) in blocks.ranges(oc).enumerate() {
        let ob = cols.len();
        let (first, last) = (j == 0, j + 1 == blocks.count);
        let (w32, dw32) = (&mut w32[..ob * c], &mut dw32[..ob * c]);
        widen(w32, &weight[cols.start * c..cols.end * c]);
        widen(dw32, &dweight[cols.start * c..cols.end * c]);
        let (w32, cols) = (&*w32, &cols);
        for start in (0..n).step_by(lanes.rows()) {
            let rows = lanes.rows().min(n - start);
            let (d, x) = (&mut d32[..rows * ob], &mut x32[..rows * c]);
            d.par_chunks_mut(ch * ob)
                .zip(x.par_chunks_mut(ch * c))
                .zip(inp[start * c..(start + rows) * c].par_chunks(ch * c))
                .zip(dinp[start * c..(start + rows) * c].par_chunks_mut(ch * c))
                .enumerate()
                .for_each(|(lane, (((d, x), inp), dinp))| {
                    let (m, row0) = (inp.len() / c, start + lane * ch);
                    for (r, d) in d.chunks_mut(ob).enumerate() {
                        widen_here(d, &dout[(row0 + r) * oc..][cols.clone()]);
                    }
                    if blocks.count == 1 {
                        gemm_f32(m, c, ob, x, c, false, d, ob, 1, w32, c, 1, parallel);
                        narrow_here(dinp, x);
                    } else {
                        // SAFETY: rows row0..row0 + m of the (N, C) accumulator are this
                        // lane's alone in this group.
                        let acc = unsafe { accumulator.slice(row0 * c, m * c) };
                        gemm_f32(m, c, ob, acc, c, !first, d, ob, 1, w32, c, 1, parallel);
                        if last {
                            narrow_here(dinp, acc);
                        }
                    }
                    widen_here(x, inp);
                });
            gemm_f32(ob, c, rows, dw32, c, true, d, 1, ob, x, c, 1, true);
        }
        narrow(&mut dweight[cols.start * c..cols.end * c], dw32);
    }
}

// ----------------------------------------------------------------------------------------------
// causal self-attention

/// Query rows per tile of the cpu attention: each (batch, head) runs its queries in tiles of this
/// many, each tile's products GEMMs against the keys and values up to its last query.
pub const ATTENTION_TILE: usize = 64;
/// (batch, head) pairs in flight at once, each with its own scratch: lane `l` takes pairs
/// l, l + LANES, …, so the workspace is fixed whatever the batch and however many cores run it.
pub const ATTENTION_LANES: usize = 16;

/// The cpu attention's partition of the work: lanes and tile rows.
#[derive(Debug, Clone, Copy)]
struct AttentionTiles {
    lanes: usize,
    tile: usize,
}

impl AttentionTiles {
    fn of(b: usize, t: usize, nh: usize) -> Self {
        AttentionTiles { lanes: (b * nh).clamp(1, ATTENTION_LANES), tile: t.clamp(1, ATTENTION_TILE) }
    }
}

/// Rows `rows` of one head's (T, HS) slice of a tensor — q, k or v of (B,T,3C), or dout of
/// (B,T,C) — as an f32 GEMM operand: in place when the storage is f32, else widened into
/// `wide` (rows, HS). `src` starts at the head's first element of the sequence's row 0; `rs` is
/// the tensor's row stride.
#[inline(always)] // runs in its callers' `widest`
fn head_rows<E: Elem>(src: &[E], rs: usize, rows: Range<usize>, hs: usize, wide: &mut [f32]) -> Operand<*const f32> {
    let src = &src[rows.start * rs..];
    match E::as_f32(src) {
        Some(src) => Operand::rows(src, rs),
        None => {
            for (w, row) in wide[..rows.len() * hs].chunks_mut(hs).zip(src.chunks(rs)) {
                for (w, x) in w.iter_mut().zip(&row[..hs]) {
                    *w = x.to_f32();
                }
            }
            Operand::rows(wide, hs)
        }
    }
}

/// Narrow an f32 block of HS-wide rows (row stride `block_rs`) into `dst` rows of stride `rs`,
/// starting at `first`.
///
/// # Safety
/// The rows' HS elements are in bounds of `dst` and written by this task alone.
#[inline(always)] // runs in its callers' `widest`
unsafe fn narrow_rows<E: Elem>(
    dst: SendPtr<E>,
    (first, rs): (usize, usize),
    block: &[f32],
    block_rs: usize,
    hs: usize,
) {
    for (r, x) in block.chunks(block_rs).enumerate() {
        for (d, x) in dst.slice(first + r * rs, hs).iter_mut().zip(&x[..hs]) {
            *d = E::from_f32(*x);
        }
    }
}

/// A tile's probabilities: p (m, n) row-major, for queries i0..i0+m (`q`: those m rows) against
/// keys 0..n (n = i0 + m). The scores q·kᵀ are one GEMM; each row is then scaled, and key t2 of
/// query ti = i0 + r gets exp(s − lse) rounded to `E` if t2 ≤ ti, else 0. Forward computes each
/// row's lse here (`compute_lse`); backward passes the kept ones, and so gets forward's
/// probabilities bit for bit (same GEMM, same arithmetic).
#[allow(clippy::too_many_arguments)]
#[inline(always)] // runs in its callers' `widest`
fn tile_probabilities<E: Elem>(
    p: &mut [f32],
    q: Operand<*const f32>,
    k: Operand<*const f32>,
    (i0, m, hs): (usize, usize, usize),
    scale: f32,
    lse: &mut [f32],
    compute_lse: bool,
) {
    let n = i0 + m;
    let dst = Operand { ptr: p.as_mut_ptr(), rs: n, cs: 1 };
    // SAFETY: q has m rows and k n rows of HS (the callers' operands); p holds m·n.
    unsafe { gemm_raw((m, n, hs), dst, false, q, k.t(), false) };
    for (r, row) in p[..m * n].chunks_mut(n).enumerate() {
        let (live, masked) = row.split_at_mut(i0 + r + 1);
        for s in live.iter_mut() {
            *s *= scale;
        }
        if compute_lse {
            lse[r] = log_sum_exp(live);
        }
        let lse = lse[r];
        for s in live.iter_mut() {
            *s = probability::<E>(*s, lse);
        }
        masked.fill(0.0);
    }
}

/// f32 scratch elements attention_forward needs, per lane: a tile's probabilities (tile, T)
/// and, for 16-bit storage, its head's k and v widened (2 × (T, HS)) and the tile's q and
/// output (2 × (tile, HS)).
pub fn attention_forward_scratch<E: Elem>(b: usize, t: usize, c: usize, nh: usize) -> usize {
    let AttentionTiles { lanes, tile } = AttentionTiles::of(b, t, nh);
    let hs = c / nh;
    lanes * (tile * t + if E::is_f32() { 0 } else { 2 * t * hs + 2 * tile * hs })
}

/// out: (B,T,C); lse: (B,NH,T) f32, each row's log-sum-exp of its scaled scores, kept for
/// backward instead of the (B,NH,T,T) probabilities (which backward recomputes from it);
/// qkv: (B,T,3C) with q, k, v side by side; scratch: see [`attention_forward_scratch`].
///
/// For query t and key t2 ≤ t: s = q·k / √HS, p = exp(s − lse) rounded to `E`, out = Σ p · v.
/// Each (batch, head) runs in tiles of [`ATTENTION_TILE`] queries: the scores and the weighted
/// values are f32 GEMMs against the keys and values up to the tile's last query.
#[allow(clippy::too_many_arguments)]
pub fn attention_forward<E: Elem>(
    out: &mut [E],
    lse: &mut [f32],
    qkv: &[E],
    scratch: &mut [f32],
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
) {
    let hs = c / nh;
    let scale = 1.0 / (hs as f32).sqrt();
    assert_eq!(lse.len(), b * nh * t, "lse: (B,NH,T)");
    assert_eq!(out.len(), b * t * c, "out: (B,T,C)");
    assert_eq!(qkv.len(), b * t * 3 * c, "qkv: (B,T,3C)");
    let needed = attention_forward_scratch::<E>(b, t, c, nh);
    assert!(scratch.len() >= needed, "attention_forward scratch");
    let AttentionTiles { lanes, tile } = AttentionTiles::of(b, t, nh);
    let (out_ptr, lse_ptr) = (SendPtr(out.as_mut_ptr()), SendPtr(lse.as_mut_ptr()));
    scratch[..needed].par_chunks_mut(needed / lanes).enumerate().for_each(|(lane, scratch)| {
        widest(
            #[inline(always)]
            || {
                let (p, wide) = scratch.split_at_mut(tile * t);
                let wide_len = if E::is_f32() { 0 } else { t * hs };
                let (wide_k, wide) = wide.split_at_mut(wide_len);
                let (wide_v, wide) = wide.split_at_mut(wide_len);
                let (wide_q, o32) = wide.split_at_mut(if E::is_f32() { 0 } else { tile * hs });
                for bh in (lane..b * nh).step_by(lanes) {
                    let (bi, h) = (bh / nh, bh % nh);
                    let seq = &qkv[bi * t * 3 * c + h * hs..];
                    let k = head_rows(&seq[c..], 3 * c, 0..t, hs, wide_k);
                    let v = head_rows(&seq[2 * c..], 3 * c, 0..t, hs, wide_v);
                    // SAFETY: pair (bi,h) alone writes lse[bi,h,..] and out[bi, .., h*hs..(h+1)*hs].
                    let lse_bh = unsafe { lse_ptr.slice(bh * t, t) };
                    for i0 in (0..t).step_by(tile) {
                        let m = tile.min(t - i0);
                        let q = head_rows(seq, 3 * c, i0..i0 + m, hs, wide_q);
                        tile_probabilities::<E>(p, q, k, (i0, m, hs), scale, &mut lse_bh[i0..i0 + m], true);
                        let p = Operand { ptr: p.as_ptr(), rs: i0 + m, cs: 1 };
                        let first = (bi * t + i0) * c + h * hs;
                        // out rows i0..i0+m of head h (m, HS) = p (m, n) · v (n, HS): in place in
                        // f32, else through the lane's (tile, HS) f32 block.
                        // SAFETY: v has n rows, p m·n elements; the out rows are this pair's alone.
                        unsafe {
                            if E::is_f32() {
                                let dst = Operand { ptr: out_ptr.0.add(first).cast::<f32>(), rs: c, cs: 1 };
                                gemm_raw((m, hs, i0 + m), dst, false, p, v, false);
                            } else {
                                let dst = Operand { ptr: o32.as_mut_ptr(), rs: hs, cs: 1 };
                                gemm_raw((m, hs, i0 + m), dst, false, p, v, false);
                                narrow_rows(out_ptr, (first, c), &o32[..m * hs], hs, hs);
                            }
                        }
                    }
                }
            },
        )
    });
}

/// f32 scratch elements attention_backward needs, per lane: a tile's probabilities and their
/// gradients (2 × (tile, T)) and, for 16-bit storage, its head's k and v widened and their
/// gradients accumulated in f32 (4 × (T, HS)), and the tile's q, dout and dq (3 × (tile, HS)).
pub fn attention_backward_scratch<E: Elem>(b: usize, t: usize, c: usize, nh: usize) -> usize {
    let AttentionTiles { lanes, tile } = AttentionTiles::of(b, t, nh);
    let hs = c / nh;
    lanes * (2 * tile * t + if E::is_f32() { 0 } else { 4 * t * hs + 3 * tile * hs })
}

/// dqkv: (B,T,3C) [overwritten]; scratch: see [`attention_backward_scratch`]; dout: (B,T,C);
/// qkv, lse as saved by forward.
///
/// The probabilities are recomputed from q, k and lse exactly as forward made them (rounded to
/// `E`; same GEMM, same arithmetic); datt = dout·vᵀ; dv += pᵀ·dout; the scores' gradient
/// ds = p · (datt − Σ p·datt) / √HS is rounded to `E` before it weights k and q (as a 16-bit
/// device multiplies it): dq = ds·k (a tile's queries are complete within it), dk += dsᵀ·q.
/// Every product is an f32 GEMM over a tile, as in forward.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward<E: Elem>(
    dqkv: &mut [E],
    scratch: &mut [f32],
    dout: &[E],
    qkv: &[E],
    lse: &[f32],
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
) {
    let hs = c / nh;
    let scale = 1.0 / (hs as f32).sqrt();
    assert_eq!(dqkv.len(), b * t * 3 * c, "dqkv: (B,T,3C)");
    assert_eq!(qkv.len(), b * t * 3 * c, "qkv: (B,T,3C)");
    assert_eq!(dout.len(), b * t * c, "dout: (B,T,C)");
    assert_eq!(lse.len(), b * nh * t, "lse: (B,NH,T)");
    let needed = attention_backward_scratch::<E>(b, t, c, nh);
    assert!(scratch.len() >= needed, "attention_backward scratch");
    let AttentionTiles { lanes, tile } = AttentionTiles::of(b, t, nh);
    let dqkv_ptr = SendPtr(dqkv.as_mut_ptr());
    scratch[..needed].par_chunks_mut(needed / lanes).enumerate().for_each(|(lane, scratch)| {
        widest(
            #[inline(always)]
            || {
                let (p, rest) = scratch.split_at_mut(tile * t);
                let (dp, rest) = rest.split_at_mut(tile * t);
                let wide_len = if E::is_f32() { 0 } else { t * hs };
                let (wide_k, rest) = rest.split_at_mut(wide_len);
                let (wide_v, rest) = rest.split_at_mut(wide_len);
                let (dkv32, rest) = rest.split_at_mut(2 * wide_len);
                let tile_len = if E::is_f32() { 0 } else { tile * hs };
                let (wide_q, rest) = rest.split_at_mut(tile_len);
                let (wide_d, dq32) = rest.split_at_mut(tile_len);
                for bh in (lane..b * nh).step_by(lanes) {
                    let (bi, h) = (bh / nh, bh % nh);
                    let seq = &qkv[bi * t * 3 * c + h * hs..];
                    let seq_dout = &dout[bi * t * c + h * hs..];
                    let k = head_rows(&seq[c..], 3 * c, 0..t, hs, wide_k);
                    let v = head_rows(&seq[2 * c..], 3 * c, 0..t, hs, wide_v);
                    // This pair's dk and dv (T, HS) each, accumulated over the tiles: head h's
                    // columns of dqkv in f32, else the lane's f32 block [dk | dv], narrowed at the end.
                    let first = bi * t * 3 * c + h * hs;
                    let (dk, dv) = if E::is_f32() {
                        for ti in 0..t {
                            for part in [1, 2] {
                                // SAFETY: pair (bi,h) alone writes head h's columns of sequence bi.
                                unsafe { dqkv_ptr.slice(first + ti * 3 * c + part * c, hs) }.fill(E::from_f32(0.0));
                            }
                        }
                        let at = |part: usize| Operand {
                            ptr: dqkv_ptr.0.wrapping_add(first + part * c).cast::<f32>(),
                            rs: 3 * c,
                            cs: 1,
                        };
                        (at(1), at(2))
                    } else {
                        dkv32.fill(0.0);
                        let base = dkv32.as_mut_ptr();
                        let at = |part: usize| Operand { ptr: base.wrapping_add(part * hs), rs: 2 * hs, cs: 1 };
                        (at(0), at(1))
                    };
                    for i0 in (0..t).step_by(tile) {
                        let m = tile.min(t - i0);
                        let n = i0 + m;
                        let q = head_rows(seq, 3 * c, i0..n, hs, wide_q);
                        let d = head_rows(seq_dout, c, i0..n, hs, wide_d);
                        let mut lse_tile = [0.0f32; ATTENTION_TILE];
                        lse_tile[..m].copy_from_slice(&lse[bh * t + i0..][..m]);
                        tile_probabilities::<E>(p, q, k, (i0, m, hs), scale, &mut lse_tile[..m], false);
                        let pm = Operand { ptr: p.as_ptr(), rs: n, cs: 1 };
                        let dpm = Operand { ptr: dp.as_mut_ptr(), rs: n, cs: 1 };
                        // SAFETY (each GEMM here): k, v, dk, dv have n rows, q, d and dq m, the
                        // tiles m·n elements; the gradients are this pair's alone.
                        unsafe {
                            // datt (m, n) = dout (m, HS) · vᵀ (HS, n);  dv (n, HS) += pᵀ (n, m) · dout (m, HS)
                            gemm_raw((m, n, hs), dpm, false, d, v.t(), false);
                            gemm_raw((n, hs, m), dv, true, pm.t(), d, false);
                        }
                        // softmax backward, in place of datt: ds = p · (datt − Σ p·datt) · scale, rounded to E
                        for (r, (pr, dr)) in p[..m * n].chunks(n).zip(dp[..m * n].chunks_mut(n)).enumerate() {
                            let live = i0 + r + 1;
                            let s = dot(&pr[..live], &dr[..live]);
                            for (ds, &pv) in dr[..live].iter_mut().zip(&pr[..live]) {
                                *ds = E::from_f32(pv * (*ds - s) * scale).to_f32();
                            }
                            dr[live..].fill(0.0);
                        }
                        let ds = Operand { ptr: dp.as_ptr(), rs: n, cs: 1 };
                        let dq_first = first + i0 * 3 * c;
                        unsafe {
                            // dq (m, HS) = ds (m, n) · k (n, HS);  dk (n, HS) += dsᵀ (n, m) · q (m, HS)
                            if E::is_f32() {
                                let dq = Operand { ptr: dqkv_ptr.0.add(dq_first).cast::<f32>(), rs: 3 * c, cs: 1 };
                                gemm_raw((m, hs, n), dq, false, ds, k, false);
                            } else {
                                let dq = Operand { ptr: dq32.as_mut_ptr(), rs: hs, cs: 1 };
                                gemm_raw((m, hs, n), dq, false, ds, k, false);
                                narrow_rows(dqkv_ptr, (dq_first, 3 * c), &dq32[..m * hs], hs, hs);
                            }
                            gemm_raw((n, hs, m), dk, true, ds.t(), q, false);
                        }
                    }
                    if !E::is_f32() {
                        for (part, col) in [(1, 0), (2, hs)] {
                            // SAFETY: as above.
                            unsafe { narrow_rows(dqkv_ptr, (first + part * c, 3 * c), &dkv32[col..], 2 * hs, hs) };
                        }
                    }
                }
            },
        )
    });
}

/// The dimensions of `attention_cached`: `tn` new tokens per sequence at positions
/// `start..start + tn` of a cache that holds `context` positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CachedAttention {
    pub b: usize,
    pub tn: usize,
    pub start: usize,
    pub context: usize,
    pub c: usize,
    pub nh: usize,
}

/// f32 scratch elements `attention_cached` needs: a row of scores per (batch, head).
pub fn attention_cached_scratch(b: usize, context: usize, nh: usize) -> usize {
    b * nh * context
}

/// Incremental decoding's attention. cache: (2,B,context,C), keys then values; the keys and
/// values of the `tn` new tokens (qkv: (B,Tn,3C)) are written at positions start..start+Tn,
/// then new token i (position start+i) attends to positions 0..=start+i. out: (B,Tn,C).
/// Softmax and products as `attention_forward`'s (probabilities rounded to `E` before they
/// weight the values), so a cached pass gives the same outputs as a full one.
pub fn attention_cached<E: Elem>(out: &mut [E], cache: &mut [E], qkv: &[E], scratch: &mut [f32], d: CachedAttention) {
    let CachedAttention { b, tn, start, context, c, nh } = d;
    let hs = c / nh;
    let scale = 1.0 / (hs as f32).sqrt();
    assert_eq!(cache.len(), 2 * b * context * c, "cache: (2,B,context,C)");
    assert!(start + tn <= context, "new tokens within the cache");
    let (keys, values) = cache.split_at_mut(b * context * c);
    for bi in 0..b {
        for i in 0..tn {
            let row = &qkv[(bi * tn + i) * 3 * c..][..3 * c];
            let at = (bi * context + start + i) * c;
            keys[at..at + c].copy_from_slice(&row[c..2 * c]);
            values[at..at + c].copy_from_slice(&row[2 * c..]);
        }
    }
    let (keys, values) = (&*keys, &*values);
    let out_ptr = SendPtr(out.as_mut_ptr());
    scratch[..b * nh * context].par_chunks_mut(context).enumerate().for_each(|(bh, row)| {
        widest(
            #[inline(always)]
            || {
                let (bi, h) = (bh / nh, bh % nh);
                for i in 0..tn {
                    let q = &qkv[(bi * tn + i) * 3 * c + h * hs..][..hs];
                    let last = start + i;
                    softmax_scores(row, q, last, scale, |t2| &keys[(bi * context + t2) * c + h * hs..][..hs]);
                    // SAFETY: task (bi,h) alone writes out[bi, i, h*hs .. (h+1)*hs].
                    let o = unsafe { out_ptr.slice((bi * tn + i) * c + h * hs, hs) };
                    weighted_values(o, last, |t2| row[t2], |t2| &values[(bi * context + t2) * c + h * hs..][..hs]);
                }
            },
        )
    });
}

/// One causal attention row: row[..=last] = p(t) = exp(s(t) − lse) rounded to `E` (and read
/// back as f32), s(t) = scale · q·key(t), t = 0..=last; returns lse = log Σ exp s(t) (the
/// maximum subtracted first). The full pass and the cached one share it, and backward
/// recomputes each probability by the same `probability`, so all three weigh the values with
/// the same numbers.
#[inline(always)]
fn softmax_scores<'k, E: Elem + 'k>(
    row: &mut [f32],
    q: &[E],
    last: usize,
    scale: f32,
    key: impl Fn(usize) -> &'k [E],
) -> f32 {
    let row = &mut row[..=last];
    for (t2, r) in row.iter_mut().enumerate() {
        *r = dot(q, key(t2)) * scale;
    }
    let lse = log_sum_exp(row);
    for v in row.iter_mut() {
        *v = probability::<E>(*v, lse);
    }
    lse
}

/// One causal attention probability from its scaled score and its row's log-sum-exp:
/// exp(s − lse) rounded to `E` (read back as f32) — forward's, the cached pass's and backward's.
#[inline(always)]
fn probability<E: Elem>(score: f32, lse: f32) -> f32 {
    E::from_f32(exp(score - lse)).to_f32()
}

/// o (HS) = Σ p(t) · value(t) over t = 0..=last, accumulated in f32 in chunks of 256 channels
/// (t in order, so the sum is the same wherever the values live).
#[inline(always)]
fn weighted_values<'v, E: Elem + 'v>(
    o: &mut [E],
    last: usize,
    p: impl Fn(usize) -> f32,
    value: impl Fn(usize) -> &'v [E],
) {
    let hs = o.len();
    let mut o32 = [0.0f32; 256];
    for chunk in (0..hs).step_by(256) {
        let w = (hs - chunk).min(256);
        let acc = &mut o32[..w];
        acc.fill(0.0);
        for t2 in 0..=last {
            let (a, v) = (p(t2), &value(t2)[chunk..chunk + w]);
            for k in 0..w {
                acc[k] += a * v[k].to_f32();
            }
        }
        for k in 0..w {
            o[chunk + k] = E::from_f32(acc[k]);
        }
    }
}

#[inline(always)]
fn dot<E: Elem>(a: &[E], b: &[E]) -> f32 {
    // Eight independent accumulators let the compiler vectorise without reassociating floats.
    let mut acc = [0.0f32; 8];
    let chunks = a.len() / 8;
    for j in 0..chunks {
        for l in 0..8 {
            acc[l] += a[j * 8 + l].to_f32() * b[j * 8 + l].to_f32();
        }
    }
    let mut s = acc.iter().sum::<f32>();
    for i in chunks * 8..a.len() {
        s += a[i].to_f32() * b[i].to_f32();
    }
    s
}

// ----------------------------------------------------------------------------------------------
// exp and the row reductions of softmax (attention and the classifier's cross-entropy)

/// e^x by Cephes' single-precision method — x = n·ln 2 + r with |r| ≤ ln 2 / 2, e^r by a
/// degree-7 polynomial, 2^n added to the exponent bits — within 8.2e-8 relative of the exact
/// value (a unit test checks 4M points over [−86.9, 88.7]). No branches and no call, so a loop
/// over it vectorises (libm's `expf` is a call per element); results below e^−87 (≈ 1.6e−38)
/// are flushed to 0, above f32::MAX are +∞, and NaN stays NaN.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    // Adding 1.5 · 2^23 rounds to an integer, which is then the low bits of the sum.
    const ROUND: f32 = 12_582_912.0;
    const LN2_HI: f32 = 0.693_359_4; // 355/512: n · LN2_HI is exact
    const LN2_LO: f32 = -2.121_944_4e-4;
    let xc = x.clamp(-88.0, 89.0);
    let shifted = xc * std::f32::consts::LOG2_E + ROUND;
    let n = shifted - ROUND;
    let ni = (shifted.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let r = xc - n * LN2_HI - n * LN2_LO;
    // Cephes' coefficients, highest first (its 5.0000001201e-1 rounds to 0.5 in f32).
    let poly = [1.398_2e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5]
        .iter()
        .fold(1.987_569_2e-4f32, |p, &a| p * r + a);
    // e^r in [0.70, 1.42]; 2^n for n ≤ 127 goes into its exponent bits, and n = 128 doubles
    // afterwards (∞ past f32::MAX).
    let er = poly * r * r + r + 1.0;
    let scaled = f32::from_bits((er.to_bits() as i32).wrapping_add(ni.min(127) << 23) as u32);
    let scaled = if ni > 127 { scaled * 2.0 } else { scaled };
    if x.is_nan() {
        x
    } else if ni < -125 {
        0.0
    } else {
        scaled
    }
}

/// Independent partial results of the row reductions: enough for one vector register of f32,
/// so the compiler keeps them there instead of a chain of dependent scalar operations.
pub(crate) const REDUCE_LANES: usize = 8;

/// max over `row` (−∞ when empty).
#[inline(always)]
fn row_max<E: Elem>(row: &[E]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; REDUCE_LANES];
    let chunks = row.chunks_exact(REDUCE_LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, x) in acc.iter_mut().zip(c) {
            *a = a.max(x.to_f32());
        }
    }
    let mut m = f32::NEG_INFINITY;
    for x in acc.into_iter().chain(tail.iter().map(|x| x.to_f32())) {
        m = m.max(x);
    }
    m
}

/// log Σ exp(x) over an attention row, its maximum subtracted first: the tiles' and the cached
/// pass's lse.
#[inline(always)]
fn log_sum_exp(row: &[f32]) -> f32 {
    let maxval = row_max(row);
    maxval + sum_exp(row, maxval).ln()
}

/// Σ exp(x − shift) over `row`, in `REDUCE_LANES` f32 partial sums.
#[inline(always)]
fn sum_exp(row: &[f32], shift: f32) -> f32 {
    let mut acc = [0f32; REDUCE_LANES];
    let chunks = row.chunks_exact(REDUCE_LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a += exp(x - shift);
        }
    }
    acc.iter().sum::<f32>() + tail.iter().map(|&x| exp(x - shift)).sum::<f32>()
}

// ----------------------------------------------------------------------------------------------
// GELU (tanh approximation, as GPT-2)

const GELU_SCALE: f32 = 0.797_884_6; // sqrt(2/pi)

/// tanh(x) by the rational approximation Eigen uses for floats — an odd degree-13 polynomial
/// over an even degree-6 one, x clamped to ±7.905311 (where tanh rounds to ±1): within 4.3e-7
/// of the exact value (libm's `tanhf`: 1.0e-7; cuda's GELU kernel calls `tanhf`, and the op
/// parity bound is 1e-4). Unlike libm's it has no branches, so a loop over it vectorises (GELU
/// forward 57 → 1.3 ms in `bench --preset d4-128 --profile` here). NaN stays NaN.
#[inline(always)]
pub fn tanh(x: f32) -> f32 {
    let c = x.clamp(-7.905_311, 7.905_311);
    let c2 = c * c;
    let num = [2.000_188e-13, -8.604_672e-11, 5.122_297e-8, 1.485_722_4e-5, 6.372_619e-4, 4.893_524_6e-3]
        .iter()
        .fold(-2.760_768_5e-16f32, |p, &a| p * c2 + a);
    let den = [1.185_347_1e-4, 2.268_434_6e-3, 4.893_525e-3].iter().fold(1.198_258_4e-6f32, |q, &b| q * c2 + b);
    // Below 4e-4, tanh x rounds to x.
    if x.abs() < 4e-4 {
        x
    } else {
        c * num / den
    }
}

/// out: (N) = gelu(inp)
pub fn gelu_forward<E: Elem>(out: &mut [E], inp: &[E]) {
    for_each_pair(
        out,
        inp,
        #[inline(always)]
        |o, x| {
            let v = x.to_f32();
            let cube = 0.044715 * v * v * v;
            *o = E::from_f32(0.5 * v * (1.0 + tanh(GELU_SCALE * (v + cube))));
        },
    );
}

/// dinout: (N) holds dout on entry and gelu'(inp) * dout on return.
pub fn gelu_backward_inplace<E: Elem>(dinout: &mut [E], inp: &[E]) {
    for_each_pair(
        dinout,
        inp,
        #[inline(always)]
        |d, x| {
            let v = x.to_f32();
            let cube = 0.044715 * v * v * v;
            let th = tanh(GELU_SCALE * (v + cube));
            let sech2 = 1.0 - th * th;
            let local = 0.5 * (1.0 + th) + v * 0.5 * sech2 * GELU_SCALE * (1.0 + 3.0 * 0.044715 * v * v);
            *d = E::from_f32(d.to_f32() * local);
        },
    );
}

// ----------------------------------------------------------------------------------------------
// residual

/// out (N) += inp (N)
pub fn residual_forward_inplace<E: Elem>(out: &mut [E], inp: &[E]) {
    for_each_pair(
        out,
        inp,
        #[inline(always)]
        |o, x| *o = E::from_f32(o.to_f32() + x.to_f32()),
    );
}

// ----------------------------------------------------------------------------------------------
// fused softmax + cross-entropy (f32 arithmetic whatever the storage)

/// logits: (N,VP) turned into probabilities in place, the softmax over each row's first V
/// (the vocabulary; the padding columns past it get 0); losses: (N) f32 = -log p[target].
/// A row's sum of exponentials is kept in f64; in f32 storage each exponential is computed
/// once, stored, and scaled by 1/sum afterwards.
pub fn crossentropy_forward<E: Elem>(logits: &mut [E], losses: &mut [f32], targets: &[u32], v: usize, vp: usize) {
    softmax_crossentropy(logits, losses, targets, v, vp, None)
}

/// The loss and its gradient in one pass: losses as `crossentropy_forward`'s; logits: (N,VP)
/// turned into dlogits = (p − onehot(target)) · dloss in place (0 in the padding columns), p
/// in f32 (never stored), the gradient rounded once.
pub fn crossentropy_forward_backward<E: Elem>(
    logits: &mut [E],
    losses: &mut [f32],
    targets: &[u32],
    dloss: f32,
    v: usize,
    vp: usize,
) {
    softmax_crossentropy(logits, losses, targets, v, vp, Some(dloss))
}

/// Each row's loss, and its probabilities (`dloss` None) or its gradient written over it.
fn softmax_crossentropy<E: Elem>(
    logits: &mut [E],
    losses: &mut [f32],
    targets: &[u32],
    v: usize,
    vp: usize,
    dloss: Option<f32>,
) {
    logits.par_chunks_mut(vp).zip(losses.par_iter_mut().zip(targets.par_iter())).for_each(|(row, (loss, &tgt))| {
        let (row, padding) = row.split_at_mut(v);
        padding.fill(E::from_f32(0.0));
        widest(
            #[inline(always)]
            || {
                let tgt = tgt as usize;
                let target = row[tgt].to_f32();
                let (maxval, sum) = match E::as_f32_mut(row) {
                    Some(row) => {
                        let maxval = row_max(row);
                        (maxval, exp_in_place(row, maxval))
                    }
                    None => {
                        let maxval = row_max(row);
                        let sum = lane_sum(
                            row,
                            #[inline(always)]
                            |x| exp(x - maxval) as f64,
                        );
                        (maxval, sum)
                    }
                };
                *loss = -(target - maxval - sum.ln() as f32);
                let inv = (1.0 / sum) as f32;
                match (E::as_f32_mut(row), dloss) {
                    (Some(row), None) => {
                        for x in row.iter_mut() {
                            *x *= inv
                        }
                    }
                    (None, None) => {
                        for x in row.iter_mut() {
                            *x = E::from_f32(exp(x.to_f32() - maxval) * inv)
                        }
                    }
                    (Some(row), Some(dloss)) => {
                        let p_target = row[tgt] * inv;
                        for x in row.iter_mut() {
                            *x = *x * inv * dloss
                        }
                        row[tgt] = (p_target - 1.0) * dloss;
                    }
                    (None, Some(dloss)) => {
                        for x in row.iter_mut() {
                            *x = E::from_f32(exp(x.to_f32() - maxval) * inv * dloss)
                        }
                        row[tgt] = E::from_f32((exp(target - maxval) * inv - 1.0) * dloss);
                    }
                }
            },
        )
    });
}

/// row = exp(row − shift) in place; returns their sum, in `REDUCE_LANES` f64 partial sums.
#[inline(always)]
fn exp_in_place(row: &mut [f32], shift: f32) -> f64 {
    let mut acc = [0f64; REDUCE_LANES];
    let mut chunks = row.chunks_exact_mut(REDUCE_LANES);
    for c in &mut chunks {
        for (a, x) in acc.iter_mut().zip(c) {
            *x = exp(*x - shift);
            *a += *x as f64;
        }
    }
    let tail: f64 = chunks
        .into_remainder()
        .iter_mut()
        .map(|x| {
            *x = exp(*x - shift);
            *x as f64
        })
        .sum();
    acc.iter().sum::<f64>() + tail
}

// ----------------------------------------------------------------------------------------------
// int8 transfer packing (activation offload): one scale (absmax / 127) per row of C

/// q: (N,C) int8 and scales: (N) f32 from x: (N,C).
pub fn pack_int8<E: Elem>(q: &mut [i8], scales: &mut [f32], x: &[E], c: usize) {
    for ((row, qrow), scale) in x.chunks(c).zip(q.chunks_mut(c)).zip(scales.iter_mut()) {
        let amax = row.iter().fold(0f32, |m, v| m.max(v.to_f32().abs()));
        *scale = if amax > 0.0 { amax / 127.0 } else { 1.0 };
        for (qi, v) in qrow.iter_mut().zip(row) {
            *qi = (v.to_f32() / *scale).round().clamp(-127.0, 127.0) as i8;
        }
    }
}

/// x: (N,C) = q · scale of its row.
/// x: (N) = each 4-bit value of `packed` (low nibble first, two's complement) · its group's scale.
pub fn unpack_int4<E: Elem>(x: &mut [E], packed: &[u8], scales: &[f32], group: usize) {
    for ((xg, pg), &scale) in x.chunks_mut(group).zip(packed.chunks(group / 2)).zip(scales) {
        for (pair, &byte) in xg.chunks_mut(2).zip(pg) {
            let (lo, hi) = (((byte << 4) as i8) >> 4, (byte as i8) >> 4);
            pair[0] = E::from_f32(lo as f32 * scale);
            pair[1] = E::from_f32(hi as f32 * scale);
        }
    }
}

pub fn unpack_int8<E: Elem>(x: &mut [E], q: &[i8], scales: &[f32], c: usize) {
    for ((row, qrow), &scale) in x.chunks_mut(c).zip(q.chunks(c)).zip(scales) {
        for (v, &qi) in row.iter_mut().zip(qrow) {
            *v = E::from_f32(qi as f32 * scale);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::rng::Rng;

    #[test]
    fn sixteen_bit_bias_gradients_sum_each_column_in_row_order_and_round_once() {
        // 150 columns: two full blocks of 64 and a partial one.
        let (n, c, oc) = (37, 8, 150);
        let mut rng = Rng::new(3);
        let mut randn = |len: usize| (0..len).map(|_| rng.normal() as f32).collect::<Vec<f32>>();
        let to16 = |x: &[f32]| x.iter().map(|&v| half::bf16::from_f32(v)).collect::<Vec<_>>();
        let (dout, inp, weight, db0) = (to16(&randn(n * oc)), to16(&randn(n * c)), to16(&randn(oc * c)), randn(oc));
        let (mut dinp, mut dweight, mut db) =
            (vec![half::bf16::ZERO; n * c], vec![half::bf16::ZERO; oc * c], to16(&db0));
        let mut scratch = vec![0.0f32; matmul_backward_scratch::<half::bf16>(n, c, oc)];
        matmul_backward(&mut dinp, &mut dweight, Some(&mut db), &dout, &inp, &weight, n, c, oc, &mut scratch);
        for o in 0..oc {
            let sum = dout.chunks(oc).fold(0f32, |s, row| s + row[o].to_f32());
            let expected = half::bf16::from_f32(half::bf16::from_f32(db0[o]).to_f32() + sum);
            assert_eq!(db[o].to_bits(), expected.to_bits(), "column {o}");
        }
    }

    /// `x` rounded to bf16 and back: inputs whose widening is exact, for f64 references.
    fn bf16_exact(x: Vec<f32>) -> Vec<half::bf16> {
        x.into_iter().map(half::bf16::from_f32).collect()
    }

    /// Each element of `got` within one bf16 rounding (plus f32 accumulation over `scale`) of
    /// `want`, the worst excess named.
    fn within_a_rounding(what: &str, got: &[half::bf16], want: &[f64], scale: &[f64]) {
        assert_eq!(got.len(), want.len(), "{what}");
        for (i, ((g, w), s)) in got.iter().zip(want).zip(scale).enumerate() {
            let bound = w.abs() / 256.0 + 1e-5 * s;
            assert!((g.to_f64() - w).abs() <= bound, "{what}[{i}]: {} vs {w} (bound {bound:e})", g.to_f64());
        }
    }

    /// Forward and backward of a 16-bit (N,C)·(OC,C)ᵀ matmul under the given plans, every
    /// element against an f64 reference within one bf16 rounding of its terms' magnitude.
    fn sixteen_bit_matmul_matches_f64(n: usize, c: usize, oc: usize, fwd: MatmulPlan, bwd: MatmulPlan) {
        let mut rng = Rng::new(5);
        let mut randn = |len: usize| (0..len).map(|_| rng.normal() as f32).collect::<Vec<f32>>();
        let (x, w, bias) = (bf16_exact(randn(n * c)), bf16_exact(randn(oc * c)), bf16_exact(randn(oc)));
        let f = |v: &half::bf16| v.to_f64();

        let mut out = vec![half::bf16::from_f32(f32::NAN); n * oc];
        let mut scratch = vec![f32::NAN; fwd.forward_scratch(c)];
        matmul_forward_16(fwd, &mut out, &x, &w, Some(&bias), n, c, oc, &mut scratch);
        let (mut want, mut scale) = (vec![0f64; n * oc], vec![0f64; n * oc]);
        for r in 0..n {
            for o in 0..oc {
                let terms = (0..c).map(|k| f(&x[r * c + k]) * f(&w[o * c + k]));
                want[r * oc + o] = f(&bias[o]) + terms.clone().sum::<f64>();
                scale[r * oc + o] = f(&bias[o]).abs() + terms.map(f64::abs).sum::<f64>();
            }
        }
        within_a_rounding("out", &out, &want, &scale);

        let (dout, dw0) = (bf16_exact(randn(n * oc)), bf16_exact(randn(oc * c)));
        let (mut dinp, mut dw) = (vec![half::bf16::from_f32(f32::NAN); n * c], dw0.clone());
        let mut scratch = vec![f32::NAN; bwd.backward_scratch(n, c)];
        matmul_backward_16(bwd, &mut dinp, &mut dw, &dout, &x, &w, n, c, oc, &mut scratch);
        let (mut want, mut scale) = (vec![0f64; n * c], vec![0f64; n * c]);
        for r in 0..n {
            for k in 0..c {
                let terms = (0..oc).map(|o| f(&dout[r * oc + o]) * f(&w[o * c + k]));
                want[r * c + k] = terms.clone().sum();
                scale[r * c + k] = terms.map(f64::abs).sum();
            }
        }
        within_a_rounding("dinp (overwritten)", &dinp, &want, &scale);
        let (mut want, mut scale) = (vec![0f64; oc * c], vec![0f64; oc * c]);
        for o in 0..oc {
            for k in 0..c {
                let terms = (0..n).map(|r| f(&dout[r * oc + o]) * f(&x[r * c + k]));
                want[o * c + k] = f(&dw0[o * c + k]) + terms.clone().sum::<f64>();
                scale[o * c + k] = f(&dw0[o * c + k]).abs() + terms.map(f64::abs).sum::<f64>();
            }
        }
        within_a_rounding("dweight (accumulated)", &dw, &want, &scale);
    }

    #[test]
    fn sixteen_bit_matmul_lanes_cover_every_row_once() {
        // Two full groups of lanes × 128 rows and a last group of one partial chunk, so lanes,
        // groups and the short chunk are all exercised; the weight whole.
        let (n, c, oc) = (2 * MATMUL_LANES * MATMUL_ROW_CHUNK + 77, 24, 40);
        let (fwd, bwd) = (MatmulPlan::forward(n, c, oc), MatmulPlan::backward(n, c, oc));
        assert_eq!((fwd.lanes.chunk, fwd.lanes.lanes), (MATMUL_ROW_CHUNK, MATMUL_LANES));
        assert_eq!((fwd.blocks, bwd.blocks), (WeightBlocks::whole(oc), WeightBlocks::whole(oc)));
        sixteen_bit_matmul_matches_f64(n, c, oc, fwd, bwd);

        // The public functions, with the bias gradient.
        let mut rng = Rng::new(6);
        let mut randn = |len: usize| (0..len).map(|_| rng.normal() as f32).collect::<Vec<f32>>();
        let (x, w, dout, db0) =
            (bf16_exact(randn(n * c)), bf16_exact(randn(oc * c)), bf16_exact(randn(n * oc)), bf16_exact(randn(oc)));
        let (mut dinp, mut dw, mut db) = (vec![half::bf16::ZERO; n * c], vec![half::bf16::ZERO; oc * c], db0.clone());
        let mut scratch = vec![f32::NAN; matmul_backward_scratch::<half::bf16>(n, c, oc)];
        matmul_backward(&mut dinp, &mut dw, Some(&mut db), &dout, &x, &w, n, c, oc, &mut scratch);
        let f = |v: &half::bf16| v.to_f64();
        let want: Vec<f64> = (0..oc).map(|o| f(&db0[o]) + (0..n).map(|r| f(&dout[r * oc + o])).sum::<f64>()).collect();
        let scale: Vec<f64> = (0..oc).map(|o| (0..n).map(|r| f(&dout[r * oc + o]).abs()).sum::<f64>()).collect();
        within_a_rounding("dbias (accumulated)", &db, &want, &scale);
    }

    #[test]
    fn sixteen_bit_matmul_weight_blocks_cover_every_column_once() {
        // A weight of 41 rows in blocks of at most 12 × 24 elements: four blocks of 11 rows,
        // the last of 8, each its output columns and weight-gradient rows, with dinp summed
        // over all four before it is narrowed; lanes, groups and a short chunk as above.
        let (n, c, oc) = (2 * MATMUL_LANES * MATMUL_ROW_CHUNK + 77, 24, 41);
        let (fwd, bwd) = (MatmulPlan::blocked(n, c, oc, 12 * c), MatmulPlan::blocked(n, c, oc, 12 * c));
        assert_eq!(fwd.blocks, WeightBlocks { width: 11, count: 4 });
        assert_eq!(
            WeightBlocks { width: 11, count: 4 }.ranges(oc).collect::<Vec<_>>(),
            [0..11, 11..22, 22..33, 33..41]
        );
        assert_eq!(bwd.blocks, fwd.blocks);
        assert_eq!((fwd.lanes.chunk, fwd.lanes.lanes), (MATMUL_ROW_CHUNK, MATMUL_LANES));
        sixteen_bit_matmul_matches_f64(n, c, oc, fwd, bwd);
        // One row short of a full chunk, one lane.
        let n = MATMUL_ROW_CHUNK - 1;
        let (fwd, bwd) = (MatmulPlan::blocked(n, c, oc, 12 * c), MatmulPlan::blocked(n, c, oc, 12 * c));
        assert_eq!(fwd.lanes.lanes, 1);
        sixteen_bit_matmul_matches_f64(n, c, oc, fwd, bwd);
    }

    #[test]
    fn matmul_plans_are_functions_of_the_shapes_within_their_budgets() {
        // (n, c, oc) → (weight blocks forward (width, count), lanes (rows per chunk, lanes),
        // whether backward blocks too): a small weight is whole, a large one (GPT-2's MLP, the
        // classifier) in blocks of at most 1M elements; backward blocks only when its f32 dinp
        // accumulator costs less than the whole widened weight and gradient (not for a long run
        // of rows over a mid-size weight).
        let table = [
            ((16, 24, 40), ((40, 1), (16, 1), false)),
            ((200, 64, 256), ((256, 1), (128, 2), false)),
            ((4096, 128, 512), ((512, 1), (128, 2), false)),
            ((16 * 1024, 768, 3072), ((1024, 3), (128, 2), false)),
            ((16 * 1024, 768, 50257), ((1359, 37), (128, 2), true)),
            ((256, 256, 50257), ((3866, 13), (128, 2), true)),
            ((256, 12288, 49152), ((85, 579), (128, 2), true)),
            ((64 * 1024, 1600, 6400), ((640, 10), (128, 2), false)),
        ];
        for ((n, c, oc), (blocks, lanes, backward_blocked)) in table {
            let (fwd, bwd) = (MatmulPlan::forward(n, c, oc), MatmulPlan::backward(n, c, oc));
            let at = format!("({n}, {c}, {oc})");
            assert_eq!((fwd.blocks.width, fwd.blocks.count), blocks, "{at}");
            assert_eq!((fwd.lanes.chunk, fwd.lanes.lanes), lanes, "{at}");
            assert_eq!(bwd.blocks.count > 1, backward_blocked, "{at}");
            assert!(fwd.blocks.count == 1 || fwd.blocks.width * c <= MATMUL_WEIGHT_BLOCK_ELEMENTS, "{at}");
            assert!(fwd.blocks.width * fwd.blocks.count >= oc && fwd.blocks.width * (fwd.blocks.count - 1) < oc);
            for l in [fwd.lanes, bwd.lanes] {
                let width = fwd.blocks.width.max(bwd.blocks.width);
                assert!(l.lanes == 1 || l.rows() * (c + width) <= MATMUL_LANES_ELEMENTS, "{at}");
            }
            assert_eq!(matmul_forward_scratch::<half::bf16>(n, c, oc), fwd.forward_scratch(c), "{at}");
            assert_eq!(matmul_backward_scratch::<half::bf16>(n, c, oc), bwd.backward_scratch(n, c), "{at}");
            let whole = MatmulPlan { blocks: WeightBlocks::whole(oc), lanes: MatmulLanes::of(n, c, oc) };
            assert!(bwd.backward_scratch(n, c) <= whole.backward_scratch(n, c), "{at}");
            assert_eq!(matmul_forward_scratch::<f32>(n, c, oc) + matmul_backward_scratch::<f32>(n, c, oc), 0);
        }
    }

    #[test]
    fn layernorm_matches_its_definition_in_f64() {
        // 77 columns: lane sums with a tail, two column blocks; 37 rows: a short row task.
        let (n, c) = (37, 77);
        let mut rng = Rng::new(9);
        let mut randn = |len: usize, s: f32| (0..len).map(|_| rng.normal() as f32 * s).collect::<Vec<f32>>();
        let (x, w, b) = (randn(n * c, 2.0), randn(c, 1.0), randn(c, 0.5));
        let (dout, di0, dw0, db0) = (randn(n * c, 1.0), randn(n * c, 1.0), randn(c, 1.0), randn(c, 1.0));
        let (mut out, mut mean, mut rstd) = (vec![f32::NAN; n * c], vec![f32::NAN; n], vec![f32::NAN; n]);
        layernorm_forward(&mut out, &mut mean, &mut rstd, &x, &w, &b, c);
        let (mut dinp, mut dw, mut db) = (di0.clone(), dw0.clone(), db0.clone());
        layernorm_backward(&mut dinp, &mut dw, &mut db, &dout, &x, &w, &mean, &rstd, c);
        let mut recomputed = vec![f32::NAN; n * c];
        layernorm_recompute(&mut recomputed, &x, &w, &b, &mean, &rstd, c);
        assert_eq!(recomputed, out, "recompute gives forward's bits");

        let close = |what: &str, got: f32, want: f64, tol: f64| {
            assert!((got as f64 - want).abs() <= tol * (1.0 + want.abs()), "{what}: {got} vs {want}");
        };
        let (mut want_dw, mut want_db): (Vec<f64>, Vec<f64>) =
            (dw0.iter().map(|&v| v as f64).collect(), db0.iter().map(|&v| v as f64).collect());
        for r in 0..n {
            let row = &x[r * c..][..c];
            let mu = row.iter().map(|&v| v as f64).sum::<f64>() / c as f64;
            let var = row.iter().map(|&v| (v as f64 - mu).powi(2)).sum::<f64>() / c as f64;
            let rs = 1.0 / (var + LN_EPS as f64).sqrt();
            close("mean", mean[r], mu, 1e-6);
            close("rstd", rstd[r], rs, 1e-6);
            let norm: Vec<f64> = row.iter().map(|&v| (v as f64 - mu) * rs).collect();
            let dnorm: Vec<f64> = (0..c).map(|i| w[i] as f64 * dout[r * c + i] as f64).collect();
            let dnorm_mean = dnorm.iter().sum::<f64>() / c as f64;
            let dnorm_norm_mean = dnorm.iter().zip(&norm).map(|(d, x)| d * x).sum::<f64>() / c as f64;
            for i in 0..c {
                close("out", out[r * c + i], norm[i] * w[i] as f64 + b[i] as f64, 1e-5);
                let want = di0[r * c + i] as f64 + (dnorm[i] - dnorm_mean - norm[i] * dnorm_norm_mean) * rs;
                close("dinp (accumulated)", dinp[r * c + i], want, 1e-5);
                want_dw[i] += norm[i] * dout[r * c + i] as f64;
                want_db[i] += dout[r * c + i] as f64;
            }
        }
        for i in 0..c {
            close("dweight (accumulated)", dw[i], want_dw[i], 1e-5);
            close("dbias (accumulated)", db[i], want_db[i], 1e-5);
        }
    }

    #[test]
    fn exp_is_within_a_tenth_of_a_micro_relative_and_keeps_its_edges() {
        let n = 4_000_000;
        let (lo, hi) = (-86.9f64, 88.7f64);
        let worst = (0..=n)
            .map(|i| {
                let x = (lo + (hi - lo) * i as f64 / n as f64) as f32;
                let exact = (x as f64).exp();
                ((exp(x) as f64 - exact) / exact).abs()
            })
            .fold(0f64, f64::max);
        assert!(worst < 1e-7, "worst relative error {worst:e}");
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-0.0), 1.0);
        for x in [-88.0, -100.0, -1e30, f32::NEG_INFINITY] {
            assert_eq!(exp(x), 0.0, "{x}");
        }
        for x in [88.8, 89.0, 1e30, f32::INFINITY] {
            assert_eq!(exp(x), f32::INFINITY, "{x}");
        }
        assert!(exp(88.7).is_finite() && exp(88.7) > 3.3e38);
        assert!(exp(f32::NAN).is_nan());
    }

    #[test]
    fn tanh_is_within_half_a_micro_of_the_exact_value_and_saturates() {
        let n = 2_000_000;
        let worst = (0..=n)
            .map(|i| {
                let x = (-12.0 + 24.0 * i as f64 / n as f64) as f32;
                (tanh(x) as f64 - (x as f64).tanh()).abs()
            })
            .fold(0f64, f64::max);
        assert!(worst < 5e-7, "worst error {worst:e}");
        assert_eq!(tanh(0.0), 0.0);
        assert_eq!(tanh(1e-5), 1e-5);
        assert_eq!(tanh(-3.0), -tanh(3.0), "odd");
        for x in [8.0, 100.0, f32::INFINITY] {
            assert!(tanh(x) <= 1.0 && tanh(x) > 0.999_999 && tanh(-x) == -tanh(x), "{x}");
        }
        assert!(tanh(f32::NAN).is_nan());
    }

    fn randn(rng: &mut Rng, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.normal() as f32).collect()
    }

    /// The attention by its definition, a query at a time (scores and sums in f32, the
    /// probabilities and the scores' gradient rounded to `E`): (out, lse, dqkv).
    fn row_by_row<E: Elem>(qkv: &[f32], dout: &[f32], b: usize, t: usize, c: usize, nh: usize) -> [Vec<f32>; 3] {
        let hs = c / nh;
        let scale = 1.0 / (hs as f32).sqrt();
        let (mut out, mut lse, mut dqkv) = (vec![0.0; b * t * c], vec![0.0; b * nh * t], vec![0.0; b * t * 3 * c]);
        let at = |bi: usize, ti: usize, part: usize, h: usize| (bi * t + ti) * 3 * c + part * c + h * hs;
        let dotp = |x: usize, y: usize| (0..hs).map(|i| qkv[x + i] * qkv[y + i]).sum::<f32>();
        for bi in 0..b {
            for h in 0..nh {
                for ti in 0..t {
                    let s: Vec<f32> = (0..=ti).map(|t2| dotp(at(bi, ti, 0, h), at(bi, t2, 1, h)) * scale).collect();
                    let mx = s.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
                    let l = mx + s.iter().map(|&x| (x - mx).exp()).sum::<f32>().ln();
                    lse[(bi * nh + h) * t + ti] = l;
                    let p: Vec<f32> = s.iter().map(|&x| E::from_f32((x - l).exp()).to_f32()).collect();
                    let d = &dout[(bi * t + ti) * c + h * hs..][..hs];
                    let datt: Vec<f32> =
                        (0..=ti).map(|t2| (0..hs).map(|i| d[i] * qkv[at(bi, t2, 2, h) + i]).sum()).collect();
                    let sum: f32 = p.iter().zip(&datt).map(|(p, d)| p * d).sum();
                    for t2 in 0..=ti {
                        let ds = E::from_f32(p[t2] * (datt[t2] - sum) * scale).to_f32();
                        for i in 0..hs {
                            out[(bi * t + ti) * c + h * hs + i] += p[t2] * qkv[at(bi, t2, 2, h) + i];
                            dqkv[at(bi, t2, 2, h) + i] += p[t2] * d[i];
                            dqkv[at(bi, ti, 0, h) + i] += ds * qkv[at(bi, t2, 1, h) + i];
                            dqkv[at(bi, t2, 1, h) + i] += ds * qkv[at(bi, ti, 0, h) + i];
                        }
                    }
                }
            }
        }
        [out, lse, dqkv]
    }

    /// Largest difference over largest magnitude.
    fn worst<E: Elem>(got: &[E], want: &[f32]) -> f32 {
        let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
        got.iter().zip(want).map(|(g, w)| (g.to_f32() - w).abs()).fold(0f32, f32::max) / scale
    }

    fn tiled_matches_row_by_row<E: Elem>(bound: f32) {
        // 20 (batch, head) pairs over 16 lanes; T 150 = tiles of 64, 64 and 22.
        let (b, t, c, nh) = (5, 150, 24, 4);
        let mut rng = Rng::new(21);
        let (qkv, dout) = (randn(&mut rng, b * t * 3 * c), randn(&mut rng, b * t * c));
        let (qkv, dout): (Vec<E>, Vec<E>) =
            (qkv.iter().map(|&x| E::from_f32(x)).collect(), dout.iter().map(|&x| E::from_f32(x)).collect());
        let wide = |x: &[E]| x.iter().map(|x| x.to_f32()).collect::<Vec<f32>>();
        let [out, lse, dqkv] = row_by_row::<E>(&wide(&qkv), &wide(&dout), b, t, c, nh);
        let (mut got_out, mut got_lse) = (vec![E::from_f32(f32::NAN); b * t * c], vec![f32::NAN; b * nh * t]);
        let mut scratch = vec![f32::NAN; attention_forward_scratch::<E>(b, t, c, nh)];
        attention_forward(&mut got_out, &mut got_lse, &qkv, &mut scratch, b, t, c, nh);
        let mut got_dqkv = vec![E::from_f32(f32::NAN); b * t * 3 * c];
        let mut scratch = vec![f32::NAN; attention_backward_scratch::<E>(b, t, c, nh)];
        attention_backward(&mut got_dqkv, &mut scratch, &dout, &qkv, &got_lse, b, t, c, nh);
        for (what, got) in [("out", worst(&got_out, &out)), ("dqkv", worst(&got_dqkv, &dqkv))] {
            assert!(got <= bound, "{} {what}: {got:e}", E::NAME);
        }
        assert!(worst(&got_lse, &lse) <= 1e-6, "{} lse: {:e}", E::NAME, worst(&got_lse, &lse));
    }

    #[test]
    fn tiled_attention_matches_the_row_by_row_definition() {
        tiled_matches_row_by_row::<f32>(1e-5);
        tiled_matches_row_by_row::<half::bf16>(1e-2);
    }
}
