//! What every part of a replica shares: the committed state, the role, the event fan-out.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpuledger_ledger::chain::Hash;
use gpuledger_ledger::{FollowError, Follower, Ledger, pb};
use gpuledger_ops::clock::{Clock, SystemClock};
use tokio::sync::{broadcast, watch};
use tracing::error;

/// An immutable view of the committed state (see [`gpuledger_view`]).
pub type View = gpuledger_view::View<Ledger>;

/// How often views are published when nobody asked (bounds the replay backlog).
pub const MAINTAIN_VIEWS_EVERY: Duration = Duration::from_millis(100);

/// How many recent committed batches a replica keeps for subscribers resuming from a seq.
const RECENT_BATCHES: usize = 4096;

/// A replica's role.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Starting up: loading the state.
    Starting,
    /// Tailing the log, campaigning.
    Follower,
    /// Elected; writes go through this replica.
    Leader,
}

impl Role {
    /// Lower-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Starting => "starting",
            Role::Follower => "follower",
            Role::Leader => "leader",
        }
    }
}

/// Why this replica cannot serve grants (None = it can).
#[derive(Debug, Clone, Default)]
pub struct Health {
    /// etcd answered the last freshness check.
    pub etcd_ok: bool,
    /// What went wrong last, for `Status` and error messages.
    pub reason: String,
    /// Last head seq seen in etcd.
    pub head_seq: u64,
    /// The state met an invalid event and stopped applying (needs an operator).
    pub broken: Option<String>,
    /// etcd's NOSPACE alarm is raised (on the members named here): etcd refuses every write
    /// until an operator frees space and disarms it. Reads still work.
    pub nospace: Option<String>,
}

/// What a write is told while etcd is out of space.
pub const NOSPACE_REFUSAL: &str = "etcd is out of space (its NOSPACE alarm is raised): the \
    ledger takes no writes until an operator compacts and defragments etcd and disarms the \
    alarm (`gpuledger status` says how); retry later";

/// State shared by the tail, the sequencer, the gRPC service, the watchers and the health loop.
pub struct Shared {
    /// The committed state and its hash chain (only committed events are ever folded in
    /// here). Only the fold locks it; readers take a [`View`].
    live: Mutex<Follower>,
    /// Immutable views of `live` for readers, published off the commit path.
    pub(crate) views: gpuledger_view::Views<Ledger>,
    /// Seq of the last event folded into `live`.
    folded: AtomicU64,
    /// Role, epoch and leader address.
    pub role: watch::Sender<RoleInfo>,
    /// The hashes of recent batches (by last seq) for the snapshots written from views.
    /// Locked only while `live` is.
    links: Mutex<VecDeque<(u64, Hash)>>,
    /// Committed batches as they are folded in.
    pub batches: broadcast::Sender<Arc<pb::EventBatch>>,
    recent: Mutex<VecDeque<Arc<pb::EventBatch>>>,
    /// Freshness of the view of etcd.
    pub health: Mutex<Health>,
    /// This replica's id and advertised gRPC address.
    pub replica: String,
    /// Advertised address (what followers forward to).
    pub address: String,
    /// Prometheus metrics.
    pub metrics: crate::metrics::Metrics,
    /// The highest seq folded into the committed state, for waiters.
    pub applied: watch::Sender<u64>,
    /// Where every time-based decision of the replica reads the time.
    pub clock: Arc<dyn Clock>,
}

/// Role plus what goes with it.
#[derive(Debug, Clone)]
pub struct RoleInfo {
    /// Current role.
    pub role: Role,
    /// Leader's epoch as known here (0 = none).
    pub epoch: u64,
    /// Leader's advertised address as known here.
    pub leader: String,
}

impl Shared {
    /// A replica with an empty state, on the system clock.
    pub fn new(replica: String, address: String) -> Arc<Shared> {
        Self::with_clock(replica, address, Arc::new(SystemClock))
    }

    /// A replica with an empty state whose decisions read `clock`.
    pub fn with_clock(replica: String, address: String, clock: Arc<dyn Clock>) -> Arc<Shared> {
        let (role, _) = watch::channel(RoleInfo {
            role: Role::Starting,
            epoch: 0,
            leader: String::new(),
        });
        let (batches, _) = broadcast::channel(1024);
        Arc::new(Shared {
            live: Mutex::new(Follower::new()),
            views: gpuledger_view::Views::new(&Ledger::new()),
            links: Mutex::new(VecDeque::new()),
            folded: AtomicU64::new(0),
            role,
            batches,
            recent: Mutex::new(VecDeque::new()),
            health: Mutex::new(Health::default()),
            replica,
            address,
            metrics: crate::metrics::Metrics::default(),
            applied: watch::channel(0).0,
            clock,
        })
    }

