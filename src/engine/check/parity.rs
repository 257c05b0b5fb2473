//! Op-by-op parity of a candidate `Backend` against the CPU reference: fresh random inputs,
//! outputs poisoned with NaN (int8: -128, a value the packer never writes) before every op so an
//! element the candidate skips is caught, and a relative-error threshold per storage type.
//! `headroom gpu-check` runs it for `CudaBackend`; the tests run it on CPU backends.

use std::fmt::Write as _;

use bytemuck::Pod;
use half::bf16;

use crate::memory::{Buffer, Category};

use crate::engine::backend::layers::Elem;
use crate::engine::backend::optim::AdamW;
use crate::engine::backend::{Backend, BackendResult, View, ViewMut};
use crate::engine::rng::Rng;

/// Tensor sizes of one parity run (llm.c letters).
#[derive(Debug, Clone, Copy)]
pub struct ParityShape {
    pub b: usize,
    pub t: usize,
    pub c: usize,
    pub nh: usize,
    pub v: usize,
}

impl ParityShape {
    /// Small and deliberately odd (nothing a multiple of a block size).
    pub const ODD: ParityShape = ParityShape { b: 3, t: 37, c: 96, nh: 3, v: 1003 };
    /// GPT-2 124M's widths at a shorter sequence.
    pub const GPT2: ParityShape = ParityShape { b: 4, t: 256, c: 768, nh: 12, v: 50257 };
}

/// One op at one storage type: the worst output's relative error against the reference.
#[derive(Debug, Clone)]
pub struct ParityRow {
    pub op: &'static str,
    pub dtype: &'static str,
    pub shape: String,
    /// The output with the largest error.
    pub worst: &'static str,
    /// max |candidate − reference| / max |reference| (∞ when the candidate left NaN).
    pub rel_err: f64,
    pub threshold: f64,
    pub error: Option<String>,
    /// Wall time of the op on the reference and on the candidate (synchronised), milliseconds.
    pub reference_ms: f64,
    pub candidate_ms: f64,
}

impl ParityRow {
    pub fn passed(&self) -> bool {
        self.error.is_none() && self.rel_err <= self.threshold
    }
}

/// Relative-error bound per storage type: fp32 allows reassociation; bf16 a couple of ulps
/// (2⁻⁸ each) from rounding at different points.
pub fn threshold<E: Elem>() -> f64 {
    if E::is_f32() {
        1e-4
    } else {
        2e-2
    }
}

fn rel_err(reference: &[f32], candidate: &[f32]) -> f64 {
    let scale = reference.iter().fold(0f64, |m, &x| m.max((x as f64).abs())).max(1e-30);
    let mut worst = 0f64;
    for (&r, &c) in reference.iter().zip(candidate) {
        if !c.is_finite() && r.is_finite() {
            return f64::INFINITY;
        }
        worst = worst.max((r as f64 - c as f64).abs());
    }
    worst / scale
}

/// Both sides of one tensor: (reference buffer, candidate buffer).
struct Pair {
    r: Buffer,
    c: Buffer,
}

struct Harness<'a, R: Backend, C: Backend> {
    r: &'a R,
    c: &'a C,
    rng: Rng,
    rows: Vec<ParityRow>,
    shape: String,
    reference_ms: f64,
    candidate_ms: f64,
}

