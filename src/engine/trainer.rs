//! The training state (weights, gradients, AdamW moments in the pool) and one optimizer step
//! with gradient accumulation; evaluation; checkpoint save/restore.

use std::path::{Path, PathBuf};

use crate::config::{Checkpointing, JobSpec};
use crate::memory::{Buffer, Category, OomError, Pool};

use super::checkpoint::{self, Checkpoint, CheckpointError, CheckpointHeader};
use super::model::{self, alloc_f32, GptConfig, TensorInfo};
use super::optim::{clip_grad_norm, lr_at, AdamW};
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
}

/// Where a training sequence comes from: (step, index in global batch, inputs, targets).
pub type BatchFn<'a> = dyn FnMut(u64, u64, &mut Vec<u32>, &mut Vec<u32>) + 'a;

/// Where a validation sequence comes from: (index, inputs, targets).
pub type EvalBatchFn<'a> = dyn FnMut(usize, &mut Vec<u32>, &mut Vec<u32>) + 'a;

/// Model state on the device: every tensor a pool buffer tagged with its category.
pub struct Trainer {
    pub cfg: GptConfig,
    pub hyper: Hyper,
    pub pool: Pool,
    tensors: Vec<TensorInfo>,
    params: Buffer,
    grads: Buffer,
    m: Buffer,
    v: Buffer,
    /// Optimizer steps completed.
    pub step: u64,
    adam_t: u64,
    rng: Rng,
}

impl Trainer {
    /// Allocate parameters, gradients and optimizer state, and initialise the weights.
    pub fn new(cfg: GptConfig, hyper: Hyper, pool: Pool) -> Result<Trainer, OomError> {
        let n = cfg.num_params();
        let mut params = alloc_f32(&pool, n, Category::Params)?;
        let grads = alloc_f32(&pool, n, Category::Grads)?;
        let m = alloc_f32(&pool, n, Category::Optimizer)?;
        let v = alloc_f32(&pool, n, Category::Optimizer)?;
        cfg.init_params(params.as_mut_slice(), hyper.seed);
        let rng = Rng::new(hyper.seed);
        Ok(Trainer { tensors: cfg.tensors(), cfg, hyper, pool, params, grads, m, v, step: 0, adam_t: 0, rng })
    }

    pub fn params(&self) -> &[f32] {
        self.params.as_slice()
    }

    pub fn grads(&self) -> &[f32] {
        self.grads.as_slice()
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
        self.grads.as_mut_slice::<f32>().fill(0.0);
        let dloss = 1.0 / (b * t * h.grad_accum) as f32;
        let mut loss_sum = 0.0f64;
        let (mut inputs, mut targets) = (Vec::with_capacity(b * t), Vec::with_capacity(b * t));
        for micro in 0..h.grad_accum {
            inputs.clear();
            targets.clear();
            for i in 0..b {
                batch(self.step, (micro * b + i) as u64, &mut inputs, &mut targets);
            }
            let acts = model::forward(
                &self.cfg,
                self.params.as_slice(),
                &self.pool,
                &inputs,
                &targets,
                b,
                t,
                h.checkpointing,
            )?;
            loss_sum += acts.mean_loss() as f64;
            model::backward(&self.cfg, self.params.as_slice(), self.grads.as_mut_slice(), &self.pool, acts, dloss)?;
        }
        let grad_norm = clip_grad_norm(self.grads.as_mut_slice(), h.grad_clip);
        let lr = lr_at(self.step as usize, h.lr, h.warmup_steps, h.steps as usize);
        self.adam_t += 1;
        let opt = AdamW { lr: lr as f32, weight_decay: h.weight_decay as f32, t: self.adam_t };
        opt.update(
            &self.tensors,
            self.params.as_mut_slice(),
            self.grads.as_slice(),
            self.m.as_mut_slice(),
            self.v.as_mut_slice(),
        );
        self.step += 1;
        let secs = started.elapsed().as_secs_f64();
        Ok(StepStats {
            step: self.step,
            loss: (loss_sum / h.grad_accum as f64) as f32,
            lr,
            grad_norm,
            step_ms: secs * 1e3,
            tokens_per_s: (h.global_batch * t) as f64 / secs.max(1e-9),
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
            // Evaluation keeps nothing for backward: the acts are dropped right away.
            let acts = model::forward(
                &self.cfg,
                self.params.as_slice(),
                &self.pool,
                &inputs,
                &targets,
                n,
                t,
                Checkpointing::Full,
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
            loss_scale: 1.0,
        };
        checkpoint::save(run_dir, &header, self.params.as_slice(), self.m.as_slice(), self.v.as_slice())
    }

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
        self.params.as_mut_slice::<f32>().copy_from_slice(&ckpt.params);
        self.m.as_mut_slice::<f32>().copy_from_slice(&ckpt.m);
        self.v.as_mut_slice::<f32>().copy_from_slice(&ckpt.v);
        self.step = ckpt.header.step;
        self.adam_t = ckpt.header.adam_t;
        self.rng.state = ckpt.header.rng_state;
        Ok(())
    }
}
