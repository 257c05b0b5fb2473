//! The CPU reference layers: each a `*_forward` / `*_backward` pair side by side, in fp32, on
//! plain slices (the pool owns the memory; these functions never allocate).
//!
//! Shapes follow llm.c: B batch, T time, C channels, NH heads, hs = C / NH, V vocabulary.
//! Backward functions *accumulate* into parameter gradients (so micro-batches add up) and
//! *overwrite* activation gradients unless documented otherwise.

use rayon::prelude::*;

/// A raw pointer that may cross threads: used only where tasks write provably disjoint ranges.
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

impl SendPtr {
    /// # Safety
    /// The caller guarantees `offset..offset+len` is in bounds and written by one task only.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice(&self, offset: usize, len: usize) -> &mut [f32] {
        std::slice::from_raw_parts_mut(self.0.add(offset), len)
    }
}

fn threads() -> usize {
    rayon::current_num_threads()
}

// ----------------------------------------------------------------------------------------------
// encoder: token + position embedding

/// out: (B,T,C) = wte[inp[b,t]] + wpe[t]; inp: (B,T) token ids; wte: (V,C); wpe: (maxT,C).
pub fn encoder_forward(out: &mut [f32], inp: &[u32], wte: &[f32], wpe: &[f32], t: usize, c: usize) {
    out.par_chunks_mut(c).zip(inp.par_iter()).enumerate().for_each(|(bt, (row, &tok))| {
        let pos = bt % t;
        let we = &wte[tok as usize * c..][..c];
        let pe = &wpe[pos * c..][..c];
        for i in 0..c {
            row[i] = we[i] + pe[i];
        }
    });
}

/// dwte (V,C) += scatter of dout (B,T,C) by token; dwpe (maxT,C) += dout summed over the batch.
pub fn encoder_backward(dwte: &mut [f32], dwpe: &mut [f32], dout: &[f32], inp: &[u32], t: usize, c: usize) {
    for (bt, (&tok, d)) in inp.iter().zip(dout.chunks(c)).enumerate() {
        let pos = bt % t;
        let we = &mut dwte[tok as usize * c..][..c];
        for i in 0..c {
            we[i] += d[i];
        }
        let pe = &mut dwpe[pos * c..][..c];
        for i in 0..c {
            pe[i] += d[i];
        }
    }
}

// ----------------------------------------------------------------------------------------------
// layernorm

const LN_EPS: f32 = 1e-5;

/// out: (N,C) normalised rows scaled by weight (C) plus bias (C); mean, rstd: (N) kept for backward.
pub fn layernorm_forward(
    out: &mut [f32],
    mean: &mut [f32],
    rstd: &mut [f32],
    inp: &[f32],
    weight: &[f32],
    bias: &[f32],
    c: usize,
) {
    out.par_chunks_mut(c).zip(inp.par_chunks(c)).zip(mean.par_iter_mut().zip(rstd.par_iter_mut())).for_each(
        |((o, x), (m, r))| {
            let (mu, rs) = row_stats(x);
            for i in 0..c {
                o[i] = (x[i] - mu) * rs * weight[i] + bias[i];
            }
            *m = mu;
            *r = rs;
        },
    );
}

/// Mean and reciprocal standard deviation of one row (accumulated in f64 for stability).
fn row_stats(x: &[f32]) -> (f32, f32) {
    let n = x.len() as f64;
    let mean = x.iter().map(|&v| v as f64).sum::<f64>() / n;
    let var = x.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n;
    (mean as f32, (1.0 / (var + LN_EPS as f64).sqrt()) as f32)
}

/// Recompute a layernorm output from its input and saved statistics (used by checkpointing).
pub fn layernorm_recompute(
    out: &mut [f32],
    inp: &[f32],
    weight: &[f32],
    bias: &[f32],
    mean: &[f32],
    rstd: &[f32],
    c: usize,
) {
    out.par_chunks_mut(c).zip(inp.par_chunks(c)).zip(mean.par_iter().zip(rstd.par_iter())).for_each(
        |((o, x), (&mu, &rs))| {
            for i in 0..c {
                o[i] = (x[i] - mu) * rs * weight[i] + bias[i];
            }
        },
    );
}

/// dinp (N,C) += input gradient; dweight, dbias (C) += parameter gradients.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward(
    dinp: &mut [f32],
    dweight: &mut [f32],
    dbias: &mut [f32],
    dout: &[f32],
    inp: &[f32],
    weight: &[f32],
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
                let norm = (x[i] - mu) * rs;
                let dnorm = weight[i] * d[i];
                dnorm_mean += dnorm;
                dnorm_norm_mean += dnorm * norm;
            }
            dnorm_mean /= c as f32;
            dnorm_norm_mean /= c as f32;
            for i in 0..c {
                let norm = (x[i] - mu) * rs;
                let dnorm = weight[i] * d[i];
                di[i] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * rs;
            }
        });
    // Parameter gradients: a fixed-order reduction over rows (deterministic, bitwise repeatable).
    for ((d, x), (&mu, &rs)) in dout.chunks(c).zip(inp.chunks(c)).zip(mean.iter().zip(rstd)) {
        for i in 0..c {
            let norm = (x[i] - mu) * rs;
            dbias[i] += d[i];
            dweight[i] += norm * d[i];
        }
    }
}

