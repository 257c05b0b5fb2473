//! Post-training weight quantization for inference: INT8 per output channel (absmax) and INT4
//! group-wise (a clipping search per group), the versioned file that holds a quantized model,
//! and `Quantized`, the parameter source that keeps the quantized weights in the device pool and
//! dequantizes one segment at a time when a pass fetches it.
//!
//! Matrices (the tensors that get weight decay: embeddings and the four linear layers of each
//! block) are quantized, row by row — a row of a linear weight (oc, c) is one output channel.
//! Biases and LayerNorm parameters stay in f32 (a few thousand values a layer).
//!
//! File format (version 1, little-endian): `HRQUANT\0`, u32 version, u64 length of a JSON header
//! (`QuantHeader`: model dimensions, scheme, and per tensor its name, offset, length, kind and
//! where its blobs lie), the blobs, then a CRC-32 of everything before it.

use std::ops::Range;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::engine::backend::layers::Elem;
use crate::engine::backend::{Backend, BackendResult, View, ViewMut};
use crate::engine::model::decode::Decoder;
use crate::engine::model::{GptConfig, TensorInfo};
use crate::engine::parallel::placement::{ParamSource, Weights};
use crate::memory::{Buffer, Category};

/// How the matrices are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Scheme {
    /// Every value in f32 (the reference the others are measured against).
    Fp32,
    /// Every matrix value in bf16 (rounded to nearest even): half the bytes, no scales.
    Bf16,
    /// One int8 code per value, one f32 scale (absmax / 127) per row.
    Int8,
    /// Two 4-bit codes per byte, one f32 scale per `group` values of a row.
    Int4 { group: usize },
}

impl Scheme {
    /// `fp32`, `int8`, `int4-g64` (the CLI's spelling).
    pub fn parse(text: &str) -> Result<Scheme, String> {
        match text {
            "fp32" => Ok(Scheme::Fp32),
            "bf16" => Ok(Scheme::Bf16),
            "int8" => Ok(Scheme::Int8),
            _ => match text.strip_prefix("int4-g").and_then(|g| g.parse::<usize>().ok()) {
                Some(group @ (32 | 64 | 128)) => Ok(Scheme::Int4 { group }),
                _ => Err(format!("`{text}` is not a scheme: fp32, bf16, int8, int4-g32, int4-g64 or int4-g128")),
            },
        }
    }

    pub fn name(&self) -> String {
        match self {
            Scheme::Fp32 => "fp32".into(),
            Scheme::Bf16 => "bf16".into(),
            Scheme::Int8 => "int8".into(),
            Scheme::Int4 { group } => format!("int4-g{group}"),
        }
    }
}

/// One tensor as stored.
#[derive(Debug, Clone, PartialEq)]
pub enum QTensor {
    Full(Vec<f32>),
    Bf16(Vec<half::bf16>),
    Int8 { q: Vec<i8>, scales: Vec<f32>, row: usize },
    Int4 { packed: Vec<u8>, scales: Vec<f32>, group: usize },
}

impl QTensor {
    /// Bytes of its codes and scales (or its f32 values).
    pub fn bytes(&self) -> usize {
        match self {
            QTensor::Full(v) => 4 * v.len(),
            QTensor::Bf16(v) => 2 * v.len(),
            QTensor::Int8 { q, scales, .. } => q.len() + 4 * scales.len(),
            QTensor::Int4 { packed, scales, .. } => packed.len() + 4 * scales.len(),
        }
    }

    /// The values it stands for (the host reference of the device's dequantization).
    pub fn dequantize(&self) -> Vec<f32> {
        match self {
            QTensor::Full(v) => v.clone(),
            QTensor::Bf16(v) => v.iter().map(|x| x.to_f32()).collect(),
            QTensor::Int8 { q, scales, row } => {
                let mut out = vec![0f32; q.len()];
                crate::engine::backend::layers::unpack_int8(&mut out, q, scales, *row);
                out
            }
            QTensor::Int4 { packed, scales, group } => {
                let mut out = vec![0f32; packed.len() * 2];
                crate::engine::backend::layers::unpack_int4(&mut out, packed, scales, *group);
                out
            }
        }
    }
}

/// A model's weights, quantized.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantModel {
    pub cfg: GptConfig,
    pub scheme: Scheme,
    pub tensors: Vec<(TensorInfo, QTensor)>,
}

