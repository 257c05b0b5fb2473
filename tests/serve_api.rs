//! The supervisor end to end: a daemon on port 0 with a fresh database runs real trainer children.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use headroom::supervisor::{self, RunnerConfig, RunningServer, ServeConfig};
use serde_json::Value;

struct Harness {
    dir: tempfile::TempDir,
    policies: PathBuf,
    /// Extra environment of the daemon's trainer children.
    trainer_env: Vec<(String, String)>,
}

impl Harness {
    fn new() -> Harness {
        let dir = tempfile::tempdir().unwrap();
        let policies = dir.path().join("policies");
        std::fs::create_dir_all(&policies).unwrap();
        let shipped = Path::new(env!("CARGO_MANIFEST_DIR")).join("policies");
        for e in std::fs::read_dir(shipped).unwrap() {
            let p = e.unwrap().path();
            std::fs::copy(&p, policies.join(p.file_name().unwrap())).unwrap();
        }
        Harness { dir, policies, trainer_env: Vec::new() }
    }

    async fn start(&self, token: Option<&str>) -> RunningServer {
        supervisor::start(ServeConfig {
            addr: "127.0.0.1:0".parse().unwrap(),
            db_path: self.dir.path().join("headroom.db"),
            data_dirs: vec![Path::new(env!("CARGO_MANIFEST_DIR")).join("data")],
            token: token.map(str::to_owned),
            max_device_memory: None,
            seed: Default::default(),
            runner: RunnerConfig {
                policies_dir: self.policies.clone(),
                runs_dir: self.dir.path().join("runs"),
                trainer_exe: common::bin(),
                slots: 1,
                trainer_env: self.trainer_env.clone(),
            },
        })
        .await
        .unwrap()
    }
}

fn url(s: &RunningServer, path: &str) -> String {
    format!("http://{}{path}", s.addr)
}

async fn get(s: &RunningServer, path: &str) -> Value {
    let r = reqwest::get(url(s, path)).await.unwrap();
    assert!(r.status().is_success(), "GET {path}: {}", r.status());
    r.json().await.unwrap()
}

