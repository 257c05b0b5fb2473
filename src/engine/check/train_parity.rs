//! Training parity: one model, one token stream and one set of hyper-parameters trained on a
//! reference backend and on a candidate, step by step; each step's loss and the final fp32
//! master weights are compared. `headroom gpu-check` runs it for `CudaBackend` against
//! `CpuBackend`; the tests run it on CPU backends (and one with a planted bug).

use std::fmt::Write as _;

use crate::config::{Checkpointing, Knobs, OffloadTarget};

use crate::engine::backend::layers::Elem;
use crate::engine::backend::Backend;
use crate::engine::model::{GptConfig, PpStage, TpShard};
use crate::engine::parallel::comm::{Comm, Group};
use crate::engine::rng::mix64;
use crate::engine::train::trainer::{Hyper, RankGroups, Trainer};

/// What to train: a model, the batch split, the number of optimizer steps and the memory
/// techniques in effect.
#[derive(Debug, Clone)]
pub struct TrainParityCase {
    /// What the case exercises, for the table.
    pub name: &'static str,
    pub cfg: GptConfig,
    pub micro_batch: usize,
    pub grad_accum: usize,
    pub steps: usize,
    pub checkpointing: Checkpointing,
    pub offload_optimizer: bool,
    pub offload_params: bool,
    pub offload_activations: OffloadTarget,
    /// Ranks (each on its own backend), of which `tp` consecutive ones split each block
    /// (tensor parallelism), and the ZeRO stage over the data-parallel ones.
    pub world: usize,
    pub tp: usize,
    /// Pipeline stages (tp × pp dividing `world`).
    pub pp: usize,
    pub zero_stage: usize,
}

impl TrainParityCase {
    /// A 2-layer model over a byte vocabulary: small enough for the CPU reference to train
    /// 20 steps in seconds, with gradient accumulation so the accumulate path is compared too.
    pub fn small(steps: usize) -> TrainParityCase {
        TrainParityCase {
            name: "plain",
            cfg: GptConfig {
                n_layer: 2,
                n_head: 4,
                n_embd: 128,
                block_size: 64,
                vocab: 256,
                tp: TpShard::NONE,
                pp: PpStage::NONE,
            },
            micro_batch: 4,
            grad_accum: 2,
            steps,
            checkpointing: Checkpointing::None,
            offload_optimizer: false,
            offload_params: false,
            offload_activations: OffloadTarget::None,
            world: 1,
            tp: 1,
            pp: 1,
            zero_stage: 0,
        }
    }

    /// `small` with every memory technique that moves data between host and device: full
    /// checkpointing with block outputs offloaded as int8, weights and optimizer state in
    /// host memory.
    pub fn small_offloaded(steps: usize) -> TrainParityCase {
        TrainParityCase {
            name: "ckpt+offload",
            checkpointing: Checkpointing::Full,
            offload_optimizer: true,
            offload_params: true,
            offload_activations: OffloadTarget::CpuInt8,
            ..Self::small(steps)
        }
    }

    /// `small` on two ranks at ZeRO `stage`, each accumulating half the micro-batches: the
    /// same global batch, so the same trajectory as one rank up to summation order. Stage 1
    /// all-reduces the gradients and all-gathers the updated weights; stage 3 gathers every
    /// weight segment before use and reduce-scatters every gradient segment.
    pub fn small_ranks(steps: usize, stage: usize) -> TrainParityCase {
        let names = ["2 ranks z0", "2 ranks z1", "2 ranks z2", "2 ranks z3"];
        TrainParityCase { name: names[stage.min(3)], grad_accum: 1, world: 2, zero_stage: stage, ..Self::small(steps) }
    }

    /// `small` split across two ranks by tensor parallelism: each holds two of the four heads
    /// and half the MLP, and their partial sums are summed twice per block each way.
    pub fn small_tensor_parallel(steps: usize) -> TrainParityCase {
        TrainParityCase { name: "TP 2", world: 2, tp: 2, ..Self::small(steps) }
    }

