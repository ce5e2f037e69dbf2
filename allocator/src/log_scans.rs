//! Bounds on `ReadLog` scans of the history: each page of one is read, decoded, hashed and
//! encoded by the leader, so a loop of scans from seq 1 costs CPU in proportion to the log.
//! At most `--max-log-scans` run at once (past it `RESOURCE_EXHAUSTED`, never a queue), and
//! each holder of an identity streams at most `--log-scan-events-per-s` events a second over
//! all its scans, pages from the archive and from etcd alike. Allocators and the extender are
//! held to neither: their reads are part of keeping the ledger and scheduling.

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};
use gpuledger_auth::identity::{Holder, Role};
use gpuledger_auth::limit::{Bites, Slot, Slots, wait_turn};
use gpuledger_auth::server::over_limit;
use prometheus_client::metrics::gauge::Gauge;
use tonic::Status;

/// The limit name its refusals are counted under.
pub const BITE_LOG_SCANS: &str = "log_scans";

/// Holders remembered before those that have not scanned lately are forgotten.
const MAX_KEYS: usize = 10_000;

/// The scans in flight and each holder's pace.
pub struct LogScans {
    max: usize,
    events_per_s: u32,
    slots: Arc<Slots<()>>,
    limiter: Option<Arc<DefaultKeyedRateLimiter<Holder>>>,
    in_flight: Gauge,
}

/// One scan in flight: its slot (given back when dropped) and its holder's pace.
pub struct Scan {
    _slot: Option<Slot<()>>,
    pace: Option<(Arc<DefaultKeyedRateLimiter<Holder>>, Holder, NonZeroU32)>,
    in_flight: Gauge,
}

impl LogScans {
    /// At most `max` scans at once (0: no bound), `events_per_s` events a second per holder,
    /// a second's worth at once (0: no pace); refusals counted in `bites`, scans in flight in
    /// `in_flight`.
    pub fn new(max: usize, events_per_s: u32, bites: Arc<Bites>, in_flight: Gauge) -> Self {
        let limiter = NonZeroU32::new(events_per_s)
            .map(|rate| Arc::new(RateLimiter::keyed(Quota::per_second(rate))));
        LogScans {
            max,
            events_per_s,
            slots: Slots::new((BITE_LOG_SCANS, BITE_LOG_SCANS), max, 0, bites),
            limiter,
            in_flight,
        }
    }

    /// No bounds.
    pub fn unlimited(bites: Arc<Bites>) -> Self {
        LogScans::new(0, 0, bites, Gauge::default())
    }

    /// A scan for `caller` (None: an unverified caller, which authorization refuses anyway),
    /// or `RESOURCE_EXHAUSTED` when `--max-log-scans` run already.
    pub fn start(&self, caller: Option<Holder>) -> Result<Scan, Status> {
        let held = caller
            .as_ref()
            .is_some_and(|c| !matches!(c.caller.role, Role::Allocator | Role::Extender));
        let slot = if held {
            let slot = self.slots.try_acquire(()).map_err(|_| {
                over_limit(
                    Status::resource_exhausted(format!(
                        "{} log scans run already, as many as this allocator allows at once \
                         (--max-log-scans); retry later",
                        self.max
                    )),
                    BITE_LOG_SCANS,
                )
            })?;
            Some(slot)
        } else {
            None
        };
        let pace = match (&self.limiter, caller) {
            (Some(l), Some(c)) if held => {
                if l.len() > MAX_KEYS {
                    l.retain_recent();
                }
                let burst = NonZeroU32::new(self.events_per_s).expect("a limiter has a rate");
                Some((l.clone(), c, burst))
            }
            _ => None,
        };
        self.in_flight.inc();
        Ok(Scan {
            _slot: slot,
            pace,
            in_flight: self.in_flight.clone(),
        })
    }
}

impl Scan {
    /// Wait until this scan's holder may stream `events` more events, however long that
    /// takes: its client waits for them anyway, and the scan holds one of the few slots.
    pub async fn pace(&self, events: usize) {
        let Some((limiter, holder, burst)) = &self.pace else {
            return;
        };
        let clock = DefaultClock::default();
        let mut left = u32::try_from(events).unwrap_or(u32::MAX);
        while let Some(n) = NonZeroU32::new(left.min(burst.get())) {
            let turn = || match limiter.check_key_n(holder, n) {
                Ok(Ok(())) => None,
                Ok(Err(not_until)) => Some(not_until.wait_time_from(clock.now())),
                // Never more than the burst at once; should it be, let it pass.
                Err(_) => None,
            };
            let _ = wait_turn(turn, Duration::MAX).await;
            left -= n.get();
        }
    }
}

impl Drop for Scan {
    fn drop(&mut self) {
        self.in_flight.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holder(role: Role, instance: &str) -> Holder {
        Holder {
            caller: gpuledger_auth::identity::Caller {
                role,
                subject: "system:serviceaccount:x:dashboards".into(),
            },
            instance: instance.into(),
        }
    }

    #[test]
    fn past_the_bound_scans_are_refused_and_counted_until_one_ends() {
        let bites = Bites::new();
        let gauge = Gauge::default();
        let scans = LogScans::new(2, 0, bites.clone(), gauge.clone());
        let viewer = || Some(holder(Role::Viewer, "token:1"));
        let (a, _b) = (
            scans.start(viewer()).unwrap(),
            scans.start(viewer()).unwrap(),
        );
        let refused = scans.start(viewer()).err().expect("a third scan");
        assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
        assert_eq!(bites.count(BITE_LOG_SCANS), 1);
        // A replica's own reads are not held to it.
        let _own = scans.start(Some(holder(Role::Allocator, "cert"))).unwrap();
        assert_eq!(gauge.get(), 3);
        drop(a);
        assert_eq!(gauge.get(), 2);
        scans.start(viewer()).unwrap();
    }

    #[tokio::test]
    async fn a_holders_scans_share_its_events_per_second() {
        let scans = LogScans::new(0, 1_000, Bites::new(), Gauge::default());
        let (one, two) = (
            scans.start(Some(holder(Role::Viewer, "token:1"))).unwrap(),
            scans.start(Some(holder(Role::Viewer, "token:1"))).unwrap(),
        );
        let t = std::time::Instant::now();
        // A second's worth at once, then the rate: 1,500 more take 1.5 s, in pages larger
        // than the burst too.
        one.pace(1_000).await;
        assert!(
            t.elapsed() < Duration::from_millis(300),
            "{:?}",
            t.elapsed()
        );
        one.pace(1_200).await;
        two.pace(300).await;
        assert!(
            t.elapsed() >= Duration::from_millis(1_300),
            "{:?}",
            t.elapsed()
        );
        // Another holder has its own.
        let t = std::time::Instant::now();
        let other = scans.start(Some(holder(Role::Viewer, "token:2"))).unwrap();
        other.pace(1_000).await;
        assert!(
            t.elapsed() < Duration::from_millis(300),
            "{:?}",
            t.elapsed()
        );
    }
}
