//! `DeviceSim`: the CPU reference posing as a device whose memory the host may not read, so the
//! device path of the model and trainer (uploads, downloads, backend-side optimizer, no host
//! access to pool buffers) runs and is tested on a machine without a GPU.
//!
//! Its pool hands out buffers marked not host-visible: any host read or write of one outside
//! this backend's ops panics ("host read of device memory"), as a CUDA pointer would fault.
//! Each op exposes its views and runs the CPU reference on them; transfers are counted.
//! A copy ahead behaves like one on a copy stream at its worst: the destination reads as NaN
//! until `wait_copy`, and a fence dropped without being waited on panics.
//! `SimCollectives` stands in for NCCL: the native primitives over the ranks' pool memory.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytemuck::Pod;

use crate::memory::Pool;

use crate::engine::backend::collectives::{DeviceCollectives, Dtype};
use crate::engine::backend::layers::Elem;
use crate::engine::backend::optim::AdamW;
use crate::engine::backend::{Backend, BackendResult, CpuBackend, View, ViewMut};
use crate::engine::parallel::comm::{Comm, Group};

/// A view marked host-visible, for the CPU reference to run on (see `View::exposed`).
pub(crate) trait Expose {
    fn exposed(self) -> Self;
}

impl<T: Pod> Expose for View<'_, T> {
    fn exposed(self) -> Self {
        View::exposed(self)
    }
}

impl<T: Pod> Expose for ViewMut<'_, T> {
    fn exposed(self) -> Self {
        ViewMut::exposed(self)
    }
}

/// A copy ahead that has not landed: where to, the bytes (taken when it was issued), and when
/// the simulated link has carried them.
pub(crate) struct PendingCopy {
    address: u64,
    bytes: Vec<u8>,
    arrives: Option<Instant>,
    /// A download's copy engine: a thread that writes the destination when the link has
    /// carried the bytes, so the host pays for neither the wait nor the copy.
    engine: Option<std::thread::JoinHandle<()>>,
    landed: bool,
}

impl PendingCopy {
    /// Wait for the link, then write the bytes where they go.
    fn land(mut self) {
        if let Some(engine) = self.engine.take() {
            engine.join().expect("the simulated copy engine does not panic");
            self.landed = true;
            return;
        }
        if let Some(at) = self.arrives {
            std::thread::sleep(at.saturating_duration_since(Instant::now()));
        }
        // SAFETY: the contracts of `upload_ahead` and `download_ahead`: the destination (pool
        // memory or the caller's host memory) is alive and not otherwise accessed until its
        // fence is waited on.
        unsafe { std::ptr::copy_nonoverlapping(self.bytes.as_ptr(), self.address as *mut u8, self.bytes.len()) };
        self.landed = true;
    }
}

impl Drop for PendingCopy {
    fn drop(&mut self) {
        if !self.landed && !std::thread::panicking() {
            panic!("a copy ahead to {:#x} was dropped without wait_copy", self.address);
        }
    }
}

pub(crate) struct DeviceSim {
    /// The pool as the engine sees it: device memory.
    pool: Pool,
    /// The reference over the same pool seen as host memory (its scratch buffers included).
    cpu: CpuBackend,
    uploaded: AtomicUsize,
    downloaded: AtomicUsize,
    /// Of `uploaded`, the bytes that went through `upload_ahead`.
    ahead: AtomicUsize,
    /// Scalars read back by `sum_squares`.
    scalar_reads: AtomicUsize,
    collectives: Option<SimCollectives>,
    /// A simulated host link: copies take `bytes / link` seconds (asleep, so the host's cores
    /// stay free for what overlaps them). None: as fast as memcpy.
    link_bytes_per_s: Option<f64>,
    /// When each direction of the link (to the device, to the host: full duplex, as PCIe) is
    /// free again: copies queue behind the ones issued before them.
    link_free: Mutex<[Option<Instant>; 2]>,
}

/// A direction of the simulated link.
#[derive(Clone, Copy)]
enum Link {
    ToDevice = 0,
    ToHost = 1,
}

impl DeviceSim {
    /// This device behind a host link of `bytes_per_s` (its synchronous copies take that long).
    pub(crate) fn with_link(mut self, bytes_per_s: f64) -> DeviceSim {
        self.link_bytes_per_s = Some(bytes_per_s);
        self
    }

