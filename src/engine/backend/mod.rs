//! The `Backend` trait: the op set the engine's layers are written in, over pool buffers, with
//! `CpuBackend` (the reference, over `layers.rs`) and, behind the `cuda` feature,
//! `cuda::CudaBackend` (NVRTC kernels + cuBLAS). Ops take typed views into pool buffers, check
//! shapes before touching memory, and return `Result`: an OOM of a scratch buffer is a value.
//!
//! Semantics are the CPU reference's (see `layers.rs`): backward ops *accumulate* into
//! parameter gradients and *overwrite* activation gradients unless documented otherwise;
//! statistics, softmax and losses are f32 whatever the storage type.

pub mod collectives;
mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
mod error;
pub mod layers;
pub mod optim;
pub mod shapes;
pub mod simd;
mod view;
pub mod workspace;

use bytemuck::Pod;

use crate::memory::Pool;
use optim::AdamW;

pub use collectives::DeviceCollectives;
pub use cpu::CpuBackend;
pub use error::{check_shape, BackendError, BackendResult};
pub use layers::Elem;
pub use view::{View, ViewMut};

/// Host memory a backend has page-locked (`Backend::pin_host`), unlocked when dropped.
#[derive(Default)]
pub struct HostPin(Option<Box<dyn Send + Sync>>);

impl HostPin {
    /// A pin released by dropping `guard`.
    pub fn new(guard: impl Send + Sync + 'static) -> HostPin {
        HostPin(Some(Box::new(guard)))
    }

    /// Whether any memory is locked.
    pub fn is_pinned(&self) -> bool {
        self.0.is_some()
    }
}

impl std::fmt::Debug for HostPin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostPin({})", if self.is_pinned() { "locked" } else { "none" })
    }
}

/// `wait` on every fence, all of them even after an error (no copy may still be landing once
/// its memory is reused); the first error.
fn wait_every<F>(fences: impl IntoIterator<Item = F>, mut wait: impl FnMut(F) -> BackendResult) -> BackendResult {
    let mut first = Ok(());
    for fence in fences {
        let waited = wait(fence);
        first = first.and(waited);
    }
    first
}

/// The op set. Shapes follow llm.c: B batch, T time, C channels, NH heads, V vocabulary,
/// N = B·T rows. A backend belongs to one rank and may be moved to that rank's thread.
#[allow(clippy::too_many_arguments)]
pub trait Backend: Send {
    /// The device, e.g. `cpu` or `cuda:0`.
    fn device(&self) -> String;
    /// The pool every buffer of this backend comes from.
    fn pool(&self) -> &Pool;
    /// Wait for every op issued so far.
    fn synchronize(&self) -> BackendResult;
    /// Native collectives with the other ranks' devices (NCCL on cuda), when this rank's
    /// group was opened with them; `None`: `Group` stages device memory through the host.
    fn collectives(&self) -> Option<&dyn DeviceCollectives> {
        None
    }

    /// What `upload_ahead` hands back: the copy's completion, for `wait_copy`.
    type Fence;

    /// Copy host data to the device; done when it returns.
    fn upload<T: Pod>(&self, dst: ViewMut<T>, src: &[T]) -> BackendResult;
    /// Copy device data to the host; done when it returns.
    fn download<T: Pod>(&self, src: View<T>, dst: &mut [T]) -> BackendResult;
    fn zero<T: Pod>(&self, dst: ViewMut<T>) -> BackendResult;
    /// dst = src, both on the device (defragmentation's moves). By default staged through
    /// the host; backends with a device-to-device copy override it.
    fn copy<T: Pod>(&self, dst: ViewMut<T>, src: View<T>) -> BackendResult {
        shapes::same("copy", "destination", dst.len(), src.len())?;
        let mut host = vec![T::zeroed(); src.len()];
        self.download(src, &mut host)?;
        self.upload(dst, &host)
    }

