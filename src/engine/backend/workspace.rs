//! Each backend's transient workspace per op, as a pure function of shapes and dtype: the ops
//! size their scratch buffers from these declarations and the estimator sums the same ones, so a
//! prediction is exact for the backend the job runs on. Only ops that take pool memory appear;
//! libraries' own memory (cuBLAS's workspace) is outside the pool.

use serde::Serialize;

use crate::config::DeviceKind;
use crate::memory::blocks_bytes;

use super::layers::{self, Elem};

/// Whose workspace declarations a prediction uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum WorkspaceModel {
    Cpu,
    Cuda,
}

impl WorkspaceModel {
    pub fn of(kind: DeviceKind) -> WorkspaceModel {
        match kind {
            DeviceKind::Cpu => WorkspaceModel::Cpu,
            DeviceKind::Cuda => WorkspaceModel::Cuda,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            WorkspaceModel::Cpu => "cpu",
            WorkspaceModel::Cuda => "cuda",
        }
    }

    /// Buffers (bytes each) live at the peak of `matmul_forward` (N,C)·(OC,C)ᵀ.
    pub fn matmul_forward<E: Elem>(self, n: usize, c: usize, oc: usize) -> Vec<usize> {
        match self {
            WorkspaceModel::Cpu => vec![layers::matmul_forward_scratch::<E>(n, c, oc) * 4],
            WorkspaceModel::Cuda => vec![],
        }
    }

    /// Buffers live at the peak of `matmul_backward`.
    pub fn matmul_backward<E: Elem>(self, n: usize, c: usize, oc: usize) -> Vec<usize> {
        match self {
            WorkspaceModel::Cpu => vec![layers::matmul_backward_scratch::<E>(n, c, oc) * 4],
            WorkspaceModel::Cuda => vec![],
        }
    }

    /// Buffers live at the peak of `attention_forward`.
    pub fn attention_forward<E: Elem>(self, b: usize, t: usize, c: usize, nh: usize) -> Vec<usize> {
        match self {
            WorkspaceModel::Cpu => vec![layers::attention_forward_scratch(b, t, nh) * 4],
            WorkspaceModel::Cuda => CudaAttention::of::<E>(b, t, c, nh).forward_peak(),
        }
    }

    /// Buffers live at the peak of `attention_backward`.
    pub fn attention_backward<E: Elem>(self, b: usize, t: usize, c: usize, nh: usize) -> Vec<usize> {
        match self {
            WorkspaceModel::Cpu => vec![layers::attention_backward_scratch::<E>(b, t, c, nh) * 4],
            WorkspaceModel::Cuda => CudaAttention::of::<E>(b, t, c, nh).backward_peak(),
        }
    }

    /// Buffers live at the peak of `attention_cached`: the cpu's score row per (batch, head),
    /// the cuda kernel's per (batch, head, new token).
    pub fn attention_cached(self, d: super::shapes::CachedAttention) -> Vec<usize> {
        match self {
            WorkspaceModel::Cpu => vec![layers::attention_cached_scratch(d.b, d.context, d.nh) * 4],
            WorkspaceModel::Cuda => vec![d.b * d.nh * d.tn * d.context * 4],
        }
    }

    /// Buffers live during `sum_squares` over `n` elements: the cuda kernel's per-block partial
    /// sums (one f32 per block), the cpu none.
    pub fn sum_squares<E: Elem>(self, n: usize) -> Vec<usize> {
        match self {
            WorkspaceModel::Cpu => vec![],
            WorkspaceModel::Cuda => vec![cuda_norm_blocks(n) * 4],
        }
    }
}

/// Threads per block of the cuda kernels' one-dimensional launches.
pub const CUDA_THREADS: usize = 256;
/// The most blocks a cuda reduction (`sum_squares`) launches; each writes one partial sum.
pub const CUDA_NORM_BLOCKS: usize = 1024;

/// Blocks of the cuda `sum_squares` launch over `n` elements.
pub fn cuda_norm_blocks(n: usize) -> usize {
    n.div_ceil(CUDA_THREADS).clamp(1, CUDA_NORM_BLOCKS)
}

/// The CUDA attention's scratch buffers (bytes), which `cuda::backend` allocates by these
/// names and in the order the phases below describe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaAttention {
    /// One (B·NH, T, HS) head-major copy in `E`: q, k, v, dy.
    pub heads: usize,
    /// (B·NH, T, T) scores or their gradient, f32.
    pub scores: usize,
    /// One (B·NH, T, HS) head-major tensor in f32: dv, q32, k32, dq, dk.
    pub heads_f32: usize,
}

impl CudaAttention {
    pub fn of<E: Elem>(b: usize, t: usize, c: usize, nh: usize) -> CudaAttention {
        let elems = b * t * c;
        CudaAttention { heads: elems * E::BYTES, scores: b * nh * t * t * 4, heads_f32: elems * 4 }
    }

    /// Forward: q, k, v and the scores are live together (then the scores go, y reuses q).
    pub fn forward_peak(&self) -> Vec<usize> {
        vec![self.heads, self.heads, self.heads, self.scores]
    }

    /// Backward in three phases: (q, k, v, dy, datt, dv); v and dy freed, (q, k, datt, dv, q32,
    /// k32); q and k freed, (datt, dv, q32, k32, dq, dk). The largest phase is the peak.
    pub fn backward_peak(&self) -> Vec<usize> {
        let h = self.heads;
        let (s, f) = (self.scores, self.heads_f32);
        let phases = [vec![h, h, h, h, s, f], vec![h, h, s, f, f, f], vec![s, f, f, f, f, f]];
        phases.into_iter().max_by_key(|p| blocks_bytes(p)).expect("three phases")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_attention_backward_peaks_in_the_phase_with_the_most_bytes() {
        // bf16: heads 2 bytes/elem, f32 heads 4: the last phase (5 f32 heads) is largest.
        let a = CudaAttention::of::<half::bf16>(4, 64, 64, 4);
        assert_eq!(a.backward_peak(), vec![a.scores, a.heads_f32, a.heads_f32, a.heads_f32, a.heads_f32, a.heads_f32]);
        // The CPU declarations are its layer functions' scratch.
        assert_eq!(
            WorkspaceModel::Cpu.attention_forward::<f32>(4, 64, 64, 4),
            vec![layers::attention_forward_scratch(4, 64, 4) * 4]
        );
        assert!(WorkspaceModel::Cuda.matmul_forward::<half::bf16>(256, 64, 192).is_empty(), "cuBLAS, not the pool");
    }
}
