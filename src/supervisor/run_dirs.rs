//! The supervisor's side of run directories and trainer processes: a job's directory is claimed
//! for it (one made by another database or job is moved aside, never resumed), no attempt
//! starts while another trainer holds the directory's lock, trainers die with their daemon, and
//! a restarted daemon kills the trainers its predecessor left behind.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::files;
use crate::protocol::{RunIdentity, RUN_LOCK_FILE};

/// Make `run_dir` the directory of `owner`: when it records another owner (or an unreadable
/// identity), move it to `<run_dir>.superseded-<unix time>` and say where. A directory with no
/// identity yet (new, or from before identities) is left as it is.
pub fn claim(run_dir: &Path, owner: &str) -> std::io::Result<Option<(PathBuf, String)>> {
    let found = match RunIdentity::read(run_dir) {
        Ok(None) => return Ok(None),
        Ok(Some(id)) if id.owner.as_deref() == Some(owner) => return Ok(None),
        Ok(Some(id)) => id.owner.unwrap_or_else(|| "no owner".into()),
        Err(e) => format!("an unreadable identity ({e})"),
    };
    let stamp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_secs();
    let name = run_dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let dest = files::unused_path(|n| {
        run_dir.with_file_name(if n == 1 {
            format!("{name}.superseded-{stamp}")
        } else {
            format!("{name}.superseded-{stamp}.{n}")
        })
    });
    std::fs::rename(run_dir, &dest)?;
    Ok(Some((dest, found)))
}

/// Wait until no process holds `run_dir`'s lock (a trainer of an earlier attempt finishing its
/// exit), for up to `timeout`; then the holder's pid as the error.
pub async fn wait_unlocked(run_dir: &Path, timeout: Duration) -> Result<(), String> {
    let path = run_dir.join(RUN_LOCK_FILE);
    let start = Instant::now();
    loop {
        match files::lock_holder(&path) {
            Ok(None) => return Ok(()),
            Ok(Some(_)) if start.elapsed() < timeout => tokio::time::sleep(Duration::from_millis(50)).await,
            Ok(Some(holder)) => {
                return Err(format!(
                    "run directory {} is still held by another trainer (pid {holder}) after {} s",
                    run_dir.display(),
                    timeout.as_secs()
                ))
            }
            Err(e) => return Err(format!("{}: {e}", path.display())),
        }
    }
}

/// Kill `pid` if it is a `headroom train` of `run_dir` (checked on its command line, so a
/// recycled pid is never hit). Whether one was killed.
pub fn kill_stale_trainer(pid: i64, run_dir: &Path) -> bool {
    let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else { return false };
    let args: Vec<String> = cmdline.split(|&b| b == 0).map(|a| String::from_utf8_lossy(a).into_owned()).collect();
    let dir = run_dir.to_string_lossy();
    let ours = args.iter().any(|a| a == "train") && args.iter().any(|a| *a == dir);
    let Ok(pid) = i32::try_from(pid) else { return false };
    // SAFETY: kill(2) has no memory effects; the pid was checked to be our trainer just now.
    ours && unsafe { libc::kill(pid, libc::SIGKILL) } == 0
}

/// Have the child killed when the daemon dies, however it dies (Linux: PR_SET_PDEATHSIG; the
/// signal follows the spawning thread, a runtime worker that lives as long as the daemon).
/// Checkpoints are atomic, so a killed trainer loses at most the steps since its last one.
pub fn die_with_parent(cmd: &mut tokio::process::Command) {
    crate::files::die_with_parent(cmd.as_std_mut());
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::RUN_IDENTITY_FILE;

    fn identity(dir: &Path, owner: Option<&str>) {
        let id = RunIdentity { format: 1, owner: owner.map(str::to_owned), lineage: "x".into(), model: [1; 5] };
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join(RUN_IDENTITY_FILE), serde_json::to_vec(&id).unwrap()).unwrap();
    }

    #[test]
    fn a_directory_of_another_owner_is_moved_aside_and_ours_is_kept() {
        let runs = tempfile::tempdir().unwrap();
        let dir = runs.path().join("job-1");
        assert_eq!(claim(&dir, "db/job-1").unwrap(), None, "missing: nothing to do");
        identity(&dir, Some("db/job-1"));
        assert_eq!(claim(&dir, "db/job-1").unwrap(), None);
        assert!(dir.is_dir());
        identity(&dir, Some("olddb/job-1"));
        let (moved, found) = claim(&dir, "db/job-1").unwrap().expect("moved");
        assert_eq!(found, "olddb/job-1");
        assert!(!dir.exists() && moved.join(RUN_IDENTITY_FILE).is_file());
        assert!(moved.file_name().unwrap().to_string_lossy().starts_with("job-1.superseded-"));
    }

    #[tokio::test]
    async fn waiting_for_the_lock_ends_when_the_holder_lets_go() {
        let dir = tempfile::tempdir().unwrap();
        wait_unlocked(dir.path(), Duration::ZERO).await.unwrap();
        let held = std::fs::File::create(dir.path().join(RUN_LOCK_FILE)).unwrap();
        held.lock().unwrap();
        let err = wait_unlocked(dir.path(), Duration::from_millis(100)).await.unwrap_err();
        assert!(err.contains("still held"), "{err}");
        let release = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            drop(held);
        });
        wait_unlocked(dir.path(), Duration::from_secs(5)).await.unwrap();
        release.await.unwrap();
    }

    #[test]
    fn only_a_trainer_of_that_directory_is_killed() {
        // This test process is not `headroom train <dir>`: never killed.
        assert!(!kill_stale_trainer(std::process::id() as i64, Path::new("/nonexistent/run")));
        assert!(!kill_stale_trainer(i64::from(i32::MAX), Path::new("/nonexistent/run")));
    }
}
