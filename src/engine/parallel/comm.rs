//! Collectives between data-parallel ranks behind the `Comm` trait. `Group` is the
//! in-process shared-memory implementation (one thread per rank); its `*_on` forms take pool
//! views of any backend and stage device memory through the host. Reductions sum in rank
//! order, so results are bitwise repeatable run to run and the same on every backend. A rank
//! that fails outside the collectives abandons its thread group (`Group::abandon`): the
//! others leave the collective they wait to enter instead of waiting for it forever.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::engine::backend::collectives::{DeviceCollectives, Dtype};
use crate::engine::backend::layers::Elem;
use crate::engine::backend::{Backend, BackendResult, View, ViewMut};
use crate::engine::parallel::tcp::{RankFailure, RendezvousError, TcpLink};
use crate::engine::parallel::SwapStats;

/// What the training loop needs from a rank group.
pub trait Comm: Send + Sync {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;
    /// Every rank's `buf` becomes the elementwise sum over ranks (f32 arithmetic).
    fn all_reduce_sum<E: Elem>(&self, buf: &mut [E])
    where
        Self: Sized;
    /// Every rank's `buf[range]` is copied from the rank that owns `range` (its shard).
    fn all_gather<E: Elem>(&self, buf: &mut [E], own: std::ops::Range<usize>)
    where
        Self: Sized;
    /// ZeRO-2/3 gradient reduction of one bucket: `bucket` holds this rank's gradients of the
    /// parameter range `offset..offset + bucket.len()`; the sum over ranks of the part that falls
    /// in this rank's shard `own` is added into `shard` (indexed from `own.start`).
    fn reduce_scatter_add<E: Elem>(&self, bucket: &[E], offset: usize, shard: &mut [E], own: std::ops::Range<usize>)
    where
        Self: Sized;
    /// ZeRO-3 parameter gather: every rank's `out` receives the parameter range
    /// `offset..offset + out.len()`, each element copied from the rank whose shard (`own`,
    /// stored in `shard` from `own.start`) holds it.
    fn gather_range<E: Elem>(&self, shard: &[E], own: std::ops::Range<usize>, offset: usize, out: &mut [E])
    where
        Self: Sized;
    /// The sum over ranks of `value`, added in rank order (the same bits on every rank).
    fn all_reduce_f64(&self, value: f64) -> f64;
    /// Rank 0's `value`, on every rank.
    fn broadcast(&self, value: u64) -> u64;
    /// True on every rank iff `ok` on every rank.
    fn agree(&self, ok: bool) -> bool;
}

/// What one rank shows the others during a collective: a buffer (address, length), the range
/// of parameters it owns, a scalar.
#[derive(Debug, Clone, Copy, Default)]
struct Published {
    a: (usize, usize),
    own: (usize, usize),
    word: u64,
}

/// A thread group's ranks unwind out of a collective they are waiting in with this payload
/// once the group is abandoned ([`Group::abandon`]: a rank failed outside the collectives and
/// will never arrive); the rank's root (`train::job::thread_ranks`) catches it and turns it
/// back into a value, as salsa's `Cancelled` is. `resume_unwind`: it never reaches the panic
/// hook.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Abandoned;

/// How often a rank waiting to enter a collective looks whether its group was abandoned.
const ABANDON_POLL: Duration = Duration::from_millis(20);

/// The barrier of a thread group. A wait at a collective's entry — where no rank has yet
/// shared a buffer of this collective — gives up once the group is abandoned; a wait that
/// closes a collective does not (every rank that entered it reaches its end: the collectives
/// themselves do not fail midway, see the staged `*_on` forms), so no rank leaves while
/// another may still touch its buffers.
struct RankBarrier {
    world: usize,
    /// (ranks arrived, generation).
    state: Mutex<(usize, u64)>,
    cv: Condvar,
}

impl RankBarrier {
    fn new(world: usize) -> RankBarrier {
        RankBarrier { world, state: Mutex::new((0, 0)), cv: Condvar::new() }
    }

    fn wait(&self, abandoned: Option<&AtomicBool>) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let generation = state.1;
        state.0 += 1;
        if state.0 == self.world {
            *state = (0, generation + 1);
            self.cv.notify_all();
            return;
        }
        while state.1 == generation {
            // Never a second unwind while one is under way (a wait from a destructor).
            if abandoned.is_some_and(|a| a.load(Ordering::SeqCst)) && !std::thread::panicking() {
                state.0 -= 1;
                drop(state);
                std::panic::resume_unwind(Box::new(Abandoned));
            }
            state = match abandoned {
                Some(_) => self.cv.wait_timeout(state, ABANDON_POLL).unwrap_or_else(|e| e.into_inner()).0,
                None => self.cv.wait(state).unwrap_or_else(|e| e.into_inner()),
            };
        }
    }
}

struct Shared {
    world: usize,
    barrier: RankBarrier,
    /// Set once by [`Group::abandon`]; shared with every sub-group split from the group.
    abandoned: Arc<AtomicBool>,
    /// Each rank's published buffers for the collective in progress.
    slots: Mutex<Vec<Published>>,
    word: AtomicU64,
    failures: AtomicU64,
    /// The sub-groups of a `split` in progress, in order of their first rank.
    splits: Mutex<Vec<Arc<Shared>>>,
}

impl Shared {
    fn new(world: usize, abandoned: Arc<AtomicBool>) -> Shared {
        Shared {
            world,
            barrier: RankBarrier::new(world),
            abandoned,
            slots: Mutex::new(vec![Published::default(); world]),
            word: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            splits: Mutex::new(Vec::new()),
        }
    }

    /// Wait for every rank at a collective's entry (no buffer of it shared yet); unwinds with
    /// [`Abandoned`] once the group is abandoned.
    fn enter(&self) {
        self.barrier.wait(Some(&self.abandoned));
    }

    /// Wait for every rank at a point inside or at the end of a collective.
    fn close(&self) {
        self.barrier.wait(None);
    }
}

/// One rank's handle on its group.
#[derive(Clone)]
pub struct Group {
    rank: usize,
    link: Link,
    /// Which native collectives (NCCL) serve this group's `*_on` forms on a device.
    native: Native,
}

/// The native collectives of a group.
#[derive(Clone)]
enum Native {
    /// The backend's own (attached for the world: a world group's).
    World,
    /// A communicator of its own, split from its parent's (`Group::split_on`).
    Own(Arc<dyn DeviceCollectives>),
    /// None: device memory is staged through the host.
    Staged,
}

