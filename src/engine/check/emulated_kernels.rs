//! The CUDA kernels' logic run on this machine: tests/cuda_emulator runs a kernel family's
//! threads as fibers (collectives are barriers, mma is computed from the warp's fragments), and
//! these tests launch its entry points with the cuda backend's own launch geometry and compare
//! what they write with the CPU reference. They need a C++ compiler (`c++`); CI sets
//! HEADROOM_EMULATOR_TEST=1 so a missing one fails instead of skipping.

use std::path::{Path, PathBuf};
use std::process::Command;

use cudarc::driver::LaunchConfig;

use crate::engine::backend::cuda::backend::{
    block_rows, column_sums, elementwise, encoder_order_plan, flash_blocks, packed, warp_rows, OrderLaunch, DTYPES,
};
use crate::engine::backend::cuda::entry_points;
use crate::engine::backend::layers::{self, Elem};
use crate::engine::backend::optim::{self, AdamW, BETA1, BETA2, EPS};
use crate::engine::backend::workspace::{cuda_column_bands, cuda_norm_blocks, cuda_order_keys, CUDA_THREADS};
use crate::engine::rng::Rng;

/// One kernel family built for the emulator, in its own temporary directory.
struct Emulated {
    dir: tempfile::TempDir,
    exe: PathBuf,
}

/// An argument of an emulated launch: a buffer (its contents go in, and come back as the kernel
/// left them), or a scalar of the parameter's C type.
enum Arg<'a> {
    Buf(&'a mut [u8]),
    /// A buffer starting this many bytes past a 256-byte boundary (the device's allocations
    /// are aligned; a view at an odd offset is not): the kernels' unaligned paths.
    Shifted(&'a mut [u8], usize),
    /// The `k`-th buffer argument again (0-based among the buffers): an op that works in place.
    Same(usize),
    I32(i32),
    I64(i64),
    F32(f32),
}

fn buf<T: bytemuck::Pod>(values: &mut [T]) -> Arg<'_> {
    Arg::Buf(bytemuck::cast_slice_mut(values))
}

/// `values` at `elems` elements past an aligned start.
fn shifted<T: bytemuck::Pod>(values: &mut [T], elems: usize) -> Arg<'_> {
    Arg::Shifted(bytemuck::cast_slice_mut(values), elems * std::mem::size_of::<T>())
}

fn int(n: usize) -> Arg<'static> {
    Arg::I32(i32::try_from(n).expect("fits an int"))
}

impl Emulated {
    /// Builds `family` with every entry point registered; None when there is no C++ compiler
    /// and the test is not required.
    fn build(family: &str) -> Option<Emulated> {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let required = std::env::var("HEADROOM_EMULATOR_TEST").is_ok_and(|v| v == "1");
        let dir = tempfile::tempdir().unwrap();
        let mut driver = format!("#include \"emulate.hpp\"\n#include \"run_kernel.hpp\"\n#include \"{family}.cu\"\n");
        for entry in entry_points(family).unwrap() {
            driver += &format!("EMULATE_ENTRY({entry})\n");
        }
        let source = dir.path().join(format!("{family}.cpp"));
        std::fs::write(&source, driver).unwrap();
        let exe = dir.path().join(family);
        let status = Command::new("c++")
            .args(["-std=c++17", "-O2", "-Wall", "-Werror", "-Wno-sign-compare", "-I"])
            .arg(root.join("kernels"))
            .arg("-I")
            .arg(root.join("tests/cuda_emulator"))
            .arg(&source)
            .arg("-o")
            .arg(&exe)
            .status();
        match status {
            Ok(s) => {
                assert!(s.success(), "kernels/{family}.cu does not build for the emulator");
                Some(Emulated { dir, exe })
            }
            Err(e) => {
                assert!(!required, "HEADROOM_EMULATOR_TEST=1 but `c++` cannot run: {e}");
                eprintln!("skipped: no C++ compiler ({e})");
                None
            }
        }
    }

    /// Runs `entry` over `cfg`'s grid and blocks; every buffer comes back as the kernel left it.
    fn launch(&self, entry: &str, cfg: LaunchConfig, args: &mut [Arg]) {
        let (g, b) = (cfg.grid_dim, cfg.block_dim);
        let mut plan = format!("entry {entry}\ngrid {} {} {}\nblock {} {} {}\n", g.0, g.1, g.2, b.0, b.1, b.2);
        let mut files = Vec::new();
        for (i, arg) in args.iter().enumerate() {
            match arg {
                Arg::Buf(bytes) | Arg::Shifted(bytes, _) => {
                    let path = self.dir.path().join(format!("arg{i}.bin"));
                    std::fs::write(&path, &bytes[..]).unwrap();
                    let shift = if let Arg::Shifted(_, shift) = arg { *shift } else { 0 };
                    plan += &format!("buf {} {shift}\n", path.display());
                    files.push((i, path));
                }
                Arg::Same(k) => plan += &format!("same {k}\n"),
                Arg::I32(v) => plan += &format!("i32 {v}\n"),
                Arg::I64(v) => plan += &format!("i64 {v}\n"),
                Arg::F32(v) => plan += &format!("f32 {v:e}\n"),
            }
        }
        let plan_path = self.dir.path().join("plan.txt");
        std::fs::write(&plan_path, plan).unwrap();
        let status = Command::new(&self.exe).arg(&plan_path).status().unwrap();
        assert!(status.success(), "emulated {entry}");
        for (i, path) in files {
            let (Arg::Buf(bytes) | Arg::Shifted(bytes, _)) = &mut args[i] else { unreachable!() };
            bytes.copy_from_slice(&std::fs::read(&path).unwrap());
        }
    }
}

/// The entry-point suffix of storage type `E` (`<op>_f32`, `_bf16`, `_f16`), as the backend
/// names it.
fn suffix<E: Elem>() -> &'static str {
    DTYPES.iter().find(|(name, _)| *name == E::NAME).map(|&(_, suffix)| suffix).expect("a storage type with kernels")
}

fn random<E: Elem>(rng: &mut Rng, n: usize, scale: f32) -> Vec<E> {
    (0..n).map(|_| E::from_f32(rng.normal() as f32 * scale)).collect()
}

/// `got` against `want` elementwise: within `rel` of the magnitude each element's sum was
/// made of (`scale`), plus one rounding of the storage type of the value itself.
fn close<E: Elem>(what: &str, got: &[E], want: &[E], scale: &[f64], rel: f64, ulp: f64) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, ((g, w), s)) in got.iter().zip(want).zip(scale).enumerate() {
        let (g, w) = (g.to_f32() as f64, w.to_f32() as f64);
        let bound = rel * s + ulp * w.abs() + 1e-7;
        assert!((g - w).abs() <= bound, "{what}[{i}]: {g} vs {w} (bound {bound:e})");
    }
}

/// Attention inputs qkv (B,T,3C), with q and k scaled up so some rows' softmax is peaked, some
/// flat.
fn peaked_qkv<E: Elem>(rng: &mut Rng, b: usize, t: usize, c: usize) -> Vec<E> {
    (0..b * t * 3 * c).map(|i| E::from_f32(rng.normal() as f32 * if i % (3 * c) < 2 * c { 1.6 } else { 1.0 })).collect()
}

/// Element `d` of head `h` of part `which` (0 q, 1 k, 2 v) of token `ti` of sequence `bi` in
/// qkv (B,T,3C), in f64.
fn qkv_reader<E: Elem>(
    qkv: &[E],
    t: usize,
    c: usize,
    hs: usize,
) -> impl Fn(usize, usize, usize, usize, usize) -> f64 + '_ {
    move |bi, ti, which, h, d| qkv[(bi * t + ti) * 3 * c + which * c + h * hs + d].to_f32() as f64
}

