//! The analytic memory model behind `headroom estimate`: peak device bytes per category for a
//! job's configuration, derived from the model's own size tables and the pool's rounding, so the
//! prediction follows the engine whenever a tensor changes.
//!
//! A training step's allocated bytes peak at one of three moments:
//! - **backward start**: every kept activation, the head's outputs and all backward workspace;
//! - **first block of backward** (checkpointing): the kept activations plus that block's
//!   recomputed tensors (the logits are freed by then);
//! - **forward / evaluation**: the transient full activations of the block being computed.
//!
//! (The gradient norm's moment — model state plus a reduction's partial sums — is a candidate
//! too, so every op's declared scratch is counted, though it never sets the peak in practice.)

use serde::Serialize;

pub mod inference;
pub mod step_time;

use crate::config::{JobSpec, Knobs, OffloadTarget, Precision};
use crate::memory::{block_bytes, Category, LARGE_ROUND, SMALL_LIMIT, SMALL_SEGMENT};

use crate::engine::backend::layers::Elem;
use crate::engine::backend::workspace::WorkspaceModel;
use crate::engine::model::{
    activation_width, backward_workspace_sizes, block_backward_scratch, block_forward_scratch, global_activation_sizes,
    head_backward_scratch, head_forward_scratch, kept_in, layer_activation_sizes, GptConfig, PpStage, TpShard,
};
use crate::engine::train::trainer::gpt_config;

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
    /// An allowance for `peak_reserved`: the live set at the peak placed in the pool's segments
    /// (large blocks rounded to 2 MiB, small ones packed first-fit into 2 MiB segments). Blocks
    /// freed earlier in the step can leave more segments cached than this.
    pub reserved_allowance: usize,
    /// Which moment sets the peak.
    pub peak_at: &'static str,
    pub micro_batch: usize,
    pub grad_accum: usize,
    /// Host bytes of offloaded optimizer state (not device memory).
    pub host_optimizer: usize,
    /// Host bytes of offloaded weights (not device memory).
    pub host_params: usize,
    /// Whose op workspace declarations the prediction used (the job's device kind).
    pub workspace_model: WorkspaceModel,
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
        self.buffers.iter().map(|&(_, b)| block_bytes(b)).sum()
    }
    fn of(&self, c: Category) -> usize {
        self.buffers.iter().filter(|b| b.0 == c).map(|&(_, b)| block_bytes(b)).sum()
    }
    /// With fixed segments each large block sits in a segment of its own, rounded to
    /// [`LARGE_ROUND`]; with expandable segments large blocks are packed back to back into
    /// 2 MiB pages, one more page for a run that straddles page boundaries.
    fn reserved_allowance(&self, expandable: bool) -> usize {
        let mut small = Vec::new();
        let mut large = 0;
        for &(_, b) in &self.buffers {
            let r = block_bytes(b);
            if r <= SMALL_LIMIT {
                small.push(r);
            } else if expandable {
                large += r;
            } else {
                large += r.div_ceil(LARGE_ROUND) * LARGE_ROUND;
            }
        }
        if expandable && large > 0 {
            large = large.div_ceil(LARGE_ROUND) * LARGE_ROUND + LARGE_ROUND;
        }
        // Small blocks never share a segment with large ones and are not split across
        // segments: pack them first-fit decreasing into 2 MiB segments.
        small.sort_unstable_by(|a, b| b.cmp(a));
        let mut segments: Vec<usize> = Vec::new();
        for r in small {
            match segments.iter_mut().find(|free| **free >= r) {
                Some(free) => *free -= r,
                None => segments.push(SMALL_SEGMENT - r),
            }
        }
        large + segments.len() * SMALL_SEGMENT
    }
}

/// Peak allocated bytes of one training step (plus evaluation) for this model and knobs.
/// The peak of one configuration on the cpu backend.
pub fn estimate_step(cfg: &GptConfig, k: &Knobs) -> Estimate {
    estimate_on(WorkspaceModel::Cpu, cfg, k)
}

