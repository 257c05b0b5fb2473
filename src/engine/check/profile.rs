//! Where a training step's time goes: `Profiled`, a backend that wraps another and times every
//! op it is asked for, and the per-op table `headroom bench --profile` and `headroom gpu-check
//! --profile` print (calls, ms per step, share of the step, achieved TFLOP/s or GB/s).
//!
//! Each op is timed from its call until the device is idle again (`synchronize` after it), so
//! on a GPU the figure is the op's launch plus its execution with nothing overlapping it: a
//! profiled step runs ops one at a time and is slower than the step itself (both are printed);
//! the shares are what tell where the time goes. Time the step spends outside every op — host
//! code, the allocator, waiting on copies issued ahead — is its own row.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bytemuck::Pod;

use crate::engine::backend::collectives::DeviceCollectives;
use crate::engine::backend::layers::Elem;
use crate::engine::backend::optim::AdamW;
use crate::engine::backend::{Backend, BackendResult, HostPin, View, ViewMut};
use crate::memory::Pool;

/// Bytes a view spans (what an op reads or writes through it).
pub trait ViewBytes {
    fn view_bytes(&self) -> usize;
}

impl<T: Pod> ViewBytes for View<'_, T> {
    fn view_bytes(&self) -> usize {
        self.len() * std::mem::size_of::<T>()
    }
}

impl<T: Pod> ViewBytes for ViewMut<'_, T> {
    fn view_bytes(&self) -> usize {
        self.len() * std::mem::size_of::<T>()
    }
}

impl<V: ViewBytes> ViewBytes for Option<V> {
    fn view_bytes(&self) -> usize {
        self.as_ref().map_or(0, ViewBytes::view_bytes)
    }
}

/// One op's totals.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct OpTotals {
    pub calls: u64,
    pub secs: f64,
    /// Bytes of every view passed to it (read or written once each: a lower bound on traffic).
    pub bytes: f64,
    /// Floating-point operations, where the op's are known (matmuls, attention).
    pub flops: f64,
}

/// The totals of every op since the last reset, by op name.
pub type Totals = BTreeMap<&'static str, OpTotals>;

/// A backend that times every op of the one it wraps (see the module doc).
pub struct Profiled<B> {
    inner: B,
    totals: Arc<Mutex<Totals>>,
}

/// A handle on a `Profiled` backend's totals that outlives the trainer owning the backend.
#[derive(Clone)]
pub struct ProfileHandle(Arc<Mutex<Totals>>);

