//! One run of the published experiment: one policy, one seed, pure fill.
//!
//! Every decision goes through `gpuledger_ledger::placement::evaluate` and `rank`; this module
//! only keeps the books (what each node has left) and caches evaluations per node and pod shape
//! until the node changes, which is sound because placement is a pure function of both.

use std::collections::HashMap;
use std::sync::Arc;

use gpuledger_ledger::placement::{self, Candidate, Workload};
use gpuledger_ledger::{ContainerRequest, GpuState, NodeState, PodRequest, Policy, Selector, pb};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use gpuledger_trace::{NodeRow, PodRow};

use super::floor::Floor;
use super::gorand::GoRand;
use super::probe::{Cost, Diagnosis, Probe};

/// Arrived-workload points (fractions of cluster GPU capacity) the report shows.
pub const POINTS: [f64; 5] = [0.5, 0.8, 0.9, 1.0, 1.3];

/// The result of one run.
#[derive(Debug, Clone, PartialEq)]
pub struct RunResult {
    /// The seed.
    pub seed: u64,
    /// After each pod: (arrived workload, GPU allocation ratio), both fractions of capacity.
    pub curve: Vec<(f64, f64)>,
    /// Allocation ratio at each of [`POINTS`] (interpolated between pods).
    pub alloc_at: Vec<f64>,
    /// Fragmented share of the idle GPU capacity when the arrived workload first reaches 100 %.
    pub frag_rate_at_100: f64,
    /// Pods submitted.
    pub pods: usize,
    /// Pods that fit nowhere.
    pub failed: usize,
    /// The paper's per-seed curve (`experiments/analysis/merge_alloc_discrete.py`): for each
    /// arrived workload 0..=130 %, the mean allocation (%) over the pods whose arrived workload
    /// rounds to it; `None` where no pod is near.
    pub paper_columns: Vec<Option<f64>>,
    /// What each policy of the run's [`Probe`] spent scoring every node, on this run's states.
    pub cost: Vec<Cost>,
    /// Where the idle GPU is and which pods failed, when the arrived workload first reaches 100 %.
    pub diagnosis: Diagnosis,
    /// Share of the GPU capacity that no placement could have allocated of the pods arrived by
    /// 100 % ([`Floor::of`]): the same for every policy of a seed.
    pub floor: f64,
}

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

/// How the pods and nodes of one run are ordered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Procedure {
    /// The random streams.
    pub streams: Streams,
    /// With [`Streams::Go`]: the draws between sampling and the node shuffle.
    pub informer_draws: usize,
    /// Which of the nodes scored equally gets the pod.
    pub ties: Ties,
}

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

/// How a pod's node is chosen among the nodes its policy scores equally.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Ties {
    /// The first in the (seed-shuffled) node order.
    First,
    /// Uniformly at random, as kube-scheduler's selectHost does (reservoir sampling).
    Random,
}

/// Fixed inputs shared by every run: the cluster, the pod shapes and the workload distribution.
pub struct Setup {
    nodes: Vec<NodeState>,
    node_rows: Vec<NodeRow>,
    /// Index of each pod's shape in `requests`.
    shape_of: Vec<usize>,
    /// One request per distinct pod shape.
    requests: Vec<PodRequest>,
    gpu_request: Vec<u64>,
    capacity_milli: u64,
    workload: Arc<Workload>,
    pod_count: usize,
    floor: Floor,
}

impl Setup {
    /// Build the cluster and the requests; `workload` is what FGD measures fragmentation against
    /// (it learns which nodes of this cluster can host each of its shapes).
    pub fn new(node_rows: &[NodeRow], pods: &[PodRow], workload: Workload) -> Self {
        let nodes: Vec<NodeState> = node_rows.iter().map(node_state).collect();
        let workload = Arc::new(workload.on_cluster(&nodes));
        let capacity_milli = nodes.iter().map(|n| n.gpus.len() as u64 * 1000).sum();
        let mut index: HashMap<(u64, u64, u32, u32, &[String]), usize> = HashMap::new();
        let mut requests = Vec::new();
        let mut gpu_request = Vec::new();
        let mut shape_of = Vec::with_capacity(pods.len());
        for p in pods {
            let key = (
                p.cpu_milli,
                p.memory_mib,
                p.num_gpu,
                p.gpu_milli,
                &p.gpu_spec[..],
            );
            let id = *index.entry(key).or_insert_with(|| {
                requests.push(request(p, requests.len(), &workload));
                gpu_request.push(p.gpu_request());
                requests.len() - 1
            });
            shape_of.push(id);
        }
        Setup {
            floor: Floor::new(&nodes, &requests, &gpu_request),
            nodes,
            node_rows: node_rows.to_vec(),
            shape_of,
            requests,
            gpu_request,
            capacity_milli,
            workload,
            pod_count: pods.len(),
        }
    }

