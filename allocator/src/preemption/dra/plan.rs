//! Which DRA pods preempt, and what they ask: pure decisions over a pod and its claims.
//!
//! kube-scheduler 1.37 never preempts for ResourceClaims (its DefaultPreemption does not look
//! at them; KEP-5690 targets 1.38), so a DRA pod that finds no GPU room stays Unschedulable.
//! A pod preempts when it is pending (not bound, not being deleted), kube-scheduler last
//! found it unschedulable, its policy allows preemption, and none of its claims is allocated
//! yet; what it asks is what its claims ask of gpuledger's DeviceClass, read by the rule the
//! extender and the certification use ([`gpuledger_request::dra::spec_containers`]).

use gpuledger_proto::allocator::v1 as api;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;

/// One claim of a pod: the name in `spec.resourceClaims`, and the ResourceClaim it names or
/// was generated for it (None until the claim controller made it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodClaim {
    /// `spec.resourceClaims[].name`.
    pub pod_claim: String,
    /// The ResourceClaim's name in the pod's namespace.
    pub claim: Option<String>,
}

/// Whether `pod` waits for room and may preempt for it: pending, last found unschedulable,
/// with resource claims, and a preemption policy other than `Never`.
pub fn may_preempt(pod: &Pod) -> bool {
    let Some(spec) = pod.spec.as_ref() else {
        return false;
    };
    if spec.node_name.is_some()
        || pod.metadata.deletion_timestamp.is_some()
        || spec.preemption_policy.as_deref() == Some("Never")
        || spec.resource_claims.as_ref().is_none_or(Vec::is_empty)
    {
        return false;
    }
    crate::requeue::plan::unschedulable(pod).is_some()
}

/// The claims of `pod`, each with the ResourceClaim it names or that was generated for it
/// (`status.resourceClaimStatuses`).
pub fn pod_claims(pod: &Pod) -> Vec<PodClaim> {
    let generated = pod
        .status
        .as_ref()
        .and_then(|s| s.resource_claim_statuses.as_ref());
    let spec = pod.spec.as_ref().and_then(|s| s.resource_claims.as_ref());
    spec.into_iter()
        .flatten()
        .map(|c| PodClaim {
            pod_claim: c.name.clone(),
            claim: c.resource_claim_name.clone().or_else(|| {
                generated
                    .into_iter()
                    .flatten()
                    .find(|g| g.name == c.name)
                    .and_then(|g| g.resource_claim_name.clone())
            }),
        })
        .collect()
}

/// What `pod` asks of gpuledger's GPUs through `claims` (its [`pod_claims`] with the
/// ResourceClaims read, None where none is there), as a DRA request; None when it asks for
/// none, when a claim is not made yet, or when one is allocated (the pod is not waiting for
/// GPU room); why not, when it asks for our devices in a way gpuledger does not place.
pub fn request(
    pod: &Pod,
    claims: &[(PodClaim, Option<ResourceClaim>)],
    cores: gpuledger_request::dra::CoresUnit,
) -> Result<Option<api::PodRequest>, String> {
    let mut containers = Vec::new();
    for (pc, rc) in claims {
        let Some(rc) = rc else {
            return Ok(None);
        };
        if rc.status.as_ref().is_some_and(|s| s.allocation.is_some()) {
            return Ok(None);
        }
        containers.extend(gpuledger_request::dra::spec_containers(
            &pc.pod_claim,
            &rc.spec,
            cores,
        )?);
    }
    if containers.is_empty() {
        return Ok(None);
    }
    let mut r = gpuledger_request::request_of(pod, containers).map_err(|e| e.to_string())?;
    r.dra = true;
    Ok(Some(r))
}

#[cfg(test)]
mod tests {
    const T: gpuledger_request::dra::CoresUnit = gpuledger_request::dra::CoresUnit::Thousandths;
    use k8s_openapi::serde_json::{self, Value, json};

    use super::*;

    fn pod(extra: Value) -> Pod {
        let mut v = json!({
            "metadata": {"name": "hi", "namespace": "ns", "uid": "u-hi"},
            "spec": {
                "priority": 1000,
                "containers": [{"name": "main"}],
                "resourceClaims": [{"name": "gpuledger", "resourceClaimTemplateName": "gpuledger-abc"}]
            },
            "status": {
                "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}],
                "resourceClaimStatuses": [{"name": "gpuledger", "resourceClaimName": "hi-gpuledger-x1"}]
            }
        });
        merge(&mut v, extra);
        serde_json::from_value(v).expect("a pod")
    }

    fn merge(a: &mut Value, b: Value) {
        match (a, b) {
            (Value::Object(a), Value::Object(b)) => {
                for (k, v) in b {
                    merge(a.entry(k).or_insert(Value::Null), v);
                }
            }
            (a, b) => *a = b,
        }
    }

    fn claim(class: &str, allocated: bool) -> ResourceClaim {
        let mut v = json!({
            "metadata": {"name": "hi-gpuledger-x1", "namespace": "ns", "uid": "c1"},
            "spec": {"devices": {"requests": [{"name": "c0", "exactly": {
                "deviceClassName": class,
                "capacity": {"requests": {"memory": "4Gi", "cores": "250"}}
            }}]}}
        });
        if allocated {
            v["status"] = json!({"allocation": {"devices": {"results": []}}});
        }
        serde_json::from_value(v).expect("a claim")
    }

    #[test]
    fn only_a_pending_unschedulable_claim_pod_that_may_preempt_preempts() {
        assert!(may_preempt(&pod(json!({}))));
        assert!(!may_preempt(&pod(json!({"spec": {"nodeName": "n1"}}))));
        assert!(!may_preempt(&pod(
            json!({"spec": {"preemptionPolicy": "Never"}})
        )));
        assert!(!may_preempt(&pod(json!({"status": {"conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "SchedulingGated"}
        ]}}))));
        assert!(!may_preempt(&pod(json!({"spec": {"resourceClaims": []}}))));
    }

    #[test]
    fn the_request_is_what_the_unallocated_claims_ask_of_our_class() {
        let p = pod(json!({}));
        let pcs = pod_claims(&p);
        assert_eq!(
            pcs,
            [PodClaim {
                pod_claim: "gpuledger".into(),
                claim: Some("hi-gpuledger-x1".into())
            }]
        );
        let with = |c: Option<ResourceClaim>| vec![(pcs[0].clone(), c)];
        let r = request(
            &p,
            &with(Some(claim(gpuledger_request::dra::DEVICE_CLASS, false))),
            T,
        )
        .expect("readable")
        .expect("asks for a GPU");
        assert!(r.dra);
        assert_eq!(r.priority, 1000);
        let c = &r.containers[0];
        assert_eq!(
            (c.name.as_str(), c.slices, c.mem_mib, c.core_milli),
            ("gpuledger/c0", 1, 4096, 250)
        );
        // Allocated: the pod waits for something else than GPU room.
        assert_eq!(
            request(
                &p,
                &with(Some(claim(gpuledger_request::dra::DEVICE_CLASS, true))),
                T
            ),
            Ok(None)
        );
        // Not made yet, or another class's: nothing to preempt for.
        assert_eq!(request(&p, &with(None), T), Ok(None));
        assert_eq!(
            request(&p, &with(Some(claim("gpu.example.com", false))), T),
            Ok(None)
        );
    }
}
