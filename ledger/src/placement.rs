//! Placement: which GPUs of which node a pod's containers get.
//!
//! Pure functions of a [`NodeState`] and a [`PodRequest`]. Selectors (GPU type and UUID
//! include/exclude) apply first; then the policy orders the GPUs inside a node and scores nodes.
//! Multi-slice containers take distinct GPUs of one node; the containers of a pod are placed in
//! order, each seeing what the previous ones took. [`evaluate`] is the one decision procedure:
//! [`place_on_node`], [`score_node`], [`choose_node`] and the trace simulator all go through it.

mod baselines;
mod fgd;

use std::fmt;
use std::str::FromStr;
use std::sync::{Arc, OnceLock};

use crate::CORE_MILLI_PER_GPU;
use crate::pb;
use crate::state::{GpuState, Ledger, NodeState};

pub use fgd::{PodShape, Workload};

/// How GPUs and nodes are chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum Policy {
    /// Tightest GPU, then the fullest node: keeps whole GPUs free for large requests (default).
    #[default]
    Binpack,
    /// Emptiest GPU, then the emptiest node: spreads load and interference.
    Spread,
    /// Fragmentation gradient descent (Weng et al., ATC '23): the GPU and node where the expected
    /// fragmentation for the workload distribution ([`PodRequest::workload`]) grows least.
    Fgd,
    /// FGD, except that among nodes FGD scores equally, one already in use goes before an idle
    /// one (gpuledger's variant; better than FGD on both openb traces).
    FgdPack,
    /// FGD-pack, except that among nodes FGD scores equally, a pod that asks for no GPU goes to the
    /// node with the least free GPU compute: its CPU and memory can strand no more GPU there
    /// (gpuledger's variant; better than the paper's FGD on both openb traces).
    FgdPackCpu,
    /// A uniformly random feasible node ([`PodRequest::salt`] is the randomness).
    Random,
    /// Tetris' dot product of free and requested CPU and GPU, smallest alignment first (paper baseline).
    DotProduct,
    /// Least CPU and GPU left after placement (paper baseline).
    BestFit,
    /// Shared GPUs, then idle GPUs of used nodes, then idle nodes (paper baseline).
    Packing,
    /// Next to pods with the same GPU request (paper baseline).
    Clustering,
}

impl Policy {
    /// Every policy name, as the CLI and the pod annotation spell them.
    pub const NAMES: &'static [&'static str] = &[
        "binpack",
        "spread",
        "fgd",
        "fgd-pack",
        "fgd-pack-cpu",
        "random",
        "dotprod",
        "bestfit",
        "packing",
        "clustering",
    ];

    /// The name as written in the ledger.
    pub fn as_str(self) -> &'static str {
        match self {
            Policy::Binpack => "binpack",
            Policy::Spread => "spread",
            Policy::Fgd => "fgd",
            Policy::FgdPack => "fgd-pack",
            Policy::FgdPackCpu => "fgd-pack-cpu",
            Policy::Random => "random",
            Policy::DotProduct => "dotprod",
            Policy::BestFit => "bestfit",
            Policy::Packing => "packing",
            Policy::Clustering => "clustering",
        }
    }

    /// Whether the policy measures fragmentation against a workload (fgd and its variants).
    pub fn is_fgd(self) -> bool {
        matches!(self, Policy::Fgd | Policy::FgdPack | Policy::FgdPackCpu)
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().replace('_', "-").as_str() {
            "" | "binpack" => Ok(Policy::Binpack),
            "spread" => Ok(Policy::Spread),
            "fgd" => Ok(Policy::Fgd),
            "fgd-pack" | "fgdpack" => Ok(Policy::FgdPack),
            "fgd-pack-cpu" => Ok(Policy::FgdPackCpu),
            "random" => Ok(Policy::Random),
            "dotprod" | "dot-product" | "dotproduct" => Ok(Policy::DotProduct),
            "bestfit" | "best-fit" => Ok(Policy::BestFit),
            "packing" => Ok(Policy::Packing),
            "clustering" => Ok(Policy::Clustering),
            other => Err(format!(
                "unknown placement policy {other:?} (known: {})",
                Policy::NAMES.join(", ")
            )),
        }
    }
}

