//! Tests of data-parallel ranks, ZeRO stages 1–3, tensor parallelism and offload: loss
//! trajectories against one rank, measured per-rank memory against the ZeRO proportions and
//! the estimator, offload savings, and checkpoints moved across stages, world sizes and
//! tensor-parallel splits.

use crate::config::{Checkpointing, OffloadTarget, Precision};
use crate::engine::backend::{Backend, BackendError, CpuBackend};
use crate::memory::{Category, Pool};

use crate::config::Knobs;
use crate::engine::backend::layers::Elem;
use crate::engine::estimate::{estimate_step, Estimate};
use crate::engine::model::{GptConfig, PpStage, TpShard};
use crate::engine::parallel::comm::Group;
use crate::engine::rng::mix64;
use crate::engine::train::trainer::{Hyper, RankGroups, StepStats, Trainer};

const CFG: GptConfig =
    GptConfig { n_layer: 4, n_head: 4, n_embd: 64, block_size: 32, vocab: 128, tp: TpShard::NONE, pp: PpStage::NONE };
/// A model whose state dwarfs the pool's 2 MiB segment rounding, for capacity tests.
const WIDE: GptConfig =
    GptConfig { n_layer: 8, n_head: 4, n_embd: 192, block_size: 32, vocab: 512, tp: TpShard::NONE, pp: PpStage::NONE };
const GLOBAL_BATCH: usize = 8;
const MICRO_BATCH: usize = 2;

/// One configuration of the memory knobs under test.
#[derive(Debug, Clone, Copy)]
struct Setup {
    cfg: GptConfig,
    micro_batch: usize,
    world: usize,
    /// Ranks of a tensor-parallel group and pipeline stages (tp × pp dividing `world`).
    tp: usize,
    pp: usize,
    stage: usize,
    offload_optimizer: bool,
    offload_params: bool,
    offload_activations: OffloadTarget,
    checkpointing: Checkpointing,
}

impl Setup {
    fn ranks(world: usize, stage: usize) -> Setup {
        Setup {
            cfg: CFG,
            micro_batch: MICRO_BATCH,
            world,
            tp: 1,
            pp: 1,
            stage,
            offload_optimizer: false,
            offload_params: false,
            offload_activations: OffloadTarget::None,
            checkpointing: Checkpointing::None,
        }
    }

    fn hyper(&self, steps: u64) -> Hyper {
        Hyper {
            knobs: self.knobs(Precision::Fp32),
            steps,
            global_batch: GLOBAL_BATCH,
            lr: 3e-3,
            warmup_steps: 2,
            weight_decay: 0.1,
            grad_clip: 1.0,
            seed: 11,
        }
    }

    fn knobs(&self, precision: Precision) -> Knobs {
        Knobs {
            checkpointing: self.checkpointing,
            precision,
            offload_optimizer: self.offload_optimizer,
            offload_params: self.offload_params,
            offload_activations: self.offload_activations,
            world_size: self.world,
            tensor_parallel: self.tp,
            pipeline_parallel: self.pp,
            zero_stage: self.stage,
            ..Knobs::plain(
                self.micro_batch,
                self.cfg.block_size,
                GLOBAL_BATCH / (self.micro_batch * self.world / (self.tp * self.pp)),
            )
        }
    }
}

/// A deterministic corpus for `cfg`: sequence `i` of step `s` of the global batch.
fn batch(cfg: GptConfig) -> impl FnMut(u64, u64, &mut Vec<u32>, &mut Vec<u32>) {
    move |s, i, inp, tgt| sequence(cfg, s, i, inp, tgt)
}

fn sequence(cfg: GptConfig, s: u64, i: u64, inp: &mut Vec<u32>, tgt: &mut Vec<u32>) {
    let v = cfg.vocab as u64;
    let start = mix64(s.wrapping_mul(1_000_003).wrapping_add(i)) % 997;
    for p in 0..cfg.block_size as u64 {
        // A learnable pattern (next token is a function of this one) with a little noise.
        let x = (start + p * 7) % v;
        inp.push(x as u32);
        tgt.push(((x * 5 + 3 + mix64(s ^ i ^ p) % 2) % v) as u32);
    }
}

/// What one rank of a run ended with.
struct RankResult {
    steps: Vec<StepStats>,
    pool: Pool,
    /// The full fp32 master weights at the end (gathered from every rank).
    weights: Vec<f32>,
}

