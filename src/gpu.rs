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

/// Where a trainer's step events get the device-wide view of its GPU's memory (other
/// processes included): NVML ([`GpuMonitor`]), or in tests [`SimulatedGpu`].
pub trait GpuReadings: Send {
    /// The reading of GPU `index` (None when it cannot be read).
    fn reading(&self, index: u32) -> Option<GpuReading>;
}

impl GpuReadings for GpuMonitor {
    fn reading(&self, index: u32) -> Option<GpuReading> {
        GpuMonitor::reading(self, index)
    }
}

/// The variable that names a [`SimulatedGpu`]'s file (a test hook: set only by tests).
pub const SIMULATED_GPU_ENV: &str = "HEADROOM_SIMULATED_GPU";

/// A test provider: a GPU of `total_bytes` on which this process holds what `own` says (the
/// trainer's pool) and other processes hold the number of bytes written in `path` (re-read at
/// every reading; a missing or unreadable file is 0) — so a test can make another process take
/// memory and give it back while a real trainer runs.
pub struct SimulatedGpu {
    pub path: std::path::PathBuf,
    pub total_bytes: u64,
    pub own: Box<dyn Fn() -> u64 + Send>,
}

impl GpuReadings for SimulatedGpu {
    fn reading(&self, index: u32) -> Option<GpuReading> {
        let others: u64 = std::fs::read_to_string(&self.path).ok().and_then(|t| t.trim().parse().ok()).unwrap_or(0);
        let own = (self.own)();
        Some(GpuReading {
            index,
            name: "simulated".into(),
            used_bytes: own + others,
            total_bytes: self.total_bytes,
            processes: vec![(std::process::id(), own)],
        })
    }
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
    fn a_simulated_gpu_reads_other_processes_from_its_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("others");
        let gpu = SimulatedGpu { path: path.clone(), total_bytes: 100, own: Box::new(|| 30) };
        let r = gpu.reading(0).unwrap();
        assert_eq!((r.used_bytes, r.total_bytes, r.processes[0].1), (30, 100, 30), "no file: nobody else");
        std::fs::write(&path, "45\n").unwrap();
        assert_eq!(gpu.reading(0).unwrap().used_bytes, 75);
        std::fs::write(&path, "0").unwrap();
        assert_eq!(gpu.reading(0).unwrap().used_bytes, 30);
    }

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
