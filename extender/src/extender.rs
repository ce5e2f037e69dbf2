//! The kube-scheduler extender: `filter`, `prioritize`, `bind` and `preempt` over HTTP, in the
//! exact JSON kube-scheduler sends (k8s.io/kube-scheduler/extender/v1: Go field names, no tags).
//! Filter and prioritize are answered from a read-only replica of the ledger while it is fresh
//! (see [`crate::replica`]), otherwise by an allocator replica; bind always goes through the
//! allocator's `Reserve` and the API server.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::http::header::CONTENT_TYPE;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use gpuledger_ledger::placement;
use gpuledger_ops::events::{Kind, PodEvent, Recorder};
use gpuledger_proto::allocator::v1 as api;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tonic::Code;
use tracing::{debug, info, warn};

use crate::allocator::Allocators;
use crate::metrics::{Metrics, Outcome};
use crate::parallel;
use crate::replica::Replica;
use crate::resources::{self, ANN_ALLOCATION};
use crate::scheduler_text;

/// Where a test asks the process to die (a stand-in for a crash at the worst moment).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum CrashAt {
    /// After the reservation, before the Binding is created.
    BeforeBinding,
    /// After the Binding is created, before the allocator is told.
    AfterBinding,
}

/// Shared state of the HTTP handlers.
#[derive(Clone)]
pub struct App {
    /// Allocator replicas.
    pub allocators: Allocators,
    /// API server client (bind needs it).
    pub kube: Option<kube::Client>,
    /// Test-only crash point.
    pub crash_at: Option<CrashAt>,
    /// Pod Events (placed on GPU …); None without a Kubernetes client.
    pub events: Option<Recorder>,
    /// Verb latencies and outcomes, served at /metrics.
    pub metrics: Arc<Metrics>,
    /// The local replica of the ledger filter and prioritize read (None = always ask the
    /// allocator).
    pub replica: Option<Arc<Replica>>,
}

/// `ExtenderArgs`: the body of filter, prioritize (and the pod of preempt).
#[derive(Debug, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct ExtenderArgs<'a> {
    /// The pod being scheduled.
    pub pod: Option<Pod>,
    /// Full nodes (extender not nodeCacheCapable).
    pub nodes: Option<NodeList>,
    /// Node names (nodeCacheCapable), borrowed from the request body.
    #[serde(borrow)]
    pub node_names: Option<Vec<Name<'a>>>,
}

/// A node name as the request spells it: borrowed from the body (thousands per request),
/// copied only when JSON escapes make that necessary.
#[derive(Debug, Clone)]
pub struct Name<'a>(pub Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for Name<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Str;
        impl<'de> serde::de::Visitor<'de> for Str {
            type Value = Cow<'de, str>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a node name")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Cow::Borrowed(v))
            }
            fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Cow::Owned(v.to_owned()))
            }
            fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
                Ok(Cow::Owned(v))
            }
        }
        d.deserialize_str(Str).map(Name)
    }
}

/// A `v1.NodeList` kept as raw JSON so that filter hands back exactly what it got.
#[derive(Debug, Default, Deserialize, Serialize)]
pub struct NodeList {
    /// List metadata, passed through.
    #[serde(default)]
    pub metadata: Value,
    /// The nodes.
    #[serde(default)]
    pub items: Vec<Value>,
}

/// `ExtenderFilterResult`.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct FilterResult {
    /// Feasible nodes, when the request carried full nodes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nodes: Option<NodeList>,
    /// Feasible node names, when the request carried names.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node_names: Option<Vec<String>>,
    /// Node → why the pod does not fit, for every node it does not fit on: kube-scheduler 1.20
    /// reads only this map.
    #[serde(serialize_with = "scheduler_text::reasons")]
    pub failed_nodes: BTreeMap<String, String>,
    /// Node → why the pod can never fit (preemption will not help). Newer schedulers read it
    /// too, and let it win for a node that is in both maps.
    #[serde(serialize_with = "scheduler_text::reasons")]
    pub failed_and_unresolvable_nodes: BTreeMap<String, String>,
    /// Set when the extender could not decide.
    #[serde(serialize_with = "scheduler_text::text")]
    pub error: String,
}

/// One entry of `HostPriorityList`.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct HostPriority<'a> {
    /// Node name.
    pub host: Cow<'a, str>,
    /// 0..10.
    pub score: i64,
}

