//! The CUDA backend's foundations: the kernel sources of kernels/ (one .cu per op family, entry
//! points `<op>_<dtype>`), their NVRTC compilation (cached once per process and architecture),
//! and the library probes that turn "no driver" into a typed error instead of cudarc's panic.
//! `backend` executes the `Backend` ops on a device, which `headroom train` on `cuda` runs.

pub(crate) mod backend;
pub use backend::CudaBackend;
mod vmm;

pub mod libraries;
pub mod nccl;

use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::nvrtc::result as nvrtc;

/// Shared helpers, spliced in front of every kernel family (NVRTC gets no include path).
const COMMON: &str = include_str!("../../../../kernels/common.cuh");

/// Every kernel family: (name, source).
pub const KERNELS: &[(&str, &str)] = &[
    ("encoder", include_str!("../../../../kernels/encoder.cu")),
    ("layernorm", include_str!("../../../../kernels/layernorm.cu")),
    ("attention", include_str!("../../../../kernels/attention.cu")),
    ("gelu", include_str!("../../../../kernels/gelu.cu")),
    ("residual", include_str!("../../../../kernels/residual.cu")),
    ("classifier", include_str!("../../../../kernels/classifier.cu")),
    ("adamw", include_str!("../../../../kernels/adamw.cu")),
    ("norm", include_str!("../../../../kernels/norm.cu")),
    ("cast", include_str!("../../../../kernels/cast.cu")),
    ("int8", include_str!("../../../../kernels/int8.cu")),
];

#[derive(Debug, Clone, thiserror::Error)]
pub enum CudaError {
    #[error("device cuda:{index} requested but no CUDA driver found (libcuda could not be loaded)")]
    NoDriver { index: u32 },
    #[error("NVRTC (libnvrtc.so.13 or .so.12) not found on the library path{hint}")]
    NoNvrtc { hint: String },
    #[error("kernel {family} does not compile for {arch}: {log}")]
    Compile { family: String, arch: String, log: String },
    #[error("cuBLAS (libcublas.so.13 or .so.12) not found on the library path{hint}")]
    NoCublas { hint: String },
    #[error("device cuda:{index}: {op} failed: {detail}")]
    Driver { index: u32, op: &'static str, detail: String },
    #[error("kernel {family}: {detail}")]
    Signature { family: String, detail: String },
    #[error("NCCL unavailable: {detail}")]
    Nccl { detail: String },
    #[error("unknown kernel family `{0}`")]
    UnknownFamily(String),
    #[error("{name}=`{value}`: expected {expected}")]
    Setting { name: &'static str, value: String, expected: &'static str },
}

/// The full source of one family, with the shared helpers in place of its include.
pub fn source(family: &str) -> Result<String, CudaError> {
    let (_, src) = KERNELS.iter().find(|(n, _)| *n == family).ok_or_else(|| CudaError::UnknownFamily(family.into()))?;
    Ok(src.replace("#include \"common.cuh\"", COMMON))
}

/// The block size an entry point declares as its largest (`__launch_bounds__(N)` before its
/// name), if it declares one.
pub fn launch_bound(family: &str, entry: &str) -> Result<Option<u32>, CudaError> {
    let src = source(family)?;
    for (bound, rest) in declarations(&src) {
        if rest.strip_prefix(entry).is_some_and(|t| t.starts_with('(')) {
            return Ok(bound.and_then(|n| n.parse().ok()));
        }
    }
    Ok(None)
}

/// Each entry point's declaration in `src` (`extern "C" __global__ void …`): the largest block
/// it declares (`__launch_bounds__(N)` before its name), if any, and its text from the name on.
fn declarations(src: &str) -> impl Iterator<Item = (Option<&str>, &str)> {
    src.split("extern \"C\" __global__ void ").skip(1).map(|rest| {
        match rest.strip_prefix("__launch_bounds__(").and_then(|bounded| bounded.split_once(')')) {
            Some((bound, tail)) => (Some(bound.trim()), tail.trim_start()),
            None => (None, rest),
        }
    })
}

/// Entry points (`extern "C" __global__`) a family declares.
pub fn entry_points(family: &str) -> Result<Vec<String>, CudaError> {
    Ok(signatures(family)?.into_iter().map(|(name, _)| name).collect())
}

/// The C type of a kernel parameter, as a launch passes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Param {
    /// Any pointer (a device address).
    Ptr,
    /// `int`
    I32,
    /// `long`
    I64,
    /// `float`
    F32,
}

