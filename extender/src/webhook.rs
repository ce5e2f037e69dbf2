//! The admission webhook (AdmissionReview v1, HTTPS only): `mutate` completes and translates
//! GPU requests, `validate` rejects what can never run with a message a user understands.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use base64::Engine;
use gpuledger_proto::allocator::v1 as api;
use gpuledger_proto::ledger::v1 as pb;
use k8s_openapi::api::core::v1::Pod;
use serde_json::{Map, Value, json};
use tracing::{info, warn};

use crate::allocator::Allocators;
use crate::resources::{self, ContainerGpu};

/// Shared state of the webhook handlers.
#[derive(Clone)]
pub struct Webhook {
    /// Allocator replicas (validate asks how many GPUs the largest node has).
    pub allocators: Allocators,
    /// When set, mutate moves GPU pods of the default scheduler to this scheduler.
    pub scheduler_name: Option<String>,
}

/// The webhook routes.
pub fn router(w: Webhook) -> Router {
    Router::new()
        .route("/mutate", post(mutate))
        .route("/validate", post(validate))
        .route("/healthz", get(|| async { "ok" }))
        .with_state(w)
}

fn review(response: Value) -> Response {
    axum::Json(json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "response": response,
    }))
    .into_response()
}

fn deny(uid: &str, code: u16, message: String) -> Response {
    review(json!({"uid": uid, "allowed": false, "status": {"code": code, "message": message}}))
}

/// The request's uid and pod object (None for anything that is not a pod).
fn parse(body: &[u8]) -> Result<(String, Option<(Value, Pod)>), String> {
    let v: Value =
        serde_json::from_slice(body).map_err(|e| format!("malformed AdmissionReview: {e}"))?;
    let req = v.get("request").ok_or("AdmissionReview has no request")?;
    let uid = req
        .get("uid")
        .and_then(Value::as_str)
        .ok_or("AdmissionReview request has no uid")?
        .to_string();
    let is_pod = req.pointer("/kind/kind").and_then(Value::as_str) == Some("Pod");
    let Some(obj) = req.get("object").filter(|o| is_pod && !o.is_null()) else {
        return Ok((uid, None));
    };
    let pod: Pod =
        serde_json::from_value(obj.clone()).map_err(|e| format!("the pod cannot be read: {e}"))?;
    Ok((uid, Some((obj.clone(), pod))))
}

fn fmt_num(v: f64) -> String {
    format!("{}", v.ceil() as i64)
}

/// The container's resources with aliases replaced by gpuledger names and the slice count
/// made explicit; None when nothing changes. No name a node does not advertise is left.
fn translate(raw: &Value, g: &ContainerGpu) -> Option<Value> {
    let hami = [
        resources::HAMI_GPU_MEM,
        resources::HAMI_GPU_MEM_PERCENT,
        resources::HAMI_GPU_CORES,
    ];
    let mut res = raw.get("resources").cloned().unwrap_or_else(|| json!({}));
    // nvidia.com/gpu is HAMi's GPU count only beside HAMi's other names (as `ContainerGpu::of`
    // reads it); otherwise it stays for NVIDIA's device plugin.
    let hami_count = ["limits", "requests"].iter().any(|part| {
        res.get(part)
            .and_then(Value::as_object)
            .is_some_and(|m| hami.iter().any(|k| m.contains_key(*k)))
    });
    let mut aliases = vec![resources::ALIYUN_GPU_MEM];
    aliases.extend(hami);
    if hami_count {
        aliases.push(resources::HAMI_GPU);
    }
    let mut changed = false;
    for part in ["limits", "requests"] {
        let Some(map) = res.get_mut(part).and_then(Value::as_object_mut) else {
            continue;
        };
        let had_alias = aliases.iter().any(|a| map.contains_key(*a));
        for a in &aliases {
            map.remove(*a);
        }
        let mut set = |map: &mut Map<String, Value>, k: &str, v: Option<String>| {
            if let Some(v) = v
                && !map.contains_key(k)
            {
                map.insert(k.to_string(), Value::String(v));
                changed = true;
            }
        };
        // The count as written (a fraction stays one, for the API server to refuse).
        set(
            map,
            resources::GPU,
            Some(g.slices.unwrap_or(1.0).to_string()),
        );
        set(map, resources::GPU_MEM, g.mem_mib.map(fmt_num));
        set(map, resources::GPU_MEM_PERCENT, g.mem_percent.map(fmt_num));
        set(map, resources::GPU_CORE, g.core_percent.map(fmt_num));
        changed |= had_alias;
    }
    if res.get("limits").is_none() {
        // Only requests were written: extended resources need limits too.
        let req = res.get("requests").cloned().unwrap_or_else(|| json!({}));
        let limits: Map<String, Value> = req
            .as_object()
            .map(|m| {
                m.iter()
                    .filter(|(k, _)| k.starts_with("gpuledger.io/"))
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect()
            })
            .unwrap_or_default();
        res["limits"] = Value::Object(limits);
        changed = true;
    }
    changed.then_some(res)
}

/// The JSON Patch that mutate answers for `obj`.
pub fn mutation(
    obj: &Value,
    pod: &Pod,
    scheduler_name: Option<&str>,
) -> Result<Vec<Value>, String> {
    let mut ops = Vec::new();
    let mut any_gpu = false;
    let Some(spec) = pod.spec.as_ref() else {
        return Ok(ops);
    };
    for (i, c) in spec.containers.iter().enumerate() {
        let g = ContainerGpu::of(c).map_err(|e| e.to_string())?;
        if !g.wants_gpu() {
            continue;
        }
        any_gpu = true;
        let raw = obj
            .pointer(&format!("/spec/containers/{i}"))
            .cloned()
            .unwrap_or_default();
        if let Some(res) = translate(&raw, &g) {
            ops.push(json!({"op": "add", "path": format!("/spec/containers/{i}/resources"), "value": res}));
        }
    }
    if let Some(name) = scheduler_name
        && any_gpu
        && matches!(
            spec.scheduler_name.as_deref(),
            None | Some("") | Some("default-scheduler")
        )
    {
        ops.push(json!({"op": "add", "path": "/spec/schedulerName", "value": name}));
    }
    Ok(ops)
}