/// What one container asks for, per slice.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ContainerRequest {
    /// Container name.
    pub name: String,
    /// Number of slices, each on a distinct GPU.
    pub slices: u32,
    /// Memory per slice in MiB (when `mem_percent` is 0).
    pub mem_mib: u64,
    /// Memory per slice as a percent of the chosen GPU's memory.
    pub mem_percent: u32,
    /// Compute per slice in thousandths of a GPU.
    pub core_milli: u32,
}

impl ContainerRequest {
    /// A slice that names neither memory nor compute is the whole GPU.
    pub fn normalized(&self) -> ContainerRequest {
        let mut c = self.clone();
        if c.whole_gpu() {
            c.mem_percent = 100;
            c.core_milli = CORE_MILLI_PER_GPU;
        }
        c
    }

    /// Nothing asked but the slice: the whole GPU.
    fn whole_gpu(&self) -> bool {
        self.mem_mib == 0 && self.mem_percent == 0 && self.core_milli == 0
    }

    /// Memory and compute one slice needs on `gpu`, as [`Self::normalized`] would ask, without
    /// building the normalized copy.
    pub fn slice_on(&self, gpu: &GpuState) -> (u64, u32) {
        if self.whole_gpu() {
            (gpu.memory_mib, CORE_MILLI_PER_GPU)
        } else {
            (self.mem_on(gpu), self.core_milli)
        }
    }

    /// Memory this container needs on `gpu` per slice.
    pub fn mem_on(&self, gpu: &GpuState) -> u64 {
        if self.mem_percent > 0 {
            (gpu.memory_mib * u64::from(self.mem_percent)).div_ceil(100)
        } else {
            self.mem_mib
        }
    }
}

/// Which GPUs a pod accepts (pod annotations `gpuledger.io/gpu-type`, `gpu-uuid` and their
/// `-exclude` forms). Types match as case-insensitive substrings of the model name.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Selector {
    /// Accepted model names (empty = any).
    pub types: Vec<String>,
    /// Refused model names.
    pub types_exclude: Vec<String>,
    /// Accepted GPU UUIDs (empty = any).
    pub uuids: Vec<String>,
    /// Refused GPU UUIDs.
    pub uuids_exclude: Vec<String>,
    /// Accepted model names, matched exactly (empty = any); the trace's `gpu_spec`.
    pub models: Vec<String>,
}

impl Selector {
    /// Whether the selector accepts this GPU (health is not the selector's business).
    pub fn accepts(&self, gpu: &GpuState) -> bool {
        let type_match = |t: &String| contains_ignore_ascii_case(&gpu.model, t);
        (self.types.is_empty() || self.types.iter().any(type_match))
            && !self.types_exclude.iter().any(type_match)
            && (self.uuids.is_empty() || self.uuids.contains(&gpu.uuid))
            && !self.uuids_exclude.contains(&gpu.uuid)
            && (self.models.is_empty() || self.models.contains(&gpu.model))
    }
}

/// `haystack` contains `needle`, ignoring ASCII case, without allocating (this runs for every
/// GPU of every node on every filter).
fn contains_ignore_ascii_case(haystack: &str, needle: &str) -> bool {
    let (h, n) = (haystack.as_bytes(), needle.as_bytes());
    n.is_empty() || h.windows(n.len()).any(|w| w.eq_ignore_ascii_case(n))
}

/// A pod's request: its GPU containers, selectors, policy and node-level requests.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PodRequest {
    /// The pod.
    pub pod: pb::PodRef,
    /// Containers that ask for GPU slices (others are not listed).
    pub containers: Vec<ContainerRequest>,
    /// GPU selectors.
    pub selector: Selector,
    /// Placement policy.
    pub policy: Policy,
    /// Pod CPU request (millicores), 0 = not constrained.
    pub cpu_milli: u64,
    /// Pod host memory request (MiB), 0 = not constrained.
    pub memory_mib: u64,
    /// The workload distribution FGD measures fragmentation against (`None` = [`Workload::prior`]).
    pub workload: Option<Arc<Workload>>,
    /// Randomness for the `random` policy, drawn by the caller (placement itself has none).
    pub salt: u64,
}