impl<R: Backend, C: Backend> Harness<'_, R, C> {
    fn pair<T: Pod>(&self, data: &[T]) -> BackendResult<Pair> {
        let bytes = std::mem::size_of_val(data);
        let mut r = self.r.pool().alloc(bytes, Category::Workspace)?;
        let mut c = self.c.pool().alloc(bytes, Category::Workspace)?;
        self.r.upload(ViewMut::of(&mut r), data)?;
        self.c.upload(ViewMut::of(&mut c), data)?;
        Ok(Pair { r, c })
    }

    fn randn(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.rng.normal() as f32 * scale).collect()
    }

    fn input<E: Elem>(&mut self, n: usize, scale: f32) -> BackendResult<Pair> {
        let v: Vec<E> = self.randn(n, scale).into_iter().map(E::from_f32).collect();
        self.pair(&v)
    }

    fn ids(&mut self, n: usize, below: usize) -> BackendResult<Pair> {
        let v: Vec<u32> = (0..n).map(|_| (self.rng.next_u64() % below as u64) as u32).collect();
        self.pair(&v)
    }

    /// An output both sides start from NaN.
    fn poisoned<E: Elem>(&self, n: usize) -> BackendResult<Pair> {
        self.pair(&vec![E::from_f32(f32::NAN); n])
    }

    /// A reference output copied to the candidate side (the next op's input).
    fn shared<T: Pod>(&self, p: &Pair) -> BackendResult<Pair> {
        let mut host = vec![T::zeroed(); p.r.len() / std::mem::size_of::<T>()];
        self.r.download(View::of(&p.r), &mut host)?;
        self.pair(&host)
    }

    fn fetch<E: Elem, B: Backend>(be: &B, buf: &Buffer) -> BackendResult<Vec<f32>> {
        let mut host = vec![E::default(); buf.len() / E::BYTES];
        be.download(View::of(buf), &mut host)?;
        Ok(host.into_iter().map(E::to_f32).collect())
    }

    fn err<E: Elem>(&self, p: &Pair) -> BackendResult<f64> {
        self.c.synchronize()?;
        Ok(rel_err(&Self::fetch::<E, R>(self.r, &p.r)?, &Self::fetch::<E, C>(self.c, &p.c)?))
    }

    /// Record an op: `outputs` are compared after `run` ran on both sides.
    fn record<E: Elem>(
        &mut self,
        op: &'static str,
        run: impl FnOnce(&mut Self) -> BackendResult<Vec<(&'static str, f64)>>,
    ) {
        // Each row times its own op.
        (self.reference_ms, self.candidate_ms) = (0.0, 0.0);
        let (worst, rel_err, error) = match run(self) {
            Ok(errs) => {
                let (w, e) = errs
                    .into_iter()
                    .fold(("-", 0f64), |acc, (n, e)| if e > acc.1 || e.is_nan() { (n, e) } else { acc });
                (w, e, None)
            }
            Err(e) => ("-", f64::NAN, Some(e.to_string())),
        };
        let shape = self.shape.clone();
        let (reference_ms, candidate_ms) = (self.reference_ms, self.candidate_ms);
        self.rows.push(ParityRow {
            op,
            dtype: E::NAME,
            shape,
            worst,
            rel_err,
            threshold: threshold::<E>(),
            error,
            reference_ms,
            candidate_ms,
        });
    }
}

/// Every op at fp32 and bf16 on one shape.
pub fn run<R: Backend, C: Backend>(reference: &R, candidate: &C, shape: ParityShape, seed: u64) -> Vec<ParityRow> {
    let ParityShape { b, t, c, nh, v } = shape;
    let mut h = Harness {
        r: reference,
        c: candidate,
        rng: Rng::new(seed),
        rows: Vec::new(),
        shape: format!("B{b} T{t} C{c} NH{nh} V{v}"),
        reference_ms: 0.0,
        candidate_ms: 0.0,
    };
    ops::<f32, R, C>(&mut h, shape);
    ops::<bf16, R, C>(&mut h, shape);
    ops::<half::f16, R, C>(&mut h, shape);
    h.rows
}