/// The fused attention forward against `layers::attention_forward` for one storage type and
/// shape: lse within f32 rounding, each output within two roundings of the storage type of
/// Σ p·|v| (both round the probabilities to it; the kernel before normalising them).
fn flash_forward_matches_the_reference<E: Elem>(
    attention: &Emulated,
    (b, t, nh, hs): (usize, usize, usize, usize),
    eps: f64,
) {
    let c = nh * hs;
    let mut qkv: Vec<E> = peaked_qkv(&mut Rng::new(11 + t as u64), b, t, c);
    let dt = suffix::<E>();
    let mut got = vec![E::from_f32(f32::NAN); b * t * c];
    let mut got_lse = vec![f32::NAN; b * nh * t];
    let cfg = flash_blocks(b, t, nh);
    let scale = 1.0 / (hs as f32).sqrt();
    let mut args = [buf(&mut got), buf(&mut got_lse), buf(&mut qkv), int(b), int(t), int(nh), Arg::F32(scale)];
    attention.launch(&format!("flash_attention_forward_hs{hs}_{dt}"), cfg, &mut args);

    let mut want = vec![E::default(); b * t * c];
    let mut want_lse = vec![0f32; b * nh * t];
    let mut scratch = vec![0f32; layers::attention_forward_scratch::<E>(b, t, c, nh)];
    layers::attention_forward(&mut want, &mut want_lse, &qkv, &mut scratch, b, t, c, nh);

    let at = qkv_reader(&qkv, t, c, hs);
    let mut magnitude = vec![0f64; b * t * c];
    for bi in 0..b {
        for h in 0..nh {
            for ti in 0..t {
                let row = (bi * nh + h) * t + ti;
                let (g, w) = (got_lse[row] as f64, want_lse[row] as f64);
                assert!((g - w).abs() <= 1e-5 * (1.0 + w.abs()), "lse[{bi},{h},{ti}] {dt}: {g} vs {w}");
                // p from the reference's lse, in f64
                let p: Vec<f64> = (0..=ti)
                    .map(|k| {
                        let s: f64 = (0..hs).map(|d| at(bi, ti, 0, h, d) * at(bi, k, 1, h, d)).sum();
                        (s / (hs as f64).sqrt() - w).exp()
                    })
                    .collect();
                for d in 0..hs {
                    magnitude[(bi * t + ti) * c + h * hs + d] =
                        p.iter().enumerate().map(|(k, p)| p * at(bi, k, 2, h, d).abs()).sum();
                }
            }
        }
    }
    close(&format!("out {dt}"), &got, &want, &magnitude, 4.0 * eps, 0.0);
}

/// (B, T, NH, HS) for the fused attention kernels. T 80 and 130: a last block of queries (and of
/// keys) partly past T, a step of keys past T, several key steps; T 1: one token (every other
/// row of its block past T); T 64: exactly one block.
const FLASH_SHAPES: [(usize, usize, usize, usize); 4] =
    [(2, 80, 2, 64), (1, 130, 3, 32), (1, 1, 2, 64), (2, 64, 1, 32)];

#[test]
fn the_fused_attention_forward_kernel_matches_the_cpu_reference() {
    let Some(attention) = Emulated::build("attention") else { return };
    for shape in FLASH_SHAPES {
        flash_forward_matches_the_reference::<half::bf16>(&attention, shape, 1.0 / 256.0);
        flash_forward_matches_the_reference::<half::f16>(&attention, shape, 1.0 / 2048.0);
    }
}

/// The fused attention backward — its dq kernel (which also writes each row's D = Σ p·datt)
/// then its dk/dv kernel, launched as the backend launches them — against
/// `layers::attention_backward` for one storage type and shape. Both round p and ds to the
/// storage type, so a value near a rounding boundary may round apart: each gradient is held
/// within four roundings of the magnitudes its sum is made of (ds's error scales with
/// p · (|datt| + Σ p·|datt|), not with ds, which is a difference), plus its own rounding.
fn flash_backward_matches_the_reference<E: Elem>(
    attention: &Emulated,
    (b, t, nh, hs): (usize, usize, usize, usize),
    eps: f64,
) {
    let c = nh * hs;
    let mut rng = Rng::new(23 + t as u64);
    let mut qkv: Vec<E> = peaked_qkv(&mut rng, b, t, c);
    let mut dout: Vec<E> = random(&mut rng, b * t * c, 1.0);
    let mut out = vec![E::default(); b * t * c];
    let mut lse = vec![0f32; b * nh * t];
    let mut scratch = vec![0f32; layers::attention_forward_scratch::<E>(b, t, c, nh)];
    layers::attention_forward(&mut out, &mut lse, &qkv, &mut scratch, b, t, c, nh);
    let mut want = vec![E::default(); b * t * 3 * c];
    let mut scratch = vec![0f32; layers::attention_backward_scratch::<E>(b, t, c, nh)];
    layers::attention_backward(&mut want, &mut scratch, &dout, &qkv, &lse, b, t, c, nh);

    let dt = suffix::<E>();
    let mut got = vec![E::from_f32(f32::NAN); b * t * 3 * c];
    let mut delta = vec![f32::NAN; b * nh * t];
    let cfg = flash_blocks(b, t, nh);
    let scale = 1.0 / (hs as f32).sqrt();
    let dims = || [int(b), int(t), int(nh), Arg::F32(scale)];
    let mut args = vec![buf(&mut got), buf(&mut delta), buf(&mut dout), buf(&mut qkv), buf(&mut lse)];
    args.extend(dims());
    attention.launch(&format!("flash_attention_backward_dq_hs{hs}_{dt}"), cfg, &mut args);
    let mut args = vec![buf(&mut got), buf(&mut dout), buf(&mut qkv), buf(&mut lse), buf(&mut delta)];
    args.extend(dims());
    attention.launch(&format!("flash_attention_backward_dkv_hs{hs}_{dt}"), cfg, &mut args);

    // In f64 from the same inputs: p as the reference rounds it, datt, D, and the magnitudes.
    let x = qkv_reader(&qkv, t, c, hs);
    let dy = |bi: usize, ti: usize, h: usize, d: usize| dout[(bi * t + ti) * c + h * hs + d].to_f32() as f64;
    let mut magnitude = vec![0f64; b * t * 3 * c];
    for bi in 0..b {
        for h in 0..nh {
            for i in 0..t {
                let row = (bi * nh + h) * t + i;
                let (p, datt): (Vec<f64>, Vec<f64>) = (0..=i)
                    .map(|j| {
                        let s: f64 = (0..hs).map(|d| x(bi, i, 0, h, d) * x(bi, j, 1, h, d)).sum();
                        let p = E::from_f32((s * scale as f64 - lse[row] as f64).exp() as f32).to_f32() as f64;
                        (p, (0..hs).map(|d| dy(bi, i, h, d) * x(bi, j, 2, h, d)).sum::<f64>())
                    })
                    .unzip();
                let d: f64 = p.iter().zip(&datt).map(|(p, a)| p * a).sum();
                let d_abs: f64 = p.iter().zip(&datt).map(|(p, a)| p * a.abs()).sum();
                let got_d = delta[row] as f64;
                assert!((got_d - d).abs() <= 4.0 * eps * d_abs + 1e-6, "delta[{bi},{h},{i}] {dt}: {got_d} vs {d}");
                for j in 0..=i {
                    let ds = p[j] * (datt[j].abs() + d_abs) * scale as f64;
                    for dd in 0..hs {
                        let at = |ti: usize, which: usize| (bi * t + ti) * 3 * c + which * c + h * hs + dd;
                        magnitude[at(i, 0)] += ds * x(bi, j, 1, h, dd).abs();
                        magnitude[at(j, 1)] += ds * x(bi, i, 0, h, dd).abs();
                        magnitude[at(j, 2)] += p[j] * dy(bi, i, h, dd).abs();
                    }
                }
            }
        }
    }
    close(&format!("dqkv {dt}"), &got, &want, &magnitude, 4.0 * eps, 2.0 * eps);
}

