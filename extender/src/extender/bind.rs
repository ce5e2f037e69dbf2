//! `bind`: reserve at the allocator, create the pod's Binding in the API server, then confirm
//! the binding and tell the pod's users, off the scheduler's path.

use std::time::Instant;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use gpuledger_ops::events::{Kind, PodEvent};
use gpuledger_proto::allocator::v1 as api;
use k8s_openapi::api::core::v1::{Binding, ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, PostParams};
use serde::de::IgnoredAny;
use tracing::field::{self, Empty};
use tracing::{Instrument, Span, info, instrument, warn};

use super::wire::{BindingArgs, BindingResult};
use super::{App, bad_request, failed};
use crate::resources;

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

fn kube_error(e: &kube::Error) -> (Option<u16>, String) {
    match e {
        kube::Error::Api(s) => (Some(s.code), format!("{} ({})", s.message, s.reason)),
        other => (None, other.to_string()),
    }
}

#[instrument(name = "bind", skip_all, fields(pod_uid = Empty, pod = Empty, node = Empty,
    allocations = Empty, seq = Empty, epoch = Empty))]
pub(super) async fn bind(State(app): State<App>, body: Bytes) -> Response {
    let args: BindingArgs = match serde_json::from_slice(&body) {
        Ok(a) => a,
        Err(e) => return bad_request("bind", e),
    };
    let span = Span::current();
    span.record("pod_uid", args.pod_uid.as_str());
    span.record(
        "pod",
        field::display(format_args!("{}/{}", args.pod_namespace, args.pod_name)),
    );
    span.record("node", args.node.as_str());
    match do_bind(&app, &args).await {
        Ok(()) => axum::Json(BindingResult::default()).into_response(),
        Err(error) => {
            warn!(error = %error, "bind failed");
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
        .call("Release", |mut c| {
            let rr = rr.clone();
            async move { c.release(rr).await }
        })
        .await;
    if let (Ok(w), Some(rep)) = (&res, &app.replica) {
        rep.note_write(w.seq);
    }
    if let Err(s) = res {
        // The reservation expires by itself (--reserve-ttl) if this fails.
        warn!(error = %s.message(), "releasing the reservation failed; it will expire");
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
    // The API server defaults an unset schedulerName to the default scheduler's.
    let scheduler = (pod.spec.as_ref())
        .and_then(|s| s.scheduler_name.as_deref())
        .unwrap_or("default-scheduler");
    if !app.scheduler_names.iter().any(|n| n == scheduler) {
        return Err(format!(
            "pod {}/{} is scheduled by {scheduler:?}, not by a gpuledger scheduler ({}): not bound",
            a.pod_namespace,
            a.pod_name,
            app.scheduler_names.join(", ")
        ));
    }
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    Span::current().record("pod_uid", uid.as_str());
    // A DRA pod (the marker) reserves nothing here: the allocator certified its claims before
    // the scheduler's PreBind let it reach bind, and the ledger holds their grants. It has no
    // gpuledger resource names left, so `pod_request` reads none; only the Binding is posted.
    let req = if resources::has_dra_marker(&pod) {
        info!("DRA pod: its claims are certified by the allocator; binding only");
        None
    } else {
        resources::pod_request(&pod).map_err(|e| e.to_string())?
    };
    let reserved = match req {
        None => None,
        Some(req) => {
            let assumed = match early {
                Some(x) => {
                    x.confirm(req.clone());
                    Some(x)
                }
                None => (app.replica.as_ref())
                    .map(|rep| rep.in_flight.assume(&uid, &a.node, req.clone())),
            };
            let rr = api::ReserveRequest {
                request: Some(req),
                node: a.node.clone(),
                ttl_ms: 0,
            };
            let r = app
                .allocators
                .call("Reserve", |mut c| {
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
            let span = Span::current();
            let ids: Vec<u64> = r.allocations.iter().map(|x| x.id).collect();
            span.record("allocations", field::debug(ids));
            span.record("seq", r.seq);
            span.record("epoch", r.epoch);
            Some(r)
        }
    };
    #[cfg(feature = "test-hooks")]
    crate::test_hooks::crash_if(app.crash_at, crate::test_hooks::CrashAt::BeforeBinding);
    let binding = Binding {
        metadata: ObjectMeta {
            name: Some(a.pod_name.clone()),
            namespace: Some(a.pod_namespace.clone()),
            uid: Some(uid.clone()),
            ..Default::default()
        },
        target: ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Node".into()),
            name: Some(a.node.clone()),
            ..Default::default()
        },
    };
    // The API server answers with a Status; only whether it succeeded matters.
    let created: Result<IgnoredAny, kube::Error> = pods
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
    #[cfg(feature = "test-hooks")]
    crate::test_hooks::crash_if(app.crash_at, crate::test_hooks::CrashAt::AfterBinding);
    info!(ms = t0.elapsed().as_secs_f64() * 1e3, "bound");
    if let Some(r) = reserved {
        // The pod is bound: the scheduler may go on. Recording it (ConfirmBound, one more etcd
        // commit) and the Event follow off the scheduler's path. If this extender dies first,
        // the allocator's pod watch sees the binding and records it.
        app.tasks
            .spawn(after_bind(app.clone(), a.clone(), uid, r).in_current_span());
    }
    Ok(())
}

/// What follows a successful Binding: confirm it in the ledger, tell the user. The ledger is
/// where the grant is recorded (`gpuledger inspect`); the pod is not annotated, so the extender
/// needs no right to change pods.
async fn after_bind(app: App, a: BindingArgs, uid: String, r: api::ReserveResponse) {
    let cb = api::ConfirmBoundRequest {
        pod_uid: uid.clone(),
        node: a.node.clone(),
    };
    let confirmed = app
        .allocators
        .call("ConfirmBound", |mut c| {
            let cb = cb.clone();
            async move { c.confirm_bound(cb).await }
        })
        .await;
    if let Err(s) = confirmed {
        // A failed confirm is left to the allocator's reconcile, which sees the binding;
        // releasing would leave a running pod without its GPU.
        warn!(error = %s.message(), "confirming the binding failed; the allocator's reconcile will");
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
