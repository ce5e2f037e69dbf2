//! Which pods arrive and in which order the nodes are tried, for one seed: the experiment's
//! random draws, from ChaCha or, to reproduce the published runs, from Go's math/rand in the
//! order of the paper's simulator.

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use gpuledger_trace::{NodeRow, PodRow};

use super::gorand::GoRand;

/// Where the experiment's random draws come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Streams {
    /// Go's math/rand seeded with the seed, drawn in the order of the paper's simulator, with its
    /// sampling rule (a sampled pod that would cross the target ends the sampling): the same
    /// pod and node orders as the published runs.
    Go,
    /// ChaCha (rand's StdRng); the sampled pod that crosses the target is kept.
    Chacha,
}

/// Draws the paper's simulator makes on Go's global source between sampling the pods and
/// shuffling the nodes. Calibrated on the published per-seed curves (see the README): with 10,
/// every published best-fit, FGD and packing curve checked matches to the last digit; with
/// 0..=9 or 11..=12 they do not. Most likely client-go's reflectors, started with the
/// scheduler, each drawing one `rand.Float64()` for their first watch's timeout.
pub const GO_INFORMER_DRAWS: usize = 10;

/// The pods of the experiment for `seed`: sorted by name, shuffled, then sampled with replacement
/// until their GPU request reaches `tune` times the capacity; and the shuffled node order.
pub fn workload_for_seed(
    pods: &[PodRow],
    nodes: usize,
    capacity_milli: u64,
    tune: f64,
    seed: u64,
) -> (Vec<usize>, Vec<usize>) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut order: Vec<usize> = (0..pods.len()).collect();
    order.sort_by(|&a, &b| pods[a].name.cmp(&pods[b].name));
    order.shuffle(&mut rng);
    let target = tune * capacity_milli as f64;
    let mut total: u64 = order.iter().map(|&i| pods[i].gpu_request()).sum();
    if pods.iter().any(|p| p.gpu_request() > 0) {
        while (total as f64) < target {
            let i = rng.random_range(0..pods.len());
            order.push(i);
            total += pods[i].gpu_request();
        }
    }
    let mut node_order: Vec<usize> = (0..nodes).collect();
    node_order.shuffle(&mut rng);
    (order, node_order)
}

