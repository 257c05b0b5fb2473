//! The trainer↔supervisor protocol as Rust types, used by both sides (docs/DESIGN.md "Trainer
//! protocol"): the JSON-line [`Event`]s `headroom train` writes on stdout, the [`Control`] lines
//! it reads on stdin, its [`ExitCode`]s, and the run directory's [`RunIdentity`] and lock file.
//!
//! The engine writes events only through [`Line`]; the supervisor parses them only through
//! [`Line::parse`]. A newer trainer may add fields (ignored) or event kinds ([`Event::Unknown`]);
//! a float a trainer wrote as `null` (serde_json writes NaN and infinities so) reads back as NaN.

use std::path::PathBuf;

use serde::{Deserialize, Deserializer, Serialize};

use crate::memory::{MemStats, PoolShape};

/// One line on the trainer's stdout: the event and when it was written (unix seconds).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Line {
    #[serde(default)]
    pub t: f64,
    #[serde(flatten)]
    pub event: Event,
}

impl Line {
    /// The event stamped with the current time.
    pub fn now(event: Event) -> Line {
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        Line { t: t.as_secs_f64(), event }
    }

    /// The line as written to stdout (no trailing newline).
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("protocol lines serialise")
    }

    /// Read one stdout line; `None` for a line that is not a protocol event (a stray print).
    pub fn parse(line: &str) -> Option<Line> {
        serde_json::from_str(line).ok()
    }
}

/// What a trainer reports, one variant per line kind (the `"event"` field).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    Started(Started),
    Step(Step),
    Eval(Eval),
    Checkpoint(CheckpointWritten),
    /// The trainer ran out of device memory; it exits [`ExitCode::OutOfMemory`] next. (Not the
    /// supervisor's DB event kind "oom", which records the attempt's summary.)
    Oom(Oom),
    Finished(Finished),
    /// The trainer defragmented its pool.
    Defragmented(Defragmented),
    /// A kind this supervisor does not know (written by a newer trainer): ignored.
    #[serde(other)]
    Unknown,
}

/// The job is set up (model allocated, checkpoint restored) and about to train.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Started {
    /// The resolved job spec (the supervisor keeps its own copy; opaque to it).
    pub config: serde_json::Value,
    pub world_size: i64,
    pub device: String,
    pub capacity: usize,
    pub resumed_from_step: Option<u64>,
    pub num_params: usize,
    pub grad_accum: usize,
    #[serde(deserialize_with = "nan_if_null")]
    pub unigram_entropy: f64,
}

/// One optimizer step done.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Step {
    pub step: u64,
    #[serde(deserialize_with = "nan_if_null")]
    pub loss: f32,
    #[serde(deserialize_with = "nan_if_null")]
    pub lr: f64,
    #[serde(deserialize_with = "nan_if_null")]
    pub grad_norm: f64,
    #[serde(deserialize_with = "nan_if_null")]
    pub tokens_per_s: f64,
    #[serde(deserialize_with = "nan_if_null")]
    pub step_ms: f64,
    /// This step's high-water marks (see [`MemSnapshot::window`]): with several ranks, those
    /// of the fullest (the highest `allocated / capacity`), named by `mem_rank`.
    pub mem: MemSnapshot,
    /// Whose memory `mem` is, with several ranks (absent with one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mem_rank: Option<usize>,
    /// The storage type of weights and activations ("fp32", "bf16", "fp16").
    pub precision: String,
    /// fp16's dynamic loss scale (present for fp16 or once a step was skipped).
    #[serde(default)]
    pub loss_scale: Option<f64>,
    #[serde(default)]
    pub skipped: bool,
    #[serde(default)]
    pub skipped_steps: u64,
    /// NVML's view of the GPU (cuda only).
    #[serde(default)]
    pub nvml: Option<NvmlReading>,
    /// Device↔host traffic when offloading.
    #[serde(default)]
    pub swap: Option<Swap>,
    /// Pipeline stages: the schedule's bubble, the share of a stage's step spent waiting for
    /// the others (absent without stages).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pipeline: Option<PipelineStep>,
}

