//! Immutable views of the committed state, published off the commit path.
//!
//! The fold (the sequencer, or a follower's tail) owns the committed state and never waits
//! for a reader. Readers get an [`Arc`]-held, immutable [`Ledger`] that includes every batch
//! folded before they asked. Views are published lazily — when a reader needs a newer one,
//! or by [`Views::maintain`] every [`MAINTAIN_EVERY`] — by replaying the batches committed
//! since onto a second copy (left-right): the two copies take turns being published, and
//! the one not published is brought up to date once its last reader lets go. No view is
//! ever cloned from the state the fold owns, so publishing costs the fold nothing.
//!
//! Why this and not another way (measured with `gpuledger-bench replay`, see the commit that
//! brought it): a full copy of the ledger at 5,000 nodes × 8 GPUs and 100,000 allocations
//! takes tens of milliseconds and ~100 MiB, too slow to make per batch or under the fold's
//! lock; persistent maps (`imbl`) make a copy O(1) but fold ~45 % slower, below the 2 M
//! events/s the fold must keep, and far slower while a view is held.

use std::collections::VecDeque;
use std::ops::Deref;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use gpuledger_ledger::{Ledger, pb};
use tokio::sync::Notify;
use tracing::debug;

/// How often [`Views::maintain`] publishes when nobody asked (bounds the replay backlog).
pub const MAINTAIN_EVERY: Duration = Duration::from_millis(100);

/// An immutable view of the committed state. Hold it only as long as the read needs: a
/// view held across two publications makes the next one wait for it.
pub struct View {
    ledger: Arc<Ledger>,
    released: Arc<Notify>,
}

impl Deref for View {
    type Target = Ledger;
    fn deref(&self) -> &Ledger {
        &self.ledger
    }
}

impl Drop for View {
    fn drop(&mut self) {
        self.released.notify_waiters();
    }
}

impl std::fmt::Debug for View {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("View")
            .field("seq", &self.ledger.seq())
            .finish()
    }
}

/// The published view, the copy that takes its turn next, and the batches between.
pub struct Views {
    published: ArcSwap<Ledger>,
    /// Whoever publishes holds this (readers and the maintainer, never the fold).
    builder: tokio::sync::Mutex<Builder>,
    /// Committed batches not yet in both copies, oldest first.
    backlog: Mutex<VecDeque<Arc<pb::EventBatch>>>,
    released: Arc<Notify>,
}

struct Builder {
    /// The copy published before the current one (None after a reset: cloned when needed).
    spare: Option<Arc<Ledger>>,
}

impl Views {
    /// Views of `ledger` (two copies of it).
    pub fn new(ledger: &Ledger) -> Self {
        Views {
            published: ArcSwap::from_pointee(ledger.clone()),
            builder: tokio::sync::Mutex::new(Builder {
                spare: Some(Arc::new(ledger.clone())),
            }),
            backlog: Mutex::new(VecDeque::new()),
            released: Arc::new(Notify::new()),
        }
    }

    /// A batch the fold just applied: it goes into the views when they are next published.
    pub fn committed(&self, batch: Arc<pb::EventBatch>) {
        self.backlog
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push_back(batch);
    }

    /// Start over from `ledger` (a snapshot was loaded): forget the backlog and both copies.
    pub async fn reset(&self, ledger: &Ledger) {
        let mut b = self.builder.lock().await;
        self.backlog
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
        self.published.store(Arc::new(ledger.clone()));
        b.spare = None;
    }

    /// The newest published view, whatever its seq.
    pub fn latest(&self) -> View {
        View {
            ledger: self.published.load_full(),
            released: self.released.clone(),
        }
    }

    /// A view at `seq` or later: the published one if it is, else a newer one published now.
    /// The fold must have folded `seq` already (its batches are in the backlog).
    pub async fn at_least(&self, seq: u64) -> View {
        let v = self.latest();
        if v.seq() >= seq {
            return v;
        }
        drop(v);
        let mut b = self.builder.lock().await;
        let v = self.latest();
        if v.seq() >= seq {
            return v;
        }
        drop(v);
        self.publish(&mut b).await;
        self.latest()
    }

    /// Publish every batch in the backlog (called by whoever holds the builder).
    async fn publish(&self, b: &mut Builder) {
        let mut next = match b.spare.take() {
            Some(s) => s,
            // After a reset: the only other copy is the published one.
            None => Arc::new(Ledger::clone(&self.published.load())),
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
        let l = Arc::get_mut(&mut next).expect("no reader holds the spare any more");
        let batches: Vec<Arc<pb::EventBatch>> = {
            let backlog = self.backlog.lock().unwrap_or_else(|p| p.into_inner());
            backlog
                .iter()
                .filter(|b| b.events.last().is_some_and(|e| e.seq > l.seq()))
                .cloned()
                .collect()
        };
        'replay: for batch in &batches {
            for ev in &batch.events {
                if ev.seq <= l.seq() {
                    continue;
                }
                // The fold applied the same events and reported any that broke an invariant;
                // a view stops where the fold stopped.
                if let Err(e) = l.apply(ev) {
                    debug!(seq = ev.seq, error = %e, "a view stops at the event the fold refused");
                    break 'replay;
                }
            }
        }
        let old = self.published.swap(next);
        // Both copies now hold everything up to the older one's seq: that much can go.
        let both = old.seq();
        b.spare = Some(old);
        let mut backlog = self.backlog.lock().unwrap_or_else(|p| p.into_inner());
        while backlog
            .front()
            .is_some_and(|f| f.events.last().is_none_or(|e| e.seq <= both))
        {
            backlog.pop_front();
        }
    }

    /// Publish every [`MAINTAIN_EVERY`] while views lag `folded`, so the backlog stays short
    /// even when nobody reads. Runs until the process ends.
    pub async fn maintain(&self, folded: impl Fn() -> u64) {
        let mut tick = tokio::time::interval(MAINTAIN_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let seq = folded();
            if self.published.load().seq() < seq {
                drop(self.at_least(seq).await);
            }
        }
    }
}

#[cfg(test)]
mod tests;
