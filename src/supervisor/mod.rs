//! The supervisor daemon: HTTP API, experiment database, job runner, monitor, ladder decision
//! and policy files.
//! It sees a trainer only through argv, the job file, stdin control lines, the exit status and
//! JSON lines on stdout — never the engine's internals.

pub mod admission;
pub mod db;
pub mod http;
pub mod ladder;
pub mod monitor;
pub mod outcome;
pub mod planner;
pub mod policy;
pub mod run_dirs;
pub mod runner;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;

use crate::files::{self, LockError};

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
    /// The largest `device_memory` a job may ask for (admission control), beyond what the
    /// machine has.
    pub max_device_memory: Option<u64>,
    pub runner: RunnerConfig,
    /// What to create once every check has passed (`serve --demo`: the policies directory,
    /// the data directory, the demo corpus, where missing).
    pub seed: crate::shipped::Seed,
}

/// A started daemon: its address, and handles to stop it.
pub struct RunningServer {
    pub addr: SocketAddr,
    pub runner: Arc<Runner>,
    stop: tokio::sync::watch::Sender<bool>,
    server: tokio::task::JoinHandle<std::io::Result<()>>,
    /// Held while the daemon runs: one daemon per database.
    _db_lock: Option<std::fs::File>,
}

/// How long shutdown waits for open connections (event streams end at once; this bounds a
/// client that stops reading).
const CONNECTIONS_GRACE: Duration = Duration::from_secs(3);

impl RunningServer {
    /// Graceful shutdown: stop accepting, end event streams, checkpoint and stop running
    /// children.
    pub async fn shutdown(self) -> anyhow::Result<()> {
        let _ = self.stop.send(true);
        self.runner.shutdown().await;
        let mut server = self.server;
        match tokio::time::timeout(CONNECTIONS_GRACE, &mut server).await {
            Ok(joined) => joined??,
            Err(_) => {
                tracing::warn!("connections still open after {} s: closing them", CONNECTIONS_GRACE.as_secs());
                server.abort();
            }
        }
        Ok(())
    }
}

/// Take the database's daemon lock (`<db>.lock`, an exclusive flock holding our pid): a second
/// daemon on the same database refuses to start before it reads or changes anything.
fn lock_database(db_path: &Path) -> anyhow::Result<Option<std::fs::File>> {
    if db_path.as_os_str() == ":memory:" {
        return Ok(None);
    }
    let mut name = db_path.as_os_str().to_owned();
    name.push(".lock");
    let path = PathBuf::from(name);
    match files::lock_with_pid(&path) {
        Ok(file) => Ok(Some(file)),
        Err(LockError::Held { holder }) => anyhow::bail!(
            "--db {}: another headroom serve (pid {holder}) is using this database; stop it first or use another --db",
            db_path.display()
        ),
        Err(LockError::Io(e)) => {
            Err(e).with_context(|| format!("--db {}: cannot take the lock file {}", db_path.display(), path.display()))
        }
    }
}

/// Check the paths, bind, lock and open the DB (checking it can be written), write what
/// `cfg.seed` asks for, then start the runner (requeueing unfinished jobs) and serve in the
/// background. Nothing is recovered before the lock is held and the address bound: a daemon
/// that cannot start changes nothing.
pub async fn start(cfg: ServeConfig) -> anyhow::Result<RunningServer> {
    // Every path is checked, and the address bound, before anything is created.
    let seeded = |d: &Path| cfg.seed.data_dir.as_deref() == Some(d);
    for d in cfg.data_dirs.iter().filter(|d| !seeded(d)) {
        std::fs::canonicalize(d).with_context(|| format!("--data-dir {}", d.display()))?;
    }
    let policies = &cfg.runner.policies_dir;
    if !policies.is_dir() && cfg.seed.policies_dir.as_ref() != Some(policies) {
        anyhow::bail!(
            "--policies {} is not a directory (pass --policies DIR, or start with --demo to create it with the stock policies)",
            policies.display()
        );
    }
    let listener = tokio::net::TcpListener::bind(cfg.addr).await.with_context(|| format!("binding {}", cfg.addr))?;
    let addr = listener.local_addr()?;
    let db_lock = lock_database(&cfg.db_path)?;
    let db = Db::open(&cfg.db_path)
        .await
        .with_context(|| format!("--db {}: cannot open the database", cfg.db_path.display()))?;
    db.record_start()
        .await
        .with_context(|| format!("--db {}: the database cannot be written", cfg.db_path.display()))?;
    for line in cfg.seed.write().context("writing the demo's files")? {
        eprintln!("headroom: {line}");
    }
    let mut data_dirs = Vec::new();
    for d in &cfg.data_dirs {
        data_dirs.push(std::fs::canonicalize(d).with_context(|| format!("--data-dir {}", d.display()))?);
    }
    let runner = Runner::start(db.clone(), cfg.runner.clone()).await?;
    let gpus = Arc::new(crate::gpu::GpuMonitor::init());
    let machine = Arc::new(admission::Machine::detect(&gpus, cfg.max_device_memory));
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let state = http::AppState {
        db,
        runner: runner.clone(),
        token: cfg.token.clone(),
        data_dirs,
        gpus,
        shutdown: stopped.clone(),
        machine,
    };
    let app = http::router(state);
    let server = tokio::spawn(async move {
        let mut stopped = stopped;
        axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = stopped.wait_for(|s| *s).await;
            })
            .await
    });
    tracing::info!(%addr, "headroom serving");
    Ok(RunningServer { addr, runner, stop, server, _db_lock: db_lock })
}
