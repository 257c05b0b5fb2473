//! The ladder decision: how an attempt ended ([`Outcome`]) and where the job stands
//! ([`LadderState`]) give the next [`Action`] — finish, retry, step down to a rung, step back,
//! or fail with the reason. Pure functions; the runner executes the actions and records their
//! events.

use crate::config::{serde_name, JobSpec};
use crate::engine::estimate;
use crate::memory::format_bytes;

use super::outcome::{Notice, Outcome};
use super::policy::{self, LadderPosition, Policy, StepDown, Strategy, SwapAction};

/// Where a job stands on its ladder between attempts.
#[derive(Debug, Clone, PartialEq)]
pub struct LadderState {
    pub spec: JobSpec,
    pub rung_name: String,
    /// Index of the last rung applied (-1: none).
    pub rung_index: i64,
    /// Crashes in a row on this rung.
    pub crashes: u32,
    /// The configuration before the current rung was applied (swap_bound's step back).
    pub before_rung: Option<JobSpec>,
}

impl LadderState {
    /// A job as stored: its current configuration and rung.
    pub fn new(spec: JobSpec, rung_name: String, rung_index: i64) -> LadderState {
        LadderState { spec, rung_name, rung_index, crashes: 0, before_rung: None }
    }
}

/// What to do after an attempt.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// The job is done.
    Finish,
    /// Back to the queue (the daemon is shutting down); resumes from its checkpoint later.
    Requeue,
    /// Stopped on request.
    Cancel,
    /// Nothing more can help: the job fails with this reason (after recording `before`: the
    /// rungs skipped on the way, a step back that found no rung).
    Fail { reason: String, before: Vec<Notice> },
    /// Run the same configuration again from the newest checkpoint.
    Retry { crashes: u32, message: String },
    /// Stopped to step back up: the next attempt runs the configuration the planner chose
    /// when the memory other processes held came back (`planner::step_up`).
    StepUp { reason: String },
    /// Plan again from where the job stands (`fastest_fit` after an OOM or a preemption: what
    /// failed is excluded, or what other processes hold is left to them), saying why.
    Replan { message: String },
    /// Run the next rung's configuration (`from` is the configuration it applies to: the
    /// current one, or the one before the current rung when stepping back).
    StepDown { from: Box<JobSpec>, step_back: Option<String>, down: Box<StepDown> },
}

impl Action {
    /// The job's status after this action ("running" for the ones that start another attempt).
    pub fn job_status(&self) -> &'static str {
        match self {
            Action::Finish => "finished",
            Action::Requeue => "queued",
            Action::Cancel => "cancelled",
            Action::Fail { .. } => "failed",
            Action::Retry { .. } | Action::StepDown { .. } | Action::StepUp { .. } | Action::Replan { .. } => "running",
        }
    }

    /// The events this action records, in order, with the state it was decided in.
    pub fn events(&self, state: &LadderState) -> Vec<Notice> {
        match self {
            Action::Finish => vec![("finished", format!("finished on rung {}", state.rung_name))],
            Action::Requeue => vec![],
            Action::Cancel => vec![("cancelled", "stopped after a checkpoint on request".into())],
            Action::Fail { reason, before } => before.iter().cloned().chain([("failed", reason.clone())]).collect(),
            Action::Retry { message, .. } => vec![("retry", message.clone())],
            Action::StepUp { reason } => vec![("step_up", reason.clone())],
            Action::Replan { message } => vec![("step_down", message.clone())],
            Action::StepDown { from, step_back, down } => {
                let mut out: Vec<Notice> = step_back.iter().map(|m| ("swap_bound", m.clone())).collect();
                out.extend(skip_events(&down.skipped));
                out.push((
                    "step_down",
                    format!("stepping down to rung {} ({})", down.rung_name, describe_change(from, &down.spec)),
                ));
                out
            }
        }
    }

    /// The state the next attempt runs in (terminal actions leave it as it was).
    pub fn next_state(&self, state: &LadderState) -> LadderState {
        match self {
            Action::Retry { crashes, .. } => LadderState { crashes: *crashes, ..state.clone() },
            Action::StepDown { from, down, .. } => LadderState {
                spec: down.spec.clone(),
                rung_name: down.rung_name.clone(),
                rung_index: down.rung_index,
                crashes: 0,
                before_rung: Some(JobSpec::clone(from)),
            },
            _ => state.clone(),
        }
    }
}

