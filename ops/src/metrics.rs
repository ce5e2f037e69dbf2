//! The `/metrics` route: a prometheus-client registry in the Prometheus text format.

use std::sync::Arc;

use axum::Router;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus_client::registry::Registry;

/// The Prometheus text exposition content type.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Encode `registry` as Prometheus/OpenMetrics text.
pub fn encode(registry: &Registry) -> Result<String, std::fmt::Error> {
    let mut body = String::with_capacity(4096);
    prometheus_client::encoding::text::encode(&mut body, registry)?;
    Ok(body)
}

/// A router serving `GET /metrics` from `registry`.
pub fn router<S: Clone + Send + Sync + 'static>(registry: Arc<Registry>) -> Router<S> {
    Router::new().route(
        "/metrics",
        get(move || {
            let registry = registry.clone();
            async move {
                match encode(&registry) {
                    Ok(body) => ([(header::CONTENT_TYPE, CONTENT_TYPE)], body).into_response(),
                    Err(e) => (
                        StatusCode::INTERNAL_SERVER_ERROR,
                        format!("encoding metrics: {e}\n"),
                    )
                        .into_response(),
                }
            }
        }),
    )
}