/// Every entry point a family declares, with its parameters' types, read from the source (a
/// launch is checked against them).
pub fn signatures(family: &str) -> Result<Vec<(String, Vec<Param>)>, CudaError> {
    parse_signatures(family, &source(family)?)
}

fn parse_signatures(family: &str, src: &str) -> Result<Vec<(String, Vec<Param>)>, CudaError> {
    let bad = |detail: String| CudaError::Signature { family: family.into(), detail };
    let mut entries = Vec::new();
    for (_, rest) in declarations(src) {
        let (name, tail) = rest.split_once('(').ok_or_else(|| bad("an entry point without parameters".into()))?;
        let params = tail.split_once(')').map(|(p, _)| p).ok_or_else(|| bad(format!("{name}: unclosed (")))?;
        let mut types = Vec::new();
        for param in params.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let words: Vec<&str> = param.split_whitespace().collect();
            let ty = words[..words.len().saturating_sub(1)].join(" ");
            types.push(match ty.as_str() {
                _ if param.contains('*') => Param::Ptr,
                "int" => Param::I32,
                "long" => Param::I64,
                "float" => Param::F32,
                _ => return Err(bad(format!("{}: parameter `{param}` of a type launches cannot pass", name.trim()))),
            });
        }
        entries.push((name.trim().to_string(), types));
    }
    Ok(entries)
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

/// The error for a missing libnvrtc, with where one was found off the library path, if anywhere.
pub fn no_nvrtc() -> CudaError {
    CudaError::NoNvrtc { hint: libraries::hint("libnvrtc.so", &["13", "12"], "nvidia-cuda-nvrtc") }
}

/// The error for a missing libcublas, with where one was found off the library path, if anywhere.
pub fn no_cublas() -> CudaError {
    CudaError::NoCublas { hint: libraries::hint("libcublas.so", &["13", "12"], "nvidia-cublas") }
}

/// NVRTC's version as (major, minor); None when libnvrtc is absent.
pub fn nvrtc_version() -> Option<(i32, i32)> {
    if !nvrtc_present() {
        return None;
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two out-parameters; libnvrtc is present.
    unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) }.result().ok()?;
    Some((major, minor))
}

/// A (major, minor) version as "major.minor".
pub fn dotted((major, minor): (i32, i32)) -> String {
    format!("{major}.{minor}")
}

/// The CUDA version the driver supports as (major, minor); None without a driver.
pub fn driver_version() -> Option<(i32, i32)> {
    if !driver_present() {
        return None;
    }
    let mut version = 0;
    // SAFETY: one out-parameter; libcuda is present.
    unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut version) }.result().ok()?;
    Some((version / 1000, version % 1000 / 10))
}

/// cuBLAS's version as (major, minor, patch); None when libcublas is absent.
pub fn cublas_version() -> Option<(i32, i32, i32)> {
    use cudarc::cublas::sys::{cublasGetProperty, libraryPropertyType};
    if !cublas_present() {
        return None;
    }
    let mut v = [0; 3];
    for (slot, property) in v.iter_mut().zip([
        libraryPropertyType::MAJOR_VERSION,
        libraryPropertyType::MINOR_VERSION,
        libraryPropertyType::PATCH_LEVEL,
    ]) {
        // SAFETY: one out-parameter; libcublas is present.
        unsafe { cublasGetProperty(property, slot) }.result().ok()?;
    }
    Some((v[0], v[1], v[2]))
}

/// One library in `library_report`.
#[derive(Debug, Clone)]
pub struct LibraryStatus {
    /// e.g. "libcublas".
    pub name: &'static str,
    /// Loaded; `detail` is then its version and file, else why not.
    pub loaded: bool,
    /// Whether `cuda` devices need it (NCCL only serves ranks on several GPUs).
    pub required: bool,
    pub detail: String,
}

