//! Policy files (docs/DESIGN.md "Policy file"): validated types, loading from policies/, and the
//! step-down logic that applies the next applicable rung on top of a job's configuration.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::config::{Checkpointing, JobSpec, OffloadTarget, Precision};

#[derive(Debug, Clone, thiserror::Error)]
pub enum PolicyError {
    /// The field and what is wrong with it (callers say which policy), and `also` every other
    /// problem the validator found (field, message).
    #[error("{}", invalid_text(field, message, also))]
    Invalid { field: String, message: String, also: Vec<(String, String)> },
    #[error("policy `{0}` does not exist")]
    NotFound(String),
    #[error("policy file {path}: {source}")]
    Io { path: PathBuf, source: std::sync::Arc<std::io::Error> },
}

fn invalid(field: impl Into<String>, message: impl Into<String>) -> PolicyError {
    PolicyError::Invalid { field: field.into(), message: message.into(), also: Vec::new() }
}

fn invalid_text(field: &str, message: &str, also: &[(String, String)]) -> String {
    if also.is_empty() {
        return format!("{field}: {message}");
    }
    let mut text = format!("{} problems\n  {field}: {message}", also.len() + 1);
    for (f, m) in also {
        text.push_str(&format!("\n  {f}: {m}"));
    }
    text
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Policy {
    pub name: String,
    /// How the next configuration is chosen (default `fastest_fit`).
    #[serde(default)]
    pub strategy: Strategy,
    /// Headroom the planner keeps under the preempt threshold, as a fraction of the predicted
    /// peak (a configuration fits when `predicted × (1 + margin) ≤ preempt × capacity`).
    /// Absent: learned from the database's measured/predicted peaks on the device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub margin: Option<f64>,
    #[serde(default)]
    pub thresholds: Thresholds,
    /// Applied to every job submitted under the policy, over the job's own values, before its
    /// first attempt (the job's `base` event says what it changed): the configuration the
    /// policy starts from, where rungs are what it steps down to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base: Option<RungSet>,
    pub rungs: Vec<Rung>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub swap_bound: Option<SwapBound>,
    #[serde(default)]
    pub retries: Retries,
    #[serde(default)]
    pub stall: Stall,
}

/// How the supervisor moves along the ladder.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum Strategy {
    /// Before each attempt, plan: every configuration the policy allows from where the job
    /// stands (its rungs applied cumulatively, the micro-batch free), with predicted peak and
    /// step time; the attempt runs the fastest predicted to fit (`supervisor::planner`).
    #[default]
    FastestFit,
    /// Before each attempt, pass over every rung whose configuration the estimator predicts
    /// cannot fit the device (not even its allocated bytes), recording each with its figures:
    /// the first attempt is the first configuration predicted to fit.
    FirstFit,
    /// One attempt per rung in order, each moved on by an OOM or a preemption.
    Ladder,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Thresholds {
    pub warn: f64,
    pub preempt: f64,
    pub sustain: u32,
}

impl Default for Thresholds {
    fn default() -> Self {
        Thresholds { warn: 0.85, preempt: 0.95, sustain: 3 }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Rung {
    pub name: String,
    pub set: RungSet,
    #[serde(default)]
    pub repeat: bool,
}

/// What a rung changes. Every field optional; present ones are applied.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields)]
pub struct RungSet {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub precision: Option<Precision>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub micro_batch: Option<MicroBatchSet>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpointing: Option<Checkpointing>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zero_stage: Option<i64>,
    /// Split each block across this many of the job's ranks (`memory.tensor_parallel`): a
    /// rank holds 1/N of the split weights, gradients, optimizer state and head/MLP
    /// activations. Applies only where the job's world_size and n_head allow it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tensor_parallel: Option<i64>,
    /// Split the layers into this many pipeline stages (`memory.pipeline_parallel`): a stage
    /// holds its layers' state. Applies only where the world and n_layer allow it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pipeline_parallel: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offload: Option<OffloadSet>,
    /// `static`: the first step's allocations packed into one arena, reserved = allocated
    /// after it (`memory.allocator`); rescues a job whose live peak fits but whose cached
    /// segments do not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocator: Option<crate::config::Allocator>,
    /// The share of the device the pool reserves up front as one segment (`device.reserve`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reserve: Option<f64>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(untagged, try_from = "serde_yaml::Value")]
pub enum MicroBatchSet {
    Value(i64),
    Keyword(MicroBatchKeyword),
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum MicroBatchKeyword {
    Half,
}

impl TryFrom<serde_yaml::Value> for MicroBatchSet {
    type Error = String;
    fn try_from(v: serde_yaml::Value) -> Result<Self, String> {
        match &v {
            serde_yaml::Value::Number(n) if n.as_i64().is_some() => Ok(MicroBatchSet::Value(n.as_i64().unwrap())),
            serde_yaml::Value::String(s) if s == "half" => Ok(MicroBatchSet::Keyword(MicroBatchKeyword::Half)),
            other => Err(format!(
                "micro_batch must be a positive integer or `half`, not {}",
                serde_yaml::to_string(other).unwrap_or_default().trim()
            )),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields)]
pub struct OffloadSet {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimizer: Option<OffloadTarget>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub params: Option<OffloadTarget>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub activations: Option<OffloadTarget>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SwapBound {
    pub transfer_fraction: f64,
    pub action: SwapAction,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum SwapAction {
    StepBack,
    Fail,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Retries {
    pub crash: u32,
}

impl Default for Retries {
    fn default() -> Self {
        Retries { crash: 2 }
    }
}

/// When an attempt counts as stalled (a hung collective, a deadlock, a stopped process): nothing
/// heard from its trainer — no protocol line — for the longer of `after_s` seconds and `steps`
/// times its slowest step so far. The supervisor kills it and retries it from the newest
/// checkpoint as it does a crash (the same `retries.crash`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Stall {
    #[serde(default = "Stall::default_after_s")]
    pub after_s: f64,
    #[serde(default = "Stall::default_steps")]
    pub steps: f64,
}

impl Stall {
    fn default_after_s() -> f64 {
        600.0
    }

    fn default_steps() -> f64 {
        20.0
    }

    /// How long a quiet trainer is given, its slowest step so far having taken `slowest_step_s`.
    pub fn limit(&self, slowest_step_s: f64) -> std::time::Duration {
        let s = self.after_s.max(self.steps * slowest_step_s.max(0.0));
        std::time::Duration::from_secs_f64(s.min(MAX_STALL_S))
    }
}

impl Default for Stall {
    fn default() -> Self {
        Stall { after_s: Stall::default_after_s(), steps: Stall::default_steps() }
    }
}

/// The longest wait `stall` may set (a week): anything longer is a typo, and a deadline far
/// beyond it would overflow the clock.
const MAX_STALL_S: f64 = 7.0 * 24.0 * 3600.0;

/// A policy name is a file stem: no slashes, no dots, nothing to climb out of policies/ with.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= 64 && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
}

impl Policy {
    pub fn parse(text: &str) -> Result<Policy, PolicyError> {
        crate::config::check_yaml_nesting(text).map_err(|m| invalid("yaml", m))?;
        let p: Policy = serde_yaml::from_str(text).map_err(|e| invalid("yaml", e.to_string()))?;
        p.validate()?;
        Ok(p)
    }

    /// Every problem at once, in file order.
    pub fn validate(&self) -> Result<(), PolicyError> {
        let mut problems: Vec<(String, String)> = Vec::new();
        let mut bad = |field: String, message: String| problems.push((field, message));
        if !valid_name(&self.name) {
            bad("name".to_string(), format!("`{}` must match [A-Za-z0-9_-]{{1,64}}", self.name));
        }
        let t = &self.thresholds;
        if !(t.warn > 0.0 && t.warn <= 1.0) {
            bad("thresholds.warn".to_string(), format!("{} must be in (0, 1]", t.warn));
        }
        if !(t.preempt > 0.0 && t.preempt <= 1.0 && t.preempt >= t.warn) {
            bad("thresholds.preempt".to_string(), format!("{} must be in [warn, 1]", t.preempt));
        }
        if t.sustain == 0 || t.sustain > 1000 {
            bad("thresholds.sustain".to_string(), format!("{} must be in [1, 1000]", t.sustain));
        }
        if let Some(m) = self.margin {
            if !(0.0..=1.0).contains(&m) {
                bad("margin".to_string(), format!("{m} must be in [0, 1]"));
            }
        }
        if self.rungs.is_empty() {
            bad("rungs".to_string(), "must list at least one rung (a ladder with none cannot step down)".to_string());
        }
        let sets = self.rungs.iter().enumerate().map(|(i, r)| (format!("rungs[{i}].set"), &r.set));
        for (at, set) in self.base.iter().map(|b| ("base".to_string(), b)).chain(sets) {
            if *set == RungSet::default() {
                bad(at.clone(), "must change at least one knob".to_string());
            }
            match set.micro_batch {
                Some(MicroBatchSet::Value(v)) if v < 1 => {
                    bad(format!("{at}.micro_batch"), format!("{v} must be >= 1 or `half`"));
                }
                Some(MicroBatchSet::Keyword(_)) if at == "base" => {
                    bad(format!("{at}.micro_batch"), "`half` steps down; a base sets a value".to_string());
                }
                _ => {}
            }
            if let Some(z) = set.zero_stage {
                if !(0..=3).contains(&z) {
                    bad(format!("{at}.zero_stage"), format!("{z} must be in [0, 3]"));
                }
            }
            if let Some(t) = set.tensor_parallel {
                if !(1..=64).contains(&t) {
                    bad(format!("{at}.tensor_parallel"), format!("{t} must be in [1, 64]"));
                }
            }
            if let Some(p) = set.pipeline_parallel {
                if !(1..=64).contains(&p) {
                    bad(format!("{at}.pipeline_parallel"), format!("{p} must be in [1, 64]"));
                }
            }
            if let Some(r) = set.reserve {
                if !(r > 0.0 && r <= 1.0) {
                    bad(format!("{at}.reserve"), format!("{r} must be in (0, 1] (a fraction of the device's memory)"));
                }
            }
        }
        for (i, r) in self.rungs.iter().enumerate() {
            if r.name.is_empty() {
                bad(format!("rungs[{i}].name"), "must not be empty".to_string());
            }
        }
        if let Some(s) = &self.swap_bound {
            if !(s.transfer_fraction > 0.0 && s.transfer_fraction <= 1.0) {
                bad("swap_bound.transfer_fraction".to_string(), format!("{} must be in (0, 1]", s.transfer_fraction));
            }
        }
        if self.retries.crash > 100 {
            bad("retries.crash".to_string(), format!("{} must be in [0, 100]", self.retries.crash));
        }
        if !(self.stall.after_s >= 1.0 && self.stall.after_s <= MAX_STALL_S) {
            bad("stall.after_s".to_string(), format!("{} must be in [1, {MAX_STALL_S}] seconds", self.stall.after_s));
        }
        if !(self.stall.steps >= 1.0 && self.stall.steps <= 1e6) {
            bad(
                "stall.steps".to_string(),
                format!("{} must be in [1, 1000000] (times the slowest step)", self.stall.steps),
            );
        }
        let mut all = problems.into_iter();
        match all.next() {
            None => Ok(()),
            Some((field, message)) => Err(PolicyError::Invalid { field, message, also: all.collect() }),
        }
    }

    pub fn to_yaml(&self) -> String {
        serde_yaml::to_string(self).expect("policy serialises")
    }
}

/// policies/NAME.yaml, read and validated.
pub fn load(dir: &Path, name: &str) -> Result<(Policy, String), PolicyError> {
    if !valid_name(name) {
        return Err(invalid("name", format!("`{name}` must match [A-Za-z0-9_-]{{1,64}}")));
    }
    let path = dir.join(format!("{name}.yaml"));
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(PolicyError::NotFound(name.into())),
        Err(e) => return Err(PolicyError::Io { path, source: e.into() }),
    };
    let policy = Policy::parse(&text)?;
    if policy.name != name {
        return Err(invalid("name", format!("`{}` does not match the file name `{name}`", policy.name)));
    }
    Ok((policy, text))
}

/// Names of every policy file in `dir`, sorted.
pub fn list(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let p = e.path();
            (p.extension()? == "yaml").then(|| p.file_stem()?.to_str().map(str::to_owned))?
        })
        .filter(|n| valid_name(n))
        .collect();
    names.sort();
    names
}

/// Where a job stands on its ladder: the index of the last rung applied (-1: none), and whether
/// that rung may repeat.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LadderPosition {
    pub rung_index: i64,
}

/// The outcome of asking for the next rung.
#[derive(Debug, Clone, PartialEq)]
pub struct StepDown {
    pub rung_index: i64,
    pub rung_name: String,
    pub spec: JobSpec,
    /// Rungs passed over on the way, with the reason each could not apply.
    pub skipped: Vec<(String, String)>,
}

/// Apply one rung to `spec`, or say why it cannot apply.
pub fn apply_rung(rung: &Rung, spec: &JobSpec) -> Result<JobSpec, String> {
    let mut next = spec.clone();
    let set = &rung.set;
    if let Some(p) = set.precision {
        next.memory.precision = p;
    }
    if let Some(mb) = &set.micro_batch {
        let knobs = spec.knobs();
        let target = match mb {
            MicroBatchSet::Keyword(MicroBatchKeyword::Half) => {
                if knobs.micro_batch <= 1 {
                    return Err("micro_batch is already 1".into());
                }
                // The largest divisor of the sequences per rank and step at or below half keeps
                // global_batch exact (grad_accum grows to match).
                let per_rank = knobs.micro_batch * knobs.grad_accum;
                (1..=knobs.micro_batch / 2).rev().find(|d| per_rank.is_multiple_of(*d)).unwrap_or(1) as i64
            }
            MicroBatchSet::Value(v) => *v,
        };
        next.train.micro_batch = target;
    }
    if let Some(c) = set.checkpointing {
        next.memory.checkpointing = c;
    }
    if let Some(t) = set.tensor_parallel {
        let (world, heads) = (spec.memory.world_size, spec.model.n_head);
        if world % t != 0 {
            return Err(format!("tensor_parallel {t} needs a world_size it divides (it is {world})"));
        }
        if heads % t != 0 {
            return Err(format!("tensor_parallel {t} needs an n_head it divides (it is {heads})"));
        }
        next.memory.tensor_parallel = t;
    }
    if let Some(p) = set.pipeline_parallel {
        let (world, tp, layers) = (spec.memory.world_size, next.memory.tensor_parallel, spec.model.n_layer);
        if world % (tp * p) != 0 {
            return Err(format!(
                "pipeline_parallel {p} needs a world_size that tensor_parallel × {p} divides (it is {world}, tensor_parallel {tp})"
            ));
        }
        if layers < p {
            return Err(format!("pipeline_parallel {p} needs at least {p} layers (n_layer is {layers})"));
        }
        next.memory.pipeline_parallel = p;
    }
    if let Some(z) = set.zero_stage {
        if z > 0 && spec.memory.world_size <= 1 {
            return Err(format!("zero_stage {z} needs world_size > 1 (it is {})", spec.memory.world_size));
        }
        if z > 0 && next.data_parallel() <= 1 {
            return Err(format!(
                "zero_stage {z} needs more than one data-parallel rank (world_size {} / tensor_parallel {})",
                next.memory.world_size, next.memory.tensor_parallel
            ));
        }
        next.memory.zero_stage = z;
    }
    if let Some(o) = &set.offload {
        if let Some(t) = o.optimizer {
            next.memory.offload.optimizer = t;
        }
        if let Some(t) = o.params {
            next.memory.offload.params = t;
        }
        if let Some(t) = o.activations {
            next.memory.offload.activations = t;
        }
    }
    if let Some(a) = set.allocator {
        next.memory.allocator = a;
    }
    if let Some(r) = set.reserve {
        next.device.reserve = Some(r);
    }
    if next == *spec {
        return Err("already in effect".into());
    }
    next.validate().map_err(|e| e.to_string())?;
    Ok(next)
}

/// A job submitted under `policy`: its spec with the policy's `base` applied, and what that
/// changed (`None`: the policy has no base, or the job already has it).
pub fn apply_base(policy: &Policy, spec: &JobSpec) -> Result<(JobSpec, Option<String>), String> {
    let Some(base) = &policy.base else { return Ok((spec.clone(), None)) };
    let rung = Rung { name: "base".into(), set: base.clone(), repeat: false };
    match apply_rung(&rung, spec) {
        Ok(next) => {
            let said = serde_json::to_string(base).unwrap_or_default();
            Ok((next, Some(format!("policy `{}` starts the job from its base {said}", policy.name))))
        }
        Err(e) if e == "already in effect" => Ok((spec.clone(), None)),
        Err(e) => Err(e),
    }
}

/// The next applicable rung after `from` (repeating rungs are retried first).
pub fn step_down(policy: &Policy, spec: &JobSpec, from: LadderPosition) -> Result<StepDown, Vec<(String, String)>> {
    let mut skipped = Vec::new();
    let start = if from.rung_index >= 0 && policy.rungs[from.rung_index as usize].repeat {
        from.rung_index as usize
    } else {
        (from.rung_index + 1) as usize
    };
    for (i, rung) in policy.rungs.iter().enumerate().skip(start) {
        match apply_rung(rung, spec) {
            Ok(next) => {
                return Ok(StepDown { rung_index: i as i64, rung_name: rung.name.clone(), spec: next, skipped });
            }
            Err(reason) => {
                // A repeating rung that ran out (micro_batch 1) is not a "skip" worth recording
                // twice; still list it so the reason is visible.
                skipped.push((rung.name.clone(), reason));
            }
        }
    }
    Err(skipped)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A one-layer job on an 8 MiB cpu device: global batch 8 at `micro` per pass.
    pub(crate) fn spec(micro: i64) -> JobSpec {
        JobSpec::parse(&format!(
            "name: t\nmodel: {{ n_layer: 1, n_head: 1, n_embd: 8, block_size: 8, vocab: bytes }}\n\
             data: {{ path: x.txt }}\ntrain: {{ steps: 10, global_batch: 8, micro_batch: {micro} }}\n\
             device: {{ kind: cpu, device_memory: 8MiB }}\n"
        ))
        .unwrap()
    }

    #[test]
    fn shipped_policies_parse() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("policies");
        let names = list(&dir);
        assert!(names.contains(&"default".to_string()) && names.contains(&"no-offload".to_string()));
        for n in names {
            load(&dir, &n).unwrap();
        }
    }

    #[test]
    fn bad_policies_name_the_field() {
        let e = Policy::parse("name: x\nrungs: []\nthresholds: { warn: 0.9, preempt: 0.5, sustain: 3 }").unwrap_err();
        assert!(e.to_string().contains("thresholds.preempt"), "{e}");
        let e = Policy::parse("name: x\nrungs: [{ name: a, set: { micro_batch: third } }]").unwrap_err();
        assert!(e.to_string().contains("micro_batch"), "{e}");
        let e = Policy::parse("name: x\nrungs: []\nbogus: 1").unwrap_err();
        assert!(e.to_string().starts_with("yaml: ") && e.to_string().contains("bogus"), "{e}");
        let e = Policy::parse("name: x\nrungs: []").unwrap_err();
        assert!(e.to_string().starts_with("rungs: must list at least one rung"), "{e}");
        assert!(matches!(load(Path::new("policies"), "../etc"), Err(PolicyError::Invalid { .. })));
        let rung = "rungs: [{ name: a, set: { precision: bf16 } }]";
        for (stall, field) in [
            ("{ after_s: 0.5 }", "stall.after_s: 0.5 must be in [1, 604800] seconds"),
            ("{ after_s: .nan }", "stall.after_s: NaN must be in"),
            ("{ after_s: 1e9 }", "stall.after_s: 1000000000 must be in"),
            ("{ steps: 0 }", "stall.steps: 0 must be in [1, 1000000]"),
            ("{ steps: -3, after_s: 60 }", "stall.steps: -3 must be in"),
        ] {
            let e = Policy::parse(&format!("name: x\n{rung}\nstall: {stall}")).unwrap_err();
            assert!(e.to_string().starts_with(field), "{stall}: {e}");
        }
        let e = Policy::parse(&format!("name: x\n{rung}\nstall: {{ after: 60 }}")).unwrap_err();
        assert!(e.to_string().contains("after"), "an unknown stall field is named: {e}");
        let p = Policy::parse(&format!("name: x\n{rung}\nstall: {{ steps: 50 }}")).unwrap();
        assert_eq!((p.stall.after_s, p.stall.steps), (600.0, 50.0), "an absent field keeps its default");
        // Every problem at once, in file order.
        let e = Policy::parse("name: x\nthresholds: { warn: 0.9, preempt: 0.5, sustain: 0 }\nrungs: []").unwrap_err();
        assert_eq!(
            e.to_string(),
            "3 problems\n  thresholds.preempt: 0.5 must be in [warn, 1]\n  thresholds.sustain: 0 must be in [1, 1000]\n  \
             rungs: must list at least one rung (a ladder with none cannot step down)"
        );
    }

    #[test]
    fn step_down_halves_micro_batch_keeping_global_batch_and_skips_what_cannot_apply() {
        let policy = Policy::parse(
            &std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/policies/default.yaml")).unwrap(),
        )
        .unwrap();
        let s = spec(8);
        let d0 = step_down(&policy, &s, LadderPosition { rung_index: -1 }).unwrap();
        assert_eq!(d0.rung_name, "bf16");
        assert_eq!(d0.spec.memory.precision, Precision::Bf16);
        assert!(d0.skipped.is_empty());
        let d = step_down(&policy, &d0.spec, LadderPosition { rung_index: d0.rung_index }).unwrap();
        assert_eq!(d.rung_name, "halve-micro-batch");
        assert_eq!(d.spec.train.micro_batch, 4);
        assert_eq!(d.spec.train.global_batch, 8);
        assert_eq!(d.spec.grad_accum(), 2);
        assert_eq!(d.spec.memory.precision, Precision::Bf16, "rungs apply on top of the previous ones");
        let d2 = step_down(&policy, &d.spec, LadderPosition { rung_index: d.rung_index }).unwrap();
        assert_eq!(d2.spec.train.micro_batch, 2);
        let d3 = step_down(&policy, &d2.spec, LadderPosition { rung_index: d2.rung_index }).unwrap();
        assert_eq!(d3.spec.train.micro_batch, 1);
        let d4 = step_down(&policy, &d3.spec, LadderPosition { rung_index: d3.rung_index }).unwrap();
        assert_eq!(d4.rung_name, "checkpointing");
        assert_eq!(d4.spec.memory.checkpointing, Checkpointing::Full);
        assert_eq!(d4.spec.train.micro_batch, 1);
        let d5 = step_down(&policy, &d4.spec, LadderPosition { rung_index: d4.rung_index }).unwrap();
        assert_eq!(d5.rung_name, "offload-optimizer");
        for zero in ["zero-1", "zero-2", "zero-3"] {
            assert!(d5.skipped.iter().any(|(n, r)| n == zero && r.contains("world_size")), "{:?}", d5.skipped);
        }
        let d6 = step_down(&policy, &d5.spec, LadderPosition { rung_index: d5.rung_index }).unwrap();
        assert_eq!(d6.rung_name, "offload-activations");
        assert_eq!(d6.spec.memory.offload.activations, OffloadTarget::Cpu);
        let d7 = step_down(&policy, &d6.spec, LadderPosition { rung_index: d6.rung_index }).unwrap();
        assert_eq!(d7.rung_name, "offload-params");
        assert_eq!(d7.spec.memory.offload.params, OffloadTarget::Cpu);
        assert!(
            step_down(&policy, &d7.spec, LadderPosition { rung_index: d7.rung_index }).is_err(),
            "ladder exhausted"
        );
    }

    /// A `tensor_parallel` rung applies where the world and the heads divide by it, keeps the
    /// global batch (fewer data-parallel ranks: more accumulation), and leaves ZeRO only where
    /// data-parallel ranks remain; each refusal says why, table-driven.
    #[test]
    fn a_tensor_parallel_rung_applies_only_where_the_world_allows() {
        let job = |world: i64, heads: i64| {
            let mut s = spec(2);
            s.model.n_head = heads;
            s.model.n_embd = 8 * heads;
            s.memory.world_size = world;
            s
        };
        let rung = |yaml: &str| Rung { name: "r".into(), set: serde_yaml::from_str(yaml).unwrap(), repeat: false };
        // (world, n_head, rung, the (tensor_parallel, grad_accum) it gives or why it cannot)
        type Want = Result<(i64, usize), &'static str>;
        let cases: [(i64, i64, &str, Want); 6] = [
            (2, 4, "{ tensor_parallel: 2 }", Ok((2, 4))),
            (4, 4, "{ tensor_parallel: 4 }", Ok((4, 4))),
            (4, 4, "{ tensor_parallel: 2 }", Ok((2, 2))),
            (1, 4, "{ tensor_parallel: 2 }", Err("needs a world_size it divides (it is 1)")),
            (4, 2, "{ tensor_parallel: 4 }", Err("needs an n_head it divides (it is 2)")),
            (2, 4, "{ tensor_parallel: 2, zero_stage: 1 }", Err("needs more than one data-parallel rank")),
        ];
        for (world, heads, set, want) in cases {
            let before = job(world, heads);
            match (apply_rung(&rung(set), &before), want) {
                (Ok(next), Ok((tp, accum))) => {
                    assert_eq!((next.memory.tensor_parallel, next.grad_accum()), (tp, accum), "{world} {heads} {set}");
                    assert_eq!(next.train.global_batch, before.train.global_batch);
                }
                (Err(e), Err(needle)) => assert!(e.contains(needle), "{world} {heads} {set}: {e}"),
                (got, want) => panic!("{world} {heads} {set}: {got:?}, wanted {want:?}"),
            }
        }
        // Pipeline stages: the world must hold tensor × pipeline ranks, the model enough layers.
        let mut deep = job(4, 4);
        deep.model.n_layer = 2;
        let next = apply_rung(&rung("{ pipeline_parallel: 2 }"), &deep).unwrap();
        assert_eq!((next.memory.pipeline_parallel, next.data_parallel(), next.grad_accum()), (2, 2, 2));
        let both = apply_rung(&rung("{ tensor_parallel: 2, pipeline_parallel: 2 }"), &deep).unwrap();
        assert_eq!((both.data_parallel(), both.grad_accum()), (1, 4));
        let e = apply_rung(&rung("{ pipeline_parallel: 3 }"), &deep).unwrap_err();
        assert!(e.contains("needs a world_size that tensor_parallel × 3 divides"), "{e}");
        let e = apply_rung(&rung("{ pipeline_parallel: 4 }"), &deep).unwrap_err();
        assert!(e.contains("needs at least 4 layers (n_layer is 2)"), "{e}");
        let e = Policy::parse("name: x\nrungs: [{ name: a, set: { pipeline_parallel: 65 } }]").unwrap_err();
        assert!(e.to_string().contains("rungs[0].set.pipeline_parallel: 65 must be in [1, 64]"), "{e}");
        let e = Policy::parse("name: x\nrungs: [{ name: a, set: { tensor_parallel: 0 } }]").unwrap_err();
        assert!(e.to_string().contains("rungs[0].set.tensor_parallel: 0 must be in [1, 64]"), "{e}");
    }
}