    /// Queue `bytes` on one direction of the link: when they will have crossed (None: no link).
    fn reserve_link(&self, way: Link, bytes: usize) -> Option<Instant> {
        let bw = self.link_bytes_per_s?;
        let mut free = self.link_free.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        let start = free[way as usize].map_or(now, |f| f.max(now));
        let done = start + Duration::from_secs_f64(bytes as f64 / bw);
        free[way as usize] = Some(done);
        Some(done)
    }

    /// A synchronous copy: wait until `bytes` have crossed.
    fn cross_link(&self, way: Link, bytes: usize) {
        if let Some(done) = self.reserve_link(way, bytes) {
            std::thread::sleep(done.saturating_duration_since(Instant::now()));
        }
    }

    pub(crate) fn new(capacity: usize) -> DeviceSim {
        DeviceSim::with_segments(capacity, false)
    }

    /// A simulated device whose pool has expandable segments when `expandable`.
    pub(crate) fn with_segments(capacity: usize, expandable: bool) -> DeviceSim {
        let host = Pool::host("sim:0", capacity, expandable);
        DeviceSim {
            pool: host.seen_as(false),
            cpu: CpuBackend::new(host),
            uploaded: AtomicUsize::new(0),
            downloaded: AtomicUsize::new(0),
            ahead: AtomicUsize::new(0),
            scalar_reads: AtomicUsize::new(0),
            collectives: None,
            link_bytes_per_s: None,
            link_free: Mutex::new([None; 2]),
        }
    }

    /// This rank with native collectives (its handle of a `SimCollectives::group`).
    pub(crate) fn with_collectives(mut self, collectives: SimCollectives) -> DeviceSim {
        self.collectives = Some(collectives);
        self
    }

    /// Bytes uploaded through `upload_ahead` so far.
    pub(crate) fn copied_ahead(&self) -> usize {
        self.ahead.load(Ordering::Relaxed)
    }

    /// Scalars read back to the host so far (`sum_squares`: the gradient norm's).
    pub(crate) fn scalar_reads(&self) -> usize {
        self.scalar_reads.load(Ordering::Relaxed)
    }

    /// Bytes copied host→device and device→host so far.
    pub(crate) fn traffic(&self) -> (usize, usize) {
        (self.uploaded.load(Ordering::Relaxed), self.downloaded.load(Ordering::Relaxed))
    }
}

/// NCCL's primitives for `DeviceSim` ranks, run on the host over the ranks' pool memory (host
/// memory behind the device view) through a `Group`, so sums go in rank order as in the
/// staged path. Counts the primitives called, across the group.
#[derive(Clone)]
pub(crate) struct SimCollectives {
    comm: Group,
    calls: Arc<AtomicUsize>,
}

impl SimCollectives {
    pub(crate) fn group(world: usize) -> Vec<SimCollectives> {
        let calls = Arc::new(AtomicUsize::new(0));
        Group::threads(world).into_iter().map(|comm| SimCollectives { comm, calls: calls.clone() }).collect()
    }

    /// Primitives called so far by every rank of the group.
    pub(crate) fn calls(&self) -> usize {
        self.calls.load(Ordering::Relaxed)
    }

    /// Count a call, and check NCCL's contract: every rank passes the same count and root
    /// (rank 0's, compared on each rank).
    fn call(&self, count: usize, root: usize) {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let (count0, root0) = (self.comm.broadcast(count as u64), self.comm.broadcast(root as u64));
        assert_eq!(
            (count0, root0),
            (count as u64, root as u64),
            "rank {}: (count, root) unlike rank 0's",
            self.comm.rank()
        );
    }
}

/// `count` elements of `E` at `address`, as a host slice.
///
/// # Safety
/// They are this rank's pool memory (host memory behind the device view), not otherwise
/// accessed while the slice lives.
unsafe fn elements<'a, E: Elem>(address: u64, count: usize) -> &'a mut [E] {
    std::slice::from_raw_parts_mut(address as *mut E, count)
}

/// `$body` with `$e` the element type of `$dtype`.
macro_rules! with_elem {
    ($dtype:expr, $e:ident => $body:expr) => {
        match $dtype {
            Dtype::F32 => {
                type $e = f32;
                $body
            }
            Dtype::Bf16 => {
                type $e = half::bf16;
                $body
            }
            Dtype::F16 => {
                type $e = half::f16;
                $body
            }
        }
    };
}

