//! Placement: which GPUs of which node a pod's containers get.
//!
//! Pure functions of a [`NodeState`] and a [`PodRequest`]. Selectors (GPU type and UUID
//! include/exclude) apply first; then the policy orders the GPUs inside a node and scores nodes.
//! Multi-slice containers take distinct GPUs of one node; the containers of a pod are placed in
//! order, each seeing what the previous ones took.

use std::fmt;
use std::str::FromStr;

use crate::CORE_MILLI_PER_GPU;
use crate::pb;
use crate::state::{GpuState, NodeState};

/// How GPUs and nodes are chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum Policy {
    /// Tightest GPU, then the fullest node: keeps whole GPUs free for large requests (default).
    #[default]
    Binpack,
    /// Emptiest GPU, then the emptiest node: spreads load and interference.
    Spread,
}

impl Policy {
    /// Every policy name, as the CLI and the pod annotation spell them.
    pub const NAMES: &'static [&'static str] = &["binpack", "spread"];

    /// The name as written in the ledger.
    pub fn as_str(self) -> &'static str {
        match self {
            Policy::Binpack => "binpack",
            Policy::Spread => "spread",
        }
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
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "binpack" => Ok(Policy::Binpack),
            "spread" => Ok(Policy::Spread),
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
        if c.mem_mib == 0 && c.mem_percent == 0 && c.core_milli == 0 {
            c.mem_percent = 100;
            c.core_milli = CORE_MILLI_PER_GPU;
        }
        c
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
}

impl Selector {
    /// Whether the selector accepts this GPU (health is not the selector's business).
    pub fn accepts(&self, gpu: &GpuState) -> bool {
        let model = gpu.model.to_ascii_lowercase();
        let type_match = |t: &String| model.contains(&t.to_ascii_lowercase());
        (self.types.is_empty() || self.types.iter().any(type_match))
            && !self.types_exclude.iter().any(type_match)
            && (self.uuids.is_empty() || self.uuids.contains(&gpu.uuid))
            && !self.uuids_exclude.contains(&gpu.uuid)
    }
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
}

