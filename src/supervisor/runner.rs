//! The runner: a queue of jobs over device slots; each attempt a `headroom train` child process
//! read through the trainer protocol (`crate::protocol`) into a [`Monitor`]; it executes what
//! the monitor and the ladder decision (`ladder::decide`) ask for, and records it in the DB.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::sync::{mpsc, watch, Mutex};

use crate::config::{serde_name, JobSpec};
use crate::memory::format_bytes;
use crate::protocol::{Control, Line};

use crate::engine::estimate;

use super::db::{AttemptEnd, AttemptPlan, Db, HistoryRow, RUNNER_PATIENCE};
use super::ladder::{self, Action, LadderState};
use super::monitor::Monitor;
use super::outcome::{self, Exit, Outcome, Request};
use super::planner;
use super::policy::{self, Policy, Strategy};
use super::run_dirs;

#[derive(Debug, Clone)]
pub struct RunnerConfig {
    pub policies_dir: PathBuf,
    pub runs_dir: PathBuf,
    /// The trainer executable (the current `headroom` binary).
    pub trainer_exe: PathBuf,
    /// Jobs run at once (device slots).
    pub slots: usize,
    /// Extra environment of every trainer child (tests: `HEADROOM_SIMULATED_GPU`).
    pub trainer_env: Vec<(String, String)>,
}

/// How long the output of a trainer killed for stalling is still read before the runner stops
/// waiting for it to close.
const KILLED_OUTPUT_GRACE: Duration = Duration::from_secs(30);

