//! The job spec (docs/DESIGN.md "Job spec"): serde types, parsing from YAML/JSON, and validation that
//! names the offending field and its allowed range.

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

use crate::memory::parse_bytes;

/// An invalid job: which field, and what is wrong with it — the first problem found, and
/// `also` every other one (field, message), so one run of the validator reports them all.
#[derive(Debug, Clone, thiserror::Error)]
pub struct ConfigError {
    pub field: String,
    pub message: String,
    pub also: Vec<(String, String)>,
}

impl ConfigError {
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
        ConfigError { field: field.into(), message: message.into(), also: Vec::new() }
    }

    /// Every problem, the first included: (field, message).
    pub fn problems(&self) -> impl Iterator<Item = (&str, &str)> {
        std::iter::once((self.field.as_str(), self.message.as_str()))
            .chain(self.also.iter().map(|(f, m)| (f.as_str(), m.as_str())))
    }
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.also.is_empty() {
            return write!(f, "invalid job: {}: {}", self.field, self.message);
        }
        write!(f, "invalid job: {} problems", self.also.len() + 1)?;
        for (field, message) in self.problems() {
            write!(f, "\n  {field}: {message}")?;
        }
        Ok(())
    }
}

fn bad(field: &str, message: impl Into<String>) -> ConfigError {
    ConfigError::new(field, message)
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct JobSpec {
    pub name: String,
    pub model: ModelSpec,
    pub data: DataSpec,
    pub train: TrainSpec,
    #[serde(default)]
    pub memory: MemorySpec,
    #[serde(default)]
    pub device: DeviceSpec,
    #[serde(default = "default_policy")]
    pub policy: String,
}

fn default_policy() -> String {
    "default".into()
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Vocab {
    Bytes,
    Gpt2,
}

impl Vocab {
    pub fn size(self) -> usize {
        match self {
            Vocab::Bytes => 256,
            Vocab::Gpt2 => 50257,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Vocab::Bytes => "bytes",
            Vocab::Gpt2 => "gpt2",
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    pub n_layer: i64,
    pub n_head: i64,
    pub n_embd: i64,
    pub block_size: i64,
    pub vocab: Vocab,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DataSpec {
    pub path: PathBuf,
    #[serde(default = "default_val_fraction")]
    pub val_fraction: f64,
}

fn default_val_fraction() -> f64 {
    0.1
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TrainSpec {
    pub steps: i64,
    pub global_batch: i64,
    pub micro_batch: i64,
    #[serde(default = "default_lr")]
    pub lr: f64,
    #[serde(default)]
    pub warmup_steps: i64,
    #[serde(default = "default_weight_decay")]
    pub weight_decay: f64,
    #[serde(default = "default_grad_clip")]
    pub grad_clip: f64,
    #[serde(default = "default_seed")]
    pub seed: u64,
    #[serde(default)]
    pub eval_every: i64,
    #[serde(default)]
    pub checkpoint_every: i64,
    /// Validation sequences per evaluation, in global batches: the same sequences whatever the
    /// micro-batch or world size, so `val_loss` compares across attempts of a job.
    #[serde(default = "default_eval_batches")]
    pub eval_batches: i64,
}

fn default_lr() -> f64 {
    3e-4
}
fn default_weight_decay() -> f64 {
    0.1
}
fn default_grad_clip() -> f64 {
    1.0
}
fn default_seed() -> u64 {
    1337
}
fn default_eval_batches() -> i64 {
    4
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    #[default]
    Fp32,
    Bf16,
    Fp16,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum Checkpointing {
    #[default]
    None,
    Selective,
    Full,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "kebab-case")]
pub enum OffloadTarget {
    #[default]
    None,
    Cpu,
    CpuInt8,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields)]
pub struct OffloadSpec {
    #[serde(default)]
    pub optimizer: OffloadTarget,
    #[serde(default)]
    pub params: OffloadTarget,
    #[serde(default)]
    pub activations: OffloadTarget,
    /// With the optimizer offloaded: step n's host update runs while the device computes step
    /// n+1 (DeepSpeed's delayed parameter update; gradients one step stale). One rank only.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub delayed_update: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct MemorySpec {
    #[serde(default)]
    pub precision: Precision,
    #[serde(default)]
    pub checkpointing: Checkpointing,
    #[serde(default)]
    pub zero_stage: i64,
    #[serde(default = "default_world_size")]
    pub world_size: i64,
    /// Ranks each block's heads and MLP features are split across (Megatron-style tensor
    /// parallelism); the world is data × tensor: world_size / tensor_parallel data-parallel
    /// groups of `tensor_parallel` consecutive ranks.
    #[serde(default = "default_world_size", skip_serializing_if = "is_one")]
    pub tensor_parallel: i64,
    /// Pipeline stages: each holds a contiguous run of layers (the first also the embedding,
    /// the last the head), micro-batches flowing through them (GPipe); the world is data ×
    /// pipeline × tensor.
    #[serde(default = "default_world_size", skip_serializing_if = "is_one")]
    pub pipeline_parallel: i64,
    #[serde(default)]
    pub offload: OffloadSpec,
    /// `caching` (default): every request searches the pool's free blocks. `static`: the first
    /// training step's allocations are recorded and packed into one arena; later steps are
    /// served from that plan with no search (`memory::plan`).
    #[serde(default, skip_serializing_if = "Allocator::is_caching")]
    pub allocator: Allocator,
    /// `threads` (default): every rank is a thread of the one `headroom train` process.
    /// `processes`: one process per rank, joined over TCP (`engine::parallel::tcp`); the
    /// `headroom train` started for the job is rank 0 and starts the others.
    #[serde(default, skip_serializing_if = "Ranks::is_threads")]
    pub ranks: Ranks,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum Ranks {
    #[default]
    Threads,
    Processes,
}

impl Ranks {
    fn is_threads(&self) -> bool {
        *self == Ranks::Threads
    }
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum Allocator {
    #[default]
    Caching,
    Static,
}

impl Allocator {
    fn is_caching(&self) -> bool {
        *self == Allocator::Caching
    }
}

fn default_world_size() -> i64 {
    1
}

fn is_one(v: &i64) -> bool {
    *v == 1
}

impl Default for MemorySpec {
    fn default() -> Self {
        MemorySpec {
            precision: Precision::Fp32,
            checkpointing: Checkpointing::None,
            zero_stage: 0,
            world_size: 1,
            tensor_parallel: 1,
            pipeline_parallel: 1,
            offload: OffloadSpec::default(),
            allocator: Allocator::Caching,
            ranks: Ranks::Threads,
        }
    }
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    #[default]
    Cpu,
    Cuda,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DeviceSpec {
    #[serde(default)]
    pub kind: DeviceKind,
    #[serde(default)]
    pub index: u32,
    /// Capacity of the device pool, e.g. "512MiB". Required on cpu, optional on cuda.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_memory: Option<Bytes>,
    /// Large blocks carved from one growing virtual range whose pages are mapped on demand
    /// (PyTorch's `expandable_segments`), so free memory is never stranded between segments.
    /// Default: off (see [`DeviceSpec::expandable_segments`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expandable_segments: Option<bool>,
    /// A fraction of `device_memory` (or of the GPU's free memory) the pool reserves up front as
    /// one segment, which the model state and every large block are then carved from (the
    /// seed's "pre-allocate, leave ~10% margin"). Absent: segments as needed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reserve: Option<f64>,
    /// At each checkpoint, defragment the pool when the free bytes stranded in segments that
    /// also hold live blocks exceed this share of `reserved`: persistent buffers move out of
    /// sparsely used segments, which then go back (`engine::defrag`). Absent: never (the
    /// `defragment` control line still works).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub defragment_above: Option<f64>,
}

impl DeviceSpec {
    /// Whether the pool uses expandable segments: as written, else off on both devices (the
    /// cpu device stands in for a GPU, so it behaves like one; the cuda virtual-memory path has
    /// not yet run on a GPU). A GPU without virtual memory management uses fixed segments.
    pub fn expandable_segments(&self) -> bool {
        self.expandable_segments.unwrap_or(false)
    }
}

/// A byte size as written in a job ("512MiB", "1.5GiB", "300MB", "1048576"): parsed once when
/// the job is read and written back as the user wrote it. A text that is not a size still reads
/// (so `validate` can name the field in its error) and has no [`Bytes::bytes`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "String", into = "String")]
pub struct Bytes {
    text: String,
    parsed: Result<usize, String>,
}

impl Bytes {
    /// The size, for a valid one.
    pub fn bytes(&self) -> Option<usize> {
        self.parsed.as_ref().ok().copied()
    }

    /// Why the text is not a size.
    pub fn error(&self) -> Option<&str> {
        self.parsed.as_ref().err().map(String::as_str)
    }
}

impl From<String> for Bytes {
    fn from(text: String) -> Bytes {
        let parsed = parse_bytes(&text);
        Bytes { text, parsed }
    }
}

impl From<Bytes> for String {
    fn from(b: Bytes) -> String {
        b.text
    }
}

impl Default for DeviceSpec {
    fn default() -> Self {
        DeviceSpec {
            kind: DeviceKind::Cpu,
            index: 0,
            device_memory: Some(Bytes::from(DEFAULT_CPU_DEVICE_MEMORY.to_string())),
            expandable_segments: None,
            reserve: None,
            defragment_above: None,
        }
    }
}

/// The capacity of the `cpu` device when the job has no `device:` section at all.
pub const DEFAULT_CPU_DEVICE_MEMORY: &str = "512MiB";

impl JobSpec {
    /// Parse YAML (a superset of JSON, so JSON bodies work too) and validate.
    pub fn parse(text: &str) -> Result<JobSpec, ConfigError> {
        check_yaml_nesting(text).map_err(|message| bad("job", message))?;
        let spec: JobSpec = serde_yaml::from_str(text).map_err(|e| yaml_error(&e))?;
        spec.validate()?;
        Ok(spec)
    }

    pub fn load(path: &Path) -> Result<JobSpec, ConfigError> {
        let text =
            std::fs::read_to_string(path).map_err(|e| bad("config", format!("cannot read {}: {e}", path.display())))?;
        JobSpec::parse(&text)
    }

    pub fn to_yaml(&self) -> String {
        serde_yaml::to_string(self).expect("job spec serialises")
    }

    /// Gradient-accumulation steps per optimizer step.
    pub fn grad_accum(&self) -> usize {
        (self.train.global_batch / (self.train.micro_batch * self.data_parallel())) as usize
    }

    /// Data-parallel ranks: the world over the tensor-parallel group's size and the stages.
    pub fn data_parallel(&self) -> i64 {
        (self.memory.world_size / (self.memory.tensor_parallel.max(1) * self.memory.pipeline_parallel.max(1))).max(1)
    }

    /// Device capacity in bytes (of a validated job: `device_memory` is a size).
    pub fn device_capacity(&self) -> Option<usize> {
        self.device.device_memory.as_ref().and_then(Bytes::bytes)
    }

    /// The memory knobs of this configuration, in the engine's units.
    pub fn knobs(&self) -> Knobs {
        Knobs {
            micro_batch: self.train.micro_batch as usize,
            seq_len: self.model.block_size as usize,
            grad_accum: self.grad_accum(),
            checkpointing: self.memory.checkpointing,
            precision: self.memory.precision,
            offload_optimizer: self.memory.offload.optimizer != OffloadTarget::None,
            offload_params: self.memory.offload.params != OffloadTarget::None,
            offload_activations: self.memory.offload.activations,
            delayed_update: self.memory.offload.delayed_update,
            world_size: self.memory.world_size as usize,
            tensor_parallel: self.memory.tensor_parallel as usize,
            pipeline_parallel: self.memory.pipeline_parallel as usize,
            zero_stage: self.memory.zero_stage as usize,
            expandable_segments: self.device.expandable_segments(),
            static_allocator: self.memory.allocator == Allocator::Static,
        }
    }

    /// Every check whose failure the user must see, with the field named: all of them at once
    /// (in file order), so a file with three bad values gets three messages.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut p = Problems::default();
        let name_ok = !self.name.is_empty()
            && self.name.len() <= 64
            && self.name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
            && self.name != "."
            && self.name != "..";
        if !name_ok {
            p.push("name", format!("`{}` must match [A-Za-z0-9._-]{{1,64}}", self.name));
        }
        let m = &self.model;
        p.range("model.n_layer", m.n_layer, 1, 96);
        let heads_ok = p.range("model.n_head", m.n_head, 1, 128);
        p.range("model.n_embd", m.n_embd, 1, 16384);
        p.range("model.block_size", m.block_size, 2, 8192);
        if heads_ok && m.n_embd % m.n_head != 0 {
            p.push("model.n_embd", format!("{} must be divisible by model.n_head ({})", m.n_embd, m.n_head));
        }
        let d = &self.data;
        if d.path.as_os_str().is_empty() {
            p.push("data.path", "must not be empty");
        }
        if !(d.val_fraction > 0.0 && d.val_fraction < 0.5) {
            p.push("data.val_fraction", format!("{} must be in (0, 0.5)", d.val_fraction));
        }
        let t = &self.train;
        let steps_ok = p.range("train.steps", t.steps, 1, 10_000_000);
        let batch_ok = p.range("train.global_batch", t.global_batch, 1, 1_000_000);
        let micro_ok = p.range("train.micro_batch", t.micro_batch, 1, t.global_batch.max(1));
        let world = self.memory.world_size;
        let world_ok = p.range("memory.world_size", world, 1, 64);
        let tp = self.memory.tensor_parallel;
        let mut tp_ok = p.range("memory.tensor_parallel", tp, 1, 64);
        if tp_ok && world_ok && world % tp != 0 {
            p.push("memory.tensor_parallel", format!("{tp} must divide memory.world_size ({world})"));
            tp_ok = false;
        }
        if tp_ok && heads_ok && m.n_head % tp != 0 {
            p.push(
                "memory.tensor_parallel",
                format!("{tp} must divide model.n_head ({}): each rank computes whole heads", m.n_head),
            );
        }
        let pp = self.memory.pipeline_parallel;
        let mut pp_ok = p.range("memory.pipeline_parallel", pp, 1, 64);
        if pp_ok && tp_ok && world_ok && world % (tp * pp) != 0 {
            p.push(
                "memory.pipeline_parallel",
                format!("tensor_parallel × pipeline_parallel = {tp} × {pp} must divide memory.world_size ({world})"),
            );
            pp_ok = false;
        }
        if pp_ok && pp > 1 {
            if m.n_layer < pp {
                p.push(
                    "memory.pipeline_parallel",
                    format!("{pp} stages need at least as many layers (model.n_layer {})", m.n_layer),
                );
            }
            if self.memory.zero_stage >= 2 {
                p.push(
                    "memory.zero_stage",
                    format!(
                        "{} with pipeline_parallel {pp}: pipeline stages support ZeRO 0 and 1",
                        self.memory.zero_stage
                    ),
                );
            }
            if self.memory.offload.activations != OffloadTarget::None {
                p.push("memory.offload.activations", "is not supported with pipeline_parallel > 1 yet");
            }
        }
        let dp = if tp_ok && pp_ok && world_ok { world / (tp * pp) } else { world };
        if batch_ok && micro_ok && world_ok && t.global_batch % (t.micro_batch * dp) != 0 {
            if tp > 1 || pp > 1 {
                p.push(
                    "train.global_batch",
                    format!(
                        "{} must be divisible by micro_batch × data-parallel ranks (world_size / (tensor_parallel × pipeline_parallel)) = {} × {}",
                        t.global_batch, t.micro_batch, dp
                    ),
                );
            } else {
                p.push(
                    "train.global_batch",
                    format!(
                        "{} must be divisible by micro_batch × world_size = {} × {}",
                        t.global_batch, t.micro_batch, world
                    ),
                );
            }
        }
        if !(t.lr.is_finite() && t.lr > 0.0 && t.lr <= 1.0) {
            p.push("train.lr", format!("{} must be in (0, 1]", t.lr));
        }
        p.range("train.warmup_steps", t.warmup_steps, 0, if steps_ok { t.steps } else { 10_000_000 });
        if !(t.weight_decay.is_finite() && (0.0..=1.0).contains(&t.weight_decay)) {
            p.push("train.weight_decay", format!("{} must be in [0, 1]", t.weight_decay));
        }
        if !(t.grad_clip.is_finite() && t.grad_clip >= 0.0) {
            p.push("train.grad_clip", format!("{} must be >= 0 (0 disables clipping)", t.grad_clip));
        }
        p.range("train.eval_every", t.eval_every, 0, 10_000_000);
        p.range("train.checkpoint_every", t.checkpoint_every, 0, 10_000_000);
        p.range("train.eval_batches", t.eval_batches, 1, 10_000);
        p.range("memory.zero_stage", self.memory.zero_stage, 0, 3);
        let off = &self.memory.offload;
        if off.optimizer == OffloadTarget::CpuInt8 || off.params == OffloadTarget::CpuInt8 {
            p.push("memory.offload", "cpu-int8 applies to activations only");
        }
        if off.delayed_update && world > 1 {
            p.push("memory.offload.delayed_update", format!("applies to one rank; this job has world_size {world}"));
        }
        if self.memory.offload.activations != OffloadTarget::None && self.memory.checkpointing != Checkpointing::Full {
            p.push(
                "memory.offload.activations",
                "needs memory.checkpointing: full (the offloaded activations are the checkpointed block inputs)",
            );
        }
        match &self.device.device_memory {
            Some(size) => {
                if let Some(e) = size.error() {
                    p.push("device.device_memory", e);
                }
            }
            None if self.device.kind == DeviceKind::Cpu => {
                p.push("device.device_memory", "is required for a cpu device (e.g. 512MiB)")
            }
            None => {}
        }
        if let Some(r) = self.device.reserve {
            if !(r > 0.0 && r <= 1.0) {
                p.push("device.reserve", format!("{r} must be in (0, 1] (a fraction of the device's memory)"));
            }
        }
        if let Some(d) = self.device.defragment_above {
            if !(d > 0.0 && d < 1.0) {
                p.push("device.defragment_above", format!("{d} must be in (0, 1) (a share of the reserved bytes)"));
            }
        }
        let policy_ok = !self.policy.is_empty()
            && self.policy.len() <= 64
            && self.policy.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-'));
        if !policy_ok {
            p.push("policy", format!("`{}` must match [A-Za-z0-9_-]{{1,64}}", self.policy));
        }
        p.into_result()
    }
}

/// What `validate` found, in order; one `ConfigError` carrying them all.
#[derive(Default)]
struct Problems(Vec<ConfigError>);

impl Problems {
    fn push(&mut self, field: &str, message: impl Into<String>) {
        self.0.push(bad(field, message));
    }

    /// Whether `value` is in [lo, hi]; a problem when not.
    fn range(&mut self, field: &str, value: i64, lo: i64, hi: i64) -> bool {
        let ok = (lo..=hi).contains(&value);
        if !ok {
            self.push(field, format!("{value} is out of range [{lo}, {hi}]"));
        }
        ok
    }

    fn into_result(self) -> Result<(), ConfigError> {
        let mut all = self.0.into_iter();
        match all.next() {
            None => Ok(()),
            Some(first) => Err(ConfigError { also: all.map(|e| (e.field, e.message)).collect(), ..first }),
        }
    }
}

/// The memory knobs of one configuration — what the policy ladder turns — in the engine's units:
/// what the trainer runs (inside its `Hyper`), what the estimator predicts the peak of. Derived
/// from a job by [`JobSpec::knobs`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Knobs {
    /// Sequences per forward/backward pass on each rank.
    pub micro_batch: usize,
    pub seq_len: usize,
    /// Micro-batches per optimizer step on each rank.
    pub grad_accum: usize,
    pub checkpointing: Checkpointing,
    /// Storage type of weights and activations (a trainer's is its type parameter `E`).
    pub precision: Precision,
    /// Optimizer state and master weights in host memory.
    pub offload_optimizer: bool,
    /// Compute weights in host memory, each segment copied to the device when used.
    pub offload_params: bool,
    /// Block inputs kept for backward in host memory (needs full checkpointing).
    pub offload_activations: OffloadTarget,
    /// With `offload_optimizer`: the host update overlaps the next step (gradients one step
    /// stale; `offload.delayed_update`).
    pub delayed_update: bool,
    /// All ranks (data × tensor parallel), the tensor-parallel group's size (each rank holding
    /// 1/tensor_parallel of the split tensors), and the ZeRO stage over the data-parallel
    /// ranks (0: replicated, 1: sharded optimizer state, 2: and gradients, 3: and weights),
    /// each holding 1/(world / tensor_parallel) of what is sharded.
    pub world_size: usize,
    pub tensor_parallel: usize,
    /// Pipeline stages (GPipe: every micro-batch's activations of a stage in flight at once).
    pub pipeline_parallel: usize,
    pub zero_stage: usize,
    /// The pool's large blocks come from an expandable segment (what `reserved` grows by).
    pub expandable_segments: bool,
    /// `memory.allocator: static`: steps after the first are served from a packed plan.
    pub static_allocator: bool,
}

impl Knobs {
    /// fp32, no checkpointing, no offload, one rank.
    pub fn plain(micro_batch: usize, seq_len: usize, grad_accum: usize) -> Knobs {
        Knobs {
            micro_batch,
            seq_len,
            grad_accum,
            checkpointing: Checkpointing::None,
            precision: Precision::Fp32,
            offload_optimizer: false,
            offload_params: false,
            offload_activations: OffloadTarget::None,
            delayed_update: false,
            world_size: 1,
            tensor_parallel: 1,
            pipeline_parallel: 1,
            zero_stage: 0,
            expandable_segments: false,
            static_allocator: false,
        }
    }

    /// Data-parallel ranks: the world over the tensor-parallel group and the stages.
    pub fn data_parallel(&self) -> usize {
        (self.world_size / (self.tensor_parallel.max(1) * self.pipeline_parallel.max(1))).max(1)
    }
}

/// The serde name of a config enum value ("bf16", "full").
pub fn serde_name<T: Serialize>(v: &T) -> String {
    serde_json::to_value(v).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default()
}

/// The config enum value a serde name stands for (`serde_name`'s inverse); `None` if none does.
pub fn from_serde_name<T: serde::de::DeserializeOwned>(name: &str) -> Option<T> {
    serde_json::from_value(serde_json::Value::String(name.to_owned())).ok()
}

/// Turn a serde_yaml error into a field-naming message. serde_yaml reports the path as
/// `train.steps: invalid type...` or `unknown field `foo`, expected one of ...` at a location.
/// Deepest nesting of YAML/JSON collections a job or policy file may have (theirs is 3).
pub const MAX_YAML_NESTING: usize = 32;

/// Refuse text nested deeper than [`MAX_YAML_NESTING`] before any parser sees it: the YAML
/// parser's time grows with the square of the depth (100,000 `[` take 38 s), so a 200 KB body
/// could stall the daemon. Counts flow brackets outside quotes and comments, and block
/// indentation (at most two columns a level).
pub fn check_yaml_nesting(text: &str) -> Result<(), String> {
    let too_deep = |what: &str, line: usize| {
        Err(format!("line {line}: {what} nested deeper than {MAX_YAML_NESTING} levels (a job or policy needs 3)"))
    };
    let mut depth = 0usize;
    let (mut single, mut double) = (false, false);
    for (n, line) in text.lines().enumerate() {
        let indent = line.len() - line.trim_start_matches(' ').len();
        if !single && !double && depth == 0 && indent > 2 * MAX_YAML_NESTING {
            return too_deep("indentation", n + 1);
        }
        let mut prev = ' ';
        for ch in line.chars() {
            match ch {
                '\'' if !double => single = !single,
                '"' if !single && prev != '\\' => double = !double,
                '#' if !single && !double && prev.is_whitespace() => break,
                '[' | '{' if !single && !double => {
                    depth += 1;
                    if depth > MAX_YAML_NESTING {
                        return too_deep("collections", n + 1);
                    }
                }
                ']' | '}' if !single && !double => depth = depth.saturating_sub(1),
                _ => {}
            }
            prev = ch;
        }
    }
    Ok(())
}

fn yaml_error(e: &serde_yaml::Error) -> ConfigError {
    let text = e.to_string();
    // serde_yaml prefixes nested errors with the dotted path followed by ": ".
    let (field, message) = match text.split_once(": ") {
        Some((path, rest))
            if !path.contains(' ') && path.chars().all(|c| c.is_ascii_alphanumeric() || "._[]".contains(c)) =>
        {
            (path.to_string(), rest.to_string())
        }
        _ => ("job".to_string(), text.clone()),
    };
    ConfigError::new(field, message)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn deep_nesting_is_refused_before_parsing_and_quickly() {
        let start = std::time::Instant::now();
        let bomb = format!("a: {}{}", "[".repeat(100_000), "]".repeat(100_000));
        let e = JobSpec::parse(&bomb).unwrap_err();
        assert!(e.to_string().contains("nested deeper than 32"), "{e}");
        let indented: String = (0..100).map(|i| format!("{}k{i}:\n", " ".repeat(2 * i))).collect();
        assert!(check_yaml_nesting(&indented).unwrap_err().contains("indentation"));
        assert!(start.elapsed() < std::time::Duration::from_secs(1), "{:?}", start.elapsed());
        // Brackets in quotes and comments do not count; ordinary jobs pass.
        let quoted = format!("name: '{}' # {}\n", "[".repeat(100), "{".repeat(100));
        check_yaml_nesting(&quoted).unwrap();
        check_yaml_nesting(EXAMPLE).unwrap();
        JobSpec::parse(EXAMPLE).unwrap();
    }

    pub(crate) const EXAMPLE: &str = r#"
name: shakespeare-small
model: { n_layer: 4, n_head: 4, n_embd: 128, block_size: 128, vocab: bytes }
data: { path: data/shakespeare-tiny.txt, val_fraction: 0.1 }
train:
  steps: 200
  global_batch: 32
  micro_batch: 32
  lr: 3.0e-4
  warmup_steps: 20
  weight_decay: 0.1
  grad_clip: 1.0
  seed: 1337
  eval_every: 50
  checkpoint_every: 50
memory:
  precision: fp32
  checkpointing: none
  zero_stage: 0
  world_size: 1
  offload: { optimizer: none, params: none, activations: none }
device: { kind: cpu, device_memory: 512MiB }
policy: default
"#;

    #[test]
    fn design_example_parses() {
        let spec = JobSpec::parse(EXAMPLE).unwrap();
        assert_eq!(spec.grad_accum(), 1);
        assert_eq!(spec.device_capacity(), Some(512 << 20));
        // Round trip through the serialised form.
        assert_eq!(JobSpec::parse(&spec.to_yaml()).unwrap(), spec);
        // JSON is accepted too.
        let json = serde_json::to_string(&spec).unwrap();
        assert_eq!(JobSpec::parse(&json).unwrap(), spec);
    }

    /// Every job file the repository ships parses and validates.
    #[test]
    fn the_shipped_job_files_are_valid() {
        for file in ["data/demo-job.yaml", "data/example-job.yaml", "data/quant-job.yaml"] {
            let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(file);
            let text = std::fs::read_to_string(&path).unwrap();
            JobSpec::parse(&text).unwrap_or_else(|e| panic!("{file}: {e}"));
        }
    }

    fn err_of(edit: &str, with: &str) -> ConfigError {
        JobSpec::parse(&EXAMPLE.replace(edit, with)).unwrap_err()
    }

    #[test]
    fn sizes_are_parsed_once_and_written_back_as_written() {
        let spec = JobSpec::parse(&EXAMPLE.replace("512MiB", "1.5GiB")).unwrap();
        assert_eq!(spec.device_capacity(), Some(3 << 29));
        assert!(spec.to_yaml().contains("device_memory: 1.5GiB"), "{}", spec.to_yaml());
        let back: JobSpec = serde_json::from_str(&serde_json::to_string(&spec).unwrap()).unwrap();
        assert_eq!(back, spec);
        let knobs = spec.knobs();
        assert_eq!((knobs.micro_batch, knobs.grad_accum, knobs.seq_len), (32, 1, 128));
    }

    #[test]
    fn bad_values_name_their_field() {
        let e = err_of("steps: 200", "steps: -5");
        assert_eq!(e.field, "train.steps");
        let e = err_of("micro_batch: 32", "micro_batch: 5");
        assert_eq!(e.field, "train.global_batch", "{e}");
        let e = err_of("n_embd: 128", "n_embd: 130");
        assert_eq!(e.field, "model.n_embd");
        let e = err_of("steps: 200", "steps: 200\n  stepz: 3");
        assert!(e.to_string().contains("stepz"), "{e}");
        assert_eq!(e.field, "train");
        let e = err_of("vocab: bytes", "vocab: words");
        assert!(e.to_string().contains("model"), "{e}");
        let e = err_of("512MiB", "512 parsecs");
        assert_eq!(e.field, "device.device_memory");
        let e = err_of("name: shakespeare-small", "name: ../etc");
        assert_eq!(e.field, "name");
        let e = JobSpec::parse("name: [unclosed").unwrap_err();
        assert!(e.to_string().contains("line"), "malformed YAML reports its location: {e}");
    }

    #[test]
    fn the_allocator_is_caching_unless_asked_and_static_round_trips() {
        assert!(!JobSpec::parse(EXAMPLE).unwrap().knobs().static_allocator);
        let spec =
            JobSpec::parse(&EXAMPLE.replace("  world_size: 1\n", "  world_size: 1\n  allocator: static\n")).unwrap();
        assert!(spec.knobs().static_allocator);
        assert_eq!(JobSpec::parse(&spec.to_yaml()).unwrap(), spec);
        let e = err_of("  world_size: 1\n", "  world_size: 1\n  allocator: magic\n");
        assert!(e.to_string().contains("memory") && e.to_string().contains("magic"), "{e}");
    }

    #[test]
    fn ranks_are_threads_unless_asked_and_processes_round_trips() {
        let spec = JobSpec::parse(EXAMPLE).unwrap();
        assert_eq!(spec.memory.ranks, Ranks::Threads);
        assert!(!spec.to_yaml().contains("ranks"), "the default is not written");
        let spec =
            JobSpec::parse(&EXAMPLE.replace("  world_size: 1\n", "  world_size: 1\n  ranks: processes\n")).unwrap();
        assert_eq!(spec.memory.ranks, Ranks::Processes);
        assert_eq!(JobSpec::parse(&spec.to_yaml()).unwrap(), spec);
        let e = err_of("  world_size: 1\n", "  world_size: 1\n  ranks: fibers\n");
        assert!(e.to_string().contains("memory") && e.to_string().contains("fibers"), "{e}");
    }

    #[test]
    fn tensor_parallel_splits_the_world_and_each_mismatch_names_its_field() {
        let spec = JobSpec::parse(EXAMPLE).unwrap();
        assert_eq!(spec.memory.tensor_parallel, 1);
        assert!(!spec.to_yaml().contains("tensor_parallel"), "the default is not written");
        // World 4 = 2 data-parallel × 2 tensor-parallel: micro 8 × 2 data ranks × 2 = 32.
        let grid = EXAMPLE
            .replace("micro_batch: 32", "micro_batch: 8")
            .replace("  world_size: 1\n", "  world_size: 4\n  tensor_parallel: 2\n");
        let spec = JobSpec::parse(&grid).unwrap();
        assert_eq!((spec.data_parallel(), spec.grad_accum()), (2, 2));
        let k = spec.knobs();
        assert_eq!((k.world_size, k.tensor_parallel, k.data_parallel()), (4, 2, 2));
        assert_eq!(JobSpec::parse(&spec.to_yaml()).unwrap(), spec);
        let field_of = |yaml: String| {
            let e = JobSpec::parse(&yaml).unwrap_err();
            (e.field.clone(), e.message.clone())
        };
        let (field, message) = field_of(grid.replace("tensor_parallel: 2", "tensor_parallel: 3"));
        assert_eq!(field, "memory.tensor_parallel");
        assert!(message.contains("must divide memory.world_size (4)"), "{message}");
        let (field, message) =
            field_of(grid.replace("n_head: 4", "n_head: 2").replace("tensor_parallel: 2", "tensor_parallel: 4"));
        assert_eq!(field, "memory.tensor_parallel");
        assert!(message.contains("model.n_head (2)"), "{message}");
        let (field, message) = field_of(grid.replace("micro_batch: 8", "micro_batch: 32"));
        assert_eq!(field, "train.global_batch");
        assert!(
            message.contains("data-parallel ranks (world_size / (tensor_parallel × pipeline_parallel)) = 32 × 2"),
            "{message}"
        );
        let (field, _) = field_of(grid.replace("tensor_parallel: 2", "tensor_parallel: 0"));
        assert_eq!(field, "memory.tensor_parallel");
        // Pipeline stages: world 4 = 1 data × 2 stages × 2 tensor; micro 8 × 4 accumulation.
        let staged = grid.replace("tensor_parallel: 2\n", "tensor_parallel: 2\n  pipeline_parallel: 2\n");
        let spec = JobSpec::parse(&staged).unwrap();
        assert_eq!((spec.data_parallel(), spec.grad_accum(), spec.knobs().pipeline_parallel), (1, 4, 2));
        assert_eq!(JobSpec::parse(&spec.to_yaml()).unwrap(), spec);
        let (field, message) = field_of(staged.replace("pipeline_parallel: 2", "pipeline_parallel: 3"));
        assert_eq!(field, "memory.pipeline_parallel");
        assert!(message.contains("2 × 3 must divide memory.world_size (4)"), "{message}");
        let (field, message) = field_of(staged.replace("n_layer: 4", "n_layer: 1"));
        assert_eq!(field, "memory.pipeline_parallel");
        assert!(message.contains("at least as many layers (model.n_layer 1)"), "{message}");
        let (field, message) = field_of(staged.replace("zero_stage: 0", "zero_stage: 2"));
        assert_eq!(field, "memory.zero_stage");
        assert!(message.contains("pipeline stages support ZeRO 0 and 1"), "{message}");
    }

    #[test]
    fn every_bad_value_is_reported_at_once_and_a_dependent_check_waits_for_its_inputs() {
        let e = err_of("n_layer: 4", "n_layer: 0").also;
        assert!(e.is_empty(), "one bad value, one problem: {e:?}");
        let bad = EXAMPLE
            .replace("n_layer: 4", "n_layer: 0")
            .replace("val_fraction: 0.1", "val_fraction: 2")
            .replace("lr: 3.0e-4", "lr: -1")
            .replace("zero_stage: 0", "zero_stage: 7");
        let e = JobSpec::parse(&bad).unwrap_err();
        let fields: Vec<&str> = e.problems().map(|(f, _)| f).collect();
        assert_eq!(fields, ["model.n_layer", "data.val_fraction", "train.lr", "memory.zero_stage"]);
        assert!(e.to_string().starts_with("invalid job: 4 problems\n  model.n_layer: 0 is out of range"), "{e}");
        // n_head 0: its range is the problem, not a division by zero in the divisibility check.
        let e = err_of("n_head: 4", "n_head: 0");
        assert_eq!(e.problems().map(|(f, _)| f).collect::<Vec<_>>(), ["model.n_head"]);
        let e = err_of("micro_batch: 32", "micro_batch: 0");
        assert_eq!(e.problems().map(|(f, _)| f).collect::<Vec<_>>(), ["train.micro_batch"]);
    }
}
