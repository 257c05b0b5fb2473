//! `headroom serve`: the daemon's flags, start-up (with the demo job) and signal handling.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;

use super::client::{runtime, Api, UsageError};
use crate::shipped::{self, Seed};
use crate::supervisor::{self, RunnerConfig, ServeConfig};

#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// Address to listen on (port 0: any free port, printed at start).
    #[arg(long, env = "HEADROOM_ADDR", default_value = "127.0.0.1:7878")]
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
    /// Bearer token required on mutating routes (prefer HEADROOM_TOKEN or --token-file: a
    /// flag's value is visible to every user in `ps`).
    #[arg(long, env = "HEADROOM_TOKEN", hide_env_values = true, conflicts_with = "token_file")]
    pub token: Option<String>,
    /// File holding the bearer token (its first line).
    #[arg(long)]
    pub token_file: Option<PathBuf>,
    /// Refuse jobs whose device.device_memory is above this size (e.g. 64GiB); jobs larger
    /// than the machine's memory are refused regardless.
    #[arg(long, value_parser = parse_size)]
    pub max_device_memory: Option<u64>,
    /// Jobs run at once.
    #[arg(long, default_value_t = 1)]
    pub slots: usize,
    /// Submit the shipped demo job (data/demo-job.yaml, carried in the binary) on start:
    /// planned before its first attempt, it starts on the fastest configuration predicted to
    /// fit and finishes. Works from any directory: a missing --policies directory is created
    /// with the stock policies, and the demo corpus written to the first --data-dir if it is
    /// not there.
    #[arg(long)]
    pub demo: bool,
}

fn parse_size(text: &str) -> Result<u64, String> {
    crate::memory::parse_bytes(text).map(|b| b as u64)
}

/// The token from --token / HEADROOM_TOKEN, or the first line of --token-file.
fn read_token(args: &ServeArgs) -> anyhow::Result<Option<String>> {
    let Some(path) = &args.token_file else { return Ok(args.token.clone()) };
    let text = std::fs::read_to_string(path).with_context(|| format!("--token-file {}", path.display()))?;
    let token = text.lines().next().unwrap_or("").trim().to_string();
    if token.is_empty() {
        anyhow::bail!("--token-file {}: the file is empty", path.display());
    }
    Ok(Some(token))
}

pub fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let token = read_token(&args)?;
    let demo_data = args.data_dirs.first().cloned().unwrap_or_else(|| PathBuf::from("data"));
    let seed = match args.demo {
        true => Seed::for_demo(&args.policies, &demo_data),
        false => Seed::default(),
    };
    runtime()?.block_on(async move {
        let cfg = ServeConfig {
            addr: args.addr,
            db_path: args.db,
            data_dirs: args.data_dirs,
            token: token.clone(),
            max_device_memory: args.max_device_memory,
            runner: RunnerConfig {
                policies_dir: args.policies,
                runs_dir: args.runs,
                trainer_exe: std::env::current_exe()?,
                slots: args.slots,
                trainer_env: Vec::new(),
            },
            seed,
        };
        // A daemon that cannot start as configured (database in use or unwritable, address
        // taken, a path missing) exits 2, having changed nothing.
        let server = supervisor::start(cfg).await.map_err(|e| UsageError(format!("{e:#}")))?;
        let url = format!("http://{}", server.addr);
        eprintln!("headroom: serving {url}/ (experiment history), API under {url}/api");
        if args.demo {
            let corpus = std::fs::canonicalize(demo_data.join(shipped::DEMO_CORPUS_NAME))?;
            let job = shipped::demo_job(&corpus).to_yaml();
            let api = Api { base: url.clone(), token: token.clone(), http: reqwest::Client::new() };
            let id = api.post("/api/jobs", job).await?["id"].clone();
            let show = super::self_command();
            let server = match server.addr.to_string().as_str() {
                "127.0.0.1:7878" => String::new(),
                addr => format!(" --server http://{addr}"),
            };
            eprintln!("headroom: demo job {id} submitted: follow it at {url}/ or `{show} show {id}{server}`");
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
