//! The planner: before an attempt, every configuration the policy allows from where the job
//! stands — its rungs applied cumulatively in ladder order, each with the micro-batch free
//! between 1 and the sequences per rank — with its predicted allocated peak and step time,
//! which fit the device within the margin, and which one runs (`strategy: fastest_fit`: the
//! fastest that fits). Also what the database's history teaches: the margin (measured over
//! predicted peaks) and the speed calibration (measured over predicted tokens/s). Pure.

use serde::{Deserialize, Serialize};

use crate::config::{serde_name, JobSpec, OffloadTarget};
use crate::engine::estimate::{estimate_job, step_time_job};
use crate::memory::format_bytes;

use super::ladder::{describe_change, LadderState};
use super::outcome::Notice;
use super::policy::{self, LadderPosition, Policy, Strategy};

/// The margin when neither the policy nor any history sets one: predicted peaks are planned
/// to stay 3% under the preempt threshold.
pub const DEFAULT_MARGIN: f64 = 0.03;
/// The learned margin is the worst measured/predicted ratio seen, plus this, within
/// [0, [`MAX_MARGIN`]].
pub const MARGIN_SLACK: f64 = 0.01;
pub const MAX_MARGIN: f64 = 0.5;
/// Predicted step rates this close (a fraction of the best) count as a tie, which the earlier
/// rung wins: the step-time model is not finer than that.
pub const CLOSE_ENOUGH: f64 = 0.05;
/// Attempts of the device's history the calibration reads (newest first).
pub const HISTORY: i64 = 200;

/// One finished attempt as the history records it: what was predicted, what was measured.
#[derive(Debug, Clone, PartialEq)]
pub struct Observed {
    pub predicted_allocated: i64,
    /// The attempt's measured allocated peak; for an OOM, the peak plus the request that
    /// failed (what it needed at least).
    pub measured_allocated: Option<i64>,
    pub predicted_tokens_per_s: Option<f64>,
    pub measured_tokens_per_s: Option<f64>,
}

/// How the planner turns predictions into decisions on one device kind.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Calibration {
    /// A configuration fits when `predicted allocated × (1 + margin) ≤ preempt × capacity`.
    pub margin: f64,
    /// Where the margin comes from ("policy", "learned from 12 attempts on cpu: worst measured/
    /// predicted peak 1.004", "default: no history on cuda").
    pub margin_from: String,
    /// Predicted tokens/s are multiplied by this (measured/predicted on the device, median).
    pub speed_scale: f64,
    pub speed_from: String,
    /// Attempts the speed scale is the median of (0: device defaults).
    #[serde(default)]
    pub speed_samples: usize,
}

impl Calibration {
    /// No history: the policy's margin or the default, device constants as they are.
    pub fn uncalibrated(policy: &Policy, device: &str) -> Calibration {
        learn(policy, device, &[])
    }
}

/// The calibration a device's history gives (`history`: its newest attempts with predictions).
pub fn learn(policy: &Policy, device: &str, history: &[Observed]) -> Calibration {
    let ratios: Vec<f64> = history
        .iter()
        .filter(|o| o.predicted_allocated > 0)
        .filter_map(|o| o.measured_allocated.map(|m| m as f64 / o.predicted_allocated as f64))
        .filter(|r| r.is_finite() && *r > 0.0)
        .collect();
    let (margin, margin_from) = match policy.margin {
        Some(m) => (m, "policy".to_string()),
        None if ratios.is_empty() => (DEFAULT_MARGIN, format!("default: no measured peaks on {device} yet")),
        None => {
            let worst = ratios.iter().cloned().fold(f64::MIN, f64::max);
            (
                (worst - 1.0 + MARGIN_SLACK).clamp(0.0, MAX_MARGIN),
                format!("learned from {} attempts on {device}: worst measured/predicted peak {worst:.3}", ratios.len()),
            )
        }
    };
    let mut speeds: Vec<f64> = history
        .iter()
        .filter_map(|o| Some(o.measured_tokens_per_s? / o.predicted_tokens_per_s?))
        .filter(|r| r.is_finite() && *r > 0.0)
        .collect();
    speeds.sort_by(f64::total_cmp);
    let (speed_scale, speed_from) = match speeds.len() {
        0 => (1.0, format!("device defaults: no measured throughput on {device} yet")),
        n => {
            let median = if n % 2 == 1 { speeds[n / 2] } else { (speeds[n / 2 - 1] + speeds[n / 2]) / 2.0 };
            (median, format!("median measured/predicted tokens/s of {n} attempts on {device}"))
        }
    };
    Calibration { margin, margin_from, speed_scale, speed_from, speed_samples: speeds.len() }
}

/// An attempt is re-planned when its measured tokens/s stays under this share of the plan's
/// prediction — only once the device's calibration rests on this many attempts (before that
/// the prediction is the uncalibrated model's, not a promise), and at most
/// [`MAX_SLOW_REPLANS`] times per job.
pub const SLOW_FRACTION: f64 = 0.5;
pub const SLOW_MIN_SAMPLES: usize = 3;
pub const MAX_SLOW_REPLANS: usize = 2;

