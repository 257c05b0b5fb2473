//! Each backend's transient workspace per op, as a pure function of shapes and dtype: the ops
//! size their scratch buffers from these declarations and the estimator sums the same ones, so a
//! prediction is exact for the backend the job runs on. Only ops that take pool memory appear;
//! libraries' own memory (cuBLAS's workspace) is outside the pool.

use serde::{Serialize, Serializer};

use crate::config::DeviceKind;

use super::layers::{self, Elem};

/// Whose workspace declarations a prediction uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkspaceModel {
    Cpu,
    /// The cuda backend, with the attention kernels it runs.
    Cuda(CudaAttentionKernels),
}

/// The cuda attention's kernels in 16-bit storage: cuBLAS products around a (T, T) softmax (the
/// default; scratch: head copies and a chunk's (T, T) matrices, `CudaAttention`), or the fused
/// kernels (`flash_attention_*`: no (T, T) buffer, no head copies; backward's one scratch is
/// each row's D, (B,NH,T) f32) for head sizes 32 and 64. Chosen by
/// `HEADROOM_CUDA_ATTENTION=gemm|fused` — read by the device when it opens and by the estimator
/// alike — until the fused kernels' speed is measured on a GPU; both keep only lse between the
/// passes, so either backward follows either forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CudaAttentionKernels {
    #[default]
    Gemm,
    Fused,
}

impl CudaAttentionKernels {
    pub const VARIABLE: &'static str = "HEADROOM_CUDA_ATTENTION";
    /// The values `parse` accepts, for an error message.
    pub const EXPECTED: &'static str = "gemm or fused";

    /// The setting's value (unset: `gemm`); None for anything else.
    pub fn parse(value: Option<&str>) -> Option<CudaAttentionKernels> {
        match value {
            None | Some("gemm") => Some(CudaAttentionKernels::Gemm),
            Some("fused") => Some(CudaAttentionKernels::Fused),
            Some(_) => None,
        }
    }

    /// The setting in this process's environment; Err(the value) when `parse` refuses it.
    pub fn from_env() -> Result<CudaAttentionKernels, String> {
        let value = std::env::var(Self::VARIABLE).ok();
        Self::parse(value.as_deref()).ok_or_else(|| value.unwrap_or_default())
    }

    /// Whether the fused kernels run for storage `E` and head size `hs`.
    pub fn fused<E: Elem>(self, hs: usize) -> bool {
        self == CudaAttentionKernels::Fused && !E::is_f32() && matches!(hs, 32 | 64)
    }
}

impl WorkspaceModel {
    /// The cuda backend with its default kernels.
    pub const CUDA: WorkspaceModel = WorkspaceModel::Cuda(CudaAttentionKernels::Gemm);

    /// The model of a device kind's backend as this process would open it: on cuda, with the
    /// attention kernels `HEADROOM_CUDA_ATTENTION` selects (a value the device would refuse to
    /// open with reads as the default here; the device's error names it).
    pub fn of(kind: DeviceKind) -> WorkspaceModel {
        match kind {
            DeviceKind::Cpu => WorkspaceModel::Cpu,
            DeviceKind::Cuda => WorkspaceModel::Cuda(CudaAttentionKernels::from_env().unwrap_or_default()),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            WorkspaceModel::Cpu => "cpu",
            WorkspaceModel::Cuda(CudaAttentionKernels::Gemm) => "cuda",
            WorkspaceModel::Cuda(CudaAttentionKernels::Fused) => "cuda_fused_attention",
        }
    }

    /// Buffers (bytes each) live at the peak of `matmul_forward` (N,C)·(OC,C)ᵀ.
    pub fn matmul_forward<E: Elem>(self, n: usize, c: usize, oc: usize) -> Vec<usize> {
        match self {
            WorkspaceModel::Cpu => vec![layers::matmul_forward_scratch::<E>(n, c, oc) * 4],
            WorkspaceModel::Cuda(_) => vec![],
        }
    }

