//! Verification and measurement: op parity and training parity of a backend against the CPU
//! reference, finite-difference gradient checks, each op's scratch against its declaration,
//! `DeviceSim` (the device path on CPU), the CUDA kernels run on the host emulator, the ranks
//! tests and the `headroom bench` harness. None of it is on the training path.

/// Writes the compute ops of a `Backend` that wraps another: each forwards to `self.$to`, every
/// view argument (and optional one) passed through `$map` (`Expose::exposed`, or
/// `std::convert::identity`). The op signatures are written here once for every such wrapper
/// (`DeviceSim`, the fault-injecting test backend, `Profiled`); list the ops to forward, write
/// the rest. With `via $wrap`, each call is `$wrap!(self, "op", [views...], call)` instead of
/// the bare call (the profiler times it and counts the views' bytes).
macro_rules! delegate_ops {
    ($to:tt, $m:path; $($op:ident),* $(,)?) => { $( delegate_ops!(@op $to, $m, plain_call, $op); )* };
    ($to:tt, $m:path, via $wrap:ident; $($op:ident),* $(,)?) => { $( delegate_ops!(@op $to, $m, $wrap, $op); )* };
    (@op $to:tt, $m:path, $wrap:ident, encoder_forward) => {
        fn encoder_forward<E: Elem>(&self, out: ViewMut<E>, inp: View<u32>, wte: View<E>, wpe: View<E>, t: usize, c: usize) -> BackendResult {
            $wrap!(self, "encoder_forward", [out, inp, wte, wpe], self.$to.encoder_forward($m(out), $m(inp), $m(wte), $m(wpe), t, c))
        }
    };
    (@op $to:tt, $m:path, $wrap:ident, encoder_backward) => {
        fn encoder_backward<E: Elem>(&self, dwte: ViewMut<E>, dwpe: ViewMut<E>, dout: View<E>, inp: View<u32>, t: usize, c: usize) -> BackendResult {
            $wrap!(self, "encoder_backward", [dwte, dwpe, dout, inp], self.$to.encoder_backward($m(dwte), $m(dwpe), $m(dout), $m(inp), t, c))
        }
    };
    (@op $to:tt, $m:path, $wrap:ident, layernorm_forward) => {
        fn layernorm_forward<E: Elem>(&self, out: ViewMut<E>, mean: ViewMut<f32>, rstd: ViewMut<f32>, inp: View<E>, weight: View<E>, bias: View<E>, c: usize) -> BackendResult {
            $wrap!(self, "layernorm_forward", [out, mean, rstd, inp, weight, bias], self.$to.layernorm_forward($m(out), $m(mean), $m(rstd), $m(inp), $m(weight), $m(bias), c))
        }
    };
    (@op $to:tt, $m:path, $wrap:ident, layernorm_recompute) => {
        fn layernorm_recompute<E: Elem>(&self, out: ViewMut<E>, inp: View<E>, weight: View<E>, bias: View<E>, mean: View<f32>, rstd: View<f32>, c: usize) -> BackendResult {
            $wrap!(self, "layernorm_recompute", [out, inp, weight, bias, mean, rstd], self.$to.layernorm_recompute($m(out), $m(inp), $m(weight), $m(bias), $m(mean), $m(rstd), c))
        }
    };
    (@op $to:tt, $m:path, $wrap:ident, layernorm_backward) => {
        fn layernorm_backward<E: Elem>(&self, dinp: ViewMut<E>, dweight: ViewMut<E>, dbias: ViewMut<E>, dout: View<E>, inp: View<E>, weight: View<E>, mean: View<f32>, rstd: View<f32>, c: usize) -> BackendResult {
            $wrap!(self, "layernorm_backward", [dinp, dweight, dbias, dout, inp, weight, mean, rstd], self.$to.layernorm_backward($m(dinp), $m(dweight), $m(dbias), $m(dout), $m(inp), $m(weight), $m(mean), $m(rstd), c))
        }
    };
    (@op $to:tt, $m:path, $wrap:ident, matmul_forward) => {
        fn matmul_forward<E: Elem>(&self, out: ViewMut<E>, inp: View<E>, weight: View<E>, bias: Option<View<E>>, n: usize, c: usize, oc: usize) -> BackendResult {
            $wrap!(self, "matmul_forward", [out, inp, weight, bias], self.$to.matmul_forward($m(out), $m(inp), $m(weight), bias.map($m), n, c, oc))
        }
    };
    (@op $to:tt, $m:path, $wrap:ident, matmul_backward) => {
        fn matmul_backward<E: Elem>(&self, dinp: ViewMut<E>, dweight: ViewMut<E>, dbias: Option<ViewMut<E>>, dout: View<E>, inp: View<E>, weight: View<E>, n: usize, c: usize, oc: usize) -> BackendResult {
            $wrap!(self, "matmul_backward", [dinp, dweight, dbias, dout, inp, weight], self.$to.matmul_backward($m(dinp), $m(dweight), dbias.map($m), $m(dout), $m(inp), $m(weight), n, c, oc))
        }
    };
    (@op $to:tt, $m:path, $wrap:ident, attention_forward) => {
        fn attention_forward<E: Elem>(&self, out: ViewMut<E>, lse: ViewMut<f32>, qkv: View<E>, b: usize, t: usize, c: usize, nh: usize) -> BackendResult {
            $wrap!(self, "attention_forward", [out, lse, qkv], self.$to.attention_forward($m(out), $m(lse), $m(qkv), b, t, c, nh))
        }
    };
    (@op $to:tt, $m:path, $wrap:ident, attention_backward) => {
        fn attention_backward<E: Elem>(&self, dqkv: ViewMut<E>, dout: View<E>, qkv: View<E>, lse: View<f32>, b: usize, t: usize, c: usize, nh: usize) -> BackendResult {
            $wrap!(self, "attention_backward", [dqkv, dout, qkv, lse], self.$to.attention_backward($m(dqkv), $m(dout), $m(qkv), $m(lse), b, t, c, nh))
        }
    };
    (@op $to:tt, $m:path, $wrap:ident, attention_cached) => {
        fn attention_cached<E: Elem>(&self, out: ViewMut<E>, cache: ViewMut<E>, qkv: View<E>, dims: crate::engine::backend::shapes::CachedAttention) -> BackendResult {
            $wrap!(self, "attention_cached", [out, cache, qkv], self.$to.attention_cached($m(out), $m(cache), $m(qkv), dims))
        }
    };
    (@op $to:tt, $m:path, $wrap:ident, gelu_forward) => {
        fn gelu_forward<E: Elem>(&self, out: ViewMut<E>, inp: View<E>) -> BackendResult {
            $wrap!(self, "gelu_forward", [out, inp], self.$to.gelu_forward($m(out), $m(inp)))
        }
    };
    (@op $to:tt, $m:path, $wrap:ident, gelu_backward_inplace) => {
        fn gelu_backward_inplace<E: Elem>(&self, dinout: ViewMut<E>, inp: View<E>) -> BackendResult {
            $wrap!(self, "gelu_backward_inplace", [dinout, inp], self.$to.gelu_backward_inplace($m(dinout), $m(inp)))
        }
    };
    (@op $to:tt, $m:path, $wrap:ident, residual_forward_inplace) => {
        fn residual_forward_inplace<E: Elem>(&self, out: ViewMut<E>, inp: View<E>) -> BackendResult {
            $wrap!(self, "residual_forward_inplace", [out, inp], self.$to.residual_forward_inplace($m(out), $m(inp)))
        }
    };
    (@op $to:tt, $m:path, $wrap:ident, crossentropy_forward) => {
        fn crossentropy_forward<E: Elem>(&self, logits: ViewMut<E>, losses: ViewMut<f32>, targets: View<u32>, v: usize, vp: usize) -> BackendResult {
            $wrap!(self, "crossentropy_forward", [logits, losses, targets], self.$to.crossentropy_forward($m(logits), $m(losses), $m(targets), v, vp))
        }
    };
    (@op $to:tt, $m:path, $wrap:ident, crossentropy_forward_backward) => {
        fn crossentropy_forward_backward<E: Elem>(&self, logits: ViewMut<E>, losses: ViewMut<f32>, targets: View<u32>, dloss: f32, v: usize, vp: usize) -> BackendResult {
            $wrap!(self, "crossentropy_forward_backward", [logits, losses, targets], self.$to.crossentropy_forward_backward($m(logits), $m(losses), $m(targets), dloss, v, vp))
        }
    };
    (@op $to:tt, $m:path, $wrap:ident, adamw) => {
        fn adamw<E: Elem>(&self, master: ViewMut<f32>, params: Option<ViewMut<E>>, grads: View<E>, m: ViewMut<f32>, v: ViewMut<f32>, step: &AdamW, decay: bool, grad_mult: f32) -> BackendResult {
            $wrap!(self, "adamw", [master, params, grads, m, v], self.$to.adamw($m(master), params.map($m), $m(grads), $m(m), $m(v), step, decay, grad_mult))
        }
    };
    (@op $to:tt, $m:path, $wrap:ident, sum_squares) => {
        fn sum_squares<E: Elem>(&self, x: View<E>) -> BackendResult<f64> {
            $wrap!(self, "sum_squares", [x], self.$to.sum_squares($m(x)))
        }
    };
    (@op $to:tt, $m:path, $wrap:ident, narrow) => {
        fn narrow<E: Elem>(&self, dst: ViewMut<E>, src: View<f32>) -> BackendResult {
            $wrap!(self, "narrow", [dst, src], self.$to.narrow($m(dst), $m(src)))
        }
    };
    (@op $to:tt, $m:path, $wrap:ident, widen) => {
        fn widen<E: Elem>(&self, dst: ViewMut<f32>, src: View<E>) -> BackendResult {
            $wrap!(self, "widen", [dst, src], self.$to.widen($m(dst), $m(src)))
        }
    };
    (@op $to:tt, $m:path, $wrap:ident, pack_int8) => {
        fn pack_int8<E: Elem>(&self, q: ViewMut<i8>, scales: ViewMut<f32>, x: View<E>, c: usize) -> BackendResult {
            $wrap!(self, "pack_int8", [q, scales, x], self.$to.pack_int8($m(q), $m(scales), $m(x), c))
        }
    };
    (@op $to:tt, $m:path, $wrap:ident, unpack_int8) => {
        fn unpack_int8<E: Elem>(&self, x: ViewMut<E>, q: View<i8>, scales: View<f32>, c: usize) -> BackendResult {
            $wrap!(self, "unpack_int8", [x, q, scales], self.$to.unpack_int8($m(x), $m(q), $m(scales), c))
        }
    };
    (@op $to:tt, $m:path, $wrap:ident, unpack_int4) => {
        fn unpack_int4<E: Elem>(&self, x: ViewMut<E>, packed: View<u8>, scales: View<f32>, group: usize) -> BackendResult {
            $wrap!(self, "unpack_int4", [x, packed, scales], self.$to.unpack_int4($m(x), $m(packed), $m(scales), group))
        }
    };
}

/// `delegate_ops!`'s default: the call itself (the test backends' wrappers use it).
#[cfg(test)]
macro_rules! plain_call {
    ($s:tt, $op:literal, [$($v:expr),*], $call:expr) => {
        $call
    };
}

pub mod bench;
#[cfg(test)]
pub(crate) mod device_sim;
#[cfg(all(test, feature = "cuda"))]
mod emulated_kernels;
pub mod estimate_check;
#[cfg(test)]
mod gradcheck;
pub mod parity;
pub mod profile;
#[cfg(test)]
mod ranks_tests;
pub mod train_parity;
pub mod workspace_check;
