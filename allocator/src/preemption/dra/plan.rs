//! Which DRA pods preempt, and what they ask: pure decisions over a pod and its claims.
//!
//! kube-scheduler 1.37 never preempts for ResourceClaims (its DefaultPreemption does not look
//! at them; KEP-5690 targets 1.38), so a DRA pod that finds no GPU room stays Unschedulable.
//! A pod preempts when it is pending (not bound, not being deleted), kube-scheduler last
//! found it unschedulable, its policy allows preemption, and none of its claims is allocated
//! yet; what it asks is what its claims ask of gpuledger's DeviceClass, read by the rule the
//! extender and the certification use ([`gpuledger_request::dra::spec_containers`]).

use std::collections::BTreeMap;

use gpuledger_proto::allocator::v1 as api;
use k8s_openapi::api::core::v1::{
    Node, NodeSelectorRequirement, NodeSelectorTerm, Pod, Taint, Toleration,
};
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

/// Whether kube-scheduler may put `pod` on `node` as far as the node's labels and taints go:
/// its `nodeSelector`, its required node affinity, and its tolerations of the node's
/// `NoSchedule` and `NoExecute` taints (a cordoned node has one). Preempting on a node the pod
/// cannot go to would evict pods for nothing.
pub fn node_allows(pod: &Pod, node: &Node) -> bool {
    let Some(spec) = pod.spec.as_ref() else {
        return true;
    };
    let empty = BTreeMap::new();
    let labels = node.metadata.labels.as_ref().unwrap_or(&empty);
    let name = node.metadata.name.as_deref().unwrap_or("");
    if let Some(sel) = &spec.node_selector
        && !sel.iter().all(|(k, v)| labels.get(k) == Some(v))
    {
        return false;
    }
    let required = spec
        .affinity
        .as_ref()
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|a| {
            a.required_during_scheduling_ignored_during_execution
                .as_ref()
        });
    // The terms are ORed; an empty list of terms matches no node.
    if let Some(r) = required
        && !r
            .node_selector_terms
            .iter()
            .any(|t| term_matches(t, labels, name))
    {
        return false;
    }
    let tolerations = spec.tolerations.as_deref().unwrap_or_default();
    node.spec
        .as_ref()
        .and_then(|s| s.taints.as_deref())
        .unwrap_or_default()
        .iter()
        .filter(|t| matches!(t.effect.as_str(), "NoSchedule" | "NoExecute"))
        .all(|t| tolerations.iter().any(|tol| tolerates(tol, t)))
}

/// A node selector term: its expressions over the labels and its fields (only
/// `metadata.name`) all hold; a term with neither matches nothing.
fn term_matches(t: &NodeSelectorTerm, labels: &BTreeMap<String, String>, name: &str) -> bool {
    let exprs = t.match_expressions.as_deref().unwrap_or_default();
    let fields = t.match_fields.as_deref().unwrap_or_default();
    if exprs.is_empty() && fields.is_empty() {
        return false;
    }
    exprs
        .iter()
        .all(|r| requirement_holds(r, labels.get(&r.key).map(String::as_str)))
        && fields.iter().all(|r| {
            r.key == "metadata.name"
                && r.operator != "Gt"
                && r.operator != "Lt"
                && requirement_holds(r, Some(name))
        })
}

