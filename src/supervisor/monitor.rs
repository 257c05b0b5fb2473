//! The monitor: reads one attempt's protocol events, keeps its samples and peaks, and decides
//! when memory pressure (or offload traffic) has lasted long enough to preempt it. Pressure is
//! live memory — the step's allocated bytes, plus on cuda what other processes hold on the GPU
//! (NVML) — never the pool's cache: a full cache with live bytes below the line is answered with
//! `release_cache`, not a preemption. Pure: the runner feeds it events and executes what it asks.

use crate::protocol::{Event, Line};

use super::db::{now, AttemptEnd, SampleRow, OTHERS_MARK};
use super::outcome::{Notice, Outcome, StopReason};
use super::policy::{Policy, Stall};

/// One attempt's view: samples not yet written, peaks, OOM details, and the threshold state.
#[derive(Debug)]
pub struct Monitor {
    attempt: i64,
    warn: f64,
    preempt: f64,
    sustain: u32,
    /// Steps in a row at or above the preempt threshold.
    above: u32,
    /// Steps in a row whose cache (reserved) is above the preempt threshold while live memory
    /// is not; at `sustain` the trainer is asked to release its cache.
    cache_above: u32,
    release_cache_wanted: bool,
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
    finished_at: Option<i64>,
    resumed_from: Option<i64>,
    capacity: Option<i64>,
    peaks: [Option<i64>; 7],
    tokens_per_s: Vec<f64>,
    mean_tokens_per_s: Option<f64>,
    oom_category: Option<String>,
    oom_requested: Option<i64>,
    oom_at: Option<[i64; 6]>,
    oom_message: Option<String>,
    /// What other processes hold on the GPU at the last step, and its total (NVML).
    others: Option<(u64, u64)>,
    /// The preemption was caused by other processes' memory (the attempt's own live bytes
    /// were below the line).
    external: bool,
    /// Watching for other processes' memory to fall to this level: steps in a row at or
    /// below it, and whether `sustain` of them have been seen (once).
    release_level: Option<u64>,
    release_below: u32,
    released: bool,
    step_up_reason: Option<String>,
    /// Tokens/s under which the attempt counts as far slower than planned (armed by the
    /// runner: `planner::slow_floor`), the predicted figure, and the reason once sustained.
    slow_floor: Option<(f64, f64)>,
    slow_reason: Option<String>,
    /// The policy's stall limit, whether the trainer has said `started` (the limit is armed
    /// from then on), the slowest step so far (seconds), and the reason once the trainer was
    /// found stalled.
    stall: Stall,
    started: bool,
    slowest_step_s: f64,
    stall_reason: Option<String>,
}

/// " on rank R" where a step's memory is one of several ranks' (the fullest), else nothing.
fn on_rank(rank: Option<usize>) -> String {
    rank.map_or(String::new(), |r| format!(" on rank {r}"))
}

/// Steps the slowness check looks at (their median), after the attempt's first two.
const SLOW_WINDOW: usize = 5;

impl Monitor {
    pub fn new(policy: &Policy, attempt: i64) -> Monitor {
        let t = &policy.thresholds;
        Monitor {
            attempt,
            warn: t.warn,
            preempt: t.preempt,
            sustain: t.sustain,
            above: 0,
            cache_above: 0,
            release_cache_wanted: false,
            warned: false,
            preempt_sent: false,
            preempt_reason: None,
            swap_limit: policy.swap_bound.as_ref().map(|b| b.transfer_fraction),
            swap_above: 0,
            swap_reason: None,
            samples: Vec::new(),
            first_step: None,
            last_step: None,
            finished_at: None,
            resumed_from: None,
            capacity: None,
            peaks: [None; 7],
            tokens_per_s: Vec::new(),
            mean_tokens_per_s: None,
            oom_category: None,
            oom_requested: None,
            oom_at: None,
            oom_message: None,
            others: None,
            external: false,
            release_level: None,
            release_below: 0,
            released: false,
            step_up_reason: None,
            slow_floor: None,
            slow_reason: None,
            stall: policy.stall.clone(),
            started: false,
            slowest_step_s: 0.0,
            stall_reason: None,
        }
    }

    /// How long the trainer may stay quiet (no protocol line) before it counts as stalled:
    /// the policy's `stall` limit for its slowest step so far — once it has said `started`.
    /// Before that (the device opened, the state allocated, the data tokenised — a large corpus
    /// can take many minutes on a first run — the newest checkpoint read) there is none: a
    /// rendezvous has its own timeout, and the rest makes progress or fails.
    pub fn stall_limit(&self) -> Option<std::time::Duration> {
        self.started.then(|| self.stall.limit(self.slowest_step_s))
    }

