//! A read-only replica of the ledger, the way kube-scheduler keeps a cache of the cluster:
//! filter and prioritize are answered from it with the allocator's own placement functions,
//! without a gRPC round trip per pod.
//!
//! It follows an allocator replica's `Replicate` stream (a snapshot, then every committed batch,
//! heartbeats), resumes from its last seq after a disconnect, and refuses an epoch lower than
//! the highest it has seen. Every batch must chain onto the one before it (the ledger's hash
//! chain, recomputed here from the batch's bytes, not taken from the allocator's word): a batch
//! that does not is refused, the replica drops its state and answers nothing until a fresh
//! snapshot, so filter and prioritize go to the allocator. It answers only while it has heard from the allocator within
//! `stale_after`; otherwise the caller asks the allocator over gRPC, so correctness never
//! depends on the cache.
//!
//! A stale replica can only make filter or prioritize offer a node that has just filled up:
//! bind still reserves at the allocator (`Reserve`), which decides against the authoritative
//! ledger, so the worst case is a bind failure that the scheduler retries — never a GPU granted
//! twice or beyond its capacity.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;

use backon::{BackoffBuilder, ExponentialBuilder};
use gpuledger_ledger::placement::{Defaults, PodShape, Workload};
use gpuledger_ledger::{FollowError, Followed, Follower, Ledger};
use gpuledger_proto::allocator::v1 as api;
use gpuledger_view::Views;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, instrument, warn};

use crate::allocator::Allocators;
use crate::assume::InFlight;

/// How long an answer waits for the replica to fold this extender's own last write before it
/// asks the allocator instead (the stream delivers a commit within a millisecond or two).
const OWN_WRITES_WAIT: Duration = Duration::from_millis(100);

/// The replica and its freshness. The stream's fold owns the ledger; filter and prioritize
/// read views published from it, so no answer, however long, delays the fold.
pub struct Replica {
    /// Immutable views of the ledger the stream folds.
    views: Views<Ledger>,
    /// Whether the views follow the allocator: false before the first snapshot and from a
    /// refused batch until the next snapshot.
    synced: AtomicBool,
    /// How the allocator places requests, as it last said.
    defaults: ArcSwap<Defaults>,
    /// When the allocator was last heard from (any message): milliseconds after `born`, 0 =
    /// never.
    heard_ms: AtomicU64,
    born: Instant,
    /// The replica's seq, for waiters.
    applied: watch::Sender<u64>,
    /// The highest seq this extender wrote (Reserve, Release): answers wait for it, so a
    /// scheduler sees its own binds as it does with kube-scheduler's assumed pods.
    written: AtomicU64,
    stale_after: Duration,
    metrics: ReplicaMetrics,
    /// Binds in flight, which filter and prioritize count as placed.
    pub in_flight: Arc<InFlight>,
}

#[derive(Default)]
struct ReplicaMetrics {
    seq: Gauge,
    lag: Gauge,
    synced: Gauge,
    chain_breaks: Counter,
    answers: Family<Vec<(&'static str, &'static str)>, Counter>,
}

/// Why a replica stream ended.
#[derive(Debug, thiserror::Error)]
enum StreamEnd {
    /// The allocator ended the stream or could not be reached (retryable: resume).
    #[error("{0}")]
    Broken(String),
    /// What arrived does not fold onto the replica (retryable: start again from a snapshot).
    #[error("{0}")]
    Diverged(String),
    /// A batch that does not chain onto the replica's log (refused; start again from a
    /// snapshot, answering nothing meanwhile).
    #[error("{0}")]
    ChainBroken(String),
}

impl From<FollowError> for StreamEnd {
    fn from(e: FollowError) -> Self {
        if e.breaks_chain() {
            StreamEnd::ChainBroken(e.to_string())
        } else {
            StreamEnd::Diverged(e.to_string())
        }
    }
}

impl Replica {
    /// An empty replica that answers once synced and while heard from within `stale_after`.
    pub fn new(stale_after: Duration) -> Arc<Replica> {
        Arc::new(Replica {
            views: Views::new(&Ledger::new()),
            synced: AtomicBool::new(false),
            defaults: ArcSwap::from_pointee(Defaults::default()),
            heard_ms: AtomicU64::new(0),
            born: Instant::now(),
            applied: watch::channel(0).0,
            written: AtomicU64::new(0),
            stale_after,
            metrics: ReplicaMetrics::default(),
            in_flight: InFlight::new(),
        })
    }