    /// `small` as two pipeline stages (one layer each), GPipe over its two micro-batches: the
    /// activations and their gradients cross between the stages' devices.
    pub fn small_pipeline(steps: usize) -> TrainParityCase {
        TrainParityCase { name: "PP 2", world: 2, pp: 2, ..Self::small(steps) }
    }

    /// Four ranks: two data-parallel copies (ZeRO-1 between them) of a two-way split.
    pub fn small_grid(steps: usize) -> TrainParityCase {
        TrainParityCase { name: "TP 2 × DP 2 z1", world: 4, tp: 2, zero_stage: 1, grad_accum: 1, ..Self::small(steps) }
    }

    pub(crate) fn hyper(&self) -> Hyper {
        Hyper {
            knobs: Knobs {
                checkpointing: self.checkpointing,
                offload_optimizer: self.offload_optimizer,
                offload_params: self.offload_params,
                offload_activations: self.offload_activations,
                world_size: self.world,
                tensor_parallel: self.tp,
                pipeline_parallel: self.pp,
                zero_stage: self.zero_stage,
                ..Knobs::plain(self.micro_batch, self.cfg.block_size, self.grad_accum)
            },
            steps: self.steps as u64,
            global_batch: self.micro_batch * self.grad_accum * self.world / (self.tp * self.pp),
            lr: 1e-3,
            warmup_steps: 2,
            weight_decay: 0.1,
            grad_clip: 1.0,
            seed: 1337,
        }
    }
}

/// The comparison of one training run on both backends.
#[derive(Debug, Clone)]
pub struct TrainParityReport {
    pub case: &'static str,
    pub dtype: &'static str,
    /// (reference, candidate) loss of every step.
    pub losses: Vec<(f32, f32)>,
    /// ‖w_candidate − w_reference‖ / ‖w_reference‖ of the final fp32 master weights.
    pub weights_rel_err: f64,
    pub loss_bound: f64,
    pub weights_bound: f64,
    /// Mean step time on each side, milliseconds.
    pub reference_ms: f64,
    pub candidate_ms: f64,
    pub error: Option<String>,
}

impl TrainParityReport {
    /// The largest |loss_c − loss_r| / |loss_r| over the steps (∞ for a non-finite loss).
    pub fn worst_loss_rel_err(&self) -> f64 {
        self.losses
            .iter()
            .map(|&(r, c)| if c.is_finite() { ((c - r).abs() / r.abs().max(1e-6)) as f64 } else { f64::INFINITY })
            .fold(0.0, f64::max)
    }

    pub fn passed(&self) -> bool {
        self.error.is_none()
            && self.worst_loss_rel_err() <= self.loss_bound
            && self.weights_rel_err <= self.weights_bound
    }

    /// Both sides trained bit for bit alike: every loss and the final master weights.
    pub fn identical(&self) -> bool {
        self.error.is_none()
            && !self.losses.is_empty()
            && self.losses.iter().all(|(r, c)| r.to_bits() == c.to_bits())
            && self.weights_rel_err == 0.0
    }

    /// The first step whose losses differ in any bit (0-based), if one does.
    pub fn first_difference(&self) -> Option<usize> {
        self.losses.iter().position(|(r, c)| r.to_bits() != c.to_bits())
    }
}

/// Loss and weight bounds per storage type. fp32 differs only by summation order, which 20
/// AdamW steps amplify a little; bf16 rounds activations and gradients at different points.
pub fn bounds<E: Elem>() -> (f64, f64) {
    if E::is_f32() {
        (1e-3, 1e-3)
    } else {
        (2e-2, 3e-2)
    }
}

