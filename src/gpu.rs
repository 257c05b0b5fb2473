//! GPU readings through NVML (nvml-wrapper, loaded at run time), for the supervisor's monitor
//! and the trainer's `step` events on `cuda`. On a machine without the NVIDIA driver NVML is
//! simply absent: the supervisor then monitors only the trainer's own pool figures, which is
//! what `cpu` devices use anyway.

use nvml_wrapper::Nvml;
use serde::Serialize;

/// One GPU's memory as NVML reports it.
#[derive(Debug, Clone, Serialize)]
pub struct GpuReading {
    pub index: u32,
    pub name: String,
    pub used_bytes: u64,
    pub total_bytes: u64,
    /// Bytes used by each process with a context on this GPU: (pid, bytes).
    pub processes: Vec<(u32, u64)>,
}

pub struct GpuMonitor {
    nvml: Option<Nvml>,
}

impl GpuMonitor {
    /// Load NVML if it is there; say once in the log when it is not.
    pub fn init() -> GpuMonitor {
        match Nvml::init() {
            Ok(nvml) => {
                tracing::info!(devices = nvml.device_count().unwrap_or(0), "NVML loaded: GPU memory is monitored");
                GpuMonitor { nvml: Some(nvml) }
            }
            Err(e) => {
                tracing::info!("NVML not available ({e}); monitoring from the trainers' own pool figures");
                GpuMonitor { nvml: None }
            }
        }
    }

    pub fn available(&self) -> bool {
        self.nvml.is_some()
    }

    /// The reading of GPU `index` (None without NVML or without that GPU).
    pub fn reading(&self, index: u32) -> Option<GpuReading> {
        self.readings().into_iter().find(|r| r.index == index)
    }

    /// Current readings of every GPU (empty without NVML).
    pub fn readings(&self) -> Vec<GpuReading> {
        let Some(nvml) = &self.nvml else { return Vec::new() };
        let count = nvml.device_count().unwrap_or(0);
        (0..count)
            .filter_map(|index| {
                let dev = nvml.device_by_index(index).ok()?;
                let mem = dev.memory_info().ok()?;
                let processes = dev
                    .running_compute_processes()
                    .unwrap_or_default()
                    .into_iter()
                    .map(|p| {
                        let used = match p.used_gpu_memory {
                            nvml_wrapper::enums::device::UsedGpuMemory::Used(b) => b,
                            nvml_wrapper::enums::device::UsedGpuMemory::Unavailable => 0,
                        };
                        (p.pid, used)
                    })
                    .collect();
                Some(GpuReading {
                    index,
                    name: dev.name().unwrap_or_default(),
                    used_bytes: mem.used,
                    total_bytes: mem.total,
                    processes,
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_machine_without_nvml_falls_back_cleanly() {
        let m = GpuMonitor::init();
        if !m.available() {
            assert!(m.readings().is_empty());
        } else {
            assert!(m.readings().iter().all(|r| r.used_bytes <= r.total_bytes));
        }
    }
}
