//! The one runtime of the allocator's Kubernetes controllers (pods and nodes, GPUBudgets,
//! ResourceClaims, the preemption's sweep): what kube-runtime's `Controller` gives a
//! controller, shaped to the ledger's write path. A controller is a pure plan (`plan.rs`
//! beside it) and a thin reader; this module owns the rest, once:
//!
//! - **leadership**: one check, the [`Writer`]'s ([`Runtime::leading`]): a controller acts
//!   only while this replica's sequencer takes writes, and every replica watches;
//! - **the periodic full pass** ([`Runtime::passes`]): on the leader, at once on each election,
//!   at every interval, and whenever the controller's watch nudges it;
//! - **queue and concurrency** ([`queue::Queue`], [`Runtime::workers`]): a bounded queue of
//!   keys, each at most once and never in two workers' hands, drained by a fixed number of
//!   workers whose writes share the sequencer's group commit;
//! - **the write-error policy** ([`Runtime::write`]): one mapping of [`WriteError`] to what the
//!   controller does next, logged once.
//!
//! Why not kube-runtime's `Controller` itself: see docs/allocator.md, "One controller runtime".

pub mod queue;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use gpuledger_ledger::{Command, CommandError};
use tokio::sync::{Notify, watch};
use tokio::task::JoinSet;
use tokio::time::Interval;
use tracing::{debug, info, warn};

use self::queue::Queue;
use crate::shared::{RoleInfo, Shared};
use crate::writer::{Committed, WriteError, Writer};

/// What a controller does with a write the ledger did not commit: the one policy, decided by
/// [`next_after`] for every controller.
#[derive(Debug, Clone, PartialEq)]
pub enum Unwritten {
    /// This replica does not lead (any more): the work is dropped here; the leader's own
    /// watch and its full pass at election do it.
    Dropped,
    /// The ledger refused the command against its state: nothing was written, and writing it
    /// again would be refused again. The controller's plan says what follows (a `Refused`
    /// condition, a GPUBudget's status, nothing).
    Refused(CommandError),
    /// No answer (etcd failed, leadership ended mid-write) or an event the sequencer would not
    /// write: nothing is known to be written; the work is tried again at its next change or
    /// the next full pass, never in a loop here.
    Later(String),
}

/// The write-error policy: what a controller does after `e`.
pub fn next_after(e: WriteError) -> Unwritten {
    match e {
        WriteError::NotLeader => Unwritten::Dropped,
        WriteError::Refused(e) => Unwritten::Refused(e),
        e @ (WriteError::InvalidEvent(_) | WriteError::Unavailable(_)) => {
            Unwritten::Later(e.to_string())
        }
    }
}

/// What a full pass is told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pass {
    /// The epoch this replica leads in.
    pub epoch: u64,
    /// The first pass of this leadership (state kept for a previous one is stale).
    pub elected: bool,
}

/// The runtime one controller runs on (cheap to clone).
#[derive(Clone)]
pub struct Runtime {
    /// The controller's name, in logs.
    name: &'static str,
    shared: Arc<Shared>,
    writer: Writer,
}

impl Runtime {
    /// The runtime of controller `name`, writing through `writer`.
    pub fn new(name: &'static str, shared: Arc<Shared>, writer: Writer) -> Self {
        Runtime {
            name,
            shared,
            writer,
        }
    }

    /// The runtime of another controller `name` of the same replica.
    pub fn named(&self, name: &'static str) -> Self {
        Runtime {
            name,
            ..self.clone()
        }
    }

    /// Whether this replica leads: its sequencer takes writes. The one leader check of every
    /// controller.
    pub fn leading(&self) -> bool {
        self.writer.leading()
    }

    /// Write `cmd` (described by `what` in logs) as this replica's own decision ([`write`]).
    pub async fn write(&self, cmd: Command, what: &str) -> Result<Committed, Unwritten> {
        write(self.name, &self.writer, cmd, what).await
    }

