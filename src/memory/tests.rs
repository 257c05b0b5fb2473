//! Unit tests of the caching pool's bookkeeping.

use super::*;

const MIB: usize = 1 << 20;

#[test]
fn categories_sum_to_allocated_and_peak_is_max_held() {
    let pool = Pool::new("cpu", 64 * MIB);
    let a = pool.alloc(3 * MIB, Category::Params).unwrap();
    let b = pool.alloc(1000, Category::Activations).unwrap();
    let c = pool.alloc(5 * MIB + 7, Category::Workspace).unwrap();
    let s = pool.stats();
    let sum: usize = Category::ALL.iter().map(|&c| s.current(c)).sum();
    assert_eq!(sum, s.allocated());
    assert!(s.current(Category::Activations) >= 1000);
    let peak_before = s.peak_allocated;
    drop(c);
    let s = pool.stats();
    assert_eq!(s.peak_allocated, peak_before, "peak survives a free");
    assert!(s.allocated() < peak_before);
    assert_eq!(s.peak(Category::Workspace), round(5 * MIB + 7));
    assert_eq!(s.current(Category::Workspace), 0);
    drop((a, b));
    assert_eq!(pool.stats().allocated(), 0);
}

fn round(x: usize) -> usize {
    x.div_ceil(ROUND) * ROUND
}

#[test]
fn freed_blocks_are_reused_without_growing_reservation() {
    let pool = Pool::new("cpu", 64 * MIB);
    let a = pool.alloc(8 * MIB, Category::Activations).unwrap();
    let reserved = pool.stats().reserved;
    drop(a);
    assert_eq!(pool.stats().reserved, reserved, "freed block stays cached");
    let b = pool.alloc(8 * MIB, Category::Activations).unwrap();
    assert_eq!(pool.stats().reserved, reserved, "cached block reused");
    drop(b);
    // Small blocks share a segment.
    let smalls: Vec<_> = (0..16).map(|_| pool.alloc(4096, Category::Workspace).unwrap()).collect();
    let s = pool.stats();
    assert_eq!(s.reserved, reserved + SMALL_SEGMENT);
    drop(smalls);
    pool.empty_cache();
    assert_eq!(pool.stats().reserved, 0);
}

#[test]
fn split_blocks_coalesce_on_free() {
    let pool = Pool::new("cpu", 64 * MIB);
    pool.prereserve(0.5).unwrap();
    assert_eq!(pool.stats().reserved, 32 * MIB);
    let a = pool.alloc(10 * MIB, Category::Params).unwrap();
    let b = pool.alloc(10 * MIB, Category::Grads).unwrap();
    let c = pool.alloc(10 * MIB, Category::Optimizer).unwrap();
    assert_eq!(pool.stats().reserved, 32 * MIB, "carved from the pre-reserved segment");
    drop(b);
    drop(a);
    drop(c);
    // Everything coalesced back: a 30 MiB request fits without a new segment.
    let d = pool.alloc(30 * MIB, Category::Activations).unwrap();
    assert_eq!(pool.stats().reserved, 32 * MIB);
    drop(d);
}

#[test]
fn exceeding_capacity_is_a_typed_oom_after_releasing_cache() {
    let pool = Pool::new("cpu", 16 * MIB);
    let a = pool.alloc(6 * MIB, Category::Params).unwrap();
    let cached = pool.alloc(6 * MIB, Category::Workspace).unwrap();
    drop(cached);
    // 8 MiB does not fit next to a 6 MiB live block and a 6 MiB cached one, unless the cache goes.
    let b = pool.alloc(8 * MIB, Category::Activations).expect("cache released to make room");
    let err = pool.alloc(4 * MIB, Category::Grads).unwrap_err();
    assert_eq!(err.category, Category::Grads);
    assert_eq!(err.requested_bytes, 4 * MIB);
    assert_eq!(err.stats.num_ooms, 1);
    assert!(err.to_string().contains("grads"));
    drop((a, b));
    let summary = pool.memory_summary();
    assert!(summary.contains("ooms") && summary.contains("activations"), "{summary}");
}

