//! `headroom train`: runs one job end to end and speaks the trainer protocol
//! (`crate::protocol`, docs/DESIGN.md): JSON lines on stdout, control lines on stdin, exit codes
//! through [`TrainError::exit_code`].

use std::io::{BufRead, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use crate::config::{ConfigError, DeviceKind, JobSpec, Precision};
use crate::memory::{OomError, Pool};
use crate::protocol::{self, Control, Event, ExitCode, Line, MemSnapshot};

use crate::engine::backend::layers::Elem;
use crate::engine::backend::{Backend, BackendError, CpuBackend};
use crate::engine::model::GptConfig;
use crate::engine::parallel::comm::{Abandoned, Comm, Group};
use crate::engine::parallel::tcp::RendezvousError;
use crate::engine::train::checkpoint::{self, CheckpointError};
use crate::engine::train::data::{load_tokens, DataError, Dataset};
use crate::engine::train::run_dir::{RunDir, RunDirError};
use crate::engine::train::trainer::{gpt_config, Hyper, RankGroups, Trainer};

/// Why `headroom train` did not finish, mapped to the protocol's exit codes.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Data(#[from] DataError),
    #[error("device {device} requested but {reason}")]
    DeviceUnavailable { device: String, reason: String },
    #[error(transparent)]
    Oom(#[from] OomError),
    #[error("preempted on request at step {step}; checkpoint {}", path.display())]
    Preempted { step: u64, path: PathBuf },
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error("writing the event stream: {0}")]
    Events(#[from] std::io::Error),
    #[error("rank {rank} failed: {message}")]
    RankFailed { rank: usize, message: String },
    /// An op the backend refused (a configuration it cannot run) or failed on the device.
    #[error(transparent)]
    Backend(BackendError),
    #[error(transparent)]
    RunDir(#[from] RunDirError),
    /// Rank processes that could not be joined (`memory.ranks: processes`).
    #[error(transparent)]
    Rendezvous(#[from] RendezvousError),
}

impl TrainError {
    pub fn exit_code(&self) -> ExitCode {
        match self {
            TrainError::Config(_) | TrainError::Data(_) | TrainError::DeviceUnavailable { .. } => ExitCode::Invalid,
            TrainError::Oom(_) => ExitCode::OutOfMemory,
            TrainError::Preempted { .. } => ExitCode::Preempted,
            TrainError::Checkpoint(CheckpointError::Mismatch { .. }) => ExitCode::Invalid,
            TrainError::Backend(BackendError::Unsupported { .. }) => ExitCode::Invalid,
            TrainError::Checkpoint(_) | TrainError::Events(_) | TrainError::RankFailed { .. } => ExitCode::Internal,
            TrainError::Backend(_) => ExitCode::Internal,
            TrainError::RunDir(RunDirError::Io { .. }) => ExitCode::Internal,
            TrainError::RunDir(_) => ExitCode::Invalid,
            TrainError::Rendezvous(e) => e.exit_code(),
        }
    }
}

/// How to treat checkpoints already in the run directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum ResumeMode {
    /// Resume from the newest valid checkpoint if there is one (the default).
    Auto,
    /// Resume, and fail if there is no checkpoint.
    Require,
    /// Start a new run from step 0: the checkpoints already there are moved aside
    /// (`superseded/`), never resumed nor pruned by the new run.
    Fresh,
}

#[derive(Debug, Clone)]
pub struct TrainOptions {
    pub run_dir: PathBuf,
    /// Who the run directory belongs to (`run.json`'s owner): a directory made by another owner
    /// is refused. The supervisor passes `<database id>/job-<id>`.
    pub owner: Option<String>,
    pub resume: ResumeMode,
    /// Checkpoint and exit 4 once this many steps are done (tests and drills).
    pub stop_after: Option<u64>,
    /// Read control lines from stdin.
    pub listen_stdin: bool,
    /// Ranks as processes (`memory.ranks: processes`): this process's place in the group.
    pub processes: ProcessOptions,
}

/// Where a process of a `memory.ranks: processes` job stands.
#[derive(Debug, Clone)]
pub struct ProcessOptions {
    /// The job file the rank processes started by rank 0 read (`headroom train --config`).
    pub job_file: Option<PathBuf>,
    /// This process is one rank of the group, started by hand or by rank 0 (`--rank`); `None`:
    /// it is the job's own `headroom train`, which is rank 0 and starts the others.
    pub rank: Option<RankOptions>,
    /// How long rank 0 waits for the others to join, and they for rank 0 to answer.
    pub rendezvous_timeout: std::time::Duration,
}

impl Default for ProcessOptions {
    fn default() -> Self {
        ProcessOptions { job_file: None, rank: None, rendezvous_timeout: std::time::Duration::from_secs(300) }
    }
}

/// One rank of a process group (torchrun's RANK, MASTER_ADDR:MASTER_PORT and LOCAL_RANK).
#[derive(Debug, Clone)]
pub struct RankOptions {
    pub rank: usize,
    /// Rank 0: the address it listens on; the others: rank 0's address.
    pub rendezvous: String,
    /// Which device of this machine the rank runs on (`device.index + local_rank`); the rank
    /// when not given (every rank on one machine).
    pub local_rank: Option<usize>,
}

/// The JSON-lines event writer (stdout in production).
pub struct Events {
    out: Box<dyn Write + Send>,
}

impl Events {
    pub fn new(out: Box<dyn Write + Send>) -> Events {
        Events { out }
    }

    pub fn stdout() -> Events {
        Events::new(Box::new(std::io::stdout()))
    }

    /// Write one event, stamped with the current time, as a line.
    pub fn emit(&mut self, event: Event) -> std::io::Result<()> {
        writeln!(self.out, "{}", Line::now(event).to_json())?;
        self.out.flush()
    }
}

/// No control line received (the flag's value between requests).
const CONTROL_NONE: u8 = 0;

/// Read control lines from stdin on a background thread into a flag ([`Control::code`]).
pub(super) fn spawn_control_reader() -> Arc<AtomicU8> {
    let flag = Arc::new(AtomicU8::new(CONTROL_NONE));
    let f = flag.clone();
    std::thread::Builder::new()
        .name("control".into())
        .spawn(move || {
            for line in std::io::stdin().lock().lines() {
                let Ok(line) = line else { break };
                match Control::parse(&line) {
                    Some(cmd) => f.store(cmd.code(), Ordering::SeqCst),
                    None => tracing::warn!(line = line.trim(), "ignoring unknown control line"),
                }
            }
        })
        .expect("spawn control thread");
    flag
}

/// Run a validated job in this process, its ranks (if several) as threads. On OOM the `oom`
/// event has been written before the error returns.
pub(super) fn train_in_process(spec: &JobSpec, opts: &TrainOptions, events: &mut Events) -> Result<(), TrainError> {
    if opts.processes.rank.is_some() {
        return Err(TrainError::Config(ConfigError::new(
            "--rank",
            "applies to a job whose ranks are processes (memory.ranks: processes, memory.world_size > 1)",
        )));
    }
    // Open the device first: a machine without it fails fast, before the data is tokenised.
    check_device_built(spec)?;
    #[cfg(feature = "cuda")]
    let cuda = match spec.device.kind {
        DeviceKind::Cuda => Some(open_cuda_ranks(spec)?),
        DeviceKind::Cpu => None,
    };
    let cfg = gpt_config(spec);
    let hyper = Hyper::from_spec(spec);
    // Held until the job ends: no other trainer uses this directory meanwhile.
    let run_dir = RunDir::open(&opts.run_dir, opts.owner.as_deref(), cfg.dims(), opts.resume == ResumeMode::Fresh)?;

    let data = DataLoad::start(spec, &run_dir.path, hyper.knobs.seq_len, hyper.seed);

    let control = if opts.listen_stdin { Some(spawn_control_reader()) } else { None };
    let run = Run { spec, opts, run_dir: &run_dir, data: &data, control, cfg, hyper, comm: None };
    #[cfg(feature = "cuda")]
    if let Some(backends) = cuda {
        return run.in_precision(backends, events);
    }
    let backends = (0..spec.memory.world_size as usize).map(|rank| cpu_backend(spec, rank)).collect();
    run.in_precision(backends, events)
}

/// Rank `rank`'s backend on the `cpu` device: a host pool of the job's capacity.
pub(super) fn cpu_backend(spec: &JobSpec, rank: usize) -> CpuBackend {
    let capacity = spec.device_capacity().unwrap_or(0);
    CpuBackend::new(Pool::host(&format!("cpu:{rank}"), capacity, spec.device.expandable_segments()))
}

/// A cuda job on a build without the `cuda` feature is refused before anything else.
pub(super) fn check_device_built(spec: &JobSpec) -> Result<(), TrainError> {
    if cfg!(not(feature = "cuda")) && spec.device.kind == DeviceKind::Cuda {
        return Err(TrainError::DeviceUnavailable {
            device: format!("cuda:{}", spec.device.index),
            reason: "this build was not compiled with the `cuda` feature".into(),
        });
    }
    Ok(())
}

/// The job's precision on cuda, refused (exit 2, the field named) while the kernels lack it.
#[cfg(feature = "cuda")]
pub(super) fn check_cuda_precision(spec: &JobSpec) -> Result<(), TrainError> {
    use crate::engine::backend::cuda::CudaBackend;
    let precision = match spec.memory.precision {
        Precision::Fp32 => <f32 as Elem>::NAME,
        Precision::Bf16 => <half::bf16 as Elem>::NAME,
        Precision::Fp16 => <half::f16 as Elem>::NAME,
    };
    if !CudaBackend::supports(precision) {
        return Err(TrainError::Config(ConfigError::new(
            "memory.precision",
            format!(
                "{precision} is not available on cuda devices (the kernels are built for {}): use bf16",
                CudaBackend::dtypes().join(" and ")
            ),
        )));
    }
    Ok(())
}

/// `HEADROOM_NCCL=0`: the ranks' collectives are staged through host memory even where
/// libnccl loads.
pub(super) fn nccl_switched_off() -> bool {
    std::env::var("HEADROOM_NCCL").is_ok_and(|v| v == "0")
}

/// Rank `rank`'s GPU `cuda:{index}`, its pool of `capacity` (the GPU's free memory when
/// `None`); a failure is the device's, naming the rank when the job has several.
#[cfg(feature = "cuda")]
pub(super) fn open_cuda(
    spec: &JobSpec,
    rank: usize,
    index: u32,
    capacity: Option<usize>,
) -> Result<crate::engine::backend::cuda::CudaBackend, TrainError> {
    use crate::engine::backend::cuda::{CudaBackend, CudaError};
    let world = spec.memory.world_size;
    CudaBackend::new(index, capacity, spec.device.expandable_segments()).map_err(|e| TrainError::DeviceUnavailable {
        device: format!("cuda:{index}"),
        reason: match e {
            CudaError::NoDriver { .. } => "no CUDA driver found".to_string(),
            e if world > 1 => format!("rank {rank} of memory.world_size {world} (cuda:{index}): {e}"),
            e => e.to_string(),
        },
    })
}

/// `device.expandable_segments` asked for on a GPU (or driver) that cannot map them: said once.
#[cfg(feature = "cuda")]
pub(super) fn warn_if_not_expandable(spec: &JobSpec, backends: &[crate::engine::backend::cuda::CudaBackend]) {
    if spec.device.expandable_segments() && backends.iter().any(|b| !b.pool().expandable()) {
        tracing::warn!(
            "device.expandable_segments: this GPU or driver has no virtual memory management; \
             the pool uses fixed segments (free memory can be stranded between them)"
        );
    }
}

/// The CUDA devices of the job's ranks (rank r on `cuda:{index + r}`), with what they cannot
/// run yet refused up front (exit 2, the field named) rather than at the first op.
#[cfg(feature = "cuda")]
fn open_cuda_ranks(spec: &JobSpec) -> Result<Vec<crate::engine::backend::cuda::CudaBackend>, TrainError> {
    check_cuda_precision(spec)?;
    // Validated: 1..=64.
    let world = spec.memory.world_size as u32;
    let open = |rank: u32, capacity| open_cuda(spec, rank as usize, spec.device.index + rank, capacity);
    let mut backends = (0..world).map(|rank| open(rank, spec.device_capacity())).collect::<Result<Vec<_>, _>>()?;
    // Without a `device_memory` each pool is its GPU's free memory, which other processes can
    // make unequal. Ranks make identical allocations, so give every rank the smallest: an OOM
    // then hits all ranks at the same allocation, never one rank while the others wait for it
    // in a collective.
    let smallest = backends.iter().map(|b| b.pool().stats().capacity).min().unwrap_or(0);
    for (rank, backend) in backends.iter_mut().enumerate() {
        if backend.pool().stats().capacity != smallest {
            drop(std::mem::replace(backend, open(rank as u32, Some(smallest))?));
        }
    }
    warn_if_not_expandable(spec, &backends);
    // The ranks' collectives: NCCL on the GPUs when it loads (HEADROOM_NCCL=0: never), else
    // staged through host memory (same results, PCIe traffic in each step's `swap`).
    if world > 1 {
        if nccl_switched_off() {
            tracing::info!("HEADROOM_NCCL=0: the ranks' collectives are staged through host memory");
        } else {
            match crate::engine::backend::cuda::nccl::attach(&mut backends) {
                Ok(version) => tracing::info!("the ranks' collectives run on the GPUs ({version})"),
                Err(e) => tracing::warn!("{e}; the ranks' collectives are staged through host memory"),
            }
        }
    }
    Ok(backends)
}

/// The job's data, tokenised on a thread of its own while the ranks reserve and initialise
/// their state (so an OOM does not wait for it); each rank takes it once its trainer is built.
pub(super) struct DataLoad {
    pending: Mutex<Option<std::thread::JoinHandle<Result<Dataset, TrainError>>>>,
    ready: OnceLock<Result<Dataset, String>>,
    /// The loading error, handed to the first rank that asks (the others get its message).
    error: Mutex<Option<TrainError>>,
}

impl DataLoad {
    pub(super) fn start(spec: &JobSpec, run_dir: &Path, seq_len: usize, seed: u64) -> DataLoad {
        let (path, vocab, val_fraction) = (spec.data.path.clone(), spec.model.vocab, spec.data.val_fraction);
        let cache = run_dir.join("tokens");
        let handle = std::thread::Builder::new()
            .name("data".into())
            .spawn(move || {
                let tokens = load_tokens(&path, vocab, &cache)?;
                Dataset::new(tokens, val_fraction, seq_len, seed)
                    .map_err(|message| TrainError::Config(ConfigError::new("data.path", message)))
            })
            .expect("spawn data thread");
        DataLoad { pending: Mutex::new(Some(handle)), ready: OnceLock::new(), error: Mutex::new(None) }
    }

    /// The data, waiting for the loader if it is still at work.
    fn get(&self) -> Result<&Dataset, TrainError> {
        let ready = self.ready.get_or_init(|| {
            let handle = self.pending.lock().expect("data lock").take().expect("joined once");
            match handle.join().expect("data thread") {
                Ok(data) => Ok(data),
                Err(e) => {
                    let message = e.to_string();
                    *self.error.lock().expect("data lock") = Some(e);
                    Err(message)
                }
            }
        });
        match ready {
            Ok(data) => Ok(data),
            Err(message) => Err(self
                .error
                .lock()
                .expect("data lock")
                .take()
                .unwrap_or_else(|| TrainError::Config(ConfigError::new("data.path", message.clone())))),
        }
    }
}

/// Everything a run needs once the job is validated.
pub(super) struct Run<'a> {
    pub(super) spec: &'a JobSpec,
    pub(super) opts: &'a TrainOptions,
    pub(super) run_dir: &'a RunDir,
    pub(super) data: &'a DataLoad,
    pub(super) control: Option<Arc<AtomicU8>>,
    pub(super) cfg: GptConfig,
    pub(super) hyper: Hyper,
    /// This process's rank of a process group (its one backend); `None`: the ranks are this
    /// process's threads, one per backend.
    pub(super) comm: Option<Group>,
}

impl Run<'_> {
    /// Run the ranks in the job's compute precision.
    pub(super) fn in_precision<B: Backend>(self, backends: Vec<B>, events: &mut Events) -> Result<(), TrainError> {
        match self.spec.memory.precision {
            Precision::Fp32 => self.ranks::<f32, _>(backends, events),
            Precision::Bf16 => self.ranks::<half::bf16, _>(backends, events),
            // Refused on cuda by check_cuda_precision while the kernels lack it.
            Precision::Fp16 => self.ranks::<half::f16, _>(backends, events),
        }
    }

    /// Run every data-parallel rank, rank r on `backends[r]` (each with its own device pool):
    /// rank 0 here (it speaks the protocol), the others on threads of their own
    /// ([`thread_ranks`]).
    fn ranks<E: Elem, B: Backend>(self, backends: Vec<B>, events: &mut Events) -> Result<(), TrainError> {
        let world = backends.len();
        if world == 1 {
            return self.go::<E, _>(backends.into_iter().next().expect("world_size >= 1"), events);
        }
        let native = backends.iter().any(|b| b.collectives().is_some());
        let ranks = Group::threads(world)
            .into_iter()
            .zip(backends)
            .map(|(comm, be)| {
                let control = if comm.rank() == 0 { self.control.clone() } else { None };
                (comm.clone(), (Run { control, comm: Some(comm), hyper: self.hyper.clone(), ..self }, be))
            })
            .collect();
        thread_ranks(ranks, events, native, |(run, be), events| run.go::<E, _>(be, events))
    }

    /// The training loop of one rank in compute precision `E` on `backend`.
    fn go<E: Elem, B: Backend>(self, backend: B, events: &mut Events) -> Result<(), TrainError> {
        let Run { spec, opts, run_dir, data, control, cfg, hyper, comm } = self;
        let rank = comm.as_ref().map_or(0, |c| c.rank());
        let pool = backend.pool().clone();
        let device = backend.device();
        // On a GPU, NVML's view of the device joins each step's telemetry: the driver's count,
        // which includes what the pool does not see (context, cuBLAS workspace, other processes).
        let nvml = gpu_readings(spec, &pool);
        // `device.reserve`: the pool's share taken up front, one segment the state and the
        // steps' large blocks are carved from.
        let reserved =
            spec.device.reserve.map_or(Ok(()), |fraction| pool.prereserve(fraction).map_err(BackendError::from));
        let tp = spec.memory.tensor_parallel as usize;
        let pp = spec.memory.pipeline_parallel as usize;
        let groups = RankGroups::split(&backend, comm.as_ref(), tp, pp, opts.processes.rendezvous_timeout)?;
        let trainer = reserved.and_then(|()| Trainer::<E, B>::on_ranks(cfg, hyper.clone(), backend, groups));
        let all_ok = comm.as_ref().map_or(trainer.is_ok(), |c| c.agree(trainer.is_ok()));
        let mut trainer = match (trainer, all_ok) {
            (Ok(t), true) => t,
            (Err(err), _) => return Err(report_failure(events, err, 0)),
            (Ok(_), false) => {
                return Err(TrainError::RankFailed {
                    rank,
                    message: "another rank could not allocate its state".into(),
                })
            }
        };

        let data = data.get()?;
        let resumed = match opts.resume {
            ResumeMode::Fresh => None,
            mode => match checkpoint::load_latest(&run_dir.path, Some(run_dir.lineage()), |e| {
                tracing::warn!("skipping checkpoint: {e}")
            }) {
                Some((path, ckpt)) => {
                    trainer.restore(&path, ckpt)?;
                    tracing::info!(step = trainer.step, path = %path.display(), "resumed");
                    Some(trainer.step)
                }
                None if mode == ResumeMode::Require => {
                    return Err(TrainError::Config(ConfigError::new(
                        "--resume",
                        format!("no valid checkpoint in {}", opts.run_dir.display()),
                    )))
                }
                None => None,
            },
        };
        if let Some(comm) = comm.as_ref().filter(|c| c.world() > 1) {
            // Every rank reads the checkpoint itself: ranks that see different run directories
            // (other machines, no shared filesystem) would otherwise train from different states.
            let at = resumed.map_or(0, |s| s + 1);
            let (lowest, highest) = (comm.min_u64(at), u64::MAX - comm.min_u64(u64::MAX - at));
            if lowest != highest {
                let from = |at: u64| at.checked_sub(1).map_or("a fresh start".to_string(), |s| format!("step {s}"));
                return Err(TrainError::RankFailed {
                    rank,
                    message: format!(
                        "the ranks start from different states ({} and {}): every rank must read the run \
                         directory rank 0 writes (this rank's is {}; on several machines, a shared filesystem)",
                        from(lowest),
                        from(highest),
                        run_dir.path.display()
                    ),
                });
            }
        }

        let stats = pool.stats();
        tracing::info!(
            params = cfg.num_params(),
            grad_accum = hyper.knobs.grad_accum,
            "model allocated:\n{}",
            pool.memory_summary()
        );
        events.emit(Event::Started(protocol::Started {
            config: serde_json::to_value(spec).expect("job spec serialises"),
            world_size: spec.memory.world_size,
            device,
            capacity: stats.capacity,
            resumed_from_step: resumed,
            num_params: cfg.num_params(),
            grad_accum: hyper.knobs.grad_accum,
            unigram_entropy: data.unigram_entropy(),
        }))?;

        let progress = progress_bar(hyper.steps, trainer.step);
        let eval_count = spec.train.eval_batches as usize * hyper.global_batch;
        let (eval_every, ckpt_every) = (spec.train.eval_every as u64, spec.train.checkpoint_every as u64);
        let mut last_loss = f32::NAN;
        let (mut tokens_done, mut secs_done) = (0f64, 0f64);
        while trainer.step < hyper.steps {
            // Rank 0 reads the control line; every rank acts on its decision together.
            let local = control.as_ref().map_or(CONTROL_NONE, |f| f.load(Ordering::SeqCst));
            let cmd = comm.as_ref().map_or(local as u64, |c| c.broadcast(local as u64)) as u8;
            if Control::from_code(cmd) == Some(Control::ReleaseCache) {
                // Handled once: rank 0 clears the flag (unless a later line replaced it).
                if let Some(flag) = &control {
                    let _ = flag.compare_exchange(cmd, CONTROL_NONE, Ordering::SeqCst, Ordering::SeqCst);
                }
                let before = pool.stats().reserved;
                pool.empty_cache();
                tracing::info!(
                    step = trainer.step,
                    "released the cache on request: reserved {} -> {}",
                    crate::memory::format_bytes(before),
                    crate::memory::format_bytes(pool.stats().reserved)
                );
            } else if Control::from_code(cmd) == Some(Control::Defragment) {
                if let Some(flag) = &control {
                    let _ = flag.compare_exchange(cmd, CONTROL_NONE, Ordering::SeqCst, Ordering::SeqCst);
                }
                defragment(&mut trainer, "requested", events)?;
            } else if let Some(cmd) = Control::from_code(cmd) {
                let path = save(&mut trainer, run_dir, events)?;
                tracing::info!(step = trainer.step, ?cmd, "exiting on request");
                return Err(TrainError::Preempted { step: trainer.step, path });
            }
            pool.reset_window_peaks();
            let step = match trainer.train_step(&mut |s, i, inp, tgt| data.train_sequence(s, i, inp, tgt)) {
                Ok(s) => s,
                Err(err) => return Err(report_failure(events, err, trainer.step)),
            };
            last_loss = step.loss;
            tokens_done += step.tokens_per_s * step.step_ms / 1e3;
            secs_done += step.step_ms / 1e3;
            let (mem, mem_rank) = fullest_rank(comm.as_ref(), MemSnapshot::window(&pool.stats()));
            events.emit(Event::Step(protocol::Step {
                step: step.step,
                loss: step.loss,
                lr: step.lr,
                grad_norm: step.grad_norm,
                tokens_per_s: step.tokens_per_s,
                step_ms: step.step_ms,
                mem,
                mem_rank,
                precision: E::NAME.into(),
                loss_scale: (trainer.skipped_steps > 0 || E::NAME == "fp16").then_some(step.loss_scale),
                skipped: step.skipped,
                skipped_steps: trainer.skipped_steps,
                // The GPU's view is this process's first device's: it goes with rank 0's memory.
                nvml: nvml
                    .as_ref()
                    .filter(|_| mem_rank.unwrap_or(0) == 0)
                    .and_then(|m| m.reading(spec.device.index))
                    .map(|r| protocol::NvmlReading {
                        used_bytes: r.used_bytes,
                        total_bytes: r.total_bytes,
                        process_bytes: r.processes.iter().find(|p| p.0 == std::process::id()).map(|p| p.1),
                    }),
                swap: step.swap.map(|w| protocol::Swap {
                    bytes_to_host: w.bytes_to_host,
                    bytes_to_device: w.bytes_to_device,
                    transfer_ms: w.transfer_ms,
                    hidden_ms: w.hidden_ms,
                    host_ms: w.host_ms,
                    fraction: w.transfer_ms / step.step_ms.max(1e-9),
                }),
                pipeline: step.bubble.map(|bubble_fraction| protocol::PipelineStep {
                    stages: spec.memory.pipeline_parallel as usize,
                    micro_batches: hyper.knobs.grad_accum,
                    bubble_fraction,
                }),
            }))?;
            progress.set_position(step.step);
            progress.set_message(format!("loss {:.4}", step.loss));

            let last = trainer.step == hyper.steps;
            // Rank 0 reports; its tensor-parallel group evaluates with it, and under ZeRO-3
            // (evaluation gathers weights) every rank does.
            if eval_every > 0 && (trainer.step % eval_every == 0 || last) && trainer.evaluates() {
                let val =
                    match trainer.evaluate(eval_count, &mut |i, inp, tgt| data.val_sequence(i, eval_count, inp, tgt)) {
                        Ok(v) => v,
                        Err(err) => return Err(report_failure(events, err, trainer.step)),
                    };
                tracing::info!(step = trainer.step, val_loss = val, "eval");
                events.emit(Event::Eval(protocol::Eval { step: trainer.step, val_loss: val }))?;
            }
            if ckpt_every > 0 && trainer.step % ckpt_every == 0 && !last {
                save(&mut trainer, run_dir, events)?;
                if spec.device.defragment_above.is_some_and(|above| pool.shape().stranded_share() > above) {
                    defragment(&mut trainer, "checkpoint", events)?;
                }
            }
            if opts.stop_after == Some(trainer.step) && !last {
                let path = save(&mut trainer, run_dir, events)?;
                return Err(TrainError::Preempted { step: trainer.step, path });
            }
        }
        progress.finish_and_clear();
        save(&mut trainer, run_dir, events)?;
        let stats = pool.stats();
        tracing::info!("finished:\n{}", pool.memory_summary());
        events.emit(Event::Finished(protocol::Finished {
            step: trainer.step,
            final_loss: (!last_loss.is_nan()).then_some(last_loss),
            peak_allocated: stats.peak_allocated,
            peak_reserved: stats.peak_reserved,
            mean_tokens_per_s: (secs_done > 0.0).then(|| tokens_done / secs_done),
            mem: MemSnapshot::lifetime(&stats),
        }))?;
        Ok(())
    }
}

