//! Namespace budgets and quotas, and the GPU consumption they are measured against.
//!
//! Consumption is folded incrementally: a namespace's integrals (MiB × ms, core_milli × ms) are
//! advanced only when its holdings change, so each event costs O(1). Questions about "now" take
//! the time as an argument and extend the integrals from the last change without storing it.
//! Integrals are exact to the millisecond and count time the way `gpuledger usage` does: in log
//! order, a timestamp earlier than one already seen counting as that one.

use std::collections::{BTreeMap, VecDeque};

use crate::pb;

mod account;
mod snapshot;
mod summary;
mod usage;
mod validate;
mod window;

pub(super) use account::holding;
pub use summary::{budget_summary, same_budget};
use usage::recovery_rolling;
pub use validate::{is_dns_label, validate_budget};
use window::Window;

/// Milliseconds in an hour: amounts are in unit-hours, integrals in unit-ms.
pub const MS_PER_HOUR: u128 = 3_600_000;
/// A rolling window is counted in buckets of this fraction of its length (one minute for a day).
pub const ROLLING_BUCKETS: i64 = 1440;

/// A hard cap on what one namespace may hold at once; 0 = no cap on that resource.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Quota {
    /// GPU memory, MiB summed over the namespace's live allocations.
    pub mem_mib: u64,
    /// GPU compute, thousandths summed over the namespace's live allocations.
    pub core_milli: u64,
}

/// Consumption in one bucket of a rolling window (or the whole of a calendar window).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Bucket {
    start_ms: i64,
    mib_ms: u128,
    core_ms: u128,
}

/// One namespace's holdings and consumption.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NsUsage {
    /// GPU memory held now (MiB, over all its live allocations).
    pub mem_mib: u64,
    /// GPU compute held now (thousandths).
    pub core_milli: u64,
    /// The time the integrals were last advanced to.
    pub last_ms: i64,
    /// MiB × ms since the first event.
    pub mib_ms: u128,
    /// core_milli × ms since the first event.
    pub core_ms: u128,
    /// Start of the window the buckets count for (calendar: the period's start; rolling: when
    /// counting began under this window).
    pub(super) window_start_ms: i64,
    /// Calendar windows: one bucket. Rolling: oldest first, each `bucket_ms` wide, only
    /// buckets that can still fall inside the window.
    buckets: VecDeque<Bucket>,
    bucket_sum: (u128, u128),
}

/// Budgets, quotas and per-namespace consumption.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Budgets {
    budgets: BTreeMap<String, pb::BudgetSet>,
    quotas: BTreeMap<String, Quota>,
    usage: BTreeMap<String, NsUsage>,
    /// The latest event time seen (log order): earlier timestamps count as this.
    clock_ms: i64,
}

/// Where a namespace stands against its budget at a given time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BudgetStatus {
    /// The budget in force (its `namespace` is "" when the cluster default applies).
    pub budget: pb::BudgetSet,
    /// Start of the window at the time asked (rolling: that time minus the window), or when
    /// counting under this window began if that is later.
    pub window_start_ms: i64,
    /// Consumed inside the window, in unit × ms (MiB·ms or core_milli·ms).
    pub used: u128,
    /// The amount in unit × ms.
    pub limit: u128,
    /// The rate it is consumed at now: MiB or core_milli held (unit-hours per hour).
    pub rate: u64,
    /// When the budget is spent at the current rate (None: it is not being consumed, or is
    /// spent already). For a rolling window a bound: consumption leaving the window is ignored.
    pub exhausts_at_ms: Option<i64>,
    /// When a spent budget is within its amount again if holdings stay as they are (None:
    /// not spent, or not before the namespace's pods release what they hold).
    pub recovers_at_ms: Option<i64>,
}

impl BudgetStatus {
    /// Whether the budget is spent.
    pub fn exhausted(&self) -> bool {
        self.used >= self.limit
    }
    /// What is left, in unit × ms.
    pub fn remaining(&self) -> u128 {
        self.limit.saturating_sub(self.used)
    }
}

impl Budgets {
    /// Budgets by namespace ("" = the cluster default).
    pub fn budgets(&self) -> &BTreeMap<String, pb::BudgetSet> {
        &self.budgets
    }
    /// Quotas by namespace.
    pub fn quotas(&self) -> &BTreeMap<String, Quota> {
        &self.quotas
    }
    /// Holdings and consumption of every namespace that ever held a GPU.
    pub fn usage(&self) -> &BTreeMap<String, NsUsage> {
        &self.usage
    }
    /// What a namespace holds now: (MiB, core_milli).
    pub fn held(&self, ns: &str) -> (u64, u64) {
        self.usage
            .get(ns)
            .map_or((0, 0), |u| (u.mem_mib, u.core_milli))
    }
    /// What a namespace consumed from the first event to `until` (not before its last change):
    /// (MiB·ms, core_milli·ms), exact, as `gpuledger usage` counts it.
    pub fn consumed(&self, ns: &str, until: i64) -> (u128, u128) {
        self.usage.get(ns).map_or((0, 0), |u| {
            let d = (until - u.last_ms).max(0) as u128;
            (
                u.mib_ms + u128::from(u.mem_mib) * d,
                u.core_ms + u128::from(u.core_milli) * d,
            )
        })
    }
    /// The budget in force for a namespace: its own, else the cluster default.
    pub fn budget_of(&self, ns: &str) -> Option<&pb::BudgetSet> {
        self.budgets.get(ns).or_else(|| self.budgets.get(""))
    }
    /// The latest event time seen.
    pub fn clock_ms(&self) -> i64 {
        self.clock_ms
    }