/// The tokens/s below which an attempt planned at `predicted` counts as far too slow, when the
/// calibration is trustworthy and the job has re-planned for slowness fewer than
/// [`MAX_SLOW_REPLANS`] times.
pub fn slow_floor(calibration: &Calibration, predicted: f64, excluded: &Excluded) -> Option<f64> {
    (calibration.speed_samples >= SLOW_MIN_SAMPLES && excluded.slow.len() < MAX_SLOW_REPLANS && predicted > 0.0)
        .then_some(predicted * SLOW_FRACTION)
}

/// Why a candidate is or is not the one that runs.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    Chosen,
    /// Predicted to fit, not chosen.
    Fits,
    /// Predicted not to fit: its allocated peak above the limit, or its live set not placeable
    /// in the pool's segments within the capacity (the estimator's reserved allowance).
    TooBig,
    /// This configuration, or the same one with a smaller micro-batch, already ran out of
    /// memory (or was preempted for it) in this job.
    FailedBefore,
    /// This configuration ran far below its predicted throughput in this job.
    Slow,
}

/// One configuration the plan considered.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Candidate {
    pub rung: String,
    pub rung_index: i64,
    pub micro_batch: i64,
    pub grad_accum: usize,
    /// The memory knobs in words ("bf16, checkpointing full, offload optimizer").
    pub knobs: String,
    pub predicted_allocated: usize,
    pub predicted_tokens_per_s: f64,
    pub verdict: Verdict,
    #[serde(skip)]
    pub spec: Option<JobSpec>,
}

/// Memory other processes hold on the job's GPU (NVML; a simulated GPU in tests).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub struct Others {
    pub bytes: u64,
    /// The GPU's total.
    pub total: u64,
}

/// How many times a job steps back up when other processes give memory back.
pub const MAX_STEP_UPS: u32 = 3;

/// The plan of one attempt: what was considered and what runs.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Plan {
    pub strategy: Strategy,
    pub capacity: usize,
    /// What other processes held when it was planned (the limit leaves it to them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub others: Option<Others>,
    /// `preempt × capacity / (1 + margin)`: the predicted allocated peak a configuration may have.
    pub limit: usize,
    pub calibration: Calibration,
    pub candidates: Vec<Candidate>,
    /// Index into `candidates`; None when nothing is predicted to fit.
    pub chosen: Option<usize>,
}

impl Plan {
    pub fn chosen(&self) -> Option<&Candidate> {
        self.chosen.map(|i| &self.candidates[i])
    }

    /// Mark the candidate whose configuration is `spec` as the one that runs (what `first_fit`
    /// or the ladder picked, for the record).
    pub fn mark_chosen(&mut self, spec: &JobSpec) {
        self.chosen = None;
        for (i, c) in self.candidates.iter_mut().enumerate() {
            if c.verdict == Verdict::Chosen {
                c.verdict = Verdict::Fits;
            }
            if c.spec.as_ref() == Some(spec) && self.chosen.is_none() {
                c.verdict = Verdict::Chosen;
                self.chosen = Some(i);
            }
        }
    }

    /// The plan as a table (for `headroom estimate --plan` and `headroom show`).
    pub fn table(&self) -> String {
        let mut out = format!(
            "{:<22} {:>5} {:>5} {:<40} {:>12} {:>12}  {}\n",
            "rung", "micro", "accum", "knobs", "allocated", "tokens/s", "verdict"
        );
        for c in &self.candidates {
            out.push_str(&format!(
                "{:<22} {:>5} {:>5} {:<40} {:>12} {:>12.0}  {}\n",
                c.rung,
                c.micro_batch,
                c.grad_accum,
                c.knobs,
                format_bytes(c.predicted_allocated),
                c.predicted_tokens_per_s,
                serde_name(&c.verdict)
            ));
        }
        let others = self.others.map_or(String::new(), |o| {
            format!(
                ", other processes holding {} of {}",
                format_bytes(o.bytes as usize),
                format_bytes(o.total as usize)
            )
        });
        out.push_str(&format!(
            "limit {} ({} capacity{others}; margin {:.1}%: {}); tokens/s × {:.3} ({})\n",
            format_bytes(self.limit),
            format_bytes(self.capacity),
            self.calibration.margin * 100.0,
            self.calibration.margin_from,
            self.calibration.speed_scale,
            self.calibration.speed_from
        ));
        out
    }
}

/// "bf16, checkpointing full, zero 1, offload optimizer+params".
pub fn describe_knobs(spec: &JobSpec) -> String {
    let m = &spec.memory;
    let mut parts = vec![serde_name(&m.precision)];
    if m.checkpointing != crate::config::Checkpointing::None {
        parts.push(format!("checkpointing {}", serde_name(&m.checkpointing)));
    }
    if m.tensor_parallel > 1 {
        parts.push(format!("tensor parallel {}", m.tensor_parallel));
    }
    if m.pipeline_parallel > 1 {
        parts.push(format!("{} pipeline stages", m.pipeline_parallel));
    }
    if m.zero_stage > 0 {
        parts.push(format!("zero {}", m.zero_stage));
    }
    let off: Vec<String> =
        [("optimizer", m.offload.optimizer), ("params", m.offload.params), ("activations", m.offload.activations)]
            .iter()
            .filter(|(_, t)| *t != OffloadTarget::None)
            .map(|(n, t)| if *t == OffloadTarget::Cpu { n.to_string() } else { format!("{n} ({})", serde_name(t)) })
            .collect();
    if !off.is_empty() {
        parts.push(format!("offload {}", off.join("+")));
    }
    if m.allocator == crate::config::Allocator::Static {
        parts.push("static allocator".into());
    }
    parts.join(", ")
}

