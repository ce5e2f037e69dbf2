//! Moving old ledger batches from etcd to the audit archive ([`gpuledger_archive`]):
//! etcd's size stays bounded under constant churn, while `audit`, `replay`, `usage` and
//! `verify` still read the whole history (archive + etcd as one, through `ReadLog`). Batches
//! leave etcd only after the segment holding them is durable, in a transaction fenced on the
//! leader's epoch, and never past the newest snapshot, from which replicas start.

use std::sync::Arc;
use std::time::Duration;

pub use gpuledger_archive::{Archive, ArchiveError, Batches, Segment, last_seq};
use gpuledger_ledger::pb;
use tracing::{info, warn};

use crate::log::{EtcdLog, LogError};
use crate::shared::Shared;

/// How the leader trims the log.
#[derive(Debug, Clone, Copy)]
pub struct TrimPolicy {
    /// Events kept in etcd behind the head, for followers that lag.
    pub retain_events: u64,
    /// How often to look.
    pub interval: Duration,
}

/// Why one trim step did nothing or failed.
#[derive(Debug, thiserror::Error)]
pub enum TrimError {
    /// The archive failed.
    #[error(transparent)]
    Archive(#[from] ArchiveError),
    /// etcd failed.
    #[error(transparent)]
    Log(#[from] LogError),
    /// The fence failed: this replica no longer leads.
    #[error("not the leader any more")]
    Fenced,
}

/// One step: archive whole batches up to the newest snapshot (never past `head − retain`),
/// then delete them from etcd. Returns the seq up to which etcd's log is now trimmed.
pub async fn trim_once(
    archive: &Archive,
    log: &EtcdLog,
    leader_key: &[u8],
    epoch: i64,
    head: u64,
    policy: TrimPolicy,
) -> Result<u64, TrimError> {
    let Some(&snap) = log.snapshot_seqs().await?.last() else {
        return Ok(0);
    };
    let cut = snap.min(head.saturating_sub(policy.retain_events));
    let mut archived = archive.off_thread(Archive::last_seq).await?;
    if cut > archived {
        let batches = log.read_stored(archived + 1, cut).await?;
        // Only whole batches: the one holding `cut` may run past it.
        let whole: Vec<(pb::EventBatch, Vec<u8>)> = batches
            .into_iter()
            .filter(|(b, _)| last_seq(b) <= cut)
            .collect();
        archived = archive.off_thread(move |a| a.append(&whole)).await?;
    }
    if archived == 0 {
        return Ok(0);
    }
    if !log.trim_before(leader_key, epoch, archived + 1).await? {
        return Err(TrimError::Fenced);
    }
    Ok(archived)
}

/// While leading: every `policy.interval`, move what etcd no longer needs to the archive.
/// Aborted when leadership ends; a failed step is retried at the next interval.
pub async fn trim_loop(
    archive: Archive,
    log: EtcdLog,
    leader_key: Vec<u8>,
    epoch: i64,
    shared: Arc<Shared>,
    policy: TrimPolicy,
) {
    let mut trimmed = 0;
    loop {
        tokio::time::sleep(policy.interval).await;
        let head = shared.seq();
        match trim_once(&archive, &log, &leader_key, epoch, head, policy).await {
            Ok(upto) if upto > trimmed => {
                info!(upto, dir = %archive.dir().display(), "archived the log; etcd keeps the seqs after it");
                trimmed = upto;
            }
            Ok(_) => {}
            Err(TrimError::Fenced) => return,
            Err(e) => warn!(error = %e, "archiving the log failed; etcd keeps it for now"),
        }
    }
}