macro_rules! both {
    // Argument rewriting, one token tree at a time: `&mut x` -> ViewMut of x's side, `&x` -> View
    // of it, anything else as it is; the last arm makes the call.
    (@call $be:expr, $op:ident, $e:ty, $s:ident; [$($done:expr,)*]) => { $be.$op::<$e>($($done),*) };
    (@call $be:expr, $op:ident, $e:ty, $s:ident; [$($done:expr,)*] &mut $x:ident $(, $($rest:tt)*)?) => {
        both!(@call $be, $op, $e, $s; [$($done,)* ViewMut::of(&mut $x.$s),] $($($rest)*)?)
    };
    (@call $be:expr, $op:ident, $e:ty, $s:ident; [$($done:expr,)*] &$x:ident $(, $($rest:tt)*)?) => {
        both!(@call $be, $op, $e, $s; [$($done,)* View::of(&$x.$s),] $($($rest)*)?)
    };
    (@call $be:expr, $op:ident, $e:ty, $s:ident; [$($done:expr,)*] $x:expr $(, $($rest:tt)*)?) => {
        both!(@call $be, $op, $e, $s; [$($done,)* $x,] $($($rest)*)?)
    };
    // Run one op on the reference (side `r`) and the candidate (side `c`) with the same arguments.
    ($h:ident, $op:ident::<$e:ty>($($arg:tt)*)) => {{
        let r = timed(&mut $h.reference_ms, || both!(@call $h.r, $op, $e, r; [] $($arg)*))?;
        $h.c.synchronize()?;
        let c = timed(&mut $h.candidate_ms, || {
            let out = both!(@call $h.c, $op, $e, c; [] $($arg)*)?;
            $h.c.synchronize()?;
            Ok(out)
        })?;
        (r, c)
    }};
}

/// Run `f`, adding its wall time to `ms`.
fn timed<T>(ms: &mut f64, f: impl FnOnce() -> BackendResult<T>) -> BackendResult<T> {
    let t0 = std::time::Instant::now();
    let out = f();
    *ms += t0.elapsed().as_secs_f64() * 1e3;
    out
}

