//! An in-memory [`LedgerLog`] for tests of the leader: the same write protocol as etcd (a
//! store revision, a fenced append that moves `head`), with the faults a test needs on
//! request (a deposed leader, a failing store, a slow one). Not a mock of etcd: what etcd
//! does is tested against a real etcd in `allocator/tests/`.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpuledger_ledger::pb;
use prost::Message;

use super::{Commit, Encoded, Fence, HeadInfo, LedgerLog, LogError};

/// The log, shared by every clone.
#[derive(Clone, Default)]
pub(crate) struct MemLog {
    inner: Arc<Mutex<Inner>>,
}

#[derive(Default)]
struct Inner {
    /// The store revision: +1 per successful write, as etcd's.
    revision: i64,
    batches: BTreeMap<u64, Vec<u8>>,
    head: Option<(pb::Head, i64)>,
    leader: Option<Fence>,
    snapshots: BTreeMap<u64, pb::Snapshot>,
    failing: bool,
    latency: Duration,
    /// When each append was answered, in tokio's time.
    appended_at: Vec<tokio::time::Instant>,
}

impl MemLog {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    fn with<T>(&self, f: impl FnOnce(&mut Inner) -> T) -> T {
        f(&mut self.inner.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Make `key` the leader's; returns its fence (the epoch is the revision that created it).
    pub(crate) fn elect(&self, key: &str) -> Fence {
        self.with(|i| {
            i.revision += 1;
            let f = Fence {
                key: key.as_bytes().to_vec(),
                epoch: i.revision,
            };
            i.leader = Some(f.clone());
            f
        })
    }

    /// The leader key is gone (its lease expired): every append fenced on it fails from now.
    pub(crate) fn depose(&self) {
        self.with(|i| i.leader = None);
    }

    /// Make every call fail as an unreachable store would (or work again).
    pub(crate) fn set_failing(&self, failing: bool) {
        self.with(|i| i.failing = failing);
    }

    /// How long each append takes (tokio time; paused in the tests).
    pub(crate) fn set_latency(&self, latency: Duration) {
        self.with(|i| i.latency = latency);
    }

    /// When each successful append was answered.
    pub(crate) fn appended_at(&self) -> Vec<tokio::time::Instant> {
        self.with(|i| i.appended_at.clone())
    }

    /// Every batch in the log, in order.
    pub(crate) fn batches(&self) -> Vec<pb::EventBatch> {
        self.with(|i| {
            i.batches
                .values()
                .filter_map(|b| pb::EventBatch::decode(b.as_slice()).ok())
                .collect()
        })
    }

    fn check(&self) -> Result<(), LogError> {
        if self.with(|i| i.failing) {
            return Err(LogError::Timeout(Duration::from_secs(2)));
        }
        Ok(())
    }
}

impl LedgerLog for MemLog {
    async fn head(&self) -> Result<HeadInfo, LogError> {
        self.check()?;
        Ok(self.with(|i| {
            let (h, mod_rev) = i.head.clone().unwrap_or_default();
            HeadInfo {
                seq: h.seq,
                epoch: h.epoch,
                hash: h.hash.clone(),
                mod_rev,
                revision: i.revision,
            }
        }))
    }

    async fn append(
        &self,
        fence: &Fence,
        head_rev: i64,
        batch: Encoded,
    ) -> Result<Commit, LogError> {
        let latency = self.with(|i| i.latency);
        tokio::time::sleep(latency).await;
        self.check()?;
        Ok(self.with(|i| {
            let head_now = i.head.as_ref().map_or(0, |(_, r)| *r);
            if i.leader.as_ref() != Some(fence) || head_now != head_rev {
                return Commit::Fenced;
            }
            i.revision += 1;
            i.batches.insert(batch.first_seq, batch.bytes);
            i.head = Some((batch.head, i.revision));
            i.appended_at.push(tokio::time::Instant::now());
            Commit::Done {
                head_rev: i.revision,
            }
        }))
    }

    async fn read_with(
        &self,
        from: u64,
        to: u64,
        mut f: impl FnMut(pb::EventBatch) -> bool + Send,
    ) -> Result<i64, LogError> {
        self.check()?;
        let (batches, rev) = self.with(|i| (i.batches.clone(), i.revision));
        for (key, bytes) in batches {
            let b = super::decode_batch(key.to_string().as_bytes(), &bytes)?;
            let last = b.events.last().map_or(b.first_seq, |e| e.seq);
            if last < from {
                continue;
            }
            if (to > 0 && b.first_seq > to) || !f(b) {
                break;
            }
        }
        Ok(rev)
    }

    async fn write_snapshot(&self, snap: &pb::Snapshot) -> Result<bool, LogError> {
        self.check()?;
        Ok(self.with(|i| {
            if i.snapshots.contains_key(&snap.seq) {
                return false;
            }
            i.snapshots.insert(snap.seq, snap.clone());
            true
        }))
    }

    async fn prune_snapshots(&self, keep: usize) -> Result<(), LogError> {
        self.check()?;
        self.with(|i| {
            while i.snapshots.len() > keep {
                i.snapshots.pop_first();
            }
        });
        Ok(())
    }

    fn location(&self) -> String {
        "memory".into()
    }
}
