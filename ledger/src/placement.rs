//! Placement: which GPUs of which node a pod's containers get.
//!
//! Pure functions of a [`NodeState`] and a [`PodRequest`]. Selectors (GPU type and UUID
//! include/exclude) apply first; then the policy orders the GPUs inside a node and scores nodes.
//! Multi-slice containers take distinct GPUs of one node; the containers of a pod are placed in
//! order, each seeing what the previous ones took. [`evaluate`] is the one decision procedure:
//! [`place_on_node`], [`score_node`], [`choose_node`] and the trace simulator all go through it.

mod baselines;
mod fgd;
mod filter;
pub mod preempt;
mod request;
mod score;
mod strand;
mod value;

use std::sync::OnceLock;

use crate::CORE_MILLI_PER_GPU;
use crate::pb;
use crate::state::NodeState;
use filter::{never_fits, shortage};
use score::node_score;

pub use fgd::{PodShape, Workload};
pub use filter::{
    DEVICE_PLUGIN_NODE, DRA_NODE, Filtered, Fit, NOT_REGISTERED, filter_nodes, fit_node,
};
pub use request::{ContainerRequest, Defaults, PodRequest, Policy, Selector};
pub use score::{score_node, score_nodes};
pub use value::GapValues;

/// The nodes alike in capacity (CPU, host memory, and each GPU's model and memory), one of each
/// kind with how many there are, in the order each kind first appears. Nodes of one kind can
/// host the same pods when empty.
pub fn node_kinds<'a>(nodes: impl IntoIterator<Item = &'a NodeState>) -> Vec<(&'a NodeState, u64)> {
    type Capacity<'a> = (u64, u64, Vec<(&'a str, u64)>);
    let mut at: std::collections::HashMap<Capacity<'a>, usize> = Default::default();
    let mut kinds: Vec<(&'a NodeState, u64)> = Vec::new();
    for n in nodes {
        let mut gpus: Vec<(&str, u64)> = n
            .gpus
            .iter()
            .map(|g| (g.model.as_str(), g.memory_mib))
            .collect();
        gpus.sort_unstable();
        let i = *at
            .entry((n.cpu_milli, n.memory_mib, gpus))
            .or_insert_with(|| {
                kinds.push((n, 0));
                kinds.len() - 1
            });
        kinds[i].1 += 1;
    }
    kinds
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

/// Who picks the GPUs within a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceChoice {
    /// The policy (gpuledger's device-plugin path: the ledger reserves the GPUs it scores).
    #[default]
    Policy,
    /// kube-scheduler's structured allocator (the DRA path): for each container in order, the
    /// first GPUs in index order whose remaining memory and compute cover the request (what a
    /// DRA request, `PodRequest::dra`, always gets). The policy still scores the node, by the
    /// GPUs first fit takes (unhealthy ones, tainted, passed by); a first-fit GPU the ledger
    /// would refuse fails the node.
    FirstFit,
}

/// Decide how `req` would be served on `node` under its policy, or say why it cannot be.
///
/// This is the single decision procedure; the other functions here and the trace simulator are
/// built on it.
pub fn evaluate(node: &NodeState, req: &PodRequest) -> Result<Candidate, Fit> {
    evaluate_with(node, req, DeviceChoice::Policy)
}