impl PodRequest {
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

/// Place every container of `req` on `node`, or say why not.
pub fn place_on_node(node: &NodeState, req: &PodRequest) -> Result<Vec<ContainerPlacement>, Fit> {
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
    let mut free: Vec<Free> = node
        .gpus
        .iter()
        .map(|g| Free {
            mem: g.mem_free(),
            core: g.core_free(),
        })
        .collect();
    let mut out = Vec::with_capacity(req.containers.len());
    for c in &req.containers {
        let c = c.normalized();
        let mut cands: Vec<(usize, u64, f64)> = node
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
        match req.policy {
            Policy::Binpack => cands.sort_by(|a, b| a.2.total_cmp(&b.2).then(a.0.cmp(&b.0))),
            Policy::Spread => cands.sort_by(|a, b| b.2.total_cmp(&a.2).then(a.0.cmp(&b.0))),
        }
        let mut shares = Vec::with_capacity(c.slices as usize);
        for &(i, mem, _) in cands.iter().take(c.slices as usize) {
            free[i].mem -= mem;
            free[i].core -= c.core_milli;
            shares.push(pb::GpuShare {
                gpu_uuid: node.gpus[i].uuid.clone(),
                mem_mib: mem,
                core_milli: c.core_milli,
            });
        }
        out.push(ContainerPlacement {
            container: c.name.clone(),
            shares,
        });
    }
    Ok(out)
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
    match place_on_node(node, req) {
        Ok(_) => Fit::Fits,
        Err(f) => f,
    }
}

/// Fraction (0..=1) of the node's GPU memory and compute in use after `placed` is added.
fn utilization_after(node: &NodeState, placed: &[ContainerPlacement]) -> f64 {
    let mem_cap: u64 = node.gpus.iter().map(|g| g.memory_mib).sum();
    if mem_cap == 0 {
        return 0.0;
    }
    let core_cap = u64::from(CORE_MILLI_PER_GPU) * node.gpus.len() as u64;
    let mem_used: u64 = node.gpus.iter().map(|g| g.mem_used).sum::<u64>()
        + placed
            .iter()
            .flat_map(|p| &p.shares)
            .map(|s| s.mem_mib)
            .sum::<u64>();
    let core_used: u64 = node
        .gpus
        .iter()
        .map(|g| u64::from(g.core_used))
        .sum::<u64>()
        + placed
            .iter()
            .flat_map(|p| &p.shares)
            .map(|s| u64::from(s.core_milli))
            .sum::<u64>();
    (mem_used as f64 / mem_cap as f64 + core_used as f64 / core_cap as f64) / 2.0
}

/// A node's score for the request, 0..=10 (kube-scheduler's extender range); 0 when it does not fit.
pub fn score_node(node: &NodeState, req: &PodRequest) -> u32 {
    match place_on_node(node, req) {
        Err(_) => 0,
        Ok(placed) => {
            let u = utilization_after(node, &placed);
            let s = match req.policy {
                Policy::Binpack => u,
                Policy::Spread => 1.0 - u,
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
    let mut best: Option<(f64, &'a NodeState, Vec<ContainerPlacement>)> = None;
    for n in nodes {
        if let Ok(p) = place_on_node(n, req) {
            let u = utilization_after(n, &p);
            let s = match req.policy {
                Policy::Binpack => u,
                Policy::Spread => 1.0 - u,
            };
            if best.as_ref().is_none_or(|(b, _, _)| s > *b) {
                best = Some((s, n, p));
            }
        }
    }
    best.map(|(_, n, p)| (n, p))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(i: u32, mem: u64) -> GpuState {
        GpuState {
            uuid: format!("GPU-{i}"),
            index: i,
            model: "NVIDIA A100-SXM4-80GB".into(),
            memory_mib: mem,
            healthy: true,
            mem_used: 0,
            core_used: 0,
            holders: 0,
        }
    }

    fn node(gpus: Vec<GpuState>) -> NodeState {
        NodeState {
            name: "n1".into(),
            gpus,
            cpu_milli: 0,
            memory_mib: 0,
            cpu_used: 0,
            memory_used: 0,
            allocs: Default::default(),
        }
    }

    fn req(slices: u32, mem: u64, policy: Policy) -> PodRequest {
        PodRequest {
            pod: pb::PodRef {
                uid: "u".into(),
                namespace: "ns".into(),
                name: "p".into(),
            },
            containers: vec![ContainerRequest {
                name: "c".into(),
                slices,
                mem_mib: mem,
                ..Default::default()
            }],
            policy,
            ..Default::default()
        }
    }

    #[test]
    fn binpack_takes_the_tightest_gpu_and_spread_the_emptiest() {
        let mut n = node(vec![gpu(0, 16000), gpu(1, 16000), gpu(2, 16000)]);
        n.gpus[1].mem_used = 10000;
        let p = place_on_node(&n, &req(1, 4000, Policy::Binpack)).expect("fits");
        assert_eq!(p[0].shares[0].gpu_uuid, "GPU-1");
        let p = place_on_node(&n, &req(1, 4000, Policy::Spread)).expect("fits");
        assert_eq!(p[0].shares[0].gpu_uuid, "GPU-0");
    }

    #[test]
    fn multi_slice_takes_distinct_gpus() {
        let n = node(vec![gpu(0, 16000), gpu(1, 16000)]);
        let p = place_on_node(&n, &req(2, 1000, Policy::Binpack)).expect("fits");
        assert_ne!(p[0].shares[0].gpu_uuid, p[0].shares[1].gpu_uuid);
        assert!(matches!(
            place_on_node(&n, &req(3, 1000, Policy::Binpack)),
            Err(Fit::Never(_))
        ));
    }

    #[test]
    fn too_large_is_never_and_full_is_wait() {
        let mut n = node(vec![gpu(0, 16000)]);
        assert!(matches!(
            fit_node(&n, &req(1, 20000, Policy::Binpack)),
            Fit::Never(_)
        ));
        n.gpus[0].mem_used = 15000;
        assert!(matches!(
            fit_node(&n, &req(1, 2000, Policy::Binpack)),
            Fit::Wait(_)
        ));
        n.gpus[0].healthy = false;
        n.gpus[0].mem_used = 0;
        assert!(matches!(
            fit_node(&n, &req(1, 2000, Policy::Binpack)),
            Fit::Wait(_)
        ));
    }

    #[test]
    fn selectors_filter_gpus() {
        let mut n = node(vec![gpu(0, 16000), gpu(1, 16000)]);
        n.gpus[0].model = "Tesla T4".into();
        let mut r = req(1, 1000, Policy::Spread);
        r.selector.types = vec!["a100".into()];
        let p = place_on_node(&n, &r).expect("fits");
        assert_eq!(p[0].shares[0].gpu_uuid, "GPU-1");
        r.selector.uuids_exclude = vec!["GPU-1".into()];
        assert!(matches!(fit_node(&n, &r), Fit::Never(_)));
    }

    #[test]
    fn percent_memory_resolves_per_gpu_and_bare_slice_is_whole_gpu() {
        let n = node(vec![gpu(0, 16000)]);
        let mut r = req(1, 0, Policy::Binpack);
        r.containers[0].mem_percent = 50;
        let p = place_on_node(&n, &r).expect("fits");
        assert_eq!(p[0].shares[0].mem_mib, 8000);
        let p = place_on_node(&n, &req(1, 0, Policy::Binpack)).expect("fits");
        assert_eq!(p[0].shares[0].mem_mib, 16000);
        assert_eq!(p[0].shares[0].core_milli, 1000);
    }

    #[test]
    fn validation_explains() {
        let mut r = req(1, 100, Policy::Binpack);
        r.containers[0].core_milli = 1500;
        assert!(r.validate().expect_err("bad core").contains("0-100"));
        let mut r = req(1, 100, Policy::Binpack);
        r.containers[0].mem_percent = 10;
        assert!(r.validate().expect_err("both").contains("both"));
        assert!("fastest".parse::<Policy>().is_err());
    }
}
