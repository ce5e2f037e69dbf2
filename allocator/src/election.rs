//! Leader election through etcd: a lease kept alive on a timer, and a campaign on it.
//!
//! The epoch of a leader is its election key's create_revision: unique and increasing across
//! the cluster. A lease alone is not mutual exclusion; every write is also fenced on the epoch
//! (see `log.rs`). The session also keeps a conservative local deadline: the lease cannot have
//! been renewed past `sent + ttl` of the last acknowledged keep-alive, so once that passes the
//! leader stops granting without waiting for etcd to say so.
//!
//! The lease's local deadlines are tokio instants — the monotonic reading of
//! [`gpuledger_ops::clock::Clock`] — so a test runtime with paused time drives them.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use backon::Retryable;
use etcd_client::{Client, LeaderKey};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::{CancellationToken, DropGuard};
use tracing::{info, warn};

/// What this process knows of its lease: until when it may still be valid, and whether the
/// keep-alive gave up. Every clone sees the renewals.
#[derive(Debug, Clone)]
pub struct Lease {
    deadline: watch::Receiver<Instant>,
    lost: Arc<AtomicBool>,
}

/// The side of a [`Lease`] that renews it; dropping it loses the lease.
#[derive(Debug)]
pub struct LeaseKeeper {
    deadline: watch::Sender<Instant>,
    lost: Arc<AtomicBool>,
}

/// A lease valid until `until` as far as this process knows, and its keeper.
pub fn lease(until: Instant) -> (LeaseKeeper, Lease) {
    let (tx, rx) = watch::channel(until);
    let lost = Arc::new(AtomicBool::new(false));
    (
        LeaseKeeper {
            deadline: tx,
            lost: lost.clone(),
        },
        Lease { deadline: rx, lost },
    )
}

impl LeaseKeeper {
    /// The lease was renewed: it cannot expire before `until`.
    pub fn renew(&self, until: Instant) {
        self.deadline.send_replace(until);
    }

    /// Until when the lease is valid now.
    pub fn deadline(&self) -> Instant {
        *self.deadline.borrow()
    }
}

impl Drop for LeaseKeeper {
    fn drop(&mut self) {
        // Before the sender goes: a waiter woken by the drop must see the loss.
        self.lost.store(true, Ordering::SeqCst);
    }
}

impl Lease {
    /// Whether the lease may still be valid (local conservative view).
    pub fn alive(&self) -> bool {
        !self.lost.load(Ordering::SeqCst) && Instant::now() < *self.deadline.borrow()
    }

    /// Time left before the lease may have expired.
    pub fn remaining(&self) -> Duration {
        self.deadline
            .borrow()
            .saturating_duration_since(Instant::now())
    }

    /// Resolves when the lease is (or may be) gone.
    pub async fn lost(&self) {
        let mut rx = self.deadline.clone();
        loop {
            if self.lost.load(Ordering::SeqCst) {
                return;
            }
            let d = *rx.borrow_and_update();
            tokio::select! {
                _ = tokio::time::sleep_until(d) => {
                    if Instant::now() >= *rx.borrow() {
                        return;
                    }
                }
                r = rx.changed() => {
                    if r.is_err() {
                        return;
                    }
                }
            }
        }
    }
}

/// A lease kept alive in the background.
pub struct Session {
    /// The lease id.
    pub lease_id: i64,
    /// The lease TTL.
    pub ttl: Duration,
    lease: Lease,
    /// Ends the keep-alive when the session goes.
    _keep_alive: DropGuard,
}

