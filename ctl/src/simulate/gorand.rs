//! Reproduces the streams of Go's `math/rand` (its `rngSource` and the `Rand` methods the
//! paper's simulator calls), derived from the published algorithm; the seeding table is
//! computed by jump-ahead, not copied.
//!
//! Go's generator is an additive lagged Fibonacci generator over 64-bit words (Mitchell and
//! Reeds): 607 words, lags 607 and 273,
//! `x[n] = x[n-607] + x[n-273] (mod 2^64)`; each draw returns the new word's low 63 bits.
//! Seeding runs the Park–Miller generator `x ← 48271·x mod (2^31−1)` from the seed (20
//! warm-up steps, then three steps per word) and XORs each word with a fixed table,
//! `rngCooked`. Go's `gen_cooked.go` documents where that table comes from: seed the same
//! lagged Fibonacci generator with a simpler Park–Miller fill from seed 1 and run it 7.8·10^12
//! steps. The recurrence is linear over Z/2^64, so that state is reached here by jump-ahead:
//! `x^N mod (x^607 − x^334 − 1)` with wrapping 64-bit coefficients gives each far word as a
//! combination of the 607 starting words. It takes a few milliseconds and is done once
//! ([`OnceLock`]).
//!
//! The `Rand` methods keep Go's exact consumption of draws: `Int31n`/`Intn` reject above the
//! largest multiple of n, `Shuffle` uses the internal multiply-shift `int31n` (Lemire), and
//! `Perm` draws `Intn(i+1)` for every i including i = 0. Outputs were checked against Go
//! 1.19's `math/rand` (see the tests); the algorithm has not changed since Go 1.

use std::sync::OnceLock;

/// Words of state.
const LEN: usize = 607;
/// The short lag.
const TAP: usize = 273;
/// The exponent of the middle term of the characteristic polynomial, `LEN − TAP`.
const MID: usize = LEN - TAP;
/// Go's `Int63` keeps the low 63 bits.
const MASK: u64 = (1 << 63) - 1;
/// The Park–Miller modulus, 2^31 − 1.
const PM_MOD: i64 = (1 << 31) - 1;
/// Steps from gen_cooked.go's start to the state that is Go's table (`7.8e12` in its loop).
const COOKED_STEPS: u64 = 7_800_000_000_000;

/// One step of the Park–Miller "minimal standard" generator with multiplier 48271, as Go
/// computes it (Schrage's method; same values as `48271·x mod (2^31−1)` for 0 < x < 2^31−1).
fn seedrand(x: i32) -> i32 {
    let (q, r) = (44_488, 3_399);
    let (hi, lo) = (x / q, x % q);
    let x = 48_271 * lo - r * hi;
    if x < 0 { x + PM_MOD as i32 } else { x }
}

/// Reduce a seed as Go does: modulo 2^31−1 into [1, 2^31−1), 0 mapped to 89482311.
fn reduce_seed(seed: i64) -> i32 {
    let mut s = seed % PM_MOD;
    if s < 0 {
        s += PM_MOD;
    }
    if s == 0 {
        s = 89_482_311;
    }
    s as i32
}

/// Fill 607 words from a Park–Miller stream: 20 warm-up steps, then each word from three
/// consecutive values shifted by `shifts` and XORed.
fn park_miller_fill(seed: i32, shifts: (u32, u32)) -> [u64; LEN] {
    let mut vec = [0u64; LEN];
    let mut x = seed;
    for _ in 0..20 {
        x = seedrand(x);
    }
    for w in vec.iter_mut() {
        x = seedrand(x);
        let mut u = (x as u64) << shifts.0;
        x = seedrand(x);
        u ^= (x as u64) << shifts.1;
        x = seedrand(x);
        u ^= x as u64;
        *w = u;
    }
    vec
}

/// The state as a lagged Fibonacci sequence. Step n (n ≥ 1) writes word `(MID − n) mod LEN`
/// with `x[n] = x[n−607] + x[n−273]`; the initial words are x[−606..=0], word p holding the
/// x[m] with m ≡ MID − p (mod LEN).
fn word_of(m: u64) -> usize {
    (MID + LEN - (m % LEN as u64) as usize) % LEN
}

/// Polynomials modulo `P(x) = x^607 − x^334 − 1` with coefficients in Z/2^64.
type Poly = Vec<u64>;

