//! The CPU reference layers: each a `*_forward` / `*_backward` pair side by side, on plain
//! slices (the pool owns the memory; these functions never allocate).
//!
//! Tensors are stored as `E: Elem` (f32, bf16 or f16); arithmetic is always f32, and LayerNorm
//! statistics, softmax and the loss stay f32. Matmuls go through the gemm crate in f32: for a
//! 16-bit `E` the operands are widened chunk by chunk into caller-provided f32 scratch.
//!
//! Shapes follow llm.c: B batch, T time, C channels, NH heads, hs = C / NH, V vocabulary.
//! Backward functions *accumulate* into parameter gradients (so micro-batches add up) and
//! *overwrite* activation gradients unless documented otherwise.

use rayon::prelude::*;

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
        half::bf16::to_f32(self)
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
        half::f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        half::f16::from_f32(x)
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

/// Widen `src` into `dst` (same length).
pub fn widen<E: Elem>(dst: &mut [f32], src: &[E]) {
    dst.par_chunks_mut(8192).zip(src.par_chunks(8192)).for_each(|(d, s)| {
        for (d, s) in d.iter_mut().zip(s) {
            *d = s.to_f32();
        }
    });
}

/// Narrow `src` into `dst` (same length).
pub fn narrow<E: Elem>(dst: &mut [E], src: &[f32]) {
    dst.par_chunks_mut(8192).zip(src.par_chunks(8192)).for_each(|(d, s)| {
        for (d, s) in d.iter_mut().zip(s) {
            *d = E::from_f32(*s);
        }
    });
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

/// dwte (V,C) += scatter of dout (B,T,C) by token; dwpe (maxT,C) += dout summed over the batch.
pub fn encoder_backward<E: Elem>(dwte: &mut [E], dwpe: &mut [E], dout: &[E], inp: &[u32], t: usize, c: usize) {
    for (bt, (&tok, d)) in inp.iter().zip(dout.chunks(c)).enumerate() {
        let pos = bt % t;
        let we = &mut dwte[tok as usize * c..][..c];
        for i in 0..c {
            we[i] = E::from_f32(we[i].to_f32() + d[i].to_f32());
        }
        let pe = &mut dwpe[pos * c..][..c];
        for i in 0..c {
            pe[i] = E::from_f32(pe[i].to_f32() + d[i].to_f32());
        }
    }
}

// ----------------------------------------------------------------------------------------------
// layernorm

const LN_EPS: f32 = 1e-5;

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
    out.par_chunks_mut(c).zip(inp.par_chunks(c)).zip(mean.par_iter_mut().zip(rstd.par_iter_mut())).for_each(
        |((o, x), (m, r))| {
            let (mu, rs) = row_stats(x);
            for i in 0..c {
                o[i] = E::from_f32((x[i].to_f32() - mu) * rs * weight[i].to_f32() + bias[i].to_f32());
            }
            *m = mu;
            *r = rs;
        },
    );
}

