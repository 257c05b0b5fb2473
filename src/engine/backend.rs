//! The `Backend` trait: the op set the engine's layers are written in, over pool buffers, with
//! `CpuBackend` (the reference, over `layers.rs`) and, behind the `cuda` feature,
//! `cuda::CudaBackend` (NVRTC kernels + cuBLAS). Ops take typed views into pool buffers, check
//! shapes before touching memory, and return `Result`: an OOM of a scratch buffer is a value.
//!
//! Semantics are the CPU reference's (see `layers.rs`): backward ops *accumulate* into
//! parameter gradients and *overwrite* activation gradients unless documented otherwise;
//! statistics, softmax and losses are f32 whatever the storage type.

use std::marker::PhantomData;
use std::ops::Range;

use bytemuck::Pod;

use crate::memory::{Buffer, Category, OomError, Pool};

use super::collectives::DeviceCollectives;
use super::layers::{self, Elem};
use super::model::TensorInfo;
use super::optim::{self, AdamW};

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error(transparent)]
    Oom(#[from] OomError),
    #[error("{backend}: {op} does not support {dtype}")]
    Unsupported { backend: String, op: &'static str, dtype: &'static str },
    #[error("{op}: {detail}")]
    Shape { op: &'static str, detail: String },
    #[error("{op} on {device}: {detail}")]
    Device { op: &'static str, device: String, detail: String },
}

pub type BackendResult<T = ()> = Result<T, BackendError>;

/// Fail with a shape error naming the op when `ok` is false.
pub fn check_shape(op: &'static str, ok: bool, detail: impl FnOnce() -> String) -> BackendResult {
    if ok {
        Ok(())
    } else {
        Err(BackendError::Shape { op, detail: detail() })
    }
}

/// Where a view's elements are: the first element's address, the element count, and whether
/// the memory is the host's. Shared by `View` and `ViewMut`, which add the borrow.
#[derive(Clone, Copy)]
struct Span {
    address: u64,
    len: usize,
    host_visible: bool,
}

impl Span {
    /// Elements `range` of `buf` as `T`. Panics when out of bounds or misaligned (a caller bug).
    fn of<T>(buf: &Buffer, range: Range<usize>) -> Span {
        let whole = buf.len() / std::mem::size_of::<T>();
        assert!(range.start <= range.end && range.end <= whole, "view {range:?} of {whole} elements");
        assert!(
            (buf.address() as usize).is_multiple_of(std::mem::align_of::<T>()),
            "buffer at {:#x} is not aligned for its element type",
            buf.address()
        );
        Span { address: buf.address(), len: whole, host_visible: buf.host_visible() }.sub::<T>(range)
    }

    /// Elements `range` of this span. Panics when out of bounds.
    fn sub<T>(self, range: Range<usize>) -> Span {
        assert!(range.start <= range.end && range.end <= self.len, "view {range:?} of {} elements", self.len);
        Span {
            address: self.address + (range.start * std::mem::size_of::<T>()) as u64,
            len: range.end - range.start,
            ..self
        }
    }
}

/// A read-only run of `T` elements inside a pool buffer (host or device memory). It borrows
/// the buffer, so the buffer outlives it and is not written meanwhile.
pub struct View<'a, T> {
    span: Span,
    _borrow: PhantomData<&'a [T]>,
}

impl<T> Clone for View<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for View<'_, T> {}

impl<'a, T: Pod> View<'a, T> {
    fn new(span: Span) -> Self {
        View { span, _borrow: PhantomData }
    }

    /// The whole buffer as elements of `T`.
    pub fn of(buf: &'a Buffer) -> Self {
        Self::range(buf, 0..buf.len() / std::mem::size_of::<T>())
    }

    /// Elements `range` of the buffer. Panics when out of bounds (a caller bug).
    pub fn range(buf: &'a Buffer, range: Range<usize>) -> Self {
        Self::new(Span::of::<T>(buf, range))
    }

    /// A read-only view of host memory that is not a pool buffer (e.g. host-resident weights).
    pub fn from_host(s: &'a [T]) -> Self {
        Self::new(Span { address: s.as_ptr() as u64, len: s.len(), host_visible: true })
    }

    /// Elements `range` of this view. Panics when out of bounds.
    pub fn slice(self, range: Range<usize>) -> Self {
        Self::new(self.span.sub::<T>(range))
    }

    /// The first `mid` elements and the rest.
    pub fn split_at(self, mid: usize) -> (Self, Self) {
        (self.slice(0..mid), self.slice(mid..self.len()))
    }

    pub fn len(&self) -> usize {
        self.span.len
    }

    pub fn is_empty(&self) -> bool {
        self.span.len == 0
    }

    /// Whether the elements are in host memory.
    pub fn host_visible(&self) -> bool {
        self.span.host_visible
    }

    /// The elements, for a buffer in host memory. Panics for device memory (a caller bug:
    /// device data is read through the backend's `download`).
    pub fn host(&self) -> &'a [T] {
        assert!(self.span.host_visible, "host read of device memory at {:#x}", self.span.address);
        if self.span.len == 0 {
            return &[];
        }
        // SAFETY: the view was made from a live, aligned, host-visible buffer borrowed for 'a
        // and lies inside it (checked by `Span`); shared borrows only read.
        unsafe { std::slice::from_raw_parts(self.span.address as *const T, self.span.len) }
    }

    /// Address of the first element (host pointer or device pointer).
    pub fn address(&self) -> u64 {
        self.span.address
    }

    /// The same elements marked host-visible: for `DeviceSim`, whose "device" memory is host
    /// memory that only its ops may touch.
    #[cfg(test)]
    pub(crate) fn exposed(self) -> Self {
        Self::new(Span { host_visible: true, ..self.span })
    }
}

