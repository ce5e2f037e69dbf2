//! `filter`: which of the scheduler's nodes can hold the pod now, which could after
//! preemption, and which never can.

use std::borrow::Cow;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use gpuledger_ledger::placement;
use gpuledger_proto::allocator::v1 as api;
use tonic::Code;
use tracing::field::Empty;
use tracing::{Span, debug, instrument, warn};

use super::wire::{ExtenderArgs, FilterResult, NodeList, node_name, take_node_names};
use super::{App, bad_request, failed, json_sized, record_pod};
use crate::preemption::Preemption;
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
    let req = match resources::pod_request(pod) {
        Ok(Some(r)) => r,
        Ok(None) => {
            // Nothing gpuledger manages: no opinion.
            answer_nodes(full, names, &mut out);
            return axum::Json(out).into_response();
        }
        Err(e) => {
            unresolvable_everywhere(&names, &e.to_string(), &mut out);
            answer_nodes(full, Vec::new(), &mut out);
            return axum::Json(out).into_response();
        }
    };
    let local = match &app.replica {
        None => None,
        Some(r) => {
            r.read("filter", |l, d| match d.request(req.clone()) {
                Ok(pr) => {
                    let mut f = parallel::filter_nodes(l, &names, &pr);
                    r.in_flight.filter(l, d, &pr, &mut f);
                    let nominated = nominee_waits(l, &pr, &mut f);
                    // A node the replica does not know yet may be registered by now: ask.
                    (f.unregistered == 0).then(|| Ok((f, l.seq(), nominated)))
                }
                Err(why) => Some(Err(tonic::Status::invalid_argument(why))),
            })
            .await
        }
    };
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
            if let Some(r) = &app.replica {
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
            if f.fits.is_empty() && !f.wait.is_empty() && !nominated && Preemption::may_preempt(pod)
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

/// Whether the pod of `req` is nominated; if so, its nominated node's reason says that the
/// room there is being freed for it.
fn nominee_waits(
    l: &gpuledger_ledger::Ledger,
    req: &placement::PodRequest,
    f: &mut placement::Filtered,
) -> bool {
    let Some(n) = l.nominations().get(&req.pod.uid) else {
        return false;
    };
    let victims: Vec<String> = n
        .victims
        .iter()
        .filter_map(|v| v.pod.as_ref())
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
    true
}

fn unresolvable_everywhere(names: &[String], why: &str, out: &mut FilterResult) {
    for n in names {
        out.failed_and_unresolvable_nodes
            .insert(n.clone(), why.to_string());
        out.failed_nodes.insert(n.clone(), why.to_string());
    }
}