    /// The trainer has been quiet for `quiet`: once that reaches the stall limit, the attempt
    /// is stalled — the notice to record (once), after which the runner kills it.
    pub fn stalled(&mut self, quiet: std::time::Duration) -> Option<Notice> {
        let limit = self.stall_limit()?;
        if self.stall_reason.is_some() || quiet < limit {
            return None;
        }
        let after = match self.last_step {
            Some(step) => format!("after step {step}"),
            None => "before its first step".to_string(),
        };
        let reason = format!(
            "nothing heard from the trainer for {:.0} s {after} (stall limit {:.0} s: the longer of stall.after_s {} s \
             and {} × its slowest step, {:.1} s); killed",
            quiet.as_secs_f64(),
            limit.as_secs_f64(),
            self.stall.after_s,
            self.stall.steps,
            self.slowest_step_s
        );
        self.stall_reason = Some(reason.clone());
        Some(("stalled", format!("{reason}; retrying from the newest checkpoint as a crash")))
    }

    /// Stop the attempt if its median tokens/s over [`SLOW_WINDOW`] steps stays under `floor`
    /// (the plan predicted `predicted`).
    pub fn expect_throughput(&mut self, floor: f64, predicted: f64) {
        self.slow_floor = Some((floor, predicted));
    }

    /// (bytes other processes held, GPU total) when the attempt was preempted because of them.
    pub fn external_pressure(&self) -> Option<(u64, u64)> {
        self.others.filter(|_| self.external && self.preempt_reason.is_some())
    }

    /// Report once other processes' memory has stayed at or below `level` bytes for `sustain`
    /// steps ([`Monitor::memory_released`]); a new call re-arms it.
    pub fn watch_for_release(&mut self, level: u64) {
        self.release_level = Some(level);
        self.release_below = 0;
        self.released = false;
    }

    /// (bytes other processes hold now, GPU total), once, after the watched release.
    pub fn memory_released(&mut self) -> Option<(u64, u64)> {
        if !self.released {
            return None;
        }
        self.released = false;
        self.release_level = None;
        self.others
    }

    /// The runner decided to step back up: the attempt is checkpointed and stopped for it.
    pub fn stop_for_step_up(&mut self, reason: String) {
        self.step_up_reason = Some(reason);
    }

    /// Whether the attempt should be sent `checkpoint_and_exit` now (asked once).
    pub fn wants_preempt(&self) -> bool {
        (self.preempt_reason.is_some()
            || self.swap_reason.is_some()
            || self.step_up_reason.is_some()
            || self.slow_reason.is_some())
            && !self.preempt_sent
    }

    /// The runner sent the preempt request.
    pub fn preempt_sent(&mut self) {
        self.preempt_sent = true;
    }

    /// Whether the trainer should be sent `release_cache` now.
    pub fn wants_release_cache(&self) -> bool {
        self.release_cache_wanted && !self.preempt_sent
    }

    /// The runner sent `release_cache`; the count starts again.
    pub fn release_cache_sent(&mut self) {
        self.release_cache_wanted = false;
        self.cache_above = 0;
    }

    /// Why the monitor preempted the attempt (None: it did not ask).
    pub fn stop_reason(&self) -> Option<StopReason> {
        if let Some(r) = &self.stall_reason {
            return Some(StopReason::Stalled(r.clone()));
        }
        if !self.preempt_sent {
            return None;
        }
        if let Some(r) = &self.step_up_reason {
            return Some(StopReason::StepUp(r.clone()));
        }
        if let Some(r) = &self.slow_reason {
            return Some(StopReason::Slow(r.clone()));
        }
        match (&self.swap_reason, &self.preempt_reason) {
            (Some(r), _) => Some(StopReason::SwapBound(r.clone())),
            (None, r) => Some(StopReason::Pressure(r.clone().unwrap_or_default())),
        }
    }

    /// The samples gathered since the last call, to write.
    pub fn take_samples(&mut self) -> Vec<SampleRow> {
        std::mem::take(&mut self.samples)
    }

    pub fn pending_samples(&self) -> usize {
        self.samples.len()
    }

    pub fn last_step(&self) -> Option<i64> {
        self.last_step
    }

    /// The job's progress as this attempt knows it: its last step, else the step it resumed
    /// from or finished at (an attempt resumed from its final checkpoint trains no step).
    pub fn steps_done(&self) -> Option<i64> {
        self.last_step.max(self.resumed_from).max(self.finished_at)
    }

    /// What an OOM asked for: (category, requested bytes), from the trainer's `oom` event.
    pub fn oom(&self) -> (String, i64) {
        (self.oom_category.clone().unwrap_or_default(), self.oom_requested.unwrap_or(0))
    }

