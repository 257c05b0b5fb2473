//! The CUDA kernels' logic run on this machine: tests/cuda_emulator runs a kernel's threads as
//! fibers (collectives are barriers, mma is computed from the warp's fragments), and these tests
//! compare what it writes with the CPU reference. They need a C++ compiler (`c++`); CI sets
//! HEADROOM_EMULATOR_TEST=1 so a missing one fails instead of skipping.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::engine::backend::layers::{self, Elem};
use crate::engine::rng::Rng;

/// Builds an emulator driver (tests/cuda_emulator/<name>.cpp) into `dir`; None when there is no
/// C++ compiler and the test is not required.
fn build(name: &str, dir: &Path) -> Option<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let required = std::env::var("HEADROOM_EMULATOR_TEST").is_ok_and(|v| v == "1");
    let exe = dir.join(name);
    let status = Command::new("c++")
        .args(["-std=c++17", "-O2", "-Wall", "-Werror", "-I"])
        .arg(root.join("kernels"))
        .arg("-I")
        .arg(root.join("tests/cuda_emulator"))
        .arg(root.join(format!("tests/cuda_emulator/{name}.cpp")))
        .arg("-o")
        .arg(&exe)
        .status();
    match status {
        Ok(s) => {
            assert!(s.success(), "tests/cuda_emulator/{name}.cpp does not compile");
            Some(exe)
        }
        Err(e) => {
            assert!(!required, "HEADROOM_EMULATOR_TEST=1 but `c++` cannot run: {e}");
            eprintln!("skipped: no C++ compiler ({e})");
            None
        }
    }
}

fn write_bits<E: Elem>(path: &Path, values: &[E]) {
    std::fs::write(path, bytemuck::cast_slice::<E, u8>(values)).unwrap();
}

fn read<T: bytemuck::Pod + bytemuck::Zeroable>(path: &Path, n: usize) -> Vec<T> {
    let bytes = std::fs::read(path).unwrap();
    assert_eq!(bytes.len(), n * std::mem::size_of::<T>(), "{}", path.display());
    let mut values = vec![T::zeroed(); n];
    bytemuck::cast_slice_mut::<T, u8>(&mut values).copy_from_slice(&bytes);
    values
}

/// The fused attention forward against `layers::attention_forward` for one storage type and
/// shape: lse within f32 rounding, each output within two roundings of the storage type of
/// Σ p·|v| (both round the probabilities to it; the kernel before normalising them).
fn flash_forward_matches_the_reference<E: Elem>(
    exe: &Path,
    dir: &Path,
    (b, t, nh, hs): (usize, usize, usize, usize),
    eps: f64,
) {
    let c = nh * hs;
    let mut rng = Rng::new(11 + t as u64);
    // q and k scaled up so some rows' softmax is peaked, some flat.
    let qkv: Vec<E> = (0..b * t * 3 * c)
        .map(|i| {
            let which = i % (3 * c) / c;
            E::from_f32(rng.normal() as f32 * if which < 2 { 1.6 } else { 1.0 })
        })
        .collect();
    let (input, out_path, lse_path) = (dir.join("qkv.bin"), dir.join("out.bin"), dir.join("lse.bin"));
    write_bits(&input, &qkv);
    let dt = if E::NAME == "bf16" { "bf16" } else { "f16" };
    let shape = [b, t, nh, hs].map(|n| n.to_string());
    let status = Command::new(exe).arg(dt).args(&shape).args([&input, &out_path, &lse_path]).status().unwrap();
    assert!(status.success(), "emulated flash_attention_forward {dt} {shape:?}");
    let got: Vec<E> = read(&out_path, b * t * c);
    let got_lse: Vec<f32> = read(&lse_path, b * nh * t);

    let mut want = vec![E::default(); b * t * c];
    let mut want_lse = vec![0f32; b * nh * t];
    let mut scratch = vec![0f32; layers::attention_forward_scratch::<E>(b, t, c, nh)];
    layers::attention_forward(&mut want, &mut want_lse, &qkv, &mut scratch, b, t, c, nh);

    let at = |bi: usize, ti: usize, which: usize, h: usize, d: usize| {
        qkv[(bi * t + ti) * 3 * c + which * c + h * hs + d].to_f32() as f64
    };
    for bi in 0..b {
        for h in 0..nh {
            for ti in 0..t {
                let row = (bi * nh + h) * t + ti;
                let (g, w) = (got_lse[row] as f64, want_lse[row] as f64);
                assert!((g - w).abs() <= 1e-5 * (1.0 + w.abs()), "lse[{bi},{h},{ti}] {dt}: {g} vs {w}");
                // p from the reference's lse, in f64
                let p: Vec<f64> = (0..=ti)
                    .map(|k| {
                        let s: f64 =
                            (0..hs).map(|d| at(bi, ti, 0, h, d) * at(bi, k, 1, h, d)).sum::<f64>() / (hs as f64).sqrt();
                        (s - w).exp()
                    })
                    .collect();
                for d in 0..hs {
                    let i = (bi * t + ti) * c + h * hs + d;
                    let magnitude: f64 = p.iter().enumerate().map(|(k, p)| p * at(bi, k, 2, h, d).abs()).sum();
                    let (g, w) = (got[i].to_f32() as f64, want[i].to_f32() as f64);
                    let bound = 4.0 * eps * magnitude + 1e-6;
                    assert!((g - w).abs() <= bound, "out[{bi},{ti},{h},{d}] {dt}: {g} vs {w} (bound {bound:e})");
                }
            }
        }
    }
}

#[test]
fn the_fused_attention_forward_kernel_matches_the_cpu_reference() {
    let dir = tempfile::tempdir().unwrap();
    let Some(exe) = build("attention", dir.path()) else { return };
    // T 80 and 130: a last block of queries past T, a step of keys past T, several key steps.
    for shape in [(2, 80, 2, 64), (1, 130, 3, 32)] {
        flash_forward_matches_the_reference::<half::bf16>(&exe, dir.path(), shape, 1.0 / 256.0);
        flash_forward_matches_the_reference::<half::f16>(&exe, dir.path(), shape, 1.0 / 2048.0);
    }
}