/// A writable run of `T` elements inside a pool buffer. It borrows the buffer exclusively;
/// `split_at` / `split_sizes` cut it into disjoint writable parts.
pub struct ViewMut<'a, T> {
    span: Span,
    _borrow: PhantomData<&'a mut [T]>,
}

impl<'a, T: Pod> ViewMut<'a, T> {
    fn new(span: Span) -> Self {
        ViewMut { span, _borrow: PhantomData }
    }

    pub fn of(buf: &'a mut Buffer) -> Self {
        let len = buf.len() / std::mem::size_of::<T>();
        Self::range(buf, 0..len)
    }

    pub fn range(buf: &'a mut Buffer, range: Range<usize>) -> Self {
        Self::new(Span::of::<T>(buf, range))
    }

    /// A view of host memory that is not a pool buffer (e.g. host-resident weights), for a
    /// backend whose pool is host memory too.
    pub fn from_host(s: &'a mut [T]) -> Self {
        Self::new(Span { address: s.as_mut_ptr() as u64, len: s.len(), host_visible: true })
    }

    /// Elements `range` of this view (consuming it: the rest is not reachable meanwhile).
    pub fn slice(self, range: Range<usize>) -> Self {
        Self::new(self.span.sub::<T>(range))
    }

    /// The first `mid` elements and the rest, both writable (they do not overlap).
    pub fn split_at(self, mid: usize) -> (Self, Self) {
        let len = self.len();
        (Self::new(self.span.sub::<T>(0..mid)), Self::new(self.span.sub::<T>(mid..len)))
    }

    /// Consecutive disjoint parts of the given lengths (which must sum to at most `len`).
    pub fn split_sizes(self, sizes: &[usize]) -> Vec<Self> {
        let mut rest = self;
        let mut out = Vec::with_capacity(sizes.len());
        for &n in sizes {
            let (head, tail) = rest.split_at(n);
            out.push(head);
            rest = tail;
        }
        out
    }

