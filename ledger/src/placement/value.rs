//! What a GPU's free share is worth to the pods to come.
//!
//! Pack the workload's per-GPU shares into GPUs as tightly as possible: a linear program over
//! packing patterns (Gilmore and Gomory's cutting-stock relaxation), where each share size may be
//! used as often as it is expected per GPU of the cluster. Its dual prices say what a slot of
//! each size is worth: shares that pair well are worth their size, shares too many to pair well
//! are worth less. V(h), the most a free share h can hold at those prices, is the value of a GPU
//! with h free; a share s placed where V(h) − V(h − s) is least loses the least of what the
//! GPUs could still hold. The dual is solved directly, adding each pattern that a knapsack over
//! the current prices finds worth more than a GPU, until none is.

use std::panic::AssertUnwindSafe;

use microlp::{ComparisonOp, OptimizationDirection, Problem};

use crate::CORE_MILLI_PER_GPU;

/// Patterns the solve may add before it settles for the prices it has.
const MAX_ROUNDS: usize = 200;

/// V(h) for every free share h in 0..=1000 thousandths of a GPU.
#[derive(Debug, Clone, PartialEq)]
pub struct GapValues {
    v: Vec<f64>,
}

impl GapValues {
    /// Values for a workload whose GPU pods bring `items`: (share per GPU in thousandths,
    /// expected number of such slices per GPU of the cluster). Shares are clamped to 1..=1000;
    /// an empty or unsolvable list gives each free thousandth its face value.
    pub fn of(items: &[(u32, f64)]) -> GapValues {
        let items: Vec<(usize, f64)> = items
            .iter()
            .filter(|(_, q)| q.is_finite() && *q > 0.0)
            .map(|&(s, q)| (s.clamp(1, CORE_MILLI_PER_GPU) as usize, q))
            .collect();
        // The solver is third-party numerics on learned input: a failure of it, even a panic,
        // must not take placement down, only make it less clever.
        let prices = std::panic::catch_unwind(AssertUnwindSafe(|| dual_prices(&items)))
            .ok()
            .flatten();
        match prices {
            Some(y) => {
                let sizes: Vec<usize> = items.iter().map(|i| i.0).collect();
                GapValues {
                    v: knapsack(&sizes, &y).0,
                }
            }
            None => GapValues::face(),
        }
    }

    /// Each free thousandth worth itself (no workload known).
    pub fn face() -> GapValues {
        GapValues {
            v: (0..=CORE_MILLI_PER_GPU).map(f64::from).collect(),
        }
    }

    /// The value of a GPU with `free` thousandths free.
    pub fn value(&self, free: u32) -> f64 {
        self.v[free.min(CORE_MILLI_PER_GPU) as usize]
    }
}

/// The dual prices of the packing LP, one per item: minimize z + Σ q_i·w_i subject to
/// w_i + y_i ≥ s_i and, for every pattern p that fits a GPU, Σ_{i∈p} y_i ≤ z. None if the solver
/// fails.
fn dual_prices(items: &[(usize, f64)]) -> Option<Vec<f64>> {
    if items.is_empty() {
        return None;
    }
    let cap = CORE_MILLI_PER_GPU as usize;
    let mut lp = Problem::new(OptimizationDirection::Minimize);
    let z = lp.add_var(1.0, (0.0, f64::INFINITY));
    let y: Vec<_> = items
        .iter()
        .map(|&(s, _)| lp.add_var(0.0, (0.0, s as f64)))
        .collect();
    for (&(s, q), &yi) in items.iter().zip(&y) {
        let w = lp.add_var(q, (0.0, f64::INFINITY));
        lp.add_constraint([(w, 1.0), (yi, 1.0)], ComparisonOp::Ge, s as f64);
        lp.add_constraint([(yi, (cap / s) as f64), (z, -1.0)], ComparisonOp::Le, 0.0);
    }
    let sizes: Vec<usize> = items.iter().map(|i| i.0).collect();
    let mut prices = vec![0.0; items.len()];
    for _ in 0..MAX_ROUNDS {
        let solution = lp.solve().ok()?.into_solution().ok()?;
        for (p, &yi) in prices.iter_mut().zip(&y) {
            *p = solution.var_value(yi).max(0.0);
        }
        let (values, best) = knapsack(&sizes, &prices);
        if values[cap] <= solution.var_value(z) + 1e-6 * cap as f64 {
            return Some(prices);
        }
        let mut row: Vec<(microlp::Variable, f64)> = y
            .iter()
            .zip(&best)
            .filter(|(_, n)| **n > 0)
            .map(|(&yi, &n)| (yi, n as f64))
            .collect();
        row.push((z, -1.0));
        lp.add_constraint(row, ComparisonOp::Le, 0.0);
    }
    Some(prices)
}

