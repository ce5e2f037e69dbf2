//! Fragmentation gradient descent (Weng et al., "Beware of Fragmentation: Scheduling GPU-Sharing
//! Workloads with Fragmentation Gradient Descent", USENIX ATC '23).
//!
//! For a target workload (the pod shapes that make up most pods, with their frequencies), a node's
//! fragmentation is the expected free GPU share that a typical pod cannot use there: all of the
//! node's free share when the pod cannot run on the node at all (GPU count, GPU model, CPU, host
//! memory, or the pod uses no GPU), otherwise the free share on GPUs too small for it. FGD places a
//! pod where fragmentation grows least.

use std::collections::HashMap;
use std::sync::OnceLock;

use crate::CORE_MILLI_PER_GPU;
use crate::placement::PodRequest;
use crate::placement::value::GapValues;
use crate::state::NodeState;

/// The resource shape of a pod, as the fragmentation measure sees it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct PodShape {
    /// CPU request (millicores).
    pub cpu_milli: u64,
    /// Host memory request (MiB); 0 when the workload ignores memory.
    pub memory_mib: u64,
    /// Number of GPUs (0 = CPU-only pod).
    pub gpus: u32,
    /// Compute per GPU in thousandths (1000 for whole-GPU and multi-GPU pods).
    pub core_milli: u32,
    /// Accepted GPU models, exact names (empty = any).
    pub models: Vec<String>,
}

impl PodShape {
    /// The shape of a request: all its slices, at the largest per-slice compute.
    pub fn of(req: &PodRequest) -> PodShape {
        let gpus = req.containers.iter().map(|c| c.slices).sum();
        let core_milli = req
            .containers
            .iter()
            .map(|c| c.normalized().core_milli)
            .max()
            .unwrap_or(0);
        PodShape {
            cpu_milli: req.cpu_milli,
            memory_mib: req.memory_mib,
            gpus,
            core_milli: if gpus > 1 {
                CORE_MILLI_PER_GPU
            } else {
                core_milli
            },
            models: req.selector.models.clone(),
        }
    }

    /// GPU compute the pod asks for in total, in thousandths of a GPU.
    pub fn total_core_milli(&self) -> u64 {
        u64::from(self.gpus) * u64::from(self.core_milli)
    }
}

/// A target workload: typical pod shapes and how often each occurs.
#[derive(Debug, Clone, Default)]
pub struct Workload {
    shapes: Vec<PodShape>,
    counts: Vec<u64>,
    probs: Vec<f64>,
    /// Mean host memory (MiB) of the pods each shape stands for: the shape's own when shapes
    /// carry memory, else what the pods asked (the look-ahead of `fgd-strand` needs it).
    memory: Vec<f64>,
    /// Share of the cluster's GPUs on nodes that could host each shape when empty; 1 until
    /// [`Workload::on_cluster`] says otherwise.
    hosts: Vec<f64>,
    /// The value of free GPU shares for these shapes, computed on first use.
    gaps: OnceLock<GapValues>,
}

impl PartialEq for Workload {
    fn eq(&self, other: &Self) -> bool {
        self.shapes == other.shapes && self.counts == other.counts
    }
}

impl Eq for Workload {}

impl Workload {
    /// Share of pods (by count) that the typical shapes must cover, as in the paper.
    pub const DEFAULT_COVERAGE: f64 = 0.95;

    /// The most frequent shapes covering at least `coverage` (0..=1) of all pods, with their
    /// frequencies renormalized over the kept shapes. Ties in frequency keep the smaller shape first.
    pub fn from_counts(counts: impl IntoIterator<Item = (PodShape, u64)>, coverage: f64) -> Self {
        Self::from_counts_with_memory(
            counts.into_iter().map(|(s, n)| {
                let mem = s.memory_mib.saturating_mul(n);
                (s, n, mem)
            }),
            coverage,
        )
    }

    /// [`Self::from_counts`] for shapes that leave host memory out (the paper's simulator does):
    /// each item also brings the host memory its pods asked for in total, whose mean per shape
    /// the look-ahead of `fgd-strand` uses.
    pub fn from_counts_with_memory(
        counts: impl IntoIterator<Item = (PodShape, u64, u64)>,
        coverage: f64,
    ) -> Self {
        let mut merged: HashMap<PodShape, (u64, u64)> = HashMap::new();
        for (s, n, mem) in counts {
            let e = merged.entry(s).or_default();
            e.0 += n;
            e.1 = e.1.saturating_add(mem);
        }
        let mut all: Vec<(PodShape, u64, u64)> = merged
            .into_iter()
            .filter(|(_, (n, _))| *n > 0)
            .map(|(s, (n, m))| (s, n, m))
            .collect();
        all.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        let total: u64 = all.iter().map(|(_, n, _)| n).sum();
        let need = (coverage.clamp(0.0, 1.0) * total as f64).ceil() as u64;
        let mut kept = 0u64;
        let mut shapes = Vec::new();
        let mut counts = Vec::new();
        let mut memory = Vec::new();
        for (s, n, m) in all {
            if kept >= need && !shapes.is_empty() {
                break;
            }
            kept += n;
            shapes.push(s);
            counts.push(n);
            memory.push(m as f64 / n as f64);
        }
        let probs = counts
            .iter()
            .map(|&n| n as f64 / kept.max(1) as f64)
            .collect();
        Workload {
            hosts: vec![1.0; shapes.len()],
            shapes,
            counts,
            probs,
            memory,
            gaps: OnceLock::new(),
        }
    }

