//! The training state (weights, gradients, AdamW moments in the pool) and one optimizer step
//! with gradient accumulation; evaluation; checkpoint save/restore.

use std::path::{Path, PathBuf};

use crate::config::{Checkpointing, JobSpec, OffloadTarget};
use crate::memory::{Buffer, Category, OomError, Pool};

use super::checkpoint::{self, Checkpoint, CheckpointError, CheckpointHeader};
use super::comm::{shard_range, Comm, LocalComm};
use super::layers::{narrow, widen, Elem};
use super::model::{self, alloc_elems, alloc_f32, GptConfig, TensorInfo};
use super::optim::{clip_coefficient, lr_at, sum_squares, AdamW};
use super::rng::Rng;

/// Hyper-parameters of the loop, resolved from the job spec.
#[derive(Debug, Clone)]
pub struct Hyper {
    pub steps: u64,
    pub global_batch: usize,
    pub micro_batch: usize,
    pub grad_accum: usize,
    pub seq_len: usize,
    pub lr: f64,
    pub warmup_steps: usize,
    pub weight_decay: f64,
    pub grad_clip: f64,
    pub seed: u64,
    pub checkpointing: Checkpointing,
    /// Optimizer state and master weights in host memory.
    pub offload_optimizer: bool,
    /// Block outputs kept for backward in host memory (needs full checkpointing).
    pub offload_activations: OffloadTarget,
    /// Data-parallel ranks and the ZeRO stage (0: replicated, 1: sharded optimizer state).
    pub world_size: usize,
    pub zero_stage: usize,
}

impl Hyper {
    pub fn from_spec(spec: &JobSpec) -> Hyper {
        let t = &spec.train;
        Hyper {
            steps: t.steps as u64,
            global_batch: t.global_batch as usize,
            micro_batch: t.micro_batch as usize,
            grad_accum: spec.grad_accum(),
            seq_len: spec.model.block_size as usize,
            lr: t.lr,
            warmup_steps: t.warmup_steps as usize,
            weight_decay: t.weight_decay,
            grad_clip: t.grad_clip,
            seed: t.seed,
            checkpointing: spec.memory.checkpointing,
            offload_optimizer: spec.memory.offload.optimizer != OffloadTarget::None,
            offload_activations: spec.memory.offload.activations,
            world_size: spec.memory.world_size as usize,
            zero_stage: spec.memory.zero_stage as usize,
        }
    }
}

