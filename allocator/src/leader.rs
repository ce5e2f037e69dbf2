//! The leader's sequencer: catch up, announce the epoch, then group-commit decided commands
//! into fenced transactions until leadership ends.
//!
//! Commands are decided against a speculative state (committed + everything pending). When
//! a batch goes, when answers are sent and when leadership ends are decided by the pure
//! policy in [`group_commit`]; this file is the shell around it: it decides commands, feeds
//! the policy what happened (with the replica's [`Clock`](gpuledger_ops::clock::Clock)) and
//! carries out what it asks against the log ([`LedgerLog`]) and the waiters.

pub mod group_commit;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use gpuledger_ledger::chain::Hash;
use gpuledger_ledger::{Command, CommandError, Ledger, pb};
use gpuledger_ops::clock::Clock;
use tokio::sync::oneshot;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use self::group_commit::{Ack, Action, Decided, GroupCommit};
pub use self::group_commit::{BatchLimits, LOAD_WAITERS, StepDown};
use crate::archive::Archive;
use crate::election::Lease;
use crate::log::{Commit, Fence, LedgerLog, LogError, encode, stamp};
use crate::shared::{NOSPACE_REFUSAL, Role, Shared};
use crate::writer::{Committed, Inbox, Request, WriteError};

/// How long a batch in flight when leadership ends may take to say whether it committed.
const IN_FLIGHT_GRACE: Duration = Duration::from_secs(2);

/// Who waits for a decided command's answer.
type Waiter = oneshot::Sender<Result<Committed, WriteError>>;

/// The transaction in flight. Its future is polled by the sequencer's own task (not
/// spawned): its answer wakes the sequencer directly, one task hop less between etcd's reply
/// and the acks.
struct InFlight<'a> {
    commit: Pin<Box<dyn Future<Output = Result<Commit, LogError>> + Send + 'a>>,
    batch: pb::EventBatch,
    sent: Instant,
    opened: Option<Instant>,
}

/// Everything the leader needs.
pub struct Leader<L> {
    /// Shared replica state.
    pub shared: Arc<Shared>,
    /// Where the writers' commands arrive while this replica leads.
    pub inbox: Inbox,
    /// The log.
    pub log: L,
    /// The election key won; its create_revision is the epoch.
    pub fence: Fence,
    /// Batch limits.
    pub limits: BatchLimits,
    /// Snapshot every this many events (0 = never).
    pub snapshot_every: u64,
    /// Where history etcd no longer holds is read from (catching up at election).
    pub archive: Option<Archive>,
}

