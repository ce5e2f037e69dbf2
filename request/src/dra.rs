//! gpuledger's DRA vocabulary for pods: the DeviceClass, the claim a converted pod carries, and
//! its content-addressed ResourceClaimTemplate `gpuledger-<sha256(spec)[:12]>`.
//!
//! The admission webhook converts a GPU pod (its containers' shares, computed as the
//! device-plugin path computes them) into [`ClaimRequest`]s, names the template they make and
//! records the requests on the pod ([`REQUESTS_ANNOTATION`]); it writes nothing to the API
//! server. The allocator's leader makes the template for a pod that exists
//! ([`template_of_pod`]), so no template is created on the word of an unauthenticated
//! caller, and a template's name is always the hash of what it asks.

use std::collections::BTreeMap;
use std::fmt;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{
    CapacityRequirements, DeviceClaim, DeviceConstraint, DeviceRequest, ExactDeviceRequest,
    ResourceClaim, ResourceClaimSpec, ResourceClaimTemplate, ResourceClaimTemplateSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The DeviceClass of gpuledger's GPUs.
pub const DEVICE_CLASS: &str = "gpu.gpuledger.io";
/// The DRA driver gpuledger's devices belong to: `spec.driver` of its ResourceSlices,
/// `driver` of allocation results and of `status.devices` entries.
pub const DRIVER: &str = "gpu.gpuledger.io";
/// The binding condition of gpuledger's devices: the ledger committed a grant for the result.
pub const GRANTED: &str = "gpuledger.io/Granted";
/// The binding-failure condition of gpuledger's devices: the ledger refused the result.
pub const REFUSED: &str = "gpuledger.io/Refused";
/// The reason of a [`GRANTED`] condition.
pub const REASON_GRANT: &str = "LedgerGrant";
/// The attribute that tells GPUs apart (a request of several GPUs takes distinct ones).
pub const UUID_ATTRIBUTE: &str = "gpu.gpuledger.io/uuid";
/// The name of the pod's claim (`spec.resourceClaims[].name`).
pub const POD_CLAIM: &str = "gpuledger";
/// Pod annotation and namespace label choosing the path: `dra` or `device-plugin`.
pub const PATH_KEY: &str = "gpuledger.io/path";
/// Pod annotation with the claim requests the webhook converted the pod's GPU containers to
/// ([`encode_requests`]): what the allocator makes the pod's template from.
pub const REQUESTS_ANNOTATION: &str = "gpuledger.io/claim-requests";
/// Label on gpuledger's ResourceClaimTemplates (and on their claims).
pub const MANAGED_LABEL: &str = "gpuledger.io/managed";
/// The device taint the node agent puts on an unhealthy GPU's slice device (KEP-5055): the
/// scheduler places no new claim there (`NoSchedule`), or also evicts its pods (`NoExecute`).
pub const UNHEALTHY_TAINT: &str = "gpu.gpuledger.io/unhealthy";
/// The capacity names of gpuledger's devices: memory (a quantity of bytes, published in MiB)
/// and cores (thousandths of the GPU).
pub const MEMORY: &str = "memory";
/// See [`MEMORY`].
pub const CORES: &str = "cores";
/// How gpuledger's DRA devices state their [`CORES`] capacity, one choice per cluster (the
/// allocator's `--dra-cores`, recorded on every node it registers): what a node's slice
/// publishes, what claim templates ask, and what certification reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CoresUnit {
    /// Thousandths of the GPU: the device has `cores: 1000`, a claim asks `cores: "300"`.
    #[default]
    Thousandths,
    /// A fraction of the GPU: the device has `cores: 1`, in steps of `1m`, and a claim asks
    /// `cores: "0.3"` (or `300m`). Needs Kubernetes' `DRAFractionalCapacityRange` (1.37, beta,
    /// off in kube-scheduler unless its gate or `--min-compatibility-version=1.37` says so):
    /// without it the scheduler rounds every request up to the whole GPU.
    Fraction,
}

