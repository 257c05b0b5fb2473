//! `SwapStats`: bytes moved between device and host in a step, and the time the copies took.

/// Bytes moved between device and host in one step, and the time the copies took.
#[derive(Debug, Clone, Copy, Default)]
pub struct SwapStats {
    pub bytes_to_host: usize,
    pub bytes_to_device: usize,
    pub transfer_ms: f64,
}

impl SwapStats {
    pub fn add(&mut self, o: SwapStats) {
        self.bytes_to_host += o.bytes_to_host;
        self.bytes_to_device += o.bytes_to_device;
        self.transfer_ms += o.transfer_ms;
    }
}
