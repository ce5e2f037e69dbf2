//! `ReadSnapshots`: every stored snapshot as the raw parts etcd holds, so that `verify` checks
//! exactly what a replica starting from one would load. One part (≤ 1 MiB) per message.

use gpuledger_proto::allocator::v1 as api;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use super::{BoxStream, Service};

pub(super) async fn read_snapshots(
    svc: &Service,
    _req: Request<api::ReadSnapshotsRequest>,
) -> Result<Response<BoxStream<api::SnapshotPart>>, Status> {
    let log = svc.log.clone();
    let unavailable =
        |e: crate::log::LogError| Status::unavailable(format!("reading snapshots: {e}"));
    let seqs = log.snapshot_seqs().await.map_err(unavailable)?;
    // A few parts in flight: a large snapshot is never held whole here.
    let (tx, out) = mpsc::channel(4);
    tokio::spawn(
        async move {
            for seq in seqs {
                let (parts, total_bytes, keys) = match log.snapshot_layout(seq).await {
                    Ok(Some(l)) => l,
                    // Pruned since it was listed.
                    Ok(None) => continue,
                    Err(e) => {
                        let _ = tx.send(Err(unavailable(e))).await;
                        return;
                    }
                };
                for (part, key) in keys.into_iter().enumerate() {
                    let data = match log.get_raw(&key).await {
                        Ok(Some(d)) => d,
                        Ok(None) => continue,
                        Err(e) => {
                            let _ = tx.send(Err(unavailable(e))).await;
                            return;
                        }
                    };
                    let msg = api::SnapshotPart {
                        seq,
                        key,
                        parts,
                        total_bytes,
                        part: part as u32,
                        data,
                    };
                    if tx.send(Ok(msg)).await.is_err() {
                        return;
                    }
                }
            }
        }
        .in_current_span(),
    );
    Ok(Response::new(Box::pin(ReceiverStream::new(out))))
}
