//! Keeping budgets, quotas and consumption in step with the events the fold applies.

use super::super::{Alloc, Ledger};
use crate::pb::event::Body;

impl Ledger {
    /// What the allocations an event releases or re-attributes held before it: (namespace,
    /// MiB, core_milli), for [`Ledger::account`] to move once the event is applied.
    pub(in crate::state) fn holdings_before(&self, body: &Body) -> [Option<(String, u64, u64)>; 2] {
        let get = |id: &u64| self.allocs.get(id).map(holding);
        match body {
            Body::Released(r) => [get(&r.allocation_id), None],
            Body::IdentityCorrected(c) => [get(&c.from_allocation_id), get(&c.to_allocation_id)],
            _ => [None, None],
        }
    }

    /// Keep budgets, quotas and consumption in step with an applied event at `time_ms`.
    pub(in crate::state) fn account(
        &mut self,
        body: &Body,
        before: [Option<(String, u64, u64)>; 2],
        time_ms: i64,
    ) {
        let t = self.budgets.effective(time_ms);
        match body {
            Body::Reserved(crate::pb::Reserved { allocation_id, .. })
            | Body::ClaimGranted(crate::pb::ClaimGranted { allocation_id, .. }) => {
                // Borrowed, not cloned: the fold's hottest path.
                if let Some(a) = self.allocs.get(allocation_id) {
                    let (m, c) = sums(a);
                    self.budgets.hold(&a.pod.namespace, m, c, true, t);
                }
            }
            Body::Released(_) => {
                for (ns, m, c) in before.into_iter().flatten() {
                    self.budgets.hold(&ns, m, c, false, t);
                }
            }
            Body::IdentityCorrected(c) => {
                // The shares stay with their allocation; the pod holding them changes.
                for (ns, m, k) in before.into_iter().flatten() {
                    self.budgets.hold(&ns, m, k, false, t);
                }
                for id in [c.from_allocation_id, c.to_allocation_id] {
                    if let Some((ns, m, k)) = self.allocs.get(&id).map(holding) {
                        self.budgets.hold(&ns, m, k, true, t);
                    }
                }
            }
            Body::QuotaSet(q) => self.budgets.set_quota(q),
            Body::BudgetSet(b) => self.budgets.set_budget(&b.namespace, Some(b), t),
            Body::BudgetRemoved(b) => self.budgets.set_budget(&b.namespace, None, t),
            _ => {}
        }
        self.budgets.tick(time_ms);
    }
}

/// An allocation's namespace and what it holds: (namespace, MiB, core_milli) over its GPUs.
pub(in crate::state) fn holding(a: &Alloc) -> (String, u64, u64) {
    let (m, c) = sums(a);
    (a.pod.namespace.clone(), m, c)
}

/// What an allocation holds over its GPUs: (MiB, core_milli).
fn sums(a: &Alloc) -> (u64, u64) {
    a.shares.iter().fold((0, 0), |(m, c), s| {
        (m + s.mem_mib, c + u64::from(s.core_milli))
    })
}
