//! headroom: an adaptive training-job supervisor and the GPT training engine it supervises.
//!
//! `engine` trains; `memory` is the budgeted device pool every engine byte goes through;
//! `config` is the job spec and `protocol` the trainer↔supervisor line protocol, both shared by
//! the trainer and the supervisor; `gpu` reads NVML for both, `files` holds the lock files and
//! move-aside names both use.

pub mod cli;
pub mod config;
pub mod engine;
pub mod files;
pub mod gpu;
pub mod memory;
pub mod protocol;
pub mod shipped;
pub mod supervisor;
