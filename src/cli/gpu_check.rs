//! `headroom gpu-check`: every CUDA op against the CPU reference, the device pool's two OOM
//! paths, training parity (CUDA vs CPU losses step by step), the OOM drill, and the GPT-2 124M
//! benchmark (B=16, T=1024, bf16), with a summary table printed last. Exit 1 if anything
//! failed, 2 when there is no usable device.

use super::client::UsageError;
use super::GpuCheckArgs;
use crate::engine::check::parity::ParityShape;

pub fn run(args: GpuCheckArgs) -> anyhow::Result<()> {
    if args.libraries {
        return libraries();
    }
    let shapes = match args.shapes.as_str() {
        "odd" => vec![ParityShape::ODD],
        "gpt2" => vec![ParityShape::GPT2],
        "all" => vec![ParityShape::ODD, ParityShape::GPT2],
        other => return Err(UsageError(format!("--shapes: unknown `{other}` (odd, gpt2, all)")).into()),
    };
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
    });
    run_on(&args, &shapes, seed)
}

/// The CUDA libraries, one line each: loaded (version and file), or why not.
#[cfg(feature = "cuda")]
fn print_libraries() -> Vec<crate::engine::backend::cuda::LibraryStatus> {
    let report = crate::engine::backend::cuda::library_report();
    for l in &report {
        let status = match (l.loaded, l.required) {
            (true, _) => "ok",
            (false, true) => "MISSING",
            (false, false) => "absent",
        };
        println!("{:<10} {:<8} {}", l.name, status, l.detail);
    }
    report
}

