//! The admission webhook (AdmissionReview v1, HTTPS only): `mutate` completes and translates
//! GPU requests, `validate` rejects what can never run with a message a user understands.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use base64::Engine;
use gpuledger_proto::allocator::v1 as api;
use json_patch::{Patch, PatchOperation};
use k8s_openapi::api::core::v1::{Pod, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::core::DynamicObject;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview};
use serde_json::{Value, json};
use tracing::field::{self, Empty};
use tracing::{Span, debug, info, instrument};

use self::patch::add;
use crate::allocator::Allocators;
use crate::resources::{self, ContainerGpu};

pub mod dra;
pub mod feasibility;
pub mod namespaces;
pub mod patch;
pub use dra::PodPath;
pub use feasibility::{Feasibility, Verdict};
pub use namespaces::NamespaceLabels;

/// Shared state of the webhook handlers.
#[derive(Clone)]
pub struct Webhook {
    /// Allocator replicas (validate asks how many GPUs the largest node has).
    pub allocators: Allocators,
    /// validate's answers per request shape, and the pace of its questions.
    pub feasible: Arc<Feasibility>,
    /// When set, mutate moves GPU pods of the default scheduler to this scheduler.
    pub scheduler_name: Option<String>,
    /// The ledger replica namespaces' budgets are read from (None: budgets are not applied).
    pub replica: Option<std::sync::Arc<crate::replica::Replica>>,
    /// The namespaces' labels, when the label `gpuledger.io/path` chooses the path of a pod
    /// whose annotation does not (None: every such GPU pod takes `pod_path`).
    pub namespaces: Option<NamespaceLabels>,
    /// The path of a GPU pod whose annotation and namespace do not choose one.
    pub pod_path: PodPath,
    /// The unit the DRA path's templates state `cores` in (`--dra-cores`).
    pub dra_cores: gpuledger_request::dra::CoresUnit,
}

/// The webhook routes.
pub fn router(w: Webhook) -> Router {
    Router::new()
        .route("/mutate", post(mutate))
        .route("/validate", post(validate))
        .route("/healthz", get(|| async { "ok" }))
        .with_state(w)
}

