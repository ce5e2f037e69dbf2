//! `fgd-strand`: FGD with a look-ahead for GPU that CPU and host memory would strand, and shared
//! GPUs valued by what the workload can still pack into them.
//!
//! A placement is scored by how much it lowers four things on its node:
//! - the value of the GPUs' free shares to the pods to come ([`super::GapValues`]), which measures
//!   fragmentation of shared GPUs better than FGD's per-shape count (beyond the value of the
//!   shares the pod takes, which is the same on every node);
//! - FGD's fragmentation for the multi-GPU shapes only (whole free GPUs on one node), each shape
//!   weighted by its probability over the square root of the share of the cluster's GPUs that
//!   could host it ([`Workload::on_cluster`]): a node that is one of few hosts of a shape is
//!   kept for it;
//! - the free GPU that the node's free CPU or memory could no longer feed if the rest of the node
//!   filled with the GPU pods that can land on *that* node (model, GPU count, CPU, memory), at
//!   their mean CPU and memory per GPU;
//! - at half weight, the free GPU that one-GPU shapes could no longer reach at all for lack of
//!   CPU or memory (FGD's own check, for the shapes whose share fragmentation the values replace);
//! - the GPU the placement takes from the few hosts of one-GPU shapes, weighted by how short
//!   those hosts are for them ([`Landing::reserve`]): pods that could go anywhere leave a small
//!   pool to the pods pinned to it.

use super::PodRequest;
use super::fgd::{self, PodShape, Workload};
use crate::CORE_MILLI_PER_GPU;
use crate::state::NodeState;

/// Weight of stranded GPU against lost share value. Heavier weights leave whole nodes without the
/// CPU that multi-GPU pods need; measured in `docs/placement.md`.
const STRAND_WEIGHT: f64 = 0.25;

/// Weight of the free GPU that one-GPU shapes can no longer reach for lack of CPU or memory
/// ([`Workload::cpu_blocked`]): FGD's own feasibility check, which keeps cores where the cluster
/// runs out of CPU first; heavier weights cost the mixes where it does not, lighter ones the
/// CPU-heavy mixes (`docs/placement.md`).
const BLOCKED_WEIGHT: f64 = 0.5;

/// Weight of the GPU taken from the hosts of one-GPU shapes that few nodes can host
/// ([`Landing::reserve`]). Heavier weights push pods off pools their own pinned shapes would have
/// used (`gpuspec-33`), lighter ones leave small pools to whoever comes first
/// (`docs/placement.md`).
const RESERVE_WEIGHT: f64 = 0.3;

/// Mean CPU (millicores) and host memory (MiB) per thousandth of GPU of the GPU pods that can land
/// on a node.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Demand {
    cpu: f64,
    mem: f64,
}

/// The workload's GPU shapes that could land on a node (GPU count and models, CPU, mean memory),
/// summed in one pass: their demand, and what the node is worth to those of them that one GPU
/// serves and few nodes can host.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Landing {
    /// Their mean CPU and memory per GPU; None if no GPU shape could land.
    pub(crate) demand: Option<Demand>,
    /// What a thousandth of GPU taken from the node costs the one-GPU shapes that only some
    /// nodes can host: for each that could land here, its share of the workload's one-GPU
    /// compute times `1/h - 1`, with `h` the share of the cluster's GPUs that could host it
    /// ([`Workload::on_cluster`]). Demand over supply, less the 1 that every host of a shape any
    /// node can host pays alike: 0 for such shapes, large for shapes pinned to a small pool, so
    /// that pods that could go anywhere leave the small pools to them. Multi-GPU shapes have
    /// their own term ([`multi`]).
    pub(crate) reserve: f64,
}

