//! The agent's HTTP side for the DaemonSet's probes and Prometheus: `/healthz` (the process
//! answers), `/readyz` (registered with the kubelet, following the ledger, enforcing), `/metrics`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::agent::Agent;

/// The status and body of a probe: ready when registered with the kubelet, following the
/// ledger and able to enforce (`refused` says why not).
pub fn answer(
    path: &str,
    registered: bool,
    synced: bool,
    refused: Option<&str>,
) -> (StatusCode, String) {
    match (path, refused) {
        ("/healthz", _) => (StatusCode::OK, "ok\n".into()),
        ("/readyz", Some(why)) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: enforcement refused: {why}\n"),
        ),
        ("/readyz", None) if registered && synced => (StatusCode::OK, "ready\n".into()),
        ("/readyz", None) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: kubelet_registered={registered} ledger_synced={synced}\n"),
        ),
        _ => (StatusCode::NOT_FOUND, "not found\n".into()),
    }
}

fn probe(agent: &Agent, path: &str) -> (StatusCode, String) {
    if path == "/readyz"
        && let Some(why) = agent.dra_off()
    {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: serving no DRA: {why}\n"),
        );
    }
    answer(
        path,
        agent.kubelet_registered.load(Ordering::Acquire),
        agent.synced(),
        agent.enforcement_refused.as_deref(),
    )
}

async fn metrics(State(agent): State<Arc<Agent>>) -> Response {
    agent.refresh_metrics();
    match gpuledger_ops::metrics::encode(&agent.registry) {
        Ok(body) => (
            [(header::CONTENT_TYPE, gpuledger_ops::metrics::CONTENT_TYPE)],
            body,
        )
            .into_response(),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("encoding metrics: {e}\n"),
        )
            .into_response(),
    }
}

/// The routes.
pub fn router(agent: Arc<Agent>) -> Router {
    Router::new()
        .route(
            "/healthz",
            get(|State(a): State<Arc<Agent>>| async move { probe(&a, "/healthz") }),
        )
        .route(
            "/readyz",
            get(|State(a): State<Arc<Agent>>| async move { probe(&a, "/readyz") }),
        )
        .route("/metrics", get(metrics))
        .with_state(agent)
}

/// Serve on `addr`, within the limits of `--http-*`, until `stop` is cancelled.
pub async fn serve(agent: Arc<Agent>, addr: SocketAddr, stop: CancellationToken) {
    let l = match tokio::net::TcpListener::bind(addr).await {
        Ok(l) => l,
        Err(e) => {
            warn!(%addr, "health and metrics endpoint not served: {e}");
            return;
        }
    };
    let (limits, bites) = (agent.cfg.http.limits(), agent.http_bites.clone());
    let served =
        gpuledger_auth::https::serve_plain("http", l, limits, bites, router(agent), stop).await;
    if let Err(e) = served {
        warn!(%addr, "health and metrics endpoint stopped: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_only_when_registered_synced_and_enforcing() {
        assert_eq!(answer("/healthz", false, false, None).0, StatusCode::OK);
        assert_eq!(answer("/readyz", true, true, None).0, StatusCode::OK);
        assert_eq!(
            answer("/readyz", true, false, None).0,
            StatusCode::SERVICE_UNAVAILABLE
        );
        assert_eq!(
            answer("/readyz", false, true, None).0,
            StatusCode::SERVICE_UNAVAILABLE
        );
        let (code, body) = answer("/readyz", true, true, Some("not in the host pid namespace"));
        assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE);
        assert!(
            body.contains("enforcement refused: not in the host pid namespace"),
            "{body}"
        );
        assert_eq!(
            answer("/healthz", true, true, Some("x")).0,
            StatusCode::OK,
            "alive all the same"
        );
    }
}