// ----------------------------------------------------------------------------------------------
// matmul (through the gemm crate)

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
    debug_assert!(dst.len() >= (m - 1) * dst_rs + n);
    debug_assert!(lhs.len() > (m - 1) * lhs_rs + (k - 1) * lhs_cs);
    debug_assert!(rhs.len() > (k - 1) * rhs_rs + (n - 1) * rhs_cs);
    // SAFETY: the asserts above (checked by callers' shape arithmetic) bound every access.
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

/// out: (N,OC) = inp (N,C) · weightᵀ (weight: (OC,C)) + bias (OC).
pub fn matmul_forward(
    out: &mut [f32],
    inp: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    n: usize,
    c: usize,
    oc: usize,
) {
    match bias {
        Some(b) => out.par_chunks_mut(oc).for_each(|row| row.copy_from_slice(b)),
        None => out.fill(0.0),
    }
    gemm_f32(n, oc, c, out, oc, true, inp, c, 1, weight, 1, c);
}

/// dinp (N,C) = dout (N,OC) · weight (OC,C) [overwritten]; dweight (OC,C) += doutᵀ · inp;
/// dbias (OC) += Σ_rows dout.
#[allow(clippy::too_many_arguments)]
pub fn matmul_backward(
    dinp: &mut [f32],
    dweight: &mut [f32],
    dbias: Option<&mut [f32]>,
    dout: &[f32],
    inp: &[f32],
    weight: &[f32],
    n: usize,
    c: usize,
    oc: usize,
) {
    gemm_f32(n, c, oc, dinp, c, false, dout, oc, 1, weight, c, 1);
    gemm_f32(oc, c, n, dweight, c, true, dout, 1, oc, inp, c, 1);
    if let Some(db) = dbias {
        for row in dout.chunks(oc) {
            for o in 0..oc {
                db[o] += row[o];
            }
        }
    }
}

// ----------------------------------------------------------------------------------------------
// causal self-attention

/// out: (B,T,C); att: (B,NH,T,T) softmax probabilities (zero above the diagonal), kept for
/// backward; qkv: (B,T,3C) with q, k, v side by side.
pub fn attention_forward(out: &mut [f32], att: &mut [f32], qkv: &[f32], b: usize, t: usize, c: usize, nh: usize) {
    let hs = c / nh;
    let scale = 1.0 / (hs as f32).sqrt();
    assert_eq!(att.len(), b * nh * t * t, "att: (B,NH,T,T)");
    assert_eq!(out.len(), b * t * c, "out: (B,T,C)");
    let out_ptr = SendPtr(out.as_mut_ptr());
    att.par_chunks_mut(t * t).enumerate().for_each(|(bh, att_bh)| {
        let (bi, h) = (bh / nh, bh % nh);
        for ti in 0..t {
            let q = &qkv[(bi * t + ti) * 3 * c + h * hs..][..hs];
            let row = &mut att_bh[ti * t..][..t];
            let mut maxval = f32::NEG_INFINITY;
            for t2 in 0..=ti {
                let k = &qkv[(bi * t + t2) * 3 * c + c + h * hs..][..hs];
                let s = dot(q, k) * scale;
                row[t2] = s;
                maxval = maxval.max(s);
            }
            let mut sum = 0.0f32;
            for v in row[..=ti].iter_mut() {
                *v = (*v - maxval).exp();
                sum += *v;
            }
            let inv = 1.0 / sum;
            for v in row[..=ti].iter_mut() {
                *v *= inv;
            }
            row[ti + 1..].fill(0.0);
            // SAFETY: task (bi,h) alone writes out[bi, ti, h*hs .. (h+1)*hs].
            let o = unsafe { out_ptr.slice((bi * t + ti) * c + h * hs, hs) };
            o.fill(0.0);
            for t2 in 0..=ti {
                let v = &qkv[(bi * t + t2) * 3 * c + 2 * c + h * hs..][..hs];
                let a = row[t2];
                for i in 0..hs {
                    o[i] += a * v[i];
                }
            }
        }
    });
}