/// A pipeline's schedule in one step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PipelineStep {
    pub stages: usize,
    pub micro_batches: usize,
    /// GPipe: (stages − 1) / (micro_batches + stages − 1).
    pub bubble_fraction: f64,
}

/// The driver's count of a GPU's memory, which includes what the pool does not see.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NvmlReading {
    pub used_bytes: u64,
    pub total_bytes: u64,
    /// This process's bytes, when the driver reports them.
    pub process_bytes: Option<u64>,
}

/// One step's offload traffic.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Swap {
    pub bytes_to_host: usize,
    pub bytes_to_device: usize,
    #[serde(deserialize_with = "nan_if_null")]
    pub transfer_ms: f64,
    /// Copy time hidden behind other work (the pipelined host optimizer); `transfer_ms` is only
    /// what the step waited for. Absent from older trainers: 0.
    #[serde(default)]
    pub hidden_ms: f64,
    /// Time the step waited for the host optimizer's update (offload.optimizer), beyond its
    /// copies. Absent from older trainers: 0.
    #[serde(default)]
    pub host_ms: f64,
    /// `transfer_ms / step_ms`: what the policy's `swap_bound` is compared with.
    #[serde(deserialize_with = "nan_if_null")]
    pub fraction: f64,
}

/// A validation loss.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Eval {
    pub step: u64,
    #[serde(deserialize_with = "nan_if_null")]
    pub val_loss: f32,
}

/// A checkpoint is on disk (written atomically) at `path`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointWritten {
    pub step: u64,
    pub path: PathBuf,
}

/// An allocation did not fit the device.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Oom {
    /// Optimizer steps done before it (0 when the model itself did not fit).
    pub step: u64,
    pub requested_bytes: usize,
    /// The memory category of the request (a `Category` name).
    pub category: String,
    /// Lifetime peaks (see [`MemSnapshot::lifetime`]).
    pub mem: MemSnapshot,
    pub message: String,
}

/// Persistent buffers were moved out of sparsely used segments and the wholly free segments
/// given back: at a checkpoint, when the stranded share of `reserved` was above the job's
/// `device.defragment_above` (`reason` "checkpoint"), or on the `defragment` control line
/// ("requested").
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Defragmented {
    pub step: u64,
    pub reason: String,
    pub moved_buffers: usize,
    pub moved_bytes: usize,
    pub before: PoolShape,
    pub after: PoolShape,
}

/// Training is done and the final checkpoint written; the trainer exits [`ExitCode::Finished`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Finished {
    pub step: u64,
    pub final_loss: Option<f32>,
    pub peak_allocated: usize,
    pub peak_reserved: usize,
    pub mean_tokens_per_s: Option<f64>,
    /// Lifetime peaks.
    pub mem: MemSnapshot,
}

/// The `mem` object: bytes per category and the pool's totals (names as in the DB and page).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct MemSnapshot {
    pub params: usize,
    pub grads: usize,
    pub optimizer: usize,
    pub activations: usize,
    pub workspace: usize,
    pub allocated: usize,
    pub reserved: usize,
    pub fragmentation: usize,
    pub capacity: usize,
    pub peak_allocated: usize,
    pub peak_reserved: usize,
    pub host_params: usize,
    pub host_optimizer: usize,
    pub host_activations: usize,
    /// The largest free block cached in the pool when the snapshot was taken: with
    /// `reserved − allocated` (the cached bytes), it tells an allocation that fits the cache
    /// from one that only fits its total (fragmentation).
    pub largest_free_block: usize,
    /// What each category held at one moment — a step's: when its allocated total peaked (the
    /// sum is `allocated`); an `oom`'s: when the request failed. Absent from older trainers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub at_peak: Option<Composition>,
}

/// Words of [`MemSnapshot::to_words`].
pub const MEM_WORDS: usize = 22;

