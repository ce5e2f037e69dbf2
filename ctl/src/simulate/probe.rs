//! What a run measures besides its curve: the cost of a decision with every node scored, and
//! where the idle GPU is when the arrived workload reaches 100 %.

use std::hint::black_box;
use std::time::Instant;

use gpuledger_ledger::placement::{self, PodShape, Workload};
use gpuledger_ledger::{CORE_MILLI_PER_GPU, NodeState, PodRequest, Policy};

/// Decision cost sampling: every `stride`-th pod of a run, each of `policies` scores every node
/// for that pod on the run's current state, without the simulator's cache (the cost a scheduler
/// pays). The policies take turns going first, so that none always runs on a warm cache.
#[derive(Debug, Clone, Default)]
pub struct Probe {
    /// The policies timed.
    pub policies: Vec<Policy>,
    /// Every how many pods (0 = never).
    pub stride: usize,
}

/// Time spent deciding, summed over the samples.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Cost {
    /// Nanoseconds over all samples.
    pub nanos: u128,
    /// Decisions timed.
    pub samples: u64,
}

impl Cost {
    /// Add another run's samples.
    pub fn add(&mut self, other: &Cost) {
        self.nanos += other.nanos;
        self.samples += other.samples;
    }

    /// Microseconds per decision (every node scored); NaN without samples.
    pub fn micros(&self) -> f64 {
        self.nanos as f64 / 1000.0 / self.samples as f64
    }
}

impl Probe {
    /// Whether pod `i` of the run is sampled.
    pub fn due(&self, i: usize) -> bool {
        self.stride > 0 && !self.policies.is_empty() && i.is_multiple_of(self.stride)
    }

    /// Time each policy scoring every node for `req` (pod `i` of the run).
    pub fn measure(&self, nodes: &[NodeState], req: &PodRequest, i: usize, cost: &mut [Cost]) {
        let n = self.policies.len();
        for k in 0..n {
            let j = (k + i / self.stride) % n;
            let r = PodRequest {
                policy: self.policies[j],
                ..req.clone()
            };
            let start = Instant::now();
            for node in nodes {
                let _ = black_box(placement::evaluate(black_box(node), &r));
            }
            cost[j].nanos += start.elapsed().as_nanos();
            cost[j].samples += 1;
        }
    }
}

/// Pod classes the diagnosis counts failures by.
pub const CLASSES: [&str; 4] = ["sharing", "1 GPU", "multi-GPU", "CPU-only"];

/// The idle GPU of one GPU model's nodes, by why it is idle.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ModelIdle {
    /// GPU model.
    pub model: String,
    /// GPUs of this model in the cluster.
    pub gpus: u64,
    /// Idle GPU (thousandths) on nodes where some typical pod still fits.
    pub usable: u64,
    /// Idle GPU on nodes where a typical pod's GPUs fit but its CPU or memory does not.
    pub stranded: u64,
    /// Idle GPU on nodes where no typical pod's GPUs fit (too small, wrong model).
    pub fragment: u64,
    /// CPU left on those nodes (millicores).
    pub cpu_left: u64,
}

/// Where the idle GPU is, and which pods failed, at one point of a run.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Diagnosis {
    /// Per GPU model, sorted by name.
    pub models: Vec<ModelIdle>,
    /// Failed pods so far, per class of [`CLASSES`]: (pods, GPU thousandths, GPU thousandths
    /// of those whose GPUs would have fit some node but its CPU or memory did not).
    pub failed: [(u64, u64, u64); 4],
}

impl Diagnosis {
    /// The class of a request, an index into [`CLASSES`].
    pub fn class(req: &PodRequest) -> usize {
        let s = PodShape::of(req);
        match (s.gpus, s.core_milli) {
            (0, _) => 3,
            (1, c) if c < CORE_MILLI_PER_GPU => 0,
            (1, _) => 1,
            _ => 2,
        }
    }

