//! `headroom bench`: ms/step and tokens/s of fp32 training steps on the CPU device for given
//! model shapes, on synthetic tokens (no data file needed).

use crate::config::{Checkpointing, Precision};
use crate::memory::{format_bytes, Category, MemStats, Pool};

use crate::config::Knobs;
use crate::engine::backend::layers::Elem;
use crate::engine::estimate::estimate_step;

use crate::engine::model::GptConfig;
use crate::engine::rng::mix64;
use crate::engine::train::trainer::{Hyper, Trainer};

#[derive(Debug, Clone)]
pub struct BenchCase {
    pub label: String,
    pub cfg: GptConfig,
    pub batch: usize,
    pub seq: usize,
}

#[derive(Debug, Clone)]
pub struct BenchResult {
    pub case: BenchCase,
    pub params: usize,
    pub ms_per_step: f64,
    pub min_ms: f64,
    pub tokens_per_s: f64,
    pub peak_allocated: usize,
}

/// The shapes the README compares against llm.c's CPU trainer.
pub fn preset(name: &str) -> Option<Vec<BenchCase>> {
    let small = BenchCase {
        label: "d4-256 gpt2-vocab".into(),
        cfg: GptConfig { n_layer: 4, n_head: 4, n_embd: 256, block_size: 64, vocab: 50257 },
        batch: 4,
        seq: 64,
    };
    let gpt2 = BenchCase {
        label: "gpt2-124M".into(),
        cfg: GptConfig { n_layer: 12, n_head: 12, n_embd: 768, block_size: 1024, vocab: 50257 },
        batch: 4,
        seq: 64,
    };
    let tiny = BenchCase {
        label: "d2-64 bytes".into(),
        cfg: GptConfig { n_layer: 2, n_head: 4, n_embd: 64, block_size: 64, vocab: 256 },
        batch: 16,
        seq: 64,
    };
    let d4_128 = BenchCase {
        label: "d4-128 bytes".into(),
        cfg: GptConfig { n_layer: 4, n_head: 4, n_embd: 128, block_size: 256, vocab: 256 },
        batch: 16,
        seq: 256,
    };
    match name {
        "d4-128" => Some(vec![d4_128]),
        "small" => Some(vec![small]),
        "gpt2" => Some(vec![gpt2]),
        "tiny" => Some(vec![tiny]),
        "all" => Some(vec![tiny, small, gpt2]),
        _ => None,
    }
}

/// Time `steps` optimizer steps after `warmup` untimed ones.
pub fn run_case(
    case: &BenchCase,
    warmup: usize,
    steps: usize,
) -> Result<BenchResult, crate::engine::backend::BackendError> {
    run_configured::<f32>(case, case.batch, Checkpointing::None, warmup, steps).map(|(r, _)| r)
}

/// Like [`run_case`] with `micro_batch` (accumulating to `case.batch`) and a checkpointing mode;
/// also returns the pool's final statistics.
pub fn run_configured<E: Elem>(
    case: &BenchCase,
    micro_batch: usize,
    checkpointing: Checkpointing,
    warmup: usize,
    steps: usize,
) -> Result<(BenchResult, MemStats), crate::engine::backend::BackendError> {
    let backend = crate::engine::backend::CpuBackend::new(Pool::new("cpu", usize::MAX / 2));
    let techniques = Techniques { checkpointing, ..Techniques::default() };
    run_on::<E, _>(backend, case, micro_batch, techniques, warmup, steps)
}

/// The memory techniques of a timed run besides precision and micro-batch.
#[derive(Debug, Clone, Copy, Default)]
pub struct Techniques {
    pub checkpointing: Checkpointing,
    pub offload_params: bool,
    pub offload_optimizer: bool,
    pub offload_activations: crate::config::OffloadTarget,
}

/// [`run_configured`] on any backend (e.g. a GPU's) with any techniques, and its pool's stats.
pub fn run_on<E: Elem, B: crate::engine::backend::Backend>(
    backend: B,
    case: &BenchCase,
    micro_batch: usize,
    techniques: Techniques,
    warmup: usize,
    steps: usize,
) -> Result<(BenchResult, MemStats), crate::engine::backend::BackendError> {
    let Techniques { checkpointing, offload_params, offload_optimizer, offload_activations } = techniques;
    let hyper = Hyper {
        knobs: Knobs {
            micro_batch,
            grad_accum: case.batch / micro_batch,
            seq_len: case.seq,
            checkpointing,
            offload_optimizer,
            offload_params,
            offload_activations,
            world_size: 1,
            zero_stage: 0,
            precision: crate::config::Precision::Fp32,
            expandable_segments: backend.pool().expandable(),
        },
        steps: (warmup + steps) as u64,
        global_batch: case.batch,
        lr: 3e-4,
        warmup_steps: 0,
        weight_decay: 0.1,
        grad_clip: 1.0,
        seed: 1,
    };
    let pool = backend.pool().clone();
    let mut trainer = Trainer::<E, B>::on_backend(case.cfg, hyper, backend, None)?;
    let vocab = case.cfg.vocab as u64;
    let mut batch = |s: u64, i: u64, inp: &mut Vec<u32>, tgt: &mut Vec<u32>| {
        for p in 0..case.seq as u64 {
            inp.push((mix64(s * 7919 + i * 104729 + p) % vocab) as u32);
            tgt.push((mix64(s * 7919 + i * 104729 + p + 1) % vocab) as u32);
        }
    };
    for _ in 0..warmup {
        trainer.train_step(&mut batch)?;
    }
    let mut times = Vec::new();
    for _ in 0..steps {
        times.push(trainer.train_step(&mut batch)?.step_ms);
    }
    let mean = times.iter().sum::<f64>() / times.len() as f64;
    let min = times.iter().copied().fold(f64::INFINITY, f64::min);
    let stats = pool.stats();
    let result = BenchResult {
        case: case.clone(),
        params: case.cfg.num_params(),
        ms_per_step: mean,
        min_ms: min,
        tokens_per_s: (case.batch * case.seq) as f64 / (mean / 1e3),
        peak_allocated: stats.peak_allocated,
    };
    Ok((result, stats))
}

