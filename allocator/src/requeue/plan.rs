//! Which pending pods to requeue, and when: pure decisions over the pod watch and the ledger's
//! committed events.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use gpuledger_ledger::pb;
use k8s_openapi::api::core::v1::{Pod, PodCondition};

/// The condition the leader sets in a pending GPU pod's status when the ledger may have room
/// for it again (its message names the ledger seq that freed it). kube-scheduler takes any
/// update of an unschedulable pod that no in-tree plugin rejected (the extender did) as a
/// reason to retry it after its backoff. A status condition, not an annotation: the allocator
/// may patch pods' status only, never their spec.
pub const ROOM_FREED: &str = gpuledger_request::ROOM_FREED;

/// Whether a committed event can make room for a pending pod: a release, a node (re)registered
/// or a device back to health, a nomination ended, a quota or budget raised or removed.
pub fn frees_room(ev: &pb::Event) -> bool {
    use pb::event::Body;
    matches!(
        ev.body,
        Some(
            Body::Released(_)
                | Body::NodeRegistered(_)
                | Body::DeviceHealthChanged(_)
                | Body::NominationEnded(_)
                | Body::QuotaSet(_)
                | Body::BudgetSet(_)
                | Body::BudgetRemoved(_)
        )
    )
}

/// A pod that waits for GPU room: not bound, not being deleted, asking GPU slices (on the
/// device-plugin path, or through claims: the DRA marker), and last found unschedulable by
/// kube-scheduler.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Waiting {
    /// Namespace.
    pub ns: String,
    /// Name.
    pub name: String,
    /// UID.
    pub uid: String,
    /// When kube-scheduler last found it unschedulable (RFC 3339 text, sorts by time).
    pub since: String,
}

/// The `PodScheduled` condition of `pod` when kube-scheduler last found it unschedulable.
pub fn unschedulable(pod: &Pod) -> Option<&PodCondition> {
    pod.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "PodScheduled")
        .filter(|c| c.status == "False" && c.reason.as_deref() == Some("Unschedulable"))
}

/// `pod` when it waits for GPU room ([`Waiting`]).
pub fn waiting(pod: &Pod) -> Option<Waiting> {
    let spec = pod.spec.as_ref()?;
    if spec.node_name.is_some() || pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
    // The cheap test first: every pod of the watch is looked at on each pass.
    let unschedulable = unschedulable(pod)?;
    // A DRA pod (the marker) is requeued by kube-scheduler itself when claims change, but
    // that retry can come before the leader released the grant of the claim that went, and
    // the extender then refuses it as it refuses a device-plugin pod (a preemptor whose
    // victims just left, say): it waits for room like one.
    if !gpuledger_request::has_dra_marker(pod)
        && gpuledger_request::containers(pod).map_or(true, |c| c.is_empty())
    {
        return None;
    }
    Some(Waiting {
        ns: pod.metadata.namespace.clone()?,
        name: pod.metadata.name.clone()?,
        uid: pod.metadata.uid.clone()?,
        since: unschedulable
            .last_transition_time
            .as_ref()
            .map(|t| t.0.to_string())
            .unwrap_or_default(),
    })
}

/// The pods to requeue now, at most `max`, those waiting longest first; a pod requeued less
/// than `gap` ago is left until later (kube-scheduler retries it anyway, after its backoff).
/// `last` remembers when each was requeued; pods no longer waiting are forgotten.
pub fn choose(
    mut pending: Vec<Waiting>,
    last: &mut HashMap<String, Instant>,
    now: Instant,
    gap: Duration,
    max: usize,
) -> Vec<Waiting> {
    last.retain(|uid, _| pending.iter().any(|w| &w.uid == uid));
    pending.retain(|w| {
        last.get(&w.uid)
            .is_none_or(|t| now.duration_since(*t) >= gap)
    });
    pending.sort_by(|a, b| a.since.cmp(&b.since).then_with(|| a.uid.cmp(&b.uid)));
    pending.truncate(max);
    for w in &pending {
        last.insert(w.uid.clone(), now);
    }
    pending
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::serde_json::{from_value, json};

    fn pod(name: &str, node: Option<&str>, reason: &str, since: &str, gpu: bool) -> Pod {
        let limits = if gpu {
            json!({"gpuledger.io/gpu-mem": "1024"})
        } else {
            json!({"cpu": "1"})
        };
        from_value(json!({
            "metadata": {"name": name, "namespace": "ns", "uid": format!("u-{name}")},
            "spec": {"nodeName": node, "containers": [{"name": "c", "image": "x",
                "resources": {"limits": limits}}]},
            "status": {"conditions": [{"type": "PodScheduled", "status": "False",
                "reason": reason, "lastTransitionTime": since}]}
        }))
        .expect("a pod")
    }

    #[test]
    fn only_unschedulable_unbound_gpu_pods_wait_for_room() {
        let t = "2026-01-01T00:00:00Z";
        assert!(waiting(&pod("a", None, "Unschedulable", t, true)).is_some());
        assert!(waiting(&pod("b", Some("n1"), "Unschedulable", t, true)).is_none());
        assert!(waiting(&pod("c", None, "SchedulerError", t, true)).is_none());
        assert!(waiting(&pod("d", None, "Unschedulable", t, false)).is_none());
        // A claim pod (the DRA marker, no GPU limits) waits for room too.
        let mut dra = pod("e", None, "Unschedulable", t, false);
        dra.spec.as_mut().expect("spec").containers[0].resources =
            from_value(json!({"limits": {gpuledger_request::DRA_MARKER: "1"}})).expect("resources");
        assert!(waiting(&dra).is_some());
    }

    #[test]
    fn the_longest_waiting_first_and_none_twice_within_the_gap() {
        let w = |n: &str, since: &str| {
            waiting(&pod(n, None, "Unschedulable", since, true)).expect("waiting")
        };
        let pending = vec![
            w("late", "2026-01-01T00:00:05Z"),
            w("early", "2026-01-01T00:00:01Z"),
            w("mid", "2026-01-01T00:00:03Z"),
        ];
        let mut last = HashMap::new();
        let t0 = Instant::now();
        let gap = Duration::from_secs(2);
        let first = choose(pending.clone(), &mut last, t0, gap, 2);
        let names: Vec<_> = first.iter().map(|w| w.name.as_str()).collect();
        assert_eq!(names, ["early", "mid"]);
        // Within the gap only the one not requeued yet.
        let again = choose(
            pending.clone(),
            &mut last,
            t0 + Duration::from_secs(1),
            gap,
            8,
        );
        assert_eq!(again.len(), 1);
        assert_eq!(again[0].name, "late");
        // After the gap all of them; a pod that stopped waiting is forgotten.
        let later = choose(pending[..2].to_vec(), &mut last, t0 + gap * 2, gap, 8);
        assert_eq!(later.len(), 2);
        assert_eq!(last.len(), 2);
    }

    #[test]
    fn releases_nodes_and_raised_budgets_free_room_and_reservations_do_not() {
        use pb::event::Body;
        let ev = |b| pb::Event {
            body: Some(b),
            ..Default::default()
        };
        assert!(frees_room(&ev(Body::Released(Default::default()))));
        assert!(frees_room(&ev(Body::NodeRegistered(Default::default()))));
        assert!(frees_room(&ev(Body::BudgetRemoved(Default::default()))));
        assert!(!frees_room(&ev(Body::Reserved(Default::default()))));
        assert!(!frees_room(&ev(Body::Bound(Default::default()))));
    }
}