    /// Buffers live at the peak of `matmul_backward` (with a bias gradient or without): on
    /// cuda the bias gradient's partial column sums.
    pub fn matmul_backward<E: Elem>(self, n: usize, c: usize, oc: usize, bias: bool) -> Vec<usize> {
        match self {
            WorkspaceModel::Cpu => vec![layers::matmul_backward_scratch::<E>(n, c, oc) * 4],
            WorkspaceModel::Cuda(_) if bias => vec![cuda_column_bands(n) * oc * 4],
            WorkspaceModel::Cuda(_) => vec![],
        }
    }

    /// Buffers live at the peak of `layernorm_backward` over (N,C): on cuda the partial column
    /// sums of the weight and bias gradients; the cpu's accumulators are not pool memory.
    pub fn layernorm_backward(self, n: usize, c: usize) -> Vec<usize> {
        match self {
            WorkspaceModel::Cpu => vec![],
            WorkspaceModel::Cuda(_) => vec![cuda_column_bands(n) * c * 4; 2],
        }
    }

    /// Buffers live at the peak of `attention_forward`: none with the fused kernel.
    pub fn attention_forward<E: Elem>(self, b: usize, t: usize, c: usize, nh: usize) -> Vec<usize> {
        match self {
            WorkspaceModel::Cpu => vec![layers::attention_forward_scratch::<E>(b, t, c, nh) * 4],
            WorkspaceModel::Cuda(k) if k.fused::<E>(c / nh) => vec![],
            WorkspaceModel::Cuda(_) => CudaAttention::of::<E>(b, t, c, nh).forward_peak(),
        }
    }

    /// Buffers live at the peak of `attention_backward`: with the fused kernels, each row's
    /// D = Σ p·datt, (B,NH,T) f32.
    pub fn attention_backward<E: Elem>(self, b: usize, t: usize, c: usize, nh: usize) -> Vec<usize> {
        match self {
            WorkspaceModel::Cpu => vec![layers::attention_backward_scratch::<E>(b, t, c, nh) * 4],
            WorkspaceModel::Cuda(k) if k.fused::<E>(c / nh) => vec![b * nh * t * 4],
            WorkspaceModel::Cuda(_) => CudaAttention::of::<E>(b, t, c, nh).backward_peak(),
        }
    }

    /// Buffers live at the peak of `attention_cached`: the cpu's score row per (batch, head),
    /// the cuda kernel's per (batch, head, new token).
    pub fn attention_cached(self, d: super::shapes::CachedAttention) -> Vec<usize> {
        match self {
            WorkspaceModel::Cpu => vec![layers::attention_cached_scratch(d.b, d.context, d.nh) * 4],
            WorkspaceModel::Cuda(_) => vec![d.b * d.nh * d.tn * d.context * 4],
        }
    }

    /// Buffers live during `encoder_backward` over `bt` positions: the cuda kernels' sort keys
    /// (token, position) as u64, padded to a power of two; the cpu's order is not pool memory.
    pub fn encoder_backward(self, bt: usize) -> Vec<usize> {
        match self {
            WorkspaceModel::Cpu => vec![],
            WorkspaceModel::Cuda(_) => vec![cuda_order_keys(bt) * 8],
        }
    }

    /// Buffers live during `sum_squares` over `n` elements: the cuda kernel's per-block partial
    /// sums (one f32 per block), the cpu none.
    pub fn sum_squares<E: Elem>(self, n: usize) -> Vec<usize> {
        match self {
            WorkspaceModel::Cpu => vec![],
            WorkspaceModel::Cuda(_) => vec![cuda_norm_blocks(n) * 4],
        }
    }
}

