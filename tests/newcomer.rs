//! What a newcomer does on a fresh machine: the demo from an empty directory, a daemon that
//! cannot start (changing nothing), `submit --follow`, and the README's walkthrough run as
//! written.

mod common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::*;

/// A `headroom serve` child whose stderr lines arrive on a channel; killed when dropped.
struct Daemon {
    child: Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Daemon {
    fn start(cwd: &Path, args: &[&str]) -> Daemon {
        let mut child = Command::new(bin())
            .arg("serve")
            .args(args)
            .current_dir(cwd)
            .env("HEADROOM_LOG", "warn")
            .env_remove("HEADROOM_ADDR")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start headroom serve");
        let (tx, lines) = mpsc::channel();
        let stderr = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        Daemon { child, lines, seen: Vec::new() }
    }

    /// The first stderr line containing `needle` (within 30 s).
    fn wait_for(&mut self, needle: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if line.contains(needle) {
                        return line;
                    }
                }
                Err(_) => panic!("no `{needle}` from the daemon; it said: {:#?}", self.seen),
            }
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn get(url: &str) -> serde_json::Value {
    let out = Command::new("curl").args(["-sf", url]).output().expect("curl");
    serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null)
}

fn entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    names
}

#[test]
fn the_demo_runs_from_an_empty_directory_and_follow_shows_progress() {
    let dir = tempfile::tempdir().unwrap();
    let mut daemon = Daemon::start(dir.path(), &["--demo", "--addr", "127.0.0.1:0"]);
    let serving = daemon.wait_for("serving http://");
    let url = serving.split_whitespace().find(|w| w.starts_with("http://")).unwrap().trim_end_matches('/').to_string();
    let hint = daemon.wait_for("demo job 1 submitted");
    // The next command is runnable as printed: this binary is not on PATH, so its full path.
    let exe = std::fs::canonicalize(bin()).unwrap();
    assert!(hint.contains(&format!("`{} show 1 --server {url}`", exe.display())), "{hint}");
    for created in ["policies/default.yaml", "data/shakespeare-tiny.txt", "headroom.db"] {
        assert!(dir.path().join(created).is_file(), "{created} missing: {:?}", entries(dir.path()));
    }
    // A job of one's own behind it, followed: events and progress lines in a pipe.
    // Its data path as a newcomer writes it: relative to where the daemon runs.
    let yaml =
        job_yaml("mine", 60, 16, 16, "64MiB").replace(&data_path().display().to_string(), "data/shakespeare-tiny.txt");
    let job = write_job(dir.path(), &yaml);
    let out = Command::new(bin()).args(["submit", "--follow", "--server", &url]).arg(&job).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("attempt_started"), "{stdout}");
    let progress: Vec<&str> = stdout.lines().filter(|l| l.starts_with("step ")).collect();
    assert!(progress.last().is_some_and(|l| l.starts_with("step 60/60 · loss ") && l.contains("tokens/s")), "{stdout}");
    assert!(stdout.trim_end().ends_with("job 2 finished"), "{stdout}");
    // The demo finished before it (one slot).
    assert_eq!(get(&format!("{url}/api/jobs/1"))["status"], "finished");
}

#[test]
fn a_daemon_that_cannot_start_exits_2_and_creates_nothing() {
    let dir = tempfile::tempdir().unwrap();
    // No data directory here, and no --demo to create one.
    let out = Command::new(bin()).args(["serve", "--addr", "127.0.0.1:0"]).current_dir(dir.path()).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--data-dir data"), "{stderr}");
    assert!(entries(dir.path()).is_empty(), "{:?}", entries(dir.path()));
    // The demo on an address in use: refused before it writes its files or the database.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let out = Command::new(bin()).args(["serve", "--demo", "--addr", &addr]).current_dir(dir.path()).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains(&format!("binding {addr}")), "{stderr}");
    assert!(entries(dir.path()).is_empty(), "{:?}", entries(dir.path()));
}

/// The README's walkthrough, block by block as a newcomer types it, in an empty directory with
/// `headroom` on PATH: the first block (the daemon) in the background, every other in order
/// under `bash -euo pipefail`. Only the port is chosen by the test (`HEADROOM_ADDR` /
/// `HEADROOM_URL`, which the commands read), so it cannot collide with a daemon already running.
#[test]
fn the_readme_walkthrough_runs_as_written() {
    let readme = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md")).unwrap();
    let start = readme.find("\n## Walkthrough").expect("README has a Walkthrough section");
    let section = &readme[start + 1..];
    let section = &section[..section[3..].find("\n## ").map_or(section.len(), |i| i + 3)];
    let blocks: Vec<&str> = section.split("```sh\n").skip(1).map(|b| &b[..b.find("```").unwrap()]).collect();
    assert!(blocks.len() >= 4, "{blocks:#?}");
    assert_eq!(blocks[0].trim(), "headroom serve --demo", "the first block starts the daemon");

    let dir = tempfile::tempdir().unwrap();
    let bin_dir = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(bin(), bin_dir.path().join("headroom")).unwrap();
    let path = format!("{}:{}", bin_dir.path().display(), std::env::var("PATH").unwrap_or_default());
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let (addr, url) = (format!("127.0.0.1:{port}"), format!("http://127.0.0.1:{port}"));
    let shell = |script: &str| {
        let mut command = Command::new("bash");
        command
            .args(["-euo", "pipefail", "-c", script])
            .current_dir(dir.path())
            .env("PATH", &path)
            .env("HEADROOM_ADDR", &addr)
            .env("HEADROOM_URL", &url)
            .env("HEADROOM_LOG", "warn")
            .env_remove("HEADROOM_TOKEN");
        command
    };
    let mut daemon = shell(blocks[0]).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
    let _guard = KillOnDrop(&mut daemon);
    let deadline = Instant::now() + Duration::from_secs(30);
    while get(&format!("{url}/api/jobs/1"))["id"] != 1 {
        assert!(Instant::now() < deadline, "the daemon did not come up with the demo job");
        std::thread::sleep(Duration::from_millis(200));
    }
    let mut transcript = String::new();
    for block in &blocks[1..] {
        let out = shell(block).output().unwrap();
        transcript +=
            &format!("$ {block}{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "a walkthrough block failed:\n{transcript}");
    }
    // What the text promises: the ladder job ran out of memory, stepped down and finished.
    let attempts = get(&format!("{url}/api/jobs/3/attempts"));
    let outcomes: Vec<&str> =
        attempts.as_array().unwrap().iter().map(|a| a["outcome"].as_str().unwrap_or("")).collect();
    assert!(outcomes.first() == Some(&"oom") && outcomes.last() == Some(&"finished"), "{outcomes:?}\n{transcript}");
    for id in 1..=3 {
        assert_eq!(get(&format!("{url}/api/jobs/{id}"))["status"], "finished", "job {id}\n{transcript}");
    }
}

struct KillOnDrop<'a>(&'a mut Child);

impl Drop for KillOnDrop<'_> {
    fn drop(&mut self) {
        // The block's bash and the daemon under it.
        let _ = Command::new("pkill").args(["-TERM", "-P", &self.0.id().to_string()]).status();
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
