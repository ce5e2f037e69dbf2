//! `ReadLog`: the whole history, from the archive and then from etcd, as one stream.

use gpuledger_ledger::pb;
use gpuledger_proto::allocator::v1 as api;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use super::{BoxStream, Service};

pub(super) async fn read_log(
    svc: &Service,
    req: Request<api::ReadLogRequest>,
) -> Result<Response<BoxStream<pb::EventBatch>>, Status> {
    // Each page after the first is a heavy read of its own: a stream of the whole history is
    // paced by the caller's heavy-read rate, not read at the speed of etcd.
    let caller = req
        .extensions()
        .get::<gpuledger_auth::server::Authenticated>()
        .map(gpuledger_auth::server::Authenticated::holder);
    let limits = svc.read_limits.clone();
    let r = req.into_inner();
    let (log, archive) = (svc.log.clone(), svc.archive.clone());
    let (tx, out) = mpsc::channel(64);
    tokio::spawn(
        async move {
            let to = r.to_seq;
            let mut from = r.from_seq.max(1);
            loop {
                // The archive first, while it holds `from` (files: off the runtime's threads).
                if let Some(a) = &archive {
                    let tx2 = tx.clone();
                    let read = a
                        .off_thread(move |a| a.read(from, to, |b| tx2.blocking_send(Ok(b)).is_ok()))
                        .await;
                    match read {
                        Ok(0) => {}
                        Ok(last) => {
                            if tx.is_closed() || (to > 0 && last >= to) {
                                return;
                            }
                            from = last + 1;
                        }
                        Err(e) => {
                            let _ = tx
                                .send(Err(Status::data_loss(format!("reading the archive: {e}"))))
                                .await;
                            return;
                        }
                    }
                }
                // Then etcd, a page at a time. Batches are handed over synchronously; a
                // bounded channel with blocking_send would stall the runtime.
                let mut paged = false;
                let first_in_etcd = loop {
                    if let Some(c) = caller.as_ref().filter(|_| paged) {
                        limits.pace(c).await;
                    }
                    paged = true;
                    let mut page = Vec::new();
                    let res = log
                        .read_with(from, to, 0, |b| {
                            page.push(b);
                            page.len() < 256
                        })
                        .await;
                    if let Err(e) = res {
                        let _ = tx
                            .send(Err(Status::unavailable(format!("reading the log: {e}"))))
                            .await;
                        return;
                    }
                    if let Some(first) = page.first()
                        && first.first_seq > from
                    {
                        break first.first_seq;
                    }
                    let Some(last) = page.last().and_then(|b| b.events.last()).map(|e| e.seq)
                    else {
                        return;
                    };
                    let n = page.len();
                    for b in page {
                        if tx.send(Ok(b)).await.is_err() {
                            return;
                        }
                    }
                    if n < 256 || (to > 0 && last >= to) {
                        return;
                    }
                    from = last + 1;
                };
                // etcd no longer holds `from`: archived, perhaps since the archive was read.
                let archived = match &archive {
                    Some(a) => a
                        .off_thread(crate::archive::Archive::last_seq)
                        .await
                        .unwrap_or(0),
                    None => 0,
                };
                if archived < from {
                    let why = if archive.is_some() {
                        "and the archive does not hold them"
                    } else {
                        "and this replica has no --archive-dir to read them from"
                    };
                    let _ = tx
                        .send(Err(Status::failed_precondition(format!(
                            "seqs {from}..{} are no longer in etcd (archived) {why}",
                            first_in_etcd - 1
                        ))))
                        .await;
                    return;
                }
            }
        }
        .in_current_span(),
    );
    Ok(Response::new(Box::pin(ReceiverStream::new(out))))
}
