//! The GPT-2 model: size tables (the one source of truth for tensor sizes), parameter layout,
//! initialisation, and the forward / backward passes over pool-allocated buffers.
//!
//! Parameters are laid out layer-major in one flat fp32 buffer:
//! `wte (V,C) | wpe (maxT,C) | layer 0 … layer L-1 | lnfw (C) | lnfb (C)`, each layer being
//! `ln1w ln1b qkvw qkvb attprojw attprojb ln2w ln2b fcw fcb fcprojw fcprojb`. The same order is
//! the checkpoint's canonical layout.

use crate::config::{Checkpointing, OffloadTarget};
use std::ops::Range;

use crate::memory::{Buffer, Category, OomError, Pool};

use super::layers::*;
use super::placement::{GradSink, ParamSource};
use super::rng::Rng;

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
#[derive(Debug, Clone)]
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

/// The (in, out) feature sizes of every matmul of the model.
fn matmul_shapes(cfg: &GptConfig) -> [(usize, usize); 5] {
    let c = cfg.n_embd;
    [(c, 3 * c), (c, c), (c, 4 * c), (4 * c, c), (c, cfg.vocab)]
}

/// f32 scratch elements a forward pass needs (attention score rows, widened matmul operands).
pub fn forward_scratch_elems<E: Elem>(cfg: &GptConfig, b: usize, t: usize) -> usize {
    let bt = b * t;
    let mm = matmul_shapes(cfg).iter().map(|&(i, o)| matmul_forward_scratch::<E>(bt, i, o)).max().unwrap_or(0);
    mm.max(attention_forward_scratch(b, t, cfg.n_head))
}

/// f32 scratch elements a backward pass needs (including recomputing a block's forward).
pub fn backward_scratch_elems<E: Elem>(cfg: &GptConfig, b: usize, t: usize) -> usize {
    let bt = b * t;
    let mm = matmul_shapes(cfg).iter().map(|&(i, o)| matmul_backward_scratch::<E>(bt, i, o)).max().unwrap_or(0);
    mm.max(attention_backward_scratch::<E>(b, t, cfg.n_embd, cfg.n_head)).max(forward_scratch_elems::<E>(cfg, b, t))
}

impl GptConfig {
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
        let mut rng = Rng::new(seed);
        let proj_std = 0.02 / (2.0 * self.n_layer as f64).sqrt();
        for t in self.tensors() {
            let dst = &mut params[t.offset..t.offset + t.len];
            let short = t.name.rsplit('.').next().unwrap_or(&t.name);
            match short {
                "ln1w" | "ln2w" | "lnfw" => dst.fill(1.0),
                "attprojw" | "fcprojw" => dst.iter_mut().for_each(|x| *x = (rng.normal() * proj_std) as f32),
                _ if t.decay => dst.iter_mut().for_each(|x| *x = (rng.normal() * 0.02) as f32),
                _ => dst.fill(0.0),
            }
        }
    }
}

/// Split a flat slice into consecutive pieces of the given sizes.
fn split_sizes<'a, T>(mut s: &'a [T], sizes: &[usize]) -> Vec<&'a [T]> {
    sizes
        .iter()
        .map(|&n| {
            let (head, tail) = s.split_at(n);
            s = tail;
            head
        })
        .collect()
}

fn split_sizes_mut<'a, T>(mut s: &'a mut [T], sizes: &[usize]) -> Vec<&'a mut [T]> {
    sizes
        .iter()
        .map(|&n| {
            let (head, tail) = std::mem::take(&mut s).split_at_mut(n);
            s = tail;
            head
        })
        .collect()
}

/// Views of one layer's parameters (or gradients: `T = &mut [f32]`).
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

    /// Views of one block's tensors in a slice holding exactly `layer_range(l)`.
    pub fn layer_view<'a, T>(&self, flat: &'a [T]) -> LayerTensors<&'a [T]> {
        LayerTensors::from_vec(split_sizes(flat, &self.layer_sizes()))
    }

    pub fn layer_view_mut<'a, T>(&self, flat: &'a mut [T]) -> LayerTensors<&'a mut [T]> {
        LayerTensors::from_vec(split_sizes_mut(flat, &self.layer_sizes()))
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

