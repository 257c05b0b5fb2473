//! Deterministic random numbers for init and batch sampling (splitmix64 + Box-Muller), owned here
//! so results never depend on a dependency's version.

/// splitmix64: a stateless mix of one 64-bit word.
pub fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// Two independent standard normals from counter `p` of stream `key` (Box-Muller on the two
/// 24-bit halves of one mixed word; |z| < 5.9). The logarithm and the sine/cosine are the
/// branch-free polynomials below, not libm's: the same bits on every machine and library, and
/// a loop the compiler vectorises (initialising 1.5B weights is this function 750M times).
#[inline]
fn normal_pair(key: u64, p: u64) -> (f32, f32) {
    let (u1, u2) = uniform_pair(key, p);
    box_muller(u1, u2)
}

/// The two uniforms of counter `p`: u1 in (0, 1), u2 in [0, 1), 24 bits each.
#[inline]
fn uniform_pair(key: u64, p: u64) -> (f32, f32) {
    let z = mix64(key.wrapping_add(p.wrapping_mul(GAMMA)));
    let u1 = ((z >> 40) as f32 + 0.5) * (1.0 / (1u32 << 24) as f32);
    let u2 = (z & 0xFF_FFFF) as f32 * (1.0 / (1u32 << 24) as f32);
    (u1, u2)
}

#[inline]
fn box_muller(u1: f32, u2: f32) -> (f32, f32) {
    let r = (-2.0 * ln_unit(u1)).sqrt();
    let (s, c) = sin_cos_turns(u2);
    (r * c, r * s)
}

/// ln x for x in (0, 1] (a normal f32): x = 2^e · m with m in [√½, √2), ln m = 2 atanh(s),
/// s = (m − 1)/(m + 1), |s| ≤ 0.172, by its series to s⁹ (truncation < 4e-10).
#[inline]
fn ln_unit(x: f32) -> f32 {
    let bits = x.to_bits();
    let mut e = ((bits >> 23) & 0xff) as i32 - 127;
    let mut m = f32::from_bits((bits & 0x007f_ffff) | 0x3f80_0000);
    let big = m > std::f32::consts::SQRT_2;
    m = if big { m * 0.5 } else { m };
    e += big as i32;
    let s = (m - 1.0) / (m + 1.0);
    let s2 = s * s;
    let series = s * (2.0 + s2 * (2.0 / 3.0 + s2 * (2.0 / 5.0 + s2 * (2.0 / 7.0 + s2 * (2.0 / 9.0)))));
    e as f32 * std::f32::consts::LN_2 + series
}

/// (sin 2πu, cos 2πu) for u in [0, 1]: the nearest quarter turn q and the rest x in [−π/4, π/4],
/// Taylor polynomials of x (to x⁹ and x¹⁰: truncation < 3e-8), rotated by q quarter turns.
#[inline]
fn sin_cos_turns(u: f32) -> (f32, f32) {
    let quarters = u * 4.0;
    let q = (quarters + 0.5) as i32; // round half up; u ≥ 0
    let x = (quarters - q as f32) * std::f32::consts::FRAC_PI_2;
    let x2 = x * x;
    let sin = x * (1.0 - x2 / 6.0 * (1.0 - x2 / 20.0 * (1.0 - x2 / 42.0 * (1.0 - x2 / 72.0))));
    let cos = 1.0 - x2 / 2.0 * (1.0 - x2 / 12.0 * (1.0 - x2 / 30.0 * (1.0 - x2 / 56.0 * (1.0 - x2 / 90.0))));
    // Rotating by q quarter turns: odd q swaps sine and cosine, q = 1, 2 negate the sine's
    // result, q = 2, 3 the cosine's.
    let (s, c) = if q & 1 == 1 { (cos, sin) } else { (sin, cos) };
    let s = if q & 2 == 2 { -s } else { s };
    let c = if (q + 1) & 2 == 2 { -c } else { c };
    (s, c)
}

