//! Ranks as processes (`memory.ranks: processes`): the same training as thread ranks, bit for
//! bit; one attempt that lives and dies as a unit; hand-started groups; bad input refused.

mod common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{bin, events, job_yaml, losses, of_kind, spawn_train, train, write_job};

/// A world-2 job on the tiny model; `memory` is the rest of the memory section.
fn ranks_job(steps: u64, memory: &str) -> String {
    job_yaml("ranks", steps, 16, 4, "128MiB")
        .replace("eval_every: 50", "eval_every: 6")
        .replace("checkpoint_every: 50", "checkpoint_every: 5")
        + &format!("memory: {{ world_size: 2, {memory} }}\n")
}

fn ok(out: &Output, what: &str) -> Vec<serde_json::Value> {
    assert_eq!(out.status.code(), Some(0), "{what}: {}", String::from_utf8_lossy(&out.stderr));
    events(out)
}

/// Every value the run reported that training decides: losses, gradient norms, eval losses.
fn trajectory(events: &[serde_json::Value]) -> Vec<String> {
    let steps = of_kind(events, "step").into_iter().map(|s| format!("{} {} {}", s["step"], s["loss"], s["grad_norm"]));
    let evals = of_kind(events, "eval").into_iter().map(|e| format!("eval {} {}", e["step"], e["val_loss"]));
    steps.chain(evals).collect()
}

/// `job` stopped after step 5's checkpoint (exit 4, every rank) in `run_dir` and resumed there:
/// the two attempts' trajectory is `uninterrupted`'s, and no rank outlives either.
fn stopped_and_resumed_is_uninterrupted(case: &str, job: &Path, run_dir: &Path, uninterrupted: &[serde_json::Value]) {
    let first = train(job, run_dir, &["--stop-after", "5"]);
    assert_eq!(first.status.code(), Some(4), "{case}: {}", String::from_utf8_lossy(&first.stderr));
    let second = ok(&train(job, run_dir, &["--resume"]), case);
    assert_eq!(of_kind(&second, "started")[0]["resumed_from_step"], 5);
    let mut joined = trajectory(&events(&first));
    joined.extend(trajectory(&second));
    joined.sort();
    let mut whole = trajectory(uninterrupted);
    whole.sort();
    assert_eq!(joined, whole, "{case}: stopped and resumed = uninterrupted");
    assert!(processes_of(run_dir).is_empty());
}

/// Live processes whose command line names `run_dir`.
fn processes_of(run_dir: &Path) -> Vec<common::Process> {
    let dir = run_dir.to_string_lossy().into_owned();
    common::processes().into_iter().filter(|p| p.args.contains(&dir)).collect()
}

fn rank_pid(run_dir: &Path, rank: usize) -> Option<u32> {
    let rank = rank.to_string();
    processes_of(run_dir)
        .into_iter()
        .find(|p| p.args.windows(2).any(|w| w[0] == "--rank" && w[1] == rank))
        .map(|p| p.pid)
}

/// `kill -9` the rank process `pid`, and wait (30 s at most) for rank 0 to end: its exit code.
fn kill_and_await_rank_0(pid: u32, rank0: &mut std::process::Child) -> Option<i32> {
    Command::new("kill").args(["-9", &pid.to_string()]).status().unwrap();
    let mut status = None;
    wait_until(&format!("rank 0 ends after the rank process {pid} died"), Duration::from_secs(30), || {
        status = rank0.try_wait().unwrap();
        status.is_some()
    });
    status.unwrap().code()
}