impl Landing {
    pub(crate) fn of(w: &Workload, node: &NodeState) -> Landing {
        let (mut g, mut c, mut m) = (0.0, 0.0, 0.0);
        let (mut kept, mut one_gpu) = (0.0, 0.0);
        for (s, p, mem, h) in w.shapes_in_full() {
            if s.gpus == 0 {
                continue;
            }
            let gm = p * s.total_core_milli() as f64;
            if s.gpus == 1 {
                one_gpu += gm;
            }
            if s.gpus as usize > node.gpus.len()
                || (node.cpu_milli > 0 && s.cpu_milli > node.cpu_milli)
                || (node.memory_mib > 0 && mem > node.memory_mib as f64)
            {
                continue;
            }
            if !s.models.is_empty()
                && node
                    .gpus
                    .iter()
                    .filter(|gpu| s.models.contains(&gpu.model))
                    .count()
                    < s.gpus as usize
            {
                continue;
            }
            g += gm;
            c += p * s.cpu_milli as f64;
            m += p * mem;
            if s.gpus == 1 {
                kept += gm * (1.0 / h.max(MIN_HOSTS) - 1.0);
            }
        }
        Landing {
            demand: (g > 0.0).then(|| Demand {
                cpu: c / g,
                mem: m / g,
            }),
            reserve: if one_gpu > 0.0 { kept / one_gpu } else { 0.0 },
        }
    }
}

impl Demand {
    /// GPU (thousandths) of `gpu_free` that `cpu_left` and `mem_left` cannot feed at this demand.
    pub(crate) fn stranded(&self, gpu_free: u64, cpu_left: u64, mem_left: u64) -> f64 {
        let fed = |left: u64, per: f64| {
            if per > 0.0 {
                left as f64 / per
            } else {
                f64::INFINITY
            }
        };
        let g = gpu_free as f64;
        (g - fed(cpu_left, self.cpu).min(fed(mem_left, self.mem))).max(0.0)
    }
}

/// The part of [`Start::delta`] that does not depend on the placement: computed once per node
/// and decision, whatever the number of GPUs tried.
pub(crate) struct Start {
    demand: Option<Demand>,
    frag: f64,
    stranded: f64,
    blocked: f64,
    /// [`Landing::reserve`] of the node.
    reserve: f64,
}

/// The weight of a shape in the multi-GPU fragmentation term: 0 for one-GPU and CPU-only shapes,
/// else its probability `p` over the square root of `hosts`, the share of the cluster's GPUs on
/// nodes that could host it. FGD weighs by `p` alone (the chance that the next pod has this
/// shape), which spends the only nodes big enough for a shape as readily as any other; `p /
/// hosts` (the demand per GPU that could serve it) keeps small pools idle for pinned shapes that
/// rarely come. Exponents 0.4 to 0.6 do both; 0.25 and 0.75 do not (`docs/placement.md`).
fn multi(s: &PodShape, p: f64, hosts: f64) -> f64 {
    if s.gpus > 1 {
        p / hosts.max(MIN_HOSTS).sqrt()
    } else {
        0.0
    }
}

/// The smallest host share [`multi`] and [`Landing::reserve`] divide by: a shape no node can host
/// fragments nothing, and this keeps its weight finite.
const MIN_HOSTS: f64 = 1e-4;

fn sum(v: &[u32]) -> u64 {
    v.iter().map(|&f| u64::from(f)).sum()
}

impl Start {
    /// The baseline of `node` with `before` free GPU compute (thousandths, per GPU).
    pub(crate) fn of(w: &Workload, node: &NodeState, before: &[u32]) -> Start {
        let (c0, m0) = (fgd::cpu_left(node, 0), fgd::mem_left(node, 0));
        let Landing { demand, reserve } = Landing::of(w, node);
        Start {
            demand,
            frag: w.fragmentation_of(node, before, c0, m0, multi),
            stranded: demand.map_or(0.0, |d| d.stranded(sum(before), c0, m0)),
            blocked: w.cpu_blocked(before, c0, m0),
            reserve,
        }
    }

