//! Each op's shape contract, shared by every backend so a bad call is the same error everywhere.
//! Lengths are in elements; functions that need N return it.
//! Token ids below `v`, checked where the ids are in host memory (device ids come from an
//! upload of host data that the trainer has checked).
//! pack_int8 / unpack_int8: x (N,C), q (N,C), scales (N).
#![allow(clippy::too_many_arguments)]

use super::error::{check_shape, BackendError, BackendResult};
pub use super::layers::CachedAttention;
use super::layers::Elem;
use super::view::View;

pub fn same(op: &'static str, what: &str, a: usize, b: usize) -> BackendResult {
    check_shape(op, a == b, || format!("{what}: {a} elements, expected {b}"))
}

pub fn rows(op: &'static str, len: usize, c: usize) -> BackendResult<usize> {
    check_shape(op, c > 0 && len.is_multiple_of(c), || format!("{len} elements are not whole rows of {c}"))?;
    Ok(len / c)
}

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

pub fn encoder_backward(dwte: usize, dwpe: usize, dout: usize, inp: View<u32>, t: usize, c: usize) -> BackendResult {
    const OP: &str = "encoder_backward";
    same(OP, "dout (B,T,C)", dout, inp.len() * c)?;
    rows(OP, inp.len(), t)?; // whole sequences of T
    check_shape(OP, dwpe >= t * c, || format!("dwpe has {dwpe} elements"))?;
    tokens(OP, inp, dwte / c.max(1))
}

fn layernorm(op: &'static str, out: usize, inp: usize, weight: usize, bias: usize, c: usize) -> BackendResult<usize> {
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

fn attention(op: &'static str, qkv: usize, lse: usize, b: usize, t: usize, c: usize, nh: usize) -> BackendResult {
    check_shape(op, nh > 0 && c.is_multiple_of(nh), || format!("C={c} is not a multiple of NH={nh}"))?;
    same(op, "qkv (B,T,3C)", qkv, b * t * 3 * c)?;
    same(op, "lse (B,NH,T)", lse, b * nh * t)
}

pub fn attention_forward(out: usize, lse: usize, qkv: usize, b: usize, t: usize, c: usize, nh: usize) -> BackendResult {
    const OP: &str = "attention_forward";
    attention(OP, qkv, lse, b, t, c, nh)?;
    same(OP, "out (B,T,C)", out, b * t * c)
}

/// `attention_cached`: out (B,Tn,C), cache (2,B,context,C), qkv (B,Tn,3C), the new tokens
/// within the cache.
pub fn attention_cached(out: usize, cache: usize, qkv: usize, d: CachedAttention) -> BackendResult {
    const OP: &str = "attention_cached";
    let CachedAttention { b, tn, start, context, c, nh } = d;
    check_shape(OP, nh > 0 && c.is_multiple_of(nh), || format!("C={c} is not a multiple of NH={nh}"))?;
    check_shape(OP, tn > 0 && start + tn <= context, || {
        format!("{tn} new tokens at position {start} do not fit a cache of {context} positions")
    })?;
    same(OP, "qkv (B,Tn,3C)", qkv, b * tn * 3 * c)?;
    same(OP, "cache (2,B,context,C)", cache, 2 * b * context * c)?;
    same(OP, "out (B,Tn,C)", out, b * tn * c)
}

pub fn attention_backward(
    dqkv: usize,
    dout: usize,
    qkv: usize,
    lse: usize,
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
) -> BackendResult {
    const OP: &str = "attention_backward";
    attention(OP, qkv, lse, b, t, c, nh)?;
    same(OP, "dqkv (B,T,3C)", dqkv, b * t * 3 * c)?;
    same(OP, "dout (B,T,C)", dout, b * t * c)
}

/// The softmax cross-entropy ops': logits (N,VP), losses (N), targets (N) below V ≤ VP.
/// Returns N.
pub fn crossentropy(
    op: &'static str,
    logits: usize,
    losses: usize,
    targets: View<u32>,
    v: usize,
    vp: usize,
) -> BackendResult<usize> {
    check_shape(op, v <= vp, || format!("the vocabulary ({v}) is wider than a row of logits ({vp})"))?;
    let n = rows(op, logits, vp)?;
    same(op, "losses", losses, n)?;
    same(op, "targets", targets.len(), n)?;
    tokens(op, targets, v)?;
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

/// `unpack_int4`: x elements in whole groups of an even size; packed x/2 bytes; a scale per group.
pub fn int4(op: &'static str, x: usize, packed: usize, scales: usize, group: usize) -> BackendResult<usize> {
    if group == 0 || !group.is_multiple_of(2) {
        return Err(BackendError::Shape { op, detail: format!("group {group} must be even and positive") });
    }
    let groups = rows(op, x, group)?;
    same(op, "packed", packed, x / 2)?;
    same(op, "scales", scales, groups)?;
    Ok(groups)
}

pub fn int8(op: &'static str, x: usize, q: usize, scales: usize, c: usize) -> BackendResult<usize> {
    let n = rows(op, x, c)?;
    same(op, "q", q, x)?;
    same(op, "scales", scales, n)?;
    Ok(n)
}
