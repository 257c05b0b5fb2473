//! The step-time model the planner ranks configurations by: one optimizer step's seconds from
//! the model's FLOPs (recomputation included) at a rate that grows with the rows a matmul sees,
//! its elementwise work, a fixed cost per layer and pass (kernel launches, op dispatch), the
//! optimizer's pass over its state (on the device or the host) and the bytes offload and ranks
//! move. Pure; a device kind's constants are [`DeviceSpeed::default_for`], and the supervisor
//! scales the result by what its database measured on that device (`calibration`).
//!
//! Terms, per rank and optimizer step (B micro-batch, T sequence, C width, L layers, V vocab,
//! n parameters, e storage bytes, A accumulation steps):
//! - matmuls: forward 2·B·T·(12·L·C² + C·V) + attention 2·L·B·T²·C, backward twice that,
//!   full checkpointing one more forward of the blocks (selective: their attention);
//!   at `flops × rows / (rows + half_rate_rows)` with rows = B·T;
//! - elementwise: ~40·B·T·C + 3·B·H·T² elements per layer and pass;
//! - passes: L × (2, or 3 when recomputing) × `per_layer_pass_s`;
//! - optimizer: 32 bytes per local parameter at the device's or the host's optimizer bandwidth;
//! - offload: optimizer (gradients down under the last backward, weights up beside the host
//!   update; delayed: the update under the next step, weights up after it), params (weights up twice
//!   per micro-step, overlapped with compute), activations (block inputs down and up per
//!   micro-step, overlapped); ranks: gradient all-reduce, ZeRO-3's gathers per pass.

use serde::Serialize;

use crate::config::{Checkpointing, DeviceKind, Knobs, Precision};
use crate::engine::model::GptConfig;

/// A device's speed constants (one per device kind; the planner calibrates their product).
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct DeviceSpeed {
    /// Saturated matmul FLOP/s with 32-bit storage.
    pub flops_fp32: f64,
    /// Saturated matmul FLOP/s with 16-bit storage (bf16/fp16).
    pub flops_16bit: f64,
    /// Rows (micro-batch × sequence) at which a matmul runs at half its saturated rate.
    pub half_rate_rows: f64,
    /// Elementwise elements per second (LayerNorm, GELU, softmax, residuals).
    pub elementwise_per_s: f64,
    /// Fixed seconds per layer and pass (launches, dispatch, synchronisation).
    pub per_layer_pass_s: f64,
    /// Bytes/s of the optimizer's pass over device-resident state, and over host state.
    pub device_optimizer_bw: f64,
    pub host_optimizer_bw: f64,
    /// Bytes/s between device and host memory.
    pub link_bw: f64,
    /// Bytes/s of a collective between ranks.
    pub collective_bw: f64,
    /// Ranks share this device's compute (the cpu device: ranks are threads on its cores).
    pub ranks_share_compute: bool,
    /// Copies ahead run beside compute (a GPU's copy engine); on the cpu device they take the
    /// same cores and memory bandwidth, so they add to the step.
    pub copies_overlap: bool,
}

impl DeviceSpeed {
    /// The constants of a device kind before any calibration. cpu: fitted to `headroom bench
    /// --plan` runs of the demo model on a 2-core machine (16-bit storage converts every
    /// element, so it is slower there); cuda: an H100/H200-class GPU (cuBLAS bf16 on tensor
    /// cores, ~20 kernels per layer and pass, PCIe-class host link).
    pub fn default_for(kind: DeviceKind) -> DeviceSpeed {
        match kind {
            DeviceKind::Cpu => DeviceSpeed {
                flops_fp32: 120e9,
                flops_16bit: 56e9,
                half_rate_rows: 160.0,
                elementwise_per_s: 3e9,
                per_layer_pass_s: 10e-6,
                device_optimizer_bw: 5e9,
                host_optimizer_bw: 1.2e9,
                link_bw: 5e9,
                collective_bw: 5e9,
                ranks_share_compute: true,
                copies_overlap: false,
            },
            DeviceKind::Cuda => DeviceSpeed {
                flops_fp32: 40e12,
                flops_16bit: 200e12,
                half_rate_rows: 1024.0,
                elementwise_per_s: 200e9,
                per_layer_pass_s: 100e-6,
                device_optimizer_bw: 1.5e12,
                host_optimizer_bw: 12e9,
                link_bw: 20e9,
                collective_bw: 100e9,
                ranks_share_compute: false,
                copies_overlap: true,
            },
        }
    }
}

