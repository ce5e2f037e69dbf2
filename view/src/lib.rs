//! Read-mostly state published as immutable snapshots.
//!
//! One owner folds changes into its state (an allocator replica's sequencer or tail, the
//! extender's replica stream, the node agent's subscription) and never waits for a reader.
//! Readers get an [`Arc`]-held, immutable [`View`] and never wait for the fold. Views are
//! published by replaying the committed changes onto a second copy (left-right): the two copies
//! take turns being published, and the one not published is brought up to date once its last
//! reader lets go. No view is cloned from the state the fold owns, so publishing costs the fold
//! one push onto a queue; whoever publishes (a reader that needs a newer view, or
//! [`Views::maintain`]) does the replay.
//!
//! Why this and not another way (measured with `gpuledger-bench replay`): a full copy of the
//! ledger at 5,000 nodes × 8 GPUs and 100,000 allocations takes tens of milliseconds and
//! ~100 MiB, too slow to make per batch; persistent maps (`imbl`) make a copy O(1) but fold
//! ~45 % slower, below the 2 M events/s the fold must keep, and far slower while a view is held.

use std::collections::VecDeque;
use std::ops::Deref;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use gpuledger_ledger::{Ledger, pb};
use tokio::sync::Notify;
use tracing::debug;

/// State whose copies follow the fold by replaying what it committed.
pub trait Replay: Clone + Send + Sync + 'static {
    /// One change as the fold committed it.
    type Change: Send + Sync + 'static;

    /// Apply `change` to this copy exactly as the fold applied it to its own state.
    fn replay(&mut self, change: &Self::Change);
}

/// A copy of the state with the number of changes replayed into it.
#[derive(Clone)]
struct Copy<S> {
    state: S,
    changes: u64,
}

/// An immutable view of the state. Hold it only as long as the read needs: a view held
/// across two publications makes the next one wait for it.
pub struct View<S: Replay> {
    copy: Arc<Copy<S>>,
    released: Arc<Notify>,
}

impl<S: Replay> Deref for View<S> {
    type Target = S;
    fn deref(&self) -> &S {
        &self.copy.state
    }
}

impl<S: Replay> Drop for View<S> {
    fn drop(&mut self) {
        self.released.notify_waiters();
    }
}

impl<S: Replay> std::fmt::Debug for View<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("View")
            .field("changes", &self.copy.changes)
            .finish_non_exhaustive()
    }
}

/// The published view, the copy that takes its turn next, and the changes between.
pub struct Views<S: Replay> {
    published: ArcSwap<Copy<S>>,
    /// The copy published before the current one (None after a reset: cloned when needed).
    /// Whoever publishes holds this lock (readers and the maintainer, never the fold).
    spare: tokio::sync::Mutex<Option<Arc<Copy<S>>>>,
    /// Committed changes not yet in both copies, oldest first, by number.
    backlog: Mutex<VecDeque<(u64, Arc<S::Change>)>>,
    /// How many changes were committed.
    committed: AtomicU64,
    released: Arc<Notify>,
    /// A change was committed ([`Views::maintain`] publishes it).
    changed: Notify,
}

impl<S: Replay> Views<S> {
    /// Views of `state` (two copies of it).
    pub fn new(state: &S) -> Self {
        let copy = Copy {
            state: state.clone(),
            changes: 0,
        };
        Views {
            published: ArcSwap::from_pointee(copy.clone()),
            spare: tokio::sync::Mutex::new(Some(Arc::new(copy))),
            backlog: Mutex::new(VecDeque::new()),
            committed: AtomicU64::new(0),
            released: Arc::new(Notify::new()),
            changed: Notify::new(),
        }
    }

    /// A change the fold just applied to its own state: it goes into the views when they are
    /// next published. Never waits for a reader.
    pub fn committed(&self, change: Arc<S::Change>) {
        let mut backlog = self.backlog.lock().unwrap_or_else(|p| p.into_inner());
        let n = self.committed.load(Ordering::Relaxed) + 1;
        backlog.push_back((n, change));
        self.committed.store(n, Ordering::Release);
        drop(backlog);
        self.changed.notify_one();
    }

