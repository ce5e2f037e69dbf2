//! The snapshot codec: the state as a `pb::Snapshot` and back.

use super::{Alloc, AllocState, Ledger, NodeState};
use crate::pb;

impl Ledger {
    /// The state as a snapshot message (nodes by name, allocations by id: deterministic bytes).
    pub fn to_snapshot(&self) -> pb::Snapshot {
        let mut allocations: Vec<pb::Allocation> = self.allocs.values().map(Alloc::to_pb).collect();
        allocations.sort_by_key(|a| a.id);
        let mut s = pb::Snapshot {
            version: 1,
            seq: self.seq,
            epoch: self.epoch,
            nodes: self.nodes.values().map(NodeState::inventory).collect(),
            allocations,
            time_ms: self.time_ms,
            ..pb::Snapshot::default()
        };
        self.budgets.to_snapshot(&mut s);
        s.nominations = self.nominations.iter().cloned().collect();
        s
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
                actor: None,
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
            x.claim = a
                .claim
                .as_ref()
                .map(|c| Box::new(super::ClaimGrant::from_pb(c)));
            if let Some(n) = l.nodes.get_mut(&a.node) {
                for d in &a.device_ids {
                    n.devices.insert(d.clone(), a.id);
                }
            }
        }
        let mut held: std::collections::BTreeMap<String, (u64, u64)> = Default::default();
        for a in l.allocs.values() {
            let (ns, m, c) = super::budget::holding(a);
            let h = held.entry(ns).or_default();
            h.0 += m;
            h.1 += c;
        }
        l.budgets = super::Budgets::from_snapshot(s, held)?;
        for n in &s.nominations {
            l.nominate(n)?;
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
}