/// [`evaluate`] with the GPUs within the node picked by `choice`.
pub fn evaluate_with(
    node: &NodeState,
    req: &PodRequest,
    choice: DeviceChoice,
) -> Result<Candidate, Fit> {
    if let Some(never) = never_fits(node, req) {
        return Err(Fit::Never(never));
    }
    if node.cpu_milli > 0 && node.cpu_used.saturating_add(req.cpu_milli) > node.cpu_milli {
        return Err(Fit::Wait(format!(
            "node CPU: {}m requested, {}m free",
            req.cpu_milli,
            // Room nominated for other pods may count past capacity (`Ledger::node_for`).
            node.cpu_milli.saturating_sub(node.cpu_used)
        )));
    }
    if node.memory_mib > 0 && node.memory_used.saturating_add(req.memory_mib) > node.memory_mib {
        return Err(Fit::Wait(format!(
            "node memory: {} MiB requested, {} MiB free",
            req.memory_mib,
            node.memory_mib.saturating_sub(node.memory_used)
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
    // fgd-strand's baseline of the node, once per decision: both the GPU choice and the node
    // score measure against it.
    let strand_start = match (req.policy, workload) {
        (Policy::FgdStrand, Some(w)) => Some(strand::Start::of(w, node, &frag_free(node, &before))),
        _ => None,
    };
    // The cost of the one shared GPU a one-container pod takes: its node score, already known.
    let mut strand_delta = None;
    let mut chosen_all = Vec::with_capacity(req.containers.len());
    let mut dot_score = None;
    for (k, c) in req.containers.iter().enumerate() {
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
            // The pod's own claims (the webhook's): the scheduler does not see the pod's
            // selectors, so a first-fit GPU the ledger would refuse fails the node.
            _ if req.dra || choice == DeviceChoice::FirstFit => first_fit(node, req, &c, &free)?,
            Policy::Spread => take_sorted(cands, c.slices, |a, b| b.total_cmp(a)),
            Policy::FgdStrand if c.slices == 1 && c.core_milli < CORE_MILLI_PER_GPU => {
                let w = workload.expect("fgd policies have a workload");
                let cores = frag_free(node, &free);
                let later;
                let start = match &strand_start {
                    Some(s) if k == 0 => s,
                    _ => {
                        later = strand::Start::of(w, node, &cores);
                        &later
                    }
                };
                let cands = cands.iter().map(|x| x.0);
                let pick = strand::gpu(w, node, req, start, &cores, cands, c.core_milli);
                if req.containers.len() == 1 {
                    strand_delta = pick.map(|p| p.1);
                }
                pick.map(|p| p.0).into_iter().collect()
            }
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
    let score = match (&strand_start, strand_delta) {
        (Some(_), Some(d)) => strand::score_of(node, req, &frag_free(node, &before), d),
        (Some(start), None) => {
            let w = workload.expect("fgd policies have a workload");
            let (b, a) = (frag_free(node, &before), frag_free(node, &free));
            strand::score(w, node, req, start, &b, &a)
        }
        _ => node_score(node, req, &before, &free, &chosen_all, workload, dot_score),
    };
    Ok(Candidate {
        score,
        gpus: chosen_all,
    })
}

/// The GPUs kube-scheduler's structured allocator gives one DRA request of `c` on `node`, and
/// whether the ledger accepts them: devices are tried in slice order (gpuledger's node agent
/// publishes them by GPU index), and each of the `slices` distinct devices is the first whose
/// remaining memory and compute cover the request (the slice's request policy, 1 MiB and 1
/// core_milli steps, rounds nothing), passing unhealthy GPUs by (their device taint). The
/// scheduler does not see the pod's gpu-type/gpu-uuid selectors, so a choice the ledger would
/// refuse is a `Wait` with the GPU named.
fn first_fit(
    node: &NodeState,
    req: &PodRequest,
    c: &ContainerRequest,
    free: &[Free],
) -> Result<Vec<usize>, Fit> {
    let mut order: Vec<usize> = (0..node.gpus.len()).collect();
    order.sort_by_key(|&i| node.gpus[i].index);
    let chosen: Vec<usize> = order
        .into_iter()
        // An unhealthy GPU carries the node agent's NoSchedule device taint (or is left out of
        // the slice): the scheduler passes it by.
        .filter(|&i| {
            node.gpus[i].healthy
                && free[i].mem >= c.mem_on(&node.gpus[i])
                && free[i].core >= c.core_milli
        })
        .take(c.slices as usize)
        .collect();
    if chosen.len() < c.slices as usize {
        let unhealthy = node.gpus.iter().filter(|g| !g.healthy).count();
        return Err(Fit::Wait(format!(
            "container {} needs {} GPU(s) with {} MiB and {}% compute free; {} have it ({unhealthy} unhealthy, tainted)",
            c.name,
            c.slices,
            node.gpus.first().map_or(c.mem_mib, |g| c.mem_on(g)),
            c.core_milli / 10,
            chosen.len()
        )));
    }
    if let Some(g) = chosen
        .iter()
        .map(|&i| &node.gpus[i])
        .find(|g| !req.selector.accepts(g))
    {
        return Err(Fit::Wait(format!(
            "the scheduler's first fit gives container {} GPU {} (index {}), which is excluded by the pod's gpu-type/gpu-uuid selectors",
            c.name, g.uuid, g.index
        )));
    }
    Ok(chosen)
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
    let free_cores = cores.clone();
    for i in distinct_gpus(node, &free_cores, cands.iter().map(|c| c.0)) {
        cores[i] -= core;
        let s = fgd::paper_score(f0, w.fragmentation(node, &cores, cpu, mem));
        cores[i] += core;
        if best.is_none_or(|(b, _)| s > b) {
            best = Some((s, i));
        }
    }
    best.expect("at least one candidate").1
}

/// The GPUs of `cands` that differ from every earlier one in free compute (`free`, indexed like
/// the node's GPUs) or model. A shared GPU's fragmentation scores depend only on those, so the
/// first of each kind wins any tie among its kind: an idle 8-GPU node is scored once, not 8 times.
fn distinct_gpus<'a>(
    node: &'a NodeState,
    free: &'a [u32],
    cands: impl Iterator<Item = usize> + 'a,
) -> impl Iterator<Item = usize> + 'a {
    let mut seen: Vec<(u32, &str)> = Vec::new();
    cands.filter(move |&i| {
        let key = (free[i], node.gpus[i].model.as_str());
        let new = !seen.contains(&key);
        if new {
            seen.push(key);
        }
        new
    })
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
mod dra_tests;
#[cfg(test)]
mod tests;