fn skip_events(skipped: &[(String, String)]) -> impl Iterator<Item = Notice> + '_ {
    skipped.iter().map(|(name, why)| ("skip", format!("rung {name} skipped: {why}")))
}

/// The next action for a job on `policy` in `state` whose attempt ended with `outcome`.
pub fn decide(policy: &Policy, state: &LadderState, outcome: &Outcome) -> Action {
    let rung = &state.rung_name;
    let fail = |reason: String| Action::Fail { reason, before: vec![] };
    match outcome {
        Outcome::Finished => Action::Finish,
        Outcome::SteppedUp { reason } => Action::StepUp { reason: reason.clone() },
        // Re-planned by the runner when something else fits; when nothing does, run it again.
        Outcome::Slow { reason } => Action::Replan {
            message: format!("{reason}; nothing else the policy allows is predicted to fit: running it again"),
        },
        Outcome::Suspended => Action::Requeue,
        Outcome::Cancelled => Action::Cancel,
        Outcome::Invalid { message } => fail(format!("trainer rejected the configuration: {message}")),
        // A hang counts as a crash: the same retries from the newest checkpoint, the same limit.
        Outcome::Crashed { message } | Outcome::Stalled { reason: message } => {
            let crashes = state.crashes + 1;
            if crashes > policy.retries.crash {
                return fail(format!("crashed {crashes} times on rung {rung}: {message}"));
            }
            Action::Retry {
                crashes,
                message: format!(
                    "crash {crashes}/{} on rung {rung} ({message}); retrying from the newest checkpoint",
                    policy.retries.crash
                ),
            }
        }
        Outcome::SwapBound { reason } => {
            let action = policy.swap_bound.as_ref().map(|b| b.action);
            match (action, &state.before_rung) {
                (Some(SwapAction::StepBack), Some(prev)) => {
                    let step_back = format!(
                        "rung {rung} is swap-bound ({reason}); backing off to the configuration before it and \
                         trying the rungs after it"
                    );
                    step_down(policy, state, prev, Some(step_back))
                }
                _ => fail(format!("rung {rung} is swap-bound ({reason}) and the policy does not step back")),
            }
        }
        Outcome::Oom { .. } | Outcome::Preempted { .. } => step_down(policy, state, &state.spec, None),
    }
}

/// Under [`Strategy::FirstFit`], the first configuration from `state` on (itself, else the
/// rungs after it in order) that the estimator does not rule out on the job's device — its
/// allocated peak stays under the preempt threshold's share of capacity, where the monitor
/// would not stop it — with a `skip` notice per configuration passed over
/// ("rung base skipped: predicted 29.0 MiB > 12.0 MiB"). Unchanged under `ladder`, without a
/// known capacity (cuda with no `device_memory`), or when nothing is predicted to fit (the
/// attempt then runs and its OOM decides, as on the ladder).
pub fn first_fit(policy: &Policy, state: &LadderState) -> (LadderState, Vec<Notice>) {
    let unchanged = (state.clone(), Vec::new());
    let Some(capacity) = state.spec.device_capacity() else { return unchanged };
    if policy.strategy != Strategy::FirstFit {
        return unchanged;
    }
    let limit = (capacity as f64 * policy.thresholds.preempt) as usize;
    let fits = |spec: &JobSpec| {
        let e = estimate::estimate_job(spec);
        (e.peak_allocated <= limit, e)
    };
    let mut notices = Vec::new();
    let mut current = state.clone();
    loop {
        let (ok, e) = fits(&current.spec);
        if ok {
            // Reached through a rung that freed memory some other way (checkpointing, ZeRO,
            // offload): the micro-batch goes back up to the largest that is predicted to fit.
            let sets_micro_batch = |i: i64| i >= 0 && policy.rungs[i as usize].set.micro_batch.is_some();
            // Only on a configuration just reached (by passing over rungs here, or a step-down
            // the attempt before), never on a retry or a resumed job.
            let just_reached = !notices.is_empty() || (state.before_rung.is_some() && state.crashes == 0);
            if just_reached && !sets_micro_batch(current.rung_index) {
                if let Some((raised, e)) = largest_fitting_micro_batch(&current.spec, limit) {
                    notices.push((
                        "plan",
                        format!(
                            "micro_batch {} → {} on rung {}: the largest predicted to fit ({} allocated of {} allowed)",
                            current.spec.train.micro_batch,
                            raised.train.micro_batch,
                            current.rung_name,
                            format_bytes(e.peak_allocated),
                            format_bytes(limit)
                        ),
                    ));
                    current.spec = raised;
                }
            }
            return (current, notices);
        }
        notices.push((
            "skip",
            format!(
                "rung {} skipped: predicted {} allocated > {} ({:.0}% of {} capacity, the preempt threshold)",
                current.rung_name,
                format_bytes(e.peak_allocated),
                format_bytes(limit),
                policy.thresholds.preempt * 100.0,
                format_bytes(capacity)
            ),
        ));
        match policy::step_down(policy, &current.spec, LadderPosition { rung_index: current.rung_index }) {
            Ok(down) => {
                notices.extend(skip_events(&down.skipped));
                current = LadderState {
                    spec: down.spec,
                    rung_name: down.rung_name,
                    rung_index: down.rung_index,
                    crashes: 0,
                    before_rung: Some(current.spec.clone()),
                };
            }
            Err(_) => return unchanged,
        }
    }
}

