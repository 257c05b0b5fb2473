//! The budgeted caching allocator every engine byte goes through: segments, blocks, categories, OOM.
//!
//! Modelled on PyTorch's CUDA caching allocator. The pool reserves *segments* from the device
//! (host memory for the `cpu` device) and carves them into *blocks*:
//! - requests are rounded up to [`ROUND`] bytes;
//! - requests up to [`SMALL_LIMIT`] come from small segments of [`SMALL_SEGMENT`] bytes; larger ones
//!   from a segment of their own (rounded up to [`LARGE_ROUND`]) or a cached block big enough;
//! - a free block is split when the remainder is worth keeping, and coalesced with free
//!   neighbours of the same segment when released;
//! - freed blocks stay cached (reserved) for reuse until [`Pool::empty_cache`];
//! - a request that cannot be served within `capacity` first releases every cached, wholly free
//!   segment, then fails with a typed [`OomError`] — nothing panics;
//! - segments come from a [`SegmentSource`]: host memory for the `cpu` device ([`HostSegments`]),
//!   `cuMemAlloc` for a CUDA device. A source that refuses (the device is full whatever
//!   `capacity` says) is treated like the capacity check: release the cache, retry once, OOM.
//!
//! **Expandable segments** (PyTorch's `expandable_segments:True`), for a source with an
//! [`AddressSpace`]: large requests are carved from one *arena*, a virtual address range reserved
//! once with no memory behind it; pages ([`AddressSpace::page`]) are mapped as blocks need them and
//! unmapped when the cache is released. `reserved` counts mapped pages. Free space between live
//! blocks is then never stranded in a segment: its pages go back and are mapped again where the
//! next request lands, so a request fails only when its pages do not fit beside the pages live
//! blocks touch. Small requests keep their small segments either way.

use std::collections::BTreeSet;
use std::fmt;
use std::sync::{Arc, Mutex};

use super::plan;
use super::stats::{format_bytes, Category, MemStats};

/// Every request is rounded up to a multiple of this many bytes.
pub const ROUND: usize = 512;
/// Requests up to this size are served from small segments.
pub const SMALL_LIMIT: usize = 1 << 20;
/// Size of one small segment.
pub const SMALL_SEGMENT: usize = 2 << 20;
/// Large segments are rounded up to this granularity.
pub const LARGE_ROUND: usize = 2 << 20;
/// Alignment of every segment (and so of every block, since blocks are multiples of ROUND).
const SEGMENT_ALIGN: usize = 4096;

/// A request the pool could not serve within its capacity.
#[derive(Debug, Clone, thiserror::Error)]
#[error(
    "out of device memory: requested {requested} for {category} \
     (allocated {allocated}, reserved {reserved}, capacity {capacity})",
    requested = format_bytes(*requested_bytes), allocated = format_bytes(stats.allocated()),
    reserved = format_bytes(stats.reserved), capacity = format_bytes(stats.capacity)
)]
pub struct OomError {
    pub requested_bytes: usize,
    pub category: Category,
    pub stats: Box<MemStats>,
}

/// Where a pool's segments come from.
pub trait SegmentSource: Send + Sync {
    /// Reserve `size` bytes (a multiple of [`ROUND`], aligned to at least 4 KiB); `None` when
    /// the device refuses.
    fn reserve(&self, size: usize) -> Option<u64>;
    /// Give back a segment from `reserve` of exactly `size` bytes.
    fn release(&self, address: u64, size: usize);
    /// Whether addresses are host memory (so [`Buffer::bytes`] may read them).
    fn host_visible(&self) -> bool;
    /// Virtual memory the pool may map on demand (expandable segments); `None`: fixed segments.
    fn address_space(&self) -> Option<&dyn AddressSpace> {
        None
    }
    /// Whether a fresh segment (and a freshly mapped page) reads as zeros, so a block carved
    /// from one needs no zeroing before its first use ([`Buffer::fresh_zero`]).
    fn zero_filled(&self) -> bool {
        false
    }
}

/// Address space reserved without memory, and memory mapped into it page by page: what
/// expandable segments need from a device (`mmap`/`mprotect` on the host, `cuMemAddressReserve`
/// and `cuMemMap` on CUDA).
pub trait AddressSpace: Send + Sync {
    /// The mapping granularity in bytes: a power of two and a multiple of [`ROUND`].
    fn page(&self) -> usize;
    /// Reserve `size` bytes (a multiple of `page`) of addresses with nothing behind them.
    fn reserve_range(&self, size: usize) -> Option<u64>;
    /// Give back a range from `reserve_range` of exactly `size` bytes, nothing mapped in it.
    fn release_range(&self, address: u64, size: usize);
    /// Put memory behind `size` bytes at `address` (page-aligned, inside a reserved range, not
    /// mapped). `false` when the device refuses (out of memory).
    fn map(&self, address: u64, size: usize) -> bool;
    /// Give back the memory behind a range mapped by `map` (the addresses stay reserved).
    fn unmap(&self, address: u64, size: usize);
}

/// Host memory, zeroed: the `cpu` device. Segments are anonymous mappings: zero pages the
/// kernel commits on first touch, so reserving a large segment costs microseconds, not a
/// memset of every byte (`alloc_zeroed` with page alignment writes the zeros itself).
#[derive(Debug, Default)]
pub struct HostSegments;

impl SegmentSource for HostSegments {
    fn reserve(&self, size: usize) -> Option<u64> {
        // SAFETY: a fresh private anonymous mapping; no existing memory is touched.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return None;
        }
        debug_assert!((ptr as usize).is_multiple_of(SEGMENT_ALIGN));
        Some(ptr as u64)
    }

    fn release(&self, address: u64, size: usize) {
        // SAFETY: mapped by `reserve` with this exact size; the pool holds no live block in it.
        let rc = unsafe { libc::munmap(address as *mut libc::c_void, size) };
        debug_assert_eq!(rc, 0, "munmap of a pool segment");
    }

    fn host_visible(&self) -> bool {
        true
    }

    fn zero_filled(&self) -> bool {
        true
    }
}