fn save<E: Elem, B: Backend>(
    trainer: &mut Trainer<E, B>,
    run_dir: &RunDir,
    events: &mut Events,
) -> Result<PathBuf, TrainError> {
    let path = trainer.save_checkpoint(&run_dir.path, Some(run_dir.lineage()))?;
    events.emit(Event::Checkpoint(protocol::CheckpointWritten { step: trainer.step, path: path.clone() }))?;
    Ok(path)
}

/// Defragment the pool and report it (`reason`: what asked for it).
fn defragment<E: Elem, B: Backend>(
    trainer: &mut Trainer<E, B>,
    reason: &str,
    events: &mut Events,
) -> Result<(), TrainError> {
    let d = trainer.defragment().map_err(|err| report_failure(events, err, trainer.step))?;
    tracing::info!(
        step = trainer.step,
        "defragmented ({reason}): moved {} buffers, reserved {} -> {}",
        d.moved_buffers,
        crate::memory::format_bytes(d.before.reserved),
        crate::memory::format_bytes(d.after.reserved)
    );
    events.emit(Event::Defragmented(protocol::Defragmented {
        step: trainer.step,
        reason: reason.into(),
        moved_buffers: d.moved_buffers,
        moved_bytes: d.moved_bytes,
        before: d.before,
        after: d.after,
    }))?;
    Ok(())
}

