//! The analytic memory model behind `headroom estimate`: peak device bytes per category for a
//! job's configuration, derived from the model's own size tables and the pool's rounding, so the
//! prediction follows the engine whenever a tensor changes.
//!
//! A training step's allocated bytes peak at one of three moments:
//! - **backward start**: every kept activation, the head's outputs and all backward workspace;
//! - **first block of backward** (checkpointing): the kept activations plus that block's
//!   recomputed tensors (the logits are freed by then);
//! - **forward / evaluation**: the transient full activations of the block being computed.

use serde::Serialize;

use crate::config::{Checkpointing, JobSpec, OffloadTarget, Precision};
use crate::memory::{Category, LARGE_ROUND, ROUND, SMALL_LIMIT, SMALL_SEGMENT};

use super::layers::Elem;
use super::model::{
    activation_width, backward_scratch_elems, backward_workspace_sizes, forward_scratch_elems, global_activation_sizes,
    kept_in, layer_activation_sizes, GptConfig,
};
use super::trainer::gpt_config;

/// Bytes the pool accounts for one request of `bytes` (its rounding).
pub fn pool_bytes(bytes: usize) -> usize {
    bytes.max(1).div_ceil(ROUND) * ROUND
}

/// Predicted peak of one configuration.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Estimate {
    pub params: usize,
    pub grads: usize,
    pub optimizer: usize,
    /// Activations and workspace at the moment of the peak.
    pub activations: usize,
    pub workspace: usize,
    /// Sum of the above: the predicted `peak_allocated`.
    pub peak_allocated: usize,
    /// An upper allowance for `peak_reserved`: the live set at the peak placed in the pool's
    /// segments (large blocks rounded to 2 MiB, small ones packed into 2 MiB segments).
    pub reserved_allowance: usize,
    /// Which moment sets the peak.
    pub peak_at: &'static str,
    pub micro_batch: usize,
    pub grad_accum: usize,
    /// Host bytes of offloaded optimizer state (not device memory).
    pub host_optimizer: usize,
}

/// A live set of buffers (bytes as requested), to total and to place in segments.
#[derive(Default, Clone)]
struct Live {
    buffers: Vec<(Category, usize)>,
}

impl Live {
    fn add(&mut self, c: Category, bytes: usize) {
        self.buffers.push((c, bytes));
    }
    fn total(&self) -> usize {
        self.buffers.iter().map(|&(_, b)| pool_bytes(b)).sum()
    }
    fn of(&self, c: Category) -> usize {
        self.buffers.iter().filter(|b| b.0 == c).map(|&(_, b)| pool_bytes(b)).sum()
    }
    fn reserved_allowance(&self) -> usize {
        let mut small = 0;
        let mut large = 0;
        for &(_, b) in &self.buffers {
            let r = pool_bytes(b);
            if r <= SMALL_LIMIT {
                small += r;
            } else {
                large += r.div_ceil(LARGE_ROUND) * LARGE_ROUND;
            }
        }
        large + small.div_ceil(SMALL_SEGMENT) * SMALL_SEGMENT
    }
}

/// Peak allocated bytes of one training step (plus evaluation) for this model, micro-batch,
/// checkpointing mode and precision.
pub fn estimate_step(
    cfg: &GptConfig,
    micro_batch: usize,
    seq_len: usize,
    mode: Checkpointing,
    precision: Precision,
    grad_accum: usize,
    offload_optimizer: bool,
) -> Estimate {
    let args = (cfg, micro_batch, seq_len, mode, grad_accum, offload_optimizer);
    match precision {
        Precision::Fp32 => estimate_for::<f32>(args),
        Precision::Bf16 => estimate_for::<half::bf16>(args),
        Precision::Fp16 => estimate_for::<half::f16>(args),
    }
}

