//! The training state (weights, gradients, AdamW moments in the pool) and one optimizer step
//! with gradient accumulation; evaluation; checkpoint save/restore.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::config::{Checkpointing, JobSpec, Knobs, OffloadTarget};
use crate::memory::{Buffer, Category, Pool};

use crate::engine::backend::layers::{narrow, Elem};
use crate::engine::backend::optim::{clip_coefficient, lr_at, AdamW};
use crate::engine::backend::{Backend, BackendError, BackendResult, CpuBackend, HostPin, View, ViewMut};
use crate::engine::defrag::{defragment, Defragmentation};
use crate::engine::model::{
    self, alloc_elems, alloc_f32, short_name, tp_split, GptConfig, HeadOutput, PpStage, TensorGroup, TensorInfo,
    TpShard,
};
use crate::engine::parallel::comm::{shard_range, Comm, Group};
use crate::engine::parallel::placement::{
    FullGrads, Gathered, GradSink, HostStaged, ParamSource, Resident, ShardedGrads, StreamedGrads,
};
use crate::engine::parallel::tcp::RendezvousError;
use crate::engine::rng::Rng;

use super::host_optimizer::{HostOptimizer, HostState};
use crate::engine::train::checkpoint::{self, Checkpoint, CheckpointError, CheckpointHeader};

/// Hyper-parameters of the loop, resolved from the job spec: its memory knobs and the rest.
#[derive(Debug, Clone)]
pub struct Hyper {
    pub knobs: Knobs,
    pub steps: u64,
    pub global_batch: usize,
    pub lr: f64,
    pub warmup_steps: usize,
    pub weight_decay: f64,
    pub grad_clip: f64,
    pub seed: u64,
}

impl Hyper {
    pub fn from_spec(spec: &JobSpec) -> Hyper {
        let t = &spec.train;
        Hyper {
            knobs: spec.knobs(),
            steps: t.steps as u64,
            global_batch: t.global_batch as usize,
            lr: t.lr,
            warmup_steps: t.warmup_steps as usize,
            weight_decay: t.weight_decay,
            grad_clip: t.grad_clip,
            seed: t.seed,
        }
    }
}

/// The job's whole model (a tensor-parallel rank takes its share with `GptConfig::with_tp`).
pub fn gpt_config(spec: &JobSpec) -> GptConfig {
    let m = &spec.model;
    GptConfig {
        n_layer: m.n_layer as usize,
        n_head: m.n_head as usize,
        n_embd: m.n_embd as usize,
        block_size: m.block_size as usize,
        vocab: m.vocab.size(),
        tp: TpShard::NONE,
        pp: PpStage::NONE,
    }
}

/// What one optimizer step measured.
#[derive(Debug, Clone)]
pub struct StepStats {
    /// Optimizer steps completed after this one.
    pub step: u64,
    pub loss: f32,
    pub lr: f64,
    pub grad_norm: f64,
    pub step_ms: f64,
    pub tokens_per_s: f64,
    /// fp16 dynamic loss scale in effect after this step (1.0 when unused).
    pub loss_scale: f64,
    /// The update was skipped because the scaled gradients overflowed.
    pub skipped: bool,
    /// Device↔host traffic of this step when offloading.
    pub swap: Option<SwapStats>,
    /// Pipeline stages: the share of a stage's step spent idle waiting for the others (GPipe:
    /// (stages − 1) / (micro-batches + stages − 1)).
    pub bubble: Option<f64>,
}

/// Where a training sequence comes from: (step, index in global batch, inputs, targets).
pub type BatchFn<'a> = dyn FnMut(u64, u64, &mut Vec<u32>, &mut Vec<u32>) + 'a;

pub use crate::engine::model::EvalBatchFn;

/// Initial fp16 loss scale (2^16) and the run of good steps after which it doubles.
pub const INITIAL_LOSS_SCALE: f64 = 65536.0;
pub const LOSS_SCALE_GROWTH_INTERVAL: u64 = 200;

/// Where the fp32 master weights and the AdamW moments live. Under ZeRO (stage ≥ 1, world > 1)
/// both hold only this rank's shard (padded to equal shards on every rank).
enum OptimizerState<E> {
    /// On the device, in the optimizer category. `master` is None for fp32, whose compute
    /// weights are the master.
    Device { master: Option<Buffer>, m: Buffer, v: Buffer },
    /// In host memory (`offload.optimizer: cpu`): each step the gradients go device→host into
    /// the link buffer segment by segment as the backward pass finishes them (one rank; with
    /// ranks, in chunks after the collective), the fused host AdamW updates them chunk by chunk
    /// and leaves the narrowed weights there, each chunk going host→device while the next one
    /// is updated — or, with the delayed update, on its own thread during the next step.
    Host(HostOptimizer<E>),
}

/// Elements per chunk of the offloaded optimizer step's pipeline (4M: 8 MiB of bf16 on the
/// wire, ~100 MiB of optimizer state to update, per chunk).
pub const OFFLOAD_CHUNK: usize = 1 << 22;

/// Where a rank keeps its compute copy of the weights between passes: all of them, or only
/// its shard under ZeRO-3 (`sharded`).
enum ParamStore<E> {
    /// In the device pool (params category).
    Device(Buffer),
    /// In host memory (`offload.params: cpu`); passes copy each segment to the device on use.
    /// Shared with the copy worker during a pass, exclusively owned between passes.
    Host(Arc<Vec<E>>),
}

impl<E: Elem> ParamStore<E> {
    fn view(&self) -> View<'_, E> {
        match self {
            ParamStore::Device(b) => View::of(b),
            ParamStore::Host(v) => View::from_host(v),
        }
    }

    fn view_mut(&mut self) -> ViewMut<'_, E> {
        match self {
            ParamStore::Device(b) => ViewMut::of(b),
            ParamStore::Host(v) => {
                ViewMut::from_host(Arc::get_mut(v).expect("no copy worker holds the weights between passes"))
            }
        }
    }
}

pub use crate::engine::parallel::SwapStats;

