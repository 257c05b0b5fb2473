//! Checkpoints: atomic (temp file, fsync, rename), checksummed, in a layout independent of
//! precision, micro-batch, ZeRO stage and offload: fp32 master weights and AdamW moments in the
//! canonical parameter order, plus step, data cursor and RNG state.
//!
//! File layout: `HRCKPT01` | u64 header length | JSON header | params f32 | m f32 | v f32 |
//! u32 CRC-32 of everything before it.
//!
//! Each checkpoint names the lineage (run) that wrote it (see `run_dir`): retention prunes only
//! older checkpoints of the same lineage, resume reads only the run's own, and a checkpoint that
//! fails to load is moved to `corrupt/` (kept for inspection) rather than shadowing newer ones.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::engine::model::GptConfig;

const MAGIC: &[u8; 8] = b"HRCKPT01";
/// The layout version written: 2, `wte` with `GptConfig::padded_vocab()` rows (the padding rows
/// zero); 1, `vocab` rows — upgraded as it loads (zero rows inserted after `wte`'s last).
pub const VERSION: u32 = 2;
/// How many checkpoints of a run are kept (the newest, plus fallbacks).
pub const KEEP: usize = 2;
/// Where checkpoints that fail to load are moved.
pub const CORRUPT_DIR: &str = "corrupt";

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
    /// The run that wrote it (`RunIdentity::lineage`); absent in checkpoints written before
    /// run identities, which belong to whichever run owns their directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lineage: Option<String>,
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

/// Write atomically, then prune the same lineage's older checkpoints down to [`KEEP`] in all.
/// Returns the path written.
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
    prune(run_dir, header);
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
    let mut ckpt = Checkpoint { params: floats(0), m: floats(1), v: floats(2), header };
    if ckpt.header.version < 2 {
        pad_vocabulary(&mut ckpt);
    }
    Ok(ckpt)
}

/// A version-1 checkpoint in today's layout: its `wte`'s `vocab` rows followed by the padding
/// rows, zero in the weights and both moments. Left as it is when its size is not the
/// unpadded model's (the trainer then refuses it as a mismatch).
fn pad_vocabulary(ckpt: &mut Checkpoint) {
    let cfg = GptConfig::of_dims(ckpt.header.model);
    let (real, padded) = (cfg.vocab * cfg.n_embd, cfg.padded_vocab() * cfg.n_embd);
    let n = cfg.num_params();
    if ckpt.params.len() + (padded - real) != n {
        return;
    }
    for part in [&mut ckpt.params, &mut ckpt.m, &mut ckpt.v] {
        part.splice(real..real, std::iter::repeat_n(0.0, padded - real));
    }
    ckpt.header.num_params = n as u64;
    ckpt.header.version = VERSION;
}

/// The newest checkpoint of `lineage` (any, for `None`) that loads. One that does not load is
/// reported through `on_skip` and, when corrupt, moved to `corrupt/`; other lineages' are passed
/// over untouched.
pub fn load_latest(
    run_dir: &Path,
    lineage: Option<&str>,
    mut on_skip: impl FnMut(&CheckpointError),
) -> Option<(PathBuf, Checkpoint)> {
    for path in list(run_dir) {
        // Another run's checkpoint is passed over on its header alone: never read whole (it can
        // be gigabytes) nor moved.
        if read_header(&path).is_some_and(|h| !belongs(&h, lineage)) {
            continue;
        }
        match load(&path) {
            Ok(c) if belongs(&c.header, lineage) => return Some((path, c)),
            Ok(_) => {}
            Err(e) => {
                on_skip(&e);
                if matches!(e, CheckpointError::Corrupt { .. }) {
                    quarantine(run_dir, &path);
                }
            }
        }
    }
    None
}

/// Whether a checkpoint was written by `lineage` (pre-lineage checkpoints belong to any).
fn belongs(header: &CheckpointHeader, lineage: Option<&str>) -> bool {
    match (header.lineage.as_deref(), lineage) {
        (Some(written), Some(wanted)) => written == wanted,
        _ => true,
    }
}

/// Only the JSON header of a checkpoint file (no checksum: for retention, not for loading).
fn read_header(path: &Path) -> Option<CheckpointHeader> {
    use std::io::Read;
    let mut f = std::fs::File::open(path).ok()?;
    let mut head = [0u8; 16];
    f.read_exact(&mut head).ok()?;
    if &head[..8] != MAGIC {
        return None;
    }
    let len = u64::from_le_bytes(head[8..].try_into().ok()?) as usize;
    if len > 1 << 20 {
        return None;
    }
    let mut json = vec![0u8; len];
    f.read_exact(&mut json).ok()?;
    serde_json::from_slice(&json).ok()
}

/// After `written` was saved: delete the same lineage's checkpoints of earlier steps beyond the
/// newest [`KEEP`]. Other lineages' files and later steps are never touched.
fn prune(run_dir: &Path, written: &CheckpointHeader) {
    let older = list(run_dir)
        .into_iter()
        .filter(|p| read_header(p).is_some_and(|h| h.step < written.step && belongs(&h, written.lineage.as_deref())));
    for old in older.skip(KEEP - 1) {
        let _ = std::fs::remove_file(old);
    }
}