/// Mean and reciprocal standard deviation of one row (accumulated in f64 for stability).
fn row_stats<E: Elem>(x: &[E]) -> (f32, f32) {
    let n = x.len() as f64;
    let mean = x.iter().map(|&v| v.to_f32() as f64).sum::<f64>() / n;
    let var = x.iter().map(|&v| (v.to_f32() as f64 - mean).powi(2)).sum::<f64>() / n;
    (mean as f32, (1.0 / (var + LN_EPS as f64).sqrt()) as f32)
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
    out.par_chunks_mut(c).zip(inp.par_chunks(c)).zip(mean.par_iter().zip(rstd.par_iter())).for_each(
        |((o, x), (&mu, &rs))| {
            for i in 0..c {
                o[i] = E::from_f32((x[i].to_f32() - mu) * rs * weight[i].to_f32() + bias[i].to_f32());
            }
        },
    );
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
    dinp.par_chunks_mut(c)
        .zip(dout.par_chunks(c).zip(inp.par_chunks(c)))
        .zip(mean.par_iter().zip(rstd.par_iter()))
        .for_each(|((di, (d, x)), (&mu, &rs))| {
            let mut dnorm_mean = 0.0f32;
            let mut dnorm_norm_mean = 0.0f32;
            for i in 0..c {
                let norm = (x[i].to_f32() - mu) * rs;
                let dnorm = weight[i].to_f32() * d[i].to_f32();
                dnorm_mean += dnorm;
                dnorm_norm_mean += dnorm * norm;
            }
            dnorm_mean /= c as f32;
            dnorm_norm_mean /= c as f32;
            for i in 0..c {
                let norm = (x[i].to_f32() - mu) * rs;
                let dnorm = weight[i].to_f32() * d[i].to_f32();
                di[i] = E::from_f32(di[i].to_f32() + (dnorm - dnorm_mean - norm * dnorm_norm_mean) * rs);
            }
        });
    // Parameter gradients: a fixed-order reduction over rows in f32 (deterministic, bitwise
    // repeatable), added to the stored gradient once.
    let mut dw = vec![0.0f32; 0];
    let mut db = vec![0.0f32; 0];
    let (dw32, db32): (&mut [f32], &mut [f32]) = match (E::as_f32_mut(dweight), E::as_f32_mut(dbias)) {
        (Some(w), Some(b)) => (w, b),
        _ => {
            dw.resize(c, 0.0);
            db.resize(c, 0.0);
            (&mut dw, &mut db)
        }
    };
    for ((d, x), (&mu, &rs)) in dout.chunks(c).zip(inp.chunks(c)).zip(mean.iter().zip(rstd)) {
        for i in 0..c {
            let di = d[i].to_f32();
            let norm = (x[i].to_f32() - mu) * rs;
            db32[i] += di;
            dw32[i] += norm * di;
        }
    }
    if !E::is_f32() {
        for i in 0..c {
            dweight[i] = E::from_f32(dweight[i].to_f32() + dw[i]);
            dbias[i] = E::from_f32(dbias[i].to_f32() + db[i]);
        }
    }
}

// ----------------------------------------------------------------------------------------------
// matmul (through the gemm crate, f32)

/// Rows per chunk when widening 16-bit operands.
pub const MATMUL_ROW_CHUNK: usize = 128;

/// dst (m,n) = [dst +] lhs (m,k) · rhs (k,n), all given by row/column strides.
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
) {
    assert!(dst.len() >= (m - 1) * dst_rs + n, "gemm dst: ({m},{n}) rs {dst_rs} in {}", dst.len());
    assert!(lhs.len() > (m - 1) * lhs_rs + (k - 1) * lhs_cs, "gemm lhs: ({m},{k}) in {}", lhs.len());
    assert!(rhs.len() > (k - 1) * rhs_rs + (n - 1) * rhs_cs, "gemm rhs: ({k},{n}) in {}", rhs.len());
    // SAFETY: the asserts above bound every access.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            dst_rs as isize,
            accumulate,
            lhs.as_ptr(),
            lhs_cs as isize,
            lhs_rs as isize,
            rhs.as_ptr(),
            rhs_cs as isize,
            rhs_rs as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::Rayon(threads()),
        );
    }
}

/// f32 scratch elements `matmul_forward::<E>` needs for an (N,C)·(OC,C)ᵀ product.
pub fn matmul_forward_scratch<E: Elem>(n: usize, c: usize, oc: usize) -> usize {
    if E::is_f32() {
        return 0;
    }
    let ch = n.min(MATMUL_ROW_CHUNK);
    oc * c + ch * c + ch * oc
}