    /// Export the replica's seq, lag and sync state, and which source answered each verb.
    pub fn register(&self, r: &mut Registry) {
        let m = &self.metrics;
        r.register(
            "replica_seq",
            "Ledger seq folded into the extender's replica",
            m.seq.clone(),
        );
        r.register(
            "replica_lag_seq",
            "How far the replica is behind the allocator it follows (seqs, at the last heartbeat)",
            m.lag.clone(),
        );
        r.register(
            "replica_synced",
            "1 while the replica follows the allocator and answers filter and prioritize, 0 while they go to the allocator",
            m.synced.clone(),
        );
        r.register(
            "replica_chain_breaks",
            "Batches the replica refused because they did not chain onto its log (each drops the replica's state)",
            m.chain_breaks.clone(),
        );
        r.register(
            "answers",
            "Filter and prioritize answers by source (replica or allocator)",
            m.answers.clone(),
        );
        r.register(
            "filtered_pods_unverified",
            "Filtered pods not counted as binds in flight: the API server does not have them as filter described them (made up), or all checks were busy",
            self.in_flight.unverified().clone(),
        );
        for verb in ["filter", "prioritize"] {
            for source in ["replica", "allocator"] {
                let _ = m
                    .answers
                    .get_or_create(&vec![("verb", verb), ("source", source)]);
            }
        }
    }

    /// Remember that this extender wrote `seq`: later answers reflect it.
    pub fn note_write(&self, seq: u64) {
        self.written.fetch_max(seq, Ordering::Relaxed);
    }

    /// Run `f` on the replica if it is fresh and has folded this extender's own writes
    /// (waiting up to [`OWN_WRITES_WAIT`] for them); None when the caller must ask the
    /// allocator, also when `f` says so.
    pub async fn read<T>(
        &self,
        verb: &'static str,
        f: impl FnOnce(&Ledger, &Defaults) -> Option<T>,
    ) -> Option<T> {
        let want = self.written.load(Ordering::Relaxed);
        if *self.applied.borrow() < want {
            let mut rx = self.applied.subscribe();
            let _ = tokio::time::timeout(OWN_WRITES_WAIT, rx.wait_for(|s| *s >= want)).await;
        }
        let out = if self.synced.load(Ordering::Acquire) && self.fresh() {
            let v = self.views.at_least(|l| l.seq() >= want).await;
            (v.seq() >= want)
                .then(|| f(&v, &self.defaults.load()))
                .flatten()
        } else {
            None
        };
        let source = if out.is_some() {
            "replica"
        } else {
            "allocator"
        };
        self.metrics
            .answers
            .get_or_create(&vec![("verb", verb), ("source", source)])
            .inc();
        self.metrics.synced.set(i64::from(out.is_some()));
        out
    }

