//! Training: one rank's state and optimizer step (`trainer`), the `headroom train` job loop that
//! speaks the protocol (`job`), ranks as processes (`processes`: rank 0 starting and joining
//! the others), checkpoints, the run directory's lock and identity (`run_dir`),
//! and the data pipeline.

pub mod checkpoint;
pub mod data;
mod host_optimizer;
pub mod job;
mod processes;
pub mod run_dir;
pub mod trainer;

use crate::config::{JobSpec, Ranks};
use job::{Events, TrainError, TrainOptions};

/// Run the job (`headroom train`): its ranks as threads of this process, or — with
/// `memory.ranks: processes` — as this rank's process of a group. On OOM the `oom` event has
/// been written before the error returns.
pub fn train(spec: &JobSpec, opts: &TrainOptions, events: &mut Events) -> Result<(), TrainError> {
    spec.validate()?;
    if spec.memory.ranks == Ranks::Processes && spec.memory.world_size > 1 {
        return processes::train(spec, opts, events);
    }
    job::train_in_process(spec, opts, events)
}
