//! What the state is made of: nodes and their GPUs, allocations and their lifecycle.

use std::collections::BTreeSet;

use rustc_hash::FxHashMap;

use crate::CORE_MILLI_PER_GPU;
use crate::pb;

/// One GPU with what is allocated on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuState {
    /// NVML UUID.
    pub uuid: String,
    /// NVML index on the node.
    pub index: u32,
    /// Model name (as NVML reports it, or the trace's model).
    pub model: String,
    /// Memory capacity.
    pub memory_mib: u64,
    /// False after a critical Xid: no new grants land here.
    pub healthy: bool,
    /// CUDA compute capability "major.minor" as the node agent reported it (may be empty).
    pub compute_capability: String,
    /// Sum of the memory of live allocations on this GPU.
    pub mem_used: u64,
    /// Sum of the compute of live allocations, in thousandths.
    pub core_used: u32,
    /// Number of live allocations holding a share of this GPU.
    pub holders: u32,
}

impl GpuState {
    /// Free memory.
    pub fn mem_free(&self) -> u64 {
        self.memory_mib.saturating_sub(self.mem_used)
    }
    /// Free compute in thousandths.
    pub fn core_free(&self) -> u32 {
        CORE_MILLI_PER_GPU.saturating_sub(self.core_used)
    }
}

/// A node, its GPUs and what is allocated on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeState {
    /// Node name.
    pub name: String,
    /// GPUs in index order.
    pub gpus: Vec<GpuState>,
    /// Allocatable CPU (millicores); 0 = not tracked.
    pub cpu_milli: u64,
    /// Allocatable host memory (MiB); 0 = not tracked.
    pub memory_mib: u64,
    /// CPU requested by pods holding allocations here.
    pub cpu_used: u64,
    /// Host memory requested by pods holding allocations here.
    pub memory_used: u64,
    /// Live allocations on this node.
    pub allocs: BTreeSet<u64>,
    /// Device IDs held by assigned allocations here → the allocation holding each.
    pub devices: FxHashMap<String, u64>,
    /// Live allocations here by kind ([`pod_kind`]), the tags the clustering policy reads.
    /// A fixed array: the fold updates it on every grant and release without allocating.
    pub pod_kinds: [u32; POD_KINDS],
    /// Which kind of grant the node serves: pod reservations (device plugin) or claim grants
    /// (DRA), never both.
    pub mode: pb::NodeMode,
    /// The node agent's first isolation layer as it reported it (empty: `nvml`). The ledger
    /// only keeps it for operators; no placement reads it.
    pub isolation: String,
    /// How the node's DRA devices state `cores` (`NodeInventory.dra_cores`; empty:
    /// thousandths): what its slice publishes and what certification reads claims in.
    pub dra_cores: String,
}

/// Kinds of grant told apart: a share of one GPU, then 1 to 7 whole GPUs, then 8 or more.
pub const POD_KINDS: usize = 9;

/// The kind of a grant of `gpus` GPUs with `core_milli` of each: 0 for a share of one GPU,
/// else its GPU count, 8 and more counting as 8 (the pod tags of Weng et al.'s clustering
/// baseline, whose nodes have at most 8 GPUs).
pub fn pod_kind(gpus: usize, core_milli: u32) -> usize {
    if gpus == 1 && core_milli < CORE_MILLI_PER_GPU {
        0
    } else {
        gpus.min(POD_KINDS - 1)
    }
}

impl NodeState {
    /// Count a grant of `kind` ([`pod_kind`]) here.
    pub fn add_pod_kind(&mut self, kind: usize) {
        self.pod_kinds[kind] += 1;
    }

    pub(super) fn remove_pod_kind(&mut self, kind: usize) {
        self.pod_kinds[kind] = self.pod_kinds[kind].saturating_sub(1);
    }

