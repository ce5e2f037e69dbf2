//! The ledger's event log: what leading and catching up need of it ([`LedgerLog`], the narrow
//! edge to etcd), its errors, and the batch codec. [`EtcdLog`] is the log in etcd; tests of
//! the leader also have an in-memory one (`memory::MemLog`).
//!
//! Layout in etcd under `/gpuledger/<cluster>/`:
//! `log/<first_seq:020>` one `EventBatch` per commit, `head` = `Head{seq, epoch}`,
//! `snapmeta/<seq:020>` + `snapdata/<seq:020>/<part:04>` snapshots split into ≤ 1 MiB parts,
//! `election` the leader election.

mod etcd;
#[cfg(test)]
pub(crate) mod memory;

use std::future::Future;
use std::time::Duration;

use gpuledger_archive::ArchiveError;
use gpuledger_ledger::chain::{Hash, hash_stored};
use gpuledger_ledger::pb;
use prost::Message;

pub use self::etcd::EtcdLog;

/// Largest value written in one etcd key (etcd's default request limit is 1.5 MiB).
pub const MAX_VALUE_BYTES: usize = 1024 * 1024;

/// Errors talking to the log.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    /// etcd could not be reached or answered with an error; retrying later may work.
    #[error("etcd: {0}")]
    Etcd(#[from] etcd_client::Error),
    /// An etcd call took longer than allowed; retrying may work.
    #[error("etcd did not answer within {0:?}")]
    Timeout(Duration),
    /// etcd's log starts after the seq this replica needs next: the batches between were
    /// archived while it lagged. Recovered by loading the newest snapshot again.
    #[error(
        "etcd's log starts at seq {first} but this replica needs seq {needed}: the seqs between were archived"
    )]
    Archived {
        /// The seq needed next.
        needed: u64,
        /// The first seq etcd still holds.
        first: u64,
    },
    /// The archive could not be read (see [`ArchiveError`]).
    #[error(transparent)]
    Archive(#[from] ArchiveError),
    /// The thread decoding what was read went away (the process is stopping); retrying may
    /// work.
    #[error("decoding the log: {0}")]
    Stopped(String),
    /// A stored value does not decode: the log is corrupt. Not retryable.
    #[error("corrupt value at {key}: {why}")]
    Corrupt {
        /// The key holding the bad value.
        key: String,
        /// What is wrong with it.
        why: String,
    },
}

/// What etcd answers a write with while its NOSPACE alarm is raised.
const ETCD_NO_SPACE: &str = "database space exceeded";

impl LogError {
    /// etcd refused the request because its space quota is used up (its NOSPACE alarm): the
    /// request certainly did not apply, and no write will until an operator frees space and
    /// disarms the alarm.
    pub fn is_no_space(&self) -> bool {
        matches!(self, LogError::Etcd(e) if e.to_string().contains(ETCD_NO_SPACE))
    }
}

/// Result of a fenced commit.
#[derive(Debug)]
pub enum Commit {
    /// Written; the head key's new mod_revision.
    Done {
        /// New mod_revision of `head`.
        head_rev: i64,
    },
    /// The fence failed: this process is no longer the leader (or `head` moved under it).
    Fenced,
}

/// The `head` key as read.
#[derive(Debug, Clone, Default)]
pub struct HeadInfo {
    /// Last committed seq (0 = empty log).
    pub seq: u64,
    /// Epoch that wrote it.
    pub epoch: u64,
    /// SHA-256 of the last batch's stored bytes (empty before the log was chained).
    pub hash: Vec<u8>,
    /// mod_revision of the head key (0 = no head yet).
    pub mod_rev: i64,
    /// The store revision the read was made at.
    pub revision: i64,
}

/// What makes a write the leader's: its election key and that key's create_revision (the
/// epoch). A write succeeds only while the key still exists with that revision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fence {
    /// The election key this leader holds.
    pub key: Vec<u8>,
    /// Its create_revision: the leader's epoch.
    pub epoch: i64,
}