fn ops<E: Elem, R: Backend, C: Backend>(h: &mut Harness<'_, R, C>, s: ParityShape) {
    let ParityShape { b, t, c, nh, v } = s;
    let n = b * t;
    h.record::<E>("encoder_forward", |h| {
        let (inp, wte, wpe, mut out) =
            (h.ids(n, v)?, h.input::<E>(v * c, 0.1)?, h.input::<E>(t * c, 0.1)?, h.poisoned::<E>(n * c)?);
        both!(h, encoder_forward::<E>(&mut out, &inp, &wte, &wpe, t, c));
        Ok(vec![("out", h.err::<E>(&out)?)])
    });
    h.record::<E>("encoder_backward", |h| {
        let (inp, dout) = (h.ids(n, v)?, h.input::<E>(n * c, 1.0)?);
        let (mut dwte, mut dwpe) = (h.input::<E>(v * c, 1.0)?, h.input::<E>(t * c, 1.0)?);
        both!(h, encoder_backward::<E>(&mut dwte, &mut dwpe, &dout, &inp, t, c));
        Ok(vec![("dwte", h.err::<E>(&dwte)?), ("dwpe", h.err::<E>(&dwpe)?)])
    });
    h.record::<E>("layernorm_forward", |h| {
        let (inp, w, bias) = (h.input::<E>(n * c, 2.0)?, h.input::<E>(c, 1.0)?, h.input::<E>(c, 1.0)?);
        let (mut out, mut mean, mut rstd) = (h.poisoned::<E>(n * c)?, h.poisoned::<f32>(n)?, h.poisoned::<f32>(n)?);
        both!(h, layernorm_forward::<E>(&mut out, &mut mean, &mut rstd, &inp, &w, &bias, c));
        Ok(vec![("out", h.err::<E>(&out)?), ("mean", h.err::<f32>(&mean)?), ("rstd", h.err::<f32>(&rstd)?)])
    });
    h.record::<E>("layernorm_recompute", |h| {
        let (inp, w, bias) = (h.input::<E>(n * c, 2.0)?, h.input::<E>(c, 1.0)?, h.input::<E>(c, 1.0)?);
        let (mean, rstd) = (h.input::<f32>(n, 0.5)?, h.pair(&vec![1.3f32; n])?);
        let mut out = h.poisoned::<E>(n * c)?;
        both!(h, layernorm_recompute::<E>(&mut out, &inp, &w, &bias, &mean, &rstd, c));
        Ok(vec![("out", h.err::<E>(&out)?)])
    });
    h.record::<E>("layernorm_backward", |h| {
        let (inp, w, bias, dout) =
            (h.input::<E>(n * c, 2.0)?, h.input::<E>(c, 1.0)?, h.input::<E>(c, 1.0)?, h.input::<E>(n * c, 1.0)?);
        let (mut out, mut mean, mut rstd) = (h.poisoned::<E>(n * c)?, h.poisoned::<f32>(n)?, h.poisoned::<f32>(n)?);
        h.r.layernorm_forward::<E>(
            ViewMut::of(&mut out.r),
            ViewMut::of(&mut mean.r),
            ViewMut::of(&mut rstd.r),
            View::of(&inp.r),
            View::of(&w.r),
            View::of(&bias.r),
            c,
        )?;
        let (mean, rstd) = (h.shared::<f32>(&mean)?, h.shared::<f32>(&rstd)?);
        let (mut dinp, mut dw, mut db) = (h.input::<E>(n * c, 1.0)?, h.input::<E>(c, 1.0)?, h.input::<E>(c, 1.0)?);
        both!(h, layernorm_backward::<E>(&mut dinp, &mut dw, &mut db, &dout, &inp, &w, &mean, &rstd, c));
        Ok(vec![("dinp", h.err::<E>(&dinp)?), ("dweight", h.err::<E>(&dw)?), ("dbias", h.err::<E>(&db)?)])
    });
    for (op, with_bias) in [("matmul_forward", true), ("matmul_forward (no bias)", false)] {
        h.record::<E>(op, |h| {
            let oc = 3 * c;
            let (inp, w, bias, mut out) = (
                h.input::<E>(n * c, 1.0)?,
                h.input::<E>(oc * c, 0.05)?,
                h.input::<E>(oc, 1.0)?,
                h.poisoned::<E>(n * oc)?,
            );
            timed(&mut h.reference_ms, || {
                h.r.matmul_forward::<E>(
                    ViewMut::of(&mut out.r),
                    View::of(&inp.r),
                    View::of(&w.r),
                    with_bias.then(|| View::of(&bias.r)),
                    n,
                    c,
                    oc,
                )
            })?;
            h.c.synchronize()?;
            timed(&mut h.candidate_ms, || {
                h.c.matmul_forward::<E>(
                    ViewMut::of(&mut out.c),
                    View::of(&inp.c),
                    View::of(&w.c),
                    with_bias.then(|| View::of(&bias.c)),
                    n,
                    c,
                    oc,
                )?;
                h.c.synchronize()
            })?;
            Ok(vec![("out", h.err::<E>(&out)?)])
        });
    }
    h.record::<E>("matmul_backward", |h| {
        let oc = 4 * c;
        let (inp, w, dout) = (h.input::<E>(n * c, 1.0)?, h.input::<E>(oc * c, 0.05)?, h.input::<E>(n * oc, 1.0)?);
        let (mut dinp, mut dw, mut db) = (h.poisoned::<E>(n * c)?, h.input::<E>(oc * c, 1.0)?, h.input::<E>(oc, 1.0)?);
        timed(&mut h.reference_ms, || {
            h.r.matmul_backward::<E>(
                ViewMut::of(&mut dinp.r),
                ViewMut::of(&mut dw.r),
                Some(ViewMut::of(&mut db.r)),
                View::of(&dout.r),
                View::of(&inp.r),
                View::of(&w.r),
                n,
                c,
                oc,
            )
        })?;
        h.c.synchronize()?;
        timed(&mut h.candidate_ms, || {
            h.c.matmul_backward::<E>(
                ViewMut::of(&mut dinp.c),
                ViewMut::of(&mut dw.c),
                Some(ViewMut::of(&mut db.c)),
                View::of(&dout.c),
                View::of(&inp.c),
                View::of(&w.c),
                n,
                c,
                oc,
            )?;
            h.c.synchronize()
        })?;
        Ok(vec![("dinp", h.err::<E>(&dinp)?), ("dweight", h.err::<E>(&dw)?), ("dbias", h.err::<E>(&db)?)])
    });
    h.record::<E>("attention_forward", |h| {
        let (qkv, mut out, mut lse) =
            (h.input::<E>(n * 3 * c, 1.0)?, h.poisoned::<E>(n * c)?, h.poisoned::<f32>(b * nh * t)?);
        both!(h, attention_forward::<E>(&mut out, &mut lse, &qkv, b, t, c, nh));
        Ok(vec![("out", h.err::<E>(&out)?), ("lse", h.err::<f32>(&lse)?)])
    });
    h.record::<E>("attention_backward", |h| {
        let (qkv, dout) = (h.input::<E>(n * 3 * c, 1.0)?, h.input::<E>(n * c, 1.0)?);
        let (mut out, mut lse) = (h.poisoned::<E>(n * c)?, h.poisoned::<f32>(b * nh * t)?);
        h.r.attention_forward::<E>(ViewMut::of(&mut out.r), ViewMut::of(&mut lse.r), View::of(&qkv.r), b, t, c, nh)?;
        let lse = h.shared::<f32>(&lse)?;
        let mut dqkv = h.poisoned::<E>(n * 3 * c)?;
        both!(h, attention_backward::<E>(&mut dqkv, &dout, &qkv, &lse, b, t, c, nh));
        Ok(vec![("dqkv", h.err::<E>(&dqkv)?)])
    });
    h.record::<E>("attention_cached", |h| {
        // A third of the window new, after cached positions, in a cache with room to spare.
        let tn = (t / 3).max(1);
        let d = crate::engine::backend::shapes::CachedAttention { b, tn, start: t - tn, context: t + 5, c, nh };
        let (qkv, mut cache) = (h.input::<E>(b * tn * 3 * c, 1.0)?, h.input::<E>(2 * b * d.context * c, 1.0)?);
        let mut out = h.poisoned::<E>(b * tn * c)?;
        both!(h, attention_cached::<E>(&mut out, &mut cache, &qkv, d));
        Ok(vec![("out", h.err::<E>(&out)?), ("cache", h.err::<E>(&cache)?)])
    });
    h.record::<E>("gelu_forward", |h| {
        let (inp, mut out) = (h.input::<E>(n * 4 * c, 2.0)?, h.poisoned::<E>(n * 4 * c)?);
        both!(h, gelu_forward::<E>(&mut out, &inp));
        Ok(vec![("out", h.err::<E>(&out)?)])
    });
    h.record::<E>("gelu_backward", |h| {
        let (inp, mut d) = (h.input::<E>(n * 4 * c, 2.0)?, h.input::<E>(n * 4 * c, 1.0)?);
        both!(h, gelu_backward_inplace::<E>(&mut d, &inp));
        Ok(vec![("dinp", h.err::<E>(&d)?)])
    });
    h.record::<E>("residual_forward", |h| {
        let (inp, mut out) = (h.input::<E>(n * c, 1.0)?, h.input::<E>(n * c, 1.0)?);
        both!(h, residual_forward_inplace::<E>(&mut out, &inp));
        Ok(vec![("out", h.err::<E>(&out)?)])
    });
    // Rows of logits wider than the vocabulary (the padding columns start random and must
    // come out 0).
    let vp = v + 13;
    h.record::<E>("crossentropy_forward", |h| {
        let (targets, mut logits, mut losses) = (h.ids(n, v)?, h.input::<E>(n * vp, 3.0)?, h.poisoned::<f32>(n)?);
        both!(h, crossentropy_forward::<E>(&mut logits, &mut losses, &targets, v, vp));
        Ok(vec![("probs", h.err::<E>(&logits)?), ("losses", h.err::<f32>(&losses)?)])
    });
    h.record::<E>("crossentropy_forward_backward", |h| {
        let (targets, mut logits, mut losses) = (h.ids(n, v)?, h.input::<E>(n * vp, 3.0)?, h.poisoned::<f32>(n)?);
        let dloss = 1.0 / n as f32;
        both!(h, crossentropy_forward_backward::<E>(&mut logits, &mut losses, &targets, dloss, v, vp));
        Ok(vec![("dlogits", h.err::<E>(&logits)?), ("losses", h.err::<f32>(&losses)?)])
    });
    h.record::<E>("adamw", |h| {
        let len = c * c + 7;
        let (grads, mut master, mut m) =
            (h.input::<E>(len, 1.0)?, h.input::<f32>(len, 1.0)?, h.input::<f32>(len, 0.1)?);
        let vv: Vec<f32> = h.randn(len, 0.1).into_iter().map(|x| x * x).collect();
        let mut vm = h.pair(&vv)?;
        let mut params = h.poisoned::<E>(len)?;
        let step = AdamW { lr: 1e-3, weight_decay: 0.1, t: 3 };
        timed(&mut h.reference_ms, || {
            h.r.adamw::<E>(
                ViewMut::of(&mut master.r),
                Some(ViewMut::of(&mut params.r)),
                View::of(&grads.r),
                ViewMut::of(&mut m.r),
                ViewMut::of(&mut vm.r),
                &step,
                true,
                0.5,
            )
        })?;
        h.c.synchronize()?;
        timed(&mut h.candidate_ms, || {
            h.c.adamw::<E>(
                ViewMut::of(&mut master.c),
                Some(ViewMut::of(&mut params.c)),
                View::of(&grads.c),
                ViewMut::of(&mut m.c),
                ViewMut::of(&mut vm.c),
                &step,
                true,
                0.5,
            )?;
            h.c.synchronize()
        })?;
        Ok(vec![
            ("master", h.err::<f32>(&master)?),
            ("m", h.err::<f32>(&m)?),
            ("v", h.err::<f32>(&vm)?),
            ("params", h.err::<E>(&params)?),
        ])
    });
    h.record::<E>("sum_squares", |h| {
        let x = h.input::<E>(n * c + 13, 1.0)?;
        let r = timed(&mut h.reference_ms, || h.r.sum_squares::<E>(View::of(&x.r)))?;
        h.c.synchronize()?;
        let c = timed(&mut h.candidate_ms, || h.c.sum_squares::<E>(View::of(&x.c)))?;
        Ok(vec![("sum", if c.is_finite() { (r - c).abs() / r.abs().max(1e-30) } else { f64::INFINITY })])
    });
    h.record::<E>("narrow / widen", |h| {
        let (src, mut dst) = (h.input::<f32>(n * c, 3.0)?, h.poisoned::<E>(n * c)?);
        both!(h, narrow::<E>(&mut dst, &src));
        let (src16, mut wide) = (h.input::<E>(n * c, 3.0)?, h.poisoned::<f32>(n * c)?);
        both!(h, widen::<E>(&mut wide, &src16));
        Ok(vec![("narrowed", h.err::<E>(&dst)?), ("widened", h.err::<f32>(&wide)?)])
    });
    h.record::<E>("pack_int8 / unpack_int8", |h| {
        let x = h.input::<E>(n * c, 2.0)?;
        let (mut q, mut scales) = (h.pair(&vec![i8::MIN; n * c])?, h.poisoned::<f32>(n)?);
        both!(h, pack_int8::<E>(&mut q, &mut scales, &x, c));
        h.c.synchronize()?;
        let (mut qr, mut qc) = (vec![0i8; n * c], vec![0i8; n * c]);
        h.r.download(View::of(&q.r), &mut qr)?;
        h.c.download(View::of(&q.c), &mut qc)?;
        // Quantised codes: at most one step apart (ties may round either way), never unwritten.
        let q_steps = qr
            .iter()
            .zip(&qc)
            .map(|(&a, &b)| if b == i8::MIN { f64::INFINITY } else { (a as f64 - b as f64).abs() })
            .fold(0f64, f64::max);
        let q_err = if q_steps > 1.0 { f64::INFINITY } else { 0.0 };
        let q = h.shared::<i8>(&q)?;
        let scales_shared = h.shared::<f32>(&scales)?;
        let mut back = h.poisoned::<E>(n * c)?;
        both!(h, unpack_int8::<E>(&mut back, &q, &scales_shared, c));
        Ok(vec![("q", q_err), ("scales", h.err::<f32>(&scales)?), ("unpacked", h.err::<E>(&back)?)])
    });
    h.record::<E>("unpack_int4", |h| {
        // Every byte value (so every nibble pair, both signs), groups of 32.
        let group = 32;
        let len = (n * c).div_ceil(group) * group;
        let bytes: Vec<u8> = (0..len / 2).map(|i| (i * 37 % 256) as u8).collect();
        let (packed, scales) = (h.pair(&bytes)?, h.input::<f32>(len / group, 0.1)?);
        let mut x = h.poisoned::<E>(len)?;
        both!(h, unpack_int4::<E>(&mut x, &packed, &scales, group));
        Ok(vec![("x", h.err::<E>(&x)?)])
    });
}