impl DeviceCollectives for SimCollectives {
    fn split(&self, color: u64, _key: usize) -> BackendResult<Option<Arc<dyn DeviceCollectives>>> {
        let comm = self.comm.split(color, Duration::from_secs(60)).expect("a thread group splits");
        Ok(Some(Arc::new(SimCollectives { comm, calls: self.calls.clone() })))
    }

    fn all_reduce_sum(&self, buf: u64, count: usize, dtype: Dtype) -> BackendResult {
        self.call(count, 0);
        // SAFETY: the collectives' contract: `buf` is this rank's, for this call.
        with_elem!(dtype, E => self.comm.all_reduce_sum::<E>(unsafe { elements(buf, count) }));
        Ok(())
    }

    fn reduce_sum(&self, send: u64, recv: Option<u64>, count: usize, dtype: Dtype, root: usize) -> BackendResult {
        assert_eq!(recv.is_some(), self.comm.rank() == root, "only the root receives a reduce");
        self.call(count, root);
        with_elem!(dtype, E => {
            // SAFETY: as above; `send` is only read, before `recv` is written.
            let mut sum: Vec<E> = unsafe { elements::<E>(send, count) }.to_vec();
            self.comm.all_reduce_sum(&mut sum);
            if let Some(recv) = recv {
                unsafe { elements::<E>(recv, count) }.copy_from_slice(&sum);
            }
        });
        Ok(())
    }

    fn broadcast(&self, send: Option<u64>, recv: u64, count: usize, dtype: Dtype, root: usize) -> BackendResult {
        assert_eq!(send.is_some(), self.comm.rank() == root, "only the root sends a broadcast");
        self.call(count, root);
        with_elem!(dtype, E => {
            // SAFETY: as above. The root's data is copied first: its send may be its receive buffer.
            let data: Vec<E> = send.map(|s| unsafe { elements::<E>(s, count) }.to_vec()).unwrap_or_default();
            let own = if send.is_some() { 0..count } else { count..count };
            self.comm.gather_range(&data, own, 0, unsafe { elements::<E>(recv, count) });
        });
        Ok(())
    }
}

#[allow(clippy::too_many_arguments)]
impl Backend for DeviceSim {
    type Fence = PendingCopy;

