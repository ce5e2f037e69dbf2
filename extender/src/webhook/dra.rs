//! The webhook's DRA path: a GPU pod written for the device plugin (gpuledger's, gpushare's,
//! HAMi's or gpu-manager's names) becomes a pod with a ResourceClaim of the `gpu.gpuledger.io`
//! DeviceClass, made from a content-addressed ResourceClaimTemplate, so that the garbage
//! collector owns the claim and the pod's YAML stays as its users wrote it.
//!
//! Per pod: each GPU container's share is computed with `gpuledger_request`, exactly as the
//! device-plugin path computes it; the template `gpuledger-<sha256(spec)[:12]>` is created in
//! the pod's namespace (or found, and compared field by field); the pod is patched to claim it,
//! its peer GPU names are removed and the marker [`resources::DRA_MARKER`] is added so that
//! kube-scheduler consults the extender.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use k8s_openapi::api::core::v1::{
    Namespace, Pod, PodResourceClaim, ResourceClaim as ContainerClaim, ResourceRequirements,
};
use k8s_openapi::api::resource::v1::{
    CapacityRequirements, DeviceClaim, DeviceConstraint, DeviceRequest, ExactDeviceRequest,
    ResourceClaimSpec, ResourceClaimTemplate, ResourceClaimTemplateSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, PostParams};
use serde_json::Value;
use sha2::{Digest, Sha256};

use super::add;
use crate::resources::{self, ContainerGpu};
use json_patch::PatchOperation;

/// The DeviceClass (and driver) of gpuledger's GPUs.
pub const DEVICE_CLASS: &str = "gpu.gpuledger.io";
/// The attribute that tells GPUs apart (a request of several GPUs takes distinct ones).
pub const UUID_ATTRIBUTE: &str = "gpu.gpuledger.io/uuid";
/// The name of the pod's claim (`spec.resourceClaims[].name`).
pub const POD_CLAIM: &str = "gpuledger";
/// Pod annotation and namespace label choosing the path: `dra` or `device-plugin`.
pub const PATH_KEY: &str = "gpuledger.io/path";
/// Label on the templates the webhook creates (and on their claims).
pub const MANAGED_LABEL: &str = "gpuledger.io/managed";
/// The capacity names of gpuledger's devices (MiB, and core_milli).
const MEMORY: &str = "memory";
const CORES: &str = "cores";

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

/// The path of a GPU pod: its annotation [`PATH_KEY`], else its namespace's label (read with
/// `kube`, when given), else `default` (the `--pod-path` flag). The namespace is read only when
/// the pod does not say.
pub async fn path_of(
    kube: Option<&kube::Client>,
    pod: &Pod,
    ns: &str,
    default: PodPath,
) -> Result<PodPath, String> {
    let ann = pod.metadata.annotations.as_ref();
    if let Some(v) = ann.and_then(|a| a.get(PATH_KEY)) {
        return v.parse().map_err(|e| format!("annotation {PATH_KEY}: {e}"));
    }
    let Some(kube) = kube else {
        return Ok(default);
    };
    let n = Api::<Namespace>::all(kube.clone())
        .get_opt(ns)
        .await
        .map_err(|e| {
            format!("reading namespace {ns}'s label {PATH_KEY} (which GPU path its pods take): {e}")
        })?;
    match n.and_then(|n| n.metadata.labels?.get(PATH_KEY).cloned()) {
        Some(v) => v
            .parse()
            .map_err(|e| format!("label {PATH_KEY} of namespace {ns}: {e}")),
        None => Ok(default),
    }
}

/// One GPU container's request of the claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimRequest {
    /// The container's index in `spec.containers`.
    pub container: usize,
    /// The request's name, `c<index>`.
    pub name: String,
    /// GPUs, each a distinct device.
    pub count: u32,
    /// MiB per GPU; None = the whole GPU's memory (the device's default).
    pub mem_mib: Option<u64>,
    /// Compute per GPU, in core_milli (1000 = the whole GPU).
    pub core_milli: u32,
}

