//! The paper's per-seed curve, computed the way its analysis scripts compute it (numpy's
//! rounding and summation), so that a run can be checked against the published table digit
//! for digit.

/// The paper's per-seed columns from a run's per-pod counters, computed as
/// `merge_alloc_discrete.py` does: arrived % rounded half-to-even to an integer, allocation %
/// rounded to 2 decimals (Python's `round` on a float), the mean over the pods of each column
/// (or of the columns ±1 when it has none), and that mean rounded as `round` does on the
/// numpy float pandas returns: `rint(x · 100) / 100`. The sum and that last rounding follow numpy
/// exactly because the mean of ~100 two-decimal values often is an exact decimal tie.
pub fn paper_columns(milli: &[(u64, u64)], gpus: u64) -> Vec<Option<f64>> {
    let pct = |x: u64| x as f64 / gpus as f64 / 10.0;
    let round2 = |x: f64| -> f64 { format!("{x:.2}").parse().expect("a number") };
    let rows: Vec<(f64, f64)> = milli
        .iter()
        .map(|&(a, u)| (pct(a).round_ties_even(), round2(pct(u))))
        .collect();
    (0..=130)
        .map(|col| {
            let col = f64::from(col);
            let mut vals: Vec<f64> = rows.iter().filter(|r| r.0 == col).map(|r| r.1).collect();
            if vals.is_empty() {
                vals = rows
                    .iter()
                    .filter(|r| r.0 >= col - 1.0 && r.0 <= col + 1.0)
                    .map(|r| r.1)
                    .collect();
            }
            (!vals.is_empty()).then(|| {
                let mean = pairwise_sum(&vals) / vals.len() as f64;
                (mean * 100.0).round_ties_even() / 100.0
            })
        })
        .collect()
}

/// numpy's pairwise summation (what pandas' `mean` adds with), so that the rounding of the
/// means can match the published table to the last digit.
fn pairwise_sum(a: &[f64]) -> f64 {
    const BLOCK: usize = 128;
    let n = a.len();
    if n < 8 {
        a.iter().fold(0.0, |s, &x| s + x)
    } else if n <= BLOCK {
        let mut r = [0.0f64; 8];
        r.copy_from_slice(&a[..8]);
        let whole = n - n % 8;
        for chunk in a[8..whole].chunks_exact(8) {
            for (rj, &x) in r.iter_mut().zip(chunk) {
                *rj += x;
            }
        }
        let mut res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for &x in &a[whole..] {
            res += x;
        }
        res
    } else {
        let mut n2 = n / 2;
        n2 -= n2 % 8;
        pairwise_sum(&a[..n2]) + pairwise_sum(&a[n2..])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairwise_sum_adds_up() {
        for n in [0, 1, 7, 8, 9, 127, 128, 129, 300, 1000] {
            let v: Vec<f64> = (0..n).map(|i| f64::from(i % 7)).collect();
            assert_eq!(pairwise_sum(&v), v.iter().sum::<f64>(), "n = {n}");
        }
        // Not a left-to-right sum: eight running sums, one per position modulo 8.
        let mut v = vec![1e16];
        v.extend([1.0; 7]);
        v.push(-1e16);
        v.extend([1.0; 7]);
        assert_eq!(pairwise_sum(&v), 14.0);
        assert_eq!(v.iter().sum::<f64>(), 7.0);
    }

    #[test]
    fn paper_columns_follow_merge_alloc_discrete() {
        // One GPU. Pods of 10, 20, 40 milli: arrived 1 %, 3 %, 7 %; the second one fails.
        let rows = [(10, 10), (30, 10), (70, 50)];
        let cols = paper_columns(&rows, 1);
        assert_eq!(cols[1], Some(1.0));
        assert_eq!(cols[3], Some(1.0));
        assert_eq!(cols[7], Some(5.0));
        // No pod at 2 %: the pods at 1..=3 %.
        assert_eq!(cols[2], Some(1.0));
        // No pod at 5 % nor at 4..=6 %.
        assert_eq!(cols[5], None);
        assert_eq!(cols[0], Some(1.0));
        assert_eq!(cols.len(), 131);
        // Arrived 0.5 % rounds half to even: column 0; 1.5 % to column 2.
        let cols = paper_columns(&[(5, 5), (15, 15)], 1);
        assert_eq!(cols[0], Some(0.5));
        assert_eq!(cols[2], Some(1.5));
    }
}