/// The weight source a pass reads through, for where the weights are kept.
enum Source<'a, E, B: Backend> {
    Resident(Resident<'a, E>),
    Gathered(Gathered<'a, E, B>),
    Host(HostStaged<'a, E, B>),
}

impl<E: Elem, B: Backend> Source<'_, E, B> {
    fn get(&self) -> &dyn ParamSource<E> {
        match self {
            Source::Resident(s) => s,
            Source::Gathered(s) => s,
            Source::Host(s) => s,
        }
    }
}

/// Model state on the device: every tensor a pool buffer tagged with its category.
/// `E` is the compute precision of parameters, gradients and activations; with a 16-bit `E`
/// the fp32 master weights live in the optimizer category beside the AdamW moments. `B` is
/// the backend every op runs on (the CPU reference unless a device is asked for).
///
/// ZeRO stages on a group of `world` ranks: 1 shards the optimizer state, 2 also the gradients
/// (each backward segment is reduce-scattered to its owners), 3 also the weights (each segment
/// is all-gathered before use). With world 1 every stage is stage 0. Ranks exchange through
/// host memory: in place on the `cpu` device, staged (downloaded and uploaded) on a device.
pub struct Trainer<E: Elem = f32, B: Backend = CpuBackend> {
    pub cfg: GptConfig,
    pub hyper: Hyper,
    pub pool: Pool,
    backend: B,
    /// Compute copy of the weights, in `E`: all of them, or `shard` of them under ZeRO-3.
    params: ParamStore<E>,
    params_sharded: bool,
    /// Gradient accumulator: all of them, or `shard` of them under ZeRO-2/3.
    grads: Buffer,
    grads_sharded: bool,
    /// fp32 master weights and AdamW moments of `shard`, on the device or on the host.
    opt: OptimizerState<E>,
    /// Chunk of the offloaded optimizer step's pipeline ([`OFFLOAD_CHUNK`]; the whole shard:
    /// synchronous — download all, update, upload all).
    offload_chunk: usize,
    /// Gradients for the host optimizer stream to it during the last backward pass.
    stream_grads: bool,
    /// The parameter range whose optimizer state this rank owns (everything unless sharded).
    shard: Range<usize>,
    /// The parameter layout clipped to `shard`, offsets relative to its start.
    shard_tensors: Vec<TensorInfo>,
    /// The data-parallel group: gradients are summed (or reduce-scattered) over it and ZeRO
    /// shards over it.
    comm: Option<Group>,
    /// The tensor-parallel group (`None`: no tensor parallelism): `cfg.tp` is this rank's place
    /// in it, and every pass sums partial results over it.
    tp: Option<Group>,
    /// The pipeline (`None`: one stage): `cfg.pp` is this rank's stage.
    pipe: Option<Pipeline>,
    /// Optimizer steps completed (skipped fp16 steps included: their data is consumed).
    pub step: u64,
    adam_t: u64,
    rng: Rng,
    /// Dynamic loss scaling (fp16 only).
    dynamic_scale: bool,
    loss_scale: f64,
    good_steps: u64,
    pub skipped_steps: u64,
}

impl<E: Elem> Trainer<E, CpuBackend> {
    /// Allocate parameters, gradients and optimizer state in `pool` (host memory: the `cpu`
    /// device), and initialise the weights.
    pub fn new(cfg: GptConfig, hyper: Hyper, pool: Pool) -> BackendResult<Trainer<E>> {
        Self::new_rank(cfg, hyper, pool, None)
    }

    /// One data-parallel rank of a group (`comm`) on the `cpu` device.
    pub fn new_rank(cfg: GptConfig, hyper: Hyper, pool: Pool, comm: Option<Group>) -> BackendResult<Trainer<E>> {
        Trainer::on_backend(cfg, hyper, CpuBackend::new(pool), comm)
    }
}

/// Parameters initialised (and uploaded) per chunk at start: bounds the host memory of
/// initialisation to 64 MiB of f32 whatever the model's size.
const INIT_CHUNK: usize = 16 << 20;

impl<E: Elem, B: Backend> Trainer<E, B> {
    /// Allocate the state in `backend`'s pool and initialise the weights. A rank of a group
    /// (`comm`) is sharded by `hyper.knobs.zero_stage`; every rank allocates equal (padded) shards, so
    /// all ranks make the same allocations and an OOM happens on all of them alike.
    /// A rank's trainer on `backend`: its persistent state reserved first (an OOM here costs
    /// milliseconds), then initialised.
    pub fn on_backend(cfg: GptConfig, hyper: Hyper, backend: B, comm: Option<Group>) -> BackendResult<Self> {
        Self::on_ranks(cfg, hyper, backend, RankGroups { data: comm, tensor: None, pipeline: None })
    }

    /// A rank's trainer of the whole model `cfg` on `backend`, in its data-parallel and
    /// tensor-parallel groups: it holds its tensor-parallel share of the model (`cfg.with_tp`),
    /// sharded over the data-parallel group by ZeRO.
    pub fn on_ranks(cfg: GptConfig, hyper: Hyper, backend: B, groups: RankGroups) -> BackendResult<Self> {
        let RankGroups { data: comm, tensor, pipeline } = groups;
        let tensor = tensor.filter(|g| g.world() > 1);
        let cfg = cfg
            .whole()
            .with_tp(tensor.as_ref().map_or(TpShard::NONE, |g| TpShard { rank: g.rank(), size: g.world() }))
            .with_pp(
                pipeline
                    .as_ref()
                    .map_or(PpStage::NONE, |p| PpStage { stage: p.stages.rank(), stages: p.stages.world() }),
            );
        let pool = backend.pool().clone();
        if hyper.knobs.static_allocator {
            // Armed before the model state: its large buffers get segments of their exact size.
            pool.static_arm();
        }
        let n = cfg.num_params();
        let (rank, world) = comm.as_ref().map(|c| (c.rank(), c.world())).unwrap_or((0, 1));
        let stage = if world > 1 { hyper.knobs.zero_stage } else { 0 };
        let shard = if stage >= 1 { shard_range(n, rank, world) } else { 0..n };
        let state_len = if stage >= 1 { n.div_ceil(world) } else { n };
        let k = shard.len();
        let (params_sharded, grads_sharded) = (stage >= 3, stage >= 2);
        let params_len = if params_sharded { state_len } else { n };
        // Reserve every persistent buffer before any host work: a job whose model state cannot
        // fit fails here, in milliseconds, whatever the model's size.
        let started = std::time::Instant::now();
        let kept = held(params_sharded, &shard, n);
        let mut params_buf = if hyper.knobs.offload_params {
            pool.set_host_bytes(Category::Params, params_len * E::BYTES);
            None
        } else {
            Some(alloc_elems::<E>(&pool, params_len, Category::Params)?)
        };
        let grads = alloc_elems::<E>(&pool, if grads_sharded { state_len } else { n }, Category::Grads)?;
        let mut device_state = if hyper.knobs.offload_optimizer {
            // fp32 master weights and both moments, and the link buffer of gradients / weights
            // (two with the delayed update: the next step's gradients land beside it).
            let link_buffers = if hyper.knobs.delayed_update && comm.is_none() { 2 } else { 1 };
            pool.set_host_bytes(Category::Optimizer, (3 * 4 + link_buffers * E::BYTES) * state_len);
            None
        } else {
            let master = if E::is_f32() { None } else { Some(alloc_f32(&pool, state_len, Category::Optimizer)?) };
            let m = alloc_f32(&pool, state_len, Category::Optimizer)?;
            let v = alloc_f32(&pool, state_len, Category::Optimizer)?;
            Some((master, m, v))
        };
        let reserved_ms = started.elapsed().as_secs_f64() * 1e3;
        // Then the initial values: every rank computes the part it keeps (a pure function of
        // seed and index), a chunk at a time, with no full-size host copy of a device's state.
        let mut host_params = hyper.knobs.offload_params.then(|| vec![E::default(); params_len]);
        // Host master weights: generated in place (in parallel, so first touches are spread
        // over the cores), not copied from the chunks below.
        let host_master = hyper.knobs.offload_optimizer.then(|| {
            let mut master = vec![0.0f32; k];
            cfg.init_range(hyper.seed, shard.clone(), &mut master);
            master
        });
        let mut values = vec![0.0f32; INIT_CHUNK.min(kept.len())];
        let staged = params_buf.as_ref().is_some_and(|b| !b.host_visible());
        let mut narrowed = vec![E::default(); if staged { values.len() } else { 0 }];
        for lo in kept.clone().step_by(INIT_CHUNK.max(1)) {
            let chunk = lo..(lo + INIT_CHUNK).min(kept.end);
            let vals = &mut values[..chunk.len()];
            cfg.init_range(hyper.seed, chunk.clone(), vals);
            let at = chunk.start - kept.start..chunk.end - kept.start;
            if let Some(host) = host_params.as_mut() {
                narrow::<E>(&mut host[at.clone()], vals);
            }
            if let Some(buf) = params_buf.as_mut() {
                if buf.host_visible() {
                    // Host memory (the cpu device): narrowed straight into the pool.
                    narrow::<E>(&mut buf.as_mut_slice::<E>()[at], vals);
                } else {
                    narrow::<E>(&mut narrowed[..chunk.len()], vals);
                    backend.upload(ViewMut::range(buf, at), &narrowed[..chunk.len()])?;
                }
            }
            // The master weights: the part of this chunk in the rank's shard.
            let (slo, shi) = (chunk.start.max(shard.start), chunk.end.min(shard.end));
            if slo < shi {
                let part = &vals[slo - chunk.start..shi - chunk.start];
                let at = slo - shard.start..shi - shard.start;
                if let Some((Some(mw), _, _)) = &mut device_state {
                    backend.upload(ViewMut::range(mw, at), part)?;
                }
            }
        }
        drop((values, narrowed));
        let params = match (params_buf, host_params) {
            (Some(buf), _) => ParamStore::Device(buf),
            (None, Some(host)) => ParamStore::Host(Arc::new(host)),
            (None, None) => unreachable!("the weights are on the device or the host"),
        };
        // A copy ahead into pageable memory holds the issuing thread until it is done: where
        // pinning fails, the gradients come down after the backward pass instead of during it.
        let mut pageable = false;
        let opt = match (device_state.take(), host_master) {
            (Some((master, mut m, mut v)), _) => {
                // Fresh host pages already read as zero: touching them here would only move
                // their first-touch cost from the first optimizer step to the start.
                for moments in [&mut m, &mut v] {
                    if !moments.fresh_zero() {
                        backend.zero::<f32>(ViewMut::of(moments))?;
                    }
                }
                OptimizerState::Device { master, m, v }
            }
            (None, Some(master)) => {
                // Delayed updates for one rank (validated), whose gradients stream to the host.
                let delayed = hyper.knobs.delayed_update && comm.is_none();
                OptimizerState::Host(HostOptimizer::new(master, delayed, |mem| {
                    backend.pin_host(mem).unwrap_or_else(|e| {
                        // Copies into pageable memory are slower and staged by the driver.
                        tracing::warn!(
                            "an offload buffer stays pageable (gradients come down after the backward pass): {e}"
                        );
                        pageable = true;
                        HostPin::default()
                    })
                }))
            }
            (None, None) => unreachable!("the optimizer state is on the device or the host"),
        };
        tracing::info!(
            "model state reserved in {reserved_ms:.0} ms, initialised in {:.0} ms ({} parameters)",
            started.elapsed().as_secs_f64() * 1e3 - reserved_ms,
            n
        );
        let shard_tensors = cfg
            .tensors()
            .iter()
            .filter_map(|t| {
                let lo = t.offset.max(shard.start);
                let hi = (t.offset + t.len).min(shard.end);
                (lo < hi).then(|| TensorInfo {
                    name: t.name.clone(),
                    offset: lo - shard.start,
                    len: hi - lo,
                    decay: t.decay,
                })
            })
            .collect();
        let rng = Rng::new(hyper.seed);
        let dynamic_scale = E::NAME == "fp16";
        Ok(Trainer {
            shard,
            shard_tensors,
            comm,
            tp: tensor,
            pipe: pipeline,
            cfg,
            hyper,
            pool,
            backend,
            params,
            params_sharded,
            grads,
            grads_sharded,
            opt,
            offload_chunk: OFFLOAD_CHUNK,
            stream_grads: !pageable,
            step: 0,
            adam_t: 0,
            rng,
            dynamic_scale,
            loss_scale: if dynamic_scale { INITIAL_LOSS_SCALE } else { 1.0 },
            good_steps: 0,
            skipped_steps: 0,
        })
    }

    /// The backend the passes and the optimizer run on.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Whether the weights are sharded (ZeRO-3): then every pass, evaluation included, is a
    /// collective every rank must run.
    pub fn params_sharded(&self) -> bool {
        self.params_sharded
    }

    /// Whether this rank takes part in an evaluation: the first data-parallel rank (with each
    /// rank of its tensor-parallel group: a pass is their collective), or every rank when the
    /// weights are sharded over the data-parallel group.
    pub fn evaluates(&self) -> bool {
        self.data_rank() == 0 || self.params_sharded
    }

    /// Whether this rank writes the checkpoints and reports: the first of every group.
    fn leads(&self) -> bool {
        self.data_rank() == 0 && self.tp.as_ref().is_none_or(|g| g.rank() == 0) && self.cfg.pp.is_first()
    }

    /// Elements `range` of a state buffer, copied to the host.
    fn download<T: bytemuck::Pod>(&self, buf: &Buffer, range: Range<usize>) -> BackendResult<Vec<T>> {
        let mut out = vec![T::zeroed(); range.len()];
        self.backend.download(View::range(buf, range), &mut out)?;
        Ok(out)
    }

    /// This rank's fp32 master weights (all of them unless the optimizer state is sharded),
    /// copied to the host.
    pub fn master_params(&self) -> BackendResult<Vec<f32>> {
        let k = self.shard.len();
        match &self.opt {
            OptimizerState::Device { master: Some(m), .. } => self.download(m, 0..k),
            OptimizerState::Device { master: None, .. } => {
                let r = shard_in(self.params_sharded, &self.shard);
                match &self.params {
                    ParamStore::Device(buf) => self.download(buf, r),
                    ParamStore::Host(host) => {
                        Ok(E::as_f32(&host[r]).expect("fp32 compute weights are the master").to_vec())
                    }
                }
            }
            OptimizerState::Host(host) => Ok(host.with_state(|s| s.master.clone())),
        }
    }

    /// This rank's AdamW first and second moments, copied to the host.
    fn moments(&self) -> BackendResult<(Vec<f32>, Vec<f32>)> {
        let k = self.shard.len();
        match &self.opt {
            OptimizerState::Device { m, v, .. } => Ok((self.download(m, 0..k)?, self.download(v, 0..k)?)),
            OptimizerState::Host(host) => Ok(host.with_state(|s| (s.m.clone(), s.v.clone()))),
        }
    }

    /// This rank's index in its data-parallel group (which slice of the batch it trains on).
    pub fn data_rank(&self) -> usize {
        self.comm.as_ref().map_or(0, |c| c.rank())
    }

    fn world(&self) -> usize {
        self.comm.as_ref().map_or(1, |c| c.world())
    }

    /// The whole-model vector (a checkpoint's layout) of which this rank's tensor-parallel
    /// share is `local`: assembled over the tensor-parallel group (a collective of it).
    fn whole_of(&self, local: Vec<f32>) -> Vec<f32> {
        if self.tp.is_none() && self.pipe.is_none() {
            return local;
        }
        let mut whole = self.cfg.whole_part_of(&local);
        if let Some(tp) = &self.tp {
            tp.all_reduce_sum(&mut whole);
        }
        if let Some(pipe) = &self.pipe {
            pipe.stages.all_reduce_sum(&mut whole);
        }
        whole
    }

    /// The full vector of which this rank holds `part` (its shard, or everything unshared).
    /// A collective when the state is sharded.
    fn gather_full(&self, part: Vec<f32>) -> Vec<f32> {
        if self.shard.len() == self.cfg.num_params() {
            return part;
        }
        let comm = self.comm.as_ref().expect("sharded state has a group");
        let mut full = vec![0f32; self.cfg.num_params()];
        full[self.shard.clone()].copy_from_slice(&part);
        comm.all_gather(&mut full, self.shard.clone());
        full
    }

    /// All fp32 master weights of the whole model, in the checkpoint's layout (gathered from
    /// every rank when sharded or split: a collective).
    pub fn full_master_params(&self) -> BackendResult<Vec<f32>> {
        Ok(self.whole_of(self.gather_full(self.master_params()?)))
    }

    /// The whole model's master weights and moments (gathered from every rank when sharded or
    /// split).
    fn full_state(&self) -> BackendResult<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        let (m, v) = self.moments()?;
        Ok((self.full_master_params()?, self.whole_of(self.gather_full(m)), self.whole_of(self.gather_full(v))))
    }

    pub fn loss_scale(&self) -> f64 {
        self.loss_scale
    }

    /// Override the dynamic loss scale (fp16), e.g. to start lower than 2^16.
    pub fn set_loss_scale(&mut self, scale: f64) {
        self.loss_scale = scale;
    }

    /// One optimizer step over the global batch, accumulating `grad_accum` micro-batches.
    pub fn train_step(&mut self, batch: &mut BatchFn<'_>) -> BackendResult<StepStats> {
        // The static allocator records this step (the first) or replays its plan.
        let pool = self.backend.pool().clone();
        if self.hyper.knobs.static_allocator {
            pool.static_begin_step();
        }
        let step = self.train_step_inner(batch);
        if self.hyper.knobs.static_allocator {
            match pool.static_end_step() {
                Ok(Some(r)) => tracing::info!(
                    "static allocation plan: {} of the step's {} allocations packed into {} (live peak {}, fragmentation {:.2}%)",
                    r.planned,
                    r.allocations,
                    crate::memory::format_bytes(r.arena_bytes),
                    crate::memory::format_bytes(r.live_peak),
                    100.0 * r.fragmentation
                ),
                Ok(None) => {}
                Err(e) => tracing::warn!("the static allocator is off for this run: no room for its arena ({e})"),
            }
        }
        step
    }

    fn train_step_inner(&mut self, batch: &mut BatchFn<'_>) -> BackendResult<StepStats> {
        let started = std::time::Instant::now();
        let h = self.hyper.clone();
        let (b, t) = (h.knobs.micro_batch, h.knobs.seq_len);
        let be = &self.backend;
        be.zero::<E>(ViewMut::of(&mut self.grads))?;
        let scale = self.loss_scale as f32;
        let world = self.world();
        let dloss = scale / (b * t * h.knobs.grad_accum * world) as f32;
        // This rank's slice of the global batch.
        let first_seq = self.data_rank() * b * h.knobs.grad_accum;
        let mut loss_sum = 0.0f64;
        let mut swap = SwapStats::default();
        let mut grads_on_host = false;
        let (mut inputs, mut targets) = (Vec::with_capacity(b * t), Vec::with_capacity(b * t));
        let mut bubble = None;
        if let Some(pipe) = &self.pipe {
            let source = source_of(&self.params, self.params_sharded, &self.shard, self.comm.as_ref(), be);
            let tp = TensorGroup::of(self.tp.as_ref());
            let at = Passes { be, cfg: &self.cfg, knobs: &h.knobs, source: source.get(), tp: &tp, dloss };
            let run = pipeline_passes::<E, B>(&at, pipe, &mut self.grads, self.step, first_seq, batch);
            swap.add(run.swap);
            swap.add(source.get().swap());
            drop(source);
            settle_pipeline_step(&pipe.world, self.cfg.pp, run.failure, be.pool())?;
            // The tied `wte`: the embedding's gradient (first stage) plus the classifier's (last).
            if let Some(ends) = &pipe.ends {
                swap.add(ends.all_reduce_sum_on::<E, B>(be, ViewMut::range(&mut self.grads, self.cfg.wte_range()))?);
            }
            // Only the last stage has the losses.
            loss_sum = pipe.stages.all_reduce_f64(run.loss_sum);
            let (p, m) = (pipe.stages.world() as f64, h.knobs.grad_accum as f64);
            bubble = Some((p - 1.0) / (m + p - 1.0));
        } else {
            let source = source_of(&self.params, self.params_sharded, &self.shard, self.comm.as_ref(), be);
            let tp = TensorGroup::of(self.tp.as_ref());
            for micro in 0..h.knobs.grad_accum {
                inputs.clear();
                targets.clear();
                for i in 0..b {
                    batch(self.step, (first_seq + micro * b + i) as u64, &mut inputs, &mut targets);
                }
                let cfg = &self.cfg;
                let acts = model::forward::<E, B>(
                    be,
                    cfg,
                    source.get(),
                    &inputs,
                    &targets,
                    b,
                    t,
                    h.knobs.checkpointing,
                    h.knobs.offload_activations,
                    &tp,
                    HeadOutput::Gradient { dloss },
                )?;
                loss_sum += acts.mean_loss() as f64;
                let moved = match (&self.comm, self.grads_sharded) {
                    (Some(comm), true) => {
                        let grads = ViewMut::of(&mut self.grads);
                        let mut sink = ShardedGrads::new(grads, self.shard.clone(), comm, be);
                        let mut moved = model::backward::<E, B>(be, cfg, source.get(), &mut sink, acts, &tp)?;
                        moved.add(sink.swap());
                        moved
                    }
                    (None, _) if micro + 1 == h.knobs.grad_accum && self.streams_grads() => {
                        // The host optimizer's gradients leave segment by segment as backward
                        // finishes them, under the rest of the pass.
                        let delayed_step = self.delayed_step();
                        let OptimizerState::Host(host) = &mut self.opt else { unreachable!() };
                        let landing = host.landing(delayed_step);
                        let mut sink =
                            StreamedGrads::new(ViewMut::of(&mut self.grads), landing, be).holding(cfg.wte_range());
                        let moved = model::backward::<E, B>(be, cfg, source.get(), &mut sink, acts, &tp)?;
                        swap.add(sink.finish()?);
                        grads_on_host = true;
                        moved
                    }
                    _ => {
                        let mut sink = FullGrads(ViewMut::of(&mut self.grads));
                        model::backward::<E, B>(be, cfg, source.get(), &mut sink, acts, &tp)?
                    }
                };
                swap.add(moved);
            }
            swap.add(source.get().swap());
        }
        let k = self.shard.len();
        // Squared gradient norm: of the all-reduced full gradients, or summed over the shards.
        if let (Some(comm), false) = (&self.comm, self.grads_sharded) {
            swap.add(comm.all_reduce_sum_on::<E, B>(be, ViewMut::of(&mut self.grads))?);
        }
        let mut squares = match (&self.tp, self.grads_sharded) {
            (None, true) if self.pipe.is_none() => be.sum_squares::<E>(View::range(&self.grads, 0..k))?,
            (None, false) if self.pipe.is_none() => be.sum_squares::<E>(View::of(&self.grads))?,
            // Tensor parallelism: the split tensors' squares summed over the group, the
            // replicated ones (the same gradients on every rank of it) counted once; pipeline
            // stages: summed over the stages, the tied `wte` counted on the first only.
            (tp, sharded) => {
                let all_tensors;
                let tensors = if sharded {
                    &self.shard_tensors
                } else {
                    all_tensors = self.cfg.tensors();
                    &all_tensors
                };
                // Adjacent tensors of one kind (split over the tensor-parallel group or not;
                // without one, all alike) summed as one run: one read back per run, not per
                // tensor (a stage without tensor parallelism reads once or twice).
                let tied_copy = !self.cfg.pp.is_first();
                let mut runs: Vec<(Range<usize>, bool)> = Vec::new();
                for ti in tensors {
                    if tied_copy && ti.name == "wte" {
                        continue;
                    }
                    let is_split = tp.is_some() && tp_split(short_name(&ti.name));
                    let range = ti.offset..ti.offset + ti.len;
                    match runs.last_mut() {
                        Some((run, kind)) if *kind == is_split && run.end == range.start => run.end = range.end,
                        _ => runs.push((range, is_split)),
                    }
                }
                let (mut split, mut replicated) = (0.0f64, 0.0f64);
                for (run, is_split) in runs {
                    let sq = be.sum_squares::<E>(View::range(&self.grads, run))?;
                    match is_split {
                        true => split += sq,
                        false => replicated += sq,
                    }
                }
                let stage = replicated + tp.as_ref().map_or(split, |tp| tp.all_reduce_f64(split));
                self.pipe.as_ref().map_or(stage, |p| p.stages.all_reduce_f64(stage))
            }
        };
        if let Some(comm) = &self.comm {
            if self.grads_sharded {
                squares = comm.all_reduce_f64(squares);
            }
            loss_sum = comm.all_reduce_f64(loss_sum) / world as f64;
        }
        let lr = lr_at(self.step as usize, h.lr, h.warmup_steps, h.steps as usize);
        let inv_scale = 1.0 / self.loss_scale;
        let grad_norm = squares.sqrt() * inv_scale;
        let skipped = !grad_norm.is_finite();
        if skipped {
            // fp16 overflow: drop this update, halve the scale, keep going.
            self.loss_scale = (self.loss_scale / 2.0).max(1.0);
            self.good_steps = 0;
            self.skipped_steps += 1;
        } else {
            let coef = clip_coefficient(grad_norm, h.grad_clip);
            self.adam_t += 1;
            let opt = AdamW { lr: lr as f32, weight_decay: h.weight_decay as f32, t: self.adam_t };
            let grad_mult = (coef as f64 * inv_scale) as f32;
            swap.add(self.optimizer_step(&opt, grad_mult, grads_on_host)?);
            if let (Some(comm), true, false) = (&self.comm, k < self.cfg.num_params(), self.params_sharded) {
                // ZeRO-1/2: every rank updated its shard; gather the full weights everywhere.
                let moved = comm.all_gather_on::<E, B>(&self.backend, self.params.view_mut(), self.shard.clone())?;
                swap.add(moved);
            }
            if self.dynamic_scale {
                self.good_steps += 1;
                if self.good_steps >= LOSS_SCALE_GROWTH_INTERVAL {
                    self.loss_scale *= 2.0;
                    self.good_steps = 0;
                }
            }
        }
        self.step += 1;
        self.backend.synchronize()?;
        let secs = started.elapsed().as_secs_f64();
        let offloading =
            h.knobs.offload_optimizer || h.knobs.offload_params || h.knobs.offload_activations != OffloadTarget::None;
        Ok(StepStats {
            step: self.step,
            loss: (loss_sum / h.knobs.grad_accum as f64) as f32,
            lr,
            grad_norm,
            step_ms: secs * 1e3,
            tokens_per_s: (h.global_batch * t) as f64 / secs.max(1e-9),
            loss_scale: self.loss_scale,
            skipped,
            // Offloading, or ranks on a device staging their collectives through the host.
            swap: (offloading || swap.bytes_to_host + swap.bytes_to_device > 0).then_some(swap),
            bubble,
        })
    }

    /// AdamW over this rank's shard: the fp32 master and moments from the accumulated
    /// gradients × `grad_mult`, then the compute copy rewritten from the master. Returns the
    /// device↔host traffic (offloaded optimizer state). `grads_on_host`: the backward pass
    /// already left this step's gradients in the host optimizer's staging buffer.
    fn optimizer_step(&mut self, opt: &AdamW, grad_mult: f32, grads_on_host: bool) -> BackendResult<SwapStats> {
        let be = &self.backend;
        let k = self.shard.len();
        let grads_at = shard_in(self.grads_sharded, &self.shard).start;
        let params_at = shard_in(self.params_sharded, &self.shard);
        let tensors = &self.shard_tensors;
        let delayed_step = self.delayed_step();
        match &mut self.opt {
            OptimizerState::Device { master, m, v } => {
                let (grads, master) = (&self.grads, master.as_mut());
                // One update per tensor (only matrices decay) on a view of the compute weights.
                let mut step = |mut compute: ViewMut<E>, mut master: Option<&mut Buffer>| -> BackendResult {
                    for ti in tensors {
                        let r = ti.offset..ti.offset + ti.len;
                        let g = View::range(grads, grads_at + ti.offset..grads_at + ti.offset + ti.len);
                        let p = compute.reborrow().slice(r.clone());
                        let (mt, vt) = (ViewMut::range(m, r.clone()), ViewMut::range(v, r.clone()));
                        match master.as_deref_mut() {
                            Some(mw) => {
                                be.adamw::<E>(ViewMut::range(mw, r), Some(p), g, mt, vt, opt, ti.decay, grad_mult)?
                            }
                            None => {
                                let p = p.reinterpret::<f32>();
                                be.adamw::<E>(p, None, g, mt, vt, opt, ti.decay, grad_mult)?
                            }
                        }
                    }
                    Ok(())
                };
                match &mut self.params {
                    ParamStore::Device(buf) => step(ViewMut::range(buf, params_at), master)?,
                    ParamStore::Host(host) => {
                        let host = Arc::get_mut(host).expect("no copy worker holds the weights between passes");
                        on_device(be, &mut host[params_at], |view| step(view, master))?
                    }
                }
                Ok(SwapStats::default())
            }
            OptimizerState::Host(host) if delayed_step => {
                // The delayed update: wait for the last step's, send its weights, and start
                // this step's on its own thread, over the whole shard.
                debug_assert!(grads_on_host, "a delayed update's gradients streamed to the host");
                let (opt, pieces) =
                    (*opt, tensors.iter().map(|t| (t.offset..t.offset + t.len, t.decay)).collect::<Vec<_>>());
                let params = &mut self.params;
                let cost = host.start_delayed(
                    |weights| send_weights(be, params, params_at.clone(), weights),
                    move |st| opt.update_host::<E>(pieces, &mut st.master, &mut st.io, grad_mult, &mut st.m, &mut st.v),
                )?;
                Ok(SwapStats {
                    bytes_to_device: cost.sent_bytes,
                    transfer_ms: cost.sent.as_secs_f64() * 1e3,
                    host_ms: cost.waited.as_secs_f64() * 1e3,
                    ..SwapStats::default()
                })
            }
            OptimizerState::Host(host) => {
                let started = Instant::now();
                let HostState { master, m, v, io: staged } = host.state_mut();
                let params = &mut self.params;
                let grads = &self.grads;
                let chunk = self.offload_chunk.max(1);
                let ranges: Vec<Range<usize>> = (0..k).step_by(chunk).map(|lo| lo..(lo + chunk).min(k)).collect();
                // Each chunk's tensors (only matrices decay), offsets relative to the chunk.
                let pieces = |r: &Range<usize>| -> Vec<(Range<usize>, bool)> {
                    tensors
                        .iter()
                        .filter_map(|t| {
                            let (lo, hi) = (t.offset.max(r.start), (t.offset + t.len).min(r.end));
                            (lo < hi).then(|| (lo - r.start..hi - r.start, t.decay))
                        })
                        .collect()
                };
                let download = |r: &Range<usize>, dst: &mut [E]| match grads_on_host {
                    true => Ok(()),
                    false => be.download(View::range(grads, grads_at + r.start..grads_at + r.end), dst),
                };
                // The updated compute weights go to the device, unless they live on the host
                // too (offload.params): then the next pass stages them and counts that.
                let mut upload = |r: &Range<usize>, src: &[E]| -> BackendResult<usize> {
                    send_weights(be, params, params_at.start + r.start..params_at.start + r.end, src)
                };
                type Part<'a, E> = (&'a mut [E], &'a mut [f32], &'a mut [f32], &'a mut [f32]);
                let mut parts: Vec<Option<Part<'_, E>>> = staged
                    .chunks_mut(chunk)
                    .zip(master.chunks_mut(chunk))
                    .zip(m.chunks_mut(chunk).zip(v.chunks_mut(chunk)))
                    .map(|((s, p), (m, v))| Some((s, p, m, v)))
                    .collect();
                let (mut copies, mut exposed) = (Duration::ZERO, Duration::ZERO);
                let mut bytes_to_device = 0;
                if let Some(Some(first)) = parts.first_mut() {
                    let t = Instant::now();
                    download(&ranges[0], first.0)?;
                    let waited = t.elapsed();
                    (copies, exposed) = (waited, waited);
                }
                // The pipeline: chunk i is updated on a worker (all cores, inside) while the
                // main thread brings chunk i+1 down and sends chunk i-1 up; the step waits only
                // for the copies that outlast the update beside them.
                let opt = *opt;
                std::thread::scope(|scope| -> BackendResult {
                    let mut prev: Option<(usize, &mut [E])> = None;
                    for (i, r) in ranges.iter().enumerate() {
                        let (io, p, mm, vv) = parts[i].take().expect("each chunk is updated once");
                        let local = pieces(r);
                        let worker = scope.spawn(move || {
                            let t = Instant::now();
                            opt.update_host::<E>(local, p, io, grad_mult, mm, vv);
                            (io, t.elapsed())
                        });
                        let t = Instant::now();
                        let mut copied = false;
                        let mut moved = match parts.get_mut(i + 1) {
                            Some(Some(next)) => {
                                copied = true;
                                download(&ranges[i + 1], next.0)
                            }
                            _ => Ok(()),
                        };
                        if let (Ok(()), Some((j, done))) = (&moved, prev.take()) {
                            copied = true;
                            moved = upload(&ranges[j], done).map(|b| bytes_to_device += b);
                        }
                        // Only a copy that ran beside the update counts: an iteration with
                        // nothing to move (one chunk: the synchronous step) hides nothing.
                        let copy = if copied { t.elapsed() } else { Duration::ZERO };
                        let (io, update) = worker.join().expect("the host update does not panic");
                        moved?;
                        copies += copy;
                        exposed += copy.saturating_sub(update);
                        prev = Some((i, io));
                    }
                    if let Some((j, done)) = prev.take() {
                        let t = Instant::now();
                        bytes_to_device += upload(&ranges[j], done)?;
                        let waited = t.elapsed();
                        copies += waited;
                        exposed += waited;
                    }
                    Ok(())
                })?;
                Ok(SwapStats {
                    bytes_to_host: if grads_on_host { 0 } else { k * E::BYTES },
                    bytes_to_device,
                    transfer_ms: exposed.as_secs_f64() * 1e3,
                    hidden_ms: copies.saturating_sub(exposed).as_secs_f64() * 1e3,
                    // The pipeline's own time beyond the copies it waited for: the update.
                    host_ms: started.elapsed().saturating_sub(exposed).as_secs_f64() * 1e3,
                })
            }
        }
    }

    /// Whether this step's last backward pass sends the gradients to the host optimizer as it
    /// goes (one rank; always with the delayed update, whose gradients land beside it).
    fn streams_grads(&self) -> bool {
        match &self.opt {
            OptimizerState::Host(host) => {
                // A pipeline's tied `wte` gradient is summed across stages after the passes.
                self.comm.is_none() && self.pipe.is_none() && (self.stream_grads || host.delayed())
            }
            OptimizerState::Device { .. } => false,
        }
    }

    /// Whether this step's host update is delayed: asked for, and past the learning rate's
    /// warmup (DeepSpeed's DPU too starts after the first steps, whose large, fast-changing
    /// updates staleness hurts most).
    fn delayed_step(&self) -> bool {
        matches!(&self.opt, OptimizerState::Host(host) if host.delayed()) && self.step >= self.hyper.warmup_steps as u64
    }

    /// Drain the delayed update's pipeline: wait for the update in flight and send its weights,
    /// so the device holds the latest (done before a checkpoint and an evaluation, at steps
    /// a resumed run shares). A no-op otherwise.
    pub fn settle(&mut self) -> BackendResult {
        if let OptimizerState::Host(host) = &mut self.opt {
            let at = shard_in(self.params_sharded, &self.shard);
            let (be, params) = (&self.backend, &mut self.params);
            host.settle(|weights| send_weights(be, params, at, weights))?;
        }
        Ok(())
    }

    /// Whether the host optimizer's gradients leave during the backward pass (the default) or
    /// all after it, in the optimizer step's pipeline (the synchronous form, for comparison).
    pub fn set_stream_grads(&mut self, on: bool) {
        self.stream_grads = on;
    }

    /// The chunk of the offloaded optimizer step's pipeline, in elements (`usize::MAX`: one
    /// chunk, the synchronous step).
    pub fn set_offload_chunk(&mut self, elements: usize) {
        self.offload_chunk = elements.max(1);
    }

    /// Mean loss over `count` sequences given by `batch(index)`, in micro-batches. With sharded
    /// weights every rank must call it alike (the weights are gathered as it goes).
    pub fn evaluate(&mut self, count: usize, batch: &mut EvalBatchFn<'_>) -> BackendResult<f32> {
        self.settle()?;
        let (b, t) = (self.hyper.knobs.micro_batch, self.hyper.knobs.seq_len);
        let be = &self.backend;
        let source = source_of(&self.params, self.params_sharded, &self.shard, self.comm.as_ref(), be);
        let tp = TensorGroup::of(self.tp.as_ref());
        if let Some(pipe) = &self.pipe {
            let knobs = Knobs { micro_batch: b, seq_len: t, ..self.hyper.knobs };
            let at = Passes { be, cfg: &self.cfg, knobs: &knobs, source: source.get(), tp: &tp, dloss: 0.0 };
            return Ok(pipeline_mean_loss::<E, B>(&at, pipe, count, batch)? as f32);
        }
        Ok(model::mean_loss::<E, B>(be, &self.cfg, source.get(), count, b, t, batch, &tp)? as f32)
    }
    /// Move the persistent state on the device (compute weights, gradients, optimizer state)
    /// out of sparsely used segments and give back every wholly free segment
    /// (`engine::defrag`). Settles a delayed update first (its thread writes the weights).
    pub fn defragment(&mut self) -> BackendResult<Defragmentation> {
        self.settle()?;
        let mut buffers: Vec<&mut Buffer> = Vec::new();
        if let ParamStore::Device(b) = &mut self.params {
            buffers.push(b);
        }
        buffers.push(&mut self.grads);
        if let OptimizerState::Device { master, m, v } = &mut self.opt {
            buffers.extend(master.as_mut());
            buffers.push(m);
            buffers.push(v);
        }
        defragment(&self.backend, &mut buffers)
    }

    /// Write a checkpoint of the run `lineage` (see `run_dir`) into `run_dir` (rank 0 writes;
    /// every rank takes part in gathering the state).
    pub fn save_checkpoint(&mut self, run_dir: &Path, lineage: Option<&str>) -> Result<PathBuf, CheckpointError> {
        self.settle().map_err(|e| CheckpointError::Device { path: run_dir.into(), message: e.to_string() })?;
        let header = CheckpointHeader {
            version: checkpoint::VERSION,
            step: self.step,
            num_params: self.cfg.whole().num_params() as u64,
            model: self.cfg.dims(),
            data_cursor: self.step,
            rng_state: self.rng.state,
            seed: self.hyper.seed,
            adam_t: self.adam_t,
            loss_scale: self.loss_scale,
            lineage: lineage.map(str::to_owned),
        };
        let (master, m, v) =
            self.full_state().map_err(|e| CheckpointError::Device { path: run_dir.into(), message: e.to_string() })?;
        if !self.leads() {
            // Every rank took part in gathering the state; rank 0 writes it.
            return Ok(checkpoint::checkpoint_path(run_dir, self.step));
        }
        checkpoint::save(run_dir, &header, &master, &m, &v)
    }

    /// Resume from a checkpoint written under any precision, stage, world size, tensor-parallel
    /// split or device (it holds the whole model's fp32 master weights and moments; each rank
    /// takes what it owns).
    pub fn restore(&mut self, path: &Path, mut ckpt: Checkpoint) -> Result<(), CheckpointError> {
        let mismatch = |message: String| CheckpointError::Mismatch { path: path.into(), message };
        if ckpt.header.model != self.cfg.dims() {
            return Err(mismatch(format!(
                "model (n_layer, n_head, n_embd, block_size, vocab) {:?} != job's {:?}",
                ckpt.header.model,
                self.cfg.dims()
            )));
        }
        if ckpt.params.len() != self.cfg.whole().num_params() {
            return Err(mismatch(format!(
                "{} parameters, the model has {}",
                ckpt.params.len(),
                self.cfg.whole().num_params()
            )));
        }
        if ckpt.header.step > self.hyper.steps {
            return Err(mismatch(format!("step {} is past the job's {} steps", ckpt.header.step, self.hyper.steps)));
        }
        if self.cfg.tp.size > 1 || self.cfg.pp.stages > 1 {
            // This rank's share of the whole model, in its own layout.
            for part in [&mut ckpt.params, &mut ckpt.m, &mut ckpt.v] {
                *part = self.cfg.local_of(part);
            }
        }
        let shard = self.shard.clone();
        let k = shard.len();
        let kept = held(self.params_sharded, &shard, self.cfg.num_params());
        let be = &self.backend;
        let device = |e: BackendError| CheckpointError::Device { path: path.into(), message: e.to_string() };
        match &mut self.params {
            ParamStore::Device(buf) => {
                let mut compute = vec![E::default(); kept.len()];
                narrow::<E>(&mut compute, &ckpt.params[kept.clone()]);
                be.upload(ViewMut::range(buf, 0..kept.len()), &compute).map_err(device)?;
            }
            ParamStore::Host(host) => {
                let host = Arc::get_mut(host).expect("no copy worker holds the weights between passes");
                narrow::<E>(&mut host[..kept.len()], &ckpt.params[kept]);
            }
        }
        match &mut self.opt {
            OptimizerState::Device { master, m, v } => {
                if let Some(mw) = master {
                    be.upload(ViewMut::range(mw, 0..k), &ckpt.params[shard.clone()]).map_err(device)?;
                }
                be.upload(ViewMut::range(m, 0..k), &ckpt.m[shard.clone()]).map_err(device)?;
                be.upload(ViewMut::range(v, 0..k), &ckpt.v[shard]).map_err(device)?;
            }
            OptimizerState::Host(host) => {
                host.discard();
                let HostState { master, m, v, .. } = host.state_mut();
                master.copy_from_slice(&ckpt.params[shard.clone()]);
                m.copy_from_slice(&ckpt.m[shard.clone()]);
                v.copy_from_slice(&ckpt.v[shard]);
            }
        }
        self.step = ckpt.header.step;
        self.adam_t = ckpt.header.adam_t;
        self.rng.state = ckpt.header.rng_state;
        if self.dynamic_scale && ckpt.header.loss_scale >= 1.0 {
            self.loss_scale = ckpt.header.loss_scale;
        }
        Ok(())
    }
}

