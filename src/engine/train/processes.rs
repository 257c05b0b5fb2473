//! Ranks as processes (`memory.ranks: processes`): the job's own `headroom train` is rank 0 —
//! it holds the run directory, speaks the protocol, listens for the others and, unless it was
//! itself started as one rank of a hand-made group (`--rank 0`), starts ranks 1.. as child
//! processes of this binary (`headroom train --rank r --rendezvous <rank 0>`), which join it
//! over TCP (`parallel::tcp`) and then train exactly as thread ranks do.
//!
//! The attempt is one unit: rank 0 ends every rank it started however it ends itself (the
//! children die with it by `PR_SET_PDEATHSIG`; a collective whose peer is gone ends its
//! process), so the supervisor, which sees only rank 0, stops, OOMs and resumes all of them
//! together. A rank that fails on its own reports its failure to rank 0 before it ends
//! (`TcpLink::report_failure`): rank 0 ends with that rank's exit code and `oom` event.

use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::config::{ConfigError, DeviceKind, JobSpec};
use crate::protocol::{ExitCode, Line, RunIdentity, LAUNCHER_VARIABLES};

use crate::engine::parallel::comm::{Comm, Group};
use crate::engine::parallel::tcp::{RankFailure, RendezvousError, TcpLink};
use crate::engine::train::job::{self, DataLoad, Events, LastOom, ResumeMode, Run, TrainError, TrainOptions};
use crate::engine::train::run_dir::RunDir;
use crate::engine::train::trainer::{gpt_config, Hyper};

/// What rank 0 tells every rank that joins: the run it belongs to and how it starts.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Session {
    identity: RunIdentity,
    resume: ResumeMode,
    stop_after: Option<u64>,
    /// The NCCL unique id of the group's communicator (cuda, when rank 0 loaded libnccl).
    nccl_id: Option<Vec<u8>>,
}

/// Run this process's rank of a process-rank job.
pub(super) fn train(spec: &JobSpec, opts: &TrainOptions, events: &mut Events) -> Result<(), TrainError> {
    job::check_device_built(spec)?;
    let world = spec.memory.world_size as usize;
    let job_text = serde_json::to_string(spec).expect("the job spec serialises");
    let timeout = opts.processes.rendezvous_timeout;
    let rank = opts.processes.rank.as_ref().map_or(0, |r| r.rank);
    if rank >= world {
        return Err(TrainError::Config(ConfigError::new(
            "--rank",
            format!("{rank} is not a rank of memory.world_size {world} (0..{world})"),
        )));
    }
    if rank > 0 {
        let at = &opts.processes.rank.as_ref().expect("rank > 0 was given").rendezvous;
        let (link, session): (TcpLink, Session) = TcpLink::join(at, rank, world, &job_text, timeout)?;
        let run_dir = RunDir::follow(&opts.run_dir, session.identity.clone());
        // A rank starts as rank 0 does (fresh or resumed, stopping where it stops); it reads
        // no control lines (rank 0 broadcasts its decisions) and writes no events.
        let opts = TrainOptions {
            resume: session.resume,
            stop_after: session.stop_after,
            listen_stdin: false,
            ..opts.clone()
        };
        // Its events are dropped but for its last `oom`, which rank 0 writes if it fails.
        let oom = LastOom::default();
        let mut silent = Events::new(Box::new(oom.clone()));
        let group = Group::tcp(link);
        let result = run_rank(spec, &opts, &run_dir, group.clone(), &session, &mut silent);
        if let Err(e) = &result {
            if !matches!(e, TrainError::Preempted { .. }) {
                let line = oom.take().map(|event| Line::now(event).to_json());
                let message = format!("rank {rank} failed: {e}");
                group.report_failure(&RankFailure { rank, code: e.exit_code().code(), message, line });
            }
        }
        return result;
    }

    let cfg = gpt_config(spec);
    // Held until the job ends: no other trainer uses this directory meanwhile.
    let run_dir = RunDir::open(&opts.run_dir, opts.owner.as_deref(), cfg.dims(), opts.resume == ResumeMode::Fresh)?;
    let listen = opts.processes.rank.as_ref().map_or("127.0.0.1:0", |r| r.rendezvous.as_str());
    let listener = TcpListener::bind(listen)
        .map_err(|e| RendezvousError::Io { addr: listen.into(), message: format!("cannot listen: {e}") })?;
    let addr =
        listener.local_addr().map_err(|e| RendezvousError::Io { addr: listen.into(), message: e.to_string() })?;
    let mut children = match &opts.processes.rank {
        Some(_) => Children::default(),
        None => Children::spawn(opts, world, &addr.to_string())?,
    };
    let session = Session {
        identity: run_dir.identity.clone(),
        resume: opts.resume,
        stop_after: opts.stop_after,
        nccl_id: nccl_unique_id(spec),
    };
    tracing::info!("rank 0 of {world} rank processes: waiting for the others at {addr}");
    let link = TcpLink::host(listener, world, &job_text, &session, timeout, &mut || children.check());
    let result = link
        .map_err(TrainError::from)
        .and_then(|link| run_rank(spec, opts, &run_dir, Group::tcp(link), &session, events));
    children.finish(result)
}

