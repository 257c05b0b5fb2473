//! The passes: `forward` (keeps a `KeptLayer` per block, or hands block inputs to the host),
//! `forward_loss` for evaluation, and `backward` (recomputing what checkpointing dropped), as
//! backend calls on views of pool buffers; weights come through a `ParamSource` and gradients
//! go to a `GradSink`, one segment at a time. Under tensor parallelism (`TensorGroup`) a block
//! computes its rank's heads and MLP features, and the partial sums of the row-parallel
//! projections (forward) and of the column-parallel inputs' gradients (backward) are summed
//! over the group.

use crate::config::{Checkpointing, OffloadTarget};
use crate::engine::backend::layers::*;
use crate::engine::backend::{Backend, BackendResult, View, ViewMut};
use crate::engine::parallel::comm::{Comm, Group};
use crate::engine::parallel::placement::{GradSink, ParamSource};
use crate::engine::parallel::SwapStats;
use crate::memory::{Buffer, Category, OomError, Pool};

use super::*;

/// The tensor-parallel group of a pass (Megatron-style): each rank holds its share of every
/// block's heads and MLP features (`GptConfig::tp`), and the two sums per block per pass run
/// over this group. `TensorGroup::none()`: no tensor parallelism.
pub struct TensorGroup<'a> {
    group: Option<&'a Group>,
    /// Host traffic of the sums when staged through the host (a device without native
    /// collectives for the group).
    moved: std::cell::Cell<SwapStats>,
}

impl<'a> TensorGroup<'a> {
    pub fn none() -> TensorGroup<'static> {
        TensorGroup { group: None, moved: Default::default() }
    }

    pub fn of(group: Option<&'a Group>) -> TensorGroup<'a> {
        TensorGroup { group: group.filter(|g| g.world() > 1), moved: Default::default() }
    }

    /// Whether this rank adds a row-parallel projection's bias: one rank does (rank 0), so the
    /// sum over the group holds it once.
    fn adds_bias(&self) -> bool {
        self.group.is_none_or(|g| g.rank() == 0)
    }

    /// Every rank's `buf` becomes the sum over the group (a collective of the group).
    fn sum<E: Elem, B: Backend>(&self, be: &B, buf: ViewMut<E>) -> BackendResult {
        if let Some(g) = self.group {
            let mut moved = self.moved.get();
            moved.add(g.all_reduce_sum_on::<E, B>(be, buf)?);
            self.moved.set(moved);
        }
        Ok(())
    }

    /// The host traffic of the sums so far, handed over (and reset).
    fn take_moved(&self) -> SwapStats {
        self.moved.take()
    }
}

