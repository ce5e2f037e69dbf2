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
use rand::{Rng, SeedableRng};

use gpuledger_trace::{NodeRow, PodRow};

use super::draws::{Streams, go_workload, workload_for_seed};
use super::floor::Floor;
use super::paper::paper_columns;
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

/// How the pods and nodes of one run are ordered, and who picks the GPUs within a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Procedure {
    /// The random streams.
    pub streams: Streams,
    /// With [`Streams::Go`]: the draws between sampling and the node shuffle.
    pub informer_draws: usize,
    /// Which of the nodes scored equally gets the pod.
    pub ties: Ties,
    /// Who picks the GPUs within the chosen node.
    pub devices: DeviceChoice,
}

/// Who picks the GPUs within a node (`--device-choice`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum DeviceChoice {
    /// The policy, as the device-plugin path does (the ledger reserves the GPUs it scores).
    #[default]
    Policy,
    /// kube-scheduler's first fit, as on the DRA path: the lowest-index GPUs with room; the
    /// policy scores each node by the GPUs first fit would take there.
    FirstFit,
}

impl From<DeviceChoice> for placement::DeviceChoice {
    fn from(d: DeviceChoice) -> Self {
        match d {
            DeviceChoice::Policy => placement::DeviceChoice::Policy,
            DeviceChoice::FirstFit => placement::DeviceChoice::FirstFit,
        }
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
                    let c = placement::evaluate_with(node, req, procedure.devices.into());
                    *slot = Some((version[n], c.ok()));
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
        mode: Default::default(),
        isolation: String::new(),
        dra_cores: String::new(),
        name: n.name.clone(),
        gpus: (0..n.gpus)
            .map(|i| GpuState {
                uuid: format!("{}-gpu{i}", n.name),
                index: i,
                model: n.model.clone(),
                // The trace has no GPU memory; pods ask for none, so any capacity will do.
                memory_mib: 16_384,
                healthy: true,
                compute_capability: String::new(),
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
        dra: false,
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
