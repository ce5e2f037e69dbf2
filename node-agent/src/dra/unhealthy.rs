//! Pod Events for a GPU newly tainted unhealthy in the node's slice: every pod whose claim
//! holds a share of it hears what the taint does to it (`NoExecute`: Kubernetes evicts it;
//! `NoSchedule`: it keeps running, no new claim lands there).

use std::collections::BTreeSet;

use gpuledger_ops::events::{Kind, PodEvent};
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::Api;
use tracing::debug;

use crate::agent::Agent;
use crate::view::View;

/// The Event reason.
pub const REASON: &str = "GpuUnhealthy";

/// The claims `(namespace, name)` holding a share of `gpu` in `view`.
pub fn claims_on(view: &View, gpu: &str) -> BTreeSet<(String, String)> {
    view.allocs
        .values()
        .filter(|a| a.claim.is_some() && a.shares.iter().any(|s| s.gpu_uuid == gpu))
        .filter_map(|a| a.pod.as_ref())
        .map(|p| (p.namespace.clone(), p.name.clone()))
        .collect()
}

/// What a pod on `gpu` is told when the GPU is tainted with `effect` for `reason`.
pub fn message(gpu: &str, reason: Option<&str>, effect: &str) -> String {
    let why = reason.map_or(String::new(), |r| format!(" ({r})"));
    let what = if effect == "NoExecute" {
        "Kubernetes evicts the pods using it, this one included"
    } else {
        "no new claim is placed on it; this pod keeps running on it"
    };
    format!(
        "GPU {gpu} is unhealthy{why}: its device is tainted {} {effect} in the node's ResourceSlice, so {what}",
        gpuledger_request::dra::UNHEALTHY_TAINT
    )
}

/// Tell each pod reserving a claim on `gpu` (best effort: a claim or pod gone is skipped).
pub async fn tell(agent: &Agent, client: &kube::Client, gpu: &str, effect: &str) {
    let (claims, reason) =
        agent.with_view(|v| (claims_on(v, gpu), v.health_reasons.get(gpu).cloned()));
    let text = message(gpu, reason.as_deref(), effect);
    for (ns, name) in claims {
        let claim = match Api::<ResourceClaim>::namespaced(client.clone(), &ns)
            .get_opt(&name)
            .await
        {
            Ok(Some(c)) => c,
            Ok(None) => continue,
            Err(e) => {
                debug!(claim = %format!("{ns}/{name}"), "reading the claim of an unhealthy GPU: {e}");
                continue;
            }
        };
        let pods = claim
            .status
            .and_then(|s| s.reserved_for)
            .unwrap_or_default()
            .into_iter()
            .filter(|r| r.resource == "pods" && r.api_group.as_deref().unwrap_or("").is_empty());
        for p in pods {
            agent.event(PodEvent {
                namespace: ns.clone(),
                name: p.name,
                uid: p.uid,
                kind: Kind::Warning,
                reason: REASON,
                message: text.clone(),
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuledger_proto::ledger::v1 as pb;

    fn alloc(id: u64, claim: bool, gpu: &str, ns: &str, name: &str) -> pb::Allocation {
        pb::Allocation {
            id,
            claim: claim.then(Default::default),
            pod: Some(pb::PodRef {
                uid: format!("uid-{id}"),
                namespace: ns.into(),
                name: name.into(),
            }),
            shares: vec![pb::GpuShare {
                gpu_uuid: gpu.into(),
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    #[test]
    fn the_claims_on_a_gpu_and_what_their_pods_are_told() {
        let mut v = View::default();
        for a in [
            alloc(1, true, "GPU-A", "ns", "c1"),
            alloc(2, true, "GPU-A", "ns", "c1"),
            alloc(3, true, "GPU-B", "ns", "c2"),
            alloc(4, false, "GPU-A", "ns", "device-plugin-pod"),
        ] {
            v.allocs.insert(a.id, a);
        }
        let got: Vec<(String, String)> = claims_on(&v, "GPU-A").into_iter().collect();
        assert_eq!(got, [("ns".to_string(), "c1".to_string())]);
        assert!(claims_on(&v, "GPU-C").is_empty());
        let m = message("GPU-A", Some("critical Xid 79"), "NoExecute");
        assert!(
            m.contains("GPU GPU-A is unhealthy (critical Xid 79)"),
            "{m}"
        );
        assert!(
            m.contains("tainted gpu.gpuledger.io/unhealthy NoExecute"),
            "{m}"
        );
        assert!(m.contains("evicts"), "{m}");
        let m = message("GPU-A", None, "NoSchedule");
        assert!(m.contains("keeps running"), "{m}");
    }
}