/// Run `f` on every rank of a group of `setup.world`, each rank on the `cpu` device with its own
/// pool of `capacity` bytes, and return each rank's result (rank order).
fn on_ranks<E: Elem, R: Send>(
    setup: Setup,
    steps: u64,
    capacity: usize,
    f: impl Fn(Trainer<E>, Pool) -> R + Sync,
) -> Vec<Result<R, BackendError>> {
    on_backends(setup, steps, |rank| CpuBackend::new(Pool::new(&format!("cpu:{rank}"), capacity)), f)
}

/// `on_ranks` with each rank on the backend `open(rank)`.
fn on_backends<E: Elem, B: Backend, R: Send>(
    setup: Setup,
    steps: u64,
    open: impl Fn(usize) -> B + Sync,
    f: impl Fn(Trainer<E, B>, Pool) -> R + Sync,
) -> Vec<Result<R, BackendError>> {
    let comms: Vec<Option<Group>> =
        if setup.world == 1 { vec![None] } else { Group::threads(setup.world).into_iter().map(Some).collect() };
    std::thread::scope(|scope| {
        let joins: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                let (f, open) = (&f, &open);
                scope.spawn(move || {
                    let backend = open(rank);
                    let pool = backend.pool().clone();
                    let groups = RankGroups::split(
                        &backend,
                        comm.as_ref(),
                        setup.tp,
                        setup.pp,
                        std::time::Duration::from_secs(60),
                    )
                    .expect("thread groups split");
                    let trainer = Trainer::<E, B>::on_ranks(setup.cfg, setup.hyper(steps), backend, groups)?;
                    Ok(f(trainer, pool))
                })
            })
            .collect();
        joins.into_iter().map(|j| j.join().expect("rank panicked")).collect()
    })
}

/// Train `steps` steps (evaluating once at the end, as the loop does) on every rank.
fn train<E: Elem>(setup: Setup, steps: u64, capacity: usize) -> Result<Vec<RankResult>, BackendError> {
    train_on::<E, _>(setup, steps, |rank| CpuBackend::new(Pool::new(&format!("cpu:{rank}"), capacity)))
}

/// `train` with each rank on the backend `open(rank)`.
fn train_on<E: Elem, B: Backend>(
    setup: Setup,
    steps: u64,
    open: impl Fn(usize) -> B + Sync,
) -> Result<Vec<RankResult>, BackendError> {
    on_backends::<E, B, _>(setup, steps, open, |mut trainer, pool| {
        let mut out = Vec::new();
        for _ in 0..steps {
            out.push(trainer.train_step(&mut batch(setup.cfg))?);
        }
        trainer.evaluate(setup.micro_batch, &mut |i, inp, tgt| sequence(setup.cfg, u64::MAX, i as u64, inp, tgt))?;
        let weights = trainer.full_master_params()?;
        Ok(RankResult { steps: out, pool, weights })
    })
    .into_iter()
    .map(|r| r.and_then(|x| x))
    .collect()
}

fn losses(r: &RankResult) -> Vec<f32> {
    r.steps.iter().map(|s| s.loss).collect()
}

fn max_rel_diff(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| ((x - y).abs() / x.abs().max(y.abs()).max(1e-3)) as f64).fold(0.0, f64::max)
}

/// ‖a − b‖ / ‖b‖: per-element comparisons of weights are meaningless after a few AdamW steps,
/// which turn rounding-level differences of near-zero gradients into lr-sized updates.
fn rel_distance(a: &[f32], b: &[f32]) -> f64 {
    let d: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let n: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (d / n).sqrt()
}

const BIG: usize = 1 << 30;

#[test]
fn ranks_at_every_zero_stage_follow_the_single_rank_trajectory() {
    let reference = train::<f32>(Setup::ranks(1, 0), 20, BIG).unwrap().remove(0);
    let ref_losses = losses(&reference);
    assert!(ref_losses[19] < ref_losses[0] - 0.3, "the reference run learns: {ref_losses:?}");
    for world in [2, 4] {
        for stage in 0..=3 {
            let ranks = train::<f32>(Setup::ranks(world, stage), 20, BIG).unwrap();
            for (rank, r) in ranks.iter().enumerate() {
                let d = max_rel_diff(&losses(r), &ref_losses);
                // Only the order of fp32 additions differs (accumulation split across ranks).
                assert!(d < 2e-5, "world {world} stage {stage} rank {rank}: loss off by {d:e}");
                let w = rel_distance(&r.weights, &reference.weights);
                if rank == 0 {
                    println!("world {world} stage {stage}: max loss difference {d:.1e}, weight distance {w:.1e}");
                }
                assert!(w < 1e-4, "world {world} stage {stage} rank {rank}: weights off by {w:e}");
                assert_eq!(losses(r), losses(&ranks[0]), "every rank reports the same loss");
            }
        }
    }
}