/// How the ranks of a group reach each other.
#[derive(Clone)]
enum Link {
    /// Threads of this process: buffers published by address, a barrier between phases.
    Threads(Arc<Shared>),
    /// Processes (maybe on other machines): every rank connected to rank 0.
    Tcp(Arc<TcpLink>),
}

impl Group {
    /// Handles for a group of `world` ranks as threads of this process, one per rank.
    pub fn threads(world: usize) -> Vec<Group> {
        let shared = Arc::new(Shared::new(world, Arc::default()));
        (0..world).map(|rank| Group { rank, link: Link::Threads(shared.clone()), native: Native::World }).collect()
    }

    /// This process's rank of a group of processes joined by `link`.
    pub fn tcp(link: TcpLink) -> Group {
        Group { rank: link.rank(), link: Link::Tcp(Arc::new(link)), native: Native::World }
    }

    /// Split the group (a collective: every rank calls it): the ranks that give the same
    /// `color` form one sub-group, ranked in their order here; returns this rank's. Thread
    /// groups share memory as before; process groups connect each sub-group's members to its
    /// first rank, which listens at an address the others learn through this group (waiting
    /// up to `timeout` for them). Sub-groups run their collectives independently of each other.
    pub fn split(&self, color: u64, timeout: std::time::Duration) -> Result<Group, RendezvousError> {
        if let Link::Tcp(link) = &self.link {
            let sub = link.split(color, timeout)?;
            return Ok(Group { rank: sub.rank(), link: Link::Tcp(Arc::new(sub)), native: Native::Staged });
        }
        let colors: Vec<u64> =
            self.exchange(Published { word: color, ..Default::default() }).iter().map(|p| p.word).collect();
        // The colors in order of their first rank: the sub-groups' order in `splits`.
        let mut distinct: Vec<u64> = Vec::new();
        for &c in &colors {
            if !distinct.contains(&c) {
                distinct.push(c);
            }
        }
        if self.rank == 0 {
            let members = |c: u64| colors.iter().filter(|&&x| x == c).count();
            *self.shared().splits.lock().unwrap_or_else(|e| e.into_inner()) =
                distinct.iter().map(|&c| Arc::new(Shared::new(members(c), self.shared().abandoned.clone()))).collect();
        }
        self.shared().close();
        let index = distinct.iter().position(|&c| c == color).expect("this rank's color");
        let sub = self.shared().splits.lock().unwrap_or_else(|e| e.into_inner())[index].clone();
        self.shared().close();
        if self.rank == 0 {
            self.shared().splits.lock().unwrap_or_else(|e| e.into_inner()).clear();
        }
        let sub_rank = colors[..self.rank].iter().filter(|&&c| c == color).count();
        Ok(Group { rank: sub_rank, link: Link::Threads(sub), native: Native::Staged })
    }

    /// `split`, and where this group has native collectives on `be`, the sub-group's own
    /// communicator split from them (NCCL's `ncclCommSplit`), so its `*_on` collectives stay on
    /// the device; without (or where any member's split fails) the sub-group stages through
    /// the host.
    pub fn split_on<B: Backend>(
        &self,
        be: &B,
        color: u64,
        timeout: std::time::Duration,
    ) -> Result<Group, RendezvousError> {
        let mut sub = self.split(color, timeout)?;
        let own = match self.native_of(be) {
            None => None,
            Some(parent) => parent.split(color, sub.rank).unwrap_or_else(|e| {
                tracing::warn!("a sub-group's collectives are staged through the host: {e}");
                None
            }),
        };
        // Every member uses its communicator, or none does (a collective of the sub-group).
        if sub.agree(own.is_some()) {
            sub.native = Native::Own(own.expect("agreed"));
        }
        Ok(sub)
    }

    /// This rank takes part in no more collectives (it failed outside them): every rank of a
    /// thread group, and of the groups split from it, that waits to enter a collective or
    /// later tries to unwinds with [`Abandoned`] instead of waiting for it forever. A process
    /// group needs nothing: a rank that ends closes its connections, which ends its peers'.
    pub fn abandon(&self) {
        if let Link::Threads(shared) = &self.link {
            shared.abandoned.store(true, Ordering::SeqCst);
        }
    }

    /// This rank failed outside the collectives and is about to end: a process group's rank
    /// tells rank 0 why (`TcpLink::report_failure`), so the job ends with its failure rather
    /// than a lost connection. A thread group's ranks settle it in `train::job::thread_ranks`.
    pub fn report_failure(&self, failure: &RankFailure) {
        if let Some(link) = self.tcp_link() {
            link.report_failure(failure);
        }
    }

    /// Every rank's `words` (the same count on every rank), in rank order, on every rank.
    pub fn gather_words(&self, words: &[u64]) -> Vec<Vec<u64>> {
        if self.world() == 1 {
            return vec![words.to_vec()];
        }
        if let Some(link) = self.tcp_link() {
            return link.exchange_words(words);
        }
        let slots = self.publish_equal(words.as_ptr() as usize, words.len());
        // SAFETY: every rank's words stay alive, and are only read, until the barrier below.
        let all = slots
            .iter()
            .map(|&(addr, len)| unsafe { std::slice::from_raw_parts(addr as *const u64, len) }.to_vec())
            .collect();
        self.shared().close();
        all
    }

    /// The smallest of every rank's `value`, on every rank.
    pub fn min_u64(&self, value: u64) -> u64 {
        self.gather_words(&[value]).iter().map(|w| w[0]).min().unwrap_or(value)
    }

    /// The shared memory of a thread group (the thread forms of the collectives).
    fn shared(&self) -> &Shared {
        match &self.link {
            Link::Threads(shared) => shared,
            Link::Tcp(_) => unreachable!("a thread collective on a process group"),
        }
    }

    /// The TCP link of a process group, if this is one.
    fn tcp_link(&self) -> Option<&TcpLink> {
        match &self.link {
            Link::Tcp(link) => Some(link),
            Link::Threads(_) => None,
        }
    }

