//! `headroom bench`: ms/step and tokens/s of training steps (fp32, bf16 or fp16 storage) on the
//! CPU device for given model shapes, on synthetic tokens (no data file needed).

use crate::config::{Checkpointing, Precision};
use crate::memory::{format_bytes, Category, MemStats, Pool};

use crate::config::Knobs;
use crate::engine::backend::layers::Elem;
use crate::engine::estimate::estimate_step;

use crate::engine::model::{GptConfig, PpStage, TpShard};
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
    /// Mean over the timed steps of the time the step waited for copies and for the host
    /// optimizer over step time, and of the copy time hidden behind other work.
    pub swap_fraction: f64,
    pub hidden_ms: f64,
    /// Times the timed steps took memory from the device (`MemStats::num_reserves`): 0 when the
    /// pool's cache serves the steady state, as it must.
    pub reserves: u64,
}

/// The shapes docs/INTERNALS.md compares against llm.c's CPU trainer.
pub fn preset(name: &str) -> Option<Vec<BenchCase>> {
    let small = BenchCase {
        label: "d4-256 gpt2-vocab".into(),
        cfg: GptConfig {
            n_layer: 4,
            n_head: 4,
            n_embd: 256,
            block_size: 64,
            vocab: 50257,
            tp: TpShard::NONE,
            pp: PpStage::NONE,
        },
        batch: 4,
        seq: 64,
    };
    let gpt2 = BenchCase {
        label: "gpt2-124M".into(),
        cfg: GptConfig {
            n_layer: 12,
            n_head: 12,
            n_embd: 768,
            block_size: 1024,
            vocab: 50257,
            tp: TpShard::NONE,
            pp: PpStage::NONE,
        },
        batch: 4,
        seq: 64,
    };
    let tiny = BenchCase {
        label: "d2-64 bytes".into(),
        cfg: GptConfig {
            n_layer: 2,
            n_head: 4,
            n_embd: 64,
            block_size: 64,
            vocab: 256,
            tp: TpShard::NONE,
            pp: PpStage::NONE,
        },
        batch: 16,
        seq: 64,
    };
    let d4_128 = BenchCase {
        label: "d4-128 bytes".into(),
        cfg: GptConfig {
            n_layer: 4,
            n_head: 4,
            n_embd: 128,
            block_size: 256,
            vocab: 256,
            tp: TpShard::NONE,
            pp: PpStage::NONE,
        },
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

/// Time `steps` optimizer steps after `warmup` untimed ones, with `precision` storage.
pub fn run_case(
    case: &BenchCase,
    precision: Precision,
    warmup: usize,
    steps: usize,
) -> Result<BenchResult, crate::engine::backend::BackendError> {
    let (micro, mode) = (case.batch, Checkpointing::None);
    let run = match precision {
        Precision::Fp32 => run_configured::<f32>(case, micro, mode, warmup, steps),
        Precision::Bf16 => run_configured::<half::bf16>(case, micro, mode, warmup, steps),
        Precision::Fp16 => run_configured::<half::f16>(case, micro, mode, warmup, steps),
    };
    run.map(|(r, _)| r)
}

/// [`profile_on`] of `case` on two cpu backends, with `precision` storage.
pub fn profile_cpu(
    case: &BenchCase,
    precision: Precision,
    warmup: usize,
    steps: usize,
) -> Result<String, crate::engine::backend::BackendError> {
    let open = || crate::engine::backend::CpuBackend::new(Pool::new("cpu", usize::MAX / 2));
    let (micro, techniques) = (case.batch, Techniques::default());
    match precision {
        Precision::Fp32 => profile_on::<f32, _>(open(), open(), case, micro, techniques, warmup, steps),
        Precision::Bf16 => profile_on::<half::bf16, _>(open(), open(), case, micro, techniques, warmup, steps),
        Precision::Fp16 => profile_on::<half::f16, _>(open(), open(), case, micro, techniques, warmup, steps),
    }
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
    /// With `offload_optimizer`: the host update overlaps the next step.
    pub delayed_update: bool,
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
    run_on_with::<E, B>(backend, case, micro_batch, techniques, warmup, steps, |_| {})
}

/// The per-op profile of `case`'s training step (`check::profile`): the step timed plain on
/// `plain`, then with every op timed on `profiled` (a second backend of the same device); the
/// table of both.
pub fn profile_on<E: Elem, B: crate::engine::backend::Backend>(
    plain: B,
    profiled: B,
    case: &BenchCase,
    micro_batch: usize,
    techniques: Techniques,
    warmup: usize,
    steps: usize,
) -> Result<String, crate::engine::backend::BackendError> {
    use crate::engine::check::profile::{self, Profiled};
    let (plain, _) = run_on::<E, B>(plain, case, micro_batch, techniques, warmup, steps)?;
    let profiled = Profiled::new(profiled);
    let handle = profiled.handle();
    let (measured, stats) =
        run_on_with::<E, _>(profiled, case, micro_batch, techniques, warmup, steps, |_| handle.reset())?;
    Ok(format!(
        "{} {} (params {}), B {}, T {}, micro-batch {micro_batch}, {} steps, peak allocated {}\n{}",
        case.label,
        E::NAME,
        case.cfg.num_params(),
        case.batch,
        case.seq,
        steps,
        format_bytes(stats.peak_allocated),
        profile::table(&handle.totals(), steps, measured.ms_per_step, Some(plain.ms_per_step))
    ))
}

/// The classifier's matmuls timed at one row width (`oc` columns of the logits).
#[derive(Debug, Clone, Copy)]
pub struct ClassifierTiming {
    pub oc: usize,
    pub forward_ms: f64,
    pub backward_ms: f64,
}

impl ClassifierTiming {
    /// Achieved TFLOP/s of forward (2·N·C·OC) and backward (twice that).
    pub fn tflops(&self, n: usize, c: usize) -> (f64, f64) {
        let flops = 2.0 * (n * c * self.oc) as f64;
        (flops / self.forward_ms / 1e9, 2.0 * flops / self.backward_ms / 1e9)
    }
}

/// The classifier's matmul forward and backward, (N, C) · (OC, C)ᵀ, timed (median of `reps`
/// after one untimed) at `oc = v` and, unless it is one, at `v` rounded up to a multiple of 64:
/// whether the logits' row width — GPT-2's 50,257 makes every row start off a 16-byte boundary
/// in 16-bit storage — costs the device's GEMMs speed (the question llm.c answers by padding
/// the vocabulary).
pub fn classifier_widths<E: Elem, B: crate::engine::backend::Backend>(
    be: &B,
    n: usize,
    c: usize,
    v: usize,
    reps: usize,
) -> Result<Vec<ClassifierTiming>, crate::engine::backend::BackendError> {
    use crate::engine::backend::{View, ViewMut};
    use crate::engine::model::alloc_elems;
    let pool = be.pool();
    let mut out = Vec::new();
    let mut widths = vec![v, v.next_multiple_of(64)];
    widths.dedup();
    for oc in widths {
        let mut inp = alloc_elems::<E>(pool, n * c, Category::Activations)?;
        let mut weight = alloc_elems::<E>(pool, oc * c, Category::Params)?;
        let mut logits = alloc_elems::<E>(pool, n * oc, Category::Activations)?;
        let mut dinp = alloc_elems::<E>(pool, n * c, Category::Workspace)?;
        let mut dweight = alloc_elems::<E>(pool, oc * c, Category::Grads)?;
        for buf in [&mut inp, &mut weight, &mut dweight] {
            be.zero::<E>(ViewMut::of(buf))?;
        }
        let time = |f: &mut dyn FnMut() -> Result<(), crate::engine::backend::BackendError>| {
            let mut ms = Vec::with_capacity(reps);
            for i in 0..=reps.max(1) {
                be.synchronize()?;
                let t0 = std::time::Instant::now();
                f()?;
                be.synchronize()?;
                if i > 0 {
                    ms.push(t0.elapsed().as_secs_f64() * 1e3);
                }
            }
            ms.sort_by(f64::total_cmp);
            Ok::<f64, crate::engine::backend::BackendError>(ms[ms.len() / 2])
        };
        let forward_ms = time(&mut || {
            be.matmul_forward::<E>(ViewMut::of(&mut logits), View::of(&inp), View::of(&weight), None, n, c, oc)
        })?;
        let backward_ms = time(&mut || {
            be.matmul_backward::<E>(
                ViewMut::of(&mut dinp),
                ViewMut::of(&mut dweight),
                None,
                View::of(&logits),
                View::of(&inp),
                View::of(&weight),
                n,
                c,
                oc,
            )
        })?;
        out.push(ClassifierTiming { oc, forward_ms, backward_ms });
    }
    Ok(out)
}

/// One line of [`classifier_widths`]' timings: each width's milliseconds and TFLOP/s, and how
/// much faster the padded width ran.
pub fn classifier_widths_line(n: usize, c: usize, timings: &[ClassifierTiming]) -> String {
    let rate = |t: &ClassifierTiming| {
        let (f, b) = t.tflops(n, c);
        format!("{}: forward {:.2} ms ({f:.1} TFLOP/s), backward {:.2} ms ({b:.1})", t.oc, t.forward_ms, t.backward_ms)
    };
    match timings {
        [one] => format!("{}; already a multiple of 64", rate(one)),
        [v, padded] => {
            let gain = (v.forward_ms + v.backward_ms) / (padded.forward_ms + padded.backward_ms);
            format!("{}; {}; padded {gain:.2}x faster", rate(v), rate(padded))
        }
        _ => "no timings".into(),
    }
}

/// [`run_on`], calling `measuring` with the backend once the warm-up steps are done.
pub fn run_on_with<E: Elem, B: crate::engine::backend::Backend>(
    backend: B,
    case: &BenchCase,
    micro_batch: usize,
    techniques: Techniques,
    warmup: usize,
    steps: usize,
    measuring: impl FnOnce(&B),
) -> Result<(BenchResult, MemStats), crate::engine::backend::BackendError> {
    let Techniques { checkpointing, offload_params, offload_optimizer, offload_activations, delayed_update } =
        techniques;
    let hyper = Hyper {
        knobs: Knobs {
            micro_batch,
            grad_accum: case.batch / micro_batch,
            seq_len: case.seq,
            checkpointing,
            offload_optimizer,
            offload_params,
            offload_activations,
            delayed_update,
            world_size: 1,
            tensor_parallel: 1,
            pipeline_parallel: 1,
            zero_stage: 0,
            precision: crate::config::from_serde_name(E::NAME).expect("an Elem's NAME is its precision's"),
            expandable_segments: backend.pool().expandable(),
            static_allocator: false,
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
    measuring(trainer.backend());
    let reserves_before = pool.stats().num_reserves;
    let (mut times, mut fractions, mut hidden) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..steps {
        let step = trainer.train_step(&mut batch)?;
        let swap = step.swap.unwrap_or_default();
        fractions.push((swap.transfer_ms + swap.host_ms) / step.step_ms.max(1e-9));
        hidden.push(swap.hidden_ms);
        times.push(step.step_ms);
    }
    let mean_of = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
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
        swap_fraction: mean_of(&fractions),
        hidden_ms: mean_of(&hidden),
        reserves: stats.num_reserves - reserves_before,
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
    let settings: [(&str, &str); 22] = [
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
        ("2 ranks, TP 2", "world_size: 2, tensor_parallel: 2"),
        ("4 ranks, TP 4", "world_size: 4, tensor_parallel: 4"),
        ("4 ranks, TP 2 × DP 2, ZeRO-1", "world_size: 4, tensor_parallel: 2, zero_stage: 1"),
        ("2 ranks, PP 2", "world_size: 2, pipeline_parallel: 2"),
        ("4 ranks, TP 2 × PP 2", "world_size: 4, tensor_parallel: 2, pipeline_parallel: 2"),
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
        let tp: usize = memory.split("tensor_parallel: ").nth(1).and_then(|r| r[..1].parse().ok()).unwrap_or(1);
        let pp: usize = memory.split("pipeline_parallel: ").nth(1).and_then(|r| r[..1].parse().ok()).unwrap_or(1);
        let yaml = format!(
            "name: bench\nmodel: {{ n_layer: 4, n_head: 4, n_embd: 128, block_size: 128, vocab: bytes }}\n\
             data: {{ path: {} }}\ntrain: {{ steps: {}, global_batch: 16, micro_batch: {}, lr: 1.0e-3 }}\n\
             memory: {{ {memory} }}\ndevice: {{ kind: cpu, device_memory: 4GiB }}\n",
            data_path.display(),
            steps + 1,
            16 / (world / (tp * pp))
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
            processes: Default::default(),
        };
        crate::engine::train::train(
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

/// `headroom bench --host-adamw`: the optimizer-offload update over `n` parameters (bf16
/// gradients, as the XL case has them) — the textbook scalar loop, today's three passes
/// (widen, update, narrow; all cores) and the fused pass (all cores, the widest vector unit),
/// against the machine's memory bandwidth (a parallel copy). Best of `runs` after one warm-up.
pub fn host_adamw_table(n: usize, runs: usize) -> String {
    use crate::engine::backend::layers::{narrow, widen};
    use crate::engine::backend::optim::{update_scalar, AdamW};
    use crate::engine::backend::simd::host_simd;
    use half::bf16;
    use rayon::prelude::*;
    let opt = AdamW { lr: 1e-4, weight_decay: 0.1, t: 10 };
    let fill = |seed: u64| -> Vec<f32> {
        (0..n)
            .into_par_iter()
            .map(|i| ((mix64(seed ^ i as u64) >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 1e-2)
            .collect()
    };
    let (mut master, mut m) = (fill(1), fill(2));
    let mut v: Vec<f32> = fill(3).par_iter().map(|x| x.abs()).collect();
    let grads: Vec<bf16> = fill(4).par_iter().map(|&x| bf16::from_f32(x)).collect();
    let mut wide = vec![0.0f32; n];
    let mut io = grads.clone();
    let tensors = || [(0..n, true)];
    let best = |f: &mut dyn FnMut()| -> f64 {
        f();
        (0..runs.max(1))
            .map(|_| {
                let t = std::time::Instant::now();
                f();
                t.elapsed().as_secs_f64()
            })
            .fold(f64::INFINITY, f64::min)
    };
    // Bytes per parameter each path moves through memory.
    let fused_bytes = 2.0 + 3.0 * 8.0 + 2.0; // bf16 grad in; master, m, v read and written; bf16 weight out
    let scalar_bytes = 4.0 + 3.0 * 8.0;
    let three_bytes = (2.0 + 4.0) + (4.0 + 3.0 * 8.0) + (4.0 + 2.0);
    let scalar = best(&mut || update_scalar(&opt, &mut master, &wide, &mut m, &mut v, 0.1));
    let three = best(&mut || {
        widen::<bf16>(&mut wide, &grads);
        opt.update::<f32>(tensors(), &mut master, &wide, 1.0, &mut m, &mut v);
        narrow::<bf16>(&mut io, &master);
    });
    let fused = best(&mut || {
        io.copy_from_slice(&grads);
        opt.update_host::<bf16>(tensors(), &mut master, &mut io, 1.0, &mut m, &mut v);
    });
    // The copy of `grads` into `io` above is part of the fused timing; take it out.
    let refill = best(&mut || io.copy_from_slice(&grads));
    let fused = (fused - refill).max(1e-9);
    let mut dst = vec![0.0f32; n];
    let copy =
        best(&mut || dst.par_chunks_mut(1 << 16).zip(m.par_chunks(1 << 16)).for_each(|(d, s)| d.copy_from_slice(s)));
    let bandwidth = 8.0 * n as f64 / copy;
    let row = |name: &str, secs: f64, bytes: f64| {
        format!(
            "{name:<44} {:>9.1} {:>8.1} {:>7.0}% {:>7.2}×\n",
            n as f64 / secs / 1e6,
            bytes * n as f64 / secs / 1e9,
            bytes * n as f64 / secs / bandwidth * 100.0,
            scalar / secs
        )
    };
    let mut out = format!(
        "host AdamW over {n} parameters (bf16 gradients), {} threads, SIMD {}; memory bandwidth (parallel copy) {:.1} GB/s\n",
        rayon::current_num_threads(),
        host_simd(),
        bandwidth / 1e9
    );
    out.push_str(&format!("{:<44} {:>9} {:>8} {:>8} {:>8}\n", "path", "Mparam/s", "GB/s", "of bw", "vs scalar"));
    out.push_str(&row("scalar loop (1 thread, f32 gradients)", scalar, scalar_bytes));
    out.push_str(&row("widen + update + narrow (3 passes, all cores)", three, three_bytes));
    out.push_str(&row("fused (1 pass, all cores, SIMD)", fused, fused_bytes));
    std::hint::black_box((&master, &io, &dst));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::backend::{Backend, CpuBackend};

    /// The vocabulary's width and the next multiple of 64 are both timed (once when they are
    /// the same), and the line names each with its rates.
    #[test]
    fn the_classifier_is_timed_at_its_width_and_padded_to_64() {
        let be = CpuBackend::new(Pool::new("cpu", 64 << 20));
        let (n, c) = (32, 16);
        let timed = classifier_widths::<half::bf16, _>(&be, n, c, 100, 2).unwrap();
        assert_eq!(timed.iter().map(|t| t.oc).collect::<Vec<_>>(), [100, 128]);
        assert!(timed.iter().all(|t| t.forward_ms > 0.0 && t.backward_ms > 0.0), "{timed:?}");
        let line = classifier_widths_line(n, c, &timed);
        assert!(
            line.starts_with("100: forward ") && line.contains("; 128: forward ") && line.ends_with("x faster"),
            "{line}"
        );
        let aligned = classifier_widths::<half::bf16, _>(&be, n, c, 128, 1).unwrap();
        assert_eq!(aligned.len(), 1);
        assert!(classifier_widths_line(n, c, &aligned).ends_with("already a multiple of 64"));
        assert_eq!(be.pool().stats().allocated(), 0, "every buffer returned");
    }
}
