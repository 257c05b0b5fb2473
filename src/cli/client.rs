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
            let mut after = 0;
            loop {
                for e in api
                    .get(&format!("/api/jobs/{id}/events?after={after}"))
                    .await?
                    .as_array()
                    .cloned()
                    .unwrap_or_default()
                {
                    after = e["id"].as_i64().unwrap_or(after);
                    println!("{:<16} {}", e["kind"].as_str().unwrap_or(""), e["message"].as_str().unwrap_or(""));
                }
                let job = api.get(&format!("/api/jobs/{id}")).await?;
                let status = job["status"].as_str().unwrap_or("").to_string();
                if matches!(status.as_str(), "finished" | "failed" | "cancelled") {
                    println!("job {id} {status}");
                    if status != "finished" {
                        anyhow::bail!("job {id} {status}: {}", job["reason"].as_str().unwrap_or(""));
                    }
                    break;
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
        Ok(())
    })
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