impl PodRequest {
    /// Decode the API's form (as the allocator and the extender receive it), with
    /// `default_policy` for a request that names none, and validate it.
    pub fn from_pb(r: pb::PodRequest, default_policy: Policy) -> Result<PodRequest, String> {
        let pod = r.pod.ok_or("request.pod is missing")?;
        let p = r.placement.unwrap_or_default();
        let policy = if p.policy.is_empty() {
            default_policy
        } else {
            p.policy.parse()?
        };
        let req = PodRequest {
            pod,
            containers: r
                .containers
                .into_iter()
                .map(|c| ContainerRequest {
                    name: c.name,
                    slices: c.slices,
                    mem_mib: c.mem_mib,
                    mem_percent: c.mem_percent,
                    core_milli: c.core_milli,
                })
                .collect(),
            selector: Selector {
                types: p.gpu_types,
                types_exclude: p.gpu_types_exclude,
                uuids: p.gpu_uuids,
                uuids_exclude: p.gpu_uuids_exclude,
                ..Default::default()
            },
            policy,
            cpu_milli: r.cpu_milli,
            memory_mib: r.memory_mib,
            ..Default::default()
        };
        req.validate()?;
        Ok(req)
    }

    /// Reject requests that can never be served anywhere, with a reason a user understands.
    pub fn validate(&self) -> Result<(), String> {
        if self.pod.uid.is_empty() {
            return Err("pod uid is empty".into());
        }
        if self.containers.is_empty() {
            return Err("the pod has no container asking for a GPU slice".into());
        }
        let mut names = std::collections::BTreeSet::new();
        for c in &self.containers {
            if !names.insert(c.name.as_str()) {
                return Err(format!("container {:?} is listed twice", c.name));
            }
            if c.slices == 0 {
                return Err(format!("container {:?} asks for 0 GPU slices", c.name));
            }
            if c.slices > 64 {
                return Err(format!(
                    "container {:?} asks for {} GPU slices; no node has that many GPUs",
                    c.name, c.slices
                ));
            }
            if c.core_milli > CORE_MILLI_PER_GPU {
                return Err(format!(
                    "container {:?} asks for {}% of a GPU's compute; gpu-core is 0-100",
                    c.name,
                    c.core_milli / 10
                ));
            }
            if c.mem_percent > 100 {
                return Err(format!(
                    "container {:?} asks for {}% of a GPU's memory; at most 100",
                    c.name, c.mem_percent
                ));
            }
            if c.mem_percent > 0 && c.mem_mib > 0 {
                return Err(format!(
                    "container {:?} sets both gpu-mem and gpu-mem-percent; set one",
                    c.name
                ));
            }
        }
        Ok(())
    }
}

/// Whether a pod fits on a node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fit {
    /// It fits now.
    Fits,
    /// Not now: enough capacity could free up (the reason says what is short).
    Wait(String),
    /// Never on this node as it is: no amount of waiting helps.
    Never(String),
}

/// The shares chosen for one container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerPlacement {
    /// Container name.
    pub container: String,
    /// One share per slice, on distinct GPUs.
    pub shares: Vec<pb::GpuShare>,
}

#[derive(Clone, Copy)]
struct Free {
    mem: u64,
    core: u32,
}

/// A way to serve a pod on one node, as the policy scores it.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    /// The policy's score: higher is better; only comparable between nodes for one request.
    pub score: f64,
    /// For each container of the request, in order, the indices (into `NodeState::gpus`) of the
    /// GPUs its slices take.
    pub gpus: Vec<Vec<usize>>,
}

