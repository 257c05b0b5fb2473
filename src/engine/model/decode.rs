//! Incremental decoding for generation: `KvCache` (every layer's keys and values of the tokens
//! seen so far, in the pool's `kv_cache` category) and `Decoder`, which runs only the new
//! tokens through the model, each attending to the cached positions through
//! `Backend::attention_cached`. One sequence (B = 1); a prompt is fed in chunks of at most
//! `chunk` tokens, so the transient buffers are sized once, for a chunk, up front.
//!
//! A cached pass computes what the full forward pass over the same window computes (the same
//! ops on the same rows; attention bitwise in f32, the matmuls up to the GEMM's blocking over a
//! different row count).

use std::marker::PhantomData;

use crate::engine::backend::shapes::CachedAttention;
use crate::engine::backend::workspace::WorkspaceModel;
use crate::engine::backend::{Backend, BackendResult, Elem, View, ViewMut};
use crate::engine::parallel::placement::ParamSource;
use crate::memory::{Buffer, Category, OomError, Pool};

use super::GptConfig;

/// Elements of one layer's cache: keys then values, (2, B, context, C).
pub fn kv_cache_layer_elems(cfg: &GptConfig, context: usize) -> usize {
    2 * context * cfg.n_embd
}

/// The decoder's buffers for a chunk of `rows` tokens: (name, elements, bytes per element).
/// `x` is the residual stream; `ln` a LayerNorm output, then each projection's output before
/// it is added to `x`; `h`/`hg` the MLP's hidden layer before and after GELU; the last three
/// are the classifier's row and the softmax's target and loss (its probabilities overwrite
/// `logits`).
pub fn decode_buffer_sizes<E: Elem>(cfg: &GptConfig, rows: usize) -> [(&'static str, usize, usize); 12] {
    let (c, e) = (cfg.n_embd, E::BYTES);
    [
        ("tokens", rows, 4),
        ("x", rows * c, e),
        ("ln", rows * c, e),
        ("mean", rows, 4),
        ("rstd", rows, 4),
        ("qkv", rows * 3 * c, e),
        ("atty", rows * c, e),
        ("h", rows * 4 * c, e),
        ("hg", rows * 4 * c, e),
        ("logits", cfg.padded_vocab(), e),
        ("target", 1, 4),
        ("loss", 1, 4),
    ]
}

/// The workspace buffers (bytes each) live at each op of a chunk of `rows` new tokens at the
/// end of a `context`-position cache that takes pool scratch: a block's matmuls and cached
/// attention, and the classifier's matmul (one row).
pub fn decode_op_scratch<E: Elem>(
    model: WorkspaceModel,
    cfg: &GptConfig,
    rows: usize,
    context: usize,
) -> DecodeScratch {
    let c = cfg.n_embd;
    let mut block: Vec<Vec<usize>> = [(c, 3 * c), (c, c), (c, 4 * c), (4 * c, c)]
        .iter()
        .map(|&(i, o)| model.matmul_forward::<E>(rows, i, o))
        .collect();
    let d = CachedAttention { b: 1, tn: rows, start: context - rows, context, c, nh: cfg.n_head };
    block.push(model.attention_cached(d));
    DecodeScratch { block, head: model.matmul_forward::<E>(1, c, cfg.padded_vocab()) }
}

/// What `decode_op_scratch` returns: per block op, and the classifier's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeScratch {
    pub block: Vec<Vec<usize>>,
    pub head: Vec<usize>,
}

/// Every layer's keys and values for the positions decoded so far (category `kv_cache`).
pub struct KvCache {
    layers: Vec<Buffer>,
    context: usize,
    len: usize,
}

impl KvCache {
    /// Room for `context` positions (at most the model's block size) in `E`.
    pub fn new<E: Elem>(pool: &Pool, cfg: &GptConfig, context: usize) -> Result<KvCache, OomError> {
        let layers = (0..cfg.n_layer)
            .map(|_| pool.alloc(kv_cache_layer_elems(cfg, context) * E::BYTES, Category::KvCache))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(KvCache { layers, context, len: 0 })
    }

    /// Positions held.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Positions it has room for.
    pub fn context(&self) -> usize {
        self.context
    }

    /// Forget every position (the memory stays).
    pub fn clear(&mut self) {
        self.len = 0;
    }
}

