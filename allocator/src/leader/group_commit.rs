//! The group-commit policy, as a state machine with no IO and no clock: the leader's shell
//! feeds it what happened (a request decided, the transaction in flight committed, was fenced
//! or failed, the lease is gone, time passed) with the time it happened, and carries out
//! what it asks for (write this batch, answer these waiters, fail those, wake me at `t`,
//! step down).
//!
//! The rules: one transaction in flight; the next batch fills while it flies and goes as
//! soon as etcd is free, unless all it holds are bind confirmations (nobody waits on those:
//! they linger up to `confirm_linger` for company) or the sequencer is loaded (the last
//! transaction answered [`LOAD_WAITERS`] or more requests: the batch may wait `load_linger`
//! after that commit). A full batch never waits. A waiter is answered only once its batch —
//! and so every batch before it — committed. A failed fence, an unknown outcome, a lost lease
//! or a bug ends leadership at once: nothing more is written, every waiter is told to retry,
//! and a batch still in flight is given a moment to say whether it committed.

use std::collections::VecDeque;
use std::time::Duration;

use gpuledger_ledger::{Reply, pb};
use prost::Message;
use tokio::time::Instant;

use crate::log::{LogError, MAX_VALUE_BYTES};

/// Limits of one batch.
#[derive(Debug, Clone, Copy)]
pub struct BatchLimits {
    /// Most events in one batch (etcd's --max-txn-ops by default, 128).
    pub max_events: usize,
    /// Most encoded bytes in one batch.
    pub max_bytes: usize,
    /// How long a batch of nothing but bind confirmations may wait for other writes to share
    /// its etcd transaction (nobody waits on a confirmation; every transaction costs etcd CPU
    /// on each member).
    pub confirm_linger: Duration,
    /// Under load (the last transaction answered at least [`LOAD_WAITERS`] requests), how
    /// long after a commit the next batch may wait for more requests to share its
    /// transaction. etcd's CPU per transaction hardly depends on its size, so on a busy
    /// machine fuller batches leave more CPU to everything else; a lone client never waits.
    pub load_linger: Duration,
}

/// Default limits: 128 events (etcd's default --max-txn-ops) and 1 MiB.
impl Default for BatchLimits {
    fn default() -> Self {
        BatchLimits {
            max_events: 128,
            max_bytes: MAX_VALUE_BYTES,
            confirm_linger: Duration::from_millis(5),
            load_linger: Duration::ZERO,
        }
    }
}

/// Waiters in the last committed batch from which the sequencer counts as loaded.
pub const LOAD_WAITERS: usize = 8;

impl BatchLimits {
    /// Until when the next batch may wait for company, given when the last transaction
    /// committed and how many requests it answered (None: no wait).
    fn hold_until(&self, (committed, waiters): (Instant, usize)) -> Option<Instant> {
        (!self.load_linger.is_zero() && waiters >= LOAD_WAITERS)
            .then_some(committed + self.load_linger)
    }
}

/// Why leadership ended.
#[derive(Debug)]
pub enum StepDown {
    /// The fence failed: another leader exists.
    Fenced,
    /// The lease expired or may have.
    LeaseLost,
    /// etcd failed; the outcome of the in-flight batch is unknown.
    Etcd(LogError),
    /// The process is shutting down.
    Shutdown,
    /// A decided event broke an invariant (a bug): the state is reloaded.
    Bug(String),
}

/// A command the leader decided: its events (none when answered from the state) and the
/// reply its waiter gets once they are durable.
#[derive(Debug)]
pub struct Decided<W> {
    /// Who waits for the answer.
    pub waiter: W,
    /// The events to write.
    pub events: Vec<pb::Event>,
    /// The answer.
    pub reply: Reply,
    /// The seq the answer is at (its last event's, or the state's).
    pub seq: u64,
    /// Nobody waits on it (a bind confirmation): it may linger for company.
    pub may_wait: bool,
}

/// An answer to send, once what it depends on committed.
#[derive(Debug)]
pub struct Ack<W> {
    /// Who gets it.
    pub waiter: W,
    /// The command's reply.
    pub reply: Reply,
    /// Seq of the command's last event (or of the state it was answered from).
    pub seq: u64,
}