/// Write updated compute weights `at` (of the rank's store): to the device, or into host
/// memory under `offload.params` (the next pass stages them and counts that). Bytes sent.
fn send_weights<E: Elem, B: Backend>(
    be: &B,
    params: &mut ParamStore<E>,
    at: Range<usize>,
    src: &[E],
) -> BackendResult<usize> {
    match params {
        ParamStore::Device(buf) => {
            be.upload(ViewMut::range(buf, at), src)?;
            Ok(std::mem::size_of_val(src))
        }
        ParamStore::Host(host) => {
            let host = Arc::get_mut(host).expect("no copy worker holds the weights between passes");
            host[at].copy_from_slice(src);
            Ok(0)
        }
    }
}

/// Run `f` on a device view of host data: the host memory itself when the backend's pool is
/// host memory, else a workspace copy uploaded before and downloaded after.
fn on_device<T: bytemuck::Pod, B: Backend>(
    be: &B,
    host: &mut [T],
    f: impl FnOnce(ViewMut<T>) -> BackendResult,
) -> BackendResult {
    if be.pool().host_visible() {
        return f(ViewMut::from_host(host));
    }
    let mut buf = be.pool().alloc(std::mem::size_of_val(host), Category::Workspace)?;
    be.upload(ViewMut::of(&mut buf), host)?;
    f(ViewMut::of(&mut buf))?;
    be.download(View::of(&buf), host)
}

