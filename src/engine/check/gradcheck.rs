//! Gradient checks: every layer's backward and the whole model's against central finite
//! differences of its forward.

use crate::config::{Checkpointing, OffloadTarget};
#[allow(unused_imports)]
use crate::engine::backend::layers::Elem;
use crate::engine::backend::layers::*;
use crate::engine::backend::{Backend, CpuBackend, View, ViewMut};
use crate::engine::model::{self, GptConfig, HeadOutput, PpStage, TensorGroup, TpShard};
use crate::engine::parallel::placement::{FullGrads, Resident};
use crate::engine::rng::Rng;
use crate::memory::{Category, Pool};

/// What one model pass on the CPU backend measured.
struct Pass<E> {
    loss: f32,
    /// Parameter gradients of the mean loss (empty for a forward-only pass).
    grads: Vec<E>,
    /// Activation bytes held between forward and backward.
    activation_bytes: usize,
}

/// Forward (and, with `backward`, backward) of the model over host weights `params`, placed
/// in `pool` as the trainer would.
#[allow(clippy::too_many_arguments)]
fn pass<E: Elem>(
    cfg: &GptConfig,
    pool: &Pool,
    params: &[E],
    inputs: &[u32],
    targets: &[u32],
    b: usize,
    t: usize,
    mode: Checkpointing,
    backward: bool,
) -> Pass<E> {
    let be = CpuBackend::new(pool.clone());
    let mut weights = model::alloc_elems::<E>(pool, params.len(), Category::Params).unwrap();
    be.upload(ViewMut::of(&mut weights), params).unwrap();
    let source = Resident(View::<E>::of(&weights));
    let head = HeadOutput::Gradient { dloss: 1.0 / (b * t) as f32 };
    let acts =
        model::forward(&be, cfg, &source, inputs, targets, b, t, mode, OffloadTarget::None, &TensorGroup::none(), head)
            .unwrap();
    let (loss, activation_bytes) = (acts.mean_loss(), pool.stats().current(Category::Activations));
    let mut grads = Vec::new();
    if backward {
        let mut g = model::alloc_elems::<E>(pool, params.len(), Category::Grads).unwrap();
        be.zero::<E>(ViewMut::of(&mut g)).unwrap();
        model::backward(&be, cfg, &source, &mut FullGrads(ViewMut::of(&mut g)), acts, &TensorGroup::none()).unwrap();
        grads = vec![E::default(); params.len()];
        be.download(View::of(&g), &mut grads).unwrap();
    }
    Pass { loss, grads, activation_bytes }
}

fn randn(rng: &mut Rng, n: usize, scale: f64) -> Vec<f32> {
    (0..n).map(|_| (rng.normal() * scale) as f32).collect()
}

fn dot64(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum()
}

/// Compare `analytic` with central differences of `objective` around `x`, every element.
fn check(name: &str, x: &[f32], analytic: &[f32], objective: &dyn Fn(&[f32]) -> f64) {
    assert_eq!(x.len(), analytic.len(), "{name}: gradient shape");
    let eps = 3e-3f32;
    let mut worst = 0.0f64;
    for i in 0..x.len() {
        let mut xp = x.to_vec();
        xp[i] += eps;
        let mut xm = x.to_vec();
        xm[i] -= eps;
        let numeric = (objective(&xp) - objective(&xm)) / (2.0 * eps as f64);
        let a = analytic[i] as f64;
        let err = (numeric - a).abs();
        let tol = 1e-2 * a.abs().max(numeric.abs()) + 2e-3;
        worst = worst.max(err / tol);
        assert!(err <= tol, "{name}[{i}]: analytic {a:.6} vs numeric {numeric:.6}");
    }
    assert!(worst.is_finite(), "{name}: checked");
}

#[test]
fn matmul_backward_matches_finite_differences() {
    let (n, c, oc) = (3, 4, 5);
    let mut rng = Rng::new(1);
    let (x, w, b, r) = (
        randn(&mut rng, n * c, 1.0),
        randn(&mut rng, oc * c, 1.0),
        randn(&mut rng, oc, 1.0),
        randn(&mut rng, n * oc, 1.0),
    );
    let f = |x: &[f32], w: &[f32], b: &[f32]| {
        let mut out = vec![0.0; n * oc];
        matmul_forward(&mut out, x, w, Some(b), n, c, oc, &mut []);
        dot64(&out, &r)
    };
    let (mut dx, mut dw, mut db) = (vec![0.0; n * c], vec![0.0; oc * c], vec![0.0; oc]);
    matmul_backward(&mut dx, &mut dw, Some(&mut db), &r, &x, &w, n, c, oc, &mut []);
    check("matmul.dinp", &x, &dx, &|x| f(x, &w, &b));
    check("matmul.dweight", &w, &dw, &|w| f(&x, w, &b));
    check("matmul.dbias", &b, &db, &|b| f(&x, &w, b));
}