/// Bytes per parameter of (params, grads, optimizer) that one rank keeps, from the ZeRO paper's
/// accounting for the engine's precision: fp32 keeps weights, gradients and two moments (4 + 4
/// + 8, no master copy); bf16 keeps 2 + 2 and an fp32 master plus two moments (K = 12).
fn zero_bytes_per_param(precision: Precision, stage: usize, world: usize) -> f64 {
    let (p, g, k) = match precision {
        Precision::Fp32 => (4.0, 4.0, 8.0),
        _ => (2.0, 2.0, 12.0),
    };
    let n = world as f64;
    match stage {
        0 => p + g + k,
        1 => p + g + k / n,
        2 => p + (g + k) / n,
        _ => (p + g + k) / n,
    }
}

fn static_bytes(pool: &Pool) -> usize {
    let s = pool.stats();
    s.peak(Category::Params) + s.peak(Category::Grads) + s.peak(Category::Optimizer)
}

fn within(measured: usize, predicted: usize, tolerance: f64) -> bool {
    (measured as f64 - predicted as f64).abs() <= tolerance * predicted as f64
}

fn check_zero_memory<E: Elem>(precision: Precision) -> Vec<String> {
    let psi = CFG.num_params() as f64;
    let mut rows = Vec::new();
    for world in [2, 4] {
        for stage in 0..=3 {
            let setup = Setup::ranks(world, stage);
            let ranks = train::<E>(setup, 2, BIG).unwrap();
            let estimate = estimate_step(&CFG, &setup.knobs(precision));
            let paper = zero_bytes_per_param(precision, stage, world) * psi;
            for (rank, r) in ranks.iter().enumerate() {
                let kept = static_bytes(&r.pool);
                let peak = r.pool.stats().peak_allocated;
                let row = format!(
                    "{precision:?} N={world} stage {stage} rank {rank}: params+grads+optimizer {kept} B \
                     (paper {paper:.0} B = {:.2}Ψ), peak {peak} B (estimated {})",
                    kept as f64 / psi,
                    estimate.peak_allocated
                );
                assert!(within(kept, paper as usize, 0.05), "{row}");
                assert!(within(peak, estimate.peak_allocated, 0.05), "{row}");
                assert_eq!(kept, estimate.params + estimate.grads + estimate.optimizer, "{row}");
                rows.push(row);
            }
        }
    }
    rows
}

#[test]
fn per_rank_memory_follows_the_zero_proportions_and_the_estimator() {
    let mut rows = check_zero_memory::<f32>(Precision::Fp32);
    rows.extend(check_zero_memory::<half::bf16>(Precision::Bf16));
    println!("{}", rows.join("\n"));
}

/// Train a configuration and its offloaded twin; check the saving against the estimator and the
/// results against each other (`exact`: bitwise; else within `tolerance` relative).
fn check_offload<E: Elem>(precision: Precision, base: Setup, offloaded: Setup, tolerance: f64) -> (usize, usize) {
    let plain = train::<E>(base, 6, BIG).unwrap();
    let off = train::<E>(offloaded, 6, BIG).unwrap();
    let (e_plain, e_off): (Estimate, Estimate) =
        (estimate_step(&base.cfg, &base.knobs(precision)), estimate_step(&base.cfg, &offloaded.knobs(precision)));
    let predicted = e_plain.peak_allocated - e_off.peak_allocated;
    for (a, b) in plain.iter().zip(&off) {
        let (pa, pb) = (a.pool.stats().peak_allocated, b.pool.stats().peak_allocated);
        assert!(pb < pa, "{offloaded:?}: offload lowers the peak ({pb} vs {pa})");
        let saved = pa - pb;
        assert!(
            within(saved, predicted, 0.05),
            "{offloaded:?}: saved {saved} B, predicted {predicted} B ({pa} -> {pb})"
        );
        let d = max_rel_diff(&losses(a), &losses(b));
        println!(
            "{offloaded:?}: peak {pa} -> {pb}, saved {saved} B (predicted {predicted} B), loss difference {d:.1e}"
        );
        assert!(d <= tolerance, "{offloaded:?}: losses differ by {d:e}");
        let swap = b.steps.last().unwrap().swap.expect("offloaded steps report swap traffic");
        assert!(swap.bytes_to_device > 0, "{offloaded:?}: {swap:?}");
    }
    (plain[0].pool.stats().peak_allocated, off[0].pool.stats().peak_allocated)
}