/// Activations one block keeps for its backward pass (statistics f32, the rest in `E`).
pub struct LayerActs {
    pub ln1: Buffer,
    pub ln1_mean: Buffer,
    pub ln1_rstd: Buffer,
    pub qkv: Buffer,
    pub att: Buffer,
    pub atty: Buffer,
    pub residual2: Buffer,
    pub ln2: Buffer,
    pub ln2_mean: Buffer,
    pub ln2_rstd: Buffer,
    pub fch: Buffer,
    pub fch_gelu: Buffer,
    pub residual3: Buffer,
}

/// What `selective` checkpointing keeps of a block: all but ln1, ln2 and fch_gelu.
pub struct SelectiveActs {
    pub ln1_mean: Buffer,
    pub ln1_rstd: Buffer,
    pub qkv: Buffer,
    pub att: Buffer,
    pub atty: Buffer,
    pub residual2: Buffer,
    pub ln2_mean: Buffer,
    pub ln2_rstd: Buffer,
    pub fch: Buffer,
    pub residual3: Buffer,
}

/// A block's activations as kept between forward and backward.
pub enum KeptLayer {
    All(Box<LayerActs>),
    Selective(Box<SelectiveActs>),
    /// Only the block output (`full` checkpointing).
    Output(Buffer),
    /// The block output moved to host memory (`offload.activations`).
    Host(HostTensor),
    /// Being copied back to the device by the copy worker (prefetch during backward).
    InFlight,
    /// Not kept: the pass is not followed by a backward (evaluation).
    Released,
}

/// A (rows, C) tensor in host memory, as stored or compressed to int8 with a scale per row.
pub enum HostTensor {
    Plain { bytes: Vec<u8> },
    Int8 { q: Vec<i8>, scales: Vec<f32>, elem_bytes: usize },
}

/// Bytes moved between device and host in one step, and the time the copies took.
#[derive(Debug, Clone, Copy, Default)]
pub struct SwapStats {
    pub bytes_to_host: usize,
    pub bytes_to_device: usize,
    pub transfer_ms: f64,
}

impl SwapStats {
    pub fn add(&mut self, o: SwapStats) {
        self.bytes_to_host += o.bytes_to_host;
        self.bytes_to_device += o.bytes_to_device;
        self.transfer_ms += o.transfer_ms;
    }
}

impl HostTensor {
    /// Copy a device buffer of `E` to the host (compressing to int8 rows of `c` if asked).
    fn from_device<E: Elem>(buf: &Buffer, c: usize, int8: bool) -> HostTensor {
        if !int8 {
            return HostTensor::Plain { bytes: buf.bytes().to_vec() };
        }
        let x = buf.as_slice::<E>();
        let mut q = vec![0i8; x.len()];
        let mut scales = vec![0f32; x.len() / c];
        pack_int8(&mut q, &mut scales, x, c);
        HostTensor::Int8 { q, scales, elem_bytes: E::BYTES }
    }

    /// Bytes held on the host.
    pub fn host_bytes(&self) -> usize {
        match self {
            HostTensor::Plain { bytes } => bytes.len(),
            HostTensor::Int8 { q, scales, .. } => q.len() + 4 * scales.len(),
        }
    }

    /// Device bytes of the restored tensor.
    fn device_bytes(&self) -> usize {
        match self {
            HostTensor::Plain { bytes } => bytes.len(),
            HostTensor::Int8 { q, elem_bytes, .. } => q.len() * elem_bytes,
        }
    }

    /// Bring the tensor back into a fresh device buffer.
    fn to_device<E: Elem>(&self, pool: &Pool, c: usize) -> Result<Buffer, OomError> {
        let mut buf = pool.alloc(self.device_bytes(), Category::Activations)?;
        self.fill::<E>(&mut buf, c);
        Ok(buf)
    }

    /// Copy (and decompress) into a device buffer of `device_bytes()`.
    fn fill<E: Elem>(&self, buf: &mut Buffer, c: usize) {
        match self {
            HostTensor::Plain { bytes } => buf.bytes_mut().copy_from_slice(bytes),
            HostTensor::Int8 { q, scales, .. } => unpack_int8(buf.as_mut_slice::<E>(), q, scales, c),
        }
    }
}

/// Host bytes of every offloaded block output.
fn host_activation_bytes(layers: &[KeptLayer]) -> usize {
    layers.iter().map(|k| if let KeptLayer::Host(h) = k { h.host_bytes() } else { 0 }).sum()
}

