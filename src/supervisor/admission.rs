//! Admission control: a job whose configuration cannot run on this machine (its device pool
//! larger than the device or than the daemon's cap, or more host memory than the machine has)
//! is refused at submission with the field and the figures, instead of being accepted and
//! failing, or taking the machine down, later. Pure: the machine is described by [`Machine`].

use crate::config::{DeviceKind, JobSpec};
use crate::engine::estimate::estimate_job;
use crate::memory::format_bytes;

/// What this machine and daemon allow.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Machine {
    /// Physical host memory (None: unknown, not checked).
    pub host_bytes: Option<u64>,
    /// Memory of each GPU by index, where NVML reads it.
    pub gpu_bytes: Vec<(u32, u64)>,
    /// `serve --max-device-memory`: the largest device pool a job may ask for.
    pub max_device_memory: Option<u64>,
}

impl Machine {
    /// This machine: host memory from /proc/meminfo, GPUs from NVML readings.
    pub fn detect(gpus: &crate::gpu::GpuMonitor, max_device_memory: Option<u64>) -> Machine {
        let host_bytes = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
            let line = m.lines().find(|l| l.starts_with("MemTotal:"))?;
            let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
            Some(kib * 1024)
        });
        let gpu_bytes = gpus.readings().iter().map(|r| (r.index, r.total_bytes)).collect();
        Machine { host_bytes, gpu_bytes, max_device_memory }
    }
}

/// Refuse a (validated) job this machine cannot run, naming the field and the figures.
pub fn admit(spec: &JobSpec, machine: &Machine) -> Result<(), String> {
    let world = spec.memory.world_size as u64;
    let pool = spec.device_capacity().map(|b| b as u64);
    let fmt = |b: u64| format_bytes(b as usize);
    if let (Some(pool), Some(cap)) = (pool, machine.max_device_memory) {
        if pool > cap {
            return Err(format!(
                "device.device_memory: {} is above this daemon's limit of {} (serve --max-device-memory)",
                fmt(pool),
                fmt(cap)
            ));
        }
    }
    let estimate = estimate_job(spec);
    let mut host_need = world * (estimate.host_optimizer + estimate.host_params) as u64;
    match spec.device.kind {
        DeviceKind::Cpu => {
            // A cpu device's pool lives in host memory: at most its capacity, at most the peak.
            let per_rank =
                pool.map_or(estimate.reserved_allowance as u64, |p| p.min(estimate.reserved_allowance as u64));
            if let (Some(pool), Some(host)) = (pool, machine.host_bytes) {
                if pool > host {
                    return Err(format!(
                        "device.device_memory: {} is more than this machine's {} of memory (a cpu device's pool \
                         lives in host memory)",
                        fmt(pool),
                        fmt(host)
                    ));
                }
            }
            host_need += world * per_rank;
        }
        DeviceKind::Cuda => {
            for rank in 0..world as u32 {
                let index = spec.device.index + rank;
                let Some(&(_, total)) = machine.gpu_bytes.iter().find(|(i, _)| *i == index) else { continue };
                if let Some(pool) = pool.filter(|&p| p > total) {
                    return Err(format!(
                        "device.device_memory: {} is more than cuda:{index}'s {} of memory",
                        fmt(pool),
                        fmt(total)
                    ));
                }
            }
        }
    }
    if let Some(host) = machine.host_bytes {
        if host_need > host {
            return Err(format!(
                "this job needs about {} of host memory as configured (device pools on the host and offloaded \
                 state, {} rank(s)), more than this machine's {}",
                fmt(host_need),
                world,
                fmt(host)
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::supervisor::policy::tests::spec;

    const GIB: u64 = 1 << 30;

    fn job(edit: impl FnOnce(&mut JobSpec)) -> JobSpec {
        let mut s = spec(8);
        edit(&mut s);
        s
    }

    #[test]
    fn what_the_machine_cannot_hold_is_refused_naming_the_figures() {
        let machine = Machine { host_bytes: Some(23 * GIB), gpu_bytes: vec![(0, 16 * GIB)], max_device_memory: None };
        let unknown = Machine::default();
        let capped = Machine { max_device_memory: Some(GIB), ..machine.clone() };
        let mem = |s: &str| Some(crate::config::Bytes::from(s.to_string()));
        let cases: Vec<(&str, JobSpec, &Machine, Option<&str>)> = vec![
            ("a small job", spec(8), &machine, None),
            ("no figures known: nothing checked", job(|s| s.device.device_memory = mem("100TiB")), &unknown, None),
            (
                "cpu pool above host memory",
                job(|s| s.device.device_memory = mem("100TiB")),
                &machine,
                Some("device.device_memory: 100.00 TiB is more than this machine's 23.00 GiB"),
            ),
            (
                "above the daemon's cap",
                job(|s| s.device.device_memory = mem("2GiB")),
                &capped,
                Some("above this daemon's limit of 1.00 GiB"),
            ),
            (
                "cuda pool above the GPU",
                job(|s| {
                    s.device.kind = DeviceKind::Cuda;
                    s.device.device_memory = mem("20GiB");
                }),
                &machine,
                Some("cuda:0's 16.00 GiB"),
            ),
            (
                "a GPU NVML does not see is not checked",
                job(|s| {
                    s.device.kind = DeviceKind::Cuda;
                    s.device.index = 3;
                    s.device.device_memory = mem("20GiB");
                }),
                &machine,
                None,
            ),
            (
                "ranks' cpu pools together above host memory",
                job(|s| {
                    s.device.device_memory = mem("16GiB");
                    s.model.n_layer = 48;
                    s.model.n_embd = 1600;
                    s.model.n_head = 25;
                    s.memory.world_size = 2;
                    s.train.global_batch = 2;
                    s.train.micro_batch = 1;
                }),
                &machine,
                Some("needs about 32.00 GiB of host memory"),
            ),
        ];
        for (what, spec, machine, expected) in cases {
            spec.validate().unwrap_or_else(|e| panic!("{what}: the case is not a valid job: {e}"));
            match (admit(&spec, machine), expected) {
                (Ok(()), None) => {}
                (Err(e), Some(part)) => assert!(e.contains(part), "{what}: {e}"),
                (got, want) => panic!("{what}: got {got:?}, wanted {want:?}"),
            }
        }
    }
}