#[test]
fn the_fused_attention_backward_kernels_match_the_cpu_reference() {
    let Some(attention) = Emulated::build("attention") else { return };
    for shape in FLASH_SHAPES {
        flash_backward_matches_the_reference::<half::bf16>(&attention, shape, 1.0 / 256.0);
        flash_backward_matches_the_reference::<half::f16>(&attention, shape, 1.0 / 2048.0);
    }
}

/// The cuda layernorm_backward — its row kernel, the banded partial column sums of the weight
/// and bias gradients and the pass adding them — launched as the backend launches them,
/// against `layers::layernorm_backward`. 600 rows: three bands of 256, the last short; C 77: a
/// partial block of 32 columns, the row kernel element by element; C 264: its 16-byte packs,
/// more than a warp's worth of them in 16-bit storage.
fn layernorm_backward_matches_the_reference<E: Elem>(layernorm: &Emulated, residual: &Emulated, eps: f64, c: usize) {
    let n = 600;
    let dt = suffix::<E>();
    let mut rng = Rng::new(21);
    let (inp, weight, bias) =
        (random::<E>(&mut rng, n * c, 2.0), random::<E>(&mut rng, c, 1.0), random::<E>(&mut rng, c, 0.5));
    let (dout, dinp0, dw0, db0) = (
        random::<E>(&mut rng, n * c, 1.0),
        random::<E>(&mut rng, n * c, 1.0),
        random::<E>(&mut rng, c, 1.0),
        random::<E>(&mut rng, c, 1.0),
    );
    let (mut out, mut mean, mut rstd) = (vec![E::default(); n * c], vec![0f32; n], vec![0f32; n]);
    layers::layernorm_forward(&mut out, &mut mean, &mut rstd, &inp, &weight, &bias, c);
    let (mut want_dinp, mut want_dw, mut want_db) = (dinp0.clone(), dw0.clone(), db0.clone());
    layers::layernorm_backward(&mut want_dinp, &mut want_dw, &mut want_db, &dout, &inp, &weight, &mean, &rstd, c);

    let (mut dinp, mut dw, mut db) = (dinp0.clone(), dw0.clone(), db0.clone());
    let (mut dout, mut inp, mut weight) = (dout, inp, weight);
    let mut args = [
        buf(&mut dinp),
        buf(&mut dout),
        buf(&mut inp),
        buf(&mut weight),
        buf(&mut mean),
        buf(&mut rstd),
        int(n),
        int(c),
    ];
    layernorm.launch(&format!("layernorm_backward_{dt}"), warp_rows(n), &mut args);
    let bands = cuda_column_bands(n);
    assert_eq!(bands, 3);
    let (mut pw, mut pb) = (vec![f32::NAN; bands * c], vec![f32::NAN; bands * c]);
    let mut args = [
        buf(&mut pw),
        buf(&mut pb),
        buf(&mut dout),
        buf(&mut inp),
        buf(&mut mean),
        buf(&mut rstd),
        int(n),
        int(c),
        int(n.div_ceil(bands)),
    ];
    layernorm.launch(&format!("layernorm_param_backward_partial_{dt}"), column_sums(c, bands, E::BYTES), &mut args);
    for (dst, partial) in [(&mut dw, &mut pw), (&mut db, &mut pb)] {
        let mut args = [buf(dst), buf(partial), int(bands), int(c)];
        residual.launch(&format!("column_partials_add_{dt}"), elementwise(c), &mut args);
    }

    // Magnitudes: a row's input gradient is made of terms of |dout·w|·rstd; a column's
    // parameter gradients of every row's |norm·dout| and |dout|.
    let f = |v: &E| v.to_f32() as f64;
    let norm = |r: usize, i: usize| (f(&inp[r * c + i]) - mean[r] as f64) * rstd[r] as f64;
    let dinp_scale: Vec<f64> = (0..n * c)
        .map(|x| {
            let r = x / c;
            let row: f64 = (0..c).map(|i| (f(&weight[i]) * f(&dout[r * c + i])).abs() * (1.0 + norm(r, i).abs())).sum();
            f(&dinp0[x]).abs() + (row / c as f64 + (f(&weight[x % c]) * f(&dout[x])).abs()) * rstd[r] as f64 * 3.0
        })
        .collect();
    let dw_scale: Vec<f64> = (0..c)
        .map(|i| f(&dw0[i]).abs() + (0..n).map(|r| (norm(r, i) * f(&dout[r * c + i])).abs()).sum::<f64>())
        .collect();
    let db_scale: Vec<f64> =
        (0..c).map(|i| f(&db0[i]).abs() + (0..n).map(|r| f(&dout[r * c + i]).abs()).sum::<f64>()).collect();
    close(&format!("dinp {dt}"), &dinp, &want_dinp, &dinp_scale, 1e-5, eps);
    close(&format!("dweight {dt}"), &dw, &want_dw, &dw_scale, 1e-5, eps);
    close(&format!("dbias {dt}"), &db, &want_db, &db_scale, 1e-5, eps);
}

#[test]
fn the_layernorm_backward_kernels_match_the_cpu_reference() {
    let (Some(layernorm), Some(residual)) = (Emulated::build("layernorm"), Emulated::build("residual")) else { return };
    for c in [77, 264] {
        layernorm_backward_matches_the_reference::<f32>(&layernorm, &residual, 0.0, c);
        layernorm_backward_matches_the_reference::<half::bf16>(&layernorm, &residual, 2.0 / 256.0, c);
        layernorm_backward_matches_the_reference::<half::f16>(&layernorm, &residual, 2.0 / 2048.0, c);
    }
}

/// The cuda bias gradient — banded partial column sums of dout, then the pass adding them to
/// the stored gradient — launched as `matmul_backward` launches them, against
/// `layers::matmul_backward`'s.
fn bias_gradient_matches_the_reference<E: Elem>(residual: &Emulated, eps: f64, oc: usize) {
    let (n, c) = (600, 3);
    let dt = suffix::<E>();
    let mut rng = Rng::new(31);
    let (inp, weight, mut dout, db0) = (
        random::<E>(&mut rng, n * c, 1.0),
        random::<E>(&mut rng, oc * c, 1.0),
        random::<E>(&mut rng, n * oc, 1.0),
        random::<E>(&mut rng, oc, 1.0),
    );
    let (mut dinp, mut dw, mut want) = (vec![E::default(); n * c], vec![E::default(); oc * c], db0.clone());
    let mut scratch = vec![0f32; layers::matmul_backward_scratch::<E>(n, c, oc)];
    layers::matmul_backward(&mut dinp, &mut dw, Some(&mut want), &dout, &inp, &weight, n, c, oc, &mut scratch);

    let bands = cuda_column_bands(n);
    let mut partial = vec![f32::NAN; bands * oc];
    let mut args = [buf(&mut partial), buf(&mut dout), int(n), int(oc), int(n.div_ceil(bands))];
    residual.launch(&format!("bias_backward_partial_{dt}"), column_sums(oc, bands, E::BYTES), &mut args);
    let mut db = db0.clone();
    let mut args = [buf(&mut db), buf(&mut partial), int(bands), int(oc)];
    residual.launch(&format!("column_partials_add_{dt}"), elementwise(oc), &mut args);
    let f = |v: &E| v.to_f32() as f64;
    let scale: Vec<f64> =
        (0..oc).map(|o| f(&db0[o]).abs() + (0..n).map(|r| f(&dout[r * oc + o]).abs()).sum::<f64>()).collect();
    close(&format!("dbias {dt}"), &db, &want, &scale, 1e-5, eps);
}