async fn post(s: &RunningServer, path: &str, body: &str) -> (u16, Value) {
    let r = reqwest::Client::new().post(url(s, path)).body(body.to_string()).send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

async fn submit(s: &RunningServer, yaml: &str) -> i64 {
    let (status, body) = post(s, "/api/jobs", yaml).await;
    assert_eq!(status, 201, "{body}");
    body["id"].as_i64().unwrap()
}

async fn wait_until<F, Fut>(what: &str, timeout: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while !check().await {
        assert!(start.elapsed() < timeout, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn wait_terminal(s: &RunningServer, id: i64) -> Value {
    let start = Instant::now();
    loop {
        let job = get(s, &format!("/api/jobs/{id}")).await;
        if matches!(job["status"].as_str(), Some("finished" | "failed" | "cancelled")) {
            return job;
        }
        assert!(start.elapsed() < Duration::from_secs(240), "timed out waiting for job {id} to end: {job}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The demo's shape: in fp32 micro_batch 32 needs ~26 MiB, in bf16 ~15 MiB, bf16 with micro_batch
/// 16 ~8 MiB, which fits in 12 MiB; fp32 with micro_batch 8 holds ~7.8 MiB.
fn squeezed_job(name: &str, steps: u64, micro: u64, policy: &str, ckpt_every: u64) -> String {
    common::job_yaml(name, steps, 32, micro, "12MiB")
        .replace("checkpoint_every: 50", &format!("checkpoint_every: {ckpt_every}"))
        .replace("eval_every: 50", "eval_every: 10")
        + &format!("policy: {policy}\n")
}

fn kinds(events: &Value) -> Vec<String> {
    events.as_array().unwrap().iter().map(|e| e["kind"].as_str().unwrap().to_string()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oom_steps_down_the_ladder_resumes_and_finishes() {
    let h = Harness::new();
    // The default ladder walked one attempt per rung (`strategy: ladder`), so the OOMs happen.
    let default = std::fs::read_to_string(h.policies.join("default.yaml")).unwrap();
    std::fs::write(h.policies.join("ladder.yaml"), default.replace("name: default", "name: ladder\nstrategy: ladder"))
        .unwrap();
    let s = h.start(None).await;
    let id = submit(&s, &squeezed_job("squeeze", 20, 32, "ladder", 10)).await;
    let job = wait_terminal(&s, id).await;
    assert_eq!(job["status"], "finished", "{job}");
    assert_eq!(job["rung"], "halve-micro-batch");

    let attempts = get(&s, &format!("/api/jobs/{id}/attempts")).await;
    let a = attempts.as_array().unwrap();
    let summary: Vec<(String, String, i64)> = a
        .iter()
        .map(|a| {
            (
                a["rung"].as_str().unwrap().into(),
                a["outcome"].as_str().unwrap().into(),
                a["exit_code"].as_i64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        summary,
        vec![
            ("base".into(), "oom".into(), 3),
            ("bf16".into(), "oom".into(), 3),
            ("halve-micro-batch".into(), "finished".into(), 0)
        ]
    );
    let cfg = |i: usize| -> Value { serde_json::from_str(a[i]["config_json"].as_str().unwrap()).unwrap() };
    assert_eq!(
        [0, 1, 2].map(|i| cfg(i)["memory"]["precision"].as_str().unwrap().to_string()),
        ["fp32", "bf16", "bf16"],
        "bf16 first, then kept by the next rung"
    );
    assert_eq!(
        [0, 1, 2].map(|i| cfg(i)["train"]["micro_batch"].as_i64().unwrap()),
        [32, 32, 16],
        "micro-batch halves with the same global batch"
    );
    assert!((0..3).all(|i| cfg(i)["train"]["global_batch"] == 32));
    // The ladder stopped exactly where the estimator says the configuration starts to fit.
    let verdicts: Vec<&str> = (0..3)
        .map(|i| {
            let spec: headroom::config::JobSpec = serde_json::from_value(cfg(i)).unwrap();
            let e = headroom::engine::estimate::estimate_job(&spec);
            headroom::engine::estimate::verdict(&e, 12 << 20)
        })
        .collect();
    assert_eq!(verdicts, ["no", "no", "yes"]);
    // fp32 runs out on an activation; bf16 (activations halved) on the attention's workspace.
    for (oom, category) in a[..2].iter().zip(["activations", "workspace"]) {
        assert_eq!(oom["oom_category"], category, "{oom}");
        assert!(oom["oom_requested"].as_i64().unwrap() > 0);
        assert_eq!(oom["capacity"], 12 << 20);
    }
    let done = &a[2];
    assert!(done["peak_reserved"].as_i64().unwrap() <= 12 << 20);
    assert!(done["peak_activations"].as_i64().unwrap() > 0 && done["mean_tokens_per_s"].as_f64().unwrap() > 0.0);

    // Steps trained add up to the request, each exactly once.
    let samples = get(&s, &format!("/api/jobs/{id}/samples")).await;
    let mut steps: Vec<i64> = samples
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["loss"].is_number())
        .map(|s| s["step"].as_i64().unwrap())
        .collect();
    steps.sort();
    assert_eq!(steps, (1..=20).collect::<Vec<_>>());
    // `?last=N`: the newest N, oldest first — the tail of the whole list.
    let all = samples.as_array().unwrap();
    let last = get(&s, &format!("/api/jobs/{id}/samples?last=3")).await;
    assert_eq!(last.as_array().unwrap().as_slice(), &all[all.len() - 3..]);
    let r = reqwest::get(url(&s, &format!("/api/jobs/{id}/samples?last=0"))).await.unwrap();
    assert_eq!(r.status().as_u16(), 400);
    assert!(r.text().await.unwrap().contains("last: 0 must be in [1, 10000]"));

    let events = get(&s, &format!("/api/jobs/{id}/events")).await;
    let k = kinds(&events);
    assert_eq!(k.iter().filter(|k| *k == "oom").count(), 2, "{k:?}");
    assert_eq!(k.iter().filter(|k| *k == "step_down").count(), 2, "{k:?}");
    let text = events.to_string();
    assert!(text.contains("precision fp32 → bf16"), "{text}");
    assert!(text.contains("micro_batch 32 → 16"), "{text}");
    assert!(text.contains("for activations did not fit in 12.00 MiB"), "{text}");
    s.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_fit_starts_on_the_first_rung_predicted_to_fit_with_no_oom() {
    let h = Harness::new();
    let default = std::fs::read_to_string(h.policies.join("default.yaml")).unwrap();
    std::fs::write(
        h.policies.join("first-fit.yaml"),
        default.replace("name: default", "name: first-fit\nstrategy: first_fit"),
    )
    .unwrap();
    let s = h.start(None).await;
    // The same squeezed job on the default ladder with `strategy: first_fit`: fp32 and bf16 at
    // micro-batch 32 are predicted not to fit 12 MiB, so the first attempt is already bf16 at
    // micro-batch 16.
    let id = submit(&s, &squeezed_job("planned", 12, 32, "first-fit", 0)).await;
    let job = wait_terminal(&s, id).await;
    assert_eq!(job["status"], "finished", "{job}");
    assert_eq!(job["rung"], "halve-micro-batch");
    let attempts = get(&s, &format!("/api/jobs/{id}/attempts")).await;
    let a = attempts.as_array().unwrap();
    assert_eq!(a.len(), 1, "no attempt spent on a configuration predicted not to fit: {attempts}");
    assert_eq!(a[0]["outcome"], "finished");
    let cfg: Value = serde_json::from_str(a[0]["config_json"].as_str().unwrap()).unwrap();
    assert_eq!((cfg["memory"]["precision"].as_str(), cfg["train"]["micro_batch"].as_i64()), (Some("bf16"), Some(16)));
    let events = get(&s, &format!("/api/jobs/{id}/events")).await;
    let k = kinds(&events);
    assert_eq!(k.iter().filter(|k| *k == "skip").count(), 2, "{k:?}");
    assert!(!k.contains(&"oom".to_string()), "{k:?}");
    let text = events.to_string();
    assert!(text.contains("rung base skipped: predicted") && text.contains("rung bf16 skipped: predicted"), "{text}");
    assert!(text.contains("the first configuration predicted to fit"), "{text}");
    s.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fastest_fit_starts_a_scaled_down_xl_case_on_its_fastest_fitting_configuration() {
    let h = Harness::new();
    let s = h.start(None).await;
    // The seed's headline case scaled down (4 layers, T 128 on 5 MiB): base, bf16, the
    // halvings and checkpointing are predicted not to fit at any micro-batch; the default policy
    // (fastest_fit) starts directly on offload-optimizer with the largest micro-batch predicted
    // to fit there — no attempt is spent on an OOM.
    let yaml = common::job_yaml("xl-scaled", 12, 32, 32, "5MiB")
        .replace("n_layer: 2", "n_layer: 4")
        .replace("block_size: 64", "block_size: 128")
        .replace("eval_every: 50", "eval_every: 6")
        .replace("checkpoint_every: 50", "checkpoint_every: 6");
    let id = submit(&s, &yaml).await;
    let job = wait_terminal(&s, id).await;
    assert_eq!(job["status"], "finished", "{job}");
    assert_eq!(job["rung"], "offload-optimizer", "{job}");
    let attempts = get(&s, &format!("/api/jobs/{id}/attempts")).await;
    let a = attempts.as_array().unwrap();
    assert_eq!(a.len(), 1, "zero OOM attempts: {attempts}");
    assert_eq!(a[0]["outcome"], "finished");
    assert_eq!(a[0]["last_step"], 12);
    // The attempt carries its plan: the chosen candidate is the largest micro-batch on its rung
    // predicted to fit, and every configuration on an earlier rung is too big.
    let plan = &a[0]["plan"];
    let candidates = plan["candidates"].as_array().unwrap();
    let chosen = &candidates[plan["chosen"].as_u64().unwrap() as usize];
    assert_eq!(chosen["verdict"], "chosen");
    let cfg: Value = serde_json::from_str(a[0]["config_json"].as_str().unwrap()).unwrap();
    assert_eq!(cfg["train"]["micro_batch"], chosen["micro_batch"]);
    assert!(chosen["micro_batch"].as_i64().unwrap() > 1, "{chosen}");
    for c in candidates {
        let same_rung = c["rung_index"] == chosen["rung_index"];
        if same_rung && c["micro_batch"].as_i64() > chosen["micro_batch"].as_i64() {
            assert_eq!(c["verdict"], "too_big", "{c}");
        }
        if c["rung_index"].as_i64() < chosen["rung_index"].as_i64() {
            assert_eq!(c["verdict"], "too_big", "{c}");
        }
    }
    // Predicted against measured, recorded on the attempt: the cpu estimator is exact to the
    // byte on this shape, the measured peak within the plan's limit.
    let (predicted, measured) =
        (a[0]["predicted_allocated"].as_i64().unwrap(), a[0]["peak_allocated"].as_i64().unwrap());
    assert_eq!(predicted, chosen["predicted_allocated"].as_i64().unwrap());
    assert!(measured <= plan["limit"].as_i64().unwrap(), "{measured} > {}", plan["limit"]);
    assert!(a[0]["predicted_tokens_per_s"].as_f64().unwrap() > 0.0 && a[0]["device_kind"] == "cpu");
    let events = get(&s, &format!("/api/jobs/{id}/events")).await;
    let k = kinds(&events);
    assert!(!k.contains(&"oom".to_string()), "{k:?}");
    let text = events.to_string();
    for rung in ["base", "bf16", "checkpointing"] {
        assert!(text.contains(&format!("rung {rung} skipped: predicted")), "{rung}: {text}");
    }
    assert!(text.contains("fastest fit: rung offload-optimizer ("), "{text}");
    // Warm start: the same job again starts from where the first one finished, and says so.
    let again = submit(&s, &yaml).await;
    let job2 = wait_terminal(&s, again).await;
    assert_eq!((job2["status"].as_str(), job2["rung"].as_str()), (Some("finished"), Some("offload-optimizer")));
    let events = get(&s, &format!("/api/jobs/{again}/events")).await;
    let k2 = kinds(&events);
    let at = |kind: &str| k2.iter().position(|k| k == kind);
    assert!(at("warm_start").is_some() && at("warm_start") < at("attempt_started"), "{k2:?}");
    assert!(events.to_string().contains(&format!("warm start from job {id}:")), "{events}");
    let a2 = get(&s, &format!("/api/jobs/{again}/attempts")).await;
    assert_eq!(a2.as_array().unwrap().len(), 1);
    let cfg2: Value = serde_json::from_str(a2[0]["config_json"].as_str().unwrap()).unwrap();
    assert_eq!((&cfg2["memory"], &cfg2["train"]["micro_batch"]), (&cfg["memory"], &cfg["train"]["micro_batch"]));
    s.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_taken_by_another_process_steps_the_job_down_and_its_release_steps_it_back_up() {
    // A simulated GPU (gpu::SimulatedGpu, the fake NVML provider): the trainers' step events
    // report what "other processes" hold as written in a file, on a GPU as large as the pool.
    let mut h = Harness::new();
    let others = h.dir.path().join("others-bytes");
    std::fs::write(&others, "0").unwrap();
    h.trainer_env = vec![(headroom::gpu::SIMULATED_GPU_ENV.to_string(), others.display().to_string())];
    let s = h.start(None).await;
    let steps = 400;
    let yaml = squeezed_job("shared-gpu", steps, 32, "default", 5).replace("eval_every: 10", "eval_every: 100");
    let id = submit(&s, &yaml).await;
    let wait_steps = |n: i64| {
        let s = &s;
        async move {
            for _ in 0..1200 {
                if max_step(s, id).await >= n {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
            panic!("job {id} did not reach step {n}");
        }
    };
    // The plan runs fp32 at micro-batch 8 (7.76 MiB of 12 MiB live). Another process takes
    // 4 MiB: live + theirs is above the 95% line, the attempt is preempted, and the job
    // re-plans for the memory left to it.
    wait_steps(20).await;
    std::fs::write(&others, (4u64 << 20).to_string()).unwrap();
    let mut seen = 0;
    for _ in 0..1200 {
        let a = get(&s, &format!("/api/jobs/{id}/attempts")).await;
        if a.as_array().unwrap().len() >= 2 {
            seen = max_step(&s, id).await;
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(seen > 0, "the job never got a second attempt");
    // It gives the memory back: the job steps back up at its next checkpoint.
    wait_steps(seen + 15).await;
    std::fs::write(&others, "0").unwrap();
    let job = wait_terminal(&s, id).await;
    assert_eq!(job["status"], "finished", "{job}");
    assert_eq!(job["steps_done"], steps);
    let attempts = get(&s, &format!("/api/jobs/{id}/attempts")).await;
    let a = attempts.as_array().unwrap();
    let micro = |i: usize| {
        let cfg: Value = serde_json::from_str(a[i]["config_json"].as_str().unwrap()).unwrap();
        cfg["train"]["micro_batch"].as_i64().unwrap()
    };
    let outcomes: Vec<&str> = a.iter().map(|x| x["outcome"].as_str().unwrap()).collect();
    assert_eq!(outcomes, ["preempted", "stepped_up", "finished"], "{attempts}");
    assert!(micro(1) < micro(0), "stepped down: {} → {}", micro(0), micro(1));
    assert_eq!(micro(2), micro(0), "back up to the configuration it had before");
    // One continuous run: each attempt resumes from the checkpoint the last one stopped at.
    for i in 1..a.len() {
        assert_eq!(a[i]["resumed_from_step"], a[i - 1]["last_step"], "{attempts}");
        assert_eq!(a[i]["first_step"].as_i64(), a[i - 1]["last_step"].as_i64().map(|s| s + 1), "{attempts}");
    }
    let samples = get(&s, &format!("/api/jobs/{id}/samples")).await;
    let mut trained: Vec<i64> = samples
        .as_array()
        .unwrap()
        .iter()
        .filter(|x| x["loss"].is_number())
        .map(|x| x["step"].as_i64().unwrap())
        .collect();
    trained.sort_unstable();
    trained.dedup();
    assert_eq!(trained, (1..=steps as i64).collect::<Vec<_>>(), "a loss for every step");
    let events = get(&s, &format!("/api/jobs/{id}/events")).await;
    let text = events.to_string();
    assert!(text.contains("re-planning from rung base other processes hold 4.00 MiB of 12.00 MiB"), "{text}");
    assert!(text.contains("4.00 MiB of it held by other processes"), "the preemption names the cause: {text}");
    let k = kinds(&events);
    assert_eq!(k.iter().filter(|k| *k == "step_up").count(), 1, "{k:?}");
    assert!(text.contains("other processes now hold 0 B of 12.00 MiB: stepping back up to rung base"), "{text}");
    assert!(!k.contains(&"oom".to_string()), "{k:?}");
    s.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crossing_preempt_checkpoints_and_steps_down_without_an_oom() {
    let h = Harness::new();
    std::fs::write(
        h.policies.join("tight.yaml"),
        "name: tight\nstrategy: ladder\nthresholds: { warn: 0.55, preempt: 0.6, sustain: 3 }\n\
         rungs:\n  - { name: halve-micro-batch, set: { micro_batch: half }, repeat: true }\n",
    )
    .unwrap();
    let s = h.start(None).await;
    // micro_batch 8 holds 7.76 MiB live of 12 MiB: 65%, above the 60% preempt line (the monitor
    // compares live memory, not what is reserved); micro_batch 4 holds 4.80 MiB, 40%.
    let id = submit(&s, &squeezed_job("preempt", 12, 8, "tight", 0)).await;
    let job = wait_terminal(&s, id).await;
    assert_eq!(job["status"], "finished", "{job}");
    let attempts = get(&s, &format!("/api/jobs/{id}/attempts")).await;
    let a = attempts.as_array().unwrap();
    assert_eq!(a.len(), 2, "{attempts}");
    assert_eq!(a[0]["outcome"], "preempted");
    assert_eq!(a[0]["exit_code"], 4);
    // Preempted once `sustain` samples were above the line (the child may finish one more step
    // before it reads the control line).
    let stopped = a[0]["last_step"].as_i64().unwrap();
    assert!((3..=5).contains(&stopped), "{stopped}");
    assert_eq!(a[1]["outcome"], "finished");
    assert_eq!(a[1]["resumed_from_step"], stopped, "the next rung resumes from the checkpoint");
    assert_eq!(a[1]["first_step"], stopped + 1);
    let cfg: Value = serde_json::from_str(a[1]["config_json"].as_str().unwrap()).unwrap();
    assert_eq!(cfg["train"]["micro_batch"], 4);
    let k = kinds(&get(&s, &format!("/api/jobs/{id}/events")).await);
    assert!(k.contains(&"warn".to_string()) && k.contains(&"preempt".to_string()), "{k:?}");
    assert!(!k.contains(&"oom".to_string()), "{k:?}");
    s.shutdown().await.unwrap();
}

async fn max_step(s: &RunningServer, id: i64) -> i64 {
    get(s, &format!("/api/jobs/{id}")).await["steps_done"].as_i64().unwrap_or(0)
}

/// Cancel job `id` (202), wait until it has ended cancelled, and return its attempts.
async fn cancel_and_wait(s: &RunningServer, id: i64) -> Value {
    let (code, _) = post(s, &format!("/api/jobs/{id}/cancel"), "").await;
    assert_eq!(code, 202);
    let job = wait_terminal(s, id).await;
    assert_eq!(job["status"], "cancelled");
    get(s, &format!("/api/jobs/{id}/attempts")).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_trainer_is_retried_and_resumes_from_its_checkpoint() {
    let h = Harness::new();
    let s = h.start(None).await;
    let id = submit(&s, &squeezed_job("killed", 100_000, 4, "default", 5)).await;
    wait_until("a checkpoint", Duration::from_secs(120), || async { max_step(&s, id).await >= 7 }).await;
    let attempts = get(&s, &format!("/api/jobs/{id}/attempts")).await;
    let pid = attempts[0]["pid"].as_i64().unwrap();
    let status = std::process::Command::new("kill").args(["-9", &pid.to_string()]).status().unwrap();
    assert!(status.success());
    wait_until("a second attempt with steps", Duration::from_secs(120), || async {
        let a = get(&s, &format!("/api/jobs/{id}/attempts")).await;
        a.as_array().unwrap().len() >= 2 && a[1]["pid"].is_number()
    })
    .await;
    let attempts = cancel_and_wait(&s, id).await;
    let a = attempts.as_array().unwrap();
    assert_eq!(a[0]["outcome"], "crashed");
    assert!(a[0]["exit_code"].is_null(), "killed by a signal");
    assert_eq!(a[1]["rung"], a[0]["rung"], "retried on the same rung");
    let resumed = a[1]["resumed_from_step"].as_i64().expect("second attempt resumed");
    assert!(resumed >= 5 && resumed % 5 == 0, "resumed from a checkpoint: {resumed}");
    assert_eq!(a[1]["outcome"], "cancelled");
    assert!(kinds(&get(&s, &format!("/api/jobs/{id}/events")).await).contains(&"retry".to_string()));
    s.shutdown().await.unwrap();
}

/// A trainer that stops answering (here: SIGSTOP, as a hung collective would look) is killed
/// once the policy's stall limit passes, recorded as `stalled` and retried from its newest
/// checkpoint; a hung trainer that is cancelled is killed the same way and ends cancelled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_trainer_is_killed_and_retried_and_a_stalled_cancel_ends() {
    let h = Harness::new();
    let default = std::fs::read_to_string(h.policies.join("default.yaml")).unwrap();
    let watchful = default.replace("name: default", "name: watchful") + "stall: { after_s: 5, steps: 5 }\n";
    std::fs::write(h.policies.join("watchful.yaml"), watchful).unwrap();
    let s = h.start(None).await;
    let id = submit(&s, &squeezed_job("stalled", 100_000, 4, "watchful", 5)).await;
    wait_until("a checkpoint", Duration::from_secs(120), || async { max_step(&s, id).await >= 7 }).await;
    let stop = |pid: i64| {
        let status = std::process::Command::new("kill").args(["-STOP", &pid.to_string()]).status().unwrap();
        assert!(status.success());
    };
    let attempts = get(&s, &format!("/api/jobs/{id}/attempts")).await;
    stop(attempts[0]["pid"].as_i64().unwrap());
    let stopped = Instant::now();
    wait_until("a second attempt with steps", Duration::from_secs(120), || async {
        let a = get(&s, &format!("/api/jobs/{id}/attempts")).await;
        a.as_array().unwrap().len() >= 2 && a[1]["pid"].is_number() && max_step(&s, id).await > 10
    })
    .await;
    assert!(stopped.elapsed() >= Duration::from_secs(5), "not killed before the stall limit");
    // The second attempt hangs too, and is cancelled while it does.
    let attempts = get(&s, &format!("/api/jobs/{id}/attempts")).await;
    stop(attempts[1]["pid"].as_i64().unwrap());
    let attempts = cancel_and_wait(&s, id).await;
    let a = attempts.as_array().unwrap();
    assert_eq!(a.len(), 2, "{attempts}");
    assert_eq!(a[0]["outcome"], "stalled");
    assert!(a[0]["exit_code"].is_null(), "killed by a signal");
    let why = a[0]["message"].as_str().unwrap();
    assert!(why.starts_with("nothing heard from the trainer for ") && why.contains("stall.after_s 5 s"), "{why}");
    assert_eq!(a[1]["rung"], a[0]["rung"], "retried on the same rung");
    let resumed = a[1]["resumed_from_step"].as_i64().expect("second attempt resumed");
    assert!(resumed >= 5 && resumed % 5 == 0, "resumed from a checkpoint: {resumed}");
    assert_eq!(a[1]["outcome"], "cancelled");
    let k = kinds(&get(&s, &format!("/api/jobs/{id}/events")).await);
    assert_eq!(k.iter().filter(|k| *k == "stalled").count(), 2, "{k:?}");
    assert!(k.contains(&"retry".to_string()), "{k:?}");
    s.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarting_the_daemon_resumes_a_running_job() {
    let h = Harness::new();
    let s = h.start(None).await;
    let id = submit(&s, &squeezed_job("restart", 100_000, 4, "default", 1000)).await;
    wait_until("some steps", Duration::from_secs(120), || async { max_step(&s, id).await >= 4 }).await;
    s.shutdown().await.unwrap();

    let s = h.start(None).await;
    wait_until("the job to resume", Duration::from_secs(120), || async {
        let a = get(&s, &format!("/api/jobs/{id}/attempts")).await;
        a.as_array().unwrap().len() >= 2 && a[1]["pid"].is_number()
    })
    .await;
    let attempts = get(&s, &format!("/api/jobs/{id}/attempts")).await;
    assert_eq!(attempts[0]["outcome"], "preempted", "graceful shutdown checkpoints the child");
    let stopped_at = attempts[0]["last_step"].as_i64().unwrap();
    wait_until("the resumed attempt to report", Duration::from_secs(60), || async {
        get(&s, &format!("/api/jobs/{id}/attempts")).await[1]["resumed_from_step"].is_number()
            || max_step(&s, id).await > stopped_at
    })
    .await;
    let attempts = cancel_and_wait(&s, id).await;
    assert_eq!(attempts[1]["resumed_from_step"], stopped_at, "{attempts}");
    assert!(kinds(&get(&s, &format!("/api/jobs/{id}/events")).await).contains(&"resumed".to_string()));
    s.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_a_4xx_and_writes_nothing() {
    let h = Harness::new();
    let s = h.start(None).await;
    let good = squeezed_job("fine", 5, 8, "default", 0);
    let cases: Vec<(String, u16, &str)> = vec![
        ("name: [unclosed".into(), 400, "line"),
        (good.replace("steps: 5", "steps: 5\n  stepz: 1"), 400, "stepz"),
        (good.replace("policy: default", "policy: nonexistent"), 400, "nonexistent"),
        (good.replace("name: fine", "name: ../../etc"), 400, "name"),
        (good.replace("name: fine", "name: a/b"), 400, "name"),
        (good.replace(&common::data_path().display().to_string(), "/etc/passwd"), 400, "outside the allowed"),
        (good.replace(&common::data_path().display().to_string(), "data/../Cargo.toml"), 400, "outside the allowed"),
        ("{\"name\": 3}".into(), 400, "job"),
        ("x".repeat(300 * 1024), 413, "larger than"),
    ];
    for (body, status, needle) in cases {
        let (got, err) = post(&s, "/api/jobs", &body).await;
        assert_eq!(got, status, "{needle}: {err}");
        assert!(err["error"].as_str().unwrap().contains(needle), "{needle}: {err}");
    }
    assert_eq!(get(&s, "/api/jobs").await.as_array().unwrap().len(), 0, "nothing written");
    let r = reqwest::get(url(&s, "/api/jobs/999")).await.unwrap();
    assert_eq!(r.status().as_u16(), 404);
    let r = reqwest::get(url(&s, "/api/jobs/abc")).await.unwrap();
    assert_eq!(r.status().as_u16(), 400);

    // Policies: list, read, reject invalid, accept valid.
    let list = get(&s, "/api/policies").await;
    assert!(list.as_array().unwrap().iter().any(|p| p["name"] == "default"));
    assert!(get(&s, "/api/policies/default").await["yaml"].as_str().unwrap().contains("halve-micro-batch"));
    let client = reqwest::Client::new();
    let put =
        |name: &str, body: &str| client.put(url(&s, &format!("/api/policies/{name}"))).body(body.to_string()).send();
    let r = put("mine", "name: mine\nrungs: [{ name: x, set: { zero_stage: 9 } }]").await.unwrap();
    assert_eq!(r.status().as_u16(), 400);
    assert!(r.text().await.unwrap().contains("zero_stage"));
    let r = put("..", "name: x\nrungs: []").await.unwrap();
    assert!(r.status().is_client_error());
    let r = put("mine", "name: mine\nrungs: [{ name: small, set: { micro_batch: half } }]").await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(get(&s, "/api/policies/mine").await["policy"]["rungs"][0]["name"], "small");
    let metrics = reqwest::get(url(&s, "/metrics")).await.unwrap().text().await.unwrap();
    assert!(metrics.contains("# TYPE headroom_jobs gauge"));
    assert!(metrics.contains("headroom_nvml_available "), "{metrics}");
    assert!(get(&s, "/api/gpus").await.is_array(), "GPU readings (empty without NVML)");
    assert_eq!(reqwest::get(url(&s, "/healthz")).await.unwrap().text().await.unwrap(), "ok");
    s.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_token_mutating_routes_need_it() {
    let h = Harness::new();
    let s = h.start(Some("s3cret")).await;
    let body = squeezed_job("tok", 2, 8, "default", 0);
    let client = reqwest::Client::new();
    let r = client.post(url(&s, "/api/jobs")).body(body.clone()).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 401);
    let r = client.post(url(&s, "/api/jobs")).bearer_auth("wrong").body(body.clone()).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 401);
    let r = client.put(url(&s, "/api/policies/default")).body("name: default\nrungs: []").send().await.unwrap();
    assert_eq!(r.status().as_u16(), 401);
    assert_eq!(get(&s, "/api/jobs").await.as_array().unwrap().len(), 0, "reads need no token");
    let r = client.post(url(&s, "/api/jobs")).bearer_auth("s3cret").body(body).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 201);
    let id = r.json::<Value>().await.unwrap()["id"].as_i64().unwrap();
    assert_eq!(wait_terminal(&s, id).await["status"], "finished");
    s.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_swap_bound_offload_rung_is_backed_off() {
    let h = Harness::new();
    std::fs::write(
        h.policies.join("swappy.yaml"),
        "name: swappy\nstrategy: ladder\nthresholds: { warn: 0.99, preempt: 1.0, sustain: 3 }\n\
         rungs:\n  - { name: offload-optimizer, set: { offload: { optimizer: cpu } } }\n\
         \x20 - { name: halve-micro-batch, set: { micro_batch: half }, repeat: true }\n\
         swap_bound: { transfer_fraction: 0.0001, action: step_back }\n",
    )
    .unwrap();
    let s = h.start(None).await;
    let job = format!(
        "name: swap\nmodel: {{ n_layer: 4, n_head: 4, n_embd: 128, block_size: 32, vocab: bytes }}\n\
         data: {{ path: {} }}\ntrain: {{ steps: 12, global_batch: 4, micro_batch: 4, lr: 1.0e-3 }}\n\
         device: {{ kind: cpu, device_memory: 20MiB }}\npolicy: swappy\n",
        common::data_path().display()
    );
    let id = submit(&s, &job).await;
    let done = wait_terminal(&s, id).await;
    assert_eq!(done["status"], "finished", "{done}");
    let attempts = get(&s, &format!("/api/jobs/{id}/attempts")).await;
    let a = attempts.as_array().unwrap();
    assert_eq!(a[0]["outcome"], "oom");
    assert_eq!(a[1]["rung"], "offload-optimizer");
    assert_eq!(a[1]["outcome"], "swap_bound", "{attempts}");
    let last: Value = serde_json::from_str(a.last().unwrap()["config_json"].as_str().unwrap()).unwrap();
    assert_eq!(last["memory"]["offload"]["optimizer"], "none", "the offload was backed off");
    assert!(last["train"]["micro_batch"].as_i64().unwrap() < 4);
    let text = get(&s, &format!("/api/jobs/{id}/events")).await.to_string();
    assert!(text.contains("swap-bound") && text.contains("backing off"), "{text}");
    s.shutdown().await.unwrap();
}

/// Two ranks (`ranks`: threads or processes) of the 4-layer 128-wide byte model (Ψ ≈ 830k fp32
/// parameters) on 14 MiB each, under policy `policy` (also the job's name).
fn two_rank_job(policy: &str, steps: u64, ranks: &str) -> String {
    format!(
        "name: {policy}\nmodel: {{ n_layer: 4, n_head: 4, n_embd: 128, block_size: 32, vocab: bytes }}\n\
         data: {{ path: {} }}\ntrain: {{ steps: {steps}, global_batch: 4, micro_batch: 2, lr: 1.0e-3, checkpoint_every: 4 }}\n\
         memory: {{ world_size: 2, ranks: {ranks} }}\ndevice: {{ kind: cpu, device_memory: 14MiB }}\npolicy: {policy}\n",
        common::data_path().display(),
    )
}

/// Submit `job` and wait for its end, which must be `finished`: its attempts and its events.
async fn finished_attempts(s: &RunningServer, job: &str) -> (Value, Value) {
    let id = submit(s, job).await;
    let done = wait_terminal(s, id).await;
    let attempts = get(s, &format!("/api/jobs/{id}/attempts")).await;
    let events = get(s, &format!("/api/jobs/{id}/events")).await;
    assert_eq!(done["status"], "finished", "{done}\n{attempts}\n{events}");
    (attempts, events)
}

/// Each attempt's (rung, outcome).
fn rungs_and_outcomes(attempts: &[Value]) -> Vec<(&str, &str)> {
    attempts.iter().map(|a| (a["rung"].as_str().unwrap(), a["outcome"].as_str().unwrap())).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_ranks_climb_the_zero_stages_until_the_state_fits() {
    let h = Harness::new();
    std::fs::write(
        h.policies.join("zero.yaml"),
        "name: zero\nstrategy: ladder\nthresholds: { warn: 0.99, preempt: 1.0, sustain: 1000 }\n\
         rungs:\n  - { name: zero-1, set: { zero_stage: 1 } }\n\
         \x20 - { name: zero-2, set: { zero_stage: 2 } }\n\
         \x20 - { name: zero-3, set: { zero_stage: 3 } }\n",
    )
    .unwrap();
    let s = h.start(None).await;
    // Ψ ≈ 830k fp32 parameters: 16Ψ ≈ 13 MiB of state per rank replicated, 12Ψ at ZeRO-1 (plus
    // activations: still too much for 14 MiB), 10Ψ at ZeRO-2 (fits).
    // As threads of one trainer and as processes (each attempt's ranks start, OOM and end together).
    for ranks in ["threads", "processes"] {
        let (attempts, events) = finished_attempts(&s, &two_rank_job("zero", 12, ranks)).await;
        let a = attempts.as_array().unwrap();
        assert_eq!(rungs_and_outcomes(a), [("base", "oom"), ("zero-1", "oom"), ("zero-2", "finished")], "{attempts}");
        let cfg = |i: usize| -> Value { serde_json::from_str(a[i]["config_json"].as_str().unwrap()).unwrap() };
        assert_eq!([0, 1, 2].map(|i| cfg(i)["memory"]["zero_stage"].as_i64().unwrap()), [0, 1, 2]);
        assert!((0..3).all(|i| cfg(i)["memory"]["world_size"] == 2 && cfg(i)["train"]["global_batch"] == 4));
        let recorded = if ranks == "threads" { Value::Null } else { Value::from(ranks) };
        assert!((0..3).all(|i| cfg(i)["memory"]["ranks"] == recorded), "{attempts}");
        // The recorded per-rank peaks show the sharded state: ZeRO-1 holds all 4Ψ bytes of fp32
        // weights and gradients but half of the 8Ψ of moments; ZeRO-2 halves the gradients too.
        let peak = |i: usize, k: &str| a[i][k].as_i64().unwrap() as f64;
        let close = |x: f64, y: f64| (x - y).abs() / y < 0.01;
        assert!(close(peak(1, "peak_optimizer"), peak(1, "peak_params")), "{attempts}");
        assert!(close(peak(1, "peak_grads"), peak(1, "peak_params")), "{attempts}");
        assert!(close(peak(2, "peak_grads") * 2.0, peak(1, "peak_grads")), "{attempts}");
        assert!(close(peak(2, "peak_optimizer"), peak(1, "peak_optimizer")), "{attempts}");
        assert!(a[2]["peak_reserved"].as_i64().unwrap() <= 14 << 20);
        let text = events.to_string();
        assert!(text.contains("zero_stage 0 → 1") && text.contains("zero_stage 1 → 2"), "{text}");
        assert!(text.contains("did not fit in 14.00 MiB"), "an OOM before `started` still names the capacity: {text}");
    }
    s.shutdown().await.unwrap();
}

/// A tensor-parallel rung rescues a job whose replicated state does not fit: at TP 1 each of
/// the two ranks holds the whole 830k-parameter model's 16 bytes per parameter (OOM in 14 MiB);
/// split two ways each holds its half of the blocks' matrices and fits. Threads and processes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tensor_parallel_rung_rescues_a_job_that_ooms_replicated() {
    let h = Harness::new();
    std::fs::write(
        h.policies.join("split.yaml"),
        "name: split\nstrategy: ladder\nthresholds: { warn: 0.99, preempt: 1.0, sustain: 1000 }\n\
         rungs:\n  - { name: tp-3, set: { tensor_parallel: 3 } }\n\
         \x20 - { name: tp-2, set: { tensor_parallel: 2 } }\n",
    )
    .unwrap();
    let s = h.start(None).await;
    for ranks in ["threads", "processes"] {
        let (attempts, events) = finished_attempts(&s, &two_rank_job("split", 8, ranks)).await;
        let a = attempts.as_array().unwrap();
        assert_eq!(rungs_and_outcomes(a), [("base", "oom"), ("tp-2", "finished")], "{attempts}");
        let cfg = |i: usize| -> Value { serde_json::from_str(a[i]["config_json"].as_str().unwrap()).unwrap() };
        assert_eq!(cfg(1)["memory"]["tensor_parallel"], 2, "{attempts}");
        assert_eq!(cfg(1)["train"]["global_batch"], 4);
        // Each rank's weights: the replicated embeddings and LayerNorms plus half of the rest.
        let ratio = a[1]["peak_params"].as_f64().unwrap() / a[0]["peak_params"].as_f64().unwrap();
        assert!((0.5..0.56).contains(&ratio), "per-rank weights at TP 2 / TP 1 = {ratio}: {attempts}");
        let text = events.to_string();
        assert!(
            text.contains("tensor_parallel 3 needs a world_size it divides"),
            "the tp-3 rung is passed over: {text}"
        );
        assert!(text.contains("tensor_parallel 1 → 2"), "{text}");
    }
    s.shutdown().await.unwrap();
}

/// A policy's `base` is applied to every job submitted under it and recorded as a `base`
/// event: the shipped `seed-default` starts a job in bf16 with a 90% reserve and the static
/// allocator, and it trains. A base that cannot apply to a job refuses the job, naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_base_is_where_its_jobs_start() {
    let h = Harness::new();
    let s = h.start(None).await;
    let job = common::job_yaml("seeded", 6, 8, 8, "64MiB") + "policy: seed-default\n";
    let id = submit(&s, &job).await;
    let done = wait_terminal(&s, id).await;
    assert_eq!(done["status"], "finished", "{done}");
    let spec: Value = serde_json::from_str(done["current_spec"].as_str().unwrap()).unwrap();
    assert_eq!(spec["memory"]["precision"], "bf16", "{spec}");
    assert_eq!(spec["memory"]["allocator"], "static", "{spec}");
    assert_eq!(spec["device"]["reserve"], 0.9, "{spec}");
    let events = get(&s, &format!("/api/jobs/{id}/events")).await;
    let base: Vec<&Value> = events.as_array().unwrap().iter().filter(|e| e["kind"] == "base").collect();
    assert_eq!(base.len(), 1, "{events}");
    assert!(base[0]["message"].as_str().unwrap().contains("seed-default"), "{events}");

    let client = reqwest::Client::new();
    let r = client
        .put(url(&s, "/api/policies/sharded"))
        .body("name: sharded\nbase: { zero_stage: 1 }\nrungs: [{ name: small, set: { micro_batch: half } }]")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let (status, err) = post(&s, "/api/jobs", &job.replace("policy: seed-default", "policy: sharded")).await;
    assert_eq!(status, 400, "{err}");
    assert!(err["error"].as_str().unwrap().contains("base does not apply"), "{err}");
    assert!(err["error"].as_str().unwrap().contains("world_size"), "{err}");
    s.shutdown().await.unwrap();
}

/// The rank processes `pid` started (`memory.ranks: processes`): its live children.
fn children_of(pid: i64) -> Vec<i64> {
    common::processes().into_iter().filter(|p| i64::from(p.parent) == pid).map(|p| i64::from(p.pid)).collect()
}

fn alive(pid: i64) -> bool {
    common::processes().iter().any(|p| i64::from(p.pid) == pid)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_process_that_dies_crashes_the_attempt_and_every_rank_resumes_together() {
    let h = Harness::new();
    let s = h.start(None).await;
    let job = squeezed_job("procs", 100_000, 4, "default", 5) + "memory: { world_size: 2, ranks: processes }\n";
    let id = submit(&s, &job).await;
    wait_until("a checkpoint", Duration::from_secs(120), || async { max_step(&s, id).await >= 7 }).await;
    let attempts = get(&s, &format!("/api/jobs/{id}/attempts")).await;
    let rank0 = attempts[0]["pid"].as_i64().unwrap();
    let ranks = children_of(rank0);
    assert_eq!(ranks.len(), 1, "rank 0 (the attempt's trainer) started rank 1: {ranks:?}");
    let status = std::process::Command::new("kill").args(["-9", &ranks[0].to_string()]).status().unwrap();
    assert!(status.success());
    wait_until("a second attempt with its ranks", Duration::from_secs(120), || async {
        let a = get(&s, &format!("/api/jobs/{id}/attempts")).await;
        a.as_array().unwrap().len() >= 2 && a[1]["pid"].as_i64().is_some_and(|p| !children_of(p).is_empty())
    })
    .await;
    assert!(!alive(rank0), "the first attempt's rank 0 ended");
    let attempts = get(&s, &format!("/api/jobs/{id}/attempts")).await;
    let second = children_of(attempts[1]["pid"].as_i64().unwrap());
    let attempts = cancel_and_wait(&s, id).await;
    let a = attempts.as_array().unwrap();
    assert_eq!(a[0]["outcome"], "crashed", "{attempts}");
    assert_eq!(a[0]["exit_code"], 1, "{attempts}");
    let message = a[0]["message"].as_str().unwrap_or_default();
    assert!(message.contains("the connection to rank 1 failed"), "{attempts}");
    assert_eq!(a[1]["rung"], a[0]["rung"], "retried on the same rung");
    let resumed = a[1]["resumed_from_step"].as_i64().expect("second attempt resumed");
    assert!(resumed >= 5 && resumed % 5 == 0, "resumed from a checkpoint: {resumed}");
    assert_eq!(a[1]["outcome"], "cancelled", "every rank checkpointed and stopped: {attempts}");
    wait_until("the second attempt's rank 1 ended", Duration::from_secs(10), || async {
        second.iter().all(|&p| !alive(p))
    })
    .await;
    s.shutdown().await.unwrap();
}
