//! The log in etcd: key layout, fenced commits, range reads, snapshots.

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Compare, CompareOp, GetOptions, KvClient, SortOrder, SortTarget, Txn, TxnOp};
use gpuledger_ledger::pb;
use prost::Message;

use super::{Commit, Encoded, Fence, HeadInfo, LedgerLog, LogError, decode_batch, encode};

/// Largest gRPC message accepted from etcd.
const MAX_DECODE: usize = 256 * 1024 * 1024;
/// Keys per page when range-reading the log.
const PAGE: i64 = 256;
/// Seqs one range of a bounded read spans at most. etcd counts every key up to a range's end
/// to answer it, whatever its limit (`treeIndex.Revisions`, under the index's read lock, which
/// writes wait for): a range that ends at the log's end costs the rest of the log, and a whole
/// log read in pages cost the log times its pages. A read with a known last seq walks the log
/// in windows of this many seqs instead.
const WINDOW: u64 = 8_192;

/// Handle on one cluster's log in etcd.
#[derive(Clone)]
pub struct EtcdLog {
    kv: KvClient,
    /// Where commits go: `kv`, or a connection to the etcd raft leader (see
    /// [`EtcdLog::with_writer`]).
    writer: KvClient,
    prefix: String,
    timeout: Duration,
    /// When set, pages read are decoded on a blocking thread holding one of these permits,
    /// not on the async runtime (a long ReadLog is CPU-heavy).
    decoders: Option<Arc<tokio::sync::Semaphore>>,
}

mod snapshots;

fn seq_key(seq: u64) -> String {
    format!("{seq:020}")
}

impl EtcdLog {
    /// The log of cluster `cluster` through `client`.
    pub fn new(client: &etcd_client::Client, cluster: &str, timeout: Duration) -> Self {
        let kv = client
            .kv_client()
            .max_decoding_message_size(MAX_DECODE)
            .max_encoding_message_size(MAX_DECODE);
        EtcdLog {
            writer: kv.clone(),
            kv,
            prefix: format!("/gpuledger/{cluster}/"),
            timeout,
            decoders: None,
        }
    }

    /// The same log, decoding what it reads on blocking threads, at most as many at once as
    /// `decoders` has permits.
    pub fn with_decoders(mut self, decoders: Arc<tokio::sync::Semaphore>) -> Self {
        self.decoders = Some(decoders);
        self
    }