/// Bytes per category at one moment, and what the pool reserved then.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Composition {
    pub params: usize,
    pub grads: usize,
    pub optimizer: usize,
    pub activations: usize,
    pub workspace: usize,
    pub reserved: usize,
}

impl Composition {
    /// Training allocates no KV cache (inference only): the wire form has no field for it.
    fn of(c: [usize; crate::memory::CATEGORIES], reserved: usize) -> Composition {
        Composition { params: c[0], grads: c[1], optimizer: c[2], activations: c[3], workspace: c[4], reserved }
    }

    /// At the window's allocated peak.
    pub fn at_window_peak(s: &MemStats) -> Composition {
        Composition::of(s.window_at_peak, s.window_reserved_at_peak)
    }

    /// What is live now (an OOM's: when its request failed).
    pub fn current(s: &MemStats) -> Composition {
        Composition::of(s.current, s.reserved)
    }

    /// Params, grads, optimizer, activations, workspace.
    pub fn categories(&self) -> [usize; 5] {
        [self.params, self.grads, self.optimizer, self.activations, self.workspace]
    }
}

impl MemSnapshot {
    /// A step's figures: per-category bytes, `allocated` and `reserved` are the high-water
    /// marks of the current window (one optimizer step), so a step's activations show even
    /// though they are freed before the step ends.
    pub fn window(s: &MemStats) -> MemSnapshot {
        let w = &s.window_peak;
        MemSnapshot {
            params: w[0],
            grads: w[1],
            optimizer: w[2],
            activations: w[3],
            workspace: w[4],
            allocated: s.window_peak_allocated,
            reserved: s.window_peak_reserved,
            fragmentation: s.window_peak_reserved.saturating_sub(s.window_peak_allocated),
            capacity: s.capacity,
            peak_allocated: s.peak_allocated,
            peak_reserved: s.peak_reserved,
            host_params: s.host_window_peak[0],
            host_optimizer: s.host_window_peak[2],
            host_activations: s.host_window_peak[3],
            largest_free_block: s.largest_free_block,
            at_peak: Some(Composition::at_window_peak(s)),
        }
    }

    /// The snapshot as words, in field order (`at_peak`: a presence word, then its six), for
    /// ranks to exchange; [`MemSnapshot::from_words`] reads them back.
    pub fn to_words(&self) -> [u64; MEM_WORDS] {
        let c = self.at_peak.unwrap_or_default();
        [
            self.params,
            self.grads,
            self.optimizer,
            self.activations,
            self.workspace,
            self.allocated,
            self.reserved,
            self.fragmentation,
            self.capacity,
            self.peak_allocated,
            self.peak_reserved,
            self.host_params,
            self.host_optimizer,
            self.host_activations,
            self.largest_free_block,
            self.at_peak.is_some() as usize,
            c.params,
            c.grads,
            c.optimizer,
            c.activations,
            c.workspace,
            c.reserved,
        ]
        .map(|v| v as u64)
    }

    pub fn from_words(w: &[u64]) -> MemSnapshot {
        let v = |i: usize| w.get(i).copied().unwrap_or(0) as usize;
        MemSnapshot {
            params: v(0),
            grads: v(1),
            optimizer: v(2),
            activations: v(3),
            workspace: v(4),
            allocated: v(5),
            reserved: v(6),
            fragmentation: v(7),
            capacity: v(8),
            peak_allocated: v(9),
            peak_reserved: v(10),
            host_params: v(11),
            host_optimizer: v(12),
            host_activations: v(13),
            largest_free_block: v(14),
            at_peak: (v(15) == 1).then(|| Composition {
                params: v(16),
                grads: v(17),
                optimizer: v(18),
                activations: v(19),
                workspace: v(20),
                reserved: v(21),
            }),
        }
    }