#[test]
fn the_bias_gradient_kernels_match_the_cpu_reference() {
    let Some(residual) = Emulated::build("residual") else { return };
    // OC 77: columns one by one; OC 520: 16-byte packs, past one block's 32 packs.
    for oc in [77, 520] {
        bias_gradient_matches_the_reference::<f32>(&residual, 0.0, oc);
        bias_gradient_matches_the_reference::<half::bf16>(&residual, 2.0 / 256.0, oc);
        bias_gradient_matches_the_reference::<half::f16>(&residual, 2.0 / 2048.0, oc);
    }
}

/// The causal softmax kernels around the cuBLAS attention products, launched as
/// `softmax_rows` launches them over a chunk's (rows, T) scores: forward's probabilities and
/// lse against their definition in f64, backward's recompute bitwise equal to forward's, and the
/// softmax backward — in place over the probabilities, as the backend runs it — against its
/// definition from those probabilities.
fn causal_softmax_matches_its_definition<E: Elem>(attention: &Emulated, eps: f64, t: usize) {
    // 3 heads of T 45 (element by element) or 264 (16-byte packs, more of them than a warp has
    // lanes): rows past a warp's 32 lanes, and every causal length 1..=T.
    let heads = 3;
    let rows = heads * t;
    let dt = suffix::<E>();
    let scale = 0.3f32;
    let mut rng = Rng::new(41);
    let mut scores: Vec<f32> = (0..rows * t).map(|_| rng.normal() as f32 * 4.0).collect();
    let mut datt: Vec<f32> = (0..rows * t).map(|_| rng.normal() as f32).collect();
    let (mut att, mut lse) = (vec![E::from_f32(f32::NAN); rows * t], vec![f32::NAN; rows]);
    let mut args = [buf(&mut att), buf(&mut lse), buf(&mut scores), Arg::F32(scale), int(rows), int(t)];
    attention.launch(&format!("softmax_causal_forward_{dt}"), warp_rows(rows), &mut args);
    for r in 0..rows {
        let (row, last) = (&scores[r * t..(r + 1) * t], r % t);
        let s = |i: usize| row[i] as f64 * scale as f64;
        let max = (0..=last).map(s).fold(f64::NEG_INFINITY, f64::max);
        let want = max + (0..=last).map(|i| (s(i) - max).exp()).sum::<f64>().ln();
        assert!((lse[r] as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()), "lse[{r}] {dt}: {} vs {want}", lse[r]);
        for i in 0..t {
            let (got, p) = (att[r * t + i].to_f32() as f64, if i <= last { (s(i) - want).exp() } else { 0.0 });
            assert!((got - p).abs() <= eps * p + 1e-6, "att[{r},{i}] {dt}: {got} vs {p}");
        }
    }
    let mut again = vec![E::from_f32(f32::NAN); rows * t];
    let mut args = [buf(&mut again), buf(&mut scores), buf(&mut lse), Arg::F32(scale), int(rows), int(t)];
    attention.launch(&format!("softmax_causal_probs_{dt}"), warp_rows(rows), &mut args);
    let bits = |v: &[E]| bytemuck::cast_slice::<E, u8>(v).to_vec();
    assert!(bits(&again) == bits(&att), "{dt}: backward's recomputed probabilities differ from forward's");

    let probs = att.clone();
    let mut args = [buf(&mut att), buf(&mut datt), Arg::Same(0), Arg::F32(scale), int(rows), int(t)];
    attention.launch(&format!("softmax_causal_backward_{dt}"), warp_rows(rows), &mut args);
    for r in 0..rows {
        let last = r % t;
        let p = |i: usize| probs[r * t + i].to_f32() as f64;
        let d = |i: usize| datt[r * t + i] as f64;
        let dot: f64 = (0..=last).map(|i| p(i) * d(i)).sum();
        let magnitude: f64 = (0..=last).map(|i| (p(i) * d(i)).abs()).sum();
        for i in 0..t {
            let want = if i <= last { p(i) * (d(i) - dot) * scale as f64 } else { 0.0 };
            let got = att[r * t + i].to_f32() as f64;
            let bound = eps * want.abs() + 1e-6 * (1.0 + p(i) * magnitude);
            assert!((got - want).abs() <= bound, "dpreatt[{r},{i}] {dt}: {got} vs {want} (bound {bound:e})");
        }
    }
}

#[test]
fn the_causal_softmax_kernels_match_their_definition() {
    let Some(attention) = Emulated::build("attention") else { return };
    for t in [45, 264] {
        causal_softmax_matches_its_definition::<f32>(&attention, 1e-5, t);
        causal_softmax_matches_its_definition::<half::bf16>(&attention, 1.0 / 256.0, t);
        causal_softmax_matches_its_definition::<half::f16>(&attention, 1.0 / 2048.0, t);
    }
}

/// The element-wise and row kernels with a per-element CPU twin — GELU, the token and position
/// embedding (its backward bit for bit), the softmax cross-entropy — launched as the backend
/// launches them, against `layers`.
fn elementwise_kernels_match_the_reference<E: Elem>(families: &Families, eps: f64) {
    let dt = suffix::<E>();
    let mut rng = Rng::new(51);
    let f = |v: &E| v.to_f32() as f64;

    // GELU forward and backward (in place over dout), N not a multiple of the block or of a
    // pack; on aligned arrays (16-byte packs) and on arrays one element off (element by element).
    let n = 1003;
    let (inp0, dinout0) = (random::<E>(&mut rng, n, 3.0), random::<E>(&mut rng, n, 1.0));
    let (mut want, mut want_d) = (vec![E::default(); n], dinout0.clone());
    layers::gelu_forward(&mut want, &inp0);
    layers::gelu_backward_inplace(&mut want_d, &inp0);
    for shift in [0, 1] {
        let (mut inp, mut dinout) = (inp0.clone(), dinout0.clone());
        let mut out = vec![E::from_f32(f32::NAN); n];
        let mut args = [shifted(&mut out, shift), shifted(&mut inp, shift), Arg::I64(n as i64)];
        families.gelu.launch(&format!("gelu_forward_{dt}"), packed(n, E::BYTES), &mut args);
        let scale: Vec<f64> = inp.iter().map(|x| f(x).abs()).collect();
        close(&format!("gelu {dt} shift {shift}"), &out, &want, &scale, 1e-6, eps);
        // gelu' from tanh: the CPU's polynomial and the device's tanhf differ by ~4e-7.
        let scale: Vec<f64> = dinout.iter().zip(&inp).map(|(d, x)| f(d).abs() * (1.0 + f(x).abs())).collect();
        let mut args = [shifted(&mut dinout, shift), shifted(&mut inp, shift), Arg::I64(n as i64)];
        families.gelu.launch(&format!("gelu_backward_{dt}"), packed(n, E::BYTES), &mut args);
        close(&format!("gelu backward {dt} shift {shift}"), &dinout, &want_d, &scale, 1e-5, eps);
    }

    // Embedding forward: 3 sequences of T 20 over a vocabulary of 7.
    let (b, t, c, v) = (3, 20, 24, 7);
    let mut tokens: Vec<u32> = (0..b * t).map(|i| (i * 5 % v) as u32).collect();
    let (mut wte, mut wpe) = (random::<E>(&mut rng, v * c, 1.0), random::<E>(&mut rng, t * c, 1.0));
    let mut want = vec![E::default(); b * t * c];
    layers::encoder_forward(&mut want, &tokens, &wte, &wpe, t, c);
    let mut out = vec![E::from_f32(f32::NAN); b * t * c];
    let mut args = [buf(&mut out), buf(&mut tokens), buf(&mut wte), buf(&mut wpe), int(b * t), int(t), int(c)];
    families.encoder.launch(&format!("encoder_forward_{dt}"), elementwise(b * t * c), &mut args);
    let scale: Vec<f64> = want.iter().map(|x| f(x).abs()).collect();
    close(&format!("encoder {dt}"), &out, &want, &scale, 1e-6, eps);
    encoder_backward_matches_the_reference::<E>(families, &mut rng);

    // Softmax cross-entropy over rows of V logits in rows VP wide (padding columns, random on
    // entry, must come out 0): V 1000 (past a block's 512 threads; VP 1024, in 16-byte packs,
    // the vocabulary ending on a pack's edge), V 1001 (ending inside a pack), V 5001 (past
    // 512 threads' packs: the loop comes round), V 100 in VP 124 (threads with no element; in
    // 16-bit storage element by element, 124 not a multiple of 8): the probabilities
    // (evaluation), then on the same logits the gradient made with the loss (training). Row 0
    // rises steadily, so every thread's running maximum grows at each step (its sum rescaled).
    for (v, vp) in [(1000, 1024), (1001, 1024), (5001, 5056), (100, 124)] {
        let rows = 5;
        let mut logits = random::<E>(&mut rng, rows * vp, 3.0);
        for (i, x) in logits[..v].iter_mut().enumerate() {
            *x = E::from_f32(i as f32 * 8.0 / v as f32);
        }
        let mut targets: Vec<u32> = (0..rows).map(|r| (r * 211 % v) as u32).collect();
        let dloss = 0.25f32;
        let (mut want_p, mut want_d, mut want_losses) = (logits.clone(), logits.clone(), vec![0f32; rows]);
        layers::crossentropy_forward(&mut want_p, &mut want_losses, &targets, v, vp);
        layers::crossentropy_forward_backward(&mut want_d, &mut vec![0f32; rows], &targets, dloss, v, vp);
        assert!(want_d.chunks(vp).all(|row| row[v..].iter().all(|x| x.to_f32() == 0.0)), "the reference's padding");
        let mut d = logits.clone();
        let mut losses = vec![f32::NAN; rows];
        let mut args = [buf(&mut logits), buf(&mut losses), buf(&mut targets), int(rows), int(v), int(vp)];
        families.classifier.launch(&format!("crossentropy_forward_{dt}"), block_rows(rows), &mut args);
        let check_losses = |losses: &[f32], what: &str| {
            for (r, (g, w)) in losses.iter().zip(&want_losses).enumerate() {
                assert!((g - w).abs() <= 1e-5 * (1.0 + w.abs()), "{what} loss[{r}] {dt} V {v}: {g} vs {w}");
            }
        };
        check_losses(&losses, "forward");
        close(&format!("probabilities {dt} V {v}"), &logits, &want_p, &vec![1.0; rows * vp], 1e-6, eps);
        let mut losses = vec![f32::NAN; rows];
        let mut args = [buf(&mut d), buf(&mut losses), buf(&mut targets), Arg::F32(dloss), int(rows), int(v), int(vp)];
        families.classifier.launch(&format!("crossentropy_forward_backward_{dt}"), block_rows(rows), &mut args);
        check_losses(&losses, "forward_backward");
        close(&format!("dlogits {dt} V {v}"), &d, &want_d, &vec![dloss as f64; rows * vp], 1e-6, eps);
    }
}