impl Session {
    /// Grant a lease of `ttl` and keep it alive every `ttl / 3`.
    pub async fn start(client: &Client, ttl: Duration) -> Result<Session, etcd_client::Error> {
        let mut lease_client = client.lease_client();
        let sent = Instant::now();
        let ttl_s = ttl.as_secs().max(1) as i64;
        let grant = tokio::time::timeout(ttl, lease_client.grant(ttl_s, None))
            .await
            .map_err(|_| {
                etcd_client::Error::LeaseKeepAliveError("lease grant timed out".into())
            })??;
        let lease_id = grant.id();
        let granted_ttl = Duration::from_secs(grant.ttl().max(1) as u64);
        let (keeper, lease) = lease(sent + granted_ttl);
        let client = client.clone();
        let stop = CancellationToken::new();
        tokio::spawn(stop.clone().run_until_cancelled_owned(keep_alive(
            client,
            lease_id,
            granted_ttl,
            keeper,
        )));
        Ok(Session {
            lease_id,
            ttl: granted_ttl,
            lease,
            _keep_alive: stop.drop_guard(),
        })
    }

    /// The lease as this process knows it.
    pub fn lease(&self) -> &Lease {
        &self.lease
    }

    /// Whether the lease may still be valid (local conservative view).
    pub fn alive(&self) -> bool {
        self.lease.alive()
    }

    /// Time left before the lease may have expired.
    pub fn remaining(&self) -> Duration {
        self.lease.remaining()
    }

    /// Resolves when the lease is (or may be) gone.
    pub async fn lost(&self) {
        self.lease.lost().await
    }

    /// Stop keeping the lease alive and revoke it (deletes the election key at once, so a
    /// follower takes over without waiting for the TTL).
    pub async fn revoke(self, client: &Client) {
        let lease_id = self.lease_id;
        drop(self);
        let mut lease = client.lease_client();
        match tokio::time::timeout(Duration::from_secs(1), lease.revoke(lease_id)).await {
            Ok(Ok(_)) => info!(lease = lease_id, "lease revoked"),
            Ok(Err(e)) => {
                warn!(lease = lease_id, error = %e, "lease revoke failed; it expires by itself")
            }
            Err(_) => warn!(
                lease = lease_id,
                "lease revoke timed out; it expires by itself"
            ),
        }
    }
}

/// What one keep-alive round leads to.
#[derive(Debug, PartialEq, Eq)]
enum Round {
    /// etcd renewed the lease: it cannot expire before this.
    Renewed(Instant),
    /// etcd says the lease is gone.
    Expired,
    /// No answer, but the lease may still be valid: open the stream again.
    Reopen,
    /// No answer, and the lease may have expired already.
    Lost,
}

/// The round whose keep-alive was sent at `sent` and answered with `answer` (the seconds etcd
/// says the lease has left; None: no answer in time, or the stream failed), judged at `now`
/// against the lease's `deadline`. A renewal counts from when the keep-alive was sent, not
/// from when the answer came: the lease cannot have been renewed past `sent + ttl`.
fn after_round(sent: Instant, answer: Option<i64>, deadline: Instant, now: Instant) -> Round {
    match answer {
        Some(ttl) if ttl > 0 => Round::Renewed(sent + Duration::from_secs(ttl as u64)),
        Some(_) => Round::Expired,
        None if now >= deadline => Round::Lost,
        None => Round::Reopen,
    }
}

async fn keep_alive(client: Client, id: i64, ttl: Duration, keeper: LeaseKeeper) {
    let every = ttl / 3;
    let lease = client.lease_client();
    'outer: loop {
        // (Re)open the keep-alive stream, while the lease may still be valid.
        let open = (|| {
            let mut lease = lease.clone();
            async move { lease.keep_alive(id).await }
        })
        .retry(crate::retry::forever(Duration::from_millis(100)))
        .when(|_| Instant::now() < keeper.deadline())
        .notify(|e, _| warn!(lease = id, error = %e, "lease keep-alive stream failed"));
        let Ok((mut keeper_tx, mut stream)) = open.await else {
            return;
        };
        loop {
            let sent = Instant::now();
            let ok = async {
                keeper_tx.keep_alive().await?;
                stream.message().await
            };
            let answer = match tokio::time::timeout(every, ok).await {
                Ok(Ok(Some(resp))) => Some(resp.ttl()),
                Ok(Ok(None)) | Ok(Err(_)) | Err(_) => None,
            };
            match after_round(sent, answer, keeper.deadline(), Instant::now()) {
                Round::Renewed(until) => keeper.renew(until),
                Round::Expired => {
                    warn!(lease = id, "lease expired (etcd answered ttl 0)");
                    return;
                }
                Round::Lost => {
                    warn!(lease = id, "lease keep-alive failed past the deadline");
                    return;
                }
                Round::Reopen => continue 'outer,
            }
            let next = sent + every;
            tokio::time::sleep_until(next).await;
        }
    }
}