/// `ExtenderBindingArgs`.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct BindingArgs {
    /// Pod name.
    pub pod_name: String,
    /// Pod namespace.
    pub pod_namespace: String,
    /// Pod UID.
    #[serde(rename = "PodUID")]
    pub pod_uid: String,
    /// The node chosen by the scheduler.
    pub node: String,
}

/// `ExtenderBindingResult`.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct BindingResult {
    /// Empty on success.
    #[serde(serialize_with = "scheduler_text::text")]
    pub error: String,
}

/// `ExtenderPreemptionArgs`.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct PreemptionArgs {
    /// The pod that wants to preempt.
    pub pod: Option<Pod>,
    /// Node → victims as full pods.
    #[serde(default)]
    pub node_name_to_victims: Option<BTreeMap<String, Value>>,
    /// Node → victims as UIDs.
    #[serde(default)]
    pub node_name_to_meta_victims: Option<BTreeMap<String, Value>>,
}

/// `ExtenderPreemptionResult`.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct PreemptionResult {
    /// Node → victims as UIDs, for the nodes where preemption can help.
    pub node_name_to_meta_victims: BTreeMap<String, Value>,
}

/// The extender's routes, served at the root and under `/gpuledger`.
pub fn router(app: App) -> Router {
    let metrics = app.metrics.clone();
    let verbs = Router::new()
        .route("/filter", post(filter))
        .route("/prioritize", post(prioritize))
        .route("/bind", post(bind))
        .route("/preempt", post(preempt));
    Router::new()
        .merge(verbs.clone())
        .nest("/gpuledger", verbs)
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .with_state(app)
        .merge(gpuledger_ops::metrics::router(metrics.registry.clone()))
        .layer(axum::middleware::from_fn_with_state(
            metrics,
            crate::metrics::track,
        ))
}

/// Ready when an allocator replica answers and can serve grants: without one every verb
/// would fail, so a Service should route the scheduler elsewhere.
async fn readyz(State(app): State<App>) -> Response {
    let st = app
        .allocators
        .call(|mut c| async move { c.status(api::StatusRequest {}).await })
        .await;
    match st {
        Ok(s) if s.ready => (StatusCode::OK, "ready\n".to_string()).into_response(),
        Ok(s) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "not ready: allocator {} cannot serve grants: {}\n",
                s.address, s.not_ready_reason
            ),
        )
            .into_response(),
        Err(e) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {}\n", e.message()),
        )
            .into_response(),
    }
}

/// Mark a response that answers 200 but reports a failure.
fn failed(mut resp: Response) -> Response {
    resp.extensions_mut().insert(Outcome("error"));
    resp
}

/// `v` as a JSON response, serialized into one buffer of about `hint` bytes (axum's `Json`
/// grows its buffer from 128 bytes: a dozen copies for 5,000 nodes).
fn json_sized<T: Serialize>(v: &T, hint: usize) -> Response {
    let mut buf = Vec::with_capacity(hint);
    match serde_json::to_writer(&mut buf, v) {
        Ok(()) => ([(CONTENT_TYPE, "application/json")], buf).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

fn bad_request(what: &str, e: impl std::fmt::Display) -> Response {
    let body = json!({ "Error": scheduler_text::without_percent(&format!("malformed {what} request: {e}")) });
    (StatusCode::BAD_REQUEST, axum::Json(body)).into_response()
}

/// The node names of the request, taken out of it (names, or the names of full nodes).
fn take_node_names<'a>(args: &mut ExtenderArgs<'a>) -> Vec<Cow<'a, str>> {
    if let Some(n) = args.node_names.take() {
        return n.into_iter().map(|n| n.0).collect();
    }
    args.nodes
        .as_ref()
        .map(|l| {
            l.items
                .iter()
                .filter_map(node_name)
                .map(Cow::Owned)
                .collect()
        })
        .unwrap_or_default()
}

fn node_name(v: &Value) -> Option<String> {
    v.pointer("/metadata/name")?.as_str().map(String::from)
}

fn pod_id(pod: &Pod) -> String {
    format!(
        "{}/{}",
        pod.metadata.namespace.as_deref().unwrap_or(""),
        pod.metadata.name.as_deref().unwrap_or("")
    )
}