    /// Lifetime peaks per category, with the current allocated/reserved (`oom`, `finished`).
    pub fn lifetime(s: &MemStats) -> MemSnapshot {
        let p = &s.peak;
        let allocated = s.allocated();
        MemSnapshot {
            params: p[0],
            grads: p[1],
            optimizer: p[2],
            activations: p[3],
            workspace: p[4],
            allocated,
            reserved: s.reserved,
            fragmentation: s.reserved.saturating_sub(allocated),
            capacity: s.capacity,
            peak_allocated: s.peak_allocated,
            peak_reserved: s.peak_reserved,
            host_params: s.host_peak[0],
            host_optimizer: s.host_peak[2],
            host_activations: s.host_peak[3],
            largest_free_block: s.largest_free_block,
            at_peak: None,
        }
    }

    /// The figures the attempt row keeps peaks of, in the DB's column order: params, grads,
    /// optimizer, activations, workspace, allocated, reserved.
    pub fn peak_columns(&self) -> [usize; 7] {
        [self.params, self.grads, self.optimizer, self.activations, self.workspace, self.allocated, self.reserved]
    }
}

/// A control line on the trainer's stdin (`{"cmd": ...}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "snake_case")]
#[repr(u8)]
pub enum Control {
    /// Checkpoint now and exit [`ExitCode::Preempted`] (the supervisor will resume elsewhere).
    CheckpointAndExit = 1,
    /// Checkpoint and exit [`ExitCode::Preempted`] for good (a cancelled job).
    Stop = 2,
    /// Give every cached segment that holds no live block back to the device, then go on
    /// training (the supervisor's answer to a full cache, where live memory is not).
    ReleaseCache = 3,
    /// Move persistent buffers out of sparsely used segments, give back every wholly free
    /// segment (the `defragmented` event says what changed), then go on training.
    Defragment = 4,
}

impl Control {
    /// The line as written to the trainer's stdin, newline included.
    pub fn to_line(self) -> String {
        format!("{}\n", serde_json::to_string(&self).expect("control lines serialise"))
    }

    pub fn parse(line: &str) -> Option<Control> {
        serde_json::from_str(line).ok()
    }

    /// As one byte (0 is "none"), for the flag the trainer's ranks share.
    pub fn code(self) -> u8 {
        self as u8
    }

    pub fn from_code(code: u8) -> Option<Control> {
        [Control::CheckpointAndExit, Control::Stop, Control::ReleaseCache, Control::Defragment]
            .into_iter()
            .find(|c| c.code() == code)
    }
}

/// How `headroom train` (and every other subcommand) exits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitCode {
    /// Done; for `train`, after the `finished` event.
    Finished = 0,
    /// A fault of the program or the machine (a failed write, a crashed rank).
    Internal = 1,
    /// The configuration or input is unusable: retrying cannot help.
    Invalid = 2,
    /// Out of device memory, after the `oom` event.
    OutOfMemory = 3,
    /// Stopped after a checkpoint, on request or at `--stop-after`.
    Preempted = 4,
}

impl ExitCode {
    pub const ALL: [ExitCode; 5] =
        [ExitCode::Finished, ExitCode::Internal, ExitCode::Invalid, ExitCode::OutOfMemory, ExitCode::Preempted];

    pub fn code(self) -> i32 {
        self as i32
    }

    /// The protocol's meaning of a child's exit status (`None`: a code it does not define).
    pub fn from_code(code: i32) -> Option<ExitCode> {
        ExitCode::ALL.into_iter().find(|c| c.code() == code)
    }
}

/// A launcher's rank variables (torchrun's): a `headroom train` of a process-rank job reads
/// RANK, LOCAL_RANK, MASTER_ADDR and MASTER_PORT for flags it was not given (WORLD_SIZE comes
/// with them, unread), so whoever starts a trainer as rank 0 of a group of its own removes them
/// from its environment.
pub const LAUNCHER_VARIABLES: [&str; 5] = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"];

/// The run directory's identity file: which run it belongs to.
pub const RUN_IDENTITY_FILE: &str = "run.json";
/// The run directory's lock file: held (an exclusive `flock`) by the one trainer using the
/// directory, released by the kernel when that process ends however it ends; it holds the
/// holder's pid as text.
pub const RUN_LOCK_FILE: &str = ".lock";

