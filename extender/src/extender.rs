//! The kube-scheduler extender: `filter`, `prioritize`, `bind` and `preempt` over HTTP, in the
//! exact JSON kube-scheduler sends (k8s.io/kube-scheduler/extender/v1: Go field names, no tags).
//! Filter and prioritize are answered from a read-only replica of the ledger while it is fresh
//! (see [`crate::replica`]), otherwise by an allocator replica; bind always goes through the
//! allocator's `Reserve` and the API server.

mod bind;
mod dra;
mod filter;
mod preempt;
mod prioritize;
pub mod wire;

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::http::header::CONTENT_TYPE;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use gpuledger_ops::events::Recorder;
use gpuledger_proto::allocator::v1 as api;
use k8s_openapi::api::core::v1::Pod;
use serde::Serialize;
use serde_json::json;
use tokio_util::task::TaskTracker;
use tracing::Span;

use crate::allocator::Allocators;
use crate::metrics::{Metrics, Outcome};
use crate::replica::Replica;

pub use wire::{
    BindingArgs, BindingResult, ExtenderArgs, FilterResult, HostPriority, Name, NodeList,
    PreemptionArgs, PreemptionResult,
};

/// Shared state of the HTTP handlers.
#[derive(Clone)]
pub struct App {
    /// Allocator replicas.
    pub allocators: Allocators,
    /// API server client (bind needs it).
    pub kube: Option<kube::Client>,
    /// Where a test asks the process to die mid-bind.
    #[cfg(feature = "test-hooks")]
    pub crash_at: Option<crate::test_hooks::CrashAt>,
    /// Pod Events (placed on GPU …); None without a Kubernetes client.
    pub events: Option<Recorder>,
    /// Verb latencies and outcomes, served at /metrics.
    pub metrics: Arc<Metrics>,
    /// The local replica of the ledger filter and prioritize read (None = always ask the
    /// allocator).
    pub replica: Option<Arc<Replica>>,
    /// The work that follows a bind off the scheduler's path, waited for at shutdown.
    pub tasks: TaskTracker,
    /// The `spec.schedulerName`s whose pods bind may bind; a pod of any other scheduler is
    /// refused.
    pub scheduler_names: Vec<String>,
    /// Preemption asked from filter, rate-limited per pod.
    pub preemption: Arc<crate::preemption::Preemption>,
    /// How fast filter and prioritize are answered.
    pub pace: Arc<crate::pace::Pace>,
    /// The unit DRA claims state `cores` in (`--dra-cores`).
    pub dra_cores: gpuledger_request::dra::CoresUnit,
}

/// The verbs kube-scheduler calls, served at the root and under `/gpuledger` (over HTTPS, to
/// a scheduler that presents its client certificate).
pub fn router(app: App) -> Router {
    let metrics = app.metrics.clone();
    let verbs = Router::new()
        .route("/filter", post(filter::filter))
        .route("/prioritize", post(prioritize::prioritize))
        .route_layer(axum::middleware::from_fn_with_state(
            app.pace.clone(),
            crate::pace::paced,
        ))
        .route("/bind", post(bind::bind))
        .route("/preempt", post(preempt::preempt));
    Router::new()
        .merge(verbs.clone())
        .nest("/gpuledger", verbs)
        .with_state(app)
        .layer(axum::middleware::from_fn_with_state(
            metrics,
            crate::metrics::track,
        ))
}

/// `/healthz`, `/readyz` and `/metrics`, on the plain probe port: the kubelet's probes and
/// Prometheus present no certificate, and nothing here writes or names a tenant.
pub fn probes(app: App) -> Router {
    let metrics = app.metrics.clone();
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .with_state(app)
        .merge(gpuledger_ops::metrics::router(metrics.registry.clone()))
}

/// Ready when an allocator replica answers and can serve grants: without one every verb
/// would fail, so a Service should route the scheduler elsewhere.
async fn readyz(State(app): State<App>) -> Response {
    let st = app
        .allocators
        .call("Status", |mut c| async move {
            c.status(api::StatusRequest {}).await
        })
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

/// The HTTP status of an allocator's (or the local replica's) refusal: the caller's fault
/// (a request no GPU can meet, a field out of range) is 400, anything else is ours to fix or
/// wait out: 503.
fn status_of(s: &tonic::Status) -> StatusCode {
    match s.code() {
        tonic::Code::InvalidArgument | tonic::Code::OutOfRange => StatusCode::BAD_REQUEST,
        _ => StatusCode::SERVICE_UNAVAILABLE,
    }
}

fn bad_request(what: &str, e: impl std::fmt::Display) -> Response {
    let body = json!({ "Error": crate::scheduler_text::without_percent(&format!("malformed {what} request: {e}")) });
    (StatusCode::BAD_REQUEST, axum::Json(body)).into_response()
}

/// Name the pod on the current request's span (its `pod_uid` and `pod` fields).
fn record_pod(pod: &Pod) {
    let span = Span::current();
    span.record("pod_uid", pod.metadata.uid.as_deref().unwrap_or(""));
    span.record("pod", tracing::field::display(pod_id(pod)));
}

fn pod_id(pod: &Pod) -> String {
    format!(
        "{}/{}",
        pod.metadata.namespace.as_deref().unwrap_or(""),
        pod.metadata.name.as_deref().unwrap_or("")
    )
}