pub fn gpt_config(spec: &JobSpec) -> GptConfig {
    let m = &spec.model;
    GptConfig {
        n_layer: m.n_layer as usize,
        n_head: m.n_head as usize,
        n_embd: m.n_embd as usize,
        block_size: m.block_size as usize,
        vocab: m.vocab.size(),
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
}

/// Where a training sequence comes from: (step, index in global batch, inputs, targets).
pub type BatchFn<'a> = dyn FnMut(u64, u64, &mut Vec<u32>, &mut Vec<u32>) + 'a;

/// Where a validation sequence comes from: (index, inputs, targets).
pub type EvalBatchFn<'a> = dyn FnMut(usize, &mut Vec<u32>, &mut Vec<u32>) + 'a;

/// Initial fp16 loss scale (2^16) and the run of good steps after which it doubles.
pub const INITIAL_LOSS_SCALE: f64 = 65536.0;
pub const LOSS_SCALE_GROWTH_INTERVAL: u64 = 200;

/// Where the fp32 master weights and the AdamW moments live.
enum OptimizerState {
    /// On the device, in the optimizer category. `master` is None for fp32, whose compute
    /// weights are the master.
    Device { master: Option<Buffer>, m: Buffer, v: Buffer },
    /// In host memory (`offload.optimizer: cpu`): each step the gradients go device→host,
    /// AdamW runs on the host, and the updated weights go host→device.
    Host { master: Vec<f32>, m: Vec<f32>, v: Vec<f32>, grads: Vec<f32> },
}

pub use super::model::SwapStats;

/// Model state on the device: every tensor a pool buffer tagged with its category.
/// `E` is the compute precision of parameters, gradients and activations; with a 16-bit `E`
/// the fp32 master weights live in the optimizer category beside the AdamW moments.
pub struct Trainer<E: Elem = f32> {
    pub cfg: GptConfig,
    pub hyper: Hyper,
    pub pool: Pool,
    tensors: Vec<TensorInfo>,
    /// Compute copy of the weights, in `E`.
    params: Buffer,
    grads: Buffer,
    /// fp32 master weights and AdamW moments, on the device or offloaded to the host. Under
    /// ZeRO-1 only this rank's shard (`shard`) of them.
    opt: OptimizerState,
    /// The parameter range whose optimizer state this rank owns (everything unless sharded).
    shard: std::ops::Range<usize>,
    /// `tensors` clipped to `shard`, offsets relative to its start.
    shard_tensors: Vec<TensorInfo>,
    comm: Option<LocalComm>,
    /// Optimizer steps completed (skipped fp16 steps included: their data is consumed).
    pub step: u64,
    adam_t: u64,
    rng: Rng,
    /// Dynamic loss scaling (fp16 only).
    dynamic_scale: bool,
    loss_scale: f64,
    good_steps: u64,
    pub skipped_steps: u64,
    _elem: std::marker::PhantomData<E>,
}

impl<E: Elem> Trainer<E> {
    /// Allocate parameters, gradients and optimizer state, and initialise the weights.
    pub fn new(cfg: GptConfig, hyper: Hyper, pool: Pool) -> Result<Trainer<E>, OomError> {
        Self::new_rank(cfg, hyper, pool, None)
    }

    /// One data-parallel rank of a group (`comm`), with ZeRO-1 sharding of the optimizer state
    /// when `hyper.zero_stage >= 1`. Every rank allocates equal (padded) shards, so all ranks
    /// make the same allocations and an OOM happens on all of them alike.
    pub fn new_rank(cfg: GptConfig, hyper: Hyper, pool: Pool, comm: Option<LocalComm>) -> Result<Trainer<E>, OomError> {
        let n = cfg.num_params();
        let (rank, world) = comm.as_ref().map(|c| (c.rank(), c.world())).unwrap_or((0, 1));
        let sharded = hyper.zero_stage >= 1 && world > 1;
        let shard = if sharded { shard_range(n, rank, world) } else { 0..n };
        let state_len = if sharded { n.div_ceil(world) } else { n };
        let mut params = alloc_elems::<E>(&pool, n, Category::Params)?;
        let grads = alloc_elems::<E>(&pool, n, Category::Grads)?;
        let opt = if hyper.offload_optimizer {
            let mut master = vec![0.0f32; n];
            cfg.init_params(&mut master, hyper.seed);
            narrow::<E>(params.as_mut_slice(), &master);
            pool.set_host_bytes(Category::Optimizer, 4 * 4 * n);
            OptimizerState::Host { master, m: vec![0.0; n], v: vec![0.0; n], grads: vec![0.0; n] }
        } else {
            let mut master = if E::is_f32() { None } else { Some(alloc_f32(&pool, state_len, Category::Optimizer)?) };
            let m = alloc_f32(&pool, state_len, Category::Optimizer)?;
            let v = alloc_f32(&pool, state_len, Category::Optimizer)?;
            match (E::as_f32_mut(params.as_mut_slice::<E>()), master.as_mut()) {
                (Some(p), _) => cfg.init_params(p, hyper.seed),
                (None, Some(mw)) => {
                    // Every rank initialises the same full weights; it keeps its master shard.
                    let mut full = vec![0.0f32; n];
                    cfg.init_params(&mut full, hyper.seed);
                    narrow::<E>(params.as_mut_slice(), &full);
                    mw.as_mut_slice::<f32>()[..shard.len()].copy_from_slice(&full[shard.clone()]);
                }
                (None, None) => unreachable!("16-bit params always have a master copy"),
            }
            OptimizerState::Device { master, m, v }
        };
        let tensors = cfg.tensors();
        let shard_tensors = tensors
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
            tensors,
            shard,
            shard_tensors,
            comm,
            cfg,
            hyper,
            pool,
            params,
            grads,
            opt,
            step: 0,
            adam_t: 0,
            rng,
            dynamic_scale,
            loss_scale: if dynamic_scale { INITIAL_LOSS_SCALE } else { 1.0 },
            good_steps: 0,
            skipped_steps: 0,
            _elem: std::marker::PhantomData,
        })
    }

    /// The fp32 master weights.
    /// This rank's fp32 master weights (all of them unless the optimizer state is sharded).
    pub fn master_params(&self) -> &[f32] {
        let k = self.shard.len();
        match &self.opt {
            OptimizerState::Device { master: Some(m), .. } => &m.as_slice()[..k],
            OptimizerState::Device { master: None, .. } => &self.params.as_slice()[self.shard.clone()],
            OptimizerState::Host { master, .. } => master,
        }
    }

    /// This rank's AdamW first and second moments.
    fn moments(&self) -> (&[f32], &[f32]) {
        let k = self.shard.len();
        match &self.opt {
            OptimizerState::Device { m, v, .. } => (&m.as_slice()[..k], &v.as_slice()[..k]),
            OptimizerState::Host { m, v, .. } => (m, v),
        }
    }

    fn rank(&self) -> usize {
        self.comm.as_ref().map_or(0, |c| c.rank())
    }

    fn world(&self) -> usize {
        self.comm.as_ref().map_or(1, |c| c.world())
    }

    /// Full master weights and moments (gathered from every rank when sharded).
    fn full_state(&self) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let (m, v) = self.moments();
        let master = self.master_params();
        if self.shard.len() == self.cfg.num_params() {
            return (master.to_vec(), m.to_vec(), v.to_vec());
        }
        let n = self.cfg.num_params();
        let comm = self.comm.as_ref().expect("sharded state has a group");
        let gather = |part: &[f32]| {
            let mut full = vec![0f32; n];
            full[self.shard.clone()].copy_from_slice(part);
            comm.all_gather(&mut full, self.shard.clone());
            full
        };
        (gather(master), gather(m), gather(v))
    }

    pub fn loss_scale(&self) -> f64 {
        self.loss_scale
    }

    /// Override the dynamic loss scale (fp16), e.g. to start lower than 2^16.
    pub fn set_loss_scale(&mut self, scale: f64) {
        self.loss_scale = scale;
    }

    fn model_dims(&self) -> [u64; 5] {
        let c = &self.cfg;
        [c.n_layer, c.n_head, c.n_embd, c.block_size, c.vocab].map(|x| x as u64)
    }

    /// One optimizer step over the global batch, accumulating `grad_accum` micro-batches.
    pub fn train_step(&mut self, batch: &mut BatchFn<'_>) -> Result<StepStats, OomError> {
        let started = std::time::Instant::now();
        let h = self.hyper.clone();
        let (b, t) = (h.micro_batch, h.seq_len);
        self.grads.as_mut_slice::<E>().fill(E::default());
        let scale = self.loss_scale as f32;
        let world = self.world();
        let dloss = scale / (b * t * h.grad_accum * world) as f32;
        // This rank's slice of the global batch.
        let first_seq = self.rank() * b * h.grad_accum;
        let mut loss_sum = 0.0f64;
        let mut act_swap = SwapStats::default();
        let (mut inputs, mut targets) = (Vec::with_capacity(b * t), Vec::with_capacity(b * t));
        for micro in 0..h.grad_accum {
            inputs.clear();
            targets.clear();
            for i in 0..b {
                batch(self.step, (first_seq + micro * b + i) as u64, &mut inputs, &mut targets);
            }
            let params = self.params.as_slice::<E>();
            let acts = model::forward::<E>(
                &self.cfg,
                params,
                &self.pool,
                &inputs,
                &targets,
                b,
                t,
                h.checkpointing,
                h.offload_activations,
            )?;
            loss_sum += acts.mean_loss() as f64;
            let moved = model::backward::<E>(&self.cfg, params, self.grads.as_mut_slice(), &self.pool, acts, dloss)?;
            act_swap.add(moved);
        }
        if let Some(comm) = &self.comm {
            comm.all_reduce_sum(self.grads.as_mut_slice::<E>());
            let mut l = [loss_sum as f32];
            comm.all_reduce_sum(&mut l);
            loss_sum = l[0] as f64 / world as f64;
        }
        let lr = lr_at(self.step as usize, h.lr, h.warmup_steps, h.steps as usize);
        let inv_scale = 1.0 / self.loss_scale;
        let grad_norm = sum_squares(self.grads.as_slice::<E>()).sqrt() * inv_scale;
        let skipped = !grad_norm.is_finite();
        let mut swap = (h.offload_activations != OffloadTarget::None).then_some(act_swap);
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
            let shard = self.shard.clone();
            let k = shard.len();
            let grads = &self.grads.as_slice::<E>()[shard.clone()];
            match &mut self.opt {
                OptimizerState::Device { master: Some(mw), m, v } => {
                    let mw = &mut mw.as_mut_slice::<f32>()[..k];
                    let (m, v) = (&mut m.as_mut_slice::<f32>()[..k], &mut v.as_mut_slice::<f32>()[..k]);
                    opt.update::<E>(&self.shard_tensors, mw, grads, grad_mult, m, v);
                    narrow::<E>(&mut self.params.as_mut_slice::<E>()[shard.clone()], mw);
                }
                OptimizerState::Device { master: None, m, v } => {
                    let p = E::as_f32_mut(self.params.as_mut_slice::<E>()).expect("fp32 params are the master");
                    let (m, v) = (&mut m.as_mut_slice::<f32>()[..k], &mut v.as_mut_slice::<f32>()[..k]);
                    opt.update::<E>(&self.shard_tensors, &mut p[shard.clone()], grads, grad_mult, m, v);
                }
                OptimizerState::Host { master, m, v, grads: host_grads } => {
                    let t0 = std::time::Instant::now();
                    widen::<E>(host_grads, grads);
                    let mut transfer = t0.elapsed();
                    opt.update::<f32>(&self.tensors, master, host_grads, grad_mult, m, v);
                    let t1 = std::time::Instant::now();
                    narrow::<E>(self.params.as_mut_slice(), master);
                    transfer += t1.elapsed();
                    swap.get_or_insert_with(SwapStats::default).add(SwapStats {
                        bytes_to_host: grads.len() * E::BYTES,
                        bytes_to_device: grads.len() * E::BYTES,
                        transfer_ms: transfer.as_secs_f64() * 1e3,
                    });
                }
            }
            if let (Some(comm), true) = (&self.comm, k < self.cfg.num_params()) {
                // ZeRO-1: every rank updated its shard; gather the full weights everywhere.
                comm.all_gather(self.params.as_mut_slice::<E>(), shard);
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
        let secs = started.elapsed().as_secs_f64();
        Ok(StepStats {
            step: self.step,
            loss: (loss_sum / h.grad_accum as f64) as f32,
            lr,
            grad_norm,
            step_ms: secs * 1e3,
            tokens_per_s: (h.global_batch * t) as f64 / secs.max(1e-9),
            loss_scale: self.loss_scale,
            skipped,
            swap,
        })
    }

    /// Mean loss over `count` sequences given by `batch(index)`, in micro-batches.
    pub fn evaluate(&self, count: usize, batch: &mut EvalBatchFn<'_>) -> Result<f32, OomError> {
        let (b, t) = (self.hyper.micro_batch, self.hyper.seq_len);
        let mut total = 0.0f64;
        let mut done = 0;
        while done < count {
            let n = b.min(count - done);
            let (mut inputs, mut targets) = (Vec::with_capacity(n * t), Vec::with_capacity(n * t));
            for i in 0..n {
                batch(done + i, &mut inputs, &mut targets);
            }
            // Evaluation keeps nothing for backward: only block outputs live through the pass.
            let params = self.params.as_slice::<E>();
            let acts = model::forward::<E>(
                &self.cfg,
                params,
                &self.pool,
                &inputs,
                &targets,
                n,
                t,
                Checkpointing::Full,
                OffloadTarget::None,
            )?;
            total += acts.mean_loss() as f64 * n as f64;
            done += n;
        }
        Ok((total / count as f64) as f32)
    }

    pub fn save_checkpoint(&self, run_dir: &Path) -> Result<PathBuf, CheckpointError> {
        let header = CheckpointHeader {
            version: 1,
            step: self.step,
            num_params: self.cfg.num_params() as u64,
            model: self.model_dims(),
            data_cursor: self.step,
            rng_state: self.rng.state,
            seed: self.hyper.seed,
            adam_t: self.adam_t,
            loss_scale: self.loss_scale,
        };
        let (master, m, v) = self.full_state();
        if self.rank() != 0 {
            // Every rank took part in gathering the state; rank 0 writes it.
            return Ok(checkpoint::checkpoint_path(run_dir, self.step));
        }
        checkpoint::save(run_dir, &header, &master, &m, &v)
    }

    /// Resume from a checkpoint written under any precision (it holds fp32 master weights).
    pub fn restore(&mut self, path: &Path, ckpt: Checkpoint) -> Result<(), CheckpointError> {
        let mismatch = |message: String| CheckpointError::Mismatch { path: path.into(), message };
        if ckpt.header.model != self.model_dims() {
            return Err(mismatch(format!(
                "model (n_layer, n_head, n_embd, block_size, vocab) {:?} != job's {:?}",
                ckpt.header.model,
                self.model_dims()
            )));
        }
        if ckpt.header.step > self.hyper.steps {
            return Err(mismatch(format!("step {} is past the job's {} steps", ckpt.header.step, self.hyper.steps)));
        }
        let shard = self.shard.clone();
        let k = shard.len();
        match &mut self.opt {
            OptimizerState::Device { master, m, v } => {
                narrow::<E>(self.params.as_mut_slice(), &ckpt.params);
                if let Some(mw) = master {
                    mw.as_mut_slice::<f32>()[..k].copy_from_slice(&ckpt.params[shard.clone()]);
                }
                m.as_mut_slice::<f32>()[..k].copy_from_slice(&ckpt.m[shard.clone()]);
                v.as_mut_slice::<f32>()[..k].copy_from_slice(&ckpt.v[shard]);
            }
            OptimizerState::Host { master, m, v, .. } => {
                master.copy_from_slice(&ckpt.params);
                narrow::<E>(self.params.as_mut_slice(), master);
                m.copy_from_slice(&ckpt.m);
                v.copy_from_slice(&ckpt.v);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::rng::mix64;

    fn tiny() -> (GptConfig, Hyper) {
        let cfg = GptConfig { n_layer: 1, n_head: 2, n_embd: 16, block_size: 8, vocab: 32 };
        let hyper = Hyper {
            steps: 10,
            global_batch: 4,
            micro_batch: 2,
            grad_accum: 2,
            seq_len: 8,
            lr: 1e-3,
            warmup_steps: 0,
            weight_decay: 0.1,
            grad_clip: 1.0,
            seed: 3,
            checkpointing: Checkpointing::None,
            offload_optimizer: false,
            offload_activations: OffloadTarget::None,
            world_size: 1,
            zero_stage: 0,
        };
        (cfg, hyper)
    }

    fn batch(s: u64, i: u64, inp: &mut Vec<u32>, tgt: &mut Vec<u32>) {
        for p in 0..8u64 {
            inp.push((mix64(s * 31 + i * 7 + p) % 32) as u32);
            tgt.push((mix64(s * 31 + i * 7 + p + 1) % 32) as u32);
        }
    }

    #[test]
    fn fp16_overflow_skips_the_step_and_halves_the_scale() {
        let (cfg, hyper) = tiny();
        let mut tr = Trainer::<half::f16>::new(cfg, hyper, Pool::new("cpu", 64 << 20)).unwrap();
        assert_eq!(tr.loss_scale(), INITIAL_LOSS_SCALE);
        let before = tr.master_params().to_vec();
        // A scale this large makes the fp16 gradients overflow to infinity.
        tr.set_loss_scale(1e30);
        let s = tr.train_step(&mut batch).unwrap();
        assert!(s.skipped, "overflowed step skipped");
        assert_eq!(s.loss_scale, 5e29, "scale halved");
        assert_eq!(tr.skipped_steps, 1);
        assert_eq!(tr.master_params(), &before[..], "weights untouched by a skipped step");
        tr.set_loss_scale(1024.0);
        let s = tr.train_step(&mut batch).unwrap();
        assert!(!s.skipped && s.grad_norm.is_finite());
        assert_ne!(tr.master_params(), &before[..], "a good step updates the weights");
        assert_eq!(tr.step, 2, "the skipped step still consumed its batch");
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
