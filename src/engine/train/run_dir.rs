//! A trainer's hold on its run directory: the lock (one trainer per directory) and the
//! identity (`run.json`: owner, lineage, model shape), checked before anything is written, so a
//! directory is never shared by two trainers nor resumed by a run it does not belong to.

use std::fs::File;
use std::hash::{BuildHasher, Hasher};
use std::path::{Path, PathBuf};

use crate::files::{self, LockError};
use crate::protocol::{RunIdentity, RUN_IDENTITY_FILE, RUN_LOCK_FILE};

use super::checkpoint;

/// Where checkpoints of an earlier lineage go on a `--fresh` start (moved aside, never deleted).
pub const SUPERSEDED_DIR: &str = "superseded";

#[derive(Debug, thiserror::Error)]
pub enum RunDirError {
    #[error("run directory {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("run directory {path} is in use by another trainer (pid {holder}); wait for it or use another --run-dir")]
    Locked { path: PathBuf, holder: String },
    #[error(
        "run directory {path} belongs to {found} but this run is {expected}: use another --run-dir \
         (or --fresh to start a new run there, keeping the old checkpoints under {SUPERSEDED_DIR}/)"
    )]
    Owner { path: PathBuf, found: String, expected: String },
    #[error(
        "run directory {path} holds a run of another model (n_layer, n_head, n_embd, block_size, vocab) \
         {found:?}, this job's is {expected:?}: use another --run-dir, or --fresh to start over there"
    )]
    Model { path: PathBuf, found: [u64; 5], expected: [u64; 5] },
    #[error("run directory {path}: unreadable {RUN_IDENTITY_FILE}: {message}")]
    Identity { path: PathBuf, message: String },
}

/// An open run directory: locked for this process until dropped (by rank 0 of a process
/// group; the other ranks follow it, see [`RunDir::follow`]).
#[derive(Debug)]
pub struct RunDir {
    pub path: PathBuf,
    pub identity: RunIdentity,
    _lock: Option<File>,
}

impl RunDir {
    /// Lock `path` (creating it) and check or write its identity. `fresh` starts a new lineage:
    /// the checkpoints already there move to `superseded/<old lineage>/`.
    pub fn open(path: &Path, owner: Option<&str>, model: [u64; 5], fresh: bool) -> Result<RunDir, RunDirError> {
        let io = |source| RunDirError::Io { path: path.to_path_buf(), source };
        std::fs::create_dir_all(path).map_err(io)?;
        let lock = lock(path)?;
        let found = RunIdentity::read(path).map_err(|message| RunDirError::Identity { path: path.into(), message })?;
        let describe =
            |o: Option<&str>| o.map_or("a run with no owner (a hand-run `headroom train`)".into(), |o| o.to_string());
        let identity = match found {
            Some(id) if !fresh => {
                if id.owner.as_deref() != owner {
                    return Err(RunDirError::Owner {
                        path: path.into(),
                        found: describe(id.owner.as_deref()),
                        expected: describe(owner),
                    });
                }
                if id.model != model {
                    return Err(RunDirError::Model { path: path.into(), found: id.model, expected: model });
                }
                id
            }
            found => {
                let old = found.map_or_else(|| "unnamed".to_string(), |id| id.lineage);
                if fresh {
                    set_aside(path, &old).map_err(io)?;
                }
                let id = RunIdentity { format: 1, owner: owner.map(str::to_owned), lineage: new_lineage(), model };
                write_identity(path, &id).map_err(io)?;
                id
            }
        };
        Ok(RunDir { path: path.into(), identity, _lock: Some(lock) })
    }

    /// A rank process's view of the directory rank 0 opened (and holds locked) for the job:
    /// its identity as rank 0 sent it. Such a rank reads checkpoints and never writes one.
    pub fn follow(path: &Path, identity: RunIdentity) -> RunDir {
        RunDir { path: path.into(), identity, _lock: None }
    }

    pub fn lineage(&self) -> &str {
        &self.identity.lineage
    }
}

