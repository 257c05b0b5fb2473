//! The GPT training engine: CPU reference layers, model, optimizer, data, checkpoints and the
//! `headroom train` loop. Knows nothing of HTTP, SQL or the supervisor.

pub mod backend;
pub mod bench;
pub mod checkpoint;
pub mod collectives;
pub mod comm;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod data;
#[cfg(test)]
pub(crate) mod device_sim;
pub mod estimate;
pub mod layers;
pub mod model;
pub mod optim;
pub mod parity;
pub mod placement;
pub mod rng;
pub mod run;
pub mod train_parity;
pub mod trainer;

#[cfg(test)]
mod gradcheck;
#[cfg(test)]
mod ranks_tests;

pub use run::{train, Events, ResumeMode, TrainError, TrainOptions};