/// The claim requests of the pod's GPU containers, computed as the device-plugin path
/// computes their shares.
pub fn claim_requests(pod: &Pod) -> Result<Vec<ClaimRequest>, String> {
    let Some(spec) = pod.spec.as_ref() else {
        return Ok(Vec::new());
    };
    // The same count bound as the device-plugin path.
    resources::containers(pod).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    for (i, c) in spec.containers.iter().enumerate() {
        let g = ContainerGpu::of(c).map_err(|e| e.to_string())?;
        if !g.wants_gpu() {
            continue;
        }
        let r = g.to_api().map_err(|e| e.to_string())?;
        let whole = r.mem_mib == 0 && r.mem_percent == 0 && r.core_milli == 0;
        let (mem_mib, core_milli) = if whole || r.mem_percent == 100 {
            (None, if whole { 1000 } else { r.core_milli })
        } else if r.mem_percent > 0 {
            return Err(format!(
                "container {:?} asks for {}% of a GPU's memory: a ResourceClaim asks for memory \
                 in MiB, and a percentage depends on the GPU it lands on; on the DRA path ask in \
                 MiB ({}, nvidia.com/gpumem) or for the whole GPU, or annotate the pod \
                 {PATH_KEY}: device-plugin",
                c.name,
                r.mem_percent,
                resources::GPU_MEM
            ));
        } else if r.mem_mib == 0 {
            return Err(format!(
                "container {:?} asks for GPU compute without GPU memory: a DRA grant holds at \
                 least 1 MiB; add {} (MiB), or annotate the pod {PATH_KEY}: device-plugin",
                c.name,
                resources::GPU_MEM
            ));
        } else {
            (Some(r.mem_mib), r.core_milli)
        };
        out.push(ClaimRequest {
            container: i,
            name: format!("c{i}"),
            count: r.slices,
            mem_mib,
            core_milli,
        });
    }
    Ok(out)
}