impl ProfileHandle {
    pub fn reset(&self) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }

    pub fn totals(&self) -> Totals {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

impl<B: Backend> Profiled<B> {
    pub fn new(inner: B) -> Profiled<B> {
        Profiled { inner, totals: Arc::default() }
    }

    pub fn handle(&self) -> ProfileHandle {
        ProfileHandle(self.totals.clone())
    }

    /// Run one op and wait for the device, adding its time, bytes and FLOPs to its row.
    fn time<R>(
        &self,
        op: &'static str,
        bytes: usize,
        flops: f64,
        f: impl FnOnce() -> BackendResult<R>,
    ) -> BackendResult<R> {
        let started = Instant::now();
        let out = f()?;
        self.inner.synchronize()?;
        let secs = started.elapsed().as_secs_f64();
        let mut totals = self.totals.lock().unwrap_or_else(|p| p.into_inner());
        let row = totals.entry(op).or_default();
        row.calls += 1;
        row.secs += secs;
        row.bytes += bytes as f64;
        row.flops += flops;
        Ok(out)
    }
}

/// `delegate_ops!`'s wrapper for `Profiled`: time the call, count its views' bytes.
macro_rules! timed_call {
    ($s:tt, $op:literal, [$($v:expr),*], $call:expr) => {{
        let bytes = 0 $(+ ViewBytes::view_bytes(&$v))*;
        $s.time($op, bytes, 0.0, || $call)
    }};
}

impl<B: Backend> Backend for Profiled<B> {
    type Fence = B::Fence;

    fn device(&self) -> String {
        self.inner.device()
    }
    fn pool(&self) -> &Pool {
        self.inner.pool()
    }
    fn synchronize(&self) -> BackendResult {
        self.inner.synchronize()
    }
    fn collectives(&self) -> Option<&dyn DeviceCollectives> {
        self.inner.collectives()
    }
    fn upload<T: Pod>(&self, dst: ViewMut<T>, src: &[T]) -> BackendResult {
        let bytes = dst.view_bytes();
        self.time("upload", bytes, 0.0, || self.inner.upload(dst, src))
    }
    fn download<T: Pod>(&self, src: View<T>, dst: &mut [T]) -> BackendResult {
        let bytes = src.view_bytes();
        self.time("download", bytes, 0.0, || self.inner.download(src, dst))
    }
    fn zero<T: Pod>(&self, dst: ViewMut<T>) -> BackendResult {
        let bytes = dst.view_bytes();
        self.time("zero", bytes, 0.0, || self.inner.zero(dst))
    }
    // Copies ahead overlap by design: issuing them is not timed as an op, and what the step
    // waits for them shows in `wait_copy` / `wait_host`.
    fn upload_ahead<T: Pod>(&self, dst: ViewMut<T>, src: &[T]) -> BackendResult<B::Fence> {
        self.inner.upload_ahead(dst, src)
    }
    fn wait_copy(&self, fence: B::Fence) -> BackendResult {
        self.time("wait_copy", 0, 0.0, || self.inner.wait_copy(fence))
    }
    unsafe fn download_ahead<T: Pod>(&self, src: View<T>, dst: &mut [T]) -> BackendResult<B::Fence> {
        // SAFETY: the caller keeps the contract of `download_ahead`.
        unsafe { self.inner.download_ahead(src, dst) }
    }
    fn wait_host(&self, fence: B::Fence) -> BackendResult {
        self.time("wait_host", 0, 0.0, || self.inner.wait_host(fence))
    }
    fn pin_host(&self, mem: &mut [u8]) -> BackendResult<HostPin> {
        self.inner.pin_host(mem)
    }

    // out: (n, oc) = inp (n, c) · weightᵀ (oc, c) + bias: 2·n·c·oc FLOPs.
    fn matmul_forward<E: Elem>(
        &self,
        out: ViewMut<E>,
        inp: View<E>,
        weight: View<E>,
        bias: Option<View<E>>,
        n: usize,
        c: usize,
        oc: usize,
    ) -> BackendResult {
        let bytes = out.view_bytes() + inp.view_bytes() + weight.view_bytes() + bias.view_bytes();
        let flops = 2.0 * (n * c * oc) as f64;
        self.time("matmul_forward", bytes, flops, || self.inner.matmul_forward(out, inp, weight, bias, n, c, oc))
    }
    // dinp = dout · weight and dweight += doutᵀ · inp: 4·n·c·oc FLOPs.
    fn matmul_backward<E: Elem>(
        &self,
        dinp: ViewMut<E>,
        dweight: ViewMut<E>,
        dbias: Option<ViewMut<E>>,
        dout: View<E>,
        inp: View<E>,
        weight: View<E>,
        n: usize,
        c: usize,
        oc: usize,
    ) -> BackendResult {
        let bytes = dinp.view_bytes()
            + dweight.view_bytes()
            + dbias.view_bytes()
            + dout.view_bytes()
            + inp.view_bytes()
            + weight.view_bytes();
        let flops = 4.0 * (n * c * oc) as f64;
        self.time("matmul_backward", bytes, flops, || {
            self.inner.matmul_backward(dinp, dweight, dbias, dout, inp, weight, n, c, oc)
        })
    }
    // Scores q·kᵀ and the weighted sum p·v over every (query, key) pair: 2 · 2·b·t²·c FLOPs
    // as the cuBLAS path computes them (the causal half masked, not skipped). A nominal figure
    // for the fused kernels, which skip most of the masked half (and recompute more in
    // backward): compare those rows by time.
    fn attention_forward<E: Elem>(
        &self,
        out: ViewMut<E>,
        lse: ViewMut<f32>,
        qkv: View<E>,
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
    ) -> BackendResult {
        let bytes = out.view_bytes() + lse.view_bytes() + qkv.view_bytes();
        let flops = 4.0 * (b * t * t * c) as f64;
        self.time("attention_forward", bytes, flops, || self.inner.attention_forward(out, lse, qkv, b, t, c, nh))
    }
    // The scores again (the probabilities are recomputed), then two gradients of each of the
    // forward's two products: 5 · 2·b·t²·c.
    fn attention_backward<E: Elem>(
        &self,
        dqkv: ViewMut<E>,
        dout: View<E>,
        qkv: View<E>,
        lse: View<f32>,
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
    ) -> BackendResult {
        let bytes = dqkv.view_bytes() + dout.view_bytes() + qkv.view_bytes() + lse.view_bytes();
        let flops = 10.0 * (b * t * t * c) as f64;
        self.time("attention_backward", bytes, flops, || {
            self.inner.attention_backward(dqkv, dout, qkv, lse, b, t, c, nh)
        })
    }

    delegate_ops!(inner, std::convert::identity, via timed_call;
        encoder_forward, encoder_backward, layernorm_forward, layernorm_recompute, layernorm_backward,
        gelu_forward, gelu_backward_inplace, residual_forward_inplace, crossentropy_forward,
        crossentropy_forward_backward, adamw, sum_squares, narrow, widen, pack_int8, unpack_int8, unpack_int4, attention_cached);
}

/// The profile table: one row per op (slowest first) with calls and milliseconds per step, share
/// of the profiled step, and achieved TFLOP/s (matmuls, attention) or GB/s (the rest, from the
/// bytes of its views), then the time outside every op. `step_ms`: the profiled step's mean;
/// `plain_ms`: the same step unprofiled, for scale.
pub fn table(totals: &Totals, steps: usize, step_ms: f64, plain_ms: Option<f64>) -> String {
    let steps = steps.max(1) as f64;
    let mut rows: Vec<(&str, OpTotals)> = totals.iter().map(|(k, v)| (*k, *v)).collect();
    rows.sort_by(|a, b| b.1.secs.total_cmp(&a.1.secs));
    let mut out = format!(
        "profile: {step_ms:.2} ms per profiled step (ops one at a time){}\n{:<30} {:>10} {:>10} {:>7} {:>16}\n",
        plain_ms.map(|p| format!(", {p:.2} ms unprofiled")).unwrap_or_default(),
        "op",
        "calls/step",
        "ms/step",
        "share",
        "achieved"
    );
    let mut in_ops = 0.0;
    for (op, t) in rows {
        let ms = t.secs * 1e3 / steps;
        in_ops += ms;
        let rate = if t.flops > 0.0 {
            format!("{:.2} TFLOP/s", t.flops / t.secs.max(1e-12) / 1e12)
        } else if t.bytes > 0.0 {
            format!("{:.1} GB/s", t.bytes / t.secs.max(1e-12) / 1e9)
        } else {
            String::new()
        };
        out.push_str(&format!(
            "{op:<30} {:>10.1} {ms:>10.3} {:>6.1}% {rate:>16}\n",
            t.calls as f64 / steps,
            100.0 * ms / step_ms.max(1e-12)
        ));
    }
    let outside = (step_ms - in_ops).max(0.0);
    out.push_str(&format!(
        "{:<30} {:>10} {outside:>10.3} {:>6.1}%\n",
        "outside ops (host, allocator)",
        "",
        100.0 * outside / step_ms.max(1e-12)
    ));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::backend::CpuBackend;
    use crate::engine::check::bench::{run_on, run_on_with, BenchCase, Techniques};
    use crate::engine::model::{GptConfig, PpStage, TpShard};

    fn cpu() -> CpuBackend {
        CpuBackend::new(Pool::new("cpu", 1 << 30))
    }

    /// The profiler changes nothing the step computes, counts every op call of it, and its
    /// table accounts for the whole step.
    #[test]
    fn a_profiled_step_is_the_same_step_with_every_op_counted() {
        let case = BenchCase {
            label: "d2-64".into(),
            cfg: GptConfig {
                n_layer: 2,
                n_head: 4,
                n_embd: 64,
                block_size: 32,
                vocab: 256,
                tp: TpShard::NONE,
                pp: PpStage::NONE,
            },
            batch: 4,
            seq: 32,
        };
        let (micro, steps) = (2, 3); // 2 micro-batches per step
        let (plain, _) = run_on::<f32, _>(cpu(), &case, micro, Techniques::default(), 1, steps).unwrap();
        let profiled = Profiled::new(cpu());
        let handle = profiled.handle();
        let (measured, stats) =
            run_on_with::<f32, _>(profiled, &case, micro, Techniques::default(), 1, steps, |_| handle.reset()).unwrap();
        assert_eq!(stats.peak_allocated, plain.peak_allocated, "the same allocations");
        let totals = handle.totals();
        let per_step = |op: &str| totals[op].calls as usize / steps;
        let l = case.cfg.n_layer;
        // Per micro-batch: 4 matmuls a block and the classifier; 2 layernorms a block and the
        // final one; attention and GELU once a block.
        assert_eq!(per_step("matmul_forward"), 2 * (4 * l + 1));
        assert_eq!(per_step("matmul_backward"), 2 * (4 * l + 1));
        assert_eq!(per_step("layernorm_forward"), 2 * (2 * l + 1));
        assert_eq!(per_step("attention_forward"), 2 * l);
        // The head's loss and logit gradient in one op; the probabilities alone never in training.
        assert_eq!(per_step("crossentropy_forward_backward"), 2);
        assert!(!totals.contains_key("crossentropy_forward"));
        let (b, t, c) = (micro, case.seq, case.cfg.n_embd);
        let classifier = 2.0 * (b * t * c * case.cfg.padded_vocab()) as f64;
        let blocks = 2.0 * (b * t * c * 12 * c) as f64 * l as f64; // qkv 3c, proj c, fc 4c, fcproj 4c
        assert_eq!(totals["matmul_forward"].flops, (classifier + blocks) * 2.0 * steps as f64);
        let table = table(&totals, steps, measured.ms_per_step, Some(plain.ms_per_step));
        assert!(table.contains("TFLOP/s") && table.contains("GB/s") && table.contains("outside ops"), "{table}");
        let shares: f64 = table
            .lines()
            .skip(2)
            .filter_map(|line| {
                line.split_whitespace().find(|w| w.ends_with('%'))?.trim_end_matches('%').parse::<f64>().ok()
            })
            .sum();
        assert!((shares - 100.0).abs() < 1.0, "the rows add up to the step: {shares}\n{table}");
    }
}