    /// Seq of the last event folded into the committed state.
    pub fn seq(&self) -> u64 {
        self.folded.load(Ordering::SeqCst)
    }

    /// A view of the committed state with every batch folded before the call (read-your-
    /// writes: after [`Shared::wait_applied`]`(seq)`, the view holds `seq`). Never waits for
    /// the fold; may wait for a reader still holding an older view.
    pub async fn view(&self) -> View {
        self.views.current().await
    }

    /// [`Shared::view`] from a blocking thread (`spawn_blocking`), never from an async task.
    pub fn view_blocking(&self) -> View {
        tokio::runtime::Handle::current().block_on(self.view())
    }

    /// Keep publishing views while batches are folded, so that they never lag far behind
    /// even when nobody reads (every [`MAINTAIN_VIEWS_EVERY`]). Runs until the process ends.
    pub async fn maintain_views(&self) {
        self.views.maintain(MAINTAIN_VIEWS_EVERY).await
    }

    /// A short look at the committed state by the fold itself (its own seq checks, the
    /// leader's copy when it takes over). Readers use [`Shared::view`]: this lock is the
    /// fold's.
    pub(crate) fn with_live<T>(&self, f: impl FnOnce(&Ledger) -> T) -> T {
        f(self.live.lock().unwrap_or_else(|p| p.into_inner()).ledger())
    }

    /// Replace the state (after loading a snapshot whose chain hash is `chain_hash`; empty:
    /// unknown, or a state from empty).
    pub async fn reset(&self, l: Ledger, chain_hash: &[u8]) {
        let seq = l.seq();
        self.views.reset(&l).await;
        let mut live = self.live.lock().unwrap_or_else(|p| p.into_inner());
        *live = Follower::resume(l, chain_hash);
        let mut links = self.links.lock().unwrap_or_else(|p| p.into_inner());
        links.clear();
        if let Some(tip) = live.chain().tip() {
            links.push_back((seq, tip));
        }
        drop(links);
        drop(live);
        self.folded.store(seq, Ordering::SeqCst);
        self.applied.send_replace(seq);
        self.recent
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
    }

    /// Fold a committed batch into the state and fan it out. Returns false (and marks the
    /// replica broken) when the batch does not chain or breaks an invariant.
    pub fn apply_committed(&self, batch: pb::EventBatch) -> bool {
        let batch = Arc::new(batch);
        {
            let mut live = self.live.lock().unwrap_or_else(|p| p.into_inner());
            let (seq, chained) = (live.seq(), live.chain().next_seq());
            let followed = live.follow_read(&batch);
            if let Err(e) = &followed
                && !matches!(e, FollowError::Invariant { .. })
            {
                let at = batch.stored.as_ref().map_or("", |s| s.location.as_str());
                let why = match e {
                    FollowError::Unchained { source, .. } => source.to_string(),
                    e => e.to_string(),
                };
                error!(seq = batch.first_seq, at, error = %why, "a committed batch does not chain: this replica stops applying the log");
                self.metrics.chain_breaks.inc();
                self.health.lock().unwrap_or_else(|p| p.into_inner()).broken = Some(format!(
                    "the log's hash chain breaks at seq {} ({at}): {why}",
                    batch.first_seq
                ));
                return false;
            }
            if live.chain().next_seq() > chained
                && let Some(tip) = live.chain().tip()
            {
                let mut links = self.links.lock().unwrap_or_else(|p| p.into_inner());
                links.push_back((live.chain().next_seq() - 1, tip));
                while links.len() > RECENT_BATCHES {
                    links.pop_front();
                }
            }
            for ev in batch
                .events
                .iter()
                .filter(|e| e.seq > seq && e.seq <= live.seq())
            {
                self.metrics.event(ev.body.as_ref());
            }
            // The views follow the fold exactly, up to where it stopped.
            self.views.committed(batch.clone());
            self.folded.store(live.seq(), Ordering::SeqCst);
            if let Err(FollowError::Invariant { seq, source }) = followed {
                error!(seq, error = %source, "committed event breaks an invariant; this replica stops applying the log");
                self.health.lock().unwrap_or_else(|p| p.into_inner()).broken =
                    Some(format!("event {seq} breaks an invariant: {source}"));
                return false;
            }
        }
        if let Some(last) = batch.events.last() {
            self.applied.send_if_modified(|s| {
                let bigger = last.seq > *s;
                *s = (*s).max(last.seq);
                bigger
            });
        }
        {
            let mut r = self.recent.lock().unwrap_or_else(|p| p.into_inner());
            r.push_back(batch.clone());
            while r.len() > RECENT_BATCHES {
                r.pop_front();
            }
        }
        let _ = self.batches.send(batch);
        true
    }

