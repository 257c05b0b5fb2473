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

/// The model's shape (the whole model's dimensions) and the part of it this rank computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GptConfig {
    pub n_layer: usize,
    pub n_head: usize,
    pub n_embd: usize,
    /// Maximum sequence length (rows of wpe).
    pub block_size: usize,
    /// Token ids and the softmax's width; `wte` and the logits have `padded_vocab()` rows.
    pub vocab: usize,
    /// This rank's share under tensor parallelism; the sizes, the layout and the size tables
    /// below are this rank's (`TpShard::NONE`: the whole model).
    pub tp: TpShard,
    /// This rank's pipeline stage: its layers (and the embedding on the first stage, the final
    /// LayerNorm and classifier on the last); `PpStage::NONE`: every layer.
    pub pp: PpStage,
}

/// `padded_vocab()`'s multiple: 64 tokens, 128 bytes a row of logits in 16-bit storage.
pub const VOCAB_ROW_MULTIPLE: usize = 64;

/// A rank's pipeline stage: stage `stage` of `stages` holds a contiguous run of layers (the
/// first `n_layer % stages` stages one more than the others), the first stage also `wte` and
/// `wpe` (the embedding), the last `wte` (the tied classifier: its gradient is summed with the
/// first stage's) and the final LayerNorm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PpStage {
    pub stage: usize,
    pub stages: usize,
}

impl PpStage {
    /// No pipeline: one stage holding everything.
    pub const NONE: PpStage = PpStage { stage: 0, stages: 1 };

    pub fn is_first(&self) -> bool {
        self.stage == 0
    }

    pub fn is_last(&self) -> bool {
        self.stage + 1 == self.stages
    }
}

/// A rank's part of a tensor-parallel group (Megatron's layout): rank `rank` of `size` holds
/// heads `rank·H/size ..` (their q, k and v rows of `qkvw`, `qkvb`, and their input columns of
/// `attprojw`), the same share of the MLP's features (rows of `fcw`, `fcb`, input columns of
/// `fcprojw`) and a copy of every other tensor (LayerNorms, the two projections' biases,
/// embeddings and classifier: replicated, not vocab-parallel).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TpShard {
    pub rank: usize,
    pub size: usize,
}

impl TpShard {
    /// No tensor parallelism: the whole model.
    pub const NONE: TpShard = TpShard { rank: 0, size: 1 };
}

/// Whether a layer tensor is split across a tensor-parallel group (else each rank holds a copy).
pub fn tp_split(short_name: &str) -> bool {
    matches!(short_name, "qkvw" | "qkvb" | "attprojw" | "fcw" | "fcb" | "fcprojw")
}

/// A run of a rank's parameters that is contiguous in the whole model's layout too: elements
/// `local..local + len` of this rank's layout are `whole..whole + len` of the whole one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WholeRun {
    pub local: usize,
    pub whole: usize,
    pub len: usize,
    /// Part of a split tensor (each rank holds its own), not a replicated one.
    pub split: bool,
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

