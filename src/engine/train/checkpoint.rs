//! Checkpoints: atomic (temp file, fsync, rename), checksummed, in a layout independent of
//! precision, micro-batch, ZeRO stage and offload: fp32 master weights and AdamW moments in the
//! canonical parameter order, plus step, data cursor and RNG state.
//!
//! File layout: `HRCKPT01` | u64 header length | JSON header | params f32 | m f32 | v f32 |
//! u32 CRC-32 of everything before it.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

const MAGIC: &[u8; 8] = b"HRCKPT01";
/// How many checkpoints are kept in a run directory (the newest, plus fallbacks).
pub const KEEP: usize = 2;

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("checkpoint {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("checkpoint {path}: {message}")]
    Corrupt { path: PathBuf, message: String },
    #[error("checkpoint {path} does not match this model: {message}")]
    Mismatch { path: PathBuf, message: String },
    #[error("checkpoint {path}: copying the state between host and device: {message}")]
    Device { path: PathBuf, message: String },
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct CheckpointHeader {
    pub version: u32,
    /// Optimizer steps completed.
    pub step: u64,
    pub num_params: u64,
    /// n_layer, n_head, n_embd, block_size, vocab
    pub model: [u64; 5],
    /// Next data position: batches are a function of the step, so this equals `step`.
    pub data_cursor: u64,
    pub rng_state: u64,
    pub seed: u64,
    /// AdamW bias-correction step count.
    pub adam_t: u64,
    /// fp16 dynamic loss scale (1.0 when unused).
    pub loss_scale: f64,
}

pub struct Checkpoint {
    pub header: CheckpointHeader,
    pub params: Vec<f32>,
    pub m: Vec<f32>,
    pub v: Vec<f32>,
}

pub fn checkpoint_path(run_dir: &Path, step: u64) -> PathBuf {
    run_dir.join(format!("ckpt-{step:08}.bin"))
}

/// Write atomically, then prune all but the newest [`KEEP`]. Returns the path written.
pub fn save(
    run_dir: &Path,
    header: &CheckpointHeader,
    params: &[f32],
    m: &[f32],
    v: &[f32],
) -> Result<PathBuf, CheckpointError> {
    let path = checkpoint_path(run_dir, header.step);
    let io = |source| CheckpointError::Io { path: path.clone(), source };
    std::fs::create_dir_all(run_dir).map_err(io)?;
    let json = serde_json::to_vec(header).expect("header serialises");
    let mut crc = crc32fast::Hasher::new();
    let tmp = path.with_extension("bin.tmp");
    {
        let file = std::fs::File::create(&tmp).map_err(io)?;
        let mut w = std::io::BufWriter::with_capacity(1 << 20, file);
        let mut put = |bytes: &[u8]| -> std::io::Result<()> {
            crc.update(bytes);
            w.write_all(bytes)
        };
        put(MAGIC).map_err(io)?;
        put(&(json.len() as u64).to_le_bytes()).map_err(io)?;
        put(&json).map_err(io)?;
        for part in [params, m, v] {
            put(bytemuck::cast_slice(part)).map_err(io)?;
        }
        let sum = crc.finalize();
        w.write_all(&sum.to_le_bytes()).map_err(io)?;
        let file = w.into_inner().map_err(|e| io(e.into_error()))?;
        file.sync_all().map_err(io)?;
    }
    std::fs::rename(&tmp, &path).map_err(io)?;
    if let Ok(dir) = std::fs::File::open(run_dir) {
        let _ = dir.sync_all();
    }
    for old in list(run_dir).into_iter().skip(KEEP) {
        let _ = std::fs::remove_file(old);
    }
    Ok(path)
}

/// Checkpoint files in `run_dir`, newest first.
pub fn list(run_dir: &Path) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(run_dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("ckpt-") && n.ends_with(".bin"))
        })
        .collect();
    found.sort();
    found.reverse();
    found
}

pub fn load(path: &Path) -> Result<Checkpoint, CheckpointError> {
    let bytes = std::fs::read(path).map_err(|source| CheckpointError::Io { path: path.into(), source })?;
    let corrupt = |message: &str| CheckpointError::Corrupt { path: path.into(), message: message.into() };
    if bytes.len() < 8 + 8 + 4 || &bytes[..8] != MAGIC {
        return Err(corrupt("not a headroom checkpoint (bad magic)"));
    }
    let (body, tail) = bytes.split_at(bytes.len() - 4);
    if crc32fast::hash(body) != u32::from_le_bytes(tail.try_into().unwrap()) {
        return Err(corrupt("checksum mismatch"));
    }
    let hlen = u64::from_le_bytes(body[8..16].try_into().unwrap()) as usize;
    let header: CheckpointHeader =
        serde_json::from_slice(body.get(16..16 + hlen).ok_or_else(|| corrupt("truncated header"))?)
            .map_err(|e| corrupt(&format!("bad header: {e}")))?;
    let n = header.num_params as usize;
    let data = &body[16 + hlen..];
    if data.len() != 3 * n * 4 {
        return Err(corrupt("tensor data has the wrong length"));
    }
    let floats = |i: usize| -> Vec<f32> {
        data[i * n * 4..(i + 1) * n * 4].chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
    };
    Ok(Checkpoint { params: floats(0), m: floats(1), v: floats(2), header })
}

/// The newest checkpoint that loads; corrupt ones are reported through `on_skip` and skipped.
pub fn load_latest(run_dir: &Path, mut on_skip: impl FnMut(&CheckpointError)) -> Option<(PathBuf, Checkpoint)> {
    for path in list(run_dir) {
        match load(&path) {
            Ok(c) => return Some((path, c)),
            Err(e) => on_skip(&e),
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(step: u64) -> CheckpointHeader {
        CheckpointHeader {
            version: 1,
            step,
            num_params: 3,
            model: [1, 1, 1, 1, 1],
            data_cursor: step,
            rng_state: 9,
            seed: 1,
            adam_t: step,
            loss_scale: 1.0,
        }
    }

    #[test]
    fn round_trip_prune_and_fall_back_on_corruption() {
        let dir = tempfile::tempdir().unwrap();
        for step in [10, 20, 30] {
            let x = step as f32;
            save(dir.path(), &header(step), &[x, 2.0, 3.0], &[0.1; 3], &[0.2; 3]).unwrap();
        }
        let files = list(dir.path());
        assert_eq!(files.len(), KEEP, "older checkpoints pruned");
        let (_, c) = load_latest(dir.path(), |_| {}).unwrap();
        assert_eq!(c.header.step, 30);
        assert_eq!(c.params, vec![30.0, 2.0, 3.0]);
        // Flip one byte of the newest: load falls back to the previous one.
        let mut raw = std::fs::read(&files[0]).unwrap();
        let mid = raw.len() / 2;
        raw[mid] ^= 0xff;
        std::fs::write(&files[0], raw).unwrap();
        let mut skipped = 0;
        let (_, c) = load_latest(dir.path(), |_| skipped += 1).unwrap();
        assert_eq!((c.header.step, skipped), (20, 1));
    }
}
