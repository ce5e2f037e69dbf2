//! `Subscribe`: a node agent's view of its node, then the events that touch it.

use gpuledger_ledger::pb;
use gpuledger_proto::allocator::v1 as api;
use tokio::sync::{broadcast, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use super::{BoxStream, Service};

pub(super) async fn subscribe(
    svc: &Service,
    req: Request<api::SubscribeRequest>,
) -> Result<Response<BoxStream<api::SubscribeResponse>>, Status> {
    svc.check_serving()?;
    let r = req.into_inner();
    if r.node.is_empty() {
        return Err(Status::invalid_argument("node is empty"));
    }
    let mut rx = svc.shared.batches.subscribe();
    let shared = svc.shared.clone();
    let node = r.node;
    let (tx, out) = mpsc::channel(256);
    // Start: a view of the node, or the recent events after from_seq.
    let (first, mut last) = {
        let resume = if r.from_seq > 0 {
            shared.recent_after(r.from_seq)
        } else {
            None
        };
        let epoch = shared.role_info().epoch;
        match resume {
            Some(batches) if shared.seq() >= r.from_seq => {
                let msgs: Vec<api::SubscribeResponse> = batches
                    .iter()
                    .flat_map(|b| b.events.iter())
                    .filter(|e| e.seq > r.from_seq && for_node(e, &node))
                    .map(|e| api::SubscribeResponse {
                        epoch: e.epoch.max(epoch),
                        body: Some(api::subscribe_response::Body::Event(e.clone())),
                    })
                    .collect();
                let last = batches
                    .last()
                    .and_then(|b| b.events.last())
                    .map_or(r.from_seq, |e| e.seq);
                (msgs, last)
            }
            _ => {
                let l = shared.view().await;
                let mut allocations: Vec<pb::Allocation> = l
                    .node(&node)
                    .map(|n| {
                        n.allocs
                            .iter()
                            .filter_map(|id| l.alloc(*id))
                            .map(|a| a.to_pb())
                            .collect()
                    })
                    .unwrap_or_default();
                allocations.sort_by_key(|a| a.id);
                let view = api::NodeView {
                    seq: l.seq(),
                    inventory: l.node(&node).map(|n| n.inventory()),
                    allocations,
                };
                (
                    vec![api::SubscribeResponse {
                        epoch: l.epoch().max(epoch),
                        body: Some(api::subscribe_response::Body::View(view)),
                    }],
                    l.seq(),
                )
            }
        }
    };
    tokio::spawn(
        async move {
            for m in first {
                if tx.send(Ok(m)).await.is_err() {
                    return;
                }
            }
            loop {
                match rx.recv().await {
                    Ok(b) => {
                        for e in &b.events {
                            if e.seq <= last {
                                continue;
                            }
                            last = e.seq;
                            if !for_node(e, &node) {
                                continue;
                            }
                            let m = api::SubscribeResponse {
                                epoch: e.epoch,
                                body: Some(api::subscribe_response::Body::Event(e.clone())),
                            };
                            if tx.send(Ok(m)).await.is_err() {
                                return;
                            }
                        }
                    }
                    Err(broadcast::error::RecvError::Lagged(n)) => {
                        let _ = tx
                            .send(Err(Status::resource_exhausted(format!(
                                "subscriber fell {n} batches behind; resubscribe from seq {last}"
                            ))))
                            .await;
                        return;
                    }
                    Err(broadcast::error::RecvError::Closed) => return,
                }
            }
        }
        .in_current_span(),
    );
    Ok(Response::new(Box::pin(ReceiverStream::new(out))))
}

fn event_node(e: &pb::Event) -> Option<&str> {
    use pb::event::Body;
    Some(match e.body.as_ref()? {
        Body::NodeRegistered(r) => r.inventory.as_ref()?.node.as_str(),
        Body::NodeRemoved(r) => &r.node,
        Body::DeviceHealthChanged(h) => &h.node,
        Body::Reserved(r) => &r.node,
        Body::Bound(b) => &b.node,
        Body::Assigned(a) => &a.node,
        Body::IdentityCorrected(c) => &c.node,
        Body::Released(r) => &r.node,
        Body::LimitViolated(v) => &v.node,
        Body::Nominated(n) => &n.node,
        Body::NominationEnded(x) => &x.node,
        Body::ClaimGranted(g) => &g.node,
        Body::ClaimRefused(r) => &r.node,
        Body::ClaimPrepared(p) => &p.node,
        Body::ClaimUnprepared(u) => &u.node,
        Body::ClaimConsumersChanged(c) => &c.node,
        Body::LeaderElected(_)
        | Body::QuotaSet(_)
        | Body::BudgetSet(_)
        | Body::BudgetRemoved(_) => return None,
    })
}

fn for_node(e: &pb::Event, node: &str) -> bool {
    event_node(e).is_none_or(|n| n == node)
}