/// Campaign for leadership with `value` (our advertised address). Blocks until elected.
/// Returns the leader key; its `rev()` is the epoch.
pub async fn campaign(
    client: &Client,
    name: &str,
    value: &str,
    lease_id: i64,
) -> Result<LeaderKey, etcd_client::Error> {
    let mut el = client.election_client();
    let mut resp = el.campaign(name, value, lease_id).await?;
    resp.take_leader().ok_or_else(|| {
        etcd_client::Error::ElectError("campaign answered without a leader key".into())
    })
}

/// Revoke the leases of this replica's earlier processes: the candidacy keys of election
/// `name` whose value is `value` (this replica's advertised address) on a lease other than
/// `own`. A replica that crashed and is restarted at once (a container restart keeps the pod's
/// address) so hands its dead self's leadership on now rather than when the lease's TTL runs
/// out. Only an earlier process can hold such a key: this one has bound the address's
/// listener, and replicas advertise addresses of their own. Were one still alive, fencing on
/// the epoch would keep its writes out all the same. Returns how many were revoked; an etcd
/// that cannot answer leaves the old leases to expire.
pub async fn revoke_earlier_selves(client: &Client, name: &str, value: &str, own: i64) -> usize {
    let prefix = format!("{name}/");
    let mut kv = client.kv_client();
    let opts = etcd_client::GetOptions::new().with_prefix();
    let listed = tokio::time::timeout(Duration::from_secs(1), kv.get(prefix, Some(opts))).await;
    let Ok(Ok(resp)) = listed else {
        return 0;
    };
    let stale: Vec<(i64, i64)> = resp
        .kvs()
        .iter()
        .filter(|k| k.value() == value.as_bytes() && k.lease() != 0 && k.lease() != own)
        .map(|k| (k.lease(), k.create_revision()))
        .collect();
    let leader = resp.kvs().iter().map(|k| k.create_revision()).min();
    let mut lease = client.lease_client();
    let mut n = 0;
    for (id, rev) in stale {
        match tokio::time::timeout(Duration::from_secs(1), lease.revoke(id)).await {
            Ok(Ok(_)) => {
                n += 1;
                let led = Some(rev) == leader;
                warn!(
                    lease = id,
                    epoch = rev,
                    led,
                    address = value,
                    "revoked the election lease of an earlier process of this replica (it crashed): {}",
                    if led {
                        "it led, so the election moves on now instead of after the lease's TTL"
                    } else {
                        "it was a candidate"
                    }
                );
            }
            Ok(Err(e)) => {
                warn!(lease = id, error = %e, "revoking an earlier process's lease failed; it expires by itself")
            }
            Err(_) => warn!(
                lease = id,
                "revoking an earlier process's lease timed out; it expires by itself"
            ),
        }
    }
    n
}

/// The current leader's value (address) and epoch, if any.
pub async fn current_leader(client: &Client, name: &str) -> Option<(String, i64)> {
    let mut el = client.election_client();
    match tokio::time::timeout(Duration::from_secs(1), el.leader(name)).await {
        Ok(Ok(resp)) => resp.kv().map(|kv| {
            (
                String::from_utf8_lossy(kv.value()).into_owned(),
                kv.create_revision(),
            )
        }),
        _ => None,
    }
}

#[cfg(test)]
mod tests;
