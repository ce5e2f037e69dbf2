//! The namespaces' `gpuledger.io/path` labels, from a watch: admission reviews are not
//! authenticated, so a review must cost the API server nothing. The webhook reads a
//! namespace's label from this cache; a namespace the cache does not hold yet (created a
//! moment ago, the watch a few milliseconds behind) is waited for briefly, never read from the
//! API server once per review.

use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Namespace;
use kube::Api;
use kube::core::PartialObjectMeta;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use tokio_util::sync::CancellationToken;
use tracing::warn;

/// How long a review waits for a namespace the cache does not hold (an honest one was created
/// before its pod, so the watch brings it within milliseconds) or for the first list.
const WAIT: Duration = Duration::from_secs(2);

/// Every namespace's labels (metadata only), kept current by a watch.
#[derive(Clone)]
pub struct NamespaceLabels {
    store: Store<PartialObjectMeta<Namespace>>,
}

impl NamespaceLabels {
    /// Watch the namespaces of `kube` until `stop` is cancelled (RBAC: list and watch on
    /// namespaces); a broken watch is resumed with backoff.
    pub fn start(kube: kube::Client, stop: CancellationToken) -> Self {
        let (store, writer) = reflector::store();
        let stream = reflector::reflector(
            writer,
            watcher(
                Api::<PartialObjectMeta<Namespace>>::all(kube),
                watcher::Config::default(),
            ),
        )
        .default_backoff();
        tokio::spawn(async move {
            let mut stream = std::pin::pin!(stream);
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    next = stream.next() => match next {
                        None => return,
                        Some(Ok(_)) => {}
                        Some(Err(e)) => warn!(error = %e, "watching namespaces (their gpuledger.io/path label)"),
                    },
                }
            }
        });
        NamespaceLabels { store }
    }

    /// The value of `label` on namespace `ns`: Ok(None) when it has none, or when no such
    /// namespace appears within a short wait (a review no API server sent may name any);
    /// Err when the watch has not listed the namespaces yet.
    pub async fn label(&self, ns: &str, label: &str) -> Result<Option<String>, String> {
        let key = ObjectRef::new(ns);
        let deadline = tokio::time::Instant::now() + WAIT;
        tokio::time::timeout_at(deadline, self.store.wait_until_ready())
            .await
            .map_err(|_| {
                format!(
                    "the namespaces are not listed yet (watch of namespaces; RBAC: list and \
                     watch on namespaces), so namespace {ns}'s label {label} is unknown"
                )
            })?
            .map_err(|e| format!("the watch of namespaces stopped: {e}"))?;
        loop {
            if let Some(n) = self.store.get(&key) {
                return Ok(n
                    .metadata
                    .labels
                    .as_ref()
                    .and_then(|l| l.get(label))
                    .cloned());
            }
            if tokio::time::Instant::now() >= deadline {
                return Ok(None);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}
