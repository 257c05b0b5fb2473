//! Device memory: the budgeted caching pool, its categories and statistics.

pub mod plan;
mod pool;
mod stats;

pub use pool::{
    block_bytes, blocks_bytes, AddressSpace, Buffer, HostAddressSpace, HostSegments, OomError, Pool, PoolShape,
    SegmentSource, StaticPlanReport, LARGE_ROUND, ROUND, SMALL_LIMIT, SMALL_SEGMENT,
};
pub use stats::{format_bytes, parse_bytes, Category, MemStats, CATEGORIES};

#[cfg(test)]
mod tests;
