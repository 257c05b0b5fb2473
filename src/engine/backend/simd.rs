//! The host's vector units: which is the widest this CPU has, and `widest`, which runs a hot
//! loop compiled for it (chosen at run time, so one binary uses AVX-512 where there is one and
//! still runs on any x86-64).
//!
//! Only instruction selection changes: Rust never contracts a multiply and an add into an FMA
//! or reorders float arithmetic, so a loop gives the same bits under every choice.

/// The vector units `widest` compiles for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))] // only x86-64 detects the wider ones
enum Unit {
    Avx512,
    Avx2,
    /// The build's baseline (SSE2 on x86-64, NEON on aarch64).
    Baseline,
}

/// The widest unit this CPU has (the standard library caches the detection).
#[inline(always)]
fn detect() -> Unit {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return Unit::Avx512;
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            return Unit::Avx2;
        }
    }
    Unit::Baseline
}

/// The widest vector unit this machine has ("avx512f", "avx2", or the build's baseline: "sse2"
/// on x86-64, "neon" on aarch64).
pub fn host_simd() -> &'static str {
    match detect() {
        Unit::Avx512 => "avx512f",
        Unit::Avx2 => "avx2",
        Unit::Baseline if cfg!(target_arch = "x86_64") => "sse2",
        Unit::Baseline if cfg!(target_arch = "aarch64") => "neon",
        Unit::Baseline => "scalar",
    }
}

/// `f()` compiled for the widest vector unit this machine has. `f` is inlined into a function
/// built with that unit's target features, so the loops in its body (and in the
/// `#[inline(always)]` functions it calls) are vectorised for it; a call through a function
/// that is not inlined runs at the baseline. Pass the closure as `#[inline(always)] || …`:
/// `f` has three call sites (one per unit), and LLVM declines to inline a large body into
/// three, which compiles it once, at the baseline (the cross-entropy's row loop did).
#[inline(always)]
pub fn widest<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f")]
        fn avx512<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        #[target_feature(enable = "avx2")]
        fn avx2<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        match detect() {
            // SAFETY: the CPU has AVX-512F (`detect` checked it).
            Unit::Avx512 => return unsafe { avx512(f) },
            // SAFETY: the CPU has AVX2 (`detect` checked it).
            Unit::Avx2 => return unsafe { avx2(f) },
            Unit::Baseline => {}
        }
    }
    f()
}