/// The length of a row (one output channel) of a quantized tensor.
fn row_len(cfg: &GptConfig, t: &TensorInfo) -> usize {
    if t.name.ends_with("fcprojw") {
        4 * cfg.n_embd
    } else {
        cfg.n_embd
    }
}

/// How one tensor is stored under a scheme.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Storage {
    Full,
    Bf16,
    Int8 { row: usize },
    Int4 { group: usize },
}

impl Storage {
    fn of(cfg: &GptConfig, t: &TensorInfo, scheme: Scheme) -> Storage {
        let row = row_len(cfg, t);
        match scheme {
            _ if !t.decay => Storage::Full,
            Scheme::Fp32 => Storage::Full,
            Scheme::Bf16 => Storage::Bf16,
            Scheme::Int8 => Storage::Int8 { row },
            // A row shorter than the group, or not a multiple of it, uses the row as its group.
            Scheme::Int4 { group } => Storage::Int4 { group: if row.is_multiple_of(group) { group } else { row } },
        }
    }

    /// The bytes of the buffers a tensor of `len` values takes in the pool (values, or codes
    /// then scales).
    fn buffer_bytes(self, len: usize) -> Vec<usize> {
        match self {
            Storage::Full => vec![4 * len],
            Storage::Bf16 => vec![2 * len],
            Storage::Int8 { row } => vec![len, 4 * (len / row)],
            Storage::Int4 { group } => vec![len / 2, 4 * (len / group)],
        }
    }
}

/// Quantize fp32 weights (`master`, the layout of `cfg.tensors()`) under `scheme`.
pub fn quantize(cfg: &GptConfig, master: &[f32], scheme: Scheme) -> QuantModel {
    assert_eq!(master.len(), cfg.num_params(), "one weight per parameter");
    let tensors = cfg
        .tensors()
        .into_iter()
        .map(|t| {
            let x = &master[t.offset..t.offset + t.len];
            let q = match Storage::of(cfg, &t, scheme) {
                Storage::Full => QTensor::Full(x.to_vec()),
                Storage::Bf16 => QTensor::Bf16(x.iter().map(|&v| half::bf16::from_f32(v)).collect()),
                Storage::Int8 { row } => {
                    let (q, scales) = int8_rows(x, row);
                    QTensor::Int8 { q, scales, row }
                }
                Storage::Int4 { group } => {
                    let (packed, scales) = int4_groups(x, group);
                    QTensor::Int4 { packed, scales, group }
                }
            };
            (t, q)
        })
        .collect();
    QuantModel { cfg: *cfg, scheme, tensors }
}

/// The bytes of every buffer `Quantized::upload` takes for a model of `cfg` under `scheme`
/// (what the estimator counts, before the pool's rounding).
pub fn stored_buffer_bytes(cfg: &GptConfig, scheme: Scheme) -> Vec<usize> {
    cfg.tensors().iter().flat_map(|t| Storage::of(cfg, t, scheme).buffer_bytes(t.len)).collect()
}

/// int8 codes and one scale (absmax / 127) per row of `row` values.
pub fn int8_rows(x: &[f32], row: usize) -> (Vec<i8>, Vec<f32>) {
    let mut q = vec![0i8; x.len()];
    let mut scales = vec![0f32; x.len() / row];
    crate::engine::backend::layers::pack_int8(&mut q, &mut scales, x, row);
    (q, scales)
}

/// The clip factors the INT4 search tries per group (of the group's absmax).
pub const INT4_CLIPS: [f32; 11] = [1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5];

/// 4-bit codes in [-8, 7] (two per byte, low nibble first) and one scale per group: for each
/// group the clip of its absmax (from `INT4_CLIPS`) whose rounding leaves the least squared
/// error — clipping a few outliers buys finer steps for the rest.
pub fn int4_groups(x: &[f32], group: usize) -> (Vec<u8>, Vec<f32>) {
    assert!(group.is_multiple_of(2) && x.len().is_multiple_of(group), "whole groups of an even size");
    let mut packed = vec![0u8; x.len() / 2];
    let mut scales = vec![0f32; x.len() / group];
    let code = |v: f32, scale: f32| (v / scale).round().clamp(-8.0, 7.0) as i8;
    for ((g, p), s) in x.chunks(group).zip(packed.chunks_mut(group / 2)).zip(scales.iter_mut()) {
        let amax = g.iter().fold(0f32, |m, v| m.max(v.abs()));
        let mut best = (f32::INFINITY, if amax > 0.0 { amax / 7.0 } else { 1.0 });
        if amax > 0.0 {
            for clip in INT4_CLIPS {
                let scale = clip * amax / 7.0;
                let err: f32 = g.iter().map(|&v| (v - code(v, scale) as f32 * scale).powi(2)).sum();
                if err < best.0 {
                    best = (err, scale);
                }
            }
        }
        *s = best.1;
        for (byte, pair) in p.iter_mut().zip(g.chunks(2)) {
            let (lo, hi) = (code(pair[0], *s) as u8 & 0xf, code(pair[1], *s) as u8 & 0xf);
            *byte = lo | (hi << 4);
        }
    }
    (packed, scales)
}