/// Decide how `req` would be served on `node` under its policy, or say why it cannot be.
///
/// This is the single decision procedure; the other functions here and the trace simulator are
/// built on it.
pub fn evaluate(node: &NodeState, req: &PodRequest) -> Result<Candidate, Fit> {
    if let Some(never) = never_fits(node, req) {
        return Err(Fit::Never(never));
    }
    if node.cpu_milli > 0 && node.cpu_used + req.cpu_milli > node.cpu_milli {
        return Err(Fit::Wait(format!(
            "node CPU: {}m requested, {}m free",
            req.cpu_milli,
            node.cpu_milli - node.cpu_used
        )));
    }
    if node.memory_mib > 0 && node.memory_used + req.memory_mib > node.memory_mib {
        return Err(Fit::Wait(format!(
            "node memory: {} MiB requested, {} MiB free",
            req.memory_mib,
            node.memory_mib - node.memory_used
        )));
    }
    let before: Vec<Free> = node
        .gpus
        .iter()
        .map(|g| Free {
            mem: g.mem_free(),
            core: g.core_free(),
        })
        .collect();
    let mut free = before.clone();
    let workload = req.policy.is_fgd().then(|| workload_of(req));
    let mut chosen_all = Vec::with_capacity(req.containers.len());
    let mut dot_score = None;
    for c in &req.containers {
        let c = c.normalized();
        let cands: Vec<(usize, u64, f64)> = node
            .gpus
            .iter()
            .enumerate()
            .filter(|(_, g)| g.healthy && req.selector.accepts(g))
            .filter_map(|(i, g)| {
                let mem = c.mem_on(g);
                let f = free[i];
                (f.mem >= mem && f.core >= c.core_milli).then(|| {
                    let left = (f.mem - mem) as f64 / g.memory_mib.max(1) as f64
                        + f64::from(f.core - c.core_milli) / f64::from(CORE_MILLI_PER_GPU);
                    (i, mem, left)
                })
            })
            .collect();
        if cands.len() < c.slices as usize {
            return Err(Fit::Wait(shortage(node, req, &c, &free)));
        }
        let chosen: Vec<usize> = match req.policy {
            Policy::Spread => take_sorted(cands, c.slices, |a, b| b.total_cmp(a)),
            Policy::Fgd | Policy::FgdPack | Policy::FgdPackCpu
                if c.slices == 1 && c.core_milli < CORE_MILLI_PER_GPU =>
            {
                let w = workload.expect("fgd policies have a workload");
                vec![fgd_gpu(node, req, w, &free, &cands, c.core_milli)]
            }
            Policy::DotProduct => {
                let (chosen, s) = dot_gpus(node, req, &free, &cands, &c);
                dot_score = Some(dot_score.map_or(s, |d: f64| d.min(s)));
                chosen
            }
            _ => take_sorted(cands, c.slices, |a, b| a.total_cmp(b)),
        };
        for &i in &chosen {
            free[i].mem -= c.mem_on(&node.gpus[i]);
            free[i].core -= c.core_milli;
        }
        chosen_all.push(chosen);
    }
    let score = node_score(node, req, &before, &free, &chosen_all, workload, dot_score);
    Ok(Candidate {
        score,
        gpus: chosen_all,
    })
}

/// The first `slices` candidates in the order `cmp` gives their leftover (ties: lower index).
fn take_sorted(
    mut cands: Vec<(usize, u64, f64)>,
    slices: u32,
    cmp: impl Fn(&f64, &f64) -> std::cmp::Ordering,
) -> Vec<usize> {
    cands.sort_by(|a, b| cmp(&a.2, &b.2).then(a.0.cmp(&b.0)));
    cands.iter().take(slices as usize).map(|c| c.0).collect()
}

fn workload_of(req: &PodRequest) -> &Workload {
    static PRIOR: OnceLock<Workload> = OnceLock::new();
    req.workload
        .as_deref()
        .unwrap_or_else(|| PRIOR.get_or_init(Workload::prior))
}

/// Free compute per GPU as the fragmentation measure sees it.
fn frag_free(node: &NodeState, free: &[Free]) -> Vec<u32> {
    node.gpus
        .iter()
        .zip(free)
        .map(|(g, f)| if g.healthy { f.core } else { 0 })
        .collect()
}

/// FGD's choice of one shared GPU, as the paper's simulator makes it: each GPU that fits gets the
/// node score FGD would give the placement there (an integer 0..=100, see [`fgd::paper_score`]), and
/// the highest wins, ties to the lowest GPU index. Scoring the GPUs in integers, not by exact
/// fragmentation, is what the simulator does; near-equal GPUs then go to the first one.
fn fgd_gpu(
    node: &NodeState,
    req: &PodRequest,
    w: &Workload,
    free: &[Free],
    cands: &[(usize, u64, f64)],
    core: u32,
) -> usize {
    let mut cores = frag_free(node, free);
    let f0 = w.fragmentation(node, &cores, fgd::cpu_left(node, 0), fgd::mem_left(node, 0));
    let cpu = fgd::cpu_left(node, req.cpu_milli);
    let mem = fgd::mem_left(node, req.memory_mib);
    let mut best: Option<(f64, usize)> = None;
    for &(i, _, _) in cands {
        cores[i] -= core;
        let s = fgd::paper_score(f0, w.fragmentation(node, &cores, cpu, mem));
        cores[i] += core;
        if best.is_none_or(|(b, _)| s > b) {
            best = Some((s, i));
        }
    }
    best.expect("at least one candidate").1
}

