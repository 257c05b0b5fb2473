//! AdamW with decoupled weight decay, global-norm gradient clipping and the warmup + cosine
//! learning-rate schedule.

use rayon::prelude::*;

use std::ops::Range;

use super::layers::{Elem, REDUCE_LANES};
use super::simd::widest;

pub const BETA1: f32 = 0.9;
pub const BETA2: f32 = 0.95;
pub const EPS: f32 = 1e-8;
/// Elements per parallel chunk; fixed so reductions are bitwise repeatable.
const CHUNK: usize = 1 << 16;

/// Linear warmup to `max_lr` over `warmup` steps, then cosine decay to `max_lr / 10` at `total`.
pub fn lr_at(step: usize, max_lr: f64, warmup: usize, total: usize) -> f64 {
    let min_lr = max_lr * 0.1;
    if step < warmup {
        return max_lr * (step + 1) as f64 / warmup as f64;
    }
    if total <= warmup + 1 {
        return max_lr;
    }
    let progress = ((step - warmup) as f64 / (total - warmup - 1) as f64).min(1.0);
    min_lr + 0.5 * (max_lr - min_lr) * (1.0 + (std::f64::consts::PI * progress).cos())
}

/// Sum of squares of `grads` in a fixed reduction order (f64: `REDUCE_LANES` partial sums per
/// chunk of `CHUNK`, whatever the threads). Infinite or NaN if any gradient is.
pub fn sum_squares<E: Elem>(grads: &[E]) -> f64 {
    let square = |g: &E| (g.to_f32() as f64) * (g.to_f32() as f64);
    let partial: Vec<f64> = grads
        .par_chunks(CHUNK)
        .map(|c| {
            widest(
                #[inline(always)]
                || {
                    let mut acc = [0f64; REDUCE_LANES];
                    let lanes = c.chunks_exact(REDUCE_LANES);
                    let tail: f64 = lanes.remainder().iter().map(square).sum();
                    for l in lanes {
                        for (a, g) in acc.iter_mut().zip(l) {
                            *a += square(g);
                        }
                    }
                    acc.iter().sum::<f64>() + tail
                },
            )
        })
        .collect();
    partial.iter().sum()
}

/// The factor that brings a gradient of global norm `norm` down to `max_norm` (0 disables).
pub fn clip_coefficient(norm: f64, max_norm: f64) -> f32 {
    if max_norm > 0.0 && norm > max_norm {
        (max_norm / (norm + 1e-6)) as f32
    } else {
        1.0
    }
}

/// Hyper-parameters of one AdamW update.
#[derive(Debug, Clone, Copy)]
pub struct AdamW {
    pub lr: f32,
    pub weight_decay: f32,
    /// 1-based step count for bias correction.
    pub t: u64,
}

impl AdamW {
    /// `(1 − β1^t, 1 − β2^t)`, computed in one place at run time: `powi` folded at compile time
    /// where `t` is a known constant can round differently from the run-time call, and every
    /// update path must divide by the same bits.
    #[inline(never)]
    pub fn bias_corrections(&self) -> (f32, f32) {
        let t = std::hint::black_box(self.t as i32);
        (1.0 - BETA1.powi(t), 1.0 - BETA2.powi(t))
    }

    /// Update the fp32 `params` in place from `grads × grad_mult` (unscaling and clipping folded
    /// in) with moments `m`, `v`, tensor by tensor — (element range, decayed) — so that only
    /// matrices are decayed.
    pub fn update<E: Elem>(
        &self,
        tensors: impl IntoIterator<Item = (Range<usize>, bool)>,
        params: &mut [f32],
        grads: &[E],
        grad_mult: f32,
        m: &mut [f32],
        v: &mut [f32],
    ) {
        let (bc1, bc2) = self.bias_corrections();
        for (r, decay) in tensors {
            let wd = if decay { self.weight_decay } else { 0.0 };
            let lr = self.lr;
            params[r.clone()]
                .par_chunks_mut(CHUNK)
                .zip(grads[r.clone()].par_chunks(CHUNK))
                .zip(m[r.clone()].par_chunks_mut(CHUNK).zip(v[r].par_chunks_mut(CHUNK)))
                .for_each(|((p, g), (m, v))| {
                    for i in 0..p.len() {
                        let gi = g[i].to_f32() * grad_mult;
                        m[i] = BETA1 * m[i] + (1.0 - BETA1) * gi;
                        v[i] = BETA2 * v[i] + (1.0 - BETA2) * gi * gi;
                        let mhat = m[i] / bc1;
                        let vhat = v[i] / bc2;
                        p[i] -= lr * (mhat / (vhat.sqrt() + EPS) + wd * p[i]);
                    }
                });
        }
    }
}

/// The per-step constants of one tensor's update.
#[derive(Clone, Copy)]
struct Consts {
    lr: f32,
    wd: f32,
    bc1: f32,
    bc2: f32,
    grad_mult: f32,
}

