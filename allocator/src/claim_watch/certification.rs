//! One claim's certification as a state machine, pure: the shell ([`super`]) takes a view of
//! the ledger, reads the claim, carries out each [`Step`] and tells the machine what happened,
//! as the node agent's device plugin drives its Allocate. No IO, no clock.
//!
//! A certification is, in order: read the claim (from the watch's cache first, from the API
//! server once anything depends on it being current); if the API server has none of that UID,
//! release the grants of the deleted claim; otherwise plan it ([`plan::plan_claim`]) and have the
//! shell carry the plan out and write the conditions, reading the claim afresh when the write
//! meets a newer version, at most [`ATTEMPTS`] times.
//!
//! The ledger is read before the claim, so that a grant it shows belongs to a claim read after
//! it: a release never races a grant made meanwhile.

use gpuledger_ledger::Ledger;

use super::plan::{self, Claim, Plan, Release};

/// Reads of a claim whose status write met a newer version, before leaving it to the next event.
pub const ATTEMPTS: usize = 5;

/// What the shell read for the claim, after taking a view of the ledger.
#[derive(Debug)]
pub enum Read {
    /// The claim as read (or why it is not understood).
    Claim(Result<Box<Claim>, String>),
    /// The API server has no claim of that name.
    Gone,
    /// The API server could not be read.
    Failed(String),
}

/// What the shell's write of the conditions did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Written {
    /// No condition was decided: nothing written.
    Nothing,
    /// The conditions are written.
    Done,
    /// The claim changed or was deleted since it was read.
    Conflict,
    /// The write failed otherwise.
    Failed(String),
}

/// What the shell does next.
#[derive(Debug)]
pub enum Step {
    /// Take a view of the ledger, then read the claim: from the API server when `fresh`, else
    /// from the watch's cache (the API server when the cache lacks it); tell
    /// [`Certification::read`].
    Read {
        /// Whether the read must come from the API server.
        fresh: bool,
    },
    /// The claim is gone: release these grants (none of them held by a claim any more). Done.
    Release(Vec<Release>),
    /// Carry out the plan for the claim: its releases, its consumers, each result's step, then
    /// the write of the conditions decided; tell [`Certification::written`].
    Carry(Box<Claim>, Plan),
    /// Done.
    Done(Outcome),
}

/// How a certification ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Nothing was needed, or everything needed is written.
    Settled,
    /// The claim is not understood: skipped (why).
    Unreadable(String),
    /// The API server could not be read: left to the next change or pass (why).
    ReadFailed(String),
    /// The conditions could not be written: left to the next change or pass (why).
    WriteFailed(String),
    /// The claim changed at every one of [`ATTEMPTS`] reads: left to the next change or pass.
    KeptChanging,
}

/// The certification of the claim of one UID.
#[derive(Debug)]
pub struct Certification {
    uid: String,
    what: String,
    /// Whether the claim is read from the API server (not from the cache).
    fresh: bool,
    attempts: usize,
}

impl Certification {
    /// The certification of claim `uid` (`what` names it in release reasons and logs), and its
    /// first step.
    pub fn start(uid: &str, what: String) -> (Self, Step) {
        let m = Certification {
            uid: uid.to_owned(),
            what,
            fresh: false,
            attempts: 0,
        };
        (m, Step::Read { fresh: false })
    }

    /// The claim read (`from_api`: from the API server, not the cache), against the view `l`
    /// taken before the read.
    pub fn read(&mut self, got: Read, from_api: bool, l: &Ledger) -> Step {
        self.fresh |= from_api;
        let claim = match got {
            Read::Gone => return self.deleted(l),
            Read::Failed(e) => return Step::Done(Outcome::ReadFailed(e)),
            Read::Claim(Err(e)) => return Step::Done(Outcome::Unreadable(e)),
            Read::Claim(Ok(c)) => c,
        };
        if claim.claim.uid != self.uid {
            // Another claim of that name: this one was deleted, once the API server says so.
            return if self.fresh {
                self.deleted(l)
            } else {
                self.again()
            };
        }
        let p = plan::plan_claim(l, &claim);
        if p.is_empty() {
            return Step::Done(Outcome::Settled);
        }
        if (!p.releases.is_empty() || p.consumers.is_some()) && !self.fresh {
            // Releases and consumers only from the claim as the API server has it now, not a
            // cached one.
            return self.again();
        }
        Step::Carry(claim, p)
    }

    /// What the write of the conditions did.
    pub fn written(&mut self, w: Written) -> Step {
        match w {
            Written::Nothing | Written::Done => Step::Done(Outcome::Settled),
            Written::Conflict => self.again(),
            Written::Failed(e) => Step::Done(Outcome::WriteFailed(e)),
        }
    }

    fn deleted(&self, l: &Ledger) -> Step {
        Step::Release(plan::releases_of_deleted(l, &self.uid, &self.what))
    }

    /// Read the claim afresh, unless every attempt is spent.
    fn again(&mut self) -> Step {
        self.attempts += 1;
        if self.attempts >= ATTEMPTS {
            Step::Done(Outcome::KeptChanging)
        } else {
            Step::Read { fresh: true }
        }
    }
}

#[cfg(test)]
mod tests;
