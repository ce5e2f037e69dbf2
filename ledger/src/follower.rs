//! The one follower of the log: a committed batch folds into a copy of the ledger only after it
//! links onto the hash chain. Every copy that follows the log (an allocator replica's state,
//! the extender's replica) folds through a [`Follower`]; the shell around it feeds the batches
//! and decides what an error costs it. Pure: no IO, no clock.

use prost::Message;

use crate::chain::{Chain, ChainError, Hash, batch_hash, hash_stored, short_hex};
use crate::{ApplyError, Ledger, pb};

/// A copy of the ledger and the hash chain's end at its seq, moving together.
#[derive(Debug, Clone, Default)]
pub struct Follower {
    ledger: Ledger,
    chain: Chain,
}

/// What a batch did to a follower.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Followed {
    /// Linked and folded: the follower is at the batch's last seq.
    Folded {
        /// The hash of the batch's stored bytes (the next batch links to it).
        hash: Hash,
    },
    /// Already folded (a repeat, or a batch without events): nothing changed.
    Repeat,
}

/// Why a batch or a snapshot did not fold. [`FollowError::is_retryable`] says whether starting
/// again from a fresh snapshot can mend it; [`FollowError::breaks_chain`] whether the log's
/// tamper evidence refused it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FollowError {
    /// The snapshot to start from does not load (retryable: ask for a fresh one).
    #[error("the snapshot does not load: {0}")]
    Snapshot(String),
    /// The batch begins inside what the follower folded already: the follower and its source
    /// disagree on where batches start (retryable: start again from a snapshot).
    #[error("the batch at seq {first}..{last} straddles the replica's seq {seq}")]
    Straddles {
        /// The batch's first seq.
        first: u64,
        /// The batch's last seq.
        last: u64,
        /// The follower's seq.
        seq: u64,
    },
    /// The batch's bytes do not hash to the hash it was stamped with when it was read: it was
    /// changed on its way (not retryable: the same source hands on the same batch).
    #[error(
        "the batch at seq {seq} ({at}) hashes to {} but was stamped {}: changed after it was read",
        short_hex(hash),
        short_hex(stamped)
    )]
    Altered {
        /// The batch's first seq.
        seq: u64,
        /// Where the batch was stored, as its stamp says.
        at: String,
        /// The hash of the batch's bytes.
        hash: Hash,
        /// The hash it was stamped with.
        stamped: Vec<u8>,
    },
    /// The batch does not link onto the chain: a batch before it was removed, changed or
    /// inserted (not retryable: the log itself is broken there).
    #[error("{source} ({at})")]
    Unchained {
        /// The batch's first seq.
        seq: u64,
        /// Where the batch was stored, as its stamp says.
        at: String,
        /// Which link failed.
        source: ChainError,
    },
    /// An event of a linked batch breaks an invariant; the state holds the events before it
    /// (not retryable: the log itself is broken there).
    #[error("event {seq} does not fold: {source}")]
    Invariant {
        /// The event's seq.
        seq: u64,
        /// The invariant it breaks.
        source: ApplyError,
    },
}

impl FollowError {
    /// Whether following again from a fresh snapshot can succeed: the follower's copy was out
    /// of step with its source, not the log broken.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            FollowError::Snapshot(_) | FollowError::Straddles { .. }
        )
    }

    /// Whether the hash chain refused the batch (the log, or the batch on its way, was
    /// tampered with).
    pub fn breaks_chain(&self) -> bool {
        matches!(
            self,
            FollowError::Altered { .. } | FollowError::Unchained { .. }
        )
    }
}

impl Follower {
    /// A follower at the start of the log.
    pub fn new() -> Self {
        Follower::default()
    }

    /// A follower of `ledger` (loaded from a snapshot) whose last batch hashed to `chain_hash`
    /// (empty: unknown, the next link is taken as it is).
    pub fn resume(ledger: Ledger, chain_hash: &[u8]) -> Self {
        let chain = Chain::resume(ledger.seq(), chain_hash);
        Follower { ledger, chain }
    }

    /// A follower starting from `snap`.
    pub fn from_snapshot(snap: &pb::Snapshot) -> Result<Self, FollowError> {
        let ledger = Ledger::from_snapshot(snap).map_err(FollowError::Snapshot)?;
        Ok(Follower::resume(ledger, &snap.chain_hash))
    }

    /// The folded state.
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// The hash chain's end.
    pub fn chain(&self) -> &Chain {
        &self.chain
    }

    /// Seq of the last event folded.
    pub fn seq(&self) -> u64 {
        self.ledger.seq()
    }

    /// Fold `batch`, read from the log by this replica itself: the hash it was stamped with
    /// when its bytes were read is its link (a batch never stored is hashed as it encodes).
    pub fn follow_read(&mut self, batch: &pb::EventBatch) -> Result<Followed, FollowError> {
        if !self.is_fresh(batch)? {
            return Ok(Followed::Repeat);
        }
        self.fold(batch, batch_hash(batch))
    }

    /// Fold `batch`, handed on by another replica: its link is the hash of its own bytes, and
    /// a stamp that says otherwise refuses it, so a replica that changed a batch after reading
    /// it cannot pass it off with the stored hash. `batch` is left as it came.
    pub fn follow_received(&mut self, batch: &mut pb::EventBatch) -> Result<Followed, FollowError> {
        if !self.is_fresh(batch)? {
            return Ok(Followed::Repeat);
        }
        let stamped = batch.stored.take();
        let hash = hash_stored(&batch.encode_to_vec());
        batch.stored = stamped;
        if let Some(s) = &batch.stored
            && !s.hash.is_empty()
            && s.hash != hash
        {
            return Err(FollowError::Altered {
                seq: batch.first_seq,
                at: s.location.clone(),
                hash,
                stamped: s.hash.clone(),
            });
        }
        self.fold(batch, hash)
    }

    /// Whether `batch` has events past the follower's seq; an error when it also has some at or
    /// below it.
    fn is_fresh(&self, batch: &pb::EventBatch) -> Result<bool, FollowError> {
        let seq = self.ledger.seq();
        let last = batch.events.last().map_or(0, |e| e.seq);
        if last <= seq {
            return Ok(false);
        }
        if batch.first_seq <= seq {
            return Err(FollowError::Straddles {
                first: batch.first_seq,
                last,
                seq,
            });
        }
        Ok(true)
    }

    /// Link `batch` (whose stored bytes hash to `hash`) and fold its events, which check what
    /// a follower checks: seq gapless, epoch never lower, every invariant.
    fn fold(&mut self, batch: &pb::EventBatch, hash: Hash) -> Result<Followed, FollowError> {
        self.chain
            .link(batch, hash)
            .map_err(|source| FollowError::Unchained {
                seq: batch.first_seq,
                at: batch
                    .stored
                    .as_ref()
                    .map_or_else(String::new, |s| s.location.clone()),
                source,
            })?;
        for ev in &batch.events {
            self.ledger
                .apply(ev)
                .map_err(|source| FollowError::Invariant {
                    seq: ev.seq,
                    source,
                })?;
        }
        Ok(Followed::Folded { hash })
    }
}

#[cfg(test)]
mod tests;