impl CoresUnit {
    /// The name a flag and `NodeInventory.dra_cores` use.
    pub fn as_str(self) -> &'static str {
        match self {
            CoresUnit::Thousandths => "thousandths",
            CoresUnit::Fraction => "fraction",
        }
    }

    /// `NodeInventory.dra_cores` as recorded: empty is [`CoresUnit::Thousandths`], the unit
    /// before the field existed.
    pub fn of_record(s: &str) -> Result<CoresUnit, String> {
        if s.is_empty() {
            Ok(CoresUnit::Thousandths)
        } else {
            s.parse()
        }
    }

    /// The suffix of a core_milli amount written as a quantity of this unit.
    pub fn suffix(self) -> &'static str {
        match self {
            CoresUnit::Thousandths => "",
            CoresUnit::Fraction => "m",
        }
    }

    /// `core_milli` (1000 = the whole GPU) as a quantity of this unit.
    pub fn quantity(self, core_milli: u64) -> Quantity {
        Quantity(format!("{core_milli}{}", self.suffix()))
    }

    /// One core_milli in this unit's quantities.
    fn per_core_milli(self) -> f64 {
        match self {
            CoresUnit::Thousandths => 1.0,
            CoresUnit::Fraction => 0.001,
        }
    }
}

impl std::str::FromStr for CoresUnit {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "thousandths" => Ok(CoresUnit::Thousandths),
            "fraction" => Ok(CoresUnit::Fraction),
            _ => Err(format!(
                "{s:?} is not a unit of cores: `thousandths` (cores: 1000 is the GPU) or                  `fraction` (cores: 1 is the GPU; Kubernetes 1.37's DRAFractionalCapacityRange)"
            )),
        }
    }
}

impl fmt::Display for CoresUnit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Largest quantity taken from a claim (bytes or units): 2^50, far above any GPU.
const MAX_QUANTITY: f64 = (1u64 << 50) as f64;
const MIB: f64 = 1024.0 * 1024.0;

