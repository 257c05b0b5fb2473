//! The experiment-history page in a real browser: a daemon on port 0 with a fresh database runs a
//! real job through OOMs and step-downs; tests/browser/check.mjs then drives headless Chromium
//! (Debian's package, through playwright-core) against it. `.ci/run` installs both and sets
//! HEADROOM_BROWSER_TEST=1, which makes this test required; elsewhere it says it was skipped.
//! Screenshots land in `ci-artifacts/browser/`.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use headroom::supervisor::db::NewJob;
use headroom::supervisor::{self, RunnerConfig, ServeConfig};

const XSS_NAME: &str = "<img src=x onerror=alert(1)>";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_page_in_headless_chromium() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let required = std::env::var("HEADROOM_BROWSER_TEST").is_ok_and(|v| v == "1");
    let ready =
        root.join("tests/browser/node_modules/playwright-core").is_dir() && Path::new("/usr/bin/chromium").exists();
    if !ready {
        assert!(
            !required,
            "HEADROOM_BROWSER_TEST=1 but chromium or tests/browser/node_modules is missing (see .ci/run)"
        );
        eprintln!("skipped: install chromium and run `npm install` in tests/browser (or run .ci/run)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // The page is checked on a job that OOMs and steps down: the default ladder walked one
    // attempt per rung (`strategy: ladder`; the shipped default would skip the OOMs).
    let policies = dir.path().join("policies");
    std::fs::create_dir_all(&policies).unwrap();
    let default = std::fs::read_to_string(root.join("policies/default.yaml")).unwrap();
    std::fs::write(policies.join("ladder.yaml"), default.replace("name: default", "name: ladder\nstrategy: ladder"))
        .unwrap();
    let server = supervisor::start(ServeConfig {
        addr: "127.0.0.1:0".parse().unwrap(),
        db_path: dir.path().join("headroom.db"),
        data_dirs: vec![root.join("data")],
        token: None,
        max_device_memory: None,
        seed: Default::default(),
        runner: RunnerConfig {
            policies_dir: policies,
            runs_dir: dir.path().join("runs"),
            trainer_exe: common::bin(),
            slots: 1,
            trainer_env: Vec::new(),
        },
    })
    .await
    .unwrap();
    let base = format!("http://{}", server.addr);
    let job = common::job_yaml("squeeze", 40, 32, 32, "12MiB").replace("eval_every: 50", "eval_every: 10")
        + "policy: ladder\n";
    let client = reqwest::Client::new();
    let resp = client.post(format!("{base}/api/jobs")).body(job).send().await.unwrap();
    assert_eq!(resp.status().as_u16(), 201);
    let id = resp.json::<serde_json::Value>().await.unwrap()["id"].as_i64().unwrap();
    let start = Instant::now();
    loop {
        let j: serde_json::Value =
            client.get(format!("{base}/api/jobs/{id}")).send().await.unwrap().json().await.unwrap();
        if j["status"] == "finished" {
            break;
        }
        assert!(!matches!(j["status"].as_str(), Some("failed" | "cancelled")), "{j}");
        assert!(start.elapsed() < Duration::from_secs(180), "job did not finish: {j}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    // Rows the API would refuse (the name validator forbids markup) go straight into the DB, as a
    // corrupted or older database could hold them; plus 1,000 jobs for the load-time check.
    let db = &server.runner.db;
    let xss = db
        .create_job(&NewJob {
            name: XSS_NAME,
            policy: "default",
            spec_yaml: "{}",
            current_spec: "{}",
            steps: 10,
            capacity: Some(1 << 20),
        })
        .await
        .unwrap();
    db.set_job_status(xss, "failed", Some(XSS_NAME)).await.unwrap();
    db.event(xss, None, "failed", XSS_NAME).await.unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    for i in 0..1000 {
        sqlx::query(
            "INSERT INTO jobs (name, policy, spec_yaml, current_spec, status, steps_requested, created_at, updated_at) \
             VALUES (?, 'default', '{}', '{}', 'finished', 100, 0, 0)",
        )
        .bind(format!("bulk-{i:04}"))
        .execute(&mut *tx)
        .await
        .unwrap();
    }
    tx.commit().await.unwrap();

    let shots = root.join("ci-artifacts/browser");
    let out = tokio::process::Command::new("node")
        .arg(root.join("tests/browser/check.mjs"))
        .arg(&base)
        .arg(id.to_string())
        .arg(xss.to_string())
        .arg(&shots)
        .output()
        .await
        .expect("run node");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "browser checks failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    server.shutdown().await.unwrap();
}