/// The parameters a buffer of a rank holds: all `n`, or only its `shard` when `sharded`.
fn held(sharded: bool, shard: &Range<usize>, n: usize) -> Range<usize> {
    if sharded {
        shard.clone()
    } else {
        0..n
    }
}

/// Where the rank's `shard` sits in such a buffer: from index 0 when the buffer holds only the
/// shard, at its own offsets when it holds everything.
fn shard_in(sharded: bool, shard: &Range<usize>) -> Range<usize> {
    if sharded {
        0..shard.len()
    } else {
        shard.clone()
    }
}

/// What every pass of a step shares: backend, model share, knobs, weights, tensor-parallel
/// group and the loss gradient.
struct Passes<'a, E, B> {
    be: &'a B,
    cfg: &'a GptConfig,
    knobs: &'a Knobs,
    source: &'a dyn ParamSource<E>,
    tp: &'a TensorGroup<'a>,
    dloss: f32,
}

/// What one stage's passes of a step came to.
struct PipelineRun {
    /// The losses' sum over the micro-batches (the last stage's; 0 on the others).
    loss_sum: f64,
    swap: SwapStats,
    /// The first failure; the stage went on taking part in every transfer after it.
    failure: Option<BackendError>,
}

/// One step's passes on a pipeline stage, GPipe: every micro-batch forward (from the previous
/// stage's output, or the embedding; the output sent on), then every micro-batch backward in
/// the same order (from the next stage's gradient, or the loss; the input's gradient sent
/// back), accumulating into `grads`. A stage that fails (an OOM) keeps taking part in each
/// transfer with a stand-in, so no other stage waits for it; the step's outcome is agreed
/// after (`settle_pipeline_step`).
fn pipeline_passes<E: Elem, B: Backend>(
    at: &Passes<'_, E, B>,
    pipe: &Pipeline,
    grads: &mut Buffer,
    step: u64,
    first_seq: usize,
    batch: &mut BatchFn<'_>,
) -> PipelineRun {
    let Passes { be, cfg, knobs, source, tp, .. } = *at;
    let (b, t, m) = (knobs.micro_batch, knobs.seq_len, knobs.grad_accum);
    let n = b * t * cfg.n_embd; // elements of a stage boundary (B,T,C)
    let mut run = PipelineRun { loss_sum: 0.0, swap: SwapStats::default(), failure: None };
    let mut kept: Vec<Option<model::Activations>> = Vec::with_capacity(m);
    for micro in 0..m {
        let (mut inputs, mut targets) = (Vec::with_capacity(b * t), Vec::with_capacity(b * t));
        for i in 0..b {
            batch(step, (first_seq + micro * b + i) as u64, &mut inputs, &mut targets);
        }
        let acts = forward_through::<E, B>(at, pipe, (&inputs, &targets, b), false, &mut run);
        run.loss_sum += acts.as_ref().map_or(0.0, |a| a.mean_loss() as f64);
        kept.push(acts);
    }
    for acts in kept {
        let dout = pipe.next.as_ref().and_then(|next| receive::<E, B>(be, next, n, Category::Workspace, &mut run));
        let mut dinput = None;
        if let (Some(acts), None, true) = (acts, &run.failure, pipe.next.is_none() || dout.is_some()) {
            let mut sink = FullGrads(ViewMut::of(grads));
            match model::backward_stage::<E, B>(be, cfg, source, &mut sink, acts, tp, dout) {
                Ok((moved, d)) => {
                    run.swap.add(moved);
                    dinput = d;
                }
                Err(e) => run.failure = Some(e),
            }
        }
        if let Some(prev) = &pipe.prev {
            send::<E, B>(be, prev, dinput.as_ref().map(View::of), n, &mut run);
        }
    }
    run
}