impl KeptLayer {
    fn keep(a: LayerActs, mode: Checkpointing) -> KeptLayer {
        match mode {
            Checkpointing::None => KeptLayer::All(Box::new(a)),
            Checkpointing::Selective => KeptLayer::Selective(Box::new(SelectiveActs {
                ln1_mean: a.ln1_mean,
                ln1_rstd: a.ln1_rstd,
                qkv: a.qkv,
                att: a.att,
                atty: a.atty,
                residual2: a.residual2,
                ln2_mean: a.ln2_mean,
                ln2_rstd: a.ln2_rstd,
                fch: a.fch,
                residual3: a.residual3,
            })),
            Checkpointing::Full => KeptLayer::Output(a.residual3),
        }
    }

    /// The block output: the next block's input.
    pub fn output<E: Elem>(&self) -> &[E] {
        match self {
            KeptLayer::All(a) => a.residual3.as_slice(),
            KeptLayer::Selective(s) => s.residual3.as_slice(),
            KeptLayer::Output(o) => o.as_slice(),
            KeptLayer::Host(_) | KeptLayer::InFlight => unreachable!("offloaded outputs are restored before use"),
            KeptLayer::Released => unreachable!("released outputs are never read again"),
        }
    }
}

/// Everything a forward pass keeps: inputs, per-layer activations, head outputs, losses.
pub struct Activations {
    pub b: usize,
    pub t: usize,
    pub inputs: Buffer,
    pub targets: Buffer,
    pub encoded: Buffer,
    pub layers: Vec<KeptLayer>,
    pub lnf: Buffer,
    pub lnf_mean: Buffer,
    pub lnf_rstd: Buffer,
    /// Logits, then probabilities after the loss, then logit gradients in backward.
    pub logits: Option<Buffer>,
    pub losses: Buffer,
    /// Host traffic of activation offload so far in this forward/backward pair.
    pub swap: SwapStats,
    pub offload: OffloadTarget,
}

impl Activations {
    /// Mean cross-entropy over the batch (f64 accumulation).
    pub fn mean_loss(&self) -> f32 {
        let l = self.losses.as_slice::<f32>();
        (l.iter().map(|&x| x as f64).sum::<f64>() / l.len() as f64) as f32
    }
}

/// One activation tensor by name, sized from the tables.
fn alloc_act<E: Elem>(pool: &Pool, name: &str, elems: usize) -> Result<Buffer, OomError> {
    pool.alloc(elems * activation_width(name, E::BYTES), Category::Activations)
}

fn alloc_layer_acts<E: Elem>(cfg: &GptConfig, pool: &Pool, b: usize, t: usize) -> Result<LayerActs, OomError> {
    let sizes = layer_activation_sizes(cfg, b, t);
    let mut bufs = Vec::with_capacity(sizes.len());
    for (name, n) in sizes {
        bufs.push(alloc_act::<E>(pool, name, n)?);
    }
    let mut it = bufs.into_iter();
    let mut next = || it.next().expect("13 activation tensors");
    Ok(LayerActs {
        ln1: next(),
        ln1_mean: next(),
        ln1_rstd: next(),
        qkv: next(),
        att: next(),
        atty: next(),
        residual2: next(),
        ln2: next(),
        ln2_mean: next(),
        ln2_rstd: next(),
        fch: next(),
        fch_gelu: next(),
        residual3: next(),
    })
}

/// Forward pass. params: the compute copy in `E`; inputs, targets: (B,T) token ids. Returns
/// the activations with losses filled.
#[allow(clippy::too_many_arguments)]
pub fn forward<E: Elem>(
    cfg: &GptConfig,
    params: &dyn ParamSource<E>,
    pool: &Pool,
    inputs: &[u32],
    targets: &[u32],
    b: usize,
    t: usize,
    mode: Checkpointing,
    offload: OffloadTarget,
) -> Result<Activations, OomError> {
    forward_pass(cfg, params, pool, inputs, targets, b, t, mode, offload, false)
}

/// Mean loss of a forward pass that keeps nothing for backward (evaluation): each block's
/// output is released as soon as the next block has consumed it.
#[allow(clippy::too_many_arguments)]
pub fn forward_loss<E: Elem>(
    cfg: &GptConfig,
    params: &dyn ParamSource<E>,
    pool: &Pool,
    inputs: &[u32],
    targets: &[u32],
    b: usize,
    t: usize,
) -> Result<f32, OomError> {
    let acts = forward_pass(cfg, params, pool, inputs, targets, b, t, Checkpointing::Full, OffloadTarget::None, true)?;
    Ok(acts.mean_loss())
}

