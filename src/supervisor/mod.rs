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
pub use runner::{Supervisor, SupervisorConfig};

#[derive(Debug, Clone)]
pub struct ServeConfig {
    pub addr: SocketAddr,
    pub db_path: PathBuf,
    pub policies_dir: PathBuf,
    pub runs_dir: PathBuf,
    pub data_dirs: Vec<PathBuf>,
    pub token: Option<String>,
    pub slots: usize,
    pub trainer_exe: PathBuf,
}

/// A started daemon: its address, and handles to stop it.
pub struct RunningServer {
    pub addr: SocketAddr,
    pub supervisor: Arc<Supervisor>,
    stop: tokio::sync::oneshot::Sender<()>,
    server: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl RunningServer {
    /// Graceful shutdown: stop accepting, checkpoint and stop running children.
    pub async fn shutdown(self) -> anyhow::Result<()> {
        let _ = self.stop.send(());
        self.supervisor.shutdown().await;
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
    if !cfg.policies_dir.is_dir() {
        anyhow::bail!("--policies {} is not a directory", cfg.policies_dir.display());
    }
    let supervisor = Supervisor::start(
        db.clone(),
        SupervisorConfig {
            policies_dir: cfg.policies_dir.clone(),
            runs_dir: cfg.runs_dir.clone(),
            trainer_exe: cfg.trainer_exe.clone(),
            slots: cfg.slots,
        },
    )
    .await?;
    let gpus = Arc::new(crate::gpu::GpuMonitor::init());
    let state = http::AppState { db, supervisor: supervisor.clone(), token: cfg.token.clone(), data_dirs, gpus };
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
    Ok(RunningServer { addr, supervisor, stop, server })
}