    /// The GPU with this UUID.
    pub fn gpu(&self, uuid: &str) -> Option<&GpuState> {
        self.gpus.iter().find(|g| g.uuid == uuid)
    }

    pub(super) fn gpu_mut(&mut self, uuid: &str) -> Option<&mut GpuState> {
        self.gpus.iter_mut().find(|g| g.uuid == uuid)
    }

    /// The inventory as it was registered (with current health).
    pub fn inventory(&self) -> pb::NodeInventory {
        pb::NodeInventory {
            node: self.name.clone(),
            gpus: self
                .gpus
                .iter()
                .map(|g| pb::Gpu {
                    uuid: g.uuid.clone(),
                    index: g.index,
                    model: g.model.clone(),
                    memory_mib: g.memory_mib,
                    healthy: g.healthy,
                    compute_capability: g.compute_capability.clone(),
                })
                .collect(),
            cpu_milli: self.cpu_milli,
            memory_mib: self.memory_mib,
            mode: self.mode as i32,
            isolation: self.isolation.clone(),
            dra_cores: self.dra_cores.clone(),
        }
    }
}

/// Where an allocation is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AllocState {
    /// GPUs chosen, the scheduler has not bound the pod yet; expires at the deadline.
    Reserved,
    /// The pod is bound to the node.
    Bound,
    /// A node agent handed the devices to the container.
    Assigned,
}

impl AllocState {
    pub(super) fn to_pb(self) -> pb::AllocationState {
        match self {
            AllocState::Reserved => pb::AllocationState::Reserved,
            AllocState::Bound => pb::AllocationState::Bound,
            AllocState::Assigned => pb::AllocationState::Assigned,
        }
    }

    /// Lower-case name, as the CLI shows it.
    pub fn as_str(self) -> &'static str {
        match self {
            AllocState::Reserved => "reserved",
            AllocState::Bound => "bound",
            AllocState::Assigned => "assigned",
        }
    }
}

/// A live allocation: one container's shares of one or more GPUs of one node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Alloc {
    /// Allocation id (the seq of its `Reserved` event).
    pub id: u64,
    /// The pod it was reserved for (after any identity correction).
    pub pod: pb::PodRef,
    /// Container name.
    pub container: String,
    /// Node name.
    pub node: String,
    /// One share per GPU, each on a distinct GPU.
    pub shares: Vec<pb::GpuShare>,
    /// Lifecycle state.
    pub state: AllocState,
    /// When it was reserved (leader's clock).
    pub reserved_ms: i64,
    /// When an unbound reservation expires.
    pub deadline_ms: i64,
    /// Device IDs the kubelet allocated, once assigned.
    pub device_ids: Vec<String>,
    /// Pod CPU request counted on the node through this allocation.
    pub cpu_milli: u64,
    /// Pod host memory request counted on the node through this allocation.
    pub memory_mib: u64,
    /// Epoch of the leader that reserved it.
    pub epoch: u64,
    /// Policy that placed it.
    pub policy: String,
    /// For a grant of a ResourceClaim's result: the claim side. `pod` then names the claim and
    /// `container` is [`claim_key`] of the request and share.
    pub claim: Option<Box<ClaimGrant>>,
}

/// The claim side of a grant of a ResourceClaim's result (`pb::ClaimGrant`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimGrant {
    /// The claim's request (or "request/subrequest").
    pub request: String,
    /// ResourceSlice pool (the node name).
    pub pool: String,
    /// ResourceSlice device (`gpu-<uuid>`).
    pub device: String,
    /// The allocation result's shareID.
    pub share_id: String,
    /// Pods the claim is reserved for.
    pub consumers: Vec<pb::PodRef>,
    /// "claim" or "extended-resource".
    pub source: String,
    /// Whether the node agent has prepared it.
    pub prepared: bool,
    /// The CDI device ids it was prepared with.
    pub cdi_device_ids: Vec<String>,
}