/// Which of the libraries a `cuda` device uses load here, their versions and files (loading
/// them): what `headroom gpu-check --libraries` prints.
pub fn library_report() -> Vec<LibraryStatus> {
    // Load each first (the versions), then read which files are mapped.
    let driver = driver_version().map(|v| format!("CUDA {}", dotted(v)));
    let nvrtc = nvrtc_version().map(|v| format!("NVRTC {}", dotted(v)));
    let cublas = cublas_version().map(|(a, b, c)| format!("cuBLAS {a}.{b}.{c}"));
    let nccl = nccl::version();
    let files = libraries::loaded();
    let status = |name: &'static str, required: bool, version: Result<String, String>| {
        let file = files.iter().find(|(stem, _)| *stem == name).map(|(_, p)| p.display().to_string());
        match version {
            Ok(v) => LibraryStatus {
                name,
                loaded: true,
                required,
                detail: format!("{v}, {}", file.unwrap_or_else(|| "file not seen".into())),
            },
            Err(why) => LibraryStatus { name, loaded: false, required, detail: why },
        }
    };
    vec![
        status(
            "libcuda",
            true,
            driver.ok_or_else(|| "not found: no NVIDIA driver (libcuda.so.1) on this machine".into()),
        ),
        status("libnvrtc", true, nvrtc.ok_or_else(|| no_nvrtc().to_string())),
        status("libcublas", true, cublas.ok_or_else(|| no_cublas().to_string())),
        status("libnccl", false, nccl.map_err(|e| e + " (needed only for ranks on several GPUs)")),
    ]
}

/// Machine code (a CUBIN) of one family for `arch` (e.g. "sm_90"), compiled once per process.
///
/// Machine code rather than PTX: the driver loads it without a JIT step, and it loads on a
/// driver older than libnvrtc within one CUDA major version (a pip wheel of NVRTC 13.5 on a
/// 13.0 driver), where PTX of the newer ISA would be refused.
pub fn compile(family: &str, arch: &str) -> Result<Arc<[u8]>, CudaError> {
    /// CUBINs by (family, arch).
    type Cubins = HashMap<(String, String), Arc<[u8]>>;
    static CACHE: OnceLock<Mutex<Cubins>> = OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
    let key = (family.to_string(), arch.to_string());
    if let Some(cubin) = cache.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
        return Ok(cubin.clone());
    }
    let cubin: Arc<[u8]> = compile_source(family, &source(family)?, arch, &[])?.0.into();
    cache.lock().unwrap_or_else(|e| e.into_inner()).insert(key, cubin.clone());
    Ok(cubin)
}

/// One NVRTC compilation of `src` (named `family`.cu in messages) to a CUBIN for `arch`, with
/// `extra` options; the CUBIN and NVRTC's log.
fn compile_source(family: &str, src: &str, arch: &str, extra: &[&str]) -> Result<(Vec<u8>, String), CudaError> {
    if !nvrtc_present() {
        return Err(no_nvrtc());
    }
    let fail = |log: String| CudaError::Compile { family: family.into(), arch: arch.into(), log };
    let src = CString::new(src).map_err(|_| fail("the source holds a NUL byte".into()))?;
    let name = CString::new(format!("{family}.cu")).map_err(|_| fail("bad family name".into()))?;
    let prog = nvrtc::create_program(&src, Some(&name)).map_err(|e| fail(format!("{e:?}")))?;
    let mut options = vec![format!("--gpu-architecture={arch}"), "--std=c++17".into()];
    options.extend(extra.iter().map(|o| o.to_string()));
    // SAFETY: `prog` was created above and is destroyed once, below; `src` and `name` outlive it.
    unsafe {
        let compiled = nvrtc::compile_program(prog, &options);
        let log = nvrtc::get_program_log(prog)
            .map(|log| CStr::from_ptr(log.as_ptr()).to_string_lossy().trim_end().to_string())
            .unwrap_or_default();
        let cubin = match compiled {
            Err(e) => Err(fail(format!("{e:?}: {log}"))),
            Ok(()) => cubin_of(prog).map(|c| (c, log)).map_err(|e| fail(format!("no CUBIN: {e:?}"))),
        };
        let _ = nvrtc::destroy_program(prog);
        cubin
    }
}

/// What ptxas says one kernel uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelResources {
    pub entry: String,
    pub registers: u32,
    pub spill_bytes: u32,
    /// Local memory for arrays the compiler could not keep in registers (indexed at run time).
    pub stack_bytes: u32,
}