/// Dot-product's choice: one shared (partly used) GPU or the lowest idle GPUs, whichever aligns
/// least with the request; returns the GPUs and the score of that choice.
fn dot_gpus(
    node: &NodeState,
    req: &PodRequest,
    free: &[Free],
    cands: &[(usize, u64, f64)],
    c: &ContainerRequest,
) -> (Vec<usize>, f64) {
    let cpu_left = fgd::cpu_left(node, 0).min(baselines::MAX_SPEC_CPU as u64);
    let want = u64::from(c.slices) * u64::from(c.core_milli);
    let idle: Vec<usize> = cands
        .iter()
        .filter(|x| free[x.0].core == CORE_MILLI_PER_GPU)
        .map(|x| x.0)
        .collect();
    let mut best: Option<(f64, Vec<usize>)> = None;
    if c.slices == 1 && c.core_milli < CORE_MILLI_PER_GPU {
        for &(i, _, _) in cands.iter().filter(|x| free[x.0].core < CORE_MILLI_PER_GPU) {
            let s = baselines::dot_product(cpu_left, u64::from(free[i].core), req.cpu_milli, want);
            if best.as_ref().is_none_or(|(b, _)| s > *b) {
                best = Some((s, vec![i]));
            }
        }
    }
    if idle.len() >= c.slices as usize {
        let left = idle.len() as u64 * u64::from(CORE_MILLI_PER_GPU);
        let s = baselines::dot_product(cpu_left, left, req.cpu_milli, want);
        if best.as_ref().is_none_or(|(b, _)| s > *b) {
            best = Some((s, idle[..c.slices as usize].to_vec()));
        }
    }
    match best {
        Some((s, g)) => (g, s),
        // Only partly used GPUs can serve a multi-slice request: take the tightest.
        None => (
            take_sorted(cands.to_vec(), c.slices, |a, b| a.total_cmp(b)),
            0.0,
        ),
    }
}

/// The policy's score of a node for a placement that takes `before` to `after`.
fn node_score(
    node: &NodeState,
    req: &PodRequest,
    before: &[Free],
    after: &[Free],
    chosen: &[Vec<usize>],
    workload: Option<&Workload>,
    dot_score: Option<f64>,
) -> f64 {
    let shape_gpus: u32 = req.containers.iter().map(|c| c.slices).sum();
    let gpu_total: u64 = before
        .iter()
        .zip(after)
        .map(|(b, a)| u64::from(b.core - a.core))
        .sum();
    let b = baselines::Before {
        node,
        free: &frag_free(node, before),
        cpu_left: fgd::cpu_left(node, 0),
    };
    match req.policy {
        Policy::Binpack => utilization_after(node, before, after),
        Policy::Spread => 1.0 - utilization_after(node, before, after),
        Policy::Fgd | Policy::FgdPack | Policy::FgdPackCpu => {
            let w = workload.expect("fgd policies have a workload");
            let f0 = w.fragmentation(node, b.free, b.cpu_left, fgd::mem_left(node, 0));
            let f1 = w.fragmentation(
                node,
                &frag_free(node, after),
                fgd::cpu_left(node, req.cpu_milli),
                fgd::mem_left(node, req.memory_mib),
            );
            // The paper's scorer: sigmoid of the growth in GPUs, as an integer 0..=100. The coarse
            // steps make near-equal nodes tie, and ties go to the first node, which packs; exact
            // comparison of tiny differences does measurably worse on the openb trace.
            let paper = fgd::paper_score(f0, f1);
            let in_use = before.iter().any(|b| b.core < CORE_MILLI_PER_GPU);
            // The variants only order the nodes FGD scores equally (a fraction below 1).
            match req.policy {
                Policy::FgdPackCpu if req.containers.is_empty() => {
                    // A pod without GPUs strands the free GPUs of its node if it takes the CPU or
                    // memory they need: among ties, the node with the least free GPU compute.
                    let free: u64 = b.free.iter().map(|&f| u64::from(f)).sum();
                    paper + 0.99 / (1.0 + free as f64 / f64::from(CORE_MILLI_PER_GPU))
                }
                // Among ties, a node already in use goes before an idle one: idle nodes stay
                // whole for multi-GPU pods.
                Policy::FgdPack | Policy::FgdPackCpu if in_use => paper + 0.5,
                _ => paper,
            }
        }
        Policy::Random => 0.0,
        Policy::DotProduct => {
            let s = dot_score.unwrap_or_else(|| {
                let left: u64 = b.free.iter().map(|&f| u64::from(f)).sum();
                let cpu_left = b.cpu_left.min(baselines::MAX_SPEC_CPU as u64);
                baselines::dot_product(cpu_left, left, req.cpu_milli, gpu_total)
            });
            (s * 100.0).trunc()
        }
        Policy::BestFit => baselines::best_fit(&b, req.cpu_milli, gpu_total),
        Policy::Packing => {
            let all: Vec<usize> = chosen.iter().flatten().copied().collect();
            baselines::packing(&b, shape_gpus, &all)
        }
        Policy::Clustering => {
            let core = req
                .containers
                .iter()
                .map(|c| c.normalized().core_milli)
                .max()
                .unwrap_or(0);
            baselines::clustering(&b, shape_gpus, core)
        }
    }
}