/// Train `case` on both sides over `tokens` (ids below the vocabulary; sequences start at
/// pseudo-random offsets fixed by step and index) and compare. Each side's rank r runs on the
/// backend its opener gives for r.
pub fn train_parity<E: Elem, R: Backend, C: Backend>(
    reference: impl Fn(usize) -> Result<R, String>,
    candidate: impl Fn(usize) -> Result<C, String>,
    case: &TrainParityCase,
    tokens: &[u32],
) -> TrainParityReport {
    let (loss_bound, weights_bound) = bounds::<E>();
    let mut report = TrainParityReport {
        case: case.name,
        dtype: E::NAME,
        losses: Vec::new(),
        weights_rel_err: f64::INFINITY,
        loss_bound,
        weights_bound,
        reference_ms: 0.0,
        candidate_ms: 0.0,
        error: None,
    };
    let t = case.cfg.block_size;
    if tokens.len() <= t + 1 || tokens.iter().any(|&id| id as usize >= case.cfg.vocab) {
        report.error = Some(format!("need more than {} tokens below {}", t + 1, case.cfg.vocab));
        return report;
    }
    let run = |side: &str, r: Result<(Vec<f32>, Vec<f32>, f64), String>| r.map_err(|e| format!("{side}: {e}"));
    let reference = run("reference", train_on::<E, R>(&reference, case, tokens));
    let candidate = run("candidate", train_on::<E, C>(&candidate, case, tokens));
    match (reference, candidate) {
        (Ok((lr, wr, ms_r)), Ok((lc, wc, ms_c))) => {
            report.losses = lr.into_iter().zip(lc).collect();
            report.weights_rel_err = norm_rel_err(&wr, &wc);
            (report.reference_ms, report.candidate_ms) = (ms_r, ms_c);
        }
        (Err(e), _) | (_, Err(e)) => report.error = Some(e),
    }
    report
}

/// The batch function over a token stream of more than `t + 1` ids: sequence `i` of step `s`
/// is `t` tokens from an offset fixed by (s, i), its targets the same shifted by one.
pub(crate) fn sequences(tokens: &[u32], t: usize) -> impl FnMut(u64, u64, &mut Vec<u32>, &mut Vec<u32>) + '_ {
    let span = (tokens.len() - t - 1) as u64;
    move |s, i, inp, tgt| {
        let at = (mix64(s.wrapping_mul(0x9E37_79B9) ^ i) % span) as usize;
        inp.extend_from_slice(&tokens[at..at + t]);
        tgt.extend_from_slice(&tokens[at + 1..at + t + 1]);
    }
}

/// Each step's loss, the final master weights and the mean step time (of rank 0), every rank
/// on its own thread and backend.
fn train_on<E: Elem, B: Backend>(
    open: &dyn Fn(usize) -> Result<B, String>,
    case: &TrainParityCase,
    tokens: &[u32],
) -> Result<(Vec<f32>, Vec<f32>, f64), String> {
    let backends = (0..case.world).map(open).collect::<Result<Vec<B>, String>>()?;
    let comms: Vec<Option<Group>> =
        if case.world == 1 { vec![None] } else { Group::threads(case.world).into_iter().map(Some).collect() };
    let results: Vec<_> = std::thread::scope(|scope| {
        let ranks: Vec<_> = backends
            .into_iter()
            .zip(comms)
            .map(|(backend, comm)| scope.spawn(move || train_rank::<E, B>(backend, comm, case, tokens)))
            .collect();
        ranks.into_iter().map(|r| r.join().unwrap_or_else(|_| Err("a rank panicked".into()))).collect()
    });
    let mut first = None;
    for (rank, result) in results.into_iter().enumerate() {
        match result {
            Err(e) if case.world > 1 => return Err(format!("rank {rank}: {e}")),
            Err(e) => return Err(e),
            Ok(r) => {
                first.get_or_insert(r);
            }
        }
    }
    Ok(first.expect("world >= 1"))
}

