//! Bounds on `ReadLog` scans of the history: each page of one is read, decoded, hashed and
//! encoded by the leader, so a loop of scans from seq 1 costs CPU in proportion to the log.
//! At most `--max-log-scans` run at once, at most `--max-log-scans-per-holder` of them one
//! holder's (past either `RESOURCE_EXHAUSTED`, never a queue: one viewer token cannot take
//! every slot from the other operators), and each holder of an identity streams at most `--log-scan-events-per-s` events a second over
//! all its scans, pages from the archive and from etcd alike. Allocators and the extender are
//! held to neither: their reads are part of keeping the ledger and scheduling.

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
use governor::{DefaultDirectRateLimiter, DefaultKeyedRateLimiter, Quota, RateLimiter};
use gpuledger_auth::identity::{Holder, Role};
use gpuledger_auth::limit::{Bites, Full, Slot, Slots, wait_turn};
use gpuledger_auth::server::over_limit;
use prometheus_client::metrics::gauge::Gauge;
use tonic::Status;

/// The limit name of refusals for want of a scan slot.
pub const BITE_LOG_SCANS: &str = "log_scans";
/// The limit name of refusals of a holder who runs as many scans as one may.
pub const BITE_LOG_SCANS_PER_HOLDER: &str = "log_scans_per_holder";

/// How many scans may run and how fast they stream (0: no bound).
#[derive(Debug, Clone, Copy, Default)]
pub struct ScanBounds {
    /// Scans at once, of every holder together.
    pub max: usize,
    /// Scans at once of one holder.
    pub per_holder: usize,
    /// Events a second one holder's scans stream together, a second's worth at once.
    pub events_per_s: u32,
    /// Events a second every holder's scans stream together, a second's worth at once: what
    /// many holders' scans cost the leader at most, whoever holds them.
    pub total_events_per_s: u32,
}

/// Holders remembered before those that have not scanned lately are forgotten.
const MAX_KEYS: usize = 10_000;

/// The scans in flight and each holder's pace.
pub struct LogScans {
    bounds: ScanBounds,
    slots: Arc<Slots<Holder>>,
    limiter: Option<Arc<DefaultKeyedRateLimiter<Holder>>>,
    total: Option<Arc<DefaultDirectRateLimiter>>,
    in_flight: Gauge,
}

/// One scan in flight: its slot (given back when dropped), its holder's pace and the pace of
/// all scans.
pub struct Scan {
    _slot: Option<Slot<Holder>>,
    pace: Option<(Arc<DefaultKeyedRateLimiter<Holder>>, Holder, NonZeroU32)>,
    total: Option<(Arc<DefaultDirectRateLimiter>, NonZeroU32)>,
    in_flight: Gauge,
}

impl LogScans {
    /// Scans within `bounds`; refusals counted in `bites`, scans in flight in `in_flight`.
    pub fn new(bounds: ScanBounds, bites: Arc<Bites>, in_flight: Gauge) -> Self {
        let limiter = NonZeroU32::new(bounds.events_per_s)
            .map(|rate| Arc::new(RateLimiter::keyed(Quota::per_second(rate))));
        let total = NonZeroU32::new(bounds.total_events_per_s)
            .map(|rate| Arc::new(RateLimiter::direct(Quota::per_second(rate))));
        LogScans {
            bounds,
            slots: Slots::new(
                (BITE_LOG_SCANS, BITE_LOG_SCANS_PER_HOLDER),
                bounds.max,
                bounds.per_holder,
                bites,
            ),
            limiter,
            total,
            in_flight,
        }
    }

    /// No bounds.
    pub fn unlimited(bites: Arc<Bites>) -> Self {
        LogScans::new(ScanBounds::default(), bites, Gauge::default())
    }

    /// A scan for `caller` (None: an unverified caller, which authorization refuses anyway),
    /// or `RESOURCE_EXHAUSTED` when `--max-log-scans` run already, or the caller's holder runs
    /// `--max-log-scans-per-holder`.
    pub fn start(&self, caller: Option<Holder>) -> Result<Scan, Status> {
        let held = caller
            .as_ref()
            .filter(|c| !matches!(c.caller.role, Role::Allocator | Role::Extender));
        let slot = match held {
            Some(h) => Some(self.slots.try_acquire(h.clone()).map_err(|full| {
                let (why, limit) = match full {
                    Full::Total => (
                        format!(
                            "{} log scans run already, as many as this allocator allows at \
                             once (--max-log-scans); retry later",
                            self.bounds.max
                        ),
                        BITE_LOG_SCANS,
                    ),
                    Full::PerKey => (
                        format!(
                            "this caller runs {} log scans already, as many as one may at once \
                             (--max-log-scans-per-holder); let one end first",
                            self.bounds.per_holder
                        ),
                        BITE_LOG_SCANS_PER_HOLDER,
                    ),
                };
                over_limit(Status::resource_exhausted(why), limit)
            })?),
            None => None,
        };
        let pace = match (&self.limiter, caller) {
            (Some(l), Some(c)) if slot.is_some() => {
                if l.len() > MAX_KEYS {
                    l.retain_recent();
                }
                let burst =
                    NonZeroU32::new(self.bounds.events_per_s).expect("a limiter has a rate");
                Some((l.clone(), c, burst))
            }
            _ => None,
        };
        let total = match &self.total {
            Some(t) if slot.is_some() => {
                NonZeroU32::new(self.bounds.total_events_per_s).map(|burst| (t.clone(), burst))
            }
            _ => None,
        };
        self.in_flight.inc();
        Ok(Scan {
            _slot: slot,
            pace,
            total,
            in_flight: self.in_flight.clone(),
        })
    }
}