/// `a · b mod P`.
fn mul_mod(a: &[u64], b: &[u64]) -> Poly {
    let mut c = vec![0u64; 2 * LEN - 1];
    for (i, &ai) in a.iter().enumerate() {
        if ai == 0 {
            continue;
        }
        for (cj, &bj) in c[i..i + LEN].iter_mut().zip(b) {
            *cj = cj.wrapping_add(ai.wrapping_mul(bj));
        }
    }
    reduce(c)
}

/// Fold degrees ≥ 607 down with `x^d = x^(d−273) + x^(d−607)`, highest first.
fn reduce(mut c: Vec<u64>) -> Poly {
    for d in (LEN..c.len()).rev() {
        let v = std::mem::take(&mut c[d]);
        if v != 0 {
            c[d - TAP] = c[d - TAP].wrapping_add(v);
            c[d - LEN] = c[d - LEN].wrapping_add(v);
        }
    }
    c.truncate(LEN);
    c
}

/// `x^n mod P`.
fn x_pow(n: u64) -> Poly {
    let mut r = vec![0u64; LEN];
    r[0] = 1;
    for bit in (0..u64::BITS - n.leading_zeros()).rev() {
        r = mul_mod(&r, &r);
        if n >> bit & 1 == 1 {
            // Multiply by x: shift up one degree and fold x^607.
            let top = r.pop().expect("LEN coefficients");
            r.insert(0, 0);
            r[0] = r[0].wrapping_add(top);
            r[MID] = r[MID].wrapping_add(top);
        }
    }
    r
}

/// The words after `n` steps (n ≥ LEN) of the generator started from `start` (tap 0, feed
/// `MID`), without running them: word p then holds the last x[m] written there,
/// m ∈ (n−607, n], and x[m] = Σ_j c_j · x[j−606] where `x^(m+606) ≡ Σ_j c_j x^j (mod P)`.
fn jump(start: &[u64; LEN], n: u64) -> [u64; LEN] {
    assert!(n >= LEN as u64, "every word must have been rewritten");
    // z[j] = x[j − 606], the starting words in sequence order.
    let z: Vec<u64> = (0..LEN)
        .map(|j| start[word_of((j as u64 + LEN as u64 * 2 - 606) % LEN as u64)])
        .collect();
    let mut out = [0u64; LEN];
    let mut c = x_pow(n);
    for t in 0..LEN as u64 {
        // c = x^(n + t) mod P gives x[n − 606 + t].
        let m = n - 606 + t;
        out[word_of(m)] = c
            .iter()
            .zip(&z)
            .fold(0u64, |s, (&a, &b)| s.wrapping_add(a.wrapping_mul(b)));
        let top = c.pop().expect("LEN coefficients");
        c.insert(0, 0);
        c[0] = c[0].wrapping_add(top);
        c[MID] = c[MID].wrapping_add(top);
    }
    out
}

/// Go's `rngCooked`: gen_cooked.go's start (Park–Miller fill from seed 1, shifts 20 and 10)
/// after 7.8·10^12 steps. Go's table holds these words (older releases kept their low 63 bits,
/// which is all `Int63` ever sees).
fn cooked() -> &'static [u64; LEN] {
    static COOKED: OnceLock<Box<[u64; LEN]>> = OnceLock::new();
    COOKED.get_or_init(|| Box::new(jump(&park_miller_fill(1, (20, 10)), COOKED_STEPS)))
}

/// A generator with the streams of Go's `rand.New(rand.NewSource(seed))`, which are also those
/// of the global functions after `rand.Seed(seed)`.
#[derive(Clone)]
pub struct GoRand {
    vec: Box<[u64; LEN]>,
    tap: usize,
    feed: usize,
}

impl std::fmt::Debug for GoRand {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GoRand")
            .field("tap", &self.tap)
            .field("feed", &self.feed)
            .finish_non_exhaustive()
    }
}

impl GoRand {
    /// Seeded as Go's `rngSource.Seed(seed)`.
    pub fn new(seed: i64) -> Self {
        let mut vec = Box::new(park_miller_fill(reduce_seed(seed), (40, 20)));
        for (w, c) in vec.iter_mut().zip(cooked().iter()) {
            *w ^= c;
        }
        GoRand {
            vec,
            tap: 0,
            feed: MID,
        }
    }

    /// One step: the new 64-bit word (Go's `rngSource.Uint64`).
    fn step(&mut self) -> u64 {
        self.tap = if self.tap == 0 { LEN - 1 } else { self.tap - 1 };
        self.feed = if self.feed == 0 {
            LEN - 1
        } else {
            self.feed - 1
        };
        let x = self.vec[self.feed].wrapping_add(self.vec[self.tap]);
        self.vec[self.feed] = x;
        x
    }

