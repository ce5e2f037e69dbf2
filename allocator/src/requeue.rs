//! Requeue pending GPU pods when the ledger frees room. kube-scheduler retries a pod the
//! extender found no room for on the next cluster event (a pod deleted, a node changed); when
//! that event is the deletion of the pod whose GPUs it needs, the retry can come a moment
//! before the leader has released them, and the pod then waits for the next event or for
//! kube-scheduler's periodic flush (5 minutes). The leader therefore watches its own committed
//! events: when one can free room ([`plan::frees_room`]), it sets a condition
//! ([`plan::ROOM_FREED`]) in the status of the pods kube-scheduler last found unschedulable, at
//! most `MAX_PER_PASS` a pass, each at most once per `GAP`; kube-scheduler takes the update as
//! a reason to retry them after their backoff. What to requeue is decided in [`plan`]; this
//! shell watches and patches.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::serde_json::json;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::reflector::Store;
use tokio::sync::{Notify, broadcast};
use tokio::task::JoinSet;
use tracing::debug;

use crate::runtime::Runtime;
use crate::shared::Shared;

pub mod plan;

/// Pods annotated at most per pass.
const MAX_PER_PASS: usize = 256;
/// A pod is annotated at most once in this long.
const GAP: Duration = Duration::from_secs(2);
/// Passes are at least this far apart (a burst of releases makes one pass; each looks at
/// every pod of the watch). kube-scheduler's own backoff is at least this long.
const PACE: Duration = Duration::from_secs(1);
/// A pass without a nudge this often (nothing to do unless room was freed).
const EVERY: Duration = Duration::from_secs(60);

/// Start requeueing on `tasks`: the committed events of `shared`, the pods of the watch's
/// `pods`, patched through `client`, on the leader only (`rt`'s passes).
pub fn spawn(
    tasks: &mut JoinSet<()>,
    rt: Runtime,
    shared: Arc<Shared>,
    pods: Store<Pod>,
    client: kube::Client,
) {
    let m = shared.metrics.pods_requeued.clone();
    let nudge = Arc::new(Notify::new());
    // The seq of the last event that freed room, and the last one requeued for.
    let freed = Arc::new(AtomicU64::new(0));
    let mut batches = shared.batches.subscribe();
    let (n, f) = (nudge.clone(), freed.clone());
    tasks.spawn(async move {
        loop {
            let seq = match batches.recv().await {
                Ok(b) => {
                    let last = b.first_seq + b.events.len() as u64;
                    if !b.events.iter().any(plan::frees_room) {
                        continue;
                    }
                    last.saturating_sub(1).max(b.first_seq)
                }
                // Some were missed: any of them may have freed room.
                Err(broadcast::error::RecvError::Lagged(_)) => shared.seq(),
                Err(broadcast::error::RecvError::Closed) => return,
            };
            f.fetch_max(seq, Ordering::Relaxed);
            n.notify_one();
        }
    });
    let mut last = HashMap::new();
    let mut done = 0u64;
    tasks.spawn(rt.passes(EVERY, Some(nudge), move |_| {
        let seq = freed.load(Ordering::Relaxed);
        let todo = if seq > done {
            done = seq;
            let pending = pods.state().iter().filter_map(|p| plan::waiting(p)).collect();
            plan::choose(pending, &mut last, Instant::now(), GAP, MAX_PER_PASS)
        } else {
            Vec::new()
        };
        let (client, m) = (client.clone(), m.clone());
        async move {
            // A strategic merge patch: conditions merge by type, kube-scheduler's stay.
            let patch = json!({"status": {"conditions": [{
                "type": plan::ROOM_FREED,
                "status": "True",
                "reason": "LedgerFreedRoom",
                "message": gpuledger_request::room_freed_message(seq),
            }]}});
            for w in todo {
                let api = Api::<Pod>::namespaced(client.clone(), &w.ns);
                let outcome = match api
                    .patch_status(&w.name, &PatchParams::default(), &Patch::Strategic(&patch))
                    .await
                {
                    Ok(_) => "requeued",
                    Err(e) => {
                        debug!(pod = %format!("{}/{}", w.ns, w.name), error = %e, "requeueing a pending GPU pod failed");
                        "failed"
                    }
                };
                m.get_or_create(&vec![("outcome", outcome)]).inc();
            }
            tokio::time::sleep(PACE).await;
        }
    }));
}