/// `model::mean_loss` through the stages: each chunk of sequences forward from stage to stage
/// (nothing kept for backward), the losses summed on the last stage and shared with every
/// stage; the evaluating ranks of the pipeline agree on success as a step's do.
fn pipeline_mean_loss<E: Elem, B: Backend>(
    at: &Passes<'_, E, B>,
    pipe: &Pipeline,
    count: usize,
    sequence: &mut EvalBatchFn<'_>,
) -> BackendResult<f64> {
    let Passes { be, cfg, knobs, .. } = *at;
    let (micro, t) = (knobs.micro_batch, knobs.seq_len);
    let mut run = PipelineRun { loss_sum: 0.0, swap: SwapStats::default(), failure: None };
    let mut done = 0;
    while done < count {
        let b = micro.min(count - done);
        let (mut inputs, mut targets) = (Vec::with_capacity(b * t), Vec::with_capacity(b * t));
        for i in 0..b {
            sequence(done + i, &mut inputs, &mut targets);
        }
        let acts = forward_through::<E, B>(at, pipe, (&inputs, &targets, b), true, &mut run);
        run.loss_sum += acts.as_ref().map_or(0.0, |a| a.mean_loss() as f64 * b as f64);
        done += b;
    }
    settle_pipeline_step(&pipe.stages, cfg.pp, run.failure, be.pool())?;
    Ok(pipe.stages.all_reduce_f64(run.loss_sum) / count as f64)
}

