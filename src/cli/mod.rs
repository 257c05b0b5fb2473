//! Command-line surface: the clap definitions of every subcommand and their dispatch.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};

use crate::config::{ConfigError, JobSpec, Precision};
use crate::engine::check::bench;
use crate::engine::{self, ProcessOptions, RankOptions, ResumeMode, TrainError, TrainOptions};
use crate::protocol::ExitCode;

mod client;
mod gpu_check;
mod plan_bench;
mod quantize;
mod serve;

#[derive(Debug, Parser)]
#[command(name = "headroom", version, about = "Adaptive training-job supervisor and GPT training engine")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Train one job, speaking the trainer protocol (JSON lines on stdout).
    Train(TrainArgs),
    /// Time training steps on the CPU device (fp32 unless --precision says otherwise) and print a table.
    Bench(BenchArgs),
    /// Predict peak device memory per category for a job (and each rung of a policy).
    Estimate(EstimateArgs),
    /// Quantize a run's newest checkpoint (INT8 per output channel, INT4 group-wise) into a file.
    Quantize(quantize::QuantizeArgs),
    /// Validation loss and perplexity of a run's newest checkpoint under each storage scheme
    /// (fp32, int8, int4 by group size), or of a quantized file, with the weight bytes it took.
    Eval(quantize::EvalArgs),
    /// Continue a prompt with a run's model (its newest checkpoint, or a quantized file).
    Generate(quantize::GenerateArgs),
    /// Run the supervisor daemon: HTTP API, job runner, experiment database, web page.
    Serve(serve::ServeArgs),
    /// Submit a job file to a running daemon.
    Submit(client::SubmitArgs),
    /// List jobs of a running daemon.
    Jobs(client::JobsArgs),
    /// Show one job: its attempts and events.
    Show(client::ShowArgs),
    /// On a machine with a GPU: every backend op against the CPU reference, and the device
    /// pool's OOM paths; prints a table, exits 1 if any check fails.
    GpuCheck(GpuCheckArgs),
}

impl Command {
    /// Commands that only print for a reader (tables, listings): when the reader goes away
    /// (`| head -1`) they end quietly, as a Unix filter does, instead of panicking on the
    /// failed write. Not `serve` or `train`, whose pipes lead to other programs and whose write
    /// errors are handled.
    pub fn is_filter(&self) -> bool {
        matches!(
            self,
            Command::Bench(_)
                | Command::Estimate(_)
                | Command::Eval(_)
                | Command::Generate(_)
                | Command::Quantize(_)
                | Command::Submit(_)
                | Command::Jobs(_)
                | Command::Show(_)
                | Command::GpuCheck(_)
        )
    }
}

/// How a shell runs this binary again: `headroom` when that name on PATH is this very binary,
/// else its full path (a newcomer's `target/release/headroom` is not on PATH).
pub fn self_command() -> String {
    let Ok(exe) = std::env::current_exe().and_then(std::fs::canonicalize) else { return "headroom".into() };
    let on_path = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).map(|d| d.join("headroom")).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .find(|c| c.is_file());
    match on_path.and_then(|c| std::fs::canonicalize(c).ok()) {
        Some(found) if found == exe => "headroom".into(),
        _ => exe.display().to_string(),
    }
}