#[test]
fn each_offload_mode_saves_what_the_estimator_predicts_and_trains_the_same() {
    let full = |s: Setup| Setup { checkpointing: Checkpointing::Full, ..s };
    for world in [1, 2] {
        let stage = if world == 1 { 0 } else { 2 };
        let base = Setup::ranks(world, stage);
        check_offload::<half::bf16>(
            Precision::Bf16,
            base,
            Setup { offload_optimizer: true, ..base },
            0.0, // the host runs the same AdamW on the same fp32 values
        );
        check_offload::<f32>(Precision::Fp32, base, Setup { offload_params: true, ..base }, 0.0);
        check_offload::<f32>(
            Precision::Fp32,
            full(base),
            Setup { offload_activations: OffloadTarget::Cpu, ..full(base) },
            0.0,
        );
        check_offload::<f32>(
            Precision::Fp32,
            full(base),
            Setup { offload_activations: OffloadTarget::CpuInt8, ..full(base) },
            0.02, // int8 transfer compression is lossy
        );
    }
    // ZeRO-3 with the weight shards on the host.
    let base = Setup::ranks(2, 3);
    check_offload::<f32>(Precision::Fp32, base, Setup { offload_params: true, offload_optimizer: true, ..base }, 0.0);
}

#[test]
fn a_job_that_ooms_without_offload_fits_with_it() {
    // For each mode a model where it matters: wide layers for the state offloads, a deep one at
    // a larger micro-batch for activations.
    let wide = Setup { cfg: WIDE, ..Setup::ranks(1, 0) };
    let deep = Setup {
        cfg: GptConfig {
            n_layer: 32,
            n_head: 4,
            n_embd: 32,
            block_size: 256,
            vocab: 128,
            tp: TpShard::NONE,
            pp: PpStage::NONE,
        },
        micro_batch: 8,
        checkpointing: Checkpointing::Full,
        ..Setup::ranks(1, 0)
    };
    for (base, offloaded) in [
        (wide, Setup { offload_optimizer: true, ..wide }),
        (wide, Setup { offload_params: true, ..wide }),
        (deep, Setup { offload_activations: OffloadTarget::Cpu, ..deep }),
        (Setup { world: 4, ..wide }, Setup { world: 4, stage: 3, ..wide }),
    ] {
        let (need_plain, need_off) = (
            estimate_step(&base.cfg, &base.knobs(Precision::Fp32)),
            estimate_step(&base.cfg, &offloaded.knobs(Precision::Fp32)),
        );
        // Room for the offloaded run's segments (the pool does not share small and large
        // segments), and less than the plain run's allocations.
        let capacity = need_off.reserved_allowance.max((need_plain.peak_allocated + need_off.peak_allocated) / 2);
        assert!(capacity < need_plain.peak_allocated, "{offloaded:?}: the saving outgrows segment rounding");
        let err = train::<f32>(base, 3, capacity).err().expect("the plain run OOMs");
        assert!(matches!(&err, BackendError::Oom(o) if o.requested_bytes > 0), "{err}");
        let done = train::<f32>(offloaded, 3, capacity)
            .unwrap_or_else(|e| panic!("{offloaded:?} does not fit {capacity} B: {e}"));
        assert!(done.iter().all(|r| r.steps.len() == 3 && r.pool.stats().peak_reserved <= capacity));
    }
}

/// Train 4 steps under `written_by` and checkpoint (every rank takes part, one writes); then
/// resume under each of `resumed_by` and train 4 more: each continues the one-rank run.
fn check_resume_across(written_by: Setup, resumed_by: &[Setup]) {
    let dir = tempfile::tempdir().unwrap();
    let reference = train::<f32>(Setup::ranks(1, 0), 8, BIG).unwrap().remove(0);
    on_ranks::<f32, _>(written_by, 8, BIG, |mut trainer, _| {
        for _ in 0..4 {
            trainer.train_step(&mut batch(CFG)).unwrap();
        }
        trainer.save_checkpoint(dir.path(), None).unwrap();
    })
    .into_iter()
    .for_each(|r| r.unwrap());
    for &setup in resumed_by {
        let results = on_ranks::<f32, _>(setup, 8, BIG, |mut trainer, _| {
            let (path, ckpt) =
                crate::engine::train::checkpoint::load_latest(dir.path(), None, |e| panic!("{e}")).unwrap();
            trainer.restore(&path, ckpt).unwrap();
            assert_eq!(trainer.step, 4);
            let tail: Vec<f32> = (0..4).map(|_| trainer.train_step(&mut batch(CFG)).unwrap().loss).collect();
            (tail, trainer.full_master_params().unwrap())
        });
        for r in results {
            let (tail, weights) = r.unwrap();
            let d = max_rel_diff(&tail, &losses(&reference)[4..]);
            assert!(d < 2e-5, "{written_by:?} -> {setup:?}: resumed losses off by {d:e}");
            let w = rel_distance(&weights, &reference.weights);
            assert!(w < 1e-4, "{written_by:?} -> {setup:?}: resumed weights off by {w:e}");
        }
    }
}