/// Per-layer parameter tensors of a rank in layout order: (name, elements, decayed). `c` is
/// n_embd, `tp` the tensor-parallel group's size (the split tensors hold 1/tp of the rows or
/// columns).
fn layer_param_sizes(c: usize, tp: usize) -> [(&'static str, usize, bool); 12] {
    let (cl, fl) = (c / tp, 4 * c / tp);
    [
        ("ln1w", c, false),
        ("ln1b", c, false),
        ("qkvw", 3 * cl * c, true), // (3·C/tp, C): this rank's q, k and v rows
        ("qkvb", 3 * cl, false),
        ("attprojw", c * cl, true), // (C, C/tp): the input columns of this rank's heads
        ("attprojb", c, false),
        ("ln2w", c, false),
        ("ln2b", c, false),
        ("fcw", fl * c, true), // (4C/tp, C)
        ("fcb", fl, false),
        ("fcprojw", c * fl, true), // (C, 4C/tp)
        ("fcprojb", c, false),
    ]
}

/// Per-layer activation tensors kept for backward (elements), for batch b and length t.
/// With `keep_recomputable == false` the cheap ones (LayerNorm outputs, GELU output) are
/// left out, as selective checkpointing does.
/// Under tensor parallelism the head and MLP tensors are this rank's share.
pub fn layer_activation_sizes(cfg: &GptConfig, b: usize, t: usize) -> [(&'static str, usize); 13] {
    let (c, cl, nhl, fl) = (cfg.n_embd, cfg.local_embd(), cfg.local_heads(), cfg.local_mlp());
    let bt = b * t;
    [
        ("ln1", bt * c),
        ("ln1_mean", bt),
        ("ln1_rstd", bt),
        ("qkv", bt * 3 * cl),
        ("att_lse", b * nhl * t),
        ("atty", bt * cl),
        ("residual2", bt * c),
        ("ln2", bt * c),
        ("ln2_mean", bt),
        ("ln2_rstd", bt),
        ("fch", bt * fl),
        ("fch_gelu", bt * fl),
        ("residual3", bt * c),
    ]
}

/// Bytes per element of an activation tensor: statistics, losses and token ids are always 4
/// bytes (f32 / u32); everything else is stored in the compute precision.
pub fn activation_width(name: &str, elem_bytes: usize) -> usize {
    match name {
        "ln1_mean" | "ln1_rstd" | "att_lse" | "ln2_mean" | "ln2_rstd" | "lnf_mean" | "lnf_rstd" | "losses"
        | "inputs" | "targets" => 4,
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
        ("logits", bt * cfg.padded_vocab()),
        ("losses", bt),
    ]
}

/// Backward temporaries in the compute precision (elements): running residual gradient, a
/// (BT,C) scratch, the MLP gradient and the qkv gradient (this rank's share of the last two).
pub fn backward_workspace_sizes(cfg: &GptConfig, b: usize, t: usize) -> [(&'static str, usize); 4] {
    let c = cfg.n_embd;
    let bt = b * t;
    [("dresidual", bt * c), ("dsmall", bt * c), ("dfch", bt * cfg.local_mlp()), ("dqkv", bt * 3 * cfg.local_embd())]
}

/// The (in, out) feature sizes of a block's matmuls on this rank.
fn block_matmul_shapes(cfg: &GptConfig) -> [(usize, usize); 4] {
    let (c, cl, fl) = (cfg.n_embd, cfg.local_embd(), cfg.local_mlp());
    [(c, 3 * cl), (cl, c), (c, fl), (fl, c)]
}

/// The workspace buffers (bytes each) live at a block's forward op with the most pool bytes
/// (its matmuls and attention), per `model`'s declarations.
pub fn block_forward_scratch<E: Elem>(model: WorkspaceModel, cfg: &GptConfig, b: usize, t: usize) -> Vec<usize> {
    let bt = b * t;
    let mut ops: Vec<Vec<usize>> =
        block_matmul_shapes(cfg).iter().map(|&(i, o)| model.matmul_forward::<E>(bt, i, o)).collect();
    ops.push(model.attention_forward::<E>(b, t, cfg.local_embd(), cfg.local_heads()));
    largest(ops)
}

/// The workspace buffers live at a block's backward op with the most pool bytes (recomputing
/// its forward included).
pub fn block_backward_scratch<E: Elem>(model: WorkspaceModel, cfg: &GptConfig, b: usize, t: usize) -> Vec<usize> {
    let bt = b * t;
    let mut ops: Vec<Vec<usize>> =
        block_matmul_shapes(cfg).iter().map(|&(i, o)| model.matmul_backward::<E>(bt, i, o, true)).collect();
    ops.push(model.attention_backward::<E>(b, t, cfg.local_embd(), cfg.local_heads()));
    ops.push(model.layernorm_backward(bt, cfg.n_embd));
    ops.push(block_forward_scratch::<E>(model, cfg, b, t));
    largest(ops)
}

/// The classifier's workspace (B·T, C) · (VP, C)ᵀ (the padded vocabulary): forward.
pub fn head_forward_scratch<E: Elem>(model: WorkspaceModel, cfg: &GptConfig, b: usize, t: usize) -> Vec<usize> {
    model.matmul_forward::<E>(b * t, cfg.n_embd, cfg.padded_vocab())
}

/// The head's workspace in backward: the classifier's (no bias), then the final LayerNorm's.
pub fn head_backward_scratch<E: Elem>(model: WorkspaceModel, cfg: &GptConfig, b: usize, t: usize) -> Vec<usize> {
    largest(vec![
        model.matmul_backward::<E>(b * t, cfg.n_embd, cfg.padded_vocab(), false),
        model.layernorm_backward(b * t, cfg.n_embd),
    ])
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

    /// The whole model of a checkpoint's or a quantized file's recorded `dims()`.
    pub fn of_dims(dims: [u64; 5]) -> GptConfig {
        let [n_layer, n_head, n_embd, block_size, vocab] = dims.map(|x| x as usize);
        GptConfig { n_layer, n_head, n_embd, block_size, vocab, tp: TpShard::NONE, pp: PpStage::NONE }
    }

    /// Rows of `wte` and of the logits: the vocabulary rounded up to a multiple of
    /// [`VOCAB_ROW_MULTIPLE`], so every row of logits starts on a 16-byte boundary and the
    /// classifier's GEMMs get whole tiles (GPT-2's 50,257 → 50,304, as llm.c and nanoGPT pad
    /// it). The rows past `vocab` are zero from initialisation on and stay zero: no token
    /// selects them, their logits are left out of the softmax and get a zero gradient.
    pub fn padded_vocab(&self) -> usize {
        self.vocab.next_multiple_of(VOCAB_ROW_MULTIPLE)
    }

    /// The whole model (no tensor or pipeline parallelism): what checkpoints hold.
    pub fn whole(&self) -> GptConfig {
        GptConfig { tp: TpShard::NONE, pp: PpStage::NONE, ..*self }
    }

    /// This shape as pipeline stage `pp` holds it.
    pub fn with_pp(&self, pp: PpStage) -> GptConfig {
        GptConfig { pp, ..*self }
    }

    /// The layers this rank's stage holds (global indices).
    pub fn stage_layers(&self) -> Range<usize> {
        let (l, p, s) = (self.n_layer, self.pp.stages.max(1), self.pp.stage);
        let (base, extra) = (l / p, l % p);
        let start = s * base + s.min(extra);
        start..start + base + usize::from(s < extra)
    }

    /// This shape as rank `tp.rank` of a tensor-parallel group of `tp.size` computes it.
    pub fn with_tp(&self, tp: TpShard) -> GptConfig {
        GptConfig { tp, ..*self }
    }

    /// This rank's attention width: n_embd / tp (its heads' q, k, v each have this many features).
    pub fn local_embd(&self) -> usize {
        self.n_embd / self.tp.size
    }

    /// This rank's attention heads: n_head / tp.
    pub fn local_heads(&self) -> usize {
        self.n_head / self.tp.size
    }

    /// This rank's MLP features: 4·n_embd / tp.
    pub fn local_mlp(&self) -> usize {
        4 * self.n_embd / self.tp.size
    }

    pub fn layer_params(&self) -> usize {
        layer_param_sizes(self.n_embd, self.tp.size).iter().map(|t| t.1).sum()
    }

    /// Parameters this rank holds (all of them without tensor or pipeline parallelism).
    pub fn num_params(&self) -> usize {
        let c = self.n_embd;
        let (first, last) = (self.pp.is_first(), self.pp.is_last());
        let embed = if first {
            (self.padded_vocab() + self.block_size) * c
        } else if last {
            self.padded_vocab() * c
        } else {
            0
        };
        embed + self.stage_layers().len() * self.layer_params() + if last { 2 * c } else { 0 }
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
        if self.pp.is_first() || self.pp.is_last() {
            push("wte".into(), self.padded_vocab() * c, true);
        }
        if self.pp.is_first() {
            push("wpe".into(), self.block_size * c, true);
        }
        for l in self.stage_layers() {
            for (name, len, decay) in layer_param_sizes(c, self.tp.size) {
                push(format!("h{l}.{name}"), len, decay);
            }
        }
        if self.pp.is_last() {
            push("lnfw".into(), c, false);
            push("lnfb".into(), c, false);
        }
        out
    }

    /// GPT-2 initialisation: N(0, 0.02) for matrices, residual projections scaled by
    /// 1/sqrt(2L), zero biases, unit LayerNorm weights.
    pub fn init_params(&self, params: &mut [f32], seed: u64) {
        self.init_range(seed, 0..params.len(), params);
    }

    /// The initial values of this rank's flat parameters `range` into `out` (its length): each
    /// value a pure function of (seed, its index in the whole model's layout) — a
    /// counter-based generator — so any part can be made on its own, in parallel, and the
    /// weights do not depend on the thread count, the chunking, the sharding, the
    /// tensor-parallel split or the backend.
    pub fn init_range(&self, seed: u64, range: Range<usize>, out: &mut [f32]) {
        assert_eq!(range.len(), out.len(), "init_range: output length");
        let whole = self.whole();
        let tensors = whole.tensors();
        if self.tp.size == 1 && self.pp.stages == 1 {
            return whole.init_whole(&tensors, seed, range, out);
        }
        let runs = self.whole_runs();
        // The first run that ends after range.start (runs are in local order).
        let first = runs.partition_point(|r| r.local + r.len <= range.start);
        for r in &runs[first..] {
            let (lo, hi) = (r.local.max(range.start), (r.local + r.len).min(range.end));
            if lo >= hi {
                break;
            }
            let at = r.whole + (lo - r.local);
            whole.init_whole(&tensors, seed, at..at + (hi - lo), &mut out[lo - range.start..hi - range.start]);
        }
    }

    /// `init_range` of the whole model's layout (`tensors`: its tensors).
    fn init_whole(&self, tensors: &[TensorInfo], seed: u64, range: Range<usize>, out: &mut [f32]) {
        let proj_std = (0.02 / (2.0 * self.n_layer as f64).sqrt()) as f32;
        let key = mix64(seed ^ 0x696e_6974_7061_7273);
        let first = tensors.partition_point(|t| t.offset + t.len <= range.start);
        for t in &tensors[first..] {
            if t.offset >= range.end {
                break;
            }
            let lo = t.offset.max(range.start);
            let hi = (t.offset + t.len).min(range.end);
            if lo >= hi {
                continue;
            }
            let dst = &mut out[lo - range.start..hi - range.start];
            match short_name(&t.name) {
                // The padding rows (past the vocabulary) start at zero.
                "wte" if hi > self.vocab * self.n_embd => {
                    let real = (self.vocab * self.n_embd).clamp(lo, hi);
                    normal_fill(key, lo, 0.02, &mut dst[..real - lo]);
                    dst[real - lo..].fill(0.0);
                }
                "ln1w" | "ln2w" | "lnfw" => dst.fill(1.0),
                "attprojw" | "fcprojw" => normal_fill(key, lo, proj_std, dst),
                _ if t.decay => normal_fill(key, lo, 0.02, dst),
                _ => dst.fill(0.0),
            }
        }
    }

    /// Where this rank's layout sits in the whole model's: runs in local order, adjacent ones
    /// merged (one run without tensor parallelism). A split matrix contributes a run per row
    /// (column-split: `attprojw`, `fcprojw`) or per q/k/v block (`qkvw`, `qkvb`).
    pub fn whole_runs(&self) -> Vec<WholeRun> {
        let (c, r) = (self.n_embd, self.tp.rank);
        let (cl, fl) = (self.local_embd(), self.local_mlp());
        let mut runs: Vec<WholeRun> = Vec::new();
        let mut push = |local: usize, whole: usize, len: usize, split: bool| {
            if let Some(last) = runs.last_mut() {
                if last.split == split && last.local + last.len == local && last.whole + last.len == whole {
                    last.len += len;
                    return;
                }
            }
            runs.push(WholeRun { local, whole, len, split });
        };
        let whole: std::collections::HashMap<String, TensorInfo> =
            self.whole().tensors().into_iter().map(|t| (t.name.clone(), t)).collect();
        for lt in self.tensors() {
            let wt = &whole[&lt.name];
            let (lo, wo) = (lt.offset, wt.offset);
            let split = self.tp.size > 1 && tp_split(short_name(&lt.name));
            match short_name(&lt.name) {
                "qkvw" if split => (0..3).for_each(|j| push(lo + j * cl * c, wo + (j * c + r * cl) * c, cl * c, true)),
                "qkvb" if split => (0..3).for_each(|j| push(lo + j * cl, wo + j * c + r * cl, cl, true)),
                "attprojw" if split => (0..c).for_each(|o| push(lo + o * cl, wo + o * c + r * cl, cl, true)),
                "fcw" if split => push(lo, wo + r * fl * c, fl * c, true),
                "fcb" if split => push(lo, wo + r * fl, fl, true),
                "fcprojw" if split => (0..c).for_each(|o| push(lo + o * fl, wo + o * 4 * c + r * fl, fl, true)),
                _ => push(lo, wo, lt.len, false),
            }
        }
        runs
    }

    /// This rank's part of a vector over the whole model's layout (a checkpoint's weights or
    /// moments).
    pub fn local_of(&self, whole: &[f32]) -> Vec<f32> {
        if self.tp.size == 1 && self.pp.stages == 1 {
            return whole.to_vec();
        }
        let mut out = vec![0f32; self.num_params()];
        for r in self.whole_runs() {
            out[r.local..r.local + r.len].copy_from_slice(&whole[r.whole..r.whole + r.len]);
        }
        out
    }

    /// A whole-layout vector holding this rank's `local` values where it contributes them:
    /// its split runs, the replicated ones on tensor-parallel rank 0 only, `wte` from the first
    /// stage only (the last holds the tied copy); zeros elsewhere, so the sum over the
    /// tensor-parallel and pipeline groups is the whole vector.
    pub fn whole_part_of(&self, local: &[f32]) -> Vec<f32> {
        let mut out = vec![0f32; self.whole().num_params()];
        let tied_copy = !self.pp.is_first();
        for r in self.whole_runs() {
            let wte = r.whole < self.padded_vocab() * self.n_embd;
            if (r.split || self.tp.rank == 0) && !(wte && tied_copy) {
                out[r.whole..r.whole + r.len].copy_from_slice(&local[r.local..r.local + r.len]);
            }
        }
        out
    }
}

/// A tensor's name without its layer prefix (`h3.qkvw` → `qkvw`).
pub fn short_name(name: &str) -> &str {
    name.rsplit('.').next().unwrap_or(name)
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
        layer_param_sizes(self.n_embd, self.tp.size).iter().map(|t| t.1).collect()
    }

    /// The tied token embedding / classifier weights `wte` (first and last stage).
    pub fn wte_range(&self) -> Range<usize> {
        0..self.padded_vocab() * self.n_embd
    }

    /// `wte` and `wpe`, adjacent: what the encoder reads and writes gradients for (first
    /// stage).
    pub fn embed_range(&self) -> Range<usize> {
        0..(self.padded_vocab() + self.block_size) * self.n_embd
    }

    /// Block `l`'s twelve tensors, contiguous in the layer-major layout (`l` one of the
    /// stage's layers).
    pub fn layer_range(&self, l: usize) -> Range<usize> {
        let layers = self.stage_layers();
        debug_assert!(layers.contains(&l), "layer {l} is not on stage {:?}", self.pp);
        let base = if self.pp.is_first() {
            self.embed_range().end
        } else if self.pp.is_last() {
            self.wte_range().end
        } else {
            0
        };
        let start = base + (l - layers.start) * self.layer_params();
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Nothing kept from forward to backward grows with T²: doubling the sequence doubles every
    /// per-layer and global activation (attention keeps its (B,NH,T) log-sum-exp, not (T,T)
    /// probabilities), and so does the estimator's activation figure.
    #[test]
    fn every_kept_activation_is_linear_in_the_sequence_length() {
        let cfg = GptConfig {
            n_layer: 2,
            n_head: 4,
            n_embd: 32,
            block_size: 512,
            vocab: 50,
            tp: TpShard::NONE,
            pp: PpStage::NONE,
        };
        for (short, long) in layer_activation_sizes(&cfg, 3, 128).iter().zip(layer_activation_sizes(&cfg, 3, 256)) {
            assert_eq!((short.0, 2 * short.1), long, "layer activation {}", short.0);
        }
        for (short, long) in global_activation_sizes(&cfg, 3, 128).iter().zip(global_activation_sizes(&cfg, 3, 256)) {
            assert_eq!((short.0, 2 * short.1), long, "global activation {}", short.0);
        }
        let lse = layer_activation_sizes(&cfg, 3, 128).into_iter().find(|(name, _)| *name == "att_lse");
        assert_eq!(lse, Some(("att_lse", 3 * 4 * 128)), "one f32 per (sequence, head, query)");
        assert_eq!(activation_width("att_lse", 2), 4, "kept in f32 under 16-bit storage");
    }

    /// Over a grid of tensor-parallel ranks and pipeline stages, each whole-layout element is
    /// held where the split says (a block's split tensors by one tensor-parallel rank of one
    /// stage, its replicated ones by every rank of that stage, `wte` by the first and the last
    /// stage); `local_of` and `whole_part_of` are inverse and the parts sum to the whole;
    /// initialising a share = that share of the whole initialisation.
    #[test]
    fn tensor_and_pipeline_shares_tile_the_whole_layout() {
        let whole = GptConfig {
            n_layer: 5,
            n_head: 4,
            n_embd: 16,
            block_size: 8,
            vocab: 24,
            tp: TpShard::NONE,
            pp: PpStage::NONE,
        };
        let n = whole.num_params();
        let values: Vec<f32> = (0..n).map(|i| i as f32).collect();
        let mut whole_init = vec![0f32; n];
        whole.init_range(7, 0..n, &mut whole_init);
        assert_eq!(whole.whole_runs(), [WholeRun { local: 0, whole: 0, len: n, split: false }]);
        for (size, stages) in [(1, 1), (2, 1), (4, 1), (1, 2), (1, 3), (2, 2), (1, 5)] {
            let mut covered = vec![0usize; n];
            let mut sum = vec![0f32; n];
            let mut layers = Vec::new();
            for stage in 0..stages {
                for rank in 0..size {
                    let cfg = whole.with_tp(TpShard { rank, size }).with_pp(PpStage { stage, stages });
                    if rank == 0 {
                        layers.extend(cfg.stage_layers());
                    }
                    let runs = cfg.whole_runs();
                    assert_eq!(runs.iter().map(|r| r.len).sum::<usize>(), cfg.num_params());
                    assert!(runs.windows(2).all(|w| w[0].local + w[0].len == w[1].local), "runs in local order");
                    for r in &runs {
                        covered[r.whole..r.whole + r.len].iter_mut().for_each(|c| *c += 1);
                    }
                    for l in cfg.stage_layers() {
                        let range = cfg.layer_range(l);
                        let at = cfg.tensors().iter().find(|t| t.name == format!("h{l}.ln1w")).unwrap().offset;
                        assert_eq!(range.start, at, "layer {l} on stage {stage}");
                    }
                    let local = cfg.local_of(&values);
                    assert_eq!(local.len(), cfg.num_params());
                    sum.iter_mut().zip(&cfg.whole_part_of(&local)).for_each(|(s, p)| *s += p);
                    let mut init = vec![0f32; cfg.num_params()];
                    cfg.init_range(7, 0..init.len(), &mut init);
                    assert_eq!(init, cfg.local_of(&whole_init), "tp {size} stage {stage}/{stages} rank {rank}: init");
                }
            }
            assert_eq!(layers, (0..whole.n_layer).collect::<Vec<_>>(), "every layer on one stage, in order");
            for t in whole.tensors() {
                let holders = if t.name == "wte" && stages > 1 { 2 } else { 1 };
                let want = if size > 1 && tp_split(short_name(&t.name)) { holders } else { holders * size };
                assert!(
                    covered[t.offset..t.offset + t.len].iter().all(|&c| c == want),
                    "tp {size} pp {stages}: {}",
                    t.name
                );
            }
            assert_eq!(sum, values, "tp {size} pp {stages}: the ranks' parts sum to the whole");
        }
    }
}
