//! `/metrics`: what the allocator exports to Prometheus (`gpuledger_allocator_*`).
//!
//! Counters and histograms that only the hot path can observe (commit latency, batch size,
//! events by type, leaderships) are kept up to date as things happen. Everything that is a view
//! of the ledger (seq, reservations by state, per node and per GPU figures) is encoded from the
//! state at scrape time by [`LedgerCollector`]: with 5,000 nodes × 8 GPUs, keeping 40,000 gauges
//! per family current on every event would cost the fold path, and clearing and refilling them
//! on every scrape cost more than encoding straight from the state.
//!
//! Size is the other budget: one per-GPU line is ~80 bytes, so 40,000 GPUs allow about one
//! dense per-GPU family within 5 MB. Memory — the resource that fragments — is per GPU;
//! capacity and compute are per node (compute capacity is 1000‰ per GPU by definition); an
//! unhealthy GPU gets its own series, healthy GPUs none.

use std::sync::Arc;

use gpuledger_ledger::state::MS_PER_HOUR;
use gpuledger_ledger::{AllocState, CORE_MILLI_PER_GPU, Ledger, pb};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::registry::Registry;

use crate::metrics::{EVENT_TYPES, PREFIX};
use crate::shared::{Role, Shared};

/// Render every metric in the OpenMetrics text format: the hot-path metrics of
/// [`crate::metrics::Metrics`] and the view of the ledger, read from the state at scrape time.
/// The per-namespace families only with `namespaces` (`--metrics-namespaces`): they name
/// tenants and their usage to whoever reaches the port.
pub fn render(shared: &Arc<Shared>, namespaces: bool) -> String {
    let mut view = View::of(shared);
    if !namespaces {
        view.namespaces.clear();
    }
    let mut per_scrape = Registry::with_prefix(PREFIX);
    per_scrape.register_collector(Box::new(LedgerCollector {
        view,
        events: shared.metrics.event_counts(),
        limited: shared.metrics.bites.counts(),
    }));
    shared.metrics.encode_with(&per_scrape)
}

/// The numbers one scrape reports, copied out of a view of the state.
#[derive(Debug, Default)]
struct View {
    seq: u64,
    epoch: u64,
    leader: bool,
    ready: bool,
    violations: u64,
    /// Live allocations: reserved, bound, assigned.
    by_state: [u64; 3],
    nodes: Vec<NodeRow>,
    gpus: Vec<GpuRow>,
    /// Cluster GPU memory: capacity, allocated, and free on GPUs already partly allocated.
    mem_total: u64,
    mem_allocated: u64,
    mem_stranded: u64,
    namespaces: Vec<NsRow>,
}

/// A namespace's holdings, quota and (when one applies) budget at scrape time.
#[derive(Debug)]
struct NsRow {
    name: String,
    held_mib: u64,
    held_core: u64,
    quota_mib: Option<u64>,
    budget: Option<BudgetRow>,
}

/// Budget figures in the budget's unit-hours ("gpu_mib" or "gpu").
#[derive(Debug)]
struct BudgetRow {
    unit: &'static str,
    amount: f64,
    used: f64,
    remaining: f64,
    burn_per_hour: f64,
    exhausted: bool,
    exhausts_at_s: Option<f64>,
    recovers_at_s: Option<f64>,
}

#[derive(Debug)]
struct NodeRow {
    name: String,
    mem_cap: u64,
    core_used: u64,
    core_cap: u64,
}

#[derive(Debug)]
struct GpuRow {
    /// Index into `View::nodes`.
    node: u32,
    index: u32,
    mem_used: u64,
    healthy: bool,
}

impl View {
    fn of(shared: &Shared) -> View {
        let role = shared.role_info();
        let ready = shared.readiness().is_ok();
        let mut v = View::of_ledger(&shared.view_blocking(), shared.clock.now_ms());
        v.epoch = role.epoch.max(v.epoch);
        v.leader = role.role == Role::Leader;
        v.ready = ready;
        v
    }