/// Registers and spills of every kernel of `family` for `arch`, from ptxas's verbose report.
pub fn kernel_resources(family: &str, arch: &str) -> Result<Vec<KernelResources>, CudaError> {
    let (_, log) = compile_source(family, &source(family)?, arch, &["--ptxas-options=-v"])?;
    Ok(parse_ptxas_report(&log))
}

/// The per-function lines of `ptxas -v`: "Compiling entry function 'NAME'", then
/// "N bytes spill stores, M bytes spill loads" and "Used R registers".
fn parse_ptxas_report(log: &str) -> Vec<KernelResources> {
    let number_before = |line: &str, word: &str| -> u32 {
        let at = line.find(word).unwrap_or(0);
        line[..at].split_whitespace().last().and_then(|n| n.parse().ok()).unwrap_or(0)
    };
    let mut kernels: Vec<KernelResources> = Vec::new();
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let entry = rest.split('\'').next().unwrap_or("").to_string();
            kernels.push(KernelResources { entry, registers: 0, spill_bytes: 0, stack_bytes: 0 });
        } else if let Some(k) = kernels.last_mut() {
            if line.contains("spill stores") {
                k.spill_bytes = number_before(line, "bytes spill stores") + number_before(line, "bytes spill loads");
                k.stack_bytes = number_before(line, "bytes stack frame");
            } else if line.contains("Used ") && line.contains(" registers") {
                k.registers = number_before(line, "registers");
            }
        }
    }
    kernels
}

/// The CUBIN of a program compiled for a real architecture.
///
/// # Safety
/// `prog` must be a live program that compiled.
unsafe fn cubin_of(prog: cudarc::nvrtc::sys::nvrtcProgram) -> Result<Vec<u8>, nvrtc::NvrtcError> {
    use cudarc::nvrtc::sys;
    let mut size = 0usize;
    sys::nvrtcGetCUBINSize(prog, &mut size).result()?;
    let mut cubin = vec![0u8; size];
    sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast()).result()?;
    Ok(cubin)
}