/// One micro-batch (`b` sequences of `inputs`, `targets`) through this stage's forward: its
/// input received from the previous stage (or the embedding), its output sent on. `evaluation`:
/// nothing kept for backward (full checkpointing's outputs, released as they are consumed).
fn forward_through<E: Elem, B: Backend>(
    at: &Passes<'_, E, B>,
    pipe: &Pipeline,
    (inputs, targets, b): (&[u32], &[u32], usize),
    evaluation: bool,
    run: &mut PipelineRun,
) -> Option<model::Activations> {
    let Passes { be, cfg, knobs, source, tp, dloss } = *at;
    let t = knobs.seq_len;
    let n = b * t * cfg.n_embd;
    let input = pipe.prev.as_ref().and_then(|prev| receive::<E, B>(be, prev, n, Category::Activations, run));
    let (mode, offload, head) = match evaluation {
        true => (Checkpointing::Full, OffloadTarget::None, HeadOutput::Probabilities),
        false => (knobs.checkpointing, knobs.offload_activations, HeadOutput::Gradient { dloss }),
    };
    let acts = match (&run.failure, pipe.prev.is_none() || input.is_some()) {
        (None, true) => model::forward_stage::<E, B>(
            be, cfg, source, inputs, targets, b, t, mode, offload, tp, input, evaluation, head,
        )
        .map_err(|e| run.failure = Some(e))
        .ok(),
        _ => None,
    };
    if let Some(next) = &pipe.next {
        send::<E, B>(be, next, acts.as_ref().map(|a| a.output::<E>()), n, run);
    }
    acts
}

/// Receive a stage boundary of `n` elements from the other member of `pair` into a fresh pool
/// buffer; once the stage has failed (or cannot allocate it), into a stand-in.
fn receive<E: Elem, B: Backend>(
    be: &B,
    pair: &Group,
    n: usize,
    category: Category,
    run: &mut PipelineRun,
) -> Option<Buffer> {
    if run.failure.is_none() {
        match be.pool().alloc(n * E::BYTES, category) {
            Ok(mut buf) => match pair.recv_on::<E, B>(be, ViewMut::of(&mut buf)) {
                Ok(moved) => {
                    run.swap.add(moved);
                    return Some(buf);
                }
                Err(e) => {
                    run.failure = Some(e);
                    return None;
                }
            },
            Err(e) => run.failure = Some(e.into()),
        }
    }
    pair.stand_in::<E, B>(be, n, false);
    None
}

/// Send a stage boundary to the other member of `pair`; zeros once the stage has failed.
fn send<E: Elem, B: Backend>(be: &B, pair: &Group, view: Option<View<E>>, n: usize, run: &mut PipelineRun) {
    match (view, &run.failure) {
        (Some(view), None) => match pair.send_on::<E, B>(be, view) {
            Ok(moved) => run.swap.add(moved),
            Err(e) => run.failure = Some(e),
        },
        _ => pair.stand_in::<E, B>(be, n, true),
    }
}

/// After a pipeline step's passes every rank learns whether all of them succeeded (a
/// collective of the world); if one failed, every rank fails the step with it — an OOM on any
/// stage is the step's OOM (on the others with their own pool's figures and the failing
/// stage's request), so the supervisor steps down as for any OOM.
fn settle_pipeline_step(world: &Group, at: PpStage, failure: Option<BackendError>, pool: &Pool) -> BackendResult {
    let me = world.rank() as u64;
    let first_failed = world.min_u64(if failure.is_some() { me } else { u64::MAX });
    if first_failed == u64::MAX {
        return Ok(());
    }
    // The failing rank's request and category (an OOM), or u64::MAX (another error).
    let (requested, category) = match &failure {
        Some(BackendError::Oom(oom)) if me == first_failed => (oom.requested_bytes as u64, oom.category as u64),
        _ => (u64::MAX, u64::MAX),
    };
    let requested = world.min_u64(requested);
    let category = world.min_u64(category);
    if let Some(e) = failure {
        return Err(e);
    }
    tracing::error!("stage {} stops: rank {first_failed} failed this step", at.stage);
    match Category::ALL.get(category as usize).copied() {
        Some(category) if requested != u64::MAX => Err(BackendError::Oom(crate::memory::OomError {
            requested_bytes: requested as usize,
            category,
            stats: Box::new(pool.stats()),
        })),
        _ => Err(BackendError::Device {
            op: "pipeline step",
            device: format!("stage {}", at.stage),
            detail: format!("rank {first_failed} failed this step"),
        }),
    }
}