/// A step's memory as its event reports it: with several ranks, the fullest rank's (the
/// highest `allocated / capacity`; the lowest rank among equals) and which rank that is — a
/// collective of the group, every rank gets the same — so the supervisor's thresholds watch
/// the rank nearest its OOM (a pipeline's last stage, say), not rank 0's.
fn fullest_rank(comm: Option<&Group>, mine: MemSnapshot) -> (MemSnapshot, Option<usize>) {
    let Some(group) = comm.filter(|g| g.world() > 1) else { return (mine, None) };
    let all: Vec<MemSnapshot> =
        group.gather_words(&mine.to_words()).iter().map(|w| MemSnapshot::from_words(w)).collect();
    let fill = |m: &MemSnapshot| m.allocated as f64 / m.capacity.max(1) as f64;
    let mut fullest = 0;
    for (rank, m) in all.iter().enumerate() {
        if fill(m) > fill(&all[fullest]) {
            fullest = rank;
        }
    }
    (all[fullest], Some(fullest))
}

/// How a rank thread other than rank 0 ended.
enum FollowerEnd {
    /// Its run returned, with its last `oom` event if it wrote one.
    Ran(Box<(Result<(), TrainError>, Option<Event>)>),
    /// It left a collective because another rank abandoned the group.
    Abandoned,
}