#[derive(Debug, Serialize, Deserialize)]
struct QuantHeader {
    model: [usize; 5],
    scheme: Scheme,
    tensors: Vec<TensorEntry>,
}

#[derive(Debug, Serialize, Deserialize)]
struct TensorEntry {
    name: String,
    offset: usize,
    len: usize,
    decay: bool,
    /// `full`, `bf16`, `int8` (with `row`) or `int4` (with `group`).
    kind: String,
    #[serde(default)]
    row: usize,
    #[serde(default)]
    group: usize,
}

const MAGIC: &[u8; 8] = b"HRQUANT\0";
/// 2: `wte` holds `padded_vocab()` rows (1: `vocab` rows).
const VERSION: u32 = 2;

/// Why a quantized file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum QuantFileError {
    #[error("{path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("{path}: {detail}")]
    Format { path: String, detail: String },
}

impl QuantModel {
    /// Bytes of every tensor as stored.
    pub fn bytes(&self) -> usize {
        self.tensors.iter().map(|(_, q)| q.bytes()).sum()
    }

    pub fn write(&self, path: &Path) -> Result<(), QuantFileError> {
        let io = |source| QuantFileError::Io { path: path.display().to_string(), source };
        let c = &self.cfg;
        let mut blobs = Vec::new();
        let tensors = self
            .tensors
            .iter()
            .map(|(t, q)| {
                let (kind, row, group) = match q {
                    QTensor::Full(v) => {
                        blobs.extend(v.iter().flat_map(|x| x.to_le_bytes()));
                        ("full", 0, 0)
                    }
                    QTensor::Bf16(v) => {
                        blobs.extend(v.iter().flat_map(|x| x.to_bits().to_le_bytes()));
                        ("bf16", 0, 0)
                    }
                    QTensor::Int8 { q, scales, row } => {
                        blobs.extend(q.iter().map(|&b| b as u8));
                        blobs.extend(scales.iter().flat_map(|x| x.to_le_bytes()));
                        ("int8", *row, 0)
                    }
                    QTensor::Int4 { packed, scales, group } => {
                        blobs.extend_from_slice(packed);
                        blobs.extend(scales.iter().flat_map(|x| x.to_le_bytes()));
                        ("int4", 0, *group)
                    }
                };
                TensorEntry {
                    name: t.name.clone(),
                    offset: t.offset,
                    len: t.len,
                    decay: t.decay,
                    kind: kind.into(),
                    row,
                    group,
                }
            })
            .collect();
        let header =
            QuantHeader { model: [c.n_layer, c.n_head, c.n_embd, c.block_size, c.vocab], scheme: self.scheme, tensors };
        let json = serde_json::to_vec(&header).expect("the header serialises");
        let mut out = Vec::with_capacity(24 + json.len() + blobs.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&(json.len() as u64).to_le_bytes());
        out.extend_from_slice(&json);
        out.extend_from_slice(&blobs);
        out.extend_from_slice(&crc32fast::hash(&out).to_le_bytes());
        let tmp = path.with_extension("part");
        std::fs::write(&tmp, &out).map_err(io)?;
        std::fs::rename(&tmp, path).map_err(io)
    }

