//! What a pod asks for: the policy, its containers' slices, its GPU selectors, and the
//! validation that refuses a request no node could ever serve.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use super::Workload;
use crate::CORE_MILLI_PER_GPU;
use crate::pb;
use crate::state::GpuState;

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
    /// FGD's successor (gpuledger's): scores the loss of free-share value (the learned workload's
    /// packing LP), multi-GPU fragmentation, and GPU a node's CPU and memory could no longer feed
    /// for the pods that can land there. See `docs/placement.md`.
    FgdStrand,
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
        "fgd-strand",
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
            Policy::FgdStrand => "fgd-strand",
            Policy::Random => "random",
            Policy::DotProduct => "dotprod",
            Policy::BestFit => "bestfit",
            Policy::Packing => "packing",
            Policy::Clustering => "clustering",
        }
    }

    /// Whether the policy measures fragmentation against a workload (fgd and its variants).
    pub fn is_fgd(self) -> bool {
        matches!(
            self,
            Policy::Fgd | Policy::FgdPack | Policy::FgdPackCpu | Policy::FgdStrand
        )
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
            "fgd-strand" => Ok(Policy::FgdStrand),
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
            // Saturating: inventory is bounded where it enters, this is the second fence.
            gpu.memory_mib
                .saturating_mul(u64::from(self.mem_percent))
                .div_ceil(100)
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
    /// The pod's priority: room nominated for pods of this priority or higher is taken to it.
    pub priority: i32,
    /// Through DRA: only nodes in DRA mode fit, and each container's GPUs are the ones
    /// kube-scheduler's first fit takes (GPUs in index order); the policy scores that choice.
    pub dra: bool,
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
            priority: r.priority,
            dra: r.dra,
            ..Default::default()
        };
        req.validate()?;
        Ok(req)
    }

    /// Reject requests that can never be served anywhere, with a reason a user understands.
    pub fn validate(&self) -> Result<(), String> {
        use crate::command::bounds::{self, InventoryLimits};
        if self.pod.uid.is_empty() {
            return Err("pod uid is empty".into());
        }
        bounds::id("pod uid", &self.pod.uid)?;
        bounds::name("pod namespace", &self.pod.namespace)?;
        bounds::name("pod name", &self.pod.name)?;
        if self.containers.is_empty() {
            return Err("the pod has no container asking for a GPU slice".into());
        }
        if self.containers.len() > bounds::MAX_CONTAINERS {
            return Err(format!(
                "{} containers ask for GPUs; a pod may have at most {}",
                self.containers.len(),
                bounds::MAX_CONTAINERS
            ));
        }
        if self.cpu_milli > bounds::MAX_CPU_MILLI || self.memory_mib > bounds::MAX_HOST_MEMORY_MIB {
            return Err(format!(
                "the pod requests {}m CPU and {} MiB memory; no node has that much",
                self.cpu_milli, self.memory_mib
            ));
        }
        let s = &self.selector;
        for list in [
            &s.types,
            &s.types_exclude,
            &s.uuids,
            &s.uuids_exclude,
            &s.models,
        ] {
            if list.len() > bounds::MAX_SELECTOR_ENTRIES {
                return Err(format!(
                    "a GPU selector lists {} entries; at most {}",
                    list.len(),
                    bounds::MAX_SELECTOR_ENTRIES
                ));
            }
            list.iter()
                .try_for_each(|x| bounds::id("GPU selector entry", x))?;
        }
        let mut names = std::collections::BTreeSet::new();
        for c in &self.containers {
            bounds::id("container name", &c.name)?;
            if !names.insert(c.name.as_str()) {
                return Err(format!("container {:?} is listed twice", c.name));
            }
            if c.slices == 0 {
                return Err(format!("container {:?} asks for 0 GPU slices", c.name));
            }
            let most = InventoryLimits::CEILING.max_gpu_memory_mib;
            if c.mem_mib > most {
                return Err(format!(
                    "container {:?} asks for {} MiB per GPU; no GPU has more than {most} MiB",
                    c.name, c.mem_mib
                ));
            }
            if c.slices > bounds::MAX_SLICES {
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

/// What the allocator fills in for a request that leaves it out: the policy of a request that
/// names none, and the workload FGD measures fragmentation against. The allocator decodes with
/// its own; a copy of the ledger (the extender's replica) with the ones the allocator sends, so
/// both evaluate a request alike.
#[derive(Debug, Clone, Default)]
pub struct Defaults {
    /// The policy of a request that names none.
    pub policy: Policy,
    /// The workload an FGD request is measured against (None = [`Workload::prior`]).
    pub workload: Option<Arc<Workload>>,
}

impl Defaults {
    /// Decode and validate the API's form of a request as the allocator does.
    pub fn request(&self, r: pb::PodRequest) -> Result<PodRequest, String> {
        let mut req = PodRequest::from_pb(r, self.policy)?;
        self.attach(&mut req);
        Ok(req)
    }

    /// Give an FGD request the workload, unless it brings its own (other policies ignore it).
    pub fn attach(&self, req: &mut PodRequest) {
        if req.policy.is_fgd() && req.workload.is_none() {
            req.workload.clone_from(&self.workload);
        }
    }
}