/// f32 scratch elements `matmul_backward::<E>` needs.
pub fn matmul_backward_scratch<E: Elem>(n: usize, c: usize, oc: usize) -> usize {
    if E::is_f32() {
        return 0;
    }
    let ch = n.min(MATMUL_ROW_CHUNK);
    2 * oc * c + ch * oc + 2 * ch * c
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
        gemm_f32(n, oc, c, out, oc, true, inp, c, 1, weight, 1, c);
        return;
    }
    let ch = n.min(MATMUL_ROW_CHUNK);
    let (w32, rest) = scratch.split_at_mut(oc * c);
    let (x32, rest) = rest.split_at_mut(ch * c);
    let y32 = &mut rest[..ch * oc];
    widen(w32, weight);
    for start in (0..n).step_by(ch) {
        let rows = ch.min(n - start);
        widen(&mut x32[..rows * c], &inp[start * c..(start + rows) * c]);
        let y = &mut y32[..rows * oc];
        match bias {
            Some(b) => y.par_chunks_mut(oc).for_each(|row| row.iter_mut().zip(b).for_each(|(o, b)| *o = b.to_f32())),
            None => y.fill(0.0),
        }
        gemm_f32(rows, oc, c, y, oc, true, x32, c, 1, w32, 1, c);
        narrow(&mut out[start * oc..(start + rows) * oc], y);
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
        gemm_f32(n, c, oc, dinp, c, false, dout, oc, 1, weight, c, 1);
        gemm_f32(oc, c, n, dweight, c, true, dout, 1, oc, inp, c, 1);
    } else {
        let ch = n.min(MATMUL_ROW_CHUNK);
        let (w32, rest) = scratch.split_at_mut(oc * c);
        let (dw32, rest) = rest.split_at_mut(oc * c);
        let (d32, rest) = rest.split_at_mut(ch * oc);
        let (x32, rest) = rest.split_at_mut(ch * c);
        let dx32 = &mut rest[..ch * c];
        widen(w32, weight);
        widen(dw32, dweight);
        for start in (0..n).step_by(ch) {
            let rows = ch.min(n - start);
            let d = &mut d32[..rows * oc];
            widen(d, &dout[start * oc..(start + rows) * oc]);
            let x = &mut x32[..rows * c];
            widen(x, &inp[start * c..(start + rows) * c]);
            let dx = &mut dx32[..rows * c];
            gemm_f32(rows, c, oc, dx, c, false, d, oc, 1, w32, c, 1);
            narrow(&mut dinp[start * c..(start + rows) * c], dx);
            gemm_f32(oc, c, rows, dw32, c, true, d, 1, oc, x, c, 1);
        }
        narrow(dweight, dw32);
    }
    if let Some(db) = dbias {
        match E::as_f32_mut(db) {
            Some(db) => {
                for row in dout.chunks(oc) {
                    for o in 0..oc {
                        db[o] += row[o].to_f32();
                    }
                }
            }
            None => {
                for o in 0..oc {
                    let s: f32 = dout.chunks(oc).map(|row| row[o].to_f32()).sum();
                    db[o] = E::from_f32(db[o].to_f32() + s);
                }
            }
        }
    }
}

// ----------------------------------------------------------------------------------------------
// causal self-attention

/// f32 scratch elements attention_forward needs: one score row per (batch, head).
pub fn attention_forward_scratch(b: usize, t: usize, nh: usize) -> usize {
    b * nh * t
}

/// out: (B,T,C); lse: (B,NH,T) f32, each row's log-sum-exp of its scaled scores, kept for
/// backward instead of the (B,NH,T,T) probabilities (which backward recomputes from it);
/// qkv: (B,T,3C) with q, k, v side by side; scratch: (B,NH,T) f32.
///
/// For query t and key t2 ≤ t: s = q·k / √HS, p = exp(s − lse) rounded to `E`, out = Σ p · v.
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
    assert!(scratch.len() >= b * nh * t, "scratch: (B,NH,T)");
    let out_ptr = SendPtr(out.as_mut_ptr());
    lse.par_chunks_mut(t).zip(scratch.par_chunks_mut(t)).enumerate().for_each(|(bh, (lse_bh, row))| {
        let (bi, h) = (bh / nh, bh % nh);
        for ti in 0..t {
            let q = &qkv[(bi * t + ti) * 3 * c + h * hs..][..hs];
            lse_bh[ti] = softmax_scores(row, q, ti, scale, |t2| &qkv[(bi * t + t2) * 3 * c + c + h * hs..][..hs]);
            // SAFETY: task (bi,h) alone writes out[bi, ti, h*hs .. (h+1)*hs].
            let o = unsafe { out_ptr.slice((bi * t + ti) * c + h * hs, hs) };
            weighted_values(o, ti, |t2| row[t2], |t2| &qkv[(bi * t + t2) * 3 * c + 2 * c + h * hs..][..hs]);
        }
    });
}

/// f32 scratch elements attention_backward needs: a probability row and a gradient row per
/// (batch, head), plus, for 16-bit storage, an f32 accumulator for the qkv gradient.
pub fn attention_backward_scratch<E: Elem>(b: usize, t: usize, c: usize, nh: usize) -> usize {
    2 * b * nh * t + if E::is_f32() { 0 } else { b * t * 3 * c }
}