#[test]
fn window_peaks_restart() {
    let pool = Pool::new("cpu", 16 * MIB);
    let a = pool.alloc(4 * MIB, Category::Activations).unwrap();
    drop(a);
    pool.reset_window_peaks();
    let s = pool.stats();
    assert_eq!(s.window_peak[3], 0);
    assert_eq!(s.peak(Category::Activations), 4 * MIB);
}

/// The window's composition at its allocated peak sums to that peak, unlike the per-category
/// window peaks, which come from different moments.
#[test]
fn the_composition_at_the_peak_sums_to_the_peak() {
    let pool = Pool::new("cpu", 64 * MIB);
    pool.reset_window_peaks();
    let w = pool.alloc(2 * MIB, Category::Workspace).unwrap();
    drop(w); // workspace peaked at 2 MiB, alone
    let a = pool.alloc(4 * MIB, Category::Activations).unwrap();
    let g = pool.alloc(3 * MIB, Category::Grads).unwrap(); // the peak: 4 + 3
    drop(a);
    let s = pool.stats();
    assert_eq!(s.window_peak_allocated, 7 * MIB);
    assert_eq!(s.window_peak.iter().sum::<usize>(), 9 * MIB, "per-category peaks overstate");
    assert_eq!(s.window_at_peak, [0, 3 * MIB, 0, 4 * MIB, 0, 0]);
    assert_eq!(s.window_at_peak.iter().sum::<usize>(), s.window_peak_allocated);
    assert!(s.window_reserved_at_peak >= 7 * MIB && s.window_reserved_at_peak <= s.window_peak_reserved);
    pool.reset_window_peaks();
    assert_eq!(pool.stats().window_at_peak, [0, 3 * MIB, 0, 0, 0, 0], "a new window starts from what is live");
    drop(g);
}

#[test]
fn sizes_parse_and_reject() {
    assert_eq!(parse_bytes("512MiB").unwrap(), 512 * MIB);
    assert_eq!(parse_bytes("1.5 GiB").unwrap(), 3 * 512 * MIB);
    assert_eq!(parse_bytes("300MB").unwrap(), 300_000_000);
    assert!(parse_bytes("lots").is_err());
    assert!(parse_bytes("5 parsecs").is_err());
    assert!(parse_bytes("0").is_err());
}

#[test]
fn unsplit_tail_counts_as_fragmentation_not_allocation() {
    let pool = Pool::new("cpu", 64 * MIB);
    // 5 MiB + 7 lives in a 6 MiB segment; the < 1 MiB tail is not worth splitting off.
    let a = pool.alloc(5 * MIB + 7, Category::Workspace).unwrap();
    let s = pool.stats();
    assert_eq!(s.allocated(), round(5 * MIB + 7));
    assert_eq!(s.reserved, 6 * MIB);
    assert_eq!(s.fragmentation(), 6 * MIB - round(5 * MIB + 7));
    drop(a);
}

/// A device that refuses reservations beyond `limit` bytes whatever the pool's capacity says
/// (as cuMemAlloc does when other processes hold memory), backed by host memory.
struct LimitedDevice {
    limit: usize,
    held: std::sync::Mutex<usize>,
}

impl SegmentSource for LimitedDevice {
    fn reserve(&self, size: usize) -> Option<u64> {
        let mut held = self.held.lock().unwrap();
        if *held + size > self.limit {
            return None;
        }
        *held += size;
        HostSegments.reserve(size)
    }
    fn release(&self, address: u64, size: usize) {
        *self.held.lock().unwrap() -= size;
        HostSegments.release(address, size)
    }
    fn host_visible(&self) -> bool {
        true
    }
}

#[test]
fn a_refusing_device_is_an_oom_after_the_cache_is_released() {
    let device = std::sync::Arc::new(LimitedDevice { limit: 12 * MIB, held: Default::default() });
    let pool = Pool::with_source("cuda:0", 64 * MIB, device.clone());
    // 8 MiB cached, then a 10 MiB request: the device refuses, the pool gives back the cached
    // segment and the retry succeeds.
    drop(pool.alloc(8 * MIB, Category::Activations).unwrap());
    assert_eq!(pool.stats().reserved, 8 * MIB);
    let a = pool.alloc(10 * MIB, Category::Params).unwrap();
    assert_eq!(pool.stats().reserved, 10 * MIB, "cached segment released for the retry");
    // Nothing cached left to give back: a typed OOM, well under `capacity`.
    let err = pool.alloc(4 * MIB, Category::Activations).unwrap_err();
    assert_eq!(err.requested_bytes, 4 * MIB);
    assert_eq!(err.category, Category::Activations);
    assert_eq!(err.stats.capacity, 64 * MIB);
    assert_eq!(pool.stats().num_ooms, 1);
    drop(a);
    drop(pool);
    assert_eq!(*device.held.lock().unwrap(), 0, "every segment given back to the device");
}

