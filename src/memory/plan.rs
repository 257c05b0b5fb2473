//! The static allocation plan (`memory.allocator: static`): one training step's allocations as
//! recorded (size, category, when allocated, when freed), packed into offsets of one arena by
//! lifetime, so every later step is served from it with no search — pure functions; the pool
//! records and replays.
//!
//! Packing is greedy by size (the largest first, each at the lowest offset where it overlaps no
//! placed allocation whose lifetime it shares), which is near the live peak for the nested
//! lifetimes of a forward and backward pass. A recorded allocation still live when the step
//! ended (it outlives steps) is not planned: it keeps the caching allocator.

use super::stats::Category;

/// One allocation of the recorded step; times are the pool's event counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rec {
    pub size: usize,
    pub category: Category,
    pub alloc_at: u64,
    /// `None`: still live when the recording ended.
    pub free_at: Option<u64>,
}

/// Where one recorded allocation goes in the arena, and which others share its bytes (at other
/// times): replay serves it from the plan only when none of those is live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub size: usize,
    pub category: Category,
    /// `None`: not planned (it outlived the recorded step).
    pub offset: Option<usize>,
    pub shares_with: Vec<u32>,
}

/// The packed step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// In allocation order of the recorded step.
    pub entries: Vec<Entry>,
    /// The arena's size: the end of the highest placed allocation.
    pub arena_bytes: usize,
    /// The most planned bytes live at once in the recording: what no packing can go below.
    pub live_peak: usize,
}

impl Plan {
    /// How much the arena exceeds the live peak, as a fraction of it (0: perfect packing).
    pub fn fragmentation(&self) -> f64 {
        if self.live_peak == 0 {
            return 0.0;
        }
        self.arena_bytes as f64 / self.live_peak as f64 - 1.0
    }

    pub fn planned(&self) -> usize {
        self.entries.iter().filter(|e| e.offset.is_some()).count()
    }
}

/// Pack a recorded step (see the module doc).
pub fn pack(recs: &[Rec]) -> Plan {
    let lifetime = |r: &Rec| r.free_at.map(|f| (r.alloc_at, f));
    // Largest first; ties in allocation order, so the plan is deterministic.
    let mut order: Vec<usize> = (0..recs.len()).filter(|&i| recs[i].free_at.is_some()).collect();
    order.sort_by(|&a, &b| recs[b].size.cmp(&recs[a].size).then(a.cmp(&b)));
    let mut offsets: Vec<Option<usize>> = vec![None; recs.len()];
    let mut placed: Vec<usize> = Vec::new();
    for &i in &order {
        let (a0, a1) = lifetime(&recs[i]).expect("only freed records are ordered");
        // Placed allocations alive at the same time, by offset.
        let mut busy: Vec<(usize, usize)> = placed
            .iter()
            .filter(|&&j| {
                let (b0, b1) = lifetime(&recs[j]).expect("placed records are freed");
                a0 < b1 && b0 < a1
            })
            .map(|&j| (offsets[j].expect("placed"), recs[j].size))
            .collect();
        busy.sort_unstable();
        // The lowest gap that holds it.
        let mut at = 0;
        for (start, size) in busy {
            if start >= at + recs[i].size {
                break;
            }
            at = at.max(start + size);
        }
        offsets[i] = Some(at);
        placed.push(i);
    }
    let arena_bytes = placed.iter().map(|&i| offsets[i].expect("placed") + recs[i].size).max().unwrap_or(0);
    // Live peak of the planned allocations: sweep their alloc (+) and free (−) events.
    let mut events: Vec<(u64, i64)> = placed
        .iter()
        .flat_map(|&i| {
            let (a, f) = lifetime(&recs[i]).expect("placed records are freed");
            [(a, recs[i].size as i64), (f, -(recs[i].size as i64))]
        })
        .collect();
    events.sort_unstable_by_key(|&(t, d)| (t, d));
    let (mut live, mut live_peak) = (0i64, 0i64);
    for (_, d) in events {
        live += d;
        live_peak = live_peak.max(live);
    }
    let entries = recs
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let shares_with = match offsets[i] {
                None => Vec::new(),
                Some(o) => placed
                    .iter()
                    .filter(|&&j| j != i && offsets[j].is_some_and(|p| p < o + r.size && o < p + recs[j].size))
                    .map(|&j| j as u32)
                    .collect(),
            };
            Entry { size: r.size, category: r.category, offset: offsets[i], shares_with }
        })
        .collect();
    Plan { entries, arena_bytes, live_peak: live_peak as usize }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(size: usize, alloc_at: u64, free_at: Option<u64>) -> Rec {
        Rec { size, category: Category::Activations, alloc_at, free_at }
    }

    #[test]
    fn lifetimes_that_never_meet_share_bytes_and_ones_that_do_never_overlap() {
        // A forward/backward shape: a, b, c live together; then d reuses a's bytes after it
        // is gone; e outlives the step and is not planned.
        let recs = [
            rec(400, 0, Some(10)),
            rec(200, 1, Some(4)),
            rec(100, 2, Some(3)),
            rec(300, 11, Some(12)),
            rec(50, 5, None),
        ];
        let plan = pack(&recs);
        assert_eq!(plan.live_peak, 700);
        assert_eq!(plan.arena_bytes, 700, "packed at the live peak");
        assert_eq!(plan.fragmentation(), 0.0);
        assert_eq!(plan.entries[4].offset, None, "outlives the step");
        assert_eq!(plan.planned(), 4);
        for (i, a) in recs.iter().enumerate() {
            for (j, b) in recs.iter().enumerate().filter(|&(j, _)| j != i) {
                let (Some(oa), Some(ob)) = (plan.entries[i].offset, plan.entries[j].offset) else { continue };
                let space = oa < ob + b.size && ob < oa + a.size;
                let time = a.alloc_at < b.free_at.unwrap() && b.alloc_at < a.free_at.unwrap();
                assert!(!(space && time), "{i} and {j} overlap while both live");
                assert_eq!(space, plan.entries[i].shares_with.contains(&(j as u32)), "{i} shares with {j}");
            }
        }
        assert_eq!(plan.entries[3].offset, Some(0), "d takes a's bytes once a is freed");
    }

    #[test]
    fn an_empty_step_plans_nothing() {
        let plan = pack(&[]);
        assert_eq!((plan.arena_bytes, plan.live_peak, plan.fragmentation()), (0, 0, 0.0));
    }
}