    /// Show this rank's buffers to the others and wait until every rank has; returns what
    /// every rank published, in rank order.
    fn exchange(&self, mine: Published) -> Vec<Published> {
        {
            let mut slots = self.shared().slots.lock().unwrap_or_else(|e| e.into_inner());
            slots[self.rank] = mine;
        }
        self.shared().enter();
        // Every collective ends with a barrier, so nobody publishes the next one before
        // everyone has read this one.
        self.shared().slots.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Publish one buffer that every rank may write into; it must have the same length on
    /// every rank.
    fn publish<E>(&self, buf: &mut [E]) -> Vec<(usize, usize)> {
        self.publish_equal(buf.as_mut_ptr() as usize, buf.len())
    }

    /// Publish the buffer at `addr` of `len` elements, which must be `len` on every rank.
    fn publish_equal(&self, addr: usize, len: usize) -> Vec<(usize, usize)> {
        let slots = self.exchange(Published { a: (addr, len), ..Default::default() });
        assert!(slots.iter().all(|s| s.a.1 == len), "collective on buffers of different lengths: {slots:?}");
        slots.into_iter().map(|s| s.a).collect()
    }
}

/// The shard of `len` elements rank `rank` of `world` owns: equal ceil-sized pieces.
pub fn shard_range(len: usize, rank: usize, world: usize) -> std::ops::Range<usize> {
    let per = len.div_ceil(world);
    let lo = (rank * per).min(len);
    lo..(lo + per).min(len)
}

impl Comm for Group {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        match &self.link {
            Link::Threads(shared) => shared.world,
            Link::Tcp(link) => link.world(),
        }
    }

    fn all_reduce_sum<E: Elem>(&self, buf: &mut [E]) {
        let world = self.world();
        if world == 1 {
            return;
        }
        if let Some(link) = self.tcp_link() {
            return link.all_reduce_sum(buf);
        }
        let slots = self.publish(buf);
        // This rank reduces its own chunk across every rank's buffer, in rank order, and writes
        // the sum back into every buffer. Chunks are disjoint, so no two ranks touch one element.
        let range = shard_range(buf.len(), self.rank, world);
        let mut sum = vec![0f32; range.len()];
        for &(addr, _) in &slots {
            // SAFETY: each buffer stays alive and unaliased by its owner until the barrier
            // below; only this rank touches `range` of any buffer during this phase.
            let other = unsafe { std::slice::from_raw_parts((addr as *const E).add(range.start), range.len()) };
            for (s, v) in sum.iter_mut().zip(other) {
                *s += v.to_f32();
            }
        }
        for &(addr, _) in &slots {
            // SAFETY: as above.
            let other = unsafe { std::slice::from_raw_parts_mut((addr as *mut E).add(range.start), range.len()) };
            for (o, s) in other.iter_mut().zip(&sum) {
                *o = E::from_f32(*s);
            }
        }
        self.shared().close();
    }

    fn all_gather<E: Elem>(&self, buf: &mut [E], own: std::ops::Range<usize>) {
        if self.world() == 1 {
            return;
        }
        if let Some(link) = self.tcp_link() {
            return link.all_gather(buf, own);
        }
        let slots = self.publish(buf);
        let mine = slots[self.rank].0 as *const E;
        for (r, &(addr, _)) in slots.iter().enumerate() {
            if r == self.rank {
                continue;
            }
            // SAFETY: every rank writes only its own shard into the others' buffers, and reads
            // only its own buffer's shard, which nobody else writes.
            unsafe {
                std::ptr::copy_nonoverlapping(mine.add(own.start), (addr as *mut E).add(own.start), own.len());
            }
        }
        self.shared().close();
    }

    fn reduce_scatter_add<E: Elem>(&self, bucket: &[E], offset: usize, shard: &mut [E], own: std::ops::Range<usize>) {
        let end = offset + bucket.len();
        let (lo, hi) = (own.start.max(offset), own.end.min(end));
        if self.world() == 1 {
            for i in lo..hi {
                let s = &mut shard[i - own.start];
                *s = E::from_f32(s.to_f32() + bucket[i - offset].to_f32());
            }
            return;
        }
        if let Some(link) = self.tcp_link() {
            return link.reduce_scatter_add(bucket, offset, shard, own);
        }
        let slots = self.publish_equal(bucket.as_ptr() as usize, bucket.len());
        if lo < hi {
            let mut sum = vec![0f32; hi - lo];
            for &(addr, _) in &slots {
                // SAFETY: every bucket stays alive, and is only read, until the barrier below.
                let other = unsafe { std::slice::from_raw_parts((addr as *const E).add(lo - offset), hi - lo) };
                for (s, v) in sum.iter_mut().zip(other) {
                    *s += v.to_f32();
                }
            }
            for (d, s) in shard[lo - own.start..hi - own.start].iter_mut().zip(&sum) {
                *d = E::from_f32(d.to_f32() + s);
            }
        }
        self.shared().close();
    }

    fn gather_range<E: Elem>(&self, shard: &[E], own: std::ops::Range<usize>, offset: usize, out: &mut [E]) {
        let end = offset + out.len();
        if self.world() == 1 {
            out.copy_from_slice(&shard[offset - own.start..end - own.start]);
            return;
        }
        if let Some(link) = self.tcp_link() {
            return link.gather_range(shard, own, offset, out);
        }
        let slots =
            self.exchange(Published { a: (shard.as_ptr() as usize, shard.len()), own: (own.start, own.end), word: 0 });
        // Every rank reads the part of `offset..end` that each owner holds, into its own `out`.
        for p in &slots {
            let (lo, hi) = (p.own.0.max(offset), p.own.1.min(end));
            if lo >= hi {
                continue;
            }
            // SAFETY: shards are only read until the barrier below; each rank writes only its
            // own `out`.
            let src = unsafe { std::slice::from_raw_parts((p.a.0 as *const E).add(lo - p.own.0), hi - lo) };
            out[lo - offset..hi - offset].copy_from_slice(src);
        }
        self.shared().close();
    }

    fn all_reduce_f64(&self, value: f64) -> f64 {
        if self.world() == 1 {
            return value;
        }
        // Added in rank order: the same bits on every rank.
        self.gather_words(&[value.to_bits()]).iter().map(|w| f64::from_bits(w[0])).sum()
    }

    fn broadcast(&self, value: u64) -> u64 {
        if self.world() == 1 {
            return value;
        }
        if let Some(link) = self.tcp_link() {
            return link.exchange_words(&[value])[0][0];
        }
        if self.rank == 0 {
            self.shared().word.store(value, Ordering::SeqCst);
        }
        self.shared().enter();
        let v = self.shared().word.load(Ordering::SeqCst);
        self.shared().close();
        v
    }