    fn of_ledger(l: &Ledger, now_ms: i64) -> View {
        let mut v = View {
            seq: l.seq(),
            epoch: l.epoch(),
            violations: l.violations(),
            nodes: Vec::with_capacity(l.nodes().len()),
            gpus: Vec::with_capacity(l.nodes().len() * 8),
            ..View::default()
        };
        for a in l.allocs().values() {
            let i = match a.state {
                AllocState::Reserved => 0,
                AllocState::Bound => 1,
                AllocState::Assigned => 2,
            };
            v.by_state[i] += 1;
        }
        for (i, n) in l.nodes().values().enumerate() {
            let mut row = NodeRow {
                name: n.name.clone(),
                mem_cap: 0,
                core_used: 0,
                core_cap: 0,
            };
            for g in &n.gpus {
                v.mem_total += g.memory_mib;
                v.mem_allocated += g.mem_used;
                if g.mem_used > 0 {
                    v.mem_stranded += g.memory_mib.saturating_sub(g.mem_used);
                }
                row.mem_cap += g.memory_mib;
                row.core_used += u64::from(g.core_used);
                row.core_cap += u64::from(CORE_MILLI_PER_GPU);
                v.gpus.push(GpuRow {
                    node: i as u32,
                    index: g.index,
                    mem_used: g.mem_used,
                    healthy: g.healthy,
                });
            }
            v.nodes.push(row);
        }
        v.namespaces = namespaces(l, now_ms);
        v
    }
}

/// Every namespace with a budget of its own, a quota or any consumption, at `now_ms`.
fn namespaces(l: &Ledger, now_ms: i64) -> Vec<NsRow> {
    let b = l.budgets();
    let names: std::collections::BTreeSet<&String> = b
        .budgets()
        .keys()
        .chain(b.quotas().keys())
        .chain(b.usage().keys())
        .filter(|n| !n.is_empty())
        .collect();
    names
        .into_iter()
        .map(|ns| {
            let (held_mib, held_core) = b.held(ns);
            let budget = b.status(ns, now_ms).map(|s| {
                let core = s.budget.unit == pb::BudgetUnit::GpuCoreHours as i32;
                let per = MS_PER_HOUR as f64 * if core { 1000.0 } else { 1.0 };
                let secs = |ms: i64| ms as f64 / 1000.0;
                BudgetRow {
                    unit: if core { "gpu" } else { "gpu_mib" },
                    amount: s.limit as f64 / per,
                    used: s.used as f64 / per,
                    remaining: s.remaining() as f64 / per,
                    burn_per_hour: s.rate as f64 * MS_PER_HOUR as f64 / per,
                    exhausted: s.exhausted(),
                    exhausts_at_s: s.exhausts_at_ms.map(secs),
                    recovers_at_s: s.recovers_at_ms.map(secs),
                }
            });
            NsRow {
                name: ns.clone(),
                held_mib,
                held_core,
                quota_mib: b.quotas().get(ns).map(|q| q.mem_mib),
                budget,
            }
        })
        .collect()
}