    /// Start over from `state` (the fold replaced its own, from a snapshot): forget the
    /// backlog and both copies.
    pub async fn reset(&self, state: &S) {
        let mut spare = self.spare.lock().await;
        let mut backlog = self.backlog.lock().unwrap_or_else(|p| p.into_inner());
        backlog.clear();
        self.published.store(Arc::new(Copy {
            state: state.clone(),
            changes: self.committed.load(Ordering::Acquire),
        }));
        *spare = None;
    }

    /// The newest published view, whatever it lacks.
    pub fn latest(&self) -> View<S> {
        View {
            copy: self.published.load_full(),
            released: self.released.clone(),
        }
    }

    /// A view with every change committed before the call (read-your-writes): the published
    /// one if it has them, else a newer one published now.
    pub async fn current(&self) -> View<S> {
        let n = self.committed.load(Ordering::Acquire);
        let v = self.latest();
        if v.copy.changes >= n {
            return v;
        }
        drop(v);
        let mut spare = self.spare.lock().await;
        let v = self.latest();
        if v.copy.changes >= n {
            return v;
        }
        drop(v);
        self.publish(&mut spare).await;
        self.latest()
    }

    /// The published view if `enough` says it will do, else [`Views::current`].
    pub async fn at_least(&self, enough: impl FnOnce(&S) -> bool) -> View<S> {
        let v = self.latest();
        if enough(&v) {
            return v;
        }
        drop(v);
        self.current().await
    }

    /// How many committed changes are not in both copies yet.
    pub fn backlog(&self) -> usize {
        self.backlog.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Publish every change in the backlog (called by whoever holds the spare's lock).
    async fn publish(&self, spare: &mut Option<Arc<Copy<S>>>) {
        let mut next = match spare.take() {
            Some(s) => s,
            // After a reset: the only other copy is the published one.
            None => Arc::new(Copy::clone(&self.published.load())),
        };
        // The spare may still be read by someone who took it before the last publication.
        loop {
            let released = self.released.notified();
            if Arc::get_mut(&mut next).is_some() {
                break;
            }
            released.await;
        }
        // Nobody can take a new reference to the spare: it is not published.
        let copy = Arc::get_mut(&mut next).expect("no reader holds the spare any more");
        let changes: Vec<(u64, Arc<S::Change>)> = {
            let backlog = self.backlog.lock().unwrap_or_else(|p| p.into_inner());
            backlog
                .iter()
                .filter(|(n, _)| *n > copy.changes)
                .cloned()
                .collect()
        };
        for (n, c) in &changes {
            copy.state.replay(c);
            copy.changes = *n;
        }
        let old = self.published.swap(next);
        // Both copies now hold everything up to the older one's changes: that much can go.
        let both = old.changes;
        *spare = Some(old);
        let mut backlog = self.backlog.lock().unwrap_or_else(|p| p.into_inner());
        while backlog.front().is_some_and(|(n, _)| *n <= both) {
            backlog.pop_front();
        }
    }

    /// Keep publishing while the views lag the fold, so that they never lag far and the
    /// backlog stays short even when nobody reads: every `every`, or (zero) as soon as a change
    /// is committed. Runs until the process ends.
    pub async fn maintain(&self, every: Duration) {
        let mut tick = (!every.is_zero()).then(|| {
            let mut t = tokio::time::interval(every);
            t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            t
        });
        loop {
            match tick.as_mut() {
                Some(t) => {
                    t.tick().await;
                }
                None => self.changed.notified().await,
            }
            if self.published.load().changes < self.committed.load(Ordering::Acquire) {
                drop(self.current().await);
            }
        }
    }
}

/// The ledger's copies follow the log batch by batch.
impl Replay for Ledger {
    type Change = pb::EventBatch;

    fn replay(&mut self, batch: &pb::EventBatch) {
        for ev in &batch.events {
            if ev.seq <= self.seq() {
                continue;
            }
            // The fold applied the same events and reported any that broke an invariant; a
            // copy stops where the fold stopped.
            if let Err(e) = self.apply(ev) {
                debug!(seq = ev.seq, error = %e, "a view stops at the event the fold refused");
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests;