/// The pods and node order of the paper's simulator for `seed` (hkust-adsl/
/// kubernetes-scheduler-simulator, `Simulate`, `SortClusterPods`, `TunePodsByNodeTotalResource`,
/// `syncClusterResourceList`), drawn from Go's math/rand after `rand.Seed(seed)`:
///
/// 1. one `rand.Int()` (an argument of a debug log line, evaluated whatever the log level);
/// 2. pods sorted by name, then `rand.Shuffle`;
/// 3. sampling with replacement from the pods sorted by name, `rand.Intn(len)` each: a pod
///    whose per-GPU share would take the total GPU request above `tune` × capacity ends the
///    sampling (its draw is spent, the pod is not added); otherwise it is appended and its full
///    request counted. The total starts from all original pods. If they already ask for more
///    than the target, random pods are removed instead (`tuneDownPods`);
/// 4. `informer_draws` × `rand.Float64()` drawn by client-go when the scheduler starts;
/// 5. nodes sorted by name, `rand.Perm(len)`: node i gets the prefix `perm[i]` and ties go to the
///    smallest name, so the node order is the inverse of that permutation.
pub fn go_workload(
    pods: &[PodRow],
    nodes: &[NodeRow],
    capacity_milli: u64,
    tune: f64,
    seed: u64,
    informer_draws: usize,
) -> (Vec<usize>, Vec<usize>) {
    let mut rng = GoRand::new(seed as i64);
    rng.int();
    let mut by_name: Vec<usize> = (0..pods.len()).collect();
    by_name.sort_by(|&a, &b| pods[a].name.cmp(&pods[b].name));
    let mut order = by_name.clone();
    rng.shuffle(&mut order);
    let target = tune * capacity_milli as f64;
    let mut total: u64 = pods.iter().map(PodRow::gpu_request).sum();
    let per_gpu = |p: &PodRow| {
        if p.num_gpu == 0 {
            0
        } else {
            u64::from(p.gpu_milli)
        }
    };
    if tune > 0.0 && (total as f64) < target && pods.iter().any(|p| per_gpu(p) > 0) {
        loop {
            let i = by_name[rng.intn(by_name.len())];
            if ((total + per_gpu(&pods[i])) as f64) > target {
                break;
            }
            total += pods[i].gpu_request();
            order.push(i);
        }
    } else if tune > 0.0 {
        while (total as f64) > target && !order.is_empty() {
            let i = order.remove(rng.intn(order.len()));
            total -= pods[i].gpu_request();
        }
    }
    for _ in 0..informer_draws {
        rng.float64();
    }
    let mut nodes_by_name: Vec<usize> = (0..nodes.len()).collect();
    nodes_by_name.sort_by(|&a, &b| nodes[a].name.cmp(&nodes[b].name));
    let mut node_order = vec![0; nodes.len()];
    for (i, v) in rng.perm(nodes.len()).into_iter().enumerate() {
        node_order[v] = nodes_by_name[i];
    }
    (order, node_order)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str, num_gpu: u32, gpu_milli: u32) -> PodRow {
        PodRow {
            name: name.into(),
            cpu_milli: 1000,
            memory_mib: 1024,
            num_gpu,
            gpu_milli,
            gpu_spec: Vec::new(),
            created_s: 0,
            lifetime_s: None,
        }
    }

    fn node(name: &str) -> NodeRow {
        NodeRow {
            name: name.into(),
            cpu_milli: 96_000,
            memory_mib: 786_432,
            gpus: 8,
            model: "V100M16".into(),
        }
    }

    /// Expected orders printed by a Go 1.19 program that makes the paper simulator's calls on
    /// Go's math/rand for this toy trace: `rand.Seed`, `rand.Int`, `sort.Slice` by name +
    /// `rand.Shuffle`, the `tuneUpPods` loop over the name-sorted pods, 10 × `rand.Float64`,
    /// `sort` of the nodes + `rand.Perm` (node i prefixed with `perm[i]`, smallest name first).
    #[test]
    fn go_workload_matches_go() {
        // Unsorted on purpose: both lists are sorted by name first.
        let pods = [
            pod("p07", 1, 500),
            pod("p03", 2, 1000),
            pod("p10", 0, 0),
            pod("p01", 1, 250),
            pod("p05", 1, 1000),
            pod("p00", 1, 100),
            pod("p09", 4, 1000),
            pod("p02", 0, 0),
            pod("p08", 1, 750),
            pod("p04", 1, 500),
            pod("p06", 8, 1000),
            pod("p11", 1, 300),
        ];
        let nodes: Vec<NodeRow> = ["n4", "n0", "n3", "n1", "n2", "n5"]
            .iter()
            .map(|n| node(n))
            .collect();
        let capacity = 6 * 8 * 1000;
        let names = |order: &[usize]| -> Vec<String> {
            order.iter().map(|&i| pods[i].name.clone()).collect()
        };
        let node_names = |order: &[usize]| -> Vec<String> {
            order.iter().map(|&i| nodes[i].name.clone()).collect()
        };
        let total = |order: &[usize]| order.iter().map(|&i| pods[i].gpu_request()).sum::<u64>();

        let (order, node_order) = go_workload(&pods, &nodes, capacity, 1.3, 42, 10);
        let want = "p04 p08 p07 p10 p01 p09 p05 p03 p11 p02 p06 p00 p03 p04 p08 p09 p08 p05 p11 \
                    p08 p10 p06 p04 p03 p04 p05 p02 p07 p07 p11 p06 p02 p07 p06 p05 p10 p06";
        assert_eq!(names(&order).join(" "), want);
        // Above 1.3 × 48000 = 62400: the rule looks at one GPU's share only, so an 8-GPU pod
        // can cross the target.
        assert_eq!(total(&order), 66_250);
        assert_eq!(
            node_names(&node_order),
            ["n5", "n2", "n1", "n0", "n4", "n3"]
        );

        let (order, node_order) = go_workload(&pods, &nodes, capacity, 1.3, 7, 10);
        assert_eq!(order.len(), 49);
        assert_eq!(total(&order), 64_050);
        assert_eq!(
            names(&order)[..12].join(" "),
            "p03 p04 p07 p05 p00 p08 p10 p01 p06 p09 p11 p02"
        );
        assert_eq!(
            node_names(&node_order),
            ["n4", "n0", "n5", "n1", "n3", "n2"]
        );
    }
}