#[allow(clippy::too_many_arguments)]
fn forward_pass<E: Elem>(
    cfg: &GptConfig,
    params: &dyn ParamSource<E>,
    pool: &Pool,
    inputs: &[u32],
    targets: &[u32],
    b: usize,
    t: usize,
    mode: Checkpointing,
    offload: OffloadTarget,
    release_outputs: bool,
) -> Result<Activations, OomError> {
    let (c, nh, v) = (cfg.n_embd, cfg.n_head, cfg.vocab);
    let mut swap = SwapStats::default();
    let bt = b * t;
    let g = global_activation_sizes(cfg, b, t);
    let mut input_buf = alloc_act::<E>(pool, g[0].0, g[0].1)?;
    input_buf.as_mut_slice::<u32>().copy_from_slice(inputs);
    let mut target_buf = alloc_act::<E>(pool, g[1].0, g[1].1)?;
    target_buf.as_mut_slice::<u32>().copy_from_slice(targets);
    let mut encoded = alloc_act::<E>(pool, g[2].0, g[2].1)?;
    {
        let w = params.fetch(cfg.embed_range(), (cfg.n_layer > 0).then(|| cfg.layer_range(0)))?;
        let (wte, wpe) = w.as_slice().split_at(v * c);
        encoder_forward::<E>(encoded.as_mut_slice(), inputs, wte, wpe, t, c);
    }
    let mut scratch = alloc_f32(pool, forward_scratch_elems::<E>(cfg, b, t), Category::Workspace)?;

    let mut layers: Vec<KeptLayer> = Vec::with_capacity(cfg.n_layer);
    for l in 0..cfg.n_layer {
        let mut a = alloc_layer_acts::<E>(cfg, pool, b, t)?;
        let w = params.fetch(cfg.layer_range(l), (l + 1 < cfg.n_layer).then(|| cfg.layer_range(l + 1)))?;
        let x = layers.last().map(KeptLayer::output::<E>).unwrap_or(encoded.as_slice());
        layer_forward(&cfg.layer_view(w.as_slice()), &mut a, x, scratch.as_mut_slice(), b, t, c, nh);
        drop(w);
        layers.push(KeptLayer::keep(a, mode));
        // The previous block's output has been consumed: release it, or move it to the host.
        if release_outputs && l >= 1 {
            layers[l - 1] = KeptLayer::Released;
        } else if offload != OffloadTarget::None && l >= 1 {
            let t0 = std::time::Instant::now();
            if let KeptLayer::Output(buf) = &layers[l - 1] {
                let host = HostTensor::from_device::<E>(buf, c, offload == OffloadTarget::CpuInt8);
                swap.bytes_to_host += host.host_bytes();
                layers[l - 1] = KeptLayer::Host(host);
            }
            swap.transfer_ms += t0.elapsed().as_secs_f64() * 1e3;
            pool.set_host_bytes(Category::Activations, host_activation_bytes(&layers));
        }
    }

    let mut lnf = alloc_act::<E>(pool, g[3].0, g[3].1)?;
    let mut lnf_mean = alloc_act::<E>(pool, g[4].0, g[4].1)?;
    let mut lnf_rstd = alloc_act::<E>(pool, g[5].0, g[5].1)?;
    let last = layers.last().map(KeptLayer::output::<E>).unwrap_or(encoded.as_slice());
    {
        let w = params.fetch(cfg.lnf_range(), None)?;
        let (lnfw, lnfb) = w.as_slice().split_at(c);
        layernorm_forward::<E>(
            lnf.as_mut_slice(),
            lnf_mean.as_mut_slice(),
            lnf_rstd.as_mut_slice(),
            last,
            lnfw,
            lnfb,
            c,
        );
    }
    let mut logits = alloc_act::<E>(pool, g[6].0, g[6].1)?;
    {
        let wte = params.fetch(cfg.wte_range(), None)?;
        matmul_forward::<E>(
            logits.as_mut_slice(),
            lnf.as_slice(),
            wte.as_slice(),
            None,
            bt,
            c,
            v,
            scratch.as_mut_slice(),
        );
    }
    drop(scratch);
    let mut losses = alloc_act::<E>(pool, g[7].0, g[7].1)?;
    crossentropy_forward::<E>(logits.as_mut_slice(), losses.as_mut_slice(), targets, v);
    Ok(Activations {
        b,
        t,
        inputs: input_buf,
        targets: target_buf,
        encoded,
        layers,
        lnf,
        lnf_mean,
        lnf_rstd,
        logits: Some(logits),
        losses,
        swap,
        offload,
    })
}