    pub fn read(path: &Path) -> Result<QuantModel, QuantFileError> {
        let name = path.display().to_string();
        let bad = |detail: String| QuantFileError::Format { path: name.clone(), detail };
        let data = std::fs::read(path).map_err(|source| QuantFileError::Io { path: name.clone(), source })?;
        if data.len() < 24 || &data[..8] != MAGIC {
            return Err(bad("not a headroom quantized model (no HRQUANT header)".into()));
        }
        let (body, crc) = data.split_at(data.len() - 4);
        if crc32fast::hash(body) != u32::from_le_bytes(crc.try_into().expect("4 bytes")) {
            return Err(bad("checksum mismatch (the file is damaged or truncated)".into()));
        }
        let version = u32::from_le_bytes(body[8..12].try_into().expect("4 bytes"));
        if version != VERSION {
            let again = if version < VERSION { " (written before the vocabulary padding: quantize again)" } else { "" };
            return Err(bad(format!("version {version}; this build reads version {VERSION}{again}")));
        }
        let json_len = u64::from_le_bytes(body[12..20].try_into().expect("8 bytes")) as usize;
        let header: QuantHeader = body
            .get(20..20 + json_len)
            .and_then(|j| serde_json::from_slice(j).ok())
            .ok_or_else(|| bad("unreadable header".into()))?;
        let cfg = GptConfig::of_dims(header.model.map(|x| x as u64));
        let mut at = 20 + json_len;
        let mut take = |n: usize| -> Result<&[u8], QuantFileError> {
            let blob = body.get(at..at + n).ok_or_else(|| bad("blobs end early".into()))?;
            at += n;
            Ok(blob)
        };
        let floats =
            |b: &[u8]| b.chunks(4).map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes"))).collect::<Vec<_>>();
        let mut tensors = Vec::new();
        for e in header.tensors {
            let q = match e.kind.as_str() {
                "full" => QTensor::Full(floats(take(4 * e.len)?)),
                "bf16" => QTensor::Bf16(
                    take(2 * e.len)?
                        .chunks(2)
                        .map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])))
                        .collect(),
                ),
                "int8" if e.row > 0 && e.len % e.row == 0 => {
                    let q = take(e.len)?.iter().map(|&b| b as i8).collect();
                    QTensor::Int8 { q, scales: floats(take(4 * (e.len / e.row))?), row: e.row }
                }
                "int4" if e.group > 0 && e.group % 2 == 0 && e.len % e.group == 0 => {
                    let packed = take(e.len / 2)?.to_vec();
                    QTensor::Int4 { packed, scales: floats(take(4 * (e.len / e.group))?), group: e.group }
                }
                other => {
                    return Err(bad(format!("tensor {}: kind `{other}` with row {} group {}", e.name, e.row, e.group)))
                }
            };
            tensors.push((TensorInfo { name: e.name, offset: e.offset, len: e.len, decay: e.decay }, q));
        }
        let expected = cfg.tensors();
        if tensors.len() != expected.len()
            || tensors.iter().zip(&expected).any(|((t, _), e)| t.offset != e.offset || t.len != e.len)
        {
            return Err(bad("its tensors do not match its model's layout".into()));
        }
        Ok(QuantModel { cfg, scheme: header.scheme, tensors })
    }
}

/// One tensor in the device pool.
enum Stored {
    Full(Buffer),
    Bf16(Buffer),
    Int8 { q: Buffer, scales: Buffer, row: usize },
    Int4 { packed: Buffer, scales: Buffer, group: usize },
}

/// The quantized weights in the device's pool (category params), dequantized into `E` one
/// fetched segment at a time (a workspace block freed when the pass moves on).
pub struct Quantized<'a, B: Backend> {
    backend: &'a B,
    tensors: Vec<(TensorInfo, Stored)>,
}

