//! Where the weights and gradients live during a pass: resident on the device, sharded across
//! ranks (ZeRO-3 weights, ZeRO-2/3 gradients) or held in host memory (`offload.params`).
//!
//! The model asks for one *segment* of the parameter space at a time — the embeddings, one
//! block, the final LayerNorm, the tied classifier (see `GptConfig::*_range`) — so only that
//! segment has to be on the device while it is used. Weights brought to the device for a
//! segment and gradient reduce buckets are transient: they are `Workspace` bytes, freed when
//! the segment is done. `Params` and `Grads` count only what a rank keeps between passes.

use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crate::memory::{Buffer, Category, OomError};

use crate::engine::backend::layers::Elem;
use crate::engine::backend::{Backend, BackendError, BackendResult, View, ViewMut};
use crate::engine::parallel::comm::Group;
use crate::engine::parallel::SwapStats;

/// One segment's weights on the device: borrowed from resident weights, or staged into a
/// transient workspace buffer (gathered from the ranks or copied from the host).
pub enum Weights<'a, E> {
    Borrowed(View<'a, E>),
    Staged(Buffer),
}

impl<E: Elem> Weights<'_, E> {
    pub fn view(&self) -> View<'_, E> {
        match self {
            Weights::Borrowed(v) => *v,
            Weights::Staged(b) => View::of(b),
        }
    }
}

/// What the forward and backward passes read weights through.
pub trait ParamSource<E: Elem> {
    /// The weights of parameter range `range` on the device. `next` is the range the pass will
    /// ask for next, so a source that copies can start on it ahead of time.
    fn fetch(&self, range: Range<usize>, next: Option<Range<usize>>) -> BackendResult<Weights<'_, E>>;

    /// Host→device traffic of the fetches so far.
    fn swap(&self) -> SwapStats {
        SwapStats::default()
    }
}

/// Every weight resident on the device (ZeRO stages 0–2): fetching borrows.
pub struct Resident<'a, E>(pub View<'a, E>);

impl<E: Elem> ParamSource<E> for Resident<'_, E> {
    fn fetch(&self, range: Range<usize>, _next: Option<Range<usize>>) -> BackendResult<Weights<'_, E>> {
        Ok(Weights::Borrowed(self.0.slice(range)))
    }
}

/// ZeRO-3: this rank keeps only `shard` (the parameters `own`, on the device or in host memory);
/// every fetch all-gathers the segment from its owners. A collective: every rank fetches the
/// same ranges in the same order.
pub struct Gathered<'a, E, B: Backend> {
    shard: View<'a, E>,
    own: Range<usize>,
    comm: &'a Group,
    backend: &'a B,
    /// The shard is kept in host memory (`offload.params`).
    shard_on_host: bool,
    swap: Mutex<SwapStats>,
}

impl<'a, E: Elem, B: Backend> Gathered<'a, E, B> {
    pub fn new(shard: View<'a, E>, own: Range<usize>, comm: &'a Group, backend: &'a B, shard_on_host: bool) -> Self {
        Gathered { shard, own, comm, backend, shard_on_host, swap: Mutex::new(SwapStats::default()) }
    }
}

