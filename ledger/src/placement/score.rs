//! Score: how a policy rates a node for a pod, and the 0..=10 form the extender gives
//! kube-scheduler.

use super::filter::node_has_room;
use super::{
    Candidate, Fit, Free, PodRequest, Policy, Workload, baselines, evaluate, fgd, frag_free, strand,
};
use crate::CORE_MILLI_PER_GPU;
use crate::state::{Ledger, NodeState};

/// The policy's score of a node for a placement that takes `before` to `after`.
pub(super) fn node_score(
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
        Policy::FgdStrand => {
            let w = workload.expect("fgd policies have a workload");
            let start = strand::Start::of(w, node, b.free);
            strand::score(w, node, req, &start, b.free, &frag_free(node, after))
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

/// A node's score for the request, 0..=10 (kube-scheduler's extender range); 0 when it does not fit.
pub fn score_node(node: &NodeState, req: &PodRequest) -> u32 {
    score_one_slice(node, req).unwrap_or_else(|| score_of(evaluate(node, req), req))
}

/// [`score_node`] for each named node, in order; None for a node the state does not know.
/// Nodes [`alike`] a recently scored one take its score without evaluating again: a cluster's
/// idle nodes of one kind are scored once per request (Prioritize sends thousands of names).
pub fn score_nodes<'a>(
    ledger: &'a Ledger,
    names: impl IntoIterator<Item = &'a str> + 'a,
    req: &'a PodRequest,
) -> impl Iterator<Item = (&'a str, Option<u32>)> + 'a {
    let mut score = scorer(req);
    names.into_iter().map(move |n| {
        // A node where room is nominated for pods that outrank this one is scored as they
        // will leave it, never from the memo of nodes alike.
        let s = match ledger.node_for(n, req) {
            None => None,
            Some(std::borrow::Cow::Borrowed(ns)) => Some(score(ns)),
            Some(std::borrow::Cow::Owned(ns)) => Some(score_node(&ns, req)),
        };
        (n, s)
    })
}

/// [`score_node`] for the request, remembering the last few node states scored: a node
/// [`alike`] one of them takes its score (unless a UUID selector tells their GPUs apart).
pub(super) fn scorer<'a>(req: &'a PodRequest) -> impl FnMut(&'a NodeState) -> u32 {
    let memo = req.selector.uuids.is_empty() && req.selector.uuids_exclude.is_empty();
    let mut seen: Vec<(&'a NodeState, u32)> = Vec::with_capacity(MEMO_NODES);
    let mut next = 0;
    move |ns| {
        if !memo {
            return score_node(ns, req);
        }
        if let Some(&(_, s)) = seen.iter().find(|(o, _)| alike(o, ns)) {
            return s;
        }
        let s = score_node(ns, req);
        if seen.len() < MEMO_NODES {
            seen.push((ns, s));
        } else {
            seen[next] = (ns, s);
            next = (next + 1) % MEMO_NODES;
        }
        s
    }
}

/// Distinct node states [`score_nodes`] remembers per request: few, since every miss compares
/// against all of them.
const MEMO_NODES: usize = 4;

/// Whether a placement policy must treat the two nodes alike: the same GPUs in order (model,
/// memory, health, memory and compute in use), the same CPU and host memory, allocatable and
/// used, and the same pod kinds. Only names, UUIDs and indices may differ.
fn alike(a: &NodeState, b: &NodeState) -> bool {
    a.mode == b.mode
        && a.cpu_milli == b.cpu_milli
        && a.cpu_used == b.cpu_used
        && a.memory_mib == b.memory_mib
        && a.memory_used == b.memory_used
        && a.pod_kinds == b.pod_kinds
        && a.gpus.len() == b.gpus.len()
        && a.gpus.iter().zip(&b.gpus).all(|(x, y)| {
            x.core_used == y.core_used
                && x.index == y.index
                && x.mem_used == y.mem_used
                && x.memory_mib == y.memory_mib
                && x.healthy == y.healthy
                && x.model == y.model
        })
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
    // Only where the policy chooses the GPU and the node serves the device plugin: `evaluate`
    // says why not elsewhere, and takes the first fit for a DRA pod.
    if c.slices != 1 || req.dra || node.mode != crate::pb::NodeMode::DevicePlugin {
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
pub(super) fn score_of(evaluated: Result<Candidate, Fit>, req: &PodRequest) -> u32 {
    match evaluated {
        Err(_) => 0,
        Ok(c) => {
            let s = match req.policy {
                Policy::Binpack | Policy::Spread => c.score,
                // Growth of fragmentation in GPUs, squashed as the paper's scorer does.
                Policy::Fgd | Policy::FgdPack | Policy::FgdPackCpu | Policy::FgdStrand => {
                    c.score.trunc() / 100.0
                }
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