/// Sleep until `deadline`; with none, never wake.
async fn sleep_until_or_never(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// What one attempt came to: its outcome; the configuration to step up to when the runner
/// stopped it for that; what other processes held when they caused its preemption.
struct AttemptResult {
    outcome: Outcome,
    step_up_to: Option<(LadderState, planner::Others)>,
    external: Option<planner::Others>,
}

/// Armed on attempts of a job that stepped down because other processes took memory: when they
/// give enough back, the planner is asked whether to step back up.
struct StepUpWatch {
    from: LadderState,
    current: LadderState,
    excluded: planner::Excluded,
    calibration: planner::Calibration,
    /// Other processes' bytes at or below which the planner is asked.
    level: u64,
}

/// What the runner watches an attempt for besides its memory: the release of memory other
/// processes took (step up), throughput far below the plan (re-plan).
#[derive(Default)]
struct Watch {
    step_up: Option<StepUpWatch>,
    /// (floor, predicted) tokens/s.
    slow: Option<(f64, f64)>,
}

/// Other processes must give back this share of the GPU before a step up is considered.
const RELEASE_STEP: u64 = 20;

/// The daemon's job runner, shared by the HTTP handlers.
pub struct Runner {
    pub db: Db,
    pub cfg: RunnerConfig,
    /// The database's identity: run directories are owned by `<db_id>/job-<id>`.
    db_id: String,
    queue: mpsc::UnboundedSender<i64>,
    running: Mutex<HashMap<i64, mpsc::UnboundedSender<Request>>>,
    shutdown: watch::Sender<bool>,
    workers: Mutex<Vec<tokio::task::JoinHandle<()>>>,
}

impl Runner {
    /// Start `cfg.slots` workers and requeue jobs a previous daemon left unfinished.
    pub async fn start(db: Db, cfg: RunnerConfig) -> anyhow::Result<Arc<Runner>> {
        std::fs::create_dir_all(&cfg.runs_dir)
            .with_context(|| format!("--runs {}: cannot create the runs directory", cfg.runs_dir.display()))?;
        let db_id = db.identity().await?;
        let (tx, rx) = mpsc::unbounded_channel();
        let (shutdown, _) = watch::channel(false);
        let runner = Arc::new(Runner {
            db: db.with_patience(RUNNER_PATIENCE),
            cfg,
            db_id,
            queue: tx,
            running: Mutex::new(HashMap::new()),
            shutdown,
            workers: Mutex::new(Vec::new()),
        });
        let rx = Arc::new(Mutex::new(rx));
        for slot in 0..runner.cfg.slots.max(1) {
            let (shared, rx) = (runner.clone(), rx.clone());
            let handle = tokio::spawn(async move {
                let mut stop = shared.shutdown.subscribe();
                loop {
                    let next = tokio::select! {
                        job = async { rx.lock().await.recv().await } => job,
                        _ = stop.wait_for(|s| *s) => None,
                    };
                    let Some(job) = next else { break };
                    tracing::info!(job, slot, "running job");
                    if let Err(e) = shared.run_job(job).await {
                        // Not a storage hiccup (those are waited out): the supervisor could not
                        // run the job at all (run directory, trainer executable, ...).
                        tracing::error!(job, "job runner failed: {e:#}");
                        let reason = format!("supervisor error: {e:#}");
                        let _ = shared.db.set_job_status(job, "failed", Some(&reason)).await;
                        let _ = shared.db.event(job, None, "failed", &reason).await;
                    }
                }
            });
            runner.workers.lock().await.push(handle);
        }
        for job in runner.db.unfinished_jobs().await? {
            // A trainer the previous daemon left running (it should have died with it) must
            // not write next to the new attempt.
            for pid in runner.db.dangling_attempt_pids(job).await? {
                if run_dirs::kill_stale_trainer(pid, &runner.run_dir(job)) {
                    tracing::warn!(job, pid, "killed a trainer left running by the previous daemon");
                }
            }
            runner.db.close_dangling_attempts(job).await?;
            runner.db.set_job_status(job, "queued", None).await?;
            runner
                .db
                .event(job, None, "resumed", "supervisor started: job requeued, resuming from its newest checkpoint")
                .await?;
            runner.enqueue(job);
        }
        Ok(runner)
    }

    pub fn enqueue(&self, job: i64) {
        let _ = self.queue.send(job);
    }

    pub fn run_dir(&self, job: i64) -> PathBuf {
        self.cfg.runs_dir.join(format!("job-{job}"))
    }

    /// Who job `job`'s run directory belongs to.
    fn owner(&self, job: i64) -> String {
        format!("{}/job-{job}", self.db_id)
    }

    /// Make the job's run directory its own and free: another database's or job's directory
    /// at that path is moved aside (an event says where), and a trainer still holding it (an
    /// earlier attempt exiting) is waited for.
    async fn prepare_run_dir(&self, job: i64) -> anyhow::Result<PathBuf> {
        let run_dir = self.run_dir(job);
        if let Some((moved, found)) = run_dirs::claim(&run_dir, &self.owner(job))
            .with_context(|| format!("moving aside run directory {}", run_dir.display()))?
        {
            let msg = format!(
                "run directory {} belonged to {found}, not to this job: moved to {} (its checkpoints are not resumed)",
                run_dir.display(),
                moved.display()
            );
            tracing::warn!(job, "{msg}");
            self.db.event(job, None, "run_dir_superseded", &msg).await?;
        }
        std::fs::create_dir_all(&run_dir).with_context(|| format!("creating run directory {}", run_dir.display()))?;
        run_dirs::wait_unlocked(&run_dir, Duration::from_secs(60)).await.map_err(anyhow::Error::msg)?;
        Ok(run_dir)
    }

    /// Cancel a job: a queued one is marked at once, a running one is stopped after a checkpoint.
    pub async fn cancel(&self, job: i64) -> anyhow::Result<bool> {
        if let Some(tx) = self.running.lock().await.get(&job) {
            let _ = tx.send(Request::Cancel);
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
            let _ = tx.send(Request::Shutdown);
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
        let spec: JobSpec = serde_json::from_str(&detail.current_spec)?;
        let mut state = LadderState::new(spec, detail.core.rung.clone(), detail.core.rung_index);
        let device_kind = serde_name(&state.spec.device.kind);
        // What already failed or ran slow in this job is not planned again (a daemon restart
        // included; a preemption other processes caused is no failure of the configuration).
        let mut excluded = planner::Excluded::default();
        for (outcome, config) in self.db.failed_configs(job).await? {
            let Ok(spec) = serde_json::from_str::<JobSpec>(&config) else { continue };
            match outcome.as_str() {
                "slow" => excluded.slow.push(spec),
                _ => excluded.failed.push(spec),
            }
        }
        let mut first_attempt = self.db.attempts(job).await?.is_empty();
        if first_attempt && state.rung_index == -1 && policy.strategy != Strategy::Ladder {
            let finished: Vec<planner::Finished> = self
                .db
                .finished_jobs(&policy.name, job, 50)
                .await?
                .into_iter()
                .filter_map(|f| {
                    Some(planner::Finished {
                        id: f.id,
                        submitted: JobSpec::parse(&f.spec_yaml).ok()?,
                        last: serde_json::from_str(&f.current_spec).ok()?,
                        rung_name: f.rung,
                        rung_index: f.rung_index,
                    })
                })
                .collect();
            if let Some((warm, (kind, message))) = planner::warm_start(&state.spec, &finished) {
                self.db.event(job, None, kind, &message).await?;
                let spec_json = serde_json::to_string(&warm.spec)?;
                self.db.set_job_rung(job, &warm.rung_name, warm.rung_index, &spec_json).await?;
                state = warm;
            }
        }
        // Other processes' memory the plans leave to them, where the job stood before they took
        // it, and how often it stepped back up.
        let mut others: Option<planner::Others> = None;
        let mut pressure_from: Option<LadderState> = None;
        let mut step_ups = 0u32;
        let (control_tx, mut control_rx) = mpsc::unbounded_channel();
        self.running.lock().await.insert(job, control_tx);
        let result = async {
            loop {
                self.db.set_job_status(job, "running", None).await?;
                let history: Vec<planner::Observed> =
                    self.db.device_history(&device_kind, planner::HISTORY).await?.iter().map(observed).collect();
                let calibration = planner::learn(&policy, &device_kind, &history);
                let mut plan = planner::plan(&policy, &state, &excluded, &calibration, others);
                let before = state.clone();
                let notices = match policy.strategy {
                    Strategy::FastestFit => match plan.as_ref().map(|p| planner::apply(p, &state)) {
                        Some(Some((next, notices))) => {
                            state = next;
                            notices
                        }
                        Some(None) => vec![(
                            "plan",
                            format!(
                                "no configuration the policy allows is predicted to fit; running rung {} as it stands",
                                state.rung_name
                            ),
                        )],
                        None => vec![],
                    },
                    // Pass over what the estimator rules out before spending an attempt on it.
                    Strategy::FirstFit => {
                        let (planned, notices) = ladder::first_fit(&policy, &state);
                        if planned.rung_index != state.rung_index {
                            let message = format!(
                                "starting on rung {} ({}): the first configuration predicted to fit",
                                planned.rung_name,
                                ladder::describe_change(&state.spec, &planned.spec)
                            );
                            state = planned;
                            notices.into_iter().chain([("step_down", message)]).collect()
                        } else {
                            state = planned;
                            notices
                        }
                    }
                    Strategy::Ladder => vec![],
                };
                if policy.strategy != Strategy::FastestFit {
                    if let Some(p) = plan.as_mut() {
                        p.mark_chosen(&state.spec);
                    }
                }
                if state.spec != before.spec || first_attempt {
                    for (kind, message) in &notices {
                        self.db.event(job, None, kind, message).await?;
                    }
                }
                if state.spec != before.spec {
                    let spec_json = serde_json::to_string(&state.spec)?;
                    self.db.set_job_rung(job, &state.rung_name, state.rung_index, &spec_json).await?;
                }
                first_attempt = false;
                let model = estimate::step_time_job(&state.spec);
                let attempt_plan = AttemptPlan {
                    device_kind: device_kind.clone(),
                    predicted_allocated: Some(estimate::estimate_job(&state.spec).peak_allocated as i64),
                    predicted_tokens_per_s: Some(model.tokens_per_s * calibration.speed_scale),
                    model_tokens_per_s: Some(model.tokens_per_s),
                    plan_json: plan.as_ref().map(serde_json::to_string).transpose()?,
                };
                let step_up = match (&pressure_from, others) {
                    (Some(from), Some(o)) if step_ups < planner::MAX_STEP_UPS => Some(StepUpWatch {
                        from: from.clone(),
                        current: state.clone(),
                        excluded: excluded.clone(),
                        calibration: calibration.clone(),
                        level: o.bytes.saturating_sub(o.total / RELEASE_STEP),
                    }),
                    _ => None,
                };
                let predicted = attempt_plan.predicted_tokens_per_s.unwrap_or(0.0);
                let slow = (policy.strategy == Strategy::FastestFit)
                    .then(|| planner::slow_floor(&calibration, predicted, &excluded))
                    .flatten()
                    .map(|floor| (floor, predicted));
                let watch = Watch { step_up, slow };
                let AttemptResult { outcome, step_up_to, external } =
                    self.run_attempt(job, &state, &attempt_plan, &policy, watch, &mut control_rx).await?;
                let failure = matches!(outcome, Outcome::Oom { .. } | Outcome::Preempted { .. });
                let slow = matches!(outcome, Outcome::Slow { .. });
                match external {
                    // Other processes' memory is not this configuration's failure: plan around it,
                    // and remember where the job stood to step back up when it is given back.
                    Some(o) if failure => {
                        others = Some(o);
                        pressure_from.get_or_insert_with(|| state.clone());
                    }
                    _ if failure => excluded.failed.push(state.spec.clone()),
                    _ if matches!(outcome, Outcome::Slow { .. }) => excluded.slow.push(state.spec.clone()),
                    _ => {}
                }
                let replan = if failure || slow {
                    planner::replan_after(&policy, &state, &excluded, &calibration, others)
                } else {
                    None
                };
                let action = match replan {
                    Some(message) => Action::Replan { message },
                    None => ladder::decide(&policy, &state, &outcome),
                };
                for (kind, message) in action.events(&state) {
                    self.db.event(job, None, kind, &message).await?;
                }
                let mut next = action.next_state(&state);
                match &action {
                    Action::Retry { .. } | Action::Replan { .. } => {}
                    Action::StepUp { .. } => {
                        if let Some((target, now)) = step_up_to {
                            step_ups += 1;
                            others = Some(now);
                            let spec_json = serde_json::to_string(&target.spec)?;
                            self.db.set_job_rung(job, &target.rung_name, target.rung_index, &spec_json).await?;
                            next = target;
                        }
                    }
                    Action::StepDown { down, .. } => {
                        let spec_json = serde_json::to_string(&down.spec)?;
                        self.db.set_job_rung(job, &down.rung_name, down.rung_index, &spec_json).await?;
                    }
                    Action::Finish | Action::Requeue => {
                        self.db.set_job_status(job, action.job_status(), None).await?;
                        return Ok(());
                    }
                    Action::Cancel => {
                        self.db.set_job_status(job, action.job_status(), Some("cancelled on request")).await?;
                        return Ok(());
                    }
                    Action::Fail { reason, .. } => {
                        self.db.set_job_status(job, action.job_status(), Some(reason)).await?;
                        return Ok(());
                    }
                }
                state = next;
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
        state: &LadderState,
        plan: &AttemptPlan,
        policy: &Policy,
        watch: Watch,
        control: &mut mpsc::UnboundedReceiver<Request>,
    ) -> anyhow::Result<AttemptResult> {
        let (rung, spec) = (state.rung_name.as_str(), &state.spec);
        let run_dir = self.prepare_run_dir(job).await?;
        let config_json = serde_json::to_string(spec)?;
        let (attempt, number) = self.db.start_attempt(job, rung, &config_json, plan).await?;
        match self.supervise(job, attempt, number, &run_dir, rung, spec, policy, watch, control).await {
            Ok(outcome) => Ok(outcome),
            Err(e) => {
                // The attempt row is always closed, whatever stopped the supervision.
                let end = AttemptEnd {
                    outcome: "crashed".into(),
                    message: Some(format!("supervisor error: {e:#}")),
                    ..AttemptEnd::default()
                };
                let _ = self.db.finish_attempt(attempt, &end).await;
                Err(e)
            }
        }
    }

    /// Start the trainer of one attempt (its row already open), follow it to its end, close
    /// the row and record the outcome.
    #[allow(clippy::too_many_arguments)]
    async fn supervise(
        &self,
        job: i64,
        attempt: i64,
        number: i64,
        run_dir: &Path,
        rung: &str,
        spec: &JobSpec,
        policy: &Policy,
        watch: Watch,
        control: &mut mpsc::UnboundedReceiver<Request>,
    ) -> anyhow::Result<AttemptResult> {
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
        let mut command = tokio::process::Command::new(&self.cfg.trainer_exe);
        // The attempt is rank 0 of its own group: a launcher's rank variables around the
        // daemon are not the trainer's (the daemon's own trainer_env may still set them).
        for name in crate::protocol::LAUNCHER_VARIABLES {
            command.env_remove(name);
        }
        command
            .arg("train")
            .arg("--config")
            .arg(&config_path)
            .arg("--run-dir")
            .arg(run_dir)
            .arg("--run-owner")
            .arg(self.owner(job))
            .env("HEADROOM_LOG", std::env::var("HEADROOM_TRAINER_LOG").unwrap_or_else(|_| "info".into()))
            .envs(self.cfg.trainer_env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(stderr_log))
            .kill_on_drop(true);
        run_dirs::die_with_parent(&mut command);
        let mut child = command.spawn().with_context(|| format!("starting {}", self.cfg.trainer_exe.display()))?;
        self.db.set_attempt_pid(attempt, child.id()).await?;
        let mut stdin = child.stdin.take().expect("piped stdin");
        let mut lines = BufReader::new(child.stdout.take().expect("piped stdout")).lines();
        let mut monitor = Monitor::new(policy, attempt);
        let Watch { step_up: mut watch, slow } = watch;
        if let Some(w) = &watch {
            monitor.watch_for_release(w.level);
        }
        if let Some((floor, predicted)) = slow {
            monitor.expect_throughput(floor, predicted);
        }
        let mut step_up_to = None;
        let mut requested: Option<Request> = None;
        let mut last_flush = Instant::now();
        // The stall watchdog: the last time the trainer was heard from, and once it was killed
        // for its silence, when that was (its output should end soon after).
        let mut last_heard = tokio::time::Instant::now();
        let mut killed_at: Option<tokio::time::Instant> = None;
        loop {
            // Not armed before the trainer has said `started` (the limit is None until then).
            let deadline = match (killed_at, monitor.stall_limit()) {
                (Some(at), _) => Some(at + KILLED_OUTPUT_GRACE),
                (None, limit) => limit.map(|limit| last_heard + limit),
            };
            tokio::select! {
                line = lines.next_line() => {
                    let Some(line) = line? else { break };
                    last_heard = tokio::time::Instant::now();
                    let Some(ev) = Line::parse(&line) else {
                        tracing::warn!(job, "trainer wrote a line that is not a protocol event: {line}");
                        continue;
                    };
                    for (kind, message) in monitor.observe(&ev) {
                        self.db.event(job, Some(attempt), kind, &message).await?;
                    }
                    if let (Some(w), Some((bytes, total))) = (watch.as_mut(), monitor.memory_released()) {
                        let now = planner::Others { bytes, total };
                        match planner::step_up(policy, &w.from, &w.current, &w.excluded, &w.calibration, now) {
                            Some((target, reason)) if requested.is_none() => {
                                monitor.stop_for_step_up(reason);
                                step_up_to = Some((target, now));
                            }
                            // Not worth a restart yet: ask again when more is given back.
                            _ => monitor.watch_for_release(bytes.saturating_sub(total / RELEASE_STEP)),
                        }
                    }
                    if monitor.wants_preempt() && requested.is_none() {
                        send_control(&mut stdin, Control::CheckpointAndExit).await;
                        monitor.preempt_sent();
                    } else if monitor.wants_release_cache() && requested.is_none() {
                        send_control(&mut stdin, Control::ReleaseCache).await;
                        monitor.release_cache_sent();
                    }
                    if monitor.pending_samples() >= 64 || last_flush.elapsed() > Duration::from_secs(1) {
                        self.flush(job, &mut monitor).await?;
                        last_flush = Instant::now();
                    }
                }
                msg = control.recv(), if requested.is_none() => {
                    if let Some(msg) = msg {
                        requested = Some(msg);
                        let cmd = if msg == Request::Cancel { Control::Stop } else { Control::CheckpointAndExit };
                        send_control(&mut stdin, cmd).await;
                    }
                }
                () = sleep_until_or_never(deadline) => {
                    if killed_at.is_some() {
                        // Killed, yet its output stays open (a descendant holding it): stop reading.
                        tracing::warn!(job, "the killed trainer's output is still open; no longer reading it");
                        break;
                    }
                    if let Some((kind, message)) = monitor.stalled(last_heard.elapsed()) {
                        tracing::warn!(job, attempt, "{message}");
                        self.db.event(job, Some(attempt), kind, &message).await?;
                        if let Err(e) = child.start_kill() {
                            tracing::warn!(job, "could not kill the stalled trainer: {e}");
                        }
                        killed_at = Some(tokio::time::Instant::now());
                    }
                }
            }
        }
        let status = child.wait().await?;
        self.flush(job, &mut monitor).await?;
        let code = status.code();
        let outcome = outcome::classify(&Exit {
            code,
            signal: status.to_string(),
            requested,
            stopped_by_monitor: monitor.stop_reason(),
            oom: monitor.oom(),
            last_log_line: last_log_line(run_dir, number),
        });
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
            Outcome::SteppedUp { .. } => format!("attempt {number} checkpointed and stopped to step back up"),
            Outcome::Slow { reason } => format!("attempt {number} checkpointed and stopped: {reason}"),
            Outcome::Stalled { .. } => format!("attempt {number} stalled and was killed"),
            other => format!("attempt {number} ended: {}", other.db_name()),
        };
        let kind = match outcome {
            Outcome::Oom { .. } => "oom",
            Outcome::Preempted { .. } => "preempt",
            _ => "attempt_ended",
        };
        self.db.event(job, Some(attempt), kind, &summary).await?;
        let external = monitor.external_pressure().map(|(bytes, total)| planner::Others { bytes, total });
        let step_up_to = step_up_to.filter(|_| matches!(outcome, Outcome::SteppedUp { .. }));
        Ok(AttemptResult { outcome, step_up_to, external })
    }

    async fn flush(&self, job: i64, monitor: &mut Monitor) -> anyhow::Result<()> {
        let batch = monitor.take_samples();
        self.db.insert_samples(&batch).await?;
        if let Some(step) = monitor.steps_done() {
            self.db.set_steps_done(job, step).await?;
        }
        Ok(())
    }
}

async fn send_control(stdin: &mut tokio::process::ChildStdin, cmd: Control) {
    if let Err(e) = stdin.write_all(cmd.to_line().as_bytes()).await {
        tracing::warn!("could not send {cmd:?} to the trainer: {e}");
    }
    let _ = stdin.flush().await;
}

fn last_log_line(run_dir: &Path, number: i64) -> String {
    std::fs::read_to_string(run_dir.join(format!("attempt-{number}.log")))
        .ok()
        .and_then(|s| s.lines().rev().find(|l| !l.trim().is_empty()).map(|l| l.trim().to_string()))
        .unwrap_or_else(|| "no log output".into())
}

/// An ended attempt as the planner learns from it: an OOM needed at least its peak plus the
/// request that failed; an attempt that never stepped measured no peak.
fn observed(row: &HistoryRow) -> planner::Observed {
    let measured_allocated = match (row.outcome.as_deref(), row.peak_allocated, row.oom_requested) {
        (Some("oom"), Some(peak), Some(req)) => Some(peak + req),
        (_, Some(peak), _) if row.last_step.is_some() => Some(peak),
        _ => None,
    };
    planner::Observed {
        predicted_allocated: row.predicted_allocated,
        measured_allocated,
        predicted_tokens_per_s: row.model_tokens_per_s,
        measured_tokens_per_s: row.mean_tokens_per_s.filter(|_| row.last_step.is_some()),
    }
}