    /// Decode a page of batches (key, value), off the runtime when decoders are set.
    async fn decode_page(
        &self,
        kvs: Vec<etcd_client::KeyValue>,
    ) -> Result<Vec<(pb::EventBatch, etcd_client::KeyValue)>, LogError> {
        let decode = move |kvs: Vec<etcd_client::KeyValue>| {
            kvs.into_iter()
                .map(|kv| decode_batch(kv.key(), kv.value()).map(|b| (b, kv)))
                .collect::<Result<Vec<_>, LogError>>()
        };
        let Some(decoders) = &self.decoders else {
            return decode(kvs);
        };
        let permit = decoders
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| LogError::Stopped("shutting down".into()))?;
        tokio::task::spawn_blocking(move || {
            let _thread = permit;
            decode(kvs)
        })
        .await
        .map_err(|e| LogError::Stopped(e.to_string()))?
    }

    /// The same log, with its commits sent through `client` (a connection to the member that
    /// is etcd's raft leader: a write to a follower member is forwarded to the leader and
    /// answered only after the follower applied it, one more hop inside etcd). Only the route
    /// changes: every commit is still the same fenced transaction, valid at any member.
    pub fn with_writer(&self, client: &etcd_client::Client) -> Self {
        EtcdLog {
            writer: client
                .kv_client()
                .max_decoding_message_size(MAX_DECODE)
                .max_encoding_message_size(MAX_DECODE),
            ..self.clone()
        }
    }

    /// Key prefix of this cluster (`/gpuledger/<cluster>/`).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }
    /// Prefix of the batch keys.
    pub fn log_prefix(&self) -> String {
        format!("{}log/", self.prefix)
    }
    /// Key of the batch starting at `first_seq`.
    pub fn log_key(&self, first_seq: u64) -> String {
        format!("{}log/{}", self.prefix, seq_key(first_seq))
    }

    /// The first seq of the batch stored under `key` (a [`EtcdLog::log_key`]).
    fn seq_of_key(&self, key: &str) -> Option<u64> {
        key.strip_prefix(&format!("{}log/", self.prefix))?
            .parse()
            .ok()
    }
    /// Key of the head record.
    pub fn head_key(&self) -> String {
        format!("{}head", self.prefix)
    }
    /// Name of the leader election.
    pub fn election_name(&self) -> String {
        format!("{}election", self.prefix)
    }

    async fn timed<T>(
        &self,
        f: impl std::future::Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<T, LogError> {
        match tokio::time::timeout(self.timeout, f).await {
            Ok(r) => Ok(r?),
            Err(_) => Err(LogError::Timeout(self.timeout)),
        }
    }

    /// The head's seq at revision `rev` (0: an empty log).
    async fn head_at(&self, kv: &mut KvClient, rev: i64) -> Result<u64, LogError> {
        let key = self.head_key();
        let resp = self
            .timed(kv.get(key.clone(), Some(GetOptions::new().with_revision(rev))))
            .await?;
        match resp.kvs().first() {
            None => Ok(0),
            Some(kv) => {
                pb::Head::decode(kv.value())
                    .map(|h| h.seq)
                    .map_err(|e| LogError::Corrupt {
                        key,
                        why: e.to_string(),
                    })
            }
        }
    }

    /// Read `head` (linearizable).
    pub async fn head(&self) -> Result<HeadInfo, LogError> {
        let key = self.head_key();
        let mut kv = self.kv.clone();
        let resp = self.timed(kv.get(key.clone(), None)).await?;
        let revision = resp.header().map_or(0, |h| h.revision());
        match resp.kvs().first() {
            None => Ok(HeadInfo {
                revision,
                ..HeadInfo::default()
            }),
            Some(kv) => {
                let h = pb::Head::decode(kv.value()).map_err(|e| LogError::Corrupt {
                    key,
                    why: e.to_string(),
                })?;
                Ok(HeadInfo {
                    seq: h.seq,
                    epoch: h.epoch,
                    hash: h.hash,
                    mod_rev: kv.mod_revision(),
                    revision,
                })
            }
        }
    }

    /// Append `batch` in ONE transaction, fenced on the leader key's create_revision (the
    /// epoch) and on `head`'s mod_revision. Either both keys are written or neither.
    pub async fn commit(
        &self,
        leader_key: &[u8],
        epoch: i64,
        head_rev: i64,
        batch: &pb::EventBatch,
    ) -> Result<Commit, LogError> {
        self.commit_encoded(leader_key, epoch, head_rev, encode(batch))
            .await
    }

    /// [`EtcdLog::commit`] of a batch already encoded by [`encode`].
    pub async fn commit_encoded(
        &self,
        leader_key: &[u8],
        epoch: i64,
        head_rev: i64,
        batch: Encoded,
    ) -> Result<Commit, LogError> {
        let Encoded {
            first_seq,
            head,
            bytes,
            hash: _,
        } = batch;
        let txn = Txn::new()
            .when([
                Compare::create_revision(leader_key.to_vec(), CompareOp::Equal, epoch),
                Compare::mod_revision(self.head_key(), CompareOp::Equal, head_rev),
            ])
            .and_then([
                TxnOp::put(self.log_key(first_seq), bytes, None),
                TxnOp::put(self.head_key(), head.encode_to_vec(), None),
            ]);
        let mut kv = self.writer.clone();
        let resp = self.timed(kv.txn(txn)).await?;
        if resp.succeeded() {
            Ok(Commit::Done {
                head_rev: resp.header().map_or(0, |h| h.revision()),
            })
        } else {
            Ok(Commit::Fenced)
        }
    }

    /// Delete the batches that start before `before_seq` (they are archived), in one
    /// transaction fenced on the leader key's create_revision: only the leader trims. False
    /// when the fence failed.
    pub async fn trim_before(
        &self,
        leader_key: &[u8],
        epoch: i64,
        before_seq: u64,
    ) -> Result<bool, LogError> {
        let txn = Txn::new()
            .when([Compare::create_revision(
                leader_key.to_vec(),
                CompareOp::Equal,
                epoch,
            )])
            .and_then([TxnOp::delete(
                self.log_prefix(),
                Some(etcd_client::DeleteOptions::new().with_range(self.log_key(before_seq))),
            )]);
        let mut kv = self.writer.clone();
        Ok(self.timed(kv.txn(txn)).await?.succeeded())
    }

    /// First seq still in etcd's log (None = the log is empty).
    pub async fn first_seq(&self) -> Result<Option<u64>, LogError> {
        let mut kv = self.kv.clone();
        let end = format!("{}log0", self.prefix);
        let resp = self
            .timed(
                kv.get(
                    self.log_prefix(),
                    Some(
                        GetOptions::new()
                            .with_range(end)
                            .with_limit(1)
                            .with_keys_only(),
                    ),
                ),
            )
            .await?;
        Ok(resp.kvs().first().and_then(|k| {
            String::from_utf8_lossy(k.key())
                .rsplit('/')
                .next()
                .and_then(|s| s.parse().ok())
        }))
    }

    /// Batches holding seqs `from..=to` (`to` = 0: to the end), in order, read at one revision.
    /// Returns the batches and the store revision they were read at.
    pub async fn read(&self, from: u64, to: u64) -> Result<(Vec<pb::EventBatch>, i64), LogError> {
        let mut out = Vec::new();
        let rev = self
            .read_with(from, to, 0, |b| {
                out.push(b);
                true
            })
            .await?;
        Ok((out, rev))
    }

    /// Batches holding seqs `from..=to` (`to` = 0: to the end) with their exact stored bytes
    /// (what the archive keeps, so the hash chain runs on through it).
    pub async fn read_stored(
        &self,
        from: u64,
        to: u64,
    ) -> Result<Vec<(pb::EventBatch, Vec<u8>)>, LogError> {
        let mut out = Vec::new();
        self.read_raw(from, to, 0, |b, bytes| {
            out.push((b, bytes.to_vec()));
            true
        })
        .await?;
        Ok(out)
    }

    /// Like [`EtcdLog::read`] but hands each batch to `f` as it arrives (stop by returning
    /// false), stamped with its key and the hash of its bytes (`EventBatch.stored`). `at_rev`
    /// 0 = the newest revision. Returns the revision read at.
    pub async fn read_with(
        &self,
        from: u64,
        to: u64,
        at_rev: i64,
        mut f: impl FnMut(pb::EventBatch) -> bool,
    ) -> Result<i64, LogError> {
        self.read_raw(from, to, at_rev, |b, _| f(b)).await
    }

    async fn read_raw(
        &self,
        from: u64,
        to: u64,
        at_rev: i64,
        mut f: impl FnMut(pb::EventBatch, &[u8]) -> bool,
    ) -> Result<i64, LogError> {
        let mut kv = self.kv.clone();
        let end = format!("{}log0", self.prefix); // '0' sorts right after '/'
        let (mut start, rev) = self.batch_holding(&mut kv, from.max(1), at_rev).await?;
        // Ranges end a window after where they start (see WINDOW), up to the head as of the
        // revision read at when no last seq is asked for.
        let to = match to {
            0 => self.head_at(&mut kv, rev).await?,
            to => to,
        };
        let mut window_from = self.seq_of_key(&start).unwrap_or(from.max(1));
        loop {
            let window_end = (to > 0).then(|| window_from.saturating_add(WINDOW).min(to + 1));
            let range_end = window_end.map_or_else(|| end.clone(), |w| self.log_key(w));
            let resp = self
                .timed(
                    kv.get(
                        start.clone(),
                        Some(
                            GetOptions::new()
                                .with_range(range_end)
                                .with_limit(PAGE)
                                .with_revision(rev),
                        ),
                    ),
                )
                .await?;
            let more = resp.more();
            let mut resp = resp;
            let page = self.decode_page(resp.take_kvs()).await?;
            let next = match (page.last().filter(|_| more), window_end) {
                (Some((_, last)), _) => {
                    let mut next = last.key().to_vec();
                    next.push(0);
                    Some(String::from_utf8_lossy(&next).into_owned())
                }
                // The window is read: the next one, until past the last seq.
                (None, Some(w)) if w <= to => {
                    window_from = w;
                    Some(self.log_key(w))
                }
                (None, _) => None,
            };
            for (b, kvp) in page {
                let last = b.events.last().map_or(b.first_seq, |e| e.seq);
                if last < from {
                    continue;
                }
                if to > 0 && b.first_seq > to {
                    return Ok(rev);
                }
                if !f(b, kvp.value()) {
                    return Ok(rev);
                }
            }
            let Some(next) = next else {
                return Ok(rev);
            };
            start = next;
        }
    }

    /// The key of the batch holding `from` (the last log key at or below `log/<from>`; the key
    /// of `from` itself when there is none) and the revision it was found at.
    ///
    /// etcd answers a range sorted in descending order by reading every key of the range
    /// (the limit applies after sorting), values included, so the range is widened step by
    /// step from `from` downwards: a read that starts on a batch boundary (every page of a
    /// `ReadLog` after the first, every follower catching up) costs one key, and a read from
    /// within a batch a few. Unbounded, a read from seq `s` cost the whole log below `s`, and
    /// a whole-log read in pages cost the log times its pages.
    async fn batch_holding(
        &self,
        kv: &mut KvClient,
        from: u64,
        at_rev: i64,
    ) -> Result<(String, i64), LogError> {
        let below = format!("{}log/{}", self.prefix, seq_key(from + 1));
        let mut rev = at_rev;
        for width in [0u64, 63, 4095, 262_143, u64::MAX] {
            let lowest = if width == u64::MAX {
                self.log_prefix()
            } else {
                self.log_key(from.saturating_sub(width).max(1))
            };
            let probe = self
                .timed(
                    kv.get(
                        lowest,
                        Some(
                            GetOptions::new()
                                .with_range(below.clone())
                                .with_sort(SortTarget::Key, SortOrder::Descend)
                                .with_limit(1)
                                .with_keys_only()
                                .with_revision(rev),
                        ),
                    ),
                )
                .await?;
            if rev == 0 {
                // Every further probe and page reads at the revision of the first.
                rev = probe.header().map_or(0, |h| h.revision());
            }
            if let Some(k) = probe.kvs().first() {
                return Ok((String::from_utf8_lossy(k.key()).into_owned(), rev));
            }
            if from.saturating_sub(width) <= 1 && width != u64::MAX {
                // This window already reached seq 1: nothing lies below it but other keys.
                break;
            }
        }
        Ok((self.log_key(from), rev))
    }

    /// The value of `key` as stored (None: no such key).
    pub async fn get_raw(&self, key: &str) -> Result<Option<Vec<u8>>, LogError> {
        let mut kv = self.kv.clone();
        let resp = self.timed(kv.get(key, None)).await?;
        Ok(resp.kvs().first().map(|k| k.value().to_vec()))
    }
}

impl LedgerLog for EtcdLog {
    async fn head(&self) -> Result<HeadInfo, LogError> {
        EtcdLog::head(self).await
    }

    async fn append(
        &self,
        fence: &Fence,
        head_rev: i64,
        batch: Encoded,
    ) -> Result<Commit, LogError> {
        self.commit_encoded(&fence.key, fence.epoch, head_rev, batch)
            .await
    }

    async fn read_with(
        &self,
        from: u64,
        to: u64,
        f: impl FnMut(pb::EventBatch) -> bool + Send,
    ) -> Result<i64, LogError> {
        EtcdLog::read_with(self, from, to, 0, f).await
    }

    async fn write_snapshot(&self, snap: &pb::Snapshot) -> Result<bool, LogError> {
        EtcdLog::write_snapshot(self, snap).await
    }

    async fn prune_snapshots(&self, keep: usize) -> Result<(), LogError> {
        EtcdLog::prune_snapshots(self, keep).await
    }

    fn location(&self) -> String {
        self.log_prefix()
    }
}