    /// The clock of a controller's full passes: [`Passes::next`] returns on the leader, at
    /// once when this replica is elected, at every `every`, and whenever `nudge` is notified
    /// (a change the controller's watch saw); a follower's ticks return nothing.
    pub fn pass_clock(&self, every: Duration, nudge: Option<Arc<Notify>>) -> Passes {
        let mut tick = tokio::time::interval(every.max(Duration::from_millis(10)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        Passes {
            rt: self.clone(),
            role: self.shared.role.subscribe(),
            tick,
            nudge,
            led: 0,
        }
    }

    /// Run `pass` at every pass of [`Runtime::pass_clock`], one at a time, until the replica
    /// shuts down.
    pub async fn passes<F, Fut>(self, every: Duration, nudge: Option<Arc<Notify>>, mut pass: F)
    where
        F: FnMut(Pass) -> Fut,
        Fut: Future<Output = ()>,
    {
        let mut clock = self.pass_clock(every, nudge);
        while let Some(p) = clock.next().await {
            pass(p).await;
        }
    }

    /// Start `n` workers on `tasks`, each taking a key from `queue` and running `work` on it
    /// while this replica leads (a key taken on a follower is let go).
    pub fn workers<K, F, Fut>(
        &self,
        tasks: &mut JoinSet<()>,
        n: usize,
        queue: Arc<Queue<K>>,
        work: F,
    ) where
        K: Clone + Eq + std::hash::Hash + Send + 'static,
        F: Fn(K) -> Fut + Clone + Send + 'static,
        Fut: Future<Output = ()> + Send,
    {
        for _ in 0..n {
            let (rt, queue, work) = (self.clone(), queue.clone(), work.clone());
            tasks.spawn(async move {
                loop {
                    let key = queue.pop().await;
                    if rt.leading() {
                        work(key.clone()).await;
                    }
                    queue.done(&key);
                }
            });
        }
    }
}

/// See [`Runtime::pass_clock`].
pub struct Passes {
    rt: Runtime,
    role: watch::Receiver<RoleInfo>,
    tick: Interval,
    nudge: Option<Arc<Notify>>,
    /// The epoch of the last pass.
    led: u64,
}

impl Passes {
    /// Wait for the next full pass this replica leads; None once the replica shuts down.
    pub async fn next(&mut self) -> Option<Pass> {
        loop {
            let nudge = self.nudge.clone();
            tokio::select! {
                _ = self.tick.tick() => {}
                changed = self.role.changed() => changed.ok()?,
                _ = async {
                    match nudge {
                        Some(n) => n.notified().await,
                        None => std::future::pending().await,
                    }
                } => {}
            }
            if !self.rt.leading() {
                continue;
            }
            let epoch = self.rt.shared.role_info().epoch;
            let elected = epoch != self.led;
            if elected {
                self.led = epoch;
                info!(controller = self.rt.name, epoch, "leading: full pass");
            }
            return Some(Pass { epoch, elected });
        }
    }
}

/// Write `cmd` (described by `what` in logs) through `writer` as controller `controller`'s
/// decision; what did not commit is mapped by [`next_after`] and logged here, once.
pub async fn write(
    controller: &'static str,
    writer: &Writer,
    cmd: Command,
    what: &str,
) -> Result<Committed, Unwritten> {
    match writer.submit(cmd).await {
        Ok(c) => {
            info!(
                controller,
                what,
                seq = c.seq,
                epoch = c.epoch,
                "ledger updated"
            );
            Ok(c)
        }
        Err(e) => {
            let next = next_after(e);
            match &next {
                Unwritten::Dropped => {
                    debug!(controller, what, "not the leader: left to the leader")
                }
                Unwritten::Refused(e) => {
                    info!(controller, what, error = %e, "the ledger refused it")
                }
                Unwritten::Later(e) => warn!(
                    controller, what, error = %e,
                    "not written; tried again at the next change or pass"
                ),
            }
            Err(next)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_write_error_has_one_next_step() {
        assert_eq!(next_after(WriteError::NotLeader), Unwritten::Dropped);
        assert!(matches!(
            next_after(WriteError::Refused(CommandError::Invalid("x".into()))),
            Unwritten::Refused(CommandError::Invalid(_))
        ));
        assert!(matches!(
            next_after(WriteError::Unavailable("etcd".into())),
            Unwritten::Later(m) if m == "etcd"
        ));
    }
}
