//! Namespace budgets and quotas, and the GPU consumption they are measured against.
//!
//! Consumption is folded incrementally: a namespace's integrals (MiB × ms, core_milli × ms) are
//! advanced only when its holdings change, so each event costs O(1). Questions about "now" take
//! the time as an argument and extend the integrals from the last change without storing it.
//! Integrals are exact to the millisecond and count time the way `gpuledger usage` does: in log
//! order, a timestamp earlier than one already seen counting as that one.

use std::collections::{BTreeMap, VecDeque};

use jiff::ToSpan;
use jiff::tz::TimeZone;

use super::{Alloc, Ledger};
use crate::pb;
use crate::pb::event::Body;

/// Milliseconds in an hour: amounts are in unit-hours, integrals in unit-ms.
pub const MS_PER_HOUR: u128 = 3_600_000;
/// A rolling window is counted in buckets of this fraction of its length (one minute for a day).
pub const ROLLING_BUCKETS: i64 = 1440;
/// Shortest rolling window: one minute.
pub const MIN_ROLLING_MS: i64 = 60_000;
/// Longest rolling window: 366 days.
pub const MAX_ROLLING_MS: i64 = 366 * 86_400_000;
/// Largest amount a budget may have (unit-hours): 10^12 GPU-MiB-hours is ~1.4 million
/// 80 GiB GPUs for a year; anything larger is a typo.
pub const MAX_AMOUNT: u64 = 1_000_000_000_000;
const DAY_MS: i64 = 86_400_000;

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

/// Budgets, quotas and per-namespace consumption: the part of the state issue 19 adds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Budgets {
    budgets: BTreeMap<String, pb::BudgetSet>,
    quotas: BTreeMap<String, Quota>,
    usage: BTreeMap<String, NsUsage>,
    /// The latest event time seen (log order): earlier timestamps count as this.
    clock_ms: i64,
}

/// The window a budget counts in, with what is needed to place a time in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Window {
    Rolling { len_ms: i64, bucket_ms: i64 },
    Day,
    Week,
    Month,
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

impl Window {
    fn of(b: &pb::BudgetSet) -> Option<Window> {
        match pb::BudgetWindow::try_from(b.window).ok()? {
            pb::BudgetWindow::Rolling => Some(Window::Rolling {
                len_ms: b.rolling_ms,
                bucket_ms: (b.rolling_ms / ROLLING_BUCKETS).max(1000),
            }),
            pb::BudgetWindow::Day => Some(Window::Day),
            pb::BudgetWindow::Week => Some(Window::Week),
            pb::BudgetWindow::Month => Some(Window::Month),
            pb::BudgetWindow::Unspecified => None,
        }
    }

    /// Start of the calendar period holding `t` (UTC); None for a rolling window.
    fn period_start(self, t: i64) -> Option<i64> {
        let day = t.div_euclid(DAY_MS) * DAY_MS;
        match self {
            Window::Rolling { .. } => None,
            Window::Day => Some(day),
            // 1970-01-01 was a Thursday: three days after a Monday.
            Window::Week => Some(day - (t.div_euclid(DAY_MS) + 3).rem_euclid(7) * DAY_MS),
            Window::Month => Some(month_start(t, 0)),
        }
    }

    /// Start of the calendar period after the one holding `t`.
    fn next_period(self, t: i64) -> i64 {
        match self {
            Window::Rolling { len_ms, .. } => t + len_ms,
            Window::Day => t.div_euclid(DAY_MS) * DAY_MS + DAY_MS,
            Window::Week => self.period_start(t).unwrap_or(t) + 7 * DAY_MS,
            Window::Month => month_start(t, 1),
        }
    }
}

/// Midnight UTC of the first day of the month holding `t`, `ahead` months later. Times outside
/// what a calendar can hold (never an event's) clamp to the time itself.
fn month_start(t: i64, ahead: i64) -> i64 {
    let Ok(ts) = jiff::Timestamp::from_millisecond(t) else {
        return t;
    };
    let first = ts.to_zoned(TimeZone::UTC).date().first_of_month();
    first
        .checked_add(ahead.months())
        .and_then(|d| d.to_zoned(TimeZone::UTC))
        .map_or(t, |z| z.timestamp().as_millisecond())
}