    fn agree(&self, ok: bool) -> bool {
        if self.world() == 1 {
            return ok;
        }
        if let Some(link) = self.tcp_link() {
            return link.exchange_words(&[ok as u64]).iter().all(|w| w[0] == 1);
        }
        if !ok {
            self.shared().failures.fetch_add(1, Ordering::SeqCst);
        }
        self.shared().enter();
        let all_ok = self.shared().failures.load(Ordering::SeqCst) == 0;
        self.shared().close();
        if self.rank == 0 {
            self.shared().failures.store(0, Ordering::SeqCst);
        }
        self.shared().close();
        all_ok
    }
}

/// Collectives on pool views of a rank's backend. A host-visible view (the `cpu` device) takes
/// part in place. A device view is staged: this rank's part is downloaded, exchanged through
/// host memory like any other, and the result uploaded; the bytes and the copy time are
/// returned. A rank whose download fails still takes part (its contribution is whatever the
/// staging buffer holds), so no other rank waits at a barrier for it, and returns the error
/// after.
impl Group {
    /// `all_reduce_sum` of a view.
    pub fn all_reduce_sum_on<E: Elem, B: Backend>(&self, be: &B, mut buf: ViewMut<E>) -> BackendResult<SwapStats> {
        if self.world() == 1 {
            return Ok(SwapStats::default());
        }
        if buf.host_visible() {
            self.all_reduce_sum(buf.host_mut());
            return Ok(SwapStats::default());
        }
        if let Some(native) = self.native_of(be) {
            native.all_reduce_sum(buf.address(), buf.len(), Dtype::of::<E>())?;
            return Ok(SwapStats::default());
        }
        let mut staged = Staged::new();
        let mut host = vec![E::default(); buf.len()];
        let down = staged.down(be, buf.as_view(), &mut host);
        self.all_reduce_sum(&mut host);
        down?;
        staged.up(be, buf, &host)?;
        Ok(staged.stats)
    }

    /// `all_gather` of a view holding every parameter, of which this rank owns `own`.
    pub fn all_gather_on<E: Elem, B: Backend>(
        &self,
        be: &B,
        mut buf: ViewMut<E>,
        own: Range<usize>,
    ) -> BackendResult<SwapStats> {
        if self.world() == 1 {
            return Ok(SwapStats::default());
        }
        if buf.host_visible() {
            self.all_gather(buf.host_mut(), own);
            return Ok(SwapStats::default());
        }
        if let Some(native) = self.native_of(be) {
            // Each shard is broadcast in place from its owner.
            for (root, part) in self.owned_ranges(&own).into_iter().enumerate() {
                if !part.is_empty() {
                    let at = element_address::<E>(buf.address(), part.start);
                    native.broadcast((root == self.rank).then_some(at), at, part.len(), Dtype::of::<E>(), root)?;
                }
            }
            return Ok(SwapStats::default());
        }
        let mut staged = Staged::new();
        let mut host = vec![E::default(); buf.len()];
        let down = staged.down(be, buf.as_view().slice(own.clone()), &mut host[own.clone()]);
        self.all_gather(&mut host, own.clone());
        down?;
        // Only the other ranks' shards changed.
        let (head, rest) = buf.split_at(own.start);
        let (_, tail) = rest.split_at(own.len());
        staged.up(be, head, &host[..own.start])?;
        staged.up(be, tail, &host[own.end..])?;
        Ok(staged.stats)
    }

    /// `reduce_scatter_add` of a gradient bucket (parameters `offset..`) into this rank's
    /// shard view (parameters `own`, indexed from `own.start`).
    pub fn reduce_scatter_add_on<E: Elem, B: Backend>(
        &self,
        be: &B,
        bucket: View<E>,
        offset: usize,
        mut shard: ViewMut<E>,
        own: Range<usize>,
    ) -> BackendResult<SwapStats> {
        if bucket.host_visible() && shard.host_visible() {
            self.reduce_scatter_add(bucket.host(), offset, shard.host_mut(), own);
            return Ok(SwapStats::default());
        }
        match self.native_of(be) {
            Some(native) if self.world() > 1 && !bucket.host_visible() && !shard.host_visible() => {
                self.reduce_scatter_add_native(be, native, bucket, offset, shard, own)?;
                return Ok(SwapStats::default());
            }
            _ => {}
        }
        let mut staged = Staged::new();
        let mut host_bucket = vec![E::default(); bucket.len()];
        let mut down = staged.down(be, bucket, &mut host_bucket);
        // The part of the bucket this rank owns: only it is read and written back.
        let mine = owned_part(&own, offset..offset + bucket.len());
        let in_shard = mine.start - own.start..mine.end - own.start;
        let mut part = vec![E::default(); mine.len()];
        if !mine.is_empty() {
            down = down.and(staged.down(be, shard.as_view().slice(in_shard.clone()), &mut part));
        }
        self.reduce_scatter_add(&host_bucket, offset, &mut part, mine.clone());
        down?;
        if !mine.is_empty() {
            staged.up(be, shard.slice(in_shard), &part)?;
        }
        Ok(staged.stats)
    }

    /// `gather_range` into a view `out` (parameters `offset..`) from this rank's shard
    /// (parameters `own`, indexed from `own.start`), which may be a view of host memory.
    pub fn gather_range_on<E: Elem, B: Backend>(
        &self,
        be: &B,
        shard: View<E>,
        own: Range<usize>,
        offset: usize,
        mut out: ViewMut<E>,
    ) -> BackendResult<SwapStats> {
        if shard.host_visible() && out.host_visible() {
            self.gather_range(shard.host(), own, offset, out.host_mut());
            return Ok(SwapStats::default());
        }
        match self.native_of(be) {
            Some(native) if self.world() > 1 && !out.host_visible() => {
                return self.gather_range_native(be, native, shard, own, offset, out);
            }
            _ => {}
        }
        let mut staged = Staged::new();
        // The part of the range this rank owns is all the others read from it.
        let mine = owned_part(&own, offset..offset + out.len());
        let in_shard = mine.start - own.start..mine.end - own.start;
        let mut part = vec![E::default(); mine.len()];
        let down = if shard.host_visible() {
            part.copy_from_slice(&shard.host()[in_shard]);
            Ok(())
        } else {
            staged.down(be, shard.slice(in_shard), &mut part)
        };
        let mut host_out = vec![E::default(); out.len()];
        self.gather_range(&part, mine, offset, &mut host_out);
        down?;
        if out.host_visible() {
            out.host_mut().copy_from_slice(&host_out);
        } else {
            staged.up(be, out, &host_out)?;
        }
        Ok(staged.stats)
    }
}