/// The score that decides between nodes at `position` in the caller's node order: the candidate's
/// score, except for `random`, where it is a uniform draw from [`PodRequest::salt`].
pub fn rank(req: &PodRequest, position: usize, cand: &Candidate) -> f64 {
    match req.policy {
        Policy::Random => baselines::uniform(req.salt, position),
        _ => cand.score,
    }
}

/// The shares of a candidate, ready to be reserved.
pub fn materialize(
    node: &NodeState,
    req: &PodRequest,
    cand: &Candidate,
) -> Vec<ContainerPlacement> {
    req.containers
        .iter()
        .zip(&cand.gpus)
        .map(|(c, gpus)| {
            let c = c.normalized();
            ContainerPlacement {
                container: c.name.clone(),
                shares: gpus
                    .iter()
                    .map(|&i| pb::GpuShare {
                        gpu_uuid: node.gpus[i].uuid.clone(),
                        mem_mib: c.mem_on(&node.gpus[i]),
                        core_milli: c.core_milli,
                    })
                    .collect(),
            }
        })
        .collect()
}

/// Place every container of `req` on `node`, or say why not.
pub fn place_on_node(node: &NodeState, req: &PodRequest) -> Result<Vec<ContainerPlacement>, Fit> {
    evaluate(node, req).map(|c| materialize(node, req, &c))
}

/// Why the pod can never fit on this node (whatever is released), if so.
fn never_fits(node: &NodeState, req: &PodRequest) -> Option<String> {
    if node.cpu_milli > 0 && req.cpu_milli > node.cpu_milli {
        return Some(format!(
            "pod requests {}m CPU, node has {}m",
            req.cpu_milli, node.cpu_milli
        ));
    }
    if node.memory_mib > 0 && req.memory_mib > node.memory_mib {
        return Some(format!(
            "pod requests {} MiB host memory, node has {} MiB",
            req.memory_mib, node.memory_mib
        ));
    }
    for c in &req.containers {
        let c = c.normalized();
        let able = node
            .gpus
            .iter()
            .filter(|g| req.selector.accepts(g) && c.mem_on(g) <= g.memory_mib)
            .count();
        if able < c.slices as usize {
            let accepted: Vec<&GpuState> = node
                .gpus
                .iter()
                .filter(|g| req.selector.accepts(g))
                .collect();
            if accepted.is_empty() {
                return Some(if node.gpus.is_empty() {
                    "node has no GPU".to_string()
                } else {
                    "no GPU on the node matches the pod's gpu-type/gpu-uuid selectors".to_string()
                });
            }
            let largest = accepted.iter().map(|g| g.memory_mib).max().unwrap_or(0);
            return Some(if accepted.len() < c.slices as usize {
                format!(
                    "container {} needs {} GPUs, node has {} matching",
                    c.name,
                    c.slices,
                    accepted.len()
                )
            } else {
                format!(
                    "container {} needs {} MiB per GPU, largest GPU has {} MiB",
                    c.name, c.mem_mib, largest
                )
            });
        }
    }
    None
}

fn shortage(node: &NodeState, req: &PodRequest, c: &ContainerRequest, free: &[Free]) -> String {
    let healthy = node
        .gpus
        .iter()
        .filter(|g| g.healthy && req.selector.accepts(g))
        .count();
    if healthy < c.slices as usize {
        return format!(
            "container {} needs {} healthy GPUs, node has {healthy}",
            c.name, c.slices
        );
    }
    let best_mem = node
        .gpus
        .iter()
        .zip(free)
        .filter(|(g, _)| g.healthy && req.selector.accepts(g))
        .map(|(_, f)| f.mem)
        .max()
        .unwrap_or(0);
    let best_core = node
        .gpus
        .iter()
        .zip(free)
        .filter(|(g, _)| g.healthy && req.selector.accepts(g))
        .map(|(_, f)| f.core)
        .max()
        .unwrap_or(0);
    let mem = node.gpus.first().map_or(c.mem_mib, |g| c.mem_on(g));
    format!(
        "container {} needs {} GPU(s) with {} MiB and {}% compute free; most free: {} MiB, {}%",
        c.name,
        c.slices,
        mem,
        c.core_milli / 10,
        best_mem,
        best_core / 10
    )
}