/// What a job's attempts ruled out for its later plans.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Excluded {
    /// Ran out of memory, or were preempted for their own memory: these memory knobs at this
    /// micro-batch or a larger one.
    pub failed: Vec<JobSpec>,
    /// Ran far below their predicted throughput: exactly these configurations.
    pub slow: Vec<JobSpec>,
}

impl Excluded {
    fn verdict(&self, candidate: &JobSpec) -> Option<Verdict> {
        if self
            .failed
            .iter()
            .any(|f| f.memory == candidate.memory && candidate.train.micro_batch >= f.train.micro_batch)
        {
            return Some(Verdict::FailedBefore);
        }
        self.slow.iter().any(|s| s == candidate).then_some(Verdict::Slow)
    }
}

/// The configurations the policy allows from `state`, in ladder order: the current rung's and
/// each later one's (cumulatively applied), deduplicated by memory knobs, each paired with its
/// ladder position.
fn levels(policy: &Policy, state: &LadderState) -> Vec<(String, i64, JobSpec)> {
    let mut out: Vec<(String, i64, JobSpec)> = vec![(state.rung_name.clone(), state.rung_index, state.spec.clone())];
    let mut at = (state.rung_index, state.spec.clone());
    while let Ok(down) = policy::step_down(policy, &at.1, LadderPosition { rung_index: at.0 }) {
        if !out.iter().any(|(_, _, s)| s.memory == down.spec.memory) {
            out.push((down.rung_name.clone(), down.rung_index, down.spec.clone()));
        }
        at = (down.rung_index, down.spec);
    }
    out
}

/// Every candidate with its predictions, and the choice under `policy.strategy`
/// (`fastest_fit`: the highest predicted tokens/s among those that fit — on the earliest rung
/// whose best is within [`CLOSE_ENOUGH`] of it; other strategies: left for the caller to mark). None when the capacity is unknown
/// (cuda with no `device_memory`).
pub fn plan(
    policy: &Policy,
    state: &LadderState,
    excluded: &Excluded,
    calibration: &Calibration,
    others: Option<Others>,
) -> Option<Plan> {
    let capacity = state.spec.device_capacity()?;
    // The monitor's line: allocated under `preempt × capacity`, and allocated plus what other
    // processes hold under `preempt × total`.
    let preempt = policy.thresholds.preempt;
    let line = others.map_or(capacity as f64 * preempt, |o| {
        (capacity as f64 * preempt).min(o.total as f64 * preempt - o.bytes as f64).max(0.0)
    });
    let limit = (line / (1.0 + calibration.margin)) as usize;
    let mut candidates = Vec::new();
    for (rung, rung_index, spec) in levels(policy, state) {
        let per_rank = spec.train.global_batch / spec.data_parallel();
        for micro in (1..=per_rank).filter(|m| per_rank % m == 0) {
            let mut s = spec.clone();
            s.train.micro_batch = micro;
            if s.validate().is_err() {
                continue;
            }
            let e = estimate_job(&s);
            let t = step_time_job(&s);
            let verdict = if let Some(v) = excluded.verdict(&s) {
                v
            } else if e.peak_allocated <= limit && e.reserved_allowance <= capacity {
                Verdict::Fits
            } else {
                Verdict::TooBig
            };
            candidates.push(Candidate {
                rung: rung.clone(),
                rung_index,
                micro_batch: micro,
                grad_accum: s.grad_accum(),
                knobs: describe_knobs(&s),
                predicted_allocated: e.peak_allocated,
                predicted_tokens_per_s: t.tokens_per_s * calibration.speed_scale,
                verdict,
                spec: Some(s),
            });
        }
    }
    let mut plan = Plan {
        strategy: policy.strategy,
        capacity,
        others,
        limit,
        calibration: calibration.clone(),
        candidates,
        chosen: None,
    };
    if policy.strategy == Strategy::FastestFit {
        let fitting = || plan.candidates.iter().enumerate().filter(|(_, c)| c.verdict == Verdict::Fits);
        let best = fitting().map(|(_, c)| c.predicted_tokens_per_s).fold(0.0, f64::max);
        // The earliest rung whose fastest fitting configuration is within the model's
        // resolution of the best: fewer techniques in play for a prediction that close.
        let earliest =
            fitting().find(|(_, c)| c.predicted_tokens_per_s >= best * (1.0 - CLOSE_ENOUGH)).map(|(_, c)| c.rung_index);
        let chosen = fitting()
            .filter(|(_, c)| Some(c.rung_index) == earliest)
            .max_by(|a, b| a.1.predicted_tokens_per_s.total_cmp(&b.1.predicted_tokens_per_s))
            .map(|(i, _)| i);
        if let Some(b) = chosen {
            plan.candidates[b].verdict = Verdict::Chosen;
            plan.chosen = Some(b);
        }
    }
    Some(plan)
}