    /// Run the experiment for one policy and seed.
    pub fn run(
        &self,
        pods: &[PodRow],
        policy: Policy,
        tune: f64,
        seed: u64,
        procedure: Procedure,
        probe: &Probe,
    ) -> RunResult {
        debug_assert_eq!(pods.len(), self.pod_count);
        let (order, node_order) = match procedure.streams {
            Streams::Go => go_workload(
                pods,
                &self.node_rows,
                self.capacity_milli,
                tune,
                seed,
                procedure.informer_draws,
            ),
            Streams::Chacha => {
                workload_for_seed(pods, self.nodes.len(), self.capacity_milli, tune, seed)
            }
        };
        let mut nodes: Vec<NodeState> = node_order.iter().map(|&i| self.nodes[i].clone()).collect();
        let mut requests = self.requests.clone();
        for r in &mut requests {
            r.policy = policy;
        }
        let shapes = requests.len();
        let mut version = vec![0u32; nodes.len()];
        let mut cache: Vec<Option<(u32, Option<Candidate>)>> = vec![None; nodes.len() * shapes];
        let mut salts = StdRng::seed_from_u64(seed ^ 0x5EED_5A17);
        let mut tie_rng = StdRng::seed_from_u64(seed ^ 0x7135_5A17);
        let cap = self.capacity_milli as f64;
        let (mut arrived, mut allocated) = (0u64, 0u64);
        let mut curve = Vec::with_capacity(order.len());
        let mut milli = Vec::with_capacity(order.len());
        let mut failed = 0;
        let mut frag_rate_at_100 = None;
        let mut cost = vec![Cost::default(); probe.policies.len()];
        let mut failed_by_class = [(0u64, 0u64, 0u64); 4];
        let mut diagnosis = None;
        for (i, &p) in order.iter().enumerate() {
            let t = self.shape_of[p];
            let req = &mut requests[t];
            if policy == Policy::Random {
                req.salt = salts.random();
            }
            let req = &requests[t];
            if probe.due(i) {
                probe.measure(&nodes, req, i, &mut cost);
            }
            let mut best: Option<(f64, usize)> = None;
            let mut tied = 0u32;
            for (n, node) in nodes.iter().enumerate() {
                let slot = &mut cache[n * shapes + t];
                if slot.as_ref().is_none_or(|(v, _)| *v != version[n]) {
                    *slot = Some((version[n], placement::evaluate(node, req).ok()));
                }
                if let Some((_, Some(c))) = slot {
                    let s = placement::rank(req, n, c);
                    match best {
                        Some((b, _)) if s < b => {}
                        Some((b, _)) if s == b => {
                            // kube-scheduler's selectHost: reservoir sampling among the best.
                            tied += 1;
                            if procedure.ties == Ties::Random && tie_rng.random_range(0..tied) == 0
                            {
                                best = Some((s, n));
                            }
                        }
                        _ => {
                            best = Some((s, n));
                            tied = 1;
                        }
                    }
                }
            }
            arrived += self.gpu_request[t];
            match best {
                Some((_, n)) => {
                    let (_, c) = cache[n * shapes + t].as_ref().expect("just evaluated");
                    let c = c.as_ref().expect("best is a fitting candidate").clone();
                    commit(&mut nodes[n], req, &c);
                    version[n] += 1;
                    allocated += self.gpu_request[t];
                }
                None => {
                    failed += 1;
                    let c = &mut failed_by_class[Diagnosis::class(req)];
                    c.0 += 1;
                    c.1 += self.gpu_request[t];
                    if Diagnosis::blocked_by_cpu_or_memory(&nodes, req) {
                        c.2 += self.gpu_request[t];
                    }
                }
            }
            curve.push((arrived as f64 / cap, allocated as f64 / cap));
            milli.push((arrived, allocated));
            if frag_rate_at_100.is_none() && arrived as f64 >= cap {
                frag_rate_at_100 = Some(frag_rate(&nodes, &self.workload));
                diagnosis = Some(Diagnosis::of(&nodes, &self.workload, failed_by_class));
            }
        }
        let alloc_at = POINTS.iter().map(|&x| at(&curve, x)).collect();
        // The pods whose arrival keeps the arrived workload at or below 100 %.
        let mut by_shape = vec![0u64; self.requests.len()];
        let mut sum = 0u64;
        for &p in order.iter() {
            let t = self.shape_of[p];
            sum += self.gpu_request[t];
            if sum > self.capacity_milli {
                break;
            }
            by_shape[t] += 1;
        }
        RunResult {
            floor: self.floor.of(&by_shape) as f64 / cap,
            seed,
            alloc_at,
            frag_rate_at_100: frag_rate_at_100.unwrap_or_else(|| frag_rate(&nodes, &self.workload)),
            pods: order.len(),
            failed,
            curve,
            paper_columns: paper_columns(&milli, self.capacity_milli / 1000),
            cost,
            diagnosis: diagnosis
                .unwrap_or_else(|| Diagnosis::of(&nodes, &self.workload, failed_by_class)),
        }
    }
}

