//! Helpers shared by the integration tests: job files, running the binary, reading events.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

use serde_json::Value;

pub fn bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_headroom"))
}

pub fn data_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("data/shakespeare-tiny.txt")
}

/// A small byte-level job; `extra` lines are appended under the given top-level keys by string
/// replacement of the defaults.
pub fn job_yaml(name: &str, steps: u64, global: u64, micro: u64, device_memory: &str) -> String {
    format!(
        r#"name: {name}
model: {{ n_layer: 2, n_head: 4, n_embd: 64, block_size: 64, vocab: bytes }}
data: {{ path: {data}, val_fraction: 0.1 }}
train:
  steps: {steps}
  global_batch: {global}
  micro_batch: {micro}
  lr: 3.0e-3
  warmup_steps: {warmup}
  weight_decay: 0.1
  grad_clip: 1.0
  seed: 1337
  eval_every: 50
  checkpoint_every: 50
device: {{ kind: cpu, device_memory: {device_memory} }}
"#,
        data = data_path().display(),
        warmup = steps.min(10)
    )
}

pub fn write_job(dir: &Path, yaml: &str) -> PathBuf {
    let path = dir.join("job.yaml");
    std::fs::write(&path, yaml).unwrap();
    path
}

/// `headroom train` with its stdin and stdout piped (control lines in, events out), stderr piped
/// or dropped, logging at `log`.
pub fn spawn_train(job: &Path, run_dir: &Path, log: &str, stderr: Stdio) -> Child {
    Command::new(bin())
        .args(["train", "--config"])
        .arg(job)
        .arg("--run-dir")
        .arg(run_dir)
        .env("HEADROOM_LOG", log)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .expect("spawn headroom train")
}

pub fn train(job: &Path, run_dir: &Path, extra: &[&str]) -> Output {
    Command::new(bin())
        .args(["train", "--config"])
        .arg(job)
        .arg("--run-dir")
        .arg(run_dir)
        .args(extra)
        .env("HEADROOM_LOG", "warn")
        .output()
        .expect("run headroom train")
}

pub fn events(out: &Output) -> Vec<Value> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("stdout line is not JSON ({e}): {l}")))
        .collect()
}

pub fn of_kind<'a>(events: &'a [Value], kind: &str) -> Vec<&'a Value> {
    events.iter().filter(|e| e["event"] == kind).collect()
}

pub fn losses(events: &[Value]) -> Vec<(u64, f64)> {
    of_kind(events, "step").iter().map(|e| (e["step"].as_u64().unwrap(), e["loss"].as_f64().unwrap())).collect()
}

/// A live process of this machine (exited ones not yet reaped are left out).
pub struct Process {
    pub pid: u32,
    pub parent: u32,
    pub args: Vec<String>,
}

/// Every live process, from /proc.
pub fn processes() -> Vec<Process> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
        let (Ok(cmdline), Ok(stat)) =
            (std::fs::read(entry.path().join("cmdline")), std::fs::read_to_string(entry.path().join("stat")))
        else {
            continue;
        };
        // pid (comm) state ppid …: the fields after the command's closing parenthesis.
        let fields: Vec<&str> = stat.rsplit_once(')').map_or("", |(_, rest)| rest).split_whitespace().collect();
        let Some(parent) = fields.get(1).and_then(|p| p.parse().ok()) else { continue };
        if fields[0] == "Z" {
            continue;
        }
        let args = cmdline.split(|&b| b == 0).map(|a| String::from_utf8_lossy(a).into_owned()).collect();
        found.push(Process { pid, parent, args });
    }
    found
}