/// The peak of one configuration on the backend whose workspace declarations `model` names.
pub fn estimate_on(model: WorkspaceModel, cfg: &GptConfig, k: &Knobs) -> Estimate {
    match k.precision {
        Precision::Fp32 => estimate_for::<f32>(model, cfg, k),
        Precision::Bf16 => estimate_for::<half::bf16>(model, cfg, k),
        Precision::Fp16 => estimate_for::<half::f16>(model, cfg, k),
    }
}

fn estimate_for<E: Elem>(model: WorkspaceModel, cfg: &GptConfig, k: &Knobs) -> Estimate {
    // A rank's share of the model under tensor parallelism (every tensor-parallel rank holds
    // the same amount), ZeRO-sharded over the data-parallel ranks; with pipeline stages, the
    // stage whose peak is highest.
    let shard = cfg.whole().with_tp(TpShard { rank: 0, size: k.tensor_parallel.max(1) });
    let stages = k.pipeline_parallel.max(1);
    (0..stages)
        .map(|stage| estimate_stage::<E>(model, &shard.with_pp(PpStage { stage, stages }), k))
        .rev()
        .max_by_key(|e| e.peak_allocated)
        .expect("at least one stage")
}

/// The peak of one pipeline stage (`cfg.pp`; all of the model with one stage). GPipe keeps
/// every micro-batch's activations from its forward to its backward: the other micro-batches'
/// kept sets are live beside the one in flight.
fn estimate_stage<E: Elem>(model: WorkspaceModel, cfg: &GptConfig, k: &Knobs) -> Estimate {
    let Knobs { micro_batch, seq_len, grad_accum, checkpointing: mode, offload_optimizer, .. } = *k;
    let offload_activations = k.offload_activations != OffloadTarget::None;
    let (first, last, n_layer) = (cfg.pp.is_first(), cfg.pp.is_last(), cfg.stage_layers().len());
    let n = cfg.num_params();
    let world = k.data_parallel();
    let stage = if world > 1 { k.zero_stage } else { 0 };
    let state_len = if stage >= 1 { n.div_ceil(world) } else { n };
    let params_len = if stage >= 3 { state_len } else { n };
    let grads_len = if stage >= 2 { state_len } else { n };
    // Transient workspace of the placement (see `placement`): weights staged on the device for
    // the segment in use (gathered under ZeRO-3, copied from the host under offload.params,
    // the next segment copied ahead when not sharded), and ZeRO-2/3 gradient reduce buckets.
    let transient = |present: bool| {
        move |live: &mut Live, elems: usize| {
            if present {
                live.add(Category::Workspace, elems * E::BYTES)
            }
        }
    };
    let weights = transient(stage >= 3 || k.offload_params);
    let ahead = transient(k.offload_params && stage < 3);
    let bucket = transient(stage >= 2);
    let wte = if first || last { cfg.wte_range().len() } else { 0 };
    let (embed, block) = (if first { cfg.embed_range().len() } else { 0 }, cfg.layer_params());
    // With activation offload (full checkpointing) at most one kept block output is on the
    // device at any moment; the others are in host memory.
    let on_device = |kept_layers: usize| if offload_activations { kept_layers.min(1) } else { kept_layers };
    let (b, t) = (micro_batch, seq_len);
    let mut base = Live::default();
    if !k.offload_params {
        base.add(Category::Params, params_len * E::BYTES);
    }
    base.add(Category::Grads, grads_len * E::BYTES);
    // Offloaded: master weights and moments (3 × 4 bytes per parameter) and the staging of
    // gradients in and weights out (the storage type) on the host.
    // The delayed update (one rank) lands the next step's gradients beside the update: a
    // second link buffer.
    let link_buffers = if k.delayed_update && k.world_size <= 1 { 2 } else { 1 };
    let host_optimizer = if offload_optimizer { (12 + link_buffers * E::BYTES) * state_len } else { 0 };
    let host_params = if k.offload_params { params_len * E::BYTES } else { 0 };
    if !offload_optimizer {
        if !E::is_f32() {
            base.add(Category::Optimizer, state_len * 4); // fp32 master weights
        }
        base.add(Category::Optimizer, state_len * 4);
        base.add(Category::Optimizer, state_len * 4);
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
    // A stage before the last has no head: its globals are the tokens and its input.
    let globals_here = if last { &globals[..] } else { &globals[..3] };
    let add_globals = |live: &mut Live, skip_logits: bool| {
        for &(name, elems) in globals_here {
            if !(skip_logits && name == "logits") {
                act(live, name, elems);
            }
        }
    };
    // Pipeline stages (GPipe): the other micro-batches' kept activations, each with its own
    // tokens, input and (last stage) head outputs.
    let in_flight = if cfg.pp.stages > 1 { grad_accum.saturating_sub(1) } else { 0 };
    let kept_in_mode = |name: &str| kept_in(mode, name);
    let add_others = |live: &mut Live| {
        for _ in 0..in_flight {
            add_globals(live, false);
            for _ in 0..n_layer {
                add_layer(live, &kept_in_mode);
            }
        }
    };
    let add_scratch = |live: &mut Live, scratch: Vec<usize>| {
        for bytes in scratch {
            live.add(Category::Workspace, bytes);
        }
    };
    // The backward pass's gradient buffers, and the scratch of the op running at the moment
    // (each backend's declarations: `backend::workspace`).
    let add_workspace = |live: &mut Live, scratch: Vec<usize>| {
        for (_, elems) in backward_workspace_sizes(cfg, b, t) {
            live.add(Category::Workspace, elems * E::BYTES);
        }
        add_scratch(live, scratch);
    };
    let kept = |name: &str| kept_in(mode, name);
    let all = |_: &str| true;
    let mut candidates: Vec<(&'static str, Live)> = Vec::new();
    // With pipeline stages every moment below also holds the other micro-batches' kept sets.
    let state_only = base.clone();
    let base = {
        let mut b = base;
        add_others(&mut b);
        b
    };

    // Backward start (the classifier's backward): everything kept, head outputs, all workspace,
    // the tied embedding's weights and gradient bucket.
    let mut start = base.clone();
    add_globals(&mut start, false);
    for _ in 0..on_device(n_layer) {
        add_layer(&mut start, &kept);
    }
    let head_scratch = if last { head_backward_scratch::<E>(model, cfg, b, t) } else { Vec::new() };
    add_workspace(&mut start, head_scratch);
    weights(&mut start, wte);
    bucket(&mut start, wte);
    candidates.push(("backward start", start));

    // Last block's backward: its kept part is rebuilt to the full set; the logits are gone.
    if n_layer > 0 {
        let mut rec = base.clone();
        add_globals(&mut rec, true);
        // With offload: this block's restored input plus the next one being prefetched.
        let kept_layers = if offload_activations { (n_layer - 1).min(2) } else { n_layer - 1 };
        for _ in 0..kept_layers {
            add_layer(&mut rec, &kept);
        }
        add_layer(&mut rec, &all);
        add_workspace(&mut rec, block_backward_scratch::<E>(model, cfg, b, t));
        weights(&mut rec, block);
        if n_layer > 1 {
            ahead(&mut rec, block);
        }
        bucket(&mut rec, block);
        candidates.push(("block backward", rec));
    }

    // Encoder backward: the blocks are done; the embeddings' gradient bucket is live.
    if first {
        let mut enc = base.clone();
        add_globals(&mut enc, true);
        add_workspace(&mut enc, model.encoder_backward(b * t));
        bucket(&mut enc, embed);
        candidates.push(("encoder backward", enc));
    }

    // Gradient norm: the model state and the reduction's scratch over the (local) gradients.
    let mut norm = state_only;
    add_scratch(&mut norm, model.sum_squares::<E>(grads_len));
    candidates.push(("gradient norm", norm));

    // Forward: the encoder (embedding weights staged, block 0 copied ahead), each block (the
    // earlier ones kept, this one in full, the next one copied ahead), and the head (every
    // block kept, lnf and the logits, the classifier matmul's scratch, `wte` staged).
    let mut fwd = base.clone();
    for &(name, elems) in globals.iter().take(3) {
        act(&mut fwd, name, elems);
    }
    let mut encoder = fwd.clone();
    weights(&mut encoder, embed);
    if n_layer > 0 {
        ahead(&mut encoder, block);
    }
    candidates.push(("forward encoder", encoder));
    let mut head = fwd.clone();
    for l in 0..n_layer {
        let mut at = fwd.clone();
        for _ in 0..on_device(l) {
            add_layer(&mut at, &kept);
        }
        add_layer(&mut at, &all);
        add_scratch(&mut at, block_forward_scratch::<E>(model, cfg, b, t));
        weights(&mut at, block);
        if l + 1 < n_layer {
            ahead(&mut at, block);
        }
        candidates.push(("forward", at));
    }
    if last {
        for _ in 0..on_device(n_layer) {
            add_layer(&mut head, &kept);
        }
        for &(name, elems) in globals.iter().skip(3).take(4) {
            act(&mut head, name, elems);
        }
        add_scratch(&mut head, head_forward_scratch::<E>(model, cfg, b, t));
        weights(&mut head, wte);
        candidates.push(("forward head", head));
    }

    // The first of equal candidates wins, so the reported moment is stable.
    let (peak_at, live) = candidates.into_iter().rev().max_by_key(|(_, l)| l.total()).expect("candidates");
    Estimate {
        params: live.of(Category::Params),
        grads: live.of(Category::Grads),
        optimizer: live.of(Category::Optimizer),
        activations: live.of(Category::Activations),
        workspace: live.of(Category::Workspace),
        peak_allocated: live.total(),
        // The static allocator packs each step into an arena of its live peak and sizes every
        // other segment exactly (the pool releases cached segments before it would fail).
        reserved_allowance: if k.static_allocator {
            live.total()
        } else {
            live.reserved_allowance(k.expandable_segments)
        },
        peak_at,
        micro_batch,
        grad_accum,
        host_optimizer,
        host_params,
        workspace_model: model,
    }
}

/// The peak of a job as configured, on its device kind's backend.
pub fn estimate_job(spec: &JobSpec) -> Estimate {
    let mut e = estimate_on(WorkspaceModel::of(spec.device.kind), &gpt_config(spec), &spec.knobs());
    // `device.reserve` holds its share of the capacity from the start, used or not.
    if let (Some(fraction), Some(capacity)) = (spec.device.reserve, spec.device_capacity()) {
        let reserve = ((capacity as f64 * fraction) as usize).div_ceil(LARGE_ROUND) * LARGE_ROUND;
        e.reserved_allowance = e.reserved_allowance.max(reserve);
    }
    e
}

/// The predicted step of a job as configured, with its device kind's uncalibrated constants.
pub fn step_time_job(spec: &JobSpec) -> step_time::StepTime {
    let speed = step_time::DeviceSpeed::default_for(spec.device.kind);
    step_time::step_time(&gpt_config(spec), &spec.knobs(), &speed)
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
    use crate::config::Checkpointing;
    use crate::engine::model::{PpStage, TpShard};
    use crate::engine::rng::mix64;
    use crate::engine::train::trainer::{Hyper, Trainer};
    use crate::memory::{format_bytes, Pool};

    /// Measured peak of one optimizer step and one evaluation pass.
    fn measure<E: Elem>(
        cfg: GptConfig,
        micro: usize,
        global: usize,
        t: usize,
        mode: Checkpointing,
    ) -> (usize, [usize; 3]) {
        measure_offload::<E>(cfg, micro, global, t, mode, false, OffloadTarget::None)
    }

    fn measure_offload<E: Elem>(
        cfg: GptConfig,
        micro: usize,
        global: usize,
        t: usize,
        mode: Checkpointing,
        offload_optimizer: bool,
        offload_activations: OffloadTarget,
    ) -> (usize, [usize; 3]) {
        let hyper = Hyper {
            knobs: Knobs {
                micro_batch: micro,
                grad_accum: global / micro,
                seq_len: t,
                checkpointing: mode,
                offload_optimizer,
                offload_params: false,
                offload_activations,
                delayed_update: false,
                world_size: 1,
                tensor_parallel: 1,
                pipeline_parallel: 1,
                zero_stage: 0,
                precision: crate::config::Precision::Fp32,
                expandable_segments: false,
                static_allocator: false,
            },
            steps: 2,
            global_batch: global,
            lr: 1e-3,
            warmup_steps: 0,
            weight_decay: 0.1,
            grad_clip: 1.0,
            seed: 1,
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
    fn the_static_allocator_and_a_reserve_change_the_reserved_allowance_not_the_peak() {
        let spec = JobSpec::parse(&crate::config::tests::EXAMPLE.replace("512MiB", "64MiB")).unwrap();
        let plain = estimate_job(&spec);
        assert!(plain.reserved_allowance > plain.peak_allocated, "caching: segments round up");
        let mut static_ = spec.clone();
        static_.memory.allocator = crate::config::Allocator::Static;
        let s = estimate_job(&static_);
        assert_eq!((s.peak_allocated, s.reserved_allowance), (plain.peak_allocated, plain.peak_allocated));
        let mut reserved = spec.clone();
        reserved.device.reserve = Some(0.9);
        let r = estimate_job(&reserved);
        assert_eq!(r.peak_allocated, plain.peak_allocated);
        assert!(r.reserved_allowance >= (64 << 20) * 9 / 10, "{}", r.reserved_allowance);
    }

    #[test]
    fn estimates_match_the_pool_within_five_percent_over_a_grid() {
        let models = [
            GptConfig {
                n_layer: 2,
                n_head: 4,
                n_embd: 64,
                block_size: 64,
                vocab: 256,
                tp: TpShard::NONE,
                pp: PpStage::NONE,
            },
            GptConfig {
                n_layer: 3,
                n_head: 2,
                n_embd: 32,
                block_size: 32,
                vocab: 512,
                tp: TpShard::NONE,
                pp: PpStage::NONE,
            },
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
                    let e = estimate_step(
                        &cfg,
                        &Knobs {
                            checkpointing: mode,
                            precision,
                            offload_optimizer: false,
                            offload_params: false,
                            offload_activations: OffloadTarget::None,
                            ..Knobs::plain(micro, t, 8 / micro)
                        },
                    );
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
    fn offload_estimates_match_the_pool() {
        let cfg = GptConfig {
            n_layer: 3,
            n_head: 2,
            n_embd: 32,
            block_size: 32,
            vocab: 512,
            tp: TpShard::NONE,
            pp: PpStage::NONE,
        };
        for (precision, oo, oa) in [
            (Precision::Fp32, true, OffloadTarget::None),
            (Precision::Fp32, false, OffloadTarget::Cpu),
            (Precision::Bf16, false, OffloadTarget::CpuInt8),
            (Precision::Bf16, true, OffloadTarget::Cpu),
        ] {
            for micro in [2, 8] {
                let (measured, _) = match precision {
                    Precision::Fp32 => measure_offload::<f32>(cfg, micro, 8, 32, Checkpointing::Full, oo, oa),
                    _ => measure_offload::<half::bf16>(cfg, micro, 8, 32, Checkpointing::Full, oo, oa),
                };
                let knobs = Knobs {
                    checkpointing: Checkpointing::Full,
                    precision,
                    offload_optimizer: oo,
                    offload_params: false,
                    offload_activations: oa,
                    ..Knobs::plain(micro, 32, 8 / micro)
                };
                let e = estimate_step(&cfg, &knobs);
                let err = (e.peak_allocated as f64 - measured as f64).abs() / measured as f64;
                println!("{precision:?} opt-offload {oo} act-offload {oa:?} mb{micro}: predicted {} measured {measured} ({:+.2}%)", e.peak_allocated, err * 100.0);
                assert!(err < 0.05, "{precision:?} {oo} {oa:?} mb{micro}: {} vs {measured}", e.peak_allocated);
            }
        }
    }

    #[test]
    fn the_fused_cuda_attention_declares_less_workspace_and_the_estimate_follows() {
        use crate::engine::backend::workspace::CudaAttentionKernels;
        // GPT-2 124M's blocks at B 16, T 1024 with a small vocabulary: a block's backward, and
        // in it the attention's workspace, sets the peak.
        let cfg = GptConfig {
            n_layer: 2,
            n_head: 12,
            n_embd: 768,
            block_size: 1024,
            vocab: 256,
            tp: TpShard::NONE,
            pp: PpStage::NONE,
        };
        let fused = WorkspaceModel::Cuda(CudaAttentionKernels::Fused);
        for precision in [Precision::Bf16, Precision::Fp16, Precision::Fp32] {
            let knobs = Knobs { precision, ..Knobs::plain(16, 1024, 1) };
            let (a, b) = (estimate_on(WorkspaceModel::CUDA, &cfg, &knobs), estimate_on(fused, &cfg, &knobs));
            println!(
                "{precision:?}: cuBLAS path {} (workspace {}, at {}), fused {} (workspace {}, at {})",
                format_bytes(a.peak_allocated),
                format_bytes(a.workspace),
                a.peak_at,
                format_bytes(b.peak_allocated),
                format_bytes(b.workspace),
                b.peak_at
            );
            assert_eq!((a.params, a.grads, a.optimizer), (b.params, b.grads, b.optimizer));
            if precision == Precision::Fp32 {
                assert_eq!(a, Estimate { workspace_model: WorkspaceModel::CUDA, ..b }, "no fused kernels in fp32");
                continue;
            }
            // The cuBLAS path's backward scratch (head copies, f32 gradients, a chunk's (T,T)
            // matrices: 456 MiB in bf16) against D alone (768 KiB).
            let declared =
                |m: WorkspaceModel| m.attention_backward::<half::bf16>(16, 1024, 768, 12).iter().sum::<usize>();
            assert_eq!(declared(fused), 16 * 12 * 1024 * 4);
            assert!(declared(WorkspaceModel::CUDA) > 400 << 20);
            assert!(
                a.workspace >= declared(WorkspaceModel::CUDA),
                "the cuBLAS path's attention scratch is at the peak"
            );
            assert!(b.peak_allocated + (300 << 20) < a.peak_allocated, "{} vs {}", b.peak_allocated, a.peak_allocated);
        }
        assert_eq!(fused.name(), "cuda_fused_attention");
        assert_eq!(serde_json::to_string(&fused).unwrap(), "\"cuda_fused_attention\"");
        assert_eq!(serde_json::to_string(&WorkspaceModel::CUDA).unwrap(), "\"cuda\"");
    }

    #[test]
    fn knobs_lower_the_estimate() {
        let cfg = GptConfig {
            n_layer: 4,
            n_head: 4,
            n_embd: 128,
            block_size: 128,
            vocab: 256,
            tp: TpShard::NONE,
            pp: PpStage::NONE,
        };
        let est = |checkpointing, precision, micro, accum| {
            estimate_step(&cfg, &Knobs { checkpointing, precision, ..Knobs::plain(micro, 128, accum) })
        };
        let none = est(Checkpointing::None, Precision::Fp32, 16, 1);
        let sel = est(Checkpointing::Selective, Precision::Fp32, 16, 1);
        let full = est(Checkpointing::Full, Precision::Fp32, 16, 1);
        let small = est(Checkpointing::Full, Precision::Fp32, 4, 4);
        let bf16 = est(Checkpointing::None, Precision::Bf16, 16, 1);
        assert!(none.activations > sel.activations && sel.activations > full.activations);
        assert!(bf16.activations < none.activations * 6 / 10, "bf16 roughly halves activations");
        assert_eq!(bf16.params * 2, none.params);
        assert_eq!(bf16.optimizer, none.optimizer * 3 / 2, "fp32 master weights join the moments");
        let off = estimate_step(
            &cfg,
            &Knobs { precision: Precision::Bf16, offload_optimizer: true, ..Knobs::plain(16, 128, 1) },
        );
        assert_eq!((off.optimizer, off.host_optimizer), (0, 14 * cfg.num_params()));
        assert!(small.peak_allocated < full.peak_allocated);
        assert_eq!(verdict(&none, none.reserved_allowance), "yes");
        assert_eq!(
            verdict(&none, none.peak_allocated),
            if none.reserved_allowance > none.peak_allocated { "tight" } else { "yes" }
        );
        assert_eq!(verdict(&none, none.peak_allocated - 1), "no");
    }
}
