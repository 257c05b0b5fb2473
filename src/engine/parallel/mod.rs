//! Data parallelism: ranks' collectives (`comm`; between processes over `tcp`), where weights and gradients are during a pass
//! (`placement`), and the device↔host traffic they cause (`swap`).

pub mod comm;
pub mod placement;
mod swap;
pub mod tcp;

pub use swap::SwapStats;