    /// What a placement that takes the node's free GPU compute from `before` to `after` costs
    /// the pods to come, in thousandths of a GPU: multi-GPU fragmentation, weighted stranded GPU,
    /// weighted GPU blocked for one-GPU shapes, the value lost beyond the pod's own shares, from
    /// one whole GPU's value, and the weighted GPU taken from scarce hosts.
    fn delta(
        &self,
        w: &Workload,
        node: &NodeState,
        req: &PodRequest,
        before: &[u32],
        after: &[u32],
    ) -> f64 {
        let (c1, m1) = (
            fgd::cpu_left(node, req.cpu_milli),
            fgd::mem_left(node, req.memory_mib),
        );
        let frag = w.fragmentation_of(node, after, c1, m1, multi) - self.frag;
        let strand = self
            .demand
            .map_or(0.0, |d| d.stranded(sum(after), c1, m1) - self.stranded);
        // The value the GPUs lose beyond that of the shares taken (which is the same on every
        // node), counted from one whole GPU's value: every placement sits at the same point of
        // FGD's integer sigmoid. Counted in full, eight whole GPUs put an 8-GPU pod at its flat
        // end, where every node scores 0 and the node order decides; counted from 0, the sigmoid
        // splits nodes that its ties (to nodes in use) keep together better (`docs/placement.md`).
        let g = w.gap_values();
        let value = g.value(CORE_MILLI_PER_GPU)
            + before
                .iter()
                .zip(after)
                .filter(|(b, a)| b != a)
                .map(|(&b, &a)| g.value(b) - g.value(a) - g.value(b.saturating_sub(a)))
                .sum::<f64>();
        let blocked = w.cpu_blocked(after, c1, m1) - self.blocked;
        let taken = sum(before).saturating_sub(sum(after)) as f64;
        frag + STRAND_WEIGHT * strand
            + BLOCKED_WEIGHT * blocked
            + value
            + RESERVE_WEIGHT * self.reserve * taken
    }
}

/// The GPU of `cands` whose use by a one-slice share of `core` costs least ([`Start::delta`]),
/// with that cost; ties to the first (GPUs alike in free share and model cost the same: only the
/// first is scored). `start` is the node's baseline at `free`.
pub(crate) fn gpu(
    w: &Workload,
    node: &NodeState,
    req: &PodRequest,
    start: &Start,
    free: &[u32],
    cands: impl Iterator<Item = usize>,
    core: u32,
) -> Option<(usize, f64)> {
    let mut after = free.to_vec();
    let mut best: Option<(f64, usize)> = None;
    for i in super::distinct_gpus(node, free, cands) {
        after[i] -= core;
        let d = start.delta(w, node, req, free, &after);
        after[i] += core;
        if best.is_none_or(|(b, _)| d < b) {
            best = Some((d, i));
        }
    }
    best.map(|(d, i)| (i, d))
}

/// The node score (0..=100, plus a tie-break fraction) of a placement that takes the node's free
/// GPU compute from `before` (whose baseline is `start`) to `after`: see [`score_of`].
pub(crate) fn score(
    w: &Workload,
    node: &NodeState,
    req: &PodRequest,
    start: &Start,
    before: &[u32],
    after: &[u32],
) -> f64 {
    score_of(node, req, before, start.delta(w, node, req, before, after))
}

/// The node score of a placement that costs `delta` ([`Start::delta`]) from `before`: FGD's
/// sigmoid of it. Among ties, a pod without GPUs goes to the node with the least free GPU, and
/// other pods to a node in use.
pub(crate) fn score_of(node: &NodeState, req: &PodRequest, before: &[u32], delta: f64) -> f64 {
    let base = fgd::paper_score(0.0, delta);
    if req.containers.is_empty() {
        let free: u64 = before.iter().map(|&f| u64::from(f)).sum();
        return base + 0.99 / (1.0 + free as f64 / f64::from(CORE_MILLI_PER_GPU));
    }
    let in_use = before
        .iter()
        .zip(&node.gpus)
        .any(|(&f, g)| g.healthy && f < CORE_MILLI_PER_GPU);
    if in_use { base + 0.5 } else { base }
}
