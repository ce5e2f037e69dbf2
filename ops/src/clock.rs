//! Time as a component's decisions see it, injected so that tests control it.
//!
//! Two readings, because they answer different questions: wall-clock milliseconds go into
//! what is stored and compared across machines (event timestamps, reservation deadlines in the
//! ledger), and a monotonic instant measures local waits (lingers, grace periods). The instant
//! is tokio's, so `tokio::time::sleep_until` takes it and a test runtime started with
//! `start_paused = true` moves it deterministically.

use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use tokio::time::Instant;

/// A source of wall-clock and monotonic time.
pub trait Clock: Send + Sync + std::fmt::Debug {
    /// Milliseconds since the Unix epoch, for timestamps and deadlines other machines read.
    fn now_ms(&self) -> i64;
    /// Monotonic now, for local deadlines.
    fn now(&self) -> Instant;
}

/// The machine's clocks.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> i64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
    }

    fn now(&self) -> Instant {
        Instant::now()
    }
}

/// A clock for tests: wall time starts at a chosen value and then moves with tokio's time
/// (paused in a `start_paused` test, so `tokio::time::advance` moves both readings together);
/// [`TestClock::jump`] moves the wall clock alone, as an NTP step would.
#[derive(Debug)]
pub struct TestClock {
    origin: Instant,
    origin_ms: AtomicI64,
}

impl TestClock {
    /// A clock whose wall time reads `start_ms` now.
    pub fn new(start_ms: i64) -> Self {
        TestClock {
            origin: Instant::now(),
            origin_ms: AtomicI64::new(start_ms),
        }
    }

    /// Move the wall clock by `ms` (negative: backwards) without moving monotonic time.
    pub fn jump(&self, ms: i64) {
        self.origin_ms.fetch_add(ms, Ordering::SeqCst);
    }
}

impl Clock for TestClock {
    fn now_ms(&self) -> i64 {
        let elapsed = i64::try_from(self.origin.elapsed().as_millis()).unwrap_or(i64::MAX);
        self.origin_ms
            .load(Ordering::SeqCst)
            .saturating_add(elapsed)
    }

    fn now(&self) -> Instant {
        Instant::now()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // How the test clock follows paused tokio time is tested where tokio's test-util is on
    // (the allocator's leader tests); here, what holds with the real clock.
    #[test]
    fn the_test_clock_starts_where_asked_and_jumps_on_request() {
        let c = TestClock::new(1_000);
        let t0 = c.now();
        let a = c.now_ms();
        assert!((1_000..2_000).contains(&a), "{a}");
        c.jump(-5_000);
        let b = c.now_ms();
        assert!((-5_000..-3_000).contains(&(b - a)), "{a} -> {b}");
        assert!(c.now() >= t0, "monotonic time never goes back");
    }

    #[test]
    fn the_system_clock_reads_the_wall_clock() {
        let before = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis())
            .unwrap_or(0);
        let now = SystemClock.now_ms();
        assert!(now as u128 >= before && now > 1_600_000_000_000, "{now}");
    }
}
