//! The runner: a queue of jobs over device slots; each attempt a `headroom train` child process
//! read through the trainer protocol; the threshold monitor; outcome classification; and the
//! step-down loop that walks a job down its policy ladder until it finishes or runs out of rungs.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::sync::{mpsc, watch, Mutex};

use crate::config::{serde_name, JobSpec};
use crate::memory::format_bytes;

use super::db::{now, AttemptEnd, Db, SampleRow};
use super::policy::{self, LadderPosition, Policy};

#[derive(Debug, Clone)]
pub struct SupervisorConfig {
    pub policies_dir: PathBuf,
    pub runs_dir: PathBuf,
    /// The trainer executable (the current `headroom` binary).
    pub trainer_exe: PathBuf,
    /// Jobs run at once (device slots).
    pub slots: usize,
}

/// A request to a running attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Control {
    Cancel,
    Shutdown,
}

/// The daemon's job runner, shared by the HTTP handlers.
pub struct Supervisor {
    pub db: Db,
    pub cfg: SupervisorConfig,
    queue: mpsc::UnboundedSender<i64>,
    running: Mutex<HashMap<i64, mpsc::UnboundedSender<Control>>>,
    shutdown: watch::Sender<bool>,
    workers: Mutex<Vec<tokio::task::JoinHandle<()>>>,
}

/// How one child process ended.
#[derive(Debug, Clone, PartialEq)]
enum Outcome {
    Finished,
    Oom {
        category: String,
        requested: i64,
    },
    /// Checkpointed and stopped by the monitor above the preempt threshold.
    Preempted {
        reason: String,
    },
    /// Checkpointed and stopped: offload transfers took more than the policy's `swap_bound`.
    SwapBound {
        reason: String,
    },
    /// Checkpointed and stopped because the daemon is shutting down.
    Suspended,
    Cancelled,
    /// Exit 2: the configuration is unusable; retrying cannot help.
    Invalid {
        message: String,
    },
    Crashed {
        message: String,
    },
}

impl Outcome {
    fn db_name(&self) -> &'static str {
        match self {
            Outcome::Finished => "finished",
            Outcome::Oom { .. } => "oom",
            Outcome::Preempted { .. } | Outcome::Suspended => "preempted",
            Outcome::SwapBound { .. } => "swap_bound",
            Outcome::Cancelled => "cancelled",
            Outcome::Invalid { .. } | Outcome::Crashed { .. } => "crashed",
        }
    }
}

impl Supervisor {
    /// Start `cfg.slots` workers and requeue jobs a previous daemon left unfinished.
    pub async fn start(db: Db, cfg: SupervisorConfig) -> anyhow::Result<Arc<Supervisor>> {
        std::fs::create_dir_all(&cfg.runs_dir)?;
        let (tx, rx) = mpsc::unbounded_channel();
        let (shutdown, _) = watch::channel(false);
        let sup = Arc::new(Supervisor {
            db,
            cfg,
            queue: tx,
            running: Mutex::new(HashMap::new()),
            shutdown,
            workers: Mutex::new(Vec::new()),
        });
        let rx = Arc::new(Mutex::new(rx));
        for slot in 0..sup.cfg.slots.max(1) {
            let (sup2, rx) = (sup.clone(), rx.clone());
            let handle = tokio::spawn(async move {
                let mut stop = sup2.shutdown.subscribe();
                loop {
                    let next = tokio::select! {
                        job = async { rx.lock().await.recv().await } => job,
                        _ = stop.wait_for(|s| *s) => None,
                    };
                    let Some(job) = next else { break };
                    tracing::info!(job, slot, "running job");
                    if let Err(e) = sup2.run_job(job).await {
                        tracing::error!(job, "job runner failed: {e:#}");
                        let _ = sup2.db.set_job_status(job, "failed", Some("internal supervisor error")).await;
                        let _ = sup2.db.event(job, None, "failed", "internal supervisor error").await;
                    }
                }
            });
            sup.workers.lock().await.push(handle);
        }
        for job in sup.db.unfinished_jobs().await? {
            sup.db.close_dangling_attempts(job).await?;
            sup.db.set_job_status(job, "queued", None).await?;
            sup.db
                .event(job, None, "resumed", "supervisor started: job requeued, resuming from its newest checkpoint")
                .await?;
            sup.enqueue(job);
        }
        Ok(sup)
    }