/// One rank of `train_on`.
fn train_rank<E: Elem, B: Backend>(
    backend: B,
    comm: Option<Group>,
    case: &TrainParityCase,
    tokens: &[u32],
) -> Result<(Vec<f32>, Vec<f32>, f64), String> {
    let groups = RankGroups::split(&backend, comm.as_ref(), case.tp, case.pp, std::time::Duration::from_secs(60))
        .map_err(|e| e.to_string())?;
    let trainer = Trainer::<E, B>::on_ranks(case.cfg, case.hyper(), backend, groups);
    // A rank that cannot allocate must not leave the others waiting in a collective.
    let all_ok = comm.as_ref().map_or(trainer.is_ok(), |c| c.agree(trainer.is_ok()));
    let mut trainer = match (trainer, all_ok) {
        (Ok(t), true) => t,
        (Err(e), _) => return Err(e.to_string()),
        (Ok(_), false) => return Err("another rank could not allocate its state".into()),
    };
    let mut batch = sequences(tokens, case.cfg.block_size);
    let mut losses = Vec::with_capacity(case.steps);
    let mut ms = 0.0;
    for _ in 0..case.steps {
        let s = trainer.train_step(&mut batch).map_err(|e| e.to_string())?;
        losses.push(s.loss);
        ms += s.step_ms;
    }
    let weights = trainer.full_master_params().map_err(|e| e.to_string())?;
    Ok((losses, weights, ms / case.steps.max(1) as f64))
}

fn norm_rel_err(reference: &[f32], candidate: &[f32]) -> f64 {
    let (mut diff, mut norm) = (0f64, 0f64);
    for (&r, &c) in reference.iter().zip(candidate) {
        diff += (c as f64 - r as f64).powi(2);
        norm += (r as f64).powi(2);
    }
    if candidate.iter().any(|x| !x.is_finite()) {
        return f64::INFINITY;
    }
    (diff / norm.max(1e-30)).sqrt()
}

/// The reports as a table: a summary line per run, then the losses step by step.
pub fn table(reports: &[TrainParityReport]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<13} {:<6} {:>6} {:>12} {:>10} {:>12} {:>10} {:>9} {:>9}  result",
        "case", "dtype", "steps", "loss rel", "bound", "weights rel", "bound", "ref ms", "cand ms"
    );
    for r in reports {
        let verdict = match &r.error {
            Some(e) => format!("FAIL: {e}"),
            None if r.passed() => "ok".into(),
            None => "FAIL".into(),
        };
        let _ = writeln!(
            out,
            "{:<13} {:<6} {:>6} {:>12.3e} {:>10.0e} {:>12.3e} {:>10.0e} {:>9.1} {:>9.1}  {verdict}",
            r.case,
            r.dtype,
            r.losses.len(),
            r.worst_loss_rel_err(),
            r.loss_bound,
            r.weights_rel_err,
            r.weights_bound,
            r.reference_ms,
            r.candidate_ms,
        );
    }
    for r in reports.iter().filter(|r| !r.losses.is_empty()) {
        let _ = writeln!(out, "{} {} losses (reference / candidate):", r.case, r.dtype);
        for (i, (a, b)) in r.losses.iter().enumerate() {
            let _ = writeln!(out, "  step {:>3}  {a:.6}  {b:.6}", i + 1);
        }
    }
    out
}

/// The OOM drill: a budget between what plain training and fully checkpointed training need
/// (by the estimator), so the plain run must fail with a typed OOM during its step and the
/// checkpointed one must train within the budget.
#[derive(Debug, Clone)]
pub struct OomDrillReport {
    pub capacity: usize,
    /// The plain run's outcome: the OOM message, or why it is wrong.
    pub plain: Result<String, String>,
    /// The checkpointed run's outcome: its peak reserved bytes, or its error.
    pub checkpointed: Result<usize, String>,
}

impl OomDrillReport {
    pub fn passed(&self) -> bool {
        self.plain.is_ok() && self.checkpointed.as_ref().is_ok_and(|&peak| peak <= self.capacity)
    }
}

