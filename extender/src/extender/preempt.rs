//! `preempt`: of the scheduler's preemption candidates, drop the nodes where the pod can never
//! fit, whoever is evicted.

use std::collections::BTreeMap;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use gpuledger_proto::allocator::v1 as api;
use serde_json::{Value, json};
use tracing::field::Empty;
use tracing::instrument;

use super::wire::{PreemptionArgs, PreemptionResult};
use super::{App, bad_request, record_pod};
use crate::resources;

#[instrument(name = "preempt", skip_all, fields(pod_uid = Empty, pod = Empty))]
pub(super) async fn preempt(State(app): State<App>, body: Bytes) -> Response {
    let args: PreemptionArgs = match serde_json::from_slice(&body) {
        Ok(a) => a,
        Err(e) => return bad_request("preempt", e),
    };
    if let Some(pod) = &args.pod {
        record_pod(pod);
    }
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
        .call("Filter", |mut c| {
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
            axum::Json(json!({"Error": crate::scheduler_text::without_percent(s.message())})),
        )
            .into_response(),
    }
}