impl<E: Elem, B: Backend> ParamSource<E> for Gathered<'_, E, B> {
    fn fetch(&self, range: Range<usize>, _next: Option<Range<usize>>) -> BackendResult<Weights<'_, E>> {
        let mut buf = self.backend.pool().alloc(range.len() * E::BYTES, Category::Workspace)?;
        let host_pool = buf.host_visible();
        // On a device the staged gather counts what crossed the bus (the segment going up).
        let mut moved = self.comm.gather_range_on(
            self.backend,
            self.shard,
            self.own.clone(),
            range.start,
            ViewMut::of(&mut buf),
        )?;
        if self.shard_on_host && host_pool {
            // The `cpu` device with the shard in host memory: this rank's part of the segment
            // is what crosses host→device. Bytes only: the gather's time is mostly waiting for
            // the other ranks.
            let mine = range.end.min(self.own.end).saturating_sub(range.start.max(self.own.start));
            moved.bytes_to_device += mine * E::BYTES;
        }
        self.swap.lock().unwrap_or_else(|e| e.into_inner()).add(moved);
        Ok(Weights::Staged(buf))
    }

    fn swap(&self) -> SwapStats {
        *self.swap.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The next segment on its way to the device: its range, its buffer and how it is copied.
enum Ahead<F> {
    /// Host-visible pool: a copy worker thread fills the buffer and hands it back with the
    /// milliseconds the copy took.
    Worker(Range<usize>, JoinHandle<(Buffer, f64)>),
    /// Device pool: the backend's copy stream is filling the buffer; `fence` says when.
    Copy(Range<usize>, Buffer, F),
}

/// `offload.params: cpu`: the weights live in host memory. Each fetch copies its segment to a
/// device buffer and starts copying the `next` one, so the transfer overlaps the compute of
/// this one: on a copy worker thread for a host-visible pool, on the backend's copy stream
/// (`upload_ahead`) for a device pool.
pub struct HostStaged<'b, E, B: Backend> {
    host: Arc<Vec<E>>,
    backend: &'b B,
    ahead: Mutex<Option<Ahead<B::Fence>>>,
    swap: Mutex<SwapStats>,
}

impl<'b, E: Elem, B: Backend> HostStaged<'b, E, B> {
    pub fn new(host: Arc<Vec<E>>, backend: &'b B) -> HostStaged<'b, E, B> {
        HostStaged { host, backend, ahead: Mutex::new(None), swap: Mutex::new(SwapStats::default()) }
    }

    fn alloc(&self, elems: usize) -> Result<Buffer, OomError> {
        self.backend.pool().alloc(elems * E::BYTES, Category::Workspace)
    }

    /// Start copying `range` to a fresh device buffer.
    fn start(&self, range: Range<usize>) -> BackendResult<Ahead<B::Fence>> {
        let mut buf = self.alloc(range.len())?;
        if !self.backend.pool().host_visible() {
            let fence = self.backend.upload_ahead(ViewMut::of(&mut buf), &self.host[range.clone()])?;
            return Ok(Ahead::Copy(range, buf, fence));
        }
        let host = Arc::clone(&self.host);
        let r = range.clone();
        Ok(Ahead::Worker(
            range,
            std::thread::spawn(move || {
                let t0 = std::time::Instant::now();
                buf.as_mut_slice::<E>().copy_from_slice(&host[r]);
                (buf, t0.elapsed().as_secs_f64() * 1e3)
            }),
        ))
    }
}

impl<E, B: Backend> HostStaged<'_, E, B> {
    /// Wait for a copy started by `start`: its range and the filled buffer.
    fn finish(&self, ahead: Ahead<B::Fence>, swap: &mut SwapStats) -> BackendResult<(Range<usize>, Buffer)> {
        match ahead {
            Ahead::Worker(range, worker) => {
                let (buf, ms) = worker.join().map_err(|_| BackendError::Device {
                    op: "offload.params copy",
                    device: self.backend.device(),
                    detail: "the copy worker panicked".into(),
                })?;
                swap.transfer_ms += ms;
                Ok((range, buf))
            }
            Ahead::Copy(range, buf, fence) => {
                self.backend.wait_copy(fence)?;
                Ok((range, buf))
            }
        }
    }
}