/// A run's end that leaves the other ranks without this one: an error other than a
/// preemption (which every rank reaches together, rank 0 having broadcast it).
fn leaves_the_group(result: &Result<(), TrainError>) -> bool {
    matches!(result, Err(e) if !matches!(e, TrainError::Preempted { .. }))
}

/// How long a failed rank waits for rank 0 to leave its collectives before it ends the
/// process itself (native collectives: rank 0 may be held in a device collective that no
/// abandonment reaches).
const NATIVE_ABANDON_GRACE: std::time::Duration = std::time::Duration::from_secs(10);

/// Run a job's ranks as threads of this process: `ranks[0]` here with `events` (it speaks the
/// protocol), the others on threads of their own whose events are dropped but for their last
/// `oom`. Each entry is a rank's group handle and what `go` runs it with. A rank that fails
/// (or panics) abandons the group, so the others leave the collective they wait in
/// ([`Abandoned`]) instead of waiting forever for it; the job's error is then rank 0's own,
/// else the failed rank's — an OOM with its `oom` event written here (exit 3, so the
/// supervisor steps down as for rank 0's), anything else as `RankFailed` (exit 1). With
/// `native` collectives, a failed rank that rank 0 does not answer within
/// [`NATIVE_ABANDON_GRACE`] writes its `oom` event and ends the process with its exit code.
fn thread_ranks<T: Send>(
    ranks: Vec<(Group, T)>,
    events: &mut Events,
    native: bool,
    go: impl Fn(T, &mut Events) -> Result<(), TrainError> + Sync,
) -> Result<(), TrainError> {
    let mut ranks = ranks.into_iter();
    let (leader_group, leader) = ranks.next().expect("at least one rank");
    let leader_back = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|scope| {
        let (go, leader_back) = (&go, &leader_back);
        let followers: Vec<_> = ranks
            .map(|(group, work)| {
                scope.spawn(move || {
                    let oom = LastOom::default();
                    let mut own = Events::new(Box::new(oom.clone()));
                    let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| go(work, &mut own)));
                    match ran {
                        Ok(result) => {
                            let oom = oom.take();
                            if leaves_the_group(&result) {
                                group.abandon();
                                if native {
                                    wait_for_rank_0_or_exit(group.rank(), &result, &oom, leader_back);
                                }
                            }
                            FollowerEnd::Ran(Box::new((result, oom)))
                        }
                        Err(payload) if payload.is::<Abandoned>() => FollowerEnd::Abandoned,
                        Err(payload) => {
                            group.abandon();
                            std::panic::resume_unwind(payload)
                        }
                    }
                })
            })
            .collect();
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| go(leader, events)));
        leader_back.store(true, Ordering::SeqCst);
        let mut result = match ran {
            Ok(result) => {
                if leaves_the_group(&result) {
                    leader_group.abandon();
                }
                Some(result)
            }
            // Another rank failed: its error, found below, is the job's.
            Err(payload) if payload.is::<Abandoned>() => None,
            Err(payload) => {
                leader_group.abandon();
                std::panic::resume_unwind(payload)
            }
        };
        if let (true, Some(Err(e))) = (native, &result) {
            wait_for_ranks_or_exit(&followers, e);
        }
        for (i, follower) in followers.into_iter().enumerate() {
            let rank = i + 1;
            let failed = match follower.join() {
                Ok(FollowerEnd::Abandoned) => continue,
                Ok(FollowerEnd::Ran(ran)) => match *ran {
                    (Ok(()) | Err(TrainError::Preempted { .. }), _) => continue,
                    (Err(e), oom) => (e, oom),
                },
                Err(_) => (TrainError::RankFailed { rank, message: "panicked".into() }, None),
            };
            result = match (result, failed) {
                // Rank 0 left its collectives for this rank's failure, or failed only because
                // another rank did (its state did not fit there): this rank's OOM is the job's.
                (None | Some(Err(TrainError::RankFailed { .. })), (TrainError::Oom(oom), event)) => {
                    tracing::error!("rank {rank}: {oom}");
                    if let Some(event) = event {
                        let _ = events.emit(event);
                    }
                    Some(Err(TrainError::Oom(oom)))
                }
                (None | Some(Ok(())), (e @ TrainError::RankFailed { .. }, _)) => Some(Err(e)),
                (None | Some(Ok(())), (e, _)) => Some(Err(TrainError::RankFailed { rank, message: e.to_string() })),
                (failed_first, _) => failed_first,
            };
        }
        result.unwrap_or_else(|| {
            Err(TrainError::RankFailed {
                rank: 0,
                message: "left its collectives, but no rank reported a failure".into(),
            })
        })
    })
}

