//! Inference from a run: `headroom quantize` (its newest checkpoint, INT8 per output channel or
//! INT4 group-wise, into a file), `headroom eval` (validation loss and perplexity of each storage
//! scheme side by side, with the weight bytes the pool held) and `headroom generate` (text from
//! a prompt).

use std::path::{Path, PathBuf};

use super::client::UsageError;
use crate::config::JobSpec;
use crate::engine::backend::workspace::WorkspaceModel;
use crate::engine::backend::{Backend, CpuBackend};
use crate::engine::estimate::inference::inference;
use crate::engine::model::GptConfig;
use crate::engine::quant::{self, DecodeShape, QuantModel, Scheme};
use crate::engine::train::checkpoint;
use crate::engine::train::data::{load_tokens, Dataset};
use crate::engine::train::job::default_run_dir;
use crate::engine::train::trainer::gpt_config;
use crate::memory::{format_bytes, Category, Pool};

#[derive(Debug, clap::Args)]
pub struct QuantizeArgs {
    /// The job whose run to quantize (its model, data and run directory).
    #[arg(long)]
    pub config: PathBuf,
    /// Run directory holding the checkpoints (default: runs/<name>).
    #[arg(long)]
    pub run_dir: Option<PathBuf>,
    /// bf16, int8, int4-g32, int4-g64 or int4-g128.
    #[arg(long, default_value = "int4-g64")]
    pub scheme: String,
    /// The quantized model file to write.
    #[arg(long)]
    pub out: PathBuf,
}

#[derive(Debug, clap::Args)]
pub struct EvalArgs {
    /// The job whose run to evaluate (its model, data, validation split and run directory).
    #[arg(long)]
    pub config: PathBuf,
    /// Run directory holding the checkpoints (default: runs/<name>).
    #[arg(long)]
    pub run_dir: Option<PathBuf>,
    /// Storage schemes to compare, the first the reference of the Δ column.
    #[arg(long, default_value = "fp32,bf16,int8,int4-g128,int4-g64,int4-g32", value_delimiter = ',')]
    pub schemes: Vec<String>,
    /// Evaluate this quantized model file (from `headroom quantize`) instead of the checkpoint.
    #[arg(long, conflicts_with = "schemes")]
    pub quantized: Option<PathBuf>,
    /// Validation sequences (default: the job's eval_batches × global_batch).
    #[arg(long)]
    pub sequences: Option<usize>,
}