/// Whether the pod fits on the node now, later, or never.
pub fn fit_node(node: &NodeState, req: &PodRequest) -> Fit {
    // Fast yes for the common one-container, one-slice pod: what `evaluate` would accept,
    // without building a placement (Filter runs this for thousands of nodes per pod).
    if let [c] = req.containers.as_slice()
        && c.slices == 1
        && node_has_room(node, req)
    {
        let fits = node.gpus.iter().any(|g| {
            let (mem, core) = c.slice_on(g);
            g.healthy
                && mem <= g.memory_mib
                && mem <= g.mem_free()
                && core <= g.core_free()
                && req.selector.accepts(g)
        });
        if fits {
            return Fit::Fits;
        }
    }
    match evaluate(node, req) {
        Ok(_) => Fit::Fits,
        Err(f) => f,
    }
}

/// Why a node that gpuledger does not know can never host a pod.
pub const NOT_REGISTERED: &str =
    "node is not registered with gpuledger (no node agent running there?)";

/// Filter's answer for a list of nodes: where the pod fits, and why not elsewhere.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Filtered {
    /// Nodes where the pod fits now, in the order asked.
    pub fits: Vec<String>,
    /// Node and why the pod does not fit there now.
    pub wait: Vec<(String, String)>,
    /// Node and why the pod can never fit there (unregistered nodes included).
    pub never: Vec<(String, String)>,
    /// How many of the nodes are not registered (they are in `never`).
    pub unregistered: usize,
}

/// Filter `names` for the request against the state: the one procedure behind the allocator's
/// Filter and the extender's answer from its replica, so both give the same reasons.
pub fn filter_nodes<S: AsRef<str> + Into<String>>(
    ledger: &Ledger,
    names: impl IntoIterator<Item = S>,
    req: &PodRequest,
) -> Filtered {
    let mut out = Filtered::default();
    for n in names {
        match ledger.node(n.as_ref()).map(|ns| fit_node(ns, req)) {
            None => {
                out.unregistered += 1;
                out.never.push((n.into(), NOT_REGISTERED.to_string()));
            }
            Some(Fit::Fits) => out.fits.push(n.into()),
            Some(Fit::Wait(why)) => out.wait.push((n.into(), why)),
            Some(Fit::Never(why)) => out.never.push((n.into(), why)),
        }
    }
    out
}

