//! The GPT-2 model: size tables (the one source of truth for tensor sizes, which the estimator
//! reads too), parameter layout and segments, initialisation; the passes are in `passes.rs`.
//!
//! Parameters are laid out layer-major in one flat fp32 buffer:
//! `wte (V,C) | wpe (maxT,C) | layer 0 … layer L-1 | lnfw (C) | lnfb (C)`, each layer being
//! `ln1w ln1b qkvw qkvb attprojw attprojb ln2w ln2b fcw fcb fcprojw fcprojb`. The same order is
//! the checkpoint's canonical layout.

use std::ops::Range;

use crate::config::Checkpointing;
use crate::engine::backend::workspace::WorkspaceModel;
use crate::engine::backend::{Elem, View, ViewMut};
use crate::engine::rng::{mix64, normal_fill};
use crate::memory::{blocks_bytes, Buffer, Category, OomError, Pool};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GptConfig {
    pub n_layer: usize,
    pub n_head: usize,
    pub n_embd: usize,
    /// Maximum sequence length (rows of wpe).
    pub block_size: usize,
    pub vocab: usize,
}

/// One named tensor of the parameter layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    pub offset: usize,
    pub len: usize,
    /// Matrices (and embeddings) get weight decay; biases and LayerNorm parameters do not.
    pub decay: bool,
}

