//! The estimator against a backend: each configuration trains two steps on a fresh pool and its
//! measured peak (allocated, reserved) is compared with `estimate_on` for that backend's
//! workspace declarations. Under-estimation is the failure that matters.

use crate::config::{Checkpointing, Knobs, OffloadTarget, Precision};
use crate::engine::backend::workspace::WorkspaceModel;
use crate::engine::backend::{Backend, Elem};
use crate::engine::estimate::{estimate_on, Estimate};
use crate::engine::model::{GptConfig, PpStage, TpShard};
use crate::engine::train::trainer::{Hyper, Trainer};
use crate::memory::format_bytes;

use super::train_parity::sequences;

/// One configuration to measure.
#[derive(Debug, Clone)]
pub struct EstimateCase {
    pub label: String,
    pub cfg: GptConfig,
    pub knobs: Knobs,
    /// The pool's capacity (None: the device's free memory).
    pub device_memory: Option<usize>,
}

impl EstimateCase {
    pub fn new(cfg: GptConfig, knobs: Knobs, device_memory: Option<usize>) -> EstimateCase {
        EstimateCase { label: label(&cfg, &knobs), cfg, knobs, device_memory }
    }
}

/// What was measured beside what was predicted.
#[derive(Debug, Clone)]
pub struct EstimateRow {
    pub case: EstimateCase,
    pub estimate: Estimate,
    /// (peak allocated, peak reserved), or why the run failed.
    pub measured: Result<(usize, usize), String>,
}

impl EstimateRow {
    /// (estimate − measured) / measured of the allocated peak.
    pub fn error(&self) -> Option<f64> {
        let (alloc, _) = *self.measured.as_ref().ok()?;
        Some((self.estimate.peak_allocated as f64 - alloc as f64) / alloc as f64)
    }

    /// Exact enough: never under by more than 0.5%, never over by more than 10%.
    pub fn passed(&self) -> bool {
        self.error().is_some_and(|e| (-0.005..=0.10).contains(&e))
    }
}

/// The grid gpu-check measures: precision × checkpointing × micro-batch × offload on a
/// GPT-2-small-like shape, plus the 1.5B (GPT-2 XL shape, bytes vocabulary) configurations the
/// seed's headline case reaches, on a 16 GiB budget.
pub fn grid() -> Vec<EstimateCase> {
    let small = GptConfig {
        n_layer: 12,
        n_head: 12,
        n_embd: 768,
        block_size: 1024,
        vocab: 50257,
        tp: TpShard::NONE,
        pp: PpStage::NONE,
    };
    let xl = GptConfig {
        n_layer: 48,
        n_head: 25,
        n_embd: 1600,
        block_size: 1024,
        vocab: 256,
        tp: TpShard::NONE,
        pp: PpStage::NONE,
    };
    let mut cases = Vec::new();
    for precision in [Precision::Fp32, Precision::Bf16] {
        for checkpointing in [Checkpointing::None, Checkpointing::Selective, Checkpointing::Full] {
            for micro in [2, 8] {
                let knobs = Knobs { precision, checkpointing, ..Knobs::plain(micro, small.block_size, 16 / micro) };
                cases.push(EstimateCase::new(small, knobs, None));
            }
        }
    }
    let offloaded = |micro, activations| Knobs {
        precision: Precision::Bf16,
        checkpointing: Checkpointing::Full,
        offload_optimizer: true,
        offload_activations: activations,
        ..Knobs::plain(micro, small.block_size, 16 / micro)
    };
    cases.push(EstimateCase::new(small, offloaded(8, OffloadTarget::None), None));
    cases.push(EstimateCase::new(small, offloaded(8, OffloadTarget::Cpu), None));
    for micro in [1, 8] {
        let knobs = Knobs {
            precision: Precision::Bf16,
            checkpointing: Checkpointing::Full,
            offload_optimizer: true,
            ..Knobs::plain(micro, xl.block_size, 8 / micro)
        };
        cases.push(EstimateCase::new(xl, knobs, Some(16 << 30)));
    }
    cases
}