/// One element range of the fused host update: the gradient read from `io` in its storage
/// type (widened here, × `grad_mult`), the moments and fp32 master weight updated, and the
/// narrowed compute weight written back into the gradient's slot. The same operations in the
/// same order as [`AdamW::update`] and `narrow` (Rust never contracts them into FMAs), so the
/// result is bitwise theirs; written over zipped slices so it vectorises.
#[inline(always)]
fn fused<E: Elem>(c: Consts, p: &mut [f32], io: &mut [E], m: &mut [f32], v: &mut [f32]) {
    for (((p, g), m), v) in p.iter_mut().zip(io.iter_mut()).zip(m.iter_mut()).zip(v.iter_mut()) {
        let gi = g.to_f32() * c.grad_mult;
        *m = BETA1 * *m + (1.0 - BETA1) * gi;
        *v = BETA2 * *v + (1.0 - BETA2) * gi * gi;
        let mhat = *m / c.bc1;
        let vhat = *v / c.bc2;
        *p -= c.lr * (mhat / (vhat.sqrt() + EPS) + c.wd * *p);
        *g = E::from_f32(*p);
    }
}

impl AdamW {
    /// The optimizer-offload update in one pass over host memory: for each tensor — (element
    /// range, decayed) — the gradients in `io` (storage type `E`, × `grad_mult`) update
    /// `master`, `m` and `v`, and `io` receives the narrowed compute weights. All cores
    /// (`CHUNK`-element ranges), each with the widest vector unit the machine has. Bitwise
    /// [`AdamW::update`] on the widened gradients followed by `narrow`.
    pub fn update_host<E: Elem>(
        &self,
        tensors: impl IntoIterator<Item = (Range<usize>, bool)>,
        master: &mut [f32],
        io: &mut [E],
        grad_mult: f32,
        m: &mut [f32],
        v: &mut [f32],
    ) {
        let (bc1, bc2) = self.bias_corrections();
        for (r, decay) in tensors {
            let c = Consts { lr: self.lr, wd: if decay { self.weight_decay } else { 0.0 }, bc1, bc2, grad_mult };
            master[r.clone()]
                .par_chunks_mut(CHUNK)
                .zip(io[r.clone()].par_chunks_mut(CHUNK))
                .zip(m[r.clone()].par_chunks_mut(CHUNK).zip(v[r].par_chunks_mut(CHUNK)))
                .for_each(|((p, g), (m, v))| {
                    widest(
                        #[inline(always)]
                        || fused(c, p, g, m, v),
                    )
                });
        }
    }
}