/// Encodes the ledger's view at scrape time (see the module docs for why).
#[derive(Debug)]
struct LedgerCollector {
    view: View,
    events: [u64; EVENT_TYPES.len()],
    /// How often each limit on callers refused something.
    limited: Vec<(&'static str, u64)>,
}

impl LedgerCollector {
    fn gauge(
        enc: &mut DescriptorEncoder<'_>,
        name: &str,
        help: &str,
        value: u64,
    ) -> Result<(), std::fmt::Error> {
        let mut m = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
        m.encode_gauge(&value)
    }
}

impl Collector for LedgerCollector {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let v = &self.view;
        Self::gauge(
            &mut enc,
            "ledger_seq",
            "Highest ledger seq folded by this replica",
            v.seq,
        )?;
        Self::gauge(
            &mut enc,
            "ledger_epoch",
            "Epoch of the current leader as known here",
            v.epoch,
        )?;
        Self::gauge(
            &mut enc,
            "is_leader",
            "1 when this replica is the leader",
            u64::from(v.leader),
        )?;
        Self::gauge(
            &mut enc,
            "ready",
            "1 when this replica can serve (etcd reachable, caught up, leader known), as /readyz",
            u64::from(v.ready),
        )?;
        {
            let mut m = enc.encode_descriptor(
                "events",
                "Ledger events folded by this replica, by type",
                None,
                MetricType::Counter,
            )?;
            for (t, n) in EVENT_TYPES.iter().zip(self.events) {
                if *t == "empty" && n == 0 {
                    continue;
                }
                ConstCounter::new(n).encode(m.encode_family(&[("type", *t)])?)?;
            }
        }
        {
            let mut m = enc.encode_descriptor(
                "allocations",
                "Live allocations (reservations) by state",
                None,
                MetricType::Gauge,
            )?;
            for (s, n) in ["reserved", "bound", "assigned"].iter().zip(v.by_state) {
                m.encode_family(&[("state", *s)])?.encode_gauge(&n)?;
            }
        }
        {
            let m = enc.encode_descriptor(
                "limit_violations",
                "LimitViolated events in the ledger this replica folded (since its last snapshot load)",
                None,
                MetricType::Counter,
            )?;
            ConstCounter::new(v.violations).encode(m)?;
        }
        Self::gauge(
            &mut enc,
            "cluster_gpu_memory_capacity_mib",
            "GPU memory of every GPU in the ledger",
            v.mem_total,
        )?;
        Self::gauge(
            &mut enc,
            "cluster_gpu_memory_allocated_mib",
            "GPU memory allocated on every GPU in the ledger",
            v.mem_allocated,
        )?;
        Self::gauge(
            &mut enc,
            "cluster_gpu_memory_stranded_mib",
            "Free GPU memory on GPUs already partly allocated: what a whole-GPU pod cannot use",
            v.mem_stranded,
        )?;
        Self::gauge(
            &mut enc,
            "nodes",
            "Nodes registered in the ledger",
            v.nodes.len() as u64,
        )?;
        Self::gauge(
            &mut enc,
            "gpus",
            "GPUs registered in the ledger",
            v.gpus.len() as u64,
        )?;
        Self::gauge(
            &mut enc,
            "gpus_unhealthy",
            "GPUs marked unhealthy (no new grants land on them)",
            v.gpus.iter().filter(|g| !g.healthy).count() as u64,
        )?;
        {
            let mut m = enc.encode_descriptor(
                "node_gpu_memory_capacity_mib",
                "GPU memory of a node, all its GPUs together",
                None,
                MetricType::Gauge,
            )?;
            for n in &v.nodes {
                m.encode_family(&[("node", n.name.as_str())])?
                    .encode_gauge(&n.mem_cap)?;
            }
        }
        {
            let mut m = enc.encode_descriptor(
                "node_gpu_core_allocated_permille",
                "GPU compute allocated on a node, in thousandths of a GPU",
                None,
                MetricType::Gauge,
            )?;
            for n in &v.nodes {
                m.encode_family(&[("node", n.name.as_str())])?
                    .encode_gauge(&n.core_used)?;
            }
        }
        {
            let mut m = enc.encode_descriptor(
                "node_gpu_core_capacity_permille",
                "GPU compute of a node, in thousandths of a GPU (1000 per GPU)",
                None,
                MetricType::Gauge,
            )?;
            for n in &v.nodes {
                m.encode_family(&[("node", n.name.as_str())])?
                    .encode_gauge(&n.core_cap)?;
            }
        }
        {
            let mut m = enc.encode_descriptor(
                "gpu_memory_allocated_mib",
                "GPU memory allocated per node and GPU index",
                None,
                MetricType::Gauge,
            )?;
            for g in &v.gpus {
                let node = v.nodes[g.node as usize].name.as_str();
                m.encode_family(&([("node", node)], [("gpu", g.index)]))?
                    .encode_gauge(&g.mem_used)?;
            }
        }
        {
            let mut m = enc.encode_descriptor(
                "gpu_unhealthy",
                "1 for each GPU marked unhealthy; healthy GPUs have no series",
                None,
                MetricType::Gauge,
            )?;
            for g in v.gpus.iter().filter(|g| !g.healthy) {
                let node = v.nodes[g.node as usize].name.as_str();
                m.encode_family(&([("node", node)], [("gpu", g.index)]))?
                    .encode_gauge(&1u32)?;
            }
        }
        encode_namespaces(&mut enc, &v.namespaces)?;
        {
            let mut m = enc.encode_descriptor(
                "limited",
                "Connections, handshakes, requests, streams or token reviews a limit on callers refused, by limit",
                None,
                MetricType::Counter,
            )?;
            for (limit, n) in &self.limited {
                ConstCounter::new(*n).encode(m.encode_family(&[("limit", *limit)])?)?;
            }
        }
        Ok(())
    }
}

