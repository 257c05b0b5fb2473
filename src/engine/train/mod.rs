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
