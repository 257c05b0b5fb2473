//! `SwapStats`: bytes moved between device and host in a step, and the time the copies took —
//! the part the step waited for, and the part hidden behind other work.

/// Bytes moved between device and host in one step, and the time the copies took.
#[derive(Debug, Clone, Copy, Default)]
pub struct SwapStats {
    pub bytes_to_host: usize,
    pub bytes_to_device: usize,
    /// Copy time the step waited for (exposed): what the policy's `swap_bound` compares.
    pub transfer_ms: f64,
    /// Copy time that ran while other work did (the host optimizer's update of an earlier
    /// chunk), so the step did not wait for it.
    pub hidden_ms: f64,
    /// Time the step waited for the host optimizer's update beyond its copies (the offloaded
    /// step's own work: with the delayed update, only what outlasted the device's step).
    pub host_ms: f64,
}

impl SwapStats {
    pub fn add(&mut self, o: SwapStats) {
        self.bytes_to_host += o.bytes_to_host;
        self.bytes_to_device += o.bytes_to_device;
        self.transfer_ms += o.transfer_ms;
        self.hidden_ms += o.hidden_ms;
        self.host_ms += o.host_ms;
    }
}