/// `run.json`: a run directory belongs to one run. `owner` names who made it (the supervisor
/// writes `<database id>/job-<id>`; a hand-run `headroom train` none unless `--run-owner`);
/// `lineage` changes on every `--fresh` start, and every checkpoint carries the lineage that
/// wrote it, so retention and resume never mix two runs' checkpoints.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunIdentity {
    pub format: u32,
    pub owner: Option<String>,
    pub lineage: String,
    /// n_layer, n_head, n_embd, block_size, vocab of the run's model.
    pub model: [u64; 5],
}

impl RunIdentity {
    /// The identity in `run_dir`, `Ok(None)` when it has none yet.
    pub fn read(run_dir: &std::path::Path) -> Result<Option<RunIdentity>, String> {
        let path = run_dir.join(RUN_IDENTITY_FILE);
        match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map(Some).map_err(|e| format!("{}: {e}", path.display())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(format!("{}: {e}", path.display())),
        }
    }
}

/// serde_json writes a non-finite float as `null`; read it back as NaN.
fn nan_if_null<'de, D: Deserializer<'de>, F: Deserialize<'de> + NanDefault>(d: D) -> Result<F, D::Error> {
    Ok(Option::<F>::deserialize(d)?.unwrap_or(F::NAN))
}

trait NanDefault {
    const NAN: Self;
}
impl NanDefault for f32 {
    const NAN: f32 = f32::NAN;
}
impl NanDefault for f64 {
    const NAN: f64 = f64::NAN;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mem(seed: usize) -> MemSnapshot {
        MemSnapshot {
            params: seed,
            grads: seed + 1,
            optimizer: seed + 2,
            activations: seed + 3,
            workspace: seed + 4,
            allocated: seed + 5,
            reserved: seed + 6,
            fragmentation: 1,
            capacity: 1 << 30,
            peak_allocated: seed + 7,
            peak_reserved: seed + 8,
            host_params: 9,
            host_optimizer: 10,
            host_activations: 11,
            largest_free_block: 12,
            at_peak: Some(Composition {
                params: seed,
                grads: 1,
                optimizer: 2,
                activations: 3,
                workspace: 4,
                reserved: 13,
            }),
        }
    }

    fn every_variant() -> Vec<Event> {
        vec![
            Event::Started(Started {
                config: serde_json::json!({ "name": "j" }),
                world_size: 2,
                device: "cpu:0".into(),
                capacity: 1 << 20,
                resumed_from_step: Some(40),
                num_params: 1234,
                grad_accum: 4,
                unigram_entropy: 3.5,
            }),
            Event::Step(Step {
                step: 41,
                loss: 2.25,
                lr: 3e-4,
                grad_norm: 0.5,
                tokens_per_s: 1000.0,
                step_ms: 12.5,
                mem: mem(100),
                mem_rank: Some(1),
                precision: "bf16".into(),
                loss_scale: Some(65536.0),
                skipped: true,
                skipped_steps: 1,
                nvml: Some(NvmlReading { used_bytes: 5, total_bytes: 6, process_bytes: None }),
                swap: Some(Swap {
                    bytes_to_host: 7,
                    bytes_to_device: 8,
                    transfer_ms: 1.5,
                    hidden_ms: 0.5,
                    host_ms: 2.0,
                    fraction: 0.125,
                }),
                pipeline: Some(PipelineStep { stages: 2, micro_batches: 4, bubble_fraction: 0.2 }),
            }),
            Event::Eval(Eval { step: 41, val_loss: 2.5 }),
            Event::Checkpoint(CheckpointWritten { step: 41, path: "runs/j/ckpt-00000041.bin".into() }),
            Event::Oom(Oom {
                step: 3,
                requested_bytes: 4096,
                category: "activations".into(),
                mem: mem(7),
                message: "out of device memory".into(),
            }),
            Event::Finished(Finished {
                step: 50,
                final_loss: Some(1.75),
                peak_allocated: 99,
                peak_reserved: 100,
                mean_tokens_per_s: None,
                mem: mem(3),
            }),
        ]
    }

