//! The HTTP client subcommands of a running daemon (`submit`, `jobs`, `show`).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use serde_json::Value;

use crate::memory::format_bytes;

/// A usage problem the user can fix (exit 2): unreadable file, server-side 4xx.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

#[derive(Debug, clap::Args)]
pub struct ServerArgs {
    /// Daemon address.
    #[arg(long, env = "HEADROOM_URL", default_value = "http://127.0.0.1:7878")]
    pub server: String,
    #[arg(long, env = "HEADROOM_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
}

#[derive(Debug, clap::Args)]
pub struct SubmitArgs {
    /// Job spec file (YAML or JSON).
    pub job: PathBuf,
    /// Print the job's events until it ends.
    #[arg(long)]
    pub follow: bool,
    #[command(flatten)]
    pub server: ServerArgs,
}

#[derive(Debug, clap::Args)]
pub struct JobsArgs {
    #[arg(long)]
    pub status: Option<String>,
    #[arg(long, default_value_t = 50)]
    pub limit: i64,
    #[command(flatten)]
    pub server: ServerArgs,
}

#[derive(Debug, clap::Args)]
pub struct ShowArgs {
    pub id: i64,
    #[command(flatten)]
    pub server: ServerArgs,
}

pub(super) fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread().enable_all().build()?)
}

pub(super) struct Api {
    pub(super) base: String,
    pub(super) token: Option<String>,
    pub(super) http: reqwest::Client,
}

impl Api {
    fn new(args: &ServerArgs) -> Api {
        Api {
            base: args.server.trim_end_matches('/').to_string(),
            token: args.token.clone(),
            http: reqwest::Client::new(),
        }
    }

    async fn handle(resp: reqwest::Response) -> anyhow::Result<Value> {
        let status = resp.status();
        let body: Value = resp.json().await.unwrap_or(Value::Null);
        if status.is_client_error() {
            let msg = body["error"].as_str().unwrap_or("request rejected").to_string();
            return Err(UsageError(format!("{status}: {msg}")).into());
        }
        if !status.is_success() {
            anyhow::bail!("server error {status}: {}", body["error"].as_str().unwrap_or(""));
        }
        Ok(body)
    }

    async fn get(&self, path: &str) -> anyhow::Result<Value> {
        let resp = self
            .http
            .get(format!("{}{path}", self.base))
            .send()
            .await
            .with_context(|| format!("GET {}{path}", self.base))?;
        Self::handle(resp).await
    }

    pub(super) async fn post(&self, path: &str, body: String) -> anyhow::Result<Value> {
        let mut req = self.http.post(format!("{}{path}", self.base)).body(body);
        if let Some(t) = &self.token {
            req = req.bearer_auth(t);
        }
        let resp = req.send().await.with_context(|| format!("POST {}{path}", self.base))?;
        Self::handle(resp).await
    }
}

pub fn submit(args: SubmitArgs) -> anyhow::Result<()> {
    let body = std::fs::read_to_string(&args.job).map_err(|e| UsageError(format!("{}: {e}", args.job.display())))?;
    runtime()?.block_on(async move {
        let api = Api::new(&args.server);
        let id = api.post("/api/jobs", body).await?["id"].as_i64().unwrap_or(0);
        println!("submitted job {id}");
        if args.follow {
            follow(&api, id).await?;
        }
        Ok(())
    })
}

/// Where a followed job stands, from its record and newest sample.
#[derive(Debug, Clone, PartialEq)]
struct Progress {
    step: u64,
    steps: u64,
    rung: String,
    loss: Option<f64>,
    tokens_per_s: Option<f64>,
}

impl Progress {
    /// `recent`: the newest samples, oldest first (an evaluation's sample carries no
    /// training loss: the newest that has each figure gives it).
    fn of(job: &Value, recent: &[Value]) -> Progress {
        let newest = |key: &str| recent.iter().rev().find_map(|s| s[key].as_f64());
        Progress {
            step: job["steps_done"].as_u64().unwrap_or(0),
            steps: job["steps_requested"].as_u64().unwrap_or(0),
            rung: job["rung"].as_str().unwrap_or("").to_string(),
            loss: newest("loss"),
            tokens_per_s: newest("tokens_per_s"),
        }
    }