struct Families {
    gelu: Emulated,
    encoder: Emulated,
    classifier: Emulated,
}

#[test]
fn the_gelu_embedding_and_cross_entropy_kernels_match_the_cpu_reference() {
    let (Some(gelu), Some(encoder), Some(classifier)) =
        (Emulated::build("gelu"), Emulated::build("encoder"), Emulated::build("classifier"))
    else {
        return;
    };
    let families = Families { gelu, encoder, classifier };
    elementwise_kernels_match_the_reference::<f32>(&families, 0.0);
    elementwise_kernels_match_the_reference::<half::bf16>(&families, 2.0 / 256.0);
    elementwise_kernels_match_the_reference::<half::f16>(&families, 2.0 / 2048.0);
}

/// AdamW over fp32 master weights from gradients in the storage type — the compute copy
/// written in the same pass (in place over the master in f32, as the backend passes it) — and
/// the gradient norm's per-block partial sums, against `optim`.
fn optimizer_kernels_match_the_reference<E: Elem>(adamw: &Emulated, norm: &Emulated, eps: f64) {
    let dt = suffix::<E>();
    // Not a multiple of a pack; on aligned arrays (16-byte packs) and one element off.
    let n = 1003;
    let mut rng = Rng::new(61);
    let master0: Vec<f32> = (0..n).map(|_| rng.normal() as f32).collect();
    let grads0 = random::<E>(&mut rng, n, 0.1);
    let m0: Vec<f32> = (0..n).map(|_| rng.normal() as f32 * 0.01).collect();
    let v0: Vec<f32> = (0..n).map(|_| (rng.normal() as f32 * 0.01).powi(2)).collect();
    let step = AdamW { lr: 1e-3, weight_decay: 0.1, t: 7 };
    let grad_mult = 0.5f32;
    let (mut want_w, mut want_m, mut want_v) = (master0.clone(), m0.clone(), v0.clone());
    step.update::<E>([(0..n, true)], &mut want_w, &grads0, grad_mult, &mut want_m, &mut want_v);
    let (bc1, bc2) = step.bias_corrections();
    for shift in [0, 1] {
        let (mut master, mut grads, mut m, mut v) = (master0.clone(), grads0.clone(), m0.clone(), v0.clone());
        let mut params = vec![E::from_f32(f32::NAN); n];
        let scalars = [step.lr, BETA1, BETA2, EPS, step.weight_decay, bc1, bc2, grad_mult].map(Arg::F32);
        let mut args: Vec<Arg> = vec![shifted(&mut master, shift)];
        args.push(if E::is_f32() { Arg::Same(0) } else { shifted(&mut params, shift) });
        args.extend([shifted(&mut grads, shift), shifted(&mut m, shift), shifted(&mut v, shift), Arg::I64(n as i64)]);
        args.extend(scalars);
        adamw.launch(&format!("adamw_{dt}"), packed(n, E::BYTES), &mut args);
        drop(args);
        let near = |what: &str, got: &[f32], want: &[f32]| {
            for (i, (g, w)) in got.iter().zip(want).enumerate() {
                assert!((g - w).abs() <= 1e-6 * (1.0 + w.abs()), "{what}[{i}] {dt} shift {shift}: {g} vs {w}");
            }
        };
        near("master", &master, &want_w);
        near("m", &m, &want_m);
        near("v", &v, &want_v);
        if !E::is_f32() {
            let narrowed: Vec<E> = want_w.iter().map(|&w| E::from_f32(w)).collect();
            let scale: Vec<f64> = want_w.iter().map(|w| w.abs() as f64).collect();
            close(&format!("params {dt} shift {shift}"), &params, &narrowed, &scale, 1e-6, eps);
        }
    }

    // The norm: 300,000 elements, more than the most blocks' threads (1024 × 256) cover in one
    // sweep, so the grid-stride loop comes round again.
    let n = 300_000;
    assert!(n > cuda_norm_blocks(n) * CUDA_THREADS);
    let mut x = random::<E>(&mut rng, n, 1.0);
    let blocks = cuda_norm_blocks(n);
    let mut partial = vec![f32::NAN; blocks];
    let cfg =
        LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (CUDA_THREADS as u32, 1, 1), shared_mem_bytes: 0 };
    let mut args = [buf(&mut partial), buf(&mut x), Arg::I64(n as i64)];
    norm.launch(&format!("sum_squares_{dt}"), cfg, &mut args);
    let (got, want) = (partial.iter().map(|&p| p as f64).sum::<f64>(), optim::sum_squares(&x));
    assert!((got - want).abs() <= 1e-5 * want, "sum of squares {dt}: {got} vs {want}");
}