/// Keep the nodes named in `keep`, in the request's form: full nodes when it carried them
/// (`nodes`), names otherwise.
fn answer_nodes(nodes: Option<NodeList>, keep: Vec<String>, out: &mut FilterResult) {
    if let Some(list) = nodes {
        let keep: std::collections::HashSet<&str> = keep.iter().map(String::as_str).collect();
        let items = list
            .items
            .into_iter()
            .filter(|n| node_name(n).is_some_and(|x| keep.contains(x.as_str())))
            .collect();
        out.nodes = Some(NodeList {
            metadata: list.metadata,
            items,
        });
    } else {
        out.node_names = Some(keep);
    }
}

async fn filter(State(app): State<App>, body: Bytes) -> Response {
    let t0 = Instant::now();
    let mut args: ExtenderArgs<'_> = match serde_json::from_slice(&body) {
        Ok(a) => a,
        Err(e) => return bad_request("filter", e),
    };
    if args.pod.is_none() {
        return bad_request("filter", "Pod is missing");
    }
    // Full nodes are answered in kind only when the request carried no names.
    let full = if args.node_names.is_none() {
        args.nodes.take()
    } else {
        None
    };
    let names: Vec<String> = if let Some(l) = &full {
        l.items.iter().filter_map(node_name).collect()
    } else {
        take_node_names(&mut args)
            .into_iter()
            .map(Cow::into_owned)
            .collect()
    };
    let Some(pod) = args.pod.as_ref() else {
        return bad_request("filter", "Pod is missing");
    };
    let id = pod_id(pod);
    let mut out = FilterResult::default();
    if names.is_empty() {
        // The allocator reads "no nodes" as "all nodes"; the scheduler means none.
        answer_nodes(full, Vec::new(), &mut out);
        return axum::Json(out).into_response();
    }
    let req = match resources::pod_request(pod) {
        Ok(Some(r)) => r,
        Ok(None) => {
            // Nothing gpuledger manages: no opinion.
            answer_nodes(full, names, &mut out);
            return axum::Json(out).into_response();
        }
        Err(e) => {
            unresolvable_everywhere(&names, &e.to_string(), &mut out);
            answer_nodes(full, Vec::new(), &mut out);
            return axum::Json(out).into_response();
        }
    };
    let local = match &app.replica {
        None => None,
        Some(r) => {
            r.read("filter", |l, d| match d.request(req.clone()) {
                Ok(pr) => {
                    r.in_flight.saw(&req);
                    let mut f = parallel::filter_nodes(l, &names, &pr);
                    r.in_flight.filter(l, d, &pr, &mut f);
                    // A node the replica does not know yet may be registered by now: ask.
                    (f.unregistered == 0).then(|| Ok((f, l.seq())))
                }
                Err(why) => Some(Err(tonic::Status::invalid_argument(why))),
            })
            .await
        }
    };
    let answer = match local {
        Some(Ok(r)) => Ok(r),
        Some(Err(s)) => Err((names, s)),
        None => {
            let fr = api::FilterRequest {
                request: Some(req),
                nodes: names,
            };
            let res = app
                .allocators
                .call(|mut c| {
                    let fr = fr.clone();
                    async move { c.filter(fr).await }
                })
                .await;
            match res {
                Ok(r) => Ok((
                    placement::Filtered {
                        fits: r.nodes,
                        wait: r.failed.into_iter().collect(),
                        never: r.unresolvable.into_iter().collect(),
                        ..Default::default()
                    },
                    r.seq,
                )),
                Err(s) => Err((fr.nodes, s)),
            }
        }
    };
    match answer {
        Ok((f, seq)) => {
            debug!(pod = %id, feasible = f.fits.len(), seq,
                   ms = t0.elapsed().as_secs_f64() * 1e3, "filter");
            out.failed_nodes = f.wait.into_iter().chain(f.never.clone()).collect();
            out.failed_and_unresolvable_nodes = f.never.into_iter().collect();
            answer_nodes(full, f.fits, &mut out);
        }
        Err((names, s)) if s.code() == Code::InvalidArgument => {
            unresolvable_everywhere(&names, s.message(), &mut out);
            answer_nodes(full, Vec::new(), &mut out);
        }
        Err((_, s)) => {
            warn!(pod = %id, error = %s.message(), "filter failed");
            out.error = s.message().to_string();
            return failed(axum::Json(out).into_response());
        }
    }
    let hint = out.node_names.as_ref().map_or(0, Vec::len) * 24
        + (out.failed_nodes.len() + out.failed_and_unresolvable_nodes.len()) * 64;
    json_sized(&out, hint.max(128))
}

