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

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use backon::{BackoffBuilder, ExponentialBuilder};
use gpuledger_ledger::chain::{Chain, hash_stored, short_hex};
use gpuledger_ledger::placement::{PodShape, Workload};
use gpuledger_ledger::{Ledger, PodRequest, Policy, pb};
use gpuledger_proto::allocator::v1 as api;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use prost::Message;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, instrument, warn};

use crate::allocator::Allocators;
use crate::assume::InFlight;

/// How long an answer waits for the replica to fold this extender's own last write before it
/// asks the allocator instead (the stream delivers a commit within a millisecond or two).
const OWN_WRITES_WAIT: Duration = Duration::from_millis(100);

/// How the allocator places requests that name no policy, and the FGD workload it learned.
#[derive(Default)]
pub struct Defaults {
    /// The allocator's policy for requests that name none.
    pub policy: Policy,
    /// The allocator's learned FGD workload (None = the prior).
    pub workload: Option<Arc<Workload>>,
}

impl Defaults {
    /// Decode a request as the allocator would: its default policy and FGD workload applied.
    pub fn request(&self, r: api::PodRequest) -> Result<PodRequest, String> {
        let mut pr = PodRequest::from_pb(r, self.policy)?;
        if pr.policy.is_fgd() {
            pr.workload.clone_from(&self.workload);
        }
        Ok(pr)
    }
}

struct Inner {
    /// None until the first snapshot.
    ledger: Option<Ledger>,
    /// The hash chain's end at the ledger's seq (None with the ledger).
    chain: Option<Chain>,
    defaults: Defaults,
    /// When the allocator was last heard from (any message).
    heard: Option<Instant>,
}

