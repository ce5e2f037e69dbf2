//! Budgets, quotas and consumption in the snapshot, and back.

use std::collections::BTreeMap;

use super::{Budgets, NsUsage, validate_budget};
use crate::pb;

impl Budgets {
    /// Budgets, quotas and consumption into a snapshot.
    pub(in crate::state) fn to_snapshot(&self, s: &mut pb::Snapshot) {
        s.quotas = self
            .quotas
            .iter()
            .map(|(ns, q)| pb::QuotaSet {
                namespace: ns.clone(),
                mem_mib: q.mem_mib,
                core_milli: q.core_milli,
            })
            .collect();
        s.budgets = self.budgets.values().cloned().collect();
        s.clock_ms = self.clock_ms;
        s.usage = self
            .usage
            .iter()
            .map(|(ns, u)| pb::NamespaceUsage {
                namespace: ns.clone(),
                last_ms: u.last_ms,
                mib_ms: u.mib_ms.to_string(),
                core_ms: u.core_ms.to_string(),
                window_start_ms: u.window_start_ms,
                buckets: u
                    .buckets
                    .iter()
                    .map(|b| pb::UsageBucket {
                        start_ms: b.start_ms,
                        mib_ms: b.mib_ms.to_string(),
                        core_ms: b.core_ms.to_string(),
                    })
                    .collect(),
            })
            .collect();
    }

    /// Budgets, quotas and consumption from a snapshot; `held` is what each namespace holds
    /// (re-derived from the snapshot's allocations, not trusted from it).
    pub(in crate::state) fn from_snapshot(
        s: &pb::Snapshot,
        held: BTreeMap<String, (u64, u64)>,
    ) -> Result<Budgets, String> {
        let num = |v: &str, what: &str| {
            v.parse::<u128>()
                .map_err(|e| format!("snapshot {what} {v:?} is not a number: {e}"))
        };
        let mut b = Budgets {
            clock_ms: s.clock_ms.max(s.time_ms),
            ..Budgets::default()
        };
        for q in &s.quotas {
            b.set_quota(q);
        }
        for x in &s.budgets {
            if let Some(why) = validate_budget(x) {
                return Err(format!("snapshot budget of {:?}: {why}", x.namespace));
            }
            b.budgets.insert(x.namespace.clone(), x.clone());
        }
        for x in &s.usage {
            let mut u = NsUsage {
                last_ms: x.last_ms,
                mib_ms: num(&x.mib_ms, "mib_ms")?,
                core_ms: num(&x.core_ms, "core_ms")?,
                window_start_ms: x.window_start_ms,
                ..NsUsage::default()
            };
            for k in &x.buckets {
                u.add(
                    k.start_ms,
                    num(&k.mib_ms, "bucket mib_ms")?,
                    num(&k.core_ms, "bucket core_ms")?,
                );
            }
            b.usage.insert(x.namespace.clone(), u);
        }
        for (ns, (m, c)) in held {
            let u = b
                .usage
                .get_mut(&ns)
                .ok_or_else(|| format!("snapshot has allocations of {ns} but no usage for it"))?;
            u.mem_mib = m;
            u.core_milli = c;
        }
        Ok(b)
    }
}