/// `spec` with the largest micro-batch above its own (a divisor of the sequences per rank and
/// step, so the global batch is unchanged) whose predicted allocated peak is within `limit`.
fn largest_fitting_micro_batch(spec: &JobSpec, limit: usize) -> Option<(JobSpec, estimate::Estimate)> {
    let per_rank = spec.train.global_batch / spec.data_parallel();
    (spec.train.micro_batch + 1..=per_rank).rev().filter(|m| per_rank % m == 0).find_map(|m| {
        let mut raised = spec.clone();
        raised.train.micro_batch = m;
        raised.validate().ok()?;
        let e = estimate::estimate_job(&raised);
        (e.peak_allocated <= limit).then_some((raised, e))
    })
}

/// The next applicable rung applied to `from`, or the failure naming the last rung.
fn step_down(policy: &Policy, state: &LadderState, from: &JobSpec, step_back: Option<String>) -> Action {
    match policy::step_down(policy, from, LadderPosition { rung_index: state.rung_index }) {
        Ok(down) => Action::StepDown { from: Box::new(from.clone()), step_back, down: Box::new(down) },
        Err(skipped) => Action::Fail {
            reason: format!("no rung of policy {} is left to apply (last rung: {})", policy.name, state.rung_name),
            before: step_back.map(|m| ("swap_bound", m)).into_iter().chain(skip_events(&skipped)).collect(),
        },
    }
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
    if b.tensor_parallel != a.tensor_parallel {
        parts.push(format!(
            "tensor_parallel {} → {} (data-parallel ranks {} → {}, grad_accum {} → {})",
            b.tensor_parallel,
            a.tensor_parallel,
            before.data_parallel(),
            after.data_parallel(),
            before.grad_accum(),
            after.grad_accum()
        ));
    }
    if b.pipeline_parallel != a.pipeline_parallel {
        parts.push(format!(
            "pipeline_parallel {} → {} (data-parallel ranks {} → {}, grad_accum {} → {})",
            b.pipeline_parallel,
            a.pipeline_parallel,
            before.data_parallel(),
            after.data_parallel(),
            before.grad_accum(),
            after.grad_accum()
        ));
    }
    if b.zero_stage != a.zero_stage {
        parts.push(format!("zero_stage {} → {}", b.zero_stage, a.zero_stage));
    }
    if b.offload != a.offload {
        parts.push(format!("offload {} → {}", serde_json::json!(b.offload), serde_json::json!(a.offload)));
    }
    parts.join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::supervisor::policy::tests::spec;

    /// bf16, halve (repeating), a ZeRO rung (never applies at world 1), offload-optimizer.
    fn policy(swap: &str, crash_retries: u32) -> Policy {
        Policy::parse(&format!(
            "name: p\nrungs:\n  - {{ name: bf16, set: {{ precision: bf16 }} }}\n  \
             - {{ name: halve, set: {{ micro_batch: half }}, repeat: true }}\n  \
             - {{ name: zero-2, set: {{ zero_stage: 2 }} }}\n  \
             - {{ name: offload-optimizer, set: {{ offload: {{ optimizer: cpu }} }} }}\n\
             {swap}retries: {{ crash: {crash_retries} }}\n"
        ))
        .unwrap()
    }

    const STEP_BACK: &str = "swap_bound: { transfer_fraction: 0.5, action: step_back }\n";
    const SWAP_FAILS: &str = "swap_bound: { transfer_fraction: 0.5, action: fail }\n";

    fn oom() -> Outcome {
        Outcome::Oom { category: "activations".into(), requested: 1 << 20 }
    }

    /// The state after applying `rungs` steps down from the base configuration (micro_batch 8).
    fn state_after(policy: &Policy, rungs: usize) -> LadderState {
        let mut state = LadderState::new(spec(8), "base".into(), -1);
        for _ in 0..rungs {
            let action = decide(policy, &state, &oom());
            assert!(matches!(action, Action::StepDown { .. }), "{action:?}");
            state = action.next_state(&state);
        }
        state
    }

    /// What an action comes to, as the runner sees it.
    #[derive(Debug, PartialEq)]
    enum Want {
        Finish,
        Requeue,
        Cancel,
        Fail(&'static str),
        Retry(u32),
        StepUp,
        Replan,
        /// Rung name, micro-batch and whether it stepped back.
        Down(&'static str, i64, bool),
    }

    fn seen(action: &Action) -> Want {
        match action {
            Action::Finish => Want::Finish,
            Action::Requeue => Want::Requeue,
            Action::Cancel => Want::Cancel,
            Action::Fail { reason, .. } => Want::Fail(Box::leak(reason.clone().into_boxed_str())),
            Action::Retry { crashes, .. } => Want::Retry(*crashes),
            Action::StepUp { .. } => Want::StepUp,
            Action::Replan { .. } => Want::Replan,
            Action::StepDown { step_back, down, .. } => Want::Down(
                Box::leak(down.rung_name.clone().into_boxed_str()),
                down.spec.train.micro_batch,
                step_back.is_some(),
            ),
        }
    }

    #[test]
    fn each_outcome_and_position_gives_the_expected_action() {
        let crash = Outcome::Crashed { message: "exit code 1: boom".into() };
        let preempt = Outcome::Preempted { reason: "device memory at 97%".into() };
        let swap = Outcome::SwapBound { reason: "transfers took 80%".into() };
        let invalid = Outcome::Invalid { message: "invalid job: train.lr".into() };
        let stalled = Outcome::Stalled { reason: "nothing heard for 600 s".into() };
        // (case, swap_bound, rungs applied, crashes so far, outcome, expected)
        let cases: Vec<(&str, &str, usize, u32, Outcome, Want)> = vec![
            ("finished", "", 0, 0, Outcome::Finished, Want::Finish),
            ("stopped to step back up", "", 3, 0, Outcome::SteppedUp { reason: "freed".into() }, Want::StepUp),
            ("slow, nothing else fits", "", 2, 0, Outcome::Slow { reason: "3k tokens/s".into() }, Want::Replan),
            ("suspended", "", 2, 0, Outcome::Suspended, Want::Requeue),
            ("cancelled", "", 1, 0, Outcome::Cancelled, Want::Cancel),
            ("oom at the base", "", 0, 0, oom(), Want::Down("bf16", 8, false)),
            ("preempt at the base", "", 0, 0, preempt.clone(), Want::Down("bf16", 8, false)),
            ("oom on bf16", "", 1, 0, oom(), Want::Down("halve", 4, false)),
            ("a repeating rung repeats", "", 2, 0, oom(), Want::Down("halve", 2, false)),
            ("and again", "", 3, 0, oom(), Want::Down("halve", 1, false)),
            ("zero skipped at world 1", "", 4, 0, oom(), Want::Down("offload-optimizer", 1, false)),
            (
                "ladder exhausted",
                "",
                5,
                0,
                oom(),
                Want::Fail("no rung of policy p is left to apply (last rung: offload-optimizer)"),
            ),
            ("first crash retries", "", 1, 0, crash.clone(), Want::Retry(1)),
            ("a stall retries as a crash", "", 1, 0, stalled.clone(), Want::Retry(1)),
            (
                "a stall after two crashes fails",
                "",
                1,
                2,
                stalled,
                Want::Fail("crashed 3 times on rung bf16: nothing heard for 600 s"),
            ),
            ("second crash retries", "", 1, 1, crash.clone(), Want::Retry(2)),
            (
                "third crash fails",
                "",
                1,
                2,
                crash.clone(),
                Want::Fail("crashed 3 times on rung bf16: exit code 1: boom"),
            ),
            (
                "invalid never retries",
                "",
                0,
                0,
                invalid,
                Want::Fail("trainer rejected the configuration: invalid job: train.lr"),
            ),
            (
                "swap-bound on the last rung steps back, then fails",
                STEP_BACK,
                5,
                0,
                swap.clone(),
                Want::Fail("no rung of policy p is left to apply (last rung: offload-optimizer)"),
            ),
            (
                "swap-bound on a repeating rung re-applies it from before",
                STEP_BACK,
                2,
                0,
                swap.clone(),
                Want::Down("halve", 4, true),
            ),
            (
                "swap-bound with action fail",
                SWAP_FAILS,
                2,
                0,
                swap.clone(),
                Want::Fail("rung halve is swap-bound (transfers took 80%) and the policy does not step back"),
            ),
            (
                "swap-bound with no policy entry",
                "",
                2,
                0,
                swap.clone(),
                Want::Fail("rung halve is swap-bound (transfers took 80%) and the policy does not step back"),
            ),
            (
                "swap-bound before any rung",
                STEP_BACK,
                0,
                0,
                swap,
                Want::Fail("rung base is swap-bound (transfers took 80%) and the policy does not step back"),
            ),
        ];
        for (name, swap_bound, rungs, crashes, outcome, want) in cases {
            let policy = policy(swap_bound, 2);
            let state = LadderState { crashes, ..state_after(&policy, rungs) };
            assert_eq!(seen(&decide(&policy, &state, &outcome)), want, "{name}");
        }
    }

    #[test]
    fn first_fit_passes_over_what_the_estimator_rules_out() {
        let demo = JobSpec::parse(include_str!("../../data/demo-job.yaml")).unwrap();
        let shipped = Policy::parse(include_str!("../../policies/default.yaml")).unwrap();
        let default = Policy { strategy: Strategy::FirstFit, ..shipped };
        let ladder = Policy { strategy: Strategy::Ladder, ..default.clone() };
        let cuda_unbounded = {
            let mut s = demo.clone();
            s.device.kind = crate::config::DeviceKind::Cuda;
            s.device.device_memory = None;
            s
        };
        let roomy = JobSpec {
            device: crate::config::DeviceSpec {
                device_memory: Some(crate::config::Bytes::from("64MiB".to_string())),
                ..demo.device.clone()
            },
            ..demo.clone()
        };
        // (case, policy, job, rung it starts on, micro-batch, skip notices)
        let cases: Vec<(&str, &Policy, &JobSpec, &str, i64, usize)> = vec![
            ("the demo on 12 MiB: fp32 and bf16 at 32 ruled out", &default, &demo, "halve-micro-batch", 16, 2),
            ("ladder strategy: unchanged", &ladder, &demo, "base", 32, 0),
            ("no known capacity: unchanged", &default, &cuda_unbounded, "base", 32, 0),
            ("fits as submitted: unchanged", &default, &roomy, "base", 32, 0),
        ];
        for (name, policy, spec, rung, micro, skips) in cases {
            let (state, notices) = first_fit(policy, &LadderState::new(spec.clone(), "base".into(), -1));
            assert_eq!((state.rung_name.as_str(), state.spec.train.micro_batch), (rung, micro), "{name}");
            assert_eq!(notices.iter().filter(|n| n.0 == "skip").count(), skips, "{name}: {notices:?}");
            if skips > 0 {
                assert!(notices[0].1.starts_with("rung base skipped: predicted "), "{notices:?}");
                let e = estimate::estimate_job(&state.spec);
                assert!(e.peak_allocated as f64 <= 0.95 * (12 << 20) as f64, "{name}: the chosen one fits");
            }
        }

        // A scaled-down copy of the XL case: 8 layers, T 512 on 16 MiB. Every micro-batch
        // without checkpointing is ruled out (micro-batch 1 in bf16: 17.22 MiB allocated); with
        // full checkpointing the micro-batch goes back up to the largest predicted to fit (2:
        // 14.25 MiB; 4 would be 21.64 MiB).
        let mut long = demo.clone();
        long.model.block_size = 512;
        long.model.n_layer = 8;
        long.device.device_memory = Some(crate::config::Bytes::from("16MiB".to_string()));
        let (state, notices) = first_fit(&default, &LadderState::new(long.clone(), "base".into(), -1));
        assert_eq!(state.rung_name, "checkpointing", "{notices:?}");
        let micro = state.spec.train.micro_batch;
        assert!(micro > 1, "{notices:?}");
        let limit = (0.95 * (16 << 20) as f64) as usize;
        let at = |m: i64| {
            let mut s = state.spec.clone();
            s.train.micro_batch = m;
            estimate::estimate_job(&s).peak_allocated
        };
        assert!(at(micro) <= limit && at(micro * 2) > limit, "micro {micro}: the largest that fits");
        assert!(notices.last().unwrap().1.starts_with("micro_batch 1 → "), "{notices:?}");
        let predicted = notices.iter().filter(|n| n.0 == "skip" && n.1.contains("predicted")).count();
        assert_eq!(predicted, 7, "base, bf16, five halvings: {notices:?}");
        // Reached by a step-down (an OOM on micro-batch 1 without checkpointing), the same.
        let stepped = LadderState { rung_name: "checkpointing".into(), rung_index: 2, ..state.clone() };
        let stepped = LadderState {
            spec: JobSpec {
                train: crate::config::TrainSpec { micro_batch: 1, ..long.train.clone() },
                ..state.spec.clone()
            },
            before_rung: Some(long.clone()),
            ..stepped
        };
        assert_eq!(first_fit(&default, &stepped).0.spec.train.micro_batch, micro);
        // A retry (or a resumed job) keeps its micro-batch.
        let retried = LadderState { crashes: 1, ..stepped.clone() };
        assert_eq!(first_fit(&default, &retried).0.spec.train.micro_batch, 1);
    }

    #[test]
    fn a_step_down_records_skips_then_itself_and_resets_the_crash_count() {
        let policy = policy("", 2);
        let state = LadderState { crashes: 2, ..state_after(&policy, 4) };
        assert_eq!(state.spec.train.micro_batch, 1);
        let action = decide(&policy, &state, &oom());
        let events = action.events(&state);
        let kinds: Vec<_> = events.iter().map(|e| e.0).collect();
        assert_eq!(kinds, ["skip", "skip", "step_down"], "{events:?}");
        assert!(events[0].1.contains("rung halve skipped: micro_batch is already 1"), "{events:?}");
        assert!(events[1].1.contains("rung zero-2 skipped: zero_stage 2 needs world_size > 1"), "{events:?}");
        assert!(events[2].1.starts_with("stepping down to rung offload-optimizer (offload "), "{events:?}");
        let next = action.next_state(&state);
        assert_eq!((next.rung_index, next.crashes, next.before_rung.as_ref()), (3, 0, Some(&state.spec)));
        assert_eq!(action.job_status(), "running");
    }

    #[test]
    fn stepping_back_applies_the_next_rung_to_the_configuration_before_the_swap_bound_one() {
        let policy = policy(STEP_BACK, 2);
        let state = state_after(&policy, 5); // offload-optimizer on micro-batch 1
        assert_eq!(state.rung_name, "offload-optimizer");
        let two_rungs = Policy::parse(&format!(
            "name: p\nrungs:\n  - {{ name: offload-optimizer, set: {{ offload: {{ optimizer: cpu }} }} }}\n  \
             - {{ name: checkpointing, set: {{ checkpointing: full }} }}\n{STEP_BACK}"
        ))
        .unwrap();
        let first = decide(&two_rungs, &LadderState::new(spec(8), "base".into(), -1), &oom());
        let on_offload = first.next_state(&LadderState::new(spec(8), "base".into(), -1));
        let back = decide(&two_rungs, &on_offload, &Outcome::SwapBound { reason: "80%".into() });
        let Action::StepDown { from, step_back: Some(msg), down } = &back else { panic!("{back:?}") };
        assert_eq!(**from, spec(8), "back to the configuration before the offload rung");
        assert_eq!(down.rung_name, "checkpointing");
        assert_eq!(down.spec.memory.offload.optimizer, crate::config::OffloadTarget::None, "offload undone");
        assert!(msg.contains("backing off"), "{msg}");
        assert_eq!(back.events(&on_offload)[0].0, "swap_bound");
        // On the default-like policy the rung after offload-optimizer does not exist: fail, but
        // still record that it stepped back.
        let fail = decide(&policy, &state, &Outcome::SwapBound { reason: "80%".into() });
        let kinds: Vec<_> = fail.events(&state).iter().map(|e| e.0).collect();
        assert_eq!(kinds.first(), Some(&"swap_bound"), "{kinds:?}");
        assert_eq!(kinds.last(), Some(&"failed"), "{kinds:?}");
    }
}