/// The decoder's buffers, as `decode_buffer_sizes` lists them.
struct DecodeBuffers {
    tokens: Buffer,
    x: Buffer,
    ln: Buffer,
    mean: Buffer,
    rstd: Buffer,
    qkv: Buffer,
    atty: Buffer,
    h: Buffer,
    hg: Buffer,
    logits: Buffer,
    target: Buffer,
    loss: Buffer,
}

/// Runs new tokens of one sequence through the model against its `KvCache`.
pub struct Decoder<'a, E: Elem, B: Backend> {
    be: &'a B,
    elem: PhantomData<E>,
    cfg: GptConfig,
    cache: KvCache,
    chunk: usize,
    bufs: DecodeBuffers,
}

impl<'a, E: Elem, B: Backend> Decoder<'a, E, B> {
    /// A decoder with a cache of `context` positions (1..=block_size) and buffers for chunks
    /// of `chunk` tokens (1..=context), in `E`; everything allocated now.
    pub fn new(be: &'a B, cfg: &GptConfig, context: usize, chunk: usize) -> BackendResult<Decoder<'a, E, B>> {
        assert!((1..=cfg.block_size).contains(&context), "context within the model's positions");
        assert!((1..=context).contains(&chunk), "a chunk within the context");
        let pool = be.pool();
        let cache = KvCache::new::<E>(pool, cfg, context)?;
        let mut it = decode_buffer_sizes::<E>(cfg, chunk).into_iter();
        let mut next = || -> Result<Buffer, OomError> {
            let (_, elems, width) = it.next().expect("a size per buffer");
            pool.alloc(elems * width, Category::Activations)
        };
        let bufs = DecodeBuffers {
            tokens: next()?,
            x: next()?,
            ln: next()?,
            mean: next()?,
            rstd: next()?,
            qkv: next()?,
            atty: next()?,
            h: next()?,
            hg: next()?,
            logits: next()?,
            target: next()?,
            loss: next()?,
        };
        Ok(Decoder { be, elem: PhantomData, cfg: *cfg, cache, chunk, bufs })
    }

    /// The cache (positions held, room).
    pub fn cache(&self) -> &KvCache {
        &self.cache
    }

    /// Start over: the next tokens are at position 0.
    pub fn clear(&mut self) {
        self.cache.clear();
    }

    /// Run `tokens` after the cached positions (there must be room for them), then write the
    /// next-token probabilities after the last of them into `probs` (V).
    pub fn feed(&mut self, params: &dyn ParamSource<E>, tokens: &[u32], probs: &mut [f32]) -> BackendResult {
        assert!(!tokens.is_empty() && self.cache.len + tokens.len() <= self.cache.context, "tokens fit the cache");
        assert_eq!(probs.len(), self.cfg.vocab, "probs: (V)");
        for part in tokens.chunks(self.chunk) {
            self.chunk_forward(params, part)?;
        }
        // The last token is the last row of the last chunk.
        self.head(params, (tokens.len() - 1) % self.chunk, probs)
    }

    /// One chunk through the blocks: afterwards `x` holds its rows' final residual stream and
    /// the cache holds their keys and values.
    fn chunk_forward(&mut self, params: &dyn ParamSource<E>, tokens: &[u32]) -> BackendResult {
        let (be, cfg) = (self.be, &self.cfg);
        let (c, nh, vp, n) = (cfg.n_embd, cfg.n_head, cfg.padded_vocab(), tokens.len());
        let start = self.cache.len;
        let DecodeBuffers { tokens: tok, x, ln, mean, rstd, qkv, atty, h, hg, .. } = &mut self.bufs;
        be.upload(ViewMut::range(tok, 0..n), tokens)?;
        {
            // x: (n,C) = wte[token] + wpe[start + i]
            let w = params.fetch(cfg.embed_range(), (cfg.n_layer > 0).then(|| cfg.layer_range(0)))?;
            let (wte, wpe) = w.view().split_at(vp * c);
            let wpe = wpe.slice(start * c..(start + n) * c);
            be.encoder_forward(ViewMut::range(x, 0..n * c), View::range(tok, 0..n), wte, wpe, n, c)?;
        }
        // The first n rows of a buffer `width` wide.
        fn rows<E: Elem>(buf: &mut Buffer, n: usize, width: usize) -> ViewMut<'_, E> {
            ViewMut::range(buf, 0..n * width)
        }
        fn part<E: Elem>(buf: &Buffer, n: usize, width: usize) -> View<'_, E> {
            View::range(buf, 0..n * width)
        }
        fn stat(buf: &mut Buffer, n: usize) -> ViewMut<'_, f32> {
            ViewMut::range(buf, 0..n)
        }
        for l in 0..cfg.n_layer {
            let next = if l + 1 < cfg.n_layer { cfg.layer_range(l + 1) } else { cfg.lnf_range() };
            let w = params.fetch(cfg.layer_range(l), Some(next))?;
            let p = cfg.layer_view(w.view());
            // ln: (n,C) = ln1(x)
            be.layernorm_forward(rows(ln, n, c), stat(mean, n), stat(rstd, n), part(x, n, c), p.ln1w, p.ln1b, c)?;
            // qkv: (n,3C)
            be.matmul_forward(rows(qkv, n, 3 * c), part::<E>(ln, n, c), p.qkvw, Some(p.qkvb), n, c, 3 * c)?;
            // atty: (n,C); the rows' keys and values appended to the layer's cache
            let dims = CachedAttention { b: 1, tn: n, start, context: self.cache.context, c, nh };
            let cache = ViewMut::<E>::of(&mut self.cache.layers[l]);
            be.attention_cached(rows(atty, n, c), cache, part::<E>(qkv, n, 3 * c), dims)?;
            // x += atty · attprojwᵀ + attprojb
            be.matmul_forward(rows(ln, n, c), part(atty, n, c), p.attprojw, Some(p.attprojb), n, c, c)?;
            be.residual_forward_inplace(rows::<E>(x, n, c), part::<E>(ln, n, c))?;
            // ln: (n,C) = ln2(x)
            be.layernorm_forward(rows(ln, n, c), stat(mean, n), stat(rstd, n), part(x, n, c), p.ln2w, p.ln2b, c)?;
            // h, hg: (n,4C)
            be.matmul_forward(rows(h, n, 4 * c), part::<E>(ln, n, c), p.fcw, Some(p.fcb), n, c, 4 * c)?;
            be.gelu_forward(rows::<E>(hg, n, 4 * c), part::<E>(h, n, 4 * c))?;
            // x += hg · fcprojwᵀ + fcprojb
            be.matmul_forward(rows(ln, n, c), part(hg, n, 4 * c), p.fcprojw, Some(p.fcprojb), n, 4 * c, c)?;
            be.residual_forward_inplace(rows::<E>(x, n, c), part::<E>(ln, n, c))?;
        }
        self.cache.len = start + n;
        Ok(())
    }

    /// The classifier on row `row` of `x`: probs (V) = softmax(lnf(x[row]) · wteᵀ).
    fn head(&mut self, params: &dyn ParamSource<E>, row: usize, probs: &mut [f32]) -> BackendResult {
        let (be, cfg) = (self.be, &self.cfg);
        let c = cfg.n_embd;
        let DecodeBuffers { x, ln, mean, rstd, logits, target, loss, .. } = &mut self.bufs;
        {
            let w = params.fetch(cfg.lnf_range(), Some(cfg.wte_range()))?;
            let (lnfw, lnfb) = w.view().split_at(c);
            let xv = View::<E>::range(x, row * c..(row + 1) * c);
            let (mean, rstd) = (ViewMut::range(mean, 0..1), ViewMut::range(rstd, 0..1));
            be.layernorm_forward(ViewMut::<E>::range(ln, 0..c), mean, rstd, xv, lnfw, lnfb, c)?;
        }
        {
            // logits: (1,VP) = lnf · wteᵀ (the classifier is tied to the token embedding)
            let wte = params.fetch(cfg.wte_range(), None)?;
            let lv = View::<E>::range(ln, 0..c);
            be.matmul_forward(ViewMut::<E>::of(logits), lv, wte.view(), None, 1, c, cfg.padded_vocab())?;
        }
        // The softmax in place (its loss, against target 0, is not used).
        let (v, vp) = (cfg.vocab, cfg.padded_vocab());
        be.upload(ViewMut::<u32>::of(target), &[0])?;
        be.crossentropy_forward(ViewMut::<E>::of(logits), ViewMut::of(loss), View::of(target), v, vp)?;
        let mut host = vec![E::default(); v];
        be.download(View::<E>::range(logits, 0..v), &mut host)?;
        for (p, q) in probs.iter_mut().zip(host) {
            *p = q.to_f32();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Checkpointing, OffloadTarget};
    use crate::engine::backend::CpuBackend;
    use crate::engine::model::forward;
    use crate::engine::model::{PpStage, TpShard};
    use crate::engine::quant::{quantize, Quantized, Scheme};

    /// The next-token probabilities after `tokens`, by the full forward pass over all of them.
    fn full_pass(be: &CpuBackend, cfg: &GptConfig, source: &dyn ParamSource<f32>, tokens: &[u32]) -> Vec<f32> {
        let t = tokens.len();
        let acts = forward::<f32, _>(
            be,
            cfg,
            source,
            tokens,
            &vec![0; t],
            1,
            t,
            Checkpointing::Full,
            OffloadTarget::None,
            &crate::engine::model::TensorGroup::none(),
            crate::engine::model::HeadOutput::Probabilities,
        )
        .unwrap();
        let mut probs = vec![0f32; cfg.vocab];
        let row = (t - 1) * cfg.padded_vocab();
        be.download(View::range(acts.logits.as_ref().unwrap(), row..row + cfg.vocab), &mut probs).unwrap();
        probs
    }

    /// Fed a prompt and then one token at a time, in chunks of any size, the decoder gives at
    /// every position the probabilities the full pass over the same tokens gives.
    #[test]
    fn cached_decoding_matches_the_full_forward_pass_at_every_position() {
        let cfg = GptConfig {
            n_layer: 2,
            n_head: 2,
            n_embd: 32,
            block_size: 16,
            vocab: 64,
            tp: TpShard::NONE,
            pp: PpStage::NONE,
        };
        let mut w = vec![0f32; cfg.num_params()];
        cfg.init_params(&mut w, 11);
        let be = CpuBackend::new(Pool::new("cpu", 64 << 20));
        let model = quantize(&cfg, &w, Scheme::Fp32);
        let source = Quantized::upload(&be, &model).unwrap();
        let tokens: Vec<u32> = (0..16).map(|i| (i * 37 % 64) as u32).collect();
        for chunk in [1, 3, 16] {
            let mut dec = Decoder::<f32, _>::new(&be, &cfg, 16, chunk).unwrap();
            let mut probs = vec![0f32; cfg.vocab];
            let prompt = 7;
            dec.feed(&source, &tokens[..prompt], &mut probs).unwrap();
            for len in prompt..=16 {
                if len > prompt {
                    dec.feed(&source, &tokens[len - 1..len], &mut probs).unwrap();
                }
                assert_eq!(dec.cache().len(), len);
                let full = full_pass(&be, &cfg, &source, &tokens[..len]);
                let worst = probs.iter().zip(&full).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                assert!(worst < 1e-6, "chunk {chunk}, {len} tokens: probabilities differ by {worst}");
            }
            dec.clear();
            dec.feed(&source, &tokens[3..9], &mut probs).unwrap();
            let full = full_pass(&be, &cfg, &source, &tokens[3..9]);
            let worst = probs.iter().zip(&full).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(worst < 1e-6, "after clear, the window starts at position 0 again: {worst}");
        }
        assert_eq!(be.pool().stats().current(Category::KvCache), 0, "the caches went with their decoders");
    }

    /// A cache is its own category, one (2, context, C) buffer per layer.
    #[test]
    fn the_cache_takes_its_own_category() {
        let cfg = GptConfig {
            n_layer: 3,
            n_head: 2,
            n_embd: 32,
            block_size: 16,
            vocab: 64,
            tp: TpShard::NONE,
            pp: PpStage::NONE,
        };
        let pool = Pool::new("cpu", 64 << 20);
        let cache = KvCache::new::<f32>(&pool, &cfg, 10).unwrap();
        assert_eq!((cache.len(), cache.context()), (0, 10));
        let bytes = 3 * crate::memory::block_bytes(2 * 10 * 32 * 4);
        assert_eq!(pool.stats().current(Category::KvCache), bytes);
        assert!(pool.memory_summary().contains("kv_cache"), "the summary shows it");
        drop(cache);
        assert_eq!(pool.stats().current(Category::KvCache), 0);
    }
}