impl ClaimGrant {
    /// The claim side of the grant `g` records, not prepared yet.
    pub fn granted(g: &pb::ClaimGranted) -> Self {
        ClaimGrant {
            request: g.request.clone(),
            pool: g.pool.clone(),
            device: g.device.clone(),
            share_id: g.share_id.clone(),
            consumers: g.consumers.clone(),
            source: g.source.clone(),
            prepared: false,
            cdi_device_ids: Vec::new(),
        }
    }

    /// The protobuf form.
    pub fn to_pb(&self) -> pb::ClaimGrant {
        pb::ClaimGrant {
            request: self.request.clone(),
            pool: self.pool.clone(),
            device: self.device.clone(),
            share_id: self.share_id.clone(),
            consumers: self.consumers.clone(),
            source: self.source.clone(),
            prepared: self.prepared,
            cdi_device_ids: self.cdi_device_ids.clone(),
        }
    }

    /// From the protobuf form.
    pub fn from_pb(c: &pb::ClaimGrant) -> Self {
        ClaimGrant {
            request: c.request.clone(),
            pool: c.pool.clone(),
            device: c.device.clone(),
            share_id: c.share_id.clone(),
            consumers: c.consumers.clone(),
            source: c.source.clone(),
            prepared: c.prepared,
            cdi_device_ids: c.cdi_device_ids.clone(),
        }
    }
}

impl Alloc {
    /// Memory per slice (the largest share; shares of one container are equal unless percent-based).
    pub fn mem_mib(&self) -> u64 {
        self.shares.iter().map(|s| s.mem_mib).max().unwrap_or(0)
    }

    /// The protobuf form.
    pub fn to_pb(&self) -> pb::Allocation {
        pb::Allocation {
            id: self.id,
            pod: Some(self.pod.clone()),
            container: self.container.clone(),
            node: self.node.clone(),
            shares: self.shares.clone(),
            state: self.state.to_pb() as i32,
            reserved_ms: self.reserved_ms,
            deadline_ms: self.deadline_ms,
            device_ids: self.device_ids.clone(),
            cpu_milli: self.cpu_milli,
            memory_mib: self.memory_mib,
            epoch: self.epoch,
            policy: self.policy.clone(),
            claim: self.claim.as_deref().map(|c| Box::new(c.to_pb())),
        }
    }
}

/// The key of a claim grant among its claim's grants, as a container name is among a pod's:
/// request and share id. Request names are DNS labels (with "/" only between a request and its
/// subrequest) and share ids UUIDs, so the last "/" separates them.
pub fn claim_key(request: &str, share_id: &str) -> String {
    format!("{request}/{share_id}")
}

/// The mode a node in the ledger is in, from its inventory's raw field (an unknown value, from
/// a newer writer, counts as neither mode: the fold refuses it).
pub fn node_mode(raw: i32) -> Option<pb::NodeMode> {
    pb::NodeMode::try_from(raw).ok()
}

/// A pod's containers with a live allocation, by name. Pods have one to a few GPU containers:
/// a sorted vector costs one small allocation where a map would cost a tree node.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct Containers(Vec<(String, u64)>);

impl Containers {
    pub(super) fn get(&self, name: &str) -> Option<&u64> {
        self.0.iter().find(|(n, _)| n == name).map(|(_, id)| id)
    }
    pub(super) fn insert(&mut self, name: &str, id: u64) {
        match self.0.binary_search_by(|(n, _)| n.as_str().cmp(name)) {
            Ok(i) => self.0[i].1 = id,
            Err(i) => self.0.insert(i, (name.to_owned(), id)),
        }
    }
    pub(super) fn remove(&mut self, name: &str) {
        self.0.retain(|(n, _)| n != name);
    }
    pub(super) fn values(&self) -> impl Iterator<Item = &u64> {
        self.0.iter().map(|(_, id)| id)
    }
    pub(super) fn len(&self) -> usize {
        self.0.len()
    }
    pub(super) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}