/// One configuration's predicted step, by term.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct StepTime {
    /// Matmul and elementwise seconds of the forward and backward passes (recomputation
    /// excluded), launches included.
    pub compute_s: f64,
    /// What checkpointing's recomputation adds.
    pub recompute_s: f64,
    /// The optimizer's pass over its state.
    pub optimizer_s: f64,
    /// Copies and collectives not hidden behind compute.
    pub transfer_s: f64,
    pub step_s: f64,
    /// Tokens of the whole global batch per second.
    pub tokens_per_s: f64,
}

/// The predicted step of `cfg` under `k` on a device with `speed`.
pub fn step_time(cfg: &GptConfig, k: &Knobs, speed: &DeviceSpeed) -> StepTime {
    let (b, t, c) = (k.micro_batch as f64, k.seq_len as f64, cfg.n_embd as f64);
    let (v, h) = (cfg.padded_vocab() as f64, cfg.n_head as f64); // the classifier runs over the padded rows
    let l = (cfg.n_layer as f64 / k.pipeline_parallel.max(1) as f64).ceil();
    // Under tensor parallelism a rank computes 1/tp of each block and holds its share of the
    // weights; ZeRO and the gradients' collective run over the data-parallel ranks.
    let tp = k.tensor_parallel.max(1) as f64;
    // Pipeline stages: a stage computes its share of the layers (the last also the head, the
    // slowest stage), GPipe runs grad_accum + stages − 1 micro-steps of it (the bubble), and
    // each micro-batch crosses every boundary twice (activations, their gradients).
    let pp = k.pipeline_parallel.max(1) as f64;
    // The parameters a rank holds: its tensor-parallel share of the largest stage.
    let shard = cfg.whole().with_tp(crate::engine::model::TpShard { rank: 0, size: k.tensor_parallel.max(1) });
    let stages = k.pipeline_parallel.max(1);
    let n = (0..stages)
        .map(|stage| shard.with_pp(crate::engine::model::PpStage { stage, stages }).num_params())
        .max()
        .unwrap_or(0) as f64;
    let world = k.data_parallel() as f64;
    let e = match k.precision {
        Precision::Fp32 => 4.0,
        Precision::Bf16 | Precision::Fp16 => 2.0,
    };
    let rows = b * t;
    let peak = match k.precision {
        Precision::Fp32 => speed.flops_fp32,
        Precision::Bf16 | Precision::Fp16 => speed.flops_16bit,
    };
    let rate = peak * rows / (rows + speed.half_rate_rows);
    // One forward pass of one micro-batch.
    let block_matmul = 2.0 * rows * 12.0 * c * c / tp;
    let block_attention = 2.0 * b * t * t * c / tp;
    let head = 2.0 * rows * c * v;
    let block_elementwise = 40.0 * rows * c + 3.0 * b * h * t * t / tp;
    let block_pass = |flops: f64, elems: f64| flops / rate + elems / speed.elementwise_per_s + speed.per_layer_pass_s;
    let forward = l * block_pass(block_matmul + block_attention, block_elementwise) + head / rate;
    // Backward computes the scores again (attention keeps only their log-sum-exp): half the
    // forward's attention products on top of twice them.
    let backward =
        l * block_pass(2.5 * block_attention + 2.0 * block_matmul, 2.0 * block_elementwise) + 2.0 * head / rate;
    let recompute = match k.checkpointing {
        Checkpointing::None => 0.0,
        Checkpointing::Selective => l * block_pass(block_attention, 3.0 * b * h * t * t),
        Checkpointing::Full => l * block_pass(block_matmul + block_attention, block_elementwise),
    };
    let accum = k.grad_accum.max(1) as f64;
    let share = if speed.ranks_share_compute { world * tp * pp } else { 1.0 };
    // On shared cores the other stages compute during a stage's bubble; on devices of their
    // own each stage waits through it.
    let micro_steps = if speed.ranks_share_compute { accum } else { accum + pp - 1.0 };
    // Copies a micro-step overlaps with its compute: offloaded weights (up for the forward and
    // for the backward) and offloaded block inputs (down, then up).
    let weights_local = if k.zero_stage >= 3 { n / world } else { n };
    let mut overlapped = 0.0;
    if k.offload_params {
        overlapped += 2.0 * weights_local * e / speed.link_bw;
    }
    if k.offload_activations != crate::config::OffloadTarget::None {
        overlapped += 2.0 * l * rows * c * e / speed.link_bw;
    }
    if k.zero_stage >= 3 && world > 1.0 {
        overlapped += 2.0 * n * e / speed.collective_bw;
    }
    // Tensor parallelism: two sums of a (B·T, C) tensor per block in forward, two in backward,
    // two more for a fully recomputed forward; the next op waits for each.
    let tp_sums = match k.checkpointing {
        Checkpointing::Full => 6.0,
        _ => 4.0,
    };
    let tp_exposed = if tp > 1.0 { tp_sums * l * 2.0 * rows * c * e / speed.collective_bw } else { 0.0 };
    let micro_compute = (forward + backward) * share;
    let micro_recompute = recompute * share;
    let hidden_excess =
        if speed.copies_overlap { (overlapped - micro_compute - micro_recompute).max(0.0) } else { overlapped };
    // Once per step: the optimizer over the state this rank holds, its copies, the gradients'
    // collective.
    let state_local = if k.zero_stage >= 1 { n / world } else { n };
    let compute_s = micro_steps * micro_compute;
    let recompute_s = micro_steps * micro_recompute;
    let mut optimizer_s = if k.offload_optimizer {
        32.0 * state_local / speed.host_optimizer_bw
    } else {
        32.0 * state_local / speed.device_optimizer_bw
    } * share;
    let mut step_transfer = 0.0;
    if k.offload_optimizer {
        let one_way = state_local * e / speed.link_bw;
        if world == 1.0 && speed.copies_overlap {
            // Gradients stream down under the last backward pass; weights go up chunk by chunk
            // beside the update — or, delayed, the update runs under the next step's compute
            // and its weights go up after it.
            step_transfer += (one_way - backward * share).max(0.0);
            if k.delayed_update {
                optimizer_s = (optimizer_s - compute_s - recompute_s).max(0.0);
                step_transfer += one_way;
            } else {
                step_transfer += (one_way - optimizer_s).max(0.0);
            }
        } else {
            step_transfer += 2.0 * one_way;
        }
    }
    if world > 1.0 {
        step_transfer += 2.0 * n * e / speed.collective_bw;
    }
    let pp_exposed = if pp > 1.0 { 2.0 * rows * c * e / speed.collective_bw } else { 0.0 };
    let transfer_s = accum * (hidden_excess + tp_exposed + pp_exposed) + step_transfer;
    let step_s = compute_s + recompute_s + optimizer_s + transfer_s;
    let tokens = accum * rows * world;
    StepTime { compute_s, recompute_s, optimizer_s, transfer_s, step_s, tokens_per_s: tokens / step_s }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::model::{PpStage, TpShard};

    const DEMO: GptConfig = GptConfig {
        n_layer: 2,
        n_head: 4,
        n_embd: 64,
        block_size: 64,
        vocab: 256,
        tp: TpShard::NONE,
        pp: PpStage::NONE,
    };
    const XL: GptConfig = GptConfig {
        n_layer: 48,
        n_head: 25,
        n_embd: 1600,
        block_size: 1024,
        vocab: 50257,
        tp: TpShard::NONE,
        pp: PpStage::NONE,
    };

    fn knobs(micro: usize, global: usize, t: usize) -> Knobs {
        Knobs::plain(micro, t, global / micro)
    }

    #[test]
    fn each_term_moves_the_step_the_way_the_engine_does() {
        let cpu = DeviceSpeed::default_for(DeviceKind::Cpu);
        let cuda = DeviceSpeed::default_for(DeviceKind::Cuda);
        let tps = |cfg: &GptConfig, k: &Knobs, s: &DeviceSpeed| step_time(cfg, k, s).tokens_per_s;
        let base = knobs(32, 32, 64);
        let with = |f: &dyn Fn(&mut Knobs)| {
            let mut k = base;
            f(&mut k);
            k
        };
        // (case, faster configuration, slower one, device)
        let cases: Vec<(&str, Knobs, Knobs, &DeviceSpeed)> = vec![
            ("larger micro-batches amortise launches and fill matmuls", base, knobs(4, 32, 64), &cpu),
            ("on cuda even more so", base, knobs(4, 32, 64), &cuda),
            ("recomputation costs", base, with(&|k| k.checkpointing = Checkpointing::Full), &cpu),
            (
                "selective recomputes less than full",
                with(&|k| k.checkpointing = Checkpointing::Selective),
                with(&|k| k.checkpointing = Checkpointing::Full),
                &cpu,
            ),
            ("16-bit storage converts on the cpu", base, with(&|k| k.precision = Precision::Bf16), &cpu),
            ("and runs on tensor cores on cuda", with(&|k| k.precision = Precision::Bf16), base, &cuda),
            ("a host optimizer is slower", base, with(&|k| k.offload_optimizer = true), &cpu),
            (
                "offloaded weights cost what a small micro-batch's compute does not hide",
                knobs(1, 8, 64),
                Knobs { offload_params: true, ..knobs(1, 8, 64) },
                &cuda,
            ),
            (
                "on one cpu a tensor-parallel split does the same work and adds its sums (measured: 8.6k vs 7.1k)",
                Knobs { world_size: 2, grad_accum: 1, ..knobs(16, 32, 64) },
                Knobs { world_size: 2, tensor_parallel: 2, grad_accum: 2, ..knobs(16, 32, 64) },
                &cpu,
            ),
            (
                "on GPUs of their own two stages each compute half the layers, less the bubble",
                Knobs { world_size: 2, pipeline_parallel: 2, grad_accum: 8, ..knobs(4, 32, 64) },
                knobs(4, 32, 64),
                &cuda,
            ),
            (
                "and more micro-batches of the same size shrink the bubble (8/9 busy vs 2/3)",
                Knobs { world_size: 2, pipeline_parallel: 2, ..knobs(4, 32, 64) },
                Knobs { world_size: 2, pipeline_parallel: 2, ..knobs(4, 8, 64) },
                &cuda,
            ),
            (
                "on GPUs of their own a split's ranks each compute half",
                Knobs { world_size: 2, tensor_parallel: 2, grad_accum: 2, ..knobs(16, 32, 64) },
                knobs(16, 32, 64),
                &cuda,
            ),
        ];
        for (name, fast, slow, speed) in cases {
            let cfg = if std::ptr::eq(speed, &cuda) { XL } else { DEMO };
            let (f, s) = (tps(&cfg, &fast, speed), tps(&cfg, &slow, speed));
            assert!(f > s, "{name}: {f:.0} vs {s:.0} tokens/s");
        }
    }

    #[test]
    fn a_host_optimizer_bound_step_barely_cares_about_the_micro_batch() {
        // The XL case with its optimizer on the host: the host pass over 1.48B parameters'
        // state dominates, so micro-batch 8 is within a few percent of micro-batch 1 — and on
        // the device, without offload, micro-batch 8 is clearly faster.
        let cuda = DeviceSpeed::default_for(DeviceKind::Cuda);
        let offloaded = |m: usize| {
            let mut k = knobs(m, 8, 1024);
            k.precision = Precision::Bf16;
            k.checkpointing = Checkpointing::Full;
            k.offload_optimizer = true;
            step_time(&XL, &k, &cuda)
        };
        let (one, eight) = (offloaded(1), offloaded(8));
        assert!(one.optimizer_s > one.compute_s + one.recompute_s, "{one:?}");
        assert!(eight.tokens_per_s / one.tokens_per_s < 1.5, "{one:?} {eight:?}");
        let on_device = |m: usize| {
            let mut k = knobs(m, 8, 1024);
            k.precision = Precision::Bf16;
            step_time(&XL, &k, &cuda).tokens_per_s
        };
        assert!(on_device(8) / on_device(1) > 1.2, "{} vs {}", on_device(8), on_device(1));
    }

    /// A pipeline stage updates only the parameters it holds: about half of XL's at 2 stages.
    #[test]
    fn a_stage_optimizes_only_its_share() {
        let cuda = DeviceSpeed::default_for(DeviceKind::Cuda);
        let one = step_time(&XL, &knobs(4, 32, 64), &cuda).optimizer_s;
        let staged = Knobs { world_size: 2, pipeline_parallel: 2, ..knobs(4, 32, 64) };
        let two = step_time(&XL, &staged, &cuda).optimizer_s;
        assert!((0.45..0.55).contains(&(two / one)), "optimizer time at 2 stages / 1: {}", two / one);
    }

    #[test]
    fn terms_add_up_and_tokens_are_the_global_batch() {
        let cpu = DeviceSpeed::default_for(DeviceKind::Cpu);
        let mut k = knobs(8, 32, 64);
        k.offload_optimizer = true;
        k.checkpointing = Checkpointing::Full;
        let s = step_time(&DEMO, &k, &cpu);
        let sum = s.compute_s + s.recompute_s + s.optimizer_s + s.transfer_s;
        assert!((s.step_s - sum).abs() < 1e-12 && s.recompute_s > 0.0 && s.transfer_s > 0.0, "{s:?}");
        assert!((s.tokens_per_s * s.step_s - 32.0 * 64.0).abs() < 1e-6, "{s:?}");
    }
}
