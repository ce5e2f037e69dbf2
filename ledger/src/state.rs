//! The folded state of the ledger and the invariants every event must keep.
//!
//! The types are in [`types`]; folding an event (with its per-event checks) in `fold`; the
//! whole-state invariant check in `check`; the snapshot codec in `snapshot`.

use rustc_hash::FxHashMap;

mod budget;
mod check;
mod claims;
mod fold;
mod nodes;
mod nominations;
mod snapshot;
mod types;

pub use budget::{
    BudgetStatus, Budgets, MS_PER_HOUR, NsUsage, Quota, ROLLING_BUCKETS, budget_summary,
    is_dns_label, same_budget, validate_budget,
};
pub use claims::{dra_device_name, holder, holders, same_pods};
pub use nodes::Nodes;
pub(crate) use nominations::take_nominated;
pub use nominations::{Nominations, nominee};
use types::Containers;
pub use types::{
    Alloc, AllocState, ClaimGrant, GpuState, NodeState, POD_KINDS, claim_key, node_mode, pod_kind,
};

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
    budgets: Budgets,
    nominations: Nominations,
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
    /// The node a pod holds GPUs on, if it holds any (a pod's allocations share one node).
    pub fn node_of_pod(&self, pod_uid: &str) -> Option<&str> {
        self.by_pod
            .get(pod_uid)?
            .values()
            .find_map(|id| self.allocs.get(id))
            .map(|a| a.node.as_str())
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
    /// Per-namespace quotas (hard caps on what a namespace holds at once).
    pub fn quotas(&self) -> &std::collections::BTreeMap<String, Quota> {
        self.budgets.quotas()
    }
    /// Budgets, quotas and per-namespace consumption.
    pub fn budgets(&self) -> &Budgets {
        &self.budgets
    }
    /// Number of `LimitViolated` events folded.
    pub fn violations(&self) -> u64 {
        self.violations
    }

    /// Equality of everything a snapshot holds (a snapshot round trip drops the violation count).
    pub fn same_state(&self, other: &Ledger) -> bool {
        self.seq == other.seq
            && self.epoch == other.epoch
            && self.nodes == other.nodes
            && self.allocs == other.allocs
            && self.by_pod == other.by_pod
            && self.gpu_owner == other.gpu_owner
            && self.budgets == other.budgets
            && self.nominations == other.nominations
    }
}

#[cfg(test)]
mod tests;
