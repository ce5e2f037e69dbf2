//! Preemption asked from `filter`, which works with every kube-scheduler.
//!
//! kube-scheduler calls an extender's `preempt` verb only for nodes where its own dry run
//! found victims; when only GPU memory or compute (`ignoredByScheduler`) is short, the dry run
//! reprieves every pod and the verb is never called (kubernetes#139270). So when `filter` sees
//! that a pod fits on none of the scheduler's nodes for want of GPU room, and the pod may
//! preempt (its `preemptionPolicy` is not `Never`), it asks the allocator leader to preempt for
//! it (`Preempt`), off the scheduler's path: the leader chooses and evicts the victims and
//! keeps the room for the pod, and the victims' deletion makes the scheduler try the pod
//! again. The scheduler retries filter often; a pod is asked for at most once per
//! `--preempt-retry-ms`, and not while its nomination is live.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpuledger_proto::allocator::v1 as api;
use k8s_openapi::api::core::v1::Pod;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use tokio_util::task::TaskTracker;
use tonic::Code;
use tracing::{Instrument, debug, info, info_span, warn};

use crate::allocator::Allocators;

/// Pods remembered at once for the rate limit; beyond, the oldest answers are forgotten and,
/// if all are recent, a new pod is not asked for (`outcome="throttled"`).
const MAX_PODS: usize = 4096;

/// The allocator considers at most this many candidate nodes per preemption.
pub const MAX_NODES: usize = 512;

type Labels = Vec<(&'static str, &'static str)>;

/// Which pods were asked for lately, and what came of it.
pub struct Preemption {
    every: Duration,
    asked: Mutex<HashMap<String, Instant>>,
    outcomes: Family<Labels, Counter>,
}

impl Preemption {
    /// Ask for a pod at most once per `every`; zero never asks (GPU slices are then preempted
    /// only by a scheduler that calls the `preempt` verb).
    pub fn new(every: Duration) -> Arc<Preemption> {
        Arc::new(Preemption {
            every,
            asked: Mutex::new(HashMap::new()),
            outcomes: Family::default(),
        })
    }

    /// Export `gpuledger_extender_preemptions_requested_total{outcome}`.
    pub fn register(&self, r: &mut Registry) {
        r.register(
            "preemptions_requested",
            "Preemptions asked of the allocator by filter, by outcome: nominated, repeat (already nominated), none (no eviction helps), refused, busy, error, throttled (--preempt-retry-ms)",
            self.outcomes.clone(),
        );
    }

    fn count(&self, outcome: &'static str) {
        self.outcomes
            .get_or_create(&vec![("outcome", outcome)])
            .inc();
    }

    /// Whether `pod` may preempt others at all (`spec.preemptionPolicy` is not `Never`).
    pub fn may_preempt(pod: &Pod) -> bool {
        pod.spec
            .as_ref()
            .and_then(|s| s.preemption_policy.as_deref())
            != Some("Never")
    }

    /// Whether `uid` may be asked for now; if so, it counts as asked from now on.
    fn admit(&self, uid: &str, now: Instant) -> bool {
        if self.every.is_zero() {
            return false;
        }
        let mut m = self.asked.lock().unwrap_or_else(|p| p.into_inner());
        if m.get(uid)
            .is_some_and(|t| now.duration_since(*t) < self.every)
        {
            return false;
        }
        if m.len() >= MAX_PODS && !m.contains_key(uid) {
            let every = self.every;
            m.retain(|_, t| now.duration_since(*t) < every);
            if m.len() >= MAX_PODS {
                return false;
            }
        }
        m.insert(uid.to_string(), now);
        true
    }

    /// Ask the allocator leader to preempt for `request` on `nodes` (the scheduler's nodes
    /// where only GPU room is missing), in a task of `tasks`, unless the pod was asked for
    /// within `--preempt-retry-ms`.
    pub fn ask(
        self: &Arc<Self>,
        allocators: &Allocators,
        tasks: &TaskTracker,
        request: api::PodRequest,
        mut nodes: Vec<String>,
    ) {
        let Some(pod) = request.pod.clone() else {
            return;
        };
        if self.every.is_zero() {
            return;
        }
        if !self.admit(&pod.uid, Instant::now()) {
            self.count("throttled");
            return;
        }
        nodes.truncate(MAX_NODES);
        let (me, allocators) = (self.clone(), allocators.clone());
        let span = info_span!("preempt_on_filter", pod_uid = %pod.uid, pod = %format!("{}/{}", pod.namespace, pod.name));
        tasks.spawn(
            async move {
                let req = api::PreemptRequest {
                    request: Some(request),
                    nodes,
                };
                let res = allocators
                    .call("Preempt", |mut c| {
                        let req = req.clone();
                        async move { c.preempt(req).await }
                    })
                    .await;
                match res {
                    Ok(r) => match &r.nomination {
                        Some(n) => {
                            me.count(if r.created { "nominated" } else { "repeat" });
                            info!(node = %n.node, victims = n.victims.len(), created = r.created, "preemption: the pod is nominated");
                        }
                        None => {
                            me.count("none");
                            debug!(why = %r.reason, "preemption: no eviction helps");
                        }
                    },
                    Err(s)
                        if matches!(
                            s.code(),
                            Code::FailedPrecondition
                                | Code::PermissionDenied
                                | Code::NotFound
                                | Code::AlreadyExists
                        ) =>
                    {
                        me.count("refused");
                        debug!(error = %s.message(), "preemption refused");
                    }
                    // The allocator's bound, or the room went to another nomination first.
                    Err(s) if s.code() == Code::ResourceExhausted => {
                        me.count("busy");
                        debug!(error = %s.message(), "preemption deferred; the pod's next filter asks again");
                    }
                    Err(s) => {
                        me.count("error");
                        warn!(error = %s.message(), "preemption failed; the pod's next filter asks again");
                    }
                }
            }
            .instrument(span),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pod_is_asked_for_once_per_interval_and_never_when_off() {
        let p = Preemption::new(Duration::from_secs(5));
        let t0 = Instant::now();
        assert!(p.admit("a", t0));
        assert!(!p.admit("a", t0 + Duration::from_secs(4)));
        assert!(p.admit("b", t0 + Duration::from_secs(4)));
        assert!(p.admit("a", t0 + Duration::from_secs(5)));
        let off = Preemption::new(Duration::ZERO);
        assert!(!off.admit("a", t0));
    }

    #[test]
    fn the_rate_limit_stays_bounded() {
        let p = Preemption::new(Duration::from_secs(5));
        let t0 = Instant::now();
        for i in 0..MAX_PODS {
            assert!(p.admit(&format!("pod-{i}"), t0));
        }
        // All recent: a new pod waits rather than growing the map.
        assert!(!p.admit("one-more", t0 + Duration::from_secs(1)));
        // Once they are old, they make room.
        assert!(p.admit("one-more", t0 + Duration::from_secs(6)));
        assert!(p.asked.lock().unwrap().len() <= MAX_PODS);
    }

    #[test]
    fn never_is_the_only_policy_that_forbids_preempting() {
        let pod = |policy: Option<&str>| -> Pod {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "p"},
                "spec": {"containers": [], "preemptionPolicy": policy},
            }))
            .unwrap()
        };
        assert!(Preemption::may_preempt(&pod(None)));
        assert!(Preemption::may_preempt(&pod(Some("PreemptLowerPriority"))));
        assert!(!Preemption::may_preempt(&pod(Some("Never"))));
    }
}