/// Host memory with expandable segments (`device.expandable_segments: true` on cpu). The arena is a
/// `PROT_NONE`, `MAP_NORESERVE` mapping (address space only); `map` makes pages readable and
/// writable, `unmap` drops their contents (`MADV_DONTNEED`, so a page mapped again reads as
/// zeros) and closes them again.
#[derive(Debug, Default)]
pub struct HostAddressSpace;

impl SegmentSource for HostAddressSpace {
    fn reserve(&self, size: usize) -> Option<u64> {
        HostSegments.reserve(size)
    }

    fn release(&self, address: u64, size: usize) {
        HostSegments.release(address, size)
    }

    fn host_visible(&self) -> bool {
        true
    }

    fn address_space(&self) -> Option<&dyn AddressSpace> {
        Some(self)
    }

    fn zero_filled(&self) -> bool {
        true
    }
}

impl AddressSpace for HostAddressSpace {
    fn page(&self) -> usize {
        LARGE_ROUND
    }

    fn reserve_range(&self, size: usize) -> Option<u64> {
        // SAFETY: a fresh anonymous mapping with no access; no existing memory is touched.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        (ptr != libc::MAP_FAILED).then_some(ptr as u64)
    }

    fn release_range(&self, address: u64, size: usize) {
        // SAFETY: the whole range came from `reserve_range` with this size; no block is live in it.
        let rc = unsafe { libc::munmap(address as *mut libc::c_void, size) };
        debug_assert_eq!(rc, 0, "munmap of the pool's arena");
    }

    fn map(&self, address: u64, size: usize) -> bool {
        // SAFETY: pages of our own reserved range, holding no live block.
        unsafe { libc::mprotect(address as *mut libc::c_void, size, libc::PROT_READ | libc::PROT_WRITE) == 0 }
    }

    fn unmap(&self, address: u64, size: usize) {
        // SAFETY: pages of our own range that hold no live block: their contents may go.
        unsafe {
            libc::madvise(address as *mut libc::c_void, size, libc::MADV_DONTNEED);
            libc::mprotect(address as *mut libc::c_void, size, libc::PROT_NONE);
        }
    }
}

/// The arena's address span for a pool of `capacity`: four times the capacity (room for holes
/// between live blocks), at most 16 TiB of addresses.
fn arena_span(capacity: usize, page: usize) -> usize {
    round_up(capacity.min(1 << 42).saturating_mul(4).max(page), page)
}

/// The expandable segment: one reserved range (segment `segment` of the pool, whose blocks are
/// carved as any segment's) and which of its pages are mapped.
#[derive(Debug)]
struct Arena {
    segment: usize,
    page: usize,
    mapped: Vec<bool>,
}

#[derive(Debug)]
struct Segment {
    address: u64,
    size: usize,
    small: bool,
    /// Blocks of this segment, keyed by offset: (size, free, category when used).
    blocks: std::collections::BTreeMap<usize, BlockState>,
}

#[derive(Debug, Clone, Copy)]
struct BlockState {
    size: usize,
    category: Option<Category>,
}

/// Free-block index entry, ordered for best fit: smallest size first, then address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct FreeKey {
    size: usize,
    segment: usize,
    offset: usize,
}

struct PoolInner {
    capacity: usize,
    source: Arc<dyn SegmentSource>,
    segments: Vec<Option<Segment>>,
    free_small: BTreeSet<FreeKey>,
    free_large: BTreeSet<FreeKey>,
    stats: MemStats,
    /// Large requests go to the arena (created on first use) when the source can map pages.
    expandable: bool,
    arena: Option<Arena>,
    /// The static allocator (`memory.allocator: static`): off, recording a step, or replaying.
    static_plan: StaticPlan,
}

/// The static allocator's state: see [`Pool::static_begin_step`].
#[derive(Debug, Default)]
enum StaticPlan {
    #[default]
    Off,
    /// Armed: the next step is recorded.
    Armed,
    /// Inside the recorded step: its allocations in order, and the event clock.
    Recording {
        recs: Vec<plan::Rec>,
        clock: u64,
    },
    Replaying(Replay),
    /// The arena did not fit: the caching allocator serves for good.
    Declined,
}

/// A plan being served: the arena (a segment of its own, never in the free lists), the cursor
/// into the step's allocation sequence, and which planned blocks are live.
#[derive(Debug)]
struct Replay {
    plan: plan::Plan,
    segment: usize,
    address: u64,
    cursor: usize,
    live: Vec<bool>,
    in_step: bool,
}

/// How a pool's reservation is used: what defragmentation reports before and after.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct PoolShape {
    pub allocated: usize,
    pub reserved: usize,
    /// Free bytes cached in segments that also hold live blocks: what releasing the cache
    /// cannot give back and compaction can.
    pub stranded: usize,
    pub largest_free_block: usize,
    pub segments: usize,
}

impl PoolShape {
    /// Stranded bytes as a share of the reservation (0 when nothing is reserved).
    pub fn stranded_share(&self) -> f64 {
        if self.reserved == 0 {
            0.0
        } else {
            self.stranded as f64 / self.reserved as f64
        }
    }
}

/// What packing the recorded step gave (`Pool::static_end_step`).
#[derive(Debug, Clone, PartialEq)]
pub struct StaticPlanReport {
    /// Allocations the step made, and how many of them are planned (the rest outlived it).
    pub allocations: usize,
    pub planned: usize,
    pub arena_bytes: usize,
    pub live_peak: usize,
    /// arena / live peak − 1.
    pub fragmentation: f64,
}