#[test]
fn layernorm_backward_matches_finite_differences() {
    let (n, c) = (3, 8);
    let mut rng = Rng::new(2);
    let (x, w, b, r) =
        (randn(&mut rng, n * c, 1.0), randn(&mut rng, c, 1.0), randn(&mut rng, c, 1.0), randn(&mut rng, n * c, 1.0));
    let f = |x: &[f32], w: &[f32], b: &[f32]| {
        let (mut out, mut m, mut s) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
        layernorm_forward(&mut out, &mut m, &mut s, x, w, b, c);
        dot64(&out, &r)
    };
    let (mut out, mut m, mut s) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
    layernorm_forward(&mut out, &mut m, &mut s, &x, &w, &b, c);
    let (mut dx, mut dw, mut db) = (vec![0.0; n * c], vec![0.0; c], vec![0.0; c]);
    layernorm_backward(&mut dx, &mut dw, &mut db, &r, &x, &w, &m, &s, c);
    check("layernorm.dinp", &x, &dx, &|x| f(x, &w, &b));
    check("layernorm.dweight", &w, &dw, &|w| f(&x, w, &b));
    check("layernorm.dbias", &b, &db, &|b| f(&x, &w, b));
}

/// attention_forward's (out, lse) of `qkv`, run with the scratch it declares.
fn attention_with_its_scratch<E: Elem>(qkv: &[E], (b, t, c, nh): (usize, usize, usize, usize)) -> (Vec<E>, Vec<f32>) {
    let (mut out, mut lse) = (vec![E::default(); b * t * c], vec![0.0; b * nh * t]);
    let mut scratch = vec![0.0; attention_forward_scratch::<E>(b, t, c, nh)];
    attention_forward(&mut out, &mut lse, qkv, &mut scratch, b, t, c, nh);
    (out, lse)
}

#[test]
fn attention_backward_matches_finite_differences() {
    let (b, t, c, nh) = (2, 4, 8, 2);
    let mut rng = Rng::new(3);
    let (qkv, r) = (randn(&mut rng, b * t * 3 * c, 1.0), randn(&mut rng, b * t * c, 1.0));
    let f = |qkv: &[f32]| {
        let (out, _) = attention_with_its_scratch(qkv, (b, t, c, nh));
        dot64(&out, &r)
    };
    let (out, lse) = attention_with_its_scratch(&qkv, (b, t, c, nh));
    // Causality: query 0 attends only to itself, so its output is its own value and its
    // log-sum-exp its own scaled score.
    let hs = c / nh;
    assert_eq!(out[..hs], qkv[2 * c..2 * c + hs]);
    let s00: f32 = (0..hs).map(|i| qkv[i] * qkv[c + i]).sum::<f32>() / (hs as f32).sqrt();
    assert!((lse[0] - s00).abs() < 1e-6, "lse {} vs score {s00}", lse[0]);
    let mut dqkv = vec![0.0; b * t * 3 * c];
    let mut scratch = vec![0.0; attention_backward_scratch::<f32>(b, t, c, nh)];
    attention_backward(&mut dqkv, &mut scratch, &r, &qkv, &lse, b, t, c, nh);
    check("attention.dqkv", &qkv, &dqkv, &f);
}

#[test]
fn gelu_and_crossentropy_backward_match_finite_differences() {
    let mut rng = Rng::new(4);
    let (x, r) = (randn(&mut rng, 64, 2.0), randn(&mut rng, 64, 1.0));
    let f = |x: &[f32]| {
        let mut out = vec![0.0; x.len()];
        gelu_forward(&mut out, x);
        dot64(&out, &r)
    };
    let mut d = r.clone();
    gelu_backward_inplace(&mut d, &x);
    check("gelu.dinp", &x, &d, &f);

    let (n, v) = (3, 7);
    let logits = randn(&mut rng, n * v, 1.0);
    let targets = [1u32, 6, 0];
    let f = |lg: &[f32]| {
        let (mut p, mut losses) = (lg.to_vec(), vec![0.0; n]);
        crossentropy_forward(&mut p, &mut losses, &targets, v, v);
        losses.iter().map(|&l| l as f64).sum::<f64>() / n as f64
    };
    let (mut d, mut losses) = (logits.clone(), vec![0.0; n]);
    crossentropy_forward_backward(&mut d, &mut losses, &targets, 1.0 / n as f32, v, v);
    check("crossentropy.dlogits", &logits, &d, &f);
}