    #[test]
    fn every_event_round_trips_through_its_line() {
        for event in every_variant() {
            let line = Line { t: 1700000000.25, event: event.clone() };
            let text = line.to_json();
            assert!(!text.contains('\n'), "one line: {text}");
            assert_eq!(Line::parse(&text), Some(line), "{text}");
        }
    }

    #[test]
    fn the_wire_names_are_the_documented_ones() {
        let kinds: Vec<String> = every_variant()
            .into_iter()
            .map(|e| serde_json::from_str::<serde_json::Value>(&Line::now(e).to_json()).unwrap()["event"].to_string())
            .collect();
        assert_eq!(kinds, ["\"started\"", "\"step\"", "\"eval\"", "\"checkpoint\"", "\"oom\"", "\"finished\""]);
        let step = serde_json::to_value(Line::now(every_variant().swap_remove(1))).unwrap();
        for key in ["t", "step", "loss", "lr", "tokens_per_s", "step_ms", "mem", "swap", "nvml"] {
            assert!(step.get(key).is_some(), "step has `{key}`: {step}");
        }
        assert_eq!(step["mem"]["host_activations"], 11);
        assert_eq!(step["swap"]["fraction"], 0.125);
    }

    #[test]
    fn a_newer_trainers_extra_fields_and_kinds_are_tolerated() {
        let step = r#"{"event":"step","t":1.5,"step":3,"loss":2.0,"lr":0.1,"grad_norm":1.0,"tokens_per_s":10.0,
            "step_ms":2.0,"precision":"fp32","mem":{"params":4,"kv_cache":9,"capacity":64},"bubble":0.1}"#;
        let line = Line::parse(&step.replace('\n', " ")).expect("extra fields are ignored");
        let Event::Step(s) = line.event else { panic!("a step: {line:?}") };
        assert_eq!((s.step, s.mem.params, s.mem.capacity, s.swap), (3, 4, 64, None));
        let new_kind = Line::parse(r#"{"event":"profile","t":2.0,"rows":[1,2]}"#).expect("an unknown kind is an event");
        assert_eq!(new_kind.event, Event::Unknown);
        assert_eq!(Line::parse("progress 50%"), None, "not a protocol line");
    }

    #[test]
    fn non_finite_floats_survive_as_nan() {
        let line = Line::now(Event::Eval(Eval { step: 1, val_loss: f32::NAN }));
        let text = line.to_json();
        assert!(text.contains("\"val_loss\":null"), "{text}");
        let Some(Line { event: Event::Eval(e), .. }) = Line::parse(&text) else { panic!("{text}") };
        assert!(e.val_loss.is_nan());
    }

    #[test]
    fn control_lines_and_exit_codes_are_the_documented_ones() {
        assert_eq!(Control::CheckpointAndExit.to_line(), "{\"cmd\":\"checkpoint_and_exit\"}\n");
        assert_eq!(Control::Stop.to_line(), "{\"cmd\":\"stop\"}\n");
        assert_eq!(Control::ReleaseCache.to_line(), "{\"cmd\":\"release_cache\"}\n");
        assert_eq!(Control::Defragment.to_line(), "{\"cmd\":\"defragment\"}\n");
        for c in [Control::CheckpointAndExit, Control::Stop, Control::ReleaseCache, Control::Defragment] {
            assert_eq!(Control::parse(c.to_line().trim()), Some(c));
            assert_eq!(Control::from_code(c.code()), Some(c));
        }
        assert_eq!(Control::from_code(0), None);
        assert_eq!(Control::parse(r#"{"cmd":"reboot"}"#), None);
        let codes: Vec<i32> = ExitCode::ALL.iter().map(|c| c.code()).collect();
        assert_eq!(codes, [0, 1, 2, 3, 4]);
        assert_eq!(ExitCode::from_code(3), Some(ExitCode::OutOfMemory));
        assert_eq!(ExitCode::from_code(101), None);
    }
}