/// Point to point over a group of two (neighbouring pipeline stages): a broadcast from the
/// sender, `send_on` on one member and `recv_on` on the other, in the same order on both.
impl Group {
    /// Send `view` to the other member.
    pub fn send_on<E: Elem, B: Backend>(&self, be: &B, view: View<E>) -> BackendResult<SwapStats> {
        debug_assert_eq!(self.world(), 2, "point to point is between two ranks");
        let n = view.len();
        if let Some(native) = self.native_of(be).filter(|_| !view.host_visible()) {
            native.broadcast(Some(view.address()), view.address(), n, Dtype::of::<E>(), self.rank)?;
            return Ok(SwapStats::default());
        }
        let mut staged = Staged::new();
        let mut host = vec![E::default(); n];
        let down = if view.host_visible() {
            host.copy_from_slice(view.host());
            Ok(())
        } else {
            staged.down(be, view, &mut host)
        };
        // A rank whose download failed still takes part, so the other is not left waiting.
        self.all_gather(&mut host, 0..n);
        down?;
        Ok(staged.stats)
    }

    /// Receive into `buf` what the other member sends.
    pub fn recv_on<E: Elem, B: Backend>(&self, be: &B, mut buf: ViewMut<E>) -> BackendResult<SwapStats> {
        debug_assert_eq!(self.world(), 2, "point to point is between two ranks");
        let n = buf.len();
        if let Some(native) = self.native_of(be).filter(|_| !buf.host_visible()) {
            native.broadcast(None, buf.address(), n, Dtype::of::<E>(), 1 - self.rank)?;
            return Ok(SwapStats::default());
        }
        if buf.host_visible() {
            self.all_gather(buf.host_mut(), n..n);
            return Ok(SwapStats::default());
        }
        let mut staged = Staged::new();
        let mut host = vec![E::default(); n];
        self.all_gather(&mut host, n..n);
        staged.up(be, buf, &host)?;
        Ok(staged.stats)
    }

    /// Take part in a transfer without a buffer of one's own (a rank that failed earlier in
    /// the step): sends zeros, or receives into a stand-in that is dropped. The stand-in takes
    /// the path the other member's buffer does: on a device with native collectives a device
    /// buffer (the pool's, in `workspace`) through them; where the pool cannot give one, or
    /// without them, the host's. (A peer on NCCL would wait for a host stand-in forever: that
    /// attempt ends by the supervisor's stall limit.)
    pub fn stand_in<E: Elem, B: Backend>(&self, be: &B, n: usize, sending: bool) {
        if self.native_of(be).is_some() {
            if let Ok(mut buf) = be.pool().alloc(n * E::BYTES, crate::memory::Category::Workspace) {
                // Sent whether or not the zeroing worked: the peer waits for the transfer, and
                // its step fails with this one's after the passes.
                let moved = match sending {
                    true => {
                        let _ = be.zero::<E>(ViewMut::of(&mut buf));
                        self.send_on::<E, B>(be, View::of(&buf))
                    }
                    false => self.recv_on::<E, B>(be, ViewMut::of(&mut buf)),
                };
                if let Err(e) = moved {
                    tracing::warn!("a failed stage's stand-in transfer failed too: {e}");
                }
                return;
            }
        }
        let mut host = vec![E::default(); n];
        self.all_gather(&mut host, if sending { 0..n } else { n..n });
    }
}

/// ZeRO's collectives built from a backend's native primitives (NCCL): no host copies.
impl Group {
    /// The native collectives that serve this group on `be`, if any.
    fn native_of<'b, B: Backend>(&'b self, be: &'b B) -> Option<&'b dyn DeviceCollectives> {
        match &self.native {
            Native::World => be.collectives(),
            Native::Own(own) => Some(own.as_ref()),
            Native::Staged => None,
        }
    }

    /// Every rank's shard, in rank order (a host exchange: ranks publish only their own).
    fn owned_ranges(&self, own: &Range<usize>) -> Vec<Range<usize>> {
        let words = self.gather_words(&[own.start as u64, own.end as u64]);
        words.into_iter().map(|w| w[0] as usize..w[1] as usize).collect()
    }

    /// `reduce_scatter_add_on` natively: for each owner, the part of the bucket in its shard
    /// is reduced into a workspace on the owner, which adds it into its shard (in fp32 the
    /// same two additions as the host path; in 16 bits the sum is rounded once more).
    fn reduce_scatter_add_native<E: Elem, B: Backend>(
        &self,
        be: &B,
        native: &dyn DeviceCollectives,
        bucket: View<E>,
        offset: usize,
        mut shard: ViewMut<E>,
        own: Range<usize>,
    ) -> BackendResult {
        let range = offset..offset + bucket.len();
        let parts: Vec<Range<usize>> =
            self.owned_ranges(&own).iter().map(|theirs| owned_part(theirs, range.clone())).collect();
        // Every rank allocates the workspace for the largest part, before any call: the same
        // allocation on every rank, so an OOM hits all of them here and none waits in NCCL.
        let largest = parts.iter().map(|p| p.len()).max().unwrap_or(0);
        let mut sum = be.pool().alloc(largest.max(1) * E::BYTES, crate::memory::Category::Workspace)?;
        for (root, part) in parts.into_iter().enumerate() {
            if part.is_empty() {
                continue;
            }
            let send = element_address::<E>(bucket.address(), part.start - offset);
            if root != self.rank {
                native.reduce_sum(send, None, part.len(), Dtype::of::<E>(), root)?;
                continue;
            }
            let sum = ViewMut::<E>::range(&mut sum, 0..part.len());
            native.reduce_sum(send, Some(sum.address()), part.len(), Dtype::of::<E>(), root)?;
            let mine = shard.reborrow().slice(part.start - own.start..part.end - own.start);
            be.residual_forward_inplace(mine, sum.as_view())?;
        }
        Ok(())
    }

