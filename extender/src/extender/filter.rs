//! `filter`: which of the scheduler's nodes can hold the pod now, which could after
//! preemption, and which never can.

use std::borrow::Cow;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use gpuledger_ledger::placement;
use gpuledger_proto::allocator::v1 as api;
use gpuledger_proto::ledger::v1 as pb;
use tonic::Code;
use tracing::field::Empty;
use tracing::{Span, debug, info, instrument, warn};

use super::dra::Unreadable;
use super::wire::{ExtenderArgs, FilterResult, NodeList, node_name, take_node_names};
use super::{App, bad_request, failed, json_sized, record_pod};
use crate::preemption::Preemption;
use crate::replica::Replica;
use crate::{parallel, resources};

/// Keep the nodes named in `keep`, in the request's form: full nodes when it carried them
/// (`nodes`), names otherwise.
fn answer_nodes(nodes: Option<NodeList>, keep: Vec<String>, out: &mut FilterResult) {
    if let Some(list) = nodes {
        let keep: std::collections::HashSet<&str> = keep.iter().map(String::as_str).collect();
        let items = list
            .items
            .into_iter()
            .filter(|n| node_name(n).is_some_and(|x| keep.contains(x.as_str())))
            .collect();
        out.nodes = Some(NodeList {
            metadata: list.metadata,
            items,
        });
    } else {
        out.node_names = Some(keep);
    }
}