#[test]
fn the_adamw_and_norm_kernels_match_the_cpu_reference() {
    let (Some(adamw), Some(norm)) = (Emulated::build("adamw"), Emulated::build("norm")) else { return };
    optimizer_kernels_match_the_reference::<f32>(&adamw, &norm, 0.0);
    optimizer_kernels_match_the_reference::<half::bf16>(&adamw, &norm, 2.0 / 256.0);
    optimizer_kernels_match_the_reference::<half::f16>(&adamw, &norm, 2.0 / 2048.0);
}

/// The storage casts (`widen` / `narrow` on cuda) against `Elem`'s conversions, bit for bit:
/// every 16-bit pattern widened, and f32 values narrowed — ties, rounding carries into the
/// exponent, overflow, subnormals, infinities and NaNs among them.
fn casts_match_elem_bit_for_bit<E: Elem>(cast: &Emulated) {
    let dt = suffix::<E>();
    let mut words: Vec<u16> = (0..=u16::MAX).collect();
    let n = words.len();
    // In 16-byte packs, and (one element off) element by element.
    for shift in [0, 1] {
        let mut wide = vec![f32::NAN; n];
        let mut args = [shifted(&mut wide, shift), shifted(&mut words, shift), Arg::I64(n as i64)];
        cast.launch(&format!("cast_{dt}_to_f32"), packed(n, E::BYTES), &mut args);
        for (w, got) in words.iter().zip(&wide) {
            let want = bytemuck::cast::<u16, E>(*w).to_f32();
            let same = got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan());
            assert!(same, "{dt} {w:#06x} shift {shift}: {got} vs {want}");
        }
    }
    let mut rng = Rng::new(71);
    let mut values: Vec<f32> =
        (0..20_000).map(|_| (rng.normal() * 10f64.powi((rng.normal() * 6.0) as i32)) as f32).collect();
    // Exact ties and near-ties of both types, and the edges.
    values.extend(
        (0..2000u32)
            .flat_map(|i| [0x3f80_8000 + (i << 16), 0x3f80_1000 + (i << 13), 0x3f80_0fff + (i << 13)])
            .map(f32::from_bits),
    );
    values.extend([
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        f32::MAX,
        f32::MIN_POSITIVE,
        1e-42,
        65519.0,
        65520.0,
        6e-8,
        3e-8,
    ]);
    let n = values.len();
    assert_ne!(n % 8, 0, "a partial last pack");
    let mut narrow = vec![E::from_f32(f32::NAN); n];
    let mut args = [buf(&mut narrow), buf(&mut values), Arg::I64(n as i64)];
    cast.launch(&format!("cast_f32_to_{dt}"), packed(n, E::BYTES), &mut args);
    for (x, got) in values.iter().zip(&narrow) {
        let want = E::from_f32(*x);
        let (g, w) = (bytemuck::cast::<E, u16>(*got), bytemuck::cast::<E, u16>(want));
        assert!(
            g == w || (got.to_f32().is_nan() && want.to_f32().is_nan()),
            "{dt} {x:e} ({:#010x}): {g:#06x} vs {w:#06x}",
            x.to_bits()
        );
    }
}

#[test]
fn the_cast_kernels_convert_as_the_cpu_does() {
    let Some(cast) = Emulated::build("cast") else { return };
    casts_match_elem_bit_for_bit::<half::bf16>(&cast);
    casts_match_elem_bit_for_bit::<half::f16>(&cast);
}

/// Incremental decoding — the new tokens' keys and values appended to the cache, then each new
/// token attending to every cached position up to its own — launched as `attention_cached`
/// launches it, against `layers::attention_cached`.
fn cached_attention_matches_the_reference<E: Elem>(attention: &Emulated, eps: f64) {
    use crate::engine::backend::layers::CachedAttention;
    let dt = suffix::<E>();
    let d = CachedAttention { b: 2, tn: 3, start: 37, context: 48, c: 64, nh: 4 };
    let (hs, mut rng) = (d.c / d.nh, Rng::new(81));
    let mut cache = random::<E>(&mut rng, 2 * d.b * d.context * d.c, 1.0);
    let mut qkv = random::<E>(&mut rng, d.b * d.tn * 3 * d.c, 1.5);
    let (mut want, mut want_cache) = (vec![E::default(); d.b * d.tn * d.c], cache.clone());
    let mut scratch = vec![0f32; layers::attention_cached_scratch(d.b, d.context, d.nh)];
    layers::attention_cached(&mut want, &mut want_cache, &qkv, &mut scratch, d);

    let mut args = [buf(&mut cache), buf(&mut qkv), int(d.b), int(d.tn), int(d.start), int(d.context), int(d.c)];
    attention.launch(&format!("kv_append_{dt}"), elementwise(d.b * d.tn * d.c), &mut args);
    let bits = |v: &[E]| bytemuck::cast_slice::<E, u8>(v).to_vec();
    assert!(bits(&cache) == bits(&want_cache), "{dt}: the appended cache differs");
    let mut out = vec![E::from_f32(f32::NAN); d.b * d.tn * d.c];
    let mut scores = vec![f32::NAN; d.b * d.nh * d.tn * d.context];
    let mut args = [
        buf(&mut out),
        buf(&mut scores),
        buf(&mut cache),
        buf(&mut qkv),
        int(d.b),
        int(d.tn),
        int(d.start),
        int(d.context),
        int(d.nh),
        int(hs),
    ];
    attention.launch(&format!("attention_cached_{dt}"), warp_rows(d.b * d.nh * d.tn), &mut args);
    // Outputs are convex combinations of values: within a few roundings of max |v|.
    let scale = vec![4.0; out.len()];
    close(&format!("cached attention {dt}"), &out, &want, &scale, 1e-5 + eps, eps);
}

#[test]
fn the_cached_attention_kernels_match_the_cpu_reference() {
    let Some(attention) = Emulated::build("attention") else { return };
    cached_attention_matches_the_reference::<f32>(&attention, 0.0);
    cached_attention_matches_the_reference::<half::bf16>(&attention, 2.0 / 256.0);
    cached_attention_matches_the_reference::<half::f16>(&attention, 2.0 / 2048.0);
}