impl From<&etcd_client::LeaderKey> for Fence {
    fn from(k: &etcd_client::LeaderKey) -> Self {
        Fence {
            key: k.key().to_vec(),
            epoch: k.rev(),
        }
    }
}

/// The narrow edge between the allocator and the store of its log: what leading and catching
/// up need. Every implementation keeps the write protocol (`docs/ledger.md`): one fenced
/// transaction per batch, `head` moving with it.
pub trait LedgerLog: Clone + Send + Sync + 'static {
    /// Read `head` (linearizable).
    fn head(&self) -> impl Future<Output = Result<HeadInfo, LogError>> + Send;

    /// Append `batch` and move `head` in one transaction that succeeds only while `fence`
    /// holds and `head` is still at `head_rev` ([`Commit::Fenced`] otherwise).
    fn append(
        &self,
        fence: &Fence,
        head_rev: i64,
        batch: Encoded,
    ) -> impl Future<Output = Result<Commit, LogError>> + Send;

    /// Hand the batches holding seqs `from..=to` (`to` 0: to the end) to `f` in order, until
    /// it returns false. Returns the store revision they were read at.
    fn read_with(
        &self,
        from: u64,
        to: u64,
        f: impl FnMut(pb::EventBatch) -> bool + Send,
    ) -> impl Future<Output = Result<i64, LogError>> + Send;

    /// Store a snapshot of the folded state, unless one exists at its seq (then false).
    fn write_snapshot(
        &self,
        snap: &pb::Snapshot,
    ) -> impl Future<Output = Result<bool, LogError>> + Send;

    /// Delete all but the newest `keep` snapshots.
    fn prune_snapshots(&self, keep: usize) -> impl Future<Output = Result<(), LogError>> + Send;

    /// Where the log lives, for messages (etcd: its `log/` key prefix).
    fn location(&self) -> String;
}

/// A batch ready to append: its first seq, the head it moves to, and its bytes.
#[derive(Debug, Clone)]
pub struct Encoded {
    /// Seq of the batch's first event (its key in the log).
    pub first_seq: u64,
    /// What `head` says once the batch is in (with the batch's hash).
    pub head: pb::Head,
    /// The encoded `EventBatch`.
    pub bytes: Vec<u8>,
    /// SHA-256 of `bytes`: the next batch's `prev_hash`.
    pub hash: Hash,
}

/// Encode a batch for [`LedgerLog::append`] (its `stored` is never written). Its
/// `prev_hash` must already link it to the batch before.
pub fn encode(batch: &pb::EventBatch) -> Encoded {
    let last = batch
        .events
        .last()
        .map_or(batch.first_seq.saturating_sub(1), |e| e.seq);
    let bytes = if batch.stored.is_some() {
        pb::EventBatch {
            stored: None,
            ..batch.clone()
        }
        .encode_to_vec()
    } else {
        batch.encode_to_vec()
    };
    let hash = hash_stored(&bytes);
    Encoded {
        first_seq: batch.first_seq,
        head: pb::Head {
            seq: last,
            epoch: batch.epoch,
            hash: hash.to_vec(),
        },
        bytes,
        hash,
    }
}

/// Mark `batch` as stored at `location` with bytes hashing to `hash` (what the chain checks).
pub fn stamp(batch: &mut pb::EventBatch, hash: Hash, location: String) {
    batch.stored = Some(pb::StoredAt {
        hash: hash.to_vec(),
        location,
    });
}

/// Decode a batch from a watch or range value, stamped with the hash of those bytes.
pub fn decode_batch(key: &[u8], value: &[u8]) -> Result<pb::EventBatch, LogError> {
    let key = String::from_utf8_lossy(key);
    let mut b = pb::EventBatch::decode(value).map_err(|e| LogError::Corrupt {
        key: key.clone().into_owned(),
        why: e.to_string(),
    })?;
    stamp(&mut b, hash_stored(value), format!("etcd {key}"));
    Ok(b)
}
