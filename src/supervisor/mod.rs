//! The supervisor daemon: HTTP API, experiment database, job runner, monitor, ladder decision
//! and policy files.
//! It sees a trainer only through argv, the job file, stdin control lines, the exit status and
//! JSON lines on stdout — never the engine's internals.

pub mod db;
pub mod http;
pub mod ladder;
pub mod monitor;
pub mod outcome;
pub mod policy;
pub mod runner;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;

pub use db::Db;
pub use runner::{Runner, RunnerConfig};

/// What `headroom serve` starts: the HTTP side (address, database, token, readable data
/// folders) and the job runner's own configuration.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    pub addr: SocketAddr,
    pub db_path: PathBuf,
    pub data_dirs: Vec<PathBuf>,
    pub token: Option<String>,
    pub runner: RunnerConfig,
}

/// A started daemon: its address, and handles to stop it.
pub struct RunningServer {
    pub addr: SocketAddr,
    pub runner: Arc<Runner>,
    stop: tokio::sync::oneshot::Sender<()>,
    server: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl RunningServer {
    /// Graceful shutdown: stop accepting, checkpoint and stop running children.
    pub async fn shutdown(self) -> anyhow::Result<()> {
        let _ = self.stop.send(());
        self.runner.shutdown().await;
        self.server.await??;
        Ok(())
    }
}

/// Open the DB, start the runner (requeueing unfinished jobs), bind and serve in the background.
pub async fn start(cfg: ServeConfig) -> anyhow::Result<RunningServer> {
    let db = Db::open(&cfg.db_path).await.with_context(|| format!("opening database {}", cfg.db_path.display()))?;
    let mut data_dirs = Vec::new();
    for d in &cfg.data_dirs {
        data_dirs.push(std::fs::canonicalize(d).with_context(|| format!("--data-dir {}", d.display()))?);
    }
    if !cfg.runner.policies_dir.is_dir() {
        anyhow::bail!("--policies {} is not a directory", cfg.runner.policies_dir.display());
    }
    let runner = Runner::start(db.clone(), cfg.runner.clone()).await?;
    let gpus = Arc::new(crate::gpu::GpuMonitor::init());
    let state = http::AppState { db, runner: runner.clone(), token: cfg.token.clone(), data_dirs, gpus };
    let listener = tokio::net::TcpListener::bind(cfg.addr).await.with_context(|| format!("binding {}", cfg.addr))?;
    let addr = listener.local_addr()?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let app = http::router(state);
    let server = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = stopped.await;
            })
            .await
    });
    tracing::info!(%addr, "headroom serving");
    Ok(RunningServer { addr, runner, stop, server })
}
