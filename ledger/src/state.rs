//! The folded state of the ledger and the invariants every event must keep.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use rustc_hash::FxHashMap;

use crate::CORE_MILLI_PER_GPU;
use crate::pb;
use crate::pb::event::Body;

mod nodes;
pub use nodes::Nodes;

/// An event that would break an invariant. Meeting one is a bug in whoever wrote the event:
/// the leader refuses to write it, a follower or a replay reports it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ApplyError {
    /// The event's seq is not the next one (the log has a gap or a repeat).
    #[error("seq gap: expected {expected}, event has {got}")]
    SeqGap {
        /// The seq the state expected next.
        expected: u64,
        /// The seq the event carried.
        got: u64,
    },
    /// The event's epoch is lower than one already applied.
    #[error("epoch went backwards at seq {seq}: {got} after {current}")]
    EpochBackwards {
        /// Seq of the offending event.
        seq: u64,
        /// Highest epoch applied so far.
        current: u64,
        /// The event's epoch.
        got: u64,
    },
    /// The event has no body (written by a newer version, or corrupt).
    #[error("event {0} has no body")]
    EmptyEvent(u64),
    /// Any other broken invariant, with what broke.
    #[error("invariant broken at seq {seq}: {what}")]
    Invariant {
        /// Seq of the offending event.
        seq: u64,
        /// What the event would have broken.
        what: String,
    },
}

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

    fn remove_pod_kind(&mut self, kind: usize) {
        self.pod_kinds[kind] = self.pod_kinds[kind].saturating_sub(1);
    }

    /// The GPU with this UUID.
    pub fn gpu(&self, uuid: &str) -> Option<&GpuState> {
        self.gpus.iter().find(|g| g.uuid == uuid)
    }

    fn gpu_mut(&mut self, uuid: &str) -> Option<&mut GpuState> {
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
                })
                .collect(),
            cpu_milli: self.cpu_milli,
            memory_mib: self.memory_mib,
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
    fn to_pb(self) -> pb::AllocationState {
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
        }
    }
}

/// A pod's containers with a live allocation, by name. Pods have one to a few GPU containers:
/// a sorted vector costs one small allocation where a map would cost a tree node.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Containers(Vec<(String, u64)>);

impl Containers {
    fn get(&self, name: &str) -> Option<&u64> {
        self.0.iter().find(|(n, _)| n == name).map(|(_, id)| id)
    }
    fn insert(&mut self, name: &str, id: u64) {
        match self.0.binary_search_by(|(n, _)| n.as_str().cmp(name)) {
            Ok(i) => self.0[i].1 = id,
            Err(i) => self.0.insert(i, (name.to_owned(), id)),
        }
    }
    fn remove(&mut self, name: &str) {
        self.0.retain(|(n, _)| n != name);
    }
    fn values(&self) -> impl Iterator<Item = &u64> {
        self.0.iter().map(|(_, id)| id)
    }
    fn len(&self) -> usize {
        self.0.len()
    }
    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// The folded ledger: nodes, GPUs and live allocations at `seq`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ledger {
    seq: u64,
    epoch: u64,
    time_ms: i64,
    nodes: Nodes,
    allocs: FxHashMap<u64, Alloc>,
    /// pod uid → container → live allocation id.
    by_pod: FxHashMap<String, Containers>,
    gpu_owner: FxHashMap<String, String>,
    quotas: BTreeMap<String, u64>,
    violations: u64,
}

impl Ledger {
    /// An empty ledger (seq 0, epoch 0).
    pub fn new() -> Self {
        Self::default()
    }