    /// Go's `Int63`: a non-negative 63-bit integer.
    pub fn int63(&mut self) -> i64 {
        (self.step() & MASK) as i64
    }

    /// Go's `Uint32`: bits 31..62 of one `Int63`.
    pub fn uint32(&mut self) -> u32 {
        (self.int63() >> 31) as u32
    }

    /// Go's `Int31`: the top 31 bits of one `Int63`.
    pub fn int31(&mut self) -> i32 {
        (self.int63() >> 32) as i32
    }

    /// Go's `Int` on a 64-bit platform: one `Int63`.
    pub fn int(&mut self) -> i64 {
        self.int63()
    }

    /// Go's `Int63n`: uniform in [0, n), by rejection above the largest multiple of n.
    pub fn int63n(&mut self, n: i64) -> i64 {
        assert!(n > 0, "invalid argument to int63n");
        if n & (n - 1) == 0 {
            return self.int63() & (n - 1);
        }
        let max = (MASK - (1u64 << 63) % n as u64) as i64;
        let mut v = self.int63();
        while v > max {
            v = self.int63();
        }
        v % n
    }

    /// Go's `Int31n`: uniform in [0, n), by rejection above the largest multiple of n.
    pub fn int31n(&mut self, n: i32) -> i32 {
        assert!(n > 0, "invalid argument to int31n");
        if n & (n - 1) == 0 {
            return self.int31() & (n - 1);
        }
        let max = ((1u32 << 31) - 1 - (1u32 << 31) % n as u32) as i32;
        let mut v = self.int31();
        while v > max {
            v = self.int31();
        }
        v % n
    }

    /// Go's unexported `int31n` (used by `Shuffle`): multiply-shift with Lemire's rejection.
    fn int31n_lemire(&mut self, n: i32) -> i32 {
        let n = n as u32;
        let mut prod = u64::from(self.uint32()) * u64::from(n);
        if (prod as u32) < n {
            let thresh = n.wrapping_neg() % n;
            while (prod as u32) < thresh {
                prod = u64::from(self.uint32()) * u64::from(n);
            }
        }
        (prod >> 32) as i32
    }

    /// Go's `Intn`: `Int31n` below 2^31, `Int63n` above.
    pub fn intn(&mut self, n: usize) -> usize {
        assert!(n > 0, "invalid argument to intn");
        if n <= i32::MAX as usize {
            self.int31n(n as i32) as usize
        } else {
            self.int63n(n as i64) as usize
        }
    }

    /// Go's `Float64`: `Int63 / 2^63`, drawn again in the (never seen) case it rounds to 1.
    pub fn float64(&mut self) -> f64 {
        loop {
            let f = self.int63() as f64 / (1u64 << 63) as f64;
            if f < 1.0 {
                return f;
            }
        }
    }

    /// Go's `Perm`: a permutation of 0..n, one `Intn(i + 1)` for every i, i = 0 included.
    pub fn perm(&mut self, n: usize) -> Vec<usize> {
        let mut m = vec![0usize; n];
        for i in 0..n {
            let j = self.intn(i + 1);
            m[i] = m[j];
            m[j] = i;
        }
        m
    }

