//! A lower bound on the unallocated GPU of any placement that never moves a pod: how much of an
//! arrived workload no policy can place, because its pods fit only a few kinds of node and a node
//! holds only so many of them.
//!
//! For a set `U` of node kinds, the pods that fit no node outside `U` must share the nodes of
//! `U`. On a node of kind `k`, no more of them fit together than its GPU compute, CPU or host
//! memory divided by the least any of them (that fits `k`) asks for. When more of them arrive
//! than the nodes of `U` can hold that way, the rest fail whatever the policy, at least the GPU
//! of that many of the smallest. The floor is the largest such shortfall over the sets of kinds
//! that some pod fits exactly.

use gpuledger_ledger::{CORE_MILLI_PER_GPU, NodeState, PodRequest, Policy, placement};

/// What the floor needs of a cluster and of the request shapes of a trace, computed once for
/// every run: the node kinds ([`placement::node_kinds`]) and which of them can host each shape.
pub struct Floor {
    /// Nodes of each kind.
    count: Vec<u64>,
    /// GPU compute (thousandths), CPU (millicores) and host memory (MiB) of a node of each kind.
    capacity: Vec<[u64; 3]>,
    /// For each request shape, the kinds an empty node of which can host it.
    hosts: Vec<Vec<bool>>,
    /// For each request shape, what bounds how many share a node: GPU compute (thousandths),
    /// CPU, host memory.
    demand: Vec<[u64; 3]>,
}

impl Floor {
    /// The kinds of `nodes` (empty) and the hosts of each of `requests`, which ask for
    /// `gpu_request` thousandths of a GPU each.
    pub fn new(nodes: &[NodeState], requests: &[PodRequest], gpu_request: &[u64]) -> Floor {
        let kinds = placement::node_kinds(nodes);
        let hosts = requests
            .iter()
            .map(|req| {
                let r = PodRequest {
                    policy: Policy::Binpack,
                    ..req.clone()
                };
                kinds
                    .iter()
                    .map(|(n, _)| placement::evaluate(n, &r).is_ok())
                    .collect()
            })
            .collect();
        Floor {
            count: kinds.iter().map(|&(_, c)| c).collect(),
            capacity: kinds
                .iter()
                .map(|(n, _)| {
                    [
                        n.gpus.len() as u64 * u64::from(CORE_MILLI_PER_GPU),
                        n.cpu_milli,
                        n.memory_mib,
                    ]
                })
                .collect(),
            hosts,
            demand: requests
                .iter()
                .zip(gpu_request)
                .map(|(r, &g)| [g, r.cpu_milli, r.memory_mib])
                .collect(),
        }
    }

    /// The floor (GPU thousandths) of the pods that arrived: `arrived[t]` pods of request shape
    /// `t`.
    pub fn of(&self, arrived: &[u64]) -> u64 {
        let shapes: Vec<usize> = (0..arrived.len()).filter(|&t| arrived[t] > 0).collect();
        let mut sets: Vec<&Vec<bool>> = shapes.iter().map(|&t| &self.hosts[t]).collect();
        sets.sort();
        sets.dedup();
        let mut best = 0;
        for u in sets {
            // The pods that fit no kind outside `u`.
            let within: Vec<usize> = shapes
                .iter()
                .copied()
                .filter(|&t| {
                    self.hosts[t]
                        .iter()
                        .zip(u)
                        .all(|(&h, &inside)| !h || inside)
                })
                .collect();
            let mut room = 0u64;
            let mut unbounded = false;
            for k in (0..u.len()).filter(|&k| u[k]) {
                let mut least = [u64::MAX; 3];
                for &t in within.iter().filter(|&&t| self.hosts[t][k]) {
                    for (l, &d) in least.iter_mut().zip(&self.demand[t]) {
                        *l = (*l).min(d);
                    }
                }
                let per_node = self.capacity[k]
                    .iter()
                    .zip(least)
                    .filter(|&(_, l)| l > 0 && l != u64::MAX)
                    .map(|(&c, l)| c / l)
                    .min();
                match per_node {
                    Some(m) => room += m * self.count[k],
                    // Some pod asks for nothing that runs out: no bound from this set.
                    None if within.iter().any(|&t| self.hosts[t][k]) => unbounded = true,
                    None => {}
                }
            }
            if unbounded {
                continue;
            }
            let pods: u64 = within.iter().map(|&t| arrived[t]).sum();
            let mut short = pods.saturating_sub(room);
            if short == 0 {
                continue;
            }
            // The `short` smallest of them fail at least.
            let mut sizes: Vec<(u64, u64)> = within
                .iter()
                .map(|&t| (self.demand[t][0], arrived[t]))
                .collect();
            sizes.sort_unstable();
            let mut gpu = 0;
            for (size, n) in sizes {
                let take = n.min(short);
                gpu += take * size;
                short -= take;
                if short == 0 {
                    break;
                }
            }
            best = best.max(gpu);
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use gpuledger_ledger::placement::ContainerRequest;
    use gpuledger_trace::NodeRow;

    use super::*;

    fn node(name: &str, gpus: u32, cpu_milli: u64) -> NodeState {
        super::super::engine::node_state(&NodeRow {
            name: name.into(),
            cpu_milli,
            memory_mib: 0,
            gpus,
            model: "G".into(),
        })
    }

    fn pod(gpus: u32, cpu_milli: u64) -> PodRequest {
        PodRequest {
            containers: vec![ContainerRequest {
                name: "c".into(),
                slices: gpus,
                core_milli: 1000,
                ..Default::default()
            }],
            cpu_milli,
            ..Default::default()
        }
    }

    #[test]
    fn pods_that_only_a_few_nodes_can_hold_set_the_floor() {
        // Two 128-core nodes and three 96-core ones, 8 GPUs each. 120-core 8-GPU pods fit only
        // the two big nodes, one each: of five, three fail whatever the policy (24 GPUs).
        let nodes = [
            node("a", 8, 128_000),
            node("b", 8, 128_000),
            node("c", 8, 96_000),
            node("d", 8, 96_000),
            node("e", 8, 96_000),
        ];
        let reqs = [pod(8, 120_000), pod(8, 64_000), pod(1, 4000)];
        let floor = Floor::new(&nodes, &reqs, &[8000, 8000, 1000]);
        assert_eq!(floor.count, vec![2, 3]);
        assert_eq!(floor.of(&[5, 0, 0]), 24_000);
        // Five pods of 8 GPUs any node holds: all fit.
        assert_eq!(floor.of(&[0, 5, 0]), 0);
        // Two big and four 64-core ones: six 8-GPU pods on five nodes, one fails (8 GPUs),
        // however they are arranged.
        assert_eq!(floor.of(&[2, 4, 0]), 8000);
        // 40 one-GPU pods fill the 40 GPUs exactly; one more fails.
        assert_eq!(floor.of(&[0, 0, 41]), 1000);
    }

    #[test]
    fn a_pod_that_fits_no_node_always_fails_and_cpu_only_pods_are_bounded_by_cpu() {
        let nodes = [node("a", 2, 8000)];
        let floor = Floor::new(&nodes, &[pod(4, 1000), pod(0, 3000)], &[4000, 0]);
        assert_eq!(floor.of(&[2, 0]), 8000);
        // Three 3-core pods on an 8-core node: one fails, with no GPU to count.
        assert_eq!(floor.of(&[0, 3]), 0);
    }
}