/// A source whose addresses are not host memory.
struct OpaqueDevice;

impl SegmentSource for OpaqueDevice {
    fn reserve(&self, _size: usize) -> Option<u64> {
        Some(0x7000_0000_0000)
    }
    fn release(&self, _address: u64, _size: usize) {}
    fn host_visible(&self) -> bool {
        false
    }
}

#[test]
fn device_buffers_carry_addresses_and_refuse_host_reads() {
    let pool = Pool::with_source("cuda:0", 64 * MIB, std::sync::Arc::new(OpaqueDevice));
    let a = pool.alloc(1000, Category::Params).unwrap();
    let b = pool.alloc(1000, Category::Params).unwrap();
    assert!(!a.host_visible());
    assert_eq!(a.address(), 0x7000_0000_0000);
    assert_eq!(b.address(), a.address() + round(1000) as u64, "blocks carved from one small segment");
    let read = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| a.bytes().len()));
    assert!(read.is_err(), "a host read of device memory is refused");
}

#[test]
fn the_largest_free_block_is_reported_with_the_cache() {
    let pool = Pool::new("cpu", 64 * MIB);
    let a = pool.alloc(10 * MIB, Category::Params).unwrap();
    let b = pool.alloc(20 * MIB, Category::Workspace).unwrap();
    assert_eq!(pool.stats().largest_free_block, 0);
    drop(b);
    let s = pool.stats();
    assert_eq!((s.largest_free_block, s.reserved - s.allocated()), (20 * MIB, 20 * MIB));
    drop(a);
    assert_eq!(pool.stats().largest_free_block, 20 * MIB, "free blocks of separate segments never merge");
}

/// The allocation pattern of a step that reuses a cached activation block for a long-lived
/// one: the remainder is stranded in that segment under fixed segments, and the next request
/// fails although 5 MiB of the 16 are free. Expandable segments serve it.
fn stranded_remainder_pattern(pool: &Pool) -> (Result<Buffer, OomError>, Vec<Buffer>) {
    drop(pool.alloc(8 * MIB, Category::Activations).unwrap());
    let params = pool.alloc(5 * MIB, Category::Params).unwrap();
    let grads = pool.alloc(6 * MIB, Category::Grads).unwrap();
    (pool.alloc(7 * MIB / 2, Category::Activations), vec![params, grads])
}

#[test]
fn expandable_segments_serve_what_fixed_segments_strand() {
    let fixed = Pool::host("cpu", 16 * MIB, false);
    let (result, _live) = stranded_remainder_pattern(&fixed);
    let err = result.expect_err("fixed segments strand the free bytes");
    let s = &err.stats;
    assert_eq!((s.allocated(), s.reserved), (11 * MIB, 14 * MIB), "5 MiB free in total, 3 MiB largest");
    assert_eq!(fixed.stats().largest_free_block, 3 * MIB);

    let expandable = Pool::host("cpu", 16 * MIB, true);
    assert!(expandable.expandable());
    let (result, _live) = stranded_remainder_pattern(&expandable);
    let block = result.expect("expandable segments map the free bytes where the request lands");
    let s = expandable.stats();
    assert_eq!((s.allocated(), s.reserved), (11 * MIB + 7 * MIB / 2, 16 * MIB));
    // The memory is real host memory: written and read back.
    let mut block = block;
    block.as_mut_slice::<u32>().iter_mut().enumerate().for_each(|(i, x)| *x = i as u32);
    assert_eq!(block.as_slice::<u32>()[12345], 12345);
}