    /// The workload of a list of (recent) requests, at the default coverage; the prior if empty.
    pub fn from_requests<'a>(reqs: impl IntoIterator<Item = &'a PodRequest>) -> Self {
        let w = Self::from_counts(
            reqs.into_iter().map(|r| (PodShape::of(r), 1)),
            Self::DEFAULT_COVERAGE,
        );
        if w.shapes.is_empty() {
            Self::prior()
        } else {
            w
        }
    }

    /// A neutral prior for a cluster that has seen no requests yet: whole GPUs, halves, quarters,
    /// tenths and multi-GPU pods, without CPU or memory constraints.
    pub fn prior() -> Self {
        let shape = |gpus, core_milli| PodShape {
            gpus,
            core_milli,
            ..Default::default()
        };
        Self::from_counts(
            [
                (shape(1, 1000), 4),
                (shape(1, 500), 2),
                (shape(1, 250), 2),
                (shape(1, 100), 1),
                (shape(2, 1000), 1),
                (shape(8, 1000), 1),
            ],
            1.0,
        )
    }

    /// The typical shapes with their probabilities (summing to 1).
    pub fn shapes(&self) -> impl Iterator<Item = (&PodShape, f64)> {
        self.shapes.iter().zip(self.probs.iter().copied())
    }

    /// The typical shapes with the pod counts they were built from. `from_counts(counts, 1.0)`
    /// gives this very workload back (how a replica receives the allocator's).
    pub fn counts(&self) -> impl Iterator<Item = (&PodShape, u64)> {
        self.shapes.iter().zip(self.counts.iter().copied())
    }

    /// The typical shapes with their probabilities, the mean host memory (MiB) of their pods and
    /// the share of the cluster's GPUs that could host them ([`Workload::on_cluster`]).
    pub fn shapes_in_full(&self) -> impl Iterator<Item = (&PodShape, f64, f64, f64)> {
        self.shapes
            .iter()
            .zip(self.probs.iter().copied())
            .zip(self.memory.iter().copied())
            .zip(self.hosts.iter().copied())
            .map(|(((s, p), m), h)| (s, p, m, h))
    }

    /// What a GPU's free share is worth to these shapes ([`GapValues`]): each slice size of the
    /// GPU pods, with how many of them a GPU of the cluster can expect.
    pub fn gap_values(&self) -> &GapValues {
        self.gaps.get_or_init(|| {
            let milli: f64 = self
                .shapes()
                .map(|(s, p)| p * s.total_core_milli() as f64)
                .sum();
            let mut items: Vec<(u32, f64)> = Vec::new();
            for (s, p) in self.shapes().filter(|(s, _)| s.gpus > 0) {
                let per_gpu = p * f64::from(s.gpus) * f64::from(CORE_MILLI_PER_GPU) / milli;
                match items.iter_mut().find(|i| i.0 == s.core_milli) {
                    Some(i) => i.1 += per_gpu,
                    None => items.push((s.core_milli, per_gpu)),
                }
            }
            items.sort_by_key(|i| std::cmp::Reverse(i.0));
            GapValues::of(&items)
        })
    }

    /// This workload on a cluster of `nodes`: each shape learns which share of the cluster's
    /// GPUs is on nodes that could host it when empty (GPU count and models, CPU, host memory).
    /// A cluster without GPUs leaves every share at 1.
    pub fn on_cluster<'a>(mut self, nodes: impl IntoIterator<Item = &'a NodeState>) -> Self {
        let kinds = super::node_kinds(nodes);
        let gpus = |(n, count): &(&NodeState, u64)| n.gpus.len() as u64 * count;
        let total: u64 = kinds.iter().map(gpus).sum();
        if total == 0 {
            return self;
        }
        for (s, h) in self.shapes.iter().zip(self.hosts.iter_mut()) {
            let on: u64 = kinds.iter().filter(|(n, _)| hosts(s, n)).map(gpus).sum();
            *h = on as f64 / total as f64;
        }
        self
    }

    /// The typical shapes with their probabilities and the share of the cluster's GPUs on nodes
    /// that could host them ([`Workload::on_cluster`]).
    pub fn shapes_with_hosts(&self) -> impl Iterator<Item = (&PodShape, f64, f64)> {
        self.shapes
            .iter()
            .zip(self.probs.iter().copied())
            .zip(self.hosts.iter().copied())
            .map(|((s, p), h)| (s, p, h))
    }

    /// Whether no shape is known.
    pub fn is_empty(&self) -> bool {
        self.shapes.is_empty()
    }

    /// Expected fragmentation of `node` (thousandths of a GPU) as it is now.
    pub fn node_fragmentation(&self, node: &NodeState) -> f64 {
        let free: Vec<u32> = node.gpus.iter().map(usable_free).collect();
        self.fragmentation(node, &free, cpu_left(node, 0), mem_left(node, 0))
    }

    /// Expected fragmentation of `node` (thousandths of a GPU) if its GPUs had `free` compute left
    /// and it had `cpu_left` millicores and `mem_left` MiB of host memory left.
    pub fn fragmentation(
        &self,
        node: &NodeState,
        free: &[u32],
        cpu_left: u64,
        mem_left: u64,
    ) -> f64 {
        self.fragmentation_of(node, free, cpu_left, mem_left, |_, p, _| p)
    }

    /// [`Self::fragmentation`] with each shape weighted by `weight(shape, probability, share of
    /// the cluster's GPUs that could host it)` instead of its probability (0 leaves it out).
    pub(crate) fn fragmentation_of(
        &self,
        node: &NodeState,
        free: &[u32],
        cpu_left: u64,
        mem_left: u64,
        weight: impl Fn(&PodShape, f64, f64) -> f64,
    ) -> f64 {
        let total: u64 = free.iter().map(|&f| u64::from(f)).sum();
        if total == 0 {
            return 0.0;
        }
        self.shapes_with_hosts()
            .map(|(s, p, h)| (s, weight(s, p, h)))
            .filter(|&(_, w)| w > 0.0)
            .map(|(s, w)| w * frag_for(s, node, free, total, cpu_left, mem_left) as f64)
            .sum()
    }
}