/// Per-layer parameter tensors in layout order: (name, elements, decayed, init std multiplier).
fn layer_param_sizes(c: usize) -> [(&'static str, usize, bool); 12] {
    [
        ("ln1w", c, false),
        ("ln1b", c, false),
        ("qkvw", 3 * c * c, true),
        ("qkvb", 3 * c, false),
        ("attprojw", c * c, true),
        ("attprojb", c, false),
        ("ln2w", c, false),
        ("ln2b", c, false),
        ("fcw", 4 * c * c, true),
        ("fcb", 4 * c, false),
        ("fcprojw", 4 * c * c, true),
        ("fcprojb", c, false),
    ]
}

/// Per-layer activation tensors kept for backward (elements), for batch b and length t.
/// With `keep_recomputable == false` the cheap ones (LayerNorm outputs, GELU output) are
/// left out, as selective checkpointing does.
pub fn layer_activation_sizes(cfg: &GptConfig, b: usize, t: usize) -> [(&'static str, usize); 13] {
    let (c, nh) = (cfg.n_embd, cfg.n_head);
    let bt = b * t;
    [
        ("ln1", bt * c),
        ("ln1_mean", bt),
        ("ln1_rstd", bt),
        ("qkv", bt * 3 * c),
        ("att", b * nh * t * t),
        ("atty", bt * c),
        ("residual2", bt * c),
        ("ln2", bt * c),
        ("ln2_mean", bt),
        ("ln2_rstd", bt),
        ("fch", bt * 4 * c),
        ("fch_gelu", bt * 4 * c),
        ("residual3", bt * c),
    ]
}

/// Bytes per element of an activation tensor: statistics, losses and token ids are always 4
/// bytes (f32 / u32); everything else is stored in the compute precision.
pub fn activation_width(name: &str, elem_bytes: usize) -> usize {
    match name {
        "ln1_mean" | "ln1_rstd" | "ln2_mean" | "ln2_rstd" | "lnf_mean" | "lnf_rstd" | "losses" | "inputs"
        | "targets" => 4,
        _ => elem_bytes,
    }
}

/// Which per-layer activations a checkpointing mode keeps from forward to backward; the rest
/// are recomputed in backward. `selective` drops the cheap ones (LayerNorm outputs, GELU output;
/// their statistics stay), `full` keeps only the block output, the next block's input.
pub fn kept_in(mode: Checkpointing, name: &str) -> bool {
    match mode {
        Checkpointing::None => true,
        Checkpointing::Selective => !matches!(name, "ln1" | "ln2" | "fch_gelu"),
        Checkpointing::Full => name == "residual3",
    }
}

/// Activations outside the blocks: (name, elements).
pub fn global_activation_sizes(cfg: &GptConfig, b: usize, t: usize) -> [(&'static str, usize); 8] {
    let bt = b * t;
    [
        ("inputs", bt),
        ("targets", bt),
        ("encoded", bt * cfg.n_embd),
        ("lnf", bt * cfg.n_embd),
        ("lnf_mean", bt),
        ("lnf_rstd", bt),
        ("logits", bt * cfg.vocab),
        ("losses", bt),
    ]
}

/// Backward temporaries in the compute precision (elements): running residual gradient, a
/// (BT,C) scratch, the MLP gradient and the qkv gradient.
pub fn backward_workspace_sizes(cfg: &GptConfig, b: usize, t: usize) -> [(&'static str, usize); 4] {
    let c = cfg.n_embd;
    let bt = b * t;
    [("dresidual", bt * c), ("dsmall", bt * c), ("dfch", bt * 4 * c), ("dqkv", bt * 3 * c)]
}

/// The (in, out) feature sizes of a block's matmuls.
fn block_matmul_shapes(cfg: &GptConfig) -> [(usize, usize); 4] {
    let c = cfg.n_embd;
    [(c, 3 * c), (c, c), (c, 4 * c), (4 * c, c)]
}

/// The workspace buffers (bytes each) live at a block's forward op with the most pool bytes
/// (its matmuls and attention), per `model`'s declarations.
pub fn block_forward_scratch<E: Elem>(model: WorkspaceModel, cfg: &GptConfig, b: usize, t: usize) -> Vec<usize> {
    let bt = b * t;
    let mut ops: Vec<Vec<usize>> =
        block_matmul_shapes(cfg).iter().map(|&(i, o)| model.matmul_forward::<E>(bt, i, o)).collect();
    ops.push(model.attention_forward::<E>(b, t, cfg.n_embd, cfg.n_head));
    largest(ops)
}

/// The workspace buffers live at a block's backward op with the most pool bytes (recomputing
/// its forward included).
pub fn block_backward_scratch<E: Elem>(model: WorkspaceModel, cfg: &GptConfig, b: usize, t: usize) -> Vec<usize> {
    let bt = b * t;
    let mut ops: Vec<Vec<usize>> =
        block_matmul_shapes(cfg).iter().map(|&(i, o)| model.matmul_backward::<E>(bt, i, o)).collect();
    ops.push(model.attention_backward::<E>(b, t, cfg.n_embd, cfg.n_head));
    ops.push(block_forward_scratch::<E>(model, cfg, b, t));
    largest(ops)
}

/// The classifier's workspace (B·T, C) · (V, C)ᵀ: forward.
pub fn head_forward_scratch<E: Elem>(model: WorkspaceModel, cfg: &GptConfig, b: usize, t: usize) -> Vec<usize> {
    model.matmul_forward::<E>(b * t, cfg.n_embd, cfg.vocab)
}

/// The classifier's workspace: backward.
pub fn head_backward_scratch<E: Elem>(model: WorkspaceModel, cfg: &GptConfig, b: usize, t: usize) -> Vec<usize> {
    model.matmul_backward::<E>(b * t, cfg.n_embd, cfg.vocab)
}

/// The buffer set taking the most pool bytes (each buffer rounded as the pool rounds it).
fn largest(ops: Vec<Vec<usize>>) -> Vec<usize> {
    ops.into_iter().max_by_key(|op| blocks_bytes(op)).unwrap_or_default()
}

impl GptConfig {
    /// (n_layer, n_head, n_embd, block_size, vocab): the shape a checkpoint and a run
    /// directory record.
    pub fn dims(&self) -> [u64; 5] {
        [self.n_layer, self.n_head, self.n_embd, self.block_size, self.vocab].map(|x| x as u64)
    }

    pub fn layer_params(&self) -> usize {
        layer_param_sizes(self.n_embd).iter().map(|t| t.1).sum()
    }

    pub fn num_params(&self) -> usize {
        let c = self.n_embd;
        self.vocab * c + self.block_size * c + self.n_layer * self.layer_params() + 2 * c
    }

    /// The full parameter layout, in order.
    pub fn tensors(&self) -> Vec<TensorInfo> {
        let c = self.n_embd;
        let mut out = Vec::new();
        let mut offset = 0;
        let mut push = |name: String, len: usize, decay: bool| {
            out.push(TensorInfo { name, offset, len, decay });
            offset += len;
        };
        push("wte".into(), self.vocab * c, true);
        push("wpe".into(), self.block_size * c, true);
        for l in 0..self.n_layer {
            for (name, len, decay) in layer_param_sizes(c) {
                push(format!("h{l}.{name}"), len, decay);
            }
        }
        push("lnfw".into(), c, false);
        push("lnfb".into(), c, false);
        out
    }

    /// GPT-2 initialisation: N(0, 0.02) for matrices, residual projections scaled by
    /// 1/sqrt(2L), zero biases, unit LayerNorm weights.
    pub fn init_params(&self, params: &mut [f32], seed: u64) {
        self.init_range(seed, 0..params.len(), params);
    }

    /// The initial values of flat parameters `range` into `out` (its length): each value a pure
    /// function of (seed, flat index) — a counter-based generator — so any part can be made on
    /// its own, in parallel, and the weights do not depend on the thread count, the chunking,
    /// the sharding or the backend.
    pub fn init_range(&self, seed: u64, range: Range<usize>, out: &mut [f32]) {
        assert_eq!(range.len(), out.len(), "init_range: output length");
        let proj_std = (0.02 / (2.0 * self.n_layer as f64).sqrt()) as f32;
        let key = mix64(seed ^ 0x696e_6974_7061_7273);
        for t in self.tensors() {
            let lo = t.offset.max(range.start);
            let hi = (t.offset + t.len).min(range.end);
            if lo >= hi {
                continue;
            }
            let dst = &mut out[lo - range.start..hi - range.start];
            let short = t.name.rsplit('.').next().unwrap_or(&t.name);
            match short {
                "ln1w" | "ln2w" | "lnfw" => dst.fill(1.0),
                "attprojw" | "fcprojw" => normal_fill(key, lo, proj_std, dst),
                _ if t.decay => normal_fill(key, lo, 0.02, dst),
                _ => dst.fill(0.0),
            }
        }
    }
}

/// One layer's parameters (or gradients), as views into a segment of the flat layout.
pub struct LayerTensors<T> {
    pub ln1w: T,
    pub ln1b: T,
    pub qkvw: T,
    pub qkvb: T,
    pub attprojw: T,
    pub attprojb: T,
    pub ln2w: T,
    pub ln2b: T,
    pub fcw: T,
    pub fcb: T,
    pub fcprojw: T,
    pub fcprojb: T,
}

impl<T> LayerTensors<T> {
    fn from_vec(v: Vec<T>) -> Self {
        let mut it = v.into_iter();
        let mut next = || it.next().expect("12 layer tensors");
        LayerTensors {
            ln1w: next(),
            ln1b: next(),
            qkvw: next(),
            qkvb: next(),
            attprojw: next(),
            attprojb: next(),
            ln2w: next(),
            ln2b: next(),
            fcw: next(),
            fcb: next(),
            fcprojw: next(),
            fcprojb: next(),
        }
    }
}

impl GptConfig {
    fn layer_sizes(&self) -> Vec<usize> {
        layer_param_sizes(self.n_embd).iter().map(|t| t.1).collect()
    }

    /// The tied token embedding / classifier weights `wte`.
    pub fn wte_range(&self) -> Range<usize> {
        0..self.vocab * self.n_embd
    }

    /// `wte` and `wpe`, adjacent: what the encoder reads and writes gradients for.
    pub fn embed_range(&self) -> Range<usize> {
        0..(self.vocab + self.block_size) * self.n_embd
    }

    /// Block `l`'s twelve tensors, contiguous in the layer-major layout.
    pub fn layer_range(&self, l: usize) -> Range<usize> {
        let start = self.embed_range().end + l * self.layer_params();
        start..start + self.layer_params()
    }

    /// The final LayerNorm's weight and bias.
    pub fn lnf_range(&self) -> Range<usize> {
        let n = self.num_params();
        n - 2 * self.n_embd..n
    }

    /// Views of one block's tensors in a view holding exactly `layer_range(l)`.
    pub fn layer_view<'a, E: Elem>(&self, flat: View<'a, E>) -> LayerTensors<View<'a, E>> {
        let mut at = 0;
        LayerTensors::from_vec(
            self.layer_sizes()
                .into_iter()
                .map(|n| {
                    at += n;
                    flat.slice(at - n..at)
                })
                .collect(),
        )
    }

    /// Writable views of one block's gradients, for a view holding exactly `layer_range(l)`.
    pub fn layer_view_mut<'a, E: Elem>(&self, flat: ViewMut<'a, E>) -> LayerTensors<ViewMut<'a, E>> {
        LayerTensors::from_vec(flat.split_sizes(&self.layer_sizes()))
    }
}

/// An fp32 buffer of `n` elements from the pool.
pub fn alloc_f32(pool: &Pool, n: usize, category: Category) -> Result<Buffer, OomError> {
    pool.alloc(n * 4, category)
}

/// A buffer of `n` elements of `E` from the pool.
pub fn alloc_elems<E: Elem>(pool: &Pool, n: usize, category: Category) -> Result<Buffer, OomError> {
    pool.alloc(n * E::BYTES, category)
}

pub mod decode;
mod passes;

pub use passes::*;