/// Why a budget is not acceptable, or None. The allocator and the fold share it.
pub fn validate_budget(b: &pb::BudgetSet) -> Option<String> {
    if !b.namespace.is_empty() && !is_dns_label(&b.namespace) {
        return Some(format!("namespace {:?} is not a DNS label", b.namespace));
    }
    if !matches!(
        pb::BudgetUnit::try_from(b.unit),
        Ok(pb::BudgetUnit::GpuMibHours | pb::BudgetUnit::GpuCoreHours)
    ) {
        return Some(format!("unknown budget unit {}", b.unit));
    }
    if b.amount == 0 || b.amount > MAX_AMOUNT {
        return Some(format!(
            "amount {} is out of range (1 to {MAX_AMOUNT})",
            b.amount
        ));
    }
    match pb::BudgetWindow::try_from(b.window) {
        Ok(pb::BudgetWindow::Rolling) => {
            if !(MIN_ROLLING_MS..=MAX_ROLLING_MS).contains(&b.rolling_ms) {
                return Some(format!(
                    "a rolling window of {} ms is out of range (1 minute to 366 days)",
                    b.rolling_ms
                ));
            }
        }
        Ok(pb::BudgetWindow::Day | pb::BudgetWindow::Week | pb::BudgetWindow::Month) => {
            if b.rolling_ms != 0 {
                return Some("a calendar window has no rolling length".into());
            }
        }
        _ => return Some(format!("unknown budget window {}", b.window)),
    }
    match pb::BudgetPolicy::try_from(b.policy) {
        Ok(pb::BudgetPolicy::Demote) => {
            if b.priority_class.is_empty() || b.priority_class.len() > 253 {
                return Some("policy demote needs a priority class name".into());
            }
            if !b.priority_class.split('.').all(is_dns_label) {
                return Some(format!(
                    "priority class {:?} is not a DNS subdomain",
                    b.priority_class
                ));
            }
        }
        Ok(pb::BudgetPolicy::Deny | pb::BudgetPolicy::Warn) => {
            if !b.priority_class.is_empty() {
                return Some("only policy demote takes a priority class".into());
            }
        }
        _ => return Some(format!("unknown budget policy {}", b.policy)),
    }
    None
}

/// A Kubernetes DNS-1123 label: 1–63 of `[a-z0-9-]`, alphanumeric at both ends.
pub fn is_dns_label(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}

/// A budget in one line for people: "10000 GPU-MiB-hours per day, deny".
pub fn budget_summary(b: &pb::BudgetSet) -> String {
    let unit = match pb::BudgetUnit::try_from(b.unit) {
        Ok(pb::BudgetUnit::GpuCoreHours) => {
            return format!("{} GPU-hours {}", fmt_milli(b.amount), summary_tail(b));
        }
        _ => "GPU-MiB-hours",
    };
    format!("{} {unit} {}", b.amount, summary_tail(b))
}

fn summary_tail(b: &pb::BudgetSet) -> String {
    let window = match pb::BudgetWindow::try_from(b.window) {
        Ok(pb::BudgetWindow::Rolling) => format!("per rolling {} s", b.rolling_ms / 1000),
        Ok(pb::BudgetWindow::Day) => "per day".into(),
        Ok(pb::BudgetWindow::Week) => "per week".into(),
        Ok(pb::BudgetWindow::Month) => "per month".into(),
        _ => "per ?".into(),
    };
    let policy = match pb::BudgetPolicy::try_from(b.policy) {
        Ok(pb::BudgetPolicy::Demote) => format!("demote to {}", b.priority_class),
        Ok(pb::BudgetPolicy::Deny) => "deny".into(),
        Ok(pb::BudgetPolicy::Warn) => "warn".into(),
        _ => "?".into(),
    };
    format!("{window}, {policy}")
}

/// Thousandths as a decimal: 2500 → "2.5".
fn fmt_milli(v: u64) -> String {
    let (i, f) = (v / 1000, v % 1000);
    if f == 0 {
        i.to_string()
    } else {
        format!("{i}.{f:03}").trim_end_matches('0').to_owned()
    }
}

/// The two budgets mean the same (where each came from aside).
pub fn same_budget(a: &pb::BudgetSet, b: &pb::BudgetSet) -> bool {
    pb::BudgetSet {
        source: String::new(),
        ..a.clone()
    } == pb::BudgetSet {
        source: String::new(),
        ..b.clone()
    }
}

impl NsUsage {
    /// Count the holdings from `last_ms` to `t` (t ≥ last_ms) under `window`.
    fn advance(&mut self, t: i64, window: Option<Window>) {
        let from = self.last_ms;
        if t <= from {
            return;
        }
        let (m, c) = (u128::from(self.mem_mib), u128::from(self.core_milli));
        let ms = (t - from) as u128;
        self.mib_ms += m * ms;
        self.core_ms += c * ms;
        self.last_ms = t;
        match window {
            None => {}
            Some(Window::Rolling { len_ms, bucket_ms }) => {
                // Older than the window at t can never count again.
                let lo = from.max(t - len_ms).max(self.window_start_ms);
                let mut s = lo;
                while s < t {
                    let b0 = s.div_euclid(bucket_ms) * bucket_ms;
                    let e = (b0 + bucket_ms).min(t);
                    self.add(b0, m * (e - s) as u128, c * (e - s) as u128);
                    s = e;
                }
                self.evict(t - len_ms, bucket_ms);
            }
            Some(w) => {
                let p = w.period_start(t).unwrap_or(t);
                if p > self.window_start_ms {
                    self.window_start_ms = p;
                    self.buckets.clear();
                    self.bucket_sum = (0, 0);
                }
                let lo = from.max(self.window_start_ms);
                if t > lo {
                    let d = (t - lo) as u128;
                    self.add(p, m * d, c * d);
                }
            }
        }
    }