/// The state the chosen candidate puts the job in, and the events that say why: a `skip` for
/// every rung passed over (none of its configurations fit, or its fastest fitting one is
/// slower), and a `plan` naming the choice with its figures. `None` when nothing fits (the
/// attempt then runs as the ladder stands and its OOM decides).
pub fn apply(plan: &Plan, state: &LadderState) -> Option<(LadderState, Vec<Notice>)> {
    let chosen = plan.chosen()?;
    let spec = chosen.spec.clone()?;
    let mut notices = Vec::new();
    let chosen_tps = chosen.predicted_tokens_per_s;
    let mut seen: Vec<i64> = Vec::new();
    for c in &plan.candidates {
        if c.rung_index == chosen.rung_index {
            break;
        }
        if seen.contains(&c.rung_index) {
            continue;
        }
        seen.push(c.rung_index);
        let level: Vec<&Candidate> = plan.candidates.iter().filter(|x| x.rung_index == c.rung_index).collect();
        let fitting = level
            .iter()
            .filter(|x| x.verdict == Verdict::Fits)
            .max_by(|a, b| a.predicted_tokens_per_s.total_cmp(&b.predicted_tokens_per_s));
        let smallest = level.iter().min_by_key(|x| x.predicted_allocated).expect("a level has candidates");
        let why = match fitting {
            Some(f) => format!(
                "its fastest fitting configuration (micro_batch {}) is predicted at {:.0} tokens/s, below {:.0}",
                f.micro_batch, f.predicted_tokens_per_s, chosen_tps
            ),
            None if level.iter().all(|x| matches!(x.verdict, Verdict::FailedBefore | Verdict::Slow)) => {
                "it ran out of memory (or ran slow) before in this job".to_string()
            }
            None => format!(
                "predicted {} allocated even at micro_batch {} > {} (preempt threshold less the {:.1}% margin, of {} capacity)",
                format_bytes(smallest.predicted_allocated),
                smallest.micro_batch,
                format_bytes(plan.limit),
                plan.calibration.margin * 100.0,
                format_bytes(plan.capacity)
            ),
        };
        notices.push(("skip", format!("rung {} skipped: {why}", c.rung)));
    }
    let fits = plan.candidates.iter().filter(|c| matches!(c.verdict, Verdict::Fits | Verdict::Chosen)).count();
    let change = if spec == state.spec {
        "the configuration as it stands".to_string()
    } else {
        format!("rung {} ({})", chosen.rung, describe_change(&state.spec, &spec))
    };
    notices.push((
        "plan",
        format!(
            "fastest fit: {change} — micro_batch {} × {}, {}: predicted {:.0} tokens/s, {} allocated of {} allowed; \
             {fits} of {} configurations predicted to fit",
            chosen.micro_batch,
            chosen.grad_accum,
            chosen.knobs,
            chosen_tps,
            format_bytes(chosen.predicted_allocated),
            format_bytes(plan.limit),
            plan.candidates.len()
        ),
    ));
    // Undoing the chosen rung (a swap-bound step back) returns to the level before it at the
    // same micro-batch.
    let before_rung = if chosen.rung_index == state.rung_index {
        state.before_rung.clone()
    } else {
        seen.last().and_then(|&r| {
            plan.candidates
                .iter()
                .find(|x| x.rung_index == r && x.micro_batch == chosen.micro_batch)
                .and_then(|x| x.spec.clone())
        })
    };
    let next = LadderState {
        spec: spec.clone(),
        rung_name: chosen.rung.clone(),
        rung_index: chosen.rung_index,
        crashes: if spec == state.spec { state.crashes } else { 0 },
        before_rung,
    };
    Some((next, notices))
}

/// Stepping back up: a job that stepped down because other processes took memory (`from`: where
/// it stood before) and now runs `current`; they hold `others` now. The fastest configuration
/// planned from `from` with what they hold now, when it is predicted faster than `current` by
/// more than [`CLOSE_ENOUGH`] (hysteresis: a move costs a restart), with the reason.
pub fn step_up(
    policy: &Policy,
    from: &LadderState,
    current: &LadderState,
    excluded: &Excluded,
    calibration: &Calibration,
    others: Others,
) -> Option<(LadderState, String)> {
    let fastest = Policy { strategy: Strategy::FastestFit, ..policy.clone() };
    let plan = plan(&fastest, from, excluded, calibration, Some(others))?;
    let (target, _) = apply(&plan, from)?;
    let chosen = plan.chosen()?;
    let now = step_time_job(&current.spec).tokens_per_s * calibration.speed_scale;
    if target.spec == current.spec || chosen.predicted_tokens_per_s <= now * (1.0 + CLOSE_ENOUGH) {
        return None;
    }
    let reason = format!(
        "other processes now hold {} of {}: stepping back up to rung {} ({}) — predicted {:.0} tokens/s, was {:.0}",
        format_bytes(others.bytes as usize),
        format_bytes(others.total as usize),
        target.rung_name,
        describe_change(&current.spec, &target.spec),
        chosen.predicted_tokens_per_s,
        now
    );
    Some((target, reason))
}