impl Serialize for WorkspaceModel {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

/// Threads per block of the cuda kernels' one-dimensional launches.
pub const CUDA_THREADS: usize = 256;
/// The most blocks a cuda reduction (`sum_squares`) launches; each writes one partial sum.
pub const CUDA_NORM_BLOCKS: usize = 1024;

/// Rows per band of a cuda column sum (bias and LayerNorm parameter gradients), and the most
/// bands: a (rows, C) tensor is summed by ⌈C/32⌉ × bands blocks, so a tall one fills the device
/// (GPT-2 124M at B 16, T 1024: 64 bands of 256 rows) instead of ⌈C/32⌉ blocks walking every row.
pub const CUDA_COLUMN_BAND_ROWS: usize = 256;
pub const CUDA_COLUMN_BANDS: usize = 128;

/// Bands of a cuda column sum over `rows` rows; each band's sums are a row of f32 partials.
pub fn cuda_column_bands(rows: usize) -> usize {
    rows.div_ceil(CUDA_COLUMN_BAND_ROWS).clamp(1, CUDA_COLUMN_BANDS)
}

/// Keys per block of the embedding backward's token sort (`ORDER_CHUNK` in `encoder.cu`: 16 KiB
/// of shared memory, 1024 threads).
pub const CUDA_ORDER_CHUNK: usize = 2048;

/// Keys the embedding backward's token sort orders for `bt` positions: a power of two (the
/// bitonic network's length), the positions past `bt` padding.
pub fn cuda_order_keys(bt: usize) -> usize {
    bt.next_power_of_two().max(2)
}

/// Blocks of the cuda `sum_squares` launch over `n` elements.
pub fn cuda_norm_blocks(n: usize) -> usize {
    n.div_ceil(CUDA_THREADS).clamp(1, CUDA_NORM_BLOCKS)
}

/// The most bytes one chunk of the CUDA attention's (T,T) matrices (f32 scores and `E`
/// probabilities of every head of `chunk` sequences) may hold, unless one sequence needs more.
/// Bounds the attention's workspace whatever the batch, and keeps each batched product large
/// enough to fill the device (GPT-2 124M at T 1024: 3 sequences, 36 heads, per chunk).
pub const CUDA_ATTENTION_CHUNK_BYTES: usize = 256 << 20;

/// The CUDA attention's scratch buffers (bytes), which `cuda::backend` allocates by these
/// names and in the order `forward_peak` / `backward_peak` list them. The (T,T) matrices
/// exist for one chunk of sequences at a time; nothing of (B,NH,T,T) is kept between passes
/// (backward recomputes the probabilities from the saved log-sum-exp).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaAttention {
    /// One (B·NH, T, HS) head-major copy in `E`: q, k, v (forward's y reuses q), dy.
    pub heads: usize,
    /// One (B·NH, T, HS) head-major tensor in f32: dq, dk, dv.
    pub heads_f32: usize,
    /// Sequences per chunk.
    pub chunk: usize,
    /// (chunk·NH, T, T) f32: a chunk's scores, then (backward) the probabilities' gradient.
    pub scores: usize,
    /// (chunk·NH, T, T) in `E`: a chunk's probabilities, then (backward) the scores' gradient.
    pub probs: usize,
}

impl CudaAttention {
    pub fn of<E: Elem>(b: usize, t: usize, c: usize, nh: usize) -> CudaAttention {
        let elems = b * t * c;
        let per_sequence = nh * t * t * (4 + E::BYTES);
        let chunk = (CUDA_ATTENTION_CHUNK_BYTES / per_sequence.max(1)).clamp(1, b.max(1));
        CudaAttention {
            heads: elems * E::BYTES,
            heads_f32: elems * 4,
            chunk,
            scores: chunk * nh * t * t * 4,
            probs: chunk * nh * t * t * E::BYTES,
        }
    }

    /// Forward: q, k, v, then a chunk's scores and probabilities.
    pub fn forward_peak(&self) -> Vec<usize> {
        vec![self.heads, self.heads, self.heads, self.scores, self.probs]
    }