/// int8 transfer packing (activation offload) and 4-bit weight unpacking against `layers`, bit
/// for bit: the same f32 operations in the same order (absmax, absmax / 127, round half away
/// from zero, clamp; q · scale rounded once). Rows of 77 (a warp's stride comes round three
/// times, the last time partly), one row all zeros (scale 1), one whose absmax is its last
/// element, and exact halves of the scale.
/// The embedding's backward on the emulator, bit for bit the CPU reference: the token sort
/// (its launches as the backend plans them) over 5 sequences of T 900 — 4,500 positions, so
/// 8,192 keys: four chunks, strides across chunks and padding — with skewed tokens (a few
/// long runs, many short ones, unused rows, a run ending where the next key is (token, 0)),
/// then the per-token sums and the positions' sums.
fn encoder_backward_matches_the_reference<E: Elem>(families: &Families, rng: &mut Rng) {
    let dt = suffix::<E>();
    let (b, t, c, v) = (5, 900, 24, 61);
    let bt = b * t;
    let mut tokens: Vec<u32> =
        (0..bt).map(|_| ((rng.uniform() * rng.uniform() * 40.0) as u32 + 3) % v as u32).collect();
    tokens[0] = 4; // token 3's run (the longest) ends right before the key (4 << 32 | 0)
    let mut dout = random::<E>(rng, bt * c, 1.0);
    let (dwte0, dwpe0) = (random::<E>(rng, v * c, 1.0), random::<E>(rng, t * c, 1.0));
    let (mut want_wte, mut want_wpe) = (dwte0.clone(), dwpe0.clone());
    layers::encoder_backward(&mut want_wte, &mut want_wpe, &dout, &tokens, t, c);

    let mut keys = vec![u64::MAX - 1; cuda_order_keys(bt)];
    let plan = encoder_order_plan(bt);
    assert!(plan.iter().any(|l| matches!(l, OrderLaunch::Merge { .. })), "strides across chunks run");
    for launch in plan {
        match launch {
            OrderLaunch::Chunks { cfg, chunk } => families.encoder.launch(
                "encoder_order_chunks",
                cfg,
                &mut [buf(&mut keys), buf(&mut tokens), int(bt), int(chunk)],
            ),
            OrderLaunch::Merge { cfg, n, j, k } => {
                families.encoder.launch("encoder_order_merge", cfg, &mut [buf(&mut keys), int(n), int(j), int(k)])
            }
            OrderLaunch::MergeChunks { cfg, chunk, k } => {
                families.encoder.launch("encoder_order_merge_chunk", cfg, &mut [buf(&mut keys), int(chunk), int(k)])
            }
        }
    }
    // The keys: each token's positions together, in order (the CPU's order), then padding.
    let (order, _) = layers::token_order(&tokens, v);
    let sorted: Vec<u64> = order.iter().map(|&p| (u64::from(tokens[p as usize]) << 32) | u64::from(p)).collect();
    assert_eq!(keys[..bt], sorted[..], "encoder order {dt}");
    assert!(keys[bt..].iter().all(|&k| k == u64::MAX), "encoder order {dt}: padding sorts last");

    let (mut dwte, mut dwpe) = (dwte0.clone(), dwpe0.clone());
    let mut args = [buf(&mut dwte), buf(&mut dout), buf(&mut keys), int(bt), int(c)];
    families.encoder.launch(&format!("encoder_backward_wte_{dt}"), elementwise(bt * c), &mut args);
    let mut args = [buf(&mut dwpe), buf(&mut dout), int(b), int(t), int(c)];
    families.encoder.launch(&format!("encoder_backward_wpe_{dt}"), elementwise(t * c), &mut args);
    let bits = |x: &[E]| x.iter().map(|e| e.to_f32().to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&dwte), bits(&want_wte), "encoder dwte {dt}: not the CPU's bits");
    assert_ne!(bits(&dwte), bits(&dwte0), "encoder dwte {dt}: the sums landed");
    assert_eq!(bits(&dwpe), bits(&want_wpe), "encoder dwpe {dt}: not the CPU's bits");
}

fn int8_kernels_match_the_reference<E: Elem>(int8: &Emulated) {
    let dt = suffix::<E>();
    let (rows, c) = (37, 77);
    let mut rng = Rng::new(83);
    let mut x: Vec<E> = random(&mut rng, rows * c, 2.0);
    x[5 * c..6 * c].fill(E::from_f32(0.0));
    // Row 11's largest magnitude in its last column (the warp's last, partial stride), negative.
    x[12 * c - 1] = E::from_f32(-9.0);
    // Row 7: amax 127 (scale 1), so its halves are ties the rounding must break away from 0.
    for (i, v) in x[7 * c..8 * c].iter_mut().enumerate() {
        *v = E::from_f32(if i == 0 { 127.0 } else { (i as f32 - 38.0) + 0.5 });
    }
    let (mut q, mut scales) = (vec![i8::MIN; rows * c], vec![f32::NAN; rows]);
    let mut args = [buf(&mut q), buf(&mut scales), buf(&mut x), int(rows), int(c)];
    int8.launch(&format!("pack_int8_{dt}"), warp_rows(rows), &mut args);
    let (mut want_q, mut want_scales) = (vec![0i8; rows * c], vec![0f32; rows]);
    layers::pack_int8(&mut want_q, &mut want_scales, &x, c);
    assert_eq!(q, want_q, "pack_int8 {dt}: q");
    assert_eq!(bytemuck::cast_slice::<f32, u32>(&scales), bytemuck::cast_slice::<f32, u32>(&want_scales), "{dt}");
    // −36.5 and 38.5: ties, broken away from zero
    assert_eq!((q[7 * c + 1], q[8 * c - 1]), (-37, 39), "pack_int8 {dt}: ties");

    let mut back = vec![E::from_f32(f32::NAN); rows * c];
    let mut args = [buf(&mut back), buf(&mut q), buf(&mut scales), int(rows), int(c)];
    int8.launch(&format!("unpack_int8_{dt}"), elementwise(rows * c), &mut args);
    let mut want = vec![E::default(); rows * c];
    layers::unpack_int8(&mut want, &want_q, &want_scales, c);
    assert_eq!(bytemuck::cast_slice::<E, u8>(&back), bytemuck::cast_slice::<E, u8>(&want), "unpack_int8 {dt}");

    // 4-bit: every byte value, groups of 8 values (4 bytes), each group its own scale.
    let (n, group) = (512, 8);
    let mut packed: Vec<u8> = (0..n / 2).map(|i| i as u8).collect();
    let mut scales: Vec<f32> = (0..n / group).map(|g| 0.01 + 0.37 * g as f32).collect();
    let mut got = vec![E::from_f32(f32::NAN); n];
    let mut args = [buf(&mut got), buf(&mut packed), buf(&mut scales), Arg::I64(n as i64), int(group)];
    int8.launch(&format!("unpack_int4_{dt}"), elementwise(n), &mut args);
    let mut want = vec![E::default(); n];
    layers::unpack_int4(&mut want, &packed, &scales, group);
    assert_eq!(bytemuck::cast_slice::<E, u8>(&got), bytemuck::cast_slice::<E, u8>(&want), "unpack_int4 {dt}");
}

#[test]
fn the_int8_and_int4_kernels_match_the_cpu_reference_bit_for_bit() {
    let Some(int8) = Emulated::build("int8") else { return };
    int8_kernels_match_the_reference::<f32>(&int8);
    int8_kernels_match_the_reference::<half::bf16>(&int8);
    int8_kernels_match_the_reference::<half::f16>(&int8);
}

/// The cuBLAS attention path's head permutes against their definitions, bit for bit: qkv
/// (B,T,3,NH,HS) split into q, k, v (B,NH,T,HS); (B,NH,T,HS) merged into (B,T,C) and split back;
/// f32 dq, dk, dv gathered into dqkv, each rounded once to the storage type.
fn head_permutes_match_their_definitions<E: Elem>(attention: &Emulated, hs: usize) {
    let dt = suffix::<E>();
    let (b, t, nh) = (2, 37, 3);
    let c = nh * hs;
    let n = b * t * c;
    let mut rng = Rng::new(89);
    let mut qkv: Vec<E> = random(&mut rng, 3 * n, 1.0);
    let dims = || [int(b), int(t), int(nh), int(hs)];
    // (B,NH,T,HS) index of (b, h, t, d) and its (B,T,C) / (B,T,3C) twins
    let head = |bi: usize, h: usize, ti: usize, d: usize| ((bi * nh + h) * t + ti) * hs + d;
    let row = |bi: usize, ti: usize, part: usize, h: usize, d: usize, width: usize| {
        (bi * t + ti) * width + part * c + h * hs + d
    };
    let every = || {
        (0..b).flat_map(move |bi| {
            (0..nh).flat_map(move |h| (0..t).flat_map(move |ti| (0..hs).map(move |d| (bi, h, ti, d))))
        })
    };
    let bits = |v: E| v.to_f32().to_bits(); // exact: every storage type widens to f32 exactly

    let (mut q, mut k, mut v) = (vec![E::from_f32(f32::NAN); n], vec![E::default(); n], vec![E::default(); n]);
    let mut args: Vec<Arg> = vec![buf(&mut q), buf(&mut k), buf(&mut v), buf(&mut qkv)];
    args.extend(dims());
    attention.launch(&format!("permute_qkv_{dt}"), packed(n, E::BYTES), &mut args);
    for (bi, h, ti, d) in every() {
        for (part, x) in [&q, &k, &v].into_iter().enumerate() {
            assert_eq!(bits(x[head(bi, h, ti, d)]), bits(qkv[row(bi, ti, part, h, d, 3 * c)]), "{dt} part {part}");
        }
    }

    let mut merged = vec![E::from_f32(f32::NAN); n];
    let mut args: Vec<Arg> = vec![buf(&mut merged), buf(&mut q)];
    args.extend(dims());
    args.push(Arg::I32(1));
    attention.launch(&format!("heads_permute_{dt}"), packed(n, E::BYTES), &mut args);
    for (bi, h, ti, d) in every() {
        assert_eq!(bits(merged[row(bi, ti, 0, h, d, c)]), bits(q[head(bi, h, ti, d)]), "{dt} merge");
    }
    let mut split = vec![E::from_f32(f32::NAN); n];
    let mut args: Vec<Arg> = vec![buf(&mut split), buf(&mut merged)];
    args.extend(dims());
    args.push(Arg::I32(0));
    attention.launch(&format!("heads_permute_{dt}"), packed(n, E::BYTES), &mut args);
    assert_eq!(bytemuck::cast_slice::<E, u8>(&split), bytemuck::cast_slice::<E, u8>(&q), "{dt} split");

    let mut grads: Vec<Vec<f32>> = (0..3).map(|_| (0..n).map(|_| rng.normal() as f32).collect()).collect();
    let mut dqkv = vec![E::from_f32(f32::NAN); 3 * n];
    let [dq, dk, dv] = &mut grads[..] else { unreachable!() };
    let mut args: Vec<Arg> = vec![buf(&mut dqkv), buf(dq), buf(dk), buf(dv)];
    args.extend(dims());
    attention.launch(&format!("permute_qkv_backward_{dt}"), packed(n, E::BYTES), &mut args);
    for (bi, h, ti, d) in every() {
        for (part, g) in grads.iter().enumerate() {
            let want = E::from_f32(g[head(bi, h, ti, d)]);
            assert_eq!(bits(dqkv[row(bi, ti, part, h, d, 3 * c)]), bits(want), "{dt} backward part {part}");
        }
    }
}