async fn mutate(State(w): State<Webhook>, body: Bytes) -> Response {
    let (uid, pod) = match parse(&body) {
        Ok(x) => x,
        Err(e) => return (StatusCode::BAD_REQUEST, e).into_response(),
    };
    let Some((obj, pod)) = pod else {
        return review(json!({"uid": uid, "allowed": true}));
    };
    match mutation(&obj, &pod, w.scheduler_name.as_deref()) {
        // Malformed quantities are validate's to reject, with its message.
        Err(_) => review(json!({"uid": uid, "allowed": true})),
        Ok(ops) if ops.is_empty() => review(json!({"uid": uid, "allowed": true})),
        Ok(ops) => {
            let patch = serde_json::to_vec(&ops).expect("JSON values serialize");
            info!(pod = ?pod.metadata.name, ns = ?pod.metadata.namespace, ops = ops.len(), "mutated");
            review(json!({
                "uid": uid,
                "allowed": true,
                "patchType": "JSONPatch",
                "patch": base64::engine::general_purpose::STANDARD.encode(patch),
            }))
        }
    }
}

/// Why the pod must be refused, if it must.
pub async fn check(allocators: &Allocators, pod: &Pod) -> Option<String> {
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
    let mut most = 0;
    for c in &cs {
        match c.to_api() {
            Ok(r) => most = most.max(r.slices),
            Err(e) => return Some(e.to_string()),
        }
    }
    if most <= 1 {
        return None;
    }
    // Can any node ever hold `most` slices on distinct GPUs? Ask with a minimal request.
    let probe = api::FilterRequest {
        request: Some(api::PodRequest {
            pod: Some(pb::PodRef {
                uid: "admission-probe".into(),
                namespace: "probe".into(),
                name: "probe".into(),
            }),
            containers: vec![api::ContainerRequest {
                name: "probe".into(),
                slices: most,
                mem_mib: 1,
                ..Default::default()
            }],
            ..Default::default()
        }),
        nodes: Vec::new(),
    };
    match allocators
        .call(|mut c| {
            let p = probe.clone();
            async move { c.filter(p).await }
        })
        .await
    {
        Ok(r) if r.nodes.is_empty() && r.failed.is_empty() && !r.unresolvable.is_empty() => {
            let name = cs
                .iter()
                .find(|c| c.slices.unwrap_or(1.0) as u32 == most)
                .map_or("?", |c| c.name.as_str());
            Some(format!(
                "container {name:?} asks for {most} GPU slices ({}), each on a distinct GPU, but no \
                 node in the cluster has {most} GPUs",
                resources::GPU
            ))
        }
        Ok(_) => None,
        Err(s) => {
            // The scheduler's filter will say so again; refusing pods for an outage is worse.
            warn!(error = %s.message(), "validate could not ask the allocator; admitting");
            None
        }
    }
}

async fn validate(State(w): State<Webhook>, body: Bytes) -> Response {
    let (uid, pod) = match parse(&body) {
        Ok(x) => x,
        Err(e) => return (StatusCode::BAD_REQUEST, e).into_response(),
    };
    let Some((_, pod)) = pod else {
        return review(json!({"uid": uid, "allowed": true}));
    };
    match check(&w.allocators, &pod).await {
        None => review(json!({"uid": uid, "allowed": true})),
        Some(m) => {
            info!(pod = ?pod.metadata.name, ns = ?pod.metadata.namespace, reason = %m, "denied");
            deny(&uid, 422, m)
        }
    }
}

/// TLS settings from PEM files.
pub fn tls_config(cert: &Path, key: &Path) -> anyhow::Result<rustls::ServerConfig> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .map_err(|e| anyhow::anyhow!("reading {}: {e}", cert.display()))?
        .collect::<Result<_, _>>()
        .map_err(|e| anyhow::anyhow!("reading {}: {e}", cert.display()))?;
    anyhow::ensure!(!certs.is_empty(), "{} holds no certificate", cert.display());
    let key = PrivateKeyDer::from_pem_file(key)
        .map_err(|e| anyhow::anyhow!("reading {}: {e}", key.display()))?;
    let mut cfg = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_no_client_auth()
    .with_single_cert(certs, key)?;
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(cfg)
}

/// Serve `app` over HTTPS on `listener` until the process ends.
pub async fn serve_tls(listener: tokio::net::TcpListener, tls: rustls::ServerConfig, app: Router) {
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls));
    loop {
        let (tcp, peer): (tokio::net::TcpStream, SocketAddr) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                warn!(error = %e, "webhook accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = tcp.set_nodelay(true);
        let acceptor = acceptor.clone();
        let app = app.clone();
        tokio::spawn(async move {
            let stream = match acceptor.accept(tcp).await {
                Ok(s) => s,
                Err(e) => {
                    warn!(%peer, error = %e, "TLS handshake failed");
                    return;
                }
            };
            let svc = hyper_util::service::TowerToHyperService::new(app);
            let conn = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(stream), svc);
            if let Err(e) = conn.await {
                warn!(%peer, error = %e, "webhook connection ended with an error");
            }
        });
    }
}