/// A failed rank of a group with native collectives: rank 0 may be held in a device collective
/// that abandonment cannot reach. Unless it comes back within [`NATIVE_ABANDON_GRACE`], this
/// rank speaks for the job — its `oom` event on stdout, its error on stderr — and ends the
/// process with its exit code.
fn wait_for_rank_0_or_exit(
    rank: usize,
    result: &Result<(), TrainError>,
    oom: &Option<Event>,
    leader_back: &std::sync::atomic::AtomicBool,
) {
    if followed_within_grace(|| leader_back.load(Ordering::SeqCst)) {
        return;
    }
    let Err(e) = result else { return };
    if let Some(event) = oom.clone() {
        let _ = Events::stdout().emit(event);
    }
    eprintln!("rank {rank}: {e}; rank 0 did not leave its device collective within {NATIVE_ABANDON_GRACE:?}: ending the process");
    let code = match e {
        TrainError::Oom(_) => ExitCode::OutOfMemory,
        _ => ExitCode::Internal,
    };
    std::process::exit(code.code());
}

/// Whether `followed` holds within [`NATIVE_ABANDON_GRACE`] (looked at every 20 ms).
fn followed_within_grace(followed: impl Fn() -> bool) -> bool {
    let deadline = std::time::Instant::now() + NATIVE_ABANDON_GRACE;
    while std::time::Instant::now() < deadline {
        if followed() {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    followed()
}

/// Rank 0 failed in a group with native collectives: the other ranks may be held in a device
/// collective that abandonment cannot reach. Unless they all end within
/// [`NATIVE_ABANDON_GRACE`], rank 0 ends the process with its error (its `oom` event is
/// already written).
fn wait_for_ranks_or_exit<T>(followers: &[std::thread::ScopedJoinHandle<'_, T>], e: &TrainError) {
    if matches!(e, TrainError::Preempted { .. }) {
        return;
    }
    if followed_within_grace(|| followers.iter().all(|f| f.is_finished())) {
        return;
    }
    eprintln!("error: {e}");
    eprintln!("rank 0 failed and the other ranks did not leave their device collectives within {NATIVE_ABANDON_GRACE:?}: ending the process");
    std::process::exit(e.exit_code().code());
}

/// An events writer that keeps only the last `oom` event written to it (a rank's other than
/// rank 0: rank 0 writes it for the job when that rank's failure ends it).
#[derive(Clone, Default)]
pub(super) struct LastOom(Arc<Mutex<(Vec<u8>, Option<Event>)>>);

impl LastOom {
    pub(super) fn take(&self) -> Option<Event> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).1.take()
    }
}

impl Write for LastOom {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let mut kept = self.0.lock().unwrap_or_else(|e| e.into_inner());
        kept.0.extend_from_slice(buf);
        while let Some(end) = kept.0.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = kept.0.drain(..=end).collect();
            if let Some(Line { event: event @ Event::Oom(_), .. }) = Line::parse(&String::from_utf8_lossy(&line)) {
                kept.1 = Some(event);
            }
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// An OOM is reported as the `oom` event; any other backend failure is returned as it is.
fn report_failure(events: &mut Events, err: BackendError, step: u64) -> TrainError {
    match err {
        BackendError::Oom(oom) => report_oom(events, oom, step),
        other => TrainError::Backend(other),
    }
}

/// Write the `oom` event (requested bytes, category, memory snapshot) and turn it into the error.
fn report_oom(events: &mut Events, oom: OomError, step: u64) -> TrainError {
    tracing::error!("{oom}");
    let _ = events.emit(Event::Oom(protocol::Oom {
        step,
        requested_bytes: oom.requested_bytes,
        category: oom.category.name().into(),
        mem: MemSnapshot {
            at_peak: Some(protocol::Composition::current(&oom.stats)),
            ..MemSnapshot::lifetime(&oom.stats)
        },
        message: oom.to_string(),
    }));
    TrainError::Oom(oom)
}

fn progress_bar(total: u64, at: u64) -> indicatif::ProgressBar {
    if !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(total);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} steps  {msg}  [{elapsed_precise} < {eta}]")
            .expect("template"),
    );
    bar.set_position(at);
    bar
}