impl<L: LedgerLog> Leader<L> {
    /// Lead until leadership ends: the lease is lost, a write is fenced or fails, a bug, or
    /// `shutdown` is cancelled (SIGTERM).
    pub async fn run(self, lease: &Lease, shutdown: CancellationToken) -> StepDown {
        let Leader {
            shared,
            inbox,
            log,
            fence,
            limits,
            snapshot_every,
            archive,
        } = self;
        let epoch = fence.epoch as u64;
        let clock = shared.clock.clone();
        let (mut spec, mut head_rev, mut tip) =
            match announce(&shared, &log, &fence, archive.as_ref()).await {
                Ok(x) => x,
                Err(stop) => {
                    // Elected, but not one event written: the replica backs off before it
                    // campaigns again (`replica::lifecycle`), or it would take over and fail
                    // again many times a second.
                    shared.metrics.failed_takeovers.inc();
                    warn!(epoch, reason = ?stop, "elected but could not take over; stepping down");
                    return stop;
                }
            };
        info!(epoch, seq = spec.seq(), replica = %shared.replica, "leading");
        shared.metrics.leaderships.inc();
        let mut requests = inbox.open();
        shared.set_role(Role::Leader, epoch, shared.address.clone());

        let mut policy = GroupCommit::<Waiter>::new(limits, epoch, clock.now());
        let mut in_flight: Option<InFlight<'_>> = None;
        let mut wake: Option<Instant> = None;
        let mut closed = false;
        let mut last_snap = spec.seq();
        let reason = 'lead: loop {
            while let Some(action) = policy.next_action() {
                match action {
                    Action::Launch { mut batch, opened } => {
                        let encoded = chain(&mut batch, &mut tip, &log);
                        in_flight = Some(InFlight {
                            commit: Box::pin(log.append(&fence, head_rev, encoded)),
                            batch,
                            sent: clock.now(),
                            opened,
                        });
                    }
                    Action::Ack(acks) => answer(acks, epoch),
                    Action::Fail(waiters, why) => fail(waiters, why),
                    Action::WakeAt(t) => wake = Some(t),
                    Action::StepDown(reason) => break 'lead reason,
                }
            }
            if policy.stopping() {
                if !closed {
                    closed = true;
                    inbox.close(&mut requests);
                }
                // Only the batch in flight is left to say how it ended.
                let Some(f) = in_flight.take() else {
                    // The policy steps down once nothing is in flight; say so if it did not.
                    break StepDown::Bug("the sequencer stopped without stepping down".into());
                };
                match tokio::time::timeout(IN_FLIGHT_GRACE, f.commit).await {
                    Ok(Ok(Commit::Done { .. })) => {
                        shared.apply_committed(f.batch);
                        policy.committed(clock.now());
                    }
                    Ok(Ok(Commit::Fenced)) => policy.fenced(),
                    Ok(Err(e)) => policy.failed(e),
                    Err(_) => policy.failed(LogError::Timeout(IN_FLIGHT_GRACE)),
                }
                continue;
            }
            let accepting = policy.accepting();
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => policy.stop(StepDown::Shutdown),
                _ = lease.lost() => policy.stop(StepDown::LeaseLost),
                done = async { in_flight.as_mut().expect("guarded").commit.as_mut().await }, if in_flight.is_some() => {
                    let f = in_flight.take().expect("guarded");
                    match done {
                        Ok(Commit::Done { head_rev: r }) => {
                            head_rev = r;
                            let answered = clock.now();
                            let txn = answered.saturating_duration_since(f.sent);
                            shared.metrics.commit_latency.observe(txn.as_secs_f64());
                            shared.metrics.batch_events.observe(f.batch.events.len() as f64);
                            let events = f.batch.events.len();
                            let waiters = policy.in_flight_waiters();
                            shared.apply_committed(f.batch);
                            policy.committed(clock.now());
                            debug!(events, waiters,
                                queued_us = f.opened.map_or(0, |o| f.sent.saturating_duration_since(o).as_micros() as u64),
                                txn_us = txn.as_micros() as u64,
                                acked_us = clock.now().saturating_duration_since(answered).as_micros() as u64,
                                "batch committed");
                        }
                        Ok(Commit::Fenced) => policy.fenced(),
                        Err(e) if e.is_no_space() => {
                            // Certainly not written: fail it and what was decided on top of
                            // it, and go on leading from the committed state. Writes resume
                            // by themselves once an operator has made room.
                            shared.metrics.nospace_refusals.inc();
                            debug!(events = f.batch.events.len(), "etcd is out of space: batch refused");
                            policy.refused(NOSPACE_REFUSAL);
                            spec = shared.with_live(Ledger::clone);
                            match shared.chain_tip() {
                                Some(t) => tip = t,
                                None => policy.stop(StepDown::Bug(
                                    "no chain tip after a refused batch".into(),
                                )),
                            }
                        }
                        Err(e) => policy.failed(e),
                    }
                }
                _ = async { tokio::time::sleep_until(wake.expect("guarded")).await }, if wake.is_some() => {}
                req = requests.recv(), if accepting => match req {
                    None => policy.stop(StepDown::Shutdown),
                    Some(req) => {
                        decide(&mut spec, &mut policy, req, epoch, clock.as_ref());
                        // Take whatever else is already queued into the same batch.
                        while policy.accepting() {
                            let Ok(req) = requests.try_recv() else { break };
                            decide(&mut spec, &mut policy, req, epoch, clock.as_ref());
                        }
                    }
                },
            }
            wake = None;
            policy.tick(clock.now(), lease.alive());
            if policy.idle() && crate::tail::snapshot_due(&spec, last_snap, snapshot_every) {
                last_snap = spec.seq();
                crate::tail::spawn_snapshot(shared.clone(), log.clone());
            }
        };
        if !closed {
            inbox.close(&mut requests);
        }
        match &reason {
            StepDown::Shutdown => info!(epoch, "leader shutting down"),
            other => warn!(epoch, reason = ?other, "stepping down"),
        }
        reason
    }
}

/// Link `batch` to the chain's `tip` and encode it; `tip` moves to its hash and the batch is
/// stamped with it, as a reader of the store would see it.
fn chain<L: LedgerLog>(batch: &mut pb::EventBatch, tip: &mut Hash, log: &L) -> crate::log::Encoded {
    batch.prev_hash = tip.to_vec();
    let encoded = encode(batch);
    *tip = encoded.hash;
    stamp(
        batch,
        encoded.hash,
        format!("etcd {}{:020}", log.location(), batch.first_seq),
    );
    encoded
}