fn unresolvable_everywhere(names: &[String], why: &str, out: &mut FilterResult) {
    for n in names {
        out.failed_and_unresolvable_nodes
            .insert(n.clone(), why.to_string());
        out.failed_nodes.insert(n.clone(), why.to_string());
    }
}

async fn prioritize(State(app): State<App>, body: Bytes) -> Response {
    let mut args: ExtenderArgs<'_> = match serde_json::from_slice(&body) {
        Ok(a) => a,
        Err(e) => return bad_request("prioritize", e),
    };
    let names = take_node_names(&mut args);
    let Some(pod) = args.pod.as_ref() else {
        return bad_request("prioritize", "Pod is missing");
    };
    fn zero(names: Vec<Cow<'_, str>>) -> Vec<HostPriority<'_>> {
        names
            .into_iter()
            .map(|host| HostPriority { host, score: 0 })
            .collect()
    }
    let req = match resources::pod_request(pod) {
        Ok(Some(r)) => r,
        Ok(None) | Err(_) => return axum::Json(zero(names)).into_response(),
    };
    let local = match &app.replica {
        None => None,
        Some(r) => {
            r.read("prioritize", |l, d| match d.request(req.clone()) {
                // A node the replica does not know yet may be registered by now: ask.
                Ok(pr) => {
                    let mut scores = parallel::score_nodes(l, &names, &pr);
                    r.in_flight.scores(l, d, &pr, &names, &mut scores);
                    names
                        .iter()
                        .zip(scores)
                        .map(|(n, s)| {
                            Some(HostPriority {
                                host: Cow::Borrowed(n.as_ref()),
                                score: i64::from(s?.min(10)),
                            })
                        })
                        .collect::<Option<Vec<_>>>()
                        .map(Ok)
                }
                Err(why) => Some(Err(why)),
            })
            .await
        }
    };
    let res = match local {
        Some(Ok(list)) => return json_sized(&list, names.len() * 40),
        Some(Err(why)) => Err(tonic::Status::invalid_argument(why)),
        None => {
            let sr = api::ScoreRequest {
                request: Some(req),
                nodes: names.iter().map(|n| n.to_string()).collect(),
            };
            app.allocators
                .call(|mut c| {
                    let sr = sr.clone();
                    async move { c.score(sr).await }
                })
                .await
        }
    };
    match res {
        Ok(r) => {
            let list: Vec<HostPriority<'_>> = r
                .scores
                .into_iter()
                .map(|s| HostPriority {
                    host: s.node.into(),
                    score: i64::from(s.score.min(10)),
                })
                .collect();
            axum::Json(list).into_response()
        }
        Err(s) => {
            warn!(pod = %pod_id(pod), error = %s.message(), "prioritize failed");
            (
                StatusCode::SERVICE_UNAVAILABLE,
                axum::Json(json!({"Error": scheduler_text::without_percent(s.message())})),
            )
                .into_response()
        }
    }
}

/// "placed on node-3: container main on GPU-… (3072 MiB, 30% compute), …" for the pod's Event.
fn placed_message(node: &str, r: &api::ReserveResponse) -> String {
    let parts: Vec<String> = r
        .allocations
        .iter()
        .map(|a| {
            let gpus: Vec<String> = a
                .shares
                .iter()
                .map(|s| {
                    format!(
                        "{} ({} MiB, {}% compute)",
                        s.gpu_uuid,
                        s.mem_mib,
                        s.core_milli / 10
                    )
                })
                .collect();
            format!(
                "container {} on {} [allocation {}]",
                a.container,
                gpus.join(", "),
                a.id
            )
        })
        .collect();
    format!("placed on {node}: {}", parts.join("; "))
}

/// The human-readable record of a grant, written to the pod (never read back).
fn allocation_annotation(r: &api::ReserveResponse) -> String {
    let allocs: Vec<Value> = r
        .allocations
        .iter()
        .map(|a| {
            json!({
                "id": a.id,
                "container": a.container,
                "node": a.node,
                "gpus": a.shares.iter().map(|s| s.gpu_uuid.clone()).collect::<Vec<_>>(),
                "memMiB": a.shares.first().map_or(0, |s| s.mem_mib),
                "coreMilli": a.shares.first().map_or(0, |s| s.core_milli),
            })
        })
        .collect();
    json!({"allocations": allocs, "seq": r.seq, "epoch": r.epoch}).to_string()
}