/// A rank's groups: data-parallel (gradients, ZeRO), tensor-parallel and pipeline; `None`
/// for a dimension of size 1.
#[derive(Clone, Default)]
pub struct RankGroups {
    pub data: Option<Group>,
    pub tensor: Option<Group>,
    pub pipeline: Option<Pipeline>,
}

/// A pipeline stage's links: the stage group (ranked by stage), the pairs it shares with the
/// previous and the next stage (activations forward, their gradients back), the group of the
/// first and last stage (the tied `wte`'s gradient), and the world (every stage agrees on a
/// step's success).
#[derive(Clone)]
pub struct Pipeline {
    pub stages: Group,
    pub prev: Option<Group>,
    pub next: Option<Group>,
    pub ends: Option<Group>,
    pub world: Group,
}

impl RankGroups {
    /// A rank's groups, split from its world group (a collective of the world). The world is
    /// ordered stage-major, then data-parallel, then tensor-parallel: rank = (stage · dp +
    /// d) · tp + t, so a tensor-parallel group is `tp` consecutive ranks (the closest together:
    /// threads of one process, GPUs of one machine), a data-parallel group the ranks at the
    /// same place in theirs on one stage, a pipeline the ranks at the same place on every
    /// stage. Each gets its own native communicator where the world has one on `be` (NCCL),
    /// else stages through the host. Process groups wait up to `timeout` for each sub-group's
    /// members.
    pub fn split<B: Backend>(
        be: &B,
        world: Option<&Group>,
        tp: usize,
        pp: usize,
        timeout: Duration,
    ) -> Result<RankGroups, RendezvousError> {
        let Some(world) = world.filter(|w| w.world() > 1) else {
            return Ok(RankGroups::default());
        };
        let (tp, pp) = (tp.max(1), pp.max(1));
        if tp == 1 && pp == 1 {
            return Ok(RankGroups { data: Some(world.clone()), tensor: None, pipeline: None });
        }
        let r = world.rank();
        let dp = world.world() / (tp * pp);
        let sized = |g: Group| (g.world() > 1).then_some(g);
        let tensor = sized(world.split_on(be, (r / tp) as u64, timeout)?);
        let data = sized(world.split_on(be, ((r / (tp * dp)) * tp + r % tp) as u64, timeout)?);
        let pipeline = if pp > 1 {
            let stages = world.split_on(be, (r % (tp * dp)) as u64, timeout)?;
            let s = stages.rank();
            // Pairs (0,1), (2,3), … and (1,2), (3,4), …: each stage is in one of each.
            let even = sized(stages.split_on(be, (s / 2) as u64, timeout)?);
            let odd = sized(stages.split_on(be, s.div_ceil(2) as u64, timeout)?);
            let (next, prev) = if s % 2 == 0 { (even, odd) } else { (odd, even) };
            let end = s == 0 || s + 1 == pp;
            let ends = sized(stages.split_on(be, if end { 0 } else { s as u64 + 1 }, timeout)?);
            Some(Pipeline { stages, prev, next, ends, world: world.clone() })
        } else {
            None
        };
        Ok(RankGroups { data, tensor, pipeline })
    }
}