fn label(cfg: &GptConfig, k: &Knobs) -> String {
    let mut s = format!(
        "{:.0}M {} {} mb{}",
        cfg.num_params() as f64 / 1e6,
        crate::config::serde_name(&k.precision),
        crate::config::serde_name(&k.checkpointing),
        k.micro_batch
    );
    if k.offload_optimizer {
        s.push_str(" +opt-offload");
    }
    if k.offload_activations != OffloadTarget::None {
        s.push_str(" +act-offload");
    }
    s
}

/// Measure every case on a backend from `open(device_memory)`.
pub fn run<B: Backend>(
    open: &dyn Fn(Option<usize>) -> Result<B, String>,
    model: WorkspaceModel,
    cases: &[EstimateCase],
    tokens: &[u32],
) -> Vec<EstimateRow> {
    cases
        .iter()
        .map(|case| {
            let estimate = estimate_on(model, &case.cfg, &case.knobs);
            let measured = match case.knobs.precision {
                Precision::Fp32 => measure::<f32, B>(open, case, tokens),
                Precision::Bf16 => measure::<half::bf16, B>(open, case, tokens),
                Precision::Fp16 => measure::<half::f16, B>(open, case, tokens),
            };
            EstimateRow { case: case.clone(), estimate, measured }
        })
        .collect()
}

fn measure<E: Elem, B: Backend>(
    open: &dyn Fn(Option<usize>) -> Result<B, String>,
    case: &EstimateCase,
    tokens: &[u32],
) -> Result<(usize, usize), String> {
    let t = case.cfg.block_size;
    if tokens.len() <= t + 1 {
        return Err(format!("need more than {} tokens", t + 1));
    }
    let be = open(case.device_memory)?;
    let pool = be.pool().clone();
    let hyper = Hyper {
        knobs: case.knobs,
        steps: 2,
        global_batch: case.knobs.micro_batch * case.knobs.grad_accum,
        lr: 1e-4,
        warmup_steps: 1,
        weight_decay: 0.1,
        grad_clip: 1.0,
        seed: 1,
    };
    let mut trainer = Trainer::<E, B>::on_backend(case.cfg, hyper, be, None).map_err(|e| e.to_string())?;
    let vocab = case.cfg.vocab as u32;
    let clipped: Vec<u32> = tokens.iter().map(|&x| x % vocab).collect();
    let mut batch = sequences(&clipped, t);
    for _ in 0..2 {
        trainer.train_step(&mut batch).map_err(|e| e.to_string())?;
    }
    let stats = pool.stats();
    Ok((stats.peak_allocated, stats.peak_reserved))
}

