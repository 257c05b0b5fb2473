//! The CUDA backend's foundations: the kernel sources of kernels/ (one .cu per op family, entry
//! points `<op>_<dtype>`), their NVRTC compilation (cached once per process and architecture),
//! and the library probes that turn "no driver" into a typed error instead of cudarc's panic.
//! `backend` executes the `Backend` ops on a device, which `headroom train` on `cuda` runs.

mod backend;
pub use backend::CudaBackend;

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

/// Shared helpers, spliced in front of every kernel family (NVRTC gets no include path).
const COMMON: &str = include_str!("../../../kernels/common.cuh");

/// Every kernel family: (name, source).
pub const KERNELS: &[(&str, &str)] = &[
    ("encoder", include_str!("../../../kernels/encoder.cu")),
    ("layernorm", include_str!("../../../kernels/layernorm.cu")),
    ("attention", include_str!("../../../kernels/attention.cu")),
    ("gelu", include_str!("../../../kernels/gelu.cu")),
    ("residual", include_str!("../../../kernels/residual.cu")),
    ("classifier", include_str!("../../../kernels/classifier.cu")),
    ("adamw", include_str!("../../../kernels/adamw.cu")),
    ("norm", include_str!("../../../kernels/norm.cu")),
    ("cast", include_str!("../../../kernels/cast.cu")),
    ("int8", include_str!("../../../kernels/int8.cu")),
];

#[derive(Debug, Clone, thiserror::Error)]
pub enum CudaError {
    #[error("device cuda:{index} requested but no CUDA driver found (libcuda could not be loaded)")]
    NoDriver { index: u32 },
    #[error("NVRTC (libnvrtc) not found: install the CUDA toolkit or `pip install nvidia-cuda-nvrtc-cu12` and put its lib folder on LD_LIBRARY_PATH")]
    NoNvrtc,
    #[error("kernel {family} does not compile for {arch}: {log}")]
    Compile { family: String, arch: String, log: String },
    #[error("cuBLAS (libcublas) not found: install the CUDA toolkit or `pip install nvidia-cublas-cu12` and put its lib folder on LD_LIBRARY_PATH")]
    NoCublas,
    #[error("device cuda:{index}: {op} failed: {detail}")]
    Driver { index: u32, op: &'static str, detail: String },
    #[error("unknown kernel family `{0}`")]
    UnknownFamily(String),
}

/// The full source of one family, with the shared helpers in place of its include.
pub fn source(family: &str) -> Result<String, CudaError> {
    let (_, src) = KERNELS.iter().find(|(n, _)| *n == family).ok_or_else(|| CudaError::UnknownFamily(family.into()))?;
    Ok(src.replace("#include \"common.cuh\"", COMMON))
}

/// Entry points (`extern "C" __global__`) a family declares.
pub fn entry_points(family: &str) -> Result<Vec<String>, CudaError> {
    let src = source(family)?;
    Ok(src
        .split("extern \"C\" __global__ void ")
        .skip(1)
        .filter_map(|rest| rest.split('(').next().map(|n| n.trim().to_string()))
        .collect())
}

pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen libcuda.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

pub fn cublas_present() -> bool {
    // SAFETY: only tries to dlopen libcublas.
    unsafe { cudarc::cublas::sys::is_culib_present() }
}

pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen libnvrtc.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// PTX text of one family for `arch` (e.g. "sm_80"), compiled once per process.
pub fn compile(family: &str, arch: &str) -> Result<String, CudaError> {
    static CACHE: OnceLock<Mutex<HashMap<(String, String), String>>> = OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
    let key = (family.to_string(), arch.to_string());
    if let Some(ptx) = cache.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
        return Ok(ptx.clone());
    }
    if !nvrtc_present() {
        return Err(CudaError::NoNvrtc);
    }
    // NVRTC wants a 'static arch name; the few distinct ones a process sees are interned.
    let arch_static: &'static str = Box::leak(arch.to_string().into_boxed_str());
    let opts = cudarc::nvrtc::CompileOptions {
        arch: Some(arch_static),
        name: Some(format!("{family}.cu")),
        options: vec!["--std=c++17".into()],
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(source(family)?, opts).map_err(|e| CudaError::Compile {
        family: family.into(),
        arch: arch.into(),
        log: match &e {
            cudarc::nvrtc::CompileError::CompileError { log, .. } => log.to_string_lossy().into_owned(),
            other => format!("{other:?}"),
        },
    })?;
    let text = ptx.to_src();
    cache.lock().unwrap_or_else(|e| e.into_inner()).insert(key, text.clone());
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_family_declares_f32_and_bf16_entry_points() {
        for (family, _) in KERNELS {
            let eps = entry_points(family).unwrap();
            assert!(!eps.is_empty(), "{family}");
            assert!(
                eps.iter().any(|e| e.ends_with("_f32")) && eps.iter().any(|e| e.ends_with("_bf16")),
                "{family}: {eps:?}"
            );
            assert!(!source(family).unwrap().contains("#include \"common.cuh\""));
        }
    }

    /// Compiles every kernel for sm_80 and sm_90. Required in CI (HEADROOM_NVRTC_TEST=1, set
    /// by .ci/run after installing libnvrtc); elsewhere it says when NVRTC is missing.
    #[test]
    fn every_kernel_compiles_with_nvrtc_for_sm80_and_sm90() {
        let required = std::env::var("HEADROOM_NVRTC_TEST").is_ok_and(|v| v == "1");
        if !nvrtc_present() {
            assert!(!required, "HEADROOM_NVRTC_TEST=1 but libnvrtc cannot be loaded (LD_LIBRARY_PATH?)");
            eprintln!("skipped: libnvrtc not found");
            return;
        }
        for (family, _) in KERNELS {
            for arch in ["sm_80", "sm_90"] {
                let ptx = compile(family, arch).unwrap_or_else(|e| panic!("{e}"));
                for ep in entry_points(family).unwrap() {
                    assert!(ptx.contains(&format!(".entry {ep}")), "{family}/{arch}: no entry {ep}");
                }
            }
        }
    }

    #[test]
    fn no_driver_is_a_typed_error_not_a_panic() {
        if driver_present() {
            return; // a GPU machine: covered by scripts/gpu-check.sh
        }
        let err = super::CudaBackend::new(0, None).unwrap_err();
        assert_eq!(err.to_string(), "device cuda:0 requested but no CUDA driver found (libcuda could not be loaded)");
    }
}
