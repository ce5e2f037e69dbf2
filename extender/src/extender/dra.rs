//! Pods on the DRA path (they carry the marker `gpuledger.io/dra`): what they ask is read from
//! their ResourceClaims' specs (a template's, or an unallocated claim's), one container request
//! per `gpu.gpuledger.io` device request, so that filter and prioritize judge them with the
//! ledger as they judge device-plugin pods: DRA nodes only, and the GPU kube-scheduler's first
//! fit will take there. Bind reserves nothing for them: the allocator certifies their claims.

use gpuledger_proto::allocator::v1 as api;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimSpec, ResourceClaimTemplate};
use kube::api::Api;

use super::App;
use crate::resources;
use gpuledger_request::dra::DEVICE_CLASS;

/// Why a pod's request cannot be read.
#[derive(Debug)]
pub(super) enum Unreadable {
    /// The pod asks for something no node can serve (the pod must change).
    Invalid(String),
    /// The API server could not be read (the scheduler tries again).
    Unavailable(String),
}

/// The allocator request of any pod: from its claims when it carries the DRA marker, from its
/// resources otherwise; None when it asks gpuledger for nothing (or its claims are all
/// allocated already, which pins it to their node).
pub(super) async fn pod_request(
    app: &App,
    pod: &Pod,
) -> Result<Option<api::PodRequest>, Unreadable> {
    if !resources::has_dra_marker(pod) {
        return resources::pod_request(pod).map_err(|e| Unreadable::Invalid(e.to_string()));
    }
    let containers = claim_containers(app, pod).await?;
    if containers.is_empty() {
        return Ok(None);
    }
    let mut r =
        resources::request_of(pod, containers).map_err(|e| Unreadable::Invalid(e.to_string()))?;
    r.dra = true;
    Ok(Some(r))
}

/// One container request per `gpu.gpuledger.io` device request of the pod's unallocated claims,
/// named `<pod claim>/<request>`.
async fn claim_containers(app: &App, pod: &Pod) -> Result<Vec<api::ContainerRequest>, Unreadable> {
    let ns = pod.metadata.namespace.as_deref().unwrap_or("default");
    let claims = pod
        .spec
        .as_ref()
        .and_then(|s| s.resource_claims.clone())
        .unwrap_or_default();
    if claims.is_empty() {
        return Err(Unreadable::Invalid(format!(
            "the pod carries {} but no resource claim: the gpuledger webhook adds both",
            resources::DRA_MARKER
        )));
    }
    let kube = app.kube.clone().ok_or_else(|| {
        Unreadable::Unavailable(
            "the extender has no Kubernetes client to read the pod's ResourceClaims".into(),
        )
    })?;
    let unavailable =
        |what: String, e: kube::Error| Unreadable::Unavailable(format!("reading {what}: {e}"));
    let mut out = Vec::new();
    for pc in claims {
        let spec: ResourceClaimSpec = if let Some(t) = &pc.resource_claim_template_name {
            let api: Api<ResourceClaimTemplate> = Api::namespaced(kube.clone(), ns);
            let what = format!("ResourceClaimTemplate {ns}/{t}");
            match api
                .get_opt(t)
                .await
                .map_err(|e| unavailable(what.clone(), e))?
            {
                Some(t) => t.spec.spec,
                None => return Err(Unreadable::Unavailable(format!("{what} does not exist"))),
            }
        } else if let Some(c) = &pc.resource_claim_name {
            let api: Api<ResourceClaim> = Api::namespaced(kube.clone(), ns);
            let what = format!("ResourceClaim {ns}/{c}");
            match api
                .get_opt(c)
                .await
                .map_err(|e| unavailable(what.clone(), e))?
            {
                // Allocated: the scheduler pins the pod to the allocation's node.
                Some(c) if c.status.as_ref().is_some_and(|s| s.allocation.is_some()) => continue,
                Some(c) => c.spec,
                None => return Err(Unreadable::Unavailable(format!("{what} does not exist"))),
            }
        } else {
            continue;
        };
        for r in spec.devices.and_then(|d| d.requests).unwrap_or_default() {
            let name = format!("{}/{}", pc.name, r.name);
            let Some(e) = r.exactly else {
                let ours = r
                    .first_available
                    .iter()
                    .flatten()
                    .any(|s| s.device_class_name == DEVICE_CLASS);
                if ours {
                    return Err(Unreadable::Invalid(format!(
                        "request {name} lists {DEVICE_CLASS} among firstAvailable subrequests, \
                         which gpuledger does not place; ask for it in `exactly`"
                    )));
                }
                continue;
            };
            if e.device_class_name != DEVICE_CLASS {
                continue;
            }
            out.push(container(&name, &e, app.dra_cores)?);
        }
    }
    Ok(out)
}