    pub fn enqueue(&self, job: i64) {
        let _ = self.queue.send(job);
    }

    pub fn run_dir(&self, job: i64) -> PathBuf {
        self.cfg.runs_dir.join(format!("job-{job}"))
    }

    /// Cancel a job: a queued one is marked at once, a running one is stopped after a checkpoint.
    pub async fn cancel(&self, job: i64) -> anyhow::Result<bool> {
        if let Some(tx) = self.running.lock().await.get(&job) {
            let _ = tx.send(Control::Cancel);
            return Ok(true);
        }
        match self.db.job(job).await?.map(|j| j.core.status) {
            Some(s) if s == "queued" => {
                self.db.set_job_status(job, "cancelled", Some("cancelled before it started")).await?;
                self.db.event(job, None, "cancelled", "cancelled while queued").await?;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// Graceful shutdown: running children checkpoint and stop; their jobs stay queued for the
    /// next start.
    pub async fn shutdown(&self) {
        let _ = self.shutdown.send(true);
        for tx in self.running.lock().await.values() {
            let _ = tx.send(Control::Shutdown);
        }
        let workers: Vec<_> = std::mem::take(&mut *self.workers.lock().await);
        // Running children checkpoint first; give them time, then stop waiting.
        let _ = tokio::time::timeout(Duration::from_secs(120), futures::future::join_all(workers)).await;
    }

    async fn run_job(self: &Arc<Self>, job: i64) -> anyhow::Result<()> {
        let Some(detail) = self.db.job(job).await? else { return Ok(()) };
        if detail.core.status != "queued" {
            return Ok(());
        }
        let (policy, _) = match policy::load(&self.cfg.policies_dir, &detail.core.policy) {
            Ok(p) => p,
            Err(e) => {
                let msg = format!("cannot load policy: {e}");
                self.db.set_job_status(job, "failed", Some(&msg)).await?;
                self.db.event(job, None, "failed", &msg).await?;
                return Ok(());
            }
        };
        let mut spec: JobSpec = serde_json::from_str(&detail.current_spec)?;
        let mut rung_name = detail.core.rung.clone();
        let mut rung_index = detail.core.rung_index;
        let mut crashes = 0u32;
        // The configuration before the current rung was applied (for swap_bound's step back).
        let mut before_rung: Option<JobSpec> = None;
        let (control_tx, mut control_rx) = mpsc::unbounded_channel();
        self.running.lock().await.insert(job, control_tx);
        let result = async {
            loop {
                self.db.set_job_status(job, "running", None).await?;
                let outcome = self.run_attempt(job, &rung_name, &spec, &policy, &mut control_rx).await?;
                match outcome.clone() {
                    Outcome::Finished => {
                        self.db.set_job_status(job, "finished", None).await?;
                        self.db.event(job, None, "finished", &format!("finished on rung {rung_name}")).await?;
                        return Ok(());
                    }
                    Outcome::Suspended => {
                        self.db.set_job_status(job, "queued", None).await?;
                        return Ok(());
                    }
                    Outcome::Cancelled => {
                        self.db.set_job_status(job, "cancelled", Some("cancelled on request")).await?;
                        self.db.event(job, None, "cancelled", "stopped after a checkpoint on request").await?;
                        return Ok(());
                    }
                    Outcome::Invalid { message } => {
                        let msg = format!("trainer rejected the configuration: {message}");
                        self.db.set_job_status(job, "failed", Some(&msg)).await?;
                        self.db.event(job, None, "failed", &msg).await?;
                        return Ok(());
                    }
                    Outcome::Crashed { message } => {
                        crashes += 1;
                        if crashes > policy.retries.crash {
                            let msg = format!("crashed {crashes} times on rung {rung_name}: {message}");
                            self.db.set_job_status(job, "failed", Some(&msg)).await?;
                            self.db.event(job, None, "failed", &msg).await?;
                            return Ok(());
                        }
                        let msg = format!(
                            "crash {crashes}/{} on rung {rung_name} ({message}); retrying from the newest checkpoint",
                            policy.retries.crash
                        );
                        self.db.event(job, None, "retry", &msg).await?;
                    }
                    Outcome::SwapBound { reason } => {
                        let action = policy.swap_bound.as_ref().map(|b| b.action);
                        match (action, before_rung.take()) {
                            (Some(policy::SwapAction::StepBack), Some(prev)) => {
                                let msg = format!(
                                    "rung {rung_name} is swap-bound ({reason}); backing off to the configuration before it \
                                     and trying the rungs after it"
                                );
                                self.db.event(job, None, "swap_bound", &msg).await?;
                                spec = prev;
                            }
                            _ => {
                                let msg = format!("rung {rung_name} is swap-bound ({reason}) and the policy does not step back");
                                self.db.set_job_status(job, "failed", Some(&msg)).await?;
                                self.db.event(job, None, "failed", &msg).await?;
                                return Ok(());
                            }
                        }
                    }
                    Outcome::Oom { .. } | Outcome::Preempted { .. } => {}
                }
                if matches!(outcome, Outcome::Oom { .. } | Outcome::Preempted { .. } | Outcome::SwapBound { .. }) {
                        crashes = 0;
                        match policy::step_down(&policy, &spec, LadderPosition { rung_index }) {
                            Ok(down) => {
                                for (name, why) in &down.skipped {
                                    self.db.event(job, None, "skip", &format!("rung {name} skipped: {why}")).await?;
                                }
                                let msg = format!(
                                    "stepping down to rung {} ({})",
                                    down.rung_name,
                                    describe_change(&spec, &down.spec)
                                );
                                self.db.event(job, None, "step_down", &msg).await?;
                                before_rung = Some(std::mem::replace(&mut spec, down.spec));
                                rung_index = down.rung_index;
                                rung_name = down.rung_name;
                                self.db
                                    .set_job_rung(job, &rung_name, rung_index, &serde_json::to_string(&spec)?)
                                    .await?;
                            }
                            Err(skipped) => {
                                for (name, why) in &skipped {
                                    self.db.event(job, None, "skip", &format!("rung {name} skipped: {why}")).await?;
                                }
                                let msg = format!(
                                    "no rung of policy {} is left to apply (last rung: {rung_name})",
                                    policy.name
                                );
                                self.db.set_job_status(job, "failed", Some(&msg)).await?;
                                self.db.event(job, None, "failed", &msg).await?;
                                return Ok(());
                            }
                        }
                }
                if *self.shutdown.borrow() {
                    self.db.set_job_status(job, "queued", None).await?;
                    return Ok(());
                }
            }
        }
        .await;
        self.running.lock().await.remove(&job);
        result
    }

    async fn run_attempt(
        &self,
        job: i64,
        rung: &str,
        spec: &JobSpec,
        policy: &Policy,
        control: &mut mpsc::UnboundedReceiver<Control>,
    ) -> anyhow::Result<Outcome> {
        let run_dir = self.run_dir(job);
        std::fs::create_dir_all(&run_dir)?;
        let config_json = serde_json::to_string(spec)?;
        let (attempt, number) = self.db.start_attempt(job, rung, &config_json).await?;
        let config_path = run_dir.join(format!("attempt-{number}.yaml"));
        std::fs::write(&config_path, spec.to_yaml())?;
        let stderr_log = std::fs::File::create(run_dir.join(format!("attempt-{number}.log")))?;
        self.db
            .event(
                job,
                Some(attempt),
                "attempt_started",
                &format!(
                    "attempt {number} on rung {rung}: micro_batch {} × {} accumulation, {}, checkpointing {}",
                    spec.train.micro_batch,
                    spec.grad_accum(),
                    serde_name(&spec.memory.precision),
                    serde_name(&spec.memory.checkpointing)
                ),
            )
            .await?;
        let mut child = tokio::process::Command::new(&self.cfg.trainer_exe)
            .arg("train")
            .arg("--config")
            .arg(&config_path)
            .arg("--run-dir")
            .arg(&run_dir)
            .env("HEADROOM_LOG", std::env::var("HEADROOM_TRAINER_LOG").unwrap_or_else(|_| "info".into()))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(stderr_log))
            .kill_on_drop(true)
            .spawn()?;
        self.db.set_attempt_pid(attempt, child.id()).await?;
        let mut stdin = child.stdin.take().expect("piped stdin");
        let mut lines = BufReader::new(child.stdout.take().expect("piped stdout")).lines();
        let mut monitor = Monitor::new(policy, attempt);
        let mut requested: Option<Control> = None;
        let mut last_flush = Instant::now();
        loop {
            tokio::select! {
                line = lines.next_line() => {
                    let Some(line) = line? else { break };
                    let Ok(ev) = serde_json::from_str::<Value>(&line) else {
                        tracing::warn!(job, "trainer wrote a non-JSON line: {line}");
                        continue;
                    };
                    for (kind, message) in monitor.observe(&ev) {
                        self.db.event(job, Some(attempt), kind, &message).await?;
                    }
                    if monitor.wants_preempt() && requested.is_none() {
                        send_control(&mut stdin, "checkpoint_and_exit").await;
                        monitor.preempt_sent = true;
                    }
                    if monitor.samples.len() >= 64 || last_flush.elapsed() > Duration::from_secs(1) {
                        self.flush(job, &mut monitor).await?;
                        last_flush = Instant::now();
                    }
                }
                msg = control.recv(), if requested.is_none() => {
                    if let Some(msg) = msg {
                        requested = Some(msg);
                        send_control(&mut stdin, if msg == Control::Cancel { "stop" } else { "checkpoint_and_exit" }).await;
                    }
                }
            }
        }
        let status = child.wait().await?;
        self.flush(job, &mut monitor).await?;
        let code = status.code();
        let outcome = match (code, requested) {
            (Some(0), _) => Outcome::Finished,
            (Some(3), _) => Outcome::Oom {
                category: monitor.oom_category.clone().unwrap_or_default(),
                requested: monitor.oom_requested.unwrap_or(0),
            },
            (Some(4), Some(Control::Cancel)) => Outcome::Cancelled,
            (Some(4), Some(Control::Shutdown)) => Outcome::Suspended,
            (Some(4), None) if monitor.preempt_sent => match &monitor.swap_reason {
                Some(reason) => Outcome::SwapBound { reason: reason.clone() },
                None => Outcome::Preempted { reason: monitor.preempt_reason.clone().unwrap_or_default() },
            },
            (Some(4), None) => Outcome::Preempted { reason: "trainer stopped itself after a checkpoint".into() },
            (Some(2), _) => Outcome::Invalid { message: last_log_line(&run_dir, number) },
            (Some(c), _) => Outcome::Crashed { message: format!("exit code {c}: {}", last_log_line(&run_dir, number)) },
            (None, _) => Outcome::Crashed { message: format!("killed by a signal ({status})") },
        };
        let end = monitor.end(&outcome, code);
        self.db.finish_attempt(attempt, &end).await?;
        let summary = match &outcome {
            Outcome::Oom { category, requested } => format!(
                "attempt {number} ran out of device memory at step {}: a {} request for {category} did not fit in {}",
                end.last_step.unwrap_or(0),
                format_bytes(*requested as usize),
                format_bytes(end.capacity.unwrap_or(0) as usize)
            ),
            Outcome::Preempted { reason } => format!("attempt {number} preempted: {reason}"),
            Outcome::SwapBound { reason } => format!("attempt {number} swap-bound: {reason}"),
            other => format!("attempt {number} ended: {}", other.db_name()),
        };
        let kind = match outcome {
            Outcome::Oom { .. } => "oom",
            Outcome::Preempted { .. } => "preempt",
            _ => "attempt_ended",
        };
        self.db.event(job, Some(attempt), kind, &summary).await?;
        Ok(outcome)
    }

    async fn flush(&self, job: i64, monitor: &mut Monitor) -> anyhow::Result<()> {
        let batch = std::mem::take(&mut monitor.samples);
        self.db.insert_samples(&batch).await?;
        if let Some(step) = monitor.last_step {
            self.db.set_steps_done(job, step).await?;
        }
        Ok(())
    }
}

async fn send_control(stdin: &mut tokio::process::ChildStdin, cmd: &str) {
    let line = format!("{{\"cmd\":\"{cmd}\"}}\n");
    if let Err(e) = stdin.write_all(line.as_bytes()).await {
        tracing::warn!("could not send {cmd} to the trainer: {e}");
    }
    let _ = stdin.flush().await;
}

fn last_log_line(run_dir: &Path, number: i64) -> String {
    std::fs::read_to_string(run_dir.join(format!("attempt-{number}.log")))
        .ok()
        .and_then(|s| s.lines().rev().find(|l| !l.trim().is_empty()).map(|l| l.trim().to_string()))
        .unwrap_or_else(|| "no log output".into())
}

/// "micro_batch 16 → 8 (grad_accum 1 → 2)" and the like: what a step-down changed.
pub fn describe_change(before: &JobSpec, after: &JobSpec) -> String {
    let mut parts = Vec::new();
    if before.train.micro_batch != after.train.micro_batch {
        parts.push(format!(
            "micro_batch {} → {}, grad_accum {} → {}, global_batch {}",
            before.train.micro_batch,
            after.train.micro_batch,
            before.grad_accum(),
            after.grad_accum(),
            after.train.global_batch
        ));
    }
    let (b, a) = (&before.memory, &after.memory);
    if b.precision != a.precision {
        parts.push(format!("precision {} → {}", serde_name(&b.precision), serde_name(&a.precision)));
    }
    if b.checkpointing != a.checkpointing {
        parts.push(format!("checkpointing {} → {}", serde_name(&b.checkpointing), serde_name(&a.checkpointing)));
    }
    if b.zero_stage != a.zero_stage {
        parts.push(format!("zero_stage {} → {}", b.zero_stage, a.zero_stage));
    }
    if b.offload != a.offload {
        parts.push(format!("offload {} → {}", serde_json::json!(b.offload), serde_json::json!(a.offload)));
    }
    parts.join("; ")
}

/// Reads one attempt's events: samples, peaks, OOM details, and the warn/preempt thresholds.
struct Monitor {
    attempt: i64,
    warn: f64,
    preempt: f64,
    sustain: u32,
    above: u32,
    warned: bool,
    preempt_sent: bool,
    preempt_reason: Option<String>,
    /// Transfer fraction of step time that counts as swap-bound (from the policy), the run of
    /// steps above it, and the reason once sustained.
    swap_limit: Option<f64>,
    swap_above: u32,
    swap_reason: Option<String>,
    samples: Vec<SampleRow>,
    first_step: Option<i64>,
    last_step: Option<i64>,
    resumed_from: Option<i64>,
    capacity: Option<i64>,
    peaks: [Option<i64>; 7],
    tokens_per_s: Vec<f64>,
    mean_tokens_per_s: Option<f64>,
    oom_category: Option<String>,
    oom_requested: Option<i64>,
    oom_message: Option<String>,
}

const PEAK_KEYS: [&str; 7] = ["params", "grads", "optimizer", "activations", "workspace", "allocated", "reserved"];

impl Monitor {
    fn new(policy: &Policy, attempt: i64) -> Monitor {
        let t = &policy.thresholds;
        Monitor {
            attempt,
            warn: t.warn,
            preempt: t.preempt,
            sustain: t.sustain,
            above: 0,
            warned: false,
            preempt_sent: false,
            preempt_reason: None,
            swap_limit: policy.swap_bound.as_ref().map(|b| b.transfer_fraction),
            swap_above: 0,
            swap_reason: None,
            samples: Vec::new(),
            first_step: None,
            last_step: None,
            resumed_from: None,
            capacity: None,
            peaks: [None; 7],
            tokens_per_s: Vec::new(),
            mean_tokens_per_s: None,
            oom_category: None,
            oom_requested: None,
            oom_message: None,
        }
    }

    fn wants_preempt(&self) -> bool {
        (self.preempt_reason.is_some() || self.swap_reason.is_some()) && !self.preempt_sent
    }

    fn bump_peaks(&mut self, mem: &Value) {
        for (i, key) in PEAK_KEYS.iter().enumerate() {
            if let Some(v) = mem[*key].as_i64() {
                self.peaks[i] = Some(self.peaks[i].map_or(v, |p| p.max(v)));
            }
        }
    }

    /// Take one protocol event; returns supervisor events to record.
    fn observe(&mut self, ev: &Value) -> Vec<(&'static str, String)> {
        let mut out = Vec::new();
        let t = ev["t"].as_f64().unwrap_or_else(now);
        match ev["event"].as_str().unwrap_or("") {
            "started" => {
                self.resumed_from = ev["resumed_from_step"].as_i64();
                self.capacity = ev["capacity"].as_i64();
            }
            "step" => {
                let step = ev["step"].as_i64().unwrap_or(0);
                self.first_step.get_or_insert(step);
                self.last_step = Some(step);
                let mem = &ev["mem"];
                self.bump_peaks(mem);
                if let Some(tps) = ev["tokens_per_s"].as_f64() {
                    self.tokens_per_s.push(tps);
                }
                let g = |k: &str| mem[k].as_i64();
                self.samples.push(SampleRow {
                    attempt_id: self.attempt,
                    step,
                    t,
                    loss: ev["loss"].as_f64(),
                    val_loss: None,
                    tokens_per_s: ev["tokens_per_s"].as_f64(),
                    step_ms: ev["step_ms"].as_f64(),
                    params: g("params"),
                    grads: g("grads"),
                    optimizer: g("optimizer"),
                    activations: g("activations"),
                    workspace: g("workspace"),
                    allocated: g("allocated"),
                    reserved: g("reserved"),
                    fragmentation: g("fragmentation"),
                    capacity: g("capacity"),
                });
                let capacity = g("capacity").unwrap_or(0).max(1) as f64;
                let fraction = g("reserved").unwrap_or(0) as f64 / capacity;
                if fraction >= self.warn && !self.warned {
                    self.warned = true;
                    out.push((
                        "warn",
                        format!(
                            "step {step}: device memory at {:.1}% of capacity (warn threshold {:.0}%)",
                            fraction * 100.0,
                            self.warn * 100.0
                        ),
                    ));
                }
                if fraction >= self.preempt {
                    self.above += 1;
                } else {
                    self.above = 0;
                }
                if let (Some(limit), Some(frac)) = (self.swap_limit, ev["swap"]["fraction"].as_f64()) {
                    self.swap_above = if frac >= limit { self.swap_above + 1 } else { 0 };
                    if self.swap_above >= self.sustain && self.swap_reason.is_none() && self.preempt_reason.is_none() {
                        let reason = format!(
                            "transfers took {:.1}% of step time for {} steps in a row (swap_bound {:.1}%)",
                            frac * 100.0,
                            self.swap_above,
                            limit * 100.0
                        );
                        out.push(("swap_bound", format!("step {step}: {reason}; checkpointing")));
                        self.swap_reason = Some(reason);
                    }
                }
                if self.above >= self.sustain && self.preempt_reason.is_none() && self.swap_reason.is_none() {
                    let reason = format!(
                        "device memory at {:.1}% of capacity for {} steps in a row (preempt threshold {:.0}%, sustain {})",
                        fraction * 100.0,
                        self.above,
                        self.preempt * 100.0,
                        self.sustain
                    );
                    out.push(("preempt", format!("step {step}: {reason}; checkpointing and stepping down")));
                    self.preempt_reason = Some(reason);
                }
            }
            "eval" => {
                self.samples.push(SampleRow {
                    attempt_id: self.attempt,
                    step: ev["step"].as_i64().unwrap_or(0),
                    t,
                    val_loss: ev["val_loss"].as_f64(),
                    ..SampleRow::default()
                });
            }
            "oom" => {
                self.oom_category = ev["category"].as_str().map(str::to_owned);
                self.oom_requested = ev["requested_bytes"].as_i64();
                self.oom_message = ev["message"].as_str().map(str::to_owned);
                // An OOM while allocating the model comes before `started`.
                if self.capacity.is_none() {
                    self.capacity = ev["mem"]["capacity"].as_i64();
                }
                self.bump_peaks(&ev["mem"]);
            }
            "finished" => {
                self.mean_tokens_per_s = ev["mean_tokens_per_s"].as_f64();
                self.bump_peaks(&ev["mem"]);
            }
            _ => {}
        }
        out
    }

    fn end(&self, outcome: &Outcome, code: Option<i32>) -> AttemptEnd {
        let mean = self.mean_tokens_per_s.or_else(|| {
            (!self.tokens_per_s.is_empty())
                .then(|| self.tokens_per_s.iter().sum::<f64>() / self.tokens_per_s.len() as f64)
        });
        let message = match outcome {
            Outcome::Oom { .. } => self.oom_message.clone(),
            Outcome::Preempted { reason } | Outcome::SwapBound { reason } => Some(reason.clone()),
            Outcome::Invalid { message } | Outcome::Crashed { message } => Some(message.clone()),
            Outcome::Suspended => Some("supervisor shutting down".into()),
            _ => None,
        };
        AttemptEnd {
            outcome: outcome.db_name().into(),
            exit_code: code.map(i64::from),
            first_step: self.first_step,
            last_step: self.last_step,
            resumed_from_step: self.resumed_from,
            capacity: self.capacity,
            peaks: self.peaks,
            mean_tokens_per_s: mean,
            oom_category: self.oom_category.clone(),
            oom_requested: self.oom_requested,
            message,
        }
    }
}
