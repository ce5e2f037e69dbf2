//! The baseline policies of Weng et al. (ATC '23), scored as their simulator scores them
//! (integer node scores 0..=100, so that near-equal nodes tie and the first one wins).

use crate::CORE_MILLI_PER_GPU;
use crate::state::NodeState;

/// CPU of the largest node type, to normalize CPU (millicores).
pub(crate) const MAX_SPEC_CPU: f64 = 128_000.0;
/// GPUs of the largest node type, to normalize GPU (thousandths).
pub(crate) const MAX_SPEC_GPU: f64 = 8_000.0;

/// What a node looks like before and after a candidate placement.
pub(crate) struct Before<'a> {
    pub node: &'a NodeState,
    /// Free compute per GPU before the placement (unhealthy GPUs have none).
    pub free: &'a [u32],
    /// CPU left before the placement.
    pub cpu_left: u64,
}

impl Before<'_> {
    fn gpu_left(&self) -> u64 {
        self.free.iter().map(|&f| u64::from(f)).sum()
    }
    fn idle(&self) -> usize {
        self.free
            .iter()
            .filter(|&&f| f == CORE_MILLI_PER_GPU)
            .count()
    }
}

/// Best-fit: least CPU and GPU left after the placement, equally weighted.
pub(crate) fn best_fit(b: &Before<'_>, cpu: u64, gpu_total: u64) -> f64 {
    let cpu_left = b.cpu_left.min(MAX_SPEC_CPU as u64) as f64;
    let left = 0.5 * (cpu_left - cpu as f64) / MAX_SPEC_CPU
        + 0.5 * (b.gpu_left() as f64 - gpu_total as f64) / MAX_SPEC_GPU;
    ((1.0 - left) * 100.0).trunc()
}

/// Packing: shared GPUs first, then idle GPUs of used nodes, then idle nodes.
pub(crate) fn packing(b: &Before<'_>, gpus: u32, chosen: &[usize]) -> f64 {
    if gpus == 0 {
        return 0.0;
    }
    let n = b.node.gpus.len() as i64;
    let idle = b.idle() as i64;
    if idle == n {
        return (100 / 3 - idle).max(idle) as f64;
    }
    let idle_used = chosen
        .iter()
        .filter(|&&i| b.free[i] == CORE_MILLI_PER_GPU)
        .count() as i64;
    if idle_used > 0 {
        return (100 / 2 - idle_used).max(100 / 3) as f64;
    }
    let free_pct: i64 = chosen
        .iter()
        .map(|&i| i64::from(b.free[i]) * 100 / i64::from(CORE_MILLI_PER_GPU))
        .sum();
    (100 - free_pct / 10).max(100 / 2) as f64
}

/// Clustering: put pods next to pods of the same kind (a share of one GPU, or k whole GPUs;
/// [`crate::state::pod_kind`]), the tags Weng et al.'s simulator gives nodes by the pods on
/// them. Higher is better.
pub(crate) fn clustering(b: &Before<'_>, gpus: u32, core_milli: u32) -> f64 {
    if gpus == 0 {
        return 0.0;
    }
    let kinds = &b.node.pod_kinds;
    let tags = kinds.iter().filter(|&&n| n > 0).count();
    let fill = 25 * (MAX_SPEC_GPU as i64 - b.gpu_left() as i64) / MAX_SPEC_GPU as i64;
    let base = if kinds[crate::state::pod_kind(gpus as usize, core_milli)] > 0 {
        if tags == 1 { 75 } else { 50 }
    } else if tags == 0 {
        25
    } else {
        0
    };
    (fill + base) as f64
}

/// Dot product (Tetris): the score of one way of serving the pod, where `gpu_left` is the GPU share
/// of the chosen group (one shared GPU, or all idle GPUs). Higher is better.
pub(crate) fn dot_product(cpu_left: u64, gpu_left: u64, cpu: u64, gpu_total: u64) -> f64 {
    let dot = (cpu_left as f64 / MAX_SPEC_CPU) * (cpu as f64 / MAX_SPEC_CPU)
        + (gpu_left as f64 / MAX_SPEC_GPU) * (gpu_total as f64 / MAX_SPEC_GPU);
    1.0 - dot / 2.0
}

/// A uniform pseudo-random number in [0, 1) from a seed and a position (splitmix64).
pub(crate) fn uniform(seed: u64, position: usize) -> f64 {
    let mut z = seed ^ (position as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}