    /// `gather_range_on` natively: each owner broadcasts its part of the range into every
    /// rank's `out`. A shard in host memory (`offload.params`) is uploaded into its own part
    /// of `out` first and broadcast from there.
    fn gather_range_native<E: Elem, B: Backend>(
        &self,
        be: &B,
        native: &dyn DeviceCollectives,
        shard: View<E>,
        own: Range<usize>,
        offset: usize,
        mut out: ViewMut<E>,
    ) -> BackendResult<SwapStats> {
        let range = offset..offset + out.len();
        let mut staged = Staged::new();
        let mine = owned_part(&own, range.clone());
        // A rank whose upload fails still takes part (the others must not wait for it), and
        // returns the error after.
        let mut uploaded = Ok(());
        if shard.host_visible() && !mine.is_empty() {
            let dst = out.reborrow().slice(mine.start - offset..mine.end - offset);
            uploaded = staged.up(be, dst, &shard.host()[mine.start - own.start..mine.end - own.start]);
        }
        for (root, theirs) in self.owned_ranges(&own).into_iter().enumerate() {
            let part = owned_part(&theirs, range.clone());
            if part.is_empty() {
                continue;
            }
            let recv = element_address::<E>(out.address(), part.start - offset);
            let send = match (root == self.rank, shard.host_visible()) {
                (false, _) => None,
                (true, true) => Some(recv),
                (true, false) => Some(element_address::<E>(shard.address(), part.start - own.start)),
            };
            native.broadcast(send, recv, part.len(), Dtype::of::<E>(), root)?;
        }
        uploaded?;
        Ok(staged.stats)
    }
}

/// The address of element `index` of a buffer of `E` at `base`.
fn element_address<E: Elem>(base: u64, index: usize) -> u64 {
    base + (index * E::BYTES) as u64
}

/// The part of `own` inside `range`; empty (at `own.start`) when they do not meet.
fn owned_part(own: &Range<usize>, range: Range<usize>) -> Range<usize> {
    let (lo, hi) = (own.start.max(range.start), own.end.min(range.end));
    if lo < hi {
        lo..hi
    } else {
        own.start..own.start
    }
}

/// The copies of one staged collective, counted.
struct Staged {
    stats: SwapStats,
}

impl Staged {
    fn new() -> Staged {
        Staged { stats: SwapStats::default() }
    }

    fn down<E: Elem, B: Backend>(&mut self, be: &B, src: View<E>, dst: &mut [E]) -> BackendResult {
        if dst.is_empty() {
            return Ok(());
        }
        let t0 = Instant::now();
        let done = be.download(src, dst);
        self.stats.bytes_to_host += dst.len() * E::BYTES;
        self.stats.transfer_ms += t0.elapsed().as_secs_f64() * 1e3;
        done
    }