/// dqkv: (B,T,3C) [overwritten]; scratch: (B,NH,T) workspace; dout: (B,T,C); qkv, att as saved.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    dqkv: &mut [f32],
    scratch: &mut [f32],
    dout: &[f32],
    qkv: &[f32],
    att: &[f32],
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
) {
    let hs = c / nh;
    let scale = 1.0 / (hs as f32).sqrt();
    assert_eq!(dqkv.len(), b * t * 3 * c, "dqkv: (B,T,3C)");
    assert!(scratch.len() >= b * nh * t, "scratch: (B,NH,T)");
    dqkv.fill(0.0);
    let dqkv_ptr = SendPtr(dqkv.as_mut_ptr());
    scratch.par_chunks_mut(t).enumerate().take(b * nh).for_each(|(bh, datt)| {
        let (bi, h) = (bh / nh, bh % nh);
        let att_bh = &att[bh * t * t..][..t * t];
        for ti in 0..t {
            let row = &att_bh[ti * t..][..t];
            let d = &dout[(bi * t + ti) * c + h * hs..][..hs];
            // datt[t2] = d · v[t2];  dv[t2] += att[t2] * d
            for t2 in 0..=ti {
                let base = (bi * t + t2) * 3 * c + 2 * c + h * hs;
                datt[t2] = dot(d, &qkv[base..][..hs]);
                // SAFETY: task (bi,h) alone writes the v-columns of head h in batch bi.
                let dv = unsafe { dqkv_ptr.slice(base, hs) };
                let a = row[t2];
                for i in 0..hs {
                    dv[i] += a * d[i];
                }
            }
            // softmax backward: dpre[t2] = att[t2] * (datt[t2] - Σ att·datt)
            let s: f32 = (0..=ti).map(|t2| row[t2] * datt[t2]).sum();
            let q_base = (bi * t + ti) * 3 * c + h * hs;
            for t2 in 0..=ti {
                let dpre = row[t2] * (datt[t2] - s) * scale;
                let k_base = (bi * t + t2) * 3 * c + c + h * hs;
                // SAFETY: as above, for the q- and k-columns of head h in batch bi.
                let dq = unsafe { dqkv_ptr.slice(q_base, hs) };
                let k = &qkv[k_base..][..hs];
                for i in 0..hs {
                    dq[i] += dpre * k[i];
                }
                let dk = unsafe { dqkv_ptr.slice(k_base, hs) };
                let q = &qkv[q_base..][..hs];
                for i in 0..hs {
                    dk[i] += dpre * q[i];
                }
            }
        }
    });
}

#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight independent accumulators let the compiler vectorise without reassociating floats.
    let mut acc = [0.0f32; 8];
    let chunks = a.len() / 8;
    for j in 0..chunks {
        for l in 0..8 {
            acc[l] += a[j * 8 + l] * b[j * 8 + l];
        }
    }
    let mut s = acc.iter().sum::<f32>();
    for i in chunks * 8..a.len() {
        s += a[i] * b[i];
    }
    s
}

// ----------------------------------------------------------------------------------------------
// GELU (tanh approximation, as GPT-2)

const GELU_SCALE: f32 = 0.797_884_6; // sqrt(2/pi)

/// out: (N) = gelu(inp)
pub fn gelu_forward(out: &mut [f32], inp: &[f32]) {
    out.par_chunks_mut(4096).zip(inp.par_chunks(4096)).for_each(|(o, x)| {
        for i in 0..o.len() {
            let v = x[i];
            let cube = 0.044715 * v * v * v;
            o[i] = 0.5 * v * (1.0 + (GELU_SCALE * (v + cube)).tanh());
        }
    });
}

/// dinp: (N) = gelu'(inp) * dout [overwritten]; `dinp` may alias nothing, use `gelu_backward_inplace`.
pub fn gelu_backward_inplace(dinout: &mut [f32], inp: &[f32]) {
    dinout.par_chunks_mut(4096).zip(inp.par_chunks(4096)).for_each(|(d, x)| {
        for i in 0..d.len() {
            let v = x[i];
            let cube = 0.044715 * v * v * v;
            let arg = GELU_SCALE * (v + cube);
            let th = arg.tanh();
            let sech2 = 1.0 - th * th;
            let local = 0.5 * (1.0 + th) + v * 0.5 * sech2 * GELU_SCALE * (1.0 + 3.0 * 0.044715 * v * v);
            d[i] *= local;
        }
    });
}

// ----------------------------------------------------------------------------------------------
// residual

/// out (N) += inp (N)
pub fn residual_forward_inplace(out: &mut [f32], inp: &[f32]) {
    out.par_chunks_mut(4096).zip(inp.par_chunks(4096)).for_each(|(o, x)| {
        for i in 0..o.len() {
            o[i] += x[i];
        }
    });
}

// ----------------------------------------------------------------------------------------------
// fused softmax + cross-entropy

/// logits: (N,V) turned into probabilities in place; losses: (N) = -log p[target].
pub fn crossentropy_forward(logits: &mut [f32], losses: &mut [f32], targets: &[u32], v: usize) {
    logits.par_chunks_mut(v).zip(losses.par_iter_mut().zip(targets.par_iter())).for_each(|(row, (loss, &tgt))| {
        let maxval = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0f64;
        for x in row.iter_mut() {
            *x = (*x - maxval).exp();
            sum += *x as f64;
        }
        let inv = (1.0 / sum) as f32;
        for x in row.iter_mut() {
            *x *= inv;
        }
        *loss = -(row[tgt as usize].max(1e-30)).ln();
    });
}

/// probs: (N,V) turned into dlogits in place: (p - onehot(target)) * dloss.
pub fn crossentropy_backward_inplace(probs: &mut [f32], targets: &[u32], dloss: f32, v: usize) {
    probs.par_chunks_mut(v).zip(targets.par_iter()).for_each(|(row, &tgt)| {
        for x in row.iter_mut() {
            *x *= dloss;
        }
        row[tgt as usize] -= dloss;
    });
}