/// The template's spec for `reqs`: one request per GPU container, a distinct-GPU constraint
/// for each request of more than one GPU, and the managed label on the claims.
pub fn template_spec(reqs: &[ClaimRequest]) -> ResourceClaimTemplateSpec {
    let requests = reqs
        .iter()
        .map(|r| {
            let mut caps = BTreeMap::new();
            if let Some(m) = r.mem_mib {
                caps.insert(MEMORY.to_string(), Quantity(format!("{m}Mi")));
            }
            caps.insert(CORES.to_string(), Quantity(r.core_milli.to_string()));
            DeviceRequest {
                name: r.name.clone(),
                exactly: Some(ExactDeviceRequest {
                    device_class_name: DEVICE_CLASS.to_string(),
                    allocation_mode: Some("ExactCount".into()),
                    count: Some(i64::from(r.count)),
                    capacity: Some(CapacityRequirements {
                        requests: Some(caps),
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            }
        })
        .collect();
    let constraints: Vec<DeviceConstraint> = reqs
        .iter()
        .filter(|r| r.count > 1)
        .map(|r| DeviceConstraint {
            requests: Some(vec![r.name.clone()]),
            distinct_attribute: Some(UUID_ATTRIBUTE.to_string()),
            ..Default::default()
        })
        .collect();
    ResourceClaimTemplateSpec {
        metadata: Some(ObjectMeta {
            labels: Some(managed_labels()),
            ..Default::default()
        }),
        spec: ResourceClaimSpec {
            devices: Some(DeviceClaim {
                requests: Some(requests),
                constraints: (!constraints.is_empty()).then_some(constraints),
                ..Default::default()
            }),
        },
    }
}

fn managed_labels() -> BTreeMap<String, String> {
    BTreeMap::from([(MANAGED_LABEL.to_string(), "true".to_string())])
}

/// `gpuledger-<first 12 hex digits of the SHA-256 of the spec's JSON>`: one template per
/// distinct spec and namespace, so a retried or reinvoked admission finds the same one.
pub fn template_name(spec: &ResourceClaimTemplateSpec) -> String {
    // The JSON of a k8s-openapi struct is canonical: fields in declaration order, maps sorted.
    let json = serde_json::to_vec(spec).unwrap_or_default();
    let digest = Sha256::digest(&json);
    let hex: String = digest.iter().take(6).map(|b| format!("{b:02x}")).collect();
    format!("gpuledger-{hex}")
}

/// The template for `reqs` in namespace `ns`.
pub fn template(ns: &str, reqs: &[ClaimRequest]) -> ResourceClaimTemplate {
    let spec = template_spec(reqs);
    ResourceClaimTemplate {
        metadata: ObjectMeta {
            name: Some(template_name(&spec)),
            namespace: Some(ns.to_string()),
            labels: Some(managed_labels()),
            ..Default::default()
        },
        spec,
    }
}

/// Whether `got` (as the API server stored it) asks what `want` asks, field by field; the
/// difference otherwise. Quantities compare by value (the API server writes `1000` as `1k`).
pub fn same_template(
    want: &ResourceClaimTemplate,
    got: &ResourceClaimTemplate,
) -> Result<(), String> {
    let name = want.metadata.name.as_deref().unwrap_or("");
    let ns = want.metadata.namespace.as_deref().unwrap_or("");
    let what = format!("ResourceClaimTemplate {ns}/{name}");
    let devices = |t: &ResourceClaimTemplate| t.spec.spec.devices.clone().unwrap_or_default();
    let (w, g) = (devices(want), devices(got));
    let (wr, gr) = (
        w.requests.clone().unwrap_or_default(),
        g.requests.clone().unwrap_or_default(),
    );
    if wr.len() != gr.len() {
        return Err(format!(
            "{what} exists with {} requests, not {}: it was not made for this pod's spec; \
             delete it",
            gr.len(),
            wr.len()
        ));
    }
    for w in &wr {
        let Some(g) = gr.iter().find(|g| g.name == w.name) else {
            return Err(format!("{what} has no request {}; delete it", w.name));
        };
        let (we, ge) = (
            w.exactly.clone().unwrap_or_default(),
            g.exactly.clone().unwrap_or_default(),
        );
        let field = |f: &str, a: &dyn fmt::Debug, b: &dyn fmt::Debug| {
            format!(
                "{what} request {}: {f} is {b:?}, not {a:?}; delete it",
                w.name
            )
        };
        if we.device_class_name != ge.device_class_name {
            return Err(field(
                "deviceClassName",
                &we.device_class_name,
                &ge.device_class_name,
            ));
        }
        if we.allocation_mode != ge.allocation_mode {
            return Err(field(
                "allocationMode",
                &we.allocation_mode,
                &ge.allocation_mode,
            ));
        }
        if we.count != ge.count {
            return Err(field("count", &we.count, &ge.count));
        }
        let caps = |e: &ExactDeviceRequest| {
            e.capacity
                .as_ref()
                .and_then(|c| c.requests.clone())
                .unwrap_or_default()
        };
        let (wc, gc) = (caps(&we), caps(&ge));
        if !wc.is_empty() && gc.is_empty() {
            return Err(format!(
                "the API server dropped capacity.requests from {what} (request {}): the \
                 DRAConsumableCapacity feature gate is off on kube-apiserver (beta and on by \
                 default from Kubernetes 1.36; 1.35 needs \
                 --feature-gates=DRAConsumableCapacity=true on kube-apiserver, kube-scheduler \
                 and the kubelet). Without it a claim takes whole GPUs. Turn the gate on, then \
                 delete {what}",
                w.name
            ));
        }
        let value = |q: Option<&Quantity>| q.map(|q| resources::parse_quantity(&q.0));
        if wc.len() != gc.len()
            || wc
                .iter()
                .any(|(k, v)| value(Some(v)) != value(gc.get(k)) || value(gc.get(k)).is_none())
        {
            return Err(field("capacity.requests", &wc, &gc));
        }
    }
    let constraints = |d: &DeviceClaim| d.constraints.clone().unwrap_or_default();
    if constraints(&w) != constraints(&g) {
        return Err(format!(
            "{what}: constraints are {:?}, not {:?}; delete it",
            constraints(&g),
            constraints(&w)
        ));
    }
    let labels = |t: &ResourceClaimTemplate| {
        t.spec
            .metadata
            .as_ref()
            .and_then(|m| m.labels.clone())
            .unwrap_or_default()
    };
    if labels(want) != labels(got) {
        return Err(format!(
            "{what}: the claims' labels are {:?}, not {:?}; delete it",
            labels(got),
            labels(want)
        ));
    }
    Ok(())
}

/// Create the template, or find it; either way check what the API server stored. Nothing is
/// created on a dry run.
pub async fn ensure_template(
    kube: &kube::Client,
    t: &ResourceClaimTemplate,
    dry_run: bool,
) -> Result<(), String> {
    if dry_run {
        return Ok(());
    }
    let ns = t.metadata.namespace.as_deref().unwrap_or("default");
    let name = t.metadata.name.as_deref().unwrap_or("");
    let api: Api<ResourceClaimTemplate> = Api::namespaced(kube.clone(), ns);
    let stored = match api.create(&PostParams::default(), t).await {
        Ok(s) => s,
        Err(kube::Error::Api(s)) if s.code == 409 => api
            .get(name)
            .await
            .map_err(|e| format!("reading ResourceClaimTemplate {ns}/{name} (it exists): {e}"))?,
        Err(e) => {
            return Err(format!(
                "creating ResourceClaimTemplate {ns}/{name}: {e} (the webhook's service account \
                 needs create and get on resourceclaimtemplates.resource.k8s.io)"
            ));
        }
    };
    same_template(t, &stored)
}

/// The JSON Patch operations that convert the pod: claim the template, one request per GPU
/// container, peer GPU names removed, the marker added.
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
