//! `headroom bench --plan`: the planner checked by brute force — every configuration of the
//! plan predicted to fit is trained for a few steps (a `headroom train` child each, in a
//! scratch run directory), and the fastest-fit choice's measured tokens/s is compared with the
//! best measured. A benchmark, not a test: timings on a busy machine are noisy, so each
//! configuration runs `rounds` times (interleaved) and keeps its best median.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};

use crate::config::JobSpec;
use crate::protocol::{Event, Line};
use crate::supervisor::ladder::LadderState;
use crate::supervisor::planner::{self, Calibration, Verdict};
use crate::supervisor::policy::{Policy, Strategy};

/// The ratio the issue asks of the choice: at least this share of the best measured.
pub const TARGET: f64 = 0.9;

/// Median tokens/s of one short run of `spec` (steps after the first two), or why it failed.
fn measure(spec: &JobSpec, steps: i64, scratch: &Path) -> anyhow::Result<f64> {
    let mut spec = spec.clone();
    spec.train.steps = steps;
    spec.train.warmup_steps = spec.train.warmup_steps.min(steps);
    spec.train.eval_every = 0;
    spec.train.checkpoint_every = 0;
    let run_dir = scratch.join("run");
    let _ = std::fs::remove_dir_all(&run_dir);
    let config = scratch.join("job.yaml");
    std::fs::write(&config, spec.to_yaml())?;
    let mut child = Command::new(std::env::current_exe()?)
        .args(["train", "--fresh", "--config"])
        .arg(&config)
        .arg("--run-dir")
        .arg(&run_dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::from(std::fs::File::create(scratch.join("train.log"))?))
        .spawn()?;
    let mut rates = Vec::new();
    for line in BufReader::new(child.stdout.take().expect("piped")).lines() {
        if let Some(Line { event: Event::Step(s), .. }) = Line::parse(&line?) {
            if s.step > 2 && s.tokens_per_s.is_finite() {
                rates.push(s.tokens_per_s);
            }
        }
    }
    let status = child.wait()?;
    if !status.success() || rates.is_empty() {
        let log = std::fs::read_to_string(scratch.join("train.log")).unwrap_or_default();
        let last = log.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("no output");
        anyhow::bail!("{} ({}): the trainer exited with {status}: {last}", config.display(), describe(&spec));
    }
    rates.sort_by(f64::total_cmp);
    Ok(rates[rates.len() / 2])
}

fn describe(spec: &JobSpec) -> String {
    format!("micro_batch {}, {}", spec.train.micro_batch, planner::describe_knobs(spec))
}

/// The brute-force table for `spec` on `policy`, and whether the choice met [`TARGET`].
pub fn plan_bench(spec: &JobSpec, policy: &Policy, steps: i64, rounds: usize) -> anyhow::Result<(String, bool)> {
    let policy = Policy { strategy: Strategy::FastestFit, ..policy.clone() };
    let state = LadderState::new(spec.clone(), "base".into(), -1);
    let calibration = Calibration::uncalibrated(&policy, &crate::config::serde_name(&spec.device.kind));
    let plan = planner::plan(&policy, &state, &planner::Excluded::default(), &calibration, None)
        .ok_or_else(|| anyhow::anyhow!("device.device_memory: the capacity is unknown, nothing to plan against"))?;
    let chosen = plan.chosen.ok_or_else(|| anyhow::anyhow!("nothing the policy allows is predicted to fit"))?;
    let fitting: Vec<usize> = (0..plan.candidates.len())
        .filter(|&i| matches!(plan.candidates[i].verdict, Verdict::Fits | Verdict::Chosen))
        .collect();
    let scratch = Scratch::new()?;
    let mut measured = vec![f64::NAN; plan.candidates.len()];
    for round in 0..rounds.max(1) {
        for &i in &fitting {
            let spec = plan.candidates[i].spec.as_ref().expect("planned candidates carry their spec");
            let tps = measure(spec, steps, &scratch.0)?;
            measured[i] = if round == 0 { tps } else { measured[i].max(tps) };
        }
    }
    let best = fitting.iter().map(|&i| measured[i]).fold(0.0, f64::max);
    let mut out = format!(
        "{:<20} {:>5} {:>5} {:<58} {:>10} {:>10} {:>6}\n",
        "rung", "micro", "accum", "knobs", "predicted", "measured", "ratio"
    );
    for &i in &fitting {
        let c = &plan.candidates[i];
        out.push_str(&format!(
            "{:<20} {:>5} {:>5} {:<58} {:>10.0} {:>10.0} {:>6.2}{}\n",
            c.rung,
            c.micro_batch,
            c.grad_accum,
            c.knobs,
            c.predicted_tokens_per_s,
            measured[i],
            measured[i] / best,
            if i == chosen { "  ← chosen" } else { "" }
        ));
    }
    let ratio = measured[chosen] / best;
    let ok = ratio >= TARGET;
    out.push_str(&format!(
        "chosen: {:.0} tokens/s = {ratio:.2} × the best measured ({best:.0}); target ≥ {TARGET}: {}\n",
        measured[chosen],
        if ok { "PASS" } else { "FAIL" }
    ));
    Ok((out, ok))
}

/// A scratch directory under the system's temporary one, removed when dropped.
struct Scratch(std::path::PathBuf);

impl Scratch {
    fn new() -> std::io::Result<Scratch> {
        let dir = std::env::temp_dir().join(format!("headroom-plan-bench-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        Ok(Scratch(dir))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