/// Whether a CUBIN defines the kernel `entry` (its name in the ELF string table).
pub fn cubin_defines(cubin: &[u8], entry: &str) -> bool {
    let needle: Vec<u8> = [b"\0", entry.as_bytes(), b"\0"].concat();
    cubin.starts_with(b"\x7fELF") && cubin.windows(needle.len()).any(|w| w == needle.as_slice())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_family_declares_f32_bf16_and_f16_entry_points() {
        for (family, _) in KERNELS {
            let eps = entry_points(family).unwrap();
            assert!(!eps.is_empty(), "{family}");
            for dt in ["_f32", "_bf16", "_f16"] {
                assert!(eps.iter().any(|e| e.ends_with(dt)), "{family} has no {dt} entry point: {eps:?}");
            }
            assert!(!source(family).unwrap().contains("#include \"common.cuh\""));
            // Each bf16 entry point has an fp16 twin taking the same parameters.
            let sigs = signatures(family).unwrap();
            for (name, params) in sigs.iter().filter(|(n, _)| n.contains("bf16")) {
                let twin = name.replace("bf16", "f16");
                let found = sigs.iter().find(|(n, _)| *n == twin);
                assert_eq!(found.map(|(_, p)| p), Some(params), "{family}: {twin} mirrors {name}");
            }
        }
    }

    /// Compiles every kernel for sm_80 and sm_90. Required in CI (HEADROOM_NVRTC_TEST=1, set
    /// by .ci/run after installing libnvrtc; HEADROOM_NVRTC_MAJOR names the major version it
    /// must have loaded); elsewhere it says when NVRTC is missing.
    #[test]
    fn every_kernel_compiles_with_nvrtc_for_sm80_and_sm90() {
        let required = std::env::var("HEADROOM_NVRTC_TEST").is_ok_and(|v| v == "1");
        if !nvrtc_present() {
            assert!(!required, "HEADROOM_NVRTC_TEST=1 but libnvrtc cannot be loaded (LD_LIBRARY_PATH?)");
            eprintln!("skipped: libnvrtc not found");
            return;
        }
        let (major, minor) = nvrtc_version().expect("NVRTC loads but reports no version");
        eprintln!("NVRTC {major}.{minor}");
        if let Ok(want) = std::env::var("HEADROOM_NVRTC_MAJOR") {
            assert_eq!(major.to_string(), want, "HEADROOM_NVRTC_MAJOR={want} but NVRTC {major}.{minor} was loaded");
        }
        for (family, _) in KERNELS {
            for arch in ["sm_80", "sm_90"] {
                let cubin = compile(family, arch).unwrap_or_else(|e| panic!("{e}"));
                for ep in entry_points(family).unwrap() {
                    assert!(cubin_defines(&cubin, &ep), "{family}/{arch}: no entry {ep}");
                }
                assert!(!cubin_defines(&cubin, "no_such_kernel_f32"), "{family}/{arch}");
            }
        }
    }

    /// The element-wise kernels that move 16-byte packs (`PACK(T)` in `common.cuh`).
    const PACKED: [&str; 11] = [
        "residual_forward_",
        "bias_broadcast_",
        "bias_backward_partial_",
        "gelu_",
        "cast_",
        "adamw_",
        "layernorm_",
        "crossentropy_",
        "permute_qkv",
        "heads_permute_",
        "softmax_causal_",
    ];

    /// The PTX of `family` for virtual architecture `arch` (`compute_90`).
    fn ptx_of(family: &str, arch: &str) -> String {
        let src = CString::new(source(family).unwrap()).unwrap();
        let prog = nvrtc::create_program(&src, None).unwrap();
        let options = [format!("--gpu-architecture={arch}"), "--std=c++17".to_string()];
        // SAFETY: `prog` was created above and is destroyed once, below; `src` outlives it.
        unsafe {
            nvrtc::compile_program(prog, &options).unwrap_or_else(|e| panic!("{family}: {e:?}"));
            let ptx = nvrtc::get_ptx(prog).unwrap();
            let _ = nvrtc::destroy_program(prog);
            CStr::from_ptr(ptx.as_ptr()).to_string_lossy().into_owned()
        }
    }

    /// The element-wise kernels load and store their packs as 128-bit accesses (`.v4`; the
    /// one-by-one path is there too, for views at odd offsets and the tail): checked in the
    /// PTX NVRTC emits, where a pack that fell back to 16-bit accesses would show.
    #[test]
    fn the_element_wise_kernels_move_16_bytes_per_access() {
        if !nvrtc_present() {
            eprintln!("skipped: libnvrtc not found");
            return;
        }
        for (family, entries) in [
            ("residual", &["residual_forward_bf16", "residual_forward_f32", "bias_broadcast_bf16"][..]),
            ("gelu", &["gelu_forward_bf16", "gelu_backward_f16"]),
            ("cast", &["cast_f32_to_bf16", "cast_bf16_to_f32"]),
            ("adamw", &["adamw_bf16", "adamw_f32"]),
            ("layernorm", &["layernorm_recompute_bf16", "layernorm_forward_bf16", "layernorm_backward_f32"]),
            ("classifier", &["crossentropy_forward_backward_bf16", "crossentropy_forward_f32"]),
            ("attention", &["permute_qkv_bf16", "permute_qkv_backward_bf16", "heads_permute_f16"]),
            ("attention", &["softmax_causal_forward_bf16", "softmax_causal_probs_f16", "softmax_causal_backward_bf16"]),
        ] {
            let ptx = ptx_of(family, "compute_90");
            for entry in entries {
                let body =
                    ptx.split(&format!(".entry {entry}(")).nth(1).unwrap_or_else(|| panic!("{entry} in the PTX"));
                let body = body.split(".entry ").next().unwrap();
                assert!(body.contains("ld.global.v4."), "{entry}: no 128-bit load");
                assert!(body.contains("st.global.v4."), "{entry}: no 128-bit store");
            }
        }
    }

    /// Every kernel fits a block of the largest size any launch uses (registers × threads
    /// within 64K: else "too many resources requested for launch" on the GPU) and spills
    /// nothing to local memory, for sm_80 and sm_90, per ptxas's own report.
    #[test]
    fn every_kernel_fits_its_largest_block_without_spilling() {
        if !nvrtc_present() {
            eprintln!("skipped: libnvrtc not found");
            return;
        }
        let mut most = KernelResources { entry: String::new(), registers: 0, spill_bytes: 0, stack_bytes: 0 };
        for (family, _) in KERNELS {
            for arch in ["sm_80", "sm_90"] {
                let kernels = kernel_resources(family, arch).unwrap_or_else(|e| panic!("{e}"));
                let mut entries: Vec<String> = kernels.iter().map(|k| k.entry.clone()).collect();
                let mut declared = entry_points(family).unwrap();
                entries.sort();
                declared.sort();
                assert_eq!(entries, declared, "{family}/{arch}: ptxas reported other functions");
                for k in kernels {
                    // A kernel that declares its largest block (`__launch_bounds__`) is launched
                    // with at most that; the others with up to MAX_BLOCK_THREADS.
                    let block = launch_bound(family, &k.entry).unwrap().unwrap_or(backend::MAX_BLOCK_THREADS);
                    let per_block = (65536 / block).min(255);
                    assert!(k.registers > 0 && k.registers <= per_block, "{family}/{arch}: {k:?} (block {block})");
                    assert_eq!(k.spill_bytes, 0, "{family}/{arch}: {k:?}");
                    // Tensor-core kernels keep their fragments in registers, or they crawl; so do
                    // the element-wise kernels their 16-byte packs.
                    if k.entry.starts_with("flash_") || PACKED.iter().any(|p| k.entry.starts_with(p)) {
                        assert_eq!(k.stack_bytes, 0, "{family}/{arch}: {k:?}");
                    }
                    if k.registers > most.registers {
                        most = k;
                    }
                }
            }
        }
        eprintln!("most registers: {} ({})", most.registers, most.entry);
    }

    #[test]
    fn the_attention_kernels_setting_is_parsed_and_names_entry_points_that_exist() {
        use crate::engine::backend::workspace::CudaAttentionKernels as Kernels;
        use backend::fused_entry;
        use half::{bf16, f16};
        assert_eq!(Kernels::parse(None), Some(Kernels::Gemm));
        assert_eq!(Kernels::parse(Some("gemm")), Some(Kernels::Gemm));
        assert_eq!(Kernels::parse(Some("fused")), Some(Kernels::Fused));
        assert_eq!(Kernels::parse(Some("flash")), None);
        // (kernels, pass, head size) → the fused entry point in each storage, or the cuBLAS path
        let table = [
            (
                Kernels::Fused,
                "forward",
                64,
                [None, Some("flash_attention_forward_hs64_bf16"), Some("flash_attention_forward_hs64_f16")],
            ),
            (
                Kernels::Fused,
                "backward_dq",
                32,
                [None, Some("flash_attention_backward_dq_hs32_bf16"), Some("flash_attention_backward_dq_hs32_f16")],
            ),
            (
                Kernels::Fused,
                "backward_dkv",
                64,
                [None, Some("flash_attention_backward_dkv_hs64_bf16"), Some("flash_attention_backward_dkv_hs64_f16")],
            ),
            (Kernels::Fused, "forward", 48, [None; 3]),
            (Kernels::Fused, "backward_dkv", 128, [None; 3]),
            (Kernels::Gemm, "forward", 64, [None; 3]),
            (Kernels::Gemm, "backward_dq", 32, [None; 3]),
        ];
        let entries = entry_points("attention").unwrap();
        for (kernels, pass, hs, want) in table {
            let got = [
                fused_entry::<f32>(kernels, pass, hs, "f32"),
                fused_entry::<bf16>(kernels, pass, hs, "bf16"),
                fused_entry::<f16>(kernels, pass, hs, "f16"),
            ];
            for (got, want) in got.into_iter().zip(want) {
                assert_eq!(got.as_deref(), want, "{kernels:?} {pass} hs {hs}");
                if let Some(entry) = got {
                    assert!(entries.contains(&entry), "{entry} is not in kernels/attention.cu");
                    assert_eq!(launch_bound("attention", &entry).unwrap(), Some(128), "{entry}");
                }
            }
        }
    }

    #[test]
    fn kernel_signatures_are_read_from_the_source() {
        for (family, _) in KERNELS {
            for (entry, params) in signatures(family).unwrap() {
                assert!(params.contains(&Param::Ptr), "{family}: {entry} takes no buffer: {params:?}");
            }
        }
        let adamw = signatures("adamw").unwrap();
        assert!(adamw.iter().all(|(name, _)| name.starts_with("adamw_")), "{adamw:?}");
        let src = "extern \"C\" __global__ void k_f32(float* a, const unsigned int* t, int n, long m, float s) { }\n\
                   extern \"C\" __global__ void j_f32(double d) { }";
        let err = parse_signatures("x", src).unwrap_err().to_string();
        assert!(err.contains("j_f32: parameter `double d` of a type launches cannot pass"), "{err}");
        let ok = parse_signatures("x", &src[..src.find('\n').unwrap()]).unwrap();
        assert_eq!(ok, [("k_f32".to_string(), vec![Param::Ptr, Param::Ptr, Param::I32, Param::I64, Param::F32])]);
    }

    #[test]
    fn the_ptxas_report_is_read_per_kernel() {
        let log = "ptxas info    : 1 bytes gmem
ptxas info    : Compiling entry function 'a_f32' for 'sm_90'
ptxas info    : Function properties for a_f32
ptxas         .     24 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 128 bytes smem
ptxas info    : Compiling entry function 'b_bf16' for 'sm_90'
ptxas info    : Function properties for b_bf16
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 16 registers, used 0 barriers";
        assert_eq!(
            parse_ptxas_report(log),
            [
                KernelResources { entry: "a_f32".into(), registers: 40, spill_bytes: 20, stack_bytes: 24 },
                KernelResources { entry: "b_bf16".into(), registers: 16, spill_bytes: 0, stack_bytes: 0 },
            ]
        );
    }

    #[test]
    fn a_kernel_that_does_not_compile_is_a_typed_error_with_the_log() {
        if !nvrtc_present() {
            assert!(matches!(compile_source("broken", "", "sm_90", &[]), Err(CudaError::NoNvrtc { .. })));
            eprintln!("skipped: libnvrtc not found");
            return;
        }
        let src = "extern \"C\" __global__ void broken_f32(float* x) { x[0] = undeclared; }";
        let err = compile_source("broken", src, "sm_90", &[]).unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, CudaError::Compile { .. }), "{text}");
        assert!(text.starts_with("kernel broken does not compile for sm_90: "), "{text}");
        assert!(text.contains("broken.cu") && text.contains("undeclared"), "{text}");
        let (ok, _) =
            compile_source("fine", "extern \"C\" __global__ void fine_f32(float* x) { x[0] = 1.0f; }", "sm_80", &[])
                .unwrap();
        assert!(cubin_defines(&ok, "fine_f32") && !cubin_defines(&ok, "broken_f32"));
    }

    /// The report loads what it can and says where each came from; on a machine without a
    /// driver libcuda is reported missing. In CI (HEADROOM_NVRTC_TEST=1, HEADROOM_NCCL_TEST=1)
    /// NVRTC and NCCL must be reported loaded from pip's files.
    #[test]
    fn the_library_report_names_each_library_its_version_and_file() {
        let report = library_report();
        let names: Vec<&str> = report.iter().map(|l| l.name).collect();
        assert_eq!(names, ["libcuda", "libnvrtc", "libcublas", "libnccl"]);
        for l in &report {
            eprintln!("{:<10} {:<5} {}", l.name, l.loaded, l.detail);
            assert!(!l.detail.is_empty());
        }
        if !driver_present() {
            assert!(!report[0].loaded && report[0].detail.contains("no NVIDIA driver"));
        }
        if std::env::var("HEADROOM_NVRTC_TEST").is_ok_and(|v| v == "1") {
            assert!(report[1].loaded, "{}", report[1].detail);
            assert!(
                report[1].detail.starts_with("NVRTC 1") && report[1].detail.contains("/libnvrtc.so.1"),
                "{}",
                report[1].detail
            );
        }
        if std::env::var("HEADROOM_NCCL_TEST").is_ok_and(|v| v == "1") {
            assert!(report[3].loaded && report[3].detail.contains("/libnccl.so.2"), "{}", report[3].detail);
        }
        if !report[2].loaded {
            assert!(
                report[2].detail.starts_with("cuBLAS (libcublas.so.13 or .so.12) not found"),
                "{}",
                report[2].detail
            );
        }
    }

    #[test]
    fn no_driver_is_a_typed_error_not_a_panic() {
        if driver_present() {
            return; // a GPU machine: covered by scripts/gpu-check.sh
        }
        let err = super::CudaBackend::new(0, None, false).unwrap_err();
        assert_eq!(err.to_string(), "device cuda:0 requested but no CUDA driver found (libcuda could not be loaded)");
    }
}
