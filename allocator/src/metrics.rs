//! The metrics only the hot path can observe (commit latency, batch size, events by type,
//! leaderships), kept up to date as things happen. The view of the ledger is encoded at
//! scrape time by `http::metrics`, which renders both.

use std::sync::atomic::{AtomicU64, Ordering};

use gpuledger_ledger::pb::event::Body;
use prometheus_client::encoding::text::{encode_eof, encode_registry};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// Prefix of every metric name.
pub(crate) const PREFIX: &str = "gpuledger_allocator";

/// Ledger event types, in the order of [`Metrics`]' per-type counters.
pub(crate) const EVENT_TYPES: [&str; 21] = [
    "node_registered",
    "node_removed",
    "device_health_changed",
    "reserved",
    "bound",
    "assigned",
    "identity_corrected",
    "released",
    "limit_violated",
    "leader_elected",
    "quota_set",
    "budget_set",
    "budget_removed",
    "nominated",
    "nomination_ended",
    "claim_granted",
    "claim_refused",
    "claim_prepared",
    "claim_unprepared",
    "claim_consumers_changed",
    "empty",
];

/// The metrics the allocator keeps between scrapes; the rest is read from the ledger.
pub struct Metrics {
    registry: Registry,
    /// Seconds from sending a batch's transaction to its commit.
    pub commit_latency: Histogram,
    /// Events per committed batch.
    pub batch_events: Histogram,
    /// Times this replica became leader.
    pub leaderships: Counter,
    /// Committed batches this replica refused to fold because they do not chain.
    pub chain_breaks: Counter,
    /// 1 while etcd's NOSPACE alarm is raised (it refuses every write), else 0.
    pub etcd_nospace: Gauge,
    /// Ledger batches etcd refused for want of space.
    pub nospace_refusals: Counter,
    /// Leaderships that ended before their first write (a `head` that does not match the log,
    /// etcd refusing the takeover): the replica backs off before campaigning again.
    pub failed_takeovers: Counter,
    /// Writes refused by a limit of this replica, by limit.
    pub writes_refused: Family<Vec<(&'static str, String)>, Counter>,
    /// Calls refused by the authorization table, by rule and caller role.
    denied: Family<Vec<(&'static str, String)>, Counter>,
    /// `Preempt` calls by outcome.
    pub(crate) preemptions: Family<Vec<(&'static str, &'static str)>, Counter>,
    /// Evictions of preemption victims by outcome.
    pub(crate) evictions: Family<Vec<(&'static str, &'static str)>, Counter>,
    /// Events folded, by type (index into [`EVENT_TYPES`]): a fixed array, so counting an
    /// event in the fold neither allocates nor hashes.
    events: [AtomicU64; EVENT_TYPES.len()],
    /// ResourceClaim results certified, by outcome (granted, refused) and condition reason.
    pub(crate) claims_certified: Family<Vec<(&'static str, &'static str)>, Counter>,
    /// Claim grants released, by reason.
    pub(crate) claim_releases: Family<Vec<(&'static str, &'static str)>, Counter>,
    /// Claim events dropped because `--claim-queue` was full.
    pub(crate) claim_queue_full: Counter,
    /// Pending GPU pods requeued in kube-scheduler because the ledger freed room, by outcome.
    pub(crate) pods_requeued: Family<Vec<(&'static str, &'static str)>, Counter>,
    /// ResourceClaimTemplates of converted pods, by outcome.
    pub(crate) claim_templates: Family<Vec<(&'static str, &'static str)>, Counter>,
    /// Claims waiting for the certification.
    pub(crate) claim_queue_depth: Gauge,
    /// Condition writes to a claim's status that failed (retried at the next event or pass).
    pub(crate) claim_status_failures: Counter,
    /// `ReadLog` scans in flight (`--max-log-scans` bounds those of operators).
    pub(crate) log_scans: Gauge,
    /// How often each limit on callers refused something (`limited_total{limit}`).
    pub bites: std::sync::Arc<gpuledger_auth::limit::Bites>,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix(PREFIX);
        let commit_latency = Histogram::new(exponential_buckets(0.0005, 2.0, 14));
        let batch_events = Histogram::new(exponential_buckets(1.0, 2.0, 9));
        let leaderships = Counter::default();
        registry.register(
            "commit_latency_seconds",
            "Time from sending a batch to etcd to its commit",
            commit_latency.clone(),
        );
        registry.register(
            "batch_events",
            "Events per committed batch",
            batch_events.clone(),
        );
        registry.register(
            "leaderships",
            "Times this replica became the leader (failovers it took over)",
            leaderships.clone(),
        );
        let chain_breaks = Counter::default();
        registry.register(
            "chain_breaks",
            "Batches refused because their prev_hash does not chain (the log was changed; this replica stops folding)",
            chain_breaks.clone(),
        );
        let etcd_nospace = Gauge::default();
        registry.register(
            "etcd_nospace",
            "1 while etcd's NOSPACE alarm is raised and it refuses every write (recover: compact, defragment, disarm; see gpuledger status)",
            etcd_nospace.clone(),
        );
        let nospace_refusals = Counter::default();
        registry.register(
            "etcd_nospace_refusals",
            "Ledger batches etcd refused because its space quota is used up (NOSPACE)",
            nospace_refusals.clone(),
        );
        let failed_takeovers = Counter::default();
        registry.register(
            "failed_takeovers",
            "Leaderships that ended before their first write (head does not match the log, or etcd refused it); the replica backs off before campaigning again",
            failed_takeovers.clone(),
        );
        let writes_refused = Family::<Vec<(&'static str, String)>, Counter>::default();
        registry.register(
            "writes_refused",
            "Writes refused by a limit of this replica (node_write_rate, gpus_per_node, gpu_memory), by limit",
            writes_refused.clone(),
        );
        let denied = Family::<Vec<(&'static str, String)>, Counter>::default();
        registry.register(
            "calls_denied",
            "Calls refused by the authorization table, by the rule that refused and the caller's role",
            denied.clone(),
        );
        let preemptions = Family::<Vec<(&'static str, &'static str)>, Counter>::default();
        registry.register(
            "preemptions",
            "Preempt calls by outcome: nominated, repeat (the nomination was live), none (no eviction helps), refused, busy (--max-preemptions-in-flight)",
            preemptions.clone(),
        );
        let evictions = Family::<Vec<(&'static str, &'static str)>, Counter>::default();
        registry.register(
            "evictions",
            "Evictions of preemption victims by outcome: evicted, gone, refused (a PodDisruptionBudget), failed",
            evictions.clone(),
        );
        let claims_certified = Family::<Vec<(&'static str, &'static str)>, Counter>::default();
        registry.register(
            "claims_certified",
            "ResourceClaim results certified: outcome granted (gpuledger.io/Granted written after the grant committed) or refused (gpuledger.io/Refused), by condition reason",
            claims_certified.clone(),
        );
        let claim_releases = Family::<Vec<(&'static str, &'static str)>, Counter>::default();
        registry.register(
            "claim_releases",
            "Claim grants released because their claim was deallocated or deleted, by reason",
            claim_releases.clone(),
        );
        let claim_templates = Family::<Vec<(&'static str, &'static str)>, Counter>::default();
        registry.register(
            "claim_templates",
            "ResourceClaimTemplates of pods the webhook converted to the DRA path, by outcome: created (for a pod that exists), refused (the pod's requests do not make the template it claims, or a different one of that name exists), collected (no pod claims it), failed (an API error; retried)",
            claim_templates.clone(),
        );
        let pods_requeued = Family::<Vec<(&'static str, &'static str)>, Counter>::default();
        registry.register(
            "pods_requeued",
            "Pending GPU pods kube-scheduler had found unschedulable, given the status condition gpuledger.io/RoomFreed when the ledger freed room so that kube-scheduler retries them after their backoff, by outcome: requeued, failed (an API error; the next freed room tries again)",
            pods_requeued.clone(),
        );
        let claim_queue_full = Counter::default();
        registry.register(
            "claim_queue_full",
            "ResourceClaim events dropped because --claim-queue was full (the next --claim-reconcile-interval pass picks them up)",
            claim_queue_full.clone(),
        );
        let claim_queue_depth = Gauge::default();
        registry.register(
            "claim_queue_depth",
            "ResourceClaims waiting for the certification",
            claim_queue_depth.clone(),
        );
        let claim_status_failures = Counter::default();
        registry.register(
            "claim_status_failures",
            "Writes of a gpuledger condition to a ResourceClaim's status that failed (retried at its next event or pass)",
            claim_status_failures.clone(),
        );
        let log_scans = Gauge::default();
        registry.register(
            "log_scans",
            "ReadLog scans in flight (those of operators bounded by --max-log-scans)",
            log_scans.clone(),
        );
        Metrics {
            registry,
            log_scans,
            claims_certified,
            claim_releases,
            claim_templates,
            claim_queue_full,
            pods_requeued,
            claim_queue_depth,
            claim_status_failures,
            commit_latency,
            batch_events,
            leaderships,
            chain_breaks,
            etcd_nospace,
            nospace_refusals,
            failed_takeovers,
            writes_refused,
            denied,
            preemptions,
            evictions,
            events: Default::default(),
            bites: gpuledger_auth::limit::Bites::new(),
        }
    }
}

impl Metrics {
    /// Count a folded event.
    pub fn event(&self, body: Option<&Body>) {
        let i = match body {
            Some(Body::NodeRegistered(_)) => 0,
            Some(Body::NodeRemoved(_)) => 1,
            Some(Body::DeviceHealthChanged(_)) => 2,
            Some(Body::Reserved(_)) => 3,
            Some(Body::Bound(_)) => 4,
            Some(Body::Assigned(_)) => 5,
            Some(Body::IdentityCorrected(_)) => 6,
            Some(Body::Released(_)) => 7,
            Some(Body::LimitViolated(_)) => 8,
            Some(Body::LeaderElected(_)) => 9,
            Some(Body::QuotaSet(_)) => 10,
            Some(Body::BudgetSet(_)) => 11,
            Some(Body::BudgetRemoved(_)) => 12,
            Some(Body::Nominated(_)) => 13,
            Some(Body::NominationEnded(_)) => 14,
            Some(Body::ClaimGranted(_)) => 15,
            Some(Body::ClaimRefused(_)) => 16,
            Some(Body::ClaimPrepared(_)) => 17,
            Some(Body::ClaimUnprepared(_)) => 18,
            Some(Body::ClaimConsumersChanged(_)) => 19,
            None => 20,
        };
        self.events[i].fetch_add(1, Ordering::Relaxed);
    }

    /// Count a call refused by `rule` from a caller in `role`.
    pub fn denied(&self, rule: &str, role: &str) {
        self.denied
            .get_or_create(&vec![
                ("rule", rule.to_string()),
                ("role", role.to_string()),
            ])
            .inc();
    }

    /// Count a write refused by `limit`.
    pub fn refused(&self, limit: &str) {
        self.writes_refused
            .get_or_create(&vec![("limit", limit.to_string())])
            .inc();
    }

    /// Events folded so far, by type (in the order of [`EVENT_TYPES`]).
    pub(crate) fn event_counts(&self) -> [u64; EVENT_TYPES.len()] {
        std::array::from_fn(|i| self.events[i].load(Ordering::Relaxed))
    }

    /// These metrics and then `per_scrape`'s, in the OpenMetrics text format.
    pub(crate) fn encode_with(&self, per_scrape: &Registry) -> String {
        let mut out = String::with_capacity(1 << 16);
        let res = encode_registry(&mut out, &self.registry)
            .and_then(|()| encode_registry(&mut out, per_scrape))
            .and_then(|()| encode_eof(&mut out));
        if res.is_err() {
            // Writing to a String cannot fail; an encoder error would be a bug in a label set.
            out.clear();
        }
        out
    }
}