    fn device(&self) -> String {
        "sim:0".into()
    }
    fn pool(&self) -> &Pool {
        &self.pool
    }
    fn synchronize(&self) -> BackendResult {
        Ok(())
    }
    fn collectives(&self) -> Option<&dyn DeviceCollectives> {
        self.collectives.as_ref().map(|c| c as &dyn DeviceCollectives)
    }
    fn upload<T: Pod>(&self, dst: ViewMut<T>, src: &[T]) -> BackendResult {
        self.uploaded.fetch_add(std::mem::size_of_val(src), Ordering::Relaxed);
        self.cross_link(Link::ToDevice, std::mem::size_of_val(src));
        self.cpu.upload(dst.exposed(), src)
    }
    fn download<T: Pod>(&self, src: View<T>, dst: &mut [T]) -> BackendResult {
        self.downloaded.fetch_add(std::mem::size_of_val(dst), Ordering::Relaxed);
        self.cross_link(Link::ToHost, std::mem::size_of_val(dst));
        self.cpu.download(src.exposed(), dst)
    }
    fn zero<T: Pod>(&self, dst: ViewMut<T>) -> BackendResult {
        self.cpu.zero(dst.exposed())
    }
    fn upload_ahead<T: Pod>(&self, dst: ViewMut<T>, src: &[T]) -> BackendResult<PendingCopy> {
        crate::engine::backend::shapes::same("upload_ahead", "destination", dst.len(), src.len())?;
        let bytes = bytemuck::cast_slice::<T, u8>(src).to_vec();
        self.uploaded.fetch_add(bytes.len(), Ordering::Relaxed);
        self.ahead.fetch_add(bytes.len(), Ordering::Relaxed);
        let mut dst = dst.exposed();
        bytemuck::cast_slice_mut::<T, u8>(dst.host_mut()).fill(0xFF);
        let arrives = self.reserve_link(Link::ToDevice, bytes.len());
        Ok(PendingCopy { address: dst.address(), bytes, arrives, engine: None, landed: false })
    }
    fn wait_copy(&self, fence: PendingCopy) -> BackendResult {
        fence.land();
        Ok(())
    }
    unsafe fn download_ahead<T: Pod>(&self, src: View<T>, dst: &mut [T]) -> BackendResult<PendingCopy> {
        crate::engine::backend::shapes::same("download_ahead", "destination", dst.len(), src.len())?;
        // The destination reads as NaN until the fence is waited on; the copy engine reads
        // the source when the link has carried it (the contract: nothing writes it before).
        let len = std::mem::size_of_val(dst);
        self.downloaded.fetch_add(len, Ordering::Relaxed);
        let out = bytemuck::cast_slice_mut::<T, u8>(dst);
        out.fill(0xFF);
        let arrives = self.reserve_link(Link::ToHost, len);
        let (from, to) = (src.exposed().address() as usize, out.as_mut_ptr() as usize);
        let engine = std::thread::spawn(move || {
            if let Some(at) = arrives {
                std::thread::sleep(at.saturating_duration_since(Instant::now()));
            }
            // SAFETY: the contract of `download_ahead`: the source (pool memory, host memory
            // behind the simulated device) is not written, and the destination neither read
            // nor written nor freed, until the fence is waited on, which joins this thread.
            unsafe { std::ptr::copy_nonoverlapping(from as *const u8, to as *mut u8, len) };
        });
        Ok(PendingCopy { address: to as u64, bytes: Vec::new(), arrives, engine: Some(engine), landed: false })
    }
    fn wait_host(&self, fence: PendingCopy) -> BackendResult {
        fence.land();
        Ok(())
    }
    fn sum_squares<E: Elem>(&self, x: View<E>) -> BackendResult<f64> {
        // A scalar read back to the host: on a GPU, a wait for the stream.
        self.scalar_reads.fetch_add(1, Ordering::Relaxed);
        self.cpu.sum_squares(Expose::exposed(x))
    }
    delegate_ops!(cpu, Expose::exposed;
        encoder_forward, encoder_backward, layernorm_forward, layernorm_recompute, layernorm_backward,
        matmul_forward, matmul_backward, attention_forward, attention_backward, gelu_forward,
        gelu_backward_inplace, residual_forward_inplace, crossentropy_forward, crossentropy_forward_backward,
        adamw, narrow, widen, pack_int8, unpack_int8, unpack_int4, attention_cached);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::check::train_parity::{sequences, TrainParityCase};
    use crate::engine::model::{GptConfig, PpStage, TpShard};
    use crate::engine::train::checkpoint;
    use crate::engine::train::trainer::{Hyper, SwapStats as SwapStatsOf, Trainer};
    use crate::memory::Category;

    fn tokens() -> Vec<u32> {
        let text = std::fs::read("data/shakespeare-tiny.txt").expect("data/shakespeare-tiny.txt");
        text[..64 << 10].iter().map(|&b| b as u32).collect()
    }

    /// A checkpoint written from the device and resumed on another device instance continues
    /// exactly where an uninterrupted host run would be, and evaluation reads the same losses.
    #[test]
    fn checkpoints_and_evaluation_on_the_device_path_match_the_host() {
        let tokens = tokens();
        for case in [TrainParityCase::small(4), TrainParityCase::small_offloaded(4)] {
            let t = case.cfg.block_size;
            let host = Pool::new("cpu", 256 << 20);
            let mut reference = Trainer::<half::bf16>::new(case.cfg, case.hyper(), host).unwrap();
            let expected: Vec<f32> =
                (0..4).map(|_| reference.train_step(&mut sequences(&tokens, t)).unwrap().loss).collect();

            let dir = tempfile::tempdir().unwrap();
            let open = || Trainer::<half::bf16, _>::on_backend(case.cfg, case.hyper(), DeviceSim::new(256 << 20), None);
            let mut first = open().unwrap();
            for _ in 0..2 {
                first.train_step(&mut sequences(&tokens, t)).unwrap();
            }
            first.save_checkpoint(dir.path(), None).unwrap();
            drop(first);
            let (path, ckpt) = checkpoint::load_latest(dir.path(), None, |e| panic!("{e}")).expect("a checkpoint");
            let mut resumed = open().unwrap();
            resumed.restore(&path, ckpt).unwrap();
            assert_eq!(resumed.step, 2);
            let tail: Vec<f32> = (0..2).map(|_| resumed.train_step(&mut sequences(&tokens, t)).unwrap().loss).collect();
            assert_eq!(tail, expected[2..], "{}: resumed losses", case.name);
            assert_eq!(resumed.master_params().unwrap(), reference.master_params().unwrap(), "{}", case.name);

            let mut eval = |i: usize, inp: &mut Vec<u32>, tgt: &mut Vec<u32>| {
                sequences(&tokens, t)(u64::MAX, i as u64, inp, tgt);
            };
            let (on_device, on_host) =
                (resumed.evaluate(6, &mut eval).unwrap(), reference.evaluate(6, &mut eval).unwrap());
            assert_eq!(on_device.to_bits(), on_host.to_bits(), "{}: validation loss", case.name);
        }
    }