    /// Backward: q, k, v, dy, dq, dk, dv, then a chunk's scores and probabilities.
    pub fn backward_peak(&self) -> Vec<usize> {
        let (h, f) = (self.heads, self.heads_f32);
        vec![h, h, h, h, f, f, f, self.scores, self.probs]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_attention_works_in_chunks_of_sequences_within_the_budget() {
        // GPT-2 124M, B 16, T 1024, 12 heads, bf16: 75.5 MB of (T,T) matrices per sequence,
        // so 3 sequences per chunk — 226 MB where the whole batch's f32 scores alone were 805 MB.
        let a = CudaAttention::of::<half::bf16>(16, 1024, 768, 12);
        assert_eq!(a.chunk, 3);
        assert_eq!(a.scores, 3 * 12 * 1024 * 1024 * 4);
        assert_eq!(a.probs, 3 * 12 * 1024 * 1024 * 2);
        assert!(a.scores + a.probs <= CUDA_ATTENTION_CHUNK_BYTES);
        assert_eq!(a.backward_peak().len(), 9);
        // A small batch fits one chunk; a sequence over the budget is a chunk of its own.
        assert_eq!(CudaAttention::of::<f32>(4, 64, 64, 4).chunk, 4);
        let long = CudaAttention::of::<half::bf16>(2, 8192, 1024, 16);
        assert_eq!(long.chunk, 1);
        assert_eq!(long.scores, 16 * 8192 * 8192 * 4);
        // The CPU declarations are its layer functions' scratch.
        assert_eq!(
            WorkspaceModel::Cpu.attention_forward::<f32>(4, 64, 64, 4),
            vec![layers::attention_forward_scratch::<f32>(4, 64, 64, 4) * 4]
        );
        assert_eq!(
            WorkspaceModel::Cpu.attention_backward::<half::bf16>(4, 64, 64, 4),
            vec![layers::attention_backward_scratch::<half::bf16>(4, 64, 64, 4) * 4]
        );
        assert!(WorkspaceModel::CUDA.matmul_forward::<half::bf16>(256, 64, 192).is_empty(), "cuBLAS, not the pool");
        // Column sums: 64 bands of 256 rows at B 16, T 1024; capped at 128; one for a short tensor.
        assert_eq!(WorkspaceModel::CUDA.matmul_backward::<half::bf16>(16 * 1024, 768, 2304, true), vec![64 * 2304 * 4]);
        assert!(WorkspaceModel::CUDA.matmul_backward::<half::bf16>(16 * 1024, 768, 50257, false).is_empty());
        assert_eq!(WorkspaceModel::CUDA.layernorm_backward(1 << 20, 1600), vec![128 * 1600 * 4; 2]);
        assert_eq!(cuda_column_bands(10), 1);
        assert!(WorkspaceModel::Cpu.layernorm_backward(1 << 20, 1600).is_empty());
    }

    #[test]
    fn the_fused_cuda_attention_declares_d_alone_where_its_kernels_run() {
        use half::{bf16, f16};
        let fused = WorkspaceModel::Cuda(CudaAttentionKernels::Fused);
        // (B, T, C, NH): head sizes 64 and 32 run fused in 16-bit storage
        for (b, t, c, nh) in [(16, 1024, 768, 12), (3, 37, 96, 3)] {
            assert!(fused.attention_forward::<bf16>(b, t, c, nh).is_empty());
            assert_eq!(fused.attention_backward::<f16>(b, t, c, nh), vec![b * nh * t * 4]);
            // fp32, and the default kernels, keep the cuBLAS path's
            assert_eq!(
                fused.attention_backward::<f32>(b, t, c, nh),
                CudaAttention::of::<f32>(b, t, c, nh).backward_peak()
            );
            assert_eq!(
                WorkspaceModel::CUDA.attention_forward::<bf16>(b, t, c, nh),
                CudaAttention::of::<bf16>(b, t, c, nh).forward_peak()
            );
        }
        // other head sizes (48, 128) have no fused kernels
        for (c, nh) in [(768, 16), (1024, 8)] {
            assert_eq!(
                fused.attention_backward::<bf16>(4, 64, c, nh),
                CudaAttention::of::<bf16>(4, 64, c, nh).backward_peak()
            );
        }
        assert_eq!(CudaAttentionKernels::parse(Some("gemm ")), None, "no trimming: the device would refuse it");
    }
}