#[test]
fn checkpoints_resume_under_another_stage_and_world_size() {
    // Written by two ranks at ZeRO-3; resumed by four at ZeRO-1 and by one.
    check_resume_across(Setup::ranks(2, 3), &[Setup::ranks(4, 1), Setup::ranks(1, 0)]);
}

/// Ranks on a device whose memory the host may not read (`DeviceSim`) stage their collectives
/// through host memory and follow ranks on the `cpu` device bit for bit, at every ZeRO stage and
/// with weights, optimizer state or activations kept on the host.
#[test]
fn ranks_on_a_device_stage_their_collectives_and_match_the_cpu_bit_for_bit() {
    use crate::engine::check::device_sim::DeviceSim;
    let two = |stage| Setup::ranks(2, stage);
    let cases = [
        two(0),
        two(1),
        two(2),
        two(3),
        Setup { offload_params: true, ..two(3) },
        Setup { offload_params: true, offload_optimizer: true, ..two(2) },
        Setup { checkpointing: Checkpointing::Full, offload_activations: OffloadTarget::CpuInt8, ..two(3) },
    ];
    let n = CFG.num_params();
    for setup in cases {
        let on_cpu = train::<half::bf16>(setup, 3, BIG).unwrap();
        let on_device = train_on::<half::bf16, _>(setup, 3, |_| DeviceSim::new(BIG)).unwrap();
        for (rank, (cpu, device)) in on_cpu.iter().zip(&on_device).enumerate() {
            let bits = |r: &RankResult| losses(r).iter().map(|l| l.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(device), bits(cpu), "{setup:?} rank {rank}: losses");
            assert!(device.weights == cpu.weights, "{setup:?} rank {rank}: weights differ");
            let swap = device.steps[2].swap.expect("a device rank reports its staged traffic");
            if setup.stage == 0 && !setup.offload_params && !setup.offload_optimizer {
                // The gradients go down and the sums come back up, once per step.
                assert_eq!((swap.bytes_to_host, swap.bytes_to_device), (2 * n, 2 * n), "{setup:?}");
            }
            assert!(swap.bytes_to_host > 0 && swap.bytes_to_device > 0, "{setup:?}: {swap:?}");
        }
    }
}

/// A checkpoint written by ranks on a device (ZeRO-3 shards gathered from the device) and
/// resumed by a fresh group of device ranks continues exactly where ranks on the cpu are.
#[test]
fn device_ranks_checkpoint_and_resume_exactly() {
    use crate::engine::check::device_sim::DeviceSim;
    let setup = Setup { offload_optimizer: true, ..Setup::ranks(2, 3) };
    let reference = train::<half::bf16>(setup, 4, BIG).unwrap().remove(0);
    let dir = tempfile::tempdir().unwrap();
    let device = |_| DeviceSim::new(BIG);
    on_backends::<half::bf16, _, _>(setup, 4, device, |mut trainer, _| {
        for _ in 0..2 {
            trainer.train_step(&mut batch(CFG)).unwrap();
        }
        trainer.save_checkpoint(dir.path(), None).unwrap();
    })
    .into_iter()
    .for_each(|r| r.unwrap());
    let resumed = on_backends::<half::bf16, _, _>(setup, 4, device, |mut trainer, _| {
        let (path, ckpt) = crate::engine::train::checkpoint::load_latest(dir.path(), None, |e| panic!("{e}")).unwrap();
        trainer.restore(&path, ckpt).unwrap();
        let tail: Vec<f32> = (0..2).map(|_| trainer.train_step(&mut batch(CFG)).unwrap().loss).collect();
        (tail, trainer.full_master_params().unwrap())
    });
    for (rank, r) in resumed.into_iter().enumerate() {
        let (tail, weights) = r.unwrap();
        let bits = |l: &[f32]| l.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&tail), bits(&losses(&reference)[2..]), "rank {rank}: resumed losses");
        assert!(weights == reference.weights, "rank {rank}: resumed weights");
    }
}

/// World `world` split into tensor-parallel groups of `tp` (data-parallel: world / tp).
fn grid(world: usize, tp: usize, stage: usize) -> Setup {
    Setup { tp, ..Setup::ranks(world, stage) }
}

