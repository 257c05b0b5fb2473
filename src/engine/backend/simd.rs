//! The host's vector units: which is the widest this CPU has, and `widest`, which runs a hot
//! loop compiled for it (chosen at run time, so one binary uses AVX-512 where there is one and
//! still runs on any x86-64).
//!
//! Only instruction selection changes: Rust never contracts a multiply and an add into an FMA
//! or reorders float arithmetic, so a loop gives the same bits under every choice.

/// The widest vector unit this machine has ("avx512f", "avx2", or the build's baseline: "sse2"
/// on x86-64, "neon" on aarch64).
pub fn host_simd() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return "avx512f";
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            return "avx2";
        }
        "sse2"
    }
    #[cfg(target_arch = "aarch64")]
    {
        "neon"
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        "scalar"
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
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F (checked just above).
            return unsafe { avx512(f) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked just above).
            return unsafe { avx2(f) };
        }
    }
    f()
}
