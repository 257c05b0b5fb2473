//! Training data: tokenisation (bytes or GPT-2 BPE), the llm.c token-file cache, the
//! deterministic train/val split and reproducible batches.
//!
//! Batches are a pure function of (seed, step, sequence index): sequence `i` of optimizer step
//! `s` is the same whatever the micro-batch size, rank count or resume point, so gradient
//! accumulation and resume are exact by construction. The "data cursor" is the step.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use crate::config::Vocab;

use crate::engine::rng::mix64;

/// Magic and version of llm.c's token files (`dev/data/*.bin`).
pub const TOKEN_FILE_MAGIC: i32 = 20240520;
pub const TOKEN_FILE_VERSION: i32 = 1;
const HEADER_INTS: usize = 256;

#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("data.path: cannot read {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("data.path: {path}: {message}")]
    Invalid { path: PathBuf, message: String },
    #[error("token cache {path}: {source}")]
    Cache { path: PathBuf, source: std::io::Error },
}

/// Tokenise `text` with the given vocabulary.
pub fn tokenize(text: &[u8], vocab: Vocab) -> Result<Vec<u16>, String> {
    match vocab {
        Vocab::Bytes => Ok(text.iter().map(|&b| b as u16).collect()),
        Vocab::Gpt2 => {
            let text =
                std::str::from_utf8(text).map_err(|e| format!("not valid UTF-8 for the gpt2 vocabulary: {e}"))?;
            let bpe = tiktoken_rs::r50k_base_singleton();
            Ok(bpe.encode_ordinary(text).into_iter().map(|t| t as u16).collect())
        }
    }
}

/// Write tokens in llm.c's format: 256 little-endian i32 header (magic, version, count), then u16s.
pub fn write_token_file(path: &Path, tokens: &[u16]) -> std::io::Result<()> {
    let mut header = [0i32; HEADER_INTS];
    header[0] = TOKEN_FILE_MAGIC;
    header[1] = TOKEN_FILE_VERSION;
    header[2] = tokens.len() as i32;
    // Per process: rank processes of one job may tokenise into the same cache at once.
    let tmp = path.with_extension(format!("bin.{}.tmp", std::process::id()));
    {
        let mut f = std::io::BufWriter::new(std::fs::File::create(&tmp)?);
        for h in header {
            f.write_all(&h.to_le_bytes())?;
        }
        for t in tokens {
            f.write_all(&t.to_le_bytes())?;
        }
        f.into_inner().map_err(|e| e.into_error())?.sync_all()?;
    }
    std::fs::rename(tmp, path)
}

/// Read an llm.c token file, checking magic, version and length.
pub fn read_token_file(path: &Path) -> Result<Vec<u16>, String> {
    let mut bytes = Vec::new();
    std::fs::File::open(path).and_then(|mut f| f.read_to_end(&mut bytes)).map_err(|e| e.to_string())?;
    if bytes.len() < HEADER_INTS * 4 {
        return Err("shorter than the 1024-byte header".into());
    }
    let int = |i: usize| i32::from_le_bytes(bytes[i * 4..i * 4 + 4].try_into().unwrap());
    if int(0) != TOKEN_FILE_MAGIC || int(1) != TOKEN_FILE_VERSION {
        return Err(format!("bad magic/version {} {}", int(0), int(1)));
    }
    let n = int(2) as usize;
    let body = &bytes[HEADER_INTS * 4..];
    if body.len() != n * 2 {
        return Err(format!("header says {n} tokens, file holds {}", body.len() / 2));
    }
    Ok(body.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect())
}

/// Tokens of a text file, tokenised once and cached under `cache_dir` in llm.c's format.
pub fn load_tokens(text_path: &Path, vocab: Vocab, cache_dir: &Path) -> Result<Vec<u16>, DataError> {
    let text = std::fs::read(text_path).map_err(|source| DataError::Read { path: text_path.into(), source })?;
    let stem = text_path.file_stem().and_then(|s| s.to_str()).unwrap_or("data");
    let cache = cache_dir.join(format!("{stem}-{}-{:08x}.bin", vocab.name(), crc32fast::hash(&text)));
    if let Ok(tokens) = read_token_file(&cache) {
        return Ok(tokens);
    }
    let tokens = tokenize(&text, vocab).map_err(|message| DataError::Invalid { path: text_path.into(), message })?;
    std::fs::create_dir_all(cache_dir).map_err(|source| DataError::Cache { path: cache_dir.into(), source })?;
    write_token_file(&cache, &tokens).map_err(|source| DataError::Cache { path: cache.clone(), source })?;
    Ok(tokens)
}