/// The smallest pool capacity (to `resolution` bytes) at which `case` trains two steps on a
/// backend from `open(capacity)`, searched between the predicted allocated peak (below it
/// nothing fits) and `ceiling`; `None` when even `ceiling` does not fit. What fragmentation costs
/// a configuration is this minus its allocated peak.
pub fn min_capacity<B: Backend>(
    open: &dyn Fn(Option<usize>) -> Result<B, String>,
    model: WorkspaceModel,
    case: &EstimateCase,
    tokens: &[u32],
    ceiling: usize,
    resolution: usize,
) -> Option<usize> {
    let fits = |capacity: usize| {
        let case = EstimateCase { device_memory: Some(capacity), ..case.clone() };
        match case.knobs.precision {
            Precision::Fp32 => measure::<f32, B>(open, &case, tokens),
            Precision::Bf16 => measure::<half::bf16, B>(open, &case, tokens),
            Precision::Fp16 => measure::<half::f16, B>(open, &case, tokens),
        }
        .is_ok()
    };
    if !fits(ceiling) {
        return None;
    }
    let floor = estimate_on(model, &case.cfg, &case.knobs).peak_allocated.min(ceiling);
    // Invariant: `hi` fits; `lo` does not (or is the floor, below which nothing can).
    let (mut lo, mut hi) = (floor.saturating_sub(resolution), ceiling);
    while hi - lo > resolution {
        let mid = lo + (hi - lo) / 2;
        if fits(mid) {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    Some(hi)
}

/// The table: predicted and measured peaks side by side.
pub fn table(rows: &[EstimateRow]) -> String {
    let mut s = format!(
        "{:<40} {:>12} {:>12} {:>8} {:>14} {:>12}\n",
        "configuration", "estimated", "measured", "error", "reserved≤ est", "reserved"
    );
    for r in rows {
        let (measured, reserved) = match &r.measured {
            Ok((a, res)) => (format_bytes(*a), format_bytes(*res)),
            Err(e) => (format!("failed: {e}"), String::new()),
        };
        s.push_str(&format!(
            "{:<40} {:>12} {:>12} {:>8} {:>14} {:>12}\n",
            r.case.label,
            format_bytes(r.estimate.peak_allocated),
            measured,
            r.error().map_or(String::new(), |e| format!("{:+.2}%", e * 100.0)),
            format_bytes(r.estimate.reserved_allowance),
            reserved
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::check::device_sim::DeviceSim;

    /// The harness on the simulated device (the CPU's declarations), on a small grid: every
    /// row is exact, so on a GPU a failing row is the backend's, not the harness's.
    #[test]
    fn the_estimator_is_exact_on_the_simulated_device() {
        let cfg = GptConfig {
            n_layer: 2,
            n_head: 4,
            n_embd: 64,
            block_size: 64,
            vocab: 256,
            tp: TpShard::NONE,
            pp: PpStage::NONE,
        };
        let cases: Vec<EstimateCase> =
            [(Precision::Fp32, Checkpointing::None, 4), (Precision::Bf16, Checkpointing::Full, 2)]
                .into_iter()
                .map(|(precision, checkpointing, micro)| {
                    let knobs = Knobs { precision, checkpointing, ..Knobs::plain(micro, 64, 4 / micro) };
                    EstimateCase::new(cfg, knobs, None)
                })
                .collect();
        let tokens: Vec<u32> = (0..4096u32).map(|i| (i * 7 + 3) % 256).collect();
        let open = |memory: Option<usize>| Ok(DeviceSim::new(memory.unwrap_or(1 << 30)));
        let rows = run(&open, WorkspaceModel::Cpu, &cases, &tokens);
        print!("{}", table(&rows));
        for r in &rows {
            assert!(r.passed(), "{}: {:?} vs {:?}", r.case.label, r.estimate.peak_allocated, r.measured);
        }
        assert_eq!(grid().len(), 16, "12 GPT-2-small-like rows, 2 offloaded, 2 at 1.5B");
    }

    /// Fragmentation, measured: the smallest capacity a job pattern with multi-MiB blocks
    /// trains in, with fixed segments and with expandable ones. Fixed segments strand free
    /// bytes in partly used segments (the job OOMs with enough free bytes in total); expandable
    /// ones fit within about a page of the allocated peak.
    #[test]
    fn expandable_segments_fit_where_fixed_segments_strand_free_memory() {
        use crate::engine::backend::CpuBackend;
        use crate::memory::{Pool, LARGE_ROUND};
        let cfg = GptConfig {
            n_layer: 2,
            n_head: 4,
            n_embd: 256,
            block_size: 128,
            vocab: 256,
            tp: TpShard::NONE,
            pp: PpStage::NONE,
        };
        let tokens: Vec<u32> = (0..8192u32).map(|i| (i * 7 + 3) % 256).collect();
        let mut min = Vec::new();
        for expandable in [false, true] {
            let knobs = Knobs { expandable_segments: expandable, ..Knobs::plain(8, 128, 1) };
            let case = EstimateCase::new(cfg, knobs, None);
            let open =
                |memory: Option<usize>| Ok(CpuBackend::new(Pool::host("cpu", memory.unwrap_or(1 << 30), expandable)));
            let estimate = estimate_on(WorkspaceModel::Cpu, &cfg, &knobs);
            let fits = min_capacity(&open, WorkspaceModel::Cpu, &case, &tokens, 256 << 20, 256 << 10)
                .expect("fits in 256 MiB");
            println!(
                "expandable {expandable}: allocated peak {}, smallest capacity that trains {}, allowance {}",
                format_bytes(estimate.peak_allocated),
                format_bytes(fits),
                format_bytes(estimate.reserved_allowance)
            );
            min.push((estimate.peak_allocated, fits));
        }
        let [(allocated, fixed), (_, expandable)] = min[..] else { unreachable!() };
        assert!(
            expandable < fixed,
            "expandable {expandable} vs fixed {fixed}: a capacity in between OOMs only with fixed segments"
        );
        assert!(expandable <= allocated + 2 * LARGE_ROUND, "expandable needs {expandable}, allocated peak {allocated}");
    }
}
