//! Training: one rank's state and optimizer step (`trainer`), the `headroom train` job loop that
//! speaks the protocol (`job`), checkpoints, and the data pipeline.

pub mod checkpoint;
pub mod data;
pub mod job;
pub mod trainer;