/// The AdmissionReview that carries `resp` back, in the API server's own encoding: kube-core
/// writes `patch` (a Go `[]byte`) as an array of numbers and an allowed answer's empty status
/// as `{}`, where the API server writes a base64 string and no status (as the captured
/// kube-1.20 answers show).
fn answer(mut resp: AdmissionResponse) -> Response {
    let patch = resp.patch.take();
    let mut v = match serde_json::to_value(resp.into_review()) {
        Ok(v) => v,
        Err(e) => return (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    };
    if let Some(r) = v.get_mut("response").and_then(Value::as_object_mut) {
        if let Some(p) = patch {
            let b64 = base64::engine::general_purpose::STANDARD.encode(p);
            r.insert("patch".into(), Value::String(b64));
        }
        if r.get("status").is_some_and(|s| s == &json!({})) {
            r.remove("status");
        }
    }
    axum::Json(v).into_response()
}

/// Decode an AdmissionReview body: its request and its pod (None for anything that is not a
/// pod).
pub fn parse(body: &[u8]) -> Result<(AdmissionRequest<DynamicObject>, Option<Pod>), String> {
    let review: AdmissionReview<DynamicObject> =
        serde_json::from_slice(body).map_err(|e| format!("malformed AdmissionReview: {e}"))?;
    let req: AdmissionRequest<DynamicObject> = review
        .try_into()
        .map_err(|_| "AdmissionReview has no request".to_string())?;
    let pod = match &req.object {
        Some(obj) if req.kind.kind == "Pod" => Some(
            obj.clone()
                .try_parse::<Pod>()
                .map_err(|e| format!("the pod cannot be read: {e}"))?,
        ),
        _ => None,
    };
    Ok((req, pod))
}

fn fmt_num(v: f64) -> Quantity {
    Quantity(format!("{}", v.ceil() as i64))
}

/// The container's resources with aliases replaced by gpuledger names and the slice count
/// made explicit; None when nothing changes. No name a node does not advertise is left.
fn translate(res: Option<&ResourceRequirements>, g: &ContainerGpu) -> Option<ResourceRequirements> {
    let hami = [
        resources::HAMI_GPU_MEM,
        resources::HAMI_GPU_MEM_PERCENT,
        resources::HAMI_GPU_CORES,
    ];
    let mut res = res.cloned().unwrap_or_default();
    // nvidia.com/gpu is HAMi's GPU count only beside HAMi's other names (as `ContainerGpu::of`
    // reads it); otherwise it stays for NVIDIA's device plugin.
    let hami_count = [res.limits.as_ref(), res.requests.as_ref()]
        .into_iter()
        .flatten()
        .any(|m| hami.iter().any(|k| m.contains_key(*k)));
    let mut aliases = vec![
        resources::ALIYUN_GPU_MEM,
        resources::VCUDA_CORE,
        resources::VCUDA_MEMORY,
    ];
    aliases.extend(hami);
    if hami_count {
        aliases.push(resources::HAMI_GPU);
    }
    let mut changed = false;
    for map in [res.limits.as_mut(), res.requests.as_mut()]
        .into_iter()
        .flatten()
    {
        let had_alias = aliases.iter().any(|a| map.contains_key(*a));
        for a in &aliases {
            map.remove(*a);
        }
        let mut set = |map: &mut BTreeMap<String, Quantity>, k: &str, v: Option<Quantity>| {
            if let Some(v) = v
                && !map.contains_key(k)
            {
                map.insert(k.to_string(), v);
                changed = true;
            }
        };
        // The count as written (a fraction stays one, for the API server to refuse).
        set(
            map,
            resources::GPU,
            Some(Quantity(g.slices.unwrap_or(1.0).to_string())),
        );
        set(map, resources::GPU_MEM, g.mem_mib.map(fmt_num));
        set(map, resources::GPU_MEM_PERCENT, g.mem_percent.map(fmt_num));
        set(map, resources::GPU_CORE, g.core_percent.map(fmt_num));
        changed |= had_alias;
    }
    if res.limits.is_none() {
        // Only requests were written: extended resources need limits too.
        let limits = res
            .requests
            .iter()
            .flatten()
            .filter(|(k, _)| k.starts_with("gpuledger.io/"))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        res.limits = Some(limits);
        changed = true;
    }
    changed.then_some(res)
}

/// The JSON Patch that mutate answers for `pod`.
pub fn mutation(pod: &Pod, scheduler_name: Option<&str>) -> Result<Patch, String> {
    let mut ops = Vec::new();
    let mut any_gpu = false;
    let Some(spec) = pod.spec.as_ref() else {
        return Ok(Patch(ops));
    };
    for (i, c) in spec.containers.iter().enumerate() {
        let g = ContainerGpu::of(c).map_err(|e| e.to_string())?;
        if !g.wants_gpu() {
            continue;
        }
        any_gpu = true;
        if let Some(res) = translate(c.resources.as_ref(), &g) {
            let value = serde_json::to_value(res).map_err(|e| e.to_string())?;
            ops.push(add(
                &["spec", "containers", &i.to_string(), "resources"],
                value,
            ));
        }
    }
    if any_gpu && let Some(op) = scheduler_op(pod, scheduler_name) {
        ops.push(op);
    }
    Ok(Patch(ops))
}

/// Move a GPU pod of the default scheduler to `scheduler_name`, if one is set.
fn scheduler_op(pod: &Pod, scheduler_name: Option<&str>) -> Option<PatchOperation> {
    let spec = pod.spec.as_ref()?;
    let name = scheduler_name?;
    matches!(
        spec.scheduler_name.as_deref(),
        None | Some("") | Some("default-scheduler")
    )
    .then(|| add(&["spec", "schedulerName"], Value::String(name.into())))
}

/// The JSON Patch that converts a GPU pod to the DRA path ([`dra`]). It creates nothing: the
/// allocator makes the template the pod claims once the pod exists.
pub fn dra_mutation(
    pod: &Pod,
    scheduler_name: Option<&str>,
    cores: gpuledger_request::dra::CoresUnit,
) -> Result<Patch, String> {
    let reqs = gpuledger_request::dra::claim_requests(pod)?;
    if reqs.is_empty() {
        return Ok(Patch(Vec::new()));
    }
    let spec = gpuledger_request::dra::template_spec(&reqs, cores);
    let name = gpuledger_request::dra::template_name(&spec);
    let mut ops = dra::patch_ops(pod, &reqs, &name)?;
    ops.extend(scheduler_op(pod, scheduler_name));
    Ok(Patch(ops))
}

/// Name the review and its pod on the current request's span.
fn record_review(req: &AdmissionRequest<DynamicObject>, pod: Option<&Pod>) {
    let span = Span::current();
    span.record("review", req.uid.as_str());
    if let Some(p) = pod {
        let m = &p.metadata;
        let name = m
            .name
            .as_deref()
            .or(m.generate_name.as_deref())
            .unwrap_or("");
        let ns = m
            .namespace
            .as_deref()
            .or(req.namespace.as_deref())
            .unwrap_or("");
        span.record("pod", field::display(format_args!("{ns}/{name}")));
    }
}

#[instrument(name = "mutate", skip_all, fields(review = Empty, pod = Empty))]
async fn mutate(State(w): State<Webhook>, body: Bytes) -> Response {
    let (req, pod) = match parse(&body) {
        Ok(x) => x,
        Err(e) => return (StatusCode::BAD_REQUEST, e).into_response(),
    };
    record_review(&req, pod.as_ref());
    let allowed = AdmissionResponse::from(&req);
    let Some(pod) = pod else {
        return answer(allowed);
    };
    let ns = namespace_of(&req, &pod);
    let gpu = resources::containers(&pod).is_ok_and(|c| !c.is_empty());
    let path = if gpu {
        match dra::path_of(w.namespaces.as_ref(), &pod, &ns, w.pod_path).await {
            Ok(p) => p,
            Err(m) => return refuse(allowed, m),
        }
    } else {
        PodPath::DevicePlugin
    };
    let ops = match path {
        PodPath::DevicePlugin => mutation(&pod, w.scheduler_name.as_deref()),
        PodPath::Dra => {
            let sched = w.scheduler_name.as_deref();
            match dra_mutation(&pod, sched, w.dra_cores) {
                Ok(ops) => {
                    info!(dry_run = req.dry_run, "converted to the DRA path");
                    Ok(ops)
                }
                Err(m) => return refuse(allowed, m),
            }
        }
    };
    match ops {
        // Malformed quantities are validate's to reject, with its message.
        Err(_) => answer(allowed),
        Ok(mut ops) => {
            let allowed = budget_hook(&w, &pod, &ns, allowed, &mut ops).await;
            if ops.is_empty() {
                return answer(allowed);
            }
            let n = ops.len();
            match allowed.with_patch(ops) {
                Ok(r) => {
                    info!(ops = n, "mutated");
                    answer(r)
                }
                Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
            }
        }
    }
}

/// Deny the review with `m`, as validate denies.
fn refuse(allowed: AdmissionResponse, m: String) -> Response {
    info!(reason = %m, "denied");
    let mut denied = allowed.deny(m);
    denied.result.code = 422;
    answer(denied)
}

/// The pod's namespace: a pod being created often carries none, the review always does.
fn namespace_of(req: &AdmissionRequest<DynamicObject>, pod: &Pod) -> String {
    pod.metadata
        .namespace
        .clone()
        .or_else(|| req.namespace.clone())
        .unwrap_or_default()
}

/// A GPU pod of a namespace whose budget is spent: demoted (`ops` gain the patch) or warned.
async fn budget_hook(
    w: &Webhook,
    pod: &Pod,
    ns: &str,
    mut allowed: AdmissionResponse,
    ops: &mut Patch,
) -> AdmissionResponse {
    use crate::budget_admission::{self as b, Verdict};
    if !resources::containers(pod).is_ok_and(|c| !c.is_empty()) {
        return allowed;
    }
    let now = jiff::Timestamp::now().as_millisecond();
    match b::check(w.replica.as_deref(), ns, now).await {
        Verdict::Demote {
            priority_class,
            why,
        } => {
            info!(%priority_class, reason = %why, "demoted");
            let demote = b::demotion(pod, &ops.0, &priority_class, &why);
            ops.0.extend(demote);
            allowed.warnings = Some(vec![format!("demoted to {priority_class}: {why}")]);
        }
        Verdict::Warn(why) => allowed.warnings = Some(vec![why]),
        Verdict::Within | Verdict::Deny(_) => {}
    }
    allowed
}

/// Why the pod must be refused, if it must (asked of the allocator through `feasible`).
pub async fn check(feasible: &Feasibility, allocators: &Allocators, pod: &Pod) -> Option<String> {
    let cs = match resources::containers(pod) {
        Ok(cs) => cs,
        Err(e) => return Some(e.to_string()),
    };
    if cs.is_empty() {
        return None;
    }
    if let Err(e) = resources::placement(pod) {
        return Some(e.to_string());
    }
    let mut sizes = Vec::with_capacity(cs.len());
    for c in &cs {
        match c.to_api() {
            Ok(r) => sizes.push(r),
            Err(e) => return Some(e.to_string()),
        }
    }
    let most = sizes.iter().map(|c| c.slices).max().unwrap_or(0);
    if most > 1 {
        // Can any node ever hold `most` slices on distinct GPUs? Ask with a minimal request.
        let one = api::ContainerRequest {
            name: "probe".into(),
            slices: most,
            mem_mib: 1,
            ..Default::default()
        };
        if let Verdict::Never(why) = feasible.never_fits(allocators, vec![one]).await {
            let name = cs
                .iter()
                .find(|c| c.slices.unwrap_or(1.0) as u32 == most)
                .map_or("?", |c| c.name.as_str());
            debug!(%why, "no node has enough GPUs");
            return Some(format!(
                "container {name:?} asks for {most} GPU slices ({}), each on a distinct GPU, but no \
                 node in the cluster has {most} GPUs",
                resources::GPU
            ));
        }
    }
    // Can any node ever hold the sizes it asks for (selectors aside: a GPU type may come)?
    match feasible.never_fits(allocators, sizes).await {
        Verdict::Never(why) => Some(format!(
            "no node in the cluster can ever hold this pod: {why}"
        )),
        Verdict::Unchecked => {
            debug!("validate checks over --validate-checks-per-s: admitted unchecked");
            None
        }
        Verdict::Fits => None,
    }
}

#[instrument(name = "validate", skip_all, fields(review = Empty, pod = Empty))]
async fn validate(State(w): State<Webhook>, body: Bytes) -> Response {
    let (req, pod) = match parse(&body) {
        Ok(x) => x,
        Err(e) => return (StatusCode::BAD_REQUEST, e).into_response(),
    };
    record_review(&req, pod.as_ref());
    let allowed = AdmissionResponse::from(&req);
    let Some(pod) = pod else {
        return answer(allowed);
    };
    let refusal = match check(&w.feasible, &w.allocators, &pod).await {
        Some(m) => Some(m),
        // A pod converted to the DRA path is a GPU pod too: its namespace's budget applies.
        None if resources::containers(&pod).is_ok_and(|c| !c.is_empty())
            || resources::has_dra_marker(&pod) =>
        {
            let now = jiff::Timestamp::now().as_millisecond();
            let ns = namespace_of(&req, &pod);
            match crate::budget_admission::check(w.replica.as_deref(), &ns, now).await {
                crate::budget_admission::Verdict::Deny(why) => Some(why),
                _ => None,
            }
        }
        None => None,
    };
    match refusal {
        None => answer(allowed),
        Some(m) => {
            info!(reason = %m, "denied");
            let mut denied = allowed.deny(m);
            denied.result.code = 422;
            answer(denied)
        }
    }
}