/// One rank's run on its own device, once the group is joined.
fn run_rank(
    spec: &JobSpec,
    opts: &TrainOptions,
    run_dir: &RunDir,
    comm: Group,
    session: &Session,
    events: &mut Events,
) -> Result<(), TrainError> {
    let rank = comm.rank();
    let hyper = Hyper::from_spec(spec);
    let data = DataLoad::start(spec, &run_dir.path, hyper.knobs.seq_len, hyper.seed);
    let control = opts.listen_stdin.then(job::spawn_control_reader);
    let run = Run { spec, opts, run_dir, data: &data, control, cfg: gpt_config(spec), hyper, comm: Some(comm) };
    match spec.device.kind {
        DeviceKind::Cpu => run.in_precision(vec![job::cpu_backend(spec, rank)], events),
        #[cfg(feature = "cuda")]
        DeviceKind::Cuda => {
            let backend = open_cuda_rank(spec, opts, run.comm.as_ref().expect("a group"), session)?;
            run.in_precision(vec![backend], events)
        }
        #[cfg(not(feature = "cuda"))]
        DeviceKind::Cuda => {
            let _ = session;
            unreachable!("refused by check_device_built")
        }
    }
}

/// Rank 0's NCCL unique id for a cuda group (`None`: cpu, or libnccl does not load here; the
/// collectives are then staged through host memory).
fn nccl_unique_id(spec: &JobSpec) -> Option<Vec<u8>> {
    if spec.device.kind != DeviceKind::Cuda || job::nccl_switched_off() {
        return None;
    }
    #[cfg(feature = "cuda")]
    match crate::engine::backend::cuda::nccl::unique_id() {
        Ok(id) => return Some(id),
        Err(e) => tracing::warn!("{e}; the ranks' collectives are staged through host memory"),
    }
    None
}

/// This rank's GPU (`device.index + local_rank`), its pool the smallest of the group's when
/// no `device_memory` is set (an OOM then hits every rank at the same allocation), and its
/// NCCL communicator when every rank has libnccl.
#[cfg(feature = "cuda")]
fn open_cuda_rank(
    spec: &JobSpec,
    opts: &TrainOptions,
    comm: &Group,
    session: &Session,
) -> Result<crate::engine::backend::cuda::CudaBackend, TrainError> {
    use crate::engine::backend::cuda::nccl;
    use crate::engine::backend::Backend;
    job::check_cuda_precision(spec)?;
    let (rank, world) = (comm.rank(), comm.world());
    let local = opts.processes.rank.as_ref().and_then(|r| r.local_rank).unwrap_or(rank);
    let index = spec.device.index + local as u32;
    let open = |capacity| job::open_cuda(spec, rank, index, capacity);
    let opened = open(spec.device_capacity());
    // Every rank learns whether every rank has its device before any waits on another.
    if !comm.agree(opened.is_ok()) {
        return Err(opened.err().unwrap_or_else(|| TrainError::RankFailed {
            rank,
            message: "another rank could not open its GPU".into(),
        }));
    }
    let mut backend = opened?;
    let smallest = comm.min_u64(backend.pool().stats().capacity as u64) as usize;
    if backend.pool().stats().capacity != smallest {
        drop(backend);
        backend = open(Some(smallest))?;
    }
    job::warn_if_not_expandable(spec, std::slice::from_ref(&backend));
    if let Some(id) = &session.nccl_id {
        let loads = nccl::version().is_ok();
        if comm.agree(loads) {
            match nccl::attach_rank(&mut backend, id, rank, world) {
                Ok(version) => tracing::info!("rank {rank}: the collectives run on the GPUs ({version})"),
                Err(e) => return Err(TrainError::RankFailed { rank, message: e.to_string() }),
            }
        } else {
            tracing::warn!("a rank has no libnccl; the ranks' collectives are staged through host memory");
        }
    }
    Ok(backend)
}