/// One GPU container's request of the claim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
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
    crate::containers(pod).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    for (i, c) in spec.containers.iter().enumerate() {
        let g = crate::ContainerGpu::of(c).map_err(|e| e.to_string())?;
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
                crate::GPU_MEM
            ));
        } else if r.mem_mib == 0 {
            return Err(format!(
                "container {:?} asks for GPU compute without GPU memory: a DRA grant holds at \
                 least 1 MiB; add {} (MiB), or annotate the pod {PATH_KEY}: device-plugin",
                c.name,
                crate::GPU_MEM
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
pub fn template_spec(reqs: &[ClaimRequest], cores: CoresUnit) -> ResourceClaimTemplateSpec {
    let requests = reqs
        .iter()
        .map(|r| {
            let mut caps = BTreeMap::new();
            if let Some(m) = r.mem_mib {
                caps.insert(MEMORY.to_string(), Quantity(format!("{m}Mi")));
            }
            caps.insert(CORES.to_string(), cores.quantity(u64::from(r.core_milli)));
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
    format!("{TEMPLATE_PREFIX}{hex}")
}

/// The template for `reqs` in namespace `ns`.
pub fn template(ns: &str, reqs: &[ClaimRequest], cores: CoresUnit) -> ResourceClaimTemplate {
    let spec = template_spec(reqs, cores);
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
        let value = |q: Option<&Quantity>| q.map(|q| crate::parse_quantity(&q.0));
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

/// Longest [`REQUESTS_ANNOTATION`] value accepted (64 containers of the longest request fit).
pub const MAX_REQUESTS_ANNOTATION: usize = 8 << 10;

/// The value of [`REQUESTS_ANNOTATION`] for `reqs` (JSON).
pub fn encode_requests(reqs: &[ClaimRequest]) -> String {
    serde_json::to_string(reqs).unwrap_or_default()
}

/// The claim requests a [`REQUESTS_ANNOTATION`] names, each checked against the bounds the
/// webhook's conversion keeps (at most [`crate::MAX_CONTAINERS`] GPU containers, 1–64 GPUs
/// each, compute 0–1000, memory 1 MiB to the largest GPU, names `c<container>`).
pub fn decode_requests(v: &str) -> Result<Vec<ClaimRequest>, String> {
    if v.len() > MAX_REQUESTS_ANNOTATION {
        return Err(format!(
            "annotation {REQUESTS_ANNOTATION} is {} bytes, over {MAX_REQUESTS_ANNOTATION}",
            v.len()
        ));
    }
    let reqs: Vec<ClaimRequest> = serde_json::from_str(v)
        .map_err(|e| format!("annotation {REQUESTS_ANNOTATION} is not a list of requests: {e}"))?;
    if reqs.is_empty() || reqs.len() > crate::MAX_CONTAINERS {
        return Err(format!(
            "annotation {REQUESTS_ANNOTATION} names {} requests: 1 to {} are possible",
            reqs.len(),
            crate::MAX_CONTAINERS
        ));
    }
    let most_mib = crate::InventoryLimits::CEILING.max_gpu_memory_mib;
    let mut seen = std::collections::BTreeSet::new();
    for r in &reqs {
        let ok = r.name == format!("c{}", r.container)
            && seen.insert(r.container)
            && (1..=64).contains(&r.count)
            && r.core_milli <= 1000
            && r.mem_mib.is_none_or(|m| (1..=most_mib).contains(&m));
        if !ok {
            return Err(format!(
                "annotation {REQUESTS_ANNOTATION}: request {r:?} is not one the webhook makes"
            ));
        }
    }
    Ok(reqs)
}

/// The template pod `pod` of namespace `ns` claims, when it is a pod the webhook converted:
/// None when it claims no gpuledger template; the template its [`REQUESTS_ANNOTATION`] makes
/// when that template has the name the pod claims; why not otherwise (a pod that names one
/// template and asks for another gets none).
pub fn template_of_pod(
    ns: &str,
    pod: &Pod,
    cores: CoresUnit,
) -> Option<Result<ResourceClaimTemplate, String>> {
    let claimed = claimed_template(pod)?;
    let Some(v) = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(REQUESTS_ANNOTATION))
    else {
        return Some(Err(format!(
            "the pod claims template {claimed} but has no annotation {REQUESTS_ANNOTATION}"
        )));
    };
    Some(decode_requests(v).and_then(|reqs| {
        let t = template(ns, &reqs, cores);
        let name = t.metadata.name.as_deref().unwrap_or("");
        if name == claimed {
            Ok(t)
        } else {
            Err(format!(
                "the pod claims template {claimed}, but its annotation {REQUESTS_ANNOTATION} \
                 makes {name}"
            ))
        }
    }))
}

/// The gpuledger template (named with [`TEMPLATE_PREFIX`]) that pod `pod`'s claim
/// [`POD_CLAIM`] is made from, if it has one.
pub fn claimed_template(pod: &Pod) -> Option<String> {
    let name = pod
        .spec
        .as_ref()?
        .resource_claims
        .as_ref()?
        .iter()
        .find(|c| c.name == POD_CLAIM)?
        .resource_claim_template_name
        .clone()?;
    name.starts_with(TEMPLATE_PREFIX).then_some(name)
}

/// The request a container names for an allocation result of `request`: a result allocated
/// from a `firstAvailable` subrequest is named `request/subrequest`, and the kubelet gives a
/// device to the containers naming `request` only when the driver answers that name
/// (upstream's kubelet plugin helper strips the suffix the same way).
pub fn main_request(request: &str) -> &str {
    request.split_once('/').map_or(request, |(main, _)| main)
}

/// The name of every template of gpuledger's starts with it.
pub const TEMPLATE_PREFIX: &str = "gpuledger-";

/// One allocation result of a ResourceClaim for [`DRIVER`], as the API server has it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimResult {
    /// The claim's request (or `request/subrequest`).
    pub request: String,
    /// The pool (gpuledger's pools are named after their node).
    pub pool: String,
    /// The device (`gpu-<uuid>`).
    pub device: String,
    /// The shareID; empty when the device was allocated whole.
    pub share_id: String,
    /// `consumedCapacity` as the scheduler wrote it (None: absent).
    pub consumed: Option<BTreeMap<String, String>>,
    /// `adminAccess: true`: access to a device in use, which gpuledger never grants.
    pub admin_access: bool,
}

impl ClaimResult {
    /// The share `consumedCapacity` declares: memory in whole MiB and cores in whole
    /// core_milli (read in the node's `cores` unit), each None when absent or not a whole
    /// number of its unit; None without `consumedCapacity`.
    pub fn declared(&self, cores: CoresUnit) -> Option<(Option<u64>, Option<u64>)> {
        self.consumed.as_ref().map(|m| {
            (
                m.get(MEMORY).and_then(|q| exact(q, MIB)),
                m.get(CORES).and_then(|q| exact(q, cores.per_core_milli())),
            )
        })
    }
}

/// The allocation results of [`DRIVER`] in claim `rc`, every other driver's left out; None
/// when the claim is not allocated.
pub fn claim_results(rc: &ResourceClaim) -> Option<Vec<ClaimResult>> {
    let results = rc
        .status
        .as_ref()?
        .allocation
        .as_ref()?
        .devices
        .as_ref()?
        .results
        .as_ref()?;
    Some(
        results
            .iter()
            .filter(|r| r.driver == DRIVER)
            .map(|r| ClaimResult {
                request: r.request.clone(),
                pool: r.pool.clone(),
                device: r.device.clone(),
                share_id: r.share_id.clone().unwrap_or_default(),
                consumed: r
                    .consumed_capacity
                    .as_ref()
                    .map(|m| m.iter().map(|(k, q)| (k.clone(), q.0.clone())).collect()),
                admin_access: r.admin_access.unwrap_or(false),
            })
            .collect(),
    )
}

/// What a device request asks of one of gpuledger's devices in `capacity.requests`: memory
/// in MiB and cores, each rounded up to a whole unit, None when left out (the device's
/// request policy then gives the whole GPU).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CapacityAsk {
    /// MiB, rounded up.
    pub memory_mib: Option<u64>,
    /// Thousandths of the GPU, rounded up.
    pub cores: Option<u64>,
}

/// Decode `capacity.requests` of a request for gpuledger's devices, by the scheduler's rule:
/// a key is a capacity name of the device as published, compared exactly ([`MEMORY`],
/// [`CORES`]); a request naming any other capacity (`gpu.gpuledger.io/memory` included)
/// fits none of gpuledger's devices, so it is refused, never read as something else.
pub fn capacity_ask(
    caps: Option<&CapacityRequirements>,
    cores: CoresUnit,
) -> Result<CapacityAsk, String> {
    let mut ask = CapacityAsk::default();
    for (name, q) in caps.and_then(|c| c.requests.as_ref()).into_iter().flatten() {
        let (slot, unit) = match name.as_str() {
            MEMORY => (&mut ask.memory_mib, MIB),
            CORES => (&mut ask.cores, cores.per_core_milli()),
            _ => {
                return Err(format!(
                    "capacity {name:?} is not one of gpuledger's devices (they have \
                     {MEMORY:?} and {CORES:?}); no device can be allocated for it"
                ));
            }
        };
        *slot = Some(round_up(&q.0, unit).map_err(|e| format!("capacity {name}: {e}"))?);
    }
    Ok(ask)
}

/// One container request per request of `spec` for [`DEVICE_CLASS`] (in `exactly`), named
/// `<pod_claim>/<request>`, judged as the allocator certifies its allocation; requests for
/// other classes are left out. Why not, when the claim asks for our devices in a way gpuledger
/// does not place (the pod must change).
pub fn spec_containers(
    pod_claim: &str,
    spec: &ResourceClaimSpec,
    cores: CoresUnit,
) -> Result<Vec<gpuledger_proto::allocator::v1::ContainerRequest>, String> {
    let mut out = Vec::new();
    let requests = spec.devices.as_ref().and_then(|d| d.requests.as_ref());
    for r in requests.into_iter().flatten() {
        let name = format!("{pod_claim}/{}", r.name);
        let Some(e) = &r.exactly else {
            let ours = r
                .first_available
                .iter()
                .flatten()
                .any(|s| s.device_class_name == DEVICE_CLASS);
            if ours {
                return Err(format!(
                    "request {name} lists {DEVICE_CLASS} among firstAvailable subrequests, \
                     which gpuledger does not place; ask for it in `exactly`"
                ));
            }
            continue;
        };
        if e.device_class_name != DEVICE_CLASS {
            continue;
        }
        out.push(exact_container(&name, e, cores)?);
    }
    Ok(out)
}

/// The container request of one `exactly` request of our class. A capacity it leaves out is
/// the whole GPU's (the device's request policy default).
pub fn exact_container(
    name: &str,
    e: &ExactDeviceRequest,
    cores: CoresUnit,
) -> Result<gpuledger_proto::allocator::v1::ContainerRequest, String> {
    let bad = |m: String| format!("request {name}: {m}");
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
    let ask = capacity_ask(e.capacity.as_ref(), cores).map_err(bad)?;
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
    Ok(gpuledger_proto::allocator::v1::ContainerRequest {
        name: name.to_string(),
        slices,
        mem_mib,
        mem_percent,
        core_milli,
    })
}

/// A quantity in `unit`s, rounded up.
fn round_up(q: &str, unit: f64) -> Result<u64, String> {
    let v = crate::parse_quantity(q)?;
    if !(0.0..=MAX_QUANTITY).contains(&v) {
        return Err(format!("{q:?} is out of range"));
    }
    Ok(units(v, unit).unwrap_or_else(|| (v / unit).ceil() as u64))
}

/// `v` as a whole number of `unit`s when it is one, within the float error of a decimal
/// unit (`0.3` is not 300 thousandths exactly in binary; a billionth of a unit is far below
/// what any quantity of ours states).
fn units(v: f64, unit: f64) -> Option<u64> {
    let n = v / unit;
    let r = n.round();
    ((n - r).abs() <= 1e-9).then_some(r as u64)
}

/// A quantity as a whole number of `unit`s; None when it is not one.
fn exact(q: &str, unit: f64) -> Option<u64> {
    let v = crate::parse_quantity(q).ok()?;
    if !(0.0..=MAX_QUANTITY).contains(&v) {
        return None;
    }
    units(v, unit)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(mib: Option<u64>, cores: u32) -> Vec<ClaimRequest> {
        vec![ClaimRequest {
            container: 0,
            name: "c0".into(),
            count: 1,
            mem_mib: mib,
            core_milli: cores,
        }]
    }

    fn caps(pairs: &[(&str, &str)]) -> CapacityRequirements {
        CapacityRequirements {
            requests: Some(
                pairs
                    .iter()
                    .map(|(k, v)| (k.to_string(), Quantity(v.to_string())))
                    .collect(),
            ),
        }
    }

    #[test]
    fn capacity_is_read_by_the_devices_names_and_rounded_up() {
        let ask = capacity_ask(
            Some(&caps(&[("memory", "1.5Gi"), ("cores", "0.2k")])),
            CoresUnit::Thousandths,
        )
        .unwrap();
        assert_eq!(
            ask,
            CapacityAsk {
                memory_mib: Some(1536),
                cores: Some(200)
            }
        );
        let ask = capacity_ask(Some(&caps(&[("memory", "1")])), CoresUnit::Thousandths).unwrap();
        assert_eq!((ask.memory_mib, ask.cores), (Some(1), None));
        assert_eq!(
            capacity_ask(None, CoresUnit::Thousandths).unwrap(),
            CapacityAsk::default()
        );
        assert!(capacity_ask(Some(&caps(&[("memory", "-1Mi")])), CoresUnit::Thousandths).is_err());
        assert!(capacity_ask(Some(&caps(&[("cores", "lots")])), CoresUnit::Thousandths).is_err());
    }

    /// In the fraction unit a claim states cores as a part of the GPU: `0.3`, `300m` and
    /// `0.3333` (rounded up to the next thousandth) read as core_milli, the template writes
    /// `300m`, and a consumedCapacity is read back exactly; the thousandths unit reads `300`.
    #[test]
    fn cores_read_and_written_in_the_clusters_unit() {
        let f = CoresUnit::Fraction;
        for (q, want) in [
            ("0.3", 300),
            ("300m", 300),
            ("0.3333", 334),
            ("1", 1000),
            ("0", 0),
        ] {
            let ask = capacity_ask(Some(&caps(&[("cores", q)])), f).unwrap();
            assert_eq!(ask.cores, Some(want), "{q}");
        }
        let t = template_spec(&one(None, 250), f);
        let asked = t.spec.devices.unwrap().requests.unwrap()[0]
            .exactly
            .clone()
            .unwrap()
            .capacity
            .unwrap()
            .requests
            .unwrap();
        assert_eq!(asked[CORES], Quantity("250m".into()));
        let r = |q: &str| ClaimResult {
            request: "c0".into(),
            pool: "n".into(),
            device: "gpu-x".into(),
            share_id: "s".into(),
            consumed: Some(BTreeMap::from([(CORES.to_string(), q.to_string())])),
            admin_access: false,
        };
        assert_eq!(r("250m").declared(f), Some((None, Some(250))));
        assert_eq!(r("0.25").declared(f), Some((None, Some(250))));
        assert_eq!(
            r("250").declared(CoresUnit::Thousandths),
            Some((None, Some(250)))
        );
        // Not a whole thousandth: no share is read from it.
        assert_eq!(r("2505u").declared(f), Some((None, None)));
        // Two templates of one pod differ by unit, so a cluster's webhook and allocator must
        // agree on it (one flag, both binaries).
        assert_ne!(
            template_name(&template_spec(&one(None, 250), f)),
            template_name(&template_spec(&one(None, 250), CoresUnit::Thousandths))
        );
        assert_eq!(CoresUnit::of_record(""), Ok(CoresUnit::Thousandths));
        assert_eq!("fraction".parse(), Ok(CoresUnit::Fraction));
        assert!(
            "percent"
                .parse::<CoresUnit>()
                .unwrap_err()
                .contains("thousandths")
        );
    }

    /// The scheduler looks a request's capacity up by the device's own capacity names, and a
    /// device lacking a requested name is no candidate: `gpu.gpuledger.io/memory` fits none
    /// of our devices. The allocator used to read it as `memory`, the extender to ignore it
    /// (the whole GPU): both now refuse it, as the scheduler does.
    #[test]
    fn a_capacity_our_devices_do_not_have_is_refused() {
        for name in [
            "gpu.gpuledger.io/memory",
            "gpu.gpuledger.io/cores",
            "memoryMiB",
        ] {
            let why =
                capacity_ask(Some(&caps(&[(name, "1Gi")])), CoresUnit::Thousandths).unwrap_err();
            assert!(why.contains(name) && why.contains("no device"), "{why}");
        }
    }

    #[test]
    fn our_results_are_decoded_once_and_others_left_out() {
        let rc: ResourceClaim = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "c", "namespace": "ns", "uid": "u"},
            "spec": {},
            "status": {"allocation": {"devices": {"results": [
                {"request": "gpu/small", "driver": DRIVER, "pool": "n1", "device": "gpu-a",
                 "shareID": "s1", "consumedCapacity": {"memory": "2Gi", "cores": "300"}},
                {"request": "nic", "driver": "nic.example.com", "pool": "n1", "device": "eth0"},
                {"request": "all", "driver": DRIVER, "pool": "n1", "device": "gpu-b",
                 "adminAccess": true}
            ]}}}
        }))
        .unwrap();
        let r = claim_results(&rc).unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!(
            (r[0].request.as_str(), r[0].share_id.as_str()),
            ("gpu/small", "s1")
        );
        assert_eq!(
            r[0].declared(CoresUnit::Thousandths),
            Some((Some(2048), Some(300)))
        );
        assert!(
            r[1].admin_access
                && r[1].share_id.is_empty()
                && r[1].declared(CoresUnit::Thousandths).is_none()
        );
        let mut unallocated = rc.clone();
        unallocated.status = None;
        assert_eq!(claim_results(&unallocated), None);
        // A declared share that is no whole number of its unit declares nothing.
        let half = ClaimResult {
            consumed: Some(BTreeMap::from([(MEMORY.to_string(), "1.5Mi".to_string())])),
            ..r[0].clone()
        };
        assert_eq!(half.declared(CoresUnit::Thousandths), Some((None, None)));
    }

    #[test]
    fn a_subrequest_result_answers_its_main_request() {
        assert_eq!(main_request("gpu/small"), "gpu");
        assert_eq!(main_request("gpu"), "gpu");
    }

    #[test]
    fn requests_survive_the_annotation_and_absurd_ones_are_refused() {
        let reqs = one(Some(3000), 200);
        assert_eq!(decode_requests(&encode_requests(&reqs)).unwrap(), reqs);
        for bad in [
            r#"[]"#,
            r#"[{"container":0,"name":"c1","count":1,"memMib":1,"coreMilli":1}]"#,
            r#"[{"container":0,"name":"c0","count":0,"memMib":1,"coreMilli":1}]"#,
            r#"[{"container":0,"name":"c0","count":1,"memMib":0,"coreMilli":1}]"#,
            r#"[{"container":0,"name":"c0","count":1,"memMib":1,"coreMilli":1001}]"#,
            r#"[{"container":0,"name":"c0","count":1,"memMib":1,"coreMilli":1,"x":1}]"#,
            r#"{"container":0}"#,
        ] {
            assert!(decode_requests(bad).is_err(), "{bad}");
        }
        let twice = [one(Some(1), 1), one(Some(2), 2)].concat();
        assert!(decode_requests(&encode_requests(&twice)).is_err());
        assert!(decode_requests(&" ".repeat(MAX_REQUESTS_ANNOTATION + 1)).is_err());
    }

    #[test]
    fn a_stored_template_compares_by_value_and_names_what_differs() {
        let want = template("ns", &one(Some(2000), 200), CoresUnit::Thousandths);
        let mut got = want.clone();
        let set = |t: &mut ResourceClaimTemplate, cores: Option<&str>| {
            let e = t
                .spec
                .spec
                .devices
                .as_mut()
                .unwrap()
                .requests
                .as_mut()
                .unwrap()[0]
                .exactly
                .as_mut()
                .unwrap();
            e.capacity = cores.map(|q| CapacityRequirements {
                requests: Some(BTreeMap::from([
                    (MEMORY.to_string(), Quantity("2000Mi".into())),
                    (CORES.to_string(), Quantity(q.into())),
                ])),
            });
        };
        // The API server writes 200 as "0.2k": the same quantity.
        set(&mut got, Some("0.2k"));
        assert_eq!(same_template(&want, &got), Ok(()));
        set(&mut got, Some("1k"));
        let why = same_template(&want, &got).unwrap_err();
        assert!(
            why.contains("capacity.requests") && why.contains("delete it"),
            "{why}"
        );
        // A gate that is off drops capacity.requests: said so.
        set(&mut got, None);
        let why = same_template(&want, &got).unwrap_err();
        assert!(why.contains("DRAConsumableCapacity"), "{why}");
    }

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
        let c = exact_container(
            "p/c0",
            &exactly(&[("memory", "1G"), ("cores", "300")]),
            CoresUnit::Thousandths,
        )
        .unwrap();
        assert_eq!((c.mem_mib, c.mem_percent, c.core_milli), (954, 0, 300));
        let c = exact_container("p/c0", &exactly(&[]), CoresUnit::Thousandths).unwrap();
        assert_eq!((c.mem_mib, c.mem_percent, c.core_milli), (0, 100, 1000));
        assert!(
            exact_container(
                "p/c0",
                &exactly(&[("cores", "1001")]),
                CoresUnit::Thousandths
            )
            .is_err()
        );
        // The fraction unit: a quarter of the GPU; more than the GPU is named in that unit.
        let f = CoresUnit::Fraction;
        let c = exact_container("p/c0", &exactly(&[("cores", "0.25")]), f).unwrap();
        assert_eq!(c.core_milli, 250);
        let why = exact_container("p/c0", &exactly(&[("cores", "1.5")]), f).unwrap_err();
        assert!(why.contains("cores 1500m"), "{why}");
    }

    /// The scheduler allocates no device of ours for a capacity they do not publish: the
    /// extender used to take `gpu.gpuledger.io/memory` for the whole GPU, and the allocator
    /// for `memory`; both refuse it now.
    #[test]
    fn a_capacity_our_devices_do_not_publish_is_invalid() {
        let e = exact_container(
            "p/c0",
            &exactly(&[("gpu.gpuledger.io/memory", "2Gi")]),
            CoresUnit::Thousandths,
        )
        .unwrap_err();
        assert!(e.contains("gpu.gpuledger.io/memory"), "{e}");
    }
}
