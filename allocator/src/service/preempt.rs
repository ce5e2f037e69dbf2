//! `Preempt`: the extender asks for room for a pending pod that fits on none of the scheduler's
//! nodes (see [`crate::preemption`]). Any replica plans from its own view and pod watch; the
//! leader decides (the `Nominate` command re-checks the room against its state), commits, and
//! then evicts, so only the replica whose sequencer committed the nomination evicts.

use gpuledger_ledger::{Command, Reply, pb};
use gpuledger_proto::allocator::v1 as api;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::reflector::Store;
use tonic::{Request, Response, Status};

use super::Service;
use super::forward::Written;
use crate::preemption;
use crate::shared::Role;

/// Most candidate nodes one `Preempt` may name (the search costs up to a few milliseconds per
/// node that could hold the pod).
pub const MAX_PREEMPT_NODES: usize = 512;

pub(super) async fn preempt(
    svc: &Service,
    req: Request<api::PreemptRequest>,
) -> Result<Response<api::PreemptResponse>, Status> {
    svc.check_serving()?;
    let r = req.get_ref().clone();
    if r.nodes.is_empty() {
        return Err(Status::invalid_argument(
            "preempt needs the nodes where only GPU room is missing",
        ));
    }
    if r.nodes.len() > MAX_PREEMPT_NODES {
        return Err(Status::invalid_argument(format!(
            "{} candidate nodes; a preemption considers at most {MAX_PREEMPT_NODES}",
            r.nodes.len()
        )));
    }
    let mut pr = svc.request(r.request.clone())?;
    let p = svc.preemption().clone();
    let Some((store, client)) = svc.authz().pods().cloned() else {
        p.outcome("refused");
        return Err(Status::failed_precondition(
            "this allocator has no Kubernetes API (--kubeconfig, or in a cluster): it cannot read \
             priorities or evict pods, so it does not preempt",
        ));
    };
    let Some(_permit) = p.permit() else {
        return Err(Status::resource_exhausted(
            "too many preemptions in flight on this allocator (--max-preemptions-in-flight); retry",
        ));
    };
    // The preemptor as the API server has it: its priority and policy are the API server's
    // word, not the caller's.
    let me = preemption::current_pod(&store, &client, &pr.pod)
        .await
        .map_err(|e| Status::unavailable(format!("cannot read the pod: {e}; retry")))?
        .ok_or_else(|| Status::not_found("the API server has no pod with this UID"))?;
    let spec = me.spec.as_ref();
    if spec.and_then(|s| s.preemption_policy.as_deref()) == Some("Never") {
        p.outcome("refused");
        return Err(Status::failed_precondition(format!(
            "pod {} has preemptionPolicy Never: it waits for GPU room and evicts nothing",
            preemption::pod_name(Some(&pr.pod))
        )));
    }
    if let Some(n) = spec.and_then(|s| s.node_name.as_deref()) {
        p.outcome("refused");
        return Err(Status::failed_precondition(format!(
            "pod {} is already bound to node {n}",
            preemption::pod_name(Some(&pr.pod))
        )));
    }
    pr.priority = spec.and_then(|s| s.priority).unwrap_or(0);
    let uid = pr.pod.uid.clone();

    // A live nomination gets the same answer; its victims still running are evicted again (a
    // leader that died between its commit and the evictions leaves them to the next call).
    let (live, seq, epoch) = {
        let v = svc.shared.view().await;
        (v.nominations().get(&uid).cloned(), v.seq(), v.epoch())
    };
    if let Some(n) = live {
        p.outcome("repeat");
        if svc.shared.role_info().role == Role::Leader {
            spawn_evictions(svc, store, client, n.clone());
        }
        return Ok(Response::new(api::PreemptResponse {
            nomination: Some(n),
            created: false,
            reason: String::new(),
            seq,
            epoch,
        }));
    }

    if let Some(a) = svc.shared.view().await.allocs_of_pod(&uid).first() {
        p.outcome("refused");
        return Err(Status::failed_precondition(format!(
            "pod {} already holds allocation {} on node {}",
            preemption::pod_name(Some(&pr.pod)),
            a.id,
            a.node
        )));
    }
    let pods = store.state();
    let mut nodes = r.nodes.clone();
    nodes.sort();
    nodes.dedup();
    let plan = preemption::choose(&svc.shared, &client, &pods, &pr, &nodes)
        .await
        .map_err(|e| match e {
            preemption::PlanError::Budgets(_) => Status::unavailable(e.to_string()),
            preemption::PlanError::Search(_) => Status::internal(e.to_string()),
        })?;
    let Some((plan, leaving)) = plan else {
        p.outcome("none");
        return Ok(Response::new(api::PreemptResponse {
            nomination: None,
            created: false,
            reason: format!(
                "evicting pods of priority below {} (those no PodDisruptionBudget protects) frees \
                 no room for it on these {} node(s)",
                pr.priority,
                nodes.len()
            ),
            seq,
            epoch,
        }));
    };
    let by_uid = preemption::names(&pods);
    let deadline = svc.shared.clock.now_ms() + p.ttl().as_millis() as i64;
    let nomination = plan.nomination(&pr, deadline, &|u| by_uid.get(u).cloned());
    let cmd = Command::Nominate {
        nomination: nomination.clone(),
        leaving,
    };
    match svc.write(req, cmd).await? {
        // Committed by this replica's sequencer: this replica evicts.
        Written::Here(c) => {
            let created = matches!(c.reply, Reply::Done { changed: true });
            p.outcome(if created { "nominated" } else { "repeat" });
            spawn_evictions(svc, store, client, nomination.clone());
            Ok(Response::new(api::PreemptResponse {
                nomination: Some(nomination),
                created,
                reason: String::new(),
                seq: c.seq,
                epoch: c.epoch,
            }))
        }
        Written::There(r) => Ok(r),
    }
}

/// Evict in a task of its own: the caller's deadline must not cut the evictions short once
/// the nomination is committed.
fn spawn_evictions(svc: &Service, store: Store<Pod>, client: kube::Client, n: pb::Nominated) {
    let (p, writer) = (svc.preemption.clone(), svc.writer.clone());
    tokio::spawn(async move { preemption::evict(&p, &writer, &store, &client, &n).await });
}
