//! Filesystem helpers the trainer and the supervisor share: pid lock files (one trainer per run
//! directory, one daemon per database), fresh names for what is moved aside, and child
//! processes that die with their parent.

use std::fs::File;
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

/// Why a lock file could not be taken.
#[derive(Debug)]
pub enum LockError {
    /// Another process holds it; its pid as written in the file ("unknown" if none was).
    Held {
        holder: String,
    },
    Io(std::io::Error),
}

/// Take the exclusive `flock` on `path` (created if missing) without waiting and write our pid
/// into it. The kernel releases it when the returned file is dropped or the process ends,
/// however it ends.
pub fn lock_with_pid(path: &Path) -> Result<File, LockError> {
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(LockError::Io)?;
    match file.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => return Err(LockError::Held { holder: read_holder(&mut file) }),
        Err(std::fs::TryLockError::Error(e)) => return Err(LockError::Io(e)),
    }
    file.set_len(0).map_err(LockError::Io)?;
    file.rewind().map_err(LockError::Io)?;
    write!(file, "{}", std::process::id()).map_err(LockError::Io)?;
    Ok(file)
}

/// The pid holding `path`'s lock, or None when nobody does (or the file does not exist). Takes
/// nothing: a free lock is released again at once.
pub fn lock_holder(path: &Path) -> std::io::Result<Option<String>> {
    let mut file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    match file.try_lock() {
        Ok(()) => Ok(None),
        Err(std::fs::TryLockError::WouldBlock) => Ok(Some(read_holder(&mut file))),
        Err(std::fs::TryLockError::Error(e)) => Err(e),
    }
}

fn read_holder(file: &mut File) -> String {
    let mut holder = String::new();
    let _ = file.read_to_string(&mut holder);
    let holder = holder.trim();
    if holder.is_empty() {
        "unknown".into()
    } else {
        holder.to_string()
    }
}

/// `name(1)`, or the first of `name(2)`, `name(3)`, ... that does not exist yet.
pub fn unused_path(name: impl Fn(u32) -> PathBuf) -> PathBuf {
    (1..).map(name).find(|p| !p.exists()).expect("some name is free")
}

/// Have the child `cmd` starts killed when the thread that starts it ends, however it ends
/// (Linux: PR_SET_PDEATHSIG; also when the parent died between fork and prctl). The daemon's
/// trainers and a process-rank job's ranks die with their parent this way.
pub fn die_with_parent(cmd: &mut std::process::Command) {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        let parent = std::process::id();
        // SAFETY: the closure runs in the forked child before exec and calls only
        // async-signal-safe functions (prctl, getppid, _exit).
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::getppid() as u32 != parent {
                    libc::_exit(1);
                }
                Ok(())
            });
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = cmd;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pid_lock_is_exclusive_names_its_holder_and_is_released_on_drop() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(".lock");
        assert!(lock_holder(&path).unwrap().is_none(), "no file: nobody holds it");
        let held = lock_with_pid(&path).unwrap();
        let me = std::process::id().to_string();
        assert!(matches!(lock_with_pid(&path), Err(LockError::Held { holder }) if holder == me));
        assert_eq!(lock_holder(&path).unwrap(), Some(me));
        drop(held);
        assert!(lock_holder(&path).unwrap().is_none());
        lock_with_pid(&path).unwrap();
    }

    #[test]
    fn unused_path_skips_names_that_exist() {
        let dir = tempfile::tempdir().unwrap();
        let name = |n: u32| dir.path().join(if n == 1 { "a".to_string() } else { format!("a.{n}") });
        assert_eq!(unused_path(name), dir.path().join("a"));
        std::fs::write(dir.path().join("a"), b"").unwrap();
        std::fs::write(dir.path().join("a.2"), b"").unwrap();
        assert_eq!(unused_path(name), dir.path().join("a.3"));
    }
}