/// [`score_node`] for each named node, in order; None for a node the state does not know.
pub fn score_nodes<'a>(
    ledger: &'a Ledger,
    names: impl IntoIterator<Item = &'a str> + 'a,
    req: &'a PodRequest,
) -> impl Iterator<Item = (&'a str, Option<u32>)> + 'a {
    names
        .into_iter()
        .map(move |n| (n, ledger.node(n).map(|ns| score_node(ns, req))))
}

/// The node's CPU and host memory take the pod (the node-level checks of `evaluate`).
fn node_has_room(node: &NodeState, req: &PodRequest) -> bool {
    (node.cpu_milli == 0 || node.cpu_used + req.cpu_milli <= node.cpu_milli)
        && (node.memory_mib == 0 || node.memory_used + req.memory_mib <= node.memory_mib)
}

/// Fraction (0..=1) of the node's GPU memory and compute in use after `before` becomes `after`.
fn utilization_after(node: &NodeState, before: &[Free], after: &[Free]) -> f64 {
    let mem_cap: u64 = node.gpus.iter().map(|g| g.memory_mib).sum();
    if mem_cap == 0 {
        return 0.0;
    }
    let core_cap = u64::from(CORE_MILLI_PER_GPU) * node.gpus.len() as u64;
    let placed_mem: u64 = before.iter().zip(after).map(|(b, a)| b.mem - a.mem).sum();
    let placed_core: u64 = before
        .iter()
        .zip(after)
        .map(|(b, a)| u64::from(b.core - a.core))
        .sum();
    let mem_used = node.gpus.iter().map(|g| g.mem_used).sum::<u64>() + placed_mem;
    let core_used = node
        .gpus
        .iter()
        .map(|g| u64::from(g.core_used))
        .sum::<u64>()
        + placed_core;
    (mem_used as f64 / mem_cap as f64 + core_used as f64 / core_cap as f64) / 2.0
}

/// A node's score for the request, 0..=10 (kube-scheduler's extender range); 0 when it does not fit.
pub fn score_node(node: &NodeState, req: &PodRequest) -> u32 {
    score_one_slice(node, req).unwrap_or_else(|| score_of(evaluate(node, req), req))
}

/// [`score_node`] for the common one-container, one-slice pod under binpack or spread, without
/// building a placement (Prioritize runs this for thousands of nodes per pod): the GPU and the
/// utilization `evaluate` would choose and score. None = not such a request.
fn score_one_slice(node: &NodeState, req: &PodRequest) -> Option<u32> {
    let [c] = req.containers.as_slice() else {
        return None;
    };
    let spread = match req.policy {
        Policy::Binpack => false,
        Policy::Spread => true,
        _ => return None,
    };
    if c.slices != 1 {
        return None;
    }
    if !node_has_room(node, req) {
        return Some(0);
    }
    // The candidate `take_sorted` puts first: least (binpack) or most (spread) left over,
    // ties to the lower index.
    let mut best: Option<(f64, u64, u32)> = None;
    for g in node
        .gpus
        .iter()
        .filter(|g| g.healthy && req.selector.accepts(g))
    {
        let (mem, core) = c.slice_on(g);
        let (free_mem, free_core) = (g.mem_free(), g.core_free());
        if free_mem < mem || free_core < core {
            continue;
        }
        let left = (free_mem - mem) as f64 / g.memory_mib.max(1) as f64
            + f64::from(free_core - core) / f64::from(CORE_MILLI_PER_GPU);
        let better = best.is_none_or(|(b, _, _)| {
            let o = left.total_cmp(&b);
            if spread { o.is_gt() } else { o.is_lt() }
        });
        if better {
            best = Some((left, mem, core));
        }
    }
    let Some((_, mem, core)) = best else {
        return Some(0);
    };
    let mem_cap: u64 = node.gpus.iter().map(|g| g.memory_mib).sum();
    let used = if mem_cap == 0 {
        0.0
    } else {
        let core_cap = u64::from(CORE_MILLI_PER_GPU) * node.gpus.len() as u64;
        let mem_used = node.gpus.iter().map(|g| g.mem_used).sum::<u64>() + mem;
        let core_used = node
            .gpus
            .iter()
            .map(|g| u64::from(g.core_used))
            .sum::<u64>()
            + u64::from(core);
        (mem_used as f64 / mem_cap as f64 + core_used as f64 / core_cap as f64) / 2.0
    };
    let s = if spread { 1.0 - used } else { used };
    Some(((s * 10.0).round() as u32).clamp(1, 10))
}

/// The 0..=10 score of an evaluation.
fn score_of(evaluated: Result<Candidate, Fit>, req: &PodRequest) -> u32 {
    match evaluated {
        Err(_) => 0,
        Ok(c) => {
            let s = match req.policy {
                Policy::Binpack | Policy::Spread => c.score,
                // Growth of fragmentation in GPUs, squashed as the paper's scorer does.
                Policy::Fgd | Policy::FgdPack | Policy::FgdPackCpu => c.score.trunc() / 100.0,
                Policy::Random => 0.5,
                Policy::DotProduct | Policy::BestFit | Policy::Packing | Policy::Clustering => {
                    c.score / 100.0
                }
            };
            // Fitting nodes score at least 1 so that they stay ahead of non-fitting ones.
            ((s * 10.0).round() as u32).clamp(1, 10)
        }
    }
}

/// The best node among `nodes` for the request, with its placement (ties: the first node).
pub fn choose_node<'a>(
    nodes: impl IntoIterator<Item = &'a NodeState>,
    req: &PodRequest,
) -> Option<(&'a NodeState, Vec<ContainerPlacement>)> {
    let mut best: Option<(f64, &'a NodeState, Candidate)> = None;
    for (pos, n) in nodes.into_iter().enumerate() {
        if let Ok(c) = evaluate(n, req) {
            let s = rank(req, pos, &c);
            if best.as_ref().is_none_or(|(b, _, _)| s > *b) {
                best = Some((s, n, c));
            }
        }
    }
    best.map(|(_, n, c)| {
        let p = materialize(n, req, &c);
        (n, p)
    })
}

#[cfg(test)]
mod tests;