    fn bump_peaks(&mut self, figures: [usize; 7]) {
        for (peak, v) in self.peaks.iter_mut().zip(figures) {
            let v = v as i64;
            *peak = Some(peak.map_or(v, |p| p.max(v)));
        }
    }

    /// Take one protocol line; returns supervisor events to record.
    pub fn observe(&mut self, line: &Line) -> Vec<Notice> {
        let mut out = Vec::new();
        let t = if line.t > 0.0 { line.t } else { now() };
        match &line.event {
            Event::Started(s) => {
                self.started = true;
                self.resumed_from = s.resumed_from_step.map(|s| s as i64);
                self.capacity = Some(s.capacity as i64);
            }
            Event::Step(ev) => {
                let step = ev.step as i64;
                self.first_step.get_or_insert(step);
                self.last_step = Some(step);
                if ev.step_ms.is_finite() {
                    self.slowest_step_s = self.slowest_step_s.max(ev.step_ms / 1e3);
                }
                let mem = &ev.mem;
                self.bump_peaks(mem.peak_columns());
                let finite = |x: f64| x.is_finite().then_some(x);
                if let Some(tps) = finite(ev.tokens_per_s) {
                    self.tokens_per_s.push(tps);
                }
                if let (Some((floor, predicted)), None) = (self.slow_floor, &self.slow_reason) {
                    let n = self.tokens_per_s.len();
                    if n >= SLOW_WINDOW + 2 {
                        let mut window = self.tokens_per_s[n - SLOW_WINDOW..].to_vec();
                        window.sort_by(f64::total_cmp);
                        let median = window[SLOW_WINDOW / 2];
                        if median < floor && self.preempt_reason.is_none() && self.swap_reason.is_none() {
                            let reason = format!(
                                "measured {median:.0} tokens/s (median of the last {SLOW_WINDOW} steps), under {:.0}% of \
                                 the {predicted:.0} the plan predicted",
                                floor / predicted * 100.0
                            );
                            out.push(("slow", format!("step {step}: {reason}; checkpointing and re-planning")));
                            self.slow_reason = Some(reason);
                        }
                    }
                }
                let g = |v: usize| Some(v as i64);
                self.samples.push(SampleRow {
                    attempt_id: self.attempt,
                    step,
                    t,
                    loss: finite(ev.loss as f64),
                    val_loss: None,
                    tokens_per_s: finite(ev.tokens_per_s),
                    step_ms: finite(ev.step_ms),
                    params: g(mem.params),
                    grads: g(mem.grads),
                    optimizer: g(mem.optimizer),
                    activations: g(mem.activations),
                    workspace: g(mem.workspace),
                    allocated: g(mem.allocated),
                    reserved: g(mem.reserved),
                    fragmentation: g(mem.fragmentation),
                    capacity: g(mem.capacity),
                    at_peak_params: mem.at_peak.map(|a| a.params as i64),
                    at_peak_grads: mem.at_peak.map(|a| a.grads as i64),
                    at_peak_optimizer: mem.at_peak.map(|a| a.optimizer as i64),
                    at_peak_activations: mem.at_peak.map(|a| a.activations as i64),
                    at_peak_workspace: mem.at_peak.map(|a| a.workspace as i64),
                    at_peak_reserved: mem.at_peak.map(|a| a.reserved as i64),
                });
                let capacity = mem.capacity.max(1) as f64;
                let mut fraction = mem.allocated as f64 / capacity;
                // Memory other processes hold on the GPU is pressure too.
                let own_fraction = fraction;
                if let Some(n) = ev.nvml.as_ref().filter(|n| n.total_bytes > 0) {
                    let others = n.used_bytes.saturating_sub(n.process_bytes.unwrap_or(mem.reserved as u64));
                    fraction = fraction.max((mem.allocated as u64 + others) as f64 / n.total_bytes as f64);
                    self.others = Some((others, n.total_bytes));
                    if let Some(level) = self.release_level {
                        self.release_below = if others <= level { self.release_below + 1 } else { 0 };
                        if self.release_below >= self.sustain {
                            self.released = true;
                        }
                    }
                }
                if fraction >= self.warn && !self.warned {
                    self.warned = true;
                    out.push((
                        "warn",
                        format!(
                            "step {step}: live device memory{} at {:.1}% of capacity (warn threshold {:.0}%)",
                            on_rank(ev.mem_rank),
                            fraction * 100.0,
                            self.warn * 100.0
                        ),
                    ));
                }
                if fraction >= self.preempt {
                    self.above += 1;
                    self.cache_above = 0;
                } else {
                    self.above = 0;
                    let cached = mem.reserved as f64 / capacity;
                    self.cache_above = if cached >= self.preempt { self.cache_above + 1 } else { 0 };
                    if self.cache_above >= self.sustain && !self.release_cache_wanted {
                        self.release_cache_wanted = true;
                        out.push((
                            "release_cache",
                            format!(
                                "step {step}: the pool's cache holds {:.1}% of capacity but live memory is {:.1}% \
                                 (preempt threshold {:.0}%): asking the trainer to release its cache",
                                cached * 100.0,
                                fraction * 100.0,
                                self.preempt * 100.0
                            ),
                        ));
                    }
                }
                if let (Some(limit), Some(swap)) = (self.swap_limit, &ev.swap) {
                    let frac = swap.fraction;
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
                        "live device memory{} at {:.1}% of capacity for {} steps in a row (preempt threshold {:.0}%, sustain {})",
                        on_rank(ev.mem_rank),
                        fraction * 100.0,
                        self.above,
                        self.preempt * 100.0,
                        self.sustain
                    );
                    self.external = own_fraction < self.preempt;
                    let reason = match self.others.filter(|_| self.external) {
                        Some((others, _)) => {
                            format!("{reason}; {} of it {OTHERS_MARK}", crate::memory::format_bytes(others as usize))
                        }
                        None => reason,
                    };
                    out.push(("preempt", format!("step {step}: {reason}; checkpointing and stepping down")));
                    self.preempt_reason = Some(reason);
                }
            }
            Event::Eval(ev) => {
                self.samples.push(SampleRow {
                    attempt_id: self.attempt,
                    step: ev.step as i64,
                    t,
                    val_loss: ev.val_loss.is_finite().then_some(ev.val_loss as f64),
                    ..SampleRow::default()
                });
            }
            Event::Oom(ev) => {
                self.oom_category = Some(ev.category.clone());
                self.oom_requested = Some(ev.requested_bytes as i64);
                self.oom_message = Some(ev.message.clone());
                self.oom_at = ev.mem.at_peak.map(|a| {
                    let c = a.categories();
                    [c[0], c[1], c[2], c[3], c[4], a.reserved].map(|v| v as i64)
                });
                // An OOM while allocating the model comes before `started`.
                if self.capacity.is_none() {
                    self.capacity = Some(ev.mem.capacity as i64);
                }
                self.bump_peaks(ev.mem.peak_columns());
            }
            Event::Finished(ev) => {
                self.finished_at = Some(ev.step as i64);
                self.mean_tokens_per_s = ev.mean_tokens_per_s.filter(|v| v.is_finite());
                self.bump_peaks(ev.mem.peak_columns());
            }
            Event::Defragmented(d) => {
                let mb = crate::memory::format_bytes;
                out.push((
                    "defragmented",
                    format!(
                        "step {} ({}): moved {} buffers ({}); reserved {} -> {}, stranded {} -> {}, largest free \
                         block {} -> {}",
                        d.step,
                        d.reason,
                        d.moved_buffers,
                        mb(d.moved_bytes),
                        mb(d.before.reserved),
                        mb(d.after.reserved),
                        mb(d.before.stranded),
                        mb(d.after.stranded),
                        mb(d.before.largest_free_block),
                        mb(d.after.largest_free_block)
                    ),
                ));
            }
            Event::Checkpoint(_) | Event::Unknown => {}
        }
        out
    }

    /// The attempt row's closing figures for `outcome` and the child's exit `code`.
    pub fn end(&self, outcome: &Outcome, code: Option<i32>) -> AttemptEnd {
        let mean = self.mean_tokens_per_s.or_else(|| {
            (!self.tokens_per_s.is_empty())
                .then(|| self.tokens_per_s.iter().sum::<f64>() / self.tokens_per_s.len() as f64)
        });
        let message = match outcome {
            Outcome::Oom { .. } => self.oom_message.clone(),
            Outcome::Preempted { reason } | Outcome::SwapBound { reason } | Outcome::Stalled { reason } => {
                Some(reason.clone())
            }
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
            oom_at: self.oom_at,
            message,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{self, MemSnapshot, Swap};

    fn policy(warn: f64, preempt: f64, sustain: u32, swap: Option<f64>) -> Policy {
        let swap =
            swap.map_or(String::new(), |f| format!("swap_bound: {{ transfer_fraction: {f}, action: step_back }}\n"));
        Policy::parse(&format!(
            "name: p\nthresholds: {{ warn: {warn}, preempt: {preempt}, sustain: {sustain} }}\n\
             rungs: [{{ name: bf16, set: {{ precision: bf16 }} }}]\n{swap}"
        ))
        .unwrap()
    }

    /// The trainer's `started` line.
    fn started() -> Line {
        Line {
            t: 1.0,
            event: Event::Started(protocol::Started {
                config: serde_json::json!({ "name": "j" }),
                world_size: 1,
                device: "cpu:0".into(),
                capacity: 100,
                resumed_from_step: None,
                num_params: 10,
                grad_accum: 1,
                unigram_entropy: 3.0,
            }),
        }
    }

    /// A step event at `reserved` bytes of a 100-byte device, with a transfer `fraction`.
    fn step(n: u64, reserved: usize, swap: Option<f64>) -> Line {
        Line {
            t: 10.0 + n as f64,
            event: Event::Step(protocol::Step {
                step: n,
                loss: 2.0,
                lr: 1e-3,
                grad_norm: 1.0,
                tokens_per_s: 100.0 * n as f64,
                step_ms: 5.0,
                mem: MemSnapshot {
                    activations: n as usize,
                    allocated: reserved,
                    reserved,
                    capacity: 100,
                    ..Default::default()
                },
                precision: "fp32".into(),
                loss_scale: None,
                skipped: false,
                skipped_steps: 0,
                pipeline: None,
                mem_rank: None,
                nvml: None,
                swap: swap.map(|fraction| Swap {
                    bytes_to_host: 1,
                    bytes_to_device: 1,
                    transfer_ms: 1.0,
                    hidden_ms: 0.0,
                    host_ms: 0.0,
                    fraction,
                }),
            }),
        }
    }

    /// Feed `reserved` figures (percent of capacity) one step each; the notice kinds per step.
    fn run(m: &mut Monitor, reserved: &[usize], swap: Option<f64>) -> Vec<Vec<&'static str>> {
        (0..reserved.len())
            .map(|i| m.observe(&step(i as u64 + 1, reserved[i], swap)).into_iter().map(|(k, _)| k).collect())
            .collect()
    }

    /// A trainer's `defragmented` line becomes one `defragmented` event saying what moved and
    /// what changed, and asks for nothing.
    #[test]
    fn a_defragmentation_is_recorded_with_its_figures() {
        use crate::memory::PoolShape;
        let mut m = Monitor::new(&policy(0.85, 0.95, 2, None), 1);
        let shape = |reserved: usize, stranded: usize| PoolShape {
            allocated: 4 << 20,
            reserved,
            stranded,
            largest_free_block: stranded,
            segments: 2,
        };
        let line = Line {
            t: 1.0,
            event: Event::Defragmented(protocol::Defragmented {
                step: 8,
                reason: "checkpoint".into(),
                moved_buffers: 2,
                moved_bytes: 2 << 20,
                before: shape(12 << 20, 8 << 20),
                after: shape(6 << 20, 2 << 20),
            }),
        };
        let notices = m.observe(&line);
        assert_eq!(notices.len(), 1, "{notices:?}");
        assert_eq!(notices[0].0, "defragmented");
        assert!(
            notices[0].1.starts_with(
                "step 8 (checkpoint): moved 2 buffers (2.00 MiB); reserved 12.00 MiB -> 6.00 MiB, stranded 8.00 MiB -> 2.00 MiB"
            ),
            "{}",
            notices[0].1
        );
        assert!(!m.wants_preempt() && !m.wants_release_cache());
    }

    /// The stall limit is the longer of `stall.after_s` and `stall.steps` × the slowest step
    /// so far; a trainer quiet that long is stalled once (a `stalled` notice, the stop reason
    /// that classifies the kill), and not a moment before.
    #[test]
    fn a_trainer_quiet_past_the_stall_limit_is_stalled_once() {
        let secs = std::time::Duration::from_secs_f64;
        // (case, stall yaml, step times in ms, quiet s, stalled)
        let cases: &[(&str, &str, &[f64], f64, bool)] = &[
            ("not started: no limit", "", &[], 1e6, false),
            ("defaults, before any step, 599 s", "", &[], 599.0, false),
            ("defaults, before any step, 600 s", "", &[], 600.0, true),
            ("defaults, fast steps: the floor rules", "", &[500.0, 900.0], 601.0, true),
            ("defaults, 40 s steps: 20 of them", "", &[40_000.0, 10_000.0], 700.0, false),
            ("defaults, 40 s steps: 800 s", "", &[40_000.0, 10_000.0], 800.0, true),
            ("a short floor", "stall: { after_s: 2 }\n", &[100.0], 2.5, true),
            ("a short floor, slow steps", "stall: { after_s: 2, steps: 5 }\n", &[1000.0], 4.0, false),
            ("a short floor, slow steps, past", "stall: { after_s: 2, steps: 5 }\n", &[1000.0], 5.0, true),
        ];
        for &(case, yaml, step_ms, quiet, stalled) in cases {
            let policy =
                Policy::parse(&format!("name: p\nrungs: [{{ name: bf16, set: {{ precision: bf16 }} }}]\n{yaml}"))
                    .unwrap();
            let mut m = Monitor::new(&policy, 1);
            if !case.starts_with("not started") {
                m.observe(&started());
            }
            for (i, &ms) in step_ms.iter().enumerate() {
                let mut line = step(i as u64 + 1, 10, None);
                let Event::Step(s) = &mut line.event else { unreachable!() };
                s.step_ms = ms;
                m.observe(&line);
            }
            assert_eq!(m.stop_reason(), None, "{case}");
            let notice = m.stalled(secs(quiet));
            assert_eq!(notice.is_some(), stalled, "{case}: limit {:?}", m.stall_limit());
            if let Some((kind, message)) = notice {
                assert_eq!(kind, "stalled", "{case}");
                assert!(message.starts_with(&format!("nothing heard from the trainer for {quiet:.0} s")), "{message}");
                assert!(matches!(m.stop_reason(), Some(StopReason::Stalled(_))), "{case}");
                assert_eq!(m.stalled(secs(quiet * 2.0)), None, "{case}: once");
            }
        }
    }

    /// A step whose memory is one of several ranks' (the fullest) names that rank in the
    /// warning and the preemption.
    #[test]
    fn thresholds_name_the_rank_whose_memory_crossed_them() {
        let mut m = Monitor::new(&policy(0.85, 0.95, 1, None), 1);
        let mut line = step(1, 97, None);
        let Event::Step(s) = &mut line.event else { unreachable!() };
        s.mem_rank = Some(3);
        let notices = m.observe(&line);
        assert_eq!(notices.iter().map(|n| n.0).collect::<Vec<_>>(), ["warn", "preempt"], "{notices:?}");
        assert!(notices.iter().all(|n| n.1.contains("live device memory on rank 3 at 97.0%")), "{notices:?}");
    }

    /// warn, preempt, sustain, reserved per step, notice kinds per step, wants preempt after.
    type ThresholdCase = (f64, f64, u32, &'static [usize], &'static [&'static [&'static str]], bool);

    #[test]
    fn thresholds_warn_once_and_preempt_after_sustain_steps_in_a_row() {
        let cases: &[ThresholdCase] = &[
            (0.85, 0.95, 3, &[10, 50, 80], &[&[], &[], &[]], false),
            (0.85, 0.95, 3, &[86, 90, 50], &[&["warn"], &[], &[]], false),
            (0.85, 0.95, 3, &[95, 96, 97], &[&["warn"], &[], &["preempt"]], true),
            // A dip below preempt restarts the run.
            (0.85, 0.95, 3, &[95, 96, 90, 96, 97], &[&["warn"], &[], &[], &[], &[]], false),
            (0.85, 0.95, 3, &[95, 96, 90, 96, 97, 99], &[&["warn"], &[], &[], &[], &[], &["preempt"]], true),
            (0.5, 0.5, 1, &[50], &[&["warn", "preempt"]], true),
            // Preempt is reported once, however long the pressure lasts.
            (0.9, 0.9, 1, &[100, 100, 100], &[&["warn", "preempt"], &[], &[]], true),
        ];
        for (i, &(warn, preempt, sustain, reserved, kinds, wants)) in cases.iter().enumerate() {
            let mut m = Monitor::new(&policy(warn, preempt, sustain, None), 1);
            let got = run(&mut m, reserved, None);
            let want: Vec<Vec<&str>> = kinds.iter().map(|k| k.to_vec()).collect();
            assert_eq!(got, want, "case {i}");
            assert_eq!(m.wants_preempt(), wants, "case {i}");
            if wants {
                m.preempt_sent();
                assert!(!m.wants_preempt(), "asked once");
                assert!(matches!(m.stop_reason(), Some(StopReason::Pressure(r)) if r.contains("preempt threshold")));
            } else {
                assert_eq!(m.stop_reason(), None, "case {i}");
            }
        }
    }

    #[test]
    fn a_full_cache_over_live_memory_below_the_line_asks_for_release_not_preemption() {
        // (allocated, reserved) per step, percent of capacity; notice kinds per step; whether
        // release_cache is wanted after. Preempt 0.95, sustain 2.
        type CacheCase = (&'static [(usize, usize)], &'static [&'static [&'static str]], bool);
        let cases: &[CacheCase] = &[
            // Cache at 98%, live at 80%: release after 2 steps, never preempt.
            (&[(80, 98), (80, 98), (80, 98)], &[&[], &["release_cache"], &[]], true),
            // Live memory itself above the line: preempt (the cache is not the problem).
            (&[(96, 98), (96, 98)], &[&["warn"], &["preempt"]], false),
            // Cache below the line: nothing.
            (&[(80, 90), (80, 90)], &[&[], &[]], false),
        ];
        for (i, &(steps, kinds, release)) in cases.iter().enumerate() {
            let mut m = Monitor::new(&policy(0.85, 0.95, 2, None), 1);
            let got: Vec<Vec<&str>> = steps
                .iter()
                .enumerate()
                .map(|(n, &(allocated, reserved))| {
                    let mut line = step(n as u64 + 1, reserved, None);
                    if let Event::Step(s) = &mut line.event {
                        s.mem.allocated = allocated;
                    }
                    m.observe(&line).into_iter().map(|(k, _)| k).collect()
                })
                .collect();
            assert_eq!(got, kinds.iter().map(|k| k.to_vec()).collect::<Vec<_>>(), "case {i}");
            assert_eq!(m.wants_release_cache(), release, "case {i}");
            assert_eq!(m.wants_preempt(), !release && steps[0].0 >= 95, "case {i}");
            m.release_cache_sent();
            assert!(!m.wants_release_cache(), "asked once");
        }
    }

    #[test]
    fn memory_other_processes_hold_on_the_gpu_is_pressure() {
        let mut m = Monitor::new(&policy(0.85, 0.95, 1, None), 1);
        let mut line = step(1, 50, None);
        if let Event::Step(s) = &mut line.event {
            // The pool at 50% of its capacity; another process holds 48 of the GPU's 100.
            s.nvml = Some(protocol::NvmlReading { used_bytes: 98, total_bytes: 100, process_bytes: Some(50) });
        }
        let kinds: Vec<_> = m.observe(&line).into_iter().map(|(k, _)| k).collect();
        assert_eq!(kinds, ["warn", "preempt"]);
    }

    #[test]
    fn sustained_transfer_time_is_swap_bound_and_wins_over_later_pressure() {
        // (swap_bound, fractions per step, swap-bound after)
        let cases: &[(Option<f64>, &[f64], bool)] = &[
            (Some(0.5), &[0.6, 0.7, 0.8], true),
            (Some(0.5), &[0.6, 0.4, 0.8], false),
            (Some(0.5), &[0.5, 0.5, 0.5], true),
            (None, &[0.9, 0.9, 0.9], false),
        ];
        for (i, &(limit, fractions, bound)) in cases.iter().enumerate() {
            let mut m = Monitor::new(&policy(0.85, 0.95, 3, limit), 1);
            let kinds: Vec<_> =
                fractions.iter().enumerate().flat_map(|(s, &f)| m.observe(&step(s as u64 + 1, 10, Some(f)))).collect();
            assert_eq!(kinds.iter().any(|(k, _)| *k == "swap_bound"), bound, "case {i}: {kinds:?}");
            assert_eq!(m.wants_preempt(), bound, "case {i}");
        }
        // Once swap-bound, pressure does not also preempt: the reason stays the transfers.
        let mut m = Monitor::new(&policy(0.85, 0.95, 2, Some(0.5)), 1);
        for s in 1..=4 {
            m.observe(&step(s, 99, Some(0.9)));
        }
        m.preempt_sent();
        assert!(matches!(m.stop_reason(), Some(StopReason::SwapBound(r)) if r.contains("swap_bound 50.0%")));
    }

    #[test]
    fn samples_peaks_and_the_attempt_end_come_from_the_events() {
        let mut m = Monitor::new(&policy(0.85, 0.95, 3, None), 7);
        m.observe(&Line {
            t: 1.0,
            event: Event::Started(protocol::Started {
                config: serde_json::Value::Null,
                world_size: 1,
                device: "cpu:0".into(),
                capacity: 100,
                resumed_from_step: Some(4),
                num_params: 1,
                grad_accum: 1,
                unigram_entropy: 1.0,
            }),
        });
        run(&mut m, &[30, 60, 40], None);
        m.observe(&Line { t: 20.0, event: Event::Eval(protocol::Eval { step: 3, val_loss: f32::NAN }) });
        m.observe(&Line { t: 21.0, event: Event::Unknown });
        let samples = m.take_samples();
        assert_eq!(samples.len(), 4);
        assert_eq!(samples.iter().map(|s| s.step).collect::<Vec<_>>(), [1, 2, 3, 3]);
        assert_eq!(samples[1].reserved, Some(60));
        assert_eq!(samples[3].val_loss, None, "a NaN validation loss is stored as NULL");
        assert_eq!(m.pending_samples(), 0);
        let end = m.end(&Outcome::Finished, Some(0));
        assert_eq!(
            (end.first_step, end.last_step, end.resumed_from_step, end.capacity),
            (Some(1), Some(3), Some(4), Some(100))
        );
        assert_eq!(end.peaks[3], Some(3), "activations peak");
        assert_eq!(end.peaks[6], Some(60), "reserved peak");
        assert_eq!(end.mean_tokens_per_s, Some(200.0));
        assert_eq!(end.outcome, "finished");
        assert_eq!(m.steps_done(), Some(4), "resumed from step 4, above the steps trained here");
    }

    #[test]
    fn an_oom_before_started_still_names_the_capacity() {
        let mut m = Monitor::new(&policy(0.85, 0.95, 3, None), 1);
        m.observe(&Line {
            t: 1.0,
            event: Event::Oom(protocol::Oom {
                step: 0,
                requested_bytes: 4096,
                category: "optimizer".into(),
                mem: MemSnapshot {
                    params: 10,
                    capacity: 64,
                    at_peak: Some(protocol::Composition { params: 8, grads: 2, reserved: 12, ..Default::default() }),
                    ..Default::default()
                },
                message: "out of device memory".into(),
            }),
        });
        assert_eq!(m.oom(), ("optimizer".to_string(), 4096));
        assert_eq!(m.end(&Outcome::Finished, None).oom_at, Some([8, 2, 0, 0, 0, 12]), "what was live when it failed");
        let end = m.end(&Outcome::Oom { category: "optimizer".into(), requested: 4096 }, Some(3));
        assert_eq!(
            (end.capacity, end.peaks[0], end.message.as_deref()),
            (Some(64), Some(10), Some("out of device memory"))
        );
    }

    /// A step at `allocated` live bytes of 100 while other processes hold `others` (NVML).
    fn shared_step(n: u64, allocated: usize, others: u64) -> Line {
        let mut line = step(n, allocated, None);
        if let Event::Step(ev) = &mut line.event {
            ev.nvml = Some(protocol::NvmlReading {
                used_bytes: allocated as u64 + others,
                total_bytes: 100,
                process_bytes: Some(allocated as u64),
            });
        }
        line
    }

    #[test]
    fn other_processes_memory_preempts_as_external_pressure_and_its_release_is_reported_once() {
        // (case, (allocated, others) for 3 steps, external pressure)
        let cases = [
            ("own memory above the line: not external", (97, 0), None),
            ("others push it over: external", (70, 30), Some((30, 100))),
            ("below the line: no preemption", (70, 10), None),
        ];
        for (name, at, external) in cases {
            let steps = [at; 3];
            let mut m = Monitor::new(&policy(0.9, 0.95, 3, None), 1);
            for (i, (alloc, others)) in steps.iter().enumerate() {
                m.observe(&shared_step(i as u64 + 1, *alloc, *others));
            }
            assert_eq!(m.external_pressure(), external, "{name}");
        }
        // The release watch: reported after `sustain` steps at or below the level, once; a
        // step above it starts the count again.
        let mut m = Monitor::new(&policy(0.9, 0.95, 3, None), 1);
        m.watch_for_release(10);
        for (i, others) in [30, 5, 5, 40, 5, 5].iter().enumerate() {
            m.observe(&shared_step(i as u64 + 1, 50, *others));
            assert_eq!(m.memory_released(), None, "step {}", i + 1);
        }
        m.observe(&shared_step(7, 50, 8));
        assert_eq!(m.memory_released(), Some((8, 100)));
        assert_eq!(m.memory_released(), None, "once");
        // Stopping for a step up is a stop the runner asked for, with its reason.
        assert!(!m.wants_preempt());
        m.stop_for_step_up("freed".into());
        assert!(m.wants_preempt());
        m.preempt_sent();
        assert_eq!(m.stop_reason(), Some(StopReason::StepUp("freed".into())));
    }

    #[test]
    fn an_attempt_far_below_its_predicted_throughput_is_stopped_once_its_median_says_so() {
        // step(n) reports 100·n tokens/s: the median of steps 3..7 is 500.
        // (case, floor, stopped)
        let cases = [("under the floor", 600.0, true), ("above it", 400.0, false)];
        for (name, floor, stopped) in cases {
            let mut m = Monitor::new(&policy(0.9, 0.95, 3, None), 1);
            m.expect_throughput(floor, floor * 2.0);
            let mut events = Vec::new();
            for n in 1..=7 {
                events.extend(m.observe(&step(n, 10, None)));
            }
            assert_eq!(m.wants_preempt(), stopped, "{name}: {events:?}");
            if stopped {
                assert_eq!(events.last().map(|e| e.0), Some("slow"), "{name}");
                m.preempt_sent();
                assert!(matches!(m.stop_reason(), Some(StopReason::Slow(r)) if r.starts_with("measured 500 tokens/s")));
            }
        }
        // Not armed: never.
        let mut m = Monitor::new(&policy(0.9, 0.95, 3, None), 1);
        for n in 1..=20 {
            m.observe(&step(n, 10, None));
        }
        assert!(!m.wants_preempt());
    }
}