/// Rebuild a block's full activations from what checkpointing kept (bitwise the same values,
/// since the recomputation runs the same kernels on the same inputs).
#[allow(clippy::too_many_arguments)]
fn recompute<E: Elem>(
    cfg: &GptConfig,
    pool: &Pool,
    p: &LayerTensors<&[E]>,
    kept: KeptLayer,
    x: &[E],
    scratch: &mut [f32],
    b: usize,
    t: usize,
) -> Result<LayerActs, OomError> {
    let (c, nh) = (cfg.n_embd, cfg.n_head);
    let full = |pool: &Pool, scratch: &mut [f32]| -> Result<LayerActs, OomError> {
        let mut a = alloc_layer_acts::<E>(cfg, pool, b, t)?;
        layer_forward(p, &mut a, x, scratch, b, t, c, nh);
        Ok(a)
    };
    match kept {
        KeptLayer::All(a) => Ok(*a),
        KeptLayer::Selective(s) => {
            let sizes = layer_activation_sizes(cfg, b, t);
            let size = |name: &str| sizes.iter().find(|e| e.0 == name).expect("size table entry").1;
            let mut ln1 = alloc_act::<E>(pool, "ln1", size("ln1"))?;
            layernorm_recompute::<E>(
                ln1.as_mut_slice(),
                x,
                p.ln1w,
                p.ln1b,
                s.ln1_mean.as_slice(),
                s.ln1_rstd.as_slice(),
                c,
            );
            let mut ln2 = alloc_act::<E>(pool, "ln2", size("ln2"))?;
            layernorm_recompute::<E>(
                ln2.as_mut_slice(),
                s.residual2.as_slice(),
                p.ln2w,
                p.ln2b,
                s.ln2_mean.as_slice(),
                s.ln2_rstd.as_slice(),
                c,
            );
            let mut fch_gelu = alloc_act::<E>(pool, "fch_gelu", size("fch_gelu"))?;
            gelu_forward::<E>(fch_gelu.as_mut_slice(), s.fch.as_slice());
            Ok(LayerActs {
                ln1,
                ln1_mean: s.ln1_mean,
                ln1_rstd: s.ln1_rstd,
                qkv: s.qkv,
                att: s.att,
                atty: s.atty,
                residual2: s.residual2,
                ln2,
                ln2_mean: s.ln2_mean,
                ln2_rstd: s.ln2_rstd,
                fch: s.fch,
                fch_gelu,
                residual3: s.residual3,
            })
        }
        KeptLayer::Output(out) => {
            // Free the kept output first: the block is recomputed from `x`.
            drop(out);
            full(pool, scratch)
        }
        KeptLayer::Host(_) | KeptLayer::InFlight | KeptLayer::Released => full(pool, scratch),
    }
}

/// One transformer block forward. x: (B,T,C) block input; fills every tensor of `a`.
#[allow(clippy::too_many_arguments)]
fn layer_forward<E: Elem>(
    p: &LayerTensors<&[E]>,
    a: &mut LayerActs,
    x: &[E],
    scratch: &mut [f32],
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
) {
    let bt = b * t;
    layernorm_forward::<E>(
        a.ln1.as_mut_slice(),
        a.ln1_mean.as_mut_slice(),
        a.ln1_rstd.as_mut_slice(),
        x,
        p.ln1w,
        p.ln1b,
        c,
    );
    matmul_forward::<E>(a.qkv.as_mut_slice(), a.ln1.as_slice(), p.qkvw, Some(p.qkvb), bt, c, 3 * c, scratch);
    attention_forward::<E>(a.atty.as_mut_slice(), a.att.as_mut_slice(), a.qkv.as_slice(), scratch, b, t, c, nh);
    matmul_forward::<E>(a.residual2.as_mut_slice(), a.atty.as_slice(), p.attprojw, Some(p.attprojb), bt, c, c, scratch);
    residual_forward_inplace::<E>(a.residual2.as_mut_slice(), x);
    layernorm_forward::<E>(
        a.ln2.as_mut_slice(),
        a.ln2_mean.as_mut_slice(),
        a.ln2_rstd.as_mut_slice(),
        a.residual2.as_slice(),
        p.ln2w,
        p.ln2b,
        c,
    );
    matmul_forward::<E>(a.fch.as_mut_slice(), a.ln2.as_slice(), p.fcw, Some(p.fcb), bt, c, 4 * c, scratch);
    gelu_forward::<E>(a.fch_gelu.as_mut_slice(), a.fch.as_slice());
    matmul_forward::<E>(
        a.residual3.as_mut_slice(),
        a.fch_gelu.as_slice(),
        p.fcprojw,
        Some(p.fcprojb),
        bt,
        4 * c,
        c,
        scratch,
    );
    residual_forward_inplace::<E>(a.residual3.as_mut_slice(), a.residual2.as_slice());
}