/// `--libraries`: one line per library; exit 2 when one a cuda device needs is missing.
#[cfg(feature = "cuda")]
fn libraries() -> anyhow::Result<()> {
    let report = print_libraries();
    let missing: Vec<&str> = report.iter().filter(|l| l.required && !l.loaded).map(|l| l.name).collect();
    if !missing.is_empty() {
        return Err(UsageError(format!("cuda devices cannot be used here: {} missing", missing.join(", "))).into());
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn libraries() -> anyhow::Result<()> {
    Err(UsageError("this build was not compiled with the `cuda` feature".into()).into())
}

#[cfg(not(feature = "cuda"))]
fn run_on(args: &GpuCheckArgs, _shapes: &[ParityShape], _seed: u64) -> anyhow::Result<()> {
    Err(UsageError(format!("device cuda:{}: this build was not compiled with the `cuda` feature", args.index)).into())
}

/// One line of the summary: what was checked, whether it passed, the figure that says so.
#[cfg(any(feature = "cuda", test))]
struct Check {
    name: String,
    ok: bool,
    figure: String,
}

#[cfg(feature = "cuda")]
fn run_on(args: &GpuCheckArgs, shapes: &[ParityShape], seed: u64) -> anyhow::Result<()> {
    use crate::engine::backend::cuda::CudaBackend;
    use crate::engine::backend::workspace::WorkspaceModel;
    use crate::engine::backend::Backend;
    use crate::memory::format_bytes;

    let index = args.index;
    let device = CudaBackend::new(index, None, false).map_err(|e| UsageError(e.to_string()))?;
    println!("device: cuda:{index} {} (pool capacity {})", device.name(), format_bytes(device.pool().stats().capacity));
    let vmm = CudaBackend::new(index, Some(64 << 20), true).is_ok_and(|d| d.pool().expandable());
    println!("expandable segments (virtual memory management): {}", if vmm { "supported" } else { "not supported" });
    print_libraries();
    let attention = device.attention_kernels();
    println!(
        "attention in 16-bit storage: {attention:?} ({}=gemm|fused)",
        crate::engine::backend::workspace::CudaAttentionKernels::VARIABLE
    );
    println!("seed: {seed}");
    drop(device);
    let open = |memory: Option<usize>, expandable: bool| {
        CudaBackend::new(index, memory, expandable).map_err(|e| anyhow::anyhow!("{e}"))
    };
    let gpt2 = crate::engine::check::bench::BenchCase {
        label: "GPT-2 124M".into(),
        cfg: crate::engine::model::GptConfig {
            n_layer: 12,
            n_head: 12,
            n_embd: 768,
            block_size: 1024,
            vocab: 50257,
            tp: crate::engine::model::TpShard::NONE,
            pp: crate::engine::model::PpStage::NONE,
        },
        batch: 16,
        seq: 1024,
    };
    let mut checks = checks(&open, WorkspaceModel::Cuda(attention), args, shapes, &gpt2, seed, true)?;
    checks.extend(nccl_checks(index, args)?);
    summary(&checks)
}

/// Two ranks on two GPUs with their collectives on NCCL, against two CPU ranks (ZeRO-1 and
/// ZeRO-3), when there is a second GPU: NCCL refuses two ranks on one GPU, so on one GPU it
/// only says whether libnccl loads.
#[cfg(feature = "cuda")]
fn nccl_checks(index: u32, args: &GpuCheckArgs) -> anyhow::Result<Vec<Check>> {
    use crate::engine::backend::cuda::{nccl, CudaBackend};
    use crate::engine::backend::CpuBackend;
    use crate::engine::check::train_parity::{train_parity, TrainParityCase};
    use crate::memory::Pool;
    use std::sync::Mutex;

    let gpus = cudarc::driver::CudaContext::device_count().unwrap_or(0).max(0) as u32;
    let tokens = corpus_tokens();
    let (Some(tokens), true, true) = (tokens, gpus >= index + 2, args.train_steps > 0) else {
        let library = nccl::version().unwrap_or_else(|e| e);
        println!("NCCL: not checked (needs cuda:{} too; this machine has {gpus} GPU(s)); {library}", index + 1);
        return Ok(Vec::new());
    };
    let mut checks = Vec::new();
    for stage in [1, 3] {
        let mut pair = vec![CudaBackend::new(index, None, false)?, CudaBackend::new(index + 1, None, false)?];
        let version = match nccl::attach(&mut pair) {
            Ok(version) => version,
            Err(e) => {
                checks.push(Check { name: "NCCL on two GPUs".into(), ok: false, figure: e.to_string() });
                break;
            }
        };
        let slots = Mutex::new(pair.into_iter().map(Some).collect::<Vec<_>>());
        let candidate = |rank: usize| {
            slots.lock().unwrap_or_else(|e| e.into_inner())[rank]
                .take()
                .ok_or_else(|| format!("rank {rank} opened twice"))
        };
        let case = TrainParityCase::small_ranks(args.train_steps, stage);
        let reference = |_rank| Ok(CpuBackend::new(Pool::new("cpu", 64 << 30)));
        let report = train_parity::<half::bf16, _, _>(reference, candidate, &case, &tokens);
        print!("{}", crate::engine::check::train_parity::table(std::slice::from_ref(&report)));
        let mut check = parity_check(&report);
        check.name = format!("{} on cuda:{}+{} ({version})", check.name, index, index + 1);
        checks.push(check);
    }
    Ok(checks)
}

/// Every check of `args` on backends made by `open(device_memory, expandable_segments)`, timing
/// `bench_case` in bf16.
/// `driver_refusal`: also check that an allocation beyond the device's memory is refused by
/// its allocator (not for a device whose segments are host memory, which the OS may overcommit).
#[cfg(any(feature = "cuda", test))]
#[allow(clippy::too_many_arguments)]
fn checks<B: crate::engine::backend::Backend>(
    open_with: &dyn Fn(Option<usize>, bool) -> anyhow::Result<B>,
    model: crate::engine::backend::workspace::WorkspaceModel,
    args: &GpuCheckArgs,
    shapes: &[ParityShape],
    bench_case: &crate::engine::check::bench::BenchCase,
    seed: u64,
    driver_refusal: bool,
) -> anyhow::Result<Vec<Check>> {
    use crate::engine::backend::CpuBackend;
    use crate::engine::check::{parity, train_parity, workspace_check};
    use crate::memory::{format_bytes, Category, Pool};

    let open = |memory: Option<usize>| open_with(memory, false);
    let device = open(None)?;
    let cpu = || CpuBackend::new(Pool::new("cpu", 64 << 30));
    let mut checks = Vec::new();

    // 1. Every op against the reference.
    let reference = cpu();
    let mut rows = Vec::new();
    for &shape in shapes {
        rows.extend(parity::run(&reference, &device, shape, seed));
    }
    print!("{}", parity::table(&rows));
    let passed = rows.iter().filter(|r| r.passed()).count();
    let worst = rows.iter().filter(|r| r.error.is_none()).map(|r| r.rel_err / r.threshold).fold(0.0, f64::max);
    checks.push(Check {
        name: format!("op parity ({} shapes × fp32/bf16/fp16)", shapes.len()),
        ok: passed == rows.len(),
        figure: format!("{passed}/{} rows within bounds; worst error {:.2} of its bound", rows.len(), worst),
    });
    drop(reference);

    // 1b. Every op's scratch, measured by the device's pool, against what the estimator sums
    // (the model's: with the fused attention kernels, theirs).
    let mut rows = Vec::new();
    let mut failure = None;
    for &shape in shapes {
        match workspace_check::run(&device, model, shape) {
            Ok(r) => rows.extend(r),
            Err(e) => failure = Some(e.to_string()),
        }
    }
    print!("{}", workspace_check::table(&rows));
    let exact = rows.iter().filter(|r| r.passed()).count();
    checks.push(Check {
        name: format!("op workspace = {} declarations", model.name()),
        ok: failure.is_none() && exact == rows.len(),
        figure: failure.unwrap_or_else(|| format!("{exact}/{} ops allocate exactly what they declare", rows.len())),
    });
    drop(device);

    // 2. The device pool's OOM paths: its own capacity, and the driver refusing cuMemAlloc.
    let small = open(Some(8 << 20))?;
    let held = small.pool().alloc(6 << 20, Category::Params);
    let over = small.pool().alloc(6 << 20, Category::Activations);
    checks.push(Check {
        name: "pool: device_memory 8 MiB".into(),
        ok: held.is_ok() && over.as_ref().is_err_and(|e| e.category == Category::Activations),
        figure: "6 MiB ok, 6 MiB more -> OomError".into(),
    });
    drop((held, over, small));
    if driver_refusal {
        let unbounded = open(Some(usize::MAX / 4))?;
        let beyond = unbounded.pool().alloc(2 << 40, Category::Activations);
        checks.push(Check {
            name: "pool: cuMemAlloc of 2 TiB".into(),
            ok: beyond.as_ref().is_err_and(|e| e.requested_bytes == 2 << 40),
            figure: "refused by the driver -> OomError".into(),
        });
        drop((beyond, unbounded));
    }

    // 3. Training parity and 4. the OOM drill, on the repository's corpus as bytes.
    match &corpus_tokens() {
        None if args.train_steps > 0 => checks.push(Check {
            name: "training parity".into(),
            ok: false,
            figure: format!("{CORPUS} not found: run from the repository root"),
        }),
        None => {}
        Some(tokens) => {
            if args.train_steps > 0 {
                use train_parity::{train_parity, TrainParityCase};
                let steps = args.train_steps;
                let (plain, offloaded) = (TrainParityCase::small(steps), TrainParityCase::small_offloaded(steps));
                let reference = |_rank| Ok(cpu());
                // Every rank on this device: the ranks' collectives are staged through the host.
                let device = |_rank| open(None).map_err(|e| e.to_string());
                let reports = vec![
                    train_parity::<f32, _, _>(reference, device, &plain, tokens),
                    train_parity::<half::bf16, _, _>(reference, device, &plain, tokens),
                    // fp16 storage with dynamic loss scaling (the CPU reference's).
                    train_parity::<half::f16, _, _>(reference, device, &plain, tokens),
                    // Checkpointing, int8 activation offload, host weights and host optimizer:
                    // every host↔device copy path of the trainer.
                    train_parity::<half::bf16, _, _>(reference, device, &offloaded, tokens),
                    // Two ranks: ZeRO-1 (all-reduce, all-gather) and ZeRO-3 (segment gathers,
                    // reduce-scatters), each rank's collectives staged through the host.
                    train_parity::<half::bf16, _, _>(
                        reference,
                        device,
                        &TrainParityCase::small_ranks(steps, 1),
                        tokens,
                    ),
                    train_parity::<half::bf16, _, _>(
                        reference,
                        device,
                        &TrainParityCase::small_ranks(steps, 3),
                        tokens,
                    ),
                    // Tensor parallelism: two ranks each computing half of every block, their
                    // partial sums staged through the host.
                    train_parity::<half::bf16, _, _>(
                        reference,
                        device,
                        &TrainParityCase::small_tensor_parallel(steps),
                        tokens,
                    ),
                    // Pipeline: two stages, activations and their gradients between them.
                    train_parity::<half::bf16, _, _>(
                        reference,
                        device,
                        &TrainParityCase::small_pipeline(steps),
                        tokens,
                    ),
                ];
                print!("{}", train_parity::table(&reports));
                checks.extend(reports.iter().map(parity_check));
                // Determinism: the same bf16 run twice on the device, bit for bit (no kernel
                // uses atomics; cuBLAS is deterministic on one device and toolkit).
                checks.push(determinism_check(&train_parity::<half::bf16, _, _>(device, device, &plain, tokens)));
            }
            let drill =
                train_parity::oom_drill(|capacity| open(Some(capacity)).map_err(|e| e.to_string()), model, tokens);
            checks.push(Check {
                name: format!("OOM in training at device_memory {}", format_bytes(drill.capacity)),
                ok: drill.passed(),
                figure: format!(
                    "plain: {}; full checkpointing: {}",
                    match &drill.plain {
                        Ok(_) => "OOM as expected".to_string(),
                        Err(e) => e.clone(),
                    },
                    match &drill.checkpointed {
                        Ok(peak) => format!("trained, peak reserved {}", format_bytes(*peak)),
                        Err(e) => e.clone(),
                    }
                ),
            });
            checks.push(fragmentation_check(open_with, model, tokens));
        }
    }

    // 5. With --estimate-grid, the estimator against this backend over the grid (GPT-2-small-like
    // shapes and the 1.5B headline configurations), unless the benchmark is off.
    if args.estimate_grid && args.bench_steps > 0 {
        use crate::engine::check::estimate_check;
        if let Some(tokens) = corpus_tokens() {
            let open = |memory: Option<usize>| open(memory).map_err(|e| e.to_string());
            let rows = estimate_check::run(&open, model, &estimate_check::grid(), &tokens);
            print!("{}", estimate_check::table(&rows));
            let passed = rows.iter().filter(|r| r.passed()).count();
            let worst =
                rows.iter().filter_map(|r| r.error()).fold(0.0f64, |w, e| if e.abs() > w.abs() { e } else { w });
            checks.push(Check {
                name: format!("estimator vs measured ({} configurations, {} model)", rows.len(), model.name()),
                ok: passed == rows.len(),
                figure: format!(
                    "{passed}/{} within -0.5%..+10% of peak allocated; largest error {:+.2}%",
                    rows.len(),
                    worst * 100.0
                ),
            });
        }
    }

    // 6. The benchmark: resident, then with the weights in host memory (every segment comes
    // over the copy stream, one ahead of its use: the step-time ratio is the overlap's price).
    if args.bench_steps > 0 {
        use crate::engine::check::bench::{self, Techniques};
        let case = bench_case;
        let offloaded = Techniques { offload_params: true, ..Techniques::default() };
        let runs = [
            (format!("{} B={} T={} bf16", case.label, case.batch, case.seq), Techniques::default()),
            (format!("{} bf16, offload params", case.label), offloaded),
        ];
        let mut resident_ms = None;
        for (name, techniques) in runs {
            let result = bench::run_on::<half::bf16, _>(open(None)?, case, case.batch, techniques, 1, args.bench_steps);
            checks.push(match result {
                Ok((r, stats)) => {
                    let ratio = resident_ms.map(|ms: f64| format!(", {:.2}x the resident step", r.ms_per_step / ms));
                    resident_ms.get_or_insert(r.ms_per_step);
                    // The steady state takes no memory from the driver (each cuMemAlloc or
                    // cuMemMap may synchronise the device): the pool's cache serves it.
                    Check {
                        name: name.clone(),
                        ok: r.reserves == 0,
                        figure: format!(
                            "{:.0} tokens/s, {:.1} ms/step (min {:.1}){}, peak allocated {}, reserved {}, {} device allocations in the timed steps",
                            r.tokens_per_s,
                            r.ms_per_step,
                            r.min_ms,
                            ratio.unwrap_or_default(),
                            format_bytes(stats.peak_allocated),
                            format_bytes(stats.peak_reserved),
                            r.reserves
                        ),
                    }
                }
                Err(e) => Check { name, ok: false, figure: e.to_string() },
            });
        }
        // Where the resident step's time goes (`--profile`): every op timed one at a time.
        if args.profile {
            let name = format!("profile of the {} bf16 step", case.label);
            let table = open(None).and_then(|plain| Ok((plain, open(None)?))).and_then(|(plain, profiled)| {
                bench::profile_on::<half::bf16, _>(
                    plain,
                    profiled,
                    case,
                    case.batch,
                    Techniques::default(),
                    1,
                    args.bench_steps,
                )
                .map_err(|e| anyhow::anyhow!("{e}"))
            });
            checks.push(match table {
                Ok(table) => {
                    println!("{table}");
                    Check { name, ok: true, figure: "the table above".into() }
                }
                Err(e) => Check { name, ok: false, figure: e.to_string() },
            });
            // The classifier's GEMMs at the vocabulary's width and padded to a multiple of 64:
            // what an unaligned row of logits costs them (informational; decides the padding).
            let (n, c, v) = (case.batch * case.seq, case.cfg.n_embd, case.cfg.vocab);
            let name = format!("classifier GEMMs bf16 ({n}, {c}) · ({v}, {c})ᵀ: row width {v} vs padded");
            let timed = open(None).and_then(|be| Ok(bench::classifier_widths::<half::bf16, _>(&be, n, c, v, 5)?));
            checks.push(match timed {
                Ok(t) => {
                    let figure = bench::classifier_widths_line(n, c, &t);
                    Check { name, ok: true, figure }
                }
                Err(e) => Check { name, ok: false, figure: e.to_string() },
            });
        }
    }

    // 7. The seed's headline case with its optimizer on the host: the GPT-2 XL shape (1.478B,
    // bytes vocab, T 1024, global batch 8) on 16 GiB, bf16 + full checkpointing + optimizer
    // offload, at micro-batch 8 and 1, and at 8 with the delayed update. Target (micro-batch 8):
    // ≥ 8.5k tokens/s with the step waiting on copies and the host update ≤ 30% of its time.
    if args.xl_offload_steps > 0 {
        use crate::engine::check::bench::{self, BenchCase, Techniques};
        let xl = BenchCase {
            label: "XL offload".into(),
            cfg: crate::engine::model::GptConfig {
                n_layer: 48,
                n_head: 25,
                n_embd: 1600,
                block_size: 1024,
                vocab: 256,
                tp: crate::engine::model::TpShard::NONE,
                pp: crate::engine::model::PpStage::NONE,
            },
            batch: 8,
            seq: 1024,
        };
        let techniques = Techniques {
            checkpointing: crate::config::Checkpointing::Full,
            offload_optimizer: true,
            ..Techniques::default()
        };
        // The third row: micro-batch 8 with the delayed update (the host update of step n
        // beside step n+1's compute), which leaves only the upload on the step's path.
        for (micro, delayed_update) in [(8, false), (1, false), (8, true)] {
            let techniques = Techniques { delayed_update, ..techniques };
            let name = format!(
                "XL offload (1.478B on 16 GiB, bf16 + full ckpt + optimizer offload{}) micro-batch {micro}",
                if delayed_update { ", delayed update" } else { "" }
            );
            let result = open(Some(16 << 30)).and_then(|device| {
                bench::run_on::<half::bf16, _>(device, &xl, micro, techniques, 1, args.xl_offload_steps)
                    .map_err(|e| anyhow::anyhow!("{e}"))
            });
            checks.push(match result {
                Ok((r, stats)) => {
                    let met = r.tokens_per_s >= 8500.0 && r.swap_fraction <= 0.3;
                    Check {
                        name,
                        ok: micro != 8 || delayed_update || met,
                        figure: format!(
                            "{:.0} tokens/s, {:.0} ms/step, swap fraction {:.2} (hidden {:.0} ms/step), peak allocated {}{}",
                            r.tokens_per_s,
                            r.ms_per_step,
                            r.swap_fraction,
                            r.hidden_ms,
                            format_bytes(stats.peak_allocated),
                            if micro == 8 && !delayed_update {
                                format!("; target ≥ 8500 tokens/s, swap ≤ 0.30: {}", if met { "met" } else { "not met" })
                            } else {
                                String::new()
                            }
                        ),
                    }
                }
                Err(e) => Check { name, ok: false, figure: e.to_string() },
            });
        }
    }

    Ok(checks)
}

/// Fragmentation: the smallest device_memory a job pattern with multi-MiB blocks trains two
/// steps in, with fixed segments and with expandable ones. It passes when the pool really is
/// expandable, fits no later than with fixed segments, and within two pages of the allocated peak.
#[cfg(any(feature = "cuda", test))]
fn fragmentation_check<B: crate::engine::backend::Backend>(
    open_with: &dyn Fn(Option<usize>, bool) -> anyhow::Result<B>,
    model: crate::engine::backend::workspace::WorkspaceModel,
    tokens: &[u32],
) -> Check {
    use crate::config::Knobs;
    use crate::engine::check::estimate_check::{min_capacity, EstimateCase};
    use crate::engine::estimate::estimate_on;
    use crate::engine::model::{GptConfig, PpStage, TpShard};
    use crate::memory::{format_bytes, LARGE_ROUND};

    let name = "expandable segments vs fixed (smallest device_memory that trains)".to_string();
    let cfg = GptConfig {
        n_layer: 2,
        n_head: 4,
        n_embd: 256,
        block_size: 128,
        vocab: 256,
        tp: TpShard::NONE,
        pp: PpStage::NONE,
    };
    let tokens: Vec<u32> = tokens.iter().map(|&t| t % 256).collect();
    let mut smallest = Vec::new();
    for expandable in [false, true] {
        match open_with(Some(64 << 20), expandable) {
            Ok(device) if device.pool().expandable() != expandable => {
                return Check { name, ok: false, figure: "the pool did not take expandable segments".into() }
            }
            Err(e) => return Check { name, ok: false, figure: e.to_string() },
            Ok(_) => {}
        }
        let knobs = Knobs { expandable_segments: expandable, ..Knobs::plain(8, 128, 1) };
        let open = |memory: Option<usize>| open_with(memory, expandable).map_err(|e| e.to_string());
        smallest.push(min_capacity(&open, model, &EstimateCase::new(cfg, knobs, None), &tokens, 512 << 20, 256 << 10));
    }
    let allocated = estimate_on(model, &cfg, &Knobs::plain(8, 128, 1)).peak_allocated;
    match smallest[..] {
        [Some(fixed), Some(expandable)] => Check {
            name,
            ok: expandable <= fixed && expandable <= allocated + 2 * LARGE_ROUND.max(2 << 20),
            figure: format!(
                "fixed {}, expandable {} (allocated peak {})",
                format_bytes(fixed),
                format_bytes(expandable),
                format_bytes(allocated)
            ),
        },
        _ => Check { name, ok: false, figure: format!("did not train within 512 MiB: {smallest:?}") },
    }
}

/// The corpus the training checks read, as bytes.
#[cfg(any(feature = "cuda", test))]
const CORPUS: &str = "data/shakespeare-tiny.txt";

/// The first 256 KiB of the corpus as byte tokens; None when it is not there (not run from
/// the repository root).
#[cfg(any(feature = "cuda", test))]
fn corpus_tokens() -> Option<Vec<u32>> {
    std::fs::read(CORPUS).ok().map(|text| text[..text.len().min(256 << 10)].iter().map(|&b| b as u32).collect())
}

/// One training-parity report as a summary line.
#[cfg(any(feature = "cuda", test))]
fn parity_check(r: &crate::engine::check::train_parity::TrainParityReport) -> Check {
    Check {
        name: format!("training parity {} {} ({} steps)", r.case, r.dtype, r.losses.len()),
        ok: r.passed(),
        figure: match &r.error {
            Some(e) => e.clone(),
            None => format!(
                "loss rel err {:.2e} (bound {:.0e}), weights {:.2e} (bound {:.0e})",
                r.worst_loss_rel_err(),
                r.loss_bound,
                r.weights_rel_err,
                r.weights_bound
            ),
        },
    }
}

/// Two runs of one case on the same backend: bit for bit alike, or the first step that differs.
#[cfg(any(feature = "cuda", test))]
fn determinism_check(r: &crate::engine::check::train_parity::TrainParityReport) -> Check {
    Check {
        name: format!("determinism {} {} (the run twice, {} steps)", r.case, r.dtype, r.losses.len()),
        ok: r.identical(),
        figure: match (&r.error, r.first_difference()) {
            (Some(e), _) => e.clone(),
            (None, Some(step)) => format!(
                "losses differ from step {step} ({} vs {}); weights rel err {:.2e}",
                r.losses[step].0, r.losses[step].1, r.weights_rel_err
            ),
            (None, None) if r.weights_rel_err != 0.0 => {
                format!("losses alike, final weights differ (rel err {:.2e})", r.weights_rel_err)
            }
            (None, None) => "every loss and the final weights bit for bit alike".into(),
        },
    }
}

/// The summary table, last; an error when any check failed.
#[cfg(any(feature = "cuda", test))]
fn summary(checks: &[Check]) -> anyhow::Result<()> {
    let width = checks.iter().map(|c| c.name.len()).max().unwrap_or(0);
    println!("\n{:<width$}  result  figure", "check");
    for c in checks {
        println!("{:<width$}  {:<6}  {}", c.name, if c.ok { "ok" } else { "FAIL" }, c.figure);
    }
    let failed = checks.iter().filter(|c| !c.ok).count();
    if failed > 0 {
        anyhow::bail!("{failed} of {} GPU checks failed", checks.len());
    }
    println!("all {} GPU checks passed", checks.len());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::backend::workspace::WorkspaceModel;
    use crate::engine::check::device_sim::DeviceSim;

    /// The whole harness on the simulated device (a tiny model in place of GPT-2 124M for the
    /// benchmark): every check runs to its verdict and passes, so a GPU session spends its
    /// time on the GPU's answers.
    #[test]
    fn the_harness_runs_every_check_on_a_device_and_passes_a_correct_one() {
        let args = GpuCheckArgs {
            index: 0,
            seed: Some(7),
            shapes: "odd".into(),
            train_steps: 3,
            bench_steps: 1,
            xl_offload_steps: 0,
            libraries: false,
            estimate_grid: false,
            profile: true,
        };
        let open = |memory: Option<usize>, expandable: bool| {
            Ok(DeviceSim::with_segments(memory.unwrap_or(4 << 30), expandable))
        };
        let tiny = crate::engine::check::bench::preset("tiny").expect("the tiny preset").remove(0);
        let checks = checks(&open, WorkspaceModel::Cpu, &args, &[ParityShape::ODD], &tiny, 7, false).unwrap();
        let names: Vec<&str> = checks.iter().map(|c| c.name.as_str()).collect();
        for c in &checks {
            assert!(c.ok, "{}: {}", c.name, c.figure);
        }
        assert!(names[0].starts_with("op parity"), "{names:?}");
        assert!(names.contains(&"pool: device_memory 8 MiB"), "{names:?}");
        assert!(names.iter().any(|n| n.starts_with("profile of the")), "{names:?}");
        let widths = checks.iter().find(|c| c.name.starts_with("classifier GEMMs")).expect("the width row");
        assert!(widths.figure.contains("TFLOP/s"), "{}", widths.figure);
        assert!(names.contains(&"op workspace = cpu declarations"), "{names:?}");
        let trained = names.iter().filter(|n| n.starts_with("training parity")).count();
        assert_eq!(
            trained, 8,
            "plain fp32, bf16 and fp16, offloaded bf16, 2 ranks at ZeRO-1 and ZeRO-3, TP 2, PP 2: {names:?}"
        );
        assert!(names.contains(&"training parity 2 ranks z3 bf16 (3 steps)"), "{names:?}");
        assert!(names.contains(&"training parity TP 2 bf16 (3 steps)"), "{names:?}");
        let again = checks.iter().find(|c| c.name.starts_with("determinism")).expect("the determinism row");
        assert_eq!(again.name, "determinism plain bf16 (the run twice, 3 steps)");
        assert!(again.figure.contains("bit for bit alike"), "{}", again.figure);
        assert!(names.iter().any(|n| n.starts_with("OOM in training")), "{names:?}");
        assert!(names.iter().any(|n| n.starts_with("expandable segments")), "{names:?}");
        let timed: Vec<&Check> = checks.iter().filter(|c| c.name.starts_with(&tiny.label)).collect();
        assert_eq!(timed.len(), 2, "resident and offloaded benchmark rows: {names:?}");
        assert!(timed[1].figure.contains("x the resident step"), "{}", timed[1].figure);
        summary(&checks).unwrap();
    }
}
