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

use crate::memory::{Buffer, Category, OomError, Pool};

use super::backend::{Backend, BackendResult, View, ViewMut};
use super::comm::{Comm, LocalComm};
use super::layers::Elem;
use super::model::SwapStats;

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

/// ZeRO-3: this rank keeps only `shard` (the parameters `own`); every fetch all-gathers the
/// segment from its owners. A collective: every rank fetches the same ranges in the same order.
/// Ranks exchange host memory (`LocalComm`), so this runs on the `cpu` device.
pub struct Gathered<'a, E> {
    pub shard: &'a [E],
    pub own: Range<usize>,
    pub comm: &'a LocalComm,
    pub pool: &'a Pool,
}

impl<E: Elem> ParamSource<E> for Gathered<'_, E> {
    fn fetch(&self, range: Range<usize>, _next: Option<Range<usize>>) -> BackendResult<Weights<'_, E>> {
        let mut buf = self.pool.alloc(range.len() * E::BYTES, Category::Workspace)?;
        self.comm.gather_range(self.shard, self.own.clone(), range.start, buf.as_mut_slice::<E>());
        Ok(Weights::Staged(buf))
    }
}

/// A segment being copied host→device by the copy worker: its range and the worker, which
/// hands back the filled buffer and the milliseconds the copy took.
type InFlight = (Range<usize>, JoinHandle<(Buffer, f64)>);

/// `offload.params: cpu`: the weights live in host memory. Each fetch copies its segment to a
/// device buffer. On a host-visible pool it also starts copying the `next` segment on a copy
/// worker, so the transfer overlaps the compute of this one; on a device pool the copy goes
/// through the backend when the segment is asked for.
pub struct HostStaged<'b, E, B> {
    host: Arc<Vec<E>>,
    backend: &'b B,
    ahead: Mutex<Option<InFlight>>,
    swap: Mutex<SwapStats>,
}

impl<'b, E: Elem, B: Backend> HostStaged<'b, E, B> {
    pub fn new(host: Arc<Vec<E>>, backend: &'b B) -> HostStaged<'b, E, B> {
        HostStaged { host, backend, ahead: Mutex::new(None), swap: Mutex::new(SwapStats::default()) }
    }

    fn alloc(&self, elems: usize) -> Result<Buffer, OomError> {
        self.backend.pool().alloc(elems * E::BYTES, Category::Workspace)
    }
}

impl<E: Elem, B: Backend> ParamSource<E> for HostStaged<'_, E, B> {
    fn fetch(&self, range: Range<usize>, next: Option<Range<usize>>) -> BackendResult<Weights<'_, E>> {
        let mut ahead = self.ahead.lock().unwrap_or_else(|e| e.into_inner());
        let mut swap = self.swap.lock().unwrap_or_else(|e| e.into_inner());
        let buf = match ahead.take() {
            Some((r, worker)) if r == range => {
                let (buf, ms) = worker.join().expect("copy worker");
                swap.transfer_ms += ms;
                buf
            }
            stale => {
                // A prefetch for a range the pass did not ask for is dropped (never happens
                // with the model's own order, but a wrong hint must not be wrong weights).
                if let Some((_, worker)) = stale {
                    drop(worker.join());
                }
                let t0 = std::time::Instant::now();
                let mut buf = self.alloc(range.len())?;
                self.backend.upload(ViewMut::of(&mut buf), &self.host[range.clone()])?;
                swap.transfer_ms += t0.elapsed().as_secs_f64() * 1e3;
                buf
            }
        };
        swap.bytes_to_device += range.len() * E::BYTES;
        if let Some(next) = next.filter(|_| self.backend.pool().host_visible()) {
            let mut nbuf = self.alloc(next.len())?;
            let host = Arc::clone(&self.host);
            let r = next.clone();
            *ahead = Some((
                next,
                std::thread::spawn(move || {
                    let t0 = std::time::Instant::now();
                    nbuf.as_mut_slice::<E>().copy_from_slice(&host[r]);
                    (nbuf, t0.elapsed().as_secs_f64() * 1e3)
                }),
            ));
        }
        Ok(Weights::Staged(buf))
    }

    fn swap(&self) -> SwapStats {
        *self.swap.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl<E, B> Drop for HostStaged<'_, E, B> {
    fn drop(&mut self) {
        // The copy worker holds a handle on the host weights: it must be done before the
        // optimizer may update them.
        if let Some((_, worker)) = self.ahead.get_mut().unwrap_or_else(|e| e.into_inner()).take() {
            drop(worker.join());
        }
    }
}

/// What the backward pass writes parameter gradients through, one segment at a time.
pub trait GradSink<E: Elem> {
    /// A view the gradient of `range` is accumulated into (`+=`).
    fn open(&mut self, range: Range<usize>) -> BackendResult<ViewMut<'_, E>>;
    /// The pass is done with `range` for now (it may open it again later: the tied embedding
    /// gets gradient from the classifier first and from the encoder last).
    fn close(&mut self, range: Range<usize>);
}

/// Every gradient accumulated in place in one full buffer (ZeRO stages 0–1).
pub struct FullGrads<'a, E>(pub ViewMut<'a, E>);

impl<E: Elem> GradSink<E> for FullGrads<'_, E> {
    fn open(&mut self, range: Range<usize>) -> BackendResult<ViewMut<'_, E>> {
        Ok(self.0.reborrow().slice(range))
    }

    fn close(&mut self, _range: Range<usize>) {}
}

/// ZeRO-2/3: this rank keeps only the gradients of its shard. Each segment is computed into a
/// zeroed reduce bucket, reduce-scattered to the owners when closed, and freed. A collective:
/// every rank opens and closes the same ranges in the same order (host memory, `cpu` device).
pub struct ShardedGrads<'a, E> {
    pub shard: &'a mut [E],
    pub own: Range<usize>,
    pub comm: &'a LocalComm,
    pub pool: &'a Pool,
    bucket: Option<Buffer>,
}

impl<'a, E: Elem> ShardedGrads<'a, E> {
    pub fn new(shard: &'a mut [E], own: Range<usize>, comm: &'a LocalComm, pool: &'a Pool) -> Self {
        ShardedGrads { shard, own, comm, pool, bucket: None }
    }
}

impl<E: Elem> GradSink<E> for ShardedGrads<'_, E> {
    fn open(&mut self, range: Range<usize>) -> BackendResult<ViewMut<'_, E>> {
        let mut bucket = self.pool.alloc(range.len() * E::BYTES, Category::Workspace)?;
        bucket.as_mut_slice::<E>().fill(E::default());
        Ok(ViewMut::of(self.bucket.insert(bucket)))
    }

    fn close(&mut self, range: Range<usize>) {
        let bucket = self.bucket.take().expect("close follows open");
        debug_assert_eq!(bucket.as_slice::<E>().len(), range.len());
        self.comm.reduce_scatter_add(bucket.as_slice::<E>(), range.start, self.shard, self.own.clone());
    }
}