    /// Go's `Shuffle` (Fisher–Yates from the end, `int31n` below 2^31 elements).
    pub fn shuffle<T>(&mut self, s: &mut [T]) {
        let mut i = s.len();
        while i > 1 {
            i -= 1;
            let j = if i + 1 > i32::MAX as usize {
                self.int63n(i as i64 + 1) as usize
            } else {
                self.int31n_lemire(i as i32 + 1) as usize
            };
            s.swap(i, j);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Run `n` steps the slow way, as gen_cooked.go's `vrand` does, from a state that has
    /// already run `done` steps (which fixes where tap and feed point).
    fn direct_after(start: &[u64; LEN], done: u64, n: u64) -> [u64; LEN] {
        let back = (done % LEN as u64) as usize;
        let mut g = GoRand {
            vec: Box::new(*start),
            tap: (LEN - back) % LEN,
            feed: (MID + LEN - back) % LEN,
        };
        for _ in 0..n {
            g.step();
        }
        *g.vec
    }

    fn direct(start: &[u64; LEN], n: u64) -> [u64; LEN] {
        direct_after(start, 0, n)
    }

    #[test]
    fn seedrand_is_park_miller_48271() {
        let mut x = 1i32;
        let mut y = 1i64;
        for _ in 0..10_000 {
            x = seedrand(x);
            y = y * 48_271 % PM_MOD;
            assert_eq!(i64::from(x), y);
        }
    }

    #[test]
    fn jump_ahead_equals_stepping() {
        let start = park_miller_fill(7, (20, 10));
        for n in [607, 608, 1000, 5_000, 12_345] {
            assert_eq!(jump(&start, n), direct(&start, n), "n = {n}");
        }
    }

    #[test]
    fn derived_table_properties() {
        let t = cooked();
        // Distinct, well-mixed words: about half of all bits set, every bit position used.
        let mut sorted = t.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), LEN);
        let ones: u32 = t.iter().map(|w| w.count_ones()).sum();
        let frac = f64::from(ones) / (64.0 * LEN as f64);
        assert!((0.48..0.52).contains(&frac), "{frac}");
        assert_eq!(t.iter().fold(0, |a, w| a | w), u64::MAX);
        // The state is 7.8e12 steps on: 1000 more steps from it equal a jump of 7.8e12 + 1000.
        let start = park_miller_fill(1, (20, 10));
        assert_eq!(
            direct_after(t, COOKED_STEPS, 1000),
            jump(&start, COOKED_STEPS + 1000)
        );
    }

    // Expected values below were printed by Go 1.19's math/rand
    // (`rand.New(rand.NewSource(seed))`, and `rand.Seed` + the global functions).

    #[test]
    fn int63_matches_go() {
        let mut r = GoRand::new(42);
        let want = [
            3_440_579_354_231_278_675,
            608_747_136_543_856_411,
            5_571_782_338_101_878_760,
            1_926_012_586_526_624_009,
            404_153_945_743_547_657,
        ];
        for w in want {
            assert_eq!(r.int63(), w);
        }
        assert_eq!(GoRand::new(0).int63(), 8_717_895_732_742_165_505);
        assert_eq!(GoRand::new(-5).int63(), 1_811_683_815_564_572_222);
        assert_eq!(
            GoRand::new((1 << 40) + 7).int63(),
            3_978_647_029_347_767_025
        );
    }

    #[test]
    fn long_stream_matches_go() {
        // 10,000 draws use every word of the table many times over.
        let mut r = GoRand::new(1);
        let mut h = 0u64;
        for _ in 0..10_000 {
            h = h.wrapping_mul(31).wrapping_add(r.int63() as u64);
        }
        assert_eq!(h, 721_828_143_724_379_667);
        assert_eq!(r.int63(), 6_039_733_029_773_106_643);
    }

    #[test]
    fn rand_methods_match_go() {
        let mut r = GoRand::new(7);
        assert_eq!(r.perm(10), [2, 0, 5, 3, 1, 6, 9, 8, 4, 7]);
        let mut a: Vec<usize> = (0..10).collect();
        r.shuffle(&mut a);
        assert_eq!(a, [9, 7, 8, 2, 6, 0, 5, 1, 3, 4]);
        assert_eq!(
            [r.intn(1000), r.intn(1 << 20), r.intn(3), r.intn(8152)],
            [310, 851_996, 0, 3147]
        );
        assert_eq!(r.int31n(7), 1);
        assert_eq!(r.int63n(1_000_000_007), 480_527_637);
        assert_eq!(r.int63n(1 << 40), 399_732_103_465);
        assert_eq!(r.float64(), 0.421_169_079_635_494_9);
        assert_eq!(r.float64(), 0.879_424_438_798_867_7);
        assert_eq!(r.int(), 6_272_943_931_788_759_867);
        assert_eq!(r.int31(), 909_385_951);
        assert_eq!(r.uint32(), 4_047_429_097);
    }

    #[test]
    fn global_functions_after_seed_match_go() {
        // rand.Seed(42); rand.Int(); rand.Shuffle(8152, ..); rand.Perm(1213)
        let mut r = GoRand::new(42);
        assert_eq!(r.int(), 3_440_579_354_231_278_675);
        let mut b: Vec<usize> = (0..8152).collect();
        r.shuffle(&mut b);
        assert_eq!(b[..8], [255, 1685, 6784, 4463, 602, 1564, 3882, 7257]);
        assert_eq!(
            r.perm(1213)[..8],
            [496, 1123, 900, 308, 233, 1090, 553, 232]
        );
    }
}