    /// The same bytes as elements of another type of the same width (f32 weights of an `E`
    /// that is f32).
    pub fn reinterpret<U: Pod>(self) -> ViewMut<'a, U> {
        assert_eq!(std::mem::size_of::<T>(), std::mem::size_of::<U>(), "reinterpret needs equal widths");
        ViewMut::new(self.span)
    }

    /// The same elements, borrowed again for a shorter time (to pass on and keep this view).
    pub fn reborrow(&mut self) -> ViewMut<'_, T> {
        ViewMut::new(self.span)
    }

    pub fn len(&self) -> usize {
        self.span.len
    }

    pub fn is_empty(&self) -> bool {
        self.span.len == 0
    }

    pub fn host_visible(&self) -> bool {
        self.span.host_visible
    }

    /// The elements, for a buffer in host memory (panics for device memory).
    pub fn host_mut(&mut self) -> &mut [T] {
        assert!(self.span.host_visible, "host write of device memory at {:#x}", self.span.address);
        if self.span.len == 0 {
            return &mut [];
        }
        // SAFETY: the view was made from a live, aligned, host-visible buffer borrowed
        // exclusively for 'a; views split from it are disjoint, and &mut self keeps this one
        // the only access for the slice's lifetime.
        unsafe { std::slice::from_raw_parts_mut(self.span.address as *mut T, self.span.len) }
    }

    pub fn address(&self) -> u64 {
        self.span.address
    }

    /// A read-only view of the same elements.
    pub fn as_view(&self) -> View<'_, T> {
        View::new(self.span)
    }

    /// The same elements marked host-visible (see `View::exposed`).
    #[cfg(test)]
    pub(crate) fn exposed(self) -> Self {
        Self::new(Span { host_visible: true, ..self.span })
    }
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
    /// group was opened with them; `None`: `LocalComm` stages device memory through the host.
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

    /// Start copying host data to the device off the compute stream (offload prefetch), so the
    /// transfer overlaps the ops issued meanwhile. `src` may be reused when this returns; `dst`
    /// holds the data only for ops issued after `wait_copy(fence)`, which must come before
    /// `dst`'s buffer is read, written or freed. A backend without a copy engine copies now.
    fn upload_ahead<T: Pod>(&self, dst: ViewMut<T>, src: &[T]) -> BackendResult<Self::Fence>;
    /// Order every op issued from now on after the copy behind `fence` (does not block the
    /// host on a device with streams).
    fn wait_copy(&self, fence: Self::Fence) -> BackendResult;
    /// `wait_copy` on every fence, all of them even after an error (no copy may still be
    /// landing once its memory is reused); the first error.
    fn wait_copies(&self, fences: impl IntoIterator<Item = Self::Fence>) -> BackendResult
    where
        Self: Sized,
    {
        let mut first = Ok(());
        for fence in fences {
            let waited = self.wait_copy(fence);
            first = first.and(waited);
        }
        first
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
    /// dwte (V,C) += scatter of dout (B,T,C) by token; dwpe (maxT,C) += dout summed over B.
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

    /// out: (B,T,C); att: (B,NH,T,T) causal softmax probabilities; qkv: (B,T,3C).
    fn attention_forward<E: Elem>(
        &self,
        out: ViewMut<E>,
        att: ViewMut<E>,
        qkv: View<E>,
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
    ) -> BackendResult;
    /// dqkv: (B,T,3C) [overwritten]; dout: (B,T,C); qkv, att as saved by forward.
    fn attention_backward<E: Elem>(
        &self,
        dqkv: ViewMut<E>,
        dout: View<E>,
        qkv: View<E>,
        att: View<E>,
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
    ) -> BackendResult;

    /// out: (N) = gelu(inp)
    fn gelu_forward<E: Elem>(&self, out: ViewMut<E>, inp: View<E>) -> BackendResult;
    /// dinout: (N) dout on entry, gelu'(inp) · dout on return.
    fn gelu_backward_inplace<E: Elem>(&self, dinout: ViewMut<E>, inp: View<E>) -> BackendResult;
    /// out (N) += inp (N)
    fn residual_forward_inplace<E: Elem>(&self, out: ViewMut<E>, inp: View<E>) -> BackendResult;

    /// logits: (N,V) turned into probabilities in place; losses: (N) f32; targets: (N).
    fn crossentropy_forward<E: Elem>(
        &self,
        logits: ViewMut<E>,
        losses: ViewMut<f32>,
        targets: View<u32>,
        v: usize,
    ) -> BackendResult;
    /// probs: (N,V) turned into logit gradients (p - onehot) · dloss in place.
    fn crossentropy_backward_inplace<E: Elem>(
        &self,
        probs: ViewMut<E>,
        targets: View<u32>,
        dloss: f32,
        v: usize,
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
}

/// Each op's shape contract, shared by every backend so a bad call is the same error everywhere.
/// Lengths are in elements; functions that need N return it.
#[allow(clippy::too_many_arguments)]
pub mod shapes {
    use super::*;

    pub fn same(op: &'static str, what: &str, a: usize, b: usize) -> BackendResult {
        check_shape(op, a == b, || format!("{what}: {a} elements, expected {b}"))
    }

    pub fn rows(op: &'static str, len: usize, c: usize) -> BackendResult<usize> {
        check_shape(op, c > 0 && len.is_multiple_of(c), || format!("{len} elements are not whole rows of {c}"))?;
        Ok(len / c)
    }

    /// Token ids below `v`, checked where the ids are in host memory (device ids come from an
    /// upload of host data that the trainer has checked).
    fn tokens(op: &'static str, ids: View<u32>, v: usize) -> BackendResult {
        if ids.host_visible() {
            if let Some(bad) = ids.host().iter().find(|&&id| id as usize >= v) {
                return Err(BackendError::Shape {
                    op,
                    detail: format!("token id {bad} is not below the vocabulary size {v}"),
                });
            }
        }
        Ok(())
    }

    pub fn encoder_forward(out: usize, inp: View<u32>, wte: usize, wpe: usize, t: usize, c: usize) -> BackendResult {
        const OP: &str = "encoder_forward";
        same(OP, "out (B,T,C)", out, inp.len() * c)?;
        check_shape(OP, wpe >= t * c, || format!("wpe has {wpe} elements, T·C = {}", t * c))?;
        tokens(OP, inp, wte / c.max(1))
    }

    pub fn encoder_backward(
        dwte: usize,
        dwpe: usize,
        dout: usize,
        inp: View<u32>,
        t: usize,
        c: usize,
    ) -> BackendResult {
        const OP: &str = "encoder_backward";
        same(OP, "dout (B,T,C)", dout, inp.len() * c)?;
        check_shape(OP, dwpe >= t * c, || format!("dwpe has {dwpe} elements"))?;
        tokens(OP, inp, dwte / c.max(1))
    }

    fn layernorm(
        op: &'static str,
        out: usize,
        inp: usize,
        weight: usize,
        bias: usize,
        c: usize,
    ) -> BackendResult<usize> {
        let n = rows(op, inp, c)?;
        same(op, "output (N,C)", out, inp)?;
        same(op, "weight (C)", weight, c)?;
        same(op, "bias (C)", bias, c)?;
        Ok(n)
    }

    fn statistics(op: &'static str, mean: usize, rstd: usize, n: usize) -> BackendResult<usize> {
        same(op, "mean", mean, n)?;
        same(op, "rstd", rstd, n)?;
        Ok(n)
    }

    pub fn layernorm_forward(
        out: usize,
        mean: usize,
        rstd: usize,
        inp: usize,
        weight: usize,
        bias: usize,
        c: usize,
    ) -> BackendResult<usize> {
        const OP: &str = "layernorm_forward";
        let n = layernorm(OP, out, inp, weight, bias, c)?;
        statistics(OP, mean, rstd, n)
    }

    pub fn layernorm_recompute(
        out: usize,
        inp: usize,
        weight: usize,
        bias: usize,
        mean: usize,
        rstd: usize,
        c: usize,
    ) -> BackendResult<usize> {
        const OP: &str = "layernorm_recompute";
        let n = layernorm(OP, out, inp, weight, bias, c)?;
        statistics(OP, mean, rstd, n)
    }

    pub fn layernorm_backward(
        dinp: usize,
        dweight: usize,
        dbias: usize,
        dout: usize,
        inp: usize,
        weight: usize,
        mean: usize,
        rstd: usize,
        c: usize,
    ) -> BackendResult<usize> {
        const OP: &str = "layernorm_backward";
        let n = layernorm(OP, dinp, inp, weight, dbias, c)?;
        same(OP, "dout", dout, n * c)?;
        same(OP, "dweight", dweight, c)?;
        statistics(OP, mean, rstd, n)
    }

    fn matmul(
        op: &'static str,
        out: usize,
        inp: usize,
        weight: usize,
        bias: Option<usize>,
        n: usize,
        c: usize,
        oc: usize,
    ) -> BackendResult {
        same(op, "out (N,OC)", out, n * oc)?;
        same(op, "inp (N,C)", inp, n * c)?;
        same(op, "weight (OC,C)", weight, oc * c)?;
        if let Some(b) = bias {
            same(op, "bias (OC)", b, oc)?;
        }
        Ok(())
    }

    pub fn matmul_forward(
        out: usize,
        inp: usize,
        weight: usize,
        bias: Option<usize>,
        n: usize,
        c: usize,
        oc: usize,
    ) -> BackendResult {
        matmul("matmul_forward", out, inp, weight, bias, n, c, oc)
    }

    pub fn matmul_backward(
        dinp: usize,
        dweight: usize,
        dbias: Option<usize>,
        dout: usize,
        inp: usize,
        weight: usize,
        n: usize,
        c: usize,
        oc: usize,
    ) -> BackendResult {
        const OP: &str = "matmul_backward";
        matmul(OP, dout, inp, weight, dbias, n, c, oc)?;
        same(OP, "dinp (N,C)", dinp, n * c)?;
        same(OP, "dweight (OC,C)", dweight, oc * c)
    }

    fn attention(op: &'static str, qkv: usize, att: usize, b: usize, t: usize, c: usize, nh: usize) -> BackendResult {
        check_shape(op, nh > 0 && c.is_multiple_of(nh), || format!("C={c} is not a multiple of NH={nh}"))?;
        same(op, "qkv (B,T,3C)", qkv, b * t * 3 * c)?;
        same(op, "att (B,NH,T,T)", att, b * nh * t * t)
    }

    pub fn attention_forward(
        out: usize,
        att: usize,
        qkv: usize,
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
    ) -> BackendResult {
        const OP: &str = "attention_forward";
        attention(OP, qkv, att, b, t, c, nh)?;
        same(OP, "out (B,T,C)", out, b * t * c)
    }

    pub fn attention_backward(
        dqkv: usize,
        dout: usize,
        qkv: usize,
        att: usize,
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
    ) -> BackendResult {
        const OP: &str = "attention_backward";
        attention(OP, qkv, att, b, t, c, nh)?;
        same(OP, "dqkv (B,T,3C)", dqkv, b * t * 3 * c)?;
        same(OP, "dout (B,T,C)", dout, b * t * c)
    }

    pub fn crossentropy_forward(logits: usize, losses: usize, targets: View<u32>, v: usize) -> BackendResult<usize> {
        const OP: &str = "crossentropy_forward";
        let n = rows(OP, logits, v)?;
        same(OP, "losses", losses, n)?;
        same(OP, "targets", targets.len(), n)?;
        tokens(OP, targets, v)?;
        Ok(n)
    }

    pub fn crossentropy_backward(probs: usize, targets: View<u32>, v: usize) -> BackendResult<usize> {
        const OP: &str = "crossentropy_backward";
        let n = rows(OP, probs, v)?;
        same(OP, "targets", targets.len(), n)?;
        tokens(OP, targets, v)?;
        Ok(n)
    }

    pub fn adamw<E: Elem>(n: usize, params: Option<usize>, grads: usize, m: usize, v: usize) -> BackendResult {
        same("adamw", "grads", grads, n)?;
        same("adamw", "m", m, n)?;
        same("adamw", "v", v, n)?;
        match params {
            Some(p) => same("adamw", "params", p, n),
            None => check_shape("adamw", E::is_f32(), || {
                format!("{} weights need a compute copy besides the fp32 master", E::NAME)
            }),
        }
    }

    /// pack_int8 / unpack_int8: x (N,C), q (N,C), scales (N).
    pub fn int8(op: &'static str, x: usize, q: usize, scales: usize, c: usize) -> BackendResult<usize> {
        let n = rows(op, x, c)?;
        same(op, "q", q, x)?;
        same(op, "scales", scales, n)?;
        Ok(n)
    }
}

/// The CPU reference: `layers.rs` on host buffers of its pool; scratch comes from the same pool
/// as workspace.
#[derive(Debug, Clone)]
pub struct CpuBackend {
    pool: Pool,
}

impl CpuBackend {
    pub fn new(pool: Pool) -> CpuBackend {
        CpuBackend { pool }
    }

    fn scratch(&self, elems: usize) -> BackendResult<Buffer> {
        Ok(self.pool.alloc(elems * 4, Category::Workspace)?)
    }
}

impl Backend for CpuBackend {
    type Fence = ();

    fn device(&self) -> String {
        "cpu".into()
    }

    fn pool(&self) -> &Pool {
        &self.pool
    }

    fn synchronize(&self) -> BackendResult {
        Ok(())
    }

    fn upload<T: Pod>(&self, mut dst: ViewMut<T>, src: &[T]) -> BackendResult {
        shapes::same("upload", "destination", dst.len(), src.len())?;
        dst.host_mut().copy_from_slice(src);
        Ok(())
    }

    fn download<T: Pod>(&self, src: View<T>, dst: &mut [T]) -> BackendResult {
        shapes::same("download", "destination", dst.len(), src.len())?;
        dst.copy_from_slice(src.host());
        Ok(())
    }

    fn upload_ahead<T: Pod>(&self, dst: ViewMut<T>, src: &[T]) -> BackendResult {
        self.upload(dst, src)
    }

    fn wait_copy(&self, _fence: ()) -> BackendResult {
        Ok(())
    }

    fn zero<T: Pod>(&self, mut dst: ViewMut<T>) -> BackendResult {
        dst.host_mut().fill(T::zeroed());
        Ok(())
    }

    fn encoder_forward<E: Elem>(
        &self,
        mut out: ViewMut<E>,
        inp: View<u32>,
        wte: View<E>,
        wpe: View<E>,
        t: usize,
        c: usize,
    ) -> BackendResult {
        shapes::encoder_forward(out.len(), inp, wte.len(), wpe.len(), t, c)?;
        layers::encoder_forward(out.host_mut(), inp.host(), wte.host(), wpe.host(), t, c);
        Ok(())
    }

    fn encoder_backward<E: Elem>(
        &self,
        mut dwte: ViewMut<E>,
        mut dwpe: ViewMut<E>,
        dout: View<E>,
        inp: View<u32>,
        t: usize,
        c: usize,
    ) -> BackendResult {
        shapes::encoder_backward(dwte.len(), dwpe.len(), dout.len(), inp, t, c)?;
        layers::encoder_backward(dwte.host_mut(), dwpe.host_mut(), dout.host(), inp.host(), t, c);
        Ok(())
    }

    fn layernorm_forward<E: Elem>(
        &self,
        mut out: ViewMut<E>,
        mut mean: ViewMut<f32>,
        mut rstd: ViewMut<f32>,
        inp: View<E>,
        weight: View<E>,
        bias: View<E>,
        c: usize,
    ) -> BackendResult {
        shapes::layernorm_forward(out.len(), mean.len(), rstd.len(), inp.len(), weight.len(), bias.len(), c)?;
        layers::layernorm_forward(
            out.host_mut(),
            mean.host_mut(),
            rstd.host_mut(),
            inp.host(),
            weight.host(),
            bias.host(),
            c,
        );
        Ok(())
    }

    fn layernorm_recompute<E: Elem>(
        &self,
        mut out: ViewMut<E>,
        inp: View<E>,
        weight: View<E>,
        bias: View<E>,
        mean: View<f32>,
        rstd: View<f32>,
        c: usize,
    ) -> BackendResult {
        shapes::layernorm_recompute(out.len(), inp.len(), weight.len(), bias.len(), mean.len(), rstd.len(), c)?;
        layers::layernorm_recompute(
            out.host_mut(),
            inp.host(),
            weight.host(),
            bias.host(),
            mean.host(),
            rstd.host(),
            c,
        );
        Ok(())
    }

    fn layernorm_backward<E: Elem>(
        &self,
        mut dinp: ViewMut<E>,
        mut dweight: ViewMut<E>,
        mut dbias: ViewMut<E>,
        dout: View<E>,
        inp: View<E>,
        weight: View<E>,
        mean: View<f32>,
        rstd: View<f32>,
        c: usize,
    ) -> BackendResult {
        shapes::layernorm_backward(
            dinp.len(),
            dweight.len(),
            dbias.len(),
            dout.len(),
            inp.len(),
            weight.len(),
            mean.len(),
            rstd.len(),
            c,
        )?;
        let (dw, db) = (dweight.host_mut(), dbias.host_mut());
        layers::layernorm_backward(
            dinp.host_mut(),
            dw,
            db,
            dout.host(),
            inp.host(),
            weight.host(),
            mean.host(),
            rstd.host(),
            c,
        );
        Ok(())
    }

    fn matmul_forward<E: Elem>(
        &self,
        mut out: ViewMut<E>,
        inp: View<E>,
        weight: View<E>,
        bias: Option<View<E>>,
        n: usize,
        c: usize,
        oc: usize,
    ) -> BackendResult {
        shapes::matmul_forward(out.len(), inp.len(), weight.len(), bias.map(|b| b.len()), n, c, oc)?;
        let mut scratch = self.scratch(layers::matmul_forward_scratch::<E>(n, c, oc))?;
        let bias = bias.map(|b| b.host());
        layers::matmul_forward(out.host_mut(), inp.host(), weight.host(), bias, n, c, oc, scratch.as_mut_slice());
        Ok(())
    }

    fn matmul_backward<E: Elem>(
        &self,
        mut dinp: ViewMut<E>,
        mut dweight: ViewMut<E>,
        dbias: Option<ViewMut<E>>,
        dout: View<E>,
        inp: View<E>,
        weight: View<E>,
        n: usize,
        c: usize,
        oc: usize,
    ) -> BackendResult {
        shapes::matmul_backward(
            dinp.len(),
            dweight.len(),
            dbias.as_ref().map(|b| b.len()),
            dout.len(),
            inp.len(),
            weight.len(),
            n,
            c,
            oc,
        )?;
        let mut scratch = self.scratch(layers::matmul_backward_scratch::<E>(n, c, oc))?;
        let mut dbias = dbias;
        let db = dbias.as_mut().map(|b| b.host_mut());
        let dw = dweight.host_mut();
        layers::matmul_backward(
            dinp.host_mut(),
            dw,
            db,
            dout.host(),
            inp.host(),
            weight.host(),
            n,
            c,
            oc,
            scratch.as_mut_slice(),
        );
        Ok(())
    }

    fn attention_forward<E: Elem>(
        &self,
        mut out: ViewMut<E>,
        mut att: ViewMut<E>,
        qkv: View<E>,
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
    ) -> BackendResult {
        shapes::attention_forward(out.len(), att.len(), qkv.len(), b, t, c, nh)?;
        let mut scratch = self.scratch(layers::attention_forward_scratch(b, t, nh))?;
        layers::attention_forward(out.host_mut(), att.host_mut(), qkv.host(), scratch.as_mut_slice(), b, t, c, nh);
        Ok(())
    }

    fn attention_backward<E: Elem>(
        &self,
        mut dqkv: ViewMut<E>,
        dout: View<E>,
        qkv: View<E>,
        att: View<E>,
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
    ) -> BackendResult {
        shapes::attention_backward(dqkv.len(), dout.len(), qkv.len(), att.len(), b, t, c, nh)?;
        let mut scratch = self.scratch(layers::attention_backward_scratch::<E>(b, t, c, nh))?;
        layers::attention_backward(
            dqkv.host_mut(),
            scratch.as_mut_slice(),
            dout.host(),
            qkv.host(),
            att.host(),
            b,
            t,
            c,
            nh,
        );
        Ok(())
    }

    fn gelu_forward<E: Elem>(&self, mut out: ViewMut<E>, inp: View<E>) -> BackendResult {
        shapes::same("gelu_forward", "out", out.len(), inp.len())?;
        layers::gelu_forward(out.host_mut(), inp.host());
        Ok(())
    }

    fn gelu_backward_inplace<E: Elem>(&self, mut dinout: ViewMut<E>, inp: View<E>) -> BackendResult {
        shapes::same("gelu_backward", "dinout", dinout.len(), inp.len())?;
        layers::gelu_backward_inplace(dinout.host_mut(), inp.host());
        Ok(())
    }

    fn residual_forward_inplace<E: Elem>(&self, mut out: ViewMut<E>, inp: View<E>) -> BackendResult {
        shapes::same("residual_forward", "out", out.len(), inp.len())?;
        layers::residual_forward_inplace(out.host_mut(), inp.host());
        Ok(())
    }

    fn crossentropy_forward<E: Elem>(
        &self,
        mut logits: ViewMut<E>,
        mut losses: ViewMut<f32>,
        targets: View<u32>,
        v: usize,
    ) -> BackendResult {
        shapes::crossentropy_forward(logits.len(), losses.len(), targets, v)?;
        layers::crossentropy_forward(logits.host_mut(), losses.host_mut(), targets.host(), v);
        Ok(())
    }

    fn crossentropy_backward_inplace<E: Elem>(
        &self,
        mut probs: ViewMut<E>,
        targets: View<u32>,
        dloss: f32,
        v: usize,
    ) -> BackendResult {
        shapes::crossentropy_backward(probs.len(), targets, v)?;
        layers::crossentropy_backward_inplace(probs.host_mut(), targets.host(), dloss, v);
        Ok(())
    }

    fn adamw<E: Elem>(
        &self,
        mut master: ViewMut<f32>,
        params: Option<ViewMut<E>>,
        grads: View<E>,
        mut m: ViewMut<f32>,
        mut v: ViewMut<f32>,
        step: &AdamW,
        decay: bool,
        grad_mult: f32,
    ) -> BackendResult {
        let n = master.len();
        shapes::adamw::<E>(n, params.as_ref().map(|p| p.len()), grads.len(), m.len(), v.len())?;
        let tensor = [TensorInfo { name: "tensor".into(), offset: 0, len: n, decay }];
        step.update(&tensor, master.host_mut(), grads.host(), grad_mult, m.host_mut(), v.host_mut());
        if let Some(mut p) = params {
            layers::narrow(p.host_mut(), master.as_view().host());
        }
        Ok(())
    }

    fn sum_squares<E: Elem>(&self, x: View<E>) -> BackendResult<f64> {
        Ok(optim::sum_squares(x.host()))
    }

    fn narrow<E: Elem>(&self, mut dst: ViewMut<E>, src: View<f32>) -> BackendResult {
        shapes::same("narrow", "dst", dst.len(), src.len())?;
        layers::narrow(dst.host_mut(), src.host());
        Ok(())
    }

    fn widen<E: Elem>(&self, mut dst: ViewMut<f32>, src: View<E>) -> BackendResult {
        shapes::same("widen", "dst", dst.len(), src.len())?;
        layers::widen(dst.host_mut(), src.host());
        Ok(())
    }

    fn pack_int8<E: Elem>(&self, mut q: ViewMut<i8>, mut scales: ViewMut<f32>, x: View<E>, c: usize) -> BackendResult {
        shapes::int8("pack_int8", x.len(), q.len(), scales.len(), c)?;
        layers::pack_int8(q.host_mut(), scales.host_mut(), x.host(), c);
        Ok(())
    }

    fn unpack_int8<E: Elem>(&self, mut x: ViewMut<E>, q: View<i8>, scales: View<f32>, c: usize) -> BackendResult {
        shapes::int8("unpack_int8", x.len(), q.len(), scales.len(), c)?;
        layers::unpack_int8(x.host_mut(), q.host(), scales.host(), c);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    #[test]
    fn bad_shapes_and_token_ids_are_errors_naming_the_op() {
        let be = CpuBackend::new(Pool::new("cpu", 16 * MIB));
        let pool = be.pool().clone();
        let mut out = pool.alloc(4 * 8 * 4, Category::Activations).unwrap();
        let inp = pool.alloc(4 * 6 * 4, Category::Activations).unwrap();
        let w = pool.alloc(8 * 6 * 4, Category::Params).unwrap();
        let err =
            be.matmul_forward::<f32>(ViewMut::of(&mut out), View::of(&inp), View::of(&w), None, 4, 6, 7).unwrap_err();
        assert_eq!(err.to_string(), "matmul_forward: out (N,OC): 32 elements, expected 28");

        let mut ids = pool.alloc(2 * 4, Category::Activations).unwrap();
        ids.as_mut_slice::<u32>().copy_from_slice(&[1, 9]);
        let mut logits = pool.alloc(2 * 5 * 4, Category::Activations).unwrap();
        let mut losses = pool.alloc(2 * 4, Category::Activations).unwrap();
        let err = be
            .crossentropy_forward::<f32>(ViewMut::of(&mut logits), ViewMut::of(&mut losses), View::of(&ids), 5)
            .unwrap_err();
        assert_eq!(err.to_string(), "crossentropy_forward: token id 9 is not below the vocabulary size 5");
    }

    #[test]
    fn scratch_that_does_not_fit_is_an_oom_value() {
        // bf16 matmul widens its operands into f32 scratch from the same pool.
        let pool = Pool::new("cpu", 3 * MIB);
        let be = CpuBackend::new(pool.clone());
        let (n, c, oc) = (64, 256, 1024);
        let mut out = pool.alloc(n * oc * 2, Category::Activations).unwrap();
        let inp = pool.alloc(n * c * 2, Category::Activations).unwrap();
        let w = pool.alloc(oc * c * 2, Category::Params).unwrap();
        let err = be
            .matmul_forward::<half::bf16>(ViewMut::of(&mut out), View::of(&inp), View::of(&w), None, n, c, oc)
            .unwrap_err();
        assert!(matches!(err, BackendError::Oom(ref e) if e.category == Category::Workspace), "{err}");
    }
}