/// Train/val split of one token stream and the batch sampler over it.
pub struct Dataset {
    tokens: Vec<u16>,
    train_len: usize,
    pub seq_len: usize,
    seed: u64,
}

impl Dataset {
    /// The last `val_fraction` of the tokens is validation, the rest training. Both must hold at
    /// least one sequence of `seq_len + 1` tokens.
    pub fn new(tokens: Vec<u16>, val_fraction: f64, seq_len: usize, seed: u64) -> Result<Dataset, String> {
        let n = tokens.len();
        let train_len = ((n as f64) * (1.0 - val_fraction)) as usize;
        let val_len = n - train_len;
        if train_len < seq_len + 2 || val_len < seq_len + 1 {
            return Err(format!(
                "{n} tokens give {train_len} train / {val_len} val; each split needs more than block_size + 1 = {}",
                seq_len + 1
            ));
        }
        Ok(Dataset { tokens, train_len, seq_len, seed })
    }

    /// Training sequence `index` of optimizer step `step`: (inputs, targets), each `seq_len`.
    pub fn train_sequence(&self, step: u64, index: u64, inputs: &mut Vec<u32>, targets: &mut Vec<u32>) {
        let span = (self.train_len - self.seq_len - 1) as u64;
        let h = mix64(self.seed ^ mix64(step.wrapping_mul(0x1_0000_0001) ^ mix64(index)));
        self.push_window((h % span) as usize, inputs, targets);
    }

    /// `count` evenly spaced validation sequences starting at index `first` of them.
    pub fn val_sequence(&self, index: usize, count: usize, inputs: &mut Vec<u32>, targets: &mut Vec<u32>) {
        let val_len = self.tokens.len() - self.train_len;
        let span = val_len - self.seq_len - 1;
        let offset = self.train_len + if count <= 1 { 0 } else { index * span / (count - 1) };
        self.push_window(offset, inputs, targets);
    }

    fn push_window(&self, offset: usize, inputs: &mut Vec<u32>, targets: &mut Vec<u32>) {
        let w = &self.tokens[offset..offset + self.seq_len + 1];
        inputs.extend(w[..self.seq_len].iter().map(|&t| t as u32));
        targets.extend(w[1..].iter().map(|&t| t as u32));
    }

    /// Unigram entropy of the training split in nats: the loss of the best context-free model.
    pub fn unigram_entropy(&self) -> f64 {
        let mut counts = std::collections::HashMap::<u16, usize>::new();
        for &t in &self.tokens[..self.train_len] {
            *counts.entry(t).or_default() += 1;
        }
        let n = self.train_len as f64;
        counts.values().map(|&c| -(c as f64 / n) * (c as f64 / n).ln()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_file_round_trips_in_llmc_format() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.bin");
        write_token_file(&path, &[1, 2, 65535]).unwrap();
        let raw = std::fs::read(&path).unwrap();
        assert_eq!(i32::from_le_bytes(raw[0..4].try_into().unwrap()), 20240520);
        assert_eq!(raw.len(), 1024 + 6);
        assert_eq!(read_token_file(&path).unwrap(), vec![1, 2, 65535]);
        std::fs::write(&path, &raw[..1000]).unwrap();
        assert!(read_token_file(&path).is_err());
    }

    #[test]
    fn gpt2_tokeniser_matches_known_ids() {
        // "Hello world" in GPT-2 BPE is [15496, 995].
        assert_eq!(tokenize(b"Hello world", Vocab::Gpt2).unwrap(), vec![15496, 995]);
        assert_eq!(tokenize(b"Hi", Vocab::Bytes).unwrap(), vec![72, 105]);
    }

    #[test]
    fn batches_are_a_function_of_step_and_index() {
        let tokens: Vec<u16> = (0..10_000).map(|i| (i % 251) as u16).collect();
        let ds = Dataset::new(tokens, 0.1, 16, 7).unwrap();
        let (mut a, mut at, mut b, mut bt) = (vec![], vec![], vec![], vec![]);
        ds.train_sequence(3, 5, &mut a, &mut at);
        ds.train_sequence(3, 5, &mut b, &mut bt);
        assert_eq!((a.clone(), at.clone()), (b, bt));
        assert_eq!(&a[1..], &at[..15], "targets are inputs shifted by one");
        let (mut c, mut ct) = (vec![], vec![]);
        ds.train_sequence(4, 5, &mut c, &mut ct);
        assert_ne!(a, c);
        assert!(Dataset::new(vec![0; 20], 0.1, 16, 7).is_err());
    }
}