    /// Whether a pod that fits nowhere would fit some node if CPU and memory were no object.
    pub fn blocked_by_cpu_or_memory(nodes: &[NodeState], req: &PodRequest) -> bool {
        let r = PodRequest {
            cpu_milli: 0,
            memory_mib: 0,
            policy: Policy::Binpack,
            ..req.clone()
        };
        nodes.iter().any(|n| placement::evaluate(n, &r).is_ok())
    }

    /// Classify the idle GPU of `nodes` against the typical shapes of `w`.
    pub fn of(nodes: &[NodeState], w: &Workload, failed: [(u64, u64, u64); 4]) -> Diagnosis {
        let mut models: Vec<ModelIdle> = Vec::new();
        for n in nodes {
            let Some(first) = n.gpus.first() else {
                continue;
            };
            let at = match models.iter().position(|m| m.model == first.model) {
                Some(at) => at,
                None => {
                    models.push(ModelIdle {
                        model: first.model.clone(),
                        ..Default::default()
                    });
                    models.len() - 1
                }
            };
            let m = &mut models[at];
            m.gpus += n.gpus.len() as u64;
            let idle: u64 = n.gpus.iter().map(|g| u64::from(g.core_free())).sum();
            if idle == 0 {
                continue;
            }
            let cpu_left = n.cpu_milli.saturating_sub(n.cpu_used);
            let mem_left = n.memory_mib.saturating_sub(n.memory_used);
            let gpu_fits = |s: &PodShape| {
                s.gpus > 0
                    && n.gpus
                        .iter()
                        .filter(|g| {
                            g.core_free() >= s.core_milli
                                && (s.models.is_empty() || s.models.contains(&g.model))
                        })
                        .count()
                        >= s.gpus as usize
            };
            let room = |s: &PodShape| s.cpu_milli <= cpu_left && s.memory_mib <= mem_left;
            if w.shapes().any(|(s, _)| gpu_fits(s) && room(s)) {
                m.usable += idle;
            } else if w.shapes().any(|(s, _)| gpu_fits(s)) {
                m.stranded += idle;
            } else {
                m.fragment += idle;
            }
            m.cpu_left += cpu_left;
        }
        models.sort_by(|a, b| a.model.cmp(&b.model));
        Diagnosis { models, failed }
    }
}

#[cfg(test)]
mod tests {
    use gpuledger_ledger::GpuState;

    use super::*;

    fn node(gpus: u32, core_used: u32, cpu_milli: u64, cpu_used: u64) -> NodeState {
        NodeState {
            mode: Default::default(),
            isolation: String::new(),
            dra_cores: String::new(),
            name: "n".into(),
            gpus: (0..gpus)
                .map(|i| GpuState {
                    uuid: format!("g{i}"),
                    index: i,
                    model: "T4".into(),
                    memory_mib: 16_384,
                    healthy: true,
                    compute_capability: String::new(),
                    mem_used: 0,
                    core_used,
                    holders: 0,
                })
                .collect(),
            cpu_milli,
            memory_mib: 0,
            cpu_used,
            memory_used: 0,
            allocs: Default::default(),
            devices: Default::default(),
            pod_kinds: Default::default(),
        }
    }

    #[test]
    fn idle_gpu_is_told_apart_by_why_it_is_idle() {
        let shape = PodShape {
            cpu_milli: 4000,
            gpus: 1,
            core_milli: 500,
            ..Default::default()
        };
        let w = Workload::from_counts([(shape, 1)], 1.0);
        let nodes = [
            // 2 × 0.5 idle, 8 cores left: usable.
            node(2, 500, 16_000, 8000),
            // 2 × 0.5 idle, 2 cores left: stranded by CPU.
            node(2, 500, 16_000, 14_000),
            // 2 × 0.2 idle: too small for 0.5.
            node(2, 800, 16_000, 0),
        ];
        let d = Diagnosis::of(&nodes, &w, [(0, 0, 0); 4]);
        assert_eq!(d.models.len(), 1);
        let m = &d.models[0];
        assert_eq!((m.usable, m.stranded, m.fragment), (1000, 1000, 400));
        assert_eq!(m.gpus, 6);
    }
}
