//! The one way into the ledger: a [`Writer`] hands a command to the leader's sequencer on this
//! replica and waits until its events are durable; the sequencer takes them from its
//! [`Inbox`], which is open only while this replica leads.
//!
//! Everything in the allocator that changes the ledger goes through a `Writer`: the gRPC
//! writes (which forward to the leader replica when this one does not lead), the Kubernetes
//! and GPUBudget watchers, and the preemption's evictions and sweep. Its answers are ledger
//! words ([`WriteError`]); the gRPC service turns them into a status in one place.

use std::sync::{Arc, Mutex};

use gpuledger_ledger::{ApplyError, Command, CommandError, Reply, pb};
use tokio::sync::{mpsc, oneshot};

/// Requests the sequencer's inbox holds before a writer waits to hand one over.
const INBOX_CAPACITY: usize = 4096;

/// An answer to a write, sent only after its events (and every event before them) committed.
#[derive(Debug, Clone)]
pub struct Committed {
    /// The command's reply.
    pub reply: Reply,
    /// Seq of the command's last event (or of the state it was answered from).
    pub seq: u64,
    /// Epoch of the leader that answered.
    pub epoch: u64,
}

/// Why a write was not committed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum WriteError {
    /// This replica does not lead: only the leader's sequencer writes, and nothing was sent.
    #[error("this replica is not the leader")]
    NotLeader,
    /// The ledger refused the command against its state; nothing was written.
    #[error(transparent)]
    Refused(CommandError),
    /// The command's events would break an invariant of the ledger: the sequencer wrote
    /// nothing and its leadership ends (a bug, which an operator must look into).
    #[error("refused to write an invalid event: {0}")]
    InvalidEvent(ApplyError),
    /// The write has no answer: leadership ended, or etcd failed or refused the batch, before
    /// it was known to commit. It is safe to retry (on the leader of the moment).
    #[error("{0}")]
    Unavailable(String),
}

/// A write command on its way to the leader's sequencer.
pub struct Request {
    /// What to do.
    pub cmd: Command,
    /// Who asked (the verified caller, or this replica for what the leader does itself):
    /// recorded on every event the command writes.
    pub actor: Option<pb::Actor>,
    /// Where the answer goes once the events are durable.
    pub reply: oneshot::Sender<Result<Committed, WriteError>>,
}

/// Where writers find the sequencer: its inbox while this replica leads, nothing otherwise.
type Slot = Arc<Mutex<Option<mpsc::Sender<Request>>>>;

/// The handle everything that writes to the ledger holds (cheap to clone).
#[derive(Clone)]
pub struct Writer {
    slot: Slot,
    /// This replica, as the actor of what the leader decides itself.
    me: pb::Actor,
}

/// The sequencer's end of the write path, which the leader opens while it leads.
#[derive(Clone)]
pub struct Inbox {
    slot: Slot,
}

/// A writer and the inbox it writes to, for a replica that records its own decisions as `me`.
pub fn channel(me: pb::Actor) -> (Writer, Inbox) {
    let slot = Slot::default();
    (
        Writer {
            slot: slot.clone(),
            me,
        },
        Inbox { slot },
    )
}

impl Writer {
    /// Write `cmd` as this replica's own decision (expiry, node sync, budgets from
    /// Kubernetes); [`WriteError::NotLeader`] when it does not lead, since watchers on
    /// followers observe but do not act.
    pub async fn submit(&self, cmd: Command) -> Result<Committed, WriteError> {
        self.submit_as(cmd, self.me.clone()).await
    }

    /// Write `cmd` on behalf of `actor` (a verified caller of the API).
    pub async fn submit_as(&self, cmd: Command, actor: pb::Actor) -> Result<Committed, WriteError> {
        let answer = self.send(cmd, actor).await?;
        answer
            .await
            .unwrap_or_else(|_| Err(WriteError::Unavailable("leader stepped down; retry".into())))
    }

    /// Hand `cmd` to the sequencer; the answer comes on the returned channel once the events
    /// are durable (or the write failed).
    pub(crate) async fn send(
        &self,
        cmd: Command,
        actor: pb::Actor,
    ) -> Result<oneshot::Receiver<Result<Committed, WriteError>>, WriteError> {
        let tx = self
            .slot
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or(WriteError::NotLeader)?;
        let (reply, answer) = oneshot::channel();
        let request = Request {
            cmd,
            actor: Some(actor),
            reply,
        };
        tx.send(request)
            .await
            .map_err(|_| WriteError::Unavailable("leadership lost; retry".into()))?;
        Ok(answer)
    }

    /// Whether a sequencer takes writes here (this replica leads).
    pub fn leading(&self) -> bool {
        self.slot
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
    }
}

impl Inbox {
    /// Take writes: from now on writers reach the returned receiver.
    pub fn open(&self) -> mpsc::Receiver<Request> {
        let (tx, rx) = mpsc::channel(INBOX_CAPACITY);
        *self.slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(tx);
        rx
    }

    /// Stop taking writes at once: no new request reaches `rx`, and those queued in it are
    /// told to retry (elsewhere).
    pub fn close(&self, rx: &mut mpsc::Receiver<Request>) {
        *self.slot.lock().unwrap_or_else(|p| p.into_inner()) = None;
        rx.close();
        while let Ok(r) = rx.try_recv() {
            let _ = r.reply.send(Err(WriteError::Unavailable(
                "leadership lost; retry".into(),
            )));
        }
    }
}