#[test]
fn encoder_backward_matches_finite_differences() {
    let (b, t, c, vocab) = (2, 3, 4, 5);
    let mut rng = Rng::new(5);
    let (wte, wpe, r) = (randn(&mut rng, vocab * c, 1.0), randn(&mut rng, t * c, 1.0), randn(&mut rng, b * t * c, 1.0));
    let inp = [0u32, 3, 3, 4, 0, 1];
    let f = |wte: &[f32], wpe: &[f32]| {
        let mut out = vec![0.0; b * t * c];
        encoder_forward(&mut out, &inp, wte, wpe, t, c);
        dot64(&out, &r)
    };
    let (mut dwte, mut dwpe) = (vec![0.0; vocab * c], vec![0.0; t * c]);
    encoder_backward(&mut dwte, &mut dwpe, &r, &inp, t, c);
    check("encoder.dwte", &wte, &dwte, &|w| f(w, &wpe));
    check("encoder.dwpe", &wpe, &dwpe, &|w| f(&wte, w));
}

#[test]
fn whole_model_gradients_match_finite_differences() {
    let cfg =
        GptConfig { n_layer: 2, n_head: 2, n_embd: 8, block_size: 4, vocab: 11, tp: TpShard::NONE, pp: PpStage::NONE };
    let (b, t) = (2, 4);
    let pool = Pool::new("cpu", 64 << 20);
    let mut params = vec![0.0f32; cfg.num_params()];
    cfg.init_params(&mut params, 7);
    // Larger weights than GPT-2's init so every path carries a visible gradient.
    let mut rng = Rng::new(8);
    for p in params.iter_mut() {
        *p += (rng.normal() * 0.3) as f32;
    }
    let inputs: Vec<u32> = (0..(b * t) as u32).map(|i| (i * 7 + 3) % 11).collect();
    let targets: Vec<u32> = (0..(b * t) as u32).map(|i| (i * 5 + 1) % 11).collect();
    let loss = |p: &[f32]| pass(&cfg, &pool, p, &inputs, &targets, b, t, Checkpointing::None, false).loss as f64;
    let grads = pass(&cfg, &pool, &params, &inputs, &targets, b, t, Checkpointing::None, true).grads;
    assert_eq!(pool.stats().current(Category::Activations), 0, "backward frees every activation");
    assert_eq!(pool.stats().current(Category::Workspace), 0, "and its workspace");
    for info in cfg.tensors() {
        let r = info.offset..info.offset + info.len;
        check(&info.name, &params[r.clone()], &grads[r.clone()], &|x| {
            let mut p = params.clone();
            p[r.clone()].copy_from_slice(x);
            loss(&p)
        });
    }
}

#[test]
fn checkpointing_gives_the_same_gradients_with_fewer_activation_bytes() {
    let cfg =
        GptConfig { n_layer: 3, n_head: 2, n_embd: 16, block_size: 8, vocab: 13, tp: TpShard::NONE, pp: PpStage::NONE };
    let (b, t) = (4, 8);
    let mut params = vec![0.0f32; cfg.num_params()];
    cfg.init_params(&mut params, 3);
    let inputs: Vec<u32> = (0..(b * t) as u32).map(|i| (i * 7 + 3) % 13).collect();
    let targets: Vec<u32> = (0..(b * t) as u32).map(|i| (i * 5 + 1) % 13).collect();
    let mut results = Vec::new();
    for mode in [Checkpointing::None, Checkpointing::Selective, Checkpointing::Full] {
        let pool = Pool::new("cpu", 64 << 20);
        let Pass { loss, grads, .. } = pass(&cfg, &pool, &params, &inputs, &targets, b, t, mode, true);
        results.push((mode, loss, grads, pool.stats().peak(Category::Activations)));
    }
    let (_, loss0, grads0, peak0) = &results[0];
    for (mode, loss, grads, peak) in &results[1..] {
        assert_eq!(loss.to_bits(), loss0.to_bits(), "{mode:?}: same forward");
        assert!(grads.iter().zip(grads0).all(|(a, b)| a.to_bits() == b.to_bits()), "{mode:?}: recomputation is exact");
        assert!(peak < peak0, "{mode:?}: {peak} activation bytes at peak vs {peak0}");
    }
    assert!(results[2].3 < results[1].3, "full keeps less than selective");
}

