//! The memory of generation (`headroom generate`): the stored weights, the KV cache, the
//! decoder's buffers and the largest op moment — a dequantized weight segment with the scratch
//! of the op using it — from the tables the decoder and `Quantized` allocate by. The peak is
//! that of a generation that runs a full chunk (a prompt, or a window shift, of at least
//! `chunk` tokens); shorter ones stay under it.

use serde::Serialize;

use crate::engine::backend::layers::Elem;
use crate::engine::backend::workspace::WorkspaceModel;
use crate::engine::model::decode::{decode_buffer_sizes, decode_op_scratch, kv_cache_layer_elems};
use crate::engine::model::GptConfig;
use crate::engine::quant::{stored_buffer_bytes, DecodeShape, Scheme};
use crate::memory::{block_bytes, blocks_bytes};

/// Predicted pool bytes of generation, per category, and their sum.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct InferenceEstimate {
    /// The stored weights (codes and scales, or f32 values): category params.
    pub weights: usize,
    /// Every layer's keys and values for `context` positions: category kv_cache.
    pub kv_cache: usize,
    /// The decoder's buffers for a chunk: category activations.
    pub activations: usize,
    /// The largest dequantized segment with its op's scratch: category workspace.
    pub workspace: usize,
    /// Sum of the above: the predicted `peak_allocated`.
    pub peak_allocated: usize,
}

/// The estimate for a model of `cfg` stored under `scheme`, decoding in `E` with `shape`, on a
/// backend whose scratch `model` declares.
pub fn inference<E: Elem>(
    model: WorkspaceModel,
    cfg: &GptConfig,
    scheme: Scheme,
    shape: DecodeShape,
) -> InferenceEstimate {
    let weights = blocks_bytes(&stored_buffer_bytes(cfg, scheme));
    let kv_cache = cfg.n_layer * block_bytes(kv_cache_layer_elems(cfg, shape.context) * E::BYTES);
    let activations = decode_buffer_sizes::<E>(cfg, shape.chunk).iter().map(|&(_, n, w)| block_bytes(n * w)).sum();
    let segment = |range: std::ops::Range<usize>| block_bytes(range.len() * E::BYTES);
    let scratch = decode_op_scratch::<E>(model, cfg, shape.chunk, shape.context);
    let block_op = scratch.block.iter().map(|op| blocks_bytes(op)).max().unwrap_or(0);
    let mut moments = vec![segment(cfg.embed_range()), segment(cfg.lnf_range())];
    moments.push(segment(cfg.wte_range()) + blocks_bytes(&scratch.head));
    if cfg.n_layer > 0 {
        moments.push(segment(cfg.layer_range(0)) + block_op);
    }
    let workspace = moments.into_iter().max().unwrap_or(0);
    InferenceEstimate {
        weights,
        kv_cache,
        activations,
        workspace,
        peak_allocated: weights + kv_cache + activations + workspace,
    }
}