/// One requirement of a node selector on the value found (None: the label is absent).
fn requirement_holds(r: &NodeSelectorRequirement, value: Option<&str>) -> bool {
    let values = r.values.as_deref().unwrap_or_default();
    let number = |s: &str| s.parse::<i64>().ok();
    match r.operator.as_str() {
        "In" => value.is_some_and(|v| values.iter().any(|x| x == v)),
        "NotIn" => value.is_none_or(|v| !values.iter().any(|x| x == v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        "Gt" | "Lt" => {
            let (Some(v), [bound]) = (value.and_then(number), values) else {
                return false;
            };
            let Some(bound) = number(bound) else {
                return false;
            };
            if r.operator == "Gt" {
                v > bound
            } else {
                v < bound
            }
        }
        _ => false,
    }
}

/// Whether toleration `tol` tolerates `taint` (the rules of `v1.Toleration.ToleratesTaint`).
fn tolerates(tol: &Toleration, taint: &Taint) -> bool {
    if tol
        .effect
        .as_deref()
        .is_some_and(|e| !e.is_empty() && e != taint.effect)
    {
        return false;
    }
    let key = tol.key.as_deref().unwrap_or("");
    let exists = tol.operator.as_deref() == Some("Exists");
    if key.is_empty() {
        return exists;
    }
    key == taint.key
        && (exists || tol.value.as_deref().unwrap_or("") == taint.value.as_deref().unwrap_or(""))
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

    fn node(v: Value) -> Node {
        let mut n = json!({"metadata": {"name": "n1", "labels": {"zone": "a", "gpus": "8"}}});
        merge(&mut n, v);
        serde_json::from_value(n).expect("a node")
    }

    #[test]
    fn preemption_looks_only_at_nodes_the_pods_selectors_affinity_and_tolerations_allow() {
        let any = pod(json!({}));
        assert!(node_allows(&any, &node(json!({}))));
        let sel = pod(json!({"spec": {"nodeSelector": {"zone": "a"}}}));
        assert!(node_allows(&sel, &node(json!({}))));
        assert!(!node_allows(
            &sel,
            &node(json!({"metadata": {"labels": {"zone": "b"}}}))
        ));
        let affinity = |terms: Value| {
            pod(json!({"spec": {"affinity": {"nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}
            }}}}))
        };
        let expr = |key: &str, op: &str, values: Value| {
            affinity(
                json!([{"matchExpressions": [{"key": key, "operator": op, "values": values}]}]),
            )
        };
        let n = node(json!({}));
        assert!(node_allows(&expr("zone", "In", json!(["a", "c"])), &n));
        assert!(!node_allows(&expr("zone", "NotIn", json!(["a"])), &n));
        assert!(node_allows(&expr("rack", "NotIn", json!(["a"])), &n));
        assert!(node_allows(&expr("zone", "Exists", json!(null)), &n));
        assert!(!node_allows(&expr("zone", "DoesNotExist", json!(null)), &n));
        assert!(node_allows(&expr("gpus", "Gt", json!(["4"])), &n));
        assert!(!node_allows(&expr("gpus", "Lt", json!(["4"])), &n));
        assert!(
            !node_allows(&expr("zone", "Gt", json!(["4"])), &n),
            "not a number"
        );
        // Terms are ORed; one that matches is enough; none matches nothing.
        assert!(node_allows(
            &affinity(json!([
                {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]},
                {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]}
            ])),
            &n
        ));
        assert!(!node_allows(&affinity(json!([])), &n));
        assert!(!node_allows(&affinity(json!([{}])), &n));
        // Taints: NoSchedule and NoExecute keep out a pod that does not tolerate them.
        let tainted = node(json!({"spec": {"taints": [
            {"key": "gpu", "value": "h100", "effect": "NoSchedule"},
            {"key": "soft", "effect": "PreferNoSchedule"}
        ]}}));
        assert!(!node_allows(&any, &tainted));
        let tol = |t: Value| pod(json!({"spec": {"tolerations": [t]}}));
        assert!(node_allows(
            &tol(json!({"key": "gpu", "value": "h100"})),
            &tainted
        ));
        assert!(node_allows(
            &tol(json!({"key": "gpu", "operator": "Exists"})),
            &tainted
        ));
        assert!(node_allows(&tol(json!({"operator": "Exists"})), &tainted));
        assert!(!node_allows(
            &tol(json!({"key": "gpu", "value": "a100"})),
            &tainted
        ));
        assert!(!node_allows(
            &tol(json!({"key": "gpu", "operator": "Exists", "effect": "NoExecute"})),
            &tainted
        ));
        let cordoned = node(json!({"spec": {"unschedulable": true, "taints": [
            {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}
        ]}}));
        assert!(!node_allows(&any, &cordoned));
    }
}