    /// Wait up to `timeout` for the replica to fold a state in which `done` holds; whether it
    /// did.
    pub async fn wait_for(&self, timeout: Duration, done: impl Fn(&Ledger) -> bool) -> bool {
        let mut rx = self.applied.subscribe();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            rx.borrow_and_update();
            if done(&*self.views.current().await) {
                return true;
            }
            match tokio::time::timeout_at(deadline, rx.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) | Err(_) => return false,
            }
        }
    }

    /// Whether the allocator was heard from within `stale_after`.
    fn fresh(&self) -> bool {
        let heard = self.heard_ms.load(Ordering::Relaxed);
        heard > 0
            && self.born.elapsed().as_millis() as u64 <= heard + self.stale_after.as_millis() as u64
    }

    /// The seq of the published view (0 while not synced).
    pub fn seq(&self) -> u64 {
        if self.synced.load(Ordering::Acquire) {
            self.views.latest().seq()
        } else {
            0
        }
    }

    /// Follow the allocators until `shutdown`: snapshot, batches, resume after a break; the
    /// views are published as soon as a batch is folded.
    pub async fn follow(self: Arc<Self>, allocators: Allocators, shutdown: CancellationToken) {
        let publish = self.views.maintain(Duration::ZERO);
        shutdown
            .run_until_cancelled(async { tokio::join!(self.follow_forever(allocators), publish) })
            .await;
    }

    #[instrument(name = "ledger_replica", skip_all)]
    async fn follow_forever(&self, allocators: Allocators) {
        // 100 ms after a stream that ended cleanly, doubling to 2 s while they keep breaking.
        let backoff = ExponentialBuilder::new()
            .with_min_delay(Duration::from_millis(100))
            .with_max_delay(Duration::from_secs(2))
            .without_max_times();
        let mut delays = backoff.build();
        let mut max_epoch = 0u64;
        // The ledger and its hash chain; None until the first snapshot.
        let mut follower: Option<Follower> = None;
        loop {
            let from = follower.as_ref().map_or(0, Follower::seq);
            let end = self
                .stream(&allocators, from, &mut follower, &mut max_epoch)
                .await;
            self.metrics.synced.set(0);
            match end {
                Err(StreamEnd::Diverged(why)) => {
                    warn!(error = %why, "the ledger replica diverged; starting again from a snapshot");
                    self.drop_state(&mut follower);
                }
                Err(StreamEnd::ChainBroken(why)) => {
                    error!(error = %why, "the ledger replica refused a batch that breaks the hash chain; filter and prioritize go to the allocator until a snapshot chains again");
                    self.metrics.chain_breaks.inc();
                    self.drop_state(&mut follower);
                }
                Err(StreamEnd::Broken(why)) => {
                    warn!(error = %why, seq = from, "ledger replica stream broken; resuming");
                }
                Ok(()) => delays = backoff.build(),
            }
            let pause = delays.next().unwrap_or(Duration::from_secs(2));
            tokio::time::sleep(pause).await;
        }
    }

    fn drop_state(&self, follower: &mut Option<Follower>) {
        self.synced.store(false, Ordering::Release);
        *follower = None;
    }

    /// One stream, until it ends, folding into `follower`.
    async fn stream(
        &self,
        allocators: &Allocators,
        from: u64,
        follower: &mut Option<Follower>,
        max_epoch: &mut u64,
    ) -> Result<(), StreamEnd> {
        let mut s = allocators
            .call("Replicate", |mut c| async move {
                c.replicate(api::ReplicateRequest { from_seq: from }).await
            })
            .await
            .map_err(|s| StreamEnd::Broken(s.message().to_string()))?;
        // Heartbeats come twice a second; silence this long means a dead peer.
        let silence = self.stale_after.max(Duration::from_secs(2));
        loop {
            let msg = match tokio::time::timeout(silence, s.message()).await {
                Err(_) => return Err(StreamEnd::Broken(format!("no message in {silence:?}"))),
                Ok(Err(st)) => return Err(StreamEnd::Broken(st.message().to_string())),
                Ok(Ok(None)) => return Ok(()),
                Ok(Ok(Some(m))) => m,
            };
            self.fold(msg, follower, max_epoch).await?;
        }
    }

    /// Fold one message of the stream into `follower` and publish what changed.
    async fn fold(
        &self,
        msg: api::ReplicateResponse,
        follower: &mut Option<Follower>,
        max_epoch: &mut u64,
    ) -> Result<(), StreamEnd> {
        use api::replicate_response::Body;
        let now = self.born.elapsed().as_millis() as u64;
        self.heard_ms.store(now.max(1), Ordering::Relaxed);
        self.metrics.synced.set(i64::from(follower.is_some()));
        match msg.body {
            Some(Body::Placement(p)) => {
                let policy = p.default_policy.parse().unwrap_or_default();
                // The shares of the cluster that can host each shape, from this replica's
                // nodes (the allocator's own, as of the last batch folded).
                let workload = (!p.workload.is_empty()).then(|| {
                    let w = workload_of(p);
                    Arc::new(match follower {
                        Some(f) => w.on_cluster(f.ledger().nodes().values()),
                        None => w,
                    })
                });
                self.defaults.store(Arc::new(Defaults { policy, workload }));
            }
            Some(Body::Snapshot(snap)) => {
                if snap.epoch < *max_epoch {
                    // An allocator replica that has not seen the latest leader yet.
                    return Err(StreamEnd::Broken(format!(
                        "snapshot of epoch {} after epoch {max_epoch}",
                        snap.epoch
                    )));
                }
                let f = Follower::from_snapshot(&snap)?;
                let l = f.ledger();
                self.views.reset(l).await;
                self.synced.store(true, Ordering::Release);
                info!(
                    seq = l.seq(),
                    epoch = l.epoch(),
                    nodes = l.nodes().len(),
                    "ledger replica loaded a snapshot"
                );
                self.metrics.seq.set(l.seq() as i64);
                self.applied.send_replace(l.seq());
                *max_epoch = l.epoch();
                // The placement defaults come before the first snapshot: learn the
                // workload's hosts now that the nodes are known.
                let d = self.defaults.load_full();
                if let Some(w) = &d.workload {
                    let w = Workload::clone(w).on_cluster(l.nodes().values());
                    self.defaults.store(Arc::new(Defaults {
                        policy: d.policy,
                        workload: Some(Arc::new(w)),
                    }));
                }
                *follower = Some(f);
            }
            Some(Body::Batch(mut b)) => {
                let Some(f) = follower.as_mut() else {
                    return Err(StreamEnd::Diverged("a batch before any snapshot".into()));
                };
                if let Followed::Folded { .. } = f.follow_received(&mut b)? {
                    self.views.committed(Arc::new(b));
                }
                let l = f.ledger();
                *max_epoch = l.epoch();
                self.metrics.seq.set(l.seq() as i64);
                self.applied.send_replace(l.seq());
            }
            Some(Body::Heartbeat(h)) => {
                let seq = follower.as_ref().map_or(0, Follower::seq);
                self.metrics.lag.set(h.seq.saturating_sub(seq) as i64);
            }
            None => {}
        }
        Ok(())
    }
}

fn workload_of(p: api::PlacementDefaults) -> Workload {
    Workload::from_counts(
        p.workload.into_iter().map(|s| {
            (
                PodShape {
                    cpu_milli: s.cpu_milli,
                    memory_mib: s.memory_mib,
                    gpus: s.gpus,
                    core_milli: s.core_milli,
                    models: s.models,
                },
                s.count,
            )
        }),
        1.0,
    )
}

#[cfg(test)]
mod tests;
