//! When an unbound reservation expires, decided on this replica's monotonic clock.
//!
//! A reservation's deadline is a wall-clock time written by the leader that reserved it. A
//! later leader whose wall clock runs ahead would find every fresh reservation already past
//! it and release GPUs of pods that are being bound; one whose clock runs behind would hold
//! them for as long as it lags. So only the reservation's TTL is read from the ledger (its
//! deadline minus its reserved time, both of one leader's clock), and it runs on the monotonic
//! clock of the replica deciding, from when that replica first saw the reservation: never
//! early, whatever the clocks say; after a failover at most one TTL late.

use std::collections::HashMap;
use std::time::Duration;

use tokio::time::Instant;

/// A reservation younger than this (by this replica's clock) may be missing from the pod cache
/// because the watch has not delivered its pod yet.
pub const YOUNG: Duration = Duration::from_secs(5);

/// When this replica first saw each reservation.
#[derive(Debug, Default)]
pub struct Expiry {
    seen: HashMap<u64, Instant>,
}

impl Expiry {
    /// Whether reservation `id`, reserved at `reserved_ms` until `deadline_ms` (one leader's
    /// wall clock), has waited its TTL at `now`, counted from when this replica first saw it.
    pub fn expired(&mut self, id: u64, reserved_ms: i64, deadline_ms: i64, now: Instant) -> bool {
        let ttl = Duration::from_millis(
            u64::try_from(deadline_ms.saturating_sub(reserved_ms)).unwrap_or(0),
        );
        now.saturating_duration_since(self.first_seen(id, now)) >= ttl
    }

    /// Whether reservation `id` was first seen less than [`YOUNG`] before `now`.
    pub fn young(&mut self, id: u64, now: Instant) -> bool {
        now.saturating_duration_since(self.first_seen(id, now)) < YOUNG
    }

    /// Forget every reservation but those `held` says are still held.
    pub fn retain(&mut self, held: impl Fn(u64) -> bool) {
        self.seen.retain(|id, _| held(*id));
    }

    fn first_seen(&mut self, id: u64, now: Instant) -> Instant {
        *self.seen.entry(id).or_insert(now)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use gpuledger_ops::clock::{Clock, TestClock};

    use super::*;

    const TTL_MS: i64 = 60_000;
    const T0: i64 = 1_700_000_000_000;

    /// Leader A (its clock at `T0`) reserves; leader B, whose wall clock differs from A's by
    /// `skew_ms`, takes over at once and checks every second. When B expires it, in seconds
    /// after the takeover.
    fn expires_after_takeover(skew_ms: i64) -> u64 {
        let a = TestClock::new(T0);
        let (reserved_ms, deadline_ms) = (a.now_ms(), a.now_ms() + TTL_MS);
        let b = Arc::new(TestClock::new(T0 + skew_ms));
        let mut expiry = Expiry::default();
        let start = b.now();
        (0..=600)
            .find(|s| {
                let now = start + Duration::from_secs(*s);
                expiry.expired(7, reserved_ms, deadline_ms, now)
            })
            .expect("expires within ten minutes")
    }

    #[tokio::test(start_paused = true)]
    async fn a_leader_whose_clock_runs_ahead_expires_nothing_early() {
        // Ten minutes ahead: by its wall clock the reservation expired long ago.
        assert_eq!(expires_after_takeover(600_000), 60);
    }

    #[tokio::test(start_paused = true)]
    async fn a_leader_whose_clock_runs_behind_holds_nothing_for_longer() {
        // Ten minutes behind: by its wall clock the reservation has eleven minutes to go.
        assert_eq!(expires_after_takeover(-600_000), 60);
    }

    #[tokio::test(start_paused = true)]
    async fn the_reserving_leader_expires_on_time_and_young_ends_after_five_seconds() {
        let clock = TestClock::new(T0);
        let mut e = Expiry::default();
        let t = clock.now();
        let (r, d) = (clock.now_ms(), clock.now_ms() + TTL_MS);
        assert!(!e.expired(1, r, d, t));
        assert!(e.young(1, t + Duration::from_secs(4)));
        assert!(!e.young(1, t + Duration::from_secs(5)));
        assert!(!e.expired(1, r, d, t + Duration::from_millis(59_999)));
        assert!(e.expired(1, r, d, t + Duration::from_secs(60)));
        // A deadline before its reservation (a corrupt value) expires at once, not never.
        assert!(e.expired(2, r, r - 5, t));
        e.retain(|id| id == 2);
        assert!(
            !e.expired(1, r, d, t + Duration::from_secs(61)),
            "forgotten: seen anew"
        );
    }
}