    /// Seq of the last applied event.
    pub fn seq(&self) -> u64 {
        self.seq
    }
    /// Highest epoch applied.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }
    /// Timestamp of the last applied event.
    pub fn time_ms(&self) -> i64 {
        self.time_ms
    }
    /// Nodes by name.
    pub fn nodes(&self) -> &Nodes {
        &self.nodes
    }
    /// One node.
    pub fn node(&self, name: &str) -> Option<&NodeState> {
        self.nodes.get(name)
    }
    /// Live allocations by id.
    pub fn allocs(&self) -> &FxHashMap<u64, Alloc> {
        &self.allocs
    }
    /// One allocation.
    pub fn alloc(&self, id: u64) -> Option<&Alloc> {
        self.allocs.get(&id)
    }
    /// The live allocation of a pod's container.
    pub fn alloc_of(&self, pod_uid: &str, container: &str) -> Option<&Alloc> {
        self.by_pod
            .get(pod_uid)
            .and_then(|c| c.get(container))
            .and_then(|id| self.allocs.get(id))
    }
    /// Every live allocation of a pod, by container name order.
    pub fn allocs_of_pod(&self, pod_uid: &str) -> Vec<&Alloc> {
        self.by_pod
            .get(pod_uid)
            .map(|c| c.values().filter_map(|id| self.allocs.get(id)).collect())
            .unwrap_or_default()
    }
    /// The node a GPU UUID is registered on.
    pub fn gpu_owner(&self, uuid: &str) -> Option<&str> {
        self.gpu_owner.get(uuid).map(String::as_str)
    }
    /// Per-namespace memory quotas.
    pub fn quotas(&self) -> &BTreeMap<String, u64> {
        &self.quotas
    }
    /// Number of `LimitViolated` events folded.
    pub fn violations(&self) -> u64 {
        self.violations
    }