/// Move a checkpoint that does not load to `corrupt/`, out of the way of resume and retention.
fn quarantine(run_dir: &Path, path: &Path) {
    let dir = run_dir.join(CORRUPT_DIR);
    let name = path.file_name().expect("a checkpoint file name");
    if let Err(e) = std::fs::create_dir_all(&dir).and_then(|_| std::fs::rename(path, dir.join(name))) {
        tracing::warn!("could not move corrupt checkpoint {} aside: {e}", path.display());
    } else {
        tracing::warn!("corrupt checkpoint {} moved to {}", path.display(), dir.display());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(step: u64) -> CheckpointHeader {
        CheckpointHeader {
            version: VERSION,
            step,
            num_params: 3,
            model: [1, 1, 1, 1, 1],
            data_cursor: step,
            rng_state: 9,
            seed: 1,
            adam_t: step,
            loss_scale: 1.0,
            lineage: Some("a".into()),
        }
    }

    /// A checkpoint of the layout before the vocabulary padding loads in today's: `wte`'s rows,
    /// then zero padding rows (weights and both moments), then every other tensor unmoved.
    #[test]
    fn a_version_1_checkpoint_loads_with_the_padding_rows_inserted() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = GptConfig::of_dims([1, 2, 8, 16, 50]);
        let (real, padded) = (50 * 8, cfg.padded_vocab() * 8);
        assert_eq!(padded, 64 * 8);
        let n_old = cfg.num_params() - (padded - real);
        let values = |k: f32| (0..n_old).map(|i| k + i as f32).collect::<Vec<f32>>();
        let (p, m, v) = (values(1.0), values(-1e6), values(1e6));
        let old = CheckpointHeader { version: 1, num_params: n_old as u64, model: cfg.dims(), ..header(7) };
        save(dir.path(), &old, &p, &m, &v).unwrap();
        let ckpt = load(&checkpoint_path(dir.path(), 7)).unwrap();
        assert_eq!((ckpt.header.version, ckpt.header.num_params), (VERSION, cfg.num_params() as u64));
        for (got, was) in [(&ckpt.params, &p), (&ckpt.m, &m), (&ckpt.v, &v)] {
            assert_eq!(got.len(), cfg.num_params());
            assert_eq!(got[..real], was[..real], "wte's rows");
            assert!(got[real..padded].iter().all(|&x| x == 0.0), "the padding rows");
            assert_eq!(got[padded..], was[real..], "every tensor after wte");
        }
        // A version-1 file of another size is left as it is (the trainer refuses it).
        let odd = CheckpointHeader { version: 1, num_params: 5, model: cfg.dims(), ..header(8) };
        save(dir.path(), &odd, &[1.0; 5], &[0.0; 5], &[0.0; 5]).unwrap();
        assert_eq!(load(&checkpoint_path(dir.path(), 8)).unwrap().params.len(), 5);
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
        let (_, c) = load_latest(dir.path(), Some("a"), |_| {}).unwrap();
        assert_eq!(c.header.step, 30);
        assert_eq!(c.params, vec![30.0, 2.0, 3.0]);
        // Flip one byte of the newest: load falls back to the previous one.
        let mut raw = std::fs::read(&files[0]).unwrap();
        let mid = raw.len() / 2;
        raw[mid] ^= 0xff;
        std::fs::write(&files[0], raw).unwrap();
        let mut skipped = 0;
        let (_, c) = load_latest(dir.path(), Some("a"), |_| skipped += 1).unwrap();
        assert_eq!((c.header.step, skipped), (20, 1));
        // ... and the corrupt one is out of the way, kept under corrupt/.
        assert_eq!(list(dir.path()).len(), 1);
        assert!(dir.path().join(CORRUPT_DIR).join("ckpt-00000030.bin").is_file());
    }

    #[test]
    fn retention_keeps_this_lineage_newest_and_never_touches_another_run_or_later_steps() {
        let dir = tempfile::tempdir().unwrap();
        let other = |step| CheckpointHeader { lineage: Some("b".into()), ..header(step) };
        for step in [90, 100] {
            save(dir.path(), &other(step), &[1.0; 3], &[0.0; 3], &[0.0; 3]).unwrap();
        }
        // A new run at lower step numbers keeps its own newest two, and the other run's files.
        for step in [10, 20, 30] {
            save(dir.path(), &header(step), &[1.0; 3], &[0.0; 3], &[0.0; 3]).unwrap();
        }
        let names: Vec<String> =
            list(dir.path()).iter().map(|p| p.file_name().unwrap().to_string_lossy().into_owned()).collect();
        assert_eq!(names, ["ckpt-00000100.bin", "ckpt-00000090.bin", "ckpt-00000030.bin", "ckpt-00000020.bin"]);
        // Resume reads the run's own newest, not the other run's higher step.
        assert_eq!(load_latest(dir.path(), Some("a"), |_| {}).unwrap().1.header.step, 30);
        assert_eq!(load_latest(dir.path(), Some("b"), |_| {}).unwrap().1.header.step, 100);
        // A checkpoint from before lineages belongs to the run that owns the directory.
        assert!(belongs(&CheckpointHeader { lineage: None, ..header(5) }, Some("a")));
    }
}
