//! Verification and measurement: op parity and training parity of a backend against the CPU
//! reference, finite-difference gradient checks, `DeviceSim` (the device path on CPU), the
//! ranks tests and the `headroom bench` harness. None of it is on the training path.

pub mod bench;
#[cfg(test)]
pub(crate) mod device_sim;
#[cfg(test)]
mod gradcheck;
pub mod parity;
#[cfg(test)]
mod ranks_tests;
pub mod train_parity;