/// `dst[j] = std · N(0, 1)` for flat index `first + j`: indices 2p and 2p+1 share the pair of
/// counter p, so each value depends only on (key, index), never on how `dst` was cut or how
/// many threads filled it.
pub fn normal_fill(key: u64, first: usize, std: f32, dst: &mut [f32]) {
    use rayon::prelude::*;
    const CHUNK: usize = 1 << 16; // even: every chunk after the head starts on a pair
    if dst.is_empty() {
        return;
    }
    let (head, rest) = dst.split_at_mut(first % 2);
    if let Some(h) = head.first_mut() {
        *h = normal_pair(key, (first / 2) as u64).1 * std;
    }
    let start = first + head.len();
    rest.par_chunks_mut(CHUNK).enumerate().for_each(|(i, chunk)| {
        let p0 = ((start + i * CHUNK) / 2) as u64;
        let half = (chunk.len() / 2) as u64;
        // Blocks of pairs: the counters' uniforms first, then the transcendental part in a
        // loop over plain arrays, which the compiler vectorises.
        const BLOCK: usize = 256;
        let mut pairs = chunk.chunks_exact_mut(2);
        let (mut u1, mut u2) = ([0f32; BLOCK], [0f32; BLOCK]);
        let mut j = 0u64;
        while pairs.len() > 0 {
            let n = pairs.len().min(BLOCK);
            for k in 0..n {
                (u1[k], u2[k]) = uniform_pair(key, p0 + j + k as u64);
            }
            for (pair, (&a, &b)) in (&mut pairs).take(n).zip(u1.iter().zip(&u2)) {
                let (x, y) = box_muller(a, b);
                pair[0] = x * std;
                pair[1] = y * std;
            }
            j += n as u64;
        }
        if let [last] = pairs.into_remainder() {
            *last = normal_pair(key, p0 + half).0 * std;
        }
    });
}

/// A tiny sequential generator; its whole state is one u64 (saved in checkpoints).
#[derive(Debug, Clone)]
pub struct Rng {
    pub state: u64,
}

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng { state: mix64(seed ^ 0x6865_6164_726f_6f6d) }
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix64(self.state)
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Standard normal (Box-Muller, one value per call for simplicity and determinism).
    pub fn normal(&mut self) -> f64 {
        let u1 = self.uniform().max(1e-300);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normal_fill_is_a_function_of_the_index_whatever_the_cut() {
        let n = 200_001;
        let mut whole = vec![0.0f32; n];
        normal_fill(7, 3, 1.0, &mut whole);
        // Any split (odd starts included) gives the same values.
        for cut in [1, 2, 65_537, 131_072, 199_999] {
            let mut a = vec![0.0f32; cut];
            let mut b = vec![0.0f32; n - cut];
            normal_fill(7, 3, 1.0, &mut a);
            normal_fill(7, 3 + cut, 1.0, &mut b);
            a.extend(b);
            assert!(a.iter().zip(&whole).all(|(x, y)| x.to_bits() == y.to_bits()), "cut at {cut}");
        }
        // Standard normal moments.
        let mean = whole.iter().map(|&x| x as f64).sum::<f64>() / n as f64;
        let var = whole.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n as f64;
        let kurt = whole.iter().map(|&x| (x as f64 - mean).powi(4)).sum::<f64>() / n as f64 / (var * var);
        assert!(mean.abs() < 0.01 && (var - 1.0).abs() < 0.01 && (kurt - 3.0).abs() < 0.05, "{mean} {var} {kurt}");
        // The polynomials against the standard library's functions.
        for i in 1..=(1 << 16) {
            let u = i as f32 / (1 << 16) as f32;
            let (s, c) = sin_cos_turns(u);
            let (s_ref, c_ref) = (std::f64::consts::TAU * u as f64).sin_cos();
            assert!((s as f64 - s_ref).abs() < 2e-7 && (c as f64 - c_ref).abs() < 2e-7, "sin_cos({u}): {s} {c}");
            let tiny = u * u * u * u; // down to 2^-64
            let ln_ref = (tiny as f64).ln();
            assert!((ln_unit(tiny) as f64 - ln_ref).abs() < 1e-6 * ln_ref.abs().max(1.0), "ln({tiny})");
        }
        // Another key, other values.
        let mut other = vec![0.0f32; 16];
        normal_fill(8, 3, 1.0, &mut other);
        assert_ne!(other[..], whole[..16]);
    }
}