/// The container request of one `exactly` request of our class. A capacity it leaves out is
/// the whole GPU's (the device's request policy default).
fn container(
    name: &str,
    e: &k8s_openapi::api::resource::v1::ExactDeviceRequest,
    cores: gpuledger_request::dra::CoresUnit,
) -> Result<api::ContainerRequest, Unreadable> {
    let bad = |m: String| Unreadable::Invalid(format!("request {name}: {m}"));
    match e.allocation_mode.as_deref() {
        None | Some("ExactCount") => {}
        Some(m) => {
            return Err(bad(format!(
                "allocationMode {m} is not placed by gpuledger; use ExactCount"
            )));
        }
    }
    let count = e.count.unwrap_or(1);
    let slices = u32::try_from(count)
        .ok()
        .filter(|c| *c >= 1)
        .ok_or_else(|| bad(format!("count {count}")))?;
    // Read as the allocator reads it when it certifies the allocation.
    let ask = gpuledger_request::dra::capacity_ask(e.capacity.as_ref(), cores).map_err(bad)?;
    let (mem_mib, mem_percent) = match ask.memory_mib {
        // The device's request policy: 1 MiB at least.
        Some(m) => (m.max(1), 0),
        None => (0, 100),
    };
    let core_milli = match ask.cores {
        Some(c) if c <= 1000 => c as u32,
        Some(c) => {
            return Err(bad(format!(
                "cores {}: more than the whole GPU ({})",
                cores.quantity(c).0,
                cores.quantity(1000).0
            )));
        }
        None => 1000,
    };
    Ok(api::ContainerRequest {
        name: name.to_string(),
        slices,
        mem_mib,
        mem_percent,
        core_milli,
    })
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::api::resource::v1::{CapacityRequirements, ExactDeviceRequest};
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

    use super::*;
    use gpuledger_request::dra::CoresUnit;

    const T: CoresUnit = CoresUnit::Thousandths;

    fn exactly(caps: &[(&str, &str)]) -> ExactDeviceRequest {
        let requests: BTreeMap<String, Quantity> = caps
            .iter()
            .map(|(k, v)| (k.to_string(), Quantity(v.to_string())))
            .collect();
        ExactDeviceRequest {
            device_class_name: DEVICE_CLASS.into(),
            capacity: Some(CapacityRequirements {
                requests: Some(requests),
            }),
            ..Default::default()
        }
    }

    #[test]
    fn a_request_is_judged_with_the_capacity_the_allocator_certifies() {
        let c = container("p/c0", &exactly(&[("memory", "1G"), ("cores", "300")]), T).unwrap();
        assert_eq!((c.mem_mib, c.mem_percent, c.core_milli), (954, 0, 300));
        let c = container("p/c0", &exactly(&[]), T).unwrap();
        assert_eq!((c.mem_mib, c.mem_percent, c.core_milli), (0, 100, 1000));
        assert!(matches!(
            container("p/c0", &exactly(&[("cores", "1001")]), T),
            Err(Unreadable::Invalid(_))
        ));
        // The fraction unit: a quarter of the GPU; more than the GPU is named in that unit.
        let f = CoresUnit::Fraction;
        let c = container("p/c0", &exactly(&[("cores", "0.25")]), f).unwrap();
        assert_eq!(c.core_milli, 250);
        match container("p/c0", &exactly(&[("cores", "1.5")]), f) {
            Err(Unreadable::Invalid(m)) => assert!(m.contains("cores 1500m"), "{m}"),
            other => panic!("not invalid: {other:?}"),
        }
    }

    /// The scheduler allocates no device of ours for a capacity they do not publish: the
    /// extender used to take `gpu.gpuledger.io/memory` for the whole GPU, and the allocator
    /// for `memory`; both refuse it now.
    #[test]
    fn a_capacity_our_devices_do_not_publish_is_invalid() {
        match container("p/c0", &exactly(&[("gpu.gpuledger.io/memory", "2Gi")]), T) {
            Err(Unreadable::Invalid(m)) => assert!(m.contains("gpu.gpuledger.io/memory"), "{m}"),
            other => panic!("not invalid: {other:?}"),
        }
    }
}