    /// Start copying host data to the device off the compute stream (offload prefetch), so the
    /// transfer overlaps the ops issued meanwhile. `src` may be reused when this returns; `dst`
    /// holds the data only for ops issued after `wait_copy(fence)`, which must come before
    /// `dst`'s buffer is read, written or freed. A backend without a copy engine copies now.
    fn upload_ahead<T: Pod>(&self, dst: ViewMut<T>, src: &[T]) -> BackendResult<Self::Fence>;
    /// Order every op issued from now on after the copy behind `fence` (does not block the
    /// host on a device with streams).
    fn wait_copy(&self, fence: Self::Fence) -> BackendResult;
    /// Start copying device data to the host off the compute stream, after every op issued so
    /// far (offloaded gradients leaving during the backward pass), so the transfer overlaps the
    /// ops issued meanwhile. Ops issued later must not write `src` before the copy has read it
    /// (`wait_copy(fence)` orders them after it). A backend without a copy engine copies now.
    ///
    /// # Safety
    /// `dst` must stay allocated, and be neither read nor written, until `wait_host(fence)`
    /// (or `wait_copy(fence)`, after which its contents are unspecified) returns: the device
    /// writes it after this call has returned. It is fastest page-locked (`pin_host`).
    unsafe fn download_ahead<T: Pod>(&self, src: View<T>, dst: &mut [T]) -> BackendResult<Self::Fence>;
    /// Block the host until the copy behind `fence` has landed (a download's destination then
    /// holds the data).
    fn wait_host(&self, fence: Self::Fence) -> BackendResult;
    /// `wait_host` on every fence, all of them even after an error; the first error.
    fn wait_host_all(&self, fences: impl IntoIterator<Item = Self::Fence>) -> BackendResult
    where
        Self: Sized,
    {
        wait_every(fences, |f| self.wait_host(f))
    }
    /// Page-lock host memory this backend copies to and from, so copies into it run on the
    /// copy engine without a staging pass; released when the returned pin is dropped, which
    /// must happen before `mem` is freed. Where that gains nothing (the host is the device),
    /// an empty pin.
    fn pin_host(&self, _mem: &mut [u8]) -> BackendResult<HostPin> {
        Ok(HostPin::default())
    }

    /// `wait_copy` on every fence, all of them even after an error (no copy may still be
    /// landing once its memory is reused); the first error.
    fn wait_copies(&self, fences: impl IntoIterator<Item = Self::Fence>) -> BackendResult
    where
        Self: Sized,
    {
        wait_every(fences, |f| self.wait_copy(f))
    }

    /// out: (B,T,C) = wte[inp] + wpe[t]; inp: (B,T); wte: (V,C); wpe: (maxT,C).
    fn encoder_forward<E: Elem>(
        &self,
        out: ViewMut<E>,
        inp: View<u32>,
        wte: View<E>,
        wpe: View<E>,
        t: usize,
        c: usize,
    ) -> BackendResult;
    /// dwte (V,C) += each token's rows of dout (B,T,C), summed in f32 in (b,t) order and added
    /// once; dwpe (maxT,C) += dout summed over B in order, rounded per add (`layers::encoder_backward`).
    fn encoder_backward<E: Elem>(
        &self,
        dwte: ViewMut<E>,
        dwpe: ViewMut<E>,
        dout: View<E>,
        inp: View<u32>,
        t: usize,
        c: usize,
    ) -> BackendResult;

    /// out: (N,C); mean, rstd: (N) f32; inp: (N,C); weight, bias: (C).
    fn layernorm_forward<E: Elem>(
        &self,
        out: ViewMut<E>,
        mean: ViewMut<f32>,
        rstd: ViewMut<f32>,
        inp: View<E>,
        weight: View<E>,
        bias: View<E>,
        c: usize,
    ) -> BackendResult;
    /// out: (N,C) from inp and the saved statistics (checkpointing's recompute).
    fn layernorm_recompute<E: Elem>(
        &self,
        out: ViewMut<E>,
        inp: View<E>,
        weight: View<E>,
        bias: View<E>,
        mean: View<f32>,
        rstd: View<f32>,
        c: usize,
    ) -> BackendResult;
    /// dinp (N,C) += input gradient; dweight, dbias (C) += parameter gradients.
    fn layernorm_backward<E: Elem>(
        &self,
        dinp: ViewMut<E>,
        dweight: ViewMut<E>,
        dbias: ViewMut<E>,
        dout: View<E>,
        inp: View<E>,
        weight: View<E>,
        mean: View<f32>,
        rstd: View<f32>,
        c: usize,
    ) -> BackendResult;

    /// out: (N,OC) = inp (N,C) · weightᵀ (weight: (OC,C)) + bias (OC).
    fn matmul_forward<E: Elem>(
        &self,
        out: ViewMut<E>,
        inp: View<E>,
        weight: View<E>,
        bias: Option<View<E>>,
        n: usize,
        c: usize,
        oc: usize,
    ) -> BackendResult;
    /// dinp (N,C) = dout · weight [overwritten]; dweight (OC,C) += doutᵀ · inp; dbias (OC) += Σ dout.
    fn matmul_backward<E: Elem>(
        &self,
        dinp: ViewMut<E>,
        dweight: ViewMut<E>,
        dbias: Option<ViewMut<E>>,
        dout: View<E>,
        inp: View<E>,
        weight: View<E>,
        n: usize,
        c: usize,
        oc: usize,
    ) -> BackendResult;