#[test]
fn expandable_segments_map_pages_on_demand_and_release_them() {
    let pool = Pool::host("cpu", 64 * MIB, true);
    let a = pool.alloc(3 * MIB, Category::Params).unwrap();
    let b = pool.alloc(3 * MIB, Category::Params).unwrap();
    // Packed back to back: 6 MiB over three 2 MiB pages, not two 4 MiB segments.
    assert_eq!(pool.stats().reserved, 6 * MIB);
    assert_eq!(b.address(), a.address() + 3 * MIB as u64);
    drop(a);
    let s = pool.stats();
    assert_eq!(s.reserved, 6 * MIB, "freed pages stay cached");
    // Only the page wholly inside the freed block is reusable memory (the second is shared with b).
    assert_eq!(s.largest_free_block, 2 * MIB);
    pool.empty_cache();
    assert_eq!(pool.stats().reserved, 4 * MIB, "the free page went back; b's two pages stay");
    // A page mapped again reads as zeros.
    let c = pool.alloc(2 * MIB, Category::Activations).unwrap();
    assert!(c.as_slice::<u8>().iter().all(|&x| x == 0));
    drop((b, c));
    pool.empty_cache();
    assert_eq!(pool.stats().reserved, 0);
    // Small requests keep their small segments.
    let small = pool.alloc(4096, Category::Workspace).unwrap();
    assert_eq!(pool.stats().reserved, SMALL_SEGMENT);
    drop(small);
}

#[test]
fn expandable_segments_keep_capacity_and_report_a_typed_oom() {
    let pool = Pool::host("cpu", 16 * MIB, true);
    let a = pool.alloc(6 * MIB, Category::Params).unwrap();
    drop(pool.alloc(6 * MIB, Category::Workspace).unwrap());
    // The cached 6 MiB is unmapped to make room, as with fixed segments.
    let b = pool.alloc(8 * MIB, Category::Activations).expect("cache released to make room");
    assert!(pool.stats().reserved <= 16 * MIB);
    let err = pool.alloc(4 * MIB, Category::Grads).unwrap_err();
    assert_eq!((err.category, err.requested_bytes, err.stats.num_ooms), (Category::Grads, 4 * MIB, 1));
    drop((a, b));
    pool.empty_cache();
    pool.prereserve(0.5).unwrap();
    assert_eq!(pool.stats().reserved, 8 * MIB, "prereserve maps the arena's first pages");
}

/// Host address space that refuses to map beyond `limit` bytes (another process holds the rest).
struct LimitedSpace {
    limit: usize,
    mapped: std::sync::Mutex<usize>,
}

impl SegmentSource for LimitedSpace {
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
}

impl AddressSpace for LimitedSpace {
    fn page(&self) -> usize {
        HostAddressSpace.page()
    }
    fn reserve_range(&self, size: usize) -> Option<u64> {
        HostAddressSpace.reserve_range(size)
    }
    fn release_range(&self, address: u64, size: usize) {
        assert_eq!(*self.mapped.lock().unwrap(), 0, "the range is released with nothing mapped");
        HostAddressSpace.release_range(address, size)
    }
    fn map(&self, address: u64, size: usize) -> bool {
        let mut mapped = self.mapped.lock().unwrap();
        if *mapped + size > self.limit {
            return false;
        }
        *mapped += size;
        HostAddressSpace.map(address, size)
    }
    fn unmap(&self, address: u64, size: usize) {
        *self.mapped.lock().unwrap() -= size;
        HostAddressSpace.unmap(address, size)
    }
}

#[test]
fn a_refusing_device_with_expandable_segments_releases_cache_then_ooms() {
    let space = std::sync::Arc::new(LimitedSpace { limit: 12 * MIB, mapped: Default::default() });
    let pool = Pool::with_source("cuda:0", 64 * MIB, space.clone());
    drop(pool.alloc(8 * MIB, Category::Activations).unwrap());
    let a = pool.alloc(10 * MIB, Category::Params).expect("cached pages unmapped for the retry");
    assert!(*space.mapped.lock().unwrap() <= 12 * MIB);
    assert!(pool.alloc(4 * MIB, Category::Activations).is_err());
    drop(a);
    drop(pool);
    assert_eq!(*space.mapped.lock().unwrap(), 0, "every page given back");
}