fn kube_error(e: &kube::Error) -> (Option<u16>, String) {
    match e {
        kube::Error::Api(s) => (Some(s.code), format!("{} ({})", s.message, s.reason)),
        other => (None, other.to_string()),
    }
}

async fn bind(State(app): State<App>, body: Bytes) -> Response {
    let args: BindingArgs = match serde_json::from_slice(&body) {
        Ok(a) => a,
        Err(e) => return bad_request("bind", e),
    };
    match do_bind(&app, &args).await {
        Ok(()) => axum::Json(BindingResult::default()).into_response(),
        Err(error) => {
            warn!(pod = %format!("{}/{}", args.pod_namespace, args.pod_name), uid = %args.pod_uid,
                  node = %args.node, error = %error, "bind failed");
            failed(axum::Json(BindingResult { error }).into_response())
        }
    }
}

async fn release(app: &App, uid: &str, why: &str) {
    let rr = api::ReleaseRequest {
        pod_uid: uid.to_string(),
        reason: why.to_string(),
        ..Default::default()
    };
    let res = app
        .allocators
        .call(|mut c| {
            let rr = rr.clone();
            async move { c.release(rr).await }
        })
        .await;
    if let (Ok(w), Some(rep)) = (&res, &app.replica) {
        rep.note_write(w.seq);
    }
    if let Err(s) = res {
        // The reservation expires by itself (--reserve-ttl) if this fails.
        warn!(uid, error = %s.message(), "releasing the reservation failed; it will expire");
    }
}

async fn do_bind(app: &App, a: &BindingArgs) -> Result<(), String> {
    let t0 = Instant::now();
    // Counted by filter and prioritize from now on, as the scheduler's next pod is.
    let early =
        (app.replica.as_ref()).and_then(|rep| rep.in_flight.assume_seen(&a.pod_uid, &a.node));
    let kube = app
        .kube
        .clone()
        .ok_or("the extender has no Kubernetes client (--kubeconfig or in-cluster config)")?;
    let pods: Api<Pod> = Api::namespaced(kube, &a.pod_namespace);
    let pod = pods.get(&a.pod_name).await.map_err(|e| {
        format!(
            "reading pod {}/{}: {}",
            a.pod_namespace,
            a.pod_name,
            kube_error(&e).1
        )
    })?;
    if !a.pod_uid.is_empty() && pod.metadata.uid.as_deref() != Some(a.pod_uid.as_str()) {
        return Err(format!(
            "pod {}/{} has uid {:?}, not {} (it was deleted and created again)",
            a.pod_namespace, a.pod_name, pod.metadata.uid, a.pod_uid
        ));
    }
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    let req = resources::pod_request(&pod).map_err(|e| e.to_string())?;
    let reserved = match req {
        None => None,
        Some(req) => {
            let assumed = early.or_else(|| {
                (app.replica.as_ref()).map(|rep| rep.in_flight.assume(&uid, &a.node, req.clone()))
            });
            let rr = api::ReserveRequest {
                request: Some(req),
                node: a.node.clone(),
                ttl_ms: 0,
            };
            let r = app
                .allocators
                .call(|mut c| {
                    let rr = rr.clone();
                    async move { c.reserve(rr).await }
                })
                .await
                .map_err(|s| format!("reserving GPUs on {}: {}", a.node, s.message()))?;
            if let Some(rep) = &app.replica {
                rep.note_write(r.seq);
            }
            if let Some(x) = assumed {
                x.landed(r.seq);
            }
            Some(r)
        }
    };
    if app.crash_at == Some(CrashAt::BeforeBinding) {
        std::process::exit(99);
    }
    let binding = json!({
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {"name": a.pod_name, "namespace": a.pod_namespace, "uid": uid},
        "target": {"apiVersion": "v1", "kind": "Node", "name": a.node},
    });
    let created: Result<Value, kube::Error> = pods
        .create_subresource("binding", &a.pod_name, &PostParams::default(), &binding)
        .await;
    if let Err(e) = created {
        let (code, msg) = kube_error(&e);
        // A repeated bind of a pod already bound to this very node is a success.
        let already_here = code == Some(409)
            && pods.get(&a.pod_name).await.ok().is_some_and(|p| {
                p.spec.and_then(|s| s.node_name).as_deref() == Some(a.node.as_str())
            });
        if !already_here {
            if reserved.is_some() {
                release(app, &uid, "bind failed").await;
            }
            return Err(format!("creating the Binding to {}: {msg}", a.node));
        }
    }
    if app.crash_at == Some(CrashAt::AfterBinding) {
        std::process::exit(99);
    }
    info!(pod = %format!("{}/{}", a.pod_namespace, a.pod_name), uid, node = %a.node,
          ms = t0.elapsed().as_secs_f64() * 1e3, "bound");
    if let Some(r) = reserved {
        // The pod is bound: the scheduler may go on. Recording it (ConfirmBound, one more etcd
        // commit), the annotation for humans and the Event follow off the scheduler's path. If
        // this extender dies first, the allocator's pod watch sees the binding and records it.
        tokio::spawn(after_bind(app.clone(), pods, a.clone(), uid, r));
    }
    Ok(())
}

