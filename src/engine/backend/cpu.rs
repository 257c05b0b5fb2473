//! `CpuBackend`: the reference backend, `layers.rs` on host buffers of its pool.

use bytemuck::Pod;
use rayon::prelude::*;

use crate::memory::{Buffer, Category, Pool};

use super::layers::{self, Elem};
use super::{shapes, Backend, BackendResult, View, ViewMut};
use crate::engine::backend::optim::{self, AdamW};

/// The CPU reference: `layers.rs` on host buffers of its pool; scratch comes from the same pool
/// as workspace.
#[derive(Debug, Clone)]
pub struct CpuBackend {
    pool: Pool,
}

/// Bytes per task of the parallel copies and fills (small ones stay on one thread).
const PAR_COPY: usize = 4 << 20;

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
        // In parallel: a first touch of fresh pool pages is page faults, which cores share.
        let (d, s): (&mut [u8], &[u8]) = (bytemuck::cast_slice_mut(dst.host_mut()), bytemuck::cast_slice(src));
        d.par_chunks_mut(PAR_COPY).zip(s.par_chunks(PAR_COPY)).for_each(|(d, s)| d.copy_from_slice(s));
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

    unsafe fn download_ahead<T: Pod>(&self, src: View<T>, dst: &mut [T]) -> BackendResult {
        self.download(src, dst)
    }

    fn wait_host(&self, _fence: ()) -> BackendResult {
        Ok(())
    }

    fn copy<T: Pod>(&self, mut dst: ViewMut<T>, src: View<T>) -> BackendResult {
        shapes::same("copy", "destination", dst.len(), src.len())?;
        let (d, s): (&mut [u8], &[u8]) = (bytemuck::cast_slice_mut(dst.host_mut()), bytemuck::cast_slice(src.host()));
        d.par_chunks_mut(PAR_COPY).zip(s.par_chunks(PAR_COPY)).for_each(|(d, s)| d.copy_from_slice(s));
        Ok(())
    }

    fn zero<T: Pod>(&self, mut dst: ViewMut<T>) -> BackendResult {
        // All-zero bytes are T's zero (Pod).
        let d: &mut [u8] = bytemuck::cast_slice_mut(dst.host_mut());
        d.par_chunks_mut(PAR_COPY).for_each(|d| d.fill(0));
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
        mut lse: ViewMut<f32>,
        qkv: View<E>,
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
    ) -> BackendResult {
        shapes::attention_forward(out.len(), lse.len(), qkv.len(), b, t, c, nh)?;
        let mut scratch = self.scratch(layers::attention_forward_scratch::<E>(b, t, c, nh))?;
        layers::attention_forward(out.host_mut(), lse.host_mut(), qkv.host(), scratch.as_mut_slice(), b, t, c, nh);
        Ok(())
    }

    fn attention_cached<E: Elem>(
        &self,
        mut out: ViewMut<E>,
        mut cache: ViewMut<E>,
        qkv: View<E>,
        dims: shapes::CachedAttention,
    ) -> BackendResult {
        shapes::attention_cached(out.len(), cache.len(), qkv.len(), dims)?;
        let mut scratch = self.scratch(layers::attention_cached_scratch(dims.b, dims.context, dims.nh))?;
        layers::attention_cached(out.host_mut(), cache.host_mut(), qkv.host(), scratch.as_mut_slice(), dims);
        Ok(())
    }

    fn attention_backward<E: Elem>(
        &self,
        mut dqkv: ViewMut<E>,
        dout: View<E>,
        qkv: View<E>,
        lse: View<f32>,
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
    ) -> BackendResult {
        shapes::attention_backward(dqkv.len(), dout.len(), qkv.len(), lse.len(), b, t, c, nh)?;
        let mut scratch = self.scratch(layers::attention_backward_scratch::<E>(b, t, c, nh))?;
        layers::attention_backward(
            dqkv.host_mut(),
            scratch.as_mut_slice(),
            dout.host(),
            qkv.host(),
            lse.host(),
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
        vp: usize,
    ) -> BackendResult {
        shapes::crossentropy("crossentropy_forward", logits.len(), losses.len(), targets, v, vp)?;
        layers::crossentropy_forward(logits.host_mut(), losses.host_mut(), targets.host(), v, vp);
        Ok(())
    }

    fn crossentropy_forward_backward<E: Elem>(
        &self,
        mut logits: ViewMut<E>,
        mut losses: ViewMut<f32>,
        targets: View<u32>,
        dloss: f32,
        v: usize,
        vp: usize,
    ) -> BackendResult {
        shapes::crossentropy("crossentropy_forward_backward", logits.len(), losses.len(), targets, v, vp)?;
        layers::crossentropy_forward_backward(logits.host_mut(), losses.host_mut(), targets.host(), dloss, v, vp);
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
        step.update([(0..n, decay)], master.host_mut(), grads.host(), grad_mult, m.host_mut(), v.host_mut());
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

    fn unpack_int4<E: Elem>(
        &self,
        mut x: ViewMut<E>,
        packed: View<u8>,
        scales: View<f32>,
        group: usize,
    ) -> BackendResult {
        shapes::int4("unpack_int4", x.len(), packed.len(), scales.len(), group)?;
        layers::unpack_int4(x.host_mut(), packed.host(), scales.host(), group);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::backend::BackendError;

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
            .crossentropy_forward::<f32>(ViewMut::of(&mut logits), ViewMut::of(&mut losses), View::of(&ids), 5, 5)
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