#[test]
fn only_never_used_zero_memory_is_handed_out_as_fresh_zero() {
    for expandable in [false, true] {
        let pool = Pool::host("cpu", 64 * MIB, expandable);
        let mut a = pool.alloc(4 * MIB, Category::Optimizer).unwrap();
        assert!(a.fresh_zero(), "expandable {expandable}: a new segment or newly mapped pages");
        assert!(a.as_slice::<u32>().iter().all(|&x| x == 0));
        a.as_mut_slice::<u32>().fill(7);
        drop(a);
        // The same bytes again, from the cache: they hold what the last holder wrote.
        let b = pool.alloc(4 * MIB, Category::Optimizer).unwrap();
        assert!(!b.fresh_zero(), "expandable {expandable}: a reused block");
        assert!(b.as_slice::<u32>().contains(&7));
        drop(b);
        // Released to the OS and taken again: zero pages once more.
        pool.empty_cache();
        let c = pool.alloc(4 * MIB, Category::Optimizer).unwrap();
        assert!(c.fresh_zero(), "expandable {expandable}: after the cache was released");
        assert!(c.as_slice::<u32>().iter().all(|&x| x == 0));
    }
    // A device whose fresh memory is not known to be zero never says so.
    let device = Pool::with_source("cuda:0", 64 * MIB, std::sync::Arc::new(OpaqueDevice));
    assert!(!device.alloc(4 * MIB, Category::Optimizer).unwrap().fresh_zero());
}

/// The static allocator at the pool: a step recorded, then replayed at the same addresses with
/// no search; a request that differs from the recording, or whose planned bytes a block kept
/// from the last step still holds, is served by the caching allocator instead (counted), never
/// at an address a live block uses.
#[test]
fn a_static_plan_replays_its_step_and_falls_back_when_the_step_differs() {
    let pool = Pool::new("cpu", 64 * MIB);
    pool.static_arm();
    let step = |pool: &Pool, keep_last: bool| -> (Vec<u64>, Option<Buffer>) {
        pool.static_begin_step();
        let a = pool.alloc(2 * MIB, Category::Activations).unwrap();
        let b = pool.alloc(MIB, Category::Workspace).unwrap();
        let addrs = vec![a.address(), b.address()];
        drop(b);
        let c = pool.alloc(MIB, Category::Workspace).unwrap(); // may reuse b's bytes
        let mut addrs = addrs;
        addrs.push(c.address());
        drop(c);
        (addrs, if keep_last { Some(a) } else { None })
    };
    let (first, _) = step(&pool, false);
    let report = pool.static_end_step().unwrap().expect("the recorded step is packed");
    assert_eq!((report.allocations, report.planned), (3, 3));
    assert_eq!(report.arena_bytes, 3 * MIB, "b and c share bytes: 2 + 1 MiB");
    assert_eq!(report.fragmentation, 0.0);
    let _ = first;
    let searches = pool.stats().num_searches;
    let (second, _) = step(&pool, false);
    pool.static_end_step().unwrap();
    let (third, kept) = step(&pool, true);
    pool.static_end_step().unwrap();
    assert_eq!(second, third, "the same planned addresses every step");
    assert_eq!(second[1], second[2], "c takes b's planned bytes");
    assert_eq!(pool.stats().num_searches, searches, "no search while replaying");
    assert_eq!(pool.stats().num_planned, 6);
    // `a` kept into the next step: the next step's `a` cannot have its planned bytes.
    let kept = kept.unwrap();
    pool.static_begin_step();
    let a2 = pool.alloc(2 * MIB, Category::Activations).unwrap();
    assert_ne!(a2.address(), kept.address(), "never two live blocks at one address");
    // A request the recording did not have at this position: the caching allocator serves it.
    let odd = pool.alloc(3 * MIB, Category::Workspace).unwrap();
    let s = pool.stats();
    assert_eq!(s.num_plan_misses, 2, "the held bytes, then the odd request");
    assert_eq!(s.num_searches, searches + 2);
    drop((a2, odd, kept));
    pool.static_end_step().unwrap();
    assert_eq!(pool.stats().allocated(), 0, "every block given back, planned or not");
}