/// What follows a successful Binding: confirm it in the ledger, annotate the pod, tell the user.
async fn after_bind(
    app: App,
    pods: Api<Pod>,
    a: BindingArgs,
    uid: String,
    r: api::ReserveResponse,
) {
    let cb = api::ConfirmBoundRequest {
        pod_uid: uid.clone(),
        node: a.node.clone(),
    };
    let confirm = app.allocators.call(|mut c| {
        let cb = cb.clone();
        async move { c.confirm_bound(cb).await }
    });
    let patch = json!({"metadata": {"annotations": {ANN_ALLOCATION: allocation_annotation(&r)}}});
    let (pp, merge) = (PatchParams::default(), Patch::Merge(&patch));
    let annotate = pods.patch(&a.pod_name, &pp, &merge);
    let (confirmed, annotated) = tokio::join!(confirm, annotate);
    if let Err(s) = confirmed {
        // A failed confirm is left to the allocator's reconcile, which sees the binding;
        // releasing would leave a running pod without its GPU.
        warn!(uid, error = %s.message(), "confirming the binding failed; the allocator's reconcile will");
    }
    if let Err(e) = annotated {
        warn!(uid, error = %kube_error(&e).1, "writing the allocation annotation failed (it is informational)");
    }
    if let Some(events) = &app.events {
        events.emit(PodEvent {
            namespace: a.pod_namespace.clone(),
            name: a.pod_name.clone(),
            uid,
            kind: Kind::Normal,
            reason: "GpuPlaced",
            message: placed_message(&a.node, &r),
        });
    }
}

async fn preempt(State(app): State<App>, body: Bytes) -> Response {
    let args: PreemptionArgs = match serde_json::from_slice(&body) {
        Ok(a) => a,
        Err(e) => return bad_request("preempt", e),
    };
    let mut candidates: BTreeMap<String, Value> =
        args.node_name_to_meta_victims.unwrap_or_default();
    for (node, v) in args.node_name_to_victims.unwrap_or_default() {
        let uids: Vec<Value> = v
            .get("Pods")
            .and_then(Value::as_array)
            .map(|ps| {
                ps.iter()
                    .filter_map(|p| p.pointer("/metadata/uid").cloned())
                    .map(|u| json!({"UID": u}))
                    .collect()
            })
            .unwrap_or_default();
        let pdb = v.get("NumPDBViolations").cloned().unwrap_or(json!(0));
        candidates
            .entry(node)
            .or_insert_with(|| json!({"Pods": uids, "NumPDBViolations": pdb}));
    }
    let req = match args.pod.as_ref().map(resources::pod_request) {
        Some(Ok(Some(r))) => r,
        // No GPU request: gpuledger has no say in preemption.
        Some(Ok(None)) => {
            return axum::Json(PreemptionResult {
                node_name_to_meta_victims: candidates,
            })
            .into_response();
        }
        Some(Err(_)) | None => return axum::Json(PreemptionResult::default()).into_response(),
    };
    // Drop the nodes where the pod can never fit, whoever is evicted.
    let fr = api::FilterRequest {
        request: Some(req),
        nodes: candidates.keys().cloned().collect(),
    };
    match app
        .allocators
        .call(|mut c| {
            let fr = fr.clone();
            async move { c.filter(fr).await }
        })
        .await
    {
        Ok(r) => {
            candidates.retain(|n, _| !r.unresolvable.contains_key(n));
            axum::Json(PreemptionResult {
                node_name_to_meta_victims: candidates,
            })
            .into_response()
        }
        Err(s) => (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(json!({"Error": scheduler_text::without_percent(s.message())})),
        )
            .into_response(),
    }
}