/// Per-namespace families: holdings and quota for every namespace, budget figures for those a
/// budget applies to (labelled with its unit: `gpu_mib` = GPU-MiB-hours, `gpu` = GPU-hours).
fn encode_namespaces(
    enc: &mut DescriptorEncoder<'_>,
    rows: &[NsRow],
) -> Result<(), std::fmt::Error> {
    type Get = fn(&NsRow) -> Option<f64>;
    let plain: [(&str, &str, Get); 3] = [
        (
            "namespace_gpu_memory_held_mib",
            "GPU memory a namespace holds now",
            |r| Some(r.held_mib as f64),
        ),
        (
            "namespace_gpu_core_held_permille",
            "GPU compute a namespace holds now, in thousandths of a GPU",
            |r| Some(r.held_core as f64),
        ),
        (
            "namespace_gpu_memory_quota_mib",
            "A namespace's cap on GPU memory held at once (no series: no quota)",
            |r| r.quota_mib.filter(|q| *q > 0).map(|q| q as f64),
        ),
    ];
    for (name, help, get) in plain {
        let mut m = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
        for r in rows {
            if let Some(x) = get(r) {
                m.encode_family(&[("namespace", r.name.as_str())])?
                    .encode_gauge(&x)?;
            }
        }
    }
    type GetB = fn(&BudgetRow) -> Option<f64>;
    let budget: [(&str, &str, GetB); 7] = [
        (
            "namespace_budget_hours",
            "A namespace's budget per window, in unit-hours",
            |b| Some(b.amount),
        ),
        (
            "namespace_budget_used_hours",
            "Consumed inside the current window, in unit-hours",
            |b| Some(b.used),
        ),
        (
            "namespace_budget_remaining_hours",
            "Left in the current window, in unit-hours",
            |b| Some(b.remaining),
        ),
        (
            "namespace_budget_burn_rate",
            "Unit-hours consumed per hour at the current holdings",
            |b| Some(b.burn_per_hour),
        ),
        (
            "namespace_budget_exhausted",
            "1 when the namespace's budget is spent",
            |b| Some(if b.exhausted { 1.0 } else { 0.0 }),
        ),
        (
            "namespace_budget_exhaustion_timestamp_seconds",
            "When the budget is spent at the current rate (no series: not being spent)",
            |b| b.exhausts_at_s,
        ),
        (
            "namespace_budget_recovery_timestamp_seconds",
            "When a spent budget is within its amount again (no series: not spent, or not while its pods hold what they do)",
            |b| b.recovers_at_s,
        ),
    ];
    for (name, help, get) in budget {
        let mut m = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
        for r in rows {
            if let Some(x) = r.budget.as_ref().and_then(|b| get(b).map(|x| (b.unit, x))) {
                m.encode_family(&[("namespace", r.name.as_str()), ("unit", x.0)])?
                    .encode_gauge(&x.1)?;
            }
        }
    }
    Ok(())
}