#[instrument(name = "filter", skip_all, fields(pod_uid = Empty, pod = Empty, nodes = Empty, seq = Empty))]
pub(super) async fn filter(State(app): State<App>, body: Bytes) -> Response {
    let t0 = Instant::now();
    let mut args: ExtenderArgs<'_> = match serde_json::from_slice(&body) {
        Ok(a) => a,
        Err(e) => return bad_request("filter", e),
    };
    if args.pod.is_none() {
        return bad_request("filter", "Pod is missing");
    }
    // Full nodes are answered in kind only when the request carried no names.
    let full = if args.node_names.is_none() {
        args.nodes.take()
    } else {
        None
    };
    let names: Vec<String> = if let Some(l) = &full {
        l.items.iter().filter_map(node_name).collect()
    } else {
        take_node_names(&mut args)
            .into_iter()
            .map(Cow::into_owned)
            .collect()
    };
    let Some(pod) = args.pod.as_ref() else {
        return bad_request("filter", "Pod is missing");
    };
    record_pod(pod);
    Span::current().record("nodes", names.len());
    let mut out = FilterResult::default();
    if names.is_empty() {
        // The allocator reads "no nodes" as "all nodes"; the scheduler means none.
        answer_nodes(full, Vec::new(), &mut out);
        return axum::Json(out).into_response();
    }
    let req = match super::dra::pod_request(&app, pod).await {
        Ok(Some(r)) => r,
        Ok(None) => {
            // Nothing gpuledger manages: no opinion.
            answer_nodes(full, names, &mut out);
            return axum::Json(out).into_response();
        }
        Err(Unreadable::Invalid(e)) => {
            unresolvable_everywhere(&names, &e, &mut out);
            answer_nodes(full, Vec::new(), &mut out);
            return axum::Json(out).into_response();
        }
        Err(Unreadable::Unavailable(e)) => {
            warn!(error = %e, "filter cannot read the pod's claims");
            out.error = e;
            return failed(axum::Json(out).into_response());
        }
    };
    // A retry the leader caused by freeing room (its condition names the seq): the answer must
    // reflect that seq, else a replica a moment behind refuses the pod again and nothing else
    // retries it (the replica waits for the seq, or the allocator answers).
    if let (Some(r), Some(seq)) = (&app.replica, gpuledger_request::room_freed_seq(pod)) {
        r.note_write(seq);
    }
    let mut local = match &app.replica {
        None => None,
        Some(r) => on_replica(r, &names, &req).await,
    };
    // A nominated pod whose victims are gone from the API server, retried by the scheduler
    // on their deletion: the allocator releases their GPUs on that same deletion, a moment
    // later, and no other event would make the scheduler try the pod again. Wait for it.
    if let (Some(r), Some(Ok((f, _, Some(victims))))) = (&app.replica, &local)
        && f.fits.is_empty()
        && !victims.is_empty()
        && victims_gone(&app, victims).await
    {
        let uids: Vec<String> = victims.iter().map(|v| v.uid.clone()).collect();
        let released =
            |l: &gpuledger_ledger::Ledger| uids.iter().all(|u| l.allocs_of_pod(u).is_empty());
        if r.wait_for(VICTIMS_RELEASE_WAIT, released).await {
            info!("the victims' GPUs were released while filter waited");
            local = on_replica(r, &names, &req).await;
        }
    }
    let local = local.map(|x| x.map(|(f, seq, victims)| (f, seq, victims.is_some())));
    let answer = match local {
        Some(Ok(r)) => Ok(r),
        Some(Err(s)) => Err((names, s)),
        None => {
            let fr = api::FilterRequest {
                request: Some(req.clone()),
                nodes: names,
            };
            let res = app
                .allocators
                .call("Filter", |mut c| {
                    let fr = fr.clone();
                    async move { c.filter(fr).await }
                })
                .await;
            match res {
                Ok(r) => Ok((
                    placement::Filtered {
                        fits: r.nodes,
                        wait: r.failed.into_iter().collect(),
                        never: r.unresolvable.into_iter().collect(),
                        ..Default::default()
                    },
                    r.seq,
                    // Unknown here: the leader answers a live nomination as a repeat.
                    false,
                )),
                Err(s) => Err((fr.nodes, s)),
            }
        }
    };
    match answer {
        Ok((f, seq, nominated)) => {
            Span::current().record("seq", seq);
            debug!(
                feasible = f.fits.len(),
                ms = t0.elapsed().as_secs_f64() * 1e3,
                "filter"
            );
            // A DRA pod is not reserved at bind (its claim is certified): nothing in flight.
            if let Some(r) = app.replica.as_ref().filter(|_| !req.dra) {
                // The scheduler binds the pod to one of these next, before it tells us which:
                // counted once the API server confirms the pod (off the scheduler's path).
                if let (Some(v), Some(kube)) = (r.in_flight.feasible(&req, &f.fits), &app.kube) {
                    let (r, kube, names) = (r.clone(), kube.clone(), app.scheduler_names.clone());
                    app.tasks.spawn(async move {
                        let own = own_request(kube, &names, &v).await;
                        r.in_flight.verified(&v.uid, own);
                    });
                }
            }
            // Only GPU room is missing, and the scheduler's own preemption cannot see it.
            // (The ledger nominates nothing on DRA nodes.)
            if f.fits.is_empty()
                && !f.wait.is_empty()
                && !nominated
                && !req.dra
                && Preemption::may_preempt(pod)
            {
                let nodes = f.wait.iter().map(|(n, _)| n.clone()).collect();
                app.preemption
                    .ask(&app.allocators, &app.tasks, req.clone(), nodes);
            }
            out.failed_nodes = f.wait.into_iter().chain(f.never.clone()).collect();
            out.failed_and_unresolvable_nodes = f.never.into_iter().collect();
            answer_nodes(full, f.fits, &mut out);
        }
        Err((names, s)) if s.code() == Code::InvalidArgument => {
            unresolvable_everywhere(&names, s.message(), &mut out);
            answer_nodes(full, Vec::new(), &mut out);
        }
        Err((_, s)) => {
            warn!(error = %s.message(), "filter failed");
            out.error = s.message().to_string();
            return failed(axum::Json(out).into_response());
        }
    }
    let hint = out.node_names.as_ref().map_or(0, Vec::len) * 24
        + (out.failed_nodes.len() + out.failed_and_unresolvable_nodes.len()) * 64;
    json_sized(&out, hint.max(128))
}

