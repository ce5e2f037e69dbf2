//! `ReadLog`: the whole history, from the archive and then from etcd, as one stream.
//!
//! A scan is bounded ([`crate::log_scans`]): it takes one of the few scan slots, and every page
//! it streams, from the archive or etcd, first waits for its holder's events-per-second
//! budget. Pages are decoded (and hashed) on the heavy-read threads, off the runtime that
//! keeps the leader's lease alive.

use std::sync::Arc;

use gpuledger_ledger::pb;
use gpuledger_proto::allocator::v1 as api;
use tokio::sync::{Semaphore, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use super::{BoxStream, Service, heavy_thread, on_heavy_thread};
use crate::archive::{Archive, Batches, last_seq};
use crate::log::EtcdLog;
use crate::log_scans::Scan;

/// Most batches in one page (etcd's range limit of the log's reads, too).
const PAGE_BATCHES: usize = 256;
/// Most events in one page of the archive: pages are paced by their events.
const PAGE_EVENTS: usize = 4_096;

type Tx = mpsc::Sender<Result<pb::EventBatch, Status>>;

/// What a scan reads from and pays with.
struct Scanner {
    scan: Scan,
    log: EtcdLog,
    archive: Option<Archive>,
    heavy: Arc<Semaphore>,
    to: u64,
    tx: Tx,
}

pub(super) async fn read_log(
    svc: &Service,
    req: Request<api::ReadLogRequest>,
) -> Result<Response<BoxStream<pb::EventBatch>>, Status> {
    let caller = req
        .extensions()
        .get::<gpuledger_auth::server::Authenticated>()
        .map(gpuledger_auth::server::Authenticated::holder);
    let scan = svc.log_scans.start(caller)?;
    let r = req.into_inner();
    let (tx, out) = mpsc::channel(64);
    let s = Scanner {
        scan,
        log: svc.log.clone(),
        archive: svc.archive.clone(),
        heavy: svc.heavy.clone(),
        to: r.to_seq,
        tx,
    };
    tokio::spawn(
        async move {
            if let Err(e) = s.stream(r.from_seq.max(1)).await {
                let _ = s.tx.send(Err(e)).await;
            }
        }
        .in_current_span(),
    );
    Ok(Response::new(Box::pin(ReceiverStream::new(out))))
}

impl Scanner {
    /// Stream seqs `from..`: the archive while it holds them, then etcd; the archive again
    /// when etcd was trimmed meanwhile.
    async fn stream(&self, mut from: u64) -> Result<(), Status> {
        loop {
            if let Some(a) = &self.archive {
                match self.stream_archive(a, from).await? {
                    Some(next) => from = next,
                    None => return Ok(()),
                }
            }
            let Some(first_in_etcd) = self.stream_etcd(from).await? else {
                return Ok(());
            };
            // etcd no longer holds `from`: archived, perhaps since the archive was read.
            let archived = match &self.archive {
                Some(a) => a.off_thread(Archive::last_seq).await.unwrap_or(0),
                None => 0,
            };
            if archived < from {
                let why = if self.archive.is_some() {
                    "and the archive does not hold them"
                } else {
                    "and this replica has no --archive-dir to read them from"
                };
                return Err(Status::failed_precondition(format!(
                    "seqs {from}..{} are no longer in etcd (archived) {why}",
                    first_in_etcd - 1
                )));
            }
        }
    }

    /// Stream what the archive holds from `from` on, a page at a time read on a heavy-read
    /// thread. The seq to go on from, or None when the scan is over.
    async fn stream_archive(&self, a: &Archive, from: u64) -> Result<Option<u64>, Status> {
        let to = self.to;
        let data_loss = |e| Status::data_loss(format!("reading the archive: {e}"));
        let mut batches = Some(
            a.off_thread(move |a| a.batches(from, to))
                .await
                .map_err(data_loss)?,
        );
        let mut next = from;
        while let Some(mut it) = batches.take() {
            let thread = heavy_thread(&self.heavy).await?;
            let (it, page) = on_heavy_thread(thread, move || {
                let page = archive_page(&mut it);
                (it, page)
            })
            .await?;
            let page = page.map_err(data_loss)?;
            let Some(last) = page.last().map(last_seq) else {
                return Ok(Some(next));
            };
            if !self.send(page).await || (to > 0 && last >= to) {
                return Ok(None);
            }
            next = last + 1;
            batches = Some(it);
        }
        Ok(Some(next))
    }

    /// Stream what etcd holds from `from` on, a page at a time. None when the scan is over,
    /// else the first seq etcd holds, past `from` (trimmed since the archive was read).
    async fn stream_etcd(&self, mut from: u64) -> Result<Option<u64>, Status> {
        loop {
            let mut page = Vec::new();
            self.log
                .read_with(from, self.to, 0, |b| {
                    page.push(b);
                    page.len() < PAGE_BATCHES
                })
                .await
                .map_err(|e| Status::unavailable(format!("reading the log: {e}")))?;
            if let Some(first) = page.first()
                && first.first_seq > from
            {
                return Ok(Some(first.first_seq));
            }
            let Some(last) = page.last().map(last_seq) else {
                return Ok(None);
            };
            let full = page.len() == PAGE_BATCHES;
            if !self.send(page).await || !full || (self.to > 0 && last >= self.to) {
                return Ok(None);
            }
            from = last + 1;
        }
    }

    /// Hand `page` to the client once its holder's budget allows; false when the client is
    /// gone, also while the page waits for its turn (the scan's slot is given back at once).
    async fn send(&self, page: Vec<pb::EventBatch>) -> bool {
        let events = page.iter().map(|b| b.events.len()).sum();
        tokio::select! {
            _ = self.scan.pace(events) => {}
            _ = self.tx.closed() => return false,
        }
        for b in page {
            if self.tx.send(Ok(b)).await.is_err() {
                return false;
            }
        }
        true
    }
}

/// The next page of `it`: up to [`PAGE_BATCHES`] batches or [`PAGE_EVENTS`] events (at least
/// one batch, however large); empty at the end.
fn archive_page(it: &mut Batches) -> Result<Vec<pb::EventBatch>, crate::archive::ArchiveError> {
    let (mut page, mut events) = (Vec::new(), 0);
    while page.len() < PAGE_BATCHES && events < PAGE_EVENTS {
        let Some(b) = it.next().transpose()? else {
            break;
        };
        events += b.events.len();
        page.push(b);
    }
    Ok(page)
}