impl<'a, B: Backend> Quantized<'a, B> {
    /// Upload `model` into `backend`'s pool.
    pub fn upload(backend: &'a B, model: &QuantModel) -> BackendResult<Quantized<'a, B>> {
        let pool = backend.pool();
        let put = |bytes: &[u8]| -> BackendResult<Buffer> {
            let mut buf = pool.alloc(bytes.len(), Category::Params)?;
            backend.upload(ViewMut::of(&mut buf), bytes)?;
            Ok(buf)
        };
        let floats = |v: &[f32]| put(bytemuck::cast_slice(v));
        let tensors = model
            .tensors
            .iter()
            .map(|(t, q)| {
                let stored = match q {
                    QTensor::Full(v) => Stored::Full(floats(v)?),
                    QTensor::Bf16(v) => Stored::Bf16(put(bytemuck::cast_slice(v))?),
                    QTensor::Int8 { q, scales, row } => {
                        Stored::Int8 { q: put(bytemuck::cast_slice(q))?, scales: floats(scales)?, row: *row }
                    }
                    QTensor::Int4 { packed, scales, group } => {
                        Stored::Int4 { packed: put(packed)?, scales: floats(scales)?, group: *group }
                    }
                };
                Ok((t.clone(), stored))
            })
            .collect::<BackendResult<Vec<_>>>()?;
        Ok(Quantized { backend, tensors })
    }
}

impl<E: Elem, B: Backend> ParamSource<E> for Quantized<'_, B> {
    fn fetch(&self, range: Range<usize>, _next: Option<Range<usize>>) -> BackendResult<Weights<'_, E>> {
        let be = self.backend;
        let mut out = crate::engine::model::alloc_elems::<E>(be.pool(), range.len(), Category::Workspace)?;
        for (t, stored) in self.tensors.iter().filter(|(t, _)| t.offset < range.end && range.start < t.offset + t.len) {
            debug_assert!(range.start <= t.offset && t.offset + t.len <= range.end, "segments hold whole tensors");
            let at = t.offset - range.start..t.offset - range.start + t.len;
            let dst = ViewMut::<E>::range(&mut out, at);
            match stored {
                Stored::Full(v) => be.narrow::<E>(dst, View::of(v))?,
                Stored::Bf16(v) => bf16_into(be, dst, View::of(v))?,
                Stored::Int8 { q, scales, row } => be.unpack_int8::<E>(dst, View::of(q), View::of(scales), *row)?,
                Stored::Int4 { packed, scales, group } => {
                    be.unpack_int4::<E>(dst, View::of(packed), View::of(scales), *group)?
                }
            }
        }
        Ok(Weights::Staged(out))
    }
}

/// bf16 weights into a segment of `E`: a copy, a widening, or through f32 (fp16).
fn bf16_into<E: Elem, B: Backend>(be: &B, dst: ViewMut<E>, src: View<half::bf16>) -> BackendResult {
    match E::NAME {
        "bf16" => be.copy(dst.reinterpret::<half::bf16>(), src),
        "fp32" => be.widen::<half::bf16>(dst.reinterpret::<f32>(), src),
        _ => {
            let mut wide = crate::engine::model::alloc_f32(be.pool(), src.len(), Category::Workspace)?;
            be.widen::<half::bf16>(ViewMut::of(&mut wide), src)?;
            be.narrow::<E>(dst, View::of(&wide))
        }
    }
}

/// The validation loss of `model` under the causal LM objective: `count` sequences of the val
/// split (`Dataset::val_sequence`, as the trainer's evaluation), `micro` at a time, weights
/// dequantized on the fly from the pool. Also the bytes the stored weights took in the pool.
pub fn validation_loss<B: Backend>(
    backend: &B,
    model: &QuantModel,
    data: &crate::engine::train::data::Dataset,
    count: usize,
    micro: usize,
) -> BackendResult<(f64, usize)> {
    let before = backend.pool().stats().current(Category::Params);
    let source = Quantized::upload(backend, model)?;
    let weight_bytes = backend.pool().stats().current(Category::Params) - before;
    let mut sequence =
        |i: usize, inputs: &mut Vec<u32>, targets: &mut Vec<u32>| data.val_sequence(i, count, inputs, targets);
    let loss = crate::engine::model::mean_loss::<f32, B>(
        backend,
        &model.cfg,
        &source,
        count,
        micro,
        data.seq_len,
        &mut sequence,
        &crate::engine::model::TensorGroup::none(),
    )?;
    Ok((loss, weight_bytes))
}

/// How the next token is drawn from the model's distribution.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// 0: always the most likely token; else probabilities raised to 1/temperature.
    pub temperature: f32,
    /// Only the k most likely tokens are candidates (0: all).
    pub top_k: usize,
    pub seed: u64,
}

/// The token `probs` (one distribution over the vocabulary) gives under `sampling`, with `u` a
/// uniform draw in [0, 1). Pure: the tests pin each rule.
pub fn sample(probs: &[f32], sampling: &Sampling, u: f64) -> usize {
    let mut order: Vec<usize> = (0..probs.len()).collect();
    order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
    if sampling.temperature <= 0.0 {
        return order[0];
    }
    let k = if sampling.top_k == 0 { probs.len() } else { sampling.top_k.min(probs.len()) };
    let weights: Vec<f64> =
        order[..k].iter().map(|&i| (probs[i].max(0.0) as f64).powf(1.0 / sampling.temperature as f64)).collect();
    let total: f64 = weights.iter().sum();
    let mut target = u * total;
    for (&i, w) in order[..k].iter().zip(&weights) {
        if target < *w {
            return i;
        }
        target -= w;
    }
    order[k - 1]
}