/// The weight source for a pass over weights kept in `params` (a shard of them if `sharded`).
fn source_of<'a, E: Elem, B: Backend>(
    params: &'a ParamStore<E>,
    sharded: bool,
    shard: &Range<usize>,
    comm: Option<&'a Group>,
    backend: &'a B,
) -> Source<'a, E, B> {
    match (params, sharded, comm) {
        (store, true, Some(comm)) => Source::Gathered(Gathered::new(
            store.view().slice(0..shard.len()),
            shard.clone(),
            comm,
            backend,
            matches!(store, ParamStore::Host(_)),
        )),
        (ParamStore::Host(host), _, _) => Source::Host(HostStaged::new(Arc::clone(host), backend)),
        (ParamStore::Device(buf), _, _) => Source::Resident(Resident(View::of(buf))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Checkpointing;
    use crate::engine::rng::mix64;

    fn tiny() -> (GptConfig, Hyper) {
        let cfg = GptConfig {
            n_layer: 1,
            n_head: 2,
            n_embd: 16,
            block_size: 8,
            vocab: 32,
            tp: TpShard::NONE,
            pp: PpStage::NONE,
        };
        let hyper = Hyper {
            knobs: Knobs {
                micro_batch: 2,
                grad_accum: 2,
                seq_len: 8,
                checkpointing: Checkpointing::None,
                offload_optimizer: false,
                offload_params: false,
                offload_activations: OffloadTarget::None,
                delayed_update: false,
                world_size: 1,
                tensor_parallel: 1,
                pipeline_parallel: 1,
                zero_stage: 0,
                precision: crate::config::Precision::Fp32,
                expandable_segments: false,
                static_allocator: false,
            },
            steps: 10,
            global_batch: 4,
            lr: 1e-3,
            warmup_steps: 0,
            weight_decay: 0.1,
            grad_clip: 1.0,
            seed: 3,
        };
        (cfg, hyper)
    }

    /// After its first step a training step takes no memory from the device: the pool's cache
    /// serves every request (`MemStats::num_reserves` stays put), so on a GPU a steady-state
    /// step makes no cuMemAlloc or cuMemMap call — resident, checkpointed or offloaded, with
    /// fixed or expandable segments, in fp32 and bf16.
    #[test]
    fn after_its_first_step_a_step_takes_no_memory_from_the_device() {
        fn reserves<E: Elem>(knobs: Knobs, expandable: bool) -> Vec<u64> {
            // Buffers above the small-block limit (1 MiB), as any real model's, so freed
            // segments could go back to the device.
            let cfg = GptConfig { n_layer: 2, n_head: 4, n_embd: 128, block_size: 32, vocab: 256, ..tiny().0 };
            let (_, mut hyper) = tiny();
            hyper.knobs = Knobs { expandable_segments: expandable, seq_len: 32, ..knobs };
            let pool = Pool::host("cpu", 256 << 20, expandable);
            let mut tr = Trainer::<E>::new(cfg, hyper, pool.clone()).unwrap();
            let mut batch = |s: u64, i: u64, inp: &mut Vec<u32>, tgt: &mut Vec<u32>| {
                for p in 0..32u64 {
                    inp.push((mix64(s * 31 + i * 7 + p) % 256) as u32);
                    tgt.push((mix64(s * 31 + i * 7 + p + 1) % 256) as u32);
                }
            };
            (0..4)
                .map(|_| {
                    tr.train_step(&mut batch).unwrap();
                    pool.stats().num_reserves
                })
                .collect()
        }
        let k = tiny().1.knobs;
        let offloaded = Knobs {
            checkpointing: Checkpointing::Full,
            offload_optimizer: true,
            offload_params: true,
            offload_activations: OffloadTarget::CpuInt8,
            ..k
        };
        let cases = [
            ("plain", k),
            (
                "full checkpointing, micro-batch 1",
                Knobs { checkpointing: Checkpointing::Full, micro_batch: 1, grad_accum: 4, ..k },
            ),
            ("everything offloaded", offloaded),
        ];
        for (name, knobs) in cases {
            for expandable in [false, true] {
                for (dtype, r) in
                    [("fp32", reserves::<f32>(knobs, expandable)), ("bf16", reserves::<half::bf16>(knobs, expandable))]
                {
                    let case = format!("{name}, {dtype}, expandable {expandable}: reserves after each step {r:?}");
                    assert!(r[0] > 0, "{case}");
                    assert!(r.windows(2).all(|w| w[0] == w[1]), "{case}");
                }
            }
        }
    }

    fn batch(s: u64, i: u64, inp: &mut Vec<u32>, tgt: &mut Vec<u32>) {
        for p in 0..8u64 {
            inp.push((mix64(s * 31 + i * 7 + p) % 32) as u32);
            tgt.push((mix64(s * 31 + i * 7 + p + 1) % 32) as u32);
        }
    }

    /// `wte`'s padding rows (past the vocabulary, 32 → 64 rows here) start at zero and stay
    /// zero through training — no token selects them, their logits get no gradient, and AdamW
    /// moves nothing with a zero gradient and zero moments — while the vocabulary's rows learn;
    /// in every storage type, and with the optimizer on the host.
    #[test]
    fn the_padding_rows_of_the_vocabulary_stay_zero_through_training() {
        fn padding_after_steps<E: Elem>(offload_optimizer: bool) -> (Vec<f32>, bool) {
            let (cfg, mut hyper) = tiny();
            hyper.knobs.offload_optimizer = offload_optimizer;
            let mut tr = Trainer::<E>::new(cfg, hyper, Pool::new("cpu", 64 << 20)).unwrap();
            let before = tr.master_params().unwrap();
            for _ in 0..3 {
                assert!(tr.train_step(&mut batch).unwrap().loss.is_finite());
            }
            let after = tr.master_params().unwrap();
            let (real, padded) = (cfg.vocab * cfg.n_embd, cfg.padded_vocab() * cfg.n_embd);
            (after[real..padded].to_vec(), after[..real] != before[..real])
        }
        let (cfg, _) = tiny();
        assert_eq!((cfg.vocab, cfg.padded_vocab()), (32, 64));
        for (padding, learned) in [
            padding_after_steps::<f32>(false),
            padding_after_steps::<half::bf16>(false),
            padding_after_steps::<half::f16>(false),
            padding_after_steps::<half::bf16>(true),
        ] {
            assert_eq!(padding.len(), 32 * 16);
            assert!(padding.iter().all(|&x| x == 0.0), "padding rows moved: {padding:?}");
            assert!(learned, "the vocabulary's rows learn");
        }
    }

    /// A run checkpointed before the vocabulary padding (a version-1 file: `wte` with `vocab`
    /// rows) resumes and trains on exactly as the run that wrote it.
    #[test]
    fn a_run_resumes_from_a_checkpoint_written_before_the_vocabulary_padding() {
        let (cfg, hyper) = tiny();
        let dir = tempfile::tempdir().unwrap();
        let mut original = Trainer::<f32>::new(cfg, hyper.clone(), Pool::new("cpu", 64 << 20)).unwrap();
        for _ in 0..2 {
            original.train_step(&mut batch).unwrap();
        }
        let path = original.save_checkpoint(dir.path(), None).unwrap();
        // The same state in the layout before the padding, as version 1 wrote it.
        let ckpt = checkpoint::load(&path).unwrap();
        let (real, padded) = (cfg.vocab * cfg.n_embd, cfg.padded_vocab() * cfg.n_embd);
        let unpadded = |x: &[f32]| [&x[..real], &x[padded..]].concat();
        let header =
            CheckpointHeader { version: 1, num_params: (cfg.num_params() - (padded - real)) as u64, ..ckpt.header };
        let old = dir.path().join("old");
        let old_path =
            checkpoint::save(&old, &header, &unpadded(&ckpt.params), &unpadded(&ckpt.m), &unpadded(&ckpt.v)).unwrap();
        let mut resumed = Trainer::<f32>::new(cfg, hyper, Pool::new("cpu", 64 << 20)).unwrap();
        resumed.restore(&old_path, checkpoint::load(&old_path).unwrap()).unwrap();
        assert_eq!(resumed.master_params().unwrap(), original.master_params().unwrap());
        for _ in 0..2 {
            let (a, b) = (original.train_step(&mut batch).unwrap(), resumed.train_step(&mut batch).unwrap());
            assert_eq!((a.step, a.loss.to_bits()), (b.step, b.loss.to_bits()));
        }
        assert_eq!(resumed.master_params().unwrap(), original.master_params().unwrap());
    }

    #[test]
    fn fp16_overflow_skips_the_step_and_halves_the_scale() {
        let (cfg, hyper) = tiny();
        let mut tr = Trainer::<half::f16>::new(cfg, hyper, Pool::new("cpu", 64 << 20)).unwrap();
        assert_eq!(tr.loss_scale(), INITIAL_LOSS_SCALE);
        let before = tr.master_params().unwrap();
        // A scale this large makes the fp16 gradients overflow to infinity.
        tr.set_loss_scale(1e30);
        let s = tr.train_step(&mut batch).unwrap();
        assert!(s.skipped, "overflowed step skipped");
        assert_eq!(s.loss_scale, 5e29, "scale halved");
        assert_eq!(tr.skipped_steps, 1);
        assert_eq!(tr.master_params().unwrap(), before, "weights untouched by a skipped step");
        tr.set_loss_scale(1024.0);
        let s = tr.train_step(&mut batch).unwrap();
        assert!(!s.skipped && s.grad_norm.is_finite());
        assert_ne!(tr.master_params().unwrap(), before, "a good step updates the weights");
        assert_eq!(tr.step, 2, "the skipped step still consumed its batch");
    }

    /// Defragmenting between steps moves the model state out of a segment it shared with
    /// cache into one another buffer keeps alive, gives the emptied segment back, and the
    /// training goes on bit for bit as without it.
    #[test]
    fn defragmenting_between_steps_moves_the_state_and_changes_nothing() {
        let cfg = GptConfig {
            n_layer: 2,
            n_head: 4,
            n_embd: 128,
            block_size: 32,
            vocab: 256,
            tp: TpShard::NONE,
            pp: PpStage::NONE,
        };
        let (_, mut hyper) = tiny();
        hyper.knobs.seq_len = 32;
        let mut batch = |s: u64, i: u64, inp: &mut Vec<u32>, tgt: &mut Vec<u32>| {
            for p in 0..32u64 {
                inp.push((mix64(s * 31 + i * 7 + p) % 256) as u32);
                tgt.push((mix64(s * 31 + i * 7 + p + 1) % 256) as u32);
            }
        };
        let run = |defragment: bool, batch: &mut BatchFn<'_>| {
            let pool = Pool::new("cpu", 256 << 20);
            // The model state (four 1.7 MiB buffers) is carved from one cached 8 MiB segment.
            drop(pool.alloc(8 << 20, Category::Workspace).unwrap());
            let mut tr = Trainer::<f32>::new(cfg, hyper.clone(), pool.clone()).unwrap();
            let mut losses = Vec::new();
            let mut moved = None;
            for step in 0..4 {
                losses.push(tr.train_step(batch).unwrap().loss.to_bits());
                if defragment && step == 1 {
                    // A long-lived buffer elsewhere, in a segment with room for the state.
                    drop(pool.alloc(32 << 20, Category::Workspace).unwrap());
                    let tenant = pool.alloc(2 << 20, Category::Workspace).unwrap();
                    let d = tr.defragment().unwrap();
                    assert!(d.after.reserved < d.before.reserved, "a segment went back: {d:?}");
                    moved = Some((d, tenant));
                }
            }
            (losses, tr.master_params().unwrap(), moved)
        };
        let (losses, master, _) = run(false, &mut batch);
        let (d_losses, d_master, moved) = run(true, &mut batch);
        let (d, _) = moved.unwrap();
        assert_eq!(d.moved_buffers, 4, "the weights (fp32: also the master), gradients and both moments: {d:?}");
        assert_eq!(d_losses, losses, "losses bitwise");
        assert_eq!(d_master, master, "weights bitwise");
    }

    /// `memory.allocator: static`: the same training bit for bit; after the recorded first
    /// step no request searches the pool, none misses the plan, and the step's reserved bytes
    /// stay within 2% of its allocated peak.
    #[test]
    fn the_static_allocator_trains_identically_with_no_search_after_the_first_step() {
        // Model state above the small-block limit (1 MiB per buffer), as any real model's.
        let cfg = GptConfig {
            n_layer: 2,
            n_head: 4,
            n_embd: 128,
            block_size: 32,
            vocab: 256,
            tp: TpShard::NONE,
            pp: PpStage::NONE,
        };
        let run = |static_allocator: bool, checkpointing: Checkpointing| {
            let (_, mut hyper) = tiny();
            hyper.knobs = Knobs { seq_len: 32, static_allocator, checkpointing, ..hyper.knobs };
            let pool = Pool::new("cpu", 256 << 20);
            let mut tr = Trainer::<f32>::new(cfg, hyper, pool.clone()).unwrap();
            let mut batch = |s: u64, i: u64, inp: &mut Vec<u32>, tgt: &mut Vec<u32>| {
                for p in 0..32u64 {
                    inp.push((mix64(s * 31 + i * 7 + p) % 256) as u32);
                    tgt.push((mix64(s * 31 + i * 7 + p + 1) % 256) as u32);
                }
            };
            let mut losses = Vec::new();
            let mut searches = Vec::new();
            let mut ratio = 0.0f64;
            for step in 0..5 {
                pool.reset_window_peaks();
                losses.push(tr.train_step(&mut batch).unwrap().loss.to_bits());
                let st = pool.stats();
                searches.push(st.num_searches);
                if step >= 1 {
                    ratio = ratio.max(st.window_peak_reserved as f64 / st.window_peak_allocated as f64);
                }
            }
            (losses, tr.master_params().unwrap(), searches, ratio, pool.stats())
        };
        for checkpointing in [Checkpointing::None, Checkpointing::Full] {
            let (losses, master, _, cached_ratio, _) = run(false, checkpointing);
            let (static_losses, static_master, searches, ratio, stats) = run(true, checkpointing);
            assert_eq!(static_losses, losses, "{checkpointing:?}: losses bitwise");
            assert_eq!(static_master, master, "{checkpointing:?}: weights bitwise");
            assert!(
                searches[1..].windows(2).all(|w| w[0] == w[1]),
                "{checkpointing:?}: no search after step 1: {searches:?}"
            );
            assert_eq!(stats.num_plan_misses, 0, "{checkpointing:?}");
            assert!(stats.num_planned > 0);
            println!("{checkpointing:?}: peak reserved / peak allocated per step: caching {cached_ratio:.4}, static {ratio:.4}");
            assert!(ratio <= 1.02, "{checkpointing:?}: reserved {ratio:.4}× allocated");
        }
    }

    #[test]
    fn sixteen_bit_memory_is_smaller_per_category() {
        let (cfg, hyper) = tiny();
        let n = cfg.num_params();
        let p32 = Pool::new("cpu", 64 << 20);
        let _t32 = Trainer::<f32>::new(cfg, hyper.clone(), p32.clone()).unwrap();
        let p16 = Pool::new("cpu", 64 << 20);
        let _t16 = Trainer::<half::bf16>::new(cfg, hyper, p16.clone()).unwrap();
        let (a, b) = (p32.stats(), p16.stats());
        let r = |x: usize| x.div_ceil(crate::memory::ROUND) * crate::memory::ROUND;
        assert_eq!(a.current(Category::Params), r(4 * n));
        assert_eq!(b.current(Category::Params), r(2 * n), "bf16 compute weights");
        assert_eq!(b.current(Category::Grads), r(2 * n), "bf16 gradients");
        assert_eq!(b.current(Category::Optimizer), 3 * r(4 * n), "fp32 master + m + v");
    }
}