/// Activations one block keeps for its backward pass (statistics f32, the rest in `E`).
pub struct LayerActs {
    pub ln1: Buffer,
    pub ln1_mean: Buffer,
    pub ln1_rstd: Buffer,
    pub qkv: Buffer,
    /// (B,NH,T) f32: the attention rows' log-sum-exp, from which backward recomputes the
    /// probabilities (no (B,NH,T,T) tensor is kept).
    pub att_lse: Buffer,
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
    /// (B,NH,T) f32: the attention rows' log-sum-exp, from which backward recomputes the
    /// probabilities (no (B,NH,T,T) tensor is kept).
    pub att_lse: Buffer,
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

impl HostTensor {
    /// Copy a device buffer of `E` to the host (compressed on the device to int8 rows of `c`
    /// first if asked, so only the int8 bytes and scales cross the bus).
    fn from_device<E: Elem, B: Backend>(be: &B, buf: &Buffer, c: usize, int8: bool) -> BackendResult<HostTensor> {
        if !int8 {
            let mut bytes = vec![0u8; buf.len()];
            be.download(View::of(buf), &mut bytes)?;
            return Ok(HostTensor::Plain { bytes });
        }
        let n = buf.len() / E::BYTES;
        let mut q_dev = be.pool().alloc(n, Category::Workspace)?;
        let mut scales_dev = alloc_f32(be.pool(), n / c, Category::Workspace)?;
        be.pack_int8::<E>(ViewMut::of(&mut q_dev), ViewMut::of(&mut scales_dev), View::of(buf), c)?;
        let (mut q, mut scales) = (vec![0i8; n], vec![0f32; n / c]);
        be.download(View::of(&q_dev), &mut q)?;
        be.download(View::of(&scales_dev), &mut scales)?;
        Ok(HostTensor::Int8 { q, scales, elem_bytes: E::BYTES })
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

    /// Start bringing the tensor back into a fresh device buffer through the backend's copy
    /// stream (int8 goes as int8, to be expanded on the device when it lands).
    fn send_ahead<B: Backend>(&self, be: &B) -> BackendResult<Inbound<B::Fence>> {
        let pool = be.pool();
        let mut buf = pool.alloc(self.device_bytes(), Category::Activations)?;
        match self {
            HostTensor::Plain { bytes } => {
                let fence = be.upload_ahead(ViewMut::of(&mut buf), bytes)?;
                Ok(Inbound { buf, packed: None, fences: vec![fence] })
            }
            HostTensor::Int8 { q, scales, .. } => {
                let mut q_dev = pool.alloc(q.len(), Category::Workspace)?;
                let mut scales_dev = alloc_f32(pool, scales.len(), Category::Workspace)?;
                let q_fence = be.upload_ahead(ViewMut::of(&mut q_dev), q)?;
                let scales_fence = match be.upload_ahead(ViewMut::of(&mut scales_dev), scales) {
                    Ok(f) => f,
                    Err(e) => {
                        // The first copy must land before its buffer is freed.
                        be.wait_copy(q_fence)?;
                        return Err(e);
                    }
                };
                Ok(Inbound { buf, packed: Some((q_dev, scales_dev)), fences: vec![q_fence, scales_fence] })
            }
        }
    }

    /// Bring the tensor back into a fresh device buffer now.
    fn to_device<E: Elem, B: Backend>(&self, be: &B, c: usize) -> BackendResult<Buffer> {
        self.send_ahead(be)?.land::<E, B>(be, c)
    }

    /// Copy (and decompress) into a host-visible buffer of `device_bytes()`: what the copy
    /// worker runs, on its own thread, while the backward pass computes.
    fn fill_host<E: Elem>(&self, buf: &mut Buffer, c: usize) {
        match self {
            HostTensor::Plain { bytes } => buf.bytes_mut().copy_from_slice(bytes),
            HostTensor::Int8 { q, scales, .. } => unpack_int8(buf.as_mut_slice::<E>(), q, scales, c),
        }
    }
}

/// A block output on its way back to the device: its buffer, and for int8 the packed rows and
/// scales it is expanded from, being filled by copies ahead (`Backend::upload_ahead`).
struct Inbound<F> {
    buf: Buffer,
    packed: Option<(Buffer, Buffer)>,
    fences: Vec<F>,
}

impl<F> Inbound<F> {
    /// Order what follows after the copies (and expand int8 rows of `c`): the device buffer.
    fn land<E: Elem, B: Backend<Fence = F>>(self, be: &B, c: usize) -> BackendResult<Buffer> {
        let Inbound { mut buf, packed, fences } = self;
        be.wait_copies(fences)?;
        if let Some((q, scales)) = packed {
            be.unpack_int8::<E>(ViewMut::of(&mut buf), View::of(&q), View::of(&scales), c)?;
        }
        Ok(buf)
    }
}

/// The backward pass's block input in flight on a device pool: waited on however the pass
/// ends, so no copy lands in memory the pool has handed out again.
struct InboundSlot<'b, B: Backend> {
    be: &'b B,
    pending: Option<Inbound<B::Fence>>,
}

impl<B: Backend> Drop for InboundSlot<'_, B> {
    fn drop(&mut self) {
        if let Some(inbound) = self.pending.take() {
            let _ = self.be.wait_copies(inbound.fences);
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
                att_lse: a.att_lse,
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
    pub fn output<E: Elem>(&self) -> View<'_, E> {
        match self {
            KeptLayer::All(a) => View::of(&a.residual3),
            KeptLayer::Selective(s) => View::of(&s.residual3),
            KeptLayer::Output(o) => View::of(o),
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
    /// The stage's input (B,T,C): the embedding's output on the first stage, the previous
    /// stage's output on the others.
    pub encoded: Buffer,
    /// The stage's blocks.
    pub layers: Vec<KeptLayer>,
    /// The final LayerNorm's outputs and the losses (the last stage's).
    pub head: Option<HeadActs>,
    /// The last stage's logits after the loss: probabilities or their gradient, as `head_output` says.
    pub logits: Option<Buffer>,
    /// What the head left in `logits`.
    pub head_output: HeadOutput,
    /// Mean cross-entropy over the micro-batch (f64 accumulation on the host).
    mean_loss: f32,
    /// Host traffic of activation offload so far in this forward/backward pair.
    pub swap: SwapStats,
    pub offload: OffloadTarget,
}

/// What the last stage's head leaves over the logits, once the loss is computed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum HeadOutput {
    /// The probabilities (evaluation, decoding).
    Probabilities,
    /// The logits' gradient (softmax − onehot(target)) · dloss, made in the loss's own pass
    /// (training: where backward starts). `dloss` is d(objective)/d(loss at one position), e.g.
    /// 1 / (B·T·grad_accum) for a mean over the global batch (times the loss scale for fp16).
    Gradient { dloss: f32 },
}

/// The head's activations: the final LayerNorm's output and statistics, the losses.
pub struct HeadActs {
    pub lnf: Buffer,
    pub lnf_mean: Buffer,
    pub lnf_rstd: Buffer,
    pub losses: Buffer,
}

impl Activations {
    /// Mean cross-entropy over the micro-batch (0 on a stage before the last).
    pub fn mean_loss(&self) -> f32 {
        self.mean_loss
    }

    /// The stage's output (B,T,C), its last block's: what a stage before the last sends on.
    pub fn output<E: Elem>(&self) -> View<'_, E> {
        self.layers.last().map(KeptLayer::output::<E>).unwrap_or(View::of(&self.encoded))
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
        att_lse: next(),
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

/// Forward pass on backend `be`. params: the compute copy in `E`; inputs, targets: (B,T) token
/// ids in host memory (uploaded here). Returns the activations with losses filled and the
/// logits replaced by what `head` asks for.
#[allow(clippy::too_many_arguments)]
pub fn forward<E: Elem, B: Backend>(
    be: &B,
    cfg: &GptConfig,
    params: &dyn ParamSource<E>,
    inputs: &[u32],
    targets: &[u32],
    b: usize,
    t: usize,
    mode: Checkpointing,
    offload: OffloadTarget,
    tp: &TensorGroup,
    head: HeadOutput,
) -> BackendResult<Activations> {
    forward_stage(be, cfg, params, inputs, targets, b, t, mode, offload, tp, None, false, head)
}

/// Mean loss of a forward pass that keeps nothing for backward (evaluation): each block's
/// output is released as soon as the next block has consumed it.
#[allow(clippy::too_many_arguments)]
pub fn forward_loss<E: Elem, B: Backend>(
    be: &B,
    cfg: &GptConfig,
    params: &dyn ParamSource<E>,
    inputs: &[u32],
    targets: &[u32],
    b: usize,
    t: usize,
    tp: &TensorGroup,
) -> BackendResult<f32> {
    let acts = forward_stage(
        be,
        cfg,
        params,
        inputs,
        targets,
        b,
        t,
        Checkpointing::Full,
        OffloadTarget::None,
        tp,
        None,
        true,
        HeadOutput::Probabilities,
    )?;
    Ok(acts.mean_loss())
}

/// Where a validation sequence comes from: (index, inputs, targets).
pub type EvalBatchFn<'a> = dyn FnMut(usize, &mut Vec<u32>, &mut Vec<u32>) + 'a;

/// Mean loss over `count` sequences, `micro` at a time, each written by `sequence(index,
/// inputs, targets)` (`t` tokens): the evaluation loop of training and of `headroom eval`.
#[allow(clippy::too_many_arguments)]
pub fn mean_loss<E: Elem, B: Backend>(
    be: &B,
    cfg: &GptConfig,
    params: &dyn ParamSource<E>,
    count: usize,
    micro: usize,
    t: usize,
    sequence: &mut EvalBatchFn<'_>,
    tp: &TensorGroup,
) -> BackendResult<f64> {
    let (mut total, mut done) = (0.0f64, 0);
    while done < count {
        let n = micro.min(count - done);
        let (mut inputs, mut targets) = (Vec::with_capacity(n * t), Vec::with_capacity(n * t));
        for i in 0..n {
            sequence(done + i, &mut inputs, &mut targets);
        }
        let loss = forward_loss::<E, B>(be, cfg, params, &inputs, &targets, n, t, tp)?;
        total += loss as f64 * n as f64;
        done += n;
    }
    Ok(total / count as f64)
}

/// `forward` of a pipeline stage (`cfg.pp`): from `stage_input`, the previous stage's output (B,T,C)
/// in a pool buffer (`None` on the first stage: the embedding of `inputs`), through the
/// stage's blocks; the last stage goes on to the head and the losses (of `targets`).
/// `release_outputs`: keep nothing for backward (evaluation).
#[allow(clippy::too_many_arguments)]
pub fn forward_stage<E: Elem, B: Backend>(
    be: &B,
    cfg: &GptConfig,
    params: &dyn ParamSource<E>,
    inputs: &[u32],
    targets: &[u32],
    b: usize,
    t: usize,
    mode: Checkpointing,
    offload: OffloadTarget,
    tp: &TensorGroup,
    stage_input: Option<Buffer>,
    release_outputs: bool,
    head: HeadOutput,
) -> BackendResult<Activations> {
    let pool = be.pool();
    // v: the vocabulary (token ids, the softmax); vp: rows of wte and of the logits (padded).
    let (c, v, vp) = (cfg.n_embd, cfg.vocab, cfg.padded_vocab());
    let mut swap = SwapStats::default();
    let bt = b * t;
    let g = global_activation_sizes(cfg, b, t);
    let stage = cfg.stage_layers();
    let mut input_buf = alloc_act::<E>(pool, g[0].0, g[0].1)?;
    be.upload(ViewMut::of(&mut input_buf), inputs)?;
    let mut target_buf = alloc_act::<E>(pool, g[1].0, g[1].1)?;
    be.upload(ViewMut::of(&mut target_buf), targets)?;
    let encoded = match stage_input {
        Some(received) => received,
        None => {
            debug_assert!(cfg.pp.is_first(), "a stage after the first starts from its input");
            let mut encoded = alloc_act::<E>(pool, g[2].0, g[2].1)?;
            let w = params.fetch(cfg.embed_range(), (!stage.is_empty()).then(|| cfg.layer_range(stage.start)))?;
            let (wte, wpe) = w.view().split_at(vp * c);
            be.encoder_forward(ViewMut::of(&mut encoded), View::of(&input_buf), wte, wpe, t, c)?;
            encoded
        }
    };

    let mut layers: Vec<KeptLayer> = Vec::with_capacity(stage.len());
    for (j, l) in stage.clone().enumerate() {
        let mut a = alloc_layer_acts::<E>(cfg, pool, b, t)?;
        let next =
            if l + 1 < stage.end { Some(cfg.layer_range(l + 1)) } else { cfg.pp.is_last().then(|| cfg.lnf_range()) };
        let w = params.fetch(cfg.layer_range(l), next)?;
        let x = layers.last().map(KeptLayer::output::<E>).unwrap_or(View::of(&encoded));
        layer_forward(be, cfg, &cfg.layer_view(w.view()), &mut a, x, b, t, tp)?;
        drop(w);
        layers.push(KeptLayer::keep(a, mode));
        // The previous block's output has been consumed: release it, or move it to the host.
        if release_outputs && j >= 1 {
            layers[j - 1] = KeptLayer::Released;
        } else if offload != OffloadTarget::None && j >= 1 {
            let t0 = std::time::Instant::now();
            if let KeptLayer::Output(buf) = &layers[j - 1] {
                let host = HostTensor::from_device::<E, B>(be, buf, c, offload == OffloadTarget::CpuInt8)?;
                swap.bytes_to_host += host.host_bytes();
                layers[j - 1] = KeptLayer::Host(host);
            }
            swap.transfer_ms += t0.elapsed().as_secs_f64() * 1e3;
            pool.set_host_bytes(Category::Activations, host_activation_bytes(&layers));
        }
    }

    if !cfg.pp.is_last() {
        swap.add(tp.take_moved());
        return Ok(Activations {
            b,
            t,
            inputs: input_buf,
            targets: target_buf,
            encoded,
            layers,
            head: None,
            logits: None,
            head_output: head,
            mean_loss: 0.0,
            swap,
            offload,
        });
    }
    let mut lnf = alloc_act::<E>(pool, g[3].0, g[3].1)?;
    let mut lnf_mean = alloc_act::<E>(pool, g[4].0, g[4].1)?;
    let mut lnf_rstd = alloc_act::<E>(pool, g[5].0, g[5].1)?;
    let last = layers.last().map(KeptLayer::output::<E>).unwrap_or(View::of(&encoded));
    {
        let w = params.fetch(cfg.lnf_range(), Some(cfg.wte_range()))?;
        let (lnfw, lnfb) = w.view().split_at(c);
        be.layernorm_forward(
            ViewMut::of(&mut lnf),
            ViewMut::of(&mut lnf_mean),
            ViewMut::of(&mut lnf_rstd),
            last,
            lnfw,
            lnfb,
            c,
        )?;
    }
    // logits: (B,T,VP) = lnf · wteᵀ (the classifier is tied to the token embedding; the padding
    // rows of wte are zero, and the softmax leaves their columns out).
    let mut logits = alloc_act::<E>(pool, g[6].0, g[6].1)?;
    {
        let wte = params.fetch(cfg.wte_range(), None)?;
        be.matmul_forward(ViewMut::of(&mut logits), View::of(&lnf), wte.view(), None, bt, c, vp)?;
    }
    let mut losses = alloc_act::<E>(pool, g[7].0, g[7].1)?;
    let (lg, ls, tg) = (ViewMut::of(&mut logits), ViewMut::of(&mut losses), View::of(&target_buf));
    match head {
        HeadOutput::Probabilities => be.crossentropy_forward::<E>(lg, ls, tg, v, vp)?,
        // dlogits: (B,T,VP) = (softmax − onehot) · dloss over the logits, 0 in the padding
        HeadOutput::Gradient { dloss } => be.crossentropy_forward_backward::<E>(lg, ls, tg, dloss, v, vp)?,
    }
    let mut host_losses = vec![0f32; bt];
    be.download(View::of(&losses), &mut host_losses)?;
    let mean_loss = (host_losses.iter().map(|&x| x as f64).sum::<f64>() / bt as f64) as f32;
    swap.add(tp.take_moved());
    Ok(Activations {
        b,
        t,
        inputs: input_buf,
        targets: target_buf,
        encoded,
        layers,
        head: Some(HeadActs { lnf, lnf_mean, lnf_rstd, losses }),
        logits: Some(logits),
        head_output: head,
        mean_loss,
        swap,
        offload,
    })
}

/// Rebuild a block's full activations from what checkpointing kept (bitwise the same values,
/// since the recomputation runs the same kernels on the same inputs).
#[allow(clippy::too_many_arguments)]
fn recompute<E: Elem, B: Backend>(
    be: &B,
    cfg: &GptConfig,
    p: &LayerTensors<View<E>>,
    kept: KeptLayer,
    x: View<E>,
    b: usize,
    t: usize,
    tp: &TensorGroup,
) -> BackendResult<LayerActs> {
    let pool = be.pool();
    let c = cfg.n_embd;
    let full = || -> BackendResult<LayerActs> {
        let mut a = alloc_layer_acts::<E>(cfg, pool, b, t)?;
        layer_forward(be, cfg, p, &mut a, x, b, t, tp)?;
        Ok(a)
    };
    match kept {
        KeptLayer::All(a) => Ok(*a),
        KeptLayer::Selective(s) => {
            let sizes = layer_activation_sizes(cfg, b, t);
            let size = |name: &str| sizes.iter().find(|e| e.0 == name).expect("size table entry").1;
            let mut ln1 = alloc_act::<E>(pool, "ln1", size("ln1"))?;
            be.layernorm_recompute(
                ViewMut::of(&mut ln1),
                x,
                p.ln1w,
                p.ln1b,
                View::of(&s.ln1_mean),
                View::of(&s.ln1_rstd),
                c,
            )?;
            let mut ln2 = alloc_act::<E>(pool, "ln2", size("ln2"))?;
            be.layernorm_recompute(
                ViewMut::of(&mut ln2),
                View::of(&s.residual2),
                p.ln2w,
                p.ln2b,
                View::of(&s.ln2_mean),
                View::of(&s.ln2_rstd),
                c,
            )?;
            let mut fch_gelu = alloc_act::<E>(pool, "fch_gelu", size("fch_gelu"))?;
            be.gelu_forward::<E>(ViewMut::of(&mut fch_gelu), View::of(&s.fch))?;
            Ok(LayerActs {
                ln1,
                ln1_mean: s.ln1_mean,
                ln1_rstd: s.ln1_rstd,
                qkv: s.qkv,
                att_lse: s.att_lse,
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
            full()
        }
        KeptLayer::Host(_) | KeptLayer::InFlight | KeptLayer::Released => full(),
    }
}

/// One transformer block forward. x: (B,T,C) block input; fills every tensor of `a`. Under
/// tensor parallelism (`tp`) the rank computes its heads and MLP features (C/tp, 4C/tp) and the
/// two projections' partial outputs are summed over the group.
#[allow(clippy::too_many_arguments)]
fn layer_forward<E: Elem, B: Backend>(
    be: &B,
    cfg: &GptConfig,
    p: &LayerTensors<View<E>>,
    a: &mut LayerActs,
    x: View<E>,
    b: usize,
    t: usize,
    tp: &TensorGroup,
) -> BackendResult {
    let bt = b * t;
    let (c, cl, nhl, fl) = (cfg.n_embd, cfg.local_embd(), cfg.local_heads(), cfg.local_mlp());
    // ln1: (B,T,C), ln1_mean, ln1_rstd: (B,T)
    be.layernorm_forward(
        ViewMut::of(&mut a.ln1),
        ViewMut::of(&mut a.ln1_mean),
        ViewMut::of(&mut a.ln1_rstd),
        x,
        p.ln1w,
        p.ln1b,
        c,
    )?;
    // qkv: (B,T,3·C/tp), column-parallel: this rank's heads' q, k, v
    be.matmul_forward(ViewMut::of(&mut a.qkv), View::of(&a.ln1), p.qkvw, Some(p.qkvb), bt, c, 3 * cl)?;
    // atty: (B,T,C/tp), att_lse: (B,NH/tp,T)
    be.attention_forward::<E>(ViewMut::of(&mut a.atty), ViewMut::of(&mut a.att_lse), View::of(&a.qkv), b, t, cl, nhl)?;
    // residual2: (B,T,C) = x + atty · attprojwᵀ + attprojb (row-parallel: partial sums over
    // the group, the bias added by one rank)
    let bias = tp.adds_bias().then_some(p.attprojb);
    be.matmul_forward(ViewMut::of(&mut a.residual2), View::of(&a.atty), p.attprojw, bias, bt, cl, c)?;
    tp.sum::<E, B>(be, ViewMut::of(&mut a.residual2))?;
    be.residual_forward_inplace::<E>(ViewMut::of(&mut a.residual2), x)?;
    // ln2: (B,T,C)
    be.layernorm_forward(
        ViewMut::of(&mut a.ln2),
        ViewMut::of(&mut a.ln2_mean),
        ViewMut::of(&mut a.ln2_rstd),
        View::of(&a.residual2),
        p.ln2w,
        p.ln2b,
        c,
    )?;
    // fch, fch_gelu: (B,T,4C/tp), column-parallel
    be.matmul_forward(ViewMut::of(&mut a.fch), View::of(&a.ln2), p.fcw, Some(p.fcb), bt, c, fl)?;
    be.gelu_forward::<E>(ViewMut::of(&mut a.fch_gelu), View::of(&a.fch))?;
    // residual3: (B,T,C) = residual2 + fch_gelu · fcprojwᵀ + fcprojb (row-parallel)
    let bias = tp.adds_bias().then_some(p.fcprojb);
    be.matmul_forward(ViewMut::of(&mut a.residual3), View::of(&a.fch_gelu), p.fcprojw, bias, bt, fl, c)?;
    tp.sum::<E, B>(be, ViewMut::of(&mut a.residual3))?;
    be.residual_forward_inplace::<E>(ViewMut::of(&mut a.residual3), View::of(&a.residual2))
}

/// One transformer block backward, the mirror of `layer_forward`. x: (B,T,C) block input;
/// `ws.dres` holds d(block output) on entry and d(block input) on return; the block's
/// parameter gradients are accumulated into `g`. Under tensor parallelism the gradients of the
/// column-parallel matmuls' input (d ln2, d ln1) are partial sums, summed over the group.
#[allow(clippy::too_many_arguments)]
fn layer_backward<E: Elem, B: Backend>(
    be: &B,
    cfg: &GptConfig,
    p: LayerTensors<View<E>>,
    g: LayerTensors<ViewMut<E>>,
    a: &LayerActs,
    x: View<E>,
    ws: &mut BackwardWorkspace,
    b: usize,
    t: usize,
    tp: &TensorGroup,
) -> BackendResult {
    let bt = b * t;
    let (c, cl, nhl, fl) = (cfg.n_embd, cfg.local_embd(), cfg.local_heads(), cfg.local_mlp());
    let BackwardWorkspace { dres, dsmall, dfch, dqkv } = ws;
    // MLP: residual3 = residual2 + fcproj(gelu(fc(ln2(residual2))))
    // dfch: (B,T,4C/tp) = d fch_gelu, then d fch
    be.matmul_backward(
        ViewMut::of(dfch),
        g.fcprojw,
        Some(g.fcprojb),
        View::of(dres),
        View::of(&a.fch_gelu),
        p.fcprojw,
        bt,
        fl,
        c,
    )?;
    be.gelu_backward_inplace::<E>(ViewMut::of(dfch), View::of(&a.fch))?;
    // dsmall: (B,T,C) = d ln2 (partial over the group, then summed)
    be.matmul_backward(ViewMut::of(dsmall), g.fcw, Some(g.fcb), View::of(dfch), View::of(&a.ln2), p.fcw, bt, c, fl)?;
    tp.sum::<E, B>(be, ViewMut::of(dsmall))?;
    // dres: (B,T,C) += d residual2 through ln2
    be.layernorm_backward(
        ViewMut::of(dres),
        g.ln2w,
        g.ln2b,
        View::of(dsmall),
        View::of(&a.residual2),
        p.ln2w,
        View::of(&a.ln2_mean),
        View::of(&a.ln2_rstd),
        c,
    )?;
    // Attention: residual2 = x + attproj(attention(qkv(ln1(x))))
    // datty: (B,T,C/tp), in the front of dsmall
    let datty = bt * cl;
    be.matmul_backward(
        ViewMut::range(dsmall, 0..datty),
        g.attprojw,
        Some(g.attprojb),
        View::of(dres),
        View::of(&a.atty),
        p.attprojw,
        bt,
        cl,
        c,
    )?;
    // dqkv: (B,T,3C/tp)
    be.attention_backward::<E>(
        ViewMut::of(dqkv),
        View::range(dsmall, 0..datty),
        View::of(&a.qkv),
        View::of(&a.att_lse),
        b,
        t,
        cl,
        nhl,
    )?;
    // dsmall: (B,T,C) = d ln1 (partial over the group, then summed)
    be.matmul_backward(
        ViewMut::of(dsmall),
        g.qkvw,
        Some(g.qkvb),
        View::of(dqkv),
        View::of(&a.ln1),
        p.qkvw,
        bt,
        c,
        3 * cl,
    )?;
    tp.sum::<E, B>(be, ViewMut::of(dsmall))?;
    // dres: (B,T,C) += d x through ln1: the gradient of the block input, the next block's dout.
    be.layernorm_backward(
        ViewMut::of(dres),
        g.ln1w,
        g.ln1b,
        View::of(dsmall),
        x,
        p.ln1w,
        View::of(&a.ln1_mean),
        View::of(&a.ln1_rstd),
        c,
    )
}

/// The backward pass's gradient buffers, sized from `backward_workspace_sizes` and reused
/// by every block.
struct BackwardWorkspace {
    /// (B,T,C): d(residual stream), the running gradient of the current block's output.
    dres: Buffer,
    /// (B,T,C): d(ln output) or d(attention output), one at a time.
    dsmall: Buffer,
    /// (B,T,4C): d(fc output).
    dfch: Buffer,
    /// (B,T,3C): d(qkv).
    dqkv: Buffer,
}

impl BackwardWorkspace {
    /// `dres`: the gradient of the stage's output, when the next stage sent it.
    fn alloc<E: Elem>(
        cfg: &GptConfig,
        pool: &Pool,
        b: usize,
        t: usize,
        dres: Option<Buffer>,
    ) -> Result<Self, OomError> {
        let ws = backward_workspace_sizes(cfg, b, t);
        let dres = match dres {
            Some(given) => given,
            None => alloc_elems::<E>(pool, ws[0].1, Category::Workspace)?,
        };
        Ok(BackwardWorkspace {
            dres,
            dsmall: alloc_elems::<E>(pool, ws[1].1, Category::Workspace)?,
            dfch: alloc_elems::<E>(pool, ws[2].1, Category::Workspace)?,
            dqkv: alloc_elems::<E>(pool, ws[3].1, Category::Workspace)?,
        })
    }
}

/// Backward pass: consumes the activations of a forward with `HeadOutput::Gradient` (freeing
/// each block's as soon as it is done) and accumulates parameter gradients into `grads`.
pub fn backward<E: Elem, B: Backend>(
    be: &B,
    cfg: &GptConfig,
    params: &dyn ParamSource<E>,
    grads: &mut dyn GradSink<E>,
    acts: Activations,
    tp: &TensorGroup,
) -> BackendResult<SwapStats> {
    Ok(backward_stage(be, cfg, params, grads, acts, tp, None)?.0)
}

/// `backward` of a pipeline stage (`cfg.pp`): the last stage starts from the loss, the others
/// from `dout`, the gradient of their output (B,T,C) sent back by the next stage; the first
/// stage ends in the embedding's gradients, the others return the gradient of their input,
/// for the previous stage.
#[allow(clippy::too_many_arguments)]
pub fn backward_stage<E: Elem, B: Backend>(
    be: &B,
    cfg: &GptConfig,
    params: &dyn ParamSource<E>,
    grads: &mut dyn GradSink<E>,
    mut acts: Activations,
    tp: &TensorGroup,
    dout: Option<Buffer>,
) -> BackendResult<(SwapStats, Option<Buffer>)> {
    let pool = be.pool();
    let (c, vp) = (cfg.n_embd, cfg.padded_vocab());
    let (b, t) = (acts.b, acts.t);
    let bt = b * t;
    let stage = cfg.stage_layers();
    let mut ws = BackwardWorkspace::alloc::<E>(cfg, pool, b, t, dout)?;

    if let Some(head) = acts.head.take() {
        // Head: dlogits (made with the loss, in forward) -> lnf.
        assert!(
            matches!(acts.head_output, HeadOutput::Gradient { .. }),
            "backward starts from the logits' gradient: a training forward's"
        );
        let logits = acts.logits.take().expect("forward fills logits");
        {
            let wte = params.fetch(cfg.wte_range(), Some(cfg.lnf_range()))?;
            let gwte = grads.open(cfg.wte_range())?;
            // dsmall: (B,T,C) = d lnf
            be.matmul_backward(
                ViewMut::of(&mut ws.dsmall),
                gwte,
                None,
                View::of(&logits),
                View::of(&head.lnf),
                wte.view(),
                bt,
                c,
                vp,
            )?;
            grads.close(cfg.wte_range())?;
        }
        drop(logits);
        be.zero::<E>(ViewMut::of(&mut ws.dres))?;
        let last = acts.output::<E>();
        let w = params.fetch(cfg.lnf_range(), stage.clone().last().map(|l| cfg.layer_range(l)))?;
        let (glnfw, glnfb) = grads.open(cfg.lnf_range())?.split_at(c);
        // dres: (B,T,C) = d(last block output) through lnf
        be.layernorm_backward(
            ViewMut::of(&mut ws.dres),
            glnfw,
            glnfb,
            View::of(&ws.dsmall),
            last,
            w.view().slice(0..c),
            View::of(&head.lnf_mean),
            View::of(&head.lnf_rstd),
            c,
        )?;
        grads.close(cfg.lnf_range())?;
    }

    let mut copies = BlockInputCopies { prefetch: None, inbound: InboundSlot { be, pending: None } };
    for l in stage.clone().rev() {
        let kept = acts.layers.pop().expect("one KeptLayer per layer");
        copies.restore_block_input::<E>(&mut acts, c)?;
        let x = acts.output::<E>();
        let w = params.fetch(cfg.layer_range(l), (l > stage.start).then(|| cfg.layer_range(l - 1)))?;
        let pl = cfg.layer_view(w.view());
        let a = recompute::<E, B>(be, cfg, &pl, kept, x, b, t, tp)?;
        let gl = cfg.layer_view_mut(grads.open(cfg.layer_range(l))?);
        layer_backward(be, cfg, pl, gl, &a, x, &mut ws, b, t, tp)?;
        drop(a);
        grads.close(cfg.layer_range(l))?;
    }
    let dinput = if cfg.pp.is_first() {
        let (gwte, gwpe) = grads.open(cfg.embed_range())?.split_at(vp * c);
        be.encoder_backward(gwte, gwpe, View::of(&ws.dres), View::of(&acts.inputs), t, c)?;
        grads.close(cfg.embed_range())?;
        None
    } else {
        Some(ws.dres)
    };
    if acts.offload != OffloadTarget::None {
        pool.set_host_bytes(Category::Activations, 0);
    }
    acts.swap.add(tp.take_moved());
    Ok((acts.swap, dinput))
}

/// The block inputs coming back during backward when activations are offloaded: by a copy
/// worker thread into a host-visible pool, or through the backend's copy stream into a device
/// pool.
struct BlockInputCopies<'b, B: Backend> {
    prefetch: Option<std::thread::JoinHandle<(Buffer, f64)>>,
    inbound: InboundSlot<'b, B>,
}

impl<B: Backend> BlockInputCopies<'_, B> {
    /// Before the backward of the block whose `KeptLayer` was just popped: make its input (the
    /// previous block's output, now last in `acts.layers`) resident on the device — landed from
    /// the prefetch started one block earlier, or copied now — and start bringing back the input
    /// of the block after it, overlapping this block's backward.
    fn restore_block_input<E: Elem>(&mut self, acts: &mut Activations, c: usize) -> BackendResult {
        let be = self.inbound.be;
        let pool = be.pool();
        if let Some(slot) = acts.layers.last_mut() {
            match slot {
                KeptLayer::InFlight => {
                    let buf = match self.prefetch.take() {
                        Some(worker) => {
                            let (buf, ms) = worker.join().expect("copy worker");
                            acts.swap.transfer_ms += ms;
                            buf
                        }
                        None => {
                            let t0 = std::time::Instant::now();
                            let buf = self.inbound.pending.take().expect("a copy is in flight").land::<E, B>(be, c)?;
                            acts.swap.transfer_ms += t0.elapsed().as_secs_f64() * 1e3;
                            buf
                        }
                    };
                    *slot = KeptLayer::Output(buf);
                }
                KeptLayer::Host(h) => {
                    let t0 = std::time::Instant::now();
                    let buf = h.to_device::<E, B>(be, c)?;
                    acts.swap.bytes_to_device += h.host_bytes();
                    acts.swap.transfer_ms += t0.elapsed().as_secs_f64() * 1e3;
                    *slot = KeptLayer::Output(buf);
                }
                _ => {}
            }
        }
        let n = acts.layers.len();
        if n >= 2 && matches!(acts.layers[n - 2], KeptLayer::Host(_)) {
            let KeptLayer::Host(h) = std::mem::replace(&mut acts.layers[n - 2], KeptLayer::InFlight) else {
                unreachable!("checked above")
            };
            acts.swap.bytes_to_device += h.host_bytes();
            if pool.host_visible() {
                let mut buf = pool.alloc(h.device_bytes(), Category::Activations)?;
                self.prefetch = Some(std::thread::spawn(move || {
                    let t0 = std::time::Instant::now();
                    h.fill_host::<E>(&mut buf, c);
                    (buf, t0.elapsed().as_secs_f64() * 1e3)
                }));
            } else {
                let t0 = std::time::Instant::now();
                self.inbound.pending = Some(h.send_ahead(be)?);
                acts.swap.transfer_ms += t0.elapsed().as_secs_f64() * 1e3;
            }
        }
        if acts.offload != OffloadTarget::None {
            pool.set_host_bytes(Category::Activations, host_activation_bytes(&acts.layers));
        }
        Ok(())
    }
}