/// Run the drill in fp32 on backends made by `open(capacity)`.
pub fn oom_drill<B: Backend>(
    open: impl Fn(usize) -> Result<B, String>,
    model: crate::engine::backend::workspace::WorkspaceModel,
    tokens: &[u32],
) -> OomDrillReport {
    use crate::config::Knobs;
    use crate::engine::estimate::estimate_on;
    let mut case = TrainParityCase::small(2);
    case.cfg.block_size = 128;
    (case.micro_batch, case.grad_accum) = (16, 1);
    let knobs = |checkpointing| Knobs { checkpointing, ..Knobs::plain(case.micro_batch, case.cfg.block_size, 1) };
    let plain = estimate_on(model, &case.cfg, &knobs(Checkpointing::None));
    let full = estimate_on(model, &case.cfg, &knobs(Checkpointing::Full));
    let capacity = full.reserved_allowance.max((plain.peak_allocated + full.peak_allocated) / 2);
    let t = case.cfg.block_size;
    if tokens.len() <= t + 1 {
        let short = format!("need more than {} tokens", t + 1);
        return OomDrillReport { capacity, plain: Err(short.clone()), checkpointed: Err(short) };
    }
    let mut batch = sequences(tokens, t);
    let mut attempt = |mode| -> Result<usize, String> {
        let be = open(capacity)?;
        let pool = be.pool().clone();
        let mut c = case.clone();
        c.checkpointing = mode;
        let mut trainer = Trainer::<f32, B>::on_backend(c.cfg, c.hyper(), be, None).map_err(|e| e.to_string())?;
        for _ in 0..c.steps {
            trainer.train_step(&mut batch).map_err(|e| e.to_string())?;
        }
        Ok(pool.stats().peak_reserved)
    };
    let plain_outcome = match attempt(Checkpointing::None) {
        Err(e) if e.contains("out of device memory") => Ok(e),
        Err(e) => Err(format!("failed, but not with an OOM: {e}")),
        Ok(peak) => Err(format!(
            "fit in {capacity} B (peak reserved {peak} B) but the estimator says it needs {} B",
            plain.peak_allocated
        )),
    };
    OomDrillReport { capacity, plain: plain_outcome, checkpointed: attempt(Checkpointing::Full) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::backend::workspace::WorkspaceModel;
    use crate::engine::backend::CpuBackend;
    use crate::engine::check::device_sim::{DeviceSim, SimCollectives};
    use crate::engine::check::parity::tests::Faulty;
    use crate::memory::Pool;

    fn tokens() -> Vec<u32> {
        // The repository's corpus as bytes: a stream the model can learn from in a few steps.
        let text = std::fs::read("data/shakespeare-tiny.txt").expect("data/shakespeare-tiny.txt");
        text[..64 << 10].iter().map(|&b| b as u32).collect()
    }

    fn cpu() -> CpuBackend {
        CpuBackend::new(Pool::new("cpu", 256 << 20))
    }

    #[test]
    fn the_reference_trains_identically_on_a_second_instance() {
        let case = TrainParityCase::small(6);
        for report in [
            train_parity::<f32, _, _>(|_| Ok(cpu()), |_| Ok(cpu()), &case, &tokens()),
            train_parity::<half::bf16, _, _>(|_| Ok(cpu()), |_| Ok(cpu()), &case, &tokens()),
        ] {
            eprintln!("{}", table(std::slice::from_ref(&report)));
            assert!(report.error.is_none(), "{:?}", report.error);
            assert_eq!(report.losses.len(), 6);
            assert!(report.identical(), "{:?} {}", report.losses, report.weights_rel_err);
            assert_eq!(report.first_difference(), None);
            assert!(report.passed());
            assert!(report.losses[5].0 < report.losses[0].0, "the model learns: {:?}", report.losses);
        }
    }

    /// The device path (data in memory the host may not touch: uploads, downloads, optimizer
    /// and offload copies through the backend) computes exactly what the host path does.
    #[test]
    fn the_device_path_trains_bit_identically_to_the_host_path() {
        let cases = [
            TrainParityCase::small(4),
            TrainParityCase::small_offloaded(4),
            TrainParityCase::small_ranks(4, 1),
            TrainParityCase::small_ranks(4, 3),
            TrainParityCase::small_tensor_parallel(4),
            TrainParityCase::small_pipeline(4),
        ];
        for case in cases {
            for report in [
                train_parity::<f32, _, _>(|_| Ok(cpu()), |_| Ok(DeviceSim::new(256 << 20)), &case, &tokens()),
                train_parity::<half::bf16, _, _>(|_| Ok(cpu()), |_| Ok(DeviceSim::new(256 << 20)), &case, &tokens()),
            ] {
                eprintln!("{}", table(std::slice::from_ref(&report)));
                assert!(report.error.is_none(), "{} {}: {:?}", case.name, report.dtype, report.error);
                assert_eq!(report.losses.len(), 4);
                let identical = report.losses.iter().all(|(r, c)| r.to_bits() == c.to_bits());
                assert!(identical, "{} {}: {:?}", case.name, report.dtype, report.losses);
                assert_eq!(report.weights_rel_err, 0.0, "{} {}", case.name, report.dtype);
            }
        }
    }

    /// Ranks whose backend has native collectives (NCCL's primitives, simulated) build ZeRO
    /// 0-3 from them — with weights in host memory too — and train as ranks on the cpu do:
    /// bit for bit in fp32 (the sums go in rank order); in bf16 the reduced bucket is rounded
    /// once more before it is added to the shard, as with NCCL, so within the bf16 bounds.
    #[test]
    fn ranks_with_native_collectives_train_like_the_host_ranks() {
        let offloaded = TrainParityCase {
            name: "2 ranks z3+offload",
            offload_params: true,
            offload_optimizer: true,
            ..TrainParityCase::small_ranks(4, 3)
        };
        let cases = [0, 1, 2, 3].map(|stage| TrainParityCase::small_ranks(4, stage));
        // Tensor parallelism: the sub-groups get communicators split from the world's.
        let grids = [
            TrainParityCase::small_tensor_parallel(4),
            TrainParityCase::small_grid(4),
            TrainParityCase::small_pipeline(4),
        ];
        for case in cases.iter().chain([&offloaded]).chain(&grids) {
            let group = SimCollectives::group(case.world);
            let native = |r: usize| Ok(DeviceSim::new(256 << 20).with_collectives(group[r].clone()));
            let fp32 = train_parity::<f32, _, _>(|_| Ok(cpu()), native, case, &tokens());
            let calls = group[0].calls();
            let bf16 = train_parity::<half::bf16, _, _>(|_| Ok(cpu()), native, case, &tokens());
            eprintln!("{}", table(&[fp32.clone(), bf16.clone()]));
            assert!(calls > 0, "{}: no native collective was called", case.name);
            assert!(fp32.error.is_none() && bf16.error.is_none(), "{}: {:?} {:?}", case.name, fp32.error, bf16.error);
            let identical = fp32.losses.iter().all(|(r, c)| r.to_bits() == c.to_bits());
            assert!(identical, "{} fp32: {:?}", case.name, fp32.losses);
            assert_eq!(fp32.weights_rel_err, 0.0, "{} fp32", case.name);
            assert!(bf16.passed(), "{} bf16: {:?} weights {}", case.name, bf16.losses, bf16.weights_rel_err);
        }
    }

    /// With everything resident on the device a step moves only its tokens up and its losses
    /// down: no weight, gradient or optimizer traffic.
    #[test]
    fn a_step_on_a_device_moves_what_its_placement_says() {
        let case = TrainParityCase::small(1);
        let (b, t) = (case.micro_batch, case.cfg.block_size);
        let mut trainer = Trainer::<half::bf16, _>::on_backend(case.cfg, case.hyper(), DeviceSim::new(256 << 20), None)
            .expect("trainer");
        let before = trainer.backend().traffic();
        let n = case.cfg.num_params();
        assert_eq!(before, (2 * n + 4 * n, 0), "bf16 weights and fp32 master uploaded once");
        let tokens = tokens();
        trainer.train_step(&mut sequences(&tokens, t)).unwrap();
        let after = trainer.backend().traffic();
        let per_micro = (2 * b * t * 4, b * t * 4);
        let accum = case.grad_accum;
        assert_eq!((after.0 - before.0, after.1 - before.1), (accum * per_micro.0, accum * per_micro.1));

        // Offloaded, the weights go up for every pass and the gradients come down; the step's
        // reported swap traffic is what actually crossed, less the tokens and losses.
        let case = TrainParityCase::small_offloaded(1);
        let mut trainer = Trainer::<half::bf16, _>::on_backend(case.cfg, case.hyper(), DeviceSim::new(256 << 20), None)
            .expect("trainer");
        let before = trainer.backend().traffic();
        let stats = trainer.train_step(&mut sequences(&tokens, t)).unwrap();
        let after = trainer.backend().traffic();
        let (up, down) = (after.0 - before.0, after.1 - before.1);
        let swap = stats.swap.expect("offloading reports its traffic");
        eprintln!("offloaded step: {up} B up, {down} B down, reported {swap:?}");
        assert!(up >= 2 * accum * 2 * n, "bf16 weights up for forward and backward of each micro-batch: {up}");
        assert!(down >= 2 * n, "bf16 gradients down to the host optimizer: {down}");
        assert_eq!((swap.bytes_to_device, swap.bytes_to_host), (up - accum * per_micro.0, down - accum * per_micro.1));
        // Every weight segment but the first of each pass (the embeddings forward, the tied
        // classifier backward) goes ahead of its use through the copy stream, and so do the
        // offloaded block outputs.
        let ahead = trainer.backend().copied_ahead();
        let (c, v, t_max) = (case.cfg.n_embd, case.cfg.padded_vocab(), case.cfg.block_size);
        let first_segments = accum * ((v + t_max) * c + v * c) * 2;
        assert_eq!(ahead, up - accum * per_micro.0 - first_segments, "bytes that went ahead");
    }

    #[test]
    fn the_oom_drill_passes_on_the_device_path() {
        let report = oom_drill(|capacity| Ok(DeviceSim::new(capacity)), WorkspaceModel::Cpu, &tokens());
        assert!(report.passed(), "{report:?}");
    }

    #[test]
    fn a_backend_with_a_planted_bug_fails_training_parity() {
        let case = TrainParityCase::small(4);
        let report = train_parity::<f32, _, _>(|_| Ok(cpu()), |_| Ok(Faulty(cpu())), &case, &tokens());
        let table = table(std::slice::from_ref(&report));
        eprintln!("{table}");
        assert!(!report.passed(), "{table}");
        assert!(table.contains("FAIL"));
        assert!(!report.identical(), "{table}");
        assert!(report.first_difference().is_some(), "{table}");
    }

    #[test]
    fn the_oom_drill_ooms_plain_and_fits_checkpointed() {
        let report =
            oom_drill(|capacity| Ok(CpuBackend::new(Pool::new("cpu", capacity))), WorkspaceModel::Cpu, &tokens());
        assert!(report.passed(), "{report:?}");
        let message = report.plain.unwrap();
        assert!(message.contains("out of device memory"), "{message}");
    }

    #[test]
    fn a_candidate_that_runs_out_of_memory_is_a_failed_report_not_a_panic() {
        let case = TrainParityCase::small(2);
        let report = train_parity::<f32, _, _>(
            |_| Ok(cpu()),
            |_| Ok(CpuBackend::new(Pool::new("cpu", 1 << 20))),
            &case,
            &tokens(),
        );
        let error = report.error.as_deref().expect("an error");
        assert!(error.starts_with("candidate: ") && error.contains("out of device memory"), "{error}");
        assert!(!report.passed());
    }
}