/// Under `fastest_fit`, after an attempt ran out of memory or was preempted: whether planning
/// again from where the job stands (`excluded` now holding that configuration, or `others` what
/// other processes took) finds a configuration that fits — then the job re-plans instead of
/// taking the ladder's next rung — with the message that says so.
pub fn replan_after(
    policy: &Policy,
    state: &LadderState,
    excluded: &Excluded,
    calibration: &Calibration,
    others: Option<Others>,
) -> Option<String> {
    if policy.strategy != Strategy::FastestFit {
        return None;
    }
    let plan = plan(policy, state, excluded, calibration, others)?;
    let chosen = plan.chosen()?;
    let why = match others {
        Some(o) => {
            format!("other processes hold {} of {}", format_bytes(o.bytes as usize), format_bytes(o.total as usize))
        }
        None => "without the configurations that failed or ran slow".to_string(),
    };
    Some(format!(
        "re-planning from rung {} {why}: the fastest that fits is micro_batch {} × {} on rung {} ({})",
        state.rung_name, chosen.micro_batch, chosen.grad_accum, chosen.rung, chosen.knobs
    ))
}

/// A finished job of the same policy a new job may start from.
#[derive(Debug, Clone)]
pub struct Finished {
    pub id: i64,
    /// As it was submitted, and as it finished.
    pub submitted: JobSpec,
    pub last: JobSpec,
    pub rung_name: String,
    pub rung_index: i64,
}