    /// `loss 2.313 · 45.9k tokens/s · rung base`
    fn summary(&self) -> String {
        let mut parts = Vec::new();
        if let Some(l) = self.loss {
            parts.push(format!("loss {l:.3}"));
        }
        if let Some(t) = self.tokens_per_s {
            parts.push(match t {
                t if t >= 1e6 => format!("{:.2}M tokens/s", t / 1e6),
                t if t >= 1e3 => format!("{:.1}k tokens/s", t / 1e3),
                t => format!("{t:.0} tokens/s"),
            });
        }
        parts.push(format!("rung {}", self.rung));
        parts.join(" · ")
    }

    /// The plain form, for a log or a pipe: `step 120/300 · loss 2.313 · ...`
    fn line(&self) -> String {
        format!("step {}/{} · {}", self.step, self.steps, self.summary())
    }
}

/// Print a job's events until it ends, with its progress: a bar on a terminal, a plain line
/// every few seconds (when the step moved) otherwise. A job that does not finish is an error.
async fn follow(api: &Api, id: i64) -> anyhow::Result<()> {
    use std::io::IsTerminal;
    const PLAIN_EVERY: Duration = Duration::from_secs(5);
    let bar = match std::io::stdout().is_terminal() {
        true => {
            let bar = indicatif::ProgressBar::new(0);
            let style =
                indicatif::ProgressStyle::with_template("{bar:30.cyan/blue} {pos}/{len} steps · {msg} [{elapsed}]")
                    .expect("a valid template");
            bar.set_style(style);
            Some(bar)
        }
        false => None,
    };
    let say = |text: String| match &bar {
        Some(bar) => bar.println(text),
        None => println!("{text}"),
    };
    let (mut after, mut printed) = (0, None::<(std::time::Instant, u64)>);
    loop {
        for e in api.get(&format!("/api/jobs/{id}/events?after={after}")).await?.as_array().cloned().unwrap_or_default()
        {
            after = e["id"].as_i64().unwrap_or(after);
            say(format!("{:<16} {}", e["kind"].as_str().unwrap_or(""), e["message"].as_str().unwrap_or("")));
        }
        let job = api.get(&format!("/api/jobs/{id}")).await?;
        let recent = api.get(&format!("/api/jobs/{id}/samples?last=4")).await?;
        let progress = Progress::of(&job, recent.as_array().map(Vec::as_slice).unwrap_or_default());
        match &bar {
            Some(bar) => {
                bar.set_length(progress.steps);
                bar.set_position(progress.step);
                bar.set_message(progress.summary());
            }
            None => {
                let due = printed.is_none_or(|(at, step)| step != progress.step && at.elapsed() >= PLAIN_EVERY);
                if due && progress.step > 0 {
                    println!("{}", progress.line());
                    printed = Some((std::time::Instant::now(), progress.step));
                }
            }
        }
        let status = job["status"].as_str().unwrap_or("").to_string();
        if matches!(status.as_str(), "finished" | "failed" | "cancelled") {
            if let Some(bar) = &bar {
                bar.finish_and_clear();
            }
            if printed.is_none_or(|(_, step)| step != progress.step) {
                println!("{}", progress.line());
            }
            println!("job {id} {status}");
            if status != "finished" {
                anyhow::bail!("job {id} {status}: {}", job["reason"].as_str().unwrap_or(""));
            }
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

fn opt_bytes(v: &Value) -> String {
    v.as_u64().map(|b| format_bytes(b as usize)).unwrap_or_default()
}

pub fn jobs(args: JobsArgs) -> anyhow::Result<()> {
    runtime()?.block_on(async move {
        let api = Api::new(&args.server);
        let mut path = format!("/api/jobs?limit={}", args.limit);
        if let Some(s) = &args.status {
            path.push_str(&format!("&status={s}"));
        }
        let jobs = api.get(&path).await?;
        println!(
            "{:>5}  {:<24} {:<10} {:<20} {:>8} {:>13} {:>14} {:>10}",
            "id", "name", "status", "rung", "attempts", "steps", "peak reserved", "tokens/s"
        );
        for j in jobs.as_array().cloned().unwrap_or_default() {
            println!(
                "{:>5}  {:<24} {:<10} {:<20} {:>8} {:>13} {:>14} {:>10}",
                j["id"].as_i64().unwrap_or(0),
                j["name"].as_str().unwrap_or(""),
                j["status"].as_str().unwrap_or(""),
                j["rung"].as_str().unwrap_or(""),
                j["attempts"].as_i64().unwrap_or(0),
                format!("{}/{}", j["steps_done"], j["steps_requested"]),
                opt_bytes(&j["peak_reserved"]),
                j["mean_tokens_per_s"].as_f64().map(|t| format!("{t:.0}")).unwrap_or_default()
            );
        }
        Ok(())
    })
}

pub fn show(args: ShowArgs) -> anyhow::Result<()> {
    runtime()?.block_on(async move {
        let api = Api::new(&args.server);
        let id = args.id;
        let job = api.get(&format!("/api/jobs/{id}")).await?;
        println!(
            "job {id} {}: {} on rung {} ({}/{} steps){}",
            job["name"].as_str().unwrap_or(""),
            job["status"].as_str().unwrap_or(""),
            job["rung"].as_str().unwrap_or(""),
            job["steps_done"],
            job["steps_requested"],
            job["reason"].as_str().map(|r| format!(" — {r}")).unwrap_or_default()
        );
        println!(
            "\n{:>3}  {:<20} {:<10} {:>5} {:>11} {:>12} {:>12} {:>12} {:>10} {:>12} {:>10}",
            "#",
            "rung",
            "outcome",
            "exit",
            "steps",
            "activations",
            "allocated",
            "reserved",
            "tokens/s",
            "predicted",
            "tokens/s"
        );
        let attempts = api.get(&format!("/api/jobs/{id}/attempts")).await?.as_array().cloned().unwrap_or_default();
        for a in &attempts {
            println!(
                "{:>3}  {:<20} {:<10} {:>5} {:>11} {:>12} {:>12} {:>12} {:>10} {:>12} {:>10}",
                a["number"].as_i64().unwrap_or(0),
                a["rung"].as_str().unwrap_or(""),
                a["outcome"].as_str().unwrap_or("running"),
                a["exit_code"].as_i64().map(|c| c.to_string()).unwrap_or_default(),
                match (a["first_step"].as_i64(), a["last_step"].as_i64()) {
                    (Some(f), Some(l)) => format!("{f}-{l}"),
                    _ => "-".into(),
                },
                opt_bytes(&a["peak_activations"]),
                opt_bytes(&a["peak_allocated"]),
                opt_bytes(&a["peak_reserved"]),
                a["mean_tokens_per_s"].as_f64().map(|t| format!("{t:.0}")).unwrap_or_default(),
                opt_bytes(&a["predicted_allocated"]),
                a["predicted_tokens_per_s"].as_f64().map(|t| format!("{t:.0}")).unwrap_or_default()
            );
        }
        // The newest attempt's plan: what was considered, skipped and chosen.
        if let Some((number, plan)) = attempts.iter().rev().find_map(|a| {
            let plan: crate::supervisor::planner::Plan = serde_json::from_value(a["plan"].clone()).ok()?;
            Some((a["number"].as_i64().unwrap_or(0), plan))
        }) {
            println!("\nplan of attempt {number} (strategy {}):", crate::config::serde_name(&plan.strategy));
            print!("{}", plan.table());
        }
        println!();
        for e in api.get(&format!("/api/jobs/{id}/events")).await?.as_array().cloned().unwrap_or_default() {
            println!("{:<16} {}", e["kind"].as_str().unwrap_or(""), e["message"].as_str().unwrap_or(""));
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_reads_the_job_and_its_newest_sample() {
        let job = serde_json::json!({ "steps_done": 120, "steps_requested": 300, "rung": "bf16" });
        let step = serde_json::json!({ "loss": 2.31349, "tokens_per_s": 45925.0 });
        let eval = serde_json::json!({ "loss": null, "val_loss": 2.4, "tokens_per_s": null });
        let p = Progress::of(&job, &[step, eval]);
        assert_eq!(p.line(), "step 120/300 · loss 2.313 · 45.9k tokens/s · rung bf16");
        let none = Progress::of(&job, &[]);
        assert_eq!(none.line(), "step 120/300 · rung bf16");
        let fast = Progress { tokens_per_s: Some(1.25e6), ..p.clone() };
        assert!(fast.summary().contains("1.25M tokens/s"));
    }
}