/// How a buffer's block was made: the caching allocator (possibly recorded into a static
/// plan), or the plan itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Origin {
    Cached,
    Recorded(u32),
    Planned(u32),
}

// SAFETY: the raw segment pointers are owned by the pool and only handed out as disjoint blocks;
// the inner state is always accessed under the pool's mutex.
unsafe impl Send for PoolInner {}

/// A shared handle to one device's pool. Cheap to clone; buffers keep their pool alive.
#[derive(Clone)]
pub struct Pool {
    inner: Arc<Mutex<PoolInner>>,
    name: Arc<str>,
    host_visible: bool,
}

impl fmt::Debug for Pool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pool").field("device", &self.name).finish()
    }
}

/// The bytes the pool gives (and counts) for one request of `bytes`: at least one
/// [`ROUND`], rounded up to it. The estimator and the backends' workspace declarations size
/// buffers with this same rule.
pub fn block_bytes(bytes: usize) -> usize {
    round_up(bytes.max(1), ROUND)
}

/// [`block_bytes`] summed over a set of requests.
pub fn blocks_bytes(requests: &[usize]) -> usize {
    requests.iter().map(|&b| block_bytes(b)).sum()
}

fn round_up(x: usize, to: usize) -> usize {
    x.div_ceil(to) * to
}

impl Pool {
    /// A pool over `capacity` bytes of host memory for the device called `name`, with fixed
    /// segments.
    pub fn new(name: &str, capacity: usize) -> Pool {
        Pool::with_source(name, capacity, Arc::new(HostSegments))
    }

    /// A pool over `capacity` bytes of host memory, with expandable segments when `expandable`.
    pub fn host(name: &str, capacity: usize, expandable: bool) -> Pool {
        if expandable {
            Pool::with_source(name, capacity, Arc::new(HostAddressSpace))
        } else {
            Pool::new(name, capacity)
        }
    }

    /// Whether large requests are served from an expandable segment.
    pub fn expandable(&self) -> bool {
        self.lock().expandable
    }

    /// A pool over `capacity` bytes whose segments come from `source`.
    pub fn with_source(name: &str, capacity: usize, source: Arc<dyn SegmentSource>) -> Pool {
        let host_visible = source.host_visible();
        Pool {
            host_visible,
            inner: Arc::new(Mutex::new(PoolInner {
                capacity,
                segments: Vec::new(),
                free_small: BTreeSet::new(),
                free_large: BTreeSet::new(),
                stats: MemStats { capacity, ..MemStats::default() },
                expandable: source.address_space().is_some(),
                arena: None,
                static_plan: StaticPlan::Off,
                source,
            })),
            name: name.into(),
        }
    }

    /// Whether the pool's buffers live in host memory (the `cpu` device).
    pub fn host_visible(&self) -> bool {
        self.host_visible
    }