    /// The delayed update (DPU) on the simulated device: step n's forward runs on the weights
    /// of n−1 updates, so its loss is bit for bit what the synchronous run's weights after
    /// n−1 steps give on step n's batch (checkable while the two runs' weights agree: n ≤ 2),
    /// and a checkpoint settles the pipeline, so a run resumed from it continues exactly as
    /// the original did.
    #[test]
    fn the_delayed_update_trains_one_step_stale_and_resumes_exactly() {
        let tokens = tokens();
        let case = TrainParityCase { offload_optimizer: true, ..TrainParityCase::small(6) };
        let t = case.cfg.block_size;
        // Delayed from the first step (past a warmup of 0 steps).
        let plain = Hyper { warmup_steps: 0, ..case.hyper() };
        let mut delayed = plain.clone();
        delayed.knobs.delayed_update = true;
        let open = |hyper| Trainer::<f32, _>::on_backend(case.cfg, hyper, DeviceSim::new(256 << 20), None).unwrap();

        let mut dpu = open(delayed.clone());
        let losses: Vec<u32> =
            (0..3).map(|_| dpu.train_step(&mut sequences(&tokens, t)).unwrap().loss.to_bits()).collect();
        for (n, &loss) in losses.iter().enumerate() {
            let mut sync = open(plain.clone());
            for _ in 0..n.saturating_sub(1) {
                sync.train_step(&mut sequences(&tokens, t)).unwrap();
            }
            // The synchronous weights after n−1 steps, on step n's batch.
            let mut base = sequences(&tokens, t);
            let shift = (n - n.saturating_sub(1)) as u64;
            let on_step_n = sync.train_step(&mut |s, i, inp, tgt| base(s + shift, i, inp, tgt)).unwrap();
            assert_eq!(loss, on_step_n.loss.to_bits(), "step {n}: the weights of {} updates", n.saturating_sub(1));
        }

        // Past the learning rate's warmup only: with 2 warmup steps, steps 0–2 run on the
        // synchronous run's weights, step 3 on one update fewer.
        let warm = |delayed_update: bool| {
            let mut hyper = case.hyper();
            assert_eq!(hyper.warmup_steps, 2);
            hyper.knobs.delayed_update = delayed_update;
            let mut trainer = open(hyper);
            (0..4).map(|_| trainer.train_step(&mut sequences(&tokens, t)).unwrap().loss.to_bits()).collect::<Vec<_>>()
        };
        let (gated, sync) = (warm(true), warm(false));
        assert_eq!(gated[..3], sync[..3], "no delay during the warmup");
        assert_ne!(gated[3], sync[3], "delayed after it");

        // Checkpoint at step 3 (settling), on to 6; a run resumed from step 3 matches it.
        let dir = tempfile::tempdir().unwrap();
        let mut original = open(delayed.clone());
        for _ in 0..3 {
            original.train_step(&mut sequences(&tokens, t)).unwrap();
        }
        original.save_checkpoint(dir.path(), None).unwrap();
        let rest: Vec<u32> =
            (3..6).map(|_| original.train_step(&mut sequences(&tokens, t)).unwrap().loss.to_bits()).collect();
        let (path, ckpt) = checkpoint::load_latest(dir.path(), None, |e| panic!("{e}")).expect("a checkpoint");
        let mut resumed = open(delayed);
        resumed.restore(&path, ckpt).unwrap();
        let again: Vec<u32> =
            (3..6).map(|_| resumed.train_step(&mut sequences(&tokens, t)).unwrap().loss.to_bits()).collect();
        assert_eq!(again, rest, "resumed from the checkpoint, the same losses");
        let (a, b) = (original.master_params().unwrap(), resumed.master_params().unwrap());
        assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "and the same weights");
    }

    #[test]
    fn a_copy_ahead_lands_only_when_waited_on() {
        let sim = DeviceSim::new(16 << 20);
        let mut a = sim.pool().alloc(16, Category::Activations).unwrap();
        let fence = sim.upload_ahead(ViewMut::of(&mut a), &[1.0f32, 2.0, 3.0, 4.0]).unwrap();
        let mut out = [0f32; 4];
        sim.download(View::of(&a), &mut out).unwrap();
        assert!(out.iter().all(|x| x.is_nan()), "not there before wait_copy: {out:?}");
        sim.wait_copy(fence).unwrap();
        sim.download(View::of(&a), &mut out).unwrap();
        assert_eq!(out, [1.0, 2.0, 3.0, 4.0]);
        assert_eq!(sim.copied_ahead(), 16);

        // A download ahead over a 160 B/s link: 16 bytes land 100 ms after it was issued, and
        // the host waits for them in `wait_host`, not before.
        let slow = DeviceSim::new(16 << 20).with_link(160.0);
        let mut b = slow.pool().alloc(16, Category::Activations).unwrap();
        slow.upload(ViewMut::of(&mut b), &[1.0f32, 2.0, 3.0, 4.0]).unwrap();
        let mut host = [0f32; 4];
        let issued = std::time::Instant::now();
        // SAFETY: `host` is not touched, nor `b` written, until the fence is waited on.
        let fence = unsafe { slow.download_ahead(View::of(&b), &mut host) }.unwrap();
        assert!(issued.elapsed().as_secs_f64() < 0.05, "issuing does not wait for the link");
        slow.wait_host(fence).unwrap();
        assert!(issued.elapsed().as_secs_f64() >= 0.1, "landed after the link carried it");
        assert_eq!(host, [1.0, 2.0, 3.0, 4.0]);

        let forgotten = sim.upload_ahead(ViewMut::of(&mut a), &[0f32; 4]).unwrap();
        let dropped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(forgotten)));
        assert!(dropped.is_err(), "a fence dropped without wait_copy is a bug the sim reports");
    }

    /// `StreamedGrads` on the device: every gradient reaches the host exactly once in each
    /// order a pass may close its segments — the held (tied) range sent with the segment that
    /// closes over it, or at `finish` when none does — and a range opened again after its
    /// copy left is sent again with its new sum (and counted twice).
    #[test]
    fn streamed_gradients_reach_the_host_once_whatever_the_order() {
        use crate::engine::parallel::placement::{GradSink, StreamedGrads};
        let sim = DeviceSim::new(16 << 20);
        let mut g = sim.pool().alloc(8 * 4, Category::Grads).unwrap();
        let add = |sink: &mut StreamedGrads<f32, DeviceSim>, r: std::ops::Range<usize>, v: f32| {
            let len = r.len();
            let view = sink.open(r.clone()).unwrap();
            sim.upload(view, &vec![v; len]).unwrap();
            sink.close(r).unwrap();
        };
        // (closes in order with the value each writes, expected host values, bytes sent)
        type Close = (std::ops::Range<usize>, f32);
        let cases: [(&str, Vec<Close>, [f32; 8], usize); 3] = [
            (
                "held, then closed over",
                vec![(0..2, 1.0), (2..8, 2.0), (0..4, 3.0)],
                [3.0, 3.0, 3.0, 3.0, 2.0, 2.0, 2.0, 2.0],
                8 * 4 + 2 * 4,
            ),
            (
                "held, never closed again",
                vec![(0..2, 1.0), (2..8, 2.0)],
                [1.0, 1.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0],
                8 * 4,
            ),
            (
                "sent, opened again",
                vec![(0..2, 1.0), (4..8, 2.0), (2..4, 5.0), (4..6, 7.0)],
                [1.0, 1.0, 5.0, 5.0, 7.0, 7.0, 2.0, 2.0],
                10 * 4,
            ),
        ];
        for (name, closes, expect, bytes) in cases {
            let mut host = [0f32; 8];
            let mut sink = StreamedGrads::new(ViewMut::of(&mut g), &mut host, &sim).holding(0..2);
            for (r, v) in closes {
                add(&mut sink, r, v);
            }
            let swap = sink.finish().unwrap();
            assert_eq!(host, expect, "{name}");
            assert_eq!(swap.bytes_to_host, bytes, "{name}");
        }
    }

    #[test]
    fn its_buffers_refuse_host_access_but_its_ops_and_copies_work() {
        let sim = DeviceSim::new(16 << 20);
        let mut a = sim.pool().alloc(16, Category::Params).unwrap();
        assert!(!a.host_visible());
        let read = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| a.as_slice::<f32>()[0]));
        assert!(read.is_err(), "the engine may not read the simulated device directly");
        sim.upload(ViewMut::of(&mut a), &[1.0f32, -2.0, 3.0, 0.5]).unwrap();
        let mut b = sim.pool().alloc(16, Category::Activations).unwrap();
        sim.gelu_forward::<f32>(ViewMut::of(&mut b), View::of(&a)).unwrap();
        let mut out = [0f32; 4];
        sim.download(View::of(&b), &mut out).unwrap();
        let mut expect = [0f32; 4];
        crate::engine::backend::layers::gelu_forward::<f32>(&mut expect, &[1.0, -2.0, 3.0, 0.5]);
        assert_eq!(out, expect);
        assert_eq!(sim.traffic(), (16, 16));
        assert_eq!(sim.pool().stats().current(Category::Activations), 512, "one pool, one account");
    }

    /// The offloaded optimizer step overlapped — gradients streamed to the host during the
    /// backward pass, the update pipelined with the weights going back — against its
    /// synchronous form, on a device behind a simulated 20 GB/s link (12.6M parameters: 25 MB
    /// of bf16 each way): the same losses and weights bit for bit (a gradient read before it
    /// landed would be NaN here), and the copy time the step waits for drops (measured, best
    /// of two steps each).
    #[test]
    fn the_offloaded_optimizer_overlaps_its_copies_with_the_host_update_and_computes_the_same() {
        let tokens = tokens();
        let case = TrainParityCase {
            cfg: GptConfig {
                n_layer: 4,
                n_head: 4,
                n_embd: 512,
                block_size: 64,
                vocab: 256,
                tp: TpShard::NONE,
                pp: PpStage::NONE,
            },
            micro_batch: 1,
            grad_accum: 1,
            offload_optimizer: true,
            ..TrainParityCase::small(3)
        };
        let n = case.cfg.num_params();
        let run = |chunk: usize, stream: bool| {
            let sim = DeviceSim::new(256 << 20).with_link(20e9);
            let mut t = Trainer::<half::bf16, _>::on_backend(case.cfg, case.hyper(), sim, None).unwrap();
            t.set_offload_chunk(chunk);
            t.set_stream_grads(stream);
            let steps: Vec<_> = (0..3).map(|_| t.train_step(&mut sequences(&tokens, 64)).unwrap()).collect();
            let losses: Vec<u32> = steps.iter().map(|s| s.loss.to_bits()).collect();
            let swap: Vec<SwapStatsOf> = steps[1..].iter().map(|s| s.swap.expect("offloading reports swap")).collect();
            let exposed = swap.iter().map(|s| s.transfer_ms).fold(f64::INFINITY, f64::min);
            let hidden = swap.iter().map(|s| s.hidden_ms).fold(0.0, f64::max);
            let bytes = swap[0].bytes_to_host;
            (losses, t.master_params().unwrap(), exposed, hidden, bytes)
        };
        let (sync_losses, sync_master, sync_exposed, sync_hidden, sync_bytes) = run(usize::MAX, false);
        let (losses, master, exposed, hidden, bytes) = run(n.div_ceil(8), true);
        assert_eq!(losses, sync_losses, "losses bitwise");
        assert!(master.iter().zip(&sync_master).all(|(a, b)| a.to_bits() == b.to_bits()), "master weights bitwise");
        assert_eq!(bytes, sync_bytes, "every gradient crosses once either way");
        println!("exposed copy ms: synchronous {sync_exposed:.2}, overlapped {exposed:.2} (hidden {hidden:.2})");
        assert_eq!(sync_hidden, 0.0, "nothing overlaps the synchronous step's copies");
        assert!(hidden > 0.0 && exposed < 0.6 * sync_exposed, "sync {sync_exposed:.2} ms, overlapped {exposed:.2} ms");
    }
}