/// What the shell is asked to do.
#[derive(Debug)]
pub enum Action<W> {
    /// Write this batch: one fenced transaction, the only one in flight. Report its outcome
    /// with [`GroupCommit::committed`], [`GroupCommit::fenced`] or [`GroupCommit::failed`].
    Launch {
        /// The batch.
        batch: pb::EventBatch,
        /// When its first command was decided (how long it waited for the transaction).
        opened: Option<Instant>,
    },
    /// Answer these waiters: what they wait for is durable.
    Ack(Vec<Ack<W>>),
    /// Tell these waiters their write did not happen, or that its outcome is unknown.
    Fail(Vec<W>, &'static str),
    /// Call [`GroupCommit::tick`] at this instant (a linger or a hold ends then).
    WakeAt(Instant),
    /// Leadership is over: nothing is in flight and every waiter has its answer.
    StepDown(StepDown),
}

const LOST: &str = "leadership lost; retry";
const FENCED: &str = "leadership lost before the write committed; retry";
const UNKNOWN: &str =
    "the ledger write's outcome is unknown (etcd error); retry, requests are idempotent";
const LEASE_EXPIRED: &str = "this replica's lease expired; retry";
const STOPPED_IN_FLIGHT: &str = "leadership lost; outcome unknown, retry (requests are idempotent)";

/// The batch filling while another flies.
struct Pending<W> {
    events: Vec<pb::Event>,
    bytes: usize,
    waiters: Vec<Ack<W>>,
    /// When the first command of this batch was decided.
    opened: Option<Instant>,
    /// Someone waits for an event of this batch: write it as soon as etcd is free.
    urgent: bool,
    /// When the first event that may wait (a bind confirmation) joined.
    lingering: Option<Instant>,
}

impl<W> Pending<W> {
    fn new() -> Self {
        Pending {
            events: Vec::new(),
            bytes: 0,
            waiters: Vec::new(),
            opened: None,
            urgent: false,
            lingering: None,
        }
    }

    /// Whether to hand the batch to etcd now (when no transaction is in flight).
    fn due(&self, limits: &BatchLimits, now: Instant) -> bool {
        !self.waiters.is_empty()
            && (self.urgent
                || self.events.is_empty()
                || self.full(limits)
                || self
                    .lingering
                    .is_none_or(|t| now >= t + limits.confirm_linger))
    }

    fn full(&self, limits: &BatchLimits) -> bool {
        self.events.len() >= limits.max_events || self.bytes >= limits.max_bytes
    }
}

/// Where a leadership is.
#[derive(Debug)]
enum Phase {
    Leading,
    /// Ending for this reason, waiting for the batch in flight to say how it ended.
    Stopping(StepDown),
    /// Over: [`Action::StepDown`] was given.
    Over,
}

/// The group-commit policy of one leadership (one epoch).
pub struct GroupCommit<W> {
    limits: BatchLimits,
    epoch: u64,
    pending: Pending<W>,
    /// The waiters of the batch in flight, if one is.
    in_flight: Option<Vec<Ack<W>>>,
    /// When the last transaction committed and how many requests it answered.
    last_commit: (Instant, usize),
    phase: Phase,
    actions: VecDeque<Action<W>>,
}

impl<W> GroupCommit<W> {
    /// The policy of a leadership of `epoch` that starts at `now` with nothing in flight.
    pub fn new(limits: BatchLimits, epoch: u64, now: Instant) -> Self {
        GroupCommit {
            limits,
            epoch,
            pending: Pending::new(),
            in_flight: None,
            last_commit: (now, 0),
            phase: Phase::Leading,
            actions: VecDeque::new(),
        }
    }

    /// The next thing to do, in order.
    pub fn next_action(&mut self) -> Option<Action<W>> {
        self.actions.pop_front()
    }

    /// Whether another request may be decided into the pending batch now.
    pub fn accepting(&self) -> bool {
        matches!(self.phase, Phase::Leading) && !self.pending.full(&self.limits)
    }

    /// Nothing in flight and nobody waiting: a moment for background work (snapshots).
    pub fn idle(&self) -> bool {
        self.in_flight.is_none() && self.pending.waiters.is_empty()
    }

    /// How many requests the transaction in flight answers.
    pub fn in_flight_waiters(&self) -> usize {
        self.in_flight.as_ref().map_or(0, Vec::len)
    }

    /// Whether leadership is ending (the shell stops taking requests).
    pub fn stopping(&self) -> bool {
        !matches!(self.phase, Phase::Leading)
    }

    /// A request was decided at `now`: its events join the pending batch.
    pub fn decided(&mut self, now: Instant, d: Decided<W>) {
        let p = &mut self.pending;
        p.opened.get_or_insert(now);
        if d.events.is_empty() {
            // Answered from the state: nothing to wait for but the batches before it.
        } else if d.may_wait {
            p.lingering.get_or_insert(now);
        } else {
            p.urgent = true;
        }
        p.bytes += d.events.iter().map(|e| e.encoded_len() + 4).sum::<usize>();
        p.events.extend(d.events);
        p.waiters.push(Ack {
            waiter: d.waiter,
            reply: d.reply,
            seq: d.seq,
        });
    }

