//! AdamW with decoupled weight decay, global-norm gradient clipping and the warmup + cosine
//! learning-rate schedule.

use rayon::prelude::*;

use std::ops::Range;

use super::layers::Elem;

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

/// Sum of squares of `grads` in a fixed reduction order (f64). Infinite or NaN if any
/// gradient is.
pub fn sum_squares<E: Elem>(grads: &[E]) -> f64 {
    let partial: Vec<f64> = grads
        .par_chunks(CHUNK)
        .map(|c| c.iter().map(|&g| (g.to_f32() as f64) * (g.to_f32() as f64)).sum::<f64>())
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
        let bc1 = 1.0 - BETA1.powi(self.t as i32);
        let bc2 = 1.0 - BETA2.powi(self.t as i32);
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

#[cfg(test)]
mod tests {
    use super::*;

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
