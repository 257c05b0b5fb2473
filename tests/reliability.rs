//! Reliability under contention, faults and hostile input, against real `headroom serve`
//! processes, real SQLite files and real trainer processes on loopback: a busy database never
//! fails a job, SIGKILLed daemons lose no job and leave no trainer behind, run directories are
//! never shared or mixed up, hostile requests are answered fast, shutdown ends event streams.
//!
//! Sizes: HEADROOM_RELIABILITY_JOBS (default 500) concurrent submissions, HEADROOM_RELIABILITY_KILLS
//! (default 20) daemon SIGKILLs.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;
use sqlx::Connection;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn env_count(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// A `headroom serve` process on a port of its choosing.
struct Daemon {
    child: Child,
    base: String,
    stderr: Arc<Mutex<String>>,
}

impl Daemon {
    fn start(dir: &Path, slots: usize) -> Daemon {
        Self::try_start(dir, slots).unwrap_or_else(|(code, err)| panic!("serve exited {code:?}: {err}"))
    }

    /// Start, or the exit code and stderr of a daemon that refused to.
    fn try_start(dir: &Path, slots: usize) -> Result<Daemon, (Option<i32>, String)> {
        let mut child = Command::new(common::bin())
            .args(["serve", "--addr", "127.0.0.1:0", "--slots", &slots.to_string(), "--db"])
            .arg(dir.join("headroom.db"))
            .arg("--runs")
            .arg(dir.join("runs"))
            .arg("--policies")
            .arg(root().join("policies"))
            .arg("--data-dir")
            .arg(root().join("data"))
            .env("HEADROOM_LOG", "warn")
            .env("HEADROOM_TRAINER_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn headroom serve");
        let stderr = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let pipe = child.stderr.take().unwrap();
        let log = stderr.clone();
        // Drain stderr for the daemon's whole life (a full pipe would block it).
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                if let Some(rest) = line.split("serving http://").nth(1) {
                    let _ = tx.send(rest.split('/').next().unwrap_or("").to_string());
                }
                log.lock().unwrap().push_str(&(line + "\n"));
            }
        });
        let start = Instant::now();
        loop {
            if let Ok(addr) = rx.try_recv() {
                return Ok(Daemon { child, base: format!("http://{addr}"), stderr });
            }
            if let Some(status) = child.try_wait().unwrap() {
                std::thread::sleep(Duration::from_millis(100));
                return Err((status.code(), stderr.lock().unwrap().clone()));
            }
            assert!(start.elapsed() < Duration::from_secs(30), "daemon did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    fn sigterm(&self) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A job of a few steps that finishes in well under a second.
fn tiny_job(name: &str, steps: u64, checkpoint_every: u64) -> String {
    common::job_yaml(name, steps, 4, 4, "8MiB")
        .replace(
            "n_layer: 2, n_head: 4, n_embd: 64, block_size: 64",
            "n_layer: 1, n_head: 2, n_embd: 16, block_size: 16",
        )
        .replace("checkpoint_every: 50", &format!("checkpoint_every: {checkpoint_every}"))
        .replace("eval_every: 50", "eval_every: 1000")
}

async fn submit(http: &reqwest::Client, base: &str, yaml: &str) -> Result<i64, String> {
    let r = http.post(format!("{base}/api/jobs")).body(yaml.to_string()).send().await.map_err(|e| e.to_string())?;
    let status = r.status();
    let body: Value = r.json().await.map_err(|e| e.to_string())?;
    if status.as_u16() != 201 {
        return Err(format!("{status}: {body}"));
    }
    Ok(body["id"].as_i64().unwrap())
}

async fn open_db(dir: &Path) -> sqlx::SqliteConnection {
    let url = format!("sqlite://{}", dir.join("headroom.db").display());
    let mut c = sqlx::SqliteConnection::connect(&url).await.unwrap();
    sqlx::query("PRAGMA busy_timeout = 30000").execute(&mut c).await.unwrap();
    c
}

async fn job_statuses(dir: &Path) -> Vec<(i64, String, i64, i64)> {
    let mut c = open_db(dir).await;
    sqlx::query_as("SELECT id, status, steps_done, steps_requested FROM jobs ORDER BY id")
        .fetch_all(&mut c)
        .await
        .unwrap()
}

/// Wait until every job is finished, failed or cancelled.
async fn wait_all_terminal(dir: &Path, timeout: Duration) -> Vec<(i64, String, i64, i64)> {
    let start = Instant::now();
    loop {
        let jobs = job_statuses(dir).await;
        if jobs.iter().all(|j| matches!(j.1.as_str(), "finished" | "failed" | "cancelled")) {
            return jobs;
        }
        let open: Vec<_> =
            jobs.iter().filter(|j| !matches!(j.1.as_str(), "finished" | "failed" | "cancelled")).collect();
        assert!(
            start.elapsed() < timeout,
            "{} jobs still open after {timeout:?}: {:?}",
            open.len(),
            &open[..open.len().min(5)]
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Processes whose command line is a `headroom train` with a run directory under `runs`.
fn trainers_under(runs: &Path) -> Vec<u32> {
    let needle = runs.to_string_lossy().to_string();
    common::processes()
        .into_iter()
        .filter(|p| p.args.iter().any(|a| a == "train") && p.args.iter().any(|a| a.starts_with(&needle)))
        .map(|p| p.pid)
        .collect()
}

async fn unclosed_attempts(dir: &Path) -> i64 {
    let mut c = open_db(dir).await;
    let (n,): (i64,) =
        sqlx::query_as("SELECT COUNT(*) FROM attempts WHERE outcome IS NULL").fetch_one(&mut c).await.unwrap();
    n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn many_concurrent_submissions_and_an_external_exclusive_lock_fail_no_job() {
    let dir = tempfile::tempdir().unwrap();
    let daemon = Daemon::start(dir.path(), 2);
    let http = reqwest::Client::builder().pool_max_idle_per_host(64).build().unwrap();
    let n = env_count("HEADROOM_RELIABILITY_JOBS", 500);
    let started = Instant::now();
    let posts: Vec<_> = (0..n)
        .map(|i| {
            let (http, base) = (http.clone(), daemon.base.clone());
            tokio::spawn(async move { submit(&http, &base, &tiny_job(&format!("c{i}"), 3, 0)).await })
        })
        .collect();
    for p in posts {
        p.await.unwrap().expect("every submission is accepted");
    }
    eprintln!("{n} submissions accepted in {:.1} s", started.elapsed().as_secs_f64());

    // Another process takes the write lock for 12 s while jobs run: the runner waits it out.
    let mut other = open_db(dir.path()).await;
    sqlx::query("BEGIN EXCLUSIVE").execute(&mut other).await.unwrap();
    let locked = Instant::now();
    let late = {
        let (http, base) = (http.clone(), daemon.base.clone());
        tokio::spawn(async move { submit(&http, &base, &tiny_job("during-lock", 3, 0)).await })
    };
    tokio::time::sleep(Duration::from_secs(12)).await;
    sqlx::query("COMMIT").execute(&mut other).await.unwrap();
    drop(other);
    late.await.unwrap().expect("a submission during the lock is accepted once it ends");
    eprintln!("external lock held {:.1} s", locked.elapsed().as_secs_f64());

    let jobs = wait_all_terminal(dir.path(), Duration::from_secs(900)).await;
    eprintln!("{} jobs ended {:.1} s after the first submission", jobs.len(), started.elapsed().as_secs_f64());
    let bad: Vec<_> = jobs.iter().filter(|j| j.1 != "finished" || j.2 != j.3).collect();
    assert!(
        bad.is_empty(),
        "{} of {} jobs did not finish all their steps: {:?}",
        bad.len(),
        jobs.len(),
        &bad[..bad.len().min(5)]
    );
    assert_eq!(jobs.len(), n + 1);
    assert_eq!(unclosed_attempts(dir.path()).await, 0, "every attempt row is closed");
    let log = daemon.stderr.lock().unwrap().clone();
    assert!(log.contains("database busy"), "the lock was felt and waited out: {log}");
    drop(daemon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_daemons_lose_no_job_and_leave_no_trainer() {
    let dir = tempfile::tempdir().unwrap();
    let runs = dir.path().join("runs");
    let http = reqwest::Client::new();
    let mut daemon = Daemon::start(dir.path(), 1);
    for i in 0..5 {
        submit(&http, &daemon.base, &tiny_job(&format!("k{i}"), 40, 5)).await.unwrap();
    }
    let kills = env_count("HEADROOM_RELIABILITY_KILLS", 20);
    // Deterministic "random" moments: a splitmix sequence over 0.2..1.5 s.
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for k in 0..kills {
        x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        let delay = Duration::from_millis(200 + (z ^ (z >> 31)) % 1300);
        tokio::time::sleep(delay).await;
        daemon.kill();
        // Trainers die with their daemon.
        let start = Instant::now();
        while !trainers_under(&runs).is_empty() {
            assert!(
                start.elapsed() < Duration::from_secs(5),
                "kill {k}: trainers outlived the daemon: {:?}",
                trainers_under(&runs)
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        daemon = Daemon::start(dir.path(), 1);
    }
    let jobs = wait_all_terminal(dir.path(), Duration::from_secs(300)).await;
    for (id, status, done, requested) in &jobs {
        assert_eq!((status.as_str(), done), ("finished", requested), "job {id}");
    }
    assert_eq!(unclosed_attempts(dir.path()).await, 0);
    drop(daemon);
    let mut c = open_db(dir.path()).await;
    let (check,): (String,) = sqlx::query_as("PRAGMA integrity_check").fetch_one(&mut c).await.unwrap();
    assert_eq!(check, "ok");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_daemon_on_the_database_refuses_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let http = reqwest::Client::new();
    let first = Daemon::start(dir.path(), 1);
    let id = submit(&http, &first.base, &tiny_job("long", 100_000, 1000)).await.unwrap();
    // Wait for its attempt to be running.
    let start = Instant::now();
    while job_statuses(dir.path()).await[0].1 != "running" {
        assert!(start.elapsed() < Duration::from_secs(30));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let count = |sql: &'static str| {
        let dir = dir.path().to_path_buf();
        async move {
            let mut c = open_db(&dir).await;
            let (n,): (i64,) = sqlx::query_as(sql).fetch_one(&mut c).await.unwrap();
            n
        }
    };
    // What a second daemon's recovery would write: a `resumed` event, the live attempt closed
    // as crashed, a new start time.
    let last_start = || {
        let dir = dir.path().to_path_buf();
        async move {
            let mut c = open_db(&dir).await;
            let (v,): (String,) =
                sqlx::query_as("SELECT value FROM meta WHERE key = 'last_start'").fetch_one(&mut c).await.unwrap();
            v
        }
    };
    let before = last_start().await;
    let Err((code, stderr)) = Daemon::try_start(dir.path(), 1) else { panic!("a second daemon started") };
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("another headroom serve") && stderr.contains(&first.child.id().to_string()), "{stderr}");
    assert_eq!(last_start().await, before, "the refused daemon wrote nothing");
    assert_eq!(count("SELECT COUNT(*) FROM events WHERE kind = 'resumed'").await, 0);
    assert_eq!(unclosed_attempts(dir.path()).await, 1, "the live attempt is still open, not marked crashed");

    // SIGTERM with an event stream open: the daemon exits within 5 s.
    let mut stream = http
        .get(format!("{}/api/jobs/{id}/events", first.base))
        .header("accept", "text/event-stream")
        .send()
        .await
        .unwrap();
    assert!(stream.chunk().await.unwrap().is_some(), "the stream is open and sending");
    let mut first = first;
    first.sigterm();
    let start = Instant::now();
    let status = loop {
        if let Some(s) = first.child.try_wait().unwrap() {
            break s;
        }
        assert!(start.elapsed() < Duration::from_secs(5), "SIGTERM with an open stream: still running after 5 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(status.success(), "{status}: {}", first.stderr.lock().unwrap());
    // The stream ended rather than hanging.
    let end =
        tokio::time::timeout(Duration::from_secs(2), async { while let Ok(Some(_)) = stream.chunk().await {} }).await;
    assert!(end.is_ok(), "the event stream was not closed");
}

/// Raw HTTP/1.1 on a socket: what a hostile client sends.
fn raw_request(base: &str, head: &str, body: &[u8]) -> std::net::TcpStream {
    let mut s = std::net::TcpStream::connect(base.trim_start_matches("http://")).unwrap();
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    s
}

fn read_status(mut s: std::net::TcpStream, timeout: Duration) -> (u16, String) {
    s.set_read_timeout(Some(timeout)).unwrap();
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf);
    let text = String::from_utf8_lossy(&buf).into_owned();
    let code = text.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (code, text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_requests_are_answered_fast_and_the_daemon_stays_responsive() {
    let dir = tempfile::tempdir().unwrap();
    let daemon = Daemon::start(dir.path(), 1);
    let base = daemon.base.clone();
    let health = |base: String| async move {
        let t = Instant::now();
        let r = reqwest::get(format!("{base}/healthz")).await.unwrap();
        assert_eq!(r.status().as_u16(), 200);
        t.elapsed()
    };

    // 200 KB of nesting (under the body limit): a 4xx within a second, health answered meanwhile.
    let bomb = format!("a: {}{}", "[".repeat(100_000), "]".repeat(100_000));
    let http = reqwest::Client::new();
    let t = Instant::now();
    let posts: Vec<_> = (0..2)
        .map(|_| {
            let (http, base, bomb) = (http.clone(), base.clone(), bomb.clone());
            tokio::spawn(async move { http.post(format!("{base}/api/jobs")).body(bomb).send().await.unwrap() })
        })
        .collect();
    let during = health(base.clone()).await;
    for p in posts {
        let r = p.await.unwrap();
        assert_eq!(r.status().as_u16(), 400);
        let body: Value = r.json().await.unwrap();
        assert!(body["error"].as_str().unwrap().contains("nested deeper"), "{body}");
    }
    assert!(t.elapsed() < Duration::from_secs(1), "nested YAML answered in {:?}", t.elapsed());
    assert!(during < Duration::from_millis(100), "/healthz took {during:?} meanwhile");

    // A declared body far over the limit, never sent: 413 at once, as JSON.
    let t = Instant::now();
    let s = raw_request(&base, "POST /api/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999\r\n\r\n", b"");
    let (code, text) = read_status(s, Duration::from_secs(5));
    assert_eq!(code, 413, "{text}");
    assert!(text.contains("\"error\""), "{text}");
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());

    // A body that never completes: cut off (408), the daemon answering others meanwhile.
    let t = Instant::now();
    let s = raw_request(&base, "POST /api/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n", b"name: x");
    let during = health(base.clone()).await;
    let (code, text) = read_status(s, Duration::from_secs(20));
    assert_eq!(code, 408, "{text}");
    assert!(t.elapsed() < Duration::from_secs(12), "{:?}", t.elapsed());
    assert!(during < Duration::from_millis(100), "/healthz took {during:?} meanwhile");

    // Cross-site posts and non-YAML bodies are refused; errors are JSON everywhere.
    let job = tiny_job("x", 3, 0);
    let post = |ct: &'static str, origin: Option<&'static str>| {
        let mut r = http.post(format!("{base}/api/jobs")).header("content-type", ct).body(job.clone());
        if let Some(o) = origin {
            r = r.header("origin", o);
        }
        r.send()
    };
    assert_eq!(post("text/plain", None).await.unwrap().status().as_u16(), 415);
    assert_eq!(post("application/x-www-form-urlencoded", None).await.unwrap().status().as_u16(), 415);
    assert_eq!(post("image/png", None).await.unwrap().status().as_u16(), 415);
    assert_eq!(post("application/yaml", Some("https://evil.example")).await.unwrap().status().as_u16(), 403);
    let same_origin = base.clone();
    let r = http
        .post(format!("{base}/api/jobs"))
        .header("content-type", "application/yaml")
        .header("origin", same_origin)
        .body(job.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 201, "same-origin submissions (the web page's) are accepted");
    for (method, path, status) in [
        ("GET", "/no/such/route", 404),
        ("DELETE", "/api/jobs", 405),
        ("GET", "/api/jobs?limit=x", 400),
        ("GET", "/api/jobs?status=bogus", 400),
    ] {
        let r = http.request(method.parse().unwrap(), format!("{base}{path}")).send().await.unwrap();
        assert_eq!(r.status().as_u16(), status, "{method} {path}");
        let body: Value = r.json().await.unwrap_or(Value::Null);
        assert!(body["error"].is_string(), "{method} {path}: {body}");
    }

    // Admission: a job larger than the machine is refused naming the field and the figure.
    let huge = tiny_job("huge", 3, 0).replace("device_memory: 8MiB", "device_memory: 100TiB");
    let r = http.post(format!("{base}/api/jobs")).body(huge).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 400);
    let body: Value = r.json().await.unwrap();
    assert!(body["error"].as_str().unwrap().contains("device.device_memory: 100.00 TiB"), "{body}");
    drop(daemon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_database_never_resumes_another_databases_run_directory() {
    let dir = tempfile::tempdir().unwrap();
    let http = reqwest::Client::new();
    let first = Daemon::start(dir.path(), 1);
    let old = submit(&http, &first.base, &tiny_job("old", 40, 10)).await.unwrap();
    wait_all_terminal(dir.path(), Duration::from_secs(120)).await;
    drop(first);
    // A new database, the same runs/: job ids start again at 1.
    std::fs::remove_file(dir.path().join("headroom.db")).unwrap();
    let _ = std::fs::remove_file(dir.path().join("headroom.db-wal"));
    let _ = std::fs::remove_file(dir.path().join("headroom.db-shm"));
    let second = Daemon::start(dir.path(), 1);
    let new = submit(&http, &second.base, &tiny_job("new", 20, 10)).await.unwrap();
    assert_eq!(old, new, "the same job id, so the same run directory path");
    let jobs = wait_all_terminal(dir.path(), Duration::from_secs(120)).await;
    assert_eq!((jobs[0].1.as_str(), jobs[0].2), ("finished", 20));
    let mut c = open_db(dir.path()).await;
    let (resumed,): (Option<i64>,) =
        sqlx::query_as("SELECT resumed_from_step FROM attempts WHERE job_id = ? ORDER BY number LIMIT 1")
            .bind(new)
            .fetch_one(&mut c)
            .await
            .unwrap();
    assert_eq!(resumed, None, "the new job started from step 0");
    let (moved,): (String,) =
        sqlx::query_as("SELECT message FROM events WHERE kind = 'run_dir_superseded'").fetch_one(&mut c).await.unwrap();
    assert!(moved.contains("moved to"), "{moved}");
    let superseded: Vec<_> = std::fs::read_dir(dir.path().join("runs"))
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("job-1.superseded-"))
        .collect();
    assert_eq!(superseded.len(), 1, "the old run's directory is kept aside");
    assert!(superseded[0].path().join("ckpt-00000040.bin").is_file(), "with its checkpoints");
    drop(second);
}

#[test]
fn a_daemon_with_a_missing_path_exits_2_and_creates_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(common::bin())
        .args(["serve", "--addr", "127.0.0.1:0", "--data-dir", "no-such-data", "--db"])
        .arg(dir.path().join("headroom.db"))
        .arg("--runs")
        .arg(dir.path().join("runs"))
        .arg("--policies")
        .arg(root().join("policies"))
        .current_dir(dir.path())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--data-dir no-such-data"), "{stderr}");
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().flatten().map(|e| e.file_name()).collect();
    assert!(left.is_empty(), "nothing created: {left:?}");
}