/// Relative error ‖a − b‖ / ‖b‖ of a 16-bit result against the fp32 reference.
fn rel_err<E: Elem>(a: &[E], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| (x.to_f32() as f64 - *y as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

fn to<E: Elem>(x: &[f32]) -> Vec<E> {
    x.iter().map(|&v| E::from_f32(v)).collect()
}

#[test]
fn sixteen_bit_layers_match_the_fp32_reference() {
    let (b, t, c, nh, oc) = (2, 8, 16, 2, 24);
    let n = b * t;
    let mut rng = Rng::new(11);
    let x = randn(&mut rng, n * c, 1.0);
    let w = randn(&mut rng, oc * c, 0.3);
    let bias = randn(&mut rng, oc, 0.1);
    let mut ref_out = vec![0.0f32; n * oc];
    matmul_forward(&mut ref_out, &x, &w, Some(&bias), n, c, oc, &mut []);
    let mut out16 = vec![half::bf16::ZERO; n * oc];
    let mut scratch = vec![0.0f32; matmul_forward_scratch::<half::bf16>(n, c, oc)];
    matmul_forward(&mut out16, &to(&x), &to(&w), Some(&to(&bias)), n, c, oc, &mut scratch);
    assert!(rel_err(&out16, &ref_out) < 1e-2, "bf16 matmul: {}", rel_err(&out16, &ref_out));

    let dout = randn(&mut rng, n * oc, 1.0);
    let (mut dx, mut dw, mut db) = (vec![0.0f32; n * c], vec![0.0f32; oc * c], vec![0.0f32; oc]);
    matmul_backward(&mut dx, &mut dw, Some(&mut db), &dout, &x, &w, n, c, oc, &mut []);
    let (mut dx16, mut dw16, mut db16) =
        (vec![half::f16::ZERO; n * c], vec![half::f16::ZERO; oc * c], vec![half::f16::ZERO; oc]);
    let mut scratch = vec![0.0f32; matmul_backward_scratch::<half::f16>(n, c, oc)];
    matmul_backward(&mut dx16, &mut dw16, Some(&mut db16), &to(&dout), &to(&x), &to(&w), n, c, oc, &mut scratch);
    for (name, e) in [("dinp", rel_err(&dx16, &dx)), ("dweight", rel_err(&dw16, &dw)), ("dbias", rel_err(&db16, &db))] {
        assert!(e < 5e-3, "fp16 matmul {name}: {e}");
    }

    let qkv = randn(&mut rng, n * 3 * c, 1.0);
    let (o, lse) = attention_with_its_scratch(&qkv, (b, t, c, nh));
    let (o16, lse16) = attention_with_its_scratch::<half::bf16>(&to(&qkv), (b, t, c, nh));
    assert!(rel_err(&o16, &o) < 2e-2 && rel_err(&lse16, &lse) < 1e-2);
    let d = randn(&mut rng, n * c, 1.0);
    let mut dqkv = vec![0.0f32; n * 3 * c];
    attention_backward(
        &mut dqkv,
        &mut vec![0.0; attention_backward_scratch::<f32>(b, t, c, nh)],
        &d,
        &qkv,
        &lse,
        b,
        t,
        c,
        nh,
    );
    let mut dqkv16 = vec![half::bf16::ZERO; n * 3 * c];
    let mut scratch = vec![0.0; attention_backward_scratch::<half::bf16>(b, t, c, nh)];
    attention_backward(&mut dqkv16, &mut scratch, &to(&d), &to(&qkv), &lse16, b, t, c, nh);
    assert!(rel_err(&dqkv16, &dqkv) < 3e-2, "bf16 attention backward: {}", rel_err(&dqkv16, &dqkv));
}

#[test]
fn bf16_model_gradients_track_fp32() {
    let cfg =
        GptConfig { n_layer: 2, n_head: 2, n_embd: 16, block_size: 8, vocab: 13, tp: TpShard::NONE, pp: PpStage::NONE };
    let (b, t) = (4, 8);
    let mut params = vec![0.0f32; cfg.num_params()];
    cfg.init_params(&mut params, 5);
    let inputs: Vec<u32> = (0..(b * t) as u32).map(|i| (i * 7 + 3) % 13).collect();
    let targets: Vec<u32> = (0..(b * t) as u32).map(|i| (i * 5 + 1) % 13).collect();
    let pool = Pool::new("cpu", 64 << 20);
    let Pass { loss: l32, grads: g32, activation_bytes: act32 } =
        pass(&cfg, &pool, &params, &inputs, &targets, b, t, Checkpointing::None, true);
    let p16: Vec<half::bf16> = to(&params);
    let Pass { loss: l16, grads: g16, activation_bytes: act16 } =
        pass(&cfg, &pool, &p16, &inputs, &targets, b, t, Checkpointing::None, true);
    assert!((l16 - l32).abs() / l32 < 1e-2, "loss {l16} vs {l32}");
    assert!(rel_err(&g16, &g32) < 5e-2, "gradients: {}", rel_err(&g16, &g32));
    assert!((act16 as f64) < act32 as f64 * 0.7, "bf16 activations {act16} vs fp32 {act32}");
}
