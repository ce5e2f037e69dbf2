//! `?watch=true`: a stream of JSON lines (`{"type": …, "object": …}`), resumed from a
//! resourceVersion, ended by `timeoutSeconds` or by a 410 when the watcher fell behind.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::response::Response;
use futures::StreamExt;
use serde_json::{Value, json};
use tokio::sync::broadcast;
use tokio_stream::wrappers::ReceiverStream;

use crate::kube::store::{ApiError, Filter, Scope, Store};

fn event_line(kind: &str, obj: &Value) -> Bytes {
    let mut v =
        serde_json::to_vec(&json!({"type": kind, "object": obj})).expect("JSON values serialize");
    v.push(b'\n');
    Bytes::from(v)
}

/// The watch response for `scope` through `f`, with the query's `resourceVersion` and
/// `timeoutSeconds` (30 minutes when absent).
pub(super) fn watch(
    store: Arc<Store>,
    scope: Scope,
    f: Filter,
    q: &BTreeMap<String, String>,
) -> Response {
    let from: u64 = q
        .get("resourceVersion")
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let timeout = q
        .get("timeoutSeconds")
        .and_then(|s| s.parse().ok())
        .map_or(Duration::from_secs(1800), Duration::from_secs);
    let start = match store.watch_from(&scope, &f, from) {
        Ok(s) => s,
        Err(e) => {
            let line = event_line("ERROR", &e.status());
            return Response::new(Body::from(line));
        }
    };
    let (tx, rx) = tokio::sync::mpsc::channel(256);
    let deadline = tokio::time::Instant::now() + timeout;
    tokio::spawn(async move {
        let mut rx = start.rx;
        let mut last = start.rv;
        for (kind, obj) in &start.first {
            if tx.send(event_line(kind, obj)).await.is_err() {
                return;
            }
        }
        loop {
            let c = tokio::select! {
                r = rx.recv() => r,
                _ = tokio::time::sleep_until(deadline) => return,
            };
            match c {
                Ok(c) => {
                    if c.rv <= last {
                        continue;
                    }
                    last = c.rv;
                    if let Some(kind) = c.seen_by(&scope, &f)
                        && tx.send(event_line(kind, &c.object)).await.is_err()
                    {
                        return;
                    }
                }
                Err(broadcast::error::RecvError::Lagged(_)) => {
                    let e = ApiError::new(410, "Expired", "watch fell behind; relist");
                    let _ = tx.send(event_line("ERROR", &e.status())).await;
                    return;
                }
                Err(broadcast::error::RecvError::Closed) => return,
            }
        }
    });
    let body = ReceiverStream::new(rx).map(Ok::<_, Infallible>);
    let mut r = Response::new(Body::from_stream(body));
    r.headers_mut().insert(
        "content-type",
        "application/json".parse().expect("static header"),
    );
    r
}