/// Backward pass: consumes the activations (freeing each block's as soon as it is done) and
/// accumulates parameter gradients into `grads`. `dloss` is d(objective)/d(loss at one position),
/// e.g. 1 / (B·T·grad_accum) for a mean over the global batch (times the loss scale for fp16).
pub fn backward<E: Elem>(
    cfg: &GptConfig,
    params: &dyn ParamSource<E>,
    grads: &mut dyn GradSink<E>,
    pool: &Pool,
    mut acts: Activations,
    dloss: f32,
) -> Result<SwapStats, OomError> {
    let (c, nh, v) = (cfg.n_embd, cfg.n_head, cfg.vocab);
    let (b, t) = (acts.b, acts.t);
    let bt = b * t;
    let ws = backward_workspace_sizes(cfg, b, t);
    let mut dres = alloc_elems::<E>(pool, ws[0].1, Category::Workspace)?;
    let mut dsmall = alloc_elems::<E>(pool, ws[1].1, Category::Workspace)?;
    let mut dfch = alloc_elems::<E>(pool, ws[2].1, Category::Workspace)?;
    let mut dqkv = alloc_elems::<E>(pool, ws[3].1, Category::Workspace)?;
    let mut scratch_buf = alloc_f32(pool, backward_scratch_elems::<E>(cfg, b, t), Category::Workspace)?;
    let scratch = scratch_buf.as_mut_slice::<f32>();

    // Head: loss -> logits -> lnf.
    let mut logits = acts.logits.take().expect("forward fills logits");
    crossentropy_backward_inplace::<E>(logits.as_mut_slice(), acts.targets.as_slice(), dloss, v);
    {
        let wte = params.fetch(cfg.wte_range(), None)?;
        let gwte = grads.open(cfg.wte_range())?;
        let (dlogits, lnf) = (logits.as_slice(), acts.lnf.as_slice());
        matmul_backward::<E>(dsmall.as_mut_slice(), gwte, None, dlogits, lnf, wte.as_slice(), bt, c, v, scratch);
        grads.close(cfg.wte_range());
    }
    drop(logits);
    dres.as_mut_slice::<E>().fill(E::default());
    {
        let last = acts.layers.last().map(KeptLayer::output::<E>).unwrap_or(acts.encoded.as_slice());
        let w = params.fetch(cfg.lnf_range(), cfg.n_layer.checked_sub(1).map(|l| cfg.layer_range(l)))?;
        let g = grads.open(cfg.lnf_range())?;
        let (glnfw, glnfb) = g.split_at_mut(c);
        layernorm_backward::<E>(
            dres.as_mut_slice(),
            glnfw,
            glnfb,
            dsmall.as_slice(),
            last,
            &w.as_slice()[..c],
            acts.lnf_mean.as_slice(),
            acts.lnf_rstd.as_slice(),
            c,
        );
        grads.close(cfg.lnf_range());
    }

    let mut prefetch: Option<std::thread::JoinHandle<(Buffer, f64)>> = None;
    for l in (0..cfg.n_layer).rev() {
        let kept = acts.layers.pop().expect("one KeptLayer per layer");
        // This block's input (the previous block's output) must be on the device: prefetched by
        // the copy worker during the previous iteration, or restored now.
        if let Some(slot) = acts.layers.last_mut() {
            match slot {
                KeptLayer::InFlight => {
                    let (buf, ms) = prefetch.take().expect("a prefetch is in flight").join().expect("copy worker");
                    acts.swap.transfer_ms += ms;
                    *slot = KeptLayer::Output(buf);
                }
                KeptLayer::Host(h) => {
                    let t0 = std::time::Instant::now();
                    let buf = h.to_device::<E>(pool, c)?;
                    acts.swap.bytes_to_device += h.host_bytes();
                    acts.swap.transfer_ms += t0.elapsed().as_secs_f64() * 1e3;
                    *slot = KeptLayer::Output(buf);
                }
                _ => {}
            }
        }
        // Start bringing back the input of the block after this one, overlapping this backward.
        let n = acts.layers.len();
        if n >= 2 && matches!(acts.layers[n - 2], KeptLayer::Host(_)) {
            let KeptLayer::Host(h) = std::mem::replace(&mut acts.layers[n - 2], KeptLayer::InFlight) else {
                unreachable!("checked above")
            };
            let mut buf = pool.alloc(h.device_bytes(), Category::Activations)?;
            acts.swap.bytes_to_device += h.host_bytes();
            prefetch = Some(std::thread::spawn(move || {
                let t0 = std::time::Instant::now();
                h.fill::<E>(&mut buf, c);
                (buf, t0.elapsed().as_secs_f64() * 1e3)
            }));
        }
        if acts.offload != OffloadTarget::None {
            pool.set_host_bytes(Category::Activations, host_activation_bytes(&acts.layers));
        }
        let x = acts.layers.last().map(KeptLayer::output::<E>).unwrap_or(acts.encoded.as_slice());
        let w = params.fetch(cfg.layer_range(l), l.checked_sub(1).map(|l| cfg.layer_range(l)))?;
        let pl = &cfg.layer_view(w.as_slice());
        let a = recompute::<E>(cfg, pool, pl, kept, x, scratch, b, t)?;
        let gl = cfg.layer_view_mut(grads.open(cfg.layer_range(l))?);
        // MLP: residual3 = residual2 + fcproj(gelu(fc(ln2(residual2))))
        matmul_backward::<E>(
            dfch.as_mut_slice(),
            gl.fcprojw,
            Some(gl.fcprojb),
            dres.as_slice(),
            a.fch_gelu.as_slice(),
            pl.fcprojw,
            bt,
            4 * c,
            c,
            scratch,
        );
        gelu_backward_inplace::<E>(dfch.as_mut_slice(), a.fch.as_slice());
        matmul_backward::<E>(
            dsmall.as_mut_slice(),
            gl.fcw,
            Some(gl.fcb),
            dfch.as_slice(),
            a.ln2.as_slice(),
            pl.fcw,
            bt,
            c,
            4 * c,
            scratch,
        );
        layernorm_backward::<E>(
            dres.as_mut_slice(),
            gl.ln2w,
            gl.ln2b,
            dsmall.as_slice(),
            a.residual2.as_slice(),
            pl.ln2w,
            a.ln2_mean.as_slice(),
            a.ln2_rstd.as_slice(),
            c,
        );
        // Attention: residual2 = x + attproj(attention(qkv(ln1(x))))
        matmul_backward::<E>(
            dsmall.as_mut_slice(),
            gl.attprojw,
            Some(gl.attprojb),
            dres.as_slice(),
            a.atty.as_slice(),
            pl.attprojw,
            bt,
            c,
            c,
            scratch,
        );
        attention_backward::<E>(
            dqkv.as_mut_slice(),
            scratch,
            dsmall.as_slice(),
            a.qkv.as_slice(),
            a.att.as_slice(),
            b,
            t,
            c,
            nh,
        );
        matmul_backward::<E>(
            dsmall.as_mut_slice(),
            gl.qkvw,
            Some(gl.qkvb),
            dqkv.as_slice(),
            a.ln1.as_slice(),
            pl.qkvw,
            bt,
            c,
            3 * c,
            scratch,
        );
        layernorm_backward::<E>(
            dres.as_mut_slice(),
            gl.ln1w,
            gl.ln1b,
            dsmall.as_slice(),
            x,
            pl.ln1w,
            a.ln1_mean.as_slice(),
            a.ln1_rstd.as_slice(),
            c,
        );
        drop(a);
        grads.close(cfg.layer_range(l));
    }
    let inputs = acts.inputs.as_slice::<u32>();
    let g = grads.open(cfg.embed_range())?;
    let (gwte, gwpe) = g.split_at_mut(v * c);
    encoder_backward::<E>(gwte, gwpe, dres.as_slice(), inputs, t, c);
    grads.close(cfg.embed_range());
    if acts.offload != OffloadTarget::None {
        pool.set_host_bytes(Category::Activations, 0);
    }
    Ok(acts.swap)
}