    /// The batch in flight committed at `now` (the shell has folded it into the state).
    pub fn committed(&mut self, now: Instant) {
        let Some(waiters) = self.in_flight.take() else {
            return;
        };
        self.last_commit = (now, waiters.len());
        if !waiters.is_empty() {
            self.actions.push_back(Action::Ack(waiters));
        }
        self.finish_stopping();
    }

    /// The batch in flight was refused by the fence: another leader exists.
    pub fn fenced(&mut self) {
        self.in_flight_failed(FENCED, StepDown::Fenced);
    }

    /// The batch in flight failed with `e`: its outcome is unknown.
    pub fn failed(&mut self, e: LogError) {
        self.in_flight_failed(UNKNOWN, StepDown::Etcd(e));
    }

    /// etcd refused the batch in flight and certainly did not write it (its space quota is
    /// used up): its waiters, and those of the batch filling behind it (decided on top of
    /// it), are told `why`, and leadership goes on from the committed state — the shell
    /// drops its speculative state back to it.
    pub fn refused(&mut self, why: &'static str) {
        let Some(waiters) = self.in_flight.take() else {
            return;
        };
        self.fail(waiters, why);
        let pending = std::mem::replace(&mut self.pending, Pending::new());
        self.fail(pending.waiters, why);
        self.finish_stopping();
    }

    fn in_flight_failed(&mut self, why: &'static str, reason: StepDown) {
        let Some(waiters) = self.in_flight.take() else {
            return;
        };
        // While stepping down for another reason, a failed write only has an unknown outcome.
        let leading = matches!(self.phase, Phase::Leading);
        self.fail(waiters, if leading { why } else { STOPPED_IN_FLIGHT });
        self.stop(reason);
        self.finish_stopping();
    }

    /// Leadership ends for `reason`: fail what is pending at once; a batch in flight is
    /// answered by its outcome, which the shell still reports (or gives up on with
    /// [`GroupCommit::failed`]).
    pub fn stop(&mut self, reason: StepDown) {
        if !matches!(self.phase, Phase::Leading) {
            return;
        }
        self.phase = Phase::Stopping(reason);
        let pending = std::mem::replace(&mut self.pending, Pending::new());
        self.fail(pending.waiters, LOST);
        self.finish_stopping();
    }

    fn finish_stopping(&mut self) {
        if self.in_flight.is_some() || !matches!(self.phase, Phase::Stopping(_)) {
            return;
        }
        if let Phase::Stopping(reason) = std::mem::replace(&mut self.phase, Phase::Over) {
            self.actions.push_back(Action::StepDown(reason));
        }
    }

    fn fail(&mut self, waiters: Vec<Ack<W>>, why: &'static str) {
        if !waiters.is_empty() {
            self.actions.push_back(Action::Fail(
                waiters.into_iter().map(|a| a.waiter).collect(),
                why,
            ));
        }
    }

    /// Time is `now`, and the lease is `lease_alive`: launch the pending batch if it is due,
    /// or say when to look again.
    pub fn tick(&mut self, now: Instant, lease_alive: bool) {
        if !matches!(self.phase, Phase::Leading) || self.in_flight.is_some() {
            return;
        }
        let full = self.pending.full(&self.limits);
        let hold = self.limits.hold_until(self.last_commit);
        if self.pending.due(&self.limits, now) && (full || hold.is_none_or(|h| now >= h)) {
            if !lease_alive {
                let pending = std::mem::replace(&mut self.pending, Pending::new());
                self.fail(pending.waiters, LEASE_EXPIRED);
                self.stop(StepDown::LeaseLost);
                return;
            }
            let batch = std::mem::replace(&mut self.pending, Pending::new());
            if batch.events.is_empty() {
                self.actions.push_back(Action::Ack(batch.waiters));
            } else {
                self.in_flight = Some(batch.waiters);
                self.actions.push_back(Action::Launch {
                    batch: pb::EventBatch {
                        version: 1,
                        first_seq: batch.events.first().map_or(0, |e| e.seq),
                        epoch: self.epoch,
                        events: batch.events,
                        ..Default::default()
                    },
                    opened: batch.opened,
                });
            }
            return;
        }
        let p = &self.pending;
        let wake = p
            .lingering
            .filter(|_| !p.urgent)
            .map(|t| t + self.limits.confirm_linger)
            .into_iter()
            .chain(hold.filter(|_| !p.waiters.is_empty() && !full))
            .min();
        if let Some(t) = wake {
            self.actions.push_back(Action::WakeAt(t));
        }
    }
}

#[cfg(test)]
mod tests;
