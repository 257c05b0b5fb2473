//! Device-native collectives: the three primitives (all-reduce, reduce to a root, broadcast
//! from a root) a rank's backend may run on its own device memory and stream — NCCL on cuda
//! ranks of distinct GPUs. `Group`'s `*_on` forms build ZeRO's collectives from them when
//! the backend has them, instead of staging device memory through the host.
//!
//! Every rank calls the same primitives in the same order with the same counts and roots (the
//! NCCL contract); buffers are device addresses of the calling rank's pool, valid for ops
//! issued after the call on that rank's stream.

use crate::engine::backend::layers::Elem;
use crate::engine::backend::BackendResult;

/// The element type of a collective's buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dtype {
    F32,
    Bf16,
    F16,
}

impl Dtype {
    pub fn of<E: Elem>() -> Dtype {
        match E::NAME {
            "bf16" => Dtype::Bf16,
            "fp16" => Dtype::F16,
            _ => Dtype::F32,
        }
    }
}

/// One rank's handle on native collectives with its peers (ranks `0..world`).
pub trait DeviceCollectives: Send + Sync {
    /// `count` elements at `buf` become the elementwise sum over ranks, on every rank.
    fn all_reduce_sum(&self, buf: u64, count: usize, dtype: Dtype) -> BackendResult;
    /// On `root`, `recv` receives the elementwise sum over ranks of each rank's `count`
    /// elements at `send`; the other ranks pass `recv: None`.
    fn reduce_sum(&self, send: u64, recv: Option<u64>, count: usize, dtype: Dtype, root: usize) -> BackendResult;
    /// Every rank's `recv` receives `root`'s `count` elements at `send` (the root passes
    /// `Some(send)`, which may equal its `recv`; the others `None`).
    fn broadcast(&self, send: Option<u64>, recv: u64, count: usize, dtype: Dtype, root: usize) -> BackendResult;
    /// A collective of every rank: the ranks that pass the same `color` get a communicator of
    /// their own, ranked by `key` (`ncclCommSplit`); `None` where the implementation cannot.
    fn split(&self, color: u64, key: usize) -> BackendResult<Option<std::sync::Arc<dyn DeviceCollectives>>>;
}