#[derive(Debug, clap::Args)]
pub struct GenerateArgs {
    /// The job whose run to sample from (its model, vocabulary and run directory).
    #[arg(long)]
    pub config: PathBuf,
    /// Run directory holding the checkpoints (default: runs/<name>).
    #[arg(long)]
    pub run_dir: Option<PathBuf>,
    /// Sample from this quantized model file instead of the checkpoint.
    #[arg(long)]
    pub quantized: Option<PathBuf>,
    /// The text to continue.
    #[arg(long, default_value = "\n")]
    pub prompt: String,
    /// Tokens to generate.
    #[arg(long, default_value_t = 200)]
    pub tokens: usize,
    /// 0: always the most likely token; higher: more varied.
    #[arg(long, default_value_t = 0.8, allow_negative_numbers = true)]
    pub temperature: f32,
    /// Draw only among the k most likely tokens (0: all).
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Positions the KV cache holds (default: the model's block size); when it fills, the
    /// newest half of it is run again from position 0.
    #[arg(long)]
    pub context: Option<usize>,
    /// Prompt tokens run through the model at once (default: 64, at most the context).
    #[arg(long)]
    pub chunk: Option<usize>,
}

pub fn generate(args: GenerateArgs) -> anyhow::Result<()> {
    use crate::config::Vocab;
    let spec = JobSpec::load(&args.config)?;
    let cfg = gpt_config(&spec);
    if !(args.temperature.is_finite() && args.temperature >= 0.0) {
        return Err(UsageError(format!("--temperature: {} must be >= 0", args.temperature)).into());
    }
    let model = match &args.quantized {
        Some(file) => read_quantized(file, &cfg)?,
        None => quant::quantize(&cfg, &newest_weights(&spec, &args.run_dir)?.1, Scheme::Fp32),
    };
    let prompt: Vec<u32> = crate::engine::train::data::tokenize(args.prompt.as_bytes(), spec.model.vocab)
        .map_err(|e| UsageError(format!("--prompt: {e}")))?
        .into_iter()
        .map(u32::from)
        .collect();
    if prompt.is_empty() {
        return Err(UsageError("--prompt: empty (give at least one character)".into()).into());
    }
    let sampling = quant::Sampling { temperature: args.temperature, top_k: args.top_k, seed: args.seed };
    let shape = decode_shape(&cfg, args.context, args.chunk)?;
    let backend = CpuBackend::new(Pool::new("cpu", 64 << 30));
    let out = quant::generate(&backend, &model, &prompt, args.tokens, &sampling, shape)?;
    let stats = backend.pool().stats();
    let estimate = inference::<f32>(WorkspaceModel::Cpu, &cfg, model.scheme, shape);
    eprintln!(
        "memory: weights {} ({}), kv cache {} ({} positions), decoder {}, workspace {}; peak {} (estimated {})",
        format_bytes(stats.peak(Category::Params)),
        model.scheme.name(),
        format_bytes(stats.peak(Category::KvCache)),
        shape.context,
        format_bytes(stats.peak(Category::Activations)),
        format_bytes(stats.peak(Category::Workspace)),
        format_bytes(stats.peak_allocated),
        format_bytes(estimate.peak_allocated),
    );
    let text = match spec.model.vocab {
        Vocab::Bytes => String::from_utf8_lossy(&out.iter().map(|&t| t as u8).collect::<Vec<_>>()).into_owned(),
        Vocab::Gpt2 => {
            tiktoken_rs::r50k_base_singleton().decode(&out).unwrap_or_else(|e| format!("<undecodable: {e}>"))
        }
    };
    println!("{}{text}", args.prompt);
    Ok(())
}

/// The KV cache's positions and the prompt's chunk: as given (checked against the model), or
/// the defaults.
fn decode_shape(cfg: &GptConfig, context: Option<usize>, chunk: Option<usize>) -> anyhow::Result<DecodeShape> {
    let default = DecodeShape::of(cfg);
    let context = context.unwrap_or(default.context);
    if !(1..=cfg.block_size).contains(&context) {
        return Err(UsageError(format!(
            "--context: {context} must be 1..={} (the model's block size)",
            cfg.block_size
        ))
        .into());
    }
    let chunk = chunk.unwrap_or(default.chunk.min(context));
    if !(1..=context).contains(&chunk) {
        return Err(UsageError(format!("--chunk: {chunk} must be 1..={context} (the context)")).into());
    }
    Ok(DecodeShape { context, chunk })
}

/// A quantized model file, checked against the job's model.
fn read_quantized(file: &Path, cfg: &GptConfig) -> anyhow::Result<QuantModel> {
    let model = QuantModel::read(file).map_err(|e| UsageError(e.to_string()))?;
    if model.cfg != *cfg {
        return Err(UsageError(format!("{}: quantized from another model than the job's", file.display())).into());
    }
    Ok(model)
}

/// The run directory: as given, or the trainer's default.
fn run_dir_of(spec: &JobSpec, run_dir: &Option<PathBuf>) -> PathBuf {
    run_dir.clone().unwrap_or_else(|| default_run_dir(spec))
}

/// The newest checkpoint's fp32 weights, checked against the job's model.
fn newest_weights(spec: &JobSpec, run_dir: &Option<PathBuf>) -> anyhow::Result<(PathBuf, Vec<f32>)> {
    let dir = run_dir_of(spec, run_dir);
    let cfg = gpt_config(spec);
    let (path, ckpt) =
        checkpoint::load_latest(&dir, None, |e| tracing::warn!("skipping checkpoint: {e}")).ok_or_else(|| {
            UsageError(format!("--run-dir {}: no checkpoint to read (train the job first)", dir.display()))
        })?;
    if ckpt.header.model != cfg.dims() {
        return Err(UsageError(format!(
            "{}: a model of dimensions {:?}, not the job's {:?}",
            path.display(),
            ckpt.header.model,
            cfg.dims()
        ))
        .into());
    }
    Ok((path, ckpt.params))
}

fn scheme(text: &str, flag: &str) -> anyhow::Result<Scheme> {
    Scheme::parse(text).map_err(|e| UsageError(format!("{flag}: {e}")).into())
}

pub fn quantize(args: QuantizeArgs) -> anyhow::Result<()> {
    let spec = JobSpec::load(&args.config)?;
    let scheme = scheme(&args.scheme, "--scheme")?;
    let (from, weights) = newest_weights(&spec, &args.run_dir)?;
    let model = quant::quantize(&gpt_config(&spec), &weights, scheme);
    model.write(&args.out)?;
    println!(
        "{} → {}: {} ({}), {} of weights ({:.3} of fp32's {})",
        from.display(),
        args.out.display(),
        spec.name,
        scheme.name(),
        format_bytes(model.bytes()),
        model.bytes() as f64 / (4 * weights.len()) as f64,
        format_bytes(4 * weights.len())
    );
    Ok(())
}

pub fn eval(args: EvalArgs) -> anyhow::Result<()> {
    let spec = JobSpec::load(&args.config)?;
    let cfg = gpt_config(&spec);
    let models: Vec<QuantModel> = match &args.quantized {
        Some(file) => vec![read_quantized(file, &cfg)?],
        None => {
            let schemes = args.schemes.iter().map(|s| scheme(s, "--schemes")).collect::<anyhow::Result<Vec<_>>>()?;
            let (_, weights) = newest_weights(&spec, &args.run_dir)?;
            schemes.into_iter().map(|s| quant::quantize(&cfg, &weights, s)).collect()
        }
    };
    let cache = run_dir_of(&spec, &args.run_dir);
    let tokens = load_tokens(&spec.data.path, spec.model.vocab, &cache)?;
    let data = Dataset::new(tokens, spec.data.val_fraction, cfg.block_size, spec.train.seed)
        .map_err(|e| UsageError(format!("data.path {}: {e}", spec.data.path.display())))?;
    let count = args.sequences.unwrap_or(spec.train.eval_batches as usize * spec.train.global_batch as usize).max(1);
    let micro = spec.train.micro_batch as usize;
    println!(
        "{} ({} parameters), {count} validation sequences of {} tokens",
        spec.name,
        cfg.num_params(),
        cfg.block_size
    );
    println!(
        "{:<11} {:>14} {:>9} {:>10} {:>11} {:>9}",
        "scheme", "weight bytes", "× fp32", "val loss", "perplexity", "Δ ppl"
    );
    let fp32_bytes = 4 * cfg.num_params();
    let mut first = None;
    for model in &models {
        let backend = CpuBackend::new(Pool::new("cpu", 64 << 30));
        let (loss, bytes) = quant::validation_loss(&backend, model, &data, count, micro)?;
        let ppl = loss.exp();
        let reference = *first.get_or_insert(ppl);
        println!(
            "{:<11} {:>14} {:>9.3} {:>10.4} {:>11.3} {:>8.2}%",
            model.scheme.name(),
            format_bytes(bytes),
            bytes as f64 / fp32_bytes as f64,
            loss,
            ppl,
            100.0 * (ppl / reference - 1.0)
        );
    }
    Ok(())
}
