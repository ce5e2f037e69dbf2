//! The unary reads, answered from this replica's committed state.

use gpuledger_ledger::placement;
use gpuledger_proto::allocator::v1 as api;
use tonic::{Request, Response, Status};

use super::Service;
use crate::shared::Role;

pub(super) async fn filter(
    svc: &Service,
    req: Request<api::FilterRequest>,
) -> Result<Response<api::FilterResponse>, Status> {
    svc.check_serving()?;
    let r = req.into_inner();
    let pr = svc.request(r.request)?;
    let resp = svc
        .on_view(move |l| {
            let names: Vec<String> = if r.nodes.is_empty() {
                l.nodes().keys().cloned().collect()
            } else {
                r.nodes
            };
            let f = placement::filter_nodes(l, names, &pr);
            api::FilterResponse {
                nodes: f.fits,
                failed: f.wait.into_iter().collect(),
                unresolvable: f.never.into_iter().collect(),
                seq: l.seq(),
            }
        })
        .await?;
    Ok(Response::new(resp))
}

pub(super) async fn score(
    svc: &Service,
    req: Request<api::ScoreRequest>,
) -> Result<Response<api::ScoreResponse>, Status> {
    svc.check_serving()?;
    let r = req.into_inner();
    let pr = svc.request(r.request)?;
    let resp = svc
        .on_view(move |l| api::ScoreResponse {
            seq: l.seq(),
            scores: placement::score_nodes(l, r.nodes.iter().map(String::as_str), &pr)
                .map(|(n, score)| api::NodeScore {
                    node: n.to_string(),
                    score: score.unwrap_or(0),
                })
                .collect(),
        })
        .await?;
    Ok(Response::new(resp))
}

pub(super) async fn status(
    svc: &Service,
    _req: Request<api::StatusRequest>,
) -> Result<Response<api::StatusResponse>, Status> {
    let role = svc.shared.role_info();
    let (seq, nodes, allocations) = {
        let l = svc.shared.view().await;
        (l.seq(), l.nodes().len() as u64, l.allocs().len() as u64)
    };
    let serving = svc.shared.serving();
    let leader_known = role.role == Role::Leader || !role.leader.is_empty();
    let nospace = svc.shared.nospace();
    let not_ready = match (&serving, &nospace, leader_known) {
        (Err(e), _, _) => e.clone(),
        (Ok(()), Some(_), _) => crate::shared::NOSPACE_REFUSAL.into(),
        (Ok(()), None, false) => "no allocator leader is elected right now".into(),
        _ => String::new(),
    };
    Ok(Response::new(api::StatusResponse {
        replica: svc.shared.replica.clone(),
        address: svc.shared.address.clone(),
        role: role.role.as_str().into(),
        leader: role.leader,
        epoch: role.epoch,
        seq,
        ready: not_ready.is_empty(),
        not_ready_reason: not_ready,
        nodes,
        allocations,
        etcd_alarm: nospace.map_or_else(String::new, |_| "NOSPACE".into()),
    }))
}

pub(super) async fn dump(
    svc: &Service,
    _req: Request<api::DumpRequest>,
) -> Result<Response<api::DumpResponse>, Status> {
    let shared = svc.shared.clone();
    let snapshot = svc
        .on_view(move |view| {
            let mut snapshot = view.to_snapshot();
            // With the chain's hash at its seq, `verify` checks the replica folded the log it
            // reads.
            if let Some(h) = shared.chain_hash_at(view.seq()) {
                snapshot.chain_hash = h.to_vec();
            }
            snapshot
        })
        .await?;
    Ok(Response::new(api::DumpResponse {
        snapshot: Some(snapshot),
        replica: svc.shared.replica.clone(),
    }))
}