/// Tensor parallelism starts from the same weights as one rank, bit for bit: each value is a
/// function of its index in the whole model, whatever rank holds it.
#[test]
fn tensor_parallel_ranks_start_from_the_single_rank_weights() {
    let reference = on_ranks::<f32, _>(Setup::ranks(1, 0), 1, BIG, |t, _| t.full_master_params().unwrap());
    for setup in [grid(2, 2, 0), grid(4, 4, 0), grid(4, 2, 3)] {
        for w in on_ranks::<f32, _>(setup, 1, BIG, |t, _| t.full_master_params().unwrap()) {
            assert!(w.unwrap() == *reference[0].as_ref().unwrap(), "{setup:?}: initial weights differ");
        }
    }
}

/// TP 2 and 4, and TP 2 × DP 2 at every ZeRO stage, follow the one-rank loss trajectory: only
/// the order of fp32 additions differs (the projections' sums split across ranks).
#[test]
fn tensor_parallel_ranks_follow_the_single_rank_trajectory() {
    let reference = train::<f32>(Setup::ranks(1, 0), 20, BIG).unwrap().remove(0);
    let ref_losses = losses(&reference);
    let full = |s: Setup| Setup { checkpointing: Checkpointing::Full, ..s };
    let cases = [
        grid(2, 2, 0),
        grid(4, 4, 0),
        grid(4, 2, 0),
        grid(4, 2, 1),
        grid(4, 2, 2),
        grid(4, 2, 3),
        full(grid(2, 2, 0)),
        Setup { checkpointing: Checkpointing::Selective, ..grid(4, 2, 2) },
        Setup { offload_optimizer: true, ..grid(2, 2, 0) },
    ];
    for setup in cases {
        let ranks = train::<f32>(setup, 20, BIG).unwrap();
        for (rank, r) in ranks.iter().enumerate() {
            let d = max_rel_diff(&losses(r), &ref_losses);
            let w = rel_distance(&r.weights, &reference.weights);
            if rank == 0 {
                println!(
                    "world {} tp {} stage {} {:?}: max loss difference {d:.1e}, weight distance {w:.1e}",
                    setup.world, setup.tp, setup.stage, setup.checkpointing
                );
            }
            assert!(d < 2e-5, "{setup:?} rank {rank}: loss off by {d:e}");
            assert!(w < 1e-4, "{setup:?} rank {rank}: weights off by {w:e}");
            assert_eq!(losses(r), losses(&ranks[0]), "{setup:?}: every rank reports the same loss");
        }
    }
}

/// bf16 under tensor parallelism trains like bf16 on one rank (within bf16's rounding).
#[test]
fn tensor_parallel_bf16_follows_the_single_rank_bf16_trajectory() {
    let reference = losses(&train::<half::bf16>(Setup::ranks(1, 0), 12, BIG).unwrap()[0]);
    for setup in [grid(2, 2, 0), grid(4, 2, 1)] {
        let ranks = train::<half::bf16>(setup, 12, BIG).unwrap();
        let d = max_rel_diff(&losses(&ranks[0]), &reference);
        println!("bf16 world {} tp {} stage {}: max loss difference {d:.1e}", setup.world, setup.tp, setup.stage);
        assert!(d < 1e-2, "{setup:?}: bf16 losses off by {d:e}");
    }
}

/// A tensor-parallel rank keeps 1/tp of the split tensors and all of the replicated ones:
/// its model state is what the estimator says to the byte, and its step's peak within 5%.
#[test]
fn tensor_parallel_memory_per_rank_is_the_split_share_and_the_estimate() {
    for setup in [grid(2, 2, 0), grid(4, 4, 0), grid(4, 2, 2)] {
        let ranks = train::<f32>(setup, 2, BIG).unwrap();
        let knobs = setup.knobs(Precision::Fp32);
        let estimate = estimate_step(&CFG, &knobs);
        let local = CFG.with_tp(TpShard { rank: 0, size: setup.tp }).num_params();
        let replicated = CFG.num_params() - 12 * CFG.n_embd * CFG.n_embd * CFG.n_layer - 7 * CFG.n_embd * CFG.n_layer;
        // Exactly the replicated tensors plus 1/tp of the split ones.
        assert_eq!(local, replicated + (CFG.num_params() - replicated) / setup.tp, "{setup:?}");
        for (rank, r) in ranks.iter().enumerate() {
            let stats = r.pool.stats();
            let (kept, peak) = (static_bytes(&r.pool), stats.peak_allocated);
            println!(
                "world {} tp {} stage {} rank {rank}: weights {} B = {:.3} of one rank's, state {kept} B, \
                 peak {peak} B (estimated {})",
                setup.world,
                setup.tp,
                setup.stage,
                stats.peak(Category::Params),
                stats.peak(Category::Params) as f64 / (4 * CFG.num_params()) as f64,
                estimate.peak_allocated
            );
            assert_eq!(kept, estimate.params + estimate.grads + estimate.optimizer, "{setup:?} rank {rank}");
            assert!(within(peak, estimate.peak_allocated, 0.05), "{setup:?} rank {rank}: peak {peak}");
        }
    }
}