/// The request of the pod `v` names as the API server has it, if it has that pod pending, with
/// that UID and of one of gpuledger's schedulers (`names`); None otherwise or on an error.
async fn own_request(
    kube: kube::Client,
    names: &[String],
    v: &crate::assume::Verify,
) -> Option<api::PodRequest> {
    let pods: kube::Api<k8s_openapi::api::core::v1::Pod> =
        kube::Api::namespaced(kube, &v.namespace);
    let pod = match pods.get_opt(&v.name).await {
        Ok(p) => p?,
        Err(e) => {
            debug!(error = %e, "cannot check a filtered pod; it counts from its bind on");
            return None;
        }
    };
    let spec = pod.spec.as_ref()?;
    let ours = names
        .iter()
        .any(|n| Some(n.as_str()) == spec.scheduler_name.as_deref());
    let real = pod.metadata.uid.as_deref() == Some(v.uid.as_str())
        && spec.node_name.is_none()
        && pod.metadata.deletion_timestamp.is_none();
    if !(ours && real) {
        return None;
    }
    resources::pod_request(&pod).ok().flatten()
}

/// How long filter waits for the ledger to release the GPUs of a nominated pod's victims once
/// the API server no longer has them.
const VICTIMS_RELEASE_WAIT: Duration = Duration::from_secs(1);

/// At most this many victims of one nomination are looked up in the API server per filter.
const VICTIMS_LOOKED_UP: usize = 16;

/// What filter found on the replica: the nodes, the seq, and for a nominated pod the victims
/// that still hold GPUs.
type OnReplica = Option<Result<(placement::Filtered, u64, Option<Vec<pb::PodRef>>), tonic::Status>>;

/// Filter on the extender's replica; None when the allocator must answer.
async fn on_replica(r: &Replica, names: &[String], req: &api::PodRequest) -> OnReplica {
    r.read("filter", |l, d| match d.request(req.clone()) {
        Ok(pr) => {
            let mut f = parallel::filter_nodes(l, names, &pr);
            r.in_flight.filter(l, d, &pr, &mut f);
            let victims = nominee_waits(l, &pr, &mut f);
            // A node the replica does not know yet may be registered by now: ask.
            (f.unregistered == 0).then(|| Ok((f, l.seq(), victims)))
        }
        Err(why) => Some(Err(tonic::Status::invalid_argument(why))),
    })
    .await
}

/// Whether none of `victims` is in the API server any more (deleted, or another pod of that
/// name); false when one is, when it cannot be read, or there are too many to look up.
async fn victims_gone(app: &App, victims: &[pb::PodRef]) -> bool {
    let Some(kube) = &app.kube else {
        return false;
    };
    if victims.len() > VICTIMS_LOOKED_UP {
        return false;
    }
    for v in victims {
        let pods: kube::Api<k8s_openapi::api::core::v1::Pod> =
            kube::Api::namespaced(kube.clone(), &v.namespace);
        match pods.get_opt(&v.name).await {
            Ok(Some(p)) if p.metadata.uid.as_deref() == Some(v.uid.as_str()) => return false,
            Ok(_) => {}
            Err(e) => {
                debug!(error = %e, "cannot read a preemption victim");
                return false;
            }
        }
    }
    true
}

/// When the pod of `req` is nominated: the victims that still hold GPUs in the ledger, and its
/// nominated node's reason says that the room there is being freed for it. None otherwise.
fn nominee_waits(
    l: &gpuledger_ledger::Ledger,
    req: &placement::PodRequest,
    f: &mut placement::Filtered,
) -> Option<Vec<pb::PodRef>> {
    let n = l.nominations().get(&req.pod.uid)?;
    let holding: Vec<pb::PodRef> = n
        .victims
        .iter()
        .filter_map(|v| v.pod.clone())
        .filter(|p| !l.allocs_of_pod(&p.uid).is_empty())
        .collect();
    let victims: Vec<String> = holding
        .iter()
        .map(|p| format!("{}/{}", p.namespace, p.name))
        .collect();
    for (_, why) in f.wait.iter_mut().filter(|(node, _)| *node == n.node) {
        why.push_str(&if victims.is_empty() {
            "; GPU room here is kept for this pod while the pods leaving free it".to_string()
        } else {
            format!(
                "; GPU room here is kept for this pod while {} (preempted for it) leave",
                victims.join(", ")
            )
        });
    }
    Some(holding)
}

fn unresolvable_everywhere(names: &[String], why: &str, out: &mut FilterResult) {
    for n in names {
        out.failed_and_unresolvable_nodes
            .insert(n.clone(), why.to_string());
        out.failed_nodes.insert(n.clone(), why.to_string());
    }
}