/// How generation runs: the KV cache's positions and the prompt's chunk size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeShape {
    /// Positions the KV cache holds (at most the model's block size).
    pub context: usize,
    /// Prompt tokens run through the model at once (1..=context).
    pub chunk: usize,
}

impl DecodeShape {
    /// The whole window, prompts in chunks of 64 tokens.
    pub fn of(cfg: &GptConfig) -> DecodeShape {
        DecodeShape { context: cfg.block_size, chunk: cfg.block_size.min(64) }
    }
}

/// `count` tokens continuing `prompt`, each drawn from the model's next-token distribution,
/// with a KV cache: the prompt's last `context` tokens are run once (in chunks), then each new
/// token alone, attending to the cached keys and values. When the cache is full the window
/// shifts: it is cleared and the newest half of it run again from position 0 (learned
/// positions cannot slide). Weights dequantized on the fly as in evaluation.
pub fn generate<B: Backend>(
    backend: &B,
    model: &QuantModel,
    prompt: &[u32],
    count: usize,
    sampling: &Sampling,
    shape: DecodeShape,
) -> BackendResult<Vec<u32>> {
    let cfg = &model.cfg;
    let source = Quantized::upload(backend, model)?;
    let mut decoder = Decoder::<f32, B>::new(backend, cfg, shape.context, shape.chunk)?;
    let mut rng = crate::engine::rng::Rng::new(sampling.seed);
    let mut tokens = prompt.to_vec();
    let mut probs = vec![0f32; cfg.vocab];
    if count > 0 {
        decoder.feed(&source, &tokens[tokens.len().saturating_sub(shape.context)..], &mut probs)?;
    }
    for i in 0..count {
        let next = sample(&probs, sampling, rng.uniform()) as u32;
        tokens.push(next);
        if i + 1 == count {
            break;
        }
        if decoder.cache().len() == shape.context {
            decoder.clear();
            let keep = (shape.context / 2).max(1);
            decoder.feed(&source, &tokens[tokens.len() - keep..], &mut probs)?;
        } else {
            decoder.feed(&source, &[next], &mut probs)?;
        }
    }
    Ok(tokens[prompt.len()..].to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::backend::CpuBackend;
    use crate::engine::model::{PpStage, TpShard};
    use crate::memory::Pool;

    fn weights(cfg: &GptConfig) -> Vec<f32> {
        let mut w = vec![0f32; cfg.num_params()];
        cfg.init_params(&mut w, 5);
        w
    }

    #[test]
    fn each_scheme_reconstructs_within_its_step_and_int4_clipping_never_hurts() {
        let cfg = GptConfig {
            n_layer: 2,
            n_head: 4,
            n_embd: 64,
            block_size: 32,
            vocab: 256,
            tp: TpShard::NONE,
            pp: PpStage::NONE,
        };
        let w = weights(&cfg);
        for scheme in [Scheme::Bf16, Scheme::Int8, Scheme::Int4 { group: 32 }, Scheme::Int4 { group: 64 }] {
            let m = quantize(&cfg, &w, scheme);
            for (t, q) in &m.tensors {
                let x = &w[t.offset..t.offset + t.len];
                let back = q.dequantize();
                match q {
                    QTensor::Full(_) => assert_eq!(back, x, "{}: kept exactly", t.name),
                    QTensor::Bf16(_) => {
                        for (a, b) in x.iter().zip(&back) {
                            assert!((a - b).abs() <= a.abs() / 256.0, "{}: within half a bf16 step", t.name);
                        }
                    }
                    QTensor::Int8 { scales, row, .. } => {
                        for (i, (a, b)) in x.iter().zip(&back).enumerate() {
                            assert!((a - b).abs() <= scales[i / row] / 2.0 + 1e-7, "{}: half a step", t.name);
                        }
                    }
                    QTensor::Int4 { scales, group, .. } => {
                        // The clip search never does worse than plain absmax scaling.
                        for (g, (xg, bg)) in x.chunks(*group).zip(back.chunks(*group)).enumerate() {
                            let amax = xg.iter().fold(0f32, |m, v| m.max(v.abs()));
                            let plain = amax / 7.0;
                            let err = |s: f32| -> f32 {
                                xg.iter().map(|&v| (v - (v / s).round().clamp(-8.0, 7.0) * s).powi(2)).sum()
                            };
                            let got: f32 = xg.iter().zip(bg).map(|(a, b)| (a - b).powi(2)).sum();
                            assert!(got <= err(plain) * (1.0 + 1e-5) + 1e-12, "{} group {g}", t.name);
                            assert!(scales[g] <= plain * 1.0001);
                        }
                    }
                }
            }
            let ratio = m.bytes() as f64 / (4 * cfg.num_params()) as f64;
            let expected = match scheme {
                Scheme::Bf16 => 0.5..0.52,
                Scheme::Int8 => 0.25..0.30,
                _ => 0.125..0.19,
            };
            assert!(expected.contains(&ratio), "{}: {ratio:.3} of fp32", scheme.name());
        }
    }

    #[test]
    fn sampling_follows_temperature_and_top_k() {
        let p = [0.1f32, 0.6, 0.3];
        let greedy = Sampling { temperature: 0.0, top_k: 0, seed: 0 };
        assert_eq!(sample(&p, &greedy, 0.99), 1, "temperature 0: the most likely");
        let plain = Sampling { temperature: 1.0, top_k: 0, seed: 0 };
        // Candidates in order of probability: 1 (0.6), 2 (0.3), 0 (0.1).
        assert_eq!([0.0, 0.59, 0.61, 0.89, 0.91].map(|u| sample(&p, &plain, u)), [1, 1, 2, 2, 0]);
        let top2 = Sampling { top_k: 2, ..plain };
        assert_eq!(sample(&p, &top2, 0.999), 2, "the third is never drawn");
        let sharp = Sampling { temperature: 0.1, ..plain };
        assert_eq!(sample(&p, &sharp, 0.99), 1, "a low temperature concentrates on the top");
    }

    /// Generation is deterministic per seed (greedy ignores it), goes on past the window by
    /// sliding it, and leaves nothing in the pool.
    #[test]
    fn generation_is_deterministic_per_seed_and_slides_its_window() {
        let cfg = GptConfig {
            n_layer: 1,
            n_head: 2,
            n_embd: 32,
            block_size: 8,
            vocab: 64,
            tp: TpShard::NONE,
            pp: PpStage::NONE,
        };
        let m = quantize(&cfg, &weights(&cfg), Scheme::Int8);
        let be = CpuBackend::new(Pool::new("cpu", 64 << 20));
        let s = Sampling { temperature: 1.0, top_k: 10, seed: 3 };
        let shape = DecodeShape::of(&cfg);
        let a = generate(&be, &m, &[1, 2, 3], 12, &s, shape).unwrap();
        assert_eq!(a.len(), 12, "more tokens than the window holds");
        assert!(a.iter().all(|&t| (t as usize) < cfg.vocab));
        assert_eq!(generate(&be, &m, &[1, 2, 3], 12, &s, shape).unwrap(), a, "same seed, same text");
        let greedy = Sampling { temperature: 0.0, ..s };
        let g = generate(&be, &m, &[1, 2, 3], 4, &greedy, shape).unwrap();
        assert_eq!(
            generate(&be, &m, &[1, 2, 3], 4, &Sampling { seed: 99, ..greedy }, shape).unwrap(),
            g,
            "greedy ignores the seed"
        );
        assert_eq!(be.pool().stats().current(Category::Workspace), 0, "nothing left behind");
    }

    /// The pool's peaks per category during a generation that runs a full chunk are the
    /// inference estimate's, to the byte, for every scheme and shape.
    #[test]
    fn generation_peaks_where_the_inference_estimate_says() {
        use crate::engine::backend::workspace::WorkspaceModel;
        use crate::engine::estimate::inference::inference;
        let cfg = GptConfig {
            n_layer: 2,
            n_head: 4,
            n_embd: 64,
            block_size: 32,
            vocab: 96,
            tp: TpShard::NONE,
            pp: PpStage::NONE,
        };
        let w = weights(&cfg);
        let sampling = Sampling { temperature: 0.0, top_k: 0, seed: 1 };
        for scheme in
            [Scheme::Fp32, Scheme::Bf16, Scheme::Int8, Scheme::Int4 { group: 32 }, Scheme::Int4 { group: 128 }]
        {
            let m = quantize(&cfg, &w, scheme);
            let stored: usize = crate::memory::blocks_bytes(&stored_buffer_bytes(&cfg, scheme));
            for shape in [DecodeShape { context: 32, chunk: 8 }, DecodeShape { context: 12, chunk: 12 }] {
                let be = CpuBackend::new(Pool::new("cpu", 64 << 20));
                let prompt: Vec<u32> = (0..20).collect();
                let out = generate(&be, &m, &prompt, 30, &sampling, shape).unwrap();
                assert_eq!(out.len(), 30);
                let s = be.pool().stats();
                let e = inference::<f32>(WorkspaceModel::Cpu, &cfg, scheme, shape);
                let at = format!("{} {shape:?}", scheme.name());
                assert_eq!(s.peak(Category::Params), stored, "{at}: what upload took is what the sizes say");
                assert_eq!(s.peak(Category::Params), e.weights, "{at}");
                assert_eq!(s.peak(Category::KvCache), e.kv_cache, "{at}");
                assert_eq!(s.peak(Category::Activations), e.activations, "{at}");
                assert_eq!(s.peak(Category::Workspace), e.workspace, "{at}");
                assert_eq!(s.peak_allocated, e.peak_allocated, "{at}");
                assert_eq!(s.allocated(), 0, "{at}: nothing left behind");
            }
        }
    }

    #[test]
    fn the_file_round_trips_and_a_damaged_one_is_refused() {
        let cfg = GptConfig {
            n_layer: 1,
            n_head: 2,
            n_embd: 32,
            block_size: 16,
            vocab: 64,
            tp: TpShard::NONE,
            pp: PpStage::NONE,
        };
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.hrq");
        for scheme in [Scheme::Bf16, Scheme::Int8] {
            let m = quantize(&cfg, &weights(&cfg), scheme);
            m.write(&path).unwrap();
            assert_eq!(QuantModel::read(&path).unwrap(), m, "{}", scheme.name());
        }
        let m = quantize(&cfg, &weights(&cfg), Scheme::Int4 { group: 32 });
        m.write(&path).unwrap();
        assert_eq!(QuantModel::read(&path).unwrap(), m);
        let mut bytes = std::fs::read(&path).unwrap();
        let mid = bytes.len() / 2;
        bytes[mid] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        assert!(QuantModel::read(&path).unwrap_err().to_string().contains("checksum"));
        std::fs::write(&path, b"not a model at all, clearly").unwrap();
        assert!(QuantModel::read(&path).unwrap_err().to_string().contains("HRQUANT"));
    }

    /// The device path: what `Quantized` fetches is the host reference's dequantization, and
    /// the pool holds the quantized bytes (a quarter, an eighth of fp32, plus scales).
    #[test]
    fn fetched_segments_are_the_dequantized_weights_and_the_pool_holds_the_codes() {
        let cfg = GptConfig {
            n_layer: 2,
            n_head: 4,
            n_embd: 64,
            block_size: 32,
            vocab: 256,
            tp: TpShard::NONE,
            pp: PpStage::NONE,
        };
        let w = weights(&cfg);
        for scheme in [Scheme::Fp32, Scheme::Bf16, Scheme::Int8, Scheme::Int4 { group: 64 }] {
            let m = quantize(&cfg, &w, scheme);
            let reference: Vec<f32> = m.tensors.iter().flat_map(|(_, q)| q.dequantize()).collect();
            let be = CpuBackend::new(Pool::new("cpu", 64 << 20));
            let source = Quantized::upload(&be, &m).unwrap();
            let params = be.pool().stats().current(Category::Params);
            let stored: usize = m.tensors.iter().map(|(_, q)| crate::memory::block_bytes(q.bytes())).sum();
            assert_eq!(params, stored, "{}: the pool holds what the scheme stores", scheme.name());
            for range in [cfg.embed_range(), cfg.layer_range(0), cfg.layer_range(1), cfg.lnf_range()] {
                let got = ParamSource::<f32>::fetch(&source, range.clone(), None).unwrap();
                assert_eq!(got.view().host(), &reference[range.clone()], "{}", scheme.name());
                // Into 16-bit segments: the reference rounded once.
                let got = ParamSource::<half::bf16>::fetch(&source, range.clone(), None).unwrap();
                let want: Vec<half::bf16> = reference[range.clone()].iter().map(|&x| half::bf16::from_f32(x)).collect();
                assert_eq!(got.view().host(), &want[..], "{} as bf16", scheme.name());
                let got = ParamSource::<half::f16>::fetch(&source, range.clone(), None).unwrap();
                let want: Vec<half::f16> = reference[range.clone()].iter().map(|&x| half::f16::from_f32(x)).collect();
                assert_eq!(got.view().host(), &want[..], "{} as fp16", scheme.name());
            }
        }
    }
}
