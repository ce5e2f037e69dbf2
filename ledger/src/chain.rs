//! The hash chain over the log: every batch carries the SHA-256 of the previous batch's exact
//! stored bytes, so that a changed, removed or inserted batch anywhere in history breaks the
//! next link. Pure: callers hash the bytes they read and feed the links in order.
//!
//! Batches written before the log was chained carry no `prev_hash`. A log may start with such
//! batches (an upgrade); once one chained batch was seen, a batch without a link is a break.

use sha2::{Digest, Sha256};

use crate::pb;

/// A SHA-256 digest.
pub type Hash = [u8; 32];

/// What the batch at seq 1 links to.
pub const GENESIS: Hash = [0; 32];

/// The SHA-256 of a batch's stored bytes (the etcd value, the archive record).
pub fn hash_stored(bytes: &[u8]) -> Hash {
    Sha256::digest(bytes).into()
}

/// The hash a batch was stamped with by whoever read or wrote its stored bytes
/// (`EventBatch.stored`); a batch never stored (built in a test) is hashed as it encodes.
pub fn batch_hash(batch: &pb::EventBatch) -> Hash {
    if let Some(h) = batch
        .stored
        .as_ref()
        .and_then(|s| Hash::try_from(s.hash.as_slice()).ok())
    {
        return h;
    }
    let mut b = batch.clone();
    b.stored = None;
    hash_stored(&prost::Message::encode_to_vec(&b))
}

/// Lowercase hex of (the first 8 bytes of) a hash, for messages.
pub fn short_hex(h: &[u8]) -> String {
    if h.is_empty() {
        return "-".into();
    }
    h.iter().take(8).map(|b| format!("{b:02x}")).collect()
}

/// A batch that does not chain.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChainError {
    /// The batch does not start where the previous one ended: a batch was removed (or one
    /// repeated).
    #[error("gap: the batch at seq {found} follows seq {}, seqs {expected}..{} are missing", expected.saturating_sub(1), found.saturating_sub(1))]
    Gap {
        /// The seq due next.
        expected: u64,
        /// The first seq of the batch met.
        found: u64,
    },
    /// The batch's `prev_hash` is not the hash of the batch before it: that one (or this
    /// one's link) was changed.
    #[error(
        "broken link at seq {seq}: prev_hash {} but the batch before hashes to {}",
        short_hex(got),
        short_hex(expected)
    )]
    Broken {
        /// First seq of the batch whose link fails.
        seq: u64,
        /// The hash of the previous batch as read.
        expected: Vec<u8>,
        /// The link the batch carries.
        got: Vec<u8>,
    },
    /// A batch without a link after the chain began: its link was stripped.
    #[error("the batch at seq {0} has no prev_hash although the log is chained before it")]
    Unlinked(u64),
    /// The batch holds no events or its events do not follow its first seq.
    #[error("the batch at seq {0} is malformed: {1}")]
    Malformed(u64, String),
}

/// The running end of a chain: the seq due next and the hash of the last batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chain {
    next_seq: u64,
    tip: Option<Hash>,
    chained: bool,
    unchained_until: u64,
}

impl Default for Chain {
    fn default() -> Self {
        Chain::new()
    }
}

impl Chain {
    /// A chain at the start of the log (seq 1 is due; it links to [`GENESIS`]).
    pub fn new() -> Self {
        Chain {
            next_seq: 1,
            tip: Some(GENESIS),
            chained: false,
            unchained_until: 0,
        }
    }

    /// A chain resumed after `seq` (a snapshot), whose last batch hashed to `tip` (empty:
    /// unknown, the next link is taken as it is).
    pub fn resume(seq: u64, tip: &[u8]) -> Self {
        let tip = Hash::try_from(tip).ok();
        Chain {
            next_seq: seq + 1,
            tip: if seq == 0 { Some(GENESIS) } else { tip },
            chained: tip.is_some(),
            unchained_until: 0,
        }
    }

    /// The seq due next.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// The hash of the last batch linked (None: resumed without one).
    pub fn tip(&self) -> Option<Hash> {
        self.tip
    }

    /// The last seq of the unchained batches the log started with (0: none).
    pub fn unchained_until(&self) -> u64 {
        self.unchained_until
    }

    /// Check that `batch`, whose stored bytes hash to `hash`, follows the chain, and advance.
    /// On an error the chain is unchanged.
    pub fn link(&mut self, batch: &pb::EventBatch, hash: Hash) -> Result<(), ChainError> {
        let seq = batch.first_seq;
        if seq != self.next_seq {
            return Err(ChainError::Gap {
                expected: self.next_seq,
                found: seq,
            });
        }
        let last = check_seqs(batch)?;
        if batch.prev_hash.is_empty() {
            if self.chained {
                return Err(ChainError::Unlinked(seq));
            }
            self.unchained_until = last;
        } else if let Some(tip) = self.tip
            && batch.prev_hash != tip
        {
            return Err(ChainError::Broken {
                seq,
                expected: tip.to_vec(),
                got: batch.prev_hash.clone(),
            });
        } else {
            self.chained = true;
        }
        self.tip = Some(hash);
        self.next_seq = last + 1;
        Ok(())
    }

    /// Check that `head_hash` (what `head` records) is the hash of the last batch linked.
    pub fn check_head(&self, head_hash: &[u8]) -> Result<(), ChainError> {
        match self.tip {
            Some(tip) if !head_hash.is_empty() && head_hash != tip => Err(ChainError::Broken {
                seq: self.next_seq,
                expected: tip.to_vec(),
                got: head_hash.to_vec(),
            }),
            _ => Ok(()),
        }
    }
}

/// The batch's last seq, checking its events run on from its first seq.
fn check_seqs(batch: &pb::EventBatch) -> Result<u64, ChainError> {
    let seq = batch.first_seq;
    if batch.events.is_empty() {
        return Err(ChainError::Malformed(seq, "no events".into()));
    }
    for (i, e) in batch.events.iter().enumerate() {
        if e.seq != seq + i as u64 {
            return Err(ChainError::Malformed(
                seq,
                format!("event {i} has seq {}", e.seq),
            ));
        }
    }
    Ok(seq + batch.events.len() as u64 - 1)
}

#[cfg(test)]
mod tests;
