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
/// 24-bit halves of one mixed word; |z| < 5.9).
#[inline]
fn normal_pair(key: u64, p: u64) -> (f32, f32) {
    let z = mix64(key.wrapping_add(p.wrapping_mul(GAMMA)));
    let u1 = ((z >> 40) as f32 + 0.5) * (1.0 / (1u32 << 24) as f32);
    let u2 = (z & 0xFF_FFFF) as f32 * (1.0 / (1u32 << 24) as f32);
    let r = (-2.0 * u1.ln()).sqrt();
    let (s, c) = (std::f32::consts::TAU * u2).sin_cos();
    (r * c, r * s)
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
        let mut pairs = chunk.chunks_exact_mut(2);
        for (j, pair) in (&mut pairs).enumerate() {
            let (a, b) = normal_pair(key, p0 + j as u64);
            pair[0] = a * std;
            pair[1] = b * std;
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
        // Another key, other values.
        let mut other = vec![0.0f32; 16];
        normal_fill(8, 3, 1.0, &mut other);
        assert_ne!(other[..], whole[..16]);
    }
}
