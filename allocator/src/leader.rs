//! The leader's sequencer: group commit with one transaction in flight.
//!
//! Commands are decided against a speculative state (committed + everything pending). Their
//! events fill the next batch while the previous batch's transaction flies. A reply is sent only
//! after its batch — and so every batch before it — committed. Any failed fence or unknown
//! outcome stops the sequencer at once: nothing more is granted, every waiter is told to retry,
//! and the replica falls back to follower.

use std::sync::Arc;
use std::time::Duration;

use etcd_client::LeaderKey;
use gpuledger_ledger::{Command, CommandError, Ledger, pb};
use prost::Message;
use tokio::sync::{mpsc, oneshot};
use tonic::Status;
use tracing::{debug, info, warn};

use crate::election::Session;
use crate::log::{Commit, EtcdLog, LogError, MAX_VALUE_BYTES};
use crate::shared::{Committed, Request, Role, Shared};

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

/// Waiters in the last committed batch from which the sequencer counts as loaded.
pub const LOAD_WAITERS: usize = 8;

impl BatchLimits {
    /// Until when the next batch may wait for company, given when the last transaction
    /// committed and how many requests it answered (None: no wait).
    fn hold_until(
        &self,
        (committed, waiters): (tokio::time::Instant, usize),
    ) -> Option<tokio::time::Instant> {
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

struct Waiter {
    tx: oneshot::Sender<Result<Committed, Status>>,
    reply: gpuledger_ledger::Reply,
    seq: u64,
}

/// The transaction in flight, its waiters, and the batch it writes. The commit future is
/// polled by the sequencer's own task (not spawned): its answer wakes the sequencer directly,
/// one task hop less between etcd's reply and the acks.
type InFlight = (
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<Commit, LogError>> + Send>>,
    Batch,
    pb::EventBatch,
    std::time::Instant,
);

struct Batch {
    events: Vec<pb::Event>,
    bytes: usize,
    waiters: Vec<Waiter>,
    /// When the first command of this batch was decided (how long it waited for the txn).
    opened: Option<std::time::Instant>,
    /// Someone waits for an event of this batch: write it as soon as etcd is free.
    urgent: bool,
    /// When the first event that may wait (a bind confirmation) joined.
    lingering: Option<tokio::time::Instant>,
}

impl Batch {
    fn new() -> Self {
        Batch {
            events: Vec::new(),
            bytes: 0,
            waiters: Vec::new(),
            opened: None,
            urgent: false,
            lingering: None,
        }
    }

    /// Whether to hand the batch to etcd now (when no transaction is in flight).
    fn due(&self, limits: &BatchLimits, now: tokio::time::Instant) -> bool {
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

/// Everything the leader needs.
pub struct Leader {
    /// Shared replica state.
    pub shared: Arc<Shared>,
    /// The log.
    pub log: EtcdLog,
    /// The election key won (its rev is the epoch).
    pub key: LeaderKey,
    /// Batch limits.
    pub limits: BatchLimits,
    /// Snapshot every this many events (0 = never).
    pub snapshot_every: u64,
    /// Where history etcd no longer holds is read from (catching up at election).
    pub archive: Option<crate::archive::Archive>,
}

impl Leader {
    /// Lead until leadership ends. `shutdown` resolves on SIGTERM.
    pub async fn run(
        self,
        session: &Session,
        mut shutdown: tokio::sync::watch::Receiver<bool>,
    ) -> StepDown {
        let epoch = self.key.rev() as u64;
        // Catch up with everything committed before us.
        let head = match self.log.head().await {
            Ok(h) => h,
            Err(e) => return StepDown::Etcd(e),
        };
        if let Err(e) = crate::tail::catch_up(&self.shared, &self.log, self.archive.as_ref()).await
        {
            return StepDown::Etcd(e);
        }
        let mut spec: Ledger = self.shared.read(|l| l.clone());
        if spec.seq() != head.seq {
            return StepDown::Bug(format!(
                "caught up to seq {} but head says {}",
                spec.seq(),
                head.seq
            ));
        }
        let mut head_rev = head.mod_rev;
        // The first event of every epoch names the leader.
        let elected = Command::LeaderElected(pb::LeaderElected {
            replica: self.shared.replica.clone(),
            address: self.shared.address.clone(),
        });
        let events = match spec.execute(elected, epoch, self.shared.clock.now_ms()) {
            Ok((ev, _)) => ev,
            Err(e) => return StepDown::Bug(e.to_string()),
        };
        let batch = self.make_batch(epoch, events);
        match self
            .log
            .commit(self.key.key(), self.key.rev(), head_rev, &batch)
            .await
        {
            Ok(Commit::Done { head_rev: r }) => {
                head_rev = r;
                self.shared.apply_committed(batch);
            }
            Ok(Commit::Fenced) => return StepDown::Fenced,
            Err(e) => return StepDown::Etcd(e),
        }
        info!(epoch, seq = spec.seq(), replica = %self.shared.replica, "leading");
        self.shared.metrics.leaderships.inc();
        let (tx, mut inbox) = mpsc::channel::<Request>(4096);
        *self
            .shared
            .sequencer
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(tx);
        self.shared
            .set_role(Role::Leader, epoch, self.shared.address.clone());

        let mut pending = Batch::new();
        let mut inflight: Option<InFlight> = None;
        let mut last_snap = spec.seq();
        // When the last transaction committed and how many requests it answered.
        let clock = self.shared.clock.clone();
        let mut last_commit = (clock.now(), 0usize);
        let reason = loop {
            let full = pending.full(&self.limits);
            let hold = self.limits.hold_until(last_commit);
            let linger_until = pending
                .lingering
                .filter(|_| !pending.urgent)
                .map(|t| t + self.limits.confirm_linger)
                .into_iter()
                .chain(hold.filter(|_| !pending.waiters.is_empty() && !full))
                .min()
                .filter(|_| inflight.is_none());
            tokio::select! {
                biased;
                _ = shutdown.changed() => break StepDown::Shutdown,
                _ = session.lost() => break StepDown::LeaseLost,
                done = async { inflight.as_mut().expect("guarded").0.as_mut().await }, if inflight.is_some() => {
                    let (_, batch, eb, sent) = inflight.take().expect("guarded");
                    match done {
                        Ok(Commit::Done { head_rev: r }) => {
                            head_rev = r;
                            let txn = sent.elapsed();
                            self.shared.metrics.commit_latency.observe(txn.as_secs_f64());
                            self.shared.metrics.batch_events.observe(eb.events.len() as f64);
                            let (events, waiters) = (eb.events.len(), batch.waiters.len());
                            let queued = batch.opened.map(|o| sent.saturating_duration_since(o));
                            self.shared.apply_committed(eb);
                            last_commit = (clock.now(), batch.waiters.len());
                            for w in batch.waiters {
                                let _ = w.tx.send(Ok(Committed { reply: w.reply, seq: w.seq, epoch }));
                            }
                            debug!(events, waiters, queued_us = queued.map_or(0, |d| d.as_micros() as u64),
                                txn_us = txn.as_micros() as u64,
                                acked_us = (sent.elapsed() - txn).as_micros() as u64, "batch committed");
                        }
                        Ok(Commit::Fenced) => {
                            fail(batch, "leadership lost before the write committed; retry");
                            break StepDown::Fenced;
                        }
                        Err(e) => {
                            fail(batch, "the ledger write's outcome is unknown (etcd error); retry, requests are idempotent");
                            break StepDown::Etcd(e);
                        }
                    }
                }
                _ = async { tokio::time::sleep_until(linger_until.expect("guarded")).await }, if linger_until.is_some() => {}
                req = inbox.recv(), if !full => {
                    let Some(req) = req else { break StepDown::Shutdown };
                    if let Err(stop) = decide(&mut spec, &mut pending, req, epoch, clock.as_ref()) {
                        break stop;
                    }
                    // Take whatever else is already queued into the same batch.
                    let mut stop = None;
                    while !pending.full(&self.limits) {
                        let Ok(req) = inbox.try_recv() else { break };
                        if let Err(s) = decide(&mut spec, &mut pending, req, epoch, clock.as_ref()) {
                            stop = Some(s);
                            break;
                        }
                    }
                    if let Some(s) = stop {
                        break s;
                    }
                }
            }
            // Nothing in flight: launch the pending batch (or answer waiters that wrote nothing).
            let now = clock.now();
            if inflight.is_none()
                && pending.due(&self.limits, now)
                && (pending.full(&self.limits)
                    || self.limits.hold_until(last_commit).is_none_or(|h| now >= h))
            {
                if !session.alive() {
                    fail(
                        std::mem::replace(&mut pending, Batch::new()),
                        "this replica's lease expired; retry",
                    );
                    break StepDown::LeaseLost;
                }
                let batch = std::mem::replace(&mut pending, Batch::new());
                if batch.events.is_empty() {
                    for w in batch.waiters {
                        let _ = w.tx.send(Ok(Committed {
                            reply: w.reply,
                            seq: w.seq,
                            epoch,
                        }));
                    }
                } else {
                    let mut batch = batch;
                    let eb = self.make_batch(epoch, std::mem::take(&mut batch.events));
                    let log = self.log.clone();
                    let key = self.key.key().to_vec();
                    let rev = self.key.rev();
                    let (first, head, bytes) = crate::log::encode(&eb);
                    let h = Box::pin(async move {
                        log.commit_encoded(&key, rev, head_rev, first, &head, bytes)
                            .await
                    });
                    inflight = Some((h, batch, eb, std::time::Instant::now()));
                }
            }
            if inflight.is_none()
                && pending.waiters.is_empty()
                && crate::tail::snapshot_due(&spec, last_snap, self.snapshot_every)
            {
                last_snap = spec.seq();
                crate::tail::spawn_snapshot(self.shared.clone(), self.log.clone());
            }
        };
        // Stop granting at once: no new requests reach this sequencer.
        *self
            .shared
            .sequencer
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = None;
        inbox.close();
        while let Ok(r) = inbox.try_recv() {
            let _ = r
                .reply
                .send(Err(Status::unavailable("leadership lost; retry")));
        }
        fail(pending, "leadership lost; retry");
        if let Some((h, batch, eb, _)) = inflight.take() {
            // Let an in-flight write finish so its outcome is known to the waiters.
            match tokio::time::timeout(Duration::from_secs(2), h).await {
                Ok(Ok(Commit::Done { .. })) => {
                    self.shared.apply_committed(eb);
                    for w in batch.waiters {
                        let _ = w.tx.send(Ok(Committed {
                            reply: w.reply,
                            seq: w.seq,
                            epoch,
                        }));
                    }
                }
                _ => fail(
                    batch,
                    "leadership lost; outcome unknown, retry (requests are idempotent)",
                ),
            }
        }
        match &reason {
            StepDown::Shutdown => info!(epoch, "leader shutting down"),
            other => warn!(epoch, reason = ?other, "stepping down"),
        }
        reason
    }

    fn make_batch(&self, epoch: u64, events: Vec<pb::Event>) -> pb::EventBatch {
        pb::EventBatch {
            version: 1,
            first_seq: events.first().map_or(0, |e| e.seq),
            epoch,
            events,
        }
    }
}

fn decide(
    spec: &mut Ledger,
    pending: &mut Batch,
    req: Request,
    epoch: u64,
    clock: &dyn gpuledger_ops::clock::Clock,
) -> Result<(), StepDown> {
    let may_wait = matches!(req.cmd, Command::ConfirmBound { .. });
    match spec.execute(req.cmd, epoch, clock.now_ms()) {
        Ok((events, reply)) => {
            let seq = spec.seq();
            pending.opened.get_or_insert_with(std::time::Instant::now);
            if events.is_empty() {
                // Answered from the state: nothing to wait for.
            } else if may_wait {
                pending.lingering.get_or_insert_with(|| clock.now());
            } else {
                pending.urgent = true;
            }
            for e in &events {
                pending.bytes += e.encoded_len() + 4;
            }
            pending.events.extend(events);
            pending.waiters.push(Waiter {
                tx: req.reply,
                reply,
                seq,
            });
            Ok(())
        }
        Err(CommandError::Bug(e)) => {
            let _ = req.reply.send(Err(Status::internal(format!(
                "refused to write an invalid event: {e}"
            ))));
            Err(StepDown::Bug(e.to_string()))
        }
        Err(e) => {
            let _ = req.reply.send(Err(crate::service::status_of(&e)));
            Ok(())
        }
    }
}

fn fail(batch: Batch, why: &str) {
    for w in batch.waiters {
        let _ = w.tx.send(Err(Status::unavailable(why.to_string())));
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn waiter() -> Waiter {
        Waiter {
            tx: oneshot::channel().0,
            reply: gpuledger_ledger::Reply::Done { changed: true },
            seq: 1,
        }
    }

    #[test]
    fn only_confirmations_wait_and_only_for_the_linger() {
        let limits = BatchLimits::default();
        let t0 = tokio::time::Instant::now();
        let mut b = Batch::new();
        assert!(!b.due(&limits, t0), "an empty batch has nothing to write");
        b.waiters.push(waiter());
        assert!(
            b.due(&limits, t0),
            "a waiter answered from the state goes at once"
        );
        b.events.push(pb::Event::default());
        b.lingering = Some(t0);
        assert!(!b.due(&limits, t0 + Duration::from_millis(4)));
        assert!(b.due(&limits, t0 + limits.confirm_linger));
        b.urgent = true;
        assert!(b.due(&limits, t0), "someone waits: no linger");
        b.urgent = false;
        b.events = vec![pb::Event::default(); limits.max_events];
        assert!(b.due(&limits, t0), "a full batch goes at once");
    }

    #[test]
    fn only_a_loaded_sequencer_holds_a_batch_and_only_for_the_linger() {
        let t0 = tokio::time::Instant::now();
        let off = BatchLimits::default();
        assert_eq!(off.hold_until((t0, 64)), None, "no linger configured");
        let on = BatchLimits {
            load_linger: Duration::from_millis(2),
            ..BatchLimits::default()
        };
        assert_eq!(
            on.hold_until((t0, LOAD_WAITERS - 1)),
            None,
            "a lightly loaded leader never delays a write"
        );
        assert_eq!(
            on.hold_until((t0, LOAD_WAITERS)),
            Some(t0 + Duration::from_millis(2))
        );
    }
}
