//! The allocator's HTTP side: `/metrics` (OpenMetrics text), `/healthz`, `/readyz`, and the
//! live GPU map `/ui` with its JSON endpoints `/api/v1/state` and `/api/v1/events` (only with
//! `--http-state-api`: they show every tenant's pods to whoever reaches the port).
//!
//! `/healthz` answers while the process runs. `/readyz` answers 200 only when this replica can
//! serve: etcd reachable, the ledger loaded and caught up with `head`, and a leader known.

mod metrics;
mod ui;

use std::sync::Arc;

use axum::Router;
use axum::extract::{RawQuery, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

use crate::shared::Shared;

/// Run `f` off the async workers: encoding a large ledger takes milliseconds of CPU.
async fn blocking(
    shared: Arc<Shared>,
    content_type: &'static str,
    f: impl FnOnce(&Arc<Shared>) -> String + Send + 'static,
) -> Response {
    match tokio::task::spawn_blocking(move || f(&shared)).await {
        Ok(body) => ([(header::CONTENT_TYPE, content_type)], body).into_response(),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("rendering failed: {e}\n"),
        )
            .into_response(),
    }
}

const JSON: &str = "application/json";

fn bad_request(e: ui::BadQuery) -> Response {
    (StatusCode::BAD_REQUEST, format!("bad request: {e}\n")).into_response()
}

/// The HTTP router: health and metrics always; the GPU map and its JSON when `state_api`
/// (they name every tenant's pods, and this port has no authentication).
/// `/metrics` carries per-namespace series only with `namespaces`.
pub fn router(shared: Arc<Shared>, state_api: bool, namespaces: bool) -> Router {
    let r = Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route(
            "/readyz",
            get(|State(s): State<Arc<Shared>>| async move {
                match s.readiness() {
                    Ok(()) => (StatusCode::OK, "ready\n".to_string()),
                    Err(why) => (
                        StatusCode::SERVICE_UNAVAILABLE,
                        format!("not ready: {why}\n"),
                    ),
                }
            }),
        )
        .route(
            "/metrics",
            get(move |State(s): State<Arc<Shared>>| {
                // prometheus-client writes the OpenMetrics text format (`# EOF`, `_total`).
                blocking(
                    s,
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    move |s| metrics::render(s, namespaces),
                )
            }),
        );
    if !state_api {
        return r.with_state(shared);
    }
    r.route(
        "/ui",
        get(|| async {
            (
                [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
                ui::PAGE,
            )
        }),
    )
    .route(
        "/api/v1/state",
        get(
            |State(s): State<Arc<Shared>>, RawQuery(q): RawQuery| async move {
                match ui::no_params(q.as_deref()) {
                    Ok(()) => blocking(s, JSON, |s| ui::state_json(s)).await,
                    Err(e) => bad_request(e),
                }
            },
        ),
    )
    .route(
        "/api/v1/events",
        get(
            |State(s): State<Arc<Shared>>, RawQuery(q): RawQuery| async move {
                match ui::events_limit(q.as_deref()) {
                    Ok(limit) => blocking(s, JSON, move |s| ui::events_json(s, limit)).await,
                    Err(e) => bad_request(e),
                }
            },
        ),
    )
    .with_state(shared)
}