/// The textbook loop the fused update is measured against (`headroom bench --host-adamw`):
/// one thread, indexed, the gradients already widened.
pub fn update_scalar(opt: &AdamW, params: &mut [f32], grads: &[f32], m: &mut [f32], v: &mut [f32], wd: f32) {
    let (bc1, bc2) = opt.bias_corrections();
    for i in 0..params.len() {
        let g = grads[i];
        m[i] = BETA1 * m[i] + (1.0 - BETA1) * g;
        v[i] = BETA2 * v[i] + (1.0 - BETA2) * g * g;
        let mhat = m[i] / bc1;
        let vhat = v[i] / bc2;
        params[i] -= opt.lr * (mhat / (vhat.sqrt() + EPS) + wd * params[i]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::backend::layers::narrow;

    /// Random-ish values over many magnitudes, with zeros and a few non-finite ones.
    fn values(n: usize, seed: u64) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let h = crate::engine::rng::mix64(seed ^ i as u64);
                let x = ((h >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2f32.powi((h % 24) as i32 - 12);
                if i % 997 == 0 {
                    0.0
                } else {
                    x
                }
            })
            .collect()
    }

    fn fused_matches_update_then_narrow<E: Elem + PartialEq + std::fmt::Debug>() {
        let n = 3 * CHUNK + 1234;
        let tensors = [(0..1000, false), (1000..n - 77, true), (n - 77..n, false)];
        let opt = AdamW { lr: 3e-3, weight_decay: 0.1, t: 7 };
        let grads: Vec<E> = values(n, 1).into_iter().map(E::from_f32).collect();
        let (master, m, v) = (values(n, 2), values(n, 3), values(n, 4).iter().map(|x| x.abs()).collect::<Vec<_>>());
        // Today's path: widen, update, narrow.
        let (mut p1, mut m1, mut v1) = (master.clone(), m.clone(), v.clone());
        let wide: Vec<f32> = grads.iter().map(|g| g.to_f32()).collect();
        opt.update::<f32>(tensors.clone(), &mut p1, &wide, 0.5, &mut m1, &mut v1);
        let mut out1 = vec![E::from_f32(0.0); n];
        narrow::<E>(&mut out1, &p1);
        // Fused.
        let (mut p2, mut m2, mut v2, mut io) = (master, m, v, grads);
        opt.update_host::<E>(tensors, &mut p2, &mut io, 0.5, &mut m2, &mut v2);
        let first_diff = |a: &[f32], b: &[f32]| a.iter().zip(b).position(|(x, y)| x.to_bits() != y.to_bits());
        for (what, a, b) in [("master", &p1, &p2), ("m", &m1, &m2), ("v", &v1, &v2)] {
            if let Some(i) = first_diff(a, b) {
                panic!("{} {what}[{i}]: {:e} vs {:e}", E::NAME, a[i], b[i]);
            }
        }
        assert!(out1 == io, "{} compute weights", E::NAME);
    }

    #[test]
    fn the_fused_host_update_is_bitwise_update_then_narrow() {
        println!("host SIMD: {}", crate::engine::backend::simd::host_simd());
        fused_matches_update_then_narrow::<f32>();
        fused_matches_update_then_narrow::<half::bf16>();
        fused_matches_update_then_narrow::<half::f16>();
    }

    #[test]
    fn branchless_bf16_rounding_is_halfs_bit_for_bit() {
        let mut xs = values(200_000, 9);
        xs.extend([
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::from_bits(0x7F80_0001),
            f32::from_bits(0xFF7F_FFFF),
            f32::from_bits(0x7F7F_FFFF),
            f32::from_bits(0x0000_8000),
            f32::from_bits(0x0001_8000),
            f32::from_bits(0x3F80_8000),
            f32::from_bits(0x3F81_8000),
            f32::MIN_POSITIVE,
        ]);
        for bits in (0..u32::MAX).step_by(65_521) {
            xs.push(f32::from_bits(bits));
        }
        for x in xs {
            let ours = crate::engine::backend::layers::bf16_bits(x);
            assert_eq!(ours, half::bf16::from_f32(x).to_bits(), "{x:e} ({:#010x})", x.to_bits());
        }
    }

    #[test]
    fn branchless_bf16_widening_is_halfs_bit_for_bit() {
        for bits in 0..=u16::MAX {
            let ours = crate::engine::backend::layers::bf16_to_f32(bits).to_bits();
            assert_eq!(ours, half::bf16::from_bits(bits).to_f32().to_bits(), "{bits:#06x}");
        }
    }

    #[test]
    fn branchless_f16_conversions_are_halfs_bit_for_bit() {
        use crate::engine::backend::layers::{f16_bits, f16_to_f32};
        for bits in 0..=u16::MAX {
            let want = half::f16::from_bits(bits).to_f32();
            assert_eq!(f16_to_f32(bits).to_bits(), want.to_bits(), "widen {bits:#06x}");
            // Every f16 value, and the midpoints to its neighbours (ties to even), narrows back.
            for x in
                [want, f32::from_bits(want.to_bits() + 0x1000), f32::from_bits(want.to_bits().wrapping_sub(0x1000))]
            {
                assert_eq!(f16_bits(x), half::f16::from_f32(x).to_bits(), "narrow {x:e} ({:#010x})", x.to_bits());
            }
        }
        let mut xs = values(200_000, 13);
        xs.extend([65504.0, 65519.0, 65520.0, 65536.0, 1e-8, 5.96e-8, 2.98e-8, 2.99e-8, f32::MAX, f32::MIN_POSITIVE]);
        xs.extend([f32::INFINITY, f32::NEG_INFINITY, f32::NAN, -f32::NAN, f32::from_bits(0x7F80_0001), 0.0, -0.0]);
        for bits in (0..u32::MAX).step_by(65_521) {
            xs.push(f32::from_bits(bits));
        }
        for x in xs {
            assert_eq!(f16_bits(x), half::f16::from_f32(x).to_bits(), "{x:e} ({:#010x})", x.to_bits());
        }
    }

    #[test]
    fn schedule_warms_up_then_decays_to_a_tenth() {
        assert!((lr_at(0, 1.0, 10, 100) - 0.1).abs() < 1e-12);
        assert!((lr_at(9, 1.0, 10, 100) - 1.0).abs() < 1e-12);
        assert!((lr_at(10, 1.0, 10, 100) - 1.0).abs() < 1e-12);
        assert!((lr_at(99, 1.0, 10, 100) - 0.1).abs() < 1e-12);
        assert!(lr_at(50, 1.0, 10, 100) < 1.0 && lr_at(50, 1.0, 10, 100) > 0.1);
    }

    #[test]
    fn clipping_bounds_the_norm() {
        let g = vec![3.0f32, 4.0];
        let n = sum_squares(&g).sqrt();
        assert!((n - 5.0).abs() < 1e-9);
        let coef = clip_coefficient(n, 1.0);
        assert!(((n * coef as f64) - 1.0).abs() < 1e-5);
        assert_eq!(clip_coefficient(0.5, 1.0), 1.0);
        assert_eq!(clip_coefficient(5.0, 0.0), 1.0, "0 disables clipping");
        assert!(!sum_squares(&[half::f16::INFINITY]).is_finite());
    }

    #[test]
    fn adamw_first_step_moves_by_lr_against_the_gradient() {
        let tensors = [(0..2, false)];
        let (mut p, g, mut m, mut v) = (vec![1.0f32, 1.0], vec![0.5f32, -2.0], vec![0.0; 2], vec![0.0; 2]);
        AdamW { lr: 0.1, weight_decay: 0.0, t: 1 }.update(tensors, &mut p, &g, 1.0, &mut m, &mut v);
        // Bias-corrected first step: m̂/√v̂ = sign(g).
        assert!((p[0] - 0.9).abs() < 1e-5 && (p[1] - 1.1).abs() < 1e-5, "{p:?}");
    }
}