impl Scan {
    /// Wait until this scan's holder, and all scans together, may stream `events` more events,
    /// however long that takes: its client waits for them anyway, and the scan holds one of the
    /// few slots.
    pub async fn pace(&self, events: usize) {
        let clock = DefaultClock::default();
        let burst = [
            self.pace.as_ref().map(|p| p.2),
            self.total.as_ref().map(|t| t.1),
        ]
        .into_iter()
        .flatten()
        .min();
        let Some(burst) = burst else {
            return;
        };
        let mut left = u32::try_from(events).unwrap_or(u32::MAX);
        while let Some(n) = NonZeroU32::new(left.min(burst.get())) {
            if let Some((limiter, holder, _)) = &self.pace {
                let turn = || match limiter.check_key_n(holder, n) {
                    Ok(Ok(())) => None,
                    Ok(Err(not_until)) => Some(not_until.wait_time_from(clock.now())),
                    // Never more than the burst at once; should it be, let it pass.
                    Err(_) => None,
                };
                let _ = wait_turn(turn, Duration::MAX).await;
            }
            if let Some((limiter, _)) = &self.total {
                let turn = || match limiter.check_n(n) {
                    Ok(Ok(())) => None,
                    Ok(Err(not_until)) => Some(not_until.wait_time_from(clock.now())),
                    Err(_) => None,
                };
                let _ = wait_turn(turn, Duration::MAX).await;
            }
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
        let bounds = ScanBounds {
            max: 2,
            ..ScanBounds::default()
        };
        let scans = LogScans::new(bounds, bites.clone(), gauge.clone());
        let viewer = || Some(holder(Role::Viewer, "token:1"));
        let (a, _b) = (
            scans.start(viewer()).unwrap(),
            scans.start(Some(holder(Role::Viewer, "token:2"))).unwrap(),
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
        let bounds = ScanBounds {
            events_per_s: 1_000,
            ..ScanBounds::default()
        };
        let scans = LogScans::new(bounds, Bites::new(), Gauge::default());
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

    #[test]
    fn one_holder_cannot_take_every_slot() {
        let bites = Bites::new();
        let bounds = ScanBounds {
            max: 8,
            per_holder: 2,
            events_per_s: 0,
            total_events_per_s: 0,
        };
        let scans = LogScans::new(bounds, bites.clone(), Gauge::default());
        let one = || Some(holder(Role::Viewer, "token:1"));
        let _held = [scans.start(one()).unwrap(), scans.start(one()).unwrap()];
        let refused = scans
            .start(one())
            .err()
            .expect("a third scan of one holder");
        assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
        assert!(refused.message().contains("--max-log-scans-per-holder"));
        assert_eq!(bites.count(BITE_LOG_SCANS_PER_HOLDER), 1);
        // Another holder of the same identity (another token) still scans.
        scans.start(Some(holder(Role::Viewer, "token:2"))).unwrap();
    }

    #[tokio::test]
    async fn all_holders_share_the_total_pace() {
        let bounds = ScanBounds {
            total_events_per_s: 1_000,
            ..ScanBounds::default()
        };
        let scans = LogScans::new(bounds, Bites::new(), Gauge::default());
        let (one, two) = (
            scans.start(Some(holder(Role::Viewer, "token:1"))).unwrap(),
            scans.start(Some(holder(Role::Viewer, "token:2"))).unwrap(),
        );
        let t = std::time::Instant::now();
        // A second's worth at once for both together, then the total rate.
        one.pace(600).await;
        two.pace(400).await;
        assert!(
            t.elapsed() < Duration::from_millis(300),
            "{:?}",
            t.elapsed()
        );
        two.pace(500).await;
        assert!(
            t.elapsed() >= Duration::from_millis(400),
            "{:?}",
            t.elapsed()
        );
        // A replica's own reads are not held to it.
        let t = std::time::Instant::now();
        let own = scans.start(Some(holder(Role::Allocator, "cert"))).unwrap();
        own.pace(5_000).await;
        assert!(
            t.elapsed() < Duration::from_millis(100),
            "{:?}",
            t.elapsed()
        );
    }
}
