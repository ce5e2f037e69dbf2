//! `preempt`: for each of the scheduler's candidate nodes, the pods to evict so that the pod's
//! GPU slices fit there, or no answer for the node when no eviction makes them fit.
//!
//! kube-scheduler calls this verb only for nodes where its own dry run found victims, which
//! needs a conflict on a resource it sees (CPU, memory, `gpuledger.io/gpu` slots): GPU memory
//! and compute are `ignoredByScheduler`, and when only they are short the dry run reprieves
//! every pod and the verb is never called (kubernetes#139270; filter then asks the allocator to
//! preempt, see [`crate::preemption`]). When it is called, the scheduler's victims rarely free
//! a slice; it accepts any pod of the node in the answer (`convertPodUIDToPod` looks the UID up
//! among the node's pods) and evicts exactly what is returned. So the answer is the
//! scheduler's own victims (its CPU and memory need them) plus the fewest lower-priority pods
//! whose slices let the pod fit on one GPU (or the GPUs it needs), chosen by
//! [`preempt::choose_victims`] on the ledger replica, with the room nominated for pods that
//! outrank this one counted as taken; their priorities come from the API server's pods on the
//! node, which also name the pods already terminating.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use gpuledger_ledger::placement::preempt::{self, Evictable};
use gpuledger_ledger::placement::{self, Fit};
use gpuledger_ledger::{Alloc, Ledger, PodRequest};
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::ListParams;
use serde_json::{Value, json};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tracing::field::Empty;
use tracing::{Span, debug, instrument, warn};

use super::wire::{PreemptionArgs, PreemptionResult};
use super::{App, bad_request, record_pod};
use crate::resources;

/// Node pod lists asked of the API server at once.
const LIST_CONCURRENCY: usize = 8;

/// How long the pod lists may take: the scheduler gives the whole call `httpTimeout` (5 s in
/// the shipped configuration); a node whose list is late is answered from the scheduler's
/// victims alone.
const LIST_TIMEOUT: Duration = Duration::from_secs(2);

/// The victims the scheduler offered on one node.
#[derive(Default)]
struct Offered {
    uids: Vec<String>,
    pdb_violations: Value,
}

#[instrument(name = "preempt", skip_all, fields(pod_uid = Empty, pod = Empty, nodes = Empty))]
pub(super) async fn preempt(State(app): State<App>, body: Bytes) -> Response {
    let args: PreemptionArgs = match serde_json::from_slice(&body) {
        Ok(a) => a,
        Err(e) => return bad_request("preempt", e),
    };
    let offered = offered(args.node_name_to_meta_victims, args.node_name_to_victims);
    Span::current().record("nodes", offered.len());
    let Some(pod) = args.pod.as_ref() else {
        return answer(BTreeMap::new());
    };
    record_pod(pod);
    let req = match resources::pod_request(pod) {
        Ok(Some(r)) => r,
        // No GPU request: gpuledger has no say in preemption.
        Ok(None) => {
            let all = offered
                .into_iter()
                .map(|(n, o)| (n, victims(&o.uids, o.pdb_violations)))
                .collect();
            return answer(all);
        }
        Err(_) => return answer(BTreeMap::new()),
    };
    let Some(replica) = &app.replica else {
        return unavailable("the extender runs without a ledger replica (--replica-stale-ms 0)");
    };
    // Nodes where evicting every pod still leaves no room are dropped before the API server
    // is asked anything about them.
    let worth = replica
        .read("preempt", |l, d| {
            let pr = d.request(req.clone());
            Some(pr.map(|pr| {
                offered
                    .keys()
                    .filter(|n| {
                        l.node(n).is_some_and(|s| {
                            !matches!(placement::evaluate(s, &pr), Err(Fit::Never(_)))
                        })
                    })
                    .cloned()
                    .collect::<Vec<_>>()
            }))
        })
        .await;
    let worth = match worth {
        Some(Ok(w)) => w,
        Some(Err(why)) => {
            debug!(%why, "the request can never be met");
            return answer(BTreeMap::new());
        }
        None => return unavailable("the ledger replica is not fresh"),
    };
    let on_node = match &app.kube {
        Some(k) => pods_on_nodes(k, &worth).await,
        None => HashMap::new(),
    };
    let priority = pod.spec.as_ref().and_then(|s| s.priority).unwrap_or(0);
    let me = pod.metadata.uid.clone().unwrap_or_default();
    let chosen = replica
        .read("preempt", |l, d| {
            let pr = d.request(req.clone()).ok()?;
            Some(
                worth
                    .iter()
                    .filter_map(|n| {
                        let o = offered.get(n)?;
                        let pods = on_node.get(n).map(Vec::as_slice);
                        let v = choose(l, n, &pr, priority, &me, o, pods)?;
                        Some((n.clone(), v))
                    })
                    .collect::<BTreeMap<_, _>>(),
            )
        })
        .await;
    match chosen {
        Some(c) => {
            debug!(candidates = offered.len(), kept = c.len(), "preempt");
            answer(c)
        }
        None => unavailable("the ledger replica is not fresh"),
    }
}