/// The run directory used when none is given: `runs/<job name>`.
pub fn default_run_dir(spec: &JobSpec) -> PathBuf {
    Path::new("runs").join(&spec.name)
}

/// The device-wide memory view of each step event: NVML on cuda; the simulated GPU of
/// [`crate::gpu::SIMULATED_GPU_ENV`] when a test sets it (on any device: the pool's capacity
/// is the GPU's total and its reserved bytes this process's share); none otherwise.
fn gpu_readings(spec: &JobSpec, pool: &Pool) -> Option<Box<dyn crate::gpu::GpuReadings>> {
    if let Some(path) = std::env::var_os(crate::gpu::SIMULATED_GPU_ENV) {
        let own = pool.clone();
        return Some(Box::new(crate::gpu::SimulatedGpu {
            path: path.into(),
            total_bytes: pool.stats().capacity as u64,
            own: Box::new(move || own.stats().reserved as u64),
        }));
    }
    (spec.device.kind == DeviceKind::Cuda).then(|| Box::new(crate::gpu::GpuMonitor::init()) as Box<_>)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::parallel::comm::Comm;
    use crate::memory::Category;

    /// An events writer whose lines the test reads back.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// What a rank does in a case: take part in collectives, or fail before them.
    #[derive(Clone, Copy, Debug)]
    enum Part {
        /// Sum over the world, then over its half (a sub-group split by rank parity).
        Collectives,
        /// Run out of memory (its `oom` event written), then leave.
        Oom,
        /// Fail with another error.
        Fail,
        Panic,
        /// Fail because another rank did (as a rank whose peer could not allocate its state).
        Follow,
    }

    /// `parts[r]` for rank r as threads through `thread_ranks`, on a watchdog thread (a hang
    /// fails the case instead of the suite): the result and rank 0's protocol lines.
    fn run(parts: &[Part]) -> (Result<(), TrainError>, Vec<Line>) {
        let parts = parts.to_vec();
        let (tx, rx) = std::sync::mpsc::channel();
        let out = Captured::default();
        let lines = out.clone();
        std::thread::spawn(move || {
            let ranks = Group::threads(parts.len()).into_iter().map(|g| (g.clone(), g)).collect();
            let mut events = Events::new(Box::new(out));
            let result = thread_ranks(ranks, &mut events, false, |group: Group, events: &mut Events| {
                match parts[group.rank()] {
                    Part::Collectives => {
                        let half = group.split(group.rank() as u64 % 2, std::time::Duration::from_secs(5)).unwrap();
                        for _ in 0..3 {
                            group.all_reduce_f64(1.0);
                            half.all_reduce_f64(1.0);
                        }
                        Ok(())
                    }
                    Part::Oom => {
                        let pool = Pool::new("cpu", 1 << 20);
                        let oom = pool.alloc(8 << 20, Category::Activations).unwrap_err();
                        Err(report_oom(events, oom, 7))
                    }
                    Part::Fail => Err(TrainError::Events(std::io::Error::other("a failure outside the collectives"))),
                    Part::Panic => panic!("a bug on rank {}", group.rank()),
                    Part::Follow => Err(TrainError::RankFailed {
                        rank: group.rank(),
                        message: "another rank could not allocate its state".into(),
                    }),
                }
            });
            let _ = tx.send(result);
        });
        let result = rx.recv_timeout(std::time::Duration::from_secs(60)).expect("the ranks ended (no hang)");
        let text = String::from_utf8(lines.0.lock().unwrap().clone()).unwrap();
        (result, text.lines().filter_map(Line::parse).collect())
    }

    /// A rank that fails outside the collectives releases the others from the collective they
    /// wait in (in the world group or a sub-group split from it); the job's error is rank 0's
    /// own, else the failed rank's: an OOM keeps exit 3 and its `oom` event reaches rank 0's
    /// protocol lines, anything else is `rank R failed` (exit 1).
    #[test]
    fn a_rank_that_fails_outside_the_collectives_ends_every_rank_with_its_error() {
        use Part::*;
        // (parts, exit code, oom events on rank 0's stdout, message contains)
        let cases: &[(&[Part], Option<ExitCode>, usize, &str)] = &[
            (&[Collectives, Collectives, Collectives], None, 0, ""),
            (&[Collectives, Oom, Collectives], Some(ExitCode::OutOfMemory), 1, "out of"),
            (&[Collectives, Collectives, Collectives, Oom], Some(ExitCode::OutOfMemory), 1, "out of"),
            (&[Oom, Collectives, Collectives], Some(ExitCode::OutOfMemory), 1, "out of"),
            (&[Collectives, Fail, Collectives], Some(ExitCode::Internal), 0, "rank 1 failed: "),
            (&[Fail, Collectives, Collectives, Collectives], Some(ExitCode::Internal), 0, "a failure outside"),
            (&[Collectives, Collectives, Panic], Some(ExitCode::Internal), 0, "rank 2 failed: panicked"),
            (&[Follow, Oom], Some(ExitCode::OutOfMemory), 1, "out of"),
            (&[Oom, Follow], Some(ExitCode::OutOfMemory), 1, "out of"),
        ];
        for &(parts, code, ooms, message) in cases {
            let (result, lines) = run(parts);
            assert_eq!(result.as_ref().err().map(TrainError::exit_code), code, "{parts:?}: {result:?}");
            let oom_lines = lines.iter().filter(|l| matches!(l.event, Event::Oom(_))).count();
            assert_eq!(oom_lines, ooms, "{parts:?}: {lines:?}");
            if let Err(e) = result {
                assert!(e.to_string().contains(message), "{parts:?}: {e}");
            }
        }
    }

    /// Two data-parallel ranks where only rank 1's pool is too small for the step (another
    /// process took memory on its GPU, say): rank 1 runs out of memory in its forward pass
    /// while rank 0 goes on to the gradient all-reduce. Rank 0 leaves it, and the job ends
    /// with rank 1's OOM (exit 3, its `oom` event on rank 0's stdout) instead of hanging.
    #[test]
    fn one_data_parallel_rank_out_of_memory_ends_the_job_with_its_oom() {
        use crate::engine::estimate::estimate_step;
        use crate::engine::model::{PpStage, TpShard};
        use crate::engine::train::trainer::StepStats;
        let cfg = GptConfig {
            n_layer: 8,
            n_head: 4,
            n_embd: 192,
            block_size: 32,
            vocab: 512,
            tp: TpShard::NONE,
            pp: PpStage::NONE,
        };
        let knobs = crate::config::Knobs { world_size: 2, ..crate::config::Knobs::plain(2, 32, 2) };
        let hyper = Hyper {
            knobs,
            steps: 3,
            global_batch: 8,
            lr: 1e-3,
            warmup_steps: 1,
            weight_decay: 0.1,
            grad_clip: 1.0,
            seed: 5,
        };
        let need = estimate_step(&cfg, &knobs);
        // The smallest pool (MiB steps) that holds the model's state: too small for its step.
        let state = need.params + need.grads + need.optimizer;
        let tight = (state..need.peak_allocated)
            .step_by(1 << 20)
            .find(|&c| {
                Trainer::<f32>::on_backend(cfg, hyper.clone(), CpuBackend::new(Pool::new("cpu", c)), None).is_ok()
            })
            .expect("a pool between the state and the step's peak");
        let (tx, rx) = std::sync::mpsc::channel();
        let out = Captured::default();
        let lines = out.clone();
        std::thread::spawn(move || {
            let ranks = Group::threads(2).into_iter().map(|g| (g.clone(), g)).collect();
            let mut events = Events::new(Box::new(out));
            let steps = Mutex::new(Vec::new());
            let result = thread_ranks(ranks, &mut events, false, |group: Group, events: &mut Events| {
                let rank = group.rank();
                let capacity = if rank == 1 { tight } else { 1 << 30 };
                let backend = CpuBackend::new(Pool::new(&format!("cpu:{rank}"), capacity));
                let mut trainer = Trainer::<f32>::on_backend(cfg, hyper.clone(), backend, Some(group))
                    .map_err(|e| report_failure(events, e, 0))?;
                for step in 0..3 {
                    let mut batch = |_: u64, i: u64, inp: &mut Vec<u32>, tgt: &mut Vec<u32>| {
                        inp.extend((0..32).map(|p| ((i + p) % 512) as u32));
                        tgt.extend((0..32).map(|p| ((i + p + 1) % 512) as u32));
                    };
                    let done: StepStats =
                        trainer.train_step(&mut batch).map_err(|e| report_failure(events, e, step))?;
                    steps.lock().unwrap().push((rank, done.loss));
                }
                Ok(())
            });
            let _ = tx.send((result, steps.into_inner().unwrap()));
        });
        let (result, steps) = rx.recv_timeout(std::time::Duration::from_secs(120)).expect("the ranks ended (no hang)");
        assert!(matches!(&result, Err(TrainError::Oom(_))), "{result:?}");
        assert_eq!(result.unwrap_err().exit_code(), ExitCode::OutOfMemory);
        assert!(steps.is_empty(), "no step completed: {steps:?}");
        let text = String::from_utf8(lines.0.lock().unwrap().clone()).unwrap();
        let ooms: Vec<_> = text.lines().filter_map(Line::parse).filter(|l| matches!(l.event, Event::Oom(_))).collect();
        assert_eq!(ooms.len(), 1, "{text}");
        let Event::Oom(oom) = &ooms[0].event else { unreachable!() };
        assert_eq!(oom.mem.capacity, tight, "rank 1's pool: {oom:?}");
    }

    /// With several ranks a step reports the fullest rank's memory (highest allocated /
    /// capacity, the lowest rank among equals), the same snapshot on every rank, exactly as
    /// that rank took it.
    #[test]
    fn a_step_reports_the_fullest_rank_s_memory() {
        let snapshot = |allocated: usize, capacity: usize| MemSnapshot {
            allocated,
            capacity,
            reserved: allocated + 3,
            activations: allocated / 2,
            at_peak: Some(protocol::Composition { params: 1, activations: allocated - 1, ..Default::default() }),
            ..Default::default()
        };
        for (mine, want) in [
            (vec![(10, 100), (50, 100), (50, 200)], 1),
            (vec![(10, 100), (20, 200), (5, 10)], 2),
            (vec![(30, 100), (30, 100)], 0),
        ] {
            let got: Vec<_> = std::thread::scope(|scope| {
                let joins: Vec<_> = Group::threads(mine.len())
                    .into_iter()
                    .map(|g| {
                        let (a, c) = mine[g.rank()];
                        scope.spawn(move || fullest_rank(Some(&g), snapshot(a, c)))
                    })
                    .collect();
                joins.into_iter().map(|j| j.join().unwrap()).collect()
            });
            let (a, c) = mine[want];
            for (rank, (mem, mem_rank)) in got.into_iter().enumerate() {
                assert_eq!(mem_rank, Some(want), "{mine:?} rank {rank}");
                assert_eq!(mem, snapshot(a, c), "{mine:?} rank {rank}");
            }
        }
        assert_eq!(fullest_rank(None, snapshot(1, 2)), (snapshot(1, 2), None), "one rank: its own, unnamed");
    }
}