/// For a filter command: a closed stdout ends the process quietly (SIGPIPE's default action)
/// rather than with Rust's "failed printing to stdout" panic.
pub fn quiet_on_closed_pipe(cli: &Cli) {
    #[cfg(unix)]
    if cli.command.is_filter() {
        // SAFETY: restoring a signal's default disposition at start-up, before any thread.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    #[cfg(not(unix))]
    let _ = cli;
}

#[derive(Debug, clap::Args)]
pub struct GpuCheckArgs {
    /// CUDA device index.
    #[arg(long, default_value_t = 0)]
    pub index: u32,
    /// Seed of the random inputs (default: from the clock, printed).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Shapes to check: odd (small, nothing block-aligned), gpt2 (GPT-2 124M widths, T 256), all.
    #[arg(long, default_value = "all")]
    pub shapes: String,
    /// Optimizer steps of the training parity runs (CUDA vs CPU losses); 0 skips them.
    #[arg(long, default_value_t = 20)]
    pub train_steps: usize,
    /// Timed steps of the GPT-2 124M benchmark (B=16, T=1024, bf16); 0 skips it.
    #[arg(long, default_value_t = 5)]
    pub bench_steps: usize,
    /// Timed steps of the XL offload benchmark (GPT-2 XL shape, 1.478B, on device_memory 16GiB:
    /// bf16 + full checkpointing + optimizer offload at micro-batch 8 and 1; ~21 GB of host
    /// memory); 0 skips it.
    #[arg(long, default_value_t = 2)]
    pub xl_offload_steps: usize,
    /// Also measure the estimator against the device over its grid (12 GPT-2-small-like
    /// configurations, 2 offloaded, 2 at 1.5B parameters on 16 GiB).
    #[arg(long)]
    pub estimate_grid: bool,
    /// After the benchmark, print where its step's time goes: every op timed one at a time
    /// (calls, ms per step, share, achieved TFLOP/s or GB/s), beside the unprofiled step.
    #[arg(long)]
    pub profile: bool,
    /// Only report which CUDA libraries load (driver, NVRTC, cuBLAS, NCCL), their versions and
    /// files; exit 2 if one a cuda device needs is missing.
    #[arg(long)]
    pub libraries: bool,
}

#[derive(Debug, clap::Args)]
pub struct TrainArgs {
    /// Job spec (YAML or JSON).
    #[arg(long)]
    pub config: PathBuf,
    /// Run directory for checkpoints and the token cache (default: runs/<name>).
    #[arg(long)]
    pub run_dir: Option<PathBuf>,
    /// Require resuming from a checkpoint in the run directory (by default resume if one exists).
    #[arg(long, conflicts_with = "fresh")]
    pub resume: bool,
    /// Start a new run from step 0: checkpoints already in the run directory are moved to
    /// its superseded/ folder (never resumed, never deleted).
    #[arg(long)]
    pub fresh: bool,
    /// Who the run directory belongs to (recorded in its run.json on first use; a directory
    /// recorded for another owner is refused). The supervisor passes <database id>/job-<id>.
    #[arg(long)]
    pub run_owner: Option<String>,
    /// Checkpoint and exit with code 4 after this many optimizer steps.
    #[arg(long)]
    pub stop_after: Option<u64>,
    /// Run as this rank of a job whose ranks are processes (memory.ranks: processes). Not
    /// needed on one machine: the job's own `headroom train` is rank 0 and starts the others.
    /// For ranks on several machines, start rank 0 and each other rank by hand (for such a
    /// job, torchrun's RANK is read when the flag is absent).
    #[arg(long)]
    pub rank: Option<usize>,
    /// With --rank: host:port where rank 0 listens (on rank 0, the address it binds). Default
    /// from torchrun's MASTER_ADDR and MASTER_PORT.
    #[arg(long)]
    pub rendezvous: Option<String>,
    /// With --rank: which GPU of this machine the rank uses (device.index + local rank; default
    /// the rank; for such a job, torchrun's LOCAL_RANK is read when the flag is absent).
    #[arg(long, requires = "rank")]
    pub local_rank: Option<usize>,
    /// Seconds rank 0 waits for every rank to join (and a rank for rank 0 to answer).
    #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u64).range(1..))]
    pub rendezvous_timeout: u64,
}

#[derive(Debug, clap::Args)]
pub struct EstimateArgs {
    /// Job spec (YAML or JSON).
    #[arg(long)]
    pub config: PathBuf,
    /// Also estimate every rung of this policy, in ladder order.
    #[arg(long)]
    pub policy: Option<String>,
    /// Directory of policy files.
    #[arg(long, default_value = "policies")]
    pub policies: PathBuf,
    /// Print the plan instead: every configuration the policy allows (its rungs applied in
    /// order, the micro-batch free), predicted peak and tokens/s, and the one the policy's
    /// strategy runs first (needs --policy; uncalibrated: the daemon calibrates from its DB).
    #[arg(long, requires = "policy")]
    pub plan: bool,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// Preset shapes: tiny, small (d4-256, GPT-2 vocab), gpt2 (124M), d4-128 (bytes, T 256), all.
    #[arg(long, default_value = "small")]
    pub preset: String,
    /// Timed steps per case.
    #[arg(long, default_value_t = 5)]
    pub steps: usize,
    /// Untimed warm-up steps per case.
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// Override the batch size of the preset.
    #[arg(long)]
    pub batch: Option<usize>,
    /// Override the sequence length of the preset.
    #[arg(long)]
    pub seq: Option<usize>,
    /// Storage type of the speed table's and the profile's steps: fp32, bf16 or fp16 (fp32
    /// master weights and AdamW either way). The other tables choose their own.
    #[arg(long, default_value = "fp32", value_parser = parse_precision,
          conflicts_with_all = ["techniques", "parallel", "plan", "host_adamw"])]
    pub precision: Precision,
    /// Print the memory-technique table (peak per category for checkpointing and micro-batch
    /// settings at the same global batch) instead of the speed table.
    #[arg(long)]
    pub techniques: bool,
    /// Print where the step's time goes instead: every op timed (calls, ms per step, share,
    /// achieved TFLOP/s or GB/s), beside the unprofiled step.
    #[arg(long)]
    pub profile: bool,
    /// Print the ranks / ZeRO / offload table (trains a d4-128 job on data/shakespeare-tiny.txt).
    #[arg(long)]
    pub parallel: bool,
    /// Check the planner by brute force: train every configuration of this job's plan that is
    /// predicted to fit (--steps each, --rounds times) and compare the fastest-fit choice with
    /// the best measured (exit 1 below 0.9×). Needs --config; --policy picks the ladder.
    #[arg(long, requires = "config")]
    pub plan: bool,
    /// The job of --plan.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// The policy of --plan.
    #[arg(long, default_value = "default")]
    pub policy: String,
    /// Directory of policy files (--plan).
    #[arg(long, default_value = "policies")]
    pub policies: PathBuf,
    /// Print the host AdamW table (optimizer offload's update: scalar loop, today's passes, the
    /// fused SIMD pass, against memory bandwidth) over this many parameters.
    #[arg(long, value_name = "PARAMS", num_args = 0..=1, default_missing_value = "16777216")]
    pub host_adamw: Option<usize>,
    /// Interleaved rounds of --plan (each configuration keeps its best median).
    #[arg(long, default_value_t = 2)]
    pub rounds: usize,
}

pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("HEADROOM_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Train(args) => train(args),
        Command::Bench(args) => run_bench(args),
        Command::Estimate(args) => estimate(args),
        Command::Quantize(args) => quantize::quantize(args),
        Command::Eval(args) => quantize::eval(args),
        Command::Generate(args) => quantize::generate(args),
        Command::Serve(args) => serve::serve(args),
        Command::Submit(args) => client::submit(args),
        Command::Jobs(args) => client::jobs(args),
        Command::Show(args) => client::show(args),
        Command::GpuCheck(args) => gpu_check::run(args),
    }
}

fn train(args: TrainArgs) -> anyhow::Result<()> {
    let spec = JobSpec::load(&args.config)?;
    let rank = rank_options(&args, &spec)?;
    let opts = TrainOptions {
        run_dir: args.run_dir.unwrap_or_else(|| engine::train::job::default_run_dir(&spec)),
        owner: args.run_owner,
        resume: if args.fresh {
            ResumeMode::Fresh
        } else if args.resume {
            ResumeMode::Require
        } else {
            ResumeMode::Auto
        },
        stop_after: args.stop_after,
        listen_stdin: true,
        processes: ProcessOptions {
            job_file: Some(args.config.clone()),
            rank,
            rendezvous_timeout: std::time::Duration::from_secs(args.rendezvous_timeout),
        },
    };
    engine::train(&spec, &opts, &mut engine::Events::stdout())?;
    Ok(())
}

/// `--rank` and where rank 0 is (`--rendezvous`, else torchrun's MASTER_ADDR:MASTER_PORT). A
/// job whose ranks are processes also reads torchrun's RANK and LOCAL_RANK; any other job
/// ignores them (a thread-rank job started under a launcher stays one process).
fn rank_options(args: &TrainArgs, spec: &JobSpec) -> Result<Option<RankOptions>, ConfigError> {
    let from_env = |name: &str| -> Result<Option<usize>, ConfigError> {
        if spec.memory.ranks != crate::config::Ranks::Processes {
            return Ok(None);
        }
        match std::env::var(name) {
            Ok(v) => v
                .trim()
                .parse()
                .map(Some)
                .map_err(|_| ConfigError::new(name, format!("{v:?} is not a rank (a whole number from 0)"))),
            Err(_) => Ok(None),
        }
    };
    let Some(rank) = args.rank.map_or_else(|| from_env("RANK"), |r| Ok(Some(r)))? else { return Ok(None) };
    let local_rank = args.local_rank.map_or_else(|| from_env("LOCAL_RANK"), |r| Ok(Some(r)))?;
    let rendezvous = match &args.rendezvous {
        Some(at) => at.clone(),
        None => match (std::env::var("MASTER_ADDR"), std::env::var("MASTER_PORT")) {
            (Ok(addr), Ok(port)) => format!("{addr}:{port}"),
            _ => {
                return Err(ConfigError::new(
                    "--rendezvous",
                    "a rank needs rank 0's address: --rendezvous host:port (or MASTER_ADDR and MASTER_PORT)",
                ))
            }
        },
    };
    Ok(Some(RankOptions { rank, rendezvous, local_rank }))
}