impl Workload {
    /// The free GPU of a node (thousandths, all of `free`) that the one-GPU shapes could not use
    /// at all with `cpu_left` millicores and `mem_left` MiB left, weighted by their probability:
    /// the part of FGD's fragmentation that CPU and host memory decide.
    pub(crate) fn cpu_blocked(&self, free: &[u32], cpu_left: u64, mem_left: u64) -> f64 {
        let total: u64 = free.iter().map(|&f| u64::from(f)).sum();
        if total == 0 {
            return 0.0;
        }
        let p: f64 = self
            .shapes()
            .filter(|(s, _)| s.gpus == 1 && (cpu_left < s.cpu_milli || mem_left < s.memory_mib))
            .map(|(_, p)| p)
            .sum();
        p * total as f64
    }
}

/// FGD's score of a placement that takes a node's fragmentation from `before` to `after`
/// (thousandths of a GPU), as the paper's simulator computes it: the sigmoid of the fragmentation
/// removed, in GPUs, times 100 and truncated to an integer (kube-scheduler's 0..=100 node scores).
pub(crate) fn paper_score(before: f64, after: f64) -> f64 {
    (100.0 / (1.0 + ((after - before) / 1000.0).exp())).trunc()
}

/// Free compute of a GPU as the fragmentation measure counts it (an unhealthy GPU has none).
pub(crate) fn usable_free(g: &crate::state::GpuState) -> u32 {
    if g.healthy { g.core_free() } else { 0 }
}

/// CPU left on the node after `extra` more millicores (untracked CPU is unlimited).
pub(crate) fn cpu_left(node: &NodeState, extra: u64) -> u64 {
    if node.cpu_milli == 0 {
        u64::MAX
    } else {
        node.cpu_milli
            .saturating_sub(node.cpu_used.saturating_add(extra))
    }
}

/// Host memory left on the node after `extra` more MiB (untracked memory is unlimited).
pub(crate) fn mem_left(node: &NodeState, extra: u64) -> u64 {
    if node.memory_mib == 0 {
        u64::MAX
    } else {
        node.memory_mib.saturating_sub(node.memory_used + extra)
    }
}

/// Whether `node`, empty, could host a pod of shape `s` (GPU count and models, CPU, memory).
fn hosts(s: &PodShape, node: &NodeState) -> bool {
    let gpus = node
        .gpus
        .iter()
        .filter(|g| s.models.is_empty() || s.models.contains(&g.model))
        .count();
    gpus >= s.gpus as usize
        && (node.cpu_milli == 0 || s.cpu_milli <= node.cpu_milli)
        && (node.memory_mib == 0 || s.memory_mib <= node.memory_mib)
}

/// Fragmentation of the node for one typical shape: the free share that shape cannot use.
fn frag_for(
    s: &PodShape,
    node: &NodeState,
    free: &[u32],
    total: u64,
    cpu_left: u64,
    mem_left: u64,
) -> u64 {
    // A CPU-only pod uses no GPU: every free share is out of its reach (as in the paper).
    if s.gpus == 0 || cpu_left < s.cpu_milli || mem_left < s.memory_mib {
        return total;
    }
    let model_ok = |i: usize| s.models.is_empty() || s.models.contains(&node.gpus[i].model);
    let mut able = 0u32;
    let mut frag = 0u64;
    for (i, &f) in free.iter().enumerate() {
        if f >= s.core_milli && model_ok(i) {
            able += 1;
        } else {
            frag += u64::from(f);
        }
    }
    if able < s.gpus { total } else { frag }
}