impl<E: Elem, B: Backend> ParamSource<E> for HostStaged<'_, E, B> {
    fn fetch(&self, range: Range<usize>, next: Option<Range<usize>>) -> BackendResult<Weights<'_, E>> {
        let mut ahead = self.ahead.lock().unwrap_or_else(|e| e.into_inner());
        let mut swap = self.swap.lock().unwrap_or_else(|e| e.into_inner());
        let t0 = std::time::Instant::now();
        let prefetched = match ahead.take() {
            Some(a) => Some(self.finish(a, &mut swap)?),
            None => None,
        };
        let buf = match prefetched {
            Some((r, buf)) if r == range => buf,
            // A prefetch for a range the pass did not ask for is dropped (never happens with
            // the model's own order, but a wrong hint must not be wrong weights).
            _ => {
                let t1 = std::time::Instant::now();
                let mut buf = self.alloc(range.len())?;
                self.backend.upload(ViewMut::of(&mut buf), &self.host[range.clone()])?;
                if self.backend.pool().host_visible() {
                    swap.transfer_ms += t1.elapsed().as_secs_f64() * 1e3;
                }
                buf
            }
        };
        swap.bytes_to_device += range.len() * E::BYTES;
        if let Some(next) = next {
            *ahead = Some(self.start(next)?);
        }
        if !self.backend.pool().host_visible() {
            // Copies on a stream are not timed on the host: count the host time they cost
            // (waiting on a stale one, a synchronous copy, staging and issuing the next).
            swap.transfer_ms += t0.elapsed().as_secs_f64() * 1e3;
        }
        Ok(Weights::Staged(buf))
    }

    fn swap(&self) -> SwapStats {
        *self.swap.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl<E, B: Backend> Drop for HostStaged<'_, E, B> {
    fn drop(&mut self) {
        // A copy in flight must land before its buffer is freed, and the copy worker holds a
        // handle on the host weights: both must be done before the optimizer updates them.
        if let Some(ahead) = self.ahead.get_mut().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = self.finish(ahead, &mut SwapStats::default());
        }
    }
}

/// What the backward pass writes parameter gradients through, one segment at a time.
pub trait GradSink<E: Elem> {
    /// A view the gradient of `range` is accumulated into (`+=`).
    fn open(&mut self, range: Range<usize>) -> BackendResult<ViewMut<'_, E>>;
    /// The pass is done with `range` for now (it may open it again later: the tied embedding
    /// gets gradient from the classifier first and from the encoder last).
    fn close(&mut self, range: Range<usize>) -> BackendResult;

    /// Device↔host traffic of the closes so far (gradients staged for a collective).
    fn swap(&self) -> SwapStats {
        SwapStats::default()
    }
}

/// Every gradient accumulated in place in one full buffer (ZeRO stages 0–1).
pub struct FullGrads<'a, E>(pub ViewMut<'a, E>);

impl<E: Elem> GradSink<E> for FullGrads<'_, E> {
    fn open(&mut self, range: Range<usize>) -> BackendResult<ViewMut<'_, E>> {
        Ok(self.0.reborrow().slice(range))
    }

    fn close(&mut self, _range: Range<usize>) -> BackendResult {
        Ok(())
    }
}

/// Every gradient accumulated in place, as `FullGrads`, and each segment sent on its way to
/// `host` as soon as the pass closes it (`download_ahead`: on the copy stream, under the rest
/// of the backward pass) — the last micro-batch of a step whose optimizer runs on the host.
/// A segment the pass will open again (the tied embedding: classifier first, encoder last) is
/// `held`: not sent at its first close, only with the segment that closes over it later. Any
/// other segment opened again waits for its copy and goes again at its next close (the bytes
/// count twice: they crossed twice). `finish` sends what is still held and waits for what is
/// on the way.
pub struct StreamedGrads<'a, E, B: Backend> {
    grads: ViewMut<'a, E>,
    /// Where the gradients land, indexed like `grads`; untouched until `finish`.
    host: &'a mut [E],
    backend: &'a B,
    in_flight: Vec<(Range<usize>, B::Fence)>,
    /// Closed but not sent: it opens again.
    held: Option<Range<usize>>,
    /// The range to hold at its first close, until that close.
    hold: Option<Range<usize>>,
    bytes: usize,
}

impl<'a, E: Elem, B: Backend> StreamedGrads<'a, E, B> {
    pub fn new(grads: ViewMut<'a, E>, host: &'a mut [E], backend: &'a B) -> Self {
        assert_eq!(grads.len(), host.len(), "one host element per gradient");
        StreamedGrads { grads, host, backend, in_flight: Vec::new(), held: None, hold: None, bytes: 0 }
    }

    /// Do not send `range` at its first close: the pass opens it again (the tied embedding).
    pub fn holding(mut self, range: Range<usize>) -> Self {
        self.hold = Some(range);
        self
    }