/// Take the directory's lock without waiting, writing our pid into it.
fn lock(path: &Path) -> Result<File, RunDirError> {
    let lock_path = path.join(RUN_LOCK_FILE);
    files::lock_with_pid(&lock_path).map_err(|e| match e {
        LockError::Held { holder } => RunDirError::Locked { path: path.into(), holder },
        LockError::Io(source) => RunDirError::Io { path: lock_path.clone(), source },
    })
}

/// Move every checkpoint of the old lineage to `superseded/<lineage>/` (a unique folder).
fn set_aside(path: &Path, lineage: &str) -> std::io::Result<()> {
    let old = checkpoint::list(path);
    if old.is_empty() {
        return Ok(());
    }
    let base = path.join(SUPERSEDED_DIR);
    let dest = files::unused_path(|n| base.join(if n == 1 { lineage.to_string() } else { format!("{lineage}.{n}") }));
    std::fs::create_dir_all(&dest)?;
    for file in &old {
        std::fs::rename(file, dest.join(file.file_name().expect("a checkpoint file name")))?;
    }
    tracing::info!("--fresh: {} checkpoint(s) of the previous run moved to {}", old.len(), dest.display());
    Ok(())
}

fn write_identity(path: &Path, id: &RunIdentity) -> std::io::Result<()> {
    let tmp = path.join(format!("{RUN_IDENTITY_FILE}.tmp"));
    std::fs::write(&tmp, serde_json::to_vec_pretty(id).expect("identity serialises"))?;
    std::fs::rename(&tmp, path.join(RUN_IDENTITY_FILE))
}

/// 64 random bits (the standard library's per-process random hasher keys) as hex.
fn new_lineage() -> String {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos());
    h.write_u32(std::process::id());
    format!("{:016x}", h.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    const MODEL: [u64; 5] = [2, 4, 64, 64, 256];

    #[test]
    fn a_second_trainer_finds_the_directory_locked_until_the_first_lets_go() {
        let dir = tempfile::tempdir().unwrap();
        let first = RunDir::open(dir.path(), None, MODEL, false).unwrap();
        let err = RunDir::open(dir.path(), None, MODEL, false).unwrap_err();
        assert!(
            matches!(&err, RunDirError::Locked { holder, .. } if *holder == std::process::id().to_string()),
            "{err}"
        );
        drop(first);
        RunDir::open(dir.path(), None, MODEL, false).unwrap();
    }

    #[test]
    fn identity_is_kept_checked_and_renewed_by_fresh() {
        let dir = tempfile::tempdir().unwrap();
        let lineage = RunDir::open(dir.path(), Some("db/job-1"), MODEL, false).unwrap().lineage().to_string();
        // Reopened by the same owner: the same lineage.
        assert_eq!(RunDir::open(dir.path(), Some("db/job-1"), MODEL, false).unwrap().lineage(), lineage);
        // Another owner, no owner, another model: refused, naming what was found.
        let err = RunDir::open(dir.path(), Some("db2/job-1"), MODEL, false).unwrap_err();
        assert!(matches!(err, RunDirError::Owner { .. }) && err.to_string().contains("db/job-1"), "{err}");
        assert!(matches!(RunDir::open(dir.path(), None, MODEL, false), Err(RunDirError::Owner { .. })));
        let other = [4, 4, 64, 64, 256];
        assert!(matches!(RunDir::open(dir.path(), Some("db/job-1"), other, false), Err(RunDirError::Model { .. })));
        // --fresh: a new lineage; the old checkpoints move aside, never deleted.
        std::fs::write(checkpoint::checkpoint_path(dir.path(), 100), b"old").unwrap();
        let fresh = RunDir::open(dir.path(), None, other, true).unwrap();
        assert_ne!(fresh.lineage(), lineage);
        assert!(checkpoint::list(dir.path()).is_empty());
        let moved = dir.path().join(SUPERSEDED_DIR).join(&lineage).join("ckpt-00000100.bin");
        assert_eq!(std::fs::read(moved).unwrap(), b"old");
    }
}