/// dqkv: (B,T,3C) [overwritten]; scratch: see [`attention_backward_scratch`]; dout: (B,T,C);
/// qkv, lse as saved by forward.
///
/// The probabilities are recomputed from q, k and lse exactly as forward made them (rounded to
/// `E`); datt = dout·v; the scores' gradient ds = p · (datt − Σ p·datt) / √HS is rounded to `E`
/// before it weights k and q (as a 16-bit device multiplies it), the sums are in f32.
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
    assert_eq!(lse.len(), b * nh * t, "lse: (B,NH,T)");
    assert!(scratch.len() >= attention_backward_scratch::<E>(b, t, c, nh), "attention_backward scratch");
    let (rows, acc) = scratch.split_at_mut(2 * b * nh * t);
    let acc: &mut [f32] = match E::as_f32_mut(dqkv) {
        Some(d) => d,
        None => &mut acc[..b * t * 3 * c],
    };
    acc.fill(0.0);
    let acc_ptr = SendPtr(acc.as_mut_ptr());
    rows.par_chunks_mut(2 * t).enumerate().for_each(|(bh, rows)| {
        let (bi, h) = (bh / nh, bh % nh);
        let (p, datt) = rows.split_at_mut(t);
        for ti in 0..t {
            let q_base = (bi * t + ti) * 3 * c + h * hs;
            let q = &qkv[q_base..][..hs];
            let lse = lse[bh * t + ti];
            let d = &dout[(bi * t + ti) * c + h * hs..][..hs];
            // p[t2] as forward made it (one pass with the next two: k[t2] and v[t2] sit together);
            // datt[t2] = d · v[t2];  dv[t2] += p[t2] * d
            for t2 in 0..=ti {
                let base = (bi * t + t2) * 3 * c + 2 * c + h * hs;
                p[t2] = probability::<E>(dot(q, &qkv[base - c..][..hs]) * scale, lse);
                datt[t2] = dot(d, &qkv[base..][..hs]);
                // SAFETY: task (bi,h) alone writes the v-columns of head h in batch bi.
                let dv = unsafe { acc_ptr.slice(base, hs) };
                for i in 0..hs {
                    dv[i] += p[t2] * d[i].to_f32();
                }
            }
            // softmax backward: ds[t2] = p[t2] * (datt[t2] - Σ p·datt) * scale, rounded to E
            let s: f32 = (0..=ti).map(|t2| p[t2] * datt[t2]).sum();
            for t2 in 0..=ti {
                let ds = E::from_f32(p[t2] * (datt[t2] - s) * scale).to_f32();
                let k_base = (bi * t + t2) * 3 * c + c + h * hs;
                // SAFETY: as above, for the q- and k-columns of head h in batch bi.
                let dq = unsafe { acc_ptr.slice(q_base, hs) };
                let k = &qkv[k_base..][..hs];
                for i in 0..hs {
                    dq[i] += ds * k[i].to_f32();
                }
                let dk = unsafe { acc_ptr.slice(k_base, hs) };
                for i in 0..hs {
                    dk[i] += ds * q[i].to_f32();
                }
            }
        }
    });
    if !E::is_f32() {
        narrow(dqkv, &scratch[2 * b * nh * t..][..b * t * 3 * c]);
    }
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
        let (bi, h) = (bh / nh, bh % nh);
        for i in 0..tn {
            let q = &qkv[(bi * tn + i) * 3 * c + h * hs..][..hs];
            let last = start + i;
            softmax_scores(row, q, last, scale, |t2| &keys[(bi * context + t2) * c + h * hs..][..hs]);
            // SAFETY: task (bi,h) alone writes out[bi, i, h*hs .. (h+1)*hs].
            let o = unsafe { out_ptr.slice((bi * tn + i) * c + h * hs, hs) };
            weighted_values(o, last, |t2| row[t2], |t2| &values[(bi * context + t2) * c + h * hs..][..hs]);
        }
    });
}

/// One causal attention row: row[..=last] = p(t) = exp(s(t) − lse) rounded to `E` (and read
/// back as f32), s(t) = scale · q·key(t), t = 0..=last; returns lse = log Σ exp s(t) (the
/// maximum subtracted first). The full pass and the cached one share it, and backward
/// recomputes each probability by the same `probability`, so all three weigh the values with
/// the same numbers.
#[inline]
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
    let maxval = row.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
    let sum: f32 = row.iter().map(|&s| (s - maxval).exp()).sum();
    let lse = maxval + sum.ln();
    for v in row.iter_mut() {
        *v = probability::<E>(*v, lse);
    }
    lse
}

