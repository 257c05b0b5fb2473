//! The GPT training engine. Knows nothing of HTTP, SQL or the supervisor.
//!
//! - `backend/`: the op set (`Backend`), its errors, views and shape contracts, the CPU
//!   reference (`layers.rs`, `optim.rs`, `CpuBackend`), CUDA (`cuda/`) and the native
//!   collectives it offers;
//! - `model/`: GPT-2 sizes, parameter layout and the forward/backward passes;
//! - `parallel/`: ranks' collectives, placement of weights and gradients, swap accounting;
//! - `train/`: the trainer, the `headroom train` job loop, checkpoints, data;
//! - `estimate.rs` (the memory model), `rng.rs`;
//! - `quant.rs`: post-training INT8/INT4 weight quantization, its file, and the dequantizing
//!   weight source inference reads through;
//! - `check/`: parity, gradcheck, `DeviceSim`, benchmarks — verification, not the training path.

pub mod backend;
pub mod check;
pub mod defrag;
pub mod estimate;
pub mod model;
pub mod parallel;
pub mod quant;
pub mod rng;
pub mod train;

pub use train::job::{Events, ProcessOptions, RankOptions, ResumeMode, TrainError, TrainOptions};
pub use train::train;