/// The hash of the last committed batch, from the fold; checked against what `head` records.
async fn chain_tip<L: LedgerLog>(
    shared: &Shared,
    log: &L,
    head: &crate::log::HeadInfo,
    head_hash: &[u8],
) -> Result<Hash, StepDown> {
    let corrupt = |why: String| {
        shared.metrics.chain_breaks.inc();
        StepDown::Etcd(LogError::Corrupt {
            key: format!("{}head", log.location().trim_end_matches("log/")),
            why,
        })
    };
    let tip = match shared.chain_tip() {
        Some(t) => t,
        // Resumed from a snapshot without a chain hash and nothing folded since.
        None => match Hash::try_from(head_hash) {
            Ok(h) => h,
            Err(_) => {
                let mut found = None;
                log.read_with(head.seq, head.seq, |b| {
                    found = Some(gpuledger_ledger::chain::batch_hash(&b));
                    false
                })
                .await
                .map_err(StepDown::Etcd)?;
                found.ok_or_else(|| corrupt(format!("no batch holds seq {}", head.seq)))?
            }
        },
    };
    if !head_hash.is_empty() && head_hash != tip {
        return Err(corrupt(format!(
            "head records hash {} but the last batch hashes to {}: the newest batch was changed",
            gpuledger_ledger::chain::short_hex(head_hash),
            gpuledger_ledger::chain::short_hex(&tip)
        )));
    }
    Ok(tip)
}

/// Catch up with everything committed before this leadership, then write its first event
/// (`LeaderElected`, which names the leader). Returns the speculative state, `head`'s
/// mod_revision to fence the next write on and the chain's tip.
async fn announce<L: LedgerLog>(
    shared: &Arc<Shared>,
    log: &L,
    fence: &Fence,
    archive: Option<&Archive>,
) -> Result<(Ledger, i64, Hash), StepDown> {
    let epoch = fence.epoch as u64;
    let head = log.head().await.map_err(StepDown::Etcd)?;
    crate::tail::catch_up(shared, log, archive)
        .await
        .map_err(StepDown::Etcd)?;
    let mut spec: Ledger = shared.with_live(Ledger::clone);
    if spec.seq() != head.seq {
        return Err(StepDown::Bug(format!(
            "caught up to seq {} but head says {}",
            spec.seq(),
            head.seq
        )));
    }
    let elected = Command::LeaderElected(pb::LeaderElected {
        replica: shared.replica.clone(),
        address: shared.address.clone(),
    });
    let (mut events, _) = spec
        .execute(elected, epoch, shared.clock.now_ms())
        .map_err(|e| StepDown::Bug(e.to_string()))?;
    for e in &mut events {
        e.actor = Some(shared.actor());
    }
    let mut tip = chain_tip(shared, log, &head, &head.hash).await?;
    let mut batch = pb::EventBatch {
        version: 1,
        first_seq: events.first().map_or(0, |e| e.seq),
        epoch,
        events,
        ..Default::default()
    };
    let encoded = chain(&mut batch, &mut tip, log);
    match log.append(fence, head.mod_rev, encoded).await {
        Ok(Commit::Done { head_rev }) => {
            shared.apply_committed(batch);
            Ok((spec, head_rev, tip))
        }
        Ok(Commit::Fenced) => Err(StepDown::Fenced),
        Err(e) => Err(StepDown::Etcd(e)),
    }
}

/// Decide `req` against the speculative state and hand the outcome to the policy.
fn decide(
    spec: &mut Ledger,
    policy: &mut GroupCommit<Waiter>,
    req: Request,
    epoch: u64,
    clock: &dyn Clock,
) {
    let may_wait = matches!(req.cmd, Command::ConfirmBound { .. });
    match spec.execute(req.cmd, epoch, clock.now_ms()) {
        Ok((mut events, reply)) => {
            for e in &mut events {
                e.actor.clone_from(&req.actor);
            }
            policy.decided(
                clock.now(),
                Decided {
                    waiter: req.reply,
                    events,
                    reply,
                    seq: spec.seq(),
                    may_wait,
                },
            )
        }
        Err(CommandError::Bug(e)) => {
            let why = e.to_string();
            let _ = req.reply.send(Err(WriteError::InvalidEvent(e)));
            policy.stop(StepDown::Bug(why));
        }
        Err(e) => {
            let _ = req.reply.send(Err(WriteError::Refused(e)));
        }
    }
}

fn answer(acks: Vec<Ack<Waiter>>, epoch: u64) {
    for a in acks {
        let _ = a.waiter.send(Ok(Committed {
            reply: a.reply,
            seq: a.seq,
            epoch,
        }));
    }
}

fn fail(waiters: Vec<Waiter>, why: &str) {
    for w in waiters {
        let _ = w.send(Err(WriteError::Unavailable(why.to_string())));
    }
}

#[cfg(test)]
mod tests;