/// The memory-technique table: measured peak per category and step time for each knob setting
/// at the same global batch, with the estimator's prediction beside the measurement.
pub fn techniques_table(
    case: &BenchCase,
    warmup: usize,
    steps: usize,
) -> Result<String, crate::engine::backend::BackendError> {
    let quarter = (case.batch / 4).max(1);
    let settings = [
        ("fp32 baseline", Precision::Fp32, case.batch, Checkpointing::None),
        ("bf16", Precision::Bf16, case.batch, Checkpointing::None),
        ("bf16 + selective", Precision::Bf16, case.batch, Checkpointing::Selective),
        ("bf16 + full", Precision::Bf16, case.batch, Checkpointing::Full),
        ("bf16 + full, micro/4", Precision::Bf16, quarter, Checkpointing::Full),
        ("fp32 + full, micro/4", Precision::Fp32, quarter, Checkpointing::Full),
    ];
    let mut s = format!(
        "{} (params {}), global batch {}, T {}\n{:<22} {:>5} {:>11} {:>11} {:>11} {:>12} {:>11} {:>12} {:>12} {:>7} {:>9}\n",
        case.label,
        case.cfg.num_params(),
        case.batch,
        case.seq,
        "setting",
        "mb",
        "params",
        "grads",
        "optimizer",
        "activations",
        "workspace",
        "peak alloc",
        "estimated",
        "ratio",
        "ms/step"
    );
    let mut baseline = None;
    for (label, precision, micro, mode) in settings {
        let (r, st) = match precision {
            Precision::Fp32 => run_configured::<f32>(case, micro, mode, warmup, steps)?,
            Precision::Bf16 => run_configured::<half::bf16>(case, micro, mode, warmup, steps)?,
            Precision::Fp16 => run_configured::<half::f16>(case, micro, mode, warmup, steps)?,
        };
        let est = estimate_step(
            &case.cfg,
            &Knobs { checkpointing: mode, precision, ..Knobs::plain(micro, case.seq, case.batch / micro) },
        );
        let base = *baseline.get_or_insert(st.peak_allocated);
        s.push_str(&format!(
            "{:<22} {:>5} {:>11} {:>11} {:>11} {:>12} {:>11} {:>12} {:>12} {:>7.2} {:>9.1}\n",
            label,
            micro,
            format_bytes(st.peak(Category::Params)),
            format_bytes(st.peak(Category::Grads)),
            format_bytes(st.peak(Category::Optimizer)),
            format_bytes(st.peak(Category::Activations)),
            format_bytes(st.peak(Category::Workspace)),
            format_bytes(st.peak_allocated),
            format_bytes(est.peak_allocated),
            st.peak_allocated as f64 / base as f64,
            r.ms_per_step
        ));
    }
    Ok(s)
}

pub fn print_table(results: &[BenchResult]) -> String {
    let mut s = format!(
        "{:<20} {:>10} {:>4} {:>5} {:>12} {:>10} {:>12} {:>12}\n",
        "model", "params", "B", "T", "ms/step", "min ms", "tokens/s", "peak alloc"
    );
    for r in results {
        s.push_str(&format!(
            "{:<20} {:>10} {:>4} {:>5} {:>12.1} {:>10.1} {:>12.0} {:>12}\n",
            r.case.label,
            r.params,
            r.case.batch,
            r.case.seq,
            r.ms_per_step,
            r.min_ms,
            r.tokens_per_s,
            format_bytes(r.peak_allocated)
        ));
    }
    s
}