/// The answer for node `n`: the scheduler's victims plus those that free the GPU slices, or
/// None when no eviction makes the pod fit there. Without the node's pods from the API server
/// only the scheduler's victims are known to be evictable.
fn choose(
    l: &Ledger,
    n: &str,
    req: &PodRequest,
    priority: i32,
    me: &str,
    offered: &Offered,
    pods: Option<&[Pod]>,
) -> Option<Value> {
    let node = l.node_for(n, req)?;
    let allocs: Vec<&Alloc> = node.allocs.iter().filter_map(|id| l.alloc(*id)).collect();
    let mut leaving: BTreeSet<String> = offered.uids.iter().cloned().collect();
    let mut evictable = Vec::new();
    for p in pods.unwrap_or_default() {
        let Some(uid) = p.metadata.uid.as_deref().filter(|u| *u != me) else {
            continue;
        };
        let phase = p.status.as_ref().and_then(|s| s.phase.as_deref());
        if p.metadata.deletion_timestamp.is_some() {
            // Its slices are on their way back.
            leaving.insert(uid.to_string());
        } else if !matches!(phase, Some("Succeeded" | "Failed")) {
            evictable.push(Evictable {
                pod_uid: uid.to_string(),
                priority: p.spec.as_ref().and_then(|s| s.priority).unwrap_or(0),
            });
        }
    }
    let v = preempt::choose_victims(&node, &allocs, req, priority, &leaving, &evictable)?;
    let mut all: Vec<String> = offered.uids.iter().chain(&v.pods).cloned().collect();
    // The scheduler reads the first victim as the most important one (pickOneNodeForPreemption);
    // a pod whose priority is unknown is one it offered, already in its order.
    let known = |u: &String| {
        pods.unwrap_or_default()
            .iter()
            .find(|p| p.metadata.uid.as_ref() == Some(u))
            .map(|p| p.spec.as_ref().and_then(|s| s.priority).unwrap_or(0))
    };
    all.sort_by_key(|u| std::cmp::Reverse(known(u).unwrap_or(i32::MAX)));
    Some(victims(&all, offered.pdb_violations.clone()))
}

/// `MetaVictims` JSON.
fn victims(uids: &[String], pdb: Value) -> Value {
    let pods: Vec<Value> = uids.iter().map(|u| json!({ "UID": u })).collect();
    json!({ "Pods": pods, "NumPDBViolations": pdb })
}

/// The scheduler's candidate nodes with the victims it chose, from whichever form it sent.
fn offered(
    meta: Option<BTreeMap<String, Value>>,
    full: Option<BTreeMap<String, Value>>,
) -> BTreeMap<String, Offered> {
    let uids = |v: &Value, ptr: &str| -> Vec<String> {
        v.get("Pods")
            .and_then(Value::as_array)
            .map(|ps| {
                ps.iter()
                    .filter_map(|p| p.pointer(ptr).and_then(Value::as_str))
                    .map(String::from)
                    .collect()
            })
            .unwrap_or_default()
    };
    let mut out = BTreeMap::new();
    for (forms, ptr) in [(meta, "/UID"), (full, "/metadata/uid")] {
        for (node, v) in forms.unwrap_or_default() {
            out.entry(node).or_insert_with(|| Offered {
                uids: uids(&v, ptr),
                pdb_violations: v.get("NumPDBViolations").cloned().unwrap_or(json!(0)),
            });
        }
    }
    out
}

/// The pods bound to each node, from the API server's cache; a node whose list failed or came
/// late is missing.
async fn pods_on_nodes(kube: &kube::Client, nodes: &[String]) -> HashMap<String, Vec<Pod>> {
    let api: Api<Pod> = Api::all(kube.clone());
    let permits = Arc::new(Semaphore::new(LIST_CONCURRENCY));
    let mut lists = JoinSet::new();
    for n in nodes {
        let (api, permits, n) = (api.clone(), permits.clone(), n.clone());
        lists.spawn(async move {
            let _permit = permits.acquire_owned().await;
            let lp = ListParams::default()
                .fields(&format!("spec.nodeName={n}"))
                .match_any();
            (n, api.list(&lp).await)
        });
    }
    let mut out = HashMap::new();
    let collect = async {
        while let Some(r) = lists.join_next().await {
            match r {
                Ok((n, Ok(l))) => {
                    out.insert(n, l.items);
                }
                Ok((n, Err(e))) => warn!(node = %n, error = %e, "cannot list the node's pods"),
                Err(e) => warn!(error = %e, "pod list task failed"),
            }
        }
    };
    if tokio::time::timeout(LIST_TIMEOUT, collect).await.is_err() {
        warn!(
            timeout_ms = LIST_TIMEOUT.as_millis() as u64,
            "pod lists came late"
        );
    }
    out
}

/// The answer, without the nodes that need no eviction: the filter already offers those, and
/// schedulers after 1.20 refuse an extender's node with no victims (1.20 would nominate it).
fn answer(mut nodes: BTreeMap<String, Value>) -> Response {
    nodes.retain(|_, v| v["Pods"].as_array().is_some_and(|p| !p.is_empty()));
    axum::Json(PreemptionResult {
        node_name_to_meta_victims: nodes,
    })
    .into_response()
}

fn unavailable(why: &str) -> Response {
    warn!(why, "cannot choose preemption victims");
    (
        StatusCode::SERVICE_UNAVAILABLE,
        axum::Json(json!({
            "Error": format!("{why}: cannot tell which pods free GPU slices; retry")
        })),
    )
        .into_response()
}