    fn window_of(&self, ns: &str) -> Option<Window> {
        self.budget_of(ns).and_then(Window::of)
    }

    /// The time an event at `t` counts at.
    pub(super) fn effective(&self, t: i64) -> i64 {
        t.max(self.clock_ms)
    }

    pub(super) fn tick(&mut self, t: i64) {
        self.clock_ms = self.clock_ms.max(t);
    }

    /// A namespace's holdings change by (+mem, +core) or (−mem, −core) at `t`.
    pub(super) fn hold(&mut self, ns: &str, mem: u64, core: u64, add: bool, t: i64) {
        let window = self.window_of(ns);
        let u = match self.usage.get_mut(ns) {
            Some(u) => u,
            None => {
                // Nothing was held before: the whole current period counts from its start.
                let u = NsUsage {
                    last_ms: t,
                    window_start_ms: window.and_then(|w| w.period_start(t)).unwrap_or(t),
                    ..NsUsage::default()
                };
                self.usage.entry(ns.to_owned()).or_insert(u)
            }
        };
        u.advance(t, window);
        if add {
            u.mem_mib += mem;
            u.core_milli += core;
        } else {
            u.mem_mib -= mem;
            u.core_milli -= core;
        }
    }

    pub(super) fn set_quota(&mut self, q: &pb::QuotaSet) {
        if q.mem_mib == 0 && q.core_milli == 0 {
            self.quotas.remove(&q.namespace);
        } else {
            self.quotas.insert(
                q.namespace.clone(),
                Quota {
                    mem_mib: q.mem_mib,
                    core_milli: q.core_milli,
                },
            );
        }
    }

    /// Set (Some) or remove (None) a namespace's budget at `t`. Namespaces whose window
    /// changes start counting afresh; an amount or policy change keeps what was counted.
    pub(super) fn set_budget(&mut self, ns: &str, b: Option<&pb::BudgetSet>, t: i64) {
        let before: Vec<(String, Option<Window>)> = self
            .usage
            .keys()
            .filter(|n| ns.is_empty() || n.as_str() == ns)
            .map(|n| (n.clone(), self.window_of(n)))
            .collect();
        match b {
            Some(b) => self.budgets.insert(ns.to_owned(), b.clone()),
            None => self.budgets.remove(ns),
        };
        for (n, old) in before {
            let new = self.window_of(&n);
            if let Some(u) = self.usage.get_mut(&n) {
                u.advance(t, old);
                if new != old {
                    u.restart(t, new);
                }
            }
        }
    }

    /// Where `ns` stands against its budget at `now` (None: no budget applies). `now` earlier
    /// than the last event counts as the last event's time.
    pub fn status(&self, ns: &str, now: i64) -> Option<BudgetStatus> {
        let budget = self.budget_of(ns)?;
        let window = Window::of(budget)?;
        let now = self.effective(now);
        let mib = pb::BudgetUnit::try_from(budget.unit) != Ok(pb::BudgetUnit::GpuCoreHours);
        let empty = NsUsage::default();
        let u = self.usage.get(ns).unwrap_or(&empty);
        let now = now.max(u.last_ms);
        let (um, uc) = u.used_at(now, window);
        let (used, rate) = if mib {
            (um, u.mem_mib)
        } else {
            (uc, u.core_milli)
        };
        let limit = u128::from(budget.amount) * MS_PER_HOUR;
        // Counting under this window began when it was set (or the namespace first held).
        let window_start_ms = match window {
            Window::Rolling { len_ms, .. } => now - len_ms,
            w => w.period_start(now).unwrap_or(now),
        }
        .max(u.window_start_ms);
        let exhausts_at_ms = (used < limit && rate > 0)
            .then(|| {
                let left = (limit - used).div_ceil(u128::from(rate));
                now.saturating_add(i64::try_from(left).unwrap_or(i64::MAX))
            })
            .filter(|at| match window {
                Window::Rolling { .. } => true,
                w => *at < w.next_period(now),
            });
        let recovers_at_ms = if used < limit {
            None
        } else {
            match window {
                Window::Rolling { len_ms, bucket_ms } => {
                    recovery_rolling(u, now, len_ms, bucket_ms, mib, limit)
                }
                w => Some(w.next_period(now)),
            }
        };
        Some(BudgetStatus {
            budget: budget.clone(),
            window_start_ms,
            used,
            limit,
            rate,
            exhausts_at_ms,
            recovers_at_ms,
        })
    }
}

#[cfg(test)]
mod tests;