#[test]
fn the_head_permute_kernels_match_their_definitions() {
    let Some(attention) = Emulated::build("attention") else { return };
    // HS 12: 16-bit storage element by element (f32 in packs of 4); HS 16: packs in all three.
    for hs in [12, 16] {
        head_permutes_match_their_definitions::<f32>(&attention, hs);
        head_permutes_match_their_definitions::<half::bf16>(&attention, hs);
        head_permutes_match_their_definitions::<half::f16>(&attention, hs);
    }
}

/// LayerNorm forward (one warp per row: f32 statistics, where the CPU sums in f64) and its
/// recompute from saved statistics; the residual add and the matmul's bias broadcast — over
/// (n, c): C 77 takes the element-wise kernels' one-by-one path, C 80 their 16-byte packs, C 264
/// more packs per row than a warp has lanes (LayerNorm forward's loop comes round).
fn layernorm_forward_and_residual_kernels_match_the_reference<E: Elem>(
    layernorm: &Emulated,
    residual: &Emulated,
    eps: f64,
    (n, c): (usize, usize),
) {
    let dt = suffix::<E>();
    let mut rng = Rng::new(97);
    // rows off zero, so the mean matters
    let mut inp: Vec<E> = (0..n * c).map(|i| E::from_f32(rng.normal() as f32 * 1.5 + (i / c) as f32 * 0.1)).collect();
    let (mut weight, mut bias) = (random::<E>(&mut rng, c, 1.0), random::<E>(&mut rng, c, 0.5));
    let (mut want, mut want_mean, mut want_rstd) = (vec![E::default(); n * c], vec![0f32; n], vec![0f32; n]);
    layers::layernorm_forward(&mut want, &mut want_mean, &mut want_rstd, &inp, &weight, &bias, c);
    // each output within f32 error of the magnitudes it is made of, plus rounding apart
    let magnitude: Vec<f64> = (0..n * c)
        .map(|i| {
            let (x, m, r) = (inp[i].to_f32() as f64, want_mean[i / c] as f64, want_rstd[i / c] as f64);
            ((x.abs() + m.abs()) * r * weight[i % c].to_f32().abs() as f64) + bias[i % c].to_f32().abs() as f64
        })
        .collect();

    let (mut out, mut mean, mut rstd) = (vec![E::from_f32(f32::NAN); n * c], vec![f32::NAN; n], vec![f32::NAN; n]);
    let mut args = [
        buf(&mut out),
        buf(&mut mean),
        buf(&mut rstd),
        buf(&mut inp),
        buf(&mut weight),
        buf(&mut bias),
        int(n),
        int(c),
    ];
    layernorm.launch(&format!("layernorm_forward_{dt}"), warp_rows(n), &mut args);
    for (what, got, want) in [("mean", &mean, &want_mean), ("rstd", &rstd, &want_rstd)] {
        for (row, (g, w)) in got.iter().zip(want.iter()).enumerate() {
            assert!((g - w).abs() <= 1e-5 * (1.0 + w.abs()), "{what}[{row}] {dt}: {g} vs {w}");
        }
    }
    close(&format!("layernorm_forward {dt}"), &out, &want, &magnitude, 1e-5, 2.0 * eps);

    let mut again = vec![E::from_f32(f32::NAN); n * c];
    let (mut m, mut r) = (want_mean.clone(), want_rstd.clone());
    let mut args =
        [buf(&mut again), buf(&mut inp), buf(&mut weight), buf(&mut bias), buf(&mut m), buf(&mut r), int(n), int(c)];
    layernorm.launch(&format!("layernorm_recompute_{dt}"), packed(n * c, E::BYTES), &mut args);
    let mut want_again = vec![E::default(); n * c];
    layers::layernorm_recompute(&mut want_again, &inp, &weight, &bias, &want_mean, &want_rstd, c);
    close(&format!("layernorm_recompute {dt}"), &again, &want_again, &magnitude, 1e-6, 2.0 * eps);

    // out += inp: one f32 add, one rounding — bit for bit (aligned, and one element off)
    let mut want_sum = out.clone();
    layers::residual_forward_inplace(&mut want_sum, &inp);
    for shift in [0, 1] {
        let mut sum = out.clone();
        let mut args = [shifted(&mut sum, shift), shifted(&mut inp, shift), Arg::I64((n * c) as i64)];
        residual.launch(&format!("residual_forward_{dt}"), packed(n * c, E::BYTES), &mut args);
        let (got, want) = (bytemuck::cast_slice::<E, u8>(&sum), bytemuck::cast_slice::<E, u8>(&want_sum));
        assert_eq!(got, want, "residual {dt} C {c} shift {shift}");
    }

    let mut broadcast = vec![E::from_f32(f32::NAN); n * c];
    let mut args = [buf(&mut broadcast), buf(&mut bias), Arg::I64(n as i64), int(c)];
    residual.launch(&format!("bias_broadcast_{dt}"), packed(n * c, E::BYTES), &mut args);
    let want_rows: Vec<E> = (0..n).flat_map(|_| bias.iter().copied()).collect();
    assert_eq!(bytemuck::cast_slice::<E, u8>(&broadcast), bytemuck::cast_slice::<E, u8>(&want_rows), "bias {dt}");
}

#[test]
fn the_layernorm_forward_and_residual_kernels_match_the_cpu_reference() {
    let (Some(layernorm), Some(residual)) = (Emulated::build("layernorm"), Emulated::build("residual")) else {
        return;
    };
    for shape in [(37, 77), (37, 80), (9, 264)] {
        layernorm_forward_and_residual_kernels_match_the_reference::<f32>(&layernorm, &residual, 0.0, shape);
        let bf16 = 1.0 / 256.0;
        layernorm_forward_and_residual_kernels_match_the_reference::<half::bf16>(&layernorm, &residual, bf16, shape);
        let f16 = 1.0 / 2048.0;
        layernorm_forward_and_residual_kernels_match_the_reference::<half::f16>(&layernorm, &residual, f16, shape);
    }
}