    /// out: (B,T,C); lse: (B,NH,T) f32, each query's log-sum-exp of its scaled causal scores
    /// (what backward keeps instead of the (B,NH,T,T) probabilities); qkv: (B,T,3C).
    fn attention_forward<E: Elem>(
        &self,
        out: ViewMut<E>,
        lse: ViewMut<f32>,
        qkv: View<E>,
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
    ) -> BackendResult;
    /// dqkv: (B,T,3C) [overwritten]; dout: (B,T,C); qkv, lse as saved by forward (the
    /// probabilities are recomputed from them).
    fn attention_backward<E: Elem>(
        &self,
        dqkv: ViewMut<E>,
        dout: View<E>,
        qkv: View<E>,
        lse: View<f32>,
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
    ) -> BackendResult;
    /// Incremental decoding: the keys and values of the `tn` new tokens in qkv (B,Tn,3C) are
    /// written into cache (2,B,context,C) at positions start..start+Tn, then each new token
    /// attends to every cached position up to its own. out: (B,Tn,C).
    fn attention_cached<E: Elem>(
        &self,
        out: ViewMut<E>,
        cache: ViewMut<E>,
        qkv: View<E>,
        dims: shapes::CachedAttention,
    ) -> BackendResult;

    /// out: (N) = gelu(inp)
    fn gelu_forward<E: Elem>(&self, out: ViewMut<E>, inp: View<E>) -> BackendResult;
    /// dinout: (N) dout on entry, gelu'(inp) · dout on return.
    fn gelu_backward_inplace<E: Elem>(&self, dinout: ViewMut<E>, inp: View<E>) -> BackendResult;
    /// out (N) += inp (N)
    fn residual_forward_inplace<E: Elem>(&self, out: ViewMut<E>, inp: View<E>) -> BackendResult;

    /// logits: (N,VP) turned into probabilities in place — the softmax over each row's first
    /// V, 0 in the padding columns past it; losses: (N) f32; targets: (N), each below V.
    fn crossentropy_forward<E: Elem>(
        &self,
        logits: ViewMut<E>,
        losses: ViewMut<f32>,
        targets: View<u32>,
        v: usize,
        vp: usize,
    ) -> BackendResult;
    /// The loss and its gradient in one pass over the logits (training's head): losses: (N) f32
    /// as `crossentropy_forward`'s; logits: (N,VP) turned into their gradient
    /// (softmax − onehot(target)) · dloss in place (0 in the padding columns), the
    /// probabilities never stored.
    fn crossentropy_forward_backward<E: Elem>(
        &self,
        logits: ViewMut<E>,
        losses: ViewMut<f32>,
        targets: View<u32>,
        dloss: f32,
        v: usize,
        vp: usize,
    ) -> BackendResult;

    /// One AdamW step of one tensor: fp32 `master` and moments updated from `grads × grad_mult`;
    /// `params`, the compute copy in `E`, rewritten from the master (None: the master is it, f32).
    fn adamw<E: Elem>(
        &self,
        master: ViewMut<f32>,
        params: Option<ViewMut<E>>,
        grads: View<E>,
        m: ViewMut<f32>,
        v: ViewMut<f32>,
        step: &AdamW,
        decay: bool,
        grad_mult: f32,
    ) -> BackendResult;
    /// Σ x² in f64 (not NaN-safe: a NaN or inf gradient gives a non-finite sum, as on CPU).
    fn sum_squares<E: Elem>(&self, x: View<E>) -> BackendResult<f64>;

    /// dst (N) = src rounded to `E`.
    fn narrow<E: Elem>(&self, dst: ViewMut<E>, src: View<f32>) -> BackendResult;
    /// dst (N) = src widened to f32.
    fn widen<E: Elem>(&self, dst: ViewMut<f32>, src: View<E>) -> BackendResult;

    /// q: (N,C) int8, scales: (N) f32 from x: (N,C) (activation offload's transfer format).
    fn pack_int8<E: Elem>(&self, q: ViewMut<i8>, scales: ViewMut<f32>, x: View<E>, c: usize) -> BackendResult;
    /// x: (N,C) = q · scale of its row.
    fn unpack_int8<E: Elem>(&self, x: ViewMut<E>, q: View<i8>, scales: View<f32>, c: usize) -> BackendResult;
    /// x: (N) = the 4-bit values of `packed` (N/2 bytes: element 2i in the low nibble, 2i+1 in
    /// the high one, two's complement in [-8, 7]) · the scale of their group of `group`
    /// (scales: N/group) — quantized weights for inference.
    fn unpack_int4<E: Elem>(&self, x: ViewMut<E>, packed: View<u8>, scales: View<f32>, group: usize) -> BackendResult;
}