/// A checkpoint holds the whole model whatever the grid: written by TP 2 × DP 2 at ZeRO-3, it
/// resumes under TP 4, plain data parallelism and one rank, each continuing the one-rank run.
#[test]
fn checkpoints_resume_across_tensor_parallel_splits() {
    check_resume_across(grid(4, 2, 3), &[grid(4, 4, 0), Setup::ranks(2, 1), Setup::ranks(1, 0), grid(2, 2, 0)]);
}

/// World `world` as `pp` pipeline stages of `tp`-way splits (data-parallel: the rest).
fn stages(world: usize, tp: usize, pp: usize, stage: usize) -> Setup {
    Setup { tp, pp, ..Setup::ranks(world, stage) }
}

/// PP 2 and 4, and TP 2 × PP 2 × DP 2, follow the one-rank trajectory (GPipe over the step's
/// micro-batches: the same gradients, the tied embedding's two halves added after the
/// passes), report the same loss on every rank, and report the schedule's bubble.
#[test]
fn pipeline_stages_follow_the_single_rank_trajectory() {
    let reference = train::<f32>(Setup::ranks(1, 0), 20, BIG).unwrap().remove(0);
    let ref_losses = losses(&reference);
    let cases = [
        stages(2, 1, 2, 0),
        stages(4, 1, 4, 0),
        stages(8, 2, 2, 1),
        Setup { checkpointing: Checkpointing::Full, ..stages(2, 1, 2, 0) },
        Setup { offload_optimizer: true, ..stages(2, 1, 2, 0) },
        Setup { offload_params: true, ..stages(4, 2, 2, 0) },
    ];
    for setup in cases {
        let ranks = train::<f32>(setup, 20, BIG).unwrap();
        let m = setup.knobs(Precision::Fp32).grad_accum as f64;
        for (rank, r) in ranks.iter().enumerate() {
            let d = max_rel_diff(&losses(r), &ref_losses);
            let w = rel_distance(&r.weights, &reference.weights);
            if rank == 0 {
                println!(
                    "world {} tp {} pp {} stage {} {:?}: max loss difference {d:.1e}, weight distance {w:.1e}",
                    setup.world, setup.tp, setup.pp, setup.stage, setup.checkpointing
                );
            }
            assert!(d < 2e-5, "{setup:?} rank {rank}: loss off by {d:e}");
            assert!(w < 1e-4, "{setup:?} rank {rank}: weights off by {w:e}");
            assert_eq!(losses(r), losses(&ranks[0]), "{setup:?}: every rank reports the same loss");
            let p = setup.pp as f64;
            assert_eq!(r.steps[0].bubble, Some((p - 1.0) / (m + p - 1.0)), "{setup:?}");
        }
    }
}

/// Each stage holds its layers' share of the model state (the first also the embedding, the
/// last the head) and, under GPipe, every micro-batch's kept activations: the estimator's
/// per-stage prediction (the highest stage's) is exact for the state and within 5% for the
/// peak, and a 2-stage split holds about half the blocks' state on each stage.
#[test]
fn pipeline_memory_per_stage_is_the_estimate() {
    for setup in [stages(2, 1, 2, 0), stages(4, 1, 4, 0), stages(4, 2, 2, 0), stages(8, 2, 2, 1)] {
        let ranks = train::<f32>(setup, 2, BIG).unwrap();
        let knobs = setup.knobs(Precision::Fp32);
        let worst = estimate_step(&CFG, &knobs);
        let highest = ranks.iter().map(|r| r.pool.stats().peak_allocated).max().unwrap();
        println!(
            "world {} tp {} pp {} stage {}: highest rank peak {highest} B, estimated {} B ({})",
            setup.world, setup.tp, setup.pp, setup.stage, worst.peak_allocated, worst.peak_at
        );
        assert!(within(highest, worst.peak_allocated, 0.05), "{setup:?}: {highest} vs {}", worst.peak_allocated);
        for (rank, r) in ranks.iter().enumerate() {
            // rank = (stage · dp + d) · tp + t
            let dp = setup.world / (setup.tp * setup.pp);
            let stage = rank / (setup.tp * dp);
            let shard = CFG
                .with_tp(TpShard { rank: rank % setup.tp, size: setup.tp })
                .with_pp(crate::engine::model::PpStage { stage, stages: setup.pp });
            let stats = r.pool.stats();
            let zero1 = setup.stage >= 1 && dp > 1;
            let n = shard.num_params();
            let opt = if zero1 { 2 * 4 * n.div_ceil(dp) } else { 2 * 4 * n };
            let block = |b: usize| b.div_ceil(crate::memory::ROUND) * crate::memory::ROUND;
            assert_eq!(stats.peak(Category::Params), block(4 * n), "{setup:?} rank {rank}: weights of stage {stage}");
            assert_eq!(stats.peak(Category::Optimizer), block(opt / 2) * 2, "{setup:?} rank {rank}");
        }
    }
}