/// The rank processes rank 0 started (none when it was itself started as a rank).
#[derive(Default)]
struct Children {
    procs: Vec<(usize, Child)>,
}

impl Children {
    /// Start ranks 1..world as `headroom train` processes of this binary, reading the same
    /// job file, joining rank 0 at `rendezvous`.
    fn spawn(opts: &TrainOptions, world: usize, rendezvous: &str) -> Result<Children, TrainError> {
        let job_file = opts.processes.job_file.as_deref().ok_or_else(|| {
            TrainError::Config(ConfigError::new(
                "memory.ranks",
                "processes: the rank processes read the job from a file (headroom train --config)",
            ))
        })?;
        let exe = std::env::current_exe()
            .map_err(|e| TrainError::RankFailed { rank: 1, message: format!("cannot find this program: {e}") })?;
        let mut children = Children::default();
        for rank in 1..world {
            let mut cmd = rank_command(&exe, job_file, opts, rank, rendezvous);
            let child =
                cmd.spawn().map_err(|e| TrainError::RankFailed { rank, message: format!("could not start: {e}") })?;
            children.procs.push((rank, child));
        }
        Ok(children)
    }

    /// Fails when a rank has exited (while the group is still forming).
    fn check(&mut self) -> Result<(), String> {
        for (rank, child) in &mut self.procs {
            if let Ok(Some(status)) = child.try_wait() {
                return Err(format!("rank {rank} exited ({}) before joining", describe(status)));
            }
        }
        Ok(())
    }

    /// Settle the children once rank 0's run has ended with `result`: after a normal end
    /// (finished, or stopped after a checkpoint) each is given time to end the same way and a
    /// rank that failed is reported; after a failure they are ended at once.
    fn finish(mut self, result: Result<(), TrainError>) -> Result<(), TrainError> {
        let ended_well = matches!(result, Ok(()) | Err(TrainError::Preempted { .. }));
        if !ended_well {
            return result; // Drop ends them.
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut failed = None;
        for (rank, child) in &mut self.procs {
            let status = loop {
                match child.try_wait() {
                    Ok(Some(status)) => break Some(status),
                    Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
                    _ => break None,
                }
            };
            let fine = status.is_some_and(|s| {
                [ExitCode::Finished, ExitCode::Preempted].into_iter().any(|c| s.code() == Some(c.code()))
            });
            if !fine && failed.is_none() {
                let message = status.map_or("did not end within 60 s of rank 0".into(), describe);
                failed = Some(TrainError::RankFailed { rank: *rank, message });
            }
        }
        match (result, failed) {
            (Ok(()), Some(e)) => Err(e),
            (result, _) => result,
        }
    }
}

impl Drop for Children {
    /// No rank outlives the attempt: what is still running is killed and reaped.
    fn drop(&mut self) {
        for (_, child) in &mut self.procs {
            if let Ok(None) = child.try_wait() {
                let _ = child.kill();
            }
            let _ = child.wait();
        }
    }
}

fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit code {code}"),
        (None, Some(signal)) => format!("killed by signal {signal}"),
        _ => status.to_string(),
    }
}

/// `headroom train` for rank `rank`: the same job file and run directory, no events on stdout
/// (rank 0 speaks for the job), logs on the shared stderr; it dies with rank 0.
fn rank_command(exe: &Path, job_file: &Path, opts: &TrainOptions, rank: usize, rendezvous: &str) -> Command {
    let mut cmd = Command::new(exe);
    cmd.arg("train")
        .arg("--config")
        .arg(job_file)
        .arg("--run-dir")
        .arg(&opts.run_dir)
        .arg("--rank")
        .arg(rank.to_string())
        .arg("--rendezvous")
        .arg(rendezvous)
        .arg("--rendezvous-timeout")
        .arg(opts.processes.rendezvous_timeout.as_secs().max(1).to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    // A launcher's variables, inherited from above us, would be read as this rank's.
    for name in LAUNCHER_VARIABLES {
        cmd.env_remove(name);
    }
    // The rank is killed when the thread that started it (rank 0's main thread) ends,
    // however rank 0 ends.
    crate::files::die_with_parent(&mut cmd);
    cmd
}