fn estimate(args: EstimateArgs) -> anyhow::Result<()> {
    use crate::engine::backend::workspace::WorkspaceModel;
    use crate::engine::estimate::{estimate_job, verdict};
    use crate::memory::format_bytes;
    use crate::supervisor::policy::{self, LadderPosition};
    let spec = JobSpec::load(&args.config)?;
    if args.plan {
        return print_plan(&args, &spec);
    }
    let capacity = spec.device_capacity();
    let mut rows = vec![("base".to_string(), spec.clone())];
    if let Some(name) = &args.policy {
        let (pol, _) = policy::load(&args.policies, name).map_err(|e| ConfigError::new("--policy", e.to_string()))?;
        let (mut cur, mut pos) = (spec.clone(), LadderPosition { rung_index: -1 });
        while let Ok(down) = policy::step_down(&pol, &cur, pos) {
            pos = LadderPosition { rung_index: down.rung_index };
            cur = down.spec;
            rows.push((down.rung_name, cur.clone()));
        }
    }
    let estimates: Vec<_> = rows.iter().map(|(rung, s)| (rung, s, estimate_job(s))).collect();
    if args.json {
        let out: Vec<_> = estimates
            .iter()
            .map(|(rung, s, e)| {
                serde_json::json!({
                    "rung": rung, "micro_batch": s.train.micro_batch, "grad_accum": s.grad_accum(),
                    "checkpointing": s.memory.checkpointing, "precision": s.memory.precision,
                    "estimate": e, "capacity": capacity, "fits": capacity.map(|c| verdict(e, c)),
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!(
        "{:<20} {:>5} {:>5} {:<10} {:>11} {:>11} {:>11} {:>12} {:>11} {:>14} {:>12} {:>5}",
        "rung",
        "mb",
        "accum",
        "ckpt",
        "params",
        "grads",
        "optimizer",
        "activations",
        "workspace",
        "peak allocated",
        "reserved≤",
        "fits"
    );
    for (rung, s, e) in &estimates {
        println!(
            "{:<20} {:>5} {:>5} {:<10} {:>11} {:>11} {:>11} {:>12} {:>11} {:>14} {:>12} {:>5}",
            rung,
            s.train.micro_batch,
            s.grad_accum(),
            crate::config::serde_name(&s.memory.checkpointing),
            format_bytes(e.params),
            format_bytes(e.grads),
            format_bytes(e.optimizer),
            format_bytes(e.activations),
            format_bytes(e.workspace),
            format_bytes(e.peak_allocated),
            format_bytes(e.reserved_allowance),
            capacity.map(|c| verdict(e, c)).unwrap_or("?")
        );
    }
    if let Some(c) = capacity {
        println!("capacity: {}", format_bytes(c));
    }
    if spec.memory.world_size > 1 {
        println!(
            "per rank: world_size {} = {} data-parallel × {} pipeline stages × {} tensor-parallel (each rank has its \
             own device pool; with stages, the figures are the highest stage's)",
            spec.memory.world_size,
            spec.data_parallel(),
            spec.memory.pipeline_parallel,
            spec.memory.tensor_parallel
        );
    }
    println!(
        "peak allocated: the most bytes live at one moment; the category columns are what each holds at that \
         moment (they sum to it)"
    );
    println!(
        "workspace model: {} (the op scratch declarations of the job's device kind; libraries' own memory, \
         e.g. cuBLAS's workspace, is outside the pool and not counted)",
        WorkspaceModel::of(spec.device.kind).name()
    );
    Ok(())
}

/// `headroom estimate --plan`: the planner's table for the job's first attempt.
fn print_plan(args: &EstimateArgs, spec: &JobSpec) -> anyhow::Result<()> {
    use crate::supervisor::ladder::{self, LadderState};
    use crate::supervisor::planner::{self, Calibration};
    use crate::supervisor::policy::{self, Strategy};
    let name = args.policy.as_deref().unwrap_or("default");
    let (pol, _) = policy::load(&args.policies, name).map_err(|e| ConfigError::new("--policy", e.to_string()))?;
    let state = LadderState::new(spec.clone(), "base".into(), -1);
    let calibration = Calibration::uncalibrated(&pol, &crate::config::serde_name(&spec.device.kind));
    let Some(mut plan) = planner::plan(&pol, &state, &planner::Excluded::default(), &calibration, None) else {
        return Err(ConfigError::new(
            "device.device_memory",
            "the device's capacity is unknown (cuda without device_memory): nothing to plan against",
        )
        .into());
    };
    match pol.strategy {
        Strategy::FastestFit => {}
        Strategy::FirstFit => plan.mark_chosen(&ladder::first_fit(&pol, &state).0.spec),
        Strategy::Ladder => plan.mark_chosen(spec),
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&plan)?);
        return Ok(());
    }
    print!("{}", plan.table());
    match plan.chosen() {
        Some(c) => println!(
            "{}: rung {}, micro_batch {} × {} accumulation, {}",
            crate::config::serde_name(&pol.strategy),
            c.rung,
            c.micro_batch,
            c.grad_accum,
            c.knobs
        ),
        None => println!("nothing the policy allows is predicted to fit"),
    }
    Ok(())
}

fn run_bench(args: BenchArgs) -> anyhow::Result<()> {
    let mut cases = bench::preset(&args.preset).ok_or_else(|| {
        ConfigError::new("--preset", format!("unknown preset `{}` (tiny, small, gpt2, d4-128, all)", args.preset))
    })?;
    for case in &mut cases {
        if let Some(b) = args.batch {
            case.batch = b;
        }
        if let Some(t) = args.seq {
            case.seq = t;
            case.cfg.block_size = case.cfg.block_size.max(t);
        }
    }
    println!("threads: {}", rayon::current_num_threads());
    if let Some(n) = args.host_adamw {
        print!("{}", bench::host_adamw_table(n, args.steps));
        return Ok(());
    }
    if let (true, Some(config)) = (args.plan, &args.config) {
        let spec = JobSpec::load(config)?;
        let (pol, _) = crate::supervisor::policy::load(&args.policies, &args.policy)
            .map_err(|e| ConfigError::new("--policy", e.to_string()))?;
        let (table, ok) = plan_bench::plan_bench(&spec, &pol, args.steps.max(4) as i64, args.rounds)?;
        print!("{table}");
        anyhow::ensure!(ok, "the planner's choice is below {}× the best measured", plan_bench::TARGET);
        return Ok(());
    }
    if args.parallel {
        print!("{}", bench::parallel_table(std::path::Path::new("data/shakespeare-tiny.txt"), args.steps)?);
        return Ok(());
    }
    if args.techniques {
        for case in &cases {
            print!("{}", bench::techniques_table(case, args.warmup, args.steps)?);
        }
        return Ok(());
    }
    // The speed table and the profile run one storage type (`--precision`); the tables above
    // choose their own.
    println!("storage: {}", crate::config::serde_name(&args.precision));
    if args.profile {
        for case in &cases {
            print!("{}", bench::profile_cpu(case, args.precision, args.warmup, args.steps)?);
        }
        return Ok(());
    }
    let mut results = Vec::new();
    for case in &cases {
        let r = bench::run_case(case, args.precision, args.warmup, args.steps)
            .with_context(|| format!("bench case {}", case.label))?;
        results.push(r);
    }
    print!("{}", bench::print_table(&results));
    Ok(())
}

/// `--precision`'s value, by the job spec's names.
fn parse_precision(text: &str) -> Result<Precision, String> {
    crate::config::from_serde_name(text).ok_or_else(|| format!("`{text}` is not a precision: fp32, bf16 or fp16"))
}

/// The one place a subcommand's error becomes its exit code (`protocol::ExitCode`; a trainer's
/// errors through `TrainError::exit_code`).
pub fn exit_code(err: &anyhow::Error) -> ExitCode {
    if let Some(e) = err.downcast_ref::<TrainError>() {
        return e.exit_code();
    }
    if err.downcast_ref::<ConfigError>().is_some() || err.downcast_ref::<client::UsageError>().is_some() {
        return ExitCode::Invalid;
    }
    if err.chain().any(|e| e.downcast_ref::<crate::memory::OomError>().is_some()) {
        return ExitCode::OutOfMemory;
    }
    ExitCode::Internal
}