/// Unbounded knapsack at `prices`: the best value for every capacity 0..=1000, and how many of
/// each item the best full-capacity pattern holds.
fn knapsack(sizes: &[usize], prices: &[f64]) -> (Vec<f64>, Vec<u32>) {
    let cap = CORE_MILLI_PER_GPU as usize;
    let mut v = vec![0.0f64; cap + 1];
    let mut pick: Vec<Option<usize>> = vec![None; cap + 1];
    for h in 1..=cap {
        let (mut best, mut choice) = (v[h - 1], None);
        for (i, (&s, &p)) in sizes.iter().zip(prices).enumerate() {
            if s <= h && v[h - s] + p > best {
                best = v[h - s] + p;
                choice = Some(i);
            }
        }
        v[h] = best;
        pick[h] = choice;
    }
    let mut counts = vec![0u32; sizes.len()];
    let mut h = cap;
    while h > 0 {
        match pick[h] {
            Some(i) => {
                counts[i] += 1;
                h -= sizes[i];
            }
            None => h -= 1,
        }
    }
    (v, counts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_that_pair_up_are_worth_their_size() {
        // More halves than GPUs for them: two fill a GPU exactly, so a half is worth 500 and a
        // free half too.
        let g = GapValues::of(&[(500, 2.5)]);
        assert!((g.value(1000) - 1000.0).abs() < 1e-6, "{g:?}");
        assert!((g.value(500) - 500.0).abs() < 1e-6);
        // 499 free holds no half.
        assert!(g.value(499).abs() < 1e-6);
    }

    #[test]
    fn a_share_that_strands_the_rest_prices_the_gpu() {
        // 0.8s and nothing to fill their 0.2: a GPU is worth one 0.8, and 0.2 free nothing.
        let g = GapValues::of(&[(800, 1.25)]);
        assert!((g.value(1000) - 800.0).abs() < 1e-6, "{g:?}");
        assert!(g.value(200).abs() < 1e-6);
        // With more 0.2s than the 0.8s leave room for, the 0.2 is worth its size again.
        let g = GapValues::of(&[(800, 1.0), (200, 1.5)]);
        assert!((g.value(1000) - 1000.0).abs() < 1e-6, "{g:?}");
        assert!((g.value(200) - 200.0).abs() < 1e-6, "{g:?}");
    }

    #[test]
    fn no_workload_is_face_value() {
        assert_eq!(GapValues::of(&[]), GapValues::face());
        assert_eq!(GapValues::face().value(370), 370.0);
        assert_eq!(GapValues::of(&[(300, f64::NAN)]), GapValues::face());
    }

    #[test]
    fn values_never_fall_as_the_free_share_grows() {
        let g = GapValues::of(&[(810, 0.6), (470, 0.4), (320, 0.2), (160, 0.05), (1000, 0.1)]);
        for h in 1..=1000 {
            assert!(g.value(h) + 1e-9 >= g.value(h - 1), "V({h}) < V({})", h - 1);
        }
    }
}