/// The parallelism / offload table: each setting trains the same job for a few steps through
/// the real `headroom train` path (in process, events captured) and reports rank 0's measured
/// peak per category, host bytes and step time.
pub fn parallel_table(
    data_path: &std::path::Path,
    steps: usize,
) -> Result<String, crate::engine::train::job::TrainError> {
    use std::sync::{Arc, Mutex};
    let settings: [(&str, &str); 17] = [
        ("1 rank", "world_size: 1"),
        ("2 ranks, ZeRO-0", "world_size: 2, zero_stage: 0"),
        ("2 ranks, ZeRO-1", "world_size: 2, zero_stage: 1"),
        ("2 ranks, ZeRO-2", "world_size: 2, zero_stage: 2"),
        ("2 ranks, ZeRO-3", "world_size: 2, zero_stage: 3"),
        ("4 ranks, ZeRO-0", "world_size: 4, zero_stage: 0"),
        ("4 ranks, ZeRO-1", "world_size: 4, zero_stage: 1"),
        ("4 ranks, ZeRO-2", "world_size: 4, zero_stage: 2"),
        ("4 ranks, ZeRO-3", "world_size: 4, zero_stage: 3"),
        ("bf16, 4 ranks, ZeRO-3", "precision: bf16, world_size: 4, zero_stage: 3"),
        ("offload optimizer", "offload: { optimizer: cpu }"),
        ("offload params", "offload: { params: cpu }"),
        ("offload params + optim", "offload: { params: cpu, optimizer: cpu }"),
        ("full ckpt", "checkpointing: full"),
        ("full ckpt + offload acts", "checkpointing: full, offload: { activations: cpu }"),
        ("full ckpt + acts int8", "checkpointing: full, offload: { activations: cpu-int8 }"),
        ("4 ranks, ZeRO-3 + all off", "world_size: 4, zero_stage: 3, checkpointing: full, offload: { params: cpu, optimizer: cpu, activations: cpu }"),
    ];
    let mut out = format!(
        "d4-128 bytes, global batch 16, T 128, micro-batch 16 / ranks; rank 0's pool, mean of {steps} steps after the first\n\
         {:<27} {:>10} {:>10} {:>10} {:>11} {:>10} {:>11} {:>11} {:>9} {:>6}\n",
        "setting", "params", "grads", "optimizer", "activations", "workspace", "peak alloc", "host bytes", "ms/step", "swap"
    );
    for (label, memory) in settings {
        let world: usize = memory.split("world_size: ").nth(1).and_then(|r| r[..1].parse().ok()).unwrap_or(1);
        let yaml = format!(
            "name: bench\nmodel: {{ n_layer: 4, n_head: 4, n_embd: 128, block_size: 128, vocab: bytes }}\n\
             data: {{ path: {} }}\ntrain: {{ steps: {}, global_batch: 16, micro_batch: {}, lr: 1.0e-3 }}\n\
             memory: {{ {memory} }}\ndevice: {{ kind: cpu, device_memory: 4GiB }}\n",
            data_path.display(),
            steps + 1,
            16 / world
        );
        let spec = crate::config::JobSpec::parse(&yaml)?;
        let buf = Arc::new(Mutex::new(Vec::<u8>::new()));
        struct Sink(Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for Sink {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap_or_else(|e| e.into_inner()).extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let dir = std::env::temp_dir().join(format!("headroom-bench-{}", std::process::id()));
        let opts = crate::engine::train::job::TrainOptions {
            run_dir: dir.clone(),
            owner: None,
            resume: crate::engine::train::job::ResumeMode::Fresh,
            stop_after: None,
            listen_stdin: false,
        };
        crate::engine::train::job::train(
            &spec,
            &opts,
            &mut crate::engine::train::job::Events::new(Box::new(Sink(buf.clone()))),
        )?;
        let _ = std::fs::remove_dir_all(&dir);
        let text = String::from_utf8(buf.lock().unwrap_or_else(|e| e.into_inner()).clone()).unwrap_or_default();
        let steps_ev: Vec<serde_json::Value> = text
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["event"] == "step")
            .collect();
        let timed = &steps_ev[1.min(steps_ev.len() - 1)..];
        let ms = timed.iter().map(|e| e["step_ms"].as_f64().unwrap_or(0.0)).sum::<f64>() / timed.len() as f64;
        let m = &steps_ev.last().expect("steps ran")["mem"];
        let b = |k: &str| format_bytes(m[k].as_u64().unwrap_or(0) as usize);
        let host = ["host_params", "host_optimizer", "host_activations"]
            .iter()
            .map(|k| m[*k].as_u64().unwrap_or(0))
            .sum::<u64>();
        // Transfer time as a share of step time, over the timed steps.
        let swap = timed.iter().map(|e| e["swap"]["transfer_ms"].as_f64().unwrap_or(0.0)).sum::<f64>()
            / timed.iter().map(|e| e["step_ms"].as_f64().unwrap_or(0.0)).sum::<f64>().max(1e-9);
        out.push_str(&format!(
            "{:<27} {:>10} {:>10} {:>10} {:>11} {:>10} {:>11} {:>11} {:>9.1} {:>5.1}%\n",
            label,
            b("params"),
            b("grads"),
            b("optimizer"),
            b("activations"),
            b("workspace"),
            b("allocated"),
            format_bytes(host as usize),
            ms,
            swap * 100.0
        ));
    }
    Ok(out)
}
