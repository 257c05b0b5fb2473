//! `headroom serve`: the daemon's flags, start-up (with the demo job) and signal handling.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;

use super::client::{runtime, Api};
use crate::supervisor::{self, RunnerConfig, ServeConfig};

#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    #[arg(long, default_value = "127.0.0.1:7878")]
    pub addr: SocketAddr,
    /// SQLite experiment database (created if missing).
    #[arg(long, default_value = "headroom.db")]
    pub db: PathBuf,
    /// Directory of policy files.
    #[arg(long, default_value = "policies")]
    pub policies: PathBuf,
    /// Directory for run directories (checkpoints, attempt configs and logs).
    #[arg(long, default_value = "runs")]
    pub runs: PathBuf,
    /// Directories job data may come from (repeatable).
    #[arg(long = "data-dir", default_value = "data")]
    pub data_dirs: Vec<PathBuf>,
    /// Bearer token required on mutating routes.
    #[arg(long, env = "HEADROOM_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// Jobs run at once.
    #[arg(long, default_value_t = 1)]
    pub slots: usize,
    /// Submit the shipped demo job (data/demo-job.yaml) on start: it OOMs, steps down, finishes.
    #[arg(long)]
    pub demo: bool,
}

pub fn serve(args: ServeArgs) -> anyhow::Result<()> {
    runtime()?.block_on(async move {
        let cfg = ServeConfig {
            addr: args.addr,
            db_path: args.db,
            data_dirs: args.data_dirs,
            token: args.token.clone(),
            runner: RunnerConfig {
                policies_dir: args.policies,
                runs_dir: args.runs,
                trainer_exe: std::env::current_exe()?,
                slots: args.slots,
            },
        };
        let server = supervisor::start(cfg).await?;
        let url = format!("http://{}", server.addr);
        eprintln!("headroom: serving {url}/ (experiment history), API under {url}/api");
        if args.demo {
            let job = std::fs::read_to_string("data/demo-job.yaml").context("reading data/demo-job.yaml")?;
            let api = Api { base: url.clone(), token: args.token.clone(), http: reqwest::Client::new() };
            let id = api.post("/api/jobs", job).await?["id"].clone();
            eprintln!("headroom: demo job {id} submitted: follow it at {url}/ or `headroom show {id}`");
        }
        shutdown_signal().await;
        eprintln!("headroom: shutting down; running jobs checkpoint and resume on next start");
        server.shutdown().await
    })
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM handler");
        tokio::select! { _ = ctrl_c => {}, _ = term.recv() => {} }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}
