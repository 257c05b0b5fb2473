//! Each op's scratch on a backend, measured by its pool against the backend's declaration
//! (`backend::workspace`): the figure the estimator sums is the figure the op allocates. Run by
//! the tests on the cpu backend and by `headroom gpu-check` on cuda.

use crate::engine::backend::layers::Elem;
use crate::engine::backend::workspace::WorkspaceModel;
use crate::engine::backend::{Backend, BackendResult, View, ViewMut};
use crate::memory::{blocks_bytes, format_bytes, Buffer, Category};

use super::parity::ParityShape;

/// One op at one storage type: the peak of its workspace in the pool, and what it declares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkspaceRow {
    pub op: &'static str,
    pub dtype: &'static str,
    pub shape: String,
    /// The declaration's buffers, rounded as the pool rounds them.
    pub declared: usize,
    /// The pool's workspace peak during the op, above what was live before it.
    pub measured: usize,
}

impl WorkspaceRow {
    pub fn passed(&self) -> bool {
        self.declared == self.measured
    }
}

/// Every op that declares scratch, at fp32 and bf16, on `shape`.
pub fn run<B: Backend>(backend: &B, model: WorkspaceModel, shape: ParityShape) -> BackendResult<Vec<WorkspaceRow>> {
    let mut rows = ops::<f32, B>(backend, model, shape)?;
    rows.extend(ops::<half::bf16, B>(backend, model, shape)?);
    Ok(rows)
}

/// A zeroed tensor of `n` elements (activations, so the op's workspace stands apart).
fn tensor<T: bytemuck::Pod, B: Backend>(backend: &B, n: usize) -> BackendResult<Buffer> {
    let mut buffer = backend.pool().alloc(n * std::mem::size_of::<T>(), Category::Activations)?;
    backend.upload(ViewMut::of(&mut buffer), &vec![T::zeroed(); n])?;
    Ok(buffer)
}

/// The pool's workspace peak while `op` runs, above the workspace live before it.
fn measure<B: Backend>(backend: &B, op: impl FnOnce() -> BackendResult) -> BackendResult<usize> {
    backend.synchronize()?;
    let pool = backend.pool();
    let before = pool.stats().current(Category::Workspace);
    pool.reset_window_peaks();
    op()?;
    backend.synchronize()?;
    Ok(pool.stats().window_peak(Category::Workspace) - before)
}

