//! Defragmentation: persistent buffers moved out of sparsely used segments (`Pool::
//! compaction_homes` picks the homes, the backend copies on the device), then every wholly
//! free segment given back — cache that a plain release cannot free because a long-lived
//! block pins its segment. Run at a checkpoint when the stranded share is above the job's
//! threshold, or on the `defragment` control line.

use serde::Serialize;

use crate::engine::backend::{Backend, BackendResult, View, ViewMut};
use crate::memory::{Buffer, PoolShape};

/// What one defragmentation did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Defragmentation {
    pub moved_buffers: usize,
    pub moved_bytes: usize,
    pub before: PoolShape,
    pub after: PoolShape,
}

/// Move what `Pool::compaction_homes` finds a home for (each buffer's contents copied there,
/// the buffer re-pointed, its old block freed), then release every wholly free segment.
/// Buffers keep their contents; views into them must not be held across the call.
pub fn defragment<B: Backend>(be: &B, buffers: &mut [&mut Buffer]) -> BackendResult<Defragmentation> {
    let pool = be.pool();
    let before = pool.shape();
    let homes = {
        let shared: Vec<&Buffer> = buffers.iter().map(|b| &**b).collect();
        pool.compaction_homes(&shared)
    };
    let (mut moved_buffers, mut moved_bytes) = (0, 0);
    for (i, mut home) in homes {
        be.copy::<u8>(ViewMut::of(&mut home), View::of(buffers[i]))?;
        std::mem::swap(buffers[i], &mut home);
        // `home` is now the old block: freed here (later device work is ordered after the copy).
        drop(home);
        moved_buffers += 1;
        moved_bytes += buffers[i].len();
    }
    be.synchronize()?;
    pool.empty_cache();
    Ok(Defragmentation { moved_buffers, moved_bytes, before, after: pool.shape() })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::backend::CpuBackend;
    use crate::memory::{Category, Pool};

    const MIB: usize = 1 << 20;

    /// Two 6 MiB segments, each carved into three blocks (2, 2 and 1.5 MiB — the last keeps the
    /// segment's 0.5 MiB tail unsplit); freeing four of them leaves one live block in each. An 8 MiB request cannot fit 16 MiB beside 12 reserved, and
    /// releasing the cache frees nothing; after defragmentation (the lone block of the first
    /// segment moves into the second's free space, the first goes back) it fits, and the moved
    /// buffer kept its contents.
    #[test]
    fn a_fragmented_pool_recovers_a_request_that_failed_before() {
        let pool = Pool::new("cpu", 16 * MIB);
        let be = CpuBackend::new(pool.clone());
        let carve = || {
            drop(pool.alloc(6 * MIB, Category::Activations).unwrap());
            let blocks: Vec<Buffer> =
                [2 * MIB, 2 * MIB, 3 * MIB / 2].iter().map(|&n| pool.alloc(n, Category::Params).unwrap()).collect();
            blocks
        };
        let [a1, c1, mut b1]: [Buffer; 3] = carve().try_into().unwrap();
        // The first segment is full: the second carve gets a segment of its own.
        let [a2, b2, c2]: [Buffer; 3] = carve().try_into().unwrap();
        let allocated = pool.stats().allocated();
        assert_eq!(pool.stats().reserved, 12 * MIB);
        b1.as_mut_slice::<u32>().iter_mut().enumerate().for_each(|(i, x)| *x = i as u32 * 7);
        drop((a1, c1, b2, c2));
        let mut kept = a2;
        kept.as_mut_slice::<u32>().fill(5);
        assert!(pool.alloc(8 * MIB, Category::Activations).is_err(), "fragmented: no 8 MiB");
        pool.empty_cache();
        assert_eq!(pool.stats().reserved, 12 * MIB, "no segment is wholly free");
        let before = pool.shape();
        // Segment one: 4 MiB free beside b1's block (its tail included); segment two: 4 MiB.
        assert_eq!(before.stranded, 8 * MIB);
        assert!((before.stranded_share() - 8.0 / 12.0).abs() < 1e-12);
        assert_eq!(before.allocated, allocated - 4 * MIB - 3 * MIB / 2 - 2 * MIB);

        let d = defragment(&be, &mut [&mut b1, &mut kept]).unwrap();
        assert_eq!((d.moved_buffers, d.moved_bytes), (1, 3 * MIB / 2), "one buffer moved: {d:?}");
        assert_eq!(d.before, before);
        assert_eq!(d.after.allocated, d.before.allocated, "the home holds the request, not the old tail");
        assert_eq!((d.after.reserved, d.after.segments), (6 * MIB, 1));
        assert_eq!(d.after.stranded, 5 * MIB / 2);
        assert!(b1.as_slice::<u32>().iter().enumerate().all(|(i, &x)| x == i as u32 * 7), "contents moved");
        assert!(kept.as_slice::<u32>().iter().all(|&x| x == 5));
        let big = pool.alloc(8 * MIB, Category::Activations).expect("fits after defragmentation");
        drop((big, b1, kept));
        assert_eq!(pool.stats().allocated(), 0, "every byte counted in is counted out");
    }

    /// A segment with a block compaction was not given stays; nothing moves, nothing is lost.
    #[test]
    fn blocks_it_was_not_given_pin_their_segment() {
        let pool = Pool::new("cpu", 16 * MIB);
        let be = CpuBackend::new(pool.clone());
        drop(pool.alloc(6 * MIB, Category::Activations).unwrap());
        let mut a = pool.alloc(2 * MIB, Category::Params).unwrap();
        let pinned = pool.alloc(2 * MIB, Category::Params).unwrap();
        let d = defragment(&be, &mut [&mut a]).unwrap();
        assert_eq!(d.moved_buffers, 0);
        assert_eq!(d.after.reserved, 6 * MIB);
        drop(pinned);
    }
}