/// An OOM on one stage (the last: room for its state, not for a step) fails the step on every
/// stage — as an OOM, so the supervisor steps down — and no stage waits for it: the failing
/// stage keeps taking part in each transfer until the ranks agree after the passes.
#[test]
fn an_oom_on_one_stage_fails_the_step_on_every_stage_without_a_hang() {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let setup = stages(4, 1, 4, 0);
        let results = on_backends::<f32, _, _>(
            setup,
            2,
            |rank| CpuBackend::new(Pool::new(&format!("cpu:{rank}"), if rank == 3 { 2 << 20 } else { BIG })),
            |mut trainer, _| trainer.train_step(&mut batch(CFG)).map(|s| s.loss),
        );
        let _ = tx.send(results);
    });
    let results = rx.recv_timeout(std::time::Duration::from_secs(60)).expect("every stage returns: no hang");
    for (rank, r) in results.into_iter().enumerate() {
        let step = r.expect("the state fits on every stage");
        match step {
            Err(BackendError::Oom(oom)) => println!("rank {rank}: {oom}"),
            other => panic!("rank {rank}: the step is an OOM on every stage, not {other:?}"),
        }
    }
}

/// The same on a device whose stage boundaries go through native collectives (simulated
/// NCCL): the failed stage's stand-ins take that path too, so its neighbours' transfers
/// complete instead of waiting for a host exchange that never comes.
#[test]
fn an_oom_on_one_stage_with_native_transfers_fails_every_stage_without_a_hang() {
    use crate::engine::check::device_sim::{DeviceSim, SimCollectives};
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let setup = stages(4, 1, 4, 0);
        let group = SimCollectives::group(4);
        let results = on_backends::<f32, _, _>(
            setup,
            2,
            |rank| DeviceSim::new(if rank == 3 { 2 << 20 } else { BIG }).with_collectives(group[rank].clone()),
            |mut trainer, _| trainer.train_step(&mut batch(CFG)).map(|s| s.loss),
        );
        let _ = tx.send((results, group[0].calls()));
    });
    let (results, calls) = rx.recv_timeout(std::time::Duration::from_secs(60)).expect("every stage returns: no hang");
    assert!(calls > 0, "the boundaries went through the native collectives");
    for (rank, r) in results.into_iter().enumerate() {
        match r.expect("the state fits on every stage") {
            Err(BackendError::Oom(_)) => {}
            other => panic!("rank {rank}: the step is an OOM on every stage, not {other:?}"),
        }
    }
}

/// The gradient norm of a pipeline stage or a tensor-parallel rank is read back once per run
/// of adjacent tensors of one kind (split or replicated), not once per tensor — each read a
/// wait for the stream on a GPU: a stage reads one scalar a step, a tensor-parallel rank about
/// a third as many as its tensors.
#[test]
fn the_gradient_norm_reads_back_a_scalar_per_run_not_per_tensor() {
    use crate::engine::check::device_sim::DeviceSim;
    let tensors = CFG.tensors().len();
    for (setup, most) in [(stages(2, 1, 2, 0), 1), (grid(2, 2, 0), tensors / 3)] {
        let reads = on_backends::<f32, _, _>(
            setup,
            1,
            |_| DeviceSim::new(BIG),
            |mut trainer, _| {
                let before = trainer.backend().scalar_reads();
                trainer.train_step(&mut batch(CFG)).unwrap();
                trainer.backend().scalar_reads() - before
            },
        );
        for (rank, r) in reads.into_iter().enumerate() {
            let r = r.unwrap();
            println!("{setup:?} rank {rank}: {r} reads for {tensors} tensors");
            assert!((1..=most).contains(&r), "{setup:?} rank {rank}: {r} reads (at most {most})");
        }
    }
}

/// A checkpoint written by pipeline stages holds the whole model: it resumes on one rank, on
/// another grid of stages, and on tensor-parallel ranks, each continuing the one-rank run.
#[test]
fn checkpoints_resume_across_pipeline_stages() {
    check_resume_across(
        stages(4, 1, 2, 1),
        &[Setup::ranks(1, 0), stages(4, 1, 4, 0), stages(4, 2, 2, 0), grid(2, 2, 0)],
    );
}