fn wait_until(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Rank 0 of `job`, streaming events until its first checkpoint: the process, its stderr (read
/// to the end on its own thread) and the checkpoint's step.
fn start_until_checkpoint(job: &Path, run: &Path) -> (std::process::Child, std::thread::JoinHandle<String>, u64) {
    let mut rank0 = spawn_train(job, run, "warn", Stdio::piped());
    let stdout = BufReader::new(rank0.stdout.take().unwrap());
    let stderr = rank0.stderr.take().unwrap();
    let stderr = std::thread::spawn(move || std::io::read_to_string(stderr).unwrap());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in stdout.lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let checkpointed = loop {
        let line = rx.recv_timeout(Duration::from_secs(60)).expect("rank 0 reports a checkpoint");
        let event: serde_json::Value = serde_json::from_str(&line).unwrap();
        if event["event"] == "checkpoint" {
            break event["step"].as_u64().unwrap();
        }
    };
    (rank0, stderr, checkpointed)
}

#[test]
fn process_ranks_train_bit_for_bit_as_thread_ranks_and_resume_across_a_stop() {
    let dir = tempfile::tempdir().unwrap();
    for (case, memory) in [
        ("z0", "zero_stage: 0"),
        ("z2", "zero_stage: 2"),
        ("z3", "zero_stage: 3"),
        ("bf16-z1", "zero_stage: 1, precision: bf16"),
    ] {
        let case_dir = dir.path().join(case);
        std::fs::create_dir_all(&case_dir).unwrap();
        let threads = write_job(&case_dir, &ranks_job(12, memory));
        let threads = ok(&train(&threads, &case_dir.join("threads"), &[]), case);
        let job = write_job(&case_dir, &ranks_job(12, &format!("{memory}, ranks: processes")));
        let run = case_dir.join("processes");
        let procs = ok(&train(&job, &run, &[]), case);
        assert_eq!(trajectory(&procs), trajectory(&threads), "{case}: process ranks train as thread ranks");
        assert_eq!(losses(&procs).len(), 12);
        let (a, b) = (of_kind(&procs, "step")[0], of_kind(&threads, "step")[0]);
        assert_eq!(of_kind(&procs, "started")[0]["world_size"], 2);
        for category in ["params", "grads", "optimizer"] {
            assert_eq!(a["mem"][category], b["mem"][category], "{case}: rank 0 holds what a thread rank holds");
        }
        assert!(processes_of(&run).is_empty(), "{case}: every rank ended with the job");

        stopped_and_resumed_is_uninterrupted(case, &job, &case_dir.join("split"), &procs);
    }
}

/// Tensor and pipeline parallelism with ranks as processes: TP 2, TP 2 × DP 2 at ZeRO-1, PP 2
/// and TP 2 × PP 2 (the sub-groups and the stages' pairs meet over TCP) train bit for bit as
/// the same grid of thread ranks, and resume across a stop.
#[test]
fn model_parallel_process_ranks_train_as_thread_ranks_and_resume() {
    let dir = tempfile::tempdir().unwrap();
    for (case, memory) in [
        ("tp2", "world_size: 2, tensor_parallel: 2"),
        ("tp2-dp2-z1", "world_size: 4, tensor_parallel: 2, zero_stage: 1"),
        ("pp2", "world_size: 2, pipeline_parallel: 2"),
        ("tp2-pp2", "world_size: 4, tensor_parallel: 2, pipeline_parallel: 2"),
    ] {
        let case_dir = dir.path().join(case);
        std::fs::create_dir_all(&case_dir).unwrap();
        let yaml = |memory: &str| ranks_job(12, memory).replace("memory: { world_size: 2, ", "memory: { ");
        let threads = write_job(&case_dir, &yaml(memory));
        let threads = ok(&train(&threads, &case_dir.join("threads"), &[]), case);
        let job = write_job(&case_dir, &yaml(&format!("{memory}, ranks: processes")));
        let procs = ok(&train(&job, &case_dir.join("processes"), &[]), case);
        assert_eq!(trajectory(&procs), trajectory(&threads), "{case}: process ranks train as thread ranks");
        assert_eq!(losses(&procs).len(), 12);

        stopped_and_resumed_is_uninterrupted(case, &job, &case_dir.join("split"), &procs);
    }
}

#[test]
fn a_rank_that_dies_ends_the_attempt_promptly_and_the_job_resumes_from_its_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let job = write_job(dir.path(), &ranks_job(100_000, "zero_stage: 2, ranks: processes"));
    let run = dir.path().join("run");
    // Rank 0 streams events until rank 1 is killed past its first checkpoint.
    let (mut rank0, stderr, checkpointed) = start_until_checkpoint(&job, &run);
    let rank1 = rank_pid(&run, 1).expect("rank 1 runs as its own process");
    assert_ne!(rank1, rank0.id());
    let code = kill_and_await_rank_0(rank1, &mut rank0);
    assert_eq!(code, Some(1), "a lost rank is a crash of the attempt (exit 1)");
    let stderr = stderr.join().unwrap();
    assert!(stderr.contains("the connection to rank 1 failed"), "{stderr}");
    assert!(processes_of(&run).is_empty(), "no rank outlives the attempt");

    // The next attempt resumes from the newest checkpoint, all ranks together.
    let out = train(&job, &run, &["--resume", "--stop-after", &(checkpointed + 10).to_string()]);
    assert_eq!(out.status.code(), Some(4), "{}", String::from_utf8_lossy(&out.stderr));
    let resumed = of_kind(&events(&out), "started")[0]["resumed_from_step"].as_u64().unwrap();
    assert!(resumed >= checkpointed, "resumed from {resumed}, checkpointed {checkpointed}");

    // Killing rank 0 (as the supervisor does to a stuck attempt) takes every rank with it.
    let mut rank0 = spawn_train(&job, &run, "warn", Stdio::null());
    wait_until("rank 1 started", Duration::from_secs(30), || rank_pid(&run, 1).is_some());
    rank0.kill().unwrap();
    rank0.wait().unwrap();
    wait_until("rank 1 ends with rank 0", Duration::from_secs(10), || processes_of(&run).is_empty());
}

/// In a grid of processes — data × tensor (world 4, tensor_parallel 2) and pipeline × tensor
/// (world 4, two stages of two) — the death of a rank outside rank 0's tensor-parallel group
/// still ends every rank promptly (each sub-group's lost connection ends its members, and the
/// world's ends rank 0), and the job resumes.
#[test]
fn a_rank_lost_from_a_model_parallel_grid_ends_every_rank_and_the_job_resumes() {
    for (case, grid) in [
        ("tp2-dp2", "world_size: 4, tensor_parallel: 2, zero_stage: 1,"),
        ("tp2-pp2", "world_size: 4, tensor_parallel: 2, pipeline_parallel: 2,"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let yaml = ranks_job(100_000, "ranks: processes").replace("world_size: 2,", grid);
        let job = write_job(dir.path(), &yaml);
        let run = dir.path().join("run");
        let (mut rank0, stderr, checkpointed) = start_until_checkpoint(&job, &run);
        let rank3 = rank_pid(&run, 3).expect("rank 3 runs as its own process");
        let code = kill_and_await_rank_0(rank3, &mut rank0);
        assert_eq!(code, Some(1), "{case}: a lost rank is a crash of the attempt (exit 1)");
        let stderr = stderr.join().unwrap();
        assert!(stderr.contains("the connection to rank"), "{case}: {stderr}");
        wait_until("no rank outlives the attempt", Duration::from_secs(10), || processes_of(&run).is_empty());

        let out = train(&job, &run, &["--resume", "--stop-after", &(checkpointed + 5).to_string()]);
        assert_eq!(out.status.code(), Some(4), "{case}: {}", String::from_utf8_lossy(&out.stderr));
        let resumed = of_kind(&events(&out), "started")[0]["resumed_from_step"].as_u64().unwrap();
        assert!(resumed >= checkpointed, "{case}: resumed from {resumed}, checkpointed {checkpointed}");
    }
}

#[test]
fn ranks_started_by_hand_or_by_a_launcher_form_the_same_group() {
    let dir = tempfile::tempdir().unwrap();
    let job = write_job(dir.path(), &ranks_job(10, "zero_stage: 1, ranks: processes"));
    let spawned = ok(&train(&job, &dir.path().join("spawned"), &[]), "spawned");
    let free_port = || std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let rank = |run: &str, flags: &[String], env: &[(&str, String)]| {
        Command::new(bin())
            .args(["train", "--config"])
            .arg(&job)
            .arg("--run-dir")
            .arg(dir.path().join(run))
            .args(flags)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .env("HEADROOM_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    // By hand: --rank and --rendezvous on each (as on several machines, each its own run dir).
    let at = format!("127.0.0.1:{}", free_port());
    let flags = |r: usize| vec!["--rank".into(), r.to_string(), "--rendezvous".into(), at.clone()];
    let (r0, r1) = (rank("hand0", &flags(0), &[]), rank("hand1", &flags(1), &[]));
    let (out0, out1) = (r0.wait_with_output().unwrap(), r1.wait_with_output().unwrap());
    assert_eq!(out1.status.code(), Some(0), "{}", String::from_utf8_lossy(&out1.stderr));
    assert!(out1.stdout.is_empty(), "only rank 0 speaks the protocol");
    assert_eq!(trajectory(&ok(&out0, "by hand")), trajectory(&spawned));

    // A launcher's variables (torchrun's RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).
    let port = free_port().to_string();
    let env = |r: usize| {
        vec![
            ("RANK", r.to_string()),
            ("LOCAL_RANK", r.to_string()),
            ("MASTER_ADDR", "127.0.0.1".to_string()),
            ("MASTER_PORT", port.clone()),
        ]
    };
    let (r0, r1) = (rank("env", &[], &env(0)), rank("env", &[], &env(1)));
    let (out0, out1) = (r0.wait_with_output().unwrap(), r1.wait_with_output().unwrap());
    assert_eq!(out1.status.code(), Some(0), "{}", String::from_utf8_lossy(&out1.stderr));
    assert_eq!(trajectory(&ok(&out0, "launcher")), trajectory(&spawned));

    // Resuming ranks that read different run directories is refused, not trained apart.
    let stop = |r: usize| [flags(r), vec!["--stop-after".into(), "5".into()]].concat();
    let at = format!("127.0.0.1:{}", free_port());
    let flags = |r: usize| vec!["--rank".into(), r.to_string(), "--rendezvous".into(), at.clone()];
    let (r0, r1) = (rank("apart0", &stop(0), &[]), rank("apart1", &stop(1), &[]));
    assert_eq!(r0.wait_with_output().unwrap().status.code(), Some(4));
    assert_eq!(r1.wait_with_output().unwrap().status.code(), Some(4));
    assert!(
        dir.path().join("apart0/ckpt-00000005.bin").exists() && !dir.path().join("apart1/ckpt-00000005.bin").exists()
    );
    let (r0, r1) = (rank("apart0", &flags(0), &[]), rank("apart1", &flags(1), &[]));
    let (out0, out1) = (r0.wait_with_output().unwrap(), r1.wait_with_output().unwrap());
    assert_eq!((out0.status.code(), out1.status.code()), (Some(1), Some(1)));
    let stderr = String::from_utf8_lossy(&out0.stderr);
    assert!(stderr.contains("the ranks start from different states (a fresh start and step 5)"), "{stderr}");
}

#[test]
fn rank_flags_that_do_not_fit_the_job_exit_2_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let threads = write_job(dir.path(), &ranks_job(2, "zero_stage: 0"));
    let run = dir.path().join("run");
    let expect_2 = |out: Output, needle: &str| {
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(out.status.code(), Some(2), "{needle}: {stderr}");
        assert!(stderr.contains(needle), "{needle}: {stderr}");
    };
    expect_2(train(&threads, &run, &["--rank", "1", "--rendezvous", "127.0.0.1:9"]), "--rank: applies to a job");
    // A launcher's RANK around a thread-rank job is not ours: the job runs as one process.
    let out = Command::new(bin())
        .args(["train", "--config"])
        .arg(&threads)
        .arg("--run-dir")
        .arg(&run)
        .env("RANK", "1")
        .env("HEADROOM_LOG", "warn")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));

    std::fs::create_dir_all(dir.path().join("p")).unwrap();
    let procs = write_job(&dir.path().join("p"), &ranks_job(2, "ranks: processes"));
    expect_2(train(&procs, &run, &["--rank", "2", "--rendezvous", "127.0.0.1:9"]), "--rank: 2 is not a rank");
    let no_master = Command::new(bin())
        .args(["train", "--config"])
        .arg(&procs)
        .args(["--rank", "1"])
        .env_remove("MASTER_ADDR")
        .env_remove("MASTER_PORT")
        .output()
        .unwrap();
    expect_2(no_master, "--rendezvous");
    let bad_env = Command::new(bin()).args(["train", "--config"]).arg(&procs).env("RANK", "first").output().unwrap();
    expect_2(bad_env, "RANK: \"first\" is not a rank");
    expect_2(train(&procs, &run, &["--local-rank", "0"]), "--rank");
    expect_2(train(&procs, &run, &["--rank", "1", "--rendezvous", "127.0.0.1:9", "--rendezvous-timeout", "0"]), "0");
    let bad_yaml = ranks_job(2, "ranks: forked");
    expect_2(train(&write_job(dir.path(), &bad_yaml), &run, &[]), "memory.ranks");

    // A rank whose rank 0 never answers gives up after --rendezvous-timeout, naming the address.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let start = Instant::now();
    let out = train(&procs, &run, &["--rank", "1", "--rendezvous", &closed.to_string(), "--rendezvous-timeout", "2"]);
    assert!(start.elapsed() < Duration::from_secs(30));
    assert_ne!(out.status.code(), Some(0));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains(&closed.to_string()),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