    fn send(&mut self, range: Range<usize>) -> BackendResult {
        let grads = self.grads.reborrow().slice(range.clone());
        let src = grads.as_view();
        // SAFETY: `host` is borrowed for this sink's lifetime and this range of it is not
        // touched again until `finish` (or `open` of an overlapping range) waits on the fence.
        let fence = unsafe { self.backend.download_ahead(src, &mut self.host[range.clone()]) }?;
        self.bytes += range.len() * E::BYTES;
        self.in_flight.push((range, fence));
        Ok(())
    }

    /// Wait until every gradient is on the host. The swap: bytes sent, and the time the step
    /// waited here (exposed; the copies' time under the backward pass is not measured).
    pub fn finish(mut self) -> BackendResult<SwapStats> {
        let waited = std::time::Instant::now();
        if let Some(held) = self.held.take() {
            self.send(held)?;
        }
        self.backend.wait_host_all(self.in_flight.drain(..).map(|(_, f)| f))?;
        Ok(SwapStats {
            bytes_to_host: self.bytes,
            transfer_ms: waited.elapsed().as_secs_f64() * 1e3,
            ..SwapStats::default()
        })
    }
}

impl<E: Elem, B: Backend> GradSink<E> for StreamedGrads<'_, E, B> {
    fn open(&mut self, range: Range<usize>) -> BackendResult<ViewMut<'_, E>> {
        // A copy still reading this range must be done before the pass adds to it again.
        let (again, rest): (Vec<_>, Vec<_>) = std::mem::take(&mut self.in_flight)
            .into_iter()
            .partition(|(r, _)| r.start < range.end && range.start < r.end);
        self.in_flight = rest;
        for (_, fence) in again {
            self.backend.wait_copy(fence)?;
        }
        Ok(self.grads.reborrow().slice(range))
    }

    fn close(&mut self, range: Range<usize>) -> BackendResult {
        if self.hold.as_ref() == Some(&range) {
            self.hold = None;
            self.held = Some(range);
            return Ok(());
        }
        // A close over the held range sends it too; one beside it leaves it held.
        if self.held.as_ref().is_some_and(|h| range.start <= h.start && h.end <= range.end) {
            self.held = None;
        }
        self.send(range)
    }
}

impl<E, B: Backend> Drop for StreamedGrads<'_, E, B> {
    fn drop(&mut self) {
        // An error left copies on the way: they must land before `host` may be reused.
        let _ = self.backend.wait_host_all(self.in_flight.drain(..).map(|(_, f)| f));
    }
}

/// ZeRO-2/3: this rank keeps only the gradients of its shard. Each segment is computed into a
/// zeroed reduce bucket, reduce-scattered to the owners when closed, and freed. A collective:
/// every rank opens and closes the same ranges in the same order.
pub struct ShardedGrads<'a, E, B: Backend> {
    shard: ViewMut<'a, E>,
    own: Range<usize>,
    comm: &'a Group,
    backend: &'a B,
    bucket: Option<Buffer>,
    swap: SwapStats,
}

impl<'a, E: Elem, B: Backend> ShardedGrads<'a, E, B> {
    pub fn new(shard: ViewMut<'a, E>, own: Range<usize>, comm: &'a Group, backend: &'a B) -> Self {
        ShardedGrads { shard, own, comm, backend, bucket: None, swap: SwapStats::default() }
    }
}

impl<E: Elem, B: Backend> GradSink<E> for ShardedGrads<'_, E, B> {
    fn open(&mut self, range: Range<usize>) -> BackendResult<ViewMut<'_, E>> {
        let mut bucket = self.backend.pool().alloc(range.len() * E::BYTES, Category::Workspace)?;
        self.backend.zero::<E>(ViewMut::of(&mut bucket))?;
        Ok(ViewMut::of(self.bucket.insert(bucket)))
    }

    fn close(&mut self, range: Range<usize>) -> BackendResult {
        let bucket = self.bucket.take().expect("close follows open");
        debug_assert_eq!(bucket.len(), range.len() * E::BYTES);
        let moved = self.comm.reduce_scatter_add_on(
            self.backend,
            View::of(&bucket),
            range.start,
            self.shard.reborrow(),
            self.own.clone(),
        )?;
        self.swap.add(moved);
        Ok(())
    }

    fn swap(&self) -> SwapStats {
        self.swap
    }
}