/// Warm start: a job whose model shape, memory options, global batch and device match a job
/// that finished (newest first in `finished`) starts from that job's final configuration —
/// its memory knobs and micro-batch on the new job's other settings — with the reason.
pub fn warm_start(spec: &JobSpec, finished: &[Finished]) -> Option<(LadderState, Notice)> {
    let same = |f: &Finished| {
        f.submitted.model == spec.model
            && f.submitted.train.global_batch == spec.train.global_batch
            && f.submitted.train.micro_batch == spec.train.micro_batch
            && f.submitted.memory == spec.memory
            && f.submitted.device == spec.device
    };
    let f = finished.iter().find(|f| same(f))?;
    let mut start = spec.clone();
    start.memory = f.last.memory.clone();
    start.train.micro_batch = f.last.train.micro_batch;
    start.validate().ok()?;
    if start == *spec {
        return None;
    }
    let message = format!(
        "warm start from job {}: it finished with the same model, global batch, memory options and device on rung {} \
         ({}); starting there ({})",
        f.id,
        f.rung_name,
        describe_knobs(&f.last),
        describe_change(spec, &start)
    );
    let state = LadderState::new(start, f.rung_name.clone(), f.rung_index);
    Some((LadderState { before_rung: None, ..state }, ("warm_start", message)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Bytes, Checkpointing, DeviceKind, Precision};

    fn default_policy() -> Policy {
        Policy::parse(include_str!("../../policies/default.yaml")).unwrap()
    }

    fn demo(device_memory: &str) -> JobSpec {
        let mut s = JobSpec::parse(include_str!("../../data/demo-job.yaml")).unwrap();
        s.device.device_memory = Some(Bytes::from(device_memory.to_string()));
        s
    }

    fn base(spec: &JobSpec) -> LadderState {
        LadderState::new(spec.clone(), "base".into(), -1)
    }

    fn fastest_fitting(plan: &Plan) -> f64 {
        plan.candidates
            .iter()
            .filter(|c| matches!(c.verdict, Verdict::Fits | Verdict::Chosen))
            .map(|c| c.predicted_tokens_per_s)
            .fold(0.0, f64::max)
    }

    /// A job whose live peak fits but whose cached segments would not: a rung that turns the
    /// static allocator on (reserved = allocated) is the plan's way through, at the job's own
    /// micro-batch — where without that rung the micro-batch has to shrink.
    #[test]
    fn a_static_allocator_rung_fits_what_segment_rounding_would_not() {
        let with_static = Policy::parse(
            "name: s\nthresholds: { warn: 0.9, preempt: 1.0, sustain: 3 }\nmargin: 0\nrungs:\n  \
             - { name: static-allocator, set: { allocator: static } }\n  \
             - { name: halve-micro-batch, set: { micro_batch: half }, repeat: true }",
        )
        .unwrap();
        let mut spec = demo("12MiB");
        // Capacity between the live peak and the caching allocator's segments at micro-batch 32.
        let e = estimate_job(&spec);
        assert!(e.reserved_allowance > e.peak_allocated, "caching rounds segments up");
        let mid = (e.peak_allocated + e.reserved_allowance) / 2;
        spec.device.device_memory = Some(Bytes::from(format!("{mid}")));
        let cal = Calibration::uncalibrated(&with_static, "cpu");
        let p = plan(&with_static, &base(&spec), &Excluded::default(), &cal, None).unwrap();
        let verdict = |rung: &str, micro: i64| {
            p.candidates.iter().find(|c| c.rung == rung && c.micro_batch == micro).map(|c| c.verdict)
        };
        assert_eq!(verdict("base", 32), Some(Verdict::TooBig), "{}", p.table());
        assert!(matches!(verdict("static-allocator", 32), Some(Verdict::Fits | Verdict::Chosen)), "{}", p.table());
        let static_32 = p.candidates.iter().find(|c| c.rung == "static-allocator" && c.micro_batch == 32).unwrap();
        assert_eq!(static_32.knobs, "fp32, static allocator");
        // The choice: the fastest that fits, or an earlier rung's within 5% of it (the rule).
        let chosen = p.chosen().unwrap_or_else(|| panic!("{}", p.table()));
        assert!(
            chosen.predicted_tokens_per_s >= static_32.predicted_tokens_per_s * (1.0 - CLOSE_ENOUGH),
            "{}",
            p.table()
        );
    }

    /// Two ranks whose replicated state does not fit: the plan's way through is the
    /// tensor-parallel rung, each rank holding its half of the blocks, with the micro-batch
    /// free up to every sequence of the step (one data-parallel rank left).
    #[test]
    fn a_tensor_parallel_level_is_planned_with_its_data_parallel_micro_batches() {
        let policy = Policy::parse(
            "name: tp\nthresholds: { warn: 0.9, preempt: 1.0, sustain: 3 }\nmargin: 0\nrungs:\n  \
             - { name: tp-2, set: { tensor_parallel: 2 } }",
        )
        .unwrap();
        let spec = JobSpec::parse(
            "name: tp\nmodel: { n_layer: 4, n_head: 4, n_embd: 128, block_size: 32, vocab: bytes }\n\
             data: { path: x.txt }\ntrain: { steps: 8, global_batch: 4, micro_batch: 2 }\n\
             memory: { world_size: 2 }\ndevice: { kind: cpu, device_memory: 14MiB }\n",
        )
        .unwrap();
        let cal = Calibration::uncalibrated(&policy, "cpu");
        let p = plan(&policy, &base(&spec), &Excluded::default(), &cal, None).unwrap();
        let micros = |rung: &str| -> Vec<i64> {
            p.candidates.iter().filter(|c| c.rung == rung).map(|c| c.micro_batch).collect()
        };
        assert_eq!(micros("base"), [1, 2], "two data-parallel ranks: 2 sequences each\n{}", p.table());
        assert_eq!(micros("tp-2"), [1, 2, 4], "one data-parallel rank: all 4 sequences\n{}", p.table());
        assert!(
            p.candidates.iter().filter(|c| c.rung == "base").all(|c| c.verdict == Verdict::TooBig),
            "{}",
            p.table()
        );
        let chosen = p.chosen().unwrap_or_else(|| panic!("{}", p.table()));
        assert_eq!((chosen.rung.as_str(), chosen.knobs.as_str()), ("tp-2", "fp32, tensor parallel 2"), "{}", p.table());
    }

    #[test]
    fn fastest_fit_runs_the_fastest_configuration_predicted_to_fit() {
        let policy = default_policy();
        let cal = Calibration::uncalibrated(&policy, "cpu");
        // (case, device memory, expected knobs of the choice)
        let cases = [
            ("roomy: the job as submitted", "256MiB", "fp32"),
            ("12 MiB: fp32 still fits at a smaller micro-batch, faster on cpu than bf16", "12MiB", "fp32"),
            ("2.5 MiB: only with a host optimizer", "2560KiB", "bf16, checkpointing full, offload optimizer"),
        ];
        for (name, mem, knobs) in cases {
            let spec = demo(mem);
            let plan = plan(&policy, &base(&spec), &Excluded::default(), &cal, None).unwrap();
            let chosen = plan.chosen().unwrap_or_else(|| panic!("{name}: nothing chosen\n{}", plan.table()));
            assert_eq!(chosen.knobs, knobs, "{name}\n{}", plan.table());
            let best = fastest_fitting(&plan);
            assert!(chosen.predicted_tokens_per_s >= best * (1.0 - CLOSE_ENOUGH), "{name}");
            for c in &plan.candidates {
                let e = estimate_job(c.spec.as_ref().unwrap());
                let fits = c.predicted_allocated <= plan.limit && e.reserved_allowance <= plan.capacity;
                assert_eq!(fits, c.verdict != Verdict::TooBig, "{name}: {c:?}");
            }
            // On its level, the largest micro-batch that fits (the model prefers larger ones).
            let level_max = plan
                .candidates
                .iter()
                .filter(|c| c.rung_index == chosen.rung_index && c.verdict != Verdict::TooBig)
                .map(|c| c.micro_batch)
                .max();
            assert_eq!(Some(chosen.micro_batch), level_max, "{name}\n{}", plan.table());
        }
    }

    #[test]
    fn the_scaled_down_xl_case_starts_on_a_fitting_configuration_at_its_largest_micro_batch() {
        // 8 layers, T 512 on 18 MiB: nothing without checkpointing fits at any micro-batch, so
        // base, bf16 and the halvings are skipped; the choice is checkpointed with the largest
        // micro-batch predicted to fit there.
        let policy = default_policy();
        let mut spec = demo("18MiB");
        spec.model.block_size = 512;
        spec.model.n_layer = 8;
        let state = base(&spec);
        let plan =
            plan(&policy, &state, &Excluded::default(), &Calibration::uncalibrated(&policy, "cpu"), None).unwrap();
        let chosen = plan.chosen().unwrap().clone();
        assert_eq!(chosen.rung, "checkpointing", "{}", plan.table());
        let raised = |m: i64| {
            let mut s = chosen.spec.clone().unwrap();
            s.train.micro_batch = m;
            estimate_job(&s).peak_allocated
        };
        assert!(chosen.micro_batch > 1 && raised(chosen.micro_batch * 2) > plan.limit, "{}", plan.table());
        let (next, notices) = apply(&plan, &state).unwrap();
        assert_eq!((next.rung_name.as_str(), next.spec.memory.checkpointing), ("checkpointing", Checkpointing::Full));
        let kinds: Vec<&str> = notices.iter().map(|n| n.0).collect();
        // halve-micro-batch changes no memory knob: with the micro-batch free it is bf16's level.
        assert_eq!(kinds, ["skip", "skip", "plan"], "base, bf16: {notices:?}");
        assert!(notices[0].1.starts_with("rung base skipped: predicted "), "{notices:?}");
        assert!(notices[2].1.starts_with("fastest fit: rung checkpointing ("), "{notices:?}");
        assert_eq!(next.before_rung.as_ref().map(|s| s.memory.precision), Some(Precision::Bf16));
    }

    #[test]
    fn what_failed_is_not_planned_again_and_nothing_fitting_changes_nothing() {
        let policy = default_policy();
        let cal = Calibration::uncalibrated(&policy, "cpu");
        let spec = demo("12MiB");
        let first = plan(&policy, &base(&spec), &Excluded::default(), &cal, None).unwrap();
        let chosen = first.chosen().unwrap().spec.clone().unwrap();
        let again =
            plan(&policy, &base(&spec), &Excluded { failed: vec![chosen.clone()], slow: vec![] }, &cal, None).unwrap();
        let next = again.chosen().unwrap();
        assert!(
            next.spec.as_ref().unwrap().memory != chosen.memory || next.micro_batch < chosen.train.micro_batch,
            "{}",
            again.table()
        );
        assert!(again
            .candidates
            .iter()
            .filter(|c| c.spec.as_ref().unwrap().memory == chosen.memory && c.micro_batch >= chosen.train.micro_batch)
            .all(|c| c.verdict == Verdict::FailedBefore));
        // A configuration that ran slow is excluded exactly: the same memory knobs at another
        // micro-batch stay in the plan.
        let slow = Excluded { failed: vec![], slow: vec![chosen.clone()] };
        let p = plan(&policy, &base(&spec), &slow, &cal, None).unwrap();
        let verdicts: Vec<Verdict> = p
            .candidates
            .iter()
            .filter(|c| c.spec.as_ref().unwrap().memory == chosen.memory)
            .map(|c| c.verdict)
            .collect();
        assert_eq!(verdicts.iter().filter(|v| **v == Verdict::Slow).count(), 1, "{}", p.table());
        assert_ne!(p.chosen().unwrap().spec.as_ref(), Some(&chosen));
        // The slow floor only with a calibration resting on enough attempts, and a cap.
        let trusted = Calibration { speed_samples: SLOW_MIN_SAMPLES, ..cal.clone() };
        assert_eq!(slow_floor(&cal, 1000.0, &Excluded::default()), None, "uncalibrated");
        assert_eq!(slow_floor(&trusted, 1000.0, &Excluded::default()), Some(500.0));
        let capped = Excluded { failed: vec![], slow: vec![chosen.clone(); MAX_SLOW_REPLANS] };
        assert_eq!(slow_floor(&trusted, 1000.0, &capped), None, "capped");
        // Nothing fits on 64 KiB: no choice, the ladder stands.
        let tiny = plan(&policy, &base(&demo("64KiB")), &Excluded::default(), &cal, None).unwrap();
        assert_eq!(tiny.chosen, None);
        assert!(apply(&tiny, &base(&demo("64KiB"))).is_none());
        // No known capacity: no plan.
        let mut unbounded = demo("12MiB");
        unbounded.device.kind = DeviceKind::Cuda;
        unbounded.device.device_memory = None;
        assert!(plan(&policy, &base(&unbounded), &Excluded::default(), &cal, None).is_none());
        // Other strategies leave the choice to the caller, who marks it.
        let ladder = Policy { strategy: Strategy::Ladder, ..policy.clone() };
        let mut p = plan(&ladder, &base(&spec), &Excluded::default(), &cal, None).unwrap();
        assert_eq!(p.chosen, None);
        p.mark_chosen(&spec);
        assert_eq!(p.chosen().map(|c| (c.rung.as_str(), c.micro_batch)), Some(("base", 32)));
    }

    #[test]
    fn the_margin_and_speed_are_learned_from_history() {
        let policy = default_policy();
        let o = |pred: i64, meas: Option<i64>, tps: Option<(f64, f64)>| Observed {
            predicted_allocated: pred,
            measured_allocated: meas,
            predicted_tokens_per_s: tps.map(|t| t.0),
            measured_tokens_per_s: tps.map(|t| t.1),
        };
        // (case, policy margin, history, margin, speed scale)
        type Case = (&'static str, Option<f64>, Vec<Observed>, f64, f64);
        let cases: Vec<Case> = vec![
            ("no history", None, vec![], DEFAULT_MARGIN, 1.0),
            ("the policy's margin wins", Some(0.2), vec![o(100, Some(150), None)], 0.2, 1.0),
            ("exact predictions: the slack", None, vec![o(100, Some(100), None), o(200, Some(190), None)], 0.01, 1.0),
            ("the worst ratio", None, vec![o(100, Some(104), None), o(100, Some(110), None)], 0.11, 1.0),
            ("bounded", None, vec![o(100, Some(400), None)], MAX_MARGIN, 1.0),
            ("no measured peak: ignored", None, vec![o(100, None, None)], DEFAULT_MARGIN, 1.0),
            (
                "speed: the median ratio",
                None,
                vec![o(1, None, Some((100.0, 50.0))), o(1, None, Some((100.0, 80.0))), o(1, None, Some((10.0, 90.0)))],
                DEFAULT_MARGIN,
                0.8,
            ),
        ];
        for (name, margin, history, want_margin, want_speed) in cases {
            let p = Policy { margin, ..policy.clone() };
            let c = learn(&p, "cpu", &history);
            assert!((c.margin - want_margin).abs() < 1e-9, "{name}: {c:?}");
            assert!((c.speed_scale - want_speed).abs() < 1e-9, "{name}: {c:?}");
        }
        // A larger margin plans smaller: the 12 MiB demo at 50% margin cannot keep fp32's
        // micro-batch.
        let spec = demo("12MiB");
        let tight = Calibration { margin: 0.5, ..Calibration::uncalibrated(&policy, "cpu") };
        let loose = plan(&policy, &base(&spec), &Excluded::default(), &Calibration::uncalibrated(&policy, "cpu"), None)
            .unwrap();
        let tight = plan(&policy, &base(&spec), &Excluded::default(), &tight, None).unwrap();
        assert!(tight.limit < loose.limit);
        let pick = |p: &Plan| p.chosen().map(|c| (c.knobs.clone(), c.micro_batch));
        assert_ne!(pick(&tight), pick(&loose), "{}\n{}", loose.table(), tight.table());
    }

    #[test]
    fn warm_start_resumes_where_a_matching_finished_job_ended() {
        let spec = demo("12MiB");
        let mut last = spec.clone();
        last.memory.precision = Precision::Bf16;
        last.train.micro_batch = 16;
        let finished = |submitted: JobSpec| Finished {
            id: 7,
            submitted,
            last: last.clone(),
            rung_name: "halve-micro-batch".into(),
            rung_index: 1,
        };
        let (state, (kind, message)) = warm_start(&spec, &[finished(spec.clone())]).unwrap();
        assert_eq!((state.rung_index, state.spec.train.micro_batch), (1, 16));
        assert_eq!(state.spec.memory.precision, Precision::Bf16);
        assert_eq!(state.spec.train.steps, spec.train.steps, "the new job's own settings stay");
        assert_eq!(kind, "warm_start");
        assert!(message.starts_with("warm start from job 7:"), "{message}");
        // (case, how the finished job's submission differs) → no warm start
        type Change = Box<dyn Fn(&mut JobSpec)>;
        let differs: Vec<(&str, Change)> = vec![
            ("model", Box::new(|s| s.model.n_layer = 3)),
            ("global batch", Box::new(|s| s.train.global_batch = 64)),
            ("device", Box::new(|s| s.device.device_memory = Some(Bytes::from("13MiB".to_string())))),
            ("memory options", Box::new(|s| s.memory.checkpointing = Checkpointing::Full)),
        ];
        for (name, change) in differs {
            let mut other = spec.clone();
            change(&mut other);
            assert!(warm_start(&spec, &[finished(other)]).is_none(), "{name}");
        }
    }

    #[test]
    fn other_processes_memory_shrinks_the_plan_and_its_release_steps_back_up() {
        let policy = default_policy();
        let cal = Calibration::uncalibrated(&policy, "cpu");
        let spec = demo("12MiB");
        let total = 12u64 << 20;
        let free = plan(&policy, &base(&spec), &Excluded::default(), &cal, None).unwrap();
        let taken = Others { bytes: 4 << 20, total };
        let squeezed = plan(&policy, &base(&spec), &Excluded::default(), &cal, Some(taken)).unwrap();
        let shrink = (free.limit - squeezed.limit) as f64;
        assert!((shrink - (4u64 << 20) as f64 / (1.0 + cal.margin)).abs() <= 1.0, "{shrink}");
        let (big, small) = (free.chosen().unwrap(), squeezed.chosen().unwrap());
        assert!(small.predicted_allocated <= squeezed.limit && big.predicted_allocated > squeezed.limit);
        let message = replan_after(&policy, &base(&spec), &Excluded::default(), &cal, Some(taken)).unwrap();
        assert!(
            message.starts_with("re-planning from rung base other processes hold 4.00 MiB of 12.00 MiB"),
            "{message}"
        );
        // Running the squeezed choice, from the state before the pressure: back up once they
        // give the memory back, not while they still hold it, and not for a gain within the
        // model's resolution.
        let from = base(&spec);
        let current = apply(&squeezed, &from).unwrap().0;
        let up = step_up(&policy, &from, &current, &Excluded::default(), &cal, Others { bytes: 0, total });
        let (target, reason) = up.expect("steps back up");
        assert_eq!(target.spec, free.chosen().unwrap().spec.clone().unwrap());
        assert!(reason.contains("stepping back up to rung base"), "{reason}");
        assert!(step_up(&policy, &from, &current, &Excluded::default(), &cal, taken).is_none(), "still held");
        let nearly = apply(&free, &from).unwrap().0;
        assert!(
            step_up(&policy, &from, &nearly, &Excluded::default(), &cal, Others { bytes: 0, total }).is_none(),
            "already there"
        );
        // Under the other strategies an OOM takes the ladder's next rung, never a re-plan.
        let ladder = Policy { strategy: Strategy::Ladder, ..policy.clone() };
        assert!(replan_after(&ladder, &base(&spec), &Excluded::default(), &cal, Some(taken)).is_none());
    }
}