/// The allocation ratio when the arrived workload is `x`, interpolated between the two pods
/// around it (the last point when the run ends before `x`).
pub fn at(curve: &[(f64, f64)], x: f64) -> f64 {
    let mut prev = (0.0, 0.0);
    for &(a, r) in curve {
        if a >= x {
            if a - prev.0 <= f64::EPSILON {
                return r;
            }
            return prev.1 + (r - prev.1) * (x - prev.0) / (a - prev.0);
        }
        prev = (a, r);
    }
    prev.1
}

/// Fragmented share of the idle GPU capacity of the cluster.
fn frag_rate(nodes: &[NodeState], w: &Workload) -> f64 {
    let idle: u64 = nodes
        .iter()
        .flat_map(|n| &n.gpus)
        .map(|g| u64::from(g.core_free()))
        .sum();
    if idle == 0 {
        return 0.0;
    }
    nodes.iter().map(|n| w.node_fragmentation(n)).sum::<f64>() / idle as f64
}

/// Book a decided candidate on the simulator's copy of the node.
fn commit(node: &mut NodeState, req: &PodRequest, c: &Candidate) {
    for (cr, gpus) in req.containers.iter().zip(&c.gpus) {
        let cr = cr.normalized();
        if !gpus.is_empty() {
            node.add_pod_kind(gpuledger_ledger::state::pod_kind(gpus.len(), cr.core_milli));
        }
        for &i in gpus {
            let g = &mut node.gpus[i];
            g.mem_used += cr.mem_on(g);
            g.core_used += cr.core_milli;
            g.holders += 1;
        }
    }
    node.cpu_used += req.cpu_milli;
    node.memory_used += req.memory_mib;
}

pub(super) fn node_state(n: &NodeRow) -> NodeState {
    NodeState {
        name: n.name.clone(),
        gpus: (0..n.gpus)
            .map(|i| GpuState {
                uuid: format!("{}-gpu{i}", n.name),
                index: i,
                model: n.model.clone(),
                // The trace has no GPU memory; pods ask for none, so any capacity will do.
                memory_mib: 16_384,
                healthy: true,
                mem_used: 0,
                core_used: 0,
                holders: 0,
            })
            .collect(),
        cpu_milli: n.cpu_milli,
        memory_mib: n.memory_mib,
        cpu_used: 0,
        memory_used: 0,
        allocs: Default::default(),
        devices: Default::default(),
        pod_kinds: Default::default(),
    }
}

fn request(p: &PodRow, id: usize, workload: &Arc<Workload>) -> PodRequest {
    let containers = if p.num_gpu == 0 {
        Vec::new()
    } else {
        vec![ContainerRequest {
            name: "main".into(),
            slices: p.num_gpu,
            mem_mib: 0,
            mem_percent: 0,
            core_milli: p.gpu_milli,
        }]
    };
    PodRequest {
        pod: pb::PodRef {
            uid: format!("shape-{id}"),
            namespace: "trace".into(),
            name: p.name.clone(),
        },
        containers,
        selector: Selector {
            models: p.gpu_spec.clone(),
            ..Default::default()
        },
        policy: Policy::default(),
        cpu_milli: p.cpu_milli,
        memory_mib: p.memory_mib,
        workload: Some(workload.clone()),
        salt: 0,
        priority: 0,
    }
}

/// The workload distribution of a pod list, for FGD: its most frequent shapes covering `coverage`.
/// Shapes carry host memory only `with_memory` (the paper's do not); their pods' mean memory is
/// kept either way.
pub fn trace_workload(pods: &[PodRow], coverage: f64, with_memory: bool) -> Workload {
    Workload::from_counts_with_memory(
        pods.iter().map(|p| {
            (
                placement::PodShape {
                    cpu_milli: p.cpu_milli,
                    memory_mib: if with_memory { p.memory_mib } else { 0 },
                    gpus: p.num_gpu,
                    core_milli: p.gpu_milli,
                    models: p.gpu_spec.clone(),
                },
                1,
                p.memory_mib,
            )
        }),
        coverage,
    )
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