fn ops<E: Elem, B: Backend>(be: &B, model: WorkspaceModel, s: ParityShape) -> BackendResult<Vec<WorkspaceRow>> {
    let ParityShape { b, t, c, nh, .. } = s;
    let (n, oc) = (b * t, 3 * c);
    let shape = format!("B{b} T{t} C{c} NH{nh}");
    let row = |op, declared: Vec<usize>, measured| WorkspaceRow {
        op,
        dtype: E::NAME,
        shape: shape.clone(),
        declared: blocks_bytes(&declared),
        measured,
    };
    let mut rows = Vec::new();

    // matmul: out (N,OC) = inp (N,C) · weight (OC,C)ᵀ + bias; and its backward.
    let (inp, weight, bias) = (tensor::<E, B>(be, n * c)?, tensor::<E, B>(be, oc * c)?, tensor::<E, B>(be, oc)?);
    let (mut out, mut dinp, mut dweight, mut dbias) =
        (tensor::<E, B>(be, n * oc)?, tensor::<E, B>(be, n * c)?, tensor::<E, B>(be, oc * c)?, tensor::<E, B>(be, oc)?);
    let measured = measure(be, || {
        be.matmul_forward::<E>(
            ViewMut::of(&mut out),
            View::of(&inp),
            View::of(&weight),
            Some(View::of(&bias)),
            n,
            c,
            oc,
        )
    })?;
    rows.push(row("matmul_forward", model.matmul_forward::<E>(n, c, oc), measured));
    let measured = measure(be, || {
        be.matmul_backward::<E>(
            ViewMut::of(&mut dinp),
            ViewMut::of(&mut dweight),
            Some(ViewMut::of(&mut dbias)),
            View::of(&out),
            View::of(&inp),
            View::of(&weight),
            n,
            c,
            oc,
        )
    })?;
    rows.push(row("matmul_backward", model.matmul_backward::<E>(n, c, oc, true), measured));

    // layernorm backward over (N,C): its parameter gradients' column sums.
    let (lweight, mut lw, mut lb) = (tensor::<E, B>(be, c)?, tensor::<E, B>(be, c)?, tensor::<E, B>(be, c)?);
    let (lmean, mut lrstd) = (tensor::<f32, B>(be, n)?, tensor::<f32, B>(be, n)?);
    be.upload(ViewMut::of(&mut lrstd), &vec![1.0f32; n])?;
    let measured = measure(be, || {
        be.layernorm_backward::<E>(
            ViewMut::of(&mut dinp),
            ViewMut::of(&mut lw),
            ViewMut::of(&mut lb),
            View::of(&inp),
            View::of(&inp),
            View::of(&lweight),
            View::of(&lmean),
            View::of(&lrstd),
            c,
        )
    })?;
    rows.push(row("layernorm_backward", model.layernorm_backward(n, c), measured));
    drop((lweight, lw, lb, lmean, lrstd));

    // attention: qkv (B,T,3C) -> out (B,T,C), lse (B,NH,T) f32; and its backward.
    let qkv = tensor::<E, B>(be, b * t * 3 * c)?;
    let (mut y, mut lse, mut dqkv) =
        (tensor::<E, B>(be, b * t * c)?, tensor::<f32, B>(be, b * nh * t)?, tensor::<E, B>(be, b * t * 3 * c)?);
    let measured = measure(be, || {
        be.attention_forward::<E>(ViewMut::of(&mut y), ViewMut::of(&mut lse), View::of(&qkv), b, t, c, nh)
    })?;
    rows.push(row("attention_forward", model.attention_forward::<E>(b, t, c, nh), measured));
    let measured = measure(be, || {
        be.attention_backward::<E>(ViewMut::of(&mut dqkv), View::of(&y), View::of(&qkv), View::of(&lse), b, t, c, nh)
    })?;
    rows.push(row("attention_backward", model.attention_backward::<E>(b, t, c, nh), measured));

    // The squared norm of the matmul's weight gradient.
    let measured = measure(be, || be.sum_squares::<E>(View::of(&dweight)).map(|_| ()))?;
    rows.push(row("sum_squares", model.sum_squares::<E>(oc * c), measured));

    // The embedding's backward over (B,T) tokens (all token 0: one run of B·T positions).
    let ParityShape { v, .. } = s;
    let (tokens, mut dwte, mut dwpe) =
        (tensor::<u32, B>(be, n)?, tensor::<E, B>(be, v * c)?, tensor::<E, B>(be, t * c)?);
    let measured = measure(be, || {
        be.encoder_backward::<E>(
            ViewMut::of(&mut dwte),
            ViewMut::of(&mut dwpe),
            View::of(&dinp),
            View::of(&tokens),
            t,
            c,
        )
    })?;
    rows.push(row("encoder_backward", model.encoder_backward(n), measured));
    Ok(rows)
}

/// The rows as a table: declared and measured bytes side by side.
pub fn table(rows: &[WorkspaceRow]) -> String {
    let mut s =
        format!("{:<20} {:<5} {:<22} {:>12} {:>12}\n", "op (workspace)", "dtype", "shape", "declared", "measured");
    for r in rows {
        s += &format!(
            "{:<20} {:<5} {:<22} {:>12} {:>12}{}\n",
            r.op,
            r.dtype,
            r.shape,
            format_bytes(r.declared),
            format_bytes(r.measured),
            if r.passed() { "" } else { "  MISMATCH" }
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::backend::CpuBackend;
    use crate::engine::check::device_sim::DeviceSim;
    use crate::memory::Pool;

    /// The cpu backend allocates exactly what it declares, for every op with scratch, on an odd
    /// shape and a GPT-2-width one, directly and behind the simulated device.
    #[test]
    fn every_op_allocates_exactly_its_declared_workspace() {
        let cpu = CpuBackend::new(Pool::new("cpu", 1 << 30));
        let sim = DeviceSim::new(1 << 30);
        let small = ParityShape { b: 2, t: 64, c: 768, nh: 12, v: 256 };
        for shape in [ParityShape::ODD, small] {
            for rows in [run(&cpu, WorkspaceModel::Cpu, shape).unwrap(), run(&sim, WorkspaceModel::Cpu, shape).unwrap()]
            {
                assert_eq!(rows.len(), 14, "7 ops × 2 dtypes");
                for r in &rows {
                    assert!(r.passed(), "{}", table(&rows));
                }
                assert!(rows.iter().any(|r| r.measured > 0), "the check sees scratch at all");
            }
        }
        // A wrong declaration is caught: the cuda model's attention is not what the cpu allocates.
        let wrong = run(&cpu, WorkspaceModel::CUDA, ParityShape::ODD).unwrap();
        assert!(wrong.iter().any(|r| !r.passed()), "{}", table(&wrong));
    }
}