/// The replica and its freshness.
pub struct Replica {
    inner: RwLock<Inner>,
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

impl Replica {
    /// An empty replica that answers once synced and while heard from within `stale_after`.
    pub fn new(stale_after: Duration) -> Arc<Replica> {
        Arc::new(Replica {
            inner: RwLock::new(Inner {
                ledger: None,
                chain: None,
                defaults: Defaults::default(),
                heard: None,
            }),
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
        let g = self.inner.read().unwrap_or_else(|p| p.into_inner());
        let fresh = g.heard.is_some_and(|t| t.elapsed() <= self.stale_after);
        let out = match (&g.ledger, fresh) {
            (Some(l), true) if l.seq() >= want => f(l, &g.defaults),
            _ => None,
        };
        drop(g);
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

    /// The replica's seq (0 before the first snapshot).
    pub fn seq(&self) -> u64 {
        let g = self.inner.read().unwrap_or_else(|p| p.into_inner());
        g.ledger.as_ref().map_or(0, Ledger::seq)
    }

    /// Follow the allocators until `shutdown`: snapshot, batches, resume after a break.
    pub async fn follow(self: Arc<Self>, allocators: Allocators, shutdown: CancellationToken) {
        shutdown
            .run_until_cancelled(self.follow_forever(allocators))
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
        loop {
            let from = self.seq();
            let end = self.stream(&allocators, from, &mut max_epoch).await;
            self.metrics.synced.set(0);
            match end {
                Err(StreamEnd::Diverged(why)) => {
                    warn!(error = %why, "the ledger replica diverged; starting again from a snapshot");
                    self.drop_state();
                }
                Err(StreamEnd::ChainBroken(why)) => {
                    error!(error = %why, "the ledger replica refused a batch that breaks the hash chain; filter and prioritize go to the allocator until a snapshot chains again");
                    self.metrics.chain_breaks.inc();
                    self.drop_state();
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

    fn drop_state(&self) {
        let mut g = self.inner.write().unwrap_or_else(|p| p.into_inner());
        g.ledger = None;
        g.chain = None;
    }

    /// One stream, until it ends.
    async fn stream(
        &self,
        allocators: &Allocators,
        from: u64,
        max_epoch: &mut u64,
    ) -> Result<(), StreamEnd> {
        use api::replicate_response::Body;
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
            let mut g = self.inner.write().unwrap_or_else(|p| p.into_inner());
            g.heard = Some(Instant::now());
            self.metrics.synced.set(i64::from(g.ledger.is_some()));
            match msg.body {
                Some(Body::Placement(p)) => {
                    let policy = p.default_policy.parse().unwrap_or_default();
                    // The shares of the cluster that can host each shape, from this replica's
                    // nodes (the allocator's own, as of the last batch folded).
                    let workload = (!p.workload.is_empty()).then(|| {
                        let w = workload_of(p);
                        Arc::new(match &g.ledger {
                            Some(l) => w.on_cluster(l.nodes().values()),
                            None => w,
                        })
                    });
                    g.defaults = Defaults { policy, workload };
                }
                Some(Body::Snapshot(snap)) => {
                    if snap.epoch < *max_epoch {
                        // An allocator replica that has not seen the latest leader yet.
                        return Err(StreamEnd::Broken(format!(
                            "snapshot of epoch {} after epoch {max_epoch}",
                            snap.epoch
                        )));
                    }
                    let l = Ledger::from_snapshot(&snap).map_err(StreamEnd::Diverged)?;
                    info!(
                        seq = l.seq(),
                        epoch = l.epoch(),
                        nodes = l.nodes().len(),
                        "ledger replica loaded a snapshot"
                    );
                    self.metrics.seq.set(l.seq() as i64);
                    self.applied.send_replace(l.seq());
                    *max_epoch = l.epoch();
                    g.chain = Some(Chain::resume(l.seq(), &snap.chain_hash));
                    // The placement defaults come before the first snapshot: learn the
                    // workload's hosts now that the nodes are known.
                    if let Some(w) = g.defaults.workload.take() {
                        let w = Workload::clone(&w).on_cluster(l.nodes().values());
                        g.defaults.workload = Some(Arc::new(w));
                    }
                    g.ledger = Some(l);
                }
                Some(Body::Batch(b)) => {
                    let Inner { ledger, chain, .. } = &mut *g;
                    let (Some(l), Some(chain)) = (ledger.as_mut(), chain.as_mut()) else {
                        return Err(StreamEnd::Diverged("a batch before any snapshot".into()));
                    };
                    fold_batch(l, chain, b)?;
                    *max_epoch = l.epoch();
                    self.metrics.seq.set(l.seq() as i64);
                    self.applied.send_replace(l.seq());
                }
                Some(Body::Heartbeat(h)) => {
                    let seq = g.ledger.as_ref().map_or(0, Ledger::seq);
                    self.metrics.lag.set(h.seq.saturating_sub(seq) as i64);
                }
                None => {}
            }
        }
    }
}

/// Fold `b` onto `l` if it chains onto `chain`; a batch wholly at or below the replica's seq is
/// a repeat and skipped. The link is checked against the hash of the batch's own bytes (as the
/// allocator stored them), so an allocator that hands on a batch changed after it was read
/// cannot pass it off with the stored hash.
fn fold_batch(l: &mut Ledger, chain: &mut Chain, mut b: pb::EventBatch) -> Result<(), StreamEnd> {
    let last = b.events.last().map_or(0, |e| e.seq);
    if last <= l.seq() {
        return Ok(());
    }
    if b.first_seq <= l.seq() {
        return Err(StreamEnd::Diverged(format!(
            "the batch at seq {}..{last} straddles the replica's seq {}",
            b.first_seq,
            l.seq()
        )));
    }
    let stamped = b.stored.take();
    let hash = hash_stored(&b.encode_to_vec());
    let at = stamped.as_ref().map_or("", |s| s.location.as_str());
    if let Some(s) = &stamped
        && !s.hash.is_empty()
        && s.hash != hash
    {
        return Err(StreamEnd::ChainBroken(format!(
            "the batch at seq {} ({at}) hashes to {} but was stamped {}: changed after it was read",
            b.first_seq,
            short_hex(&hash),
            short_hex(&s.hash)
        )));
    }
    chain
        .link(&b, hash)
        .map_err(|e| StreamEnd::ChainBroken(format!("{e} ({at})")))?;
    // The fold checks what a follower checks: seq gapless, epoch never lower.
    for ev in &b.events {
        l.apply(ev)
            .map_err(|e| StreamEnd::Diverged(format!("event {} does not fold: {e}", ev.seq)))?;
    }
    Ok(())
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