/// One causal attention probability from its scaled score and its row's log-sum-exp:
/// exp(s − lse) rounded to `E` (read back as f32) — forward's, the cached pass's and backward's.
#[inline]
fn probability<E: Elem>(score: f32, lse: f32) -> f32 {
    E::from_f32((score - lse).exp()).to_f32()
}

/// o (HS) = Σ p(t) · value(t) over t = 0..=last, accumulated in f32 in chunks of 256 channels
/// (t in order, so the sum is the same wherever the values live).
#[inline]
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

#[inline]
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
// GELU (tanh approximation, as GPT-2)

const GELU_SCALE: f32 = 0.797_884_6; // sqrt(2/pi)

/// out: (N) = gelu(inp)
pub fn gelu_forward<E: Elem>(out: &mut [E], inp: &[E]) {
    out.par_chunks_mut(4096).zip(inp.par_chunks(4096)).for_each(|(o, x)| {
        for i in 0..o.len() {
            let v = x[i].to_f32();
            let cube = 0.044715 * v * v * v;
            o[i] = E::from_f32(0.5 * v * (1.0 + (GELU_SCALE * (v + cube)).tanh()));
        }
    });
}

/// dinout: (N) holds dout on entry and gelu'(inp) * dout on return.
pub fn gelu_backward_inplace<E: Elem>(dinout: &mut [E], inp: &[E]) {
    dinout.par_chunks_mut(4096).zip(inp.par_chunks(4096)).for_each(|(d, x)| {
        for i in 0..d.len() {
            let v = x[i].to_f32();
            let cube = 0.044715 * v * v * v;
            let arg = GELU_SCALE * (v + cube);
            let th = arg.tanh();
            let sech2 = 1.0 - th * th;
            let local = 0.5 * (1.0 + th) + v * 0.5 * sech2 * GELU_SCALE * (1.0 + 3.0 * 0.044715 * v * v);
            d[i] = E::from_f32(d[i].to_f32() * local);
        }
    });
}

// ----------------------------------------------------------------------------------------------
// residual

/// out (N) += inp (N)
pub fn residual_forward_inplace<E: Elem>(out: &mut [E], inp: &[E]) {
    out.par_chunks_mut(4096).zip(inp.par_chunks(4096)).for_each(|(o, x)| {
        for i in 0..o.len() {
            o[i] = E::from_f32(o[i].to_f32() + x[i].to_f32());
        }
    });
}

// ----------------------------------------------------------------------------------------------
// fused softmax + cross-entropy (f32 arithmetic whatever the storage)

/// logits: (N,V) turned into probabilities in place; losses: (N) f32 = -log p[target].
pub fn crossentropy_forward<E: Elem>(logits: &mut [E], losses: &mut [f32], targets: &[u32], v: usize) {
    logits.par_chunks_mut(v).zip(losses.par_iter_mut().zip(targets.par_iter())).for_each(|(row, (loss, &tgt))| {
        let maxval = row.iter().map(|x| x.to_f32()).fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0f64;
        for x in row.iter() {
            sum += ((x.to_f32() - maxval).exp()) as f64;
        }
        let log_sum = sum.ln() as f32;
        let inv = (1.0 / sum) as f32;
        *loss = -(row[tgt as usize].to_f32() - maxval - log_sum);
        for x in row.iter_mut() {
            *x = E::from_f32((x.to_f32() - maxval).exp() * inv);
        }
    });
}

/// probs: (N,V) turned into dlogits in place: (p - onehot(target)) * dloss.
pub fn crossentropy_backward_inplace<E: Elem>(probs: &mut [E], targets: &[u32], dloss: f32, v: usize) {
    probs.par_chunks_mut(v).zip(targets.par_iter()).for_each(|(row, &tgt)| {
        for x in row.iter_mut() {
            *x = E::from_f32(x.to_f32() * dloss);
        }
        row[tgt as usize] = E::from_f32(row[tgt as usize].to_f32() - dloss);
    });
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