    fn up<E: Elem, B: Backend>(&mut self, be: &B, dst: ViewMut<E>, src: &[E]) -> BackendResult {
        if src.is_empty() {
            // Nothing to copy (a shard at either end of the buffer, or none at all).
            return Ok(());
        }
        let t0 = Instant::now();
        let done = be.upload(dst, src);
        self.stats.bytes_to_device += src.len() * E::BYTES;
        self.stats.transfer_ms += t0.elapsed().as_secs_f64() * 1e3;
        done
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn collectives_sum_gather_and_broadcast() {
        let world = 3;
        let handles = Group::threads(world);
        let results: Vec<(Vec<f32>, Vec<f32>, u64, bool)> = std::thread::scope(|s| {
            let joins: Vec<_> = handles
                .into_iter()
                .map(|c| {
                    s.spawn(move || {
                        let r = c.rank() as f32;
                        let mut sum: Vec<f32> = (0..10).map(|i| i as f32 + r).collect();
                        c.all_reduce_sum(&mut sum);
                        let mut gathered = vec![-1f32; 10];
                        let own = shard_range(10, c.rank(), c.world());
                        for i in own.clone() {
                            gathered[i] = r;
                        }
                        c.all_gather(&mut gathered, own);
                        let b = c.broadcast(if c.rank() == 0 { 42 } else { 7 });
                        let ok = c.agree(c.rank() != 1);
                        (sum, gathered, b, ok)
                    })
                })
                .collect();
            joins.into_iter().map(|j| j.join().unwrap()).collect()
        });
        for (sum, gathered, b, ok) in results {
            assert_eq!(sum, (0..10).map(|i| 3.0 * i as f32 + 3.0).collect::<Vec<_>>());
            assert_eq!(gathered, vec![0., 0., 0., 0., 1., 1., 1., 1., 2., 2.]);
            assert_eq!(b, 42);
            assert!(!ok, "one rank failed, so every rank hears it");
        }
    }

    /// Run `f` on every rank of a group of `world` threads; results in rank order.
    fn on_group<R: Send>(world: usize, f: impl Fn(Group) -> R + Sync) -> Vec<R> {
        std::thread::scope(|s| {
            let joins: Vec<_> = Group::threads(world).into_iter().map(|c| s.spawn(|| f(c))).collect();
            joins.into_iter().map(|j| j.join().unwrap()).collect()
        })
    }

    /// A native reduce-scatter whose workspace does not fit fails on every rank before any
    /// rank enters a collective (a rank left waiting in NCCL would hang the job) — also when
    /// the bucket's parts are as unequal as they get: a few elements of rank 0's shard and
    /// all of rank 1's.
    #[test]
    fn a_native_reduce_scatter_that_runs_out_of_memory_fails_on_every_rank() {
        use crate::engine::check::device_sim::{DeviceSim, SimCollectives};
        use crate::memory::Category;
        use std::sync::mpsc;
        const N: usize = 3 << 20; // parameters: 6 MiB shards of f32
        const OFFSET: usize = N / 2 - 1024; // the bucket: 1024 of rank 0's, all of rank 1's
        let (done, results) = mpsc::channel();
        let group = SimCollectives::group(2);
        for (c, native) in Group::threads(2).into_iter().zip(group) {
            let done = done.clone();
            std::thread::spawn(move || {
                // Room for the bucket and the shard (12 MiB and a bit), and for a 4 KiB
                // workspace, not for a 6 MiB one.
                let be = DeviceSim::new(16 << 20).with_collectives(native);
                let own = shard_range(N, c.rank(), 2);
                let mut bucket = be.pool().alloc((N - OFFSET) * 4, Category::Workspace).unwrap();
                let mut shard = be.pool().alloc(own.len() * 4, Category::Grads).unwrap();
                be.zero(ViewMut::<f32>::of(&mut bucket)).unwrap();
                let shard = ViewMut::<f32>::range(&mut shard, 0..own.len());
                let bucket = View::<f32>::range(&bucket, 0..N - OFFSET);
                let result = c.reduce_scatter_add_on(&be, bucket, OFFSET, shard, own);
                let _ = done.send((c.rank(), result.map_err(|e| e.to_string())));
            });
        }
        let mut seen = Vec::new();
        for _ in 0..2 {
            let got = results.recv_timeout(std::time::Duration::from_secs(20));
            seen.push(got.expect("a rank is stuck in a collective"));
        }
        seen.sort_by_key(|(rank, _)| *rank);
        for (rank, result) in seen {
            let err = result.expect_err("the workspace cannot fit");
            assert!(err.starts_with("out of device memory: requested 6.00 MiB for workspace"), "rank {rank}: {err}");
        }
    }

    /// Process ranks (a TCP group over loopback) give every collective's result bitwise as
    /// thread ranks do, in f32 and bf16, with unequal and empty shards.
    #[test]
    fn a_process_group_gives_what_a_thread_group_gives() {
        fn run<E: Elem + PartialEq + std::fmt::Debug>(c: Group, n: usize) -> Vec<Vec<u64>> {
            let r = c.rank() as f32;
            let own = shard_range(n, c.rank(), c.world());
            let bits = |v: &[E]| v.iter().map(|x| x.to_f32().to_bits() as u64).collect::<Vec<_>>();
            // Values whose f32 sums depend on the order of addition.
            let mut sum: Vec<E> = (0..n).map(|i| E::from_f32(1e7 * (i % 3) as f32 - 1e7 * r + 0.37 * r)).collect();
            c.all_reduce_sum(&mut sum);
            let mut gathered: Vec<E> =
                (0..n).map(|i| E::from_f32(if own.contains(&i) { 10.0 * r + i as f32 } else { -1.0 })).collect();
            c.all_gather(&mut gathered, own.clone());
            let bucket: Vec<E> = (0..n - 1).map(|i| E::from_f32((c.rank() + 1) as f32 * (i as f32 + 0.3))).collect();
            let mut shard = vec![E::from_f32(0.25); own.len()];
            c.reduce_scatter_add(&bucket, 1, &mut shard, own.clone());
            // A bucket inside the last rank's shard alone (the others' parts are empty).
            c.reduce_scatter_add(&bucket[n - 2..], n - 1, &mut shard, own.clone());
            let weights: Vec<E> = own.clone().map(|i| E::from_f32(i as f32 * 3.0)).collect();
            let mut segment = vec![E::from_f32(-1.0); n - 1];
            c.gather_range(&weights, own.clone(), 1, &mut segment);
            let mut last = vec![E::from_f32(-1.0); 1];
            c.gather_range(&weights, own.clone(), n - 1, &mut last);
            segment.extend(last);
            let scalars = vec![
                c.all_reduce_f64([1e16, 1.0, -1e16][c.rank()]).to_bits(),
                c.broadcast(40 + c.rank() as u64),
                c.agree(c.rank() != 1) as u64,
                c.agree(true) as u64,
            ];
            vec![bits(&sum), bits(&gathered), bits(&shard), bits(&segment), scalars]
        }
        fn on<R: Send>(groups: Vec<Group>, f: impl Fn(Group) -> R + Sync) -> Vec<R> {
            std::thread::scope(|s| {
                let joins: Vec<_> = groups.into_iter().map(|c| s.spawn(|| f(c))).collect();
                joins.into_iter().map(|j| j.join().unwrap()).collect()
            })
        }
        let tcp = |world| crate::engine::parallel::tcp::tests::loopback(world).into_iter().map(Group::tcp).collect();
        for (world, n) in [(2, 11), (3, 10), (3, 2)] {
            let threads = on(Group::threads(world), |c| run::<f32>(c, n));
            assert_eq!(on(tcp(world), |c| run::<f32>(c, n)), threads, "f32: {n} parameters on {world} ranks");
            let threads = on(Group::threads(world), |c| run::<half::bf16>(c, n));
            assert_eq!(on(tcp(world), |c| run::<half::bf16>(c, n)), threads, "bf16: {n} parameters on {world} ranks");
            // The rank-0 broadcast and a failed rank heard by all.
            assert_eq!(threads[world - 1][4][1..], [40, 0, 1]);
        }
    }

    #[test]
    fn a_split_group_runs_collectives_within_each_color_as_threads_and_as_processes() {
        // Per rank: (color, sub-rank, sub-world, the sub-group's sum of rank + 1, rank 0's
        // broadcast of its rank, and a collective on the whole group afterwards).
        fn run(c: Group) -> Vec<(u64, usize, usize, Vec<f32>, u64, f64)> {
            let timeout = std::time::Duration::from_secs(20);
            let rank = c.rank();
            let mut out = Vec::new();
            for color in [rank as u64 % 2, rank as u64 / 2, 7, rank as u64] {
                let sub = c.split(color, timeout).unwrap();
                let mut buf = vec![(rank + 1) as f32; 3];
                sub.all_reduce_sum(&mut buf);
                let first = sub.broadcast(rank as u64);
                out.push((color, sub.rank(), sub.world(), buf, first, c.all_reduce_f64(1.0)));
            }
            out
        }
        fn on<R: Send>(groups: Vec<Group>, f: impl Fn(Group) -> R + Sync) -> Vec<R> {
            std::thread::scope(|s| {
                let joins: Vec<_> = groups.into_iter().map(|c| s.spawn(|| f(c))).collect();
                joins.into_iter().map(|j| j.join().unwrap()).collect()
            })
        }
        let threads = on(Group::threads(4), run);
        // Rank 2: colors 0 (with rank 0), 1 (with rank 3), 7 (everyone), 2 (alone).
        assert_eq!(
            threads[2],
            [
                (0, 1, 2, vec![4.0; 3], 0, 4.0),
                (1, 0, 2, vec![7.0; 3], 2, 4.0),
                (7, 2, 4, vec![10.0; 3], 0, 4.0),
                (2, 0, 1, vec![3.0; 3], 2, 4.0),
            ]
        );
        let tcp = crate::engine::parallel::tcp::tests::loopback(4).into_iter().map(Group::tcp).collect();
        assert_eq!(on(tcp, run), threads, "a process group splits as a thread group does");
    }

    #[test]
    fn reduce_scatter_adds_each_bucket_into_its_owners_shard() {
        // 10 parameters over 3 ranks: shards 0..4, 4..8, 8..10. Two buckets (2..7 and 7..10)
        // straddle the shard boundaries; rank r contributes (r + 1) * (index + 1).
        let shards = on_group(3, |c| {
            let own = shard_range(10, c.rank(), c.world());
            let mut shard = vec![0.5f32; own.len()];
            for (lo, hi) in [(2usize, 7usize), (7, 10)] {
                let bucket: Vec<f32> = (lo..hi).map(|i| ((c.rank() + 1) * (i + 1)) as f32).collect();
                c.reduce_scatter_add(&bucket, lo, &mut shard, own.clone());
            }
            (own, shard)
        });
        for (own, shard) in shards {
            for (i, v) in own.zip(shard) {
                // Indices 0..2 are in no bucket: only the initial 0.5 remains.
                let expected = if i < 2 { 0.5 } else { 0.5 + 6.0 * (i + 1) as f32 };
                assert_eq!(v, expected, "parameter {i}");
            }
        }
    }

    #[test]
    fn gather_range_assembles_a_segment_from_its_owners() {
        let outs = on_group(4, |c| {
            let own = shard_range(11, c.rank(), c.world());
            let shard: Vec<f32> = own.clone().map(|i| i as f32 * 10.0).collect();
            // A segment spanning three owners, and one inside a single shard.
            let mut wide = vec![-1f32; 7];
            c.gather_range(&shard, own.clone(), 2, &mut wide);
            let mut narrow = vec![-1f32; 2];
            c.gather_range(&shard, own, 9, &mut narrow);
            (wide, narrow)
        });
        for (wide, narrow) in outs {
            assert_eq!(wide, (2..9).map(|i| i as f32 * 10.0).collect::<Vec<_>>());
            assert_eq!(narrow, vec![90.0, 100.0]);
        }
    }

    #[test]
    fn all_reduce_f64_gives_every_rank_the_same_sum() {
        let sums = on_group(4, |c| {
            // Values whose sum depends on the order of addition in f64.
            let v = [1e16, 1.0, -1e16, 1.0][c.rank()];
            (0..3).map(|_| c.all_reduce_f64(v)).collect::<Vec<_>>()
        });
        let expected = ((1e16 + 1.0) + -1e16) + 1.0;
        for s in &sums {
            assert_eq!(s, &vec![expected; 3], "rank order, the same bits everywhere");
        }
    }

    /// The `*_on` forms on a device (staged through the host) give what the host forms give,
    /// with shards of unequal length, an empty shard (fewer parameters than ranks) and buckets
    /// straddling shard boundaries.
    #[test]
    fn staged_and_native_collectives_on_a_device_match_the_host_ones() {
        use crate::engine::check::device_sim::{DeviceSim, SimCollectives};
        use crate::memory::Category;
        #[derive(Clone, Copy, PartialEq)]
        enum Mode {
            Host,
            Staged,
            /// Native collectives; the weights' shard in host memory when true (offload.params).
            Native(bool),
        }
        for n in [10usize, 2] {
            let group = SimCollectives::group(3);
            let run = |mode: Mode| {
                on_group(3, |c| {
                    let be = match mode {
                        Mode::Native(_) => DeviceSim::new(16 << 20).with_collectives(group[c.rank()].clone()),
                        _ => DeviceSim::new(16 << 20),
                    };
                    let own = shard_range(n, c.rank(), c.world());
                    let upload = |v: &[f32]| {
                        let mut b = be.pool().alloc(v.len().max(1) * 4, Category::Workspace).unwrap();
                        be.upload(ViewMut::range(&mut b, 0..v.len()), v).unwrap();
                        b
                    };
                    let read = |b: &crate::memory::Buffer, len: usize| {
                        let mut v = vec![0f32; len];
                        be.download(View::range(b, 0..len), &mut v).unwrap();
                        v
                    };
                    let r = c.rank() as f32;
                    let mut sum: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 + r).collect();
                    let mut gathered: Vec<f32> =
                        (0..n).map(|i| if own.contains(&i) { 10.0 * r + i as f32 } else { -1.0 }).collect();
                    let bucket: Vec<f32> = (0..n - 1).map(|i| (c.rank() + 1) as f32 * (i + 2) as f32).collect();
                    let mut shard = vec![0.25f32; own.len()];
                    let mut segment = vec![-1f32; n - 1];
                    let weights: Vec<f32> = own.clone().map(|i| i as f32 * 3.0).collect();
                    if mode != Mode::Host {
                        let mut d_sum = upload(&sum);
                        let mut d_gathered = upload(&gathered);
                        let d_bucket = upload(&bucket);
                        let mut d_shard = upload(&shard);
                        let mut d_segment = upload(&segment);
                        let d_weights = upload(&weights);
                        c.all_reduce_sum_on(&be, ViewMut::<f32>::range(&mut d_sum, 0..n)).unwrap();
                        c.all_gather_on(&be, ViewMut::<f32>::range(&mut d_gathered, 0..n), own.clone()).unwrap();
                        let bucket_view = View::<f32>::range(&d_bucket, 0..n - 1);
                        c.reduce_scatter_add_on(
                            &be,
                            bucket_view,
                            1,
                            ViewMut::range(&mut d_shard, 0..own.len()),
                            own.clone(),
                        )
                        .unwrap();
                        let weights_view = match mode {
                            Mode::Native(true) => View::from_host(&weights),
                            _ => View::<f32>::range(&d_weights, 0..own.len()),
                        };
                        c.gather_range_on(&be, weights_view, own.clone(), 1, ViewMut::range(&mut d_segment, 0..n - 1))
                            .unwrap();
                        (read(&d_sum, n), read(&d_gathered, n), read(&d_shard, own.len()), read(&d_segment, n - 1))
                    } else {
                        c.all_reduce_sum(&mut sum);
                        c.all_gather(&mut gathered, own.clone());
                        c.reduce_scatter_add(&bucket, 1, &mut shard, own.clone());
                        c.gather_range(&weights, own.clone(), 1, &mut segment);
                        (sum, gathered, shard, segment)
                    }
                })
            };
            let host = run(Mode::Host);
            assert_eq!(run(Mode::Staged), host, "staged: {n} parameters on 3 ranks");
            let calls = group[0].calls();
            assert_eq!(run(Mode::Native(false)), host, "native: {n} parameters on 3 ranks");
            assert!(group[0].calls() > calls, "the native primitives were not called");
            assert_eq!(run(Mode::Native(true)), host, "native, weights on the host: {n} parameters on 3 ranks");
            // And the host results are the collectives' meaning.
            let (sum, gathered, _, segment) = &host[2];
            assert_eq!(sum, &(0..n).map(|i| 1.5 * i as f32 + 3.0).collect::<Vec<_>>());
            let owner = |i: usize| (0..3).find(|&r| shard_range(n, r, 3).contains(&i)).unwrap() as f32;
            assert_eq!(gathered, &(0..n).map(|i| 10.0 * owner(i) + i as f32).collect::<Vec<_>>());
            assert_eq!(segment, &(1..n).map(|i| i as f32 * 3.0).collect::<Vec<_>>());
        }
    }
}