    /// The same pool (capacity, cache, counters) handing out buffers marked host-visible or
    /// not: tests simulate a device whose memory the engine must not read directly.
    #[cfg(test)]
    pub(crate) fn seen_as(&self, host_visible: bool) -> Pool {
        Pool { host_visible, ..self.clone() }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, PoolInner> {
        // A poisoned lock means a panic while holding it; the bookkeeping is still consistent
        // because every mutation completes before any call that could panic.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Reserve a segment of `fraction` of capacity up front (like a framework pre-allocating), so
    /// later large requests are carved from it instead of growing the reservation.
    pub fn prereserve(&self, fraction: f64) -> Result<(), OomError> {
        let mut inner = self.lock();
        let bytes = round_up((inner.capacity as f64 * fraction.clamp(0.0, 1.0)) as usize, LARGE_ROUND);
        if bytes == 0 {
            return Ok(());
        }
        if inner.expandable && inner.arena_segment().is_some() {
            // Map the arena's first pages: later large requests are carved from them.
            return inner.map_arena(0, bytes, bytes, Category::Workspace).map(|_| ());
        }
        let seg = inner.new_segment(bytes, false, Category::Workspace)?;
        let key = FreeKey { size: bytes, segment: seg, offset: 0 };
        inner.free_large.insert(key);
        Ok(())
    }

    /// Allocate `bytes` for `category`. Zero-sized requests get a real (minimum) block too.
    pub fn alloc(&self, bytes: usize, category: Category) -> Result<Buffer, OomError> {
        let size = block_bytes(bytes);
        let mut inner = self.lock();
        let (segment, offset, address, fresh_zero, origin) = match inner.replay_alloc(size, category) {
            Some((index, segment, offset, address)) => (segment, offset, address, false, Origin::Planned(index)),
            None => {
                let (segment, offset, address, fresh) = inner.alloc_block(size, bytes, category)?;
                let fresh_zero = fresh && inner.source.zero_filled();
                let origin = match &mut inner.static_plan {
                    StaticPlan::Recording { recs, clock } => {
                        recs.push(plan::Rec { size, category, alloc_at: *clock, free_at: None });
                        *clock += 1;
                        Origin::Recorded(recs.len() as u32 - 1)
                    }
                    _ => Origin::Cached,
                };
                (segment, offset, address, fresh_zero, origin)
            }
        };
        Ok(Buffer { pool: self.clone(), address, len: bytes, size, segment, offset, category, fresh_zero, origin })
    }

    /// Turn the static allocator on (new segments from now on are sized exactly to their
    /// request, for the model state allocated next): the next step (between `static_begin_step` and
    /// `static_end_step`) is recorded, packed into one arena at its end, and every later step
    /// is served from that plan — each request the one recorded at its position, at its planned
    /// offset, with no search (`MemStats::num_searches` stays put). A request that differs from
    /// the recording (size, category), or whose planned bytes another planned block still
    /// holds, goes to the caching allocator instead (`num_plan_misses`), so a step that changes
    /// shape stays correct. Outside a step (evaluation, checkpoints) the caching allocator serves.
    pub fn static_arm(&self) {
        let mut inner = self.lock();
        if matches!(inner.static_plan, StaticPlan::Off) {
            inner.static_plan = StaticPlan::Armed;
        }
    }

    /// A step starts: recording begins (armed) or the plan's sequence restarts (replaying).
    pub fn static_begin_step(&self) {
        let mut inner = self.lock();
        match &mut inner.static_plan {
            StaticPlan::Armed => inner.static_plan = StaticPlan::Recording { recs: Vec::new(), clock: 0 },
            StaticPlan::Replaying(r) => {
                r.cursor = 0;
                r.in_step = true;
            }
            StaticPlan::Off | StaticPlan::Recording { .. } | StaticPlan::Declined => {}
        }
    }

    /// A step ended. After the recorded one: pack it, give back the cached segments its
    /// blocks came from, reserve the arena, and report the plan.
    pub fn static_end_step(&self) -> Result<Option<StaticPlanReport>, OomError> {
        let mut inner = self.lock();
        if let StaticPlan::Replaying(r) = &mut inner.static_plan {
            r.in_step = false;
            return Ok(None);
        }
        match std::mem::take(&mut inner.static_plan) {
            StaticPlan::Recording { recs, .. } => {
                let packed = plan::pack(&recs);
                let report = StaticPlanReport {
                    allocations: recs.len(),
                    planned: packed.planned(),
                    arena_bytes: packed.arena_bytes,
                    live_peak: packed.live_peak,
                    fragmentation: packed.fragmentation(),
                };
                inner.release_free_segments();
                let bytes = round_up(packed.arena_bytes.max(ROUND), ROUND);
                // The arena is carved from a cached free block big enough (a pre-reserved
                // segment's free part), else it is a segment of its own.
                let (segment, address) = match inner.carve_arena(bytes) {
                    Some(at) => at,
                    None => {
                        let segment = match inner.new_segment(bytes, false, Category::Activations) {
                            Ok(s) => s,
                            Err(e) => {
                                // No room for the arena: the caching allocator goes on serving.
                                inner.static_plan = StaticPlan::Declined;
                                return Err(e);
                            }
                        };
                        let seg = inner.segments[segment].as_mut().expect("new segment");
                        // One block spanning the arena, marked used: never carved, never released.
                        seg.blocks.insert(0, BlockState { size: bytes, category: Some(Category::Activations) });
                        (segment, seg.address)
                    }
                };
                let live = vec![false; packed.entries.len()];
                inner.static_plan =
                    StaticPlan::Replaying(Replay { plan: packed, segment, address, cursor: 0, live, in_step: false });
                Ok(Some(report))
            }
            other => {
                inner.static_plan = other;
                Ok(None)
            }
        }
    }

    /// New homes for `buffers` (this pool's, from the caching allocator) that leave whole
    /// segments without any of them, so that once each buffer's contents are copied to its home
    /// and the old block is dropped, [`Pool::empty_cache`] can give those segments back: the
    /// first half of defragmentation (the engine's `defragment` does the copies). Only
    /// segments whose every live block is among `buffers` can be emptied, and the homes come
    /// from free blocks already reserved. Returns (index into `buffers`, its new home, same
    /// length and category); buffers that stay where they are are not listed.
    pub fn compaction_homes(&self, buffers: &[&Buffer]) -> Vec<(usize, Buffer)> {
        let movable: Vec<(usize, (usize, usize, usize))> = buffers
            .iter()
            .enumerate()
            .filter(|(_, b)| Arc::ptr_eq(&b.pool.inner, &self.inner) && b.origin == Origin::Cached)
            .map(|(i, b)| (i, (b.segment, b.offset, b.size)))
            .collect();
        let at: Vec<(usize, usize, usize)> = movable.iter().map(|&(_, at)| at).collect();
        let moves = self.lock().plan_compaction(&at);
        moves
            .into_iter()
            .map(|(m, segment, offset, address)| {
                let i = movable[m].0;
                let b = buffers[i];
                let home = Buffer {
                    pool: self.clone(),
                    address,
                    len: b.len,
                    size: b.size,
                    segment,
                    offset,
                    category: b.category,
                    fresh_zero: false,
                    origin: Origin::Cached,
                };
                (i, home)
            })
            .collect()
    }

    /// The figures compaction changes, now.
    pub fn shape(&self) -> PoolShape {
        let inner = self.lock();
        PoolShape {
            allocated: inner.stats.allocated(),
            reserved: inner.stats.reserved,
            stranded: inner.stranded(),
            largest_free_block: inner.largest_free_block(),
            segments: inner.stats.num_segments,
        }
    }

    /// Release every cached segment that holds no live block.
    pub fn empty_cache(&self) {
        self.lock().release_free_segments();
    }

    /// A snapshot of the counters, with the largest free block cached in the pool.
    pub fn stats(&self) -> MemStats {
        let inner = self.lock();
        let mut stats = inner.stats.clone();
        stats.largest_free_block = inner.largest_free_block();
        stats
    }

    /// Start a new measurement window: window peaks restart from current usage.
    pub fn reset_window_peaks(&self) {
        self.lock().stats.reset_window();
    }

    /// Tell the pool about bytes held in host memory on the device's behalf (offload targets).
    pub fn set_host_bytes(&self, category: Category, bytes: usize) {
        self.lock().stats.set_host(category, bytes);
    }

    /// A human-readable table like `torch.cuda.memory_summary()`.
    pub fn memory_summary(&self) -> String {
        let inner = self.lock();
        let segments = inner.segments.iter().flatten().count();
        let free_blocks = inner.free_small.len() + inner.free_large.len();
        inner.stats.summary(&self.name, segments, free_blocks)
    }

    fn free(&self, segment: usize, offset: usize, size: usize, category: Category, origin: Origin) {
        let mut inner = self.lock();
        match origin {
            Origin::Planned(i) => inner.replay_free(i as usize, size, category),
            Origin::Recorded(i) => {
                if let StaticPlan::Recording { recs, clock } = &mut inner.static_plan {
                    recs[i as usize].free_at = Some(*clock);
                    *clock += 1;
                }
                inner.free_block(segment, offset, size, category);
            }
            Origin::Cached => inner.free_block(segment, offset, size, category),
        }
    }
}

impl PoolInner {
    /// The next request of a replayed step, from the plan when it is the one recorded there and
    /// its bytes are free: (plan index, segment, offset, address).
    fn replay_alloc(&mut self, size: usize, category: Category) -> Option<(u32, usize, usize, u64)> {
        let StaticPlan::Replaying(r) = &mut self.static_plan else { return None };
        if !r.in_step {
            return None;
        }
        let i = r.cursor;
        r.cursor += 1;
        let served = r.plan.entries.get(i).and_then(|e| {
            let free = e.shares_with.iter().all(|&j| !r.live[j as usize]);
            (e.size == size && e.category == category && !r.live[i] && free).then_some(e.offset).flatten()
        });
        let Some(offset) = served else {
            self.stats.num_plan_misses += 1;
            return None;
        };
        r.live[i] = true;
        let (segment, address) = (r.segment, r.address + offset as u64);
        self.stats.add(category, size);
        self.stats.num_allocs += 1;
        self.stats.num_planned += 1;
        Some((i as u32, segment, offset, address))
    }

    fn replay_free(&mut self, index: usize, size: usize, category: Category) {
        if let StaticPlan::Replaying(r) = &mut self.static_plan {
            r.live[index] = false;
        }
        self.stats.sub(category, size);
        self.stats.num_frees += 1;
    }

    fn new_segment(&mut self, size: usize, small: bool, category: Category) -> Result<usize, OomError> {
        if self.stats.reserved + size > self.capacity {
            // Give back cached segments before failing, like the CUDA allocator's retry.
            self.release_free_segments();
            if self.stats.reserved + size > self.capacity {
                return Err(self.oom(size, category));
            }
        }
        let address = match self.source.reserve(size) {
            Some(a) => a,
            None => {
                // The device itself is full (other processes, fragmentation of the driver's own
                // heap): give back the cache and try once more.
                self.release_free_segments();
                match self.source.reserve(size) {
                    Some(a) => a,
                    None => return Err(self.oom(size, category)),
                }
            }
        };
        let mut blocks = std::collections::BTreeMap::new();
        blocks.insert(0, BlockState { size, category: None });
        let index = self.place_segment(Segment { address, size, small, blocks });
        self.stats.reserved += size;
        self.stats.num_segments += 1;
        self.stats.num_reserves += 1;
        self.stats.bump_reserved_peak();
        Ok(index)
    }

    fn oom(&mut self, requested_bytes: usize, category: Category) -> OomError {
        self.stats.num_ooms += 1;
        OomError { requested_bytes, category, stats: Box::new(self.stats.clone()) }
    }

    /// The arena's segment index, reserving its address range on first use. A source that
    /// refuses the range turns expandable segments off for this pool (fixed segments serve).
    fn arena_segment(&mut self) -> Option<usize> {
        if let Some(arena) = &self.arena {
            return Some(arena.segment);
        }
        let source = self.source.clone();
        let space = source.address_space()?;
        let page = space.page();
        let span = arena_span(self.capacity, page);
        let Some(address) = space.reserve_range(span) else {
            self.expandable = false;
            return None;
        };
        let mut blocks = std::collections::BTreeMap::new();
        blocks.insert(0, BlockState { size: span, category: None });
        let index = self.place_segment(Segment { address, size: span, small: false, blocks });
        self.free_large.insert(FreeKey { size: span, segment: index, offset: 0 });
        self.stats.num_segments += 1;
        self.arena = Some(Arena { segment: index, page, mapped: vec![false; span / page] });
        Some(index)
    }

    /// Map every page of the arena that `offset..offset + len` touches and is not mapped yet,
    /// within capacity: releases the cache first when needed, OOM when it still does not fit.
    /// Returns whether every page of the range was mapped by this call (so none was used before).
    fn map_arena(&mut self, offset: usize, len: usize, requested: usize, category: Category) -> Result<bool, OomError> {
        let arena = self.arena.as_ref().expect("arena reserved before mapping");
        let (page, first, end) = (arena.page, offset / arena.page, (offset + len).div_ceil(arena.page));
        let unmapped = |inner: &PoolInner| {
            let mapped = &inner.arena.as_ref().expect("arena").mapped;
            (first..end).filter(|&p| !mapped[p]).count() * page
        };
        let fresh = unmapped(self) == (end - first) * page;
        if self.stats.reserved + unmapped(self) > self.capacity {
            self.release_free_segments();
            if self.stats.reserved + unmapped(self) > self.capacity {
                return Err(self.oom(requested, category));
            }
        }
        let source = self.source.clone();
        let space = source.address_space().expect("an arena has an address space");
        let mut retried = false;
        let mut p = first;
        while p < end {
            let arena = self.arena.as_mut().expect("arena");
            if arena.mapped[p] {
                p += 1;
                continue;
            }
            let run = (p..end).take_while(|&q| !arena.mapped[q]).count();
            let address = self.segments[arena.segment].as_ref().expect("arena segment").address + (p * page) as u64;
            if !space.map(address, run * page) {
                // The device is full whatever capacity says: give back the cache, try once more.
                if retried {
                    return Err(self.oom(requested, category));
                }
                retried = true;
                self.release_free_segments();
                continue;
            }
            arena.mapped[p..p + run].fill(true);
            self.stats.reserved += run * page;
            self.stats.num_reserves += 1;
            self.stats.bump_reserved_peak();
            p += run;
        }
        Ok(fresh)
    }

    /// The arena's mapped pages that lie wholly inside free blocks, as runs (first page,
    /// pages): what releasing the cache unmaps, and what a request can reuse without growing.
    fn free_mapped_runs(&self) -> Vec<(usize, usize)> {
        let Some(arena) = &self.arena else { return Vec::new() };
        let seg = self.segments[arena.segment].as_ref().expect("arena segment");
        let page = arena.page;
        let mut runs = Vec::new();
        for (&offset, block) in seg.blocks.iter().filter(|(_, b)| b.category.is_none()) {
            let (first, end) = (offset.div_ceil(page), (offset + block.size) / page);
            let mut p = first;
            while p < end {
                let run = (p..end).take_while(|&q| arena.mapped[q]).count();
                if run > 0 {
                    runs.push((p, run));
                }
                p += run.max(1);
            }
        }
        runs
    }

    /// Unmap every mapped arena page that lies wholly inside a free block.
    fn release_arena_pages(&mut self) {
        let runs = self.free_mapped_runs();
        let Some(arena) = self.arena.as_mut() else { return };
        let address = self.segments[arena.segment].as_ref().expect("arena segment").address;
        let space = self.source.address_space().expect("an arena has an address space");
        for (p, run) in runs {
            space.unmap(address + (p * arena.page) as u64, run * arena.page);
            arena.mapped[p..p + run].fill(false);
            self.stats.reserved -= run * arena.page;
        }
    }

    /// Mapped arena bytes wholly inside free blocks: what a request can reuse without the
    /// pool growing (its pages move to wherever the request lands).
    fn arena_cached(&self) -> usize {
        let page = self.arena.as_ref().map_or(0, |a| a.page);
        self.free_mapped_runs().iter().map(|&(_, run)| run * page).sum()
    }

    fn place_segment(&mut self, seg: Segment) -> usize {
        match self.segments.iter().position(Option::is_none) {
            Some(i) => {
                self.segments[i] = Some(seg);
                i
            }
            None => {
                self.segments.push(Some(seg));
                self.segments.len() - 1
            }
        }
    }

    fn alloc_block(
        &mut self,
        size: usize,
        requested: usize,
        category: Category,
    ) -> Result<(usize, usize, u64, bool), OomError> {
        self.stats.num_searches += 1;
        // Under the static allocator every new segment is exactly its first block (the model
        // state's, the recorded step's, then the arena): nothing rounds reserved bytes up.
        let exact = !matches!(self.static_plan, StaticPlan::Off | StaticPlan::Declined);
        let small = size <= SMALL_LIMIT && !exact;
        let arena = if !small && self.expandable { self.arena_segment() } else { None };
        let probe = FreeKey { size, segment: 0, offset: 0 };
        let found = {
            let set = if small { &self.free_small } else { &self.free_large };
            set.range(probe..).next().copied()
        };
        // Whether the block lies in memory no block has used since it was mapped.
        let (key, fresh) = match found {
            Some(k) if arena.is_some() => {
                // Carve from the arena: map the pages the block will use first.
                let used = if k.size - size >= SMALL_LIMIT { size } else { k.size };
                let fresh = self.map_arena(k.offset, used, requested, category)?;
                (k, fresh)
            }
            Some(k) => (k, false),
            // The arena's address span is exhausted by holes: nothing to map into.
            None if arena.is_some() => return Err(self.oom(requested, category)),
            None => {
                let seg_size = match (small, exact) {
                    (true, _) => SMALL_SEGMENT,
                    (false, true) => size,
                    (false, false) => round_up(size, LARGE_ROUND),
                };
                let seg = self.new_segment(seg_size, small, category).map_err(|mut e| {
                    e.requested_bytes = requested;
                    e
                })?;
                (FreeKey { size: seg_size, segment: seg, offset: 0 }, true)
            }
        };
        let address = self.take_block(key, small, size, category);
        Ok((key.segment, key.offset, address, fresh))
    }

    /// Use free block `key` (in the small or large free set) for a request of `size` bytes:
    /// split off the remainder when it is worth keeping, count the request. Its address.
    fn take_block(&mut self, key: FreeKey, small: bool, size: usize, category: Category) -> u64 {
        let set = if small { &mut self.free_small } else { &mut self.free_large };
        set.remove(&key);
        let seg = self.segments[key.segment].as_mut().expect("live segment");
        // Split when the remainder is worth keeping as its own block.
        let remainder = key.size - size;
        let split_threshold = if small { ROUND } else { SMALL_LIMIT };
        let used = if remainder >= split_threshold {
            let rest = FreeKey { size: remainder, segment: key.segment, offset: key.offset + size };
            seg.blocks.insert(rest.offset, BlockState { size: remainder, category: None });
            set.insert(rest);
            size
        } else {
            key.size
        };
        seg.blocks.insert(key.offset, BlockState { size: used, category: Some(category) });
        // offset + used <= segment size by construction of the block map.
        let address = seg.address + key.offset as u64;
        // Allocated counts the rounded request; an unsplit tail shows up as fragmentation.
        self.stats.add(category, size);
        self.stats.num_allocs += 1;
        address
    }

    /// The best-fitting free block of `set` for `size` bytes in a segment that holds a live
    /// block (moving into a wholly free segment would only trade one segment for another).
    fn home_in(&self, set: &BTreeSet<FreeKey>, size: usize) -> Option<FreeKey> {
        set.range(FreeKey { size, segment: 0, offset: 0 }..).copied().find(|k| {
            let seg = self.segments[k.segment].as_ref().expect("live segment");
            seg.blocks.values().any(|b| b.category.is_some())
        })
    }

    /// The static plan's arena of `bytes` as a block of a cached free block (best fit, the
    /// expandable arena excepted), marked used but counted in no category (the planned
    /// requests are): (segment, address), or `None` when no free block is big enough.
    fn carve_arena(&mut self, bytes: usize) -> Option<(usize, u64)> {
        let arena = self.arena.as_ref().map(|a| a.segment);
        let key = self
            .free_large
            .range(FreeKey { size: bytes, segment: 0, offset: 0 }..)
            .copied()
            .find(|k| Some(k.segment) != arena)?;
        self.free_large.remove(&key);
        let seg = self.segments[key.segment].as_mut().expect("live segment");
        if key.size > bytes {
            let rest = FreeKey { size: key.size - bytes, segment: key.segment, offset: key.offset + bytes };
            seg.blocks.insert(rest.offset, BlockState { size: rest.size, category: None });
            self.free_large.insert(rest);
        }
        seg.blocks.insert(key.offset, BlockState { size: bytes, category: Some(Category::Activations) });
        Some((key.segment, seg.address + key.offset as u64))
    }

    /// Free bytes in segments that also hold live blocks: the cache a release cannot give
    /// back, which compaction can (the arena's and the static plan's segments left out).
    fn stranded(&self) -> usize {
        let fixed = self.fixed_segments();
        fixed
            .iter()
            .map(|&i| {
                let seg = self.segments[i].as_ref().expect("live segment");
                let free: usize = seg.blocks.values().filter(|b| b.category.is_none()).map(|b| b.size).sum();
                if free == seg.size {
                    0
                } else {
                    free
                }
            })
            .sum()
    }

    /// The segments compaction may empty or fill: every live one but the arena and the static
    /// plan's.
    fn fixed_segments(&self) -> Vec<usize> {
        let arena = self.arena.as_ref().map(|a| a.segment);
        let plan = match &self.static_plan {
            StaticPlan::Replaying(r) => Some(r.segment),
            _ => None,
        };
        (0..self.segments.len())
            .filter(|&i| self.segments[i].is_some() && Some(i) != arena && Some(i) != plan)
            .collect()
    }

    /// New homes for movable blocks (given as (segment, offset, request size)), so that whole
    /// segments hold none of them: segments whose live blocks are all movable are tried
    /// emptiest first; each of their blocks, largest first, gets the best-fitting free block
    /// of the same kind (small or large) for its request in a segment that holds live blocks
    /// and is neither being emptied nor was emptied; a segment whose blocks do not all fit
    /// keeps them (a dry run decides before anything is carved), and one that received blocks
    /// is not emptied afterwards. No new segment is reserved. The homes are counted as
    /// allocated from here on: (index into `movable`, segment, offset, address).
    fn plan_compaction(&mut self, movable: &[(usize, usize, usize)]) -> Vec<(usize, usize, usize, u64)> {
        let index: std::collections::HashMap<(usize, usize), (usize, usize)> =
            movable.iter().enumerate().map(|(i, &(seg, off, size))| ((seg, off), (i, size))).collect();
        let mut candidates: Vec<(usize, usize)> = self
            .fixed_segments()
            .into_iter()
            .filter_map(|i| {
                let seg = self.segments[i].as_ref().expect("live segment");
                let used: Vec<(&usize, &BlockState)> =
                    seg.blocks.iter().filter(|(_, b)| b.category.is_some()).collect();
                let all_movable = !used.is_empty() && used.iter().all(|(&off, _)| index.contains_key(&(i, off)));
                all_movable.then(|| (used.iter().map(|(_, b)| b.size).sum(), i))
            })
            .collect();
        candidates.sort();
        // Segments being emptied (their free blocks out of the free sets until the end) and
        // those that received blocks.
        let mut closed: Vec<(usize, Vec<FreeKey>)> = Vec::new();
        let mut receivers = std::collections::HashSet::new();
        let mut moves = Vec::new();
        for (_, s) in candidates {
            if receivers.contains(&s) {
                continue;
            }
            let seg = self.segments[s].as_ref().expect("live segment");
            let small = seg.small;
            let free: Vec<FreeKey> = seg
                .blocks
                .iter()
                .filter(|(_, b)| b.category.is_none())
                .map(|(&offset, b)| FreeKey { size: b.size, segment: s, offset })
                .collect();
            // (offset, request size, category): a home needs the request, not an unsplit tail.
            let mut blocks: Vec<(usize, usize, Category)> =
                seg.blocks.iter().filter_map(|(&o, b)| b.category.map(|c| (o, index[&(s, o)].1, c))).collect();
            blocks.sort_by_key(|&(o, size, _)| (std::cmp::Reverse(size), o));
            let set = if small { &mut self.free_small } else { &mut self.free_large };
            for k in &free {
                set.remove(k);
            }
            // A dry run on a copy of the free set first, so a segment that cannot be emptied
            // leaves no trace; then the same choices for real.
            let mut trial = if small { self.free_small.clone() } else { self.free_large.clone() };
            let split_threshold = if small { ROUND } else { SMALL_LIMIT };
            let fits = blocks.iter().all(|&(_, size, _)| {
                let Some(key) = self.home_in(&trial, size) else {
                    return false;
                };
                trial.remove(&key);
                if key.size - size >= split_threshold {
                    trial.insert(FreeKey { size: key.size - size, segment: key.segment, offset: key.offset + size });
                }
                true
            });
            if !fits {
                let set = if small { &mut self.free_small } else { &mut self.free_large };
                set.extend(free);
                continue;
            }
            for &(offset, size, category) in &blocks {
                let key = self.home_in(if small { &self.free_small } else { &self.free_large }, size).expect("dry run");
                let address = self.take_block(key, small, size, category);
                receivers.insert(key.segment);
                moves.push((index[&(s, offset)].0, key.segment, key.offset, address));
            }
            closed.push((s, free));
        }
        for (s, free) in closed {
            let set = if self.segments[s].as_ref().expect("live segment").small {
                &mut self.free_small
            } else {
                &mut self.free_large
            };
            set.extend(free);
        }
        moves
    }

    fn free_block(&mut self, segment: usize, offset: usize, size: usize, category: Category) {
        let seg = self.segments[segment].as_mut().expect("live segment");
        let state = seg.blocks.get(&offset).copied().expect("live block");
        self.stats.sub(category, size);
        self.stats.num_frees += 1;
        let small = seg.small;
        let set = if small { &mut self.free_small } else { &mut self.free_large };
        let mut start = offset;
        let mut size = state.size;
        debug_assert!(state.category == Some(category));
        // Coalesce with the previous block if free.
        if let Some((&prev_off, &prev)) = seg.blocks.range(..offset).next_back() {
            if prev.category.is_none() {
                set.remove(&FreeKey { size: prev.size, segment, offset: prev_off });
                seg.blocks.remove(&offset);
                start = prev_off;
                size += prev.size;
            }
        }
        // Coalesce with the next block if free.
        let next_off = offset + state.size;
        if let Some(&next) = seg.blocks.get(&next_off) {
            if next.category.is_none() {
                set.remove(&FreeKey { size: next.size, segment, offset: next_off });
                seg.blocks.remove(&next_off);
                size += next.size;
            }
        }
        seg.blocks.insert(start, BlockState { size, category: None });
        set.insert(FreeKey { size, segment, offset: start });
    }

    /// The largest free block: what one more request can get without a new segment (with the
    /// cached total, `reserved − allocated`, it tells fragmentation from a full pool).
    /// With expandable segments, the arena's part is its reusable mapped bytes ([`Self::arena_cached`]):
    /// its free address space is unbounded, its free memory is not.
    fn largest_free_block(&self) -> usize {
        let small = self.free_small.last().map_or(0, |k| k.size);
        let large = match &self.arena {
            Some(_) => self.arena_cached(),
            None => self.free_large.last().map_or(0, |k| k.size),
        };
        small.max(large)
    }

    fn release_free_segments(&mut self) {
        self.release_arena_pages();
        let arena = self.arena.as_ref().map(|a| a.segment);
        for index in (0..self.segments.len()).filter(|&i| Some(i) != arena) {
            let whole_free = match &self.segments[index] {
                Some(seg) => seg.blocks.len() == 1 && seg.blocks.get(&0).is_some_and(|b| b.category.is_none()),
                None => false,
            };
            if !whole_free {
                continue;
            }
            let seg = self.segments[index].take().expect("checked above");
            let set = if seg.small { &mut self.free_small } else { &mut self.free_large };
            set.remove(&FreeKey { size: seg.size, segment: index, offset: 0 });
            self.source.release(seg.address, seg.size);
            self.stats.reserved -= seg.size;
            self.stats.num_segments -= 1;
        }
    }
}

impl Drop for PoolInner {
    fn drop(&mut self) {
        // Every buffer holds an Arc to the pool, so no block outlives this drop.
        self.release_arena_pages();
        if let Some(arena) = self.arena.take() {
            let seg = self.segments[arena.segment].take().expect("arena segment");
            let space = self.source.address_space().expect("an arena has an address space");
            space.release_range(seg.address, seg.size);
        }
        for seg in self.segments.drain(..).flatten() {
            self.source.release(seg.address, seg.size);
        }
    }
}

/// One live block of device memory. Not `Clone`: a buffer is owned once and freed on drop.
pub struct Buffer {
    pool: Pool,
    /// Host pointer or device address of the first byte.
    address: u64,
    /// Requested length in bytes (the block may be larger).
    len: usize,
    /// Rounded size of the request.
    size: usize,
    segment: usize,
    offset: usize,
    category: Category,
    /// Carved from memory that reads as zeros and that no block used before.
    fresh_zero: bool,
    origin: Origin,
}

// SAFETY: a Buffer is the unique owner of its block; access goes through &self / &mut self.
unsafe impl Send for Buffer {}
unsafe impl Sync for Buffer {}

impl fmt::Debug for Buffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Buffer").field("len", &self.len).field("category", &self.category).finish()
    }
}