fn estimate_for<E: Elem>(
    (cfg, micro_batch, seq_len, mode, grad_accum, offload_optimizer): (
        &GptConfig,
        usize,
        usize,
        Checkpointing,
        usize,
        bool,
    ),
) -> Estimate {
    let (b, t) = (micro_batch, seq_len);
    let n = cfg.num_params();
    let mut base = Live::default();
    base.add(Category::Params, n * E::BYTES);
    base.add(Category::Grads, n * E::BYTES);
    // Offloaded: master, moments and a gradient copy (4 × 4 bytes per parameter) on the host.
    let host_optimizer = if offload_optimizer { 16 * n } else { 0 };
    if !offload_optimizer {
        if !E::is_f32() {
            base.add(Category::Optimizer, n * 4); // fp32 master weights
        }
        base.add(Category::Optimizer, n * 4);
        base.add(Category::Optimizer, n * 4);
    }

    let layer = layer_activation_sizes(cfg, b, t);
    let globals = global_activation_sizes(cfg, b, t);
    let act = |live: &mut Live, name: &str, elems: usize| {
        live.add(Category::Activations, elems * activation_width(name, E::BYTES))
    };
    let add_layer = |live: &mut Live, keep: &dyn Fn(&str) -> bool| {
        for (name, elems) in layer {
            if keep(name) {
                act(live, name, elems);
            }
        }
    };
    let add_globals = |live: &mut Live, skip_logits: bool| {
        for (name, elems) in globals {
            if !(skip_logits && name == "logits") {
                act(live, name, elems);
            }
        }
    };
    let add_workspace = |live: &mut Live| {
        for (_, elems) in backward_workspace_sizes(cfg, b, t) {
            live.add(Category::Workspace, elems * E::BYTES);
        }
        live.add(Category::Workspace, backward_scratch_elems::<E>(cfg, b, t) * 4);
    };
    let kept = |name: &str| kept_in(mode, name);
    let all = |_: &str| true;
    let mut candidates: Vec<(&'static str, Live)> = Vec::new();

    // Backward start: everything kept, head outputs, all workspace.
    let mut start = base.clone();
    add_globals(&mut start, false);
    for _ in 0..cfg.n_layer {
        add_layer(&mut start, &kept);
    }
    add_workspace(&mut start);
    candidates.push(("backward start", start));

    // Last block's backward: its kept part is rebuilt to the full set; the logits are gone.
    if mode != Checkpointing::None && cfg.n_layer > 0 {
        let mut rec = base.clone();
        add_globals(&mut rec, true);
        for _ in 0..cfg.n_layer - 1 {
            add_layer(&mut rec, &kept);
        }
        add_layer(&mut rec, &all);
        add_workspace(&mut rec);
        candidates.push(("block recompute", rec));
    }

    // Forward: through the last block (the earlier ones kept, this one in full), and the head
    // (every block kept, lnf and the logits, forward scratch still held).
    let mut fwd = base.clone();
    for &(name, elems) in globals.iter().take(3) {
        act(&mut fwd, name, elems);
    }
    fwd.add(Category::Workspace, forward_scratch_elems::<E>(cfg, b, t) * 4);
    let mut head = fwd.clone();
    for _ in 0..cfg.n_layer.saturating_sub(1) {
        add_layer(&mut fwd, &kept);
    }
    add_layer(&mut fwd, &all);
    candidates.push(("forward", fwd));
    for _ in 0..cfg.n_layer {
        add_layer(&mut head, &kept);
    }
    for &(name, elems) in globals.iter().skip(3).take(4) {
        act(&mut head, name, elems);
    }
    candidates.push(("forward head", head));

    let (peak_at, live) = candidates.into_iter().max_by_key(|(_, l)| l.total()).expect("candidates");
    Estimate {
        params: live.of(Category::Params),
        grads: live.of(Category::Grads),
        optimizer: live.of(Category::Optimizer),
        activations: live.of(Category::Activations),
        workspace: live.of(Category::Workspace),
        peak_allocated: live.total(),
        reserved_allowance: live.reserved_allowance(),
        peak_at,
        micro_batch,
        grad_accum,
        host_optimizer,
    }
}

pub fn estimate_job(spec: &JobSpec) -> Estimate {
    let cfg = gpt_config(spec);
    estimate_step(
        &cfg,
        spec.train.micro_batch as usize,
        spec.model.block_size as usize,
        spec.memory.checkpointing,
        spec.memory.precision,
        spec.grad_accum(),
        spec.memory.offload.optimizer != OffloadTarget::None,
    )
}

/// Whether an estimate fits a capacity: "yes" (even the reserved allowance fits), "tight"
/// (allocated fits, the allowance does not), "no".
pub fn verdict(e: &Estimate, capacity: usize) -> &'static str {
    if e.reserved_allowance <= capacity {
        "yes"
    } else if e.peak_allocated <= capacity {
        "tight"
    } else {
        "no"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::rng::mix64;
    use crate::engine::trainer::{Hyper, Trainer};
    use crate::memory::{format_bytes, Pool};

    /// Measured peak of one optimizer step and one evaluation pass.
    fn measure<E: Elem>(
        cfg: GptConfig,
        micro: usize,
        global: usize,
        t: usize,
        mode: Checkpointing,
    ) -> (usize, [usize; 3]) {
        let hyper = Hyper {
            steps: 2,
            global_batch: global,
            micro_batch: micro,
            grad_accum: global / micro,
            seq_len: t,
            lr: 1e-3,
            warmup_steps: 0,
            weight_decay: 0.1,
            grad_clip: 1.0,
            seed: 1,
            checkpointing: mode,
            offload_optimizer: false,
        };
        let pool = Pool::new("cpu", 1 << 32);
        let mut trainer = Trainer::<E>::new(cfg, hyper, pool.clone()).unwrap();
        let v = cfg.vocab as u64;
        let mut batch = |s: u64, i: u64, inp: &mut Vec<u32>, tgt: &mut Vec<u32>| {
            for p in 0..t as u64 {
                inp.push((mix64(s ^ (i << 20) ^ p) % v) as u32);
                tgt.push((mix64(s ^ (i << 20) ^ (p + 7)) % v) as u32);
            }
        };
        trainer.train_step(&mut batch).unwrap();
        trainer
            .evaluate(micro, &mut |i, inp, tgt| {
                for p in 0..t as u64 {
                    inp.push(((i as u64 + p) % v) as u32);
                    tgt.push(((i as u64 + p + 1) % v) as u32);
                }
            })
            .unwrap();
        let s = pool.stats();
        (s.peak_allocated, [s.peak(Category::Params), s.peak(Category::Grads), s.peak(Category::Optimizer)])
    }

    #[test]
    fn estimates_match_the_pool_within_five_percent_over_a_grid() {
        let models = [
            GptConfig { n_layer: 2, n_head: 4, n_embd: 64, block_size: 64, vocab: 256 },
            GptConfig { n_layer: 3, n_head: 2, n_embd: 32, block_size: 32, vocab: 512 },
        ];
        let mut rows = Vec::new();
        for cfg in models {
            for (precision, mode) in [Precision::Fp32, Precision::Bf16]
                .into_iter()
                .flat_map(|p| [Checkpointing::None, Checkpointing::Selective, Checkpointing::Full].map(|m| (p, m)))
            {
                for micro in [1, 4, 8] {
                    let t = cfg.block_size;
                    let (measured, static_peaks) = match precision {
                        Precision::Fp32 => measure::<f32>(cfg, micro, 8, t, mode),
                        _ => measure::<half::bf16>(cfg, micro, 8, t, mode),
                    };
                    let e = estimate_step(&cfg, micro, t, mode, precision, 8 / micro, false);
                    let err = (e.peak_allocated as f64 - measured as f64).abs() / measured as f64;
                    rows.push(format!(
                        "L{} C{} {precision:?} {mode:?} mb{micro}: predicted {} measured {} ({:+.2}%) at {}",
                        cfg.n_layer,
                        cfg.n_embd,
                        format_bytes(e.peak_allocated),
                        format_bytes(measured),
                        err * 100.0,
                        e.peak_at
                    ));
                    assert!(err < 0.05, "{}", rows.last().unwrap());
                    assert_eq!([e.params, e.grads, e.optimizer], static_peaks, "static categories are exact");
                }
            }
        }
        assert!(rows.len() >= 24);
        println!("{}", rows.join("\n"));
    }

    #[test]
    fn knobs_lower_the_estimate() {
        let cfg = GptConfig { n_layer: 4, n_head: 4, n_embd: 128, block_size: 128, vocab: 256 };
        let none = estimate_step(&cfg, 16, 128, Checkpointing::None, Precision::Fp32, 1, false);
        let sel = estimate_step(&cfg, 16, 128, Checkpointing::Selective, Precision::Fp32, 1, false);
        let full = estimate_step(&cfg, 16, 128, Checkpointing::Full, Precision::Fp32, 1, false);
        let small = estimate_step(&cfg, 4, 128, Checkpointing::Full, Precision::Fp32, 4, false);
        let bf16 = estimate_step(&cfg, 16, 128, Checkpointing::None, Precision::Bf16, 1, false);
        assert!(none.activations > sel.activations && sel.activations > full.activations);
        assert!(bf16.activations < none.activations * 6 / 10, "bf16 roughly halves activations");
        assert_eq!(bf16.params * 2, none.params);
        assert_eq!(bf16.optimizer, none.optimizer * 3 / 2, "fp32 master weights join the moments");
        let off = estimate_step(&cfg, 16, 128, Checkpointing::None, Precision::Bf16, 1, true);
        assert_eq!((off.optimizer, off.host_optimizer), (0, 16 * cfg.num_params()));
        assert!(small.peak_allocated < full.peak_allocated);
        assert_eq!(verdict(&none, none.reserved_allowance), "yes");
        assert_eq!(
            verdict(&none, none.peak_allocated),
            if none.reserved_allowance > none.peak_allocated { "tight" } else { "yes" }
        );
        assert_eq!(verdict(&none, none.peak_allocated - 1), "no");
    }
}