    /// Fold a batch of events in order. Stops at the first bad event; the events before it stay
    /// applied (the caller treats the state as broken and reports the error).
    pub fn apply_all<'a>(
        &mut self,
        events: impl IntoIterator<Item = &'a pb::Event>,
    ) -> Result<(), ApplyError> {
        for e in events {
            self.apply(e)?;
        }
        Ok(())
    }

    /// Fold one event, checking every invariant first: a rejected event changes nothing.
    pub fn apply(&mut self, ev: &pb::Event) -> Result<(), ApplyError> {
        if ev.seq != self.seq + 1 {
            return Err(ApplyError::SeqGap {
                expected: self.seq + 1,
                got: ev.seq,
            });
        }
        if ev.epoch < self.epoch {
            return Err(ApplyError::EpochBackwards {
                seq: ev.seq,
                current: self.epoch,
                got: ev.epoch,
            });
        }
        let body = ev.body.as_ref().ok_or(ApplyError::EmptyEvent(ev.seq))?;
        let bad = |what: String| ApplyError::Invariant { seq: ev.seq, what };
        match body {
            Body::NodeRegistered(r) => {
                let inv = r
                    .inventory
                    .as_ref()
                    .ok_or_else(|| bad("NodeRegistered without inventory".into()))?;
                self.register(inv).map_err(bad)?;
            }
            Body::NodeRemoved(r) => {
                let node = self
                    .nodes
                    .get(&r.node)
                    .ok_or_else(|| bad(format!("NodeRemoved of unknown node {}", r.node)))?;
                if !node.allocs.is_empty() {
                    return Err(bad(format!(
                        "NodeRemoved of {} with {} live allocations",
                        r.node,
                        node.allocs.len()
                    )));
                }
                if let Some(n) = self.nodes.remove(&r.node) {
                    for g in &n.gpus {
                        self.gpu_owner.remove(&g.uuid);
                    }
                }
            }
            Body::DeviceHealthChanged(h) => {
                let gpu = self
                    .nodes
                    .get_mut(&h.node)
                    .and_then(|n| n.gpu_mut(&h.gpu_uuid))
                    .ok_or_else(|| {
                        bad(format!(
                            "health change for unknown GPU {} on {}",
                            h.gpu_uuid, h.node
                        ))
                    })?;
                gpu.healthy = h.healthy;
            }
            Body::Reserved(r) => self.reserve(ev, r).map_err(bad)?,
            Body::Bound(b) => {
                let a = self.allocs.get_mut(&b.allocation_id).ok_or_else(|| {
                    bad(format!("Bound of unknown allocation {}", b.allocation_id))
                })?;
                if !b.node.is_empty() && a.node != b.node {
                    return Err(bad(format!(
                        "Bound names node {} but allocation {} is on {}",
                        b.node, a.id, a.node
                    )));
                }
                if a.state != AllocState::Reserved {
                    return Err(bad(format!(
                        "Bound of allocation {} in state {}",
                        a.id,
                        a.state.as_str()
                    )));
                }
                a.state = AllocState::Bound;
            }
            Body::Assigned(x) => self.assign(x).map_err(bad)?,
            Body::IdentityCorrected(c) => self.correct(c).map_err(bad)?,
            Body::Released(r) => {
                if let Some(a) = self.allocs.get(&r.allocation_id)
                    && !r.node.is_empty()
                    && a.node != r.node
                {
                    return Err(bad(format!(
                        "Released names node {} but allocation {} is on {}",
                        r.node, a.id, a.node
                    )));
                }
                self.release(r.allocation_id).map_err(bad)?;
            }
            Body::LimitViolated(_) => self.violations += 1,
            Body::LeaderElected(_) => {
                if ev.epoch <= self.epoch && self.seq > 0 {
                    return Err(bad(format!(
                        "LeaderElected with epoch {} not above {}",
                        ev.epoch, self.epoch
                    )));
                }
            }
            Body::QuotaSet(q) => {
                if q.mem_mib == 0 {
                    self.quotas.remove(&q.namespace);
                } else {
                    self.quotas.insert(q.namespace.clone(), q.mem_mib);
                }
            }
        }
        self.seq = ev.seq;
        self.epoch = ev.epoch;
        self.time_ms = ev.time_ms;
        Ok(())
    }

    fn register(&mut self, inv: &pb::NodeInventory) -> Result<(), String> {
        if inv.node.is_empty() {
            return Err("NodeRegistered with an empty node name".into());
        }
        let mut seen = BTreeSet::new();
        for g in &inv.gpus {
            if g.uuid.is_empty() || !seen.insert(g.uuid.as_str()) {
                return Err(format!(
                    "node {}: empty or duplicate GPU uuid {:?}",
                    inv.node, g.uuid
                ));
            }
            if let Some(other) = self.gpu_owner.get(&g.uuid).filter(|o| **o != inv.node) {
                return Err(format!(
                    "GPU {} is already registered on node {other}",
                    g.uuid
                ));
            }
        }
        let old = self.nodes.get(&inv.node);
        let mut gpus: Vec<GpuState> = inv
            .gpus
            .iter()
            .map(|g| {
                let prev = old.and_then(|o| o.gpu(&g.uuid));
                GpuState {
                    uuid: g.uuid.clone(),
                    index: g.index,
                    model: g.model.clone(),
                    memory_mib: g.memory_mib,
                    healthy: g.healthy,
                    mem_used: prev.map_or(0, |p| p.mem_used),
                    core_used: prev.map_or(0, |p| p.core_used),
                    holders: prev.map_or(0, |p| p.holders),
                }
            })
            .collect();
        gpus.sort_by_key(|g| g.index);
        if let Some(old) = old {
            for g in old.gpus.iter().filter(|g| g.holders > 0) {
                match gpus.iter().find(|n| n.uuid == g.uuid) {
                    None => {
                        return Err(format!(
                            "node {}: GPU {} has live allocations and cannot leave the inventory",
                            inv.node, g.uuid
                        ));
                    }
                    Some(n) if n.memory_mib < n.mem_used => {
                        return Err(format!(
                            "node {}: GPU {} would have {} MiB but {} MiB are allocated",
                            inv.node, g.uuid, n.memory_mib, n.mem_used
                        ));
                    }
                    Some(_) => {}
                }
            }
        }
        if let Some(old) = old {
            for g in &old.gpus {
                self.gpu_owner.remove(&g.uuid);
            }
        }
        for g in &gpus {
            self.gpu_owner.insert(g.uuid.clone(), inv.node.clone());
        }
        let old = self.nodes.get(&inv.node);
        let (cpu_used, memory_used, allocs, devices, pod_kinds) = old.map_or(
            (0, 0, BTreeSet::new(), FxHashMap::default(), [0; POD_KINDS]),
            |o| {
                (
                    o.cpu_used,
                    o.memory_used,
                    o.allocs.clone(),
                    o.devices.clone(),
                    o.pod_kinds,
                )
            },
        );
        self.nodes.insert(
            inv.node.clone(),
            NodeState {
                name: inv.node.clone(),
                gpus,
                cpu_milli: inv.cpu_milli,
                memory_mib: inv.memory_mib,
                cpu_used,
                memory_used,
                allocs,
                devices,
                pod_kinds,
            },
        );
        Ok(())
    }

    fn reserve(&mut self, ev: &pb::Event, r: &pb::Reserved) -> Result<(), String> {
        if r.allocation_id != ev.seq {
            return Err(format!(
                "Reserved allocation id {} is not its seq {}",
                r.allocation_id, ev.seq
            ));
        }
        let pod = r.pod.as_ref().ok_or("Reserved without pod")?;
        if pod.uid.is_empty() {
            return Err("Reserved with an empty pod uid".into());
        }
        if let Some(other) = self.by_pod.get(&pod.uid).and_then(|c| c.get(&r.container)) {
            return Err(format!(
                "pod {} container {} already holds allocation {other}",
                pod.uid, r.container
            ));
        }
        if r.shares.is_empty() {
            return Err(format!("Reserved {} has no GPU share", r.allocation_id));
        }
        let node = self
            .nodes
            .get_mut(&r.node)
            .ok_or_else(|| format!("Reserved on unknown node {}", r.node))?;
        let mut idx: Vec<usize> = Vec::with_capacity(r.shares.len());
        for s in &r.shares {
            let i = node
                .gpus
                .iter()
                .position(|g| g.uuid == s.gpu_uuid)
                .ok_or_else(|| format!("Reserved on GPU {} not on node {}", s.gpu_uuid, r.node))?;
            if idx.contains(&i) {
                return Err(format!("Reserved takes GPU {} twice", s.gpu_uuid));
            }
            idx.push(i);
            let g = &node.gpus[i];
            if !g.healthy {
                return Err(format!("Reserved on unhealthy GPU {}", s.gpu_uuid));
            }
            if g.mem_used + s.mem_mib > g.memory_mib {
                return Err(format!(
                    "GPU {} memory over capacity: {} + {} > {} MiB",
                    g.uuid, g.mem_used, s.mem_mib, g.memory_mib
                ));
            }
            if g.core_used + s.core_milli > CORE_MILLI_PER_GPU {
                return Err(format!(
                    "GPU {} compute over capacity: {} + {} > {CORE_MILLI_PER_GPU}",
                    g.uuid, g.core_used, s.core_milli
                ));
            }
        }
        if node.cpu_milli > 0 && node.cpu_used + r.cpu_milli > node.cpu_milli {
            return Err(format!("node {} CPU over capacity", r.node));
        }
        if node.memory_mib > 0 && node.memory_used + r.memory_mib > node.memory_mib {
            return Err(format!("node {} host memory over capacity", r.node));
        }
        for (s, i) in r.shares.iter().zip(idx) {
            let g = &mut node.gpus[i];
            g.mem_used += s.mem_mib;
            g.core_used += s.core_milli;
            g.holders += 1;
        }
        node.cpu_used += r.cpu_milli;
        node.memory_used += r.memory_mib;
        node.add_pod_kind(pod_kind(r.shares.len(), r.shares[0].core_milli));
        node.allocs.insert(r.allocation_id);
        self.index_insert(&pod.uid, &r.container, r.allocation_id);
        self.allocs.insert(
            r.allocation_id,
            Alloc {
                id: r.allocation_id,
                pod: pod.clone(),
                container: r.container.clone(),
                node: r.node.clone(),
                shares: r.shares.clone(),
                state: AllocState::Reserved,
                reserved_ms: ev.time_ms,
                deadline_ms: r.deadline_ms,
                device_ids: Vec::new(),
                cpu_milli: r.cpu_milli,
                memory_mib: r.memory_mib,
                epoch: ev.epoch,
                policy: r.policy.clone(),
            },
        );
        Ok(())
    }

    fn assign(&mut self, x: &pb::Assigned) -> Result<(), String> {
        let a = self
            .allocs
            .get(&x.allocation_id)
            .ok_or_else(|| format!("Assigned of unknown allocation {}", x.allocation_id))?;
        if !x.node.is_empty() && a.node != x.node {
            return Err(format!(
                "Assigned names node {} but allocation {} is on {}",
                x.node, a.id, a.node
            ));
        }
        if a.state == AllocState::Assigned {
            return Err(format!("allocation {} is already assigned", a.id));
        }
        if x.device_ids.is_empty() {
            return Err(format!("Assigned {} without device ids", a.id));
        }
        let node = self
            .nodes
            .get_mut(&a.node)
            .ok_or("allocation on unknown node")?;
        for d in &x.device_ids {
            if let Some(o) = node.devices.get(d).filter(|o| **o != a.id) {
                return Err(format!("device {d} is already held by allocation {o}"));
            }
        }
        for d in &x.device_ids {
            node.devices.insert(d.clone(), x.allocation_id);
        }
        let a = self
            .allocs
            .get_mut(&x.allocation_id)
            .expect("checked above");
        a.state = AllocState::Assigned;
        a.device_ids = x.device_ids.clone();
        Ok(())
    }

    fn correct(&mut self, c: &pb::IdentityCorrected) -> Result<(), String> {
        let (a, b) = (c.from_allocation_id, c.to_allocation_id);
        if a == b {
            return Err(format!("IdentityCorrected of allocation {a} with itself"));
        }
        let (Some(x), Some(y)) = (self.allocs.get(&a), self.allocs.get(&b)) else {
            return Err(format!(
                "IdentityCorrected between unknown allocations {a} and {b}"
            ));
        };
        if x.node != y.node {
            return Err(format!(
                "IdentityCorrected across nodes {} and {}",
                x.node, y.node
            ));
        }
        // What belongs to the pod moves with it: who it is, its reservation clock and its
        // host CPU/memory request. What belongs to the devices stays: GPUs, shares, device IDs
        // and a claim. The pod that lost `a` was never admitted (its reservation was claimed
        // for another pod's devices), so `b` becomes its reservation again unless `b` is
        // itself claimed; whether that pod is bound the pod watcher confirms at the deadline.
        let xp = (
            x.pod.clone(),
            x.container.clone(),
            x.reserved_ms,
            x.deadline_ms,
        );
        let yp = (
            y.pod.clone(),
            y.container.clone(),
            y.reserved_ms,
            y.deadline_ms,
        );
        let (xr, yr) = ((x.cpu_milli, x.memory_mib), (y.cpu_milli, y.memory_mib));
        self.index_remove(&xp.0.uid, &xp.1);
        self.index_remove(&yp.0.uid, &yp.1);
        self.index_insert(&xp.0.uid, &xp.1, b);
        self.index_insert(&yp.0.uid, &yp.1, a);
        let x = self.allocs.get_mut(&a).expect("checked above");
        (x.pod, x.container, x.reserved_ms, x.deadline_ms) = yp;
        (x.cpu_milli, x.memory_mib) = yr;
        let y = self.allocs.get_mut(&b).expect("checked above");
        (y.pod, y.container, y.reserved_ms, y.deadline_ms) = xp;
        (y.cpu_milli, y.memory_mib) = xr;
        if y.state == AllocState::Bound {
            y.state = AllocState::Reserved;
        }
        Ok(())
    }

    fn index_insert(&mut self, uid: &str, container: &str, id: u64) {
        match self.by_pod.get_mut(uid) {
            Some(c) => c.insert(container, id),
            None => {
                let mut c = Containers::default();
                c.insert(container, id);
                self.by_pod.insert(uid.to_owned(), c);
            }
        }
    }

    fn index_remove(&mut self, uid: &str, container: &str) {
        if let Some(c) = self.by_pod.get_mut(uid) {
            c.remove(container);
            if c.is_empty() {
                self.by_pod.remove(uid);
            }
        }
    }

    fn release(&mut self, id: u64) -> Result<(), String> {
        let a = self
            .allocs
            .remove(&id)
            .ok_or_else(|| format!("Released of unknown allocation {id}"))?;
        self.index_remove(&a.pod.uid, &a.container);
        let node = self
            .nodes
            .get_mut(&a.node)
            .expect("an allocation's node stays registered while it lives");
        for s in &a.shares {
            let g = node
                .gpu_mut(&s.gpu_uuid)
                .expect("an allocated GPU stays in the inventory while it is held");
            g.mem_used -= s.mem_mib;
            g.core_used -= s.core_milli;
            g.holders -= 1;
        }
        node.cpu_used -= a.cpu_milli;
        node.memory_used -= a.memory_mib;
        node.remove_pod_kind(pod_kind(
            a.shares.len(),
            a.shares.first().map_or(0, |s| s.core_milli),
        ));
        node.allocs.remove(&id);
        for d in &a.device_ids {
            node.devices.remove(d);
        }
        Ok(())
    }

    /// The state as a snapshot message (nodes by name, allocations by id: deterministic bytes).
    pub fn to_snapshot(&self) -> pb::Snapshot {
        let mut allocations: Vec<pb::Allocation> = self.allocs.values().map(Alloc::to_pb).collect();
        allocations.sort_by_key(|a| a.id);
        pb::Snapshot {
            version: 1,
            seq: self.seq,
            epoch: self.epoch,
            nodes: self.nodes.values().map(NodeState::inventory).collect(),
            allocations,
            quotas: self
                .quotas
                .iter()
                .map(|(ns, m)| pb::QuotaSet {
                    namespace: ns.clone(),
                    mem_mib: *m,
                })
                .collect(),
            time_ms: self.time_ms,
        }
    }

    /// Rebuild a state from a snapshot, re-deriving every usage counter (and so re-checking
    /// capacities). The violation count is not part of a snapshot.
    pub fn from_snapshot(s: &pb::Snapshot) -> Result<Self, String> {
        let mut l = Ledger::new();
        for n in &s.nodes {
            l.register(n)?;
        }
        for a in &s.allocations {
            let state = match pb::AllocationState::try_from(a.state) {
                Ok(pb::AllocationState::Reserved) => AllocState::Reserved,
                Ok(pb::AllocationState::Bound) => AllocState::Bound,
                Ok(pb::AllocationState::Assigned) => AllocState::Assigned,
                _ => {
                    return Err(format!(
                        "allocation {} has an unknown state {}",
                        a.id, a.state
                    ));
                }
            };
            let ev = pb::Event {
                seq: a.id,
                epoch: a.epoch,
                time_ms: a.reserved_ms,
                body: None,
            };
            let r = pb::Reserved {
                allocation_id: a.id,
                pod: a.pod.clone(),
                container: a.container.clone(),
                node: a.node.clone(),
                shares: a.shares.clone(),
                deadline_ms: a.deadline_ms,
                cpu_milli: a.cpu_milli,
                memory_mib: a.memory_mib,
                policy: a.policy.clone(),
            };
            // Snapshots may carry unhealthy GPUs with live allocations: health is checked when a
            // grant is made, not while it is held.
            let unhealthy: Vec<String> = a
                .shares
                .iter()
                .filter(|sh| {
                    l.nodes
                        .get(&a.node)
                        .and_then(|n| n.gpu(&sh.gpu_uuid))
                        .is_some_and(|g| !g.healthy)
                })
                .map(|sh| sh.gpu_uuid.clone())
                .collect();
            l.set_health(&a.node, &unhealthy, true);
            let res = l.reserve(&ev, &r);
            l.set_health(&a.node, &unhealthy, false);
            res?;
            let x = l.allocs.get_mut(&a.id).expect("just reserved");
            x.state = state;
            x.device_ids = a.device_ids.clone();
            if let Some(n) = l.nodes.get_mut(&a.node) {
                for d in &a.device_ids {
                    n.devices.insert(d.clone(), a.id);
                }
            }
        }
        for q in &s.quotas {
            l.quotas.insert(q.namespace.clone(), q.mem_mib);
        }
        l.seq = s.seq;
        l.epoch = s.epoch;
        l.time_ms = s.time_ms;
        Ok(l)
    }

    fn set_health(&mut self, node: &str, uuids: &[String], healthy: bool) {
        if let Some(n) = self.nodes.get_mut(node) {
            for u in uuids {
                if let Some(g) = n.gpu_mut(u) {
                    g.healthy = healthy;
                }
            }
        }
    }

    /// Recompute every usage counter from the live allocations and check every invariant of
    /// the state as a whole (the per-event checks, re-done from scratch). Used by tests and by
    /// `gpuledger verify`.
    pub fn check(&self) -> Result<(), String> {
        let mut mem: HashMap<&str, u64> = HashMap::new();
        let mut core: HashMap<&str, u32> = HashMap::new();
        let mut holders: HashMap<&str, u32> = HashMap::new();
        let mut cpu: HashMap<&str, u64> = HashMap::new();
        let mut hmem: HashMap<&str, u64> = HashMap::new();
        for a in self.allocs.values() {
            let n = self
                .nodes
                .get(&a.node)
                .ok_or_else(|| format!("allocation {} on unknown node {}", a.id, a.node))?;
            if !n.allocs.contains(&a.id) {
                return Err(format!("node {} does not list allocation {}", a.node, a.id));
            }
            if self
                .by_pod
                .get(&a.pod.uid)
                .and_then(|c| c.get(&a.container))
                != Some(&a.id)
            {
                return Err(format!(
                    "allocation {} missing from the container index",
                    a.id
                ));
            }
            for s in &a.shares {
                if n.gpu(&s.gpu_uuid).is_none() {
                    return Err(format!("allocation {} on unknown GPU {}", a.id, s.gpu_uuid));
                }
                *mem.entry(&s.gpu_uuid).or_default() += s.mem_mib;
                *core.entry(&s.gpu_uuid).or_default() += s.core_milli;
                *holders.entry(&s.gpu_uuid).or_default() += 1;
            }
            *cpu.entry(&a.node).or_default() += a.cpu_milli;
            *hmem.entry(&a.node).or_default() += a.memory_mib;
        }
        if self.by_pod.values().map(Containers::len).sum::<usize>() != self.allocs.len() {
            return Err("container index and allocations differ in size".into());
        }
        for n in self.nodes.values() {
            let listed = n
                .allocs
                .iter()
                .filter(|id| self.allocs.contains_key(id))
                .count();
            if listed != n.allocs.len() {
                return Err(format!("node {} lists released allocations", n.name));
            }
            let held: usize = n
                .allocs
                .iter()
                .filter_map(|id| self.allocs.get(id))
                .map(|a| a.device_ids.len())
                .sum();
            if held != n.devices.len()
                || n.devices.iter().any(|(d, id)| {
                    !self
                        .allocs
                        .get(id)
                        .is_some_and(|a| a.device_ids.contains(d))
                })
            {
                return Err(format!("node {} device index is off", n.name));
            }
            let mut kinds = [0u32; POD_KINDS];
            for a in n.allocs.iter().filter_map(|id| self.allocs.get(id)) {
                let core = a.shares.first().map_or(0, |s| s.core_milli);
                kinds[pod_kind(a.shares.len(), core)] += 1;
            }
            if kinds != n.pod_kinds {
                return Err(format!("node {} pod kind counts are off", n.name));
            }
            if cpu.get(n.name.as_str()).copied().unwrap_or(0) != n.cpu_used
                || hmem.get(n.name.as_str()).copied().unwrap_or(0) != n.memory_used
            {
                return Err(format!("node {} CPU/memory counters are off", n.name));
            }
            for g in &n.gpus {
                let (m, c, h) = (
                    mem.get(g.uuid.as_str()).copied().unwrap_or(0),
                    core.get(g.uuid.as_str()).copied().unwrap_or(0),
                    holders.get(g.uuid.as_str()).copied().unwrap_or(0),
                );
                if (m, c, h) != (g.mem_used, g.core_used, g.holders) {
                    return Err(format!("GPU {} counters are off", g.uuid));
                }
                if m > g.memory_mib {
                    return Err(format!(
                        "GPU {} memory over capacity: {m} > {}",
                        g.uuid, g.memory_mib
                    ));
                }
                if c > CORE_MILLI_PER_GPU {
                    return Err(format!("GPU {} compute over capacity: {c}", g.uuid));
                }
                if self.gpu_owner.get(&g.uuid) != Some(&n.name) {
                    return Err(format!("GPU {} missing from the owner index", g.uuid));
                }
            }
        }
        Ok(())
    }

    /// Equality of everything a snapshot holds (a snapshot round trip drops the violation count).
    pub fn same_state(&self, other: &Ledger) -> bool {
        self.seq == other.seq
            && self.epoch == other.epoch
            && self.nodes == other.nodes
            && self.allocs == other.allocs
            && self.by_pod == other.by_pod
            && self.gpu_owner == other.gpu_owner
            && self.quotas == other.quotas
    }
}

#[cfg(test)]
mod tests;