impl Buffer {
    /// The bytes, for a buffer in host memory. Panics for device memory: that is a bug in the
    /// caller (device buffers are read through the backend's copies), not a runtime condition.
    pub fn bytes(&self) -> &[u8] {
        assert!(self.pool.host_visible, "host read of a device buffer on {}", self.pool.name);
        // SAFETY: address..address+len lies inside this buffer's block in host memory, which
        // nobody else references.
        unsafe { std::slice::from_raw_parts(self.address as *const u8, self.len) }
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        assert!(self.pool.host_visible, "host write of a device buffer on {}", self.pool.name);
        // SAFETY: as above, and &mut self guarantees exclusivity.
        unsafe { std::slice::from_raw_parts_mut(self.address as *mut u8, self.len) }
    }

    /// Requested length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Address of the first byte: a host pointer, or a device pointer for a device pool.
    pub fn address(&self) -> u64 {
        self.address
    }

    /// Whether the buffer lives in host memory.
    pub fn host_visible(&self) -> bool {
        self.pool.host_visible
    }

    /// Whether the buffer was carved from memory that reads as zeros and no block had used
    /// (a fresh host segment or freshly mapped pages): it needs no zeroing before its first
    /// write. Says nothing once the holder has written it.
    pub fn fresh_zero(&self) -> bool {
        self.fresh_zero
    }

    /// View as a slice of plain-old-data elements (f32, bf16, u16...).
    pub fn as_slice<T: bytemuck::Pod>(&self) -> &[T] {
        bytemuck::cast_slice(self.bytes())
    }

    pub fn as_mut_slice<T: bytemuck::Pod>(&mut self) -> &mut [T] {
        bytemuck::cast_slice_mut(self.bytes_mut())
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        self.pool.free(self.segment, self.offset, self.size, self.category, self.origin);
    }
}
