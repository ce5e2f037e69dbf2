//! `Replicate`: a snapshot (or the recent batches after a seq), then every committed batch,
//! the placement defaults whenever they change, and heartbeats.

use std::time::Duration;

use gpuledger_ledger::pb;
use gpuledger_proto::allocator::v1 as api;
use tokio::sync::{broadcast, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use super::{BoxStream, Service};
use crate::shared::Shared;

/// How often Replicate tells a replica that the stream is alive.
const REPLICATE_HEARTBEAT: Duration = Duration::from_millis(500);

/// The newest epoch known here: the ledger's or the role's.
async fn epoch_now(s: &Shared) -> u64 {
    s.view().await.epoch().max(s.role_info().epoch)
}

/// What a replica of the ledger needs to place requests as this replica does.
fn placement_defaults(
    policy: gpuledger_ledger::Policy,
    workload: &gpuledger_ledger::placement::Workload,
) -> api::PlacementDefaults {
    api::PlacementDefaults {
        default_policy: policy.as_str().to_string(),
        workload: workload
            .counts()
            .map(|(s, count)| api::WorkloadShape {
                cpu_milli: s.cpu_milli,
                memory_mib: s.memory_mib,
                gpus: s.gpus,
                core_milli: s.core_milli,
                models: s.models.clone(),
                count,
            })
            .collect(),
    }
}

pub(super) async fn replicate(
    svc: &Service,
    req: Request<api::ReplicateRequest>,
) -> Result<Response<BoxStream<api::ReplicateResponse>>, Status> {
    use api::replicate_response::Body;
    svc.check_serving()?;
    let from = req.into_inner().from_seq;
    let shared = svc.shared.clone();
    // Subscribe before reading the state: every batch after the start point is then queued.
    let mut rx = shared.batches.subscribe();
    let mut learned = svc.placement.learned.watch();
    let default_policy = svc.placement.default_policy;
    if from > 0 && shared.seq() < from {
        // The receiver saw more than this replica folded: give it a moment to catch up.
        shared.wait_applied(from, Duration::from_secs(2)).await;
        if shared.seq() < from {
            return Err(Status::unavailable(format!(
                "this replica is behind seq {from}; try another"
            )));
        }
    }
    let epoch = epoch_now(&shared).await;
    let placement = placement_defaults(default_policy, &learned.borrow_and_update());
    let mut first = vec![api::ReplicateResponse {
        epoch,
        body: Some(Body::Placement(placement)),
    }];
    let resume = if from > 0 {
        shared.recent_after(from)
    } else {
        None
    };
    let mut last = match resume {
        Some(batches) => {
            first.extend(batches.iter().map(|b| api::ReplicateResponse {
                epoch: b.epoch,
                body: Some(Body::Batch(pb::EventBatch::clone(b))),
            }));
            batches
                .last()
                .and_then(|b| b.events.last())
                .map_or(from, |e| e.seq)
        }
        None => {
            let l = shared.view().await;
            let mut snap = l.to_snapshot();
            if let Some(h) = shared.chain_hash_at(l.seq()) {
                snap.chain_hash = h.to_vec();
            }
            first.push(api::ReplicateResponse {
                epoch,
                body: Some(Body::Snapshot(snap)),
            });
            l.seq()
        }
    };
    let (tx, out) = mpsc::channel(256);
    tokio::spawn(async move {
        for m in first {
            if tx.send(Ok(m)).await.is_err() {
                return;
            }
        }
        let mut beat = tokio::time::interval(REPLICATE_HEARTBEAT);
        loop {
            let m = tokio::select! {
                b = rx.recv() => match b {
                    Ok(b) => {
                        let Some(end) = b.events.last().map(|e| e.seq) else { continue };
                        if end <= last {
                            continue;
                        }
                        last = end;
                        Ok(api::ReplicateResponse {
                            epoch: b.epoch,
                            body: Some(Body::Batch(pb::EventBatch::clone(&b))),
                        })
                    }
                    Err(broadcast::error::RecvError::Lagged(n)) => Err(Status::resource_exhausted(
                        format!("replica fell {n} batches behind; resume from seq {last}"),
                    )),
                    Err(broadcast::error::RecvError::Closed) => return,
                },
                c = learned.changed() => {
                    if c.is_err() {
                        return;
                    }
                    let p = placement_defaults(default_policy, &learned.borrow_and_update());
                    Ok(api::ReplicateResponse {
                        epoch: epoch_now(&shared).await,
                        body: Some(Body::Placement(p)),
                    })
                }
                _ = beat.tick() => match shared.serving() {
                    // A replica that cannot serve must not keep a cache looking fresh.
                    Err(why) => Err(Status::unavailable(why)),
                    Ok(()) => Ok(api::ReplicateResponse {
                        epoch: epoch_now(&shared).await,
                        body: Some(Body::Heartbeat(api::Heartbeat {
                            seq: *shared.applied.borrow(),
                        })),
                    }),
                },
            };
            let end = m.is_err();
            if tx.send(m).await.is_err() || end {
                return;
            }
        }
    }
    .in_current_span());
    Ok(Response::new(Box::pin(ReceiverStream::new(out))))
}
