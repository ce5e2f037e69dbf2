//! The webhook's DRA path: a GPU pod written for the device plugin (gpuledger's, gpushare's,
//! HAMi's or gpu-manager's names) becomes a pod with a ResourceClaim of the `gpu.gpuledger.io`
//! DeviceClass, made from a content-addressed ResourceClaimTemplate, so that the garbage
//! collector owns the claim and the pod's YAML stays as its users wrote it.
//!
//! Per pod: each GPU container's share is computed with `gpuledger_request`, exactly as the
//! device-plugin path computes it ([`dra::claim_requests`]); the pod is patched to claim the
//! template `gpuledger-<sha256(spec)[:12]>` those requests make, with the requests in its
//! annotation [`dra::REQUESTS_ANNOTATION`], its peer GPU names are removed and the marker
//! [`resources::DRA_MARKER`] is added so that kube-scheduler consults the extender. The webhook
//! writes nothing: the allocator's leader makes the template once the pod exists
//! (`allocator/src/claim_templates.rs`), so a review that does not come from the API server
//! creates nothing anywhere.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use gpuledger_request::dra::{self, ClaimRequest, PATH_KEY, POD_CLAIM};
use k8s_openapi::api::core::v1::{
    Pod, PodResourceClaim, ResourceClaim as ContainerClaim, ResourceRequirements,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use serde_json::Value;

use super::namespaces::NamespaceLabels;
use super::patch::{add, annotate};
use crate::resources;
use json_patch::PatchOperation;

/// How a GPU pod gets its GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PodPath {
    /// `gpuledger.io/*` extended resources, reserved by the extender at bind.
    #[default]
    DevicePlugin,
    /// A ResourceClaim of the `gpu.gpuledger.io` DeviceClass, certified by the allocator.
    Dra,
}

impl FromStr for PodPath {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "device-plugin" => Ok(PodPath::DevicePlugin),
            "dra" => Ok(PodPath::Dra),
            other => Err(format!(
                "unknown pod path {other:?}: \"device-plugin\" or \"dra\""
            )),
        }
    }
}

impl fmt::Display for PodPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PodPath::DevicePlugin => "device-plugin",
            PodPath::Dra => "dra",
        })
    }
}

/// The path of a GPU pod: its annotation [`PATH_KEY`], else its namespace's label (from the
/// watched `namespaces`, when given), else `default` (the `--pod-path` flag).
pub async fn path_of(
    namespaces: Option<&NamespaceLabels>,
    pod: &Pod,
    ns: &str,
    default: PodPath,
) -> Result<PodPath, String> {
    let ann = pod.metadata.annotations.as_ref();
    if let Some(v) = ann.and_then(|a| a.get(PATH_KEY)) {
        return v.parse().map_err(|e| format!("annotation {PATH_KEY}: {e}"));
    }
    let Some(namespaces) = namespaces else {
        return Ok(default);
    };
    match namespaces.label(ns, PATH_KEY).await? {
        Some(v) => v
            .parse()
            .map_err(|e| format!("label {PATH_KEY} of namespace {ns}: {e}")),
        None => Ok(default),
    }
}

/// The JSON Patch operations that convert the pod: claim the template, one request per GPU
/// container, peer GPU names removed, the marker added, the requests recorded
/// ([`dra::REQUESTS_ANNOTATION`]) for the allocator to make the template from.
pub fn patch_ops(
    pod: &Pod,
    reqs: &[ClaimRequest],
    template: &str,
) -> Result<Vec<PatchOperation>, String> {
    let Some(spec) = pod.spec.as_ref() else {
        return Ok(Vec::new());
    };
    let mut ops = Vec::new();
    let claim = PodResourceClaim {
        name: POD_CLAIM.to_string(),
        resource_claim_template_name: Some(template.to_string()),
        ..Default::default()
    };
    let claim = serde_json::to_value(claim).map_err(|e| e.to_string())?;
    match &spec.resource_claims {
        Some(cs) if cs.iter().any(|c| c.name == POD_CLAIM) => {
            return Err(format!(
                "the pod already has a resource claim named {POD_CLAIM:?}; gpuledger's DRA path \
                 adds one of that name"
            ));
        }
        Some(_) => ops.push(add(&["spec", "resourceClaims", "-"], claim)),
        None => ops.push(add(&["spec", "resourceClaims"], Value::Array(vec![claim]))),
    }
    for r in reqs {
        let c = &spec.containers[r.container];
        let res = converted(c.resources.as_ref(), &r.name);
        let value = serde_json::to_value(res).map_err(|e| e.to_string())?;
        ops.push(add(
            &["spec", "containers", &r.container.to_string(), "resources"],
            value,
        ));
    }
    let requests = annotate(
        pod,
        &ops,
        dra::REQUESTS_ANNOTATION,
        dra::encode_requests(reqs),
    );
    ops.push(requests);
    Ok(ops)
}

/// Every name a peer's device plugin, or gpuledger's, reads: none stays on a converted
/// container (a DRA node advertises none of them, and one that a DeviceClass maps would make
/// the others unschedulable).
fn peer_names() -> impl Iterator<Item = &'static str> {
    resources::ALL_RESOURCES
        .into_iter()
        .chain([resources::HAMI_GPU])
}

/// A GPU container's resources on the DRA path.
fn converted(res: Option<&ResourceRequirements>, request: &str) -> ResourceRequirements {
    let mut res = res.cloned().unwrap_or_default();
    for map in [&mut res.limits, &mut res.requests] {
        let m = map.get_or_insert_with(BTreeMap::new);
        for k in peer_names() {
            m.remove(k);
        }
        m.insert(resources::DRA_MARKER.to_string(), Quantity("1".into()));
    }
    res.claims
        .get_or_insert_with(Vec::new)
        .push(ContainerClaim {
            name: POD_CLAIM.to_string(),
            request: Some(request.to_string()),
        });
    res
}