    /// This replica as the actor of the events its leader makes itself.
    pub fn actor(&self) -> pb::Actor {
        pb::Actor {
            role: "allocator".into(),
            name: self.replica.clone(),
            node: String::new(),
            via: String::new(),
        }
    }

    /// The hash of the batch that ended at `seq`, while it is recent (for snapshots).
    pub fn chain_hash_at(&self, seq: u64) -> Option<Hash> {
        let links = self.links.lock().unwrap_or_else(|p| p.into_inner());
        let i = links.partition_point(|(s, _)| *s < seq);
        links.get(i).filter(|(s, _)| *s == seq).map(|(_, h)| *h)
    }

    /// The hash of the last batch folded (None: resumed from a snapshot without one).
    pub fn chain_tip(&self) -> Option<Hash> {
        self.live
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .chain()
            .tip()
    }

    /// Wait (at most `limit`) until this replica has folded `seq`: a client that wrote through
    /// this replica then reads from it sees its own write.
    pub async fn wait_applied(&self, seq: u64, limit: std::time::Duration) {
        let mut rx = self.applied.subscribe();
        let _ = tokio::time::timeout(limit, rx.wait_for(|s| *s >= seq)).await;
    }

    /// Recent committed batches with events after `seq`, if the buffer reaches back that far.
    pub fn recent_after(&self, seq: u64) -> Option<Vec<Arc<pb::EventBatch>>> {
        let r = self.recent.lock().unwrap_or_else(|p| p.into_inner());
        let first = r.front()?.first_seq;
        if seq + 1 < first {
            return None;
        }
        Some(
            r.iter()
                .filter(|b| b.events.last().is_some_and(|e| e.seq > seq))
                .cloned()
                .collect(),
        )
    }

    /// Set role information.
    pub fn set_role(&self, role: Role, epoch: u64, leader: String) {
        self.role.send_replace(RoleInfo {
            role,
            epoch,
            leader,
        });
    }

    /// Current role information.
    pub fn role_info(&self) -> RoleInfo {
        self.role.borrow().clone()
    }

    /// Whether this replica is ready to serve (`/readyz`), and why not: serving, a leader
    /// known, and caught up with the head seq last seen in etcd.
    pub fn readiness(&self) -> Result<(), String> {
        self.serving()?;
        if let Some(members) = self.nospace() {
            return Err(format!(
                "etcd is out of space: its NOSPACE alarm is raised (member {members}) and it \
                 refuses every write; see `gpuledger status` to recover"
            ));
        }
        let role = self.role_info();
        if role.role != Role::Leader && role.leader.is_empty() {
            return Err("no allocator leader is elected right now".into());
        }
        let head = self
            .health
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .head_seq;
        let seq = self.seq();
        if seq < head {
            return Err(format!(
                "catching up with the ledger: at seq {seq}, head is {head}"
            ));
        }
        Ok(())
    }

    /// The etcd members whose NOSPACE alarm is raised, if any.
    pub fn nospace(&self) -> Option<String> {
        self.health
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .nospace
            .clone()
    }

    /// Record whether etcd's NOSPACE alarm is raised (`members`: on which), logging the
    /// change and keeping the metric.
    pub fn set_nospace(&self, members: Option<String>) {
        let mut h = self.health.lock().unwrap_or_else(|p| p.into_inner());
        match (&h.nospace, &members) {
            (None, Some(m)) => tracing::warn!(
                members = %m,
                "etcd is out of space (NOSPACE alarm): every ledger write is refused until an \
                 operator compacts and defragments etcd and disarms the alarm (`gpuledger status`)"
            ),
            (Some(_), None) => tracing::info!("etcd's NOSPACE alarm is cleared: writes resume"),
            _ => {}
        }
        self.metrics.etcd_nospace.set(i64::from(members.is_some()));
        h.nospace = members;
    }

    /// Whether reads and grants may be served, and if not why.
    pub fn serving(&self) -> Result<(), String> {
        let h = self.health.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(b) = &h.broken {
            return Err(format!("ledger unavailable: {b}"));
        }
        if !h.etcd_ok {
            let why = if h.reason.is_empty() {
                "not connected to etcd yet".to_string()
            } else {
                h.reason.clone()
            };
            return Err(format!("ledger unavailable: {why}"));
        }
        if self.role_info().role == Role::Starting {
            return Err("ledger unavailable: replica is still loading the ledger".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