    fn add(&mut self, start_ms: i64, mib: u128, core: u128) {
        if mib == 0 && core == 0 {
            return;
        }
        match self.buckets.back_mut() {
            Some(b) if b.start_ms == start_ms => {
                b.mib_ms += mib;
                b.core_ms += core;
            }
            _ => self.buckets.push_back(Bucket {
                start_ms,
                mib_ms: mib,
                core_ms: core,
            }),
        }
        self.bucket_sum.0 += mib;
        self.bucket_sum.1 += core;
    }

    /// Drop buckets that end at or before `cut`.
    fn evict(&mut self, cut: i64, bucket_ms: i64) {
        while let Some(b) = self.buckets.front().copied() {
            if b.start_ms + bucket_ms > cut {
                break;
            }
            self.buckets.pop_front();
            self.bucket_sum.0 -= b.mib_ms;
            self.bucket_sum.1 -= b.core_ms;
        }
    }

    /// Start counting afresh under a new window from `t` (history under another window is
    /// not kept, so it cannot be recounted).
    fn restart(&mut self, t: i64, window: Option<Window>) {
        self.buckets.clear();
        self.bucket_sum = (0, 0);
        self.window_start_ms = match window.and_then(|w| w.period_start(t)) {
            Some(p) => p.max(t),
            None => t,
        };
    }

    /// Consumption inside `window` at `now` (≥ last_ms), in (MiB·ms, core_milli·ms), with
    /// the holdings extended from `last_ms` to `now`.
    fn used_at(&self, now: i64, window: Window) -> (u128, u128) {
        let (m, c) = (u128::from(self.mem_mib), u128::from(self.core_milli));
        match window {
            Window::Rolling { len_ms, bucket_ms } => {
                let cut = now - len_ms;
                let (mut um, mut uc) = self.bucket_sum;
                for b in self
                    .buckets
                    .iter()
                    .take_while(|b| b.start_ms + bucket_ms <= cut)
                {
                    um -= b.mib_ms;
                    uc -= b.core_ms;
                }
                let lo = self.last_ms.max(cut).max(self.window_start_ms);
                let d = (now - lo).max(0) as u128;
                (um + m * d, uc + c * d)
            }
            w => {
                let p = w.period_start(now).unwrap_or(now);
                let lo = self.last_ms.max(p).max(self.window_start_ms);
                let d = (now - lo).max(0) as u128;
                if p > self.window_start_ms {
                    (m * d, c * d)
                } else {
                    (self.bucket_sum.0 + m * d, self.bucket_sum.1 + c * d)
                }
            }
        }
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

impl Budgets {
    /// Budgets, quotas and consumption into a snapshot.
    pub(super) fn to_snapshot(&self, s: &mut pb::Snapshot) {
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
    pub(super) fn from_snapshot(
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

impl Ledger {
    /// What the allocations an event releases or re-attributes held before it: (namespace,
    /// MiB, core_milli), for [`Ledger::account`] to move once the event is applied.
    pub(super) fn holdings_before(&self, body: &Body) -> [Option<(String, u64, u64)>; 2] {
        let get = |id: &u64| self.allocs.get(id).map(holding);
        match body {
            Body::Released(r) => [get(&r.allocation_id), None],
            Body::IdentityCorrected(c) => [get(&c.from_allocation_id), get(&c.to_allocation_id)],
            _ => [None, None],
        }
    }

    /// Keep budgets, quotas and consumption in step with an applied event at `time_ms`.
    pub(super) fn account(
        &mut self,
        body: &Body,
        before: [Option<(String, u64, u64)>; 2],
        time_ms: i64,
    ) {
        let t = self.budgets.effective(time_ms);
        match body {
            Body::Reserved(r) => {
                // Borrowed, not cloned: the fold's hottest path.
                if let Some(a) = self.allocs.get(&r.allocation_id) {
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
pub(super) fn holding(a: &Alloc) -> (String, u64, u64) {
    let (m, c) = sums(a);
    (a.pod.namespace.clone(), m, c)
}

/// What an allocation holds over its GPUs: (MiB, core_milli).
fn sums(a: &Alloc) -> (u64, u64) {
    a.shares.iter().fold((0, 0), |(m, c), s| {
        (m + s.mem_mib, c + u64::from(s.core_milli))
    })
}

/// The first time after `now` at which a spent rolling budget is within its amount again, if
/// the namespace keeps holding what it holds: buckets leave the window one by one while the
/// holdings keep adding. None when the holdings alone spend the amount within one window.
fn recovery_rolling(
    u: &NsUsage,
    now: i64,
    len_ms: i64,
    bucket_ms: i64,
    mib: bool,
    limit: u128,
) -> Option<i64> {
    let rate = u128::from(if mib { u.mem_mib } else { u.core_milli });
    if rate * len_ms as u128 >= limit {
        return None;
    }
    for b in &u.buckets {
        let at = b.start_ms + bucket_ms + len_ms;
        if at <= now {
            continue;
        }
        let (m, c) = u.used_at(at, Window::Rolling { len_ms, bucket_ms });
        if (if mib { m } else { c }) < limit {
            return Some(at);
        }
    }
    Some(now.max(u.last_ms) + len_ms)
}

#[cfg(test)]
mod tests;
