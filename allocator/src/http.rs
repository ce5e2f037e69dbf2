//! The allocator's HTTP side: `/metrics` (Prometheus text), `/healthz`, `/readyz`.
//!
//! `/healthz` answers while the process runs. `/readyz` answers 200 only when this replica can
//! serve: etcd reachable, the ledger loaded and caught up with `head`, and a leader known.

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::shared::{Role, Shared};

type Labels = Vec<(&'static str, String)>;

/// Every metric the allocator exports (`gpuledger_allocator_*`).
pub struct Metrics {
    registry: Registry,
    seq: Gauge,
    epoch: Gauge,
    leader: Gauge,
    /// Seconds from sending a batch's transaction to its commit.
    pub commit_latency: Histogram,
    /// Events per committed batch.
    pub batch_events: Histogram,
    /// Events folded, by type.
    pub events: Family<Labels, Counter>,
    /// Times this replica became leader.
    pub leaderships: Counter,
    allocations: Family<Labels, Gauge>,
    gpu_mem_alloc: Family<Labels, Gauge>,
    gpu_mem_cap: Family<Labels, Gauge>,
    gpu_core_alloc: Family<Labels, Gauge>,
    gpu_healthy: Family<Labels, Gauge>,
    violations: Gauge,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("gpuledger_allocator");
        let m = Metrics {
            seq: Gauge::default(),
            epoch: Gauge::default(),
            leader: Gauge::default(),
            commit_latency: Histogram::new(exponential_buckets(0.0005, 2.0, 14)),
            batch_events: Histogram::new(exponential_buckets(1.0, 2.0, 9)),
            events: Family::default(),
            leaderships: Counter::default(),
            allocations: Family::default(),
            gpu_mem_alloc: Family::default(),
            gpu_mem_cap: Family::default(),
            gpu_core_alloc: Family::default(),
            gpu_healthy: Family::default(),
            violations: Gauge::default(),
            registry: Registry::default(),
        };
        registry.register(
            "ledger_seq",
            "Highest ledger seq folded by this replica",
            m.seq.clone(),
        );
        registry.register(
            "ledger_epoch",
            "Epoch of the current leader as known here",
            m.epoch.clone(),
        );
        registry.register(
            "is_leader",
            "1 when this replica is the leader",
            m.leader.clone(),
        );
        registry.register(
            "commit_latency_seconds",
            "Time from sending a batch to etcd to its commit",
            m.commit_latency.clone(),
        );
        registry.register(
            "batch_events",
            "Events per committed batch",
            m.batch_events.clone(),
        );
        registry.register("events", "Ledger events folded, by type", m.events.clone());
        registry.register(
            "leaderships",
            "Times this replica became the leader",
            m.leaderships.clone(),
        );
        registry.register(
            "allocations",
            "Live allocations by state",
            m.allocations.clone(),
        );
        registry.register(
            "gpu_memory_allocated_mib",
            "GPU memory allocated per node and GPU",
            m.gpu_mem_alloc.clone(),
        );
        registry.register(
            "gpu_memory_capacity_mib",
            "GPU memory capacity per node and GPU",
            m.gpu_mem_cap.clone(),
        );
        registry.register(
            "gpu_core_allocated_permille",
            "GPU compute allocated per node and GPU, in thousandths",
            m.gpu_core_alloc.clone(),
        );
        registry.register(
            "gpu_healthy",
            "1 when the GPU is healthy",
            m.gpu_healthy.clone(),
        );
        registry.register(
            "limit_violations",
            "LimitViolated events folded since the last snapshot load",
            m.violations.clone(),
        );
        Metrics { registry, ..m }
    }
}

impl Metrics {
    /// Count a folded event.
    pub fn event(&self, body: Option<&gpuledger_ledger::pb::event::Body>) {
        use gpuledger_ledger::pb::event::Body;
        let t = match body {
            Some(Body::NodeRegistered(_)) => "node_registered",
            Some(Body::NodeRemoved(_)) => "node_removed",
            Some(Body::DeviceHealthChanged(_)) => "device_health_changed",
            Some(Body::Reserved(_)) => "reserved",
            Some(Body::Bound(_)) => "bound",
            Some(Body::Assigned(_)) => "assigned",
            Some(Body::IdentityCorrected(_)) => "identity_corrected",
            Some(Body::Released(_)) => "released",
            Some(Body::LimitViolated(_)) => "limit_violated",
            Some(Body::LeaderElected(_)) => "leader_elected",
            Some(Body::QuotaSet(_)) => "quota_set",
            None => "empty",
        };
        self.events
            .get_or_create(&vec![("type", t.to_string())])
            .inc();
    }

    /// Refresh the gauges from the state and render the text format.
    pub fn render(&self, shared: &Shared) -> String {
        let role = shared.role_info();
        self.epoch.set(role.epoch as i64);
        self.leader.set(i64::from(role.role == Role::Leader));
        self.allocations.clear();
        self.gpu_mem_alloc.clear();
        self.gpu_mem_cap.clear();
        self.gpu_core_alloc.clear();
        self.gpu_healthy.clear();
        shared.read(|l| {
            self.seq.set(l.seq() as i64);
            self.violations.set(l.violations() as i64);
            for s in ["reserved", "bound", "assigned"] {
                self.allocations
                    .get_or_create(&vec![("state", s.to_string())])
                    .set(0);
            }
            for a in l.allocs().values() {
                self.allocations
                    .get_or_create(&vec![("state", a.state.as_str().to_string())])
                    .inc();
            }
            for n in l.nodes().values() {
                for g in &n.gpus {
                    let labels = vec![("node", n.name.clone()), ("gpu", g.uuid.clone())];
                    self.gpu_mem_alloc
                        .get_or_create(&labels)
                        .set(g.mem_used as i64);
                    self.gpu_mem_cap
                        .get_or_create(&labels)
                        .set(g.memory_mib as i64);
                    self.gpu_core_alloc
                        .get_or_create(&labels)
                        .set(i64::from(g.core_used));
                    self.gpu_healthy
                        .get_or_create(&labels)
                        .set(i64::from(g.healthy));
                }
            }
        });
        let mut out = String::new();
        if encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

/// Whether this replica is ready to serve (and why not).
pub fn readiness(shared: &Shared) -> Result<(), String> {
    shared.serving()?;
    let role = shared.role_info();
    if role.role != Role::Leader && role.leader.is_empty() {
        return Err("no allocator leader is elected right now".into());
    }
    let head = shared
        .health
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .head_seq;
    let seq = shared.read(|l| l.seq());
    if seq < head {
        return Err(format!(
            "catching up with the ledger: at seq {seq}, head is {head}"
        ));
    }
    Ok(())
}

/// The HTTP router.
pub fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route(
            "/readyz",
            get(|State(s): State<Arc<Shared>>| async move {
                match readiness(&s) {
                    Ok(()) => (StatusCode::OK, "ready\n".to_string()),
                    Err(why) => (
                        StatusCode::SERVICE_UNAVAILABLE,
                        format!("not ready: {why}\n"),
                    ),
                }
            }),
        )
        .route(
            "/metrics",
            get(|State(s): State<Arc<Shared>>| async move {
                let body = s.metrics.render(&s);
                (
                    [(
                        header::CONTENT_TYPE,
                        "text/plain; version=0.0.4; charset=utf-8",
                    )],
                    body,
                )
                    .into_response()
            }),
        )
        .with_state(shared)
}
