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
        out.extend(
            gpuledger_request::dra::spec_containers(&pc.name, &spec, app.dra_cores)
                .map_err(Unreadable::Invalid)?,
        );
    }
    Ok(out)
}