/// The rows as a table, in run order.
pub fn table(rows: &[ParityRow]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<26} {:<5} {:<24} {:<9} {:>10} {:>9} {:>10} {:>10}  result",
        "op", "dtype", "shape", "worst", "rel err", "bound", "ref ms", "cand ms"
    );
    for r in rows {
        let result = match &r.error {
            Some(e) => format!("ERROR {e}"),
            None if r.passed() => "ok".into(),
            None => "FAIL".into(),
        };
        let _ = writeln!(
            out,
            "{:<26} {:<5} {:<24} {:<9} {:>10.2e} {:>9.0e} {:>10.3} {:>10.3}  {result}",
            r.op, r.dtype, r.shape, r.worst, r.rel_err, r.threshold, r.reference_ms, r.candidate_ms
        );
    }
    out
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::engine::backend::CpuBackend;
    use crate::memory::Pool;

    const MIB: usize = 1 << 20;

    /// The CPU backend with two planted bugs: GELU off by 5% on one element, and layernorm
    /// forgetting to write rstd.
    pub(crate) struct Faulty(pub CpuBackend);

    #[allow(clippy::too_many_arguments)]
    impl Backend for Faulty {
        type Fence = ();

        fn device(&self) -> String {
            "faulty".into()
        }
        fn pool(&self) -> &Pool {
            self.0.pool()
        }
        fn synchronize(&self) -> BackendResult {
            Ok(())
        }
        fn upload<T: Pod>(&self, dst: ViewMut<T>, src: &[T]) -> BackendResult {
            self.0.upload(dst, src)
        }
        fn download<T: Pod>(&self, src: View<T>, dst: &mut [T]) -> BackendResult {
            self.0.download(src, dst)
        }
        fn upload_ahead<T: Pod>(&self, dst: ViewMut<T>, src: &[T]) -> BackendResult {
            self.0.upload_ahead(dst, src)
        }
        fn wait_copy(&self, fence: ()) -> BackendResult {
            self.0.wait_copy(fence)
        }
        unsafe fn download_ahead<T: Pod>(&self, src: View<T>, dst: &mut [T]) -> BackendResult {
            // SAFETY: the caller keeps the contract of `download_ahead`.
            unsafe { self.0.download_ahead(src, dst) }
        }
        fn wait_host(&self, fence: ()) -> BackendResult {
            self.0.wait_host(fence)
        }
        fn zero<T: Pod>(&self, dst: ViewMut<T>) -> BackendResult {
            self.0.zero(dst)
        }
        fn layernorm_forward<E: Elem>(
            &self,
            out: ViewMut<E>,
            mean: ViewMut<f32>,
            rstd: ViewMut<f32>,
            inp: View<E>,
            weight: View<E>,
            bias: View<E>,
            c: usize,
        ) -> BackendResult {
            let mut elsewhere = self.pool().alloc(rstd.len() * 4, Category::Workspace)?;
            self.0.layernorm_forward(out, mean, ViewMut::of(&mut elsewhere), inp, weight, bias, c)
        }
        fn gelu_forward<E: Elem>(&self, mut out: ViewMut<E>, inp: View<E>) -> BackendResult {
            self.0.gelu_forward(out.reborrow(), inp)?;
            let o = out.host_mut();
            let big = (0..o.len()).max_by(|&a, &b| o[a].to_f32().abs().total_cmp(&o[b].to_f32().abs())).unwrap();
            o[big] = E::from_f32(o[big].to_f32() * 1.05);
            Ok(())
        }
        delegate_ops!(0, std::convert::identity;
            encoder_forward, encoder_backward, layernorm_recompute, layernorm_backward, matmul_forward,
            matmul_backward, attention_forward, attention_backward, gelu_backward_inplace,
            residual_forward_inplace, crossentropy_forward, crossentropy_forward_backward, adamw, sum_squares,
            narrow, widen, pack_int8, unpack_int8, unpack_int4, attention_cached);
    }

    #[test]
    fn the_reference_agrees_with_itself_on_every_op() {
        let reference = CpuBackend::new(Pool::new("cpu", 512 * MIB));
        let candidate = CpuBackend::new(Pool::new("cpu", 512 * MIB));
        let started = std::time::Instant::now();
        let rows = run(&reference, &candidate, ParityShape::ODD, 7);
        let wall_ms = started.elapsed().as_secs_f64() * 1e3;
        eprintln!("{}", table(&rows));
        assert_eq!(rows.len(), 3 * 21, "21 ops × {{fp32, bf16, fp16}}");
        for r in &rows {
            assert!(r.error.is_none(), "{} {}: {:?}", r.op, r.dtype, r.error);
            assert_eq!(r.rel_err, 0.0, "{} {}: the same code on the same inputs", r.op, r.dtype);
        }
        // Each row's times are its own op's: together they fit in the run's wall time.
        let timed: f64 = rows.iter().map(|r| r.reference_ms + r.candidate_ms).sum();
        assert!(timed <= wall_ms, "rows time {timed:.1} ms of a {wall_ms:.1} ms run");
    }

    #[test]
    fn planted_bugs_and_unwritten_outputs_fail_and_nothing_else_does() {
        let reference = CpuBackend::new(Pool::new("cpu", 512 * MIB));
        let candidate = Faulty(CpuBackend::new(Pool::new("cpu", 512 * MIB)));
        let rows = run(&reference, &candidate, ParityShape::ODD, 11);
        let table = table(&rows);
        eprintln!("{table}");
        let failed: Vec<(&str, &str, &str)> =
            rows.iter().filter(|r| !r.passed()).map(|r| (r.op, r.dtype, r.worst)).collect();
        assert_eq!(
            failed,
            vec![
                ("layernorm_forward", "fp32", "rstd"),
                ("gelu_forward", "fp32", "out"),
                ("layernorm_forward", "bf16", "rstd"),
                ("gelu_forward", "bf16", "out"),
                ("layernorm_forward", "fp16", "rstd"),
                ("gelu_forward", "fp16", "out"),
            ],
            "{table}"
        );
        let gelu = rows.iter().find(|r| r.op == "gelu_forward" && r.dtype == "fp32").unwrap();
        assert!((gelu.rel_err - 0.05).abs() < 0.01, "the 5% error is measured as such: {}", gelu.rel_err);
        assert!(table.contains("FAIL"));
    }

    #[test]
    fn an_op_that_errors_is_a_failed_row_with_the_message() {
        // A pool too small for the inputs: every op fails with the OOM in its row, no panic.
        let reference = CpuBackend::new(Pool::new("cpu", 512 * MIB));
        let candidate = CpuBackend::new(Pool::new("cpu", MIB));
        let rows = run(&reference, &candidate, ParityShape::ODD, 3);
        assert!(rows.iter().any(|r| r.error.as_deref().is_some_and(|e| e.contains("out of device memory"))));
        assert!(rows.iter().any(|r| !r.passed()));
    }
}
